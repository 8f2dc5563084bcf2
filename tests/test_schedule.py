"""Epoch schedules (packers._schedule), over generated rows: exactly once, equal steps, balanced, no order bias.

Pure numpy (no torch, no shards): the schedule is a function of the rows' example lengths and the options.
The loader's end-to-end version (real shards, iterated rank by rank) is in tests/test_loader.py.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packers import Balance, Batching, BatchBy, CostModel, PackstreamError, Sampling, Sharding
from tests._internals import Rows, Schedule, ranks, schedule_epoch, step_denominators


def schedule(rows: Rows, epoch: int = 0, *, world_size: int = 1, seed: int = 0, shuffle: bool = True,
             rebatch: bool = True, **batching) -> Schedule:
    """The schedule of ``epoch`` with these options (``batching``: :class:`packers.Batching`'s)."""
    return schedule_epoch(rows, epoch, sampling=Sampling(seed=seed, shuffle=shuffle, rebatch=rebatch),
                          batching=Batching(**batching), world_size=world_size)


def spearman(x, y) -> float:
    rx, ry = ranks(np.asarray(x, dtype=np.float64)), ranks(np.asarray(y, dtype=np.float64))  # ties: mean ranks
    return float(np.corrcoef(rx, ry)[0, 1])


def packed_rows(lengths: np.ndarray, budget: int) -> list[list[int]]:
    """First-fit decreasing, as packstream pack's BFD emits rows (long examples first)."""
    rows: list[list[int]] = []
    room = np.zeros(0, dtype=np.int64)
    for n in sorted(lengths.tolist(), reverse=True):
        fits = np.flatnonzero(room >= n)
        if len(fits):
            rows[fits[0]].append(n)
            room[fits[0]] -= n
        else:
            rows.append([n])
            room = np.append(room, budget - n)
    return rows


def long_tail(n: int, budget: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return packed_rows(np.clip(rng.lognormal(5.0, 1.2, n).astype(int), 2, budget), budget)


def sequences_of(sched, rows: Rows) -> Counter:
    """Every (row, sequence) the schedule's micro-batches hold, counted."""
    u = sched.units
    seen: Counter = Counter()
    for i in range(len(sched.bounds) - 1):
        for unit in sched.order[sched.bounds[i] : sched.bounds[i + 1]].tolist():
            seen.update((int(u.row[unit]), k) for k in range(int(u.lo[unit]), int(u.hi[unit])))
    return seen


rows_strategy = st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=6), min_size=0, max_size=60)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=rows_strategy,
    by=st.sampled_from(list(BatchBy)),
    balance=st.sampled_from(list(Balance)),
    size=st.integers(1, 12),
    world=st.integers(1, 8),
    grad_accum=st.integers(1, 4),
    epoch=st.integers(0, 1000),
    seed=st.integers(0, 2**32 - 1),
    shuffle=st.booleans(),
    rebatch=st.booleans(),
)
def test_every_example_exactly_once_and_equal_steps(rows, by, balance, size, world, grad_accum, epoch, seed, shuffle,
                                                    rebatch):
    r = Rows.from_lengths(rows)
    budget = max([sum(x) for x in rows], default=1)
    size = max(size * 10, budget) if by is BatchBy.TOKENS else size
    s = dict(batch_by=by, batch_size=size, world_size=world, grad_accum=grad_accum, balance=balance, seed=seed,
                 shuffle=shuffle, rebatch=rebatch)
    sequences = sum(len(x) for x in rows)
    try:
        sched = schedule(r, epoch, **s)
    except PackstreamError as e:
        # only when no whole number of steps exists: fewer examples than the world size needs pieces
        assert "cannot give each of" in str(e) and sequences < world * -(-len(rows) // world), (e, rows, world)
        return
    assert len(sched.bounds) - 1 == sched.steps * world  # every rank the same number of steps ...
    sizes = np.diff(sched.bounds)
    assert (sizes >= 1).all()  # ... none of them empty
    seen = sequences_of(sched, r)
    assert seen == Counter((i, k) for i, x in enumerate(rows) for k in range(len(x)))  # every example exactly once
    tokens = sched.units.sums(r, r.seq_lens.astype(float))
    for i in range(len(sizes)):
        mb = sched.order[sched.bounds[i] : sched.bounds[i + 1]]
        if by is BatchBy.ROWS:
            assert len(mb) <= size
        if by is BatchBy.TOKENS:
            assert tokens[mb].sum() <= size
    assert sched.optimizer_steps == -(-sched.steps // grad_accum)
    # the same schedule on every rank: a function of the options, the epoch and the rows alone
    again = schedule(r, epoch, **s)
    assert np.array_equal(again.order, sched.order) and np.array_equal(again.bounds, sched.bounds)
    # the loss denominators add up to the epoch's total
    per_seq = np.arange(1, len(r.seq_lens) + 1, dtype=np.float64)
    d = step_denominators(sched, r, per_seq)
    assert len(d) == sched.optimizer_steps and d.sum() == pytest.approx(per_seq.sum())


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("by,size", [(BatchBy.ROWS, 1), (BatchBy.ROWS, 3), (BatchBy.EXAMPLES, 24), (BatchBy.TOKENS, 8192)])
def test_single_row_micro_batches_at_every_world_size(world, by, size):
    """One row per micro-batch and a row count no world size divides: rows are divided at an example boundary
    (never repeated or dropped), and only as many as needed (fewer than the world size)."""
    rows = long_tail(3000, 4096, seed=world)
    r = Rows.from_lengths(rows)
    for balance in Balance:
        sched = schedule(r, 0, batch_by=by, batch_size=size, world_size=world, balance=balance)
        assert sequences_of(sched, r) == Counter((i, k) for i, x in enumerate(rows) for k in range(len(x)))
        assert len(sched.units) - len(rows) < world


def test_an_impossible_plan_is_refused():
    """5 rows of one example each cannot fill equal steps on 4 ranks without a repeat or a drop."""
    r = Rows.from_lengths([[7]] * 5)
    with pytest.raises(PackstreamError, match=r"5 rows holding 5 examples .* world_size=4 .* divides 5"):
        schedule(r, 0, world_size=4)
    sched = schedule(Rows.from_lengths([[7]] * 2 + [[3, 4]] * 3), 0, world_size=4)  # 3 pieces more: ok
    assert sched.steps == 2


def costs_per_step(sched, r: Rows, cost: CostModel) -> np.ndarray:
    c = sched.units.sums(r, cost.of(r.seq_lens))
    return np.array([[c[sched.micro_batch(s, k)].sum() for k in range(sched.world_size)] for s in range(sched.steps)])


@pytest.mark.parametrize("budget,world", [(4096, 8), (4096, 64), (32768, 8), (32768, 64)])
def test_compute_balance_beats_tokens_on_a_long_tail(budget, world):
    """The straggler ratio (sum over steps of the most loaded rank's cost / the mean rank's) is <= 1.05 with
    balance="compute" on a long-tail mix; dealing rows by tokens alone leaves more (bench/bench_balance.py
    reports the real data sets)."""
    r = Rows.from_lengths(long_tail(40 * budget // 100 * world // 8 + 2000, budget, seed=budget + world))
    cost = CostModel.from_config(dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256))
    ratio = {}
    for balance in (Balance.COMPUTE, Balance.NONE):
        per = costs_per_step(schedule(r, 0, world_size=world, balance=balance, cost=cost), r, cost)
        ratio[balance] = per.max(axis=1).sum() / per.mean(axis=1).sum()
    assert ratio[Balance.COMPUTE] <= 1.05 and ratio[Balance.COMPUTE] < ratio[Balance.NONE], ratio


@pytest.mark.parametrize("balance", list(Balance))
@pytest.mark.parametrize("by,size", [(BatchBy.ROWS, 1), (BatchBy.ROWS, 4), (BatchBy.EXAMPLES, 32)])
@pytest.mark.parametrize("world", [1, 8])
def test_step_index_does_not_predict_length(balance, by, size, world):
    """|Spearman rho| of step index vs the step's mean example length, and vs its sum of squared lengths,
    <= 0.05 in every epoch, although packing emits long examples first (the rows come in BFD order)."""
    rows = long_tail(20000, 4096, seed=3)
    r = Rows.from_lengths(rows)
    lens = r.seq_lens.astype(np.float64)
    for epoch in range(3):
        sched = schedule(r, epoch, batch_by=by, batch_size=size, world_size=world, balance=balance, seed=7)
        n, t, q = (sched.units.sums(r, v) for v in (np.ones_like(lens), lens, lens * lens))
        steps = [np.concatenate([sched.micro_batch(s, k) for k in range(world)]) for s in range(sched.steps)]
        mean_len = [t[u].sum() / n[u].sum() for u in steps]
        squares = [q[u].sum() for u in steps]
        assert sched.steps >= 40
        index = np.arange(sched.steps)
        assert abs(spearman(index, mean_len)) <= 0.05 and abs(spearman(index, squares)) <= 0.05


def test_rebatch_pairs_rows_anew_each_epoch_and_off_keeps_them():
    rows = long_tail(5000, 4096, seed=5)
    r = Rows.from_lengths(rows)

    def groups(sched):
        return {frozenset(np.concatenate([sched.micro_batch(s, k) for k in range(4)]).tolist()) for s in range(sched.steps)}

    for balance in Balance:
        s = dict(world_size=4, batch_size=2, balance=balance, seed=1)
        a, b = schedule(r, 0, **s), schedule(r, 1, **s)
        assert len(groups(a) & groups(b)) < len(groups(a)) / 2  # most steps hold other rows next epoch
        fixed = dict(world_size=4, batch_size=2, balance=balance, seed=1, rebatch=False)
        a, b = schedule(r, 0, **fixed), schedule(r, 1, **fixed)
        assert groups(a) == groups(b) and not np.array_equal(a.order, b.order)  # same steps, new order


def test_cost_model():
    m = CostModel.from_config(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128))
    assert m.beta == 2 * 6 * 4 * 16  # 12 FLOPs per allowed (q, k) pair per head dim, l**2/2 pairs, 2 layers
    windowed = CostModel.from_config(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=128, sliding_window=512))
    assert windowed.beta == 0 and windowed.alpha == m.alpha + 2 * 12 * 4 * 16 * 512
    assert CostModel.from_config(dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                      sliding_window=512), max_tokens=512).beta == m.beta  # windows never bite
    rows = [[100], [50, 50], [400], [200, 10], [1000]]
    truth = CostModel(alpha=3e-6, beta=2e-9)
    fit = CostModel.fit(rows, [float(truth.of(np.array(x)).sum()) for x in rows])
    assert fit.alpha == pytest.approx(truth.alpha, rel=1e-6) and fit.beta == pytest.approx(truth.beta, rel=1e-6)
    with pytest.raises(PackstreamError, match="finite number"):
        CostModel(alpha=-1.0)
    with pytest.raises(PackstreamError, match="hidden_size"):
        CostModel.from_config({})


