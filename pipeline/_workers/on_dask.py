"""The job on Dask: packstream's DaskRunner (Beam's, with a GroupByKey for few, small values) and the read
tasks spread over every Dask worker.

Beam's DaskRunner turns each step into a ``dask.bag`` operation. Its ``GroupByKey`` is ``Bag.groupby``,
which keeps its input's number of partitions and shuffles through ``n x n`` small tasks (``n`` over 32:
two stages of them). The job's few inputs (often one file) arrive as one partition, so every read task cut
from them would be read by one worker, one after the other; spreading them with more partitions made the
graph of a 35 MiB run about 5,900 tasks, most of them the shuffles' splits, whose scheduling cost more than
the job's own work on a small cluster. And a shuffle's output partitions go to the worker that holds their
pieces, not to the worker that is free, so the read tasks were dealt out unevenly.

What this job shuffles is small (read tasks, the names of spill files, counts): the bytes go through the
spill folder. So :class:`DaskRunner` groups by key in three steps: each input partition groups its own
elements, one task merges those groups, and ``lanes`` tasks take the keys dealt round-robin, in the order
they came (one key each when there are no more keys than lanes)::

    n partitions --group--> n --merge--> 1 --deal--> lanes partitions (queued, each to the next free worker)

The dealt partitions are marked as data producers, so the scheduler queues them and hands each to the
next worker with a free thread (a read task at a time): the workers finish together. A graph is a few
tasks per lane. ``lanes`` is ``--dask_npartitions``, which :func:`layout` sets to the read tasks (at
least two per worker thread and one more); the tasks are cut for the cluster's worker threads (:func:`pipeline._read.task_bytes`),
asked of the scheduler at launch. Which worker reads which task never changes the output.
"""

from __future__ import annotations

import math
import operator
from typing import Optional, Sequence

from pipeline import _read
from pipeline._workers import parallel

MAX_LANES = 1024
TASKS_PER_THREAD = 16
"""Read tasks wanted per Dask worker thread (within :func:`pipeline._read.task_bytes`' sizes): each goes to
the next free worker (holding one more queued), so the workers finish within about two tasks (1/8 of a
worker's share) of each other."""

RUNNER = f"{__name__}.DaskRunner"
"""The class path of packstream's DaskRunner (``--runner=DaskRunner``)."""


def cluster_threads(pipe_opts) -> Optional[int]:
    """The worker threads of the Dask cluster the job will run on; None when the scheduler cannot be asked.

    Without an address (or scheduler file) DaskRunner starts a local cluster whose workers share
    this machine's cores.
    """
    from apache_beam.runners.dask.dask_runner import DaskOptions

    opts = pipe_opts.view_as(DaskOptions).get_all_options(drop_default=True, current_only=True)
    opts.pop("npartitions", None)
    opts.pop("partition_size", None)
    if not opts.get("address") and not opts.get("scheduler_file"):
        return parallel.cores()
    try:
        import distributed

        with distributed.Client(**{"timeout": 10, **opts}) as client:
            threads = sum(client.nthreads().values()) or None
            try:
                client.run(warm)  # the workers import the job's code while this process builds the graph
            except Exception:  # noqa: BLE001 - only a head start (a worker without packstream fails its tasks)
                pass
            return threads
    except Exception:  # noqa: BLE001 - only sizes the tasks; the runner reports an unreachable cluster itself
        return None


WARM_MODULES = ("apache_beam.runners.common", "apache_beam.runners.dask.transform_evaluator", "pipeline._job._steps",
                "pipeline._workers.on_dask")
"""What a Dask worker imports to run the job's tasks (Beam, the steps, the tokenizer's library): about a
second of a fresh worker's CPU."""


def warm() -> None:
    """Import :data:`WARM_MODULES` in a thread of this (Dask worker) process, and return at once.

    Run on every worker at launch (``Client.run``), so that the imports overlap the launcher's own work
    (the run context, the graph) instead of delaying each worker's first task; a task that needs a module
    meanwhile waits on Python's import lock for the thread to finish it.
    """
    import importlib
    import threading

    def imports() -> None:
        for name in WARM_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - only a head start: the task's own import reports a problem
                return

    threading.Thread(target=imports, name="packstream-warm", daemon=True).start()


def task_count(files: Sequence[_read.InputFile], sizes: Sequence[int], task_bytes: int) -> int:
    """The read tasks the inputs are cut into (about: a JSONL file is cut at line ends)."""
    return sum(max(1, math.ceil(n / task_bytes)) if f.kind == "jsonl" else 1 for f, n in zip(files, sizes))


def lanes(tasks: int, threads: Optional[int]) -> int:
    """The partitions a shuffle deals its keys into: one per read task, and more than two per worker thread
    (so that the scheduler queues them and hands them to free workers), within [1, MAX_LANES]."""
    return max(1, min(MAX_LANES, max(tasks, 2 * (threads or 1) + 1)))


