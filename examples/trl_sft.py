"""Train with TRL's ``SFTTrainer(padding_free=True)`` on packed shards (tiny random Llama, CPU or GPU).

    python examples/trl_sft.py out/gsm8k-packed --make-gsm8k 2000   # packstream pack, then train
    python examples/trl_sft.py out/gsm8k-packed --max-steps 30 --examples-per-step 16

TRL's padding-free collator takes rows with ``input_ids``, ``labels`` and ``seq_lengths`` (the
format of its own ``pack_dataset``) and refuses custom collators, so the packed rows are mapped
to that format: ``labels`` from ``loss_mask``, ``seq_lengths`` from ``seq_offsets``. TRL then
flattens a batch of rows into ``[1, T]`` with position_ids and ``cu_seq_lens``, sets
``use_cache=False`` in its loss, and masks each example's first label, as packers.Collator does.

TRL batches *rows*: ``per_device_train_batch_size`` rows per micro-step. To see as many examples
per optimizer step as a padded run with batch size E, this script sets it to
``round(E / mean examples per row)`` (the mean is in the shards: ``PackedDataset.num_examples``).
For an exact count per step, use the HF Trainer example's PackedDataset dataloader instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import VocabFold, make_gsm8k_shards, tiny_llama  # noqa: E402

from packers import PackedDataset, install_packing_guard  # noqa: E402


def to_trl(batch: dict, table: np.ndarray) -> dict:
    """Packed rows -> TRL's packed format (batched ``datasets.map``)."""
    out = {"input_ids": [], "labels": [], "seq_lengths": []}
    for ids, mask, offs in zip(batch["input_ids"], batch["loss_mask"], batch["seq_offsets"]):
        ids, offs = table[np.asarray(ids)], np.asarray(offs)
        labels = np.where(np.asarray(mask, dtype=bool), ids, -100)
        labels[offs[:-1]] = -100  # first token of every example (TRL's collator does it too)
        out["input_ids"].append(ids.tolist())
        out["labels"].append(labels.tolist())
        out["seq_lengths"].append(np.diff(offs).tolist())
    return out


def main(argv=None) -> float:
    from trl import SFTConfig, SFTTrainer

    from tests._shards import load_tokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shards")
    p.add_argument("--make-gsm8k", type=int, metavar="N")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--examples-per-step", type=int, default=16)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "packstream-trl"))
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.make_gsm8k:
        make_gsm8k_shards(Path(args.shards), args.make_gsm8k, args.budget)

    ds = PackedDataset(args.shards)  # the rows, memory-mapped, and their statistics
    fold = VocabFold(ds, args.vocab)
    # A map writes a new Arrow file; keep it out of the shard folder (datasets would put it next to the shards).
    os.makedirs(args.output_dir, exist_ok=True)
    train = ds.rows.map(to_trl, batched=True, fn_kwargs={"table": fold.table}, remove_columns=ds.rows.column_names,
                        cache_file_name=os.path.join(args.output_dir, "trl-rows.arrow"))
    rows_per_step = max(1, round(args.examples_per_step / float(ds.num_examples.mean())))

    model = tiny_llama(args.vocab, ds.budget)
    install_packing_guard(model, max_length=ds.budget)  # TRL's batches pass it: no attention_mask, use_cache=False
    config = SFTConfig(
        output_dir=args.output_dir,
        padding_free=True,
        max_length=None,  # rows are already within the budget; TRL refuses max_length with padding_free alone
        dataset_kwargs={"skip_prepare_dataset": True},
        per_device_train_batch_size=rows_per_step,
        max_steps=args.max_steps,
        learning_rate=3e-3,
        warmup_steps=3,
        logging_steps=max(1, args.max_steps // 5),
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=train, processing_class=load_tokenizer())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(f"{rows_per_step} rows/step = ~{rows_per_step * ds.num_examples.mean():.1f} examples/step; "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return losses[-1] - losses[0]


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(0 if main() < 0 else 1)
