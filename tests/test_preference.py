"""Preference pairs: every layout gives the same prompt, chosen and rejected turns (pipeline._formats.preference).

* A property test: generated pairs (a conversation so far, two different answers) written in every
  layout (LLaMA-Factory ranking, OpenAI DPO, TRL explicit and implicit prompts, HH-RLHF
  transcripts, Alpaca-style ranking, Orca-style system + question) come back from
  :func:`preference_turns` as the same three turn lists.
* For SFT, ``--preference chosen|rejected`` trains the prompt and that answer; without it a pair is
  refused as ``preference_pair`` and the detail names the option, which then packs it. (Before,
  LLaMA-Factory's ranking form was read as ShareGPT and trained only the history.)
"""

from __future__ import annotations

import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests._internals import FormatOptions, Reason, Rejected, normalize, preference_layout as layout, preference_turns
from tests.test_formats import SHAPES, load

CHOSEN, REJECTED = FormatOptions(preference="chosen"), FormatOptions(preference="rejected")

words = st.text(alphabet="abcdefghijklmnopqrstuvwxyz ,.?!éß中0123456789", min_size=1, max_size=30).map(str.strip).filter(bool)


@st.composite
def pairs(draw):
    """(system or None, earlier exchanges [(q, a)], the last question, chosen answer, rejected answer)."""
    system = draw(st.one_of(st.none(), words))
    history = draw(st.lists(st.tuples(words, words), max_size=2))
    q, chosen = draw(words), draw(words)
    rejected = draw(words.filter(lambda r: r != chosen))
    return system, history, q, chosen, rejected


def _msgs(system, history, q, role="role", content="content", user="user", assistant="assistant", sys="system"):
    out = [{role: sys, content: system}] if system else []
    for a, b in history:
        out += [{role: user, content: a}, {role: assistant, content: b}]
    return out + [{role: user, content: q}]


def write(kind: str, system, history, q, chosen, rejected) -> dict:
    """The pair in one layout."""
    if kind == "ranking":
        return {**({"system": system} if system else {}),
                "conversations": _msgs(None, history, q, "from", "value", "human", "gpt"),
                "chosen": {"from": "gpt", "value": chosen}, "rejected": {"from": "gpt", "value": rejected}}
    if kind == "openai-dpo":
        return {"input": {"messages": _msgs(system, history, q)},
                "preferred_output": [{"role": "assistant", "content": chosen}],
                "non_preferred_output": [{"role": "assistant", "content": rejected}]}
    if kind == "trl-conversational":
        return {"prompt": _msgs(system, history, q), "chosen": [{"role": "assistant", "content": chosen}],
                "rejected": [{"role": "assistant", "content": rejected}]}
    if kind == "trl-implicit":
        p = _msgs(system, history, q)
        return {"chosen": p + [{"role": "assistant", "content": chosen}],
                "rejected": p + [{"role": "assistant", "content": rejected}]}
    if kind == "trl-repeated-prompt":  # argilla: the prompt as text, each side the whole conversation
        p = _msgs(system, history, q)
        return {"prompt": q, "chosen": p + [{"role": "assistant", "content": chosen}],
                "rejected": p + [{"role": "assistant", "content": rejected}]}
    if kind == "hh":
        text = "".join(f"\n\nHuman: {a}\n\nAssistant: {b}" for a, b in history) + f"\n\nHuman: {q}\n\nAssistant: "
        return {**({"system": system} if system else {}), "chosen": text + chosen, "rejected": text + rejected}
    if kind == "instruction":
        return {**({"system": system} if system else {}), "history": [[a, b] for a, b in history],
                "instruction": q, "chosen": chosen, "rejected": rejected}
    if kind == "orca":
        return {**({"system": system} if system else {}), "question": q, "chosen": chosen, "rejected": rejected}
    raise AssertionError(kind)


SINGLE_TURN = {"orca", "trl-repeated-prompt"}  # layouts whose prompt is one question (history goes elsewhere or nowhere)
KINDS = ["ranking", "openai-dpo", "trl-conversational", "trl-implicit", "trl-repeated-prompt", "hh", "instruction", "orca"]


