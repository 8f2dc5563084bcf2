"""Predict a packing job from a sample of its inputs: ``packstream estimate`` (``pack --estimate``).

For each input, :func:`sample_input` takes about ``k`` records spread over the whole file
(evenly spaced seeks for JSONL, evenly spaced rows elsewhere, a seeded reservoir for compressed JSONL) and
counts the records (exactly where that is cheap; otherwise file bytes / sampled bytes per
record). :func:`estimate` then runs the job's own stages on the sample: the encode stage
(:meth:`pipeline._encode.Encoder.encode`: normalize, render, tokenize, sample or repeat per data
set) and the long-example policy (:func:`pipeline._rows.pieces`), and extrapolates::

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
    local time      startup + tokenizer load + records * measured seconds per record
                    + Beam's per-record and per-token overhead (calibrated, see _BEAM_*)

Sizes are computed in bytes and shown in binary units (KiB, MiB, GiB: powers of 1024).
Duplicate ids are not detected from a sample; the prediction assumes none.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from typing import Any, Sequence

import numpy as np

import packers
from packers import PackstreamError
import pipeline._parallel as _parallel
import pipeline._read as _read
import pipeline._rows as _rows
import pipeline._write as _write
from pipeline._formats import Reason
from pipeline._options import PackMode, PackOptions

_SMALL = 32 * 2**20
"""JSONL files up to this size are read whole (exact count, exact even spacing)."""
_SIM_CAP = 1_000_000
"""Most lengths simulated by packers.pack; beyond it, rows are scaled from the simulation."""
# Beam's cost on top of the functions timed on the sample, fitted to local FnApiRunner runs
# (--workers 1) on ../shared/data (17k records, 3.4M tokens, 9-13 s on 2 busy cores): start-up,
# moving record chunks between steps, and grouping, packing, assembling and writing per token.
_BEAM_STARTUP_S = 2.0
_BEAM_PER_RECORD_S = 30e-6
_BEAM_PER_TOKEN_S = 0.2e-6
ESTIMATE_SCHEMA_VERSION = 3


@dataclasses.dataclass(frozen=True)
class InputSample:
    """About ``k`` records of one input, spread over it, and how many records it holds."""

    file: _read.InputFile
    records: int
    """Records in the input: counted when ``exact``, else file bytes / sampled bytes per record."""
    exact: bool
    sample: list
    """``(position, record or Rejected)``, as :func:`pipeline._read.read_file` yields them."""
    seconds: float
    """Time spent reading and parsing ``parsed`` records."""
    parsed: int
    """Records parsed to take the sample: ``len(sample)``, or all of them for whole-file formats."""


def _evenly(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices spread evenly over ``range(n)``."""
    if n <= k:
        return list(range(n))
    return sorted({int((i + 0.5) * n / k) for i in range(k)})


def _parse_lines(lines: Sequence[tuple[int, "bytes | int"]], max_bytes: int) -> list:
    """Parse sampled JSONL lines with the job's own record parser."""
    return [(pos, _read._record(raw, max_bytes)) for pos, raw in lines]


