"""Read packed shards for training: memory-mapped rows, planned epochs, rank sharding, loss weights, exact resume.

Each epoch follows a plan made before it starts (:mod:`packers._plan`), the same on every rank
without communication: every example exactly once, every rank the same number of steps, each step's
rows dealt so that its most loaded rank is close to its mean (``balance``), the steps in an order
where the index does not predict length. Step ``s`` on rank ``r`` is micro-batch ``(s, r)`` of the plan.

A micro-batch holds ``batch_size`` units of ``batch_by``:

* ``rows``: ``batch_size`` rows (fewer in the epoch's last step);
* ``examples``: a step takes rows while that brings its packed examples closer to ``batch_size x
  world_size``, so a step holds about as many examples as a padded run with that batch size: offline
  packing into fewer rows otherwise means fewer, larger optimizer steps, which hurts convergence at equal
  epochs (arXiv 2407.09105);
* ``tokens``: rows are added while every micro-batch stays within ``batch_size`` tokens, a memory cap.

Every row of a micro-batch carries ``loss_weights`` (per token: what it counts in its optimizer step's
loss, the global denominator already divided in) and ``loss_denominator``; :class:`packers.Collator`
puts the weights in the batch and :func:`packers.loss` applies them.

``state_dict()`` is ``(epoch, position)`` (steps consumed in the epoch) plus the options that shape the
plan; restoring it gives the same next batches as an uninterrupted run.
"""

from __future__ import annotations

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

from packers.errors import ContractError, PackstreamError, parse_enum
from packers.files import check_regular, open_checked, show_path
from packers.manifest import (
    LOCK,
    MANIFEST,
    SHARD_NAME,
    SPLITS,
    TMP_PREFIX,
    Manifest,
    RowChecks,
    ShardEntry,
    escape_source,
    is_datasets_cache,
    load_manifest,
    metadata_mismatch,
    missing_manifest,
    require_complete,
)
from packers._plan import (
    Balance,
    BatchBy,
    CostModel,
    LossWeighting,
    Plan,
    Rows,
    Sampling,
    is_count,
    plan_epoch,
    short,
    step_denominators,
)

from packers.rowcheck import Batch, Failure, check_batch, gather
from packers.schema import PLACE_KEYS, SCHEMA, count_targets, read_metadata


def _differences(saved: Mapping[str, Any], current: Mapping[str, Any], keys: Sequence[str]) -> str:
    """``"seed -5 vs 3, world_size 2 vs 1"``: the keys whose saved and current values differ ('' if none)."""
    return ", ".join(f"{k} {short(saved[k])} vs {short(current[k])}" for k in keys
                     if saved[k] != current[k] or type(saved[k]) is not type(current[k]))


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


# -- what the plan and the loss weights need from the rows (computed once per PackedDataset) -----------------


def _row_facts(table: pa.Table, grain: int = 1) -> Rows:
    """Each row's tokens and its examples' lengths, from ``num_tokens`` and ``seq_offsets`` (no token read)."""
    offsets = table.column("seq_offsets")
    counts = pc.list_value_length(offsets).to_numpy(zero_copy_only=False).astype(np.int64)  # sequences + 1
    flat = np.concatenate([c.flatten().to_numpy() for c in offsets.chunks] or [np.zeros(0, np.int32)]).astype(np.int64)
    ends = np.cumsum(counts)
    inside = np.ones(max(len(flat) - 1, 0), dtype=bool)  # pairs (offs[j], offs[j + 1]) within one row
    inside[ends[:-1] - 1] = False
    seq_lens = np.maximum(np.diff(flat)[inside], 0)  # a damaged row's are refused when it is read
    seq_start = np.concatenate([[0], np.cumsum(counts - 1)]).astype(np.int64)
    tokens = table.column("num_tokens").to_numpy().astype(np.int64)
    return Rows(tokens=tokens, seq_start=seq_start, seq_lens=seq_lens, grain=grain)


