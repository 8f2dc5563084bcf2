"""Crash consistency: SIGKILL ``packstream pack`` at 20+ seeded points across every phase of a run.

After each kill the output folder is in one of two states, and nothing in between:

* not committed: ``datasets.load_dataset``, ``packstream verify`` and ``packers.PackedDataset`` all
  refuse the folder, saying why (the guard card, a lock of a killed run, shards without a manifest);
* committed: every file the complete manifest lists, and the manifest itself, is byte-identical to
  a clean run's (only packstream's own ``.tmp-*`` names and the lock may be left beside them).

A rerun into the leftovers is refused without ``--overwrite`` (the killed run's lock is reported as
stale), and with it always gives the clean run's bytes, with nothing left over. The kills come from
inside each phase (tests/_kill.py patches the phase's function in the killed process), not from a
timer, so every phase is hit on any machine.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import bundled_sample, main

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["-q", "--max-tokens", "256", "--group-size", "16", "--num-shards", "3", "--batch-size", "8",
        "--validation-fraction", "0.2"]
POINTS = 22
SEED = 20261130


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("crash") / "in"
    shutil.copytree(bundled_sample(), folder)
    lines = [json.dumps({"instruction": f"Count to {i}.", "output": " ".join(map(str, range(i)))}) for i in range(1, 120)]
    lines += ["{broken", json.dumps({"messages": []}), json.dumps({"text": " ".join(f"w{i}" for i in range(400))})]
    (folder / "extra.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _kill_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests._kill", *args]


def _files(folder: Path) -> dict[str, bytes]:
    """Every file's bytes; the manifest with its one run-specific value (config.output) blanked."""
    out = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    if "manifest.json" in out:
        out["manifest.json"] = out["manifest.json"].replace(json.dumps(str(folder)).encode(), b'"OUT"')
    return out


@pytest.fixture(scope="module")
def clean(inputs, tmp_path_factory) -> tuple[dict[str, bytes], dict[str, int]]:
    out = tmp_path_factory.mktemp("clean") / "out"
    r = subprocess.run(_kill_cmd("count", "pack", str(inputs), "-o", str(out), *ARGS), cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    counts = json.loads(r.stdout.split("COUNTS ", 1)[1])
    files = _files(out)
    assert json.loads(files["manifest.json"])["status"] == "complete"
    return files, counts


def _points(counts: dict[str, int]) -> list[tuple[str, int]]:
    """Every phase at least once, then seeded random points, weighted by how often each phase runs."""
    rng = random.Random(SEED)
    phases = sorted(counts)
    points = [(p, rng.randint(1, counts[p])) for p in phases]
    weights = [counts[p] ** 0.5 for p in phases]
    while len(points) < POINTS:
        p = rng.choices(phases, weights)[0]
        points.append((p, rng.randint(1, counts[p])))
    return points


def _refused_by_every_reader(out: Path) -> None:
    import datasets

    import packers

    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code != 0, r.output
    assert "manifest.json" in r.output or ".packstream.lock" in r.output, r.output
    with pytest.raises(packers.PackstreamError, match="manifest.json|.packstream.lock"):
        packers.PackedDataset(str(out))
    with pytest.raises(FileNotFoundError, match="packstream-output-not-complete"):  # the guard card
        datasets.load_dataset(str(out))


def test_sigkill_anywhere_leaves_nothing_that_passes_for_complete(inputs, clean, tmp_path):
    expected, counts = clean
    points = _points(counts)
    assert len(points) >= 20 and {p for p, _ in points} == set(counts)
    for phase, n in points:
        out = tmp_path / f"out-{phase}-{n}"
        r = subprocess.run(_kill_cmd(phase, str(n), "pack", str(inputs), "-o", str(out), *ARGS), cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == -signal.SIGKILL, (phase, n, r.returncode, r.stderr[-2000:])
        names = sorted(os.listdir(out))
        manifest = json.loads((out / "manifest.json").read_text()) if "manifest.json" in names else None
        got = _files(out)
        committed = manifest is not None and manifest.get("status") == "complete" and all(
            got.get(name) == expected[name] for name in [*manifest["files"], "manifest.json"])
        if committed:
            extra = set(names) - set(manifest["files"]) - {"manifest.json"}
            assert all(x.startswith(".tmp-") or x == ".packstream.lock" for x in extra), (phase, n, extra)
        else:
            # No commit (a complete manifest whose card is still the guard is no commit either): every shard under
            # a final name may exist, but no reader takes the folder for an output.
            own = (".tmp-", ".packstream.lock", "train-", "validation-", "rejected.jsonl", "README.md", "manifest.json")
            assert all(x.startswith(own) for x in names), (phase, n, names)
            _refused_by_every_reader(out)
        again = CliRunner().invoke(main, ["pack", str(inputs), "-o", str(out), *ARGS])
        assert again.exit_code == 2 and "--overwrite" in again.output, (phase, n, again.output)
        assert "killed run" in again.output or "earlier packstream output" in again.output, again.output
        rerun = CliRunner().invoke(main, ["pack", str(inputs), "-o", str(out), *ARGS, "--overwrite"])
        assert rerun.exit_code == 0, (phase, n, rerun.output)
        assert _files(out) == expected, f"a rerun after a kill in {phase}#{n} differs from a clean run"
        shutil.rmtree(out)
