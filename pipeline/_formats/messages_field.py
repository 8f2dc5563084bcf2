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


def read(record: dict, ctx: Ctx) -> list[Draft]:
    path = ctx.o.messages_field
    turns = _turn_list(resolve(record, path), path, ctx, strings_alternate=True)
    ctx.mapping.insert(0, f"{path}[]: " + (_speaker_words(ctx) or "turns"))
    return [Draft(turns=turns)]


SHAPE = Shape(
    name="messages_field",
    claims=Claim(mapped=lambda record, o: [o.messages_field] if resolve(record, o.messages_field) is MISSING else [],
                 applies=lambda o: o.messages_field is not None,
                 given=lambda o, missing: f"--messages-field {missing[0]}"),
    reads=lambda record, o: {top_key(record, o.messages_field)},
    common=("system", "tools"),
    read=read,
    looks_like="a list of turns under any key: ``--messages-field PATH`` (``--role-key``, ``--content-key``, "
               "``--roles``)",
    follows=lambda o: [o.messages_field],
)
