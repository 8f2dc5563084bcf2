"""``packstream verify``: re-check a whole output folder from its files alone.

Pure functions that return a list of :class:`Problem` s, each naming where (shard, row,
sequence, example id, or the manifest key) and what (expected vs got). Nothing is trusted:

* **Files.** Every shard named in ``manifest.json`` exists, no other ``train-*`` file does,
  names follow ``train-XXXXX-of-NNNNN.<ext>`` (and are only ever opened inside the folder), no
  ``.tmp-*`` leftover of a killed run remains, and each shard's bytes match the manifest's
  size and sha256.
* **Schema.** Read with pyarrow's IPC or Parquet reader (no pickle anywhere): the schema
  equals :data:`packers.SCHEMA`, the metadata (:func:`packers.read_metadata`) names the
  manifest's budget and tokenizer, and no column holds nulls.
* **Rows.** :func:`packers.validate_row` (budget, lengths, offsets from 0 to ``len`` and strictly
  increasing), loss_mask values only 0 or 1, and boundaries consistent with the tokens: every
  example ends with the tokenizer's EOS (the renderer appends it), unless it is a full-budget
  piece of a truncated or split example; with ``--long drop`` every example has a target
  token, with ``--train-on all`` every token is one.
* **Ids and counts.** Every example id exactly once across all shards; per-shard and total
  counts equal the manifest's; records read = packed + rejected + dropped; the dead-letter
  file is well formed, its counts by reason match, and a ``duplicate_id`` names a packed id
  while a ``too_long`` one is not packed.
* **Inputs** (optional). Every input record is re-read, normalized and re-tokenized with the
  manifest's configuration, and is then either packed, with tokens and mask equal to the stored
  ones (a prefix for ``--long truncate``, ``#k`` pieces for ``--long split``), or in the
  dead-letter file under the same reason, exactly once.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import posixpath
import re
import time
from typing import Any, Optional, Sequence

import numpy as np
import pyarrow as pa

import packers
from packers import ContractError, InternalError, LongPolicy, PackstreamError
from pipeline import _read, _rows, _write
from pipeline._formats import Reason, Rejected, normalize
from pipeline._options import Format, OutputFormat, PackMode, PackOptions, TrainOn

SHARD_NAME = re.compile(r"^train-(\d{5})-of-(\d{5})\.(arrow|parquet)$")
REASONS = {r.value for r in Reason}


@dataclasses.dataclass(frozen=True)
class Problem:
    where: str
    """``manifest.json counts.rows``, ``train-00000-of-00002.arrow row 3 sequence 1 (src:7)``, ..."""
    what: str
    """What is wrong, with the expected and the actual value."""

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


@dataclasses.dataclass
class Report:
    folder: str
    problems: list[Problem] = dataclasses.field(default_factory=list)
    shards: int = 0
    rows: int = 0
    pieces: int = 0
    tokens: int = 0
    dead_letters: int = 0
    records: Optional[int] = None
    """Input records reconciled (``None`` without inputs)."""
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, where: str, what: str) -> None:
        self.problems.append(Problem(where, what))

    def summary(self) -> str:
        s = (f"{self.folder}: {self.shards} shards, {self.rows:,} rows, {self.pieces:,} sequences, "
             f"{self.tokens:,} tokens, {self.dead_letters:,} dead letters")
        if self.records is not None:
            s += f"; {self.records:,} input records reconciled"
        return s + f" ({self.elapsed_s:.1f} s)"


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Where one packed sequence is stored, and its tokens."""

    where: str
    input_ids: Optional[np.ndarray]  # kept only when inputs are reconciled
    loss_mask: Optional[np.ndarray]


# ----------------------------------------------------------------------------------------------
# Files


def _is_remote(folder: str) -> bool:
    return "://" in folder


def _join(folder: str, name: str) -> str:
    if "/" in name or "\\" in name or name in ("", ".", ".."):  # callers open only checked names
        raise InternalError(f"refusing to open {name!r}: not a plain file name inside {folder}")
    return posixpath.join(folder, name) if not _is_remote(folder) else folder.rstrip("/") + "/" + name


def _list(folder: str) -> list[str]:
    if _is_remote(folder):
        from apache_beam.io.filesystems import FileSystems

        return sorted(m.path.rstrip("/").rsplit("/", 1)[-1] for m in FileSystems.match([folder.rstrip("/") + "/*"])[0].metadata_list)
    import os

    return sorted(os.listdir(folder))


