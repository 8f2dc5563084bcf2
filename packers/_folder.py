"""Open a run's output folder for training: the manifest decides what is read, and every shard is checked
against it before a row is read.

:func:`open_rows` finds the folder (local or any fsspec URL) and the shard files asked for, reads the complete
``manifest.json`` through the checked open, refuses a folder holding shard files it does not list (or a run's
lock), copies remote shards into a private cache (reused only when the copy hashes to the manifest's sha256),
and checks each shard's size, schema, schema metadata and row counts against its entry (and its sha256 with
``verify``). Every refusal names the folder or shard, what differs, and the fix; see docs/loader.md, "What the
loader checks".
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
import tempfile
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from packers.errors import ContractError, PackstreamError, short
from packers.files import check_regular, open_checked, show_path
from packers.manifest import (
    LOCK,
    MANIFEST,
    RESTORE,
    SHARD_NAME,
    SPLITS,
    TMP_PREFIX,
    Manifest,
    RowChecks,
    ShardEntry,
    is_datasets_cache,
    load_manifest,
    missing_manifest,
    require_complete,
)
from packers.shardcheck import check_rows, checked_metadata

# -- opening: the manifest decides what is read ---------------------------------------------------------

_HASH_CHUNK = 1 << 22  # 4 MiB per read while hashing or copying


def _sha256(f: Any) -> str:
    """sha256 of a binary file object, read in chunks (never the whole shard in memory)."""
    h = hashlib.sha256()
    while chunk := f.read(_HASH_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def _sha256_file(path: str, what: str = "shard") -> str:
    with open_checked(path, what=what) as f:
        return _sha256(f)


@dataclass(frozen=True)
class _Folder:
    """Where a run's output lives, as PackedDataset was given it."""

    fs: Any  # fsspec filesystem
    root: str  # the folder, as the filesystem names it
    where: str  # the folder as the user sees it: a local path or a URL; starts every message
    local: bool
    files: tuple[str, ...] | None  # the shard files asked for, by name; None: every listed shard of the split

    def join(self, name: str) -> str:
        return posixpath.join(self.root, name)


def _locate(path: str | os.PathLike | Sequence[str | os.PathLike], storage_options: dict | None) -> _Folder:
    """One output folder, and the shard files of it that ``path`` names (a folder, a file, or a list of files)."""
    import fsspec

    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    if not paths:
        raise PackstreamError("PackedDataset got an empty list of paths; pass the --output folder of packstream pack")
    found: list[tuple[Any, str, str | None]] = []
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            raise PackstreamError(f"PackedDataset path {short(p)} is a {type(p).__name__}; pass a folder or file path")
        try:
            fs, root = fsspec.core.url_to_fs(os.fspath(p), **(storage_options or {}))
        except (ValueError, ImportError) as e:  # an unknown protocol, or its filesystem not installed
            raise PackstreamError(f"{show_path(os.fspath(p))}: {e}; pass a local folder or an fsspec URL") from None
        root = root.rstrip("/") or "/"
        if fs.isdir(root):
            found.append((fs, root, None))
        elif fs.exists(root):
            found.append((fs, posixpath.dirname(root), posixpath.basename(root)))
        else:
            raise PackstreamError(f"{show_path(os.fspath(p))} does not exist; pass the --output folder of packstream pack")
    fs, root = found[0][0], found[0][1]
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    local = "file" in protocols
    where = show_path(root if local else fs.unstrip_protocol(root))
    folders = sorted({r for _, r, _ in found})
    if len(folders) > 1:
        raise PackstreamError(
            f"PackedDataset reads one packstream run, and these paths span {len(folders)} folders: {folders[:4]}. "
            "Shards of two runs cannot be checked against one manifest (and a copy of a run would train every "
            "example twice); pack all the inputs in one run: packstream pack IN1 IN2 ... -o OUT"
        )
    names = [n for _, _, n in found]
    if None in names:
        if len(names) > 1:
            raise PackstreamError(
                f"{where}: got the folder and {len(names) - 1} more path(s) in it; pass the folder alone (every "
                "listed shard) or a list of its shard files"
            )
        return _Folder(fs, root, where, local, None)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise PackstreamError(f"{where}: {twice[0]} is passed {names.count(twice[0])} times; its rows would be read twice")
    return _Folder(fs, root, where, local, tuple(names))


