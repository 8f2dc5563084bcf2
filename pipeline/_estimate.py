"""Predict a packing job from a sample of its inputs: ``packstream pack --estimate``.

For each input, :func:`sample_input` takes about ``k`` records spread over the whole file
(evenly spaced seeks for JSONL, evenly spaced rows elsewhere, a seeded reservoir for gzip) and
counts the records (exactly where that is cheap; otherwise file bytes / sampled bytes per
record). :func:`estimate` then runs the job's own code on the sample (``_read`` parsing,
``_formats.normalize``, ``_render.Renderer``) and extrapolates::

    per input f:   N_f records (counted or projected) | sample of k_f: rejected by reason,
                   token lengths L_f, targets, seconds per record
    examples       sum_f N_f * (kept_f / k_f)
    tokens         sum_f examples_f * mean(L_f after --long)           (truncate: min(L, budget))
    rows, fill     packers.pack on lengths resampled from L_f to the projected count (capped),
                   in groups of the size the grouped job would use, scaled back up
    output bytes   tokens * (bytes per token of a real shard encoded from the packed sample)
    local time     startup + tokenizer load + records * measured seconds per record
                   + Beam's per-record and per-token overhead (calibrated, see _BEAM_*)

Duplicate ids are not detected from a sample; the prediction assumes none.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from typing import Any, Sequence

import numpy as np

import packers
from packers import LongPolicy, PackstreamError
from pipeline import _read
from pipeline._formats import Rejected, normalize
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
ESTIMATE_SCHEMA_VERSION = 1


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


def _size(path: str) -> int:
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.match([path])[0].metadata_list[0].size_in_bytes


def _evenly(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices spread evenly over ``range(n)``."""
    if n <= k:
        return list(range(n))
    return sorted({int((i + 0.5) * n / k) for i in range(k)})


def _parse_lines(lines: Sequence[tuple[int, bytes]], max_bytes: int) -> list:
    """Parse sampled JSONL lines with the job's own line parser."""
    return [(pos, _read.parse_line(raw, max_bytes, first=pos == 1)) for pos, raw in lines]


def _count_lines(path: str) -> int:
    """Non-blank lines, i.e. records, as the job's JSONL reader counts them."""
    with _read._open_bytes(path) as fh:
        return sum(1 for raw in iter(fh.readline, b"") if not raw.isspace())


def _jsonl_sample(f: _read.InputFile, k: int, max_bytes: int, rng: random.Random) -> tuple[list, int, bool]:
    from apache_beam.io.filesystems import FileSystems

    if f.path.lower().endswith(".gz"):
        # No seeking into gzip: one pass, counting lines and keeping a seeded reservoir.
        kept: list[tuple[int, bytes]] = []
        n = 0
        with _read._open_bytes(f.path) as fh:
            for lineno, raw in enumerate(iter(fh.readline, b""), start=1):
                if not raw.strip():
                    continue
                n += 1
                if len(kept) < k:
                    kept.append((lineno, raw))
                else:
                    j = rng.randrange(n)
                    if j < k:
                        kept[j] = (lineno, raw)
        return _parse_lines(sorted(kept), max_bytes), n, True
    size = _size(f.path)
    if size <= _SMALL:
        with FileSystems.open(f.path, compression_type="uncompressed") as fh:
            lines = [(i, raw) for i, raw in enumerate(fh.read().split(b"\n"), start=1) if raw.strip()]
        return _parse_lines([lines[i] for i in _evenly(len(lines), k)], max_bytes), len(lines), True
    # Large: seek to k evenly spaced offsets and take the line after each one. The line a seek
    # lands in is chosen in proportion to its length; the line after it is not.
    lines = []
    with FileSystems.open(f.path, compression_type="uncompressed") as fh:
        for i in range(k):
            offset = int((i + 0.5) * size / k)
            fh.seek(offset)
            if offset:
                fh.readline()
            raw = fh.readline()
            while raw and not raw.strip():
                raw = fh.readline()
            if raw:
                lines.append((offset, raw))
    if not lines:
        return [], 0, True
    per_record = sum(len(raw) for _, raw in lines) / len(lines)
    if "://" not in f.path:
        records, exact = _count_lines(f.path), True
    else:
        records, exact = int(round(size / per_record)), False
    # Positions are line numbers in the job; here the offset's approximate line.
    lines = [(int(off / per_record) + 1, raw) for off, raw in lines]
    return _parse_lines(lines, max_bytes), records, exact


