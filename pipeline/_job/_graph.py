"""A job's plan (:mod:`pipeline._job._plan`) as a Beam graph, for the runners that are Beam's (Dataflow, Dask,
Flink, Spark, and any ``--runner`` named): each stage's step in a DoFn, joined by shuffles, the transforms
labelled as the plan says. It walks any plan and names no step.

The local runner (:mod:`pipeline._job._local`) walks the same plan, running the same step objects without
Beam; the two give byte-identical outputs (tests/test_dask.py, tests/test_faults.py, tests/test_job_plan.py).
"""

from __future__ import annotations

from typing import Any

import apache_beam as beam

from pipeline import _trace
from pipeline._job._plan import Plan, Stage


class Step(beam.DoFn):
    """A step of a plan as a DoFn: Beam's setup, process and teardown, passed on. A ``grouped`` step (every
    stage after the first) gets its GroupByKey's ``(key, values)`` as the local runner gives it: a list, with
    the ``None`` of a key that only the plan's ``every`` named left out."""

    def __init__(self, step: Any, grouped: bool = False):
        self.step = step
        self.grouped = grouped

    def setup(self):
        if hasattr(self.step, "setup"):
            self.step.setup()

    def teardown(self):
        if hasattr(self.step, "teardown"):
            self.step.teardown()

    def process(self, element):
        if self.grouped:
            key, values = element
            element = (key, [v for v in values if v is not None])
        yield from self.step.process(element)


class Finalize(beam.DoFn):
    """Everything the stages reported -> the plan's finish (a pack: rejected.jsonl, README.md and, last,
    manifest.json: :func:`pipeline._job._commit.finalize`)."""

    def __init__(self, ctx: Any, finish):
        self.ctx = ctx
        self.finish = finish

    def process(self, keyed):
        _, items = keyed
        with _trace.span("finalize"):
            manifest = self.finish(self.ctx, list(items))
        yield manifest.get("status") if isinstance(manifest, dict) else None


def build(p, ctx: Any, plan: Plan) -> None:
    """``plan`` as a Beam graph (see :mod:`pipeline._job._plan`): the source's elements spread over the workers,
    one ParDo per stage, the carried values grouped by key into the next, every stage's reports to the finish."""
    source, labels = plan.source, plan.source.labels
    elements = (
        p
        | labels.inputs >> beam.Create(source.inputs(ctx))
        | labels.cut >> beam.FlatMap(source.cut, ctx)
        | labels.key >> beam.Map(_keyed_by, source.key)
        | labels.spread >> beam.GroupByKey()
        | labels.elements >> beam.FlatMap(_values)
    )
    found = []
    for i, stage in enumerate(plan.stages):
        out = elements | stage.labels.step >> beam.ParDo(Step(stage.step(ctx), grouped=i > 0))
        if stage.carries is None:  # the last stage: all it emits is a report
            found.append(out)
            continue
        found.append(out | stage.labels.reports >> beam.Filter(_not_carried, stage.carries))
        elements = _carried(p, out, stage, ctx) | stage.labels.grouped >> beam.GroupByKey()
    finish = plan.labels
    (
        tuple(found)
        | finish.flatten >> beam.Flatten()
        | finish.key >> beam.Map(_one_key)
        | finish.collect >> beam.GroupByKey()
        | finish.finish >> beam.ParDo(Finalize(ctx, plan.finish))
    )


def _carried(p, out, stage: Stage, ctx: Any):
    """A stage's carried values as ``(key, part)``, with ``(key, None)`` for every key of its ``every``."""
    carried = out | stage.labels.carried >> beam.FlatMap(_keyed_parts, stage.carries, stage.key)
    if stage.every is None:
        return carried
    every = [(key, None) for key in stage.every(ctx)]
    return (carried, p | stage.labels.every >> beam.Create(every)) | stage.labels.merged >> beam.Flatten()


def _keyed_by(element: Any, key) -> tuple:
    return key(element), element


def _values(kv: tuple) -> Any:
    return kv[1]


def _keyed_parts(item: Any, kind: type, key) -> list:
    return [key(item)] if isinstance(item, kind) else []


def _not_carried(item: Any, kind: type) -> bool:
    return not isinstance(item, kind)


def _one_key(item: Any) -> tuple:
    return None, item
