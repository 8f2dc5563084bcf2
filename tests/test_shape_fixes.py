"""Records of no known shape, read as a new user would: preview refuses them, the printed fix is typed back as it
stands, and the packed rows hold what the record meant (not merely something that packs).

Each case is one fixture in tests/shapes/ (written for the project, shaped like a public set):

=========================  ======================================================  ===============================
file                       the record                                              what must be trained
=========================  ======================================================  ===============================
parallel_answers.jsonl     instruction + 5 ``responses`` + 5 parallel ``rewards``  a pair: best against worst
                           (Magpie-PO)                                             (never all five in one turn)
model_completions.jsonl    prompt + ``completions: [{model, completion}]``         the prompt as the user turn,
                           (Tulu human-eval)                                       one completion as the answer
capitalised_fields.jsonl   Question/Complex_CoT/Response beside question/answer    Question, its reasoning and
                           (HuatuoGPT-o1)                                          Response; not the short answer
pair_conversations.jsonl   chosen_messages / rejected_messages                     a pair (--pairs), both sides
turn_keys.jsonl            ``dialogue: {turn_1: ..., turn_12: ...}``               every turn, in numeric order
named_solution.jsonl       problem, generated_solution, expected_answer            the solution, not the bare answer
                           (OpenMathInstruct)
solution_steps.jsonl       question, a list of ``steps``, a one-word label (PRM)   no fix: the label is never the
                                                                                   answer; the steps are named
marked_sides.jsonl         history, human_ref_A / human_ref_B, labels (SHP)        a pair; the label's values the
                                                                                   user's to give
huatuo_o1.jsonl            a longer multiple-choice question + answer beside       Question, Complex_CoT, Response
                           Question/Complex_CoT/Response (HuatuoGPT-o1)            (the family with more text)
moss_chat.jsonl            turns with one key per speaker, marked text (MOSS)      no fix; what is missing named
tulu_completions.jsonl     one record per completion, ids repeated (Tulu)          every one: with --ids position
oasst_tree.jsonl           a message tree under ``prompt`` (OpenAssistant)         --tree prompt: each path
(written at test time)     Parquet: prompt as messages + a solution (RL sets)      the solution, after the prompt
numbered_turns.jsonl       ``message_1`` / ``message_2`` and no prompt (CAMEL)      message_1 the user's turn,
                                                                                   message_2 trained: not a pair
=========================  ======================================================  ===============================
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline import PackOptions
from pipeline.cli import main
from tests._internals import FormatOptions, Rejected, conversations, load_tokenizer

SHAPES_DIR = Path(__file__).parent / "shapes"


def records(name: str) -> list[dict]:
    return [json.loads(line) for line in (SHAPES_DIR / name).read_text().splitlines() if line.strip()]


def cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return result.output


def refusals(name: str) -> list[str]:
    """``packstream preview FILE``: the detail of every refused record."""
    out = cli("preview", str(SHAPES_DIR / name), "--no-color", "-n", "50")
    return [line.strip() for line in out.splitlines() if line.startswith("   keys [")]


def printed_fix(detail: str) -> list[str]:
    """The options after "read it with", as a shell would split them; [] when the detail offers none."""
    m = re.search(r"read it with (.*?)(?: \(|$)", detail)
    return shlex.split(m.group(1)) if m else []


def the_fix(name: str) -> list[str]:
    """The one fix preview prints for every record of the file (each record refused, all with the same fix)."""
    details = refusals(name)
    assert len(details) == len(records(name)), details
    fixes = {tuple(printed_fix(d)) for d in details}
    assert len(fixes) == 1 and () not in fixes, details
    return list(fixes.pop())


def packed(tmp_path: Path, name: str, args: list[str]) -> list[dict]:
    """``packstream pack FILE --output OUT ARGS``: per example, its full text and its trained text (decoded)."""
    from tests.test_pipeline import _rows

    out = tmp_path / "out"
    cli("pack", str(SHAPES_DIR / name), "--output", str(out), *args)
    tok = load_tokenizer(PackOptions(inputs=("-",)).tokenizer)  # the default, as the fix does not name one
    examples = []
    for row in _rows(str(out)):
        ids, mask, offs = row["input_ids"], row["loss_mask"], list(row["seq_offsets"])
        for j, eid in enumerate(row["example_ids"]):
            a, b = offs[j], offs[j + 1]
            examples.append({"id": eid, "text": tok.decode(ids[a:b]),
                             "trained": tok.decode([t for t, m in zip(ids[a:b], mask[a:b]) if m])})
    return examples


# ------------------------------------------------------------------------------------------------
# What preview prints: the fix, or why there is none. Fast: no job runs.

def test_parallel_answers_are_refused_with_a_pair_reading_not_merged():
    assert the_fix("parallel_answers.jsonl") == ["--pairs", "--pair-ranked", "responses/rewards"]
    detail = refusals("parallel_answers.jsonl")[0]
    assert "5 alternative answers" in detail and "'responses[N]=assistant'" in detail


def test_model_completions_keep_the_prompt_as_the_user_turn():
    fix = the_fix("model_completions.jsonl")
    assert fix == ["--field", "prompt=user", "--field", "completions[0].completion=assistant"]
    detail = refusals("model_completions.jsonl")[0]
    assert "2 alternative answers" in detail and "--pairs" in detail  # the other completion: said, not dropped unseen


def test_capitalised_fields_are_read_by_the_longest_texts():
    assert the_fix("capitalised_fields.jsonl") == ["--field", "Question=user", "--field", "Complex_CoT=reasoning",
                                                   "--field", "Response=assistant"]
    detail = refusals("capitalised_fields.jsonl")[0]
    assert "question: the same field as Question in lower-case keys, left" in detail
    assert "answer: shorter than Response, left as another answer" in detail  # no twin: never called a copy


def test_two_whole_conversations_are_suggested_as_a_pair():
    assert the_fix("pair_conversations.jsonl") == ["--pairs", "--pair-sides", "chosen_messages,rejected_messages"]
    detail = refusals("pair_conversations.jsonl")[0]
    assert "(the other side is then dropped)" in detail  # the SFT reading only with words saying what it drops


def test_numbered_turn_keys_are_suggested_as_a_turn_list():
    assert the_fix("turn_keys.jsonl") == ["--messages-field", "dialogue"]


def test_preview_with_the_printed_fix_shows_the_best_answer_trained_against_the_worst():
    out = cli("preview", str(SHAPES_DIR / "parallel_answers.jsonl"), "--no-color", *the_fix("parallel_answers.jsonl"))
    rec = records("parallel_answers.jsonl")[0]
    chosen, rejected = out.split("chosen:")[1].split("rejected:")[:2]
    best, worst = (rec["responses"][i] for i in (1, 3))
    assert f"[[{best}" in chosen and f"[[{worst}" in rejected
    assert not any(r in out.split("-- line 2")[0] for r in (rec["responses"][0], rec["responses"][2], rec["responses"][4]))


def test_a_user_mapping_of_scored_answers_is_refused_not_merged():
    """--field responses=assistant beside a parallel list of scores would train all five answers as one reply:
    refused (ambiguous_field), naming the pair reading, which the driver tried."""
    rec = records("parallel_answers.jsonl")[0]
    with pytest.raises(Rejected) as e:
        conversations(rec, FormatOptions(fields=(("instruction", "user"), ("responses", "assistant"))))
    assert e.value.reason.value == "ambiguous_field"
    assert "--pairs --pair-ranked responses/rewards instead of --field" in e.value.detail
    assert not e.value.fix.failed and e.value.fix.pack() == {"pairs": True}


def test_pair_ranked_reads_parallel_lists_and_says_the_form_when_wrong():
    from packers import PackstreamError
    from tests._internals import pair_conversations

    rec = records("parallel_answers.jsonl")[1]
    chosen, rejected = pair_conversations(rec, FormatOptions(pair_ranked="responses/rewards"))
    assert chosen.messages[-1]["content"] == rec["responses"][1]
    assert rejected.messages[-1]["content"] == rec["responses"][4]
    assert chosen.messages[0] == {"role": "user", "content": rec["instruction"]}
    for bad in ("responses/", "responses/responses", "responses"):
        with pytest.raises(PackstreamError, match=r"LIST=TEXT/SCORE .* or TEXTS/SCORES") as err:
            FormatOptions(pair_ranked=bad)
        assert "\n" not in str(err.value)
    short = dict(rec, rewards=rec["rewards"][:3])
    with pytest.raises(Rejected, match="responses has 5 items and rewards has 3"):
        pair_conversations(short, FormatOptions(pair_ranked="responses/rewards"))


def test_turn_keys_read_in_numeric_order_through_messages_field():
    rec = records("turn_keys.jsonl")[0]
    conv = conversations(rec, FormatOptions(messages_field="dialogue"))[0]
    want = [rec["dialogue"][f"turn_{i}"] for i in range(1, 13)]  # turn_10..12 after turn_9, not after turn_1
    assert [m["content"] for m in conv.messages] == want
    assert [m["role"] for m in conv.messages] == ["user", "assistant"] * 6
    for keys in (("turn1", "turn2"), ("Turn 1", "Turn 2"), ("t-1", "t-2")):
        conv = conversations({"d": {keys[1]: "hello", keys[0]: "hi"}}, FormatOptions(messages_field="d"))[0]
        assert [m["content"] for m in conv.messages] == ["hi", "hello"]


def test_a_pair_refusal_without_pairs_names_pairs():
    rec = {"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."}
    with pytest.raises(Rejected) as e:
        conversations(rec, FormatOptions())
    assert "--pairs" in e.value.detail


# ------------------------------------------------------------------------------------------------
# --field X=reasoning: the reasoning of the assistant turn, rendered as parsed reasoning and masked on request.

def test_reasoning_field_renders_as_reasoning_and_mask_reasoning_masks_it():
    from tests._internals import preview

    rec = records("capitalised_fields.jsonl")[0]
    fields = (("Question", "user"), ("Complex_CoT", "reasoning"), ("Response", "assistant"))
    conv = conversations(rec, FormatOptions(fields=fields))[0]
    assert conv.messages[-1] == {"role": "assistant", "content": rec["Response"], "reasoning": rec["Complex_CoT"]}
    path = SHAPES_DIR / "capitalised_fields.jsonl"
    for mask in (False, True):
        item = preview(PackOptions(inputs=(str(path),), fields=fields, mask_reasoning=mask), n=1)[0]
        trained = "".join(t for t, flag in item["spans"] if flag)
        context = "".join(t for t, flag in item["spans"] if not flag)
        assert rec["Response"] in trained and rec["Question"] in context
        assert (rec["Complex_CoT"] in context) is mask and (rec["Complex_CoT"] in trained) is not mask
        assert "<think>" in trained + context  # the built-in ChatML writes reasoning as a think block


def test_reasoning_field_with_a_template_that_renders_reasoning():
    from tests._internals import preview

    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<reason>"
                "{{ m.reasoning_content }}</reason>\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    rec = records("capitalised_fields.jsonl")[1]
    fields = (("Question", "user"), ("Complex_CoT", "reasoning"), ("Response", "assistant"))
    path = SHAPES_DIR / "capitalised_fields.jsonl"
    for mask in (False, True):
        opts = PackOptions(inputs=(str(path),), fields=fields, mask_reasoning=mask, chat_template=template)
        item = preview(opts, n=2)[1]
        text = "".join(t for t, _ in item["spans"])
        trained = "".join(t for t, flag in item["spans"] if flag)
        assert f"<reason>{rec['Complex_CoT']}</reason>" in text
        assert (rec["Complex_CoT"] in trained) is not mask and rec["Response"] in trained


def test_reasoning_field_with_no_answer_to_belong_to_is_refused():
    with pytest.raises(Rejected, match="no assistant turn follows it"):
        conversations({"q": "Q", "cot": "because"}, FormatOptions(fields=(("q", "user"), ("cot", "reasoning"))))


# ------------------------------------------------------------------------------------------------
# The printed fix, typed back to pack: the packed rows hold what the record meant.

def test_pack_parallel_answers_with_the_printed_fix(tmp_path):
    rows = packed(tmp_path, "parallel_answers.jsonl", the_fix("parallel_answers.jsonl"))
    recs = records("parallel_answers.jsonl")
    assert len(rows) == 2 * len(recs)  # a chosen and a rejected side per record
    for rec in recs:
        best = max(range(5), key=lambda i: rec["rewards"][i])
        worst = min(range(5), key=lambda i: rec["rewards"][i])
        sides = [r for r in rows if rec["instruction"] in r["text"]]
        assert [s["trained"].split("<|im_end|>")[0] for s in sides] == [rec["responses"][best], rec["responses"][worst]]
        for i in set(range(5)) - {best, worst}:  # the others: not trained, not merged into a turn
            assert not any(rec["responses"][i] in s["text"] for s in sides)


def test_pack_model_completions_with_the_printed_fix(tmp_path):
    rows = packed(tmp_path, "model_completions.jsonl", the_fix("model_completions.jsonl"))
    for rec in records("model_completions.jsonl"):
        (row,) = [r for r in rows if rec["prompt"] in r["text"]]
        assert rec["prompt"] not in row["trained"]  # the prompt is the user turn, context
        assert row["trained"].startswith(rec["completions"][0]["completion"])
        assert rec["completions"][1]["completion"] not in row["text"]


def test_pack_capitalised_fields_with_the_printed_fix(tmp_path):
    rows = packed(tmp_path, "capitalised_fields.jsonl", the_fix("capitalised_fields.jsonl"))
    for rec in records("capitalised_fields.jsonl"):
        (row,) = [r for r in rows if rec["Question"] in r["text"]]
        assert rec["Response"] in row["trained"] and rec["Complex_CoT"] in row["trained"]
        assert rec["answer"] not in row["text"] and rec["question"] not in row["text"]


def test_pack_pair_conversations_with_the_printed_fix(tmp_path):
    rows = packed(tmp_path, "pair_conversations.jsonl", the_fix("pair_conversations.jsonl"))
    for rec in records("pair_conversations.jsonl"):
        last = rec["chosen_messages"][-1]["content"], rec["rejected_messages"][-1]["content"]
        sides = [r for r in rows if r["trained"].split("<|im_end|>")[0] in last]
        assert [s["trained"].split("<|im_end|>")[0] for s in sides] == list(last)
        assert all(rec["chosen_messages"][0]["content"] in s["text"] for s in sides)


def test_pack_turn_keys_with_the_printed_fix(tmp_path):
    rows = packed(tmp_path, "turn_keys.jsonl", the_fix("turn_keys.jsonl"))
    rec = records("turn_keys.jsonl")[0]
    (row,) = [r for r in rows if r["id"].endswith(":bread")]
    texts = [rec["dialogue"][f"turn_{i}"] for i in range(1, 13)]
    places = [row["text"].index(t) for t in texts]
    assert places == sorted(places)  # in numeric order
    assert all(t in row["trained"] for t in texts[1::2]) and not any(t in row["trained"] for t in texts[::2])


# ------------------------------------------------------------------------------------------------
# Shapes found after the first round: an answer under a compound name, an answer that is a list of steps beside a
# short label, two answers under marked keys with a label that picks one.

def test_a_compound_answer_name_is_read_by_its_head_word_and_the_longest_text_wins():
    """OpenMathInstruct-like: generated_solution (a solution) beside expected_answer (the bare result): the
    solution is trained, the short answer named as left."""
    assert the_fix("named_solution.jsonl") == ["--field", "problem=user", "--field", "generated_solution=assistant"]
    assert "expected_answer: shorter than generated_solution, left as another answer" in refusals("named_solution.jsonl")[0]


def test_a_short_label_is_never_trained_in_place_of_the_longest_text():
    """PRM-like: question, a list of solution steps, a one-word label. Training the label as the answer would
    drop the steps: no fix, and the refusal names the longest field and how to map it."""
    for detail in refusals("solution_steps.jsonl"):
        assert printed_fix(detail)[:2] == ["--field", "NAME=ROLE"] and "label=assistant" not in detail
        assert "its longest field, steps" in detail and "--field steps=ROLE" in detail


def test_marked_sides_are_suggested_as_a_pair_with_the_winner_left_to_the_user():
    """SHP-like: history, human_ref_A/human_ref_B, labels (1: A preferred). The sides and the prompt are found; the
    label's meaning is not guessed: its values are holes the user fills."""
    fix = the_fix("marked_sides.jsonl")
    assert fix == ["--pairs", "--pair-sides", "human_ref_A,human_ref_B", "--pair-prompt", "history",
                   "--pair-winner", "labels=VALUE_human_ref_A/VALUE_human_ref_B"]
    assert "(domain, post_id, score_A, score_B then counted as ignored)" in refusals("marked_sides.jsonl")[0]


