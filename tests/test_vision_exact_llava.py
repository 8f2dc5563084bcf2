"""Packed LLaVA-1.5 batches are exact on a tiny random ``LlavaForConditionalGeneration`` (CLIP tower, Llama, fp32, CPU).

LLaVA's language model rotates by 1-D positions, and every image is one fixed run of ``<image>`` tokens: (42 / 14)^2 =
9 patches here, with the CLS feature dropped (``vision_feature_select_strategy="default"``, the spec's
``extra_tokens=0``) or kept (``"full"``, ``extra_tokens=1``: 10 tokens). Five examples (two text-only, one with two
images apart, one with two images back to back, one with one image) are packed into two rows, collated with
``Collator(vision=spec)`` (``[1, T]`` positions, ``pixel_values [5, 3, 42, 42]``; images of several sizes, from PNG
bytes and from a file, resized and cropped to 42 x 42) and run as one batch; each example is also run alone the way
transformers would (``model(input_ids, pixel_values)``, the pixels from the PIL LLaVA processor). Logits, per-example
losses and gradients agree to fp32 rounding, under eager and sdpa, in train and eval mode; the packing guard passes
the batch, and refuses it where the vision tower would get the text's boundaries.
"""

from __future__ import annotations

import io

import pytest
import torch

from packers import (Collator, ContractError, PackstreamError, PixelLoader, VisionSpec, check_packing_safe,
                     example_losses)
from tests._internals import VisionFamily, cached_verdict, dropout_settings
from tests.test_vision_exact import TOL, assert_same_gradients, gradients, mean_target_loss, pack_row, png

VOCAB, IMAGE = 128, 120
SIDE, PATCH = 42, 14
STRATEGIES = {"default": 0, "full": 1}  # vision_feature_select_strategy -> the spec's extra_tokens (the CLS feature)
TEXT = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
VISION = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, image_size=SIDE, patch_size=PATCH, projection_dim=32)


def tiny_spec(strategy: str = "default") -> VisionSpec:
    """The spec of the tiny tower: 42-pixel squares in 14-pixel patches, 9 tokens (10 with the CLS feature)."""
    return VisionSpec(family=VisionFamily.LLAVA, name=f"tiny-llava-{strategy}", image_size=SIDE, patch_size=PATCH,
                      merge_size=1, temporal_patch_size=1, extra_tokens=STRATEGIES[strategy], image_token="<image>",
                      vision_start=None, vision_end=None)


def tiny_llava(attn: str, strategy: str = "default") -> torch.nn.Module:
    import transformers

    spec = tiny_spec(strategy)
    cfg = transformers.LlavaConfig(vision_config=VISION, text_config=TEXT, image_token_id=IMAGE,
                                   image_seq_length=spec.image_tokens(SIDE, SIDE), vision_feature_layer=-2,
                                   vision_feature_select_strategy=strategy)
    assert cfg.image_token_index == IMAGE  # LlavaConfig maps image_token_id onto image_token_index
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration._from_config(cfg, attn_implementation=attn)


SIZES = {"a": (56, 40), "c0": (90, 50), "c1": (30, 90), "d0": (42, 42), "d1": (100, 100)}
LAYOUTS = {  # text runs and images, in order
    "a": [[5, 9, 17], "a", [30, 31, 44, 8]],
    "b": [[3, 4, 5, 6, 7, 8]],
    "c": [[11, 12], "c0", [13], "c1", [14, 15, 16]],
    "d": [[40, 41], "d0", "d1", [42, 43, 44]],  # two images back to back: LLaVA fills <image> tokens in order
    "e": [[50, 51, 52, 53, 54]],
}


def make_examples(spec: VisionSpec, tmp_path) -> list[dict]:
    """Five examples: tokens, loss mask, and each image's reference, offset and grid (the spec's one square grid, as
    packing measures it). Image ``c1`` is a file; the others are PNG bytes."""
    refs = {k: {"path": None, "bytes": png(w, h, i)} for i, (k, (w, h)) in enumerate(SIZES.items())}
    (tmp_path / "c1.png").write_bytes(refs["c1"]["bytes"])
    refs["c1"] = {"path": str(tmp_path / "c1.png"), "bytes": None}
    out = []
    for name, parts in LAYOUTS.items():
        ids, offsets, grids, images = [], [], [], []
        for p in parts:
            if isinstance(p, list):
                ids += p
                continue
            grid = spec.image_grid(*SIZES[p])
            offsets.append(len(ids))
            ids += [IMAGE] * spec.grid_tokens(grid)
            grids.append(grid)
            images.append(refs[p])
        mask = [0] * (len(ids) - 3) + [1, 1, 1]  # the last three tokens are the completion
        out.append(dict(id=name, ids=ids, mask=mask, offsets=offsets, grids=grids, images=images))
    return out


