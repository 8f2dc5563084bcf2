"""Nothing a user sets or gives is dropped without a word (issue 52), on the pipeline's side: each cause as a family
of generated inputs, not only the case that was reported.

====================================  ==========================================================================
family                                what must happen
====================================  ==========================================================================
label spellings x value forms         a KTO label is read (``label``/``kto_tag`` holding a JSON boolean, as TRL),
x known / unknown shapes              or the summary or the suggested fix names ``--kto-label FIELD``; the fix,
                                      run, keeps every label it names (never an answer column: Label=assistant)
two label fields                      agreeing: read once; disagreeing: a ``label_conflict`` dead letter
encodings x text kinds                UTF-16/32 (with or without a byte-order mark): one line naming the
                                      encoding and iconv, exit 2; never packed as mojibake
an unnamed first CSV column           DataFrame.to_csv's index: read under ``Unnamed: 0``, counted as ignored,
                                      a note says so; any other unnamed column is still refused
most records dead-lettered            exit 3 by default (``--max-reject-fraction`` 0.5), counts and dead
                                      letters written; ``--max-reject-fraction 1`` never fails
verify --inputs from elsewhere        relative INPUT paths resolve from the folder the pack ran in
an image in a preference answer       ``non_text_content`` naming the side, whatever form the image takes
====================================  ==========================================================================
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main


def run(*args: str):
    result = CliRunner().invoke(main, list(args))
    assert isinstance(result.exception, (SystemExit, type(None))), repr(result.exception)  # never a traceback
    assert "Traceback" not in result.output
    return result


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def dead(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]


# -- KTO labels: read once, under any spelling ----------------------------------------------------------------------

SPELLINGS = ["label", "kto_tag", "Label", "LABEL", "KTO_TAG", "Kto-Tag", "kto tag"]
FORMS = {"bool": lambda v: v, "text": lambda v: "true" if v else "false", "digit": lambda v: "1" if v else "0",
         "word": lambda v: "True" if v else "False"}


def _csv_cell(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else str(v)


@pytest.mark.parametrize("seed", [*range(10), *(pytest.param(s, marks=pytest.mark.slow) for s in range(10, 60))])
def test_a_kto_label_is_read_or_named_under_every_spelling_and_the_named_fix_keeps_it(tmp_path, seed):
    rng = random.Random(seed)
    key, form = rng.choice(SPELLINGS), rng.choice(sorted(FORMS))
    capital = rng.random() < 0.5  # Prompt/Completion: no known shape, so the fix is a suggestion
    csv = rng.random() < 0.4
    if csv and form == "bool":
        form = "text"  # a CSV cell cannot hold a boolean
    labels = [rng.random() < 0.5 for _ in range(6)]
    labels[0], labels[1] = True, False  # both kinds, every time
    p, c = ("Prompt", "Completion") if capital else ("prompt", "completion")
    records = [{p: f"question {i}?", c: f"answer {i}.", key: FORMS[form](v)} for i, v in enumerate(labels)]
    if csv:
        src = tmp_path / "in.csv"
        src.write_text(f"{p},{c},{key}\n" + "".join(f"{r[p]},{r[c]},{_csv_cell(r[key])}\n" for r in records))
    else:
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    first = run("pack", str(src), "-o", str(out), "--max-reject-fraction", "1")
    assert first.exit_code in (0, 3), first.output
    counts = manifest(out)["counts"]
    read_by_itself = key in ("label", "kto_tag") and form == "bool" and not capital
    if read_by_itself:
        fix: list[str] = []
    else:
        assert f"--kto-label {key}" in first.output.replace("'", ""), first.output  # named, in the summary or the fix
        assert counts["normalization"].get("kto_labels:desirable") is None  # nothing read as a label without it
        for reason, n in counts["rejected_by_reason"].items():  # a suggestion never takes the label for an answer
            assert f"{key}=assistant" not in json.dumps(counts["first_rejected"]), counts["first_rejected"]
        if capital:  # the fix as the dead letter types it, shell words and all ('kto tag' quoted)
            detail = counts["first_rejected"]["unknown_format"]["detail"]
            fix = _shell_words(detail.split("read it with ", 1)[1].split(" (")[0].split(";")[0])
        else:
            fix = ["--kto-label", key]
        out = tmp_path / "out2"
        again = run("pack", str(src), "-o", str(out), *fix)
        assert again.exit_code == 0, (fix, again.output)
        counts = manifest(out)["counts"]
    kept = counts["normalization"]
    assert kept.get("kto_labels:desirable", 0) == sum(labels) and kept.get("kto_labels:undesirable", 0) == (
        len(labels) - sum(labels)), (key, form, capital, csv, kept)
    assert counts["examples_packed"] == len(labels)


def _shell_words(text: str) -> list[str]:
    import shlex

    return shlex.split(text)


@pytest.mark.parametrize("label,tag,reason", [(True, True, None), (False, False, None), (True, False, "label_conflict"),
                                              (False, True, "label_conflict")])
def test_two_label_fields_are_read_once_and_a_disagreement_is_a_dead_letter(tmp_path, label, tag, reason):
    src = tmp_path / "in.jsonl"
    good = {"prompt": "p?", "completion": "c.", "label": True}
    src.write_text(json.dumps({"prompt": "q?", "completion": "a.", "label": label, "kto_tag": tag}) + "\n"
                   + json.dumps(good) + "\n")
    out = tmp_path / "out"
    r = run("pack", str(src), "-o", str(out), "--max-reject-fraction", "1")
    assert r.exit_code == 0, r.output
    counts = manifest(out)["counts"]
    if reason is None:
        assert counts["examples_packed"] == 2 and "kto_tag" not in json.dumps(counts["normalization"])
        assert counts["normalization"][f"kto_labels:{'desirable' if label else 'undesirable'}"] >= 1
    else:
        [d] = dead(out)
        assert d["reason"] == reason and "label is" in d["detail"] and "kto_tag is" in d["detail"], d


@pytest.mark.parametrize("seed", range(12))
def test_label_fields_of_any_spelling_and_form_that_disagree_are_a_conflict(tmp_path, seed):
    """Generated: the label read (an exact ``label``/``kto_tag`` boolean, or ``--kto-label FIELD``) beside another
    field of a label's name in any spelling and form; disagreeing is ``label_conflict``, agreeing packs once."""
    rng = random.Random(seed)
    named = rng.random() < 0.4
    read_key = "verdict" if named else rng.choice(["label", "kto_tag"])
    other = rng.choice([k for k in SPELLINGS if k != read_key])
    value, agree = rng.random() < 0.5, rng.random() < 0.5
    record = {"prompt": "q?", "completion": "a.", read_key: FORMS["text" if named else "bool"](value),
              other: FORMS[rng.choice(sorted(FORMS))](value if agree else not value)}
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(record) + "\n" + json.dumps({"prompt": "p?", "completion": "c.", read_key: (
        "true" if named else True)}) + "\n")
    out = tmp_path / "out"
    r = run("pack", str(src), "-o", str(out), "--max-reject-fraction", "1", *(["--kto-label", read_key] if named else []))
    assert r.exit_code == 0, r.output
    counts = manifest(out)["counts"]
    if agree:
        assert counts["examples_packed"] == 2 and counts["rejected"] == 0, (record, counts)
        assert not any(k.startswith("ignored_field:") for k in counts["normalization"]), counts["normalization"]
    else:
        [d] = dead(out)
        assert d["reason"] == "label_conflict" and read_key in d["detail"] and other in d["detail"], (record, d)


