"""The job on a real distributed engine: Beam's DaskRunner on a ``distributed.LocalCluster`` of 2 worker
processes gives byte-identical output to the default (packstream's local) runner."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

distributed = pytest.importorskip("dask.distributed", reason="needs dask[distributed]: pip install 'packstream[dask]'")

from pipeline.cli import bundled_sample, main  # noqa: E402
from tests._internals import _trace  # noqa: E402


def _inputs(tmp_path: Path) -> Path:
    """The bundled sample, a file of bad and duplicate records, and a long one to split."""
    folder = tmp_path / "in"
    shutil.copytree(bundled_sample(), folder / "sample")
    good = {"messages": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]}
    lines = [json.dumps(good), "{broken", json.dumps({"id": "d", **good}), json.dumps({"id": "d", **good}),
             json.dumps({"text": " ".join(f"w{i}" for i in range(700))}), json.dumps([1, 2])]
    lines += [json.dumps({"instruction": f"Count to {i}.", "output": " ".join(map(str, range(i)))}) for i in range(1, 60)]
    (folder / "extra.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_dask_runner_output_is_byte_identical(tmp_path, monkeypatch):
    src = _inputs(tmp_path)
    out = tmp_path / "out"
    args = ["pack", str(src), "-o", str(out), "-q", "--max-tokens", "256", "--group-size", "16", "--num-shards", "3",
            "--validation-fraction", "0.2", "--long", "split", "--batch-size", "8"]
    default = CliRunner().invoke(main, args)
    assert default.exit_code == 0, default.output
    expected = _files(out)
    assert len([n for n in expected if n.startswith("train-")]) == 3 and any(n.startswith("validation-") for n in expected)
    shutil.rmtree(out)
    trace = tmp_path / "trace"
    trace.mkdir()
    monkeypatch.setenv(_trace.ENV, str(trace))  # the cluster's workers inherit it
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with distributed.Client(cluster) as client:
            assert len(client.scheduler_info()["workers"]) == 2
        on_dask = CliRunner().invoke(main, [*args, "--runner=DaskRunner", f"--dask_client_address={cluster.scheduler_address}",
                                            "--tokenizer-threads", "1"])
    assert on_dask.exit_code == 0, on_dask.output
    # The read tasks (one per input file here) came one per Dask partition (EncodeTasks is set up once per
    # each), dealt to the workers as they freed up, so both workers read some (pipeline._workers.on_dask).
    spans = _trace.read(str(trace))
    encoded = [s for s in spans if s["span"] == "encode_task"]
    assert len(encoded) == 7 and sum(s["span"] == "encode_setup" for s in spans) >= 7
    assert len({s["pid"] for s in encoded}) == 2
    got = _files(out)
    assert sorted(got) == sorted(expected)
    for name in expected:
        if name == "manifest.json":  # the local run says its workers x threads (`run`); the cluster's are its own
            local, dask = json.loads(expected[name]), json.loads(got[name])
            assert "run" in local and "run" not in dask
            local.pop("run")
            assert dask == local, "manifest.json differs between the default runner and Dask beyond `run`"
            continue
        assert got[name] == expected[name], f"{name} differs between the default runner and Dask"
    manifest = json.loads(got["manifest.json"])
    c = manifest["counts"]
    assert manifest["status"] == "complete" and c["rejected"] >= 3 and c["split_examples"] >= 1
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # no spill, no lock left


def test_dask_runner_needs_no_address(tmp_path, capfd):
    """Without --dask_client_address the runner starts a local cluster of its own; its workers print none of
    Beam's import-time warnings (each worker printed "apitools not found" once: pipeline._workers.quiet)."""
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["pack", "-o", str(out), "--max-tokens", "256", "--runner=DaskRunner"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    assert "apitools" not in capfd.readouterr().err + r.output
