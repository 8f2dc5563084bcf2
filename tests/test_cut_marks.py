"""The rows' ``cuts`` column (contract version 9): a mark ``[pieces, length]`` on every sequence a run cut.

Worked examples through ``pipeline.run`` (--long truncate, --long split), the pair path, examples that arrive already
cut (a repack's), a property over random lengths, budgets and policies, a version-6 folder that still loads, and
tampered marks refused by the loader's row checks and by ``packstream verify``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import packers
from packers import ContractError, LongPolicy, PackedDataset, Sampling, validate_row
from packers.rowcheck import check_batch, gather
from packers.manifest import RowChecks
from pipeline import PackOptions, run
from tests._internals import ExampleBatch, pack_group, verify
from tests._shards import make_row, random_examples, write_manifest, write_shards


def _rows(folder) -> list[dict]:
    out = []
    for p in sorted(Path(folder).glob("*.arrow")):
        with pa.memory_map(str(p)) as src:
            out += pa.ipc.open_stream(src).read_all().to_pylist()
    return out


def _sequences(rows: list[dict]) -> dict[str, tuple[list[int], list[int]]]:
    """Example id -> (its tokens, its mark)."""
    out = {}
    for r in rows:
        offs, cuts = r["seq_offsets"], r["cuts"] or [0, 0] * (len(r["seq_offsets"]) - 1)
        for j, eid in enumerate(r["example_ids"]):
            out[eid] = (r["input_ids"][offs[j]:offs[j + 1]], cuts[2 * j:2 * j + 2])
    return out


# -- worked examples: one long text record and a short one, budget 256 ------------------------------------------------


@pytest.fixture(scope="module")
def long_input(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("in") / "in.jsonl"
    src.write_text(json.dumps({"text": " ".join(f"word{i}" for i in range(300))}) + "\n"
                   + json.dumps({"text": "short one"}) + "\n")
    return src


@pytest.fixture(scope="module")
def packed(long_input, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    out = {}
    for long in ("truncate", "split"):
        folder = tmp_path_factory.mktemp(long) / "out"
        out[long] = folder, run(PackOptions(inputs=(str(long_input),), output=str(folder), max_tokens=256,
                                            long=LongPolicy(long)))
    return out


def test_truncate_and_split_mark_the_long_record(packed):
    # in.jsonl@1 is N tokens (N > 256, the same in both runs); in.jsonl@2 is 3 tokens, whole: [0, 0].
    #   --long truncate:  in.jsonl@1     its first 256 tokens     [1, N]
    #   --long split:     in.jsonl@1#k   tokens [256k, 256k+256)  [ceil(N / 256), N] each, k = 0, 1, 2
    t_folder, t_manifest = packed["truncate"]
    s_folder, s_manifest = packed["split"]
    split = _sequences(_rows(s_folder))
    pieces = [split[f"in.jsonl@1#{k}"] for k in range(3)]
    whole = [t for tokens, _ in pieces for t in tokens]
    n = len(whole)
    assert n > 2 * 256 and f"in.jsonl@1#3" not in split
    assert [mark for _, mark in pieces] == [[3, n]] * 3 and [len(t) for t, _ in pieces] == [256, 256, n - 512]
    assert split["in.jsonl@2"][1] == [0, 0]
    trunc = _sequences(_rows(t_folder))
    assert trunc["in.jsonl@1"] == (whole[:256], [1, n])  # the right-truncated window: the first 256 tokens
    assert trunc["in.jsonl@2"][1] == [0, 0]
    # The run counted what it placed; verify holds the marks against it.
    assert t_manifest["contract_version"] == s_manifest["contract_version"] == 9
    assert t_manifest["counts"]["cut_sequences"] == {"truncated": 1, "pieces": 0, "carried": 0}
    assert s_manifest["counts"]["cut_sequences"] == {"truncated": 0, "pieces": 3, "carried": 0}
    assert (t_manifest["counts"]["truncated_examples"], s_manifest["counts"]["split_examples"]) == (1, 1)
    for folder in (t_folder, s_folder):
        report = verify(str(folder), announce=lambda line: None)
        assert report.ok, [str(p) for p in report.problems]


def test_a_row_of_whole_sequences_has_empty_cuts(packed):
    # The row holding only in.jsonl@2 (truncate run: the long one fills its own row) has cuts [].
    rows = _rows(packed["truncate"][0])
    assert [r["cuts"] for r in rows if r["example_ids"] == ["in.jsonl@2"]] == [[]]


def test_the_loader_reads_version_9_rows_as_before(packed):
    folder = packed["split"][0]
    ds = PackedDataset(folder, sampling=Sampling(shuffle=False))
    fetched = ds.fetch(np.arange(len(ds.rows)))
    assert sorted(e for r in fetched for e in r["example_ids"]) == sorted(_sequences(_rows(folder)))
    assert all("cuts" not in r for r in fetched)  # the marks are metadata for tools: the Collator's rows are unchanged
    packers.Collator()(fetched)


def test_tampered_marks_are_refused_by_verify(packed, tmp_path):
    import shutil

    folder = tmp_path / "out"
    shutil.copytree(packed["split"][0], folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["counts"]["cut_sequences"]["pieces"] = 2
    (folder / "manifest.json").write_text(json.dumps(manifest))
    found = [str(p) for p in verify(str(folder), announce=lambda line: None).problems]
    assert len(found) == 1 and found[0].startswith("manifest.json counts.cut_sequences: says 0 truncated sequences and "
                                                   "2 split pieces, the shards' cuts marks 0 and 3 "
                                                   "(train-00000-of-00001.arrow holds 0 truncated, 3 pieces)"), found
    assert "restore the folder or re-run packstream pack" in found[0]


# -- the pure path: pack_group on hand-made batches -------------------------------------------------------------------


def _options(budget: int, long: str = "truncate", **kw) -> PackOptions:
    return PackOptions(inputs=("x.jsonl",), output="unused", max_tokens=budget, long=LongPolicy(long), **kw)


def _batch(lengths, *, targets=None, marks=None, cuts=None, desirable=None) -> ExampleBatch:
    """Examples ``s@0, s@1, ...``: token ``t`` of example ``i`` is ``1000 * i + t`` (so a window says where it came
    from); every token a target unless ``targets`` gives each example's mask."""
    lengths = np.asarray(lengths, np.int64)
    tokens = np.concatenate([1000 * i + np.arange(n) for i, n in enumerate(lengths)]) if len(lengths) else np.zeros(0)
    mask = np.concatenate(targets) if targets is not None else np.ones(int(lengths.sum()), np.uint8)
    return ExampleBatch.from_arrays([f"s@{i}" for i in range(len(lengths))], ["s"] * len(lengths),
                                    list(range(len(lengths))), lengths, tokens, mask, cuts,
                                    desirable=desirable).with_marks(marks)


