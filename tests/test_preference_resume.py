"""Checkpoint and resume of :class:`packers.PackedDPOTrainer` / :class:`packers.PackedKTOTrainer` mid-epoch (issue 43):
a run resumed from its step-2 checkpoint logs the same steps 3 and 4, and ends with the same parameters, as the run
that was never stopped.

Each case (one also with 2 DataLoader workers) trains 4 optimizer steps of 2 micro-batches (AdamW, so the optimizer state must come back too) over a
folder of 6 one-row micro-batches: 3 optimizer steps per epoch, shuffled, so checkpoint-2 is mid-epoch (position 4 of
6) and steps 3-4 cross into epoch 1, whose schedule differs. The resumed trainer is built on a fresh PackedDataset at
epoch 0, position 0: the position comes back from the checkpoint's ``packstream_loader.json``, not from the Trainer
skipping batches. With precomputed reference log-probs and no reference model, the resumed trainer is handed a
policy that is not the starting one (as a user handing in the checkpoint's weights would): the table comes back from
``packstream_ref_logps.json`` rather than being recomputed from that policy.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from packers import Batching, PackedDataset, PackstreamError, Sampling
from tests._shards import make_pair_row, make_row, write_shards
from tests.test_preference_trainers import ACCUM, B, EOS, _common, _kto, _models, _pairs

trl = pytest.importorskip("trl")

STEPS, SAVE = 4, 2


def _folder(tmp, kind: str) -> None:
    if kind == "dpo":
        pairs = _pairs(B * 6, seed=5)
        rows = [make_pair_row(pairs[i:i + B]) for i in range(0, len(pairs), B)]
    else:
        data = _kto(B * 6, seed=5)
        rows = [{**make_row([ex for ex, _ in data[i:i + B]]), "desirable": [g for _, g in data[i:i + B]]}
                for i in range(0, len(data), B)]
    write_shards(tmp / "packed", rows, budget=max(len(r["input_ids"]) for r in rows), eos_token_id=EOS)


def _dataset(tmp) -> PackedDataset:
    return PackedDataset(tmp / "packed", sampling=Sampling(shuffle=True, seed=3),
                         batching=Batching(batch_by="rows", batch_size=1, grad_accum=ACCUM))


def _config(kind: str, out, precompute: bool, workers: int):
    common = {**_common(out), "dataloader_num_workers": workers, "max_steps": STEPS, "save_strategy": "steps", "save_steps": SAVE,
              "optim": "adamw_torch", "learning_rate": 1e-2, "precompute_ref_log_probs": precompute,
              "max_length": None}
    if kind == "dpo":
        return trl.DPOConfig(**common, loss_type=["sigmoid"], beta=0.5)
    return trl.KTOConfig(**common, loss_type="kto", beta=0.1, desirable_weight=1.3, undesirable_weight=0.8)


def _trainer(kind: str, tmp, out, policy, ref, precompute: bool, workers: int = 0):
    from packers import PackedDPOTrainer, PackedKTOTrainer

    cls = PackedDPOTrainer if kind == "dpo" else PackedKTOTrainer
    return cls(policy, _config(kind, out, precompute, workers), _dataset(tmp), ref_model=ref)


def _logs(trainer) -> dict[int, dict]:
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h}


CASES = [("dpo", False, 0), ("dpo", True, 0), ("kto", False, 0), ("kto", True, 0), ("dpo", False, 2)]


@pytest.mark.parametrize("kind,precompute,workers", CASES,
                         ids=[f"{k}-{'precomputed' if p else 'ref_model'}-{w}workers" for k, p, w in CASES])
def test_resume_mid_epoch_gives_the_uninterrupted_steps(tmp_path, kind, precompute, workers):
    _folder(tmp_path, kind)
    policy, ref = _models()
    ref_or_none = (lambda: None) if precompute else (lambda: copy.deepcopy(ref))

    full = _trainer(kind, tmp_path, tmp_path / "full", copy.deepcopy(policy), ref_or_none(), precompute, workers)
    full.train()
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE}"
    saved = json.loads((checkpoint / "packstream_loader.json").read_text())
    assert (saved["epoch"], saved["position"]) == (0, SAVE * ACCUM), saved  # mid-epoch: 4 of 6 micro-batches
    assert (checkpoint / "packstream_ref_logps.json").exists() == precompute
    assert full.train_dataset.epoch == 1  # steps 3-4 crossed into epoch 1

    start = copy.deepcopy(policy)
    if precompute:  # not the starting policy: a recomputed table would differ
        with torch.no_grad():
            for p in start.parameters():
                p.add_(0.05)
    resumed = _trainer(kind, tmp_path, tmp_path / "resumed", start, ref_or_none(), precompute, workers)
    read = []  # (epoch, step) of every micro-batch the resumed run reads: no skipping by reading, no precompute pass
    ds, micro_batch = resumed.train_dataset, resumed.train_dataset.micro_batch
    ds.micro_batch = lambda step, epoch=None: read.append((ds.epoch if epoch is None else epoch, step)) or micro_batch(
        step, epoch)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    if not workers:  # (workers read copies of the dataset)
        assert read == [(0, 4), (0, 5), (1, 0), (1, 1)], read

    want, got = _logs(full), _logs(resumed)  # the resumed history starts with the checkpoint's steps 1-2
    assert sorted(got) == [1, 2, 3, 4], sorted(got)
    for step in (3, 4):
        keys = [k for k in want[step] if k not in ("epoch",) and isinstance(want[step][k], float)]
        assert "loss" in keys and "rewards/chosen" in keys, keys
        for k in keys:
            assert got[step][k] == pytest.approx(want[step][k], rel=1e-6, abs=1e-9), (step, k)
    worst = max(((a - b).abs().max().item() for a, b in zip(full.model.parameters(), resumed.model.parameters())))
    assert worst <= 1e-6, worst
    print(kind, precompute, workers, "largest parameter difference", worst)


def test_resume_refuses_a_checkpoint_without_the_loader_state(tmp_path):
    """A checkpoint without packstream_loader.json (another trainer's, or an older packstream's) is refused in one line
    naming the file and ignore_data_skip, instead of resuming at a position the Trainer would have to guess."""
    _folder(tmp_path, "dpo")
    policy, ref = _models()
    full = _trainer("dpo", tmp_path, tmp_path / "full", copy.deepcopy(policy), copy.deepcopy(ref), False)
    full.train()
    checkpoint = tmp_path / "full" / f"checkpoint-{SAVE}"
    (checkpoint / "packstream_loader.json").unlink()
    resumed = _trainer("dpo", tmp_path, tmp_path / "resumed", copy.deepcopy(policy), copy.deepcopy(ref), False)
    with pytest.raises(PackstreamError, match="packstream_loader.json.*ignore_data_skip=True"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
