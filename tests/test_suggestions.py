"""Every fix a refusal carries reads the record it was refused for, whole, and its detail names exactly that fix.

A refusal that options would fix carries them as data (:class:`pipeline._formats.Fix`: ``--field
question=user ...``, ``--content-key answer``, ``--preference chosen``), and its detail is rendered from
it. Checked here on the fixture records, the refusals of test_formats.py, records of public shapes and
generated records: applied to the options given, the fix (and the alternative it names) packs the record,
and no field below the top level that holds text is left unread (top-level keys left over are in the fix's
``leaves``, named in the detail); or its values are holes for the user to fill (``--content-key KEY``,
``--roles customer=ROLE``). An independent reading of the detail's text finds exactly the concrete options
of the fix, so no option is named in words that the data does not hold.
"""

from __future__ import annotations

import json
import pickle
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import PackOptions
from packers import PackstreamError
from tests._internals import Fix, FormatOptions, Hole, Reason, Rejected, conversations, pair_conversations, preview
from tests.test_formats import REFUSALS, SHAPES, load
from tests.test_fuzz_formats import SKELETONS

PAIRS = {"--field": "fields", "--roles": "roles", "--transcript-marker": "transcript_markers"}
SWITCHES = {"--pairs": "pairs"}
"""Pack-level switches a fix may name (Fix.pack): tried by the pair reader."""


def printed_fix(detail: str, given: dict) -> dict:
    """The options a text asks for (concrete values only, read here from the words), added to ``given``; {} when
    it asks for none."""
    fix: dict = {}
    g = FormatOptions(**given)
    for m in re.finditer(r"(?<![\w-])(--[a-z-]+)(?: ('[^']*'|[^\s;,()-][^\s;,()]*(?:,[^\s;,()]+)*))?", detail):
        flag, raw = m.group(1), m.group(2)
        if raw is None:  # a switch: a pack-level one is part of a fix when more options follow it (--pairs --pair-...)
            if flag in SWITCHES and detail[m.end():].startswith(" --"):
                fix[SWITCHES[flag]] = True
            continue
        value = raw.strip("'")
        if re.search(r"\b[A-Z]{2,}|\[[A-Z]\]", value):  # KEY, ROLE, PATH, an item [N]: for the user to fill in
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


def _steps(path: str) -> list[tuple[str, str]]:
    """A path's steps: ``("key", k)`` (a key may be empty: ``a.`` is key ``""`` of ``a``) or ``("item", "1:")``."""
    steps, i = [], 0
    while i < len(path):
        if path[i] == "[":
            j = path.index("]", i)
            steps.append(("item", path[i + 1:j]))
            i = j + 1
            continue
        if path[i] == "." and steps:
            i += 1
        j = min([k for k in (path.find(".", i), path.find("[", i)) if k >= 0] or [len(path)])
        steps.append(("key", path[i:j]))
        i = j
    return steps


def _values(record: dict, path: str) -> list:
    """Every value an ignored-field path names (``a[].b``: each item's b; ``c[1:]``: the items from 1)."""
    vals = [record]
    for kind, step in _steps(path):
        nxt: list = []
        for v in vals:
            if kind == "key" and isinstance(v, dict) and step in v:
                nxt.append(v[step])
            elif kind == "item" and isinstance(v, list):
                lo, colon, hi = step.partition(":")
                if not step:
                    nxt += v
                elif colon:
                    nxt += v[int(lo or 0): int(hi) if hi else None]
                elif -len(v) <= int(lo) < len(v):
                    nxt.append(v[int(lo)])
        vals = nxt
    return vals


def _holes(value: Any) -> bool:
    return isinstance(value, Hole) or (isinstance(value, tuple) and any(map(_holes, value)))


