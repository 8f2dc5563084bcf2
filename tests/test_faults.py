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
byte-identical to a clean run on the default ``FnApiRunner``. (The local ``FnApiRunner`` does
not retry bundles; a failure there fails the job, which the kill-and-rerun test covers.)

The kill test SIGKILLs a real ``packstream pack`` process mid-run on the shared data, checks
that no partial shard is visible under a final name, and reruns it with ``--overwrite``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline import PackOptions, run
from pipeline import _read, _rows, _write
from pipeline._render import Renderer
from pipeline._verify import verify
from pipeline.cli import bundled_sample, main
from tests.conftest import GSM8K_FIELDS, shared_data


def digest(folder) -> dict[str, str]:
    """sha256 of every shard and of rejected.jsonl, plus the manifest minus the output folder
    (the only option a rerun changes; --overwrite is not recorded)."""
    folder = Path(folder)
    out = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
           for p in sorted(folder.iterdir()) if p.name.startswith(("train-", "rejected"))}
    m = json.loads((folder / "manifest.json").read_text())
    m["config"].pop("output")
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
    real = _read.read_file

    def read_file(f, max_bytes):
        for n, item in enumerate(real(f, max_bytes)):
            if n == 6:  # two chunks of 4 records already went downstream
                fault.fire(f"reading {f.source} after 6 records")
            fault.calls += 1
            yield item

    monkeypatch.setattr(_read, "read_file", read_file)


def _fail_mid_chunk(monkeypatch, fault: FirstAttempt) -> None:
    real = Renderer.encode

    def encode(self, convs):
        fault.calls += 1
        if fault.calls == 3:  # earlier chunks of the bundle already emitted their examples
            fault.fire("tokenizing the third chunk")
        return real(self, convs)

    monkeypatch.setattr(Renderer, "encode", encode)


def _fail_mid_group(monkeypatch, fault: FirstAttempt) -> None:
    real = _rows.pack_group

    def pack_group(examples, options):
        fault.calls += 1
        if fault.calls == 2:  # the first group's rows were already emitted
            fault.fire("packing the second group")
        return real(examples, options)

    monkeypatch.setattr(_rows, "pack_group", pack_group)


def _fail_after_shard_written(monkeypatch, fault: FirstAttempt) -> None:
    real = _write.write_shard

    def write_shard(*args, **kwargs):
        fault.calls += 1
        result = real(*args, **kwargs)  # the shard is on disk under its final name
        fault.fire(f"after writing shard {result['name']}")
        return result

    monkeypatch.setattr(_write, "write_shard", write_shard)


def _fail_before_rename(monkeypatch, fault: FirstAttempt) -> None:
    real = os.replace

    def replace(src, dst, *a, **kw):
        if os.path.basename(str(dst)).startswith("train-"):
            fault.calls += 1
            fault.fire(f"renaming {os.path.basename(str(src))}")  # the temp file is fully written
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", replace)


def _fail_after_dead_letters(monkeypatch, fault: FirstAttempt) -> None:
    real = _write.write_rejected

    def write_rejected(folder, records):
        fault.calls += 1
        counts = real(folder, list(records))
        fault.fire("after writing rejected.jsonl")
        return counts

    monkeypatch.setattr(_write, "write_rejected", write_rejected)


def _fail_after_manifest(monkeypatch, fault: FirstAttempt) -> None:
    real = _write.dataset_card

    def dataset_card(manifest):  # called after manifest.json is written, before README.md
        fault.calls += 1
        fault.fire("after writing manifest.json")
        return real(manifest)

    monkeypatch.setattr(_write, "dataset_card", dataset_card)


