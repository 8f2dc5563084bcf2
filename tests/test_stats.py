"""Tests of packers.pack_stats on worked examples."""

from __future__ import annotations

import pytest

from packers import PackStats, PackstreamError, pack, pack_stats


def test_classic_example():
    # BFD rows of the textbook example (see test_pack.py): 7+2+1 | 6+4 | 5+5 | 5+2.
    s = pack_stats(pack([5, 7, 5, 2, 4, 2, 5, 1, 6], budget=10))
    assert (s.rows, s.tokens, s.budget) == (4, 37, 10)
    assert s.fill == pytest.approx(37 / 40)
    assert s.lower_bound == 4 and s.rows_over_lower_bound == 0.0  # ceil(37 / 10) = 4: optimal
    assert (s.examples, s.pieces) == (9, 9)
    assert (s.examples_per_row_mean, s.examples_per_row_min, s.examples_per_row_max) == (2.25, 2, 3)
    assert (s.dropped_examples, s.empty_examples, s.truncated_examples, s.split_examples) == (0, 0, 0, 0)


def test_next_fit_is_over_the_lower_bound():
    # Next-fit: 5 | 7 | 5+2 | 4+2 | 5+1 | 6 -> 6 rows for a lower bound of 4.
    s = pack_stats(pack([5, 7, 5, 2, 4, 2, 5, 1, 6], budget=10, strategy="next_fit"))
    assert s.rows == 6 and s.lower_bound == 4
    assert s.rows_over_lower_bound == pytest.approx(0.5)
    assert s.fill == pytest.approx(37 / 60)


def test_long_and_empty():
    lengths = [3, 0, 10, 4, 9]  # budget 4: #1 empty, #2 and #4 long
    s = pack_stats(pack(lengths, budget=4, long="drop"))
    assert (s.examples, s.tokens, s.rows) == (2, 7, 2)
    assert (s.dropped_examples, s.dropped_tokens, s.empty_examples) == (2, 19, 1)

    s = pack_stats(pack(lengths, budget=4, long="truncate"))
    assert (s.examples, s.tokens, s.truncated_examples, s.truncated_tokens) == (4, 15, 2, 11)

    # Split: #2 -> 4+4+2, #4 -> 4+4+1: 8 pieces of 4 examples, 26 tokens in 7 rows.
    s = pack_stats(pack(lengths, budget=4, long="split"))
    assert (s.examples, s.pieces, s.split_examples, s.split_pieces) == (4, 8, 2, 6)
    assert (s.tokens, s.rows, s.lower_bound) == (26, 7, 7)
    assert s.fill == pytest.approx(26 / 28)


def test_from_row_lengths():
    s = pack_stats([10, 10, 10, 7], budget=10)
    assert (s.rows, s.tokens, s.lower_bound) == (4, 37, 4)
    assert s.examples is None and s.dropped_examples is None
    assert set(s.to_dict()) == {f for f in PackStats.__dataclass_fields__}


def test_empty_and_errors():
    s = pack_stats(pack([], budget=8))
    assert (s.rows, s.tokens, s.fill, s.lower_bound, s.rows_over_lower_bound) == (0, 0, 0.0, 0, 0.0)
    with pytest.raises(PackstreamError, match="needs budget"):
        pack_stats([8, 8])
    with pytest.raises(PackstreamError, match="packed with budget 8"):
        pack_stats(pack([1], budget=8), budget=4)