# -- text encodings: decoded as declared or refused -----------------------------------------------------------------

TEXTS = {
    "txt": "hello there\nsecond line é\n",
    "jsonl": '{"text": "hello é"}\n{"text": "again"}\n',
    "json": '[{"text": "hello é"}]\n',
    "csv": "prompt,completion\nhi é,there\n",
    "tsv": "prompt\tcompletion\nhi é\tthere\n",
}
ENCODINGS = ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]


@pytest.mark.parametrize("kind", sorted(TEXTS))
@pytest.mark.parametrize("encoding", ENCODINGS)
def test_a_text_input_not_in_utf8_is_refused_naming_its_encoding(tmp_path, kind, encoding):
    src = tmp_path / f"in.{kind}"
    src.write_bytes(TEXTS[kind].encode(encoding))
    r = run("pack", str(src), "-o", str(tmp_path / "out"))
    assert r.exit_code == 2, r.output
    [line] = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert "not UTF-8" in line and "iconv" in line and str(src) in line, line
    if "16" in encoding:
        assert "UTF-16" in line, line
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("kind", sorted(TEXTS))
def test_utf8_with_or_without_its_mark_still_packs(tmp_path, kind):
    src = tmp_path / f"in.{kind}"
    src.write_bytes(TEXTS[kind].encode("utf-8-sig"))
    r = run("pack", str(src), "-o", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    assert manifest(tmp_path / "out")["counts"]["rejected"] == 0


# -- CSV index columns ----------------------------------------------------------------------------------------------

def test_an_unnamed_first_csv_column_is_read_as_an_ignored_index_and_said(tmp_path):
    src = tmp_path / "frame.csv"
    src.write_text(",prompt,completion\n0,hi,there\n1,yo,man\n")  # what DataFrame.to_csv() writes by default
    out = tmp_path / "out"
    r = run("pack", str(src), "-o", str(out))
    assert r.exit_code == 0, r.output
    m = manifest(out)
    assert m["counts"]["examples_packed"] == 2
    assert m["counts"]["normalization"]["ignored_field:Unnamed: 0"] == 2
    [note] = m["notes"]
    assert "first column has no name" in note and "'Unnamed: 0'" in note and note in r.output.replace("\n", " ") or (
        "first column has no name" in r.output)
    other = tmp_path / "gap.csv"
    other.write_text("prompt,,completion\nhi,x,there\n")
    refused = run("pack", str(other), "-o", str(tmp_path / "out2"))
    assert refused.exit_code == 2 and "column 2 of the header row has no name" in refused.output


# -- a pack that dead-letters most of its input fails --------------------------------------------------------------

def test_a_pack_that_dead_letters_most_records_fails_by_default_with_its_counts_written(tmp_path):
    src = tmp_path / "ids.jsonl"
    src.write_text("".join(json.dumps({"id": "same", "text": f"t{i}"}) + "\n" for i in range(3)))
    out = tmp_path / "out"
    r = run("pack", str(src), "-o", str(out))
    assert r.exit_code == 3, r.output
    assert "--max-reject-fraction" in r.output and "duplicate_id" in r.output and "--ids position" in r.output
    m = manifest(out)
    assert m["status"] == "failed" and m["exit_code"] == 3 and m["counts"]["rejected"] == 2
    assert len(dead(out)) == 2
    ok = run("pack", str(src), "-o", str(tmp_path / "out2"), "--max-reject-fraction", "1")
    assert ok.exit_code == 0 and "the run fails above" not in ok.output
    fine = run("pack", str(src), "-o", str(tmp_path / "out3"), "--ids", "position")
    assert fine.exit_code == 0 and "the run fails above 50% rejected or dropped: --max-reject-fraction" in fine.output


# -- verify --inputs from any folder -------------------------------------------------------------------------------

def test_verify_finds_relative_inputs_from_another_folder(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "inputs").mkdir(parents=True)
    (project / "inputs" / "a.jsonl").write_text(json.dumps({"prompt": "p?", "completion": "c."}) + "\n")
    monkeypatch.chdir(project)
    assert run("pack", "inputs/a.jsonl", "-o", "out", "-q").exit_code == 0
    assert manifest(project / "out")["inputs_from"] == str(project)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    ok = run("verify", str(project / "out"), "--inputs")
    assert ok.exit_code == 0 and ok.output.rstrip().endswith("OK"), ok.output
    # An older manifest (no inputs_from) is found by the recorded input paths.
    m = manifest(project / "out")
    del m["inputs_from"]
    (project / "out" / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    again = run("verify", str(project / "out"), "--inputs")
    assert again.exit_code == 0 and again.output.rstrip().endswith("OK"), again.output


def test_absolute_inputs_record_no_working_folder(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"prompt": "p?", "completion": "c."}) + "\n")
    assert run("pack", str(src), "-o", str(tmp_path / "out"), "-q").exit_code == 0
    assert "inputs_from" not in manifest(tmp_path / "out")


