"""Predict a packing job from a sample of its inputs: ``packstream estimate`` (``pack --estimate``).

For each input, the readers' :func:`pipeline._read.sample` takes about ``k`` records spread over
the whole file, read as the job reads them, and counts the records (exactly where that is cheap;
otherwise file bytes / sampled bytes per record). :func:`estimate` then runs the job's own stages
on the sample: the encode stage (:meth:`pipeline._encode.Encoder.encode`: normalize, render,
tokenize, sample or repeat per data set) and the long-example policy (:func:`pipeline._rows.pieces`),
and extrapolates::

    per input f     N_f records (counted or projected), k_f sampled; scale_f = N_f / k_f
    counts          rejected by reason, not sampled, repeated copies, dropped for length,
                    truncated / split: what the sample gives, times scale_f
    splits          each sampled example goes to the split the job would put it in (a stable
                    hash of its id; its copies and pieces with it)
    tokens, pieces  per split: sum_f scale_f * (the sample's pieces, after --long)
    rows, fill      per split: packers.pack_stream on piece lengths resampled to the projected
                    count (capped at _SIM_CAP), in as many groups as the job plans
                    (pipeline._write.shard_layout), scaled back up
    shards          pipeline._write.shard_layout: --num-shards, else one per SHARD_TOKENS
                    tokens of input bytes, never more than the groups
    output bytes    shards * (an empty shard's bytes) + tokens * (bytes per token of a real shard
                    written from the packed sample, pipeline._write.ShardWriter)
    local time      a timed pack (``timed_run``, the job's own runner with the run's workers and
                    threads) of ~TIMED_RECORDS sampled records, split by its trace (pipeline._trace)
                    into a fixed part, read tasks and packing-and-writing:
                      fixed (start-up, the workers, the commit) + tokenizer load
                      + read tasks: sum_f N_f * (f's sampled seconds per record) * calibration,
                        spread over the workers; calibration = the timed pack's read-task seconds /
                        the same records' seconds in the sample (the runner's per-record cost, the load)
                      + packing and writing: the timed pack's, per token
                    Without ``timed_run`` (the library call), the sample's seconds per record plus
                    fixed guesses (_UNTIMED_*), with no error bound.

Sizes are computed in bytes and shown in binary units (KiB, MiB, GiB: powers of 1024).
Duplicate ids are not detected from a sample; the prediction assumes none.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

import packers
from packers import PackstreamError
from pipeline._workers import parallel as _parallel
import pipeline._read as _read
import pipeline._rows as _rows
import pipeline._write as _write
from pipeline._formats import Reason
from pipeline._options import PackMode, PackOptions

_SIM_CAP = 1_000_000
"""Most lengths simulated by packers.pack; beyond it, rows are scaled from the simulation."""
TIMED_RECORDS = 2000
"""Records of the timed sample pack, spread over the inputs by their record counts: ~1-2 s of read tasks on
2 cores, long enough to measure the job's per-record cost, short enough for a quick estimate."""
TIME_ERROR = 0.25
"""The error bound shown with a run time calibrated by a timed pack: what ``bench/bench_estimate.py`` checks
(predicted / real within 1 +- this on ../shared/data and 6x the shared mix, 2 cores shared with other work).
Other load on the machine moves a real run by about as much."""
# Without a timed pack (estimate() called without timed_run): fixed guesses for the runner's cost on top of the
# functions timed on the sample (start-up, moving record chunks between steps, packing and writing per token).
_UNTIMED_STARTUP_S = 2.0
_UNTIMED_PER_RECORD_S = 30e-6
_UNTIMED_PER_TOKEN_S = 0.2e-6
ESTIMATE_SCHEMA_VERSION = 6


# ---------------------------------------------------------------------------------------
# The sample through the job's stages


