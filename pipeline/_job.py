"""The Beam job behind ``packstream pack``: thin composites around the pure functions.

::

    Create(inputs) -> CutTasks -> Spread -> EncodeTasks ------------------------------+
                      (split big     (tasks    read a task, normalize, render,          |
                       files)        over the  tokenize (pipeline._encode), spill the   |
                                     workers)  examples per packing group to disk       |
                                                   |                                     |
                                 Slices: (split, group) -> Slice(group, spill file, batch)
                                                   v                                     |
                                    ByGroup -> PackGroups: per group, on every worker:   |
                                               read it back, de-duplicate, split/        |
                                               truncate, bin-pack, assemble rows, park   |
                                               them in a packed spill file               |
                                                   |                                     |
                                 Pieces: (split, shard) -> Piece(group, packed file, batch)
                                                   v                                     |
                      (every shard) -> ByShard -> WriteShards: per shard, stream its     |
                                                  groups' rows in group order into the   |
                                                  shard file, sha256 as the bytes pass   |
                                                   |                                     |
                                                   v                                     v
                                   Collect (one key) -> Finalize: merge the dead letters,
                                   sum the counts, check they reconcile, then the commit:
                                   the staged shards renamed into place, manifest.json
                                   (complete) and the dataset card; or a failed manifest
                                   and a card that points at no data

Only small values cross a shuffle (tasks, slices, shard descriptions, counts, file names), so
memory does not grow with the input on any runner; tokens move through spill files
(:mod:`pipeline._spill`). Every step has one output (a tagged tuple): runners such as Dask
support nothing more. Nothing a worker finds wrong with the user's data or folder raises: a
corrupt input is a dead letter naming the file, a failed write a ``failure`` value that the
manifest records, and the launcher turns a failed manifest into one ``error:`` line.

The launcher owns the output folder for the run (:mod:`pipeline._output`: the lock holds the
run's journal), puts a guard card in it first, and whatever stops the run (a signal, a runner
error) ends in :func:`_stopped`: a failed manifest and guard card (or the rest of a commit that
was already made), so every reader refuses the folder and ``--overwrite`` can clear it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional, Sequence

import apache_beam as beam
import numpy as np

import packers
from packers import InternalError, PackstreamError
from packers.files import show_path
from packers.manifest import MANIFEST, Status
from pipeline import _dask, _output, _parallel, _pool, _progress, _read, _rows, _signals, _spill, _trace, _write
from pipeline._exit import ExitCode
from pipeline._formats import NOTE_UNITS, Reason
from pipeline._options import PackMode, PackOptions
from pipeline._tokenizer import tokenizer_identity

NS = "packstream"


class TooManyRejected(PackstreamError):
    """The run packed nothing, or rejected more than ``--max-reject-fraction`` (the CLI exits with 3)."""

    def __init__(self, message: str, manifest: Optional[dict] = None):
        super().__init__(message)
        self.manifest = manifest


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the launcher decides before the job starts; every worker gets the same copy."""

    run_id: str
    spill: str
    groups: dict[str, int]
    """Packing groups per split ("train", "validation")."""
    shards: dict[str, int]
    """Output shards per split."""
    schema_metadata: dict
    eos_id: Optional[int]
    run_digest: str = ""
    """The manifest's ``run_id`` (:func:`pipeline._write.run_digest`), also in every shard's schema metadata."""
    task_bytes: int = _read.TASK_BYTES
    """The size of JSONL read tasks (:func:`pipeline._read.task_bytes`): enough tasks for the workers."""
    lanes: int = 0
    """Dask: empty keys shuffled with the read tasks, so that every Dask worker gets some (see
    :mod:`pipeline._dask`); 0 elsewhere."""

    def key(self, example_id: str, fraction: float) -> tuple[str, int, int]:
        """(split, group, shard) of an example: stable hashes of its id."""
        split = _rows.split_of(example_id, fraction)
        group = _rows.group_of(example_id, self.groups[split])
        return split, group, group % self.shards[split]


def _tagged(kind: str, value: Any) -> tuple[str, Any]:
    return (kind, value)


def _only(kind: str):
    return lambda item: [item[1]] if item[0] == kind else []


# ---------------------------------------------------------------------------------------
# Reading and encoding


