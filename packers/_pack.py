"""Bin-packing of example lengths into rows of at most ``budget`` tokens.

:func:`pack` is a pure function from an integer array of example lengths to a
:class:`PackResult`: which pieces of which examples go into which row, in CSR form.
Nothing leaves the main path silently: examples longer than the budget are dropped,
truncated or split (:class:`LongPolicy`) and listed, zero-length examples are listed as
``empty``.

How it is organised:

* One per-item loop (:func:`packers._strategies.place_all`) defines every strategy. It asks a
  strategy one question per piece, "which bin does this length go into?", and tells it the bin's
  new remaining capacity. Next-fit, first-fit, best-fit and padded differ in that one answer.
  FFD and next-fit run on it.
* Best-fit decreasing, the default, runs on :func:`packers._bfd.bfd_batched`, which places all
  pieces of one length bin by bin instead of piece by piece. It gives the same rows as the loop
  with :class:`packers._strategies.BestFit` (``tests/test_pack.py`` checks this with hypothesis, and
  :func:`_pack_per_item` runs any strategy on the loop); the sorting and gathering around
  it cost more than the packing itself. Padded is one ``arange``, also checked against the loop.
* ``refine`` also packs by minimum bin slack (:func:`packers._strategies.min_bin_slack`).
* Preference pairs, one item each: :func:`packers._pairs.pack_pairs`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Iterable, Sequence, TypedDict

import numpy as np

from packers._bfd import EMPTY, bfd_batched
from packers._strategies import BestFit, FirstFit, Fit, NextFit, Padded, min_bin_slack, place_all, rows_of_bins
from packers.errors import InternalError, PackstreamError, check_int, is_int, parse_enum
from packers.schema import MAX_TOKENS_LIMIT


class Strategy(str, enum.Enum):
    """How pieces are assigned to rows."""

    BFD = "bfd"  #: best-fit decreasing: the fullest row that still fits (default)
    FFD = "ffd"  #: first-fit decreasing: the oldest row that still fits
    NEXT_FIT = "next_fit"  #: input order; a new row when the next piece does not fit
    PADDED = "padded"  #: one piece per row (the unpacked baseline)

    def __str__(self) -> str:
        return self.value


class LongPolicy(str, enum.Enum):
    """What happens to an example longer than the budget. Every case is listed in the result."""

    DROP = "drop"  #: not placed; listed in ``PackResult.dropped``
    TRUNCATE = "truncate"  #: keep its first ``budget`` tokens; listed in ``PackResult.truncated``
    SPLIT = "split"  #: cut into pieces of ``budget`` tokens (the last one shorter); ``PackResult.split``

    def __str__(self) -> str:
        return self.value


_MAX_BUDGET = MAX_TOKENS_LIMIT


class PackKeywords(TypedDict, total=False):
    """The keyword options :func:`pack` takes besides ``strategy``, which :func:`packers.pack_pairs` passes on."""

    long: LongPolicy | str
    max_per_row: int | None
    seed: int | None
    refine: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Options:
    """The options of :func:`pack`, :func:`pack_stream` and :func:`packers.pack_pairs`, validated once."""

    budget: int
    """Tokens per row."""
    strategy: Strategy = Strategy.BFD
    long: LongPolicy = LongPolicy.DROP
    max_per_row: int | None = None
    """Most pieces in one row; None for no cap."""
    seed: int | None = None
    """Shuffle the order of the rows with this seed; None keeps creation order."""
    refine: bool = False
    """Also pack by minimum bin slack (:func:`packers._strategies.min_bin_slack`) and keep whichever uses fewer rows."""

    def __post_init__(self) -> None:
        fix = "pass the row size in tokens, e.g. budget=4096"
        object.__setattr__(self, "budget", check_int(self.budget, "budget", fix=fix))
        if self.budget > _MAX_BUDGET:
            raise PackstreamError(f"budget={self.budget:,} tokens > the supported {_MAX_BUDGET:,}; {fix}")
        object.__setattr__(self, "strategy", parse_enum(Strategy, self.strategy, "strategy"))
        object.__setattr__(self, "long", parse_enum(LongPolicy, self.long, "long-example policy"))
        if self.max_per_row is not None:
            fix = "pass max_per_row=None for no cap, or a cap >= 1"
            object.__setattr__(self, "max_per_row", check_int(self.max_per_row, "max_per_row", fix=fix))
        if self.refine and self.max_per_row is not None:
            raise PackstreamError(
                f"refine=True cannot honour max_per_row={self.max_per_row} (exact fill has no per-row cap); "
                "pass refine=False or max_per_row=None"
            )
        if self.seed is not None:
            if not (is_int(self.seed) and self.seed >= 0):
                raise PackstreamError(f"seed must be a non-negative integer or None, got {self.seed!r}")
            object.__setattr__(self, "seed", int(self.seed))


def _as_lengths(lengths: object) -> np.ndarray:
    """``lengths`` as a 1-D int64 array; PackstreamError for anything else or a negative value."""
    arr = np.asarray(lengths)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise PackstreamError(f"lengths must be a 1-D sequence of integers, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise PackstreamError(
            f"lengths must be integers (token counts), got dtype {arr.dtype}; convert with .astype(int)"
        )
    if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8 and arr.max() > np.iinfo(np.int64).max:
        raise PackstreamError(f"lengths must fit in int64, got {arr.max()}")
    arr = arr.astype(np.int64, copy=False)
    if arr.min() < 0:
        i = int(np.argmax(arr < 0))
        raise PackstreamError(f"example {i} has length {arr[i]} < 0; lengths are token counts")
    return arr


@dataclasses.dataclass(frozen=True, eq=False)
class PackResult:
    """Which pieces of which examples go into which row, in CSR form.

    A piece is a span ``[starts[j], stops[j])`` of the tokens of example ``order[j]``; row
    ``i`` is the pieces ``row_offsets[i]:row_offsets[i + 1]``. A piece is the whole example,
    except for long ones: its first ``budget`` tokens (truncate), or one of its consecutive
    ``budget``-token pieces (split). Within a row, pieces are in the order they were placed
    (for BFD and FFD: longest first, ties by example index; for next-fit: input order).
    Without a seed, rows are in the order they were opened.

    Five examples into rows of 8 tokens; example 2 (11 tokens) is split into ``[0, 8)`` and
    ``[8, 11)``, then best-fit decreasing places 8, 5, 4, 3, 3, 2::

        row 0 | 2[0:8]          |  8 tokens
        row 1 | 0[0:5] 1[0:3]   |  8
        row 2 | 4[0:4] 2[8:11]  |  7
        row 3 | 3[0:2]          |  2

        order        [2  0  1  4  2  3]
        starts       [0  0  0  0  8  0]
        stops        [8  5  3  4 11  2]
        row_offsets  [0  1  3  5  6]

    >>> r = pack([5, 3, 11, 2, 4], budget=8, long="split")
    >>> r.order, r.starts, r.stops, r.row_offsets
    (array([2, 0, 1, 4, 2, 3]), array([0, 0, 0, 0, 8, 0]), array([ 8,  5,  3,  4, 11,  2]), array([0, 1, 3, 5, 6]))
    >>> r.rows
    [array([2]), array([0, 1]), array([4, 2]), array([3])]
    >>> r.row_lengths, r.split
    (array([8, 8, 7, 2]), array([2]))
    """

    order: np.ndarray
    """int64 (pieces,): the example index of each piece, row after row."""
    starts: np.ndarray
    """int64 (pieces,): first token of each piece within its example."""
    stops: np.ndarray
    """int64 (pieces,): one past the last token of each piece within its example."""
    row_offsets: np.ndarray
    """int64 (rows + 1,): row ``i`` is pieces ``row_offsets[i]:row_offsets[i + 1]``."""
    budget: int
    strategy: Strategy
    long: LongPolicy = LongPolicy.DROP
    max_per_row: int | None = None
    num_examples: int = 0
    """Number of input lengths (placed, dropped and empty together)."""
    dropped: np.ndarray = dataclasses.field(default_factory=lambda: EMPTY)
    """int64: examples longer than the budget that were not placed (``long="drop"``)."""
    empty: np.ndarray = dataclasses.field(default_factory=lambda: EMPTY)
    """int64: zero-length examples; never placed."""
    truncated: np.ndarray = dataclasses.field(default_factory=lambda: EMPTY)
    """int64: examples placed as their first ``budget`` tokens (``long="truncate"``)."""
    split: np.ndarray = dataclasses.field(default_factory=lambda: EMPTY)
    """int64: examples placed as several pieces (``long="split"``)."""
    dropped_tokens: int = 0
    """Tokens of the dropped examples."""
    truncated_tokens: int = 0
    """Tokens cut off the truncated examples."""

    @property
    def num_rows(self) -> int:
        return len(self.row_offsets) - 1

    def __len__(self) -> int:
        return self.num_rows

    @property
    def rows(self) -> list[np.ndarray]:
        """The example indices of each row (one array per row; slow for millions of rows)."""
        return np.split(self.order, self.row_offsets[1:-1]) if self.num_rows else []

    @functools.cached_property
    def row_lengths(self) -> np.ndarray:
        """int64 (rows,): tokens in each row."""
        csum = np.zeros(len(self.order) + 1, dtype=np.int64)
        np.cumsum(self.stops - self.starts, out=csum[1:])
        return np.diff(csum[self.row_offsets])


# ---------------------------------------------------------------------------------------
# Pieces: what the strategies place.


@dataclasses.dataclass(frozen=True)
class _Pieces:
    """The pieces to place, in (example index, piece number) order, and what left the path."""

    example: np.ndarray | None
    """The example of each piece; None when piece ``i`` is example ``i``."""
    start: np.ndarray | None
    """The first token of each piece; None when all start at 0."""
    length: np.ndarray
    report: dict

    def spans(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(example, start, stop) of pieces ``idx``."""
        example = idx if self.example is None else self.example[idx]
        stop = self.length[idx]
        if self.start is None:
            return example, np.zeros(len(idx), np.int64), stop
        start = self.start[idx]
        return example, start, start + stop


