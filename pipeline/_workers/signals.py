"""Interruption: SIGINT, SIGTERM and SIGHUP end a command with one ``error:`` line and exit 128 + the signal.

::

    Ctrl-C / kill / hang-up                  the launcher (the ``packstream`` process)
          |                                    handler: note the signal, mute every other output
          v                                    (logging, thread tracebacks, stderr), stop the local
    launcher ---- SIGTERM ----> workers        workers, raise Stop in the main thread
    (handler)                  (ignore SIGINT  -> the job unwinds; the launcher (pipeline._job) makes
                                and SIGHUP;       the folder a failed output (or finishes a commit)
                                die with the   -> the CLI prints one line, exits 130 / 143 / 129
                                launcher)

* :class:`Stop` is a ``BaseException``, so no ``except Exception`` in Beam, a library or our own
  best-effort code swallows it. Beam may wrap it on the way up (``RuntimeError: ... [while running
  'EncodeTasks']``); what counts is :func:`received`, not the type that arrives.
* A signal that arrives inside :func:`deferred` (claiming the folder, writing the commit) is held
  and raised when the section ends, so those steps happen whole or not at all.
* A second signal while the first is being handled ends the process at once with the same line
  (the run's lock then stays, and ``--overwrite`` clears what the run left, by its journal).
* A signal the shell set to be ignored (``nohup``, ``cmd &`` in a script) stays ignored.
* Local worker processes (``--workers N``, :mod:`pipeline._job._local`) ignore SIGINT and SIGHUP
  (a terminal sends them to the whole process group) and die with their launcher: it stops them.

The test hook :func:`at` delivers a signal at a named point of a run (``PACKSTREAM_SIGNAL_AT``,
read once at import); unset, it is one comparison. The hook stays an environment variable: a test
sets it from outside the process tree, and every process of the run (launcher, workers) reads it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Iterator, Optional

from packers import PackstreamError

SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
"""The signals that end a command cleanly (SIGKILL cannot be caught: tests/test_crash.py covers it)."""


def exit_code(signum: int) -> int:
    """The shell's convention: 128 + the signal number (SIGINT 130, SIGTERM 143, SIGHUP 129)."""
    return 128 + signum


def name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Stop(BaseException):
    """Raised in the main thread by the handler (never caught by ``except Exception``)."""


class Interrupted(PackstreamError):
    """A command stopped by a signal; the CLI prints the message and exits with :attr:`exit_code`."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum
        self.exit_code = exit_code(signum)


class _State:
    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.raised = False
        self.deferring = 0
        self.last_words = ""
        self.saved_stderr: Optional[int] = None
        self.saved_hook = None
        self.outer_hook = None
        self.installed: dict[int, object] = {}
        self.wakeup: Optional[tuple[int, int, int]] = None
        """(read end, write end, the wakeup fd before ours) of the pipe Python's C-level handler writes to."""
        self.arrived = False


_state = _State()


def received() -> Optional[int]:
    """The signal this command received (None: none)."""
    return _state.signum


def set_last_words(text: str) -> None:
    """What the one line says if a second signal ends the process during clean-up."""
    _state.last_words = text


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Handle :data:`SIGNALS` for the duration of a command (main thread only; restores the old handlers)."""
    global _state
    if threading.current_thread() is not threading.main_thread() or _state.installed:
        yield
        return
    _state = _State()
    _state.outer_hook = threading.excepthook
    threading.excepthook = _thread_exception
    graced = [*logging.getLogger().handlers, logging.lastResort]
    for h in graced:
        if h is not None:
            h.addFilter(_GRACE)
    for s in SIGNALS:
        old = signal.getsignal(s)
        if old is signal.SIG_IGN:  # nohup, or a background job of a script: the user chose to ignore it
            continue
        _state.installed[s] = old
        signal.signal(s, _handler)
    _wake_on_signals()
    try:
        yield
    finally:
        for s, old in _state.installed.items():
            signal.signal(s, old)
        _state.installed = {}
        _unwake()
        for h in graced:
            if h is not None:
                h.removeFilter(_GRACE)
        if _state.signum is None and threading.excepthook is _thread_exception:
            threading.excepthook = _state.outer_hook
        unmute_stderr()  # logging and thread tracebacks stay off after a signal: the process is about to exit,
        # and Beam's threads may still be winding down


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold a signal that arrives inside the block; raise :class:`Stop` when the block ends."""
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1
    if not _state.deferring and _state.signum is not None and not _state.raised:
        _state.raised = True
        raise Stop(_state.signum)