def _read_manifest(folder: _Folder) -> tuple[Manifest, list[str]]:
    """The folder's complete, checked manifest and its file names; refuses a folder that is not a finished
    run's (read through the checked open: a FIFO, a device or a huge file is one refusal, not a hang)."""
    try:
        names = sorted(posixpath.basename(p.rstrip("/")) for p in folder.fs.ls(folder.root, detail=False))
    except OSError as e:
        raise PackstreamError(f"{folder.where} cannot be listed: {e.strerror or e}; check its permissions") from None
    if MANIFEST not in names:
        raise missing_manifest(folder.where, names)
    path = folder.join(MANIFEST) if folder.local else folder.fs.unstrip_protocol(folder.join(MANIFEST))
    opener = None if folder.local else (lambda p: folder.fs.open(p, "rb"))
    m = require_complete(load_manifest(path, folder.where, opener=opener), folder.where)
    if LOCK in names:
        raise ContractError(
            f"{folder.where}: {LOCK} is present: a packstream run (pack --overwrite) is rewriting this folder, so its "
            f"files may not be the ones {MANIFEST} lists. Wait for the run to finish; if none is running (it was "
            f"killed), re-run packstream pack --overwrite"
        )
    stray = [n for n in m.unlisted(names) if not is_datasets_cache(n)]
    if stray:
        n = stray[0]
        why = (
            "a temporary file of an interrupted packstream write" if n.startswith(TMP_PREFIX)
            else "a shard of another run (its name is not one of this run's)" if SHARD_NAME.match(n)
            else "not a shard of this run (a backup, a copy, or another run's file)"
        )
        more = f" (and {len(stray) - 1} more: {stray[1:4]})" if len(stray) > 1 else ""
        raise ContractError(
            f"{folder.where}: {show_path(n)}: not listed in {MANIFEST}{more}; it is {why}. PackedDataset reads exactly "
            f"the listed shards and refuses a folder that holds others: remove it, or re-run packstream pack --overwrite"
        )
    return m, names


def _select(folder: _Folder, m: Manifest, split: str) -> list[ShardEntry]:
    """The manifest entries to open: every shard of ``split``, or the files asked for (which must be listed)."""
    if folder.files is None:
        entries = m.listed(split)
        if not entries:
            have = sorted({s.split for s in m.shards})
            hint = (f"; it lists {have} shards: pass split={have[0]!r}" if have
                    else "; the run packed no rows (see the counts in manifest.json and rejected.jsonl)")
            raise ContractError(f"{folder.where}: {MANIFEST} lists no {split!r} shards{hint}")
        return entries
    by_name = {s.name: s for s in m.shards}
    entries = []
    for n in folder.files:
        s = by_name.get(n)
        if s is None:
            raise ContractError(
                f"{folder.where}/{show_path(n)}: not a shard listed in {MANIFEST}; pass the folder, or shard files it "
                f"lists ({sorted(by_name)[:3]}{' ...' if len(by_name) > 3 else ''})"
            )
        if s.split != split:
            raise PackstreamError(
                f"{folder.where}/{n}: a {s.split!r} shard, and this PackedDataset reads split={split!r}; pass split={s.split!r}"
            )
        entries.append(s)
    return sorted(entries, key=lambda s: s.name)


# -- the cache of remote shards --------------------------------------------------------------------------

class CopyHashes:
    """sha256 of the cached copies hashed in this process, keyed by their (device, inode, size, mtime, ctime): any
    write to a file changes its ctime, which no user call can set back, so an entry is the file's current hash.
    One instance, :data:`COPIES`."""

    def __init__(self) -> None:
        self._known: dict[tuple[int, int, int, int, int], str] = {}

    def of(self, path: str) -> str | None:
        """sha256 of the cached copy at ``path`` (hashed once per process while the file is unchanged); None if it
        is not a regular file of this user's."""
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
            return None
        key = _identity(st)
        if key not in self._known:
            self._known[key] = _sha256_file(path, "cached shard")
        return self._known[key]

    def remember(self, path: str, sha: str) -> None:
        """``path`` (a copy just written and hashed on the way) has ``sha``."""
        self._known[_identity(os.stat(path))] = sha