def options_from_config(config: dict, inputs: Sequence[str], output: str) -> PackOptions:
    """The :class:`PackOptions` of a finished run, from ``manifest.json``'s ``config``."""
    enums = {"format": Format, "train_on": TrainOn, "long": LongPolicy, "mode": PackMode, "output_format": OutputFormat}
    names = {f.name for f in dataclasses.fields(PackOptions)}
    kw = {k: v for k, v in config.items() if k in names}
    for k, cls in enums.items():
        if k in kw:
            kw[k] = cls(kw[k])
    kw["fields"] = tuple(tuple(x) for x in kw.get("fields", ()))
    kw["inputs"], kw["output"] = tuple(inputs), output
    return PackOptions(**kw)


# ----------------------------------------------------------------------------------------------
# Shards


def _lists(table: pa.Table, name: str) -> tuple[np.ndarray, Any, int]:
    """(absolute offsets, values, null count) of a list column."""
    arr = table.column(name).combine_chunks()
    if isinstance(arr, pa.ChunkedArray):  # zero chunks
        arr = pa.array([], arr.type)
    values = arr.values
    nulls = arr.null_count + values.null_count
    values = values.to_pylist() if pa.types.is_string(values.type) else values.to_numpy(zero_copy_only=False)
    return arr.offsets.to_numpy(), values, nulls


def _read_table(data: bytes, ext: str) -> tuple[pa.Schema, pa.Table]:
    """Parse one shard with pyarrow only; ``ArrowInvalid``/``OSError`` on a broken file."""
    buf = pa.py_buffer(data)
    if ext == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(pa.BufferReader(buf))
        return pf.schema_arrow, pf.read()
    reader = pa.ipc.open_stream(buf)
    return reader.schema, reader.read_all()


def check_shard(
    report: Report,
    name: str,
    data: bytes,
    *,
    budget: int,
    eos_id: Optional[int],
    long: LongPolicy,
    train_all: bool,
    expect_meta: dict[str, Any],
    pieces: dict[str, list[_Piece]],
    keep_tokens: bool,
) -> dict[str, Any]:
    """Check one shard's schema, metadata and rows; record its sequences in ``pieces``.

    Returns what the manifest says about a shard (rows, examples, tokens, target_tokens, bytes,
    sha256), measured; ``{}`` when the shard cannot be read.
    """
    measured: dict[str, Any] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    try:
        schema, table = _read_table(data, name.rsplit(".", 1)[-1])
    except (pa.ArrowInvalid, OSError, ValueError) as e:
        report.add(name, f"cannot be read as {name.rsplit('.', 1)[-1]}: {e}")
        return measured
    if not schema.remove_metadata().equals(packers.SCHEMA):
        report.add(name, f"schema is {schema.remove_metadata()!r}, expected packers.SCHEMA {packers.SCHEMA!r}")
        return measured
    try:
        meta = packers.read_metadata(schema)
    except ContractError as e:
        report.add(f"{name} schema metadata", str(e))
        meta = {}
    for key, want in expect_meta.items():
        if key in meta and meta[key] != want:
            report.add(f"{name} schema metadata {key}", f"is {meta[key]!r}, manifest.json says {want!r}")
    nrows = table.num_rows
    ids_off, ids, n1 = _lists(table, "input_ids")
    mask_off, mask, n2 = _lists(table, "loss_mask")
    seq_off, seqs, n3 = _lists(table, "seq_offsets")
    ex_off, exs, n4 = _lists(table, "example_ids")
    num = table.column("num_tokens").to_numpy() if nrows else np.zeros(0, np.int32)
    nulls = n1 + n2 + n3 + n4 + table.column("num_tokens").null_count
    if nulls:
        report.add(name, f"holds {nulls} null values; the contract has none")
        return measured
    targets = 0
    for i in range(nrows):
        where = f"{name} row {i}"
        row_ids, row_mask = ids[ids_off[i]:ids_off[i + 1]], mask[mask_off[i]:mask_off[i + 1]]
        offs = seqs[seq_off[i]:seq_off[i + 1]].tolist()
        ex = exs[ex_off[i]:ex_off[i + 1]]
        try:
            packers.validate_row(
                {"input_ids": row_ids, "loss_mask": row_mask, "seq_offsets": offs, "example_ids": ex,
                 "num_tokens": int(num[i])},
                budget,
            )
        except ContractError as e:
            report.add(where, str(e))
            continue
        targets += int(row_mask.sum())
        if row_mask.size and row_mask.max() > 1:
            j = int(np.flatnonzero(row_mask > 1)[0])
            report.add(where, f"loss_mask[{j}] is {int(row_mask[j])}; only 0 and 1 are allowed")
        for k, eid in enumerate(ex):
            lo, hi = offs[k], offs[k + 1]
            at = f"{where} sequence {k} ({eid})"
            seq_ids, seq_mask = row_ids[lo:hi], row_mask[lo:hi]
            if not eid:
                report.add(at, "example id is empty")
            full_piece = hi - lo == budget and long is not LongPolicy.DROP
            if eos_id is not None and int(seq_ids[-1]) != eos_id and not full_piece:
                report.add(
                    at,
                    f"ends at seq_offsets[{k + 1}]={hi} on token {int(seq_ids[-1])}, not on EOS {eos_id}, and is not a "
                    f"full {budget}-token piece: the offsets do not match the examples' boundaries",
                )
            if train_all and not seq_mask.all():
                report.add(at, "--train-on all, but loss_mask has 0s")
            elif long is LongPolicy.DROP and not train_all and not seq_mask.any():
                report.add(at, "no token is a training target (loss_mask all 0)")
            piece = _Piece(at, seq_ids if keep_tokens else None, seq_mask if keep_tokens else None)
            pieces.setdefault(eid, []).append(piece)
    measured.update(
        rows=nrows,
        examples=int(ex_off[-1] - ex_off[0]) if nrows else 0,
        tokens=int(num.sum()),
        target_tokens=targets,
    )
    report.rows += nrows
    report.pieces += measured["examples"]
    report.tokens += measured["tokens"]
    return measured