def _parquet_sample(f: _read.InputFile, k: int) -> tuple[list, int, bool]:
    import pyarrow.parquet as pq
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(f.path, compression_type="uncompressed") as fh:
        pf = pq.ParquetFile(fh)
        n = pf.metadata.num_rows
        starts = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
        wanted = _evenly(n, k)
        sample, cache = [], {}
        for i in wanted:
            g = int(np.searchsorted(starts, i, side="right") - 1)
            if g not in cache:
                cache = {g: pf.read_row_group(g).to_pylist()}  # one group in memory at a time
            sample.append((i, cache[g][i - starts[g]]))
    return sample, n, True


def _hf_sample(f: _read.InputFile, k: int) -> tuple[list, int, bool]:
    import datasets

    ds = datasets.load_from_disk(f.path)
    if f.split:
        ds = ds[f.split]
    wanted = _evenly(len(ds), k)
    return list(zip(wanted, ds.select(wanted).to_list())), len(ds), True


def sample_input(f: _read.InputFile, k: int = 1000, max_bytes: int = 16 * 2**20, seed: int = 0) -> InputSample:
    """About ``k`` records spread over input ``f``, and its record count."""
    if k < 1:
        raise PackstreamError(f"--sample {k} must be >= 1 records per input (e.g. 1000)")
    started = time.perf_counter()
    rng = random.Random(seed)
    if f.kind == "jsonl":
        sample, n, exact = _jsonl_sample(f, k, max_bytes, rng)
    elif f.kind == "parquet":
        sample, n, exact = _parquet_sample(f, k)
    elif f.kind == "hf_disk":
        sample, n, exact = _hf_sample(f, k)
    else:  # json, arrow: the job reads these whole too
        records = list(_read.read_file(f, max_bytes))
        sample, n, exact = [records[i] for i in _evenly(len(records), k)], len(records), True
        return InputSample(f, n, exact, sample, time.perf_counter() - started, len(records))
    return InputSample(f, n, exact, sample, time.perf_counter() - started, len(sample))


def count_records(f: _read.InputFile) -> int:
    """Records in one input, as cheaply as the format allows (used for the progress ETA)."""
    if f.kind == "jsonl" and not f.path.lower().endswith(".gz") and "://" not in f.path:
        return _count_lines(f.path)
    if f.kind == "parquet":
        import pyarrow.parquet as pq
        from apache_beam.io.filesystems import FileSystems

        with FileSystems.open(f.path, compression_type="uncompressed") as fh:
            return pq.ParquetFile(fh).metadata.num_rows
    if f.kind == "arrow":
        import pyarrow as pa
        from apache_beam.io.filesystems import FileSystems

        with FileSystems.open(f.path, compression_type="uncompressed") as fh:
            data = fh.read()
        try:
            return sum(b.num_rows for b in pa.ipc.open_stream(data))
        except pa.ArrowInvalid:
            return pa.ipc.open_file(data).read_all().num_rows
    return sample_input(f, k=1).records


# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Tokenized:
    sample: InputSample
    lengths: np.ndarray
    targets: np.ndarray
    """Target tokens per example within the first ``budget`` tokens (what --long truncate keeps)."""
    full_targets: np.ndarray
    rejected: dict
    seconds_per_record: float
    """Reading, parsing, normalizing, rendering and tokenizing one record (measured)."""
    examples: list


