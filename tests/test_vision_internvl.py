"""InternVL images (issue 45): dynamic tiles counted exactly, packed, loaded and run against transformers' own.

``VisionSpec`` of the InternVL family counts an image's tiles the way transformers' ``InternVLProcessor`` does (its
GotOcr2 image processor cropping to a canvas of ``cols x rows`` tiles, plus a thumbnail): a property test holds the
tile grid and the token count equal to transformers' on generated sizes and random ``min_patches``/``max_patches``,
both from the arithmetic and from the processor run on images. End to end, generated records with 0-2 images of
random sizes are packed by ``packstream pack --processor <an InternVL processor folder>``, loaded with
``PackedDataset``, collated with ``Collator(vision=ds.vision)`` and run through a tiny random
``InternVLForConditionalGeneration`` (28-pixel tiles in 7-pixel patches, pixel-shuffled to 4 tokens a tile); each
example is also prepared by ``InternVLProcessor`` from its own text and images and run alone: logits and per-example
losses agree within 1e-5, eager and sdpa. Settings packstream has not verified are refused in one line.

transformers' ``InternVLProcessor`` insists on a video processor, which needs torchvision (not installed here): the
tests build it through :class:`ImagesOnly`, which lets the video processor be None (images never reach it).
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
from packers import Collator, ContractError, PackstreamError, PixelLoader, VisionSpec
from pipeline.cli import main
from tests._internals import VisionFamily
from tests.test_vision_exact import assert_same_gradients, gradients, mean_target_loss, pack_row, png
from tests.test_vision_end_to_end import _records as _shared_records
from tests.test_vision_pipeline import save_tokenizer

PIL = pytest.importorskip("PIL.Image")
TOL = 1e-5
TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
          "video_token": "<video>"}
IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
WORDS = "red square blue circle what colour shape is this describe the picture please answer".split()


def preprocessor(side: int = 448, low: int = 1, high: int = 12, **extra) -> dict:
    """preprocessor_config.json as OpenGVLab/InternVL3-*-hf ship it (transformers' convert_internvl_weights_to_hf.py
    writes this GotOcr2ImageProcessorFast; its crop_to_patches stays false: InternVLProcessor crops anyway)."""
    return {"image_processor_type": "GotOcr2ImageProcessorFast", "processor_class": "InternVLProcessor",
            "crop_to_patches": False, "min_patches": low, "max_patches": high, "size": {"height": side, "width": side},
            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "do_convert_rgb": True, "resample": 3, **IMAGENET, **extra}


def processor_folder(root: Path, pre: dict, seq: int | None = 256) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "preprocessor_config.json").write_text(json.dumps(pre))
    proc = {"processor_class": "InternVLProcessor"} | ({} if seq is None else {"image_seq_length": seq})
    (root / "processor_config.json").write_text(json.dumps(proc))
    return root


def _images_only():
    from transformers import InternVLProcessor

    class ImagesOnly(InternVLProcessor):
        """InternVLProcessor with no video processor (torchvision is not installed; images never reach it)."""

        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImagesOnly


@pytest.fixture(scope="module")
def tok_folder(tmp_path_factory) -> str:
    return save_tokenizer(tmp_path_factory.mktemp("internvl-tok"), ["<img>", "</img>", "<IMG_CONTEXT>", "<video>"])


@pytest.fixture(scope="module")
def hf_tokenizer(tok_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_folder, extra_special_tokens=TOKENS)


def internvl_processor(hf_tokenizer, side: int, low: int, high: int, seq: int, crop: bool = False):
    """transformers' InternVLProcessor over its PIL GotOcr2 image processor, set as a processor folder sets it."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    image = GotOcr2ImageProcessorPil(size={"height": side, "width": side}, min_patches=low, max_patches=high,
                                     crop_to_patches=crop, **IMAGENET)
    return _images_only()(image_processor=image, tokenizer=hf_tokenizer, image_seq_length=seq)


# -- the count ---------------------------------------------------------------------------------------------------


limits = st.integers(1, 14).flatmap(lambda high: st.tuples(st.integers(1, high), st.just(high)))


@settings(max_examples=400, deadline=None)
@given(width=st.integers(1, 5000), height=st.integers(1, 5000), side=st.sampled_from([28, 56, 448, 512]),
       lim=limits)
