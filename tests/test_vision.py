"""Vision-token budgets: :class:`packers.VisionSpec` counts, from an image's size alone, what the model's own processor
produces for that image (a property test over generated images), and reads processor configs as models ship them."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packers import ImageSizeError, PackstreamError, VisionFamily, VisionSpec
from tests._internals import smart_resize

PIL = pytest.importorskip("PIL.Image")
qwen_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
llava_pil = pytest.importorskip("transformers.models.llava.image_processing_pil_llava")

_QUICK = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _image(width: int, height: int, seed: int) -> "PIL.Image":
    rng = np.random.default_rng(seed)
    return PIL.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@st.composite
def _qwen_case(draw):
    patch = draw(st.sampled_from([14, 16]))
    merge = draw(st.sampled_from([1, 2]))
    factor = patch * merge
    min_pixels = draw(st.integers(factor * factor, 64 * factor * factor))
    max_pixels = draw(st.integers(min_pixels, 400 * factor * factor))
    width = draw(st.integers(1, 700))
    height = draw(st.integers(max(1, -(-width // 150)), min(700, width * 150)))
    return VisionSpec(family=VisionFamily.QWEN2_VL, patch_size=patch, merge_size=merge, min_pixels=min_pixels,
                      max_pixels=max_pixels), width, height


@_QUICK
@given(case=_qwen_case(), seed=st.integers(0, 2**16))
def test_qwen_tokens_equal_the_processors(case, seed):
    """The grid and token count from the size alone equal Qwen2-VL's processor's on the decoded image."""
    spec, width, height = case
    processor = qwen_pil.Qwen2VLImageProcessorPil(
        size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels}, patch_size=spec.patch_size,
        merge_size=spec.merge_size, temporal_patch_size=spec.temporal_patch_size)
    out = processor(images=[_image(width, height, seed)], return_tensors="np")
    grid = tuple(int(v) for v in out["image_grid_thw"][0])
    assert spec.image_grid(width, height) == grid
    # The processor's patches merged merge x merge: one placeholder token each (Qwen2VLProcessor's expansion).
    assert spec.image_tokens(width, height) == out["pixel_values"].shape[0] // spec.merge_size ** 2
    assert spec.image_tokens(width, height) == int(np.prod(grid)) // spec.merge_size ** 2


@_QUICK
@given(width=st.integers(1, 900), height=st.integers(1, 900), seed=st.integers(0, 2**16))
def test_llava_tokens_equal_the_processors(width, height, seed):
    """LLaVA-1.5 resizes and crops every image to one square: the count never depends on the size, and equals the
    features the CLS-dropping tower keeps of the processor's output."""
    spec = VisionSpec.builtin("llava-1.5")
    processor = llava_pil.LlavaImageProcessorPil(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336})
    out = processor(images=[_image(width, height, seed)], return_tensors="np")
    _, _, h, w = out["pixel_values"].shape
    assert spec.image_tokens(width, height) == (h // spec.patch_size) * (w // spec.patch_size) == 576


@_QUICK
@given(height=st.integers(1, 5000), width=st.integers(1, 5000),
       factor=st.sampled_from([14, 28, 32]), lo=st.integers(1, 400), span=st.integers(0, 20000))
def test_smart_resize_is_transformers(height, width, factor, lo, span):
    """Our copy of the resize rule equals transformers' own, wherever transformers accepts the size."""
    theirs = qwen_pil.smart_resize

    min_pixels, max_pixels = lo * factor, lo * factor + span * factor
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(ValueError):
            theirs(height, width, factor, min_pixels, max_pixels)
        return
    assert smart_resize(height, width, factor, min_pixels, max_pixels) == theirs(height, width, factor, min_pixels,
                                                                                 max_pixels)


def test_sizes_the_processor_refuses_are_carried_as_data():
    spec = VisionSpec.builtin("qwen2-vl")
    with pytest.raises(ImageSizeError) as e:
        spec.image_tokens(width=4000, height=10)
    assert (e.value.reason.value, e.value.width, e.value.height) == ("extreme_aspect_ratio", 4000, 10)
    assert "crop or pad" in str(e.value)
    with pytest.raises(ImageSizeError, match="no area"):
        spec.image_tokens(width=0, height=10)


def test_processor_configs_as_models_ship_them(tmp_path):
    """Qwen2-VL's, Qwen2.5-VL's and LLaVA-1.5's config files (their fields, as on the Hub) give the shipped specs."""
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}))
    spec = VisionSpec.from_processor(qwen)
    assert spec == VisionSpec.builtin("qwen2-vl").__class__(**{**VisionSpec.builtin("qwen2-vl").__dict__,
                                                               "name": str(qwen)})
    (qwen / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}))
    assert VisionSpec.from_processor(qwen).family is VisionFamily.QWEN2_5_VL

    llava = tmp_path / "llava"
    llava.mkdir()
    (llava / "preprocessor_config.json").write_text(json.dumps({
        "crop_size": {"height": 336, "width": 336}, "do_center_crop": True, "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor", "size": {"shortest_edge": 336}}))
    (llava / "processor_config.json").write_text(json.dumps({
        "image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
        "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"}))
    spec = VisionSpec.from_processor(llava)
    assert (spec.family, spec.image_tokens(640, 480), spec.image_token) == (VisionFamily.LLAVA, 576, "<image>")
    assert VisionSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("config, message", [
    ({"image_processor_type": "LlavaNextImageProcessor", "processor_class": "LlavaNextProcessor"},
     "LlavaNextImageProcessor of LlavaNextProcessor is not one packstream counts tokens for exactly"),
    ({"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen2_5OmniProcessor", "patch_size": 14},
     "Qwen2VLImageProcessorFast of Qwen2_5OmniProcessor is not one"),
    ({"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 10, "max_pixels": 5},
     "min_pixels 10 is over max_pixels 5, expected min_pixels <= max_pixels"),
])
def test_unverified_or_broken_processors_are_refused(tmp_path, config, message):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(PackstreamError, match=message):
        VisionSpec.from_processor(tmp_path)


def test_processor_names_and_missing_paths():
    assert VisionSpec.from_processor("Qwen2.5-VL").family is VisionFamily.QWEN2_5_VL
    with pytest.raises(PackstreamError, match=r"no such file or folder; give the model's folder"):
        VisionSpec.from_processor("/nonexistent/processor")
    with pytest.raises(PackstreamError, match="no shipped vision processor 'idefics'"):
        VisionSpec.builtin("idefics")
