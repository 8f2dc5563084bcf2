"""Signal -> exit code and one line, without a subprocess: the CLI's end of an interrupted command.

The end-to-end cases (a real signal in every phase of a real run, the folder left behind) are
tests/test_interrupt.py.
"""

from __future__ import annotations

import logging
import os
import signal
import threading

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests._internals import _job, interrupted_message, signals

pytestmark = pytest.mark.usefixtures("default_signals")  # signals ignored by nohup: tests/conftest.py

SIGNALS = ("INT", "TERM", "HUP")


@pytest.fixture
def after_a_signal():
    """A handled signal leaves this process as a stopping one (logging off, thread tracebacks muted, the signal
    noted): put it back for the next test."""
    hook = threading.excepthook
    yield
    logging.disable(logging.NOTSET)
    threading.excepthook = hook
    signals._state = signals._State()


@pytest.mark.parametrize("sig", SIGNALS)
def test_a_signal_maps_to_its_exit_code_and_one_line(sig, monkeypatch, tmp_path, after_a_signal):
    """The CLI's end of a signal: the handler stops the command, which exits 128 + N with one line naming it."""
    signum = getattr(signal, f"SIG{sig}")
    assert signals.exit_code(signum) == {"INT": 130, "TERM": 143, "HUP": 129}[sig]
    assert signals.name(signum) == f"SIG{sig}" and signals.name(999) == "signal 999"

    def interrupted_run(options, beam_args=(), **kw):
        os.kill(os.getpid(), signum)
        threading.Event().wait(10)  # the handler raises Stop here
        raise AssertionError("the signal was not handled")

    monkeypatch.setattr(_job, "launch", interrupted_run)
    r = CliRunner().invoke(main, ["pack", "-o", str(tmp_path / "out")])
    assert r.exit_code == 128 + signum, r.output
    assert r.stdout == "" and r.stderr == f"error: interrupted by SIG{sig}\n", r.output


@pytest.mark.parametrize("state,words", [
    ("complete", ["after the output was committed", "is complete", "packstream verify"]),
    ("failed", ["holds no complete output", "manifest.json says failed", "--overwrite"]),
    ("locked", ["partial output and the run's lock", "--overwrite"]),
])
def test_an_interrupted_run_says_what_its_folder_holds(state, words, monkeypatch, tmp_path):
    """The launcher's Interrupted (the folder made to explain itself) becomes the one line and the exit code."""
    line = interrupted_message(signal.SIGTERM, str(tmp_path / "out"), state)
    assert line.startswith("interrupted by SIGTERM") and all(w in line for w in words), line

    def interrupted_run(options, beam_args=(), **kw):
        return _job.Interrupted(signal.SIGTERM, line)

    monkeypatch.setattr(_job, "launch", interrupted_run)
    r = CliRunner().invoke(main, ["pack", "-o", str(tmp_path / "out")])
    assert r.exit_code == 143 and r.stderr == f"error: {line}\n", r.output


def test_the_signal_tests_pass_when_the_suite_starts_with_sigint_and_sighup_ignored(tmp_path):
    """``nohup pytest &``: the suite starts with SIGINT and SIGHUP ignored, inherited by everything it spawns. The
    interruption tests give them back their default for their own duration (tests/conftest.py), and the run's
    header says so; without that, every case that sends SIGINT or SIGHUP saw nothing happen."""
    import subprocess
    import sys
    from pathlib import Path

    def as_nohup():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
         "tests/test_signals.py::test_a_signal_maps_to_its_exit_code_and_one_line", "tests/test_interrupt.py::test_a_signal_in_every_phase[spill-INT-2-launcher]",
         "tests/test_interrupt.py::test_a_signal_in_every_phase[encode-HUP-1-launcher]",
         "tests/test_interrupt.py::test_a_signal_in_every_phase[commit-INT-1-group]"],
        cwd=root, preexec_fn=as_nohup, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "signals: SIGINT, SIGHUP ignored by whoever started the suite" in proc.stdout
    assert "6 passed" in proc.stdout, proc.stdout[-2000:]


def test_a_worker_whose_launcher_died_before_it_started_ends(tmp_path):
    """The race behind a hang seen under load: the launcher exits (a zombie its parent has not reaped yet, since the
    parent still reads the launcher's stdout) before a forked worker reaches ``worker_setup``. Its death signal was
    never armed and its pid still answers ``kill(pid, 0)``; the worker must see it was handed to init and end, not
    wait for work forever holding the stdout the parent reads."""
    import subprocess
    import sys
    import textwrap
    import time

    script = textwrap.dedent("""
        import os, sys, time
        from tests._internals import signals
        launcher = os.getpid()
        if os.fork() == 0:  # the worker
            time.sleep(0.5)  # the launcher is gone (a zombie) by now
            signals.worker_setup(launcher)
            print("worker still running", flush=True)
            time.sleep(60)  # what waiting for work looks like
            os._exit(0)
        os._exit(0)  # the launcher dies at once, unreaped: its parent is still reading the pipe
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=root)
    t0 = time.monotonic()
    out = proc.stdout.read()  # EOF once every holder of the pipe (the launcher, the worker) has ended
    waited = time.monotonic() - t0
    proc.wait(timeout=10)
    assert "worker still running" not in out and waited < 30, (out, waited)
