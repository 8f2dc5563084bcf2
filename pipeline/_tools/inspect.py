"""``packstream inspect DIR``: what a finished output holds, computed from its shards.

Like every reader of the output-folder contract (:mod:`packers.manifest`), inspect trusts only a
complete ``manifest.json`` and opens exactly the shards it lists, in both splits; shard-like
files it does not list are named in ``warnings`` and never read. From each shard it reads four
columns (``num_tokens``, ``seq_offsets``, ``loss_mask`` and ``example_ids``; never the token ids)
and computes rows, sequences, examples, tokens, targets, fill and the length percentiles,
in total (``train`` and ``validation`` together) and per split (``splits``). What the shards
cannot tell (records read, not sampled, rejected by reason, dropped for length, truncated,
split) comes from the manifest's counts and is counted exactly as ``pack``'s summary counts it:
``rejected`` never includes the examples dropped for length. ``consistent`` says whether the
shards agree with the manifest. A run of preference pairs (``--pairs``) also gets ``pairs``: the
pairs packed, pairs per row, and the length difference between a pair's two sides. Three PNGs,
drawn with matplotlib's Agg backend (no display)::

    example_lengths.png    tokens per packed sequence (a piece of a split example counts
                           as one), log-scaled counts, the budget as a dashed line
    row_fill.png           num_tokens / budget per row
    examples_per_row.png   sequences per row

:func:`inspect` returns the report as a JSON-ready dict whose keys and types are fixed
(:data:`REPORT_KEYS`, ``schema_version``); ``packstream inspect --json`` prints it.
"""

from __future__ import annotations

import math
import os
import posixpath
import stat
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import packers
from packers import ContractError, PackstreamError
from packers.files import check_regular, load_json, read_checked, show_path
from packers.manifest import (
    LOCK, MANIFEST, SPLITS, TMP_PREFIX, Manifest, ShardEntry, is_datasets_cache, missing_manifest, require_complete,
)
import pipeline._write as _write
from pipeline._report import one_line

SCHEMA_VERSION = 5
PERCENTILES = (0, 10, 50, 90, 99, 100)
PLOTS = ("example_lengths", "row_fill", "examples_per_row")

REPORT_KEYS: dict[str, Any] = {
    "schema_version": int,  # bumped on any change to these keys or their meaning
    "path": str,  # the inspected folder
    "format": str,  # "arrow" or "parquet"
    "budget": int,  # tokens per row (the shards' packstream.budget metadata)
    "tokenizer": str,
    # From the shards (both splits together; "splits" has each):
    "shards": int,
    "bytes": int,  # shard bytes on disk
    "rows": int,
    "examples": int,  # sequences in the rows (a piece of a split example counts as one)
    "examples_packed": int,  # distinct examples (the pieces of a split example count once)
    "tokens": int,
    "target_tokens": int,  # tokens with loss_mask 1
    "fill": float,  # tokens / (rows * budget)
    "lower_bound": int,  # ceil(tokens / budget): no packing of these tokens has fewer rows
    "rows_over_lower_bound": float,  # rows / lower_bound - 1; 0.0 is optimal
    "examples_per_row": dict,  # {"mean": float, "min": int, "max": int}
    "example_length": dict,  # {"mean": float, "p0": int, "p10": .., "p50", "p90", "p99", "p100": int}
    "row_tokens": dict,  # same keys as example_length, over rows
    "splits": dict,  # split -> {"shards", "bytes", "rows", "examples", "examples_packed", "tokens",
    #                             "target_tokens": int, "fill": float}; only splits the manifest lists
    # From manifest.json's counts, as pack's summary counts them:
    "records_read": int,
    "not_sampled": int,  # records of data sets with weight < 1 left out by sampling
    "repeated_copies": int,  # extra copies of records of data sets with weight > 1
    "extra_paths": int,  # examples beyond a record's first (--tree-paths all: one per root-to-leaf path)
    "rejected": int,  # dead-lettered records, NOT counting those dropped for length
    "rejected_by_reason": dict,  # reason -> records (too_long never here)
    "dropped_too_long": int,  # examples longer than the budget dropped by --long drop
    "truncated_examples": int,
    "split_examples": int,
    "consistent": bool,  # the shards agree with manifest.json (rows, tokens, targets, sequences, examples)
    "warnings": list,  # where they disagree, and shard-like files the manifest does not list
    "plots": dict,  # plot name -> PNG path; {} with --no-plots
    # A run of preference pairs (--pairs); {} otherwise:
    "pairs": dict,  # {"pairs": int, "pairs_per_row": {"mean", "min", "max"}, "side_difference": {"mean", "p0", ...}
    #                  (|chosen - rejected| tokens per pair), "chosen_longer": float (fraction of pairs)}
    # A run with images (--processor); {} otherwise:
    "vision": dict,  # {"processor": str, "images": int, "image_tokens": int (placeholder tokens, in "tokens"),
    #                   "image_token_share": float (of tokens), "rows_with_images": int,
    #                   "images_per_row": {"mean", "min", "max"}, "tokens_per_image": {"mean", "p0", ..., "p100"},
    #                   "embedded_images": int (carried as bytes; the rest by path),
    #                   "videos": {} without videos (--video-fps), else {"videos": int, "video_tokens": int,
    #                   "video_token_share": float, "rows_with_videos": int, "frames": int (sampled frames),
    #                   "tokens_per_video": {"mean", "p0", ...}, "frames_per_video": {"mean", "p0", ...},
    #                   "embedded_videos": int}}
}
_SPLIT_KEYS = ("shards", "bytes", "rows", "examples", "examples_packed", "tokens", "target_tokens", "fill")


