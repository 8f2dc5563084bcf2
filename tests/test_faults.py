"""Faults: a retried bundle, a hard kill, and a rerun never duplicate, lose or half-write rows.

What matters on a real runner (Dataflow retries a failed bundle; so does Beam's own
``BundleBasedDirectRunner``, up to 4 attempts): the outputs of a failed attempt are discarded
by the runner, so only *side effects* can leak, and packstream's only side effects are file
writes. Every file is written under a temporary name and renamed to a name that depends only
on the data (``train-XXXXX-of-NNNNN``, ``rejected.jsonl``, ``manifest.json``), with bytes that
depend only on the data (rows sorted by a seeded key, dead letters sorted), so a retried write
puts the same bytes under the same name, and a failed one removes its temporary file.

The retry tests therefore run the job on ``BundleBasedDirectRunner``, which really retries a
failed bundle, and make the *first* attempt of one bundle fail at a chosen point: mid-file,
mid-chunk, mid-group, after a shard was written, before a rename, after the dead letters and
after the manifest were written. Each run must give shards, dead letters and manifest counts
byte-identical to a clean run on the default local runner (``pipeline._job._local``, no Beam). (The local
runner does not retry; a failure there fails the job, which the kill-and-rerun test covers.)

Hard kills (SIGKILL at seeded points of every phase, then a rerun) are tests/test_crash.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from pipeline import PackOptions, run
from pipeline.cli import bundled_sample
from tests._internals import Encoder, _read, _rows, _sink, _spill, _write, verify


def digest(folder) -> dict[str, str]:
    """sha256 of every shard and of rejected.jsonl, plus the manifest minus the output folder
    (the only option a rerun changes; --overwrite is not recorded) and minus ``run`` (a local run's workers and
    threads: the retrying runner is not local, so it has none)."""
    folder = Path(folder)
    out = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
           for p in sorted(folder.iterdir()) if p.name.startswith(("train-", "rejected"))}
    m = json.loads((folder / "manifest.json").read_text())
    m["config"].pop("output")
    m.pop("run", None)
    assert "overwrite" not in m["config"]
    out["manifest.json"] = json.dumps(m, sort_keys=True)
    return out


def leftovers(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(".tmp-"))


# ------------------------------------------------------------------------------------------------
# A bundle that fails on its first attempt, retried by the runner.


class InjectedFault(RuntimeError):
    """Raised once by a test hook; the runner must retry the bundle and discard its outputs."""


class FirstAttempt:
    """Fails the first time ``fire()`` is reached (a marker file remembers it, across threads)."""

    def __init__(self, marker: Path):
        self.marker, self.calls = marker, 0

    def fire(self, where: str) -> None:
        if not self.marker.exists():
            self.marker.write_text(where)
            raise InjectedFault(f"injected fault: {where}")

    @property
    def fired(self) -> bool:
        return self.marker.exists()


def _fail_mid_file(monkeypatch, fault: FirstAttempt) -> None:
    real = _read.read_task

    def read_task(task, max_bytes):
        for n, item in enumerate(real(task, max_bytes)):
            if n == 6:  # chunks of 4 records already went downstream
                fault.fire(f"reading {task.file.source} after 6 records")
            fault.calls += 1
            yield item

    monkeypatch.setattr(_read, "read_task", read_task)


def _fail_mid_chunk(monkeypatch, fault: FirstAttempt) -> None:
    real = Encoder.finish

    def finish(self, prepared, encodings):
        fault.calls += 1
        if fault.calls == 3:  # earlier chunks of the task are already encoded
            fault.fire("tokenizing the third chunk")
        return real(self, prepared, encodings)

    monkeypatch.setattr(Encoder, "finish", finish)


def _fail_after_spill(monkeypatch, fault: FirstAttempt) -> None:
    real = _spill.write_part

    def write_part(*args, **kwargs):
        fault.calls += 1
        slices = real(*args, **kwargs)  # a spill file is on disk; its slices were not emitted yet
        fault.fire("after writing a spill file")
        return slices

    monkeypatch.setattr(_spill, "write_part", write_part)


def _fail_mid_group(monkeypatch, fault: FirstAttempt) -> None:
    real = _rows.pack_group

    def pack_group(batch, options, eos_id):
        fault.calls += 1
        if fault.calls == 2:  # the first group's rows are already in the shard's temp file
            fault.fire("packing the second group")
        return real(batch, options, eos_id)

    monkeypatch.setattr(_rows, "pack_group", pack_group)


def _fail_after_shard_written(monkeypatch, fault: FirstAttempt) -> None:
    real = _write.ShardWriter.close

    def close(self, split):
        fault.calls += 1
        result = real(self, split)  # the shard is whole on disk (staged under its .tmp- name until the commit)
        fault.fire(f"after writing shard {result['name']}")
        return result

    monkeypatch.setattr(_write.ShardWriter, "close", close)


def _fail_before_rename(monkeypatch, fault: FirstAttempt) -> None:
    real = os.replace

    def replace(src, dst, *a, **kw):
        if os.path.basename(str(dst)).startswith("train-"):
            fault.calls += 1
            fault.fire(f"renaming {os.path.basename(str(src))}")  # the temp file is fully written
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)


def _fail_after_dead_letters(monkeypatch, fault: FirstAttempt) -> None:
    real = _write.merge_rejected

    def merge_rejected(folder, parts):
        fault.calls += 1
        counts = real(folder, parts)
        fault.fire("after writing rejected.jsonl")
        return counts

    monkeypatch.setattr(_write, "merge_rejected", merge_rejected)


def _fail_after_manifest(monkeypatch, fault: FirstAttempt) -> None:
    real = _write.write_atomic

    def write_atomic(path, data, site):
        real(path, data, site)
        if os.path.basename(path) == "manifest.json":  # committed, the spill not yet removed
            fault.calls += 1
            fault.fire("after writing manifest.json")

    monkeypatch.setattr(_write, "write_atomic", write_atomic)


FAULTS = {
    "mid_file": _fail_mid_file,
    "mid_chunk": _fail_mid_chunk,
    "after_spill": _fail_after_spill,
    "mid_group": _fail_mid_group,
    "after_shard_written": _fail_after_shard_written,
    "before_rename": _fail_before_rename,
    "after_dead_letters": _fail_after_dead_letters,
    "after_manifest": _fail_after_manifest,
}


@pytest.fixture(scope="module")
def small_inputs(tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("faults") / "in"
    data.mkdir()
    for p in Path(bundled_sample()).iterdir():
        (data / p.name).write_bytes(p.read_bytes())
    (data / "bad.jsonl").write_text('{"messages": []}\n{oops\n' + json.dumps({"text": "w " * 900}) + "\n")
    return data


def _options(data: Path, out: Path) -> PackOptions:
    # Small chunks and groups: many elements per bundle, so a failure lands mid-bundle.
    return PackOptions(inputs=(str(data),), output=str(out), max_tokens=512, num_shards=3, batch_size=4, group_size=8)


@pytest.fixture(scope="module")
def clean_run(small_inputs, tmp_path_factory) -> dict[str, str]:
    out = tmp_path_factory.mktemp("clean") / "out"
    run(_options(small_inputs, out))
    return digest(out)


@pytest.fixture
def retrying_runner():
    """``BundleBasedDirectRunner``: Beam's runner that really retries a failed bundle (up to 4 attempts)."""
    return ["--runner=BundleBasedDirectRunner"]


