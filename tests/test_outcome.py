"""How a run ends, as a type: the launcher's outcome decides the exit code, never the keys of a dict.

Worked examples of each outcome through the real CLI, with and without ``-q``: a committed run (0), a worker's
user error (2), a bad tokenizer (2), too many rejected (3), a signal (128 + N), a manifest that could not be written
(2), and a Flex Template launch (0, nothing run).
"""

from __future__ import annotations

import errno
import json
import os
import signal

import pytest
from click.testing import CliRunner

from packers import PackstreamError
from pipeline.cli import main
from tests._internals import _job, _read, _sink

pytestmark = pytest.mark.usefixtures("default_signals")  # signals ignored by nohup: tests/conftest.py

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}


def _data(tmp_path, records=(GOOD,), n=20):
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records) * n)
    return src


def _pack(*args):
    r = CliRunner().invoke(main, ["pack", *args, "--no-progress", "--workers", "1"])
    assert isinstance(r.exception, (SystemExit, type(None))), repr(r.exception)
    assert "Traceback" not in r.output, r.output
    return r


def _ends(r, code: int, *words: str) -> None:
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert r.exit_code == code and len(errors) == 1, (r.exit_code, r.output)
    assert all(w in errors[0] for w in words), errors[0]


def test_a_manifest_is_an_outcome_only_when_it_says_complete_with_counts():
    assert isinstance(_job._outcome.from_manifest({"status": "complete", "counts": {"rows": 1}}), _job.Committed)
    # What the full disk left: a recorded error without counts. Before, "no counts" read as a template launch.
    failed = _job._outcome.from_manifest({"status": "failed", "error": "cannot write to --output o (OSError: x)",
                                          "exit_code": 2})
    assert failed == _job.Failed("cannot write to --output o (OSError: x)", 2, None)
    assert isinstance(_job._outcome.from_manifest({}), _job.Failed)
    assert isinstance(_job._outcome.from_manifest({"status": "complete"}), _job.Failed)  # no counts: not a commit
    rejected = _job.Failed("no example was packed", 3, {"counts": {}})
    with pytest.raises(_job.TooManyRejected):
        rejected.result()
    with pytest.raises(PackstreamError, match="^x$"):
        _job.Failed("x").result()
    assert _job.TemplateLaunched("gs://b/t", {}).result() == {"config": {}, "template_location": "gs://b/t"}


@pytest.mark.parametrize("quiet", [[], ["-q"]], ids=["loud", "quiet"])
def test_each_outcome_ends_with_its_exit_code(quiet, tmp_path, monkeypatch):
    src = _data(tmp_path)
    ok = _pack(str(src), "-o", str(tmp_path / "ok"), *quiet)
    assert ok.exit_code == 0 and ("records read" in ok.stdout) == (not quiet), ok.output

    bad_tok = _pack(str(src), "-o", str(tmp_path / "tok"), "--tokenizer", str(tmp_path / "no-such-tokenizer"), *quiet)
    _ends(bad_tok, 2, "no-such-tokenizer")

    rejected = _pack(str(_data(tmp_path / "rej", [{"messages": [{"role": "user", "content": "x"}]}])),
                     "-o", str(tmp_path / "rej" / "out"), *quiet)
    _ends(rejected, 3, "no example was packed")

    def read_task(task, max_bytes):
        raise PackstreamError(f"input {task.file.source} changed while it was read; pack it again")

    with monkeypatch.context() as m:
        m.setattr(_read, "read_task", read_task)
        worker = _pack(str(src), "-o", str(tmp_path / "worker"), *quiet)
    _ends(worker, 2, "changed while it was read")
    assert json.loads((tmp_path / "worker" / "manifest.json").read_text())["status"] == "failed"

    real = _sink.create

    def full(path, site, **kw):
        if site in (_sink.Site.SHARD, _sink.Site.MANIFEST):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(path, site, **kw)

    with monkeypatch.context() as m:  # the manifest itself cannot be written: the outcome file says why
        m.setattr(_sink, "create", full)
        disk = _pack(str(src), "-o", str(tmp_path / "disk"), *quiet)
    _ends(disk, 2, f"cannot write to --output {tmp_path / 'disk'}", "No space left on device")
    assert not (tmp_path / "disk" / "manifest.json").exists()


@pytest.mark.parametrize("quiet", [[], ["-q"]], ids=["loud", "quiet"])
def test_a_signal_during_the_run_ends_as_interrupted(quiet, tmp_path, monkeypatch):
    """SIGTERM arrives while a shard is being written: the folder is made failed, exit 143, one line."""
    src = _data(tmp_path)
    real = _sink.create

    def signalled(path, site, **kw):
        if site is _sink.Site.SHARD:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(path, site, **kw)

    monkeypatch.setattr(_sink, "create", signalled)
    r = _pack(str(src), "-o", str(tmp_path / "out"), *quiet)
    _ends(r, 128 + signal.SIGTERM, "interrupted by SIGTERM", "--overwrite")
    manifest = tmp_path / "out" / "manifest.json"
    assert not manifest.exists() or json.loads(manifest.read_text())["status"] == "failed"
