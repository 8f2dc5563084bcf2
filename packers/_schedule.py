"""Epoch schedules: which rows each rank trains at each step; every example once, steps balanced in compute.

An epoch's schedule is fixed before the epoch starts, from what the shards already say (each row's token count
and example lengths: no token is read), the same on every rank without communication. Three promises:

* **Exactly once.** Every example is in exactly one micro-batch of the epoch, and every rank gets the
  same number of steps, at any world size: no repeated tail, no dropped tail. When the rows cannot be
  dealt evenly (11 single-row micro-batches for 4 ranks), a few rows are divided at an example boundary
  into two pieces (each example stays whole), until they can. ``schedule.steps`` is exact before training.
* **Balanced steps** (``balance="compute"``). A rank's step time follows its attention cost, which grows
  with the sum of squared example lengths, not with tokens: a row of one 4k-token example costs more
  than a row of forty 100-token ones. With cost ``alpha * sum(l) + beta * sum(l**2)`` per row
  (:class:`packers.CostModel`), rows of similar cost are dealt one to each rank, so every step's most loaded
  rank is close to its mean. The rows themselves are unchanged.
* **No order bias.** Rows are drawn across all shards and packing groups; the steps are then put in an
  order where the step index does not predict the examples' length (stratified by length, random within).

One epoch, 10 rows, world size 2, ``batch_size=2`` rows, ``balance="compute"``::

    row cost        r0 9  r1 2  r2 7  r3 4  r4 8  r5 1  r6 3  r7 6  r8 5  r9 9
    sorted, cut     [r0 r9] [r4 r2] [r7 r8] [r3 r6] [r1 r5]         tiers: one row per rank, similar costs
    tiers shuffled  [r7 r8] [r1 r5] [r0 r9] [r4 r2] [r3 r6]
    steps of 2      step a: [r7 r8] [r1 r5]     step b: [r0 r9] [r4 r2]     step c: [r3 r6]
    heaviest tier   step a  rank 0: r7 r5 (6+1)   rank 1: r8 r1 (5+2)       each tier's heaviest row goes
    first, to the           ...                                             to the least loaded rank
    least loaded    step c  rank 0: r3 (4)        rank 1: r6 (3)            (fewer tiers: still one row each)
    step order      stratified by the steps' mean example length, random within each stratum

With ``balance="none"`` the epoch's shuffled rows are cut into micro-batches in order; with ``"tokens"``, the
tiers sort by token count. ``batch_by`` decides how many tiers a step takes: ``rows``, ``batch_size`` tiers (so
each micro-batch holds ``batch_size`` rows); ``tokens``, as many as keep every micro-batch within ``batch_size``
tokens; ``examples``, as many as bring the step closest to ``batch_size x world_size`` examples.

Loss weights are scheduled here too: :func:`step_denominators` gives each optimizer step (``grad_accum``
micro-batches on every rank) the global denominator of its loss, known before training.

Pure numpy: importable without torch (``bench/bench_balance.py`` schedules epochs of real lengths).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from packers._options import Balance, Batching, BatchBy, Sampling
from packers.errors import InternalError, PackstreamError


@dataclass(frozen=True)
class Rows:
    """What the schedule knows of each row: its tokens and its examples' lengths (from the shards' ``num_tokens``
    and ``seq_offsets``; no token is read). Sequences are numbered across rows, row ``i`` holding
    ``seq_start[i]:seq_start[i + 1]``."""

    tokens: np.ndarray  # int64 [N]
    seq_start: np.ndarray  # int64 [N + 1]
    seq_lens: np.ndarray  # int64 [S]
    grain: int = 1
    """Sequences per example: 2 in rows of preference pairs (a pair's chosen and rejected sides are one
    example, never divided), else 1. A row is only ever cut where an example ends."""

    @classmethod
    def from_lengths(cls, rows: Sequence[Sequence[int]], grain: int = 1) -> "Rows":
        """From each row's sequence lengths (tests, benchmarks); ``grain=2``: rows of pairs."""
        lens = np.array([n for r in rows for n in r], dtype=np.int64)
        start = np.concatenate([[0], np.cumsum([len(r) for r in rows])]).astype(np.int64)
        return cls(tokens=np.add.reduceat(lens, start[:-1]) if len(rows) else np.zeros(0, np.int64),
                   seq_start=start, seq_lens=lens, grain=grain)

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Units:
    """What micro-batches hold: rows, or pieces of a row cut at an example boundary (``lo:hi``, sequence numbers
    within the row; a whole row is ``0:sequences``)."""

    row: np.ndarray
    lo: np.ndarray
    hi: np.ndarray

    @classmethod
    def whole(cls, rows: Rows) -> "Units":
        n = len(rows)
        return cls(np.arange(n, dtype=np.int64), np.zeros(n, np.int64), np.diff(rows.seq_start))

    def __len__(self) -> int:
        return len(self.row)

    def sums(self, rows: Rows, per_sequence: np.ndarray) -> np.ndarray:
        """Per unit, the sum of ``per_sequence`` (a value for every sequence of ``rows``) over its sequences."""
        cs = np.concatenate([[0.0], np.cumsum(per_sequence, dtype=np.float64)])
        base = rows.seq_start[self.row]
        return cs[base + self.hi] - cs[base + self.lo]


