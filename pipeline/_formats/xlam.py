"""xLAM / APIGen function calling: ``{"query", "tools", "answers": [{"name", "arguments"}, ...]}``.

The user's query, then one assistant turn whose tool calls are the answers, arguments kept
exactly as the record holds them (rendered as the template's tool calls). ``answers`` and
``tools`` may be JSON text (as Salesforce/xlam-function-calling-60k ships them) or objects.

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> rec = {"query": "Weather in Oslo?", "answers": '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "tools": "[]"}
>>> [t.message() for t in read(rec, Ctx(FormatOptions()))[0].turns]  # doctest: +NORMALIZE_WHITESPACE
[{'role': 'user', 'content': 'Weather in Oslo?'},
 {'role': 'assistant', 'content': '', 'tool_calls': [{'type': 'function', 'function': {'name': 'get_weather', 'arguments': {'city': 'Oslo'}}}]}]
"""

from __future__ import annotations

from pipeline._formats._base import Ctx, Draft, Shape, Turn, all_of, has
from pipeline._formats._turns import _content, _tool_calls


def read(record: dict, ctx: Ctx) -> list[Draft]:
    query = _content(record["query"], "query", ctx, "user").text
    calls = _tool_calls(record["answers"], "answers", ctx)
    ctx.mapping.append(f"query -> user, answers -> assistant tool calls ({len(calls)})")
    return [Draft(turns=[Turn("user", query, "query"), Turn("assistant", "", "answers", tool_calls=calls or None)])]


SHAPE = Shape(
    name="xlam",
    claims=all_of(has("query"), has("answers")),
    reads=("query", "answers"),
    common=("system", "tools"),
    read=read,
    looks_like="``query`` + ``answers: [{name, arguments}]`` (xLAM/APIGen function calling; JSON text or objects)",
    keys="query/answers",
)
