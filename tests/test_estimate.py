"""``packstream estimate``: sampling, the job's own stages on the sample, predictions held against real runs.

The wall-time prediction is measured by ``bench/bench_estimate.py``, not asserted here: it depends
on the machine's load. The counts are deterministic and held tightly.
"""

from __future__ import annotations

import gzip
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline import OutputFormat, PackOptions, run
from pipeline.cli import bundled_sample, main
from tests._internals import (
    FormatOptions, _sample, estimate, expand_inputs, human_bytes, load_config, read_file, sample,
)
from tests.conftest import GSM8K_FIELDS, shared_data

ESTIMATE_KEYS = {
    "schema_version", "inputs", "sampled_records", "records", "not_sampled", "repeated_copies", "rejected",
    "rejected_by_reason", "dropped_too_long", "examples_packed", "truncated_examples", "split_examples",
    "no_target_pieces", "pieces", "tokens", "target_tokens", "rows", "lower_bound", "fill", "examples_per_row",
    "splits", "output_bytes", "shards", "workers", "tokenizer_threads", "workers_why", "local_seconds",
    "local_seconds_error", "timed_sample", "sample_tokens_per_s", "estimate_seconds", "max_tokens", "pairs",
    "vision", "first_rejected",
}
TIMED_KEYS = {"records", "seconds", "fixed_s", "read_s", "pack_write_s", "calibration"}
INPUT_KEYS = {"source", "dataset", "records", "records_exact", "sampled", "mean_tokens"}


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


def _manifest(folder) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_counts_and_samples_every_format(inputs, monkeypatch):
    files = {f.source: f for f in expand_inputs((str(inputs),))}
    truth = {name: sum(1 for _ in read_file(f, 2**24)) for name, f in files.items()}
    assert truth == {"a.jsonl": 3001, "b.jsonl.gz": 1234, "c.json": 777, "d.parquet": 2500}
    for name, f in files.items():
        s = sample(f, 100, 2**24)
        assert s.records == truth[name] and s.exact and 95 <= len(s.items) <= 100, name
        positions = [p for p, _ in s.items]
        assert positions == sorted(positions) or name == "b.jsonl.gz"
        # Spread over the whole input, not its head.
        assert max(positions) > 0.8 * truth[name], (name, max(positions))
    # Large JSONL: seeks to evenly spaced offsets, counts lines exactly (local), parses with the job's reader.
    monkeypatch.setattr(_sample, "WHOLE_JSONL_BYTES", 1000)
    s = sample(files["a.jsonl"], 50, 2**24)
    assert s.records == 3001 and s.exact and len(s.items) == 50
    assert any(type(r).__name__ == "Rejected" for _, r in sample(files["a.jsonl"], 3001, 2**24).items)


def _same_counts(e: dict, c: dict) -> None:
    """A whole-sample estimate counts exactly what the run counts."""
    assert e["records"] == c["records_read"] and e["sampled_records"] == c["records_read"]
    for key in ("not_sampled", "repeated_copies", "rejected", "rejected_by_reason", "dropped_too_long",
                "examples_packed", "truncated_examples", "split_examples", "no_target_pieces", "pieces", "tokens",
                "target_tokens"):
        assert e[key] == c[key], key


def test_whole_sample_predicts_the_bundled_run_exactly(tmp_path):
    """When every record is sampled, counts are exact and rows are the packing of the real lengths."""
    options = PackOptions(inputs=(bundled_sample(),), output=str(tmp_path / "o"), max_tokens=256)
    e = estimate(options, sample=10_000)
    m = run(options)
    c = m["counts"]
    assert set(e) == ESTIMATE_KEYS and all(set(i) == INPUT_KEYS for i in e["inputs"])
    _same_counts(e, c)
    assert e["rows"] == c["rows"] and e["lower_bound"] == c["lower_bound"] and e["fill"] == pytest.approx(c["fill"])
    assert e["shards"] == len(m["shards"]) and set(e["splits"]) == set(c["splits"]) == {"train"}
    # One group, one shard: the estimate wrote the same shard the job wrote, byte for byte.
    assert e["output_bytes"] == sum(s["bytes"] for s in m["shards"])


