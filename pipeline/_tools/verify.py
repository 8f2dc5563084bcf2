"""``packstream verify``: re-check a whole output folder from its files alone.

Pure functions that fill a :class:`Report` with :class:`Problem` s, each naming where (shard,
row, sequence, example id, input record, or the manifest key) and what (the check, expected vs
got). Nothing in the folder is trusted:

* **The manifest.** Only a complete ``manifest.json`` is read, through the checked open and the typed
  reader (:mod:`packers.manifest`): a folder without one (a run still writing, a killed run, not
  packstream's), with ``"status": "failed"``, or with one that is not a regular file, too big, too
  deep or of the wrong types is a problem that says so, and nothing else is opened. Every place the
  manifest contradicts itself (:func:`packers.manifest.inconsistencies`) is a problem of its own.
* **Files.** Exactly the shards the manifest lists are opened (train and validation), only by
  the names the contract allows, only inside the folder. Every other ``*.arrow``/``*.parquet``
  is reported by name (a stray copy, another run's shard), and so are ``.tmp-*`` leftovers and
  a leftover ``.packstream.lock``. Each shard's size and sha256 must equal the manifest's, and
  every file the manifest lists must exist.
* **Schema.** Read with pyarrow's IPC or Parquet reader (no pickle anywhere): the schema equals
  :data:`packers.SCHEMA`, the metadata (:func:`packers.read_metadata`) equals what the manifest
  implies (:func:`packers.manifest.expected_metadata`: the run's, and the shard's own run id, split,
  index and count), and no column holds nulls.
* **Rows.** :func:`packers.validate_row` (budget, lengths, offsets from 0 to ``len`` and strictly
  increasing), loss_mask values only 0 or 1, ``num_targets``, the pair columns (empty, or in a run of
  pairs: whole pairs, chosen first, one prompt per pair, loss_mask exactly on the completion spans),
  and the manifest's ``row_checks``: every sequence
  shorter than the budget ends with ``eos_token_id`` (``eos_at_boundaries``), every sequence has a
  target (``targets_in_every_sequence``), every token is one (``all_targets``).
* **Ids and counts.** Every example id exactly once across all shards and splits, the copies and
  pieces of one record in one split; every count of the manifest equals what the shards and
  ``rejected.jsonl`` hold, and the counts reconcile::

      records_read + repeated_copies + extra_paths == examples_packed + rejected + dropped_too_long + not_sampled

* **Inputs** (``--inputs``). Every input record is re-read and re-encoded with the manifest's
  configuration (:class:`pipeline._encode.Encoder`, the job's own encode stage; data sets, weights
  and format options from ``config``), then the job's packing rules are applied
  (:func:`pipeline._rows.dedupe`, :func:`pipeline._rows.pieces`): each record is then packed with
  the stored tokens and mask (``~k`` copies, ``#k`` pieces, the kept window of a truncated
  example), or in ``rejected.jsonl`` under the same reason, or not sampled; never two of these.

**Trust.** The tokenizer named in the manifest is loaded only with ``--trust-remote-code`` from the
command line allowing its code; the manifest's own ``trust_remote_code`` is ignored. verify says
which tokenizer it loads before loading it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import pyarrow as pa

import packers
from packers import ContractError, InternalError, PackstreamError
from packers.files import load_json, show_path
from packers.manifest import (
    LOCK, MANIFEST, MAX_DEAD_LETTER_BYTES, TMP_PREFIX, Manifest, RowChecks, ShardEntry, expected_metadata,
    inconsistencies, is_datasets_cache, missing_manifest, require_complete,
)
from packers.rowcheck import Failure, gather, check_batch
from packers.schema import PAIR_COLUMNS
import pipeline._read as _read
import pipeline._rows as _rows
import pipeline._write as _write
from pipeline._formats import Reason
from pipeline._options import DatasetSpec, FormatOptions, PackOptions

REASONS = {r.value for r in Reason}
MAX_KEPT_PROBLEMS = 10_000
"""Problems kept in a report (all are counted): a badly damaged folder can have one per sequence."""
_MISMATCH_DETAILS = 1_000
"""Pieces whose re-encoded tokens are kept to explain a mismatch position by position."""


@dataclasses.dataclass(frozen=True)
class Problem:
    where: str
    """``manifest.json counts.rows``, ``train-00000-of-00002.arrow row 3 sequence 1 (src@7)``, ..."""
    what: str
    """The check that failed, with the expected and the actual value."""

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


@dataclasses.dataclass
class Report:
    folder: str
    problems: list[Problem] = dataclasses.field(default_factory=list)
    """The first :data:`MAX_KEPT_PROBLEMS` problems; :attr:`count` counts them all."""
    count: int = 0
    shards: int = 0
    rows: int = 0
    pieces: int = 0
    tokens: int = 0
    dead_letters: int = 0
    records: Optional[int] = None
    """Input records reconciled (``None`` without ``--inputs``)."""
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.count == 0

    def add(self, where: str, what: str) -> None:
        self.count += 1
        if len(self.problems) < MAX_KEPT_PROBLEMS:
            self.problems.append(Problem(where, what))

    def summary(self) -> str:
        s = (f"{self.folder}: {self.shards} shards, {self.rows:,} rows, {self.pieces:,} sequences, "
             f"{self.tokens:,} tokens, {self.dead_letters:,} dead letters")
        if self.records is not None:
            s += f"; {self.records:,} input records reconciled"
        return s + f" ({self.elapsed_s:.1f} s)"


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# The folder


def _is_remote(folder: str) -> bool:
    return "://" in folder


def _path(folder: str, name: str) -> str:
    if "/" in name or "\\" in name or name in ("", ".", ".."):  # callers open only checked names
        raise InternalError(f"refusing to open {name!r}: not a plain file name inside {folder}")
    return _write.join(folder, name)


def _list(folder: str) -> list[str]:
    if _is_remote(folder):
        from apache_beam.io.filesystems import FileSystems

        found = FileSystems.match([folder.rstrip("/") + "/*"])[0].metadata_list
        return sorted(m.path.rstrip("/").rsplit("/", 1)[-1] for m in found)
    return sorted(os.listdir(folder))


def _load_manifest(folder: str, names: list[str], report: Report) -> Optional[Manifest]:
    """The complete manifest, or None with the problem that says why the folder cannot be trusted. Its types
    and ranges are checked first (a manifest that fails is the one problem reported: nothing else can be read
    against it); then every place it contradicts itself is a problem of its own, and the checks go on."""
    if MANIFEST not in names:
        report.add(MANIFEST, f"missing: {missing_manifest(folder, names)}")
        return None
    try:
        m = require_complete(_write.read_manifest(folder, consistent=False), folder)
    except PackstreamError as e:  # ContractError, or the checked open's refusal (a FIFO, a device, too big)
        report.add(MANIFEST, str(e))
        return None
    for key, what in inconsistencies(m):
        report.add(f"{MANIFEST} {key}", what)
    return m


def _check_files(folder: str, names: list[str], m: Manifest, report: Report) -> list[ShardEntry]:
    """Leftovers, unlisted shard-like files, listed files that are missing; returns the listed shards present."""
    present = set(names)
    for n in names:
        if n.startswith(TMP_PREFIX):
            report.add(show_path(n), "temporary file left by an interrupted write; packstream pack --overwrite removes it")
        elif n == LOCK:
            report.add(n, "run lock left in a folder whose manifest is complete: a run is writing here now, or was "
                          "killed; packstream pack --overwrite breaks it")
    for n in m.unlisted(names):
        if not is_datasets_cache(n):
            report.add(show_path(n), "shard-like file not listed in manifest.json (a stray copy, or a shard of another "
                                     "run); not opened: remove it")
    for n in m.files:
        if n not in present:
            report.add(n, "listed in manifest.json files but missing from the folder")
    out = []
    for e in m.listed():
        if e.name in present:
            out.append(e)
        elif e.name not in m.files:
            report.add(e.name, "listed in manifest.json shards but missing from the folder")
    return out


# ----------------------------------------------------------------------------------------------
# Shards


_SHIFT_SHARD, _SHIFT_ROW = 64, 24  # a sequence's place, packed in one int: shard, row, sequence


@dataclasses.dataclass
class _Stored:
    """Every packed sequence: example id -> where it is (one int, or several when the id repeats)."""

    names: list[str] = dataclasses.field(default_factory=list)
    splits: list[str] = dataclasses.field(default_factory=list)
    loc: dict[str, Any] = dataclasses.field(default_factory=dict)
    digest: dict[str, bytes] = dataclasses.field(default_factory=dict)
    """Piece id -> blake2b of its tokens and mask (only with --inputs)."""
    bases: dict[str, str] = dataclasses.field(default_factory=dict)
    """A record's id (no ``~k``, no ``#k``) -> the split its sequences are in (only with a validation split)."""

    def add(self, eid: str, shard: int, row: int, k: int) -> None:
        loc = (shard << _SHIFT_SHARD) | (row << _SHIFT_ROW) | k
        had = self.loc.get(eid)
        if had is None:
            self.loc[eid] = loc
        elif isinstance(had, list):
            had.append(loc)
        else:
            self.loc[eid] = [had, loc]

    def where(self, loc: int, eid: str) -> str:
        shard, row, k = loc >> _SHIFT_SHARD, (loc >> _SHIFT_ROW) & ((1 << 40) - 1), loc & ((1 << _SHIFT_ROW) - 1)
        return f"{self.names[shard]} row {row} sequence {k} ({eid})"

    def first(self, eid: str) -> str:
        had = self.loc[eid]
        return self.where(had[0] if isinstance(had, list) else had, eid)