@dataclasses.dataclass
class _Encoded:
    """One input's sample after the encode stage and the --long policy."""

    sample: _read.Sample
    rejected: dict[str, int]
    """Dead letters by reason (too_long excluded: ``counts["dropped_too_long"]``)."""
    first: dict[str, dict]
    """The first dead letter of each reason in the sample (source, position, detail), as the manifest's
    ``first_rejected``: its detail names the fix ``pack`` prints."""
    counts: dict[str, int]
    """not_sampled, repeated_copies, dropped_too_long, truncated_examples, split_examples,
    no_target_pieces, examples_packed."""
    lengths: np.ndarray
    """Tokens of every piece that would be packed (with --pairs: of every pair, its two sides together)."""
    targets: np.ndarray
    """Target tokens of every piece."""
    validation: np.ndarray
    """bool per piece: it goes to the validation split."""
    batch: _rows.ExampleBatch
    """The encoded examples (copies included), for a real shard of the sample."""
    seconds_per_record: float
    """Reading, parsing, encoding and cutting one record (measured)."""
    side_difference: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    """With --pairs: |chosen - rejected| tokens of every packed pair."""


def _encode_sample(f: _read.InputFile, k: int, encoder, options: PackOptions) -> _Encoded:
    """About ``k`` records of input ``f`` (:func:`pipeline._read.sample`) through the encode stage and the --long
    policy, timed."""
    from pipeline._encode import add_counts

    started = time.perf_counter()
    s = _read.sample(f, k, options.max_record_bytes, options.seed)
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    items = [(f.dataset, f.source, pos, rec) for pos, rec in s.items]
    batches, dead, counts = [], [], {}
    for i in range(0, len(items), options.batch_size):
        enc = encoder.encode(items[i:i + options.batch_size])
        batches.append(enc.batch)
        dead += enc.rejected
        add_counts(counts, enc.counts)
    batch = _rows.ExampleBatch.concat(batches)
    stats: dict[str, int] = {}
    cum = np.concatenate([[0], np.cumsum(batch.loss_mask, dtype=np.int64)])
    side_difference = np.zeros(0, np.int64)
    if options.pairs:  # the job's rules for pairs: an item is a pair, its sides kept as pack_pairs keeps them
        batch = _rows.as_pairs(batch)
        result, prompt = _rows.pack_pair_group(batch, options, dead, stats)
        ex = result.order[0::2] // 2
        kept_c, kept_r = result.stops[0::2], result.stops[1::2]
        off, cut = batch.offsets[ex], batch.cuts[ex]
        targets = (cum[off + kept_c] - cum[off]) + (cum[off + cut + kept_r] - cum[off + cut])
        lengths = (kept_c + kept_r).astype(np.int64)
        side_difference = np.abs(kept_c - kept_r)
    else:
        ex, starts, stops, _, _ = _rows.pieces(batch, options, dead, stats)
        abs_starts, abs_stops = batch.offsets[ex] + starts, batch.offsets[ex] + stops
        lengths, targets = (stops - starts).astype(np.int64), cum[abs_stops] - cum[abs_starts]
    # The split of an example is the job's own (a hash of its id): copies (~k) and pieces (#k) stay together.
    held_out = [_rows.split_of(i, options.validation_fraction) == "validation" for i in batch.ids]
    validation = np.array([held_out[e] for e in ex.tolist()], dtype=bool)
    rejected: dict[str, int] = {}
    first: dict[str, dict] = {}
    for r in sorted(dead, key=lambda r: r.get("position") or 0):
        if r["reason"] != Reason.TOO_LONG.value:
            rejected[r["reason"]] = rejected.get(r["reason"], 0) + 1
        first.setdefault(r["reason"], {k: r.get(k) for k in ("source", "position", "detail")})
    for key in ("dropped_too_long", "truncated_examples", "split_examples", "no_target_pieces"):
        counts[key] = stats.get(key, 0)
    counts["examples_packed"] = int(len(np.unique(ex)))
    per_record = (time.perf_counter() - started) / max(1, len(items)) + read_s / max(1, s.parsed)
    return _Encoded(s, rejected, first, counts, lengths, targets, validation, batch, per_record, side_difference)