def _pieces(lengths: np.ndarray, budget: int, long: LongPolicy) -> _Pieces:
    is_empty = lengths == 0
    is_long = lengths > budget
    report = dict(
        num_examples=len(lengths),
        empty=np.flatnonzero(is_empty),
        dropped=EMPTY,
        truncated=EMPTY,
        split=EMPTY,
        dropped_tokens=0,
        truncated_tokens=0,
    )
    any_long = bool(is_long.any())
    if not any_long or long is LongPolicy.DROP:
        keep = ~(is_empty | is_long)
        if any_long:
            report["dropped"] = np.flatnonzero(is_long)
            report["dropped_tokens"] = int(lengths[is_long].sum())
        if keep.all():
            return _Pieces(None, None, lengths, report)
        example = np.flatnonzero(keep)
        return _Pieces(example, None, lengths[example], report)
    if long is LongPolicy.TRUNCATE:
        example = np.flatnonzero(~is_empty)
        length = np.minimum(lengths[example], budget)
        report["truncated"] = np.flatnonzero(is_long)
        report["truncated_tokens"] = int((lengths[is_long] - budget).sum())
        return _Pieces(example, None, length, report)
    # SPLIT: example of length n becomes ceil(n / budget) pieces [k*budget, min((k+1)*budget, n)).
    example = np.flatnonzero(~is_empty)
    n_pieces = -(-lengths[example] // budget)
    total = int(n_pieces.sum())
    first = np.zeros(len(example), dtype=np.int64)
    np.cumsum(n_pieces[:-1], out=first[1:])
    k = np.arange(total, dtype=np.int64) - np.repeat(first, n_pieces)
    example = np.repeat(example, n_pieces)
    start = k * budget
    length = np.minimum(lengths[example] - start, budget)
    report["split"] = np.flatnonzero(is_long)
    return _Pieces(example, start, length, report)


def _decreasing(length: np.ndarray, budget: int) -> np.ndarray:
    """Indices sorting ``length`` (all in [1, budget]) longest first, ties by index."""
    if budget <= np.iinfo(np.uint16).max:
        # numpy sorts 16-bit integers with a stable radix sort: O(n).
        key = length.astype(np.uint16)
        np.subtract(np.uint16(budget), key, out=key)
        return np.argsort(key, kind="stable")
    return np.argsort(-length, kind="stable")


# ---------------------------------------------------------------------------------------
# Public functions.


def _assemble(pieces: _Pieces, idx: np.ndarray, sizes: np.ndarray, opts: _Options) -> PackResult:
    """PackResult from the pieces ``idx`` row after row, ``sizes`` pieces per row."""
    row_offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=row_offsets[1:])
    order, starts, stops = pieces.spans(idx)
    tokens = np.cumsum(stops if pieces.start is None else stops - starts)
    row_lengths = np.diff(tokens[row_offsets[1:] - 1], prepend=0) if len(tokens) else EMPTY
    result = PackResult(
        order=order,
        starts=starts,
        stops=stops,
        row_offsets=row_offsets,
        budget=opts.budget,
        strategy=opts.strategy,
        long=opts.long,
        max_per_row=opts.max_per_row,
        **pieces.report,
    )
    if len(row_lengths) and (row_lengths.max() > opts.budget or sizes.min() < 1):
        raise InternalError(f"{opts.strategy}: a row of {row_lengths.max()} > {opts.budget} tokens, or an empty row")
    result.__dict__["row_lengths"] = row_lengths  # fill the cached_property
    return result


