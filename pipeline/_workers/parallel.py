"""How many local worker processes, and how many tokenizer threads in each: ``--workers`` and
``--tokenizer-threads``, ``auto`` by default.

The work is the tokenizer's (Rust, ~90% of a record's CPU time on the shared mix) plus this
job's Python per record (reading, rendering, masks: ~10%, one thread per worker, overlapped with
the tokenizer). A run on ``C`` cores can spend them two ways::

    1 worker  x C tokenizer threads   no second process; but the tokenizer's threads wait at the
                                      end of every batch, and the worker's one Python thread
                                      bounds it once C is large (Python ~10% -> ~10 cores at most)
    N workers x C/N threads           each worker is one more process (forked warm from the
                                      launcher: ~0.02 CPU-s); they share the read tasks and the
                                      packing groups, and nothing waits at a batch's end

Measured with ``bench/bench_scale.py`` (README, Performance) on 2 cores, with packstream's own
local runner (no Beam): 2 workers of 1 thread beat one worker of 2 threads (19.19 s against
19.96 s for the 6x mix, the same CPU time), so ``auto`` gives each worker
:data:`THREADS_PER_WORKER` thread and one worker per core. (With Beam's runner a worker cost
~0.3 CPU-s and its share of gRPC, and one worker of 2 threads won.) A small input gets fewer
workers (one per :data:`BYTES_PER_WORKER`), so that no worker's start-up outweighs its
work. Only local runs (pipeline._job._local) start workers; on a cluster the runner owns the processes and
``--tokenizer-threads`` (if given) sets each process's tokenizer threads.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional

THREADS_ENV = "RAYON_NUM_THREADS"
"""The tokenizers library's thread pool size (Rust rayon), read once when a process first tokenizes."""
PARALLELISM_ENV = "TOKENIZERS_PARALLELISM"
"""``false``: the tokenizer encodes a batch in the calling thread (read at every call)."""


THREADS_PER_WORKER = 1
"""``auto``: tokenizer threads per worker (a worker per core)."""
BYTES_PER_WORKER = 2 * 2**20
"""``auto``: at most one worker per this much input. A worker pays for itself once it has about a CPU-second of
work: ~0.55 CPU-seconds per MiB of JSONL on the shared mix (bench_scale --cores), against ~0.02 s for a
forked worker."""


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
    """What was given, or what ``auto`` went by: the cores, and what kept it to fewer workers (a small input,
    few read tasks)."""

    def env(self) -> dict[str, str]:
        """The environment that gives a worker process ``threads`` tokenizer threads."""
        return tokenizer_env(self.threads)

    def describe(self) -> str:
        """One line for pack's summary and estimate's report.

        >>> choose(0, 0, 2**30, n_cores=2).describe()
        '2 x 1 tokenizer thread (--workers auto: 2 cores, a worker per core)'
        >>> choose(2, 0, 2**30, n_cores=2).describe()
        '2 x 1 tokenizer thread (--workers 2: 2 cores shared by 2 workers)'
        """
        return f"{self.workers} x {self.threads} tokenizer thread{'s' if self.threads != 1 else ''} ({self.why})"

    def to_dict(self) -> dict[str, Any]:
        """The manifest's ``run``: ``workers``, ``tokenizer_threads``, ``why``."""
        return {"workers": self.workers, "tokenizer_threads": self.threads, "why": self.why}


def tokenizer_env(threads: int) -> dict[str, str]:
    """Environment variables for ``threads`` tokenizer threads (1: encode in the calling thread)."""
    return {THREADS_ENV: str(threads), PARALLELISM_ENV: "false" if threads == 1 else "true"}


def choose(workers: int, threads: int, input_bytes: float, n_cores: Optional[int] = None,
           read_tasks: Optional[Callable[[int], int]] = None, size_note: Optional[str] = None) -> Parallelism:
    """Resolve ``--workers`` and ``--tokenizer-threads`` (0: auto) for a local run over ``input_bytes``.

    ``read_tasks(n)``: about how many read tasks the inputs give ``n`` workers (:func:`pipeline._read.read_tasks`);
    ``auto`` starts no more workers than that (a worker without a task costs a process and does nothing).
    ``size_note``: what ``input_bytes`` stands for when it is not the input's size (a ``--processor`` run's
    work, its images counted: :meth:`pipeline._media.Work.describe`), said in ``why``.

    >>> choose(0, 0, 9 * 2**20, n_cores=16).why
    '--workers auto: 16 cores, a small input (9 MiB: a worker per 2 MiB)'
    >>> choose(0, 0, 2**30, n_cores=16, read_tasks=lambda n: 3).describe()
    '3 x 5 tokenizer threads (--workers auto: 16 cores, 3 read tasks)'
    """
    c = n_cores or cores()
    if workers and threads:
        return Parallelism(workers, threads, f"--workers {workers} --tokenizer-threads {threads}, as given; {c} cores")
    if workers:
        return Parallelism(workers, max(1, c // workers), f"--workers {workers}: {c} cores shared by {workers} workers")
    per = threads or THREADS_PER_WORKER
    by_cores = max(1, c // per)
    by_size = max(1, int(input_bytes // BYTES_PER_WORKER))
    n = min(by_size, by_cores)
    tasks = read_tasks(n) if read_tasks is not None and n > 1 else n
    why = [f"{c} core{'s' if c != 1 else ''}"]
    if tasks < n:
        n = max(1, tasks)
        why.append(f"{n} read task{'s' if n != 1 else ''}")
    elif by_size < by_cores:
        why.append(f"a small input ({input_bytes / 2**20:,.0f} MiB: a worker per {BYTES_PER_WORKER // 2**20} MiB)")
    elif c >= per:
        why.append("a worker per core" if per == 1 else f"a worker per {per} cores")
    if size_note:
        why.append(size_note)
    head = "--workers auto" + (f" --tokenizer-threads {threads}" if threads else "")
    return Parallelism(n, threads or max(1, c // n), f"{head}: " + ", ".join(why))


def for_run(options: Any, files: list, sizes: list[int]) -> tuple[Parallelism, float, float]:
    """:func:`choose` for a run over ``files`` (``sizes``: their bytes), as ``pack`` and ``estimate`` both resolve it:
    a ``--processor`` run counts its images' measured work (:func:`pipeline._media.image_work`), not only the
    records' bytes. Returns the parallelism, the work in bytes of text and the work per input byte, which the read
    tasks are cut by (:func:`pipeline._read.task_bytes`)."""
    from pipeline import _media, _read

    work = _media.image_work(options, files, sizes)
    size, scale = (float(sum(sizes)), 1.0) if work is None else (work.bytes, work.scale)
    par = choose(options.workers, options.tokenizer_threads, size,
                 read_tasks=lambda n: _read.read_tasks(files, size, n, scale),
                 size_note=None if work is None else work.describe())
    return par, size, scale