@settings(max_examples=300, deadline=None)
@given(pair=pairs(), kind=st.sampled_from(KINDS))
def test_every_layout_gives_the_same_prompt_and_answers(pair, kind):
    system, history, q, chosen, rejected = pair
    if kind in SINGLE_TURN:
        history = []
    if kind == "trl-repeated-prompt":
        system = None
    rec = write(kind, system, history, q, chosen, rejected)
    p = preference_turns(rec)
    want = ([("system", system)] if system else []) + [t for a, b in history for t in (("user", a), ("assistant", b))]
    want.append(("user", q))
    assert [(t.role, t.content) for t in p.prompt] == want, (kind, rec)
    assert [(t.role, t.content) for t in p.chosen] == [("assistant", chosen)]
    assert [(t.role, t.content) for t in p.rejected] == [("assistant", rejected)]
    prompt, c, r = p  # unpacks as the three lists
    assert (prompt, c, r) == (p.prompt, p.chosen, p.rejected)
    # SFT: the prompt and one side, the other counted; without --preference, refused and told how.
    for options, answer in ((CHOSEN, chosen), (REJECTED, rejected)):
        conv = normalize(rec, options)
        assert [(m["role"], m["content"]) for m in conv.messages] == want + [("assistant", answer)]
        assert conv.notes.get("other_side_not_trained") == 1
    with pytest.raises(Rejected) as e:
        normalize(rec, FormatOptions())
    assert e.value.reason is Reason.PREFERENCE_PAIR and "--preference chosen" in e.value.detail


def _fixture_pairs():
    for key, (name, opts, _) in SHAPES.items():
        if opts.get("preference"):
            for pos, rec in load(name):
                yield f"{key}@{pos}", rec


@pytest.mark.parametrize("name,rec", list(_fixture_pairs()))
def test_a_pair_without_preference_is_refused_and_the_named_option_packs_it(name, rec):
    """Before, the ranking form was read as ShareGPT (only the history trained, chosen ignored) and OpenAI's DPO
    form was told to use --messages-field preferred_output, which refused every record."""
    with pytest.raises(Rejected) as e:
        normalize(rec, FormatOptions())
    assert e.value.reason is Reason.PREFERENCE_PAIR
    assert "--preference chosen" in e.value.detail and f"{layout(rec)} layout" in e.value.detail
    conv = normalize(rec, CHOSEN)
    assert "ignored_field:chosen" not in conv.notes
    if conv.raw is not None:  # TRL's standard strings, kept raw (--strings raw): the prompt, then the chosen answer
        assert conv.raw == (rec["prompt"], rec["chosen"]) and not conv.messages
    else:
        assert conv.messages[-1]["role"] == "assistant"


def test_the_rejected_side_and_the_pair_api_on_ranking_records():
    rec = dict(load("preference_ranking.json"))[1]
    prompt, chosen, rejected = preference_turns(rec)
    assert [t.role for t in prompt] == ["system", "user", "assistant", "user"]
    assert chosen[0].content.startswith("Use a parameterised query") and rejected[0].content.startswith("Escape the quotes")
    conv = normalize(rec, REJECTED)
    assert conv.messages[-1]["content"] == rejected[0].content and conv.notes == {"other_side_not_trained": 1}


def test_openai_dpo_tools_and_calls_come_from_the_record():
    rec = dict(load("preference_openai_dpo.jsonl"))[3]
    p = preference_turns(rec)
    assert p.layout == "openai-dpo" and p.tools == rec["input"]["tools"]
    assert p.chosen[0].tool_calls == [{"type": "function", "id": "call_1",
                                       "function": {"name": "get_order_status", "arguments": {"order_id": "A-1043"}}}]
    assert normalize(rec, CHOSEN).tools == rec["input"]["tools"]


