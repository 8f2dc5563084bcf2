"""GPU training benchmark: padded vs DataCollatorWithFlattening vs packed rows, ~1B Llama, bf16.

    python bench/gpu_bench.py [--examples-per-step 64] [--steps 10] [--budget 4096] [--json out.json]

A random Llama-shaped model (hidden 2048, 12 layers, 16 heads / 8 KV heads, vocab 129,280: ~1.1B
parameters) in bf16 trains on gsm8k examples (../shared/data, the bundled tokenizer; random
lengths when absent) with the same number of examples per step in every mode:

* ``padded``: random examples, right-padded, sdpa with an attention mask;
* ``flattening``: the same kind of random examples through transformers'
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` (padding-free, on the fly);
* ``packed``: rows packed offline (tests/_shards.py, budget ``--budget``) read by
  ``PackedDataset(batching=Batching(batch_by="examples"))`` and ``Collator()``;
* ``packed, fixed_shape``: the same, every row padded to the budget (constant shapes).

The padding-free modes use ``flash_attention_2`` when flash-attn is installed, else the torch
varlen backend (``packstream_varlen``). Reported per mode: useful tokens/s (the examples' own
tokens, no padding), mean step time and peak GPU memory per step. Skips cleanly without CUDA.
Budgeted to finish well under 10 minutes on one H100/H200. Exit status 2 when a mode was not
measured (out of memory) or there is no CUDA device: such a run is not a complete benchmark.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packers import (  # noqa: E402
    Batching, Collator, PackedDataset, Sampling, check_packing_safe, register_varlen_attention,
)
from tests import _shards  # noqa: E402


def model_1b(attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=129280, hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=8192,
                      attn_implementation=attn, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.train()


def load_examples(n: int) -> tuple[list[_shards.Example], str]:
    if _shards.GSM8K.exists():
        return _shards.gsm8k_examples(_shards.load_tokenizer(), limit=n), "gsm8k"
    return _shards.random_examples(n, min_len=32, max_len=1024, vocab=129280), "random lengths 32-1024"


def run_mode(model, batches: list[dict], useful: list[int], warmup: int) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    check_packing_safe(model, batches[0])
    times, peaks = [], []
    for i, b in enumerate(batches):
        b = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in b.items()}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        model(**b).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            peaks.append(torch.cuda.max_memory_allocated() / 2**30)
    del opt
    torch.cuda.empty_cache()
    return {"useful tok/s": sum(useful[warmup:]) / sum(times), "step s": float(np.mean(times)),
            "peak GiB": float(max(peaks)), "tokens/step": float(np.mean([int(b["input_ids"].numel()) for b in batches]))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--examples-per-step", type=int, default=64)
    p.add_argument("--steps", type=int, default=10, help="measured steps per mode (after 3 warm-up steps)")
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("not measured: no CUDA device")
        return 2
    from transformers import DataCollatorWithFlattening

    warmup, E = 3, args.examples_per_step
    n_steps = warmup + args.steps
    examples, source = load_examples(max(7473, E * n_steps * 2))
    if importlib.util.find_spec("flash_attn"):
        varlen = "flash_attention_2"
    else:
        varlen = register_varlen_attention()
        print("flash-attn not installed: padding-free modes use the torch varlen backend")

    rng = np.random.default_rng(0)
    order = rng.permutation(len(examples))
    random_steps = [[examples[i] for i in order[s * E : (s + 1) * E]] for s in range(n_steps)]

    folder = Path(tempfile.mkdtemp(prefix="packstream-gpu-bench-"))
    _shards.write_shards(folder, _shards.pack_first_fit(examples, args.budget), budget=args.budget)
    ds = PackedDataset(folder, sampling=Sampling(seed=0), batching=Batching(batch_by="examples", batch_size=E))
    packed_rows = [ds.fetch(b) for b in ds.schedule()[:n_steps]]

    flat = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    modes = {
        "padded (sdpa + mask)": ("sdpa", [_shards.padded_batch(s) for s in random_steps],
                                 [sum(len(e.input_ids) for e in s) for s in random_steps]),
        f"flattening ({varlen})": (varlen, [{**flat([{"input_ids": e.input_ids, "labels": [t if m else -100 for t, m in
                                                      zip(e.input_ids, e.loss_mask)]} for e in s]), "use_cache": False}
                                            for s in random_steps],
                                   [sum(len(e.input_ids) for e in s) for s in random_steps]),
        f"packed ({varlen})": (varlen, [Collator()(r) for r in packed_rows],
                               [sum(int(x["num_tokens"]) for x in r) for r in packed_rows]),
        f"packed, fixed_shape ({varlen})": (varlen, [Collator(fixed_shape=True, budget=args.budget)(r) for r in packed_rows],
                                            [sum(int(x["num_tokens"]) for x in r) for r in packed_rows]),
    }
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | data {source} | {E} examples/step "
          f"(packed: {np.mean([sum(len(x['example_ids']) for x in r) for r in packed_rows]):.1f})")
    model = model_1b("sdpa")
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters, bf16")
    results = {}
    for name, (attn, batches, useful) in modes.items():
        model.set_attn_implementation(attn)
        t0 = time.time()
        try:
            results[name] = run_mode(model, batches, useful, warmup)
        except torch.cuda.OutOfMemoryError as e:
            results[name] = {"error": f"OOM: {e}"[:120]}
            torch.cuda.empty_cache()
        print(f"  {name}: {results[name]} ({time.time() - t0:.0f}s)", flush=True)
    base = results.get("padded (sdpa + mask)", {}).get("useful tok/s")
    print("\n| mode | useful tok/s | vs padded | step s | tokens/step | peak GiB |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | {r['error']} | | | | |")
            continue
        ratio = f"{r['useful tok/s'] / base:.2f}x" if base else "-"
        print(f"| {name} | {r['useful tok/s']:,.0f} | {ratio} | {r['step s']:.3f} | {r['tokens/step']:,.0f} | {r['peak GiB']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    missing = [name for name, r in results.items() if "error" in r]
    if missing:  # a mode that did not run was not measured: the run is not a complete benchmark
        print(f"INCOMPLETE: not measured: {', '.join(missing)}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
