"""Every setting of TRL's ``DPOConfig`` and ``KTOConfig``, and what the packed preference trainers do with it.

One table (:data:`SETTINGS`, per config class, plus the ``transformers.TrainingArguments`` fields the Trainer applies
itself, :data:`TRAINER_OWN`): each field is

- ``honoured``: computed as TRL (or the Trainer) computes it, in :mod:`packers._preference_trainer`;
- ``trainer``: ``transformers.Trainer``'s own (optimizer, schedule, logging, saving, precision, distribution), applied
  by the Trainer these trainers subclass;
- ``fixed by the folder``: ``packstream pack`` fixed it when it wrote the rows (lengths, truncation, padding);
- ``set by the dataset``: the :class:`packers.PackedDataset`'s ``Sampling`` / ``Batching`` decide it;
- ``refused``: not supported on packed rows;
- ``ignored``: read by nothing here, and setting it changes nothing (each says why).

:func:`check` runs at construction: a field of the last four kinds whose value is not TRL's default (nor a value that
the table says changes nothing, e.g. ``max_length=None``) is one :class:`PackstreamError` line naming the field, the
value, why and the fix. A field the table does not know (a later TRL's) is refused the same way until it is
classified; ``tests/test_trainer_settings.py`` walks the installed TRL's fields and fails for any such field.

``python -m packers._trainer_settings`` rewrites the table in docs/loader.md (:func:`markdown`).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from pathlib import Path
from typing import Any, Callable, Mapping

from packers.errors import PackstreamError

CONFIGS = ("DPOConfig", "KTOConfig")


class Handling(str, enum.Enum):
    """What a packed preference trainer does with one config field."""

    HONOURED = "honoured"  #: computed as TRL (or the Trainer) computes it
    TRAINER = "trainer"  #: transformers.Trainer's own, applied by the Trainer
    FOLDER = "fixed by the folder"  #: fixed when the rows were packed; refused unless at TRL's default
    DATASET = "set by the dataset"  #: the PackedDataset's Sampling/Batching decide; refused unless they agree
    REFUSED = "refused"  #: not supported on packed rows; refused unless at TRL's default
    IGNORED = "ignored"  #: nothing reads it here, and it changes nothing (the reason says why)


_CHECKED = (Handling.FOLDER, Handling.DATASET, Handling.REFUSED)
"""The kinds :func:`check` refuses away from TRL's default."""

Allowed = Callable[[Any, Any, Any], bool]
"""``(value, args, dataset) -> True`` where a value other than TRL's default changes nothing (or agrees)."""


@dataclasses.dataclass(frozen=True)
class Setting:
    handling: Handling
    why: str
    """One line: what TRL does with it and what the packed trainers do."""
    fix: str = ""
    """For the checked kinds: what to do instead."""
    allowed: Allowed | None = None
    """Values besides TRL's default that are accepted (they change nothing, or agree with the folder/dataset)."""
    when: str = ""
    """The accepted values, in words (for the docs table)."""


def _budget_or_more(value: Any, args: Any, ds: Any) -> bool:
    return value is None or (isinstance(value, int) and value >= ds.budget)


def _untruncated(value: Any, args: Any, ds: Any) -> bool:
    return _budget_or_more(args.max_length, args, ds)


def _examples_per_micro_batch(ds: Any) -> set[int] | None:
    """The numbers of examples (pairs) in this epoch's micro-batches, or None where a row is cut between two."""
    import numpy as np

    steps = ds.schedule()
    rows = np.concatenate(steps) if steps else np.zeros(0, dtype=np.int64)
    if len(np.unique(rows)) != len(rows):
        return None
    return {int(ds.num_examples[s].sum()) for s in steps}


def _exact_batch(value: Any, args: Any, ds: Any) -> bool:
    return _examples_per_micro_batch(ds) == {value}


def _no_kl_precompute(value: Any, args: Any, ds: Any) -> bool:
    return not (args.precompute_ref_log_probs and args.loss_type == "kto")


def _default_accelerator(value: Any, args: Any, ds: Any) -> bool:
    from transformers.trainer_pt_utils import AcceleratorConfig

    return value is None or value == AcceleratorConfig()


_PACK = "packstream pack"
_FOLDER_LENGTHS = (f"the packed folder fixed every example's length at pack time ({_PACK} --max-tokens N, --long "
                   "drop|truncate)")

