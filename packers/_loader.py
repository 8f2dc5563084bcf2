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
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.utils.data

from packers._errors import ContractError, InternalError, PackstreamError
from packers._manifest import (
    LOCK,
    MANIFEST,
    SHARD_NAME,
    SPLITS,
    TMP_PREFIX,
    RowChecks,
    expected_metadata,
    is_datasets_cache,
    listed_shards,
    missing_manifest,
    parse_manifest,
    require_complete,
    row_checks,
    unlisted,
)
from packers._rowcheck import Batch, Failure, gather, check_batch
from packers._schema import SCHEMA, read_metadata


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
        if self.batch_size < 1:
            raise PackstreamError(f"batch_size={self.batch_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise PackstreamError(f"rank={self.rank} must be in [0, world_size={self.world_size})")


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


def _sha256_file(path: str) -> str:
    with open(path, "rb") as f:
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
        fs, root = fsspec.core.url_to_fs(os.fspath(p), **(storage_options or {}))
        root = root.rstrip("/") or "/"
        if fs.isdir(root):
            found.append((fs, root, None))
        elif fs.exists(root):
            found.append((fs, posixpath.dirname(root), posixpath.basename(root)))
        else:
            raise PackstreamError(f"{os.fspath(p)} does not exist; pass the --output folder of packstream pack")
    fs, root = found[0][0], found[0][1]
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    local = "file" in protocols
    where = root if local else fs.unstrip_protocol(root)
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


def _read_manifest(folder: _Folder) -> tuple[dict[str, Any], list[str]]:
    """The folder's complete manifest and its file names; refuses a folder that is not a finished run's."""
    names = sorted(posixpath.basename(p.rstrip("/")) for p in folder.fs.ls(folder.root, detail=False))
    if MANIFEST not in names:
        raise missing_manifest(folder.where, names)
    m = require_complete(parse_manifest(folder.fs.cat_file(folder.join(MANIFEST)), folder.where), folder.where)
    if LOCK in names:
        raise ContractError(
            f"{folder.where}: {LOCK} is present: a packstream run (pack --overwrite) is rewriting this folder, so its "
            f"files may not be the ones {MANIFEST} lists. Wait for the run to finish; if none is running (it was "
            f"killed), re-run packstream pack --overwrite"
        )
    stray = [n for n in unlisted(names, m) if not is_datasets_cache(n)]
    if stray:
        n = stray[0]
        why = (
            "a temporary file of an interrupted packstream write" if n.startswith(TMP_PREFIX)
            else "a shard of another run (its name is not one of this run's)" if SHARD_NAME.match(n)
            else "not a shard of this run (a backup, a copy, or another run's file)"
        )
        more = f" (and {len(stray) - 1} more: {stray[1:4]})" if len(stray) > 1 else ""
        raise ContractError(
            f"{folder.where}: {n}: not listed in {MANIFEST}{more}; it is {why}. PackedDataset reads exactly the "
            f"listed shards and refuses a folder that holds others: remove it, or re-run packstream pack --overwrite"
        )
    return m, names


def _select(folder: _Folder, m: dict[str, Any], split: str) -> list[dict[str, Any]]:
    """The manifest entries to open: every shard of ``split``, or the files asked for (which must be listed)."""
    if folder.files is None:
        entries = listed_shards(m, split)
        if not entries:
            have = sorted({s.get("split", "train") for s in m["shards"]})
            hint = (f"; it lists {have} shards: pass split={have[0]!r}" if have
                    else "; the run packed no rows (see the counts in manifest.json and rejected.jsonl)")
            raise ContractError(f"{folder.where}: {MANIFEST} lists no {split!r} shards{hint}")
        return entries
    by_name = {s["name"]: s for s in m["shards"]}
    entries = []
    for n in folder.files:
        s = by_name.get(n)
        if s is None:
            raise ContractError(
                f"{folder.where}/{n}: not a shard listed in {MANIFEST}; pass the folder, or shard files it lists "
                f"({sorted(by_name)[:3]}{' ...' if len(by_name) > 3 else ''})"
            )
        if s.get("split", "train") != split:
            raise PackstreamError(
                f"{folder.where}/{n}: a {s.get('split', 'train')!r} shard, and this PackedDataset reads split={split!r}; "
                f"pass split={s.get('split', 'train')!r}"
            )
        entries.append(s)
    return sorted(entries, key=lambda s: s["name"])


def _fetch_shard(folder: _Folder, s: dict[str, Any], names: list[str], cache_dir: str | None) -> tuple[str, bool]:
    """A local, size-checked path for the listed shard ``s``; remote shards are copied into a cache (and hashed
    on the way: the copy is checked against the manifest's sha256). Returns (path, sha256 already checked)."""
    name = s["name"]
    at = f"{folder.where}/{name}"
    if name not in names:
        raise ContractError(
            f"{at}: listed in {MANIFEST} but missing from the folder ({s['rows']} rows lost); copy the whole output "
            "folder, or re-run packstream pack"
        )
    if name.endswith(".parquet"):
        raise PackstreamError(
            f"{at}: Parquet shards cannot be memory-mapped; pack with --output-format arrow (the default), or read "
            "them with datasets.load_dataset('parquet', ...) and packers.Collator"
        )
    size = int(folder.fs.size(folder.join(name)))
    if size != s["bytes"]:
        raise ContractError(
            f"{at}: {size:,} bytes, {MANIFEST} says {s['bytes']:,}: the shard was changed after the run wrote it (rows "
            "removed or added, truncated, or replaced by another run's shard); restore the folder or re-run packstream pack"
        )
    if folder.local:
        return folder.join(name), False
    # Memory-mapping needs a local file: copy once into a cache keyed by the folder's URL. A copy is reused
    # only if it is the manifest's (same size, and the sha256 recorded beside it is the manifest's).
    cache = os.path.join(cache_dir or os.path.join(tempfile.gettempdir(), "packstream-cache"),
                         hashlib.sha256(folder.where.encode()).hexdigest()[:16])
    os.makedirs(cache, exist_ok=True)
    dst, stamp = os.path.join(cache, name), os.path.join(cache, name + ".sha256")
    if os.path.exists(dst) and os.path.getsize(dst) == size and os.path.exists(stamp):
        with open(stamp) as f:
            if f.read().strip() == s["sha256"]:
                return dst, False
    part = f"{dst}.{os.getpid()}.part"  # several ranks of one host may copy at once
    h = hashlib.sha256()
    with folder.fs.open(folder.join(name), "rb") as src, open(part, "wb") as out:
        while chunk := src.read(_HASH_CHUNK):
            h.update(chunk)
            out.write(chunk)
    if h.hexdigest() != s["sha256"]:
        os.remove(part)
        raise ContractError(
            f"{at}: sha256 of the copy is {h.hexdigest()[:16]}…, {MANIFEST} says {s['sha256'][:16]}…: the shard's "
            "bytes changed after the run wrote it (or the copy was corrupted); restore the folder or re-run packstream pack"
        )
    os.replace(part, dst)
    with open(stamp + f".{os.getpid()}", "w") as f:
        f.write(s["sha256"])
    os.replace(stamp + f".{os.getpid()}", stamp)
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
    metadata: dict[str, Any]  # the shards' schema metadata (all equal)
    manifest: dict[str, Any]
    checks: RowChecks
    where: str
    names: tuple[str, ...]  # the opened shards' names
    starts: np.ndarray  # global index of each shard's first row, plus the total


def open_rows(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    split: str = "train",
    verify: bool = False,
    cache_dir: str | None = None,
    storage_options: dict | None = None,
) -> _Opened:
    """Open the shards a complete manifest lists as one memory-mapped ``datasets.Dataset`` (zero-copy).

    Checks each shard's size, schema, schema metadata and row count against ``manifest.json`` (and its
    sha256 with ``verify``); every refusal is a :class:`ContractError`/:class:`PackstreamError` naming
    the folder or shard, what differs, and the fix.
    """
    import datasets

    if split not in SPLITS:
        raise PackstreamError(f"split={split!r}; use one of {list(SPLITS)}")
    folder = _locate(path, storage_options)
    m, names = _read_manifest(folder)
    checks, expect = row_checks(m, folder.where), expected_metadata(m, folder.where)
    parts, counts, opened, meta0 = [], [0], [], None
    for s in _select(folder, m, split):
        at = f"{folder.where}/{s['name']}"
        local, hashed = _fetch_shard(folder, s, names, cache_dir)
        if verify and not hashed:
            got = _sha256_file(local)
            if got != s["sha256"]:
                raise ContractError(
                    f"{at}: check sha256 failed: the file hashes to {got[:16]}…, {MANIFEST} says {s['sha256'][:16]}…: its "
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
        for key, want in expect.items():
            if meta.get(key) != want:
                raise ContractError(
                    f"{at}: schema metadata {key} is {meta.get(key)!r}, {MANIFEST} says {want!r}: the shard is not "
                    "this run's; restore the folder or re-run packstream pack"
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
        measured = {"rows": part.num_rows}
        if isinstance(s.get("tokens"), int):  # cheap: one int32 column, and the offsets of another
            measured["tokens"] = int(pc.sum(table.column("num_tokens")).as_py() or 0)
        if isinstance(s.get("examples"), int):
            measured["examples"] = int(pc.sum(pc.list_value_length(table.column("example_ids"))).as_py() or 0)
        for key, got in measured.items():
            if got != s[key]:
                raise ContractError(
                    f"{at}: {got:,} {key}, {MANIFEST} says {s[key]:,}: the shard is not the one the run wrote; "
                    "restore the folder or re-run packstream pack"
                )
        parts.append(part)
        counts.append(part.num_rows)
        opened.append(s["name"])
        meta0 = meta0 or meta
    rows = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return _Opened(rows=rows, metadata=meta0, manifest=m, checks=checks, where=folder.where, names=tuple(opened),
                   starts=np.cumsum(counts).astype(np.int64))


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
        self.rows, self.metadata, self.manifest = opened.rows, opened.metadata, opened.manifest
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
        """Where the iteration is, plus what shaped its plan; plain Python values."""
        s = asdict(self.sampling)
        s["batch_by"] = self.sampling.batch_by.value
        return {"epoch": self.epoch, "position": self._position, "num_rows": len(self.rows), **s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``; the plan options and the data must match the saved ones.

        Every rank is at the same (epoch, position), so one rank's state (say rank 0's) resumes all.
        """
        mine = self.state_dict()
        same = ("epoch", "position", "rank")
        diff = {k: (state.get(k), mine[k]) for k in mine if k not in same and state.get(k) != mine[k]}
        if diff:
            raise PackstreamError(
                f"cannot resume: saved vs current {diff}; the plan depends on these, so resume with the same "
                "data, world size and batching options"
            )
        self.epoch, self._position = int(state["epoch"]), int(state["position"])

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
