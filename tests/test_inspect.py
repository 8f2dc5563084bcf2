"""``packstream inspect``: numbers it computes from the shards, its stable JSON schema, real PNG plots.

Every number inspect computes is held against a truth computed here independently: the shards
read row by row with pyarrow (``to_pylist``, plain Python sums), or the test's own inputs. The
manifest is only the source of what the shards cannot tell (records read, rejected), and those
are held against what the test's inputs are known to contain.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner
from PIL import Image

from packers import PackstreamError
from pipeline import OutputFormat, PackOptions, run
from pipeline.cli import bundled_sample, main
from tests._internals import PERCENTILES, PLOTS, PLOTS_MARK, REPORT_KEYS, SCHEMA_VERSION, inspect

BUDGET = 256


def _sample_records() -> int:
    """Records in the bundled sample, counted from its files (every one of them packs at BUDGET)."""
    n = 0
    for name in os.listdir(bundled_sample()):
        path = os.path.join(bundled_sample(), name)
        if name.endswith(".jsonl"):
            n += sum(1 for line in open(path) if line.strip())
        elif name.endswith(".json"):
            n += len(json.load(open(path)))
    return n


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The bundled sample at a small budget, with a validation split: several rows and shards, varied fill."""
    out = tmp_path_factory.mktemp("inspect") / "out"
    run(PackOptions(inputs=(bundled_sample(),), output=str(out), max_tokens=BUDGET, group_size=7, num_shards=2,
                    validation_fraction=0.25))
    return str(out)


def truth(folder: str) -> dict:
    """What the shards hold, row by row in plain Python, per split and in total."""
    per: dict[str, dict] = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith((".arrow", ".parquet")):
            continue
        split = name.split("-")[0]
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            rows = pq.read_table(os.path.join(folder, name)).to_pylist()
        else:
            rows = pa.ipc.open_stream(open(os.path.join(folder, name), "rb").read()).read_all().to_pylist()
        t = per.setdefault(split, {"shards": 0, "bytes": 0, "rows": [], "lengths": [], "ids": []})
        t["shards"] += 1
        t["bytes"] += os.path.getsize(os.path.join(folder, name))
        t["rows"] += rows
        for r in rows:
            offs = r["seq_offsets"]
            t["lengths"] += [b - a for a, b in zip(offs, offs[1:])]
            t["ids"] += r["example_ids"]

    def summary(t: dict) -> dict:
        tokens = sum(len(r["input_ids"]) for r in t["rows"])
        return {
            "shards": t["shards"], "bytes": t["bytes"], "rows": len(t["rows"]), "examples": len(t["lengths"]),
            "examples_packed": len({i.split("#")[0] for i in t["ids"]}), "tokens": tokens,
            "target_tokens": sum(sum(r["loss_mask"]) for r in t["rows"]),
            "fill": tokens / (len(t["rows"]) * BUDGET) if t["rows"] else 0.0,
        }

    every = {k: sum((t[k] for t in per.values()), start=0 if k in ("shards", "bytes") else []) for k in per["train"]}
    return {"total": summary(every), "splits": {sp: summary(t) for sp, t in per.items()},
            "lengths": every["lengths"], "row_tokens": [len(r["input_ids"]) for r in every["rows"]],
            "per_row": [len(r["example_ids"]) for r in every["rows"]]}


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
    assert all(type(v) is int for v in report["rejected_by_reason"].values())
    for s in report["splits"].values():
        assert set(s) == {"shards", "bytes", "rows", "examples", "examples_packed", "tokens", "target_tokens", "fill"}
        assert all(type(s[k]) is int for k in s if k != "fill") and type(s["fill"]) is float


def test_json_schema_is_stable(packed, tmp_path):
    r = CliRunner().invoke(main, ["inspect", packed, "--json", "--plots-dir", str(tmp_path / "plots")])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    _check_types(report)
    assert report["schema_version"] == SCHEMA_VERSION == 5
    assert set(report["plots"]) == set(PLOTS)
    # The documented keys (docs/operations.md) are exactly these.
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "operations.md")).read()
    for key in REPORT_KEYS:
        assert f"`{key}`" in doc, key


