"""Row checks over a gathered batch of packed rows: the packed-row contract and the manifest's ``row_checks``.

One vectorized definition (numpy and pyarrow, no torch) that the loader runs on every batch it
yields (:class:`packers.PackedDataset`) and ``packstream verify`` runs over whole shards. The
per-row definition it follows is :func:`packers.validate_row`; ``tests/test_loader_trust.py``
holds the two equal on random valid and broken rows.

A shared contract module: the pipeline (writer, verify, inspect) and the loader both use it, so it
has no leading underscore; users reach the same names through :mod:`packers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packers._tiles import grid_problem
from packers._video import group_runs
from packers._vision import VisionFamily
from packers.manifest import RowChecks
from packers.schema import cut_problem


# -- reading: every gathered batch is checked against the contract and the manifest's row_checks ----------


@dataclass(frozen=True)
class Batch:
    """A gathered batch of rows as flat numpy arrays: ``values[name]`` back to back, ``lengths[name]`` per row."""

    values: dict[str, np.ndarray]  # input_ids, loss_mask, seq_offsets, sides, completion_spans, desirable, cuts
    lengths: dict[str, np.ndarray]  # the same columns (cuts only from a table that has it: contract version 9)
    num_tokens: np.ndarray
    num_targets: np.ndarray
    example_ids: Any  # the gathered example_ids (a ChunkedArray of lists)
    pair_ids: Any  # the gathered pair_ids (a ChunkedArray of lists)


@dataclass(frozen=True)
class Failure:
    """The first broken row of a batch: its index in the batch, the sequence (if the check is per sequence)."""

    row: int
    check: str
    detail: str
    sequence: int | None = None


_NUMERIC_LISTS = ("input_ids", "loss_mask", "seq_offsets", "sides", "completion_spans", "desirable")
_OPTIONAL_LISTS = ("cuts",)
"""Columns of the newer text schema only (contract version 9); a version-6 table has none of them."""
_STRING_LISTS = ("example_ids", "pair_ids")


def gather(table: pa.Table, *, check: bool) -> Batch | Failure:
    """The batch's columns as flat numpy arrays; with ``check``, first the first row holding a null (the
    schema says non-null, but a damaged file may hold them anyway, and numpy cannot view them)."""
    names = _NUMERIC_LISTS + tuple(n for n in _OPTIONAL_LISTS if n in table.column_names)
    cols = {name: table.column(name).combine_chunks() for name in names}
    if check:
        for name in ("num_tokens", "num_targets"):
            if (col := table.column(name)).null_count:
                row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
                return Failure(row, "nulls", f"{name} is null")
        checked = dict(cols)
        for name in _STRING_LISTS:
            col = table.column(name)
            if col.null_count or pc.list_flatten(col).null_count:
                checked[name] = col.combine_chunks()
        for name, col in checked.items():
            if col.null_count:
                return Failure(int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0]), "nulls",
                                f"{name} is null")
            if col.values.null_count:  # a null inside a list: its row is where the list offsets put it
                t = int(np.flatnonzero(col.values.is_null().to_numpy(zero_copy_only=False))[0])
                row = int(np.searchsorted(col.offsets.to_numpy(), t, side="right")) - 1
                return Failure(row, "nulls", f"{name} holds a null value")
    return Batch(
        values={name: col.flatten().to_numpy() for name, col in cols.items()},
        lengths={name: pc.list_value_length(col).to_numpy() for name, col in cols.items()},
        num_tokens=table.column("num_tokens").to_numpy(),
        num_targets=table.column("num_targets").to_numpy(),
        example_ids=table.column("example_ids"),
        pair_ids=table.column("pair_ids"),
    )


def _ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, b) for a, b in zip(starts, stops)])``, vectorized."""
    lens = stops - starts
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    return np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens) + np.arange(total, dtype=np.int64)