def _jsonl_sample(f: _read.InputFile, k: int, max_bytes: int, rng: random.Random) -> tuple[list, int, bool]:
    """Lines are split and numbered by the job's own reader (:func:`pipeline._read._jsonl_texts`: one
    line rule, lines past --max-record-bytes never held), so positions are the job's."""
    if _read.compression(f.path) is not None:
        # No seeking into a compressed stream: one pass, counting lines and keeping a seeded reservoir.
        kept: list[tuple[int, "bytes | int"]] = []
        n = 0
        for lineno, raw in _read._jsonl_texts(f, max_bytes):
            n += 1
            if len(kept) < k:
                kept.append((lineno, raw))
            else:
                j = rng.randrange(n)
                if j < k:
                    kept[j] = (lineno, raw)
        return _parse_lines(sorted(kept), max_bytes), n, True
    size = _read.input_bytes(f)
    if size <= _SMALL:
        lines = list(_read._jsonl_texts(f, max_bytes))
        return _parse_lines([lines[i] for i in _evenly(len(lines), k)], max_bytes), len(lines), True
    # Large: seek to k evenly spaced offsets and take the line after each one. The line a seek
    # lands in is chosen in proportion to its length; the line after it is not.
    lines = []
    with _read.open_raw(f.path) as fh:
        for i in range(k):
            offset = int((i + 0.5) * size / k)
            fh.seek(offset)
            found = _read.split_lines(_read._blocks(fh, size=64 * 2**10), max_bytes)
            if offset:
                next(found, None)  # the rest of the line the seek landed in
            raw = next((r for r in found if isinstance(r, int) or r.strip()), None)
            if raw is not None:
                lines.append((offset, raw))
    if not lines:
        return [], 0, True
    per_record = sum(raw if isinstance(raw, int) else len(raw) for _, raw in lines) / len(lines)
    if "://" not in f.path:
        records, exact = sum(1 for _ in _read._jsonl_texts(f, max_bytes)), True
    else:
        records, exact = int(round(size / per_record)), False
    # Positions are line numbers in the job; here the offset's approximate line.
    lines = [(int(off / per_record) + 1, raw) for off, raw in lines]
    return _parse_lines(lines, max_bytes), records, exact


def _parquet_sample(f: _read.InputFile, k: int, max_bytes: int) -> tuple[list, int, bool]:
    """Rows restored as the job restores them (:func:`pipeline._read.table_rows`)."""
    import pyarrow.parquet as pq

    with _read.open_raw(f.path) as fh:
        pf = pq.ParquetFile(fh)
        decoder = _read.row_decoder(pf.schema_arrow)
        n = pf.metadata.num_rows
        starts = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
        wanted = _evenly(n, k)
        sample, cache = [], {}
        for i in wanted:
            g = int(np.searchsorted(starts, i, side="right") - 1)
            if g not in cache:
                cache = {g: _read.table_rows(pf.read_row_group(g), max_bytes, decoder)}  # one group in memory at a time
            sample.append((i, cache[g][i - starts[g]]))
    return sample, n, True


def _hf_sample(f: _read.InputFile, k: int, max_bytes: int) -> tuple[list, int, bool]:
    import datasets

    ds = datasets.load_from_disk(f.path)
    if f.split:
        ds = ds[f.split]
    wanted = _evenly(len(ds), k)
    rows = _read.table_rows(ds.with_format("arrow").select(wanted)[:], max_bytes, _read.row_decoder(ds.features.arrow_schema))
    return list(zip(wanted, rows)), len(ds), True


def sample_input(f: _read.InputFile, k: int = 1000, max_bytes: int = 16 * 2**20, seed: int = 0) -> InputSample:
    """About ``k`` records spread over input ``f``, and its record count."""
    if k < 1:
        raise PackstreamError(f"--sample {k} must be >= 1 records per input (e.g. 1000)")
    started = time.perf_counter()
    rng = random.Random(seed)
    if f.kind == "jsonl":
        sample, n, exact = _jsonl_sample(f, k, max_bytes, rng)
    elif f.kind == "parquet":
        sample, n, exact = _parquet_sample(f, k, max_bytes)
    elif f.kind == "hf_disk":
        sample, n, exact = _hf_sample(f, k, max_bytes)
    else:  # json, arrow: no seeking; count, then keep the records at evenly spaced places in one pass
        n = _read.count_records(f)
        wanted = set(_evenly(n, k))
        sample = [item for i, item in enumerate(_read.read_file(f, max_bytes)) if i in wanted]
        return InputSample(f, n, True, sample, time.perf_counter() - started, n)
    return InputSample(f, n, exact, sample, time.perf_counter() - started, len(sample))


# ---------------------------------------------------------------------------------------
# The sample through the job's stages


