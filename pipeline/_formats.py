"""Record shapes -> one normalized conversation.

Every supported shape becomes a :class:`Conversation`: a list of ``{"role", "content"}``
messages with roles in ``system | user | assistant | tool`` (plus optional ``tool_calls`` on
assistant messages) and an optional ``tools`` list. Anything that cannot be normalized raises
:class:`Rejected` with a :class:`Reason`, which the job turns into a dead-letter record.

>>> normalize({"instruction": "Add 2 and 3.", "input": "", "output": "5"}, FormatOptions())
Conversation(messages=[{'role': 'user', 'content': 'Add 2 and 3.'}, {'role': 'assistant', 'content': '5'}], tools=None, text=None)
>>> normalize({"question": "2+2?", "answer": "4"}, FormatOptions(fields=(("question", "user"), ("answer", "assistant")))).messages[1]
{'role': 'assistant', 'content': '4'}
>>> normalize({"messages": [{"role": "assistant", "content": "hi"}]}, FormatOptions())
Traceback (most recent call last):
...
pipeline._formats.Rejected: starts_with_assistant: messages[0] is an assistant turn; a conversation must open with system or user
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any, Mapping, Optional, Sequence

from pipeline._options import ROLES, Format, FormatOptions


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
    MISPLACED_SYSTEM = "misplaced_system"
    TEMPLATE_ERROR = "template_error"
    EMPTY_AFTER_RENDER = "empty_after_render"
    NO_TARGET_TOKENS = "no_target_tokens"
    DUPLICATE_ID = "duplicate_id"
    TOO_LONG = "too_long"
    NON_TEXT_CONTENT = "non_text_content"
    TEMPLATE_LIMIT = "template_limit"
    PRETOKENIZED_UNVERIFIED = "pretokenized_unverified"
    BAD_TOKEN_ID = "bad_token_id"


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
    messages: list[dict[str, Any]]
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


# ShareGPT speaker names seen in the wild (ShareGPT, Glaive, LLaMA-Factory, Vicuna).
_SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "tool_call": "assistant",
    "observation": "tool",
    "function": "tool",
    "tool": "tool",
    "ipython": "tool",
}


def detect(record: Mapping[str, Any]) -> Format:
    """The record's shape, by its keys; :class:`Rejected` (unknown_format) if none fits."""
    if "messages" in record:
        return Format.MESSAGES
    if "conversations" in record:
        return Format.SHAREGPT
    if "prompt" in record and "completion" in record:
        return Format.PROMPT_COMPLETION
    if "instruction" in record and any(k in record for k in ("output", "response", "instances")):
        return Format.ALPACA
    if "text" in record:
        return Format.TEXT
    keys = ", ".join(sorted(map(str, record))[:8]) or "none"
    raise Rejected(
        Reason.UNKNOWN_FORMAT,
        f"keys [{keys}] match no format (messages, conversations, prompt/completion, "
        "instruction/output, text); pass --field NAME=ROLE to map fields to turns",
    )


