"""Alpaca: ``{"instruction", "input", "output"}`` (``response`` for ``output``, ``context`` for ``input``),
with LLaMA-Factory's ``"history": [["q1", "a1"], ...]`` and self-instruct's ``"instances": [{"input", "output"}]``.

The alternative keys of one slot (``input``/``context``, ``output``/``response``/``instances``):
the one that holds text is read; the same text under both is read once; different text under
both refuses the record as ``ambiguous_field``, naming the ``--field`` mapping that reads both.

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> rec = {"instruction": "Add.", "input": "2, 3", "output": "5", "history": [["Hi", "Hello"]]}
>>> [(t.role, t.content) for t in read(rec, Ctx(FormatOptions()))[0].turns]
[('user', 'Hi'), ('assistant', 'Hello'), ('user', 'Add.\\n\\n2, 3'), ('assistant', '5')]
"""

from __future__ import annotations

from typing import Optional

from pipeline._formats._base import (Conversation, Ctx, Draft, Reason, Rejected, Shape, Turn, _blank, _keys, _kind,
                                     _one_slot, _short, all_of, has, has_any)
from pipeline._formats._fix import Fix
from pipeline._formats._turns import _content, _unused_turn_keys
from pipeline._options import Format

_ALPACA_INPUTS = ("input", "context")
_ALPACA_ANSWERS = ("output", "response", "instances")


def _alpaca_key(record: dict, keys: tuple[str, ...]) -> Optional[str]:
    """The key an Alpaca slot is read from: the first of ``keys`` that holds something (else the first
    present). Two that hold different things make the record ambiguous: neither is dropped unseen."""
    found, other = _one_slot(record, keys)
    if other is not None:
        raise _ambiguity(record, found, other)
    return found


def _ambiguity(record: dict, a: str, b: str) -> Rejected:
    """Two keys of one slot hold different things: the ``--field`` mapping that reads both (or picks one)."""
    said = f"{a} and {b} both hold something ({_short(record[a])} vs {_short(record[b])}), and alpaca reads one"
    head = (("system", "system"),) if isinstance(record.get("system"), str) and record["system"].strip() else ()
    head += (("instruction", "user"),)
    inputs = tuple((k, "user") for k in _ALPACA_INPUTS if k in record and not _blank(record[k]))
    lost = " (history is then not read)" if not _blank(record.get("history")) else ""
    if a in _ALPACA_INPUTS:  # input and context: both are the user's
        answer = next((k for k in ("output", "response") if k in record and not _blank(record[k])), None)
        if answer is None:
            return Rejected(Reason.AMBIGUOUS_FIELD, f"{said} input; keep one of them in the data")
        return Rejected(Reason.AMBIGUOUS_FIELD, f"{said} input; read both with ",
                        Fix.of(fields=head + inputs + ((answer, "assistant"),)), f"{lost}, or keep one in the data")
    fields = head + inputs[:1] + ((a, "assistant"),)
    if b == "instances":  # an answer beside self-instruct instances
        return Rejected(Reason.AMBIGUOUS_FIELD, f"{said} answer; read {a} with ", Fix.of(fields=fields),
                        f" (instances is then counted as an ignored field){lost}, or drop {a} from the data to read "
                        "the instances")
    return Rejected(Reason.AMBIGUOUS_FIELD, f"{said} answer; pick it with ",
                    Fix.of(fields=fields, alternative=((b, "assistant"),)),
                    f", the other is then counted as an ignored field{lost}")


def history_turns(record: dict, ctx: Ctx) -> list[Turn]:
    """LLaMA-Factory's ``history``: ``[[user, assistant], ...]`` exchanges before the instruction."""
    turns: list[Turn] = []
    history = record.get("history")
    if history not in (None, "", []):
        if not isinstance(history, list):
            raise Rejected(Reason.BAD_TYPE, f"history is {_kind(history)}, expected a list of [user, assistant] pairs")
        for i, pair in enumerate(history):
            if not (isinstance(pair, list) and len(pair) == 2):
                raise Rejected(Reason.BAD_TYPE, f"history[{i}] is {_kind(pair)} {_short(pair)}, expected a "
                                                "[user, assistant] pair")
            turns.append(Turn("user", _content(pair[0], f"history[{i}][0]", ctx, "user").text, f"history[{i}][0]"))
            turns.append(Turn("assistant", _content(pair[1], f"history[{i}][1]", ctx, "assistant").text,
                               f"history[{i}][1]"))
        ctx.mapping.append(f"history -> {len(history)} earlier exchanges")
    return turns


