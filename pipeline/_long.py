"""The --long policy and the cut marks: each example's spans, and the mark every placed sequence carries.

:func:`long_pieces` cuts the examples over the budget as ``--long`` says; every placed sequence gets a cut mark
``[pieces, length]`` (the rows' ``cuts`` column, :data:`packers.SCHEMA`): ``[0, 0]`` whole, ``[1, N]`` a window
--long truncate kept of N tokens (a pair side whose completion was cut: N its length before, :func:`pair_marks`),
``[n, N]`` piece ``#k`` of the ``n = ceil(N / budget)`` pieces --long split cut N tokens into. Budget 8, an example
of 19 tokens::

    --long truncate   t0.jsonl@9      tokens [0, 8)     mark [1, 19]
    --long split      t0.jsonl@9#0    tokens [0, 8)     mark [3, 19]
                      t0.jsonl@9#1    tokens [8, 16)    mark [3, 19]
                      t0.jsonl@9#2    tokens [16, 19)   mark [3, 19]

>>> cuts_column(np.array([[0, 0], [3, 19], [0, 0]], np.int32), np.array([1, 2])).to_pylist()
[[], [3, 19, 0, 0]]

Pure functions over :class:`pipeline._rows.ExampleBatch` and its placements; :mod:`pipeline._rows` packs with them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

import packers
from packers import LongPolicy
from pipeline import _arrow
from pipeline._formats import Reason
from pipeline._options import PackOptions, TruncateSide

ExampleBatch = Placement = Any
"""Annotations only: a :class:`pipeline._rows.ExampleBatch` and its ``Placement`` (that module imports this one)."""


def long_pieces(batch: ExampleBatch, options: PackOptions, dead: list[tuple[int, Reason, str]], stats: dict[str, int]):
    """Each example's spans under the --long policy: (example index, start, stop, part, mark); part -1 = whole;
    mark (int32 (m, 2)) each span's cut mark ``[pieces, length]`` (the module docstring). The examples it drops go to
    ``dead`` as ``(example index, reason, detail)`` (:func:`pipeline._rows.pieces` makes them dead letters).

    Never a piece without a target token: a truncated example whose kept window has none is
    rejected (``no_target_tokens``); such pieces of a split example are dropped and counted (and
    still count in their siblings' ``pieces``). An example that arrived cut (:attr:`ExampleBatch.marks`)
    keeps its mark; when it is still over the budget, a truncated window is truncated again under
    --long truncate (its mark keeps the original length), and a piece of an earlier split is never
    cut again: it is dropped (``too_long``), as a truncated window is under --long split.
    """
    budget = options.max_tokens
    lengths = batch.lengths
    long = np.flatnonzero(lengths > budget)
    ex = np.arange(len(batch), dtype=np.int64)
    starts = np.zeros(len(batch), np.int64)
    stops = lengths.astype(np.int64).copy()
    parts = np.full(len(batch), -1, np.int64)
    marks = np.zeros((len(batch), 2), np.int32) if batch.marks is None else batch.marks.copy()
    if not len(long):
        return ex, starts, stops, parts, marks
    keep = np.ones(len(batch), dtype=bool)
    extra: list[tuple[int, int, int, int, int, int]] = []
    for i in long.tolist():
        n = int(lengths[i])
        o = int(batch.offsets[i])
        mask = batch.loss_mask[o:o + n]
        why = refusal(batch, i, options)
        if why is not None:
            dead.append((i, Reason.TOO_LONG, why))
            stats["dropped_too_long"] = stats.get("dropped_too_long", 0) + 1
            stats["dropped_too_long_tokens"] = stats.get("dropped_too_long_tokens", 0) + n
            keep[i] = False
        elif options.long is LongPolicy.TRUNCATE:
            a, b = (0, budget) if options.truncate_side is TruncateSide.RIGHT else (n - budget, n)
            if not mask[a:b].any():
                other = "left" if options.truncate_side is TruncateSide.RIGHT else "right"
                dead.append((i, Reason.NO_TARGET_TOKENS,
                             f"{n} tokens > budget {budget}, and the {budget} tokens --long truncate keeps "
                             f"(--truncate-side {options.truncate_side.value}) hold no target token; use "
                             f"--truncate-side {other}, --long split, or a larger --max-tokens"))
                keep[i] = False
                continue
            starts[i], stops[i] = a, b
            if int(marks[i, 0]) != packers.Cut.TRUNCATED:  # a window cut again keeps its original length
                marks[i] = (packers.Cut.TRUNCATED, n)
            stats["truncated_examples"] = stats.get("truncated_examples", 0) + 1
            stats["truncated_tokens"] = stats.get("truncated_tokens", 0) + n - budget
        else:
            keep[i] = False
            stats["split_examples"] = stats.get("split_examples", 0) + 1
            count = -(-n // budget)  # every piece, those dropped below for holding no target included
            for k, a in enumerate(range(0, n, budget)):
                b = min(a + budget, n)
                if mask[a:b].any():
                    extra.append((i, a, b, k, count, n))
                else:
                    stats["no_target_pieces"] = stats.get("no_target_pieces", 0) + 1
                    stats["no_target_piece_tokens"] = stats.get("no_target_piece_tokens", 0) + b - a
    sel = np.flatnonzero(keep)
    ex, starts, stops, parts, marks = ex[sel], starts[sel], stops[sel], parts[sel], marks[sel]
    if extra:
        e = np.array(extra, dtype=np.int64)
        ex, starts, stops, parts = (np.concatenate([ex, e[:, 0]]), np.concatenate([starts, e[:, 1]]),
                                    np.concatenate([stops, e[:, 2]]), np.concatenate([parts, e[:, 3]]))
        marks = np.concatenate([marks, e[:, 4:6].astype(np.int32)])
        order = np.lexsort((parts, ex))  # pieces of one example stay together, in order
        ex, starts, stops, parts, marks = ex[order], starts[order], stops[order], parts[order], marks[order]
    return ex, starts, stops, parts, marks


def refusal(batch: ExampleBatch, i: int, options: PackOptions) -> str | None:
    """Why example ``i`` (over the budget) is dropped whatever the --long policy makes of long examples, or under
    --long drop; None when the policy cuts it. An example with images is never cut; a KTO example never split; a
    piece of an earlier split never cut again, nor a window truncated earlier split (a mark says one cut)."""
    budget, n, marks = options.max_tokens, int(batch.lengths[i]), batch.marks
    mark = [0, 0] if marks is None else marks[i].tolist()
    k = int(batch.images.counts[i]) if batch.images is not None else 0
    labelled = batch.desirable is not None and int(batch.desirable[i]) >= 0
    why = None
    if k:  # an image is never cut, nor an example from its images: such an example goes whole or not at all
        why = (f"{n} tokens > budget {budget}, and the example holds {k} image(s) or video(s), which are never cut (whatever "
               "--long says); use a larger --max-tokens, or smaller images (the processor's max_pixels; for videos "
               "--video-fps, --video-max-frames, --video-max-pixels)")
    elif options.long is LongPolicy.DROP:
        why = f"{n} tokens > budget {budget} (--long drop); use --long split or truncate, or a larger --max-tokens"
    elif options.long is LongPolicy.SPLIT and labelled:  # TRL's KTOTrainer truncates; it never splits
        why = (f"{n} tokens > budget {budget}, and a KTO example (labelled desirable or undesirable) is never "
               "split by --long split: its later pieces would start mid-answer with no prompt and carry the "
               "record's label; use --long truncate (as TRL does) or --long drop, or a larger --max-tokens")
    elif mark[0] not in (packers.Cut.WHOLE, packers.Cut.TRUNCATED):  # its mark could say only one cut
        why = (f"{n} tokens > budget {budget}, and it is a piece of an example split at an earlier pack (cuts "
               f"{mark}), which is never cut again; pack the raw inputs at this --max-tokens")
    elif options.long is LongPolicy.SPLIT and mark[0] == packers.Cut.TRUNCATED:
        why = (f"{n} tokens > budget {budget}, and it is a window of an example of {mark[1]} tokens "
               "truncated at an earlier pack, which --long split does not split again (its pieces' marks could "
               "not say both cuts); use --long truncate, or pack the raw inputs at this --max-tokens")
    return why


def pair_marks(batch: ExampleBatch, ex: np.ndarray, side: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """The cut marks of placed pair sides (side ``side[j]`` of pair ``ex[j]``, ``kept[j]`` of its tokens): ``[1, N]``
    for a side whose completion was cut (N its length before: the arrived mark's, for a side truncated at an
    earlier pack), else the mark it arrived with (``[0, 0]`` for a fresh one)."""
    full = np.where(side == 0, batch.cuts[ex], batch.lengths[ex] - batch.cuts[ex])
    marks = (np.zeros((len(ex), 2), np.int32) if batch.marks is None
             else batch.marks.reshape(len(batch), 2, 2)[ex, side].astype(np.int32))
    cut = kept < full
    again = cut & (marks[:, 0] == packers.Cut.TRUNCATED)
    marks[cut & ~again] = np.stack([np.full(len(ex), int(packers.Cut.TRUNCATED)), full], axis=1)[cut & ~again]
    return marks


CUT_STATS = ("cut_truncated", "cut_pieces", "cut_carried")
"""The stats of :func:`cut_counts`, the manifest's ``counts.cut_sequences`` (truncated, pieces, carried)."""


def cut_counts(batch: ExampleBatch, placed: Placement) -> dict[str, int]:
    """What the placed sequences' cut marks say, counted from the placements (never by reading shards back): how
    many are truncated windows (``[1, N]``), how many pieces of split examples (``[n >= 2, N]`` or ``[-1, -1]``),
    and of those how many carry the mark their example arrived with (:attr:`ExampleBatch.marks`)."""
    p = placed.marks[:, 0].astype(np.int64)
    carried = 0
    if batch.marks is not None and len(p):
        arrived = batch.marks.reshape(len(batch), -1, 2)
        side = placed.sides if placed.sides is not None else np.zeros(len(p), np.int64)
        carried = int((arrived[placed.ex, side, 0] != packers.Cut.WHOLE).sum())
    return {"cut_truncated": int((p == packers.Cut.TRUNCATED).sum()),
            "cut_pieces": int(((p >= 2) | (p == packers.Cut.OLD_PIECE)).sum()), "cut_carried": carried}


def cuts_column(marks: np.ndarray, row_pieces: np.ndarray) -> pa.ListArray:
    """The rows' ``cuts``: the pieces' marks (in row order, ``row_pieces[r]`` in row ``r``), two per sequence in a
    row where one was cut, none in a row of whole sequences (the module docstring's example)."""
    rows = len(row_pieces)
    row_of = np.repeat(np.arange(rows), row_pieces)
    cut = np.bincount(row_of, weights=marks.any(axis=1), minlength=rows) > 0 if rows else np.zeros(0, bool)
    offsets = np.concatenate([[0], np.cumsum(np.where(cut, 2 * row_pieces, 0))]).astype(np.int64)
    return _arrow.list_array(offsets, marks[cut[row_of]].reshape(-1).astype(np.int32), pa.int32())


def reject_record(source: str, position: int, reason: Reason, detail: str, example_id: str | None = None) -> dict:
    """A dead-letter record. ``position`` is a 1-based line for JSONL, a 0-based index otherwise."""
    rec = {"source": source, "position": position, "reason": reason.value, "detail": detail}
    if example_id is not None:
        rec["example_id"] = example_id
    return rec


def whole_id(example_id: str) -> str:
    """The id of the example a piece was cut from: ``x#2`` -> ``x`` (a record's own id escapes ``#``, so an example id
    holds one only as the piece mark of an example ``--long split`` cut at an earlier pack, which a repack carries)."""
    base, _, k = example_id.rpartition("#")
    return base if base and k.isdigit() else example_id


def carried_pieces(batch: ExampleBatch, options: PackOptions, rejected: list[dict], stats: dict[str, int]) -> ExampleBatch:
    """A repack's pieces of examples an earlier pack split (ids ``<id>#k``, kept in one group by their whole id):
    an example any of whose pieces exceeds this budget goes whole, as one ``too_long`` dead letter: a piece is never
    cut again (it would train a piece of a piece) nor joined back (the first pack's cut stays visible)."""
    budget = options.max_tokens
    long = np.flatnonzero(batch.lengths > budget).tolist()
    bad = {whole_id(batch.ids[i]): i for i in long if whole_id(batch.ids[i]) != batch.ids[i]}
    if not bad:
        return batch
    drop = [i for i, eid in enumerate(batch.ids) if whole_id(eid) in bad]
    for whole, i in sorted(bad.items()):
        n = int(batch.lengths[i])
        rejected.append(reject_record(
            batch.sources[i], batch.positions[i], Reason.TOO_LONG,
            f"{whole} was split into pieces by the pack this folder came from, and its piece {batch.ids[i]} has {n} "
            f"tokens > budget {budget}; a repack never cuts a piece again: pack the raw inputs at --max-tokens "
            f"{budget}, or repack at a budget of at least {n}", whole))
        stats["dropped_too_long"] = stats.get("dropped_too_long", 0) + 1
        stats["dropped_too_long_tokens"] = stats.get("dropped_too_long_tokens", 0) + int(
            sum(int(batch.lengths[j]) for j in drop if whole_id(batch.ids[j]) == whole))
    keep = np.setdiff1d(np.arange(len(batch)), np.array(drop, dtype=np.int64))
    return batch.take(keep)
