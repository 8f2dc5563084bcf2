"""Read packed shards for training: memory-mapped rows, scheduled epochs, rank sharding, loss weights, exact resume.

Each epoch follows a schedule made before it starts (:mod:`packers._schedule`), the same on every rank
without communication: every example exactly once, every rank the same number of steps, each step's
rows dealt so that its most loaded rank is close to its mean (``balance``), the steps in an order
where the index does not predict length. Step ``s`` on rank ``r`` is micro-batch ``(s, r)`` of the schedule.
The folder is opened by :mod:`packers._folder`; the options come in three groups (:mod:`packers._options`).

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
schedule; restoring it gives the same next batches as an uninterrupted run.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import asdict
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.utils.data

from packers._folder import open_rows
from packers._options import Batching, BatchBy, LossWeighting, Sampling, Sharding, check_loss_weight, regrouped
from packers._schedule import Rows, Schedule, schedule_epoch, step_denominators
from packers.errors import ContractError, PackstreamError, is_int, short
from packers.manifest import MANIFEST, Manifest, escape_source
from packers.rowcheck import Batch, Failure, check_batch, check_images, check_videos, gather
from packers.schema import count_targets
from packers._vision import VisionSpec


def _differences(saved: Mapping[str, Any], current: Mapping[str, Any], keys: Sequence[str]) -> str:
    """``"seed -5 vs 3, world_size 2 vs 1"``: the keys whose saved and current values differ ('' if none)."""
    return ", ".join(f"{k} {short(saved[k], 40)} vs {short(current[k], 40)}" for k in keys
                     if saved[k] != current[k] or type(saved[k]) is not type(current[k]))


# -- what the schedule and the loss weights need from the rows (computed once per PackedDataset) -------------


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
    """Sequences ``lo..hi-1`` of a fetched row as a row of their own (the schedule cuts rows only where an example ends:
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
            "completion_spans": (spans[2 * lo : 2 * hi] - a).astype(np.int32) if len(spans) else spans.astype(np.int32),
            "desirable": _slice_desirable(row, lo, hi), **_slice_images(row, a, z)}


def _slice_images(row: dict[str, Any], a: int, z: int) -> dict[str, Any]:
    """The images whose placeholder runs start in tokens ``[a, z)`` of a row (a run never leaves its example), their
    offsets moved to the piece; nothing for a row without image columns."""
    if "image_offsets" not in row:
        return {}
    offs = np.asarray(row["image_offsets"], dtype=np.int64)
    keep = (offs >= a) & (offs < z)
    grids = np.asarray(row["image_grid_thw"], dtype=np.int32).reshape(-1, 3)[keep].reshape(-1)
    out = {"image_offsets": (offs[keep] - a).astype(np.int32), "image_grid_thw": grids,
           "images": [img for img, k in zip(row["images"], keep) if k]}
    if "video_offsets" in row:
        v = np.asarray(row["video_offsets"], dtype=np.int64)
        vk = (v >= a) & (v < z)
        out.update(video_offsets=(v[vk] - a).astype(np.int32),
                   video_grid_thw=np.asarray(row["video_grid_thw"], dtype=np.int32).reshape(-1, 3)[vk].reshape(-1),
                   videos=[x for x, k in zip(row["videos"], vk) if k],
                   second_per_grid_ts=np.asarray(row["second_per_grid_ts"], dtype=np.float32)[vk])
    return out


def _slice_desirable(row: dict[str, Any], lo: int, hi: int) -> np.ndarray:
    """Sequences ``lo..hi-1``'s desirability labels (empty when the row carries none)."""
    labels = np.asarray(row.get("desirable", ()), dtype=np.int8)
    return labels[lo:hi] if len(labels) else labels