def _simulate_rows(parts: Sequence[tuple[np.ndarray, float]], groups: int, options: PackOptions,
                   rng: np.random.Generator) -> float:
    """Rows for ``sum(projected)`` pieces whose lengths are like ``lengths``, per ``(lengths, projected)``
    of each input, packed in ``groups`` groups as the job packs them."""
    total = sum(n for _, n in parts)
    if total < 1:
        return 0.0
    m = int(min(round(total), _SIM_CAP))
    drawn = []
    for lengths, n in parts:
        take = int(round(n * m / total))
        if take == len(lengths):
            drawn.append(lengths)  # the whole input was sampled: its own lengths, no resampling noise
        elif take and len(lengths):
            drawn.append(rng.choice(lengths, size=take, replace=True))
    if not drawn:
        return 0.0
    lengths = np.concatenate(drawn)
    rng.shuffle(lengths)  # the job keys examples into groups by a hash of their id: groups mix inputs
    refine = options.refine and options.max_per_row is None  # as pipeline._rows.pack_group packs
    if options.mode is PackMode.GLOBAL:
        result = packers.pack(lengths, options.max_tokens, max_per_row=options.max_per_row, refine=refine)
    else:
        group = max(1, math.ceil(total / groups))  # hash buckets are about equal
        result = packers.pack_stream(lengths, options.max_tokens, group_size=group,
                                     max_per_row=options.max_per_row, refine=refine)
    return result.num_rows * total / len(lengths)


def _shard_bytes(batch: _rows.ExampleBatch, options: PackOptions, identity: dict, eos_id) -> tuple[float, float]:
    """(bytes of an empty shard, bytes per token of a shard written from the packed sample), by writing both
    with the job's own writer (this --output-format) into a temporary folder."""
    import tempfile

    schema = _write.run_schema(options, identity, "0" * 16)
    fmt = options.output_format.value
    ext = "parquet" if fmt == "parquet" else "arrow"
    with tempfile.TemporaryDirectory(prefix="packstream-estimate-") as tmp:
        empty = _write.ShardWriter(tmp, _write.shard_name("train", 0, 2, ext), schema, fmt).close("train")["bytes"]
        if not len(batch):
            return float(empty), 5.0
        writer = _write.ShardWriter(tmp, _write.shard_name("train", 1, 2, ext), schema, fmt)
        for rows in _rows.pack_group(batch, options, eos_id).chunks:
            writer.write(rows)
        desc = writer.close("train")
    if not desc["tokens"]:
        return float(empty), 5.0
    return float(empty), (desc["bytes"] - empty) / desc["tokens"]


