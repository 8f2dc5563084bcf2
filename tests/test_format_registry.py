"""The formats registry holds together: one shape, one module, one fixture, one place in ORDER.

* Every registered shape reads records of a fixture file in ``tests/shapes/`` (the ``SHAPES`` table
  of test_formats.py), and every fixture record is read as a registered shape.
* ``Format``, the package docstring's table, ``docs/formats.md`` and the ``unknown_format`` list
  follow :data:`ORDER`.
* Claims are disjoint or ordered: where a record has the keys of two shapes, the pair is in the
  reviewed :data:`OVERLAPS` list (winner first) and detection agrees. A new overlap fails here
  until someone decides it.
* Every field is read or counted: a shape's ``read`` touches only the keys it declares, and a key
  added anywhere in a fixture record comes out in the conversation, as an ``ignored_field`` note,
  or as a refusal. Never silently gone.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import Format
from tests._internals import (
    KNOWN_KEYS, NOTE_KEYS, ORDER, REGISTRY, FormatOptions, Rejected, _formats as formats, by_name, conversations,
    detect, read_as, shape_table,
)
from tests.test_formats import SHAPES, load

ROOT = Path(__file__).resolve().parents[1]


def _fixture_records() -> list[tuple[str, int, dict, dict]]:
    """(fixture, position, record, options) of every fixture record that is not refused by design."""
    out = []
    for fixture, (name, opts, expected) in sorted(SHAPES.items()):
        for pos, rec in load(name):
            if expected[pos][0] != "rejected":
                out.append((fixture, pos, rec, opts))
    return out


FIXTURES = _fixture_records()


def _shape_of(rec: dict, opts: dict) -> str:
    return detect(rec, FormatOptions(**opts))


def test_every_registered_shape_has_fixture_records_and_every_fixture_a_shape():
    read_as = {_shape_of(rec, opts) for _, _, rec, opts in FIXTURES}
    assert read_as == set(REGISTRY), (set(REGISTRY) - read_as, read_as - set(REGISTRY))


def test_the_registry_refuses_a_second_shape_of_one_name():
    with pytest.raises(ValueError, match="registered twice"):
        by_name((ORDER[0], ORDER[0]))
    assert list(REGISTRY) == [s.name for s in ORDER]


def test_format_enum_docstring_docs_and_unknown_list_follow_order():
    assert {s.format for s in ORDER if s.format is not None} == set(Format) - {Format.AUTO}
    assert shape_table() in formats.__doc__
    assert KNOWN_KEYS == ", ".join(s.keys for s in ORDER if s.keys)
    with pytest.raises(Rejected, match=re.escape(f"match no format ({KNOWN_KEYS})")):
        formats.normalize({"zz": 1}, FormatOptions())
    # docs/formats.md's detection paragraph names each detected shape's first key, in ORDER.
    docs = (ROOT / "docs" / "formats.md").read_text()
    para = docs[docs.index("**Detection**"):]
    para = para[: para.index("\n\n")]
    at = [para.find(f"`{s.claims.needs[0].name}`") for s in ORDER if s.claims.mapped is None]
    assert -1 not in at and at == sorted(at), para


# ------------------------------------------------------------------------------------------------
# Claims: disjoint, or ordered by a reviewed decision.

OVERLAPS = [  # (winner, loser): a record with the keys of both is read as the winner. Reviewed; ORDER agrees.
    *[("tokens", s) for s in ("segments", "messages", "preference", "sharegpt", "chat", "xlam", "prompt-completion",
                              "alpaca", "text")],
    *[("segments", s) for s in ("messages", "preference", "sharegpt", "chat", "xlam", "prompt-completion", "alpaca", "text")],
    # messages beside chosen/rejected (UltraFeedback binarized: messages is the chosen conversation): messages
    *[("messages", s) for s in ("preference", "sharegpt", "chat", "xlam", "prompt-completion", "alpaca", "text")],
    # a pair is refused without --preference, never read as one of its halves (LLaMA-Factory's ranking form
    # has conversations, its Alpaca form instruction)
    *[("preference", s) for s in ("sharegpt", "chat", "xlam", "prompt-completion", "alpaca", "text")],
    *[("sharegpt", s) for s in ("chat", "xlam", "prompt-completion", "alpaca", "text")],
    *[("chat", s) for s in ("xlam", "prompt-completion", "alpaca", "text")],
    # query + answers is a tool-call record even beside prompt/instruction/text keys
    *[("xlam", s) for s in ("prompt-completion", "alpaca", "text")],
    ("prompt-completion", "alpaca"), ("prompt-completion", "text"),
    ("alpaca", "text"),
]
"""Shapes that options name (``fields``, ``messages_field``) win over every other by design."""


def _one_record_per_shape() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for _, _, rec, opts in FIXTURES:
        name = _shape_of(rec, opts)
        if REGISTRY[name].claims.mapped is None:
            out.setdefault(name, rec)
    return out


def test_claims_are_disjoint_or_a_reviewed_overlap():
    records = _one_record_per_shape()
    order = [s.name for s in ORDER]
    seen = set()
    for a, b in itertools.combinations(sorted(records), 2):
        for merged in ({**records[a], **records[b]}, {**records[b], **records[a]}):
            both = [n for n in (a, b) if not REGISTRY[n].claims.missing(merged, FormatOptions())]
            if len(both) < 2:
                continue
            pair = tuple(sorted((a, b), key=order.index))
            assert pair in OVERLAPS, f"{a} and {b} both claim {sorted(merged)}: add {pair} to OVERLAPS (winner first)"
            assert detect(merged) == pair[0]
            seen.add(pair)
    assert set(OVERLAPS) <= seen, f"OVERLAPS lists pairs that no longer overlap: {set(OVERLAPS) - seen}"


# ------------------------------------------------------------------------------------------------
# Every field read or counted.


class Touched(dict):
    """A record that remembers which keys were read (``[]`` or ``get``)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.touched: set[str] = set()

    def __getitem__(self, key):
        self.touched.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        if key in self:  # asking for a key the record lacks reads nothing
            self.touched.add(key)
        return super().get(key, default)


