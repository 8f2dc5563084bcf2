"""Packed preference pairs compute exactly what unpacked ones do (tiny random models, fp32, CPU).

For Llama, Qwen2 and Mistral (also with a sliding window shorter than the sequences), with ``eager``
and ``sdpa``, in ``train()`` mode with the model's default config and in ``eval()``:

* each sequence's completion log-prob from one packed pair batch (:func:`packers.sequence_logps`)
  equals the sequence run alone, max abs diff <= 1e-5;
* the DPO loss and its gradients (policy, with a frozen reference model's pass over the same batch)
  equal a padded DPO reference on the same pairs (a right-padded batch with an attention mask);
* the guard passes pair batches and refuses a leaking one.

And for ~1,000-token completions (tiny Llama, sdpa; and random logits): each side's log-prob is summed in
float64 and returned in float64, within 1e-5 of the side alone, never the fp32 running sum's drift.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from packers import Collator, PackstreamError, check_packing_safe, install_packing_guard, sequence_logps
from tests._shards import Pair, make_pair_row, make_row, random_pairs
from tests._models import MODEL_IDS, MODELS, TOL, VOCAB, tiny_model

# Five pairs in two rows; completions of different lengths; prompts of 1..9 tokens.
PAIRS = random_pairs(5, seed=11, max_prompt=9, max_completion=12, vocab=VOCAB)
ROWS = [make_pair_row(PAIRS[:3]), make_pair_row(PAIRS[3:])]
BETA = 0.1


def alone_logp(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The completion's summed log-prob with the sequence run alone (a plain call, default config)."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1:].sum()


def padded_logps(model, pairs) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed completion log-probs of ``pairs`` in one right-padded batch, as a padded DPO
    trainer computes them: chosen sequences then rejected ones, an attention mask, a completion mask."""
    seqs = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    n = max(len(a) + len(b) for a, b in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    attn = torch.zeros(len(seqs), n, dtype=torch.long)
    comp = torch.zeros(len(seqs), n, dtype=torch.bool)
    for i, (a, b) in enumerate(seqs):
        ids[i, : len(a) + len(b)] = torch.tensor(a + b)
        attn[i, : len(a) + len(b)] = 1
        comp[i, len(a): len(a) + len(b)] = True
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
    per_seq = (lp * comp[:, 1:]).sum(1)
    return per_seq[: len(pairs)], per_seq[len(pairs):]


def dpo_loss(pc, pr, rc, rr) -> torch.Tensor:
    return -F.logsigmoid(BETA * ((pc - rc) - (pr - rr))).mean()


@pytest.mark.parametrize("kind,overrides", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_packed_pair_logps_equal_alone(kind, overrides, attn, mode):
    model = getattr(tiny_model(kind, attn, **overrides), mode)()
    batch = Collator()(ROWS)
    check_packing_safe(model, batch)
    lp = sequence_logps(model(**batch).logits, batch)
    with torch.no_grad():
        want_c = torch.stack([alone_logp(model, p.prompt, p.chosen) for p in PAIRS])
        want_r = torch.stack([alone_logp(model, p.prompt, p.rejected) for p in PAIRS])
    assert (lp.chosen - want_c).abs().max().item() <= TOL
    assert (lp.rejected - want_r).abs().max().item() <= TOL
    assert lp.chosen_tokens.tolist() == [len(p.chosen) for p in PAIRS]
    assert torch.allclose(lp.chosen_mean.float(), want_c / torch.tensor([len(p.chosen) for p in PAIRS]), atol=TOL)


@pytest.mark.parametrize("kind,overrides", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_packed_dpo_loss_and_grads_equal_padded(kind, overrides, attn, mode):
    policy = getattr(tiny_model(kind, attn, **overrides), mode)()
    torch.manual_seed(1)
    reference = tiny_model(kind, attn, **overrides).eval().requires_grad_(False)
    for p in reference.parameters():  # another set of weights than the policy's
        p.add_(0.05 * torch.randn_like(p))
    batch = Collator()(ROWS)

    policy.zero_grad()
    lp = sequence_logps(policy(**batch).logits, batch)
    with torch.no_grad():
        ref = sequence_logps(reference(**batch).logits, batch)
    packed = dpo_loss(lp.chosen, lp.rejected, ref.chosen, ref.rejected)
    packed.backward()
    packed_grads = [p.grad.clone() for p in policy.parameters()]

    policy.zero_grad()
    pc, pr = padded_logps(policy, PAIRS)
    with torch.no_grad():
        rc, rr = padded_logps(reference, PAIRS)
    padded = dpo_loss(pc, pr, rc, rr)
    padded.backward()
    assert abs(packed.item() - padded.item()) <= TOL
    assert (ref.chosen - rc).abs().max().item() <= TOL and (ref.rejected - rr).abs().max().item() <= TOL
    d_grad = max((p.grad - g).abs().max().item() for p, g in zip(policy.parameters(), packed_grads))
    assert d_grad <= TOL, d_grad


def test_fixed_shape_pairs_change_nothing():
    model = tiny_model("llama", "sdpa").train()
    loose, fixed = Collator()(ROWS), Collator(fixed_shape=True, budget=80, pad_token_id=3)(ROWS)
    a = sequence_logps(model(**loose).logits, loose)
    b = sequence_logps(model(**fixed).logits, fixed)
    assert (a.chosen - b.chosen).abs().max().item() <= TOL and (a.rejected - b.rejected).abs().max().item() <= TOL
    # two rows padded: two more sequences in the batch, no more examples in the values
    assert len(fixed["cu_seq_lens_q"]) == len(loose["cu_seq_lens_q"]) + 2
    assert b.ids == a.ids and len(b.ids) == b.tokens.shape[0] == 2 * len(PAIRS) and b.tokens.min() > 0
    assert (a.sum - b.sum).abs().max().item() <= TOL and b.pair_ids == tuple(p.id for p in PAIRS)


def test_guard_covers_pair_batches():
    """A guarded model runs pair batches; the leaking variant (a cache, sdpa, train) is refused, and it does leak."""
    model = tiny_model("qwen2", "sdpa").train()
    handle = install_packing_guard(model)
    batch = Collator()(ROWS)
    model(**batch)
    leaky = Collator(disable_cache=False)(ROWS)
    with pytest.raises(PackstreamError, match="use_cache"):
        model(**leaky)
    handle.remove()
    with torch.no_grad():
        good = sequence_logps(model(**batch).logits, batch)
        bad = sequence_logps(model(**leaky).logits, leaky)
    assert (good.rejected - bad.rejected).abs().max().item() > 1e-3  # the chosen side leaks into the rejected


def test_sequence_logps_refuses_other_shapes():
    batch = Collator()(ROWS)
    T = batch["input_ids"].shape[1]
    with pytest.raises(PackstreamError, match="expected \\[1, .*, vocab\\]"):
        sequence_logps(torch.zeros(1, T - 1, 5), batch)
    plain = {k: v for k, v in batch.items() if k not in ("completion_mask", "pair_index")}
    lp = sequence_logps(torch.zeros(1, T, VOCAB), plain)  # no pairs: targets from the labels, per sequence
    assert lp.tokens.tolist() == [len(c) for p in PAIRS for c in (p.chosen, p.rejected)]
    with pytest.raises(PackstreamError, match="holds no preference pairs"):
        lp.chosen
    # per-example values need to know which sequences are examples, and each its id
    with pytest.raises(PackstreamError, match="has no example_index"):
        sequence_logps(torch.zeros(1, T, VOCAB), {k: v for k, v in batch.items() if k != "example_index"})
    with pytest.raises(PackstreamError, match="9 example_ids for 10 examples"):
        sequence_logps(torch.zeros(1, T, VOCAB), {**batch, "example_ids": batch["example_ids"][:-1]})
    with pytest.raises(PackstreamError, match="does not name increasing sequences"):
        sequence_logps(torch.zeros(1, T, VOCAB), {**batch, "example_index": batch["example_index"] + 1})
    with pytest.raises(PackstreamError, match="pair_index names sequences .* that are not all examples"):
        sequence_logps(torch.zeros(1, T, VOCAB), {**batch, "example_index": batch["example_index"][:-1],
                                                  "example_ids": batch["example_ids"][:-1]})


# -- long completions: summed in float64 ---------------------------------------------------------------------------

def long_pairs(n: int = 2, seed: int = 3) -> list[Pair]:
    """``n`` pairs with completions of about 1,000 tokens (summed log-probs of about -4,600)."""
    rng = np.random.default_rng(seed)
    return [Pair(f"long@{i}", rng.integers(2, VOCAB, size=8).tolist(), rng.integers(2, VOCAB, size=1000 + 7 * i).tolist(),
                 rng.integers(2, VOCAB, size=990 + 5 * i).tolist()) for i in range(n)]


@pytest.mark.parametrize("fixed", [False, True])
def test_long_completion_logps_are_exact_sums(fixed):
    """Two pairs with ~1,000-token completions packed in one row behind a short pair (random logits): each
    side's log-prob is its per-token log-probs' exact sum (float64: within 1e-6), and equals the side collated
    alone. Added one at a time in float32, as before, the same
    terms missed their exact sum by up to 3.4e-3."""
    pairs = random_pairs(1, seed=4, max_prompt=6, max_completion=6, vocab=VOCAB) + long_pairs()
    row = make_pair_row(pairs)
    batch = Collator(fixed_shape=fixed, budget=len(row["input_ids"]) + 5)([row])
    logits = 3 * torch.randn(1, batch["input_ids"].shape[1], VOCAB, generator=torch.Generator().manual_seed(0))
    lp = sequence_logps(logits, batch)
    offs, drift = row["seq_offsets"], []
    for k, side in enumerate(p.sides()[j] for p in pairs for j in (0, 1)):
        a, z = offs[k], offs[k + 1]
        ids = torch.tensor(side.input_ids)
        first = side.loss_mask.index(1)
        terms = torch.log_softmax(logits[0, a:z - 1], -1).gather(1, ids[1:, None])[first - 1:, 0].numpy()
        exact = math.fsum(terms.astype(np.float64).tolist())
        got = lp.sum[k].item()
        assert lp.ids[k] == side.id and lp.tokens[k] == len(terms)
        assert lp.sum.dtype == torch.float64 and abs(got - exact) <= 1e-6, (side.id, got, exact)
        drift.append(abs(float(np.cumsum(terms, dtype=np.float32)[-1]) - exact))  # the old way: fp32, one at a time
        alone = Collator()([make_row([side])])
        assert abs(sequence_logps(logits[:, a:z], alone).sum[0].item() - got) <= 1e-5
    assert max(drift) > 1e-3, drift  # so the float64 sums above are what passes, not the data


def test_long_completion_dpo_logps_equal_alone():
    """DPO log-probs of two pairs with ~1,000-token completions, packed in one row, equal each side run alone
    (tiny Llama, fp32, sdpa): the float64 sums within 1e-5 (measured 5.7e-6: the model's own packed-vs-alone
    rounding over 1,000 tokens), and sequence_logps returns those float64 sums as they are."""
    from tests._internals import sequence_sums

    pairs = long_pairs()
    model = tiny_model("llama", "sdpa", max_position_embeddings=1100).eval()
    batch = Collator()([make_pair_row(pairs)])
    with torch.no_grad():
        logits = model(**batch).logits
        packed64, _, _ = sequence_sums(logits, batch)
        lp = sequence_logps(logits, batch)
        for k, side in enumerate(s for p in pairs for s in p.sides()):
            alone = Collator()([make_row([side])])
            alone_logits = model(**alone).logits
            alone64 = sequence_sums(alone_logits, alone)[0][0].item()
            assert abs(packed64[k].item() - alone64) <= 1e-5, (side.id, packed64[k].item(), alone64)
            assert lp.sum[k].item() == packed64[k].item()  # never rounded to float32
            public_alone = sequence_logps(alone_logits, alone).sum[0].item()
            assert abs(lp.sum[k].item() - public_alone) <= 1e-5, (side.id, lp.sum[k], public_alone)
    assert lp.pair_ids == ("long@0", "long@1") and lp.chosen_tokens.tolist() == [1000, 1007]


@pytest.mark.parametrize("loss", ["dpo", "orpo", "simpo"])
def test_dpo_example_trains(tmp_path, loss):
    """examples/dpo.py on a folder of packed pairs (written by tests/_shards.py): the loss falls."""
    import importlib.util
    from pathlib import Path

    from tests._shards import write_shards

    pairs = random_pairs(48, seed=5, max_prompt=6, max_completion=10, vocab=64)
    rows = [make_pair_row(pairs[i:i + 3]) for i in range(0, len(pairs), 3)]
    write_shards(tmp_path / "pairs", rows, budget=96, eos_token_id=None)
    path = Path(__file__).resolve().parents[1] / "examples" / "dpo.py"
    spec = importlib.util.spec_from_file_location("dpo_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = module.main([str(tmp_path / "pairs"), "--loss", loss, "--steps", "12", "--pairs-per-step", "6",
                       "--vocab", "64", "--lr", "1e-2", "--threads", "1"])
    assert out["last"] < out["first"], out["history"]
