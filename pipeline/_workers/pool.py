"""Warm local workers: forked from the launcher once it has imported Beam and loaded the tokenizer.

``packstream pack --workers N`` runs Beam's FnApiRunner in multi-process mode, which starts each
worker as a shell command. A cold worker (:mod:`pipeline._workers.worker`) then imports Beam and
loads the tokenizer itself: ~3 CPU-seconds before it reads a record, on every run
(``bench/bench_scale.py --cores``, "start-up / worker"). The launcher has done both already, so
it forks its N workers instead, before it starts any thread or server, and they wait::

    launcher  imports, loads the tokenizer, decides the run, claims the folder
              --fork--> N children, each listening on <pool>/w<i>.sock
              runs the job; FnApiRunner: "python -I -S .../handoff.py <pool> <pid>"  (x N, milliseconds each)
                 handoff --connect--> an idle child: it takes the handoff's environment (the
                                      runner's addresses), runs the SDK worker, replies its exit code
              the job ends: close() reaps every child (idle ones are told to stop)

The children share the launcher's memory (the tokenizer, copy-on-write) until they write to it.
A child never outlives the run: it stops when its handoff goes (the runner killed it), when its
SDK worker ends, when the launcher closes the pool, or when the launcher is gone. Where the pool
cannot help (not Linux, threads already running in the launcher, more workers asked than
forked) a handoff falls back to a cold worker, so the job runs the same either way.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Optional

from pipeline._workers import signals

HANDOFF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "handoff.py")


def supported() -> bool:
    """Forking is safe here: Linux, and no other Python thread running (a fork copies only this one)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and threading.active_count() == 1


class WorkerPool:
    """``n`` forked workers, waiting for FnApiRunner's worker commands (:attr:`command`)."""

    def __init__(self, n: int):
        self.folder = tempfile.mkdtemp(prefix="packstream-pool-")
        self.pids: list[int] = []
        self.launcher = parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            for i in range(n):
                path = os.path.join(self.folder, f"w{i}.sock")
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                listener.bind(path)
                listener.listen(1)
                pid = os.fork()
                if pid == 0:  # the child: never returns into the launcher's code
                    code = 1
                    try:
                        code = _serve(listener, path, parent)
                    finally:
                        os._exit(code)
                listener.close()
                self.pids.append(pid)
                signals.register_workers([pid])  # a signal to the launcher stops them too
        except BaseException:
            self.close()
            raise

    @property
    def command(self) -> str:
        """The worker command line for ``SubprocessSDKEnvironment``."""
        # SIGINT and SIGHUP ignored from exec on (as for cold workers: signals.worker_command), so a terminal's
        # signal to the whole group never kills a handoff before it starts, nor prints its traceback. The
        # launcher's pid goes to a cold worker the handoff may become.
        return (f"trap '' INT HUP; exec {shlex.quote(sys.executable)} -I -S {shlex.quote(HANDOFF)} "
                f"{shlex.quote(self.folder)} {self.launcher}")

    def close(self, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop idle children, wait for the others (their workers end with the job), then reap every one.
        ``kill``: the job did not end (an error, Ctrl-C): stop them all now."""
        idle = {int(n[1:-5]) for n in (os.listdir(self.folder) if os.path.isdir(self.folder) else ())
                if n.startswith("w") and n.endswith(".sock") and n[1:-5].isdigit()}  # never handed a worker
        for i, pid in enumerate(self.pids):
            if kill or i in idle:
                try:
                    os.kill(pid, signal.SIGKILL if kill else signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for pid in self.pids:
            while True:
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if done:
                    break
                if time.monotonic() > deadline:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    deadline = float("inf")
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.02)
        signals.register_workers(self.pids, add=False)
        self.pids = []
        shutil.rmtree(self.folder, ignore_errors=True)


def _serve(listener: socket.socket, path: str, parent: int) -> int:
    """A child: wait for a handoff, become the SDK worker it asks for, reply its exit code."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's handler is not ours: close() stops us with it
    signals.worker_setup(parent)  # Ctrl-C and hang-up are the launcher's to handle; die with the launcher
    listener.settimeout(0.5)
    while True:
        try:
            conn, _ = listener.accept()
            break
        except socket.timeout:
            if os.getppid() != parent:  # the launcher is gone
                return 0
    os.unlink(path)  # taken: the next handoff looks for another worker
    listener.close()
    conn.settimeout(None)
    conn.sendall(b"ok\n")
    env = json.loads(conn.makefile("rb").readline() or b"{}")
    if not env:
        return 1
    os.environ.clear()
    os.environ.update(env)
    from pipeline import _trace

    _trace.mark("pool_worker", process_cpu=time.process_time())
    threading.Thread(target=_exit_when_closed, args=(conn,), daemon=True).start()
    code = _run_worker()
    try:
        conn.sendall(f"{code}\n".encode())
    except OSError:
        pass
    return code


def _exit_when_closed(conn: socket.socket) -> None:
    """The handoff went away (the runner killed its worker): so does this worker."""
    try:
        while conn.recv(1024):
            pass
    except OSError:
        pass
    os._exit(1)


def _run_worker() -> int:
    from pipeline._workers import worker

    try:
        worker.main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the worker logged it to the runner; the exit code says it failed
        return 1
    return 0


def start(n: int) -> Optional[WorkerPool]:
    """A pool of ``n`` warm workers, or None where forking is not safe here."""
    if n < 2 or not supported():
        return None
    try:
        return WorkerPool(n)
    except OSError:
        return None