def test_pack_named_solution_with_the_printed_fix(tmp_path):
    rows = packed(tmp_path, "named_solution.jsonl", the_fix("named_solution.jsonl"))
    for rec in records("named_solution.jsonl"):
        (row,) = [r for r in rows if rec["problem"] in r["text"]]
        assert row["trained"].startswith(rec["generated_solution"]) and rec["problem"] not in row["trained"]


def test_pack_marked_sides_with_the_printed_fix_filled_in(tmp_path):
    fix = [w.replace("VALUE_human_ref_A/VALUE_human_ref_B", "1/0") for w in the_fix("marked_sides.jsonl")]
    rows = packed(tmp_path, "marked_sides.jsonl", fix)
    for rec in records("marked_sides.jsonl"):
        chosen, rejected = ((rec["human_ref_A"], rec["human_ref_B"]) if rec["labels"] == 1
                            else (rec["human_ref_B"], rec["human_ref_A"]))
        sides = [r for r in rows if rec["history"] in r["text"]]
        assert [s["trained"].split("<|im_end|>")[0] for s in sides] == [chosen, rejected]


def test_scores_kept_as_objects_rank_the_parallel_answers(tmp_path):
    """Magpie's ``rewards_armorm`` holds one ``{"score": x}`` per answer: a parallel list of scores all the same, read
    through the one number of each object, suggested and packed as best against worst."""
    rec = {"instruction": "Suggest a name for a bakery that sells only sourdough bread.",
           "responses": ["Crumb & Crust", "The Bread Shop", "Wild Rise Bakery", "Bakery"],
           "rewards_armorm": [{"score": 0.31}, {"score": 0.12}, {"score": 0.77}, {"score": 0.05}]}
    src = tmp_path / "magpie.jsonl"
    src.write_text(json.dumps(rec) + "\n")
    out = cli("preview", str(src), "--no-color")
    [detail] = [line.strip() for line in out.splitlines() if line.startswith("   keys [")]
    assert printed_fix(detail) == ["--pairs", "--pair-ranked", "responses/rewards_armorm"]
    out = cli("preview", str(src), "--no-color", *printed_fix(detail))
    chosen, rejected = out.split("chosen:")[1].split("rejected:")[:2]
    assert "[[Wild Rise Bakery" in chosen and "[[Bakery<" in rejected


