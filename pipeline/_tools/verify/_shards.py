"""The shards: each listed shard's bytes, schema, metadata, rows and sequences, and every example id once."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import packers
from packers import ContractError
from packers.manifest import RowChecks, ShardEntry
from packers.rowcheck import Failure, check_batch, gather
from packers.schema import PAIR_COLUMNS, row_schema
import pipeline._arrow as _arrow
import pipeline._rows as _rows
import pipeline._write as _write
from pipeline._tools.verify._base import Report, in_folder, is_remote, short


_SHIFT_SHARD, _SHIFT_ROW = 64, 24  # a sequence's place, packed in one int: shard, row, sequence
_MEDIA_NUMBERS = ("image_offsets", "image_grid_thw", "video_offsets", "video_grid_thw", "second_per_grid_ts")
_SCHEMA_NAMES = {packers.CONTRACT_VERSION: "SCHEMA", packers.schema.TEXT_V6_VERSION: "SCHEMA_V6",
                 packers.VISION_CONTRACT_VERSION: "VISION_SCHEMA", packers.VIDEO_CONTRACT_VERSION: "VIDEO_SCHEMA"}


@dataclasses.dataclass
class Stored:
    """Every packed sequence: example id -> where it is (one int, or several when the id repeats)."""

    names: list[str] = dataclasses.field(default_factory=list)
    splits: list[str] = dataclasses.field(default_factory=list)
    loc: dict[str, Any] = dataclasses.field(default_factory=dict)
    digest: dict[str, bytes] = dataclasses.field(default_factory=dict)
    """Piece id -> blake2b of its tokens, mask and images (:func:`piece_digest`; only with --inputs)."""
    bases: dict[str, str] = dataclasses.field(default_factory=dict)
    """A record's id (no ``~k``, no ``#k``) -> the split its sequences are in (only with a validation split)."""
    cuts: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Shard name -> the sequences its ``cuts`` marks say are truncated, and pieces of split examples (contract
    version 9 shards only)."""
    truncated: set = dataclasses.field(default_factory=set)
    """The examples (pairs: the pair ids) with a sequence marked truncated (``[1, N]``)."""
    split: set = dataclasses.field(default_factory=set)
    """The examples with a sequence marked a piece (``[n >= 2, N]`` or ``[-1, -1]``)."""

    def add(self, eid: str, shard: int, row: int, k: int) -> None:
        loc = (shard << _SHIFT_SHARD) | (row << _SHIFT_ROW) | k
        had = self.loc.get(eid)
        if had is None:
            self.loc[eid] = loc
        elif isinstance(had, list):
            had.append(loc)
        else:
            self.loc[eid] = [had, loc]

    @staticmethod
    def place(loc: int) -> tuple[int, int, int]:
        """``(shard, row, sequence)`` of a place packed by :meth:`add`."""
        return loc >> _SHIFT_SHARD, (loc >> _SHIFT_ROW) & ((1 << 40) - 1), loc & ((1 << _SHIFT_ROW) - 1)

    def where(self, loc: int, eid: str) -> str:
        shard, row, k = self.place(loc)
        return f"{self.names[shard]} row {row} sequence {k} ({eid})"

    def first(self, eid: str) -> str:
        had = self.loc[eid]
        return self.where(had[0] if isinstance(had, list) else had, eid)


@dataclasses.dataclass(frozen=True)
class PieceImage:
    """One image of a packed piece as ``--inputs`` compares it with re-reading its input: where its placeholder run
    starts in the piece, its patch grid, its path and the sha256 of its embedded bytes (the bytes themselves are
    never kept)."""

    offset: int
    """Its first placeholder token, counted from the piece's first token."""
    grid: tuple[int, int, int]
    path: Optional[str]
    sha256: Optional[str]
    """Of the embedded bytes; None when the row holds none (``--images reference``)."""
    seconds: Optional[float] = None
    """A video's ``second_per_grid_ts`` (contract version 5); None for an image."""

    @classmethod
    def of(cls, offset: int, grid: Any, path: Optional[str], data: Any,
           seconds: Optional[float] = None) -> "PieceImage":
        """``data``: the embedded bytes (any buffer), or None; ``seconds``: a video's ``second_per_grid_ts``."""
        return cls(int(offset), tuple(int(g) for g in grid), path,
                   None if data is None else hashlib.sha256(data).hexdigest(),
                   None if seconds is None else float(np.float32(seconds)))

    @property
    def kind(self) -> str:
        return "image" if self.seconds is None else "video"


