"""Interruption: SIGINT, SIGTERM and SIGHUP at seeded points in every phase of a run.

Each case runs ``packstream pack`` in a process of its own (its own session, like a shell job) with
``--workers 1`` or ``2``; the hook of :mod:`pipeline._workers.signals` (``PACKSTREAM_SIGNAL_AT``) sends the
signal from inside the phase, at its N-th pass, to the launcher's process group (what a terminal
does for Ctrl-C and hang-up) or to the launcher alone (``kill PID``). Then:

* the command exits 128 + the signal (130, 143, 129) with exactly one line on stderr, ``error:
  interrupted by SIG...`` naming what to do, and nothing else from any process (no traceback, no
  KeyboardInterrupt from a worker, no log line);
* no shard sits under its final name, nothing temporary is left, and ``datasets.load_dataset``,
  ``packers.PackedDataset`` and ``packstream verify`` all refuse the folder;
* a rerun without ``--overwrite`` is refused as an earlier packstream output (never as files
  packstream did not write), and ``--overwrite`` gives a clean run's bytes, with nothing left over.

The grid is one case per phase, with the signal, the worker count and the target rotated over the
phases so that every signal meets both worker counts and both targets (:data:`GRID`); how a signal
maps to its exit code and its one line is a unit test (tests/test_signals.py). Two cases stay in the
fast tier.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import packers
from pipeline.cli import bundled_sample, main
from tests._internals import signals

pytestmark = pytest.mark.usefixtures("default_signals")  # signals ignored by nohup: tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["-q", "--max-tokens", "256", "--group-size", "16", "--num-shards", "3", "--batch-size", "8",
        "--validation-fraction", "0.2"]
SEED = 20261201
SIGNALS = ("INT", "TERM", "HUP")
LAUNCHER_ONLY = {"launch"}  # passes made by the launcher itself, whatever the workers
ONE_PROCESS = {"commit"}    # passes made by the one step that commits (Finalize)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("interrupt") / "in"
    shutil.copytree(bundled_sample(), folder)
    lines = [json.dumps({"instruction": f"Count to {i}.", "output": " ".join(map(str, range(i)))}) for i in range(1, 120)]
    lines += ["{broken", json.dumps({"messages": []}), json.dumps({"text": " ".join(f"w{i}" for i in range(400))})]
    (folder / "extra.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _files(folder: Path) -> dict[str, bytes]:
    """Every entry's bytes (a folder is an error); the manifest with its one run-specific value blanked."""
    out = {p.name: p.read_bytes() for p in sorted(folder.iterdir())}
    if "manifest.json" in out:
        out["manifest.json"] = out["manifest.json"].replace(json.dumps(str(folder)).encode(), b'"OUT"')
    return out


@pytest.fixture(scope="module")
def clean(inputs, tmp_path_factory):
    """A clean run's files, and how often it passes each point (counted in this process, one worker)."""
    counts: dict[str, int] = {}

    def count(phase: str) -> None:
        counts[phase] = counts.get(phase, 0) + 1

    out = tmp_path_factory.mktemp("clean") / "out"
    real, signals.at = signals.at, count
    try:
        r = CliRunner().invoke(main, ["pack", str(inputs), "-o", str(out), *ARGS])
    finally:
        signals.at = real
    assert r.exit_code == 0, r.output
    assert set(counts) == set(signals.PHASES), counts
    return _files(out), counts


def _interrupt(inputs: Path, out: Path, phase: str, n: int, sig: str, target: str, workers: int):
    marker = out.parent / f"{out.name}.fired"
    env = {**os.environ, signals.HOOK_ENV: f"{phase}:{n}:{sig}:{target}:{marker}"}
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "pack", str(inputs), "-o", str(out), *ARGS,
                        "--workers", str(workers)], cwd=ROOT, env=env, capture_output=True, text=True,
                       start_new_session=True, timeout=600)
    assert marker.exists(), f"{phase}#{n} was never reached (exit {r.returncode}): {r.stderr[-2000:]}"
    return r


def _refused_by_every_reader(out: Path, case: str) -> None:
    import datasets

    with pytest.raises(Exception) as e:  # noqa: PT011 - whatever datasets raises, it must not load
        datasets.load_dataset(str(out))
    assert not isinstance(e.value, AssertionError)
    with pytest.raises(packers.PackstreamError):
        packers.PackedDataset(str(out))
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code in (1, 2) and "Traceback" not in r.output, (case, r.output)


