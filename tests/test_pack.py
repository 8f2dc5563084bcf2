"""Tests of packers.pack / pack_stream: worked examples, then one property suite for every strategy."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packers import LongPolicy, PackResult, PackstreamError, Strategy, pack, pack_stream
from tests._internals import _pack_per_item

ROWS = lambda r: [row.tolist() for row in r.rows]  # noqa: E731


# ---------------------------------------------------------------------------------------
# Worked examples.


def test_bfd_classic_example():
    # The textbook example (items 0.5 0.7 0.5 0.2 0.4 0.2 0.5 0.1 0.6, bins of 1.0), in tenths.
    # Longest first, ties by index: 7(#1) 6(#8) 5(#0) 5(#2) 5(#6) 4(#4) 2(#3) 2(#5) 1(#7).
    #   7 -> new row 0 (3 free)      6 -> new row 1 (4 free)      5#0 -> new row 2 (5 free)
    #   5#2 -> row 2, the only fit (0 free)                        5#6 -> new row 3 (5 free)
    #   4 -> row 1: rows 1 (4 free) and 3 (5 free) fit, row 1 is tighter (0 free)
    #   2#3 -> row 0 (3 free, tightest fit) -> 1 free;   2#5 -> row 3, the only fit -> 3 free
    #   1 -> row 0 (1 free) rather than row 3 (3 free)
    r = pack([5, 7, 5, 2, 4, 2, 5, 1, 6], budget=10)
    assert ROWS(r) == [[1, 3, 7], [8, 4], [0, 2], [6, 5]]
    assert r.row_lengths.tolist() == [10, 10, 10, 7]
    assert r.num_rows == len(r) == 4  # = ceil(37 / 10), the lower bound


def test_bfd_differs_from_ffd():
    # 8 -> row 0 (2 free); 6 -> row 1 (4 free); 3 -> row 1 (only fit, 1 free).
    # The 1 fits both rows: first-fit takes row 0 (the oldest), best-fit row 1 (the fullest).
    assert ROWS(pack([8, 1, 3, 6], budget=10, strategy="bfd")) == [[0], [3, 2, 1]]
    assert ROWS(pack([8, 1, 3, 6], budget=10, strategy="ffd")) == [[0, 1], [3, 2]]


def test_bfd_ties_between_rows_are_fifo():
    # 7 -> row 0, 7 -> row 1: both have 3 free, row 0 first. 2#2 -> row 0 (got 3 free first).
    # 2#3 -> row 1: row 0 now has 1 free.
    assert ROWS(pack([7, 7, 2, 2], budget=10)) == [[0, 2], [1, 3]]


def test_next_fit_keeps_input_order():
    # 5+3 = 8 fits; 7 does not fit after them; 7+2 = 9 > 8; 2+4 = 6.
    assert ROWS(pack([5, 3, 7, 2, 4], budget=8, strategy="next_fit")) == [[0, 1], [2], [3, 4]]


def test_next_fit_can_beat_bfd_on_a_lucky_order():
    # The input is already an optimal packing, row after row: 10+2+3 | 4+4+7. Next-fit keeps
    # it. BFD reorders: 10 -> row 0 (5 free), 7 -> row 1 (8 free), 4 -> row 0 (1 free),
    # 4 -> row 1 (4 free), 3 -> row 1 (1 free), 2 fits nowhere -> row 2. So "BFD <= next-fit"
    # only holds on the same (decreasing) order; see test_no_more_rows_than_next_fit.
    assert len(pack([10, 2, 3, 4, 4, 7], budget=15, strategy="next_fit")) == 2
    assert ROWS(pack([10, 2, 3, 4, 4, 7], budget=15)) == [[0, 3], [5, 4, 2], [1]]


def test_padded_is_one_per_row():
    assert ROWS(pack([3, 1, 2], budget=4, strategy=Strategy.PADDED)) == [[0], [1], [2]]


def test_long_and_empty_examples_are_reported():
    lengths = [3, 0, 10, 4, 9]  # budget 4: #1 is empty, #2 (10) and #4 (9) are long
    r = pack(lengths, budget=4, long="drop")
    # 4 -> row 0 (full), 3 -> row 1.
    assert ROWS(r) == [[3], [0]]
    assert r.dropped.tolist() == [2, 4] and r.dropped_tokens == 19
    assert r.empty.tolist() == [1]
    assert r.num_examples == 5

    r = pack(lengths, budget=4, long="truncate")
    # 4, 4, 4 (the truncated #2 and #4 are 4 tokens now), then 3: one row each.
    assert ROWS(r) == [[2], [3], [4], [0]]
    assert r.stops.tolist() == [4, 4, 4, 3]
    assert r.truncated.tolist() == [2, 4] and r.truncated_tokens == 6 + 5
    assert r.empty.tolist() == [1] and len(r.dropped) == 0

    r = pack(lengths, budget=4, long=LongPolicy.SPLIT)
    # #2 -> [0,4) [4,8) [8,10); #4 -> [0,4) [4,8) [8,9). Longest first, ties by (example, piece):
    # the five 4s (#2a #2b #3 #4a #4b) fill rows 0-4; 3 (#0) -> new row 5 (1 free);
    # 2 (#2c) -> new row 6 (2 free); 1 (#4c) -> row 5, the tightest fit.
    assert ROWS(r) == [[2], [2], [3], [4], [4], [0, 4], [2]]
    assert r.starts.tolist() == [0, 4, 0, 0, 4, 0, 8, 8]
    assert r.stops.tolist() == [4, 8, 4, 4, 8, 3, 9, 10]
    assert r.split.tolist() == [2, 4]


def test_max_per_row():
    # Ten 1-token examples, budget 10: one row without a cap, rows of 3, 3, 3, 1 with cap 3.
    assert ROWS(pack([1] * 10, budget=10)) == [list(range(10))]
    for strategy in Strategy:
        r = pack([1] * 10, budget=10, strategy=strategy, max_per_row=3)
        want = [[i] for i in range(10)] if strategy is Strategy.PADDED else [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
        assert ROWS(r) == want


def test_seed_shuffles_row_order_only():
    lengths = [5, 7, 5, 2, 4, 2, 5, 1, 6]
    plain, shuffled = pack(lengths, 10), pack(lengths, 10, seed=3)
    perm = np.random.default_rng(3).permutation(plain.num_rows)
    assert ROWS(shuffled) == [ROWS(plain)[i] for i in perm]
    assert shuffled.row_lengths.tolist() == plain.row_lengths[perm].tolist()


def test_empty_input():
    r = pack([], budget=8)
    assert r.num_rows == 0 and r.rows == [] and r.row_offsets.tolist() == [0]
    r = pack([0, 0], budget=8)
    assert r.num_rows == 0 and r.empty.tolist() == [0, 1]


def test_strings_and_enums_are_the_same():
    assert Strategy("next_fit") is Strategy.NEXT_FIT and str(Strategy.BFD) == "bfd"
    a = pack([3, 9, 2], 8, "ffd", long="split")
    b = pack([3, 9, 2], 8, Strategy.FFD, long=LongPolicy.SPLIT)
    assert a.strategy is b.strategy is Strategy.FFD and a.long is LongPolicy.SPLIT
    assert ROWS(a) == ROWS(b)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: pack([1, 2], 0), "budget=0 must be >= 1"),
        (lambda: pack([1, 2], -5), "budget=-5 must be >= 1"),
        (lambda: pack([1, 2], 8.0), "budget must be an integer"),
        (lambda: pack([1, 2], 1 << 25), "budget=33,554,432 tokens > the supported 16,777,216"),
        (lambda: pack([1, -3, 2], 8), "example 1 has length -3 < 0"),
        (lambda: pack([1.5, 2], 8), "lengths must be integers"),
        (lambda: pack([[1, 2]], 8), "must be a 1-D sequence"),
        (lambda: pack([1], 8, "best"), "strategy 'best' is not one of bfd, ffd, next_fit, padded"),
        (lambda: pack([1], 8, long="cut"), "long-example policy 'cut' is not one of drop, truncate, split"),
        (lambda: pack([1], 8, max_per_row=0), "max_per_row=0 must be >= 1; pass max_per_row=None"),
        (lambda: pack([1], 8, seed=-1), "seed must be a non-negative integer"),
        (lambda: pack_stream([1, 2], 8, group_size=0), "group_size=0 must be >= 1"),
        (lambda: pack_stream(np.array([1, 2]), 8), "needs group_size=N"),
        (lambda: pack_stream([1, 2], 8), "bare length 1"),
    ],
)
def test_errors_name_the_value_and_the_fix(call, message):
    with pytest.raises(PackstreamError, match=re.escape(message)):
        call()


def test_pack_stream_groups():
    # Groups [5, 3, 7] and [2, 4] are packed on their own; indices stay global.
    r = pack_stream([5, 3, 7, 2, 4], budget=8, group_size=3)
    assert ROWS(r) == [[2], [0, 1], [4, 3]]
    # The same groups as an iterator.
    r2 = pack_stream(iter([np.array([5, 3, 7]), [2, 4]]), budget=8)
    assert ROWS(r2) == ROWS(r) and r2.num_examples == 5
    # Reports are global too: example 4 (9 tokens) is dropped from the second group.
    r3 = pack_stream([1, 0, 2, 3, 9], budget=8, group_size=3)
    assert r3.dropped.tolist() == [4] and r3.empty.tolist() == [1]
    assert pack_stream(iter([]), budget=8).num_rows == 0


# ---------------------------------------------------------------------------------------
# Properties, for every strategy.


@st.composite
def packing_inputs(draw, max_size=60):
    budget = draw(st.integers(1, 40))
    # Few distinct lengths make ties (equal lengths, bins with equal room) common.
    alphabet = draw(st.lists(st.integers(0, 2 * budget + 1), min_size=1, max_size=6))
    lengths = draw(st.lists(st.one_of(st.sampled_from(alphabet), st.integers(0, 2 * budget + 1)), max_size=max_size))
    long = draw(st.sampled_from(list(LongPolicy)))
    max_per_row = draw(st.one_of(st.none(), st.integers(1, 5)))
    return np.array(lengths, dtype=np.int64), budget, long, max_per_row


def check_result(r: PackResult, lengths: np.ndarray, budget: int, long: LongPolicy, max_per_row) -> None:
    """Everything placed once (or reported), spans exact, no row over budget, offsets consistent."""
    for a in (r.order, r.starts, r.stops, r.row_offsets, r.dropped, r.empty, r.truncated, r.split):
        assert a.dtype == np.int64
    assert r.budget == budget and r.num_examples == len(lengths)
    # Offsets: start at 0, end at the number of pieces, no empty rows.
    assert r.row_offsets[0] == 0 and r.row_offsets[-1] == len(r.order)
    assert (np.diff(r.row_offsets) >= 1).all()
    if max_per_row is not None:
        assert (np.diff(r.row_offsets) <= max_per_row).all()
    # Spans inside their example, rows within budget, row_lengths consistent.
    assert (r.starts >= 0).all() and (r.starts < r.stops).all()
    assert (r.stops <= lengths[r.order]).all() if len(r.order) else True
    sums = [int((r.stops - r.starts)[a:b].sum()) for a, b in zip(r.row_offsets[:-1], r.row_offsets[1:])]
    assert r.row_lengths.tolist() == sums and all(s <= budget for s in sums)
    # Every example: placed exactly as its policy says, or reported.
    pieces: dict[int, list[tuple[int, int]]] = {}
    for i, a, b in zip(r.order.tolist(), r.starts.tolist(), r.stops.tolist()):
        pieces.setdefault(i, []).append((a, b))
    for i, n in enumerate(lengths.tolist()):
        got = sorted(pieces.get(i, []))
        if n == 0:
            assert got == [] and i in r.empty
        elif n <= budget:
            assert got == [(0, n)]
        elif long is LongPolicy.DROP:
            assert got == [] and i in r.dropped
        elif long is LongPolicy.TRUNCATE:
            assert got == [(0, budget)] and i in r.truncated
        else:  # split: consecutive budget-sized pieces that cover the example exactly
            assert got == [(k, min(k + budget, n)) for k in range(0, n, budget)] and i in r.split
    assert r.empty.tolist() == np.flatnonzero(lengths == 0).tolist()
    long_ones = np.flatnonzero(lengths > budget).tolist()
    assert r.dropped.tolist() == (long_ones if long is LongPolicy.DROP else [])
    assert r.truncated.tolist() == (long_ones if long is LongPolicy.TRUNCATE else [])
    assert r.split.tolist() == (long_ones if long is LongPolicy.SPLIT else [])
    assert r.dropped_tokens == (int(lengths[long_ones].sum()) if long is LongPolicy.DROP else 0)
    assert r.truncated_tokens == (int((lengths[long_ones] - budget).sum()) if long is LongPolicy.TRUNCATE else 0)


def same(a: PackResult, b: PackResult) -> bool:
    return all(
        np.array_equal(getattr(a, f), getattr(b, f))
        for f in ("order", "starts", "stops", "row_offsets", "dropped", "empty", "truncated", "split")
    )


PROPS = settings(max_examples=200, deadline=None)


# The default strategy (best-fit decreasing) in the fast tier; the others in the slow one (CI runs all).
EVERY_STRATEGY = [s if s is Strategy.BFD else pytest.param(s, marks=pytest.mark.slow) for s in Strategy]


@pytest.mark.parametrize("strategy", EVERY_STRATEGY)
class TestEveryStrategy:
    @PROPS
    @given(packing_inputs())
    def test_placed_once_within_budget(self, strategy, inp):
        lengths, budget, long, max_per_row = inp
        r = pack(lengths, budget, strategy, long=long, max_per_row=max_per_row)
        assert r.strategy is strategy
        check_result(r, lengths, budget, long, max_per_row)

    @PROPS
    @given(packing_inputs(), st.integers(0, 2**32))
    def test_deterministic_and_seed_permutes_rows(self, strategy, inp, seed):
        lengths, budget, long, max_per_row = inp
        a = pack(lengths, budget, strategy, long=long, max_per_row=max_per_row)
        assert same(a, pack(lengths.copy(), budget, strategy, long=long, max_per_row=max_per_row))
        s = pack(lengths, budget, strategy, long=long, max_per_row=max_per_row, seed=seed)
        assert same(s, pack(lengths, budget, strategy, long=long, max_per_row=max_per_row, seed=seed))
        perm = np.random.default_rng(seed).permutation(a.num_rows)
        rows_a = [list(zip(*x)) for x in _row_spans(a)]
        assert [list(zip(*x)) for x in _row_spans(s)] == [rows_a[i] for i in perm]
        check_result(s, lengths, budget, long, max_per_row)

    @PROPS
    @given(packing_inputs())
    def test_matches_the_per_item_loop(self, strategy, inp):
        # For BFD this is the batched algorithm against the O(n * rows) best-fit scan.
        lengths, budget, long, max_per_row = inp
        kw = dict(long=long, max_per_row=max_per_row)
        assert same(pack(lengths, budget, strategy, **kw), _pack_per_item(lengths, budget, strategy, **kw))

    @PROPS
    @given(packing_inputs())
    def test_no_more_rows_than_next_fit(self, strategy, inp):
        # Any-fit (first-fit, best-fit) never opens more rows than next-fit on the same order:
        # if it opens row i+1 at piece t, row i's pieces and piece t came after row i opened,
        # and they overflow (tokens or count), so next-fit's row i had ended by then too.
        # BFD and FFD place longest first, so compare with next-fit over the sorted pieces.
        lengths, budget, long, max_per_row = inp
        r = pack(lengths, budget, strategy, long=long, max_per_row=max_per_row)
        desc = np.sort(r.stops - r.starts)[::-1]
        nf = pack(desc, budget, "next_fit", max_per_row=max_per_row)
        if strategy in (Strategy.BFD, Strategy.FFD):
            assert r.num_rows <= nf.num_rows
        if max_per_row is None and strategy is not Strategy.PADDED:
            # Any-fit: at most one row is at most half full; next-fit: no two neighbours are.
            # Either way (rows - 1) * budget / 2 < tokens.
            assert r.num_rows <= -(-2 * int(desc.sum()) // budget)

    @PROPS
    @given(packing_inputs(), st.integers(1, 80))
    def test_pack_stream(self, strategy, inp, group_size):
        lengths, budget, long, max_per_row = inp
        kw = dict(strategy=strategy, long=long, max_per_row=max_per_row)
        whole = pack_stream(lengths, budget, group_size=max(len(lengths), 1), seed=5, **kw)
        assert same(whole, pack(lengths, budget, seed=5, **kw))
        # Groups are packed on their own: the same rows as packing each slice, shifted.
        r = pack_stream(lengths, budget, group_size=group_size, **kw)
        check_result(r, lengths, budget, long, max_per_row)
        want = []
        for lo in range(0, len(lengths), group_size):
            want += [(row + lo).tolist() for row in pack(lengths[lo : lo + group_size], budget, **kw).rows]
        assert ROWS(r) == want
        groups = (lengths[lo : lo + group_size] for lo in range(0, len(lengths), group_size))
        assert same(pack_stream(groups, budget, **kw), r)


def _row_spans(r: PackResult):
    return [
        (r.order[a:b].tolist(), r.starts[a:b].tolist(), r.stops[a:b].tolist())
        for a, b in zip(r.row_offsets[:-1], r.row_offsets[1:])
    ]


@settings(max_examples=400, deadline=None)
@given(
    st.integers(1, 64),
    st.lists(st.integers(1, 12), min_size=1, max_size=4),
    st.integers(0, 300),
    st.one_of(st.none(), st.integers(1, 6)),
    st.integers(0, 2**32),
)
def test_fast_bfd_equals_reference_on_larger_inputs(budget, divisors, n, max_per_row, seed):
    # Many pieces of few lengths (budget // d): long runs of equal lengths and of bins with
    # equal room, where the batched steps take several pieces per bin and several bins at once.
    rng = np.random.default_rng(seed)
    alphabet = np.array([max(1, budget // d) for d in divisors] + [1])
    lengths = rng.choice(alphabet, size=n)
    other = rng.random(n) < 0.2
    lengths[other] = rng.integers(1, budget + 1, size=int(other.sum()))
    fast = pack(lengths, budget, max_per_row=max_per_row)
    assert same(fast, _pack_per_item(lengths, budget, max_per_row=max_per_row))


def test_fast_bfd_equals_reference_realistic():
    rng = np.random.default_rng(0)
    for budget in (64, 256):
        lengths = np.clip(rng.lognormal(np.log(budget / 8), 1.0, 2000).astype(np.int64), 0, 2 * budget)
        for max_per_row in (None, 4):
            kw = dict(long="split", max_per_row=max_per_row)
            assert same(pack(lengths, budget, **kw), _pack_per_item(lengths, budget, **kw))


def test_large_input_is_exact_and_near_the_lower_bound():
    rng = np.random.default_rng(1)
    budget = 4096
    lengths = np.clip(rng.lognormal(np.log(300), 1.0, 200_000).astype(np.int64), 1, 2 * budget)
    r = pack(lengths, budget)
    check = lengths <= budget
    assert np.array_equal(np.sort(r.order), np.flatnonzero(check))
    assert r.row_lengths.max() <= budget
    lower = -(-int(lengths[check].sum()) // budget)
    assert r.num_rows <= lower * 1.001 + 1


# --- refine: best-fit, then minimum bin slack (exact fill), keeping the fewer rows -----------------


def test_refine_worked_example():
    # 30 tokens in rows of 10: the lower bound is 3 rows.
    # BFD, longest first: 5+5 | 4+4 | then the 3s: 3+3+3 | 3  -> 4 rows (slack 2 in the 4+4 row).
    # Exact fill: 5 + best subset for 5 = 5 | 4 + 3+3 | 4 + 3+3 -> 3 rows, every row full.
    lengths = [5, 5, 4, 4, 3, 3, 3, 3]
    assert ROWS(pack(lengths, 10)) == [[0, 1], [2, 3], [4, 5, 6], [7]]
    assert ROWS(pack(lengths, 10, refine=True)) == [[0, 1], [2, 4, 5], [3, 6, 7]]
    # Where BFD is already optimal, refine keeps BFD's rows: 6+4 | 5+3+2.
    assert ROWS(pack([6, 5, 4, 3, 2], 10, refine=True)) == ROWS(pack([6, 5, 4, 3, 2], 10))


def test_refine_refuses_a_row_cap():
    with pytest.raises(PackstreamError, match="max_per_row"):
        pack([1, 2], 8, refine=True, max_per_row=2)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 70), min_size=0, max_size=120),
    budget=st.integers(1, 64),
    long=st.sampled_from(list(LongPolicy)),
)
def test_refine_is_valid_deterministic_and_never_worse(lengths, budget, long):
    base = pack(lengths, budget, long=long)
    refined = pack(lengths, budget, long=long, refine=True)
    assert refined.num_rows <= base.num_rows
    assert (refined.row_lengths <= budget).all() and (np.diff(refined.row_offsets) >= 1).all()
    # The same pieces are placed, each exactly once.
    key = lambda r: sorted(zip(r.order.tolist(), r.starts.tolist(), r.stops.tolist()))
    assert key(refined) == key(base)
    again = pack(lengths, budget, long=long, refine=True)
    assert np.array_equal(again.order, refined.order) and np.array_equal(again.row_offsets, refined.row_offsets)


# ---------------------------------------------------------------------------------------
# An independent reference for the loop-based strategies: written out here from their textbook
# definitions, sharing no code with packers._pack and packers._strategies (whose per-item loop they also run on).


def _reference_rows(lengths, budget: int, strategy: str, long: LongPolicy, max_per_row):
    """Rows as lists of (example, start, stop): next-fit and padded (a row per piece) in input
    order; first-fit in decreasing order (longest first, ties by example, then piece); a row
    holding ``max_per_row`` pieces takes no more."""
    pieces = []
    for i, n in enumerate(int(x) for x in lengths):
        if n == 0 or (n > budget and long is LongPolicy.DROP):
            continue
        if n <= budget:
            pieces.append((i, 0, n))
        elif long is LongPolicy.TRUNCATE:
            pieces.append((i, 0, budget))
        else:
            pieces += [(i, a, min(a + budget, n)) for a in range(0, n, budget)]
    if strategy == "ffd":
        pieces.sort(key=lambda p: (-(p[2] - p[1]), p[0], p[1]))
    rows: list[list[tuple[int, int, int]]] = []
    used: list[int] = []

    def fits(r: int, size: int) -> bool:
        return used[r] + size <= budget and (max_per_row is None or len(rows[r]) < max_per_row)

    for p in pieces:
        size = p[2] - p[1]
        if strategy == "next_fit":
            target = len(rows) - 1 if rows and fits(len(rows) - 1, size) else None
        elif strategy == "ffd":
            target = next((r for r in range(len(rows)) if fits(r, size)), None)
        else:  # padded
            target = None
        if target is None:
            rows.append([])
            used.append(0)
            target = len(rows) - 1
        rows[target].append(p)
        used[target] += size
    return rows


@pytest.mark.parametrize("strategy", ["ffd", pytest.param("next_fit", marks=pytest.mark.slow),
                                      pytest.param("padded", marks=pytest.mark.slow)])
@settings(max_examples=300, deadline=None)
@given(inp=packing_inputs())
def test_loop_strategies_match_an_independent_reference(strategy, inp):
    lengths, budget, long, max_per_row = inp
    r = pack(lengths, budget, strategy, long=long, max_per_row=max_per_row)
    got = [list(zip(*spans)) for spans in _row_spans(r)]
    assert got == _reference_rows(lengths, budget, strategy, long, max_per_row)


def test_the_reference_on_a_worked_example():
    # budget 10: next-fit in order 6|3 -> row 0 holds 9; 5 opens row 1; 4 does not fit 1 left... -> row 2.
    assert _reference_rows([6, 3, 5, 4, 1], 10, "next_fit", LongPolicy.DROP, None) == [
        [(0, 0, 6), (1, 0, 3)], [(2, 0, 5), (3, 0, 4), (4, 0, 1)]]
    # first-fit decreasing: 6, 5, 4, 3, 1 -> 6+4, 5+3+1
    assert _reference_rows([6, 3, 5, 4, 1], 10, "ffd", LongPolicy.DROP, None) == [
        [(0, 0, 6), (3, 0, 4)], [(2, 0, 5), (1, 0, 3), (4, 0, 1)]]