def test_pairs_that_cannot_be_split_say_why():
    with pytest.raises(Rejected, match="missing_field: chosen is a string without speaker markers and the record has no prompt"):
        preference_turns({"chosen": "Paris.", "rejected": "Lyon."})
    with pytest.raises(Rejected, match="missing_field: input is str; OpenAI's DPO layout has the prompt under input.messages"):
        preference_turns({"input": "hi", "preferred_output": [], "non_preferred_output": []})
    with pytest.raises(Rejected, match="bad_type: rejected is null"):
        preference_turns({"prompt": "Capital of France?", "chosen": "Paris.", "rejected": None})
    # Identical sides: the last turn is the answer of both (nothing to learn from, but nothing lost either).
    same = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    p = preference_turns({"chosen": same, "rejected": json.loads(json.dumps(same))})
    assert [t.content for t in p.prompt] == ["hi"] and [t.content for t in p.chosen] == ["hello"]


def test_whole_conversations_beside_a_prompt_field_are_read_once():
    """orpo-dpo-mix / capybara-dpo: a prompt field beside sides that are whole conversations (a system turn first,
    or earlier exchanges): the shared turns are the prompt, and the prompt field's text is not trained twice."""
    conv = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    rec = {"prompt": "And 3+3?", "question": "And 3+3?", "chosen": conv + [{"role": "assistant", "content": "6"}],
           "rejected": conv + [{"role": "assistant", "content": "7"}]}
    p = preference_turns(rec)
    assert [t.content for t in p.prompt] == ["Be exact.", "2+2?", "4", "And 3+3?"]
    assert [t.content for t in p.chosen] == ["6"] and [t.content for t in p.rejected] == ["7"]
    conv_ = normalize(rec, CHOSEN)
    assert [m["content"] for m in conv_.messages] == ["Be exact.", "2+2?", "4", "And 3+3?", "6"]
    # A prompt field whose text the sides do not hold is kept, first.
    p = preference_turns({**rec, "prompt": "Context: arithmetic."})
    assert [t.content for t in p.prompt][:2] == ["Context: arithmetic.", "Be exact."]


def test_other_records_are_not_pairs():
    assert layout({"messages": [], "chosen": "x"}) is None
    # ultrafeedback_binarized has messages beside chosen/rejected: messages wins (ORDER), the pair is counted.
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
           "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
           "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}
    conv = normalize(rec, FormatOptions())
    assert conv.shape == "messages" and {"ignored_field:chosen", "ignored_field:rejected"} <= set(conv.notes)


# ------------------------------------------------------------------------------------------------
# Named fields (--pair-sides, --pair-winner, --pair-prompt): label-picked pairs (PKU-SafeRLHF, SHP,
# Chatbot Arena, HelpSteer-style scores, one-hot winner columns).

LABELLED = {  # name: (options, write(record, a, b, picks) -> record, prompt in the record)
    "pku": (dict(pair_sides="response_0,response_1", pair_winner=(("better_response_id", "0/1"),)),
            lambda q, a, b, k: {"prompt": q, "response_0": a, "response_1": b, "better_response_id": k,
                                "safer_response_id": 1 - k}),
    "shp": (dict(pair_sides="human_ref_A,human_ref_B", pair_winner=(("labels", "1/0"),), pair_prompt="history"),
            lambda q, a, b, k: {"post_id": "x", "history": q, "human_ref_A": a, "human_ref_B": b, "labels": 1 - k}),
    "arena": (dict(pair_sides="conversation_a,conversation_b", pair_winner=(("winner", "model_a/model_b"),)),
              lambda q, a, b, k: {"model_a": "m1", "model_b": "m2", "winner": ["model_a", "model_b"][k],
                                  "conversation_a": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                  "conversation_b": [{"role": "user", "content": q}, {"role": "assistant", "content": b}]}),
    "score": (dict(pair_sides="r.first,r.second", pair_winner=(("pref", "<0/>0"),), pair_prompt="ctx[0]"),
              lambda q, a, b, k: {"ctx": [q, "unused"], "r": {"first": a, "second": b, "model": "m"},
                                  "pref": [-2.5, 3][k]}),
    "one-hot": (dict(pair_sides="response_a,response_b",
                     pair_winner=(("winner_model_a", "1/0"), ("winner_model_b", "0/1"))),
                lambda q, a, b, k: {"prompt": q, "response_a": a, "response_b": b, "winner_model_a": 1 - k,
                                    "winner_model_b": k, "tie": False}),
}