class EncodeTasks(beam.DoFn):
    """A read task -> its examples spilled per packing group, plus dead letters and counts.

    Yields tagged tuples: ``("slice", ((split, group), Slice))``, ``("rejects", path)``,
    ``("stats", counts)``, ``("failure", message)``. While the tokenizer (Rust, its own threads)
    encodes one chunk, this thread reads, parses and renders the next.
    """

    def __init__(self, options: PackOptions, plan: Plan):
        self.options, self.plan = options, plan
        self.encoder = None
        self.read = _progress.Counter(NS, "records_read")
        self.encoded = _progress.Counter(NS, "records_encoded")
        self.examples = _progress.Counter(NS, "examples_tokenized")
        self.tokens = _progress.Counter(NS, "tokens")

    def setup(self):
        from pipeline._encode import Encoder

        _quiet_worker()
        if self.options.tokenizer_threads:  # before this process's tokenizer first encodes
            os.environ.update(_parallel.tokenizer_env(self.options.tokenizer_threads))
        with _trace.span("encode_setup") as info:
            self.encoder = Encoder(self.options)
            info["process_cpu"] = time.process_time()  # the process's start-up until its tokenizer is ready
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="packstream-tokenize")

    def teardown(self):
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.shutdown(wait=False)

    def process(self, task: _read.ReadTask):
        with _trace.span("encode_task", task=task.name, start=task.start) as info:
            for item in self._process(task):
                if item[0] == "stats":
                    info["records"] = item[1]["records_read"]
                yield item

    def _process(self, task: _read.ReadTask):
        from pipeline._encode import add_counts

        o, plan = self.options, self.plan
        stats: dict[str, int] = {"records_read": 0}
        rejected: list[dict] = []
        held: list = []  # encoded batches not yet spilled
        held_tokens = 0
        parts = 0
        out: list = []

        def spill() -> None:
            nonlocal held, held_tokens, parts
            batch = _rows.ExampleBatch.concat(held)
            held, held_tokens = [], 0
            if not len(batch):
                return
            keys = [plan.key(eid, o.validation_fraction) for eid in batch.ids]
            for split in ("train", "validation"):
                which = [i for i, k in enumerate(keys) if k[0] == split]
                if not which:
                    continue
                sub = batch.take(which)
                groups = np.array([keys[i][1] for i in which], dtype=np.int64)
                for sl in _spill.write_part(plan.spill, f"{task.name}-{parts}", sub, groups):
                    out.append(_tagged("slice", ((split, sl.group), sl)))
                _signals.at("spill")
                stats[f"examples_{split}"] = stats.get(f"examples_{split}", 0) + len(which)
            parts += 1

        def finish(pending) -> None:
            nonlocal held_tokens
            prepared, future, size = pending
            enc = self.encoder.finish(prepared, future.result())
            _signals.at("encode")
            self.encoded.inc(size)
            rejected.extend(enc.rejected)
            add_counts(stats, enc.counts)
            if len(enc.batch):
                held.append(enc.batch)
                held_tokens += enc.batch.num_tokens
                self.examples.inc(len(enc.batch))
                self.tokens.inc(enc.batch.num_tokens)
            if held_tokens >= _spill.SPILL_TOKENS:
                spill()

        pending = None
        try:
            for chunk in self._chunks(task, stats, rejected):
                prepared = self.encoder.prepare(chunk)
                future = self.pool.submit(self.encoder.tokenize, prepared)
                if pending is not None:
                    finish(pending)
                pending = (prepared, future, len(chunk))
                yield from out
                out.clear()
            if pending is not None:
                finish(pending)
            spill()
            path = _write.write_reject_part(plan.spill, task.name, rejected)
        except OSError as e:  # the spill folder (under --output) cannot be written: a typed failure
            yield _tagged("failure", f"cannot write to --output ({type(e).__name__}: {e.strerror or e})")
            return
        yield from out
        if path:
            yield _tagged("rejects", path)
        yield _tagged("stats", stats)
        _progress.flush()

    def _chunks(self, task: _read.ReadTask, stats: dict, rejected: list) -> Iterable[list]:
        f, size = task.file, self.options.batch_size
        chunk: list = []
        position = None
        try:
            for position, record in _read.read_task(task, self.options.max_record_bytes):
                _signals.at("read")
                chunk.append((f.dataset, f.source, position, record))
                if len(chunk) == size:
                    stats["records_read"] += size
                    self.read.inc(size)
                    yield chunk
                    chunk = []
        except _read.CorruptInput as e:
            # Errors as data: the unreadable rest of the file is one dead letter, counted as a record.
            where = 0 if e.position is None else e.position + 1
            rejected.append(_rows.reject_record(f.source, where, Reason.CORRUPT_INPUT, str(e)))
            stats["records_read"] += 1
        if chunk:
            stats["records_read"] += len(chunk)
            self.read.inc(len(chunk))
            yield chunk


def _quiet_worker() -> None:
    """``-q`` reaches worker processes through the environment: silence their logs too."""
    if os.environ.get("PACKSTREAM_QUIET"):
        import logging

        logging.getLogger().setLevel(logging.ERROR)


# ---------------------------------------------------------------------------------------
# Packing and writing


class PackGroups(beam.DoFn):
    """One packing group: read its examples back from the spill, pack them, park the rows for their shard.

    Groups are independent, so every worker packs its share of them. Yields ``("piece", ((split,
    shard), Piece))`` for the shard that writes the rows (global mode: one per shard of the split,
    the rows dealt out round-robin), then the group's dead letters, counts and row checks.
    """

    def __init__(self, options: PackOptions, plan: Plan):
        self.options, self.plan = options, plan
        self.rows = _progress.Counter(NS, "rows")

    def setup(self):
        _quiet_worker()

    def process(self, keyed):
        import pyarrow as pa

        (split, g), slices = keyed
        o, plan = self.options, self.plan
        count = plan.shards[split]
        try:
            _signals.at("pack")
            with _trace.span("pack_group", group=g):
                group = _rows.pack_group(_spill.read_slices(sorted(slices)), o, plan.eos_id)
                batch = group.batch
                if o.mode is PackMode.GROUPED or count == 1:
                    by_shard = {g % count: batch}
                else:  # global mode: one group per split, its rows dealt out round-robin over the split's shards
                    rows = np.arange(batch.num_rows)
                    by_shard = {s: batch.take(pa.array(rows[rows % count == s])) for s in range(count)}
                pieces = _spill.write_packed(plan.spill, f"{split}-{g}", g, by_shard)
                path = _write.write_reject_part(plan.spill, f"group-{split}-{g}", group.rejected)
        except OSError as e:
            yield _tagged("failure", f"cannot write to --output ({type(e).__name__}: {e.strerror or e})")
            return
        self.rows.inc(batch.num_rows)
        _progress.flush()
        for shard, piece in pieces:
            yield _tagged("piece", ((split, shard), piece))
        if path:
            yield _tagged("rejects", path)
        yield _tagged("stats", group.stats)
        yield _tagged("flags", {"eos_at_boundaries": group.eos_at_boundaries, "all_targets": group.all_targets})


