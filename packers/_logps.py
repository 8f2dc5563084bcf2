"""Per-sequence completion log-probabilities from one packed forward pass (DPO, ORPO, SimPO, rewards).

A batch of preference pairs from :class:`packers.Collator` holds each pair's two sides as
adjacent sequences. One forward of the model over the whole ``[1, T]`` batch gives every
token's logits; the log-probability of a sequence's completion is the sum over its completion
tokens ``t`` of ``log_softmax(logits[t - 1])[input_ids[t]]`` (token ``t`` is predicted from the
one before it, inside the same sequence: a completion never starts at a sequence's first token)::

    input_ids        [ 5  9 41 17 | 5  9 30 ]          one pair: chosen, then rejected
    completion_mask  [ .  .  T  T | .  .  T ]
    per-token logp   [ .  . a2 a3 | .  . b6 ]          a2 = log p(41 | 5 9), ...
    sum              [ a2 + a3    , b6      ]          one per example (a padded row's padding is none)
    mean             [(a2 + a3)/2 , b6 / 1  ]
    ids              ["p#chosen"  , "p#rejected"]      the rows' example_ids
    chosen, rejected [a2 + a3], [b6]                   by the batch's pair_index

A reference model's pass over the same batch gives the reference log-probs the same way. Only
the completion positions' logits are upcast and normalised (never the whole ``[T, vocab]`` tensor
in float32). The sums are accumulated and returned in float64: added one at a time in float32, a 1,000-token
completion's log-prob (about -4,600) drifted by up to 4e-3 from its exact sum, and even rounded once to float32
at the end it carries up to 2.4e-4 of error, about what a DPO margin of policy-minus-reference differences
measures; so the differences a loss takes are taken in float64, and only the loss is float32 (or whatever the
caller casts it to).
For a batch without pairs, the targets are the tokens whose label is not -100.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from packers.errors import PackstreamError
from packers.schema import Side
from packers._examples import examples, sequences, text_positions
from packers._loss import _check_vocab


@dataclass(frozen=True)
class SequenceLogps:
    """What :func:`sequence_logps` returns: one value per example of the batch, in the rows' order (as the
    batch's ``example_index``: a padded row's padding is no example), with its id.

    ``sum`` is differentiable (through the logits). An example without completion tokens has sum 0
    and 0 tokens.
    """

    sum: torch.Tensor
    """``[E]`` float64: summed log-probability of each example's completion tokens (subtract the reference's in
    float64, then cast the loss)."""
    tokens: torch.Tensor
    """``[E]`` int64: completion tokens of each example."""
    pair_index: torch.Tensor | None
    """``[P, 2]`` int64: each pair's (chosen, rejected) positions in ``sum``, ``tokens`` and ``ids``; None for a
    batch without pairs. Not the batch's ``pair_index``, which counts sequences (padding included)."""
    ids: tuple[Any, ...] | None = None
    """The examples' ids (the rows' ``example_ids``, e.g. ``"dpo@1#chosen"``), aligned with ``sum``; None when
    the rows carried none."""
    desirable: torch.Tensor | None = None
    """``[E]`` int8, aligned with ``sum``: each example's KTO label (1 desirable, 0 undesirable, -1 none), the
    batch's ``desirable``; None when no row carried one. What :func:`kto_loss` reads."""

    @property
    def mean(self) -> torch.Tensor:
        """``[E]``: the mean per completion token (length-normalised, as SimPO and ORPO use it); 0 without tokens."""
        return self.sum / self.tokens.clamp(min=1).to(self.sum.dtype)

    @property
    def pair_ids(self) -> tuple[Any, ...] | None:
        """``P`` pair ids, aligned with ``chosen`` / ``rejected``: the chosen side's example id without its
        ``"#chosen"`` (the row contract names a side ``pair_id + "#chosen"``); None without ids."""
        if self.ids is None:
            return None
        suffix = Side.CHOSEN.suffix
        return tuple(str(self.ids[c]).removesuffix(suffix) for c in self._pairs()[:, 0].tolist())

    def _pairs(self) -> torch.Tensor:
        if self.pair_index is None:
            raise PackstreamError("this batch holds no preference pairs (no pair_index): pack with packstream pack "
                                  "--pairs, or read per-sequence values from .sum / .mean")
        return self.pair_index

    @property
    def chosen(self) -> torch.Tensor:
        """``[P]``: summed completion log-prob of each pair's chosen side."""
        return self.sum[self._pairs()[:, 0]]

    @property
    def rejected(self) -> torch.Tensor:
        """``[P]``: summed completion log-prob of each pair's rejected side."""
        return self.sum[self._pairs()[:, 1]]

    @property
    def chosen_mean(self) -> torch.Tensor:
        return self.mean[self._pairs()[:, 0]]

    @property
    def rejected_mean(self) -> torch.Tensor:
        return self.mean[self._pairs()[:, 1]]

    @property
    def chosen_tokens(self) -> torch.Tensor:
        return self.tokens[self._pairs()[:, 0]]

    @property
    def rejected_tokens(self) -> torch.Tensor:
        return self.tokens[self._pairs()[:, 1]]