def piece_digest(input_ids: np.ndarray, loss_mask: np.ndarray, images: Sequence[PieceImage] = ()) -> bytes:
    """A 16-byte digest of one sequence's tokens and mask, and of its images and videos (offset, grid, path, bytes'
    sha256; a video also its ``second_per_grid_ts``), in token order: what ``--inputs`` compares. A piece without
    images digests its tokens and mask alone."""
    h = hashlib.blake2b(np.ascontiguousarray(input_ids, dtype=np.int32).tobytes(), digest_size=16)
    h.update(np.ascontiguousarray(loss_mask, dtype=np.uint8).tobytes())
    for im in images:
        fields = [im.offset, list(im.grid), im.path, im.sha256] + ([] if im.seconds is None else ["video", im.seconds])
        h.update(json.dumps(fields).encode())
    return h.digest()


def row_images(table: pa.Table) -> list[list[tuple[int, PieceImage]]]:
    """Each row's images and videos as ``(row offset, PieceImage with that row offset)``, in token order, from its
    ``image_offsets``, ``image_grid_thw`` and ``images`` columns and (contract version 5) its ``video_offsets``,
    ``video_grid_thw``, ``videos`` and ``second_per_grid_ts`` (embedded bytes hashed chunk by chunk, never copied);
    [] per row of a table without images. Rows whose columns disagree in length are :func:`_check_images`' to
    report."""
    if "images" not in table.column_names:
        return [[] for _ in range(table.num_rows)]
    out = _media_column(table, "image", None)
    if "videos" in table.column_names:
        seconds = table.column("second_per_grid_ts").to_pylist()
        for row, videos in zip(out, _media_column(table, "video", seconds)):
            if videos:
                row.extend(videos)
                row.sort(key=lambda x: x[0])
    return out


def _media_column(table: pa.Table, kind: str, seconds: Optional[list]) -> list[list[tuple[int, PieceImage]]]:
    """:func:`row_images` of one kind (``image``, or ``video`` with each row's ``second_per_grid_ts``)."""
    offsets = table.column(f"{kind}_offsets").to_pylist()
    grids = table.column(f"{kind}_grid_thw").to_pylist()
    out: list[list[tuple[int, PieceImage]]] = []
    for chunk in table.column(f"{kind}s").chunks:
        starts = chunk.offsets.to_numpy()
        starts = starts - starts[0]
        paths, data = chunk.flatten().flatten()  # the struct's fields, slices respected
        paths = paths.to_pylist()
        for r in range(len(chunk)):
            i = len(out)
            row: list[tuple[int, PieceImage]] = []
            for k, j in enumerate(range(int(starts[r]), int(starts[r + 1]))):
                if k >= len(offsets[i]) or 3 * k + 3 > len(grids[i]):
                    break
                b = data[j]
                sec = None if seconds is None else (seconds[i][k] if k < len(seconds[i]) else float("nan"))
                row.append((int(offsets[i][k]), PieceImage.of(0, grids[i][3 * k:3 * k + 3], paths[j],
                                                              b.as_buffer() if b.is_valid else None, sec)))
            out.append(row)
    return out


def images_in(images: Sequence[tuple[int, PieceImage]], start: int, stop: int) -> list[tuple[int, PieceImage]]:
    """The images and videos of ``images`` (a row's, from :func:`row_images`) that start in tokens ``[start, stop)``,
    as ``(index in the row among its kind, PieceImage with its offset from start)``."""
    out, seen = [], {"image": 0, "video": 0}
    for at, im in images:
        k = seen[im.kind]
        seen[im.kind] += 1
        if start <= at < stop:
            out.append((k, dataclasses.replace(im, offset=at - start)))
    return out