def check_batch(b: Batch, checks: RowChecks) -> Failure | None:
    """A row of ``b`` that breaks the packed-row contract or the run's ``row_checks`` (the first one the
    first failing check finds), else None.

    Vectorized: a few numpy passes over the batch's tokens and offsets, no per-token Python. Checks:
    ``num_tokens`` = len(input_ids) <= ``budget``; len(loss_mask) = len(input_ids); one example id per
    sequence; ``seq_offsets`` start at 0, increase strictly, end at len(input_ids); ``loss_mask`` in
    {0, 1}; ``num_targets`` = the targets the Collator's labels keep; the pair columns empty, or, in a
    run of pairs (``row_checks.pairs``), one side, pair id and completion span per sequence, sides
    alternating chosen/rejected, a pair's two sides sharing their pair id and their prompt tokens, each
    span inside its sequence after its first token, ``loss_mask`` 1 exactly on the spans; ``desirable`` empty or
    one of 1, 0, -1 per sequence; ``cuts`` (version 9) empty or a mark per sequence (:func:`packers.schema.cut_problem`:
    ``[0, 0]`` whole, ``[1, N]`` or ``[n >= 2, N]`` with N more than its tokens, a split piece's id ending ``#k``,
    ``[-1, -1]``); then what the
    manifest says every row of the run satisfies: ``eos_at_boundaries``, ``targets_in_every_sequence``,
    ``all_targets`` (see :mod:`packers.manifest`).

    Each test is one numpy pass over the batch, with ``.any()`` first: a good batch (the common case) pays no
    search. Batches are small (a few rows), so numpy's per-call overhead is most of the cost: tests of one
    kind are or-ed into one pass, and the first failing row is then diagnosed with scalars.
    """
    lengths = b.lengths["input_ids"].astype(np.int64)
    if not len(lengths):
        return None
    if (failure := _check_sizes(b, lengths, checks.budget)) is not None:
        return failure
    offsets = b.lengths["seq_offsets"].astype(np.int64)
    ends = offsets.cumsum()  # position in `offs` after each row's offsets
    # Pairs (offs[j], offs[j + 1]) inside one row: a sequence each. The pair across two rows is not one.
    inside = np.ones(len(b.values["seq_offsets"]) - 1, dtype=bool)
    inside[ends[:-1] - 1] = False
    if (failure := _check_offsets(b.values["seq_offsets"], lengths, ends, ends - offsets, inside)) is not None:
        return failure
    mask = b.values["loss_mask"]
    if mask.size and mask.max() > 1:
        t = _first(mask > 1)
        i = int(np.searchsorted(lengths.cumsum(), t, side="right"))
        return Failure(i, "loss_mask_values", f"loss_mask[{t - int(lengths[:i].sum())}] is {int(mask[t])}; only 0 and 1 "
                                              "are allowed")
    seqs = _Sequences.of(b.values["seq_offsets"], lengths, offsets - 1, inside)
    return (_check_pair_columns(b, checks.pairs, seqs) or _check_desirable(b, seqs) or _check_cuts(b, seqs)
            or _check_row_checks(checks, b, seqs) or _check_targets(b, lengths, seqs))


def _first(bad: np.ndarray) -> int:
    return int(bad.argmax())  # the first True (callers have checked that there is one)


def _check_sizes(b: Batch, lengths: np.ndarray, budget: int) -> Failure | None:
    """Each row's lengths: num_tokens, the budget, loss_mask's length, at least one offset, one example id per
    sequence."""
    L, M = lengths, b.lengths["loss_mask"]
    O, E = b.lengths["seq_offsets"].astype(np.int64), pc.list_value_length(b.example_ids).to_numpy()
    if not (bad := (b.num_tokens != L) | (L > budget) | (M != L) | (O < 1) | (E != O - 1)).any():
        return None
    i = _first(bad)
    n, m, o, e, nt = int(L[i]), int(M[i]), int(O[i]), int(E[i]), int(b.num_tokens[i])
    if nt != n:
        return Failure(i, "num_tokens", f"num_tokens is {nt}, input_ids has {n} tokens")
    if n > budget:
        return Failure(i, "budget", f"{n} tokens > budget {budget}")
    if m != n:
        return Failure(i, "loss_mask_length", f"loss_mask has {m} entries, input_ids has {n}")
    if o < 1:
        return Failure(i, "seq_offsets", "seq_offsets is empty; it must start at 0")
    return Failure(i, "example_ids", f"{e} example_ids for {o - 1} sequences")


