"""DPO on packed pairs against TRL's ``DPOTrainer`` on the same pairs padded, side by side in one run (CPU, fp32).

    python bench/bench_dpo_trl.py [--pairs 128] [--steps 10] [--pairs-per-step 8] [--budget 2048] [--json OUT]

Data: the first ``--pairs`` pairs of ../shared/preference/dpo_zh_demo.json (LLaMA-Factory's ranking form), packed
by ``packstream pack --pairs --long truncate --max-tokens BUDGET`` into a temporary folder (skipped, with a message,
when that file is absent). Token ids are folded into ``--vocab`` ids as examples/train_tiny.py's ``VocabFold``
does (the data's most frequent ids keep their own), and both paths get the *same* folded ids: the TRL side's
``prompt_ids``/``chosen_ids``/``rejected_ids`` are cut out of the packed rows, so both see the same tokens, the
``--long truncate`` cut included. Model: examples/train_tiny.py's tiny random Llama (sdpa, hidden 64, 2 layers),
built twice from one seed (same init for both paths), fp32, ``--threads`` CPU threads. Per path:

* **packed**: ``PackedDataset`` (``Batching(batch_by="examples", batch_size=--pairs-per-step)``: a step holds about
  that many pairs, whole rows) + ``Collator``, the packing guard on both models, one policy forward and one no-grad
  reference forward per step over the step's rows flattened into one ``[1, T]`` batch, ``sequence_logps``, the
  sigmoid DPO loss (beta 0.1, mean over the step's pairs), gradient clipping at 1.0, one AdamW step. Timed: the
  row fetch, the fold, the collation and the step.
* **TRL**: ``trl.DPOTrainer`` + ``DPOConfig`` (``loss_type="sigmoid"``, beta 0.1, ``per_device_train_batch_size``
  = --pairs-per-step, ``max_length=None``: the pairs are already cut to the budget; gradient checkpointing off,
  as on the packed side (TRL's default turns it on); AdamW, constant learning rate, clipping at 1.0) and its own
  collator, ``DataCollatorForPreference``: chosen then rejected sequences, right-padded to the batch's longest.
  The pairs are laid out in the packed run's step order and read sequentially
  (``train_sampling_strategy="sequential"``). TRL 1.16's dataset preparation only takes text and tokenizes it
  (pre-tokenized columns fail in ``extract_prompt`` with ``KeyError: 'chosen'``), so a subclass returns the
  already tokenized dataset from ``_prepare_dataset``; that happens before training and is not timed. The
  collator's pad id is 0 (a folded id; the padded positions are masked and never reach the loss). Timed: each
  optimizer step from the end of the one before (a ``TrainerCallback``), its data loading and collation included.

Reported per path: pairs per step, tokens per forward (real, and computed: the batch's ``input_ids`` including
padding), padding fraction, wall and CPU (process, all threads) seconds per optimizer step, the median over the
steps after ``--warmup`` (the first step pays the guard's probe, allocator growth and lazy imports), and
milliseconds per pair (the median of each step's seconds over its pairs: a packed step's pair count varies by a
row). Ratios are packed/TRL. One policy and one reference forward per step on both sides. On CPU, sdpa computes a
packed row's block-diagonal mask densely (T x T), so a packed forward pays for the masked-out blocks that varlen
kernels on a GPU skip; the padded side pays for its padding instead. The paths run one after the other in one
process: on a shared machine rerun it and compare the ratios. No peak memory is reported: both paths share one
process.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from packers import Batching, Collator, PackedDataset, Sampling, install_packing_guard, sequence_logps  # noqa: E402
from train_tiny import VocabFold, tiny_llama  # noqa: E402

DEMO = ROOT.parent / "shared" / "preference" / "dpo_zh_demo.json"
BETA = 0.1
LR = 1e-4


def pack_demo(folder: Path, n: int, budget: int) -> None:
    """The first ``n`` pairs of the demo, packed by ``packstream pack --pairs`` into ``folder``."""
    subset = folder.parent / "dpo_zh_demo.json"
    subset.write_text(json.dumps(json.loads(DEMO.read_text(encoding="utf-8"))[:n], ensure_ascii=False))
    cmd = [sys.executable, "-m", "pipeline.cli", "pack", str(subset), "--pairs", "--long", "truncate",
           "--max-tokens", str(budget), "--output", str(folder), "--quiet"]
    print("$ packstream " + " ".join(cmd[3:]))
    subprocess.run(cmd, check=True, cwd=ROOT)


def packed_steps(ds: PackedDataset):
    """The dataset's micro-batches (lists of rows), epoch after epoch."""
    while True:
        yield from ds


