"""A fuzz of the folder files readers trust: ``manifest.json`` and ``rejected.jsonl`` (issue 16, must show).

Hypothesis mutates a real ``pack`` output: values of any type put at any place in the manifest's JSON
tree (and in dead letters), keys deleted, list entries duplicated, dropped or swapped (shards, files,
inputs), nesting thousands of levels deep, huge numbers and strings, lines added, dropped, doubled or
garbled, and the whole file replaced by a link to /dev/zero, a FIFO, a folder, a 100 MiB file or random
bytes. Each mutated folder goes through ``verify``, ``inspect``, ``PackedDataset`` and
``pack --overwrite`` (tests/_abuse.py): each must work or refuse in one line (a PackstreamError, or
verify's problems, one line each), within its time bound. No other exception may escape.

The fast tier runs a few dozen seeded examples; the slow tier runs hundreds.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests._abuse import FILE_KINDS, clone, outcomes, replace_file

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"),
                                reason="needs FIFOs and /dev/zero")


@pytest.fixture(scope="module")
def base(small_run) -> Path:
    assert len((small_run / "rejected.jsonl").read_text().splitlines()) == 3
    assert all(v is None for v in outcomes(small_run).values())  # the untouched folder works everywhere
    return small_run


# -- what a mutation puts somewhere ------------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(-3, 3), st.integers(-(2**70), 2**70), st.sampled_from([10**400, -(10**400), 2**63, 2**63 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["", "complete", "failed", "train", "validation", "../x", "a\nb",
                                           "train-00000-of-00002.arrow", "0" * 64, "rejected.jsonl", "\x00"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)
big = st.sampled_from(["deep", "wide", "long string"])


def _big(kind: str) -> Any:
    if kind == "deep":
        v: Any = 1
        for _ in range(600):  # past the reader's depth bound (512), within what json.dumps can write
            v = [v]
        return v
    if kind == "wide":
        return list(range(200_000))
    return "x" * 3_000_000


def _children(v: Any):
    return v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()


def _paths(tree: Any, depth: int = 8) -> list[tuple]:
    """Every place in a JSON tree down to ``depth`` (the root excluded), as key/index paths."""
    out, level = [], [((), tree)]
    for _ in range(depth):
        level = [(at + (k,), v) for at, t in level for k, v in _children(t)]
        out += [at for at, _ in level]
    return out


def _lists(tree: Any, depth: int = 8) -> list[tuple]:
    """The paths of the non-empty lists in a JSON tree (the root included)."""
    return [p for p in [()] + _paths(tree, depth) if isinstance(_get(tree, p), list) and _get(tree, p)]


def _get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


@st.composite
def mutated(draw, tree: Any) -> Any:
    """``tree`` with 1-3 mutations."""
    tree = json.loads(json.dumps(tree))
    for _ in range(draw(st.integers(1, 3))):
        paths, lists = _paths(tree), _lists(tree)
        op = draw(st.sampled_from(["replace", "replace", "delete", "big", "duplicate", "drop", "swap"]))
        if op in ("duplicate", "drop", "swap") and lists:
            lst = _get(tree, draw(st.sampled_from(lists)))
            i, j = draw(st.integers(0, len(lst) - 1)), draw(st.integers(0, len(lst) - 1))
            if op == "duplicate":
                lst.insert(j, json.loads(json.dumps(lst[i])))
            elif op == "drop":
                del lst[i]
            else:
                lst[i], lst[j] = lst[j], lst[i]
            continue
        if not paths:
            return draw(values)
        path = draw(st.sampled_from(paths))
        parent, key = _get(tree, path[:-1]), path[-1]
        if op == "delete":
            del parent[key]
        else:
            parent[key] = _big(draw(big)) if op == "big" else draw(values)
    return tree


def _fresh(base: Path) -> Path:
    """A clone of ``base`` (files hard-linked: each mutated file is unlinked, then written anew)."""
    work = Path(tempfile.mkdtemp(dir=base.parent, prefix="case-")) / "out"
    clone(base, work)
    return work


def _write_json(path: Path, value: Any) -> None:
    path.unlink()
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):  # a value json cannot write: keep the bytes readers would never see
        text = "null"
    path.write_text(text)


def check(folder: Path) -> None:
    outcomes(folder)  # asserts: works, or one-line refusal, within the bound; any other exception escapes
    shutil.rmtree(folder.parent, ignore_errors=True)


manifest_cases = st.data()


def _manifest_case(base: Path, data) -> None:
    work = _fresh(base)
    path = work / "manifest.json"
    if data.draw(st.integers(0, 5)) == 0:
        replace_file(path, data.draw(st.sampled_from(FILE_KINDS)), path.read_bytes(), data.draw(st.binary(max_size=64)))
    else:
        _write_json(path, data.draw(mutated(json.loads(path.read_text()))))
    check(work)


def _dead_letter_case(base: Path, data) -> None:
    work = _fresh(base)
    path = work / "rejected.jsonl"
    original = path.read_bytes()
    if data.draw(st.integers(0, 4)) == 0:
        replace_file(path, data.draw(st.sampled_from(FILE_KINDS)), original, data.draw(st.binary(max_size=64)))
    else:
        lines = original.decode().splitlines()
        for _ in range(data.draw(st.integers(1, 3))):
            op = data.draw(st.sampled_from(["mutate", "drop", "duplicate", "garbage", "long", "deep", "swap"]))
            i = data.draw(st.integers(0, max(0, len(lines) - 1)))
            if op == "mutate" and lines:
                lines[i] = json.dumps(data.draw(mutated(json.loads(lines[i])))) if lines[i].startswith("{") else "{}"
            elif op == "drop" and lines:
                del lines[i]
            elif op == "duplicate" and lines:
                lines.insert(i, lines[i])
            elif op == "swap" and len(lines) > 1:
                j = data.draw(st.integers(0, len(lines) - 1))
                lines[i], lines[j] = lines[j], lines[i]
            elif op == "garbage":
                lines.insert(i, data.draw(st.text(max_size=40)).replace("\n", " "))
            elif op == "long":
                lines.insert(i, json.dumps({"source": "x" * 5_000_000, "position": 1, "reason": "too_long",
                                            "detail": ""}))
            elif op == "deep":
                lines.insert(i, "[" * 50_000 + "]" * 50_000)
        path.unlink()
        path.write_text("".join(line + "\n" for line in lines))
    check(work)


FAST = settings(max_examples=25, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
SLOW = settings(FAST, max_examples=300, derandomize=False)


@FAST
@given(data=st.data())
def test_manifest_fuzz_fast(base, data):
    _manifest_case(base, data)


@FAST
@given(data=st.data())
def test_dead_letter_fuzz_fast(base, data):
    _dead_letter_case(base, data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_manifest_fuzz(base, data):
    _manifest_case(base, data)


@pytest.mark.slow
@settings(SLOW, max_examples=120)
@given(data=st.data())
def test_dead_letter_fuzz(base, data):
    _dead_letter_case(base, data)


@pytest.mark.slow
def test_every_manifest_key_replaced_by_every_type(base):
    """The issue's type mutations, exhaustively: each key of the manifest to depth 3 (97 places, the run's
    options and inputs left out) in turn replaced by a value of each of 8 types (null, true, -1, 2**64, 1.5,
    "x", [], {}): 776 manifests. Each must refuse in one line or work, never raise TypeError, AttributeError or
    ValueError."""
    tree = json.loads((base / "manifest.json").read_text())
    places = [p for p in _paths(tree) if len(p) <= 3 and not (len(p) > 1 and p[0] in ("config", "inputs"))]
    kinds = [None, True, -1, 2**64, 1.5, "x", [], {}]
    for path in places:
        for v in kinds:
            t = json.loads(json.dumps(tree))
            _get(t, path[:-1])[path[-1]] = v
            work = _fresh(base)
            _write_json(work / "manifest.json", t)
            check(work)
