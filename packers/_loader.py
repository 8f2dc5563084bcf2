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
    escape_source,
    expected_metadata,
    is_datasets_cache,
    listed_shards,
    missing_manifest,
    parse_manifest,
    require_complete,
    row_checks,
    unlisted,
)
from packers._plan import (
    Balance,
    BatchBy,
    CostModel,
    LossWeighting,
    Plan,
    Rows,
    Sampling,
    plan_epoch,
    step_denominators,
)
from packers._schema import SCHEMA, read_metadata


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


# -- reading: every gathered batch is checked against the contract and the manifest's row_checks ----------


@dataclass(frozen=True)
class _Batch:
    """A gathered batch of rows as flat numpy arrays: ``values[name]`` back to back, ``lengths[name]`` per row."""

    values: dict[str, np.ndarray]  # input_ids, loss_mask, seq_offsets
    lengths: dict[str, np.ndarray]  # input_ids, loss_mask, seq_offsets
    num_tokens: np.ndarray
    example_ids: Any  # the gathered example_ids (a ChunkedArray of lists)


@dataclass(frozen=True)
class _Failure:
    """The first broken row of a batch: its index in the batch, the sequence (if the check is per sequence)."""

    row: int
    check: str
    detail: str
    sequence: int | None = None


def _gather(table: pa.Table, *, check: bool) -> _Batch | _Failure:
    """The batch's columns as flat numpy arrays; with ``check``, first the first row holding a null (the
    schema says non-null, but a damaged file may hold them anyway, and numpy cannot view them)."""
    cols = {name: table.column(name).combine_chunks() for name in ("input_ids", "loss_mask", "seq_offsets")}
    if check:
        example_ids, num_tokens = table.column("example_ids"), table.column("num_tokens")
        if num_tokens.null_count:
            row = int(np.flatnonzero(num_tokens.is_null().to_numpy(zero_copy_only=False))[0])
            return _Failure(row, "nulls", "num_tokens is null")
        if example_ids.null_count or pc.list_flatten(example_ids).null_count:
            cols["example_ids"] = example_ids.combine_chunks()
        for name, col in cols.items():
            if col.null_count:
                return _Failure(int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0]), "nulls",
                                f"{name} is null")
            if col.values.null_count:  # a null inside a list: its row is where the list offsets put it
                t = int(np.flatnonzero(col.values.is_null().to_numpy(zero_copy_only=False))[0])
                row = int(np.searchsorted(col.offsets.to_numpy(), t, side="right")) - 1
                return _Failure(row, "nulls", f"{name} holds a null value")
    return _Batch(
        values={name: col.flatten().to_numpy() for name, col in cols.items()},
        lengths={name: pc.list_value_length(col).to_numpy() for name, col in cols.items()},
        num_tokens=table.column("num_tokens").to_numpy(),
        example_ids=table.column("example_ids"),
    )