_EVAL_ONLY = ("per_device_eval_batch_size", "eval_steps", "eval_delay", "eval_accumulation_steps",
              "eval_do_concat_batches", "eval_use_gather_object", "prediction_loss_only", "include_for_metrics",
              "batch_eval_metrics", "bf16_full_eval", "fp16_full_eval", "label_names", "metric_for_best_model",
              "greater_is_better", "load_best_model_at_end")
"""Read only by the Trainer's evaluation, which these trainers refuse (``eval_strategy``)."""

_SHARED: dict[str, Setting] = {
    # -- TRL's fields -------------------------------------------------------------------------------------------
    "beta": Setting(Handling.HONOURED, "TRL's beta in every loss and reward"),
    "loss_type": Setting(Handling.HONOURED, "TRL's formula per loss type; the types that are not per pair (DPO: aot, "
                         "aot_unpaired) or unknown are refused by name"),
    "precompute_ref_log_probs": Setting(Handling.HONOURED, "a no-grad reference pass before training, looked up by "
                                        "example id; saved in checkpoints as packstream_ref_logps.json"),
    "disable_dropout": Setting(Handling.HONOURED, "TRL's disable_dropout_in_model on the policy and the reference"),
    "router_aux_loss_coef": Setting(Handling.HONOURED, "MoE models: coef x outputs.aux_loss added to the loss and "
                                    "logged as aux_loss, the coefficient TRL picks (None: the model config's)"),
    "max_length": Setting(Handling.FOLDER, _FOLDER_LENGTHS + ", and TRL's truncation is not applied to packed rows",
                          f"leave it at TRL's default or None; to change lengths, repack with {_PACK} --max-tokens N "
                          "--long truncate", _budget_or_more, "None or >= the folder's budget"),
    "pad_to_multiple_of": Setting(Handling.FOLDER, "packed rows are not padded to a multiple; "
                                  "Collator(fixed_shape=True, budget=ds.budget) pads each row to the budget",
                                  "leave it unset (use Collator(fixed_shape=True) for fixed shapes)",
                                  lambda v, a, d: v in (None, "auto"), "None"),
    "dataset_num_proc": Setting(Handling.IGNORED, "the processes of TRL's dataset preparation; a packed folder is "
                                f"prepared already ({_PACK} --workers), and the count never changes the data"),
    "model_init_kwargs": Setting(Handling.REFUSED, "TRL loads a model named by a string with them; these trainers "
                                 "take model objects and build no model", "pass them to from_pretrained yourself"),
    "trust_remote_code": Setting(Handling.REFUSED, "TRL loads a model named by a string with it; these trainers take "
                                 "model objects and build no model", "pass it to from_pretrained yourself"),
    "activation_offloading": Setting(Handling.REFUSED, "TRL wraps its forward in an activation-offloading context; "
                                     "these trainers do not", "leave it off (gradient_checkpointing saves memory)"),
    "sync_ref_model": Setting(Handling.REFUSED, "TRL's reference-model sync callback is not wired into these "
                              "trainers", "leave it off"),
    "ref_model_mixup_alpha": Setting(Handling.IGNORED, "read only with sync_ref_model=True (refused), by TRL too"),
    "ref_model_sync_steps": Setting(Handling.IGNORED, "read only with sync_ref_model=True (refused), by TRL too"),
    # -- TrainingArguments fields whose meaning changes on packed rows ------------------------------------------
    "gradient_accumulation_steps": Setting(Handling.HONOURED, "the Trainer's; must equal the dataset's "
                                           "Batching(grad_accum=...), which deals optimizer steps to ranks"),
    "dataloader_num_workers": Setting(Handling.HONOURED, "passed to the PackedDataset's loader"),
    "dataloader_pin_memory": Setting(Handling.HONOURED, "passed to the PackedDataset's loader (on CUDA)"),
    "dataloader_prefetch_factor": Setting(Handling.HONOURED, "passed to the PackedDataset's loader"),
    "dataloader_multiprocessing_context": Setting(Handling.HONOURED, "passed to the PackedDataset's loader"),
    "ignore_data_skip": Setting(Handling.HONOURED, "resuming starts the checkpoint's epoch afresh, as the Trainer's"),
    "seed": Setting(Handling.HONOURED, "the Trainer seeds its RNGs with it (initialization, dropout); the data order "
                    "is PackedDataset(sampling=Sampling(seed=...))'s"),
    "per_device_train_batch_size": Setting(
        Handling.DATASET, "the PackedDataset's Batching decides each micro-batch's examples (pairs), not the Trainer",
        "leave it at TRL's default, or set Batching(batch_by='examples', batch_size=N) on the dataset",
        _exact_batch, "the dataset's examples (pairs) per micro-batch, when the same in every one"),
    "train_sampling_strategy": Setting(
        Handling.DATASET, "the order is PackedDataset(sampling=Sampling(shuffle=..., seed=...))'s; 'group_by_length' "
        "has no meaning for packed rows", "use 'random' or 'sequential' and set Sampling(shuffle=...) on the dataset",
        lambda v, a, d: v in ("random", "sequential"), "'random' or 'sequential' (Sampling(shuffle=...) decides)"),
    "data_seed": Setting(Handling.DATASET, "the data order is the PackedDataset's Sampling(seed=...)",
                         "leave it unset and set Sampling(seed=...) on the dataset",
                         lambda v, a, d: v == d.sampling.seed, "the dataset's Sampling(seed)"),
    "dataloader_drop_last": Setting(Handling.DATASET, "the PackedDataset's schedule deals every example of the epoch "
                                    "once; no micro-batch is dropped", "leave it off"),
    "dataloader_persistent_workers": Setting(Handling.REFUSED, "persistent workers would keep a stale epoch and "
                                             "position of the PackedDataset", "leave it off"),
    "dataloader_in_order": Setting(Handling.REFUSED, "the loader hands out micro-batches in step order, which the "
                                   "schedule and resuming rely on", "leave it on"),
    "auto_find_batch_size": Setting(Handling.REFUSED, "it retries with a smaller per_device_train_batch_size, which "
                                    "the dataset decides", "leave it off; lower Batching(batch_size=...) instead"),
    "accelerator_config": Setting(Handling.REFUSED, "the PackedDataset's loader is rank-aware and not passed through "
                                  "accelerate, so split_batches, dispatch_batches, even_batches and the seedable "
                                  "sampler do not apply", "leave it unset", _default_accelerator, "unset"),
    "label_smoothing_factor": Setting(Handling.REFUSED, "the Trainer's SFT label smoother; TRL's losses (and these) "
                                      "never apply it", "leave it at 0 (DPO: label_smoothing)"),
    "neftune_noise_alpha": Setting(Handling.REFUSED, "NEFTune scales its noise by the sequence length, which in a "
                                   "packed row is the row's, not the example's", "leave it unset"),
    "use_liger_kernel": Setting(Handling.REFUSED, "Liger's fused cross-entropy replaces the forward these trainers "
                                "read logits from (TRL keeps its layer kernels only)", "leave it off"),
    "liger_kernel_config": Setting(Handling.REFUSED, "read only with use_liger_kernel (refused)", "leave it unset"),
    "eval_strategy": Setting(Handling.REFUSED, "the Trainer's evaluation loop batches items of the eval dataset, and a "
                             "PackedDataset item is a whole micro-batch", "leave it 'no' and evaluate after training",
                             lambda v, a, d: getattr(v, "value", v) == "no", "'no'"),
    "eval_on_start": Setting(Handling.REFUSED, "an evaluation (see eval_strategy)", "leave it off"),
    "remove_unused_columns": Setting(Handling.IGNORED, "the packed columns are the Collator's and are never dropped "
                                     "(set to False at construction); the Trainer's column removal is not used"),
    "length_column_name": Setting(Handling.IGNORED, "read only by train_sampling_strategy='group_by_length' (refused)"),
    "average_tokens_across_devices": Setting(Handling.IGNORED, "these losses are means over pairs (examples), as "
                                             "TRL's: none reads num_items_in_batch"),
    "do_train": Setting(Handling.IGNORED, "not read by transformers.Trainer (a flag for scripts)"),
    "do_eval": Setting(Handling.IGNORED, "not read by transformers.Trainer (a flag for scripts)"),
    "do_predict": Setting(Handling.IGNORED, "not read by transformers.Trainer (a flag for scripts)"),
    "resume_from_checkpoint": Setting(Handling.IGNORED, "not read by transformers.Trainer (a flag for scripts); pass "
                                      "train(resume_from_checkpoint=...)"),
    **{name: Setting(Handling.IGNORED, "read only by evaluation, which eval_strategy refuses") for name in _EVAL_ONLY},
}

