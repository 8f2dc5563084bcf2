"""``packstream repack`` on every runner: the local one (in-process and on 2 workers), Beam's DirectRunner and
DaskRunner (a ``distributed.LocalCluster`` of 2 processes) write byte-identical repacked shards, as pack does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests.test_repack import write_records


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != "manifest.json"}


def _manifest(folder: Path) -> dict:
    m = json.loads((folder / "manifest.json").read_text())
    m.pop("run", None)  # the local run's workers x threads; a cluster's are its own
    m.pop("elapsed_s", None)
    m["config"].pop("output")
    return m


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("runners")
    for i in range(3):
        write_records(tmp / "in" / f"part{i}.jsonl", "sft", 40, i)
    bad = tmp / "in" / "bad.jsonl"
    bad.write_text('{broken\n{"prompt": "q", "completion": " a"}\n')
    out = tmp / "packed"
    r = CliRunner().invoke(main, ["pack", str(tmp / "in"), "-o", str(out), "-q", "--max-tokens", "2048",
                                  "--num-shards", "3"])
    assert r.exit_code == 0, r.output
    return out


ARGS = ["--max-tokens", "128", "--group-size", "16", "--num-shards", "2", "--validation-fraction", "0.2", "-q"]


def _repack(packed: Path, out: Path, *extra: str) -> tuple[dict, dict]:
    r = CliRunner().invoke(main, ["repack", str(packed), "-o", str(out), *ARGS, *extra])
    assert r.exit_code == 0, r.output
    return _files(out), _manifest(out)


def test_local_workers_and_direct_runner_are_byte_identical(packed, tmp_path):
    expected = _repack(packed, tmp_path / "one", "--workers", "1")
    assert _repack(packed, tmp_path / "two", "--workers", "2") == expected
    assert _repack(packed, tmp_path / "direct", "--runner=DirectRunner") == expected
    assert any(n.startswith("validation-") for n in expected[0])


def test_dask_runner_is_byte_identical(packed, tmp_path):
    distributed = pytest.importorskip("dask.distributed", reason="needs dask[distributed]: pip install 'packstream[dask]'")
    expected = _repack(packed, tmp_path / "local")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        got = _repack(packed, tmp_path / "dask", "--runner=DaskRunner",
                      f"--dask_client_address={cluster.scheduler_address}")
    assert got == expected
