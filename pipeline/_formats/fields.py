"""``--field PATH=ROLE``: any shape, mapped field by field (and transcripts: one string of marked turns).

Repeated in turn order. ROLE is ``system``, ``user``, ``assistant``, ``tool``, ``transcript``
("Human: ... Assistant: ..." in one string) or ``text`` (the whole record as plain text). Strings
keep their place; lists of equal length interleave turn by turn; a field mapped to ``system`` goes first
(role order, issue 35). Hygiene never cuts a turn a field names: it refuses the record
(``mapped_field_cut``). What a path leaves beside it (``choices[0].index``, ``choices[1:]``) is counted
as ignored.

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> ctx = Ctx(FormatOptions(fields=(("sys", "system"), ("qs", "user"), ("as", "assistant"))))
>>> [(t.role, t.content) for t in read({"sys": "S", "qs": ["q1", "q2"], "as": ["a1", "a2"]}, ctx)[0].turns]
[('system', 'S'), ('user', 'q1'), ('assistant', 'a1'), ('user', 'q2'), ('assistant', 'a2')]
>>> [(t.role, t.content) for t in _transcript("Intro.\\n\\nHuman: hi\\n\\nAssistant: hello", "t", ctx)]
[('system', 'Intro.'), ('user', 'hi'), ('assistant', 'hello')]
"""

from __future__ import annotations

import functools
import re
from typing import Any

from pipeline._formats._base import MISSING, Claim, Ctx, Draft, Reason, Rejected, Shape, Turn
from pipeline._formats._fix import MARKER, ROLE, Fix
from pipeline._formats._paths import resolve, top_key
from pipeline._formats._turns import ROLE_KEYS, _content, _looks_like_calls, _tool_calls, _turn
from pipeline._options import ROLES, FormatOptions

_BUILTIN_MARKERS: tuple[tuple[str, str], ...] = (
    ("### Human:", "user"), ("### Assistant:", "assistant"), ("### System:", "system"), ("### User:", "user"),
    ("### Human", "user"), ("### Assistant", "assistant"),
    ("Human:", "user"), ("Assistant:", "assistant"), ("User:", "user"), ("System:", "system"),
    ("USER:", "user"), ("ASSISTANT:", "assistant"), ("SYSTEM:", "system"), ("FUNCTION RESPONSE:", "tool"),
)
"""Transcript speaker markers (``--transcript-marker`` adds more): word markers match at the start of a
line (or after whitespace, when that finds no assistant turn otherwise), ``###`` markers anywhere."""


# ------------------------------------------------------------------------------------------------
# Transcripts: one string of "Human: ... Assistant: ..." turns.


def _markers(ctx: Ctx) -> dict[str, str]:
    markers = dict(_BUILTIN_MARKERS)
    markers.update({m.strip(): r for m, r in ctx.o.transcript_markers})
    return markers


@functools.lru_cache(maxsize=32)
def _marker_re(markers: tuple[tuple[str, str], ...], loose: bool) -> re.Pattern:
    """Markers led by a symbol (``### Human:``, ``<|user|>``) match anywhere; word markers (``Human:``)
    at the start of a line, or (``loose``) after any non-word character, for one-line transcripts."""
    names = sorted((m for m, _ in markers), key=len, reverse=True)
    symbol = "|".join(re.escape(m) for m in names if not m[0].isalnum())
    word = "|".join(re.escape(m) for m in names if m[0].isalnum())
    start = r"(?<![A-Za-z0-9_])" if loose else r"(?:\A|(?<=\n))[ \t]*"
    alts = [f"(?:{start})(?P<w>{word})"] if word else []
    alts += [f"(?P<s>{symbol})"] if symbol else []
    return re.compile("|".join(alts))


def marked_roles(text: str) -> set[str]:
    """The roles of the built-in speaker markers the transcript reader finds in ``text`` (word markers at line
    starts, ``###`` markers anywhere): what ``--field X=transcript`` would read it as.

    >>> sorted(marked_roles("Human: hi\\n\\nAssistant: hello")), marked_roles("Assistant: alone")
    (['assistant', 'user'], {'assistant'})
    """
    markers = dict(_BUILTIN_MARKERS)
    return {markers[m.group(m.lastgroup)] for m in _marker_re(_BUILTIN_KEY, False).finditer(text)}


_BUILTIN_KEY = tuple(sorted(_BUILTIN_MARKERS))


