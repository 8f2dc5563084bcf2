"""Image preference pairs (issue 45): ``packstream pack --pairs --processor`` packs each pair's two sides with the
prompt's images in both, and DPO on the packed rows equals DPO on each pair alone on a tiny random Qwen2-VL.

The reference for each side is built without packstream's vision code (``tests/test_vision_end_to_end.py``'s
``_reference``): the side's tokens with each image run cut back to one ``<|image_pad|>`` and expanded by the
processor's own grid for the image file, run alone with the processor's ``pixel_values`` and the model's own
``get_rope_index`` positions; its completion log-prob summed by hand; the DPO loss (sigmoid, beta 0.1) per pair from
those sums, against a reference model.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import packers
from pipeline.cli import main
from tests.test_vision_end_to_end import WORDS, _processor_folder, _reference, _tiny_qwen2_vl
from tests.test_vision_pipeline import VISION_TOKENS, tokenizer  # noqa: F401 - tokenizer: a fixture

PIL = pytest.importorskip("PIL.Image")
TOL = 1e-5
BETA = 0.1


def _pair_records(root: Path, n: int, seed: int) -> Path:
    """``n`` pairs in three layouts (TRL's vision DPO: ``images`` + ``{"type": "image"}`` parts in ``prompt``;
    inline ``image_url`` parts; LLaMA-Factory: ``images`` + ``<image>`` in ``conversations`` with ``chosen``/
    ``rejected`` answers), 0-2 images of random sizes each."""
    rng = np.random.default_rng(seed)
    lines = []
    for r in range(n):
        names = []
        for k in range(int(rng.integers(0, 3))):
            w, h = int(rng.integers(8, 300)), int(rng.integers(8, 300))
            names.append(f"p{r}_{k}.png")
            PIL.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / names[-1])
        words = " ".join(rng.choice(WORDS, int(rng.integers(1, 10))))
        chosen, rejected = (" ".join(rng.choice(WORDS, int(rng.integers(1, 8)))) for _ in range(2))
        layout = r % 3
        if layout == 0:
            prompt = [{"role": "user", "content": [{"type": "image"} for _ in names] + [{"type": "text", "text": words}]}]
            lines.append({"id": f"p{r}", "images": names, "prompt": prompt,
                          "chosen": [{"role": "assistant", "content": chosen}],
                          "rejected": [{"role": "assistant", "content": rejected}]})
        elif layout == 1:
            parts = [{"type": "image_url", "image_url": {"url": x}} for x in names]
            lines.append({"id": f"p{r}", "prompt": [{"role": "user", "content": parts + [{"type": "text", "text": words}]}],
                          "chosen": [{"role": "assistant", "content": chosen}],
                          "rejected": [{"role": "assistant", "content": rejected}]})
        else:
            lines.append({"id": f"p{r}", "images": names,
                          "conversations": [{"from": "human", "value": "<image>" * len(names) + words}],
                          "chosen": {"from": "gpt", "value": chosen}, "rejected": {"from": "gpt", "value": rejected}})
    path = root / "pairs.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def _side_logp(model, ref: dict, ids: torch.Tensor, span: tuple[int, int], pad: int) -> torch.Tensor:
    """The completion log-prob (tokens ``span``) of one side run alone, as transformers prepares it."""
    kwargs = {}
    if ref["pixels"] is not None:
        kwargs = dict(pixel_values=ref["pixels"]["pixel_values"], image_grid_thw=ref["pixels"]["image_grid_thw"],
                      mm_token_type_ids=(ids == pad).int())
    logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0].double()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    a, z = span
    return logp[a - 1:z - 1].sum()


@pytest.mark.parametrize("attn, seed", [pytest.param("sdpa", 0, marks=pytest.mark.slow), ("eager", 1)])
def test_dpo_on_packed_image_pairs_equals_each_pair_alone(tmp_path, tokenizer, attn, seed):  # noqa: F811
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    data = _pair_records(tmp_path, 9, seed)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(data), "--pairs", "--tokenizer", tokenizer, "--processor",
                                       str(_processor_folder(tmp_path / "proc")), "--max-tokens", "700",
                                       "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["rejected"] == 0

    tok = AutoTokenizer.from_pretrained(tokenizer)
    start, pad, end = (tok.convert_tokens_to_ids(t) for t in VISION_TOKENS)
    ds = packers.PackedDataset(out)
    rows = ds.fetch(range(len(ds.rows)))
    used = sorted({int(t) for r in rows for t in r["input_ids"]} | {start, pad, end})
    fold = np.zeros(max(used) + 1, np.int64)
    fold[used] = np.arange(len(used))
    ids_map = {"image_token_id": int(fold[pad]), "vision_start_token_id": int(fold[start]),
               "vision_end_token_id": int(fold[end])}
    policy = _tiny_qwen2_vl(len(used) + 1, ids_map, attn).eval()
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 7)
        for p in reference.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": ds.vision.min_pixels,
                                               "longest_edge": ds.vision.max_pixels})

    batch = packers.Collator(vision=ds.vision)([{**r, "input_ids": fold[r["input_ids"]]} for r in rows])
    assert batch["pair_index"].shape[0] == 9
    with torch.no_grad():
        lp_pol = packers.sequence_logps(policy(**batch).logits, batch)
        lp_ref = packers.sequence_logps(reference(**batch).logits, batch)
    packed_loss = -torch.nn.functional.logsigmoid(
        BETA * ((lp_pol.chosen - lp_ref.chosen) - (lp_pol.rejected - lp_ref.rejected)))

    alone: dict[str, list[float]] = {}
    for row in rows:
        offs, spans = np.asarray(row["seq_offsets"]), np.asarray(row["completion_spans"]).reshape(-1, 2)
        images_at = np.asarray(row["image_offsets"])
        for j, eid in enumerate(row["example_ids"]):
            a, z = int(offs[j]), int(offs[j + 1])
            mine = [im for im, o in zip(row["images"], images_at) if a <= o < z]
            tokens = row["input_ids"][a:z].tolist()
            ref = _reference(tokens, row["loss_mask"][a:z].tolist(), mine, pad, processor)
            assert ref["ids"] == tokens, f"side {eid}: the image expansion differs from the processor's"
            ids = torch.from_numpy(fold[np.asarray(ref["ids"])])[None]
            span = (int(spans[j, 0]) - a, int(spans[j, 1]) - a)
            with torch.no_grad():
                d = float(_side_logp(policy, ref, ids, span, int(fold[pad])) -
                          _side_logp(reference, ref, ids, span, int(fold[pad])))
            alone.setdefault(eid.rsplit("#", 1)[0], []).append(d)
    assert len(alone) == 9 and all(len(v) == 2 for v in alone.values())
    images_per_pair = {}
    for row in rows:
        for j, eid in enumerate(row["example_ids"]):
            a, z = int(row["seq_offsets"][j]), int(row["seq_offsets"][j + 1])
            images_per_pair.setdefault(eid.rsplit("#", 1)[0], []).append(
                sum(a <= o < z for o in np.asarray(row["image_offsets"])))
    assert any(c[0] > 0 for c in images_per_pair.values()), "no pair carried an image"
    assert all(c[0] == c[1] for c in images_per_pair.values()), "a pair's sides hold different images"
    wants = []
    for k, pid in enumerate(lp_pol.pair_ids):
        c, r = alone[pid]
        want = -torch.nn.functional.logsigmoid(torch.tensor(BETA * (c - r), dtype=torch.float64))
        wants.append(float(want))
        assert abs(float(packed_loss[k]) - float(want)) <= TOL, f"pair {pid}: DPO loss {packed_loss[k]} vs {want}"
        got_c = float(lp_pol.chosen[k] - lp_ref.chosen[k])
        assert abs(got_c - c) <= 1e-4, f"pair {pid}: chosen log-ratio {got_c} vs {c}"
    if attn == "sdpa":  # the user's path: PackedDPOTrainer on the folder, its collator built from ds.vision
        _trainer_loss_is_the_pairs_mean(tmp_path, out, policy, reference, fold, float(np.mean(wants)))


def _trainer_loss_is_the_pairs_mean(tmp_path, out, policy, reference, fold, want: float) -> None:
    trl = pytest.importorskip("trl")
    ds = packers.PackedDataset(out, sampling=packers.Sampling(shuffle=False),
                               batching=packers.Batching(batch_by="rows", batch_size=len(packers.PackedDataset(out).rows)))
    vision = packers.Collator(vision=ds.vision)

    def folded(rows):  # the tiny model's vocabulary: the same computation on fewer ids
        return vision([{**r, "input_ids": fold[np.asarray(r["input_ids"])]} for r in rows])

    config = trl.DPOConfig(output_dir=str(tmp_path / "t"), max_steps=1,
                           learning_rate=0.0, optim="sgd", logging_steps=1, save_strategy="no", report_to="none",
                           use_cpu=True, beta=BETA, loss_type=["sigmoid"], max_length=None, disable_dropout=True,
                           dataloader_num_workers=0)
    with pytest.raises(packers.PackstreamError, match="KL term pairs each prompt with another example's completion"):
        packers.PackedKTOTrainer(policy, trl.KTOConfig(output_dir=str(tmp_path / "k"), report_to="none", use_cpu=True,
                                                       max_length=None),
                                 ds, ref_model=reference)
    trainer = packers.PackedDPOTrainer(policy.train(), config, ds, ref_model=reference, collator=folded)
    trainer.train()
    got = next(h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h)
    assert abs(got - want) <= 1e-4 * max(1.0, abs(want)), f"trainer loss {got} vs the pairs alone {want}"


def test_images_in_an_answer_or_differing_between_sides_are_refused(tmp_path, tokenizer):  # noqa: F811
    PIL.new("RGB", (60, 40), "red").save(tmp_path / "a.png")
    PIL.new("RGB", (40, 60), "blue").save(tmp_path / "b.png")
    part = lambda name: {"type": "image_url", "image_url": {"url": name}}  # noqa: E731
    records = [
        {"id": "in_answer", "prompt": [{"role": "user", "content": "look"}],
         "chosen": [{"role": "assistant", "content": [part("a.png"), {"type": "text", "text": "this"}]}],
         "rejected": [{"role": "assistant", "content": "no"}]},
        {"id": "differ", "chosen": [{"role": "user", "content": [part("a.png"), {"type": "text", "text": "q"}]},
                                    {"role": "assistant", "content": "x"}],
         "rejected": [{"role": "user", "content": [part("b.png"), {"type": "text", "text": "q"}]},
                      {"role": "assistant", "content": "y"}]},
        {"id": "ok", "prompt": [{"role": "user", "content": [part("a.png"), {"type": "text", "text": "q"}]}],
         "chosen": [{"role": "assistant", "content": "x"}], "rejected": [{"role": "assistant", "content": "y"}]},
    ]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = CliRunner().invoke(main, ["pack", str(data), "--pairs", "--processor", "qwen2-vl", "--tokenizer",
                                       tokenizer, "-o", str(tmp_path / "o"), "-q", "--max-reject-fraction", "1"])
    assert result.exit_code == 0, result.output
    dead = {json.loads(x)["example_id"].split(":")[-1]: json.loads(x)
            for x in (tmp_path / "o" / "rejected.jsonl").read_text().splitlines()}
    assert dead["in_answer"]["reason"] == "non_text_content" and "shared prompt only" in dead["in_answer"]["detail"]
    assert dead["differ"]["reason"] == "pair_prompt_mismatch" and "different images" in dead["differ"]["detail"]
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["counts"]["examples_packed"] == 1