def row_pairs(row: dict) -> list[tuple[list[int], list[int], list[int]]]:
    """The (prompt, chosen completion, rejected completion) ids of each pair in a packed row, as TRL's tokenized
    preference format holds them: chosen = ``prompt + chosen``, rejected = ``prompt + rejected``."""
    ids, offs, spans = np.asarray(row["input_ids"]), list(row["seq_offsets"]), list(row["completion_spans"])
    sides = list(row["sides"])
    out = []
    for k in range(0, len(sides), 2):
        if sides[k:k + 2] != [0, 1]:
            raise RuntimeError(f"sequences {k}, {k + 1} of a pair row have sides {sides[k:k + 2]}, not chosen, rejected")
        seqs = []
        for j in (k, k + 1):
            start, stop, first, end = offs[j], offs[j + 1], spans[2 * j], spans[2 * j + 1]
            if end != stop:
                raise RuntimeError(f"sequence {j}: its completion ends at {end}, its sequence at {stop}")
            seqs.append((ids[start:first].tolist(), ids[first:end].tolist()))
        (prompt, chosen), (prompt_r, rejected) = seqs
        if prompt != prompt_r:
            raise RuntimeError(f"pair {k // 2}: chosen and rejected sides have different prompts")
        out.append((prompt, chosen, rejected))
    return out


