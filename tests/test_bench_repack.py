"""bench/bench_repack.py runs end to end on a tiny generated mix (its figures are the bench's to report, not asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from tests._bench import load_bench


def fake_data(root: Path) -> Path:
    """The three files bench_scale.build_mix reads, a few records each, a few longer than 256 tokens."""
    for d in ("gsm8k", "gpteacher", "self_instruct"):
        (root / d).mkdir(parents=True)
    with open(root / "gsm8k" / "train.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"question": f"what is {i} + {i}? " * (1 + i % 3), "answer": f"it is {2 * i}. " * (1 + i)}) + "\n")
    (root / "gpteacher" / "codegen-instruct.json").write_text(json.dumps(
        [{"instruction": f"write code {i}", "input": "x" * i, "response": "def f(): pass\n" * (i + 1)} for i in range(6)]))
    with open(root / "self_instruct" / "t0_sample_15_per_template.jsonl", "w") as f:
        for i in range(6):
            f.write(json.dumps({"prompt": "word " * (10 + i * 60), "completion": "yes " * (i + 1)}) + "\n")
    return root


def test_bench_repack_smallest_mode(tmp_path, capsys):
    data = fake_data(tmp_path / "data")
    res = load_bench("bench_repack").main(["--data", str(data), "--scale", "2", "--from", "256", "--to", "512", "--repeats", "1",
                             "--workers", "1", "--memory-scales", "1", "2", "--no-trace",
                             "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "r.json")])
    s = res["speed"]
    assert s["pack"]["seconds"] > 0 and s["repack"]["seconds"] > 0 and s["repack"]["peak_rss"] > 0
    c = s["compare"]
    assert c["first_pack_cut"]["dropped_too_long"] > 0  # the long T0 prompts: dropped at 256, so not pack's bytes
    assert not c["identical"] and c["tokens"]["repack"] < c["tokens"]["pack"]
    assert [r["scale"] for r in res["memory"]] == [1, 2]
    assert json.loads((tmp_path / "r.json").read_text())["speed"]["scale"] == 2
    assert "pack / repack" in capsys.readouterr().out
    assert not (tmp_path / "work" / "mix-2x.jsonl").exists()


def test_bench_repack_identical_when_nothing_cut(tmp_path):
    data = fake_data(tmp_path / "data")
    res = load_bench("bench_repack").main(["--data", str(data), "--scale", "1", "--from", "2048", "--to", "4096", "--repeats", "1",
                             "--workers", "1", "--memory-scales", "--no-trace", "--workdir", str(tmp_path / "work")])
    c = res["speed"]["compare"]
    assert not any(c["first_pack_cut"].values()), c["first_pack_cut"]
    assert c["identical"], c
