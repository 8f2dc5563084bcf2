"""Gemma 3 images (issue 45): one fixed square, counted and expanded exactly, packed and run against transformers'.

``VisionSpec`` of the Gemma 3 family counts what transformers' ``Gemma3Processor`` makes of an image (every image
resized to one square, ``image_seq_length`` ``<image_soft_token>`` tokens) and writes the text around it as the
processor does (each ``<start_of_image>`` becomes ``\\n\\n<start_of_image>`` + the soft tokens + ``<end_of_image>\\n\\n``
before tokenization): property tests hold the soft-token count, the ids of random text with images, the
``token_type_ids`` and the pixels equal to the processor's. End to end, generated records with 0-2 images are packed by
``packstream pack --processor <a Gemma 3 processor folder>``, loaded with ``PackedDataset``, collated with
``Collator(vision=ds.vision)`` (``token_type_ids``: 1 on the soft tokens) and run in train mode through a tiny random
``Gemma3ForConditionalGeneration`` (28-pixel images in 7-pixel patches pooled to 4 soft tokens; a sliding-window and
a full-attention layer) under ``install_packing_guard``; each example is also prepared by ``Gemma3Processor`` from its
own text and images and run alone: logits and per-example losses agree within 1e-5, eager and sdpa. Without the
guard transformers' sliding-window mask loses the image blocks of a row's later examples: refused in one line.
"""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

import packers
from packers import Collator, PackstreamError, PixelLoader, VisionSpec
from pipeline.cli import main
from tests._internals import VisionFamily, gemma_token_type_ids
from tests.test_vision_exact import assert_same_gradients, gradients, png
from tests.test_vision_end_to_end import _records as _shared_records
from tests.test_vision_pipeline import save_tokenizer

PIL = pytest.importorskip("PIL.Image")
TOL = 1e-5
BOI, SOFT, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
TOKENS = {"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT}
WORDS = "red square blue circle what colour shape is this describe the picture please answer".split()


def preprocessor(side: int = 896, seq: int | None = 256, **extra) -> dict:
    """preprocessor_config.json as google/gemma-3-4b-it ships it (do_convert_rgb and the pan-and-scan keys null)."""
    pre = {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
           "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True,
           "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
           "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
           "pan_and_scan_min_ratio_to_activate": None, "rescale_factor": 1 / 255,
           "size": {"height": side, "width": side}}
    return pre | ({} if seq is None else {"image_seq_length": seq}) | extra


def processor_folder(root: Path, pre: dict, seq: int | None = 256) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "preprocessor_config.json").write_text(json.dumps(pre))
    proc = {"processor_class": "Gemma3Processor"} | ({} if seq is None else {"image_seq_length": seq})
    (root / "processor_config.json").write_text(json.dumps(proc))
    return root


@pytest.fixture(scope="module")
def tok_folder(tmp_path_factory) -> str:
    return save_tokenizer(tmp_path_factory.mktemp("gemma3-tok"), [BOI, SOFT, EOI])


@pytest.fixture(scope="module")
def hf_tokenizer(tok_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_folder, extra_special_tokens=TOKENS)