def piece_base(eid: str) -> str:
    """The example of a piece: ``<id>#<k>`` -> ``<id>`` (ids escape '#', so a '#' is always the piece marker)."""
    return eid.rsplit("#", 1)[0] if "#" in eid else eid


def open_shard(folder: str, name: str, limit: int) -> tuple[int, str, Callable[[], tuple[pa.Schema, pa.Table]]]:
    """(bytes, sha256, a function that parses the shard). Local files are opened through the checked open (a
    FIFO or a device is refused, never read), hashed in blocks and memory-mapped; a remote one is read whole,
    at most ``limit`` bytes (its manifest size). PackstreamError when it cannot be read."""
    from packers.files import open_checked

    path = in_folder(folder, name)
    ext = name.rsplit(".", 1)[-1]
    if not is_remote(folder):
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
    arr = col.combine_chunks() if col.num_chunks else pa.nulls(0, col.type)
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.flatten()
    nulls = arr.null_count + values.null_count
    values = values.to_pylist() if pa.types.is_string(values.type) else values.to_numpy(zero_copy_only=False)
    return offsets - offsets[0], values, nulls


@dataclasses.dataclass(frozen=True)
class OpenShard:
    """A listed shard, opened: its manifest entry, its index among the shards read, its bytes and sha256 as read,
    how to parse it, and the schema metadata the manifest implies for it."""

    entry: ShardEntry
    index: int
    size: int
    sha: str
    parse: Callable[[], tuple[pa.Schema, pa.Table]]
    expect_meta: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class _Columns:
    """A shard's list columns as flat arrays (offsets from 0, values) and its num_tokens."""

    tok_off: np.ndarray
    tok: np.ndarray
    mask_off: np.ndarray
    mask: np.ndarray
    seq_off: np.ndarray
    seq: np.ndarray
    ex_off: np.ndarray
    exs: list
    num: np.ndarray


def check_shard(report: Report, shard: OpenShard, checks: RowChecks, stored: Stored,
                keep_digests: bool) -> Optional[dict[str, int]]:
    """Check one listed shard: bytes and sha256, schema and metadata (its place included: run id, split,
    index, count), every row and sequence; record its sequences in ``stored`` (with their digests when
    ``keep_digests``). Returns what it measured (rows, examples, tokens, target_tokens), or None when the
    shard cannot be read."""
    entry, name = shard.entry, shard.entry.name
    table = _table(report, shard)
    if table is None:
        return None
    cols = _columns(report, name, table)
    if cols is None:
        return None
    bad = _check_rows(report, name, cols, checks.budget)
    if "images" in table.column_names:
        bad |= _check_images(report, name, table, cols, shard.expect_meta.get("vision"))
    good = np.flatnonzero(~bad)
    _check_targets_and_pairs(report, name, table, good, cols.exs, cols.ex_off, checks)
    _check_sequences(report, shard, cols, good, checks, stored,
                     row_images(table) if keep_digests else None)
    for i in np.flatnonzero(bad).tolist():  # ids of broken rows still count (and collide), without tokens
        for k, eid in enumerate(cols.exs[cols.ex_off[i]:cols.ex_off[i + 1]]):
            stored.add(eid, shard.index, i, k)
    if "cuts" in table.column_names:
        _count_cuts(name, table, cols, stored)
    nrows = table.num_rows
    measured = {"rows": nrows, "examples": int(cols.ex_off[-1]) if nrows else 0, "tokens": int(cols.num.sum()),
                "target_tokens": int(cols.mask.sum()) if len(cols.mask) else 0}
    for key, got in measured.items():
        if getattr(entry, key) != got:
            report.add(name, f"check {key} failed: the shard holds {got}, manifest.json says {getattr(entry, key)!r}")
    report.rows += nrows
    report.pieces += measured["examples"]
    report.tokens += measured["tokens"]
    return measured


