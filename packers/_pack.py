"""Bin-packing of example lengths into rows of at most ``budget`` tokens.

:func:`pack` is a pure function from an integer array of example lengths to a
:class:`PackResult`: which pieces of which examples go into which row, in CSR form.
Nothing leaves the main path silently: examples longer than the budget are dropped,
truncated or split (:class:`LongPolicy`) and listed, zero-length examples are listed as
``empty``.

How it is organised:

* One per-item loop (:func:`_place_all`) defines every strategy. It asks a strategy one
  question per piece, "which bin does this length go into?" (:meth:`_Fit.find`), and
  tells it the bin's new remaining capacity (:meth:`_Fit.update`). Next-fit, first-fit,
  best-fit and padded differ in that one answer. FFD and next-fit run on it.
* Best-fit decreasing, the default, runs on :func:`_bfd_batched`, which places all pieces
  of one length bin by bin instead of piece by piece. It gives the same rows as the loop
  with :class:`_BestFit` (``tests/test_pack.py`` checks this with hypothesis, and
  :func:`_pack_per_item` runs any strategy on the loop); the sorting and gathering around
  it cost more than the packing itself. Padded is one ``arange``, also checked against the loop.

Best-fit with FIFO bins per capacity follows OLMo-core's ``InstancePacker`` and Ding et al.,
"Fewer Truncations Improve Language Modeling" (ICML 2024, https://arxiv.org/abs/2404.10830).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections import deque
from typing import Iterable, Sequence

import numpy as np

from packers.errors import InternalError, PackstreamError, parse_enum
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


def _positive_int(value: object, name: str, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise PackstreamError(f"{name} must be an integer, got {value!r}; {fix}")
    if value < 1:
        raise PackstreamError(f"{name}={value} must be >= 1; {fix}")
    return int(value)


_MAX_BUDGET = MAX_TOKENS_LIMIT


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Options:
    """The options of :func:`pack` and :func:`pack_stream`, validated once."""

    budget: int
    """Tokens per row."""
    strategy: Strategy = Strategy.BFD
    long: LongPolicy = LongPolicy.DROP
    max_per_row: int | None = None
    """Most pieces in one row; None for no cap."""
    seed: int | None = None
    """Shuffle the order of the rows with this seed; None keeps creation order."""
    refine: bool = False
    """Also pack by minimum bin slack (:func:`_mbs`) and keep whichever uses fewer rows."""

    def __post_init__(self) -> None:
        fix = "pass the row size in tokens, e.g. budget=4096"
        object.__setattr__(self, "budget", _positive_int(self.budget, "budget", fix))
        if self.budget > _MAX_BUDGET:
            raise PackstreamError(f"budget={self.budget:,} tokens > the supported {_MAX_BUDGET:,}; {fix}")
        object.__setattr__(self, "strategy", parse_enum(Strategy, self.strategy, "strategy"))
        object.__setattr__(self, "long", parse_enum(LongPolicy, self.long, "long-example policy"))
        if self.max_per_row is not None:
            fix = "pass max_per_row=None for no cap, or a cap >= 1"
            object.__setattr__(self, "max_per_row", _positive_int(self.max_per_row, "max_per_row", fix))
        if self.refine and self.max_per_row is not None:
            raise PackstreamError(
                f"refine=True cannot honour max_per_row={self.max_per_row} (exact fill has no per-row cap); "
                "pass refine=False or max_per_row=None"
            )
        if self.seed is not None:
            if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
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


_I64 = np.zeros(0, dtype=np.int64)
_I64.flags.writeable = False


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
    dropped: np.ndarray = dataclasses.field(default_factory=lambda: _I64)
    """int64: examples longer than the budget that were not placed (``long="drop"``)."""
    empty: np.ndarray = dataclasses.field(default_factory=lambda: _I64)
    """int64: zero-length examples; never placed."""
    truncated: np.ndarray = dataclasses.field(default_factory=lambda: _I64)
    """int64: examples placed as their first ``budget`` tokens (``long="truncate"``)."""
    split: np.ndarray = dataclasses.field(default_factory=lambda: _I64)
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
        dropped=_I64,
        truncated=_I64,
        split=_I64,
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


def _group_stable(key: np.ndarray, n_keys: int) -> np.ndarray:
    """A stable argsort of ``key`` (ints in [0, n_keys)), as LSD radix passes over 16 bits."""
    if n_keys <= 1 << 16:
        return np.argsort(key.astype(np.uint16), kind="stable")
    if n_keys <= 1 << 32:
        idx = np.argsort((key & 0xFFFF).astype(np.uint16), kind="stable")
        return idx[np.argsort((key[idx] >> 16).astype(np.uint16), kind="stable")]
    return np.argsort(key, kind="stable")


# ---------------------------------------------------------------------------------------
# The per-item loop and its strategies.


class _Fit:
    """A strategy of the per-item loop: where does a piece of a given length go?"""

    decreasing = False
    """Whether pieces are placed longest first (ties by index) rather than in input order."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.n_bins = 0

    def find(self, length: int) -> int:
        """The bin for a piece of ``length`` tokens; ``self.n_bins`` opens a new bin."""
        raise NotImplementedError

    def update(self, b: int, remaining: int) -> None:
        """Bin ``b`` (possibly just opened) now has ``remaining`` free tokens (0 once it is full)."""
        raise NotImplementedError