# ----------------------------------------------------------------------------------------------
# The whole folder


def verify(folder: str, inputs: Optional[Sequence[str]] = None) -> Report:
    """Re-check ``folder``; with ``inputs`` (``()`` = the manifest's own), reconcile every record.

    Raises :class:`PackstreamError` only when there is nothing to check (no such folder) or the
    inputs cannot be read; every mismatch is a :class:`Problem` in the report.
    """
    started = time.time()
    folder = folder.rstrip("/") or "/"
    report = Report(folder)
    try:
        names = _list(folder)
    except (OSError, ValueError) as e:
        raise PackstreamError(f"cannot list output folder {folder}: {e}") from None
    manifest = _load_manifest(folder, names, report)
    config = manifest.get("config", {}) if manifest else {}
    budget = config.get("max_tokens")
    long = LongPolicy(config.get("long", "drop"))
    train_all = config.get("train_on") == TrainOn.ALL.value
    tokenizer = manifest.get("tokenizer", {}) if manifest else {}
    eos_id = tokenizer.get("eos_token_id")
    expect_meta = {"budget": budget, "tokenizer_vocab_sha256": tokenizer.get("vocab_sha256"),
                   "eos_token_id": eos_id, "pad_token_id": tokenizer.get("pad_token_id")}
    expect_meta = {k: v for k, v in expect_meta.items() if v is not None}

    # Files: leftovers, names, and the manifest's list.
    for n in names:
        if n.startswith(".tmp-"):
            report.add(n, "temporary file left by an interrupted write; rerun with --overwrite")
        elif n.startswith("train-") and not SHARD_NAME.match(n):
            report.add(n, "not a shard name packstream writes (train-XXXXX-of-NNNNN.arrow|parquet)")
    on_disk = [n for n in names if SHARD_NAME.match(n)]
    listed: dict[str, dict] = {}
    for s in (manifest or {}).get("shards", []):
        n = s.get("name", "") if isinstance(s, dict) else ""
        if not SHARD_NAME.match(n):
            report.add("manifest.json shards", f"shard name {n!r} is not train-XXXXX-of-NNNNN.<ext>; not opened")
            continue
        listed[n] = s
    if manifest is not None:
        for n in sorted(set(listed) - set(on_disk)):
            report.add(n, "listed in manifest.json but missing from the folder")
        for n in sorted(set(on_disk) - set(listed)):
            report.add(n, "shard file not listed in manifest.json")
    expected_ext = "parquet" if config.get("output_format") == "parquet" else "arrow"
    counts_of = [SHARD_NAME.match(n).group(2) for n in on_disk]
    if on_disk and len(set(counts_of)) == 1:
        total = int(counts_of[0])
        have = sorted(int(SHARD_NAME.match(n).group(1)) for n in on_disk)
        if have != list(range(total)):
            report.add("shards", f"indices {have} on disk, expected 0..{total - 1}")
    elif len(set(counts_of)) > 1:
        report.add("shards", f"shards of different runs mixed: counts {sorted(set(counts_of))}")

    # Shards.
    pieces: dict[str, list[_Piece]] = {}
    measured: dict[str, dict] = {}
    if budget is None and on_disk:
        budget = _budget_from_shard(folder, on_disk[0])
    for n in on_disk:
        if manifest is not None and not n.endswith(expected_ext):
            report.add(n, f"extension differs from the manifest's output_format {config.get('output_format')!r}")
        data = _write.read_bytes(_join(folder, n))
        measured[n] = check_shard(
            report, n, data, budget=budget or 2**31 - 1, eos_id=eos_id, long=long, train_all=train_all,
            expect_meta=expect_meta, pieces=pieces, keep_tokens=inputs is not None,
        )
        report.shards += 1
    for eid, where in pieces.items():
        if len(where) > 1:
            report.add(f"example id {eid}", f"appears {len(where)} times: " + "; ".join(p.where for p in where))

    # Manifest counts, per shard and in total; dead letters.
    dead = _check_dead_letters(folder, names, manifest, pieces, report)
    if manifest is not None:
        _check_counts(manifest, listed, measured, pieces, dead, long, report)

    if inputs is not None and manifest is not None:
        _check_inputs(folder, manifest, inputs, pieces, dead, report)
    elif inputs is not None:
        report.add("inputs", "not reconciled: manifest.json is missing or unreadable")
    report.elapsed_s = time.time() - started
    return report


