"""Every write of a run can fail, and each failure ends the run as a failure.

The write sites are not listed here: a clean run through the one door (``pipeline._sink.create``) records them,
and each kind of site (the lock, the cards, the spill, the shards, the dead letters, the manifest) is then failed
at its first and at its last write, with each of ENOSPC, EROFS, EACCES and EIO. A write added to the code later is
in the matrix without a new test. For every cell:

- the command exits non-zero with exactly one ``error:`` line that names the output folder and the cause;
- no complete manifest is left;
- the loader (``PackedDataset``), ``packstream verify`` and ``datasets.load_dataset`` refuse the folder;
- the input is untouched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests._internals import _sink

ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EIO)
RECORDS = [{"messages": [{"role": "user", "content": f"question {i} " + "word " * (i % 17)},
                         {"role": "assistant", "content": f"answer {i} " + "more " * (i % 23)}]} for i in range(60)]
BAD = ['{"messages": [{"role": "assistant", "content": "no user turn"}]}', "{broken"]  # two dead letters


def _inputs(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in RECORDS) + "\n".join(BAD) + "\n")
    return src


def _pack(src: Path, out: Path):
    r = CliRunner().invoke(main, ["pack", str(src), "-o", str(out), "--max-tokens", "256", "--num-shards", "2",
                                  "--validation-fraction", "0.2", "--workers", "1", "--no-progress"])
    assert isinstance(r.exception, (SystemExit, type(None))), repr(r.exception)
    assert "Traceback" not in r.output, r.output
    return r


def _record_sites(tmp_path: Path, monkeypatch) -> list[tuple[str, int]]:
    """Run once through the door, recording each open: (site, its index among the opens of that site)."""
    seen: list[str] = []
    real = _sink.create

    def recording(path, site, **kw):
        seen.append(site.value)
        return real(path, site, **kw)

    monkeypatch.setattr(_sink, "create", recording)
    r = _pack(_inputs(tmp_path / "clean"), tmp_path / "clean" / "out")
    monkeypatch.setattr(_sink, "create", real)
    assert r.exit_code == 0, r.output
    cells = []
    for site in dict.fromkeys(seen):
        n = seen.count(site)
        cells += [(site, 0)] + ([(site, n - 1)] if n > 1 else [])
    return cells


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> list[tuple[str, int]]:
    mp = pytest.MonkeyPatch()
    try:
        return _record_sites(tmp_path_factory.mktemp("sites"), mp)
    finally:
        mp.undo()


def test_the_sites_are_found_from_the_code(sites):
    kinds = {s for s, _ in sites}
    print(f"\n{len(sites)} write sites found ({len(kinds)} kinds): {sites}")
    assert kinds == {s.value for s in _sink.Site}, "a kind of write never happened in the clean run"


def _refused(out: Path) -> None:
    from datasets import load_dataset

    from packers import PackedDataset, PackstreamError

    manifest = out / "manifest.json"
    if manifest.exists():
        assert json.loads(manifest.read_text())["status"] != "complete"
    with pytest.raises(PackstreamError):
        PackedDataset(out)
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    if out.exists() and any(out.iterdir()):
        with pytest.raises(Exception) as e:  # the guard card (or no data files) keeps datasets out
            load_dataset(str(out), split="train")
        assert not isinstance(e.value, (AssertionError, KeyboardInterrupt))


@pytest.mark.slow
@pytest.mark.parametrize("code", ERRNOS, ids=[errno.errorcode[c] for c in ERRNOS])
def test_a_failed_write_at_any_site_ends_the_run_as_a_failure(sites, code, tmp_path, monkeypatch):
    src = _inputs(tmp_path)
    before = hashlib.sha256(src.read_bytes()).hexdigest()
    real = _sink.create
    for site, index in sites:
        out = tmp_path / f"out-{site}-{index}"
        count = {"n": 0}

        def failing(path, s, **kw):
            if s.value == site:
                count["n"] += 1
                if count["n"] - 1 == index:
                    raise OSError(code, os.strerror(code), path)
            return real(path, s, **kw)

        monkeypatch.setattr(_sink, "create", failing)
        r = _pack(src, out)
        monkeypatch.setattr(_sink, "create", real)
        where = f"{errno.errorcode[code]} at {site}#{index}"
        assert count["n"] > index, f"{where}: the site was not reached"
        errors = [line for line in r.output.splitlines() if line.startswith("error: ")]
        assert r.exit_code != 0 and len(errors) == 1, f"{where}: exit {r.exit_code}\n{r.output}"
        assert str(out) in errors[0] and os.strerror(code) in errors[0], f"{where}: {errors[0]}"
        _refused(out)
        assert hashlib.sha256(src.read_bytes()).hexdigest() == before, f"{where}: the input changed"


def test_a_full_disk_exits_2_with_one_line_with_and_without_quiet(tmp_path, monkeypatch):
    """The shard write hits ENOSPC: exit 2, one line naming the folder and the cause, -q or not."""
    src = _inputs(tmp_path)
    real = _sink.create

    def full(path, site, **kw):
        if site is _sink.Site.SHARD:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real(path, site, **kw)

    monkeypatch.setattr(_sink, "create", full)
    for quiet in ([], ["-q"]):
        out = tmp_path / f"out{len(quiet)}"
        r = CliRunner().invoke(main, ["pack", str(src), "-o", str(out), *quiet])
        errors = [line for line in r.output.splitlines() if line.startswith("error: ")]
        assert r.exit_code == 2 and errors == [
            f"error: cannot write to --output {out} (OSError: No space left on device)"], r.output
        assert "Traceback" not in r.output
