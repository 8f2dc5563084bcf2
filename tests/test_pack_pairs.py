"""``packstream pack --pairs`` end to end: every preference layout in one run, round-tripped.

Each record of a generated mix (TRL explicit prompts as strings and message lists, TRL implicit
prompts, LLaMA-Factory's ranking form, OpenAI DPO; plus a pair whose sides differ before their
answers, a record that is not a pair, a pair too long for the budget and a repeated id) is packed,
dead-lettered with its reason, or dropped for length, exactly once; the counts reconcile; every row
follows the contract (sides adjacent, chosen first, one prompt per pair, the mask exactly on the
completions); decoding a side's completion gives its answer; verify --inputs re-derives it all.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

import packers
from pipeline import PackOptions, run
from tests._internals import load_tokenizer, verify
from tests.test_pipeline import _rows

WORDS = "alpha beta gamma delta prime river stone cloud seven ninety quiet answer".split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def layouts(rng: random.Random, i: int) -> tuple[dict, str, str, str]:
    """A pair in one of the layouts: (record, question, chosen answer, rejected answer)."""
    q, c, r = _text(rng, rng.randint(1, 12)), _text(rng, rng.randint(1, 30)), _text(rng, rng.randint(1, 30))
    kind = i % 5
    if kind == 0:  # TRL's standard strings: raw text, so the answers start with their space
        rec = {"prompt": q, "chosen": " " + c, "rejected": " " + r}
    elif kind == 1:
        rec = {"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": c}],
               "rejected": [{"role": "assistant", "content": r}]}
    elif kind == 2:
        user = {"role": "user", "content": q}
        rec = {"chosen": [user, {"role": "assistant", "content": c}], "rejected": [user, {"role": "assistant", "content": r}]}
    elif kind == 3:
        rec = {"conversations": [{"from": "human", "value": q}], "chosen": {"from": "gpt", "value": c},
               "rejected": {"from": "gpt", "value": r}}
    else:
        rec = {"input": {"messages": [{"role": "user", "content": q}]},
               "preferred_output": [{"role": "assistant", "content": c}],
               "non_preferred_output": [{"role": "assistant", "content": r}]}
    return rec, q, c, r


@pytest.mark.slow
@pytest.mark.parametrize("long", ["drop", "truncate"])
def test_pack_pairs_round_trip(tmp_path, long):
    rng = random.Random(3)
    records, answers = [], {}
    for i in range(60):
        rec, q, c, r = layouts(rng, i)
        rec["id"] = f"p{i}"
        records.append(rec)
        answers[f"p{i}"] = (c, r)
    records.append({"id": "differ", "chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                    "rejected": [{"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]})
    records.append({"id": "sft", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    records.append({"id": "long", "prompt": "short", "chosen": _text(rng, 400), "rejected": _text(rng, 300)})
    records.append(dict(records[0]))  # id p0 again
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    options = PackOptions(inputs=(str(path),), output=str(tmp_path / "out"), pairs=True, max_tokens=512, long=long)
    m = run(options)
    c = m["counts"]
    assert m["row_checks"]["pairs"] is True and m["contract_version"] == packers.CONTRACT_VERSION
    assert c["rejected_by_reason"] == {"duplicate_id": 1, "not_a_pair": 1, "pair_prompt_mismatch": 1}
    packed = 60 + (long == "truncate")  # "long" is dropped, or truncated to fit
    assert c["examples_packed"] == packed and c["pieces"] == 2 * packed
    assert c["dropped_too_long"] == (long == "drop") and c["truncated_examples"] == (long == "truncate")
    assert c["records_read"] == c["examples_packed"] + c["rejected"] + c["dropped_too_long"] == len(records)

    tok = load_tokenizer(options.tokenizer)
    eos = tok.eos_token
    seen = set()
    for row in _rows(options.output):
        packers.validate_row(row, options.max_tokens)
        spans, ids = row["completion_spans"], row["input_ids"]
        for j, pid in enumerate(row["pair_ids"]):
            seen.add(pid.rsplit(":", 1)[1])
            if pid.endswith(":long"):
                continue
            completion = tok.decode(ids[spans[2 * j]:spans[2 * j + 1]]).lstrip()
            want = answers[pid.rsplit(":", 1)[1]][j % 2]
            # a conversation ends as the template renders it (TRL); a raw string completion with the EOS
            assert completion.startswith(want) and completion.endswith((eos, "<|im_end|>\n")), (completion, want)
    assert seen == set(answers) | ({"long"} if long == "truncate" else set())

    report = verify(options.output, inputs=(), announce=lambda _: None)
    assert report.ok, [str(p) for p in report.problems[:5]]


def test_prompts_that_tokenize_differently_are_dead_lettered(monkeypatch):
    """The prompt's tokens are compared, not just its messages: a template whose rendering is not a function of
    the messages alone (a date from strftime_now, read at each call) could give the two sides different prompts."""
    from tests._internals import Encoder

    encoder = Encoder(PackOptions(inputs=("x.jsonl",), pairs=True, max_tokens=256, strings="chat", eos="always"))
    real = encoder.renderer.segments
    calls = []

    def dated(conv, fmt):  # the second rendering of every record happens "a day later"
        segs = real(conv, fmt)
        calls.append(1)
        return [("Today: 2 Jan\n" + segs[0][0], segs[0][1])] + segs[1:] if len(calls) % 2 == 0 else segs

    monkeypatch.setattr(encoder.renderer, "segments", dated)
    enc = encoder.encode([(0, "pairs.jsonl", 1, {"prompt": "q", "chosen": "yes", "rejected": "no"})])
    assert not len(enc.batch) and [r["reason"] for r in enc.rejected] == ["pair_prompt_mismatch"]
    assert "tokenize differently" in enc.rejected[0]["detail"] and "Today" in enc.rejected[0]["detail"]
    monkeypatch.setattr(encoder.renderer, "segments", real)
    enc = encoder.encode([(0, "pairs.jsonl", 1, {"prompt": "q", "chosen": "yes", "rejected": "no"})])
    assert len(enc.batch) == 1 and not enc.rejected
    # TRL's rule (the default): each side's rendering of the prompt is compared before the tokens are
    encoder = Encoder(PackOptions(inputs=("x.jsonl",), pairs=True, max_tokens=256, strings="chat"))
    split, calls = encoder.renderer.split, []

    def dated_split(conv, fmt):
        s = split(conv, fmt)
        calls.append(1)
        return dataclasses.replace(s, prompt="Today: 2 Jan\n" + s.prompt) if len(calls) % 2 == 0 else s

    monkeypatch.setattr(encoder.renderer, "split", dated_split)
    enc = encoder.encode([(0, "pairs.jsonl", 1, {"prompt": "q", "chosen": "yes", "rejected": "no"})])
    assert not len(enc.batch) and [r["reason"] for r in enc.rejected] == ["pair_prompt_mismatch"]
    assert "renders the pair's prompt differently" in enc.rejected[0]["detail"]


def test_encoder_pair_example():
    """One pair becomes one example: chosen tokens then rejected, the completion (answer, end of turn, EOS) the target."""
    from tests._internals import Encoder

    record = {"prompt": "Name a prime.", "chosen": "97", "rejected": "91, no: 7 x 13"}
    chatml = "<|im_start|>user\nName a prime.<|im_end|>\n<|im_start|>assistant\n"
    for opts, prompt, end in (({}, "Name a prime.", ""),  # TRL's standard strings: raw text, the EOS appended
                              ({"strings": "chat"}, chatml, "<|im_end|>\n"),  # the template's own ending
                              ({"strings": "chat", "eos": "always"}, chatml, "<|im_end|>{eos}")):
        encoder = Encoder(PackOptions(inputs=("x.jsonl",), pairs=True, max_tokens=256, **opts))
        tok = encoder.renderer.tok
        b = encoder.encode([(0, "pairs.jsonl", 1, record)]).batch
        cut = int(b.cuts[0])
        sides = [(b.input_ids[:cut], b.loss_mask[:cut]), (b.input_ids[cut:], b.loss_mask[cut:])]
        for (ids, mask), answer in zip(sides, ("97", "91, no: 7 x 13")):
            assert tok.decode(ids[mask == 0]) == prompt, opts
            want = (answer if opts else " " + answer if False else answer) + end.format(eos=tok.eos_token)
            assert tok.decode(ids[mask == 1]) == (want if opts else answer + tok.eos_token), opts
            assert mask.tolist() == sorted(mask.tolist())  # prompt, then completion: one span


def test_preview_shows_both_sides():
    from tests._internals import format_preview, preview

    items = preview(PackOptions(inputs=("tests/shapes/preference_trl.jsonl",), pairs=True), n=2)
    for it in items:
        chosen, rejected = it["sides"]
        assert [y for _, y in chosen] == [False, True] and [y for _, y in rejected] == [False, True]
        assert chosen[0][0] == rejected[0][0]  # one prompt
        assert "--pairs" in it["mapping"][0] and "other_side_not_trained" not in it["notes"]
    out = format_preview(items, color=False)
    assert out.count("   chosen:") == 2 and out.count("   rejected:") == 2


# The record schemas of public preference sets (field names and nesting as they are published; the text here is
# made up): each packs with --pairs and nothing else, and its packed log-probs equal the unpacked ones.
Q, A, B = "How many legs does a spider have?", "Eight.", "Six, like an insect."
U = {"role": "user", "content": Q}
PUBLIC = {
    "HuggingFaceH4/ultrafeedback_binarized": {  # a `messages` copy of the chosen side beside the pair
        "prompt": Q, "prompt_id": "9f1c", "chosen": [U, {"role": "assistant", "content": A}],
        "rejected": [U, {"role": "assistant", "content": B}], "messages": [U, {"role": "assistant", "content": A}],
        "score_chosen": 9.0, "score_rejected": 4.0},
    "trl-lib/ultrafeedback_binarized": {  # implicit prompt
        "chosen": [U, {"role": "assistant", "content": A}], "rejected": [U, {"role": "assistant", "content": B}],
        "score_chosen": 9.0, "score_rejected": 4.0},
    "Anthropic/hh-rlhf": {"chosen": f"\n\nHuman: {Q}\n\nAssistant: {A}", "rejected": f"\n\nHuman: {Q}\n\nAssistant: {B}"},
    "Intel/orca_dpo_pairs": {"system": "You are a helpful assistant.", "question": Q, "chosen": A, "rejected": B},
    "Dahoas/full-hh-rlhf": {  # HH-RLHF split into a transcript prompt and the answers
        "prompt": f"\n\nHuman: {Q}\n\nAssistant:", "response": f" {A}", "chosen": f" {A}", "rejected": f" {B}"},
    "trl-lib explicit prompt (conversational)": {
        "prompt": [U], "chosen": [{"role": "assistant", "content": A}], "rejected": [{"role": "assistant", "content": B}]},
    "llamafactory dpo_en_demo": {"conversations": [{"from": "human", "value": Q}],
                                 "chosen": {"from": "gpt", "value": A}, "rejected": {"from": "gpt", "value": B}},
    "OpenAI DPO": {"input": {"messages": [U], "tools": [], "parallel_tool_calls": True},
                   "preferred_output": [{"role": "assistant", "content": A}],
                   "non_preferred_output": [{"role": "assistant", "content": B}]},
}


# Public sets that keep their answers under other names and pick one by a label: they pack with the documented
# options (docs/formats.md, "Pairs under other names"), the label choosing A (the chosen side) in each.
PUBLIC_NAMED = {
    "PKU-Alignment/PKU-SafeRLHF": (
        {"prompt": Q, "response_0": B, "response_1": A, "prompt_source": "x", "is_response_0_safe": True,
         "better_response_id": 1, "safer_response_id": 0},
        dict(pair_sides="response_0,response_1", pair_winner=(("better_response_id", "0/1"),))),
    "stanfordnlp/SHP": (
        {"post_id": "p1", "domain": "askscience_train", "history": Q, "c_root_id_A": "a", "c_root_id_B": "b",
         "human_ref_A": B, "human_ref_B": A, "labels": 0, "score_A": 3, "score_B": 40},
        dict(pair_sides="human_ref_A,human_ref_B", pair_winner=(("labels", "1/0"),), pair_prompt="history")),
    "lmsys/chatbot_arena_conversations": (
        {"question_id": "q1", "model_a": "m1", "model_b": "m2", "winner": "model_a", "judge": "arena_user",
         "conversation_a": [U, {"role": "assistant", "content": A}], "conversation_b": [U, {"role": "assistant", "content": B}],
         "turn": 1, "language": "English"},
        dict(pair_sides="conversation_a,conversation_b", pair_winner=(("winner", "model_a/model_b"),))),
    "nvidia/HelpSteer3 (preference)": (
        {"domain": "general", "language": "english", "context": [U], "response1": A, "response2": B,
         "overall_preference": -2, "individual_preference": [{"score": -2, "reasoning": "r"}]},
        dict(pair_sides="response1,response2", pair_winner=(("overall_preference", "<0/>0"),), pair_prompt="context")),
    "openbmb/UltraFeedback": (
        {"source": "evol_instruct", "instruction": Q, "models": ["m1", "m2", "m3"],
         "completions": [{"model": "m1", "response": "Maybe eight.", "overall_score": 6.5, "critique": "c"},
                         {"model": "m2", "response": B, "overall_score": 2.0, "critique": "c"},
                         {"model": "m3", "response": A, "overall_score": 9.0, "critique": "c"}], "correct_answers": []},
        dict(pair_ranked="completions=response/overall_score")),
    "berkeley-nest/Nectar": (
        {"prompt": f"\n\nHuman: {Q}\n\nAssistant:", "answers": [
            {"answer": A, "model": "m1", "rank": 1.0}, {"answer": "Maybe eight.", "model": "m2", "rank": 2.0},
            {"answer": B, "model": "m3", "rank": 3.0}], "turns": 1, "num_responses": 3, "source": ["x"],
         "good_natured": True},
        dict(pair_ranked="answers=answer/rank", pair_best="low")),
    "lvwerra/stack-exchange-paired": (
        {"qid": 1, "question": Q, "date": "2020", "metadata": ["u"], "response_j": A, "response_k": B},
        dict(pair_sides="response_j,response_k", pair_prompt="question")),
}


@pytest.mark.parametrize("name", ["named-by-layout", *PUBLIC_NAMED])
def test_public_pair_schemas_pack_and_their_logps_equal_the_unpacked(name):
    import pyarrow as pa
    import torch

    from packers import Collator, sequence_logps
    from tests._internals import Encoder, _rows
    from tests._shards import Example, compact_vocab
    from tests._models import tiny_model

    records, named = (list(PUBLIC.values()), {}) if name == "named-by-layout" else ([PUBLIC_NAMED[name][0]],
                                                                                   PUBLIC_NAMED[name][1])
    options = PackOptions(inputs=("x.jsonl",), pairs=True, max_tokens=512, **named)
    encoder = Encoder(options)
    tok = encoder.renderer.tok
    enc = encoder.encode([(0, "public.jsonl", i, r) for i, r in enumerate(records)])
    assert not enc.rejected and len(enc.batch) == len(records), enc.rejected
    b = enc.batch
    for i in range(len(b)):
        a, z, cut = int(b.offsets[i]), int(b.offsets[i + 1]), int(b.cuts[i])
        for (x, y), answer in (((a, a + cut), A), ((a + cut, z), B)):
            ids, mask = b.input_ids[x:y], b.loss_mask[x:y]
            # (a raw transcript prompt's answer keeps the space after "Assistant:", as TRL trains it)
            assert Q in tok.decode(ids[mask == 0]) and tok.decode(ids[mask == 1]).lstrip().startswith(answer), (name, i)
    rows = pa.Table.from_batches([_rows.pack_group(b, options, encoder.eos_id).batch]).to_pylist()
    # token ids folded into the tiny model's vocabulary (97): ids seen, most frequent first
    fold = compact_vocab([Example("all", [t for r in rows for t in r["input_ids"]], [])], 97)
    for r in rows:
        r["input_ids"] = [fold.get(t, 96) for t in r["input_ids"]]
    model = tiny_model("qwen2", "sdpa").eval()
    batch = Collator()(rows)
    with torch.no_grad():
        lp = sequence_logps(model(**batch).logits, batch)
        cu = batch["cu_seq_lens_q"].tolist()
        comp = batch["completion_mask"][0]
        for s in range(len(cu) - 1):
            ids = batch["input_ids"][:, cu[s]:cu[s + 1]]
            alone = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
            at = torch.nonzero(comp[cu[s] + 1:cu[s + 1]])[:, 0]
            want = alone[at].gather(1, ids[0, at + 1, None])[:, 0].sum()
            assert abs(float(lp.sum[s]) - float(want)) <= 1e-5
    assert len(lp.chosen) == len(records)


def test_label_picked_pairs_pack_and_verify(tmp_path):
    """PKU-SafeRLHF's layout (two responses and the index of the better one) under --pair-sides/--pair-winner:
    each pair's chosen completion is the picked response, ties are dead-lettered as no_preference, the counts
    reconcile and verify --inputs re-derives the rows from the options the manifest records."""
    rng = random.Random(5)
    records, answers = [], {}
    for i in range(24):
        q, a, b = _text(rng, 6), _text(rng, rng.randint(1, 20)), _text(rng, rng.randint(1, 20))
        better = i % 3 if i % 8 else None  # 0, 1 or 2 (no such response); None: unlabelled
        records.append({"id": f"p{i}", "prompt": q, "response_0": a, "response_1": b, "better_response_id": better,
                        "safer_response_id": 0})
        if better in (0, 1):
            answers[f"p{i}"] = (a, b) if better == 0 else (b, a)
    path = tmp_path / "pku.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    options = PackOptions(inputs=(str(path),), output=str(tmp_path / "out"), pairs=True, max_tokens=256,
                          pair_sides="response_0,response_1", pair_winner=(("better_response_id", "0/1"),))
    c = run(options)["counts"]
    assert c["examples_packed"] == len(answers) and c["rejected_by_reason"] == {"no_preference": len(records) - len(answers)}
    assert c["records_read"] == c["examples_packed"] + c["rejected"] == len(records)
    assert c["normalization"]["ignored_field:safer_response_id"] == len(answers)
    tok = load_tokenizer(options.tokenizer)
    seen = set()
    for row in _rows(options.output):
        spans, ids = row["completion_spans"], row["input_ids"]
        for j, pid in enumerate(row["pair_ids"]):
            key = pid.rsplit(":", 1)[1]
            seen.add(key)
            assert tok.decode(ids[spans[2 * j]:spans[2 * j + 1]]).startswith(answers[key][j % 2])
    assert seen == set(answers)
    report = verify(options.output, inputs=(), announce=lambda _: None)
    assert report.ok, [str(p) for p in report.problems[:5]]