def check_refusal(record: dict, given: dict) -> int:
    """Refused under ``given`` with a fix? Then the fix reads the record whole, or shows holes; and the detail names
    exactly its options. Returns the number of fixes tried here (0 or 1)."""
    options = FormatOptions(**given)
    try:
        conversations(record, options)
        return 0
    except Rejected as e:
        r = e
    fix = r.fix
    # The words name exactly the options the data holds (no concrete option in the prose around it).
    assert printed_fix(r.detail, given) == printed_fix(fix.text() if fix else "", given), r.detail
    if fix is None:
        return 0
    assert fix.text() in r.detail and r.detail.endswith(fix.outcome()), r.detail
    copy = pickle.loads(pickle.dumps(r))  # Beam ships refusals between steps
    assert (copy.reason, copy.detail, copy.fix) == (r.reason, r.detail, r.fix)
    if fix.failed or not fix.changes(options):  # nothing to try: the values are the user's to fill in
        assert fix.failed or _holes(fix.options), f"a fix that holds nothing to try and no hole: {r.detail}"
        assert not fix.failed or not fix.changes(options), f"a failed fix shows a value: {r.detail}"
        return 0
    for alternative in (False, True) if fix.alternative is not None else (False,):
        try:
            tried = fix.applied(options, alternative)
        except PackstreamError as e:
            raise AssertionError(f"the fix {fix} is not even valid options ({e}): {r.detail}") from None
        try:
            convs = pair_conversations(record, tried) if fix.pack().get("pairs") else conversations(record, tried)
        except Rejected as e:
            raise AssertionError(f"the fix {fix} does not pack the record ({e}): {r.detail}") from None
        for c in convs:
            for note in c.notes:
                path = note.split(":", 1)[1] if note.startswith("ignored_field:") else None
                if path is not None and any(path == k or path.startswith((k + ".", k + "[")) for k in fix.drops):
                    assert fix.drops[0] in r.detail, f"the fix leaves part of {path} on purpose, unsaid: {r.detail}"
                    continue
                if path is not None and re.search(r"[.\[]", path):
                    assert not any(map(_holds_text, _values(record, path))), \
                        f"the fix {fix} leaves {path} unread: {r.detail}"
                elif path is not None and not alternative:
                    assert path in fix.leaves and path in r.detail, \
                        f"the fix leaves {path} unread and the detail does not say so: {r.detail}"
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
        with pytest.raises(Rejected) as e:
            conversations(rec, FormatOptions())
        assert it["detail"] == e.value.detail  # rendered from the same fix
        if e.value.fix is not None and e.value.fix.changes(FormatOptions()):
            assert conversations(rec, e.value.fix.applied(FormatOptions())), it["detail"]


def test_a_refusal_without_a_fix_and_one_with_a_fix_pickle_whole():
    plain = Rejected(Reason.BAD_TYPE, "x is int, expected a string")
    assert str(plain) == "bad_type: x is int, expected a string" and plain.fix is None
    fixed = Rejected(Reason.UNKNOWN_ROLE, "m[0].from is 'bob'; map it with ", Fix.of(roles=(("bob", Hole("ROLE")),)),
                     " (ROLE: user or assistant)")
    assert fixed.detail == "m[0].from is 'bob'; map it with --roles bob=ROLE (ROLE: user or assistant)"
    tried = fixed.with_fix(fixed.fix.holes(FormatOptions()))  # a value with a hole is left as it is
    assert tried.detail == fixed.detail + " (no single option found that reads this record whole; check the record "\
                                          "with packstream preview)"
    for r in (plain, fixed, tried):
        copy = pickle.loads(pickle.dumps(r))
        assert (type(copy), copy.reason, copy.detail, copy.fix, str(copy)) == (Rejected, r.reason, r.detail, r.fix, str(r))


names = st.text(alphabet="abcAB_[]0. <|>'", min_size=1, max_size=6)
FIXES = st.one_of(
    st.builds(lambda k, alt: Fix.of(content_key=k, alternative=alt), st.one_of(names, st.just(Hole("KEY"))),
              st.one_of(st.none(), names)),
    st.builds(lambda p, pairs: Fix.of(messages_field=p, roles=pairs), names,
              st.lists(st.tuples(names, st.sampled_from(["user", "assistant", Hole("ROLE")])), min_size=1, max_size=3)
              .map(tuple)),
    st.builds(lambda pairs, drop: Fix.of(fields=pairs, drop=drop), st.lists(st.tuples(names, st.sampled_from(
        ["user", "assistant", "system"])), min_size=1, max_size=3).map(tuple), st.sampled_from([(), ("roles",)])),
)


def test_a_fix_keeps_its_own_pair_that_the_user_gave_already():
    """A fix that maps a field to two roles, one of which the user gave: trying it sets both, not only the new one."""
    fix = Fix.of(fields=(("0", "user"), ("0", "assistant")))
    given_ = FormatOptions(fields=(("0", "user"), ("q", "user")))
    assert fix.changes(given_) == {"fields": (("0", "user"), ("0", "assistant"), ("q", "user"))}
    assert not Fix.of(fields=(("0", "user"),)).changes(given_)  # all of it given: nothing to try


