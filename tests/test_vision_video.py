"""Videos for Qwen2-VL and Qwen2.5-VL (``--video-fps``), held against transformers.

* Frame sampling and token counts: :func:`packers._video.frame_indices` and :meth:`VisionSpec.video_grid` equal
  transformers' ``Qwen2VLVideoProcessor.sample_frames`` and its ``smart_resize`` / ``get_num_of_video_patches`` rule,
  over clips of several lengths and frame rates and random fps / max-frames / pixel limits. transformers' video
  processor module imports torchvision at its top, and the torchvision wheel on the index is built against CUDA
  torch (its ``_C`` extension does not load beside the CPU-only torch wheel), so the module is imported here with a
  stand-in for ``torchvision.transforms.v2.functional``: its ``sample_frames`` and ``smart_resize`` use torch alone.
* End to end: records with videos and images -> ``packstream pack`` -> ``PackedDataset`` -> ``Collator`` -> tiny
  random Qwen2-VL and Qwen2.5-VL: logits and per-example losses equal each example alone, its positions computed by
  the model's own ``get_rope_index`` (``mm_token_type_ids``, ``second_per_grid_ts``), its placeholder runs expanded
  from transformers' sampling and resize rule. (The pixels are the loader's for both: transformers' video processor
  cannot run here, see above.)
* A video too long for the budget is dead-lettered ``too_long``; LLaVA / InternVL with --video-fps are refused
  (Qwen3-VL videos: ``tests/test_vision_qwen3_video.py``).
"""

from __future__ import annotations

import fractions
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import packers
from pipeline.cli import main
from tests._internals import frame_indices
from tests.test_vision_pipeline import save_tokenizer

av = pytest.importorskip("av")
PIL = pytest.importorskip("PIL.Image")
TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
WORDS = "red square blue circle what colour shape is this describe the clip please answer".split()
TOL = 1e-5


def clip(path: Path, frames: int, fps: float, width: int, height: int, seed: int = 0) -> Path:
    """A small MPEG-4 clip of random frames."""
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w") as c:
        s = c.add_stream("mpeg4", rate=fractions.Fraction(fps).limit_denominator(1000))
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            f = av.VideoFrame.from_ndarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), format="rgb24")
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def _hf_video_module(name: str = "transformers.models.qwen2_vl.video_processing_qwen2_vl"):
    """A transformers video processing module (Qwen2-VL's by default), imported with a stand-in for torchvision's
    functional API (unused by ``sample_frames`` and ``smart_resize``): its wheel does not load beside a CPU torch."""
    if name in sys.modules:
        return sys.modules[name]
    stubs = {}
    for mod in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                "torchvision.transforms.v2.functional"):
        if mod not in sys.modules:
            stubs[mod] = sys.modules[mod] = types.ModuleType(mod)
    try:
        import importlib

        return importlib.import_module(name)
    finally:
        for mod in stubs:
            sys.modules.pop(mod, None)


def _hf_indices(total: int, fps: float, want_fps: float, max_frames: int) -> list[int]:
    from transformers.video_utils import VideoMetadata

    vp = _hf_video_module().Qwen2VLVideoProcessor
    proc = vp.__new__(vp)  # sample_frames reads only the class's defaults and its arguments
    proc.num_frames = None
    proc.fps = None
    meta = VideoMetadata(total_num_frames=total, fps=fps)
    return proc.sample_frames(meta, fps=want_fps, max_frames=max_frames, temporal_patch_size=2,
                              min_frames=4).tolist()


def test_frame_indices_equal_transformers_sample_frames():
    rng = np.random.default_rng(0)
    for _ in range(400):
        total = int(rng.integers(2, 600))
        fps = float(rng.choice([1, 5, 8, 12.5, 23.976, 24, 25, 29.97, 30, 60, float(rng.uniform(0.5, 90))]))
        want = float(rng.choice([0.5, 1, 2, 3, float(rng.uniform(0.1, 8))]))
        cap = int(rng.integers(2, 800))
        assert frame_indices(total, fps, want_fps=want, min_frames=4, max_frames=cap, temporal=2) == \
            _hf_indices(total, fps, want, cap), (total, fps, want, cap)


