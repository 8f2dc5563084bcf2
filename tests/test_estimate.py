"""``packstream pack --estimate``: sampling, counting, and predictions held against real runs."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline import PackOptions, run
from pipeline import _estimate
from pipeline._estimate import count_records, estimate, sample_input
from pipeline._read import expand_inputs, read_file
from pipeline.cli import bundled_sample, main
from tests.conftest import GSM8K_FIELDS, shared_data

ESTIMATE_KEYS = {
    "schema_version", "inputs", "sampled_records", "records", "rejected", "rejected_by_reason", "dropped_too_long",
    "examples_packed", "tokens", "target_tokens", "rows", "lower_bound", "fill", "examples_per_row", "output_bytes",
    "shards", "workers", "local_seconds", "sample_tokens_per_s", "estimate_seconds", "max_tokens",
}


def _records(n: int) -> list[dict]:
    # Lengths grow with the index, so a sample from the head alone would be biased short.
    return [{"instruction": f"question {i} " + "word " * (i % 97), "output": f"answer {i}"} for i in range(n)]


@pytest.fixture
def inputs(tmp_path):
    recs = _records(3000)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs) + "\n{broken\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs[:1234]))
    (tmp_path / "c.json").write_text(json.dumps(recs[:777]))
    pq.write_table(pa.Table.from_pylist(recs[:2500]), tmp_path / "d.parquet", row_group_size=300)
    return tmp_path


def test_counts_and_samples_every_format(inputs, monkeypatch):
    files = {f.source: f for f in expand_inputs((str(inputs),))}
    truth = {name: sum(1 for _ in read_file(f, 2**24)) for name, f in files.items()}
    assert truth == {"a.jsonl": 3001, "b.jsonl.gz": 1234, "c.json": 777, "d.parquet": 2500}
    for name, f in files.items():
        assert count_records(f) == truth[name], name
        s = sample_input(f, k=100)
        assert s.records == truth[name] and s.exact and 95 <= len(s.sample) <= 100, name
        positions = [p for p, _ in s.sample]
        assert positions == sorted(positions) or name == "b.jsonl.gz"
        # Spread over the whole input, not its head.
        assert max(positions) > 0.8 * truth[name], (name, max(positions))
    # Large JSONL: seeks to evenly spaced offsets, counts lines exactly (local), parses with the job's reader.
    monkeypatch.setattr(_estimate, "_SMALL", 1000)
    s = sample_input(files["a.jsonl"], k=50)
    assert s.records == 3001 and s.exact and len(s.sample) == 50
    assert any(type(r).__name__ == "Rejected" for _, r in sample_input(files["a.jsonl"], k=3001).sample)


def test_whole_sample_predicts_the_bundled_run_exactly(tmp_path):
    """When every record is sampled, counts are exact and rows are the packing of the real lengths."""
    options = PackOptions(inputs=(bundled_sample(),), output=str(tmp_path / "o"), max_tokens=256)
    e = estimate(options, sample=10_000)
    c = run(options)["counts"]
    assert set(e) == ESTIMATE_KEYS
    assert e["records"] == c["records_read"] and e["sampled_records"] == c["records_read"]
    assert e["tokens"] == c["tokens"] and e["target_tokens"] == c["target_tokens"]
    assert e["rows"] == c["rows"] and e["lower_bound"] == c["lower_bound"]
    assert e["examples_packed"] == c["examples_packed"] and e["rejected"] == c["rejected"]
    real_bytes = sum(s["bytes"] for s in json.load(open(tmp_path / "o" / "manifest.json"))["shards"])
    assert e["output_bytes"] == pytest.approx(real_bytes, rel=0.05)


def test_cli_estimate_json_and_table(tmp_path):
    runner = CliRunner()
    r = runner.invoke(main, ["pack", "--estimate", "--log-format", "json", "--max-tokens", "512", "--sample", "5"])
    assert r.exit_code == 0, r.output
    e = json.loads(r.stdout)
    assert set(e) == ESTIMATE_KEYS | {"event"} and e["event"] == "estimate" and e["schema_version"] == 1
    assert {i["source"] for i in e["inputs"]} >= {"alpaca.jsonl", "sharegpt.json"}
    assert all(set(i) == {"source", "records", "records_exact", "sampled", "mean_tokens"} for i in e["inputs"])
    assert all(i["sampled"] <= 5 for i in e["inputs"])
    r = runner.invoke(main, ["estimate", str(tmp_path / "nothing-here.jsonl")])
    assert r.exit_code == 2 and "matches no file" in r.output
    r = runner.invoke(main, ["estimate", "--max-tokens", "512"])
    assert r.exit_code == 0, r.output
    for label in ("records", "tokens", "rows", "fill", "output", "local run time"):
        assert label in r.stdout
    assert not (tmp_path / "o").exists()
    r = runner.invoke(main, ["pack", "--max-tokens", "512"])
    assert r.exit_code == 2 and "--output" in r.output  # required unless --estimate


def test_estimate_is_within_tolerance_of_the_real_run(tmp_path):
    """On ../shared/data, sampling 1,000 records per input: rows, tokens and bytes within 10%."""
    data = shared_data()
    options = PackOptions(inputs=(str(data),), output=str(tmp_path / "o"), fields=GSM8K_FIELDS, max_tokens=4096)
    e = estimate(options, sample=1000)
    manifest = run(options)
    c = manifest["counts"]
    assert e["records"] == c["records_read"]  # local JSONL/JSON: counted, not projected
    assert e["sampled_records"] < c["records_read"] / 3
    assert e["rows"] == pytest.approx(c["rows"], rel=0.10)
    assert e["tokens"] == pytest.approx(c["tokens"], rel=0.10)
    assert e["target_tokens"] == pytest.approx(c["target_tokens"], rel=0.10)
    assert e["fill"] == pytest.approx(c["fill"], abs=0.02)
    assert e["examples_per_row"] == pytest.approx(c["examples_per_row"], rel=0.10)
    assert e["output_bytes"] == pytest.approx(sum(s["bytes"] for s in manifest["shards"]), rel=0.10)
    # Run time depends on the machine's load; hold it to a factor of 3.
    assert manifest["elapsed_s"] / 3 <= e["local_seconds"] <= manifest["elapsed_s"] * 3