@dataclasses.dataclass
class _Encoded:
    """One input's sample after the encode stage and the --long policy."""

    sample: InputSample
    rejected: dict[str, int]
    """Dead letters by reason (too_long excluded: ``counts["dropped_too_long"]``)."""
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


def _encode_sample(s: InputSample, encoder, options: PackOptions, rng: np.random.Generator) -> _Encoded:
    from pipeline._encode import add_counts

    started = time.perf_counter()
    items = [(s.file.dataset, s.file.source, pos, rec) for pos, rec in s.sample]
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
        if batch.cuts is None:
            batch = dataclasses.replace(batch, cuts=np.zeros(0, np.int64))
        result, prompt = _rows.pack_pair_group(batch, options, dead, stats)
        ex = result.order[0::2] // 2
        kept_c, kept_r = result.stops[0::2], result.stops[1::2]
        off, cut = batch.offsets[ex], batch.cuts[ex]
        targets = (cum[off + kept_c] - cum[off]) + (cum[off + cut + kept_r] - cum[off + cut])
        lengths = (kept_c + kept_r).astype(np.int64)
        side_difference = np.abs(kept_c - kept_r)
    else:
        ex, starts, stops, _ = _rows.pieces(batch, options, dead, stats)
        abs_starts, abs_stops = batch.offsets[ex] + starts, batch.offsets[ex] + stops
        lengths, targets = (stops - starts).astype(np.int64), cum[abs_stops] - cum[abs_starts]
    # The split of an example is the job's own (a hash of its id): copies (~k) and pieces (#k) stay together.
    held_out = [_rows.split_of(i, options.validation_fraction) == "validation" for i in batch.ids]
    validation = np.array([held_out[e] for e in ex.tolist()], dtype=bool)
    rejected: dict[str, int] = {}
    for r in dead:
        if r["reason"] != Reason.TOO_LONG.value:
            rejected[r["reason"]] = rejected.get(r["reason"], 0) + 1
    for key in ("dropped_too_long", "truncated_examples", "split_examples", "no_target_pieces"):
        counts[key] = stats.get(key, 0)
    counts["examples_packed"] = int(len(np.unique(ex)))
    per_record = (time.perf_counter() - started) / max(1, len(items)) + s.seconds / max(1, s.parsed)
    return _Encoded(s, rejected, counts, lengths, targets, validation, batch, per_record, side_difference)


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

    import pyarrow as pa

    schema = pa.schema(packers.SCHEMA, metadata=packers.schema_metadata(
        budget=options.max_tokens, tokenizer=identity["name"], vocab_sha256=identity["vocab_sha256"],
        pad_token_id=identity["pad_token_id"], eos_token_id=identity["eos_token_id"], run_id="0" * 16))
    fmt = options.output_format.value
    ext = "parquet" if fmt == "parquet" else "arrow"
    with tempfile.TemporaryDirectory(prefix="packstream-estimate-") as tmp:
        empty = _write.ShardWriter(tmp, _write.shard_name("train", 0, 2, ext), schema, fmt).close("train")["bytes"]
        if not len(batch):
            return float(empty), 5.0
        rows = _rows.pack_group(batch, options, eos_id).batch
        writer = _write.ShardWriter(tmp, _write.shard_name("train", 1, 2, ext), schema, fmt)
        writer.write(rows)
        desc = writer.close("train")
    if not desc["tokens"]:
        return float(empty), 5.0
    return float(empty), (desc["bytes"] - empty) / desc["tokens"]


def _read_tasks(f: _read.InputFile, records: int, task_bytes: int = _read.TASK_BYTES) -> int:
    """About how many read tasks the job splits an input into (pipeline._read.cut_tasks)."""
    if f.kind == "jsonl" and _read.compression(f.path) is None:
        return max(1, math.ceil(_read.input_bytes(f) / task_bytes))
    if f.kind in ("parquet", "hf_disk"):
        return max(1, math.ceil(records / _read.TASK_ROWS))
    return 1


