"""pipeline._fs: local paths without Beam, with the semantics of Beam's LocalFileSystem; remote ones through Beam.

Two kinds of test: a fresh interpreter that reads, writes, claims and publishes on local paths through every
function that once imported ``apache_beam.io.filesystems`` and finds Beam never imported; and each local operation
of :mod:`pipeline._fs` held against Beam's own ``LocalFileSystem`` on twin folders (property-style, with
hypothesis, where the inputs vary), plus the remote calls checked to reach Beam's ``FileSystems`` as before.
"""

from __future__ import annotations

import io
import json
import os
import posixpath
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._internals import _fs, _write

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------------
# A local run's file work never imports Beam


_NO_BEAM = textwrap.dedent(r"""
    import gzip, json, os, sys
    import pyarrow as pa

    work = sys.argv[1]
    from pipeline import PackOptions, _fs, _output, _read, _spill, _write
    from pipeline._read import _files
    from packers.manifest import shard_name
    from packers.schema import SCHEMA
    SCHEMA = SCHEMA.with_metadata({})

    # reading: a folder of inputs, matched, sized, cut into tasks and read
    data = os.path.join(work, "data")
    os.makedirs(data)
    with open(os.path.join(data, "a.jsonl"), "w") as f:
        f.write('{"text": "x"}\n{"text": "y"}\n')
    with open(os.path.join(data, "b.csv"), "w") as f:
        f.write("text\nz\n")
    with gzip.open(os.path.join(data, "c.jsonl.gz"), "wt") as f:
        f.write('{"text": "w"}\n')
    files, _, _ = _read.expand_datasets(PackOptions(inputs=(data,), output=os.path.join(work, "out")).datasets())
    sizes = [_read.input_bytes(f) for f in files]
    assert all(s > 0 for s in sizes), sizes
    assert _read.read_tasks(files, sum(sizes), 2) >= len(files)
    assert [_read.expected_records(f) for f in files] == [2, 1, 1]
    read = [r for f in files for t in _read.cut_tasks(f) for _, r in _read.read_task(t, 1 << 20)]
    assert len(read) == 4, read
    assert not _files.is_hf_disk(data)
    with _read.open_raw("file://" + os.path.join(data, "a.jsonl")) as f:
        assert f.read().startswith(b'{"text"')

    # claiming the output folder, then a second claim that finds the lock
    out = _output.normalize_output(os.path.join(work, "out"))
    claim = _output.claim(out, [data], False, "run-1", files=["README.md"])
    try:
        _output.claim(out, [data], False, "run-2")
        raise SystemExit("the second claim went through")
    except _output.OutputLocked:
        pass

    # writing: a card, dead letters merged, shards staged, published, aborted and discarded, spill files
    _write.write_atomic(_write.join(out, "card.md"), b"card", _write.Site.CARD)
    assert _write.read_bytes(_write.join(out, "card.md"), what="card", limit=10) == b"card"
    parts = [_write.write_reject_part(out, str(i), [{"reason": "r", "source": "a", "position": i}]) for i in (2, 1)]
    counts, _ = _write.merge_rejected(out, parts)
    assert counts == {"r": 2}
    lines = list(_write.read_lines(_write.join(out, "rejected.jsonl"), what="rejected.jsonl", line_limit=1000))
    assert [json.loads(line)["position"] for _, line in lines] == [1, 2]
    staged = _write.ShardWriter(out, shard_name("train", 0, 1, "arrow"), SCHEMA, "arrow").close("train")
    _write.publish(out, [staged])
    _write.publish(out, [staged])  # a retried commit
    dropped = _write.ShardWriter(out, shard_name("validation", 0, 1, "arrow"), SCHEMA, "arrow")
    dropped.abort()
    _write.discard([_write.ShardWriter(out, shard_name("validation", 0, 1, "arrow"), SCHEMA, "arrow").close("x")])
    spill = _spill.spill_folder(out, "run-1")
    rows = pa.RecordBatch.from_pylist([{"n": 1}])
    [(_, piece)] = _spill.write_packed(spill, "g0", 0, {0: [rows]})
    assert _spill.read_piece(piece).to_pylist() == [{"n": 1}]
    __import__("shutil").rmtree(spill)
    names = _write.list_folder(out)
    assert "train-00000-of-00001.arrow" in names and not [n for n in names if n.startswith(".tmp-")], names
    _output.remove_temporaries(out)
    claim.release()
    assert ".packstream-lock" not in os.listdir(out)

    # the operations themselves
    p = _fs.join(out, "x.bin")
    _write.write_atomic(p, b"12345", _write.Site.CARD)
    assert _fs.exists(p) and _fs.size(p) == 5 and [m.path for m in _fs.match(out + "/x.*")] == [p]
    with _fs.open(p) as f:
        assert f.read() == b"12345"
    _fs.replace(p, p + ".2")
    _fs.delete([p + ".2"])
    assert _fs.supports(out) and not _fs.exists(p)

    print(json.dumps(sorted(m for m in sys.modules if m == "apache_beam" or m.startswith("apache_beam."))))
""")