_DPO: dict[str, Setting] = {
    "loss_weights": Setting(Handling.HONOURED, "TRL's weight per loss type"),
    "label_smoothing": Setting(Handling.HONOURED, "TRL's, in exo_pair and robust (TRL's sigmoid does not read it)"),
    "f_divergence_type": Setting(Handling.HONOURED, "TRL's f-divergence scores, for the loss types TRL allows"),
    "f_alpha_divergence_coef": Setting(Handling.HONOURED, "TRL's alpha of alpha_divergence"),
    "discopop_tau": Setting(Handling.HONOURED, "TRL's tau of discopop"),
    "truncation_mode": Setting(Handling.FOLDER, _FOLDER_LENGTHS, f"repack with {_PACK} --long truncate "
                               "--truncate-side right|left", _untruncated,
                               "any, with max_length None or >= the folder's budget (nothing to truncate)"),
    "padding_free": Setting(Handling.IGNORED, "trl 1.16 turns it off with a warning; packed rows hold no padding "
                            "either way, and padded and padding-free forwards give the same log-probs"),
    "pad_token": Setting(Handling.IGNORED, "deprecated; padding tokens are masked out of every loss, in TRL's batches "
                         "and in packed rows alike"),
    "precompute_ref_batch_size": Setting(Handling.IGNORED, "an example's reference log-prob does not depend on the "
                                         "batch it is computed in (here: the training micro-batches)"),
    "use_weighting": Setting(Handling.REFUSED, "it needs per-token values of TRL's fused LM head", "leave it unset"),
    "ld_alpha": Setting(Handling.REFUSED, "it needs per-token values of TRL's fused LM head", "leave it unset"),
}

