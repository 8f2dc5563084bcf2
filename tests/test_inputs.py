"""Every input path bounded, odd bytes (issue 16, the input side).

1. **Worked examples, one per cause.** A number Python refuses costs its line (JSONL) or its
   item (a JSON array), never the rest of the task or file; integers stay exact at any size;
   line numbers are one rule in every read task (LF, CRLF, lone CR); two examples with one id at
   one place stop the run; JSON arrays are streamed in bounded memory and refuse deep nesting per
   record; FIFOs and links to ``/dev/zero`` named as ``preview`` inputs, ``--chat-template``,
   ``--config`` or tokenizer files are one error line; a YAML alias bomb or a 50,000-level config
   is one error line; ``preview`` checks file types as ``pack`` does; ``--seed -1`` is refused once,
   in the options.
2. **A byte-level fuzz of JSONL and JSON inputs.** Seeded corruptions (truncation, flipped
   bytes, CR/LF/CRLF mixes, huge numbers, deep nesting, NULs, invalid UTF-8, a byte-order mark)
   in files of many read tasks (``TASK_BYTES`` set small). The truth is computed here, on its own:
   where each clean record sits (its line, by a regular expression over the final bytes, or its
   index in the array). Every clean record must come out with exactly that position and its own
   content; only damaged records may be refused; every non-blank line (or item) comes out exactly
   once. Many seeds go through the reader functions (hypothesis), a few through the real job
   (``pipeline.run``), whose counts must reconcile and which ``verify --inputs`` must accept.
3. **No way around the checked open.** The source of ``pipeline/`` and ``packers/`` is searched
   for raw opens of files; each one left is a writer, or reads a file packstream itself wrote and
   is listed below with its reason.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import json
import os
import random
import re
import threading
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packers
from packers import PackstreamError
from packers.files import MAX_JSON_DEPTH
from pipeline import PackOptions
from pipeline.cli import main
from tests._internals import Reason, Rejected, _read

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, timeout: float = 120) -> Any:
    """``packstream ARGS`` in this process, in a thread that must end within ``timeout`` seconds (a FIFO
    that blocks would otherwise hang the test run): one ``error:`` line or success, never a traceback."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(CliRunner().invoke(main, list(args))), daemon=True)
    t.start()
    t.join(timeout)
    assert box, f"packstream {' '.join(args)} did not end within {timeout} s"
    result = box[0]
    assert isinstance(result.exception, (SystemExit, type(None))), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def one_error(result, *words: str) -> str:
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.output
    for w in words:
        assert w in errors[0], errors[0]
    return errors[0]


def read_all(path: Path, kind: str, max_bytes: int = 1 << 20, task_bytes: int | None = None) -> list:
    """``(position, record or Rejected)`` of every task of one input, in task order (a break: a CorruptInput item)."""
    f = _read.InputFile(str(path), path.name, kind)
    out: list = []
    for task in _read.cut_tasks(f, task_bytes):
        try:
            for item in _read.read_task(task, max_bytes):
                out.append(item)
        except _read.CorruptInput as e:
            out.append(("corrupt", e.position))
    return out


# ------------------------------------------------------------------------------------------------
# Cause 1: a line the parsers refuse costs that line only; integers stay exact


HUGE = b"1" + b"0" * 5000  # more digits than Python's int() converts (4,300)


@pytest.mark.parametrize("line", [
    b'{"text": "a", "n": ' + HUGE + b"}",  # int() refuses: ValueError
    b'{"text": "a", "n": [' + b"[" * 2000 + b"]" * 2000 + b"]}",  # past orjson's depth: RecursionError in json
    b'{"text": "a", "d": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",  # past our bound
])
def test_a_refused_line_costs_that_line_only(tmp_path, line):
    lines = [json.dumps({"text": f"r{i}"}).encode() for i in range(300)]
    lines[5] = line
    p = tmp_path / "a.jsonl"
    p.write_bytes(b"\n".join(lines) + b"\n")
    got = read_all(p, "jsonl", task_bytes=512)
    assert [pos for pos, _ in got] == list(range(1, 301))
    assert isinstance(got[5][1], Rejected) and got[5][1].reason is Reason.MALFORMED_JSON
    assert [r for _, r in got if not isinstance(r, Rejected)] == [{"text": f"r{i}"} for i in range(300) if i != 5]