def estimate(options: PackOptions, *, sample: int = 1000,
             timed_run: Optional[Callable[[PackOptions], dict]] = None) -> dict[str, Any]:
    """Predict rows, fill, tokens, output size and the local run time of ``packstream pack``.

    Every data set of ``options`` counts with its weight (a fraction samples, an integer repeats),
    and ``--validation-fraction`` splits the rows and shards. Returns a JSON-ready dict (keys
    documented in ``docs/operations.md``; ``schema_version`` changes with them). ``--workers`` and
    ``--tokenizer-threads`` (auto as ``pack`` resolves them) set the parallelism of the predicted local run
    time. ``timed_run`` (the job's launcher, which the tools do not import: the command passes it) packs
    ~:data:`TIMED_RECORDS` sampled records for real into a temporary folder, to time the run's fixed and
    per-record parts on this machine; without it the time is the sample's, plus fixed guesses.
    """
    from pipeline._encode import Encoder, input_folders
    from pipeline._tokenizer import tokenizer_identity

    started = time.perf_counter()
    specs = options.datasets()
    files = _read.expand_datasets(specs)[0]
    sizes = [_read.input_bytes(f) for f in files]
    input_bytes = sum(sizes)
    par, size, scale = _parallel.for_run(options, files, sizes)  # as pack chooses: a --processor run's images counted
    t = time.perf_counter()
    encoder = Encoder(options, input_folders(files))  # loads the tokenizer (once per process)
    tokenizer_s = time.perf_counter() - t
    identity = tokenizer_identity(options.tokenizer, options.trust_remote_code)
    rng = np.random.default_rng(options.seed)
    if sample < 1:
        raise PackstreamError(f"--sample {sample} must be >= 1 records per input (e.g. 1000)")
    encoded = [_encode_sample(f, sample, encoder, options) for f in files]
    counts, rejected = _counts(encoded)
    weighted = sum(e.sample.records * specs[e.sample.file.dataset].weight for e in encoded)
    groups, shards = _write.shard_layout(options, weighted, input_bytes)
    splits = {split: _split(encoded, split, options, groups[split], shards[split], rng)
              for split in (("train", "validation") if options.validation_fraction > 0 else ("train",))}
    rows = sum(s["rows"] for s in splits.values())
    tokens = sum(s["tokens"] for s in splits.values())
    pieces = sum(s["pieces"] for s in splits.values())
    n_shards = sum(s["shards"] for s in splits.values())
    budget = options.max_tokens
    lower = math.ceil(tokens / budget) if tokens else 0
    empty, per_token = _shard_bytes(_rows.ExampleBatch.concat([e.batch for e in encoded]), options, identity,
                                    encoder.eos_id)
    sample_s = sum(e.seconds_per_record * len(e.sample.items) for e in encoded)
    local_s, timed = _run_time(encoded, options, par, (size, tokenizer_s, tokens, scale), timed_run)
    return {
        "schema_version": ESTIMATE_SCHEMA_VERSION,
        "inputs": [_input_report(e, specs) for e in encoded],
        "sampled_records": sum(len(e.sample.items) for e in encoded),
        "records": sum(e.sample.records for e in encoded),
        "not_sampled": counts["not_sampled"],
        "repeated_copies": counts["repeated_copies"],
        "rejected": sum(rejected.values()),
        "rejected_by_reason": rejected, "first_rejected": _first_rejected(encoded),
        "dropped_too_long": counts["dropped_too_long"],
        "examples_packed": counts["examples_packed"],
        "truncated_examples": counts["truncated_examples"],
        "split_examples": counts["split_examples"],
        "no_target_pieces": counts["no_target_pieces"],
        "pieces": pieces,
        "tokens": tokens,
        "target_tokens": sum(s["target_tokens"] for s in splits.values()),
        "rows": rows,
        "lower_bound": lower,
        "fill": tokens / (rows * budget) if rows else 0.0,
        "examples_per_row": pieces / rows if rows else 0.0,
        "splits": splits,
        "output_bytes": int(round(n_shards * empty + tokens * per_token)),
        "shards": n_shards,
        "workers": par.workers,
        "tokenizer_threads": par.threads,
        "workers_why": par.why,
        "local_seconds": round(local_s, 1),
        "local_seconds_error": TIME_ERROR if timed["records"] else None,
        "timed_sample": timed,
        "sample_tokens_per_s": round(sum(e.batch.num_tokens for e in encoded) / max(1e-9, sample_s), 1),
        "estimate_seconds": round(time.perf_counter() - started, 2),
        "max_tokens": budget,
        "pairs": _pairs_estimate(encoded, counts["examples_packed"], rows) if options.pairs else {},
        "vision": _vision_estimate(encoded, encoder.vision, tokens, rows),
    }


