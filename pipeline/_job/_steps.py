"""The job's steps: thin classes around the stages' pure functions, with no runner in them.

Every step takes the one :class:`~pipeline._job._context.RunContext` and has Beam's shape
(``setup()``, ``process(element)`` yielding the typed values of :mod:`pipeline._job._outputs`,
``teardown()``), so the same objects run under both runners: the local one
(:mod:`pipeline._job._local`, no Beam) and Beam's (:mod:`pipeline._job._graph` wraps each in a DoFn).
While the tokenizer (Rust, its own threads) encodes one chunk of a read task, the step's thread
reads, parses and renders the next.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import numpy as np

import packers
from packers import PackstreamError
from pipeline import _arrow, _progress, _read, _rows, _spill, _trace, _write
from pipeline._encode import Encoder, add_counts, input_folders
from pipeline._formats import Reason
from pipeline._job._context import RunContext
from pipeline._job._outputs import Failure, Flags, Packed, Rejects, Spilled, Stats, Written
from pipeline._options import PackMode
from pipeline._workers import parallel, signals

if TYPE_CHECKING:
    import pyarrow as pa

NS = "packstream"
"""The namespace of the job's counters (Beam metrics where the job runs on Beam)."""


class EncodeTasks:
    """A read task -> its examples spilled per packing group (:class:`Spilled`), plus dead letters
    (:class:`Rejects`) and counts (:class:`Stats`); a :class:`Failure` when the folder cannot be written."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.encoder = None
        self.broken = None
        self.read = _progress.Counter(NS, "records_read", ctx.progress)
        self.encoded = _progress.Counter(NS, "records_encoded", ctx.progress)
        self.examples = _progress.Counter(NS, "examples_tokenized", ctx.progress)
        self.tokens = _progress.Counter(NS, "tokens", ctx.progress)

    def setup(self):
        threads = self.ctx.options.tokenizer_threads
        if threads:  # the Rust tokenizer reads its thread count from the environment, before it first encodes
            os.environ.update(parallel.tokenizer_env(threads))
        try:
            with _trace.span("encode_setup") as info:
                self.encoder = Encoder(self.ctx.options, folders=input_folders(self.ctx.files))
                info["process_cpu"] = time.process_time()  # the process's start-up until its tokenizer is ready
        except PackstreamError as e:  # the launcher loaded the same tokenizer; a remote worker may not find it
            self.broken = Failure.of(e, self.ctx.output)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="packstream-tokenize")

    def teardown(self):
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    def process(self, task: _read.ReadTask):
        if self.broken is not None:
            yield self.broken
            return
        with _trace.span("encode_task", task=task.name, start=task.start) as info:
            for item in self._process(task):
                if isinstance(item, Stats):
                    info["records"] = item.counts["records_read"]
                yield item

    def _process(self, task: _read.ReadTask):
        state = _TaskState(self, task)
        try:
            for chunk in self._chunks(task, state):
                state.submit(chunk)
                yield from state.take()
            state.finish_pending()
            state.spill()
            path = _write.write_reject_part(self.ctx.spill, task.name, state.rejected)
        except (OSError, PackstreamError) as e:  # the spill folder (under --output) cannot be written
            yield Failure.of(e, self.ctx.output)
            return
        yield from state.take()
        if path:
            yield Rejects(path)
        yield Stats(state.stats)
        _progress.flush(self.ctx.progress)

    def _chunks(self, task: _read.ReadTask, state: "_TaskState") -> Iterable[list]:
        f, size = task.file, self.ctx.options.batch_size
        chunk: list = []
        try:
            for position, record in _read.read_task(task, self.ctx.options.max_record_bytes):
                signals.at("read")
                chunk.append((f.dataset, f.source, position, record))
                if len(chunk) == size:
                    state.stats["records_read"] += size
                    self.read.inc(size)
                    yield chunk
                    chunk = []
        except _read.CorruptInput as e:
            # Errors as data: the unreadable rest of the file is one dead letter, counted as a record.
            state.rejected.append(_rows.reject_record(f.source, e.rest_at, Reason.CORRUPT_INPUT, str(e)))
            state.stats["records_read"] += 1
        if chunk:
            state.stats["records_read"] += len(chunk)
            self.read.inc(len(chunk))
            yield chunk


class _TaskState:
    """One read task on its way through :class:`EncodeTasks`: the chunk being tokenized, the encoded
    examples not yet spilled, the task's dead letters and counts, and the values ready to go out."""

    def __init__(self, step: EncodeTasks, task: _read.ReadTask):
        self.step, self.task = step, task
        self.stats: dict[str, int] = {"records_read": 0}
        self.rejected: list[dict] = []
        self.held: list = []  # encoded batches not yet spilled
        self.held_tokens = 0
        self.parts = 0
        self.pending = None  # (prepared chunk, its tokenizer future, records)
        self.out: list = []

    def submit(self, chunk: list) -> None:
        """Tokenize ``chunk`` in the background; finish the chunk before it meanwhile."""
        encoder = self.step.encoder
        prepared = encoder.prepare(chunk)
        future = self.step.pool.submit(encoder.tokenize, prepared)
        self.finish_pending()
        self.pending = (prepared, future, len(chunk))

    def finish_pending(self) -> None:
        if self.pending is None:
            return
        (prepared, future, size), self.pending = self.pending, None
        step = self.step
        enc = step.encoder.finish(prepared, future.result())
        signals.at("encode")
        step.encoded.inc(size)
        self.rejected.extend(enc.rejected)
        add_counts(self.stats, enc.counts)
        if len(enc.batch):
            self.held.append(enc.batch)
            self.held_tokens += enc.batch.num_tokens
            step.examples.inc(len(enc.batch))
            step.tokens.inc(enc.batch.num_tokens)
        if self.held_tokens >= _spill.SPILL_TOKENS:
            self.spill()

    def spill(self) -> None:
        """Write the held examples to the spill, one slice per packing group."""
        ctx = self.step.ctx
        batch = _rows.ExampleBatch.concat(self.held)
        self.held, self.held_tokens = [], 0
        if not len(batch):
            return
        keys = [ctx.layout.key(eid, ctx.options.validation_fraction) for eid in batch.ids]
        for split in ("train", "validation"):
            which = [i for i, k in enumerate(keys) if k[0] == split]
            if not which:
                continue
            sub = batch.take(which)
            groups = np.array([keys[i][1] for i in which], dtype=np.int64)
            for sl in _spill.write_part(ctx.spill, f"{self.task.name}-{self.parts}", sub, groups):
                self.out.append(Spilled(split, sl.group, sl))
            signals.at("spill")
            self.stats[f"examples_{split}"] = self.stats.get(f"examples_{split}", 0) + len(which)
        self.parts += 1

    def take(self) -> Iterator:
        out, self.out = self.out, []
        return iter(out)