def _placed(group) -> dict[str, tuple[list[int], list[int]]]:
    return _sequences(pa.Table.from_batches(list(group.chunks)).to_pylist())


def test_pairs_truncation_marks_each_cut_side():
    # Pair 0: prompt 2, chosen completion 8, rejected 3: 10 + 5 = 15 > budget 12. truncate_pairs cuts both
    # completions at L = 12 - 2 * 2 - 3 = 5: chosen keeps 2 + 5 = 7 of 10 -> [1, 10]; rejected keeps all 5 -> [0, 0].
    # Pair 1 (2 + 2 tokens) fits: whole.
    prompt = np.array([1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0], np.uint8) ^ 1  # 0 on the prompts, 1 on completions
    pair1 = np.array([0, 1, 0, 1], np.uint8)
    batch = _batch([15, 4], targets=[prompt, pair1], cuts=np.array([10, 2]))
    group = pack_group(batch, _options(12, pairs=True), eos_id=None)
    seqs = _placed(group)
    assert seqs["s@0#chosen"] == (list(range(7)), [1, 10])
    assert seqs["s@0#rejected"][1] == [0, 0] and len(seqs["s@0#rejected"][0]) == 5
    assert seqs["s@1#chosen"][1] == seqs["s@1#rejected"][1] == [0, 0]
    # A truncated pair counts once (truncated_examples), its cut sides each (cut_truncated).
    assert (group.stats["truncated_examples"], group.stats["cut_truncated"], group.stats["cut_pieces"]) == (1, 1, 0)
    for r in pa.Table.from_batches(list(group.chunks)).to_pylist():  # (these made-up sides hold different prompts)
        packers.schema.validate_cuts(r)