def test_a_local_run_reads_and_writes_without_importing_beam(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _NO_BEAM, str(tmp_path)], capture_output=True, text=True,
                          timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


# ------------------------------------------------------------------------------------------------
# The local operations, side by side with Beam's LocalFileSystem


@pytest.fixture(scope="module")
def beam_local():
    """Beam's LocalFileSystem, the semantics each local operation keeps."""
    from apache_beam.io.localfilesystem import LocalFileSystem

    return LocalFileSystem(None)


_GLOB = st.text(alphabet="ab*?[]!^/.", min_size=0, max_size=12)


@settings(deadline=None)  # the first example imports Beam
@given(pattern=_GLOB)
def test_translate_pattern_is_beams(pattern):
    from apache_beam.io.filesystem import FileSystem

    assert _fs.translate_pattern(pattern) == FileSystem.translate_pattern(pattern)


_NAMES = st.sampled_from(["a", "b", "ab", "a.jsonl", "b.csv", ".hidden", "x[1]", "sub"])
_TREES = st.lists(st.lists(_NAMES, min_size=1, max_size=3), min_size=0, max_size=8)
_PIECES = st.sampled_from(["a", "b", "sub", "*", "**", "?", "[ab]", "[!a]", "a*", "*.jsonl", "x[1]", ".hidden", ""])


def _make_tree(root: Path, tree: list[list[str]]) -> None:
    """Files at the given relative paths (a path that would go through a file is skipped), a byte per level."""
    root.mkdir(parents=True, exist_ok=True)
    for parts in tree:
        p = root.joinpath(*parts)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            if not p.exists():
                p.write_bytes(b"x" * len(parts))
        except (FileExistsError, NotADirectoryError):
            pass


def _found(results) -> list[tuple[str, int]]:
    return sorted((m.path, m.size_in_bytes) for m in results)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=_TREES, pieces=st.lists(_PIECES, min_size=1, max_size=3), trailing=st.booleans())
def test_match_finds_what_beam_finds(tmp_path, beam_local, tree, pieces, trailing):
    local = beam_local
    root = tmp_path / uuid.uuid4().hex  # one tmp_path for all examples: a fresh tree in it for each
    _make_tree(root, tree)
    pattern = str(root) + "/" + "/".join(pieces) + ("/" if trailing else "")
    want = _found(local.match([pattern])[0].metadata_list)
    assert _found(_fs.match(pattern)) == want
    assert _found(_fs.match("file://" + pattern)) == [("file://" + p, n) for p, n in want]
    shutil.rmtree(root)


def test_match_of_relative_and_literal_patterns_is_beams(tmp_path, beam_local, monkeypatch):
    local = beam_local
    monkeypatch.chdir(tmp_path)
    _make_tree(tmp_path, [["d", "a.jsonl"], ["d", "e", "b.jsonl"], ["c.jsonl"]])
    for pattern in ("*.jsonl", "d/*.jsonl", "d/**", "d", "d/", "c.jsonl", "missing", "missing/*", str(tmp_path / "d")):
        assert _found(_fs.match(pattern)) == _found(local.match([pattern])[0].metadata_list), pattern


