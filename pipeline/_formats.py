"""Record shapes -> one normalized conversation.

Every record becomes a :class:`Conversation` or raises :class:`Rejected` with a :class:`Reason`
whose detail names the value, the limit and the fix. Conversational shapes become a list of
messages ``{"role", "content"}`` with roles ``system | user | assistant | tool`` (assistant
messages may carry ``reasoning`` and OpenAI-shaped ``tool_calls``; tool results ``name`` and
``tool_call_id``). Three shapes are not conversations: plain ``text`` (every token trained),
labelled ``segments`` (trained exactly where labelled) and pre-tokenized ``tokens``.

Shapes (``--format auto`` picks the first whose keys a record has; ``docs/formats.md`` has the table):

==================  =========================================================================
tokens              ``input_ids`` (+ ``labels`` with -100, or ``loss_mask``; ``attention_mask``)
segments            ``segments: [{text, label}]`` (template-free, Axolotl's input_output)
messages            ``messages: [{role, content}]`` (OpenAI: parts, reasoning, tool calls)
sharegpt            ``conversations: [{from, value}]`` (or role/content)
prompt-completion   ``prompt`` + ``completion`` (strings, or lists of messages as in TRL)
alpaca              ``instruction`` + ``output``/``response`` (+ ``input``, ``system``, ``history``)
text                ``text``
==================  =========================================================================

Any other shape is mapped: ``--field PATH=ROLE`` (paths like ``choices[0].turns``; lists of
equal length interleave; ``transcript`` parses "Human: ... Assistant: ..." strings) or
``--messages-field PATH`` for a list of turn objects under any key (``--role-key``,
``--content-key``, ``--roles``). A record of no known shape is refused with a suggestion
computed from its own keys.

Conversation hygiene, the same for every conversational shape, each step counted in ``notes``:
empty turns are dropped; consecutive same-role turns with the same train flag are merged
(``--same-role``; turns whose flags differ stay apart); a first assistant turn that answers
nothing is dropped, kept as context, or refused (``--leading-assistant``); trailing turns that
are not trained (user, tool, or flagged 0) are trimmed, so every example ends on a target turn.
Reasoning written inline in an assistant answer (``<think>...</think>``, or text before a
``</think>`` with no ``<think>``) becomes the turn's reasoning.

Nothing a record holds is dropped unseen: record keys outside the detected shape are counted as
``ignored_field:<key>``; so are (when they hold something) turn keys a turn does not read
(``ignored_field:messages[].refusal``) and fields beside a followed ``--field``/``--messages-field``
path (``ignored_field:conversation.system``, ``ignored_field:choices[1:]``). Two keys that hold
different text for one slot (Alpaca ``input``/``context``, ``output``/``response``/``instances``;
a turn's ``content``/``text``/``value``; two reasoning keys) refuse the record as ``ambiguous_field``.

>>> c = normalize({"instruction": "Add 2 and 3.", "input": "", "output": "5"}, FormatOptions())
>>> c.shape, c.messages
('alpaca', [{'role': 'user', 'content': 'Add 2 and 3.'}, {'role': 'assistant', 'content': '5'}])
>>> c = normalize({"conversations": [{"from": "gpt", "value": "Hi! Ask me anything."},
...                                  {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}, FormatOptions())
>>> [m["role"] for m in c.messages], c.notes
(['user', 'assistant'], {'leading_assistant_dropped': 1})
>>> fmt = FormatOptions(fields=(("turns", "user"), ("choices[0].turns", "assistant")))
>>> c = normalize({"turns": ["Hi", "2+2?"], "choices": [{"turns": ["Hello", "4"]}], "category": "math"}, fmt)
>>> [(m["role"], m["content"]) for m in c.messages], c.notes
([('user', 'Hi'), ('assistant', 'Hello'), ('user', '2+2?'), ('assistant', '4')], {'ignored_field:category': 1})
>>> normalize({"question": "2+2?", "answer": "4"}, FormatOptions())
Traceback (most recent call last):
...
pipeline._formats.Rejected: unknown_format: keys [answer, question] match no format (messages, conversations, prompt/completion, instruction/output, text, segments, input_ids); read it with --field question=user --field answer=assistant
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import math
import re
from typing import Any, Optional, Sequence

from pipeline._options import Format, FormatOptions, LeadingAssistant, SameRole, TrainOn, parse_path  # noqa: F401 - parse_path re-exported


class Reason(str, enum.Enum):
    """Why a record left the main path. One counter and one dead-letter reason each."""

    MALFORMED_JSON = "malformed_json"
    INVALID_UTF8 = "invalid_utf8"
    RECORD_TOO_LARGE = "record_too_large"
    NOT_AN_OBJECT = "not_an_object"
    UNKNOWN_FORMAT = "unknown_format"
    MISSING_FIELD = "missing_field"
    BAD_TYPE = "bad_type"
    EMPTY_CONVERSATION = "empty_conversation"
    NO_ASSISTANT_TURN = "no_assistant_turn"
    STARTS_WITH_ASSISTANT = "starts_with_assistant"
    CONSECUTIVE_SAME_ROLE = "consecutive_same_role"
    UNKNOWN_ROLE = "unknown_role"
    TEMPLATE_ERROR = "template_error"
    EMPTY_AFTER_RENDER = "empty_after_render"
    NO_TARGET_TOKENS = "no_target_tokens"
    DUPLICATE_ID = "duplicate_id"
    TOO_LONG = "too_long"
    NON_TEXT_CONTENT = "non_text_content"
    TEMPLATE_LIMIT = "template_limit"
    PRETOKENIZED_UNVERIFIED = "pretokenized_unverified"
    BAD_TOKEN_ID = "bad_token_id"
    CORRUPT_INPUT = "corrupt_input"
    AMBIGUOUS_FIELD = "ambiguous_field"


class Rejected(Exception):
    """A record that cannot be packed; ``str()`` is ``"<reason>: <detail>"``."""

    def __init__(self, reason: Reason, detail: str):
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail

    def __reduce__(self):  # pickle (Beam ships read-time rejections between steps) by our own fields
        return (Rejected, (self.reason, self.detail))


@dataclasses.dataclass
class Conversation:
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """``{"role", "content"}`` plus, where present: ``reasoning`` (assistant), ``tool_calls``
    (assistant; ``[{"type": "function", "function": {"name", "arguments"}, "id"?}]``), ``name``
    and ``tool_call_id`` (tool)."""
    tools: Optional[list] = None
    text: Optional[str] = None
    """Set for plain-text records (every token trained); ``messages`` is then empty."""
    train: Optional[list[Optional[bool]]] = None
    """Per message: True/False where the record's turn says so (loss_weight, train, training), else None."""
    segments: Optional[list[tuple[str, bool]]] = None
    """Template-free labelled segments ``[(text, is_target), ...]``; ``messages`` is then empty."""
    tokens: Optional[Any] = None
    """Pre-tokenized: a ``(2, n)`` int32 array (ids, loss mask); ``messages`` is then empty."""
    notes: dict[str, int] = dataclasses.field(default_factory=dict)
    """What normalization did to the record (turns trimmed, merged, dropped; ``ignored_field:<name>``)."""
    shape: str = ""
    """The shape the record was read as (``alpaca``, ``messages``, ``fields``, ...)."""
    mapping: tuple[str, ...] = ()
    """How the record's fields became turns, in words (``instruction+input -> user``), for ``preview``."""


NOTE_KEYS = ("leading_assistant_dropped", "trailing_turns_trimmed", "empty_turns_dropped", "turns_merged")
"""Notes that count turns a record held but its conversation does not (besides ``ignored_field:*``)."""