def test_any_one_character_side_mark_pairs_two_long_answers():
    """stack-exchange-paired keeps its two answers as response_j (the better) and response_k: the same stem with a
    one-character mark, two long texts. Short marked fields (multiple-choice distractor1/distractor2) are not sides."""
    from tests._internals import suggest

    rec = {"qid": 7, "question": "How do I reverse a list in Python without changing the original list?",
           "response_j": "Use slicing: reversed_copy = items[::-1] makes a new list and leaves items unchanged.",
           "response_k": "Call items.reverse(); it reverses the list in place and returns None, which is fine."}
    fix, words = suggest(rec)
    assert fix.text() == "--pairs --pair-sides response_j,response_k" and "response_j is taken as the chosen" in words
    quiz = {"question": "Which gas do plants absorb from the air for photosynthesis, mostly through their leaves?",
            "distractor1": "oxygen", "distractor2": "helium", "correct_answer": "carbon dioxide"}
    fix, _ = suggest(quiz)
    assert fix is None or "--pairs" not in fix.text()


# ------------------------------------------------------------------------------------------------
# Issue 42, round 2: HuatuoGPT-o1 (a longer lower-case question beside the capitalised family), MOSS (speakers as
# keys), Tulu (ids repeated by design), an OpenAssistant tree, and RL Parquet (prompt as messages, a solution string).

