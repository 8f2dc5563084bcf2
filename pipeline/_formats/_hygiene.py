"""Conversation hygiene: the same rules for every conversational shape, run once by the driver.

``read`` -> :func:`_inline_reasoning` -> :func:`_hygiene` (``--system-prompt`` included) ->
messages -> :func:`_renderable`. Each step that changes a conversation is counted in its notes:
empty turns dropped, consecutive turns of one role and one train flag merged, a leading assistant
turn dropped (or kept as context, or refused), trailing turns that are not trained trimmed.

>>> from pipeline._formats._base import Ctx, Turn
>>> from pipeline._options import FormatOptions
>>> ctx = Ctx(FormatOptions())
>>> turns = [Turn("assistant", "Hi!", "m[0]"), Turn("user", "2+2?", "m[1]"), Turn("assistant", "<think>2+2</think>4", "m[2]"),
...          Turn("user", "thanks", "m[3]")]
>>> _inline_reasoning(turns)
>>> [t.message() for t in _hygiene(turns, ctx)], ctx.notes
([{'role': 'user', 'content': '2+2?'}, {'role': 'assistant', 'content': '4', 'reasoning': '2+2'}], {'leading_assistant_dropped': 1, 'trailing_turns_trimmed': 1})
"""

from __future__ import annotations

import json
import re
from typing import Any

from pipeline._formats._base import Conversation, Ctx, Reason, Rejected, Turn
from pipeline._formats._fix import Fix
from pipeline._formats._turns import _speaker_words, roles_verb
from pipeline._options import LeadingAssistant, SameRole, TrainOn

_THINK_RE = re.compile(r"\A\s*<think>(.*?)</think>\s*", re.S)
_THINK_END_RE = re.compile(r"\A(.*?)</think>\s*", re.S)


def _inline_reasoning(turns: list[Turn]) -> None:
    """Reasoning written inline in an assistant answer, as R1-style data does: ``<think>...</think> answer``,
    or (DeepSeek-R1 distills, whose template opens the block in the prompt) ``...</think> answer`` with no
    ``<think>`` before the first ``</think>``. The block becomes the turn's reasoning, so it renders as
    reasoning and ``--mask-reasoning`` applies to it. An empty block is kept as written."""
    for t in turns:
        if t.role != "assistant" or t.reasoning is not None or "</think>" not in t.content:
            continue
        found = _THINK_RE.match(t.content)
        if found is None and "<think>" not in t.content[: t.content.find("</think>")]:
            found = _THINK_END_RE.match(t.content)
        if found and found.group(1).strip():
            t.reasoning, t.content = found.group(1).strip("\n"), t.content[found.end():]


def _merge(a: Turn, b: Turn) -> Turn:
    """Two consecutive turns of one role and one train flag (turns whose flags differ are never merged:
    one loss mask cannot say both)."""
    join = lambda x, y: x + "\n\n" + y if x and y else x or y  # noqa: E731
    reasoning = join(a.reasoning or "", b.reasoning or "") or None
    calls = (a.tool_calls or []) + (b.tool_calls or []) or None
    return Turn(a.role, join(a.content, b.content), a.at, a.speaker, reasoning, calls, a.name, a.tool_call_id,
                 a.train, a.mapped or b.mapped)


def _hygiene(turns: list[Turn], ctx: Ctx) -> list[Turn]:
    o = ctx.o
    if not turns:
        raise Rejected(Reason.EMPTY_CONVERSATION, "the conversation has no turns")
    ctx.turns_read = turns
    merged: list[Turn] = []
    empty = 0
    for t in turns:
        if t.empty():
            empty += 1
            continue
        prev = merged[-1] if merged else None
        if prev is not None and prev.role == t.role and t.role != "tool":
            if o.same_role is SameRole.REJECT:
                raise Rejected(Reason.CONSECUTIVE_SAME_ROLE, f"{prev.at} and {t.at} are both {t.role} turns "
                                                             "(--same-role reject)")
            if prev.train == t.train:  # None, True and False are three different flags
                merged[-1] = _merge(prev, t)
                ctx.note("turns_merged")
            else:  # kept apart, each with its own flag (the built-in ChatML renders them one after the other)
                merged.append(t)
        else:
            merged.append(t)
    ctx.note("empty_turns_dropped", empty)
    if not merged:
        raise Rejected(Reason.EMPTY_CONVERSATION, f"all {len(turns)} turns are empty")
    turns = merged
    if o.system_prompt is not None and turns[0].role != "system":  # '' adds an empty one: a template's default stays out
        turns.insert(0, Turn("system", o.system_prompt, "--system-prompt"))
        ctx.mapping.append("--system-prompt -> system")
    first = next((i for i, t in enumerate(turns) if t.role != "system"), None)
    if first is not None and turns[first].role == "assistant":
        t = turns[first]
        if o.leading_assistant is LeadingAssistant.REJECT:
            raise Rejected(Reason.STARTS_WITH_ASSISTANT, f"{t.at} is an assistant turn that answers nothing "
                                                         "(--leading-assistant reject)")
        # The whole run of assistant turns before the first user turn answers nothing (turns with
        # different train flags are not merged, so the run may hold more than one).
        end = first
        while end < len(turns) and turns[end].role == "assistant":
            end += 1
        if o.leading_assistant is LeadingAssistant.DROP:
            _keep_mapped(turns[first:end], "opens the conversation, answering nothing, and would be dropped",
                         "a (non-empty) user turn before it", Fix.of(leading_assistant=LeadingAssistant.KEEP))
            del turns[first:end]
            ctx.note("leading_assistant_dropped", end - first)
        else:
            for t in turns[first:end]:
                t.train = False
    n = len(turns)
    end = len(turns)
    while end and (turns[end - 1].role != "assistant" or turns[end - 1].train is False):
        end -= 1
    if end:  # with no trained answer at all the record is no_assistant_turn (below), mapped fields or not
        _keep_mapped(turns[end:], "comes after the last trained assistant turn and would be trimmed",
                     "a trained assistant turn after it")
    while len(turns) > end:
        ctx.flagged_off += turns.pop().train is False
    ctx.note("trailing_turns_trimmed", n - len(turns))
    if not any(t.role == "assistant" for t in turns):
        raise _no_assistant(ctx)
    return turns


