"""Labelled segments, template-free (Axolotl's input_output): ``{"segments": [{"text", "label": true}]}``.

Trained exactly where labelled, with no template and no EOS added.

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> read({"segments": [{"text": "Q: 2+2?\\nA: ", "label": False}, {"text": "4", "label": True}]}, Ctx(FormatOptions()))[0].segments
[('Q: 2+2?\\nA: ', False), ('4', True)]
"""

from __future__ import annotations

from pipeline._formats._base import Ctx, Draft, Reason, Rejected, Shape, _keys, _kind, _short, all_of, has, is_list
from pipeline._formats._turns import _content, _count_unread, flag01
from pipeline._options import Format


def _read_segments(record: dict, ctx: Ctx) -> list[tuple[str, bool]]:
    segs = record["segments"]
    if not isinstance(segs, list):
        raise Rejected(Reason.BAD_TYPE, f"segments is {_kind(segs)}, expected a list of {{text, label}}")
    if not segs:
        raise Rejected(Reason.EMPTY_CONVERSATION, "segments is an empty list")
    out = []
    for i, s in enumerate(segs):
        at = f"segments[{i}]"
        if not isinstance(s, dict):
            raise Rejected(Reason.BAD_TYPE, f"{at} is {_kind(s)}, expected an object {{text, label}}")
        if "text" not in s:
            raise Rejected(Reason.MISSING_FIELD, f"{at} has no 'text'; its keys: [{_keys(s)}]")
        text = _content(s["text"], f"{at}.text", ctx, "text").text
        key = next((k for k in ("label", "train", "training") if k in s), None)
        if key is None:
            raise Rejected(Reason.MISSING_FIELD, f"{at} has no 'label' (true: trained, false: context)")
        label = flag01(s[key])
        if label is None:
            raise Rejected(Reason.BAD_TYPE, f"{at}.{key} is {_short(s[key])}, expected true or false")
        _count_unread(s, {"text", key}, at, ctx)
        out.append((text, label))
    ctx.mapping.append(f"segments[]: text, label ({sum(t for _, t in out)} of {len(out)} trained)")
    return out


def read(record: dict, ctx: Ctx) -> list[Draft]:
    return [Draft(segments=_read_segments(record, ctx))]


SHAPE = Shape(
    name="segments",
    claims=all_of(has("segments"), is_list("segments")),
    reads=("segments",),
    read=read,
    looks_like="``segments: [{text, label}]`` (template-free, Axolotl's input_output)",
    keys="segments",
    format=Format.SEGMENTS,
)
