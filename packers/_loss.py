"""The loss of a packed batch as its :class:`packers.PackedDataset` scheduled it, and per-example eval losses.

A packed micro-batch is a slice of an optimizer step that spans ``grad_accum`` micro-batches on each of
``world_size`` ranks. The step's loss is ``sum_t w_t * CE_t / D`` over every target token ``t`` of the
step, with ``w_t`` and ``D`` set by ``loss_weighting``:

=============  ====================================  ==========================================
weighting      ``w_t`` (each target token of ex. e)  ``D`` (the whole step, every rank)
=============  ====================================  ==========================================
``token``      1                                     target tokens
``example``    1 / (targets of e)                    examples with a target
``source``     ``loss_weight`` of e's data set       sum of the weights of its target tokens
=============  ====================================  ==========================================

The loader computes ``D`` before training and puts ``w_t * world_size / D`` in every row's
``loss_weights``, so :func:`loss` needs no communication: each rank backpropagates its micro-batches'
:func:`loss`, and data parallelism that averages gradients over ranks (DDP, FSDP) gives exactly the
gradient of the step's loss, as one unpacked batch of all its examples would (tests/test_loss.py).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F

from packers._collate import IGNORE_INDEX
from packers.errors import PackstreamError


def _check_vocab(token_ids: torch.Tensor, vocab: int) -> None:
    """A target the logits cannot score (a model whose vocabulary is smaller than the tokenizer's that packed the
    rows) is one error naming both, not torch's IndexError or a CUDA device-side assert."""
    if token_ids.numel():
        top = int(token_ids.max())
        if top >= vocab:
            raise PackstreamError(f"token id {top} is a target, but the logits score only {vocab} tokens: the model's "
                                  "vocabulary is smaller than the tokenizer's that packed these rows; use the model the "
                                  "rows were tokenized for (the manifest's tokenizer), or resize its embeddings")


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of predicting ``labels[t]`` from ``logits[t - 1]``, in fp32, flat over the batch's ``T - 1``
    label positions ``1..T-1``; 0 where the label is ignored."""
    if logits.shape[:-1] != labels.shape:
        raise PackstreamError(f"logits of shape {tuple(logits.shape)} do not match labels of shape {tuple(labels.shape)}")
    vocab = logits.shape[-1]
    _check_vocab(labels, vocab)
    return F.cross_entropy(logits[..., :-1, :].reshape(-1, vocab).float(), labels[..., 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="none")


def loss(logits: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """This micro-batch's part of its optimizer step's loss (see the module docstring): a scalar to backpropagate.

    ``logits`` is the model's output for ``batch`` (``model(**batch).logits``), ``batch`` a
    :class:`packers.Collator` batch. With the batch's ``loss_weights`` (rows from :class:`packers.PackedDataset`):
    ``sum_t loss_weights[t] * CE_t``, already divided by the step's global denominator and multiplied by the
    world size, so that the ranks' gradients averaged by DDP/FSDP are the step's; summed over a rank's
    micro-batches and averaged over ranks, the value is the step's loss. Without them (rows from elsewhere):
    the mean over this batch's targets, what ``model(**batch).loss`` gives.
    """
    labels = batch["labels"]
    ce = _token_losses(logits, labels)
    weights = batch.get("loss_weights")
    if weights is None:
        n = (labels[..., 1:] != IGNORE_INDEX).sum()
        return ce.sum() / n.clamp(min=1)
    if weights.shape != labels.shape:
        raise PackstreamError(f"loss_weights of shape {tuple(weights.shape)} do not match labels of shape "
                              f"{tuple(labels.shape)}; collate the rows with packers.Collator")
    return (ce * weights[..., 1:].reshape(-1).to(ce.device, ce.dtype)).sum()


def example_losses(logits: torch.Tensor, batch: Mapping[str, Any]) -> torch.Tensor:
    """Per sequence of the batch (the order of ``cu_seq_lens_q``: the rows' examples in order, then a padded
    row's padding), its mean cross-entropy over its target tokens, fp32; NaN for a sequence with no target.

    What each example gives alone (``model(input_ids=example)`` and the same mean): eval parity. Pair the
    values with the rows' ``example_ids``, flattened in order.
    """
    labels = batch["labels"]
    cu = batch.get("cu_seq_lens_q")
    if cu is None or labels.shape[0] != 1:
        raise PackstreamError("example_losses needs a flattened [1, T] batch with cu_seq_lens_q: collate with packers.Collator()")
    ce = _token_losses(logits, labels)
    cu = cu.to(ce.device, torch.int64)
    positions = torch.arange(1, labels.shape[-1], device=ce.device)
    seq = torch.searchsorted(cu[1:], positions, right=True)  # the sequence of each label position 1..T-1
    counted = (labels[0, 1:] != IGNORE_INDEX).to(ce.device)
    n = len(cu) - 1
    sums = torch.zeros(n, device=ce.device).index_add_(0, seq, ce)
    counts = torch.zeros(n, device=ce.device).index_add_(0, seq, counted.float())
    return sums / counts
