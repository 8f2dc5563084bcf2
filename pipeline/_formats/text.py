"""Plain text: ``{"text"}``, every token trained (``--field body=text`` for text under another key).

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> read({"text": "Sourdough is a culture of wild yeast."}, Ctx(FormatOptions()))[0].text
'Sourdough is a culture of wild yeast.'
"""

from __future__ import annotations

from pipeline._formats._base import Ctx, Draft, Shape, all_of, has
from pipeline._formats._turns import _content
from pipeline._options import Format


def read(record: dict, ctx: Ctx) -> list[Draft]:
    text = _content(record["text"], "text", ctx, "text").text
    ctx.mapping.append("text (every token trained)")
    return [Draft(text=text)]


SHAPE = Shape(
    name="text",
    claims=all_of(has("text")),
    reads=("text",),
    read=read,
    looks_like="``text``",
    keys="text",
    format=Format.TEXT,
)