def test_long_examples_split_and_parquet(tmp_path):
    """--long split through the job's own _rows.pieces: pieces, pieces without targets, rows, bytes."""
    options = PackOptions(inputs=(bundled_sample(),), output=str(tmp_path / "o"), max_tokens=64, long="split",
                          output_format=OutputFormat.PARQUET)
    e = estimate(options, sample=10_000)
    m = run(options)
    c = m["counts"]
    _same_counts(e, c)
    assert c["split_examples"] > 0 and c["no_target_pieces"] > 0  # the sample exercises both
    assert e["rows"] == c["rows"]
    assert e["output_bytes"] == pytest.approx(sum(s["bytes"] for s in m["shards"]), rel=0.01)


def test_data_set_weights_and_validation_fraction(tmp_path):
    """A --config mix (a sampled half, a set repeated 3 times) with a validation split: the estimate
    samples and repeats through the encode stage, so a whole sample counts exactly; the shards per
    split are the job's."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(200)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": f"document {i} " + "w " * (i % 40)}) + "\n"
                                              for i in range(60)))
    cfg = tmp_path / "mix.yaml"
    cfg.write_text("datasets:\n  - name: half\n    paths: [a.jsonl]\n    weight: 0.5\n"
                   "  - name: thrice\n    paths: [b.jsonl]\n    weight: 3\n")
    options = PackOptions(config=load_config(str(cfg), FormatOptions()), output=str(tmp_path / "o"), max_tokens=512,
                          validation_fraction=0.2, group_size=50, num_shards=2)
    e = estimate(options, sample=10_000)
    timed = estimate(options, sample=10_000, timed_run=run)  # its timed pack: the mix's sample, in a temp folder
    assert timed["timed_sample"]["records"] > 0 and timed["rows"] == e["rows"] and not (tmp_path / "o").exists()
    assert e["timed_sample"]["records"] == 0 and "without timed_run" in e["timed_sample"]["why"]
    m = run(options)
    c = m["counts"]
    _same_counts(e, c)
    assert 60 < c["not_sampled"] < 140 and c["repeated_copies"] == 120
    assert {i["dataset"] for i in e["inputs"]} == {"half", "thrice"}
    assert set(e["splits"]) == set(c["splits"]) == {"train", "validation"}
    for split, s in e["splits"].items():
        assert s["shards"] == sum(1 for x in m["shards"] if x["split"] == split), split
        # Which examples are held out is the job's hash; the estimate draws the same fraction.
        assert s["tokens"] == pytest.approx(c["splits"][split]["tokens"], rel=0.5), split
    assert sum(s["tokens"] for s in e["splits"].values()) == c["tokens"]
    assert e["shards"] == len(m["shards"]) == 4
    assert e["rows"] == pytest.approx(c["rows"], rel=0.05)


def test_sizes_are_labelled_in_the_units_they_are_computed_in():
    """1024-based sizes say KiB/MiB/GiB, never KB/MB/GB."""
    assert human_bytes(512) == "512 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 2**20) == "3.0 MiB"
    assert human_bytes(5 * 2**30) == "5.0 GiB"
    assert human_bytes(2 * 2**40) == "2.0 TiB"


def test_cli_estimate_json_and_table(tmp_path):
    runner = CliRunner()
    r = runner.invoke(main, ["pack", "--estimate", "--log-format", "json", "--max-tokens", "512", "--sample", "5"])
    assert r.exit_code == 0, r.output
    e = json.loads(r.stdout)
    assert set(e) == ESTIMATE_KEYS | {"event"} and e["event"] == "estimate" and e["schema_version"] == 6
    # The run time is calibrated by a timed pack of the sample (issue 28): its parts and the error bound are shown.
    assert set(e["timed_sample"]) == TIMED_KEYS and 0 < e["timed_sample"]["records"] <= sum(
        i["sampled"] for i in e["inputs"])
    assert e["local_seconds_error"] == 0.25 and e["local_seconds"] > 0
    assert e["workers"] >= 1 and e["tokenizer_threads"] >= 1 and e["workers_why"].startswith("--workers auto")
    assert {i["source"] for i in e["inputs"]} >= {"alpaca.jsonl", "sharegpt.json"}
    assert all(set(i) == INPUT_KEYS for i in e["inputs"])
    assert all(i["sampled"] <= 5 for i in e["inputs"])
    r = runner.invoke(main, ["estimate", str(tmp_path / "nothing-here.jsonl")])
    assert r.exit_code == 2 and "matches no file" in r.output
    r = runner.invoke(main, ["estimate", "--max-tokens", "512", "--workers", "2"])
    assert r.exit_code == 0, r.output
    for label in ("records", "tokens", "rows", "fill", "output", "local run time (--workers 2)"):
        assert label in r.stdout
    assert "(±25%, from a timed " in r.stdout and "-record pack)" in r.stdout
    assert re.search(r"2 x \d+ tokenizer threads? \(--workers 2: ", r.stdout), r.stdout
    assert "KiB" in r.stdout and not any(f" {u} " in r.stdout + " " for u in ("KB", "MB", "GB"))
    assert not (tmp_path / "o").exists()
    r = runner.invoke(main, ["pack", "--max-tokens", "512"])
    assert r.exit_code == 2 and "--output" in r.output  # required unless --estimate
    r = runner.invoke(main, ["estimate", "--help"])
    assert r.exit_code == 0 and "estimate [OPTIONS] [INPUTS]" in r.output and "Predict a pack job" in r.output
    assert "--sample" in r.output and "--output DIR" not in r.output and "--overwrite" not in r.output


def test_estimate_is_within_1_percent_of_the_real_run(tmp_path):
    """On ../shared/data, sampling 1,000 records per input: rows, tokens and bytes within 1%.

    The sample is deterministic (evenly spaced, seeded), so this holds run after run. The predicted
    run time is checked by bench/bench_estimate.py instead.
    """
    data = shared_data()
    options = PackOptions(inputs=(str(data),), output=str(tmp_path / "o"), fields=GSM8K_FIELDS, max_tokens=4096)
    e = estimate(options, sample=1000)
    manifest = run(options)
    c = manifest["counts"]
    assert e["records"] == c["records_read"]  # local JSONL/JSON: counted, not projected
    assert e["sampled_records"] < c["records_read"] / 3
    assert e["rows"] == pytest.approx(c["rows"], rel=0.01)
    assert e["tokens"] == pytest.approx(c["tokens"], rel=0.01)
    assert e["output_bytes"] == pytest.approx(sum(s["bytes"] for s in manifest["shards"]), rel=0.01)
    assert e["target_tokens"] == pytest.approx(c["target_tokens"], rel=0.02)
    assert e["fill"] == pytest.approx(c["fill"], abs=0.01)
    assert e["examples_per_row"] == pytest.approx(c["examples_per_row"], rel=0.02)
    assert e["shards"] == len(manifest["shards"])


def test_tools_do_not_import_the_job():
    """Layering (STYLE.md): the tools (pipeline._tools) use the stages (_read, _encode, _rows, _write), never _job."""
    import ast
    import pathlib

    import pipeline

    for path in sorted((pathlib.Path(pipeline.__file__).parent / "_tools").rglob("*.py")):
        name = path.name
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {f"pipeline.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                     and n.module == "pipeline" for a in n.names}
        assert "pipeline._job" not in imported, name


def test_seeks_that_land_in_one_long_line_sample_distinct_places(tmp_path, monkeypatch):
    """A big JSONL file of lines longer than the seek spacing: two seeks may land in one line and take the line
    after it. Each sampled record gets its own position, so no two sampled examples claim one place (which the
    job's dedupe refuses as a reader bug), and the estimate runs."""
    recs = [{"instruction": f"q{i} " + "long " * 2000, "output": f"a{i}"} for i in range(40)]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    monkeypatch.setattr(_sample, "WHOLE_JSONL_BYTES", 1000)
    f = expand_inputs((str(tmp_path / "long.jsonl"),))[0]
    items, records, _ = _sample._seek_lines(f, 100, 2**24, (tmp_path / "long.jsonl").stat().st_size)  # remote files
    positions = [p for p, _ in items]
    assert records == 40 and len(positions) > 40 and positions == sorted(set(positions))  # lines taken twice
    s = sample(f, 100, 2**24)  # a local file: evenly spaced lines of its two passes, each once
    assert s.records == 40 and [p for p, _ in s.items] == list(range(1, 41))
    e = estimate(PackOptions(inputs=(str(tmp_path),), output=str(tmp_path / "o"), max_tokens=8192), sample=100)
    assert e["records"] == 40 and e["sampled_records"] == 40