FAULTS = {
    "mid_file": _fail_mid_file,
    "mid_chunk": _fail_mid_chunk,
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
def retrying_runner(monkeypatch):
    """``BundleBasedDirectRunner``, with one bug of Beam 2.77 patched for this test.

    Its ``EvaluationContext._update_side_inputs_container`` feeds side inputs only from the
    first output PCollection of a step (``uncommitted_output_bundles[0]``), so a tagged output
    read as a side input (PackGroups' ``stats`` -> the manifest) arrives empty or mixed with
    the main output. The fix below routes each committed bundle to the views of its own
    PCollection; the retry logic (``TransformExecutor.call``) is untouched.
    """
    from apache_beam.runners.direct import evaluation_context

    def update(self, committed_bundles, result):
        for bundle in committed_bundles:
            for view in self._pcollection_to_views.get(bundle.pcollection, ()):
                self._side_inputs_container.add_values(view, bundle.get_elements_iterable(make_copy=True))

    monkeypatch.setattr(evaluation_context.EvaluationContext, "_update_side_inputs_container", update)
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
    report = verify(str(out), (str(small_inputs),))
    assert report.ok, "\n".join(map(str, report.problems))


# ------------------------------------------------------------------------------------------------
# Atomic, idempotent writes


def test_write_atomic_is_idempotent_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "train-00000-of-00001.arrow"
    _write.write_atomic(str(target), b"same bytes")
    _write.write_atomic(str(target), b"same bytes")  # a retried writer: same name, same bytes
    assert target.read_bytes() == b"same bytes" and leftovers(tmp_path) == []

    def broken_replace(src, dst):
        raise OSError("disk went away")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk went away"):
        _write.write_atomic(str(target), b"new bytes")
    assert target.read_bytes() == b"same bytes"  # the old file is intact, never half-replaced
    assert leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------------
# SIGKILL mid-run, then a rerun


@pytest.fixture(scope="module")
def shared_clean(tmp_path_factory):
    data = shared_data()
    out = tmp_path_factory.mktemp("shared_clean") / "out"
    options = PackOptions(inputs=(str(data),), output=str(out), fields=GSM8K_FIELDS, num_shards=8)
    run(options)
    return data, out, digest(out)


def _pack_cmd(data: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "pack", str(data), "-o", str(out), "--field", "question=user",
            "--field", "answer=assistant", "--num-shards", "8", "-q", *extra]


def _kill_midway(cmd: list[str], out: Path, when: str) -> int:
    """Start ``packstream pack``, SIGKILL it at the chosen moment; returns its exit status."""
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.time()
    try:
        while proc.poll() is None and time.time() - started < 120:
            if when == "while_tokenizing" and time.time() - started > 5:
                break
            names = os.listdir(out) if out.is_dir() else []
            if when == "while_writing_shards" and any(n.startswith(("train-", ".tmp-train-")) for n in names):
                break
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group this test started
        proc.wait()
    return proc.returncode


@pytest.mark.parametrize("when", ["while_tokenizing", "while_writing_shards"])
def test_sigkill_then_rerun_gives_identical_output(shared_clean, tmp_path, when):
    data, clean_out, clean = shared_clean
    out = tmp_path / "out"
    for _ in range(3):  # on a loaded machine the run may finish inside the polling gap: try again
        shutil.rmtree(out, ignore_errors=True)
        if _kill_midway(_pack_cmd(data, out), out, when) == -signal.SIGKILL:
            break
    else:
        pytest.fail("packstream pack finished every time before it could be killed")
    # Nothing partial is visible under a final name: a shard there is complete and final.
    names = sorted(os.listdir(out)) if out.is_dir() else []
    for n in names:
        assert n.startswith((".tmp-", "train-", "rejected.jsonl", "manifest.json", "README.md")), n
    if "manifest.json" in names:  # written last, atomically: complete if visible at all
        json.loads((out / "manifest.json").read_text())
        if n.startswith("train-"):
            assert hashlib.sha256((out / n).read_bytes()).hexdigest() == clean[n], f"{n} is partial"
    # A rerun into the leftovers is refused without --overwrite, then replaces them.
    if names:
        refused = CliRunner().invoke(main, _pack_cmd(data, out)[3:])
        assert refused.exit_code == 2 and "error: --output" in refused.output and "--overwrite" in refused.output
    rerun = subprocess.run(_pack_cmd(data, out, "--overwrite"), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert digest(out) == clean
    assert leftovers(out) == []
    if when == "while_writing_shards":
        report = verify(str(out), ())  # the manifest's own inputs: every record reconciled
        assert report.ok and report.records == json.loads((out / "manifest.json").read_text())["counts"]["records_read"]
