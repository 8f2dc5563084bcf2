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


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_every_generated_layout_packs_each_image_and_video_it_names(tmp_path, seed):
    """Generated records in every layout the readers take, images and videos mixed: parts, columns with their
    placeholders, columns with none (placed first), LLaVA-Video's ``<image>`` for a video. Each record packs, and its
    example holds exactly as many image runs and video runs as it names media: none lost, none made up (a video once
    went missing this way: a column with no placeholder got a literal ``<image>``)."""
    pytest.importorskip("av")
    import numpy as np
    import pyarrow as pa

    from tests.test_vision_pipeline import save_tokenizer
    from tests.test_vision_video import clip

    rng = np.random.default_rng(seed)
    tok = save_tokenizer(tmp_path / "tok", ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"])
    PIL.new("RGB", (56, 40), "red").save(tmp_path / "i.png")
    clip(tmp_path / "v.mp4", 8, 4.0, 56, 56)
    records, want = [], {}
    for r in range(40):
        n_img, n_vid = int(rng.integers(0, 3)), int(rng.integers(0, 2))
        layout = str(rng.choice(["parts", "tags", "untagged", "llava_video"]))
        if layout == "llava_video" and (n_img or not n_vid):
            layout = "tags"
        text = "what is shown"
        if layout == "parts":
            content = ([{"type": "image_url", "image_url": {"url": "i.png"}}] * n_img
                       + [{"type": "video", "video": "v.mp4"}] * n_vid + [{"type": "text", "text": text}])
            rec = {"messages": [{"role": "user", "content": content}]}
        elif layout == "llava_video":
            rec = {"video": "v.mp4", "conversations": [{"from": "human", "value": "<image>\n" + text}]}
        else:
            tags = ("<image>" * n_img + "<video>" * n_vid) if layout == "tags" else ""
            rec = {"messages": [{"role": "user", "content": tags + text}],
                   **({"images": ["i.png"] * n_img} if n_img else {}), **({"videos": ["v.mp4"] * n_vid} if n_vid else {})}
        turns = rec.get("messages", rec.get("conversations"))
        turns.append({"role": "assistant", "content": "an answer"} if "messages" in rec
                     else {"from": "gpt", "value": "an answer"})
        records.append({"id": f"r{r}", **rec})
        want[f"r{r}"] = (n_img, n_vid)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in records))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(path), "--processor", "qwen2-vl", "--video-fps", "2",
                                       "--video-min-pixels", "784", "--video-max-pixels", "12544", "--tokenizer", tok,
                                       "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert not (out / "rejected.jsonl").exists() or not (out / "rejected.jsonl").read_text().strip()
    got = {}
    for shard in sorted(out.glob("train-*.arrow")):
        with pa.memory_map(str(shard)) as f:
            for row in pa.ipc.open_stream(f).read_all().to_pylist():
                offs = row["seq_offsets"]
                for j, eid in enumerate(row["example_ids"]):
                    inside = [sum(offs[j] <= o < offs[j + 1] for o in row[k]) for k in ("image_offsets", "video_offsets")]
                    got[eid.rsplit(":", 1)[-1]] = tuple(inside)
    assert got == want
