"""Read packed shards for training: memory-mapped rows, seeded epochs, rank sharding, exact resume.

One epoch of a :class:`PackedDataset` over 10 rows, ``batch_size=2`` rows, 2 ranks::

    order         = default_rng(seed + epoch).permutation(10)    e.g. [7 2 9 0 4 1 8 3 6 5]
    micro-batches = [7 2] [9 0] [4 1] [8 3] [6 5]                 chunks of the order
    tail          : 5 micro-batches for 2 ranks -> repeat the first one (drop_last=False)
                    or drop the last one (drop_last=True)
    step          0          1          2
    rank 0        [7 2]      [4 1]      [6 5]                     micro-batch  step * world + rank
    rank 1        [9 0]      [8 3]      [7 2]  <- repeated

Every rank computes the same plan from the seed alone (no communication), takes its own
micro-batches, and so sees rows disjoint from the other ranks' and the same number of steps.
The only repeats are the tail's, as with torch's ``DistributedSampler``.

A micro-batch holds ``batch_size`` units of ``batch_by``:

* ``rows``: exactly ``batch_size`` rows (the last one may be short);
* ``examples``: rows are added while that brings the number of packed examples closer to
  ``batch_size`` (at least one row), so a step holds about as many examples as a padded
  run with that batch size: offline packing into fewer rows otherwise means fewer, larger
  optimizer steps, which hurts convergence at equal epochs (arXiv 2407.09105);
* ``tokens``: rows are added while the total stays within ``batch_size`` tokens, a memory cap.

``state_dict()`` is ``(epoch, position)`` (steps consumed in the epoch) plus the options that
shape the plan; restoring it gives the same next batches as an uninterrupted run.
"""

from __future__ import annotations

import enum
import hashlib
import os
import posixpath
import stat
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.utils.data

from packers._errors import ContractError, InternalError, PackstreamError
from packers._files import check_regular, open_checked, show_path
from packers._manifest import (
    LOCK,
    MANIFEST,
    SHARD_NAME,
    SPLITS,
    TMP_PREFIX,
    Manifest,
    RowChecks,
    ShardEntry,
    is_datasets_cache,
    load_manifest,
    metadata_mismatch,
    missing_manifest,
    require_complete,
)
from packers._rowcheck import Batch, Failure, check_batch, gather
from packers._schema import PLACE_KEYS, SCHEMA, read_metadata


class BatchBy(str, enum.Enum):
    """What ``batch_size`` counts in a :class:`PackedDataset` micro-batch."""

    ROWS = "rows"
    EXAMPLES = "examples"
    TOKENS = "tokens"


