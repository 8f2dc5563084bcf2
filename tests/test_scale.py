"""Scaling with workers: the output never depends on how the work is cut, spread or who does it.

* the read tasks: tasks of any size cover every line of a JSONL file exactly once, at its line number;
* the job: the same bytes whatever the task size (a group's examples are sorted before packing);
* local workers forked warm from the launcher (pipeline._job._local): the same bytes as one process, and
  no process left behind, even when the launcher dies;
* ``--workers`` / ``--tokenizer-threads`` auto (pipeline._workers.parallel).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import PackOptions, run
from tests._internals import _read, _trace, parallel

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------
# The read tasks


_line = st.one_of(
    st.fixed_dictionaries({"instruction": st.text(max_size=30), "output": st.text(max_size=60)}).map(json.dumps),
    st.just(""),  # a blank line: not a record, but it has a line number
    st.just("{broken"),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_line, min_size=1, max_size=40), ending=st.sampled_from(["\n", "\r\n"]),
       last_newline=st.booleans(), task_bytes=st.integers(1, 400))
def test_tasks_of_any_size_read_every_line_once(lines, ending, last_newline, task_bytes):
    text = ending.join(lines) + (ending if last_newline else "")
    if not text.strip():
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "x.jsonl")
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        f = _read.InputFile(path, "x.jsonl", "jsonl")
        whole = [(pos, repr(rec)) for pos, rec in _read.read_file(f, 2**20)]
        tasks = _read.cut_tasks(f, task_bytes)
        cut = [(pos, repr(rec)) for t in tasks for pos, rec in _read.read_task(t, 2**20)]
    assert cut == whole
    assert len({t.name for t in tasks}) == len(tasks)  # names the tasks' spill files: unique


def test_task_size_follows_the_workers():
    mib = 2**20
    assert _read.task_bytes(16 * mib, 1) == _read.TASK_BYTES  # one worker: nothing to balance
    assert _read.task_bytes(64 * mib, 2) == 4 * mib  # 16 for two
    assert _read.task_bytes(64 * mib, 64) == _read.MIN_TASK_BYTES  # never smaller than the minimum
    assert _read.task_bytes(10**12, 64) == _read.TASK_BYTES  # nor larger than the maximum
    assert _read.task_bytes(64 * mib, None) == _read.task_bytes(64 * mib, _read.UNKNOWN_WORKERS)


# ---------------------------------------------------------------------------------------
# The job


def _write_mix(folder: Path, seed: int) -> Path:
    """Records of varied lengths, a duplicate id, a broken line, a blank line, CRLF endings."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    lines = []
    for i in range(400):
        n = rng.choice([3, 10, 40, 150, 600])
        rec = {"id": f"r{i}", "instruction": f"Say {i}.", "output": " ".join(rng.choices(words, k=n))}
        lines.append(json.dumps(rec))
    lines[17] = json.dumps({"id": "r3", "instruction": "Again.", "output": "A duplicate id."})
    lines[50] = "{broken"
    lines[51] = ""
    path = folder / "mix.jsonl"
    path.write_bytes(("\r\n".join(lines) + "\r\n").encode())
    return path


def _files(folder: str) -> dict[str, bytes]:
    return {n: (Path(folder) / n).read_bytes() for n in sorted(os.listdir(folder))}


def test_output_does_not_depend_on_the_task_size(tmp_path, monkeypatch):
    src = _write_mix(tmp_path, seed=7)
    base = PackOptions(inputs=(str(src),), max_tokens=512, group_size=60, num_shards=3, validation_fraction=0.1,
                       long="split", batch_size=32, output=str(tmp_path / "one"))
    monkeypatch.setattr(_read, "task_bytes", lambda size, workers=None, scale=1.0: 10**9)  # one task
    run(base)
    one = _files(base.output)
    for task_bytes in (997, 8000):  # dozens of tasks, cut mid-way through the groups
        monkeypatch.setattr(_read, "task_bytes", lambda size, workers=None, scale=1.0, b=task_bytes: b)
        out = str(tmp_path / f"cut-{task_bytes}")
        run(dataclasses.replace(base, output=out))
        got = _files(out)
        assert got.keys() == one.keys()
        for name in one:
            assert got[name] == one[name] or name == "manifest.json", f"{name} differs with {task_bytes}-byte tasks"
        m1, m2 = json.loads(one["manifest.json"]), json.loads(got["manifest.json"])
        assert m1["shards"] == m2["shards"] and m1["counts"] == m2["counts"]


