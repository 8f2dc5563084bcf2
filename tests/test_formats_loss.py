"""No silent loss and no mis-masking in normalization: worked examples, one per way a record's content
could go missing or be trained wrongly (each failed before its fix).

The rule: a record is packed with all the content it holds, or what it does not pack is accounted for
(a dead letter with a reason, or a counted note such as ``ignored_field:<name>``).
"""

from __future__ import annotations

import pytest

from tests._internals import Encoder, Reason, Rejected, _fast, _normalize, normalize
from tests.test_formats import FormatOptions, _examples, pack_options  # packstream's hygiene (--turns cleaned)


def turns(conv) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in conv.messages]


def encode(record: dict, **opts) -> tuple[str, str]:
    """(full decoded text, decoded training targets) of ``record`` packed as ``packstream pack`` does."""
    enc = Encoder(pack_options(opts))
    out = enc.encode([(0, "t.jsonl", 1, record)])
    assert not out.rejected, out.rejected
    (ids, mask), = _examples(out)
    tok = enc.renderer.tok
    return tok.decode(ids), tok.decode([i for i, m in zip(ids, mask) if m])


# ------------------------------------------------------------------------------------------------
# 1. Alpaca: alternative keys of one slot (input/context, output/response, output/instances).


AMBIGUOUS_ALPACA = [
    ({"instruction": "Summarize", "input": "The cat sat.", "context": "EXTRA CONTEXT", "output": "A cat sat."},
     ("'input'", "'context'"), "--field instruction=user --field input=user --field context=user --field output=assistant"),
    ({"instruction": "Say hi", "output": "hi", "response": "hello there"},
     ("'output'", "'response'"), "--field output=assistant (or --field response=assistant)"),
    ({"instruction": "Do tasks", "output": "main out", "instances": [{"input": "i1", "output": "INSTANCE OUT"}]},
     ("'output'", "'instances'"), "--field instruction=user --field output=assistant (instances is then counted"),
]


@pytest.mark.parametrize("case", range(len(AMBIGUOUS_ALPACA)))
def test_alpaca_keys_of_one_slot_holding_different_things_are_refused(case):
    rec, _, remedy = AMBIGUOUS_ALPACA[case]
    with pytest.raises(Rejected) as e:
        normalize(rec, FormatOptions())
    assert e.value.reason is Reason.AMBIGUOUS_FIELD, str(e.value)
    a, b = (k.strip("'") for k in AMBIGUOUS_ALPACA[case][1])
    assert e.value.detail.startswith(f"{a} and {b} both hold something") and remedy in e.value.detail, e.value.detail


def test_alpaca_ambiguity_remedies_work():
    rec, _, _ = AMBIGUOUS_ALPACA[0]
    with pytest.raises(Rejected) as e:
        normalize(rec, FormatOptions())
    assert e.value.fix.text() in e.value.detail.split("read both with")[1].split(", or")[0]
    conv = normalize(rec, e.value.fix.applied(FormatOptions()))
    assert turns(conv) == [("user", "Summarize\n\nThe cat sat.\n\nEXTRA CONTEXT"), ("assistant", "A cat sat.")]
    rec, _, _ = AMBIGUOUS_ALPACA[1]
    with pytest.raises(Rejected) as e:
        normalize(rec, FormatOptions())
    assert e.value.detail.split("pick it with ")[1].startswith(e.value.fix.text())
    conv = normalize(rec, e.value.fix.applied(FormatOptions()))
    assert turns(conv) == [("user", "Say hi"), ("assistant", "hi")] and conv.notes == {"ignored_field:response": 1}
    conv = normalize(rec, e.value.fix.applied(FormatOptions(), alternative=True))  # the other one it names
    assert turns(conv) == [("user", "Say hi"), ("assistant", "hello there")] and conv.notes == {"ignored_field:output": 1}


def test_alpaca_keys_of_one_slot_equal_or_empty_read_the_one_that_holds_text():
    rec = {"instruction": "Say hi", "output": "", "response": "hello there"}
    assert turns(normalize(rec, FormatOptions())) == [("user", "Say hi"), ("assistant", "hello there")]
    rec = {"instruction": "Summarize", "input": "", "context": "The cat sat.", "output": "A cat sat."}
    assert turns(normalize(rec, FormatOptions()))[0] == ("user", "Summarize\n\nThe cat sat.")
    rec = {"instruction": "Say hi", "output": "hi", "response": "hi"}
    assert turns(normalize(rec, FormatOptions())) == [("user", "Say hi"), ("assistant", "hi")]
    rec = {"instruction": "Sort.", "output": "", "instances": [{"input": "b a", "output": "a b"}]}
    assert turns(normalize(rec, FormatOptions())) == [("user", "Sort.\n\nb a"), ("assistant", "a b")]


