"""A finished packed folder -> the examples its rows hold: the first brick of ``repack`` (issue 44).

Every row holds examples back to back; its ``seq_offsets`` say where each one starts, and its other columns carry,
per sequence, what the example carried when it was packed. Reading them back (budget 16, see
:mod:`packers.schema`)::

    example_ids  ["gsm8k/train.jsonl@7",   "oasst.jsonl:a1b2",  "t0.jsonl@3#1"]
    input_ids    [ 5  9  2 41 17  1 | 5  8 30  1 | 5 77  6  1 ]
    seq_offsets  [0,                6,          10,          14]
    ->  PackedExample("gsm8k/train.jsonl@7", input_ids [5 9 2 41 17 1], loss_mask [0 0 0 1 1 1], ...)
        PackedExample("oasst.jsonl:a1b2", ...)
        PackedExample("t0.jsonl@3#1", ..., piece=1)     the 2nd piece of an example --long split cut at the first pack

A pair (``--pairs`` folders) comes back as one item, as :class:`pipeline._rows.ExampleBatch` holds it before
packing: the chosen side's tokens then the rejected side's, ``chosen_length`` where the rejected side starts,
and each side's completion span counted from the item's first token.

Truncated examples (``--long truncate``) are not marked per example in the rows: a kept window carries the
record's id, with no suffix, and the manifest only counts them (``counts.truncated_examples``). A truncated
example is exactly ``budget`` tokens long, so :attr:`PackedExample.maybe_truncated` flags every example of that
length in a folder that truncated any; a truncated pair has no such tell, so there every pair is flagged.

The folder is read as the loader reads it: its complete ``manifest.json`` decides which shards are read, each
shard's size, sha256, schema, schema metadata and counts must agree with its entry, and every row must pass the
loader's row checks (:func:`packers.rowcheck.check_batch`: the contract and the manifest's ``row_checks``) before an
example is cut from it. Local
folders only for now; rows of images (contract version 7) or videos (version 8) are refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa

from packers.errors import ContractError, PackstreamError
from packers.files import check_regular, open_checked, show_path
from packers.manifest import (MANIFEST, RESTORE, SPLITS, Manifest, RowChecks, ShardEntry, escape_source, id_source,
                              load_manifest, missing_manifest, require_complete)
from packers.rowcheck import Batch, Failure, check_batch, gather
from packers.shardcheck import check_rows, checked_metadata
from packers.schema import VIDEO_CONTRACT_VERSION, Side, is_text
from pipeline import _rows

_NO_IMAGES = "repack of image rows is not supported yet"
_NO_VIDEOS = "repack of video rows is not supported yet"


@dataclasses.dataclass(frozen=True, eq=False)
class PackedExample:
    """One example recovered from a packed row, with everything the row carries for it."""

    id: str
    """Its example id as packed (a pair's: the pair id, without ``#chosen``/``#rejected``)."""
    source: str
    """The input it came from, as the manifest's ``inputs[].source`` names it (the id's escaped prefix when the
    manifest lists no input of that name)."""
    split: str
    """``train`` or ``validation``: the split of the shard that holds it."""
    input_ids: np.ndarray
    """int32: its tokens (a pair's: chosen then rejected)."""
    loss_mask: np.ndarray
    """uint8: 1 on its target tokens; same length."""
    desirable: Optional[int] = None
    """Its KTO label (1 desirable, 0 undesirable, -1 none) when the row holds a ``desirable`` column entry, else None."""
    chosen_length: Optional[int] = None
    """A pair's: where its rejected side starts in ``input_ids``; None for a plain example."""
    completion_spans: tuple[tuple[int, int], ...] = ()
    """A pair's: each side's completion ``[start, stop)``, counted from the item's first token; () for a plain one."""
    piece: Optional[int] = None
    """``k`` when it is the ``<id>#<k>`` piece of an example cut by ``--long split`` at the first pack; else None."""
    maybe_truncated: bool = False
    """True when the folder truncated examples (``--long truncate``) and this one is as long as a kept window."""


def packed_examples(folder: str, *, split: Optional[str] = None) -> Iterator[PackedExample]:
    """The examples of the finished packed ``folder`` (its ``split``, or both), row by row in shard-name order.

    PackstreamError (or ContractError) in one line when the folder is not a complete packstream run, a shard
    differs from its manifest entry, a row breaks the row contract (naming the shard, the row and the check), or its
    rows hold images."""
    if split is not None and split not in SPLITS:
        raise PackstreamError(f"split={split!r}; use one of {list(SPLITS)}")
    m = _manifest(folder)
    sources = {escape_source(i.source): i.source for i in m.inputs}
    budget = int(m.config["max_tokens"])
    truncated = bool(m.counts and m.counts.truncated_examples)
    for entry in m.listed(split):
        table = _open(folder, m, entry)
        yield from _examples(table, entry.split, sources, budget if truncated else None)


def open_folder(folder: str) -> Manifest:
    """The complete manifest of the packed text ``folder`` (a local folder), checked as the loader checks it; one
    PackstreamError line when it is not a finished packstream run, or its rows hold images or videos."""
    return _manifest(folder)


def open_shard(folder: str, m: Manifest, entry: ShardEntry, rows: Optional[tuple[int, int]] = None,
               digest: bool = True) -> pa.Table:
    """The rows of ``entry`` (one of ``m.listed()``), once its bytes, schema, metadata, counts and every row agree
    with the manifest and the row contract: one ContractError line naming the shard (and the row) otherwise.

    ``rows``: only rows ``[start, stop)`` (memory-mapped: the others are never touched), and only they are held to
    the row contract; ``digest``: False skips the file's sha256 (a repack reads a shard in parts, each part on any
    worker, and checks the whole file's digest in its first part: a mismatch fails the run before it commits)."""
    return _open(folder, m, entry, rows, digest)


def _manifest(folder: str) -> Manifest:
    where = show_path(folder)
    if not os.path.isdir(folder):
        raise PackstreamError(f"{where} is not a folder; pass the --output folder of packstream pack (local folders only for now)")
    names = os.listdir(folder)
    if MANIFEST not in names:
        raise missing_manifest(where, names)
    m = require_complete(load_manifest(os.path.join(folder, MANIFEST), where), where)
    if m.raw.get("contract_version") == VIDEO_CONTRACT_VERSION:
        raise PackstreamError(f"{where}: its rows hold videos (packed with --processor --video-fps); "
                              f"{_NO_VIDEOS}")
    if m.raw.get("vision"):
        raise PackstreamError(f"{where}: its rows hold images (packed with --processor); {_NO_IMAGES}")
    return m


def _open(folder: str, m: Manifest, s: ShardEntry, rows: Optional[tuple[int, int]] = None,
          digest: bool = True) -> pa.Table:
    """The rows of the listed shard ``s``, once its bytes, schema, metadata and counts agree with its entry."""
    at = f"{show_path(folder)}/{s.name}"
    path = os.path.join(folder, s.name)
    try:
        size = check_regular(path, "shard").st_size
    except PackstreamError:
        raise ContractError(f"{at}: listed in {MANIFEST} but missing or not a regular file; {RESTORE}") from None
    if size != s.bytes:
        raise ContractError(f"{at}: {size:,} bytes, {MANIFEST} says {s.bytes:,}; {RESTORE}")
    if digest:
        with open_checked(path, what="shard") as f:
            sha = hashlib.file_digest(f, "sha256").hexdigest()
        if sha != s.sha256:
            raise ContractError(f"{at}: sha256 {sha[:16]}…, {MANIFEST} says {s.sha256[:16]}…; {RESTORE}")
    try:
        if s.ext == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(pa.memory_map(path))
            schema, table = pf.schema_arrow, pf.read()
        else:
            reader = pa.ipc.open_stream(pa.memory_map(path))
            schema, table = reader.schema, reader.read_all()
    except (pa.ArrowException, OSError) as e:
        raise ContractError(f"{at}: not a readable packstream shard ({e}); {RESTORE}") from None
    meta = checked_metadata(at, schema, m, s)  # the loader's checks (packers.shardcheck), in its words
    if not is_text(meta["contract_version"]):
        what = "videos" if meta["contract_version"] == VIDEO_CONTRACT_VERSION else "images"
        raise PackstreamError(f"{at}: contract version {meta['contract_version']} rows hold {what}; "
                              f"{_NO_VIDEOS if 'videos' in what else _NO_IMAGES}")
    check_rows(at, table, s)
    start = 0
    if rows is not None:
        start = rows[0]
        table = table.slice(start, rows[1] - start)
    _check_contract(at, table, m.row_checks, start)
    return table


_CHUNK = 1024
"""Rows per call of the loader's vectorized row checks."""


def _check_contract(at: str, table: pa.Table, checks: RowChecks, first: int = 0) -> None:
    """Every row against the packed-row contract and the manifest's ``row_checks``, by the checks the loader runs on
    every batch it yields (:func:`packers.rowcheck.check_batch`): a row whose ``seq_offsets`` run backwards or past
    its tokens, whose mask is not 0/1, whose pairs are not whole, ... is one ContractError naming the shard, the row
    (and the sequence) and the broken check, never examples cut from it."""
    for start in range(0, table.num_rows, _CHUNK):
        b = gather(table.slice(start, _CHUNK), check=True)
        f = b if isinstance(b, Failure) else check_batch(b, checks)
        if f is None:
            continue
        where = f"{at} row {first + start + f.row}"
        if f.sequence is not None and isinstance(b, Batch):
            where += f" sequence {f.sequence} ({b.example_ids[f.row][f.sequence].as_py()})"
        raise ContractError(f"{where}: check {f.check} failed: {f.detail}; the shard is not what packstream pack "
                            f"wrote: {RESTORE}")


def _examples(table: pa.Table, split: str, sources: dict[str, str], budget: Optional[int]) -> Iterator[PackedExample]:
    """The examples of a checked shard's rows. ``budget``: the folder's, when it truncated examples, else None."""
    for batch in table.to_batches():
        ids_col, mask_col = batch.column("input_ids"), batch.column("loss_mask")
        id_starts, mask_starts = ids_col.offsets.to_numpy(), mask_col.offsets.to_numpy()
        tokens, mask = ids_col.values.to_numpy(), mask_col.values.to_numpy()
        cols = {c: batch.column(c).to_pylist()
                for c in ("seq_offsets", "example_ids", "pair_ids", "sides", "completion_spans", "desirable")}
        for r in range(batch.num_rows):
            t0, m0 = int(id_starts[r]), int(mask_starts[r])
            offsets, eids, labels = cols["seq_offsets"][r], cols["example_ids"][r], cols["desirable"][r]

            def cut(j: int) -> tuple[np.ndarray, np.ndarray]:
                a, b = offsets[j], offsets[j + 1]
                return tokens[t0 + a:t0 + b].copy(), mask[m0 + a:m0 + b].copy()

            def source(eid: str) -> str:
                esc = id_source(eid)
                return sources.get(esc, esc)

            if cols["pair_ids"][r]:
                yield from _pairs(r, {c: v[r] for c, v in cols.items()}, cut, source, split, budget)
                continue
            for j, eid in enumerate(eids):
                ids, msk = cut(j)
                base, _, k = eid.rpartition("#")  # ids and sources escape '#': one is always a piece marker
                yield PackedExample(
                    id=eid, source=source(eid), split=split, input_ids=ids, loss_mask=msk,
                    desirable=labels[j] if labels else None, piece=int(k) if base and k.isdigit() else None,
                    maybe_truncated=budget is not None and len(ids) == budget)


def _pairs(r, row, cut, source, split, budget) -> Iterator[PackedExample]:
    """Row ``r`` of pairs (``row``: its small columns as lists): each pair (chosen, then rejected, adjacent) as one item."""
    offsets, eids, pair_ids, sides = row["seq_offsets"], row["example_ids"], row["pair_ids"], row["sides"]
    spans, labels = row["completion_spans"], row["desirable"]
    if len(eids) % 2:
        raise ContractError(f"row {r}: {len(eids)} sequences in a row of pairs; {RESTORE}")
    for j in range(0, len(eids), 2):
        pid = pair_ids[j]
        if (sides[j], sides[j + 1]) != (Side.CHOSEN, Side.REJECTED) or pair_ids[j + 1] != pid:
            raise ContractError(f"row {r}: pair {pid!r} is not a chosen side followed by its rejected side; {RESTORE}")
        (c_ids, c_mask), (r_ids, r_mask) = cut(j), cut(j + 1)
        start = offsets[j]
        rel = tuple((spans[2 * k] - start, spans[2 * k + 1] - start) for k in (j, j + 1))
        yield PackedExample(
            id=pid, source=source(pid), split=split, input_ids=np.concatenate([c_ids, r_ids]),
            loss_mask=np.concatenate([c_mask, r_mask]), desirable=labels[j] if labels else None,
            chosen_length=len(c_ids), completion_spans=rel,
            maybe_truncated=budget is not None and len(c_ids) + len(r_ids) <= budget)


def rows_batch(table: pa.Table, pairs: bool) -> tuple[_rows.ExampleBatch, Optional[np.ndarray]]:
    """A checked shard's rows as the :class:`pipeline._rows.ExampleBatch` its examples were before packing, in row
    order, vectorized (no Python object per example but its id): an example of tokens ``seq_offsets[j]:seq_offsets[j
    + 1]`` of its row, with its id, KTO label and mark; a pair (``pairs``) as one item, its chosen side then its
    rejected side (``cuts``: where the rejected side starts). Ids and sources are as packed: the caller renames them.

    Also returns each sequence's cut mark (``cuts`` column, version 9: ``[pieces, length]``), one row per item (a pair:
    its chosen side's), or None when the shard has no such column (version 6) or no row holds a mark.
    """
    table = table.combine_chunks()
    n_rows = table.num_rows

    def flat(name: str) -> tuple[np.ndarray, np.ndarray]:
        col = table.column(name)
        arr = col.chunk(0) if col.num_chunks else pa.array([], col.type)
        offsets = arr.offsets.to_numpy().astype(np.int64)
        values = arr.values.to_numpy(zero_copy_only=False) if len(arr.values) else np.zeros(0, np.int64)
        return offsets - offsets[0] if len(offsets) else np.zeros(1, np.int64), values[offsets[0]:offsets[-1]] \
            if len(offsets) else values

    tok_off, tokens = flat("input_ids")
    _, mask = flat("loss_mask")
    so, sv = flat("seq_offsets")
    rows_of = np.repeat(np.arange(n_rows, dtype=np.int64), np.diff(so))
    last = so[1:] - 1
    first = so[:-1]
    start_at = np.delete(np.arange(len(sv), dtype=np.int64), last)
    stop_at = np.delete(np.arange(len(sv), dtype=np.int64), first)
    starts = sv[start_at].astype(np.int64) + tok_off[rows_of[start_at]]
    stops = sv[stop_at].astype(np.int64) + tok_off[rows_of[stop_at]]
    seq_rows = rows_of[start_at]
    n_seq = len(starts)
    ids_col = table.column("example_ids").combine_chunks()
    eids = ids_col.flatten().to_pylist() if n_rows else []
    do, dv = flat("desirable")
    labels = None
    if len(dv):
        labels = np.full(n_seq, -1, np.int8)
        has = np.diff(do) > 0  # a row's labels: none, or one per sequence
        seq_has = has[seq_rows]
        labels[seq_has] = dv.astype(np.int8)
    marks = None
    if "cuts" in table.column_names:
        co, cv = flat("cuts")
        if len(cv):
            marks = np.zeros((n_seq, 2), np.int32)
            seq_has = (np.diff(co) > 0)[seq_rows]
            marks[seq_has] = cv.reshape(-1, 2)
    if not pairs:
        lengths = stops - starts
        batch = _rows.ExampleBatch.from_arrays(eids, [""] * n_seq, [-1] * n_seq, lengths, tokens, mask,
                                               desirable=labels)
        return batch, marks
    if n_seq % 2:
        raise ContractError(f"{n_seq} sequences in a shard of pairs; {RESTORE}")
    pids = table.column("pair_ids").combine_chunks().flatten().to_pylist()[0::2] if n_rows else []
    chosen = stops[0::2] - starts[0::2]
    lengths = stops[1::2] - starts[0::2]
    batch = _rows.ExampleBatch.from_arrays(pids, [""] * len(pids), [-1] * len(pids), lengths, tokens, mask, chosen,
                                           desirable=None if labels is None else labels[0::2])
    return batch, None if marks is None else marks
