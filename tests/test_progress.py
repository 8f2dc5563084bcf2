"""Progress of local runs: the worker-side counters, the reporter, and the CLI's three modes."""

from __future__ import annotations

import glob
import io
import json
import os
import tempfile

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests._internals import LogFormat, Progress, _progress

PROGRESS_KEYS = {"event", "stage", "elapsed_s", "records_read", "records_encoded", "records_total",
                 "examples_tokenized", "tokens", "rows", "percent", "rate_per_s", "rate_unit", "eta_s"}


@pytest.fixture
def progress_dir(tmp_path, monkeypatch):
    folder = tmp_path / "progress"
    folder.mkdir()
    monkeypatch.setattr(_progress, "FLUSH_S", 0.0)  # write on every increment
    return folder


def test_record_writes_one_file_per_process_and_read_counts_sums_them(progress_dir):
    _progress.record(str(progress_dir), "records_read", 5)
    _progress.record(str(progress_dir), "records_read", 2)
    _progress.record(str(progress_dir), "tokens", 100)
    # Another worker process's file, as a subprocess worker would write it.
    (progress_dir / "99999999.json").write_text(json.dumps({"records_read": 10, "rows": 1}))
    (progress_dir / "99999999.json.tmp").write_text("{half a write")  # ignored: not renamed yet
    counts = _progress.read_counts(str(progress_dir))
    assert counts == {"records_read": 17, "records_encoded": 0, "examples_tokenized": 0, "tokens": 100, "rows": 1}
    assert sorted(os.listdir(progress_dir)) == sorted([f"{os.getpid()}.json", "99999999.json", "99999999.json.tmp"])


def test_record_is_a_no_op_without_a_watching_launcher(tmp_path, monkeypatch):
    monkeypatch.setattr(_progress, "FLUSH_S", 0.0)
    monkeypatch.chdir(tmp_path)
    _progress.record(None, "records_read", 3)
    _progress.flush(None)
    _progress.Counter("packstream", "rows", None).inc(2)
    assert os.listdir(tmp_path) == []  # no file anywhere: a remote worker's steps get no folder
    assert _progress.read_counts(str(tmp_path / "nowhere")) == {k: 0 for k in _progress.COUNTERS}


def test_a_new_folder_starts_new_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(_progress, "FLUSH_S", 0.0)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        _progress.record(str(tmp_path / name), "rows", 4)
        assert _progress.read_counts(str(tmp_path / name))["rows"] == 4


def test_counter_feeds_beam_and_progress(progress_dir):
    c = _progress.Counter("packstream", "rows", str(progress_dir))
    c.inc(3)
    assert _progress.read_counts(str(progress_dir))["rows"] == 3


def test_the_percentage_and_eta_follow_the_limiting_stage(monkeypatch):
    """Reading runs ahead; tokenizing drives the ETA, then rows written against the rows needed."""
    clock = [100.0]
    monkeypatch.setattr(_progress.time, "monotonic", lambda: clock[0])
    p = Progress(LogFormat.JSON, io.StringIO(), interval=1.0, budget=1000)
    p.total = 1000
    p.started = 90.0  # ten seconds in
    first = p.snapshot({"records_read": 1000, "records_encoded": 200, "tokens": 9000, "rows": 0})
    assert set(first) == PROGRESS_KEYS and first["stage"] == "tokenizing"
    assert first["percent"] == 20.0  # all records read, 20% tokenized: the percentage is the tokenizer's
    clock[0] = 110.0
    e = p.snapshot({"records_read": 1000, "records_encoded": 400, "tokens": 18000, "rows": 0})
    assert e["rate_per_s"] == pytest.approx(20.0) and e["rate_unit"] == "records"  # (400 - 200) / 10 s, moving
    assert e["eta_s"] == pytest.approx(30.0)  # 600 records left at 20/s
    assert "tokenizing 40%" in p.line(e) and "tokenized 400/1,000 (read 1,000)" in p.line(e)
    clock[0] = 115.0
    pack = p.snapshot({"records_read": 1000, "records_encoded": 1000, "tokens": 50_000, "rows": 10})
    assert pack["stage"] == "packing and writing" and pack["percent"] == 20.0  # 10 of the 50 rows 50k tokens need
    assert pack["rate_unit"] == "rows" and "rows/s" in p.line(pack)
    clock[0] = 200.0  # a long pause: the moving window forgets the old rate instead of averaging it in
    stalled = p.snapshot({"records_read": 1000, "records_encoded": 1000, "tokens": 50_000, "rows": 10})
    assert stalled["rate_per_s"] == 0.0 and stalled["eta_s"] is None
    done = p.snapshot({"records_read": 1000, "records_encoded": 1000, "tokens": 50_000, "rows": 51})
    assert done["stage"] == "finishing" and done["eta_s"] == 0.0