def test_pack_huatuo_o1_trains_the_reasoning_and_the_response_not_the_short_answer(tmp_path):
    """The lower-case question (multiple choice, with its options) is longer than Question, yet the capitalised
    family holds most of the record's text: Question, Complex_CoT and Response are read; question and answer left,
    each named with its reason (answer has no twin: never called a copy)."""
    fix = the_fix("huatuo_o1.jsonl")
    assert fix == ["--field", "Question=user", "--field", "Complex_CoT=reasoning", "--field", "Response=assistant"]
    detail = refusals("huatuo_o1.jsonl")[0]
    assert "question: the same field as Question in lower-case keys, left" in detail
    assert "answer: shorter than Response" in detail and "answer: the same" not in detail
    rows = packed(tmp_path, "huatuo_o1.jsonl", fix)
    assert len(rows) == len(records("huatuo_o1.jsonl"))
    for rec in records("huatuo_o1.jsonl"):
        (row,) = [r for r in rows if rec["Question"] in r["text"]]
        assert rec["Complex_CoT"] in row["trained"] and rec["Response"] in row["trained"]  # the long texts train
        assert rec["Question"] not in row["trained"]  # the question is context
        assert rec["question"] not in row["text"] and rec["answer"] not in row["text"]  # the short answer: never


def test_moss_speakers_as_keys_are_refused_naming_what_is_missing(tmp_path):
    """MOSS keeps each turn as {Human: "<|Human|>: ...", MOSS: "<|MOSS|>: ..."}: no option maps a key's name to a role,
    so no fix is offered, and never one that takes a role name from a message's text."""
    details = refusals("moss_chat.jsonl")
    assert len(details) == len(records("moss_chat.jsonl"))
    for detail in details:
        assert printed_fix(detail) == [] and "--roles" not in detail and "<|Human|>" not in detail
        assert "one key per speaker (Human, Inner Thoughts, Commands, Tool Responses, MOSS)" in detail
        assert "convert each turn into {role, content} objects" in detail
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["pack", str(SHAPES_DIR / "moss_chat.jsonl"), "--output", str(out)])
    assert r.exit_code == 3 and "unknown_format" in r.output and "--roles '<|" not in r.output, r.output


