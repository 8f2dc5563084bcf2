"""Packing statistics: how full the rows are, and what left the main path.

>>> from packers import pack
>>> s = pack_stats(pack([5, 3, 7, 2, 4, 0, 12], budget=8))   # rows: 7 | 5 3 | 4 2
>>> s.rows, s.tokens, s.lower_bound, round(s.fill, 3), round(s.rows_over_lower_bound, 3)
(3, 21, 3, 0.875, 0.0)
>>> s.dropped_examples, s.dropped_tokens, s.empty_examples
(1, 12, 1)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from packers.errors import PackstreamError
from packers._pack import PackResult


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackStats:
    """Summary of a packing. Example-level fields are None when built from row lengths alone."""

    budget: int
    rows: int
    tokens: int
    """Tokens placed in rows."""
    fill: float
    """``tokens / (rows * budget)``; 0.0 without rows."""
    lower_bound: int
    """``ceil(tokens / budget)``: no packing of these tokens has fewer rows."""
    rows_over_lower_bound: float
    """``rows / lower_bound - 1``: 0.0 is optimal."""
    examples: int | None = None
    """Examples placed, whole or in pieces."""
    pieces: int | None = None
    """Sequences placed: one per placed example, more for split ones."""
    examples_per_row_mean: float | None = None
    """Pieces per row (a piece of a split example counts as one)."""
    examples_per_row_min: int | None = None
    examples_per_row_max: int | None = None
    dropped_examples: int | None = None
    """Longer than the budget and not placed."""
    dropped_tokens: int | None = None
    empty_examples: int | None = None
    """Zero-length examples, never placed."""
    truncated_examples: int | None = None
    truncated_tokens: int | None = None
    """Tokens cut off the truncated examples."""
    split_examples: int | None = None
    split_pieces: int | None = None
    """Pieces the split examples became."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def pack_stats(result_or_row_lengths: PackResult | np.ndarray, budget: int | None = None) -> PackStats:
    """Statistics of a :class:`PackResult`, or of the tokens per row (e.g. a shard's ``num_tokens``).

    ``budget`` is required with row lengths; with a PackResult it defaults to the result's
    and must match it if given.
    """
    if isinstance(result_or_row_lengths, PackResult):
        result = result_or_row_lengths
        if budget is not None and budget != result.budget:
            raise PackstreamError(f"budget={budget} but the result was packed with budget {result.budget}")
        budget = result.budget
        row_lengths = result.row_lengths
    else:
        result = None
        if budget is None or budget < 1:
            raise PackstreamError(f"pack_stats of row lengths needs budget >= 1, got {budget!r}")
        row_lengths = np.asarray(result_or_row_lengths, dtype=np.int64)
    rows = len(row_lengths)
    tokens = int(row_lengths.sum())
    lower_bound = -(-tokens // budget)
    stats: dict[str, Any] = dict(
        budget=budget,
        rows=rows,
        tokens=tokens,
        fill=tokens / (rows * budget) if rows else 0.0,
        lower_bound=lower_bound,
        rows_over_lower_bound=rows / lower_bound - 1 if lower_bound else 0.0,
    )
    if result is not None:
        per_row = np.diff(result.row_offsets)
        split_pieces = int(np.isin(result.order, result.split).sum()) if len(result.split) else 0
        stats.update(
            examples=len(result.order) - split_pieces + len(result.split),
            pieces=len(result.order),
            examples_per_row_mean=float(per_row.mean()) if rows else 0.0,
            examples_per_row_min=int(per_row.min()) if rows else 0,
            examples_per_row_max=int(per_row.max()) if rows else 0,
            dropped_examples=len(result.dropped),
            dropped_tokens=result.dropped_tokens,
            empty_examples=len(result.empty),
            truncated_examples=len(result.truncated),
            truncated_tokens=result.truncated_tokens,
            split_examples=len(result.split),
            split_pieces=split_pieces,
        )
    return PackStats(**stats)