def gemma_processor(hf_tokenizer, side: int, seq: int):
    """transformers' Gemma3Processor over its PIL image processor, set as a processor folder sets it."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    image = Gemma3ImageProcessorPil(size={"height": side, "width": side})
    return Gemma3Processor(image_processor=image, tokenizer=hf_tokenizer, image_seq_length=seq)


def expanded_ids(hf_tokenizer, spec: VisionSpec, text: str) -> list[int]:
    """What packstream makes of rendered ``text``: :meth:`VisionSpec.expand`, tokenized, each soft token repeated to
    the image's count (the packer's expansion)."""
    soft = hf_tokenizer.convert_tokens_to_ids(SOFT)
    out: list[int] = []
    for t in hf_tokenizer(spec.expand(text), add_special_tokens=False)["input_ids"]:
        out += [t] * (spec.image_tokens(1, 1) if t == soft else 1)
    return out


# -- the count, the text, the pixels -------------------------------------------------------------------------------

shapes = st.sampled_from([(28, 4), (28, 1), (56, 16), (56, 4), (896, 256)])
fragments = st.lists(st.sampled_from(["", " ", "\n", "\n\n", "\n\n\n", "a", " what", "is it?\n", "  x ", BOI]),
                     max_size=8)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(1, 300), height=st.integers(1, 300), shape=shapes, parts=fragments)
def test_tokens_text_and_pixels_equal_what_gemma3_processor_makes(tmp_path_factory, hf_tokenizer, width, height,
                                                                 shape, parts):
    """The spec read from a processor folder (random square side and image_seq_length) gives, for random text with
    images at random places (blank lines and spaces beside them): the processor's input_ids (its soft-token runs
    and the text around them, tokenized as it tokenizes them), its token_type_ids, and its pixel_values."""
    side, seq = shape
    spec = VisionSpec.from_processor(processor_folder(tmp_path_factory.mktemp("proc"), preprocessor(side, seq), seq))
    assert spec.family is VisionFamily.GEMMA3 and spec.image_tokens(width, height) == seq
    assert spec.image_grid(width, height) == (1, int(seq ** 0.5), int(seq ** 0.5))
    proc = gemma_processor(hf_tokenizer, side, seq)
    text = "".join(parts) + BOI + "end"  # at least one image
    n = text.count(BOI)
    refs = [{"path": None, "bytes": png(width + k, height, k)} for k in range(n)]
    images = [PIL.open(io.BytesIO(r["bytes"])).convert("RGB") for r in refs]
    out = proc(text=[text], images=[images], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    assert expanded_ids(hf_tokenizer, spec, text) == ids
    soft = hf_tokenizer.convert_tokens_to_ids(SOFT)
    starts = [i for i, t in enumerate(ids) if t == soft and (i == 0 or ids[i - 1] != soft)]
    assert len(starts) == n
    types = gemma_token_type_ids(len(ids), starts, [seq] * n)
    assert types.tolist() == out["token_type_ids"][0].tolist()
    pixels, grids = PixelLoader(vision=spec)(refs, [spec.image_grid(width + k, height) for k in range(n)])
    assert pixels.shape == out["pixel_values"].shape == (n, 3, side, side)
    assert torch.allclose(pixels, out["pixel_values"], atol=1e-6)


def test_the_shipped_spec_is_gemma3_it():
    """``gemma3``: 896-pixel squares, 256 soft tokens (16 x 16), the same spec as read from google's configs."""
    spec = VisionSpec.builtin("gemma3")
    assert spec.image_tokens(640, 480) == spec.image_tokens(1, 5000) == 256
    assert spec.image_grid(640, 480) == (1, 16, 16) and spec.resized(640, 480) == (896, 896)
    assert (spec.image_token, spec.vision_start, spec.vision_end) == (SOFT, BOI, EOI)
    assert spec.placeholder == BOI and spec.expand(f"x{BOI}y") == f"x\n\n{BOI}{SOFT}{EOI}\n\ny"
    assert not spec.family.mrope and spec.family.square
    assert VisionSpec.from_json(spec.to_json()) == spec


def test_the_folder_gemma3_it_ships_reads_as_the_shipped_spec(tmp_path):
    spec = VisionSpec.from_processor(processor_folder(tmp_path, preprocessor()))
    assert spec == dataclasses.replace(VisionSpec.builtin("gemma3"), name=str(tmp_path))
    bare = VisionSpec.from_processor(processor_folder(tmp_path / "b", preprocessor(seq=None), seq=None))
    assert bare.image_tokens(10, 10) == 256  # Gemma3Processor's default image_seq_length


# -- refusals ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, seq, message", [
    ({"do_pan_and_scan": True}, 256, r"do_pan_and_scan is true, expected false or null: pan-and-scan adds crops"),
    ({"size": {"height": 896, "width": 448}}, 256, r"size.height 896 and size.width 448 differ, expected a square"),
    ({"size": {"shortest_edge": 896}}, 256, r"size.height is missing"),
    ({}, 255, r"image_seq_length 255 .*is not a square number whose side divides the image side 896"),
    ({"size": {"height": 900, "width": 900}}, 256, r"is not a square number whose side divides the image side 900"),
    ({"image_mean": [0.485, 0.456, 0.406]}, 256, r"image_mean is \[0.485, 0.456, 0.406\], expected \[0.5, 0.5, 0.5\]"),
    ({"resample": 3}, 256, r"resample is 3, expected 2"),
    ({"do_normalize": False}, 256, r"do_normalize is false, expected true"),
    ({"processor_class": "PaliGemmaProcessor"}, 256, r"image processor Gemma3ImageProcessor of PaliGemmaProcessor is "
                                                     r"not one packstream counts"),
])
def test_unverified_settings_are_refused_in_one_line(tmp_path, change, seq, message):
    pre = preprocessor(seq=seq) | change
    with pytest.raises(PackstreamError, match=message) as e:
        folder = processor_folder(tmp_path, pre, seq)
        if "processor_class" in change:
            (folder / "processor_config.json").write_text(json.dumps(change | {"image_seq_length": seq}))
        VisionSpec.from_processor(folder)
    text = str(e.value)
    assert "\n" not in text and ("--processor gemma3" in text or "Shipped" in text), text