pair_rows_strategy = st.lists(st.lists(st.tuples(st.integers(2, 30), st.integers(2, 30)), min_size=1, max_size=4),
                              min_size=1, max_size=40)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=pair_rows_strategy, by=st.sampled_from(list(BatchBy)), balance=st.sampled_from(list(Balance)),
       size=st.integers(1, 8), world=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_rows_of_pairs_are_cut_only_between_pairs(rows, by, balance, size, world, seed):
    """In rows of preference pairs (grain 2: chosen, rejected) a piece always starts and ends at a pair boundary,
    every pair is served exactly once, and batch_by="examples" counts pairs."""
    r = Rows.from_lengths([[n for pair in row for n in pair] for row in rows], grain=2)
    budget = max(r.tokens)
    size = max(size * 10, int(budget)) if by is BatchBy.TOKENS else size
    s = dict(batch_by=by, batch_size=size, world_size=world, balance=balance, seed=seed)
    try:
        sched = schedule(r, 0, **s)
    except PackstreamError as e:
        assert "cannot give each of" in str(e) and sum(len(x) for x in rows) < world * -(-len(rows) // world), e
        return
    u = sched.units
    assert ((u.lo % 2) == 0).all() and ((u.hi % 2) == 0).all() and (u.hi > u.lo).all()
    assert sequences_of(sched, r) == Counter((i, k) for i, x in enumerate(rows) for k in range(2 * len(x)))


def test_a_pair_run_split_for_the_ranks_serves_whole_pairs(tmp_path):
    """End to end: 3 rows of pairs on 2 ranks, one row per micro-batch: the schedule cuts one row, between its pairs,
    and the pieces collate with their pair columns (completion spans moved with their sequences)."""
    from packers import Collator, PackedDataset
    from tests._shards import make_pair_row, random_pairs, write_shards

    pairs = random_pairs(6, seed=1)
    rows = [make_pair_row(pairs[2 * k : 2 * k + 2]) for k in range(3)]
    write_shards(tmp_path, rows, budget=128, num_shards=1, eos_token_id=1)
    served = []
    for rank in range(2):
        ds = PackedDataset(tmp_path, sampling=Sampling(shuffle=False), sharding=Sharding(world_size=2, rank=rank),
                           batching=Batching(batch_size=1))
        assert len(ds) == 2
        for mb in ds:
            for row in mb:
                assert len(row["sides"]) % 2 == 0 and list(row["sides"]) == [0, 1] * (len(row["sides"]) // 2)
                Collator()([row])  # the pair columns still fit the piece
                served += row["example_ids"]
    assert sorted(served) == sorted(i for r in rows for i in r["example_ids"])


@pytest.mark.parametrize("kind,kw,match", [
    (Sampling, {"rebatch": "yes"}, "rebatch='yes' must be True or False"),
    (Sampling, {"shuffle": 1}, "shuffle=1 must be True or False"),
    (Sampling, {"seed": -1}, "seed=-1 must be an integer >= 0 \\(numpy's generators"),
    (Sampling, {"seed": True}, "seed=True must be an integer >= 0"),
    (Batching, {"grad_accum": 0}, "grad_accum=0 must be >= 1"),
    (Batching, {"batch_size": 2.5}, "batch_size must be an integer, got 2.5"),
    (Batching, {"batch_by": "bytes"}, "batch_by 'bytes' is not one of rows, examples, tokens"),
    (Batching, {"cost": 1.0}, "pass a packers.CostModel"),
    (Batching, {"source_weights": {"a": 1.0}}, "loss_weighting='source' only"),
    (Batching, {"loss_weighting": "source", "source_weights": {"a": -1.0}}, "loss weight -1.0 of data set 'a'"),
    (Sharding, {"rank": 2, "world_size": 2}, r"rank=2 must be in \[0, world_size=2\)"),
    (Sharding, {"world_size": 0}, "world_size=0 must be >= 1"),
    (Sharding, {"rank": -1}, "rank=-1 must be >= 0"),
])
def test_options_are_checked_when_made(kind, kw, match):
    with pytest.raises(PackstreamError, match=match):
        kind(**kw)
