"""Two ranks on CPU (gloo) of :class:`packers.PackedDPOTrainer` and :class:`packers.PackedKTOTrainer` (issue 43): over
one epoch every pair (KTO example) is trained exactly once, on one of the ranks, and the logged loss of each optimizer
step and the final parameters equal a one-rank run's.

The equivalence. Rows are one micro-batch each (``batch_by="rows", batch_size=1``), in shard order
(``shuffle=False, balance="none"``), so with 2 ranks and ``grad_accum=A`` micro-step ``s`` of rank ``r`` is row
``2s + r``, and optimizer step ``k`` holds rows ``2kA .. 2kA + 2A - 1``: the same rows as step ``k`` of one rank with
``grad_accum=2A``. Each micro-batch's loss is its mean over its pairs (examples), divided by the accumulation steps;
DDP averages the gradient over the ranks, so both runs step on ``1/(2A)`` times the sum over the same ``2A`` micro-batch
gradients. The Trainer logs the ranks' mean of their summed micro-batch losses: ``1/(2A)`` times the sum of the same
``2A`` micro-batch losses. The metrics are means over the ranks' values each micro-step (weighted by their counts,
as TRL's gather-then-mean is), so they match one rank's when every row holds the same number of pairs (examples); in
``dpo_uneven`` rows hold 2, 3 or 4 pairs, and only the loss and the parameters are compared.

KTO's reference point ``kl`` is, as in TRL, one value per micro-step averaged over the ranks' micro-batches, where one
rank has only its own. So the KTO folder's rows come in twins: row ``2s + 1`` holds row ``2s``'s tokens under other
example ids, its ``kl`` equals its twin's, and the ranks' mean is each rank's own (a ``kl`` summed instead of averaged
over ranks, or taken from one rank's garbage, would not be).

Each run is two processes from ``torch.multiprocessing``, joined under a deadline, with ``init_process_group`` on a
file store (no port) and a collective timeout, so a lost rank fails the test instead of hanging it. The Trainer finds
the process group already initialised and uses it (accelerate reads ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK``).
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pytest
import torch

from packers import Batching, PackedDataset, Sampling
from tests._shards import Example, make_pair_row, make_row, write_shards
from tests.test_preference_trainers import EOS, _common, _kto, _models, _pairs

trl = pytest.importorskip("trl")

B, ACCUM, STEPS, WORLD = 3, 2, 3, 2  # per row; micro-batches per rank per step; optimizer steps; ranks
ROWS = ACCUM * STEPS * WORLD
DEADLINE = 240  # seconds for both ranks, start-up included (about 15 s measured)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected", "kl")


def _folder(tmp: Path, kind: str) -> Path:
    if kind.startswith("dpo"):
        pairs = _pairs(B * ROWS)
        sizes = [B] * ROWS if kind == "dpo" else [B - 1, B, B + 1] * (ROWS // 3)  # uneven: 2, 3, 4 pairs a row
        cut = [sum(sizes[:i]) for i in range(ROWS + 1)]
        rows = [make_pair_row(pairs[a:z]) for a, z in zip(cut, cut[1:])]
    else:
        data = _kto(B * ROWS // 2)
        rows = []
        for i in range(0, len(data), B):
            for twin in ("", "+twin"):
                chunk = [(Example(ex.id + twin, ex.input_ids, ex.loss_mask), g) for ex, g in data[i:i + B]]
                rows.append({**make_row([ex for ex, _ in chunk]), "desirable": [g for _, g in chunk]})
    folder = tmp / f"packed-{kind}"
    write_shards(folder, rows, budget=max(len(r["input_ids"]) for r in rows), eos_token_id=EOS)
    return folder


def _train(folder: str, kind: str, precompute: bool, world: int, out: str) -> dict:
    """One run on this process (rank of ``world``): the example ids of every micro-batch trained, the logged steps;
    rank 0 also saves the final parameters to ``out.pt``."""
    from packers import PackedDPOTrainer, PackedKTOTrainer

    accum = ACCUM * WORLD // world
    ds = PackedDataset(folder, sampling=Sampling(shuffle=False),
                       batching=Batching(batch_by="rows", batch_size=1, grad_accum=accum, balance="none"))
    common = _common(Path(out).parent / f"trainer-{world}", num_train_epochs=1, max_length=None,
                     precompute_ref_log_probs=precompute)
    common.update(max_steps=-1, gradient_accumulation_steps=accum)  # one epoch
    common.pop("per_device_train_batch_size")  # rows of uneven pair counts: the dataset's Batching decides
    if kind.startswith("dpo"):
        base, args = PackedDPOTrainer, trl.DPOConfig(**common, loss_type=["sigmoid"], beta=0.5)
    else:
        base, args = PackedKTOTrainer, trl.KTOConfig(**common, loss_type="kto", beta=0.1, desirable_weight=1.3,
                                                     undesirable_weight=0.8)
    seen: list[list[str]] = []

    class Recording(base):
        def compute_loss(self, model, inputs, *a, **kw):
            seen.append(sorted({str(i).split("#")[0] for i in inputs["example_ids"]}))
            return super().compute_loss(model, inputs, *a, **kw)

    policy, ref = _models()
    trainer = Recording(model=copy.deepcopy(policy), args=args, train_dataset=ds, ref_model=copy.deepcopy(ref))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}, out + ".pt")
    return {"seen": seen, "logs": logs, "steps": trainer.state.global_step}


def _rank(rank: int, world: int, store: str, folder: str, kind: str, precompute: bool, out: str) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    done = False
    try:
        result = _train(folder, kind, precompute, world, out)
        Path(f"{out}.{rank}.json").write_text(json.dumps(result))
        done = True
    finally:
        if done:  # both ranks here before either tears gloo down (else a rank can abort: SIGABRT, "terminate called")
            dist.barrier()
            # ... and both out of the barrier: a rank that returns from it may still have its message in flight to
            # the other, which aborts if the socket closes first (seen once in ~20 runs before this wait).
            Path(f"{out}.left.{rank}").touch()
            end = time.monotonic() + 30
            while not all(Path(f"{out}.left.{r}").exists() for r in range(world)) and time.monotonic() < end:
                time.sleep(0.05)
        dist.destroy_process_group()


def _spawn(tmp: Path, folder: Path, kind: str, precompute: bool) -> list[dict]:
    import torch.multiprocessing as mp

    out = str(tmp / "ranks")
    ctx = mp.spawn(_rank, args=(WORLD, str(tmp / "store"), str(folder), kind, precompute, out), nprocs=WORLD,
                   join=False)
    end = time.monotonic() + DEADLINE
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > end:
                raise AssertionError(f"the {WORLD} ranks did not finish in {DEADLINE} s")
    finally:
        for p in ctx.processes:  # only the ranks this test started
            if p.is_alive():
                p.kill()
    return [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precompute", [False, True], ids=["ref_model", "precomputed"])
@pytest.mark.parametrize("kind", ["dpo", "dpo_uneven", "kto"])
def test_two_ranks_gloo_each_example_once_and_loss_equal_to_one_rank(tmp_path, kind, precompute):
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    folder = _folder(tmp_path, kind)
    ranks = _spawn(tmp_path, folder, kind, precompute)
    one = _train(str(folder), kind, precompute, 1, str(tmp_path / "one"))

    # Exactly once: the ranks' micro-batches together hold every pair (example) of the folder once.
    every = [i for rank in ranks for mb in rank["seen"] for i in mb]
    assert len(every) == len(set(every)) == B * ROWS, sorted(every)
    assert all(len(rank["seen"]) == ACCUM * STEPS for rank in ranks)  # the same number of micro-steps on each rank
    # Step k of the ranks trained the rows step k of one rank did.
    for k in range(STEPS):
        both = {i for rank in ranks for mb in rank["seen"][k * ACCUM:(k + 1) * ACCUM] for i in mb}
        assert both == {i for mb in one["seen"][k * ACCUM * WORLD:(k + 1) * ACCUM * WORLD] for i in mb}

    # The logged loss and metrics of every step: the same on both ranks, and equal to one rank's.
    assert ranks[0]["steps"] == one["steps"] == STEPS and len(one["logs"]) == STEPS
    loss_rel = max(abs(g["loss"] - w["loss"]) / abs(w["loss"]) for rank in ranks
                   for g, w in zip(rank["logs"], one["logs"]))
    for rank in ranks:
        assert len(rank["logs"]) == STEPS
        for got, want in zip(rank["logs"], one["logs"]):
            for key in ("loss",) + METRICS:
                if key in want and (key == "loss" or kind != "dpo_uneven"):
                    assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), (key, got, want)
    if kind == "kto":
        assert any(h["kl"] > 0 for h in one["logs"]), one["logs"]  # the reference point is exercised

    # The final parameters.
    a, b = torch.load(tmp_path / "ranks.pt"), torch.load(tmp_path / "one.pt")
    assert a.keys() == b.keys()
    worst = max(((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)).item() for k in a)
    assert worst <= 1e-4, worst
    print(kind, precompute, f"largest loss difference {loss_rel:.2e}, parameter difference {worst:.2e} (relative)")
