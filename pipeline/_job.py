"""The Beam job behind ``packstream pack``: thin composites around the pure functions.

::

    ListInputs -> ReadRecords (chunks) -> EncodeChunks ----------------> rejected
                                   (normalize, render, tokenize)          ^
                                   |                                      |
                                   v                                      |
       grouped: KeyByIdHash -> GroupByKey -> PackGroups ----------------->|  (duplicates, too long)
       global:  CollectLengths -> PlanGlobally -> JoinTokens -> Assemble->|
                                   |                                      |
                                   v                                      v
                 KeyByShard -> WriteShards                      WriteRejected
                                   \\______________ WriteManifest ________/

Counts are data, not metrics: the manifest sums what the steps emitted and refuses to finish
if records read != examples packed + rejected + dropped for length. Beam metrics (namespace
``packstream``) mirror them for runner UIs.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Optional, Sequence

import apache_beam as beam
from apache_beam.metrics import Metrics
from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

import packers
from packers import InternalError, PackstreamError
from pipeline import _progress, _read, _rows, _write
from pipeline._formats import Reason
from pipeline._options import PackMode, PackOptions
from pipeline._render import tokenizer_identity

NS = "packstream"
SHARD_TOKENS = 64 * 2**20  # automatic sharding: one shard per 64M budget tokens (~300 MB)


class TooManyRejected(PackstreamError):
    """More records were rejected than ``--max-reject-fraction`` allows (the CLI exits with 3)."""


class ReadRecords(beam.DoFn):
    """One input file -> chunks of ``(source, position, record)``; unparseable lines become Rejected.

    Records travel in chunks of ``--batch-size`` so that Beam's per-element cost is paid per
    chunk, not per record; the tokenizer then encodes a whole chunk in one batch call.
    """

    def __init__(self, max_bytes: int, chunk_size: int):
        self.max_bytes, self.chunk_size = max_bytes, chunk_size
        self.read = _progress.Counter(NS, "records_read")

    def process(self, f: _read.InputFile):
        chunk = []
        for position, record in _read.read_file(f, self.max_bytes):
            chunk.append((f.dataset, f.source, position, record))
            if len(chunk) == self.chunk_size:
                self.read.inc(len(chunk))
                yield chunk
                chunk = []
        if chunk:
            self.read.inc(len(chunk))
            yield chunk


class _Rejects:
    """One Beam counter per rejection reason, created on first use."""

    def __init__(self):
        self.counters: dict[str, Any] = {}

    def __call__(self, rec: dict):
        reason = rec["reason"]
        if reason not in self.counters:
            self.counters[reason] = Metrics.counter(NS, f"rejected_{reason}")
        self.counters[reason].inc()
        return beam.pvalue.TaggedOutput("rejected", rec)


class EncodeChunk(beam.DoFn):
    """A chunk of raw records -> an :class:`~pipeline._rows.ExampleBatch` (see :mod:`pipeline._encode`).

    The tokenizer loads once per worker process (``setup`` + a per-process cache).
    """

    def __init__(self, options: PackOptions):
        self.options = options
        self.encoder = None
        self.reject = _Rejects()
        self.examples = _progress.Counter(NS, "examples_tokenized")
        self.tokens = _progress.Counter(NS, "tokens")

    def setup(self):
        from pipeline._encode import Encoder

        self.encoder = Encoder(self.options)

    def process(self, chunk):
        enc = self.encoder.encode(chunk)
        for r in enc.rejected:
            yield self.reject(r)
        if enc.counts:
            yield beam.pvalue.TaggedOutput("stats", enc.counts)
        if len(enc.batch):
            self.examples.inc(len(enc.batch))
            self.tokens.inc(enc.batch.num_tokens)
            yield enc.batch


def _by_group(batch: _rows.ExampleBatch, n: int, group_size: int):
    """Split a batch of examples by group: a stable hash of the example id modulo the group count."""
    groups = max(1, math.ceil(n / group_size))
    parts: dict[int, list] = {}
    for e in batch.examples():
        parts.setdefault(_rows.stable_hash(e.example_id) % groups, []).append(e)
    return [(g, _rows.ExampleBatch.of(part)) for g, part in sorted(parts.items())]


class PackGroups(beam.DoFn):
    """Grouped mode: bin-pack one group of examples (all duplicates of an id land in one group)."""

    def __init__(self, options: PackOptions):
        self.options = options
        self.fill = Metrics.distribution(NS, "row_tokens")
        self.rows = _progress.Counter(NS, "rows")

        self.reject = _Rejects()

    def process(self, keyed):
        _, parts = keyed
        rows, rejected, stats = _rows.pack_group((e for part in parts for e in part.examples()), self.options)
        for r in rejected:
            yield self.reject(r)
        self.rows.inc(len(rows))
        for row in rows:
            self.fill.update(row["num_tokens"])
            yield row
        yield beam.pvalue.TaggedOutput("stats", stats)


def _plan_globally(items: list, options: PackOptions):
    kept, rejected = _rows.dedupe(items)
    plan = _rows.plan(kept, options)
    plan.stats["duplicates"] = len(rejected)
    for r in rejected + plan.rejected:
        yield beam.pvalue.TaggedOutput("rejected", r)
    yield beam.pvalue.TaggedOutput("stats", plan.stats)
    for row_no, pieces in enumerate(plan.rows):
        for slot, piece in enumerate(pieces):
            yield piece.example_id, (row_no, slot, piece)


def _join_tokens(keyed):
    _, grouped = keyed
    placements, examples = grouped["placements"], grouped["examples"]
    if not placements:
        return  # a duplicate or dropped example: already dead-lettered by the plan
    tokens = min(examples, key=lambda e: (e.source, e.position)).tokens
    for row_no, slot, piece in placements:
        yield row_no, (slot, piece, tokens)


def _assemble_global(keyed, seed: int):
    _, parts = keyed
    parts = sorted(parts, key=lambda t: t[0])
    tokens = {p.example_id: tok for _, p, tok in parts}
    return _rows.assemble([p for _, p, _ in parts], tokens, seed)


class PackRows(beam.PTransform):
    """Chunks of examples -> packed rows, plus ``rejected`` and per-group ``stats`` side outputs."""

    def __init__(self, options: PackOptions):
        super().__init__()
        self.options = options

    def expand(self, chunks):
        o = self.options
        if o.mode is PackMode.GLOBAL:
            examples = chunks | "Examples" >> beam.FlatMap(lambda batch: batch.examples())
            planned = (
                examples
                | "Lengths" >> beam.Map(lambda e: (e.example_id, e.source, e.position, e.length))
                | "CollectLengths" >> beam.combiners.ToList()
                | "PlanGlobally" >> beam.FlatMap(_plan_globally, o).with_outputs("rejected", "stats", main="placements")
            )
            rows = (
                {"placements": planned.placements, "examples": examples | "KeyById" >> beam.Map(lambda e: (e.example_id, e))}
                | "JoinTokens" >> beam.CoGroupByKey()
                | "ToRows" >> beam.FlatMap(_join_tokens)
                | "GroupRows" >> beam.GroupByKey()
                | "Assemble" >> beam.Map(_assemble_global, o.seed)
            )
            return rows, planned.rejected, planned.stats
        n = chunks | "ChunkSizes" >> beam.Map(len) | "CountExamples" >> beam.CombineGlobally(sum)
        groups = (
            chunks
            | "KeyByIdHash" >> beam.FlatMap(_by_group, n=beam.pvalue.AsSingleton(n), group_size=o.group_size)
            | "GroupByKey" >> beam.GroupByKey()
            | "PackGroups" >> beam.ParDo(PackGroups(o)).with_outputs("rejected", "stats", main="rows")
        )
        return groups.rows, groups.rejected, groups.stats


def num_shards(options: PackOptions, rows: int) -> int:
    if options.num_shards:
        return options.num_shards
    return max(1, math.ceil(rows * options.max_tokens / SHARD_TOKENS))


class WriteShards(beam.PTransform):
    """Rows -> shard files ``train-XXXXX-of-NNNNN``; every shard index exists, even an empty one."""

    def __init__(self, options: PackOptions, schema):
        super().__init__()
        self.options, self.schema = options, schema

    def expand(self, rows):
        o = self.options
        count = rows | "CountRows" >> beam.combiners.Count.Globally()
        keyed = rows | "KeyByShard" >> beam.Map(
            lambda r, c: (r["key"] % num_shards(o, c), r), c=beam.pvalue.AsSingleton(count)
        )
        every = count | "EveryShard" >> beam.FlatMap(lambda c: [(i, None) for i in range(num_shards(o, c))])
        return (
            {"rows": keyed, "exists": every}
            | "GroupShards" >> beam.CoGroupByKey()
            | "WriteShard" >> beam.Map(
                lambda kv, c: _write.write_shard(
                    o.output, kv[0], num_shards(o, c), list(kv[1]["rows"]), self.schema, o.output_format.value
                ),
                c=beam.pvalue.AsSingleton(count),
            )
        )


def _manifest(_, *, options, identity, files, shards, rejected, stats, records_read) -> dict:
    """Sum what the steps emitted into manifest.json and README.md; check that counts reconcile."""
    totals: dict[str, int] = {}
    for s in stats:
        for k, v in s.items():
            totals[k] = totals.get(k, 0) + v
    rows = sum(s["rows"] for s in shards)
    tokens = sum(s["tokens"] for s in shards)
    budget = options.max_tokens
    too_long = rejected.get(Reason.TOO_LONG.value, 0)
    rejected_other = sum(v for k, v in rejected.items() if k != Reason.TOO_LONG.value)
    examples = totals.get("examples_packed", 0)
    counts = {
        "records_read": records_read,
        "examples_packed": examples,
        "rejected": rejected_other,
        "rejected_by_reason": {k: v for k, v in rejected.items() if k != Reason.TOO_LONG.value},
        "dropped_too_long": too_long,
        "dropped_too_long_tokens": totals.get("dropped_too_long_tokens", 0),
        "truncated_examples": totals.get("truncated_examples", 0),
        "truncated_tokens": totals.get("truncated_tokens", 0),
        "split_examples": totals.get("split_examples", 0),
        "pieces": totals.get("pieces", 0),
        "rows": rows,
        "tokens": tokens,
        "target_tokens": sum(s["target_tokens"] for s in shards),
        "lower_bound": math.ceil(tokens / budget) if tokens else 0,
        "fill": tokens / (rows * budget) if rows else 0.0,
        "examples_per_row": totals.get("pieces", 0) / rows if rows else 0.0,
    }
    if records_read != examples + rejected_other + too_long:
        raise InternalError(
            f"counts do not reconcile: read {records_read} != packed {examples} + rejected {rejected_other} "
            f"+ dropped for length {too_long}"
        )
    if totals.get("rows", rows) != rows or sum(s["examples"] for s in shards) != counts["pieces"]:
        raise InternalError(f"shards hold {rows} rows / {sum(s['examples'] for s in shards)} pieces, packing made "
                            f"{totals.get('rows')} / {counts['pieces']}")
    manifest = {
        "packstream_version": _version(),
        "contract_version": packers.CONTRACT_VERSION,
        "config": options.to_dict(),
        "tokenizer": identity,
        "inputs": [{"path": f.path, "source": f.source, "kind": f.kind, "split": f.split} for f in files],
        "counts": counts,
        "shards": sorted(shards, key=lambda s: s["name"]),
        "rejected_file": "rejected.jsonl",
    }
    body = json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    _write.write_atomic(_write.join(options.output, "manifest.json"), body.encode())
    _write.write_atomic(_write.join(options.output, "README.md"), _write.dataset_card(manifest).encode())
    return manifest


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("packstream")
    except PackageNotFoundError:
        return "0+unknown"


def prepare_output(options: PackOptions) -> None:
    """Refuse a non-empty output folder unless --overwrite; then remove only packstream's own files."""
    from apache_beam.io.filesystems import FileSystems

    out = options.output.rstrip("/")
    if "://" not in out:
        import os

        if os.path.exists(out) and not os.path.isdir(out):
            raise PackstreamError(f"--output {out} is a file; give a folder")
        os.makedirs(out, exist_ok=True)
        existing = sorted(os.listdir(out))
    else:
        existing = [posixpath_basename(m.path) for m in FileSystems.match([out + "/*"])[0].metadata_list]
    if not existing:
        return
    if not options.overwrite:
        raise PackstreamError(
            f"--output {out} is not empty ({len(existing)} entries, e.g. {existing[0]}); "
            "pass --overwrite to replace packstream's files there, or choose an empty folder"
        )
    own = [n for n in existing if n.startswith(_write.OWN_FILES)]
    if own:
        FileSystems.delete([_write.join(out, n) for n in own])


