"""The encode stage: a chunk of raw records -> encoded examples plus typed rejections.

Every path that turns records into tokens calls :meth:`Encoder.encode`: the Beam job, ``estimate``,
``verify --inputs``, ``preview`` and the benchmarks. One chunk goes through::

    [(dataset, source, position, record | Rejected), ...]
       | normalize  per record (pipeline._formats)   -> Conversation, or Rejected
       | render     per record (pipeline._render)    -> segments [(text, is_target), ...]
       | tokenize   ONE encode_batch_fast call over every segment of the chunk (Rust, threads)
       | masks      numpy: each segment's flag repeated over its token count; EOS appended
       v
    Encoded(batch: ExampleBatch, rejected: [dead letters], counts: {counter: n})

Nothing leaves silently: a record becomes an example (or several, when its data set repeats or it is a
message tree with several kept paths),
a dead letter with a :class:`~pipeline._formats.Reason`, or a ``not_sampled`` count (a data set
sampled below weight 1). ``counts`` also carries what normalization did to the records that
were kept (turns trimmed, merged, dropped; fields ignored), summed into the manifest.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional, Sequence

import numpy as np

from pipeline import _rows
from pipeline._formats import Conversation, Reason, Rejected, conversations
from pipeline._options import PackOptions
from pipeline._render import Renderer

Item = tuple[int, str, int, Any]
"""``(dataset index, source, position, record or Rejected)``: what the readers emit."""


@dataclasses.dataclass
class Encoded:
    batch: _rows.ExampleBatch
    rejected: list[dict]
    counts: dict[str, int]
    """Per-chunk counters: ``not_sampled``, ``repeated_copies``, ``extra_paths`` (examples beyond the first of a
    record that holds several conversations: the paths of a message tree), normalization notes,
    ``ignored_field:<name>``."""


@dataclasses.dataclass
class _Prepared:
    """A chunk after normalize and render, before tokenization."""

    texts: list[str] = dataclasses.field(default_factory=list)
    flags: list[bool] = dataclasses.field(default_factory=list)
    owner: list[int] = dataclasses.field(default_factory=list)
    """Index in ``meta`` of each segment."""
    meta: list[tuple[str, str, int, int]] = dataclasses.field(default_factory=list)
    """(example id, source, position, dataset) of each kept record."""
    direct: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    """Index in ``meta`` -> a pre-tokenized (2, n) example."""
    no_eos: set[int] = dataclasses.field(default_factory=set)
    """Indices in ``meta`` that get no EOS appended (pre-tokenized examples and labelled segments)."""
    rejected: list[dict] = dataclasses.field(default_factory=list)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)


def add_counts(into: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v
    return into


class Encoder:
    """Normalize, render and tokenize chunks of records with one tokenizer (loaded once per process)."""

    def __init__(self, options: PackOptions):
        self.options = options
        self.datasets = options.datasets()
        self.renderer = Renderer(options)
        tok = self.renderer.tok
        self._backend = tok.backend_tokenizer
        self.eos_id: Optional[int] = tok.eos_token_id
        self.vocab_size = len(tok)
        self._foreign_ends = _foreign_ends(self._backend, self.eos_id)

    # -- per record ---------------------------------------------------------------------------
    def _sampled(self, dataset: int, example_id: str) -> bool:
        weight = self.datasets[dataset].weight
        if weight >= 1:
            return True
        # A stable fraction: the same records at every run, on every machine and runner.
        return _rows.stable_hash(example_id, salt=f"sample:{self.options.seed}") < weight * 2**64

    def _pretokenized(self, conv: Conversation, dataset: int) -> np.ndarray:
        """Pre-tokenized ids, refused when they cannot be this tokenizer's: checked before --tokenized-with is asked
        for, so that the refusal never suggests an option that would pack another tokenizer's ids."""
        tokens = conv.tokens
        fmt = self.datasets[dataset].format
        ids = tokens[0]
        name = self.options.tokenizer
        if tokens.shape[1] and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            bad = int(ids.max()) if int(ids.max()) >= self.vocab_size else int(ids.min())
            raise Rejected(Reason.BAD_TOKEN_ID, f"input_ids holds {bad}, at or beyond the vocabulary of {name} "
                                                f"({self.vocab_size} ids): they were made with another tokenizer; pack "
                                                "them with that one as --tokenizer, or pack the text")
        if tokens.shape[1]:
            last = int(ids[-1])
            if last in self._foreign_ends:  # e.g. LLaMA-3's <|eot_id|> 128009 is a deepseek placeholder token
                raise Rejected(Reason.BAD_TOKEN_ID, f"input_ids ends with {last} ({self._foreign_ends[last]!r}), a "
                                                    f"special token of {name} that is not its EOS ({self.eos_id}): the "
                                                    "ids look made with another tokenizer; pack them with that one as "
                                                    "--tokenizer, or pack the text")
        if fmt.tokenized_with is None:
            raise Rejected(
                Reason.PRETOKENIZED_UNVERIFIED,
                "the record holds input_ids, but nothing says which tokenizer made them; pass --tokenized-with "
                f"{name} (it must be the tokenizer they were made with)",
            )
        return tokens

    # -- per chunk ----------------------------------------------------------------------------
    def encode(self, chunk: Sequence[Item]) -> Encoded:
        """Encode one chunk (see the module docstring). Never raises for a bad record."""
        prepared = self.prepare(chunk)
        return self.finish(prepared, self.tokenize(prepared))

    def prepare(self, chunk: Sequence[Item]) -> "_Prepared":
        """The Python half: normalize and render every record of the chunk into segments."""
        p = _Prepared()
        for dataset, source, position, record in chunk:
            eid = None
            try:
                if isinstance(record, Rejected):
                    raise record
                eid = _rows.example_id(source, position, record)
                if not self._sampled(dataset, eid):
                    p.counts["not_sampled"] = p.counts.get("not_sampled", 0) + 1
                    continue
                fmt = self.datasets[dataset].format
                convs = conversations(record, fmt)
            except Rejected as r:
                p.rejected.append(_rows.reject_record(source, position, r.reason, r.detail, eid))
                continue
            if len(convs) > 1:  # a message tree: one example per kept path, ids <id>~p2, <id>~p3, ...
                p.counts["extra_paths"] = p.counts.get("extra_paths", 0) + len(convs) - 1
            for k, conv in enumerate(convs):
                ceid = eid if k == 0 else f"{eid}~p{k + 1}"
                try:
                    if conv.tokens is not None:
                        p.direct[len(p.meta)] = self._pretokenized(conv, dataset)
                    else:
                        if not self.renderer.appends_eos(conv):  # labelled segments: trained exactly as labelled
                            p.no_eos.add(len(p.meta))
                        segs = self.renderer.segments(conv, fmt)
                        i = len(p.meta)
                        p.texts.extend(t for t, _ in segs)
                        p.flags.extend(y for _, y in segs)
                        p.owner.extend(itertools.repeat(i, len(segs)))
                    add_counts(p.counts, conv.notes)
                except Rejected as r:
                    p.rejected.append(_rows.reject_record(source, position, r.reason, r.detail, ceid))
                    continue
                p.meta.append((ceid, source, position, dataset))
        return p

    def tokenize(self, p: "_Prepared") -> list:
        """The Rust half: one batch call over every segment (releases the GIL, uses the tokenizer's threads)."""
        return self._backend.encode_batch_fast(p.texts, add_special_tokens=False) if p.texts else []

    def finish(self, p: "_Prepared", encs: list) -> Encoded:
        """Masks from segment lengths (numpy), the EOS, target checks, repeats."""
        rejected, counts, kept_meta, direct = p.rejected, p.counts, p.meta, p.direct
        n = len(kept_meta)
        seg_lens = np.fromiter(map(len, encs), dtype=np.int64, count=len(encs))
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=np.int32, count=int(seg_lens.sum()))
        mask = np.repeat(np.asarray(p.flags, dtype=np.uint8), seg_lens)
        rec_lens = np.bincount(np.asarray(p.owner, dtype=np.int64), weights=seg_lens, minlength=n).astype(np.int64)
        if direct:  # splice pre-tokenized examples in at their place
            ids, mask, rec_lens = _splice(ids, mask, rec_lens, direct)
        ids, mask, rec_lens = self._append_eos(ids, mask, rec_lens, set(direct) | p.no_eos)

        starts = np.concatenate([[0], np.cumsum(rec_lens)[:-1]]).astype(np.int64) if n else np.zeros(0, np.int64)
        targets = np.add.reduceat(mask.astype(np.int64), starts) if n and len(mask) else np.zeros(n, np.int64)
        targets = np.where(rec_lens > 0, targets, 0)
        keep = np.ones(n, dtype=bool)
        for i in np.flatnonzero(rec_lens == 0):
            eid, source, position, _ = kept_meta[i]
            rejected.append(_rows.reject_record(source, position, Reason.EMPTY_AFTER_RENDER,
                                                "the record renders to no tokens", eid))
            keep[i] = False
        for i in np.flatnonzero((rec_lens > 0) & (targets == 0)):
            eid, source, position, _ = kept_meta[i]
            rejected.append(_rows.reject_record(
                source, position, Reason.NO_TARGET_TOKENS,
                "no token is a training target (every turn is context: empty assistant turns, or train flags "
                "set to 0); use --train-on all to train on every token", eid))
            keep[i] = False
        if not keep.all():
            token_keep = np.repeat(keep, rec_lens)
            ids, mask, rec_lens = ids[token_keep], mask[token_keep], rec_lens[keep]
            kept_meta = [m for m, k in zip(kept_meta, keep) if k]
        batch = _rows.ExampleBatch.from_arrays(
            [m[0] for m in kept_meta], [m[1] for m in kept_meta], [m[2] for m in kept_meta], rec_lens, ids, mask,
        )
        batch, copies = self._repeat(batch, [m[3] for m in kept_meta])
        if copies:
            counts["repeated_copies"] = counts.get("repeated_copies", 0) + copies
        return Encoded(batch, rejected, counts)

    def _append_eos(self, ids, mask, rec_lens, skip: set[int]):
        """Every rendered example ends with the tokenizer's EOS: append it where the text did not end with it.
        The EOS is a target when the example's last token is one. ``skip``: examples that stay as they are
        (pre-tokenized records, labelled segments)."""
        if self.eos_id is None or not len(rec_lens):
            return ids, mask, rec_lens
        ends = np.cumsum(rec_lens)
        need = rec_lens > 0
        need[rec_lens > 0] &= ids[ends[rec_lens > 0] - 1] != self.eos_id
        if skip:
            need[list(skip)] = False
        if not need.any():
            return ids, mask, rec_lens
        at = ends[need]
        ids = np.insert(ids, at, np.int32(self.eos_id))
        mask = np.insert(mask, at, mask[at - 1])
        return ids, mask, rec_lens + need

    def _repeat(self, batch: _rows.ExampleBatch, datasets: list[int]) -> tuple[_rows.ExampleBatch, int]:
        """Data sets with an integer weight above 1: every example again, with ids ``<id>~2``, ``<id>~3``, ..."""
        times = [int(self.datasets[d].weight) if self.datasets[d].weight > 1 else 1 for d in datasets]
        if all(t == 1 for t in times):
            return batch, 0
        parts = [batch]
        for copy in range(2, max(times) + 1):
            which = [i for i, t in enumerate(times) if t >= copy]
            parts.append(batch.take(which, suffix=f"~{copy}"))
        return _rows.ExampleBatch.concat(parts), sum(times) - len(times)


