"""Preference pairs: one record, a prompt and two answers (chosen, rejected). Every layout in one module.

Layouts, told apart by their keys (:func:`layout`):

==================  ==========================================================================
openai-dpo          ``input: {messages, tools?}`` + ``preferred_output`` + ``non_preferred_output``
                    (OpenAI's DPO fine-tuning files; each output a list of messages)
ranking             ``conversations: [{from, value}]`` + ``chosen``/``rejected`` as one turn object
                    each (LLaMA-Factory's ranking form; a list of turns works too)
instruction         ``instruction`` (+ ``input``/``context``, ``history``) + ``chosen``/``rejected``
                    strings (LLaMA-Factory's Alpaca ranking form)
prompt              ``prompt`` (or ``question``, ``query``; a string or a list of messages) +
                    ``chosen``/``rejected`` as strings, turn objects or lists of messages (TRL's
                    explicit prompt; Intel/orca_dpo_pairs, with ``system``). A chosen list that
                    repeats the prompt's turns first has them read once; a prompt string that is
                    a transcript ending on "Assistant:" (Dahoas/full-hh-rlhf) is its turns.
implicit            ``chosen``/``rejected`` as whole conversations that share their beginning:
                    lists of messages (TRL's implicit prompt, UltraFeedback) or transcript strings
                    ("Human: ... Assistant: ...", HH-RLHF); the prompt is the shared turns
==================  ==========================================================================

Other records name their fields by options (:func:`mapped_pair`): ``--pair-sides`` and
``--pair-winner`` (two answers and the label that picks one), ``--pair-ranked`` (a scored list),
``--pair-prompt``; the record is rewritten into one of the layouts above.

:func:`preference_turns` is the API for packing pairs: one record -> ``(prompt, chosen,
rejected)`` turn lists before hygiene, the ``system`` column as the prompt's first turn; or
:class:`Rejected` with a reason. For SFT, ``--preference chosen`` (or ``rejected``) trains the
prompt and that side's answer; the other side is counted (``other_side_not_trained``). Without
it a preference record is refused as ``preference_pair``: training it as SFT would silently
train half of the pair (or, as LLaMA-Factory's ranking form read as ShareGPT did, only the history).

>>> rec = {"conversations": [{"from": "human", "value": "Name a prime above 90."}],
...        "chosen": {"from": "gpt", "value": "97"}, "rejected": {"from": "gpt", "value": "91"}}
>>> p = preference_turns(rec)
>>> [(t.role, t.content) for t in p.prompt], [t.content for t in p.chosen], [t.content for t in p.rejected], p.layout
([('user', 'Name a prime above 90.')], ['97'], ['91'], 'ranking')
>>> p = preference_turns({"chosen": "\\n\\nHuman: Hi\\n\\nAssistant: Hello!", "rejected": "\\n\\nHuman: Hi\\n\\nAssistant: Go away."})
>>> [(t.role, t.content) for t in p.prompt], [t.content for t in p.chosen], p.layout
([('user', 'Hi')], ['Hello!'], 'implicit')
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

from pipeline._formats._base import (MISSING, Claim, Ctx, Draft, Need, Reason, Rejected, Shape, Turn, _blank, _keys, _kind,
                                     _one_slot, _short, missing_mapped)
from pipeline._formats._fix import MARKER, ROLE, Fix
from pipeline._formats._turns import (ROLE_KEYS, _content, _count_unread, _system_column, _turn, _turn_list)
from pipeline._formats.alpaca import history_turns
from pipeline._formats.fields import _transcript
from pipeline._formats.prompt_completion import raw_strings
from pipeline._options import FormatOptions, Preference

SIDES = {"openai-dpo": ("preferred_output", "non_preferred_output")}
"""The keys of the two answers, where a layout names them otherwise than ``chosen``/``rejected``."""
PROMPT_KEYS = ("prompt", "question", "query")
"""Keys of an explicit prompt (besides ``conversations``, ``instruction`` and OpenAI's ``input``), first wins."""


def layout(record: dict) -> Optional[str]:
    """The preference layout of ``record`` (see the module docstring), or None when it is not a pair."""
    if "preferred_output" in record and "non_preferred_output" in record:
        return "openai-dpo"
    if "chosen" not in record or "rejected" not in record:
        return None
    if "conversations" in record:
        return "ranking"
    if "instruction" in record:
        return "instruction"
    if any(k in record for k in PROMPT_KEYS) or isinstance(record.get("input"), str):
        return "prompt"
    return "implicit"


def _prompt_key(record: dict) -> Optional[str]:
    return next((k for k in PROMPT_KEYS if k in record), "input" if isinstance(record.get("input"), str) else None)


def _reads(record: dict, options: FormatOptions) -> tuple[str, ...]:
    kind = layout(record)
    sides = SIDES.get(kind, ("chosen", "rejected"))
    prompt = {"openai-dpo": ("input",), "ranking": ("conversations",),
              "instruction": ("instruction", "input", "context", "history"),
              "prompt": (_prompt_key(record),), "implicit": ()}.get(kind, ())
    own_tools = kind == "openai-dpo" and isinstance(record.get("input"), dict) and not _blank(record["input"].get("tools"))
    return (*prompt, *sides, "system", *(() if own_tools else ("tools",)))  # input.tools wins: a top-level one is counted


@dataclasses.dataclass
class PreferenceTurns:
    """One pair, before hygiene. Unpacks as ``prompt, chosen, rejected``."""

    prompt: list[Turn]
    """The shared turns: the ``system`` column first (when the record has one), then the conversation so far."""
    chosen: list[Turn]
    rejected: list[Turn]
    layout: str
    """Which layout the record is in (see the module docstring)."""
    tools: Any = None
    """Tool definitions as the record holds them (its ``tools``, or OpenAI's ``input.tools``); None without."""

    def __iter__(self) -> Iterator[list[Turn]]:
        return iter((self.prompt, self.chosen, self.rejected))


def preference_turns(record: dict, options: FormatOptions = FormatOptions(), ctx: Optional[Ctx] = None) -> PreferenceTurns:
    """One preference record -> its prompt, chosen and rejected turns (before hygiene), or :class:`Rejected`.

    Turn objects read as everywhere else (``--roles``, ``--role-key``, ``--content-key`` apply); an
    answer given as a string is one assistant turn. ``ctx`` collects notes and words (a fresh one when
    not given). To pack both sides whole, normalize the record twice with ``--preference chosen`` and
    ``--preference rejected``: the two conversations share the prompt's tokens.
    """
    _an_object(record)
    ctx = ctx if ctx is not None else Ctx(options)
    kind = layout(record)
    if kind is None:
        raise Rejected(Reason.MISSING_FIELD, f"a preference pair needs chosen and rejected (or OpenAI's preferred_output "
                                             f"and non_preferred_output); the record has keys [{_keys(record)}]")
    tools = record.get("tools")
    if kind == "openai-dpo":
        prompt, tools = _openai_input(record, ctx)
    elif kind == "ranking":
        prompt = _turn_list(record["conversations"], "conversations", ctx)
        ctx.mapping.append("conversations[] -> prompt")
    elif kind == "instruction":
        prompt = _instruction(record, ctx)
    elif kind == "prompt":
        prompt = _explicit_prompt(record, ctx)
    else:
        prompt = []
    a, b = SIDES.get(kind, ("chosen", "rejected"))
    # after a transcript prompt ("...\n\nAssistant:") an answer string starts with the space that followed the
    # marker; in a turn of its own that space is not part of the answer (a transcript's own turns are stripped too)
    spaced = kind == "prompt" and bool(prompt) and prompt[0].at.startswith(f"{_prompt_key(record)} turn ")
    chosen, rejected = (_side(record[k].lstrip() if spaced and isinstance(record[k], str) else record[k], k, prompt,
                              ctx, implicit=kind == "implicit") for k in (a, b))
    if kind == "implicit":
        prompt, chosen, rejected = _shared_prefix(chosen, rejected)
        ctx.mapping.append(f"{a}/{b}: the shared {len(prompt)} turns are the prompt")
    elif chosen and rejected and chosen[0].role != "assistant" and rejected[0].role != "assistant":
        # Both sides are whole conversations beside a prompt field (capybara-dpo, orpo-dpo-mix: a system turn
        # first, or earlier exchanges): their shared turns are the prompt, and the prompt field is read once
        # when its text is among them (else it comes first, never dropped).
        shared, chosen, rejected = _shared_prefix(chosen, rejected)
        said = {t.content.strip() for t in shared}
        prompt = shared if all(t.content.strip() in said for t in prompt) else prompt + shared
        ctx.mapping.append(f"{a}/{b}: whole conversations; their shared {len(shared)} turns are the prompt")
    _system_column(record, prompt, ctx)
    return PreferenceTurns(prompt, chosen, rejected, kind, tools)


def _an_object(record: Any) -> None:
    if not isinstance(record, dict):
        raise Rejected(Reason.NOT_AN_OBJECT, f"record is {_kind(record)}, expected a preference object")


def _openai_input(record: dict, ctx: Ctx) -> tuple[list[Turn], Any]:
    inp = record.get("input")
    if not isinstance(inp, dict) or "messages" not in inp:
        got = f"an object with keys [{_keys(inp)}]" if isinstance(inp, dict) else _kind(inp)
        raise Rejected(Reason.MISSING_FIELD, f"input is {got}; OpenAI's DPO layout has the prompt under input.messages")
    prompt = _turn_list(inp["messages"], "input.messages", ctx)
    _count_unread(inp, {"messages", "tools"}, "input", ctx)  # parallel_tool_calls and the like: counted
    ctx.mapping.append("input.messages[] -> prompt")
    return prompt, inp.get("tools") if not _blank(inp.get("tools")) else record.get("tools")


def _instruction(record: dict, ctx: Ctx) -> list[Turn]:
    turns = history_turns(record, ctx)
    instruction = _content(record["instruction"], "instruction", ctx, "user").text
    key, other = _one_slot(record, ("input", "context"))
    if other is not None:
        raise Rejected(Reason.AMBIGUOUS_FIELD, f"input and context both hold something ({_short(record['input'])} vs "
                                               f"{_short(record['context'])}), and the prompt has one input; keep one "
                                               "of them in the data")
    inp = _content(record[key], key, ctx, "user", allow_null=True).text if key else ""
    turns.append(Turn("user", instruction + "\n\n" + inp if inp.strip() else instruction, "instruction"))
    ctx.mapping.append(f"instruction{'+' + key if key and inp.strip() else ''} -> prompt")
    return turns


def _explicit_prompt(record: dict, ctx: Ctx) -> list[Turn]:
    key = _prompt_key(record)
    value = record[key]
    if isinstance(value, list) and any(isinstance(m, dict) for m in value):
        ctx.mapping.append(f"{key}[] -> prompt")
        return _turn_list(value, key, ctx)
    turns = _transcript_prompt(value, key, ctx)
    if turns is not None:
        ctx.mapping.append(f"{key} -> prompt (a transcript: {len(turns)} turns)")
        return turns
    ctx.mapping.append(f"{key} -> prompt")
    return [Turn("user", _content(value, key, ctx, "user").text, key)]


def _transcript_prompt(value: Any, key: str, ctx: Ctx) -> Optional[list[Turn]]:
    """A prompt written as a transcript that begins with a speaker marker and ends on the assistant's, waiting
    for the answer ("\n\nHuman: Hi\n\nAssistant:"; HH-RLHF split into prompt and answers, Nectar): its turns.
    None for any other prompt (text that merely mentions a marker is the user's words)."""
    if not isinstance(value, str):
        return None
    try:
        turns = _transcript(value, key, Ctx(ctx.o))
    except Rejected:
        return None
    if (len(turns) < 2 or turns[0].at.endswith("(text before the first marker)") or turns[-1].role != "assistant"
            or turns[-1].content or not any(t.role == "user" for t in turns)):
        return None
    return turns[:-1]


def _side(value: Any, key: str, prompt: list[Turn], ctx: Ctx, implicit: bool) -> list[Turn]:
    """One answer: a string, a turn object, or a list of turns (which may repeat the prompt first)."""
    if isinstance(value, str) and implicit:
        try:
            turns = _transcript(value, key, ctx)  # HH-RLHF: the whole conversation in one marked string
        except Rejected:
            raise Rejected(Reason.MISSING_FIELD, f"{key} is a string without speaker markers and the record has no "
                                                 f"prompt ({', '.join(PROMPT_KEYS)}, instruction or conversations); "
                                                 "a transcript's own markers are named with ",
                           Fix.of(transcript_markers=((MARKER, ROLE),))) from None
    elif isinstance(value, str) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        turns = [Turn("assistant", _content(value, key, ctx, "assistant").text, key)]
    elif isinstance(value, dict) and any(k in value for k in ROLE_KEYS + ((ctx.o.role_key,) if ctx.o.role_key else ())):
        turns = [_turn(value, key, ctx, where=key, one=True)]
    elif isinstance(value, list):
        turns = _turn_list(value, key, ctx)
        n = len(prompt)
        if n and len(turns) > n and all(_same_turn(a, b) for a, b in zip(turns, prompt)):
            turns = turns[n:]  # the answer repeats the prompt's turns first (argilla, orpo-dpo-mix): read once
    else:
        raise Rejected(Reason.BAD_TYPE, f"{key} is {_kind(value)}, expected the answer: a string, a turn object "
                                        "{role, content} or a list of turns")
    return turns


def _same_turn(a: Turn, b: Turn) -> bool:
    return (a.role, a.content.strip(), a.reasoning, a.tool_calls) == (b.role, b.content.strip(), b.reasoning, b.tool_calls)


def _shared_prefix(chosen: list[Turn], rejected: list[Turn]) -> tuple[list[Turn], list[Turn], list[Turn]]:
    """TRL's implicit prompt: the turns both sides begin with. Identical sides keep their last turn as the answer."""
    n = 0
    while n < min(len(chosen), len(rejected)) and _same_turn(chosen[n], rejected[n]):
        n += 1
    if n == len(chosen) or n == len(rejected):
        n = max(0, min(len(chosen), len(rejected)) - 1)
    return chosen[:n], chosen[n:], rejected[n:]


# ------------------------------------------------------------------------------------------------
# Pairs whose fields options name (--pair-sides, --pair-winner, --pair-ranked, --pair-prompt): PKU-SafeRLHF's
# response_0/response_1 + better_response_id, SHP's history + human_ref_A/B + labels, Chatbot Arena's
# conversation_a/b + winner, UltraFeedback's scored completions, Nectar's ranked answers. The record is
# rewritten into the layouts above, and read as they are.

ANSWER_KEYS = ("chosen", "rejected", "preferred_output", "non_preferred_output")
PROMPT_FIELDS = (*PROMPT_KEYS, "instruction", "input", "context", "history", "conversations")
"""Keys the layouts read as a prompt: beside ``--pair-prompt`` they are not read (counted as ignored)."""


@dataclasses.dataclass
class MappedPair:
    """A record of named fields, as a record of the layouts above."""

    record: dict
    ignored: list[str]
    """Fields of the original record that the rewritten one does not read (counted as ignored)."""
    mapping: list[str]


def mapped_pair(record: Any, o: FormatOptions) -> MappedPair:
    """``record`` read through ``--pair-sides``/``--pair-winner``/``--pair-ranked``/``--pair-prompt``, or
    :class:`Rejected`.

    >>> o = FormatOptions(pair_sides="response_0,response_1", pair_winner=(("better_response_id", "0/1"),))
    >>> m = mapped_pair({"prompt": "Hi", "response_0": "Go.", "response_1": "Hello!", "better_response_id": 1}, o)
    >>> m.record, m.mapping
    ({'prompt': 'Hi', 'chosen': 'Hello!', 'rejected': 'Go.'}, ['response_1 (better_response_id=1) -> chosen, response_0 -> rejected'])
    """
    from pipeline._formats._paths import resolve, top_key, unused_beside_paths

    _an_object(record)
    ranked, lists = o.ranked(), o.ranked_lists()
    named = ([(ranked[0], "--pair-ranked")] if ranked is not None else [(p, "--pair-ranked") for p in lists]
             if lists is not None else [(p, "--pair-sides") for p in o.sides()])
    named += [(f, "--pair-winner") for f, _ in o.pair_winner] + ([(o.pair_prompt, "--pair-prompt")] if o.pair_prompt else [])
    paths = [p for p, _ in named]
    for path, flag in named:
        if resolve(record, path) is MISSING:
            raise missing_mapped([path], flag, record)
    ignored: list[str] = []
    if ranked is not None:
        chosen, rejected, mapping = _ranked(resolve(record, ranked[0]), ranked, o, ignored)
    elif lists is not None:
        chosen, rejected, mapping = _ranked_lists(resolve(record, lists[0]), resolve(record, lists[1]), lists, o,
                                                  ignored)
    else:
        a, b = o.sides()
        first = _winner(record, o, a, b) if o.pair_winner else 0
        won, lost = (a, b) if first == 0 else (b, a)
        why = f" ({', '.join(f'{f}={_short(resolve(record, f))}' for f, _ in o.pair_winner)})" if o.pair_winner else ""
        mapping = [f"{won}{why} -> chosen, {lost} -> rejected"] if (a, b) != ("chosen", "rejected") or why else []
        chosen, rejected = resolve(record, won), resolve(record, lost)
    used = {top_key(record, p) for p in paths}
    out: dict = {}
    names = set(ANSWER_KEYS) | (set(PROMPT_FIELDS) if o.pair_prompt else set())
    for key, value in record.items():
        if key in used:
            continue
        if key in names:  # a layout would read it in place of the named field: not read, counted
            ignored.append(key)
        else:
            out[key] = value
    if o.pair_prompt:
        out["prompt"] = resolve(record, o.pair_prompt)
        mapping.append(f"{o.pair_prompt} -> prompt")
    out["chosen"], out["rejected"] = chosen, rejected
    notes = Ctx(o)
    unused_beside_paths(record, [p for p in paths if p not in record], notes)  # beside a nested path: counted
    ignored += [k.split(":", 1)[1] for k in notes.notes if k.startswith("ignored_field:")]
    return MappedPair(out, ignored, mapping)


def _ranked(items: Any, ranked: tuple[str, str, str], o: FormatOptions, ignored: list[str]) -> tuple[Any, Any, list[str]]:
    """``--pair-ranked``: the best- and the worst-scored answer of a list (ties: the first in list order); the
    items between them, unscored items and the two items' other keys are counted in ``ignored``."""
    path, text, score = ranked
    if not isinstance(items, list) or not all(isinstance(x, dict) for x in items):
        raise Rejected(Reason.BAD_TYPE, f"{path} is {_kind(items)}, expected a list of scored answers "
                                        f"{{{text}, {score}}} (--pair-ranked {o.pair_ranked})")
    for i, item in enumerate(items):
        if text not in item:
            raise Rejected(Reason.MISSING_FIELD, f"{path}[{i}] has no {text!r} (--pair-ranked {o.pair_ranked}); its keys "
                                                 f"are [{_keys(item)}]")
    best, worst = _best_worst([item.get(score) for item in items], path, score, o, ignored)
    for i in (best[0], worst[0]):
        ignored += [f"{path}[{i}].{k}" for k in items[i] if k not in (text, score)]
    mapping = [f"{path}[{best[0]}].{text} ({score} {_short(best[1])}) -> chosen, {path}[{worst[0]}].{text} "
               f"({score} {_short(worst[1])}) -> rejected"]
    return items[best[0]][text], items[worst[0]][text], mapping


def _ranked_lists(texts: Any, scores: Any, lists: tuple[str, str], o: FormatOptions,
                  ignored: list[str]) -> tuple[Any, Any, list[str]]:
    """``--pair-ranked TEXTS/SCORES``: the answers of one list scored by the parallel list (Magpie-PO's
    ``responses``/``rewards``), as :func:`_ranked` picks them; the items of both lists not picked are counted."""
    a, b = lists
    if not isinstance(texts, list) or not isinstance(scores, list) or len(texts) != len(scores):
        said = f"{a} is {_kind(texts)} and {b} is {_kind(scores)}" if not (isinstance(texts, list) and isinstance(
            scores, list)) else f"{a} has {len(texts)} items and {b} has {len(scores)}"
        raise Rejected(Reason.BAD_TYPE, f"{said}; --pair-ranked {o.pair_ranked} needs two lists of equal length, the "
                                        "answers and their scores")
    best, worst = _best_worst([score_value(s) for s in scores], b, "score", o, ignored)
    ignored[:] = [n for n in ignored if not n.startswith(f"{b}[")]  # scores: counted through their answers
    ignored += [f"{a}[{i}]" for i in range(len(texts)) if i not in (best[0], worst[0])]
    mapping = [f"{a}[{best[0]}] ({b} {_short(best[1])}) -> chosen, {a}[{worst[0]}] ({b} {_short(worst[1])}) -> "
               "rejected"]
    return texts[best[0]], texts[worst[0]], mapping


def score_value(item: Any) -> Any:
    """An item of a list of scores as a number: the item itself, or the one number of an object that holds one
    (Magpie's ``rewards_armorm: [{"score": 0.12}, ...]``); anything else as it is (unscored, counted).

    >>> score_value(0.5), score_value({"score": 0.25}), score_value({"a": 1, "b": 2}), score_value("N/A")
    (0.5, 0.25, {'a': 1, 'b': 2}, 'N/A')
    """
    if isinstance(item, dict):
        numbers = [v for v in item.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) == 1:
            return numbers[0]
    return item


def _best_worst(values: list, path: str, score: str, o: FormatOptions,
                ignored: list[str]) -> tuple[tuple[int, Any], tuple[int, Any]]:
    """The best- and the worst-scored ``(index, score)`` (ties: the first in list order); unscored items and the
    scored ones between them are counted in ``ignored`` as ``path[i]``."""
    from pipeline._options import PairBest

    scored = []
    for i, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            ignored.append(f"{path}[{i}]")  # unscored ("N/A", null): not compared, counted
        else:
            scored.append((i, value))
    if len(scored) < 2:
        raise Rejected(Reason.NO_PREFERENCE, f"{path} holds {len(scored)} scored answer(s) (--pair-ranked "
                                             f"{o.pair_ranked}); a pair needs two with different scores")
    sign = 1 if o.pair_best is PairBest.HIGH else -1
    best = max(scored, key=lambda t: (sign * t[1], -t[0]))
    worst = min(scored, key=lambda t: (sign * t[1], t[0]))
    if best[1] == worst[1]:
        raise Rejected(Reason.NO_PREFERENCE, f"every scored answer of {path} has {score} {_short(best[1])} "
                                             f"(--pair-ranked {o.pair_ranked}); a tie is not a pair")
    for i, _ in scored:
        if i not in (best[0], worst[0]):
            ignored.append(f"{path}[{i}]")
    return best, worst


def _winner(record: dict, o: FormatOptions, a: str, b: str) -> int:
    """0 when every ``--pair-winner`` rule picks answer ``a``, 1 when every one picks ``b``; else ``no_preference``."""
    from pipeline._formats._paths import resolve

    picks = []
    for field, spec in o.pair_winner:
        value = resolve(record, field)
        hits = [_matches(value, v) for v in spec.split("/")]
        picks.append(hits.index(True) if hits.count(True) == 1 else None)
        if picks[-1] is None:
            said = ("both answers" if all(hits) else "neither answer")
            raise Rejected(Reason.NO_PREFERENCE, f"{field} is {_short(value)}, which picks {said} (--pair-winner "
                                                 f"{field}={spec}: {spec.split('/')[0]} for {a}, {spec.split('/')[1]} "
                                                 f"for {b}); a tie or a missing label is not a pair")
    if len(set(picks)) > 1:
        said = ", ".join(f"{f} picks {(a, b)[k]}" for (f, _), k in zip(o.pair_winner, picks))
        raise Rejected(Reason.NO_PREFERENCE, f"the --pair-winner fields disagree ({said}); a pair needs one preferred "
                                             "answer")
    return picks[0]


def _matches(value: Any, spec: str) -> bool:
    """Whether a label ``value`` is the ``--pair-winner`` value ``spec`` (a literal, or a comparison with a number)."""
    from pipeline._options import WINNER_OPS, winner_test

    op, number = winner_test(spec)
    spec = spec.strip()
    if op:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or number is None:
            return False
        return WINNER_OPS[op](value, number)
    if isinstance(value, bool):
        return spec.lower() == str(value).lower()
    if isinstance(value, (int, float)):
        try:
            return float(spec) == value
        except ValueError:
            return False
    if value is None:
        return spec == "null"
    return isinstance(value, str) and value.strip() == spec


def read(record: dict, ctx: Ctx) -> list[Draft]:
    kind = layout(record)
    side = ctx.o.preference
    if side is None:
        a, b = SIDES.get(kind, ("chosen", "rejected"))
        raise Rejected(Reason.PREFERENCE_PAIR, f"the record is a preference pair ({kind} layout: {a} and {b}); train the "
                                               "chosen answer as SFT with ", Fix.of(preference=Preference.CHOSEN),
                       ", or pack both sides as pairs with --pairs")
    keys = SIDES.get(kind, ("chosen", "rejected"))
    used, left = (keys if side is Preference.CHOSEN else keys[::-1])
    ctx.note("other_side_not_trained")
    if kind == "prompt" and "prompt" in record and raw_strings(record, ctx, ("prompt", "chosen", "rejected")):
        ctx.mapping.append(f"a preference pair (prompt layout, strings): the prompt (context) and {used}, raw text as "
                           f"TRL (--strings raw); {left} is not trained")
        return [Draft(raw=(record["prompt"], record[used]))]
    pair = preference_turns(record, ctx.o, ctx)
    answer = pair.chosen if side is Preference.CHOSEN else pair.rejected
    ctx.mapping.insert(0, f"a preference pair ({kind} layout): the prompt and {used} (--preference {side.value}); "
                          f"{left} is not trained")
    # TRL's layouts (an explicit prompt, or the shared turns of whole conversations): the prompt is context whatever
    # roles it holds, and the turns are rendered as written, as TRL renders them
    trl = kind == "implicit" or kind == "prompt" and "prompt" in record
    return [Draft(turns=pair.prompt + answer, tools=pair.tools, prompt=len(pair.prompt) if trl else None)]


SHAPE = Shape(
    name="preference",
    claims=Claim(needs=(Need("chosen", lambda r: layout(r) is not None),)),
    reads=_reads,
    common=(),  # tools: the record's, or OpenAI's input.tools (preference_turns finds them)
    read=read,
    looks_like="``chosen`` + ``rejected`` (TRL, LLaMA-Factory ranking, HH-RLHF) or OpenAI DPO's "
               "``preferred_output``: with ``--preference chosen``",
    keys="chosen/rejected",
)
