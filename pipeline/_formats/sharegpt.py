"""ShareGPT: ``{"conversations": [{"from": "human", "value"}, {"from": "gpt", "value"}], "system", "tools"}``.

Glaive and LLaMA-Factory tool use ride on it: ``function_call`` turns are assistant tool calls,
``observation`` turns tool results, ``tools`` JSON text.

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> [t.role for t in read({"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},
...                       Ctx(FormatOptions()))[0].turns]
['user', 'assistant']
"""

from __future__ import annotations

from pipeline._formats._base import Ctx, Draft, Shape, all_of, has
from pipeline._formats.messages import read_turns
from pipeline._options import Format


def read(record: dict, ctx: Ctx) -> list[Draft]:
    return [Draft(turns=read_turns(record, ctx, "conversations"))]


SHAPE = Shape(
    name="sharegpt",
    claims=all_of(has("conversations")),
    reads=("conversations",),
    common=("system", "tools"),
    read=read,
    looks_like="``conversations: [{from, value}]`` (or role/content)",
    keys="conversations",
    format=Format.SHAREGPT,
)
