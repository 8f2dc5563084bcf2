"""``--messages-field PATH``: a list of turn objects under any key, or a list of strings that alternate user, assistant.

With ``--role-key``, ``--content-key`` and ``--roles`` for turn objects of any keys and speaker
names. What the path leaves beside it (``conversation.system`` for ``conversation.turns``) is
counted as ignored.

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> ctx = Ctx(FormatOptions(messages_field="data"))
>>> [(t.role, t.content) for t in read({"data": ["hi", "hello", "bye?", "bye"]}, ctx)[0].turns]
[('user', 'hi'), ('assistant', 'hello'), ('user', 'bye?'), ('assistant', 'bye')]
"""

from __future__ import annotations

from pipeline._formats._base import MISSING, Claim, Ctx, Draft, Shape
from pipeline._formats._paths import resolve, top_key
from pipeline._formats._turns import _speaker_words, _turn_list
from pipeline._formats.fields import _mapped_turns
from pipeline._options import FormatOptions


def read(record: dict, ctx: Ctx) -> list[Draft]:
    path = ctx.o.messages_field
    turns = _turn_list(resolve(record, path), path, ctx, strings_alternate=True)
    ctx.mapping.insert(0, f"{path}[]: " + (_speaker_words(ctx) or "turns"))
    if ctx.o.fields:  # the answer after the list: --messages-field conversations --field chosen=assistant
        # role order: a field mapped to system opens the conversation (--field system_prompt=system), the
        # others follow the list (issue 35: appended, a system field was trimmed as a trailing turn)
        head, rest = _mapped_turns(record, ctx)
        turns = head + turns + rest
    return [Draft(turns=turns)]


def _paths(o: FormatOptions) -> list[str]:
    return [o.messages_field, *(p for p, _ in o.fields)]


def _given(o: FormatOptions, missing: list[str]) -> str:
    return " ".join(f"--messages-field {p}" if p == o.messages_field else
                    " ".join(f"--field {f}={r}" for f, r in o.fields if f == p) for p in missing)


SHAPE = Shape(
    name="messages_field",
    claims=Claim(mapped=lambda record, o: [p for p in _paths(o) if resolve(record, p) is MISSING],
                 applies=lambda o: o.messages_field is not None, given=_given),
    reads=lambda record, o: {top_key(record, p) for p in _paths(o)},
    common=("system", "tools"),
    read=read,
    looks_like="a list of turns under any key: ``--messages-field PATH`` (``--role-key``, ``--content-key``, "
               "``--roles``; ``--field`` turns after it)",
    follows=_paths,
)
