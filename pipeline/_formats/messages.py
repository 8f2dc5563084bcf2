"""Lists of turn objects under a known key: OpenAI ``messages``, and ``conversation``/``dialog``/``dialogue``/``chat``/
``texts``.

``{"messages": [{"role", "content"}], "tools", "system"}``: content as a string, parts, or an
object; ``reasoning_content``/``thinking``; ``tool_calls`` and ``tool`` results. The second shape,
``chat``, is the same list under ``conversation`` (lmsys-chat), ``dialog``, ``dialogue``, ``chat`` or
``texts``, detected only when it holds turn objects (or Capybara's ``{input, output}`` and the_cauldron's
``{user, assistant}`` exchanges); any other key takes ``--messages-field``.

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> ctx = Ctx(FormatOptions())
>>> [t.message() for t in read({"messages": [{"role": "user", "content": "Hi"}, {"role": "gpt", "content": "Hello"}]}, ctx)[0].turns]
[{'role': 'user', 'content': 'Hi'}, {'role': 'assistant', 'content': 'Hello'}]
>>> ctx.mapping
['messages[]: user->user, gpt->assistant']
"""

from __future__ import annotations

from typing import Optional

from pipeline._formats._base import Claim, Conversation, Ctx, Draft, Need, Shape, Turn, all_of, has
from pipeline._formats._turns import EXCHANGES, ROLE_KEYS, _speaker_words, _turn_list
from pipeline._options import Format


def read_turns(record: dict, ctx: Ctx, key: str) -> list[Turn]:
    """The turn objects under ``key``, with the words preview shows."""
    turns = _turn_list(record[key], key, ctx)
    words = _speaker_words(ctx)
    if words or not any(m.startswith(f"{key}[]: ") for m in ctx.mapping):  # exchanges say their own mapping
        ctx.mapping.insert(0, f"{key}[]: " + (words or "no turns"))
    return turns


def read(record: dict, ctx: Ctx) -> list[Draft]:
    return [Draft(turns=read_turns(record, ctx, "messages"))]


# The clean shape most SFT data comes in, built directly: about 4x faster than the general path,
# which is the per-record Python the encode stage runs beside the tokenizer. Anything short of clean
# (another key, a non-string, an empty or whitespace turn, an inline <think>, roles out of order)
# returns None and takes the general path; tests/test_fast_path.py holds the two equal.
_FAST_KEYS = frozenset({"id", "messages"})
_FAST_TURN = {"role", "content"}
_MAPPING = ("messages[]: user->user, assistant->assistant",)


def fast(record: dict) -> Optional[Conversation]:
    if "messages" not in record or not record.keys() <= _FAST_KEYS:
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
    return Conversation(out, shape="messages", mapping=_MAPPING)


SHAPE = Shape(
    name="messages",
    claims=all_of(has("messages")),
    reads=("messages",),
    common=("system", "tools"),
    read=read,
    looks_like="``messages: [{role, content}]`` (OpenAI: parts, reasoning, tool calls)",
    keys="messages",
    format=Format.MESSAGES,
    fast=fast,
)


TURN_KEYS = ("conversation", "dialog", "dialogue", "chat", "texts")
"""Other keys detected as a list of turn objects (lmsys-chat ``conversation``, Capybara, the_cauldron's and
Docmatix's ``texts``); any other key takes ``--messages-field``."""


def _turn_key(record: dict) -> Optional[str]:
    """The first of :data:`TURN_KEYS` that holds a list of turn objects (or ``{input, output}`` / ``{user,
    assistant}`` exchanges)."""
    for key in TURN_KEYS:
        v = record.get(key)
        if isinstance(v, list) and v and all(isinstance(m, dict) and (any(k in m for k in ROLE_KEYS) or any(
                a in m and b in m for a, b in EXCHANGES)) for m in v):
            return key
    return None


def read_chat(record: dict, ctx: Ctx) -> list[Draft]:
    return [Draft(turns=read_turns(record, ctx, _turn_key(record)))]


DIALOGUE = Shape(
    name="chat",
    claims=Claim(needs=(Need("conversation", lambda r: _turn_key(r) is not None),)),
    reads=lambda record, options: (_turn_key(record),),
    common=("system", "tools"),
    read=read_chat,
    looks_like="``conversation``/``dialog``/``dialogue``/``chat``/``texts``: a list of turn objects (lmsys-chat; "
               "Capybara's ``[{input, output}]``; the_cauldron's ``texts: [{user, assistant}]``)",
    keys="conversation/dialog/dialogue/chat/texts",
)