_KTO: dict[str, Setting] = {
    "desirable_weight": Setting(Handling.HONOURED, "TRL's weight of desirable examples"),
    "undesirable_weight": Setting(Handling.HONOURED, "TRL's weight of undesirable examples"),
    "precompute_ref_batch_size": Setting(
        Handling.REFUSED, "with loss_type='kto', TRL pairs each prompt with another example's completion within each "
        "precompute batch of this size; the packed trainer pairs within each micro-batch",
        "leave it unset", _no_kl_precompute, "any, unless precompute_ref_log_probs with loss_type='kto'"),
}

SETTINGS: dict[str, dict[str, Setting]] = {"DPOConfig": {**_SHARED, **_DPO}, "KTOConfig": {**_SHARED, **_KTO}}
"""Config class name -> field -> its setting (the fields named here; the rest of TrainingArguments: TRAINER_OWN)."""

TRAINER_OWN = frozenset("""
output_dir num_train_epochs max_steps learning_rate lr_scheduler_type lr_scheduler_kwargs warmup_steps optim optim_args
weight_decay adam_beta1 adam_beta2 adam_epsilon optim_target_modules max_grad_norm bf16 fp16 tf32
activation_checkpointing activation_checkpointing_kwargs gradient_checkpointing gradient_checkpointing_kwargs
torch_compile torch_compile_backend torch_compile_mode use_cache torch_empty_cache_steps logging_strategy logging_steps
logging_first_step log_on_each_node logging_nan_inf_filter include_num_input_tokens_seen log_level log_level_replica
disable_tqdm report_to run_name project trackio_space_id trackio_bucket_id trackio_static_space_id save_only_model
save_strategy save_steps save_on_each_node save_total_limit enable_jit_checkpoint push_to_hub hub_token
hub_private_repo hub_model_id hub_strategy hub_always_push hub_revision restore_callback_states_from_checkpoint
full_determinism use_cpu parallelism_config ddp_find_unused_parameters ddp_bucket_cap_mb ddp_broadcast_buffers
ddp_static_graph ddp_backend ddp_timeout fsdp fsdp_config deepspeed debug skip_memory_metrics local_rank
""".split())
"""The ``transformers.TrainingArguments`` fields applied by the Trainer itself, as on any Trainer (those whose meaning
changes on packed rows are in :data:`SETTINGS` instead)."""

