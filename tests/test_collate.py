"""packers.Collator: worked examples, agreement with transformers' DataCollatorWithFlattening, properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packers import Collator, ContractError, PackstreamError
from tests._shards import Example, make_row, random_examples


def test_worked_example():
    # Row 0 holds two examples (4 + 2 tokens), row 1 one example (5 tokens).
    rows = [
        {"input_ids": [5, 9, 41, 17, 5, 30], "loss_mask": [0, 0, 1, 1, 0, 1], "seq_offsets": [0, 4, 6]},
        {"input_ids": [5, 8, 6, 1, 2], "loss_mask": [1, 0, 1, 1, 1], "seq_offsets": [0, 5]},
    ]
    b = Collator()(rows)
    assert b["input_ids"].tolist() == [[5, 9, 41, 17, 5, 30, 5, 8, 6, 1, 2]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4]]
    # -100 where loss_mask is 0, and on each example's first token even where loss_mask is 1 (row 1's "5")
    assert b["labels"].tolist() == [[-100, -100, 41, 17, -100, 30, -100, -100, 6, 1, 2]]
    assert b["cu_seq_lens_q"].tolist() == b["cu_seq_lens_k"].tolist() == [0, 4, 6, 11]
    assert b["cu_seq_lens_q"].dtype == torch.int32 and b["seq_idx"].dtype == torch.int32
    assert b["max_length_q"] == b["max_length_k"] == 5 and isinstance(b["max_length_q"], int)
    assert b["seq_idx"].tolist() == [[0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2]]
    assert b["use_cache"] is False
    assert {b[k].dtype for k in ("input_ids", "labels", "position_ids")} == {torch.int64}


def test_fixed_shape_worked_example():
    rows = [{"input_ids": [5, 9, 41], "loss_mask": [0, 1, 1], "seq_offsets": [0, 3]},
            {"input_ids": [7, 8, 6, 1, 2], "loss_mask": [0, 1, 1, 1, 1], "seq_offsets": [0, 2, 5]}]
    b = Collator(fixed_shape=True, budget=5, pad_token_id=99)(rows)
    assert b["input_ids"].tolist() == [[5, 9, 41, 99, 99, 7, 8, 6, 1, 2]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 0, 1, 2]]  # the padding is a sequence of its own
    assert b["labels"].tolist() == [[-100, 9, 41, -100, -100, -100, 8, -100, 1, 2]]
    assert b["cu_seq_lens_q"].tolist() == [0, 3, 5, 7, 10]
    assert b["max_length_q"] == 5  # the budget: constant for torch.compile
    assert b["example_index"].tolist() == [0, 2, 3]  # sequence 1 is row 0's padding: no example
    assert "example_ids" not in b  # these rows carry none


def test_example_ids_one_per_sequence():
    """The rows' example_ids become the batch's, flattened; a row with too many or too few is refused even without
    validate (it would pair every value after it with the wrong example), and so is a batch mixing rows with ids
    and rows without."""
    row = {"input_ids": [5, 9, 41, 7, 8], "loss_mask": [0, 1, 1, 0, 1], "seq_offsets": [0, 3, 5], "example_ids": ["a", "b"]}
    other = {"input_ids": [7, 8, 6], "loss_mask": [0, 1, 1], "seq_offsets": [0, 3], "example_ids": ["c"]}
    b = Collator(fixed_shape=True, budget=6)([row, other])
    assert b["example_ids"] == ["a", "b", "c"] and b["example_index"].tolist() == [0, 1, 3]
    for validate in (True, False):
        with pytest.raises(ContractError, match=r"row 1: 2 example_ids for 1 sequences"):
            Collator(validate=validate)([row, {**other, "example_ids": ["c", "d"]}])
    with pytest.raises(PackstreamError, match="row 0 carries example_ids, row 1 does not"):
        Collator()([row, {k: v for k, v in other.items() if k != "example_ids"}])
    with pytest.raises(PackstreamError, match="row 0 carries no example_ids, row 1 does"):
        Collator()([{k: v for k, v in row.items() if k != "example_ids"}, other])


def test_options_drop_keys():
    rows = [make_row(random_examples(3, seed=1))]
    b = Collator(return_flash_attn_kwargs=False, return_seq_idx=False, disable_cache=False,
                 return_example_index=False)(rows)
    assert set(b) == {"input_ids", "labels", "position_ids"}


@pytest.mark.parametrize("rows_per_batch", [1, 3])
def test_same_as_transformers_flattening_collator(rows_per_batch):
    """Fed the same examples, transformers' DataCollatorWithFlattening gives the same batch."""
    from transformers import DataCollatorWithFlattening

    examples = random_examples(4 * rows_per_batch, seed=rows_per_batch)
    rows = [make_row(examples[i::rows_per_batch]) for i in range(rows_per_batch)]
    ours = Collator()(rows)
    features = [
        {"input_ids": e.input_ids, "labels": [t if m else -100 for t, m in zip(e.input_ids, e.loss_mask)]}
        for r in range(rows_per_batch)
        for e in examples[r::rows_per_batch]
    ]
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(features)
    for key in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "seq_idx"):
        assert ours[key].tolist() == theirs[key].tolist(), key
    assert ours["max_length_q"] == theirs["max_length_q"]


