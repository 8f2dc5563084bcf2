"""TRL's DPO and KTO on packed rows: ``transformers.Trainer`` subclasses that take TRL's own ``DPOConfig`` / ``KTOConfig``.

TRL's ``DPOTrainer`` and ``KTOTrainer`` cannot take a packed folder (their dataset preparation wants ``chosen`` /
``completion`` text columns, and trl 1.16 switched DPO's ``padding_free`` off; huggingface/trl#2469). These trainers
read a :class:`packers.PackedDataset` instead and compute what TRL computes, per micro-batch::

    packed micro-batch   [ p c c | p r | p c | p r r ]       pairs: chosen and rejected side by side in one row
    policy forward       one, with grad            ->  sequence_logps  -> chosen, rejected  [P]
    reference forward    one, no grad (or looked up by example id when precompute_ref_log_probs=True)
    log-ratios           policy - reference, in float64
    loss                 TRL's formula for args.loss_type, mean over the micro-batch's pairs (KTO: examples),
                         divided by gradient_accumulation_steps by the Trainer, as TRL's is

and log TRL's metric names with TRL's definitions (``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``
(DPO), ``rewards/margins``, ``logps/chosen``, ``logps/rejected``, ``kl`` (KTO), ``aux_loss`` (MoE models, whose
``router_aux_loss_coef x aux_loss`` joins the loss as in TRL)), each the mean of its micro-batch values since the last
log. TRL's ``entropy``, ``logits/*``, ``mean_token_accuracy`` and ``num_tokens`` are not logged (they need TRL's fused
LM head). Every other field of TRL's configs is honoured or refused by the table of :mod:`packers._trainer_settings`.

KTO's reference point (TRL's ``kl``): each example's prompt followed by the completion of the example before it in
the micro-batch (the first takes the last one's: TRL rotates completions by one within each batch), packed as a
second batch, through the policy and the reference without grad; ``kl`` is the mean policy-minus-reference over
these mismatched sequences, averaged over processes, clamped at 0, detached. With ``precompute_ref_log_probs`` the
mismatched completion of each example is fixed at the precompute pass (as TRL fixes it when it prepares the data).

Checkpoint and resume: each checkpoint folder also holds ``packstream_loader.json`` (the dataset's
``state_dict()``: epoch and micro-batches consumed) and, with ``precompute_ref_log_probs``, ``packstream_ref_logps.json``
(the reference table). ``train(resume_from_checkpoint=...)`` loads both before the Trainer loads the weights, and the
Trainer's own skipping of the epoch's trained batches (``get_resumed_dataloader``, which would read them again) is
replaced by a check that the dataset stands where the trainer state says. The table is restored, not recomputed: with
no reference model it came from the policy before training, which the resumed run no longer has (and with KTO's
``rebatch`` the mismatched completions depend on the epoch it was computed in). Optimizer, scheduler and RNG states are
the Trainer's. tests/test_preference_resume.py.

The trade-off: subclassing ``transformers.Trainer`` and reading TRL's configs keeps these trainers working while
TRL's trainer internals move between releases (its collators, dataset preparation, fused LM head and
``_compute_loss`` changed in every minor release of 1.x), at the cost of copying TRL's loss formulas here: a TRL
release that changes a formula is caught by the equality tests against the installed TRL
(tests/test_preference_trainers.py), not inherited. Subclassing ``DPOTrainer`` would inherit new options for free,
but also its dataset preparation and padded collator, which are what cannot take packed rows.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from dataclasses import replace
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F
from packers.errors import PackstreamError
from packers._collate import Collator
from packers._loader import PackedDataset
from packers._logps import SequenceLogps, kto_loss, sequence_logps

LOADER_STATE = "packstream_loader.json"
"""In each checkpoint folder: ``PackedDataset.state_dict()`` when it was saved (every rank's is the same but for
``rank``, which ``load_state_dict`` does not compare)."""
REF_LOGPS = "packstream_ref_logps.json"
"""In each checkpoint folder when ``precompute_ref_log_probs=True``: the reference table, example id -> values."""

_NOT_MODEL = ("labels", "completion_mask", "pair_index", "example_index", "example_ids", "desirable", "loss_weights",
              "loss_denominator")
"""Batch keys that are the trainer's, not the model's."""


def _trl():
    try:
        import trl
    except ImportError as e:
        raise PackstreamError('the packed preference trainers need TRL: pip install "packstream[trl]"') from e
    return trl


def _model_inputs(batch: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k not in _NOT_MODEL}


def _per_pair(name: str, ls: float, tau: float) -> Callable[..., torch.Tensor] | None:
    """TRL 1.16's ``DPOTrainer._compute_loss`` per-pair term for ``loss_type=name``, as a function of ``(beta, d, c, r,
    cs, rs, nc, nr)``: ``d`` the chosen-minus-rejected score, ``c``/``r`` the chosen/rejected log-ratios, ``cs``/``rs``
    their f-divergence scores, ``nc``/``nr`` the completion token counts. None: not a per-pair loss."""
    ls_ = torch.tensor(ls, dtype=torch.float64)
    losses = {
        "sigmoid": lambda b, d, c, r, cs, rs, nc, nr: -F.logsigmoid(b * d),
        "hinge": lambda b, d, c, r, cs, rs, nc, nr: torch.relu(1 - b * d),
        "ipo": lambda b, d, c, r, cs, rs, nc, nr: (cs / nc - rs / nr - 1 / (2 * b)) ** 2,
        "exo_pair": lambda b, d, c, r, cs, rs, nc, nr: (
            torch.sigmoid(b * d) * (F.logsigmoid(b * d) - torch.log1p(-ls_))
            + torch.sigmoid(-b * d) * (F.logsigmoid(-b * d) - torch.log(ls_))),
        "nca_pair": lambda b, d, c, r, cs, rs, nc, nr: (
            -F.logsigmoid(b * c) - 0.5 * F.logsigmoid(-b * c) - 0.5 * F.logsigmoid(-b * r)),
        "robust": lambda b, d, c, r, cs, rs, nc, nr: (
            (-(1 - ls) * F.logsigmoid(b * d) + ls * F.logsigmoid(-b * d)) / (1 - 2 * ls)),
        "bco_pair": lambda b, d, c, r, cs, rs, nc, nr: -F.logsigmoid(b * c) - F.logsigmoid(-b * r),
        "sppo_hard": lambda b, d, c, r, cs, rs, nc, nr: (c - 0.5 / b) ** 2 + (r + 0.5 / b) ** 2,
        "apo_zero": lambda b, d, c, r, cs, rs, nc, nr: 1 - torch.sigmoid(b * c) + torch.sigmoid(b * r),
        "apo_down": lambda b, d, c, r, cs, rs, nc, nr: torch.sigmoid(b * c) + 1 - torch.sigmoid(b * (c - r)),
        "discopop": lambda b, d, c, r, cs, rs, nc, nr: (
            -F.logsigmoid(b * d) * (1 - torch.sigmoid(b * d / tau)) + torch.exp(-b * d) * torch.sigmoid(b * d / tau)),
        "sigmoid_norm": lambda b, d, c, r, cs, rs, nc, nr: -F.logsigmoid(b * (cs / nc - rs / nr)),
    }
    return losses.get(name)


_F_DIVERGENCE_LOSSES = frozenset({"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"})
"""TRL 1.16's loss types that take an f_divergence_type other than reverse_kl (the others it refuses)."""