def _check_offsets(offs: np.ndarray, lengths: np.ndarray, ends: np.ndarray, starts: np.ndarray,
                   inside: np.ndarray) -> Failure | None:
    """Each row's seq_offsets (``offs[starts[i]:ends[i]]``) start at 0, end at its length, increase strictly."""
    if (bad := (offs[starts] != 0) | (offs[ends - 1] != lengths)).any():
        i = _first(bad)
        lo, hi = int(offs[starts[i]]), int(offs[ends[i] - 1])
        what = f"start at 0, got {lo}" if lo != 0 else f"end at len(input_ids)={int(lengths[i])}, got {hi}"
        return Failure(i, "seq_offsets", f"seq_offsets must {what}")
    if (bad := (offs[1:] <= offs[:-1]) & inside).any():
        j = _first(bad)
        i = int(np.searchsorted(ends, j, side="right"))
        k = j - int(starts[i])
        return Failure(i, "seq_offsets", f"seq_offsets must increase strictly: seq_offsets[{k}]={int(offs[j])}, "
                                          f"seq_offsets[{k + 1}]={int(offs[j + 1])}")
    return None


@dataclass(frozen=True)
class _Sequences:
    """The batch's sequences as ``[start, end)`` into its flat token arrays (a row's offsets shifted by the row's
    first token), ``per_row`` of them in each row, whose first token is ``row_base``."""

    start: np.ndarray
    end: np.ndarray
    per_row: np.ndarray
    row_base: np.ndarray

    @classmethod
    def of(cls, offs: np.ndarray, lengths: np.ndarray, per_row: np.ndarray, inside: np.ndarray) -> "_Sequences":
        row_base = lengths.cumsum() - lengths
        g = offs + np.repeat(row_base, per_row + 1)
        return cls(g[:-1][inside], g[1:][inside], per_row, row_base)

    def failure(self, j: int, check: str, detail: str) -> Failure:
        """The failure of the batch's sequence ``j``, as its row and its index in that row."""
        ends = self.per_row.cumsum()  # position in the sequence arrays after each row's sequences
        i = int(np.searchsorted(ends, j, side="right"))
        return Failure(i, check, detail, sequence=j - int(ends[i] - self.per_row[i]))


