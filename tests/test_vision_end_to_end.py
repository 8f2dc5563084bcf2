"""The whole product path on images, against transformers' own: records -> ``packstream pack --processor`` ->
``PackedDataset`` -> ``Collator(vision=ds.vision)`` -> a tiny random Qwen2-VL, compared with each record prepared
the way transformers prepares it.

For every packed example, the reference is built without packstream's vision code: the example's tokens with each
image's placeholder run cut back to the single ``<|image_pad|>`` the chat template writes, then expanded the way
``Qwen2VLProcessor`` expands it (``image_grid_thw.prod() // merge**2`` copies, the grid from transformers' image
processor run on the image file itself), and run alone with the processor's ``pixel_values`` and the model's own
``get_rope_index`` positions. The packed tokens must equal that expansion exactly, and the packed batch's logits and
per-example losses must equal the example's alone (1e-5), for generated records: images of random sizes and
counts (0-2 per record), random text, random budgets.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import packers
from pipeline.cli import main
from tests.test_vision_pipeline import VISION_TOKENS, save_tokenizer, tokenizer  # noqa: F401 - tokenizer: a fixture

PIL = pytest.importorskip("PIL.Image")
TOL = 1e-5
MAX_PIXELS = 28 * 28 * 12  # a few dozen tokens per image keep the model's sequences short on CPU
WORDS = "red square blue circle what colour shape is this describe the picture please answer".split()


def _processor_folder(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "min_pixels": 28 * 28 * 2, "max_pixels": MAX_PIXELS, "patch_size": 14, "merge_size": 2,
        "temporal_patch_size": 2}))
    return root


def _records(root: Path, n: int, seed: int, sides: tuple[int, int] = (8, 400)) -> Path:
    """``n`` OpenAI-style records, each 0-2 PNGs of random sizes in ``sides`` (aspect at most 150) placed among random
    text; the shared generator of the families' end-to-end tests."""
    rng = np.random.default_rng(seed)
    lines = []
    for r in range(n):
        parts = []
        for k in range(int(rng.integers(0, 3))):
            w, h = int(rng.integers(*sides)), int(rng.integers(*sides))
            if max(w, h) / min(w, h) > 150:
                w = h
            path = root / f"r{r}_{k}.png"
            PIL.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
            parts.append({"type": "image_url", "image_url": {"url": path.name}})
        parts.insert(int(rng.integers(0, len(parts) + 1)),
                     {"type": "text", "text": " ".join(rng.choice(WORDS, int(rng.integers(1, 12))))})
        lines.append({"id": f"r{r}", "messages": [
            {"role": "user", "content": parts},
            {"role": "assistant", "content": " ".join(rng.choice(WORDS, int(rng.integers(1, 8))))}]})
    path = root / "records.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def folded_qwen2_vl(rows: list[dict], tokenizer: str, attn: str) -> tuple[torch.nn.Module, np.ndarray, int]:
    """A tiny Qwen2-VL over the ids ``rows`` use, the 129k vocabulary folded onto them (the same computation): the
    model, the fold (old id -> new) and the image pad token's old id."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    start, pad, end = (tok.convert_tokens_to_ids(t) for t in VISION_TOKENS)
    used = sorted({int(t) for r in rows for t in r["input_ids"]} | {start, pad, end})
    fold = np.zeros(max(used) + 1, np.int64)
    fold[used] = np.arange(len(used))
    model = _tiny_qwen2_vl(len(used) + 1, {"image_token_id": int(fold[pad]), "vision_start_token_id": int(fold[start]),
                                           "vision_end_token_id": int(fold[end])}, attn).eval()
    return model, fold, pad


def _tiny_qwen2_vl(vocab: int, ids: dict[str, int], attn: str) -> torch.nn.Module:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, mlp_ratio=2)
    torch.manual_seed(0)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, video_token_id=vocab - 1, **ids)
    return Qwen2VLForConditionalGeneration._from_config(cfg, attn_implementation=attn)


def _reference(tokens: list[int], mask: list[int], images: list[dict], pad: int, processor) -> dict:
    """One packed example rebuilt the transformers way: its image runs cut to one pad each, then expanded by the
    processor's rule from the processor's own grid for each image file."""
    collapsed = [t for i, t in enumerate(tokens) if t != pad or i == 0 or tokens[i - 1] != pad]
    pil = [PIL.open(im["path"]).convert("RGB") for im in images]
    out = processor(images=pil, return_tensors="pt") if pil else None
    ids: list[int] = []
    k = 0
    for t in collapsed:
        if t == pad:
            ids += [pad] * (int(out["image_grid_thw"][k].prod()) // 4)
            k += 1
        else:
            ids.append(t)
    assert k == len(images)
    return {"ids": ids, "mask": mask, "pixels": out}


@pytest.mark.parametrize("attn, seed", [("sdpa", 0), pytest.param("eager", 1, marks=pytest.mark.slow),
                                        pytest.param("sdpa", 2, marks=pytest.mark.slow),
                                        pytest.param("eager", 3, marks=pytest.mark.slow)])
def test_packed_records_equal_each_record_prepared_by_transformers(tmp_path, tokenizer, attn, seed):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    data = _records(tmp_path, 14, seed)
    out = tmp_path / "out"
    budget = int(np.random.default_rng(seed).integers(300, 700))
    result = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", tokenizer, "--processor",
                                       str(_processor_folder(tmp_path / "proc")), "--max-tokens", str(budget),
                                       "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["examples_packed"] == 14 and manifest["counts"]["rejected"] == 0

    ds = packers.PackedDataset(out)
    rows = ds.fetch(range(len(ds.rows)))
    model, fold, pad = folded_qwen2_vl(rows, tokenizer, attn)
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": ds.vision.min_pixels,
                                               "longest_edge": ds.vision.max_pixels})

    batch = packers.Collator(vision=ds.vision)([{**r, "input_ids": fold[r["input_ids"]]} for r in rows])
    packers.check_packing_safe(model, batch)
    with torch.no_grad():
        logits = model(**batch).logits[0]
    cu = batch["cu_seq_lens_q"].tolist()
    with torch.no_grad():
        per_example = packers.example_losses(model(**batch).logits, batch)
    assert list(per_example.ids) == [e for r in rows for e in r["example_ids"]]
    examples = [(r, j) for r in rows for j in range(len(r["example_ids"]))]
    assert len(examples) == len(cu) - 1 == 14

    for s, (row, j) in enumerate(examples):
        a, z = int(row["seq_offsets"][j]), int(row["seq_offsets"][j + 1])
        offs = np.asarray(row["image_offsets"])
        mine = [im for im, o in zip(row["images"], offs) if a <= o < z]
        ref = _reference(row["input_ids"][a:z].tolist(), row["loss_mask"][a:z].tolist(), mine, pad, processor)
        assert ref["ids"] == row["input_ids"][a:z].tolist(), f"example {row['example_ids'][j]}: expansion differs"
        ids = torch.from_numpy(fold[np.asarray(ref["ids"])])[None]
        kwargs = {}
        if ref["pixels"] is not None:
            kwargs = dict(pixel_values=ref["pixels"]["pixel_values"], image_grid_thw=ref["pixels"]["image_grid_thw"],
                          mm_token_type_ids=(ids == int(fold[pad])).int())
        with torch.no_grad():
            alone = model(input_ids=ids, use_cache=False, **kwargs).logits[0]
        diff = (logits[cu[s]:cu[s + 1]] - alone).abs().max().item()
        assert diff <= TOL, f"example {row['example_ids'][j]}: logits differ by {diff:.2e}"
        labels, target = ids[0], torch.tensor(ref["mask"], dtype=torch.bool)
        want = torch.nn.functional.cross_entropy(alone[:-1], labels[1:], reduction="none")[target[1:]].mean()
        got = per_example.loss[s]
        assert abs(float(got) - float(want)) <= TOL, f"example {row['example_ids'][j]}: loss {got} vs {want}"


def test_llava_records_packed_by_the_job_equal_each_record_alone(tmp_path):
    """LLaVA-format records (``image`` beside ``conversations`` with ``<image>`` in the first turn, and LLaMA-Factory
    ``images`` + ``<image>``) packed by ``packstream pack --processor <a LLaVA processor folder>``, loaded and
    collated with ``Collator(vision=ds.vision)``: each image is the processor's fixed run of ``<image>`` tokens, and
    a tiny LLaVA's logits on the packed batch equal each record's alone (pixels from transformers' LLaVA processor)."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    tok = AutoTokenizer.from_pretrained(save_tokenizer(tmp_path / "tok", ["<image>"]))
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor",
        "crop_size": {"height": 42, "width": 42}, "size": {"shortest_edge": 42}}))
    (proc / "processor_config.json").write_text(json.dumps({
        "image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
        "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"}))
    rng = np.random.default_rng(5)
    lines = []
    for r in range(8):
        n = int(rng.integers(0, 3))
        names = []
        for k in range(n):
            names.append(f"l{r}_{k}.png")
            PIL.fromarray(rng.integers(0, 256, (int(rng.integers(20, 120)), int(rng.integers(20, 120)), 3),
                                       dtype=np.uint8)).save(tmp_path / names[-1])
        question = "<image>\n" * n + " ".join(rng.choice(WORDS, int(rng.integers(1, 8))))
        answer = " ".join(rng.choice(WORDS, int(rng.integers(1, 6))))
        if r % 2:
            lines.append({"images": names, "messages": [{"role": "user", "content": question},
                                                        {"role": "assistant", "content": answer}]})
        else:
            lines.append({**({"image": names if n != 1 else names[0]} if n else {}), "conversations": [
                {"from": "human", "value": question}, {"from": "gpt", "value": answer}]})
    data = tmp_path / "llava.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", str(tmp_path / "tok"), "--processor",
                                       str(proc), "--max-tokens", "400", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["counts"]["examples_packed"] == 8

    image = tok.convert_tokens_to_ids("<image>")
    ds = packers.PackedDataset(out)
    assert ds.vision.image_tokens(640, 480) == 9
    rows = ds.fetch(range(len(ds.rows)))
    used = sorted({int(t) for r in rows for t in r["input_ids"]} | {image})
    fold = np.zeros(max(used) + 1, np.int64)
    fold[used] = np.arange(len(used))
    text = dict(model_type="llama", vocab_size=len(used) + 1, hidden_size=32, intermediate_size=64,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=42, patch_size=14, projection_dim=32)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=int(fold[image]),
                                   image_seq_length=9, vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration._from_config(cfg, attn_implementation="sdpa").eval()
    batch = packers.Collator(vision=ds.vision)([{**r, "input_ids": fold[r["input_ids"]]} for r in rows])
    packers.check_packing_safe(model, batch)
    with torch.no_grad():
        logits = model(**batch).logits[0]
    processor = LlavaImageProcessorPil(size={"shortest_edge": 42}, crop_size={"height": 42, "width": 42})
    cu = batch["cu_seq_lens_q"].tolist()
    s = 0
    for row in rows:
        for j in range(len(row["example_ids"])):
            a, z = int(row["seq_offsets"][j]), int(row["seq_offsets"][j + 1])
            mine = [im for im, o in zip(row["images"], row["image_offsets"]) if a <= o < z]
            ids = row["input_ids"][a:z]
            assert int((ids == image).sum()) == 9 * len(mine)  # each image the processor's 9 tokens
            kwargs = {}
            if mine:
                kwargs["pixel_values"] = processor(images=[PIL.open(im["path"]).convert("RGB") for im in mine],
                                                   return_tensors="pt")["pixel_values"]
            with torch.no_grad():
                alone = model(input_ids=torch.from_numpy(fold[ids])[None], use_cache=False, **kwargs).logits[0]
            diff = (logits[cu[s]:cu[s + 1]] - alone).abs().max().item()
            assert diff <= TOL, f"{row['example_ids'][j]}: logits differ by {diff:.2e}"
            s += 1
    assert s == 8