def _table(report: Report, shard: OpenShard) -> Optional[pa.Table]:
    """The shard's table, after its bytes, sha256, schema and schema metadata are checked; None when it cannot be
    read or its schema is not the contract's."""
    entry, name = shard.entry, shard.entry.name
    for key, got in (("bytes", shard.size), ("sha256", shard.sha)):
        if getattr(entry, key) != got:
            report.add(name, f"check {key} failed: the file has {got!r}, manifest.json says {getattr(entry, key)!r}")
    try:
        schema, table = shard.parse()
    except (pa.ArrowInvalid, OSError, ValueError) as e:
        report.add(name, f"cannot be read as {name.rsplit('.', 1)[-1]}: {e}")
        return None
    version = shard.expect_meta.get("contract_version", packers.CONTRACT_VERSION)
    try:
        want = row_schema(version)
    except ContractError as e:
        report.add(name, f"check schema failed: {e}")
        return None
    if not schema.remove_metadata().equals(want):
        report.add(name, f"check schema failed: schema is {schema.remove_metadata()!r}, expected "
                         f"packers.{_SCHEMA_NAMES[version]} {want!r}")
        return None
    try:
        meta = packers.read_metadata(schema)
    except ContractError as e:
        report.add(f"{name} schema metadata", str(e))
        meta = {}
    for key, want in shard.expect_meta.items():
        got = meta.get(key, "missing")
        if meta and (got != want or type(got) is not type(want)):
            report.add(f"{name} schema metadata {key}", f"is {got if key not in meta else short(got)}, manifest.json "
                                                        f"says {want!r}")
    return table


def _columns(report: Report, name: str, table: pa.Table) -> Optional[_Columns]:
    """The list columns as flat arrays; None, with the problem, when any column holds a null."""
    tok_off, tok, n1 = _list_column(table, "input_ids")
    mask_off, mask, n2 = _list_column(table, "loss_mask")
    seq_off, seq, n3 = _list_column(table, "seq_offsets")
    ex_off, exs, n4 = _list_column(table, "example_ids")
    nulls = n1 + n2 + n3 + n4 + table.column("num_tokens").null_count + table.column("num_targets").null_count
    nulls += sum(_list_column(table, c)[2] for c in PAIR_COLUMNS + _MEDIA_NUMBERS + ("cuts",) if c in table.column_names)
    if nulls:
        report.add(name, f"holds {nulls} null values; the contract has none")
        return None
    num = table.column("num_tokens").to_numpy().astype(np.int64) if table.num_rows else np.zeros(0, np.int64)
    return _Columns(tok_off, tok, mask_off, mask, seq_off, seq, ex_off, exs, num)


def _count_cuts(name: str, table: pa.Table, c: _Columns, stored: Stored) -> None:
    """What the shard's ``cuts`` marks say (for :func:`~pipeline._tools.verify._folder.check_counts`): its truncated
    sequences and split pieces, and the examples they belong to. A row whose marks do not fit its sequences is the
    row checks' to report; it counts nothing here."""
    off, values, _ = _list_column(table, "cuts")
    values = np.asarray(values, dtype=np.int64)
    truncated = pieces = 0
    for i in np.flatnonzero(np.diff(off) > 0).tolist():
        ids = c.exs[c.ex_off[i]:c.ex_off[i + 1]]
        marks = values[off[i]:off[i + 1]]
        if len(marks) != 2 * len(ids):
            continue
        for eid, p in zip(ids, marks[0::2].tolist()):
            if p == packers.Cut.TRUNCATED:
                truncated += 1
                stored.truncated.add(piece_base(eid))
            elif p >= 2 or p == packers.Cut.OLD_PIECE:
                pieces += 1
                stored.split.add(piece_base(eid))
    stored.cuts[name] = (truncated, pieces)


