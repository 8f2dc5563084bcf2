"""How an option field is declared and read: its command-line metadata (:func:`cli`), ``NAME=VALUE`` pairs,
enum values, and the JSON form recorded in the manifest."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional

from packers import PackstreamError
from packers.errors import parse_enum


def cli(flag: str, help: str, *, short: Optional[str] = None, metavar: Optional[str] = None,
        kind: str = "", commands: tuple[str, ...] = ("pack", "estimate", "preview")) -> dict[str, Any]:
    """Field metadata: how a field appears on the command line.

    ``kind``: "" (derived from the type), ``pairs`` (repeatable ``NAME=VALUE``, or comma
    separated), ``list`` (repeatable), ``file`` (a file whose text is the value), ``flag``
    (``--x/--no-x``), ``switch`` (a bare flag that turns on), ``auto`` (a count, or ``auto``
    stored as 0).
    """
    return {"cli": {"flag": flag, "help": help, "short": short, "metavar": metavar, "kind": kind,
                    "commands": commands}}


def parse_pairs(value: Any, what: str) -> tuple[tuple[str, str], ...]:
    """``(("a", "b"), ...)`` from pairs, a ``{a: b}`` mapping or ``"a=b,c=d"`` text."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):
        value = list(value.items())
    items: list[Any] = []
    for item in value or ():  # "a=b,c=d" strings hold several pairs
        items += [p for p in item.split(",") if p.strip()] if isinstance(item, str) else [item]
    out = []
    for item in items:
        if isinstance(item, str):
            if "=" not in item:
                raise PackstreamError(f"{what} {item!r} must look like NAME=ROLE, e.g. {what} question=user")
            k, v = item.split("=", 1)
            item = (k.strip(), v.strip())
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            raise PackstreamError(f"{what} {item!r} must be a NAME=VALUE pair of strings")
        out.append((item[0], item[1]))
    return tuple(out)


def jsonable(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple):
        return [jsonable(x) for x in v]
    return v


def option_enum(cls, value, name: str):
    """``value`` as a member of the enum ``cls``, or the error naming the option ``--<name>`` and its values."""
    return parse_enum(cls, value, "--" + name.replace("_", "-"))


def flag_of(cls, name: str) -> str:
    """The command-line flag of a field (its cli metadata), e.g. ``--content-key``."""
    meta = {f.name: f.metadata.get("cli") for f in dataclasses.fields(cls)}.get(name)
    return meta["flag"] if meta else "--" + name.replace("_", "-")
