"""The job as a Beam graph, for the runners that are Beam's (Dataflow, Dask, Flink, Spark, and any
``--runner`` named): each step of :mod:`pipeline._job._steps` in a DoFn, joined by shuffles.

The local runner (:mod:`pipeline._job._local`) runs the same step objects without Beam; the two
give byte-identical outputs (tests/test_dask.py, tests/test_faults.py).
"""

from __future__ import annotations

from typing import Any

import apache_beam as beam

from pipeline._job._commit import finalize
from pipeline._job._context import RunContext
from pipeline._job._outputs import Packed, Spilled, only, reports
from pipeline._job._steps import EncodeTasks, PackGroups, WriteShards, cut_tasks
from pipeline import _trace


class Step(beam.DoFn):
    """A step of :mod:`pipeline._job._steps` as a DoFn: Beam's setup, process and teardown, passed on."""

    def __init__(self, step: Any):
        self.step = step

    def setup(self):
        if hasattr(self.step, "setup"):
            self.step.setup()

    def teardown(self):
        if hasattr(self.step, "teardown"):
            self.step.teardown()

    def process(self, element):
        yield from self.step.process(element)


class Finalize(beam.DoFn):
    """Everything the steps reported -> rejected.jsonl, README.md and, last, manifest.json (:func:`finalize`)."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx

    def process(self, keyed):
        _, items = keyed
        with _trace.span("finalize"):
            manifest = finalize(self.ctx, items)
        yield manifest.get("status")


def build(p, ctx: RunContext) -> None:
    """The job graph (see :mod:`pipeline._job`)."""
    tasks = (
        p
        | "Inputs" >> beam.Create(ctx.files)
        | "CutTasks" >> beam.FlatMap(cut_tasks, ctx.task_bytes)
        | "KeyTasks" >> beam.Map(lambda t: (t.name, t))
    )
    encoded = (
        tasks
        | "Spread" >> beam.GroupByKey()
        | "Tasks" >> beam.FlatMap(lambda kv: kv[1])
        | "EncodeTasks" >> beam.ParDo(Step(EncodeTasks(ctx)))
    )
    packed = (
        encoded
        | "Slices" >> beam.FlatMap(only(Spilled))
        | "ByGroup" >> beam.GroupByKey()
        | "PackGroups" >> beam.ParDo(Step(PackGroups(ctx)))
    )
    every = [(key, None) for key in ctx.every_shard()]
    written = (
        (packed | "Pieces" >> beam.FlatMap(only(Packed)), p | "EveryShard" >> beam.Create(every))
        | "AllPieces" >> beam.Flatten()
        | "ByShard" >> beam.GroupByKey()
        | "WriteShards" >> beam.ParDo(Step(WriteShards(ctx)))
    )
    (
        (encoded | "Reports" >> beam.Filter(reports), packed | "PackReports" >> beam.Filter(reports), written)
        | "Everything" >> beam.Flatten()
        | "OneKey" >> beam.Map(lambda item: (None, item))
        | "Collect" >> beam.GroupByKey()
        | "Finalize" >> beam.ParDo(Finalize(ctx))
    )