def alone(model: torch.nn.Module, ex: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One example's logits and mean target loss, run as transformers runs it: its pixels from the PIL LLaVA
    processor at the tower's size, no position_ids (the model numbers the tokens 0, 1, ...)."""
    from PIL import Image
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    kwargs = {}
    if ex["images"]:
        processor = LlavaImageProcessorPil(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
        images = [Image.open(io.BytesIO(r["bytes"]) if r["bytes"] else r["path"]).convert("RGB") for r in ex["images"]]
        kwargs["pixel_values"] = processor(images=images, return_tensors="pt")["pixel_values"]
    logits = model(input_ids=torch.tensor([ex["ids"]]), use_cache=False, **kwargs).logits[0]
    return logits, mean_target_loss(logits, ex)


@pytest.fixture(scope="module")
def images_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("images")


def packed_batch(spec: VisionSpec, images_dir, **collator) -> tuple[dict, list[dict]]:
    examples = make_examples(spec, images_dir)
    return Collator(vision=spec, **collator)([pack_row(examples[:3]), pack_row(examples[3:])]), examples


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_packed_llava_batch_equals_each_example_alone(strategy, attn, mode, images_dir):
    spec = tiny_spec(strategy)
    model = getattr(tiny_llava(attn, strategy), mode)()
    assert dropout_settings(model) == []  # train mode draws no dropout: packed and alone are comparable
    batch, examples = packed_batch(spec, images_dir)
    total = sum(len(e["ids"]) for e in examples)
    # 1-D positions, one [3, 42, 42] square per image in token order, no grids (LlavaForConditionalGeneration
    # takes none): every image is 9 (10) tokens.
    assert batch["position_ids"].shape == (1, total) and "image_grid_thw" not in batch
    assert batch["pixel_values"].shape == (5, 3, SIDE, SIDE)
    assert int((batch["input_ids"] == IMAGE).sum()) == 5 * (9 + STRATEGIES[strategy])
    with torch.no_grad():
        packed = model(**batch).logits[0]
        losses = example_losses(packed[None], batch)
        at = 0
        for i, ex in enumerate(examples):
            logits, loss = alone(model, ex)
            n = len(ex["ids"])
            assert (packed[at:at + n] - logits).abs().max().item() <= TOL, ex["id"]
            assert losses.loss[i].item() == pytest.approx(loss.item(), abs=TOL), ex["id"]
            at += n
    assert losses.ids == tuple(e["id"] for e in examples)


def test_the_images_matter_and_stay_with_their_examples(images_dir):
    """The comparison above can fail: the same batch with its images' order reversed (each example then sees
    another's image) moves every image example's logits, the text-only ones not at all."""
    spec = tiny_spec()
    model = tiny_llava("sdpa").eval()
    batch, examples = packed_batch(spec, images_dir)
    with torch.no_grad():
        exact = model(**batch).logits[0]
        swapped = model(**{**batch, "pixel_values": batch["pixel_values"].flip(0)}).logits[0]
    at = 0
    for ex in examples:
        n = len(ex["ids"])
        moved = (exact[at:at + n] - swapped[at:at + n]).abs().max().item()
        assert (moved > 1e-3) if ex["images"] else (moved == 0), (ex["id"], moved)
        at += n


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_gradients_equal_the_sum_of_each_examples_alone(attn, images_dir):
    """The gradient of the summed per-example losses w.r.t. every parameter (CLIP tower, projector, Llama) from the
    packed batch equals the sum of each example's own gradient."""
    model = tiny_llava(attn).train()
    batch, examples = packed_batch(tiny_spec(), images_dir)
    packed = gradients(model, example_losses(model(**batch).logits, batch).loss.sum())
    summed = gradients(model, sum(alone(model, ex)[1] for ex in examples))
    assert_same_gradients(packed, summed, tower="model.vision_tower.")


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_guard_passes_the_packed_llava_batch(mode, images_dir):
    """LLaVA has no 3-D positions: the guard's text rules and its (text-only) probe decide, and find it exact."""
    model = getattr(tiny_llava("sdpa"), mode)()
    batch, _ = packed_batch(tiny_spec(), images_dir)
    check_packing_safe(model, batch)
    verdict = cached_verdict(model, batch)
    assert verdict is not None and verdict.error is None and verdict.diff < 1e-5


def test_the_vision_tower_gets_the_texts_boundaries(images_dir):
    """Why the guard refuses a varlen vision tower beside cu_seq_lens: transformers hands the forward's keyword
    arguments on to every CLIPAttention of the tower (seen here with a hook on one)."""
    model = tiny_llava("sdpa").eval()
    batch, _ = packed_batch(tiny_spec(), images_dir)
    seen = []
    attention = next(m for m in model.model.vision_tower.modules() if type(m).__name__ == "CLIPAttention")
    attention.register_forward_pre_hook(lambda m, args, kwargs: seen.append(set(kwargs)), with_kwargs=True)
    with torch.no_grad():
        model(**batch)
    assert seen and {"cu_seq_lens_q", "max_length_q"} <= seen[0]


@pytest.mark.parametrize("leak, message", [
    ("flash vision tower", r"vision tower runs under attn_implementation='flash_attention_2'.*"
                           r"return_flash_attn_kwargs=False"),
    ("use_cache", r"use_cache on"),
    ("attention_mask", r"packed batch with an attention_mask"),
])
def test_guard_refuses_a_packed_llava_batch_that_would_leak(leak, message, images_dir):
    model = tiny_llava("sdpa").train()
    batch, _ = packed_batch(tiny_spec(), images_dir)
    if leak == "flash vision tower":  # refused from the config: no GPU needed
        model.config.vision_config._attn_implementation = "flash_attention_2"
    elif leak == "use_cache":
        batch["use_cache"] = True
    else:
        batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    with pytest.raises(PackstreamError, match=message) as e:
        check_packing_safe(model, batch)
    assert "\n" not in str(e.value)
    if leak == "flash vision tower":  # without the text's boundaries in the batch it passes the rule
        model.config.vision_config._attn_implementation = "sdpa"
        check_packing_safe(model, packed_batch(tiny_spec(), images_dir, return_flash_attn_kwargs=False)[0])


def test_a_row_packed_for_another_llava_size_is_refused(images_dir):
    """Every image of a LLaVA spec has the one grid of its square: a row packed for 28-pixel images (grid (1, 2, 2),
    4 tokens) is refused by the 42-pixel spec, naming the grid it expects."""
    small = VisionSpec(family=VisionFamily.LLAVA, name="llava-28", image_size=28, patch_size=PATCH, merge_size=1,
                       temporal_patch_size=1)
    row = pack_row(make_examples(small, images_dir))
    with pytest.raises(ContractError, match=r"row 0, image 0: 4 placeholder tokens \(grid \(1, 2, 2\)\) at token 3: "
                                            r"every image of the vision spec tiny-llava-default \(image_size 42, patch "
                                            r"14\) has grid \(1, 3, 3\), 9 tokens") as e:
        Collator(vision=tiny_spec())([row])
    assert "\n" not in str(e.value)


def test_a_processor_set_to_another_size_is_refused(images_dir):
    """The pixels must be the spec's square: a processor cropping to 28 pixels would give 4 image features per
    image where the rows hold 9 tokens."""
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    spec = tiny_spec()
    other = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    with pytest.raises(ContractError, match=r"row 0 image 0 \(example 'a'\) \(and every image beside it\) decodes to "
                                            r"28x28 pixels, the spec tiny-llava-default has image_size 42"):
        packed_batch(spec, images_dir, pixels=PixelLoader(vision=spec, processor=other))


def test_the_builtin_llava_spec_decodes_336_pixel_squares():
    """``VisionSpec.builtin("llava-1.5")``: 576 <image> tokens per image, pixels [n, 3, 336, 336] (CLIP's resize of
    the short side to 336 and centre crop, as llava-hf/llava-1.5-*-hf's processor)."""
    spec = VisionSpec.builtin("llava-1.5")
    grid = spec.image_grid(640, 480)
    row = {"input_ids": [5] + [IMAGE] * 576 + [6, 7], "loss_mask": [0] * 577 + [1, 1], "seq_offsets": [0, 579],
           "image_offsets": [1], "image_grid_thw": list(grid), "images": [{"path": None, "bytes": png(640, 480, 3)}]}
    batch = Collator(vision=spec)([row])
    assert grid == (1, 24, 24) and batch["pixel_values"].shape == (1, 3, 336, 336)
    assert batch["position_ids"].tolist() == [list(range(579))] and "image_grid_thw" not in batch