def test_text_mode_redraws_one_line_and_clears_it(tmp_path):
    out = io.StringIO()
    p = Progress(LogFormat.TEXT, out, interval=1.0)
    p.total = 10
    p.report({"records_read": 5, "records_encoded": 5, "examples_tokenized": 5, "tokens": 1234, "rows": 0})
    p.report({"records_read": 10, "records_encoded": 10, "examples_tokenized": 10, "tokens": 2500, "rows": 2})
    text = out.getvalue()
    assert text.startswith("\rtokenizing 50% | tokenized 5/10 (read 5) | 1.2k tokens | rows 0")
    assert "\rpacking and writing" in text and "\n" not in text
    p._clear()
    assert out.getvalue().endswith("\r")


def test_for_cli_modes(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())  # not a terminal
    assert _progress.for_cli(LogFormat.TEXT, quiet=False, progress=None, interval=None) is None
    forced = _progress.for_cli(LogFormat.TEXT, quiet=False, progress=True, interval=None)
    assert forced is not None and forced.interval == 0.5
    assert _progress.for_cli(LogFormat.TEXT, quiet=True, progress=True, interval=None) is None
    assert _progress.for_cli(LogFormat.JSON, quiet=True, progress=None, interval=None) is None
    j = _progress.for_cli(LogFormat.JSON, quiet=False, progress=False, interval=None)
    assert j is not None and j.interval == 10.0
    with pytest.raises(Exception, match="--log-interval"):
        _progress.for_cli(LogFormat.JSON, quiet=False, progress=None, interval=0)


def test_watching_a_remote_runner_does_nothing():
    p = Progress(LogFormat.JSON, io.StringIO(), interval=0.05)
    with _progress.watching(p, [], local=False) as folder:
        assert folder is None  # the steps get no folder: they record nothing
    with _progress.watching(None, [], local=True) as folder:
        assert folder is None
    assert p.events == []
    with _progress.watching(p, [], local=True) as folder:  # a local run: a fresh folder, gone afterwards
        assert os.path.isdir(folder) and os.listdir(folder) == []
    assert not os.path.exists(folder) and p.events[-1]["event"] == "progress"


def _shards_and_rejects(folder) -> dict[str, bytes]:
    names = sorted(glob.glob(os.path.join(folder, "train-*"))) + [os.path.join(folder, "rejected.jsonl")]
    return {os.path.basename(p): open(p, "rb").read() for p in names}


def test_json_log_of_a_real_run_and_output_unchanged(tmp_path, monkeypatch):
    """--log-format json: progress lines, then a done event with the manifest's counts; same bytes as --quiet."""
    temp = tmp_path / "temp"  # the run's own temporary folders (progress, outcome) go here, and must go away
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    runner = CliRunner()
    logged = runner.invoke(main, ["pack", "--output", str(tmp_path / "a"), "--max-tokens", "256",
                                  "--log-format", "json", "--log-interval", "0.1"])
    assert logged.exit_code == 0, logged.output
    events = [json.loads(line) for line in logged.stdout.splitlines()]  # stdout holds nothing but JSON lines
    progress, done = events[:-1], events[-1]
    assert progress and all(set(e) == PROGRESS_KEYS for e in progress)
    assert max(e["records_read"] for e in progress) > 0
    assert {e["stage"] for e in progress} <= {"tokenizing", "packing and writing", "finishing"}
    manifest = json.load(open(tmp_path / "a" / "manifest.json"))
    assert done["event"] == "done" and done["counts"] == manifest["counts"]
    # Issue 28: the workers x threads the run chose, and why, as data: the manifest's run, the done event's too.
    assert set(manifest["run"]) == {"workers", "tokenizer_threads", "why"} and done["run"] == manifest["run"]
    assert manifest["run"]["why"].startswith("--workers auto: ")
    assert done["output"] == str(tmp_path / "a") and done["shards"] == len(manifest["shards"])
    assert {e["records_total"] for e in progress} <= {None, manifest["counts"]["records_read"]}
    # The progress folder (and the outcome file) are gone: nothing leaks into the next run.
    assert os.listdir(temp) == []
    assert not [n for n in os.listdir(tmp_path / "a") if n.startswith(".tmp")]

    quiet = runner.invoke(main, ["pack", "--output", str(tmp_path / "b"), "--max-tokens", "256", "--quiet"])
    assert quiet.exit_code == 0 and quiet.stdout == ""
    assert _shards_and_rejects(tmp_path / "a") == _shards_and_rejects(tmp_path / "b")
    assert sorted(os.listdir(tmp_path / "a")) == sorted(os.listdir(tmp_path / "b"))


def test_json_log_ends_with_an_error_event(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("not empty")
    r = CliRunner().invoke(main, ["pack", "--output", str(tmp_path / "out"), "--log-format", "json"])
    assert r.exit_code == 2
    last = json.loads(r.stdout.splitlines()[-1])
    assert last["event"] == "error" and last["exit_code"] == 2 and "packstream did not write" in last["message"]
