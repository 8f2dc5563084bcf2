"""TRL's DPO or KTO on a packed folder with packers.PackedDPOTrainer / PackedKTOTrainer (tiny random Llama, CPU or GPU).

    python examples/preference_trl.py out/dpo-pairs --trainer dpo --loss-type sigmoid   # a folder packed with --pairs
    python examples/preference_trl.py out/kto --trainer kto --precompute                # KTO-labelled rows

The configs are TRL's own ``DPOConfig`` / ``KTOConfig``; the data is a ``PackedDataset`` (``--examples-per-micro-step``
pairs or KTO examples per micro-batch, ``--grad-accum`` micro-batches per optimizer step). The reference is a frozen
copy of the starting policy, or (``--precompute``) its log-probs computed once before training and the copy dropped.
Token ids are folded into a small vocabulary as in examples/train_tiny.py.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import FoldThenCollate, VocabFold, tiny_llama  # noqa: E402

from packers import (Batching, Collator, PackedDataset, PackedDPOTrainer, PackedKTOTrainer, Sampling,  # noqa: E402
                     install_packing_guard)


def main(argv=None) -> dict:
    from trl import DPOConfig, KTOConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", help="packed with packstream pack --pairs (dpo) or from KTO-labelled records (kto)")
    p.add_argument("--trainer", choices=["dpo", "kto"], default="dpo")
    p.add_argument("--loss-type", default=None, help="TRL's loss_type [dpo: sigmoid, kto: kto]")
    p.add_argument("--precompute", action="store_true", help="precompute_ref_log_probs=True, no reference model kept")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--examples-per-micro-step", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "packstream-preference-trl"))
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))

    common = dict(output_dir=args.output_dir, max_steps=args.max_steps, gradient_accumulation_steps=args.grad_accum,
                  learning_rate=args.lr, logging_steps=1, save_strategy="no", report_to="none", bf16=False,
                  gradient_checkpointing=False, precompute_ref_log_probs=args.precompute, beta=args.beta,
                  use_cpu=not torch.cuda.is_available())
    if args.trainer == "dpo":
        config, trainer_cls = DPOConfig(loss_type=[args.loss_type or "sigmoid"], **common), PackedDPOTrainer
    else:
        config, trainer_cls = KTOConfig(loss_type=args.loss_type or "kto", **common), PackedKTOTrainer
    ds = PackedDataset(args.folder, sampling=Sampling(seed=config.seed),
                       batching=Batching(batch_by="examples", batch_size=args.examples_per_micro_step,
                                         grad_accum=args.grad_accum))
    collate = FoldThenCollate(VocabFold(ds, args.vocab), Collator())
    policy = tiny_llama(args.vocab, ds.budget)
    ref = None if args.precompute else copy.deepcopy(policy).eval().requires_grad_(False)
    for m in (policy, ref):
        if m is not None:
            install_packing_guard(m, max_length=ds.budget)
    trainer = trainer_cls(policy, config, ds, ref_model=ref, collator=collate)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    first, last = logs[0], logs[-1]
    print(f"{args.trainer} ({config.loss_type}): loss {first['loss']:.4f} -> {last['loss']:.4f}; "
          f"rewards/margins {first.get('rewards/margins', float('nan')):.4f} -> "
          f"{last.get('rewards/margins', float('nan')):.4f}")
    return {"logs": logs}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