def _vision_estimate(encoded: list[_Encoded], vision: Any, tokens: int, rows: int) -> dict[str, Any]:
    """With ``--processor``: the images packed and their placeholder tokens, projected from the samples, and with
    ``--video-fps`` the videos apart; {} else."""
    if vision is None:
        return {}

    def count(video: bool) -> Callable[[_Encoded], float]:
        return lambda e: float((e.batch.images.video == video).sum()) if e.batch.images is not None else 0.0

    def placeholders(video: bool) -> Callable[[_Encoded], float]:
        def tokens_of(e: _Encoded) -> float:
            imgs = e.batch.images
            grids = imgs.grids[imgs.video == video] if imgs is not None else ()
            return float(sum(vision.grid_tokens(g) for g in grids))
        return tokens_of

    images, image_tok = (int(round(_scaled(encoded, f(False)))) for f in (count, placeholders))
    out = {"processor": vision.name or vision.family.value, "images": images, "image_tokens": image_tok,
           "image_token_share": image_tok / tokens if tokens else 0.0,
           "images_per_row": images / rows if rows else 0.0}
    if vision.videos:
        videos, video_tok = (int(round(_scaled(encoded, f(True)))) for f in (count, placeholders))
        out.update(videos=videos, video_tokens=video_tok, video_token_share=video_tok / tokens if tokens else 0.0)
    return out


def _scaled(encoded: list[_Encoded], get) -> float:
    """``get(e)`` of each input's sample, times that input's records per sampled record, summed."""
    return sum(get(e) * (e.sample.records / len(e.sample.items)) for e in encoded if e.sample.items)


def _counts(encoded: list[_Encoded]) -> tuple[dict[str, int], dict[str, int]]:
    """The projected counts (not sampled, repeated, dropped, truncated, split, packed) and dead letters by reason."""
    counts = {k: int(round(_scaled(encoded, lambda e, k=k: e.counts.get(k, 0))))
              for k in ("not_sampled", "repeated_copies", "dropped_too_long", "truncated_examples", "split_examples",
                        "no_target_pieces", "examples_packed")}
    reasons = sorted({r for e in encoded for r in e.rejected})
    rejected = {r: int(round(_scaled(encoded, lambda e, r=r: e.rejected.get(r, 0)))) for r in reasons}
    return counts, {r: n for r, n in rejected.items() if n}


def _first_rejected(encoded: list[_Encoded]) -> dict[str, dict]:
    """The first sampled dead letter of each reason, over the inputs in order (the manifest's ``first_rejected``)."""
    first: dict[str, dict] = {}
    for e in encoded:
        for reason, case in e.first.items():
            first.setdefault(reason, case)
    return first


def _split(encoded: list[_Encoded], split: str, options: PackOptions, groups: int, shards: int,
           rng: np.random.Generator) -> dict[str, int]:
    """One split's rows, tokens, target tokens, pieces, lower bound and shards, projected from the samples."""
    tokens = targets = pieces = 0.0
    parts = []
    for e in encoded:
        if not e.sample.items:
            continue
        scale = e.sample.records / len(e.sample.items)
        mine = e.validation == (split == "validation")
        tokens += float(e.lengths[mine].sum()) * scale
        targets += float(e.targets[mine].sum()) * scale
        pieces += float(mine.sum()) * scale * (2 if options.pairs else 1)  # a pair: two sequences
        parts.append((e.lengths[mine], float(mine.sum()) * scale))
    rows = int(round(_simulate_rows(parts, groups, options, rng)))
    tokens_i = int(round(tokens))
    lower = math.ceil(tokens_i / options.max_tokens) if tokens_i else 0
    return {"rows": max(rows, lower), "tokens": tokens_i, "target_tokens": int(round(targets)),
            "pieces": int(round(pieces)), "lower_bound": lower, "shards": shards}


@dataclasses.dataclass(frozen=True)
class _Timing:
    """A short real pack of sampled records (:func:`_timed_pack`), its wall time split by its trace."""

    records: int
    """Records the timed pack read."""
    tokens: int
    seconds: float
    """Its wall time from the launch to the commit, as ``pack``'s summary times a run."""
    read_s: float
    """Seconds in read tasks (reading, parsing, encoding: ``encode_task`` spans), summed over the workers."""
    read_wall_s: float
    """From the first read task's start to the last one's end."""
    pack_write_s: float
    """From the first group packed to the last shard written."""
    sampled_s: float
    """The same records' seconds in the sample (:attr:`_Encoded.seconds_per_record`, this process)."""

    @property
    def fixed_s(self) -> float:
        """Start-up, the stages' hand-overs, the commit: the part of the run that does not grow with the input."""
        return max(0.0, self.seconds - self.read_wall_s - self.pack_write_s)

    @property
    def calibration(self) -> float:
        """A record's seconds in the job's read tasks / in the sample: the runner's per-record cost, the threads."""
        return self.read_s / self.sampled_s if self.sampled_s > 0 else 1.0

    def report(self) -> dict[str, Any]:
        return {"records": self.records, "seconds": round(self.seconds, 2), "fixed_s": round(self.fixed_s, 2),
                "read_s": round(self.read_s, 2), "pack_write_s": round(self.pack_write_s, 2),
                "calibration": round(self.calibration, 3)}


