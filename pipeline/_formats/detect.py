"""Detection: which shape reads a record. One table, :data:`ORDER`; the first shape whose claim a record meets wins.

Shapes that options name (``--field``, ``--messages-field``) come first and apply to the records
that have every mapped path; an explicit ``--format NAME`` reads every other record as that shape
and names the first field it lacks; otherwise the shapes are tried in order by their keys. A
record no shape claims is refused with options computed from its own keys (:func:`suggest`, in
:mod:`pipeline._formats._suggest`), or, where no reading is unambiguous, with words that say why.

>>> detect({"conversations": [], "tools": "[]"})
'sharegpt'
>>> detect({"input_ids": [1, 2], "text": "x"})
'tokens'
>>> [s.name for s in ORDER]  # doctest: +NORMALIZE_WHITESPACE
['fields', 'messages_field', 'tree', 'tokens', 'segments', 'messages', 'preference', 'sharegpt', 'chat', 'xlam',
 'prompt-completion', 'alpaca', 'text']
"""

from __future__ import annotations

from typing import Any

from pipeline._formats import (alpaca, fields, messages, messages_field, preference, prompt_completion, segments, sharegpt,
                               text, tokens, tree, xlam)
from pipeline._formats._base import Reason, Rejected, Shape, _keys, missing_mapped
from pipeline._formats._suggest import suggest
from pipeline._options import Format, FormatOptions

ORDER: tuple[Shape, ...] = (  # first matching claim wins; reorder only with a test (tests/test_formats.py OVERLAPS)
    fields.SHAPE, messages_field.SHAPE, tree.SHAPE,  # when options name them
    tokens.SHAPE, segments.SHAPE, messages.SHAPE,
    preference.SHAPE,  # conversations + chosen/rejected: above sharegpt; instruction + chosen: above alpaca
    sharegpt.SHAPE, messages.DIALOGUE,
    xlam.SHAPE,  # query + answers: above alpaca and text
    prompt_completion.SHAPE, alpaca.SHAPE, text.SHAPE,
)


def by_name(shapes: tuple[Shape, ...]) -> dict[str, Shape]:
    """The registry: shapes by name; a second shape of one name is refused."""
    out: dict[str, Shape] = {}
    for shape in shapes:
        if shape.name in out:
            raise ValueError(f"shape {shape.name!r} is registered twice")
        out[shape.name] = shape
    return out


REGISTRY: dict[str, Shape] = by_name(ORDER)
BY_FORMAT: dict[Format, Shape] = {s.format: s for s in ORDER if s.format is not None}
KNOWN_KEYS = ", ".join(s.keys for s in ORDER if s.keys)
"""The keys detection knows, in words, for the ``unknown_format`` detail."""


def shape_table() -> str:
    """The table of shapes in the package docstring (tests hold the two equal)."""
    width = max(len(s.name) for s in ORDER)
    rule = "=" * width + "  " + "=" * 73
    rows = [f"{s.name:<{width}}  {s.looks_like}" for s in ORDER]
    return "\n".join([rule, *rows, rule])


def detect(record: Any, options: FormatOptions = FormatOptions()) -> str:
    """The name of the shape ``record`` is read as under ``options`` (see the module docstring), or :class:`Rejected`."""
    if not isinstance(record, dict):
        kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
        raise Rejected(Reason.NOT_AN_OBJECT, f"record is a JSON {kinds.get(type(record), type(record).__name__)}, "
                                             "expected an object")
    o = options
    missing: list[str] = []
    asked = ""
    for shape in ORDER:
        claim = shape.claims
        if claim.mapped is not None and claim.applies(o):
            lacks = claim.missing(record, o)
            if not lacks:
                return shape.name
            if not missing:
                missing, asked = lacks, claim.given(o, lacks)
    if o.format is not Format.AUTO:
        shape = BY_FORMAT[o.format]
        absent = shape.claims.missing(record, o, explicit=True)
        if absent:
            raise Rejected(Reason.MISSING_FIELD, f"field {absent[0]!r} (format {o.format.value}) is missing; the record "
                                                 f"has keys [{_keys(record)}]")
        return shape.name
    for shape in ORDER:
        if shape.claims.mapped is None and not shape.claims.missing(record, o):
            return shape.name
    if missing:  # a mapping was given for this data: name what it lacks, never "pass --field"
        raise missing_mapped(missing, asked, record)
    fix, words = suggest(record)
    said = f"keys [{_keys(record)}] match no format ({KNOWN_KEYS}); "
    if fix is None:  # no reading is unambiguous: say what is
        raise Rejected(Reason.UNKNOWN_FORMAT, said + words)
    raise Rejected(Reason.UNKNOWN_FORMAT, said + "read it with ", fix, words)