def _splice(ids, mask, rec_lens, direct: dict[int, np.ndarray]):
    """Insert pre-tokenized examples (index -> (2, n) array) into the rendered ones' flat arrays."""
    n = len(rec_lens)
    parts_ids, parts_mask = [], []
    ends = np.cumsum(rec_lens)
    start = 0
    for i in range(n):
        if i in direct:
            parts_ids.append(direct[i][0].astype(np.int32))
            parts_mask.append(direct[i][1].astype(np.uint8))
            rec_lens[i] = direct[i].shape[1]
        else:
            parts_ids.append(ids[start:ends[i]])
            parts_mask.append(mask[start:ends[i]])
            start = ends[i]
    return (np.concatenate(parts_ids) if parts_ids else ids, np.concatenate(parts_mask) if parts_mask else mask,
            rec_lens)


_END_WORDS = ("end", "eot", "eos", "eom", "</s>", "stop")


def _foreign_ends(backend, eos_id: Optional[int]) -> dict[int, str]:
    """Special tokens of the tokenizer that no sequence of its own ends with: neither its EOS nor an end marker
    (``<|im_end|>``, ``<|eot_id|>``, ``<|endoftext|>``): padding, placeholders, BOS. Pre-tokenized ids ending with
    one were made with another tokenizer (LLaMA-2's EOS 2 is deepseek's pad)."""
    try:
        added = backend.get_added_tokens_decoder()
    except AttributeError:  # not a tokenizers.Tokenizer: nothing to tell
        return {}
    return {i: t.content for i, t in added.items()
            if t.special and i != eos_id and not any(w in t.content.lower() for w in _END_WORDS)}