def load_manifest(folder: str) -> tuple[Manifest, list[str]]:
    """The complete, checked manifest of ``folder`` and the folder's file names; PackstreamError if there is
    none, or it cannot be trusted (see :mod:`packers.manifest`)."""
    try:
        names = _write.list_folder(folder)
    except (OSError, ValueError) as e:
        raise PackstreamError(f"{show_path(folder)} cannot be listed ({e}); pass the --output folder of packstream "
                              "pack") from None
    if MANIFEST not in names:
        raise missing_manifest(folder, names)
    return require_complete(_write.read_manifest(folder), folder), names


class _Shard:
    """What inspect reads of one shard: per-row tokens and sequences, sequence lengths, targets, examples."""

    def __init__(self, folder: str, entry: ShardEntry, vision: str = ""):
        name = entry.name
        path = _write.join(folder, name)
        if "://" not in path:
            self.bytes = check_regular(path, "shard").st_size  # a FIFO or a device is refused, never mapped
            source: Any = pa.memory_map(path)  # zero-copy: only the columns read are touched
        else:
            data = _write.read_bytes(path, what="shard", limit=entry.bytes,
                                     fix="larger than manifest.json says: run packstream verify on the folder")
            source, self.bytes = pa.BufferReader(data), len(data)
        columns = ["num_tokens", "seq_offsets", "loss_mask", "example_ids"]
        if vision:  # the run wrote image columns (its manifest's contract version), and video columns (version 5)
            columns += ["image_grid_thw", "images"] + (["video_grid_thw", "videos"] if vision == "videos" else [])
        try:
            if name.endswith(".parquet"):
                import pyarrow.parquet as pq

                pf = pq.ParquetFile(source)
                self.schema, table = pf.schema_arrow, pf.read(columns=columns)
            else:
                reader = pa.ipc.open_stream(source)
                self.schema, table = reader.schema, reader.read_all().select(columns)
            expected = (packers.VIDEO_SCHEMA if "videos" in self.schema.names else
                        packers.VISION_SCHEMA if "images" in self.schema.names else
                        packers.SCHEMA if "cuts" in self.schema.names else packers.SCHEMA_V6)
            if not self.schema.remove_metadata().equals(expected):
                raise PackstreamError(f"{show_path(path)}: its schema is not the packed-row contract's; run packstream "
                                      "verify on the folder")
        except (pa.ArrowException, OSError, KeyError) as e:
            raise PackstreamError(f"{show_path(path)} cannot be read ({one_line(str(e), 200)}); run packstream verify on the "
                                  "folder") from None
        self.name, self.split = name, entry.split
        self.num_tokens = table.column("num_tokens").to_numpy().astype(np.int64)
        offsets = table.column("seq_offsets").combine_chunks()
        starts = offsets.offsets.to_numpy().astype(np.int64)
        starts -= starts[0]
        values = offsets.flatten().to_numpy().astype(np.int64)
        self.per_row = np.diff(starts) - 1
        diffs = np.diff(values)
        keep = np.ones(len(diffs), dtype=bool)
        keep[starts[1:-1] - 1] = False  # the step from one row's last offset to the next row's 0
        self.lengths = diffs[keep] if len(values) else diffs
        self.target_tokens = int(pc.sum(table.column("loss_mask").combine_chunks().flatten()).as_py() or 0)
        ids = table.column("example_ids").combine_chunks().flatten()
        # '#' in an id is always a piece marker (sources and ids escape it as %23, see pipeline._rows).
        piece = pc.match_substring(ids, "#")
        self.whole = int(len(ids) - (pc.sum(piece).as_py() or 0))
        # A pair's sides (#chosen, #rejected) are its pieces: one example, the pair.
        self.piece_bases = pc.replace_substring_regex(ids.filter(piece), r"#(\d+|chosen|rejected)$", "")
        self.grids, self.images_per_row, self.embedded = self._media(table, "image")
        self.video_grids, self.videos_per_row, self.embedded_videos = self._media(table, "video")

    def _media(self, table: pa.Table, kind: str) -> tuple[np.ndarray, np.ndarray, int]:
        """A kind's (``image`` or ``video``) grids ``(n, 3)``, count per row, and how many are embedded."""
        if f"{kind}s" not in table.column_names:
            return np.zeros((0, 3), np.int64), np.zeros(len(self.num_tokens), np.int64), 0
        grids = table.column(f"{kind}_grid_thw").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        media = table.column(f"{kind}s").combine_chunks()
        return (grids.astype(np.int64).reshape(-1, 3),
                pc.list_value_length(media).to_numpy(zero_copy_only=False).astype(np.int64),
                int(pc.sum(pc.is_valid(media.flatten().field("bytes"))).as_py() or 0))


