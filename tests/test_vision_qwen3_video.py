"""Qwen3-VL videos (issue 45, ``--processor qwen3-vl --video-fps``), held against transformers' own Qwen3-VL code.

* Sampling, resize, timestamps and token counts: :func:`packers._video.qwen3_frame_indices`,
  :meth:`VisionSpec.measure_video_text` equal ``Qwen3VLVideoProcessor.sample_frames`` and its module's
  ``smart_resize`` (imported with the torchvision stand-in of ``tests/test_vision_video.py``), and the text equals
  ``Qwen3VLProcessor.replace_video_token`` (``_calculate_timestamps``: ``<t seconds>`` + ``<|vision_start|>`` + the
  group's pads + ``<|vision_end|>`` per temporal group), on generated clips of several lengths and rates under random
  fps / max-frames / pixel limits.
* End to end: records with videos and images -> ``packstream pack --processor qwen3-vl --video-fps 2`` ->
  ``PackedDataset`` -> ``Collator`` -> a tiny random Qwen3VLForConditionalGeneration: every packed example's tokens
  equal the processor's own expansion of it (``get_text_with_replacements`` with its image and video replacements,
  tokenized as one text), and its logits and loss equal the example's alone, positions from the model's own
  ``get_rope_index`` (``mm_token_type_ids``, 2 on video tokens; ``video_grid_thw`` split per frame group).
  (Pixels are the loader's on both sides: transformers' video processor resizes with torchvision, which cannot run
  here.)
* Positions: generated rows of text, images and timestamped videos: the Collator's positions equal
  ``get_rope_index`` on each example alone; rows whose frame groups are not there are refused.
* A video too long for the budget is dead-lettered ``too_long``; a clip sampled to one frame is refused.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import packers
from pipeline.cli import main
from tests._internals import qwen3_frame_indices
from tests.test_vision_pipeline import save_tokenizer
from tests.test_vision_qwen3 import LIMITS, image_processor, tiny_qwen3_vl
from tests.test_vision_video import TOKENS, _hf_video_module, _records, clip

av = pytest.importorskip("av")
PIL = pytest.importorskip("PIL.Image")
TOL = 1e-5
VIDEO_LIMITS = ["--video-min-pixels", "2048", "--video-max-pixels", "16384"]


def _hf_module():
    """transformers' qwen3_vl video processing module (torchvision stood in for, as in tests/test_vision_video.py)."""
    return _hf_video_module("transformers.models.qwen3_vl.video_processing_qwen3_vl")


def _hf_indices(total: int, fps: float, want_fps: float, max_frames: int) -> list[int]:
    from transformers.video_utils import VideoMetadata

    vp = _hf_module().Qwen3VLVideoProcessor
    proc = vp.__new__(vp)  # sample_frames reads the class's defaults (fps, min_frames) and max_frames
    proc.max_frames = max_frames
    return proc.sample_frames(VideoMetadata(total_num_frames=total, fps=fps), fps=want_fps).tolist()