def sequence_logps(logits: torch.Tensor, batch: Mapping[str, Any]) -> SequenceLogps:
    """Each example's completion log-probability from a model's ``logits`` on a :class:`packers.Collator` batch.

    ``logits``: ``[1, T, vocab]`` (or ``[T, vocab]``), e.g. ``model(**batch).logits``. Completion
    tokens are the batch's ``completion_mask`` (rows of pairs), else the tokens whose label is not
    -100. Sequences are where ``position_ids`` restart, examples the batch's ``example_index``.
    Returns a :class:`SequenceLogps`: ``.sum``, ``.mean`` and ``.tokens`` per example with ``.ids``,
    ``.chosen`` / ``.rejected`` (and ``_mean``) per pair with ``.pair_ids``.

    >>> import torch
    >>> from packers import Collator
    >>> row = {"input_ids": [5, 9, 41, 17, 5, 9, 30], "loss_mask": [0, 0, 1, 1, 0, 0, 1], "seq_offsets": [0, 4, 7],
    ...        "sides": [0, 1], "completion_spans": [2, 4, 6, 7], "example_ids": ["p#chosen", "p#rejected"]}
    >>> batch = Collator(fixed_shape=True, budget=8)([row])   # sequences: chosen, rejected, 1 token of padding
    >>> logits = torch.zeros(1, 8, 50)                       # uniform over 50 tokens: log(1/50) per token
    >>> lp = sequence_logps(logits, batch)
    >>> lp.ids, lp.tokens.tolist(), [round(x, 4) for x in lp.sum.tolist()]
    (('p#chosen', 'p#rejected'), [2, 1], [-7.824, -3.912])
    >>> lp.pair_ids, round(lp.chosen_mean.item(), 4)
    (('p',), -3.912)
    """
    sums, tokens, n_seq = _sequence_sums(logits, batch)
    device = sums.device
    index, ids = examples(batch, n_seq, device)
    pair_index = batch.get("pair_index")
    if pair_index is not None:
        pair_index = pair_index.to(device, torch.int64)
        flat = pair_index.reshape(-1)
        at = torch.searchsorted(index, flat)  # the batch's pair_index counts sequences; SequenceLogps's, examples
        if flat.numel() and (int(at.max()) >= index.shape[0] or not bool((index[at] == flat).all())):
            raise PackstreamError(f"pair_index names sequences {pair_index.flatten().tolist()[:8]} that are not all "
                                  f"examples (example_index {index.tolist()[:8]}): the batch was changed after "
                                  "collation; pass the packers.Collator batch as it is")
        pair_index = at.reshape(pair_index.shape)
    desirable = batch.get("desirable")
    if desirable is not None:
        desirable = torch.as_tensor(desirable).to(device, torch.int8)
        if desirable.shape != index.shape:
            raise PackstreamError(f"{desirable.shape[0]} desirable labels for {index.shape[0]} examples: the batch was "
                                  "changed after collation; pass the packers.Collator batch as it is")
    return SequenceLogps(sum=sums[index], tokens=tokens[index], pair_index=pair_index, ids=ids,
                         desirable=desirable)