def _percentiles(x: np.ndarray) -> dict[str, Any]:
    """The mean and the nearest-rank percentiles (each a value of ``x``: the smallest whose share of values at or
    below it reaches p%), which read right on a handful of values too.

    >>> _percentiles(np.array([33, 35]))
    {'mean': 34.0, 'p0': 33, 'p10': 33, 'p50': 33, 'p90': 35, 'p99': 35, 'p100': 35}
    """
    if not len(x):
        return {"mean": 0.0, **{f"p{p}": 0 for p in PERCENTILES}}
    q = np.percentile(x, PERCENTILES, method="inverted_cdf")
    return {"mean": float(x.mean()), **{f"p{p}": int(v) for p, v in zip(PERCENTILES, q)}}


def _totals(shards: list[_Shard], budget: int) -> dict[str, Any]:
    rows = sum(len(s.num_tokens) for s in shards)
    tokens = sum(int(s.num_tokens.sum()) for s in shards)
    bases = pa.chunked_array([s.piece_bases for s in shards], pa.string())
    return {
        "shards": len(shards),
        "bytes": sum(s.bytes for s in shards),
        "rows": rows,
        "examples": sum(len(s.lengths) for s in shards),
        "examples_packed": sum(s.whole for s in shards) + (pc.count_distinct(bases).as_py() if len(bases) else 0),
        "tokens": tokens,
        "target_tokens": sum(s.target_tokens for s in shards),
        "fill": tokens / (rows * budget) if rows else 0.0,
    }


