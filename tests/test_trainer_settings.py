"""Issue 52 part A: nothing a user sets on TRL's ``DPOConfig`` / ``KTOConfig`` is silently dropped by the packed
preference trainers (packers/_trainer_settings.py), and what they honour is TRL's.

- Every field of the installed TRL's configs is classified (a later TRL's new field fails here until it is).
- Generated settings: a checked field (fixed by the folder, set by the dataset, refused) away from TRL's default
  is one PackstreamError line naming it; an honoured or ignored field set to a valid non-default value constructs.
- Folders the loss cannot take: unlabelled KTO examples, ``--train-on all``, ``--mask-reasoning``.
- A corrupted ``packstream_ref_logps.json`` (generated corruptions) and a reference giving NaN: one line naming the
  file (or pass), the example, the value and the fix.
- MoE: a tiny Mixtral (4 experts, top 2, ``router_aux_loss_coef=0.5``) trained by the packed trainers and by TRL's on
  the same records, step for step: loss, metrics and ``aux_loss`` agree (see :func:`test_moe_aux_loss_equals_trls`).
- docs/loader.md's settings table is the one the code renders.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from packers import Batching, PackedDataset, PackstreamError, Sampling
from tests._internals import _trainer_settings as ts
from tests._shards import make_pair_row, make_row, write_manifest, write_shards
from tests.test_preference_trainers import (ACCUM, B, EOS, STEPS, _common, _compare, _kto, _models, _pairs, _run,
                                            _text, _tokenizer, _with_reference)

trl = pytest.importorskip("trl")

CHECKED = (ts.Handling.FOLDER, ts.Handling.DATASET, ts.Handling.REFUSED)


def test_every_field_of_the_installed_trl_is_classified():
    import transformers

    trainer_fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    for config in ts.CONFIGS:
        names = {f.name for f in dataclasses.fields(getattr(trl, config))}
        unknown = sorted(n for n in names if ts.setting(config, n) is None)
        assert not unknown, f"{config} fields not in packers/_trainer_settings.py: {unknown}; classify them"
        assert set(ts.SETTINGS[config]) <= names, sorted(set(ts.SETTINGS[config]) - names)  # no stale entries
        assert ts.TRAINER_OWN <= trainer_fields and not ts.TRAINER_OWN & set(ts.SETTINGS[config])
        for name, s in ts.SETTINGS[config].items():
            assert s.why and (s.fix or s.handling not in CHECKED), (config, name)


# -- a tiny folder of each kind and a tiny model, built once -----------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("settings")
    pairs = _pairs(B * ACCUM)
    dpo = [make_pair_row(pairs[i:i + B]) for i in range(0, len(pairs), B)]
    data = _kto(B * ACCUM)
    kto = [{**make_row([ex for ex, _ in data[i:i + B]]), "desirable": [g for _, g in data[i:i + B]]}
           for i in range(0, len(data), B)]
    for name, rows in (("DPOConfig", dpo), ("KTOConfig", kto)):
        write_shards(tmp / name, rows, budget=max(len(r["input_ids"]) for r in rows), eos_token_id=EOS)
    policy, ref = _models()
    return tmp, policy, ref


def _dataset(folder) -> PackedDataset:
    return PackedDataset(folder, sampling=Sampling(shuffle=False),
                         batching=Batching(batch_by="rows", batch_size=1, grad_accum=ACCUM))


def _args(config: str, out, **over):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's and transformers' deprecation notes
        return getattr(trl, config)(**{**_common(out, max_length=None), **over})


def _trainer(config: str, world, args, folder=None):
    from packers import PackedDPOTrainer, PackedKTOTrainer

    tmp, policy, ref = world
    cls = PackedDPOTrainer if config == "DPOConfig" else PackedKTOTrainer
    return cls(policy, args, _dataset(folder or tmp / config), ref_model=ref)


# -- generated settings ------------------------------------------------------------------------------------------

_CHOICES = {  # fields whose values TRL or transformers validate: the non-default values that construct
    "train_sampling_strategy": st.just("group_by_length"),
    "eval_strategy": st.sampled_from(["steps", "epoch"]),
    "truncation_mode": st.just("keep_end"),
    "accelerator_config": st.sampled_from([{"split_batches": True}, {"even_batches": False}]),
    "model_init_kwargs": st.just({"dtype": "float32"}),
    "liger_kernel_config": st.just({"rms_norm": True}),
    "pad_to_multiple_of": st.integers(1, 64),
}


def _non_default(config: str, name: str) -> st.SearchStrategy:
    """Values of ``name`` other than TRL's default, drawn by the default's type."""
    if name in _CHOICES:
        return _CHOICES[name]
    d = ts.default(getattr(trl, config), name)
    if isinstance(d, bool):
        return st.just(not d)
    if isinstance(d, float):
        return st.floats(0.01, 10.0).filter(lambda v: v != d)
    if isinstance(d, int) or d is None:  # the None defaults here are optional numbers
        return st.integers(1, 10_000).filter(lambda v: v != d)
    raise AssertionError(f"no generator for {config}.{name} (default {d!r}): add one to _CHOICES")


def _checked_fields() -> list[tuple[str, str]]:
    return [(c, n) for c in ts.CONFIGS for n, s in sorted(ts.SETTINGS[c].items()) if s.handling in CHECKED]


@pytest.mark.parametrize("config,name", _checked_fields(), ids=lambda x: x if isinstance(x, str) else None)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_checked_field_away_from_trls_default_is_one_line_naming_it(world, data, tmp_path, config, name):
    value = data.draw(_non_default(config, name))
    args = _args(config, tmp_path, **{name: value})
    s = ts.SETTINGS[config][name]
    if s.allowed is not None and s.allowed(getattr(args, name), args, _dataset(world[0] / config)):
        _trainer(config, world, args)  # a value that changes nothing here (e.g. max_length past the budget)
        return
    with pytest.raises(PackstreamError) as e:
        _trainer(config, world, args)
    message = str(e.value)
    assert "\n" not in message and f"{name}=" in message and "packed rows" in message, message


HONOURED = {  # a valid non-default value of each honoured or ignored field (DPO, KTO), for construction
    "beta": 0.3, "precompute_ref_log_probs": True, "disable_dropout": False, "router_aux_loss_coef": 0.0,
    "dataloader_num_workers": 1, "dataloader_pin_memory": False, "ignore_data_skip": True, "seed": 7,
    "gradient_accumulation_steps": None, "dataset_num_proc": 2, "ref_model_mixup_alpha": 0.3,
    "ref_model_sync_steps": 5, "remove_unused_columns": False, "length_column_name": "n",
    "average_tokens_across_devices": False, "do_train": True, "do_eval": True, "do_predict": True,
    "resume_from_checkpoint": "somewhere", "per_device_eval_batch_size": 2, "eval_steps": 5, "eval_delay": 1,
    "eval_accumulation_steps": 2, "eval_do_concat_batches": False, "eval_use_gather_object": True,
    "prediction_loss_only": True, "include_for_metrics": ["loss"], "batch_eval_metrics": True,
    "bf16_full_eval": None, "fp16_full_eval": None, "label_names": ["labels"], "metric_for_best_model": "loss",
    "greater_is_better": True, "load_best_model_at_end": None,
    "dataloader_prefetch_factor": 4, "dataloader_multiprocessing_context": "spawn",
    # DPO
    "loss_type": None, "loss_weights": [0.5], "label_smoothing": 0.2, "f_divergence_type": "js_divergence",
    "f_alpha_divergence_coef": 0.3, "discopop_tau": 0.1, "padding_free": True, "pad_token": "<pad>",
    "precompute_ref_batch_size": 2,
    # KTO
    "desirable_weight": 1.5, "undesirable_weight": 0.7,
}
"""None: covered elsewhere (gradient_accumulation_steps: test_refusals; loss_type: the equality tests), or a
value transformers itself refuses without evaluation (load_best_model_at_end, the *_full_eval precisions on CPU)."""
_ALSO = {"dataloader_prefetch_factor": {"dataloader_num_workers": 1},
         "dataloader_multiprocessing_context": {"dataloader_num_workers": 1}}


def _passing() -> list[tuple[str, str]]:
    return [(c, n) for c in ts.CONFIGS for n, s in sorted(ts.SETTINGS[c].items())
            if s.handling in (ts.Handling.HONOURED, ts.Handling.IGNORED)]


def test_every_honoured_or_ignored_field_has_a_value_to_try():
    assert not [n for _, n in _passing() if n not in HONOURED]


@pytest.mark.parametrize("config,name", [p for p in _passing() if HONOURED[p[1]] is not None],
                         ids=lambda x: x if isinstance(x, str) else None)
def test_an_honoured_or_ignored_field_set_constructs(world, tmp_path, config, name):
    args = _args(config, tmp_path, **{name: HONOURED[name], **_ALSO.get(name, {})})
    _trainer(config, world, args)


def test_a_trl_field_packstream_does_not_know_is_refused(world, tmp_path, monkeypatch):
    args = _args("DPOConfig", tmp_path, beta=0.3)
    monkeypatch.setitem(ts.SETTINGS, "DPOConfig", {k: v for k, v in ts.SETTINGS["DPOConfig"].items() if k != "beta"})
    with pytest.raises(PackstreamError, match=r"beta=0\.3 is a DPOConfig field packstream does not know"):
        _trainer("DPOConfig", world, args)


def test_a_router_aux_loss_coef_on_a_dense_model_is_refused_as_trl_refuses_it(world, tmp_path):
    with pytest.raises(PackstreamError, match="router_aux_loss_coef=0.5 but LlamaForCausalLM is not a Mixture"):
        _trainer("DPOConfig", world, _args("DPOConfig", tmp_path, router_aux_loss_coef=0.5))


def test_f_divergence_with_a_loss_trl_refuses_it_for(world, tmp_path):
    args = _args("DPOConfig", tmp_path, f_divergence_type="js_divergence", loss_type=["bco_pair"])
    with pytest.raises(PackstreamError, match="f_divergence_type='js_divergence' with loss_type=\\['bco_pair'\\]"):
        _trainer("DPOConfig", world, args)


# -- folders the loss cannot take --------------------------------------------------------------------------------


def test_unlabelled_kto_examples_are_refused_at_construction(world, tmp_path):
    """Worked example: 6 examples, 2 of them unlabelled (-1), 1 row without the desirable column at all (its 3
    sequences count as unlabelled): apo_zero_unpaired would score them as undesirable, kto_loss refuses mid-run."""
    data = _kto(9)
    rows = [{**make_row([ex for ex, _ in data[0:3]]), "desirable": [1, -1, 0]},
            {**make_row([ex for ex, _ in data[3:6]]), "desirable": [-1, 1, 1]},
            make_row([ex for ex, _ in data[6:9]])]
    write_shards(tmp_path / "f", rows, budget=max(len(r["input_ids"]) for r in rows), eos_token_id=EOS)
    for loss_type in ("kto", "apo_zero_unpaired"):
        with pytest.raises(PackstreamError, match="^PackedKTOTrainer: 5 of the folder's 9 examples carry no KTO label"):
            _trainer("KTOConfig", world, _args("KTOConfig", tmp_path, loss_type=loss_type), tmp_path / "f")


@pytest.mark.parametrize("config", ts.CONFIGS)
@pytest.mark.parametrize("options,match", [
    ({"train_on": "all"}, "packed with --train-on all, so its targets hold the prompt"),
    ({"mask_reasoning": True}, "packed with --mask-reasoning, so the completions' reasoning"),
    ({"config": [{"name": "math", "train_on": "all"}]}, "--train-on all \\(data set 'math'\\)"),
])
def test_a_folder_whose_targets_are_not_the_completion_is_refused(world, tmp_path, config, options, match):
    import shutil

    folder = tmp_path / "f"  # the folder of this kind, copied, with the run's options recorded in its manifest
    shutil.copytree(world[0] / config, folder)
    budget = json.loads((folder / "manifest.json").read_text())["config"]["max_tokens"]
    write_manifest(folder, config={"max_tokens": budget, "output_format": "arrow", **options})
    with pytest.raises(PackstreamError, match=match):
        _trainer(config, world, _args(config, tmp_path), folder)


# -- the precomputed reference table -----------------------------------------------------------------------------


def _checkpoint(trainer, tmp_path, table) -> str:
    from tests._internals import LOADER_STATE, REF_LOGPS

    folder = tmp_path / "checkpoint-1"
    folder.mkdir(exist_ok=True)
    (folder / LOADER_STATE).write_text(json.dumps(trainer.train_dataset.state_dict()))
    (folder / REF_LOGPS).write_text(table if isinstance(table, str) else json.dumps(table))
    return str(folder)


_BAD_NUMBERS = [math.nan, math.inf, -math.inf, "-3.5", None, True, [1.0]]


@st.composite
def _corruption(draw, ids: list[str], kto: bool):
    """A table of ``ids`` with one thing broken, and what the error must name."""
    table = {i: ([-float(k), list(range(2, 5)), -1.5] if kto else [-float(k)]) for k, i in enumerate(ids)}
    kind = draw(st.sampled_from(["number", "arity", "unknown_id", "missing_id", "not_a_table"]
                                + (["completion", "kl_number"] if kto else [])))
    eid = draw(st.sampled_from(ids))
    if kind == "number":
        table[eid][0] = draw(st.sampled_from(_BAD_NUMBERS))
    elif kind == "kl_number":
        table[eid][2] = draw(st.sampled_from(_BAD_NUMBERS))
    elif kind == "completion":
        table[eid][1] = draw(st.sampled_from(["w5 w6", [2, -1], [2.5], None, {"a": 1}]))
    elif kind == "arity":
        table[eid] = draw(st.sampled_from([[], table[eid] + [0.0], -1.0, {"logp": -1.0}]))
    elif kind == "unknown_id":
        eid = draw(st.sampled_from(["other@0", "dpo@99#chosen", ""]))
        table[eid] = [-1.0, [2], -1.0] if kto else [-1.0]
    elif kind == "missing_id":
        del table[eid]
    else:
        return list(table.values()), kind, None
    return table, kind, eid


@pytest.mark.parametrize("config", ts.CONFIGS)
def test_a_corrupted_reference_table_is_one_line_naming_file_example_and_fix(world, tmp_path, config):
    import pyarrow.compute as pc

    trainer = _trainer(config, world, _args(config, tmp_path / "out", precompute_ref_log_probs=True))
    ids = pc.list_flatten(trainer.train_dataset.rows.data.column("example_ids")).to_pylist()

    @settings(max_examples=40, deadline=None)
    @given(case=_corruption(ids, config == "KTOConfig"))
    def corrupted(case):
        table, kind, eid = case
        path = _checkpoint(trainer, tmp_path, table)
        trainer._precomputed = None
        with pytest.raises(PackstreamError) as e:
            trainer.train(resume_from_checkpoint=path)
        message = str(e.value)
        assert "\n" not in message and "packstream_ref_logps.json" in message and f"delete {path}" in message
        if eid is not None:
            assert repr(eid)[:40] in message, (kind, message)

    corrupted()
    trainer._precomputed = None  # the table as the trainer writes it passes the checks (the Trainer then loads the
    path = _checkpoint(trainer, tmp_path, trainer._reference_table())  # weights, which this folder lacks)
    trainer._precomputed = None
    with pytest.raises(Exception) as e:
        trainer.train(resume_from_checkpoint=path)
    assert not isinstance(e.value, PackstreamError), e.value


def test_a_reference_model_giving_nan_is_refused_when_the_table_is_computed(world, tmp_path):
    from packers import PackedDPOTrainer

    tmp, policy, ref = world
    broken = copy.deepcopy(ref)
    with torch.no_grad():
        broken.lm_head.weight[3].fill_(math.nan)
    trainer = PackedDPOTrainer(policy, _args("DPOConfig", tmp_path, precompute_ref_log_probs=True),
                               _dataset(tmp / "DPOConfig"), ref_model=broken)
    with pytest.raises(PackstreamError, match="^the precomputed reference log-probs: example 'dpo@0#chosen': \\[nan\\] "
                                              "holds a reference log-prob that is not a finite number; the reference"):
        trainer.train()


# -- MoE auxiliary loss ------------------------------------------------------------------------------------------


def _mixtral():
    """A tiny random Mixtral (4 experts, top 2; the BASE sizes of tests/_models.py) and a perturbed reference."""
    import transformers

    from tests._models import BASE

    cfg = transformers.MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.001)
    torch.manual_seed(0)
    return _with_reference(transformers.MixtralForCausalLM._from_config(cfg, attn_implementation="sdpa"))


@pytest.mark.slow
@pytest.mark.parametrize("config", ts.CONFIGS)
def test_moe_aux_loss_equals_trls(tmp_path, config):
    """TRL adds ``router_aux_loss_coef * outputs.aux_loss`` (the model's load-balancing loss over its padded batch,
    pads masked out) and logs ``aux_loss``; a packed micro-batch of the same examples holds the same tokens and no
    padding, so the statistic is the same. Per step: loss, metrics and aux_loss within 1e-5 relative (the loss
    carries 0.5 x aux_loss ~ 1: an fp32 sum of 2 layers' router softmaxes, rounding ~1e-7), updates within 1e-4."""
    from datasets import Dataset

    from packers import PackedDPOTrainer, PackedKTOTrainer
    from tests.test_preference_trainers import _packed_folder

    policy, ref = _mixtral()
    if config == "DPOConfig":
        pairs = _pairs(B * ACCUM * STEPS)
        ds = _packed_folder(tmp_path, [make_pair_row(pairs[i:i + B]) for i in range(0, len(pairs), B)])
        text = Dataset.from_list([{"prompt": _text(p.prompt), "chosen": " " + _text(p.chosen),
                                   "rejected": " " + _text(p.rejected)} for p in pairs])
        ours, theirs, over = PackedDPOTrainer, trl.DPOTrainer, {"loss_type": ["sigmoid"], "beta": 0.5}
    else:
        data = _kto(B * ACCUM * STEPS)
        ds = _packed_folder(tmp_path, [{**make_row([ex for ex, _ in data[i:i + B]]),
                                        "desirable": [g for _, g in data[i:i + B]]} for i in range(0, len(data), B)])
        text = Dataset.from_list([{"prompt": _text(ex.input_ids[:ex.loss_mask.index(1)]),
                                   "completion": " " + _text(ex.input_ids[ex.loss_mask.index(1):]), "label": bool(g)}
                                  for ex, g in data])
        ours, theirs, over = PackedKTOTrainer, trl.KTOTrainer, {"loss_type": "kto", "beta": 0.1}

    def args(out):
        return _args(config, out, router_aux_loss_coef=0.5, **over)

    packed = _run(ours, copy.deepcopy(policy), train_dataset=ds, args=args(tmp_path / "p"), ref_model=copy.deepcopy(ref))
    padded = _run(theirs, copy.deepcopy(policy), train_dataset=text, processing_class=_tokenizer(),
                  args=args(tmp_path / "t"), ref_model=copy.deepcopy(ref))
    worst = 0.0
    for p, t in zip(packed[0], padded[0]):
        assert t["aux_loss"] > 1.0, t  # the term is exercised: 0.5 x aux_loss is a large part of the loss
        assert p["aux_loss"] == pytest.approx(t["aux_loss"], rel=1e-5), (p, t)
        worst = max(worst, abs(p["aux_loss"] - t["aux_loss"]) / t["aux_loss"])
    margin = 1e-6 if config == "KTOConfig" else 1e-7
    print(config, "aux_loss worst relative", worst, _compare(packed, padded, margin_abs=margin))


def test_moe_aux_loss_refuses_a_padding_collator(world, tmp_path):
    from packers import Collator, PackedDPOTrainer

    policy, ref = _mixtral()
    ds = _dataset(world[0] / "DPOConfig")
    with pytest.raises(PackstreamError, match="would count Collator\\(fixed_shape=True\\)'s padding tokens"):
        PackedDPOTrainer(policy, _args("DPOConfig", tmp_path), ds, ref_model=ref,
                         collator=Collator(fixed_shape=True, budget=ds.budget))


# -- the docs ----------------------------------------------------------------------------------------------------


def test_docs_loader_md_holds_the_table_the_code_renders():
    doc = ts.DOCS.read_text(encoding="utf-8")
    assert ts.rendered(doc) == doc, "docs/loader.md's trainer settings table is stale: python -m packers._trainer_settings"