def test_tile_grid_and_tokens_equal_transformers_arithmetic(width, height, side, lim):
    """The grid and the count equal GotOcr2's ``get_optimal_tiled_canvas`` and ``get_number_of_image_patches``
    (what InternVLProcessor's ``_get_num_multimodal_tokens`` multiplies by ``image_seq_length``)."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (GotOcr2ImageProcessorPil,
                                                                            get_optimal_tiled_canvas)

    low, high = lim
    spec = VisionSpec(family=VisionFamily.INTERNVL, image_size=side, min_tiles=low, max_tiles=high, tile_tokens=7,
                      merge_size=1, temporal_patch_size=1, image_token="<IMG_CONTEXT>", vision_start="<img>",
                      vision_end="</img>")
    tiles, rows, cols = spec.image_grid(width, height)
    want = GotOcr2ImageProcessorPil(size={"height": side, "width": side}).get_number_of_image_patches(
        height, width, {"crop_to_patches": True, "min_patches": low, "max_patches": high})
    assert tiles == want and spec.image_tokens(width, height) == 7 * want
    if high > 1:
        assert (cols, rows) == get_optimal_tiled_canvas((height, width), (side, side), low, high)
    assert packers.rowcheck.check_images(0, np.full(7 * want, 9), None, np.array([0, 7 * want]), [0],
                                         [tiles, rows, cols], 1, spec) is None


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(1, 240), height=st.integers(1, 240), lim=limits, seq=st.integers(1, 5),
       crop=st.booleans())
def test_tiles_equal_what_internvl_processor_makes_of_the_image(tmp_path_factory, hf_tokenizer, width, height, lim,
                                                                seq, crop):
    """The spec read from a processor folder (random min/max patches and image_seq_length; its own crop_to_patches
    true or false) counts what InternVLProcessor, set the same way, gives for an image: its <IMG_CONTEXT> tokens
    between <img> and </img>, and its tiles in pixel_values."""
    low, high = lim
    folder = processor_folder(tmp_path_factory.mktemp("proc"), preprocessor(28, low, high, crop_to_patches=crop), seq)
    spec = VisionSpec.from_processor(folder)
    proc = internvl_processor(hf_tokenizer, 28, low, high, seq, crop)
    image = PIL.new("RGB", (width, height), "red")
    out = proc(text=["<IMG_CONTEXT>"], images=[image], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    start, end, ctx = (hf_tokenizer.convert_tokens_to_ids(TOKENS[k]) for k in
                       ("start_image_token", "end_image_token", "context_image_token"))
    run = ids[ids.index(start) + 1:ids.index(end)]
    assert run == [ctx] * spec.image_tokens(width, height)
    assert out["pixel_values"].shape == (spec.image_grid(width, height)[0], 3, 28, 28)
    pixels, grids = PixelLoader(vision=spec)([{"path": None, "bytes": png(width, height, 0)}])
    assert grids.tolist() == [list(spec.image_grid(width, height))] and pixels.shape == out["pixel_values"].shape


def test_the_shipped_spec_is_internvl3_hf():
    """``internvl3``: 448-pixel tiles, 1..12 of them plus a thumbnail, 256 tokens a tile; the same spec as read from
    the configs InternVL3-hf ships."""
    spec = VisionSpec.builtin("internvl3")
    assert spec.image_grid(640, 480) == (13, 3, 4) and spec.image_tokens(640, 480) == 13 * 256
    assert spec.image_grid(448, 448) == (1, 1, 1) and spec.image_tokens(100, 100) == 256
    assert spec.image_grid(4000, 100) == (13, 1, 12)
    assert (spec.image_token, spec.vision_start, spec.vision_end) == ("<IMG_CONTEXT>", "<img>", "</img>")
    assert not spec.family.mrope
    assert VisionSpec.from_json(spec.to_json()) == spec
    assert "tile_tokens" not in VisionSpec.builtin("qwen2-vl").to_json()  # other families' JSON as before


def test_the_folder_internvl3_hf_ships_reads_as_the_shipped_spec(tmp_path):
    spec = VisionSpec.from_processor(processor_folder(tmp_path, preprocessor()))
    assert spec == dataclasses.replace(VisionSpec.builtin("internvl3"), name=str(tmp_path))


# -- refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, seq, message", [
    ({"min_patches": 5, "max_patches": 2}, 256, r"min_patches 5 is over max_patches 2, expected min_patches <= "
                                                r"max_patches"),
    ({"size": {"height": 448, "width": 224}}, 256, r"size.height 448 and size.width 224 differ, expected square"),
    ({"size": {"shortest_edge": 448}}, 256, r"size.height is missing"),
    ({"max_patches": 0}, 256, r"max_patches is 0, expected an integer in 1..1024"),
    ({"image_mean": [0.5, 0.5, 0.5]}, 256, r"image_mean is \[0.5, 0.5, 0.5\], expected \[0.485, 0.456, 0.406\]"),
    ({"image_std": None}, 256, r"image_std is absent|image_std is null"),
    ({"do_normalize": False}, 256, r"do_normalize is false, expected true"),
    ({"resample": 2}, 256, r"resample is 2, expected 3"),
    ({}, 0, r"image_seq_length is 0, expected an integer in 1..65536"),
    ({"image_processor_type": "InternVL3_5ImageProcessor"}, 256, r"image processor InternVL3_5ImageProcessor of "
                                                                 r"InternVLProcessor is not one packstream counts"),
])
def test_unverified_settings_are_refused_in_one_line(tmp_path, change, seq, message):
    pre = preprocessor() | change
    if change.get("image_std", 0) is None:
        del pre["image_std"]
        message = r"image_std is absent \(its class default is another\)"
    with pytest.raises(PackstreamError, match=message) as e:
        VisionSpec.from_processor(processor_folder(tmp_path, pre, seq))
    text = str(e.value)
    assert "\n" not in text and ("--processor internvl3" in text or "Shipped" in text), text


def test_a_row_whose_grid_is_no_tile_grid_is_refused():
    """(tiles, rows, cols) must be a canvas the limits allow, with its thumbnail: a row edited to (4, 2, 2) (the
    thumbnail dropped, the same 4 x 256 tokens as a 1 x 3 canvas + thumbnail) is refused before any pixel."""
    spec = VisionSpec.builtin("internvl3")
    row = {"input_ids": [5, 1] + [9] * 1024 + [2, 6, 7], "loss_mask": [0] * 1028 + [1], "seq_offsets": [0, 1029],
           "image_offsets": [2], "image_grid_thw": [4, 2, 2], "images": [{"path": None, "bytes": png(60, 30, 0)}]}
    with pytest.raises(ContractError, match=r"image 0: 1024 placeholder tokens \(grid \(4, 2, 2\)\) at token 2 is no "
                                            r"InternVL tile grid"):
        Collator(vision=spec, decode_images=False)([row])


def test_an_image_replaced_since_packing_is_refused_without_decoding():
    """A 60 x 30 image packed as (3, 1, 2), its file since replaced by a 30 x 60 one (3, 2, 1: the same tokens): the
    Collator that does not decode still reads each image's size from its header and refuses the row."""
    spec = _tiny_spec()
    (ex,) = _examples(spec, [[(60, 30)]])
    assert ex["grids"] == [(3, 1, 2)]
    row = pack_row([{**ex, "images": [{"path": None, "bytes": png(30, 60, 0)}]}])
    with pytest.raises(ContractError, match=r"its size gives patch grid \(3, 2, 1\), the row was packed for "
                                            r"\(3, 1, 2\)"):
        Collator(vision=spec, decode_images=False)([row])


