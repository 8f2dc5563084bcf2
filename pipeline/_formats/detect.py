"""Detection: which shape reads a record. One table, :data:`ORDER`; the first shape whose claim a record meets wins.

Shapes that options name (``--field``, ``--messages-field``) come first and apply to the records
that have every mapped path; an explicit ``--format NAME`` reads every other record as that shape
and names the first field it lacks; otherwise the shapes are tried in order by their keys. A
record no shape claims is refused with options computed from its own keys (:func:`suggest`).

>>> detect({"conversations": [], "tools": "[]"})
'sharegpt'
>>> detect({"input_ids": [1, 2], "text": "x"})
'tokens'
>>> [s.name for s in ORDER]  # doctest: +NORMALIZE_WHITESPACE
['fields', 'messages_field', 'tree', 'tokens', 'segments', 'messages', 'preference', 'sharegpt', 'chat', 'xlam',
 'prompt-completion', 'alpaca', 'text']
"""

from __future__ import annotations

import re
from typing import Any, Optional

from pipeline._formats import (alpaca, fields, messages, messages_field, preference, prompt_completion, segments, sharegpt,
                               text, tokens, tree, xlam)
from pipeline._formats._base import ID_KEYS, Reason, Rejected, Shape, _keys, missing_mapped
from pipeline._formats._fix import NAME, ROLE, Fix
from pipeline._formats._turns import CONTENT_KEYS, ROLE_ALIASES, ROLE_KEYS, speaker_name
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
    raise Rejected(Reason.UNKNOWN_FORMAT, f"keys [{_keys(record)}] match no format ({KNOWN_KEYS}); read it with ",
                   fix, words)


# ------------------------------------------------------------------------------------------------
# Suggestions for a record of no known shape.

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


def suggest(record: dict) -> tuple[Fix, str]:
    """Options that would read a record of unknown shape, guessed from its keys and values: the fix, and the
    words that follow it in the detail."""
    # A list of turn objects under any key (or one level down).
    for path, v in [(k, v) for k, v in record.items()] + [
            (f"{k}.{k2}", v2) for k, v in record.items() if isinstance(v, dict) for k2, v2 in v.items()]:
        if isinstance(v, list) and v and all(isinstance(m, dict) for m in v):
            if all("input" in m and "output" in m for m in v):
                return Fix.of(messages_field=path), " (each {input, output} is one exchange)"
            found = _turn_keys(v)
            if found is not None:
                return Fix.of(messages_field=path, **found[0]), found[1]
    system = next((k for k in record if k.lower() in ("system", "system_prompt") and isinstance(record[k], str)), None)
    head: tuple[tuple[str, str], ...] = ()
    if system:  # "SYSTEM: You are ..." (glaive v2) is itself a marked turn
        head = ((system, "transcript" if re.match(r"(?:SYSTEM|System):", record[system]) else "system"),)
    for k, v in record.items():
        if isinstance(v, str) and len(_BUILTIN_RE.findall(v)) >= 2 and k != system:
            return Fix.of(fields=head + ((k, "transcript"),)), ""
    keys = [k for k in record if isinstance(record[k], (str, list, int, float)) and not isinstance(record[k], bool)]
    user = next((k for w in _USER_WORDS for k in keys if k.lower() == w), None)
    assistant = next((k for w in _ASSISTANT_WORDS for k in keys if k.lower() == w and k != user), None)
    if user and assistant:
        return Fix.of(fields=head + ((user, "user"), (assistant, "assistant"))), ""
    lists = _string_lists(record)
    for i, (p1, v1) in enumerate(lists):  # questions and answers as parallel lists (MT-bench: turns, choices[0].turns)
        for p2, v2 in lists[i + 1:]:
            if len(v1) == len(v2):
                return Fix.of(fields=head + ((p1, "user"), (p2, "assistant"))), ""
    if lists:
        path = max(lists, key=lambda pv: sum(map(len, pv[1])))[0]
        if len(record[path] if path in record else ()) > 1:
            return Fix.of(messages_field=path), " (its strings alternate user, assistant)"
    strings = [k for k in keys if isinstance(record[k], str) and k not in ID_KEYS]
    if len(strings) == 1:
        return Fix.of(fields=((strings[0], "text"),)), " (plain text, every token trained), or --field NAME=ROLE per turn"
    return Fix.of(fields=((NAME, ROLE),)), " for each turn's field, or --messages-field PATH for a list of turns"


def _turn_keys(v: list[dict]) -> Optional[tuple[dict[str, Any], str]]:
    """For a list of turn objects: the options beside ``--messages-field`` that read it (its speaker and text keys
    when they are not the usual ones, the speaker names no built-in role covers) and the words after them; None
    when no key looks like the speaker or the text."""
    rk = next((k for k in ROLE_KEYS if k in v[0]), None)
    ck = next((k for k in CONTENT_KEYS if k in v[0]), None)
    opts: dict[str, Any] = {}
    if ck is None:  # the text: the key with the longest strings
        texts = [k for k in v[0] if isinstance(v[0][k], str) and k != rk]
        ck = max(texts, key=lambda k: sum(len(m.get(k) or "") for m in v if isinstance(m.get(k), str)), default=None)
        if ck is None:
            return None
        opts["content_key"] = ck
    if rk is None:  # the speaker: a key with few distinct short values
        cands = [k for k in v[0] if k != ck and all(isinstance(m.get(k), (str, int, bool)) for m in v)]
        cands = [k for k in cands if len({str(m[k]) for m in v}) <= max(2, len(v) // 2)]
        if not cands:
            return None
        rk = cands[0]
        opts = {"role_key": rk, **opts}
    names = list(dict.fromkeys(speaker_name(m[rk]) for m in v if rk in m))
    unknown = [n for n in names if n.lower() not in ROLE_ALIASES]
    if not unknown:
        return opts, ""
    guess = ("user", "assistant") if len(names) == 2 else (ROLE, ROLE)
    opts["roles"] = tuple((n, guess[min(i, 1)]) for i, n in enumerate(names) if n in unknown)
    return opts, " (check the roles with preview)"


_BUILTIN_RE = re.compile(r"(?:(?:\A|\n)[ \t]*(?:Human|Assistant|User|USER|ASSISTANT):|### (?:Human|Assistant))")