def test_a_refused_item_costs_that_item_only(tmp_path):
    items = [json.dumps({"text": f"r{i}"}).encode() for i in range(50)]
    items[3] = b'{"text": "a", "n": ' + HUGE + b"}"
    items[7] = b'{"text": "a", "d": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    p = tmp_path / "a.json"
    p.write_bytes(b"[\n" + b",\n".join(items) + b"\n]\n")
    got = read_all(p, "json")
    assert [pos for pos, _ in got] == list(range(50))
    assert "longer than Python reads" in got[3][1].detail
    assert "5001 levels deep, deeper than the 512 levels" in got[7][1].detail
    assert sum(isinstance(r, Rejected) for _, r in got) == 2


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_integers_stay_exact(tmp_path, kind):
    """orjson reads an integer beyond 64 bits as a float: ids 2**70 and 2**70 + 1 would be one id."""
    values = [2**64, 2**70, 2**70 + 1, -(2**63) - 1, 2**63 - 1, -(2**63), 10**4000, 12345678901234567890]
    records = [{"id": v, "text": "x"} for v in values]
    p = tmp_path / f"a.{kind}"
    p.write_text("\n".join(json.dumps(r) for r in records) if kind == "jsonl" else json.dumps(records))
    got = [r for _, r in read_all(p, kind)]
    assert got == records and all(type(r["id"]) is int for r in got)
    from tests._internals import example_id

    assert len({example_id("a", 0, r) for r in got}) == len(values)


# ------------------------------------------------------------------------------------------------
# Cause 2: line numbering is one rule in every task; one id at one place is a bug


def truth_lines(data: bytes) -> list[tuple[int, bytes]]:
    """Non-blank lines and their numbers, by the rule written here on its own: LF, CRLF and lone CR end lines."""
    lines = re.split(rb"\r\n|\r|\n", data)
    if lines and lines[-1] == b"":
        lines.pop()
    if lines and lines[0].startswith(b"\xef\xbb\xbf"):
        lines[0] = lines[0][3:]
    return [(n, raw) for n, raw in enumerate(lines, start=1) if raw.strip()]


def test_lone_cr_lines_number_alike_in_every_task(tmp_path):
    """Issue 16's case: lone CRs early in a file of several tasks once shifted later tasks' line numbers."""
    body = b"".join(json.dumps({"text": f"r{i}"}).encode() + (b"\r" if i < 50 else b"\n") for i in range(400))
    p = tmp_path / "a.jsonl"
    p.write_bytes(body)
    got = read_all(p, "jsonl", task_bytes=1024)
    assert len(_read.cut_tasks(_read.InputFile(str(p), "a", "jsonl"), 1024)) > 5
    assert [(pos, r) for pos, r in got] == [(n, json.loads(raw)) for n, raw in truth_lines(body)]


chunks_of_bytes = st.lists(st.sampled_from([b"\n", b"\r", b"\r\n", b"{}", b" ", b"ab", b"\r\r", b"\n\r", b"abcdefg"]),
                           max_size=60).map(b"".join)


@settings(max_examples=300, deadline=None)
@given(data=chunks_of_bytes, cuts=st.lists(st.integers(1, 7), min_size=1, max_size=8), task=st.integers(1, 20))
def test_one_line_rule_everywhere(data, cuts, task):
    """The splitter, the counter and the planner agree with the rule, whatever the blocks and tasks."""
    blocks, i = [], 0
    while i < len(data):
        n = cuts[len(blocks) % len(cuts)]
        blocks.append(data[i:i + n])
        i += n
    lines = list(_read.split_lines(blocks, max_bytes=1 << 20))
    want = re.split(rb"\r\n|\r|\n", data)
    if want[-1] == b"":
        want.pop()
    assert lines == want
    # Lines past max_bytes come out as their lengths, wherever the blocks cut them.
    assert list(_read.split_lines(blocks, max_bytes=3)) == [w if len(w) <= 3 else len(w) for w in want]
    after_cr, ends = False, 0
    for b in blocks:
        ends += _read.line_ends(b, after_cr=after_cr)
        after_cr = b[-1:] == b"\r"
    assert ends == len(re.findall(rb"\r\n|\r|\n", data))
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".jsonl") as fh:
        fh.write(data)
        fh.flush()
        f = _read.InputFile(fh.name, "a", "jsonl")
        tasks = _read.cut_tasks(f, task)
        seen = [(n, raw) for t in tasks for n, raw in _read.jsonl_texts(f, 1 << 20, t.start, t.stop, t.first)]
    assert seen == truth_lines(data)
    assert [t.start for t in tasks[1:]] == [t.stop for t in tasks[:-1]]


def test_long_lines_are_never_held(tmp_path):
    """A line past --max-record-bytes comes out as its size: a file of one huge line (no LF, only CRs
    that readline would not split at) is read in bounded memory."""
    lines = list(_read.split_lines((b"x" * 1000 for _ in range(10_000)), max_bytes=100))
    assert lines == [10_000_000]
    got = list(_read.split_lines([b"ab\r", b"\n" + b"y" * 50, b"y" * 60 + b"\rc"], max_bytes=100))
    assert got == [b"ab", 110, b"c"]