def _load_manifest(folder: str, names: list[str], report: Report) -> Optional[dict]:
    if "manifest.json" not in names:
        report.add("manifest.json", "missing: the run did not finish, or this is not a packstream output folder")
        return None
    try:
        manifest = json.loads(_write.read_bytes(_join(folder, "manifest.json")))
    except (ValueError, UnicodeDecodeError) as e:
        report.add("manifest.json", f"is not valid JSON: {e}")
        return None
    if not isinstance(manifest, dict):
        report.add("manifest.json", "is not a JSON object")
        return None
    missing = [k for k in ("config", "counts", "shards", "tokenizer", "inputs") if k not in manifest]
    if missing:
        report.add("manifest.json", f"lacks {', '.join(missing)}")
        return None
    if manifest.get("contract_version") != packers.CONTRACT_VERSION:
        report.add("manifest.json contract_version",
                   f"is {manifest.get('contract_version')!r}, this packstream checks {packers.CONTRACT_VERSION}")
    return manifest


def _budget_from_shard(folder: str, name: str) -> Optional[int]:
    try:
        schema, _ = _read_table(_write.read_bytes(_join(folder, name)), name.rsplit(".", 1)[-1])
        return int(packers.read_metadata(schema)["budget"])
    except (pa.ArrowInvalid, OSError, ValueError, KeyError):
        return None


def _check_dead_letters(folder, names, manifest, pieces, report) -> dict[tuple[str, int], dict]:
    """Parse the dead-letter file; returns ``(source, position) -> record``."""
    fname = (manifest or {}).get("rejected_file", "rejected.jsonl")
    if not isinstance(fname, str) or not re.fullmatch(r"[\w.-]+", fname) or fname.startswith("."):
        report.add("manifest.json rejected_file", f"{fname!r} is not a plain file name; not opened")
        return {}
    if fname not in names:
        report.add(fname, "missing")
        return {}
    dead: dict[tuple[str, int], dict] = {}
    lines = _write.read_bytes(_join(folder, fname)).decode("utf-8", errors="replace").splitlines()
    for lineno, line in enumerate(lines, start=1):
        at = f"{fname} line {lineno}"
        try:
            rec = json.loads(line)
        except ValueError as e:
            report.add(at, f"is not JSON: {e}")
            continue
        if not isinstance(rec, dict):
            report.add(at, "is not a JSON object")
            continue
        bad = [k for k, t in (("source", str), ("position", int), ("reason", str), ("detail", str))
               if not isinstance(rec.get(k), t) or isinstance(rec.get(k), bool)]
        if bad:
            report.add(at, f"field(s) {', '.join(bad)} missing or of the wrong type")
            continue
        if rec["reason"] not in REASONS:
            report.add(at, f"unknown reason {rec['reason']!r}")
        key = (rec["source"], rec["position"])
        if key in dead:
            report.add(at, f"{key[0]}:{key[1]} is dead-lettered twice")
        dead[key] = rec
    # A too_long example is not packed; a duplicate_id names the kept one: packed, or dropped as too long.
    bases = {_base(eid) for eid in pieces}
    dropped = {r.get("example_id") for r in dead.values() if r["reason"] == Reason.TOO_LONG.value}
    for (source, position), rec in dead.items():
        eid = rec.get("example_id")
        if rec["reason"] == Reason.TOO_LONG.value and eid in bases:
            report.add(f"{fname} {source}:{position}", f"{eid} is dropped as too_long but also packed")
        if rec["reason"] == Reason.DUPLICATE_ID.value and eid not in bases and eid not in dropped:
            report.add(f"{fname} {source}:{position}", f"duplicate of {eid}, but no example {eid} is packed")
    report.dead_letters = len(lines)
    return dead