class WriteShards(beam.DoFn):
    """One shard: stream its groups' packed rows, in group order, into the file (hashed as it goes)."""

    def __init__(self, options: PackOptions, plan: Plan):
        self.options, self.plan = options, plan

    def setup(self):
        _quiet_worker()

    def process(self, keyed):
        import pyarrow as pa

        (split, shard), values = keyed
        o, plan = self.options, self.plan
        pieces = sorted(v for v in values if v is not None)
        schema = pa.schema(packers.SCHEMA, metadata=plan.schema_metadata)
        ext = "parquet" if o.output_format.value == "parquet" else "arrow"
        writer = None
        try:
            with _trace.span("write_shard", shard=shard, pieces=len(pieces)):
                writer = _write.ShardWriter(o.output, _write.shard_name(split, shard, plan.shards[split], ext),
                                            schema, o.output_format.value)
                for piece in pieces:
                    if piece.rows:
                        writer.write(_spill.read_piece(piece))
                        _signals.at("shard_write")
                desc = writer.close(split)
                _signals.at("shard_write")
        except BaseException as e:
            if writer is not None:  # a failed attempt leaves no temp file (a retry writes its own)
                writer.abort()
            if not isinstance(e, OSError):
                raise
            yield _tagged("failure", f"cannot write to --output ({type(e).__name__}: {e.strerror or e})")
            return
        yield _tagged("shard", desc)


# ---------------------------------------------------------------------------------------
# The commit


class Finalize(beam.DoFn):
    """Everything the steps reported -> rejected.jsonl, README.md and, last, manifest.json."""

    def __init__(self, options: PackOptions, plan: Plan, identity: dict, files: Sequence[_read.InputFile], notes):
        self.options, self.plan, self.identity, self.files, self.notes = options, plan, identity, files, notes

    def process(self, keyed):
        _, items = keyed
        with _trace.span("finalize"):
            manifest = finalize(self.options, self.plan, self.identity, self.files, self.notes, list(items))
        yield manifest.get("status")