@settings(max_examples=200, deadline=None)
@given(pair=pairs(), kind=st.sampled_from(sorted(LABELLED)), first=st.booleans())
def test_named_fields_pick_the_preferred_answer(pair, kind, first):
    """The answer the label picks is the chosen side, the other the rejected one, under the prompt; every field
    the options do not name is counted as ignored (nested neighbours of a path too)."""
    from tests._internals import pair_conversations

    _, _, q, a, b = pair
    opts, write_ = LABELLED[kind]
    rec = write_(q, a, b, 0 if first else 1)
    chosen, rejected = pair_conversations(rec, FormatOptions(**opts))
    won, lost = (a, b) if first else (b, a)
    assert [(m["role"], m["content"]) for m in chosen.messages] == [("user", q), ("assistant", won)], rec
    assert [(m["role"], m["content"]) for m in rejected.messages] == [("user", q), ("assistant", lost)], rec
    ignored = {k.split(":", 1)[1] for k in chosen.notes if k.startswith("ignored_field:")}
    want = {"pku": {"safer_response_id"}, "shp": {"post_id"}, "arena": {"model_a", "model_b"},
            "score": {"ctx[1:]", "r.model"}, "one-hot": {"tie"}}[kind]
    assert ignored == want, (kind, chosen.notes)


@pytest.mark.parametrize("kind,rec,words", [
    ("pku", {"prompt": "q", "response_0": "a", "response_1": "b", "better_response_id": 2}, "picks neither"),
    ("pku", {"prompt": "q", "response_0": "a", "response_1": "b", "better_response_id": None}, "picks neither"),
    ("pku", {"prompt": "q", "response_0": "a", "response_1": "b", "better_response_id": True}, "picks neither"),
    ("arena", {"winner": "tie (bothbad)", "conversation_a": [], "conversation_b": []}, "picks neither"),
    ("score", {"ctx": ["q"], "r": {"first": "a", "second": "b"}, "pref": 0}, "picks neither"),
    ("score", {"ctx": ["q"], "r": {"first": "a", "second": "b"}, "pref": "3"}, "picks neither"),
    ("one-hot", {"prompt": "q", "response_a": "a", "response_b": "b", "winner_model_a": 1, "winner_model_b": 1,
                 "tie": False}, "disagree"),
    ("one-hot", {"prompt": "q", "response_a": "a", "response_b": "b", "winner_model_a": 0, "winner_model_b": 0,
                 "tie": 1}, "disagree"),  # a tie: the two columns pick different answers
])
def test_a_tie_or_a_missing_label_is_no_preference(kind, rec, words):
    from tests._internals import pair_conversations

    with pytest.raises(Rejected) as e:
        pair_conversations(rec, FormatOptions(**LABELLED[kind][0]))
    assert e.value.reason is Reason.NO_PREFERENCE and words in e.value.detail, e.value.detail


def test_named_fields_missing_or_beside_a_layouts_fields():
    from tests._internals import pair_conversations

    o = FormatOptions(**LABELLED["pku"][0])
    with pytest.raises(Rejected) as e:
        pair_conversations({"prompt": "q", "response_0": "a", "better_response_id": 0}, o)
    assert e.value.reason is Reason.MISSING_FIELD and "'response_1' (--pair-sides)" in e.value.detail
    # A record that also holds chosen/rejected (and, beside --pair-prompt, a prompt): the named fields are read,
    # the others counted; never silently mixed.
    rec = {"question": "other", "history": "q", "chosen": "x", "rejected": "y", "response_0": "a", "response_1": "b",
           "better_response_id": 1}
    c, r = pair_conversations(rec, FormatOptions(**LABELLED["pku"][0], pair_prompt="history"))
    assert [m["content"] for m in c.messages] == ["q", "b"] and [m["content"] for m in r.messages] == ["q", "a"]
    assert {"ignored_field:question", "ignored_field:chosen", "ignored_field:rejected"} <= set(c.notes)