NOTE_UNITS = {**dict.fromkeys(NOTE_KEYS, "turns"), "number_as_text": "values", "padding_tokens_removed": "tokens"}
"""Every note normalization keeps (besides ``ignored_field:*``), with what it counts."""

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
_CALL_PARTS = {"tool_call", "function_call", "tool_use"}
_MEDIA_PARTS = {"image", "image_url", "input_image", "audio", "input_audio", "video", "video_url", "file",
                "input_file", "document", "image_file"}

_BUILTIN_MARKERS: tuple[tuple[str, str], ...] = (
    ("### Human:", "user"), ("### Assistant:", "assistant"), ("### System:", "system"), ("### User:", "user"),
    ("### Human", "user"), ("### Assistant", "assistant"),
    ("Human:", "user"), ("Assistant:", "assistant"), ("User:", "user"), ("System:", "system"),
    ("USER:", "user"), ("ASSISTANT:", "assistant"), ("SYSTEM:", "system"), ("FUNCTION RESPONSE:", "tool"),
)
"""Transcript speaker markers (``--transcript-marker`` adds more): word markers match at the start of a
line (or after whitespace, when that finds no assistant turn otherwise), ``###`` markers anywhere."""

_ID_KEYS = ("id",)  # the example id (pipeline._rows.example_id): part of every shape

_MISSING = object()


def resolve(record: Any, path: str) -> Any:
    """The value at ``path`` (a key first taken literally, so ``"a.b"`` may be one key), or ``_MISSING``."""
    if isinstance(record, dict) and path in record:
        return record[path]
    value = record
    for step in parse_path(path):
        if isinstance(step, int):
            if not isinstance(value, list) or not -len(value) <= step < len(value):
                return _MISSING
        elif not isinstance(value, dict) or step not in value:
            return _MISSING
        value = value[step]
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {str: "str", bool: "bool", int: "int", float: "float", list: "list", dict: "dict"}.get(
        type(value), type(value).__name__)


def _keys(record: dict) -> str:
    keys = sorted(map(str, record))
    return ", ".join(keys[:10]) + (f", ... ({len(keys)} keys)" if len(keys) > 10 else "") if keys else "none"


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------------
# One record's reading context: options, notes and the words preview shows.


class _Ctx:
    def __init__(self, options: FormatOptions):
        self.o = options
        self.notes: dict[str, int] = {}
        self.mapping: list[str] = []
        self.speakers: dict[str, str] = {}  # raw speaker name -> role, as seen
        self.roles = {k.lower(): v for k, v in options.roles}
        self.flagged_off = 0  # trailing assistant turns trimmed because their own flag says not to train
        self.turns_read: list = []  # the turns as read, before hygiene (for the details of a refusal)

    def note(self, key: str, n: int = 1) -> None:
        if n:
            self.notes[key] = self.notes.get(key, 0) + n

    def ignore(self, name: str) -> None:
        """A field the record holds but the conversation does not: counted once per record."""
        self.notes.setdefault(f"ignored_field:{name}", 1)


def _blank(value: Any) -> bool:
    """Holds nothing to lose: null, a string of whitespace, an empty list or object."""
    return value is None or (isinstance(value, str) and not value.strip()) or (isinstance(value, (list, dict)) and not value)


def _same(a: Any, b: Any) -> bool:
    """Two values of one slot that say the same thing (strings compared without surrounding whitespace)."""
    if isinstance(a, str) and isinstance(b, str):
        return a.strip() == b.strip()
    return type(a) is type(b) and a == b


def _one_slot(m: dict, keys: Sequence[str]) -> tuple[Optional[str], Optional[str]]:
    """One slot that may sit under any of ``keys``: the key to read (the first that holds something, else
    the first present, else None), and another key that holds different text (None when none does)."""
    present = [k for k in keys if k in m]
    full = [k for k in present if not _blank(m[k])]
    found = full[0] if full else present[0] if present else None
    return found, next((k for k in full[1:] if not _same(m[k], m[found])), None)