def test_video_grids_and_tokens_equal_transformers_on_generated_clips(tmp_path):
    """Clips of several lengths, rates and sizes: the container's header read by PyAV, the frames sampled and each
    frame resized as transformers does, under random --video-fps / --video-max-frames / pixel limits."""
    hf = _hf_video_module()
    rng = np.random.default_rng(1)
    base = packers.VisionSpec.builtin("qwen2-vl")
    for k, (frames, fps, w, h) in enumerate([(4, 4, 32, 32), (9, 3, 48, 32), (24, 12, 64, 40), (31, 10, 40, 72),
                                              (50, 25, 56, 56), (7, 29.97, 30, 20)]):
        path = clip(tmp_path / f"c{k}.mp4", frames, fps, w, h, seed=k)
        with av.open(str(path)) as c:
            s = c.streams.video[0]
            total, rate = int(s.frames), float(s.average_rate)
        assert total == frames
        for _ in range(5):
            want, cap = float(rng.choice([0.5, 1, 2, 4, 8])), int(rng.integers(2, 40))
            low = int(rng.integers(1, 8)) * 784
            high = low + int(rng.integers(0, 12)) * 784
            spec = base.with_video(want, cap, low, high)
            grid, seconds = spec.measure_video(str(path), "clip")
            idx = _hf_indices(total, rate, want, cap)
            rh, rw = hf.smart_resize(h, w, factor=28, min_pixels=low, max_pixels=high)
            assert grid == (-(-len(idx) // 2), rh // 14, rw // 14)
            assert spec.grid_tokens(grid) == grid[0] * grid[1] * grid[2] // 4
            assert seconds == float(np.float32(2 / (len(idx) / total * rate)))


def _tiny(family: str, vocab: int, ids: dict[str, int], attn: str) -> torch.nn.Module:
    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    torch.manual_seed(0)
    if family == "qwen2-vl":
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, mlp_ratio=2)
        cfg = Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
        return Qwen2VLForConditionalGeneration._from_config(cfg, attn_implementation=attn)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    vision = dict(depth=1, hidden_size=16, out_hidden_size=32, intermediate_size=32, num_heads=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, tokens_per_second=2, window_size=56,
                  fullatt_block_indexes=[0])
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)
    return Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation=attn)


