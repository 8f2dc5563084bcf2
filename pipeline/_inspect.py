"""``packstream inspect DIR``: what a packed output holds, from its shards and manifest.

Reads only two cheap columns of every shard (``num_tokens`` and ``seq_offsets``; the token
lists are never decoded) plus ``manifest.json`` for what left the main path, and draws three
PNGs with matplotlib's Agg backend (no display needed)::

    example_lengths.png    tokens per packed sequence (a piece of a split example counts
                           as one), log-scaled counts, the budget as a dashed line
    row_fill.png           num_tokens / budget per row
    examples_per_row.png   sequences per row

:func:`inspect` returns the report as a JSON-ready dict whose keys and types are fixed
(:data:`REPORT_KEYS`, ``schema_version``); ``packstream inspect --json`` prints it.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
from typing import Any, Optional

import numpy as np
import pyarrow as pa

import packers
from packers import PackstreamError
from pipeline import _write

SCHEMA_VERSION = 1
PERCENTILES = (0, 10, 50, 90, 99, 100)
PLOTS = ("example_lengths", "row_fill", "examples_per_row")

REPORT_KEYS: dict[str, Any] = {
    "schema_version": int,  # bumped on any change to these keys or their meaning
    "path": str,  # the inspected folder
    "format": str,  # "arrow" or "parquet"
    "budget": int,  # tokens per row (the shards' packstream.budget metadata)
    "tokenizer": str,
    "shards": int,
    "bytes": int,  # shard bytes on disk
    "rows": int,
    "examples": int,  # sequences in the rows (a piece of a split example counts as one)
    "tokens": int,
    "target_tokens": (int, type(None)),  # from manifest.json; None without it
    "fill": float,  # tokens / (rows * budget)
    "lower_bound": int,  # ceil(tokens / budget): no packing of these tokens has fewer rows
    "rows_over_lower_bound": float,  # rows / lower_bound - 1; 0.0 is optimal
    "examples_per_row": dict,  # {"mean": float, "min": int, "max": int}
    "example_length": dict,  # {"mean": float, "p0": int, "p10": .., "p50", "p90", "p99", "p100": int}
    "row_tokens": dict,  # same keys as example_length, over rows
    "records_read": (int, type(None)),  # from manifest.json
    "rejected": dict,  # reason -> records, too_long included; from manifest.json ({} without it)
    "rejected_total": int,
    "manifest": bool,  # whether manifest.json was found
    "consistent": (bool, type(None)),  # shards agree with manifest.json's rows and tokens (None without it)
    "plots": dict,  # plot name -> PNG path; {} with --no-plots
}


def _fs():
    from apache_beam.io.filesystems import FileSystems

    return FileSystems


def _shards(folder: str) -> list[str]:
    if "://" in folder:
        found = _fs().match([_write.join(folder, "train-*")])[0].metadata_list
        paths = [m.path for m in found]
    else:
        paths = [os.path.join(folder, n) for n in os.listdir(folder) if n.startswith("train-")]
    return sorted(p for p in paths if p.endswith((".arrow", ".parquet")))


def _read_columns(path: str) -> tuple[pa.Schema, np.ndarray, np.ndarray, np.ndarray, int]:
    """(schema, num_tokens per row, sequences per row, sequence lengths, bytes) of one shard."""
    if "://" not in path:
        source: Any = pa.memory_map(path)
        size = os.path.getsize(path)
    else:
        data = _write.read_bytes(path)
        source, size = pa.BufferReader(data), len(data)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(source)
        schema = pf.schema_arrow
        table = pf.read(columns=["num_tokens", "seq_offsets"])
    else:
        reader = pa.ipc.open_stream(source)
        schema = reader.schema
        table = reader.read_all().select(["num_tokens", "seq_offsets"])
    num_tokens = table.column("num_tokens").to_numpy().astype(np.int64)
    offsets = table.column("seq_offsets").combine_chunks()
    starts = offsets.offsets.to_numpy().astype(np.int64)
    starts -= starts[0]
    values = offsets.flatten().to_numpy().astype(np.int64)
    per_row = np.diff(starts) - 1
    diffs = np.diff(values)
    keep = np.ones(len(diffs), dtype=bool)
    keep[starts[1:-1] - 1] = False  # the step from one row's last offset to the next row's 0
    return schema, num_tokens, per_row, diffs[keep] if len(values) else diffs, size


def _percentiles(x: np.ndarray) -> dict[str, Any]:
    if not len(x):
        return {"mean": 0.0, **{f"p{p}": 0 for p in PERCENTILES}}
    q = np.percentile(x, PERCENTILES, method="lower")
    return {"mean": float(x.mean()), **{f"p{p}": int(v) for p, v in zip(PERCENTILES, q)}}


def _manifest(folder: str) -> Optional[dict]:
    from apache_beam.io.filesystem import BeamIOError

    path = _write.join(folder, "manifest.json")
    try:
        return json.loads(_write.read_bytes(path))
    except (OSError, BeamIOError):
        return None  # a folder of shards without a manifest: report what the shards hold


def inspect(folder: str, plots_dir: Optional[str] = None) -> dict[str, Any]:
    """The report of one output folder; writes the PNGs into ``plots_dir`` when given."""
    folder = folder.rstrip("/") or "/"
    if "://" not in folder and not os.path.isdir(folder):
        raise PackstreamError(f"{folder} is not a folder; pass the --output folder of packstream pack")
    paths = _shards(folder)
    if not paths:
        raise PackstreamError(
            f"{folder} holds no train-*.arrow or train-*.parquet shards; pass the --output folder of packstream pack"
        )
    parts = [_read_columns(p) for p in paths]
    meta = packers.read_metadata(parts[0][0])
    budget = int(meta["budget"])
    num_tokens = np.concatenate([p[1] for p in parts])
    per_row = np.concatenate([p[2] for p in parts])
    lengths = np.concatenate([p[3] for p in parts])
    rows, tokens = len(num_tokens), int(num_tokens.sum())
    lower = math.ceil(tokens / budget) if tokens else 0
    manifest = _manifest(folder)
    rejected: dict[str, int] = {}
    records_read = target_tokens = consistent = None
    if manifest is not None:
        c = manifest["counts"]
        rejected = dict(c.get("rejected_by_reason", {}))
        if c.get("dropped_too_long"):
            rejected["too_long"] = int(c["dropped_too_long"])
        rejected = dict(sorted(rejected.items()))
        records_read, target_tokens = int(c["records_read"]), int(c["target_tokens"])
        consistent = bool(c["rows"] == rows and c["tokens"] == tokens and c.get("pieces", len(lengths)) == len(lengths))
    report = {
        "schema_version": SCHEMA_VERSION,
        "path": folder,
        "format": "parquet" if paths[0].endswith(".parquet") else "arrow",
        "budget": budget,
        "tokenizer": str(meta.get("tokenizer", "")),
        "shards": len(paths),
        "bytes": int(sum(p[4] for p in parts)),
        "rows": rows,
        "examples": int(len(lengths)),
        "tokens": tokens,
        "target_tokens": target_tokens,
        "fill": tokens / (rows * budget) if rows else 0.0,
        "lower_bound": lower,
        "rows_over_lower_bound": rows / lower - 1 if lower else 0.0,
        "examples_per_row": {
            "mean": float(per_row.mean()) if rows else 0.0,
            "min": int(per_row.min()) if rows else 0,
            "max": int(per_row.max()) if rows else 0,
        },
        "example_length": _percentiles(lengths),
        "row_tokens": _percentiles(num_tokens),
        "records_read": records_read,
        "rejected": rejected,
        "rejected_total": int(sum(rejected.values())),
        "manifest": manifest is not None,
        "consistent": consistent,
        "plots": {},
    }
    if plots_dir is not None:
        report["plots"] = write_plots(plots_dir, lengths, num_tokens, per_row, budget)
    return report


def write_plots(out: str, lengths: np.ndarray, num_tokens: np.ndarray, per_row: np.ndarray, budget: int) -> dict[str, str]:
    """Draw the three PNGs into local folder ``out``; returns name -> path."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    paths = {}

    def save(fig, name: str) -> None:
        path = os.path.join(out, f"{name}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths[name] = path

    fig, ax = plt.subplots(figsize=(8, 4.5))
    top = max(budget, int(lengths.max()) if len(lengths) else 1)
    ax.hist(lengths, bins=np.linspace(0, top, 61), color="#4C72B0", edgecolor="white", linewidth=0.3)
    ax.axvline(budget, color="#C44E52", linestyle="--", linewidth=1.5, label=f"budget {budget:,}")
    ax.set_yscale("log")
    ax.set(xlabel="tokens per example", ylabel="examples (log)", title=f"Example lengths ({len(lengths):,} examples)")
    ax.legend()
    save(fig, "example_lengths")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    fill = num_tokens / budget
    # Well-packed rows pile up just below 1.0: start the axis at the emptiest row and count
    # on a log scale, so the few underfull rows stay visible next to the full ones.
    low = math.floor(min(float(fill.min()) if len(fill) else 0.0, 0.9) * 20) / 20
    ax.hist(fill, bins=np.linspace(low, 1, 51), color="#55A868", edgecolor="white", linewidth=0.3)
    ax.set_yscale("log")
    mean = float(fill.mean()) if len(fill) else 0.0
    ax.axvline(mean, color="#333333", linestyle=":", linewidth=1.2, label=f"mean {mean:.2%}")
    ax.set(xlabel="row fill (tokens / budget)", ylabel="rows (log)", title=f"Row fill ({len(num_tokens):,} rows)")
    ax.legend(loc="upper left")
    save(fig, "row_fill")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    hi = int(per_row.max()) if len(per_row) else 1
    ax.hist(per_row, bins=np.arange(0.5, hi + 1.5, max(1, math.ceil(hi / 60))), color="#8172B2",
            edgecolor="white", linewidth=0.3)
    ax.set(xlabel="examples per row", ylabel="rows", title="Examples per row")
    save(fig, "examples_per_row")
    return paths


def default_plots_dir(folder: str) -> str:
    """``<DIR>-inspect`` beside a local output; ``./<name>-inspect`` for a remote one."""
    folder = folder.rstrip("/")
    if "://" in folder:
        return f"{posixpath.basename(folder)}-inspect"
    return f"{folder}-inspect"


def format_report(r: dict[str, Any]) -> str:
    """The report as a two-column table, like ``pack``'s summary."""
    el, rt, epr = r["example_length"], r["row_tokens"], r["examples_per_row"]
    pct = lambda d: "  ".join(f"p{p} {d[f'p{p}']:,}" for p in PERCENTILES)  # noqa: E731
    lines = [
        ("folder", f"{r['path']}  ({r['shards']} {r['format']} shard(s), {r['bytes']:,} bytes)"),
        ("budget", f"{r['budget']:,} tokens per row  ({r['tokenizer']})"),
        ("rows", f"{r['rows']:,}  (lower bound {r['lower_bound']:,}, +{r['rows_over_lower_bound']:.2%})"),
        ("examples", f"{r['examples']:,}"),
        ("tokens", f"{r['tokens']:,}" + (f"  ({r['target_tokens']:,} targets)" if r["target_tokens"] is not None else "")),
        ("fill", f"{r['fill']:.3%}"),
        ("examples per row", f"mean {epr['mean']:.2f}  min {epr['min']}  max {epr['max']}"),
        ("example length", f"mean {el['mean']:,.0f}  " + pct(el)),
        ("row tokens", f"mean {rt['mean']:,.0f}  " + pct(rt)),
    ]
    if r["manifest"]:
        lines.append(("records read", f"{r['records_read']:,}"))
        lines.append(("rejected", f"{r['rejected_total']:,}"))
        lines += [(f"  {k}", f"{v:,}") for k, v in r["rejected"].items()]
        if not r["consistent"]:
            lines.append(("WARNING", "shards disagree with manifest.json (rows, tokens or examples)"))
    else:
        lines.append(("manifest", "none (manifest.json not found: no rejected counts)"))
    lines += [(f"plot {k}", v) for k, v in r["plots"].items()]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)