def piece_digest(input_ids: np.ndarray, loss_mask: np.ndarray) -> bytes:
    """A 16-byte digest of one sequence's tokens and mask: what ``--inputs`` compares."""
    h = hashlib.blake2b(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes(), digest_size=16)
    h.update(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
    return h.digest()


def _piece_base(eid: str) -> str:
    """The example of a piece: ``<id>#<k>`` -> ``<id>`` (ids escape '#', so a '#' is always the piece marker)."""
    return eid.rsplit("#", 1)[0] if "#" in eid else eid


def _open_shard(folder: str, name: str, limit: int) -> tuple[int, str, Callable[[], tuple[pa.Schema, pa.Table]]]:
    """(bytes, sha256, a function that parses the shard). Local files are opened through the checked open (a
    FIFO or a device is refused, never read), hashed in blocks and memory-mapped; a remote one is read whole,
    at most ``limit`` bytes (its manifest size). PackstreamError when it cannot be read."""
    from packers.files import open_checked

    path = _path(folder, name)
    ext = name.rsplit(".", 1)[-1]
    if not _is_remote(folder):
        with open_checked(path, what="shard") as f:
            sha = hashlib.file_digest(f, "sha256").hexdigest()
            size = os.fstat(f.fileno()).st_size
        source: Any = path
    else:
        data = _write.read_bytes(path, what="shard", limit=limit,
                                 fix="larger than manifest.json says: the shard was changed after the run wrote it")
        size, sha, source = len(data), hashlib.sha256(data).hexdigest(), pa.py_buffer(data)

    def parse() -> tuple[pa.Schema, pa.Table]:
        if ext == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(source if not isinstance(source, str) else pa.memory_map(source))
            return pf.schema_arrow, pf.read()
        reader = pa.ipc.open_stream(pa.memory_map(source) if isinstance(source, str) else source)
        return reader.schema, reader.read_all()

    return size, sha, parse


def _list_column(table: pa.Table, name: str) -> tuple[np.ndarray, Any, int]:
    """(offsets from 0, values, null count) of a list column."""
    col = table.column(name)
    arr = col.combine_chunks() if col.num_chunks else pa.array([], col.type)
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.flatten()
    nulls = arr.null_count + values.null_count
    values = values.to_pylist() if pa.types.is_string(values.type) else values.to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values, nulls


def check_shard(report: Report, index: int, entry: ShardEntry, size: int, sha: str, parse, *, checks: RowChecks,
                expect_meta: dict[str, Any], stored: _Stored, keep_digests: bool) -> Optional[dict[str, int]]:
    """Check one listed shard: bytes and sha256, schema and metadata (its place included: run id, split,
    index, count), every row and sequence; record its sequences in ``stored``. Returns what it measured (rows,
    examples, tokens, target_tokens), or None when the shard cannot be read."""
    name = entry.name
    for key, got in (("bytes", size), ("sha256", sha)):
        if getattr(entry, key) != got:
            report.add(name, f"check {key} failed: the file has {got!r}, manifest.json says {getattr(entry, key)!r}")
    try:
        schema, table = parse()
    except (pa.ArrowInvalid, OSError, ValueError) as e:
        report.add(name, f"cannot be read as {name.rsplit('.', 1)[-1]}: {e}")
        return None
    if not schema.remove_metadata().equals(packers.SCHEMA):
        report.add(name, f"check schema failed: schema is {schema.remove_metadata()!r}, expected packers.SCHEMA "
                         f"{packers.SCHEMA!r}")
        return None
    try:
        meta = packers.read_metadata(schema)
    except ContractError as e:
        report.add(f"{name} schema metadata", str(e))
        meta = {}
    for key, want in expect_meta.items():
        got = meta.get(key, "missing")
        if meta and (got != want or type(got) is not type(want)):
            report.add(f"{name} schema metadata {key}", f"is {got if key not in meta else _short(got)}, manifest.json "
                                                        f"says {want!r}")
    tok_off, tok, n1 = _list_column(table, "input_ids")
    mask_off, mask, n2 = _list_column(table, "loss_mask")
    seq_off, seq, n3 = _list_column(table, "seq_offsets")
    ex_off, exs, n4 = _list_column(table, "example_ids")
    nulls = n1 + n2 + n3 + n4 + table.column("num_tokens").null_count + table.column("num_targets").null_count
    nulls += sum(_list_column(table, c)[2] for c in PAIR_COLUMNS)
    if nulls:
        report.add(name, f"holds {nulls} null values; the contract has none")
        return None
    nrows = table.num_rows
    num = table.column("num_tokens").to_numpy().astype(np.int64) if nrows else np.zeros(0, np.int64)
    budget = checks.budget

    # Rows: the contract's structure, vectorized; validate_row names what is wrong with a bad row.
    n = np.diff(tok_off)
    nseq = np.diff(seq_off) - 1
    bad = (n > budget) | (np.diff(mask_off) != n) | (num != n) | (nseq < 1) | (np.diff(ex_off) != nseq)
    has = np.diff(seq_off) >= 1
    padded = seq if len(seq) else np.zeros(1, np.int32)
    first = padded[np.where(has, seq_off[:-1], 0)]
    last = padded[np.where(has, seq_off[1:] - 1, 0)]
    bad |= ~has | (first != 0) | (last != n)
    if len(seq) > 1:
        steps = np.diff(seq.astype(np.int64))
        inner = np.ones(len(steps), dtype=bool)
        inner[seq_off[1:-1][seq_off[1:-1] > 0] - 1] = False  # the step from one row's last offset to the next row's 0
        broken = np.flatnonzero(inner & (steps <= 0))
        bad[np.searchsorted(seq_off, broken, side="right") - 1] = True
    for i in np.flatnonzero(bad).tolist():
        row = {"input_ids": tok[tok_off[i]:tok_off[i + 1]].tolist(),
               "loss_mask": mask[mask_off[i]:mask_off[i + 1]].tolist(),
               "seq_offsets": seq[seq_off[i]:seq_off[i + 1]].tolist(), "example_ids": exs[ex_off[i]:ex_off[i + 1]],
               "num_tokens": int(num[i])}
        try:
            packers.validate_row(row, budget)
            why = "holds no sequence; every row holds at least one example"
        except ContractError as e:
            why = str(e)
        report.add(f"{name} row {i}", f"check contract failed: {why}")
    above = np.flatnonzero(mask > 1)
    if len(above):
        rows_of = np.searchsorted(mask_off, above, side="right") - 1
        for i, j in zip(*np.unique(rows_of, return_index=True)):
            pos = int(above[j] - mask_off[i])
            report.add(f"{name} row {int(i)}", f"check loss_mask failed: loss_mask[{pos}] is {int(mask[above[j]])}; "
                                               "only 0 and 1 are allowed")

    # Sequences of the good rows.
    good = np.flatnonzero(~bad)
    _check_targets_and_pairs(report, name, table, good, exs, ex_off, checks)
    counts = nseq[good]
    rows_of = np.repeat(good, counts)
    k_of = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    end_at = seq_off[rows_of] + 1 + k_of  # index in seq of each sequence's end offset
    starts = tok_off[rows_of] + seq[end_at - 1].astype(np.int64)
    stops = tok_off[rows_of] + seq[end_at].astype(np.int64)
    lengths = stops - starts
    cum = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    targets = cum[stops] - cum[starts]
    ids_of = [exs[ex_off[r] + k] for r, k in zip(rows_of.tolist(), k_of.tolist())]

    def at(s: int) -> str:
        return f"{name} row {int(rows_of[s])} sequence {int(k_of[s])} ({ids_of[s]})"

    if checks.eos_at_boundaries and len(stops):
        last_tok = tok[stops - 1]
        for s in np.flatnonzero((last_tok != checks.eos_token_id) & (lengths < budget)).tolist():
            report.add(at(s), f"check eos_at_boundaries failed: ends at seq_offsets[{int(k_of[s]) + 1}]="
                              f"{int(stops[s] - tok_off[rows_of[s]])} on token {int(last_tok[s])}, not on EOS "
                              f"{checks.eos_token_id}, and is shorter than the budget {budget}: the offsets do not "
                              "match the examples' boundaries")
    if checks.targets_in_every_sequence:
        for s in np.flatnonzero(targets == 0).tolist():
            report.add(at(s), "check targets_in_every_sequence failed: no token is a training target (loss_mask all 0)")
    if checks.all_targets:
        for s in np.flatnonzero(targets != lengths).tolist():
            report.add(at(s), f"check all_targets failed: {int(lengths[s] - targets[s])} of {int(lengths[s])} tokens "
                              "have loss_mask 0, but the run trains on every token")
    for s, eid in enumerate(ids_of):
        if not eid:
            report.add(at(s), "check example_ids failed: the example id is empty")
        stored.add(eid, index, int(rows_of[s]), int(k_of[s]))
        if keep_digests:
            a, b = int(starts[s]), int(stops[s])
            stored.digest[eid] = piece_digest(tok[a:b], mask[a:b])
    for i in np.flatnonzero(bad).tolist():  # ids of broken rows still count (and collide), without tokens
        for k, eid in enumerate(exs[ex_off[i]:ex_off[i + 1]]):
            stored.add(eid, index, i, k)
    measured = {"rows": nrows, "examples": int(ex_off[-1]) if nrows else 0, "tokens": int(num.sum()),
                "target_tokens": int(mask.sum()) if len(mask) else 0}
    for key, got in measured.items():
        if getattr(entry, key) != got:
            report.add(name, f"check {key} failed: the shard holds {got}, manifest.json says {getattr(entry, key)!r}")
    report.rows += nrows
    report.pieces += measured["examples"]
    report.tokens += measured["tokens"]
    return measured


_CHECK_CHUNK = 1024
"""Rows per call of the loader's vectorized checks in :func:`_check_targets_and_pairs`."""


def _check_targets_and_pairs(report: Report, name: str, table: pa.Table, good: np.ndarray, exs: list, ex_off: np.ndarray,
                             checks: RowChecks) -> None:
    """``num_targets`` and the pair columns of the structurally good rows, by the loader's own vectorized checks
    (:func:`packers.rowcheck.check_batch`; the flags verify reports itself are off): every broken row once."""
    plain = dataclasses.replace(checks, eos_at_boundaries=False, targets_in_every_sequence=False, all_targets=False)
    for c0 in range(0, len(good), _CHECK_CHUNK):
        idx = good[c0:c0 + _CHECK_CHUNK]
        while len(idx):
            b = gather(table.take(pa.array(idx)), check=False)
            f = check_batch(b, plain) if not isinstance(b, Failure) else b
            if f is None:
                break
            row = int(idx[f.row])
            where = f"{name} row {row}"
            if f.sequence is not None:
                where += f" sequence {f.sequence} ({exs[ex_off[row] + f.sequence]})"
            report.add(where, f"check {f.check} failed: {f.detail}")
            idx = np.delete(idx, f.row)  # a row's first failure only; the others are checked again without it


def _check_ids(stored: _Stored, report: Report) -> None:
    """Every example id once; the copies and pieces of one record in one split."""
    for eid, loc in stored.loc.items():
        if isinstance(loc, list):
            report.add(f"example id {eid}", f"check unique example ids failed: appears {len(loc)} times: "
                                            + "; ".join(stored.where(x, eid) for x in loc))
    if len(set(stored.splits)) < 2:
        return
    for eid, loc in stored.loc.items():
        first = loc[0] if isinstance(loc, list) else loc
        split = stored.splits[first >> _SHIFT_SHARD]
        base = _rows.base_id(_piece_base(eid))
        had = stored.bases.setdefault(base, split)
        if had != split:
            report.add(stored.where(first, eid), f"check split failed: in {split}, but other copies or pieces of "
                                                 f"record {base} are in {had}")


# ----------------------------------------------------------------------------------------------
# Dead letters and counts


@dataclasses.dataclass
class _Dead:
    by_key: dict[tuple[str, int, Optional[str]], dict]
    """(source, position, example_id) -> the dead letter."""
    by_reason: dict[str, int]
    first: dict[str, dict]
    read: bool = True
    """False when rejected.jsonl could not be read to its end: nothing is compared with its counts then."""


def _check_dead_letters(folder: str, names: list[str], m: Manifest, stored: _Stored, report: Report) -> _Dead:
    dead = _Dead({}, {}, {})
    fname = m.rejected_file
    if fname not in names:
        report.add(fname, "missing")
        dead.read = False
        return dead
    prev = None
    lines = 0
    try:  # one line at a time through the checked open: a big file costs one line of memory, a FIFO none
        for lineno, line in _write.read_lines(_path(folder, fname), what=fname, line_limit=MAX_DEAD_LETTER_BYTES):
            lines += 1
            at = f"{fname} line {lineno}"
            try:
                rec = load_json(line, what=at)
            except PackstreamError as e:
                report.add(at, str(e)[len(at) + 2:])
                continue
            if not isinstance(rec, dict):
                report.add(at, "is not a JSON object")
                continue
            bad = [k for k, t in (("source", str), ("position", int), ("reason", str), ("detail", str))
                   if not isinstance(rec.get(k), t) or isinstance(rec.get(k), bool)]
            if bad or not isinstance(rec.get("example_id", ""), str):
                report.add(at, f"field(s) {', '.join(bad) or 'example_id'} missing or of the wrong type")
                continue
            if rec["reason"] not in REASONS:
                report.add(at, f"unknown reason {_short(rec['reason'])}")
            key = (rec["source"], rec["position"], rec.get("example_id"))
            if key in dead.by_key:
                report.add(at, f"{_record(key)} is dead-lettered twice")
            dead.by_key[key] = rec
            dead.by_reason[rec["reason"]] = dead.by_reason.get(rec["reason"], 0) + 1
            dead.first.setdefault(rec["reason"], rec)
            order = _rows.reject_sort_key(rec)
            if prev is not None and order < prev:
                report.add(at, "out of order: rejected.jsonl is sorted by source, position, reason and id")
            prev = order
    except PackstreamError as e:
        report.add(fname, f"cannot be read: {e}")
        dead.read = False
    report.dead_letters = lines
    # A too_long example is not packed; a duplicate_id names an example that was kept: packed, or dead-lettered.
    packed = {_piece_base(e) for e in stored.loc}
    kept_dead = {k[2] for k, r in dead.by_key.items() if r["reason"] != Reason.DUPLICATE_ID.value}
    for key, rec in dead.by_key.items():
        eid = key[2]
        if rec["reason"] == Reason.TOO_LONG.value and eid in packed:
            report.add(f"{fname} {_record(key)}", f"{eid} is dropped as too_long but also packed")
        if rec["reason"] == Reason.DUPLICATE_ID.value and eid not in packed and eid not in kept_dead:
            report.add(f"{fname} {_record(key)}",
                       f"duplicate of {eid}, but no example {eid} is packed or dead-lettered")
    return dead


def _record(key: tuple) -> str:
    source, position, eid = key
    return show_path(f"{source}:{position}" + (f" ({eid})" if eid else ""))


def _short(v: Any, limit: int = 80) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _check_counts(m: Manifest, measured: dict[str, dict], stored: _Stored, dead: _Dead, complete: bool,
                  report: Report) -> None:
    """The manifest's counts against what the files hold (that they reconcile among themselves and with the
    shard entries is :func:`packers.manifest.inconsistencies`, reported with the manifest)."""
    c = m.counts

    def expect(key: str, got: Any, holder: str = "the files hold") -> None:
        if getattr(c, key) != got:
            report.add(f"manifest.json counts.{key}", f"says {getattr(c, key)!r}, {holder} {got!r}")

    if complete:  # every listed shard was read
        rows = sum(x["rows"] for x in measured.values())
        tokens = sum(x["tokens"] for x in measured.values())
        expect("rows", rows)
        expect("tokens", tokens)
        expect("target_tokens", sum(x["target_tokens"] for x in measured.values()))
        expect("pieces", sum(x["examples"] for x in measured.values()))
        expect("examples_packed", len({_piece_base(e) for e in stored.loc}), "the shards hold (distinct examples)")
        splits = {}
        for name, x in measured.items():
            s = splits.setdefault(stored.splits[stored.names.index(name)], {"rows": 0, "tokens": 0})
            s["rows"] += x["rows"]
            s["tokens"] += x["tokens"]
        said = {sp: {"rows": v.rows, "tokens": v.tokens} for sp, v in c.splits.items()}
        if said != splits:
            report.add("manifest.json counts.splits", f"says {said!r}, the shards hold {splits!r}")
    if not dead.read:
        return
    by_reason = dict(dead.by_reason)
    expect("dropped_too_long", by_reason.pop(Reason.TOO_LONG.value, 0), "rejected.jsonl holds")
    expect("rejected", sum(by_reason.values()), "rejected.jsonl holds")
    if dict(c.rejected_by_reason) != dict(sorted(by_reason.items())):
        report.add("manifest.json counts.rejected_by_reason",
                   f"says {dict(c.rejected_by_reason)!r}, rejected.jsonl holds {dict(sorted(by_reason.items()))!r}")
    first = {r: (x["source"], x["position"], x["detail"]) for r, x in dead.first.items()}
    if {r: (x.source, x.position, x.detail) for r, x in c.first_rejected.items()} != first:
        report.add("manifest.json counts.first_rejected", "differs from the first dead letter of each reason in "
                                                          "rejected.jsonl")


# ----------------------------------------------------------------------------------------------
# Inputs


def options_from_config(config: dict, inputs: Sequence[str], output: str,
                        trust_remote_code: bool = False) -> PackOptions:
    """The :class:`PackOptions` of a finished run, from ``manifest.json``'s ``config`` (data sets included).

    ``inputs`` replaces the recorded INPUT paths (not possible for a ``--config`` run: its data sets
    name their own paths). ``trust_remote_code`` comes from the caller, never from the manifest.
    """
    names = {f.name for f in dataclasses.fields(PackOptions)}
    fmt_names = {f.name for f in dataclasses.fields(FormatOptions)}
    given = ("config", "inputs", "output", "trust_remote_code")  # set below, never taken from the manifest as is
    kw = {k: v for k, v in config.items() if k in names and k not in given}
    try:
        specs = tuple(
            DatasetSpec(name=d["name"], paths=tuple(d["paths"]), weight=d.get("weight", 1.0), split=d.get("split"),
                        format=FormatOptions(**{k: v for k, v in d.items() if k in fmt_names}))
            for d in config.get("config") or ()
        )
        if specs and inputs:
            raise PackstreamError("this run read --config data sets, each with its own paths; verify --inputs re-reads "
                                  "the paths recorded in manifest.json: give no INPUT paths")
        kw.update(config=specs, inputs=() if specs else tuple(inputs) or tuple(config.get("inputs") or ()),
                  output=output, trust_remote_code=trust_remote_code)
        return PackOptions(**kw)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PackstreamError(f"manifest.json config cannot be read back into options ({type(e).__name__}: {e}); "
                              "it was written by another packstream version: verify with that version") from None


@dataclasses.dataclass
class _InputCheck:
    options: PackOptions
    files: list


def _prepare_inputs(folder: str, m: Manifest, inputs: Sequence[str], trust_remote_code: bool,
                    announce: Callable[[str], None], report: Report) -> Optional[_InputCheck]:
    """Options and inputs of the run, and its tokenizer (loaded here, before the shards are read, so a
    tokenizer that cannot be loaded fails at once). None, with a problem, when the inputs differ."""
    from pipeline._tokenizer import tokenizer_identity

    options = options_from_config(m.config, inputs, folder, trust_remote_code)
    files, _ = _read.expand_datasets(options.datasets())  # PackstreamError: the inputs cannot be read
    want = sorted({i.source for i in m.inputs})
    got = sorted({f.source for f in files})
    if want != got:
        report.add("inputs", f"resolve to sources {got}, the manifest has {want}; pass the same inputs as the pack run")
        return None
    name = options.tokenizer
    announce(f"verify: loading tokenizer {name!r} (named in {folder}/{MANIFEST}); its own code "
             + ("may run (--trust-remote-code)" if trust_remote_code else
                "will not run (the manifest cannot allow it; only --trust-remote-code does)"))
    try:
        identity = tokenizer_identity(name, trust_remote_code)
    except PackstreamError as e:
        hint = "" if trust_remote_code else ("; verify never runs a tokenizer's own code unless you pass "
                                             "--trust-remote-code (whatever manifest.json says)")
        raise PackstreamError(f"{e}{hint}") from None
    if identity["vocab_sha256"] != m.tokenizer.vocab_sha256:
        report.add("tokenizer", f"{name!r} here has vocab sha256 {identity['vocab_sha256'][:16]}…, the run used "
                                f"{m.tokenizer.vocab_sha256[:16]}…; cannot re-tokenize")
        return None
    return _InputCheck(options, files)


def _chunks(files: Iterable, options: PackOptions, counts: dict, expected_dead: dict) -> Iterable[list]:
    """The inputs as the job reads them (per read task, chunks of --batch-size), a corrupt rest as one dead letter."""
    for f in files:
        for task in _read.cut_tasks(f):
            chunk: list = []
            try:
                for position, record in _read.read_task(task, options.max_record_bytes):
                    chunk.append((f.dataset, f.source, position, record))
                    if len(chunk) == options.batch_size:
                        counts["records_read"] += len(chunk)
                        yield chunk
                        chunk = []
            except _read.CorruptInput as e:  # as pipeline._job.EncodeTasks: counted as one record
                where = 0 if e.position is None else e.position + 1
                expected_dead[(f.source, where, None)] = Reason.CORRUPT_INPUT.value
                counts["records_read"] += 1
            if chunk:
                counts["records_read"] += len(chunk)
                yield chunk


def _check_inputs(folder: str, m: Manifest, plan: _InputCheck, stored: _Stored, dead: _Dead, report: Report) -> None:
    """Every input record: packed with the same tokens, dead-lettered for the same reason, or not sampled."""
    from pipeline._encode import Encoder, add_counts

    options = plan.options
    budget = options.max_tokens
    encoder = Encoder(options)
    counts: dict[str, int] = {"records_read": 0}
    expected_dead: dict[tuple[str, int, Optional[str]], str] = {}
    # Each example: (source, position, [(piece id, digest)] or a dead-letter reason, its --long stats).
    candidates: dict[str, list[tuple[str, int, Any, dict]]] = {}
    details: dict[str, np.ndarray] = {}  # piece id -> re-encoded (2, n) tokens, for a mismatch's message
    for chunk in _chunks(plan.files, options, counts, expected_dead):
        enc = encoder.encode(chunk)
        add_counts(counts, enc.counts)
        for r in enc.rejected:
            expected_dead[(r["source"], r["position"], r.get("example_id"))] = r["reason"]
        batch = enc.batch
        lengths = batch.lengths
        for i, eid in enumerate(batch.ids):
            stats: dict[str, int] = {}
            if options.pairs:  # the job's rules for pairs, on this pair alone: two sides, or a dead letter
                rejected = []
                result, _ = _rows.pack_pair_group(batch.take([i]), options, rejected, stats)
                if rejected:
                    candidates.setdefault(eid, []).append((batch.sources[i], batch.positions[i],
                                                           rejected[0]["reason"], stats))
                    continue
                cut = int(batch.cuts[i])
                spans = [(packers.Side(side).suffix, (0 if side == 0 else cut), (0 if side == 0 else cut) + int(n))
                         for side, n in zip(result.order.tolist(), result.stops.tolist())]
            elif lengths[i] <= budget:
                spans = [(-1, 0, int(lengths[i]))]
            else:  # the job's --long rules, on this example alone
                rejected: list[dict] = []
                _, a, b, parts = _rows.pieces(batch.take([i]), options, rejected, stats)
                if rejected:
                    candidates.setdefault(eid, []).append((batch.sources[i], batch.positions[i],
                                                           rejected[0]["reason"], stats))
                    continue
                spans = list(zip(parts.tolist(), a.tolist(), b.tolist()))
            o = int(batch.offsets[i])
            out = []
            for part, a, b in spans:
                pid = eid + part if isinstance(part, str) else eid if part < 0 else f"{eid}#{part}"
                ids, mask = batch.input_ids[o + a:o + b], batch.loss_mask[o + a:o + b]
                d = piece_digest(ids, mask)
                if pid in stored.digest and stored.digest[pid] != d and len(details) < _MISMATCH_DETAILS:
                    details[pid] = np.stack([ids.astype(np.int64), mask.astype(np.int64)])
                out.append((pid, d))
            candidates.setdefault(eid, []).append((batch.sources[i], batch.positions[i], out, stats))
    report.records = counts["records_read"]

    # Duplicate ids: the job keeps the first by (source, position) (pipeline._rows.dedupe).
    winners: dict[str, tuple[str, int, Any, dict]] = {}
    repeated = [e for e, c in candidates.items() if len(c) > 1]
    for eid, c in candidates.items():
        if len(c) == 1:
            winners[eid] = c[0]
    if repeated:
        flat = [(eid, s, p) for eid in repeated for s, p, _, _ in candidates[eid]]
        probe = _rows.ExampleBatch.from_arrays([x[0] for x in flat], [x[1] for x in flat], [x[2] for x in flat],
                                               np.zeros(len(flat), np.int64), np.zeros(0, np.int32),
                                               np.zeros(0, np.uint8))
        kept, dups = _rows.dedupe(probe)
        for eid, s, p in zip(kept.ids, kept.sources, kept.positions):
            winners[eid] = next(c for c in candidates[eid] if c[0] == s and c[1] == p)
        for r in dups:
            expected_dead[(r["source"], r["position"], r["example_id"])] = r["reason"]

    expected: dict[str, tuple[str, int, bytes]] = {}
    totals: dict[str, int] = {}
    for eid, (source, position, outcome, stats) in winners.items():
        add_counts(totals, stats)
        if isinstance(outcome, str):
            expected_dead[(source, position, eid)] = outcome
            continue
        totals["examples_packed"] = totals.get("examples_packed", 0) + bool(outcome)  # as len(np.unique(ex))
        for pid, d in outcome:
            expected[pid] = (source, position, d)

    # Packed pieces against the stored ones.
    dead_at = {k[:2]: r["reason"] for k, r in dead.by_key.items()}
    tables: dict[int, pa.Table] = {}  # shards parsed again to explain mismatches, once each
    for pid, (source, position, d) in expected.items():
        if pid not in stored.loc:
            why = dead_at.get((source, position))
            report.add(f"input {source}:{position}", f"should be packed as {pid!r} but is not in any shard"
                                                     + (f" (rejected.jsonl says {why})" if why else ""))
        elif pid in stored.digest and stored.digest[pid] != d:
            _explain(folder, stored, pid, details.get(pid), tables, report)
    for pid in sorted(set(stored.loc) - set(expected)):
        report.add(stored.first(pid), "packed example matches no input record (not in the inputs, not sampled, or "
                                      "another run's)")
    # Dead letters against the expected ones.
    for key, reason in sorted(expected_dead.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or "")):
        got = dead.by_key.get(key)
        if got is None:
            report.add(f"input {_record(key)}", f"is rejected ({reason}) on re-reading but is not in rejected.jsonl")
        elif got["reason"] != reason:
            report.add(f"input {_record(key)}", f"rejected.jsonl says {got['reason']}, re-reading gives {reason}")
    for key in sorted(set(dead.by_key) - set(expected_dead), key=lambda k: (k[0], k[1], k[2] or "")):
        report.add(f"rejected.jsonl {_record(key)}",
                   f"dead letter ({dead.by_key[key]['reason']}) for a record the inputs pack fine or do not have")
    # Counts re-derived from the inputs.
    c = m.counts
    for key, got in (("records_read", counts["records_read"]), ("not_sampled", counts.get("not_sampled", 0)),
                     ("repeated_copies", counts.get("repeated_copies", 0)),
                     ("examples_packed", totals.get("examples_packed", 0)),
                     ("truncated_examples", totals.get("truncated_examples", 0)),
                     ("split_examples", totals.get("split_examples", 0)),
                     ("no_target_pieces", totals.get("no_target_pieces", 0))):
        if getattr(c, key) != got:
            report.add(f"manifest.json counts.{key}", f"says {getattr(c, key)!r}, re-reading the inputs gives {got}")
    if c.extra_paths != counts.get("extra_paths", 0):
        report.add("manifest.json counts.extra_paths", f"says {c.extra_paths}, re-reading the inputs gives "
                                                       f"{counts.get('extra_paths', 0)}")


