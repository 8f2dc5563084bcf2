"""Exception types (one for user error, one for a broken internal invariant), and the checks that build their
messages: the one parser of enum values, the integer and number checks, the cut ``repr`` of a bad value.

Shared by the packers and the pipeline; users reach the types through :mod:`packers`.
"""

from __future__ import annotations

import enum
import math
from typing import TypeVar

import numpy as np

E = TypeVar("E", bound=enum.Enum)


class PackstreamError(ValueError):
    """A user-facing error: bad input, bad option, or data that breaks the contract.

    Messages name the value, the limit and the fix; the CLI prints them without a traceback.
    """


class ContractError(PackstreamError):
    """Data that does not follow the packed-row contract (:mod:`packers.schema`)."""


class InternalError(RuntimeError):
    """A broken internal invariant: a bug in packstream, never the user's fault."""


def parse_enum(kind: type[E], value: object, what: str) -> E:
    """``value`` as a member of ``kind`` (a member, or its value), else a PackstreamError naming ``what``,
    the value and the choices.

    >>> import enum
    >>> class Side(str, enum.Enum):
    ...     LEFT = "left"
    ...     RIGHT = "right"
    >>> parse_enum(Side, "left", "--truncate-side")
    <Side.LEFT: 'left'>
    >>> parse_enum(Side, "up", "--truncate-side")
    Traceback (most recent call last):
    ...
    packers.errors.PackstreamError: --truncate-side 'up' is not one of left, right
    """
    try:
        return kind(value)
    except ValueError:
        raise PackstreamError(f"{what} {value!r} is not one of {', '.join(str(m.value) for m in kind)}") from None


def short(value: object, limit: int = 80) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters (a bad value can be megabytes long; an
    integer of more than 30 digits is named by its length).

    >>> short("x" * 100, 12), short(10**40)
    ("'xxxxxxxxxx…", 'an integer of 41 digits')
    """
    big = isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30
    s = f"an integer of {len(str(abs(value)))} digits" if big else repr(value)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def is_int(value: object) -> bool:
    """An integer, Python's or numpy's, and not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_weight(value: object) -> bool:
    """A finite real number >= 0 (Python's or numpy's), not a bool: a weight, a cost, a fraction."""
    return (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0)


def check_int(value: object, name: str, *, low: int = 1, fix: str) -> int:
    """``value`` as an ``int`` when it is an integer >= ``low``, else a PackstreamError naming the value, the limit
    and the ``fix``.

    >>> check_int(0, "batch_size", fix="e.g. batch_size=8")
    Traceback (most recent call last):
    ...
    packers.errors.PackstreamError: batch_size=0 must be >= 1; e.g. batch_size=8
    """
    if not is_int(value):
        raise PackstreamError(f"{name} must be an integer, got {short(value)}; {fix}")
    if value < low:
        raise PackstreamError(f"{name}={value} must be >= {low}; {fix}")
    return int(value)
