"""``--image-max-pixels`` / ``--image-min-pixels`` (issue 45): an image's token count changes exactly as the
processor's does under the same limits, the limits travel with the run (manifest, shard metadata) and the loader
resizes with them, so the rows it decodes come out at the grids they were packed for.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

import packers
from packers import PackstreamError, VisionSpec
from pipeline.cli import main
from tests.test_vision_pipeline import tokenizer  # noqa: F401 - a fixture

PIL = pytest.importorskip("PIL.Image")


def _processor(spec: VisionSpec):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
                                    patch_size=spec.patch_size, merge_size=spec.merge_size,
                                    temporal_patch_size=spec.temporal_patch_size)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(width=st.integers(1, 420), height=st.integers(1, 420), low=st.integers(1, 200_000),
       span=st.integers(0, 400_000), which=st.sampled_from(["both", "max", "min"]),
       family=st.sampled_from(["qwen2-vl", "qwen2.5-vl"]))
def test_counts_change_as_the_processors_do_under_the_same_limits(width, height, low, span, which, family):
    base = VisionSpec.builtin(family)
    lo, hi = (low, low + span) if which == "both" else (None, low + span) if which == "max" else (low, None)
    if which == "max":
        hi = max(hi, base.min_pixels)
    if which == "min":
        lo = min(lo, base.max_pixels)
    spec = base.with_pixel_limits(lo, hi)
    assert (spec.min_pixels, spec.max_pixels) == (lo or base.min_pixels, hi or base.max_pixels)
    if max(width, height) / min(width, height) > 200:
        with pytest.raises(packers.ImageSizeError):
            spec.image_grid(width, height)
        return
    out = _processor(spec)(images=[PIL.new("RGB", (width, height))], return_tensors="np")
    grid = tuple(int(v) for v in out["image_grid_thw"][0])
    assert spec.image_grid(width, height) == grid
    assert spec.image_tokens(width, height) == out["pixel_values"].shape[0] // spec.merge_size ** 2


@pytest.mark.parametrize(("spec", "limits", "message"), [
    ("qwen2-vl", {"max_pixels": 1000}, "the processor's min_pixels 3,136 is over --image-max-pixels 1,000 for "
                                       "processor qwen2-vl; give --image-min-pixels 1,000 or less too"),
    ("qwen2-vl", {"min_pixels": 10**7, "max_pixels": 10**6}, "--image-min-pixels 10,000,000 is over "
                                                              "--image-max-pixels 1,000,000"),
    ("qwen2-vl", {"min_pixels": 0}, "--image-min-pixels 0 is out of range"),
    ("qwen2-vl", {"max_pixels": 2**31}, "--image-max-pixels 2147483648 is out of range"),
    ("llava-1.5", {"max_pixels": 5000}, "resizes every image to one 336x336 square, so no pixel limit applies"),
    ("internvl3", {"min_pixels": 5000}, "cuts each image into 448x448 tiles (1..12 of them, its min_patches/max_patches), "
                                        "so no pixel limit applies"),
])
def test_limits_a_processor_cannot_take_are_one_line(spec, limits, message):
    with pytest.raises(PackstreamError, match=re.escape(message)) as e:
        VisionSpec.builtin(spec).with_pixel_limits(**limits)
    assert "\n" not in str(e.value)


def test_no_limit_is_the_processors_own():
    spec = VisionSpec.builtin("qwen2-vl")
    assert spec.with_pixel_limits() is spec
    assert spec.with_pixel_limits(max_pixels=768 * 768).image_tokens(4000, 3000) == 713
    assert spec.image_tokens(4000, 3000) == 15301


@pytest.mark.parametrize("args", [["--image-max-pixels", "5000"],
                                  ["--image-min-pixels", "5000", "--image-max-pixels", "9000"]])
def test_limits_without_a_processor_are_refused(tmp_path, args):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    result = CliRunner().invoke(main, ["pack", str(data), "-o", str(tmp_path / "o"), *args])
    assert result.exit_code == 2 and "only --processor packs images" in result.output
    assert "Traceback" not in result.output


def _records(root: Path, sizes: list[tuple[int, int]]) -> Path:
    lines = []
    for k, size in enumerate(sizes):
        rng = np.random.default_rng(k)
        PIL.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(root / f"i{k}.png")
        lines.append(json.dumps({"id": f"r{k}", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"i{k}.png"}},
                                         {"type": "text", "text": "what is this"}]},
            {"role": "assistant", "content": "a picture"}]}))
    (root / "d.jsonl").write_text("\n".join(lines) + "\n")
    return root / "d.jsonl"


def test_the_limits_travel_with_the_run_and_the_loader_resizes_with_them(tmp_path, tokenizer):  # noqa: F811
    sizes = [(900, 700), (640, 480), (120, 90), (1000, 60)]
    data = _records(tmp_path, sizes)
    low, high = 28 * 28 * 8, 28 * 28 * 40
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl",
                                       "--image-min-pixels", str(low), "--image-max-pixels", str(high),
                                       "--max-tokens", "4096", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["image_max_pixels"] == high and manifest["config"]["image_min_pixels"] == low
    stored = VisionSpec.from_json(manifest["vision"])
    assert (stored.min_pixels, stored.max_pixels) == (low, high)
    shard = next(out.glob("train-*.arrow"))
    with pa.memory_map(str(shard)) as f:
        meta = pa.ipc.open_stream(f).schema.metadata
    assert VisionSpec.from_json(json.loads(meta[b"packstream.vision"])) == stored

    ds = packers.PackedDataset(out)
    assert ds.vision == stored
    rows = ds.fetch(range(len(ds.rows)))
    limited = VisionSpec.builtin("qwen2-vl").with_pixel_limits(low, high)
    packed = [tuple(g) for r in rows for g in np.asarray(r["image_grid_thw"]).reshape(-1, 3).tolist()]
    assert sorted(packed) == sorted(limited.image_grid(w, h) for w, h in sizes)
    assert packed != [VisionSpec.builtin("qwen2-vl").image_grid(w, h) for w, h in sizes]  # the limits changed them
    batch = packers.Collator(vision=ds.vision)(rows)  # decodes every image, each checked against its packed grid
    reference = _processor(limited)(images=[PIL.open(tmp_path / f"i{k}.png") for k in range(len(sizes))],
                                    return_tensors="np")
    assert sorted(map(tuple, batch["image_grid_thw"].tolist())) == sorted(map(tuple, reference["image_grid_thw"]))
    with pytest.raises(packers.ContractError, match="decodes to patch grid"):  # without the limits: other grids
        packers.Collator(vision=VisionSpec.builtin("qwen2-vl"))(rows)