def _disagreements(m: Manifest, shards: list[_Shard], totals: dict, splits: dict) -> list[str]:
    """Where the shards and manifest.json disagree (packstream verify checks everything; this is the cheap part)."""
    out = []
    c = m.counts
    for key, got in (("rows", totals["rows"]), ("tokens", totals["tokens"]), ("target_tokens", totals["target_tokens"]),
                     ("pieces", totals["examples"]), ("examples_packed", totals["examples_packed"])):
        if getattr(c, key) != got:
            out.append(f"manifest.json counts.{key} is {getattr(c, key)!r}, the shards hold {got}")
    for split, want in c.splits.items():
        for key in ("rows", "tokens"):
            got = splits.get(split, {}).get(key, 0)
            if getattr(want, key) != got:
                out.append(f"manifest.json counts.splits.{split}.{key} is {getattr(want, key)!r}, the shards hold {got}")
    entries = {e.name: e for e in m.shards}
    for s in shards:
        e = entries[s.name]
        for key, got in (("rows", len(s.num_tokens)), ("bytes", s.bytes)):
            if getattr(e, key) != got:
                out.append(f"{s.name}: manifest.json says {key} {getattr(e, key)!r}, the file has {got}")
    return out


def inspect(folder: str, plots_dir: Optional[str] = None) -> dict[str, Any]:
    """The report of one finished output folder; writes the PNGs into ``plots_dir`` when given.

    Raises PackstreamError for a folder that is not a finished packstream output (no manifest,
    a failed run, a listed shard that cannot be read)."""
    folder = folder.rstrip("/") or "/"
    if "://" not in folder and not os.path.isdir(folder):
        raise PackstreamError(f"{show_path(folder)} is not a folder; pass the --output folder of packstream pack")
    if plots_dir is not None:
        _check_plots_dir(plots_dir)  # before the work: a folder inspect may not write into fails at once
    try:
        m, names = load_manifest(folder)
        entries = m.listed()
        if not entries:
            raise PackstreamError(f"{show_path(folder)}: manifest.json lists no shards; the run packed nothing")
        version = m.raw.get("contract_version")
        vision = ("videos" if version == packers.VIDEO_CONTRACT_VERSION else
                  "images" if version == packers.VISION_CONTRACT_VERSION else "")
        shards = [_Shard(folder, e, vision) for e in entries]
        meta = packers.read_metadata(shards[0].schema)
    except ContractError as e:
        raise PackstreamError(str(e)) from None
    budget = m.row_checks.budget
    if meta.get("budget") != budget:
        raise PackstreamError(f"{show_path(folder)}/{shards[0].name}: schema metadata budget is {meta.get('budget')!r:.40}, "
                              f"{MANIFEST} says {budget}; run packstream verify on the folder")
    totals = _totals(shards, budget)
    splits = {sp: _totals([s for s in shards if s.split == sp], budget) for sp in SPLITS
              if any(s.split == sp for s in shards)}
    num_tokens = np.concatenate([s.num_tokens for s in shards])
    per_row = np.concatenate([s.per_row for s in shards])
    lengths = np.concatenate([s.lengths for s in shards])
    rows, tokens = totals["rows"], totals["tokens"]
    lower = math.ceil(tokens / budget) if tokens else 0
    warnings = _disagreements(m, shards, totals, splits)
    warnings += [f"{show_path(n)}: a shard-like file manifest.json does not list (a stray file or another run's shard); "
                 "not read" for n in m.unlisted(names) if not is_datasets_cache(n)]
    warnings += [f"{show_path(n)}: left by an interrupted run; packstream pack --overwrite removes it"
                 for n in names if n.startswith(TMP_PREFIX) or n == LOCK]
    c = m.counts
    report = {
        "schema_version": SCHEMA_VERSION,
        "path": folder,
        "format": "parquet" if shards[0].name.endswith(".parquet") else "arrow",
        "budget": budget,
        "tokenizer": m.tokenizer.name,
        **totals,
        "lower_bound": lower,
        "rows_over_lower_bound": rows / lower - 1 if lower else 0.0,
        "examples_per_row": {
            "mean": float(per_row.mean()) if rows else 0.0,
            "min": int(per_row.min()) if rows else 0,
            "max": int(per_row.max()) if rows else 0,
        },
        "example_length": _percentiles(lengths),
        "row_tokens": _percentiles(num_tokens),
        "splits": splits,
        "records_read": c.records_read,
        "not_sampled": c.not_sampled,
        "repeated_copies": c.repeated_copies,
        "extra_paths": c.extra_paths,
        "rejected": c.rejected,
        "rejected_by_reason": dict(sorted(c.rejected_by_reason.items())),
        "dropped_too_long": c.dropped_too_long,
        "truncated_examples": c.truncated_examples,
        "split_examples": c.split_examples,
        "consistent": not warnings,
        "warnings": warnings,
        "plots": {},
        "pairs": _pairs(lengths, per_row) if m.row_checks.pairs else {},
        "vision": _vision(meta, shards, tokens),
    }
    if plots_dir is not None:
        report["plots"] = write_plots(plots_dir, lengths, num_tokens, per_row, budget)
    return report


