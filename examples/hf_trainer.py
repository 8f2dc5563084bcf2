"""Train with transformers' ``Trainer`` on packed shards (tiny random Llama, CPU or GPU).

    python examples/hf_trainer.py out/gsm8k-packed --make-gsm8k 2000   # packstream pack, then train
    python examples/hf_trainer.py out/gsm8k-packed --max-steps 30 --examples-per-micro-step 8 --grad-accum 2
    torchrun --nproc-per-node 2 examples/hf_trainer.py out/gsm8k-packed   # DDP: rows sharded by rank

The Trainer's own dataloader would batch *rows* (``per_device_train_batch_size`` rows of many
examples each: far fewer optimizer steps than a padded run) and re-shard them. Here
``get_train_dataloader`` returns ``PackedDataset.dataloader()`` instead, which already shards by
rank, batches by *examples*, and keeps its position exact with workers, so each optimizer step
sees ``examples_per_micro_step x grad_accum x world_size`` examples, as a padded run with that
batch size. The Trainer normalises the loss by the target tokens of all micro-batches of the step,
on all ranks (``num_items_in_batch``; ``average_tokens_across_devices``), i.e. a token-level mean
equal to unpacked training's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import FoldThenCollate, VocabFold, make_gsm8k_shards, tiny_llama  # noqa: E402

from packers import Batching, Collator, PackedDataset, Sampling, Sharding, install_packing_guard  # noqa: E402


def main(argv=None) -> float:
    from transformers import Trainer, TrainingArguments

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shards")
    p.add_argument("--make-gsm8k", type=int, metavar="N")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--examples-per-micro-step", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "packstream-hf-trainer"))
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.make_gsm8k:
        make_gsm8k_shards(Path(args.shards), args.make_gsm8k, args.budget)

    # After torch.distributed is initialised (torchrun + TrainingArguments below), rank/world_size are read
    # from it; a TrainingArguments object initialises it, so build that first.
    targs = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=3e-3,
        warmup_steps=3,
        logging_steps=max(1, args.max_steps // 5),
        save_strategy="no",
        report_to="none",
        remove_unused_columns=False,  # keep the packed columns (the Trainer would drop what forward() lacks)
        dataloader_num_workers=args.workers,
        use_cpu=not torch.cuda.is_available(),
    )
    ds = PackedDataset(args.shards, sampling=Sampling(seed=targs.seed),
                       sharding=Sharding(rank=targs.process_index, world_size=targs.world_size),
                       batching=Batching(batch_by="examples", batch_size=args.examples_per_micro_step))
    collate = FoldThenCollate(VocabFold(ds, args.vocab), Collator())
    model = tiny_llama(args.vocab, ds.budget)
    install_packing_guard(model, max_length=ds.budget)  # probes once, at the folder's row length

    class PackedTrainer(Trainer):
        def get_train_dataloader(self):
            # Not passed through accelerator.prepare: PackedDataset is rank-aware and already batched.
            return ds.dataloader(collate_fn=collate, num_workers=self.args.dataloader_num_workers,
                                 pin_memory=torch.cuda.is_available())

    trainer = PackedTrainer(model=model, args=targs, train_dataset=ds, data_collator=collate)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"examples per optimizer step: ~{args.examples_per_micro_step * args.grad_accum * targs.world_size}; "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; loader state {ds.state_dict()}")
    return losses[-1] - losses[0]


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(0 if main() < 0 else 1)