@pytest.mark.parametrize("model, message", [
    ({"model_type": "gemma3", "mm_tokens_per_image": 64}, r"mm_tokens_per_image is 64, the processor's is 256"),
    ({"model_type": "gemma3", "vision_config": {"image_size": 448}}, r"vision_config.image_size is 448, the "
                                                                    r"processor's is 896"),
])
def test_a_model_config_that_disagrees_with_the_processor_is_refused(tmp_path, model, message):
    folder = processor_folder(tmp_path, preprocessor())
    (folder / "config.json").write_text(json.dumps(model))
    with pytest.raises(PackstreamError, match=message):
        VisionSpec.from_processor(folder)
    (folder / "config.json").write_text(json.dumps({"model_type": "gemma3", "mm_tokens_per_image": 256,
                                                    "vision_config": {"image_size": 896, "patch_size": 14}}))
    assert VisionSpec.from_processor(folder).image_tokens(5, 5) == 256


def test_pixel_limits_are_refused_for_gemma3():
    with pytest.raises(PackstreamError, match=r"resizes every image to one 896x896 square, so no pixel limit"):
        VisionSpec.builtin("gemma3").with_pixel_limits(max_pixels=768 * 768)


def test_image_pixel_limit_options_are_refused_for_gemma3(tmp_path, tok_folder):
    data = tmp_path / "r.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "yo"}]}) + "\n")
    result = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", tok_folder, "--processor", "gemma3",
                                       "--image-max-pixels", "589824", "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code != 0 and "no pixel limit applies" in result.output, result.output


# -- end to end --------------------------------------------------------------------------------------------------

SIDE, PATCH, PER_IMAGE, WINDOW = 28, 7, 4, 8  # 4 x 4 patches pooled 2 x 2: 4 soft tokens; an 8-token window


def _records(root: Path, n: int, seed: int) -> Path:
    return _shared_records(root, n, seed, sides=(4, 120))