def test_exists_size_and_open_are_beams(tmp_path, beam_local):
    local = beam_local
    (tmp_path / "f").write_bytes(b"abc")
    (tmp_path / "d").mkdir()
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "link").symlink_to(tmp_path / "f")
    for name in ("f", "d", "dangling", "link", "missing", "x[1]"):
        p = str(tmp_path / name)
        assert _fs.exists(p) == local.exists(p) == _fs.exists("file://" + p), name
    assert _fs.size(str(tmp_path / "f")) == local.size(str(tmp_path / "f")) == 3
    assert _fs.size(str(tmp_path / "link")) == 3
    with pytest.raises(OSError):
        _fs.size(str(tmp_path / "missing"))
    with pytest.raises(OSError):
        local.size(str(tmp_path / "missing"))
    with _fs.open(str(tmp_path / "f")) as a, local.open(str(tmp_path / "f"), compression_type="uncompressed") as b:
        assert a.read() == b.read() == b"abc"
    gz = tmp_path / "f.gz"
    gz.write_bytes(b"not gzip")  # stored bytes, never decompressed by suffix
    with _fs.open(str(gz)) as a:
        assert a.read() == b"not gzip"
    with pytest.raises(FileNotFoundError):
        _fs.open(str(tmp_path / "missing"))


def test_a_name_with_glob_characters_is_sized_as_itself(tmp_path):
    # Beam's match would read "x[1].jsonl" as a glob (x1.jsonl) and size the input 0
    p = tmp_path / "x[1].jsonl"
    p.write_bytes(b"12345")
    assert _fs.size(str(p)) == 5
    _fs.delete([str(p)])
    assert not p.exists()
    with pytest.raises(TypeError, match="a list of paths"):
        _fs.delete(str(tmp_path))


def _twin(tmp_path: Path, build) -> tuple[Path, Path]:
    a, b = tmp_path / "ours", tmp_path / "beams"
    for root in (a, b):
        root.mkdir()
        build(root)
    return a, b


def _state(root: Path) -> list[tuple[str, str]]:
    out = []
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            kind = "link" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes().decode()
            out.append((str(p.relative_to(root)), kind))
    return sorted(out)


def _build(root: Path) -> None:
    (root / "f").write_bytes(b"f")
    (root / "g").write_bytes(b"g")
    (root / "d" / "e").mkdir(parents=True)
    (root / "d" / "e" / "h").write_bytes(b"h")
    (root / "dangling").symlink_to(root / "nowhere")
    (root / "dirlink").symlink_to(root / "d")


@pytest.mark.parametrize("names", [["f"], ["d"], ["f", "g"], ["missing"], ["f", "missing", "g"], ["dangling"],
                                   ["dirlink"], ["d/e/h"]])
def test_delete_is_beams(tmp_path, beam_local, names):
    local = beam_local
    ours, beams = _twin(tmp_path, _build)
    failed = []
    for root, delete in ((ours, _fs.delete), (beams, local.delete)):
        try:
            delete([str(root / n) for n in names])
            failed.append(False)
        except OSError:
            failed.append(True)
    assert failed[0] == failed[1]
    assert _state(ours) == _state(beams)


@pytest.mark.parametrize("src,dst", [("f", "g"), ("f", "new"), ("missing", "g"), ("f", "d"), ("d", "moved"),
                                     ("f", "nofolder/x")])
def test_replace_renames_as_beam_does(tmp_path, beam_local, src, dst):
    local = beam_local
    ours, beams = _twin(tmp_path, _build)
    failed = []
    for root, rename in ((ours, lambda s, d: _fs.replace(s, d)), (beams, lambda s, d: local.rename([s], [d]))):
        try:
            rename(str(root / src), str(root / dst))
            failed.append(False)
        except OSError:
            failed.append(True)
    assert failed[0] == failed[1]
    assert _state(ours) == _state(beams)


@settings(deadline=None)
@given(folder=st.sampled_from(["/a", "/a/", "a", "", "/a/b/", "file:///a"]),
       name=st.sampled_from(["x", "x/y", ".tmp-x", "/abs"]))
def test_join_is_beams_locally(folder, name):
    from apache_beam.io.localfilesystem import LocalFileSystem

    want = posixpath.join(folder, name)
    assert _fs.join(folder, name) == want
    if not folder.startswith("file://"):
        assert want == LocalFileSystem(None).join(folder, name)


