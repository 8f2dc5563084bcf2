"""The job's shape is declared once (pipeline._job._plan) and both runners walk it.

Worked examples: the pack plan's stages in order; a toy plan of two tiny steps over plain Python values, run
by the local runner (in this process and on forked or spawned workers) and by Beam's DirectRunner, reaching
its finish with the same reports; the real pack on the bundled sample, byte-identical on both runners.
Guards: the runners' source names no step class and no stage name, so the shape cannot be written twice again.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

import pipeline
from pipeline.cli import bundled_sample
from tests._internals import PACK, Plan, Source, Stage, StageLabels, _local

ROOT = Path(__file__).resolve().parents[1]
RUNNERS = ("pipeline/_job/_local.py", "pipeline/_job/_graph.py")


# --- the pack plan --------------------------------------------------------------------------------------------------

def test_the_pack_plan_is_encode_pack_write_then_the_commit():
    from tests._internals import EncodeTasks, Packed, PackGroups, Spilled, WriteShards, _job, finalize

    assert [s.name for s in PACK.stages] == ["encode", "pack", "write"]
    assert [s.step for s in PACK.stages] == [EncodeTasks, PackGroups, WriteShards]
    assert [s.carries for s in PACK.stages] == [Spilled, Packed, None]
    assert [s.every is not None for s in PACK.stages] == [False, True, False]  # every shard is written, empty or not
    assert PACK.finish is finalize and _job.run  # the launcher runs PACK (pipeline._job._launch)


def test_the_pack_plan_keeps_the_graphs_labels():
    """Beam's transform labels, declared in the plan, are the graph's labels of before the plan (a Dataflow job
    updated in place matches its steps by label)."""
    src = PACK.source.labels
    assert (src.inputs, src.cut, src.key, src.spread, src.elements) == ("Inputs", "CutTasks", "KeyTasks", "Spread",
                                                                         "Tasks")
    assert [dataclasses.astuple(s.labels) for s in PACK.stages] == [
        ("EncodeTasks", "Slices", "ByGroup", "Reports", None, None),
        ("PackGroups", "Pieces", "ByShard", "PackReports", "EveryShard", "AllPieces"),
        ("WriteShards", None, None, None, None, None),
    ]
    assert dataclasses.astuple(PACK.labels) == ("Everything", "OneKey", "Collect", "Finalize")


def test_the_pack_graph_has_exactly_the_plans_labels(tmp_path):
    """The graph built from PACK, without running it: every label the plan declares, and no other stage label."""
    beam = pytest.importorskip("apache_beam")
    from tests._internals import Inputs, _graph, _read, decide

    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "a"}\n')
    options = pipeline.PackOptions(inputs=(str(src),), output=str(tmp_path / "out"))
    tokenizer = {"name": "tok", "vocab_sha256": "0" * 64, "pad_token_id": 0, "eos_token_id": 2, "eos_token": "</s>"}
    files = (_read.InputFile(str(src), "in.jsonl", "jsonl"),)
    ctx = decide(options, Inputs(files, (), tokenizer, src.stat().st_size), "0123456789ab")
    p = beam.Pipeline(runner="DirectRunner")
    _graph.build(p, ctx, PACK)
    labels = {t.full_label for t in p.transforms_stack[0].parts}
    assert labels == {"Inputs", "CutTasks", "KeyTasks", "Spread", "Tasks", "EncodeTasks", "Slices", "ByGroup",
                      "PackGroups", "Pieces", "EveryShard", "AllPieces", "ByShard", "WriteShards", "Reports",
                      "PackReports", "Everything", "OneKey", "Collect", "Finalize"}


def test_a_plan_is_checked_when_declared():
    source = Source(inputs=_lines, cut=_words, key=_itself)
    with pytest.raises(ValueError, match="at least one stage"):
        Plan(source, (), _finish)
    first = Stage("count", CountWords, StageLabels("CountWords"), carries=Letter)
    with pytest.raises(ValueError, match="the last stage 'count' carries Letter on to no stage"):
        Plan(source, (first,), _finish)
    last = Stage("join", JoinLetters, StageLabels("JoinLetters"))
    with pytest.raises(ValueError, match="stage 'join' carries nothing on, but stage"):
        Plan(source, (last, dataclasses.replace(last, name="again")), _finish)
    with pytest.raises(ValueError, match=r"must differ, got \['join', 'join'\]"):
        Plan(source, (dataclasses.replace(last, carries=Letter), last), _finish)


# --- the shape, written once ----------------------------------------------------------------------------------------

def _names_and_strings(source: str) -> tuple[set[str], set[str]]:
    """Every identifier (names, attributes, imported names) and every string constant but docstrings."""
    tree = ast.parse(source)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    names, strings = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.alias):
            names |= {node.name.rsplit(".", 1)[-1], node.asname or ""}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            strings.add(node.value)
    return names, strings


def _violations(source: str) -> list[str]:
    """What a runner's source names of the pack: its step classes, carried types, stage names and Beam labels."""
    names, strings = _names_and_strings(source)
    steps = {s.step.__name__ for s in PACK.stages} | {s.carries.__name__ for s in PACK.stages if s.carries}
    steps |= {"cut_tasks", "finalize", "every_shard", "task_weight", "PACK"}
    labels = {label for s in PACK.stages for label in dataclasses.astuple(s.labels) if label}
    labels |= set(dataclasses.astuple(PACK.source.labels)) | set(dataclasses.astuple(PACK.labels))
    spelled = {s.name for s in PACK.stages} | labels
    return [f"names {n}" for n in sorted(names & steps)] + [f"spells {s!r}" for s in sorted(strings & spelled)]


