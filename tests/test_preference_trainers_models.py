"""The packed preference trainers against TRL's own on other models than Llama (issue 43's held-out direction):
Qwen2, Mistral with a sliding window shorter than the sequences, and Phi-3, under sdpa and eager. The same setup as
tests/test_preference_trainers.py (3 optimizer steps of 2 micro-batches, SGD, the same token ids in the same order),
for sigmoid DPO and KTO with a reference model: loss and metrics within 1e-5 relative per step, parameter updates
within 1e-4 relative in norm.
"""

from __future__ import annotations

import copy

import pytest

from tests._shards import make_pair_row, make_row
from tests.test_preference_trainers import (ACCUM, B, STEPS, _common, _compare, _dpo_config, _kto, _models,
                                            _packed_folder, _pairs, _run, _text, _tokenizer)


def _same(packed, padded):
    """As tests/test_preference_trainers.py's comparison, but ``rewards/margins`` (chosen minus rejected reward: a
    difference of two numbers ~100x larger in these runs) is held to 1e-5 relative to the rewards it subtracts, not
    to itself: TRL takes it in float32, so its own rounding is 1e-7 of the rewards, a larger share of a small margin."""
    for p, t in zip(packed[0], padded[0]):
        scale = max(abs(t["rewards/chosen"]), abs(t["rewards/rejected"]), abs(t["rewards/margins"]))
        assert abs(p["rewards/margins"] - t["rewards/margins"]) <= 1e-5 * scale, (p, t)
    strip = [[{k: v for k, v in h.items() if k != "rewards/margins"} for h in logs] for logs in (packed[0], padded[0])]
    return _compare((strip[0], packed[1]), (strip[1], padded[1]))

trl = pytest.importorskip("trl")

KINDS = [("qwen2", "sdpa", {}), ("mistral", "sdpa", {"sliding_window": 4}), ("phi3", "eager", {}),
         ("llama", "eager", {})]
IDS = ["qwen2-sdpa", "mistral-window4-sdpa", "phi3-eager", "llama-eager"]


@pytest.mark.parametrize("kind,attn,overrides", KINDS, ids=IDS)
def test_packed_dpo_equals_trl_on_other_models(tmp_path, kind, attn, overrides):
    from datasets import Dataset

    from packers import PackedDPOTrainer

    pairs = _pairs(B * ACCUM * STEPS, seed=5)
    ds = _packed_folder(tmp_path, [make_pair_row(pairs[i:i + B]) for i in range(0, len(pairs), B)])
    policy, ref = _models(kind, attn, overrides)
    text = Dataset.from_list([{"prompt": _text(p.prompt), "chosen": " " + _text(p.chosen),
                               "rejected": " " + _text(p.rejected)} for p in pairs])
    packed = _run(PackedDPOTrainer, copy.deepcopy(policy), train_dataset=ds,
                  args=trl.DPOConfig(**_dpo_config(tmp_path / "p", "sigmoid", False)), ref_model=copy.deepcopy(ref))
    padded = _run(trl.DPOTrainer, copy.deepcopy(policy), train_dataset=text, processing_class=_tokenizer(),
                  args=trl.DPOConfig(**_dpo_config(tmp_path / "t", "sigmoid", False)), ref_model=copy.deepcopy(ref))
    _same(packed, padded)


@pytest.mark.parametrize("kind,attn,overrides", KINDS, ids=IDS)
def test_packed_kto_equals_trl_on_other_models(tmp_path, kind, attn, overrides):
    from datasets import Dataset

    from packers import PackedKTOTrainer

    data = _kto(B * ACCUM * STEPS, seed=6)
    rows = [{**make_row([ex for ex, _ in data[i:i + B]]), "desirable": [g for _, g in data[i:i + B]]}
            for i in range(0, len(data), B)]
    ds = _packed_folder(tmp_path, rows)
    policy, ref = _models(kind, attn, overrides)
    text = Dataset.from_list([{"prompt": _text(ex.input_ids[:ex.loss_mask.index(1)]),
                               "completion": " " + _text(ex.input_ids[ex.loss_mask.index(1):]), "label": bool(g)}
                              for ex, g in data])

    def config(out):
        return trl.KTOConfig(**_common(out, loss_type="kto", beta=0.1, max_length=None))

    packed = _run(PackedKTOTrainer, copy.deepcopy(policy), train_dataset=ds, args=config(tmp_path / "p"),
                  ref_model=copy.deepcopy(ref))
    padded = _run(trl.KTOTrainer, copy.deepcopy(policy), train_dataset=text, processing_class=_tokenizer(),
                  args=config(tmp_path / "t"), ref_model=copy.deepcopy(ref))
    _same(packed, padded)