def posixpath_basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def pipeline_options(beam_args: Sequence[str], workers: int) -> tuple[PipelineOptions, Any]:
    """Beam options plus the runner: FnApiRunner locally (never Prism, which downloads a binary)."""
    args = list(beam_args)
    runner = None
    if not any(a == "--runner" or a.startswith("--runner=") for a in args):
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        runner = FnApiRunner()
        if workers > 1:
            args += [f"--direct_num_workers={workers}", "--direct_running_mode=multi_processing"]
    return PipelineOptions(args, pipeline_type_check=True), runner


def run(options: PackOptions, beam_args: Sequence[str] = (), progress: Optional[_progress.Progress] = None) -> dict:
    """Build and run the whole job; returns the manifest. Raises PackstreamError on user error.

    ``progress`` reports a local run while it runs (see :mod:`pipeline._progress`); it never
    changes the output. A Flex Template launch (``--template_location``) only writes the job
    graph: Dataflow runs it later, so there is no manifest yet and this returns the config.
    """
    started = time.time()
    files, duplicate_notes = _read.expand_datasets(options.datasets())
    identity = tokenizer_identity(options.tokenizer, options.trust_remote_code)
    prepare_output(options)
    schema = packers.shard_schema(
        budget=options.max_tokens,
        tokenizer=identity["name"],
        vocab_sha256=identity["vocab_sha256"],
        pad_token_id=identity["pad_token_id"],
        eos_token_id=identity["eos_token_id"],
    )
    pipe_opts, runner = pipeline_options(beam_args, options.workers or 1)
    with _progress.watching(progress, files, local=runner is not None), beam.Pipeline(runner=runner, options=pipe_opts) as p:
        records = (
            p
            | "ListInputs" >> beam.Create(files)
            | "SpreadFiles" >> beam.Reshuffle()
            | "ReadRecords" >> beam.ParDo(ReadRecords(options.max_record_bytes, options.batch_size))
        )
        tokenized = (
            records
            # Big files are read by one worker; spreading their chunks lets every worker tokenize.
            | "SpreadChunks" >> beam.Reshuffle()
            | "EncodeChunks" >> beam.ParDo(EncodeChunk(options)).with_outputs("rejected", "stats", main="ok")
        )
        rows, pack_rejected, stats = tokenized.ok | "PackRows" >> PackRows(options)
        shards = rows | "WriteShards" >> WriteShards(options, schema)
        reject_counts = (
            (tokenized.rejected, pack_rejected)
            | "AllRejected" >> beam.Flatten()
            | "OneFile" >> beam.combiners.ToList()
            | "WriteRejected" >> beam.Map(lambda recs: _write.write_rejected(options.output, recs))
        )
        (
            p
            | "Finish" >> beam.Create([None])
            | "WriteManifest" >> beam.Map(
                _manifest,
                options=options,
                identity=identity,
                files=files,
                shards=beam.pvalue.AsList(shards),
                rejected=beam.pvalue.AsSingleton(reject_counts),
                stats=beam.pvalue.AsList((stats, tokenized.stats) | "AllStats" >> beam.Flatten()),
                records_read=beam.pvalue.AsSingleton(
                    records | "RecordChunkSizes" >> beam.Map(len) | "CountRecords" >> beam.CombineGlobally(sum)
                ),
            )
        )
    template = pipe_opts.view_as(GoogleCloudOptions).template_location
    if template and runner is None:  # DataflowRunner wrote the job graph there and submitted nothing
        return {"config": options.to_dict(), "template_location": template}
    manifest = json.loads(_write.read_bytes(_write.join(options.output, "manifest.json")))
    manifest["elapsed_s"] = round(time.time() - started, 3)
    c = manifest["counts"]
    if c["records_read"] == 0:
        shown = ", ".join(f.path for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        raise PackstreamError(f"the inputs hold no records ({shown}); check that they are the files you meant")
    rejected_frac = (c["rejected"] + c["dropped_too_long"]) / max(1, c["records_read"])
    if rejected_frac > options.max_reject_fraction:
        raise TooManyRejected(
            f"{rejected_frac:.1%} of {c['records_read']} records were rejected or dropped, more than "
            f"--max-reject-fraction {options.max_reject_fraction:.1%}; see {options.output}/rejected.jsonl"
        )
    return manifest

