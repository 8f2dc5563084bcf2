"""Qwen3-VL images (issue 45), against transformers' own Qwen3-VL code: token counts and grids from
``Qwen3VLProcessor`` (its image processor, ``Qwen2VLImageProcessorPil`` with Qwen3-VL's settings), image positions
from ``Qwen3VLModel.get_rope_index``, and the whole product path (records -> ``packstream pack --processor`` ->
``PackedDataset`` -> ``Collator``) on tiny random Qwen3-VL (dense and MoE) models: each packed example's logits and
loss equal the example's alone, prepared the way the processor prepares it. What is not verified is refused.

transformers' ``Qwen3VLProcessor.__init__`` builds a video processor, which needs torchvision (not installed here):
:func:`qwen3_processor` builds the real class without it (videos: tests/test_vision_qwen3_video.py) and calls its own
``__call__``, ``replace_image_token`` and ``_get_num_multimodal_tokens``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

import packers
from packers import PackstreamError, VisionSpec, mrope_positions
from pipeline.cli import main
from tests._internals import VisionFamily
from tests.test_vision_end_to_end import _records as _shared_records
from tests.test_vision_pipeline import VISION_TOKENS, save_tokenizer

PIL = pytest.importorskip("PIL.Image")
TOL = 1e-5
WORDS = "red square blue circle what colour shape is this describe the picture please answer".split()
LIMITS = dict(min_pixels=32 * 32 * 2, max_pixels=32 * 32 * 12)  # 2 to 12 merged 32-pixel patches: short sequences


def image_processor(spec: VisionSpec):
    """transformers' image processor for Qwen3-VL (what ``image_processing_auto`` maps ``qwen3_vl`` to), set as
    Qwen3-VL's preprocessor_config.json sets it, with ``spec``'s pixel limits."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
                                    patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3)


def qwen3_processor(spec: VisionSpec, tok=None):
    """A real ``Qwen3VLProcessor`` around :func:`image_processor` (no video processor: see the module docstring)."""
    from transformers import Qwen3VLProcessor

    p = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    p.image_processor, p.tokenizer, p.video_processor, p.chat_template = image_processor(spec), tok, None, None
    p.image_token, p.video_token = "<|image_pad|>", "<|video_pad|>"
    p.vision_start_token, p.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    if tok is not None:
        p.image_token_id, p.video_token_id = (tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>"))
    return p


def processor_folder(root: Path, spec: VisionSpec) -> Path:
    """What a Qwen3-VL model ships: the image processor's own preprocessor_config.json (saved by transformers) with
    ``processor_class: Qwen3VLProcessor``, and a config.json naming the model type."""
    image_processor(spec).save_pretrained(root)
    config = json.loads((root / "preprocessor_config.json").read_text())
    (root / "preprocessor_config.json").write_text(json.dumps({**config, "processor_class": "Qwen3VLProcessor"}))
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    return root


def tiny_qwen3_vl(vocab: int, ids: dict[str, int], attn: str, moe: bool = False) -> torch.nn.Module:
    """A tiny random Qwen3-VL (or Qwen3-VL-MoE) built from its config: 16-pixel patches merged 2 x 2, deepstack
    features added after the first two decoder layers, interleaved mRoPE."""
    import transformers

    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, bos_token_id=None,
                eos_token_id=None, pad_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                 "mrope_interleaved": True})
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 1])
    config, model = ((transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration) if moe else
                     (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration))
    torch.manual_seed(0)
    cfg = config(text_config=text, vision_config=vision, video_token_id=vocab - 1, **ids)
    return model._from_config(cfg, attn_implementation=attn)


# -- token counts and grids ---------------------------------------------------------------------------------------------


def test_the_shipped_spec_is_qwen3_vl_instruct_and_reads_back_from_its_config(tmp_path):
    spec = VisionSpec.builtin("qwen3-vl")
    assert (spec.family, spec.patch_size, spec.merge_size, spec.temporal_patch_size, spec.min_pixels,
            spec.max_pixels) == (VisionFamily.QWEN3_VL, 16, 2, 2, 65536, 16777216)
    assert spec.image_grid(640, 480) == (1, 30, 40) and spec.image_tokens(640, 480) == 300
    # Qwen/Qwen3-VL-8B-Instruct's preprocessor_config.json, as published.
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast"}))
    read = VisionSpec.from_processor(tmp_path)
    assert read == dataclasses.replace(spec, name=str(tmp_path))
    assert VisionSpec.from_json(read.to_json()) == read
    saved = VisionSpec.from_processor(processor_folder(tmp_path / "saved", spec))
    assert (saved.family, saved.patch_size, saved.min_pixels, saved.max_pixels) == (VisionFamily.QWEN3_VL, 16,
                                                                                    65536, 16777216)


