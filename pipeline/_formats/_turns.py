"""Turns: speaker names and roles, content (strings, numbers, parts, objects), tool-call objects, train flags.

Every shape that holds turn objects (``messages``, ``conversations``, ``--messages-field``,
conversational prompt/completion, trees, preference pairs) reads them here, so a turn reads the
same wherever it sits: one :data:`ROLE_ALIASES`, one content reader, one tool-call reader.

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> t = _turn({"from": "gpt", "value": "4", "lang": "en"}, "conversations[1]", Ctx(FormatOptions()))
>>> t.role, t.content
('assistant', '4')
>>> _tool_calls({"name": "f", "arguments": '{"x": 1}'}, "at")
[{'type': 'function', 'function': {'name': 'f', 'arguments': {'x': 1}}}]
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Optional, Sequence

from pipeline._formats._base import Ctx, Reason, Rejected, Turn, _blank, _keys, _kind, _one_slot, _same, _short
from pipeline._formats._fix import KEY, ROLE, Fix
from pipeline._formats._images import IMAGE_PARTS, VIDEO_AUDIO_PARTS, VIDEO_PARTS, part_marker

_CALL = "assistant:call"  # a speaker whose turn is an assistant tool call (ShareGPT/Glaive function_call)

ROLE_ALIASES: dict[str, str] = {
    "user": "user", "human": "user", "prompter": "user",
    "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant",
    "system": "system", "developer": "system",
    "tool": "tool", "function": "tool", "observation": "tool", "ipython": "tool", "tool_response": "tool",
    "function_response": "tool",
    "function_call": _CALL, "tool_call": _CALL,
}
"""Built-in speaker names (case-insensitive); ``--roles FROM=ROLE`` adds to and overrides them."""

ROLE_KEYS = ("role", "from", "speaker", "author")
CONTENT_KEYS = ("content", "value", "text", "utterance", "message")
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")
TRAIN_KEYS = ("loss_weight", "train", "training", "weight")
MEDIA_KEYS = ("images", "image", "videos", "video", "audios", "audio")

_TEXT_PARTS = {"text", "input_text", "output_text"}
_REASONING_PARTS = {"reasoning", "thinking", "reasoning_text"}
_CALL_KINDS = ("function", "tool_use", "tool_call", "function_call")
"""The ``type`` of a tool-call object (OpenAI's function, Anthropic's tool_use, ...): one list for every reader."""
_CALL_PARTS = frozenset(_CALL_KINDS) - {"function"}
"""Content parts that are tool calls (a part typed ``function`` is not a call in any published format)."""
_TEXT_ONLY = ("packstream packs text only (images with --processor): drop records with media, or their media")
"""How a refusal of media ends (``parts`` or ``keys`` follows)."""
_MEDIA_PARTS = {"image", "image_url", "input_image", "audio", "input_audio", "video", "video_url", "file",
                "input_file", "document", "image_file", "input_video", "audio_url"}



# ------------------------------------------------------------------------------------------------
# Content: strings, numbers, parts, objects.


@dataclasses.dataclass
class _Content:
    text: str
    reasoning: Optional[str] = None
    calls: Optional[list] = None


def _content(value: Any, at: str, ctx: Ctx, role: str, allow_null: bool = False) -> _Content:
    """A turn's content: a string, a number, a list of parts, or an object holding the text."""
    if isinstance(value, str):
        return _Content(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise Rejected(Reason.BAD_TYPE, f"{at} is float {value!r}, expected a string")
        ctx.note("number_as_text")
        return _Content(json.dumps(value))
    if value is None:
        if allow_null:
            return _Content("")
        raise Rejected(Reason.BAD_TYPE, f"{at} is null, expected a string")
    if role == "assistant" and _looks_like_calls(value):  # {name, arguments} objects: tool calls, arguments kept
        return _Content("", calls=_tool_calls(value, at, ctx))
    if isinstance(value, list):
        return _parts(value, at, ctx, role)
    if isinstance(value, dict):
        if isinstance(value.get("type"), str):  # one content part on its own
            return _parts([value], at, ctx, role)
        key = ctx.o.content_key
        if key is not None and key in value:
            _count_unread(value, {key}, at, ctx)  # the object's other keys: counted, never dropped unseen
            return _content(value[key], f"{at}.{key}", ctx, role, allow_null)
        strings = [k for k, v in value.items() if isinstance(v, str)]
        if key is None and len(value) == 1 and len(strings) == 1:
            return _Content(value[strings[0]])
        if key is not None:
            raise Rejected(Reason.BAD_TYPE, f"{at} is an object without {key!r} (--content-key {key}); "
                                            f"its keys: [{_keys(value)}]")
        raise Rejected(Reason.BAD_TYPE, f"{at} is an object with keys [{_keys(value)}], not text; pick the key that "
                                        "holds the text: ", Fix.of(content_key=strings[0] if strings else KEY))
    raise Rejected(Reason.BAD_TYPE, f"{at} is {_kind(value)}, expected a string")


def _where(at: str) -> str:
    """A place in a record without its list indices, as ignored fields are named: ``messages[].content[]``."""
    return re.sub(r"\[-?\d+\]", "[]", at)


def _count_unread(obj: dict, read: set, at: str, ctx: Optional[Ctx]) -> None:
    """Keys of ``obj`` (at ``at``) that were not read and hold something: ``ignored_field:<where>.<key>``."""
    if ctx is None:
        return
    for k, v in obj.items():
        if k not in read and not _blank(v):
            ctx.ignore(f"{_where(at)}.{k}")


def _part_text(part: dict, at: str, names: Sequence[str], ctx: Ctx) -> str:
    """The text of a content part: the first of ``names`` it has. Its other keys (``cache_control``, a
    second text key with other text) are counted as ignored."""
    for k in names:
        if k in part:
            if isinstance(part[k], str):
                _count_unread(part, {"type", k, *(n for n in names if _same(part.get(n), part[k]))}, at, ctx)
                return part[k]
            raise Rejected(Reason.BAD_TYPE, f"{at}.{k} is {_kind(part[k])}, expected a string")
    raise Rejected(Reason.MISSING_FIELD, f"{at} has no text (looked for {', '.join(names)}); its keys: [{_keys(part)}]")


def _parts(parts: list, at: str, ctx: Ctx, role: str) -> _Content:
    """OpenAI/LLaMA-Factory/Anthropic content parts: text (under text or value), reasoning, tool calls."""
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list = []
    for j, part in enumerate(parts):
        where = f"{at}[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise Rejected(Reason.BAD_TYPE, f"{at} is list holding {_kind(part)} at [{j}], expected a string "
                                            "or text parts [{type: text, text: ...}]")
        kind = part.get("type")
        if kind is None:
            media = [k for k in part if k in _MEDIA_PARTS]
            if media and ctx.image_text is not None and (media[0] in IMAGE_PARTS or (
                    media[0] in VIDEO_PARTS and ctx.video_text is not None)):
                _count_unread(part, {media[0]}, where, ctx)
                texts.append(part_marker({**part, "type": media[0]}, where, ctx))
                continue
            if media:
                raise Rejected(Reason.NON_TEXT_CONTENT, f"{where} is a {media[0]} part; {_TEXT_ONLY} parts")
            texts.append(_part_text(part, where, ("text", "value", ctx.o.content_key or "content"), ctx))
        elif not isinstance(kind, str):
            raise Rejected(Reason.BAD_TYPE, f"{where}.type is {_kind(kind)}, expected a string such as 'text'")
        elif kind in _TEXT_PARTS:
            texts.append(_part_text(part, where, ("text", "value"), ctx))
        elif kind in _REASONING_PARTS:
            if role != "assistant":
                raise Rejected(Reason.BAD_TYPE, f"{where} is a {kind} part in a {role} turn; only assistant "
                                                "turns carry reasoning")
            reasoning.append(_part_text(part, where, ("text", "value", kind), ctx))
        elif kind in _CALL_PARTS:
            if role != "assistant":
                raise Rejected(Reason.BAD_TYPE, f"{where} is a {kind} part in a {role} turn; only assistant "
                                                "turns call tools")
            if "value" in part:  # LLaMA-Factory: the call as JSON text under value
                _count_unread(part, {"type", "value"}, where, ctx)
                calls.extend(_tool_calls(part["value"], f"{where}.value", ctx))
            else:  # Anthropic tool_use: the part is the call
                calls.extend(_tool_calls(part, where, ctx))
        elif kind in _MEDIA_PARTS and ctx.image_text is not None and kind in IMAGE_PARTS + VIDEO_AUDIO_PARTS:
            _count_unread(part, {"type", "image_url", "image", "url", "path", "video", "video_url", "input_video"},
                          where, ctx)
            texts.append(part_marker(part, where, ctx))
        elif kind in _MEDIA_PARTS:
            raise Rejected(Reason.NON_TEXT_CONTENT, f"{where} is an {kind} part; {_TEXT_ONLY} parts")
        else:
            raise Rejected(Reason.BAD_TYPE, f"{where} has type {kind!r}; content parts of type text, reasoning, "
                                            "thinking and tool_call are read")
    return _Content("".join(texts), "\n\n".join(reasoning) if reasoning else None, calls or None)