class _NextFit(_Fit):
    """Only the newest bin is open."""

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.last_remaining = -1

    def find(self, length: int) -> int:
        return self.n_bins - 1 if self.last_remaining >= length else self.n_bins

    def update(self, b: int, remaining: int) -> None:
        self.n_bins = max(self.n_bins, b + 1)
        self.last_remaining = remaining


class _Padded(_Fit):
    """Every piece in a bin of its own."""

    def find(self, length: int) -> int:
        return self.n_bins

    def update(self, b: int, remaining: int) -> None:
        self.n_bins = b + 1


class _FirstFit(_Fit):
    """The lowest-numbered bin that fits: a max segment tree over remaining capacities.

    Bins not yet opened sit in the tree with a full budget, so the leftmost fitting leaf is
    either an open bin or the next bin to open. O(log bins) per piece.
    """

    decreasing = True

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.size = 1024
        self.tree = [budget] * (2 * self.size)

    def find(self, length: int) -> int:
        tree, size = self.tree, self.size
        if tree[1] < length:  # every leaf is an open bin and none fits: double the tree
            leaves = tree[size:] + [self.budget] * size
            size *= 2
            tree = [0] * size + leaves
            for i in range(size - 1, 0, -1):
                tree[i] = max(tree[2 * i], tree[2 * i + 1])
            self.tree, self.size = tree, size
        i = 1
        while i < size:
            i *= 2
            if tree[i] < length:
                i += 1
        return i - size

    def update(self, b: int, remaining: int) -> None:
        self.n_bins = max(self.n_bins, b + 1)
        tree = self.tree
        i = b + self.size
        tree[i] = remaining
        while i > 1:
            i >>= 1
            v = max(tree[2 * i], tree[2 * i + 1])
            if tree[i] == v:
                break
            tree[i] = v


class _BestFit(_Fit):
    """The bin with the least room that fits; among equals, the one that got that room first.

    A plain O(bins) scan per piece: the definition that :func:`_bfd_batched` reproduces.
    """

    decreasing = True

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.remaining: list[int] = []
        self.since: list[int] = []  # when each bin reached its current remaining capacity
        self.clock = 0

    def find(self, length: int) -> int:
        best, key = self.n_bins, None
        for b, (rem, since) in enumerate(zip(self.remaining, self.since)):
            if rem >= length and (key is None or (rem, since) < key):
                best, key = b, (rem, since)
        return best

    def update(self, b: int, remaining: int) -> None:
        if b == self.n_bins:
            self.remaining.append(0)
            self.since.append(0)
            self.n_bins += 1
        self.remaining[b] = remaining
        self.since[b] = self.clock
        self.clock += 1


_LOOP_FITS: dict[Strategy, type[_Fit]] = {
    Strategy.BFD: _BestFit,
    Strategy.FFD: _FirstFit,
    Strategy.NEXT_FIT: _NextFit,
    Strategy.PADDED: _Padded,
}


def _place_all(fit: _Fit, lengths: Sequence[int], budget: int, max_per_row: int | None) -> list[int]:
    """The packing loop: the bin of each piece of ``lengths``, placed in the given order.

    A bin holding ``max_per_row`` pieces is full: the strategy is told it has no room left.
    """
    room: list[int] = []
    count: list[int] = []
    cap = max_per_row or 0
    out = []
    for length in lengths:
        b = fit.find(length)
        if b >= len(room):
            if b > len(room):
                raise InternalError(f"{type(fit).__name__} opened bin {b} after bin {len(room) - 1}")
            room.append(budget)
            count.append(0)
        rem = room[b] - length
        if rem < 0:
            raise InternalError(f"{type(fit).__name__} put {length} tokens in bin {b} with {room[b]} free")
        room[b] = rem
        count[b] += 1
        fit.update(b, 0 if count[b] == cap else rem)
        out.append(b)
    return out


