"""The worker command of a local run with a warm pool (:mod:`pipeline._workers.pool`); the standard library only.

FnApiRunner starts every worker as a shell command with the runner's addresses in its
environment. This one runs as ``python -I -S .../handoff.py POOL LAUNCHER_PID`` (no site
packages: it starts in milliseconds), gives its environment to an idle forked worker of the pool,
and waits for that worker's exit code, which it exits with. Where no pool worker is free (or the
pool is gone) it becomes a cold worker instead: ``python -m pipeline._workers.worker LAUNCHER_PID``.
"""

import fcntl
import json
import os
import signal
import socket
import sys


def _claim(pool: str):
    """A connection to an idle pool worker, or None. One handoff at a time (a lock file), so no two
    connect to the same worker: a worker removes its socket before it acknowledges."""
    with open(os.path.join(pool, "lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in sorted(os.listdir(pool)):
            if not name.endswith(".sock"):
                continue
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)  # a worker acknowledges at once; one that does not is dead or stopping
            try:
                s.connect(os.path.join(pool, name))
                if s.recv(3) == b"ok\n":
                    s.settimeout(None)
                    return s
            except OSError:
                pass
            s.close()
    return None


def main() -> int:
    for s in (signal.SIGINT, signal.SIGHUP):  # the launcher handles Ctrl-C and hang-up; the worker ends with the runner
        signal.signal(s, signal.SIG_IGN)
    try:
        conn = _claim(sys.argv[1])
    except OSError:
        conn = None
    if conn is None:
        os.execv(sys.executable, [sys.executable, "-m", "pipeline._workers.worker", *sys.argv[2:3]])
    conn.sendall(json.dumps(dict(os.environ)).encode() + b"\n")
    reply = conn.makefile("rb").readline().strip()
    return int(reply) if reply.lstrip(b"-").isdigit() else 1


if __name__ == "__main__":
    sys.exit(main())