def _identity(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


COPIES = CopyHashes()


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/packstream/shards`` (``~/.cache/packstream/shards``): where remote shards are copied."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "packstream", "shards")


def _private_dir(path: str, what: str) -> str:
    """``path`` as a folder only this user can write: created with mode 0700 if absent; an existing one must
    be a folder owned by this user that neither group nor others can write (else anyone could swap a copy)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        raise PackstreamError(f"{what} {show_path(path)} cannot be created: {e.strerror or e}; pass cache_dir= a "
                              "folder of yours") from None
    if not stat.S_ISDIR(st.st_mode):
        raise PackstreamError(f"{what} {show_path(path)} is not a folder; pass cache_dir= a folder of yours")
    if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
        raise PackstreamError(
            f"{what} {show_path(path)} belongs to user id {st.st_uid}, not to you (id {os.geteuid()}): whoever owns "
            "it could change the shards you train on; pass cache_dir= a folder of yours"
        )
    if st.st_mode & 0o022:
        raise PackstreamError(
            f"{what} {show_path(path)} is writable by {'others' if st.st_mode & 0o002 else 'its group'} (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): anyone who can write there could change the shards you train on; "
            f"chmod 700 it, or pass cache_dir= a private folder"
        )
    return path


def _fetch_shard(folder: _Folder, s: ShardEntry, names: list[str], cache_dir: str | None) -> tuple[str, bool]:
    """A local, size-checked regular file for the listed shard ``s``. Remote shards are copied into a private
    cache (hashed on the way), and a copy already there is used only if its sha256 is the manifest's.
    Returns (path, sha256 already checked)."""
    at = f"{folder.where}/{s.name}"
    if s.name not in names:
        raise ContractError(
            f"{at}: listed in {MANIFEST} but missing from the folder ({s.rows} rows lost); copy the whole output "
            "folder, or re-run packstream pack"
        )
    if s.ext == "parquet":
        raise PackstreamError(
            f"{at}: Parquet shards cannot be memory-mapped; pack with --output-format arrow (the default), or read "
            "them with datasets.load_dataset('parquet', ...) and packers.Collator"
        )
    if folder.local:
        size = check_regular(folder.join(s.name), "shard").st_size  # a FIFO or a device is refused, never opened
    else:
        size = int(folder.fs.size(folder.join(s.name)))
    if size != s.bytes:
        raise ContractError(
            f"{at}: {size:,} bytes, {MANIFEST} says {s.bytes:,}: the shard was changed after the run wrote it (rows "
            f"removed or added, truncated, or replaced by another run's shard); {RESTORE}"
        )
    if folder.local:
        return folder.join(s.name), False
    # Memory-mapping needs a local file: copy once into a private cache keyed by the folder's URL (see
    # docs/loader.md, "Remote folders"). A copy there is reused only if it hashes to the manifest's sha256.
    root = _private_dir(cache_dir or default_cache_dir(), "cache_dir")
    cache = _private_dir(os.path.join(root, hashlib.sha256(folder.where.encode()).hexdigest()[:16]), "cache_dir")
    dst = os.path.join(cache, s.name)
    if os.path.exists(dst) and os.path.getsize(dst) == s.bytes and COPIES.of(dst) == s.sha256:
        return dst, True
    fd, part = tempfile.mkstemp(prefix=f".{s.name}.", suffix=".part", dir=cache)  # several ranks may copy at once
    h = hashlib.sha256()
    try:
        with folder.fs.open(folder.join(s.name), "rb") as src, os.fdopen(fd, "wb") as out:
            while chunk := src.read(_HASH_CHUNK):
                h.update(chunk)
                out.write(chunk)
        if h.hexdigest() != s.sha256:
            raise ContractError(
                f"{at}: sha256 of the copy is {h.hexdigest()[:16]}…, {MANIFEST} says {s.sha256[:16]}…: the shard's "
                f"bytes changed after the run wrote it (or the copy was corrupted); {RESTORE}"
            )
        os.replace(part, dst)
    except BaseException:
        if os.path.exists(part):
            os.remove(part)
        raise
    COPIES.remember(dst, s.sha256)
    return dst, True


def _read_schema(path: str, at: str) -> pa.Schema:
    with pa.memory_map(path) as src:
        try:
            return pa.ipc.open_stream(src).schema
        except (pa.ArrowException, OSError) as e:
            raise ContractError(
                f"{at}: not an Arrow IPC stream file (what packstream pack writes): {e}; {RESTORE}"
            ) from None


@dataclass(frozen=True)
class _Opened:
    rows: Any  # datasets.Dataset over the shards, in name order
    metadata: dict[str, Any]  # the shards' schema metadata (equal but for each shard's place)
    manifest: Manifest
    checks: RowChecks
    where: str
    names: tuple[str, ...]  # the opened shards' names
    starts: np.ndarray  # global index of each shard's first row, plus the total
    data_sha256: str  # sha256 over the opened shards' names and manifest sha256s: what a resume state is tied to


def open_rows(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    split: str = "train",
    verify: bool = False,
    cache_dir: str | None = None,
    storage_options: dict | None = None,
) -> _Opened:
    """Open the shards a complete manifest lists as one memory-mapped ``datasets.Dataset`` (zero-copy).

    Checks each shard's size, schema, schema metadata (run id, split, index and count included) and row
    count against ``manifest.json`` (and its sha256 with ``verify``); every refusal is a
    :class:`ContractError`/:class:`PackstreamError` naming the folder or shard, what differs, and the fix.
    """
    import datasets

    if split not in SPLITS:
        raise PackstreamError(f"split={short(split)}; use one of {list(SPLITS)}")
    folder = _locate(path, storage_options)
    m, names = _read_manifest(folder)
    parts, counts, opened, meta0 = [], [0], [], None
    for s in _select(folder, m, split):
        local, hashed = _fetch_shard(folder, s, names, cache_dir)
        if verify and not hashed:
            _check_sha256(f"{folder.where}/{s.name}", local, s)
        part, meta = _open_shard(f"{folder.where}/{s.name}", local, m, s)
        parts.append(part)
        counts.append(part.num_rows)
        opened.append(s)
        meta0 = meta0 or meta
    rows = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    data = hashlib.sha256("".join(f"{s.name} {s.sha256}\n" for s in opened).encode()).hexdigest()
    return _Opened(rows=rows, metadata=meta0, manifest=m, checks=m.row_checks, where=folder.where,
                   names=tuple(s.name for s in opened), starts=np.cumsum(counts).astype(np.int64), data_sha256=data)


def _check_sha256(at: str, local: str, s: ShardEntry) -> None:
    got = _sha256_file(local)
    if got != s.sha256:
        raise ContractError(
            f"{at}: check sha256 failed: the file hashes to {got[:16]}…, {MANIFEST} says {s.sha256[:16]}…: its "
            f"bytes changed after the run wrote it (a token, a mask or an offset edited); {RESTORE}"
        )


def _open_shard(at: str, local: str, m: Manifest, s: ShardEntry) -> tuple[Any, dict[str, Any]]:
    """The shard at ``local`` memory-mapped as a ``datasets.Dataset``, and its schema metadata, once its schema,
    metadata, Arrow structure and counts agree with its manifest entry ``s``."""
    import datasets

    meta = checked_metadata(at, _read_schema(local, at), m, s)
    try:
        part = datasets.Dataset.from_file(local)
    except (pa.ArrowException, OSError) as e:
        raise ContractError(
            f"{at}: not a valid Arrow file ({e}); it was damaged after the run wrote it: {RESTORE}"
        ) from None
    check_rows(at, part.data.table, s)
    return part, meta