# ---------------------------------------------------------------------------------------
# Best-fit decreasing, batched.


def _bfd_batched(counts: np.ndarray, budget: int, max_per_row: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The rows that :class:`_BestFit` makes of pieces sorted longest first.

    ``counts[L]`` is the number of pieces of length ``L`` (``0 < L <= budget``). Returns
    positions in the sorted sequence, row after row (in placement order within a row), and
    the number of pieces in each row.

    Bins wait in FIFO buckets by remaining capacity, so the front bin of a bucket is the one
    that reached that capacity first, the tie rule of :class:`_BestFit`. A bin that holds
    ``max_per_row`` pieces or has no room leaves for good. The nonempty buckets are the set
    bits of one Python int. For the ``c`` pieces of length ``L``, longest first: take the
    front bin of the smallest bucket ``cap >= L``. After one piece it has
    ``cap - L``; nothing had room in ``[L, cap)``, so if ``cap - L >= L`` it is still the
    unique best bin, and it takes ``q = cap // L`` pieces in a row (fewer at the row cap or
    when the pieces run out) before the next bin of the bucket. The bucket's bins then move,
    in order, to the bucket of their new capacity. When no bucket ``>= L`` is left, open
    ``ceil(c / q)`` bins of ``budget`` at once. That is a few thousand steps in all for
    millions of pieces. Each step records its bins and how many consecutive pieces each
    took; at the end these (bin, first piece, count) segments are grouped by bin and expanded.
    """
    n = int(counts.sum())
    m = max_per_row
    per_bin = np.zeros(n if m is not None else 0, dtype=np.int64)  # pieces per bin
    buckets: list[deque | None] = [None] * (budget + 1)
    nonempty = 0  # bit c set <=> buckets[c] holds bins
    n_bins = 0
    step_bins: list[np.ndarray] = []
    step_takes: list[np.ndarray] = []

    def put(d: int, bins: np.ndarray) -> None:
        nonlocal nonempty
        if buckets[d] is None:
            buckets[d] = deque((bins,))
            nonempty |= 1 << d
        else:
            buckets[d].append(bins)

    for L in np.flatnonzero(counts[::-1][:-1]).tolist():
        L = budget - L
        c = int(counts[L])
        while c:
            above = nonempty >> L
            if above:
                cap = L + (above & -above).bit_length() - 1
                dq = buckets[cap]
            else:  # no bin fits: new bins, as if from an endless bucket at capacity `budget`
                cap, dq = budget, None
            q = cap // L
            if m is not None and dq is not None:
                # Bins of one bucket hold different numbers of pieces: per-bin takes.
                ids_parts, take_parts, got = [], [], 0
                while dq:
                    a = dq.popleft()
                    qa = np.minimum(q, m - per_bin[a])
                    cs = np.cumsum(qa)
                    if got + int(cs[-1]) >= c:
                        k = int(np.searchsorted(cs, c - got)) + 1  # bins needed from `a`
                        if k < len(a):
                            dq.appendleft(a[k:])
                            a, qa = a[:k], qa[:k]
                        qa[-1] -= got + int(cs[k - 1]) - c
                        ids_parts.append(a)
                        take_parts.append(qa)
                        got = c
                        break
                    ids_parts.append(a)
                    take_parts.append(qa)
                    got += int(cs[-1])
                ids = ids_parts[0] if len(ids_parts) == 1 else np.concatenate(ids_parts)
                takes = take_parts[0] if len(take_parts) == 1 else np.concatenate(take_parts)
            else:
                if m is not None:
                    q = min(q, m)  # new bins hold no pieces yet
                need = -(-c // q)
                if dq is None:
                    ids = np.arange(n_bins, n_bins + need, dtype=np.int64)
                    n_bins += need
                else:
                    parts, got = [], 0
                    while dq and got < need:
                        a = dq.popleft()
                        if got + len(a) > need:
                            dq.appendleft(a[need - got:])
                            a = a[: need - got]
                        parts.append(a)
                        got += len(a)
                    ids = parts[0] if len(parts) == 1 else np.concatenate(parts)
                takes = np.full(len(ids), q, dtype=np.int64)
                used = q * len(ids)
                if used > c:
                    takes[-1] -= used - c
                got = min(used, c)
            if dq is not None and not dq:
                buckets[cap] = None
                nonempty ^= 1 << cap
            c -= got
            step_bins.append(ids)
            step_takes.append(takes)
            # Move the bins on. All but the last took `q` pieces (or reached the row cap);
            # the last may have taken fewer.
            last_take = int(takes[-1])
            if m is not None:
                per_bin[ids] += takes
                open_ = per_bin[ids[:-1]] < m
                head = ids[:-1][open_] if not open_.all() else ids[:-1]
                last_open = per_bin[ids[-1]] < m
            else:
                head, last_open = ids[:-1], True
            d = cap - q * L
            if d and len(head):
                put(d, head)
            d = cap - last_take * L
            if d and last_open:
                put(d, ids[-1:])

    if not step_bins:
        return _I64, _I64
    seg_bin = np.concatenate(step_bins)
    seg_take = np.concatenate(step_takes)
    if int(seg_take.sum()) != n or seg_take.min() < 1:
        raise InternalError(f"batched best-fit placed {int(seg_take.sum())} of {n} pieces")
    seg_first = np.zeros(len(seg_take), dtype=np.int64)
    np.cumsum(seg_take[:-1], out=seg_first[1:])
    g = _group_stable(seg_bin, n_bins)  # segments of one bin in placement order
    seg_first, seg_take = seg_first[g], seg_take[g]
    dest = np.zeros(len(seg_take), dtype=np.int64)
    np.cumsum(seg_take[:-1], out=dest[1:])
    pos = np.repeat(seg_first - dest, seg_take)
    pos += np.arange(n, dtype=np.int64)
    sizes = np.bincount(seg_bin, weights=np.concatenate(step_takes), minlength=n_bins).astype(np.int64)
    return pos, sizes


def _rows(bins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions row after row, pieces per row) from the bin of each piece in placement order."""
    n_bins = int(bins.max()) + 1 if len(bins) else 0
    if len(bins) > 1 and not (bins[1:] >= bins[:-1]).all():
        pos = _group_stable(bins, n_bins)
    else:
        pos = np.arange(len(bins), dtype=np.int64)
    return pos, np.bincount(bins, minlength=n_bins)