@settings(max_examples=300, deadline=None)
@given(fix=FIXES, given_fields=st.lists(st.tuples(names, st.sampled_from(["user", "assistant"])), max_size=2))
def test_a_fix_is_typed_as_it_is_tried_and_its_holes_hold_nothing_to_try(fix, given_fields):
    """The text names each option once per value it sets; what trying sets is the fix's own values (pairs merged
    by name); its holes leave nothing to try and show each option still."""
    try:
        given_ = FormatOptions(fields=tuple(given_fields))
    except PackstreamError:
        return
    text = fix.text()
    for name, value in fix.options:
        flag = "--" + {"fields": "field"}.get(name, name).replace("_", "-")
        assert flag in text
        changed = fix.changes(given_).get(name)
        if changed is not None and name in ("fields", "roles"):
            have = getattr(given_, name)
            assert all(p in changed for p in value) and all(n in dict(changed) for n, _ in have)
            own = {n for n, _ in value}  # the fix's names take its pairs, whole; the user's other names keep theirs
            assert sorted(p for p in changed if p[0] in own) == sorted(dict.fromkeys(value))
            assert [p for p in changed if p[0] not in own] == [p for p in have if p[0] not in own]
        elif changed is not None:
            assert changed == value
    holed = fix.holes(given_)
    assert holed.failed and not holed.changes(given_) and holed.outcome().startswith(" (no single option")
    assert [n for n, _ in holed.options] == [n for n, _ in fix.options]
    assert pickle.loads(pickle.dumps(fix)) == fix


# ------------------------------------------------------------------------------------------------
# Coverage: a suggestion trains what the record means. Records of unknown shape are generated from role-named
# fields in random casings (twins of another case included, either side the longer, beside fields with no twin),
# compound names (generated_solution), parallel lists of answers and scores (numbers, or one-number objects), lists
# of answer objects, side-marked keys (response_a/response_b), repeated ids, turns whose values embed speaker
# markers (MOSS: one key per speaker), nested answers and fields no role is known for. Under CI=1 (tests/conftest.py)
# Hypothesis is derandomized: every run draws the same examples.

ROLE_NAMES = {"user": ["question", "instruction", "prompt", "query", "problem", "original_question"],
              "assistant": ["answer", "response", "output", "solution", "completion", "generated_solution",
                            "expected_answer"],
              "reasoning": ["complex_cot", "reasoning", "rationale"], "other": ["source", "category", "notes_x"]}
ANSWER_LIKE = {n for n in ROLE_NAMES["assistant"]} | {"responses", "completions", "answers", "outputs"}
words = st.text(alphabet="abc defgh.", min_size=1, max_size=120).filter(str.strip)
long_words = st.text(alphabet="abc defgh.", min_size=70, max_size=300).filter(lambda t: len(t.strip()) >= 70)


def _cased(name: str, style: int) -> str:
    return [name, name.capitalize(), name.upper(), name.replace("_", " ").title().replace(" ", "_")][style]


@st.composite
def _huatuo(draw) -> dict:
    """A case twin beside keys of its family with no twin (HuatuoGPT-o1): either side of the twin the longer."""
    rec = {"Question": draw(words), "Complex_CoT": draw(st.one_of(words, long_words)), "Response": draw(words)}
    rec["question"] = draw(st.one_of(words, long_words))
    if draw(st.booleans()):
        rec["answer"] = draw(words)
    return rec


@st.composite
def _speaker_turns(draw) -> dict:
    """Turns whose values embed speaker markers, one key per speaker (MOSS), or in a speaker key's value."""
    n = draw(st.integers(1, 3))
    if draw(st.booleans()):
        chat = {f"turn_{i + 1}": {"Human": f"<|Human|>: {draw(words)}<eoh>\n", "Inner Thoughts": "<|Inner Thoughts|>: "
                                  "None<eot>\n", "MOSS": f"<|MOSS|>: {draw(words)}<eom>\n"} for i in range(n)}
        return {"meta_instruction": draw(words), "chat": chat}
    turns = [{"speaker": f"<|{who}|>: {draw(words)}", "said": draw(words)} for i in range(n) for who in ("Human", "Bot")]
    return {"session": turns}


@st.composite
def unknown_records(draw) -> dict:
    kind = draw(st.integers(0, 9))
    if kind == 8:
        return draw(_huatuo())
    if kind == 9:
        return draw(_speaker_turns())
    rec: dict = {}
    for role in ("user", "assistant", "reasoning", "other"):
        for name in draw(st.lists(st.sampled_from(ROLE_NAMES[role]), max_size=2, unique=True)):
            rec[_cased(name, draw(st.integers(0, 3)))] = draw(st.one_of(words, long_words))
    if draw(st.booleans()) and rec:  # a twin of another case, beside the fields with none
        key = draw(st.sampled_from(sorted(rec)))
        twin = key.lower() if key != key.lower() else key.capitalize()
        if twin != key:
            rec[twin] = draw(st.one_of(words, long_words))
    if draw(st.booleans()):  # an id, repeated across the records of a file by design (Tulu): never a turn
        rec["id"] = draw(st.sampled_from(["q1", "q2", 7]))
    if kind == 1:  # alternatives as a list of strings, maybe with a parallel list of scores
        answers = draw(st.lists(words, min_size=2, max_size=5))
        rec[draw(st.sampled_from(["responses", "answers", "outputs"]))] = answers
        score = draw(st.sampled_from([None, "number", "object"]))
        if score is not None:  # numbers, or one-number objects (Magpie's rewards_armorm: [{"score": x}])
            nums = draw(st.lists(st.floats(-5, 5), min_size=len(answers), max_size=len(answers)))
            rec["rewards"] = nums if score == "number" else [{"score": x} for x in nums]
    elif kind == 2:  # alternatives as objects, maybe scored
        n = draw(st.integers(2, 4))
        scored = draw(st.booleans())
        rec["completions"] = [{"model": f"m{i}", "completion": draw(words), **({"score": i} if scored else {})}
                              for i in range(n)]
    elif kind == 3:  # a nested answer
        rec["meta"] = {"answer": draw(words)}
    elif kind == 4:  # a field of a name no role is known for
        rec[draw(st.sampled_from(["zz_body", "Passage", "blob"]))] = draw(words)
    elif kind == 5:  # two answers under side-marked keys
        mark = draw(st.sampled_from([("_a", "_b"), ("_A", "_B"), ("_0", "_1"), ("_j", "_k")]))
        for m in mark:
            rec["response" + m] = draw(st.one_of(words, long_words))
    return rec


