"""Prompt/completion: ``{"prompt", "completion"}`` as strings, or as lists of messages (TRL's conversational form).

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> read({"prompt": "The sky is", "completion": " blue."}, Ctx(FormatOptions()))[0].raw
('The sky is', ' blue.')
>>> d = read({"prompt": [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
...                      {"role": "user", "content": "Another?"}], "completion": [{"role": "assistant", "content": "Red."}]},
...          Ctx(FormatOptions()))[0]
>>> [(t.role, t.content) for t in d.turns], d.prompt
([('user', 'Name a color.'), ('assistant', 'Blue.'), ('user', 'Another?'), ('assistant', 'Red.')], 3)
"""

from __future__ import annotations

from pipeline._formats._base import Ctx, Draft, Shape, Turn, all_of, has
from pipeline._formats._turns import ROLE_KEYS, _content, _speaker_words, _turn_list
from pipeline._options import Format, Strings


def read(record: dict, ctx: Ctx) -> list[Draft]:
    """TRL's prompt-completion format (and its unpaired-preference form, with a KTO ``label``): the prompt is context
    whatever roles it holds, the completion is trained whole. Two strings under ``--strings raw`` stay raw text
    (:attr:`Draft.raw`); lists of messages (or ``--strings chat``) become turns split at the prompt's end
    (:attr:`Draft.prompt`)."""
    if raw_strings(record, ctx, ("prompt", "completion")):
        ctx.mapping.append("prompt (context) + completion: raw text, as TRL (--strings raw)")
        return [Draft(raw=(record["prompt"], record["completion"]))]
    parts: list[list[Turn]] = []
    for key, role in (("prompt", "user"), ("completion", "assistant")):
        v = record[key]
        if isinstance(v, list) and all(isinstance(m, dict) and any(k in m for k in ROLE_KEYS) for m in v):
            parts.append(_turn_list(v, key, ctx))
            ctx.mapping.append(f"{key}[]: " + _speaker_words(ctx))
        else:
            parts.append([Turn(role, _content(v, key, ctx, role).text, key)])
            ctx.mapping.append(f"{key} -> {role}")
    ctx.mapping.append(f"the prompt's {len(parts[0])} turn(s) are context, the completion's {len(parts[1])} trained")
    return [Draft(turns=parts[0] + parts[1], prompt=len(parts[0]))]


def raw_strings(record: dict, ctx: Ctx, keys: tuple[str, ...]) -> bool:
    """Whether ``record[keys]`` are TRL's standard (string) format, kept raw: every one a string, ``--strings raw``,
    no image run (``--processor``: images need the template's turns), and no ``system`` or ``tools`` column, which
    only a chat template can render (such records take the template, so that nothing they hold is dropped)."""
    return (ctx.o.strings is Strings.RAW and ctx.image_text is None and all(isinstance(record[k], str) for k in keys)
            and all(record.get(k) in (None, "", []) for k in ("system", "tools")))


SHAPE = Shape(
    name="prompt-completion",
    claims=all_of(has("prompt"), has("completion")),
    reads=("prompt", "completion"),
    common=("system", "tools"),
    read=read,
    looks_like="``prompt`` + ``completion`` (strings, or lists of messages as in TRL)",
    keys="prompt/completion",
    format=Format.PROMPT_COMPLETION,
)