def read(record: dict, ctx: Ctx) -> list[Draft]:
    turns: list[Turn] = []
    instruction = _content(record["instruction"], "instruction", ctx, "user").text
    in_key = _alpaca_key(record, _ALPACA_INPUTS)
    inp = _content(record[in_key], in_key, ctx, "user", allow_null=True).text if in_key else ""
    out_key = _alpaca_key(record, _ALPACA_ANSWERS)
    if out_key is None:
        raise Rejected(Reason.MISSING_FIELD, f"field 'output' (or response, instances) is missing; the record has keys "
                                             f"[{_keys(record)}]")
    turns += history_turns(record, ctx)
    if out_key == "instances":  # self-instruct seed tasks: each instance is one more exchange
        instances = record["instances"]
        if not isinstance(instances, list) or not instances:
            raise Rejected(Reason.BAD_TYPE, f"instances is {_kind(instances)}, expected a non-empty list of "
                                            "{input, output}")
        for i, inst in enumerate(instances):
            where = f"instances[{i}]"
            if not isinstance(inst, dict):
                raise Rejected(Reason.BAD_TYPE, f"{where} is {_kind(inst)}, expected an object {{input, output}}")
            if "output" not in inst:
                raise Rejected(Reason.MISSING_FIELD, f"{where} has no 'output'; its keys: [{_keys(inst)}]")
            _unused_turn_keys(inst, {"input", "output"}, where, "instances", ctx)
            x = _content(inst.get("input"), f"{where}.input", ctx, "user", allow_null=True).text
            prompt = (instruction + ("\n\n" + x if x else "")) if i == 0 else (x or instruction)
            turns.append(Turn("user", prompt, f"{where}.input"))
            turns.append(Turn("assistant", _content(inst["output"], f"{where}.output", ctx, "assistant").text,
                               f"{where}.output"))
        ctx.mapping.insert(0, f"instruction+instances[].input -> user, instances[].output -> assistant "
                              f"({len(instances)} exchanges)")
    else:
        user = "\n\n".join(s for s in (instruction, inp) if s) if inp.strip() else instruction
        turns.append(Turn("user", user, "instruction"))
        turns.append(Turn("assistant", _content(record[out_key], out_key, ctx, "assistant").text, out_key))
        ctx.mapping.insert(0, f"instruction{'+' + in_key if in_key else ''} -> user, {out_key} -> assistant")
    return [Draft(turns=turns)]


# The clean Alpaca record, built directly (see messages.fast); tests/test_fast_path.py holds it equal.
_FAST_KEYS = frozenset({"id", "instruction", "input", "output"})
_MAPPING = {True: ("instruction+input -> user, output -> assistant",),
            False: ("instruction -> user, output -> assistant",)}


def fast(record: dict) -> Optional[Conversation]:
    if "instruction" not in record or "output" not in record or not record.keys() <= _FAST_KEYS:
        return None
    ins, output, inp = record["instruction"], record["output"], record.get("input", "")
    if type(ins) is not str or type(output) is not str or type(inp) is not str or not ins.strip() or not output.strip():
        return None
    if "</think>" in output:  # inline reasoning: the general path reads it
        return None
    user = ins + "\n\n" + inp if inp.strip() else ins
    return Conversation([{"role": "user", "content": user}, {"role": "assistant", "content": output}],
                        shape="alpaca", mapping=_MAPPING[("input" in record)])


SHAPE = Shape(
    name="alpaca",
    claims=all_of(has("instruction"), has_any(*_ALPACA_ANSWERS)),
    reads=("instruction", *_ALPACA_INPUTS, *_ALPACA_ANSWERS, "history"),
    common=("system",),
    read=read,
    looks_like="``instruction`` + ``output``/``response`` (+ ``input``, ``system``, ``history``)",
    keys="instruction/output",
    format=Format.ALPACA,
    fast=fast,
)