def test_retrying_runner_matches_the_default_runner(small_inputs, clean_run, retrying_runner, tmp_path):
    """The baseline for the fault tests: no fault, same bytes on both runners."""
    run(_options(small_inputs, tmp_path / "out"), retrying_runner)
    assert digest(tmp_path / "out") == clean_run


@pytest.mark.parametrize("where", sorted(FAULTS))
def test_bundle_retried_after_a_fault_gives_identical_output(
    small_inputs, clean_run, retrying_runner, monkeypatch, tmp_path, where
):
    fault = FirstAttempt(tmp_path / "fired")
    FAULTS[where](monkeypatch, fault)
    out = tmp_path / "out"
    manifest = run(_options(small_inputs, out), retrying_runner)
    assert fault.fired, "the fault was never reached"
    assert fault.calls >= 2, "the failed step was not retried"
    assert digest(out) == clean_run  # nothing duplicated, nothing lost, byte for byte
    assert leftovers(out) == []  # a failed write removes its temp file
    c = manifest["counts"]
    assert c["records_read"] == c["examples_packed"] + c["rejected"] + c["dropped_too_long"]
    assert not [n for n in os.listdir(out) if n.startswith(".")]  # the spill and the lock are gone
    report = verify(str(out), (str(small_inputs),))
    assert report.ok, "\n".join(map(str, report.problems))


# ------------------------------------------------------------------------------------------------
# Atomic, idempotent writes


def test_write_atomic_is_idempotent_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "train-00000-of-00001.arrow"
    _write.write_atomic(str(target), b"same bytes", _sink.Site.SHARD)
    _write.write_atomic(str(target), b"same bytes", _sink.Site.SHARD)  # a retried writer: same name, same bytes
    assert target.read_bytes() == b"same bytes" and leftovers(tmp_path) == []

    def broken_replace(src, dst):
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk went away"):
        _write.write_atomic(str(target), b"new bytes", _sink.Site.SHARD)
    assert target.read_bytes() == b"same bytes"  # the old file is intact, never half-replaced
    assert leftovers(tmp_path) == []