def test_self_instruct_instance_keys_not_read_are_counted():
    rec = {"instruction": "Sort.", "instances": [{"input": "b a", "output": "a b", "source": "seed"}]}
    assert normalize(rec, FormatOptions()).notes == {"ignored_field:instances[].source": 1}


# ------------------------------------------------------------------------------------------------
# 2. Consecutive same-role turns with different train flags are never merged.


def test_turns_with_different_flags_keep_their_own_loss_mask():
    rec = {"id": 6, "messages": [{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "NOT TRAINED", "weight": 0},
                                 {"role": "assistant", "content": "TRAINED", "weight": 1}]}
    conv = normalize(rec, FormatOptions())
    assert turns(conv) == [("user", "q"), ("assistant", "NOT TRAINED"), ("assistant", "TRAINED")]
    assert conv.train == [None, False, True] and "turns_merged" not in conv.notes
    full, trained = encode(rec)
    assert "NOT TRAINED" in full and trained == "TRAINED<|im_end|><｜end▁of▁sentence｜>"


def test_a_flagged_off_turn_does_not_untrain_its_unflagged_neighbour():
    rec = {"id": 7, "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "NOT TRAINED", "weight": 0},
                                      {"from": "gpt", "value": "DEFAULT"}]}
    conv = normalize(rec, FormatOptions())  # the unflagged answer is the target: not no_assistant_turn
    assert turns(conv)[-1] == ("assistant", "DEFAULT") and conv.train == [None, False, None]
    full, trained = encode(rec)
    assert full.index("NOT TRAINED") < full.index("DEFAULT")
    assert trained == "DEFAULT<|im_end|><｜end▁of▁sentence｜>"


STRICT = ("{%- for m in messages -%}{%- if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role -%}"
          "{{ raise_exception('Conversation roles must alternate') }}{%- endif -%}<|{{ m.role }}|>{{ m.content }}</s>"
          "{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")


def test_a_template_that_refuses_same_role_turns_dead_letters_them_with_a_reason():
    from tests._internals import Renderer

    rec = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "NOT TRAINED", "weight": 0},
                             {"from": "gpt", "value": "DEFAULT"}]}
    with pytest.raises(Rejected, match="template_error: chat template failed: TemplateError: Conversation roles must"):
        Renderer(pack_options({"chat_template": STRICT})).segments(normalize(rec, FormatOptions()), FormatOptions())


