"""A typed reader of JSON objects: each key read is declared once (:class:`Key`: its type, range and default) and
:func:`get` is the one check of all of them, so a value of the wrong type, out of range or missing is one
PackstreamError line naming the file it is in, the key, the value as written, what was expected and the fix.

The processor configs of :mod:`packers._vision` (``preprocessor_config.json``, ``processor_config.json``) and the
vision specs that manifests and shards store are read through it.

>>> values = {"patch_size": ("two", "--processor m/preprocessor_config.json", "")}
>>> read(values, Key("patch_size", int, 1, 1024), "fix the value", "m")
Traceback (most recent call last):
...
packers.errors.PackstreamError: --processor m/preprocessor_config.json: patch_size is "two", expected an integer in 1..1024; fix the value
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from packers.errors import PackstreamError

NEEDED = object()
"""The default of a key that must be there."""


@dataclasses.dataclass(frozen=True)
class Key:
    """One value a reader takes from a JSON object, declared once: its name, type, range and default.
    :func:`get` is the one check of all of them.

    An integer is a JSON integer, or a float with no fraction (``14.0`` reads as ``14``, as ``int()`` read it
    before); ``true``/``false`` are never integers.
    """

    path: str
    """The key; ``parent.child`` reads inside an object (``size.shortest_edge``)."""
    kind: type
    """``int`` or ``str``."""
    low: int = 0
    high: int = 0
    """The range: of the value for an ``int``, of its length for a ``str``."""
    choices: tuple[str, ...] = ()
    """A ``str`` must be one of these, when given."""
    default: Any = NEEDED
    """The value when the key is absent (``NEEDED``: it must be there)."""
    nullable: bool = False
    """``null`` reads as absent (HF writes ``min_pixels: null`` when ``size`` holds the setting); elsewhere a
    ``null`` is refused. A ``null`` parent (``"size": null``) always reads as absent."""
    bare: bool = False
    """The parent may be the value itself: CLIP's older ``crop_size: 336`` for ``{"height": 336, ...}``."""

    def expected(self) -> str:
        if self.kind is float:
            return f"a number in {self.low}..{self.high}"
        if self.kind is int:
            return f"an integer in {self.low}..{self.high}"
        if self.choices:
            return "one of " + ", ".join(json.dumps(c) for c in self.choices)
        return f"a string of {self.low}..{self.high} characters"


def shown(value: Any, limit: int = 60) -> str:
    """``value`` as the JSON file has it, cut to ``limit`` characters (a bad value can be long)."""
    s = json.dumps(value, ensure_ascii=True, allow_nan=True)
    return s if len(s) <= limit else s[: limit - 1] + "…"


@dataclasses.dataclass(frozen=True)
class Got:
    """A value read, and where from (for messages about two values at once)."""

    value: Any
    what: str = ""
    """The file (``--processor PATH``) it came from; empty for a default."""
    label: str = ""
    """The key as written there (``image_processor.patch_size`` when nested in processor_config.json)."""

    def named(self, default_name: str, beside: str) -> str:
        """``label value``, the file too when it is not ``beside``; ``the default NAME value`` for a default."""
        if not self.what:
            return f"the default {default_name} {self.value}"
        return f"{self.label} {self.value}" + (f" (in {self.what})" if self.what != beside else "")


def get(values: Mapping[str, tuple[Any, str, str]], key: Key, fix: str) -> Got:
    """``key`` read from ``values`` (key -> (value, the file it came from, its key prefix)) and checked: the value,
    its default when absent, or a one-line PackstreamError naming the file, the key, the value given, what was
    expected and ``fix``."""
    head, _, child = key.path.partition(".")
    if head not in values:
        return Got(key.default)
    value, what, prefix = values[head]
    label = prefix + head

    def bad(value: Any, expected: str) -> PackstreamError:
        return PackstreamError(f"{what}: {label} is {shown(value)}, expected {expected}; {fix}")

    expected = key.expected()
    if child:
        if value is None:
            return Got(key.default)
        if isinstance(value, dict):
            if child not in value:
                return Got(key.default)
            value, label = value[child], f"{label}.{child}"
        elif not key.bare:
            raise bad(value, "an object")
        else:  # the parent stands for the value itself
            expected = f"an object or {expected}"
    if value is None:
        if key.nullable:
            return Got(key.default)
        raise bad(value, expected)
    if key.kind is int:
        if not integral(value) or not key.low <= value <= key.high:
            raise bad(value, expected)
        return Got(int(value), what, label)
    if key.kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not key.low <= value <= key.high:
            raise bad(value, expected)
        return Got(float(value), what, label)
    if not isinstance(value, str) or (key.choices and value not in key.choices) or (
            not key.choices and not key.low <= len(value) <= key.high):
        raise bad(value, expected)
    return Got(value, what, label)


def read(values: Mapping[str, tuple[Any, str, str]], key: Key, fix: str, where: str) -> Any:
    """:func:`get`'s value; a key that must be there and is not is an error naming ``where`` (the file)."""
    got = get(values, key, fix)
    if got.value is NEEDED:
        raise PackstreamError(f"{where}: {key.path} is missing, expected {key.expected()}; {fix}")
    return got.value


def integral(value: Any) -> bool:
    """A JSON integer, or a float with no fraction; not a bool."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float)
                                                                          and value.is_integer())


@dataclasses.dataclass(frozen=True)
class Fixed:
    """An image processor setting that changes the pixels (never the token count) and that packstream's loader
    reproduces at one value only: the key, that value, and whether a config may leave it out (absent or null: the
    processor class's default, which is that value) or must write it (the class default is another)."""

    key: str
    value: Any
    default_ok: bool = True


def check_fixed(config: Mapping[str, tuple[Any, str, str]], fixed: Sequence[Fixed], where: str, family: str,
                fix: str) -> None:
    """PackstreamError naming the file, the key, the value and the expected one when a setting of ``fixed`` is not
    ``family``'s (a left-out one only where its class default is another), so that the pixels the loader gives the
    model are the ones the model's own processor would give it."""
    for f in fixed:
        value, what, prefix = config.get(f.key, (None, where, ""))
        if value is None and f.default_ok:
            continue
        if value is None or not _same(value, f.value):
            shown_value = "absent (its class default is another)" if value is None else json.dumps(value)[:60]
            raise PackstreamError(f"{what}: {prefix}{f.key} is {shown_value}, expected {json.dumps(f.value)} "
                                  f"({family}'s; packstream's loader reproduces only that); {fix}")


def _same(value: Any, want: Any) -> bool:
    if isinstance(want, bool):
        return value is want
    if isinstance(want, (list, tuple)):
        return (isinstance(value, list) and len(value) == len(want)
                and all(_number(v) and abs(v - w) <= 1e-9 for v, w in zip(value, want)))
    return _number(value) and abs(value - want) <= 1e-12


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