def _transcript(value: Any, at: str, ctx: Ctx) -> list[Turn]:
    text = _content(value, at, ctx, "user").text
    markers = _markers(ctx)
    key = tuple(sorted(markers.items()))
    found = list(_marker_re(key, False).finditer(text))
    if not any(markers[m.group(m.lastgroup)] == "assistant" for m in found):
        loose = list(_marker_re(key, True).finditer(text))  # "USER: hi ASSISTANT: hello" on one line
        if any(markers[m.group(m.lastgroup)] == "assistant" for m in loose):
            found = loose
    if not found:
        said = f"{at} holds no speaker markers (looked for Human:, Assistant:, User:, System:, ### Human, ### Assistant"
        if ctx.o.transcript_markers:
            raise Rejected(Reason.BAD_TYPE, f"{said} (yours from --transcript-marker included))")
        raise Rejected(Reason.BAD_TYPE, f"{said}); add yours with ", Fix.of(transcript_markers=((MARKER, ROLE),)),
                       ", once per marker (Q:=user)")
    turns = []
    lead = text[: found[0].start()].strip()
    if lead:
        turns.append(Turn("system", lead, f"{at} (text before the first marker)"))
    for k, m in enumerate(found):
        end = found[k + 1].start() if k + 1 < len(found) else len(text)
        marker = m.group(m.lastgroup)
        role = markers[marker]
        turns.append(Turn(role, text[m.end():end].strip(), f"{at} turn {k + 1}", marker))
    return turns


def _read_fields(record: dict, ctx: Ctx) -> "list[Turn] | str":
    """``--field PATH=ROLE`` mappings; lists of equal length interleave, strings keep their place, except that
    a field mapped to ``system`` goes first (role order: hygiene trims a trailing system turn, and a system
    prompt after the turns means nothing)."""
    if ctx.o.fields[0][1] == "text":
        return _text_field(record, ctx)
    head, rest = _mapped_turns(record, ctx)
    return head + rest


def _text_field(record: dict, ctx: Ctx) -> str:
    path = ctx.o.fields[0][0]
    ctx.mapping.append(f"{path} -> text (every token trained)")
    return _content(resolve(record, path), path, ctx, "text").text


def _mapped_turns(record: dict, ctx: Ctx) -> tuple[list[Turn], list[Turn]]:
    """The turns of the ``--field`` mappings (no ``text`` role), as (the system fields, the others): each
    turn a field names carries it in ``Turn.mapped``, so hygiene refuses rather than cut it. Transcript turns
    are a turn list of their own, trimmed like one."""
    head: list[Turn] = []
    before: list[Turn] = []
    after: list[Turn] = []
    columns: list[tuple[str, str, list]] = []
    for path, role in ctx.o.fields:
        value = resolve(record, path)
        named = f"--field {path}={role}"
        if role == "transcript":
            (after if columns else before).extend(_transcript(value, path, ctx))
            ctx.mapping.append(f"{path} -> transcript turns")
        elif role == "tool_calls" or (role == "assistant" and _looks_like_calls(value)):
            # {name, arguments} objects (or their JSON text, with =tool_calls): one assistant turn of tool calls,
            # rendered as the template's calls with the arguments as the record holds them (xLAM/APIGen answers)
            calls = _tool_calls(value, path, ctx)
            (after if columns else before).append(Turn("assistant", "", path, tool_calls=calls or None, mapped=named))
            ctx.mapping.append(f"{path} -> assistant tool calls ({len(calls)})")
        elif isinstance(value, dict) and role in ROLES and any(k in value for k in (*ROLE_KEYS, ctx.o.role_key) if k):
            # one turn object under the field (LLaMA-Factory's chosen: {from, value}): read as a turn of the mapped role
            t = _turn(value, path, ctx, where=path, one=True)
            if t.role != role:
                raise Rejected(Reason.BAD_TYPE, f"field {path!r} is a turn object of role {t.role} ({t.speaker!r}), "
                                                f"mapped as {role}; map it with ", Fix.of(fields=((path, t.role),)))
            t.mapped = named
            (head if role == "system" else after if columns else before).append(t)
            ctx.mapping.append(f"{path} -> {role} (a turn object)")
        elif isinstance(value, list) and not (value and all(isinstance(p, dict) and "type" in p for p in value)):
            if value and all(isinstance(v, dict) and any(k in v for k in ROLE_KEYS) for v in value):
                raise Rejected(Reason.BAD_TYPE, f"field {path!r} holds a list of turn objects, not {role} texts; "
                                                "read it with ", Fix.of(messages_field=path, drop=("fields",)))
            columns.append((path, role, value))
            ctx.mapping.append(f"{path}[] -> {role}")
        else:
            t = Turn(role, _content(value, path, ctx, role).text, path, mapped=named)
            (head if role == "system" else after if columns else before).append(t)
            ctx.mapping.append(f"{path} -> {role}")
    turns = before
    if columns:
        lengths = {p: len(v) for p, _, v in columns}
        if len(set(lengths.values())) > 1:
            raise Rejected(Reason.BAD_TYPE, "mapped lists must have equal lengths to interleave into turns: "
                                            + ", ".join(f"{p} has {n}" for p, n in lengths.items()))
        _scored_alternatives(record, columns, before + after)
        columns.sort(key=lambda c: c[1] != "system")  # role order in each step too: a system text opens it
        for k in range(len(columns[0][2])):
            for path, role, value in columns:
                turns.append(Turn(role, _content(value[k], f"{path}[{k}]", ctx, role).text, f"{path}[{k}]",
                                  mapped=f"--field {path}={role}"))
    return head, _attach_reasoning(turns + after)