def test_pack_tulu_completions_with_the_printed_fix_keeps_every_completion(tmp_path):
    """Tulu keeps one record per completion, three sharing each prompt's id: the printed fix names --ids position,
    without which four of the six records would be duplicate_id dead letters."""
    fix = the_fix("tulu_completions.jsonl")
    assert fix == ["--field", "prompt=user", "--field", "model_output=assistant", "--ids", "position"]
    rows = packed(tmp_path, "tulu_completions.jsonl", fix)
    recs = records("tulu_completions.jsonl")
    assert len(rows) == len(recs)
    for rec in recs:
        (row,) = [r for r in rows if rec["model_output"] in r["text"]]
        assert row["trained"].startswith(rec["model_output"]) and rec["prompt"] not in row["trained"]
    unique = tmp_path / "unique.jsonl"  # ids that do not repeat: the fix does not name --ids
    unique.write_text("".join(json.dumps(dict(r, id=f"u{i}")) + "\n" for i, r in enumerate(recs)))
    out = cli("preview", str(unique), "--no-color", "-n", "50")
    assert "--ids" not in out and "--field prompt=user --field model_output=assistant" in out


def test_pack_oasst_tree_with_the_printed_fix(tmp_path):
    """An OpenAssistant tree: the refusal names --tree prompt (not only --messages-field PATH); packed so, every
    root-to-leaf path is one conversation, each ending on an assistant reply that is trained."""
    fix = the_fix("oasst_tree.jsonl")
    assert fix == ["--tree", "prompt"]
    rows = packed(tmp_path, "oasst_tree.jsonl", fix)
    t1, t2 = records("oasst_tree.jsonl")
    root, (a, b) = t1["prompt"], t1["prompt"]["replies"]
    follow, last = b["replies"][0], b["replies"][0]["replies"][0]
    paths = [r for r in rows if root["text"] in r["text"]]
    assert len(paths) == 2  # [root, a] and [root, b, follow, last]; [root, b] begins the latter: not kept twice
    assert [r["trained"].split("<|im_end|>")[0] for r in paths if last["text"] not in r["text"]] == [a["text"]]
    deep = [r for r in paths if last["text"] in r["text"]]
    assert len(deep) == 1 and follow["text"] in deep[0]["text"] and follow["text"] not in deep[0]["trained"]
    assert b["text"] in deep[0]["trained"] and last["text"] in deep[0]["trained"]
    assert any(t2["prompt"]["replies"][0]["text"] in r["trained"] for r in rows)
    assert all(root["text"] not in r["trained"] for r in paths)


