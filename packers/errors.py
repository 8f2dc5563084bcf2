"""Exception types (one for user error, one for a broken internal invariant) and the one parser of enum values.

Shared by the packers and the pipeline; users reach the types through :mod:`packers`.
"""

from __future__ import annotations

import enum
from typing import TypeVar

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
