"""Bad input through ``packstream pack``: every record is packed or dead-lettered with a reason.

Per-record problems are one corpus: one small file per case (the file name is the case), packed in
a single run. For each file the test knows which positions (1-based lines for JSONL, 0-based
indices otherwise) must be dead-lettered, under which reason and with which words in the detail,
that every other record is packed, and what normalization notes its packed records add (turns
dropped or merged, fields ignored). Controls are records that look odd but must be packed. The
run is then reconciled three ways: per source from the files, through the manifest's counts, and
by ``packstream verify --inputs``.

Whole-input problems found at launch (a file that is not what its extension says, empty inputs,
unreadable files) are separate CLI invocations that must exit 2 with one ``error:`` line and no
traceback. A file that breaks off mid-way is found by the worker reading it: errors as data, the
records before the break are packed and the rest of the file is one ``corrupt_input`` dead
letter. The last section covers safety: sandboxed chat templates, ``trust_remote_code``, and
record ids that look like paths.
"""

from __future__ import annotations

import bz2
import dataclasses
import gzip
import hashlib
import json
import logging
import lzma
import os
import re
from collections import Counter
from typing import Any, Union

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from pipeline import PackOptions
from pipeline.cli import main
from tests._internals import Conversation, FormatOptions, Reason, Rejected
from tests.test_verify import read_rows

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
BUDGET = 256
MAX_RECORD_BYTES = 2_000_000


def turns(*pairs) -> dict:
    return {"messages": [{"role": r, "content": c} for r, c in pairs]}


def chat(*pairs) -> dict:
    """lmsys-chat's ``conversation``: a shape TRL does not read, so packstream's hygiene applies (TRL's ``messages``
    and ``conversations`` keep their turns as written: --turns written)."""
    return {"conversation": [{"role": r, "content": c} for r, c in pairs]}


def sharegpt(*pairs, **extra) -> dict:
    return {"conversations": [{"from": f, "value": v} for f, v in pairs], **extra}


def _zstd(data: bytes) -> bytes:
    """A zstd stream, as the zstd tool writes it (pyarrow's codec: no dependency of its own)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as out:
        out.write(data)
    return sink.getvalue().to_pybytes()


def jsonl(*lines: Union[dict, list, str, bytes]) -> bytes:
    """One line each: objects are JSON-encoded, str and bytes written verbatim."""
    out = []
    for line in lines:
        if isinstance(line, bytes):
            out.append(line)
        elif isinstance(line, str):
            out.append(line.encode())
        else:
            out.append(json.dumps(line).encode())
    return b"\n".join(out) + b"\n"


def parquet(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


Expect = Union[str, tuple[str, str]]  # reason, or (reason, words the detail must contain)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    expect: dict[int, Expect]
    """Position -> reason; every other record of the file must be packed."""
    ext: str = "jsonl"
    records: int = 0
    """Records in the file (JSONL: counted from the non-blank lines)."""
    notes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Normalization notes the file's packed records add to the manifest's ``counts.normalization``."""

    @property
    def source(self) -> str:
        return f"{self.name}.{self.ext}"

    def num_records(self) -> int:
        if self.ext == "jsonl":
            return sum(1 for line in self.data.split(b"\n") if line.strip())
        return self.records


HUGE = {"text": "x" * 3_000_000}  # 3 MB > --max-record-bytes 2 MB
BIG = {"text": "word " * 240_000}  # 1.2 MB: parsed, but far over the token budget
LONG = {"text": " ".join(f"word{i}" for i in range(600))}

