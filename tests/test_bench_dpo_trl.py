"""bench/bench_dpo_trl.py runs end to end with tiny settings (its figures are the bench's to report, not asserted)."""

from __future__ import annotations

import pytest

from tests._bench import load_bench


def test_bench_dpo_trl_runs_both_paths_on_the_same_pairs(capsys):
    bench = load_bench("bench_dpo_trl")
    if not bench.DEMO.exists():
        pytest.skip(f"{bench.DEMO} not found")
    out = bench.main(["--pairs", "8", "--steps", "2", "--pairs-per-step", "2", "--budget", "1024", "--vocab", "256"])
    packed, trl = out["packed"], out["trl"]
    assert packed["steps"] == trl["steps"] == 2
    assert packed["padding"] == 0.0 and packed["real_tokens_per_forward"] == packed["computed_tokens_per_forward"]
    assert 0.0 < trl["padding"] < 1.0  # chosen and rejected of different lengths, padded to the batch's longest
    assert trl["pairs_per_step"] <= 2
    assert "packed/TRL" in capsys.readouterr().out


def test_row_pairs_cut_prompt_and_completions_out_of_a_pair_row():
    # One pair: prompt [5, 9], chosen [41, 17], rejected [30]; both sides repeat the prompt.
    row = {"input_ids": [5, 9, 41, 17, 5, 9, 30], "seq_offsets": [0, 4, 7], "sides": [0, 1],
           "completion_spans": [2, 4, 6, 7]}
    assert load_bench("bench_dpo_trl").row_pairs(row) == [([5, 9], [41, 17], [30])]