def _check_images(report: Report, name: str, table: pa.Table, c: _Columns, vision: Any) -> np.ndarray:
    """Each row's images, and videos in a contract-5 shard, against its tokens (:func:`packers.rowcheck.check_images`,
    :func:`~packers.rowcheck.check_videos`): every placeholder run of the length its grid gives, inside one example,
    one token id, never a target; one ``second_per_grid_ts`` per video, positive. Returns which rows are broken."""
    from packers.rowcheck import check_images, check_videos

    bad = np.zeros(table.num_rows, dtype=bool)
    try:
        spec = packers.VisionSpec.from_json(vision)
    except (TypeError, ValueError) as e:
        report.add(name, f"check images failed: the manifest's vision spec is unreadable ({e})")
        bad[:] = True
        return bad
    kinds = [("image", check_images)] + ([("video", check_videos)] if "videos" in table.column_names else [])
    for kind, check in kinds:
        offsets = table.column(f"{kind}_offsets").to_pylist()
        grids = table.column(f"{kind}_grid_thw").to_pylist()
        counts = pc.list_value_length(table.column(f"{kind}s")).to_numpy(zero_copy_only=False)
        seconds = table.column("second_per_grid_ts").to_pylist() if kind == "video" else None
        for i in np.flatnonzero(~bad).tolist():
            if not len(offsets[i]) and not len(grids[i]) and not counts[i] and not (seconds and seconds[i]):
                continue
            a, z, m, n = c.tok_off[i], c.tok_off[i + 1], c.seq_off[i], c.seq_off[i + 1]
            f = check(i, c.tok[a:z], c.mask[a:z], np.asarray(c.seq[m:n]), np.asarray(offsets[i]),
                      np.asarray(grids[i]), int(counts[i]), spec)
            if f is None and seconds is not None:
                f = _check_seconds(i, seconds[i], len(offsets[i]))
            if f is not None:
                report.add(f"{name} row {i}", f"check {f.check} failed: {f.detail}")
                bad[i] = True
    return bad


def _check_seconds(row: int, seconds: list, n_videos: int) -> Optional[Failure]:
    """A row's ``second_per_grid_ts``: one per video, each positive and finite."""
    if len(seconds) != n_videos:
        return Failure(row, "videos", f"{len(seconds)} second_per_grid_ts for {n_videos} video_offsets; one per video")
    wrong = [k for k, v in enumerate(seconds) if v is None or not 0 < v < float("inf")]
    if wrong:
        return Failure(row, "videos", f"video {wrong[0]}: second_per_grid_ts is {seconds[wrong[0]]}; the temporal "
                                      "patch over the sampled frame rate is a positive number of seconds")
    return None


def _check_rows(report: Report, name: str, c: _Columns, budget: int) -> np.ndarray:
    """The contract's structure of every row, vectorized (:func:`packers.validate_row` names what is wrong with a
    bad row), and the loss_mask values. Returns which rows are broken."""
    n = np.diff(c.tok_off)
    nseq = np.diff(c.seq_off) - 1
    bad = (n > budget) | (np.diff(c.mask_off) != n) | (c.num != n) | (nseq < 1) | (np.diff(c.ex_off) != nseq)
    has = np.diff(c.seq_off) >= 1
    padded = c.seq if len(c.seq) else np.zeros(1, np.int32)
    first = padded[np.where(has, c.seq_off[:-1], 0)]
    last = padded[np.where(has, c.seq_off[1:] - 1, 0)]
    bad |= ~has | (first != 0) | (last != n)
    if len(c.seq) > 1:
        steps = np.diff(c.seq.astype(np.int64))
        inner = np.ones(len(steps), dtype=bool)
        inner[c.seq_off[1:-1][c.seq_off[1:-1] > 0] - 1] = False  # the step from one row's last offset to the next row's 0
        broken = np.flatnonzero(inner & (steps <= 0))
        bad[np.searchsorted(c.seq_off, broken, side="right") - 1] = True
    for i in np.flatnonzero(bad).tolist():
        row = {"input_ids": c.tok[c.tok_off[i]:c.tok_off[i + 1]].tolist(),
               "loss_mask": c.mask[c.mask_off[i]:c.mask_off[i + 1]].tolist(),
               "seq_offsets": c.seq[c.seq_off[i]:c.seq_off[i + 1]].tolist(),
               "example_ids": c.exs[c.ex_off[i]:c.ex_off[i + 1]], "num_tokens": int(c.num[i])}
        try:
            packers.validate_row(row, budget)
            why = "holds no sequence; every row holds at least one example"
        except ContractError as e:
            why = str(e)
        report.add(f"{name} row {i}", f"check contract failed: {why}")
    above = np.flatnonzero(c.mask > 1)
    if len(above):
        rows_of = np.searchsorted(c.mask_off, above, side="right") - 1
        for i, j in zip(*np.unique(rows_of, return_index=True)):
            pos = int(above[j] - c.mask_off[i])
            report.add(f"{name} row {int(i)}", f"check loss_mask failed: loss_mask[{pos}] is {int(c.mask[above[j]])}; "
                                               "only 0 and 1 are allowed")
    return bad