def test_numbers_are_computed_from_the_shards(packed):
    report = inspect(packed)
    t = truth(packed)
    for key, want in t["total"].items():
        assert report[key] == pytest.approx(want), key
    assert set(report["splits"]) == {"train", "validation"}
    for split, want in t["splits"].items():
        assert report["splits"][split] == pytest.approx(want), split
    assert report["rows"] > 3 and report["splits"]["validation"]["rows"] >= 1
    # Every record of the bundled sample packs at this budget, once, in one split or the other.
    assert report["examples_packed"] == _sample_records() == report["records_read"]
    tokens = t["total"]["tokens"]
    assert report["lower_bound"] == math.ceil(tokens / BUDGET)
    assert report["rows_over_lower_bound"] == pytest.approx(t["total"]["rows"] / math.ceil(tokens / BUDGET) - 1)
    assert report["examples_per_row"] == {"mean": pytest.approx(np.mean(t["per_row"])), "min": min(t["per_row"]),
                                          "max": max(t["per_row"])}
    lengths = sorted(t["lengths"])
    el = report["example_length"]
    assert el["mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert el["p0"] == lengths[0] and el["p100"] == lengths[-1] and el["p50"] == lengths[(len(lengths) - 1) // 2]
    assert report["row_tokens"]["p100"] == max(t["row_tokens"]) <= BUDGET
    assert report["budget"] == BUDGET and report["format"] == "arrow" and report["plots"] == {}
    assert report["consistent"] is True and report["warnings"] == []
    assert report["rejected"] == report["dropped_too_long"] == report["not_sampled"] == 0


def test_pngs_are_valid_and_drawn(packed, tmp_path):
    report = inspect(packed, str(tmp_path / "plots"))
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


def test_table_and_default_plots_dir(packed):
    r = CliRunner().invoke(main, ["inspect", packed])
    assert r.exit_code == 0, r.output
    for label in ("rows", "examples packed", "sequences", "tokens", "fill", "lower bound", "examples per row",
                  "example length", "p50", "records read", "rejected", "dropped (> 256 tokens)", "  train",
                  "  validation", "plot example_lengths", "KiB"):
        assert label in r.stdout, label
    assert sorted(os.listdir(packed + "-inspect")) == sorted([PLOTS_MARK] + [f"{p}.png" for p in PLOTS])


def test_rejected_is_counted_like_packs_summary_and_parquet(tmp_path):
    """A too-long example is dropped for length, not rejected: inspect counts them apart, as pack does."""
    src = tmp_path / "in.jsonl"
    long_text = " ".join(f"w{i}" for i in range(400))
    src.write_text(
        json.dumps({"instruction": "hi", "output": "hello"}) + "\n"
        + "{not json\n"
        + json.dumps({"text": long_text}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n"
    )
    out = tmp_path / "o"
    run(PackOptions(inputs=(str(src),), output=str(out), max_tokens=64, output_format=OutputFormat.PARQUET,
                    max_reject_fraction=1.0))  # 3 of 4 records off the main path, on purpose
    report = inspect(str(out))
    assert report["format"] == "parquet" and report["rows"] == 1 and report["examples"] == 1
    assert report["examples_packed"] == 1 and report["records_read"] == 4
    assert report["rejected_by_reason"] == {"malformed_json": 1, "no_assistant_turn": 1}
    assert report["rejected"] == 2 and report["dropped_too_long"] == 1
    assert report["tokens"] == truth(str(out))["total"]["tokens"]
    table = CliRunner().invoke(main, ["inspect", str(out), "--no-plots"]).stdout
    assert "rejected                    2" in table and "dropped (> 64 tokens)       1" in table


def test_disagreements_and_unlisted_files_are_warned_about(packed, tmp_path):
    folder = tmp_path / "out"
    shutil.copytree(packed, folder)
    m = json.loads((folder / "manifest.json").read_text())
    first = m["shards"][0]["name"]
    shutil.copy(folder / first, folder / "backup-00000-of-00003.arrow")
    table = pa.ipc.open_stream((folder / first).read_bytes()).read_all()
    with pa.OSFile(str(folder / first), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table.slice(1))  # a row removed: the file no longer holds what its entry says
    report = inspect(str(folder))
    assert report["consistent"] is False
    assert any(w.startswith(f"{first}: manifest.json says rows") for w in report["warnings"])
    assert any("counts.rows" in w for w in report["warnings"])
    assert any(w.startswith("backup-00000-of-00003.arrow") for w in report["warnings"])
    assert report["rows"] == truth(packed)["total"]["rows"] - 1  # the stray copy is not read

    m["counts"]["rows"] += 1  # a manifest that contradicts itself is refused, in one line
    (folder / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["inspect", str(folder), "--no-plots"])
    assert r.exit_code == 2 and r.output.count("\n") == 1 and "manifest.json counts.rows says" in r.output, r.output


def test_only_a_complete_manifest_is_read(packed, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in os.listdir(packed):
        if name != "manifest.json":
            os.link(os.path.join(packed, name), bare / name)
    r = CliRunner().invoke(main, ["inspect", str(bare)])
    assert r.exit_code == 2 and "shard files but no manifest.json" in r.output and "Traceback" not in r.output
    (bare / ".packstream.lock").write_text("{}")
    r = CliRunner().invoke(main, ["inspect", str(bare)])
    assert r.exit_code == 2 and ".packstream.lock is present" in r.output
    m = json.loads(open(os.path.join(packed, "manifest.json")).read())
    m.update(status="failed", error="disk full")
    (bare / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["inspect", str(bare)])
    assert r.exit_code == 2 and "failed (disk full)" in r.output

    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "is not a folder" in r.output
    (tmp_path / "empty").mkdir()
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "empty")])
    assert r.exit_code == 2 and "no manifest.json" in r.output