def _explain(folder: str, stored: _Stored, pid: str, want: Optional[np.ndarray], tables: dict[int, pa.Table],
             report: Report) -> None:
    """A stored piece differs from the re-encoded one: say where and at which position."""
    loc = stored.loc[pid]
    loc = loc[0] if isinstance(loc, list) else loc
    where = stored.where(loc, pid)
    if want is None:
        report.add(where, "check input_ids/loss_mask failed: the stored tokens differ from re-encoding the input")
        return
    shard, row, k = loc >> _SHIFT_SHARD, (loc >> _SHIFT_ROW) & ((1 << 40) - 1), loc & ((1 << _SHIFT_ROW) - 1)
    if shard not in tables:
        tables[shard] = _open_shard(folder, stored.names[shard], 1 << 62)[2]()[1]  # read once already
    r = tables[shard].slice(row, 1).to_pylist()[0]
    a, b = r["seq_offsets"][k], r["seq_offsets"][k + 1]
    got = np.array([r["input_ids"][a:b], r["loss_mask"][a:b]], dtype=np.int64)
    if got.shape[1] != want.shape[1]:
        report.add(where, f"check input_ids failed: {got.shape[1]} tokens stored, re-tokenizing the input gives "
                          f"{want.shape[1]}")
        return
    for i, column in enumerate(("input_ids", "loss_mask")):
        diff = np.flatnonzero(got[i] != want[i])
        if diff.size:
            j = int(diff[0])
            more = f" ({diff.size} positions differ)" if diff.size > 1 else ""
            report.add(where, f"check {column} failed: {column}[{j}] is {int(got[i][j])}, re-tokenizing the input "
                              f"gives {int(want[i][j])}{more}")