def _sampled_media_root(options: PackOptions, encoded: list[_Encoded]) -> Optional[str]:
    """The media root of the timed pack, whose records sit in a temporary folder: ``--media-root``, else the one
    folder of the sampled inputs (relative image paths resolve there, as in the run). Inputs in several folders
    with no ``--media-root`` have no one root: PackstreamError (the estimate goes uncalibrated, saying so)."""
    if options.processor is None or options.media_root is not None:
        return options.media_root
    folders = {os.path.dirname(os.path.abspath(e.sample.file.path)) for e in encoded if "://" not in e.sample.file.path}
    if len(folders) != 1:
        raise PackstreamError(f"the image inputs lie in {len(folders)} folders and no --media-root is given, so one "
                              "timed pack cannot resolve their relative image paths")
    return folders.pop()


def _timed_pack(encoded: list[_Encoded], options: PackOptions, par, timed_run: Callable[[PackOptions], dict],
                k: int = TIMED_RECORDS) -> _Timing:
    """Pack ~``k`` of the sampled records (each input's share by its record count, evenly spaced), as JSONL in a
    temporary folder, with ``timed_run`` and the full run's workers and threads, traced (:mod:`pipeline._trace`).
    Nothing goes to ``--output``. Raises PackstreamError (the pack failed) or TypeError (a record JSON cannot hold)."""
    import json
    import tempfile

    from pipeline import _trace

    total = max(1, sum(e.sample.records for e in encoded))
    with tempfile.TemporaryDirectory(prefix="packstream-estimate-") as tmp:
        paths: dict[int, list[str]] = {}
        sampled_s = 0.0
        for i, e in enumerate(encoded):
            good = [rec for _, rec in e.sample.items if isinstance(rec, dict)]  # not the sample's unreadable lines
            n = min(len(good), max(1, round(k * e.sample.records / total)))
            if not n:
                continue
            path = os.path.join(tmp, f"{i:04d}-{os.path.basename(e.sample.file.path)}.jsonl")
            with open(path, "w", encoding="utf-8") as out:
                out.writelines(json.dumps(good[j * len(good) // n], ensure_ascii=False) + "\n" for j in range(n))
            paths.setdefault(e.sample.file.dataset, []).append(path)
            sampled_s += n * e.seconds_per_record
        specs = options.datasets()
        config = tuple(dataclasses.replace(specs[d], paths=tuple(p), split=None) for d, p in sorted(paths.items()))
        timed = dataclasses.replace(
            options, output=os.path.join(tmp, "out"), overwrite=False, workers=par.workers,
            tokenizer_threads=par.threads, force_workers=True, media_root=_sampled_media_root(options, encoded),
            **({"config": config} if options.config else {"inputs": tuple(p for ps in paths.values() for p in ps)}))
        trace = os.path.join(tmp, "trace")
        os.mkdir(trace)
        saved = os.environ.get(_trace.ENV)
        os.environ[_trace.ENV] = trace  # every process of the run (forked workers inherit it) writes its spans
        try:
            started = time.perf_counter()
            manifest = timed_run(timed)
            seconds = manifest.get("elapsed_s", time.perf_counter() - started)
        finally:
            if saved is None:
                os.environ.pop(_trace.ENV, None)
            else:
                os.environ[_trace.ENV] = saved
        spans = _trace.read(trace)

    def phase(*names: str) -> tuple[float, float]:
        mine = [s for s in spans if s["span"] in names]
        if not mine:
            return 0.0, 0.0
        return sum(s["wall"] for s in mine), max(s["start"] + s["wall"] for s in mine) - min(s["start"] for s in mine)

    read_s, read_wall = phase("encode_task")
    c = manifest["counts"]
    return _Timing(c["records_read"], c["tokens"], float(seconds), read_s, read_wall,
                   phase("pack_group", "write_shard")[1], sampled_s)


def _run_time(encoded: list[_Encoded], options: PackOptions, par, sizes: tuple[float, float, int, float],
              timed_run: Optional[Callable[[PackOptions], dict]]) -> tuple[float, dict[str, Any]]:
    """The predicted local run time and the report's ``timed_sample`` (``records`` 0 and ``why`` when there is
    none). ``sizes``: the input's work in bytes (its images counted), the tokenizer's load seconds, the predicted
    tokens, and the work per input byte."""
    timing, why = None, "no timed pack (estimate() called without timed_run)"
    if timed_run is not None:
        try:
            timing = _timed_pack(encoded, options, par, timed_run)
        except (PackstreamError, TypeError, ValueError, OSError) as e:  # the prediction falls back to the sample's
            why = f"the timed pack failed: {e}"
    work_bytes, tokenizer_s, tokens, scale = sizes
    seconds = _local_seconds(encoded, par, (work_bytes, scale), tokenizer_s, tokens, timing)
    return seconds, (timing.report() if timing is not None else {"records": 0, "why": why})


def _local_seconds(encoded: list[_Encoded], par, work: tuple[float, float], tokenizer_s: float, tokens: int,
                   timing: Optional[_Timing]) -> float:
    """The local run time: reading and encoding spread over the workers (at most one per read task), plus the fixed
    part and packing and writing. With ``timing``, each input's sampled seconds per record times the timed pack's
    calibration are seconds of one worker of this run; without, the sample was timed here with this process's
    tokenizer threads, and the run has workers x threads of them."""
    workers = par.workers
    task_bytes = _read.task_bytes(work[0], workers, work[1])  # work: the input's (images counted) and per byte
    tasks = [_read.task_count(e.sample.file, e.sample.records, task_bytes) for e in encoded]
    parallel = max(1, min(workers, sum(tasks)))
    if timing is not None:
        per_file_s = [e.sample.records * e.seconds_per_record * timing.calibration for e in encoded]
        work = max(sum(per_file_s) / parallel, max((s / n for s, n in zip(per_file_s, tasks)), default=0.0))
        return timing.fixed_s + tokenizer_s + work + timing.pack_write_s * tokens / max(1, timing.tokens)
    sampled_threads = 1 if os.environ.get(_parallel.PARALLELISM_ENV, "true").lower() == "false" else _parallel.cores()
    speed = min(workers * par.threads, _parallel.cores()) / sampled_threads
    per_file_s = [e.sample.records * (e.seconds_per_record + _UNTIMED_PER_RECORD_S) for e in encoded]
    work = max(sum(per_file_s) / max(speed, 1e-9) * max(1.0, workers / parallel),
               max((s / n * sampled_threads / par.threads for s, n in zip(per_file_s, tasks)), default=0.0))
    return _UNTIMED_STARTUP_S + tokenizer_s + work + tokens * _UNTIMED_PER_TOKEN_S


def _input_report(e: _Encoded, specs) -> dict[str, Any]:
    return {"source": e.sample.file.source, "dataset": specs[e.sample.file.dataset].name,
            "records": e.sample.records, "records_exact": e.sample.exact, "sampled": len(e.sample.items),
            "mean_tokens": float(e.batch.lengths.mean()) if len(e.batch) else 0.0}


def _pairs_estimate(encoded: list, pairs: int, rows: int) -> dict[str, Any]:
    """A run of pairs: pairs packed, pairs per row, and the mean |chosen - rejected| tokens of the sampled pairs."""
    diff = np.concatenate([e.side_difference for e in encoded]) if encoded else np.zeros(0)
    return {"pairs": pairs, "pairs_per_row": pairs / rows if rows else 0.0,
            "side_difference_mean": float(diff.mean()) if len(diff) else 0.0}


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units, labelled as such: 1 KiB = 1024 B, 1 MiB = 1024 KiB, ..."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {sec:02d} s"


def _time_basis(e: dict[str, Any]) -> str:
    """What the run time rests on: a timed pack and its error bound, or why there was none."""
    t = e["timed_sample"]
    if not t["records"]:
        return f"not calibrated: {t['why']}"
    return f"±{e['local_seconds_error']:.0%}, from a timed {t['records']:,}-record pack"


def format_estimate(e: dict[str, Any]) -> str:
    """The estimate as a two-column table, counted like ``pack``'s summary."""
    from pipeline._report import first_case, rejected_lines, table

    exact = all(i["records_exact"] for i in e["inputs"])
    lines = [
        ("records", f"{e['records']:,}" + ("" if exact else " (projected from file sizes)")),
        ("sampled", f"{e['sampled_records']:,} records from {len(e['inputs'])} inputs"),
    ]
    if e["not_sampled"]:
        lines.append(("not sampled (weight < 1)", f"~{e['not_sampled']:,}"))
    if e["repeated_copies"]:
        lines.append(("repeated copies (weight > 1)", f"~{e['repeated_copies']:,}"))
    lines += [
        ("rejected", f"~{e['rejected']:,}"),
        *rejected_lines(e["rejected_by_reason"], e.get("first_rejected", {}), "~"),
        (f"dropped (> {e['max_tokens']} tokens)", f"~{e['dropped_too_long']:,}"),
        *([("  too_long", first_case(e["first_rejected"]["too_long"]).lstrip())]
          if e["dropped_too_long"] and "too_long" in e.get("first_rejected", {}) else []),
        ("truncated / split examples", f"~{e['truncated_examples']:,} / ~{e['split_examples']:,}"),
        ("examples packed", f"~{e['examples_packed']:,}"),
        ("tokens", f"~{e['tokens']:,}  (~{e['target_tokens']:,} targets)"),
        ("rows", f"~{e['rows']:,}  (lower bound {e['lower_bound']:,})"),
        ("fill", f"~{e['fill']:.2%}"),
        ("examples per row", f"~{e['examples_per_row']:.2f}"),
        *([("pairs", f"~{e['pairs']['pairs']:,}  (~{e['pairs']['pairs_per_row']:.2f} per row, sides differ by "
                     f"~{e['pairs']['side_difference_mean']:,.0f} tokens on average)")] if e["pairs"] else []),
        *([("images", f"~{e['vision']['images']:,}  (~{e['vision']['image_tokens']:,} placeholder tokens, "
                      f"{e['vision']['image_token_share']:.0%} of the tokens; ~{e['vision']['images_per_row']:.2f} "
                      f"per row; {e['vision']['processor']})")] if e.get("vision") else []),
        *([("videos", f"~{e['vision']['videos']:,}  (~{e['vision']['video_tokens']:,} placeholder tokens, "
                      f"{e['vision']['video_token_share']:.0%} of the tokens)")]
          if "videos" in e.get("vision", {}) else []),
    ]
    if len(e["splits"]) > 1:
        lines += [(f"  {name}", f"~{s['rows']:,} rows, ~{s['tokens']:,} tokens, {s['shards']} shard(s)")
                  for name, s in e["splits"].items()]
    lines += [
        ("output", f"~{human_bytes(e['output_bytes'])} in {e['shards']} shard(s)"),
        ("workers", f"{e['workers']} x {e['tokenizer_threads']} tokenizer thread{'s' if e['tokenizer_threads'] != 1 else ''}"
                    f" ({e['workers_why']})"),
        (f"local run time (--workers {e['workers']})", f"~{_duration(e['local_seconds'])}  ({_time_basis(e)})"),
    ]
    return table(lines)