# -- an image in a preference answer is named as such ----------------------------------------------------------------

@pytest.mark.parametrize("seed", range(8))
def test_an_image_in_a_preference_answer_is_named_whatever_its_form(tmp_path, seed):
    from PIL import Image

    from tests.test_vision_pipeline import VISION_TOKENS, save_tokenizer

    rng = random.Random(seed)
    tokenizer = save_tokenizer(tmp_path / "tok", VISION_TOKENS)
    Image.new("RGB", (60, 40), "red").save(tmp_path / "a.png")
    records, want = [], {}
    for i in range(6):
        form = rng.choice(["part", "column_part", "column_tag"])
        where = rng.choice(["prompt", "chosen", "rejected"])
        layout = rng.choice(["explicit", "implicit"])

        def content(text: str, image: bool):
            if not image:
                return text
            if form == "part":
                return [{"type": "image_url", "image_url": {"url": "a.png"}}, {"type": "text", "text": text}]
            if form == "column_part":
                return [{"type": "image"}, {"type": "text", "text": text}]
            return "<image>" + text

        prompt = [{"role": "user", "content": content(f"question {i}?", True)}]  # the prompt always has one
        chosen = [{"role": "assistant", "content": content("yes", where == "chosen")}]
        rejected = [{"role": "assistant", "content": content("no", where == "rejected")}]
        rec = ({"id": f"r{i}", "prompt": prompt, "chosen": chosen, "rejected": rejected} if layout == "explicit" else
               {"id": f"r{i}", "chosen": prompt + chosen, "rejected": prompt + rejected})
        if form != "part":
            rec["images"] = ["a.png"] * (1 + (where != "prompt"))
        records.append(rec)
        want[f"r{i}"] = None if where == "prompt" else where
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    r = run("pack", str(src), "--pairs", "--processor", "qwen2-vl", "--tokenizer", tokenizer, "-o", str(out), "-q",
            "--max-reject-fraction", "1")
    assert r.exit_code in (0, 3), r.output
    got = {d["example_id"].split(":")[-1]: d for d in dead(out)}
    for rid, side in want.items():
        if side is None:
            assert rid not in got, got[rid]
        else:
            assert got[rid]["reason"] == "non_text_content", (rid, side, got[rid])
            assert got[rid]["detail"].startswith(f"the {side} answer holds an image"), (rid, side, got[rid])