@pytest.mark.parametrize("path", RUNNERS)
def test_the_runners_name_no_step_and_no_stage(path):
    """The runners walk a Plan: no step class, carried type, stage name or Beam label of the pack in their code
    (a new stage goes in pipeline/_job/_plan.py alone)."""
    assert _violations((ROOT / path).read_text()) == [], f"{path}: declare these in pipeline/_job/_plan.py"


def test_the_guard_catches_a_runner_that_names_a_step():
    """A worked example: the old local runner's string table and the old graph's labels are caught; a docstring
    that names a step is not."""
    planted = ('"""Doc naming EncodeTasks is fine."""\nfrom pipeline._job._steps import EncodeTasks, cut_tasks\n'
               'STEPS = {"encode": EncodeTasks}\nx = "Spread" >> cut_tasks\n')
    assert _violations(planted) == ["names EncodeTasks", "names cut_tasks", "spells 'Spread'", "spells 'encode'"]


# --- a toy plan: two tiny steps over plain Python values -----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ToyContext:
    lines: tuple[str, ...]
    letters: tuple[str, ...]  # the join stage's every keys: each is joined, with words or none
    out: str = ""  # where the finish writes what it got (Beam's finish runs where the runner puts it)


@dataclasses.dataclass(frozen=True)
class Letter:
    """Carried: a word, keyed by its first letter."""

    letter: str
    word: str

    def keyed(self):
        return self.letter, self.word


@dataclasses.dataclass(frozen=True)
class Seen:
    word: str
    set_up: bool


@dataclasses.dataclass(frozen=True)
class Joined:
    letter: str
    words: tuple[str, ...]


class CountWords:
    def __init__(self, ctx: ToyContext):
        self.ctx, self.set_up = ctx, False

    def setup(self):
        self.set_up = True

    def process(self, word: str):
        yield Letter(word[0], word)
        yield Seen(word, self.set_up)


class JoinLetters:
    def __init__(self, ctx: ToyContext):
        self.ctx = ctx

    def process(self, keyed):
        letter, words = keyed
        yield Joined(letter, tuple(sorted(words)))


def _lines(ctx):
    return ctx.lines


def _words(line, ctx):
    return line.split()


def _itself(x):
    return x


def _letters(ctx):
    return ctx.letters


def _finish(ctx, reports):
    got = sorted(json.dumps([type(r).__name__, dataclasses.asdict(r)], sort_keys=True) for r in reports)
    if ctx.out:
        Path(ctx.out).write_text(json.dumps(got))
    return {"status": "complete", "reports": got}


TOY = Plan(
    source=Source(inputs=_lines, cut=_words, key=_itself, order=len),
    stages=(
        Stage("count", CountWords, StageLabels("CountWords", carried="Letters", grouped="ByLetter",
                                                reports="Seen", every="EveryLetter", merged="AllLetters"),
              carries=Letter, every=_letters),
        Stage("join", JoinLetters, StageLabels("JoinLetters")),
    ),
    finish=_finish,
)
CTX = ToyContext(lines=("apple avocado banana", "cherry apricot", "blueberry"), letters=("a", "b", "c", "d"))
EXPECTED = sorted(
    [json.dumps(["Seen", {"word": w, "set_up": True}], sort_keys=True)
     for w in ("apple", "avocado", "banana", "cherry", "apricot", "blueberry")]
    + [json.dumps(["Joined", {"letter": k, "words": list(v)}], sort_keys=True) for k, v in
       {"a": ("apple", "apricot", "avocado"), "b": ("banana", "blueberry"), "c": ("cherry",), "d": ()}.items()])


def test_a_toy_plan_runs_on_the_local_runner_in_process():
    workers = _local.InProcess()
    try:
        got = _local.run(CTX, workers, TOY)
    finally:
        workers.close()
    assert got == {"status": "complete", "reports": EXPECTED}  # "d": named by every, joined with no words


def test_a_toy_plan_runs_on_local_workers():
    """Worker processes get the context and the plan once, then a stage's index and an element."""
    workers = _local.Workers(2)
    try:
        got = _local.run(CTX, workers, TOY)
    finally:
        workers.close()
    assert got["reports"] == EXPECTED


def test_a_toy_plan_gives_its_finish_the_same_reports_on_beam(tmp_path):
    beam = pytest.importorskip("apache_beam")
    from tests._internals import _graph

    out = tmp_path / "finish.json"
    with beam.Pipeline(runner="DirectRunner") as p:
        _graph.build(p, dataclasses.replace(CTX, out=str(out)), TOY)
    assert json.loads(out.read_text()) == EXPECTED


# --- the real pack, on both runners ---------------------------------------------------------------------------------

def test_the_pack_plan_gives_byte_identical_shards_on_both_runners(tmp_path):
    """The bundled sample (copied to one place, so both runs read the same paths) packed on the local runner and
    on Beam's DirectRunner: every file the same bytes; the manifests differ only in the local run's ``run``."""
    src = tmp_path / "sample"
    shutil.copytree(bundled_sample(), src)
    out = tmp_path / "out"
    files = {}
    for name, beam_args in (("local", ()), ("direct", ("--runner=DirectRunner",))):
        manifest = pipeline.run(pipeline.PackOptions(inputs=(str(src),), output=str(out), num_shards=2), beam_args)
        assert manifest["status"] == "complete"
        files[name] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
        shutil.rmtree(out)
    local, direct = files["local"], files["direct"]
    assert sorted(local) == sorted(direct) and any(n.startswith("train-") for n in local)
    for name in local:
        if name == "manifest.json":
            a, b = json.loads(local[name]), json.loads(direct[name])
            assert "run" in a and "run" not in b
            a.pop("run")
            assert a == b
            continue
        assert local[name] == direct[name], f"{name} differs between the local runner and DirectRunner"
