"""The job's shape, declared once as data: a :class:`Plan` is a source, its stages in order, and a finish.

Both runners walk a plan and know nothing else about the job: the local runner
(:mod:`pipeline._job._local`) deals each stage's elements to its workers, the Beam graph
(:mod:`pipeline._job._graph`) makes each stage one ParDo behind a GroupByKey. Neither names a step::

    source    the run's inputs (ctx -> inputs), each cut into elements (input, ctx -> elements); on Beam the
              elements are keyed and spread over the workers, locally they are dealt biggest first (order)
    stage     a step class of pipeline._job._steps, built from the RunContext; its input is the source's
              elements (the first stage) or the last stage's carried values grouped by key: (key, [part, ...]),
              every key of the last stage's ``every`` present, with an empty list where nothing carried it
              (Beam's GroupByKey and the local runner's dict give the step the same parts, None-free, in no
              promised order: a step sorts them)
    carries   the type of the values a stage hands to the next (its ``key`` makes each one a (key, part));
              every other value the stage emits is a report (:func:`pipeline._job._outputs.reports`)
    finish    finish(ctx, reports): every stage's reports, in one place (pack: the commit, finalize())

:data:`PACK` is ``packstream pack``: the inputs cut into read tasks; encode (read, render, tokenize, spill:
:class:`Spilled` per packing group); pack (a group's slices -> :class:`Packed` per shard, every shard present);
write (a shard's pieces -> the shard file); then :func:`~pipeline._job._commit.finalize`.

A second command declares its own plan from the same steps, and both runners run it unchanged: :data:`REPACK`
(``packstream repack``, :mod:`pipeline._job._repack`) puts one step first in place of encode, one that spills a
packed folder's examples per packing group as encode spills a read task's (and encodes a raw input beside them
with encode itself), then keeps pack, write and the commit as they are.

Everything in a plan is a module-level function or class, never a lambda, so a stage pickles by reference
(the local runner's workers may be started with ``spawn``, Beam ships the steps to its workers).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Iterable, Optional, Sequence

from pipeline._job._commit import finalize
from pipeline._job._context import RunContext
from pipeline._job._outputs import Packed, Spilled
from pipeline._job._repack import SpillExamples, element_key, element_weight, repack_cut, repack_inputs
from pipeline._job._steps import EncodeTasks, PackGroups, WriteShards, cut_tasks, task_weight  # noqa: F401


@dataclasses.dataclass(frozen=True)
class SourceLabels:
    """The Beam transforms' labels of a source (the local runner has none)."""

    inputs: str = "Inputs"
    cut: str = "CutTasks"
    key: str = "KeyTasks"
    spread: str = "Spread"
    elements: str = "Tasks"


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a plan's first stage gets its elements: ``inputs(ctx)``, each cut into ``cut(input, ctx)``.

    ``key(element)`` spreads the elements over Beam's workers (a GroupByKey, so one big input's elements do not
    all run where it was cut); ``order(element)``, a weight, deals them biggest first on the local runner (so
    the last ones dealt are short); None keeps the inputs' order.
    """

    inputs: Callable[[Any], Sequence]
    cut: Callable[[Any, Any], Iterable]
    key: Callable[[Any], Hashable]
    order: Optional[Callable[[Any], float]] = None
    labels: SourceLabels = SourceLabels()


@dataclasses.dataclass(frozen=True)
class StageLabels:
    """The Beam transforms' labels of a stage: its ParDo, and where it carries values on (see :class:`Stage`)."""

    step: str
    carried: Optional[str] = None  # the (key, part) of every carried value
    grouped: Optional[str] = None  # the GroupByKey into the next stage
    reports: Optional[str] = None  # the values that are not carried, for the finish
    every: Optional[str] = None  # the (key, None) of every key in ``every``
    merged: Optional[str] = None  # the carried values and the every keys, flattened


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of a plan: ``step(ctx)`` (setup, process, teardown) over each of its elements.

    ``carries``: the type of the values that go on to the next stage as ``key(value)`` -> (key, part), grouped
    by key; None for the last stage (all it emits is a report). ``every(ctx)``: keys the next stage gets even
    when no value carried one (an empty shard is still written). Keys are sorted for the next stage locally,
    so they must compare (tuples of str and int do).
    """

    name: str
    step: type
    labels: StageLabels
    carries: Optional[type] = None
    key: Callable[[Any], tuple[Hashable, Any]] = None  # type: ignore[assignment]
    every: Optional[Callable[[Any], Iterable[Hashable]]] = None

    def __post_init__(self):
        if self.carries is not None and self.key is None:
            object.__setattr__(self, "key", keyed)


@dataclasses.dataclass(frozen=True)
class FinishLabels:
    """The Beam transforms' labels of the finish: every stage's reports flattened, under one key, collected."""

    flatten: str = "Everything"
    key: str = "OneKey"
    collect: str = "Collect"
    finish: str = "Finalize"


@dataclasses.dataclass(frozen=True)
class Plan:
    """A job: its source, its stages in order, and ``finish(ctx, reports)`` (its return is the run's result)."""

    source: Source
    stages: tuple[Stage, ...]
    finish: Callable[[Any, list], Any]
    labels: FinishLabels = FinishLabels()

    def __post_init__(self):
        if not self.stages:
            raise ValueError("a Plan needs at least one stage: Plan(source, stages=(Stage(...),), finish)")
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"a Plan's stage names must differ, got {names}; name each Stage once")
        for stage in self.stages[:-1]:
            if stage.carries is None:
                raise ValueError(f"stage {stage.name!r} carries nothing on, but stage(s) follow it; give it "
                                 f"carries=TYPE or make it the last stage")
        last = self.stages[-1]
        if last.carries is not None:
            raise ValueError(f"the last stage {last.name!r} carries {last.carries.__name__} on to no stage; "
                             f"drop carries= (all it emits goes to the finish) or add the stage that takes it")


