"""Per-sequence completion log-probabilities from one packed forward pass (DPO, ORPO, SimPO, rewards).

A batch of preference pairs from :class:`packers.Collator` holds each pair's two sides as
adjacent sequences. One forward of the model over the whole ``[1, T]`` batch gives every
token's logits; the log-probability of a sequence's completion is the sum over its completion
tokens ``t`` of ``log_softmax(logits[t - 1])[input_ids[t]]`` (token ``t`` is predicted from the
one before it, inside the same sequence: a completion never starts at a sequence's first token)::

    input_ids        [ 5  9 41 17 | 5  9 30 ]          one pair: chosen, then rejected
    completion_mask  [ .  .  T  T | .  .  T ]
    per-token logp   [ .  . a2 a3 | .  . b6 ]          a2 = log p(41 | 5 9), ...
    sum              [ a2 + a3    , b6      ]          one per sequence
    mean             [(a2 + a3)/2 , b6 / 1  ]
    chosen, rejected [a2 + a3], [b6]                   by the batch's pair_index

A reference model's pass over the same batch gives the reference log-probs the same way. Only
the completion positions' logits are upcast and normalised (never the whole ``[T, vocab]`` tensor
in float32). For a batch without pairs, the targets are the tokens whose label is not -100.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from packers.errors import PackstreamError
from packers._loss import _check_vocab


@dataclass(frozen=True)
class SequenceLogps:
    """What :func:`sequence_logps` returns: one value per sequence of the batch (as in ``cu_seq_lens``).

    ``sum`` is differentiable (through the logits). A sequence without completion tokens (a
    padding sequence of ``Collator(fixed_shape=True)``) has sum 0 and 0 tokens.
    """

    sum: torch.Tensor
    """``[N]`` float32: summed log-probability of each sequence's completion tokens."""
    tokens: torch.Tensor
    """``[N]`` int64: completion tokens of each sequence."""
    pair_index: torch.Tensor | None
    """``[P, 2]`` int64: (chosen, rejected) sequence indices; None for a batch without pairs."""

    @property
    def mean(self) -> torch.Tensor:
        """``[N]``: the mean per completion token (length-normalised, as SimPO and ORPO use it); 0 without tokens."""
        return self.sum / self.tokens.clamp(min=1).to(self.sum.dtype)

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
    """Each sequence's completion log-probability from a model's ``logits`` on a :class:`packers.Collator` batch.

    ``logits``: ``[1, T, vocab]`` (or ``[T, vocab]``), e.g. ``model(**batch).logits``. Completion
    tokens are the batch's ``completion_mask`` (rows of pairs), else the tokens whose label is not
    -100. Sequences are where ``position_ids`` restart. Returns a :class:`SequenceLogps`: ``.sum``
    and ``.mean`` per sequence, ``.chosen`` / ``.rejected`` (and ``_mean``) per pair.

    >>> import torch
    >>> from packers import Collator
    >>> row = {"input_ids": [5, 9, 41, 17, 5, 9, 30], "loss_mask": [0, 0, 1, 1, 0, 0, 1], "seq_offsets": [0, 4, 7],
    ...        "sides": [0, 1], "completion_spans": [2, 4, 6, 7]}
    >>> batch = Collator()([row])
    >>> logits = torch.zeros(1, 7, 50)                       # uniform over 50 tokens: log(1/50) per token
    >>> lp = sequence_logps(logits, batch)
    >>> lp.tokens.tolist(), [round(x, 4) for x in lp.sum.tolist()], round(lp.chosen_mean.item(), 4)
    ([2, 1], [-7.824, -3.912], -3.912)
    """
    ids, pos = batch["input_ids"], batch["position_ids"]
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
    starts = pos[0].to(device) == 0
    seq = torch.cumsum(starts.to(torch.int64), 0) - 1  # the sequence of each token
    n_seq = int(starts.sum())
    if bool((target & starts).any()):
        raise PackstreamError("a completion token is the first token of its sequence (nothing predicts it); the batch "
                              "is not a packers.Collator batch of a valid packed row")
    at = torch.nonzero(target, as_tuple=True)[0]
    token_ids = ids[0].to(device)[at]
    _check_vocab(token_ids, logits.shape[-1])
    lp = -F.cross_entropy(logits[at - 1].float(), token_ids, reduction="none")
    sums = torch.zeros(n_seq, dtype=lp.dtype, device=device).index_add(0, seq[at], lp)
    tokens = torch.bincount(seq[at], minlength=n_seq)
    pair_index = batch.get("pair_index")
    if pair_index is not None:
        pair_index = pair_index.to(device)
        if pair_index.numel() and int(pair_index.max()) >= n_seq:
            raise PackstreamError(f"pair_index names sequence {int(pair_index.max())}, the batch has {n_seq}")
    return SequenceLogps(sum=sums, tokens=tokens, pair_index=pair_index)
