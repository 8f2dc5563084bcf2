"""The local runner: a job's plan (:mod:`pipeline._job._plan`) on this machine's cores, with no Beam in the way.

::

    launcher (packstream pack)                            worker processes (--workers N, forked warm)
      the plan's source: the inputs cut into elements
      deal a stage's elements, one to each idle  ------>  the stage's step: setup once, process each
      worker, biggest first (the source's order)          element, teardown at the end
      keep the carried values, keyed and grouped <------  (an element's values, small: files and counts)
      and the reports
      the next stage: its (key, [part, ...]), in key order; ... until the last stage
      the plan's finish (a pack: pipeline._job._commit.finalize), here, over every stage's reports

The runner walks any :class:`~pipeline._job._plan.Plan` and names no step: a worker is handed the run's
context and plan once, then the index of a stage and an element. The steps are the same objects Beam's
runners run (:mod:`pipeline._job._graph` walks the same plan), so the output is byte-identical either way.
Only descriptions and counts cross between processes; tokens move through the spill files. Elements go to
whichever worker is idle, so a slow task never holds up the others; a stage starts once the last one's
values are all in (every packing group takes examples from every read task).

Why not Beam here: a local run spent ~0.85 CPU-seconds importing Beam before it read a record, and
its FnApiRunner moved every value through gRPC threads in every process; on 2 cores that was a third
of the run's serial time (``bench/bench_scale.py --cores``). With one worker the steps run in this
process: no second process, nothing pickled.

The workers are forked from the launcher once it has loaded the tokenizer (they share it, copy on
write), before any thread starts here; where forking is not safe (threads already running, not
Linux) they start fresh (``spawn``) and load it themselves. A worker ignores the terminal's
SIGINT and SIGHUP, dies with the launcher, and is stopped by the launcher's signal handler
(:mod:`pipeline._workers.signals`); one that dies on its own (out of memory, killed) ends the run
with one line that names it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any, Iterable, Iterator, Optional

from packers import PackstreamError
from pipeline import _trace
from pipeline._job._plan import Plan
from pipeline._workers import signals

class _Steps:
    """One process's steps of the plan, each built and set up on its stage's first element, torn down at the end."""

    def __init__(self, ctx: Any = None, plan: Optional[Plan] = None):
        self.ctx, self.plan = ctx, plan
        self.steps: dict[int, Any] = {}

    def process(self, stage: int, element: Any) -> list:
        step = self.steps.get(stage)
        if step is None:
            step = self.steps[stage] = self.plan.stages[stage].step(self.ctx)
            if hasattr(step, "setup"):
                step.setup()
        return list(step.process(element))

    def close(self) -> None:
        for step in self.steps.values():
            if hasattr(step, "teardown"):
                step.teardown()
        self.steps = {}


class InProcess:
    """One worker: the steps run in the launcher itself."""

    workers = 1

    def start(self, ctx: Any, plan: Plan) -> None:
        self.steps = _Steps(ctx, plan)

    def map(self, stage: int, elements: Iterable) -> Iterator:
        for element in elements:
            yield from self.steps.process(stage, element)

    def close(self, kill: bool = False) -> None:
        steps = getattr(self, "steps", None)
        if steps is not None:
            steps.close()


class Workers:
    """``n`` worker processes, started now (forked when that is safe: call before any thread starts)."""

    def __init__(self, n: int):
        self.workers = n
        self.launcher = os.getpid()
        self.conns: list[Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        method = "fork" if _fork_is_safe() else "spawn"
        mp = multiprocessing.get_context(method)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            for _ in range(n):
                here, there = mp.Pipe(duplex=True)
                proc = mp.Process(target=_serve, args=(there, self.launcher), daemon=True,
                                  name="packstream-worker")
                proc.start()
                there.close()
                self.conns.append(here)
                self.procs.append(proc)
                signals.register_workers([proc.pid])  # a signal to the launcher stops them too
        except BaseException:
            self.close(kill=True)
            raise

    def start(self, ctx: Any, plan: Plan) -> None:
        """Hand every worker the run's context and plan (once: the steps are built from them)."""
        self.plan = plan
        for conn in self.conns:
            conn.send(("start", (ctx, plan)))

    def map(self, stage: int, elements: Iterable) -> Iterator:
        """Run the plan's ``stage`` (its index) over ``elements``, an element to each idle worker; the values, as
        each element finishes."""
        name = self.plan.stages[stage].name
        todo = deque(elements)
        busy: dict[Connection, tuple[int, Any]] = {}
        idle = list(self.conns)
        while todo or busy:
            while todo and idle:
                conn = idle.pop()
                element = todo.popleft()
                conn.send(("step", (stage, element)))
                busy[conn] = (self.conns.index(conn), element)
            for conn in wait(list(busy)):
                i, element = busy.pop(conn)
                try:
                    what, value = conn.recv()
                except (EOFError, OSError):
                    raise self._lost(i, name) from None
                if what == "error":
                    raise RuntimeError(f"a local worker failed in step {name!r}:\n{value}")
                idle.append(conn)
                yield from value

    def _lost(self, i: int, name: str) -> BaseException:
        """A worker that ended on its own: the signal that is on its way if there is one (the whole group got it),
        else one line that names the worker and how it ended."""
        proc = self.procs[i]
        proc.join(timeout=2.0)
        deadline = time.monotonic() + signals.THREAD_GRACE_S
        while signals.received() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # a signal to the process group reaches this process's handler here
        code = proc.exitcode
        how = (f"killed by {signals.name(-code)}" if code is not None and code < 0
               else f"exited {code}" if code is not None else "stopped answering")
        return PackstreamError(
            f"local worker {i + 1} of {self.workers} (pid {proc.pid}) {how} while running step {name!r}; the run "
            f"stopped (if it was out of memory, use fewer --workers or a smaller --max-tokens)")

    def close(self, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop the workers and reap them; ``kill``: the run did not end (an error, a signal): at once."""
        for conn in self.conns:
            if not kill:
                try:
                    conn.send(("stop", None))
                except OSError:
                    pass
        deadline = time.monotonic() + (0 if kill else timeout)
        for proc in self.procs:
            if proc.pid is None:
                continue
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        signals.register_workers([p.pid for p in self.procs if p.pid is not None], add=False)
        self.conns, self.procs = [], []


def _fork_is_safe() -> bool:
    """Forking copies only the calling thread: safe on Linux while no other Python thread runs."""
    return sys.platform.startswith("linux") and threading.active_count() == 1


def _serve(conn: Connection, launcher: int) -> None:
    """A worker: run the steps the launcher deals, reply each element's values, until told to stop."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's handler is not ours: it stops us with SIGTERM
    try:
        signal.set_wakeup_fd(-1)  # the launcher's wake-up pipe (a fork copies it) is the launcher's
    except (ValueError, OSError):
        pass
    signals.worker_setup(launcher)  # Ctrl-C and hang-up are the launcher's to handle; die with the launcher
    _trace.mark("worker", process_cpu=time.process_time())
    steps = _Steps()
    try:
        while True:
            try:
                what, value = conn.recv()
            except (EOFError, OSError):  # the launcher is gone
                return
            if what == "stop":
                return
            if what == "start":
                steps.ctx, steps.plan = value
                continue
            try:
                out = ("done", steps.process(*value))
            except Exception:  # noqa: BLE001 - a bug in a step: the launcher fails the run with its traceback
                out = ("error", traceback.format_exc())
            conn.send(out)
    finally:
        steps.close()


def start(workers: int) -> "InProcess | Workers":
    """The run's workers: this process for one, else ``workers`` processes started now."""
    return InProcess() if workers <= 1 else Workers(workers)


def run(ctx: Any, workers: "InProcess | Workers", plan: Plan) -> Any:
    """``plan`` on ``workers`` (started with the run's context here), stage by stage; returns what its finish
    returns (a pack: the manifest it committed)."""
    workers.start(ctx, plan)
    source = plan.source
    elements: list = [e for each in source.inputs(ctx) for e in source.cut(each, ctx)]
    if source.order is not None:
        elements.sort(key=source.order, reverse=True)  # the biggest first, so the last ones dealt are short
    reports: list = []
    for i, stage in enumerate(plan.stages):
        carried: dict = {key: [] for key in stage.every(ctx)} if stage.every is not None else {}
        for item in workers.map(i, elements):
            if stage.carries is not None and isinstance(item, stage.carries):
                key, part = stage.key(item)
                carried.setdefault(key, []).append(part)
            else:
                reports.append(item)
        elements = sorted(carried.items(), key=_key)
    with _trace.span("finalize"):
        return plan.finish(ctx, reports)


def _key(kv: tuple) -> Any:
    return kv[0]
