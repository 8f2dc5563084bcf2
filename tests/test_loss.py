"""Loss weights as data: packed training computes the loss and gradients an unpacked reference computes.

For each weighting (token, example, source), gradient accumulation of 1 and 4 micro-batches, one rank
and two ranks (gloo, DDP averaging the gradients): the optimizer step's loss and gradients from
``packers.loss`` over the packed micro-batches equal those of the same examples run one by one, unpacked,
with the weighting's definition, within 1e-6 relative (tiny random Llama, fp32, CPU). The per-example
eval loss of packed rows equals each example's own, within 1e-6.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from packers import Batching, Collator, PackedDataset, PackstreamError, Sampling, Sharding, example_losses, loss
from tests._models import tiny_model
from tests._shards import Example, pack_first_fit, random_examples, write_manifest, write_shards

VOCAB = 97
BUDGET = 64
REL = 1e-6
SOURCES = {"a.jsonl": ("arith", 1.0), "b.jsonl": ("chat", 3.0)}  # source -> (data set name, loss_weight)


def examples() -> list[Example]:
    """Random examples from two sources; some with no target but their first token (a 1-token example)."""
    out = []
    for i, e in enumerate(random_examples(90, seed=11, vocab=VOCAB, min_len=2, max_len=30)):
        source = "a.jsonl" if i % 3 else "b.jsonl"
        out.append(Example(f"{source}@{i}", e.input_ids, e.loss_mask))
    out.append(Example("b.jsonl@900", [7], [1]))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Packed shards whose manifest traces every example to its --config data set (as packstream pack writes it)."""
    path = tmp_path_factory.mktemp("loss")
    write_shards(path, pack_first_fit(examples(), BUDGET), budget=BUDGET, num_shards=2)
    inputs = [{"path": f"/data/{s}", "source": s, "kind": "jsonl", "split": "", "dataset": i}
              for i, s in enumerate(SOURCES)]
    config = {"max_tokens": BUDGET, "output_format": "arrow",
              "config": [{"name": name, "weight": 1.0, "loss_weight": lw} for name, lw in SOURCES.values()]}
    write_manifest(path, inputs=inputs, config=config)
    return path


def tiny_llama() -> torch.nn.Module:
    return tiny_model("llama", "sdpa", vocab_size=VOCAB).train()


def dataset(folder, weighting, grad_accum, world, rank, source_weights=None) -> PackedDataset:
    return PackedDataset(folder, sampling=Sampling(seed=5), sharding=Sharding(world_size=world, rank=rank),
                         batching=Batching(batch_size=2, grad_accum=grad_accum, loss_weighting=weighting,
                                           source_weights=source_weights))


def optimizer_steps(ds: PackedDataset) -> list[list[list[dict]]]:
    """This rank's micro-batches, grouped by optimizer step."""
    batches = list(ds)
    ga = ds.batching.grad_accum
    return [batches[i : i + ga] for i in range(0, len(batches), ga)]


def packed_step(model, micro_batches) -> tuple[float, list[torch.Tensor]]:
    """Backpropagate packers.loss over one rank's micro-batches of one optimizer step; (loss, grads)."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for rows in micro_batches:
        batch = Collator()(rows)
        out = model(**{k: v for k, v in batch.items() if k != "loss_weights"})
        value = loss(out.logits, batch)
        value.backward()
        total += value.item()
    return total, [p.grad.detach().clone() for p in model.parameters()]


def reference_step(model, ids: list[str], weighting: str) -> tuple[float, list[torch.Tensor]]:
    """The same examples unpacked, one forward each, with the weighting's definition (module docstring)."""
    by_id = {e.id: e for e in examples()}
    model.zero_grad(set_to_none=True)
    parts = []
    for i in ids:
        e = by_id[i]
        labels = torch.tensor([t if m else -100 for t, m in zip(e.input_ids, e.loss_mask)])
        labels[0] = -100
        logits = model(input_ids=torch.tensor([e.input_ids])).logits[0]
        ce = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="none")
        n = int((labels[1:] != -100).sum())
        weight = {"token": 1.0, "example": 1.0 / n if n else 0.0,
                  "source": SOURCES[i.split("@")[0]][1]}[weighting]
        denominator = {"token": n, "example": 1.0 if n else 0.0, "source": weight * n}[weighting]
        parts.append((ce.sum() * weight, denominator))
    total = sum(d for _, d in parts)
    value = sum(v for v, _ in parts) / total
    value.backward()
    return value.item(), [p.grad.detach().clone() for p in model.parameters()]


