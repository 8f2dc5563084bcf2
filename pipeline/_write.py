"""Writers: packed rows -> Arrow (or Parquet) shards, the dead-letter file, manifest and card.

Every file appears atomically: it is written under a temporary name in the output folder and
renamed into place, so a reader never sees a partial shard and a retried or re-run writer
produces the same bytes under the same name. Shards keep their temporary (``.tmp-*``) names
until the run commits (:func:`publish`): ``datasets`` ignores such names, so no shard of a run
that can still fail sits where it would be loaded. Shard contents are deterministic: rows sorted
by their seeded shuffle key, one fixed schema (:data:`packers.SCHEMA`) with fixed metadata.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import posixpath
import uuid
from typing import Any, Iterator, Optional, Sequence

import pyarrow as pa

import packers
from packers import PackstreamError
from packers.manifest import shard_name  # noqa: F401 - the writers' name for shards
from pipeline import _arrow, _fs, _sink
from pipeline._rows import reject_sort_key
from pipeline._sink import Site


SHARD_TOKENS = 64 * 2**20
"""Budget tokens per output shard when ``--num-shards`` is 0 (automatic)."""
INPUT_BYTES_PER_TOKEN = 4
"""About how many bytes of input text make one token: sizes shards before anything is tokenized."""
SHARD_RECORDS = 1000
"""The fewest records an explicit ``--num-shards`` gives each shard, or ``--group-size`` when that is smaller (but
never under :data:`MIN_SHARD_RECORDS`): shards past that make packing groups of a few records, which pack badly
(30,000 one-record groups filled 5% of their rows)."""
MIN_SHARD_RECORDS = 8
"""The fewest records a shard is expected to hold, whatever ``--group-size``: a shard expected to hold k records
(hashed by id) is empty with probability about e^-k, so at 8 about one shard in 3,000 is (shards of one expected record
each were a third empty), while a small input can still be cut into a few shards for a test or a demo."""


def auto_shards(input_bytes: float) -> int:
    """Shards of one split when ``--num-shards`` is 0: one per :data:`SHARD_TOKENS` tokens of input."""
    return max(1, math.ceil(input_bytes / INPUT_BYTES_PER_TOKEN / SHARD_TOKENS))


def shard_layout(options, records: float, input_bytes: float) -> tuple[dict[str, int], dict[str, int]]:
    """(packing groups, output shards) per split ("train", "validation") of a run over ``records``
    records (weighted by their data sets' weights) and ``input_bytes`` bytes of input: what the job
    plans before it starts, and what ``packstream estimate`` predicts.

    In grouped mode shard ``s`` packs the groups ``g`` with ``g % shards == s``: an explicit
    ``--num-shards`` gets at least a group per shard (smaller groups), an automatic count never
    exceeds the groups. Either is at most one shard per :func:`shard_records` records the split expects, so
    that every shard gets rows: 30,000 records asked for 50,000 shards make 30 (see :func:`shard_cap_notes`).
    """
    from pipeline._options import PackMode

    fractions = {"train": 1.0 - options.validation_fraction, "validation": options.validation_fraction}
    groups, shards = {}, {}
    for split, frac in fractions.items():
        groups[split] = 1 if options.mode is PackMode.GLOBAL else max(1, math.ceil(records * frac / options.group_size))
        auto = auto_shards(input_bytes * frac)
        asked = min(options.num_shards, max(1, math.ceil(records * frac / shard_records(options))))
        if options.mode is PackMode.GROUPED:
            shards[split] = asked or min(auto, groups[split])
            groups[split] = max(groups[split], shards[split])
        else:
            shards[split] = asked or auto
    return groups, shards


def shard_records(options) -> int:
    """The fewest records the split expects per shard of an explicit ``--num-shards``: :data:`SHARD_RECORDS`, or
    ``--group-size`` when smaller (the user's own bound on a packing group), at least :data:`MIN_SHARD_RECORDS`."""
    return min(SHARD_RECORDS, max(MIN_SHARD_RECORDS, options.group_size))


def shard_cap_notes(options, shards: dict[str, int]) -> list[str]:
    """One line per split whose ``--num-shards`` :func:`shard_layout` capped at one shard per :func:`shard_records`
    records the split expects: the manifest's ``notes``, which pack's summary shows.

    >>> from pipeline._options import PackOptions
    >>> shard_cap_notes(PackOptions(inputs=("in.jsonl",), num_shards=50000), {"train": 30, "validation": 1})
    ['--num-shards 50000 capped to 30 train shards, one per 1,000 records (fewer records per shard pack worse and leave shards empty); pass --num-shards 30 or fewer, or a smaller --group-size (down to 8 records per shard)']
    """
    splits = ("train", "validation") if options.validation_fraction > 0 else ("train",)
    each = shard_records(options)
    smaller = f", or a smaller --group-size (down to {MIN_SHARD_RECORDS} records per shard)" if each > MIN_SHARD_RECORDS else ""
    return [f"--num-shards {options.num_shards} capped to {shards[s]} {s} shards, one per {each:,} records (fewer "
            f"records per shard pack worse and leave shards empty); pass --num-shards {shards[s]} or fewer{smaller}"
            for s in splits if shards[s] < options.num_shards]


def run_digest(config: dict, inputs: list[dict], tokenizer: dict) -> str:
    """The manifest's ``run_id`` (16 hex digits), which every shard also carries in its schema metadata: a
    digest of what decides the run's bytes (``config`` without the output folder, ``inputs``, ``tokenizer``,
    the contract version). A rerun of the same run, into any folder, gets the same id and the same bytes;
    readers use it to tell this run's shards and resume states from another run's."""
    recipe = {"contract_version": packers.CONTRACT_VERSION, "tokenizer": tokenizer, "inputs": inputs,
              "config": _recipe(config)}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:16]


EXIT_ONLY = {"max_reject_fraction": 1.0}
"""Options that decide how a run ends, never its bytes: entered in the run's id at the value every run had before the
default changed, so the same rows keep the same id (and shard bytes) whatever the threshold."""


def _recipe(config: dict) -> dict:
    """``config`` as it enters the run's id: without the output folder, and without the options added later at their
    defaults (:data:`pipeline._options.LATER_DEFAULTS`), in the data sets of a ``--config`` too."""
    from pipeline._options import LATER_DEFAULTS

    def kept(d: dict) -> dict:
        out = {k: v for k, v in d.items() if k != "output" and not (k in LATER_DEFAULTS and v == LATER_DEFAULTS[k])}
        return {**out, **{k: v for k, v in EXIT_ONLY.items() if k in out}}

    out = kept(config)
    if isinstance(out.get("config"), list):
        out["config"] = [kept(d) if isinstance(d, dict) else d for d in out["config"]]
    return out


def run_metadata(options, identity: dict, run_id: str) -> dict:
    """The schema metadata of every shard of a run (:func:`packers.schema_metadata`): its budget, its tokenizer's
    identity (:func:`pipeline._tokenizer.tokenizer_identity`) and ``run_id``; each shard adds its own place."""
    vision = options.vision()
    return packers.schema_metadata(budget=options.max_tokens, tokenizer=identity["name"],
                                   vocab_sha256=identity["vocab_sha256"], pad_token_id=identity["pad_token_id"],
                                   eos_token_id=identity["eos_token_id"], run_id=run_id,
                                   vision=None if vision is None else vision.to_json())


def run_schema(options, identity: dict, run_id: str) -> pa.Schema:
    """The schema of every shard of a run, its :func:`run_metadata` attached: :data:`packers.SCHEMA`, or
    :data:`packers.VISION_SCHEMA` for a run with images (``--processor``)."""
    vision = options.vision()
    rows = packers.SCHEMA if vision is None else packers.VIDEO_SCHEMA if vision.videos else packers.VISION_SCHEMA
    return pa.schema(rows, metadata=run_metadata(options, identity, run_id))


def join(folder: str, name: str) -> str:
    """``name`` inside the local or remote ``folder`` (:func:`pipeline._fs.join`)."""
    return _fs.join(folder, name)


def list_folder(folder: str) -> list[str]:
    """The names in a local or remote (gs://, s3://, ...) folder, sorted."""
    if "://" in folder:
        found = _fs.match(folder.rstrip("/") + "/*")
        return sorted(m.path.rstrip("/").rsplit("/", 1)[-1] for m in found)
    return sorted(os.listdir(folder))


def beam_open(path: str):
    """A remote file (gs://, s3://, ...) as a binary stream through Beam's FileSystems, uncompressed: the
    ``opener`` the checked open (:mod:`packers.files`) uses for anything that is not a local path
    (:func:`pipeline._fs.open`, which opens a local path without Beam)."""
    return _fs.open(path)


def read_bytes(path: str, *, what: str, limit: int, fix: str = "") -> bytes:
    """A whole file's bytes, local or remote (no decompression), through the checked open: a regular file of
    at most ``limit`` bytes, else one PackstreamError line (:func:`packers.files.read_checked`)."""
    from packers.files import read_checked

    return read_checked(path, what=what, limit=limit, fix=fix, opener=beam_open)


def read_lines(path: str, *, what: str, line_limit: int) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of a local or remote JSON-lines file, read one line at a time through the
    checked open (a FIFO or a device is refused, never read): memory stays one line, and a line longer than
    ``line_limit`` bytes (``/dev/zero``'s endless line, a damaged file) is one PackstreamError line."""
    from packers.files import open_checked, show_path

    with open_checked(path, what=what, opener=beam_open) as f:
        number = 0
        while line := f.readline(line_limit + 1):
            number += 1
            if len(line) > line_limit:
                raise PackstreamError(f"{what} {show_path(path)} line {number} is longer than {line_limit:,} bytes; "
                                      "this is not a file packstream wrote: restore the folder or re-run packstream pack")
            yield number, line


def read_manifest(folder: str, *, consistent: bool = True, files_only: bool = False):
    """The checked :class:`packers.manifest.Manifest` of the local or remote output ``folder`` (see
    :func:`packers.manifest.load_manifest`)."""
    from packers.manifest import MANIFEST, load_manifest

    return load_manifest(join(folder, MANIFEST), folder, opener=beam_open, consistent=consistent,
                         files_only=files_only)


def write_atomic(path: str, data: bytes, site: Site) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and a rename (``site``: what it is, for the one
    door every output write goes through, :func:`pipeline._sink.create`)."""
    folder, name = posixpath.split(path) if "://" not in path else path.rsplit("/", 1)
    tmp = join(folder, f".tmp-{name}.{uuid.uuid4().hex}")
    try:
        with _sink.create(tmp, site) as f:
            f.write(data)
        _fs.replace(tmp, path)  # locally os.replace: atomic on POSIX
    except BaseException:
        # A failed attempt leaves no temp file behind (the retry writes its own); only a hard kill
        # can, and the next --overwrite run removes those (they carry packstream's .tmp- prefix).
        try:
            if _fs.exists(tmp):
                _fs.delete([tmp])
        except OSError:  # best effort (BeamIOError is an OSError); the original error matters more
            pass
        raise


class _HashingFile:
    """A binary sink that hashes and counts what passes through it."""

    def __init__(self, raw):
        self.raw, self.sha, self.size, self.closed = raw, hashlib.sha256(), 0, False

    def write(self, data) -> int:
        mv = memoryview(data)
        self.sha.update(mv)
        self.size += mv.nbytes
        return self.raw.write(mv)

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.closed = True

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True


class ShardWriter:
    """Write one shard as its record batches come (never the whole shard in memory), atomically.

    The bytes go to a ``.tmp-`` sibling through a sha256; :meth:`close` finishes the file and
    returns what manifest.json says about it, plus ``"staged"``: the temporary path, which
    :func:`publish` renames into place when the run commits. Arrow: an uncompressed IPC *stream*,
    what ``datasets.Dataset.from_file`` memory-maps zero-copy; an empty shard still holds one
    empty record batch, so every reader sees the full schema. Parquet: zstd, a row group per batch.
    """

    def __init__(self, folder: str, name: str, schema: pa.Schema, output_format: str):
        from packers.manifest import shard_place
        from packers.schema import place_metadata

        place = shard_place(name)
        if place is None:
            raise packers.InternalError(f"{name!r} is not a shard name (packers.manifest.shard_name makes them)")
        # Each shard carries its own place (run id, split, index, count): readers hold it against the manifest.
        schema = schema.with_metadata(place_metadata(schema.metadata, split=place[0], shard_index=place[1],
                                                     shard_count=place[2]))
        self.path, self.name, self.schema = join(folder, name), name, schema
        self.tmp = join(folder, f".tmp-{name}.{uuid.uuid4().hex}")
        self._raw = _sink.create(self.tmp, Site.SHARD)
        self._sink = _HashingFile(self._raw)
        if output_format == "parquet":
            import pyarrow.parquet as pq

            self._writer = pq.ParquetWriter(pa.PythonFile(self._sink, mode="w"), schema, compression="zstd")
        else:
            self._writer = pa.ipc.new_stream(pa.PythonFile(self._sink, mode="w"), schema)
        self.rows = self.examples = self.tokens = self.target_tokens = 0

    def write(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self._write(batch)

    def _write(self, batch: pa.RecordBatch) -> None:
        import pyarrow.compute as pc

        if isinstance(self._writer, pa.ipc.RecordBatchStreamWriter):
            self._writer.write_batch(batch.replace_schema_metadata(self.schema.metadata))
        else:
            self._writer.write_table(pa.Table.from_batches([batch]).replace_schema_metadata(self.schema.metadata))
        self.rows += batch.num_rows
        self.examples += len(batch.column("example_ids").values)
        self.tokens += int(pc.sum(batch.column("num_tokens")).as_py() or 0)
        self.target_tokens += int(pc.sum(batch.column("loss_mask").values).as_py() or 0)

    def close(self, split: str) -> dict:
        if self.rows == 0 and isinstance(self._writer, pa.ipc.RecordBatchStreamWriter):
            self._writer.write_batch(_arrow.empty_batch(self.schema))  # readable when empty
        self._writer.close()
        self._raw.close()
        return {"name": self.name, "split": split, "rows": self.rows, "examples": self.examples,
                "tokens": self.tokens, "target_tokens": self.target_tokens, "bytes": self._sink.size,
                "sha256": self._sink.sha.hexdigest(), "staged": self.tmp}

    def abort(self) -> None:
        try:
            self._raw.close()
        except Exception:  # noqa: BLE001 - best effort: the original error matters more
            pass
        try:
            _fs.delete([self.tmp])
        except Exception:  # noqa: BLE001
            pass


def publish(folder: str, shards: Sequence[dict]) -> list[dict]:
    """The commit's first step: rename every staged shard (:meth:`ShardWriter.close`) to its final name.

    Returns the manifest's shard entries (without ``"staged"``). A commit that is retried (a runner
    retries a failed bundle) finds the shards it already renamed in place, and goes on.
    """
    out = []
    for s in shards:
        entry = {k: v for k, v in s.items() if k != "staged"}
        staged, final = s.get("staged"), join(folder, s["name"])
        if staged and (_fs.exists(staged) or not _fs.exists(final)):
            _fs.replace(staged, final)
        out.append(entry)
    return out


def discard(shards: Sequence[dict]) -> None:
    """A failed run publishes nothing: remove its staged shards (best effort; --overwrite removes any ``.tmp-*``)."""
    staged = [s["staged"] for s in shards if s.get("staged")]
    for path in staged:
        try:
            _fs.delete([path])
        except Exception:  # noqa: BLE001 - BeamIOError (an OSError) or a missing file: nothing to keep
            pass


def write_reject_part(folder: str, name: str, records: list[dict]) -> Optional[str]:
    """Dead letters of one task or shard, sorted, as a JSON-lines part; None when there are none."""
    if not records:
        return None
    records = sorted(records, key=reject_sort_key)
    path = join(folder, f"rejects-{name}-{uuid.uuid4().hex[:12]}.jsonl")
    write_atomic(path, "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records).encode(),
                 Site.REJECTS)
    return path


def merge_rejected(folder: str, parts: Sequence[str]) -> tuple[dict[str, int], dict[str, dict]]:
    """Merge sorted dead-letter parts into ``rejected.jsonl`` (streaming); counts and first record by reason."""
    import heapq

    def lines(path: str):
        with _fs.open(path) as f:
            for line in iter(f.readline, b""):
                rec = json.loads(line)
                yield reject_sort_key(rec), line

    counts: dict[str, int] = {}
    first: dict[str, dict] = {}
    path = join(folder, "rejected.jsonl")
    tmp = join(folder, f".tmp-rejected.jsonl.{uuid.uuid4().hex}")
    with _sink.create(tmp, Site.REJECTS) as out:
        for _, line in heapq.merge(*(lines(p) for p in sorted(parts)), key=lambda t: t[0]):
            out.write(line)
            rec = json.loads(line)
            counts[rec["reason"]] = counts.get(rec["reason"], 0) + 1
            first.setdefault(rec["reason"], rec)
    _fs.replace(tmp, path)
    return dict(sorted(counts.items())), first


def _yaml_features(schema: pa.Schema) -> str:
    """The ``features:`` list of a datasets card for ``schema`` (what ``datasets.Features`` writes)."""
    lines = []
    for field in schema:
        if pa.types.is_list(field.type) and pa.types.is_struct(field.type.value_type):
            lines += [f"  - name: {field.name}", "    list:"]
            lines += [ln for sub in field.type.value_type for ln in (f"    - name: {sub.name}", f"      dtype: {sub.type}")]
        elif pa.types.is_list(field.type):
            lines += [f"  - name: {field.name}", f"    list: {field.type.value_type}"]
        else:
            lines += [f"  - name: {field.name}", f"    dtype: {field.type}"]
    return "\n".join(lines)


def _cuts_column(manifest: dict) -> str:
    """The card's words for the ``cuts`` column, in a run whose rows have it (contract version 9)."""
    if "cuts" not in packers.schema.row_schema(manifest["contract_version"]).names:
        return ""
    return ("\n`cuts` (list<int32>, two per sequence `[pieces, length]`: `[0, 0]` whole, `[1, N]` truncated from N "
            "tokens, `[n, N]` piece `#k` of n of a split example of N tokens), empty in rows where nothing was cut.")


def _vision_columns(manifest: dict[str, Any]) -> str:
    """The card's words on the image columns of a run with images (contract version 7, 8 with videos); "" otherwise."""
    if "vision" not in manifest:
        return ""
    return ("\nImages (packed for the processor in `manifest.json`'s `vision`): `image_offsets` (list<int32>, each "
            "image's first placeholder token in the row), `image_grid_thw` (list<int32>, t, h, w per image) and "
            "`images` (list<struct<path, bytes>>).")


def _size_category(rows: int) -> str:
    """The Hub's ``size_categories`` tag for ``rows`` rows."""
    bounds = ["1K", "10K", "100K", "1M", "10M", "100M", "1B", "10B", "100B", "1T"]
    for i, b in enumerate(bounds):
        if rows < 10 ** (3 + i):
            return f"n<{b}" if i == 0 else f"{bounds[i - 1]}<n<{b}"
    return "n>1T"


GUARD_MARK = "<!-- packstream: not a complete output -->"
"""The line that marks packstream's own "not complete" card (pipeline._output recognises its leftovers by it)."""
GUARD_DATA = "packstream-output-not-complete-see-README.md"
"""Where the guard card's ``data_files`` point: a name that never exists, so ``datasets.load_dataset(folder)``
raises ``FileNotFoundError: Unable to find '.../packstream-output-not-complete-see-README.md'``."""


def guard_card(why: str) -> str:
    """README.md of a folder that holds no complete output: while a run writes it, or after it failed.

    ``datasets.load_dataset(folder)`` reads a card's ``configs`` before anything else, and without
    a card it infers splits from file names (``train-*``, and ``rejected.jsonl`` as data): so a
    card is always there, and until the commit it points at a name that does not exist. Only a
    complete run replaces it with :func:`dataset_card`.
    """
    return f"""---
configs:
- config_name: default
  data_files:
  - split: train
    path: "{GUARD_DATA}"
tags:
- packstream
---
{GUARD_MARK}

# Not a complete packstream output

{why}

Nothing here is a dataset yet: `datasets.load_dataset`, `packers.PackedDataset` and `packstream verify`
refuse this folder (its `manifest.json` is missing or says `"status": "failed"`). Fix the cause, if any,
and run `packstream pack ... --overwrite` into this folder: it removes exactly the files packstream wrote
here and packs again.
"""


def dataset_card(manifest: dict[str, Any]) -> str:
    """The output folder's README.md, with the YAML header that datasets and the Hub read.

    Only a complete run's card points at data; a failed run's is :func:`guard_card` with the reason.
    """
    if manifest.get("status") != "complete":
        return guard_card(f"This packstream run failed: {manifest.get('error') or 'no reason recorded'}.")
    c = manifest["counts"]
    ext = "parquet" if manifest["config"]["output_format"] == "parquet" else "arrow"
    # Only splits that hold rows: `datasets` cannot load a DatasetDict with an empty split (datasets#8401),
    # so an empty validation split must not take the train split down with it.
    splits = sorted({s.get("split", "train") for s in manifest["shards"] if s["rows"]} or {"train"},
                    key=lambda x: x != "train")
    total_bytes = sum(s["bytes"] for s in manifest["shards"])
    files = "\n".join(f'  - split: {sp}\n    path: "{sp}-*.{ext}"' for sp in splits)
    infos = "\n".join(
        f"  - name: {sp}\n    num_bytes: {sum(s['bytes'] for s in manifest['shards'] if s.get('split', 'train') == sp)}\n"
        f"    num_examples: {sum(s['rows'] for s in manifest['shards'] if s.get('split', 'train') == sp)}"
        for sp in splits
    )
    header = f"""---
configs:
- config_name: default
  data_files:
{files}
dataset_info:
  features:
{_yaml_features(packers.schema.row_schema(manifest["contract_version"]))}
  splits:
{infos}
  download_size: {total_bytes}
  dataset_size: {total_bytes}
tags:
- packstream
- packed-sft
task_categories:
- text-generation
size_categories:
- {_size_category(c['rows'])}
---
"""
    t = manifest["tokenizer"]
    pairs = bool(manifest["config"].get("pairs"))
    what = ("preference pairs, each pair's chosen and rejected sides next to each other in one row"
            if pairs else "examples")
    body = f"""
# Packed {'preference' if pairs else 'SFT'} data (packstream)

Rows of at most **{manifest['config']['max_tokens']}** tokens, each holding several tokenized
{what} back to back (packed-row contract v{manifest['contract_version']}; no padding stored).

| | |
|---|---|
| rows | {c['rows']:,} |
| packed {'pairs' if pairs else 'examples'} | {c['examples_packed']:,} |
| tokens | {c['tokens']:,} |
| fill | {c['fill']:.4%} |
| rows vs lower bound | {c['rows']:,} vs {c['lower_bound']:,} |
| records read | {c['records_read']:,} |
| rejected | {c['rejected']:,} (see `rejected.jsonl`) |
| tokenizer | `{t['name']}` (vocab sha256 `{t['vocab_sha256'][:16]}…`) |

Columns: `input_ids` (list<int32>), `loss_mask` (list<uint8>, 1 = training target),
`seq_offsets` (list<int32>, `[0, end_1, ..., len]`), `example_ids` (list<string>), `num_tokens` (int32),
`num_targets` (int32, the targets the loss sees), `pair_ids` (list<string>), `sides` (list<uint8>, 0 chosen,
1 rejected) and `completion_spans` (list<int32>, `[start, stop)` per sequence), empty in rows without
pairs; and `desirable` (list<int8>, KTO labels: 1, 0, -1 for none per sequence), empty in rows without labels.{_cuts_column(manifest)}{_vision_columns(manifest)}

Load it with `datasets.load_dataset("<this folder>")`, or zero-copy with
`packers.PackedDataset("<this folder>")`, and collate with `packers.Collator()`.
`manifest.json` holds the full configuration and every count.
"""
    return header + body