def _tokenize(s: InputSample, options: PackOptions, renderer) -> _Tokenized:
    from pipeline._rows import Example, example_id

    started = time.perf_counter()
    rejected: dict[str, int] = {}
    convs = []
    for pos, record in s.sample:
        try:
            if isinstance(record, Rejected):
                raise record
            convs.append((pos, record, normalize(record, options.format, options.fields)))
        except Rejected as r:
            rejected[r.reason.value] = rejected.get(r.reason.value, 0) + 1
    examples, lengths, targets, full = [], [], [], []
    for i in range(0, len(convs), options.batch_size):
        batch = convs[i : i + options.batch_size]
        for (pos, record, _), res in zip(batch, renderer.encode([c for _, _, c in batch])):
            if isinstance(res, Rejected):
                rejected[res.reason.value] = rejected.get(res.reason.value, 0) + 1
                continue
            examples.append(Example(example_id(s.file.source, pos, record), s.file.source, pos, res))
            lengths.append(res.shape[1])
            targets.append(int(res[1, : options.max_tokens].sum()))
            full.append(int(res[1].sum()))
    k = max(1, len(s.sample))
    per_record = (time.perf_counter() - started) / k + s.seconds / max(1, s.parsed)
    return _Tokenized(
        s, np.array(lengths, np.int64), np.array(targets, np.int64), np.array(full, np.int64), rejected,
        per_record, examples,
    )


def _kept_tokens(lengths: np.ndarray, budget: int, long: LongPolicy) -> np.ndarray:
    """Tokens each example contributes to the rows under the --long policy."""
    if long is LongPolicy.DROP:
        return np.where(lengths > budget, 0, lengths)
    if long is LongPolicy.TRUNCATE:
        return np.minimum(lengths, budget)
    return lengths


def _simulate_rows(tok: list[_Tokenized], examples: list[float], options: PackOptions, seed: int) -> tuple[float, float]:
    """(rows, pieces) for the projected examples, by packing resampled lengths."""
    total = sum(examples)
    if total < 1:
        return 0.0, 0.0
    m = int(min(total, _SIM_CAP))
    rng = np.random.default_rng(seed)
    parts = []
    for t, e in zip(tok, examples):
        take = int(round(e * m / total))
        if take == len(t.lengths):
            parts.append(t.lengths)  # the whole input was sampled: its own lengths, no resampling noise
        elif take and len(t.lengths):
            parts.append(rng.choice(t.lengths, size=take, replace=True))
    if not parts:
        return 0.0, 0.0
    lengths = np.concatenate(parts)
    rng.shuffle(lengths)  # the grouped job keys examples by a hash of their id: groups mix inputs
    kw = dict(long=options.long, max_per_row=options.max_per_row,
              refine=options.refine and options.max_per_row is None)  # as _rows.plan packs
    if options.mode is PackMode.GLOBAL:
        result = packers.pack(lengths, options.max_tokens, **kw)
    else:
        groups = max(1, math.ceil(total / options.group_size))
        group = max(1, math.ceil(total / groups))  # hash buckets are about equal
        result = packers.pack_stream(lengths, options.max_tokens, group_size=group, **kw)
    scale = total / len(lengths)
    return result.num_rows * scale, len(result.order) * scale


def _bytes_per_token(tok: list[_Tokenized], options: PackOptions) -> float:
    """Bytes per token of a real shard (this --output-format) built from the packed sample."""
    from pipeline import _rows, _write

    examples = [e for t in tok for e in t.examples]
    if not examples:
        return 5.0
    rows, _, _ = _rows.pack_group(examples, options)
    if not rows:
        return 5.0
    table = _write.rows_table(rows, packers.SCHEMA)
    data = _write.encode_shard(table, options.output_format.value)
    return len(data) / sum(r["num_tokens"] for r in rows)


