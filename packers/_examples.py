"""Which sequences of a collated batch are the rows' examples, and their ids: what per-example outputs index.

A batch's sequences (``cu_seq_lens``, ``seq_idx``) include each padded row's padding with
``Collator(fixed_shape=True)``, right after that row; the rows' examples are the others. Two rows,
budget 8::

    row 0  [ a a a | b b | . . . ]      row 1  [ c c c c c | . . . ]      (. = padding)
    sequence   0       1     2                      3           4
    example_index  [0, 1, 3]                        (int64: the sequence of each example, in the rows' order)
    example_ids    ["a", "b", "c"]                  (when the rows carry example_ids)

:func:`packers.example_losses` and :func:`packers.sequence_logps` return one value per example, in this
order, with its id: a padding sequence never takes an example's place. (Issue "No silent mismatch left in
training": pairing per-sequence values with ``example_ids`` in order put row 0's padding where row 1's first
example belonged.)
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from packers.errors import PackstreamError

_NOT_COLLATED = ("collate the rows with packers.Collator() (return_example_index=True, the default) and pass its "
                 "batch as it is")


def text_positions(batch: Mapping[str, Any]) -> torch.Tensor:
    """The batch's ``[1, T]`` 1-D positions: ``position_ids``, or its row 0 when it is ``[4, 1, T]`` (a vision batch:
    row 0 the text positions, rows 1..3 the mRoPE positions; see :class:`packers.Collator`)."""
    pos = batch["position_ids"]
    return pos[0] if pos.dim() == 3 else pos


def sequences(batch: Mapping[str, Any], device: torch.device) -> tuple[torch.Tensor, int]:
    """The sequence of each of the batch's ``T`` tokens (``[T]`` int64: they restart where ``position_ids`` is 0)
    and the number of sequences."""
    pos = text_positions(batch)
    starts = pos[0].to(device) == 0
    return torch.cumsum(starts.to(torch.int64), 0) - 1, int(starts.sum())


def examples(batch: Mapping[str, Any], n_seq: int, device: torch.device) -> tuple[torch.Tensor, tuple[Any, ...] | None]:
    """``example_index`` (``[E]`` int64 on ``device``) and ``example_ids`` (a tuple of ``E``; None when the rows
    carried none) of a :class:`packers.Collator` batch of ``n_seq`` sequences, checked."""
    index = batch.get("example_index")
    if index is None:
        raise PackstreamError(f"the batch has no example_index (which of its {n_seq} sequences are examples, which "
                              f"are a padded row's padding): {_NOT_COLLATED}")
    index = torch.as_tensor(index).to(device, torch.int64)
    if index.dim() != 1 or (index.numel() and (int(index.min()) < 0 or int(index.max()) >= n_seq
                                               or bool((torch.diff(index) <= 0).any()))):
        shown = index.flatten().tolist()[:8]
        raise PackstreamError(f"example_index {shown} does not name increasing sequences of this batch's {n_seq}: "
                              f"the batch was changed after collation; {_NOT_COLLATED}")
    ids = batch.get("example_ids")
    if ids is not None:
        ids = tuple(ids)
        if len(ids) != index.shape[0]:
            raise PackstreamError(f"{len(ids)} example_ids for {index.shape[0]} examples in example_index: the batch "
                                  f"was changed after collation; {_NOT_COLLATED}")
    return index, ids