def _mapped(fix) -> dict:
    return dict(fix.options)


_COPY = re.compile(r"(?:\(|; )([^;()]+?): the same fields? as ([^;()]+?) in (?:lower-case|capitalised) keys, left")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rec=unknown_records())
def test_a_suggestion_trains_what_the_record_means(rec):
    """A suggestion never silently drops the longest text field (it is read, or named in the detail), never
    merges a list of alternatives into one turn, never takes the user turn from an answer-like field, never names
    a key with no twin a copy (its twin is read), never takes a role name from a message's text; and every
    printed fix packs the record (check_refusal)."""
    try:
        conversations(rec, FormatOptions())
        return  # a known shape
    except Rejected as e:
        r = e
    check_refusal(rec, {})
    fix = r.fix
    for m in _COPY.finditer(r.detail):  # "question: the same field as Question in lower-case keys, left"
        for key in m.group(1).split(", "):
            twins = [k for k in rec if k != key and k.lower() == key.lower()]
            assert twins, f"{key} called a copy, with no twin: {r.detail}"
            rest = _COPY.sub("", r.detail.split(" match no format ", 1)[-1])  # read, or named for itself
            said = [t for t in twins if re.search(rf"(?<![\w.]){re.escape(t)}(?![\w])", rest)]
            assert said, f"{key}'s twin neither read nor named: {r.detail}"
    if fix is None or fix.failed:
        return
    opts = _mapped(fix)
    for name, _ in opts.get("roles", ()):
        assert not _holes(name) and "\n" not in name and not re.search(r": \S", name) and len(name.split()) <= 2, \
            f"a role named after a message's text: {r.detail}"
    fields = tuple(p for p in opts.get("fields", ()) if not _holes(p))
    read = {p.split("[")[0].split(".")[0] for p, _ in fields} | {opts.get("messages_field"), opts.get("tree")}
    read |= {p.split("[")[0].split("/")[0].split("=")[0] for p in [opts.get("pair_ranked") or ""]}
    read |= set((opts.get("pair_sides") or "").split(",")) | {opts.get("pair_prompt")}
    assert "id" not in read, f"an id read as a turn: {r.detail}"
    texts = {k: len(v.strip()) for k, v in rec.items() if isinstance(v, str)}
    if texts:
        longest = max(texts, key=texts.get)
        assert longest in read or longest in r.detail, f"{longest} dropped unseen: {r.detail}"
    for path, role in fields:
        key = path.split("[")[0].split(".")[0]
        if role == "user":
            assert key.lower().replace(" ", "_") not in ANSWER_LIKE, f"user turn from an answer field: {r.detail}"
        if role == "assistant" and isinstance(rec.get(path), list) and not any(
                isinstance(rec.get(p), list) and r2 == "user" for p, r2 in fields):
            raise AssertionError(f"a list of alternatives merged into one turn: {r.detail}")
    assert sum(role == "assistant" for _, role in fields) <= 1 or any(isinstance(rec.get(p), list) for p, _ in fields)


def test_the_coverage_checks_can_fail():
    """The copy check above fails on the old rule's words (HuatuoGPT-o1: Complex_CoT has no twin)."""
    detail = "read it with --field question=user (Complex_CoT, Question, Response: the same fields as x in capitalised keys, left)"
    found = [k for m in _COPY.finditer(detail) for k in m.group(1).split(", ")]
    rec = {"question": "q", "Question": "Q", "Complex_CoT": "c", "Response": "r"}
    assert [k for k in found if not any(t != k and t.lower() == k.lower() for t in rec)] == ["Complex_CoT", "Response"]