@settings(max_examples=50, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(1, 360), height=st.integers(1, 360), low=st.integers(1, 150_000),
       span=st.integers(0, 300_000), which=st.sampled_from(["both", "max", "min", "none"]))
def test_counts_and_grids_equal_the_qwen3_vl_processor(width, height, low, span, which):
    """Generated image sizes under random pixel limits: the spec's grid and token count equal what transformers'
    Qwen3VLProcessor gives (its image_grid_thw, its expansion of the image placeholder, its _get_num_multimodal_tokens)."""
    base = VisionSpec.builtin("qwen3-vl")
    lo, hi = {"both": (low, low + span), "max": (None, max(low + span, base.min_pixels)),
              "min": (min(low, base.max_pixels), None), "none": (None, None)}[which]
    spec = base.with_pixel_limits(lo, hi)
    proc = qwen3_processor(spec)
    if max(width, height) / min(width, height) > 200:
        with pytest.raises(packers.ImageSizeError):
            spec.image_grid(width, height)
        with pytest.raises(ValueError):
            proc.image_processor(images=[PIL.new("RGB", (width, height))], return_tensors="np")
        return
    out = proc.image_processor(images=[PIL.new("RGB", (width, height))], return_tensors="np")
    grid = tuple(int(v) for v in out["image_grid_thw"][0])
    assert spec.image_grid(width, height) == grid
    tokens = len(proc.replace_image_token({"image_grid_thw": out["image_grid_thw"]}, 0)) // len("<|image_pad|>")
    assert spec.image_tokens(width, height) == tokens == out["pixel_values"].shape[0] // 4


@settings(max_examples=40, deadline=None, derandomize=True)
@given(width=st.integers(1, 20_000), height=st.integers(1, 20_000))
def test_counts_of_large_images_equal_the_processors_count(width, height):
    """Sizes up to 20,000 pixels a side under the shipped limits, counted without decoding: transformers'
    ``Qwen3VLProcessor._get_num_multimodal_tokens`` (what vLLM and TRL budget with)."""
    spec = VisionSpec.builtin("qwen3-vl")
    if max(width, height) / min(width, height) > 200:
        return
    counted = qwen3_processor(spec, _TOK.tok)._get_num_multimodal_tokens(image_sizes=[(height, width)])
    assert spec.image_tokens(width, height) == counted.num_image_tokens[0]
    t, h, w = spec.image_grid(width, height)
    assert t * h * w == counted.num_image_patches[0]


class _TOK:
    """The default tokenizer with Qwen's vision tokens (set once per module by the ``_tokenizer`` fixture)."""

    path = ""
    tok = None


@pytest.fixture(scope="module", autouse=True)
def _tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    _TOK.path = save_tokenizer(tmp_path_factory.mktemp("q3-tok"), VISION_TOKENS + ["<|video_pad|>"])
    _TOK.tok = AutoTokenizer.from_pretrained(_TOK.path)
    return _TOK.path


# -- positions ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rope_model():
    return tiny_qwen3_vl(64, {"image_token_id": 60, "vision_start_token_id": 61, "vision_end_token_id": 62}, "sdpa")


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(st.integers(1, 6), st.tuples(st.integers(1, 8), st.integers(1, 8))), min_size=1,
                      max_size=7))
def test_positions_equal_get_rope_index_on_each_example_alone(rope_model, parts):
    """Generated examples (text runs and images of random merged grids, a text token between images): the
    positions ``mrope_positions`` gives equal ``Qwen3VLModel.get_rope_index`` run on the example alone with its
    ``mm_token_type_ids``, as transformers' processor returns them."""
    ids, offsets, grids, last_image = [], [], [], False
    for p in parts:
        if isinstance(p, int) or last_image:
            ids += [5] * (p if isinstance(p, int) else 1)
            last_image = False
        if isinstance(p, tuple):
            offsets.append(len(ids))
            grids.append((1, 2 * p[0], 2 * p[1]))
            ids += [60] * (p[0] * p[1])
            last_image = True
    ids.append(7)
    x = torch.tensor([ids])
    kwargs = {"image_grid_thw": torch.tensor(grids)} if grids else {}
    want, _ = rope_model.model.get_rope_index(x, (x == 60).int(), **kwargs)
    got = mrope_positions(len(ids), offsets, grids, merge_size=2)
    assert got.tolist() == want[:, 0].tolist()


