"""Suggestions for a record of no known shape: candidate readings ranked by the text they train correctly.

:func:`suggest` looks at a record's keys and values and answers with a :class:`Fix` (the options, as data; the
driver tries it on the record before it is shown) and the words after it, or with no fix and words that say
what is ambiguous. A reading is offered only when

* every field that holds long text is read, or the words say which it leaves and why (the same field under a
  key of another case, in the family of keys that holds less of the record's text: HuatuoGPT's ``question`` beside
  ``Question``, ``Complex_CoT`` and ``Response``; a key with no twin is never left so);
* no two alternative answers are merged into one trained turn: a list of answers to one prompt (Magpie-PO's
  ``responses`` with their ``rewards``; completions from several models) is packed as a pair when scores say
  which is best (``--pairs --pair-ranked``), else one item is trained and the words say so;
* the user turn is never taken from an answer field.

Tried in order, first found wins: two sides of a pair under other keys (``--pairs --pair-sides``); a list of
turns (or a ``turn_1``, ``turn_2``... dict) under any key; alternatives; a transcript string; fields by role
(keys matched case-insensitively, the longest text of each role kept); parallel lists; one string.

>>> fix, words = suggest({"question": "2+2?", "answer": "4"})
>>> fix.text(), words
('--field question=user --field answer=assistant', '')
>>> fix, words = suggest({"instruction": "Name a prime.", "responses": ["2", "4"], "rewards": [0.9, 0.1]})
>>> fix.text()
'--pairs --pair-ranked responses/rewards'
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

from pipeline._formats._base import ID_KEYS, text_size
from pipeline._formats._fix import NAME, ROLE, Fix, Hole
from pipeline._formats._labels import label_like, label_spelling
from pipeline._formats.preference import score_value
from pipeline._formats.tree import REPLY_KEYS
from pipeline._formats._turns import CONTENT_KEYS, EXCHANGES, ROLE_ALIASES, ROLE_KEYS, _looks_like_calls, numbered, speaker_name

_WORDS = {
    "system": ("system", "system_prompt", "sys", "system_message"),
    "reasoning": ("reasoning", "cot", "complex_cot", "chain_of_thought", "thinking", "thought", "thoughts",
                  "rationale", "think", "explanation", "reasoning_content"),
    "user": ("instruction", "question", "query", "prompt", "input", "problem", "human", "request", "user",
             "context", "inputs", "task", "instructions", "questions", "prompts"),
    "assistant": ("output", "answer", "response", "completion", "solution", "target", "chosen", "reply",
                  "assistant", "outputs", "answers", "responses", "label", "targets", "completions",
                  "generations", "generation", "candidates", "replies"),
}
"""Key names (lower case, ``-`` and spaces as ``_``) by the role a field under them plays."""
_ANSWER_ITEM_KEYS = ("completion", "response", "output", "answer", "text", "content", "generation", "reply")
"""Keys of the answer inside one item of a list of alternatives (``completions: [{model, completion}]``)."""
_BETTER = {"chosen", "preferred", "accepted", "good", "better", "positive", "pos", "win", "winner", "selected",
           "correct", "best"}
_WORSE = {"rejected", "dispreferred", "bad", "worse", "negative", "neg", "lose", "loser", "incorrect", "worst"}
PAIR_PROMPTS = ("prompt", "question", "query", "instruction", "input")
"""Prompt keys the pair reader finds by itself (others need ``--pair-prompt``)."""
LONG = 64
"""Characters from which a field's text counts as long: left unread, it must be named with a reason."""


def _norm(key: str) -> str:
    return re.sub(r"[\s\-]+", "_", key.strip().lower())


def role_of(key: str) -> Optional[str]:
    """The role a key's name says its field plays (``Complex_CoT`` -> reasoning), or None. A name of several words
    plays the role of its last word (its head noun: ``generated_solution`` and ``expectedAnswer`` -> assistant,
    ``original_question`` -> user), never of another (``question_id``, ``answer_type``: none).

    >>> [role_of(k) for k in ("Complex_CoT", "generated_solution", "expectedAnswer", "question_id", "answer_type")]
    ['reasoning', 'assistant', 'assistant', None, None]
    """
    k = _norm(key)
    found = next((role for role, words in _WORDS.items() if k in words), None)
    if found is not None:
        return found
    head = _words(key)[-1:]
    return next((role for role, words in _WORDS.items() if head and head[0] in words), None)