@dataclass(frozen=True)
class Schedule:
    """One epoch: ``steps`` steps of ``world_size`` micro-batches (one per rank), each a list of units.

    ``order`` lists unit ids micro-batch after micro-batch (step by step, rank by rank); micro-batch
    ``step * world_size + rank`` is ``order[bounds[i]:bounds[i + 1]]``.
    """

    units: Units
    order: np.ndarray
    bounds: np.ndarray
    world_size: int
    grad_accum: int

    @property
    def steps(self) -> int:
        """Micro-batches per rank in the epoch (the same on every rank)."""
        return (len(self.bounds) - 1) // self.world_size

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps in the epoch: ``grad_accum`` micro-batches each, the last one possibly fewer."""
        return -(-self.steps // self.grad_accum)

    def micro_batch(self, step: int, rank: int) -> np.ndarray:
        i = step * self.world_size + rank
        return self.order[self.bounds[i] : self.bounds[i + 1]]


@dataclass(frozen=True)
class _Setup:
    """What shapes every epoch's schedule: the dataset's sampling and batching options, and the world size."""

    sampling: Sampling
    batching: Batching
    world_size: int


def schedule_epoch(rows: Rows, epoch: int, *, sampling: Sampling, batching: Batching, world_size: int) -> Schedule:
    """The schedule of ``epoch`` (all ranks); see the module docstring."""
    s = _Setup(sampling, batching, world_size)
    b = batching
    if b.batch_by is BatchBy.TOKENS and len(rows) and int(rows.tokens.max()) > b.batch_size:
        raise PackstreamError(f"batch_size={b.batch_size} tokens < the longest row ({int(rows.tokens.max())} tokens); "
                              "a row would not fit: use at least the row budget")
    compose = np.random.default_rng([sampling.seed, epoch if sampling.rebatch else 0, 0])
    order_rng = np.random.default_rng([sampling.seed, epoch, 1])
    units = Units.whole(rows)
    if len(rows) == 0:
        return Schedule(units, np.zeros(0, np.int64), np.zeros(1, np.int64), world_size, b.grad_accum)
    seq_cost = rows.seq_lens.astype(np.float64) if b.balance is not Balance.COMPUTE else b.cost.of(rows.seq_lens)
    if b.balance is Balance.NONE:
        mbs, units = _cut_in_order(rows, units, s, compose, seq_cost)
        steps = [mbs[i : i + world_size] for i in range(0, len(mbs), world_size)]
    else:
        steps, units = _deal_tiers(rows, units, s, compose, seq_cost)
    positions = _spread(rows, units, steps, order_rng) if sampling.shuffle else _first_row_order(units, steps)
    order, sizes = [], []
    for i in positions:
        for mb in steps[i]:
            order.append(mb)
            sizes.append(len(mb))
    flat = np.concatenate(order).astype(np.int64)
    bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if len(flat) != len(units) or len(np.unique(flat)) != len(units) or min(sizes) < 1:
        raise InternalError(f"schedule: {len(flat)} unit slots for {len(units)} units, smallest micro-batch {min(sizes)}")
    return Schedule(units, flat, bounds, world_size, b.grad_accum)


# -- balance="none": the shuffled rows in order -------------------------------------------------------------


def _cut_in_order(rows: Rows, units: Units, s: _Setup, rng: np.random.Generator,
                  seq_cost: np.ndarray) -> tuple[list[np.ndarray], Units]:
    """Micro-batches of the (shuffled) rows in order, by ``batch_by``; then as many more as make their number a
    multiple of the world size, by halving the largest ones (a row with several examples in two, if need be)."""
    order = rng.permutation(len(rows)) if s.sampling.shuffle else np.arange(len(rows))
    if s.batching.batch_by is BatchBy.ROWS:
        mbs = [order[i : i + s.batching.batch_size] for i in range(0, len(order), s.batching.batch_size)]
    else:
        counts = (np.diff(rows.seq_start) // rows.grain if s.batching.batch_by is BatchBy.EXAMPLES else rows.tokens)[order]
        mbs = _greedy(order, counts, s)
    missing = -len(mbs) % s.world_size
    for _ in range(missing):
        sizes = np.fromiter((len(m) for m in mbs), np.int64, len(mbs))
        i = int(sizes.argmax())
        if sizes[i] >= 2:  # halve the micro-batch with the most rows
            half = len(mbs[i]) // 2
            mbs[i : i + 1] = [mbs[i][:half], mbs[i][half:]]
            continue
        # every micro-batch holds one unit: divide the unit with the most examples at an example boundary
        lone = np.fromiter((m[0] for m in mbs), np.int64, len(mbs))
        nseq = units.hi[lone] - units.lo[lone]
        j = int(nseq.argmax())
        if nseq[j] < 2 * rows.grain:
            raise _uneven(rows, units, s)
        units, new = _split(rows, units, int(lone[j]), seq_cost)
        mbs[j : j + 1] = [mbs[j], np.array([new])]
    return mbs, units


def _greedy(order: np.ndarray, counts: np.ndarray, s: _Setup) -> list[np.ndarray]:
    """Cut ``order`` where the next row would overshoot: ``examples`` adds a row while that lands closer to the
    target (|count + n - T| < |count - T|), ``tokens`` while the total stays within the cap."""
    target, by_examples = s.batching.batch_size, s.batching.batch_by is BatchBy.EXAMPLES
    out, start, count = [], 0, 0
    for i, n in enumerate(counts.tolist()):
        if i > start:
            fits = count + n / 2 < target if by_examples else count + n <= target
            if not fits:
                out.append(order[start:i])
                start, count = i, 0
        count += n
    if start < len(order):
        out.append(order[start:])
    return out


# -- balance="compute"/"tokens": tiers of similar rows, one row of each tier per rank --------------------------


def _deal_tiers(rows: Rows, units: Units, s: _Setup, rng: np.random.Generator,
                seq_cost: np.ndarray) -> tuple[list[list[np.ndarray]], Units]:
    """Steps as lists of ``world_size`` micro-batches (arrays of unit ids), dealt from tiers (module docstring)."""
    w = s.world_size
    cost = units.sums(rows, seq_cost)
    tie = rng.random(len(units)) if s.sampling.shuffle else np.arange(len(units), dtype=np.float64)
    order = np.lexsort((tie, -cost))  # costliest first; ties at random (or by row)
    if len(order) % w:
        units, order = _split_tail(rows, units, order, w, s, seq_cost)
        cost = units.sums(rows, seq_cost)
    if s.sampling.shuffle and s.sampling.rebatch and len(order) >= 2 * w:
        order = _mix_alike(order, cost, w, rng)
    tiers = order.reshape(-1, w)
    tiers = np.take_along_axis(tiers, np.argsort(-cost[tiers], axis=1, kind="stable"), axis=1)  # each: costliest first
    n_tiers = len(tiers)
    # Steps: consecutive tiers of a random (or first-row) order, as many as batch_by allows.
    if s.sampling.shuffle:
        tier_order = rng.permutation(n_tiers)
    else:
        tier_order = np.argsort(units.row[tiers].min(axis=1), kind="stable")
    tiers = tiers[tier_order]
    starts = _tier_steps(rows, units, tiers, s)
    steps: list[list[np.ndarray]] = []
    for a, b in zip(starts, starts[1:]):
        group = tiers[a:b]
        group = group[np.argsort(-cost[group[:, 0]], kind="stable")]  # heaviest tier first
        load = np.zeros(w)
        assigned: list[list[int]] = [[] for _ in range(w)]
        for tier in group:  # longest processing time first: the costliest row to the least loaded rank
            ranks = np.argsort(load, kind="stable")
            load[ranks] += cost[tier]
            for r, u in zip(ranks.tolist(), tier.tolist()):
                assigned[r].append(u)
        steps.append([np.array(sorted(a, key=lambda u: (units.row[u], units.lo[u])), dtype=np.int64) for a in assigned])
    return steps, units


def _split_tail(rows: Rows, units: Units, order: np.ndarray, w: int, s: _Setup,
                seq_cost: np.ndarray) -> tuple[Units, np.ndarray]:
    """Make the number of units a multiple of the world size by dividing the cheapest rows (the tail that would
    leave some ranks without a row in the last step) into pieces at example boundaries, the costliest piece
    first, until the tail fills whole tiers: the last step then holds pieces of similar cost on every rank, and
    every other step whole rows. Where the tail holds too few examples, it takes in the tier before it."""
    head = len(order) - len(order) % w
    while True:
        tail = [int(u) for u in order[head:]]
        trial, pieces = units, list(tail)
        while len(pieces) % w or not pieces:
            nseq = trial.hi[pieces] - trial.lo[pieces]
            c = trial.sums(rows, seq_cost)[pieces]
            c[nseq < 2 * rows.grain] = -1.0
            k = int(c.argmax())
            if c[k] < 0:
                break
            trial, new = _split(rows, trial, pieces[k], seq_cost)
            pieces.append(new)
        if pieces and len(pieces) % w == 0:
            c = trial.sums(rows, seq_cost)[pieces]
            return trial, np.concatenate([order[:head], np.array(pieces, dtype=np.int64)[np.argsort(-c, kind="stable")]])
        if head == 0:
            raise _uneven(rows, units, s)
        head -= w


def _mix_alike(order: np.ndarray, cost: np.ndarray, w: int, rng: np.random.Generator, spread: float = 0.005) -> np.ndarray:
    """New tiers each epoch: units whose costs are within ``spread`` of each other (runs of the sorted order) are
    shuffled among themselves, so which rows share a step changes from epoch to epoch while every tier still
    holds units of nearly equal cost (balance is not given up for the re-pairing)."""
    c = cost[order]
    out = order.copy()
    start = 0
    for i in range(1, len(c) + 1):
        if i == len(c) or c[i] < c[start] * (1 - spread):
            if i - start > 1:
                out[start:i] = out[start:i][rng.permutation(i - start)]
            start = i
    return out


def _tier_steps(rows: Rows, units: Units, tiers: np.ndarray, s: _Setup) -> list[int]:
    """Where each step starts in ``tiers``: ``rows`` takes batch_size tiers; ``tokens`` as many as keep every
    rank within batch_size tokens (counting each tier's longest unit); ``examples`` as many as bring the step
    closest to batch_size x world_size examples."""
    n = len(tiers)
    if s.batching.batch_by is BatchBy.ROWS:
        return list(range(0, n, s.batching.batch_size)) + [n]
    if s.batching.batch_by is BatchBy.TOKENS:
        per_tier = units.sums(rows, rows.seq_lens.astype(np.float64))[tiers].max(axis=1)
        target, by_examples = s.batching.batch_size, False
    else:
        per_tier = ((units.hi - units.lo) // rows.grain)[tiers].sum(axis=1).astype(np.float64)
        target, by_examples = s.batching.batch_size * s.world_size, True
    starts, count = [0], 0.0
    for i, n_i in enumerate(per_tier.tolist()):
        if i > starts[-1]:
            fits = count + n_i / 2 < target if by_examples else count + n_i <= target
            if not fits:
                starts.append(i)
                count = 0.0
        count += n_i
    return starts + [n]


def _split(rows: Rows, units: Units, u: int, seq_cost: np.ndarray) -> tuple[Units, int]:
    """Divide unit ``u`` (>= 2 sequences) at the example boundary that best halves its cost; the second piece
    becomes a new unit at the end. Returns the new units and the new unit's id."""
    base, lo, hi = int(rows.seq_start[units.row[u]]), int(units.lo[u]), int(units.hi[u])
    c = np.cumsum(seq_cost[base + lo : base + hi])
    cuts = np.arange(rows.grain, hi - lo, rows.grain)  # where an example ends (a pair's two sides stay together)
    k = lo + int(cuts[int(np.abs(2 * c[cuts - 1] - c[-1]).argmin())])  # first sequence of the second piece
    row = np.append(units.row, units.row[u])
    new_lo, new_hi = np.append(units.lo, k), np.append(units.hi, hi)
    new_hi[u] = k
    return Units(row, new_lo, new_hi), len(row) - 1


def _uneven(rows: Rows, units: Units, s: _Setup) -> PackstreamError:
    return PackstreamError(
        f"{len(rows)} rows holding {len(rows.seq_lens) // rows.grain} examples cannot give each of world_size={s.world_size} ranks "
        f"the same number of micro-batches without repeating or dropping an example (every piece left holds one "
        f"example); use a world size that divides {len(rows)}, or pack into more, smaller rows (--max-tokens)"
    )


# -- the order of steps --------------------------------------------------------------------------------------


def _spread(rows: Rows, units: Units, steps: list[list[np.ndarray]], rng: np.random.Generator) -> np.ndarray:
    """Step order (step ids by position) where the index does not predict length.

    The steps are ranked by their mean example length and by their sum of squared lengths (the mean of
    the two ranks), cut into about sqrt(steps) strata of similar steps, and block ``j`` of the epoch takes
    the ``j``-th step of every stratum (each stratum shuffled), in random order: every stretch of the epoch
    holds short and long steps alike. What correlation with the index is left (the two measures do not rank
    the steps alike) is then cancelled by :func:`_decorrelate`.
    """
    n = len(steps)
    if n < 3:
        return rng.permutation(n)
    lens = rows.seq_lens.astype(np.float64)
    per_unit = np.stack([units.sums(rows, np.ones_like(lens)), units.sums(rows, lens), units.sums(rows, lens * lens)])
    per_step = np.stack([per_unit[:, np.concatenate(st)].sum(axis=1) for st in steps])
    tie = rng.random(n)
    r_len, r_sq = ranks(per_step[:, 1] / per_step[:, 0]), ranks(per_step[:, 2])
    ranked = np.lexsort((tie, r_len + r_sq))
    q = max(1, int(round(math.sqrt(n))))
    block = np.empty(n, dtype=np.int64)
    for stratum in np.array_split(ranked, q):
        block[stratum] = rng.permutation(len(stratum))
    order = np.lexsort((rng.random(n), block))
    return _decorrelate(order, (r_len, r_sq), rng)


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks from 0, ties sharing their mean rank (as Spearman's rho counts them).

    >>> ranks(np.array([10.0, 30.0, 20.0, 30.0])).tolist()
    [0.0, 2.5, 1.0, 2.5]
    """
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return (first + (counts - 1) / 2)[inverse].astype(np.float64)


def _decorrelate(order: np.ndarray, ranks: tuple[np.ndarray, ...], rng: np.random.Generator,
                 target: float = 2e-3, rounds: int = 64, candidates: int = 2048) -> np.ndarray:
    """Swap pairs of steps until position and every rank vector in ``ranks`` have |Spearman rho| <= ``target``
    (or no swap helps). Each round draws ``candidates`` random pairs and applies the one that lowers the worst
    |rho| most; swapping steps at positions i, j changes a covariance by (i - j) * (r[step_j] - r[step_i])."""
    n = len(order)
    order = order.copy()
    pos = np.arange(n, dtype=np.float64) - (n - 1) / 2
    # A rank vector with no spread (every step alike) cannot correlate with position: its scale is taken as
    # infinite, so its |rho| is 0 (no division by zero, no warning).
    scale = [float(((r - r.mean()) ** 2).sum() ** 0.5 * (pos ** 2).sum() ** 0.5) or math.inf for r in ranks]
    cov = np.array([float((pos * (r[order] - r.mean())).sum()) for r in ranks])
    for _ in range(rounds):
        rho = np.abs(cov) / scale
        if rho.max() <= target:
            break
        i, j = rng.integers(0, n, size=(2, candidates))
        delta = np.stack([(i - j) * (r[order[j]] - r[order[i]]) for r in ranks])  # [len(ranks), candidates]
        new = np.abs(cov[:, None] + delta) / np.array(scale)[:, None]
        worst = new.max(axis=0)
        best = int(worst.argmin())
        if worst[best] >= rho.max():
            break
        order[i[best]], order[j[best]] = order[j[best]], order[i[best]]
        cov = cov + delta[:, best]
    return order


def _first_row_order(units: Units, steps: list[list[np.ndarray]]) -> np.ndarray:
    """Without shuffling: steps in the order of their first row (shard order), deterministic."""
    first = np.array([min(int(units.row[mb].min()) for mb in st) for st in steps])
    return np.argsort(first, kind="stable")


# -- loss denominators -----------------------------------------------------------------------------------------


def step_denominators(schedule: Schedule, rows: Rows, per_sequence: np.ndarray) -> np.ndarray:
    """Per optimizer step, the sum of ``per_sequence`` over every sequence its micro-batches hold on every rank:
    the global denominator of that step's loss (targets, examples, or weighted targets)."""
    per_unit = schedule.units.sums(rows, per_sequence)
    if not len(schedule.order):
        return np.zeros(0)
    per_mb = np.add.reduceat(per_unit[schedule.order], schedule.bounds[:-1])
    step_of_mb = np.arange(len(per_mb)) // schedule.world_size // schedule.grad_accum
    return np.bincount(step_of_mb, weights=per_mb, minlength=schedule.optimizer_steps)