def check_batch(b: _Batch, checks: RowChecks) -> _Failure | None:
    """A row of ``b`` that breaks the packed-row contract or the run's ``row_checks`` (the first one the
    first failing check finds), else None.

    Vectorized: a few numpy passes over the batch's tokens and offsets, no per-token Python. Checks:
    ``num_tokens`` = len(input_ids) <= ``budget``; len(loss_mask) = len(input_ids); one example id per
    sequence; ``seq_offsets`` start at 0, increase strictly, end at len(input_ids); ``loss_mask`` in
    {0, 1}; then what the manifest says every row of the run satisfies: ``eos_at_boundaries``,
    ``targets_in_every_sequence``, ``all_targets`` (see :mod:`packers._manifest`).
    """
    L, M = b.lengths["input_ids"].astype(np.int64), b.lengths["loss_mask"]
    O, E = b.lengths["seq_offsets"].astype(np.int64), pc.list_value_length(b.example_ids).to_numpy()
    ids, mask, offs = b.values["input_ids"], b.values["loss_mask"], b.values["seq_offsets"]
    budget = checks.budget
    if not len(L):
        return None

    # Each test is one numpy pass over the batch, with `.any()` first: a good batch (the common case) pays no
    # search. Batches are small (a few rows), so numpy's per-call overhead is most of the cost: tests of one
    # kind are or-ed into one pass, and the first failing row is then diagnosed with scalars.
    def first(bad: np.ndarray) -> int:
        return int(bad.argmax())  # the first True (callers have checked that there is one)

    if (bad := (b.num_tokens != L) | (L > budget) | (M != L) | (O < 1) | (E != O - 1)).any():
        i = first(bad)
        n, m, o, e, nt = int(L[i]), int(M[i]), int(O[i]), int(E[i]), int(b.num_tokens[i])
        if nt != n:
            return _Failure(i, "num_tokens", f"num_tokens is {nt}, input_ids has {n} tokens")
        if n > budget:
            return _Failure(i, "budget", f"{n} tokens > budget {budget}")
        if m != n:
            return _Failure(i, "loss_mask_length", f"loss_mask has {m} entries, input_ids has {n}")
        if o < 1:
            return _Failure(i, "seq_offsets", "seq_offsets is empty; it must start at 0")
        return _Failure(i, "example_ids", f"{e} example_ids for {o - 1} sequences")
    ends = O.cumsum()  # position in `offs` after each row's offsets
    starts = ends - O
    if (bad := (offs[starts] != 0) | (offs[ends - 1] != L)).any():
        i = first(bad)
        lo, hi = int(offs[starts[i]]), int(offs[ends[i] - 1])
        what = f"start at 0, got {lo}" if lo != 0 else f"end at len(input_ids)={int(L[i])}, got {hi}"
        return _Failure(i, "seq_offsets", f"seq_offsets must {what}")
    # Pairs (offs[j], offs[j + 1]) inside one row: a sequence each. The pair across two rows is not one.
    inside = np.ones(len(offs) - 1, dtype=bool)
    inside[ends[:-1] - 1] = False
    if (bad := (offs[1:] <= offs[:-1]) & inside).any():
        j = first(bad)
        i = int(np.searchsorted(ends, j, side="right"))
        k = j - int(starts[i])
        return _Failure(i, "seq_offsets", f"seq_offsets must increase strictly: seq_offsets[{k}]={int(offs[j])}, "
                                          f"seq_offsets[{k + 1}]={int(offs[j + 1])}")
    if mask.size and mask.max() > 1:
        t = first(mask > 1)
        i = int(np.searchsorted(L.cumsum(), t, side="right"))
        return _Failure(i, "loss_mask_values", f"loss_mask[{t - int(L[:i].sum())}] is {int(mask[t])}; only 0 and 1 are allowed")
    if not (checks.eos_at_boundaries or checks.targets_in_every_sequence or checks.all_targets) or not mask.size:
        return None
    # Sequences as [start, end) into the flat token arrays: a row's offsets, shifted by the row's first token.
    g = offs + np.repeat(L.cumsum() - L, O)
    seq_start, seq_end = g[:-1][inside], g[1:][inside]

    def at_sequence(j: int, check: str, detail: str) -> _Failure:
        per_row = (O - 1).cumsum()  # position in the sequence arrays after each row's sequences
        i = int(np.searchsorted(per_row, j, side="right"))
        return _Failure(i, check, detail, sequence=j - int(per_row[i] - (O[i] - 1)))

    if checks.eos_at_boundaries and seq_end.size:
        last = ids[seq_end - 1]
        if (bad := (last != checks.eos_token_id) & (seq_end - seq_start < budget)).any():
            j = first(bad)
            return at_sequence(j, "eos_at_boundaries",
                               f"ends on token {int(last[j])}, not on eos_token_id {checks.eos_token_id}, and is shorter "
                               f"than the budget {budget}: the example boundaries are not where the run put them "
                               "(examples would attend to each other)")
    # A sequence whose last token is a target has one (the usual case: the answer ends it); only the others
    # are scanned. Sequences tile the batch's tokens (checked above), so reduceat over their starts covers
    # exactly each one; the mask is 0/1 (checked above), so viewing it as bool is exact.
    if checks.targets_in_every_sequence and seq_start.size and (unsure := mask[seq_end - 1] == 0).any():
        if (bad := unsure & ~np.logical_or.reduceat(mask.view(bool), seq_start)).any():
            return at_sequence(first(bad), "targets_in_every_sequence",
                               "has no target token (loss_mask all 0), but the run put a target in every sequence")
    if checks.all_targets and not mask.all():
        t = first(mask == 0)
        j = int(np.searchsorted(seq_start, t, side="right")) - 1
        return at_sequence(j, "all_targets", f"its token {t - int(seq_start[j])} has loss_mask 0, but the run trains "
                                             "on every token (--train-on all)")
    return None


def _default_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


# -- what the plan and the loss weights need from the rows (computed once per PackedDataset) -----------------