def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).double().pow(2).sum()) for x, y in zip(a, b)) ** 0.5
    return num / sum(float(y.double().pow(2).sum()) for y in b) ** 0.5


WEIGHTINGS = ["token", "example", "source"]


@pytest.mark.parametrize("weighting", WEIGHTINGS)
@pytest.mark.parametrize("grad_accum", [1, 4])
def test_one_rank_packed_loss_and_gradients_equal_unpacked(folder, weighting, grad_accum):
    model = tiny_llama()
    ds = dataset(folder, weighting, grad_accum, 1, 0)
    steps = optimizer_steps(ds)
    assert len(steps) == ds.optimizer_steps
    for step in (steps[0], steps[-1]):  # a full one, and the epoch's last (possibly short)
        ids = [i for rows in step for r in rows for i in r["example_ids"]]
        got, grads = packed_step(model, step)
        want, ref = reference_step(model, ids, weighting)
        assert got == pytest.approx(want, rel=REL) and rel(grads, ref) <= REL, (got, want, rel(grads, ref))


def test_the_weightings_differ(folder):
    """So that the tests above cannot pass by computing one thing three times."""
    model = tiny_llama()
    ids = [i for r in dataset(folder, "token", 1, 1, 0).micro_batch(0) for i in r["example_ids"]]
    values = {w: reference_step(model, ids, w)[0] for w in WEIGHTINGS}
    assert len({round(v, 6) for v in values.values()}) == 3, values


def test_token_weighting_is_hf_num_items_in_batch(folder):
    """With loss_weighting="token" the planned denominator is the step's target count, what HF's Trainer passes
    as num_items_in_batch (counted over labels[..., 1:]): the model's own loss agrees."""
    model = tiny_llama()
    ds = dataset(folder, "token", 4, 1, 0)
    step = optimizer_steps(ds)[0]
    batches = [Collator()(rows) for rows in step]
    n = sum(int((b["labels"][..., 1:] != -100).sum()) for b in batches)
    assert ds.loss_denominators()[0] == n == step[0][0]["loss_denominator"]
    with torch.no_grad():
        hf = sum(model(**{k: v for k, v in b.items() if k != "loss_weights"}, num_items_in_batch=n).loss.item()
                 for b in batches)
        ours = sum(loss(model(**b).logits, b).item() for b in batches)  # loss_weights in the batch: ignored by the model
    assert ours == pytest.approx(hf, rel=REL)


def test_source_weights_from_the_config_or_given(folder, tmp_path):
    ds = dataset(folder, "source", 1, 1, 0)
    rows = ds.micro_batch(0)
    for r in rows:  # each target token weighs its data set's loss_weight, over the step's weighted total
        w = r["loss_weights"] * r["loss_denominator"]
        for k, i in enumerate(r["example_ids"]):
            a, z = r["seq_offsets"][k], r["seq_offsets"][k + 1]
            on = w[a:z][w[a:z] > 0]
            assert np.allclose(on, SOURCES[i.split("@")[0]][1], rtol=1e-6)
    given = dataset(folder, "source", 1, 1, 0, source_weights={"arith": 2.0, "chat": 0.0})
    assert all((r["loss_weights"] == 0).all() for r in given.micro_batch(0) if all(i.startswith("b.") for i in r["example_ids"]))
    with pytest.raises(PackstreamError, match=r"source_weights names \['math'\]"):
        dataset(folder, "source", 1, 1, 0, source_weights={"math": 1.0, "arith": 1.0, "chat": 1.0})
    with pytest.raises(PackstreamError, match=r"no weight for \['chat'\]"):
        dataset(folder, "source", 1, 1, 0, source_weights={"arith": 1.0})
    with pytest.raises(PackstreamError, match="loss_weighting='source' only"):
        dataset(folder, "token", 1, 1, 0, source_weights={"arith": 1.0, "chat": 1.0})
    bare = tmp_path / "bare"  # a folder whose manifest cannot trace ids to data sets
    write_shards(bare, pack_first_fit(examples(), BUDGET), budget=BUDGET)
    with pytest.raises(PackstreamError, match="lists no 'inputs'"):
        dataset(bare, "source", 1, 1, 0)


