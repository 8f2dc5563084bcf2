"""Every ``--field`` lands where it means (issue 35, "Every field lands where it means, and every choice is said").

A field mapped to ``system`` opens the conversation, whatever its key and wherever the turns come from
(``--field`` only, or after a ``--messages-field`` list); hygiene trims and drops only turns no mapping
named; a mapped field it would cut refuses the record as ``mapped_field_cut``, naming the field.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._internals import FormatOptions, Reason, Rejected, conversations

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_a_mapped_system_prompt_opens_a_turn_list():
    # The record: before the fix the system message was appended after the turns, then trimmed as a
    # trailing turn ("trailing turns trimmed 1"), and missing from every example.
    record = {"conversation_id": "c1", "system_prompt": "You are terse.",
              "turns": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    (conv,) = conversations(record, FormatOptions(messages_field="turns", fields=(("system_prompt", "system"),)))
    assert conv.messages == [
        {"role": "system", "content": "You are terse."},  # first, though the mapping came after the list
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert "trailing_turns_trimmed" not in conv.notes  # nothing was cut
    assert conv.notes == {"ignored_field:conversation_id": 1}
    assert "system_prompt -> system" in conv.mapping


def test_a_system_field_given_last_still_goes_first():
    # --field q=user --field a=assistant --field s=system: the system text opens the conversation
    (conv,) = conversations({"q": "Q", "a": "A", "s": "S"},
                            FormatOptions(fields=(("q", "user"), ("a", "assistant"), ("s", "system"))))
    assert [(m["role"], m["content"]) for m in conv.messages] == [("system", "S"), ("user", "Q"), ("assistant", "A")]
    assert conv.notes == {}


def test_a_mapped_system_field_beside_the_system_column_keeps_both():
    # the record's own `system` column and a mapped `persona`: both texts, in the one system turn, column first
    record = {"system": "Col.", "persona": "Field.", "turns": ["hi", "hello"]}
    (conv,) = conversations(record, FormatOptions(messages_field="turns", fields=(("persona", "system"),)))
    assert conv.messages[0] == {"role": "system", "content": "Col.\n\nField."}
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"]


@pytest.mark.parametrize("fields, messages_field, record, named", [
    # a user field after the answer would be trimmed as a trailing turn
    ((("q", "user"), ("a", "assistant"), ("more", "user")), None, {"q": "Q", "a": "A", "more": "M"}, "more"),
    # after a list that ends on an answer, a mapped user question would be trimmed
    ((("q", "user"),), "turns", {"turns": ["hi", "hello"], "q": "Q"}, "q"),
    # an assistant field that opens the conversation would be dropped as a leading assistant turn
    ((("a", "assistant"), ("q", "user"), ("b", "assistant")), None, {"a": "A", "q": "Q", "b": "B"}, "a"),
])
def test_a_mapped_field_that_hygiene_would_cut_refuses_the_record(fields, messages_field, record, named):
    with pytest.raises(Rejected) as e:
        conversations(record, FormatOptions(fields=fields, messages_field=messages_field))
    assert e.value.reason is Reason.MAPPED_FIELD_CUT
    assert f"--field {named}=" in e.value.detail and "turn order" in e.value.detail, e.value.detail


def test_unmapped_turns_of_a_list_are_still_trimmed():
    # a list's own trailing question is data, trimmed and counted as before; the mapped system field stays
    record = {"sys": "S", "turns": ["hi", "hello", "one more?"]}
    (conv,) = conversations(record, FormatOptions(messages_field="turns", fields=(("sys", "system"),)))
    assert [m["content"] for m in conv.messages] == ["S", "hi", "hello"]
    assert conv.notes == {"trailing_turns_trimmed": 1}


# ------------------------------------------------------------------------------------------------
# Property: over random keys and layouts, each mapped text appears exactly once, in its role; or the record
# is refused as mapped_field_cut, naming a field that is not a system field; layouts in turn order never are.

_KEY = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8).map(lambda s: "k" + s)  # never a key a shape reads itself (system, tools, id, images, ...)
_ROLE = st.sampled_from(["user", "assistant", "system"])


@st.composite
def _layouts(draw):
    """(record, options, mapped [(text, role)], in_order): a record laid out one of six ways, with random keys."""
    keys = iter(draw(st.lists(_KEY, min_size=8, max_size=8, unique=True)))
    texts = iter(f"<T{i}>" for i in range(1000))
    record: dict = {}
    fields: list[tuple[str, str]] = []
    mapped: list[tuple[str, str]] = []
    messages_field = None
    layout = draw(st.sampled_from(["flat", "list+field", "list+system", "nested", "flat+system_column",
                                   "list+system_column"]))

    def field(role: str, path: str = "") -> None:
        key = path or next(keys)
        text = next(texts)
        if path:  # a nested path: k1.k2 or k1[0].k2
            outer, inner = next(keys), next(keys)
            nested = draw(st.booleans())
            record[outer] = [{inner: text}] if nested else {inner: text}
            key = f"{outer}[0].{inner}" if nested else f"{outer}.{inner}"
        else:
            record[key] = text
        fields.append((key, role))
        mapped.append((text, role))

    if layout.startswith("list"):
        messages_field = next(keys)
        n = draw(st.integers(1, 4))
        record[messages_field] = [{"from": ("human", "gpt")[i % 2], "value": next(texts)} for i in range(n)]
        ends_on_answer = n % 2 == 0
    if layout in ("flat", "nested", "flat+system_column"):
        roles = draw(st.lists(_ROLE, min_size=2, max_size=5))
        ordered = draw(st.booleans())
        if ordered:  # user, assistant pairs in turn order, the system fields anywhere
            plain = ["user", "assistant"] * (len([r for r in roles if r != "system"]) // 2 or 1)
            roles = [r for r in roles if r == "system"] + plain
            roles = draw(st.permutations(roles)) if "system" in roles else roles
            plain_order = [r for r in roles if r != "system"]
            in_order = plain_order == ["user", "assistant"] * (len(plain_order) // 2)
        else:
            in_order = False
        for i, role in enumerate(roles):
            field(role, path="nested" if layout == "nested" and i == 0 else "")
    elif layout == "list+field":
        role = draw(_ROLE)
        field(role)
        in_order = role == "system" or (role == "assistant" and not ends_on_answer)
    else:  # list+system, list+system_column: a system field, given after the list
        field("system")
        in_order = True
    if layout == "list+system_column":
        record["system"] = next(texts)
        mapped.append((record["system"], "system"))  # a turn list's system column is read too, once, as system
    elif layout == "flat+system_column":  # --field alone reads what it maps: an unmapped column is counted
        record["system"] = next(texts)
    return record, FormatOptions(fields=tuple(fields), messages_field=messages_field), mapped, in_order


@settings(max_examples=300, **SETTINGS)
@given(_layouts())
def test_every_mapped_field_lands_once_in_its_role(layout):
    record, options, mapped, in_order = layout
    try:
        convs = conversations(record, options)
    except Rejected as e:
        answers = any(r == "assistant" for _, r in mapped) or any(
            t.get("from") == "gpt" for t in record.get(options.messages_field, ()))
        if e.reason is Reason.NO_ASSISTANT_TURN:  # nothing to train on: refused as before, mapped fields or not
            assert not answers, (record, options, e)
            return
        assert not in_order, (record, options, e)
        assert e.reason is Reason.MAPPED_FIELD_CUT, (record, options, e)
        named = [p for p, r in options.fields if f"--field {p}={r}" in e.detail]
        assert named and all(r != "system" for p, r in options.fields if p in named), e.detail
        return
    (conv,) = convs
    if "system" in record and not options.messages_field:
        assert conv.notes.get("ignored_field:system") == 1 and record["system"] not in str(conv.messages)
    assert conv.messages[0]["role"] == "system" or not any(r == "system" for _, r in mapped)
    for text, role in mapped:
        holders = [m for m in conv.messages if text in m["content"]]
        assert len(holders) == 1 and holders[0]["role"] == role, (text, role, conv.messages)
        assert sum(m["content"].count(text) for m in conv.messages) == 1
    # what hygiene cut was no mapping's: every turn it trimmed or dropped was a list's own
    assert conv.messages[-1]["role"] == "assistant"