def _sequence_targets(table: pa.Table) -> np.ndarray:
    """Each sequence's trained tokens (int64, sequences numbered across rows as in :func:`_row_facts`): its
    ``loss_mask`` ones, less its first token's (an example's first token is never a target: nothing before
    it predicts it). One pass over the memory-mapped ``loss_mask`` column, a record batch at a time.

    The only place these counts come from, so that a shard column holding them can replace this pass."""
    out = []
    for batch in table.select(["loss_mask", "seq_offsets"]).to_batches():
        if not batch.num_rows:
            continue
        mask = batch.column(0).flatten().to_numpy(zero_copy_only=False)
        offs = batch.column(1)
        counts = pc.list_value_length(offs).to_numpy(zero_copy_only=False).astype(np.int64)
        flat = offs.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
        token_base = np.concatenate([[0], np.cumsum(pc.list_value_length(batch.column(0)).to_numpy(zero_copy_only=False))[:-1]])
        starts = flat + np.repeat(token_base, counts)  # each offset as a position in `mask`
        ends = np.cumsum(counts)
        first = np.ones(len(flat), dtype=bool)
        first[ends - 1] = False  # the last offset of a row ends it, starts nothing
        # A damaged shard may hold offsets outside its row: clipped here (the counts only weigh the loss), and the
        # row itself is refused with its shard, row and check when it is read (check_batch).
        seq_starts = np.clip(starts[first], 0, max(len(mask) - 1, 0))
        if not len(seq_starts):
            continue
        sums = np.add.reduceat(mask.astype(np.int64), seq_starts) if len(mask) else np.zeros(len(seq_starts), np.int64)
        out.append(sums - (mask[seq_starts] if len(mask) else 0))
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)


def _sequence_sources(table: pa.Table, manifest: dict[str, Any], where: str) -> tuple[np.ndarray, list[str]]:
    """Each sequence's data set (an index into the returned names), from its example id's source and the
    manifest's ``inputs`` (source -> data set) and ``config.config`` (the ``--config`` data sets, in order)."""
    inputs = manifest.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ContractError(
            f"{where}: {MANIFEST} lists no 'inputs', so example ids cannot be traced to their data sets; "
            "loss_weighting='source' needs a folder written by packstream pack"
        )
    specs = ((manifest.get("config") or {}).get("config")) or [{"name": "default"}]
    names = [str(d.get("name", f"dataset{i}")) for i, d in enumerate(specs)]
    source_of = {}
    for f in inputs:
        if isinstance(f, dict) and isinstance(f.get("source"), str):
            source_of[escape_source(f["source"])] = int(f.get("dataset") or 0)
    ids = pc.list_flatten(table.column("example_ids"))
    prefix = pc.struct_field(pc.extract_regex(ids, r"^(?P<source>[^:@]*)"), "source")
    known = pa.array(sorted(source_of), pa.string())
    where_in = pc.index_in(prefix, value_set=known)
    if where_in.null_count:
        bad = pc.filter(ids, pc.is_null(where_in))[0].as_py()
        raise ContractError(f"{where}: example {bad!r} names a source that {MANIFEST}'s inputs do not list; "
                            "re-run packstream pack")
    dataset_of_known = np.array([source_of[k] for k in known.to_pylist()], dtype=np.int64)
    return dataset_of_known[where_in.to_numpy(zero_copy_only=False).astype(np.int64)], names