@dataclass(frozen=True, kw_only=True)
class _Sampling:
    """The options that decide which rows each rank gets at each step; saved in the state dict."""

    batch_size: int = 1
    """Units of ``batch_by`` per micro-batch (one rank, one step)."""
    batch_by: BatchBy = BatchBy.ROWS
    """Count rows, packed examples, or tokens."""
    shuffle: bool = True
    """Permute the rows each epoch with ``numpy.random.default_rng(seed + epoch)``."""
    seed: int = 0
    """Same on every rank."""
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False
    """Drop the epoch's short last micro-batch and the micro-batches that do not fill a step on every rank,
    instead of repeating micro-batches from the epoch's start."""

    def __post_init__(self) -> None:
        if not _is_count(self.seed):
            raise PackstreamError(f"seed={_short(self.seed)} must be an integer >= 0 (numpy's generators take "
                                  "non-negative seeds); use e.g. seed=0")
        if self.batch_size < 1:
            raise PackstreamError(f"batch_size={self.batch_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise PackstreamError(f"rank={self.rank} must be in [0, world_size={self.world_size})")


def _is_count(v: Any) -> bool:
    """An integer >= 0 (Python or numpy; not a bool)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) and v >= 0


def _short(v: Any, limit: int = 40) -> str:
    s = repr(v)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _differences(saved: Mapping[str, Any], current: Mapping[str, Any], keys: Sequence[str]) -> str:
    """``"seed -5 vs 3, world_size 2 vs 1"``: the keys whose saved and current values differ ('' if none)."""
    return ", ".join(f"{k} {_short(saved[k])} vs {_short(current[k])}" for k in keys
                     if saved[k] != current[k] or type(saved[k]) is not type(current[k]))


def _micro_batches(order: np.ndarray, units: np.ndarray | None, s: _Sampling, budget: int) -> list[np.ndarray]:
    """Cut the epoch's row order into micro-batches (see the module docstring)."""
    if s.batch_by is BatchBy.ROWS:
        out = [order[i : i + s.batch_size] for i in range(0, len(order), s.batch_size)]
        if s.drop_last and out and len(out[-1]) < s.batch_size:
            out.pop()
        return out
    if units is None:
        raise InternalError(f"batch_by={s.batch_by.value} needs per-row counts")
    target, by_examples = s.batch_size, s.batch_by is BatchBy.EXAMPLES
    out, start, count = [], 0, 0
    for i, n in enumerate(units[order].tolist()):
        if i > start:
            # examples: add the row if that lands closer to the target (|count + n - T| < |count - T|);
            # tokens: add it if the total stays within the target.
            fits = count + n / 2 < target if by_examples else count + n <= target
            if not fits:
                out.append(order[start:i])
                start, count = i, 0
        count += n
    if start < len(order):
        short = count < target if by_examples else count + budget <= target
        if not (s.drop_last and short):
            out.append(order[start:])
    return out


def plan_epoch(
    num_rows: int, units: np.ndarray | None, s: _Sampling, epoch: int, budget: int
) -> list[np.ndarray]:
    """This rank's micro-batches (arrays of row indices) for one epoch, in step order."""
    order = np.random.default_rng(s.seed + epoch).permutation(num_rows) if s.shuffle else np.arange(num_rows)
    mbs = _micro_batches(order, units, s, budget)
    rem = len(mbs) % s.world_size
    if rem and s.drop_last:
        mbs = mbs[: len(mbs) - rem]
    elif rem:
        mbs = mbs + [mbs[i % len(mbs)] for i in range(s.world_size - rem)]
    return mbs[s.rank :: s.world_size]


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
            raise PackstreamError(f"PackedDataset path {p!r:.80} is a {type(p).__name__}; pass a folder or file path")
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

_HASHED: dict[tuple[int, int, int, int, int], str] = {}
"""sha256 of cached copies hashed in this process, keyed by their (device, inode, size, mtime, ctime): any
write to a file changes its ctime, which no user call can set back, so an entry is the file's current hash."""


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


def _cached_sha256(path: str) -> str | None:
    """sha256 of the cached copy at ``path`` (hashed once per process while the file is unchanged); None if it
    is not a regular file of this user's."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or (hasattr(os, "geteuid") and st.st_uid != os.geteuid()):
        return None
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _HASHED:
        _HASHED[key] = _sha256_file(path, "cached shard")
    return _HASHED[key]


def _remember(path: str, sha: str) -> None:
    st = os.stat(path)
    _HASHED[(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)] = sha


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
            "removed or added, truncated, or replaced by another run's shard); restore the folder or re-run packstream pack"
        )
    if folder.local:
        return folder.join(s.name), False
    # Memory-mapping needs a local file: copy once into a private cache keyed by the folder's URL (see
    # docs/loader.md, "Remote folders"). A copy there is reused only if it hashes to the manifest's sha256.
    root = _private_dir(cache_dir or default_cache_dir(), "cache_dir")
    cache = _private_dir(os.path.join(root, hashlib.sha256(folder.where.encode()).hexdigest()[:16]), "cache_dir")
    dst = os.path.join(cache, s.name)
    if os.path.exists(dst) and os.path.getsize(dst) == s.bytes and _cached_sha256(dst) == s.sha256:
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
                "bytes changed after the run wrote it (or the copy was corrupted); restore the folder or re-run "
                "packstream pack"
            )
        os.replace(part, dst)
    except BaseException:
        if os.path.exists(part):
            os.remove(part)
        raise
    _remember(dst, s.sha256)
    return dst, True


def _read_schema(path: str, at: str) -> pa.Schema:
    with pa.memory_map(path) as src:
        try:
            return pa.ipc.open_stream(src).schema
        except (pa.ArrowException, OSError) as e:
            raise ContractError(
                f"{at}: not an Arrow IPC stream file (what packstream pack writes): {e}; restore the folder or "
                "re-run packstream pack"
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
        raise PackstreamError(f"split={split!r:.80}; use one of {list(SPLITS)}")
    folder = _locate(path, storage_options)
    m, names = _read_manifest(folder)
    parts, counts, opened, meta0 = [], [0], [], None
    for s in _select(folder, m, split):
        at = f"{folder.where}/{s.name}"
        local, hashed = _fetch_shard(folder, s, names, cache_dir)
        if verify and not hashed:
            got = _sha256_file(local)
            if got != s.sha256:
                raise ContractError(
                    f"{at}: check sha256 failed: the file hashes to {got[:16]}…, {MANIFEST} says {s.sha256[:16]}…: its "
                    "bytes changed after the run wrote it (a token, a mask or an offset edited); restore the folder "
                    "or re-run packstream pack"
                )
        schema = _read_schema(local, at)
        if not schema.remove_metadata().equals(SCHEMA):
            raise ContractError(f"{at}: schema {schema.remove_metadata()} differs from the packed-row contract {SCHEMA}")
        try:
            meta = read_metadata(schema)
        except ValueError as e:  # ContractError, or metadata that is not UTF-8 JSON
            raise ContractError(f"{at}: schema metadata unreadable: {e}") from None
        wrong = metadata_mismatch(meta, m, s)
        if wrong is not None:
            key, what = wrong
            whose = ("another shard's file (a copy listed twice, or renamed), or another run's" if key in PLACE_KEYS
                     else "not this run's")
            raise ContractError(
                f"{at}: schema metadata {key} {what}: the shard is {whose}; restore the folder or re-run packstream pack"
            )
        try:
            part = datasets.Dataset.from_file(local)
            table = part.data.table
            # Arrow's own structure (buffer sizes, list offsets in bounds, UTF-8): O(rows), no token is read.
            # A damaged file must fail here, not as an out-of-bounds read in the middle of training.
            table.validate(full=True)
        except (pa.ArrowException, OSError) as e:
            raise ContractError(
                f"{at}: not a valid Arrow file ({e}); it was damaged after the run wrote it: restore the folder or "
                "re-run packstream pack"
            ) from None
        measured = {"rows": part.num_rows,  # cheap: one int32 column, and the offsets of another
                    "tokens": int(pc.sum(table.column("num_tokens")).as_py() or 0),
                    "examples": int(pc.sum(pc.list_value_length(table.column("example_ids"))).as_py() or 0)}
        for key, got in measured.items():
            if got != getattr(s, key):
                raise ContractError(
                    f"{at}: {got:,} {key}, {MANIFEST} says {getattr(s, key):,}: the shard is not the one the run wrote; "
                    "restore the folder or re-run packstream pack"
                )
        parts.append(part)
        counts.append(part.num_rows)
        opened.append(s)
        meta0 = meta0 or meta
    rows = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    data = hashlib.sha256("".join(f"{s.name} {s.sha256}\n" for s in opened).encode()).hexdigest()
    return _Opened(rows=rows, metadata=meta0, manifest=m, checks=m.row_checks, where=folder.where,
                   names=tuple(s.name for s in opened), starts=np.cumsum(counts).astype(np.int64), data_sha256=data)


def _default_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class PackedDataset(torch.utils.data.IterableDataset):
    """Packed shards as an iterable of micro-batches (lists of row dicts) for one rank; resumable.

    ``path``: the ``--output`` folder of a finished ``packstream pack`` (local or any fsspec URL:
    remote shards are copied once to ``cache_dir`` so they can be memory-mapped), or shard files of
    one such folder (a path or a list). The folder's ``manifest.json`` decides what is read: it must
    say the run completed, the loader opens exactly the shards it lists for ``split``, checks each
    one's size, schema, schema metadata and row count against it (and, with ``verify=True``, its
    sha256), and refuses a folder holding ``*.arrow``/``*.parquet`` files it does not list. Every row
    :meth:`fetch` returns (so every batch iteration yields) is checked against the packed-row contract
    and the manifest's ``row_checks``; see docs/loader.md, "What the loader checks".

    * ``rows``: every row as a memory-mapped, map-style ``datasets.Dataset`` (zero-copy). Reading it
      directly skips the row checks: call :meth:`check_rows` first, or pass ``verify=True``.
    * ``manifest``: the folder's ``manifest.json``; ``shards``: the shard names opened, in row order.
    * iterating yields this rank's micro-batches of the current epoch from the current position,
      each a list of row dicts with numpy arrays, ready for :class:`packers.Collator`.
    * ``rank``/``world_size`` default to torch.distributed's when it is initialised.

    With DataLoader workers, use :meth:`dataloader`: it tracks the position in the main process
    (workers hold copies), and splits the steps over workers so that the order stays the same.
    """

    def __init__(
        self,
        path: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        split: str = "train",
        verify: bool = False,
        batch_size: int = 1,
        batch_by: BatchBy | str = BatchBy.ROWS,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        cache_dir: str | None = None,
        storage_options: dict | None = None,
    ) -> None:
        default_rank, default_world = _default_rank_world()
        try:
            batch_by = BatchBy(batch_by)
        except ValueError:
            raise PackstreamError(f"batch_by={batch_by!r}; use one of {[b.value for b in BatchBy]}") from None
        self.sampling = _Sampling(
            batch_size=batch_size,
            batch_by=batch_by,
            shuffle=shuffle,
            seed=seed,
            rank=default_rank if rank is None else rank,
            world_size=default_world if world_size is None else world_size,
            drop_last=drop_last,
        )
        opened = open_rows(path, split=split, verify=verify, cache_dir=cache_dir, storage_options=storage_options)
        self.rows, self.metadata = opened.rows, opened.metadata
        self.manifest: Manifest = opened.manifest
        self._data_sha256 = opened.data_sha256
        self.split: str = split
        self.shards: tuple[str, ...] = opened.names
        self._where, self._starts, self._checks = opened.where, opened.starts, opened.checks
        self.budget: int = opened.checks.budget
        table = self.rows.data.table
        self.num_tokens = table.column("num_tokens").to_numpy().astype(np.int64)
        self.num_examples = pc.subtract(pc.list_value_length(table.column("seq_offsets")), 1).to_numpy().astype(np.int64)
        if batch_by is BatchBy.TOKENS and batch_size < self.budget:
            raise PackstreamError(
                f"batch_size={batch_size} tokens < row budget {self.budget}: a row would not fit; use at least {self.budget}"
            )
        self._arrow = self.rows.with_format("arrow")
        self.epoch = 0
        self._position = 0
        self._tracked = False  # set by PackedLoader while it starts workers
        self._pinned = False  # set_epoch() named the current epoch; cleared when an iteration runs to its end
        self._plan_cache: tuple[int, list[np.ndarray]] | None = None

    # -- plan -------------------------------------------------------------------------------
    def _plan(self, epoch: int) -> list[np.ndarray]:
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            by = self.sampling.batch_by
            units = None if by is BatchBy.ROWS else (self.num_examples if by is BatchBy.EXAMPLES else self.num_tokens)
            self._plan_cache = (epoch, plan_epoch(len(self.rows), units, self.sampling, epoch, self.budget))
        return self._plan_cache[1]

    def __len__(self) -> int:
        """Steps (micro-batches) this rank gets in the current epoch; the same on every rank."""
        return len(self._plan(self.epoch))

    def plan(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's micro-batches of ``epoch`` (default: the current one) as arrays of row indices."""
        return list(self._plan(self.epoch if epoch is None else epoch))

    # -- reading ----------------------------------------------------------------------------
    def fetch(self, indices: Sequence[int] | np.ndarray) -> list[dict[str, Any]]:
        """Rows by global index, as dicts of numpy arrays (views into one gathered Arrow table).

        The rows are checked first (:func:`check_batch`, vectorized over the batch); a broken row raises
        :class:`ContractError` naming its shard, its row in that shard, the sequence and the check.
        """
        return self._fetch(indices, check=True)

    def _fetch(self, indices: Sequence[int] | np.ndarray, *, check: bool) -> list[dict[str, Any]]:
        indices = np.asarray(indices, dtype=np.int64)
        table = self._arrow[indices]
        b = gather(table, check=check)
        failure = b if isinstance(b, Failure) else check_batch(b, self._checks) if check else None
        if failure is not None:
            raise self._broken(indices, b, failure)
        flat = {name: np.split(b.values[name], np.cumsum(b.lengths[name])[:-1]) for name in b.values}
        example_ids, pair_ids = b.example_ids.to_pylist(), b.pair_ids.to_pylist()
        return [
            {
                "input_ids": flat["input_ids"][i],
                "loss_mask": flat["loss_mask"][i],
                "seq_offsets": flat["seq_offsets"][i],
                "example_ids": example_ids[i],
                "num_tokens": int(flat["input_ids"][i].shape[0]),
                "num_targets": int(b.num_targets[i]),
                "pair_ids": pair_ids[i],
                "sides": flat["sides"][i],
                "completion_spans": flat["completion_spans"][i],
            }
            for i in range(len(example_ids))
        ]

    def _broken(self, indices: np.ndarray, b: Batch | Failure, f: Failure) -> ContractError:
        """The error for row ``f.row`` of a gathered batch: shard file, row in the shard, sequence, check."""
        g = int(indices[f.row])
        k = int(np.searchsorted(self._starts, g, side="right")) - 1
        at = f"{self._where}/{self.shards[k]} row {g - int(self._starts[k])}"
        if f.sequence is not None and isinstance(b, Batch):
            at += f" sequence {f.sequence} ({b.example_ids[f.row][f.sequence].as_py()})"
        return ContractError(
            f"{at}: check {f.check} failed: {f.detail}. The shard is not what packstream pack wrote (its manifest "
            f"says otherwise); run packstream verify {self._where} to list every problem, and re-run packstream pack"
        )

    def check_rows(self, chunk: int = 4096) -> None:
        """Check every row as :meth:`fetch` does, in chunks of ``chunk`` rows; for code that reads ``rows`` directly."""
        for start in range(0, len(self.rows), chunk):
            self._fetch(np.arange(start, min(start + chunk, len(self.rows))), check=True)

    def _begin(self) -> None:
        """Start of an iteration. A used-up epoch rolls over to the next one, unless set_epoch() named it:
        then this iteration is empty, and the loop that calls set_epoch moves on by itself (a state saved
        right after an epoch's last batch must not make such a loop train one epoch too many)."""
        if self._position >= len(self._plan(self.epoch)):
            if self._pinned:
                self._pinned = False
            else:
                self.epoch, self._position = self.epoch + 1, 0

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        info = torch.utils.data.get_worker_info()
        if info is None:
            self._begin()
        elif not self._tracked:
            raise PackstreamError(
                "PackedDataset in a plain DataLoader with num_workers > 0: the workers' copies advance, the "
                "dataset's epoch and position do not, so every epoch would repeat and state_dict() would be stale. "
                "Use ds.dataloader(num_workers=..., collate_fn=Collator()) instead"
            )
        plan, start = self._plan(self.epoch), self._position
        for step in range(start, len(plan)):
            if info is not None and (step - start) % info.num_workers != info.id:
                continue
            if info is None:
                self._position = step + 1  # before the yield: the consumer may stop and save right after it
            yield self.fetch(plan[step])
        if info is None:
            self._pinned = False

    # -- epochs and resumption ---------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` from its start; a no-op when already in it (so a resumed position survives)."""
        self._pinned = True
        if epoch != self.epoch:
            self.epoch, self._position = epoch, 0

    @property
    def position(self) -> int:
        """Steps of the current epoch already yielded (to the consumer, with :meth:`dataloader`)."""
        return self._position

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration is, what shaped its plan, and which data it is over; plain Python values.

        ``run_id``, ``split`` and ``data_sha256`` (sha256 over the opened shards' names and their
        manifest sha256s) tie the state to the data: it resumes only a dataset over the same shards."""
        s = asdict(self.sampling)
        s["batch_by"] = self.sampling.batch_by.value
        return {"epoch": self.epoch, "position": self._position, "num_rows": len(self.rows), **s,
                "run_id": self.manifest.run_id, "split": self.split, "data_sha256": self._data_sha256}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``; the data, the plan options and the world size must match the saved ones, and
        ``(epoch, position)`` must be a place in this plan (0 <= position <= the epoch's steps).

        Every rank is at the same (epoch, position), so one rank's state (say rank 0's) resumes all.
        """
        if not isinstance(state, Mapping):
            raise PackstreamError(f"cannot resume: the state is a {type(state).__name__}, expected the dict "
                                  "PackedDataset.state_dict() returns")
        mine = self.state_dict()
        lacking = [k for k in mine if k not in state]
        if lacking:
            raise PackstreamError(
                f"cannot resume: the state lacks {lacking}; it was saved by an older packstream or is not a "
                "PackedDataset state. Start the epoch afresh (set_epoch) instead of loading it"
            )
        data = _differences(state, mine, ("run_id", "split", "data_sha256", "num_rows"))
        if data:
            raise PackstreamError(
                f"cannot resume: the state was saved over other data (saved vs current: {data}); a state resumes only "
                f"the folder and split it was saved on ({self._where}, split {self.split!r} here)"
            )
        same = ("epoch", "position", "rank")
        diff = _differences(state, mine, [k for k in mine if k not in same])
        if diff:
            raise PackstreamError(
                f"cannot resume: saved vs current: {diff}; the plan depends on these, so resume with the same "
                "data, world size and batching options"
            )
        epoch, position = state["epoch"], state["position"]
        if not _is_count(epoch):
            raise PackstreamError(f"cannot resume: epoch is {_short(epoch)}, expected an integer >= 0")
        if not _is_count(position):
            raise PackstreamError(f"cannot resume: position is {_short(position)}, expected an integer >= 0 (the "
                                  "steps of the epoch already taken)")
        steps = len(self._plan(int(epoch)))
        if position > steps:
            raise PackstreamError(f"cannot resume: position {int(position)} is past the end of epoch {int(epoch)}, "
                                  f"which has {steps} steps on each rank; the state is not this dataset's")
        self.epoch, self._position = int(epoch), int(position)

    def dataloader(self, **kwargs: Any) -> "PackedLoader":
        """A ``torch.utils.data.DataLoader`` over this dataset that keeps its position exact with workers.

        Pass ``collate_fn=packers.Collator(...)`` (runs in the workers; without it the loader yields
        the lists of rows) and any DataLoader option except ``batch_size``/``sampler``/``persistent_workers``.
        """
        return PackedLoader(self, **kwargs)


