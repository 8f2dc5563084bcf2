"""Loader benchmark (CPU): reading, collating and training on packed rows, each against its baseline.

    python bench/bench_loader.py [--shards DIR] [--budget 2048] [--examples 7473] [--train-steps 20]

Without ``--shards`` it packs gsm8k from ../shared/data (tokenized with the bundled tokenizer) with
tests/_shards.py, or random examples when that data is absent. The measurements, one table:

1. rows/s read from memory-mapped shards: ``PackedDataset`` batches (Arrow -> numpy views)
   against ``datasets``' default Python-list access to the same rows; and the cost of the row
   checks every ``fetch`` runs (contract + the manifest's row_checks), as rows/s with and without
   them, in the same run; and the cost of ``verify=True``: seconds per GB of shards to sha256
   (files in the page cache, so CPU bound; a cold disk adds its read time), and the open time
   with and without it;
2. collate time per batch: ``packers.Collator`` on those rows against transformers'
   ``DataCollatorWithFlattening`` on the same examples (as a padding-free pipeline feeds it);
3. training tokens/s of a tiny Llama on CPU: packed rows (sdpa, packed mask from position_ids)
   against a typical padded run (random examples, as many per step, sdpa + attention mask).
   "Useful" tokens are the examples' own tokens (no padding). On CPU, sdpa/eager compute the
   packed block-diagonal mask densely (T x T per row), so packing saves the padding but pays
   for the masked-out blocks; the varlen kernels on GPU skip them (bench/gpu_bench.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packers import Batching, Collator, PackedDataset, Sampling  # noqa: E402
from tests import _shards  # noqa: E402


def timeit(fn, *, repeats: int = 5, min_time: float = 0.2) -> float:
    """Seconds per call of ``fn``: the best of ``repeats`` timings, each over >= ``min_time`` s, after as long a warm-up.

    The best, not the mean: on a shared machine, other processes only ever add time. The garbage
    collector is off while timing (as in the stdlib's timeit): the baselines' Python lists held in
    memory would otherwise bill full collections to whichever code happens to trigger them.
    """
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < min_time:  # warm-up: caches, allocator thresholds, lazy imports
        fn()
    best = float("inf")
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            runs, t0 = 0, time.perf_counter()
            while runs < 1 or time.perf_counter() - t0 < min_time:
                fn()
                runs += 1
            best = min(best, (time.perf_counter() - t0) / runs)
    finally:
        gc.enable()
    return best


def timeit_pair(a, b, *, repeats: int = 15, min_time: float = 0.1) -> tuple[float, float]:
    """Seconds per call of ``a`` and of ``b``, timed in turns (a, b, a, b, ...), the best of each: contention
    from other processes then hits both alike, so their ratio holds on a busy machine."""
    for fn in (a, b):
        timeit(fn, repeats=1, min_time=min_time)  # warm-up
    best = [float("inf"), float("inf")]
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            for k, fn in enumerate((a, b)):
                runs, t0 = 0, time.perf_counter()
                while runs < 1 or time.perf_counter() - t0 < min_time:
                    fn()
                    runs += 1
                best[k] = min(best[k], (time.perf_counter() - t0) / runs)
    finally:
        gc.enable()
    return best[0], best[1]


def build_shards(args) -> tuple[Path, str]:
    folder = Path(tempfile.mkdtemp(prefix="packstream-bench-"))
    if _shards.GSM8K.exists():
        examples = _shards.gsm8k_examples(_shards.load_tokenizer(), limit=args.examples)
        source = f"gsm8k, {len(examples)} examples"
    else:
        examples = _shards.random_examples(args.examples, max_len=400, vocab=32000)
        source = f"random, {len(examples)} examples"
    _shards.write_shards(folder, _shards.pack_first_fit(examples, args.budget), budget=args.budget, num_shards=4)
    return folder, source


def bench_read(ds: PackedDataset) -> dict:
    schedule = ds.schedule()
    # The same reads with and without the row checks, in turns.
    ours, unchecked = timeit_pair(lambda: [ds.fetch(b) for b in schedule],
                                  lambda: [ds._fetch(b, check=False) for b in schedule])
    hf = timeit(lambda: [ds.rows[b.tolist()] for b in schedule])  # dict of Python lists, datasets' default format
    n = sum(len(b) for b in schedule)
    return {"packstream rows/s": n / ours, "unchecked rows/s": n / unchecked, "datasets rows/s": n / hf,
            "ratio": hf / ours, "checked / unchecked": unchecked / ours}


def bench_verify(folder: Path) -> dict:
    """sha256 of every shard (what verify=True adds), per GB; and PackedDataset's open time with and without it."""
    from packers._folder import _sha256_file

    shards = [str(folder / s["name"]) for s in json.loads((folder / "manifest.json").read_text())["shards"]]
    gb = sum(os.path.getsize(p) for p in shards) / 1e9
    t_hash = timeit(lambda: [_sha256_file(p) for p in shards], repeats=3, min_time=1.0)
    t_open, t_open_verify = timeit_pair(lambda: PackedDataset(folder), lambda: PackedDataset(folder, verify=True),
                                        repeats=5, min_time=0.2)
    return {"GB": gb, "sha256 s/GB": t_hash / gb, "open s": t_open, "open verify s": t_open_verify}


def bench_collate(ds: PackedDataset) -> dict:
    from transformers import DataCollatorWithFlattening

    batches = [ds.fetch(b) for b in ds.schedule()[:50]]
    as_lists = [[{k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in r.items()} for r in b] for b in batches]
    features = []  # the same examples, one dict each, with masked labels: what a padding-free pipeline collates
    for b in as_lists:
        feats = []
        for r in b:
            o = r["seq_offsets"]
            for a, z in zip(o, o[1:]):
                ids = r["input_ids"][a:z]
                feats.append({"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, r["loss_mask"][a:z])]})
        features.append(feats)
    collate = Collator()
    hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)
    t_np = timeit(lambda: [collate(b) for b in batches]) / len(batches)
    t_list = timeit(lambda: [collate(b) for b in as_lists]) / len(batches)
    t_hf = timeit(lambda: [hf(f) for f in features]) / len(batches)
    return {"packstream ms/batch (numpy rows)": t_np * 1e3, "packstream ms/batch (list rows)": t_list * 1e3,
            "DataCollatorWithFlattening ms/batch": t_hf * 1e3, "ratio": t_hf / t_np}


def tiny_llama(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                                        attn_implementation="sdpa"))


def _pad(seqs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    n = max(len(x) for x, _ in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    lab = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for i, (x, y) in enumerate(seqs):
        ids[i, : len(x)], lab[i, : len(x)], mask[i, : len(x)] = x, y, 1
    return {"input_ids": ids, "labels": lab, "attention_mask": mask, "use_cache": False}


def bench_train(folder: Path, steps: int, rows_per_step: int) -> dict:
    """Packed rows vs a typical padded run (random examples, as many per step), useful tokens/s."""
    vocab = 4096  # ids folded into a small vocab: a 129k-way softmax would dominate a tiny model on CPU
    collate = Collator()
    ds = PackedDataset(folder, sampling=Sampling(seed=2), batching=Batching(batch_size=rows_per_step))
    packed = [collate([{**r, "input_ids": r["input_ids"] % vocab} for r in ds.fetch(b)])
              for b in ds.schedule()[:steps]]
    every = collate([{**r, "input_ids": r["input_ids"] % vocab} for r in ds.fetch(np.arange(len(ds.rows)))])
    cu = every["cu_seq_lens_q"].tolist()
    examples = [(every["input_ids"][0, x:y], every["labels"][0, x:y]) for x, y in zip(cu, cu[1:])]
    order = np.random.default_rng(0).permutation(len(examples)).tolist()
    padded = []
    for b in packed:
        k = len(b["cu_seq_lens_q"]) - 1
        padded.append(_pad([examples[order.pop()] for _ in range(k)]))
    useful_packed = sum(int(b["input_ids"].shape[1]) for b in packed)
    useful_padded = sum(int(b["attention_mask"].sum()) for b in padded)
    padded_tokens = sum(int(b["input_ids"].numel()) for b in padded)

    # Interleaved, one step of each in turn, best of 3 passes: contention from other processes hits both alike.
    models = {name: tiny_llama(vocab).train() for name in ("padded", "packed")}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    seconds = {"padded": [], "packed": []}
    for name, batches in (("padded", padded), ("packed", packed)):  # warm-up
        models[name](**batches[0]).loss.backward()
        opts[name].zero_grad()
    for _ in range(3):
        spent = {"padded": 0.0, "packed": 0.0}
        for pair in zip(padded, packed):
            for name, b in zip(("padded", "packed"), pair):
                t0 = time.perf_counter()
                models[name](**b).loss.backward()
                opts[name].step()
                opts[name].zero_grad()
                spent[name] += time.perf_counter() - t0
        for name in spent:
            seconds[name].append(spent[name])
    t_pad, t_pack = min(seconds["padded"]), min(seconds["packed"])
    return {"padded useful tok/s": useful_padded / t_pad, "packed useful tok/s": useful_packed / t_pack,
            "ratio": (useful_packed / t_pack) / (useful_padded / t_pad),
            "padding share of padded": 1 - useful_padded / padded_tokens, "steps": len(packed),
            "examples/step": float(np.mean([len(b["cu_seq_lens_q"]) - 1 for b in packed]))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", help="a packed output folder (default: build one from gsm8k)")
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--examples", type=int, default=7473)
    p.add_argument("--rows-per-batch", type=int, default=8)
    p.add_argument("--train-steps", type=int, default=12)
    p.add_argument("--train-rows-per-step", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    folder, source = (Path(args.shards), "given shards") if args.shards else build_shards(args)
    ds = PackedDataset(folder, sampling=Sampling(seed=0), batching=Batching(batch_size=args.rows_per_batch))
    print(f"data: {source}; {len(ds.rows)} rows of budget {ds.budget}, {int(ds.num_examples.sum())} examples, "
          f"{ds.num_tokens.sum() / (len(ds.rows) * ds.budget):.1%} fill; torch threads {args.threads}\n")
    results = {
        "read": bench_read(ds),
        "verify": bench_verify(folder),
        "collate": bench_collate(ds),
        "train": bench_train(folder, args.train_steps, args.train_rows_per_step),
    }
    r, v, c, t = results["read"], results["verify"], results["collate"], results["train"]
    print("| measurement | packstream | baseline | packstream / baseline |")
    print("|---|---|---|---|")
    print(f"| read, rows/s ({args.rows_per_batch} rows/batch, mmap, rows checked) | {r['packstream rows/s']:,.0f} | "
          f"{r['datasets rows/s']:,.0f} (datasets, Python lists) | {r['ratio']:.1f}x faster |")
    print(f"| row checks: read rows/s with / without | {r['packstream rows/s']:,.0f} | {r['unchecked rows/s']:,.0f} "
          f"(same reads, unchecked) | {r['checked / unchecked']:.2f}x |")
    print(f"| verify=True: sha256, s/GB (page cache) | {v['sha256 s/GB']:.2f} ({v['GB'] * 1e3:.1f} MB of shards) | "
          f"open {v['open s'] * 1e3:.0f} ms without verify | open {v['open verify s'] * 1e3:.0f} ms with |")
    print(f"| collate, ms/batch ({args.rows_per_batch} rows) | {c['packstream ms/batch (numpy rows)']:.3f} "
          f"(list rows: {c['packstream ms/batch (list rows)']:.3f}) | {c['DataCollatorWithFlattening ms/batch']:.3f} "
          f"(DataCollatorWithFlattening) | {c['ratio']:.1f}x faster |")
    print(f"| tiny Llama train, useful tok/s ({t['steps']} steps, {t['examples/step']:.1f} examples/step) | "
          f"{t['packed useful tok/s']:,.0f} (packed, sdpa) | {t['padded useful tok/s']:,.0f} (padded, "
          f"{t['padding share of padded']:.0%} padding) | {t['ratio']:.2f}x |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