_NOT_PER_PAIR = {
    "aot": "it sorts the log-ratios across the batch, so a pair's loss depends on the others packed with it",
    "aot_unpaired": "it sorts the log-ratios across the batch, so a pair's loss depends on the others packed with it",
}


def _scores(kind: str, alpha: float, x: torch.Tensor) -> torch.Tensor:
    """TRL's f-divergence score of log-ratios ``x`` (``f_divergence_type``; f-DPO, Wang et al. 2023)."""
    if kind == "reverse_kl" or (kind == "alpha_divergence" and abs(alpha - 1.0) < 1e-6):
        return x
    if kind == "forward_kl":
        return 1 - torch.exp(-x)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(x)
    if kind == "alpha_divergence":
        return (torch.exp(torch.clamp((alpha - 1.0) * x, max=80.0)) - 1.0) / (alpha - 1.0)
    raise PackstreamError(f"f_divergence_type={kind!r} is unknown; use reverse_kl, forward_kl, js_divergence or "
                          "alpha_divergence")


class _Shared:
    """What DPO and KTO share: the packed data loader, the reference model or precomputed log-probs, the metrics.
    Mixed into ``transformers.Trainer`` on first use (:func:`__getattr__`): importing transformers' Trainer sets
    torch's environment and loggers, which importing a packers module must not."""

    loss_is_scaled_for_ga = False  # as TRL's: a micro-batch mean, divided by the accumulation steps by the Trainer
    _config = ""

    def __init__(self, model: torch.nn.Module, args: Any, train_dataset: PackedDataset, *,
                 ref_model: torch.nn.Module | None = None, collator: Collator | None = None, **kwargs: Any) -> None:
        config = getattr(_trl(), self._config)
        name = type(self).__name__
        if not isinstance(args, config):
            raise PackstreamError(f"{name} takes TRL's {self._config}; got args={type(args).__name__}")
        if not isinstance(train_dataset, PackedDataset):
            raise PackstreamError(f"{name} trains on a packers.PackedDataset of a packed folder; got "
                                  f"{type(train_dataset).__name__}")
        from packers._trainer_settings import check

        check(name, args, train_dataset)  # every field TRL's config has: honoured, or refused in one line
        _check_targets(name, train_dataset)
        if ref_model is None and not args.precompute_ref_log_probs:
            raise PackstreamError(f"{name} needs ref_model=... or {self._config}(precompute_ref_log_probs=True) (the "
                                  "policy before training is then the reference)")
        if ref_model is model:
            raise PackstreamError(f"{name}: model and ref_model are the same object; pass a frozen copy")
        accum = train_dataset.batching.grad_accum
        if accum != args.gradient_accumulation_steps:
            raise PackstreamError(f"PackedDataset(batching=Batching(grad_accum={accum})) but gradient_accumulation_steps"
                                  f"={args.gradient_accumulation_steps}: give both the same value (the dataset deals "
                                  "optimizer steps to ranks)")
        if train_dataset.batching.loss_weighting.value == "source":  # never a weighting applied in silence
            raise PackstreamError(f"{name} computes TRL's loss, a mean over each micro-batch's "
                                  f"{'pairs' if self._config == 'DPOConfig' else 'examples'}; "
                                  "Batching(loss_weighting='source') weights SFT tokens by data set and is not "
                                  "applied here: leave the default, or weight data sets by sampling (--config weight)")
        if train_dataset.vision is not None and self._config != "DPOConfig":
            raise PackstreamError(f"{name}: the rows carry images ({train_dataset.vision.name or 'a vision spec'}), and "
                                  "KTO's KL term pairs each prompt with another example's completion, which is not "
                                  "built for image rows yet; train KTO on text rows, or DPO (--pairs) on image rows")
        self._check_args(args)
        self._check_data(train_dataset)
        args.remove_unused_columns = False  # keep the packed columns
        self.collator = collator if collator is not None else Collator(vision=train_dataset.vision)
        super().__init__(model=model, args=args, train_dataset=train_dataset, data_collator=self.collator, **kwargs)
        self.model_accepts_loss_kwargs = False  # transformers < 5.19 reads this instead of loss_is_scaled_for_ga
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.to(self.args.device).eval().requires_grad_(False)
        from packers._attention import guard_max_length

        for m in (model, ref_model):  # a packing guard on either probes at the folder's budget, every rank alike
            if m is not None:
                guard_max_length(m, train_dataset.budget)
        if args.disable_dropout:
            from trl.trainer.utils import disable_dropout_in_model

            for m in (model, ref_model):
                if m is not None:
                    disable_dropout_in_model(m)
        self._metrics: dict[str, list[float]] = defaultdict(list)
        self._precomputed: dict[Any, Any] | None = None  # filled by _reference_table() when first needed
        self._aux_coef = self._router_aux_loss_coef(model, args)

    def _check_args(self, args: Any) -> None:
        raise NotImplementedError

    def _check_data(self, ds: PackedDataset) -> None:
        """The folder's rows fit this trainer's loss (KTO: every example labelled)."""

    def _router_aux_loss_coef(self, model: torch.nn.Module, args: Any) -> float | None:
        """TRL 1.16's MoE load-balancing loss (``aux_loss_enabled``): on for a model whose config has
        ``output_router_logits``, with ``router_aux_loss_coef`` (None: the config's own), unless that is 0. None: off.

        The model's ``load_balancing_loss_func`` averages the router statistics over the batch's tokens, TRL's over its
        padded batch with the attention mask (pads left out): the same tokens as a packed micro-batch of the same
        examples, which holds no padding. ``Collator(fixed_shape=True)`` pads, and packed rows pass no attention mask,
        so the pads would count: refused (tests/test_trainer_settings.py measures the packed aux loss against TRL's)."""
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        coef = args.router_aux_loss_coef
        moe = hasattr(text, "output_router_logits")
        if coef and not moe:
            raise PackstreamError(f"{type(self).__name__}: router_aux_loss_coef={coef} but {type(model).__name__} is not "
                                  "a Mixture-of-Experts model that returns its router logits (its config has no "
                                  "output_router_logits): there is no auxiliary loss to weight; leave it unset")
        value = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
        if not moe or not value:
            return None
        if getattr(self.collator, "fixed_shape", False):
            raise PackstreamError(f"{type(self).__name__}: the MoE auxiliary loss (router_aux_loss_coef={value}) would "
                                  "count Collator(fixed_shape=True)'s padding tokens, which TRL leaves out; use "
                                  "Collator() (no padding), or router_aux_loss_coef=0.0 to train without it")
        return float(value)

    def get_train_dataloader(self):
        # Not through accelerator.prepare: PackedDataset is rank-aware and already batched (examples/hf_trainer.py).
        extra = {k: v for k, v in (("prefetch_factor", self.args.dataloader_prefetch_factor),
                                   ("multiprocessing_context", self.args.dataloader_multiprocessing_context))
                 if v is not None}
        return self.train_dataset.dataloader(collate_fn=self.collator, num_workers=self.args.dataloader_num_workers,
                                             pin_memory=self.args.dataloader_pin_memory and torch.cuda.is_available(),
                                             **extra)

    # -- checkpoint and resume: the loader's position and the reference table go into each checkpoint folder -----
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any):
        """``transformers.Trainer.train``; resuming also restores the dataset's position (``LOADER_STATE``) and the
        precomputed reference log-probs (``REF_LOGPS``) from the checkpoint, before the Trainer loads the weights."""
        if resume_from_checkpoint is True:
            from transformers.trainer_utils import get_last_checkpoint

            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True  # True: the Trainer's error
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            self._restore(os.fspath(resume_from_checkpoint))
        self._reference_table()  # from the policy as handed in, before the checkpoint's weights replace it
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _restore(self, checkpoint: str) -> None:
        ds: PackedDataset = self.train_dataset
        path = os.path.join(checkpoint, LOADER_STATE)
        if not self.args.ignore_data_skip:  # ignore_data_skip: the Trainer's meaning, the resumed epoch from its start
            if not os.path.isfile(path):
                raise PackstreamError(f"cannot resume from {checkpoint}: it holds no {LOADER_STATE} (the packed "
                                      "dataset's position), so it was not saved by these trainers; resume from one "
                                      "they saved, or pass ignore_data_skip=True to start its epoch's data afresh")
            ds.load_state_dict(_read_json(path, LOADER_STATE, 1 << 20))  # refuses other data or options, naming them
        path = os.path.join(checkpoint, REF_LOGPS)
        if self.args.precompute_ref_log_probs and os.path.isfile(path):
            self._precomputed = self._checked_table(_read_json(path, REF_LOGPS, 1 << 34), path,
                                                    f"delete {path} and resume: the table is then recomputed")

    def _save_checkpoint(self, model, trial) -> None:
        super()._save_checkpoint(model, trial)
        if not self.args.should_save:  # every rank is at the same (epoch, position); the table is merged over ranks
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        if not os.path.isdir(folder):  # rotated away at once (save_total_limit with load_best_model_at_end)
            return
        _write_json(os.path.join(folder, LOADER_STATE), self.train_dataset.state_dict())
        if self._precomputed is not None:
            _write_json(os.path.join(folder, REF_LOGPS), self._precomputed)

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """The Trainer would skip ``num_batches`` by reading them; the dataset already stands there (``_restore``)."""
        ds: PackedDataset = self.train_dataset
        if ds.position != num_batches:
            raise PackstreamError(f"cannot resume: the checkpoint's {LOADER_STATE} is at micro-batch {ds.position} of "
                                  f"epoch {ds.epoch}, its trainer state at micro-batch {num_batches}; the files come "
                                  "from different checkpoints")
        return dataloader

    def _reference_table(self) -> dict[Any, Any] | None:
        """The precomputed reference log-probs (``precompute_ref_log_probs=True``), computed on first need: from the
        reference model, else from the policy before training."""
        if self.args.precompute_ref_log_probs and self._precomputed is None:
            self._precomputed = self._precompute(self.ref_model if self.ref_model is not None else self.model)
        return self._precomputed

    @torch.no_grad()
    def _precompute(self, ref: torch.nn.Module) -> dict[Any, Any]:
        """One no-grad reference pass over this rank's micro-batches of the current epoch, by example id, merged
        over ranks (every example is on some rank once per epoch, and may be on another one later)."""
        ds: PackedDataset = self.train_dataset
        was = ref.training
        ref.eval()
        table: dict[Any, Any] = {}
        for step in range(len(ds)):
            batch = self._prepare_inputs(self.collator(ds.micro_batch(step, ds.epoch)))
            table.update(self._reference_entries(ref, batch))
        ref.train(was)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            parts: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(parts, table)
            for part in parts:
                table.update(part)
        return self._checked_table(table, "the precomputed reference log-probs",
                                   "the reference model gives them: check its weights and dtype")

    def _checked_table(self, table: Any, where: str, fix: str) -> dict[Any, Any]:
        """``table`` (example id -> reference values) as ``_reference_entries`` makes it: one entry for each example
        of the dataset and no other, each of this trainer's arity, every log-prob a finite number (KTO: the mismatched
        completion a list of token ids, or None without the KL term). Else one line naming ``where``, the example,
        the value and ``fix``."""
        if not isinstance(table, dict):
            raise PackstreamError(f"{where}: a {type(table).__name__}, not a table of example id -> reference "
                                  f"log-probs; {fix}")
        import pyarrow.compute as pc

        ids = set(pc.list_flatten(self.train_dataset.rows.data.column("example_ids")).to_pylist())
        for eid, entry in table.items():
            problem = _entry_problem(entry, self._arity, getattr(self, "_with_kl", False))
            if eid not in ids:
                problem = "is not an example of the dataset (the table was computed over other data)"
            if problem:
                raise PackstreamError(f"{where}: example {_short(eid)}: {_short(entry)} {problem}; {fix}")
        missing = sorted(ids - set(table))
        if missing:
            raise PackstreamError(f"{where}: no entry for {len(missing)} examples of the dataset (e.g. "
                                  f"{_short(missing[0])}): it was computed over other data; {fix}")
        return table

    def _reference_entries(self, ref: torch.nn.Module, batch: Mapping[str, Any]) -> dict[Any, Any]:
        raise NotImplementedError

    def _logps(self, model: torch.nn.Module, batch: Mapping[str, Any]) -> SequenceLogps:
        return self._forward(model, batch, aux=False)[0]

    def _forward(self, model: torch.nn.Module, batch: Mapping[str, Any], aux: bool) -> tuple[SequenceLogps, Any]:
        """The log-probs of ``model`` on ``batch`` and, with ``aux`` and the MoE loss on, its ``aux_loss``."""
        aux = aux and self._aux_coef is not None
        out = model(**_model_inputs(batch), **({"output_router_logits": True} if aux else {}))
        lp = sequence_logps(out.logits, batch)
        if lp.ids is None:
            raise PackstreamError("the rows carry no example_ids; the preference trainers look examples up by id: pack "
                                  "with packstream pack")
        return lp, (out.aux_loss if aux else None)

    def _with_aux(self, loss: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """TRL's ``loss + router_aux_loss_coef * aux_loss``, ``aux_loss`` logged as the mean over processes."""
        if aux is None:
            return loss
        self._metrics["aux_loss"].append(self._gathered_mean(aux.reshape(1)))
        return loss + self._aux_coef * aux

    def _looked_up(self, ids: tuple[Any, ...], key: int, device: torch.device) -> torch.Tensor:
        missing = [i for i in ids if i not in self._precomputed]
        if missing:
            raise PackstreamError(f"no precomputed reference log-prob for {missing[:3]}: the dataset is not the one "
                                  "the trainer precomputed over")
        return torch.tensor([self._precomputed[i][key] for i in ids], dtype=torch.float64, device=device)

    def _gathered_mean(self, x: torch.Tensor) -> float:
        """The mean of ``x`` over every process's values: TRL's ``gather(x).mean()``, but the ranks' micro-batches of
        packed rows hold different numbers of pairs, and a gather of unequal shapes is a collective mismatch (gloo
        aborts the process; NCCL can hang). So each rank gives its sum and count, one shape everywhere."""
        x = x.detach().double()
        total, count = self.accelerator.gather(torch.stack([x.sum(), x.new_tensor(x.numel())]).reshape(1, 2)).sum(0)
        return (total / count).item()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        prefix = "" if self.model.training else "eval_"
        logs.update({prefix + k: sum(v) / len(v) for k, v in self._metrics.items() if v})
        super().log(logs, start_time)
        self._metrics.clear()


class _DPO(_Shared):
    """DPO on rows packed with ``packstream pack --pairs``, as TRL's ``DPOTrainer`` computes it, from TRL's ``DPOConfig``.

    ``PackedDPOTrainer(model, DPOConfig(...), PackedDataset(folder, batching=Batching(batch_by="examples",
    batch_size=8, grad_accum=...)), ref_model=ref)`` (or ``precompute_ref_log_probs=True`` and no ``ref_model``). Every
    per-pair ``loss_type`` of TRL 1.16 (``sigmoid``, ``hinge``, ``ipo``, ``exo_pair``, ``nca_pair``, ``robust``,
    ``bco_pair``, ``sppo_hard``, ``apo_zero``, ``apo_down``, ``discopop``, ``sigmoid_norm``, and ``sft``, a token mean
    over the micro-batch's chosen sides), combined by ``loss_weights``; ``beta``, ``label_smoothing``,
    ``f_divergence_type``, ``f_alpha_divergence_coef`` and ``discopop_tau`` as in TRL. Refused by name: ``aot`` and
    ``aot_unpaired``, ``use_weighting`` and ``ld_alpha`` (they need per-token values TRL's fused head gives). Every
    other field: packers._trainer_settings.
    """

    _config = "DPOConfig"
    _arity = 1

    def _check_args(self, args: Any) -> None:
        for name in args.loss_type:
            if name in _NOT_PER_PAIR:
                raise PackstreamError(f"loss_type={name!r} is not supported on packed rows: {_NOT_PER_PAIR[name]}")
            if name != "sft" and _per_pair(name, 0.0, 1.0) is None:
                raise PackstreamError(f"loss_type={name!r} is not supported on packed rows: not a loss of TRL 1.16's "
                                      "DPOTrainer")
        kind = getattr(args.f_divergence_type, "value", args.f_divergence_type)
        if kind != "reverse_kl" and not set(args.loss_type) <= _F_DIVERGENCE_LOSSES:  # as TRL 1.16 refuses it
            raise PackstreamError(f"f_divergence_type={kind!r} with loss_type={args.loss_type}: TRL allows it only with "
                                  f"{', '.join(sorted(_F_DIVERGENCE_LOSSES))}; use f_divergence_type='reverse_kl'")
        if "robust" in args.loss_type and not 0.0 <= args.label_smoothing < 0.5:
            raise PackstreamError(f"label_smoothing={args.label_smoothing} with loss_type='robust': use [0, 0.5)")
        if "exo_pair" in args.loss_type and args.label_smoothing == 0.0:
            raise PackstreamError("label_smoothing=0.0 with loss_type='exo_pair': EXO needs > 0 (the paper uses 1e-3)")

    def _reference_entries(self, ref: torch.nn.Module, batch: Mapping[str, Any]) -> dict[Any, Any]:
        lp = self._logps(ref, batch)
        return {i: [float(s)] for i, s in zip(lp.ids, lp.sum.double().tolist())}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        lp, aux = self._forward(model, inputs, aux=True)
        if lp.pair_index is None:
            raise PackstreamError("this batch holds no preference pairs: pack the folder with packstream pack --pairs")
        pairs = lp.pair_index
        if self._reference_table() is not None:
            ref = self._looked_up(lp.ids, 0, lp.sum.device)
        else:
            with torch.no_grad():
                ref = self._logps(self.ref_model, inputs).sum.double()
        pc, pr = lp.chosen.double(), lp.rejected.double()
        c, r = pc - ref[pairs[:, 0]], pr - ref[pairs[:, 1]]  # float64: the log-ratios are small differences
        cs, rs = (_scores(args.f_divergence_type, args.f_alpha_divergence_coef, x) for x in (c, r))
        nc, nr = (t.double().clamp(min=1) for t in (lp.chosen_tokens, lp.rejected_tokens))
        loss = torch.zeros((), dtype=torch.float64, device=pc.device)
        for name, weight in zip(args.loss_type, args.loss_weights or [1.0] * len(args.loss_type)):
            if name == "sft":  # TRL: the token mean of the micro-batch's chosen sides
                term = -pc.sum() / lp.chosen_tokens.sum().clamp(min=1)
            else:
                term = _per_pair(name, args.label_smoothing, args.discopop_tau)(
                    args.beta, cs - rs, c, r, cs, rs, nc, nr).mean()
            loss = loss + term * weight
        chosen, rejected = args.beta * c.detach(), args.beta * r.detach()
        for key, value in (("rewards/chosen", chosen), ("rewards/rejected", rejected),
                           ("rewards/accuracies", (chosen > rejected).double()), ("rewards/margins", chosen - rejected),
                           ("logps/chosen", pc), ("logps/rejected", pr)):
            self._metrics[key].append(self._gathered_mean(value))
        loss = self._with_aux(loss, aux).float()
        return (loss, {"chosen_logps": pc, "rejected_logps": pr}) if return_outputs else loss


class _KTO(_Shared):
    """KTO on KTO-labelled packed rows (each example's ``desirable`` label kept), as TRL's ``KTOTrainer`` computes it,
    from TRL's ``KTOConfig``: ``loss_type`` ``"kto"`` (with TRL's KL reference point, see the module docstring) or
    ``"apo_zero_unpaired"``; ``beta``, ``desirable_weight``, ``undesirable_weight`` as in TRL. Each example must be a
    prompt then one completion (its targets one run to the end), as TRL's KTO data is.
    """

    _config = "KTOConfig"
    _arity = 3

    def _check_data(self, ds: PackedDataset) -> None:
        """Every example of the folder labelled: TRL's KTO data has a label per record, and an unlabelled example
        (desirable -1) would be refused by kto_loss mid-run or scored as undesirable by apo_zero_unpaired."""
        import pyarrow.compute as pc

        table = ds.rows.data
        total = int(ds.num_examples.sum())
        labelled = 0
        if "desirable" in table.column_names:
            labelled = int(pc.sum(pc.greater_equal(pc.list_flatten(table.column("desirable")), 0)).as_py() or 0)
        if labelled < total:
            raise PackstreamError(f"{type(self).__name__}: {total - labelled} of the folder's {total} examples carry no "
                                  "KTO label (desirable -1), and KTO scores labelled examples only; pack KTO data where "
                                  "every record has a label (a boolean label, kto_tag or --kto-label field)")

    def _check_args(self, args: Any) -> None:
        if args.loss_type not in ("kto", "apo_zero_unpaired"):
            raise PackstreamError(f"loss_type={args.loss_type!r} is not supported on packed rows: use 'kto' or "
                                  "'apo_zero_unpaired'")

    @property
    def _with_kl(self) -> bool:
        return self.args.loss_type == "kto"

    def _reference_entries(self, ref: torch.nn.Module, batch: Mapping[str, Any]) -> dict[Any, Any]:
        lp = self._logps(ref, batch)
        entries = {i: [float(s), None, 0.0] for i, s in zip(lp.ids, lp.sum.double().tolist())}
        if self._with_kl:
            prompts, completions = _prompts_completions(batch, lp.ids)
            swapped = completions[-1:] + completions[:-1]
            kl = self._logps(ref, _mismatched(prompts, swapped, lp.ids)).sum.double().tolist()
            for i, comp, value in zip(lp.ids, swapped, kl):
                entries[i][1:] = [comp, value]
        return entries

    def _kl(self, model: torch.nn.Module, batch: Mapping[str, Any], ids: tuple[Any, ...]) -> torch.Tensor:
        """TRL's ``kl``: mean policy-minus-reference log-prob of the micro-batch's mismatched sequences, averaged over
        processes, clamped at 0; no grad."""
        prompts, completions = _prompts_completions(batch, ids)
        if self._precomputed is not None:
            swapped = [self._precomputed[i][1] for i in ids]
        else:
            swapped = completions[-1:] + completions[:-1]  # TRL: (x_1, y_n), (x_2, y_1), ..., (x_n, y_{n-1})
        kl_batch = self._prepare_inputs(_mismatched(prompts, swapped, ids))
        with torch.no_grad():
            policy = self._logps(model, kl_batch).sum.double()
            if self._precomputed is not None:
                ref = torch.tensor([self._precomputed[i][2] for i in ids], dtype=torch.float64, device=policy.device)
            else:
                ref = self._logps(self.ref_model, kl_batch).sum.double()
        kl = (policy - ref).mean()
        # One value per rank, averaged with equal weights as TRL's is (gather, not gather_for_metrics: the loader is
        # not accelerate's, so there is no duplicated tail to drop).
        return self.accelerator.gather(kl.reshape(1)).mean().clamp(min=0)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        lp, aux = self._forward(model, inputs, aux=True)
        if lp.desirable is None:
            raise PackstreamError("this batch carries no KTO labels: pack KTO data (a boolean label, kto_tag or "
                                  "--kto-label field) with packstream pack")
        if self._reference_table() is not None:
            ref = self._looked_up(lp.ids, 0, lp.sum.device)
        else:
            with torch.no_grad():
                ref = self._logps(self.ref_model, inputs).sum.double()
        kl = self._kl(model, inputs, lp.ids) if self._with_kl else torch.zeros((), dtype=torch.float64)
        policy64 = replace(lp, sum=lp.sum.double())
        if self._with_kl:
            loss = kto_loss(policy64, replace(lp, sum=ref), kl.to(ref.device), beta=args.beta,
                            desirable_weight=args.desirable_weight, undesirable_weight=args.undesirable_weight)
        else:  # TRL's unpaired APO-zero
            if bool((lp.desirable < 0).any()):
                raise PackstreamError(f"{int((lp.desirable < 0).sum())} of the batch's examples carry no KTO label; "
                                      "pack KTO data where every record has a label")
            ratio, good = policy64.sum - ref, lp.desirable.to(ref.device) == 1
            loss = torch.where(good, args.desirable_weight * (1 - torch.sigmoid(args.beta * ratio)),
                               args.undesirable_weight * torch.sigmoid(args.beta * ratio)).mean()
        self._kto_metrics(policy64.sum.detach(), args.beta * (policy64.sum.detach() - ref),
                          lp.desirable.to(ref.device) == 1, kl)
        loss = self._with_aux(loss, aux).float()
        return (loss, {"logps": lp.sum}) if return_outputs else loss

    def _kto_metrics(self, logps: torch.Tensor, rewards: torch.Tensor, good: torch.Tensor, kl: torch.Tensor) -> None:
        """TRL's KTO metrics: sums over the processes' chosen (rejected) examples over their count; margins only when
        both are present."""
        self._metrics["kl"].append(float(kl))
        gather = self.accelerator.gather
        sums = torch.stack([rewards[good].sum(), logps[good].sum(), rewards[~good].sum(), logps[~good].sum(),
                            good.sum().double(), (~good).sum().double()])
        rc, lc, rr, lr, nc, nr = gather(sums.reshape(1, -1)).sum(0).tolist()
        if nc > 0:
            self._metrics["rewards/chosen"].append(rc / nc)
            self._metrics["logps/chosen"].append(lc / nc)
        if nr > 0:
            self._metrics["rewards/rejected"].append(rr / nr)
            self._metrics["logps/rejected"].append(lr / nr)
        if nc > 0 and nr > 0:
            self._metrics["rewards/margins"].append(rc / nc - rr / nr)


def _prompts_completions(batch: Mapping[str, Any], ids: tuple[Any, ...]) -> tuple[list[list[int]], list[list[int]]]:
    """Each example's prompt and completion token ids from a :class:`packers.Collator` batch: the completion is the
    example's targets, which must be one run to its end."""
    cu = batch["cu_seq_lens_q"].tolist()
    tokens, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    prompts, completions = [], []
    for s, eid in zip(batch["example_index"].tolist(), ids):
        a, z = cu[s], cu[s + 1]
        target = [t != -100 for t in labels[a:z]]
        first = target.index(True) if True in target else z - a
        if not all(target[first:]):
            raise PackstreamError(f"example {eid}: its targets are not one completion at its end; KTO trains "
                                  "prompt-completion examples (pack one completion per record)")
        prompts.append(tokens[a:a + first])
        completions.append(tokens[a + first:z])
    return prompts, completions


def _mismatched(prompts: list[list[int]], completions: list[list[int]], ids: tuple[Any, ...]) -> dict[str, Any]:
    """One packed batch of ``prompt[i] + completion[i]`` sequences (one row each), ids kept."""
    rows = [{"input_ids": p + c, "loss_mask": [0] * len(p) + [1] * len(c), "seq_offsets": [0, len(p) + len(c)],
             "example_ids": [f"{i}#kl"]} for p, c, i in zip(prompts, completions, ids)]
    return Collator()(rows)


def _check_targets(name: str, ds: PackedDataset) -> None:
    """The folder's targets are each example's completion, what TRL scores: not packed with ``--train-on all`` (the
    prompt among the targets) nor ``--mask-reasoning`` (the completion's reasoning left out), read from the run's
    options in the manifest (``PackOptions.to_dict()``; with ``--config``, each data set's)."""
    config = ds.manifest.config or {}
    specs = [d for d in config.get("config") or () if isinstance(d, dict)] or [config]
    for spec in specs:
        where = f" (data set {spec.get('name')!r})" if spec is not config else ""
        if spec.get("train_on", "assistant") != "assistant":
            raise PackstreamError(f"{name}: the folder was packed with --train-on {spec.get('train_on')}{where}, so its "
                                  "targets hold the prompt, and TRL scores the completion only; repack with the "
                                  "default --train-on assistant")
        if spec.get("mask_reasoning"):
            raise PackstreamError(f"{name}: the folder was packed with --mask-reasoning{where}, so the completions' "
                                  "reasoning is not among the targets, and TRL scores the whole completion; repack "
                                  "without --mask-reasoning")


def _real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _entry_problem(entry: Any, arity: int, kl: bool) -> str:
    """What is wrong with one reference entry (DPO: ``[logp]``; KTO: ``[logp, mismatched completion ids (None
    without the KL term, ``kl``), its logp]``), or ""."""
    if not isinstance(entry, (list, tuple)) or len(entry) != arity:
        return f"is not a list of {arity} value{'s' if arity > 1 else ''}"
    if not _real(entry[0]):
        return "holds a reference log-prob that is not a finite number"
    if arity == 3:
        comp = entry[1]
        if (comp is not None or kl) and not (isinstance(comp, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                                    and t >= 0 for t in comp)):
            return "holds a mismatched completion that is not a list of token ids"
        if not _real(entry[2]):
            return "holds a KL reference log-prob that is not a finite number"
    return ""


def _short(value: Any, most: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= most else text[:most - 3] + "..."


def _read_json(path: str, what: str, limit: int) -> Any:
    """The JSON file ``path`` these trainers wrote into a checkpoint, read through packstream's checked open."""
    from packers.files import load_json, read_checked

    fix = "it is not the file these trainers wrote; resume from another checkpoint"
    return load_json(read_checked(path, what=f"checkpoint file {what}", limit=limit, fix=fix), what=path, fix=fix)


def _write_json(path: str, value: Any) -> None:
    """``value`` as JSON at ``path``, whole or not at all (floats round-trip exactly: Python writes the shortest repr)."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> type:
    """``PackedDPOTrainer`` and ``PackedKTOTrainer``: the strategies above on ``transformers.Trainer``, built once."""
    mixins = {"PackedDPOTrainer": _DPO, "PackedKTOTrainer": _KTO}
    if name not in mixins:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _BUILT:
        from transformers import Trainer

        mixin = mixins[name]
        _BUILT[name] = type(name, (mixin, Trainer), {"__doc__": mixin.__doc__, "__module__": __name__,
                                                    "__qualname__": name})
    return _BUILT[name]