THREAD_GRACE_S = 2.0
"""How long a thread's exception waits for a signal that may be on its way to the main thread."""


def _wake_on_signals() -> None:
    """Have Python's C-level handler write each signal's number to a pipe the moment it arrives (in whatever
    thread the kernel picks), long before the main thread runs the Python handler: a thread that finds its
    worker gone can then tell at once that a signal is ending the command, however loaded the machine."""
    try:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
    except OSError:
        return
    try:
        before = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):  # not the main thread, or no such support
        os.close(r)
        os.close(w)
        return
    _state.wakeup = (r, w, before)


def _unwake() -> None:
    if _state.wakeup is None:
        return
    r, w, before = _state.wakeup
    _state.wakeup = None
    try:
        signal.set_wakeup_fd(before)
    except (ValueError, OSError):
        pass
    os.close(r)
    os.close(w)


def _arrived() -> bool:
    """Has one of :data:`SIGNALS` reached this process (noted by the main thread, or only by the C handler)?"""
    if _state.signum is not None or _state.arrived:
        return True
    wakeup = _state.wakeup
    if wakeup is not None:
        try:
            data = os.read(wakeup[0], 512)
        except OSError:  # nothing there (BlockingIOError), or closed meanwhile
            data = b""
        if any(b in {int(s) for s in _state.installed} for b in data):
            _state.arrived = True
    return _state.arrived


def _signal_on_its_way() -> bool:
    """In a thread other than the main one: wait up to :data:`THREAD_GRACE_S` for a signal to arrive (the C-level
    handler's pipe tells at once; the main thread's handler may run much later on a loaded machine)."""
    deadline = time.monotonic() + THREAD_GRACE_S
    while not _arrived() and time.monotonic() < deadline and threading.main_thread().is_alive():
        time.sleep(0.01)
    return _arrived()


