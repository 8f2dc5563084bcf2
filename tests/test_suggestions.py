"""Every fix a refusal or ``preview`` prints reads the record it was printed for, whole.

A refusal's detail names options (``--field question=user ...``, ``--content-key answer``,
``--preference chosen``) only after they were tried on the record: with them it packs, and no
field below the top level that holds text is left unread (top-level keys left over are named in
the detail as counted). Values the user must choose stay placeholders (``--content-key KEY``,
``--roles customer=ROLE``). Checked here with an independent reading of the detail, on the
fixture records, the refusals of test_formats.py, records of public shapes, and generated records.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline._formats import Rejected, conversations
from pipeline._options import FormatOptions, PackOptions
from pipeline._preview import preview
from packers import PackstreamError
from tests.test_formats import REFUSALS, SHAPES, load
from tests.test_fuzz_formats import SKELETONS

PAIRS = {"--field": "fields", "--roles": "roles", "--transcript-marker": "transcript_markers"}


def printed_fix(detail: str, given: dict) -> dict:
    """The options a detail asks for (concrete values only), added to ``given``; {} when it asks for none."""
    fix: dict = {}
    g = FormatOptions(**given)
    for flag, raw in re.findall(r"(?<![\w-])(--[a-z-]+) ('[^']*'|[^\s;,()]+(?:,[^\s;,()]+)*)", detail):
        value = raw.strip("'")
        if re.search(r"\b[A-Z]{2,}", value):  # KEY, ROLE, PATH: for the user to fill in
            continue
        key = PAIRS.get(flag, flag[2:].replace("-", "_"))
        if key in PAIRS.values():
            pairs = tuple(tuple(p.split("=", 1)) for p in value.split(",") if "=" in p)  # else not a NAME=VALUE
            have = tuple(getattr(g, key))
            if pairs and not set(pairs) <= set(have):
                fix[key] = tuple(fix.get(key, have)) + tuple(p for p in pairs if p not in have)
        elif str(getattr(getattr(g, key, None), "value", getattr(g, key, None))) != value:
            fix[key] = value
    if "instead of --field" in detail and "messages_field" in fix:
        fix["fields"] = ()
    return fix


def _holds_text(v: Any) -> bool:
    if isinstance(v, str):
        return bool(v.strip())
    if isinstance(v, dict):
        return any(map(_holds_text, v.values()))
    if isinstance(v, list):
        return any(map(_holds_text, v))
    return False


def _values(record: dict, path: str) -> list:
    """Every value an ignored-field path names (``a[].b``: each item's b; ``c[1:]``: the items from 1)."""
    vals = [record]
    for lo, colon, hi, key in re.findall(r"\[(-?\d*)(:?)(-?\d*)\]|([^.\[\]]+)", path):
        nxt: list = []
        for v in vals:
            if key and isinstance(v, dict) and key in v:
                nxt.append(v[key])
            elif not key and isinstance(v, list):
                if not lo and not colon:
                    nxt += v
                elif colon:
                    nxt += v[int(lo or 0): int(hi) if hi else None]
                elif -len(v) <= int(lo) < len(v):
                    nxt.append(v[int(lo)])
        vals = nxt
    return vals


def check_refusal(record: dict, given: dict) -> int:
    """Refused under ``given``? Then the fix it prints reads the record whole. Returns the number of fixes checked."""
    try:
        conversations(record, FormatOptions(**given))
        return 0
    except (Rejected, PackstreamError) as e:
        detail = getattr(e, "detail", str(e))
    fix = printed_fix(detail, given)
    if not fix:
        return 0
    try:
        options = FormatOptions(**{**FormatOptions(**given).__dict__, **fix})
    except PackstreamError as e:
        raise AssertionError(f"the printed fix {fix} is not even valid options ({e}): {detail}")
    try:
        convs = conversations(record, options)
    except Rejected as e:
        raise AssertionError(f"the printed fix {fix} does not pack the record ({e}): {detail}") from None
    for c in convs:
        for note in c.notes:
            path = note.split(":", 1)[1] if note.startswith("ignored_field:") else None
            if path is not None and re.search(r"[.\[]", path):
                assert not any(map(_holds_text, _values(record, path))), \
                    f"the printed fix {fix} leaves {path} unread: {detail}"
            elif path is not None:
                assert path in detail, f"the printed fix leaves {path} unread and the detail does not say so: {detail}"
    return 1


PUBLIC = [  # refused records shaped like public sets, as a new user would first try them
    {"id": "q1", "question": "What is 7*8?", "answer": "56", "source": "gsm8k"},
    {"query": "Weather in Oslo?", "response": "Cold.", "meta": {"lang": "en"}},
    {"problem": "Solve x+1=2.", "solution": "x=1", "level": "Level 1", "type": "Algebra"},
    {"question_id": 81, "category": "writing", "turns": ["q1", "q2"], "choices": [{"index": 0, "turns": ["a1", "a2"]}]},
    {"data": ["Hi", "Hello!", "Bye", "Bye!"], "id": "0"},
    {"system_prompt": "Be brief.", "question": "2+2?", "response": "4", "id": "niv.1"},
    {"session": [{"speaker": "user", "utterance": "hi"}, {"speaker": "bot", "utterance": "hello"}]},
    {"dialog": [{"who": "A", "said": "hi"}, {"who": "B", "said": "hello"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": {"answer": "4", "why": "2+2"}}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": {"answer": "4", "score": 0.9}}]},
    {"input": {"messages": [{"role": "user", "content": "q"}]}, "preferred_output": [{"role": "assistant", "content": "a"}],
     "non_preferred_output": [{"role": "assistant", "content": "b"}]},
    {"prompt": {"text": "Q", "role": "prompter", "replies": [{"text": "A", "role": "assistant", "replies": []}]}},
    {"instruction": "Add.", "input": "2, 3", "context": "numbers", "output": "5"},
    {"conversation": "Q: hi\nA: hello"},
]


def _cases():
    for key, (name, opts, expected) in SHAPES.items():
        for pos, rec in load(name):
            yield f"{key}@{pos}", rec, opts
            yield f"{key}@{pos}/no-options", rec, {}
    for i, (rec, given, _, _) in enumerate(REFUSALS):
        yield f"refusal{i}", rec, given
    for i, rec in enumerate(PUBLIC):
        yield f"public{i}", rec, {}


CASES = list(_cases())


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: CASES[i][0])
def test_a_printed_fix_reads_the_record_whole(case):
    _, rec, given = CASES[case]
    check_refusal(json.loads(json.dumps(rec)), given)


def test_the_checks_above_do_check_fixes():
    assert sum(check_refusal(json.loads(json.dumps(rec)), given) for _, rec, given in CASES) >= 15


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), shape=st.sampled_from(sorted(SKELETONS)), drop=st.booleans())
def test_generated_refusals_print_only_fixes_that_work(data, shape, drop):
    strategy, opts = SKELETONS[shape]
    rec = data.draw(strategy)
    try:
        check_refusal(rec, {} if drop else opts)
    except (TypeError, ValueError):  # records JSON cannot hold (NaN keys and the like) are not the point here
        pass


def test_preview_prints_the_same_checked_fixes(tmp_path):
    path = tmp_path / "refused.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in PUBLIC))
    items = preview(PackOptions(inputs=(str(path),)), n=len(PUBLIC))
    refused = [it for it in items if "reason" in it]
    assert refused
    for it in refused:
        rec = PUBLIC[it["position"] - 1]
        fix = printed_fix(it["detail"], {})
        if fix:
            assert conversations(rec, FormatOptions(**fix)), it["detail"]