def test_shard_notes_keep_the_manifest_of_a_run_that_needs_none(tmp_path):
    """A run with no relative input, no capped shards and no index column writes no notes and no inputs_from."""
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"text": "x"}) + "\n")
    assert run("pack", str(src), "-o", str(tmp_path / "out"), "-q").exit_code == 0
    m = manifest(tmp_path / "out")
    assert "notes" not in m and "inputs_from" not in m
    assert os.path.isabs(m["inputs"][0]["path"])


# -- shard counts capped by what fills them ------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(40))
def test_the_shard_layout_gives_every_shard_a_group_of_enough_records(seed):
    """Over generated runs: an explicit --num-shards is at most one shard per 1,000 records the split expects (or
    per --group-size, when smaller, down to 8), and in grouped mode each shard packs at least one group."""
    import math

    from pipeline import PackMode, PackOptions
    from tests._internals import _write

    rng = random.Random(seed)
    records = rng.choice([1, 7, 999, 1000, 1001, 30_000, 10**6])
    options = PackOptions(inputs=("in.jsonl",), num_shards=rng.choice([0, 1, 3, 64, 50_000, 99_999]),
                          group_size=rng.choice([1, 8, 500, 10_000]), validation_fraction=rng.choice([0.0, 0.1]),
                          mode=rng.choice(list(PackMode)))
    groups, shards = _write.shard_layout(options, records, records * 100)
    each = min(_write.SHARD_RECORDS, max(_write.MIN_SHARD_RECORDS, options.group_size))
    for split, frac in (("train", 1 - options.validation_fraction), ("validation", options.validation_fraction)):
        if options.num_shards:
            assert shards[split] <= max(1, math.ceil(records * frac / each)), (split, groups, shards)
            assert shards[split] <= options.num_shards
        if options.mode is PackMode.GROUPED:
            assert groups[split] >= shards[split] >= 1


@pytest.mark.parametrize("seed", range(12))
def test_asked_for_more_shards_than_fill_every_shard_holds_rows(tmp_path, seed):
    rng = random.Random(seed)
    n = rng.randint(40, 400)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"q{i} " * rng.randint(1, 20), "completion": f"a{i}."}) + "\n"
                           for i in range(n)))
    group = rng.choice([4, 16, 64])
    out = tmp_path / "out"
    r = run("pack", str(src), "-o", str(out), "-q", "--num-shards", str(n * 10), "--group-size", str(group),
            "--max-tokens", "256")
    assert r.exit_code == 0, r.output
    m = manifest(out)
    rows = [s["rows"] for s in m["shards"]]
    assert 1 <= len(rows) <= m["counts"]["rows"] and min(rows) > 0, (n, group, rows)