class _Grace(logging.Filter):
    """The same wait for an error a thread logs (Beam's data plane logs a lost worker's stream)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or threading.current_thread() is threading.main_thread():
            return _state.signum is None
        return not _signal_on_its_way()


_GRACE = _Grace()


def _thread_exception(args) -> None:
    """A thread's uncaught exception while a command runs: silent when a signal stops the command.

    A signal to the process group kills the local workers at the same moment it reaches the launcher,
    and a Beam thread watching a worker (``run_worker``) may raise before the main thread has run the
    Python-level handler (handlers run only there, between bytecodes). So the exception waits a moment
    for the handler: a signal noted by then means the command is ending, and the traceback is noise."""
    if not _signal_on_its_way():
        (_state.outer_hook or threading.__excepthook__)(args)


def _handler(signum: int, frame) -> None:
    if _state.signum is not None:  # again, while the first one is handled: leave now, say why
        words = _state.last_words or f"interrupted by {name(_state.signum)}"
        unmute_stderr()
        os.write(2, f"error: {words}\n".encode("utf-8", "replace"))
        os._exit(exit_code(_state.signum))
    _state.signum = signum
    mute()
    stop_workers()
    if not _state.deferring:
        _state.raised = True
        raise Stop(signum)


def mute() -> None:
    """From here on nothing but the command's last line is printed: Beam's teardown logs, the tracebacks of
    its threads that lose their worker, gRPC's own stderr lines."""
    logging.disable(logging.CRITICAL)
    if _state.saved_hook is None:
        _state.saved_hook = threading.excepthook
        threading.excepthook = lambda args: None
    if _state.saved_stderr is None:
        try:
            sys.stderr.flush()
            _state.saved_stderr = os.dup(2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
        except (OSError, ValueError):  # no fd 2 (an embedded interpreter): logging is off already
            _state.saved_stderr = None


def unmute_stderr() -> None:
    """Give stderr back, for the command's last line (logging and thread tracebacks stay off)."""
    if _state.saved_stderr is not None:
        try:
            os.dup2(_state.saved_stderr, 2)
            os.close(_state.saved_stderr)
        except OSError:
            pass
        _state.saved_stderr = None


_REGISTERED: set[int] = set()
"""This launcher's local worker processes (:mod:`pipeline._job._local`), for :func:`stop_workers`."""


def register_workers(pids, add: bool = True) -> None:
    """Count ``pids`` among this launcher's workers (``add=False``: no longer), for :func:`stop_workers`."""
    (_REGISTERED.update if add else _REGISTERED.difference_update)(pids)


def stop_workers() -> None:
    """SIGTERM the local workers (they die at once, silently)."""
    for pid in sorted(_REGISTERED):
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass


_launcher: Optional[int] = None
"""In a worker process: its launcher's pid (:func:`worker_setup`), where the test hook sends a signal."""


def worker_setup(launcher: Optional[int]) -> None:
    """In a local worker process of launcher ``launcher`` (a pid): ignore the terminal's SIGINT and SIGHUP, and
    die with the launcher."""
    global _launcher
    _launcher = launcher
    for s in ("SIGINT", "SIGHUP"):
        if hasattr(signal, s):
            signal.signal(getattr(signal, s), signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:  # PR_SET_PDEATHSIG: a launcher killed outright (SIGKILL) takes its workers with it
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if launcher is not None and os.getppid() != launcher:
        # The launcher died before PR_SET_PDEATHSIG was set (so no signal will come): this process was handed to
        # init already. Its pid alone cannot tell (a dead launcher its own parent has not reaped yet is a zombie that
        # os.kill(pid, 0) still finds), and a fork keeps a copy of the launcher's end of the pipe, so no EOF would
        # come either: the worker would wait for work forever, holding the launcher's stdout open.
        os._exit(0)  # nothing of this run may be written any more


# ---------------------------------------------------------------------------------------------------
# The test hook: a signal at the N-th pass through a named point (tests/test_interrupt.py).

HOOK_ENV = "PACKSTREAM_SIGNAL_AT"
"""``PHASE:N:SIGNAL:TARGET:MARKER``: at the N-th pass through point PHASE (counted per process), send
SIGNAL (``INT``, ``TERM``, ``HUP``) to TARGET (``group``: the launcher's process group, as a terminal
does; ``launcher``: the launcher alone, as ``kill PID`` does), once per run (MARKER: a file created
exclusively by the first process that fires), then wait to be stopped."""

PHASES = ("launch", "read", "encode", "spill", "pack", "shard_write", "commit")
"""The named points, in the order a run passes them."""

_HOOK = os.environ.get(HOOK_ENV) or None
_passes: dict[str, int] = {}


def at(phase: str) -> None:
    """A named point of a run (see :data:`HOOK_ENV`); costs one comparison when the hook is unset."""
    if _HOOK is None:
        return
    _fire(phase)


def _fire(phase: str) -> None:
    want, n, sig, target, marker = _HOOK.split(":", 4)
    if phase != want:
        return
    _passes[phase] = _passes.get(phase, 0) + 1
    if _passes[phase] != int(n):
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # another worker fired first
    launcher = _launcher or os.getpid()  # a worker's launcher, or this process: the launcher itself
    signum = getattr(signal, f"SIG{sig}")
    if target == "group":
        os.killpg(os.getpgid(launcher), signum)
    else:
        os.kill(launcher, signum)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the signal takes effect here: the handler raises, or the launcher stops us
        time.sleep(0.05)
