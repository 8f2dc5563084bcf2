"""Prompt/completion: ``{"prompt", "completion"}`` as strings, or as lists of messages (TRL's conversational form).

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> [(t.role, t.content) for t in read({"prompt": "Capital of Canada?", "completion": "Ottawa"}, Ctx(FormatOptions()))[0].turns]
[('user', 'Capital of Canada?'), ('assistant', 'Ottawa')]
"""

from __future__ import annotations

from pipeline._formats._base import Ctx, Draft, Shape, Turn, all_of, has
from pipeline._formats._turns import ROLE_KEYS, _content, _speaker_words, _turn_list
from pipeline._options import Format


def read(record: dict, ctx: Ctx) -> list[Draft]:
    turns: list[Turn] = []
    for key, role in (("prompt", "user"), ("completion", "assistant")):
        v = record[key]
        if isinstance(v, list) and all(isinstance(m, dict) and any(k in m for k in ROLE_KEYS) for m in v):
            turns += _turn_list(v, key, ctx)
            ctx.mapping.append(f"{key}[]: " + _speaker_words(ctx))
        else:
            turns.append(Turn(role, _content(v, key, ctx, role).text, key))
            ctx.mapping.append(f"{key} -> {role}")
    return [Draft(turns=turns)]


SHAPE = Shape(
    name="prompt-completion",
    claims=all_of(has("prompt"), has("completion")),
    reads=("prompt", "completion"),
    common=("system", "tools"),
    read=read,
    looks_like="``prompt`` + ``completion`` (strings, or lists of messages as in TRL)",
    keys="prompt/completion",
    format=Format.PROMPT_COMPLETION,
)
