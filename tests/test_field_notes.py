"""A mapped field whose text is structured data says so (issue 35): tool calls stored as JSON text under a field
mapped to a text role are trained as raw JSON; the summary names the field and the mapping that renders them."""

from __future__ import annotations

import json

from click.testing import CliRunner

from pipeline.cli import main
from tests._internals import looks_like_tool_calls

CALLS = json.dumps([{"name": "get_weather", "arguments": {"city": "Oslo"}}])
RECORDS = [{"query": f"Weather in Oslo, day {i}?", "calls": CALLS,
            "tools": json.dumps([{"name": "get_weather", "parameters": {"type": "object", "properties": {}}}])}
           for i in range(12)]


def _pack(tmp_path, *fields):
    src = tmp_path / "calls.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    out = tmp_path / f"out{len(list(tmp_path.iterdir()))}"
    args = ["pack", str(src), "-o", str(out), "--workers", "1", "--no-progress"]
    for f in fields:
        args += ["--field", f]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    return r.output, json.loads((out / "manifest.json").read_text())


def test_tool_calls_kept_as_text_under_a_text_role_are_named_with_the_mapping_that_renders_them(tmp_path):
    output, manifest = _pack(tmp_path, "query=user", "calls=assistant")
    assert manifest["counts"]["normalization"]["tool_calls_as_text:calls"] == 12
    [line] = [line for line in output.splitlines() if line.startswith("tool calls as text")]
    assert "calls holds JSON tool calls in 12 records, trained as raw text; --field calls=tool_calls" in line
    # The mapping it names renders them as calls, and says nothing more.
    output, manifest = _pack(tmp_path, "query=user", "calls=tool_calls")
    assert not [k for k in manifest["counts"]["normalization"] if k.startswith("tool_calls_as_text:")]
    assert "tool calls as text" not in output


def test_what_counts_as_tool_calls():
    assert looks_like_tool_calls(CALLS) and looks_like_tool_calls(' {"function": {"name": "f", "arguments": "{}"}} ')
    for text in ("plain words", "[1, 2]", "[]", '[{"name": "f"}]', "{broken", '{"name": 3, "arguments": {}}'):
        assert not looks_like_tool_calls(text), text


TRANSCRIPTS = [{"text": f"Human: What is {i} + {i}?\n\nAssistant: It is {2 * i}."} for i in range(5)] + [
    {"text": "A plain document about sourdough, with no speakers in it."},
    {"text": "Assistant: a line that starts like a turn, and no human side."}]


def test_plain_text_holding_a_transcript_is_named_with_the_mapping_that_trains_the_answers(tmp_path):
    """A ``text`` record of "Human: ... Assistant: ..." turns trains every turn as plain text; preview suggests
    --field text=transcript, and pack's summary counts the records that hold such turns."""
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in TRANSCRIPTS))
    r = CliRunner().invoke(main, ["preview", str(src), "--no-color", "-n", "7"])
    assert r.exit_code == 0, r.output
    assert r.output.count("suggest: --field text=transcript") == 5
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["pack", str(src), "-o", str(out), "--workers", "1", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["counts"]["normalization"]["transcript_as_text:text"] == 5
    [line] = [line for line in r.output.splitlines() if line.startswith("transcript as text")]
    assert "text holds 'Human:'/'Assistant:' turns in 5 records" in line and "--field text=transcript" in line
    # The mapping it names trains the answers only, and says nothing more.
    r = CliRunner().invoke(main, ["preview", str(src), "--no-color", "-n", "1", "--field", "text=transcript"])
    assert "suggest:" not in r.output and "[[It is 0.<|im_end|>" in r.output