def _piece(row: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    """Sequences ``lo..hi-1`` of a fetched row as a row of their own (the plan cuts rows only where an example ends:
    in a row of pairs, between two pairs)."""
    offs = row["seq_offsets"]
    a, z = int(offs[lo]), int(offs[hi])
    mask = row["loss_mask"][a:z]
    piece_offs = offs[lo : hi + 1] - offs[lo]
    spans = np.asarray(row.get("completion_spans", ()), dtype=np.int64)
    return {**row, "input_ids": row["input_ids"][a:z], "loss_mask": mask, "seq_offsets": piece_offs,
            "example_ids": row["example_ids"][lo:hi], "num_tokens": z - a,
            "num_targets": count_targets(mask, piece_offs),
            "pair_ids": list(row.get("pair_ids") or ())[lo:hi], "sides": np.asarray(row.get("sides", ()))[lo:hi],
            "completion_spans": (spans[2 * lo : 2 * hi] - a).astype(np.int32) if len(spans) else spans.astype(np.int32)}


class PackedDataset(torch.utils.data.IterableDataset):
    """Packed shards as an iterable of micro-batches (lists of row dicts) for one rank; planned, resumable.

    ``path``: the ``--output`` folder of a finished ``packstream pack`` (local or any fsspec URL:
    remote shards are copied once to ``cache_dir`` so they can be memory-mapped), or shard files of
    one such folder (a path or a list). The folder's ``manifest.json`` decides what is read: it must
    say the run completed, the loader opens exactly the shards it lists for ``split``, checks each
    one's size, schema, schema metadata and row count against it (and, with ``verify=True``, its
    sha256), and refuses a folder holding ``*.arrow``/``*.parquet`` files it does not list. Every row
    :meth:`fetch` returns (so every batch iteration yields) is checked against the packed-row contract
    and the manifest's ``row_checks``; see docs/loader.md, "What the loader checks".

    Each epoch follows a plan (:mod:`packers._plan`): every example exactly once, ``len(ds)`` steps on
    every rank, known before the epoch; ``balance`` deals each step's rows so that no rank waits long
    for another (``"compute"``: by ``cost``, a :class:`packers.CostModel`; ``"tokens"``; ``"none"``);
    ``rebatch`` forms new micro-batches every epoch. ``grad_accum`` micro-batches per rank make an
    optimizer step, whose loss denominator (``loss_weighting``: ``"token"``, ``"example"`` or
    ``"source"``, weighted by ``source_weights`` or the ``--config`` data sets' ``loss_weight``) comes
    with every row as ``loss_weights``.

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
        grad_accum: int = 1,
        balance: Balance | str = Balance.COMPUTE,
        cost: CostModel | None = None,
        rebatch: bool = True,
        loss_weighting: LossWeighting | str = LossWeighting.TOKEN,
        source_weights: dict[str, float] | None = None,
        cache_dir: str | None = None,
        storage_options: dict | None = None,
        drop_last: bool | None = None,
    ) -> None:
        if drop_last is not None:
            raise PackstreamError(
                "drop_last is gone: every epoch's plan trains every example exactly once and gives every rank the "
                "same number of steps (nothing repeated, nothing dropped); remove drop_last="
            )
        default_rank, default_world = _default_rank_world()
        batch_by, balance, loss_weighting = (parse_enum(BatchBy, batch_by, "batch_by"), parse_enum(Balance, balance, "balance"),
                                             parse_enum(LossWeighting, loss_weighting, "loss_weighting"))
        if cost is not None and not isinstance(cost, CostModel):
            raise PackstreamError(f"cost={cost!r}; pass a packers.CostModel (e.g. CostModel.from_config(model.config))")
        self.sampling = Sampling(
            batch_size=batch_size,
            batch_by=batch_by,
            shuffle=shuffle,
            seed=seed,
            rank=default_rank if rank is None else rank,
            world_size=default_world if world_size is None else world_size,
            grad_accum=grad_accum,
            balance=balance,
            cost=cost or CostModel(),
            rebatch=rebatch,
        )
        self.loss_weighting: LossWeighting = loss_weighting
        opened = open_rows(path, split=split, verify=verify, cache_dir=cache_dir, storage_options=storage_options)
        self.rows, self.metadata = opened.rows, opened.metadata
        self.manifest: Manifest = opened.manifest
        self._data_sha256 = opened.data_sha256
        self.split: str = split
        self.shards: tuple[str, ...] = opened.names
        self._where, self._starts, self._checks = opened.where, opened.starts, opened.checks
        self.budget: int = opened.checks.budget
        if batch_by is BatchBy.TOKENS and batch_size < self.budget:
            raise PackstreamError(
                f"batch_size={batch_size} tokens < row budget {self.budget}: a row would not fit; use at least {self.budget}"
            )
        self._arrow = self.rows.with_format("arrow")
        table = self.rows.data.table
        grain = 2 if self.manifest.row_checks is not None and self.manifest.row_checks.pairs else 1
        self._facts = _row_facts(table, grain)
        self.num_tokens = self._facts.tokens
        self.num_examples = np.diff(self._facts.seq_start) // grain  # pairs in a row of pairs
        # What each target token of each sequence weighs, and what it adds to its step's denominator.
        targets = _sequence_targets(table)
        if loss_weighting is LossWeighting.TOKEN:
            weight = np.ones(len(targets))
        elif loss_weighting is LossWeighting.EXAMPLE:
            weight = np.divide(1.0, targets, out=np.zeros(len(targets)), where=targets > 0)
        else:
            weight = self._source_weights(table, source_weights)[0]
        if source_weights is not None and loss_weighting is not LossWeighting.SOURCE:
            raise PackstreamError(f"source_weights= is read with loss_weighting='source' only, got {loss_weighting.value!r}")
        self._seq_weight = weight
        self._seq_denominator = (targets > 0).astype(np.float64) if loss_weighting is LossWeighting.EXAMPLE \
            else weight * targets
        self.epoch = 0
        self._position = 0
        self._tracked = False  # set by PackedLoader while it starts workers
        self._pinned = False  # set_epoch() named the current epoch; cleared when an iteration runs to its end
        self._plan_cache: tuple[int, Plan, np.ndarray] | None = None

    def _source_weights(self, table: pa.Table, given: dict[str, float] | None) -> tuple[np.ndarray, dict[str, float]]:
        """Per sequence, its data set's loss weight: ``given`` by name, else the ``--config`` data sets' ``loss_weight``."""
        dataset, names = _sequence_sources(table, self.manifest.raw, self._where)
        specs = ((self.manifest.config or {}).get("config")) or [{}]
        weights = {n: float(d.get("loss_weight", 1.0)) if isinstance(d, dict) else 1.0 for n, d in zip(names, specs)}
        if given is not None:
            unknown = sorted(set(given) - set(weights))
            if unknown:
                raise PackstreamError(f"source_weights names {unknown}, not data sets of this run; its data sets: {names}")
            missing = sorted(set(names) - set(given))
            if missing:
                raise PackstreamError(f"source_weights has no weight for {missing}; give every data set one: {names}")
            weights = {n: given[n] for n in names}
        for n, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not np.isfinite(w) or w < 0:
                raise PackstreamError(f"loss weight {w!r} of data set {n!r} must be a finite number >= 0")
        return np.array([weights[n] for n in names], dtype=np.float64)[dataset], weights

    # -- plan -------------------------------------------------------------------------------
    def _plan(self, epoch: int) -> tuple[Plan, np.ndarray]:
        """The epoch's plan (all ranks) and its optimizer steps' loss denominators; the last epoch's is cached."""
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            plan = plan_epoch(self._facts, self.sampling, epoch)
            self._plan_cache = (epoch, plan, step_denominators(plan, self._facts, self._seq_denominator))
        return self._plan_cache[1], self._plan_cache[2]

    def __len__(self) -> int:
        """Steps (micro-batches) this rank gets in the current epoch; the same on every rank, exact before it starts."""
        return self._plan(self.epoch)[0].steps

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps in the current epoch: ``grad_accum`` micro-batches each (the last one possibly fewer)."""
        return self._plan(self.epoch)[0].optimizer_steps

    def plan(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's micro-batches of ``epoch`` (default: the current one) as arrays of row indices, in step
        order. A row the plan divided at an example boundary appears in the two micro-batches holding its pieces."""
        plan, _ = self._plan(self.epoch if epoch is None else epoch)
        r = self.sampling.rank
        return [plan.units.row[plan.micro_batch(s, r)] for s in range(plan.steps)]

    def loss_denominators(self, epoch: int | None = None) -> np.ndarray:
        """Each optimizer step's global loss denominator in ``epoch`` (the same on every rank): its target tokens
        (``token``), examples with a target (``example``) or weighted target tokens (``source``)."""
        return self._plan(self.epoch if epoch is None else epoch)[1].copy()

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

    def micro_batch(self, step: int, epoch: int | None = None) -> list[dict[str, Any]]:
        """This rank's micro-batch ``step`` of ``epoch`` (default: the current one): its rows (or row pieces),
        checked, each with ``loss_weights`` (float32 per token: its weight in the optimizer step's loss, the
        global denominator and the world size divided in; 0 off target) and ``loss_denominator``."""
        plan, denominators = self._plan(self.epoch if epoch is None else epoch)
        units = plan.micro_batch(step, self.sampling.rank)
        u = plan.units
        rows = self.fetch(u.row[units])
        denominator = float(denominators[step // plan.grad_accum])
        scale = plan.world_size / denominator if denominator > 0 else 0.0
        out = []
        for row, r, lo, hi in zip(rows, u.row[units].tolist(), u.lo[units].tolist(), u.hi[units].tolist()):
            offs = row["seq_offsets"]
            if lo != 0 or hi != len(offs) - 1:  # a piece of the row: its sequences lo..hi-1 (whole pairs)
                row = _piece(row, lo, hi)
                offs = row["seq_offsets"]
            base = int(self._facts.seq_start[r]) + lo
            lens = np.diff(offs)
            target = row["loss_mask"].astype(np.float32)
            target[offs[:-1]] = 0.0  # an example's first token is never a target (Collator's labels agree)
            weights = np.repeat(self._seq_weight[base : base + len(lens)], lens).astype(np.float32)
            out.append({**row, "loss_weights": weights * target * np.float32(scale), "loss_denominator": denominator})
        return out

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
        if self._position >= len(self):
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
        start, steps = self._position, len(self)
        for step in range(start, steps):
            if info is not None and (step - start) % info.num_workers != info.id:
                continue
            if info is None:
                self._position = step + 1  # before the yield: the consumer may stop and save right after it
            yield self.micro_batch(step)
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
        for k in ("batch_by", "balance"):
            s[k] = getattr(self.sampling, k).value
        return {"epoch": self.epoch, "position": self._position, "num_rows": len(self.rows),
                "loss_weighting": self.loss_weighting.value, **s,
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
        if not is_count(epoch):
            raise PackstreamError(f"cannot resume: epoch is {short(epoch)}, expected an integer >= 0")
        if not is_count(position):
            raise PackstreamError(f"cannot resume: position is {short(position)}, expected an integer >= 0 (the "
                                  "steps of the epoch already taken)")
        steps = self._plan(int(epoch))[0].steps
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
        try:
            for batch in it:
                ds._position += 1
                yield batch
        finally:  # an error or a loop left early: the workers stop now, not when the iterator is collected
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        ds._pinned = False

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)  # type: ignore[attr-defined]

    def state_dict(self) -> dict[str, Any]:
        return self.dataset.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)  # type: ignore[attr-defined]