def _text(value: Any, where: str) -> str:
    """Content as a string: a str, or OpenAI-style text parts [{"type": "text", "text": ...}]."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in value):
        if all(isinstance(p.get("text"), str) for p in value):
            return "".join(p["text"] for p in value)
    kind = "null" if value is None else type(value).__name__
    raise Rejected(Reason.BAD_TYPE, f"{where} is {kind}, expected a string")


def _field(record: Mapping[str, Any], key: str) -> Any:
    if key not in record:
        raise Rejected(Reason.MISSING_FIELD, f"field {key!r} is missing")
    return record[key]


def _tools(record: Mapping[str, Any]) -> Optional[list]:
    tools = record.get("tools")
    if tools in (None, "", []):
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise Rejected(Reason.BAD_TYPE, f"tools is a string but not JSON ({e.msg})") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise Rejected(Reason.BAD_TYPE, f"tools is {type(tools).__name__}, expected a list")
    return tools


def _messages(items: Any, where: str, role_key: str, content_key: str, roles: Mapping[str, str]) -> list[dict]:
    if not isinstance(items, list):
        kind = "null" if items is None else type(items).__name__
        raise Rejected(Reason.BAD_TYPE, f"{where} is {kind}, expected a list of turns")
    out = []
    for i, m in enumerate(items):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise Rejected(Reason.BAD_TYPE, f"{at} is {type(m).__name__}, expected an object")
        if role_key not in m:
            raise Rejected(Reason.MISSING_FIELD, f"{at} has no {role_key!r}")
        raw_role = m[role_key]
        if not isinstance(raw_role, str) or raw_role.lower() not in roles:
            raise Rejected(Reason.UNKNOWN_ROLE, f"{at}.{role_key} is {raw_role!r}; known: {', '.join(sorted(roles))}")
        role = roles[raw_role.lower()]
        msg: dict[str, Any] = {"role": role}
        tool_calls = m.get("tool_calls")
        if role == "assistant" and tool_calls:
            if not isinstance(tool_calls, list):
                raise Rejected(Reason.BAD_TYPE, f"{at}.tool_calls is {type(tool_calls).__name__}, expected a list")
            msg["tool_calls"] = tool_calls
            content = m.get(content_key)
            msg["content"] = "" if content is None else _text(content, f"{at}.{content_key}")
        else:
            if content_key not in m:
                raise Rejected(Reason.MISSING_FIELD, f"{at} has no {content_key!r}")
            msg["content"] = _text(m[content_key], f"{at}.{content_key}")
        if role == "tool" and isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _alpaca(record: Mapping[str, Any]) -> list[dict]:
    instruction = _text(_field(record, "instruction"), "instruction")
    messages = []
    if record.get("system"):
        messages.append({"role": "system", "content": _text(record["system"], "system")})
    if "instances" in record and not any(k in record for k in ("output", "response")):
        # self-instruct seed tasks: every instance becomes one more user/assistant exchange.
        instances = record["instances"]
        if not isinstance(instances, list) or not instances:
            raise Rejected(Reason.BAD_TYPE, "instances must be a non-empty list of {input, output}")
        for i, inst in enumerate(instances):
            if not isinstance(inst, dict):
                raise Rejected(Reason.BAD_TYPE, f"instances[{i}] is {type(inst).__name__}, expected an object")
            inp = _text(inst.get("input", ""), f"instances[{i}].input")
            prompt = (instruction + ("\n\n" + inp if inp else "")) if i == 0 else (inp or instruction)
            messages.append({"role": "user", "content": prompt})
            messages.append({"role": "assistant", "content": _text(_field(inst, "output"), f"instances[{i}].output")})
        return messages
    inp = record.get("input") or ""
    inp = _text(inp, "input")
    output_key = "output" if "output" in record else "response"
    messages.append({"role": "user", "content": instruction + ("\n\n" + inp if inp else "")})
    messages.append({"role": "assistant", "content": _text(_field(record, output_key), output_key)})
    return messages


def normalize(record: Any, options: "FormatOptions") -> Conversation:
    """Turn one raw record into a validated :class:`Conversation`, or raise :class:`Rejected`."""
    return _renderable(_normalize(record, options.format, options.fields))


def _renderable(conv: Conversation) -> Conversation:
    """Refuse text the tokenizer cannot take, before it fails a whole batch.

    JSON may escape lone surrogates (``"\\ud800"``): Python decodes them into a ``str`` that is
    not valid Unicode, and the Rust tokenizer raises TypeError on the whole batch. The readers
    already dead-letter such records (Beam's coders fail on them too); this guards any other
    caller. Tool definitions and calls from Parquet/Arrow inputs may hold values JSON cannot render.
    """
    parts: list[tuple[str, Any]] = [("text", conv.text)] if conv.text is not None else []
    for i, m in enumerate(conv.messages):
        parts.append((f"messages[{i}].content", m["content"]))
        if "tool_calls" in m:
            parts.append((f"messages[{i}].tool_calls", m["tool_calls"]))
        if "name" in m:
            parts.append((f"messages[{i}].name", m["name"]))
    if conv.tools:
        parts.append(("tools", conv.tools))
    for where, value in parts:
        if not isinstance(value, str):
            try:
                value = json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError) as e:
                raise Rejected(Reason.BAD_TYPE, f"{where} cannot be rendered as JSON ({e})") from None
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


def _normalize(record: Any, fmt: Format, fields: Sequence[tuple[str, str]]) -> Conversation:
    if not isinstance(record, dict):
        kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
        kind = kinds.get(type(record), type(record).__name__)
        raise Rejected(Reason.NOT_AN_OBJECT, f"record is a JSON {kind}, expected an object")
    # A field mapping applies to records that have every mapped field; in auto mode the others are
    # still detected, so one run can mix a mapped source (e.g. gsm8k) with standard shapes.
    if fields and (fmt is not Format.AUTO or all(k in record for k, _ in fields)):
        if len(fields) == 1 and fields[0][1] == "text":
            return Conversation([], text=_text(_field(record, fields[0][0]), fields[0][0]))
        messages = [{"role": role, "content": _text(_field(record, key), key)} for key, role in fields]
        return _validated(Conversation(messages, _tools(record)))
    if fmt is Format.AUTO:
        fmt = detect(record)
    if fmt is Format.TEXT:
        return Conversation([], text=_text(_field(record, "text"), "text"))
    if fmt is Format.MESSAGES:
        roles = {r: r for r in ROLES} | {"function": "tool", "ipython": "tool", "developer": "system"}
        messages = _messages(_field(record, "messages"), "messages", "role", "content", roles)
    elif fmt is Format.SHAREGPT:
        conv = _field(record, "conversations")
        if isinstance(conv, list) and conv and isinstance(conv[0], dict) and "role" in conv[0]:
            roles = {r: r for r in ROLES}
            messages = _messages(conv, "conversations", "role", "content", roles)
        else:
            messages = _messages(conv, "conversations", "from", "value", _SHAREGPT_ROLES)
        # A system turn inside the conversation wins over the "system" column (as in LLaMA-Factory).
        if isinstance(record.get("system"), str) and record["system"] and not (messages and messages[0]["role"] == "system"):
            messages.insert(0, {"role": "system", "content": record["system"]})
    elif fmt is Format.PROMPT_COMPLETION:
        prompt, completion = _field(record, "prompt"), _field(record, "completion")
        if isinstance(prompt, list) and isinstance(completion, list):  # conversational prompt/completion
            roles = {r: r for r in ROLES}
            messages = _messages(prompt, "prompt", "role", "content", roles)
            messages += _messages(completion, "completion", "role", "content", roles)
        else:
            messages = [
                {"role": "user", "content": _text(prompt, "prompt")},
                {"role": "assistant", "content": _text(completion, "completion")},
            ]
    elif fmt is Format.ALPACA:
        messages = _alpaca(record)
    else:  # pragma: no cover - Format is exhaustive above
        raise AssertionError(fmt)
    return _validated(Conversation(messages, _tools(record)))


def _validated(conv: Conversation) -> Conversation:
    """Structural checks shared by every conversational shape."""
    msgs = conv.messages
    if not msgs:
        raise Rejected(Reason.EMPTY_CONVERSATION, "the conversation has no turns")
    first = 1 if msgs[0]["role"] == "system" else 0
    if first == len(msgs):
        raise Rejected(Reason.NO_ASSISTANT_TURN, "the conversation has only a system turn")
    if msgs[first]["role"] == "assistant":
        raise Rejected(
            Reason.STARTS_WITH_ASSISTANT,
            f"messages[{first}] is an assistant turn; a conversation must open with system or user",
        )
    for i in range(1, len(msgs)):
        role, prev = msgs[i]["role"], msgs[i - 1]["role"]
        if role == "system":
            raise Rejected(Reason.MISPLACED_SYSTEM, f"messages[{i}] is a system turn; only the first turn may be")
        if role == prev and role != "tool":
            raise Rejected(
                Reason.CONSECUTIVE_SAME_ROLE, f"messages[{i - 1}] and messages[{i}] are both {role} turns"
            )
    if not any(m["role"] == "assistant" for m in msgs):
        raise Rejected(Reason.NO_ASSISTANT_TURN, "the conversation has no assistant turn to train on")
    return conv
