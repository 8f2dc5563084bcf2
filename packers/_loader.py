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
import re
import tempfile
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.utils.data

from packers._errors import ContractError, InternalError, PackstreamError
from packers._schema import SCHEMA, read_metadata

_SHARD_NAME = re.compile(r"-(\d+)-of-(\d+)\.arrow$")


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


def _local_files(path: str | os.PathLike | Sequence[str | os.PathLike], cache_dir: str | None, storage_options: dict | None) -> list[str]:
    """The shard files under ``path`` (a folder, a file, or a list of them), local, copied from fsspec if remote."""
    import fsspec

    paths = [path] if isinstance(path, (str, os.PathLike)) else list(path)
    out: list[str] = []
    for p in paths:
        fs, root = fsspec.core.url_to_fs(str(p), **(storage_options or {}))
        if fs.isdir(root):
            listing = fs.ls(root, detail=False)
            files = _shard_files(listing)
            if not files and any(f.endswith(".parquet") for f in listing):
                raise PackstreamError(
                    f"{p} holds Parquet shards, which cannot be memory-mapped; pack with --output-format arrow "
                    "(the default), or read them with datasets.load_dataset('parquet', ...) and packers.Collator"
                )
            if not files:
                raise PackstreamError(f"no .arrow shards in {p}; point at the output folder of `packstream pack`")
            _check_complete(str(p), files)
        elif fs.exists(root):
            files = [root]
        else:
            raise PackstreamError(f"{p} does not exist")
        local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        if local:
            out += [os.fspath(f) for f in files]
            continue
        # Memory-mapping needs a local file: copy remote shards once into a cache keyed by their URL.
        cache = os.path.join(cache_dir or os.path.join(tempfile.gettempdir(), "packstream-cache"),
                             hashlib.sha256(str(p).encode()).hexdigest()[:16])
        os.makedirs(cache, exist_ok=True)
        for f in files:
            dst = os.path.join(cache, os.path.basename(f))
            if not (os.path.exists(dst) and os.path.getsize(dst) == fs.size(f)):
                fs.get(f, dst + ".part")
                os.replace(dst + ".part", dst)
            out.append(dst)
    return out


def _shard_files(names: list[str]) -> list[str]:
    """The shards in a folder listing: ``*-0000k-of-0000n.arrow`` when there are such, else every ``.arrow``;
    never ``cache-*.arrow``, which ``datasets`` writes next to a file it maps (``ds.rows.map(...)``)."""
    arrow = sorted(f for f in names if f.endswith(".arrow") and not os.path.basename(f).startswith("cache-"))
    named = [f for f in arrow if _SHARD_NAME.search(f)]
    return named or arrow


def _check_complete(where: str, files: list[str]) -> None:
    """Shards named ``*-0000k-of-0000n.arrow`` must all be there: a partial copy would silently lose rows."""
    named = [m for m in (_SHARD_NAME.search(f) for f in files) if m]
    if not named:
        return
    totals = {int(m.group(2)) for m in named}
    seen = {int(m.group(1)) for m in named}
    for total in totals:
        missing = sorted(set(range(total)) - seen)
        if missing:
            raise ContractError(f"{where}: shard(s) {missing[:5]} of {total} missing; copy the whole output folder")


def _read_schema(path: str) -> pa.Schema:
    with pa.memory_map(path) as src:
        try:
            return pa.ipc.open_stream(src).schema
        except pa.ArrowInvalid as e:
            raise ContractError(f"{path} is not an Arrow IPC stream file (what `packstream pack` writes): {e}") from e


def open_rows(
    path: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    cache_dir: str | None = None,
    storage_options: dict | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Open packed shards as one memory-mapped ``datasets.Dataset`` (zero-copy); also returns the metadata."""
    import datasets

    files = _local_files(path, cache_dir, storage_options)
    meta: dict[str, Any] | None = None
    want = [(f.name, f.type) for f in SCHEMA]
    for f in files:
        schema = _read_schema(f)
        got = [(x.name, x.type) for x in schema]
        if got != want:
            raise ContractError(f"{f}: columns {got} differ from the packed-row contract {want}")
        m = read_metadata(schema)
        if meta is None:
            meta = m
        elif m != meta:
            diff = {k: (meta.get(k), m.get(k)) for k in set(meta) | set(m) if meta.get(k) != m.get(k)}
            raise ContractError(f"{f}: metadata differs from {files[0]}: {diff}; shards of one run only")
    parts = [datasets.Dataset.from_file(f) for f in files]
    rows = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return rows, meta or {}


def _default_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class PackedDataset(torch.utils.data.IterableDataset):
    """Packed shards as an iterable of micro-batches (lists of row dicts) for one rank; resumable.

    ``path``: a folder of ``*.arrow`` shards (local or any fsspec URL: remote shards are copied
    once to ``cache_dir`` so they can be memory-mapped), one shard file, or a list of them.

    * ``rows``: every row as a memory-mapped, map-style ``datasets.Dataset`` (zero-copy).
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
        self.rows, self.metadata = open_rows(path, cache_dir=cache_dir, storage_options=storage_options)
        self.budget: int = int(self.metadata["budget"])
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
        """Rows by global index, as dicts of numpy arrays (views into one gathered Arrow table)."""
        table = self._arrow[np.asarray(indices, dtype=np.int64)]
        flat: dict[str, list[np.ndarray]] = {}
        for name in ("input_ids", "loss_mask", "seq_offsets"):
            col = table.column(name).combine_chunks()
            values = col.flatten().to_numpy()
            ends = np.cumsum(pc.list_value_length(col).to_numpy())
            flat[name] = np.split(values, ends[:-1])
        example_ids = table.column("example_ids").to_pylist()
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