def test_qwen3_vl_finds_the_packed_sequences_from_the_first_position_row(rope_model):
    """Qwen3-VL's text model (transformers 5.x) reads ``position_ids`` ``[4, B, T]`` as Qwen2-VL's does: row 0 the
    text positions it builds the packed mask from, rows 1..3 the mRoPE positions. The Collator's batch of two examples
    equals each alone; the same batch without row 0 lets the second example attend to the first."""
    a, b = [5, 9, 17, 30, 31], [3, 4, 8, 6]
    batch = packers.Collator(vision=VisionSpec.builtin("qwen3-vl"))(
        [{"input_ids": a + b, "loss_mask": [1] * 9, "seq_offsets": [0, 5, 9]}])
    assert batch["position_ids"].shape == (4, 1, 9)
    with torch.no_grad():
        packed = rope_model(**batch).logits[0]
        alone = [rope_model(input_ids=torch.tensor([x]), use_cache=False).logits[0] for x in (a, b)]
        leaked = rope_model(**{**batch, "position_ids": batch["position_ids"][1:]}).logits[0]
    assert (packed - torch.cat(alone)).abs().max().item() <= TOL
    assert (leaked[5:] - alone[1]).abs().max().item() > 1e-3


# -- the product path ---------------------------------------------------------------------------------------------------


def _records(root: Path, n: int, seed: int) -> Path:
    return _shared_records(root, n, seed, sides=(8, 300))