def estimate(options: PackOptions, *, sample: int = 1000) -> dict[str, Any]:
    """Predict rows, fill, tokens, output size and the local run time of ``packstream pack``.

    Every data set of ``options`` counts with its weight (a fraction samples, an integer repeats),
    and ``--validation-fraction`` splits the rows and shards. Returns a JSON-ready dict (keys
    documented in ``docs/operations.md``; ``schema_version`` changes with them). ``--workers`` and
    ``--tokenizer-threads`` (auto as ``pack`` resolves them) set the parallelism of the predicted
    local run time.
    """
    from pipeline._encode import Encoder
    from pipeline._tokenizer import tokenizer_identity

    started = time.perf_counter()
    specs = options.datasets()
    files, _ = _read.expand_datasets(specs)
    input_bytes = sum(_read.input_bytes(f) for f in files)
    par = _parallel.choose(options.workers, options.tokenizer_threads, input_bytes)
    workers = par.workers
    t = time.perf_counter()
    encoder = Encoder(options)  # loads the tokenizer (once per process)
    tokenizer_s = time.perf_counter() - t
    identity = tokenizer_identity(options.tokenizer, options.trust_remote_code)
    rng = np.random.default_rng(options.seed)
    encoded = [_encode_sample(sample_input(f, sample, options.max_record_bytes, options.seed), encoder, options, rng)
               for f in files]

    def scaled(get) -> float:
        return sum(get(e) * (e.sample.records / len(e.sample.sample)) for e in encoded if e.sample.sample)

    records = sum(e.sample.records for e in encoded)
    counts = {k: int(round(scaled(lambda e, k=k: e.counts.get(k, 0))))
              for k in ("not_sampled", "repeated_copies", "dropped_too_long", "truncated_examples", "split_examples",
                        "no_target_pieces", "examples_packed")}
    reasons = sorted({r for e in encoded for r in e.rejected})
    rejected = {r: int(round(scaled(lambda e, r=r: e.rejected.get(r, 0)))) for r in reasons}
    rejected = {r: n for r, n in rejected.items() if n}

    weighted = sum(e.sample.records * specs[e.sample.file.dataset].weight for e in encoded)
    groups, shards = _write.shard_layout(options, weighted, sum(_read.input_bytes(f) for f in files))
    budget = options.max_tokens
    splits: dict[str, dict[str, Any]] = {}
    for split in ("train", "validation") if options.validation_fraction > 0 else ("train",):
        tokens = targets = pieces = 0.0
        parts = []
        for e in encoded:
            if not e.sample.sample:
                continue
            scale = e.sample.records / len(e.sample.sample)
            mine = e.validation == (split == "validation")
            tokens += float(e.lengths[mine].sum()) * scale
            targets += float(e.targets[mine].sum()) * scale
            pieces += float(mine.sum()) * scale * (2 if options.pairs else 1)  # a pair: two sequences
            parts.append((e.lengths[mine], float(mine.sum()) * scale))
        rows = int(round(_simulate_rows(parts, groups[split], options, rng)))
        tokens_i = int(round(tokens))
        lower = math.ceil(tokens_i / budget) if tokens_i else 0
        splits[split] = {"rows": max(rows, lower), "tokens": tokens_i, "target_tokens": int(round(targets)),
                         "pieces": int(round(pieces)), "lower_bound": lower, "shards": shards[split]}
    rows = sum(s["rows"] for s in splits.values())
    tokens = sum(s["tokens"] for s in splits.values())
    pieces = sum(s["pieces"] for s in splits.values())
    n_shards = sum(s["shards"] for s in splits.values())
    lower = math.ceil(tokens / budget) if tokens else 0

    empty, per_token = _shard_bytes(_rows.ExampleBatch.concat([e.batch for e in encoded]), options, identity,
                                    encoder.eos_id)
    out_bytes = int(round(n_shards * empty + tokens * per_token))

    # Local run time: reading and encoding spread over the workers (at most one per read task). The sample
    # was timed here with this process's tokenizer threads; the run has workers x threads of them.
    sampled_threads = 1 if os.environ.get(_parallel.PARALLELISM_ENV, "true").lower() == "false" else _parallel.cores()
    speed = min(workers * par.threads, _parallel.cores()) / sampled_threads
    per_file_s = [e.sample.records * (e.seconds_per_record + _BEAM_PER_RECORD_S) for e in encoded]
    tasks = [_read_tasks(e.sample.file, e.sample.records, _read.task_bytes(input_bytes, workers)) for e in encoded]
    parallel = max(1, min(workers, sum(tasks)))
    work = max(sum(per_file_s) / max(speed, 1e-9) * max(1.0, workers / parallel),
               max((s / n * sampled_threads / par.threads for s, n in zip(per_file_s, tasks)), default=0.0))
    run_s = _BEAM_STARTUP_S + tokenizer_s + work + tokens * _BEAM_PER_TOKEN_S
    sampled = sum(len(e.sample.sample) for e in encoded)
    sample_s = sum(e.seconds_per_record * len(e.sample.sample) for e in encoded)
    return {
        "schema_version": ESTIMATE_SCHEMA_VERSION,
        "inputs": [
            {"source": e.sample.file.source, "dataset": specs[e.sample.file.dataset].name,
             "records": e.sample.records, "records_exact": e.sample.exact, "sampled": len(e.sample.sample),
             "mean_tokens": float(e.batch.lengths.mean()) if len(e.batch) else 0.0}
            for e in encoded
        ],
        "sampled_records": sampled,
        "records": records,
        "not_sampled": counts["not_sampled"],
        "repeated_copies": counts["repeated_copies"],
        "rejected": sum(rejected.values()),
        "rejected_by_reason": rejected,
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
        "output_bytes": out_bytes,
        "shards": n_shards,
        "workers": workers,
        "local_seconds": round(run_s, 1),
        "sample_tokens_per_s": round(sum(e.batch.num_tokens for e in encoded) / max(1e-9, sample_s), 1),
        "estimate_seconds": round(time.perf_counter() - started, 2),
        "max_tokens": budget,
        "pairs": _pairs_estimate(encoded, counts["examples_packed"], rows) if options.pairs else {},
    }


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