def keyed(value: Any) -> tuple[Hashable, Any]:
    """A carried value's ``(key, part)``: its own ``keyed()`` (:class:`Spilled`, :class:`Packed`)."""
    return value.keyed()


def job_inputs(ctx: RunContext) -> Sequence:
    """The run's input files."""
    return ctx.files


def read_tasks(f: Any, ctx: RunContext) -> list:
    """One input's read tasks, cut to the run's task size."""
    return cut_tasks(f, ctx.task_bytes)


def task_name(task: Any) -> str:
    """A read task's spread key: its name."""
    return task.name


def every_shard(ctx: RunContext) -> Iterable[tuple[str, int]]:
    """Every shard's ``(split, shard)``: each one is written, empty or not."""
    return ctx.every_shard()


PACK = Plan(
    source=Source(inputs=job_inputs, cut=read_tasks, key=task_name, order=task_weight),
    stages=(
        Stage("encode", EncodeTasks, carries=Spilled,
              labels=StageLabels("EncodeTasks", carried="Slices", grouped="ByGroup", reports="Reports")),
        Stage("pack", PackGroups, carries=Packed, every=every_shard,
              labels=StageLabels("PackGroups", carried="Pieces", grouped="ByShard", reports="PackReports",
                                 every="EveryShard", merged="AllPieces")),
        Stage("write", WriteShards, labels=StageLabels("WriteShards")),
    ),
    finish=finalize,
)
"""``packstream pack``: read tasks -> encode -> pack -> write -> the commit."""


REPACK = Plan(
    source=Source(inputs=repack_inputs, cut=repack_cut, key=element_key, order=element_weight),
    stages=(
        Stage("spill", SpillExamples, carries=Spilled,
              labels=StageLabels("SpillExamples", carried="Slices", grouped="ByGroup", reports="Reports")),
        *PACK.stages[1:],
    ),
    finish=finalize,
)
"""``packstream repack``: packed shards (and any raw inputs' read tasks) -> spill -> pack -> write -> the commit."""