def _keep_mapped(cut: list[Turn], why: str, needs: str, keep: "Fix | None" = None) -> None:
    """Hygiene cuts turns no mapping named; a turn a ``--field`` named is never cut in silence: the record
    is refused, naming the field (issue 35: a mapped field lands where it means, or the record says why).
    ``keep``: the option that would keep the turn instead (as context), carried as the refusal's fix so that
    it is tried before it is shown."""
    named = next((t for t in cut if t.mapped), None)
    if named is not None:
        detail = (f"{named.at} ({named.mapped}) is {'an' if named.role == 'assistant' else 'a'} {named.role} turn "
                  f"that {why}; it needs {needs}: give the --field options in turn order (user, then assistant), or "
                  "leave this field out")
        if keep is None:
            raise Rejected(Reason.MAPPED_FIELD_CUT, detail)
        raise Rejected(Reason.MAPPED_FIELD_CUT, detail + ", or keep it as context (not trained) with ", keep)


def _no_assistant(ctx: Ctx) -> Rejected:
    said = []
    empty = sum(t.role == "assistant" and t.empty() for t in ctx.turns_read)
    if empty:
        said.append(f"{empty} empty assistant turn{'s' if empty > 1 else ''} dropped")
    if ctx.notes.get("leading_assistant_dropped"):
        said.append("its only assistant turn opens the conversation and answers nothing, so it was dropped")
    if ctx.flagged_off:
        said.append("its assistant turns are flagged not to train (loss_weight/train 0)")
    if ctx.speakers:
        said.append(f"speakers: {_speaker_words(ctx)}")
    if all(t.role == "system" for t in ctx.turns_read):
        return Rejected(Reason.NO_ASSISTANT_TURN, "the conversation has only a system turn")
    detail = "the conversation has no assistant turn to train on" + (" (" + "; ".join(said) + ")" if said else "")
    # A dialogue corpus whose answering side has a name that is not an assistant alias (MultiWOZ's SYSTEM).
    others = [s for s, r in ctx.speakers.items() if r in ("user", "system")]
    if len(others) >= 2 and not any(r.startswith("assistant") for r in ctx.speakers.values()):
        answering = next((s for s in others if ctx.speakers[s] == "system"), others[-1])
        return Rejected(Reason.NO_ASSISTANT_TURN, f"{detail}; if {answering!r} is the answering side, {roles_verb(ctx)} ",
                        Fix.of(roles=((answering, "assistant"),)))
    return Rejected(Reason.NO_ASSISTANT_TURN, detail)


# ------------------------------------------------------------------------------------------------


def _renderable(conv: Conversation) -> Conversation:
    """Refuse text the tokenizer cannot take, before it fails a whole batch.

    JSON may escape lone surrogates (``"\\ud800"``): Python decodes them into a ``str`` that is
    not valid Unicode, and the Rust tokenizer raises TypeError on the whole batch. The readers
    already dead-letter such records (Beam's coders fail on them too); this guards any other
    caller. Tool definitions and calls from Parquet/Arrow inputs may hold values JSON cannot render.
    """
    parts: list[tuple[str, Any]] = [("text", conv.text)] if conv.text is not None else []
    if conv.raw is not None:
        parts += [("prompt", conv.raw[0]), ("completion", conv.raw[1])]
    for i, m in enumerate(conv.messages):
        for key in ("content", "reasoning", "tool_calls", "name", "tool_call_id"):
            if key in m:
                parts.append((f"messages[{i}].{key}", m[key]))
    for i, (t, _) in enumerate(conv.segments or ()):
        parts.append((f"segments[{i}].text", t))
    if conv.tools:
        parts.append(("tools", conv.tools))
    for where, value in parts:
        if not isinstance(value, str):
            try:
                value = json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError, RecursionError) as e:
                raise Rejected(Reason.BAD_TYPE, f"{where} cannot be rendered as JSON ({type(e).__name__})") from None
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise Rejected(
                    Reason.INVALID_UTF8,
                    f"{where} holds a lone surrogate {value[e.start]!r} at character {e.start} "
                    "(an unpaired \\ud800-\\udfff escape is not valid Unicode)",
                ) from None
    return conv


def target_flags(conv: Conversation, train_on: TrainOn) -> list[bool]:
    """Per message: is it a training target? A turn's own flag wins; else assistant turns (or all, with
    ``--train-on all``)."""
    flags = conv.train or [None] * len(conv.messages)
    return [f if f is not None else (train_on is TrainOn.ALL or m["role"] == "assistant")
            for m, f in zip(conv.messages, flags)]