def _parquet(tmp_path: Path, answer_key: str) -> tuple[Path, list[dict]]:
    """An RL-style Parquet file (verl): ``prompt`` a list of messages, the answer a string, beside metadata columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    recs = [{"data_source": "algebra", "prompt": [{"role": "user", "content": "Solve 2x + 3 = 11 for x."}],
             answer_key: "Subtract 3 from both sides: 2x = 8. Divide by 2: x = 4.", "ability": "math"},
            {"data_source": "algebra", "prompt": [{"role": "user", "content": "What is 15% of 80?"}],
             answer_key: "15% of 80 is 0.15 * 80 = 12.", "ability": "math"}]
    path = tmp_path / f"rl_{answer_key}.parquet"
    pq.write_table(pa.Table.from_pylist(recs), path)
    return path, recs


@pytest.mark.parametrize("answer_key", ["solution", "generated_solution"])
def test_pack_parquet_prompt_and_solution_with_the_printed_fix(tmp_path, answer_key):
    """A Parquet file whose prompt is a list of messages and whose answer is a solution string: the fix maps the
    solution after the prompt's turns, and the solution is what trains."""
    path, recs = _parquet(tmp_path, answer_key)
    out = cli("preview", str(path), "--no-color", "-n", "50")
    details = [line.strip() for line in out.splitlines() if line.startswith("   keys [")]
    assert len(details) == len(recs) and len({tuple(printed_fix(d)) for d in details}) == 1, details
    fix = printed_fix(details[0])
    assert fix == ["--messages-field", "prompt", "--field", f"{answer_key}=assistant"]
    dest = tmp_path / "out"
    cli("pack", str(path), "--output", str(dest), *fix)
    from tests.test_pipeline import _rows

    tok = load_tokenizer(PackOptions(inputs=("-",)).tokenizer)
    trained = [tok.decode([t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]) for row in _rows(str(dest))]
    for rec in recs:
        assert any(rec[answer_key] in t and rec["prompt"][0]["content"] not in t for t in trained), trained


def test_pack_numbered_turns_with_no_prompt_as_two_turns_not_a_pair(tmp_path):
    """CAMEL's message_1/message_2 share a stem and differ by a mark, as a pair's sides do (SHP's human_ref_A/B), but
    nothing beside them is a prompt both could answer: they are the question and its answer, in the marks' order.
    Suggested as a pair, the question would have trained as a rival answer to an empty prompt."""
    fix = the_fix("numbered_turns.jsonl")
    assert fix == ["--field", "message_1=user", "--field", "message_2=assistant"]
    rows = packed(tmp_path, "numbered_turns.jsonl", fix)
    assert len(rows) == len(records("numbered_turns.jsonl"))
    for rec in records("numbered_turns.jsonl"):
        (row,) = [r for r in rows if rec["message_1"] in r["text"]]
        assert rec["message_2"] in row["trained"] and rec["message_1"] not in row["trained"]