@pytest.mark.parametrize("opts,words", [
    (dict(pair_sides="a"), "two different answer fields"),
    (dict(pair_sides="a,a"), "two different answer fields"),
    (dict(pair_sides="a,b", pair_winner=(("w", "1"),)), "FIELD=A/B"),
    (dict(pair_sides="a,b", pair_winner=(("w", "<x/1"),)), "compares with a number"),
    (dict(pair_winner=(("w", "1/0"),)), "add --pair-sides"),
    (dict(pair_sides="a,b[", ), "not a field path"),
    (dict(pair_prompt=""), "is empty"),
    (dict(pair_sides="a,b", messages_field="m"), "do not combine"),
])
def test_named_field_options_are_checked(opts, words):
    from packers import PackstreamError

    with pytest.raises(PackstreamError, match=words):
        FormatOptions(**opts)


def test_named_fields_of_any_json_pack_or_are_rejected_with_a_reason():
    """Fuzzed values under the named fields (answers, labels, prompts of every JSON type): each record is one
    packed pair or one dead letter with a reason; nothing else escapes."""
    from pipeline import PackOptions
    from tests._internals import Encoder
    from tests.test_fuzz_formats import REASONS, SETTINGS, json_values, leaves, turns_

    encoder = Encoder(PackOptions(inputs=("-",), pairs=True, pair_sides="r.a,r.b", pair_prompt="ctx",
                                  pair_winner=(("w", "0/1"), ("s", "<=0/>0"))))
    answer = st.one_of(leaves, turns_, json_values)
    record = st.fixed_dictionaries(
        {"r": st.one_of(st.fixed_dictionaries({"a": answer, "b": answer}), json_values),
         "ctx": st.one_of(leaves, turns_, json_values), "w": st.one_of(st.sampled_from([0, 1, "0", 1.0, True]), json_values),
         "s": st.one_of(st.integers(-2, 2), st.floats(allow_nan=True), json_values)},
        optional={"chosen": answer, "prompt": leaves, "system": leaves, "tools": json_values})
    seen = set()

    @settings(max_examples=400, **SETTINGS)
    @given(rec=record)
    @example(rec={"r": {"a": "yes", "b": "no"}, "ctx": "q?", "w": 1, "s": 2})  # packed: both rules pick b
    @example(rec={"r": {"a": "yes", "b": "no"}, "ctx": "q?", "w": 1, "s": -1})  # the rules disagree
    def run(rec):
        out = encoder.encode([(0, "fuzz.jsonl", 1, rec)])
        assert len(out.rejected) + len(out.batch.ids) == 1
        for dead in out.rejected:
            assert dead["reason"] in REASONS and dead["detail"], dead
            seen.add(dead["reason"])
        if out.batch.ids:
            seen.add("packed")

    run()
    assert {"packed", "no_preference"} <= seen, seen

    ranked = Encoder(PackOptions(inputs=("-",), pairs=True, pair_ranked="c=t/s"))
    item = st.one_of(st.fixed_dictionaries({"t": answer, "s": st.one_of(st.integers(), st.floats(), json_values)},
                                           optional={"m": json_values}), json_values)

    @settings(max_examples=300, **SETTINGS)
    @given(rec=st.fixed_dictionaries({"prompt": st.one_of(leaves, turns_), "c": st.one_of(st.lists(item, max_size=4),
                                                                                           json_values)}))
    @example(rec={"prompt": "q", "c": [{"t": "yes", "s": 2}, {"t": "no", "s": 1}]})
    def run_ranked(rec):
        out = ranked.encode([(0, "fuzz.jsonl", 1, rec)])
        assert len(out.rejected) + len(out.batch.ids) == 1
        for dead in out.rejected:
            assert dead["reason"] in REASONS and dead["detail"], dead

    run_ranked()


@settings(max_examples=200, deadline=None)
@given(q=words, items=st.lists(st.tuples(words, st.one_of(st.integers(-3, 9), st.floats(-5, 5), st.none(),
                                                            st.just("N/A"))), min_size=0, max_size=5),
       best=st.sampled_from(["high", "low"]))