def _shuffle_rows(result: PackResult, seed: int) -> PackResult:
    """The same rows in the order of ``numpy.random.default_rng(seed).permutation``."""
    offsets = result.row_offsets
    perm = np.random.default_rng(seed).permutation(result.num_rows)
    sizes = np.diff(offsets)[perm]
    new_offsets = np.zeros_like(offsets)
    np.cumsum(sizes, out=new_offsets[1:])
    take = np.repeat(offsets[:-1][perm] - new_offsets[:-1], sizes) + np.arange(len(result.order))
    out = dataclasses.replace(
        result, order=result.order[take], starts=result.starts[take], stops=result.stops[take], row_offsets=new_offsets
    )
    out.__dict__["row_lengths"] = result.row_lengths[perm]  # fill the cached_property
    return out


_LOOP_FITS: dict[Strategy, type[Fit]] = {
    Strategy.BFD: BestFit,
    Strategy.FFD: FirstFit,
    Strategy.NEXT_FIT: NextFit,
    Strategy.PADDED: Padded,
}


def _pack(lengths: np.ndarray, opts: _Options, *, per_item: bool = False) -> PackResult:
    """:func:`pack` on validated input; ``per_item=True`` runs every strategy on the per-item loop."""
    pieces = _pieces(lengths, opts.budget, opts.long)
    fit = _LOOP_FITS[opts.strategy]
    # `placed`: the pieces in placement order; `pos`: positions in `placed`, row after row.
    if fit.decreasing:
        placed = _decreasing(pieces.length, opts.budget)
    else:
        placed = np.arange(len(pieces.length), dtype=np.int64)
    if opts.strategy is Strategy.BFD and not per_item:
        counts = np.bincount(pieces.length, minlength=opts.budget + 1)
        pos, sizes = bfd_batched(counts, opts.budget, opts.max_per_row)
    elif opts.strategy is Strategy.PADDED and not per_item:
        pos = np.arange(len(placed), dtype=np.int64)
        sizes = np.ones(len(placed), dtype=np.int64)
    else:
        bins = place_all(fit(opts.budget), pieces.length[placed].tolist(), opts.budget, opts.max_per_row)
        pos, sizes = rows_of_bins(np.array(bins, dtype=np.int64))
    idx = placed[pos]
    if opts.refine and len(pieces.length):
        exact, exact_sizes = min_bin_slack(pieces.length, opts.budget)
        if len(exact_sizes) < len(sizes):
            idx, sizes = exact, exact_sizes
    result = _assemble(pieces, idx, sizes, opts)
    return result if opts.seed is None else _shuffle_rows(result, opts.seed)