def _attach_reasoning(turns: list[Turn]) -> list[Turn]:
    """``--field X=reasoning`` turns become the reasoning of the assistant turn they lead to (the next one before
    any user turn, else the one just before it), rendered and masked (``--mask-reasoning``) as parsed reasoning."""
    out = [t for t in turns if t.role != "reasoning"]
    for i, t in enumerate(turns):
        if t.role != "reasoning":
            continue
        after = next((u for u in turns[i + 1:] if u.role != "reasoning"), None)
        before = next((u for u in reversed(turns[:i]) if u.role != "reasoning"), None)
        target = after if after is not None and after.role == "assistant" else before
        if target is None or target.role != "assistant":
            raise Rejected(Reason.MISSING_FIELD, f"{t.at} is mapped as reasoning (--field {t.at.split('[')[0]}="
                                                 "reasoning), and no assistant turn follows it or comes just before "
                                                 "it; map the answer with --field ANSWER=assistant after it")
        if target.reasoning:
            raise Rejected(Reason.AMBIGUOUS_FIELD, f"{t.at} and {target.at} both give the reasoning of the assistant "
                                                   f"turn {target.at}; map one of them")
        target.reasoning = t.content
    return out


def _scored_alternatives(record: dict, columns: list[tuple[str, str, list]], strings: list[Turn]) -> None:
    """A list mapped to assistant beside a parallel list of numbers (Magpie-PO: ``responses`` and ``rewards``) and
    no user list: its items are scored alternatives to one prompt, which interleaving would merge into one
    trained reply. Refused, naming the pair reader."""
    if any(role == "user" for _, role, _ in columns) or not any(t.role == "user" for t in strings):
        return
    for path, role, value in columns:
        if role != "assistant" or len(value) < 2:
            continue
        scores = next((k for k, v in record.items() if isinstance(v, list) and len(v) == len(value) and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)), None)
        if scores is not None:
            raise Rejected(Reason.AMBIGUOUS_FIELD, f"--field {path}=assistant maps {len(value)} answers scored by "
                                                   f"{scores} to one prompt: they are alternatives, and one trained "
                                                   "reply would merge them all; pack the best against the worst with ",
                           Fix.of(pairs=True, pair_ranked=f"{path}/{scores}", drop=("fields",), drops=(path,)),
                           f", or train one of them with --field '{path}[N]=assistant' in its place (N: the item)")



def read(record: dict, ctx: Ctx) -> list[Draft]:
    got = _read_fields(record, ctx)
    return [Draft(text=got) if isinstance(got, str) else Draft(turns=got)]


def _missing(record: dict, o: FormatOptions) -> list[str]:
    return [p for p, _ in o.fields if resolve(record, p) is MISSING]


SHAPE = Shape(
    name="fields",
    claims=Claim(mapped=_missing, applies=lambda o: bool(o.fields) and o.messages_field is None,
                 given=lambda o, missing: " ".join(f"--field {p}={r}" for p, r in o.fields if p in missing)),
    reads=lambda record, o: {top_key(record, p) for p, _ in o.fields},
    common=("tools",),
    read=read,
    looks_like="any other shape, field by field: ``--field PATH=ROLE`` (and ``transcript`` strings)",
    follows=lambda o: [p for p, _ in o.fields],
)