class PackedDataset(torch.utils.data.IterableDataset):
    """Packed shards as an iterable of micro-batches (lists of row dicts) for one rank; scheduled, resumable.

    ``path``: the ``--output`` folder of a finished ``packstream pack`` (local or any fsspec URL:
    remote shards are copied once to ``cache_dir`` so they can be memory-mapped), or shard files of
    one such folder (a path or a list). The folder's ``manifest.json`` decides what is read: it must
    say the run completed, the loader opens exactly the shards it lists for ``split``, checks each
    one's size, schema, schema metadata and row count against it (and, with ``verify=True``, its
    sha256), and refuses a folder holding ``*.arrow``/``*.parquet`` files it does not list. Every row
    :meth:`fetch` returns (so every batch iteration yields) is checked against the packed-row contract
    and the manifest's ``row_checks``; see docs/loader.md, "What the loader checks".

    Each epoch follows a schedule (:mod:`packers._schedule`): every example exactly once, ``len(ds)`` steps on
    every rank, known before the epoch. The options come in three groups, each checked when it is made:

    * ``sampling`` (:class:`packers.Sampling`): ``shuffle``, ``seed``, and ``rebatch`` (new micro-batches every
      epoch);
    * ``sharding`` (:class:`packers.Sharding`): ``rank`` and ``world_size``, torch.distributed's by default;
    * ``batching`` (:class:`packers.Batching`): ``batch_size`` units of ``batch_by`` per micro-batch,
      ``grad_accum`` micro-batches per rank in an optimizer step, ``balance`` (deal each step's rows so that no
      rank waits long for another: ``"compute"`` by ``cost``, a :class:`packers.CostModel`; ``"tokens"``;
      ``"none"``), and the step's loss denominator (``loss_weighting``: ``"token"``, ``"example"`` or
      ``"source"``, weighted by ``source_weights`` or the ``--config`` data sets' ``loss_weight``), which comes
      with every row as ``loss_weights``.

    For example ``PackedDataset("packed/", batching=Batching(batch_by="examples", batch_size=16))``.

    * ``rows``: every row as a memory-mapped, map-style ``datasets.Dataset`` (zero-copy). Reading it
      directly skips the row checks: call :meth:`check_rows` first, or pass ``verify=True``.
    * ``manifest``: the folder's ``manifest.json``; ``shards``: the shard names opened, in row order.
    * iterating yields this rank's micro-batches of the current epoch from the current position,
      each a list of row dicts with numpy arrays, ready for :class:`packers.Collator`.

    With DataLoader workers, use :meth:`dataloader`: it tracks the position in the main process
    (workers hold copies), and splits the steps over workers so that the order stays the same.
    """

    def __init__(
        self,
        path: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        split: str = "train",
        verify: bool = False,
        sampling: Sampling = Sampling(),
        sharding: Sharding = Sharding(),
        batching: Batching = Batching(),
        cache_dir: str | None = None,
        storage_options: dict | None = None,
        **old: Any,
    ) -> None:
        if old:  # the flat keywords of the old signature (batch_size=, rank=, seed=...): their new spelling, issue 35
            raise PackstreamError(regrouped(old, _OWN))
        for name, value, kind in (("sampling", sampling, Sampling), ("sharding", sharding, Sharding),
                                  ("batching", batching, Batching)):
            if not isinstance(value, kind):
                raise PackstreamError(f"{name}={short(value)}; pass packers.{kind.__name__}(...)")
        self.sampling: Sampling = sampling
        self.sharding: Sharding = sharding.resolved()
        self.batching: Batching = batching
        opened = open_rows(path, split=split, verify=verify, cache_dir=cache_dir, storage_options=storage_options)
        self.rows, self.metadata = opened.rows, opened.metadata
        self.manifest: Manifest = opened.manifest
        self._data_sha256 = opened.data_sha256
        self.split: str = split
        self.shards: tuple[str, ...] = opened.names
        self._where, self._starts, self._checks = opened.where, opened.starts, opened.checks
        self.budget: int = opened.checks.budget
        self.vision: VisionSpec | None = (
            VisionSpec.from_json(self.metadata["vision"], what=f"{self._where}: the shards' vision spec")
            if "vision" in self.metadata else None)
        """The run's vision processor spec when its rows carry images (``packstream pack --processor``): pass it
        to ``packers.Collator(vision=...)``."""
        if batching.batch_by is BatchBy.TOKENS and batching.batch_size < self.budget:
            raise PackstreamError(f"batch_size={batching.batch_size} tokens < row budget {self.budget}: a row would "
                                  f"not fit; use at least {self.budget}")
        self._arrow = self.rows.with_format("arrow")
        table = self.rows.data.table
        grain = 2 if self.manifest.row_checks is not None and self.manifest.row_checks.pairs else 1
        self._facts = _row_facts(table, grain)
        self.num_tokens = self._facts.tokens
        self.num_examples = np.diff(self._facts.seq_start) // grain  # pairs in a row of pairs
        self._seq_weight, self._seq_denominator = self._sequence_weights(table)
        self.epoch = 0
        self._position = 0
        self._tracked = False  # set by PackedLoader while it starts workers
        self._pinned = False  # set_epoch() named the current epoch; cleared when an iteration runs to its end
        self._schedule_cache: tuple[int, Schedule, np.ndarray] | None = None

    def _sequence_weights(self, table: pa.Table) -> tuple[np.ndarray, np.ndarray]:
        """Per sequence: what each of its target tokens weighs, and what it adds to its step's loss denominator."""
        targets = _sequence_targets(table)
        weighting = self.batching.loss_weighting
        if weighting is LossWeighting.TOKEN:
            weight = np.ones(len(targets))
        elif weighting is LossWeighting.EXAMPLE:
            weight = np.divide(1.0, targets, out=np.zeros(len(targets)), where=targets > 0)
        else:
            weight = self._source_weights(table, self.batching.source_weights)
        if weighting is LossWeighting.EXAMPLE:
            return weight, (targets > 0).astype(np.float64)
        return weight, weight * targets

    def _source_weights(self, table: pa.Table, given: Mapping[str, float] | None) -> np.ndarray:
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
            check_loss_weight(n, w)
        return np.array([weights[n] for n in names], dtype=np.float64)[dataset]

    # -- the schedule -----------------------------------------------------------------------
    def _schedule(self, epoch: int) -> tuple[Schedule, np.ndarray]:
        """The epoch's schedule (all ranks) and its optimizer steps' loss denominators; the last epoch's is cached."""
        if self._schedule_cache is None or self._schedule_cache[0] != epoch:
            schedule = schedule_epoch(self._facts, epoch, sampling=self.sampling, batching=self.batching,
                                      world_size=self.sharding.world_size)
            self._schedule_cache = (epoch, schedule, step_denominators(schedule, self._facts, self._seq_denominator))
        return self._schedule_cache[1], self._schedule_cache[2]

    def __len__(self) -> int:
        """Steps (micro-batches) this rank gets in the current epoch; the same on every rank, exact before it starts."""
        return self._schedule(self.epoch)[0].steps

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps in the current epoch: ``grad_accum`` micro-batches each (the last one possibly fewer)."""
        return self._schedule(self.epoch)[0].optimizer_steps

    def schedule(self, epoch: int | None = None) -> list[np.ndarray]:
        """This rank's micro-batches of ``epoch`` (default: the current one) as arrays of row indices, in step
        order. A row the schedule divided at an example boundary appears in the two micro-batches holding its
        pieces."""
        schedule, _ = self._schedule(self.epoch if epoch is None else epoch)
        r = self.sharding.rank
        return [schedule.units.row[schedule.micro_batch(s, r)] for s in range(schedule.steps)]

    def loss_denominators(self, epoch: int | None = None) -> np.ndarray:
        """Each optimizer step's global loss denominator in ``epoch`` (the same on every rank): its target tokens
        (``token``), examples with a target (``example``) or weighted target tokens (``source``)."""
        return self._schedule(self.epoch if epoch is None else epoch)[1].copy()

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
        rows = [
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
                "desirable": flat["desirable"][i],
            }
            for i in range(len(example_ids))
        ]
        if self.vision is not None:
            self._add_images(indices, table, rows, check=check)
        return rows

    def _add_images(self, indices: np.ndarray, table: pa.Table, rows: list[dict[str, Any]], *, check: bool) -> None:
        """Each row's ``image_offsets``, ``image_grid_thw`` (numpy int32) and ``images`` (``{"path", "bytes"}``
        dicts), checked against its tokens."""
        offsets = table.column("image_offsets").to_pylist()
        grids = table.column("image_grid_thw").to_pylist()
        images = table.column("images").to_pylist()
        for i, row in enumerate(rows):
            row["image_offsets"] = np.asarray(offsets[i], dtype=np.int32)
            row["image_grid_thw"] = np.asarray(grids[i], dtype=np.int32)
            row["images"] = images[i]
            if check and (f := check_images(i, row["input_ids"], row["loss_mask"], row["seq_offsets"],
                                            row["image_offsets"], row["image_grid_thw"], len(images[i]),
                                            self.vision)) is not None:
                raise self._broken(indices, Failure(f.row, f.check, f.detail), f)
        if "video_offsets" in table.column_names:
            self._add_videos(indices, table, rows, check=check)

    def _add_videos(self, indices: np.ndarray, table: pa.Table, rows: list[dict[str, Any]], *, check: bool) -> None:
        """Each row's video columns (contract version 8), checked against its tokens as its images are."""
        cols = {c: table.column(c).to_pylist() for c in ("video_offsets", "video_grid_thw", "videos",
                                                          "second_per_grid_ts")}
        for i, row in enumerate(rows):
            row["video_offsets"] = np.asarray(cols["video_offsets"][i], dtype=np.int32)
            row["video_grid_thw"] = np.asarray(cols["video_grid_thw"][i], dtype=np.int32)
            row["videos"] = cols["videos"][i]
            row["second_per_grid_ts"] = np.asarray(cols["second_per_grid_ts"][i], dtype=np.float32)
            f = check_videos(i, row["input_ids"], row["loss_mask"], row["seq_offsets"], row["video_offsets"],
                             row["video_grid_thw"], len(row["videos"]), self.vision) if check else None
            if f is None and check and len(row["second_per_grid_ts"]) != len(row["video_offsets"]):
                f = Failure(i, "videos", f"{len(row['second_per_grid_ts'])} second_per_grid_ts for "
                                         f"{len(row['video_offsets'])} videos; one per video")
            if f is not None:
                raise self._broken(indices, Failure(f.row, f.check, f.detail), f)

    def micro_batch(self, step: int, epoch: int | None = None) -> list[dict[str, Any]]:
        """This rank's micro-batch ``step`` of ``epoch`` (default: the current one): its rows (or row pieces),
        checked, each with ``loss_weights`` (float32 per token: its weight in the optimizer step's loss, the
        global denominator and the world size divided in; 0 off target) and ``loss_denominator``."""
        schedule, denominators = self._schedule(self.epoch if epoch is None else epoch)
        units = schedule.micro_batch(step, self.sharding.rank)
        u = schedule.units
        rows = self.fetch(u.row[units])
        denominator = float(denominators[step // schedule.grad_accum])
        scale = schedule.world_size / denominator if denominator > 0 else 0.0
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
        """Where the iteration is, what shaped its schedule, and which data it is over; plain Python values.

        ``run_id``, ``split`` and ``data_sha256`` (sha256 over the opened shards' names and their
        manifest sha256s) tie the state to the data: it resumes only a dataset over the same shards."""
        b, s = self.batching, self.sampling
        return {"epoch": self.epoch, "position": self._position, "num_rows": len(self.rows),
                "loss_weighting": b.loss_weighting.value, "batch_size": b.batch_size, "batch_by": b.batch_by.value,
                "shuffle": s.shuffle, "seed": s.seed, "rank": self.sharding.rank, "world_size": self.sharding.world_size,
                "grad_accum": b.grad_accum, "balance": b.balance.value, "cost": asdict(b.cost), "rebatch": s.rebatch,
                "run_id": self.manifest.run_id, "split": self.split, "data_sha256": self._data_sha256}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``; the data, the options that shape the schedule and the world size must match the saved
        ones, and ``(epoch, position)`` must be a place in this schedule (0 <= position <= the epoch's steps).

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
                f"cannot resume: saved vs current: {diff}; the schedule depends on these, so resume with the same "
                "data, world size and batching options"
            )
        epoch, position = state["epoch"], state["position"]
        if not (is_int(epoch) and epoch >= 0):
            raise PackstreamError(f"cannot resume: epoch is {short(epoch, 40)}, expected an integer >= 0")
        if not (is_int(position) and position >= 0):
            raise PackstreamError(f"cannot resume: position is {short(position, 40)}, expected an integer >= 0 (the "
                                  "steps of the epoch already taken)")
        steps = self._schedule(int(epoch))[0].steps
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


_OWN = [p.name for p in inspect.signature(PackedDataset.__init__).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY]
"""The keywords PackedDataset takes (split=, verify=, sampling=, ...), named when it is given another."""


class PackedLoader(torch.utils.data.DataLoader):
    """DataLoader for a :class:`PackedDataset`: counts the batches it hands out, in the main process.

    Workers each produce every ``num_workers``-th step of the schedule, and the DataLoader returns
    them round-robin, i.e. in step order; the dataset's position advances as each batch leaves
    this loader. ``state_dict``/``load_state_dict``/``set_epoch`` delegate to the dataset.
    """

    def __init__(self, dataset: PackedDataset, **kwargs: Any) -> None:
        for key in ("batch_size", "sampler", "batch_sampler", "shuffle", "drop_last"):
            if kwargs.pop(key, None) is not None:
                raise PackstreamError(f"PackedLoader: {key}= is not a loader option: the dataset yields whole "
                                      "micro-batches; set them with PackedDataset(batching=..., sampling=...)")
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
