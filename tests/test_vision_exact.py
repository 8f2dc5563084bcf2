"""Packed vision-language batches are exact on tiny random Qwen2-VL and Qwen2.5-VL models (fp32, CPU).

Five examples (two text-only, one with two images) are packed into two rows, collated with
``Collator(vision=...)`` (the images decoded from PNG bytes and from a file), and run as one ``[1, T]`` batch; each
example is also run alone the way transformers would (``model(input_ids, pixel_values, image_grid_thw,
mm_token_type_ids)``, no position_ids: the model computes its mRoPE positions with ``get_rope_index``). Logits and
per-example losses agree to fp32 rounding, under eager and sdpa, in train and eval mode. The same batch with 1-D
position_ids (what the text Collator gives) leaks: Qwen2-VL builds the packed mask only from a 4-row position_ids.
"""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from packers import Collator, ContractError, VisionSpec, example_losses, mrope_positions
from tests._internals import VisionFamily

TOL = 1e-5
VOCAB, IMAGE, START, END = 128, 120, 121, 122
# Small pixel limits keep the images a few tokens each: 2 to 8 merged 28-pixel patches.
LIMITS = dict(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 8)
SPECS = {"qwen2-vl": VisionSpec(family=VisionFamily.QWEN2_VL, name="tiny-qwen2-vl", **LIMITS),
         "qwen2.5-vl": VisionSpec(family=VisionFamily.QWEN2_5_VL, name="tiny-qwen2.5-vl", **LIMITS)}
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            # head_dim 16: mrope_section sums to 16 / 2
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]})
IDS = dict(image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=123)


def tiny_vl(family: str, attn: str) -> torch.nn.Module:
    import transformers

    if family == "qwen2-vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                      temporal_patch_size=2, mlp_ratio=2)
        config, model = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
        config, model = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    cfg = config(text_config=TEXT, vision_config=vision, **IDS)
    torch.manual_seed(0)
    return model._from_config(cfg, attn_implementation=attn)


def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def make_examples(spec: VisionSpec, tmp_path) -> list[dict]:
    """Five examples: tokens, loss mask, and each image's reference, offset and grid (from the spec, as packing
    measures them). Image ``c1`` is a file; the others are PNG bytes."""
    sizes = {"a": (56, 56), "c0": (90, 50), "c1": (120, 60), "d": (30, 30)}
    refs = {k: {"path": None, "bytes": png(w, h, i)} for i, (k, (w, h)) in enumerate(sizes.items())}
    (tmp_path / "c1.png").write_bytes(refs["c1"]["bytes"])
    refs["c1"] = {"path": str(tmp_path / "c1.png"), "bytes": None}
    layouts = {  # text runs and images, in order
        "a": [[5, 9, 17], "a", [30, 31, 44, 8]],
        "b": [[3, 4, 5, 6, 7, 8]],
        "c": [[11, 12], "c0", [13], "c1", [14, 15, 16]],
        "d": [[40, 41], "d", [42]],
        "e": [[50, 51, 52, 53, 54]],
    }
    out = []
    for name, parts in layouts.items():
        ids, offsets, grids, images = [], [], [], []
        for p in parts:
            if isinstance(p, list):
                ids += p
                continue
            grid = spec.image_grid(*sizes[p])
            ids.append(START)
            offsets.append(len(ids))
            ids += [IMAGE] * spec.grid_tokens(grid)
            ids.append(END)
            grids.append(grid)
            images.append(refs[p])
        mask = [0] * (len(ids) - 3) + [1, 1, 1]  # the last three tokens are the completion
        out.append(dict(id=name, ids=ids, mask=mask, offsets=offsets, grids=grids, images=images))
    return out


def pack_row(examples: list[dict]) -> dict:
    """A packed row of ``examples`` back to back, as the pipeline writes it."""
    row = dict(input_ids=[], loss_mask=[], seq_offsets=[0], example_ids=[], image_offsets=[], image_grid_thw=[],
               images=[])
    for ex in examples:
        at = len(row["input_ids"])
        row["input_ids"] += ex["ids"]
        row["loss_mask"] += ex["mask"]
        row["seq_offsets"].append(len(row["input_ids"]))
        row["example_ids"].append(ex["id"])
        row["image_offsets"] += [at + o for o in ex["offsets"]]
        row["image_grid_thw"] += [v for g in ex["grids"] for v in g]
        row["images"] += ex["images"]
    return row


