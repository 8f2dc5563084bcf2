"""The encode stage: a chunk of raw records -> encoded examples plus typed rejections.

Every path that turns records into tokens calls :meth:`Encoder.encode`: the Beam job, ``estimate``,
``verify --inputs``, ``preview`` and the benchmarks. One chunk goes through::

    [(dataset, source, position, record | Rejected), ...]
       | normalize  per record (pipeline._formats)   -> Conversation, or Rejected
       | render     per record (pipeline._render)    -> segments [(text, is_target), ...]
       | tokenize   ONE encode_batch_fast call over every segment of the chunk (Rust, threads)
       | masks      numpy: each segment's flag repeated over its token count; EOS appended
       | images     --processor only: each image's one placeholder token repeated to the processor's count
       |            for the image's size (pipeline._media), never a target; the images ride in batch.images
       |            (--images embed: each local file read once, its bytes sized and carried)
       v
    Encoded(batch: ExampleBatch, rejected: [dead letters], counts: {counter: n})

With ``--pairs`` (:meth:`Encoder.prepare_pair`) a record is a preference pair: it is normalized twice
(``--preference chosen``, then ``rejected``), the messages both sides begin with are the prompt and
the rest is each side's answer; each side is rendered and tokenized, its completion (everything after
the prompt, EOS included) is the target, and the pair becomes ONE example (chosen tokens, then
rejected) whose two prompts must be the same tokens, else ``pair_prompt_mismatch``::

    chosen    [ <prompt> | <completion c> <eos> ]     mask [ 0 ... 0 | 1 ... 1 ]
    rejected  [ <prompt> | <completion r> <eos> ]     the same <prompt> tokens
    example   chosen ++ rejected, cut = len(chosen)   (pipeline._rows.ExampleBatch.cuts)

Nothing leaves silently: a record becomes an example (or several, when its data set repeats or it is a
message tree with several kept paths),
a dead letter with a :class:`~pipeline._formats.Reason`, or a ``not_sampled`` count (a data set
sampled below weight 1). ``counts`` also carries what normalization did to the records that
were kept (turns trimmed, merged, dropped; fields ignored), summed into the manifest.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from packers import InternalError
from pipeline import _media, _rows
from pipeline._formats import ANSWER_IMAGE, Conversation, Reason, Rejected, conversations, pair_conversations
from pipeline._options import Eos, FormatOptions, Ids, PackOptions, TrainOn
from pipeline._render import Renderer, Split

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
    labels: list[int] = dataclasses.field(default_factory=list)
    """Per kept record (as ``meta``), its desirability: 1, 0, or -1 without a label (pipeline._formats._labels)."""
    pairs: bool = False
    """``--pairs``: ``owner`` names a side, ``2 * k`` (chosen) or ``2 * k + 1`` (rejected) of ``meta[k]``."""
    images: dict[int, list[_media.Image]] = dataclasses.field(default_factory=dict)
    """``--processor`` runs: index in ``meta`` -> its example's images, measured, in order."""
    prompts: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    """TRL-format examples (:class:`~pipeline._render.Split`): ``(owner, prompt text)``, tokenized after the
    segments; the owner's tokens in common with its prompt's are context (TRL's ``common_prefix_length``)."""
    special: set[int] = dataclasses.field(default_factory=set)
    """Owners whose text (and prompt) is tokenized with the tokenizer's special tokens (raw text, as
    ``tokenizer(text)``)."""
    spans: dict[int, tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=dict)
    """Owners whose one segment is a whole ``messages`` conversation: its target character spans (tokenized with
    offsets; a token overlapping a span is a target)."""
    merged: set[int] = dataclasses.field(default_factory=set)
    """Pairs (index in ``meta``) whose prompt shares no token with a side: it merges with the answer's first tokens."""
    rejected: list[dict] = dataclasses.field(default_factory=list)
    counts: dict[str, int] = dataclasses.field(default_factory=dict)

    def add_split(self, split: Split, owner: int) -> None:
        """A TRL-format example (or side), owned by ``owner``: its whole text one target segment, its prompt
        tokenized beside it (:meth:`Encoder.finish` masks the tokens they share)."""
        self.add_segments([(split.whole, True)], owner)
        if split.prompt is not None:
            self.prompts.append((owner, split.prompt))
        if split.special:
            self.special.add(owner)
        if split.spans is not None:
            self.spans[owner] = split.spans

    def add_segments(self, segments: list[tuple[str, bool]], owner: int) -> None:
        """The ``(text, is_target)`` segments of one example (or side), owned by ``owner``."""
        self.texts.extend(t for t, _ in segments)
        self.flags.extend(y for _, y in segments)
        self.owner.extend(itertools.repeat(owner, len(segments)))

    def token_arrays(self, encs: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The segments' tokens (``encs``: one encoding per segment) as flat ids, their mask, and each segment's
        token count."""
        seg_lens = np.fromiter(map(len, encs), dtype=np.int64, count=len(encs))
        ids = np.fromiter(itertools.chain.from_iterable(e.ids for e in encs), dtype=np.int32, count=int(seg_lens.sum()))
        return ids, np.repeat(np.asarray(self.flags, dtype=np.uint8), seg_lens), seg_lens


def input_folders(files: Sequence[Any]) -> dict[str, str]:
    """Each input's folder by its source (``InputFile`` s): where its relative image paths resolve."""
    return {f.source: os.path.dirname(f.path) for f in files}


def add_counts(into: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v
    return into


class Encoder:
    """Normalize, render and tokenize chunks of records with one tokenizer (loaded once per process)."""

    def __init__(self, options: PackOptions, folders: Optional[Mapping[str, str]] = None):
        """``folders``: each input's folder by its source, where relative image paths resolve without
        ``--media-root`` (absent: the working folder)."""
        self.options = options
        self.datasets = options.datasets()
        self.renderer = Renderer(options)
        tok = self.renderer.tok
        self._backend = tok.backend_tokenizer
        self.eos_id: Optional[int] = tok.eos_token_id
        self.vocab_size = len(tok)
        self._foreign_ends = _foreign_ends(self._backend, self.eos_id)
        self.vision = options.vision()
        self.image_text: Optional[str] = None
        self.video_text: Optional[str] = None
        self.video_id = -1
        if self.vision is not None:
            from pipeline._tokenizer import vision_token_ids

            self.vision_ids = vision_token_ids(tok, self.vision, options.tokenizer)  # each once per image
            self.image_id = self.vision_ids["image_token"]
            v = self.vision
            self.image_text = v.placeholder  # Gemma 3: <start_of_image>, expanded as its processor does (tokenize)
            if v.videos:
                self.video_text = v.video_placeholder
                self.video_id = self.vision_ids["video_token"]
        self._folders = dict(folders or {})
        self._roots: dict[str, _media.MediaRoot] = {}

    def _media_root(self, source: str) -> _media.MediaRoot:
        """The folder the images of ``source`` resolve against and must lie under: --media-root, else the input's
        folder (:func:`pipeline._media.media_root`)."""
        root = self._roots.get(source)
        if root is None:
            root = self._roots[source] = _media.media_root(self.options.media_root, self._folders.get(source))
        return root

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
        p = _Prepared(pairs=self.options.pairs)
        for dataset, source, position, record in chunk:
            eid = None
            try:
                if isinstance(record, Rejected):
                    raise record
                fmt = self.datasets[dataset].format
                eid = _rows.example_id(source, position, record, fmt.ids is not Ids.POSITION)
                if not self._sampled(dataset, eid):
                    p.counts["not_sampled"] = p.counts.get("not_sampled", 0) + 1
                    continue
                if p.pairs:
                    sides, notes, refs = self.prepare_pair(record, fmt)
                    if refs:  # the prompt's images, measured once, stand in both sides
                        images = _media.measure(refs, self._media_root(source), self.vision, self.options.images,
                                                notes)
                        p.images[2 * len(p.meta)] = p.images[2 * len(p.meta) + 1] = images
                    for k, side in enumerate(sides):
                        if isinstance(side, Split):  # TRL's layouts, as DPOTrainer tokenizes them
                            p.add_split(side, 2 * len(p.meta) + k)
                            p.no_eos.add(2 * len(p.meta) + k)
                        else:
                            p.add_segments(side, 2 * len(p.meta) + k)
                    add_counts(p.counts, notes)
                    p.meta.append((eid, source, position, dataset))
                    continue
                convs = conversations(record, fmt, self.image_text, self.video_text)
            except Rejected as r:
                p.rejected.append(_rows.reject_record(source, position, r.reason, r.detail, eid))
                continue
            if len(convs) > 1:  # a message tree: one example per kept path, ids <id>~p2, <id>~p3, ...
                p.counts["extra_paths"] = p.counts.get("extra_paths", 0) + len(convs) - 1
            for k, conv in enumerate(convs):
                ceid = eid if k == 0 else f"{eid}~p{k + 1}"
                try:
                    if conv.images:
                        p.images[len(p.meta)] = _media.measure(conv.images, self._media_root(source), self.vision,
                                                               self.options.images, conv.notes)
                    if conv.tokens is not None:
                        p.direct[len(p.meta)] = self._pretokenized(conv, dataset)
                    elif (split := self.renderer.split(conv, fmt)) is not None:  # TRL's formats, as TRL
                        p.add_split(split, len(p.meta))
                        p.no_eos.add(len(p.meta))
                    else:
                        segs = self.renderer.segments(conv, fmt)
                        if not self.renderer.appends_eos(conv, fmt):  # labelled segments, TRL's conversations
                            p.no_eos.add(len(p.meta))
                        p.add_segments(segs, len(p.meta))
                    add_counts(p.counts, conv.notes)
                except Rejected as r:
                    p.rejected.append(_rows.reject_record(source, position, r.reason, r.detail, ceid))
                    continue
                p.meta.append((ceid, source, position, dataset))
                p.labels.append(-1 if conv.desirable is None else int(conv.desirable))
        return p

    def prepare_pair(self, record: Any, fmt: FormatOptions) -> tuple[tuple[list, list], dict[str, int], list]:
        """One preference record -> the segments of its chosen and rejected sides (prompt: context; the answer and
        everything after it: target), its normalization notes (counted once) and its prompt's image references
        (``--processor``: both sides hold them; an image in an answer is refused); or :class:`Rejected`."""
        convs = pair_conversations(record, fmt, self.image_text)
        c, r = convs
        if c.tools != r.tools:
            raise Rejected(Reason.PAIR_PROMPT_MISMATCH, "the two sides carry different tool definitions; a pair shares "
                                                        "its prompt")
        notes = {k: max(c.notes.get(k, 0), r.notes.get(k, 0)) for k in c.notes.keys() | r.notes.keys()
                 if k != "other_side_not_trained"}
        trl = self._trl_pair(c, r, fmt)
        if trl is not None:
            return trl, notes, list(c.images)
        n = 0
        while n < min(len(c.messages), len(r.messages)) and c.messages[n] == r.messages[n]:
            n += 1
        n = min(n, len(c.messages) - 1, len(r.messages) - 1)  # identical sides: the last turn is the answer
        roles = [conv.messages[n]["role"] if n >= 0 else None for conv in convs]
        if n < 0 or roles != ["assistant", "assistant"]:
            at = (f"at messages[{n}], a {roles[0]} turn" if roles[0] == roles[1] else
                  f"at messages[{n}], a {roles[0]} turn on the chosen side and a {roles[1]} turn on the rejected side")
            raise Rejected(Reason.PAIR_PROMPT_MISMATCH, (
                f"the two sides differ before their answers ({at}); a pair is one prompt (the same messages on both "
                "sides), then two assistant answers"))
        _pair_images(c, r, n, self.image_text)
        sides = []
        train = dataclasses.replace(fmt, train_on=TrainOn.ASSISTANT, mask_reasoning=False)
        for conv in convs:
            conv.train = [False] * n + [True] * (len(conv.messages) - n)
            segs = self.renderer.segments(conv, train)
            first = next((i for i, (_, target) in enumerate(segs) if target), None)
            if first is None:
                raise Rejected(Reason.NO_TARGET_TOKENS, "an answer of the pair renders to no text")
            if first == 0:
                raise Rejected(Reason.TEMPLATE_ERROR, "the prompt renders to no text, so nothing comes before the "
                                                      "answer's first token to predict it; use a chat template that "
                                                      "writes the assistant header (the built-in ChatML does)")
            # The completion is everything after the prompt: tool results between answer turns included (TRL's
            # prompt/completion split), so a side's log-prob covers all it adds to the prompt.
            sides.append([(t, i >= first) for i, (t, _) in enumerate(segs)])
        return (sides[0], sides[1]), notes, list(c.images)

    def _trl_pair(self, c: Conversation, r: Conversation, fmt: FormatOptions) -> Optional[tuple[Split, Split]]:
        """A pair in TRL's layouts (an explicit ``prompt``, or whole conversations sharing their first turns), as
        ``DPOTrainer`` tokenizes it: each side's whole text and the one prompt (:meth:`Renderer.split`); None for
        the other layouts (and under ``--eos always`` or ``--mask-reasoning``)."""
        if c.raw is not None and r.raw is not None:
            if c.raw[0] != r.raw[0]:
                raise InternalError("the two sides of a raw preference record hold different prompts")
        elif not c.prompt or not r.prompt or fmt.eos is not Eos.TRL or fmt.mask_reasoning:
            return None  # no shared prompt at all: the general path refuses it (the sides differ before their answers)
        elif c.prompt != r.prompt or c.messages[:c.prompt] != r.messages[:r.prompt]:
            raise Rejected(Reason.PAIR_PROMPT_MISMATCH, "the two sides' prompts differ after reading; a pair shares its "
                                                        "prompt")
        if c.images or r.images:
            _pair_images(c, r, c.prompt or 0, self.image_text)
        sides = tuple(self.renderer.split(conv, fmt) for conv in (c, r))
        if sides[0].prompt != sides[1].prompt:
            raise Rejected(Reason.PAIR_PROMPT_MISMATCH, "the chat template renders the pair's prompt differently on "
                                                        "its two sides; a pair shares its prompt")
        return sides

    def tokenize(self, p: "_Prepared") -> list:
        """The Rust half: one batch call over every segment (releases the GIL, uses the tokenizer's threads), then
        the prompts of TRL-format examples after them; raw text (``p.special``) in a call with special tokens."""
        texts = p.texts if self.vision is None else [self.vision.expand(t) for t in p.texts]
        if self.video_text is not None and any(m.text for ms in p.images.values() for m in ms):
            texts = self._timestamped(texts, p)
        prompts = [text if self.vision is None else self.vision.expand(text) for _, text in p.prompts]
        texts = texts + prompts
        owners = p.owner + [owner for owner, _ in p.prompts]
        if not p.special and not p.spans:
            return self._backend.encode_batch_fast(texts, add_special_tokens=False) if texts else []
        out: list = [None] * len(texts)
        for special in (False, True):
            for offsets in (False, True):  # whole conversations: with character offsets (slower: only those)
                which = [i for i, owner in enumerate(owners)
                         if (owner in p.special) is special and (i < len(p.texts) and owner in p.spans) is offsets]
                if which:
                    encode = self._backend.encode_batch if offsets else self._backend.encode_batch_fast
                    for i, e in zip(which, encode([texts[i] for i in which], add_special_tokens=special)):
                        out[i] = e
        return out

    def _timestamped(self, texts: list[str], p: "_Prepared") -> list[str]:
        """Qwen3-VL: each video's placeholder text replaced, before tokenization, by what its processor writes for it
        (``Image.text``: a ``<t seconds>`` timestamp and one placeholder per temporal group), the videos taken in
        order through each example's (or side's) segments. A placeholder with no video left stays as written (the
        placeholder check refuses the example)."""
        out, left = list(texts), {}
        for k, (text, owner) in enumerate(zip(texts, p.owner)):
            if self.video_text in text:
                videos = [m.text or self.video_text for m in p.images.get(owner, ()) if m.video]
                it = left.setdefault(owner, iter(videos))
                out[k] = re.sub(re.escape(self.video_text), lambda _: next(it, self.video_text), text)
        return out

    def finish(self, p: "_Prepared", encs: list) -> Encoded:
        """Masks from segment lengths (numpy), the EOS, target checks, repeats."""
        if p.pairs:
            return self._finish_pairs(p, encs)
        rejected, counts, kept_meta, direct = p.rejected, p.counts, p.meta, p.direct
        n = len(kept_meta)
        encs, prompt_encs = encs[:len(p.texts)], encs[len(p.texts):]
        ids, mask, seg_lens = p.token_arrays(encs)
        rec_lens = np.bincount(np.asarray(p.owner, dtype=np.int64), weights=seg_lens, minlength=n).astype(np.int64)
        self._mask_prompts(ids, mask, rec_lens, p, prompt_encs)
        self._mask_spans(mask, rec_lens, p, encs)
        if direct:  # splice pre-tokenized examples in at their place
            ids, mask, rec_lens = _splice(ids, mask, rec_lens, direct)
        ids, mask, rec_lens = self._append_eos(ids, mask, rec_lens, set(direct) | p.no_eos)
        keep = np.ones(n, dtype=bool)
        images = None
        if self.vision is not None:
            ids, mask, rec_lens, images = self._expand_images(ids, mask, rec_lens, p, keep)

        starts = np.concatenate([[0], np.cumsum(rec_lens)[:-1]]).astype(np.int64) if n else np.zeros(0, np.int64)
        targets = np.add.reduceat(mask.astype(np.int64), starts) if n and len(mask) else np.zeros(n, np.int64)
        targets = np.where(rec_lens > 0, targets, 0)
        for i in np.flatnonzero((rec_lens == 0) & keep):
            eid, source, position, _ = kept_meta[i]
            rejected.append(_rows.reject_record(source, position, Reason.EMPTY_AFTER_RENDER,
                                                "the record renders to no tokens", eid))
            keep[i] = False
        for i in np.flatnonzero((rec_lens > 0) & (targets == 0) & keep):
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
        if len(p.labels) != n:
            raise InternalError(f"{len(p.labels)} desirability labels for {n} examples")
        labels = np.asarray(p.labels, dtype=np.int8)[keep]
        batch = _rows.ExampleBatch.from_arrays(
            [m[0] for m in kept_meta], [m[1] for m in kept_meta], [m[2] for m in kept_meta], rec_lens, ids, mask,
            desirable=labels if (labels != -1).any() else None,
        ).with_images(None if images is None else images.take(np.flatnonzero(keep)))
        batch, copies = self._repeat(batch, [m[3] for m in kept_meta])
        if copies:
            counts["repeated_copies"] = counts.get("repeated_copies", 0) + copies
        return Encoded(batch, rejected, counts)

    def _expand_images(self, ids, mask, rec_lens, p: "_Prepared", keep: np.ndarray, group: int = 1):
        """Each image's one placeholder token becomes its run of ``tokens`` placeholder tokens (never a target), so
        an example's length is what the model sees. An example whose placeholder tokens and images differ in number
        (text holding the placeholder's own text, a template that drops or repeats a turn) is ``placeholder_mismatch``
        (``keep`` cleared). Returns the new ids, mask and lengths, and the examples' :class:`~pipeline._rows.Images`.
        ``group``: sequences per record (2 for pairs: ``rec_lens`` are sides, ``p.meta[i // 2]`` their record; a
        side refused refuses its pair, once)."""
        n = len(rec_lens)
        ends = np.cumsum(rec_lens)
        self._check_placeholders(ids, ends, p, keep, group)
        want = np.array([len(p.images.get(i, ())) for i in range(n)], dtype=np.int64)
        pos = np.flatnonzero((ids == self.image_id) | (ids == self.video_id))
        owner = np.searchsorted(ends, pos, side="right")
        ok = keep[owner]
        rep = np.ones(len(ids), np.int64)
        kept = [img for i in range(n) if keep[i] for img in p.images.get(i, ())]
        units = [_units(img) for img in kept]  # placeholders per medium: a Qwen3-VL video's one per frame group
        if [img.video for img, u in zip(kept, units) for _ in range(u)] != (ids[pos[ok]] == self.video_id).tolist():
            raise InternalError("the image and video placeholder tokens stand in another order than the media")
        rep[pos[ok]] = np.asarray([img.tokens // u for img, u in zip(kept, units) for _ in range(u)], np.int64)
        new_at = np.cumsum(rep) - rep  # where each old token starts in the expanded arrays
        ids, mask = np.repeat(ids, rep), np.repeat(mask, rep)
        runs = _rows._ranges(new_at[pos[ok]], new_at[pos[ok]] + rep[pos[ok]])
        mask[runs] = 0  # an image is never a target
        rec_lens = rec_lens + np.bincount(owner[ok], weights=rep[pos[ok]] - 1, minlength=n).astype(np.int64)
        starts = np.cumsum(rec_lens) - rec_lens
        counts = np.where(keep, want, 0)
        index = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=index[1:])
        first = pos[ok][np.cumsum([0] + units[:-1]).astype(np.int64)] if kept else pos[ok]  # each medium's first
        images = _rows.Images(index, (new_at[first] - starts[np.searchsorted(ends, first, side="right")]).astype(
                              np.int64),
                              np.array([img.grid for img in kept], np.int32).reshape(-1, 3),
                              [(img.path, img.data) for img in kept], np.array([img.video for img in kept], bool),
                              np.array([img.seconds for img in kept], np.float32))
        return ids, mask, rec_lens, images

    def _check_placeholders(self, ids: np.ndarray, ends: np.ndarray, p: "_Prepared", keep: np.ndarray,
                            group: int) -> None:
        """Each example's placeholder tokens, one per image (``<|image_pad|>``), per video (``<|video_pad|>``) and
        per either (Qwen's start/end): an example whose counts differ is ``placeholder_mismatch`` (``keep`` cleared;
        a side refused refuses its pair, once)."""
        n = len(ends)
        media = [p.images.get(i, ()) for i in range(n)]
        videos = np.array([sum(_units(m) for m in ms if m.video) for ms in media], dtype=np.int64)
        total = np.array([sum(map(_units, ms)) for ms in media], dtype=np.int64)
        wants = {"image_token": total - videos, "video_token": videos}
        for what, token_id in self.vision_ids.items():
            want = wants.get(what, total)
            found = np.bincount(np.searchsorted(ends, np.flatnonzero(ids == token_id), side="right"), minlength=n)
            token = getattr(self.vision, what)
            kind = "videos" if what == "video_token" else "images" if what == "image_token" else "images and videos"
            for i in np.flatnonzero((found != want) & keep).tolist():
                if not keep[i]:  # its pair's other side was refused just now
                    continue
                eid, source, position, _ = p.meta[i // group]
                side = ("the chosen side" if i % 2 == 0 else "the rejected side") if group == 2 else "the example"
                p.rejected.append(_rows.reject_record(source, position, Reason.PLACEHOLDER_MISMATCH, (
                    f"{side} holds {found[i]} {token!r} tokens for {want[i]} {kind}: its text holds {token!r} "
                    "itself, or the chat template drops or repeats a turn with an image; remove the processor's tokens "
                    "from the text (images go in image parts or as <image>, videos as video parts or <video>)"), eid))
                keep[i - i % group:i - i % group + group] = False

    def _finish_pairs(self, p: "_Prepared", encs: list) -> Encoded:
        """:meth:`finish` for pairs: per side the EOS and the completion mask, then the prompt check, then one
        example per pair (chosen tokens, then rejected; ``cuts``)."""
        rejected, meta = p.rejected, p.meta
        n = len(meta)
        encs, prompt_encs = encs[:len(p.texts)], encs[len(p.texts):]
        ids, mask, seg_lens = p.token_arrays(encs)
        side_lens = np.bincount(np.asarray(p.owner, dtype=np.int64), weights=seg_lens, minlength=2 * n).astype(np.int64)
        self._mask_prompts(ids, mask, side_lens, p, prompt_encs, pairs=True)
        ids, mask, side_lens = self._append_eos(ids, mask, side_lens, p.no_eos)
        images = None
        if self.vision is not None:
            kept_sides = np.ones(2 * n, dtype=bool)
            ids, mask, side_lens, images = self._expand_images(ids, mask, side_lens, p, kept_sides, group=2)
            images = _pair_images_of(images, side_lens)
            keep = kept_sides[0::2].copy()
        else:
            keep = np.ones(n, dtype=bool)
        ends = np.cumsum(side_lens)
        starts = ends - side_lens
        for k in np.flatnonzero(keep).tolist():
            (a0, z0), (a1, z1) = (starts[2 * k], ends[2 * k]), (starts[2 * k + 1], ends[2 * k + 1])
            c_mask, r_mask = mask[a0:z0], mask[a1:z1]
            why = None
            if not c_mask.any() or not r_mask.any():
                why = (Reason.NO_TARGET_TOKENS, "an answer of the pair tokenizes to no tokens")
            elif k in p.merged:
                why = (Reason.PAIR_PROMPT_MISMATCH, (
                    f"the prompt's tokens merge with an answer's first tokens ({self._decode(ids[a0:a0 + 4])!r} vs "
                    f"{self._decode(ids[a1:a1 + 4])!r}), so the two sides share no prompt token; end the prompt on "
                    "a token boundary (raw answers usually start with a space), or pass --strings chat"))
            else:
                pc, pr = int(c_mask.argmax()), int(r_mask.argmax())
                cp, rp = ids[a0:a0 + pc], ids[a1:a1 + pr]
                if pc != pr or not np.array_equal(cp, rp):
                    at = next((i for i in range(min(pc, pr)) if cp[i] != rp[i]), min(pc, pr))
                    why = (Reason.PAIR_PROMPT_MISMATCH, (
                        f"the two sides' prompts tokenize differently ({pc} vs {pr} tokens, first difference at token "
                        f"{at}: {self._decode(cp[at:at + 8])!r} vs {self._decode(rp[at:at + 8])!r}); the chat template "
                        "renders the prompt differently depending on the answer, so the sides cannot share a prompt"))
            if why is not None:
                eid, source, position, _ = meta[k]
                rejected.append(_rows.reject_record(source, position, why[0], why[1], eid))
                keep[k] = False
        if not keep.all():
            token_keep = np.repeat(np.repeat(keep, 2), side_lens)
            ids, mask, side_lens = ids[token_keep], mask[token_keep], side_lens[np.repeat(keep, 2)]
            meta = [m for m, k in zip(meta, keep) if k]
        pair = side_lens.reshape(-1, 2)
        batch = _rows.ExampleBatch.from_arrays([m[0] for m in meta], [m[1] for m in meta], [m[2] for m in meta],
                                               pair.sum(axis=1), ids, mask, cuts=pair[:, 0]
                                               ).with_images(None if images is None else
                                                             images.take(np.flatnonzero(keep)))
        batch, copies = self._repeat(batch, [m[3] for m in meta])
        if copies:
            p.counts["repeated_copies"] = p.counts.get("repeated_copies", 0) + copies
        return Encoded(batch, rejected, p.counts)

    def _mask_prompts(self, ids: np.ndarray, mask: np.ndarray, lens: np.ndarray, p: "_Prepared", encs: list,
                      pairs: bool = False) -> None:
        """TRL's completion mask of each TRL-format example (``p.prompts``; ``lens``: tokens per owner, in owner
        order): its tokens in common with its prompt's tokens are context, the rest is the completion
        (``trl.data_utils.common_prefix_length``; a pair's two sides share the shorter common prefix, as
        ``DPOTrainer`` takes it). A prompt whose tokens are not all a prefix of the whole is counted
        (``prompt_not_prefix``), as TRL warns. ``--train-on all`` trains every token all the same."""
        if not p.prompts:
            return
        starts = np.cumsum(lens) - lens
        common: dict[int, tuple[int, bool]] = {}
        for (owner, _), enc in zip(p.prompts, encs):
            a = int(starts[owner])
            whole = ids[a:a + int(lens[owner])]
            prompt = np.asarray(enc.ids, dtype=np.int32)
            k = min(len(prompt), len(whole))
            differ = np.flatnonzero(whole[:k] != prompt[:k])
            common[owner] = (int(differ[0]) if len(differ) else k, len(differ) > 0 or k < len(prompt))
        if pairs:  # both sides of a pair start their completion at the shorter common prefix
            for owner in list(common):
                other = owner ^ 1
                if other in common:
                    common[owner] = (min(common[owner][0], common[other][0]), common[owner][1] or common[other][1])
        short = 0
        for owner, (length, cut) in common.items():
            if self._train_all(p, owner, pairs):
                continue
            a = int(starts[owner])
            # at least the first token is context: nothing comes before it to predict it, so training is the same
            # (TRL's labels shift it out), and the row contract's completions start after a prompt token
            mask[a:a + max(length, 1)] = 0
            short += cut and not (pairs and owner % 2)  # a pair is counted once
            if pairs and not length:
                p.merged.add(owner // 2)
        if short:
            p.counts["prompt_not_prefix"] = p.counts.get("prompt_not_prefix", 0) + short

    @staticmethod
    def _mask_spans(mask: np.ndarray, lens: np.ndarray, p: "_Prepared", encs: list) -> None:
        """The mask of each whole ``messages`` conversation (``p.spans``): 1 on every token that overlaps a target
        character span, as transformers' ``assistant_masks`` (each such owner holds one segment, ``encs[k]``)."""
        if not p.spans:
            return
        starts = np.cumsum(lens) - lens
        for k, owner in enumerate(p.owner):
            spans = p.spans.get(owner)
            if spans is None:
                continue
            enc, at = encs[k], int(starts[owner])
            hit = np.zeros(len(enc.ids), dtype=bool)
            for a, b in spans:  # the tokens holding the span's first and last characters, and those between
                first, last = enc.char_to_token(a), enc.char_to_token(b - 1)
                if first is None or last is None:  # a character no token holds: every token's offsets, then
                    offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
                    hit |= (offsets[:, 1] > a) & (offsets[:, 0] < b)
                else:
                    hit[first:last + 1] = True
            mask[at:at + len(hit)] = hit

    def _train_all(self, p: "_Prepared", owner: int, pairs: bool) -> bool:
        """``--train-on all`` for the data set of ``owner`` (never for pairs: their prompt is context)."""
        return not pairs and self.datasets[p.meta[owner][3]].format.train_on is TrainOn.ALL

    def _decode(self, ids: np.ndarray) -> str:
        return self.renderer.tok.decode(ids.tolist())

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


def _units(img: _media.Image) -> int:
    """The placeholders a medium's text holds: one per temporal group for a Qwen3-VL video (its timestamped
    ``Image.text``), else one."""
    return int(img.grid[0]) if img.text else 1


def _pair_images_of(sides: _rows.Images, side_lens: np.ndarray) -> _rows.Images:
    """The images of each side (``sides``: per side, offsets from the side's start) as the images of each pair: the
    chosen side's, then the rejected side's, their offsets from the pair's start (the rejected side starts after the
    chosen one)."""
    n = len(side_lens) // 2
    owner = np.repeat(np.arange(2 * n), sides.counts)
    shift = np.where(owner % 2 == 1, side_lens[owner - 1], 0) if len(owner) else np.zeros(0, np.int64)
    return _rows.Images(sides.index[0::2].copy(), sides.offsets + shift, sides.grids, sides.refs)


def _pair_images(c: Conversation, r: Conversation, n: int, image_text: Optional[str]) -> None:
    """A pair's images stand in its shared prompt (its first ``n`` messages), the same on both sides: an image in
    an answer, or sides whose prompts name other images, is :class:`Rejected`."""
    if not c.images and not r.images:
        return
    for side, conv in (("chosen", c), ("rejected", r)):
        if any(image_text in str(m.get("content")) for m in conv.messages[n:]):
            raise Rejected(Reason.NON_TEXT_CONTENT, ANSWER_IMAGE.format(side=side))
    if c.images != r.images:
        raise Rejected(Reason.PAIR_PROMPT_MISMATCH, f"the two sides' prompts hold different images ({len(c.images)} "
                                                    f"and {len(r.images)}, or other files); a pair shares its prompt")


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
