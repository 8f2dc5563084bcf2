"""The job on Beam's DaskRunner: spread the read tasks over every Dask worker.

Beam's DaskRunner turns each step into a ``dask.bag`` operation. A ``Create`` makes bags of
about 128 elements per partition, and a ``GroupByKey`` (``Bag.groupby``) keeps its input's
number of partitions. So the job's few inputs (often one file) arrive as one partition, and
every read task cut from them would be read by one Dask worker, one after the other::

    Create(files)      1 partition     CutTasks -> 60 tasks, all in partition 0
    Spread (groupby)   1 partition     -> one worker encodes all 60

The job therefore shuffles its read tasks together with ``lanes`` empty keys that come in
``lanes`` partitions (``--dask_npartitions``, which Beam's Create obeys), and the shuffle hashes
the tasks over ``lanes + 1`` partitions, which Dask hands to its workers as they free up::

    Create(files) + Create(lanes: 2 x tasks)  ->  Spread: 2 x tasks + 1 partitions  ->  every worker

The tasks are cut for the cluster's worker threads (:func:`pipeline._read.task_bytes`), asked
of the scheduler at launch. Which worker reads which task never changes the output.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from pipeline import _read
from pipeline._workers import parallel

MAX_LANES = 1024


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
            return sum(client.nthreads().values()) or None
    except Exception:  # noqa: BLE001 - only sizes the tasks; the runner reports an unreachable cluster itself
        return None


def lanes(files: Sequence[_read.InputFile], sizes: Sequence[int], task_bytes: int) -> int:
    """Empty keys shuffled with the read tasks: about two per task, within [16, MAX_LANES]."""
    tasks = sum(max(1, math.ceil(n / task_bytes)) if f.kind == "jsonl" else 1 for f, n in zip(files, sizes))
    return max(16, min(MAX_LANES, 2 * tasks))


def layout(pipe_opts, files: Sequence[_read.InputFile], sizes: Sequence[int]) -> tuple[int, int]:
    """(task bytes, lanes) of a Dask run; sets ``--dask_npartitions`` to the lanes unless the user set it
    (or ``--dask_partition_size``)."""
    from apache_beam.runners.dask.dask_runner import DaskOptions

    task_bytes = _read.task_bytes(sum(sizes), cluster_threads(pipe_opts))
    n = lanes(files, sizes, task_bytes)
    view = pipe_opts.view_as(DaskOptions)
    if view.npartitions is None and view.partition_size is None:
        view.npartitions = n
    return task_bytes, n
