"""Image+text layouts beyond the ones with placeholders (issue 45): records that leave the image's place unsaid
(LLaVA-style and LLaMA-Factory records without ``<image>``, RLAIF-V's ``image``/``question``/``chosen``/``rejected``,
the_cauldron's and Docmatix's ``images`` + ``texts: [{user, assistant}]``) get their images before the first user
turn's text, as TRL's ``prepare_multimodal_messages`` places them, and the summary counts each one so placed.
A record that says some places but not all is still refused; so is one whose first turn is not a user's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests.test_vision_pipeline import tokenizer  # noqa: F401 - a fixture

PIL = pytest.importorskip("PIL.Image")
IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"


def _write(root: Path, records: list[dict]) -> Path:
    PIL.new("RGB", (64, 48), "red").save(root / "a.png")
    PIL.new("RGB", (48, 64), "blue").save(root / "b.png")
    path = root / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _pack(path: Path, tokenizer: str, *extra: str) -> tuple[dict, list[dict]]:  # noqa: F811
    out = path.parent / "out"
    result = CliRunner().invoke(main, ["pack", str(path), "--processor", "qwen2-vl", "--tokenizer", tokenizer,
                                       "-o", str(out), "--overwrite", *extra])
    assert result.exit_code == 0, result.output
    dead = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()] \
        if (out / "rejected.jsonl").exists() else []
    return {"manifest": json.loads((out / "manifest.json").read_text()), "output": result.output}, dead


def _preview(path: Path, tokenizer: str, *extra: str) -> str:  # noqa: F811
    result = CliRunner().invoke(main, ["preview", str(path), "--processor", "qwen2-vl", "--tokenizer", tokenizer,
                                       "--no-color", *extra])
    assert result.exit_code == 0, result.output
    return result.output


def test_images_with_no_place_said_go_before_the_first_user_turn(tmp_path, tokenizer):  # noqa: F811
    records = [
        {"id": "messages", "images": ["a.png", "b.png"], "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Compare them."},
            {"role": "assistant", "content": "Red, then blue."}]},
        {"id": "llava", "image": "a.png", "conversations": [{"from": "human", "value": "What colour?"},
                                                              {"from": "gpt", "value": "Red."}]},
        {"id": "cauldron", "images": ["b.png"], "texts": [
            {"user": "What colour?", "assistant": "Blue.", "source": "vqa"},
            {"user": "Sure?", "assistant": "Yes."}]},
    ]
    path = _write(tmp_path, records)
    run, dead = _pack(path, tokenizer)
    assert dead == [] and run["manifest"]["counts"]["examples_packed"] == 3
    assert "images placed first" in run["output"]
    shown = _preview(path, tokenizer)
    # each image's mark stands at the head of the first user turn, after the system turn, in the column's order
    assert "user\n<|vision_start|><image " in shown and "Compare them." in shown
    first = shown.split("-- line 1")[1].split("-- line 2")[0]
    assert first.index("a.png") < first.index("b.png") < first.index("Compare them.")
    assert first.index("Be brief.") < first.index("a.png")
    cauldron = shown.split("-- line 3")[1]
    assert cauldron.startswith(": chat ") and cauldron.count("<image ") == 1 and "[[Yes." in cauldron


def test_rlaif_v_pairs_pack_with_the_image_in_both_sides(tmp_path, tokenizer):  # noqa: F811
    path = _write(tmp_path, [{"id": "p", "image": "a.png", "question": "What colour?", "chosen": "Red.",
                              "rejected": "Blue."}])
    run, dead = _pack(path, tokenizer, "--pairs")
    assert dead == [] and run["manifest"]["counts"]["examples_packed"] == 1
    shown = _preview(path, tokenizer, "--pairs")
    assert shown.count("<image ") == 2  # one per side


@pytest.mark.parametrize("record, reason", [
    ({"images": ["a.png", "b.png"], "messages": [{"role": "user", "content": "<image> and?"},
                                                {"role": "assistant", "content": "x"}]}, "placeholder_mismatch"),
    ({"images": ["a.png"], "messages": [{"role": "assistant", "content": "Hello."},
                                        {"role": "assistant", "content": "x"}]}, None),
])
def test_places_partly_said_or_no_user_turn_are_refused(tmp_path, tokenizer, record, reason):  # noqa: F811
    good = {"images": ["a.png"], "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    run, dead = _pack(_write(tmp_path, [record, good]), tokenizer)
    assert run["manifest"]["counts"]["examples_packed"] == 1 and len(dead) == 1 and dead[0]["position"] == 1
    if reason is not None:
        assert dead[0]["reason"] == reason


def test_exchange_lists_under_other_keys_are_suggested_and_speaker_keys_are_not(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"dialogs": [{"user": "hi there", "assistant": "hello"}]}) + "\n"
                    + json.dumps({"dialogs": [{"human": "hi there", "bot": "hello"}, {"human": "2+2?", "bot": "4"}]})
                    + "\n")
    shown = CliRunner().invoke(main, ["preview", str(path), "--no-color"]).output
    assert "read it with --messages-field dialogs (each {user, assistant} is one exchange)" in shown
    assert "one key per speaker (human, bot)" in shown and "--roles hello" not in shown
    fixed = CliRunner().invoke(main, ["preview", str(path), "--no-color", "--messages-field", "dialogs", "-n", "1"])
    assert "dialogs[]: user -> user, assistant -> assistant" in fixed.output and "[[hello" in fixed.output


def test_a_video_with_no_place_said_or_marked_with_image_goes_where_its_dataset_means(tmp_path):
    """A ``videos`` column with no placeholder gets its video before the first user turn's text (never a literal
    ``<image>`` and a video dropped), and LLaVA-Video's ``video`` + ``<image>`` reads the tag as the video's place;
    each counted in the summary. An ``<image>`` tag beside a video and an image is still the image's."""
    pytest.importorskip("av")
    from tests.test_vision_pipeline import save_tokenizer
    from tests.test_vision_video import clip

    tok = save_tokenizer(tmp_path / "tok", ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"])
    clip(tmp_path / "a.mp4", 8, 4.0, 56, 56)
    PIL.new("RGB", (56, 56), "red").save(tmp_path / "i.png")
    records = [
        {"id": "column", "videos": ["a.mp4"], "messages": [{"role": "user", "content": "describe"},
                                                            {"role": "assistant", "content": "noise"}]},
        {"id": "llava_video", "video": "a.mp4", "conversations": [{"from": "human", "value": "<image>\ndescribe"},
                                                                  {"from": "gpt", "value": "noise"}]},
        {"id": "both", "video": "a.mp4", "image": "i.png", "conversations": [
            {"from": "human", "value": "<video> then <image>"}, {"from": "gpt", "value": "noise, red"}]},
    ]
    path = tmp_path / "v.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = ["--processor", "qwen2-vl", "--video-fps", "2", "--tokenizer", tok]
    out = CliRunner().invoke(main, ["pack", str(path), *args, "-o", str(tmp_path / "out")])
    assert out.exit_code == 0, out.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["counts"]["examples_packed"] == 3 and manifest["counts"]["rejected"] == 0
    assert "videos placed first" in out.output and "image tags as videos" in out.output
    shown = CliRunner().invoke(main, ["preview", str(path), *args, "--no-color"]).output
    for line in ("-- line 1", "-- line 2"):
        part = shown.split(line)[1].split("-- line")[0]
        assert part.count("<video ") == 1 and "<image" not in part and "user\n<|vision_start|><video " in part
    both = shown.split("-- line 3")[1]
    assert both.index("<video ") < both.index("<image ") and both.count("<video ") == both.count("<image ") == 1
