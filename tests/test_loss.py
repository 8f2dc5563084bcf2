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
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from packers import (
    Batching, Collator, PackedDataset, PackstreamError, Sampling, Sharding, example_losses, loss, sequence_logps,
)
from tests._models import tiny_model
from tests._shards import (
    Example, make_pair_row, make_row, pack_first_fit, random_examples, random_pairs, write_manifest, write_shards,
)

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
    """Eval parity: per-example mean losses from packed rows (shuffle off; fixed shape or not, padded or full rows)
    = unpacked, each under its own id."""
    model = tiny_llama().eval()
    by_id = {e.id: e for e in examples()}
    ds = PackedDataset(folder, sampling=Sampling(shuffle=False), batching=Batching(batch_size=3))
    checked = 0
    for rows in itertools.islice(ds, 4):
        ids = [i for r in rows for i in r["example_ids"]]
        # these rows are full (64 tokens): budget + 7 pads every row, so a padding sequence follows each one
        for collate in (Collator(), Collator(fixed_shape=True, budget=BUDGET), Collator(fixed_shape=True, budget=BUDGET + 7)):
            batch = collate(rows)
            with torch.no_grad():
                out = example_losses(model(**batch).logits, batch)
            assert list(out.ids) == ids and out.loss.shape == (len(ids),)
            for i, value in out.by_id().items():
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


def test_example_losses_fixed_shape_worked_example():
    """Two rows, each shorter than the budget, collated with fixed_shape: each row's padding is a sequence right
    after it, yet every example gets its own loss under its own id, and no padding gets one.

        row 0  [ 5  9 41 | 5 30 | 0 0 0 ]     examples "a" (targets 9, 41), "b" (target 30), padding
        row 1  [ 7  8  6  1 | 0 0 0 0 ]       example "c" (targets 6, 1), padding
        sequences  a=0  b=1  pad=2  c=3  pad=4          example_index [0, 1, 3]

    Synthetic logits: 0 everywhere, except ``boost[e]`` on the target token where example e predicts it, so each
    example's mean loss is ``log(V - 1 + exp(boost)) - boost`` (V = 50): a 2.0323, b 2.9458, c log(50) = 3.9120.
    Pairing per-sequence values with the ids in order (the old documented use) gave c the padding's NaN.
    """
    V, boost = 50, {"a": 2.0, "b": 1.0, "c": 0.0}
    rows = [{"input_ids": [5, 9, 41, 5, 30], "loss_mask": [0, 1, 1, 0, 1], "seq_offsets": [0, 3, 5],
             "example_ids": ["a", "b"]},
            {"input_ids": [7, 8, 6, 1], "loss_mask": [0, 0, 1, 1], "seq_offsets": [0, 4], "example_ids": ["c"]}]
    batch = Collator(fixed_shape=True, budget=8)(rows)
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 12, 16] and batch["example_index"].tolist() == [0, 1, 3]
    logits = torch.zeros(1, 16, V)
    for example, targets in (("a", [(1, 9), (2, 41)]), ("b", [(4, 30)]), ("c", [(10, 6), (11, 1)])):
        for t, token in targets:  # token at batch position t, predicted from position t - 1
            logits[0, t - 1, token] = boost[example]
    out = example_losses(logits, batch)
    want = {e: math.log(V - 1 + math.exp(b)) - b for e, b in boost.items()}
    assert out.ids == ("a", "b", "c") and out.targets.tolist() == [2, 1, 2]
    assert out.by_id() == pytest.approx(want, abs=1e-6)
    assert round(want["a"], 4) == 2.0323 and round(want["b"], 4) == 2.9458 and round(want["c"], 4) == 3.912
    assert not out.loss.isnan().any()


def test_example_losses_old_tensor_use_names_the_new_spelling():
    """example_losses returned a [N] tensor (one value per sequence, padding included); the ways it was used fail
    loudly, naming .loss / .ids / .by_id(), instead of pairing values with the wrong ids."""
    rows = [{"input_ids": [5, 9, 41], "loss_mask": [0, 1, 1], "seq_offsets": [0, 3]}]
    out = example_losses(torch.zeros(1, 3, 50), Collator()(rows))
    for old in (lambda: out[:1], lambda: out.tolist(), lambda: list(zip(["x"], out)), lambda: torch.isnan(out),
                lambda: out.mean()):
        with pytest.raises(PackstreamError, match=r"use \.loss .*\.ids, or \.by_id\(\)"):
            old()
    with pytest.raises(PackstreamError, match="carried no example_ids"):  # rows without ids: .loss, in order
        out.by_id()
    assert out.ids is None and out.loss.shape == (1,)
    with pytest.raises(AttributeError):
        out.no_such_name
    batch = Collator(return_example_index=False)(rows)
    with pytest.raises(PackstreamError, match="has no example_index"):
        example_losses(torch.zeros(1, 3, 50), batch)


