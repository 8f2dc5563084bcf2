"""The file system operations a run makes on paths that may be local or remote, without Beam for local ones.

A local path (no ``scheme://``, or ``file://``) goes to ``os``, ``shutil`` and ``io``; anything else (``gs://``,
``s3://``, ``hdfs://``, ``azfs://``) to Beam's ``FileSystems``, imported there and only there: importing
``apache_beam.io.filesystems`` imports the whole of Beam (about 0.85 CPU-seconds), which a local pack never needs.

Each local operation keeps what Beam's ``LocalFileSystem`` does for it (``tests/test_local_fs.py`` holds them side
by side), with two deliberate differences: the paths given to :func:`size` and :func:`delete` are literal (Beam's
``match`` would take the ``[`` of a folder named ``out[1]`` for a glob and find nothing), and a local failure is
the ``OSError`` the operating system raised (Beam wraps it in ``BeamIOError``, itself an ``OSError``: every caller
catches ``OSError`` or wider). Remote paths behave exactly as they did through Beam.

Writes are not here: every file a run writes under its output goes through :func:`pipeline._sink.create` (the one
door ``tests/test_write_faults.py`` fails site by site), which already opens local files with ``open``.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import shutil
from typing import Any, BinaryIO, NamedTuple, Sequence

_FILE = "file://"


class Metadata(NamedTuple):
    """A matched local file, with the fields of Beam's ``FileMetadata`` that callers read."""

    path: str
    size_in_bytes: int
    last_updated_in_seconds: float


def is_remote(path: str) -> bool:
    """Whether ``path`` names an object store or other non-local file system (``gs://b/k``; not ``file:///x``)."""
    return "://" in path and not path.startswith(_FILE)


def _local(path: str) -> str:
    return path[len(_FILE):] if path.startswith(_FILE) else path


def _beam() -> Any:
    from apache_beam.io.filesystems import FileSystems

    return FileSystems


def join(folder: str, name: str) -> str:
    """``name`` inside ``folder`` (a remote folder joined by its file system's rules)."""
    return _beam().join(folder, name) if is_remote(folder) else posixpath.join(folder, name)


def supports(path: str) -> bool:
    """Whether a file system is installed for ``path``'s scheme (local paths always; ``gs://`` needs
    apache-beam[gcp], ``s3://`` apache-beam[aws])."""
    if not is_remote(path):
        return True
    try:
        _beam().get_filesystem(path)
    except ValueError:
        return False
    return True


def open(path: str) -> BinaryIO:
    """``path`` opened to read bytes, as stored (no decompression by suffix). A raw open: a user-named file is
    opened through :func:`packers.files.open_checked`, which hands only remote paths to this."""
    if is_remote(path):
        return _beam().open(path, compression_type="uncompressed")
    return io.open(_local(path), "rb")


def exists(path: str) -> bool:
    """Whether ``path`` exists (a file or a folder; a dangling symlink does not)."""
    return _beam().exists(path) if is_remote(path) else os.path.exists(_local(path))


def size(path: str) -> int:
    """The size of the file ``path`` in bytes; FileNotFoundError (an OSError) when there is none."""
    if not is_remote(path):
        return os.path.getsize(_local(path))
    found = _beam().match([path])[0].metadata_list
    if not found:
        raise FileNotFoundError(f"no file {path}")
    return int(found[0].size_in_bytes)


def match(pattern: str) -> list:
    """The files ``pattern`` matches, each with ``path`` and ``size_in_bytes`` (Beam's ``FileSystems.match`` of one
    pattern). Locally as Beam's ``LocalFileSystem`` matches: ``*`` stays within a folder and ``**`` crosses
    folders; a pattern ending in ``/`` means its folder's files; a pattern with no glob character matches
    itself if it exists (a folder too); a relative glob whose fixed part has no folder (``*.jsonl``)
    matches nothing; the paths keep a ``file://`` the pattern had."""
    if is_remote(pattern):
        return list(_beam().match([pattern])[0].metadata_list)
    scheme = _FILE if pattern.startswith(_FILE) else ""
    pattern = _local(pattern)
    if pattern.endswith(("/", "\\")):
        pattern += "*"
    fixed = re.match(r"^[^[*?]*", pattern).group(0)
    if fixed == pattern:
        found = [_metadata(pattern)] if os.path.exists(pattern) else []
    else:
        found = _walk(os.path.dirname(fixed))
    wanted = re.compile(translate_pattern(pattern)).match
    return [m._replace(path=scheme + m.path) for m in found if wanted(m.path)]


def _metadata(path: str) -> Metadata:
    return Metadata(path, os.path.getsize(path), os.path.getmtime(path))


def _walk(folder: str) -> list[Metadata]:
    """Every file under ``folder`` (not following links to folders), as Beam's ``LocalFileSystem._list`` lists them:
    nothing when the folder does not exist; a file that vanishes while listed is left out."""
    if not os.path.exists(folder):
        return []
    out = []
    for dirpath, _, files in os.walk(folder):
        for name in files:
            try:
                out.append(_metadata(os.path.join(dirpath, name)))
            except OSError:
                pass
    return out


def translate_pattern(pattern: str) -> str:
    """A glob as the regular expression Beam's ``FileSystem.translate_pattern`` makes of it: fnmatch's syntax,
    except that ``*`` does not cross a ``/`` and ``**`` does; there is no way to quote a special character."""
    i, n, res = 0, len(pattern), ""
    while i < n:
        c = pattern[i]
        i += 1
        if c == "*":
            if i < n and pattern[i] == "*":
                res, i = res + ".*", i + 1
            else:
                res += r"[^/\\]*"
        elif c == "?":
            res += "."
        elif c == "[":
            j = i
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                res += r"\["
            else:
                stuff = pattern[i:j].replace("\\", "\\\\")
                i = j + 1
                stuff = "^" + stuff[1:] if stuff[0] == "!" else "\\" + stuff if stuff[0] == "^" else stuff
                res = f"{res}[{stuff}]"
        else:
            res += re.escape(c)
    return r"(?ms)" + res + r"\Z"


def delete(paths: Sequence[str]) -> None:
    """Remove each path: a file, or a folder with all it holds (Beam's ``FileSystems.delete``; remote paths in
    one call, as Beam batches them). Locally each path is tried, then the first failure is raised:
    FileNotFoundError for a path that does not exist (a dangling symlink included, which Beam leaves too)."""
    if isinstance(paths, str):  # each character a path: Beam refuses it too
        raise TypeError(f"delete takes a list of paths, not the string {paths!r}")
    remote = [p for p in paths if is_remote(p)]
    if remote:
        _beam().delete(remote)
    first = None
    for p in (_local(p) for p in paths if not is_remote(p)):
        try:
            if not os.path.exists(p):
                raise FileNotFoundError(2, "No files found to delete", p)
            if os.path.isdir(p):
                shutil.rmtree(p)
            else:
                os.remove(p)
        except OSError as e:
            first = first or e
    if first is not None:
        raise first


def replace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst``, replacing a file ``dst`` (locally ``os.replace``: atomic on POSIX; remotely
    Beam's delete then rename, as object stores have no atomic rename)."""
    if not is_remote(dst) and not is_remote(src):
        os.replace(_local(src), _local(dst))
        return
    fs = _beam()
    if fs.exists(dst):
        fs.delete([dst])
    fs.rename([src], [dst])