def _check_sequences(report: Report, shard: OpenShard, c: _Columns, good: np.ndarray, checks: RowChecks,
                     stored: Stored, images: Optional[list]) -> None:
    """The manifest's row checks on every sequence of the good rows; each sequence recorded in ``stored``, with
    its digest when ``images`` (each row's, :func:`row_images`) is given (``--inputs``)."""
    name, budget = shard.entry.name, checks.budget
    counts = (np.diff(c.seq_off) - 1)[good]
    rows_of = np.repeat(good, counts)
    k_of = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    end_at = c.seq_off[rows_of] + 1 + k_of  # index in seq of each sequence's end offset
    starts = c.tok_off[rows_of] + c.seq[end_at - 1].astype(np.int64)
    stops = c.tok_off[rows_of] + c.seq[end_at].astype(np.int64)
    lengths = stops - starts
    cum = np.concatenate([[0], np.cumsum(c.mask, dtype=np.int64)])
    targets = cum[stops] - cum[starts]
    ids_of = [c.exs[c.ex_off[r] + k] for r, k in zip(rows_of.tolist(), k_of.tolist())]

    def at(s: int) -> str:
        return f"{name} row {int(rows_of[s])} sequence {int(k_of[s])} ({ids_of[s]})"

    if checks.eos_at_boundaries and len(stops):
        last_tok = c.tok[stops - 1]
        for s in np.flatnonzero((last_tok != checks.eos_token_id) & (lengths < budget)).tolist():
            report.add(at(s), f"check eos_at_boundaries failed: ends at seq_offsets[{int(k_of[s]) + 1}]="
                              f"{int(stops[s] - c.tok_off[rows_of[s]])} on token {int(last_tok[s])}, not on EOS "
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
        stored.add(eid, shard.index, int(rows_of[s]), int(k_of[s]))
        if images is not None:
            a, b, r = int(starts[s]), int(stops[s]), int(rows_of[s])
            here = images[r] and images_in(images[r], a - int(c.tok_off[r]), b - int(c.tok_off[r]))
            stored.digest[eid] = piece_digest(c.tok[a:b], c.mask[a:b], [im for _, im in here or ()])


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
            b = gather(table.take(_arrow.array(idx)), check=False)
            f = check_batch(b, plain) if not isinstance(b, Failure) else b
            if f is None:
                break
            row = int(idx[f.row])
            where = f"{name} row {row}"
            if f.sequence is not None:
                where += f" sequence {f.sequence} ({exs[ex_off[row] + f.sequence]})"
            report.add(where, f"check {f.check} failed: {f.detail}")
            idx = np.delete(idx, f.row)  # a row's first failure only; the others are checked again without it


def check_ids(stored: Stored, report: Report) -> None:
    """Every example id once; the copies and pieces of one record in one split."""
    for eid, loc in stored.loc.items():
        if isinstance(loc, list):
            report.add(f"example id {eid}", f"check unique example ids failed: appears {len(loc)} times: "
                                            + "; ".join(stored.where(x, eid) for x in loc))
    if len(set(stored.splits)) < 2:
        return
    for eid, loc in stored.loc.items():
        first = loc[0] if isinstance(loc, list) else loc
        split = stored.splits[stored.place(first)[0]]
        base = _rows.base_id(piece_base(eid))
        had = stored.bases.setdefault(base, split)
        if had != split:
            report.add(stored.where(first, eid), f"check split failed: in {split}, but other copies or pieces of "
                                                 f"record {base} are in {had}")
