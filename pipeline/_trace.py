"""Where a run's time goes: opt-in spans, one JSON line each, for ``bench/bench_scale.py --cores``.

With ``PACKSTREAM_TRACE=<folder>`` in the environment (worker processes inherit it), every
process of a local run appends one line per span to ``<folder>/<pid>.jsonl``::

    {"pid": 4242, "span": "encode_task", "start": 1767.2, "wall": 3.91, "cpu": 3.88, "thread_cpu": 0.41,
     "info": {"records": 9731}}

``cpu`` is the whole process's CPU time over the span (the tokenizer's Rust threads included),
``thread_cpu`` the calling thread's alone; ``start`` is ``time.time()``, so spans of different
processes line up. Without the variable a span costs one environment lookup and writes nothing;
it never touches the output, so it cannot change the output's bytes. A file that cannot be
written is skipped, never an error.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Iterator

ENV = "PACKSTREAM_TRACE"


@contextlib.contextmanager
def span(name: str, **info: Any) -> Iterator[dict]:
    """Time the ``with`` body as span ``name``; the yielded dict takes more ``info`` on the way."""
    folder = os.environ.get(ENV)
    if not folder:
        yield info
        return
    start, wall, cpu, thread = time.time(), time.perf_counter(), time.process_time(), time.thread_time()
    try:
        yield info
    finally:
        line = {"pid": os.getpid(), "span": name, "start": round(start, 4),
                "wall": round(time.perf_counter() - wall, 4), "cpu": round(time.process_time() - cpu, 4),
                "thread_cpu": round(time.thread_time() - thread, 4), "info": info}
        try:
            with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:
            pass


def mark(name: str, **info: Any) -> None:
    """A span of no length: a moment (a process's start, say)."""
    with span(name, **info):
        pass


def read(folder: str) -> list[dict]:
    """Every span written under ``folder``, by start time."""
    out = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl"):
            with open(os.path.join(folder, name)) as f:
                out += [json.loads(line) for line in f if line.strip()]
    return sorted(out, key=lambda s: s["start"])