@pytest.mark.slow
def test_forked_workers_write_the_same_bytes_and_leave_nothing(tmp_path):
    """``--workers 2`` as a user runs it (the CLI, so the launcher forks its workers) against one process:
    byte-identical, the groups packed on both workers, every worker forked (no cold start), none left."""
    src = _write_mix(tmp_path, seed=3)
    args = [str(src), "--max-tokens", "512", "--group-size", "40", "--num-shards", "2", "--validation-fraction",
            "0.1", "--long", "split", "--batch-size", "32", "-q"]
    one = tmp_path / "one"
    run(PackOptions(inputs=(str(src),), max_tokens=512, group_size=40, num_shards=2, validation_fraction=0.1,
                    long="split", batch_size=32, output=str(one), workers=1))
    trace = tmp_path / "trace"
    trace.mkdir()
    two = tmp_path / "two"
    env = {**os.environ, _trace.ENV: str(trace)}
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "pack", *args, "-o", str(two), "--workers", "2",
                        "--tokenizer-threads", "1"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr
    a, b = _files(str(one)), _files(str(two))
    assert a.keys() == b.keys()
    for name in a:
        if name not in ("manifest.json", "README.md"):  # both name their own output folder
            assert a[name] == b[name], f"{name} differs between one process and two workers"
    spans = _trace.read(str(trace))
    forked = {s["pid"] for s in spans if s["span"] == "worker"}
    assert len(forked) == 2
    assert {s["pid"] for s in spans if s["span"] in ("encode_task", "pack_group")} <= forked
    assert len({s["pid"] for s in spans if s["span"] == "pack_group"}) == 2  # groups packed on both workers
    _assert_gone(forked)


def _assert_gone(pids, within: float = 10.0) -> None:
    import psutil

    deadline = time.monotonic() + within
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE}
        time.sleep(0.1)
    assert not alive, f"worker processes left behind: {alive}"


def test_idle_workers_end_with_the_run_or_the_launcher(tmp_path):
    """close() reaps them; a launcher that dies without closing (SIGKILL) leaves none behind either."""
    script = textwrap.dedent("""
        import json, os, sys
        from tests._internals import _local
        closed = _local.Workers(2)
        pids = [p.pid for p in closed.procs]
        closed.close()
        orphaned = _local.Workers(2)
        print(json.dumps({"closed": pids, "orphaned": [p.pid for p in orphaned.procs]}), flush=True)
        os._exit(0)  # as if killed: the workers are never closed
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    pids = json.loads(r.stdout)
    assert len(pids["closed"]) == len(pids["orphaned"]) == 2
    _assert_gone(pids["closed"], within=1.0)
    _assert_gone(pids["orphaned"])


@pytest.mark.slow
def test_a_failing_worker_fails_the_run_and_leaves_no_worker(tmp_path):
    """A step that breaks in a forked worker (patched in the launcher: the fork inherits it) fails the run;
    the workers are stopped with it, none is left behind."""
    src = _write_mix(tmp_path, seed=5)
    trace = tmp_path / "trace"
    trace.mkdir()
    script = textwrap.dedent(f"""
        import sys
        from pipeline import PackOptions, _rows, run

        def broken(*a, **kw):
            raise RuntimeError("packing broke")

        _rows.pack_group = broken
        try:
            run(PackOptions(inputs=({str(src)!r},), output={str(tmp_path / "out")!r}, max_tokens=512, workers=2,
                            tokenizer_threads=1, group_size=100))
        except Exception as e:
            print("FAILED", type(e).__name__)
            sys.exit(0)
        print("PASSED")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600,
                       env={**os.environ, _trace.ENV: str(trace)})
    assert r.returncode == 0 and "FAILED" in r.stdout, r.stdout + r.stderr[-3000:]
    forked = {s["pid"] for s in _trace.read(str(trace)) if s["span"] == "worker"}
    assert len(forked) == 2
    _assert_gone(forked)


def test_read_tasks_are_dealt_biggest_first(tmp_path):
    """The local runner deals a JSONL file's tasks by their bytes, the last (shorter, open-ended) one last, so the
    workers finish close together; a task whose size is unknown (rows of a table) goes first. The order is the
    pack plan's source's (pipeline._job._plan.PACK.source.order)."""
    from tests._internals import PACK, task_weight

    assert PACK.source.order is task_weight

    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps({"instruction": "q" * (i % 50), "output": "a"}) + "\n" for i in range(3000)))
    f = _read.InputFile(str(path), "x.jsonl", "jsonl")
    tasks = _read.cut_tasks(f, 8000)
    weights = [task_weight(t) for t in tasks]
    assert sum(weights) == path.stat().st_size and len(tasks) > 5
    assert min(weights) == weights[-1] < max(weights)  # the open-ended last task is the shortest here
    rows = _read.ReadTask(_read.InputFile(str(tmp_path / "t.parquet"), "t.parquet", "parquet"), 0, 65536)
    assert task_weight(rows) == float("inf")