def test_an_example_that_arrives_cut_keeps_its_mark():
    # Budget 8. s@0: a 5-token window of a 19-token example truncated earlier [1, 19]: fits, kept as is.
    # s@1: a 12-token window [1, 30], still too long: truncated again to 8, keeping [1, 30].
    # s@2: an earlier split's piece [3, 40] of 10 tokens: never cut again, dropped as too_long.
    # s@3: 4 tokens, whole.
    marks = np.array([[1, 19], [1, 30], [3, 40], [0, 0]], np.int32)
    batch = _batch([5, 12, 10, 4], marks=marks)
    group = pack_group(batch, _options(8), eos_id=None)
    seqs = _placed(group)
    assert {e: m for e, (_, m) in seqs.items()} == {"s@0": [1, 19], "s@1": [1, 30], "s@3": [0, 0]}
    assert seqs["s@1"][0] == [1000 + t for t in range(8)]
    [dead] = group.rejected
    assert dead["example_id"] == "s@2" and dead["reason"] == "too_long"
    assert "a piece of an example split at an earlier pack" in dead["detail"] and "pack the raw inputs" in dead["detail"]
    assert (group.stats["cut_truncated"], group.stats["cut_carried"], group.stats["truncated_examples"]) == (2, 2, 1)
    # --long split never splits a window truncated earlier (its pieces' marks could not say both cuts).
    split = pack_group(batch, _options(8, "split"), eos_id=None)
    assert sorted(r["example_id"] for r in split.rejected) == ["s@1", "s@2"]


def test_concat_fills_marks_of_a_batch_without():
    a, b = _batch([3]), _batch([4], marks=np.array([[1, 9]], np.int32))
    assert ExampleBatch.concat([a, b]).marks.tolist() == [[0, 0], [1, 9]]
    assert ExampleBatch.concat([a, a]).marks is None
    assert ExampleBatch.concat([a, b]).take([1]).marks.tolist() == [[1, 9]]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(1, 60), min_size=1, max_size=8), st.integers(8, 24),
       st.sampled_from(["drop", "truncate", "split"]), st.sampled_from(["right", "left"]), st.randoms())