def test_equal_flags_still_merge_and_a_leading_run_of_assistant_turns_is_dropped_whole():
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0},
                        {"role": "assistant", "content": "b", "weight": 0}, {"role": "user", "content": "r"},
                        {"role": "assistant", "content": "c"}]}
    conv = normalize(rec, FormatOptions())
    assert turns(conv)[1] == ("assistant", "a\n\nb") and conv.train == [None, False, None, None]
    rec = {"messages": [{"role": "assistant", "content": "Hi", "weight": 0}, {"role": "assistant", "content": "Ask!"},
                        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    conv = normalize(rec, FormatOptions())
    assert turns(conv) == [("user", "q"), ("assistant", "a")] and conv.notes == {"leading_assistant_dropped": 2}
    conv = normalize(rec, FormatOptions(leading_assistant="keep"))
    assert len(conv.messages) == 4 and conv.train[:2] == [False, False]


# ------------------------------------------------------------------------------------------------
# 3. Keys on a turn: read, counted as ignored, or refused as ambiguous.


def _msgs(*extra_turns: dict) -> dict:
    return {"messages": [{"role": "user", "content": "q"}, *extra_turns]}


def test_two_reasoning_keys_with_different_text_are_ambiguous():
    rec = _msgs({"role": "assistant", "content": "a", "reasoning_content": "R1", "thinking": "R2"})
    with pytest.raises(Rejected) as e:
        normalize(rec, FormatOptions())
    assert e.value.reason is Reason.AMBIGUOUS_FIELD
    assert "'reasoning_content' and 'thinking'" in e.value.detail and "keep one of the two keys in the data" in e.value.detail
    rec["messages"][1]["thinking"] = "R1"  # the same reasoning twice: read once
    assert normalize(rec, FormatOptions()).messages[1]["reasoning"] == "R1"


def test_turn_keys_not_read_are_counted_as_ignored():
    rec = _msgs({"role": "assistant", "content": "a", "refusal": "I can't.", "name": None, "tool_calls": []})
    conv = normalize(rec, FormatOptions())
    assert turns(conv) == [("user", "q"), ("assistant", "a")]
    assert conv.notes == {"ignored_field:messages[].refusal": 1}  # null and empty keys hold nothing
    rec = {"conversations": [{"from": "human", "value": "q", "lang": "en"}, {"from": "gpt", "value": "a", "lang": "en"}]}
    assert normalize(rec, FormatOptions()).notes == {"ignored_field:conversations[].lang": 1}


def test_tool_calls_on_a_user_turn_are_refused():
    call = [{"type": "function", "function": {"name": "f", "arguments": {}}}]
    rec = {"messages": [{"role": "user", "content": "q", "tool_calls": call}, {"role": "assistant", "content": "a"}]}
    with pytest.raises(Rejected, match=r"bad_type: messages\[0\].tool_calls is on a user turn; only assistant turns "
                                       "call tools"):
        normalize(rec, FormatOptions())


def test_text_under_a_second_content_key_is_read_or_refused_never_dropped():
    rec = {"messages": [{"role": "user", "content": "", "text": "REAL TEXT"}, {"role": "assistant", "content": "a"}]}
    assert turns(normalize(rec, FormatOptions())) == [("user", "REAL TEXT"), ("assistant", "a")]
    rec["messages"][0]["content"] = "other text"
    with pytest.raises(Rejected) as e:
        normalize(rec, FormatOptions())
    assert e.value.reason is Reason.AMBIGUOUS_FIELD
    # Either --content-key leaves the other text unread, so neither is printed as a fix (tests/test_suggestions.py).
    assert "'content' and 'text'" in e.value.detail and "--content-key KEY (or --content-key KEY)" in e.value.detail
    conv = normalize(rec, FormatOptions(content_key="text"))  # the remedy: the other key is counted
    assert turns(conv)[0] == ("user", "REAL TEXT") and conv.notes == {"ignored_field:messages[].content": 1}


# ------------------------------------------------------------------------------------------------
# 4. Fields beside a followed path.


def test_siblings_of_a_messages_field_path_are_counted():
    rec = {"conversation": {"system": "NESTED SYSTEM PROMPT", "turns": [{"role": "user", "content": "q"},
                                                                        {"role": "assistant", "content": "a"}]}}
    conv = normalize(rec, FormatOptions(messages_field="conversation.turns"))
    assert turns(conv) == [("user", "q"), ("assistant", "a")]
    assert conv.notes == {"ignored_field:conversation.system": 1}


def test_list_items_beside_a_field_path_are_counted():
    rec = {"turns": ["q"], "choices": [{"turns": ["a"]}, {"turns": ["b"]}, {"turns": ["c"]}]}
    conv = normalize(rec, FormatOptions(fields=(("turns", "user"), ("choices[0].turns", "assistant"))))
    assert turns(conv) == [("user", "q"), ("assistant", "a")] and conv.notes == {"ignored_field:choices[1:]": 1}
    conv = normalize(rec, FormatOptions(fields=(("turns", "user"), ("choices[1].turns", "assistant"))))
    assert conv.notes == {"ignored_field:choices[0]": 1, "ignored_field:choices[2:]": 1}


# ------------------------------------------------------------------------------------------------
# 5. Reasoning closed by </think> with no opening tag (DeepSeek-R1 distills).

R1_DISTILL = {"messages": [{"role": "user", "content": "q"},
                           {"role": "assistant", "content": "SECRET REASONING here\n</think>\n\nfinal answer"}]}


def test_reasoning_before_a_lone_closing_think_tag_is_reasoning():
    conv = normalize(R1_DISTILL, FormatOptions())
    assert conv.messages[1] == {"role": "assistant", "content": "final answer", "reasoning": "SECRET REASONING here"}
    assert _fast(R1_DISTILL, FormatOptions()) is None and normalize(R1_DISTILL, FormatOptions()) == _normalize(
        R1_DISTILL, FormatOptions())
    _, trained = encode(R1_DISTILL, mask_reasoning=True)
    assert trained == "final answer<|im_end|><｜end▁of▁sentence｜>"
    # A <think> before the first </think> is not this case; an answer that only mentions </think> later is.
    rec = _msgs({"role": "assistant", "content": "see <think>x</think> here"})
    assert normalize(rec, FormatOptions()).messages[1] == {"role": "assistant", "content": "see <think>x</think> here"}


def test_inline_reasoning_is_read_in_every_shape():
    rec = {"instruction": "2+2?", "output": "<think>2 and 2</think>4"}
    assert _fast(rec, FormatOptions()) is None
    assert normalize(rec, FormatOptions()).messages[1] == {"role": "assistant", "content": "4", "reasoning": "2 and 2"}
    rec = {"prompt": "2+2?", "completion": "2 and 2\n</think>\n4"}
    assert normalize(rec, FormatOptions()).messages[1] == {"role": "assistant", "content": "4", "reasoning": "2 and 2"}


# ------------------------------------------------------------------------------------------------
# 6. An explicitly empty --system-prompt is an empty system turn (it keeps a template's default out).


def test_an_empty_system_prompt_is_an_empty_system_turn():
    fmt = FormatOptions(system_prompt="")
    for rec in ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
                {"instruction": "q", "input": "", "output": "a"}, {"conversations": [{"from": "human", "value": "q"},
                                                                                     {"from": "gpt", "value": "a"}]}):
        conv = normalize(rec, fmt)
        assert turns(conv) == [("system", ""), ("user", "q"), ("assistant", "a")] and conv == _normalize(rec, fmt)
