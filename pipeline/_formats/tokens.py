"""Pre-tokenized records: ``{"input_ids", "labels"?, "loss_mask"?, "attention_mask"?}``.

``labels`` is a copy of ``input_ids`` with -100 where not trained (never shifted); ``loss_mask``
says the same with 0/1; ``attention_mask`` zeros are padding and are removed (counted as
``padding_tokens_removed``). Whether the ids belong to the run's tokenizer is checked by the
encoder (``--tokenized-with``, the vocabulary).

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> read({"input_ids": [5, 6, 7, 0], "labels": [-100, 6, 7, -100], "attention_mask": [1, 1, 1, 0]},
...      Ctx(FormatOptions()))[0].tokens.tolist()
[[5, 6, 7], [0, 1, 1]]
"""

from __future__ import annotations

from typing import Any

from pipeline._formats._base import Ctx, Draft, Reason, Rejected, Shape, _kind, _short, all_of, has
from pipeline._options import Format

_INT32_MAX = 2**31 - 1


def _int_list(value: Any, key: str) -> list[int]:
    if not isinstance(value, list):
        raise Rejected(Reason.BAD_TYPE, f"{key} is {_kind(value)}, expected a list of integers")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                continue
            raise Rejected(Reason.BAD_TYPE, f"{key}[{i}] is {_kind(v)} {_short(v)}, expected an integer")
    return [int(v) for v in value]


def _read_tokens(record: dict, ctx: Ctx):
    import numpy as np

    ids = _int_list(record["input_ids"], "input_ids")
    if not ids:
        raise Rejected(Reason.EMPTY_CONVERSATION, "input_ids is an empty list")
    bad = next((v for v in ids if not 0 <= v <= _INT32_MAX), None)
    if bad is not None:
        raise Rejected(Reason.BAD_TOKEN_ID, f"input_ids holds {bad}, not a token id (0..{_INT32_MAX})")
    n = len(ids)
    keep = None
    if record.get("attention_mask") is not None:
        am = _int_list(record["attention_mask"], "attention_mask")
        if len(am) != n:
            raise Rejected(Reason.BAD_TYPE, f"attention_mask has {len(am)} values for {n} input_ids")
        if any(v not in (0, 1) for v in am):
            raise Rejected(Reason.BAD_TYPE, "attention_mask holds values other than 0 and 1")
        if not all(am):
            keep = am  # padding: packed rows store no padding
            ctx.note("padding_tokens_removed", n - sum(am))
    mask = [1] * n
    if record.get("labels") is not None:
        labels = _int_list(record["labels"], "labels")
        if len(labels) != n:
            raise Rejected(Reason.BAD_TYPE, f"labels has {len(labels)} values for {n} input_ids; they must align")
        for i, (t, y) in enumerate(zip(ids, labels)):
            if y != -100 and y != t:
                raise Rejected(Reason.BAD_TYPE, f"labels[{i}] is {y} but input_ids[{i}] is {t}: labels must be a copy "
                                                "of input_ids with -100 where not trained (not shifted)")
        mask = [int(y != -100) for y in labels]
        ctx.mapping.append("labels -> loss mask (-100: not trained)")
    if record.get("loss_mask") is not None:
        lm = _int_list(record["loss_mask"], "loss_mask")
        if len(lm) != n or any(v not in (0, 1) for v in lm):
            raise Rejected(Reason.BAD_TYPE, f"loss_mask must hold {n} values of 0 or 1 (one per input id)")
        if record.get("labels") is not None and lm != mask:
            raise Rejected(Reason.BAD_TYPE, "labels and loss_mask disagree on which tokens are trained")
        mask = lm
        ctx.mapping.append("loss_mask -> loss mask")
    if record.get("labels") is None and record.get("loss_mask") is None:
        ctx.mapping.append("no labels: every token trained")
    arr = np.array([ids, mask], dtype=np.int32)
    if keep is not None:
        arr = arr[:, np.asarray(keep, dtype=bool)]
    ctx.mapping.insert(0, f"input_ids ({arr.shape[1]} tokens)")
    return arr


def read(record: dict, ctx: Ctx) -> list[Draft]:
    return [Draft(tokens=_read_tokens(record, ctx))]


SHAPE = Shape(
    name="tokens",
    claims=all_of(has("input_ids")),
    reads=("input_ids", "labels", "loss_mask", "attention_mask"),
    read=read,
    looks_like="``input_ids`` (+ ``labels`` with -100, or ``loss_mask``; ``attention_mask``)",
    keys="input_ids",
    format=Format.TOKENS,
)
