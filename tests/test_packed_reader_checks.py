"""The packed-folder reader (``pipeline._read.packed_examples``, what ``repack`` will stand on) runs the row contract's
checks on every row it reads (issue 52, part B4), the ones the loader runs on every batch it yields
(``packers.rowcheck.check_batch``: the contract and the manifest's ``row_checks``).

Before, a shard whose manifest entry agreed with its bytes (a buggy writer, a hand-edited folder resealed) was cut
into examples by whatever its ``seq_offsets`` said: offsets that run backwards gave empty or overlapping examples,
offsets past the end gave short ones, all without a word. Now a broken row is one ContractError naming the shard,
the row (and the sequence) and the broken check.

Each test packs a real folder (``pipeline.run``), breaks one row of one shard, and reseals the manifest (sizes, sha256
and counts agree with the files again), so that only the row checks stand between the broken row and the examples.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packers import ContractError
from pipeline import PackOptions, run
from tests._internals import packed_examples
from tests._shards import recount

WORDS = "alpha beta gamma delta seven nine Oslo cat chat".split()
BUDGET = 192


def _pack(folder: Path, records: list[dict], **opts) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    run(PackOptions(inputs=(str(src),), output=str(folder / "out"), max_tokens=BUDGET, validation_fraction=0.25,
                    workers=1, **opts))
    return folder / "out"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """120 short SFT examples (about 35 tokens each), packed at budget 192 into a train and a validation shard: each
    row holds about 5 examples."""
    records = [{"instruction": " ".join(WORDS[(i + k) % 9] for k in range(1 + i % 5)),
                "output": " ".join(WORDS[(2 * i + k) % 9] for k in range(1 + i % 4))} for i in range(120)]
    out = _pack(tmp_path_factory.mktemp("plain"), records)
    assert len(_shards(out)) == 2 and len(list(packed_examples(str(out)))) == 120  # the folder as packed reads whole
    return out


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    records = [{"prompt": " ".join(WORDS[i % 9: i % 9 + 2]), "chosen": " " + WORDS[i % 9],
                "rejected": " " + WORDS[-1 - i % 9]} for i in range(40)]
    out = _pack(tmp_path_factory.mktemp("pairs"), records, pairs=True)
    assert len(list(packed_examples(str(out)))) == 40
    return out


def _copy(folder: Path, tmp_path: Path) -> Path:
    work = Path(tmp_path) / "out"
    shutil.copytree(folder, work)
    return work


def _shards(folder: Path) -> list[str]:
    return [s["name"] for s in json.loads((folder / "manifest.json").read_text())["shards"] if s["rows"]]


def _read(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_stream(src).read_all()


def _break(folder: Path, shard: str, row: int, edit) -> dict:
    """``edit`` row ``row`` of ``shard`` (a dict of its columns, as lists), rewrite the shard as the writer does (one
    stream, its schema and metadata), then reseal the manifest as a buggy writer would: bytes, sha256, rows, tokens,
    examples and the counts agree with the files again. Returns the row as it was."""
    path = folder / shard
    table = _read(path)
    rows = table.to_pylist()
    before = json.loads(json.dumps(rows[row]))
    edit(rows[row])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(pa.Table.from_pylist(rows, schema=table.schema))
    m = json.loads((folder / "manifest.json").read_text())
    for s in m["shards"]:
        data, t = (folder / s["name"]).read_bytes(), _read(folder / s["name"])
        s.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), rows=t.num_rows,
                 tokens=sum(t.column("num_tokens").to_pylist()),
                 examples=sum(len(x) for x in t.column("example_ids").to_pylist()))
        s["target_tokens"] = min(s["target_tokens"], s["tokens"])
    m["counts"] = recount(m["counts"], m["shards"], m["row_checks"]["budget"])
    (folder / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    return before


def _refusal(folder: Path) -> str:
    with pytest.raises(ContractError) as e:
        list(packed_examples(str(folder)))
    message = str(e.value)
    assert "\n" not in message, message
    return message


# -- worked examples --------------------------------------------------------------------------------------------------


def test_offsets_that_run_backwards_are_refused_naming_shard_row_and_check(plain, tmp_path):
    work = _copy(plain, tmp_path)
    shard = _shards(work)[0]
    row = next(r for r, offs in enumerate(_read(work / shard).column("seq_offsets").to_pylist()) if len(offs) > 3)

    def backwards(r):  # e.g. [0, 9, 20, 31] -> [0, 20, 9, 31]: example 1 would be cut as tokens 20..9, nothing
        r["seq_offsets"][1], r["seq_offsets"][2] = r["seq_offsets"][2], r["seq_offsets"][1]

    before = _break(work, shard, row, backwards)
    a, b = before["seq_offsets"][1:3]
    assert _refusal(work) == (f"{work}/{shard} row {row}: check seq_offsets failed: seq_offsets must increase "
                              f"strictly: seq_offsets[1]={b}, seq_offsets[2]={a}; the shard is not what packstream "
                              f"pack wrote: restore the folder or re-run packstream pack")


def test_offsets_past_the_end_are_refused(plain, tmp_path):
    work = _copy(plain, tmp_path)
    shard = _shards(work)[-1]
    before = _break(work, shard, 0, lambda r: r["seq_offsets"].__setitem__(-1, r["seq_offsets"][-1] + 5))
    n = len(before["input_ids"])
    assert _refusal(work).startswith(f"{work}/{shard} row 0: check seq_offsets failed: seq_offsets must end at "
                                     f"len(input_ids)={n}, got {n + 5}; ")


def test_a_pair_whose_sides_are_swapped_is_refused(pairs, tmp_path):
    work = _copy(pairs, tmp_path)
    shard = _shards(work)[0]

    def swap(r):
        r["sides"][0], r["sides"][1] = r["sides"][1], r["sides"][0]

    _break(work, shard, 0, swap)
    message = _refusal(work)
    assert re.match(rf"{re.escape(str(work))}/{shard} row 0 sequence 0 \(.*#chosen\): check sides failed: side is 1, "
                    r"expected 0", message), message


# -- property test: generated corruptions of real folders -------------------------------------------------------------


def _interior(offs: list[int], draw) -> int | None:
    return draw(st.integers(1, len(offs) - 2)) if len(offs) > 2 else None


def _backwards(r, draw):
    offs = r["seq_offsets"]
    k = _interior(offs, draw)
    if k is None:
        r["seq_offsets"] = offs[::-1]  # [n, 0]: starts past 0
    elif draw(st.booleans()):
        offs[k] = offs[k - 1]  # an empty example
    else:
        offs[k] = offs[k - 1] - draw(st.integers(1, 5))  # runs backwards


def _past_end(r, draw):
    offs, d = r["seq_offsets"], draw(st.integers(1, 100))
    k = _interior(offs, draw)
    if k is None or draw(st.booleans()):
        offs[-1] += d
    else:
        offs[k] = offs[-1] + d


def _mask_value(r, draw):
    r["loss_mask"][draw(st.integers(0, len(r["loss_mask"]) - 1))] = draw(st.integers(2, 255))


def _mask_length(r, draw):
    if draw(st.booleans()):
        r["loss_mask"].pop()
    else:
        r["loss_mask"].append(0)


def _num_tokens(r, draw):
    r["num_tokens"] = max(0, r["num_tokens"] + draw(st.integers(-3, 3).filter(bool)))
    if r["num_tokens"] == len(r["input_ids"]):
        r["num_tokens"] += 1


def _num_targets(r, draw):
    r["num_targets"] = r["num_targets"] + draw(st.integers(1, 3))


def _example_ids(r, draw):
    if len(r["example_ids"]) > 1 and draw(st.booleans()):
        r["example_ids"].pop()
    else:
        r["example_ids"].append("in.jsonl@999")


def _over_budget(r, draw):
    extra = BUDGET + 1 - len(r["input_ids"]) + draw(st.integers(0, 8))
    r["input_ids"] += [r["input_ids"][-1]] * extra
    r["loss_mask"] += [1] * extra
    r["seq_offsets"][-1] = r["num_tokens"] = len(r["input_ids"])
    r["num_targets"] += extra


PLAIN = {  # corruption -> the checks that may name it (the first one that fails, in check_batch's order)
    "offsets backwards": (_backwards, {"seq_offsets"}),
    "offsets past the end": (_past_end, {"seq_offsets"}),
    "mask value": (_mask_value, {"loss_mask_values"}),
    "mask length": (_mask_length, {"loss_mask_length"}),
    "num_tokens": (_num_tokens, {"num_tokens"}),
    "num_targets": (_num_targets, {"num_targets"}),
    "example_ids": (_example_ids, {"example_ids"}),
    "over budget": (_over_budget, {"budget"}),
}


def _swap_sides(r, draw):
    j = 2 * draw(st.integers(0, len(r["sides"]) // 2 - 1))
    r["sides"][j], r["sides"][j + 1] = r["sides"][j + 1], r["sides"][j]


def _pair_id(r, draw):
    r["pair_ids"][draw(st.integers(0, len(r["pair_ids"]) - 1))] += "x"


def _span_out(r, draw):
    k = draw(st.integers(0, len(r["completion_spans"]) - 1))
    r["completion_spans"][k] = r["num_tokens"] + draw(st.integers(1, 9))


PAIRS = {
    "sides swapped": (_swap_sides, {"sides"}),
    "pair id changed": (_pair_id, {"pair_ids"}),
    "span moved out": (_span_out, {"completion_spans"}),
    "offsets backwards": (_backwards, {"seq_offsets"}),
    "mask value": (_mask_value, {"loss_mask_values"}),
}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["plain", "pairs"]), data=st.data())
def test_any_broken_row_is_one_line_naming_shard_row_and_check(plain, pairs, tmp_path_factory, which, data):
    folder, kinds = (plain, PLAIN) if which == "plain" else (pairs, PAIRS)
    work = _copy(folder, tmp_path_factory.mktemp("c"))
    shard = data.draw(st.sampled_from(_shards(work)))
    row = data.draw(st.integers(0, _read(work / shard).num_rows - 1))
    kind = data.draw(st.sampled_from(sorted(kinds)))
    edit, checks = kinds[kind]
    _break(work, shard, row, lambda r: edit(r, data.draw))
    message = _refusal(work)
    named = re.match(rf"{re.escape(str(work))}/{shard} row {row}( sequence \d+ \(.*\))?: check (\w+) failed: ", message)
    assert named and named.group(2) in checks, (kind, message)
    assert message.endswith("restore the folder or re-run packstream pack"), message
