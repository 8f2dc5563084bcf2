"""Message trees (OpenAssistant): ``--tree KEY`` reads a tree of messages, each with its ``replies``, as conversations.

::

    prompt: {role: prompter, text: "Q"}            --tree-paths all: every root-to-leaf path, each cut
      ├── {role: assistant, text: "A1", rank: 1}     back to its last assistant message
      │     └── {role: prompter, text: "P2"}           -> [Q, A1], [Q, A2]    (P2 is counted off path)
      └── {role: assistant, text: "A2", rank: 0}   --tree-paths best: the best-ranked reply at each step
                                                       -> [Q, A2]             (A1 and P2 off path)

A node is a turn object (``role``/``text``, or any keys ``--role-key``/``--content-key`` name) with
its children under ``replies`` (or ``children``) and its place among its siblings under ``rank``
(0 is the best; replies without a rank come after ranked ones, in order). Nodes marked
``deleted: true`` are left out with their subtrees. A path that ends on a question is cut back
to its last assistant message, and a path that is the beginning of another kept path is not
kept twice. Each record counts ``tree_paths_kept`` (conversations) and ``tree_messages_off_path``
(messages on no kept path: other branches with ``best``, unanswered questions, deleted nodes).

>>> from pipeline._formats._base import Ctx
>>> from pipeline._options import FormatOptions
>>> tree = {"prompt": {"role": "prompter", "text": "Q", "replies": [
...     {"role": "assistant", "text": "A1", "rank": 1, "replies": [{"role": "prompter", "text": "P2"}]},
...     {"role": "assistant", "text": "A2", "rank": 0}]}}
>>> ctx = Ctx(FormatOptions(tree="prompt"))
>>> [[t.content for t in d.turns] for d in read(tree, ctx)], ctx.notes
([['Q', 'A1'], ['Q', 'A2']], {'tree_paths_kept': 2, 'tree_messages_off_path': 1})
>>> ctx = Ctx(FormatOptions(tree="prompt", tree_paths="best"))
>>> [[t.content for t in d.turns] for d in read(tree, ctx)], ctx.notes
([['Q', 'A2']], {'tree_paths_kept': 1, 'tree_messages_off_path': 2})
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from pipeline._formats._base import MISSING, Claim, Ctx, Draft, Reason, Rejected, Shape, Turn, _blank, _kind
from pipeline._formats._fix import Fix
from pipeline._formats._paths import resolve, top_key
from pipeline._formats._turns import TRAIN_KEYS, _turn_object, _unused_turn_keys, _where
from pipeline._options import TreePaths

REPLY_KEYS = ("replies", "children")
"""Where a node keeps its children (OpenAssistant: ``replies``)."""
NODE_KEYS = (*REPLY_KEYS, "rank", "deleted")
"""Keys of a node that shape the tree rather than the turn."""
MAX_DEPTH = 1000
MAX_PATHS = 10_000
"""Root-to-leaf paths one record may expand to with ``--tree-paths all`` (OpenAssistant's trees hold tens): a
record of a few MB can hold a tree of 100,000 paths (each a conversation to render and tokenize); past the
limit the record is a ``record_too_large`` dead letter naming ``--tree-paths best``."""


@dataclasses.dataclass(eq=False)
class _Node:
    turn: Optional[Turn]  # None: deleted
    rank: Optional[float]
    children: list["_Node"]

    def size(self) -> int:
        return 1 + sum(c.size() for c in self.children)


def _node(m: Any, at: str, ctx: Ctx, depth: int = 0) -> _Node:
    if depth > MAX_DEPTH:
        raise Rejected(Reason.BAD_TYPE, f"{at}: the tree is deeper than {MAX_DEPTH} messages")
    if not isinstance(m, dict):
        raise Rejected(Reason.BAD_TYPE, f"{at} is {_kind(m)}, expected a message object {{role, text, replies}}")
    full = [k for k in REPLY_KEYS if not _blank(m.get(k))]
    if len(full) > 1:
        raise Rejected(Reason.AMBIGUOUS_FIELD, f"{at} holds replies under both {full[0]!r} and {full[1]!r}; keep one")
    key = full[0] if full else next((k for k in REPLY_KEYS if k in m), None)
    replies = m.get(key) if key else None
    if replies is not None and not isinstance(replies, list):
        raise Rejected(Reason.BAD_TYPE, f"{at}.{key} is {_kind(replies)}, expected a list of reply messages")
    rank = m.get("rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, (int, float))):
        raise Rejected(Reason.BAD_TYPE, f"{at}.rank is {_kind(rank)}, expected a number (0 is the best reply)")
    deleted = m.get("deleted")
    if deleted is not None and not isinstance(deleted, bool):
        raise Rejected(Reason.BAD_TYPE, f"{at}.deleted is {_kind(deleted)}, expected true or false")
    children = [_node(r, f"{at}.{key}[{i}]", ctx, depth + 1) for i, r in enumerate(replies or ())]
    if m.get("deleted") is True:
        return _Node(None, rank, children)
    used = set(TRAIN_KEYS) | set(NODE_KEYS)
    turn = _turn_object(m, at, ctx, used)
    _unused_turn_keys(m, used, at, _where(at), ctx, one=True)
    return _Node(turn, rank, children)


def _paths(root: _Node, best: bool) -> list[list[_Node]]:
    """Root-to-leaf paths over live nodes (every one, or the best-ranked), each cut back to its last assistant."""
    out: list[list[_Node]] = []

    def walk(node: _Node, path: list[_Node]) -> None:
        path = path + [node]
        live = [c for c in node.children if c.turn is not None]
        if best and live:
            live = [min(live, key=lambda c: (c.rank is None, c.rank if c.rank is not None else 0, live.index(c)))]
        if not live:
            cut = max((i for i, n in enumerate(path) if n.turn.role == "assistant"), default=-1)
            if cut >= 0:
                out.append(path[: cut + 1])
        for c in live:
            walk(c, path)

    if root.turn is not None:
        walk(root, [])
    # A path that begins another kept path (or repeats one) is not kept twice. In a tree the path to a node is
    # unique, so p begins q exactly when p's last node lies inside q: one pass over the paths, not a pairwise one.
    inside = {id(n) for q in out for n in q[:-1]}
    kept: list[list[_Node]] = []
    ends: set[int] = set()
    for p in out:
        if id(p[-1]) not in inside and id(p[-1]) not in ends:
            ends.add(id(p[-1]))
            kept.append(p)
    return kept


def _leaves(node: _Node) -> int:
    """Root-to-leaf paths over live nodes (an upper bound of the paths kept)."""
    live = [c for c in node.children if c.turn is not None]
    return sum(_leaves(c) for c in live) if live else 1


def read(record: dict, ctx: Ctx) -> list[Draft]:
    path = ctx.o.tree
    root = _node(resolve(record, path), path, ctx)
    best = ctx.o.tree_paths is TreePaths.BEST
    if not best and root.turn is not None and (n := _leaves(root)) > MAX_PATHS:
        raise Rejected(Reason.RECORD_TOO_LARGE, f"the tree under {path} has {n:,} root-to-leaf paths, more than the "
                                                f"{MAX_PATHS:,} one record may expand to; use ",
                       Fix.of(tree_paths=TreePaths.BEST), " (one path per tree), or split the tree into several records")
    paths = _paths(root, best)
    if not paths:
        raise Rejected(Reason.NO_ASSISTANT_TURN, f"the tree under {path} has no assistant reply "
                                                 f"({root.size()} messages)")
    on_path = {id(n) for p in paths for n in p}
    ctx.note("tree_paths_kept", len(paths))
    ctx.note("tree_messages_off_path", root.size() - len(on_path))
    ctx.mapping.append(f"{path}: a message tree, {len(paths)} path{'s' if len(paths) != 1 else ''} "
                       f"({'the best-ranked' if best else 'every root-to-leaf path'}, --tree-paths {ctx.o.tree_paths.value})")
    return [Draft(turns=[dataclasses.replace(n.turn) for n in p]) for p in paths]


SHAPE = Shape(
    name="tree",
    claims=Claim(mapped=lambda record, o: [o.tree] if resolve(record, o.tree) is MISSING else [],
                 applies=lambda o: o.tree is not None, given=lambda o, missing: f"--tree {o.tree}"),
    reads=lambda record, o: {top_key(record, o.tree)},
    common=("system", "tools"),
    read=read,
    looks_like="a message tree, each message with its ``replies`` (OpenAssistant): ``--tree KEY`` "
               "(``--tree-paths all|best``)",
    follows=lambda o: [o.tree],
)
