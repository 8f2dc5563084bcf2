"""``packstream preview`` on every shape: the shape and mapping, the rendered text with targets, counts, refusals.

Preview runs the same Encoder as ``pack``, so for each fixture record the tokens it reports are
the tokens that would be packed, and the text between ``[[`` and ``]]`` is exactly what is
trained. It must not import Beam (local inputs), and it must be quick.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline import PackOptions
from pipeline.cli import main
from tests._internals import FormatOptions, detect, format_preview, inputs, preview
from tests.conftest import GSM8K_FIELDS, shared_data
from tests.test_formats import CLEANED, SHAPES, SHAPES_DIR, chatml, load

ROOT = Path(__file__).resolve().parents[1]


def options(path: Path, opts: dict) -> PackOptions:
    """The fixtures' expectations hold packstream's hygiene and EOS (tests/test_formats.py: CLEANED)."""
    return PackOptions(inputs=(str(path),), **{**CLEANED, **opts})


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_preview_every_shape(shape):
    name, opts, expected = SHAPES[shape]
    items = preview(options(SHAPES_DIR / name, opts), n=10)
    wants = [(p, w) for p, _ in load(name) for w in (expected[p] if isinstance(expected[p], list) else [expected[p]])]
    assert [it["position"] for it in items] == [p for p, _ in wants]  # a message tree: one item per kept path
    for it, (_, want) in zip(items, wants):
        assert it["source"] == name and it["dataset"] == "default"
        if want[0] == "rejected":
            assert it["reason"] == want[1] and want[2] in it["detail"]
            continue
        assert it["format"] == detect(dict(load(name))[it["position"]], FormatOptions(**opts))
        assert it["mapping"], it  # how the record's fields became turns, in words
        assert it["tokens"] == sum(len(t) for t, _ in it["spans"]) or it["tokens"] > 0
        assert it["targets"] > 0 and any(y for _, y in it["spans"])
        if want[0] not in ("text", "segments", "tokens"):
            turns, tools, notes = want
            text, target = chatml(turns, tools, "<｜end▁of▁sentence｜>")
            assert "".join(t for t, _ in it["spans"]) == text
            assert "".join(t for t, y in it["spans"] if y) == target
            assert it["notes"] == notes
    out = format_preview(items, color=False)
    assert out.startswith(f"== {name}\n") and out.endswith("[[...]]: training targets (loss mask 1)\n")
    for it in items:
        if "reason" in it:
            assert f"REFUSED {it['reason']}\n   {it['detail']}" in out
        else:
            assert f"{it['tokens']} tokens, {it['targets']} trained" in out
            assert "".join(f"[[{t}]]" if y else t for t, y in it["spans"]) in out


def test_preview_text_brackets_and_colour():
    items = preview(options(SHAPES_DIR / "messages.jsonl", {}), n=2)
    plain = format_preview(items, color=False)
    assert "<|im_start|>assistant\n[[Run `ss -ltnp 'sport = :8080'` (or `lsof -i :8080`).<|im_end|><｜end▁of▁sentence｜>]]" in plain
    trl = format_preview(preview(PackOptions(inputs=(str(SHAPES_DIR / "messages.jsonl"),)), n=2), color=False)
    assert "<|im_start|>assistant\n[[Run `ss -ltnp 'sport = :8080'` (or `lsof -i :8080`).<|im_end|>\n]]" in trl
    assert "[[<think>\n221 = 13 × 17, since 13 × 17 = 221.\n</think>\n\nNo: 221 = 13 × 17.<|im_end|>" in plain
    coloured = format_preview(items, color=True)
    assert "\x1b[32m" in coloured and "[[" not in coloured
    masked = format_preview(preview(options(SHAPES_DIR / "messages.jsonl", {"mask_reasoning": True}), n=2), color=False)
    assert "<|im_start|>assistant\n<think>\n221 = 13 × 17, since 13 × 17 = 221.\n</think>\n\n[[No: 221 = 13 × 17." in masked


def test_preview_cli_every_shape_and_options(tmp_path):
    """The command, with each shape's documented options, exits 0; refusals are shown, not raised."""
    flags = {k: "--field" if k == "fields" else "--" + k.replace("_", "-") for _, opts, _ in SHAPES.values() for k in opts}
    for shape, (name, opts, _) in SHAPES.items():
        args = ["preview", str(SHAPES_DIR / name), "-n", "2", "--no-color"]
        for k, v in opts.items():
            for item in v.split(",") if k == "fields" else [v]:
                args += [flags[k], item]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, (shape, result.output)
        assert f"== {name}" in result.output and "Traceback" not in result.output


