"""Packed preference pairs compute exactly what unpacked ones do (tiny random models, fp32, CPU).

For Llama, Qwen2 and Mistral (also with a sliding window shorter than the sequences), with ``eager``
and ``sdpa``, in ``train()`` mode with the model's default config and in ``eval()``:

* each sequence's completion log-prob from one packed pair batch (:func:`packers.sequence_logps`)
  equals the sequence run alone, max abs diff <= 1e-5;
* the DPO loss and its gradients (policy, with a frozen reference model's pass over the same batch)
  equal a padded DPO reference on the same pairs (a right-padded batch with an attention mask);
* the guard passes pair batches and refuses a leaking one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from packers import Collator, PackstreamError, check_packing_safe, install_packing_guard, sequence_logps
from tests._shards import make_pair_row, random_pairs
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
    assert torch.allclose(lp.chosen_mean, want_c / torch.tensor([len(p.chosen) for p in PAIRS]), atol=TOL)


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
    assert b.tokens.shape[0] == a.tokens.shape[0] + 2 and b.tokens[b.pair_index.flatten()].min() > 0


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