def _words(key: str) -> list[str]:
    """A key's words, lower case: split at ``_``, ``-``, spaces, dots and camelCase humps."""
    return [w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", key)]


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def suggest(record: dict) -> tuple[Optional[Fix], str]:
    """Options that would read a record of unknown shape and the words after them; or no options, and words that
    say what is ambiguous (see the module docstring). A KTO label in any spelling (``Label``, ``KTO_TAG``, holding
    true/false, 1/0 or their text) is never taken for a turn: the fix reads it with ``--kto-label``, so no suggestion
    packs a labelled answer as plain SFT.

    >>> fix, words = suggest({"Prompt": "2+2?", "Completion": "5", "Label": "false"})
    >>> fix.text()
    '--field Prompt=user --field Completion=assistant --kto-label Label'
    """
    label = next((k for k in record if label_spelling(k) and label_like(record[k])), None)
    rest = record if label is None else {k: v for k, v in record.items() if k != label}
    fix, words = _suggested(rest)
    if label is None:
        return fix, words
    if fix is None:
        return None, words + f"; {label} is a KTO label: read it with --kto-label {label}"
    return dataclasses.replace(fix, options=fix.options + (("kto_label", label),)), words


def _suggested(record: dict) -> tuple[Optional[Fix], str]:
    for step in (_pair_sides, _tree, _turn_lists, _alternatives, _transcript, _by_role, _parallel, _one_string):
        found = step(record)
        if found is not None:
            return found
    return Fix.of(fields=((NAME, ROLE),)), " for each turn's field, or --messages-field PATH for a list of turns"


# ------------------------------------------------------------------------------------------------
# Two sides of a pair: chosen_messages/rejected_messages, response_good/response_bad, two transcripts.

def _side_rank(key: str) -> int:
    words = set(_norm(key).split("_"))
    return -1 if words & _BETTER else 1 if words & _WORSE else 0


def _turnish(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 1 and all(isinstance(m, dict) for m in v)


def _differ_at_end(a: Any, b: Any) -> bool:
    """Two turn lists that share all but their last turns, or two strings that share a long beginning."""
    if isinstance(a, str) and isinstance(b, str):
        shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return a != b and shared >= max(LONG, min(len(a), len(b)) // 2)
    if _turnish(a) and _turnish(b):
        return a[:-1] == b[:-1] and a[-1] != b[-1]
    return False


_MARKED = re.compile(r"^(?P<stem>.*?[^_\- ])[_\- ]?(?P<mark>[A-Za-z0-9])$")
_WINNER_WORDS = {"label", "labels", "winner", "preference", "preferred", "choice", "better", "best", "chosen",
                 "prefer", "pick", "selected"}


def _marked(a: str, b: str) -> bool:
    """Two keys that differ only by a one-character side mark: ``human_ref_A``/``human_ref_B``, ``response_0``/
    ``response_1``, ``conversation_a``/``conversation_b``, ``response_j``/``response_k``."""
    ma, mb = _MARKED.match(a), _MARKED.match(b)
    return bool(ma and mb and ma["stem"] == mb["stem"] and ma["mark"].lower() != mb["mark"].lower())


def _marked_prompt(record: dict, a: str, b: str) -> Optional[str]:
    """The field two marked sides answer: a prompt key, else the longest other text of some length; None."""
    prompt = _prompt_key(record)
    if prompt is None:
        rest = [k for k, v in record.items() if k not in (a, b) and isinstance(v, str) and text_size(v) >= LONG // 2]
        prompt = max(rest, key=lambda k: text_size(record[k]), default=None)
    return prompt


def _numbered_turns(record: dict, a: str, b: str) -> Optional[tuple[Optional[Fix], str]]:
    """Two marked text fields with nothing beside them for both to answer (CAMEL's ``message_1``/``message_2``):
    not a preference pair (two answers to no prompt) but two turns in the marks' order, the first the user's."""
    if not (isinstance(record[a], str) and isinstance(record[b], str)) or _marked_prompt(record, a, b) is not None \
            or "assistant" in (role_of(a), role_of(b)):  # response_0/response_1: two answers, a pair's sides
        return None
    first, second = sorted((a, b), key=lambda k: _MARKED.match(k)["mark"].lower())
    return (Fix.of(fields=((first, "user"), (second, "assistant"))),
            f" ({first} and {second} are numbered turns with no prompt beside them to answer: {first} is read as "
            f"the user's turn, {second} as the assistant's)")


def _marked_extras(record: dict, a: str, b: str) -> tuple[dict[str, Any], str]:
    """For two marked sides (SHP, Chatbot Arena): the prompt when the pair reader would not find it by itself, and
    the field that may say which side won (its values are the user's to give), with the words about them."""
    opts: dict[str, Any] = {}
    words = ""
    prompt = _marked_prompt(record, a, b)
    if prompt is not None and prompt not in PAIR_PROMPTS:
        opts["pair_prompt"] = prompt
        words += f"; {prompt} read as the prompt"
    winner = next((k for k, v in record.items() if k not in (a, b) and set(_words(k)) & _WINNER_WORDS
                   and isinstance(v, (str, int, bool)) and (not isinstance(v, str) or len(v) <= 32)), None)
    if winner is not None:
        opts["pair_winner"] = ((winner, Hole(f"VALUE_{a}/VALUE_{b}")),)
        opts["drops"] = (winner,)  # read once the user gives its values: not an ignored field of the fix
        words += (f"; {winner} ({record[winner]!r} here) may say which side is preferred: give its value for {a}, "
                  f"then for {b} (e.g. --pair-winner {winner}=1/0)")
    else:
        words += f"; {a} is taken as the chosen one: add --pair-winner FIELD=A/B if a field says"
    return opts, words


def _pair_sides(record: dict) -> Optional[tuple[Optional[Fix], str]]:
    keys = [k for k, v in record.items() if _turnish(v) or (isinstance(v, str) and text_size(v))]
    for i, a in enumerate(keys):
        for b in keys[i + 1:]:
            va, vb = record[a], record[b]
            if _marked(a, b) and type(va) is type(vb) and min(text_size(va), text_size(vb)) >= LONG // 2:
                turns = _numbered_turns(record, a, b)
                if turns is not None:
                    return turns
                extras, more = _marked_extras(record, a, b)
                return (Fix.of(pairs=True, pair_sides=f"{a},{b}", **extras),
                        f" ({a} and {b} look like the two answers of one preference pair{more}; to train one "
                        "side only as SFT, map it with --field (the other side is then dropped))")
            named = {_side_rank(a), _side_rank(b)} == {-1, 1}
            if not (named and type(va) is type(vb)) and not _differ_at_end(va, vb):
                continue
            won, lost = (a, b) if _side_rank(a) <= _side_rank(b) else (b, a)
            order = "" if named else f"; {won} is taken as the chosen one: add --pair-winner FIELD=A/B if a field says"
            return (Fix.of(pairs=True, pair_sides=f"{won},{lost}"),
                    f" ({won} and {lost} look like the chosen and the rejected side of one preference pair{order}; to "
                    "train one side only as SFT, pass that key alone to --messages-field (the other side is then "
                    "dropped))")
    return None


# ------------------------------------------------------------------------------------------------
# A list of turns under any key, or one level down; a dict of numbered turns (turn_1, turn_2, ...).

def _tree(record: dict) -> Optional[tuple[Optional[Fix], str]]:
    """A message tree (OpenAssistant): a turn object with its replies, nested; read by ``--tree``."""
    for k, v in record.items():
        if isinstance(v, dict) and any(r in v for r in ROLE_KEYS) and any(
                isinstance(v.get(r), list) and v[r] and all(isinstance(x, dict) for x in v[r]) for r in REPLY_KEYS):
            other = sorted({x for x in v if x not in (*ROLE_KEYS, *CONTENT_KEYS, *REPLY_KEYS, "rank")})
            more = f"; its messages' other keys are counted as ignored: {', '.join(other)}" if other else ""
            return (Fix.of(tree=k, drops=(k,)),
                    f" ({k} is a message tree: each root-to-leaf path becomes one conversation{more})")
    return None


def _turn_lists(record: dict) -> Optional[tuple[Optional[Fix], str]]:
    found = [(k, v) for k, v in record.items()] + [
        (f"{k}.{k2}", v2) for k, v in record.items() if isinstance(v, dict) for k2, v2 in v.items()]
    for path, v in found:
        listed = numbered(v)
        if listed is not None and (len(listed) > 1 or isinstance(listed[0][1], dict)) and \
                all(isinstance(x, (str, dict)) for _, x in listed):  # one turn_1 object: a one-turn chat (MOSS)
            items = [x for _, x in listed]
            if all(isinstance(x, str) for x in items):
                return Fix.of(messages_field=path), f" (its {listed[0][0]}, {listed[1][0]}, ... keys are turns in " \
                                                    "numeric order; strings alternate user, assistant)"
            v = items
        if isinstance(v, list) and v and all(isinstance(m, dict) for m in v) and not _is_alternatives(path, v, record):
            pair = next((p for p in EXCHANGES if all(p[0] in m and p[1] in m for m in v)), None)
            if pair is not None:
                return Fix.of(messages_field=path), f" (each {{{pair[0]}, {pair[1]}}} is one exchange)"
            keys = _turn_keys(v)
            # Speakers as keys ({"human": ..., "bot": ...}) win over a guessed speaker key: a guess would take one
            # speaker's messages for role names.
            if (keys is None or (keys[0] or {}).get("role_key")) and _speakers_as_keys(v):
                return None, _speakers_as_keys(v, path)
            if keys is not None and keys[0] is None:
                return None, f"{path}: {keys[1]}"
            if keys is not None:
                return _answered(record, path, v, keys)
    return None


def _answered(record: dict, path: str, v: list[dict], keys: tuple[dict[str, Any], str]
              ) -> tuple[Optional[Fix], str]:
    """``--messages-field`` for a list of turns; when it ends on a user turn and a string beside it holds the answer
    (RL Parquet: ``prompt`` as a list of messages, ``solution`` a string), that answer mapped after it."""
    opts, words = keys
    rk = opts.get("role_key") or next((k for k in ROLE_KEYS if k in v[-1]), None)
    last = speaker_name(v[-1].get(rk)) if rk is not None else ""
    if "." not in path and ROLE_ALIASES.get(last.lower()) == "user" and "roles" not in opts:
        answers = [k for k, x in record.items() if k != path and role_of(k) == "assistant" and isinstance(x, str)
                   and text_size(x)]
        if answers:
            best = max(answers, key=lambda k: text_size(record[k]))
            return (Fix.of(messages_field=path, **opts, fields=((best, "assistant"),)),
                    f" ({path} ends on a user turn; {best} is its answer){words}")
    return Fix.of(messages_field=path, **opts), words


def _speakers_as_keys(v: list[dict], path: str = "") -> str:
    """For turn objects that hold each speaker's text under its own key (MOSS: ``{"Human": "<|Human|>: ...",
    "MOSS": "<|MOSS|>: ..."}``): why no option reads them; "" for other objects. A speaker is read from a value,
    never from text: a role named after a message would be no fix."""
    texts = [k for k in v[0] if all(isinstance(m.get(k), str) for m in v)]
    speakers = [k for k in texts if role_of(k) in ("user", "assistant") or k.lower() in ROLE_ALIASES]
    if len(texts) < 2 or not speakers:
        return ""
    return (f"{path} holds {len(v)} turn{'s' if len(v) > 1 else ''}, each an object with one key per speaker ({', '.join(texts)}); no option "
            f"reads a speaker from a key's name (--role-key KEY reads it from a value), so convert each turn into "
            f"{{role, content}} objects first")


_NAME = re.compile(r"[^\s:]+(?: [^\s:]+)?:?")
"""A speaker's name: one or two words, maybe with a colon (``gpt``, ``Speaker 2``, ``A:``), never a message."""


def _name_like(x: Any) -> bool:
    return isinstance(x, (int, bool)) or (isinstance(x, str) and len(x) <= 32 and bool(_NAME.fullmatch(x)))


def _turn_keys(v: list[dict]) -> Optional[tuple[Optional[dict[str, Any]], str]]:
    """For a list of turn objects: the options beside ``--messages-field`` that read it (its speaker and text keys
    when they are not the usual ones, the speaker names no built-in role covers) and the words after them; None
    when no key looks like the speaker or the text; no options, and words why, when the speaker holds text."""
    rk = next((k for k in ROLE_KEYS if k in v[0]), None)
    ck = next((k for k in CONTENT_KEYS if k in v[0]), None)
    opts: dict[str, Any] = {}
    if ck is None:  # the text: the key with the longest strings
        texts = [k for k in v[0] if isinstance(v[0][k], str) and k != rk]
        ck = max(texts, key=lambda k: sum(len(m.get(k) or "") for m in v if isinstance(m.get(k), str)), default=None)
        if ck is None:
            return None
        opts["content_key"] = ck
    if rk is None:  # the speaker: a key with few distinct short values
        cands = [k for k in v[0] if k != ck and all(_name_like(m.get(k)) for m in v)]
        cands = [k for k in cands if len({str(m[k]) for m in v}) <= max(2, len(v) // 2)]
        if not cands:
            return None
        rk = cands[0]
        opts = {"role_key": rk, **opts}
    names = list(dict.fromkeys(speaker_name(m[rk]) for m in v if rk in m))
    unknown = [n for n in names if n.lower() not in ROLE_ALIASES]
    if not unknown:
        return opts, ""
    text = next((m[rk] for m in v if rk in m and not _name_like(m[rk])), None)
    if text is not None:  # a message's text is no speaker's name: never offered as one (MOSS-like markers)
        return None, (f"the turns' {rk} holds text, not a speaker's name ({str(text)[:40]!r}); no option takes a "
                      "role from text: map each speaker's name to a role with --roles NAME=ROLE once the turns name "
                      "their speakers")
    guess = ("user", "assistant") if len(names) == 2 else (ROLE, ROLE)
    opts["roles"] = tuple((n, guess[min(i, 1)]) for i, n in enumerate(names) if n in unknown)
    return opts, " (check the roles with preview)"


# ------------------------------------------------------------------------------------------------
# Alternatives: several answers to one prompt. Never merged into one trained turn.

def _prompt_key(record: dict) -> Optional[str]:
    """The user-like string field with the most text."""
    keys = [k for k, v in record.items() if role_of(k) == "user" and isinstance(v, str) and text_size(v)]
    return max(keys, key=lambda k: text_size(record[k]), default=None)


def _answer_key(item: dict) -> Optional[str]:
    return next((k for k in item if _norm(k) in _ANSWER_ITEM_KEYS and isinstance(item[k], str)), None)


def _is_alternatives(path: str, v: list, record: dict) -> bool:
    """A list of objects that each hold an answer and no speaker, beside a prompt string (Tulu's human-eval
    ``completions: [{model, completion}]``)."""
    if len(v) < 2 or _prompt_key(record) is None or "." in path:
        return False
    return all(isinstance(m, dict) and not any(k in m for k in ROLE_KEYS) and _answer_key(m) == _answer_key(v[0])
               and _answer_key(m) is not None for m in v)


def _alternatives(record: dict) -> Optional[tuple[Optional[Fix], str]]:
    prompt = _prompt_key(record)
    if prompt is None:
        return None
    for key, v in record.items():
        strings = isinstance(v, list) and len(v) > 1 and all(isinstance(x, str) for x in v)
        if strings and role_of(key) == "assistant":
            item, text = f"{key}[N]", None
        elif isinstance(v, list) and _is_alternatives(key, v, record):
            text = _answer_key(v[0])
            item = f"{key}[N].{text}"
        else:
            continue
        head = f" ({key} holds {len(v)} alternative answers to one prompt, which one trained turn would merge"
        pair_prompt = {} if prompt in PAIR_PROMPTS else {"pair_prompt": prompt}
        scores = _scores(record, key, v, text)
        if scores is not None:
            return (Fix.of(pairs=True, pair_ranked=scores, **pair_prompt, drops=(key,)),
                    f"{head}: packed as a pair, the best-scored against the worst; to train one of them as SFT "
                    f"instead, map it alone with --field '{item}=assistant')")
        one = f"{key}[0]" if text is None else f"{key}[0].{text}"
        return (Fix.of(fields=((prompt, "user"), (one, "assistant")), drops=(key,)),
                f"{head}, and nothing scores them: this trains the first only, the others are not trained; pick "
                f"another with --field '{item}=assistant', or pack two as a preference pair with --pairs)")
    return None


def _scores(record: dict, key: str, v: list, text: Optional[str]) -> Optional[str]:
    """``--pair-ranked`` for a list of alternatives, when numbers score them: a parallel list (``responses/rewards``)
    or a number in every item (``completions=completion/score``); None without."""
    if text is None:
        other = next((k for k, s in record.items() if k != key and isinstance(s, list) and len(s) == len(v)
                      and all(_number(score_value(x)) for x in s)), None)
        return None if other is None else f"{key}/{other}"
    common = [k for k in v[0] if k != text and all(isinstance(m, dict) and _number(m.get(k)) for m in v)]
    return None if not common else f"{key}={text}/{common[0]}"


# ------------------------------------------------------------------------------------------------
# One string of marked turns; fields by role; parallel lists; one string.

_BUILTIN_RE = re.compile(r"(?:(?:\A|\n)[ \t]*(?:Human|Assistant|User|USER|ASSISTANT):|### (?:Human|Assistant))")


def _system(record: dict) -> tuple[tuple[str, str], ...]:
    system = next((k for k in record if role_of(k) == "system" and isinstance(record[k], str)), None)
    if system is None:
        return ()
    return ((system, "transcript" if re.match(r"(?:SYSTEM|System):", record[system]) else "system"),)


def _transcript(record: dict) -> Optional[tuple[Optional[Fix], str]]:
    head = _system(record)
    for k, v in record.items():
        if isinstance(v, str) and len(_BUILTIN_RE.findall(v)) >= 2 and (not head or k != head[0][0]):
            return Fix.of(fields=head + ((k, "transcript"),)), ""
    return None


def _case_copies(record: dict) -> tuple[set[str], str]:
    """Keys with a twin of another case (``question`` beside ``Question``) in the family that holds less of the
    record's text, as keys to leave, and the words that say why. A family is every role-named key of one case,
    twinned or not, so what is trained is judged on the whole record: HuatuoGPT-o1 keeps a multiple-choice
    ``question`` (longer than its twin) and a one-letter ``answer`` beside ``Question``, ``Complex_CoT`` and
    ``Response``, and the capitalised family is read. A key with no twin is never left as a copy (issue 42)."""
    lower: dict[str, list[str]] = {}
    for k in record:
        lower.setdefault(k.lower(), []).append(k)
    twins = [ks for ks in lower.values() if len(ks) > 1]
    if not twins:
        return set(), ""
    style = lambda k: k[:1].isupper()  # noqa: E731
    held = {s: sum(text_size(record[k]) for k in record if style(k) is s and role_of(k) is not None)
            for s in (True, False)}
    keep = held[True] >= held[False]
    left = {k for ks in twins if {style(k) for k in ks} == {True, False} for k in ks
            if style(k) is not keep and role_of(k) is not None}
    if not left:
        return set(), ""
    kept = ", ".join(sorted(k for ks in twins for k in ks if style(k) is keep and k.lower() in {x.lower() for x in left}))
    words = (f"; {', '.join(sorted(left))}: the same field{'s' if len(left) > 1 else ''} as {kept} in "
             f"{'lower-case' if keep else 'capitalised'} keys, left, as the {'capitalised' if keep else 'lower-case'} "
             f"keys hold more of the record's text, {held[keep]} against {held[not keep]} characters")
    return left, words


def _by_role(record: dict) -> Optional[tuple[Optional[Fix], str]]:
    left, why = _case_copies(record)
    keys = [k for k in record if k not in left and k not in ID_KEYS and not isinstance(record[k], bool)
            and (isinstance(record[k], str) or (role_of(k) == "assistant" and (_number(record[k])
                                                                               or _looks_like_calls(record[k]))))]
    roles = {k: role_of(k) for k in keys}
    users = [k for k in keys if roles[k] == "user" and text_size(record[k])]
    exact = [k for k in users if _norm(k) in _WORDS["user"]]
    users = exact or users  # original_question beside query: a copy, not a second user turn
    answers = sorted((k for k in keys if roles[k] == "assistant"), key=lambda k: -text_size(record[k]))
    thoughts = sorted((k for k in keys if roles[k] == "reasoning"), key=lambda k: -text_size(record[k]))
    if not answers and thoughts:  # a rationale alone is the answer
        answers, thoughts = thoughts[:1], thoughts[1:]
    if not users or not answers:
        return None
    if len(answers) > 1 and text_size(record[answers[1]]) * 4 > text_size(record[answers[0]]) and \
            text_size(record[answers[1]]) >= LONG:
        return None, (f"read it with --field NAME=ROLE per turn: {answers[0]} and {answers[1]} both hold an answer "
                      f"({text_size(record[answers[0]])} and {text_size(record[answers[1]])} characters), and training both "
                      "would merge two answers into one turn; map the one to train with --field NAME=assistant")
    unread = [k for k in keys if (roles[k] is None or (roles[k] == "user" and k not in users))
              and isinstance(record[k], str)]
    longest = max(record, key=lambda k: text_size(record[k]))
    taken = {*users, answers[0], *thoughts[:1], *left}
    if longest not in taken and text_size(record[longest]) >= max(LONG, text_size(record[answers[0]])):
        known = "has a name no role is known for" if role_of(longest) is None else \
            f"is not a string the guessed answer ({answers[0]}, {text_size(record[answers[0]])} characters) could replace"
        return None, (f"read it with --field NAME=ROLE per turn: its longest field, {longest} "
                      f"({text_size(record[longest])} characters), {known}; map it with --field "
                      f"{longest}=ROLE beside the others")
    fields = _system(record) + tuple((k, "user") for k in users)
    fields += ((thoughts[0], "reasoning"),) if thoughts else ()
    fields += ((answers[0], "assistant"),)
    words = why
    others = [k for k in answers[1:] + thoughts[1:]]
    if others:
        words += f"; {', '.join(others)}: shorter than {answers[0]}, left as another answer"
    long_left = [k for k in unread if text_size(record[k]) >= LONG]
    if long_left:
        words += f"; {', '.join(long_left)}: long text left unread (add --field NAME=ROLE if it is a turn)"
    return Fix.of(fields=fields), f" ({words[2:]})" if words else ""


def _string_lists(record: dict) -> list[tuple[str, list]]:
    """Lists of strings at the top level or one step down (``meta.turns``, ``choices[0].turns``)."""
    out = []
    for k, v in record.items():
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
            out.append((k, v))
        subs = v.items() if isinstance(v, dict) else (v[0].items() if isinstance(v, list) and v and
                                                      isinstance(v[0], dict) else ())
        for k2, v2 in subs:
            if isinstance(v2, list) and v2 and all(isinstance(x, str) for x in v2):
                out.append((f"{k}.{k2}" if isinstance(v, dict) else f"{k}[0].{k2}", v2))
    return out


def _parallel(record: dict) -> Optional[tuple[Optional[Fix], str]]:
    lists = _string_lists(record)
    head = _system(record)
    for i, (p1, v1) in enumerate(lists):  # questions and answers as parallel lists (MT-bench: turns, choices[0].turns)
        for p2, v2 in lists[i + 1:]:
            if len(v1) == len(v2) and role_of(p1.split(".")[-1]) != "assistant":
                return Fix.of(fields=head + ((p1, "user"), (p2, "assistant"))), ""
    if lists:
        path = max(lists, key=lambda pv: sum(map(len, pv[1])))[0]
        if len(record[path] if path in record else ()) > 1:
            return Fix.of(messages_field=path), " (its strings alternate user, assistant)"
    return None


def _one_string(record: dict) -> Optional[tuple[Optional[Fix], str]]:
    strings = [k for k, v in record.items() if isinstance(v, str) and k not in ID_KEYS]
    if len(strings) == 1:
        return Fix.of(fields=((strings[0], "text"),)), " (plain text, every token trained), or --field NAME=ROLE per turn"
    return None