def test_preview_bad_options_are_one_error_line():
    result = CliRunner().invoke(main, ["preview", str(SHAPES_DIR / "nested.jsonl"), "--field", "a..b=user"])
    assert result.exit_code == 2 and "error: --field: 'a..b' is not a field path" in result.output
    result = CliRunner().invoke(main, ["preview", str(SHAPES_DIR / "nope.jsonl")])
    assert result.exit_code == 2 and "matches no file" in result.output


def test_preview_imports_no_beam_and_is_quick():
    code = ("import sys, time; t = time.time(); from click.testing import CliRunner; from pipeline.cli import main; "
            f"r = CliRunner().invoke(main, ['preview', {str(SHAPES_DIR)!r}, '-n', '1']); "
            "assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'apache_beam')); print(time.time() - t)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    beam, seconds = out.stdout.splitlines()
    assert beam == "[]"
    assert float(seconds) < 60  # a few seconds here: tokenizer load, then one record per file


def test_preview_names_sources_like_the_job(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    (tmp_path / "b.json").write_text(json.dumps([{"instruction": "a", "output": "b"}]))
    (tmp_path / ".hidden.jsonl").write_text("{}\n")
    files = inputs(PackOptions(inputs=(str(tmp_path),)))
    assert [(f.source, f.kind) for f in files] == [("a/x.jsonl", "jsonl"), ("b.json", "json")]
    items = preview(PackOptions(inputs=(str(tmp_path),)), n=5)
    assert [(i["source"], i["position"], i["format"]) for i in items] == [("a/x.jsonl", 1, "text"), ("b.json", 0, "alpaca")]


def test_preview_reads_parquet_and_datasets_folders(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]), "test": datasets.Dataset.from_list(rows[2:])}) \
        .save_to_disk(str(tmp_path / "ds"))
    items = preview(PackOptions(inputs=(str(tmp_path),)), n=2)
    assert [(i["source"], i["position"], i.get("reason")) for i in items] == [
        ("chat.parquet", 0, None), ("chat.parquet", 1, None), ("ds[test]", 0, None), ("ds[train]", 0, None),
        ("ds[train]", 1, None)]


def test_shared_data_previews():
    """Every file of ../shared/data: recognised, and packed or refused with a reason (never a crash)."""
    data = shared_data()
    items = preview(PackOptions(inputs=(str(data),), fields=GSM8K_FIELDS), n=2)
    refused = {(i["source"], i["reason"]) for i in items if "reason" in i}
    assert refused == {("llamafactory/mllm_demo.json", "non_text_content")}
    assert {i["source"] for i in items} >= {"gsm8k/train.jsonl", "glaive_toolcall/glaive_toolcall_en_demo.json",
                                            "llamafactory/reason_tool_use_demo_50.jsonl", "llamafactory/v1_sft_demo.jsonl"}
    # Without the mapping, gsm8k is refused with the options that read it.
    (item,) = [i for i in preview(PackOptions(inputs=(str(data / "gsm8k" / "train.jsonl"),)), n=1)]
    assert item["reason"] == "unknown_format"
    assert item["detail"].endswith("read it with --field question=user --field answer=assistant")


def test_preview_shows_a_prompts_assistant_turn_as_context_and_the_rule(tmp_path):
    """TRL's prompt-completion (issue 51): the prompt's earlier assistant turn is context, only the completion is
    between [[ ]]; a string record says it is raw text (--strings raw), and --strings chat wraps it."""
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "Name a color."},
                                           {"role": "assistant", "content": "Blue is a color."},
                                           {"role": "user", "content": "Another one?"}],
                                "completion": [{"role": "assistant", "content": "Red."}]}) + "\n"
                    + json.dumps({"prompt": "The sky is", "completion": " blue."}) + "\n")
    out = format_preview(preview(PackOptions(inputs=(str(path),)), n=2), color=False)
    assert ("<|im_start|>assistant\nBlue is a color.<|im_end|>\n<|im_start|>user\nAnother one?<|im_end|>\n"
            "<|im_start|>assistant\n[[Red.<|im_end|>\n]]") in out
    assert "The sky is[[ blue.<｜end▁of▁sentence｜>]]" in out and "raw text, as TRL (--strings raw)" in out
    chat = format_preview(preview(PackOptions(inputs=(str(path),), strings="chat"), n=2), color=False)
    assert "<|im_start|>user\nThe sky is<|im_end|>\n<|im_start|>assistant\n[[ blue.<|im_end|>\n]]" in chat
