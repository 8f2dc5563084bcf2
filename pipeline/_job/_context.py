"""What the launcher decides before the job starts: the run's :class:`RunContext`, which every step gets.

The context is frozen and small enough to pickle: Beam ships one copy of it with every step to
every worker, so it is also how a run's settings reach the worker processes (no environment
variables). Everything in it is decided once, at launch, from the options and a cheap look at the
inputs; nothing in it changes while the job runs.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

from pipeline import _read, _rows, _spill, _write
from pipeline._options import PackOptions


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where examples go: packing groups and output shards per split, from stable hashes of their ids."""

    groups: dict[str, int]
    """Packing groups per split ("train", "validation")."""
    shards: dict[str, int]
    """Output shards per split."""

    def key(self, example_id: str, fraction: float) -> tuple[str, int, int]:
        """(split, group, shard) of an example (``fraction``: the validation fraction)."""
        split = _rows.split_of(example_id, fraction)
        group = _rows.group_of(example_id, self.groups[split])
        return split, group, group % self.shards[split]

    def shard_names(self, ext: str) -> list[str]:
        """Every shard's file name, split by split."""
        return [_write.shard_name(split, i, n, ext) for split, n in sorted(self.shards.items()) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class RunContext:
    """One run, as the launcher decided it: the options, the inputs, the tokenizer and the layout."""

    options: PackOptions
    """The options, with the output folder normalized (and, locally, the workers and threads chosen)."""
    files: tuple[_read.InputFile, ...]
    read_once: tuple[str, ...]
    """Notes on inputs named twice and read once (the manifest's ``inputs_read_once``)."""
    tokenizer: dict
    """The tokenizer's identity (:func:`pipeline._tokenizer.tokenizer_identity`)."""
    layout: Layout
    run_id: str
    """A fresh id of this launch: the output lock's, the spill folder's and the outcome file's name."""
    digest: str
    """The manifest's ``run_id`` (:func:`pipeline._write.run_digest`), also in every shard's schema metadata:
    the same for a rerun of the same run."""
    spill: str
    """The spill folder (:mod:`pipeline._spill`), under the output folder."""
    skipped: tuple[_read.Skipped, ...] = ()
    """Files of folder inputs not read, with the reason (the manifest's ``inputs_skipped``, absent when none)."""
    notes: tuple[str, ...] = ()
    """One line each on what the run chose other than asked (a ``--num-shards`` capped at the records): the
    manifest's ``notes``."""
    task_bytes: int = _read.TASK_BYTES
    """The size of JSONL read tasks (:func:`pipeline._read.task_bytes`): enough tasks for the workers."""
    progress: Optional[str] = None
    """A local run watched for progress: the folder its workers count into (:mod:`pipeline._progress`)."""
    outcome: Optional[str] = None
    """A local run: the file where the commit leaves its outcome when the manifest cannot be written."""
    inputs_from: Optional[str] = None
    """The working folder the INPUT paths were resolved from, when one is a relative local path (the manifest's
    ``inputs_from``: ``verify --inputs`` finds them from any folder); None when every one is absolute or remote."""
    parallelism: Optional[dict] = None
    """A local run: its worker processes, tokenizer threads and why (:meth:`pipeline._workers.parallel.Parallelism.
    to_dict`), the manifest's ``run``; None on a cluster, whose runner owns the processes."""
    sizes: tuple[dict, ...] = ()
    """Per input (as ``files``), what the layout was sized from: ``{"records": expected records, "bytes": size}``
    (the manifest's ``input_sizes``: ``packstream repack`` sizes a new layout from them as pack would)."""
    packed: tuple = ()
    """``packstream repack``: the packed folders read in place of their raw inputs
    (:class:`pipeline._job._repack.PackedSource`); () for a pack."""

    def every_shard(self) -> list[tuple[str, int]]:
        """(split, shard) of every shard the run writes, an empty one too: the validation split's only when the run
        has one."""
        splits = ("train", "validation") if self.options.validation_fraction > 0 else ("train",)
        return [(split, s) for split in splits for s in range(self.layout.shards[split])]

    @property
    def output(self) -> str:
        return self.options.output

    @property
    def eos_id(self) -> Optional[int]:
        return self.tokenizer["eos_token_id"]

    @property
    def extension(self) -> str:
        """The shards' file extension."""
        return "parquet" if self.options.output_format.value == "parquet" else "arrow"

    def schema(self):
        """Every shard's schema (:func:`pipeline._write.run_schema`): its rows' and the run's metadata."""
        return _write.run_schema(self.options, self.tokenizer, self.digest)

    def planned_files(self) -> list[str]:
        """The run's journal: every name it may create in the output folder (besides packstream's ``.tmp-*``
        names), known before it starts. The lock holds it, and a failed manifest lists it, so --overwrite
        clears all of it."""
        return self.layout.shard_names(self.extension) + ["rejected.jsonl", "README.md"]

    def input_entries(self) -> list[dict]:
        """The manifest's ``inputs``."""
        return input_entries(self.files)

    def read_files(self) -> tuple[_read.InputFile, ...]:
        """The inputs the run reads, tokenizes and encodes: all of them, but those a repack takes from packed folders."""
        if not self.packed:
            return self.files
        taken = {(f.path, f.split) for src in self.packed for f in src.files}
        return tuple(f for f in self.files if (f.path, f.split) not in taken)


def input_entries(files: Sequence[_read.InputFile]) -> list[dict]:
    """The manifest's ``inputs``: one entry per input file."""
    return [{"path": f.path, "source": f.source, "kind": f.kind, "split": f.split, "dataset": f.dataset} for f in files]


@dataclasses.dataclass(frozen=True)
class Inputs:
    """The inputs as the launcher found them: files, notes, the tokenizer's identity and the total size."""

    files: tuple[_read.InputFile, ...]
    read_once: tuple[str, ...]
    tokenizer: dict
    size: int
    skipped: tuple[_read.Skipped, ...] = ()
    """Files of folder inputs not read, with the reason (:func:`pipeline._read.expand_datasets`)."""
    sizes: tuple[int, ...] = ()
    """Each file's size in bytes (as ``files``)."""


def decide(options: PackOptions, inputs: Inputs, run_id: str, task_bytes: int = _read.TASK_BYTES) -> RunContext:
    """The run's context. Groups and shards per split come from a cheap count of the inputs (exact for local
    JSONL, Parquet and datasets folders; from sizes elsewhere), so they are the same for the same inputs: the
    output is too. ``task_bytes`` only says how the read tasks are cut, which never changes the output."""
    weights = [d.weight for d in options.datasets()]
    expected = [_read.expected_records(f) for f in inputs.files]
    records = sum(n * weights[f.dataset] for n, f in zip(expected, inputs.files))
    sizes = tuple({"records": int(n), "bytes": int(b)} for n, b in zip(expected, inputs.sizes)) \
        if len(inputs.sizes) == len(inputs.files) else ()
    groups, shards = _write.shard_layout(options, records, inputs.size)
    digest = _write.run_digest(options.to_dict(), input_entries(inputs.files), inputs.tokenizer)
    return RunContext(options=options, files=inputs.files, read_once=inputs.read_once, skipped=inputs.skipped,
                      tokenizer=inputs.tokenizer,
                      layout=Layout(groups, shards), run_id=run_id, digest=digest,
                      notes=tuple(_write.shard_cap_notes(options, shards)) + _read.index_notes(inputs.files),
                      spill=_spill.spill_folder(options.output, run_id), task_bytes=task_bytes, sizes=sizes,
                      inputs_from=os.getcwd() if any(_read.relative_input(p) for p in options.inputs) else None)
