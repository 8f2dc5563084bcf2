"""Spill files: encoded examples parked on disk between the encode and the pack steps.

The job never moves tokens through a Beam shuffle (a local runner holds every shuffled element
in memory). A read task collects the examples it encodes, up to :data:`SPILL_TOKENS` at a time,
and writes them to a spill file, an Arrow IPC *file* (random access) holding one record batch
per packing group. Only small :class:`Slice` s travel through the shuffle, and a pack step
reads exactly its groups' batches back::

    <output>/.tmp-spill-<run>/part-<task>-<n>-<attempt>.arrow
        batch 0: group 3   example_id | source | position | input_ids | loss_mask | cut
        batch 1: group 12  ...
        batch 2: group 40  ...

    Slice(path, batch=1, group=12, examples=57)   -> the shard that packs group 12

A pack step packs one group and parks its rows the same way, a record batch per output shard
(grouped mode: the one shard the group belongs to; global mode: every shard of the split, its
rows dealt out round-robin), and the write step of a shard streams its groups' rows, in group
order, into the shard file::

    <output>/.tmp-spill-<run>/packed-<split>-<group>-<attempt>.arrow
        batch 0: the rows for shard group % shards   input_ids | loss_mask | seq_offsets | ...

    Piece(group=12, path, batch=0, rows=31)      -> the shard that writes group 12's rows

So groups are packed in parallel on every worker, and a shard's file is only a copy.

Memory is bounded by :data:`SPILL_TOKENS` while encoding and by one group while packing; reads
are plain file reads (no memory maps, so nothing stays resident). The spill folder lives under
the output (storage every worker can reach: local disk for local runs, gs:// or s3:// on a
cluster), has packstream's ``.tmp-`` prefix, and is removed when the job ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from typing import Iterator, Sequence

import numpy as np
import pyarrow as pa

from pipeline import _arrow, _rows, _sink
from pipeline._rows import ExampleBatch, Images
from pipeline._sink import Site

SPILL_TOKENS = 2**20
"""A read task writes a spill file once it holds this many tokens (~5 MB; a few copies while writing) and starts the next."""

SPILL_SCHEMA = pa.schema([
    pa.field("example_id", pa.string(), nullable=False),
    pa.field("source", pa.string(), nullable=False),
    pa.field("position", pa.int64(), nullable=False),
    pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
    pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
    pa.field("cut", pa.int64(), nullable=False),  # a pair's rejected side starts here (-1: not a pair)
    pa.field("desirable", pa.int8(), nullable=False),  # the KTO label: 1, 0, or -1 (none)
])

VISION_SPILL_SCHEMA = pa.schema(list(SPILL_SCHEMA) + [
    pa.field("image_offsets", pa.list_(pa.int32()), nullable=False),  # example-relative (pipeline._rows.Images)
    pa.field("image_grid_thw", pa.list_(pa.int32()), nullable=False),  # 5 per image (_spilled_grids)
    pa.field("images", pa.list_(_rows.IMAGE_STRUCT), nullable=False),
])
"""The spill schema of a ``--processor`` run's examples: each example's images beside its tokens."""

MARKED_SPILL_SCHEMA = pa.schema(list(SPILL_SCHEMA) + [
    pa.field("marks", pa.list_(pa.int32()), nullable=False),  # ExampleBatch.marks: 2 per example, 4 per pair
])
"""The spill schema of a repack's examples that arrived cut: each one's cut marks beside its tokens (text only)."""


@dataclasses.dataclass(frozen=True, order=True)
class Slice:
    """Record batch ``batch`` of spill file ``path``: ``examples`` examples of packing group ``group``."""

    group: int
    path: str
    batch: int
    examples: int


@dataclasses.dataclass(frozen=True, order=True)
class Piece:
    """Record batch ``batch`` of packed file ``path``: ``rows`` packed rows of group ``group`` for one shard."""

    group: int
    path: str
    batch: int
    rows: int


def _is_remote(path: str) -> bool:
    return "://" in path


def spill_folder(output: str, run_id: str) -> str:
    from pipeline._write import join

    return join(output, f".tmp-spill-{run_id}")


def write_part(folder: str, name: str, batch: ExampleBatch, groups: np.ndarray) -> list[Slice]:
    """Write ``batch`` (``groups[i]`` is example i's group) as one spill file, a record batch per group."""
    from pipeline._write import join

    path = join(folder, f"part-{name}-{uuid.uuid4().hex[:12]}.arrow")
    order = np.argsort(groups, kind="stable")
    sorted_groups = groups[order]
    batch = batch.take(order)
    bounds = np.flatnonzero(np.diff(sorted_groups)) + 1
    starts = np.concatenate([[0], bounds]).astype(np.int64)
    stops = np.concatenate([bounds, [len(order)]]).astype(np.int64)
    slices = []
    schema = VISION_SPILL_SCHEMA if batch.images is not None else SPILL_SCHEMA if batch.marks is None \
        else MARKED_SPILL_SCHEMA
    with _ipc_file(path, schema) as w:
        for k, (a, b) in enumerate(zip(starts.tolist(), stops.tolist())):
            w.write_batch(_record_batch(batch, a, b))
            slices.append(Slice(int(sorted_groups[a]), path, k, b - a))
    return slices


def write_packed(folder: str, name: str, group: int,
                 by_shard: dict[int, list[pa.RecordBatch]]) -> list[tuple[int, Piece]]:
    """Park group ``group``'s packed rows, ``by_shard[s]`` (record batches, in row order) for shard ``s``, as one
    file: ``(shard, Piece)`` for each batch (a shard's pieces sort in row order: same group and file, rising index)."""
    from pipeline._write import join

    path = join(folder, f"packed-{name}-{uuid.uuid4().hex[:12]}.arrow")
    out = []
    batches = [(shard, rows) for shard, chunks in sorted(by_shard.items()) for rows in chunks]
    with _ipc_file(path, batches[0][1].schema) as w:
        for k, (shard, rows) in enumerate(batches):
            w.write_batch(rows)
            out.append((shard, Piece(group, path, k, rows.num_rows)))
    return out


def read_piece(piece: Piece) -> pa.RecordBatch:
    """The packed rows of ``piece``."""
    return _read_batch(piece.path, piece.batch)


@contextlib.contextmanager
def _ipc_file(path: str, schema: pa.Schema) -> Iterator[pa.ipc.RecordBatchFileWriter]:
    """An Arrow IPC file writer on a local or remote path (its folder made as needed)."""
    raw = _sink.create(path, Site.SPILL)
    sink = pa.PythonFile(raw, mode="w")
    try:
        with pa.ipc.new_file(sink, schema) as w:
            yield w
    finally:
        sink.close()
        raw.close()


def _record_batch(batch: ExampleBatch, a: int, b: int) -> pa.RecordBatch:
    o = batch.offsets[a:b + 1]
    off32 = (o - o[0]).astype(np.int32)
    columns = [
        _arrow.array(batch.ids[a:b], pa.string()),
        _arrow.array(batch.sources[a:b], pa.string()),
        _arrow.array(batch.positions[a:b], pa.int64()),
        _arrow.list_array(off32, batch.input_ids[o[0]:o[-1]], pa.int32()),
        _arrow.list_array(off32, batch.loss_mask[o[0]:o[-1]], pa.uint8()),
        _arrow.array(np.full(b - a, -1, np.int64) if batch.cuts is None else batch.cuts[a:b], pa.int64()),
        _arrow.array(np.full(b - a, -1, np.int8) if batch.desirable is None else batch.desirable[a:b], pa.int8()),
    ]
    if batch.images is None and batch.marks is None:
        return pa.RecordBatch.from_arrays(columns, schema=SPILL_SCHEMA)
    if batch.images is None:
        w = batch.marks.shape[1]
        columns.append(_arrow.list_array(np.arange(0, (b - a + 1) * w, w, dtype=np.int32),
                                         batch.marks[a:b].astype(np.int32).reshape(-1), pa.int32()))
        return pa.RecordBatch.from_arrays(columns, schema=MARKED_SPILL_SCHEMA)
    imgs = batch.images
    i = imgs.index[a:b + 1]
    off = (i - i[0]).astype(np.int64)
    columns += [_arrow.list_array(off, imgs.offsets[i[0]:i[-1]].astype(np.int32), pa.int32()),
                _arrow.list_array(5 * off, _spilled_grids(imgs, i[0], i[-1]), pa.int32()),
                _rows.image_list(off, imgs.refs[i[0]:i[-1]])]
    return pa.RecordBatch.from_arrays(columns, schema=VISION_SPILL_SCHEMA)


def read_slices(slices: Sequence[Slice]) -> ExampleBatch:
    """The examples of ``slices``, concatenated in the given order."""
    ids, sources, positions, lengths, tok_ids, masks, cuts, labels = [], [], [], [], [], [], [], []
    images: list[Images | None] = []
    marks: list[np.ndarray | None] = []
    for s in slices:
        rb = _read_batch(s.path, s.batch)
        images.append(_read_images(rb) if "image_offsets" in rb.schema.names else None)
        if "marks" in rb.schema.names:
            col = rb.column(rb.schema.get_field_index("marks"))
            flat = _arrow.to_numpy(col.flatten()).astype(np.int32)
            marks.append(flat.reshape(rb.num_rows, -1) if rb.num_rows else flat.reshape(0, 2))
        else:
            marks.append(None)
        cuts.append(_arrow.to_numpy(rb.column(5)))
        labels.append(_arrow.to_numpy(rb.column(6)))
        ids += rb.column(0).to_pylist()
        sources += rb.column(1).to_pylist()
        positions += rb.column(2).to_pylist()
        for col, out in ((rb.column(3), tok_ids), (rb.column(4), masks)):
            offs = _arrow.to_numpy(col.offsets)
            out.append(_arrow.to_numpy(col.values)[offs[0]:offs[-1]])
        lengths.append(np.diff(_arrow.to_numpy(rb.column(3).offsets)))
    if not ids:
        return ExampleBatch.empty()
    cut, label = np.concatenate(cuts), np.concatenate(labels)
    return ExampleBatch.from_arrays(ids, sources, positions, np.concatenate(lengths), np.concatenate(tok_ids),
                                    np.concatenate(masks), None if (cut < 0).all() else cut,
                                    desirable=None if (label < 0).all() else label,
                                    ).with_images(None if all(i is None for i in images) else Images.concat(
                                        [Images.none(len(n)) if i is None else i for i, n in zip(images, lengths)])
                                    ).with_marks(_marks_of(marks, lengths))


def _marks_of(marks: list, lengths: list) -> "np.ndarray | None":
    """The slices' cut marks concatenated (``[0, 0]`` per side for a slice without), or None when none has any."""
    if all(m is None for m in marks):
        return None
    width = next(m.shape[1] for m in marks if m is not None)
    return np.concatenate([np.zeros((len(n), width), np.int32) if m is None else m for m, n in zip(marks, lengths)])


def _spilled_grids(imgs: Images, a: int, z: int) -> np.ndarray:
    """Images ``a..z-1``'s grids as spilled: five int32 per image, ``t, h, w``, whether it is a video, and its
    ``second_per_grid_ts`` as float32 bits."""
    return np.concatenate([imgs.grids[a:z].astype(np.int32), imgs.video[a:z, None].astype(np.int32),
                           imgs.seconds[a:z, None].astype(np.float32).view(np.int32)], axis=1).reshape(-1)


def _read_images(rb: pa.RecordBatch) -> Images:
    """The images of a spill batch written with :data:`VISION_SPILL_SCHEMA`."""
    offs, grids, refs = (rb.column(rb.schema.get_field_index(n)) for n in ("image_offsets", "image_grid_thw", "images"))
    index = _arrow.to_numpy(offs.offsets).astype(np.int64)
    index = index - index[0]
    flat = refs.flatten()
    five = _arrow.to_numpy(grids.flatten()).astype(np.int32).reshape(-1, 5)
    return Images(index, _arrow.to_numpy(offs.flatten()).astype(np.int64), np.ascontiguousarray(five[:, :3]),
                  list(zip(flat.field("path").to_pylist(), flat.field("bytes").to_pylist())), five[:, 3] != 0,
                  np.ascontiguousarray(five[:, 4]).view(np.float32))


def _read_batch(path: str, index: int) -> pa.RecordBatch:
    if _is_remote(path):
        from pipeline import _fs

        with _fs.open(path) as f:
            return pa.ipc.open_file(pa.PythonFile(f, mode="r")).get_batch(index)
    with pa.OSFile(path, "rb") as f:
        return pa.ipc.open_file(f).get_batch(index)
