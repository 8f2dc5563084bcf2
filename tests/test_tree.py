"""Message trees (``--tree KEY``, ``--tree-paths all|best``): every message on a kept path or counted, per record.

* Worked examples on the OpenAssistant-shaped fixture (tests/shapes/tree.jsonl; its ``--tree prompt``
  expectations and decode check are in test_formats.py's SHAPES).
* A property test over generated trees: the conversations are exactly the root-to-leaf paths (or
  the best-ranked one) cut back to their last assistant message, each assistant message of a
  live branch is trained on some path with ``all``, and ``tree_paths_kept`` and
  ``tree_messages_off_path`` count the rest.
* ``packstream pack`` end to end: one example per path (ids ``<id>~p2`` ...), counts that reconcile
  with ``extra_paths``, and ``verify --inputs`` agrees.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cli import main
from tests._internals import FormatOptions, Reason, Rejected, conversations
from tests.test_formats import SHAPES_DIR, load

ALL, BEST = FormatOptions(tree="prompt"), FormatOptions(tree="prompt", tree_paths="best")


def test_best_follows_rank_and_counts_the_rest():
    rec = dict(load("tree.jsonl"))[1]
    (conv,) = conversations(rec, BEST)
    assert [m["content"][:20] for m in conv.messages] == ["What is the differen", "A list is mutable: y",
                                                          "So when should I pre", "Use a tuple for fixe"]
    # The tree has 7 messages: 4 on the best path; the rank-1 answers, and the deleted one, are off it.
    assert conv.notes["tree_paths_kept"] == 1 and conv.notes["tree_messages_off_path"] == 3


def test_tree_refusals_name_the_value():
    with pytest.raises(Rejected, match="no_assistant_turn: the tree under prompt has no assistant reply .1 messages."):
        conversations({"prompt": {"role": "prompter", "text": "hello?"}}, ALL)
    with pytest.raises(Rejected, match=r"bad_type: prompt.replies\[0\].rank is str"):
        conversations({"prompt": {"role": "prompter", "text": "q", "replies": [{"role": "assistant", "text": "a",
                                                                               "rank": "best"}]}}, ALL)
    with pytest.raises(Rejected, match=r"unknown_role: prompt.replies\[0\].role is 'moderator'"):
        conversations({"prompt": {"role": "prompter", "text": "q", "replies": [{"role": "moderator", "text": "a"}]}}, ALL)
    with pytest.raises(Rejected, match=r"missing_field: field 'prompt' \(--tree prompt\) is missing"):
        conversations({"tree": {}}, ALL)


@st.composite
def trees(draw, depth=0):
    """(node, [(role, text, rank, deleted)]): a generated message tree whose roles alternate from a question."""
    role = "prompter" if depth % 2 == 0 else "assistant"
    text = f"{role[0]}{draw(st.integers(0, 10**6))}"
    node = {"role": role, "text": text}
    if depth:
        rank = draw(st.one_of(st.none(), st.integers(0, 3)))
        if rank is not None:
            node["rank"] = rank
        if draw(st.integers(0, 9)) == 0:
            node["deleted"] = True
    if depth < 4:
        node["replies"] = draw(st.lists(trees(depth + 1), max_size=3 if depth < 2 else 2))
    return node


def _paths(node, prefix=(), best=False):
    """Independently: root-to-leaf paths over live nodes, cut back to the last assistant, prefixes removed."""
    prefix = prefix + (node,)
    live = [r for r in node.get("replies", []) if not r.get("deleted")]
    if best and live:
        live = [sorted(live, key=lambda r: (r.get("rank") is None, r.get("rank") or 0))[0]]
    if not live:
        cut = [i for i, n in enumerate(prefix) if n["role"] == "assistant"]
        return [prefix[: cut[-1] + 1]] if cut else []
    return [p for r in live for p in _paths(r, prefix, best)]


def _size(node):
    return 1 + sum(_size(r) for r in node.get("replies", []))


@settings(max_examples=300, deadline=None)
@given(root=trees(), best=st.booleans())
def test_generated_trees_keep_every_path_or_count_it(root, best):
    paths = _paths(root, best=best)
    ids = [tuple(map(id, p)) for p in paths]  # messages are told apart by place, not by text
    maximal = [p for k, (p, i) in enumerate(zip(paths, ids))
               if not any(len(j) > len(i) and j[: len(i)] == i for j in ids) and i not in ids[:k]]  # and once
    rec = {"id": "t", "prompt": root}
    if not maximal:
        with pytest.raises(Rejected) as e:
            conversations(rec, BEST if best else ALL)
        assert e.value.reason is Reason.NO_ASSISTANT_TURN
        return
    convs = conversations(rec, BEST if best else ALL)
    assert [[m["content"] for m in c.messages] for c in convs] == [[n["text"] for n in p] for p in maximal]
    on = {id(n) for p in maximal for n in p}
    assert convs[0].notes.get("tree_paths_kept") == len(convs)
    assert convs[0].notes.get("tree_messages_off_path", 0) == _size(root) - len(on)
    assert all("tree_paths_kept" not in c.notes for c in convs[1:])  # a record's counts once


def test_pack_gives_one_example_per_path_and_counts_reconcile(tmp_path):
    out = tmp_path / "out"
    src = SHAPES_DIR / "tree.jsonl"
    result = CliRunner().invoke(main, ["pack", str(src), "-o", str(out), "--tree", "prompt", "--max-tokens", "512", "-q"])
    assert result.exit_code == 0, result.output
    c = json.loads((out / "manifest.json").read_text())["counts"]
    assert c["records_read"] == 3 and c["extra_paths"] == 3 and c["examples_packed"] == 6 and c["rejected"] == 0
    assert c["normalization"]["tree_paths_kept"] == 6 and c["normalization"]["tree_messages_off_path"] == 2
    result = CliRunner().invoke(main, ["verify", str(out), "--inputs", str(src)])
    assert result.exit_code == 0, result.output


def test_tree_paths_without_a_tree_is_one_error():
    """--tree-paths chooses among a tree's paths: given alone it would change nothing, silently."""
    from packers import PackstreamError
    from tests._internals import FormatOptions, TreePaths

    with pytest.raises(PackstreamError, match=r"--tree-paths best .* needs --tree KEY"):
        FormatOptions(tree_paths=TreePaths.BEST)
    assert FormatOptions(tree="prompt", tree_paths=TreePaths.BEST).tree_paths is TreePaths.BEST


def test_a_tree_of_too_many_paths_is_a_dead_letter_naming_best(monkeypatch):
    """A record of a few MB can hold 100,000 paths: bounded per record, with the option that reads it."""
    from tests._internals import tree

    monkeypatch.setattr(tree, "MAX_PATHS", 8)

    def node(role: str, depth: int) -> dict:
        n = {"role": role, "text": f"{role} at {depth}"}
        if depth:
            n["replies"] = [node("assistant" if role == "prompter" else "prompter", depth - 1) for _ in range(2)]
        return n

    rec = {"prompt": node("prompter", 4)}  # 16 leaves
    with pytest.raises(Rejected) as e:
        conversations(rec, FormatOptions(tree="prompt"))
    assert e.value.reason is Reason.RECORD_TOO_LARGE and "16 root-to-leaf paths" in e.value.detail
    assert "--tree-paths best" in e.value.detail
    assert len(conversations(rec, FormatOptions(tree="prompt", tree_paths="best"))) == 1
    monkeypatch.setattr(tree, "MAX_PATHS", 16)
    assert len(conversations(rec, FormatOptions(tree="prompt"))) == 8  # paths ending on a question are cut back