class PackGroups:
    """One packing group: read its examples back from the spill, pack them, park the rows for their shard.

    Groups are independent, so every worker packs its share of them. Emits a :class:`Packed` for the
    shard that writes the rows (global mode: one per shard of the split, the rows dealt out
    round-robin), then the group's dead letters, counts and row checks (:class:`Flags`).
    """

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.rows = _progress.Counter(NS, "rows", ctx.progress)

    def process(self, keyed):
        (split, g), slices = keyed
        o, ctx = self.ctx.options, self.ctx
        count = ctx.layout.shards[split]
        try:
            signals.at("pack")
            with _trace.span("pack_group", group=g):
                group = _rows.pack_group(_spill.read_slices(sorted(slices)), o, ctx.eos_id)
                if o.mode is PackMode.GROUPED or count == 1:
                    by_shard = {g % count: list(group.chunks)}
                else:  # global mode: one group per split, its rows dealt out round-robin over the split's shards
                    by_shard = _deal(group.chunks, count)
                pieces = _spill.write_packed(ctx.spill, f"{split}-{g}", g, by_shard)
                path = _write.write_reject_part(ctx.spill, f"group-{split}-{g}", group.rejected)
        except (OSError, PackstreamError) as e:
            yield Failure.of(e, ctx.output)
            return
        self.rows.inc(group.num_rows)
        _progress.flush(ctx.progress)
        for shard, piece in pieces:
            yield Packed(split, shard, piece)
        if path:
            yield Rejects(path)
        yield Stats(group.stats)
        yield Flags(group.eos_at_boundaries, group.all_targets)


class WriteShards:
    """One shard: stream its groups' packed rows, in group order, into the file (hashed as it goes)."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx

    def process(self, keyed):
        (split, shard), values = keyed
        ctx = self.ctx
        pieces = sorted(v for v in values if v is not None)
        schema = ctx.schema()
        name = _write.shard_name(split, shard, ctx.layout.shards[split], ctx.extension)
        writer = None
        try:
            with _trace.span("write_shard", shard=shard, pieces=len(pieces)):
                writer = _write.ShardWriter(ctx.output, name, schema, ctx.options.output_format.value)
                for piece in pieces:
                    if piece.rows:
                        writer.write(_spill.read_piece(piece))
                        signals.at("shard_write")
                desc = writer.close(split)
                signals.at("shard_write")
        except BaseException as e:
            if writer is not None:  # a failed attempt leaves no temp file (a retry writes its own)
                writer.abort()
            if not isinstance(e, (OSError, PackstreamError)):
                raise
            yield Failure.of(e, ctx.output)
            return
        yield Written(desc)


def cut_tasks(f: _read.InputFile, task_bytes: int) -> list[_read.ReadTask]:
    """One input's read tasks (:func:`pipeline._read.cut_tasks`), traced."""
    with _trace.span("cut_tasks", source=f.source) as info:
        tasks = _read.cut_tasks(f, task_bytes)
        info["tasks"] = len(tasks)
    return tasks


def task_weight(task: Any) -> float:
    """A read task's size for dealing them biggest first: a JSONL task's bytes, a whole local file's size; a task
    whose size is not known cheaply (rows of a table, a remote file) counts as the biggest (it goes first)."""
    jsonl = task.file.kind == "jsonl"  # start and stop are bytes (the last task's stop is None: to the end)
    if jsonl and task.stop is not None:
        return float(task.stop - task.start)
    if (jsonl or task.start == 0) and task.stop is None and "://" not in task.file.path:
        try:
            return float(os.path.getsize(task.file.path) - (task.start if jsonl else 0))
        except OSError:
            pass
    return float("inf")


def _deal(chunks: Sequence[pa.RecordBatch], count: int) -> dict[int, list[pa.RecordBatch]]:
    """Global mode: a group's rows (in chunks) dealt round-robin over ``count`` shards, row ``i`` to shard
    ``i % count``, each chunk taken apart on its own (no column of several chunks is ever concatenated)."""
    by_shard: dict[int, list[pa.RecordBatch]] = {s: [] for s in range(count)}
    start = 0
    for chunk in chunks:
        rows = np.arange(start, start + chunk.num_rows)
        for s in range(count):
            by_shard[s].append(chunk.take(_arrow.array(np.flatnonzero(rows % count == s))))
        start += chunk.num_rows
    return by_shard