def row_sums(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """int64 ``values[starts[i]:starts[i] + lengths[i]].sum()`` for each row, rows laid back to back (an empty row
    sums to 0): one ``np.add.reduceat``, ten times a cumulative sum's speed on a batch's masks.

    >>> row_sums(np.array([1, 0, 1, 1, 1], np.uint8), np.array([0, 2, 2]), np.array([2, 0, 3])).tolist()
    [1, 0, 3]
    """
    out = np.zeros(len(starts), np.int64)
    full = np.flatnonzero(np.asarray(lengths) > 0)
    if len(full):
        end = int(starts[full[-1]] + lengths[full[-1]])
        out[full] = np.add.reduceat(values[:end], np.asarray(starts)[full], dtype=np.int64)
    return out


def _check_targets(b: Batch, lengths: np.ndarray, seqs: _Sequences) -> Failure | None:
    """num_targets: the row's loss_mask ones, less those on a sequence's first token. Last: a moved boundary also
    changes the count, and the checks before explain it better."""
    mask = b.values["loss_mask"]
    seq_row = np.repeat(np.arange(len(lengths)), seqs.per_row)
    base = seqs.row_base
    first = np.bincount(seq_row, weights=mask[seqs.start], minlength=len(lengths)).astype(np.int64)
    targets = row_sums(mask, base, lengths) - first
    if (bad := b.num_targets != targets).any():
        i = _first(bad)
        return Failure(i, "num_targets", f"num_targets is {int(b.num_targets[i])}, the row has {int(targets[i])} targets "
                                          "(loss_mask 1, not on a sequence's first token)")
    return None


def _check_row_checks(checks: RowChecks, b: Batch, seqs: _Sequences) -> Failure | None:
    """What the manifest's ``row_checks`` say every row of the run satisfies."""
    budget = checks.budget
    ids, mask = b.values["input_ids"], b.values["loss_mask"]
    seq_start, seq_end = seqs.start, seqs.end
    if not (checks.eos_at_boundaries or checks.targets_in_every_sequence or checks.all_targets) or not mask.size:
        return None
    if checks.eos_at_boundaries and seq_end.size:
        last = ids[seq_end - 1]
        if (bad := (last != checks.eos_token_id) & (seq_end - seq_start < budget)).any():
            j = _first(bad)
            return seqs.failure(j, "eos_at_boundaries",
                                f"ends on token {int(last[j])}, not on eos_token_id {checks.eos_token_id}, and is shorter "
                                f"than the budget {budget}: the example boundaries are not where the run put them "
                                "(examples would attend to each other)")
    # A sequence whose last token is a target has one (the usual case: the answer ends it); only the others
    # are scanned. Sequences tile the batch's tokens (checked above), so reduceat over their starts covers
    # exactly each one; the mask is 0/1 (checked above), so viewing it as bool is exact.
    if checks.targets_in_every_sequence and seq_start.size and (unsure := mask[seq_end - 1] == 0).any():
        if (bad := unsure & ~np.logical_or.reduceat(mask.view(bool), seq_start)).any():
            return seqs.failure(_first(bad), "targets_in_every_sequence",
                                "has no target token (loss_mask all 0), but the run put a target in every sequence")
    if checks.all_targets and not mask.all():
        t = _first(mask == 0)
        j = int(np.searchsorted(seq_start, t, side="right")) - 1
        return seqs.failure(j, "all_targets", f"its token {t - int(seq_start[j])} has loss_mask 0, but the run trains "
                                              "on every token (--train-on all)")
    return None


def _flat_strings(col: Any) -> pa.Array:
    """The values of a (chunked) list<string> column as one array."""
    flat = pc.list_flatten(col)
    return flat.combine_chunks() if isinstance(flat, pa.ChunkedArray) else flat


def _check_desirable(b: Batch, seqs: _Sequences) -> Failure | None:
    """The ``desirable`` column: per row empty or one value per sequence, each 1, 0 or -1 (no label)."""
    D = b.lengths["desirable"].astype(np.int64)
    if (bad := (D != 0) & (D != seqs.per_row)).any():
        i = _first(bad)
        return Failure(i, "desirable", f"holds {int(D[i])} values for {int(seqs.per_row[i])} sequences; one per "
                                       "sequence, or none")
    values = b.values["desirable"]
    if values.size and ((values > 1) | (values < -1)).any():
        t = _first((values > 1) | (values < -1))
        i = int(np.searchsorted(D.cumsum(), t, side="right"))
        return Failure(i, "desirable", f"holds {int(values[t])}; only 1 (desirable), 0 (undesirable) and -1 (no label)")
    return None


def _check_cuts(b: Batch, seqs: _Sequences) -> Failure | None:
    """The ``cuts`` column (contract version 9; nothing to check in a version-6 batch): per row empty or two values
    per sequence, each mark as :func:`packers.schema.cut_problem` says. Vectorized over the marks; only the ids of
    split pieces (rare) are read, to check their ``#k``."""
    if "cuts" not in b.lengths:
        return None
    C = b.lengths["cuts"].astype(np.int64)
    if (bad := (C != 0) & (C != 2 * seqs.per_row)).any():
        i = _first(bad)
        return Failure(i, "cuts", f"holds {int(C[i])} values for {int(seqs.per_row[i])} sequences; two ([pieces, length]) "
                                  "per sequence, or none in a row where no sequence was cut")
    if not C.any():
        return None
    marked = np.flatnonzero(np.repeat(C > 0, seqs.per_row))  # the batch's sequences that carry a mark, in order
    marks = b.values["cuts"].astype(np.int64).reshape(-1, 2)
    p, n = marks[:, 0], marks[:, 1]
    own = (seqs.end - seqs.start)[marked]
    cut = (p == 1) | (p >= 2)
    bad = (p < -1) | ((p == 0) & (n != 0)) | ((p == -1) != (n == -1)) | (cut & (n <= own))
    piece = np.flatnonzero(((p >= 2) | (p == -1)) & ~bad)
    if len(piece):  # a split piece's id ends with #k, k < n
        ids = _flat_strings(b.example_ids).take(pa.array(marked[piece])).to_pylist()
        for m, eid in zip(piece.tolist(), ids):
            if cut_problem(int(p[m]), int(n[m]), int(own[m]), eid) is not None:
                bad[m] = True
                break
    if not bad.any():
        return None
    m = _first(bad)
    j = int(marked[m])
    eid = _flat_strings(b.example_ids)[j].as_py()
    return seqs.failure(j, "cuts", cut_problem(int(p[m]), int(n[m]), int(own[m]), eid) or "")


def _check_pair_columns(b: Batch, pairs: bool, seqs: _Sequences) -> Failure | None:
    """The pair columns of :func:`check_batch` (see :mod:`packers.schema`); ``pairs``: the run packed pairs."""
    nseq, seq_start, seq_end = seqs.per_row, seqs.start, seqs.end
    ids, mask = b.values["input_ids"], b.values["loss_mask"]
    S, P = b.lengths["sides"].astype(np.int64), b.lengths["completion_spans"].astype(np.int64)
    I = pc.list_value_length(b.pair_ids).to_numpy().astype(np.int64)
    want = nseq if pairs else np.zeros_like(nseq)
    if (bad := (S != want) | (P != 2 * want) | (I != want) | ((want % 2) == 1)).any():
        i = _first(bad)
        if not pairs:
            return Failure(i, "pair_columns", f"holds {int(S[i])} sides, {int(I[i])} pair_ids, {int(P[i])} completion_spans, "
                                               "but the run packed no pairs (row_checks.pairs is false): they must be empty")
        return Failure(i, "pair_columns", f"{int(S[i])} sides, {int(I[i])} pair_ids, {int(P[i])} completion_spans for "
                                           f"{int(nseq[i])} sequences; a run of pairs has one side and one pair id, two span "
                                           "offsets per sequence, and whole pairs")
    if not pairs or not seq_start.size:
        return None
    sides = b.values["sides"]
    if (bad := sides != np.arange(sides.size) % 2).any():  # every row holds whole pairs: parity is global
        j = _first(bad)
        return seqs.failure(j, "sides", f"side is {int(sides[j])}, expected {j % 2}: sides alternate chosen (0), "
                                        "rejected (1), chosen first")
    spans = b.values["completion_spans"].astype(np.int64).reshape(-1, 2) + np.repeat(seqs.row_base, nseq)[:, None]
    a, z = spans[:, 0], spans[:, 1]
    if (bad := (a <= seq_start) | (z <= a) | (z > seq_end)).any():
        j = _first(bad)
        return seqs.failure(j, "completion_spans", f"completion span [{int(a[j] - seq_start[j])}, {int(z[j] - seq_start[j])}) "
                                                   f"(from the sequence's start) must lie in its {int(seq_end[j] - seq_start[j])} "
                                                   "tokens, after the first, and hold a token")
    edges = np.zeros(mask.size + 1, dtype=np.int64)
    np.add.at(edges, a, 1)
    np.add.at(edges, z, -1)
    if (bad := (np.cumsum(edges[:-1]) > 0) != mask.view(bool)).any():
        t = _first(bad)
        j = int(np.searchsorted(seq_start, t, side="right")) - 1
        return seqs.failure(j, "completion_spans", f"loss_mask[{t - int(seq_start[j])}] is {int(mask[t])}, but in a "
                                                   "row of pairs loss_mask is 1 exactly on the completion spans")
    prompt = a - seq_start
    if (bad := prompt[0::2] != prompt[1::2]).any():
        j = 2 * _first(bad)
        return seqs.failure(j, "pair_prompt", f"the chosen side's prompt has {int(prompt[j])} tokens, the rejected side's "
                                              f"{int(prompt[j + 1])}; both sides of a pair share one prompt")
    c_tok, r_tok = _ranges(seq_start[0::2], a[0::2]), _ranges(seq_start[1::2], a[1::2])
    if (bad := ids[c_tok] != ids[r_tok]).any():
        t = _first(bad)
        j = 2 * (int(np.searchsorted(np.cumsum(prompt[0::2]), t, side="right")))
        return seqs.failure(j, "pair_prompt", "the chosen and rejected sides' prompt tokens differ; both sides of a pair "
                                              "share one prompt")
    pids = _flat_strings(b.pair_ids)
    n = len(pids)
    same = pc.equal(pids.take(pa.array(np.arange(0, n, 2))), pids.take(pa.array(np.arange(1, n, 2))))
    if not pc.all(same).as_py():
        j = 2 * int(np.flatnonzero(~same.to_numpy(zero_copy_only=False))[0])
        return seqs.failure(j, "pair_ids", f"a chosen side's pair id {pids[j].as_py()!r} differs from the next (rejected) "
                                           f"side's {pids[j + 1].as_py()!r}: the sides of a pair are adjacent")
    suffix = pa.array(np.where(np.arange(n) % 2 == 0, "#chosen", "#rejected"))
    named = pc.equal(pc.binary_join_element_wise(pids, suffix, ""), _flat_strings(b.example_ids))
    if not pc.all(named).as_py():
        j = int(np.flatnonzero(~named.to_numpy(zero_copy_only=False))[0])
        return seqs.failure(j, "pair_ids", f"example id is not its pair id {pids[j].as_py()!r} + "
                                           f"{'#chosen' if j % 2 == 0 else '#rejected'}")
    return None




# -- rows with images (contract version 7) ---------------------------------------------------------------------------


def check_videos(row: int, input_ids: np.ndarray, loss_mask: np.ndarray | None, seq_offsets: np.ndarray,
                 video_offsets: Any, video_grid_thw: Any, n_videos: int, spec: Any) -> Failure | None:
    """:func:`check_images` for a row's video columns (contract version 8)."""
    return _check_runs(row, input_ids, loss_mask, seq_offsets, (video_offsets, video_grid_thw, n_videos), spec, "video")


def check_images(row: int, input_ids: np.ndarray, loss_mask: np.ndarray | None, seq_offsets: np.ndarray,
                 image_offsets: Any, image_grid_thw: Any, n_images: int, spec: Any) -> Failure | None:
    """Row ``row``'s image columns against its tokens (:data:`packers.schema.VISION_SCHEMA`), under the vision spec
    ``spec``: three grid values and one image (``n_images``) per offset; each image's placeholder run
    (``spec.grid_tokens(grid)`` tokens from its offset) after the previous one, inside one sequence, one token id
    throughout (the same for every image), never a target; for an mRoPE spec (Qwen2-VL) never touching the
    previous run (transformers' ``get_rope_index`` groups consecutive image tokens into one image, and raises even
    on the example alone); for LLaVA and Gemma 3 the spec's one square grid; for InternVL a ``(tiles, rows, cols)`` its tile
    limits give (:func:`packers._tiles.grid_problem`); and in each sequence no placeholder token outside
    its images' runs (as many as their grids give). The one definition: the loader, the Collator and
    ``packstream verify`` run it (the Collator with ``loss_mask=None``: it trains what the mask says, as for text
    rows). A failure's detail starts with ``image K:`` when one image breaks a rule. :func:`check_videos`: the same rules
    for a row's video columns (``video_offsets``, ``video_grid_thw``, ``videos``: contract version 8), each video's run
    ``t * h * w / merge**2`` tokens of its own placeholder id."""
    return _check_runs(row, input_ids, loss_mask, seq_offsets, (image_offsets, image_grid_thw, n_images), spec, "image")


def _check_runs(row: int, input_ids: np.ndarray, loss_mask: np.ndarray | None, seq_offsets: np.ndarray,
                runs: tuple[Any, Any, int], spec: Any, what: str) -> Failure | None:
    """:func:`check_images` (``what`` "image") and :func:`check_videos` ("video"): ``runs`` is the offsets, grids and
    number of references."""
    image_offsets, image_grid_thw, n_images = runs
    col = what + "s"
    starts = np.asarray(image_offsets, dtype=np.int64).reshape(-1)
    flat = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1)
    k = starts.shape[0]
    if flat.shape[0] != 3 * k:
        return Failure(row, col, f"{k} {what}_offsets and {flat.shape[0]} {what}_grid_thw values; 3 (t, h, w) per "
                                   f"{what}")
    if n_images != k:
        return Failure(row, col, f"{n_images} {col} for {k} {what}_offsets; one per {what}")
    tiled = spec.family is VisionFamily.INTERNVL  # (tiles, rows, cols), checked by packers._tiles.grid_problem
    square = spec.image_grid(spec.image_size, spec.image_size) if spec.family.square else None  # LLaVA, Gemma 3
    n, last, image_id = len(input_ids), 0, None
    for j, (at, grid) in enumerate(zip(starts.tolist(), flat.reshape(-1, 3).tolist())):
        count = spec.grid_tokens(grid)
        seq = int(np.searchsorted(seq_offsets, at, side="right")) - 1
        where = f"{what} {j}: {count} placeholder tokens (grid {tuple(grid)}) at token {at}"
        if at < last or min(grid) < 1:
            return Failure(row, col, f"{where}: overlaps the previous {what} (it ends at token {last}) or has an "
                                          f"empty grid; {what}_offsets must increase with each {what}'s tokens")
        if j and at == last and spec.family.mrope:
            return Failure(row, col, f"{where} start right where {what} {j - 1} ends, with no text token between; "
                                          f"{spec.family.value}'s model takes touching image runs for one image and "
                                          "cannot run the example even alone: put a token between images (the chat "
                                          f"template's {spec.vision_end or ''}{spec.vision_start or ''} does)")
        if tiled and (why := grid_problem(grid, spec.min_tiles, spec.max_tiles)) is not None:
            return Failure(row, col, f"{where} {why}; the row was packed with another vision spec?")
        if square is not None and tuple(grid) != square:
            return Failure(row, col, f"{where}: every image of the vision spec {spec.name or spec.family.value} "
                                          f"(image_size {spec.image_size}, patch {spec.patch_size}) has grid {square}, "
                                          f"{spec.grid_tokens(square)} tokens; the row was packed with another vision "
                                          "spec?")
        if not 0 <= seq < len(seq_offsets) - 1 or at + count > seq_offsets[seq + 1]:
            return Failure(row, col, f"{where} cross the end of their example (seq_offsets "
                                          f"{np.asarray(seq_offsets).tolist()[:8]}) or of the row ({n} tokens); the row "
                                          "was packed with another vision spec?")
        groups = [(at, count)]
        if what == "video" and spec.family is VisionFamily.QWEN3_VL:  # one run per frame group, timestamps between
            groups = group_runs(input_ids, at, grid, spec.merge_size, int(seq_offsets[seq + 1]))
            if groups is None:
                return Failure(row, col, f"{where}: not {grid[0]} runs of {count // grid[0]} tokens (one per frame "
                                              "group) in its example; the row was packed with another vision spec?")
        for a, c in groups:
            run = np.asarray(input_ids[a:a + c])
            if (run != run[0]).any() or (image_id is not None and run[0] != image_id):
                return Failure(row, col, f"{where}: the tokens there are not one placeholder id repeated, the same as "
                                              f"the first {what}'s ({run[:8].tolist()}...); the row was packed with "
                                              "another vision spec?")
            if loss_mask is not None and np.asarray(loss_mask[a:a + c]).any():
                return Failure(row, col, f"{where} are marked as training targets; a placeholder never is one")
            image_id, last = run[0], a + c
    if image_id is None:
        return None
    # Every placeholder token is in an image's run: a stray one (or a run longer than its grid says) would be read
    # as one more image feature, and the model's count of image tokens would not match its features.
    nseq = len(seq_offsets) - 1
    at_seq = np.searchsorted(seq_offsets, np.flatnonzero(np.asarray(input_ids) == image_id), side="right") - 1
    have = np.bincount(at_seq, minlength=nseq)[:nseq]
    want = np.bincount(np.searchsorted(seq_offsets, starts, side="right") - 1, minlength=nseq,
                       weights=[spec.grid_tokens(g) for g in flat.reshape(-1, 3).tolist()])[:nseq].astype(np.int64)
    if (bad := have != want).any():
        s = int(np.flatnonzero(bad)[0])
        return Failure(row, col, f"sequence {s} holds {int(have[s])} tokens of the placeholder id "
                                      f"{int(image_id)}, its images' grids give {int(want[s])}: a placeholder token "
                                      "outside every image's run (or a run longer than its grid); the row was packed "
                                      "with another vision spec, or changed since packing?", sequence=s)
    return None