_ARGS_KEYS = ("arguments", "parameters", "input")


def _is_call(obj: Any) -> bool:
    """A tool-call object: ``{name, arguments}`` (or ``parameters``), or OpenAI's ``{function: {name, arguments}}``."""
    if not isinstance(obj, dict):
        return False
    fn = obj.get("function") if isinstance(obj.get("function"), dict) else obj
    return isinstance(fn.get("name"), str) and any(k in fn for k in _ARGS_KEYS) and \
        obj.get("type") in (None, *_CALL_KINDS)


def _looks_like_calls(value: Any) -> bool:
    """One tool-call object, or a non-empty list of them (xLAM/APIGen answers, a call mapped to the assistant)."""
    return _is_call(value) or (isinstance(value, list) and bool(value) and all(_is_call(v) for v in value))


def _tool_calls(value: Any, at: str, ctx: Optional[Ctx] = None) -> list:
    """OpenAI ``tool_calls``, a Glaive/LLaMA-Factory ``{"name", "arguments"}`` (object or JSON text), or a list."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise Rejected(Reason.BAD_TYPE, f"{at} is str {_short(value)}, not a JSON tool call; expected a list of "
                                            "{name, arguments} objects (or their JSON text)") from None
    items = value if isinstance(value, list) else [value]
    return [_tool_call(v, f"{at}[{i}]" if isinstance(value, list) else at, ctx) for i, v in enumerate(items)]


def _tool_call(call: Any, at: str, ctx: Optional[Ctx] = None) -> dict:
    """One call -> ``{"type": "function", "function": {"name", "arguments"}, "id"?}``; its arguments are kept
    exactly (JSON text that holds an object becomes the object). Keys a call does not read are counted."""
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except (json.JSONDecodeError, RecursionError):
            raise Rejected(Reason.BAD_TYPE, f"{at} is a string but not a JSON tool call ({_short(call)})") from None
    if not isinstance(call, dict):
        raise Rejected(Reason.BAD_TYPE, f"{at} is {_kind(call)}, expected a tool call object {{name, arguments}}")
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise Rejected(Reason.BAD_TYPE, f"{at} has no function name (a string under 'name' or 'function.name')")
    args_key = next((k for k in _ARGS_KEYS if k in fn), None)
    args = fn[args_key] if args_key is not None else {}
    has_id = isinstance(call.get("id"), str)
    # A call's kind ("function", "tool_use", ...) is read: every kind renders as a function call. Any other
    # value under "type" is not a kind this reader knows, so it is counted as unread, never dropped unseen.
    kind = ("type",) if call.get("type") in _CALL_KINDS else ()
    if fn is call:
        _count_unread(call, {"name", args_key, *kind, *(("id",) if has_id else ())}, at, ctx)
    else:
        _count_unread(call, {"function", *kind, *(("id",) if has_id else ())}, at, ctx)
        _count_unread(fn, {"name", args_key}, f"{at}.function", ctx)
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
            if isinstance(parsed, dict):
                args = parsed  # chat templates expect an object (they render it with tojson)
        except (json.JSONDecodeError, RecursionError):
            pass  # kept as the model wrote it
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if has_id:
        out["id"] = call["id"]
    return out



# ------------------------------------------------------------------------------------------------
# Turn lists: OpenAI messages, ShareGPT, dialogue corpora (speaker/text), --messages-field.


def speaker_name(raw: Any) -> str:
    """A speaker as the data names it: JSON true/false as written (``is_human: true``), anything else as text."""
    return str(raw).lower() if isinstance(raw, bool) else str(raw)


def _speaker_role(raw: Any, at: str, key: str, ctx: Ctx) -> str:
    name = speaker_name(raw) if isinstance(raw, (str, int)) else None
    if name is None:
        raise Rejected(Reason.UNKNOWN_ROLE, f"{at}.{key} is {_kind(raw)} {_short(raw)}, expected a speaker name")
    low = name.lower()
    role = ctx.roles.get(low) or ROLE_ALIASES.get(low)
    if role is None:
        raise Rejected(Reason.UNKNOWN_ROLE, f"{at}.{key} is {name!r}, not a known role; {roles_verb(ctx)} ",
                       Fix.of(roles=((name, ROLE),)), " (ROLE: user, assistant, system or tool)")
    ctx.speakers.setdefault(name, "assistant tool call" if role == _CALL else role)
    return role


def flag01(value: Any) -> Optional[bool]:
    """A 0/1 flag as JSON writes it (true/false, 0/1, 0.0/1.0), or None when ``value`` is none of these."""
    if isinstance(value, bool):
        return value
    return bool(value) if isinstance(value, (int, float)) and value in (0, 1) else None


def _train_flag(m: dict, at: str) -> Optional[bool]:
    flag = None
    for key in TRAIN_KEYS:
        if key not in m or m[key] is None:
            continue
        v = m[key]
        b = flag01(v)
        if b is None:
            raise Rejected(Reason.BAD_TYPE, f"{at}.{key} is {_short(v)}; a turn's {key} must be 0 or 1 (true/false): "
                                            "packstream's loss mask is 0/1 per token")
        if flag is not None and flag != b:
            raise Rejected(Reason.BAD_TYPE, f"{at} has training flags that disagree ({', '.join(TRAIN_KEYS)})")
        flag = b
    return flag


def _turn(m: Any, at: str, ctx: Ctx, default_role: Optional[str] = None, where: str = "", one: bool = False) -> Turn:
    """One turn object -> a :class:`Turn`. Keys of the object that the turn does not read (and that hold
    something) are counted as ``ignored_field:<where>[].<key>`` (``<where>.<key>`` for a turn object that
    stands on its own, ``one``)."""
    if isinstance(m, str) and default_role is not None:  # a dialogue given as a list of strings
        return Turn(default_role, m, at)
    if not isinstance(m, dict):
        raise Rejected(Reason.BAD_TYPE, f"{at} is {_kind(m)}, expected a turn object {{role, content}}")
    used: set = set(TRAIN_KEYS)
    t = _turn_object(m, at, ctx, used)
    _unused_turn_keys(m, used, at, where or re.sub(r"\[-?\d+\]\Z", "", at), ctx, one)
    return t


def _unused_turn_keys(m: dict, used: set, at: str, where: str, ctx: Ctx, one: bool = False) -> None:
    for k, v in m.items():
        if k in used or _blank(v):
            continue
        if k in MEDIA_KEYS:
            raise Rejected(Reason.NON_TEXT_CONTENT, f"{at}.{k} holds media; {_TEXT_ONLY} keys")
        ctx.ignore(f"{where}.{k}" if one else f"{where}[].{k}")


def _turn_object(m: dict, at: str, ctx: Ctx, used: set) -> Turn:
    o = ctx.o
    if o.role_key is not None:
        key = o.role_key
        if key not in m:
            raise _no_named_key(at, key, "--role-key", m)
    else:
        key = next((k for k in ROLE_KEYS if k in m), None)
        if key is None:
            raise Rejected(Reason.MISSING_FIELD, f"{at} has no 'role' (looked for {', '.join(ROLE_KEYS)}); its keys: "
                                                 f"[{_keys(m)}]; name the speaker key with ", Fix.of(role_key=KEY))
    used.add(key)
    role = _speaker_role(m[key], at, key, ctx)
    speaker = speaker_name(m[key])
    calls: list = []
    if role == _CALL:  # ShareGPT function_call: the value is the call
        ckey = _content_key(m, at, ctx, used)
        raw = m[ckey]
        if isinstance(raw, (str, dict, list)):
            try:
                calls = _tool_calls(raw, f"{at}.{ckey}", ctx)
                return Turn("assistant", "", at, speaker, tool_calls=calls, train=_train_flag(m, at))
            except Rejected:
                if not isinstance(raw, str):
                    raise
        # Not a JSON call: the assistant said it in words; keep it as text.
        return Turn("assistant", _content(raw, f"{at}.{ckey}", ctx, "assistant").text, at, speaker,
                     train=_train_flag(m, at))
    for k in ("tool_calls", "function_call"):
        if k not in m or _blank(m[k]):
            continue
        if role != "assistant":  # a call cannot be rendered in another role's turn, and training on it would be wrong
            raise Rejected(Reason.BAD_TYPE, f"{at}.{k} is on a {role} turn; only assistant turns call tools: fix the "
                                            f"turn's role, or drop {k!r} from {role} turns")
        calls += _tool_calls(m[k], f"{at}.{k}", ctx)
        used.add(k)
    reasoning = None
    if role == "assistant":
        said: list[str] = []  # the reasoning keys that hold text
        for k in REASONING_KEYS:
            if k not in m:
                continue
            used.add(k)
            v = m[k]
            if v is None or v == "":
                continue
            if not isinstance(v, str):
                raise Rejected(Reason.BAD_TYPE, f"{at}.{k} is {_kind(v)}, expected a string")
            if not said:
                said.append(k)
            elif not _same(v, m[said[0]]):
                raise Rejected(Reason.AMBIGUOUS_FIELD, f"{at} holds reasoning under both {said[0]!r} and {k!r} "
                                                       f"({_short(m[said[0]])} vs {_short(v)}), and a turn has one "
                                                       "reasoning: keep one of the two keys in the data (no option picks one: "
                                                       "the content key names the text, not the reasoning)")
        reasoning = m[said[0]] if said else None
    ckey = _content_key(m, at, ctx, used, optional=bool(calls) or bool(reasoning))
    c = _content(m.get(ckey) if ckey else None, f"{at}.{ckey or 'content'}", ctx, role,
                 allow_null=bool(calls) or bool(reasoning))
    if reasoning is not None and c.reasoning is not None:
        reasoning = c.reasoning + "\n\n" + reasoning
    elif reasoning is None:
        reasoning = c.reasoning
    t = Turn(role, c.text, at, speaker, reasoning=reasoning or None, tool_calls=(calls + (c.calls or [])) or None,
              train=_train_flag(m, at))
    if role == "tool":
        for k, attr in (("name", "name"), ("tool_call_id", "tool_call_id")):
            if isinstance(m.get(k), str):
                setattr(t, attr, m[k])
                used.add(k)
    return t


def _no_named_key(at: str, key: str, flag: str, m: dict) -> Rejected:
    return Rejected(Reason.MISSING_FIELD, f"{at} has no {key!r} ({flag} {key}); its keys: [{_keys(m)}]")


_PAIRED_CONTENT = {"from": "value", "speaker": "text"}  # the text key that goes with a speaker key, by convention


def _content_key(m: dict, at: str, ctx: Ctx, used: set, optional: bool = False) -> Optional[str]:
    """The key of a turn's text. Without ``--content-key``, the first of :data:`CONTENT_KEYS` that holds
    something; another that holds different text makes the record ambiguous (never one of them dropped)."""
    key = ctx.o.content_key
    if key is not None and key in m:
        used.add(key)
        return key  # the user's choice: other text keys are counted as ignored
    present = [k for k in CONTENT_KEYS if k in m]
    if not present:
        if optional:
            return None
        if key is not None:
            raise _no_named_key(at, key, "--content-key", m)
        usual = next((v for k, v in _PAIRED_CONTENT.items() if k in m), "content")
        looked = [usual] + [k for k in CONTENT_KEYS if k != usual]
        raise Rejected(Reason.MISSING_FIELD, f"{at} has no {usual!r} (looked for {', '.join(looked)}); its keys: "
                                             f"[{_keys(m)}]; name the text key with ", Fix.of(content_key=KEY))
    found, k = _one_slot(m, present)
    if k is not None:
        raise Rejected(Reason.AMBIGUOUS_FIELD, f"{at} holds text under both {found!r} and {k!r} "
                                               f"({_short(m[found])} vs {_short(m[k])}); name the one to read with ",
                       Fix.of(content_key=found, alternative=k), ", the other is then counted as an ignored field")
    used.update(present)  # the others are empty, or the same text: nothing is lost
    return found


_NUMBERED = re.compile(r"^(.*?)[ _.-]?(\d+)$")


def numbered(value: Any) -> Optional[list[tuple[str, Any]]]:
    """A dict whose keys are one name and a number (``turn_1``, ``turn_2``; ``turn1``, ``Turn 1``) as its
    ``(key, value)`` items in numeric order (``turn_10`` after ``turn_9``); None for any other value.

    >>> [k for k, _ in numbered({"turn_10": "j", "turn_2": "b", "turn_1": "a"})]
    ['turn_1', 'turn_2', 'turn_10']
    >>> numbered({"turn_1": "a", "answer_2": "b"}), numbered({"q": "a"})
    (None, None)
    """
    if not isinstance(value, dict) or not value or not all(isinstance(k, str) for k in value):
        return None
    found = [_NUMBERED.match(k) for k in value]
    if not all(found) or len({m.group(1).lower() for m in found}) != 1:
        return None
    numbers = [int(m.group(2)) for m in found]
    if len(set(numbers)) != len(numbers):
        return None
    return [(k, value[k]) for _, k in sorted(zip(numbers, value))]


def _turn_list(items: Any, where: str, ctx: Ctx, strings_alternate: bool = False) -> list[Turn]:
    listed = numbered(items)
    if listed is not None:  # {"turn_1": ..., "turn_2": ...}: the turns in numeric order
        ctx.mapping.append(f"{where}: keys {listed[0][0]}..{listed[-1][0]} in numeric order")
        places = [f"{where}.{k}" for k, _ in listed]
        items = [v for _, v in listed]
    elif not isinstance(items, list):
        raise Rejected(Reason.BAD_TYPE, f"{where} is {_kind(items)}, expected a list of turns")
    else:
        places = [f"{where}[{i}]" for i in range(len(items))]
    turns = []
    said: list[tuple[str, str]] = []
    for i, m in enumerate(items):
        at = places[i]
        pair = _exchange(m, ctx) if isinstance(m, dict) else None
        if pair is not None:  # Capybara's {input, output}, the_cauldron's {user, assistant}: one exchange
            ask, answer = pair
            turns.append(Turn("user", _content(m[ask], f"{at}.{ask}", ctx, "user").text, f"{at}.{ask}"))
            turns.append(Turn("assistant", _content(m[answer], f"{at}.{answer}", ctx, "assistant").text,
                              f"{at}.{answer}"))
            _unused_turn_keys(m, set(pair), at, where, ctx)
            said += [pair] if pair not in said else []
            continue
        default = ("user", "assistant")[i % 2] if strings_alternate else None
        turns.append(_turn(m, at, ctx, default, where))
    for ask, answer in said:
        ctx.mapping.append(f"{where}[]: {ask} -> user, {answer} -> assistant")
    if strings_alternate and any(isinstance(m, str) for m in items):
        ctx.mapping.append(f"{where}: plain strings alternate user, assistant")
    return turns


EXCHANGES = (("input", "output"), ("user", "assistant"))
"""Keys of a turn object that holds one whole exchange, a question and its answer: Capybara's ``{input, output}``,
the_cauldron's and Docmatix's ``{user, assistant}`` (``texts``)."""


def _exchange(m: dict, ctx: Ctx) -> Optional[tuple[str, str]]:
    """The (question, answer) keys of an exchange object, or None for a turn object (one with a role key)."""
    if ctx.o.role_key in m or any(k in m for k in ROLE_KEYS):
        return None
    return next((pair for pair in EXCHANGES if pair[0] in m and pair[1] in m), None)



def roles_verb(ctx: Ctx) -> str:
    """How a refusal asks for a ``--roles`` pair: added to the user's, or the first."""
    return "add it to" if ctx.o.roles else "map it with"


