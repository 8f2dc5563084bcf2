"""The job's parts without running a job: the run context, the typed step outputs and the commit's dispatch,
and Beam's options and runner checked through Beam's public API."""

from __future__ import annotations

import errno
import json
import pickle

import pytest

from packers import InternalError, PackstreamError
from pipeline import PackOptions
from tests._internals import (
    DASK_RUNNER, Failure, Flags, Inputs, Packed, Rejects, Reports, Spilled, Stats, Verdict, Written, _read, _spill,
    beam_flags, cannot_write, decide, runner_args, unknown_beam_args,
)

TOKENIZER = {"name": "tok", "vocab_sha256": "0" * 64, "pad_token_id": 0, "eos_token_id": 2, "eos_token": "</s>"}


@pytest.fixture
def ctx(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"text": "t{i}"}}\n' for i in range(128)))  # 64 a split: 2 shards of 32 each
    options = PackOptions(inputs=(str(src),), output=str(tmp_path / "out"), num_shards=2, validation_fraction=0.5,
                          group_size=1)
    files = (_read.InputFile(str(src), "in.jsonl", "jsonl"),)
    return decide(options, Inputs(files, (), TOKENIZER, src.stat().st_size), "0123456789ab")


def test_the_run_context_is_what_every_step_gets(ctx):
    """Frozen, picklable (Beam ships one copy with every step), and it names everything the run may write."""
    again = pickle.loads(pickle.dumps(ctx))
    assert again == ctx and hash(again.run_id) == hash(ctx.run_id)
    with pytest.raises(AttributeError):
        ctx.run_id = "x"  # frozen
    assert ctx.planned_files() == ["train-00000-of-00002.arrow", "train-00001-of-00002.arrow",
                                   "validation-00000-of-00002.arrow", "validation-00001-of-00002.arrow",
                                   "rejected.jsonl", "README.md"]
    assert ctx.spill.startswith(ctx.output) and ctx.run_id in ctx.spill
    assert ctx.progress is None and ctx.outcome is None  # set by the launcher for a local run only
    meta = {k.decode().rsplit(".", 1)[-1]: json.loads(v) for k, v in ctx.schema().metadata.items()}
    assert ctx.eos_id == meta["eos_token_id"] == 2 and meta["run_id"] == ctx.digest != ctx.run_id
    split, group, shard = ctx.layout.key("in.jsonl@1", 0.5)
    assert split in ("train", "validation") and shard == group % ctx.layout.shards[split]


def test_steps_emit_one_type_per_kind_and_the_graph_picks_them_by_type():
    sl = _spill.Slice(3, "spill.arrow", 0, 1)
    piece = _spill.Piece(3, "packed.arrow", 0, 1)
    mixed = [Spilled("train", 3, sl), Stats({"records_read": 1}), Packed("train", 1, piece), Rejects("r.jsonl"),
             Failure("x"), Flags(True, False), Written({"name": "s"})]
    from tests._internals import _graph, _plan

    carried = lambda kind: [kv for item in mixed for kv in _graph._keyed_parts(item, kind, _plan.keyed)]  # noqa: E731
    assert carried(Spilled) == [(("train", 3), sl)]
    assert carried(Packed) == [(("train", 1), piece)]
    assert [type(i).__name__ for i in mixed if _graph._not_carried(i, Spilled) and _graph._not_carried(i, Packed)] == [
        "Stats", "Rejects", "Failure", "Flags", "Written"]


def test_the_commit_sums_the_reports_by_type():
    r = Reports()
    for item in [Stats({"records_read": 2, "rows": 1}), Stats({"records_read": 3}), Written({"name": "b"}),
                 Written({"name": "a"}), Rejects("p1"), Failure("disk full"), Flags(True, False), Flags(True, True)]:
        r.add(item)
    assert r.stats == {"records_read": 5, "rows": 1}
    assert [s["name"] for s in r.shards] == ["b", "a"] and r.parts == ["p1"] and r.failures == ["disk full"]
    assert r.flags == {"eos_at_boundaries": True, "all_targets": False}
    with pytest.raises(InternalError, match="tuple"):
        r.add(("stats", {}))  # the string tags steps once sent are no report


def test_a_failure_is_the_one_message_for_a_write_or_the_user_error():
    e = OSError(errno.ENOSPC, "No space left on device")
    assert Failure.of(e, "out").message == cannot_write(e, "out") == \
        "cannot write to --output out (OSError: No space left on device)"
    assert Failure.of(PackstreamError("input x changed; pack again"), "out").message == "input x changed; pack again"
    failed = Verdict.failed("why")
    assert not failed.complete and failed.code == 2 and Verdict().complete


def test_beam_options_are_checked_with_one_error_line():
    assert unknown_beam_args(["in.jsonl", "--direct_num_workers=2", "--foo=1"]) == ["in.jsonl", "--foo=1"]
    with pytest.raises(PackstreamError, match=r"^Beam option --direct_num_workers: invalid int value: 'abc'; "):
        unknown_beam_args(["--direct_num_workers=abc"])
    with pytest.raises(PackstreamError, match="--runner needs a runner name: --runner=NAME"):
        unknown_beam_args(["--runner"])
    assert {"--runner", "--direct_num_workers", "--project"} <= set(beam_flags())


def test_runner_names_are_beams_own():
    assert runner_args(["--runner", "directrunner", "x"]) == ["--runner=directrunner", "x"]
    assert runner_args(["--runner=FnApi"]) == ["--runner=FnApi"]  # Beam's lookup: without "Runner", any case
    with pytest.raises(PackstreamError, match="'FooRunner' is not a Beam runner; use one of .*DataflowRunner"):
        runner_args(["--runner=FooRunner"])
    with pytest.raises(PackstreamError, match="is not a PipelineRunner subclass"):
        runner_args(["--runner=pipeline._job._runner.PackstreamError"])
    pytest.importorskip("dask.distributed")
    assert runner_args(["--runner", "dask"]) == [f"--runner={DASK_RUNNER}"]