def format_estimate(e: dict[str, Any]) -> str:
    """The estimate as a two-column table, counted like ``pack``'s summary."""
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
        *[(f"  {k}", f"~{v:,}") for k, v in e["rejected_by_reason"].items()],
        (f"dropped (> {e['max_tokens']} tokens)", f"~{e['dropped_too_long']:,}"),
        ("truncated / split examples", f"~{e['truncated_examples']:,} / ~{e['split_examples']:,}"),
        ("examples packed", f"~{e['examples_packed']:,}"),
        ("tokens", f"~{e['tokens']:,}  (~{e['target_tokens']:,} targets)"),
        ("rows", f"~{e['rows']:,}  (lower bound {e['lower_bound']:,})"),
        ("fill", f"~{e['fill']:.2%}"),
        ("examples per row", f"~{e['examples_per_row']:.2f}"),
        *([("pairs", f"~{e['pairs']['pairs']:,}  (~{e['pairs']['pairs_per_row']:.2f} per row, sides differ by "
                     f"~{e['pairs']['side_difference_mean']:,.0f} tokens on average)")] if e["pairs"] else []),
    ]
    if len(e["splits"]) > 1:
        lines += [(f"  {name}", f"~{s['rows']:,} rows, ~{s['tokens']:,} tokens, {s['shards']} shard(s)")
                  for name, s in e["splits"].items()]
    lines += [
        ("output", f"~{human_bytes(e['output_bytes'])} in {e['shards']} shard(s)"),
        (f"local run time (--workers {e['workers']})", f"~{_duration(e['local_seconds'])}"),
    ]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)