def test_one_id_at_one_place_stops_the_run():
    import numpy as np

    from tests._internals import ExampleBatch, dedupe

    def batch(ids, sources, positions):
        n = len(ids)
        return ExampleBatch.from_arrays(ids, sources, positions, np.full(n, 2), np.ones(2 * n), np.ones(2 * n))

    kept, dups = dedupe(batch(["a:x", "a:x"], ["a", "a"], [1, 2]))  # two records, one own id: a duplicate
    assert len(kept) == 1 and dups[0]["reason"] == "duplicate_id" and dups[0]["position"] == 2
    with pytest.raises(packers.InternalError, match="sit at one place"):
        dedupe(batch(["a@1", "a@1"], ["a", "a"], [1, 1]))


# ------------------------------------------------------------------------------------------------
# Causes 14 and 15: JSON arrays streamed in bounded memory; deep nesting per record


def test_json_array_is_streamed(tmp_path):
    """Reading a 12 MB array holds about one item, not the file (main held the text and every record)."""
    p = tmp_path / "big.json"
    item = json.dumps({"text": "w " * 500}).encode()
    with open(p, "wb") as fh:
        fh.write(b"[")
        fh.write(b",\n".join([item] * 12_000))
        fh.write(b"]")
    assert p.stat().st_size > 12e6
    f = _read.InputFile(str(p), "big.json", "json")
    tracemalloc.start()
    try:
        n = sum(1 for _ in _read.read_file(f, 1 << 20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == 12_000 and peak < 6 * 2**20, f"peak {peak / 2**20:.1f} MiB"
    assert _read.count_records(f) == 12_000


def test_json_forms(tmp_path):
    """One object, JSON lines named .json, a byte-order mark, white space of every kind, an empty array."""
    cases = {
        b'\xef\xbb\xbf\r\n [ {"text": "a"}\r,\r{"text": "b"} ]\r\n': [(0, {"text": "a"}), (1, {"text": "b"})],
        b'{\n  "text": "one"\n}\n': [(0, {"text": "one"})],
        b'{"text": "a"}\n{"text": "b"}\r\n\n{"text": "c"}': [(1, {"text": "a"}), (2, {"text": "b"}), (4, {"text": "c"})],
        b"[]": [],
    }
    for k, (data, want) in enumerate(cases.items()):
        p = tmp_path / f"f{k}.json"
        p.write_bytes(data)
        assert read_all(p, "json") == want, data


@pytest.mark.parametrize("data, position", [
    (b'[{"text": "a"}, {"text": "b"}, {"text": "c', 1),  # breaks off in a string
    (b'[{"text": "a"}, {"text": "b"}, ' + b"[" * 100_000, 1),  # breaks off, deeply nested
    (b'[{"text": "a"}} , {"text": "b"}]', None),  # brackets that do not match at the array's level
    (b'[{"text": "a"}] trailing', 0),
])
def test_a_json_file_that_breaks_is_corrupt_after_the_last_good_item(tmp_path, data, position):
    p = tmp_path / "a.json"
    p.write_bytes(data + b" " * 5000)  # past the launch check's 4 KiB: found by the reader
    got = read_all(p, "json")
    assert got[-1] == ("corrupt", position)
    assert [pos for pos, _ in got[:-1]] == list(range(0 if position is None else position + 1))


def test_deep_json_costs_that_item_alone(tmp_path):
    """An item nested 100,000 levels deep in a JSON array never leaves the reader as a value: it is refused at its
    position, so the encode stage dead-letters it exactly as ``pack`` writes it to rejected.jsonl and packs the
    rest; preview shows it refused, and estimate's sample and estimate run over it."""
    from tests._internals import Encoder

    good = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in range(4)]
    body = [json.dumps(g).encode() for g in good]
    body.insert(2, b'{"text": "x", "d": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    p = tmp_path / "deep.json"
    p.write_bytes(b"[" + b",".join(body) + b"]")
    options = PackOptions(inputs=(str(p),), output=str(tmp_path / "out"))
    (f,) = _read.expand_datasets(options.datasets())[0]  # the launch check
    items = list(_read.read_file(f, options.max_record_bytes))
    assert [pos for pos, _ in items] == [0, 1, 2, 3, 4] and [isinstance(r, Rejected) for _, r in items].count(True) == 1
    enc = Encoder(options).encode([(f.dataset, f.source, pos, rec) for pos, rec in items])
    (dead,) = enc.rejected
    assert dead["position"] == 2 and dead["reason"] == "malformed_json" and "levels deep" in dead["detail"]
    assert len(enc.batch) == 4
    sampled = _read.sample(f, 10, options.max_record_bytes).items
    assert [(pos, getattr(r, "reason", None)) for pos, r in sampled] == [
        (pos, getattr(r, "reason", None)) for pos, r in items]
    r = cli("preview", str(p), "-n", "10", "--no-color")
    assert r.exit_code == 0 and "record 2: shape not recognised  REFUSED malformed_json" in r.output, r.output
    r = cli("estimate", str(p), "--json")
    assert r.exit_code == 0, r.output


# ------------------------------------------------------------------------------------------------
# Causes 10, 11, 16: what preview, --chat-template, --config and tokenizers name, checked alike


def special(tmp_path: Path, kind: str, name: str) -> Path:
    p = tmp_path / name
    if kind == "fifo":
        os.mkfifo(p)
    else:
        p.symlink_to("/dev/zero")
    return p


KINDS = [pytest.param("fifo", id="fifo", marks=pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")),
         pytest.param("zero", id="dev_zero", marks=pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero"))]
WHAT = {"fifo": "FIFO", "zero": "a device"}


@pytest.mark.parametrize("kind", KINDS)
def test_preview_input(tmp_path, kind):
    one_error(cli("preview", str(special(tmp_path, kind, "a.jsonl"))), WHAT[kind], "regular files")


@pytest.mark.parametrize("kind", KINDS)
def test_chat_template_file(tmp_path, kind):
    t = special(tmp_path, kind, "t.jinja")
    one_error(cli("preview", "--chat-template", str(t)), "--chat-template file", WHAT[kind])
    one_error(cli("pack", "--chat-template", str(t), "-o", str(tmp_path / "o")), WHAT[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_config_file(tmp_path, kind):
    c = special(tmp_path, kind, "mix.yaml")
    one_error(cli("preview", "--config", str(c)), "--config file", WHAT[kind])
    one_error(cli("estimate", "--config", str(c)), WHAT[kind])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"])
def test_tokenizer_folder(tmp_path, kind, name):
    from tests._internals import default_tokenizer_path

    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").symlink_to(Path(default_tokenizer_path()) / "tokenizer.json")
    if name == "tokenizer.json":
        (folder / name).unlink()
    special(folder, kind, name)
    data = tmp_path / "a.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    one_error(cli("preview", str(data), "--tokenizer", str(folder)), "tokenizer file", WHAT[kind])


def test_config_alias_bomb_and_depth(tmp_path):
    """Issue 16: 300 aliases of a 1 MiB string took 88 s and 3.8 GiB; 3,000 did not finish."""
    c = tmp_path / "bomb.yaml"
    c.write_text("x: &s '" + "z" * 900_000 + "'\ndatasets: [" + ", ".join(["*s"] * 3000) + "]\n")
    one_error(cli("preview", "--config", str(c), timeout=60), "expands to more than")
    c.write_text("datasets: " + "[" * 50_000 + "]" * 50_000 + "\n")
    one_error(cli("preview", "--config", str(c), timeout=60), "nests deeper than 32 levels")
    c.write_text("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(9)))
    one_error(cli("preview", "--config", str(c), timeout=60), "expands to more than")  # the billion laughs


@pytest.mark.parametrize("name, data, words", [
    ("a.arrow", b"not arrow at all", "not an Arrow IPC file"),
    ("a.parquet", b'{"text": "a"}\n', "not a Parquet file"),
    ("a.jsonl.gz", b'{"text": "a"}\n', "not gzip data"),
    ("a.json", b'[{"text": "a"}, {"text": ', "not valid JSON"),
])
def test_preview_checks_file_types_like_pack(tmp_path, name, data, words):
    p = tmp_path / name
    p.write_bytes(data)
    one_error(cli("preview", str(p)), words)
    one_error(cli("pack", str(p), "-o", str(tmp_path / "o")), words)


def test_preview_refuses_a_big_number_line_alone(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(b'{"text": "a", "n": ' + HUGE + b'}\n{"text": "b"}\n')
    r = cli("preview", str(p), "--no-color")
    assert r.exit_code == 0, r.output
    assert "line 1: shape not recognised  REFUSED malformed_json" in r.output and "line 2: text" in r.output


def test_preview_shows_where_a_file_breaks_off(tmp_path):
    p = tmp_path / "cut.jsonl.gz"
    data = gzip.compress(b"".join(json.dumps({"text": f"r{i} " + "w" * (i % 90)}).encode() + b"\n" for i in range(3000)))
    p.write_bytes(data[: len(data) // 2])
    r = cli("preview", str(p), "-n", "100000", "--no-color")
    assert r.exit_code == 0, r.output
    assert "REFUSED corrupt_input" in r.output and "cut.jsonl.gz is corrupt or truncated" in r.output


# ------------------------------------------------------------------------------------------------
# Cause 17: the seed, checked once


@pytest.mark.parametrize("args", [["estimate"], ["pack", "--estimate", "-o", "OUT"], ["preview"], ["pack", "-o", "OUT"]])
def test_negative_seed_is_one_error(tmp_path, args):
    args = [a.replace("OUT", str(tmp_path / "o")) for a in args]
    one_error(cli(*args, "--seed", "-1"), "--seed -1 must be an integer within 0..")
    with pytest.raises(PackstreamError, match="--seed"):
        PackOptions(inputs=("x",), seed=2**64)


# ------------------------------------------------------------------------------------------------
# Names the file system gives as bytes that are not UTF-8 (surrogate escapes in Python): a traceback from
# the first hash or Arrow write of the name, now one error naming the path and the fix.


def test_a_name_that_is_not_utf8_is_one_error(tmp_path):
    line = b'{"instruction": "q", "output": "a"}\n'
    try:
        odd = tmp_path / os.fsdecode(b"caf\xe9.jsonl")
        odd.write_bytes(line)
        folder = tmp_path / os.fsdecode(b"d\xff")
        folder.mkdir()
        (folder / "ok.jsonl").write_bytes(line)
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses names that are not UTF-8")
    good = tmp_path / "good.jsonl"
    good.write_bytes(line)
    for args in (["pack", str(odd), "-o", str(tmp_path / "o1")], ["pack", str(tmp_path), "-o", str(tmp_path.parent / "o2")],
                 ["pack", str(folder), "-o", str(tmp_path / "o3")], ["preview", str(odd)], ["estimate", str(folder)]):
        one_error(cli(*args), "not valid UTF-8", "rename it")
    out = tmp_path / os.fsdecode(b"out\xff")
    one_error(cli("pack", str(good), "-o", str(out)), "--output", "not valid UTF-8")
    assert not out.exists()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(st.binary(min_size=1, max_size=12).filter(lambda b: b"/" not in b and b"\0" not in b
                                                                  and b not in (b".", b"..")), min_size=1, max_size=3))
def test_any_file_names_list_as_utf8_or_refuse_in_one_line(tmp_path_factory, names):
    """Whatever bytes the file system gives as names, the inputs listed carry UTF-8 paths and source names (what
    ids, the manifest and Arrow store), or the listing refuses with a PackstreamError."""
    folder = tmp_path_factory.mktemp("names")
    for k, name in enumerate(dict.fromkeys(names)):
        try:
            (folder / os.fsdecode(name + b".jsonl")).write_bytes(b'{"text": "%d"}\n' % k)
        except (OSError, UnicodeError):
            return  # a name this file system refuses
    try:
        files = _read.expand_inputs((str(folder),))
    except PackstreamError as e:
        assert "\n" not in str(e)
        return
    for f in files:
        assert f.path.encode("utf-8") and f.source.encode("utf-8")  # UnicodeEncodeError: a name Arrow cannot store


# ------------------------------------------------------------------------------------------------
# The byte-level fuzz


@dataclasses.dataclass
class Corpus:
    data: bytes
    clean: dict[Any, dict]
    """Position (JSONL: line number; JSON: index) -> the record, for every record left undamaged."""
    damaged: set
    """Positions that must be refused (the rest of the damaged ones may be packed or refused)."""
    items: int
    """Non-blank lines (JSONL) or items (JSON) that must come out once each."""
    breaks_after: Any = None
    """JSON cut short: the last position before the break (None: the file is whole)."""


def _text(rng: random.Random, i: int) -> str:
    return f"record {i}: " + " ".join(rng.choice(["alpha", "beta", "gamma", "ω", "中文", "x,y", "[z]", "{q}"])
                                      for _ in range(rng.randrange(1, 12)))


def _damage(rng: random.Random, i: int, structural: bool) -> tuple[bytes, bool]:
    """A damaged record and whether it must be refused. ``structural``: the damage may touch line ends
    and quotes (JSONL); otherwise it stays inside a string value (JSON items keep their bounds)."""
    text = json.dumps({"text": _text(rng, i)}).encode()
    kind = rng.choice(["huge", "deep", "nul", "utf8", "flip", "cut"] if structural else ["huge", "deep", "nul", "utf8", "flip"])
    if kind == "huge":
        return text[:-1] + b', "n": ' + HUGE + b"}", True
    if kind == "deep":
        d = rng.choice([MAX_JSON_DEPTH + 1, 3000, 20_000])
        return text[:-1] + b', "d": ' + b"[" * d + b"]" * d + b"}", True
    if kind == "nul":
        return text[:11] + b"\x00" + text[11:], True  # a raw control byte inside a string: not JSON
    if kind == "utf8":
        return text[:11] + rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80"]) + text[11:], True
    if kind == "flip":  # may still be a valid record: not required to be refused
        k = rng.randrange(len(text)) if structural else rng.randrange(10, len(text) - 2)
        banned = b"" if structural else b'"\\'
        new = rng.choice([b for b in range(256) if b not in banned])
        return text[:k] + bytes([new]) + text[k + 1:], False
    return text[: rng.randrange(1, len(text) - 1)], True  # cut short


def jsonl_corpus(seed: int, n: int = 150) -> Corpus:
    rng = random.Random(seed)
    segments: list[tuple[bytes, Any]] = []  # (bytes with their line end, clean record or a damage flag)
    for i in range(n):
        end = rng.choice([b"\n", b"\r\n", b"\r"])
        if rng.random() < 0.05:
            segments.append((rng.choice([b"", b" ", b"\t "]) + end, "blank"))
        if rng.random() < 0.25:
            raw, must = _damage(rng, i, structural=True)
            segments.append((raw + end, "must" if must else "may"))
        else:
            rec = {"text": _text(rng, i)}
            if rng.random() < 0.1:
                rec = {"id": 2**70 + i, **rec}  # beyond 64 bits: exact ids or a collision
            segments.append((json.dumps(rec, ensure_ascii=rng.random() < 0.5).encode() + end, rec))
    if rng.random() < 0.3:  # the file breaks off mid-line
        raw, _ = segments[-1]
        segments[-1] = (raw[: max(1, len(raw) // 2)], "may")
    data = b"\xef\xbb\xbf" if rng.random() < 0.2 else b""
    clean, damaged = {}, set()
    parts, ends = [data], 0
    for raw, what in segments:
        line = ends + 1  # the truth: the line each segment starts (line ends counted by a regular expression)
        ends += len(re.findall(rb"\r\n|\r|\n", raw)) - (parts[-1].endswith(b"\r") and raw.startswith(b"\n"))
        parts.append(raw)
        if isinstance(what, dict):
            clean[line] = what
        elif what == "must":
            damaged.add(line)
    data = b"".join(parts)
    assert ends == len(re.findall(rb"\r\n|\r|\n", data))
    return Corpus(data, clean, damaged, len(truth_lines(data)))


def json_corpus(seed: int, n: int = 80) -> Corpus:
    rng = random.Random(seed)
    items, clean, damaged = [], {}, set()
    for i in range(n):
        if rng.random() < 0.25:
            raw, must = _damage(rng, i, structural=False)
            if must:
                damaged.add(i)
        else:
            rec = {"text": _text(rng, i)}
            if rng.random() < 0.1:
                rec = {"id": 2**70 + i, **rec}
            raw = json.dumps(rec, indent=rng.choice([None, 1])).encode()
            clean[i] = rec
        items.append(raw)
    ws = [b"\n", b"\r\n", b"\r", b" ", b"\t", b""]
    data = b"\xef\xbb\xbf" if rng.random() < 0.2 else b""
    data += b"[" + b"".join(raw + rng.choice(ws) + (b"," if k < n - 1 else b"]") + rng.choice(ws)
                            for k, raw in enumerate(items))
    breaks = None
    if rng.random() < 0.3:  # truncate inside item k: items before it are read, then one corrupt_input
        k = rng.randrange(1, n)
        start = data.index(items[k], len(b"[" + b"".join(items[:k])))
        data = data[: start + rng.randrange(1, len(items[k]))]
        clean = {i: r for i, r in clean.items() if i < k}
        damaged = {i for i in damaged if i < k}
        breaks, n = k - 1, k
    return Corpus(data, clean, damaged, n, breaks)


def check_reader(c: Corpus, kind: str, got: list) -> None:
    """What the readers gave for a corpus, against the truth."""
    if c.breaks_after is not None:
        assert got[-1] == ("corrupt", c.breaks_after)
        got = got[:-1]
    positions = [pos for pos, _ in got]
    assert len(positions) == len(set(positions)) == c.items, (len(positions), c.items)
    records = dict(got)
    for pos, rec in c.clean.items():
        assert records.get(pos) == rec, (pos, records.get(pos), rec)
    for pos in c.damaged:
        assert isinstance(records[pos], Rejected), (pos, records[pos])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), task=st.sampled_from([64, 500, 2048, 1 << 20]))
def test_fuzz_jsonl_reader(tmp_path_factory, seed, task):
    c = jsonl_corpus(seed)
    p = tmp_path_factory.mktemp("fuzz") / "f.jsonl"
    p.write_bytes(c.data)
    check_reader(c, "jsonl", read_all(p, "jsonl", task_bytes=task))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_fuzz_json_reader(tmp_path_factory, seed):
    c = json_corpus(seed)
    p = tmp_path_factory.mktemp("fuzz") / "f.json"
    p.write_bytes(c.data)
    check_reader(c, "json", read_all(p, "json"))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fuzz_through_the_job(tmp_path, monkeypatch, seed):
    """The corpora of one seed, packed by the real job in tasks of 1 KiB; verify --inputs reconciles."""
    from pipeline import run
    from tests._internals import _tasks, example_id, verify
    from tests.test_verify import read_rows

    monkeypatch.setattr(_tasks, "TASK_BYTES", 1024)
    data = tmp_path / "in"
    data.mkdir()
    corpora = {"a.jsonl": jsonl_corpus(seed, 300), "b.json": json_corpus(seed, 120)}
    for name, c in corpora.items():
        (data / name).write_bytes(c.data)
    assert len(_read.cut_tasks(_read.InputFile(str(data / "a.jsonl"), "a.jsonl", "jsonl"))) > 10
    out = tmp_path / "out"
    manifest = run(PackOptions(inputs=(str(data),), output=str(out), max_tokens=256, num_shards=2))
    packed = {eid for row in read_rows(out) for eid in row["example_ids"]}
    dead = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    by_place = {(d["source"], d["position"]): d for d in dead}
    for name, c in corpora.items():
        for pos, rec in c.clean.items():
            assert example_id(name, pos, rec) in packed, (name, pos, rec)
        for pos in c.damaged:
            assert (name, pos) in by_place, (name, pos)
        if c.breaks_after is not None:
            assert by_place[(name, c.breaks_after + 1)]["reason"] == "corrupt_input"
    counts = manifest["counts"]
    assert counts["records_read"] == sum(c.items + (c.breaks_after is not None) for c in corpora.values())
    assert counts["examples_packed"] + sum(counts["rejected_by_reason"].values()) == counts["records_read"]
    report = verify(str(out), (), announce=lambda _: None)
    assert report.ok, [str(p) for p in report.problems]


# ------------------------------------------------------------------------------------------------
# No way around the checked open


OPENERS = {"open", "io.open", "os.open", "gzip.open", "bz2.open", "lzma.open", "FileSystems.open", "pa.memory_map",
           "pa.OSFile", "Tokenizer.from_file", "_fs.open"}  # pipeline._fs.open: io.open locally, Beam's remotely
ALLOWED: dict[tuple[str, str], str] = {
    # (module, function) -> why a raw open is right there
    ("packers/files.py", "open_checked"): "the checked open itself",
    ("packers/files.py", "open_beneath"): "the checked open under a root (media files): one folder at a time, no links",
    ("pipeline/_fs.py", "open"): "the file system door (local io.open, else Beam's FileSystems): the remote opener "
                                 "handed to open_checked, and the reader of files a run wrote itself",
    ("pipeline/_render.py", "<module>"): "the built-in template, a package resource",
    ("packers/_attention/_fixes.py", "refuse"): "transformers' own installed source",
    ("pipeline/_sink.py", "create"): "the writer: every file a run writes under its output (tests/test_write_faults.py)",
    ("pipeline/_output.py", "_remote_create_exclusive"): "a writer",
    ("pipeline/_job/_commit.py", "_record_outcome"): "a writer: the run's outcome file",
    ("pipeline/_job/_launch.py", "_read_outcome"): "the outcome file this run wrote in its own temp folder",
    ("pipeline/_progress.py", "_write"): "a writer: progress files",
    ("pipeline/_progress.py", "read_counts"): "the progress files this run wrote in its spill folder",
    ("pipeline/_spill.py", "_read_batch"): "the spill files this run wrote",
    ("pipeline/_trace.py", "span"): "a writer: trace spans (PACKSTREAM_TRACE, opt-in)",
    ("pipeline/_trace.py", "read"): "the trace files this run's processes wrote (bench_scale)",
    ("pipeline/_output.py", "boot_id"): "the kernel's /proc/sys/kernel/random/boot_id (a stale lock's restart check)",
    ("pipeline/_output.py", "process_start"): "the kernel's /proc/PID/stat (a lock's process start time)",
    ("pipeline/_workers/signals.py", "_fire"): "a writer: the seeded signal point's marker (tests only)",
    ("pipeline/_workers/signals.py", "mute"): "os.devnull, for a stopping process's stderr",
    ("pipeline/_write.py", "beam_open"): "the remote opener packers.files' checked open calls (Beam's FileSystems)",
    ("pipeline/_tools/inspect.py", "mark"): "a writer: the marker of the plots folder inspect owns",
    ("pipeline/_tools/estimate.py", "_timed_pack"): "a writer: the timed sample pack's inputs, in its temporary folder",
    ("packers/_preference_trainer.py", "_write_json"): "a writer: the loader state and reference table in a "
                                                        "Trainer checkpoint folder",
    ("packers/_trainer_settings.py", "main"): "a writer: the trainer settings table into docs/loader.md (a "
                                             "maintainer's command, python -m packers._trainer_settings)",
    ("pipeline/_tools/inspect.py", "_file_sha256"): "the plots inspect wrote itself, in the folder its marker owns",
    # Output folders (manifests, shards, dead letters, locks): issue 16's folder side (16B, 16C)
    # moves these behind packers.files; each one leaves this list when it does.
    ("packers/_folder.py", "_read_schema"): "16B",
    ("pipeline/_tools/inspect.py", "__init__"): "16B",
    ("pipeline/_output.py", "_read_lock"): "16C",
    ("pipeline/_tools/verify/_shards.py", "parse"): "16B",
    ("pipeline/_read/_packed.py", "_open"): "16B: a listed shard, memory-mapped once its size and sha256 agree with "
                                            "the manifest (as verify's parse)",
    ("pipeline/_write.py", "lines"): "16B",
}


def _raw_opens() -> set[tuple[str, str]]:
    found = set()
    for pkg in ("pipeline", "packers"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text())
            funcs = [(n, n.name) for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            owner: dict[int, str] = {}
            for fn, name in sorted(funcs, key=lambda t: t[0].lineno):  # innermost function wins (walked later)
                for sub in ast.walk(fn):
                    owner[id(sub)] = name
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = ast.unparse(node.func)
                if name in OPENERS or name.endswith((".FileSystems.open", ".memory_map", ".read_text")):
                    found.add((rel, owner.get(id(node), "<module>")))
    return found


def test_no_raw_open_of_a_user_named_file():
    found = _raw_opens()
    unlisted = sorted(found - set(ALLOWED))
    assert not unlisted, f"raw opens outside packers.files: {unlisted}; use open_checked/read_checked, or list a writer"
    stale = sorted(set(ALLOWED) - found)
    assert not stale, f"listed but no raw open there any more: {stale}; remove them from ALLOWED"


@pytest.mark.parametrize("pattern", ["data", "data/", "data/*"])
def test_every_file_a_folder_or_glob_names_is_read_or_said(tmp_path, monkeypatch, pattern):
    # data/a.jsonl and data/b.csv are read; data/notes.txt (text beside other data: notes, not documents),
    # data/sub/README.md and data/LICENSE are not, each said with its reason (the manifest's inputs_skipped);
    # hidden names (.cache) are left out, as before (issue 35)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "data" / "b.csv").write_text("text\nx\n")
    for name in ("notes.txt", "sub/README.md", "LICENSE", ".cache"):
        (tmp_path / "data" / name).write_text("x\n")
    files, _, skipped = _read.expand_datasets(PackOptions(inputs=(pattern,), output="out").datasets())
    assert [f.source for f in files] == ["a.jsonl", "b.csv"]
    said = {s.source: s.reason for s in skipped}
    formats = "(JSONL, JSON, CSV, TSV, text, Parquet, Arrow)"
    want = {"data/LICENSE": f"skipped: a name without an extension is not a supported input format {formats}",
            "data/notes.txt": "skipped: a .txt file beside other data is taken for notes, not read; name it, or a glob "
                              "such as 'DIR/*.txt', as an input to read it as text",
            "data/sub/README.md": f"skipped: .md is not a supported input format {formats}"}
    if pattern == "data/*":  # a glob does not walk into sub/ (and a folder it matches is not an input file)
        del want["data/sub/README.md"]
    assert said == want


@pytest.mark.parametrize("pattern", ["data/notes.txt", "data/*.txt", "texts", "texts/*"])
def test_text_files_are_read_when_named_or_alone(tmp_path, monkeypatch, pattern):
    # A .txt file is read as text when the input names it, when a glob names .txt files, or when its folder (or
    # glob) holds text files only; beside other data it is notes (the test above).
    monkeypatch.chdir(tmp_path)
    for folder in ("data", "texts"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "notes.txt").write_text("a document\n")
    (tmp_path / "data" / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "texts" / "more.txt").write_text("another\n")
    files, _, skipped = _read.expand_datasets(PackOptions(inputs=(pattern,), output="out", text_split="paragraph").datasets())
    assert files and all(f.kind == "text" and f.text_split == "paragraph" for f in files) and not skipped