@dataclasses.dataclass
class _Turn:
    role: str
    content: str
    at: str  # where in the record, for messages: "messages[3]"
    speaker: str = ""  # the raw speaker name, when the role came from one
    reasoning: Optional[str] = None
    tool_calls: Optional[list] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    train: Optional[bool] = None

    def empty(self) -> bool:
        return (self.role != "tool" and not self.content.strip() and not self.tool_calls
                and not (self.reasoning or "").strip())

    def message(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            m["reasoning"] = self.reasoning
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        if self.name is not None:
            m["name"] = self.name
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


# ------------------------------------------------------------------------------------------------
# Content: strings, numbers, parts, objects.


@dataclasses.dataclass
class _Content:
    text: str
    reasoning: Optional[str] = None
    calls: Optional[list] = None


def _content(value: Any, at: str, ctx: _Ctx, role: str, allow_null: bool = False) -> _Content:
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
    if isinstance(value, list):
        return _parts(value, at, ctx, role)
    if isinstance(value, dict):
        if isinstance(value.get("type"), str):  # one content part on its own
            return _parts([value], at, ctx, role)
        key = ctx.o.content_key
        if key is not None and key in value:
            return _content(value[key], f"{at}.{key}", ctx, role, allow_null)
        strings = [k for k, v in value.items() if isinstance(v, str)]
        if key is None and len(value) == 1 and len(strings) == 1:
            return _Content(value[strings[0]])
        if key is not None:
            raise Rejected(Reason.BAD_TYPE, f"{at} is an object without {key!r} (--content-key {key}); "
                                            f"its keys: [{_keys(value)}]")
        pick = f"--content-key {strings[0]}" if strings else "--content-key KEY"
        raise Rejected(Reason.BAD_TYPE, f"{at} is an object with keys [{_keys(value)}], not text; "
                                        f"pick the key that holds the text: {pick}")
    raise Rejected(Reason.BAD_TYPE, f"{at} is {_kind(value)}, expected a string")


def _part_text(part: dict, at: str, keys: Sequence[str]) -> str:
    for k in keys:
        if k in part:
            if isinstance(part[k], str):
                return part[k]
            raise Rejected(Reason.BAD_TYPE, f"{at}.{k} is {_kind(part[k])}, expected a string")
    raise Rejected(Reason.MISSING_FIELD, f"{at} has no text (looked for {', '.join(keys)}); its keys: [{_keys(part)}]")


def _parts(parts: list, at: str, ctx: _Ctx, role: str) -> _Content:
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
            if media:
                raise Rejected(Reason.NON_TEXT_CONTENT, f"{where} is a {media[0]} part; packstream packs text only: "
                                                        "drop records with media, or their media parts")
            texts.append(_part_text(part, where, ("text", "value", ctx.o.content_key or "content")))
        elif not isinstance(kind, str):
            raise Rejected(Reason.BAD_TYPE, f"{where}.type is {_kind(kind)}, expected a string such as 'text'")
        elif kind in _TEXT_PARTS:
            texts.append(_part_text(part, where, ("text", "value")))
        elif kind in _REASONING_PARTS:
            if role != "assistant":
                raise Rejected(Reason.BAD_TYPE, f"{where} is a {kind} part in a {role} turn; only assistant "
                                                "turns carry reasoning")
            reasoning.append(_part_text(part, where, ("text", "value", kind)))
        elif kind in _CALL_PARTS:
            if role != "assistant":
                raise Rejected(Reason.BAD_TYPE, f"{where} is a {kind} part in a {role} turn; only assistant "
                                                "turns call tools")
            calls.extend(_tool_calls(part.get("value", part), where))
        elif kind in _MEDIA_PARTS:
            raise Rejected(Reason.NON_TEXT_CONTENT, f"{where} is an {kind} part; packstream packs text only: drop "
                                                    "records with media, or their media parts")
        else:
            raise Rejected(Reason.BAD_TYPE, f"{where} has type {kind!r}; content parts of type text, reasoning, "
                                            "thinking and tool_call are read")
    return _Content("".join(texts), "\n\n".join(reasoning) if reasoning else None, calls or None)


def _tool_calls(value: Any, at: str) -> list:
    """OpenAI ``tool_calls``, a Glaive/LLaMA-Factory ``{"name", "arguments"}`` (object or JSON text), or a list."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise Rejected(Reason.BAD_TYPE, f"{at} is str {_short(value)}, not a JSON tool call; expected a list of "
                                            "{name, arguments} objects (or their JSON text)") from None
    items = value if isinstance(value, list) else [value]
    return [_tool_call(v, f"{at}[{i}]" if isinstance(value, list) else at) for i, v in enumerate(items)]


def _tool_call(call: Any, at: str) -> dict:
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
    args = next((fn[k] for k in ("arguments", "parameters", "input") if k in fn), {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
            if isinstance(parsed, dict):
                args = parsed  # chat templates expect an object (they render it with tojson)
        except (json.JSONDecodeError, RecursionError):
            pass  # kept as the model wrote it
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


_THINK_RE = re.compile(r"\A\s*<think>(.*?)</think>\s*", re.S)
_THINK_END_RE = re.compile(r"\A(.*?)</think>\s*", re.S)


def _inline_reasoning(turns: list[_Turn]) -> None:
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


# ------------------------------------------------------------------------------------------------
# Turn lists: OpenAI messages, ShareGPT, dialogue corpora (speaker/text), --messages-field.


def _speaker_role(raw: Any, at: str, key: str, ctx: _Ctx) -> str:
    name = str(raw).lower() if isinstance(raw, bool) else str(raw) if isinstance(raw, (str, int)) else None
    if name is None:
        raise Rejected(Reason.UNKNOWN_ROLE, f"{at}.{key} is {_kind(raw)} {_short(raw)}, expected a speaker name")
    low = name.lower()
    role = ctx.roles.get(low) or ROLE_ALIASES.get(low)
    if role is None:
        how = f"add it to --roles: {name}=ROLE" if ctx.o.roles else f"map it with --roles {name}=ROLE"
        raise Rejected(Reason.UNKNOWN_ROLE, f"{at}.{key} is {name!r}, not a known role; {how} "
                                            "(ROLE: user, assistant, system or tool)")
    ctx.speakers.setdefault(name, "assistant tool call" if role == _CALL else role)
    return role


def _train_flag(m: dict, at: str) -> Optional[bool]:
    flag = None
    for key in TRAIN_KEYS:
        if key not in m or m[key] is None:
            continue
        v = m[key]
        if isinstance(v, bool):
            b = v
        elif isinstance(v, (int, float)) and v in (0, 1):
            b = bool(v)
        else:
            raise Rejected(Reason.BAD_TYPE, f"{at}.{key} is {_short(v)}; a turn's {key} must be 0 or 1 (true/false): "
                                            "packstream's loss mask is 0/1 per token")
        if flag is not None and flag != b:
            raise Rejected(Reason.BAD_TYPE, f"{at} has training flags that disagree ({', '.join(TRAIN_KEYS)})")
        flag = b
    return flag


def _turn(m: Any, at: str, ctx: _Ctx, default_role: Optional[str] = None, where: str = "") -> _Turn:
    """One turn object -> a :class:`_Turn`. Keys of the object that the turn does not read (and that hold
    something) are counted as ``ignored_field:<where>[].<key>``."""
    if isinstance(m, str) and default_role is not None:  # a dialogue given as a list of strings
        return _Turn(default_role, m, at)
    if not isinstance(m, dict):
        raise Rejected(Reason.BAD_TYPE, f"{at} is {_kind(m)}, expected a turn object {{role, content}}")
    used: set = set(TRAIN_KEYS)
    t = _turn_object(m, at, ctx, used)
    _unused_turn_keys(m, used, at, where or re.sub(r"\[-?\d+\]\Z", "", at), ctx)
    return t


def _unused_turn_keys(m: dict, used: set, at: str, where: str, ctx: _Ctx) -> None:
    for k, v in m.items():
        if k in used or _blank(v):
            continue
        if k in MEDIA_KEYS:
            raise Rejected(Reason.NON_TEXT_CONTENT, f"{at}.{k} holds media; packstream packs text only: drop records "
                                                    "with media, or their media keys")
        ctx.ignore(f"{where}[].{k}")


def _turn_object(m: dict, at: str, ctx: _Ctx, used: set) -> _Turn:
    o = ctx.o
    if o.role_key is not None:
        key = o.role_key
        if key not in m:
            raise Rejected(Reason.MISSING_FIELD, f"{at} has no {key!r} (--role-key {key}); its keys: [{_keys(m)}]")
    else:
        key = next((k for k in ROLE_KEYS if k in m), None)
        if key is None:
            raise Rejected(Reason.MISSING_FIELD, f"{at} has no 'role' (looked for {', '.join(ROLE_KEYS)}); its keys: "
                                                 f"[{_keys(m)}]; name the speaker key with --role-key KEY")
    used.add(key)
    role = _speaker_role(m[key], at, key, ctx)
    speaker = str(m[key]).lower() if isinstance(m[key], bool) else str(m[key])
    calls: list = []
    if role == _CALL:  # ShareGPT function_call: the value is the call
        ckey = _content_key(m, at, ctx, used)
        raw = m[ckey]
        if isinstance(raw, (str, dict, list)):
            try:
                calls = _tool_calls(raw, f"{at}.{ckey}")
                return _Turn("assistant", "", at, speaker, tool_calls=calls, train=_train_flag(m, at))
            except Rejected:
                if not isinstance(raw, str):
                    raise
        # Not a JSON call: the assistant said it in words; keep it as text.
        return _Turn("assistant", _content(raw, f"{at}.{ckey}", ctx, "assistant").text, at, speaker,
                     train=_train_flag(m, at))
    for k in ("tool_calls", "function_call"):
        if k not in m or _blank(m[k]):
            continue
        if role != "assistant":  # a call cannot be rendered in another role's turn, and training on it would be wrong
            raise Rejected(Reason.BAD_TYPE, f"{at}.{k} is on a {role} turn; only assistant turns call tools: fix the "
                                            f"turn's role, or drop {k!r} from {role} turns")
        calls += _tool_calls(m[k], f"{at}.{k}")
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
                                                       "reasoning: keep one of the two keys in the data (--content-key picks "
                                                       "the text, not the reasoning)")
        reasoning = m[said[0]] if said else None
    ckey = _content_key(m, at, ctx, used, optional=bool(calls) or bool(reasoning))
    c = _content(m.get(ckey) if ckey else None, f"{at}.{ckey or 'content'}", ctx, role,
                 allow_null=bool(calls) or bool(reasoning))
    if reasoning is not None and c.reasoning is not None:
        reasoning = c.reasoning + "\n\n" + reasoning
    elif reasoning is None:
        reasoning = c.reasoning
    t = _Turn(role, c.text, at, speaker, reasoning=reasoning or None, tool_calls=(calls + (c.calls or [])) or None,
              train=_train_flag(m, at))
    if role == "tool":
        for k, attr in (("name", "name"), ("tool_call_id", "tool_call_id")):
            if isinstance(m.get(k), str):
                setattr(t, attr, m[k])
                used.add(k)
    return t


_PAIRED_CONTENT = {"from": "value", "speaker": "text"}  # the text key that goes with a speaker key, by convention


def _content_key(m: dict, at: str, ctx: _Ctx, used: set, optional: bool = False) -> Optional[str]:
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
            raise Rejected(Reason.MISSING_FIELD, f"{at} has no {key!r} (--content-key {key}); its keys: [{_keys(m)}]")
        usual = next((v for k, v in _PAIRED_CONTENT.items() if k in m), "content")
        looked = [usual] + [k for k in CONTENT_KEYS if k != usual]
        raise Rejected(Reason.MISSING_FIELD, f"{at} has no {usual!r} (looked for {', '.join(looked)}); its keys: "
                                             f"[{_keys(m)}]; name the text key with --content-key KEY")
    found, k = _one_slot(m, present)
    if k is not None:
        raise Rejected(Reason.AMBIGUOUS_FIELD, f"{at} holds text under both {found!r} and {k!r} "
                                               f"({_short(m[found])} vs {_short(m[k])}); name the one to read "
                                               f"with --content-key {found} (or --content-key {k}), the other is "
                                               "then counted as an ignored field")
    used.update(present)  # the others are empty, or the same text: nothing is lost
    return found


def _turn_list(items: Any, where: str, ctx: _Ctx, strings_alternate: bool = False) -> list[_Turn]:
    if not isinstance(items, list):
        raise Rejected(Reason.BAD_TYPE, f"{where} is {_kind(items)}, expected a list of turns")
    turns = []
    for i, m in enumerate(items):
        at = f"{where}[{i}]"
        if isinstance(m, dict) and _is_exchange(m, ctx):  # Capybara-style {input, output}: one exchange
            turns.append(_Turn("user", _content(m["input"], f"{at}.input", ctx, "user").text, f"{at}.input"))
            turns.append(_Turn("assistant", _content(m["output"], f"{at}.output", ctx, "assistant").text, f"{at}.output"))
            _unused_turn_keys(m, {"input", "output"}, at, where, ctx)
            continue
        default = ("user", "assistant")[i % 2] if strings_alternate else None
        turns.append(_turn(m, at, ctx, default, where))
    if any(isinstance(m, dict) and _is_exchange(m, ctx) for m in items):
        ctx.mapping.append(f"{where}[]: input -> user, output -> assistant")
    if strings_alternate and any(isinstance(m, str) for m in items):
        ctx.mapping.append(f"{where}: plain strings alternate user, assistant")
    return turns


def _is_exchange(m: dict, ctx: _Ctx) -> bool:
    return "input" in m and "output" in m and ctx.o.role_key not in m and not any(k in m for k in ROLE_KEYS)


def _speaker_words(ctx: _Ctx) -> str:
    return ", ".join(f"{name}->{role}" for name, role in list(ctx.speakers.items())[:8])


# ------------------------------------------------------------------------------------------------
# Transcripts: one string of "Human: ... Assistant: ..." turns.


def _markers(ctx: _Ctx) -> dict[str, str]:
    markers = dict(_BUILTIN_MARKERS)
    markers.update({m.strip(): r for m, r in ctx.o.transcript_markers})
    return markers


@functools.lru_cache(maxsize=32)
def _marker_re(markers: tuple[tuple[str, str], ...], loose: bool) -> re.Pattern:
    """Markers led by a symbol (``### Human:``, ``<|user|>``) match anywhere; word markers (``Human:``)
    at the start of a line, or (``loose``) after any non-word character, for one-line transcripts."""
    names = sorted((m for m, _ in markers), key=len, reverse=True)
    symbol = "|".join(re.escape(m) for m in names if not m[0].isalnum())
    word = "|".join(re.escape(m) for m in names if m[0].isalnum())
    start = r"(?<![A-Za-z0-9_])" if loose else r"(?:\A|(?<=\n))[ \t]*"
    alts = [f"(?:{start})(?P<w>{word})"] if word else []
    alts += [f"(?P<s>{symbol})"] if symbol else []
    return re.compile("|".join(alts))


def _transcript(value: Any, at: str, ctx: _Ctx) -> list[_Turn]:
    text = _content(value, at, ctx, "user").text
    markers = _markers(ctx)
    key = tuple(sorted(markers.items()))
    found = list(_marker_re(key, False).finditer(text))
    if not any(markers[m.group(m.lastgroup)] == "assistant" for m in found):
        loose = list(_marker_re(key, True).finditer(text))  # "USER: hi ASSISTANT: hello" on one line
        if any(markers[m.group(m.lastgroup)] == "assistant" for m in loose):
            found = loose
    if not found:
        given = " (yours from --transcript-marker included)" if ctx.o.transcript_markers else ""
        hint = "" if ctx.o.transcript_markers else "; add yours with --transcript-marker 'Q:=user' --transcript-marker 'A:=assistant'"
        raise Rejected(Reason.BAD_TYPE, f"{at} holds no speaker markers (looked for Human:, Assistant:, User:, "
                                        f"System:, ### Human, ### Assistant{given}){hint}")
    turns = []
    lead = text[: found[0].start()].strip()
    if lead:
        turns.append(_Turn("system", lead, f"{at} (text before the first marker)"))
    for k, m in enumerate(found):
        end = found[k + 1].start() if k + 1 < len(found) else len(text)
        marker = m.group(m.lastgroup)
        role = markers[marker]
        turns.append(_Turn(role, text[m.end():end].strip(), f"{at} turn {k + 1}", marker))
    return turns


# ------------------------------------------------------------------------------------------------
# Shapes.


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
                                                "text only: drop these records (or the media key, if the text does "
                                                "not depend on it)")


def _tools(record: dict, ctx: _Ctx) -> Optional[list]:
    tools = record.get("tools")
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


def _system_column(record: dict, turns: list[_Turn], ctx: _Ctx) -> None:
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
    turns.insert(0, _Turn("system", text, "system"))
    ctx.mapping.append("system -> system")


def _read_messages(record: dict, ctx: _Ctx, key: str = "messages") -> list[_Turn]:
    turns = _turn_list(record[key], key, ctx)
    ctx.mapping.insert(0, f"{key}[]: " + (_speaker_words(ctx) or "no turns"))
    _system_column(record, turns, ctx)
    return turns


def _read_messages_field(record: dict, ctx: _Ctx) -> list[_Turn]:
    path = ctx.o.messages_field
    turns = _turn_list(resolve(record, path), path, ctx, strings_alternate=True)
    ctx.mapping.insert(0, f"{path}[]: " + (_speaker_words(ctx) or "turns"))
    _system_column(record, turns, ctx)
    return turns


def _read_prompt_completion(record: dict, ctx: _Ctx) -> list[_Turn]:
    turns: list[_Turn] = []
    for key, role in (("prompt", "user"), ("completion", "assistant")):
        v = record[key]
        if isinstance(v, list) and all(isinstance(m, dict) and any(k in m for k in ROLE_KEYS) for m in v):
            turns += _turn_list(v, key, ctx)
            ctx.mapping.append(f"{key}[]: " + _speaker_words(ctx))
        else:
            turns.append(_Turn(role, _content(v, key, ctx, role).text, key))
            ctx.mapping.append(f"{key} -> {role}")
    _system_column(record, turns, ctx)
    return turns


_ALPACA_INPUTS = ("input", "context")
_ALPACA_ANSWERS = ("output", "response", "instances")


def _alpaca_key(record: dict, keys: tuple[str, ...]) -> Optional[str]:
    """The key an Alpaca slot is read from: the first of ``keys`` that holds something (else the first
    present). Two that hold different things make the record ambiguous: neither is dropped unseen."""
    found, other = _one_slot(record, keys)
    if other is not None:
        raise Rejected(Reason.AMBIGUOUS_FIELD, _alpaca_ambiguity(record, found, other))
    return found


def _alpaca_ambiguity(record: dict, a: str, b: str) -> str:
    said = f"{a} and {b} both hold something ({_short(record[a])} vs {_short(record[b])})"
    head = ["system=system"] if isinstance(record.get("system"), str) and record["system"].strip() else []
    head.append("instruction=user")
    inputs = [k for k in _ALPACA_INPUTS if k in record and not _blank(record[k])]
    lost = " (history is then not read)" if not _blank(record.get("history")) else ""
    if a in _ALPACA_INPUTS:  # input and context: both are the user's
        answer = next((k for k in ("output", "response") if k in record and not _blank(record[k])), None)
        if answer is None:
            return f"{said}, and alpaca reads one input; keep one of them in the data"
        fields = " ".join(f"--field {f}" for f in head + [f"{k}=user" for k in inputs] + [f"{answer}=assistant"])
        return f"{said}, and alpaca reads one input; read both with {fields}{lost}, or keep one in the data"
    fields = " ".join(f"--field {f}" for f in head + [f"{k}=user" for k in inputs[:1]])
    if b == "instances":  # an answer beside self-instruct instances
        return (f"{said}, and alpaca reads one answer; read {a} with {fields} --field {a}=assistant (instances is then "
                f"counted as an ignored field){lost}, or drop {a} from the data to read the instances")
    return (f"{said}, and alpaca reads one answer; pick it with {fields} --field {a}=assistant (or --field "
            f"{b}=assistant), the other is then counted as an ignored field{lost}")


def _read_alpaca(record: dict, ctx: _Ctx) -> list[_Turn]:
    turns: list[_Turn] = []
    instruction = _content(record["instruction"], "instruction", ctx, "user").text
    in_key = _alpaca_key(record, _ALPACA_INPUTS)
    inp = _content(record[in_key], in_key, ctx, "user", allow_null=True).text if in_key else ""
    out_key = _alpaca_key(record, _ALPACA_ANSWERS)
    if out_key is None:
        raise Rejected(Reason.MISSING_FIELD, f"field 'output' (or response, instances) is missing; the record has keys "
                                             f"[{_keys(record)}]")
    history = record.get("history")
    if history not in (None, "", []):
        if not isinstance(history, list):
            raise Rejected(Reason.BAD_TYPE, f"history is {_kind(history)}, expected a list of [user, assistant] pairs")
        for i, pair in enumerate(history):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise Rejected(Reason.BAD_TYPE, f"history[{i}] is {_kind(pair)} {_short(pair)}, expected a "
                                                "[user, assistant] pair")
            turns.append(_Turn("user", _content(pair[0], f"history[{i}][0]", ctx, "user").text, f"history[{i}][0]"))
            turns.append(_Turn("assistant", _content(pair[1], f"history[{i}][1]", ctx, "assistant").text,
                               f"history[{i}][1]"))
        ctx.mapping.append(f"history -> {len(history)} earlier exchanges")
    if out_key == "instances":  # self-instruct seed tasks: each instance is one more exchange
        instances = record["instances"]
        if not isinstance(instances, list) or not instances:
            raise Rejected(Reason.BAD_TYPE, f"instances is {_kind(instances)}, expected a non-empty list of "
                                            "{input, output}")
        for i, inst in enumerate(instances):
            where = f"instances[{i}]"
            if not isinstance(inst, dict):
                raise Rejected(Reason.BAD_TYPE, f"{where} is {_kind(inst)}, expected an object {{input, output}}")
            if "output" not in inst:
                raise Rejected(Reason.MISSING_FIELD, f"{where} has no 'output'; its keys: [{_keys(inst)}]")
            _unused_turn_keys(inst, {"input", "output"}, where, "instances", ctx)
            x = _content(inst.get("input"), f"{where}.input", ctx, "user", allow_null=True).text
            prompt = (instruction + ("\n\n" + x if x else "")) if i == 0 else (x or instruction)
            turns.append(_Turn("user", prompt, f"{where}.input"))
            turns.append(_Turn("assistant", _content(inst["output"], f"{where}.output", ctx, "assistant").text,
                               f"{where}.output"))
        ctx.mapping.insert(0, f"instruction+instances[].input -> user, instances[].output -> assistant "
                              f"({len(instances)} exchanges)")
    else:
        user = "\n\n".join(s for s in (instruction, inp) if s) if inp.strip() else instruction
        turns.append(_Turn("user", user, "instruction"))
        turns.append(_Turn("assistant", _content(record[out_key], out_key, ctx, "assistant").text, out_key))
        ctx.mapping.insert(0, f"instruction{'+' + in_key if in_key else ''} -> user, {out_key} -> assistant")
    _system_column(record, turns, ctx)
    return turns


def _read_fields(record: dict, ctx: _Ctx) -> "list[_Turn] | str":
    """``--field PATH=ROLE`` mappings; lists of equal length interleave, strings keep their place."""
    fields = ctx.o.fields
    if fields[0][1] == "text":
        path = fields[0][0]
        ctx.mapping.append(f"{path} -> text (every token trained)")
        return _content(resolve(record, path), path, ctx, "text").text
    before: list[_Turn] = []
    after: list[_Turn] = []
    columns: list[tuple[str, str, list]] = []
    for path, role in fields:
        value = resolve(record, path)
        if role == "transcript":
            (after if columns else before).extend(_transcript(value, path, ctx))
            ctx.mapping.append(f"{path} -> transcript turns")
        elif isinstance(value, list) and not (value and all(isinstance(p, dict) and "type" in p for p in value)):
            if value and all(isinstance(v, dict) and any(k in v for k in ROLE_KEYS) for v in value):
                raise Rejected(Reason.BAD_TYPE, f"field {path!r} holds a list of turn objects, not {role} texts; "
                                                f"read it with --messages-field {path} instead of --field")
            columns.append((path, role, value))
            ctx.mapping.append(f"{path}[] -> {role}")
        else:
            (after if columns else before).append(_Turn(role, _content(value, path, ctx, role).text, path))
            ctx.mapping.append(f"{path} -> {role}")
    turns = before
    if columns:
        lengths = {p: len(v) for p, _, v in columns}
        if len(set(lengths.values())) > 1:
            raise Rejected(Reason.BAD_TYPE, "mapped lists must have equal lengths to interleave into turns: "
                                            + ", ".join(f"{p} has {n}" for p, n in lengths.items()))
        for k in range(len(columns[0][2])):
            for path, role, value in columns:
                turns.append(_Turn(role, _content(value[k], f"{path}[{k}]", ctx, role).text, f"{path}[{k}]"))
    return turns + after


def _read_segments(record: dict, ctx: _Ctx) -> list[tuple[str, bool]]:
    segs = record["segments"]
    if not isinstance(segs, list):
        raise Rejected(Reason.BAD_TYPE, f"segments is {_kind(segs)}, expected a list of {{text, label}}")
    if not segs:
        raise Rejected(Reason.EMPTY_CONVERSATION, "segments is an empty list")
    out = []
    for i, s in enumerate(segs):
        at = f"segments[{i}]"
        if not isinstance(s, dict):
            raise Rejected(Reason.BAD_TYPE, f"{at} is {_kind(s)}, expected an object {{text, label}}")
        if "text" not in s:
            raise Rejected(Reason.MISSING_FIELD, f"{at} has no 'text'; its keys: [{_keys(s)}]")
        text = _content(s["text"], f"{at}.text", ctx, "text").text
        key = next((k for k in ("label", "train", "training") if k in s), None)
        if key is None:
            raise Rejected(Reason.MISSING_FIELD, f"{at} has no 'label' (true: trained, false: context)")
        v = s[key]
        if not (isinstance(v, bool) or (isinstance(v, (int, float)) and v in (0, 1))):
            raise Rejected(Reason.BAD_TYPE, f"{at}.{key} is {_short(v)}, expected true or false")
        out.append((text, bool(v)))
    ctx.mapping.append(f"segments[]: text, label ({sum(t for _, t in out)} of {len(out)} trained)")
    return out


_INT32_MAX = 2**31 - 1


def _int_list(value: Any, key: str) -> list[int]:
    if not isinstance(value, list):
        raise Rejected(Reason.BAD_TYPE, f"{key} is {_kind(value)}, expected a list of integers")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                continue
            raise Rejected(Reason.BAD_TYPE, f"{key}[{i}] is {_kind(v)} {_short(v)}, expected an integer")
    return [int(v) for v in value]


def _read_tokens(record: dict, ctx: _Ctx):
    import numpy as np

    ids = _int_list(record["input_ids"], "input_ids")
    if not ids:
        raise Rejected(Reason.EMPTY_CONVERSATION, "input_ids is an empty list")
    bad = next((v for v in ids if not 0 <= v <= _INT32_MAX), None)
    if bad is not None:
        raise Rejected(Reason.BAD_TOKEN_ID, f"input_ids holds {bad}, not a token id (0..{_INT32_MAX})")
    n = len(ids)
    keep = None
    if record.get("attention_mask") is not None:
        am = _int_list(record["attention_mask"], "attention_mask")
        if len(am) != n:
            raise Rejected(Reason.BAD_TYPE, f"attention_mask has {len(am)} values for {n} input_ids")
        if any(v not in (0, 1) for v in am):
            raise Rejected(Reason.BAD_TYPE, "attention_mask holds values other than 0 and 1")
        if not all(am):
            keep = am  # padding: packed rows store no padding
            ctx.note("padding_tokens_removed", n - sum(am))
    mask = [1] * n
    if record.get("labels") is not None:
        labels = _int_list(record["labels"], "labels")
        if len(labels) != n:
            raise Rejected(Reason.BAD_TYPE, f"labels has {len(labels)} values for {n} input_ids; they must align")
        for i, (t, y) in enumerate(zip(ids, labels)):
            if y != -100 and y != t:
                raise Rejected(Reason.BAD_TYPE, f"labels[{i}] is {y} but input_ids[{i}] is {t}: labels must be a copy "
                                                "of input_ids with -100 where not trained (not shifted)")
        mask = [int(y != -100) for y in labels]
        ctx.mapping.append("labels -> loss mask (-100: not trained)")
    if record.get("loss_mask") is not None:
        lm = _int_list(record["loss_mask"], "loss_mask")
        if len(lm) != n or any(v not in (0, 1) for v in lm):
            raise Rejected(Reason.BAD_TYPE, f"loss_mask must hold {n} values of 0 or 1 (one per input id)")
        if record.get("labels") is not None and lm != mask:
            raise Rejected(Reason.BAD_TYPE, "labels and loss_mask disagree on which tokens are trained")
        mask = lm
        ctx.mapping.append("loss_mask -> loss mask")
    if record.get("labels") is None and record.get("loss_mask") is None:
        ctx.mapping.append("no labels: every token trained")
    arr = np.array([ids, mask], dtype=np.int32)
    if keep is not None:
        arr = arr[:, np.asarray(keep, dtype=bool)]
    ctx.mapping.insert(0, f"input_ids ({arr.shape[1]} tokens)")
    return arr


_SHAPE_KEYS: dict[str, tuple[str, ...]] = {
    "tokens": ("input_ids", "labels", "loss_mask", "attention_mask"),
    "segments": ("segments",),
    "messages": ("messages", "tools", "system"),
    "sharegpt": ("conversations", "tools", "system"),
    "prompt-completion": ("prompt", "completion", "system", "tools"),
    "alpaca": ("instruction", "input", "context", "output", "response", "instances", "system", "history"),
    "text": ("text",),
}
"""Top-level keys each shape reads; any other key of a record is counted as ``ignored_field:<key>``."""
_USED = {shape: frozenset(keys + _ID_KEYS) for shape, keys in _SHAPE_KEYS.items()}


_TURN_KEYS = ("conversation", "dialog", "dialogue", "chat")
"""Other keys detected as a list of turn objects (lmsys-chat ``conversation``, Capybara); any other key
takes ``--messages-field``."""


def _auto_shape(record: dict) -> Optional[str]:
    if "input_ids" in record:
        return "tokens"
    if isinstance(record.get("segments"), list):
        return "segments"
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    for key in _TURN_KEYS:
        v = record.get(key)
        if isinstance(v, list) and v and all(isinstance(m, dict) and (any(k in m for k in ROLE_KEYS) or
                                                                     ("input" in m and "output" in m)) for m in v):
            return "messages:" + key
    if "prompt" in record and "completion" in record:
        return "prompt-completion"
    if "instruction" in record and any(k in record for k in ("output", "response", "instances")):
        return "alpaca"
    if "text" in record:
        return "text"
    return None


_EXPLICIT = {Format.TOKENS: "tokens", Format.SEGMENTS: "segments", Format.MESSAGES: "messages",
             Format.SHAREGPT: "sharegpt", Format.PROMPT_COMPLETION: "prompt-completion", Format.ALPACA: "alpaca",
             Format.TEXT: "text"}
_REQUIRED = {"tokens": ("input_ids",), "segments": ("segments",), "messages": ("messages",),
             "sharegpt": ("conversations",), "prompt-completion": ("prompt", "completion"),
             "alpaca": ("instruction",), "text": ("text",)}

_USER_WORDS = ("instruction", "question", "query", "prompt", "input", "problem", "human", "request", "source",
               "user", "context", "inputs")
_ASSISTANT_WORDS = ("output", "answer", "response", "completion", "solution", "target", "chosen", "reply",
                    "assistant", "outputs", "answers", "responses", "label", "targets", "rationale")


def _string_lists(record: dict) -> list[tuple[str, list]]:
    """Lists of strings at the top level or one step down (``meta.turns``, ``choices[0].turns``)."""
    out = []
    for k, v in record.items():
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            out.append((k, v))
        subs = v.items() if isinstance(v, dict) else (v[0].items() if isinstance(v, list) and v and
                                                      isinstance(v[0], dict) else ())
        for k2, v2 in subs:
            if isinstance(v2, list) and v2 and all(isinstance(x, str) for x in v2):
                out.append((f"{k}.{k2}" if isinstance(v, dict) else f"{k}[0].{k2}", v2))
    return out


def suggest(record: dict) -> str:
    """Options that would read a record of unknown shape, guessed from its keys and values."""
    # A list of turn objects under any key (or one level down).
    for path, v in [(k, v) for k, v in record.items()] + [
            (f"{k}.{k2}", v2) for k, v in record.items() if isinstance(v, dict) for k2, v2 in v.items()]:
        if isinstance(v, list) and v and all(isinstance(m, dict) for m in v):
            if all("input" in m and "output" in m for m in v):
                return f"--messages-field {path} (each {{input, output}} is one exchange)"
            rk = next((k for k in ROLE_KEYS if k in v[0]), None)
            ck = next((k for k in CONTENT_KEYS if k in v[0]), None)
            if ck is None:  # the text: the key with the longest strings
                texts = [k for k in v[0] if isinstance(v[0][k], str) and k != rk]
                ck = max(texts, key=lambda k: sum(len(m.get(k) or "") for m in v if isinstance(m.get(k), str)),
                         default=None)
                if ck is None:
                    continue
                opts_ck = f" --content-key {ck}"
            else:
                opts_ck = ""
            opts = f"--messages-field {path}"
            if rk is None:  # the speaker: a key with few distinct short values
                cands = [k for k in v[0] if k != ck and all(isinstance(m.get(k), (str, int, bool)) for m in v)]
                cands = [k for k in cands if len({str(m[k]) for m in v}) <= max(2, len(v) // 2)]
                if not cands:
                    continue
                rk = cands[0]
                opts += f" --role-key {rk}"
            opts += opts_ck
            names = list(dict.fromkeys(str(m[rk]).lower() if isinstance(m.get(rk), bool) else str(m.get(rk))
                                       for m in v if rk in m))
            unknown = [n for n in names if n.lower() not in ROLE_ALIASES]
            if unknown:
                guess = ("user", "assistant") if len(names) == 2 else ("ROLE", "ROLE")
                opts += " --roles " + ",".join(f"{n}={guess[min(i, 1)]}" for i, n in enumerate(names)
                                               if n in unknown) + " (check the roles with preview)"
            return opts
    system = next((k for k in record if k.lower() in ("system", "system_prompt") and isinstance(record[k], str)), None)
    sys_opt = ""
    if system:  # "SYSTEM: You are ..." (glaive v2) is itself a marked turn
        sys_opt = f"--field {system}={'transcript' if re.match(r'(?:SYSTEM|System):', record[system]) else 'system'} "
    for k, v in record.items():
        if isinstance(v, str) and len(_BUILTIN_RE.findall(v)) >= 2 and k != system:
            return sys_opt + f"--field {k}=transcript"
    keys = [k for k in record if isinstance(record[k], (str, list, int, float)) and not isinstance(record[k], bool)]
    user = next((k for w in _USER_WORDS for k in keys if k.lower() == w), None)
    assistant = next((k for w in _ASSISTANT_WORDS for k in keys if k.lower() == w and k != user), None)
    if user and assistant:
        return sys_opt + f"--field {user}=user --field {assistant}=assistant"
    lists = _string_lists(record)
    for i, (p1, v1) in enumerate(lists):  # questions and answers as parallel lists (MT-bench: turns, choices[0].turns)
        for p2, v2 in lists[i + 1:]:
            if len(v1) == len(v2):
                return sys_opt + f"--field {p1}=user --field '{p2}=assistant'"
    if lists:
        path = max(lists, key=lambda pv: sum(map(len, pv[1])))[0]
        if len(record[path] if path in record else ()) > 1:
            return f"--messages-field {path} (its strings alternate user, assistant)"
    strings = [k for k in keys if isinstance(record[k], str) and k not in _ID_KEYS]
    if len(strings) == 1:
        return f"--field {strings[0]}=text (plain text, every token trained), or --field NAME=ROLE per turn"
    return "--field NAME=ROLE for each turn's field (--field question=user --field answer=assistant), or " \
           "--messages-field PATH for a list of turns"


_BUILTIN_RE = re.compile(r"(?:(?:\A|\n)[ \t]*(?:Human|Assistant|User|USER|ASSISTANT):|### (?:Human|Assistant))")


def detect(record: Any, options: FormatOptions = FormatOptions()) -> str:
    """The shape ``record`` is read as under ``options`` (see the module docstring), or :class:`Rejected`."""
    if not isinstance(record, dict):
        kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
        raise Rejected(Reason.NOT_AN_OBJECT, f"record is a JSON {kinds.get(type(record), type(record).__name__)}, "
                                             "expected an object")
    o = options
    if o.fields:
        missing = [p for p, _ in o.fields if resolve(record, p) is _MISSING]
        if not missing:
            return "fields"
    elif o.messages_field:
        missing = [o.messages_field] if resolve(record, o.messages_field) is _MISSING else []
        if not missing:
            return "messages_field"
    else:
        missing = []
    if o.format is not Format.AUTO:
        shape = _EXPLICIT[o.format]
        absent = [k for k in _REQUIRED[shape] if k not in record]
        if shape == "alpaca" and not absent and not any(k in record for k in ("output", "response", "instances")):
            absent = ["output"]
        if absent:
            raise Rejected(Reason.MISSING_FIELD, f"field {absent[0]!r} (format {o.format.value}) is missing; the record "
                                                 f"has keys [{_keys(record)}]")
        return shape
    shape = _auto_shape(record)
    if shape is not None:
        return shape
    if missing:  # a mapping was given for this data: name what it lacks, never "pass --field"
        given = " ".join(f"--field {p}={r}" for p, r in o.fields if p in missing) or f"--messages-field {missing[0]}"
        what = ", ".join(repr(p) for p in missing)
        raise Rejected(Reason.MISSING_FIELD, f"field {what} ({given}) is missing from this record; it has keys "
                                             f"[{_keys(record)}]")
    raise Rejected(Reason.UNKNOWN_FORMAT, f"keys [{_keys(record)}] match no format (messages, conversations, "
                                          "prompt/completion, instruction/output, text, segments, input_ids); "
                                          f"read it with {suggest(record)}")


def normalize(record: Any, options: FormatOptions) -> Conversation:
    """Turn one raw record into a :class:`Conversation`, or raise :class:`Rejected` (see the module docstring)."""
    fast = _fast(record, options)
    if fast is not None:
        return fast
    return _normalize(record, options)


# The two clean shapes most SFT data comes in, built directly: about 4x faster than the general path,
# which is the per-record Python the encode stage runs beside the tokenizer. Anything short of clean
# (another key, a non-string, an empty or whitespace turn, an inline <think>, roles out of order)
# returns None and takes the general path; tests/test_formats.py holds the two equal on generated records.
_FAST_ALPACA = frozenset({"id", "instruction", "input", "output"})
_FAST_MESSAGES = frozenset({"id", "messages"})
_FAST_TURN = {"role", "content"}


def _fast(record: Any, o: FormatOptions) -> Optional[Conversation]:
    if type(record) is not dict or not _plain(o):
        return None
    if "messages" in record:
        if not record.keys() <= _FAST_MESSAGES:
            return None
        msgs = record["messages"]
        if type(msgs) is not list or not msgs or len(msgs) % 2:
            return None
        out = []
        for i, m in enumerate(msgs):
            if type(m) is not dict or m.keys() != _FAST_TURN:
                return None
            role, content = m["role"], m["content"]
            if role != ("user" if i % 2 == 0 else "assistant") or type(content) is not str or not content.strip():
                return None
            if i % 2 and "</think>" in content:  # inline reasoning: the general path reads it
                return None
            out.append({"role": role, "content": content})
        return _renderable(Conversation(out, shape="messages", mapping=_MESSAGES_MAPPING))
    if "instruction" in record and "output" in record:
        if not record.keys() <= _FAST_ALPACA:
            return None
        ins, output, inp = record["instruction"], record["output"], record.get("input", "")
        if type(ins) is not str or type(output) is not str or type(inp) is not str or not ins.strip() or not output.strip():
            return None
        if "</think>" in output:  # inline reasoning: the general path reads it
            return None
        user = ins + "\n\n" + inp if inp.strip() else ins
        mapping = _ALPACA_MAPPING[("input" in record)]
        return _renderable(Conversation([{"role": "user", "content": user}, {"role": "assistant", "content": output}],
                                        shape="alpaca", mapping=mapping))
    return None


_MESSAGES_MAPPING = ("messages[]: user->user, assistant->assistant",)
_ALPACA_MAPPING = {True: ("instruction+input -> user, output -> assistant",),
                   False: ("instruction -> user, output -> assistant",)}


@functools.lru_cache(maxsize=64)
def _plain(o: FormatOptions) -> bool:
    """Options under which a clean record reads as it stands (no mapping, aliases, keys or added turns)."""
    return (o.format is Format.AUTO and not o.fields and o.messages_field is None and not o.roles
            and o.role_key is None and o.content_key is None and o.system_prompt is None)


def _normalize(record: Any, options: FormatOptions) -> Conversation:
    """The general path of :func:`normalize`: every shape and option."""
    shape = detect(record, options)
    ctx = _Ctx(options)
    if shape == "fields":
        used = {p if p in record else str(parse_path(p)[0]) for p, _ in options.fields} | {"tools", *_ID_KEYS}
    elif shape == "messages_field":
        p = options.messages_field
        used = {p if p in record else str(parse_path(p)[0]), "system", "tools", *_ID_KEYS}
    elif shape.startswith("messages:"):
        used = {shape[9:], "system", "tools", *_ID_KEYS}
    else:
        used = _USED[shape]
    if not used.isdisjoint(MEDIA_KEYS) or not record.keys().isdisjoint(MEDIA_KEYS):
        _media_check(record, skip=tuple(used))
    conv = Conversation(shape="messages" if shape.startswith("messages:") else shape)
    if shape == "tokens":
        conv.tokens = _read_tokens(record, ctx)
    elif shape == "segments":
        conv.segments = _read_segments(record, ctx)
    elif shape == "text":
        conv.text = _content(record["text"], "text", ctx, "text").text
        ctx.mapping.append("text (every token trained)")
    else:
        if shape == "fields":
            turns = _read_fields(record, ctx)
        elif shape == "messages_field":
            turns = _read_messages_field(record, ctx)
        elif shape == "messages":
            turns = _read_messages(record, ctx, "messages")
        elif shape == "sharegpt":
            turns = _read_messages(record, ctx, "conversations")
        elif shape.startswith("messages:"):
            turns = _read_messages(record, ctx, shape[9:])
        elif shape == "prompt-completion":
            turns = _read_prompt_completion(record, ctx)
        else:
            turns = _read_alpaca(record, ctx)
        if isinstance(turns, str):
            conv.text = turns
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
            conv.tools = _tools(record, ctx) if "tools" in used else None
    for key in record:
        if key not in used:
            ctx.ignore(key)
    if shape == "fields":
        _unused_beside_paths(record, [p for p, _ in options.fields], ctx)
    elif shape == "messages_field":
        _unused_beside_paths(record, [options.messages_field], ctx)
    conv.notes = ctx.notes
    conv.mapping = tuple(ctx.mapping)
    return _renderable(conv)


def _unused_beside_paths(record: dict, paths: Sequence[str], ctx: _Ctx) -> None:
    """What a followed path leaves beside it inside the record: ``--messages-field conversation.turns``
    does not read ``conversation.system``, ``--field 'choices[0].turns=assistant'`` does not read
    ``choices[1]``. Each such field that holds something is counted as ``ignored_field:<path>``
    (list items as ``choices[1]``, or ``choices[1:]`` for the rest of a list). Top-level keys are
    counted by :func:`_normalize`; what a path ends on is read whole."""
    tree: dict = {}
    for path in paths:
        if path in record:  # a key taken literally: read whole
            tree[path] = None
            continue
        node = tree
        steps = parse_path(path)
        for k, step in enumerate(steps):
            if k == len(steps) - 1:
                node[step] = None  # None: the whole value is read
            elif node.get(step, {}) is None:
                break  # inside a value read whole
            else:
                node = node.setdefault(step, {})
    for key, node in tree.items():
        if isinstance(key, str) and key in record:
            _unused_below(record[key], node, key, ctx)


def _unused_below(value: Any, node: Optional[dict], at: str, ctx: _Ctx) -> None:
    if node is None:
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if k in node:
                _unused_below(v, node[k], f"{at}.{k}", ctx)
            elif not _blank(v):
                ctx.ignore(f"{at}.{k}")
    elif isinstance(value, list):
        n = len(value)
        read = {step % n: step for step in node if isinstance(step, int) and -n <= step < n}
        for i, step in read.items():
            _unused_below(value[i], node[step], f"{at}[{step}]", ctx)
        left = [i for i in range(n) if i not in read and not _blank(value[i])]
        while left:  # runs of items not read: x[2], or x[2:] for the rest of the list
            j = 0
            while j + 1 < len(left) and left[j + 1] == left[j] + 1:
                j += 1
            lo, hi = left[0], left[j]
            ctx.ignore(f"{at}[{lo}:]" if hi == n - 1 else f"{at}[{lo}]" if lo == hi else f"{at}[{lo}:{hi + 1}]")
            left = left[j + 1:]


# ------------------------------------------------------------------------------------------------
# Hygiene: the same rules for every conversational shape.


def _merge(a: _Turn, b: _Turn) -> _Turn:
    """Two consecutive turns of one role and one train flag (turns whose flags differ are never merged:
    one loss mask cannot say both)."""
    join = lambda x, y: x + "\n\n" + y if x and y else x or y  # noqa: E731
    reasoning = join(a.reasoning or "", b.reasoning or "") or None
    calls = (a.tool_calls or []) + (b.tool_calls or []) or None
    return _Turn(a.role, join(a.content, b.content), a.at, a.speaker, reasoning, calls, a.name, a.tool_call_id,
                 a.train)


def _hygiene(turns: list[_Turn], ctx: _Ctx) -> list[_Turn]:
    o = ctx.o
    if not turns:
        raise Rejected(Reason.EMPTY_CONVERSATION, "the conversation has no turns")
    ctx.turns_read = turns
    merged: list[_Turn] = []
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
        turns.insert(0, _Turn("system", o.system_prompt, "--system-prompt"))
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
            del turns[first:end]
            ctx.note("leading_assistant_dropped", end - first)
        else:
            for t in turns[first:end]:
                t.train = False
    n = len(turns)
    while turns and (turns[-1].role != "assistant" or turns[-1].train is False):
        ctx.flagged_off += turns.pop().train is False
    ctx.note("trailing_turns_trimmed", n - len(turns))
    if not any(t.role == "assistant" for t in turns):
        raise Rejected(Reason.NO_ASSISTANT_TURN, _no_assistant_detail(ctx))
    return turns


def _no_assistant_detail(ctx: _Ctx) -> str:
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
        return "the conversation has only a system turn"
    detail = "the conversation has no assistant turn to train on" + (" (" + "; ".join(said) + ")" if said else "")
    # A dialogue corpus whose answering side has a name that is not an assistant alias (MultiWOZ's SYSTEM).
    others = [s for s, r in ctx.speakers.items() if r in ("user", "system")]
    if len(others) >= 2 and not any(r.startswith("assistant") for r in ctx.speakers.values()):
        answering = next((s for s in others if ctx.speakers[s] == "system"), others[-1])
        how = "add it to --roles" if ctx.o.roles else "map it with --roles"
        detail += f"; if {answering!r} is the answering side, {how} {answering}=assistant"
    return detail


# ------------------------------------------------------------------------------------------------


def _renderable(conv: Conversation) -> Conversation:
    """Refuse text the tokenizer cannot take, before it fails a whole batch.

    JSON may escape lone surrogates (``"\\ud800"``): Python decodes them into a ``str`` that is
    not valid Unicode, and the Rust tokenizer raises TypeError on the whole batch. The readers
    already dead-letter such records (Beam's coders fail on them too); this guards any other
    caller. Tool definitions and calls from Parquet/Arrow inputs may hold values JSON cannot render.
    """
    parts: list[tuple[str, Any]] = [("text", conv.text)] if conv.text is not None else []
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