def check(inputs: Path, expected: dict[str, bytes], out: Path, phase: str, n: int, sig: str, target: str,
          workers: int) -> None:
    case = f"SIG{sig} to the {target} at {phase}#{n}, --workers {workers}"
    r = _interrupt(inputs, out, phase, n, sig, target, workers)
    signum = getattr(signal, f"SIG{sig}")
    lines = r.stderr.splitlines()
    assert r.returncode == 128 + signum, (case, r.returncode, r.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith(f"error: interrupted by SIG{sig}"), (case, r.stderr[-3000:])
    assert r.stdout == "", (case, r.stdout[-2000:])
    if not out.exists():  # stopped before the claim: nothing was written, and the line says so
        assert "before anything was written" in lines[0], (case, lines[0])
        rerun = CliRunner().invoke(main, ["pack", str(inputs), "-o", str(out), *ARGS])
        assert rerun.exit_code == 0 and _files(out) == expected, (case, rerun.output)
        return
    assert "--overwrite" in lines[0], (case, lines[0])
    left = sorted(os.listdir(out))  # no shard took its final name, and nothing temporary stays
    assert not [n for n in left if n.startswith(("train-", "validation-", ".tmp-"))], (case, left)
    _refused_by_every_reader(out, case)
    again = CliRunner().invoke(main, ["pack", str(inputs), "-o", str(out), *ARGS])
    assert again.exit_code == 2 and "--overwrite" in again.output, (case, again.output)
    assert "did not write" not in again.output, (case, again.output)
    rerun = CliRunner().invoke(main, ["pack", str(inputs), "-o", str(out), *ARGS, "--overwrite"])
    assert rerun.exit_code == 0, (case, rerun.output)
    assert _files(out) == expected, f"{case}: a rerun with --overwrite differs from a clean run"
    shutil.rmtree(out)


def _point(counts: dict[str, int], phase: str, sig: str, workers: int) -> tuple[int, str]:
    """A seeded pass of ``phase`` that some process reaches (with 2 workers, one of them makes at least half
    of the passes), and where the signal goes."""
    rng = random.Random(f"{SEED}:{phase}:{sig}:{workers}")
    most = counts[phase] if workers == 1 or phase in LAUNCHER_ONLY | ONE_PROCESS else math.ceil(counts[phase] / 2)
    return rng.randint(1, most), rng.choice(["group", "launcher"])


GRID = [  # (phase, signal, workers, target): one case per phase
    ("launch", "INT", 1, "group"),
    ("read", "TERM", 2, "group"),
    ("encode", "HUP", 1, "launcher"),
    ("spill", "INT", 2, "launcher"),
    ("pack", "TERM", 1, "launcher"),
    ("shard_write", "HUP", 2, "group"),
    ("commit", "INT", 1, "group"),
]


def test_the_grid_covers_every_phase_signal_worker_count_and_target():
    assert [c[0] for c in GRID] == list(signals.PHASES)
    for sig in SIGNALS:  # every signal with both worker counts and both targets
        assert {c[2] for c in GRID if c[1] == sig} == {1, 2}, sig
        assert {c[3] for c in GRID if c[1] == sig} == {"group", "launcher"}, sig
    # a terminal's signal to the whole group, and a kill of the launcher alone, each with workers running
    assert {(w, t) for _, _, w, t in GRID} == {(1, "group"), (1, "launcher"), (2, "group"), (2, "launcher")}


@pytest.mark.parametrize("phase,sig,workers", [("shard_write", "INT", 2), ("commit", "TERM", 1)])
def test_a_signal_ends_with_one_line_and_a_folder_overwrite_cleans(inputs, clean, tmp_path, phase, sig, workers):
    expected, counts = clean
    n, target = _point(counts, phase, sig, workers)
    check(inputs, expected, tmp_path / "out", phase, n, sig, target, workers)


@pytest.mark.slow
@pytest.mark.parametrize("phase,sig,workers,target", GRID)
def test_a_signal_in_every_phase(inputs, clean, tmp_path, phase, sig, workers, target):
    expected, counts = clean
    n, _ = _point(counts, phase, sig, workers)
    check(inputs, expected, tmp_path / "out", phase, n, sig, target, workers)


_THREAD_RACE = """
import os, signal, sys, threading, time
from pipeline._workers import signals

def boom():
    raise RuntimeError("Worker subprocess exited with return code -15")

with signals.handling():
    try:
        threading.Thread(target=boom, name="run_worker").start()
        time.sleep(0.3)
        if sys.argv[1] == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    except signals.Stop:
        sys.exit(143)
"""


@pytest.mark.parametrize("then", ["signal", "nothing"])
def test_a_thread_that_loses_its_worker_before_the_handler_runs_prints_nothing(then):
    """The CI race behind 'Exception in thread run_worker': a signal to the group kills a worker, and the
    launcher's thread watching it raises before the main thread has run the Python-level handler. The
    exception waits for the handler (``THREAD_GRACE_S``); without a signal it is printed as before."""
    r = subprocess.run([sys.executable, "-c", _THREAD_RACE, then], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    if then == "signal":
        assert r.returncode == 143 and r.stderr == "", r.stderr
    else:
        assert r.returncode == 0 and "Exception in thread run_worker" in r.stderr, r.stderr