def _row_facts(table: pa.Table) -> Rows:
    """Each row's tokens and its examples' lengths, from ``num_tokens`` and ``seq_offsets`` (no token read)."""
    offsets = table.column("seq_offsets")
    counts = pc.list_value_length(offsets).to_numpy(zero_copy_only=False).astype(np.int64)  # sequences + 1
    flat = np.concatenate([c.flatten().to_numpy() for c in offsets.chunks] or [np.zeros(0, np.int32)]).astype(np.int64)
    ends = np.cumsum(counts)
    inside = np.ones(max(len(flat) - 1, 0), dtype=bool)  # pairs (offs[j], offs[j + 1]) within one row
    inside[ends[:-1] - 1] = False
    seq_lens = np.diff(flat)[inside]
    seq_start = np.concatenate([[0], np.cumsum(counts - 1)]).astype(np.int64)
    tokens = table.column("num_tokens").to_numpy().astype(np.int64)
    return Rows(tokens=tokens, seq_start=seq_start, seq_lens=seq_lens)


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
        seq_starts = starts[first]
        if not len(seq_starts):
            continue
        sums = np.add.reduceat(mask.astype(np.int64), seq_starts) if len(mask) else np.zeros(len(seq_starts), np.int64)
        out.append(sums - mask[seq_starts])
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
        batch_by, balance, loss_weighting = (_enum(BatchBy, batch_by, "batch_by"), _enum(Balance, balance, "balance"),
                                             _enum(LossWeighting, loss_weighting, "loss_weighting"))
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
        self.rows, self.metadata, self.manifest = opened.rows, opened.metadata, opened.manifest
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
        self._facts = _row_facts(table)
        self.num_tokens = self._facts.tokens
        self.num_examples = np.diff(self._facts.seq_start)
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
        dataset, names = _sequence_sources(table, self.manifest, self._where)
        specs = ((self.manifest.get("config") or {}).get("config")) or [{}]
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
        b = _gather(table, check=check)
        failure = b if isinstance(b, _Failure) else check_batch(b, self._checks) if check else None
        if failure is not None:
            raise self._broken(indices, b, failure)
        flat = {name: np.split(b.values[name], np.cumsum(b.lengths[name])[:-1]) for name in b.values}
        example_ids = b.example_ids.to_pylist()
        return [
            {
                "input_ids": flat["input_ids"][i],
                "loss_mask": flat["loss_mask"][i],
                "seq_offsets": flat["seq_offsets"][i],
                "example_ids": example_ids[i],
                "num_tokens": int(flat["input_ids"][i].shape[0]),
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
            if lo != 0 or hi != len(offs) - 1:  # a piece of the row: its sequences lo..hi-1
                a, z = int(offs[lo]), int(offs[hi])
                row = {"input_ids": row["input_ids"][a:z], "loss_mask": row["loss_mask"][a:z],
                       "seq_offsets": offs[lo : hi + 1] - offs[lo], "example_ids": row["example_ids"][lo:hi],
                       "num_tokens": z - a}
                offs = row["seq_offsets"]
            base = int(self._facts.seq_start[r]) + lo
            lens = np.diff(offs)
            target = row["loss_mask"].astype(np.float32)
            target[offs[:-1]] = 0.0  # an example's first token is never a target (Collator's labels agree)
            weights = np.repeat(self._seq_weight[base : base + len(lens)], lens).astype(np.float32)
            out.append({**row, "loss_weights": weights * target * np.float32(scale), "loss_denominator": denominator})
        return out

    def _broken(self, indices: np.ndarray, b: _Batch | _Failure, f: _Failure) -> ContractError:
        """The error for row ``f.row`` of a gathered batch: shard file, row in the shard, sequence, check."""
        g = int(indices[f.row])
        k = int(np.searchsorted(self._starts, g, side="right")) - 1
        at = f"{self._where}/{self.shards[k]} row {g - int(self._starts[k])}"
        if f.sequence is not None and isinstance(b, _Batch):
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
        """Where the iteration is, plus what shaped its plan; plain Python values."""
        s = asdict(self.sampling)
        for k in ("batch_by", "balance"):
            s[k] = getattr(self.sampling, k).value
        return {"epoch": self.epoch, "position": self._position, "num_rows": len(self.rows),
                "loss_weighting": self.loss_weighting.value, **s}

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


def _enum(kind: type, value: Any, name: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise PackstreamError(f"{name}={value!r}; use one of {[v.value for v in kind]}") from None


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
