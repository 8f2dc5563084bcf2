"""Opening a folder changes no model's packing probe (issue 55, part 3).

``PackedDataset`` used to raise a process-wide budget in the guard: every later probe of every model reached at
least the longest budget of any folder opened in the process (a 2,048-token Gemma 3 probe at 8,192 tokens, 4x the
time). The probe length now belongs to the model or batch it guards: ``max_length`` of
``install_packing_guard``/``check_packing_safe``, or the length the packed trainers give their models (their folder's
budget). These tests read the lengths the probe ran at from its verdicts (:class:`Verdict` ``reach`` and ``probes``).
"""

from __future__ import annotations

import sys

import pytest
import torch

from packers import Batching, Collator, PackedDataset, PackstreamError, Sampling, check_packing_safe, install_packing_guard
from tests._internals import GUARD, cached_verdict
from tests._models import VOCAB, tiny_model
from tests._shards import Example, make_pair_row, make_row, pack_first_fit, random_examples, write_shards

SHORT = 16
"""The reach of a probe told nothing: the short probe's 12 tokens (and this 12-token batch), rounded up."""


def _attention():
    """``packers._attention``, the package the guard's names come from (imported with ``GUARD``)."""
    return sys.modules["packers._attention"]


def _rows(lengths: list[int], seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [make_row([Example(f"x{j}", torch.randint(3, VOCAB, (n,), generator=g).tolist(), [1] * n)
                      for j, n in enumerate(lengths)])]


def _short():
    return Collator()(_rows([5, 7]))


def _folder(path, budget: int) -> PackedDataset:
    write_shards(path, pack_first_fit(random_examples(20, seed=3, max_len=min(60, budget)), budget), budget=budget)
    ds = PackedDataset(path)
    assert ds.budget == budget
    return ds


def _llama():
    return tiny_model("llama", "sdpa", max_position_embeddings=512).train()


def _reaches(model) -> set[int]:
    """The reach of every verdict cached for ``model`` (each mode and layout it was probed in)."""
    return {v.reach for v in GUARD.verdicts.get(model, {}).values()}


def test_opening_a_folder_of_a_larger_budget_leaves_a_guarded_models_probe_length_unchanged(tmp_path):
    """A model guarded at its folder's budget (32) keeps probing at 32 after a folder of budget 256 is opened, in a
    mode it had not been probed in yet too; a model told no length probes at its batch's length, whatever folders
    the process opened."""
    small = _folder(tmp_path / "small", 32)
    model = _llama()
    install_packing_guard(model, max_length=small.budget)
    model(**_short())
    verdict = cached_verdict(model, _short())
    assert verdict.reach == 32 and max(map(sum, verdict.probes)) == 32

    _folder(tmp_path / "large", 256)
    model.eval()  # a new model state: probed again, after the large folder was opened
    with torch.no_grad():
        model(**_short())
    verdict = cached_verdict(model, _short())
    assert verdict.reach == 32 and max(map(sum, verdict.probes)) == 32, verdict.probes
    assert _reaches(model) == {32}

    other = _llama()
    check_packing_safe(other, _short())
    verdict = cached_verdict(other, _short())
    assert verdict.reach == SHORT and max(map(sum, verdict.probes)) == SHORT, verdict.probes
    assert other not in GUARD.lengths and model not in GUARD.lengths


def test_an_explicit_max_length_probes_at_the_folders_budget_for_that_model_alone(tmp_path):
    """``max_length=ds.budget`` (a call's own), or the per-model length the trainers set: the probe reaches the
    budget; another model in the same process is not lengthened by either."""
    ds = _folder(tmp_path / "f", 128)
    checked, guarded, told, untold = (_llama() for _ in range(4))
    check_packing_safe(checked, _short(), max_length=ds.budget)
    install_packing_guard(guarded, max_length=ds.budget)
    guarded(**_short())
    _attention().guard_max_length(told, ds.budget)
    install_packing_guard(told)
    told(**_short())
    check_packing_safe(untold, _short())
    assert [cached_verdict(m, _short()).reach for m in (checked, guarded, told, untold)] == [128, 128, 128, SHORT]
    _attention().guard_max_length(told, 64)  # a shorter length later leaves the longer one
    assert GUARD.lengths[told] == 128
    with pytest.raises(PackstreamError, match=r"max_length=0: give the longest batch in tokens"):
        _attention().guard_max_length(untold, 0)


def test_the_old_process_wide_note_budget_names_the_new_spelling():
    with pytest.raises(PackstreamError, match=r"note_budget\(2048\) is gone.*install_packing_guard\(model, "
                                              r"max_length=2048\).*check_packing_safe\(model, batch, max_length=2048\)"):
        _attention().note_budget(2048)
    assert "note_budget" not in _attention().__all__


def test_a_known_length_needs_no_all_reduce_per_step(monkeypatch):
    """Why the budget existed: under torch.distributed the ranks must probe at the same step and length. Told a
    length, a rank needs no collective per step to agree on it (only the probe's verdict is agreed, once); told none,
    it all_reduces its batch length (MAX) every step. torch.distributed is faked as a 2-rank group whose other rank
    sends the same values."""
    import torch.distributed as dist

    calls = []

    def all_reduce(tensor, op=None, **kw):
        calls.append(op)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    for max_length, per_step in ((64, 0), (None, 1)):
        model = _llama()
        install_packing_guard(model, max_length=max_length)
        model(**_short())  # the first step: the probe (its verdict agreed by MIN)
        assert dist.ReduceOp.MIN in calls
        calls.clear()
        for lengths in ([5, 7], [4, 6], [3, 3]):  # each within the first probe's reach: no probe again
            model(**Collator()(_rows(lengths)))
        assert calls.count(dist.ReduceOp.MAX) == 3 * per_step and dist.ReduceOp.MIN not in calls, calls
        assert cached_verdict(model, _short()).reach == (64 if max_length else SHORT)
        calls.clear()


def test_the_packed_trainers_probe_their_guarded_models_at_their_folders_budget(tmp_path):
    """PackedDPOTrainer holds the PackedDataset: a policy and a reference guarded with no length probe at its folder's
    budget (128) while it trains; opening the folder did not do it, and a model outside the trainer stays short."""
    trl = pytest.importorskip("trl")
    from packers import PackedDPOTrainer
    from tests.test_preference_trainers import EOS, _common, _models, _pairs

    pairs = _pairs(6)
    write_shards(tmp_path / "pairs", [make_pair_row(pairs[i:i + 3]) for i in range(0, 6, 3)], budget=128,
                 eos_token_id=EOS)
    ds = PackedDataset(tmp_path / "pairs", sampling=Sampling(shuffle=False),
                       batching=Batching(batch_by="rows", batch_size=1, grad_accum=1))
    policy, ref = _models()
    for m in (policy, ref):
        install_packing_guard(m)
    assert policy not in GUARD.lengths and ref not in GUARD.lengths  # opening the folder told no model anything
    trainer = PackedDPOTrainer(policy, trl.DPOConfig(**{**_common(tmp_path / "out"), "max_steps": 1,
                                                        "gradient_accumulation_steps": 1}), ds, ref_model=ref)
    assert GUARD.lengths[policy] == GUARD.lengths[ref] == 128
    trainer.train()
    assert _reaches(policy) == _reaches(ref) == {128}
    outside = _llama()
    install_packing_guard(outside)
    outside(**_short())
    assert cached_verdict(outside, _short()).reach == SHORT