def _sequence_sums(logits: torch.Tensor, batch: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per sequence of the batch (padding included): its completion tokens' summed log-probability in float64
    (``[N]``, differentiable), its completion tokens (``[N]`` int64), and ``N``. :func:`sequence_logps` before
    it picks the examples."""
    ids, pos = batch["input_ids"], text_positions(batch)
    if ids.dim() != 2 or ids.shape[0] != 1 or pos.shape != ids.shape:
        raise PackstreamError(f"sequence_logps needs a packed [1, T] batch from packers.Collator; got input_ids of shape "
                              f"{tuple(ids.shape)}")
    T = ids.shape[1]
    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise PackstreamError(f"logits of shape {tuple(logits.shape)} for a [1, {T}] batch; expected [1, {T}, vocab]")
        logits = logits[0]
    if logits.dim() != 2 or logits.shape[0] != T:
        raise PackstreamError(f"logits of shape {tuple(logits.shape)} for a batch of {T} tokens; expected [1, {T}, vocab] "
                              "(the model's output on this very batch)")
    device = logits.device
    if "completion_mask" in batch:
        target = batch["completion_mask"][0].to(device)
    else:
        target = batch["labels"][0].to(device) != -100
    seq, n_seq = sequences(batch, device)
    starts = pos[0].to(device) == 0
    if bool((target & starts).any()):
        raise PackstreamError("a completion token is the first token of its sequence (nothing predicts it); the batch "
                              "is not a packers.Collator batch of a valid packed row")
    at = torch.nonzero(target, as_tuple=True)[0]
    token_ids = ids[0].to(device)[at]
    _check_vocab(token_ids, logits.shape[-1])
    lp = -F.cross_entropy(logits[at - 1].float(), token_ids, reduction="none")
    # float64: thousands of fp32 terms added one at a time drift by ~1e-3 (issue "No silent mismatch left in
    # training"); lp itself stays fp32 (never the [tokens, vocab] logits in float64)
    sums = torch.zeros(n_seq, dtype=torch.float64, device=device).index_add(0, seq[at], lp.double())
    return sums, torch.bincount(seq[at], minlength=n_seq), n_seq


_PIECE = re.compile(r"#\d+$")
"""A piece of an example split by ``--long split``: ``<id>#<k>`` (packers.schema, ``example_ids``)."""


def _refuse_pieces(ids: tuple[Any, ...] | None, labels: torch.Tensor) -> None:
    """KTO scores whole examples: a labelled piece of a split one (a folder packed before packstream refused
    ``--long split`` for KTO data) is refused, naming it."""
    for eid, label in zip(ids or (), labels.tolist()):
        if label >= 0 and _PIECE.search(str(eid)):
            raise PackstreamError(f"example {eid!r} is a piece of a KTO example split by --long split: each piece "
                                  "carries the record's label and the later ones start mid-answer with no prompt, so "
                                  "KTO would score text the record never labelled (TRL truncates, never splits); "
                                  "repack the data with --long truncate or --long drop")


def kto_loss(policy: SequenceLogps, reference: SequenceLogps, kl: torch.Tensor | float, *, beta: float = 0.1,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> torch.Tensor:
    """The KTO loss (Ethayarajh et al. 2024, as TRL's ``KTOTrainer`` computes it) of a batch of labelled examples.

    ``policy`` and ``reference``: :func:`sequence_logps` of the policy's and the reference model's logits on one
    batch of rows packed from KTO data (each example's ``desirable`` label kept in the row). ``kl``: the
    reference point, an estimate of KL(policy || reference) (TRL: the mean log-ratio on mismatched
    prompt/completion pairs, clamped at 0 and detached). Per example, with ``r`` = policy - reference log-prob::

        desirable    w_d * (1 - sigmoid(beta * (r - kl)))
        undesirable  w_u * (1 - sigmoid(beta * (kl - r)))

    and the loss is their mean over the batch's labelled examples. An example without a label (-1) is refused:
    pack only labelled records for KTO.

    >>> import torch
    >>> lp = SequenceLogps(sum=torch.tensor([-2.0, -3.0]), tokens=torch.tensor([2, 3]), pair_index=None,
    ...                    desirable=torch.tensor([1, 0], dtype=torch.int8))
    >>> ref = SequenceLogps(sum=torch.tensor([-2.5, -2.0]), tokens=torch.tensor([2, 3]), pair_index=None)
    >>> round(kto_loss(lp, ref, kl=0.0, beta=1.0).item(), 4)   # (1 - sigmoid(0.5) + 1 - sigmoid(1.0)) / 2
    0.3232
    """
    labels = policy.desirable if policy.desirable is not None else reference.desirable
    if labels is None:
        raise PackstreamError("kto_loss needs each example's desirability: the batch carries no desirable labels; pack "
                              "KTO data (a boolean label, kto_tag or --kto-label field) with packstream pack")
    if policy.sum.shape != reference.sum.shape:
        raise PackstreamError(f"policy has {policy.sum.shape[0]} examples, reference {reference.sum.shape[0]}: compute "
                              "both with sequence_logps on the same batch")
    labels = labels.to(policy.sum.device)
    _refuse_pieces(policy.ids or reference.ids, labels)
    if bool((labels < 0).any()):
        raise PackstreamError(f"{int((labels < 0).sum())} of the batch's {labels.shape[0]} examples carry no "
                              "desirability label; KTO trains labelled examples only (pack only labelled records)")
    ratio = policy.sum - reference.sum.to(policy.sum.device).detach()
    kl = torch.as_tensor(kl, dtype=ratio.dtype, device=ratio.device)
    good = labels == 1
    losses = torch.where(good, desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
                         undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))))
    return losses.mean()