def _pairs(lengths: np.ndarray, per_row: np.ndarray) -> dict[str, Any]:
    """What a run of pairs holds: every row is whole pairs, each chosen side followed by its rejected side."""
    chosen, rejected = lengths[0::2], lengths[1::2]
    pairs_per_row = per_row // 2
    rows = len(per_row)
    return {
        "pairs": int(len(chosen)),
        "pairs_per_row": {"mean": float(pairs_per_row.mean()) if rows else 0.0,
                          "min": int(pairs_per_row.min()) if rows else 0, "max": int(pairs_per_row.max()) if rows else 0},
        "side_difference": _percentiles(np.abs(chosen - rejected)),
        "chosen_longer": float((chosen > rejected).mean()) if len(chosen) else 0.0,
    }


def _vision(meta: dict[str, Any], shards: list[_Shard], tokens: int) -> dict[str, Any]:
    """What a run with images holds: images, their placeholder tokens, how they spread over rows; and its videos."""
    if "vision" not in meta:
        return {}
    spec = packers.VisionSpec.from_json(meta["vision"], what="the shards' vision spec (schema metadata)")
    grids = np.concatenate([s.grids for s in shards])
    per_image = np.array([spec.grid_tokens(g) for g in grids], dtype=np.int64)
    per_row = np.concatenate([s.images_per_row for s in shards])
    image_tokens = int(per_image.sum())
    return {
        "processor": spec.name or spec.family.value,
        "images": int(len(grids)),
        "image_tokens": image_tokens,
        "image_token_share": image_tokens / tokens if tokens else 0.0,
        "rows_with_images": int((per_row > 0).sum()),
        "images_per_row": {"mean": float(per_row.mean()) if len(per_row) else 0.0,
                           "min": int(per_row.min()) if len(per_row) else 0,
                           "max": int(per_row.max()) if len(per_row) else 0},
        "tokens_per_image": _percentiles(per_image),
        "embedded_images": sum(s.embedded for s in shards),
        "videos": _videos(spec, shards, tokens) if spec.videos else {},
    }


PLOTS_MARK = ".packstream-inspect.json"
"""The file that marks a plots folder as inspect's, with the sha256 of each PNG it wrote there."""


def _videos(spec: packers.VisionSpec, shards: list[_Shard], tokens: int) -> dict[str, Any]:
    """What a run with videos (``--video-fps``) holds: videos, their placeholder tokens and sampled frames (a grid's
    ``t`` temporal patches of ``temporal_patch_size`` frames), how they spread over rows."""
    grids = np.concatenate([s.video_grids for s in shards])
    per_video = np.array([spec.grid_tokens(g) for g in grids], dtype=np.int64)
    frames = grids[:, 0] * spec.temporal_patch_size
    per_row = np.concatenate([s.videos_per_row for s in shards])
    video_tokens = int(per_video.sum())
    return {
        "videos": int(len(grids)),
        "video_tokens": video_tokens,
        "video_token_share": video_tokens / tokens if tokens else 0.0,
        "rows_with_videos": int((per_row > 0).sum()),
        "frames": int(frames.sum()),
        "tokens_per_video": _percentiles(per_video),
        "frames_per_video": _percentiles(frames),
        "embedded_videos": sum(s.embedded_videos for s in shards),
    }


