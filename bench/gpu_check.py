"""GPU exactness check: packed batches on flash_attention_2 and on the torch varlen backend, bf16.

    python bench/gpu_check.py [--json out.json]

The CPU tests (tests/test_exactness.py) hold eager/sdpa to 1e-5 in fp32; this is the same check
for the CUDA-only backends, at bf16 tolerance. For tiny random Llama, Qwen2 and Mistral configs
(head_dim 64, GQA; Mistral also with a 48-token sliding window), in train() mode with the default
config, each backend runs a packed batch of 7 examples (Collator, two rows of budget 512) and
each example alone, on the same bf16 weights:

* logits and per-token loss: max abs diff, packed vs alone (same backend);
* gradients of the summed loss: max abs diff relative to the largest gradient.

Tolerance: 4x the error that bf16 itself makes here (sdpa bf16 alone vs fp32 eager alone), at
least 2e-2 on logits/loss and 5e-2 on gradients. A cross-example leak is ~0.2-0.8 on the logits,
and the script shows it catches one (sdpa with use_cache on in the batch), and that the packing guard's
probe refuses, at bf16 on this device, a model made to leak where the batch does not show it.

Vision-language rows (``check_vision``): a tiny random Qwen2-VL (bf16) on each backend, five examples (two with
images, one with two) packed into two rows by ``Collator(vision=...)`` ([4, 1, T] positions, pixel_values), against
each example run alone as transformers runs it. Two layouts: with ``cu_seq_lens`` (which transformers also hands
to the vision tower: the packing guard refuses that layout on a flash/varlen tower, and this check measures whether
the refusal is needed) and ``return_flash_attn_kwargs=False`` (the text boundaries from position_ids row 0 only).

A backend that cannot run here is reported as not checked, with why ("not checked: flash-attn not
installed", "not checked: torch 2.9 has no torch.nn.attention.varlen"), and is not a pass. Exit
status: 0 when every backend was checked and passed, 1 when a check failed, 2 when nothing failed
but something was not checked (a backend, or everything without CUDA).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packers import Collator, PackstreamError, check_packing_safe, register_varlen_attention  # noqa: E402

DEVICE = "cuda"  # a module constant so the script's logic can be dry-run on CPU with a reference kernel
VOCAB = 1000
BUDGET = 512
LENGTHS = [[200, 37, 120, 90], [300, 1, 150]]  # two rows of BUDGET; the 1-token example has no target
MODELS = {"llama": {}, "qwen2": {}, "mistral": {}, "mistral-window48": {"sliding_window": 48}}


def make_model(kind: str, attn: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    base = kind.split("-")[0]
    cfg_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                          "mistral": (MistralConfig, MistralForCausalLM)}[base]
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  attn_implementation=attn, **MODELS[kind])
    torch.manual_seed(0)
    model = model_cls(cfg)  # same seed -> same weights for every backend
    return model.to(device=DEVICE, dtype=dtype).train()


def data():
    g = torch.Generator().manual_seed(1)
    rows, examples = [], []
    for lens in LENGTHS:
        ids, mask, offs = [], [], [0]
        for n in lens:
            x = torch.randint(2, VOCAB, (n,), generator=g).tolist()
            m = [0] * (n // 3) + [1] * (n - n // 3)
            examples.append((x, m))
            ids, mask = ids + x, mask + m
            offs.append(len(ids))
        rows.append({"input_ids": ids, "loss_mask": mask, "seq_offsets": offs})
    return rows, examples


def to_device(batch: dict) -> dict:
    return {k: (v.to(DEVICE) if torch.is_tensor(v) else v) for k, v in batch.items()}


def per_token(logits, labels):
    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="none")


def alone_labels(x, m):
    lab = torch.tensor([t if b else -100 for t, b in zip(x, m)])
    lab[0] = -100
    return lab.to(DEVICE)


def run_alone(model, examples):
    """Per-example logits and per-token losses, and the summed gradients, each example alone."""
    model.zero_grad()
    outs = []
    for x, m in examples:
        logits = model(input_ids=torch.tensor([x], device=DEVICE)).logits[0]
        tok = per_token(logits, alone_labels(x, m))
        tok.sum().backward()
        outs.append((logits.detach().float(), tok.detach()))
    return outs, [p.grad.detach().float().clone() for p in model.parameters()]


def run_packed(model, batch):
    model.zero_grad()
    logits = model(**batch).logits[0]
    tok = per_token(logits, batch["labels"][0])
    tok.sum().backward()
    return logits.detach().float(), tok.detach(), [p.grad.detach().float().clone() for p in model.parameters()]


def compare(alone, alone_grads, packed, starts: list[int]):
    logits, tok, grads = packed
    d_logits = d_loss = 0.0
    for (a_logits, a_tok), s in zip(alone, starts):
        n = a_logits.shape[0]
        d_logits = max(d_logits, (a_logits - logits[s : s + n]).abs().max().item())
        if n > 1:
            d_loss = max(d_loss, (a_tok - tok[s : s + n - 1]).abs().max().item())
    scale = max(g.abs().max().item() for g in alone_grads)
    d_grad = max((g - h).abs().max().item() for g, h in zip(alone_grads, grads)) / scale
    return d_logits, d_loss, d_grad


def starts_of(batch) -> list[int]:
    return batch["cu_seq_lens_q"].tolist()[:-1]


def check_model(kind: str, backends: dict[str, str | None]) -> list[dict]:
    rows, examples = data()
    results = []
    # bf16's own error on this model: sdpa bf16 alone vs fp32 eager alone.
    ref, _ = run_alone(make_model(kind, "eager", torch.float32), examples)
    base, _ = run_alone(make_model(kind, "sdpa", torch.bfloat16), examples)
    bf16_err = max((a[0] - b[0]).abs().max().item() for a, b in zip(ref, base))
    tol_logits = max(4 * bf16_err, 2e-2)
    layouts = {"packed": Collator(), "packed, fixed_shape": Collator(fixed_shape=True, budget=BUDGET),
               "packed, position_ids only": Collator(return_flash_attn_kwargs=False)}
    for backend, why_not in backends.items():
        if why_not:
            results.append({"model": kind, "backend": backend, "status": why_not})
            continue
        model = make_model(kind, backend, torch.bfloat16)
        alone, alone_grads = run_alone(model, examples)
        for layout, collate in layouts.items():
            if layout == "packed, position_ids only" and backend == "sdpa":
                continue  # the same as "packed" for sdpa, which ignores cu_seq_lens
            row = {"model": kind, "backend": backend, "layout": layout}
            try:
                batch = to_device(collate(rows))
                check_packing_safe(model, batch)
                d = compare(alone, alone_grads, run_packed(model, batch), _real_starts(batch, layout))
                ok = d[0] <= tol_logits and d[1] <= tol_logits and d[2] <= 5e-2
                row.update(logits=d[0], loss=d[1], grad_rel=d[2], tol_logits=tol_logits, status="ok" if ok else "FAIL")
            except Exception as e:  # report and go on: one broken case must not hide the others
                traceback.print_exc()
                row["status"] = f"FAIL: {type(e).__name__}: {e}"[:200]
            results.append(row)
    # The check must be able to see a leak: sdpa with the KV cache on skips the packed mask.
    model = make_model(kind, "sdpa", torch.bfloat16)
    alone, alone_grads = run_alone(model, examples)
    leaky = to_device(Collator(disable_cache=False)(rows))
    d = compare(alone, alone_grads, run_packed(model, {**leaky, "use_cache": True}), starts_of(leaky))
    results.append({"model": kind, "backend": "sdpa, use_cache=True (must leak)", "layout": "packed", "logits": d[0],
                    "loss": d[1], "grad_rel": d[2], "tol_logits": tol_logits,
                    "status": "ok (leak seen)" if d[0] > tol_logits else "FAIL: leak not detected"})
    # The guard's probe must refuse a model that leaks where nothing in the batch shows it, at bf16 on this
    # device: a pre-hook drops position_ids before the decoder stack (no packed mask, positions 0..T-1).
    model = make_model(kind, "sdpa", torch.bfloat16)
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: (args, {k: v for k, v in kwargs.items() if k != "position_ids"}), with_kwargs=True)
    row = {"model": kind, "backend": "sdpa, position_ids dropped inside (guard must refuse)", "layout": "packed"}
    try:
        check_packing_safe(model, to_device(Collator()(rows)))
        row["status"] = "FAIL: the guard's probe let a leaking model through"
    except PackstreamError as e:
        row["status"] = "ok (refused)"
        print(f"  {kind}: refused as it should: {str(e)[:160]}")
    results.append(row)
    return results


VISION_IDS = {"image_token_id": 120, "vision_start_token_id": 121, "vision_end_token_id": 122, "video_token_id": 123}


def make_vision_model(attn: str, dtype: torch.dtype):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 8, 8]})
    vision = dict(depth=2, embed_dim=128, hidden_size=256, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, mlp_ratio=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, **VISION_IDS)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration._from_config(cfg, attn_implementation=attn)
    return model.to(device=DEVICE, dtype=dtype).train()


def vision_data():
    """Five examples (token ids, loss mask, image offsets, grids, PNG bytes) in two rows, and the spec."""
    import io

    import numpy as np
    from PIL import Image

    from packers import VisionFamily, VisionSpec

    spec = VisionSpec(family=VisionFamily.QWEN2_VL, name="gpu-check", min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64)
    rng = np.random.default_rng(2)
    g = torch.Generator().manual_seed(3)
    layouts = [[60, (140, 90), 30], [80], [20, (60, 200), 10, (300, 120), 40], [150], [10, (90, 90), 70]]
    examples = []
    for parts in layouts:
        ids, offsets, grids, images = [], [], [], []
        for part in parts:
            if isinstance(part, int):
                ids += torch.randint(2, 120, (part,), generator=g).tolist()
                continue
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (part[1], part[0], 3), dtype=np.uint8)).save(buf, format="PNG")
            grid = spec.image_grid(*part)
            ids.append(VISION_IDS["vision_start_token_id"])
            offsets.append(len(ids))
            ids += [VISION_IDS["image_token_id"]] * spec.grid_tokens(grid)
            ids.append(VISION_IDS["vision_end_token_id"])
            grids.append(grid)
            images.append({"path": None, "bytes": buf.getvalue()})
        mask = [0] * (len(ids) // 2) + [1] * (len(ids) - len(ids) // 2)
        examples.append({"ids": ids, "mask": mask, "offsets": offsets, "grids": grids, "images": images})
    rows = []
    for chunk in (examples[:3], examples[3:]):
        row = {"input_ids": [], "loss_mask": [], "seq_offsets": [0], "image_offsets": [], "image_grid_thw": [],
               "images": []}
        for ex in chunk:
            at = len(row["input_ids"])
            row["input_ids"] += ex["ids"]
            row["loss_mask"] += ex["mask"]
            row["seq_offsets"].append(len(row["input_ids"]))
            row["image_offsets"] += [at + o for o in ex["offsets"]]
            row["image_grid_thw"] += [v for grid in ex["grids"] for v in grid]
            row["images"] += ex["images"]
        rows.append(row)
    return spec, rows, examples


def run_vision_alone(model, spec, examples):
    from packers import PixelLoader

    pixels = PixelLoader(vision=spec)
    model.zero_grad()
    outs = []
    for ex in examples:
        ids = torch.tensor([ex["ids"]], device=DEVICE)
        kwargs = {}
        if ex["images"]:
            pv, grid = pixels(ex["images"], ex["grids"])
            kwargs = dict(pixel_values=pv.to(DEVICE, model.dtype), image_grid_thw=grid.to(DEVICE),
                          mm_token_type_ids=(ids == VISION_IDS["image_token_id"]).int())
        logits = model(input_ids=ids, use_cache=False, **kwargs).logits[0]
        tok = per_token(logits, alone_labels(ex["ids"], ex["mask"]))
        tok.sum().backward()
        outs.append((logits.detach().float(), tok.detach()))
    return outs, [p.grad.detach().float().clone() for p in model.parameters()]


def check_vision(backends: dict[str, str | None]) -> list[dict]:
    """Packed Qwen2-VL rows vs each example alone, per backend and layout (see the module docstring)."""
    spec, rows, examples = vision_data()
    ref, _ = run_vision_alone(make_vision_model("eager", torch.float32), spec, examples)
    base, _ = run_vision_alone(make_vision_model("sdpa", torch.bfloat16), spec, examples)
    tol_logits = max(4 * max((a[0] - b[0]).abs().max().item() for a, b in zip(ref, base)), 2e-2)
    layouts = {"packed": Collator(vision=spec),
               "packed, position_ids only": Collator(vision=spec, return_flash_attn_kwargs=False)}
    results = []
    for backend, why_not in backends.items():
        if why_not:
            results.append({"model": "qwen2-vl", "backend": backend, "status": why_not})
            continue
        model = make_vision_model(backend, torch.bfloat16)
        alone, alone_grads = run_vision_alone(model, spec, examples)
        for layout, collate in layouts.items():
            row = {"model": "qwen2-vl", "backend": backend, "layout": layout}
            try:
                batch = to_device(collate(rows))
                batch["pixel_values"] = batch["pixel_values"].to(model.dtype)
                try:
                    check_packing_safe(model, batch)
                    guard = None
                except PackstreamError as e:
                    guard = str(e)
                d = compare(alone, alone_grads, run_packed(model, batch), starts_of(batch) if "cu_seq_lens_q" in batch
                            else (batch["position_ids"][0, 0] == 0).nonzero().flatten().tolist())
                exact = d[0] <= tol_logits and d[1] <= tol_logits and d[2] <= 5e-2
                if guard is None:
                    status = "ok" if exact else "FAIL: the guard passed a batch that leaks"
                else:  # measured anyway: is the refusal needed?
                    status = f"ok (refused by the guard; measured {'exact' if exact else 'a leak'})"
                row.update(logits=d[0], loss=d[1], grad_rel=d[2], tol_logits=tol_logits, status=status)
            except Exception as e:  # noqa: BLE001 - report and go on
                traceback.print_exc()
                row["status"] = f"FAIL: {type(e).__name__}: {e}"[:200]
            results.append(row)
    return results


def _real_starts(batch, layout: str) -> list[int]:
    """Start of each real example in the flattened batch (fixed_shape adds one padding sequence per row)."""
    if layout == "packed, position_ids only":
        pos = batch["position_ids"][0]
        return (pos == 0).nonzero().flatten().tolist()
    starts, at = [], 0
    for lens in LENGTHS:
        for n in lens:
            starts.append(at)
            at += n
        if layout == "packed, fixed_shape":
            at += BUDGET - sum(lens)
    return starts


def backends() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    out["flash_attention_2"] = None if importlib.util.find_spec("flash_attn") else "not checked: flash-attn not installed"
    try:
        import torch.nn.attention.varlen  # noqa: F401

        out[register_varlen_attention()] = None
    except ImportError:
        out["packstream_varlen"] = f"not checked: torch {torch.__version__} has no torch.nn.attention.varlen (needs >= 2.10)"
    out["sdpa"] = None  # bf16 reference point
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("not checked: no CUDA device")
        return 2
    print(f"{torch.cuda.get_device_name() if DEVICE == 'cuda' else DEVICE} | torch {torch.__version__}")
    torch.backends.cuda.matmul.allow_tf32 = False
    results = [r for kind in MODELS for r in check_model(kind, backends())] + check_vision(backends())
    print("| model | backend | layout | logits | loss | grad (rel) | tol | status |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "logits" in r:
            print(f"| {r['model']} | {r['backend']} | {r['layout']} | {r['logits']:.2e} | {r['loss']:.2e} | "
                  f"{r['grad_rel']:.2e} | {r['tol_logits']:.1e} | {r['status']} |")
        else:
            print(f"| {r['model']} | {r['backend']} | {r.get('layout', '')} | | | | | {r['status']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    failed = [r for r in results if r["status"].startswith("FAIL")]
    unchecked = [r for r in results if r["status"].startswith("not checked")]
    print(f"{len(results) - len(failed) - len(unchecked)} ok, {len(failed)} failed, {len(unchecked)} not checked"
          + "".join(f"\n  not checked: {r['model']} {r['backend']} ({r['status'][len('not checked: '):]})" for r in unchecked))
    if failed:
        return 1
    if unchecked:
        print("INCOMPLETE: the backends above were not checked; this run is not a pass")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
