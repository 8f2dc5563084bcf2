"""Field paths (``a.b``, ``choices[0].turns``, ``x[-1]``): the value at a path, and what a followed path leaves beside it.

>>> resolve({"a.b": 1, "a": {"b": 2}}, "a.b"), resolve({"x": [{"y": 3}]}, "x[-1].y")
(1, 3)
>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> ctx = Ctx(FormatOptions())
>>> unused_beside_paths({"choices": [{"index": 0, "turns": ["a"]}, {"turns": ["b"]}]}, ["choices[0].turns"], ctx)
>>> sorted(ctx.notes)
['ignored_field:choices[0].index', 'ignored_field:choices[1:]']
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from pipeline._formats._base import MISSING, Ctx, _blank
from pipeline._options import parse_path


def resolve(record: Any, path: str) -> Any:
    """The value at ``path`` (a key first taken literally, so ``"a.b"`` may be one key), or ``MISSING``."""
    if isinstance(record, dict) and path in record:
        return record[path]
    value = record
    for step in parse_path(path):
        if isinstance(step, int):
            if not isinstance(value, list) or not -len(value) <= step < len(value):
                return MISSING
        elif not isinstance(value, dict) or step not in value:
            return MISSING
        value = value[step]
    return value


def top_key(record: dict, path: str) -> str:
    """The top-level key a path starts from (the whole path when the record has it as one key)."""
    return path if path in record else str(parse_path(path)[0])


def unused_beside_paths(record: dict, paths: Sequence[str], ctx: Ctx) -> None:
    """What a followed path leaves beside it inside the record: ``--messages-field conversation.turns``
    does not read ``conversation.system``, ``--field 'choices[0].turns=assistant'`` does not read
    ``choices[1]``. Each such field that holds something is counted as ``ignored_field:<path>``
    (list items as ``choices[1]``, or ``choices[1:]`` for the rest of a list). Top-level keys are
    counted by the driver; what a path ends on is read whole."""
    tree: dict = {}
    for path in paths:
        if path in record:  # a key taken literally: read whole
            tree[path] = None
            continue
        node = tree
        steps = parse_path(path)
        for k, step in enumerate(steps):
            if k == len(steps) - 1:
                node[step] = None  # None: the whole value is read
            elif node.get(step, {}) is None:
                break  # inside a value read whole
            else:
                node = node.setdefault(step, {})
    for key, node in tree.items():
        if isinstance(key, str) and key in record:
            _unused_below(record[key], node, key, ctx)


def _unused_below(value: Any, node: Optional[dict], at: str, ctx: Ctx) -> None:
    if node is None:
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if k in node:
                _unused_below(v, node[k], f"{at}.{k}", ctx)
            elif not _blank(v):
                ctx.ignore(f"{at}.{k}")
    elif isinstance(value, list):
        n = len(value)
        read = {step % n: step for step in node if isinstance(step, int) and -n <= step < n}
        for i, step in read.items():
            _unused_below(value[i], node[step], f"{at}[{step}]", ctx)
        left = [i for i in range(n) if i not in read and not _blank(value[i])]
        while left:  # runs of items not read: x[2], or x[2:] for the rest of the list
            j = 0
            while j + 1 < len(left) and left[j + 1] == left[j] + 1:
                j += 1
            lo, hi = left[0], left[j]
            ctx.ignore(f"{at}[{lo}:]" if hi == n - 1 else f"{at}[{lo}]" if lo == hi else f"{at}[{lo}:{hi + 1}]")
            left = left[j + 1:]
