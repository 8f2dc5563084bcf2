"""How many local worker processes, and how many tokenizer threads in each: ``--workers`` and
``--tokenizer-threads``, ``auto`` by default.

The work is the tokenizer's (Rust, ~90% of a record's CPU time on the shared mix) plus this
job's Python per record (reading, rendering, masks: ~10%, one thread per worker, overlapped with
the tokenizer). A run on ``C`` cores can spend them two ways::

    1 worker  x C tokenizer threads   no extra start-up; the tokenizer's threads wait at the end
                                      of every batch, and the worker's one Python thread bounds
                                      it once C is large (Python ~10% -> at most ~10 cores)
    N workers x C/N threads           each worker pays its own start-up (a Python process with
                                      Beam, its tokenizer: ~3 CPU-seconds), then they share the
                                      tasks and the groups; with 1 thread each nothing waits

``auto`` takes the second where the input holds enough work to pay for the workers' start-up,
and the first otherwise; the constants below come from ``bench/bench_scale.py --cores`` (README,
Performance), which measures both on the machine at hand. Only local runs (FnApiRunner) start
workers; on a cluster the runner owns the processes and ``--tokenizer-threads`` (if given) sets
each process's tokenizer threads.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

THREADS_ENV = "RAYON_NUM_THREADS"
"""The tokenizers library's thread pool size (Rust rayon), read once when a process first tokenizes."""
PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"
"""``false``: the tokenizer encodes a batch in the calling thread (read at every call)."""


def cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. under taskset or a container's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """Worker processes and tokenizer threads per worker for one run, and why."""

    workers: int
    threads: int
    why: str

    def env(self) -> dict[str, str]:
        """The environment that gives a worker process ``threads`` tokenizer threads."""
        return tokenizer_env(self.threads)


def tokenizer_env(threads: int) -> dict[str, str]:
    """Environment variables for ``threads`` tokenizer threads (1: encode in the calling thread)."""
    return {THREADS_ENV: str(threads), PARALLELISM_ENV: "false" if threads == 1 else "true"}


def choose(workers: int, threads: int, input_bytes: float, n_cores: Optional[int] = None) -> Parallelism:
    """Resolve ``--workers`` and ``--tokenizer-threads`` (0: auto) for a local run over ``input_bytes``."""
    c = n_cores or cores()
    if workers and threads:
        return Parallelism(workers, threads, "as given")
    if workers:
        return Parallelism(workers, max(1, c // workers), f"{c} cores shared by {workers} workers")
    if threads:
        n = max(1, c // threads)
        return Parallelism(n, threads, f"{c} cores / {threads} threads")
    return Parallelism(1, c, f"one worker with {c} tokenizer threads")