def _records(root: Path, n: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    lines = []
    for r in range(n):
        parts = []
        for k in range(int(rng.integers(0, 3))):
            if rng.random() < 0.6:
                frames, fps = int(rng.integers(2, 14)), float(rng.choice([2, 4, 6, 10]))
                name = clip(root / f"v{r}_{k}.mp4", frames, fps, int(rng.integers(2, 6)) * 8,
                            int(rng.integers(2, 6)) * 8, seed=r * 7 + k).name
                parts.append({"type": "video", "video": name})
            else:
                path = root / f"i{r}_{k}.png"
                PIL.fromarray(rng.integers(0, 256, (int(rng.integers(8, 80)), int(rng.integers(8, 80)), 3),
                                           dtype=np.uint8)).save(path)
                parts.append({"type": "image_url", "image_url": {"url": path.name}})
        parts.insert(int(rng.integers(0, len(parts) + 1)),
                     {"type": "text", "text": " ".join(rng.choice(WORDS, int(rng.integers(1, 10))))})
        answer = " ".join(rng.choice(WORDS, int(rng.integers(1, 8))))
        if r % 3 == 2:  # LLaMA-Factory: a videos column and <video> placeholders
            names = [clip(root / f"lf{r}.mp4", 6, 4, 24, 16, seed=r).name]
            lines.append({"id": f"r{r}", "videos": names, "messages": [
                {"role": "user", "content": "<video> " + " ".join(rng.choice(WORDS, 3))},
                {"role": "assistant", "content": answer}]})
        else:
            lines.append({"id": f"r{r}", "messages": [{"role": "user", "content": parts},
                                                      {"role": "assistant", "content": answer}]})
    path = root / "records.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


PACK_ARGS = ["--image-max-pixels", "9408", "--image-min-pixels", "1568", "--video-fps", "2", "--video-max-pixels",
             "3136", "--video-min-pixels", "784"]


def _reference_ids(tokens: list[int], pad: int, vpad: int, images: list, videos: list, spec) -> list[int]:
    """The example's tokens with each run cut to one pad, expanded by transformers' rules: images by the PIL image
    processor's grid, videos by ``sample_frames`` + ``smart_resize`` on the file's header."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf = _hf_video_module()
    improc = Qwen2VLImageProcessorPil(size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels})
    collapsed = [t for i, t in enumerate(tokens) if t not in (pad, vpad) or i == 0 or tokens[i - 1] != t]
    out, ki, kv = [], 0, 0
    for t in collapsed:
        if t == pad:
            g = improc(images=[PIL.open(images[ki]["path"]).convert("RGB")], return_tensors="pt")["image_grid_thw"][0]
            out += [pad] * (int(g.prod()) // 4)
            ki += 1
        elif t == vpad:
            with av.open(videos[kv]["path"]) as c:
                s = c.streams.video[0]
                idx = _hf_indices(int(s.frames), float(s.average_rate), spec.video_fps, spec.video_max_frames)
                rh, rw = hf.smart_resize(s.height, s.width, factor=28, min_pixels=spec.video_min_pixels,
                                         max_pixels=spec.video_max_pixels)
            out += [vpad] * ((-(-len(idx) // 2)) * (rh // 14) * (rw // 14) // 4)
            kv += 1
        else:
            out.append(t)
    return out


@pytest.mark.parametrize("family, attn", [("qwen2-vl", "sdpa"), ("qwen2.5-vl", "eager"),
                                          pytest.param("qwen2-vl", "eager", marks=pytest.mark.slow),
                                          pytest.param("qwen2.5-vl", "sdpa", marks=pytest.mark.slow)])
def test_packed_videos_equal_each_example_alone(tmp_path, family, attn):
    from transformers import AutoTokenizer

    tok_dir = save_tokenizer(tmp_path / "tok", TOKENS)
    data = _records(tmp_path, 9, seed=3 if family == "qwen2-vl" else 4)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", tok_dir, "--processor", family, *PACK_ARGS,
                                       "--max-tokens", "400", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["examples_packed"] == 9, (out / "rejected.jsonl").read_text()
    assert manifest["contract_version"] == packers.VIDEO_CONTRACT_VERSION

    tok = AutoTokenizer.from_pretrained(tok_dir)
    start, pad, end, vpad = (tok.convert_tokens_to_ids(t) for t in TOKENS)
    ds = packers.PackedDataset(out)
    assert ds.vision.videos and ds.vision.video_fps == 2.0
    rows = ds.fetch(range(len(ds.rows)))
    assert sum(len(r["videos"]) for r in rows) >= 3
    used = sorted({int(t) for r in rows for t in r["input_ids"]} | {start, pad, end, vpad})
    fold = np.zeros(max(used) + 1, np.int64)
    fold[used] = np.arange(len(used))
    ids = {"image_token_id": int(fold[pad]), "video_token_id": int(fold[vpad]),
           "vision_start_token_id": int(fold[start]), "vision_end_token_id": int(fold[end])}
    model = _tiny(family, len(used) + 1, ids, attn).eval()
    collate = packers.Collator(vision=ds.vision)
    batch = collate([{**r, "input_ids": fold[r["input_ids"]]} for r in rows])
    assert ("second_per_grid_ts" in batch) == (family == "qwen2.5-vl")
    with torch.no_grad():
        logits = model(**batch).logits
    per_example = packers.example_losses(logits, batch)
    cu = batch["cu_seq_lens_q"].tolist()
    examples = [(r, j) for r in rows for j in range(len(r["example_ids"]))]
    worst = 0.0
    for s, (row, j) in enumerate(examples):
        a, z = int(row["seq_offsets"][j]), int(row["seq_offsets"][j + 1])
        ims = [im for im, o in zip(row["images"], row["image_offsets"]) if a <= o < z]
        keep = [k for k, o in enumerate(row["video_offsets"]) if a <= o < z]
        vids = [row["videos"][k] for k in keep]
        tokens = row["input_ids"][a:z].tolist()
        assert _reference_ids(tokens, pad, vpad, ims, vids, ds.vision) == tokens, row["example_ids"][j]
        x = torch.from_numpy(fold[np.asarray(tokens)])[None]
        kwargs = {"mm_token_type_ids": (x == ids["image_token_id"]).int() + 2 * (x == ids["video_token_id"]).int()}
        if ims:
            pv, grid = packers.PixelLoader(vision=ds.vision)(ims)
            kwargs.update(pixel_values=pv, image_grid_thw=grid)
        if vids:
            alone = collate([{"input_ids": tokens, "loss_mask": row["loss_mask"][a:z], "seq_offsets": [0, z - a],
                              "video_offsets": np.asarray(row["video_offsets"])[keep] - a,
                              "video_grid_thw": np.asarray(row["video_grid_thw"]).reshape(-1, 3)[keep],
                              "videos": vids, "second_per_grid_ts": np.asarray(row["second_per_grid_ts"])[keep]}])
            kwargs.update(pixel_values_videos=alone["pixel_values_videos"], video_grid_thw=alone["video_grid_thw"])
            if family == "qwen2.5-vl":  # as the processor returns it: a float32 tensor
                kwargs["second_per_grid_ts"] = torch.tensor([float(v) for v in alone["second_per_grid_ts"]])
        if not ims and not vids:
            kwargs = {}
        with torch.no_grad():
            ref = model(input_ids=x, use_cache=False, **kwargs).logits[0]
        diff = (logits[0, cu[s]:cu[s + 1]] - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff <= TOL, f"{row['example_ids'][j]}: logits differ by {diff:.2e}"
        target = torch.tensor(row["loss_mask"][a:z].tolist(), dtype=torch.bool)
        want = torch.nn.functional.cross_entropy(ref[:-1], x[0, 1:], reduction="none")[target[1:]].mean()
        assert abs(float(per_example.loss[s]) - float(want)) <= TOL
    print(f"{family} {attn}: max logit diff {worst:.2e} over {len(examples)} examples")


@pytest.mark.parametrize("processor, limits", [
    ("qwen2-vl", ["--video-max-pixels", "12544", "--video-min-pixels", "784"]),
    pytest.param("qwen3-vl", ["--video-max-pixels", "200000"], marks=pytest.mark.slow),
])
def test_too_long_video_is_dead_lettered(tmp_path, processor, limits):
    tok_dir = save_tokenizer(tmp_path / "tok", TOKENS)
    clip(tmp_path / "long.mp4", 40, 4, 64, 64)
    (tmp_path / "r.jsonl").write_text(json.dumps({"id": "x", "messages": [
        {"role": "user", "content": [{"type": "video", "video": "long.mp4"}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "ok"}]}) + "\n" + json.dumps({"id": "y", "messages": [
            {"role": "user", "content": "hello"}, {"role": "assistant", "content": "ok"}]}) + "\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(tmp_path / "r.jsonl"), "--tokenizer", tok_dir, "--processor",
                                       processor, "--video-fps", "2", *limits, "--max-tokens", "64", "--long",
                                       "split", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rejected] == ["too_long"]
    assert "never cut" in rejected[0]["detail"] and "video" in rejected[0]["detail"]
    assert json.loads((out / "manifest.json").read_text())["counts"]["examples_packed"] == 1


@pytest.mark.parametrize("processor", ["llava-1.5", "internvl3"])
def test_video_fps_refused_for_other_families(tmp_path, processor):
    (tmp_path / "r.jsonl").write_text('{"text": "x"}\n')
    result = CliRunner().invoke(main, ["pack", str(tmp_path / "r.jsonl"), "--processor", processor, "--video-fps",
                                       "2", "-o", str(tmp_path / "o")])
    assert result.exit_code != 0
    line = [x for x in result.output.splitlines() if "video" in x]
    assert line and "Qwen2-VL, Qwen2.5-VL and Qwen3-VL only" in line[0], result.output


def test_videos_without_video_fps_are_refused_in_one_line(tmp_path):
    tok_dir = save_tokenizer(tmp_path / "tok", TOKENS)
    clip(tmp_path / "a.mp4", 6, 4, 32, 32)
    (tmp_path / "r.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "video", "video": "a.mp4"}]},
        {"role": "assistant", "content": "ok"}]}) + "\n")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(tmp_path / "r.jsonl"), "--tokenizer", tok_dir, "--processor",
                                       "qwen2-vl", "-o", str(out), "-q"])
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rejected] == ["non_text_content"], result.output
    assert "--video-fps" in rejected[0]["detail"]


def test_spec_json_round_trips_and_image_only_specs_read_as_before():
    spec = packers.VisionSpec.builtin("qwen2.5-vl").with_video(1.5, 32, 784, 3136)
    assert packers.VisionSpec.from_json(spec.to_json()) == spec
    plain = packers.VisionSpec.builtin("qwen2.5-vl")
    assert "video_fps" not in plain.to_json() and packers.VisionSpec.from_json(plain.to_json()) == plain
    with pytest.raises(packers.PackstreamError, match="video_fps"):
        packers.VisionSpec.from_json(json.dumps({**json.loads(spec.to_json()), "video_fps": "fast"}))


def test_a_model_folders_video_settings_are_the_defaults_and_flags_win(tmp_path):
    """A --processor folder's video_preprocessor_config.json (what transformers' video processor loads from it) sets
    the video pixel limits and frame cap when the --video-* flags leave them out; a flag wins; a bad value is one
    line naming the file."""
    from pipeline import PackOptions

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({
        "size": {"shortest_edge": 3136, "longest_edge": 50176}, "max_frames": 6}))
    base = dict(inputs=("x.jsonl",), processor=str(tmp_path), video_fps=2.0, output=str(tmp_path / "o"))
    spec = PackOptions(**base).vision()
    assert (spec.video_min_pixels, spec.video_max_pixels, spec.video_max_frames) == (3136, 50176, 6)
    spec = PackOptions(**base, video_max_pixels=100352, video_max_frames=8).vision()
    assert (spec.video_min_pixels, spec.video_max_pixels, spec.video_max_frames) == (3136, 100352, 8)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "preprocessor_config.json").write_text((tmp_path / "preprocessor_config.json").read_text())
    (bad / "video_preprocessor_config.json").write_text(json.dumps({"max_frames": "many"}))
    with pytest.raises(packers.PackstreamError, match="video_preprocessor_config.json: max_frames is \"many\""):
        PackOptions(**{**base, "processor": str(bad)}).vision()


@pytest.mark.parametrize("processor, tokens, budget", [
    ("gemma3", ["<start_of_image>", "<image_soft_token>", "<end_of_image>"], "4096"),
    ("internvl3", ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"], "8192"),
])
def test_a_video_part_is_refused_under_a_family_that_packs_no_videos(tmp_path, processor, tokens, budget):
    """Videos are packed for the Qwen family only (Gemma 3's and InternVL's video frames are not counted here): such
    a record is a dead letter, the rest packs."""
    from tests.test_vision_exact import png

    tok = save_tokenizer(tmp_path / "tok", tokens)
    (tmp_path / "a.png").write_bytes(png(60, 30, 1))
    records = [{"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"},
                                                          {"type": "text", "text": "what?"}]},
                             {"role": "assistant", "content": "a clip"}]},
               {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                                          {"type": "text", "text": "what?"}]},
                             {"role": "assistant", "content": "a square"}]}]
    data = tmp_path / "r.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", tok, "--processor", processor,
                                       "--max-tokens", budget, "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    counts = json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]
    assert counts["examples_packed"] == 1 and counts["rejected"] == 1