CASES = [
    # --- malformed JSON (each line is its own record; the file still starts like JSON)
    Case("json_truncated", jsonl(GOOD, '{"messages": [{"role": "user"'), {2: ("malformed_json", "column 30")}),
    Case("json_trailing_comma", jsonl('{"text": "a",}', GOOD), {1: "malformed_json"}),
    Case("json_single_quotes", jsonl("{'text': 'a'}", GOOD), {1: ("malformed_json", "property name")}),
    Case("json_deep_nesting", jsonl('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}", GOOD),
         {1: ("malformed_json", "than the 512 levels packstream reads")}),
    # NaN is no number a text can hold (finite numbers are read as text, see numbers_as_text below)
    Case("json_nan_content", jsonl('{"text": NaN}', GOOD), {1: ("bad_type", "text is float nan")}),
    Case("blank_lines_keep_line_numbers", jsonl(GOOD, "", "   ", "{broken"), {4: "malformed_json"}),
    # --- not an object, or no known shape
    Case("top_level_array", jsonl(GOOD, "[1, 2]"), {2: ("not_an_object", "JSON array")}),
    Case("top_level_string", jsonl(GOOD, '"hello"'), {2: ("not_an_object", "JSON string")}),
    Case("top_level_null", jsonl(GOOD, "null"), {2: ("not_an_object", "JSON null")}),
    Case("top_level_number", jsonl(GOOD, "42"), {2: ("not_an_object", "JSON number")}),
    Case("unknown_keys", jsonl({"foo": 1, "bar": 2}, GOOD), {1: ("unknown_format", "--field")}),
    # --- wrong types
    # An object with one string field is read as that text (content_one_string_object below); with two,
    # which one is the text is a guess, so the detail names the candidate key instead.
    Case("content_object", jsonl(turns(("user", {"text": "hi", "lang": "en"}), ("assistant", "ok"))),
         # --content-key text would leave the lang text unread: not printed as a fix (tests/test_suggestions.py)
         {1: ("bad_type", ("messages[0].content is an object with keys [lang, text], not text; pick the key that "
                           "holds the text: --content-key KEY"))}),
    Case("content_list", jsonl(turns(("user", [1, 2]), ("assistant", "ok"))), {1: ("bad_type", "messages[0].content is list")}),
    Case("content_null", jsonl(turns(("user", None), ("assistant", "ok"))), {1: ("bad_type", "messages[0].content is null")}),
    # Numbers are written as text (numbers_as_text below); a boolean is no text.
    Case("content_bool", jsonl(turns(("user", True), ("assistant", "ok"))), {1: ("bad_type", "messages[0].content is bool")}),
    Case("assistant_content_bool", jsonl(turns(("user", "hi"), ("assistant", False))),
         {1: ("bad_type", "messages[1].content is bool")}),
    Case("messages_is_string", jsonl({"messages": "hi"}), {1: ("bad_type", "messages is str")}),
    Case("turn_is_string", jsonl({"messages": ["hi", "there"]}), {1: ("bad_type", "messages[0] is str")}),
    Case("alpaca_output_null", jsonl({"instruction": "Add 2 and 3.", "output": None}), {1: ("bad_type", "output is null")}),
    Case("alpaca_instruction_bool", jsonl({"instruction": True, "output": "x"}), {1: ("bad_type", "instruction is bool")}),
    Case("completion_bool", jsonl({"prompt": "2+2?", "completion": False}), {1: ("bad_type", "completion is bool")}),
    Case("sharegpt_not_a_list", jsonl({"conversations": "hi"}), {1: ("bad_type", "conversations is str")}),
    Case("tools_not_json", jsonl({**GOOD, "tools": "{not json"}), {1: ("bad_type", "tools")}),
    Case("tool_calls_not_a_list", jsonl({"messages": [{"role": "user", "content": "x"},
                                                      {"role": "assistant", "content": "", "tool_calls": "f()"}]}),
         {1: ("bad_type", "tool_calls is str")}),
    # --- missing fields
    Case("turn_without_content", jsonl({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}),
         {1: ("missing_field", "messages[0] has no 'content'")}),
    Case("turn_without_role", jsonl({"messages": [{"content": "x"}, {"role": "assistant", "content": "x"}]}),
         {1: ("missing_field", "messages[0] has no 'role'")}),
    Case("sharegpt_without_value", jsonl({"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}),
         {1: ("missing_field", "'value'")}),
    Case("instances_without_output", jsonl({"instruction": "Sort.", "instances": [{"input": "b a"}]}),
         {1: ("missing_field", "'output'")}),
    # --- conversation structure
    Case("empty_messages", jsonl({"messages": []}), {1: "empty_conversation"}),
    Case("empty_sharegpt", jsonl({"conversations": []}), {1: "empty_conversation"}),
    Case("only_system", jsonl(turns(("system", "Be brief."))), {1: ("no_assistant_turn", "only a system turn")}),
    Case("no_assistant_turn", jsonl(turns(("user", "hi"))), {1: "no_assistant_turn"}),
    # An empty assistant turn: kept as written (TRL's messages), its end of turn trained, as TRL trains it; under
    # --turns cleaned it is dropped like any empty turn, which leaves nothing to train on (tests/test_formats.py).
    Case("empty_assistant_turn", jsonl(turns(("user", "hi"), ("assistant", ""))), {}),
    # `bot` is a built-in alias of assistant (bot_is_an_alias below); `critic` is no role packstream knows.
    Case("unknown_role", jsonl(turns(("user", "a"), ("critic", "b"))), {1: ("unknown_role", "'critic'")}),
    Case("sharegpt_unknown_speaker", jsonl(sharegpt(("human", "a"), ("narrator", "b"))), {1: ("unknown_role", "'narrator'")}),
    Case("role_is_number", jsonl({"messages": [{"role": 1, "content": "a"}, {"role": "assistant", "content": "b"}]}),
         {1: ("unknown_role", "messages[0].role is '1'")}),
    # --- not text
    Case("image_content_part", jsonl(turns(("user", [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
                                                     {"type": "text", "text": "What is this?"}]), ("assistant", "A cat."))),
         {1: ("non_text_content", "messages[0].content[0] is an image_url part")}),
    Case("images_beside_the_text", jsonl({**turns(("user", "<image>What is this?"), ("assistant", "A cat.")),
                                          "images": ["cat.png"]}),
         {1: ("non_text_content", "1 images in 'images', referred to by 1 <image> placeholders")}),
    # --- pre-tokenized: ids made by a tokenizer nobody named (this run passes no --tokenized-with), or
    # values that are no token id of any tokenizer (found before the vocabulary is consulted)
    Case("preference_pair_without_preference", jsonl(
        {"conversations": [{"from": "human", "value": "2+2?"}], "chosen": {"from": "gpt", "value": "4"},
         "rejected": {"from": "gpt", "value": "5"}}, GOOD), {1: ("preference_pair", "--preference chosen")}),
    Case("pretokenized_without_tokenized_with", jsonl({"input_ids": [9707, 11, 1879]}),
         {1: ("pretokenized_unverified", "pass --tokenized-with")}),
    Case("negative_token_id", jsonl({"input_ids": [9707, -5, 1879]}), {1: ("bad_token_id", "input_ids holds -5")}),
    # --- encoding
    Case("invalid_utf8", b'{"text": "caf\xe9"}\n' + jsonl(GOOD), {1: ("invalid_utf8", "byte")}),
    Case("lone_surrogate", jsonl('{"text": "a \\ud800 b"}', GOOD), {1: ("invalid_utf8", "lone surrogate")}),
    Case("lone_surrogate_in_tools", jsonl({**GOOD, "tools": [{"name": "\udfff"}]}, GOOD), {1: ("invalid_utf8", "'\\udfff'")}),
    Case("lone_surrogate_in_json_array", ('[{"text": "\\udfff"}, ' + json.dumps(GOOD) + "]").encode(),
         {0: ("invalid_utf8", "lone surrogate")}, ext="json", records=2),
    Case("surrogate_pair_is_fine", jsonl('{"text": "smile \\ud83d\\ude00"}'), {}),
    Case("byte_order_mark", b"\xef\xbb\xbf" + jsonl(GOOD), {}),  # the BOM is not part of the first record
    # --- size
    Case("huge_record", jsonl(GOOD, HUGE), {2: ("record_too_large", "--max-record-bytes")}),
    Case("huge_in_json_array", json.dumps([GOOD, HUGE]).encode(), {1: "record_too_large"}, ext="json", records=2),
    Case("big_but_allowed_too_long", jsonl(BIG, GOOD), {1: ("too_long", "--long")}),
    Case("too_long", jsonl(LONG, GOOD), {1: ("too_long", f"> budget {BUDGET}")}),
    # --- empty once rendered, or nothing to train on
    Case("empty_text", jsonl({"text": ""}, GOOD), {1: ("empty_after_render", "no tokens")}),
    Case("whitespace_text", jsonl({"text": " \n\t "}, GOOD), {1: "empty_after_render"}),
    # Labelled segments are trained exactly as labelled, with no EOS added: all false is no target at all.
    Case("segments_all_unlabelled", jsonl({"segments": [{"text": "Q: 2+2? A: 4", "label": False}]}, GOOD),
         {1: ("no_target_tokens", "no token is a training target")}),
    # --- labels: two label fields that disagree are one answer with two desirabilities, never one of them picked
    Case("label_conflict", jsonl({"prompt": "2+2?", "completion": "4", "label": True, "kto_tag": False}, GOOD),
         {1: ("label_conflict", "two desirabilities")}),
    # --- ids: own ids read back as `source:id`; the second record with one is dropped, naming the first
    Case("duplicate_id", jsonl({"id": "q1", **GOOD}, {"id": "q1", **turns(("user", "Yo"), ("assistant", "Hey"))}),
         {2: ("duplicate_id", "id 'duplicate_id.jsonl:q1' already used by duplicate_id.jsonl at 1")}),
    # --- other containers: positions are 0-based indices
    Case("json_array_with_number", json.dumps([GOOD, 5, GOOD]).encode(), {1: "not_an_object"}, ext="json", records=3),
    Case("parquet_rows", parquet(pa.table({"messages": [
        GOOD["messages"], [], [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]]})),
         # a null struct field is a field the record lacks (a columnar schema fills those with nulls)
         {1: "empty_conversation", 2: ("missing_field", "messages[0] has no 'content'")}, ext="parquet", records=3),
    Case("jsonl_gz", gzip.compress(jsonl(GOOD, "{broken", GOOD)), {2: "malformed_json"}, ext="jsonl.gz", records=3),
    # --- controls that must be packed, not rejected; the notes are what normalization did to them
    Case("text_parts_content", jsonl(turns(("user", [{"type": "text", "text": "Hi"}]), ("assistant", "Yo"))), {}),
    Case("content_one_string_object", jsonl(turns(("user", {"text": "hi"}), ("assistant", "ok"))), {}),
    # Written as text ("3.5", "7", "5", "4"), each counted once in the manifest's normalization notes.
    Case("numbers_as_text", jsonl(turns(("user", 3.5), ("assistant", 7)), {"instruction": 5, "output": "x"},
                                  {"prompt": "2+2?", "completion": 4}), {}, notes={"number_as_text": 4}),
    Case("bot_is_an_alias", jsonl(turns(("user", "a"), ("bot", "b"))), {}),
    # A first assistant turn answers nothing: dropped and counted (--leading-assistant keep/reject otherwise).
    Case("starts_with_assistant", jsonl(chat(("assistant", "hi"), ("user", "x"), ("assistant", "y"))), {},
         notes={"leading_assistant_dropped": 1}),
    Case("chat_starts_with_gpt", jsonl(chat(("gpt", "hi"), ("human", "yo"), ("gpt", "x"))), {},
         notes={"leading_assistant_dropped": 1}),
    # Consecutive turns of one role are joined with a blank line (--same-role reject refuses them).
    Case("consecutive_user", jsonl(chat(("user", "a"), ("user", "b"), ("assistant", "c"))), {}, notes={"turns_merged": 1}),
    Case("consecutive_assistant", jsonl(chat(("user", "a"), ("assistant", "b"), ("assistant", "c"))), {},
         notes={"turns_merged": 1}),
    # A later system turn is kept where it is, as context: nothing dropped, nothing to note.
    Case("misplaced_system", jsonl(turns(("user", "a"), ("assistant", "b"), ("system", "c"), ("user", "d"), ("assistant", "e"))),
         {}),
    Case("empty_user_turn", jsonl(chat(("user", "a"), ("user", " \n"), ("assistant", "b"))), {},
         notes={"empty_turns_dropped": 1}),
    # Every example ends on a trained turn: a last user turn would be context for nothing.
    Case("ends_with_user", jsonl(chat(("user", "a"), ("assistant", "b"), ("user", "c"))), {},
         notes={"trailing_turns_trimmed": 1}),
    # The turns hold their own system turn, so the `system` column is not used: counted as ignored.
    # both system texts are kept (the column's first): a field the format defines is never dropped
    Case("sharegpt_system_twice", jsonl(sharegpt(("system", "s"), ("human", "a"), ("gpt", "b"), system="t")), {}),
    Case("path_like_id", jsonl({"id": "../../escape/x", **GOOD}, {"id": "/etc/passwd", **GOOD}), {}),
    Case("crlf_lines", jsonl(GOOD).replace(b"\n", b"\r\n") * 2, {}),
    # --- CSV: positions are row numbers (the header is row 1); a bad row costs that row alone
    Case("csv_rows", b'instruction,output\nHi,Hello\nbroken row\n"Q, with comma","multi\nline"\n\xff,x\n', {
        3: ("malformed_row", "it holds 1 cells, the header 2"), 5: ("invalid_utf8", "column 'instruction'")},
        ext="csv", records=4),
    # An empty cell is a missing field; an empty answer cell is its own reason, never a fix that trains the prompt
    # (issue 42: it was unknown_format, "read it with --field instruction=text")
    Case("csv_empty_answer", b'instruction,output\n"What is 2+2?",""\nHi,Hello\n,Lonely answer\n', {
        2: ("empty_answer", "the row's output cell is empty: no answer to train on; fill in the answer"),
        4: ("missing_field", "the row's instruction cell is empty: the prompt is missing; fill it in")}, ext="csv", records=3),
]


def _reason(e: Expect) -> str:
    return e if isinstance(e, str) else e[0]


def _source_and_position(example_id: str) -> tuple[str, str]:
    """``good.jsonl@3`` -> (``good.jsonl``, ``3``); ``src:abc`` (an own id) -> (``src``, ``abc``).

    Sources are escaped in ids (``:`` and ``@`` as ``%3A``, ``%40``), so the first of them ends the source."""
    source, _, rest = re.split(r"([:@])", example_id, maxsplit=1)
    return source, rest


def test_corpus_is_big_and_covers_every_reason():
    bad = [c for c in CASES if c.expect]
    assert len(bad) >= 30 and len({c.name for c in CASES}) == len(CASES)
    covered = {_reason(e) for c in CASES for e in c.expect.values()}
    covered |= {"corrupt_input", "template_error"}  # test_input_that_breaks_off_..., test_malicious_chat_template_...
    elsewhere = {
        # refused only under non-default options (--leading-assistant reject, --same-role reject);
        # tests/test_formats.py. By default they are packed: the controls starts_with_assistant, consecutive_*.
        "starts_with_assistant", "consecutive_same_role",
        "template_limit",  # a template over its time or output bound: tests/test_render.py
        "ambiguous_field",  # two keys of one slot holding different text: tests/test_formats_loss.py
        "not_a_pair", "pair_prompt_mismatch",  # only under --pairs: tests/test_pack_pairs.py
        "no_preference",  # only under --pair-winner: tests/test_preference.py, tests/test_pack_pairs.py
        "mapped_field_cut",  # only under --field: tests/test_formats.py
        "blank_text",  # plain text only, which a folder of other data does not read: tests/test_tabular_text.py
        "placeholder_mismatch", "bad_image", "remote_image",  # only under --processor: tests/test_vision_pipeline.py
        "outside_media_root",  # only under --processor: tests/test_media_root.py
        "bad_video",  # only under --video-fps: tests/test_vision_video_tools.py
    }
    assert {r.value for r in Reason} - covered == elsewhere


def pack(*args: str) -> Any:
    result = CliRunner().invoke(main, ["pack", *args, "-q"])
    assert isinstance(result.exception, (SystemExit, type(None))), result.exception  # never a traceback
    assert "Traceback" not in result.output
    return result


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    data = root / "in"
    data.mkdir()
    for c in CASES:
        (data / c.source).write_bytes(c.data)
    (data / "good.jsonl").write_bytes(jsonl(*[turns(("user", f"Q{i}"), ("assistant", f"A{i}")) for i in range(20)]))
    out = root / "out"
    result = pack(str(data), "-o", str(out), "--max-tokens", str(BUDGET), "--max-record-bytes", str(MAX_RECORD_BYTES),
                  "--max-reject-fraction", "0.95")
    assert result.exit_code == 0, result.output
    return data, out


def test_every_case_gets_its_reason(corpus_run):
    _, out = corpus_run
    dead: dict[str, dict[int, dict]] = {}
    for line in (out / "rejected.jsonl").read_text().splitlines():
        rec = json.loads(line)
        assert rec["detail"] and rec["reason"] in {r.value for r in Reason}
        assert (rec["position"]) not in dead.setdefault(rec["source"], {}), "dead-lettered twice"
        dead[rec["source"]][rec["position"]] = rec
    failures = []
    for c in CASES:
        got = dead.pop(c.source, {})
        if set(got) != set(c.expect):
            failures.append(f"{c.name}: dead-lettered positions {sorted(got)}, expected {sorted(c.expect)}")
            continue
        for pos, e in c.expect.items():
            reason, words = (e, "") if isinstance(e, str) else e
            if got[pos]["reason"] != reason or words not in got[pos]["detail"]:
                failures.append(f"{c.name}:{pos}: got {got[pos]['reason']}: {got[pos]['detail']!r}, expected {e}")
    assert not failures, "\n".join(failures)
    assert not dead, f"unexpected dead letters: {dead}"  # good.jsonl is fully packed


def test_every_record_is_packed_or_dead_lettered(corpus_run):
    """Per source: packed + dead-lettered = records in the file; then the manifest, then verify."""
    data, out = corpus_run
    rows = read_rows(out)
    packed = Counter(_source_and_position(eid)[0] for r in rows for eid in r["example_ids"])
    dead = Counter(json.loads(line)["source"] for line in (out / "rejected.jsonl").read_text().splitlines())
    for c in CASES:
        assert packed[c.source] + dead[c.source] == c.num_records(), c.name
        assert dead[c.source] == len(c.expect), c.name
    assert packed["good.jsonl"] == 20
    m = json.loads((out / "manifest.json").read_text())
    counts = m["counts"]
    total = sum(c.num_records() for c in CASES) + 20
    assert counts["records_read"] == total == counts["examples_packed"] + counts["rejected"] + counts["dropped_too_long"]
    want = Counter(_reason(e) for c in CASES for e in c.expect.values())
    assert counts["dropped_too_long"] == want.pop("too_long")
    assert counts["rejected_by_reason"] == dict(sorted(want.items()))
    notes = sum((Counter(c.notes) for c in CASES), Counter())  # good.jsonl adds none
    assert counts["normalization"] == dict(sorted(notes.items()))
    # The same, re-derived from the inputs by `packstream verify --inputs`.
    result = CliRunner().invoke(main, ["verify", str(out), "--inputs", str(data)])
    assert result.exit_code == 0, result.output
    assert f"{total:,} input records reconciled" in result.output


def test_path_like_ids_stay_inside_the_data(corpus_run):
    """A record id like ``../../escape/x`` is only ever a string in a row, never a path."""
    data, out = corpus_run
    ids = {eid for r in read_rows(out) for eid in r["example_ids"]}
    assert {"path_like_id.jsonl:../../escape/x", "path_like_id.jsonl:/etc/passwd"} <= ids
    names = sorted(os.listdir(out))
    assert names == ["README.md", "manifest.json", "rejected.jsonl", "train-00000-of-00001.arrow"]
    assert not (data.parent / "escape").exists() and not (out.parent / "escape").exists()


@pytest.mark.parametrize("policy", ["truncate", "split"])
def test_too_long_under_truncate_and_split(tmp_path, policy):
    """drop is in the corpus (too_long); truncate and split pack the example and count it."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(LONG, GOOD))
    out = tmp_path / "out"
    result = pack(str(src), "-o", str(out), "--max-tokens", "128", "--long", policy)
    assert result.exit_code == 0, result.output
    c = json.loads((out / "manifest.json").read_text())["counts"]
    assert (out / "rejected.jsonl").read_text() == ""
    assert c["records_read"] == c["examples_packed"] == 2 and c["dropped_too_long"] == 0
    ids = sorted(eid for r in read_rows(out) for eid in r["example_ids"])
    if policy == "truncate":
        assert c["truncated_examples"] == 1 and c["truncated_tokens"] > 0 and ids == ["in.jsonl@1", "in.jsonl@2"]
    else:
        assert c["split_examples"] == 1 and ids[0] == "in.jsonl@1#0" and len(ids) == c["pieces"] > 3
    # Stored tokens are the re-tokenized prefix (truncate) or consecutive pieces (split).
    result = CliRunner().invoke(main, ["verify", str(out), "--inputs", str(src)])
    assert result.exit_code == 0, result.output


def test_max_reject_fraction_fails_the_job(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(GOOD, "{bad", turns(("user", "x")), {"foo": 1}))
    result = pack(str(src), "-o", str(tmp_path / "out"), "--max-reject-fraction", "0.5")
    assert result.exit_code == 3
    # the error names the share, each reason's count, the limit, and where the dead letters are
    assert ("error: 75.0% of 4 records were rejected or dropped (malformed_json 1, no_assistant_turn 1, "
            "unknown_format 1), more than --max-reject-fraction 50.0%; see " + str(tmp_path / "out" / "rejected.jsonl")
            in result.output)


# ------------------------------------------------------------------------------------------------
# Whole-input problems found at launch: exit 2, one "error:" line, no traceback.


WHOLE_INPUT = {
    # name: (files to create {relative path: bytes}, the input argument, words of the error)
    "text_in_jsonl": ({"a.jsonl": b"just some text\n"}, "a.jsonl", "does not start with a JSON object"),
    "png_in_jsonl": ({"a.jsonl": b"\x89PNG\r\n\x1a\n\x00\x00"}, "a.jsonl", "is a PNG image"),
    "json_array_in_jsonl": ({"a.jsonl": b'[\n  {"text": "a"}\n]\n'}, "a.jsonl", "rename it to .json"),
    "json_in_parquet": ({"a.parquet": b'{"text": "a"}\n'}, "a.parquet", "not a Parquet file"),
    "text_in_arrow": ({"a.arrow": b"hello"}, "a.arrow", "not an Arrow IPC file"),
    "plain_in_gz": ({"a.jsonl.gz": b'{"text": "a"}\n'}, "a.jsonl.gz", "not gzip data"),
    "empty_file": ({"a.jsonl": b""}, "a.jsonl", "is empty"),
    "whitespace_file": ({"a.jsonl": b" \n\n\t"}, "a.jsonl", "only whitespace"),
    "empty_json_array": ({"a.json": b"[]"}, "a.json", "hold no records"),
    "broken_json_array": ({"a.json": b'[{"text": "a"}, {"text": '}, "a.json", "is not valid JSON"),
    # Under 4 KiB: the launch check gunzips all of it and finds the break before any worker starts (a
    # bigger one passes that check and is found by its worker: BREAKS_OFF below).
    "truncated_gzip_small": ({"a.jsonl.gz": gzip.compress(b'{"text": "a"}\n' * 50)[:-12]}, "a.jsonl.gz", "truncated gzip"),
    "broken_datasets_folder": ({"ds/state.json": b"{}", "ds/x.arrow": b"x"}, "ds", "cannot open datasets folder"),
    "missing_path": ({}, "nope.jsonl", "matches no file"),
    # A folder that exists but holds nothing packstream reads: "supported: ..." names what would be read.
    "empty_folder": ({"d/.keep": b""}, "d", "holds no supported file"),
    "unsupported_files": ({"d/readme.md": b"hi"}, "d", "holds no supported file"),
    "glob_matching_nothing": ({"a.jsonl": jsonl(GOOD)}, "*.parquet", "matches no file"),
    # Compressions: the magic bytes checked, a small stream decompressed whole at launch; a name no reader
    # supports names the supported list and the fix, in a folder too (never skipped in silence).
    "plain_in_zst": ({"a.jsonl.zst": b'{"text": "a"}\n'}, "a.jsonl.zst", "ends in .zst but is not zstd data"),
    "plain_in_xz": ({"a.json.xz": b'[{"text": "a"}]'}, "a.json.xz", "ends in .xz but is not xz data"),
    "truncated_zst_small": ({"a.jsonl.zst": _zstd(b'{"text": "a"}\n' * 50)[:-6]}, "a.jsonl.zst", "corrupt or truncated zstd"),
    "truncated_bz2_small": ({"a.ndjson.bz2": bz2.compress(b'{"text": "a"}\n' * 50)[:-9]}, "a.ndjson.bz2", "corrupt or truncated bzip2"),
    "unsupported_compression": ({"a.jsonl.lz4": b"\x04\x22\x4d\x18"}, "a.jsonl.lz4", "lz4 -d"),
    # .csv, .tsv and .txt are inputs now (tests/test_tabular_text.py): an unreadable kind keeps one line, no rename
    # advice for those three
    "unsupported_name": ({"a.md": b'{"text": "a"}\n'}, "a.md", "supported: .jsonl, .ndjson, .json, .csv, .tsv, .txt, .parquet, .arrow (all but Parquet and Arrow also compressed: .gz, .zst, .xz, .bz2)"),
    "spreadsheet": ({"a.xlsx": b"PK\x03\x04"}, "a.xlsx", "packstream does not read .xlsx files: save it as CSV"),
    # CSV/TSV: the header row names every field, once each; a file of blanks is no input
    "csv_duplicate_column": ({"a.csv": b"text,text\na,b\n"}, "a.csv", "two columns are named 'text'; rename one"),
    "csv_unnamed_column": ({"a.tsv": b"instruction\t\toutput\na\tb\tc\n"}, "a.tsv", "column 2 of the header row has no name"),
    "csv_header_not_utf8": ({"a.csv": b"instruction,outp\xfft\na,b\n"}, "a.csv", "cannot read its header row"),
    "text_whitespace_only": ({"a.txt": b" \n\n\t\n"}, "a.txt", "holds only whitespace"),
    "unsupported_in_a_folder": ({"d/a.jsonl": jsonl(GOOD), "d/b.jsonl.lz4": b"\x04\x22\x4d\x18", "d/README.md": b"hi"}, "d",
                                "holds 1 file(s) no reader supports (b.jsonl.lz4)"),
}


@pytest.mark.parametrize("case", sorted(WHOLE_INPUT))
def test_whole_input_problem_is_a_clear_cli_error(tmp_path, monkeypatch, caplog, case):
    files, arg, words = WHOLE_INPUT[case]
    for rel, data in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.ERROR):
        result = pack(arg, "-o", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and words in errors[0], result.output
    # Beam logs a failing DoFn's traceback; for a user error the CLI hides it.
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def test_dangling_symlink_and_unreadable_file(tmp_path, monkeypatch):
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "gone.jsonl")
    result = pack(str(tmp_path / "link.jsonl"), "-o", str(tmp_path / "o1"))
    assert result.exit_code == 2 and f"error: cannot read input {tmp_path / 'link.jsonl'}: No such file" in result.output
    src = tmp_path / "locked.jsonl"
    src.write_bytes(jsonl(GOOD))
    if os.geteuid() != 0:  # root reads anything: simulate the permission error instead
        src.chmod(0)
    else:  # local files are opened by pipeline._read.open_raw (no Beam), which the launch check uses first
        from tests._internals import _inputs

        real_open = _inputs.open_raw

        def deny(path):
            if str(path).endswith("locked.jsonl"):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path)

        monkeypatch.setattr(_inputs, "open_raw", deny)
    result = pack(str(src), "-o", str(tmp_path / "o2"))
    assert result.exit_code == 2 and "error: cannot read input" in result.output and "Permission denied" in result.output


# ------------------------------------------------------------------------------------------------
# Inputs that break off mid-way are found by the worker reading them: errors as data. The records
# before the break are packed, and the rest of the file is one corrupt_input dead letter at the
# position after the last good record, counted as one record read.


def _truncated_big(compress=gzip.compress, n: int = 3000) -> bytes:
    """Cut in half: its first 4 KiB decompress cleanly, so it passes the launch check."""
    # Digests in the text: little to compress, so the stream is far past the launch check's 4 KiB.
    lines = b"".join(json.dumps({"text": f"record {i} " + hashlib.sha256(str(i).encode()).hexdigest() * (i % 5)}).encode()
                     + b"\n" for i in range(n))
    data = compress(lines)
    return data[: len(data) // 2]


def _gz_truncated_big() -> bytes:
    return _truncated_big()


def _arrow_truncated() -> bytes:
    """An Arrow stream of five batches cut in half: the first two read back."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, pa.schema([("text", pa.string())])) as w:
        for _ in range(5):
            w.write_batch(pa.record_batch([pa.array([f"t{i}" for i in range(1000)])], names=["text"]))
    data = sink.getvalue().to_pybytes()
    return data[: len(data) // 2]


def _parquet_bad_page() -> bytes:
    """Three row groups, the page header of the second overwritten: its footer is intact, row group 0 reads back."""
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(3000)]}), sink, row_group_size=1000)
    data = bytearray(sink.getvalue().to_pybytes())
    col = pq.ParquetFile(pa.BufferReader(bytes(data))).metadata.row_group(1).column(0)
    start = min(o for o in (col.dictionary_page_offset, col.data_page_offset) if o is not None)
    data[start:start + 16] = b"\xff" * 16
    return bytes(data)