def test_ranked_answers_pick_the_best_and_the_worst(q, items, best):
    """--pair-ranked: the best-scored answer is chosen and the worst rejected (ties: the first in list order);
    unscored items are skipped and counted; fewer than two distinct scores is no_preference."""
    from tests._internals import pair_conversations

    rec = {"instruction": q, "completions": [{"response": a, "overall_score": s, "model": "m"} for a, s in items]}
    o = FormatOptions(pair_ranked="completions=response/overall_score", pair_best=best)
    scored = [(i, s) for i, (_, s) in enumerate(items) if isinstance(s, (int, float))]
    if len({s for _, s in scored}) < 2:
        with pytest.raises(Rejected) as e:
            pair_conversations(rec, o)
        assert e.value.reason is Reason.NO_PREFERENCE, e.value
        return
    sign = 1 if best == "high" else -1
    top = max(sign * s for _, s in scored)
    bottom = min(sign * s for _, s in scored)
    want_c = items[next(i for i, s in scored if sign * s == top)][0]
    want_r = items[next(i for i, s in scored if sign * s == bottom)][0]
    chosen, rejected = pair_conversations(rec, o)
    assert [(m["role"], m["content"]) for m in chosen.messages] == [("user", q), ("assistant", want_c)]
    assert [(m["role"], m["content"]) for m in rejected.messages] == [("user", q), ("assistant", want_r)]
    ignored = {k for k in chosen.notes if k.startswith("ignored_field:completions[")}
    assert len([k for k in ignored if k.endswith(".model")]) == 2  # the two answers' other keys
    assert len(ignored) == 2 + len(items) - 2  # every other item, scored or not, counted once


def test_ranked_answers_that_cannot_be_read():
    from tests._internals import pair_conversations

    o = FormatOptions(pair_ranked="answers=answer/rank", pair_best="low")
    for rec, reason in (({"prompt": "q", "answers": "a"}, Reason.BAD_TYPE),
                        ({"prompt": "q", "answers": [{"answer": "a", "rank": 1}, {"text": "b", "rank": 2}]}, Reason.MISSING_FIELD),
                        ({"prompt": "q"}, Reason.MISSING_FIELD)):
        with pytest.raises(Rejected) as e:
            pair_conversations(rec, o)
        assert e.value.reason is reason, (rec, e.value)


def test_a_transcript_prompt_is_read_as_its_turns():
    """HH-RLHF split into prompt and answers (Dahoas/full-hh-rlhf, Nectar): a prompt that begins with a speaker
    marker and ends on the assistant's is the conversation so far; a prompt that only mentions markers is text."""
    rec = {"prompt": "\n\nHuman: 2+2?\n\nAssistant: 4.\n\nHuman: And 3+3?\n\nAssistant:", "chosen": " 6.", "rejected": " 7."}
    p = preference_turns(rec)
    assert [(t.role, t.content) for t in p.prompt] == [("user", "2+2?"), ("assistant", "4."), ("user", "And 3+3?")]
    assert [t.content for t in p.chosen] == ["6."]  # the space after "Assistant:" is the transcript's, not the answer's
    for text in ("Write a dialogue.\n\nHuman: hi\n\nAssistant:", "\n\nHuman: hi\n\nAssistant: hello",
                 "\n\nAssistant:"):
        p = preference_turns({"prompt": text, "chosen": "a", "rejected": "b"})
        assert [(t.role, t.content) for t in p.prompt] == [("user", text)], text


@pytest.mark.parametrize("opts,words", [
    (dict(pair_ranked="completions"), "LIST=TEXT/SCORE"),
    (dict(pair_ranked="completions=response"), "LIST=TEXT/SCORE"),
    (dict(pair_ranked="c=r/s", pair_sides="a,b"), "does not combine"),
    (dict(pair_best="low"), "add --pair-ranked"),
    (dict(pair_best="middle"), "--pair-best .middle. is not one of high, low"),
])
def test_ranked_options_are_checked(opts, words):
    from packers import PackstreamError

    with pytest.raises(PackstreamError, match=words):
        FormatOptions(**opts)
