"""``packstream inspect``: the report's numbers, its stable JSON schema, and real PNG plots."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from pipeline import OutputFormat, PackOptions, run
from pipeline._inspect import PERCENTILES, PLOTS, REPORT_KEYS, SCHEMA_VERSION, inspect
from pipeline.cli import bundled_sample, main


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The bundled sample at a small budget: several rows, varied fill."""
    out = tmp_path_factory.mktemp("inspect") / "out"
    manifest = run(PackOptions(inputs=(bundled_sample(),), output=str(out), max_tokens=256, group_size=7))
    return str(out), manifest


def _check_types(report: dict) -> None:
    assert set(report) == set(REPORT_KEYS)
    for key, typ in REPORT_KEYS.items():
        assert isinstance(report[key], typ), (key, report[key])
        assert not isinstance(report[key], bool) or typ in (bool, (bool, type(None))), key
    stats = {"mean", *(f"p{p}" for p in PERCENTILES)}
    for key in ("example_length", "row_tokens"):
        assert set(report[key]) == stats
        assert isinstance(report[key]["mean"], float)
        assert all(type(report[key][f"p{p}"]) is int for p in PERCENTILES)
    assert set(report["examples_per_row"]) == {"mean", "min", "max"}
    assert all(type(v) is int for v in report["rejected"].values())


def test_json_schema_is_stable(packed, tmp_path):
    folder, _ = packed
    r = CliRunner().invoke(main, ["inspect", folder, "--json", "--plots-dir", str(tmp_path / "plots")])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    _check_types(report)
    assert report["schema_version"] == SCHEMA_VERSION == 1
    assert set(report["plots"]) == set(PLOTS)
    # The documented keys (docs/operations.md) are exactly these.
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "operations.md")).read()
    for key in REPORT_KEYS:
        assert f"`{key}`" in doc, key


def test_numbers_match_the_manifest_and_the_shards(packed):
    folder, manifest = packed
    report = inspect(folder)
    c = manifest["counts"]
    assert report["rows"] == c["rows"] > 3
    assert report["tokens"] == c["tokens"] and report["target_tokens"] == c["target_tokens"]
    assert report["examples"] == c["pieces"] == c["examples_packed"]
    assert report["lower_bound"] == c["lower_bound"]
    assert report["fill"] == pytest.approx(c["fill"])
    assert report["examples_per_row"]["mean"] == pytest.approx(c["examples_per_row"])
    assert report["records_read"] == c["records_read"]
    assert report["rejected_total"] == c["rejected"] + c["dropped_too_long"]
    assert report["consistent"] is True and report["manifest"] is True
    assert report["budget"] == 256 and report["format"] == "arrow" and report["plots"] == {}
    assert report["bytes"] == sum(s["bytes"] for s in manifest["shards"])
    el = report["example_length"]
    assert 0 < el["p0"] <= el["p10"] <= el["p50"] <= el["p90"] <= el["p99"] <= el["p100"] <= 256
    assert report["row_tokens"]["p100"] <= 256


def test_pngs_are_valid_and_drawn(packed, tmp_path):
    folder, _ = packed
    report = inspect(folder, str(tmp_path / "plots"))
    assert set(report["plots"]) == set(PLOTS)
    colors = {"example_lengths": (0x4C, 0x72, 0xB0), "row_fill": (0x55, 0xA8, 0x68), "examples_per_row": (0x81, 0x72, 0xB2)}
    for name, path in report["plots"].items():
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size[0] >= 400 and im.size[1] >= 200
            px = np.asarray(im.convert("RGB")).reshape(-1, 3)
        assert len(np.unique(px, axis=0)) > 50, f"{name} looks blank"
        # The bars are drawn: a visible share of pixels has the plot's bar colour.
        bar = np.all(np.abs(px.astype(int) - colors[name]) <= 3, axis=1).mean()
        assert bar > 0.005, (name, bar)
    # The budget line (red, dashed) is on the length histogram.
    with Image.open(report["plots"]["example_lengths"]) as im:
        px = np.asarray(im.convert("RGB")).reshape(-1, 3)
    assert np.all(np.abs(px.astype(int) - (0xC4, 0x4E, 0x52)) <= 3, axis=1).sum() > 50


def test_table_and_default_plots_dir(packed, tmp_path):
    folder, _ = packed
    r = CliRunner().invoke(main, ["inspect", folder])
    assert r.exit_code == 0, r.output
    for label in ("rows", "examples", "tokens", "fill", "lower bound", "examples per row", "example length",
                  "p50", "records read", "rejected", "plot example_lengths"):
        assert label in r.stdout, label
    assert sorted(os.listdir(folder + "-inspect")) == sorted(f"{p}.png" for p in PLOTS)


def test_rejected_by_reason_and_parquet(tmp_path):
    src = tmp_path / "in.jsonl"
    long_text = " ".join(f"w{i}" for i in range(400))
    src.write_text(
        json.dumps({"instruction": "hi", "output": "hello"}) + "\n"
        + "{not json\n"
        + json.dumps({"text": long_text}) + "\n"
        + json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n"
    )
    out = tmp_path / "o"
    run(PackOptions(inputs=(str(src),), output=str(out), max_tokens=64, output_format=OutputFormat.PARQUET))
    report = inspect(str(out))
    assert report["format"] == "parquet" and report["rows"] == 1 and report["examples"] == 1
    assert report["rejected"] == {"malformed_json": 1, "starts_with_assistant": 1, "too_long": 1}
    assert report["rejected_total"] == 3 and report["records_read"] == 4


def test_without_manifest_and_user_errors(packed, tmp_path):
    folder, manifest = packed
    bare = tmp_path / "bare"
    bare.mkdir()
    for s in manifest["shards"]:
        os.link(os.path.join(folder, s["name"]), bare / s["name"])
    report = inspect(str(bare))
    _check_types(report)
    assert report["manifest"] is False and report["consistent"] is None and report["records_read"] is None
    assert report["rejected"] == {} and report["rows"] == manifest["counts"]["rows"]

    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "is not a folder" in r.output
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "empty")])
    assert r.exit_code == 2 and "no train-*.arrow" in r.output