def _base(eid: str) -> str:
    """The example id of a piece ``<id>#<k>`` (ids themselves may hold '#': only a numeric tail counts)."""
    m = re.fullmatch(r"(.*)#\d+", eid)
    return m.group(1) if m else eid


def _check_counts(manifest, listed, measured, pieces, dead, long, report) -> None:
    c = manifest["counts"]
    for n, want in listed.items():
        got = measured.get(n)
        if got is None:
            continue
        for key in ("bytes", "sha256", "rows", "examples", "tokens", "target_tokens"):
            if key in got and want.get(key) != got[key]:
                report.add(f"{n}", f"{key} is {got[key]!r}, manifest.json says {want.get(key)!r}")

    def expect(key: str, got: Any) -> None:
        if c.get(key) != got:
            report.add(f"manifest.json counts.{key}", f"says {c.get(key)!r}, the files hold {got!r}")

    if all("rows" in m for m in measured.values()) and set(measured) == set(listed):
        expect("rows", sum(m["rows"] for m in measured.values()))
        expect("tokens", sum(m["tokens"] for m in measured.values()))
        expect("target_tokens", sum(m["target_tokens"] for m in measured.values()))
        expect("pieces", sum(len(v) for v in pieces.values()))
        examples = len({_base(e) for e in pieces}) if long is LongPolicy.SPLIT else sum(len(v) for v in pieces.values())
        expect("examples_packed", examples)
        budget = manifest["config"].get("max_tokens", 0)
        tokens, rows = c.get("tokens", 0), c.get("rows", 0)
        expect("lower_bound", math.ceil(tokens / budget) if tokens and budget else 0)
        if rows and budget and not math.isclose(c.get("fill", -1), tokens / (rows * budget), rel_tol=1e-9):
            report.add("manifest.json counts.fill", f"says {c.get('fill')!r}, tokens/(rows*budget) is {tokens / (rows * budget)!r}")
    by_reason = collections.Counter(r["reason"] for r in dead.values())
    too_long = by_reason.pop(Reason.TOO_LONG.value, 0)
    expect("dropped_too_long", too_long)
    expect("rejected", sum(by_reason.values()))
    if c.get("rejected_by_reason") != dict(sorted(by_reason.items())):
        report.add("manifest.json counts.rejected_by_reason",
                   f"says {c.get('rejected_by_reason')!r}, rejected.jsonl holds {dict(sorted(by_reason.items()))!r}")
    total = c.get("examples_packed", 0) + c.get("rejected", 0) + c.get("dropped_too_long", 0)
    if c.get("records_read") != total:
        report.add("manifest.json counts.records_read",
                   f"is {c.get('records_read')!r}, but packed + rejected + dropped = {total}")


# ----------------------------------------------------------------------------------------------
# Inputs