_TRAINER = Setting(Handling.TRAINER, "transformers.Trainer's own, applied by the Trainer")


def setting(config: str, name: str) -> Setting | None:
    """The setting of field ``name`` of TRL's ``config`` (``"DPOConfig"`` / ``"KTOConfig"``); None: unclassified."""
    if name in SETTINGS[config]:
        return SETTINGS[config][name]
    return _TRAINER if name in TRAINER_OWN else None


def default(cls: type, name: str) -> Any:
    """TRL's default of field ``name`` of the config class ``cls``."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _shown(value: Any) -> str:
    text = repr(getattr(value, "value", value))
    return text if len(text) <= 80 else text[:77] + "..."


def check(trainer: str, args: Any, ds: Any) -> None:
    """Refuse, in one line, the first field of ``args`` (a TRL config) that the table does not let through: a field of
    a checked kind away from TRL's default and not an accepted value, or a field the table does not know."""
    config = type(args).__name__
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        s = setting(config, f.name)
        try:
            at_default = bool(value == default(type(args), f.name))
        except Exception:  # a value whose == is not a bool (an array): not the default
            at_default = False
        if s is None:
            if not at_default:
                raise PackstreamError(f"{trainer}: {f.name}={_shown(value)} is a {config} field packstream does not "
                                      "know (a newer TRL's), so it would not be applied; leave it at TRL's default, "
                                      "or use a packstream release that supports it")
            continue
        if s.handling not in _CHECKED or at_default or (s.allowed is not None and s.allowed(value, args, ds)):
            continue
        verb = "is not supported" if s.handling is Handling.REFUSED else "is not applied"
        raise PackstreamError(f"{trainer}: {f.name}={_shown(value)} {verb} on packed rows: {s.why}; {s.fix}")


# -- the docs table ----------------------------------------------------------------------------------------------

BEGIN = "<!-- trainer-settings: generated by python -m packers._trainer_settings; do not edit -->"
END = "<!-- /trainer-settings -->"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "loader.md"


def markdown() -> str:
    """The table as markdown: every field of :data:`SETTINGS` (DPO / KTO columns where they differ), then the
    Trainer's own fields in one line."""
    names = sorted(set(SETTINGS["DPOConfig"]) | set(SETTINGS["KTOConfig"]))
    order = {h: i for i, h in enumerate(Handling)}
    lines = ["| field | DPOConfig | KTOConfig | what the packed trainers do | accepted besides TRL's default |",
             "|---|---|---|---|---|"]

    def key(n: str) -> tuple[int, str]:
        s = SETTINGS["DPOConfig"].get(n) or SETTINGS["KTOConfig"][n]
        return order[s.handling], n

    for n in sorted(names, key=key):
        d, k = SETTINGS["DPOConfig"].get(n), SETTINGS["KTOConfig"].get(n)
        cells = [s.handling.value if s else "-" for s in (d, k)]
        s = d or k
        whys = [s.why] if d is None or k is None or d == k else [f"DPO: {d.why}", f"KTO: {k.why}"]
        fixes = [x.fix for x in (d, k) if x and x.fix and x.handling in _CHECKED]
        why = "; ".join(whys) + (f" (fix: {fixes[0]})" if fixes and (d is None or k is None or d == k) else "")
        when = "; ".join(dict.fromkeys(x.when for x in (d, k) if x and x.when))
        lines.append(f"| `{n}` | {cells[0]} | {cells[1]} | {_cell(why)} | {_cell(when)} |")
    own = ", ".join(f"`{n}`" for n in sorted(TRAINER_OWN))
    lines += ["", f"Applied by `transformers.Trainer` itself, as on any Trainer ({Handling.TRAINER.value}): {own}."]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def rendered(doc: str) -> str:
    """``doc`` (docs/loader.md's text) with the generated table between :data:`BEGIN` and :data:`END` replaced."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(doc):
        raise PackstreamError(f"{DOCS}: no {BEGIN} ... {END} block to fill; add the two markers")
    return pattern.sub(lambda m: f"{BEGIN}\n{markdown()}\n{END}", doc)


def main() -> None:
    DOCS.write_text(rendered(DOCS.read_text(encoding="utf-8")), encoding="utf-8")


if __name__ == "__main__":
    main()