def _reference(tokens: list[int], images: list[dict], pad: int, proc) -> tuple[list[int], dict | None]:
    """One packed example rebuilt the transformers way: its image runs cut to the one ``<|image_pad|>`` the chat
    template writes, each expanded by ``Qwen3VLProcessor.replace_image_token`` from the processor's own grid for
    the image file."""
    collapsed = [t for i, t in enumerate(tokens) if t != pad or i == 0 or tokens[i - 1] != pad]
    pil = [PIL.open(im["path"]).convert("RGB") for im in images]
    out = proc.image_processor(images=pil, return_tensors="pt") if pil else None
    ids: list[int] = []
    k = 0
    for t in collapsed:
        if t == pad:
            ids += [pad] * (len(proc.replace_image_token(out, k)) // len(proc.image_token))
            k += 1
        else:
            ids.append(t)
    assert k == len(images)
    return ids, out


@pytest.mark.parametrize("attn, moe, seed", [("sdpa", False, 0), ("eager", False, 1), ("sdpa", True, 2),
                                             ("eager", True, 3)])
def test_packed_records_equal_each_record_prepared_by_transformers(tmp_path, attn, moe, seed):
    data = _records(tmp_path, 12, seed)
    out = tmp_path / "out"
    spec = VisionSpec.builtin("qwen3-vl").with_pixel_limits(**LIMITS)
    budget = int(np.random.default_rng(seed).integers(150, 400))
    result = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", _TOK.path, "--processor",
                                       str(processor_folder(tmp_path / "proc", spec)), "--max-tokens", str(budget),
                                       "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["counts"]["examples_packed"] == 12

    start, pad, end = (_TOK.tok.convert_tokens_to_ids(t) for t in VISION_TOKENS)
    ds = packers.PackedDataset(out)
    assert ds.vision.family is VisionFamily.QWEN3_VL and ds.vision.patch_size == 16
    rows = ds.fetch(range(len(ds.rows)))
    assert sum(len(r["images"]) for r in rows) > 0
    used = sorted({int(t) for r in rows for t in r["input_ids"]} | {start, pad, end})  # fold the vocabulary
    fold = np.zeros(max(used) + 1, np.int64)
    fold[used] = np.arange(len(used))
    model = tiny_qwen3_vl(len(used) + 1, {"image_token_id": int(fold[pad]), "vision_start_token_id": int(fold[start]),
                                          "vision_end_token_id": int(fold[end])}, attn, moe).eval()
    proc = qwen3_processor(ds.vision)

    batch = packers.Collator(vision=ds.vision)([{**r, "input_ids": fold[r["input_ids"]]} for r in rows])
    assert batch["position_ids"].shape[:2] == (4, 1)
    packers.check_packing_safe(model, batch)
    with torch.no_grad():
        logits = model(**batch).logits
    per_example = packers.example_losses(logits, batch)
    cu = batch["cu_seq_lens_q"].tolist()
    examples = [(r, j) for r in rows for j in range(len(r["example_ids"]))]
    assert len(examples) == len(cu) - 1 == 12
    worst = 0.0
    for s, (row, j) in enumerate(examples):
        a, z = int(row["seq_offsets"][j]), int(row["seq_offsets"][j + 1])
        mine = [im for im, o in zip(row["images"], row["image_offsets"]) if a <= o < z]
        ref, pixels = _reference(row["input_ids"][a:z].tolist(), mine, pad, proc)
        assert ref == row["input_ids"][a:z].tolist(), f"example {row['example_ids'][j]}: expansion differs"
        ids = torch.from_numpy(fold[np.asarray(ref)])[None]
        kwargs = {"mm_token_type_ids": (ids == int(fold[pad])).int()}
        if pixels is not None:
            kwargs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        with torch.no_grad():
            alone = model(input_ids=ids, use_cache=False, **kwargs).logits[0]
        diff = (logits[0, cu[s]:cu[s + 1]] - alone).abs().max().item()
        worst = max(worst, diff)
        assert diff <= TOL, f"example {row['example_ids'][j]}: logits differ by {diff:.2e}"
        target = torch.from_numpy(np.asarray(row["loss_mask"][a:z], dtype=bool))
        want = torch.nn.functional.cross_entropy(alone[:-1], ids[0, 1:], reduction="none")[target[1:]].mean()
        assert abs(float(per_example.loss[s]) - float(want)) <= TOL, f"example {row['example_ids'][j]}: loss"
    print(f"qwen3-vl {'moe ' if moe else ''}{attn}: max logit difference {worst:.2e}")


# -- refusals -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config, model_type, message", [
    ({"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor", "patch_size": 16,
      "image_mean": [0.5] * 3, "image_std": [0.5] * 3},
     "qwen3_5", r"model_type \"qwen3_5\" uses Qwen3VLProcessor, but packstream has verified its packed batches only "
                r"for model_type qwen3_vl and qwen3_vl_moe; pack for a Qwen3-VL model"),
    ({"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
      "image_mean": [0.5] * 3, "image_std": [0.5] * 3}, "qwen3_5_moe",
     "model_type \"qwen3_5_moe\" uses Qwen3VLProcessor"),
    ({"image_processor_type": "SiglipImageProcessor", "processor_class": "Qwen3VLProcessor"}, None,
     "image processor SiglipImageProcessor of Qwen3VLProcessor is not one packstream counts tokens for exactly"),
    ({"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3OmniMoeProcessor"}, None,
     "Qwen2VLImageProcessor of Qwen3OmniMoeProcessor is not one"),
])
def test_unverified_qwen3_processors_are_refused_in_one_line(tmp_path, config, model_type, message):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    if model_type:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    with pytest.raises(PackstreamError, match=message) as e:
        VisionSpec.from_processor(tmp_path)
    assert "\n" not in str(e.value)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl_moe"}))
    if model_type:  # the same processor config in a Qwen3-VL-MoE folder is read
        assert VisionSpec.from_processor(tmp_path).family is VisionFamily.QWEN3_VL


def test_video_records_stay_refused_under_qwen3_vl(tmp_path):
    """Without --video-fps a Qwen3-VL record holding a video is a dead letter, the rest pack."""
    PIL.new("RGB", (64, 48)).save(tmp_path / "a.png")
    records = [
        {"id": "img", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                                                {"type": "text", "text": "what"}]},
                                   {"role": "assistant", "content": "red"}]},
        {"id": "vid", "messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"},
                                                                {"type": "text", "text": "what"}]},
                                   {"role": "assistant", "content": "red"}]},
    ]
    data = tmp_path / "r.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    CliRunner().invoke(main, ["pack", str(data), "--tokenizer", _TOK.path, "--processor", "qwen3-vl",
                              "--max-tokens", "2048", "-o", str(out), "-q"])
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["examples_packed"] == 1 and counts["rejected"] == 1