def _split(items: list, per_row: list[int]) -> list[list]:
    out, k = [], 0
    for n in per_row:
        out.append(items[k:k + n])
        k += n
    return out


@settings(max_examples=150, deadline=None)
@given(per_row=st.lists(st.integers(1, 3), min_size=1, max_size=4), pairs=st.booleans(), fixed=st.booleans(),
       slack=st.integers(0, 3), hollow=st.booleans(), seed=st.integers(0, 2**16))
def test_per_example_values_follow_their_ids(per_row, pairs, fixed, slack, hollow, seed):
    """Over generated batches (1-4 rows of 1-3 examples or pairs each; fixed shape or not; the longest row full
    when ``slack`` is 0, the others padded under fixed_shape) and random logits: example_losses and
    sequence_logps give every example exactly once, under its own id, the value of its own tokens' logits by
    hand and the value the same helper gives that example collated alone; NaN only for an example with no
    target (``hollow`` adds one), never for a padding sequence's sake."""
    V = 13
    if pairs:
        items = random_pairs(sum(per_row), seed=seed, max_prompt=5, max_completion=6, vocab=V)
        rows = [make_pair_row(chunk) for chunk in _split(items, per_row)]
        examples_ = [e for p in items for e in p.sides()]
    else:
        examples_ = random_examples(sum(per_row), seed=seed, min_len=2, max_len=12, vocab=V)
        if hollow:  # an example without a target: its first token never is one
            examples_[0] = Example("hollow", examples_[0].input_ids, [1] + [0] * (len(examples_[0].input_ids) - 1))
        rows = [make_row(chunk) for chunk in _split(examples_, per_row)]
    budget = max(len(r["input_ids"]) for r in rows) + slack
    batch = Collator(fixed_shape=fixed, budget=budget)(rows)
    T = batch["input_ids"].shape[1]
    logits = torch.randn(1, T, V, generator=torch.Generator().manual_seed(seed))

    # each example's tokens in the batch, from the rows alone: rows back to back, each padded to the budget if fixed
    where, at = {}, 0
    for r in rows:
        offs = r["seq_offsets"]
        for k, i in enumerate(r["example_ids"]):
            where[i] = (at + offs[k], at + offs[k + 1])
        at += budget if fixed else len(r["input_ids"])
    assert at == T
    ids = [i for r in rows for i in r["example_ids"]]
    assert len(set(ids)) == len(ids) == len(examples_)

    losses, logps = example_losses(logits, batch), sequence_logps(logits, batch)
    assert list(losses.ids) == list(logps.ids) == ids  # each id exactly once, in the rows' order
    assert losses.loss.shape == logps.sum.shape == (len(ids),)
    for k, e in enumerate(examples_):
        a, z = where[e.id]
        assert batch["input_ids"][0, a:z].tolist() == e.input_ids
        targets = [j for j in range(1, z - a) if e.loss_mask[j]]
        lp = torch.log_softmax(logits[0, a:z].double(), -1)
        by_hand = [float(lp[j - 1, e.input_ids[j]]) for j in targets]
        j = ids.index(e.id)
        assert int(losses.targets[j]) == int(logps.tokens[j]) == len(targets)
        assert logps.sum[j].item() == pytest.approx(sum(by_hand), abs=1e-5)
        if targets:
            assert losses.loss[j].item() == pytest.approx(-sum(by_hand) / len(targets), abs=1e-5)
        else:
            assert e.id == "hollow" and math.isnan(losses.loss[j].item())
        alone = Collator()([make_row([e])])  # the example alone, its own logits
        alone_losses, alone_logps = example_losses(logits[:, a:z], alone), sequence_logps(logits[:, a:z], alone)
        assert alone_losses.ids == (e.id,) and alone_logps.ids == (e.id,)
        assert torch.equal(alone_losses.loss[0], losses.loss[j]) or (not targets and alone_losses.loss.isnan().all())
        assert alone_logps.sum[0].item() == logps.sum[j].item()
    if pairs:
        assert logps.pair_ids == tuple(p.id for p in items)
        for n, p in enumerate(items):
            assert logps.chosen[n] == logps.sum[ids.index(p.id + "#chosen")]
            assert logps.rejected[n] == logps.sum[ids.index(p.id + "#rejected")]


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
