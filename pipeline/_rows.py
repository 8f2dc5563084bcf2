"""Pure functions between tokenized examples and packed rows (no Beam here).

An :class:`ExampleBatch` holds many tokenized examples in flat numpy arrays. :func:`pack_group`
turns one group of them into packed rows (an Arrow record batch following
:data:`packers.SCHEMA`), with every example that leaves the main path as a dead letter; it is
what every grouped-mode worker runs. Ids::

    gsm8k/train.jsonl@7          record at line 7 (JSONL) or row 7 (other formats), no id of its own
    oasst.jsonl:a1b2             the record's own string id
    oasst.jsonl:42               the record's own integer id 42 ...
    oasst.jsonl:"42"             ... which never collides with the string id "42"
    mix.jsonl:q17~2              the 2nd copy of a record of a data set with weight 2
    t0.jsonl@9#1                 the 2nd piece of an example split by --long split

Sources and string ids are escaped (``%``, ``:``, ``@``, ``#``, ``~`` as ``%25`` ...), so every
id reads back to exactly one (source, record, copy, piece).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

import packers
from packers import LongPolicy
from packers.manifest import escape_source
from packers.rowcheck import row_sums
from pipeline import _arrow
from pipeline._formats import Reason
from pipeline._long import carried_pieces, cut_counts, cuts_column, long_pieces, pair_marks, reject_record, whole_id  # noqa: F401
from pipeline._options import PackOptions


def stable_hash(text: str, salt: str = "") -> int:
    """A 64-bit hash that is the same on every machine and run (never Python's ``hash()``)."""
    return int.from_bytes(hashlib.blake2b((salt + "\0" + text).encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


_ID_ESCAPES = str.maketrans({"%": "%25", "#": "%23", "~": "%7E"})


def example_id(source: str, position: int, record: Any, own_ids: bool = True) -> str:
    """The example's id (see the module docstring): its own ``id`` when it has one, else its position;
    always its position when ``own_ids`` is False (``--ids position``: ids that repeat by design)."""
    src = escape_source(source)
    own = record.get("id") if isinstance(record, dict) and own_ids else None
    if isinstance(own, str) and own:
        text = own.translate(_ID_ESCAPES)
        return f'{src}:"{text}"' if _looks_numeric(own) else f"{src}:{text}"
    if isinstance(own, int) and not isinstance(own, bool):
        return f"{src}:{own}"
    if isinstance(own, float) and math.isfinite(own):
        return f"{src}:{own!r}"
    return f"{src}@{position}"


_NOT_NUMERIC_START = frozenset("abcdefghjklmopqrstuvwxyzABCDEFGHJKLMOPQRSTUVWXYZ_/:@#~%")
"""First characters ``float()`` never accepts (it takes digits, signs, dots, spaces, "inf"/"nan")."""


def _looks_numeric(s: str) -> bool:
    if s[0] in _NOT_NUMERIC_START:  # most string ids: skip float()'s exception
        return False
    try:
        float(s)
    except ValueError:
        return s.startswith('"')
    return True


def base_id(example_id: str) -> str:
    """The id without a repeat copy's ``~k``: every copy of a record lands in the same split."""
    return example_id.split("~", 1)[0]


def split_of(example_id: str, validation_fraction: float) -> str:
    """"validation" for a stable ``validation_fraction`` of the records (by a hash of the id without its
    repeat suffix, so every copy of a record lands in the same split), else "train"."""
    if validation_fraction and stable_hash(base_id(example_id), salt="validation") < validation_fraction * 2**64:
        return "validation"
    return "train"


def group_of(example_id: str, groups: int) -> int:
    """The packing group of an example: a stable hash of its id (all copies of one id land together)."""
    return stable_hash(example_id, salt="group") % groups


def reject_sort_key(r: dict) -> tuple:
    """The order of rejected.jsonl: by input, then position, reason and id."""
    return (r["source"], r["position"], r["reason"], r.get("example_id") or "")


@dataclasses.dataclass(frozen=True)
class Images:
    """The images of an :class:`ExampleBatch`'s examples (``--processor`` runs): example ``i``'s are images
    ``index[i]:index[i + 1]``, in the order they stand in its tokens::

        input_ids  [ 5 | 151652 151655 151655 151655 151655 151653 | 9 2 ]    one image of grid (1, 4, 4): 4 tokens
        offsets    [ 2 ]        the example-relative offset of its first placeholder token (151655, <|image_pad|>)
        grids      [[1, 4, 4]]
        refs       [("/data/cat.jpg", None)]     (path, bytes): one of the two
    """

    index: np.ndarray
    """int64 (n + 1,)."""
    offsets: np.ndarray
    """int64 (images,)."""
    grids: np.ndarray
    """int32 (images, 3)."""
    refs: list
    """Per image ``(path, bytes)``, as the rows' ``images`` column stores it."""
    video: np.ndarray | None = None
    """bool (images,): which are videos (``--video-fps``: the rows' video columns); None: none."""
    seconds: np.ndarray | None = None
    """float32 (images,): each video's ``second_per_grid_ts`` (0 for an image); None: all 0."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "video", np.zeros(len(self.offsets), bool) if self.video is None else self.video)
        object.__setattr__(self, "seconds", np.zeros(len(self.offsets), np.float32) if self.seconds is None
                           else self.seconds)

    @classmethod
    def none(cls, n: int) -> "Images":
        """``n`` examples without an image."""
        return cls(np.zeros(n + 1, np.int64), np.zeros(0, np.int64), np.zeros((0, 3), np.int32), [])

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.index)

    def take(self, which: np.ndarray) -> "Images":
        idx = _ranges(self.index[which], self.index[which + 1])
        index = np.zeros(len(which) + 1, np.int64)
        np.cumsum(self.counts[which], out=index[1:])
        return Images(index, self.offsets[idx], self.grids[idx], [self.refs[i] for i in idx.tolist()],
                      self.video[idx], self.seconds[idx])

    @classmethod
    def concat(cls, parts: Sequence["Images"]) -> "Images":
        counts = np.concatenate([p.counts for p in parts])
        index = np.zeros(len(counts) + 1, np.int64)
        np.cumsum(counts, out=index[1:])
        return cls(index, np.concatenate([p.offsets for p in parts]), np.concatenate([p.grids for p in parts]),
                   [r for p in parts for r in p.refs], np.concatenate([p.video for p in parts]),
                   np.concatenate([p.seconds for p in parts]))


@dataclasses.dataclass(frozen=True)
class ExampleBatch:
    """Many examples in flat arrays, so steps move one object per batch instead of per example.

    ``input_ids[offsets[i]:offsets[i + 1]]`` (and ``loss_mask`` likewise) is example ``i``. A
    preference pair (``--pairs``) is one example: its chosen side's tokens, then its rejected
    side's, with ``cuts[i]`` the chosen side's length, so that every step before packing (sampling,
    repeats, the validation split, groups, de-duplication, dead letters) handles the pair as one::

        input_ids  [ 5  9  2 41 17  1  5  9  2 30  1 ]    cuts [6]: chosen [0, 6), rejected [6, 11)
        loss_mask  [ 0  0  0  1  1  1  0  0  0  1  1 ]    targets: the completions
    """

    ids: list[str]
    sources: list[str]
    positions: list[int]
    offsets: np.ndarray
    """int64 (n + 1,)."""
    input_ids: np.ndarray
    """int32 (tokens,)."""
    loss_mask: np.ndarray
    """uint8 (tokens,)."""
    cuts: np.ndarray | None = None
    """int64 (n,): where each pair's rejected side starts; None for plain examples."""
    desirable: np.ndarray | None = None
    """int8 (n,): each example's KTO label (1, 0, -1 for none); None when no example carries one."""
    images: Images | None = None
    """The examples' images (``--processor`` runs); None in a text-only run."""
    marks: np.ndarray | None = None
    """int32 (n, 2): per example that arrives already cut (a repack of packed rows), its cut mark ``[pieces, length]``
    (the rows' ``cuts`` column: ``[0, 0]`` whole, ``[1, N]`` truncated, ``[n, N]`` a piece, ``[-1, -1]`` an older
    split's piece); for pairs (n, 4), the chosen side's mark then the rejected side's. None when none carries one.
    Packing keeps a mark and never cuts a piece again (:func:`pieces`)."""

    @classmethod
    def from_arrays(cls, ids: Sequence[str], sources: Sequence[str], positions: Sequence[int], lengths: np.ndarray,
                    input_ids: np.ndarray, loss_mask: np.ndarray, cuts: np.ndarray | None = None, *,
                    desirable: np.ndarray | None = None) -> "ExampleBatch":
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if cuts is not None:
            cuts = np.asarray(cuts, dtype=np.int64)
            if cuts.shape != (len(ids),) or (len(ids) and ((cuts < 1) | (cuts >= np.diff(offsets))).any()):
                raise packers.InternalError(f"pair cuts {cuts[:8]} do not fit examples of lengths {np.diff(offsets)[:8]}")
        if desirable is not None:
            desirable = np.asarray(desirable, dtype=np.int8)
            if desirable.shape != (len(ids),):
                raise packers.InternalError(f"{desirable.shape} desirability labels for {len(ids)} examples")
        return cls(list(ids), list(sources), list(positions), offsets, input_ids.astype(np.int32, copy=False),
                   loss_mask.astype(np.uint8, copy=False), cuts, desirable)

    def with_marks(self, marks: np.ndarray | None) -> "ExampleBatch":
        """These examples carrying the cut marks they arrived with (:attr:`marks`; None: none was cut)."""
        if marks is None:
            return self
        marks = np.asarray(marks, dtype=np.int32)
        if marks.shape != (len(self), mark_width(self.cuts is not None)):
            raise packers.InternalError(f"cut marks of shape {marks.shape} for {len(self)} examples; expected "
                                        f"({len(self)}, {mark_width(self.cuts is not None)})")
        return dataclasses.replace(self, marks=marks)

    def with_images(self, images: Images | None) -> "ExampleBatch":
        """These examples carrying ``images`` (one entry per example; None: a text-only run)."""
        if images is None:
            return self
        if len(images.index) != len(self.ids) + 1:
            raise packers.InternalError(f"images of {len(images.index) - 1} examples for {len(self.ids)} examples")
        return dataclasses.replace(self, images=images)

    @classmethod
    def empty(cls) -> "ExampleBatch":
        return cls([], [], [], np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, np.uint8))

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def tokens(self, i: int) -> np.ndarray:
        """Example ``i`` as a ``(2, n)`` int32 array: token ids, loss mask."""
        a, b = self.offsets[i], self.offsets[i + 1]
        return np.stack([self.input_ids[a:b], self.loss_mask[a:b].astype(np.int32)])

    def take(self, which: Sequence[int], suffix: str = "") -> "ExampleBatch":
        """The examples at ``which`` (in that order), with ``suffix`` added to their ids."""
        which = np.asarray(which, dtype=np.int64)
        starts, stops = self.offsets[which], self.offsets[which + 1]
        runs = _runs(starts, stops)
        wl = which.tolist()
        ids = [self.ids[i] + suffix for i in wl] if suffix else [self.ids[i] for i in wl]
        return ExampleBatch.from_arrays(ids, [self.sources[i] for i in wl],
                                        [self.positions[i] for i in wl], stops - starts,
                                        _gather(self.input_ids, runs), _gather(self.loss_mask, runs),
                                        None if self.cuts is None else self.cuts[which],
                                        desirable=None if self.desirable is None else self.desirable[which],
                                        ).with_images(None if self.images is None else self.images.take(which)
                                                      ).with_marks(None if self.marks is None else self.marks[which])

    @classmethod
    def concat(cls, batches: Sequence["ExampleBatch"]) -> "ExampleBatch":
        batches = [b for b in batches if len(b)]
        if not batches:
            return cls.empty()
        paired = {b.cuts is not None for b in batches}
        if len(paired) > 1:
            raise packers.InternalError("concatenating batches of pairs with batches of plain examples")
        return cls.from_arrays([i for b in batches for i in b.ids], [s for b in batches for s in b.sources],
                               [p for b in batches for p in b.positions], np.concatenate([b.lengths for b in batches]),
                               np.concatenate([b.input_ids for b in batches]),
                               np.concatenate([b.loss_mask for b in batches]),
                               np.concatenate([b.cuts for b in batches]) if paired == {True} else None,
                               desirable=_labels(batches)).with_images(_images(batches)).with_marks(_marks(batches))


def _labels(batches: Sequence[ExampleBatch]) -> np.ndarray | None:
    """The batches' desirability labels concatenated (-1 for a batch without), or None when none has any."""
    if all(b.desirable is None for b in batches):
        return None
    return np.concatenate([np.full(len(b), -1, np.int8) if b.desirable is None else b.desirable for b in batches])


def mark_width(pairs: bool) -> int:
    """Values of :attr:`ExampleBatch.marks` per example: a ``[pieces, length]`` mark, two for a pair's two sides."""
    return 4 if pairs else 2


def _marks(batches: Sequence[ExampleBatch]) -> np.ndarray | None:
    """The batches' cut marks concatenated (``[0, 0]``, whole, for a batch without), or None when none has any."""
    if all(b.marks is None for b in batches):
        return None
    width = mark_width(batches[0].cuts is not None)
    return np.concatenate([np.zeros((len(b), width), np.int32) if b.marks is None else b.marks for b in batches])


def _images(batches: Sequence[ExampleBatch]) -> Images | None:
    """The batches' images concatenated (none for a batch without), or None when no batch carries any."""
    if all(b.images is None for b in batches):
        return None
    return Images.concat([Images.none(len(b)) if b.images is None else b.images for b in batches])


def _runs(starts: np.ndarray, stops: np.ndarray) -> tuple[list[int], list[int]]:
    """The ranges ``[starts[i], stops[i])`` with each run of adjacent ones merged (``stops[i] == starts[i + 1]``), as
    lists: a take in order, or of whole groups, copies a few long slices instead of one index per token."""
    if not len(starts):
        return [], []
    new = np.ones(len(starts), dtype=bool)
    new[1:] = starts[1:] != stops[:-1]
    first = np.flatnonzero(new)
    last = np.concatenate([first[1:], [len(starts)]]) - 1
    return starts[first].tolist(), stops[last].tolist()


def _gather(values: np.ndarray, runs: tuple[list[int], list[int]]) -> np.ndarray:
    """``values[a:b]`` for each run ``(a, b)``, concatenated (:func:`_runs`)."""
    a, b = runs
    if len(a) == 1:  # one run: a view (batches are never written in place once built)
        return values[a[0]:b[0]]
    if not a:
        return values[:0].copy()
    return np.concatenate([values[x:y] for x, y in zip(a, b)])


def _ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """``concatenate([arange(a, b) for a, b in zip(starts, stops)])``, vectorized."""
    lens = (stops - starts).astype(np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    first = np.repeat(starts - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return first + np.arange(total, dtype=np.int64)


@dataclasses.dataclass
class Group:
    """What :func:`pack_group` made of one group."""

    chunks: tuple[pa.RecordBatch, ...]
    """The rows, in their seeded shuffle order, following :data:`packers.SCHEMA` (or ``VISION_SCHEMA``): one record
    batch, or several when the rows' embedded images hold more than :data:`CHUNK_IMAGE_BYTES` (one Arrow ``binary``
    array holds at most 2 GiB)."""
    rejected: list[dict]
    stats: dict[str, int]
    eos_at_boundaries: bool
    """Every sequence shorter than the budget ends with the EOS (for the manifest's row_checks)."""
    all_targets: bool

    @property
    def batch(self) -> pa.RecordBatch:
        """The rows as one record batch (a group of several chunks has none: read :attr:`chunks`)."""
        if len(self.chunks) != 1:
            raise packers.InternalError(f"a group of {len(self.chunks)} record batches: read Group.chunks")
        return self.chunks[0]

    @property
    def num_rows(self) -> int:
        return sum(c.num_rows for c in self.chunks)


def pieces(batch: ExampleBatch, options: PackOptions, rejected: list[dict], stats: dict[str, int]):
    """Each example's spans under the --long policy, and their cut marks (:func:`pipeline._long.long_pieces`): (example
    index, start, stop, part, mark); the examples it drops are dead letters in ``rejected``."""
    dead: list[tuple[int, Reason, str]] = []
    out = long_pieces(batch, options, dead, stats)
    rejected += [reject_record(batch.sources[i], batch.positions[i], reason, why, batch.ids[i]) for i, reason, why in dead]
    return out


DUPLICATE_FIX = ("if ids repeat by design (several completions of one prompt), pass --ids position to key records "
                 "by file and position")
"""The fix a ``duplicate_id`` dead letter and the summary name."""


def dedupe(batch: ExampleBatch) -> tuple[ExampleBatch, list[dict]]:
    """Sort by id and keep the first of each duplicate id (by source, then position).

    Two records may share an id when they sit at different places (two records with the same own
    ``id``): the later one is a ``duplicate_id`` dead letter. Two examples with one id at the same
    place (source and position) are one record read twice, or two records numbered alike: a bug
    in the reader, never a duplicate in the data, so the run stops with an InternalError rather
    than drop a record (a line rule that two read tasks count differently would number lines alike).
    """
    # By id, then source, then position: numpy's string order is Python's (code points), and ties are rare.
    order = np.lexsort((np.asarray(batch.positions, dtype=np.int64), np.asarray(batch.sources, dtype=str),
                        np.asarray(batch.ids, dtype=str))).tolist() if len(batch) else []
    keep, rejected = [], []
    for k, i in enumerate(order):
        prev = order[k - 1] if k else None
        if prev is not None and batch.ids[prev] == batch.ids[i] and batch.sources[prev] == batch.sources[i] \
                and batch.positions[prev] == batch.positions[i]:
            raise packers.InternalError(
                f"two examples have id {batch.ids[i]!r} and sit at one place ({batch.sources[i]} at "
                f"{batch.positions[i]}): a record was read twice or two were numbered alike; please report this bug"
            )
        if keep and batch.ids[keep[-1]] == batch.ids[i]:
            first = keep[-1]
            rejected.append(reject_record(
                batch.sources[i], batch.positions[i], Reason.DUPLICATE_ID,
                f"id {batch.ids[i]!r} already used by {batch.sources[first]} at {batch.positions[first]}; "
                f"{DUPLICATE_FIX}", batch.ids[i]))
        else:
            keep.append(i)
    return batch.take(keep), rejected


def pack_group(batch: ExampleBatch, options: PackOptions, eos_id: int | None) -> Group:
    """Grouped mode: de-duplicate, split/truncate, bin-pack and assemble one group of examples (or of pairs)."""
    stats: dict[str, int] = {}
    batch, rejected = dedupe(batch)
    stats["duplicates"] = len(rejected)
    if options.pairs:
        return _pack_pairs(batch, options, eos_id, rejected, stats)
    batch = carried_pieces(batch, options, rejected, stats)
    ex, starts, stops, parts, marks = pieces(batch, options, rejected, stats)
    result = packers.pack(stops - starts, options.max_tokens, "bfd", max_per_row=options.max_per_row,
                          refine=options.refine and options.max_per_row is None)
    if len(result.dropped) or len(result.empty):  # pieces fit the budget and are never empty
        raise packers.InternalError(f"pack() dropped {len(result.dropped)} / emptied {len(result.empty)} pieces")
    o = result.order
    suffixes = ["" if p < 0 else f"#{p}" for p in parts[o].tolist()]
    placed = Placement(ex[o], starts[o], stops[o], suffixes, result.row_offsets, marks=marks[o])
    return _finish(batch, placed, options, eos_id, rejected, stats)


def _finish(batch: ExampleBatch, placed: "Placement", options: PackOptions, eos_id: int | None, rejected: list[dict],
            stats: dict[str, int]) -> Group:
    """The group of placed pieces: its rows (:func:`assemble`), dead letters and counts. An example counts once
    however many pieces it went in, a repack's carried pieces (``<id>#k``) too."""
    placed_ex = np.unique(placed.ex)
    carried = [batch.ids[e] for e in placed_ex.tolist() if "#" in batch.ids[e]] if batch.cuts is None else []
    stats["examples_packed"] = len(placed_ex) - len(carried) + len({whole_id(eid) for eid in carried})
    stats["pieces"] = int(len(placed.ex))
    if options.processor is None:  # the cut marks the rows' cuts column holds (image rows carry none)
        for key, n in cut_counts(batch, placed).items():
            stats[key] = stats.get(key, 0) + n
    group = assemble(batch, placed, options, eos_id)
    stats["rows"] = group.num_rows
    group.rejected = rejected
    group.stats = stats
    return group


def prompt_lengths(batch: ExampleBatch) -> np.ndarray:
    """Each pair's prompt length: the tokens of its chosen side before the first target (the completion)."""
    targets = np.flatnonzero(batch.loss_mask)
    first = targets[np.minimum(np.searchsorted(targets, batch.offsets[:-1]), max(len(targets) - 1, 0))] if len(targets) \
        else batch.offsets[:-1]
    return first - batch.offsets[:-1]


def pack_pair_group(batch: ExampleBatch, options: PackOptions, rejected: list[dict], stats: dict[str, int]):
    """Pack a group of pairs (:func:`packers.pack_pairs`, the --long policy for pairs). Returns the result (its
    sequences: ``2 * i`` pair ``i``'s chosen side, ``2 * i + 1`` its rejected side) and the prompt lengths;
    dead-letters the pairs it drops and counts the ones it truncates."""
    budget = options.max_tokens
    cuts = batch.cuts
    chosen, rejected_len = cuts, batch.lengths - cuts
    prompt = prompt_lengths(batch)
    result = packers.pack_pairs(chosen, rejected_len, budget, "bfd", prompt=prompt, long=options.long,
                                max_per_row=options.max_per_row, refine=options.refine and options.max_per_row is None)
    if len(result.empty):
        raise packers.InternalError(f"pack_pairs() found {len(result.empty) // 2} empty pairs; the encoder never makes one")
    for i in np.unique(result.dropped // 2).tolist():
        c, r, p = int(chosen[i]), int(rejected_len[i]), int(prompt[i])
        if options.long is LongPolicy.TRUNCATE:
            detail = (f"pair of {c} + {r} = {c + r} tokens > budget {budget}, and its prompt ({p} tokens, on both sides) "
                      f"leaves {budget - 2 * p} tokens for the two completions, fewer than one each; use a larger "
                      "--max-tokens")
        else:
            detail = (f"pair of {c} + {r} = {c + r} tokens > budget {budget} (--long drop; a pair is never split); use "
                      "--long truncate (both completions cut at one length) or a larger --max-tokens")
        rejected.append(reject_record(batch.sources[i], batch.positions[i], Reason.TOO_LONG, detail, batch.ids[i]))
        stats["dropped_too_long"] = stats.get("dropped_too_long", 0) + 1
        stats["dropped_too_long_tokens"] = stats.get("dropped_too_long_tokens", 0) + c + r
    cut = np.unique(result.truncated // 2)
    if len(cut):
        stats["truncated_examples"] = stats.get("truncated_examples", 0) + len(cut)
        stats["truncated_tokens"] = stats.get("truncated_tokens", 0) + result.truncated_tokens
    return result, prompt


def as_pairs(batch: ExampleBatch) -> ExampleBatch:
    """``batch`` as a batch of pairs: an empty batch gets empty cuts; examples that are not pairs are a bug."""
    if batch.cuts is not None:
        return batch
    if len(batch):
        raise packers.InternalError("a --pairs run got examples that are not pairs")
    return dataclasses.replace(batch, cuts=np.zeros(0, np.int64))


def _pack_pairs(batch: ExampleBatch, options: PackOptions, eos_id: int | None, rejected: list[dict],
                stats: dict[str, int]) -> Group:
    """:func:`pack_group` for pairs: each pair one item, its two sides adjacent in one row, chosen first."""
    batch = as_pairs(batch)
    result, prompt = pack_pair_group(batch, options, rejected, stats)
    seqs = result.order
    ex, side = seqs // 2, seqs % 2
    starts = np.where(side == 0, 0, batch.cuts[ex])
    suffixes = [packers.Side(s).suffix for s in side.tolist()]
    placed = Placement(ex, starts, starts + result.stops, suffixes, result.row_offsets, prompts=prompt[ex], sides=side,
                       marks=pair_marks(batch, ex, side, result.stops))
    return _finish(batch, placed, options, eos_id, rejected, stats)


def _list(offsets: np.ndarray, values: np.ndarray | list, typ: pa.DataType) -> pa.ListArray:
    return _arrow.list_array(offsets, values, typ)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Pieces placed in rows: row ``r`` is pieces ``row_offsets[r]:row_offsets[r+1]``; piece ``j`` is tokens
    ``[starts[j], stops[j])`` of example ``ex[j]``, with id ``batch.ids[ex[j]] + suffixes[j]``.

    For the sides of pairs, ``prompts[j]`` is piece ``j``'s prompt length (its completion is everything after)
    and ``sides[j]`` its side (0 chosen, 1 rejected); both None for plain examples. ``marks[j]`` is piece ``j``'s
    cut mark ``[pieces, length]`` (int32 (m, 2); None: every piece whole).
    """

    ex: np.ndarray
    starts: np.ndarray
    stops: np.ndarray
    suffixes: list[str]
    row_offsets: np.ndarray
    prompts: np.ndarray | None = None
    sides: np.ndarray | None = None
    marks: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.marks is None:
            object.__setattr__(self, "marks", np.zeros((len(self.ex), 2), np.int32))


def assemble(batch: ExampleBatch, placed: Placement, options: PackOptions, eos_id: int | None) -> Group:
    """The rows of placed pieces, shuffled by a key seeded with ``--seed``.

    Rows of pairs get their pair columns; the rows' contract checks (pairs adjacent, chosen first) are the
    loader's and verify's.
    """
    ex, starts, stops, suffixes, row_offsets = placed.ex, placed.starts, placed.stops, placed.suffixes, placed.row_offsets
    seed, budget = options.seed, options.max_tokens
    piece_ids = [batch.ids[e] + sfx for e, sfx in zip(ex.tolist(), suffixes)]
    rows = len(row_offsets) - 1
    first = row_offsets[:-1].tolist()
    keys = np.array([stable_hash(piece_ids[f], salt=str(seed)) for f in first], dtype=np.uint64)
    row_order = np.argsort(keys, kind="stable")
    # Pieces in the shuffled row order.
    piece_order = _ranges(row_offsets[:-1][row_order], row_offsets[1:][row_order])
    abs_starts = batch.offsets[ex[piece_order]] + starts[piece_order]
    abs_stops = batch.offsets[ex[piece_order]] + stops[piece_order]
    tok = _ranges(abs_starts, abs_stops)
    input_ids = batch.input_ids[tok]
    loss_mask = batch.loss_mask[tok]
    piece_lens = (abs_stops - abs_starts).astype(np.int64)
    row_pieces = np.diff(row_offsets)[row_order]
    row_tokens = np.add.reduceat(piece_lens, np.concatenate([[0], np.cumsum(row_pieces)[:-1]])) if rows else piece_lens[:0]
    # seq_offsets: per row [0, cumsum of its pieces]: flat values with one more entry per row.
    csum = np.cumsum(piece_lens)
    row_start_piece = np.concatenate([[0], np.cumsum(row_pieces)])
    base = np.repeat(np.concatenate([[0], csum])[row_start_piece[:-1]], row_pieces)
    ends = csum - base
    seq_vals = np.insert(ends, row_start_piece[:-1], 0) if rows else np.zeros(0, np.int64)
    seq_row_off = np.concatenate([[0], np.cumsum(row_pieces + 1)])
    tok_row_off = np.concatenate([[0], np.cumsum(row_tokens)])
    ordered_ids = [piece_ids[i] for i in piece_order.tolist()]
    # num_targets: a row's targets, less those on a sequence's first token (the Collator's labels drop them).
    at_first = np.bincount(np.repeat(np.arange(rows), row_pieces), weights=loss_mask[csum - piece_lens],
                           minlength=rows).astype(np.int64) if rows else np.zeros(0, np.int64)
    num_targets = row_sums(loss_mask, tok_row_off[:-1], row_tokens) - at_first
    if placed.sides is None:
        none = np.zeros(rows + 1, np.int64)
        pair_cols = [_list(none, [], pa.string()), _list(none, np.zeros(0, np.uint8), pa.uint8()),
                     _list(none, np.zeros(0, np.int32), pa.int32())]
    else:
        seq_start = ends - piece_lens  # row-relative
        spans = np.stack([seq_start + placed.prompts[piece_order], ends], axis=1).ravel()
        sides = placed.sides[piece_order]
        pair_cols = [_list(row_start_piece, [batch.ids[e] for e in ex[piece_order].tolist()], pa.string()),
                     _list(row_start_piece, sides.astype(np.uint8), pa.uint8()),
                     _list(2 * row_start_piece, spans, pa.int32())]
    labels = np.zeros(0, np.int8) if batch.desirable is None else batch.desirable[ex[piece_order]]
    desirable = _list(row_start_piece if batch.desirable is not None else np.zeros(rows + 1, np.int64), labels, pa.int8())
    arrays = [
        _list(tok_row_off, input_ids, pa.int32()),
        _list(tok_row_off, loss_mask, pa.uint8()),
        _list(seq_row_off, seq_vals, pa.int32()),
        _list(row_start_piece, ordered_ids, pa.string()),
        _arrow.array(row_tokens, pa.int32()),
        _arrow.array(num_targets, pa.int32()),
        *pair_cols,
        desirable,
    ]
    if options.processor is None:
        arrays.append(cuts_column(placed.marks[piece_order], row_pieces))
        chunks: tuple[pa.RecordBatch, ...] = (pa.RecordBatch.from_arrays(arrays, schema=packers.SCHEMA),)
    else:
        videos = options.vision().videos
        image_cols, row_bytes = image_columns(batch, ex[piece_order], starts[piece_order], stops[piece_order],
                                              ends - piece_lens, row_pieces, sides=placed.sides is not None)
        image_cols = image_cols if videos else image_cols[:3]
        chunks = _chunked(arrays + image_cols, row_bytes, packers.VIDEO_SCHEMA if videos else packers.VISION_SCHEMA)
    # Row checks for the manifest: sequences shorter than the budget end with the EOS; targets everywhere?
    if eos_id is None or not len(piece_lens):
        eos_ok = eos_id is not None
    else:
        last_tok = input_ids[np.cumsum(piece_lens) - 1]
        eos_ok = bool(np.all((last_tok == eos_id) | (piece_lens == budget)))
    return Group(chunks, [], {}, eos_ok, bool(loss_mask.all()) if len(loss_mask) else True)


_MAX_BINARY = 2**31 - 1
"""The bytes one ``pa.binary()`` array holds (32-bit offsets)."""

IMAGE_STRUCT = packers.VISION_SCHEMA.field("images").type.value_type
"""``struct<path: string, bytes: binary>``: one image of a row."""


CHUNK_IMAGE_BYTES = 256 * 2**20
"""Embedded image bytes per record batch of packed rows: a group whose rows hold more is written as several batches
(never cut inside a row), so no ``binary`` column nears its 2 GiB limit and no batch is huge in memory."""

def _wide(schema: pa.Schema) -> pa.Schema:
    """``schema`` with 64-bit offsets for the image (and video) bytes: a group's rows before they are cut up."""
    return pa.schema([f if f.name not in ("images", "videos") else pa.field(
        f.name, pa.list_(pa.struct([pa.field("path", pa.string()), pa.field("bytes", pa.large_binary())])),
        nullable=False) for f in schema])


_WIDE_SCHEMA = _wide(packers.VISION_SCHEMA)


def image_list(offsets: np.ndarray, refs: Sequence[tuple]) -> pa.ListArray:
    """``list<struct<path, large_binary bytes>>`` whose list ``i`` is ``refs[offsets[i]:offsets[i + 1]]`` (``(path,
    bytes)`` each); :func:`_chunked` casts each chunk of rows to the contract's ``binary``."""
    struct = pa.StructArray.from_arrays([pa.array([r[0] for r in refs], pa.string()),
                                         pa.array([r[1] for r in refs], pa.large_binary())],
                                        fields=list(_WIDE_SCHEMA.field("images").type.value_type))
    return pa.ListArray.from_arrays(_arrow.array(offsets, pa.int32()), struct)


def _chunked(arrays: list, row_bytes: np.ndarray, schema: pa.Schema = packers.VISION_SCHEMA) -> tuple[pa.RecordBatch, ...]:
    """The rows as record batches of ``schema`` (:data:`packers.VISION_SCHEMA`, or ``VIDEO_SCHEMA``), each holding at
    most :data:`CHUNK_IMAGE_BYTES` of embedded images (or one row); a single row over the 2 GiB a ``binary`` column
    holds is refused."""
    wide = pa.RecordBatch.from_arrays(arrays, schema=_wide(schema))
    if len(row_bytes) and row_bytes.max() > _MAX_BINARY:
        raise packers.PackstreamError(
            f"one packed row holds {int(row_bytes.max()):,} bytes of embedded images, over the {_MAX_BINARY:,} an "
            "Arrow binary column holds; use --images reference, or a smaller --max-tokens")
    cuts = [0]
    held = 0
    for i, b in enumerate(row_bytes.tolist()):
        if held + b > CHUNK_IMAGE_BYTES and i > cuts[-1]:
            cuts.append(i)
            held = 0
        held += b
    cuts.append(wide.num_rows)
    chunks = []
    for a, z in zip(cuts[:-1], cuts[1:]):
        narrow = pa.Table.from_batches([wide.slice(a, z - a)]).cast(schema).combine_chunks()
        chunks.append(narrow.to_batches()[0] if narrow.num_rows else _arrow.empty_batch(schema))
    return tuple(chunks)


def image_columns(batch: ExampleBatch, ex: np.ndarray, starts: np.ndarray, stops: np.ndarray, at: np.ndarray,
                  row_pieces: np.ndarray, sides: bool = False) -> tuple[list[pa.Array], np.ndarray]:
    """The rows' ``image_offsets``, ``image_grid_thw``, ``images``, then ``video_offsets``, ``video_grid_thw``,
    ``videos``, ``second_per_grid_ts`` (:data:`packers.VIDEO_SCHEMA`; a run without videos drops these), the bytes wide
    until :func:`_chunked`: pieces in row order (piece ``j``: tokens ``[starts[j], stops[j])`` of example ``ex[j]``,
    at row offset ``at[j]``); and the embedded bytes of each row. ``sides``: the pieces are the two sides of pairs,
    each holding the images that start inside it (its prompt's); else a piece holds all its example's."""
    imgs = batch.images if batch.images is not None else Images.none(len(batch))
    counts = imgs.counts[ex]
    idx = _ranges(imgs.index[ex], imgs.index[ex + 1])  # the pieces' images, in row order
    piece = np.repeat(np.arange(len(ex)), counts)
    here = (imgs.offsets[idx] >= starts[piece]) & (imgs.offsets[idx] < stops[piece])
    if sides:
        idx, piece = idx[here], piece[here]
    elif not here.all():
        raise packers.InternalError("a piece of an example with images was cut; images are never cut")
    rows = len(row_pieces)
    row_of = np.repeat(np.arange(rows), row_pieces)[piece] if rows else np.zeros(0, np.int64)
    cols, row_bytes = [], np.zeros(rows, np.int64)
    for kind in (False, True):
        sel = imgs.video[idx] == kind
        k_idx, k_piece, k_row = idx[sel], piece[sel], row_of[sel]
        per_row = np.bincount(k_row, minlength=rows) if rows else np.zeros(0, np.int64)
        off = np.concatenate([[0], np.cumsum(per_row)]).astype(np.int64)
        refs = [imgs.refs[i] for i in k_idx.tolist()]
        sizes = np.array([len(r[1]) if r[1] is not None else 0 for r in refs], dtype=np.int64)
        row_bytes += np.bincount(k_row, weights=sizes, minlength=rows).astype(np.int64) if rows else 0
        inside = imgs.offsets[k_idx] - starts[k_piece]
        cols += [_list(off, (inside + at[k_piece]).astype(np.int32), pa.int32()),
                 _list(3 * off, imgs.grids[k_idx].reshape(-1).astype(np.int32), pa.int32()),
                 image_list(off, refs)]
        cols += [_list(off, imgs.seconds[k_idx].astype(np.float32), pa.float32())] if kind else []
    return cols, row_bytes