def _parquet_truncated() -> bytes:
    """Cut in half: it starts like Parquet, but its footer (the schema and row groups) is gone."""
    data = parquet(pa.table({"text": [f"row {i}" for i in range(5000)]}))
    return data[: len(data) // 2]


BREAKS_OFF = [
    # file name, bytes, words of the dead letter's detail
    pytest.param("cut.jsonl.gz", _gz_truncated_big(), "cut.jsonl.gz is corrupt or truncated (EOFError after position",
                 id="truncated_gzip"),
    pytest.param("cut.jsonl.zst", _truncated_big(_zstd), "cut.jsonl.zst is corrupt or truncated (OSError after position",
                 id="truncated_zstd"),
    pytest.param("cut.jsonl.xz", _truncated_big(lzma.compress), "cut.jsonl.xz is corrupt or truncated (EOFError after position",
                 id="truncated_xz"),
    pytest.param("cut.jsonl.bz2", _truncated_big(bz2.compress, 12_000),  # bzip2 decodes whole 900 kB blocks
                 "cut.jsonl.bz2 is corrupt or truncated (EOFError after position", id="truncated_bz2"),
    pytest.param("cut.arrow", _arrow_truncated(), "cut.arrow is corrupt or truncated (OSError after position",
                 id="truncated_arrow"),
    pytest.param("bad.parquet", _parquet_bad_page(), "Deserializing page header failed", id="parquet_bad_page"),
    pytest.param("cut.parquet", _parquet_truncated(), "cut.parquet is corrupt or truncated", id="truncated_parquet"),
]


@pytest.mark.parametrize("name, data, words", BREAKS_OFF)
def test_input_that_breaks_off_is_a_corrupt_input_dead_letter(tmp_path, caplog, name, data, words):
    src = tmp_path / name
    src.write_bytes(data)
    out = tmp_path / "out"
    with caplog.at_level(logging.ERROR):  # --max-reject-fraction 1: a file with nothing readable still reconciles
        result = pack(str(src), "-o", str(out), "--max-reject-fraction", "1")
    # A Parquet file cut before its footer has not one readable record: the run packs nothing, so it
    # fails (exit 3, a failed manifest) with the file's dead letter as its reason.
    nothing = name == "cut.parquet"
    assert result.exit_code == (3 if nothing else 0), result.output
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    (dead,) = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert dead["source"] == name and dead["reason"] == "corrupt_input" and words in dead["detail"], dead
    if nothing:
        assert dead["position"] == 0 and json.loads((out / "manifest.json").read_text())["status"] == "failed"
        return
    # Packed: every record before the break, once (JSONL lines count from 1, rows of tables from 0).
    first = 1 if ".jsonl." in name else 0
    positions = sorted(int(_source_and_position(eid)[1]) for r in read_rows(out) for eid in r["example_ids"])
    assert positions == list(range(first, dead["position"]))
    c = json.loads((out / "manifest.json").read_text())["counts"]
    assert c["records_read"] == len(positions) + 1 == c["examples_packed"] + 1
    assert c["rejected_by_reason"] == {"corrupt_input": 1}
    # verify re-reads the input, finds the same break, and expects the same dead letter.
    result = CliRunner().invoke(main, ["verify", str(out), "--inputs", str(src)])
    assert result.exit_code == 0, result.output
    assert f"{c['records_read']:,} input records reconciled" in result.output


# ------------------------------------------------------------------------------------------------
# Safety


MALICIOUS_TEMPLATES = {
    "subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals": "{{ raise_exception.__globals__['os'].system('touch pwned') }}",
    "func_globals": "{% for m in messages %}{{ m.__init__.__globals__ }}{% endfor %}",
    "include_file": "{% include '/etc/passwd' %}",
    "import": "{% import 'os' as os %}{{ os }}",
}


@pytest.mark.parametrize("name", sorted(MALICIOUS_TEMPLATES))
def test_malicious_chat_template_is_a_template_error(tmp_path, monkeypatch, name):
    """Templates render only in transformers' sandboxed Jinja: no attribute escapes, no files."""
    from tests._internals import Renderer

    monkeypatch.chdir(tmp_path)
    r = Renderer(PackOptions(inputs=("x",), output="y", chat_template=MALICIOUS_TEMPLATES[name]))
    conv = Conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    with pytest.raises(Rejected) as e:
        r.segments(conv, FormatOptions())
    assert e.value.reason is Reason.TEMPLATE_ERROR, e.value
    assert not (tmp_path / "pwned").exists()


def test_malicious_template_through_the_cli(tmp_path):
    """Every record dead-lettered as template_error: the run fails the reject guard, nothing leaks."""
    tpl = tmp_path / "evil.jinja"
    tpl.write_text(MALICIOUS_TEMPLATES["subclasses"])
    src = tmp_path / "in.jsonl"
    src.write_bytes(jsonl(GOOD, GOOD))
    out = tmp_path / "out"
    result = pack(str(src), "-o", str(out), "--chat-template", str(tpl), "--max-reject-fraction", "0.5")
    assert result.exit_code == 3, result.output
    dead = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [d["reason"] for d in dead] == ["template_error", "template_error"]
    assert "SecurityError" in dead[0]["detail"] or "unsafe" in dead[0]["detail"].lower()


def test_trust_remote_code_is_off_by_default_and_passed_through(monkeypatch):
    from transformers import AutoTokenizer

    from packers import PackstreamError
    from pipeline import DEFAULT_TOKENIZER
    from tests._internals import _job, _tokenizer, load_tokenizer

    assert PackOptions(inputs=("x",), output="y").trust_remote_code is False
    seen = []

    def spy(path, **kw):  # records the flag; loading nothing keeps the test offline
        seen.append((path, kw.get("trust_remote_code")))
        raise OSError("not loaded in this test")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    monkeypatch.setattr(_tokenizer, "_in_hub_cache", lambda name: True)  # as if cached: no Hub check before the spy
    # A tokenizer that may bring a class of its own (a Hub name, or a folder whose config names one)
    # loads through AutoTokenizer with the flag as given.
    for flag in (False, True):
        with pytest.raises(PackstreamError, match="cannot load tokenizer 'org/own-code'"):
            load_tokenizer.__wrapped__("org/own-code", flag)
    assert seen == [("org/own-code", False), ("org/own-code", True)]
    # The default is a plain tokenizer.json: it never reaches AutoTokenizer, so no code of its own can run.
    assert load_tokenizer.__wrapped__(DEFAULT_TOKENIZER, True).is_fast and len(seen) == 2
    # The CLI maps --trust-remote-code to the option, and leaves it off otherwise.
    captured = []
    monkeypatch.setattr(_job, "launch", lambda options, *a, **kw: captured.append(options) or _job.TemplateLaunched("-", {}))
    for extra in ([], ["--trust-remote-code"]):
        CliRunner().invoke(main, ["pack", "-o", "unused", "-q", *extra])
    assert [o.trust_remote_code for o in captured] == [False, True]