def layout(pipe_opts, files: Sequence[_read.InputFile], sizes: Sequence[int]) -> int:
    """The read tasks' size (bytes) of a Dask run; sets ``--dask_npartitions`` to the lanes of :class:`DaskRunner`'s
    shuffles unless the user set it (or ``--dask_partition_size``): its GroupByKey spreads the keys."""
    from apache_beam.runners.dask.dask_runner import DaskOptions

    threads = cluster_threads(pipe_opts)
    # The tasks go to free workers one at a time, so more, smaller ones than a local run's even the workers out.
    per = threads * TASKS_PER_THREAD // _read.TASKS_PER_WORKER if threads and threads > 1 else threads
    task_bytes = _read.task_bytes(sum(sizes), per)
    view = pipe_opts.view_as(DaskOptions)
    if view.npartitions is None and view.partition_size is None:
        view.npartitions = lanes(task_count(files, sizes, task_bytes), threads)
    return task_bytes


# ---------------------------------------------------------------------------------------------------------
# The runner: Beam's DaskRunner with a GroupByKey for small values. Built on first use (``DaskRunner``, as
# Beam's runner lookup asks this module for it), so that importing this module imports no Dask.

def _group_partition(items):
    """One input partition's elements grouped by key, keys in the order they came."""
    from apache_beam.runners.dask.transform_evaluator import defenestrate

    groups: dict = {}
    for k, v in items:
        groups.setdefault(k, []).append(defenestrate(v))
    return list(groups.items())


def _merge(lanes: int, *partials) -> list[list]:
    """The partitions' groups merged (values in partition order), the keys dealt round-robin over ``lanes``."""
    groups: dict = {}
    for part in partials:
        for k, vs in part:
            groups.setdefault(k, []).extend(vs)
    out: list[list] = [[] for _ in range(lanes)]
    for i, kv in enumerate(groups.items()):
        out[i % lanes].append(kv)
    return out


def group_by_key(bag, lanes: int):
    """``bag`` of (key, value) -> a bag of (key, [values]) in ``lanes`` partitions (see the module docstring)."""
    from dask.bag import Bag
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph

    partial = bag.map_partitions(_group_partition)
    token = tokenize(partial, lanes)
    merge, name = f"packstream-merge-{token}", f"packstream-deal-{token}"
    try:
        from dask._task_spec import Task, TaskRef
    except ImportError:  # an older dask: tuples (the scheduler still queues a big group with one dependency)
        dsk = {(merge, 0): (_merge, lanes, *[(partial.name, i) for i in range(partial.npartitions)])}
        dsk.update({(name, i): (operator.getitem, (merge, 0), i) for i in range(lanes)})
    else:
        dsk = {(merge, 0): Task((merge, 0), _merge, lanes, *[TaskRef((partial.name, i))
                                                            for i in range(partial.npartitions)])}
        dsk.update({(name, i): Task((name, i), operator.getitem, TaskRef((merge, 0)), i, _data_producer=True)
                    for i in range(lanes)})
    return Bag(HighLevelGraph.from_collections(name, dsk, dependencies=[partial]), name, lanes)


def _runner_class():
    from apache_beam.runners.dask import dask_runner
    from apache_beam.runners.dask.overrides import _GroupByKeyOnly

    class DaskRunner(dask_runner.DaskRunner):
        """Beam's DaskRunner whose GroupByKey is :func:`group_by_key` over ``--dask_npartitions`` lanes (by
        default more than two per worker thread of the cluster)."""

        def run_pipeline(self, pipeline, options):
            """Beam's, with :mod:`pipeline._workers.quiet` preloaded into the workers of a local cluster it starts
            (Beam's import-time warnings would print once per worker)."""
            import dask

            preload = [*dask.config.get("distributed.worker.preload", []), "pipeline._workers.quiet"]
            with dask.config.set({"distributed.worker.preload": preload}):
                return super().run_pipeline(pipeline, options)

        @staticmethod
        def to_dask_bag_visitor(bag_kwargs=None):
            bag_kwargs = dict(bag_kwargs or {})
            stock = dask_runner.DaskRunner.to_dask_bag_visitor(bag_kwargs)
            n = bag_kwargs.get("npartitions") or lanes(0, parallel.cores())

            class Visitor(type(stock)):
                def visit_transform(self, node) -> None:
                    if isinstance(node.transform, _GroupByKeyOnly):
                        (pcoll,) = node.inputs
                        self.bags[node] = group_by_key(self.bags[pcoll.producer], n)
                    else:
                        super().visit_transform(node)

            return Visitor()

    DaskRunner.__module__ = __name__
    DaskRunner.__qualname__ = "DaskRunner"
    return DaskRunner


def __getattr__(name: str):
    if name == "DaskRunner":
        cls = globals()["DaskRunner"] = _runner_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
