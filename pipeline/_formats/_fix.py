"""A refusal's fix as data: the options that read a refused record, each with its value or a hole the user fills.

A shape module that refuses a record it could read under other options says which in a :class:`Fix`
(``Rejected(reason, detail, fix=..., after=...)``): the detail's text is rendered from it (:meth:`Fix.text`),
and the driver tries it on the record before the detail is shown (:func:`pipeline._formats._driver._validated`).
A fix that reads the record whole keeps its values (the top-level fields it leaves unread are named after the
detail); one that does not has them swapped for holes, the user's to choose (:meth:`Fix.holes`).

>>> f = Fix.of(messages_field="session", role_key="who", roles=(("A", "user"), ("B", ROLE)))
>>> f.text()
'--messages-field session --role-key who --roles A=user,B=ROLE'
>>> f.changes(FormatOptions())  # what trying it sets: the roles hold a hole, so they are the user's to fill
{'messages_field': 'session', 'role_key': 'who'}
>>> f.holes(FormatOptions()).text()
'--messages-field PATH --role-key KEY --roles A=user,B=ROLE'
>>> Fix.of(fields=(("turns", "user"), ("choices[0].turns", "assistant"))).text()
"--field turns=user --field 'choices[0].turns=assistant'"

A fix may also name a pack-level option (:data:`PACK_OPTIONS`: ``--pairs``), typed first and never set on the
FormatOptions it is tried with: a fix that names ``--pairs`` is tried by the pair reader.

>>> f = Fix.of(pairs=True, pair_sides="chosen_messages,rejected_messages")
>>> f.text(), f.changes(FormatOptions()), f.pack()
('--pairs --pair-sides chosen_messages,rejected_messages', {'pair_sides': 'chosen_messages,rejected_messages'}, {'pairs': True})
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

from packers import InternalError
from pipeline._options import FormatOptions, PackOptions


@dataclasses.dataclass(frozen=True)
class Hole:
    """A value the user must choose, shown as its word (``--content-key KEY``)."""

    word: str

    def __str__(self) -> str:
        return self.word


KEY, NAME, PATH, ROLE, MARKER, VALUE = (Hole(w) for w in ("KEY", "NAME", "PATH", "ROLE", "MARKER", "VALUE"))

PACK_OPTIONS = ("pairs",)
"""PackOptions fields (beyond FormatOptions) a fix may name: switches of how the job reads every record."""
_CLI = {f.name: f.metadata["cli"] for f in dataclasses.fields(PackOptions)
        if "cli" in f.metadata and (f.name in FormatOptions.__dataclass_fields__ or f.name in PACK_OPTIONS)}
_PAIRS = {name for name, meta in _CLI.items() if meta["kind"] == "pairs"}
_JOINED = {name for name in _PAIRS if (_CLI[name]["metavar"] or "").endswith(",...")}
"""Pair options given as one comma-separated value (``--roles a=user,b=assistant``); the others repeat the flag."""
_HOLES: dict[str, Any] = {"fields": (NAME, ROLE), "roles": (NAME, ROLE), "transcript_markers": (MARKER, ROLE),
                          "messages_field": PATH, "tree": PATH, "role_key": KEY, "content_key": KEY}
"""What a value the user must choose is shown as, per option (any other: ``VALUE``)."""


@dataclasses.dataclass(frozen=True)
class Fix:
    """The options that read a refused record: FormatOptions fields, each with its value.

    A value may hold :class:`Hole` s (``--roles customer=ROLE``): that option is the user's to complete
    and is not tried. A pair option (``fields``, ``roles``, ``transcript_markers``) adds its pairs to the
    ones given, in the place of the given pairs of the same name.
    """

    options: tuple[tuple[str, Any], ...]
    """``(FormatOptions field, value)`` in the order shown; a pair option's value is a tuple of pairs."""
    alternative: Any = None
    """Another value of the last option (for a pair option: of its last pair) the user may pick instead, shown as
    ``(or --flag VALUE)``; tried too."""
    drop: tuple[str, ...] = ()
    """Options the fix takes back (shown as ``instead of --field``)."""
    leaves: tuple[str, ...] = ()
    """Found by trying it: the fields of the record it leaves unread (counted as ignored)."""
    failed: bool = False
    """Found by trying it: no value reads the record whole, so its values are holes."""
    drops: tuple[str, ...] = ()
    """Top-level keys the fix reads only in part on purpose (one answer of several): what it leaves under them is
    not trained, named in the words, and does not fail the try."""

    def __post_init__(self) -> None:
        for name in (*(n for n, _ in self.options), *self.drop):
            if name not in _CLI or (name in PACK_OPTIONS and name in self.drop):
                raise InternalError(f"a fix names {name!r}, which is not an option of FormatOptions or PACK_OPTIONS")
        if not self.options:
            raise InternalError("a fix names no option")

    @classmethod
    def of(cls, *, alternative: Any = None, drop: tuple[str, ...] = (), drops: tuple[str, ...] = (),
           **options: Any) -> "Fix":
        """``Fix.of(content_key="answer")``: the options in the order given."""
        return cls(tuple(options.items()), alternative, drop, drops=drops)

    def pack(self) -> dict[str, Any]:
        """The pack-level options it names (``{"pairs": True}``): the job's, not the FormatOptions it is tried with."""
        return {name: value for name, value in self.options if name in PACK_OPTIONS}

    # -- the words ---------------------------------------------------------------------------------
    def text(self) -> str:
        """The options as they are typed: ``--field question=user --field answer=assistant``."""
        out = " ".join(_typed(name, value) for name, value in self.options)
        if self.alternative is not None:
            out += f" (or {_typed(self.options[-1][0], self.alternative)})"
        if self.drop:
            out += " instead of " + " and ".join(_CLI[name]["flag"] for name in self.drop)
        return out

    def outcome(self) -> str:
        """What trying it found, in words for the end of the detail ("" when it was not tried or left nothing)."""
        if self.failed:
            return " (no single option found that reads this record whole; check the record with packstream preview)"
        left = [k for k in self.leaves if not under(k, self.drops)]
        return f" ({', '.join(left)} then counted as ignored)" if left else ""

    # -- trying it ---------------------------------------------------------------------------------
    def changes(self, given: FormatOptions, alternative: bool = False) -> dict[str, Any]:
        """What the fix (or its alternative) sets over ``given``, for :func:`dataclasses.replace`: its values
        without holes that the user did not give. Empty when it holds no such value (nothing to try)."""
        options = list(self.options)
        if alternative:
            name, value = options[-1]
            options[-1] = (name, value[:-1] + self.alternative if name in _PAIRS else self.alternative)
        out: dict[str, Any] = {}
        for name, value in options:
            if _has_hole(value) or name in PACK_OPTIONS:
                continue
            have = getattr(given, name)
            if name not in _PAIRS:
                if value != have:
                    out[name] = value
            elif any(p not in have for p in value):  # it sets pairs only when some are new; then all of its own
                out[name] = _merged(have, tuple(dict.fromkeys(value)))
        if out:
            out.update({name: FormatOptions.__dataclass_fields__[name].default for name in self.drop})
        return out

    def applied(self, given: FormatOptions, alternative: bool = False) -> FormatOptions:
        """``given`` with the fix (or its alternative) applied; PackstreamError when the two do not combine."""
        return dataclasses.replace(given, **self.changes(given, alternative))

    def holes(self, given: FormatOptions) -> "Fix":
        """The fix with every value the user did not give swapped for a hole (``--content-key KEY``), as failed."""
        last = self.options[-1][0]
        alternative = None if self.alternative is None else _holed(last, self.alternative, getattr(given, last))
        options = tuple((name, value if name in PACK_OPTIONS else _holed(name, value, getattr(given, name)))
                        for name, value in self.options)
        return dataclasses.replace(self, options=options, alternative=alternative, leaves=(), failed=True)