def test_every_mark_says_how_its_tokens_were_cut(lengths, budget, long, side, rnd):
    targets = [np.array([rnd.random() < 0.7 for _ in range(n)], np.uint8) for n in lengths]
    for t in targets:
        t[rnd.randrange(len(t))] = 1  # every example has a target (the encoder rejects one without)
    batch = _batch(lengths, targets=targets)
    group = pack_group(batch, _options(budget, long, truncate_side=side), eos_id=None)
    rows = pa.Table.from_batches(list(group.chunks)).to_pylist()
    for r in rows:
        validate_row(r, budget=budget)
    assert check_batch(gather(pa.Table.from_batches(list(group.chunks)), check=True), RowChecks(
        budget=budget, eos_token_id=None, eos_at_boundaries=False, targets_in_every_sequence=False,
        all_targets=False, pairs=False)) is None
    kept: dict[int, int] = {}
    for eid, (tokens, (p, n)) in _sequences(rows).items():
        base, _, k = eid.partition("#")
        i = int(base.split("@")[1])
        whole = (1000 * i + np.arange(lengths[i])).tolist()
        if p == 0:  # whole: its own tokens, no piece suffix
            assert (n, k, tokens) == (0, "", whole) and lengths[i] <= budget
        elif p == 1:  # truncated: an N-long example's budget-long prefix (right) or suffix (left)
            assert long == "truncate" and (n, k) == (lengths[i], "") and len(tokens) == budget < n
            assert tokens == (whole[:budget] if side == "right" else whole[-budget:])
        else:  # piece k of ceil(N / budget)
            assert long == "split" and n == lengths[i] and p == -(-n // budget) and int(k) < p
            assert tokens == whole[int(k) * budget:(int(k) + 1) * budget]
            kept[i] = kept.get(i, 0) + len(tokens)
    # The kept pieces and the no-target pieces dropped together hold every token of each split example.
    split = [i for i, n in enumerate(lengths) if n > budget] if long == "split" else []
    assert sum(kept.values()) + group.stats.get("no_target_piece_tokens", 0) == sum(lengths[i] for i in split)
    assert group.stats["cut_truncated"] == group.stats.get("truncated_examples", 0)
    assert len(kept) == group.stats.get("split_examples", 0) and group.stats["cut_carried"] == 0


# -- rows written by hand: version 6, and tampered marks ----------------------------------------------------------------


def test_a_version_6_folder_still_loads_and_verifies(tmp_path):
    folder = tmp_path / "v6"
    examples = random_examples(12, max_len=10)
    rows = [make_row(examples[3 * s:3 * s + 3]) for s in range(4)]
    write_shards(folder, rows, budget=64, contract_version=6)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["contract_version"] == 6 and "cut_sequences" not in manifest["counts"]
    with pa.memory_map(str(next(folder.glob("*.arrow")))) as src:
        assert pa.ipc.open_stream(src).schema.remove_metadata().equals(packers.SCHEMA_V6)
    ds = PackedDataset(folder, sampling=Sampling(shuffle=False))
    assert [r["example_ids"] for r in ds.fetch(np.arange(4))] == [r["example_ids"] for r in rows]
    report = verify(str(folder), announce=lambda line: None)
    assert report.ok, [str(p) for p in report.problems]


def _one_cut_row(cuts, ids=("t@9#2", "a:1")) -> dict:
    # Two sequences of 3 and 2 tokens: a piece of a split example and a whole one.
    return {**make_row([random_examples(1, seed=1, min_len=3, max_len=3)[0], random_examples(1, seed=2, min_len=2,
                                                                                              max_len=2)[0]]),
            "example_ids": list(ids), "cuts": list(cuts)}


@pytest.mark.parametrize("cuts,ids,words", [
    ([3, 19, 0, 0], ("t@9#2", "a:1"), None),  # good: piece 2 of 3 of a 19-token example, then a whole one
    ([-1, -1, 0, 0], ("t@9#2", "a:1"), None),  # good: an older split's piece
    ([3, 19], ("t@9#2", "a:1"), "holds 2 values for 2 sequences"),
    ([3, 19, 0, 5], ("t@9#2", "a:1"), "a whole sequence (pieces 0) has length 0"),
    ([1, 3, 0, 0], ("t@9#2", "a:1"), "says it was cut from 3 tokens, but it holds 3"),
    ([3, 19, 0, 0], ("t@9#3", "a:1"), "its id does not end with #k, k < 3"),
    ([3, 19, 0, 0], ("t@9", "a:1"), "its id does not end with #k"),
    ([-2, 19, 0, 0], ("t@9#2", "a:1"), "pieces is -2"),
    ([2, -1, 0, 0], ("t@9#1", "a:1"), "length -1 goes only with pieces -1"),
])
def test_marks_checked_by_validate_row_the_loader_and_verify(tmp_path, cuts, ids, words):
    row = _one_cut_row(cuts, ids)
    checks = RowChecks(budget=16, eos_token_id=None, eos_at_boundaries=False, targets_in_every_sequence=False,
                       all_targets=False, pairs=False)
    folder = tmp_path / "out"
    write_shards(folder, [row, make_row(random_examples(2, seed=5, max_len=6))], budget=16)
    table = pa.Table.from_pylist([{**row, "num_tokens": 5}], schema=packers.SCHEMA)
    failure = check_batch(gather(table, check=True), checks)
    found = [str(p) for p in verify(str(folder), announce=lambda line: None).problems]
    if words is None:
        validate_row(row, budget=16)
        assert failure is None and found == []
        return
    with pytest.raises(ContractError, match=words.replace("(", r"\(").replace(")", r"\)")):
        validate_row(row, budget=16)
    assert failure is not None and failure.check == "cuts" and words in failure.detail, failure
    with pytest.raises(ContractError, match="cuts"):
        PackedDataset(folder, sampling=Sampling(shuffle=False)).fetch([0])
    assert any("check cuts failed" in p and words in p for p in found), found


def test_verify_holds_marks_against_the_run_counts(tmp_path):
    # An honest manifest (tests._shards counts the marks it finds); then one that says the run truncated nothing.
    folder = tmp_path / "out"
    row = {**make_row(random_examples(2, seed=3, min_len=4, max_len=6)), "cuts": [1, 50, 0, 0]}
    row["example_ids"] = ["t@1", "t@2"]
    write_shards(folder, [row], budget=16)
    assert verify(str(folder), announce=lambda line: None).ok
    manifest = write_manifest(folder)
    manifest["counts"].update(truncated_examples=0)
    manifest["counts"]["cut_sequences"]["truncated"] = 0
    (folder / "manifest.json").write_text(json.dumps(manifest))
    found = [str(p) for p in verify(str(folder), announce=lambda line: None).problems]
    assert any(p.startswith("manifest.json counts.cut_sequences: says 0 truncated sequences") and
               "train-00000-of-00001.arrow holds 1 truncated, 0 pieces" in p for p in found), found
    assert any(p.startswith("manifest.json counts.truncated_examples: says 0 truncated and 0 split examples, the "
                            "shards' cuts marks 1 and 0") for p in found), found