def finalize(options: PackOptions, plan: Plan, identity: dict, files, notes, items: list) -> dict:
    o = options
    stats: dict[str, int] = {}
    shards, parts, failures = [], [], []
    flags = {"eos_at_boundaries": True, "all_targets": True}
    for kind, value in items:
        if kind == "stats":
            for k, v in value.items():
                stats[k] = stats.get(k, 0) + v
        elif kind == "shard":
            shards.append(value)
        elif kind == "rejects":
            parts.append(value)
        elif kind == "failure":
            failures.append(value)
        elif kind == "flags":
            for k in flags:
                flags[k] &= value[k]
    shards.sort(key=lambda s: s["name"])
    try:
        rejected, first = _write.merge_rejected(o.output, parts) if not failures else ({}, {})
    except OSError as e:
        failures.append(f"cannot write to --output ({type(e).__name__}: {e.strerror or e})")
        rejected, first = {}, {}
    _signals.at("commit")
    counts = _counts(o, stats, shards, rejected, first, check=not failures)
    status, error, code = Status.COMPLETE.value, None, 0
    if failures:
        status, error, code = Status.FAILED.value, failures[0], ExitCode.USER_ERROR
    elif counts["records_read"] == 0:
        shown = ", ".join(f.path for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        status, error, code = Status.FAILED.value, f"the inputs hold no records ({shown}); check that they are the " \
                                                   "files you meant", ExitCode.USER_ERROR
    else:
        _reconcile(counts)
        dropped = counts["rejected"] + counts["dropped_too_long"]
        frac = dropped / counts["records_read"]
        if counts["examples_packed"] == 0:
            status, error, code = Status.FAILED.value, (
                f"no example was packed: all {counts['records_read']:,} records were rejected or dropped "
                f"({_top_reasons(counts)}); see {o.output}/rejected.jsonl, or try `packstream preview` on the inputs"
            ), ExitCode.REJECTED
        elif frac > o.max_reject_fraction:
            status, error, code = Status.FAILED.value, (
                f"{frac:.1%} of {counts['records_read']:,} records were rejected or dropped ({_top_reasons(counts)}), "
                f"more than --max-reject-fraction {o.max_reject_fraction:.1%}; see {o.output}/rejected.jsonl"
            ), ExitCode.REJECTED
    _signals.at("commit")
    try:
        if status == Status.COMPLETE.value:
            shards = _write.publish(o.output, shards)  # the shards take their names; the manifest says they are whole
            written = [s["name"] for s in shards] + ["rejected.jsonl", "README.md"]
        else:  # nothing is published; the manifest lists everything the run may have left (--overwrite removes it)
            _write.discard(shards)
            shards, written = [], planned_files(o, plan)
        manifest = _manifest(o, plan, identity, files, notes, status, counts, shards, written, flags)
        if status != Status.COMPLETE.value:
            manifest.update(error=error, exit_code=code)
        commit(o.output, manifest)
    except OSError as e:
        manifest = _manifest(o, plan, identity, files, notes, Status.FAILED.value, counts, [], planned_files(o, plan),
                             flags)
        manifest.update(status=Status.FAILED.value, exit_code=ExitCode.USER_ERROR,
                        error=f"cannot write to --output ({type(e).__name__}: {e.strerror or e})")
        _record_outcome(manifest)
    _remove_spill(plan.spill)
    return manifest


def commit(output: str, manifest: dict) -> None:
    """Write the run's end into the folder: the order is what every reader sees at every instant.

    complete: (the shards already renamed into place: :func:`pipeline._write.publish`)
              manifest.json (atomic), then the dataset card that points at the shards. Until the
              card is written, the guard card written at the claim keeps ``datasets.load_dataset``
              out, and the lock keeps ``PackedDataset`` and ``verify`` out; the lock goes last.
    failed:   the guard card with the reason, then the failed manifest.

    A signal that arrives in between is held until both are written. A complete manifest whose
    card cannot be written is turned back into a failed one (best effort; the lock stays if not).
    """
    body = (json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
    card = _write.dataset_card(manifest).encode()
    readme, path = _write.join(output, "README.md"), _write.join(output, MANIFEST)
    with _signals.deferred():
        if manifest["status"] != Status.COMPLETE.value:
            _write.write_atomic(readme, card)
            _write.write_atomic(path, body)
            return
        _write.write_atomic(path, body)  # the commit
        try:
            _write.write_atomic(readme, card)
        except OSError:
            failed = {**manifest, "status": Status.FAILED.value, "exit_code": ExitCode.USER_ERROR,
                      "error": "the dataset card README.md could not be written after the manifest"}
            try:
                _write.write_atomic(path, (json.dumps(failed, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode())
            except OSError:
                pass
            raise


def _manifest(o: PackOptions, plan: Plan, identity: dict, files, notes, status: str, counts: dict, shards: list,
              written: list, flags: dict) -> dict:
    return {
        "status": status,
        "packstream_version": _version(),
        "contract_version": packers.CONTRACT_VERSION,
        "config": o.to_dict(),
        "tokenizer": identity,
        "run_id": plan.run_digest,
        "inputs": _input_entries(files),
        "inputs_read_once": list(notes),
        "counts": counts,
        "shards": shards,
        "files": written,
        "row_checks": {
            "budget": o.max_tokens,
            "eos_token_id": plan.eos_id,
            "eos_at_boundaries": bool(flags["eos_at_boundaries"] and plan.eos_id is not None),
            "targets_in_every_sequence": True,
            "all_targets": bool(flags["all_targets"] and counts["tokens"] > 0),
            "pairs": o.pairs,
        },
        "rejected_file": "rejected.jsonl",
    }


def planned_files(o: PackOptions, plan: Plan) -> list[str]:
    """The run's journal: every name it may create in the output folder (besides packstream's ``.tmp-*`` names),
    known before it starts. The lock holds it, and a failed manifest lists it, so --overwrite clears all of it."""
    ext = "parquet" if o.output_format.value == "parquet" else "arrow"
    shards = [_write.shard_name(split, i, n, ext) for split, n in sorted(plan.shards.items()) for i in range(n)]
    return shards + ["rejected.jsonl", "README.md"]


def _record_outcome(manifest: dict) -> None:
    """Where the manifest cannot be written (a full disk), a local launcher still learns why."""
    path = os.environ.get("PACKSTREAM_OUTCOME")
    if path:
        try:
            with open(path, "w") as f:
                json.dump({k: manifest[k] for k in ("status", "error", "exit_code")}, f)
        except OSError:
            pass


def _remove_spill(folder: str) -> None:
    try:
        if "://" in folder:
            from apache_beam.io.filesystems import FileSystems

            found = [m.path for m in FileSystems.match([folder.rstrip("/") + "/**"])[0].metadata_list]
            if found:
                FileSystems.delete(found)
        else:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
    except Exception:  # noqa: BLE001 - best effort: --overwrite removes .tmp-* leftovers
        pass


def _top_reasons(counts: dict, k: int = 3) -> str:
    reasons = dict(counts["rejected_by_reason"])
    if counts["dropped_too_long"]:
        reasons["too_long"] = counts["dropped_too_long"]
    top = sorted(reasons.items(), key=lambda kv: -kv[1])[:k]
    return ", ".join(f"{r} {n:,}" for r, n in top) or "no reason recorded"


def _counts(o: PackOptions, stats: dict, shards: list, rejected: dict, first: dict, check: bool = True) -> dict:
    """The manifest's counts. ``check``: the shards must hold what packing made (not after a failed write)."""
    budget = o.max_tokens
    too_long = rejected.get(Reason.TOO_LONG.value, 0)
    rows = sum(s["rows"] for s in shards)
    tokens = sum(s["tokens"] for s in shards)
    notes = {k: v for k, v in stats.items() if k in _NOTES or k.startswith("ignored_field:")}
    counts = {
        "records_read": stats.get("records_read", 0),
        "not_sampled": stats.get("not_sampled", 0),
        "repeated_copies": stats.get("repeated_copies", 0),
        "extra_paths": stats.get("extra_paths", 0),
        "examples_packed": stats.get("examples_packed", 0),
        "rejected": sum(v for k, v in rejected.items() if k != Reason.TOO_LONG.value),
        "rejected_by_reason": {k: v for k, v in rejected.items() if k != Reason.TOO_LONG.value},
        "first_rejected": {k: {"source": v["source"], "position": v["position"], "detail": v["detail"]}
                           for k, v in first.items()},
        "dropped_too_long": too_long,
        "dropped_too_long_tokens": stats.get("dropped_too_long_tokens", 0),
        "truncated_examples": stats.get("truncated_examples", 0),
        "truncated_tokens": stats.get("truncated_tokens", 0),
        "split_examples": stats.get("split_examples", 0),
        "no_target_pieces": stats.get("no_target_pieces", 0),
        "no_target_piece_tokens": stats.get("no_target_piece_tokens", 0),
        "pieces": sum(s["examples"] for s in shards),
        "rows": rows,
        "tokens": tokens,
        "target_tokens": sum(s["target_tokens"] for s in shards),
        "lower_bound": math.ceil(tokens / budget) if tokens else 0,
        "fill": tokens / (rows * budget) if rows else 0.0,
        "examples_per_row": sum(s["examples"] for s in shards) / rows if rows else 0.0,
        "splits": {sp: {"rows": sum(s["rows"] for s in shards if s["split"] == sp),
                        "tokens": sum(s["tokens"] for s in shards if s["split"] == sp)}
                   for sp in sorted({s["split"] for s in shards})},
        "normalization": dict(sorted(notes.items())),
    }
    if check and (stats.get("pieces", counts["pieces"]) != counts["pieces"] or stats.get("rows", rows) != rows):
        raise InternalError(f"shards hold {rows} rows / {counts['pieces']} pieces, packing made "
                            f"{stats.get('rows')} / {stats.get('pieces')}")
    return counts


_NOTES = tuple(NOTE_UNITS)
"""What normalization did to records that were kept (pipeline._formats), summed into counts.normalization."""


def _reconcile(c: dict) -> None:
    """Every record is packed, rejected, dropped for length, or not sampled (copies, and the paths of a message
    tree beyond its first, count as records too)."""
    given = c["records_read"] + c["repeated_copies"] + c["extra_paths"]
    accounted = c["examples_packed"] + c["rejected"] + c["dropped_too_long"] + c["not_sampled"]
    if given != accounted:
        raise InternalError(
            f"counts do not reconcile: read {c['records_read']} + copies {c['repeated_copies']} + extra tree paths "
            f"{c['extra_paths']} != packed "
            f"{c['examples_packed']} + rejected {c['rejected']} + dropped for length {c['dropped_too_long']} "
            f"+ not sampled {c['not_sampled']}"
        )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("packstream")
    except PackageNotFoundError:
        return "0+unknown"


# ---------------------------------------------------------------------------------------
# The launcher


def _plan(options: PackOptions, files: Sequence[_read.InputFile], identity: dict, run_id: str, size: int,
          task_bytes: int = _read.TASK_BYTES, lanes: int = 0) -> Plan:
    """Groups and shards per split, from a cheap count of the inputs (exact for local JSONL, Parquet
    and datasets folders; from sizes elsewhere; ``size``: their bytes). Deterministic for the same
    inputs: the output is too. ``task_bytes`` and ``lanes`` only say how the read tasks are cut and
    spread, which never changes the output."""
    weights = [d.weight for d in options.datasets()]
    records = sum(_read.expected_records(f) * weights[f.dataset] for f in files)
    groups, shards = _write.shard_layout(options, records, size)
    digest = _write.run_digest(options.to_dict(), _input_entries(files), identity)
    meta = packers.schema_metadata(budget=options.max_tokens, tokenizer=identity["name"],
                                   vocab_sha256=identity["vocab_sha256"], pad_token_id=identity["pad_token_id"],
                                   eos_token_id=identity["eos_token_id"], run_id=digest)
    return Plan(run_id, _spill.spill_folder(options.output, run_id), groups, shards, meta, identity["eos_token_id"],
                run_digest=digest, task_bytes=task_bytes, lanes=lanes)


def _input_entries(files: Sequence[_read.InputFile]) -> list[dict]:
    """The manifest's ``inputs``."""
    return [{"path": f.path, "source": f.source, "kind": f.kind, "split": f.split, "dataset": f.dataset} for f in files]


DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"


def beam_option_parser():
    """Beam's option parser (every registered option class) whose errors are one PackstreamError line.

    Beam's own parser prints its whole usage (~130 lines) and exits; a packstream user gets the
    one line that names the option, instead.
    """
    from apache_beam.options.pipeline_options import PipelineOptions, _BeamArgumentParser

    class Parser(_BeamArgumentParser):
        def error(self, message: str):  # argparse calls this on a bad value; it must not return
            what = message.removeprefix("argument ")
            if what.startswith("--runner") and "expected one argument" in what:
                raise PackstreamError(f"--runner needs a runner name: --runner=NAME (e.g. {_RUNNER_EXAMPLES})")
            raise PackstreamError(f"Beam option {what}; give it as --name=value (see Beam's pipeline options)")

    parser = Parser(allow_abbrev=False)
    seen = {}
    for cls in PipelineOptions.__subclasses__():
        seen.setdefault(str(cls), cls)
    for cls in seen.values():
        cls._add_argparse_args(parser)  # the same parser Beam builds in get_all_options()
    return parser


_RUNNER_EXAMPLES = "DataflowRunner, DaskRunner, FlinkRunner, PortableRunner"


def runner_names() -> list[str]:
    """The runner names --runner takes (besides a PipelineRunner subclass's full class path)."""
    from apache_beam.options.pipeline_options import StandardOptions

    return sorted({*StandardOptions.KNOWN_RUNNER_NAMES, "DaskRunner"})


def _runner_value(beam_args: Sequence[str], i: int) -> tuple[Optional[str], int]:
    """The value of the runner option at ``beam_args[i]`` (``--runner=X`` or ``--runner X``) and the tokens it spans."""
    a = beam_args[i]
    if a.startswith("--runner="):
        return a.split("=", 1)[1], 1
    if a == "--runner":
        if i + 1 >= len(beam_args) or beam_args[i + 1].startswith("-"):
            raise PackstreamError(f"--runner needs a runner name: --runner=NAME (e.g. {_RUNNER_EXAMPLES})")
        return beam_args[i + 1], 2
    return None, 1


def _check_runner(name: str) -> str:
    """``NAME`` as Beam is to get it (DaskRunner: its class path), or a PackstreamError naming the choices."""
    import importlib

    from apache_beam.runners.runner import _RUNNER_MAP, PipelineRunner

    choices = f"use one of {', '.join(runner_names())}, or the full class path of a PipelineRunner subclass"
    if not name.strip():
        raise PackstreamError(f"--runner is empty; {choices}")
    if name.lower() in ("daskrunner", "dask"):
        try:
            import dask.distributed  # noqa: F401
        except ImportError:
            raise PackstreamError("--runner=DaskRunner needs dask.distributed: pip install 'packstream[dask]'") from None
        importlib.import_module("apache_beam.runners.dask.dask_runner")  # registers --dask_client_address, ...
        return DASK_RUNNER
    # Beam's own lookup (apache_beam.runners.runner.create_runner): a short name, with or without "Runner".
    path = _RUNNER_MAP.get(name.lower(), _RUNNER_MAP.get(name.lower() + "runner", name))
    if "." not in path:
        raise PackstreamError(f"--runner {name!r} is not a Beam runner; {choices}")
    module, cls_name = path.rsplit(".", 1)
    try:
        cls = getattr(importlib.import_module(module), cls_name, None)
    except Exception as e:  # noqa: BLE001 - ImportError, or a runner module that fails with this environment
        extra = "gcp" if "dataflow" in path.lower() else "interactive" if "interactive" in path.lower() else None
        fix = f"pip install 'apache-beam[{extra}]'" if extra else "install the package that provides it"
        raise PackstreamError(f"--runner {name}: cannot import {module} ({type(e).__name__}: {e}); {fix}") from None
    if not (isinstance(cls, type) and issubclass(cls, PipelineRunner)):
        raise PackstreamError(f"--runner {name!r}: {path} is not a PipelineRunner subclass; {choices}")
    return name


def runner_args(beam_args: Sequence[str]) -> list[str]:
    """Beam's options with the runner checked and spelled ``--runner=NAME``; a bad runner is a PackstreamError.

    ``--runner=X`` and ``--runner X`` both work; ``DaskRunner`` (not in Beam's registry of short
    names) becomes Beam's class path. An unknown runner is one error naming the choices.
    """
    out: list[str] = []
    i = 0
    while i < len(beam_args):
        name, span = _runner_value(beam_args, i)
        if name is None:
            out.append(beam_args[i])
        else:
            out.append(f"--runner={_check_runner(name)}")
        i += span
    return out


def pipeline_options(beam_args: Sequence[str], workers: int):
    """Beam options plus the runner: FnApiRunner locally (never Prism, which downloads a binary)."""
    from apache_beam.options.pipeline_options import PipelineOptions

    args = runner_args(beam_args)
    beam_option_parser().parse_known_args(args)  # a bad value: one error line, not Beam's usage and exit
    runner = None
    if not any(a.startswith("--runner=") for a in args):
        runner = local_runner(workers)
        if workers > 1:
            args += [f"--direct_num_workers={workers}"]
    return PipelineOptions(args, pipeline_type_check=True), runner


def local_runner(workers: int, command: Optional[str] = None):
    """FnApiRunner: in this process for one worker; else Beam's multi_processing mode, whose workers run
    ``command`` (default: packstream's cold worker entry point, quiet under -q)."""
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner

    if workers <= 1:
        return FnApiRunner()
    import sys

    from apache_beam.transforms.environments import SubprocessSDKEnvironment

    command = command or _signals.worker_command()  # quiet under -q; SIGINT/SIGHUP ignored from exec on
    return FnApiRunner(default_environment=SubprocessSDKEnvironment.from_command_string(command))


def _cut_tasks(f: _read.InputFile, task_bytes: int) -> list[_read.ReadTask]:
    with _trace.span("plan_reads", source=f.source) as info:
        tasks = _read.cut_tasks(f, task_bytes)
        info["tasks"] = len(tasks)
    return tasks


def build(p, options: PackOptions, plan: Plan, identity: dict, files, notes) -> None:
    """The job graph (see the module docstring)."""
    splits = [s for s in ("train", "validation") if s == "train" or options.validation_fraction > 0]
    tasks = (
        p
        | "Inputs" >> beam.Create(files)
        | "CutTasks" >> beam.FlatMap(_cut_tasks, plan.task_bytes)
        | "KeyTasks" >> beam.Map(lambda t: (t.name, t))
    )
    if plan.lanes:  # Dask: a shuffle keeps its input's partitions, so give it plan.lanes more (Create splits)
        lanes = p | "Lanes" >> beam.Create([(f"lane-{i}", None) for i in range(plan.lanes)])
        tasks = (tasks, lanes) | "WithLanes" >> beam.Flatten()
    encoded = (
        tasks
        | "Spread" >> beam.GroupByKey()
        | "Tasks" >> beam.FlatMap(lambda kv: [t for t in kv[1] if t is not None])
        | "EncodeTasks" >> beam.ParDo(EncodeTasks(options, plan))
    )
    packed = (
        encoded
        | "Slices" >> beam.FlatMap(_only("slice"))
        | "ByGroup" >> beam.GroupByKey()
        | "PackGroups" >> beam.ParDo(PackGroups(options, plan))
    )
    every = [((sp, s), None) for sp in splits for s in range(plan.shards[sp])]
    written = (
        (packed | "Pieces" >> beam.FlatMap(_only("piece")), p | "EveryShard" >> beam.Create(every))
        | "AllPieces" >> beam.Flatten()
        | "ByShard" >> beam.GroupByKey()
        | "WriteShards" >> beam.ParDo(WriteShards(options, plan))
    )
    (
        (encoded | "Reports" >> beam.Filter(lambda item: item[0] != "slice"),
         packed | "PackReports" >> beam.Filter(lambda item: item[0] != "piece"), written)
        | "Everything" >> beam.Flatten()
        | "OneKey" >> beam.Map(lambda item: (None, item))
        | "Collect" >> beam.GroupByKey()
        | "Finalize" >> beam.ParDo(Finalize(options, plan, identity, files, notes))
    )


def run(options: PackOptions, beam_args: Sequence[str] = (), progress: Optional[_progress.Progress] = None) -> dict:
    """Build and run the whole job; returns the manifest. Raises PackstreamError on user error.

    ``progress`` reports a local run while it runs (see :mod:`pipeline._progress`); it never
    changes the output. A Flex Template launch (``--template_location``) only writes the job
    graph: Dataflow runs it later (and writes the manifest), so this returns the config.

    Stopped by a signal (the CLI handles SIGINT, SIGTERM and SIGHUP: :mod:`pipeline._signals`),
    it raises :class:`~pipeline._signals.Interrupted` once the folder is a failed output.
    """
    from apache_beam.options.pipeline_options import GoogleCloudOptions, StandardOptions

    started = time.time()
    output = _output.normalize_output(options.output)
    options = dataclasses.replace(options, output=output)
    _trace.mark("launch", process_cpu=time.process_time())
    with _trace.span("launch_inputs"):
        files, notes = _read.expand_datasets(options.datasets())
    with _trace.span("launch_tokenizer"):
        identity = tokenizer_identity(options.tokenizer, options.trust_remote_code)
        _check_launch(options, identity)
    sizes = [_read.input_bytes(f) for f in files]
    size = sum(sizes)
    par = _parallel.choose(options.workers, options.tokenizer_threads, size)
    pipe_opts, runner = pipeline_options(beam_args, par.workers)
    local = runner is not None
    task_bytes, lanes = _read.task_bytes(size, par.workers if local else None), 0
    if pipe_opts.view_as(StandardOptions).runner == DASK_RUNNER:
        task_bytes, lanes = _dask.layout(pipe_opts, files, sizes)
    if local:  # every worker process (this one for one worker) takes its share of the cores for the tokenizer
        options = dataclasses.replace(options, workers=par.workers, tokenizer_threads=par.threads)
    template = pipe_opts.view_as(GoogleCloudOptions).template_location
    run_id = uuid.uuid4().hex[:12]
    with _trace.span("launch_plan", workers=par.workers, threads=par.threads):
        plan = _plan(options, files, identity, run_id, size, task_bytes, lanes)
    inputs = [f.path for f in files] + [_glob_root(p) for d in options.datasets() for p in d.paths]
    outcome_path = os.path.join(_tempdir(), f"packstream-outcome-{run_id}.json")
    env = {"PACKSTREAM_OUTCOME": outcome_path, _signals.LAUNCHER_ENV: str(os.getpid()),
           **(par.env() if local else {})}
    saved = {k: os.environ.get(k) for k in env}
    claim = result = None
    pool, finished = None, False
    try:
        _signals.at("launch")
        if not template:
            with _signals.deferred():  # the lock, its journal, the guard card and the clearing happen whole
                claim = _output.claim(output, inputs, options.overwrite, run_id, planned_files(options, plan))
            _signals.set_last_words(f"interrupted again while stopping; {show_path(output)} holds a partial output and "
                                    "the run's lock: run again with --overwrite")
            _signals.at("launch")
        os.environ.update(env)
        if local and par.workers > 1:  # warm workers, forked now: before any thread or server starts here
            with _trace.span("launch_pool", workers=par.workers):
                pool = _pool.start(par.workers)
            if pool is not None:
                runner = local_runner(par.workers, pool.command)
        with _progress.watching(progress, files, local=runner is not None, budget=options.max_tokens):
            try:
                p = beam.Pipeline(runner=runner, options=pipe_opts)
                build(p, options, plan, identity, files, notes)
                with _trace.span("job"):
                    result = p.run()
                try:
                    with _trace.span("job_wait"):
                        result.wait_until_finish()
                    finished = True
                finally:
                    client = getattr(result, "client", None)  # DaskRunner: close the client (and a local cluster)
                    if client is not None:
                        client.close()
            except PackstreamError:
                raise
            except Exception:  # a runner error: our typed outcome (if any) says more than its text
                if _signals.received() is not None:
                    raise
                outcome = _read_outcome(outcome_path)
                if outcome:
                    raise PackstreamError(outcome["error"]) from None
                raise
        if template and runner is None:  # DataflowRunner wrote the job graph there and submitted nothing
            return {"config": options.to_dict(), "template_location": template}
        manifest = _read_manifest(output, outcome_path)
    except BaseException as e:
        signum = _signals.received()
        if pool is not None:  # the forked workers stop before the folder is made to explain itself
            pool.close(kill=True)
            pool = None
        if claim is None:
            if signum is not None:
                raise _signals.Interrupted(signum, f"interrupted by {_signals.name(signum)} before anything was "
                                                   f"written to {show_path(output)}") from None
            raise
        if signum is not None:
            _cancel(result)
        why = (f"interrupted by {_signals.name(signum)}" if signum is not None else
               str(e) if isinstance(e, PackstreamError) else f"the run stopped: {type(e).__name__}: {e}")
        code = _signals.exit_code(signum) if signum is not None else ExitCode.USER_ERROR
        state = _stopped(options, plan, identity, files, notes, claim, why, code)
        if signum is not None:
            raise _signals.Interrupted(signum, _interrupted_message(signum, output, state)) from None
        raise
    finally:
        if pool is not None:
            pool.close(kill=not finished)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            os.remove(outcome_path)
        except OSError:
            pass
        _remove_spill(plan.spill)
    if claim is not None:
        claim.release()
    manifest["elapsed_s"] = round(time.time() - started, 3)
    if manifest["status"] != Status.COMPLETE.value:
        if manifest.get("exit_code") == ExitCode.REJECTED:
            raise TooManyRejected(manifest["error"], manifest)
        raise PackstreamError(manifest.get("error") or "the run failed")
    return manifest


def _stopped(options: PackOptions, plan: Plan, identity: dict, files, notes, claim, why: str, code: int) -> str:
    """After a run stopped without its commit (a signal, a runner error): make the folder explain itself.

    The workers have stopped (Beam's teardown, or :func:`pipeline._signals.stop_workers`), so nothing
    else writes here now. A complete manifest means the commit was made: its card is (re)written and
    the run counts as done ("complete"). A failed one stays ("failed"). Otherwise a failed manifest
    listing the run's journal and a guard card are written ("failed"). The lock goes only when a
    manifest is there; if it cannot be written, the lock stays ("locked"): a killed run's lock,
    which ``--overwrite`` breaks.
    """
    state = "locked"
    with _signals.deferred():
        try:
            m = _written_manifest(options.output)
            if m is not None and m.get("status") == Status.COMPLETE.value:
                _write.write_atomic(_write.join(options.output, "README.md"), _write.dataset_card(m).encode())
                state = "complete"
            elif m is not None:
                state = "failed"
            else:
                counts = _counts(options, {}, [], {}, {})
                manifest = _manifest(options, plan, identity, files, notes, Status.FAILED.value, counts, [],
                                     planned_files(options, plan), {"eos_at_boundaries": True, "all_targets": True})
                manifest.update(error=why, exit_code=code)
                commit(options.output, manifest)
                state = "failed"
        except Exception:  # noqa: BLE001 - a folder we cannot write: the lock stays and says so
            pass
        _remove_spill(plan.spill)
        if state != "complete":
            _output.remove_temporaries(options.output)  # staged shards, dead-letter parts: nothing will publish them
        if state != "locked":
            claim.release()
        else:
            claim.leave()
    return state


def _written_manifest(output: str) -> Optional[dict]:
    """The manifest this run wrote, as JSON (the folder was cleared at the claim: any manifest there is this run's,
    written whole by an atomic rename); None when there is none or it cannot be read."""
    from packers.files import GiB, load_json, read_checked

    try:
        raw = load_json(read_checked(_write.join(output, MANIFEST), what=MANIFEST, limit=GiB, opener=_write.beam_open),
                        what=MANIFEST)
    except (OSError, PackstreamError):
        return None
    return raw if isinstance(raw, dict) else None


def _interrupted_message(signum: int, output: str, state: str) -> str:
    what = f"interrupted by {_signals.name(signum)}"
    out = show_path(output)
    if state == "complete":
        return f"{what} after the output was committed: {out} is complete (packstream verify {out} checks it)"
    if state == "failed":
        return (f"{what}; {out} holds no complete output (its manifest.json says failed, and readers refuse it): "
                "run the same command with --overwrite to pack again")
    return (f"{what}; {out} holds a partial output and the run's lock (it could not be marked failed): "
            "run the same command with --overwrite to clear it and pack again")


def _cancel(result) -> None:
    """A remote job keeps running after its launcher stops: cancel it (best effort)."""
    if result is None:
        return
    try:
        result.cancel()
    except Exception:  # noqa: BLE001 - local runners have nothing to cancel; remote ones may refuse
        pass


def _check_launch(options: PackOptions, identity: dict) -> None:
    """What every worker would find wrong alike is found here, once, as one error: the chat template
    (empty, not compiling, or never ending), an EOS token the vocabulary does not hold as one token.
    A tokenizer without an EOS gets a warning: examples then end without one."""
    from pipeline._render import Renderer
    from pipeline._tokenizer import check_eos, load_tokenizer

    Renderer(options)  # raises PackstreamError; the tokenizer is already loaded (cached per process)
    check_eos(load_tokenizer(options.tokenizer, options.trust_remote_code), identity["name"])
    if identity["eos_token"] is None and not os.environ.get("PACKSTREAM_QUIET"):
        import sys

        print(f"warning: tokenizer {show_path(identity['name'])} has no EOS token, so examples are packed without one "
              "and a model trained on them does not learn where an answer ends; set \"eos_token\" in its "
              "tokenizer_config.json", file=sys.stderr)


def _glob_root(pattern: str) -> str:
    """The folder a glob starts from (the pattern itself when it has no wildcard): an input the output must avoid."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if any(c in part for c in "*?[") and not os.path.exists(pattern):
            return "/".join(parts[:i]) or "."
    return pattern


def _tempdir() -> str:
    import tempfile

    return tempfile.gettempdir()


def _read_outcome(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_manifest(output: str, outcome_path: str) -> dict:
    try:
        return _write.read_manifest(output).raw
    except (OSError, PackstreamError) as e:
        outcome = _read_outcome(outcome_path)
        if outcome:
            return outcome
        raise PackstreamError(f"the run ended without writing {output}/{MANIFEST} ({e}); see the messages above") from None