def under(name: str, keys: tuple[str, ...]) -> bool:
    """Is the field path ``name`` one of ``keys`` or below one (``responses[1:]`` under ``responses``)?"""
    return any(name == k or name.startswith((k + ".", k + "[")) for k in keys)


def _has_hole(value: Any) -> bool:
    if isinstance(value, tuple):
        return any(_has_hole(v) for v in value)
    return isinstance(value, Hole)


def _merged(have: tuple, pairs: tuple) -> tuple:
    """``have`` with ``pairs`` added: the pairs of a name ``have`` holds take the place of its pairs of that name
    (turn order kept), the others follow."""
    out: list = []
    placed: set = set()
    for name, value in have:
        if not any(name == n for n, _ in pairs):
            out.append((name, value))
        elif name not in placed:
            out.extend(p for p in pairs if p[0] == name)
            placed.add(name)
    return tuple(out + [p for p in pairs if p[0] not in placed])


def _holed(name: str, value: Any, have: Any) -> Any:
    """``value`` with what the user did not give swapped for holes (a value with a hole is left as it is)."""
    hole = _HOLES.get(name, VALUE)
    if _has_hole(value):
        return value
    if name in _JOINED:
        return value if set(value) <= set(have) else (hole,)
    if name in _PAIRS:
        return tuple(p if p in have else hole for p in value)
    return value if value == have else hole


_SHELL = re.compile(r"""[\s'"\\$`!*?\[\](){}<>|&;#~]""")
"""Characters a shell would read as something other than the value itself."""


def _quoted(text: str) -> str:
    """``text`` as one shell word: as it is, or in single quotes where a shell would read it otherwise."""
    if text and not _SHELL.search(text):
        return text
    return "'" + text.replace("'", "'\\''") + "'"


def _word(value: Any) -> str:
    return value.value if isinstance(value, enum.Enum) else str(value)


def _typed(name: str, value: Any) -> str:
    """One option as typed in a shell: ``--content-key answer``, ``--field 'choices[0].turns=assistant'``."""
    flag = _CLI[name]["flag"]
    if _CLI[name]["kind"] == "switch":
        return flag if value else ""
    if name not in _PAIRS:
        return f"{flag} {_quoted(_word(value))}"
    pairs = [f"{_word(a)}={_word(b)}" for a, b in value]
    if name in _JOINED:
        return f"{flag} {_quoted(','.join(pairs))}"
    return " ".join(f"{flag} {_quoted(p)}" for p in pairs)
