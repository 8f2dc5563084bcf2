"""normalize()'s fast path for clean Alpaca and messages records gives exactly what the general path
gives (or steps aside): a property test over records built to sit on its edges."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests._internals import FormatOptions, Rejected, _fast, _normalize, normalize

TEXT = st.one_of(st.sampled_from(["", " ", "\n", "hi", " padded ", "<think>r</think>a", "<think>", "é🚀", "\ud800"]),
                 st.text(max_size=12))
VALUE = st.one_of(TEXT, st.none(), st.integers(-3, 3), st.booleans(), st.lists(st.integers(), max_size=2))


@st.composite
def alpaca(draw):
    rec = {"instruction": draw(st.one_of(TEXT, VALUE)), "output": draw(st.one_of(TEXT, VALUE))}
    if draw(st.booleans()):
        rec["input"] = draw(st.one_of(TEXT, VALUE))
    if draw(st.booleans()):
        rec["id"] = draw(st.one_of(st.text(max_size=4), st.integers()))
    if draw(st.integers(0, 5)) == 0:
        rec[draw(st.sampled_from(["system", "history", "response", "extra", "messages"]))] = draw(VALUE)
    return rec


@st.composite
def messages(draw):
    roles = draw(st.lists(st.sampled_from(["user", "assistant", "system", "User", "gpt", None]), max_size=6))
    turns = []
    for r in roles:
        t = {"role": r, "content": draw(st.one_of(TEXT, VALUE))}
        if draw(st.integers(0, 6)) == 0:
            t[draw(st.sampled_from(["name", "reasoning_content", "train", "tool_calls"]))] = draw(VALUE)
        turns.append(t)
    if draw(st.booleans()):  # the common case: clean alternation
        n = draw(st.integers(1, 3))
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": draw(TEXT)} for i in range(2 * n)]
    rec = {"messages": turns}
    if draw(st.integers(0, 5)) == 0:
        rec[draw(st.sampled_from(["id", "tools", "system", "extra"]))] = draw(VALUE)
    return rec


OPTIONS = [FormatOptions(), FormatOptions(train_on="all"), FormatOptions(leading_assistant="keep"),
           FormatOptions(system_prompt="Be brief."), FormatOptions(roles=(("user", "assistant"),))]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "default" if o == FormatOptions() else "changed")
@settings(max_examples=400, deadline=None)
@given(record=st.one_of(alpaca(), messages()))
def test_the_fast_path_equals_the_general_path(options, record):
    try:
        fast = _fast(record, options)
    except Rejected as e:  # refused on the fast path: the general path refuses it for the same reason
        with pytest.raises(Rejected) as general:
            _normalize(record, options)
        assert (general.value.reason, general.value.detail) == (e.reason, e.detail)
        return
    try:
        general = _normalize(record, options)
    except Rejected as e:
        assert fast is None, f"fast path packed a record the general path refuses: {e}"
        with pytest.raises(Rejected):
            normalize(record, options)
        return
    if fast is not None:
        assert fast == general
    assert normalize(record, options) == general


def test_the_fast_path_takes_the_clean_cases():
    o = FormatOptions()
    assert _fast({"id": 3, "instruction": "Add 2 and 3.", "input": "", "output": "5"}, o) is not None
    assert _fast({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}, o) is not None
    assert _fast({"instruction": "x", "output": "y", "category": "z"}, o) is None  # an ignored field is counted
    assert _fast({"instruction": "x", "output": "y"}, FormatOptions(system_prompt="s")) is None