def _plot_files(out: str) -> dict[str, str]:
    """The PNGs inspect wrote into ``out`` (name -> sha256, from its mark); {} for a new or empty folder.

    inspect writes only into a folder of its own: one it creates (and marks), or an empty one. A path
    that exists and is not a folder, a folder holding files it did not write, a PNG changed since it
    wrote it (or replaced by a user's file of that name, or a link) is refused, never overwritten."""
    fix = "pass --plots-dir a new or empty folder, or --no-plots"
    try:
        st = os.stat(out)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise PackstreamError(f"--plots-dir {show_path(out)} cannot be used: {e.strerror or e}; {fix}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise PackstreamError(f"--plots-dir {show_path(out)} exists and is not a folder (inspect writes its PNGs into "
                              f"a folder of its own); {fix}")
    names = sorted(os.listdir(out))
    if PLOTS_MARK not in names:
        if names:
            raise PackstreamError(f"--plots-dir {show_path(out)} holds files inspect did not write ({len(names)}, e.g. "
                                  f"{show_path(names[0])}); inspect never overwrites them: {fix}")
        return {}
    try:
        mark = load_json(read_checked(os.path.join(out, PLOTS_MARK), what=PLOTS_MARK, limit=1 << 16), what=PLOTS_MARK)
        plots = mark["plots"]
        if not isinstance(plots, dict) or not all(isinstance(v, str) for v in plots.values()):
            raise TypeError
    except (PackstreamError, KeyError, TypeError):
        raise PackstreamError(f"--plots-dir {show_path(out)}: {PLOTS_MARK} is not the mark inspect writes; {fix}") from None
    for name in PLOTS:
        path = os.path.join(out, f"{name}.png")
        if not os.path.lexists(path):
            continue
        st = os.lstat(path)
        mine = stat.S_ISREG(st.st_mode) and plots.get(f"{name}.png") == _file_sha256(path)
        if not mine:
            raise PackstreamError(f"{show_path(path)} is not the plot inspect wrote there (changed since, or another "
                                  f"file of that name); inspect never overwrites it: move it away, or {fix}")
    return dict(plots)


def _check_plots_dir(out: str) -> None:
    _plot_files(out)


def _file_sha256(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_plots(out: str, lengths: np.ndarray, num_tokens: np.ndarray, per_row: np.ndarray, budget: int) -> dict[str, str]:
    """Draw the three PNGs into the local folder ``out``, which inspect owns (see :func:`_plot_files`: created
    and marked here, or marked earlier by inspect); returns name -> path."""
    import json
    import uuid

    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    written = _plot_files(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise PackstreamError(f"--plots-dir {show_path(out)} cannot be created: {e.strerror or e}") from None
    paths = {}

    def mark() -> None:
        tmp = os.path.join(out, f".tmp-{PLOTS_MARK}.{uuid.uuid4().hex}")
        with open(tmp, "w") as f:
            json.dump({"written_by": "packstream inspect", "plots": written}, f, indent=2, sort_keys=True)
        os.replace(tmp, os.path.join(out, PLOTS_MARK))

    mark()  # the folder is inspect's before any PNG is in it

    def save(fig, name: str) -> None:
        path = os.path.join(out, f"{name}.png")
        tmp = os.path.join(out, f".tmp-{name}.{uuid.uuid4().hex}.png")
        fig.tight_layout()
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        written[f"{name}.png"] = _file_sha256(tmp)
        mark()
        os.replace(tmp, path)  # replaces a name, never writes through a link
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
    """The report as a two-column table, counted like ``pack``'s summary."""
    from pipeline._report import table
    from pipeline._tools.estimate import human_bytes

    el, rt, epr = r["example_length"], r["row_tokens"], r["examples_per_row"]
    pct = lambda d: "  ".join(f"p{p} {d[f'p{p}']:,}" for p in PERCENTILES)  # noqa: E731
    lines = [
        ("folder", f"{r['path']}  ({r['shards']} {r['format']} shard(s), {human_bytes(r['bytes'])})"),
        ("budget", f"{r['budget']:,} tokens per row  ({r['tokenizer']})"),
        ("records read", f"{r['records_read']:,}"),
    ]
    if r["not_sampled"]:
        lines.append(("not sampled (weight < 1)", f"{r['not_sampled']:,}"))
    if r["repeated_copies"]:
        lines.append(("repeated copies (weight > 1)", f"{r['repeated_copies']:,}"))
    if r["extra_paths"]:
        lines.append(("more message-tree paths", f"{r['extra_paths']:,}"))
    lines += [
        ("examples packed", f"{r['examples_packed']:,}"),
        ("rejected", f"{r['rejected']:,}"),
        *[(f"  {k}", f"{v:,}") for k, v in r["rejected_by_reason"].items()],
        (f"dropped (> {r['budget']} tokens)", f"{r['dropped_too_long']:,}"),
        ("truncated / split examples", f"{r['truncated_examples']:,} / {r['split_examples']:,}"),
        ("rows", f"{r['rows']:,}  (lower bound {r['lower_bound']:,}, +{r['rows_over_lower_bound']:.2%})"),
    ]
    if len(r["splits"]) > 1:
        lines += [(f"  {name}", f"{s['rows']:,} rows, {s['examples_packed']:,} examples, {s['tokens']:,} tokens, "
                                f"fill {s['fill']:.3%}") for name, s in r["splits"].items()]
    lines += [
        ("sequences", f"{r['examples']:,}"),
        ("tokens", f"{r['tokens']:,}  ({r['target_tokens']:,} targets)"),
        ("fill", f"{r['fill']:.3%}"),
        ("examples per row", f"mean {epr['mean']:.2f}  min {epr['min']}  max {epr['max']}"),
        ("example length", f"mean {el['mean']:,.0f}  " + pct(el)),
        ("row tokens", f"mean {rt['mean']:,.0f}  " + pct(rt)),
    ]
    if r["pairs"]:
        p, ppr, sd = r["pairs"], r["pairs"]["pairs_per_row"], r["pairs"]["side_difference"]
        lines += [
            ("pairs", f"{p['pairs']:,}  (chosen side longer in {p['chosen_longer']:.1%})"),
            ("pairs per row", f"mean {ppr['mean']:.2f}  min {ppr['min']}  max {ppr['max']}"),
            ("side difference", f"mean {sd['mean']:,.0f}  " + pct(sd) + "  (|chosen - rejected| tokens)"),
        ]
    if r["vision"]:
        v, ipr, tpi = r["vision"], r["vision"]["images_per_row"], r["vision"]["tokens_per_image"]
        lines += [
            ("images", f"{v['images']:,} in {v['rows_with_images']:,} rows  ({v['image_tokens']:,} placeholder tokens, "
                       f"{v['image_token_share']:.1%} of the tokens; {v['embedded_images']:,} embedded; "
                       f"{v['processor']})"),
            ("images per row", f"mean {ipr['mean']:.2f}  min {ipr['min']}  max {ipr['max']}"),
            ("tokens per image", f"mean {tpi['mean']:,.0f}  " + pct(tpi)),
        ]
        if v["videos"]:
            w, tpv, fpv = v["videos"], v["videos"]["tokens_per_video"], v["videos"]["frames_per_video"]
            lines += [
                ("videos", f"{w['videos']:,} in {w['rows_with_videos']:,} rows  ({w['video_tokens']:,} placeholder "
                           f"tokens, {w['video_token_share']:.1%} of the tokens; {w['frames']:,} sampled frames; "
                           f"{w['embedded_videos']:,} embedded)"),
                ("tokens per video", f"mean {tpv['mean']:,.0f}  " + pct(tpv)),
                ("frames per video", f"mean {fpv['mean']:,.1f}  " + pct(fpv)),
            ]
    lines += [("WARNING", w) for w in r["warnings"]]
    lines += [(f"plot {k}", v) for k, v in r["plots"].items()]
    return table(lines)
