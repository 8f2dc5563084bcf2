"""The manifest's counts: what the steps counted and what the shards hold, and the check that they reconcile."""

from __future__ import annotations

import math

from packers import InternalError
from pipeline._formats import FIELD_NOTES, NOTE_UNITS, Reason
from pipeline._options import PackOptions

_NOTES = tuple(NOTE_UNITS)
"""What normalization did to records that were kept (pipeline._formats), summed into counts.normalization."""


def count(o: PackOptions, stats: dict, shards: list, rejected: dict, first: dict, check: bool = True) -> dict:
    """The manifest's counts. ``check``: the shards must hold what packing made (not after a failed write)."""
    budget = o.max_tokens
    too_long = rejected.get(Reason.TOO_LONG.value, 0)
    rows = sum(s["rows"] for s in shards)
    tokens = sum(s["tokens"] for s in shards)
    notes = {k: v for k, v in stats.items()
             if k in _NOTES or k.startswith(FIELD_NOTES)}
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
    if o.processor is None:  # text rows carry cut marks (contract version 9); image rows none
        counts["cut_sequences"] = {"truncated": stats.get("cut_truncated", 0), "pieces": stats.get("cut_pieces", 0),
                                   "carried": stats.get("cut_carried", 0)}
    if check and (stats.get("pieces", counts["pieces"]) != counts["pieces"] or stats.get("rows", rows) != rows):
        raise InternalError(f"shards hold {rows} rows / {counts['pieces']} pieces, packing made "
                            f"{stats.get('rows')} / {stats.get('pieces')}")
    return counts


def reconcile(c: dict) -> None:
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


def by_count(counts: dict) -> list[tuple[str, int]]:
    """Every reason records left the main path (rejections and ``too_long``), most common first."""
    reasons = dict(counts["rejected_by_reason"])
    if counts["dropped_too_long"]:
        reasons["too_long"] = counts["dropped_too_long"]
    return sorted(reasons.items(), key=lambda kv: -kv[1])


def top_reasons(counts: dict, k: int = 3) -> str:
    """The ``k`` most common reasons records left the main path, with their counts."""
    return ", ".join(f"{r} {n:,}" for r, n in by_count(counts)[:k]) or "no reason recorded"
