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

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from packers._collate import IGNORE_INDEX
from packers._examples import examples, sequences
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


_MOVED = ("example_losses returns an ExampleLosses (one value per example, padding left out, with its id), not a "
          "tensor with one value per sequence: use .loss ([E] tensor, in the rows' example order), .ids, or "
          ".by_id() ({example id: loss})")


@dataclass(frozen=True)
class ExampleLosses:
    """What :func:`example_losses` returns: one value per example of the batch (in the rows' order, as the
    batch's ``example_index``; a padded row's padding is no example), each with its id.

    An old caller that treated the result as a tensor (``example_losses(...)[: len(ids)]``, ``.tolist()``,
    ``zip(ids, ...)``) gets a :class:`packers.PackstreamError` naming ``.loss`` / ``.ids`` / ``.by_id()``.
    """

    loss: torch.Tensor
    """``[E]`` float32: each example's mean cross-entropy over its target tokens; NaN for an example without one."""
    targets: torch.Tensor
    """``[E]`` int64: each example's target tokens (to weight the means: ``(loss * targets).nansum() / targets.sum()``)."""
    ids: tuple[Any, ...] | None
    """The examples' ids (the rows' ``example_ids``), aligned with ``loss``; None when the rows carried none."""

    def by_id(self) -> dict[Any, float]:
        """``{example id: mean loss}``."""
        if self.ids is None:
            raise PackstreamError("this batch's rows carried no example_ids, so its losses have no ids: read .loss, "
                                  "one value per example in the rows' order (padding already left out), or collate "
                                  "rows that carry example_ids (from packers.PackedDataset or packstream shards)")
        return dict(zip(self.ids, self.loss.tolist()))

    # The old return value was a [N] tensor: fail loudly, naming the new spelling, where it was used as one.
    def __getitem__(self, key: Any) -> Any:
        raise PackstreamError(_MOVED)

    def __iter__(self) -> Any:
        raise PackstreamError(_MOVED)

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__") and hasattr(torch.Tensor, name):
            raise PackstreamError(f".{name}: {_MOVED}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise PackstreamError(f"{getattr(func, '__name__', func)}(): {_MOVED}")


def example_losses(logits: torch.Tensor, batch: Mapping[str, Any]) -> ExampleLosses:
    """Per example of the batch (the rows' examples in order, never a padded row's padding), its mean
    cross-entropy over its target tokens, fp32 (summed in float64); NaN for an example with no target.

    What each example gives alone (``model(input_ids=example)`` and the same mean): eval parity. Returns an
    :class:`ExampleLosses`: ``.loss`` and ``.targets`` per example, ``.ids`` (the rows' ``example_ids``)
    aligned with them, ``.by_id()``.

    >>> import torch
    >>> from packers import Collator
    >>> rows = [{"input_ids": [5, 9, 41], "loss_mask": [0, 1, 1], "seq_offsets": [0, 3], "example_ids": ["a"]},
    ...         {"input_ids": [7, 8], "loss_mask": [0, 1], "seq_offsets": [0, 2], "example_ids": ["b"]}]
    >>> batch = Collator(fixed_shape=True, budget=4)(rows)   # sequences: a, padding, b, padding
    >>> out = example_losses(torch.zeros(1, 8, 50), batch)   # uniform over 50 tokens: log(50) = 3.912 per target
    >>> {i: round(v, 3) for i, v in out.by_id().items()}, out.targets.tolist()
    ({'a': 3.912, 'b': 3.912}, [2, 1])
    """
    labels = batch["labels"]
    if labels.dim() != 2 or labels.shape[0] != 1 or batch.get("position_ids") is None:
        raise PackstreamError(f"example_losses needs a flattened [1, T] batch with position_ids, got labels of shape "
                              f"{tuple(labels.shape)}: collate with packers.Collator()")
    ce = _token_losses(logits, labels)
    seq, n_seq = sequences(batch, ce.device)
    index, ids = examples(batch, n_seq, ce.device)
    counted = (labels[0, 1:] != IGNORE_INDEX).to(ce.device)
    at = seq[1:]  # the sequence of each label position 1..T-1 (a sequence's first label is never counted)
    # float64 sums: a long example's thousands of terms added one at a time in fp32 drift by ~1e-3
    sums = torch.zeros(n_seq, dtype=torch.float64, device=ce.device).index_add_(0, at, ce.double())
    counts = torch.zeros(n_seq, dtype=torch.int64, device=ce.device).index_add_(0, at, counted.to(torch.int64))
    sums, counts = sums[index], counts[index]
    return ExampleLosses(loss=(sums / counts).float(), targets=counts, ids=ids)