def test_accepts_lists_numpy_and_tensors():
    row = make_row(random_examples(2, seed=3))
    as_np = {k: np.asarray(v) for k, v in row.items()}
    as_pt = {k: torch.tensor(v) for k, v in row.items() if k != "example_ids"}
    ref = Collator()([row])
    for other in (as_np, as_pt):
        assert all(torch.equal(ref[k], Collator()([other])[k]) for k in ("input_ids", "labels", "position_ids"))


@pytest.mark.parametrize(
    "row,match",
    [
        ({"input_ids": [1, 2, 3], "loss_mask": [1, 1], "seq_offsets": [0, 3]}, "loss_mask has 2"),
        ({"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1], "seq_offsets": [0, 2]}, "from 0 to len"),
        ({"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1], "seq_offsets": [1, 3]}, "from 0 to len"),
        ({"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1], "seq_offsets": [0, 2, 2, 3]}, "strictly increasing"),
        ({"input_ids": [1] * 9, "loss_mask": [1] * 9, "seq_offsets": [0, 9]}, "9 tokens > budget 8"),
    ],
)
def test_broken_rows_are_refused(row, match):
    with pytest.raises(ContractError, match=match):
        Collator(budget=8)([row])


def test_bad_options_are_refused():
    with pytest.raises(PackstreamError, match="needs the row budget"):
        Collator(fixed_shape=True)
    with pytest.raises(PackstreamError, match="empty list"):
        Collator()([])


# -- properties over random rows -------------------------------------------------------------------

example = st.builds(
    lambda ids, bits: Example("h", ids, [b for b, _ in zip(bits, ids)]),
    st.lists(st.integers(2, 500), min_size=1, max_size=12),
    st.lists(st.integers(0, 1), min_size=12, max_size=12),
)
rows_strategy = st.lists(st.lists(example, min_size=1, max_size=5).map(make_row), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(rows=rows_strategy, fixed=st.booleans())
def test_properties(rows, fixed):
    budget = 64
    b = Collator(fixed_shape=fixed, budget=budget, pad_token_id=1)(rows)
    ids, labels, pos = b["input_ids"][0], b["labels"][0], b["position_ids"][0]
    cu = b["cu_seq_lens_q"].tolist()
    T = ids.shape[0]
    assert T == (len(rows) * budget if fixed else sum(r["num_tokens"] for r in rows))
    assert cu[0] == 0 and cu[-1] == T and all(x < y for x, y in zip(cu, cu[1:]))
    # nothing lost, nothing reordered: each row's tokens appear in order at its offset
    at, example_starts = 0, []
    for r in rows:
        n = r["num_tokens"]
        example_starts += [at + o for o in r["seq_offsets"][:-1]]
        assert ids[at : at + n].tolist() == r["input_ids"]
        mask = torch.tensor(r["loss_mask"], dtype=torch.bool)
        want = torch.where(mask, torch.tensor(r["input_ids"]), -100)
        want[r["seq_offsets"][:-1]] = -100
        assert labels[at : at + n].tolist() == want.tolist()
        if fixed:
            assert (labels[at + n : at + budget] == -100).all() and (ids[at + n : at + budget] == 1).all()
        at += budget if fixed else n
    # positions reset to 0 exactly at every sequence start, count up by one elsewhere
    starts = torch.zeros(T, dtype=torch.bool)
    starts[cu[:-1]] = True
    assert ((pos == 0) == starts).all()
    assert (pos[1:][~starts[1:]] == pos[:-1][~starts[1:]] + 1).all()
    assert b["max_length_q"] == (budget if fixed else max(y - x for x, y in zip(cu, cu[1:])))
    assert torch.equal(b["seq_idx"][0].long(), torch.cumsum(starts.long(), 0) - 1)
    # example_index: the sequence of each of the rows' examples, in order, where that example starts; the rest of
    # the sequences (one per padded row) are padding
    index = b["example_index"].tolist()
    assert [cu[k] for k in index] == example_starts and b["example_ids"] == [i for r in rows for i in r["example_ids"]]
    padded = sum(fixed and r["num_tokens"] < budget for r in rows)
    assert len(cu) - 1 == len(index) + padded


def test_logits_of_a_smaller_vocabulary_are_one_error():
    """A model whose vocabulary is smaller than the packing tokenizer's: one error naming both, from every helper
    that scores targets (torch would raise an IndexError on CPU, a device-side assert on CUDA)."""
    import torch

    import packers

    batch = packers.Collator()([{"input_ids": [5, 9, 70, 1], "loss_mask": [0, 0, 1, 1], "seq_offsets": [0, 4]}])
    logits = torch.zeros(1, 4, 64)
    for score in (packers.loss, packers.example_losses, packers.sequence_logps):
        with pytest.raises(packers.PackstreamError, match=r"token id 70 is a target, but the logits score only 64"):
            score(logits, batch)
    assert torch.isfinite(packers.loss(torch.zeros(1, 4, 128), batch))