def test_what_is_local():
    assert not _fs.is_remote("/a/b") and not _fs.is_remote("a") and not _fs.is_remote("file:///a")
    assert _fs.is_remote("gs://b/k") and _fs.is_remote("s3://b/k") and _fs.is_remote("memory://x")
    assert _fs.supports("/a") and _fs.supports("file:///a")
    assert not _fs.supports("nosuchscheme://bucket/x")


# ------------------------------------------------------------------------------------------------
# Remote paths reach Beam's FileSystems as they did


class _Recorder:
    """Beam's FileSystems, as far as pipeline._fs calls it: every call recorded."""

    def __init__(self, files: dict[str, bytes]):
        self.files, self.calls = files, []

    def join(self, folder, name):
        self.calls.append(("join", folder, name))
        return folder.rstrip("/") + "/" + name

    def exists(self, path):
        self.calls.append(("exists", path))
        return path in self.files

    def open(self, path, compression_type):
        self.calls.append(("open", path, compression_type))
        return io.BytesIO(self.files[path])

    def match(self, patterns):
        self.calls.append(("match", list(patterns)))
        from apache_beam.io.filesystem import FileMetadata, MatchResult

        (pattern,) = patterns
        return [MatchResult(pattern, [FileMetadata(p, len(b)) for p, b in sorted(self.files.items())
                                      if p.startswith(pattern.rstrip("*"))])]

    def delete(self, paths):
        self.calls.append(("delete", list(paths)))
        for p in paths:
            del self.files[p]

    def rename(self, src, dst):
        self.calls.append(("rename", list(src), list(dst)))
        for s, d in zip(src, dst):
            self.files[d] = self.files.pop(s)


def test_remote_paths_go_to_beam_with_the_same_calls(monkeypatch):
    fake = _Recorder({"gs://b/out/a": b"aaa", "gs://b/out/t": b"new"})
    monkeypatch.setattr(_fs, "_beam", lambda: fake)
    assert _fs.join("gs://b/out", "x") == "gs://b/out/x"
    assert _fs.exists("gs://b/out/a") and not _fs.exists("gs://b/out/x")
    with _fs.open("gs://b/out/a") as f:
        assert f.read() == b"aaa"
    assert _fs.size("gs://b/out/a") == 3
    with pytest.raises(FileNotFoundError):
        _fs.size("gs://b/nothing")
    assert [m.path for m in _fs.match("gs://b/out/*")] == ["gs://b/out/a", "gs://b/out/t"]
    _fs.replace("gs://b/out/t", "gs://b/out/a")
    _fs.delete(["gs://b/out/a"])
    assert fake.files == {}
    assert fake.calls == [
        ("join", "gs://b/out", "x"), ("exists", "gs://b/out/a"), ("exists", "gs://b/out/x"),
        ("open", "gs://b/out/a", "uncompressed"), ("match", ["gs://b/out/a"]), ("match", ["gs://b/nothing"]),
        ("match", ["gs://b/out/*"]), ("exists", "gs://b/out/a"), ("delete", ["gs://b/out/a"]),
        ("rename", ["gs://b/out/t"], ["gs://b/out/a"]), ("delete", ["gs://b/out/a"]),
    ]


def test_remote_writes_and_reads_of_the_job_go_through_beam(monkeypatch):
    fake = _Recorder({"gs://b/out/rejects-1.jsonl": b'{"reason": "r", "source": "s", "position": 1}\n'})
    monkeypatch.setattr(_fs, "_beam", lambda: fake)
    assert _write.join("gs://b/out", "m.json") == "gs://b/out/m.json"
    assert _write.list_folder("gs://b/out") == ["rejects-1.jsonl"]
    fake.files["gs://b/out/.tmp-x"] = b"staged"
    assert _write.publish("gs://b/out", [{"name": "x", "staged": "gs://b/out/.tmp-x"}]) == [{"name": "x"}]
    assert fake.files["gs://b/out/x"] == b"staged"
    _write.discard([{"staged": "gs://b/out/x"}])
    assert "gs://b/out/x" not in fake.files