def _processor(spec, tok=None):
    """A real ``Qwen3VLProcessor`` (built with ``__new__``: its video processor needs torchvision) whose
    ``video_processor`` carries the merge and temporal sizes its ``replace_video_token`` reads."""
    from transformers import Qwen3VLProcessor

    p = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    p.image_processor, p.tokenizer, p.chat_template = image_processor(spec), tok, None
    p.video_processor = types.SimpleNamespace(merge_size=2, temporal_patch_size=2)
    p.image_token, p.video_token = "<|image_pad|>", "<|video_pad|>"
    p.vision_start_token, p.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    if tok is not None:
        p.image_token_id, p.video_token_id = (tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>"))
    return p


def _hf_video(path: str, spec) -> dict:
    """The processor's ``video_grid_thw`` and ``video_metadata`` of one file, by transformers' sampling and resize on
    the container's header (as ``read_video_pyav`` reads it)."""
    from transformers.video_utils import VideoMetadata

    with av.open(path) as c:
        s = c.streams.video[0]
        total, rate, w, h = int(s.frames), float(s.average_rate), s.width, s.height
    idx = _hf_indices(total, rate, spec.video_fps, spec.video_max_frames)
    rh, rw = _hf_module().smart_resize(len(idx), h, w, temporal_factor=2, factor=32,
                                       min_pixels=spec.video_min_pixels, max_pixels=spec.video_max_pixels)
    grid = [-(-len(idx) // 2), rh // 16, rw // 16]
    return {"grid": grid, "meta": VideoMetadata(total_num_frames=total, fps=rate, frames_indices=np.asarray(idx))}


def test_frame_indices_equal_qwen3_sample_frames():
    rng = np.random.default_rng(0)
    for _ in range(400):
        total = int(rng.integers(1, 600))
        fps = float(rng.choice([1, 5, 8, 12.5, 23.976, 24, 25, 29.97, 30, 60, float(rng.uniform(0.5, 90))]))
        want = float(rng.choice([0.5, 1, 2, 3, float(rng.uniform(0.1, 8))]))
        cap = int(rng.integers(2, 800))
        assert qwen3_frame_indices(total, fps, want_fps=want, min_frames=4, max_frames=cap) == \
            _hf_indices(total, fps, want, cap), (total, fps, want, cap)


def test_grids_timestamps_and_text_equal_the_processor_on_generated_clips(tmp_path):
    """Clips of several lengths, rates and sizes under random --video-fps / --video-max-frames / pixel limits: the
    grid, the token count and the timestamped text equal transformers' (sample_frames, smart_resize,
    replace_video_token)."""
    rng = np.random.default_rng(1)
    base = packers.VisionSpec.builtin("qwen3-vl")
    proc = _processor(base)
    checked = 0
    for k, (frames, fps, w, h) in enumerate([(4, 4, 32, 32), (9, 3, 48, 32), (24, 12, 64, 40), (31, 10, 40, 72),
                                              (50, 25, 56, 56), (7, 29.97, 30, 20), (3, 1, 16, 100), (61, 30, 24, 24)]):
        path = str(clip(tmp_path / f"c{k}.mp4", frames, fps, w, h, seed=k))
        for _ in range(5):
            want, cap = float(rng.choice([0.5, 1, 2, 4, 8])), int(rng.integers(2, 40))
            low = int(rng.integers(1, 8)) * 1024
            spec = base.with_video(want, cap, low, low + int(rng.integers(0, 60)) * 1024)
            grid, _, text = spec.measure_video_text(path, "clip")
            ref = _hf_video(path, spec)
            assert list(grid) == ref["grid"], (k, want, cap)
            assert spec.grid_tokens(grid) == grid[0] * grid[1] * grid[2] // 4
            expanded = proc.replace_video_token({"video_grid_thw": torch.tensor([ref["grid"]]),
                                                 "video_metadata": [ref["meta"]]}, 0)
            per = grid[1] * grid[2] // 4
            assert text.replace("<|video_pad|>", "<|video_pad|>" * per) == expanded
            assert text.count("seconds>") == grid[0]
            checked += 1
    assert checked == 40


def test_a_clip_sampled_to_one_frame_is_refused(tmp_path):
    spec = packers.VisionSpec.builtin("qwen3-vl").with_video(2)
    path = str(clip(tmp_path / "one.mp4", 1, 4, 32, 32))
    with pytest.raises(packers.PackstreamError, match="at least 2"):
        spec.measure_video_text(path, "clip")
    with pytest.raises(ValueError):  # transformers refuses it too
        _hf_module().smart_resize(1, 32, 32, temporal_factor=2, factor=32)


def _collapse(text: str, groups: list[int]) -> str:
    """A packed example's text with each video's ``groups[k]`` timestamped groups and each image's run cut back to
    what the chat template writes (``<|vision_start|><|video_pad|><|vision_end|>``, one ``<|image_pad|>``)."""
    one = r"<\d+\.\d seconds><\|vision_start\|>(?:<\|video_pad\|>)+<\|vision_end\|>"
    out, at = [], 0
    for t in groups:
        m = re.compile(f"(?:{one}){{{t}}}").search(text, at)
        assert m is not None, (text[at:], t)
        out.append(text[at:m.start()] + "<|vision_start|><|video_pad|><|vision_end|>")
        at = m.end()
    return re.sub(r"(?:<\|image_pad\|>)+", "<|image_pad|>", "".join(out) + text[at:])


def _reference(tokens: list[int], images: list, videos: list, spec, tok, proc) -> tuple[list[int], dict]:
    """The example rebuilt by transformers: its text (decoded) cut back to the template's placeholders, then
    ``Qwen3VLProcessor.get_text_with_replacements`` with the processor's image and video replacements (grids and
    metadata from transformers' own rules), tokenized as one text."""
    vids = [_hf_video(v["path"], spec) for v in videos]
    text = _collapse(tok.decode(tokens, skip_special_tokens=False), [v["grid"][0] for v in vids])
    pil = [PIL.open(im["path"]).convert("RGB") for im in images]
    im_out = proc.image_processor(images=pil, return_tensors="pt") if pil else None
    v_in = {"video_grid_thw": torch.tensor([v["grid"] for v in vids]).reshape(-1, 3),
            "video_metadata": [v["meta"] for v in vids]}
    full, _ = proc.get_text_with_replacements(
        [text], [proc.replace_image_token(im_out, k) for k in range(len(pil))],
        [proc.replace_video_token(v_in, k) for k in range(len(vids))])
    return tok(full[0], add_special_tokens=False)["input_ids"], {"im": im_out, "grid": v_in["video_grid_thw"]}


def _run(tmp_path: Path, seed: int, n: int):
    tok_dir = save_tokenizer(tmp_path / "tok", TOKENS)
    data = _records(tmp_path, n, seed=seed)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", tok_dir, "--processor", "qwen3-vl",
                                       "--image-min-pixels", str(LIMITS["min_pixels"]), "--image-max-pixels",
                                       str(LIMITS["max_pixels"]), "--video-fps", "2", *VIDEO_LIMITS,
                                       "--max-tokens", "700", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["examples_packed"] == n, (out / "rejected.jsonl").read_text()
    assert manifest["contract_version"] == packers.VIDEO_CONTRACT_VERSION
    return tok_dir, packers.PackedDataset(out)


@pytest.mark.parametrize("attn, seed", [("sdpa", 5), ("eager", 6)])
def test_packed_videos_equal_each_example_prepared_by_transformers(tmp_path, attn, seed):
    from transformers import AutoTokenizer

    tok_dir, ds = _run(tmp_path, seed, 9)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    start, pad, end, vpad = (tok.convert_tokens_to_ids(t) for t in TOKENS)
    assert ds.vision.family.value == "qwen3-vl" and ds.vision.video_fps == 2.0
    rows = ds.fetch(range(len(ds.rows)))
    assert sum(len(r["videos"]) for r in rows) >= 3 and sum(len(r["images"]) for r in rows) >= 1
    used = sorted({int(t) for r in rows for t in r["input_ids"]} | {start, pad, end} - {vpad})
    fold = np.zeros(max(used + [vpad]) + 1, np.int64)
    fold[used] = np.arange(len(used))
    fold[vpad] = len(used)  # tiny_qwen3_vl's video_token_id is its last id
    ids = {"image_token_id": int(fold[pad]), "vision_start_token_id": int(fold[start]),
           "vision_end_token_id": int(fold[end])}
    model = tiny_qwen3_vl(len(used) + 1, ids, attn).eval()
    proc = _processor(ds.vision, tok)
    collate = packers.Collator(vision=ds.vision)
    batch = collate([{**r, "input_ids": fold[r["input_ids"]]} for r in rows])
    assert "second_per_grid_ts" not in batch and batch["video_grid_thw"].shape[0] == sum(len(r["videos"]) for r in rows)
    with torch.no_grad():
        logits = model(**batch).logits
    per_example = packers.example_losses(logits, batch)
    cu = batch["cu_seq_lens_q"].tolist()
    examples = [(r, j) for r in rows for j in range(len(r["example_ids"]))]
    worst, groups = 0.0, 0
    for s, (row, j) in enumerate(examples):
        a, z = int(row["seq_offsets"][j]), int(row["seq_offsets"][j + 1])
        ims = [im for im, o in zip(row["images"], row["image_offsets"]) if a <= o < z]
        keep = [k for k, o in enumerate(row["video_offsets"]) if a <= o < z]
        vids = [row["videos"][k] for k in keep]
        tokens = row["input_ids"][a:z].tolist()
        want, ref = _reference(tokens, ims, vids, ds.vision, tok, proc)
        assert want == tokens, f"{row['example_ids'][j]}: the processor's expansion differs"
        x = torch.from_numpy(fold[np.asarray(tokens)])[None]
        kwargs = {"mm_token_type_ids": (x == ids["image_token_id"]).int() + 2 * (x == len(used)).int()}
        if ims:
            kwargs.update(pixel_values=ref["im"]["pixel_values"], image_grid_thw=ref["im"]["image_grid_thw"])
        if vids:
            alone = collate([{"input_ids": tokens, "loss_mask": row["loss_mask"][a:z], "seq_offsets": [0, z - a],
                              "video_offsets": np.asarray(row["video_offsets"])[keep] - a,
                              "video_grid_thw": np.asarray(row["video_grid_thw"]).reshape(-1, 3)[keep],
                              "videos": vids, "second_per_grid_ts": np.asarray(row["second_per_grid_ts"])[keep]}])
            assert alone["video_grid_thw"].tolist() == ref["grid"].tolist()
            kwargs.update(pixel_values_videos=alone["pixel_values_videos"], video_grid_thw=ref["grid"])
            groups += int(ref["grid"][:, 0].sum())
        if not ims and not vids:
            kwargs = {}
        with torch.no_grad():
            mine = model(input_ids=x, use_cache=False, **kwargs).logits[0]
        diff = (logits[0, cu[s]:cu[s + 1]] - mine).abs().max().item()
        worst = max(worst, diff)
        assert diff <= TOL, f"{row['example_ids'][j]}: logits differ by {diff:.2e}"
        target = torch.tensor(row["loss_mask"][a:z].tolist(), dtype=torch.bool)
        loss = torch.nn.functional.cross_entropy(mine[:-1], x[0, 1:], reduction="none")[target[1:]].mean()
        assert abs(float(per_example.loss[s]) - float(loss)) <= TOL
    assert groups >= 6
    print(f"qwen3-vl video {attn}: max logit diff {worst:.2e} over {len(examples)} examples, {groups} frame groups")


def test_preview_marks_each_frame_group_after_its_timestamp(tmp_path):
    tok_dir = save_tokenizer(tmp_path / "tok", TOKENS)
    clip(tmp_path / "v.mp4", 20, 4, 64, 64)
    (tmp_path / "r.jsonl").write_text(json.dumps({"id": "x", "messages": [
        {"role": "user", "content": [{"type": "video", "video": "v.mp4"}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "ok"}]}) + "\n")
    shown = CliRunner().invoke(main, ["preview", str(tmp_path / "r.jsonl"), "--tokenizer", tok_dir, "--processor",
                                      "qwen3-vl", "--video-fps", "2", *VIDEO_LIMITS, "--no-color"]).output
    groups = shown.count("<|vision_start|><video ")
    assert groups >= 2 and "frame group 2 of" in shown and f"frame group {groups} of {groups}>" in shown
    assert "<|video_pad|>" not in shown and shown.count("seconds><|vision_start|>") == groups


def test_default_pixel_limits_are_qwen3_video_processors():
    spec = packers.VisionSpec.builtin("qwen3-vl").with_video(2)
    vp = _hf_module().Qwen3VLVideoProcessor
    assert (spec.video_min_pixels, spec.video_max_pixels) == (vp.size["shortest_edge"], vp.size["longest_edge"])
    assert (spec.video_min_frames, spec.video_max_frames) == (vp.min_frames, vp.max_frames)
    assert packers.VisionSpec.from_json(spec.to_json()) == spec


def test_collator_positions_equal_get_rope_index_on_generated_rows(tmp_path):
    """Rows of random text, images and videos laid out as the packer writes them (each frame group after a run of
    timestamp tokens): the Collator's positions equal ``Qwen3VLModel.get_rope_index`` on each example alone, with
    ``video_grid_thw`` one (t, h, w) per video and ``mm_token_type_ids`` 2 on video tokens."""
    spec = packers.VisionSpec.builtin("qwen3-vl").with_video(2, 8, 1024, 16384)
    files = [str(clip(tmp_path / f"v{k}.mp4", f, r, w, h, seed=k))
             for k, (f, r, w, h) in enumerate([(6, 4, 48, 32), (9, 2, 32, 64), (3, 1, 40, 40)])]
    grids = [spec.measure_video(f, "clip")[0] for f in files]
    model = tiny_qwen3_vl(64, {"image_token_id": 60, "vision_start_token_id": 61, "vision_end_token_id": 62}, "sdpa")
    rng = np.random.default_rng(7)
    collate = packers.Collator(vision=spec, decode_images=False)
    for _ in range(30):
        ids, v_off, v_grid, refs, offs, img, img_grid = [], [], [], [], [0], [], []
        for _ in range(int(rng.integers(1, 4))):  # examples
            for _ in range(int(rng.integers(0, 4))):
                ids += [5] * int(rng.integers(1, 4))
                if rng.random() < 0.5:  # an image of grid (1, 2, 2n): n tokens
                    n = int(rng.integers(1, 4))
                    img.append(len(ids) + 1)
                    img_grid.append([1, 2, 2 * n])
                    ids += [61] + [60] * n + [62]
                    continue
                k = int(rng.integers(0, len(files)))
                t, h, w = grids[k]
                v_grid.append(grids[k])
                refs.append({"path": files[k], "bytes": None})
                for g in range(t):
                    ids += [7] * int(rng.integers(1, 4)) + [61]
                    if g == 0:
                        v_off.append(len(ids))
                    ids += [63] * (h * w // 4) + [62]
            ids += [8]
            offs.append(len(ids))
        row = {"input_ids": ids, "loss_mask": [1] * len(ids), "seq_offsets": offs, "video_offsets": v_off,
               "video_grid_thw": np.asarray(v_grid).reshape(-1).tolist(), "videos": refs,
               "second_per_grid_ts": [1.0] * len(v_off), "image_offsets": img,
               "image_grid_thw": np.asarray(img_grid).reshape(-1).tolist(),
               "images": [{"path": None, "bytes": b"x"}] * len(img)}
        got = _positions(collate, row)
        for s in range(len(offs) - 1):
            a, z = offs[s], offs[s + 1]
            x = torch.tensor([ids[a:z]])
            vk = [k for k, o in enumerate(v_off) if a <= o < z]
            ik = [k for k, o in enumerate(img) if a <= o < z]
            kw = {"video_grid_thw": torch.tensor([v_grid[k] for k in vk]).reshape(-1, 3)} if vk else {}
            if ik:
                kw["image_grid_thw"] = torch.tensor([img_grid[k] for k in ik])
            want, _ = model.model.get_rope_index(x, ((x == 60).int() + 2 * (x == 63).int()), **kw)
            assert got[:, a:z].tolist() == want[:, 0].tolist()


def _positions(collate, row) -> np.ndarray:
    """The Collator's mRoPE positions (rows 1..3 of ``position_ids``) of one row, its images' pixels not loaded."""
    from unittest import mock

    with mock.patch.object(type(collate), "_pixels", lambda self, parts, grids: {}):
        return collate([row])["position_ids"][1:, 0].numpy()


def test_rows_whose_frame_groups_are_broken_are_refused():
    """The Collator finds each video's frame groups from its offset; a row whose groups are not there is refused
    (the files are never opened: the row checks come first)."""
    spec = packers.VisionSpec.builtin("qwen3-vl").with_video(2)
    v = 9
    good = [1, 2, v, v, 3, 4, 2, v, v, 3, 5]  # two groups of 2 tokens (grid (2, 2, 4)), a timestamp between
    row = {"input_ids": good, "loss_mask": [0] * 10 + [1], "seq_offsets": [0, 11], "video_offsets": [2],
           "video_grid_thw": [2, 2, 4], "videos": [{"path": "x.mp4", "bytes": None}], "second_per_grid_ts": [1.0]}
    collate = packers.Collator(vision=spec, decode_images=False)
    for ids in ([1, 2, v, v, v, v, 3, 4, 2, 3, 5],  # touching groups read as one in get_rope_index
                [1, 2, v, v, 3, 4, 2, 3, 5, 6, 7],  # the second group is not there
                [1, 2, v, v, 3, 4, 2, 3, 5, v, v]):  # it runs past the example's end
        with pytest.raises(packers.ContractError, match="one per frame group"):
            collate([{**row, "input_ids": ids, "seq_offsets": [0, 11] if ids[-1] != v else [0, 10, 11],
                      "loss_mask": [0] * 11}])