def test_example_losses_equal_each_example_alone(folder):
    """Eval parity: per-example mean losses from packed rows (shuffle off, fixed shape or not) = unpacked."""
    model = tiny_llama().eval()
    by_id = {e.id: e for e in examples()}
    ds = PackedDataset(folder, sampling=Sampling(shuffle=False), batching=Batching(batch_size=3))
    checked = 0
    for rows in itertools.islice(ds, 4):
        ids = [i for r in rows for i in r["example_ids"]]
        for collate in (Collator(), Collator(fixed_shape=True, budget=BUDGET)):
            batch = collate(rows)
            with torch.no_grad():
                got = example_losses(model(**batch).logits, batch)[: len(ids)]
            for i, value in zip(ids, got.tolist()):
                e = by_id[i]
                labels = torch.tensor([t if m else -100 for t, m in zip(e.input_ids, e.loss_mask)])
                labels[0] = -100
                if not (labels[1:] != -100).any():
                    assert np.isnan(value)
                    continue
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([e.input_ids])).logits[0]
                want = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100).item()
                assert value == pytest.approx(want, rel=REL), (i, value, want)
                checked += 1
    assert checked > 20


# -- two ranks on CPU (gloo), DDP averaging the gradients --------------------------------------------------------


def _ranks_worker(rank: int, world: int, store: str, folder: str, out: str) -> None:
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    result = {}
    done = False
    try:
        for weighting in WEIGHTINGS:
            for ga in (1, 4):
                model = DistributedDataParallel(tiny_llama())
                ds = dataset(folder, weighting, ga, world, rank)
                steps = optimizer_steps(ds)
                for which in (0, len(steps) - 1):
                    value, grads = packed_step(model, steps[which])
                    mean = torch.tensor([value])
                    dist.all_reduce(mean)  # the ranks' values averaged: the step's loss
                    ids = [i for rows in steps[which] for r in rows for i in r["example_ids"]]
                    key = f"{weighting}/{ga}/{which}"
                    result[key] = {"loss": mean.item() / world, "ids": ids, "steps": len(steps), "len": len(ds)}
                    torch.save(grads, f"{out}.{key.replace('/', '_')}.{rank}.pt")
        done = True
    finally:
        Path(f"{out}.{rank}.json").write_text(json.dumps(result))
        if done:  # both ranks here before either tears gloo down (else a rank can abort: SIGABRT, "terminate called")
            dist.barrier()
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_gloo_packed_loss_and_gradients_equal_unpacked(folder, tmp_path):
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    out = str(tmp_path / "result")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    mp.spawn(_ranks_worker, args=(2, str(tmp_path / "store"), str(folder), out), nprocs=2, join=True)
    results = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(2)]
    model = tiny_llama()
    assert len(results[0]) == 3 * 2 * 2
    for key, r0 in results[0].items():
        r1 = results[1][key]
        assert r0["steps"] == r1["steps"] and r0["len"] == r1["len"]  # equal steps on both ranks
        assert r0["loss"] == pytest.approx(r1["loss"], rel=1e-12)
        weighting = key.split("/")[0]
        want, ref = reference_step(model, r0["ids"] + r1["ids"], weighting)
        grads = torch.load(f"{out}.{key.replace('/', '_')}.0.pt")
        assert torch.load(f"{out}.{key.replace('/', '_')}.1.pt")[0].equal(grads[0])  # DDP: the same averaged grads
        assert r0["loss"] == pytest.approx(want, rel=REL) and rel(grads, ref) <= REL, (key, r0["loss"], want, rel(grads, ref))