def _pack_per_item(
    lengths: Sequence[int] | np.ndarray, budget: int, strategy: Strategy | str = Strategy.BFD, **kw
) -> PackResult:
    """:func:`pack` with every strategy on the per-item loop: the definition the fast paths must match.

    For BFD this is an O(pieces * rows) scan: for tests and small inputs only.
    """
    return _pack(_as_lengths(lengths), _Options(budget=budget, strategy=strategy, **kw), per_item=True)


def pack(
    lengths: Sequence[int] | np.ndarray,
    budget: int,
    strategy: Strategy | str = Strategy.BFD,
    *,
    long: LongPolicy | str = LongPolicy.DROP,
    max_per_row: int | None = None,
    seed: int | None = None,
    refine: bool = False,
) -> PackResult:
    """Pack examples of the given lengths (tokens) into rows of at most ``budget`` tokens.

    ``refine=True`` also packs by minimum bin slack (exact subset-sum fill,
    :func:`packers._strategies.min_bin_slack`) and keeps that packing when it uses fewer rows: the
    last fraction of a percent of fill, at extra cost.

    Deterministic: the same input gives the same rows. BFD and FFD place pieces longest
    first, ties by example index (and a split example's pieces in order); a fitting bin is
    chosen by the strategy (see :class:`Strategy`), never by hash order. ``seed`` shuffles
    the order of the rows, not their contents. See :class:`PackResult` for the output.

    >>> pack([5, 3, 7, 2, 4], budget=8).rows    # BFD: 7 | 5 then 3 | 4 then 2
    [array([2]), array([0, 1]), array([4, 3])]
    >>> pack([5, 3, 7, 2, 4], budget=8, strategy="next_fit").rows
    [array([0, 1]), array([2]), array([3, 4])]
    >>> pack([5, 0, 9], budget=8).dropped, pack([5, 0, 9], budget=8).empty
    (array([2]), array([1]))
    """
    opts = _Options(budget=budget, strategy=strategy, long=long, max_per_row=max_per_row, seed=seed, refine=refine)
    return _pack(_as_lengths(lengths), opts)