def _check_inputs(folder, manifest, inputs, pieces, dead, report) -> None:
    """Every input record: packed with the same tokens, or dead-lettered for the same reason."""
    from pipeline._render import Renderer, tokenizer_identity

    config = manifest["config"]
    options = options_from_config(config, tuple(inputs) or tuple(config.get("inputs", ())), folder)
    files = _read.expand_inputs(options.inputs)  # PackstreamError: the inputs themselves are unreadable
    want_sources = sorted({i["source"] for i in manifest["inputs"]})
    got_sources = sorted({f.source for f in files})
    if want_sources != got_sources:
        report.add("inputs", f"resolve to sources {got_sources}, the manifest has {want_sources}; "
                             "pass the same inputs as the pack run")
        return
    identity = tokenizer_identity(options.tokenizer, options.trust_remote_code)
    if identity["vocab_sha256"] != manifest["tokenizer"].get("vocab_sha256"):
        report.add("tokenizer", f"{options.tokenizer!r} here has vocab sha256 {identity['vocab_sha256'][:16]}…, the "
                                f"run used {str(manifest['tokenizer'].get('vocab_sha256'))[:16]}…; cannot re-tokenize")
        return
    renderer = Renderer(options)
    expected_dead: dict[tuple[str, int], str] = {}
    encoded: list[tuple[str, str, int, np.ndarray]] = []
    batch: list[tuple[str, str, int, Any]] = []
    records = 0

    def flush() -> None:
        for (eid, source, pos, _), res in zip(batch, renderer.encode([c for *_, c in batch])):
            if isinstance(res, Rejected):
                expected_dead[(source, pos)] = res.reason.value
            else:
                encoded.append((eid, source, pos, res))
        batch.clear()

    for f in files:
        for pos, rec in _read.read_file(f, options.max_record_bytes):
            records += 1
            try:
                if isinstance(rec, Rejected):
                    raise rec
                conv = normalize(rec, options.format, options.fields)
            except Rejected as r:
                expected_dead[(f.source, pos)] = r.reason.value
                continue
            batch.append((_rows.example_id(f.source, pos, rec), f.source, pos, conv))
            if len(batch) >= options.batch_size:
                flush()
    flush()
    report.records = records
    if manifest["counts"].get("records_read") != records:
        report.add("manifest.json counts.records_read", f"says {manifest['counts'].get('records_read')!r}, the inputs hold {records}")

    # Duplicates: the first of an id by (source, position) is kept (pipeline._rows.dedupe).
    encoded.sort(key=lambda t: (t[0], t[1], t[2]))
    budget = options.max_tokens
    expected_pieces: dict[str, tuple[tuple[str, int], np.ndarray]] = {}  # piece id -> ((source, pos), tokens)
    for i, (eid, source, pos, tokens) in enumerate(encoded):
        record = (source, pos)
        if i and encoded[i - 1][0] == eid:
            expected_dead[(source, pos)] = Reason.DUPLICATE_ID.value
            continue
        n = tokens.shape[1]
        if n <= budget:
            expected_pieces[eid] = (record, tokens)
        elif options.long is LongPolicy.DROP:
            expected_dead[(source, pos)] = Reason.TOO_LONG.value
        elif options.long is LongPolicy.TRUNCATE:
            expected_pieces[eid] = (record, tokens[:, :budget])
        else:
            for k in range(math.ceil(n / budget)):
                expected_pieces[f"{eid}#{k}"] = (record, tokens[:, k * budget:(k + 1) * budget])

    for pid, (record, tokens) in expected_pieces.items():
        stored = pieces.get(pid)
        if not stored:
            why = f" (rejected.jsonl says {dead[record]['reason']})" if record in dead else ""
            report.add(f"input {record[0]}:{record[1]}", f"should be packed as {pid!r} but is not in any shard{why}")
            continue
        _compare(stored[0], tokens, report)
    for pid in sorted(set(pieces) - set(expected_pieces)):
        report.add(pieces[pid][0].where, "packed example matches no input record")
    for key, reason in sorted(expected_dead.items()):
        got = dead.get(key)
        if got is None:
            report.add(f"input {key[0]}:{key[1]}", f"is rejected ({reason}) on re-reading but is not in rejected.jsonl")
        elif got["reason"] != reason:
            report.add(f"input {key[0]}:{key[1]}", f"rejected.jsonl says {got['reason']}, re-reading gives {reason}")
    for key in sorted(set(dead) - set(expected_dead)):
        report.add(f"rejected.jsonl {key[0]}:{key[1]}", f"dead letter ({dead[key]['reason']}) for a record the inputs pack fine or do not have")


def _compare(piece: _Piece, expected: np.ndarray, report: Report) -> None:
    ids, mask = expected[0], expected[1]
    if piece.input_ids.size != ids.size:
        report.add(piece.where, f"{piece.input_ids.size} tokens stored, re-tokenizing the input gives {ids.size}")
        return
    for name, got, want in (("input_ids", piece.input_ids, ids), ("loss_mask", piece.loss_mask, mask)):
        diff = np.flatnonzero(got.astype(np.int64) != want.astype(np.int64))
        if diff.size:
            j = int(diff[0])
            report.add(piece.where, f"{name}[{j}] is {int(got[j])}, re-tokenizing the input gives {int(want[j])}"
                                    + (f" ({diff.size} positions differ)" if diff.size > 1 else ""))