def alone(model: torch.nn.Module, spec: VisionSpec, ex: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One example's logits and mean loss over its targets (a 0-d tensor), run as transformers runs it (positions
    from the model)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from PIL import Image

    ids = torch.tensor([ex["ids"]])
    kwargs = {}
    if ex["images"]:
        processor = Qwen2VLImageProcessorPil(size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels})
        images = [Image.open(io.BytesIO(r["bytes"]) if r["bytes"] else r["path"]).convert("RGB") for r in ex["images"]]
        pixels = processor(images=images, return_tensors="pt")
        assert pixels["image_grid_thw"].tolist() == [list(g) for g in ex["grids"]]
        kwargs = dict(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                      mm_token_type_ids=(ids == IMAGE).int())
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0]
    return logits, mean_target_loss(logits, ex)


def mean_target_loss(logits: torch.Tensor, ex: dict) -> torch.Tensor:
    """An example's mean cross-entropy over its targets, from its ``[n, vocab]`` logits alone."""
    labels = torch.tensor(ex["ids"])
    target = torch.tensor(ex["mask"], dtype=torch.bool)
    losses = torch.nn.functional.cross_entropy(logits[:-1], labels[1:], reduction="none")
    return losses[target[1:]].mean()


def gradients(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """d loss / d every parameter, by name (a parameter the loss does not reach: zeros)."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}


def assert_same_gradients(packed: dict[str, torch.Tensor], alone: dict[str, torch.Tensor], tower: str) -> None:
    """Every parameter's gradient from the packed batch equals the sum over the examples alone (fp32 rounding:
    1e-5 relative, 1e-6 absolute), and the vision tower's (parameters named ``tower``...) is not all zero: the
    images reached the loss."""
    assert packed.keys() == alone.keys()
    for name in packed:
        torch.testing.assert_close(packed[name], alone[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert any(packed[n].abs().max() > 0 for n in packed if n.startswith(tower)), f"no gradient reached {tower}"


@pytest.fixture(scope="module")
def images_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("images")


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_packed_vision_batch_equals_each_example_alone(family, attn, mode, images_dir):
    from tests._internals import dropout_settings

    spec = SPECS[family]
    model = getattr(tiny_vl(family, attn), mode)()
    assert dropout_settings(model) == []  # train mode draws no dropout: packed and alone are comparable
    examples = make_examples(spec, images_dir)
    rows = [pack_row(examples[:3]), pack_row(examples[3:])]
    batch = Collator(vision=spec)(rows)
    assert batch["position_ids"].shape == (4, 1, sum(len(e["ids"]) for e in examples))
    assert batch["image_grid_thw"].tolist() == [list(g) for e in examples for g in e["grids"]]
    with torch.no_grad():
        packed = model(**batch).logits[0]
        losses = example_losses(packed[None], batch)
        at = 0
        for i, ex in enumerate(examples):
            logits, loss = alone(model, spec, ex)
            n = len(ex["ids"])
            assert (packed[at:at + n] - logits).abs().max().item() <= TOL, ex["id"]
            assert losses.loss[i].item() == pytest.approx(loss.item(), abs=TOL), ex["id"]
            at += n
    assert losses.ids == tuple(e["id"] for e in examples)


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_packed_gradients_equal_the_sum_of_each_examples_alone(family, images_dir):
    """Training on the packed batch is training on each example alone: the gradient of the summed per-example losses
    w.r.t. every parameter (vision tower, merger, language model) equals the sum of each example's own gradient."""
    spec = SPECS[family]
    model = tiny_vl(family, "sdpa").train()
    examples = make_examples(spec, images_dir)
    batch = Collator(vision=spec)([pack_row(examples[:3]), pack_row(examples[3:])])
    packed = gradients(model, example_losses(model(**batch).logits, batch).loss.sum())
    summed = gradients(model, sum(alone(model, spec, ex)[1] for ex in examples))
    assert_same_gradients(packed, summed, tower="model.visual.")