def test_a_worker_that_dies_on_its_own_fails_the_run_in_one_line(tmp_path):
    """A worker killed outright (the kernel's OOM killer sends SIGKILL) while the others run: the run stops with one
    error naming the worker, how it ended and what to try; the folder is a failed output; no worker is left."""
    src = _write_mix(tmp_path, seed=7)
    trace = tmp_path / "trace"
    trace.mkdir()
    script = textwrap.dedent(f"""
        import os, signal, sys
        from pipeline import PackOptions, _rows, launch

        def killed(*a, **kw):
            os.kill(os.getpid(), signal.SIGKILL)

        _rows.pack_group = killed  # the forked workers inherit it
        outcome = launch(PackOptions(inputs=({str(src)!r},), output={str(tmp_path / "out")!r}, max_tokens=512,
                                     workers=2, tokenizer_threads=1, group_size=100))
        print(type(outcome).__name__, outcome.exit_code)
        print(outcome.error)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, _trace.ENV: str(trace)})
    assert r.returncode == 0, r.stderr[-3000:]
    kind, message = r.stdout.strip().splitlines()
    assert kind == "Failed 2", r.stdout
    assert re.fullmatch(r"local worker [12] of 2 \(pid \d+\) killed by SIGKILL while running step 'pack'; the run "
                        r"stopped \(if it was out of memory, use fewer --workers or a smaller --max-tokens\)", message)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "killed by SIGKILL" in manifest["error"]
    _assert_gone({sp["pid"] for sp in _trace.read(str(trace)) if sp["span"] == "worker"})


@pytest.mark.slow
def test_workers_started_fresh_where_forking_is_unsafe_write_the_same_bytes(tmp_path):
    """A launcher with a thread already running (a notebook, a host program) cannot fork safely: its workers start
    fresh (spawn), load the tokenizer themselves, and write the same bytes as one process."""
    src = _write_mix(tmp_path, seed=11)
    opts = dict(max_tokens=512, group_size=40, num_shards=2, long="split", batch_size=32, tokenizer_threads=1)
    run(PackOptions(inputs=(str(src),), output=str(tmp_path / "one"), workers=1, **opts))
    script = textwrap.dedent(f"""
        import json, threading
        from pipeline import PackOptions, run
        from tests._internals import _local

        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()  # a thread of the host program
        assert not _local._fork_is_safe()
        run(PackOptions(inputs=({str(src)!r},), output={str(tmp_path / "two")!r}, workers=2, **{opts!r}))
        stop.set()
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = _files(str(tmp_path / "one")), _files(str(tmp_path / "two"))
    assert a.keys() == b.keys()
    for name in a:
        if name not in ("manifest.json", "README.md"):
            assert a[name] == b[name], f"{name} differs between one process and two spawned workers"


def test_a_local_run_imports_no_beam(tmp_path):
    """``packstream pack`` on local files runs on packstream's own runner: Beam (~0.85 CPU-seconds of imports) is
    never imported, with one worker or two."""
    src = _write_mix(tmp_path, seed=13)
    for workers in ("1", "2"):
        script = textwrap.dedent(f"""
            import sys
            from pipeline.cli import main
            try:
                main(["pack", {str(src)!r}, "-o", {str(tmp_path / ("out" + workers))!r}, "-q", "--workers", {workers!r},
                      "--max-tokens", "512"])
            except SystemExit as e:
                assert not e.code, e.code
            print(sorted(m for m in sys.modules if m == "apache_beam" or m.startswith("apache_beam.")))
        """)
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip() == "[]", f"--workers {workers}: {r.stdout[:500]}"


# ---------------------------------------------------------------------------------------
# Auto


MIB = 2**20


@pytest.mark.parametrize("cores,size,expected", [
    (1, 1000 * MIB, (1, 1)),
    (2, 1000 * MIB, (2, 1)),  # 2 cores: a worker per core, one tokenizer thread each
    (3, 1000 * MIB, (3, 1)),
    (16, 1 * MIB, (1, 16)),  # a small input: one process, every core for its tokenizer
    (16, 9 * MIB, (4, 4)),  # a worker per 2 MiB
    (16, 1000 * MIB, (16, 1)),  # a big one: a worker per core
    (64, 1000 * MIB, (64, 1)),
])
def test_auto_parallelism(cores, size, expected):
    p = parallel.choose(0, 0, size, n_cores=cores)
    assert (p.workers, p.threads) == expected, p.why
    assert p.workers * p.threads <= cores


def test_auto_says_why_and_starts_no_worker_without_a_read_task():
    """Issue 28: the run summary names workers x threads and why; auto starts at most one worker per read task."""
    p = parallel.choose(0, 0, 1000 * MIB, n_cores=16, read_tasks=lambda n: 3)  # e.g. three gzipped files
    assert (p.workers, p.threads) == (3, 5) and p.why == "--workers auto: 16 cores, 3 read tasks"
    assert parallel.choose(0, 0, 9 * MIB, n_cores=16).why == ("--workers auto: 16 cores, a small input (9 MiB: a "
                                                              "worker per 2 MiB)")
    assert parallel.choose(2, 0, 0, 2).describe() == "2 x 1 tokenizer thread (--workers 2: 2 cores shared by 2 workers)"
    assert parallel.choose(0, 0, 1000 * MIB, n_cores=2).to_dict() == {
        "workers": 2, "tokenizer_threads": 1, "why": "--workers auto: 2 cores, a worker per core"}


def test_given_workers_and_threads_are_kept():
    def pair(*args):
        p = parallel.choose(*args)
        return p.workers, p.threads

    assert pair(3, 0, 0, 16) == (3, 5)
    assert pair(0, 4, 10**12, 16) == (4, 4)
    assert pair(2, 8, 0, 2) == (2, 8)
    assert parallel.tokenizer_env(1) == {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