# -- issue 16, cause 4: inspect writes only into a plots folder of its own ----------------------------------


def test_plots_never_overwrite_a_users_file(packed, tmp_path):
    plots = tmp_path / "mine"
    plots.mkdir()
    (plots / "row_fill.png").write_bytes(b"the user's own figure")
    r = CliRunner().invoke(main, ["inspect", packed, "--plots-dir", str(plots)])
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "holds files inspect did not write" in errors[0], r.output
    assert (plots / "row_fill.png").read_bytes() == b"the user's own figure"
    assert sorted(os.listdir(plots)) == ["row_fill.png"]


def test_plots_dir_that_is_a_file_is_one_error_line(packed, tmp_path):
    target = tmp_path / "out-inspect"
    target.write_bytes(b"notes")
    r = CliRunner().invoke(main, ["inspect", packed, "--plots-dir", str(target)])
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "exists and is not a folder" in errors[0], r.output
    assert "Traceback" not in r.output and target.read_bytes() == b"notes"


def test_inspect_rewrites_its_own_plots_and_nothing_else(packed, tmp_path):
    plots = tmp_path / "plots"
    first = inspect(packed, str(plots))["plots"]
    mark = json.loads((plots / PLOTS_MARK).read_text())
    assert set(mark["plots"]) == {f"{p}.png" for p in PLOTS}
    assert inspect(packed, str(plots))["plots"] == first  # its own folder: rewritten in place
    (plots / "notes.txt").write_text("mine")  # a user's file beside inspect's: left alone
    inspect(packed, str(plots))
    assert (plots / "notes.txt").read_text() == "mine"
    (plots / "example_lengths.png").write_bytes(b"edited by the user")  # one of its names, changed since
    with pytest.raises(PackstreamError, match=r"example_lengths.png is not the plot inspect wrote there"):
        inspect(packed, str(plots))
    assert (plots / "example_lengths.png").read_bytes() == b"edited by the user"
    (plots / "example_lengths.png").unlink()
    (plots / "example_lengths.png").symlink_to(tmp_path / "elsewhere.png")  # a link: never written through
    with pytest.raises(PackstreamError, match=r"example_lengths.png is not the plot inspect wrote there"):
        inspect(packed, str(plots))
    assert not (tmp_path / "elsewhere.png").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert set(inspect(packed, str(empty))["plots"]) == set(PLOTS)  # an empty folder becomes inspect's