def estimate(options: PackOptions, *, sample: int = 1000, workers: int = 1, seed: int = 0) -> dict[str, Any]:
    """Predict rows, fill, tokens, output size and the local run time of ``packstream pack``.

    Returns a JSON-ready dict (keys documented in ``docs/operations.md``; ``schema_version``
    changes with them).
    """
    from pipeline._job import num_shards
    from pipeline._render import Renderer, load_tokenizer

    if workers < 1:
        raise PackstreamError(f"--workers {workers} must be >= 1")
    started = time.perf_counter()
    files = _read.expand_inputs(options.inputs)
    t = time.perf_counter()
    load_tokenizer(options.tokenizer, options.trust_remote_code)
    tokenizer_s = time.perf_counter() - t
    renderer = Renderer(options)
    budget = options.max_tokens
    tok = [_tokenize(sample_input(f, sample, options.max_record_bytes, seed), options, renderer) for f in files]

    records = sum(t.sample.records for t in tok)
    rejected: dict[str, float] = {}
    examples, tokens, targets, dropped, per_file_s = [], 0.0, 0.0, 0.0, []
    for t in tok:
        k = len(t.sample.sample)
        scale = t.sample.records / k if k else 0.0
        for reason, n in t.rejected.items():
            rejected[reason] = rejected.get(reason, 0.0) + n * scale
        examples.append(len(t.lengths) * scale)
        kept = _kept_tokens(t.lengths, budget, options.long)
        tokens += kept.sum() * scale
        tgt = np.where(kept == 0, 0, t.targets if options.long is LongPolicy.TRUNCATE else t.full_targets)
        targets += tgt.sum() * scale
        if options.long is LongPolicy.DROP:
            dropped += (t.lengths > budget).sum() * scale
        per_file_s.append(t.sample.records * (t.seconds_per_record + _BEAM_PER_RECORD_S))
    rows, pieces = _simulate_rows(tok, examples, options, seed)
    rows = int(round(rows))
    tokens_i = int(round(tokens))
    lower = math.ceil(tokens_i / budget) if tokens_i else 0
    rows = max(rows, lower)
    out_bytes = int(round(tokens * _bytes_per_token(tok, options)))
    parallel = min(workers, len(files))
    work = max(sum(per_file_s) / max(1, parallel), max(per_file_s, default=0.0))
    run_s = _BEAM_STARTUP_S + tokenizer_s * (1 if workers == 1 else 2) + work + tokens * _BEAM_PER_TOKEN_S
    sampled = sum(len(t.sample.sample) for t in tok)
    rejected_total = sum(rejected.values())
    return {
        "schema_version": ESTIMATE_SCHEMA_VERSION,
        "inputs": [
            {"source": t.sample.file.source, "records": t.sample.records, "records_exact": t.sample.exact,
             "sampled": len(t.sample.sample), "mean_tokens": float(t.lengths.mean()) if len(t.lengths) else 0.0}
            for t in tok
        ],
        "sampled_records": sampled,
        "records": records,
        "rejected": int(round(rejected_total)),
        "rejected_by_reason": {k: int(round(v)) for k, v in sorted(rejected.items())},
        "dropped_too_long": int(round(dropped)),
        "examples_packed": int(round(sum(examples) - dropped)),
        "tokens": tokens_i,
        "target_tokens": int(round(targets)),
        "rows": rows,
        "lower_bound": lower,
        "fill": tokens_i / (rows * budget) if rows else 0.0,
        "examples_per_row": pieces / rows if rows else 0.0,
        "output_bytes": out_bytes,
        "shards": num_shards(options, rows),
        "workers": workers,
        "local_seconds": round(run_s, 1),
        "sample_tokens_per_s": round(
            sum(int(t.lengths.sum()) for t in tok) / max(1e-9, sum(t.seconds_per_record * len(t.sample.sample) for t in tok)), 1
        ),
        "estimate_seconds": round(time.perf_counter() - started, 2),
        "max_tokens": budget,
    }


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s} s"
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h} h {m:02d} min" if h else f"{m} min {sec:02d} s"


def format_estimate(e: dict[str, Any]) -> str:
    """The estimate as a two-column table, like ``pack``'s summary."""
    exact = all(i["records_exact"] for i in e["inputs"])
    lines = [
        ("records", f"{e['records']:,}" + ("" if exact else " (projected from file sizes)")),
        ("sampled", f"{e['sampled_records']:,} records from {len(e['inputs'])} inputs"),
        ("rejected", f"~{e['rejected']:,}"),
        *[(f"  {k}", f"~{v:,}") for k, v in e["rejected_by_reason"].items()],
        (f"dropped (> {e['max_tokens']} tokens)", f"~{e['dropped_too_long']:,}"),
        ("examples packed", f"~{e['examples_packed']:,}"),
        ("tokens", f"~{e['tokens']:,}  (~{e['target_tokens']:,} targets)"),
        ("rows", f"~{e['rows']:,}  (lower bound {e['lower_bound']:,})"),
        ("fill", f"~{e['fill']:.2%}"),
        ("examples per row", f"~{e['examples_per_row']:.2f}"),
        ("output", f"~{_human_bytes(e['output_bytes'])} in {e['shards']} shard(s)"),
        (f"local run time (--workers {e['workers']})", f"~{_duration(e['local_seconds'])}"),
    ]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)