@pytest.mark.parametrize("rows", ["text [1, T]", "mrope [3, 1, T]"])
def test_positions_without_the_text_row_leak_on_qwen2_vl(rows, images_dir):
    """Without row 0 (the text positions) Qwen2-VL builds one causal mask over the whole batch: its text model reads
    the packed sequences only from a 4-row position_ids. With the text Collator's [1, T] positions (expanded to 3
    rows) every example after the first sees the ones before it, and every image also loses its 3-D positions;
    with the right mRoPE rows but no row 0, the first example is exact and the later ones see the earlier ones."""
    spec = SPECS["qwen2-vl"]
    model = tiny_vl("qwen2-vl", "sdpa").eval()
    examples = make_examples(spec, images_dir)
    batch = Collator(vision=spec)([pack_row(examples)])
    pos = batch["position_ids"][0] if rows.startswith("text") else batch["position_ids"][1:]
    with torch.no_grad():
        exact = model(**batch).logits[0]
        leaky = model(**{**batch, "position_ids": pos}).logits[0]
    n = len(examples[0]["ids"])
    if rows.startswith("mrope"):
        assert (exact[:n] - leaky[:n]).abs().max().item() <= TOL  # the first example has nothing before it
    assert (exact[n:] - leaky[n:]).abs().max().item() > 1e-2  # every later one attends to the ones before


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_mrope_positions_equal_get_rope_index(family):
    """Random examples (text runs and images of random grids, two images back to back among them): packstream's
    numpy positions equal the model's own ``get_rope_index`` of the example alone."""
    model = tiny_vl(family, "sdpa")
    rng = random.Random(7)
    for _ in range(30):
        ids, offsets, grids = [], [], []
        for _ in range(rng.randint(0, 3)):
            ids += [rng.randint(3, 100) for _ in range(rng.randint(0, 4))] + [START]
            grid = (1, 2 * rng.randint(1, 5), 2 * rng.randint(1, 5))
            offsets.append(len(ids))
            ids += [IMAGE] * (grid[1] * grid[2] // 4) + [END]
            grids.append(grid)
        ids += [rng.randint(3, 100) for _ in range(rng.randint(1, 4))]
        t = torch.tensor([ids])
        ours = mrope_positions(len(ids), offsets, grids, merge_size=2)
        if not grids:  # transformers computes a text-only example's positions without get_rope_index: 0, 1, ...
            assert ours.tolist() == [list(range(len(ids)))] * 3
            continue
        theirs, _ = model.model.get_rope_index(t, mm_token_type_ids=(t == IMAGE).int(),
                                               image_grid_thw=torch.tensor(grids))
        assert ours.tolist() == theirs[:, 0].tolist(), (offsets, grids)


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl"])
def test_touching_image_runs_are_refused(family):
    """Two images with no text token between: transformers' get_rope_index groups consecutive image tokens into one
    run (itertools.groupby over the token types) and gives it the first image's grid alone, so the example cannot
    run even by itself (it raises). The Collator refuses such a row, naming the image; with one token between the
    images it takes the row, and its positions are the model's."""
    model = tiny_vl(family, "sdpa")
    grids = [(1, 4, 4), (1, 4, 2)]  # 4 and 2 merged tokens
    touching = [5] + [IMAGE] * 4 + [IMAGE] * 2 + [6]
    t = torch.tensor([touching])
    with pytest.raises(RuntimeError, match="must match"):
        model.model.get_rope_index(t, mm_token_type_ids=(t == IMAGE).int(), image_grid_thw=torch.tensor(grids))

    images = [{"path": None, "bytes": png(56, 56, 0)}, {"path": None, "bytes": png(28, 56, 1)}]  # those grids

    def row(ids: list[int], offsets: list[int]) -> dict:
        return {"input_ids": ids, "loss_mask": [0] * (len(ids) - 1) + [1], "seq_offsets": [0, len(ids)],
                "image_offsets": offsets, "image_grid_thw": [v for g in grids for v in g], "images": images}

    with pytest.raises(ContractError, match=r"row 0, image 1: 2 placeholder tokens \(grid \(1, 4, 2\)\) at token 5 "
                                            r"start right where image 0 ends, with no text token between") as e:
        Collator(vision=SPECS[family], decode_images=False)([row(touching, [1, 5])])
    assert "\n" not in str(e.value)
    apart = [5] + [IMAGE] * 4 + [END] + [IMAGE] * 2 + [6]
    batch = Collator(vision=SPECS[family], decode_images=False)([row(apart, [1, 6])])
    t = torch.tensor([apart])
    theirs, _ = model.model.get_rope_index(t, mm_token_type_ids=(t == IMAGE).int(), image_grid_thw=torch.tensor(grids))
    assert batch["position_ids"][1:].tolist() == theirs.tolist()


def test_collated_mrope_rows_are_each_examples_own(images_dir):
    """Rows 1..3 of the batch's position_ids are, for each example, its positions alone; row 0 restarts at each."""
    spec = SPECS["qwen2-vl"]
    examples = make_examples(spec, images_dir)
    batch = Collator(vision=spec, decode_images=False)([pack_row(examples)])
    pos = batch["position_ids"][:, 0].numpy()
    at = 0
    for ex in examples:
        n = len(ex["ids"])
        assert pos[0, at:at + n].tolist() == list(range(n))
        assert pos[1:, at:at + n].tolist() == mrope_positions(n, ex["offsets"], ex["grids"], 2).tolist()
        at += n
