"""Best-fit decreasing, batched: the rows :class:`packers._strategies.BestFit` makes, a length at a time.

``counts[L]`` pieces of each length ``L``, placed longest first. Bins wait in FIFO buckets by remaining capacity,
so the front bin of a bucket is the one that reached that capacity first, the tie rule of ``BestFit``. A bin that
holds ``max_per_row`` pieces or has no room leaves for good. For the ``c`` pieces of length ``L``: take the front
bin of the smallest bucket ``cap >= L``. After one piece it has ``cap - L``; nothing had room in ``[L, cap)``, so
if ``cap - L >= L`` it is still the unique best bin, and it takes ``q = cap // L`` pieces in a row (fewer at the
row cap or when the pieces run out) before the next bin of the bucket. The bucket's bins then move, in order, to
the bucket of their new capacity. When no bucket ``>= L`` is left, ``ceil(c / q)`` bins of ``budget`` open at once.
That is a few thousand steps in all for millions of pieces. Each step records its bins and how many consecutive
pieces each took; at the end these (bin, first piece, count) segments are grouped by bin and expanded.

Best-fit with FIFO bins per capacity follows OLMo-core's ``InstancePacker`` and Ding et al., "Fewer Truncations
Improve Language Modeling" (ICML 2024, https://arxiv.org/abs/2404.10830).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from packers.errors import InternalError

EMPTY = np.zeros(0, dtype=np.int64)
"""A read-only empty int64 array: the default of every index list of a result."""
EMPTY.flags.writeable = False


class _Buckets:
    """Open bins by remaining capacity: ``buckets[d]`` a FIFO of arrays of bin ids, the nonempty ``d`` the set bits
    of one Python int (the smallest ``d >= L`` is one shift and one lowest-bit test away)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.buckets: list[deque | None] = [None] * (budget + 1)
        self.nonempty = 0  # bit d set <=> buckets[d] holds bins

    def smallest_fit(self, length: int) -> tuple[int, deque | None]:
        """(capacity, its bucket) of the best bins for a piece of ``length``; (budget, None) when none fits: new
        bins, as if from an endless bucket at capacity ``budget``."""
        above = self.nonempty >> length
        if not above:
            return self.budget, None
        cap = length + (above & -above).bit_length() - 1
        return cap, self.buckets[cap]

    def put(self, d: int, bins: np.ndarray) -> None:
        if self.buckets[d] is None:
            self.buckets[d] = deque((bins,))
            self.nonempty |= 1 << d
        else:
            self.buckets[d].append(bins)

    def drop_if_empty(self, cap: int) -> None:
        if not self.buckets[cap]:
            self.buckets[cap] = None
            self.nonempty ^= 1 << cap


def _front_bins(dq: deque, need: int) -> np.ndarray:
    """The first ``need`` bins of the bucket ``dq`` (fewer if it holds fewer), taken off it."""
    parts, got = [], 0
    while dq and got < need:
        a = dq.popleft()
        if got + len(a) > need:
            dq.appendleft(a[need - got:])
            a = a[: need - got]
        parts.append(a)
        got += len(a)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _capped_takes(dq: deque, q: int, m: int, per_bin: np.ndarray, c: int) -> tuple[np.ndarray, np.ndarray, int]:
    """With a row cap ``m``, bins of one bucket hold different numbers of pieces: each front bin takes
    ``min(q, m - pieces)`` until ``c`` pieces are placed or the bucket is empty. (bins, takes, pieces placed)."""
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
    return ids, takes, got


def bfd_batched(counts: np.ndarray, budget: int, max_per_row: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The rows that :class:`packers._strategies.BestFit` makes of pieces sorted longest first (module docstring).

    ``counts[L]`` is the number of pieces of length ``L`` (``0 < L <= budget``). Returns positions in the sorted
    sequence, row after row (in placement order within a row), and the number of pieces in each row.
    """
    n = int(counts.sum())
    m = max_per_row
    per_bin = np.zeros(n if m is not None else 0, dtype=np.int64)  # pieces per bin
    buckets = _Buckets(budget)
    n_bins = 0
    step_bins: list[np.ndarray] = []
    step_takes: list[np.ndarray] = []
    for L in np.flatnonzero(counts[::-1][:-1]).tolist():
        L = budget - L
        c = int(counts[L])
        while c:
            cap, dq = buckets.smallest_fit(L)
            q = cap // L
            if m is not None and dq is not None:
                ids, takes, got = _capped_takes(dq, q, m, per_bin, c)
            else:
                if m is not None:
                    q = min(q, m)  # new bins hold no pieces yet
                need = -(-c // q)
                if dq is None:
                    ids = np.arange(n_bins, n_bins + need, dtype=np.int64)
                    n_bins += need
                else:
                    ids = _front_bins(dq, need)
                takes = np.full(len(ids), q, dtype=np.int64)
                used = q * len(ids)
                if used > c:
                    takes[-1] -= used - c
                got = min(used, c)
            if dq is not None:
                buckets.drop_if_empty(cap)
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
                buckets.put(d, head)
            d = cap - last_take * L
            if d and last_open:
                buckets.put(d, ids[-1:])
    return _expand(step_bins, step_takes, n, n_bins)


def _expand(step_bins: list[np.ndarray], step_takes: list[np.ndarray], n: int, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions row after row and pieces per row from the steps' (bin, consecutive pieces taken) segments."""
    if not step_bins:
        return EMPTY, EMPTY
    seg_bin = np.concatenate(step_bins)
    seg_take = np.concatenate(step_takes)
    if int(seg_take.sum()) != n or seg_take.min() < 1:
        raise InternalError(f"batched best-fit placed {int(seg_take.sum())} of {n} pieces")
    seg_first = np.zeros(len(seg_take), dtype=np.int64)
    np.cumsum(seg_take[:-1], out=seg_first[1:])
    g = group_stable(seg_bin, n_bins)  # segments of one bin in placement order
    seg_first, seg_take = seg_first[g], seg_take[g]
    dest = np.zeros(len(seg_take), dtype=np.int64)
    np.cumsum(seg_take[:-1], out=dest[1:])
    pos = np.repeat(seg_first - dest, seg_take)
    pos += np.arange(n, dtype=np.int64)
    sizes = np.bincount(seg_bin, weights=np.concatenate(step_takes), minlength=n_bins).astype(np.int64)
    return pos, sizes


def group_stable(key: np.ndarray, n_keys: int) -> np.ndarray:
    """A stable argsort of ``key`` (ints in [0, n_keys)), as LSD radix passes over 16 bits."""
    if n_keys <= 1 << 16:
        return np.argsort(key.astype(np.uint16), kind="stable")
    if n_keys <= 1 << 32:
        idx = np.argsort((key & 0xFFFF).astype(np.uint16), kind="stable")
        return idx[np.argsort((key[idx] >> 16).astype(np.uint16), kind="stable")]
    return np.argsort(key, kind="stable")