def test_a_processor_set_to_other_tiles_is_refused():
    """The loader checks each image's tiles against the packed grid: a GotOcr2 processor of another tile size is
    refused by the pixels' shape; one whose limits differ by the tiles it gives."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    spec = VisionSpec.builtin("internvl3")
    image = {"path": None, "bytes": png(900, 300, 0)}
    grid = spec.image_grid(900, 300)
    assert grid == (4, 1, 3)
    other = GotOcr2ImageProcessorPil(size={"height": 224, "width": 224}, **IMAGENET)
    with pytest.raises(ContractError, match=r"pixel_values of shape \[4, 3, 224, 224\].*the spec internvl3 gives "
                                            r"\[tiles, channels, 448, 448\]"):
        PixelLoader(vision=spec, processor=other)([image], [grid])
    fewer = GotOcr2ImageProcessorPil(size={"height": 448, "width": 448}, max_patches=2, **IMAGENET)
    with pytest.raises(ContractError, match=r"decodes to patch grid \(3, 1, 3\), the row was packed for \(4, 1, 3\)"):
        PixelLoader(vision=spec, processor=fewer)([image], [grid])


# -- end to end --------------------------------------------------------------------------------------------------

SIDE, PATCH, PER_TILE = 28, 7, 4  # (28 / 7)^2 = 16 patches a tile, pixel-shuffled by 0.5: 4 tokens


def _records(root: Path, n: int, seed: int) -> Path:
    return _shared_records(root, n, seed, sides=(4, 200))


def _tiny_internvl(vocab: int, image_id: int, attn: str) -> torch.nn.Module:
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    text = dict(model_type="qwen2", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None,
                eos_token_id=None, pad_token_id=None)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=SIDE,
                  patch_size=PATCH)
    cfg = InternVLConfig(vision_config=vision, text_config=text, image_token_id=image_id, image_seq_length=PER_TILE,
                         downsample_ratio=0.5, vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    return InternVLForConditionalGeneration._from_config(cfg, attn_implementation=attn)


def _reference(tokens: list[int], images: list[dict], ids: dict[str, int], proc) -> tuple[list[int], dict]:
    """One packed example prepared by InternVLProcessor: each ``<img> <IMG_CONTEXT>... </img>`` cut back to the one
    ``<IMG_CONTEXT>`` a chat template writes, then expanded as the processor expands it for that image file (its
    ``<img>`` + run + ``</img>``, read from the processor's own input_ids), and the processor's pixel_values."""
    start, ctx, end = ids["<img>"], ids["<IMG_CONTEXT>"], ids["</img>"]
    pil = [PIL.open(im["path"]).convert("RGB") for im in images]
    out: list[int] = []
    k, i = 0, 0
    while i < len(tokens):
        if tokens[i] == start:
            i = tokens.index(end, i) + 1
            made = proc(text=["<IMG_CONTEXT>"], images=[pil[k]])["input_ids"][0]
            out += made[made.index(start):made.index(end) + 1]
            k += 1
        else:
            assert tokens[i] != ctx
            out.append(tokens[i])
            i += 1
    assert k == len(images)
    pixels = proc(text=[" <IMG_CONTEXT>" * k], images=pil, return_tensors="pt") if pil else None
    return out, ({} if pixels is None else {"pixel_values": pixels["pixel_values"]})


@pytest.mark.parametrize("attn, seed", [("sdpa", 0), ("eager", 1), ("sdpa", 2)])
def test_packed_internvl_records_equal_each_record_prepared_by_transformers(tmp_path, tok_folder, hf_tokenizer,
                                                                            attn, seed):
    rng = np.random.default_rng(seed)
    high = int(rng.integers(2, 9))
    folder = processor_folder(tmp_path / "proc", preprocessor(SIDE, int(rng.integers(1, high + 1)), high), PER_TILE)
    data = _records(tmp_path, 10, seed)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", tok_folder, "--processor", str(folder),
                                       "--max-tokens", str(int(rng.integers(200, 400))), "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["examples_packed"] == 10 and counts["rejected"] == 0, counts

    ds = packers.PackedDataset(out)
    assert ds.vision.family is VisionFamily.INTERNVL and ds.vision.tile_tokens == PER_TILE
    rows = ds.fetch(range(len(ds.rows)))
    ids = {t: hf_tokenizer.convert_tokens_to_ids(t) for t in ("<img>", "<IMG_CONTEXT>", "</img>")}
    used = sorted({int(t) for r in rows for t in r["input_ids"]} | set(ids.values()))
    fold = np.zeros(max(used) + 1, np.int64)
    fold[used] = np.arange(len(used))
    model = _tiny_internvl(len(used) + 1, int(fold[ids["<IMG_CONTEXT>"]]), attn).eval()
    batch = Collator(vision=ds.vision)([{**r, "input_ids": fold[r["input_ids"]]} for r in rows])
    assert batch["position_ids"].shape == batch["input_ids"].shape and "image_grid_thw" not in batch
    tiles = sum(int(g[0]) for r in rows for g in np.asarray(r["image_grid_thw"]).reshape(-1, 3))
    images = sum(len(r["images"]) for r in rows)
    print(f"{len(rows)} rows, {images} images, {tiles} tiles, max_patches {high}")
    assert images >= 4 and tiles > images  # several images, some of them more than one tile
    assert batch["pixel_values"].shape == (tiles, 3, SIDE, SIDE)
    packers.check_packing_safe(model, batch)
    with torch.no_grad():
        logits = model(**batch).logits
    per_example = packers.example_losses(logits, batch)
    proc = internvl_processor(hf_tokenizer, SIDE, ds.vision.min_tiles, ds.vision.max_tiles, PER_TILE)
    cu = batch["cu_seq_lens_q"].tolist()
    s, worst = 0, 0.0
    for row in rows:
        for j in range(len(row["example_ids"])):
            a, z = int(row["seq_offsets"][j]), int(row["seq_offsets"][j + 1])
            mine = [im for im, o in zip(row["images"], row["image_offsets"]) if a <= o < z]
            tokens = row["input_ids"][a:z].tolist()
            ref, kwargs = _reference(tokens, mine, ids, proc)
            assert ref == tokens, f"{row['example_ids'][j]}: the processor expands its images otherwise"
            alone_ids = torch.from_numpy(fold[np.asarray(ref)])[None]
            with torch.no_grad():
                alone = model(input_ids=alone_ids, use_cache=False, **kwargs).logits[0]
            diff = (logits[0, cu[s]:cu[s + 1]] - alone).abs().max().item()
            worst = max(worst, diff)
            assert diff <= TOL, f"{row['example_ids'][j]}: logits differ by {diff:.2e}"
            target = torch.tensor(row["loss_mask"][a:z], dtype=torch.bool)
            want = torch.nn.functional.cross_entropy(alone[:-1], alone_ids[0, 1:], reduction="none")[target[1:]].mean()
            assert abs(float(per_example.loss[s]) - float(want)) <= TOL, row["example_ids"][j]
            s += 1
    assert s == 10
    print(f"max logit diff {worst:.2e}")


def _tiny_spec(high: int = 4) -> VisionSpec:
    return VisionSpec(family=VisionFamily.INTERNVL, image_size=SIDE, min_tiles=1, max_tiles=high, tile_tokens=PER_TILE,
                      merge_size=1, temporal_patch_size=1, image_token="<IMG_CONTEXT>", vision_start="<img>",
                      vision_end="</img>", name="tiny")


def _examples(spec: VisionSpec, sizes: list[list[tuple[int, int]]]) -> list[dict]:
    """Examples of text and images (ids: <img> 1, <IMG_CONTEXT> 9, </img> 2), each image's run as packing makes it."""
    out = []
    for k, images in enumerate(sizes):
        ids, offsets, grids, refs = [3, 4 + k], [], [], []
        for j, (w, h) in enumerate(images):
            grid = spec.image_grid(w, h)
            ids.append(1)
            offsets.append(len(ids))
            ids += [9] * spec.grid_tokens(grid) + [2, 5 + j]
            grids.append(grid)
            refs.append({"path": None, "bytes": png(w, h, 10 * k + j)})
        ids += [6, 7, 8]
        out.append(dict(id=f"e{k}", ids=ids, mask=[0] * (len(ids) - 3) + [1, 1, 1], offsets=offsets, grids=grids,
                        images=refs))
    return out


def _alone(model: torch.nn.Module, ex: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """An example run alone, its pixels from transformers' GotOcr2 processor cropping as InternVLProcessor does."""
    import io

    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    kwargs = {}
    if ex["images"]:
        proc = GotOcr2ImageProcessorPil(size={"height": SIDE, "width": SIDE}, max_patches=4, **IMAGENET)
        pil = [PIL.open(io.BytesIO(r["bytes"])).convert("RGB") for r in ex["images"]]
        kwargs["pixel_values"] = proc(images=pil, crop_to_patches=True, return_tensors="pt")["pixel_values"]
    logits = model(input_ids=torch.tensor([ex["ids"]]), use_cache=False, **kwargs).logits[0]
    return logits, mean_target_loss(logits, ex)


SIZES = [[(60, 30), (30, 30)], [], [(20, 90)], [(100, 50), (40, 41)]]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_gradients_equal_the_sum_of_each_examples_alone(attn):
    """In train mode, the gradient of the summed per-example losses w.r.t. every parameter (InternViT tower,
    projector, Qwen2) from the packed batch equals the sum of each example's own."""
    spec = _tiny_spec()
    examples = _examples(spec, SIZES)
    model = _tiny_internvl(16, 9, attn).train()
    batch = Collator(vision=spec)([pack_row(examples[:2]), pack_row(examples[2:])])
    packed = gradients(model, packers.example_losses(model(**batch).logits, batch).loss.sum())
    summed = gradients(model, sum(_alone(model, ex)[1] for ex in examples))
    assert_same_gradients(packed, summed, tower="model.vision_tower.")


def test_the_images_matter_in_the_packed_batch():
    """The comparisons above can fail: the tiles moved by one (each image then sees its neighbour's) move every image
    example's logits, the text-only one's not at all."""
    spec = _tiny_spec()
    examples = _examples(spec, SIZES)
    batch = Collator(vision=spec)([pack_row(examples)])
    assert batch["pixel_values"].shape == (sum(g[0] for ex in examples for g in ex["grids"]), 3, SIDE, SIDE)
    model = _tiny_internvl(16, 9, "sdpa").eval()
    with torch.no_grad():
        exact = model(**batch).logits[0]
        moved = model(**{**batch, "pixel_values": batch["pixel_values"].roll(1, 0)}).logits[0]
    at = 0
    for ex in examples:
        n = len(ex["ids"])
        diff = (exact[at:at + n] - moved[at:at + n]).abs().max().item()
        assert (diff > 1e-3) if ex["images"] else diff == 0, (ex["id"], diff)
        at += n