def timed(marks: list[tuple[float, float]], warmup: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each step after ``warmup`` steps, from (perf_counter, process_time) marks taken
    before the first step and after each."""
    wall = [b[0] - a[0] for a, b in zip(marks, marks[1:])][warmup:]
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])][warmup:]
    return wall, cpu


def summary(wall, cpu, pairs, real, computed) -> dict:
    return {"steps": len(wall), "pairs_per_step": float(np.mean(pairs)), "real_tokens_per_forward": float(np.mean(real)),
            "computed_tokens_per_forward": float(np.mean(computed)), "padding": 1 - sum(real) / sum(computed),
            "wall_s_per_step": statistics.median(wall), "cpu_s_per_step": statistics.median(cpu),
            "ms_per_pair": 1e3 * statistics.median(w / p for w, p in zip(wall, pairs))}


def run_packed(folder: Path, args, fold: VocabFold) -> tuple[dict, list]:
    """Train ``--warmup + --steps`` packed steps; the result and the pairs of each step, in order."""
    ds = PackedDataset(folder, sampling=Sampling(seed=0),
                       batching=Batching(batch_by="examples", batch_size=args.pairs_per_step))
    policy = tiny_llama(args.vocab, ds.budget).train()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    install_packing_guard(policy)
    install_packing_guard(reference)
    opt = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)
    collate, steps = Collator(), packed_steps(ds)
    marks, pairs, real, computed, step_pairs = [(time.perf_counter(), time.process_time())], [], [], [], []
    for _ in range(args.warmup + args.steps):
        rows = fold(next(steps))
        batch = collate(rows)
        lp = sequence_logps(policy(**batch).logits, batch)
        with torch.no_grad():
            ref = sequence_logps(reference(**batch).logits, batch)
        loss = -F.logsigmoid(BETA * ((lp.chosen - ref.chosen) - (lp.rejected - ref.rejected))).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        marks.append((time.perf_counter(), time.process_time()))
        step_pairs.append([p for r in rows for p in row_pairs(r)])
        pairs.append(len(step_pairs[-1]))
        real.append(sum(len(r["input_ids"]) for r in rows))
        computed.append(batch["input_ids"].numel())
    wall, cpu = timed(marks, args.warmup)
    w = args.warmup
    return summary(wall, cpu, pairs[w:], real[w:], computed[w:]), step_pairs


class Recording:
    """TRL's collator, unchanged, with each batch's real and computed tokens and pairs written down."""

    def __init__(self, collate) -> None:
        self.collate, self.calls = collate, []

    def __call__(self, examples):
        out = self.collate(examples)
        self.calls.append((len(examples), int(out["attention_mask"].sum()), out["input_ids"].numel()))
        return out


def run_trl(pairs: list, args, budget: int) -> dict:
    """Train TRL's DPOTrainer ``--warmup + --steps`` steps on ``pairs`` (in this order), timed per optimizer step."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    class Clock(TrainerCallback):
        """(perf_counter, process_time) when training begins and after each optimizer step."""

        def __init__(self) -> None:
            self.marks: list[tuple[float, float]] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.marks = [(time.perf_counter(), time.process_time())]

        def on_step_end(self, args, state, control, **kwargs):
            self.marks.append((time.perf_counter(), time.process_time()))

    hf_logging.set_verbosity_error()
    data = Dataset.from_list([{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in pairs])
    policy = tiny_llama(args.vocab, budget).train()
    collate, clock = Recording(DataCollatorForPreference(pad_token_id=0)), Clock()
    with warnings.catch_warnings():  # transformers 5 renamed gradient_checkpointing; TRL 1.16 still sets it
        warnings.filterwarnings("ignore", ".*gradient_checkpointing` is deprecated", FutureWarning)
        trl_trainer(policy, data, args, collate, clock).train()
    wall, cpu = timed(clock.marks, args.warmup)
    calls = collate.calls[args.warmup:args.warmup + args.steps]
    return summary(wall, cpu, *zip(*calls))


def trl_trainer(policy, data, args, collate, clock):
    """TRL's DPOTrainer as configured for this bench (see the module docstring), its tokenization skipped."""
    from transformers.trainer_callback import PrinterCallback
    from trl import DPOConfig, DPOTrainer

    from tests._shards import load_tokenizer

    class PreTokenized(DPOTrainer):
        def _prepare_dataset(self, dataset, *a, **k):  # TRL 1.16 tokenizes text only; these are already ids
            return dataset

    total = args.warmup + args.steps
    config = DPOConfig(output_dir=tempfile.mkdtemp(prefix="packstream-bench-trl-"), beta=BETA, loss_type="sigmoid",
                       per_device_train_batch_size=args.pairs_per_step, max_steps=total, max_length=None,
                       learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0,
                       optim="adamw_torch", gradient_checkpointing=False, use_cpu=True, report_to="none",
                       save_strategy="no", logging_steps=total + 1, disable_tqdm=True,
                       train_sampling_strategy="sequential", dataloader_num_workers=0, seed=0)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    trainer = PreTokenized(model=policy, ref_model=reference, args=config, train_dataset=data,
                           processing_class=load_tokenizer(), data_collator=collate, callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # its end-of-training dict; the table below says what matters
    return trainer


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=128, help="first N pairs of dpo_zh_demo.json to pack")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per path, after --warmup")
    ap.add_argument("--warmup", type=int, default=1, help="untimed first steps per path")
    ap.add_argument("--pairs-per-step", type=int, default=8)
    ap.add_argument("--budget", type=int, default=2048, help="row budget (--max-tokens) of the packing")
    ap.add_argument("--vocab", type=int, default=2048, help="token ids folded into this many")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if not DEMO.exists():
        print(f"skipped: {DEMO} not found (the preference demo beside the checkout; see its SOURCES.md)")
        return None
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="packstream-bench-dpo-") as tmp:
        folder = Path(tmp) / "pairs"
        pack_demo(folder, args.pairs, args.budget)
        ds = PackedDataset(folder)
        fold = VocabFold(ds, args.vocab)
        print(f"{int(ds.num_examples.sum())} pairs in {len(ds.rows)} rows of budget {ds.budget}; "
              f"{args.warmup} warm-up + {args.steps} timed steps of ~{args.pairs_per_step} pairs per path, "
              f"{args.threads} threads")
        packed, step_pairs = run_packed(folder, args, fold)
    trl = run_trl([p for step in step_pairs for p in step], args, args.budget)
    out = {"args": vars(args), "packed": packed, "trl": trl,
           "ratio": {k: packed[k] / trl[k] for k in ("computed_tokens_per_forward", "wall_s_per_step",
                                                     "cpu_s_per_step", "ms_per_pair")}}
    print_table(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


def print_table(out: dict) -> None:
    print(f"\n{'path':12} {'steps':>5} {'pairs/step':>10} {'real tok/fwd':>12} {'computed tok/fwd':>16} "
          f"{'padding':>8} {'wall s/step':>11} {'CPU s/step':>10} {'ms/pair':>8}")
    for name, key in (("packed", "packed"), ("TRL padded", "trl")):
        s = out[key]
        print(f"{name:12} {s['steps']:5} {s['pairs_per_step']:10.2f} {s['real_tokens_per_forward']:12,.0f} "
              f"{s['computed_tokens_per_forward']:16,.0f} {s['padding']:8.1%} {s['wall_s_per_step']:11.3f} "
              f"{s['cpu_s_per_step']:10.3f} {s['ms_per_pair']:8.1f}")
    r = out["ratio"]
    print(f"{'packed/TRL':12} {'':5} {'':10} {'':12} {r['computed_tokens_per_forward']:15.2f}x {'':8} "
          f"{r['wall_s_per_step']:10.2f}x {r['cpu_s_per_step']:9.2f}x {r['ms_per_pair']:7.2f}x")


if __name__ == "__main__":
    main()