def _mbs(length: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Minimum bin slack: fill one row at a time as exactly as possible. (piece indices, sizes).

    Each row takes the longest remaining piece (ties: lowest index), then the subset of the
    remaining pieces whose total comes closest to the space left, found by a bounded subset-sum
    over distinct lengths (bitsets as Python ints, binary-split counts, lowest indices first).
    This is Gupta and Ho's MBS' heuristic ("A new heuristic algorithm for the one-dimensional
    bin-packing problem", Production Planning & Control, 1999). It finds near-exact rows where
    best-fit leaves a few tokens in every row (gsm8k alone at 2048: 686 rows vs BFD's 692, lower
    bound 685), and can be worse when long pieces are left for last, hence ``refine`` keeps the
    better of the two. Cost: O(rows * distinct lengths) big-int operations.
    """
    pools: dict[int, deque] = {}
    for i in np.lexsort((np.arange(len(length)), length)).tolist():  # by length, then index
        pools.setdefault(int(length[i]), deque()).append(i)
    ascending = sorted(pools)
    rows: list[int] = []
    sizes: list[int] = []
    while pools:
        top = ascending[-1]
        row = [pools[top].popleft()]
        if not pools[top]:
            del pools[top]
            ascending.pop()
        cap = budget - top
        if cap > 0 and ascending and ascending[0] <= cap:
            full = (1 << (cap + 1)) - 1
            reach, steps = 1, []  # steps: (length, copies, reachable sums before this step)
            for size in ascending:
                if size > cap or reach >> cap & 1:
                    break
                left, k = min(len(pools[size]), cap // size), 1
                while left:
                    t = min(k, left)
                    steps.append((size, t, reach))
                    reach = (reach | (reach << (t * size))) & full
                    left, k = left - t, k * 2
            target = reach.bit_length() - 1
            for size, t, before in reversed(steps):  # walk back: take a step only if needed
                if not before >> target & 1:
                    target -= t * size
                    for _ in range(t):
                        row.append(pools[size].popleft())
                    if not pools[size]:
                        del pools[size]
                        ascending.remove(size)
            if target != 0:
                raise InternalError(f"minimum bin slack: subset-sum walk-back ended at {target}, not 0")
        rows.extend(row)
        sizes.append(len(row))
    return np.array(rows, dtype=np.int64), np.array(sizes, dtype=np.int64)


# ---------------------------------------------------------------------------------------
# Public functions.


def _assemble(pieces: _Pieces, idx: np.ndarray, sizes: np.ndarray, opts: _Options) -> PackResult:
    """PackResult from the pieces ``idx`` row after row, ``sizes`` pieces per row."""
    row_offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=row_offsets[1:])
    order, starts, stops = pieces.spans(idx)
    tokens = np.cumsum(stops if pieces.start is None else stops - starts)
    row_lengths = np.diff(tokens[row_offsets[1:] - 1], prepend=0) if len(tokens) else _I64
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
        pos, sizes = _bfd_batched(counts, opts.budget, opts.max_per_row)
    elif opts.strategy is Strategy.PADDED and not per_item:
        pos = np.arange(len(placed), dtype=np.int64)
        sizes = np.ones(len(placed), dtype=np.int64)
    else:
        bins = _place_all(fit(opts.budget), pieces.length[placed].tolist(), opts.budget, opts.max_per_row)
        pos, sizes = _rows(np.array(bins, dtype=np.int64))
    idx = placed[pos]
    if opts.refine and len(pieces.length):
        exact, exact_sizes = _mbs(pieces.length, opts.budget)
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

    ``refine=True`` also packs by minimum bin slack (exact subset-sum fill, :func:`_mbs`) and keeps
    that packing when it uses fewer rows: the last fraction of a percent of fill, at extra cost.

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
            order=_I64, starts=_I64, stops=_I64, row_offsets=np.zeros(1, np.int64), budget=opts.budget,
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
        group_size = _positive_int(group_size, "group_size", "pass the examples per group, e.g. group_size=10000")
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


# ---------------------------------------------------------------------------------------
# Preference pairs: a pair is one item.


def _pair_lengths(chosen: object, rejected: object, prompt: object | None) -> tuple[np.ndarray, ...]:
    c, r = _as_lengths(chosen), _as_lengths(rejected)
    if c.shape != r.shape:
        raise PackstreamError(f"{len(c)} chosen lengths for {len(r)} rejected lengths; give one of each per pair")
    if prompt is None:
        return c, r, None
    p = _as_lengths(prompt)
    if p.shape != c.shape:
        raise PackstreamError(f"{len(p)} prompt lengths for {len(c)} pairs; give one per pair")
    bad = (p >= np.minimum(c, r)) & (np.minimum(c, r) > 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise PackstreamError(
            f"pair {i}: prompt of {p[i]} tokens leaves no completion (chosen {c[i]}, rejected {r[i]} tokens); "
            "each side is its prompt then at least one completion token"
        )
    return c, r, p


def truncate_pairs(chosen: np.ndarray, rejected: np.ndarray, prompt: np.ndarray, budget: int) -> np.ndarray:
    """The completion length ``L`` at which both sides of each pair are cut so that the pair fits ``budget``.

    A side keeps ``prompt + min(completion, L)`` tokens; ``L`` is the largest value for which the
    two sides together hold at most ``budget`` tokens: half the room left by the two prompts when
    both completions are longer than that, else the room the shorter completion leaves. ``-1``
    where even one completion token per side does not fit (``2 * prompt + 2 > budget``).
    Pairs that fit already get their longer completion's length (nothing is cut).

    >>> truncate_pairs(np.array([10, 10, 8, 5]), np.array([10, 4, 8, 6]), np.array([2, 2, 6, 2]), budget=12)
    array([ 4,  6, -1,  4])
    """
    cc, rc = chosen - prompt, rejected - prompt
    room = budget - 2 * prompt
    short, longer = np.minimum(cc, rc), np.maximum(cc, rc)
    cut = np.where(2 * short >= room, room // 2, np.minimum(room - short, longer))
    cut = np.where(chosen + rejected <= budget, longer, cut)
    return np.where(room >= 2, cut, -1)


def pack_pairs(
    chosen: Sequence[int] | np.ndarray,
    rejected: Sequence[int] | np.ndarray,
    budget: int,
    strategy: Strategy | str = Strategy.BFD,
    *,
    prompt: Sequence[int] | np.ndarray | None = None,
    long: LongPolicy | str = LongPolicy.DROP,
    max_per_row: int | None = None,
    seed: int | None = None,
    refine: bool = False,
) -> PackResult:
    """Pack preference pairs into rows of at most ``budget`` tokens; a pair is never split across rows.

    ``chosen[i]`` and ``rejected[i]`` are the token lengths of pair ``i``'s two sequences (each its
    prompt, then its completion); ``prompt[i]`` is the length of the prompt they share. Each pair is
    one item of the summed length, placed by ``strategy`` as :func:`pack` places an example. The
    result numbers *sequences*: ``2 * i`` is pair ``i``'s chosen side, ``2 * i + 1`` its rejected
    side, and in every row each pair's two sides are adjacent, chosen first.

    A pair longer than the budget follows ``long``: ``drop`` lists both sides in ``dropped``;
    ``truncate`` cuts both completions at one common length (:func:`truncate_pairs`; needs
    ``prompt``), listing the sides it cut in ``truncated``, and drops a pair whose two prompts alone
    leave no room for a completion token each; ``split`` is refused (half a pair trains nothing).
    ``max_per_row`` counts sequences (two per pair).

    >>> r = pack_pairs([6, 3, 9], [5, 4, 9], budget=12, prompt=[2, 1, 3])
    >>> r.rows, r.stops, r.dropped        # pair 0 (11 tokens) | pair 1 (7); pair 2 (18) dropped
    ([array([0, 1]), array([2, 3])], array([6, 5, 3, 4]), array([4, 5]))
    >>> t = pack_pairs([6, 3, 9], [5, 4, 9], budget=12, prompt=[2, 1, 3], long="truncate")
    >>> t.rows, t.stops, t.truncated      # pair 2: both completions cut to 3 tokens
    ([array([4, 5]), array([0, 1]), array([2, 3])], array([6, 6, 6, 5, 3, 4]), array([4, 5]))
    """
    opts = _Options(budget=budget, strategy=strategy, long=long, max_per_row=max_per_row, seed=seed, refine=refine)
    if opts.long is LongPolicy.SPLIT:
        raise PackstreamError(
            "long='split' cannot split a preference pair (each side needs its whole prompt, and half a pair trains "
            "nothing); use long='truncate' (both completions cut at one length) or long='drop'"
        )
    if opts.max_per_row is not None and opts.max_per_row < 2:
        raise PackstreamError(f"max_per_row={opts.max_per_row} is less than one pair (2 sequences); use at least 2")
    c, r, p = _pair_lengths(chosen, rejected, prompt)
    keep_c, keep_r = c.copy(), r.copy()
    total = c + r
    is_long = total > opts.budget
    truncated_tokens = 0
    cut_sides = _I64
    if is_long.any() and opts.long is LongPolicy.TRUNCATE:
        if p is None:
            raise PackstreamError("long='truncate' cuts both completions at one length: pass prompt=[...] lengths")
        i = np.flatnonzero(is_long & (c > 0) & (r > 0))
        cut = truncate_pairs(c[i], r[i], p[i], opts.budget)
        ok = cut >= 0
        i, cut = i[ok], cut[ok]
        keep_c[i] = p[i] + np.minimum(c[i] - p[i], cut)
        keep_r[i] = p[i] + np.minimum(r[i] - p[i], cut)
        truncated_tokens = int((c[i] - keep_c[i]).sum() + (r[i] - keep_r[i]).sum())
        seq = np.stack([2 * i, 2 * i + 1], axis=1).ravel()
        was = np.stack([c[i] > keep_c[i], r[i] > keep_r[i]], axis=1).ravel()
        cut_sides = np.sort(seq[was])
    items = np.where((c == 0) | (r == 0), 0, keep_c + keep_r)
    pair_opts = dataclasses.replace(
        opts, long=LongPolicy.DROP, max_per_row=None if opts.max_per_row is None else opts.max_per_row // 2
    )
    pr = _pack(items, pair_opts)

    def sides(pairs: np.ndarray) -> np.ndarray:
        return np.stack([2 * pairs, 2 * pairs + 1], axis=1).ravel()

    order = sides(pr.order)
    stops = np.stack([keep_c[pr.order], keep_r[pr.order]], axis=1).ravel()
    result = PackResult(
        order=order,
        starts=np.zeros(len(order), dtype=np.int64),
        stops=stops,
        row_offsets=2 * pr.row_offsets,
        budget=opts.budget,
        strategy=opts.strategy,
        long=opts.long,
        max_per_row=opts.max_per_row,
        num_examples=2 * len(c),
        dropped=sides(pr.dropped),
        empty=sides(pr.empty),
        truncated=cut_sides,
        dropped_tokens=int(total[pr.dropped].sum()),
        truncated_tokens=truncated_tokens,
    )
    result.__dict__["row_lengths"] = pr.row_lengths
    return result