def _as_is(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return rows


class PackedLoader(torch.utils.data.DataLoader):
    """DataLoader for a :class:`PackedDataset`: counts the batches it hands out, in the main process.

    Workers each produce every ``num_workers``-th step of the plan, and the DataLoader returns
    them round-robin, i.e. in step order; the dataset's position advances as each batch leaves
    this loader. ``state_dict``/``load_state_dict``/``set_epoch`` delegate to the dataset.
    """

    def __init__(self, dataset: PackedDataset, **kwargs: Any) -> None:
        for key in ("batch_size", "sampler", "batch_sampler", "shuffle", "drop_last"):
            if kwargs.pop(key, None) is not None:
                raise PackstreamError(f"PackedLoader: {key}= belongs to PackedDataset(...), the dataset yields batches")
        if kwargs.pop("persistent_workers", False):
            raise PackstreamError(
                "PackedLoader: persistent_workers=True would keep the workers' stale epoch and position; leave it off"
            )
        kwargs.setdefault("collate_fn", _as_is)  # not torch's default_convert: rows stay numpy, read-only views
        super().__init__(dataset, batch_size=None, **kwargs)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        ds: PackedDataset = self.dataset  # type: ignore[assignment]
        if self.num_workers == 0:
            yield from super().__iter__()  # the dataset, iterated here, tracks itself
            return
        ds._begin()
        ds._tracked = True
        try:
            it = super().__iter__()  # starts the workers with copies of ds as it is now
        finally:
            ds._tracked = False
        for batch in it:
            ds._position += 1
            yield batch
        ds._pinned = False

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]
