"""Writers: packed rows -> Arrow (or Parquet) shards, the dead-letter file, manifest and card.

Every file appears atomically: it is written under a temporary name in the output folder and
renamed into place, so a reader never sees a partial shard and a retried or re-run writer
produces the same bytes under the same name. Shard contents are deterministic: rows sorted by
their seeded shuffle key, one fixed schema (:data:`packers.SCHEMA`) with fixed metadata.
"""

from __future__ import annotations

import io
import hashlib
import json
import posixpath
import uuid
from typing import Any, Iterable, Sequence

import pyarrow as pa

import packers

OWN_FILES = ("train-", "rejected", "manifest.json", "README.md", ".tmp-")


def shard_name(index: int, count: int, ext: str) -> str:
    return f"train-{index:05d}-of-{count:05d}.{ext}"


def join(folder: str, name: str) -> str:
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.join(folder, name) if "://" in folder else posixpath.join(folder, name)


def read_bytes(path: str) -> bytes:
    """A whole file's bytes, local or remote (no decompression)."""
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path, compression_type="uncompressed") as f:
        return f.read()


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and a rename."""
    from apache_beam.io.filesystems import FileSystems

    folder, name = posixpath.split(path) if "://" not in path else path.rsplit("/", 1)
    tmp = join(folder, f".tmp-{name}.{uuid.uuid4().hex}")
    try:
        with FileSystems.create(tmp) as f:
            f.write(data)
        if "://" not in path:
            import os

            os.replace(tmp, path)  # atomic on POSIX
        else:
            if FileSystems.exists(path):
                FileSystems.delete([path])
            FileSystems.rename([tmp], [path])
    except BaseException:
        # A failed attempt leaves no temp file behind (the retry writes its own); only a hard kill
        # can, and prepare_output removes those on the next --overwrite run.
        try:
            if FileSystems.exists(tmp):
                FileSystems.delete([tmp])
        except OSError:  # best effort (BeamIOError is an OSError); the original error matters more
            pass
        raise


def rows_table(rows: Sequence[dict], schema: pa.Schema) -> pa.Table:
    """Rows (dicts of numpy arrays) -> a table with exactly ``schema``; never inferred."""
    import numpy as np

    def lists(key: str, typ: pa.DataType) -> pa.Array:
        values = [r[key] for r in rows]
        offsets = np.zeros(len(values) + 1, dtype=np.int32)
        if values:
            np.cumsum([len(v) for v in values], out=offsets[1:])
        flat = np.concatenate(values) if values else np.zeros(0)
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(flat, typ))

    ex_ids = pa.array([r["example_ids"] for r in rows], pa.list_(pa.string()))
    cols = [
        lists("input_ids", pa.int32()),
        lists("loss_mask", pa.uint8()),
        lists("seq_offsets", pa.int32()),
        ex_ids,
        pa.array([r["num_tokens"] for r in rows], pa.int32()),
    ]
    return pa.Table.from_arrays(cols, schema=schema)


def encode_shard(table: pa.Table, output_format: str) -> bytes:
    sink = io.BytesIO()
    if output_format == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, sink, compression="zstd")
    else:
        # Uncompressed IPC *stream*: what datasets memory-maps zero-copy (Dataset.from_file).
        with pa.ipc.new_stream(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=1000):
                w.write_batch(batch)
    return sink.getvalue()


def write_shard(folder: str, index: int, count: int, rows: list[dict], schema: pa.Schema, output_format: str) -> dict:
    """Sort one shard's rows by shuffle key, write it atomically, and describe it."""
    rows = sorted(rows, key=lambda r: r["key"])
    data = encode_shard(rows_table(rows, schema), output_format)
    name = shard_name(index, count, "parquet" if output_format == "parquet" else "arrow")
    write_atomic(join(folder, name), data)
    return {
        "name": name,
        "rows": len(rows),
        "examples": sum(len(r["example_ids"]) for r in rows),
        "tokens": sum(r["num_tokens"] for r in rows),
        "target_tokens": sum(r["target_tokens"] for r in rows),
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def write_rejected(folder: str, records: Iterable[dict]) -> dict[str, int]:
    """All dead letters, sorted by (source, position), one JSON object per line."""
    recs = sorted(records, key=lambda r: (r["source"], r["position"], r["reason"], r.get("example_id", "")))
    body = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in recs)
    write_atomic(join(folder, "rejected.jsonl"), body.encode())
    counts: dict[str, int] = {}
    for r in recs:
        counts[r["reason"]] = counts.get(r["reason"], 0) + 1
    return dict(sorted(counts.items()))


def _yaml_features(schema: pa.Schema) -> str:
    """The ``features:`` list of a datasets card for ``schema`` (what ``datasets.Features`` writes)."""
    lines = []
    for field in schema:
        if pa.types.is_list(field.type):
            lines += [f"  - name: {field.name}", f"    list: {field.type.value_type}"]
        else:
            lines += [f"  - name: {field.name}", f"    dtype: {field.type}"]
    return "\n".join(lines)


def _size_category(rows: int) -> str:
    """The Hub's ``size_categories`` tag for ``rows`` rows."""
    bounds = ["1K", "10K", "100K", "1M", "10M", "100M", "1B", "10B", "100B", "1T"]
    for i, b in enumerate(bounds):
        if rows < 10 ** (3 + i):
            return f"n<{b}" if i == 0 else f"{bounds[i - 1]}<n<{b}"
    return "n>1T"


def dataset_card(manifest: dict[str, Any]) -> str:
    """The output folder's README.md, with the YAML header that datasets and the Hub read."""
    c = manifest["counts"]
    ext = "parquet" if manifest["config"]["output_format"] == "parquet" else "arrow"
    total_bytes = sum(s["bytes"] for s in manifest["shards"])
    header = f"""---
configs:
- config_name: default
  data_files:
  - split: train
    path: "train-*.{ext}"
dataset_info:
  features:
{_yaml_features(packers.SCHEMA)}
  splits:
  - name: train
    num_bytes: {total_bytes}
    num_examples: {c['rows']}
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
    body = f"""
# Packed SFT data (packstream)

Rows of at most **{manifest['config']['max_tokens']}** tokens, each holding several tokenized
examples back to back (packed-row contract v{manifest['contract_version']}; no padding stored).

| | |
|---|---|
| rows | {c['rows']:,} |
| packed examples | {c['examples_packed']:,} |
| tokens | {c['tokens']:,} |
| fill | {c['fill']:.4%} |
| rows vs lower bound | {c['rows']:,} vs {c['lower_bound']:,} |
| records read | {c['records_read']:,} |
| rejected | {c['rejected']:,} (see `rejected.jsonl`) |
| tokenizer | `{t['name']}` (vocab sha256 `{t['vocab_sha256'][:16]}…`) |

Columns: `input_ids` (list<int32>), `loss_mask` (list<uint8>, 1 = training target),
`seq_offsets` (list<int32>, `[0, end_1, ..., len]`), `example_ids` (list<string>), `num_tokens` (int32).

Load it with `datasets.load_dataset("<this folder>")`, or zero-copy with
`packers.PackedDataset("<this folder>")`, and collate with `packers.Collator()`.
`manifest.json` holds the full configuration and every count.
"""
    return header + body