def _concat(parts: list[PackResult], offsets: list[int], opts: _Options, num_examples: int) -> PackResult:
    """One PackResult from results over consecutive groups starting at ``offsets``."""
    if not parts:
        return PackResult(
            order=EMPTY, starts=EMPTY, stops=EMPTY, row_offsets=np.zeros(1, np.int64), budget=opts.budget,
            strategy=opts.strategy, long=opts.long, max_per_row=opts.max_per_row, num_examples=num_examples,
        )

    def cat(name: str, shift: bool = True) -> np.ndarray:
        return np.concatenate([getattr(p, name) + (o if shift else 0) for p, o in zip(parts, offsets)])

    row_offsets = [np.zeros(1, np.int64)]
    total = 0
    for p in parts:
        row_offsets.append(p.row_offsets[1:] + total)
        total += len(p.order)
    return PackResult(
        order=cat("order"),
        starts=cat("starts", False),
        stops=cat("stops", False),
        row_offsets=np.concatenate(row_offsets),
        budget=opts.budget,
        strategy=opts.strategy,
        long=opts.long,
        max_per_row=opts.max_per_row,
        num_examples=num_examples,
        dropped=cat("dropped"),
        empty=cat("empty"),
        truncated=cat("truncated"),
        split=cat("split"),
        dropped_tokens=sum(p.dropped_tokens for p in parts),
        truncated_tokens=sum(p.truncated_tokens for p in parts),
    )


def pack_stream(
    lengths: Sequence[int] | np.ndarray | Iterable[Sequence[int] | np.ndarray],
    budget: int,
    group_size: int | None = None,
    *,
    strategy: Strategy | str = Strategy.BFD,
    long: LongPolicy | str = LongPolicy.DROP,
    max_per_row: int | None = None,
    seed: int | None = None,
    refine: bool = False,
) -> PackResult:
    """Pack bounded groups of consecutive examples independently, as a streaming job would.

    With ``group_size``, ``lengths`` is one sequence, cut into groups of ``group_size``
    examples (the last one shorter). Without it, ``lengths`` is an iterable of groups (any
    1-D sequences, e.g. a generator of arrays), consumed one at a time. Each group is packed
    by :func:`pack` on its own; the result numbers examples globally (the first group's
    examples first) and holds the groups' rows in order. ``seed`` then shuffles all rows,
    so with ``group_size >= len(lengths)`` this equals :func:`pack`.

    >>> pack_stream([5, 3, 7, 2, 4], budget=8, group_size=3).rows   # [5, 3, 7] | [2, 4]
    [array([2]), array([0, 1]), array([4, 3])]
    >>> pack_stream(iter([[5, 3], [7, 2, 4]]), budget=8).rows
    [array([0, 1]), array([2]), array([4, 3])]
    """
    opts = _Options(budget=budget, strategy=strategy, long=long, max_per_row=max_per_row, seed=seed, refine=refine)
    per_group = dataclasses.replace(opts, seed=None)
    if group_size is not None:
        group_size = check_int(group_size, "group_size", fix="pass the examples per group, e.g. group_size=10000")
        flat = _as_lengths(lengths)
        groups: Iterable = (flat[i : i + group_size] for i in range(0, len(flat), group_size))
    else:
        if isinstance(lengths, np.ndarray) or isinstance(lengths, (str, bytes)):
            raise PackstreamError(
                "pack_stream needs group_size=N for one sequence of lengths, or an iterable of groups"
            )
        groups = lengths
    parts, offsets, n = [], [], 0
    for group in groups:
        if isinstance(group, (int, np.integer)):
            raise PackstreamError(
                f"pack_stream got a bare length {group!r} as a group; pass group_size=N for one "
                "sequence of lengths, or an iterable of groups"
            )
        g = _as_lengths(group)
        parts.append(_pack(g, per_group))
        offsets.append(n)
        n += len(g)
    result = _concat(parts, offsets, opts, n)
    return result if opts.seed is None else _shuffle_rows(result, opts.seed)