@pytest.mark.parametrize("case", range(len(FIXTURES)), ids=lambda i: f"{FIXTURES[i][0]}@{FIXTURES[i][1]}")
def test_read_touches_only_the_keys_a_shape_declares(case):
    _, _, rec, opts = FIXTURES[case]
    options = FormatOptions(**opts)
    shape = REGISTRY[detect(rec, options)]
    tracked = Touched(rec)
    read_as(shape, tracked, options)  # detection looks at keys; reading must stay within the declared ones
    assert tracked.touched <= shape.top_keys(rec, options), tracked.touched - shape.top_keys(rec, options)


def _tokens(path: str) -> list:
    """``a.b[2][1:].c`` -> ["a", "b", (2, 3), (1, None), "c"]: keys, and index ranges [lo, hi)."""
    out: list = []
    for m in re.finditer(r"\[(-?\d*)(:?)(-?\d*)\]|([^.\[\]]+)", path):
        if m.group(4) is not None:
            out.append(m.group(4))
        elif not m.group(1) and not m.group(2):
            out.append((None, None))  # "[]": any item
        else:
            lo = int(m.group(1)) if m.group(1) else 0
            hi = (int(m.group(3)) if m.group(3) else None) if m.group(2) else lo + 1
            out.append((lo, hi))
    return out


def _covers(note: str, location: str) -> bool:
    """Does the note's path (``messages[].x``, ``choices[1:]``) cover ``location`` (``messages[2].x``)?"""
    a, b = _tokens(note), _tokens(location)
    if len(a) > len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, str) or isinstance(y, str):
            if x != y:
                return False
        elif x != (None, None) and not (x[0] <= y[0] and (x[1] is None or y[0] < x[1])):
            return False
    return True


def _dicts(value: Any, path: str = "") -> list[tuple[str, dict]]:
    """Every object inside a record, with its path (``""`` for the record itself)."""
    out = []
    if isinstance(value, dict):
        out.append((path, value))
        for k, v in value.items():
            out += _dicts(v, f"{path}.{k}" if path else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _dicts(v, f"{path}[{i}]")
    return out


KEY_NAMES = st.one_of(
    st.sampled_from(["role", "from", "content", "value", "text", "name", "system", "tools", "weight", "type", "input",
                     "output", "history", "reasoning", "arguments", "label", "lang", "meta", "index", "refusal",
                     "cache_control", "rank", "replies", "prompt", "chosen", "rejected", "query", "answers"]),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.integers(0, len(FIXTURES) - 1), where=st.integers(0, 10_000), key=KEY_NAMES,
       wrap=st.sampled_from(["str", "obj", "list"]), data=st.data())
def test_a_field_added_anywhere_is_read_or_counted(case, where, key, wrap, data):
    _, _, rec, opts = FIXTURES[case]
    rec = json.loads(json.dumps(rec))
    places = _dicts(rec)
    path, obj = places[where % len(places)]
    if path == "" and key == "id":
        return  # the record's id: the example's id
    marker = "\u27e6" + data.draw(st.text(alphabet="0123456789abcdef", min_size=6, max_size=6)) + "\u27e7"
    obj[key] = {"str": marker, "obj": {"note": marker}, "list": [marker]}[wrap]
    location = f"{path}.{key}" if path else key
    try:
        convs = conversations(rec, FormatOptions(**opts))
    except Rejected:
        return  # refused, with a reason: nothing packed, nothing lost unseen
    out = json.dumps([[c.messages, c.tools, c.text, c.segments] for c in convs], ensure_ascii=False)
    if marker in out:
        return  # read into the conversation
    ignored = [n.split(":", 1)[1] for c in convs for n in c.notes if n.startswith("ignored_field:")]
    other = {"chosen": ("rejected", "non_preferred_output"), "rejected": ("chosen", "preferred_output")}
    if any(c.notes.get("other_side_not_trained") for c in convs) and \
            _tokens(location)[0] in other[opts["preference"]]:
        return  # the side of a preference pair that --preference leaves out: counted as a whole
    if re.search(r"\[\d+\]", location) and any(c.notes.get(k) for c in convs for k in (*NOTE_KEYS, "tree_messages_off_path")):
        return  # inside a turn that hygiene dropped or trimmed, or a message on no kept path: counted whole
    assert any(_covers(n, location) for n in ignored), f"{location} = {obj[key]!r} is neither read nor counted " \
                                                       f"(ignored: {ignored})"