def tiny_gemma3(vocab: int, ids: dict[str, int], attn: str) -> torch.nn.Module:
    """A tiny random Gemma 3: SigLIP at 28 pixels in 7-pixel patches, pooled to 4 soft tokens; a sliding-window
    layer (8 tokens) and a full-attention one. The projector and the norms (zeros at init) are drawn at random, so
    that the images and every layer count."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=4096, sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention"], pad_token_id=0, bos_token_id=None,
                eos_token_id=None)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=SIDE,
                  patch_size=PATCH)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=PER_IMAGE,
                       image_token_index=ids[SOFT], boi_token_index=ids[BOI], eoi_token_index=ids[EOI])
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration._from_config(cfg, attn_implementation=attn)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_()
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    return model


def _reference(tokens: list[int], images: list[dict], hf_tokenizer, proc) -> dict:
    """One packed example prepared by Gemma3Processor: its tokens decoded to text, each image's sequence put back to
    the ``<start_of_image>`` a chat template writes, then the processor run on that text and the image files."""
    text = hf_tokenizer.decode(tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    text = text.replace(f"\n\n{BOI}{SOFT * PER_IMAGE}{EOI}\n\n", BOI)
    pil = [PIL.open(im["path"]).convert("RGB") for im in images]
    return proc(text=[text], images=[pil] if pil else None, return_tensors="pt")


def _pack(tmp_path: Path, tok_folder: str, seed: int, n: int = 10, extra: tuple = ()) -> packers.PackedDataset:
    folder = processor_folder(tmp_path / "proc", preprocessor(SIDE, PER_IMAGE), PER_IMAGE)
    data = _records(tmp_path, n, seed)
    out = tmp_path / "out"
    budget = int(np.random.default_rng(seed).integers(150, 260))
    result = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", tok_folder, "--processor", str(folder),
                                       "--max-tokens", str(budget), "-o", str(out), "-q", *extra])
    assert result.exit_code == 0, result.output
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["examples_packed"] == n and counts["rejected"] == 0, counts
    return packers.PackedDataset(out)


def _folded(rows: list[dict], hf_tokenizer) -> tuple[np.ndarray, dict[str, int]]:
    """Every id the rows and the image tokens use, renumbered 0..n-1 (a tiny vocabulary for the tiny model)."""
    ids = {t: hf_tokenizer.convert_tokens_to_ids(t) for t in (BOI, SOFT, EOI)}
    used = sorted({int(t) for r in rows for t in r["input_ids"]} | set(ids.values()))
    fold = np.zeros(max(used) + 1, np.int64)
    fold[used] = np.arange(len(used)) + 1  # 0 stays the pad id
    return fold, {k: int(fold[v]) for k, v in ids.items()}


@pytest.mark.parametrize("attn, seed", [("sdpa", 0), ("eager", 1), ("sdpa", 2)])
def test_packed_gemma3_records_equal_each_record_prepared_by_transformers(tmp_path, tok_folder, hf_tokenizer,
                                                                          attn, seed):
    ds = _pack(tmp_path, tok_folder, seed)
    assert ds.vision.family is VisionFamily.GEMMA3 and ds.vision.image_tokens(1, 1) == PER_IMAGE
    rows = ds.fetch(range(len(ds.rows)))
    fold, ids = _folded(rows, hf_tokenizer)
    model = tiny_gemma3(int(fold.max()) + 1, ids, attn).train()
    batch = Collator(vision=ds.vision)([{**r, "input_ids": fold[r["input_ids"]]} for r in rows])
    images = sum(len(r["images"]) for r in rows)
    assert images >= 4 and batch["pixel_values"].shape == (images, 3, SIDE, SIDE)
    assert batch["token_type_ids"].shape == batch["input_ids"].shape
    assert torch.equal(batch["token_type_ids"][0] == 1, batch["input_ids"][0] == ids[SOFT])
    later = [r for r in rows if any(o >= r["seq_offsets"][1] for o in r["image_offsets"])]
    assert later, "no image outside a row's first example: the case transformers' own masks get wrong"
    with packers.install_packing_guard(model):
        logits = model(**batch).logits
    per_example = packers.example_losses(logits, batch)
    proc = gemma_processor(hf_tokenizer, SIDE, PER_IMAGE)
    cu = batch["cu_seq_lens_q"].tolist()
    s, worst = 0, 0.0
    for row in rows:
        for j in range(len(row["example_ids"])):
            a, z = int(row["seq_offsets"][j]), int(row["seq_offsets"][j + 1])
            mine = [im for im, o in zip(row["images"], row["image_offsets"]) if a <= o < z]
            tokens = row["input_ids"][a:z].tolist()
            ref = _reference(tokens, mine, hf_tokenizer, proc)
            assert ref["input_ids"][0].tolist() == tokens, f"{row['example_ids'][j]}: the processor writes it otherwise"
            alone_ids = torch.from_numpy(fold[np.asarray(tokens)])[None]
            kwargs = {"token_type_ids": ref["token_type_ids"]}
            if mine:
                kwargs["pixel_values"] = ref["pixel_values"]
            alone = model(input_ids=alone_ids, use_cache=False, **kwargs).logits[0].detach()
            diff = (logits[0, cu[s]:cu[s + 1]] - alone).abs().max().item()
            worst = max(worst, diff)
            assert diff <= TOL, f"{row['example_ids'][j]}: logits differ by {diff:.2e}"
            target = torch.tensor(row["loss_mask"][a:z], dtype=torch.bool)
            want = torch.nn.functional.cross_entropy(alone[:-1], alone_ids[0, 1:], reduction="none")[target[1:]].mean()
            assert abs(float(per_example.loss[s].detach()) - float(want)) <= TOL, row["example_ids"][j]
            s += 1
    assert s == 10
    print(f"{len(rows)} rows, {images} images, max logit diff {worst:.2e}")


def _batch_and_model(tmp_path, tok_folder, hf_tokenizer, attn="sdpa"):
    ds = _pack(tmp_path, tok_folder, 0)
    rows = ds.fetch(range(len(ds.rows)))
    fold, ids = _folded(rows, hf_tokenizer)
    model = tiny_gemma3(int(fold.max()) + 1, ids, attn).train()
    return Collator(vision=ds.vision)([{**r, "input_ids": fold[r["input_ids"]]} for r in rows]), model


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_image_blocks_matter_and_plain_masks_are_refused(tmp_path, tok_folder, hf_tokenizer, attn):
    """The comparison above can fail: without token_type_ids (causal images) the image examples' logits move; the
    plain model(**batch), whose sliding-window masks transformers builds from positions, moves them too and is
    refused by check_packing_safe in one line, as is a batch with pixels but no token_type_ids."""
    batch, model = _batch_and_model(tmp_path, tok_folder, hf_tokenizer, attn)
    with torch.no_grad(), packers.install_packing_guard(model):
        exact = model(**batch).logits
    with torch.no_grad():
        plain = model(**batch).logits
        causal = model(**{k: v for k, v in batch.items() if k != "token_type_ids"}).logits
    assert (plain - exact).abs().max() > 1e-3 and (causal - exact).abs().max() > 1e-3
    with pytest.raises(PackstreamError, match=r"image blocks from each example's positions .* "
                                              r"install_packing_guard\(model\) builds those masks exactly") as e:
        packers.check_packing_safe(model, batch)
    assert "\n" not in str(e.value)
    with pytest.raises(PackstreamError, match=r"has pixel_values but no token_type_ids, so its images would be "
                                              r"causal"):
        packers.check_packing_safe(model, {k: v for k, v in batch.items() if k != "token_type_ids"})
    with packers.install_packing_guard(model):
        packers.check_packing_safe(model, batch)  # guarded: the forward builds them exactly


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_gradients_equal_the_sum_of_each_examples_alone(tmp_path, tok_folder, hf_tokenizer, attn):
    """In train mode, under the guard, the gradient of the summed per-example losses w.r.t. every parameter (SigLIP
    tower, projector, Gemma 3) from the packed batch equals the sum of each example's own, prepared by
    Gemma3Processor."""
    ds = _pack(tmp_path, tok_folder, 3, n=6)
    rows = ds.fetch(range(len(ds.rows)))
    fold, ids = _folded(rows, hf_tokenizer)
    model = tiny_gemma3(int(fold.max()) + 1, ids, attn).train()
    batch = Collator(vision=ds.vision)([{**r, "input_ids": fold[r["input_ids"]]} for r in rows])
    with packers.install_packing_guard(model):
        packed = gradients(model, packers.example_losses(model(**batch).logits, batch).loss.sum())
    proc = gemma_processor(hf_tokenizer, SIDE, PER_IMAGE)
    total = torch.zeros(())
    for row in rows:
        for j in range(len(row["example_ids"])):
            a, z = int(row["seq_offsets"][j]), int(row["seq_offsets"][j + 1])
            mine = [im for im, o in zip(row["images"], row["image_offsets"]) if a <= o < z]
            ref = _reference(row["input_ids"][a:z].tolist(), mine, hf_tokenizer, proc)
            alone_ids = torch.from_numpy(fold[ref["input_ids"][0].numpy()])[None]
            kwargs = {"token_type_ids": ref["token_type_ids"]} | ({"pixel_values": ref["pixel_values"]} if mine else {})
            logits = model(input_ids=alone_ids, use_cache=False, **kwargs).logits[0]
            target = torch.tensor(row["loss_mask"][a + 1:z], dtype=torch.bool)
            total = total + torch.nn.functional.cross_entropy(logits[:-1], alone_ids[0, 1:], reduction="none")[
                target].mean()
    assert_same_gradients(packed, gradients(model, total), tower="model.vision_tower.")


def test_rows_with_images_only_in_their_first_example_need_no_fix():
    """transformers' own masks are exact for a row's first example, so a plain forward of such a batch passes the
    rule; an image in a later example does not."""
    from tests._internals import later_images as _later_images

    types = torch.tensor([[0, 1, 1, 0, 0, 0, 0]])
    assert not _later_images(types, torch.tensor([[0, 1, 2, 3, 0, 1, 2]]))
    assert _later_images(types.roll(4, 1), torch.tensor([[0, 1, 2, 3, 0, 1, 2]]))


def test_image_pairs_pack_and_collate_with_token_type_ids(tmp_path, tok_folder):
    """--pairs with Gemma 3 images: the prompt's image stands in both sides; both carry its soft tokens."""
    (tmp_path / "a.png").write_bytes(png(40, 30, 2))
    prompt = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                           {"type": "text", "text": "what is it?"}]}]
    record = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "a square"}],
              "rejected": [{"role": "assistant", "content": "a circle"}]}
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(record) + "\n")
    result = CliRunner().invoke(main, ["pack", str(data), "--pairs", "--tokenizer", tok_folder, "--processor",
                                       "gemma3", "--max-tokens", "2048", "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code == 0, result.output
    ds = packers.PackedDataset(tmp_path / "out")
    rows = ds.fetch(range(len(ds.rows)))
    batch = Collator(vision=ds.vision, decode_images=False)(rows)
    assert int(batch["token_type_ids"].sum()) == 2 * 256
