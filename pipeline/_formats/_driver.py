"""The driver: one record -> its conversations. The only place that runs the steps every shape shares.

::

    detect -> shape.read -> drafts            (pipeline._formats.detect, one module per shape)
      each draft of turns:  system column -> inline reasoning -> hygiene -> messages -> tools column
      the record:           ignored top-level keys, fields beside followed paths (counted once)
      each conversation:    renderable

A refusal that carries a fix (options, as data) is checked: its values are shown only when they read the
record whole (:func:`_validated`).

A record yields one conversation, or several (one per kept path of a message tree): the record's
own notes (ignored fields) are counted once, on its first conversation; each conversation carries
the notes of its own hygiene.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, Optional, Sequence

from packers import InternalError, PackstreamError
from pipeline._formats._base import (TRL_CONVERSATIONS, Conversation, Ctx, Draft, Reason, Rejected, Shape, Turn, _blank,
                                     _kind, text_size)
from pipeline._formats._fix import under
from pipeline._formats._labels import labelled
from pipeline._formats.fields import marked_roles
from pipeline._formats._images import (IMAGE_COLUMNS, NOT_YET, VIDEO_COLUMNS, column_images, column_videos,
                                       image_tags_as_videos, place_column, refuse_private_use, take_images)
from pipeline._formats._hygiene import _hygiene, _inline_reasoning, _no_assistant, _renderable
from pipeline._formats._paths import resolve, unused_beside_paths
from pipeline._formats._turns import MEDIA_KEYS, _system_column, _tools
from pipeline._formats.detect import ORDER, REGISTRY, detect
from pipeline._options import Format, FormatOptions, LeadingAssistant, SameRole, Strings, Turns


def conversations(record: Any, options: FormatOptions, image_text: Optional[str] = None,
                  video_text: Optional[str] = None) -> list[Conversation]:
    """Every conversation one raw record holds (one, except message trees), or :class:`Rejected`. ``image_text``
    (``--processor`` runs): the text each image becomes; its references are the conversation's ``images``
    (:mod:`pipeline._formats._images`). Without it, records with images are refused. ``video_text`` (``--video-fps``
    runs): the same for videos (their references wrapped as ``Video`` among ``images``); without it, refused."""
    fast = _fast(record, options) if image_text is None else None
    if fast is not None:
        convs = [fast]
    else:
        try:
            convs = _conversations(record, options, image_text, video_text)
        except Rejected as r:
            raise _validated(r, record, options) from None
    labelled(record, options, convs)
    _transcript_as_text(options, convs)
    return convs


def normalize(record: Any, options: FormatOptions) -> Conversation:
    """Turn one raw record into a :class:`Conversation`, or raise :class:`Rejected` (see the package docstring).
    For a record that may hold several conversations (``--tree``), use :func:`conversations`."""
    fast = _fast(record, options)
    conv = fast if fast is not None else _normalize(record, options)
    labelled(record, options, [conv])
    _transcript_as_text(options, [conv])
    return conv


PAIRS_REFUSE_VIDEOS = "preference pairs (--pairs) are packed with images only, never videos"


def pair_conversations(record: Any, options: FormatOptions,
                       image_text: Optional[str] = None) -> tuple[Conversation, Conversation]:
    """A preference record read as a pair (``packstream pack --pairs``): its chosen and its rejected conversation,
    each the prompt then that answer, through the steps every shape shares; or :class:`Rejected`.

    The record is read as the ``preference`` shape whenever it holds a pair, whatever detection would pick
    first: UltraFeedback (binarized) carries a ``messages`` copy of the chosen side beside ``chosen``/
    ``rejected``, which detection reads as SFT messages; here that copy is an ignored field, counted.
    A record that holds no pair is ``not_a_pair``. ``image_text`` (``--processor`` runs): as for
    :func:`conversations`; each side then carries the images of its prompt (the record's image column or parts).
    """
    from pipeline._formats import preference
    from pipeline._options import Preference

    ignored: list[str] = []
    mapping: list[str] = []
    if options.maps_pairs():  # --pair-sides/--pair-winner/--pair-ranked/--pair-prompt: the record as a layout
        mapped = preference.mapped_pair(record, options)
        record, ignored, mapping = mapped.record, mapped.ignored, mapped.mapping
        # not TRL's own layout (its fields are named by options): its strings are turns of the chat template
        options = dataclasses.replace(options, strings=Strings.CHAT)
    if not isinstance(record, dict) or preference.layout(record) is None:
        try:
            shape = detect(record, options) if isinstance(record, dict) else f"a JSON {_kind(record)}"
        except Rejected:
            shape = "no known shape"
        raise Rejected(Reason.NOT_A_PAIR, f"--pairs packs preference pairs (chosen/rejected, OpenAI's preferred_output/"
                                          f"non_preferred_output; see docs/formats.md), and this record reads as "
                                          f"{shape}; pack it without --pairs")
    shape = REGISTRY[preference.SHAPE.name]
    try:
        chosen, rejected = (read_as(shape, record, dataclasses.replace(options, preference=side), ignored=ignored,
                                    mapping=mapping, image_text=image_text)
                            for side in (Preference.CHOSEN, Preference.REJECTED))
    except Rejected as r:  # a video: pairs never pack one, whatever --video-fps says
        side = _answer_image(record, options, image_text) if r.reason is Reason.PLACEHOLDER_MISMATCH else None
        if side is not None:  # an image column whose placeholders stand in an answer: that is the cause, not the count
            raise Rejected(Reason.NON_TEXT_CONTENT, ANSWER_IMAGE.format(side=side)) from None
        if r.reason is not Reason.NON_TEXT_CONTENT or NOT_YET not in r.detail:
            raise
        raise Rejected(r.reason, r.detail.replace(NOT_YET, PAIRS_REFUSE_VIDEOS)) from None
    if len(chosen) != 1 or len(rejected) != 1:
        raise InternalError(f"the preference shape read {len(chosen)} and {len(rejected)} conversations, not one each")
    return chosen[0], rejected[0]


ANSWER_IMAGE = "the {side} answer holds an image; pairs are packed with images in their shared prompt only: move the image to the prompt"
"""The refusal of a pair with an image in an answer (``non_text_content``), wherever the image stands."""


def _answer_image(record: Any, options: FormatOptions, image_text: Optional[str]) -> Optional[str]:
    """The side ("chosen", "rejected") whose answer turns hold an image placeholder or image part, or None."""
    from pipeline._formats import preference
    from pipeline._formats._images import _placeholders

    if image_text is None or not isinstance(record, dict):
        return None
    ctx = Ctx(options, image_text)
    try:
        pair = preference.preference_turns(record, options, ctx)
    except (Rejected, PackstreamError):
        return None
    pattern = _placeholders(ctx)
    return next((side for side, turns in (("chosen", pair.chosen), ("rejected", pair.rejected))
                 if any(pattern.search(str(t.content)) for t in turns)), None)


def _normalize(record: Any, options: FormatOptions) -> Conversation:
    """The general path of :func:`normalize`: every shape and option."""
    try:
        convs = _conversations(record, options)
    except Rejected as r:
        raise _validated(r, record, options) from None
    if len(convs) != 1:
        raise InternalError(f"normalize() got a record that holds {len(convs)} conversations; callers that read "
                            "message trees use conversations()")
    return convs[0]


_FAST = tuple(s.fast for s in ORDER if s.fast is not None)


def _fast(record: Any, o: FormatOptions) -> Optional[Conversation]:
    """The direct path of the clean shapes most SFT data comes in (about 4x faster than the general path,
    which is the per-record Python the encode stage runs beside the tokenizer), under options that read a
    clean record as it stands. None: take the general path."""
    if type(record) is not dict or not _plain(o):
        return None
    for fast in _FAST:
        conv = fast(record)
        if conv is not None:
            return _renderable(conv)
    return None


@functools.lru_cache(maxsize=64)
def _plain(o: FormatOptions) -> bool:
    """Options under which a clean record reads as it stands (no mapping, aliases, keys or added turns)."""
    return (o.format is Format.AUTO and not o.fields and o.messages_field is None and not o.roles
            and o.role_key is None and o.content_key is None and o.system_prompt is None and o.tree is None)


def _conversations(record: Any, options: FormatOptions, image_text: Optional[str] = None,
                   video_text: Optional[str] = None) -> list[Conversation]:
    return read_as(REGISTRY[detect(record, options)], record, options, image_text=image_text, video_text=video_text)


def read_as(shape: Shape, record: dict, options: FormatOptions, ignored: Sequence[str] = (),
            mapping: Sequence[str] = (), image_text: Optional[str] = None,
            video_text: Optional[str] = None) -> list[Conversation]:
    """``record`` read as ``shape`` (detection done), through the steps every shape shares. ``ignored``: fields
    counted as not read beside the record's own (a record rewritten by options); ``mapping``: how it was;
    ``image_text``: see :func:`conversations`."""
    ctx = Ctx(options, image_text, video_text)
    ctx.mapping.extend(mapping)
    for key in ignored:
        ctx.ignore(key)
    used = shape.top_keys(record, options)
    column: tuple[Optional[str], list] = (None, [])
    if image_text is not None:
        refuse_private_use(record)
        column = column_images(record, ctx)
        videos = column_videos(record, ctx)
        used = used | set(IMAGE_COLUMNS) | (set(VIDEO_COLUMNS) if video_text is not None else set())
    elif not used.isdisjoint(MEDIA_KEYS) or not record.keys().isdisjoint(MEDIA_KEYS):
        _media_check(record, skip=tuple(used))
    drafts = shape.read(record, ctx)
    if not drafts:
        raise InternalError(f"shape {shape.name!r} read no draft and raised nothing")
    if image_text is not None:
        if video_text is not None:
            image_tags_as_videos(drafts, column[1], videos[1], ctx)
        place_column(drafts, *column, ctx)
        if video_text is not None:
            place_column(drafts, *videos, ctx, video=True)
    convs = [_conversation(record, shape, d, ctx if len(drafts) == 1 else ctx.fork()) for d in drafts]
    for key in record:  # the record's own notes: once, on its first conversation
        if key not in used:
            ctx.ignore(key)
    _tool_calls_as_text(record, options, ctx)
    if shape.follows is not None:
        unused_beside_paths(record, shape.follows(options), ctx)
    if len(drafts) > 1:
        first = convs[0]
        for k, v in ctx.notes.items():
            if k.startswith("ignored_field:"):
                first.notes.setdefault(k, v)
            else:
                first.notes[k] = first.notes.get(k, 0) + v
    return [_renderable(c) for c in convs]


TRANSCRIPT_NOTE = "transcript_as_text:"
"""A note per plain-text field whose text is a transcript of speaker turns: ``transcript_as_text:<field>``."""


def _transcript_as_text(options: FormatOptions, convs: Sequence[Conversation]) -> None:
    """Plain text (every token trained) that holds "Human: ... Assistant: ..." turns trains the human turns too,
    while ``--field X=transcript`` would train the assistant turns only: say so, once per record.

    >>> convs = [Conversation(text="Human: Hi there.\\n\\nAssistant: Hello! How can I help?")]
    >>> _transcript_as_text(FormatOptions(), convs); convs[0].notes
    {'transcript_as_text:text': 1}
    """
    text = convs[0].text if convs else None
    if text is None or not {"user", "assistant"} <= marked_roles(text):
        return
    field = next((path for path, role in options.fields if role == "text"), "text")
    convs[0].notes[f"{TRANSCRIPT_NOTE}{field}"] = 1


TOOL_TEXT_NOTE = "tool_calls_as_text:"
"""A note per field mapped to a text role whose value is a JSON list of tool calls: ``tool_calls_as_text:<field>``."""


def _tool_calls_as_text(record: dict, options: FormatOptions, ctx: Ctx) -> None:
    """A field mapped to a text role (``--field calls=assistant``) that holds tool calls as JSON text is trained as
    raw JSON, while ``--field calls=tool_calls`` would render them as calls: say so, once per record and field."""
    for path, role in options.fields:
        if role not in ("assistant", "user", "system"):
            continue
        value = resolve(record, path)
        if isinstance(value, str) and looks_like_tool_calls(value):
            ctx.note(f"{TOOL_TEXT_NOTE}{path}")


def looks_like_tool_calls(text: str) -> bool:
    """Does ``text`` parse as JSON tool calls: a non-empty list of (or one) ``{name, arguments|parameters}`` or
    ``{function: {name, ...}}`` objects?

    >>> looks_like_tool_calls('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    True
    >>> looks_like_tool_calls('The answer is [1, 2].'), looks_like_tool_calls('[{"name": "x"}]')
    (False, False)
    """
    text = text.strip()
    if not text.startswith(("[", "{")):
        return False
    try:
        value = json.loads(text)
    except ValueError:
        return False
    calls = value if isinstance(value, list) else [value]

    def call(c: Any) -> bool:
        fn = c.get("function") if isinstance(c, dict) and isinstance(c.get("function"), dict) else c
        return isinstance(fn, dict) and isinstance(fn.get("name"), str) and ("arguments" in fn or "parameters" in fn)

    return bool(calls) and all(call(c) for c in calls)


def as_written(shape: str, o: FormatOptions) -> bool:
    """Whether a record of ``shape`` keeps its turns as written (``--turns written``, TRL's conversational shapes),
    rather than packstream's hygiene. ``--leading-assistant keep|reject`` and ``--same-role reject`` are hygiene the
    user asked for by name: they take it."""
    return shape in TRL_CONVERSATIONS and _written(o)


def _written(o: FormatOptions) -> bool:
    return o.turns is Turns.WRITTEN and o.leading_assistant is LeadingAssistant.DROP and o.same_role is SameRole.MERGE


def _as_written(turns: list, completion: Optional[int], ctx: Ctx) -> list:
    """The turns of a TRL record as TRL renders them: a prompt/completion record's (the last ``completion`` of them
    its completion), or a ``messages`` conversation's (``completion`` None: every turn). No hygiene (no turn dropped,
    merged or trimmed; an empty completion is trained as the template writes it), reasoning left in the text as
    written. Only what the user asked for applies: ``--system-prompt`` before a prompt without a system turn, and
    with ``--mask-reasoning`` the trained turns' inline ``<think>`` blocks become their reasoning (so that they can
    be masked). A conversation without an assistant turn has nothing to train."""
    if not turns:
        raise Rejected(Reason.EMPTY_CONVERSATION, "the conversation has no turns" if completion is None else
                       "the prompt and the completion are both empty lists")
    ctx.turns_read = turns
    turns = list(turns)
    if ctx.o.system_prompt is not None and turns[0].role != "system":
        turns.insert(0, Turn("system", ctx.o.system_prompt, "--system-prompt"))
        ctx.mapping.append("--system-prompt -> system")
    if ctx.o.mask_reasoning:
        _inline_reasoning(turns if completion is None else turns[len(turns) - completion:])
    if completion is None and not any(t.role == "assistant" for t in turns):
        raise _no_assistant(ctx)
    return turns


def _conversation(record: dict, shape: Shape, draft: Draft, ctx: Ctx) -> Conversation:
    conv = Conversation(shape=shape.name)
    if draft.turns is None:  # text, segments, tokens: the columns a conversation would read are not read
        for key in shape.common:
            if not _blank(record.get(key)):
                ctx.ignore(key)
    if draft.tokens is not None:
        conv.tokens = draft.tokens
    elif draft.segments is not None:
        conv.segments = draft.segments
    elif draft.text is not None:
        conv.text = draft.text
    elif draft.raw is not None:
        conv.raw = draft.raw
    else:
        turns = draft.turns
        completion = turns[draft.prompt:] if draft.prompt is not None else ()
        if "system" in shape.common:
            _system_column(record, turns, ctx)
        if draft.prompt is not None:  # TRL's prompt/completion: the prompt is context whatever its roles
            prompt = len(turns) - len(completion)
            for i, t in enumerate(turns):  # the completion is trained whole
                t.train = i >= prompt
            if _written(ctx.o):  # the turns as the record writes them, as TRL renders them
                turns = _as_written(turns, len(completion), ctx)
            else:  # --turns cleaned: hygiene, the flags kept (a prompt turn is never merged into the completion)
                _inline_reasoning(turns)
                turns = _hygiene(turns, ctx)
            conv.prompt = next((i for i, t in enumerate(turns) if t.train), len(turns))
        elif as_written(shape.name, ctx.o):  # TRL's messages: the turns as TRL renders them
            turns = _as_written(turns, None, ctx)
        else:
            _inline_reasoning(turns)
            turns = _hygiene(turns, ctx)
        conv.messages = [t.message() for t in turns]
        flags = [t.train for t in turns]
        if any(t.reasoning or t.tool_calls or t.train is not None for t in turns):
            for what, n in (("reasoning", sum(bool(t.reasoning) for t in turns)),
                            ("tool calls", sum(len(t.tool_calls or ()) for t in turns)),
                            ("per-turn train flags", sum(f is not None for f in flags))):
                if n:
                    ctx.mapping.append(f"{what}: {n}")
            conv.train = flags if any(f is not None for f in flags) else None
        if draft.tools is not None:  # definitions the shape found elsewhere (OpenAI DPO: input.tools)
            conv.tools = _tools(draft.tools, ctx)
        else:
            conv.tools = _tools(record.get("tools"), ctx) if "tools" in shape.common else None
    take_images(conv, ctx)
    conv.notes = ctx.notes
    conv.mapping = tuple(ctx.mapping)
    return conv


# ------------------------------------------------------------------------------------------------
# Media beside the text.


def _media_check(record: dict, skip: Sequence[str] = ()) -> None:
    """LLaVA / LLaMA-Factory multimodal records: media files beside the text (``images``, ``image``, ...)."""
    for key in MEDIA_KEYS:
        if key in skip or key not in record:
            continue
        v = record[key]
        if v in (None, "", [], {}):
            continue
        n = len(v) if isinstance(v, list) else 1
        tag = "<" + key.rstrip("s") + ">"
        try:
            refs = json.dumps(record, ensure_ascii=False).count(tag)
        except (TypeError, ValueError, RecursionError):
            refs = 0
        where = f", referred to by {refs} {tag} placeholders" if refs else ""
        raise Rejected(Reason.NON_TEXT_CONTENT, f"the record carries {n} {key} in {key!r}{where}; packstream packs "
                                                "text only (images with --processor): drop these records (or the "
                                                "media key, if the text does not depend on it)")


# ------------------------------------------------------------------------------------------------
# Tried fixes: a refusal shows concrete options only when they read the record whole.


def _text_below_top(record: dict, note: str) -> bool:
    """Does an ignored field below the top level (``choices[0].index``, ``answers[].arguments``) hold text?"""
    if note.endswith(".") or ".." in note or ".[" in note:
        return True  # an empty key below the top level (``prompt.``): no path reaches it; never say it holds nothing
    steps = re.findall(r"\[(-?\d*)(:?)(-?\d*)\]|([^.\[\]]+)", note)
    if len(steps) < 2:
        return False  # a top-level key: named in the detail, counted
    values = [record]
    for lo, colon, hi, key in steps:
        nxt = []
        for v in values:
            if key:
                if isinstance(v, dict) and key in v:
                    nxt.append(v[key])
            elif isinstance(v, list):
                a = int(lo) if lo else 0
                b = (int(hi) if hi else None) if colon or not lo else a + 1
                nxt.extend(v[a:b] if not (lo and not colon and a < 0) else v[a:][:1])
        values = nxt
    return any(text_size(v) for v in values)


def _empty_cells(r: Rejected, record: Any, options: FormatOptions) -> Rejected:
    """A CSV/TSV row refused for lacking a field its empty cell left out: the row is read again with each empty
    cell filled with a mark of its own, to see which turn it would have been. An answer left empty is
    ``empty_answer``, a prompt ``missing_field``, each naming the cell and no other fix (issue 42:
    ``instruction,output`` with ``"What is 2+2?",""`` was ``unknown_format``, fixed by ``--field
    instruction=text``, which trains the prompt). Otherwise ``r``."""
    empty = getattr(record, "empty", ())
    if not empty or r.reason not in (Reason.UNKNOWN_FORMAT, Reason.MISSING_FIELD):
        return r
    marks = {name: f"\u2402{name}\u2402" for name in empty}
    try:
        convs = _conversations({**record, **marks}, options)
    except (Rejected, PackstreamError):
        return r
    turns = [(m.get("role"), str(m.get("content"))) for c in convs for m in c.messages]
    held = {name: sorted({role for role, text in turns if mark in text}) for name, mark in marks.items()}
    answers = [name for name, roles in held.items() if "assistant" in roles]
    prompts = [name for name, roles in held.items() if roles and name not in answers]
    for cells, why in ((answers, "no answer to train on; fill in the answer"), (prompts, "the prompt is missing; fill it in")):
        if cells:
            said = f"the row's {', '.join(cells)} cell{'s are' if len(cells) > 1 else ' is'} empty: {why}, or remove the row"
            return Rejected(Reason.EMPTY_ANSWER if cells is answers else Reason.MISSING_FIELD, said)
    return r


def _validated(r: Rejected, record: Any, options: FormatOptions) -> Rejected:
    """``r`` as its fix, tried on the record, finds it: the fix (and its alternative) read the record whole
    (packed, no text left unread below the top level but under the keys it reads in part on purpose,
    ``Fix.drops``), naming the top-level fields left unread; or no value of it does, and its values are the
    user's to choose (holes). A fix with nothing to try is shown as it is; one that names ``--pairs`` is tried
    by the pair reader (:func:`pair_conversations`)."""
    r = _empty_cells(r, record, options)
    fix = r.fix
    if fix is None or not isinstance(record, dict) or not fix.changes(options):
        return r
    left: list[str] = []
    read = pair_conversations if fix.pack().get("pairs") else _conversations  # a --pairs fix: the pair reader
    for alternative in (False, True) if fix.alternative is not None else (False,):
        try:
            tried = fix.applied(options, alternative)
            convs = list(read(record, tried))
            if read is _conversations and convs:
                labelled(record, tried, convs)  # a --kto-label the fix names reads its field
        except (Rejected, PackstreamError, ValueError, TypeError):
            return r.with_fix(fix.holes(options))
        ignored = sorted({n.split(":", 1)[1] for c in convs for n in c.notes if n.startswith("ignored_field:")})
        if any(_text_below_top(record, name) for name in ignored if not under(name, fix.drops)):
            return r.with_fix(fix.holes(options))
        if not alternative:
            left = ignored
    return r.with_fix(dataclasses.replace(fix, leaves=tuple(left))) if left else r