# ----------------------------------------------------------------------------------------------
# The whole folder


def verify(folder: str, inputs: Optional[Sequence[str]] = None, *, trust_remote_code: bool = False,
           announce: Optional[Callable[[str], None]] = None) -> Report:
    """Re-check ``folder``; with ``inputs`` (``()`` = the manifest's own), reconcile every input record.

    ``trust_remote_code`` (the command line's ``--trust-remote-code``) is the only thing that lets the
    run's tokenizer execute code; ``announce`` receives the line naming the tokenizer before it is
    loaded (default: stderr). Raises :class:`PackstreamError` only for a user error: no such folder,
    inputs that cannot be read, a tokenizer that cannot be loaded. Every mismatch is a
    :class:`Problem` in the report.
    """
    started = time.time()
    folder = folder.rstrip("/") or "/"
    report = Report(folder)
    try:
        names = _list(folder)
    except (OSError, ValueError) as e:
        raise PackstreamError(f"cannot list output folder {folder}: {e}") from None
    m = _load_manifest(folder, names, report)
    if m is None:
        if inputs is not None:
            report.add("inputs", "not reconciled: the folder has no complete manifest.json")
        report.elapsed_s = time.time() - started
        return report
    checks = m.row_checks
    plan = None
    if inputs is not None:
        plan = _prepare_inputs(folder, m, inputs, trust_remote_code, announce or _stderr, report)

    entries = _check_files(folder, names, m, report)
    stored = _Stored()
    measured: dict[str, dict] = {}
    for e in entries:
        try:
            size, sha, parse = _open_shard(folder, e.name, e.bytes)
        except OSError as err:
            report.add(e.name, f"cannot be read: {err}")
            continue
        except PackstreamError as err:  # the checked open: a FIFO, a device, a folder, bigger than listed
            report.add(e.name, f"cannot be read: {err}")
            continue
        index = len(stored.names)
        stored.names.append(e.name)
        stored.splits.append(e.split)
        got = check_shard(report, index, e, size, sha, parse, checks=checks, expect_meta=expected_metadata(m, e),
                          stored=stored, keep_digests=plan is not None)
        report.shards += 1
        if got is not None:
            measured[e.name] = got
    _check_ids(stored, report)
    dead = _check_dead_letters(folder, names, m, stored, report)
    _check_counts(m, measured, stored, dead, complete=len(measured) == len(m.shards), report=report)
    if plan is not None:
        _check_inputs(folder, m, plan, stored, dead, report)
    report.elapsed_s = time.time() - started
    return report

