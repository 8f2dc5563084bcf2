"""Pure functions between tokenized examples and packed rows (no Beam here).

An :class:`Example` is one tokenized record. :func:`pack_group` bin-packs a group of them with
:func:`packers.pack` and assembles rows that follow :data:`packers.SCHEMA`; it is what every
grouped-mode worker runs. The global two-pass mode runs :func:`plan` on all lengths at once and
:func:`assemble` on each row after joining the tokens back.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable, Sequence

import numpy as np

import packers
from pipeline._formats import Reason
from pipeline._options import PackOptions


def stable_hash(text: str, salt: str = "") -> int:
    """A 64-bit hash that is the same on every machine and run (never Python's ``hash()``)."""
    return int.from_bytes(hashlib.blake2b((salt + "\0" + text).encode(), digest_size=8).digest(), "big")


@dataclasses.dataclass(frozen=True)
class Example:
    example_id: str
    source: str
    position: int
    tokens: np.ndarray
    """``(2, n)`` int32: row 0 the token ids, row 1 the loss mask."""

    @property
    def length(self) -> int:
        return int(self.tokens.shape[1])


@dataclasses.dataclass(frozen=True)
class ExampleBatch:
    """Many examples in four arrays, so Beam pickles one object per batch instead of per example.

    ``tokens[:, offsets[i]:offsets[i + 1]]`` is example ``i`` (row 0 ids, row 1 loss mask).
    """

    ids: list[str]
    sources: list[str]
    positions: list[int]
    offsets: np.ndarray
    tokens: np.ndarray

    @classmethod
    def of(cls, examples: Sequence[Example]) -> "ExampleBatch":
        lens = [e.length for e in examples]
        offsets = np.zeros(len(examples) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        tokens = np.concatenate([e.tokens for e in examples], axis=1) if examples else np.zeros((2, 0), np.int32)
        return cls([e.example_id for e in examples], [e.source for e in examples],
                   [e.position for e in examples], offsets, tokens)

    @classmethod
    def from_arrays(cls, ids: list[str], sources: list[str], positions: list[int], lengths: np.ndarray,
                    input_ids: np.ndarray, loss_mask: np.ndarray) -> "ExampleBatch":
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.empty((2, len(input_ids)), dtype=np.int32)
        tokens[0], tokens[1] = input_ids, loss_mask
        return cls(list(ids), list(sources), list(positions), offsets, tokens)

    def take(self, which: Sequence[int], suffix: str = "") -> "ExampleBatch":
        """The examples at ``which``, with ``suffix`` added to their ids."""
        o = self.offsets
        parts = [self.tokens[:, o[i]:o[i + 1]] for i in which]
        lengths = np.array([o[i + 1] - o[i] for i in which], dtype=np.int64)
        offsets = np.zeros(len(which) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(parts, axis=1) if parts else np.zeros((2, 0), np.int32)
        return ExampleBatch([self.ids[i] + suffix for i in which], [self.sources[i] for i in which],
                            [self.positions[i] for i in which], offsets, tokens)

    @classmethod
    def concat(cls, batches: Sequence["ExampleBatch"]) -> "ExampleBatch":
        tokens = np.concatenate([b.tokens for b in batches], axis=1)
        lengths = np.concatenate([np.diff(b.offsets) for b in batches])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return cls([i for b in batches for i in b.ids], [s for b in batches for s in b.sources],
                    [p for b in batches for p in b.positions], offsets, tokens)

    def __len__(self) -> int:
        return len(self.ids)

    def examples(self) -> Iterable[Example]:
        o = self.offsets
        for i, eid in enumerate(self.ids):
            yield Example(eid, self.sources[i], self.positions[i], self.tokens[:, o[i]:o[i + 1]])

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])


@dataclasses.dataclass(frozen=True)
class Piece:
    """One placed piece: ``tokens[:, start:stop]`` of ``example_id``, ``part`` >= 0 when split."""

    example_id: str
    start: int
    stop: int
    part: int  # -1 when the example is whole


@dataclasses.dataclass
class Plan:
    rows: list[list[Piece]]
    rejected: list[dict]
    stats: dict


def example_id(source: str, position: int, record: dict) -> str:
    """``source:<record's own id>`` when it has one, else ``source:position``."""
    own = record.get("id")
    if isinstance(own, (str, int)) and not isinstance(own, bool) and str(own) != "":
        return f"{source}:{own}"
    return f"{source}:{position}"


def reject_record(source: str, position: int, reason: Reason, detail: str, example_id: str | None = None) -> dict:
    """A dead-letter record. ``position`` is a 1-based line for JSONL, a 0-based index otherwise."""
    rec = {"source": source, "position": position, "reason": reason.value, "detail": detail}
    if example_id is not None:
        rec["example_id"] = example_id
    return rec


def dedupe(items: Iterable[tuple[str, str, int, int]]) -> tuple[list[tuple[str, str, int, int]], list[dict]]:
    """Sort ``(id, source, position, length)`` by id and keep the first of each duplicate id."""
    ordered = sorted(items, key=lambda t: (t[0], t[1], t[2]))
    kept, rejected = [], []
    for item in ordered:
        if kept and kept[-1][0] == item[0]:
            first = kept[-1]
            rejected.append(
                reject_record(item[1], item[2], Reason.DUPLICATE_ID,
                              f"id {item[0]!r} already used by {first[1]}:{first[2]}", item[0])
            )
        else:
            kept.append(item)
    return kept, rejected


def plan(items: Sequence[tuple[str, str, int, int]], options: PackOptions) -> Plan:
    """Bin-pack ``(id, source, position, length)`` items (already de-duplicated, sorted by id)."""
    budget = options.max_tokens
    lengths = np.fromiter((t[3] for t in items), dtype=np.int64, count=len(items))
    result = packers.pack(lengths, budget, "bfd", long=options.long, max_per_row=options.max_per_row,
                          refine=options.refine and options.max_per_row is None)
    split = set(result.split.tolist())
    order, starts, stops = result.order.tolist(), result.starts.tolist(), result.stops.tolist()
    bounds = result.row_offsets.tolist()
    rows = [
        [Piece(items[e][0], a, b, a // budget if e in split else -1)
         for e, a, b in zip(order[lo:hi], starts[lo:hi], stops[lo:hi])]
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]
    rejected = []
    for e in result.dropped.tolist():
        eid, source, position, n = items[e]
        rejected.append(reject_record(
            source, position, Reason.TOO_LONG,
            f"{n} tokens > budget {budget} (--long drop); use --long split or truncate, or a larger --max-tokens",
            eid,
        ))
    for e in result.empty.tolist():  # unreachable after tokenization (EOS is always added), kept for safety
        eid, source, position, _ = items[e]
        rejected.append(reject_record(source, position, Reason.EMPTY_AFTER_RENDER, "0 tokens", eid))
    stats = {
        "examples_packed": len(items) - len(result.dropped) - len(result.empty),
        "pieces": int(len(result.order)),
        "rows": result.num_rows,
        "tokens": int(result.row_lengths.sum()) if result.num_rows else 0,
        "dropped_too_long": int(len(result.dropped)),
        "dropped_too_long_tokens": int(result.dropped_tokens),
        "truncated_examples": int(len(result.truncated)),
        "truncated_tokens": int(result.truncated_tokens),
        "split_examples": int(len(result.split)),
    }
    return Plan(rows, rejected, stats)


def piece_id(p: Piece) -> str:
    return p.example_id if p.part < 0 else f"{p.example_id}#{p.part}"


def assemble(pieces: Sequence[Piece], tokens: dict[str, np.ndarray], seed: int) -> dict:
    """One packed row (a dict of numpy arrays following packers.SCHEMA) plus its shuffle key."""
    parts = [tokens[p.example_id][:, p.start:p.stop] for p in pieces]
    joined = np.concatenate(parts, axis=1) if parts else np.zeros((2, 0), np.int32)
    lens = np.fromiter((p.stop - p.start for p in pieces), dtype=np.int32, count=len(pieces))
    offsets = np.concatenate([[0], np.cumsum(lens, dtype=np.int32)]).astype(np.int32)
    ids = [piece_id(p) for p in pieces]
    return {
        "key": stable_hash(ids[0], salt=str(seed)),
        "input_ids": joined[0].astype(np.int32),
        "loss_mask": joined[1].astype(np.uint8),
        "seq_offsets": offsets,
        "example_ids": ids,
        "num_tokens": int(joined.shape[1]),
        "target_tokens": int(joined[1].sum()),
    }


def pack_group(examples: Iterable[Example], options: PackOptions) -> tuple[list[dict], list[dict], dict]:
    """Grouped mode: de-duplicate, plan and assemble one group. Returns (rows, rejected, stats)."""
    by_id: dict[str, Example] = {}
    items = []
    for ex in examples:
        items.append((ex.example_id, ex.source, ex.position, ex.length))
        prev = by_id.get(ex.example_id)
        if prev is None or (ex.source, ex.position) < (prev.source, prev.position):
            by_id[ex.example_id] = ex
    kept, rejected = dedupe(items)
    p = plan(kept, options)
    tokens = {k: v.tokens for k, v in by_id.items()}
    rows = [assemble(r, tokens, options.seed) for r in p.rows]
    p.stats["duplicates"] = len(rejected)
    return rows, rejected + p.rejected, p.stats