def _speaker_words(ctx: Ctx) -> str:
    return ", ".join(f"{name}->{role}" for name, role in list(ctx.speakers.items())[:8])


# ------------------------------------------------------------------------------------------------
# The columns beside the turns that the driver reads for the shapes that declare them (Shape.common).


def _tools(tools: Any, ctx: Ctx) -> Optional[list]:
    """Tool definitions: a list of objects, one object, or their JSON text (Glaive, LLaMA-Factory)."""
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except (json.JSONDecodeError, RecursionError) as e:
            msg = e.msg if isinstance(e, json.JSONDecodeError) else "nesting too deep"
            raise Rejected(Reason.BAD_TYPE, f"tools is a string but not JSON ({msg})") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise Rejected(Reason.BAD_TYPE, f"tools is {_kind(tools)}, expected a list of tool definitions")
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise Rejected(Reason.BAD_TYPE, f"tools[{i}] is {_kind(t)}, expected a tool definition object")
    ctx.mapping.append(f"tools: {len(tools)} definition{'s' if len(tools) != 1 else ''}")
    return tools


def _system_column(record: dict, turns: list[Turn], ctx: Ctx) -> None:
    """A ``system`` column becomes the first system turn. Beside a system turn of the conversation's own,
    nothing is dropped: the column's text comes first, then a blank line and the turn's (the same text
    twice is kept once)."""
    sys_ = record.get("system")
    if sys_ in (None, ""):
        return
    text = _content(sys_, "system", ctx, "system").text
    if turns and turns[0].role == "system":
        if text.strip() and text.strip() != turns[0].content.strip():
            turns[0] = dataclasses.replace(turns[0], content=text + "\n\n" + turns[0].content)
            ctx.mapping.append("system -> system (before the conversation's own system turn)")
        return
    turns.insert(0, Turn("system", text, "system"))
    ctx.mapping.append("system -> system")
