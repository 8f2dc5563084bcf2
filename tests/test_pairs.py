"""Preference pairs below the encoder: packers.pack_pairs, the pipeline's pair rows, the contract's pair
columns (validate_row, the loader's vectorized checks, verify), and the Collator's pair outputs.

Worked examples first, then property tests over generated pairs: every pair whole in one row, its
sides adjacent and chosen first; spans covering exactly the completions; one prompt per pair; no row
over budget; every pair packed, dropped (with a dead letter) or a duplicate, exactly once.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import packers
from packers import ContractError, PackstreamError, Side, pack, pack_pairs, validate_row
from packers.manifest import RowChecks
from packers.rowcheck import Batch, check_batch, gather
from pipeline import PackOptions
from tests._internals import _rows, truncate_pairs
from tests._shards import Pair, make_pair_row, make_row, random_examples, random_pairs

PROPS = settings(max_examples=150, deadline=None)


# ---------------------------------------------------------------------------------------
# packers.pack_pairs: worked examples.


def test_a_pair_is_one_item():
    # Pairs of 6+5=11, 3+4=7, 2+2=4 tokens into rows of 12: BFD places 11 | 7 then 4 (11 tokens).
    # Sequences 2i, 2i+1 are pair i's chosen and rejected sides.
    r = pack_pairs([6, 3, 2], [5, 4, 2], budget=12)
    assert [row.tolist() for row in r.rows] == [[0, 1], [2, 3, 4, 5]]
    assert r.row_lengths.tolist() == [11, 11]
    assert r.num_examples == 6 and not len(r.dropped)


def test_a_pair_never_splits_across_rows():
    # Sequence lengths 7 and 7: each fits a row of 10 alone, the pair (14) does not. It is dropped, both
    # sides listed, rather than sent to two rows.
    r = pack_pairs([7, 2], [7, 3], budget=10)
    assert [row.tolist() for row in r.rows] == [[2, 3]]
    assert r.dropped.tolist() == [0, 1] and r.dropped_tokens == 14


def test_truncation_cuts_both_completions_at_one_length():
    # Prompt 2, completions 8 and 8, budget 12: room 12 - 2*2 = 8 for two completions -> 4 each.
    assert truncate_pairs(np.array([10]), np.array([10]), np.array([2]), 12).tolist() == [4]
    # Completions 8 and 2: the short one whole (2), the long one gets the rest (6): 2+6 + 2+2 = 12.
    r = pack_pairs([10], [4], budget=12, prompt=[2], long="truncate")
    assert r.stops.tolist() == [8, 4] and r.truncated.tolist() == [0] and r.truncated_tokens == 2
    # Two prompts of 6 leave no room for one completion token each: dropped.
    r = pack_pairs([8], [8], budget=12, prompt=[6], long="truncate")
    assert r.dropped.tolist() == [0, 1] and r.num_rows == 0


@pytest.mark.parametrize("kw,match", [
    (dict(long="split"), "cannot split a preference pair"),
    (dict(long="truncate"), "pass prompt="),
    (dict(max_per_row=1), "less than one pair"),
    (dict(prompt=[5, 1]), "pair 0: prompt of 5 tokens leaves no completion"),
])
def test_pack_pairs_refuses(kw, match):
    with pytest.raises(PackstreamError, match=match):
        pack_pairs([5, 3], [6, 9], budget=8, **kw)


def test_pack_pairs_refuses_mismatched_lengths():
    with pytest.raises(PackstreamError, match="2 chosen lengths for 1 rejected"):
        pack_pairs([5, 3], [6], budget=8)


# ---------------------------------------------------------------------------------------
# packers.pack_pairs: properties.


@st.composite
def pair_lengths(draw):
    n = draw(st.integers(0, 40))
    budget = draw(st.integers(4, 64))
    prompt = draw(st.lists(st.integers(1, 20), min_size=n, max_size=n))
    comp = st.integers(1, 40)
    c = [p + draw(comp) for p in prompt]
    r = [p + draw(comp) for p in prompt]
    return c, r, prompt, budget


@PROPS
@given(pair_lengths(), st.sampled_from(["bfd", "ffd", "next_fit", "padded"]), st.sampled_from(["drop", "truncate"]),
       st.one_of(st.none(), st.integers(2, 7)))
def test_every_pair_whole_adjacent_chosen_first(data, strategy, long, max_per_row):
    c, r, p, budget = data
    res = pack_pairs(c, r, budget, strategy, prompt=p, long=long, max_per_row=max_per_row)
    n = len(c)
    placed = res.order
    # sides adjacent, chosen first, never across a row boundary
    assert (placed[0::2] % 2 == 0).all() and (placed[1::2] == placed[0::2] + 1).all()
    assert (res.row_offsets % 2 == 0).all()
    assert (res.row_lengths <= budget).all() and (np.diff(res.row_offsets) > 0).all()
    if max_per_row is not None:
        assert (np.diff(res.row_offsets) <= max_per_row).all()
    # every pair placed once or dropped, never both
    pairs_placed = placed[0::2] // 2
    assert len(set(pairs_placed.tolist())) == len(pairs_placed)
    dropped = set((res.dropped // 2).tolist())
    assert dropped.isdisjoint(pairs_placed.tolist()) and len(dropped) + len(pairs_placed) == n
    assert sorted(res.dropped.tolist()) == sorted([2 * i for i in dropped] + [2 * i + 1 for i in dropped])
    c, r, p = np.array(c), np.array(r), np.array(p)
    kept_c, kept_r = res.stops[0::2], res.stops[1::2]
    i = pairs_placed
    if long == "drop":
        assert (kept_c == c[i]).all() and (kept_r == r[i]).all() and not len(res.truncated)
        assert sorted(dropped) == np.flatnonzero(c + r > budget).tolist()
    else:
        # both completions cut at one length L: a side is cut only to L, the longest that fits
        cc, rc = kept_c - p[i], kept_r - p[i]
        assert (cc >= 1).all() and (rc >= 1).all()
        L = np.maximum(cc, rc)
        assert ((cc == c[i] - p[i]) | (cc == L)).all() and ((rc == r[i] - p[i]) | (rc == L)).all()
        longer = (c[i] + r[i] > budget)
        over = p[i] + np.minimum(c[i] - p[i], L + 1) + p[i] + np.minimum(r[i] - p[i], L + 1)
        assert (over[longer & (L < np.maximum(c[i], r[i]) - p[i])] > budget).all()  # L + 1 would not fit
        assert sorted(dropped) == np.flatnonzero((c + r > budget) & (2 * p + 2 > budget)).tolist()
        assert res.truncated_tokens == int((c[i] - kept_c).sum() + (r[i] - kept_r).sum())


@PROPS
@given(pair_lengths())
def test_pairs_pack_like_their_summed_lengths(data):
    """The rows are pack()'s rows of the pairs' summed lengths: the same strategy, on items that are pairs."""
    c, r, _, budget = data
    items = pack(np.array(c, dtype=np.int64) + np.array(r, dtype=np.int64), budget)
    res = pack_pairs(c, r, budget)
    assert (res.order[0::2] // 2).tolist() == items.order.tolist()
    assert (res.row_offsets // 2).tolist() == items.row_offsets.tolist()


# ---------------------------------------------------------------------------------------
# The pipeline's rows of pairs.


EOS = 1


def pair_batch(pairs: list[Pair], *, eos: bool = True) -> _rows.ExampleBatch:
    """An encoded batch of pairs, as the encoder makes it: one example per pair (chosen tokens then rejected)."""
    ids, mask, lengths, cuts = [], [], [], []
    for p in pairs:
        sides = [s for s in p.sides()]
        if eos:
            sides = [dataclasses.replace(s, input_ids=s.input_ids + [EOS], loss_mask=s.loss_mask + [1]) for s in sides]
        for s in sides:
            ids += s.input_ids
            mask += s.loss_mask
        cuts.append(len(sides[0].input_ids))
        lengths.append(len(sides[0].input_ids) + len(sides[1].input_ids))
    return _rows.ExampleBatch.from_arrays([p.id for p in pairs], ["pairs.jsonl"] * len(pairs),
                                          list(range(len(pairs))), np.array(lengths, np.int64),
                                          np.array(ids, np.int32), np.array(mask, np.uint8), np.array(cuts))


def options(**kw) -> PackOptions:
    return PackOptions(inputs=("x.jsonl",), pairs=True, **{"max_tokens": 64, **kw})


def rows_of(group: _rows.Group) -> list[dict]:
    return pa.Table.from_batches([group.batch]).to_pylist()


def checks(budget: int, **kw) -> RowChecks:
    return RowChecks(budget=budget, eos_token_id=EOS, eos_at_boundaries=False, targets_in_every_sequence=True,
                     all_targets=False, pairs=True, **kw)


def test_pair_rows_worked_example():
    # Two pairs; prompt [5 9] on both sides of pair a, [7] on pair b; EOS (1) closes every side.
    pairs = [Pair("a", [5, 9], [41, 17], [30]), Pair("b", [7], [62, 63, 64], [18])]
    g = _rows.pack_group(pair_batch(pairs), options(max_tokens=32), EOS)
    (row,) = rows_of(g)  # 5 + 4 + 5 + 3 = 17 tokens: one row
    # BFD places the longer pair first: b (5 + 3 = 8 tokens) ... a (5 + 4 = 9) is longer: a first.
    assert row["example_ids"] == ["a#chosen", "a#rejected", "b#chosen", "b#rejected"]
    assert row["input_ids"] == [5, 9, 41, 17, 1, 5, 9, 30, 1, 7, 62, 63, 64, 1, 7, 18, 1]
    assert row["loss_mask"] == [0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1]
    assert row["seq_offsets"] == [0, 5, 9, 14, 17]
    assert row["pair_ids"] == ["a", "a", "b", "b"] and row["sides"] == [0, 1, 0, 1]
    assert row["completion_spans"] == [2, 5, 7, 9, 10, 14, 15, 17]
    assert row["num_targets"] == 11 and row["num_tokens"] == 17
    validate_row(row, 32)
    assert g.stats["examples_packed"] == 2 and g.stats["pieces"] == 4 and not g.rejected


def test_long_pairs_dead_lettered_once_or_truncated():
    pairs = [Pair("long", [5] * 4, [6] * 30, [7] * 20), Pair("ok", [5], [6], [7])]
    g = _rows.pack_group(pair_batch(pairs), options(max_tokens=32), EOS)
    assert [r["reason"] for r in g.rejected] == ["too_long"] and g.rejected[0]["example_id"] == "long"
    assert "a pair is never split" in g.rejected[0]["detail"] and g.stats["dropped_too_long"] == 1
    g = _rows.pack_group(pair_batch(pairs), options(max_tokens=32, long="truncate"), EOS)
    assert not g.rejected and g.stats["truncated_examples"] == 1
    rows = rows_of(g)
    for row in rows:
        validate_row(row, 32)
    long = next(r for r in rows if "long" in r["pair_ids"])
    j = long["pair_ids"].index("long")
    comp = [long["completion_spans"][2 * k + 1] - long["completion_spans"][2 * k] for k in (j, j + 1)]
    assert comp == [12, 12] and long["num_tokens"] >= 32 - 1  # room 32 - 2*4 = 24: 12 each


def test_pairs_options_refuse_what_cannot_hold():
    for kw, match in [(dict(long="split"), "--long split cannot split a preference pair"),
                      (dict(long="truncate", truncate_side="left"), "--truncate-side left does not apply"),
                      (dict(max_per_row=1), "less than one pair"),
                      (dict(train_on="all"), "--train-on all and --mask-reasoning do not apply")]:
        with pytest.raises(PackstreamError, match=match):
            options(**kw)


@st.composite
def pair_sets(draw):
    n = draw(st.integers(1, 30))
    seed = draw(st.integers(0, 2**16))
    pairs = random_pairs(n, seed=seed, max_prompt=draw(st.integers(1, 20)), max_completion=draw(st.integers(1, 40)))
    dup = draw(st.lists(st.integers(0, n - 1), max_size=3))
    pairs += [dataclasses.replace(pairs[i], chosen=pairs[i].chosen + [3]) for i in dup]  # same id again
    return pairs, draw(st.integers(16, 160)), draw(st.sampled_from(["drop", "truncate"]))


@PROPS
@given(pair_sets())
def test_pair_rows_properties(data):
    pairs, budget, long = data
    batch = pair_batch(pairs)
    g = _rows.pack_group(batch, options(max_tokens=max(budget, 8), long=long), EOS)
    budget = max(budget, 8)
    rows = rows_of(g)
    by_id = {}
    for p in pairs:
        by_id.setdefault(p.id, p)  # dedupe keeps the first (source, position)
    seen = []
    for row in rows:
        validate_row(row, budget)  # the contract: adjacency, chosen first, spans, one prompt, mask = spans
        offs, spans = row["seq_offsets"], row["completion_spans"]
        for j in range(0, len(offs) - 1, 2):
            pid = row["pair_ids"][j]
            p = by_id[pid]
            seen.append(pid)
            for k, completion in ((j, p.chosen + [EOS]), (j + 1, p.rejected + [EOS])):
                # the stored side is the prompt, then a prefix of its completion: exactly the span
                assert row["input_ids"][offs[k]:spans[2 * k]] == p.prompt
                kept = row["input_ids"][spans[2 * k]:spans[2 * k + 1]]
                assert spans[2 * k + 1] == offs[k + 1] and kept == completion[:len(kept)]
                if long == "drop":
                    assert kept == completion
    # every pair once: packed, or dead-lettered (too long or a duplicate); counts reconcile
    dead = [(r["example_id"], r["reason"]) for r in g.rejected]
    assert len(seen) == len(set(seen)) == g.stats["examples_packed"]
    assert len(seen) + len(dead) == len(pairs)
    assert sum(1 for _, why in dead if why == "duplicate_id") == len(pairs) - len(by_id)
    assert set(seen) | {i for i, why in dead if why == "too_long"} == set(by_id)
    # the loader's vectorized checks agree with validate_row
    if rows:
        b = gather(pa.Table.from_pylist(rows, schema=packers.SCHEMA), check=True)
        assert isinstance(b, Batch) and check_batch(b, checks(budget)) is None


# ---------------------------------------------------------------------------------------
# Broken pair rows: validate_row and the loader's checks refuse each, naming the check.


GOOD = [make_pair_row([Pair("a", [5, 9], [41, 17, 1], [30, 1]), Pair("b", [7], [62, 1], [18, 19, 1])])]


def swap_sides(r):
    r["sides"] = [1, 0, 0, 1]


def shift_span(r):
    r["completion_spans"][0] -= 1  # now covers a prompt token that has loss_mask 0


def other_prompt(r):
    r["input_ids"][r["seq_offsets"][1]] = 99  # the rejected side's first prompt token


def wrong_pair_id(r):
    r["pair_ids"][1] = "z"


def wrong_example_id(r):
    r["example_ids"][0] = "a#rejected"


def targets_off_by_one(r):
    r["num_targets"] += 1


def span_at_first_token(r):
    r["completion_spans"][0] = 0
    r["loss_mask"][0] = 1
    r["num_targets"] += 0  # token 0 of a sequence is never a label


def drop_pair_columns(r):
    r["pair_ids"], r["sides"], r["completion_spans"] = [], [], []


BROKEN = [
    (swap_sides, "sides", "sides must alternate"),
    (shift_span, "completion_spans", "loss_mask"),
    (other_prompt, "pair_prompt", "prompts differ"),
    (wrong_pair_id, "pair_ids", "not followed by its rejected|is not its pair id"),
    (wrong_example_id, "pair_ids", "is not its pair id"),
    (targets_off_by_one, "num_targets", "num_targets"),
    (span_at_first_token, "completion_spans", "completion span"),
    (drop_pair_columns, "pair_columns", None),
]


@pytest.mark.parametrize("change,check,message", BROKEN, ids=[b[0].__name__ for b in BROKEN])
def test_broken_pair_rows_are_refused(change, check, message):
    import copy

    rows = copy.deepcopy(GOOD)
    b = gather(pa.Table.from_pylist(rows, schema=packers.SCHEMA), check=True)
    assert check_batch(b, checks(64)) is None
    validate_row(rows[0], 64)
    change(rows[0])
    f = check_batch(gather(pa.Table.from_pylist(rows, schema=packers.SCHEMA), check=True), checks(64))
    assert f is not None and f.check == check, f
    if message is not None:
        with pytest.raises(ContractError, match=message):
            validate_row(rows[0], 64)


def test_pair_columns_in_a_run_without_pairs_are_refused():
    row = make_row(random_examples(2, seed=1))
    plain = dataclasses.replace(checks(64), pairs=False)
    assert check_batch(gather(pa.Table.from_pylist([row], schema=packers.SCHEMA), check=True), plain) is None
    f = check_batch(gather(pa.Table.from_pylist(GOOD, schema=packers.SCHEMA), check=True), plain)
    assert f.check == "pair_columns" and "row_checks.pairs is false" in f.detail


# ---------------------------------------------------------------------------------------
# The Collator's pair outputs.


@PROPS
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.integers(0, 2**16), st.booleans())
def test_collator_pair_outputs(pairs_per_row, seed, fixed):
    from packers import Collator

    pairs = random_pairs(sum(pairs_per_row), seed=seed, max_prompt=6, max_completion=6)
    rows, k = [], 0
    for n in pairs_per_row:
        rows.append(make_pair_row(pairs[k:k + n]))
        k += n
    budget = max(r["num_tokens"] for r in rows) + 3
    b = Collator(fixed_shape=fixed, budget=budget)(rows)
    cu = b["cu_seq_lens_q"].tolist()
    comp = b["completion_mask"][0]
    labels = b["labels"][0]
    assert (comp == (labels != -100)).all()  # the completions are exactly the targets
    pi = b["pair_index"].tolist()
    assert len(pi) == len(pairs)
    for (c, r), p in zip(pi, pairs):
        assert r == c + 1
        for s, completion in ((c, p.chosen), (r, p.rejected)):
            a, z = cu[s], cu[s + 1]
            assert b["input_ids"][0, a:z].tolist() == p.prompt + completion
            assert comp[a:z].tolist() == [False] * len(p.prompt) + [True] * len(completion)
            assert b["position_ids"][0, a:z].tolist() == list(range(z - a))


def test_collator_refuses_mixed_rows():
    from packers import Collator

    with pytest.raises(PackstreamError, match="row 0 holds preference pairs, row 1 does not"):
        Collator()([GOOD[0], make_row(random_examples(1))])
    bad = dict(GOOD[0], sides=[0, 0, 0, 1])
    with pytest.raises(ContractError, match="sides must alternate"):
        Collator()([bad])


def test_side_suffixes():
    assert Side.CHOSEN.suffix == "#chosen" and Side.REJECTED.suffix == "#rejected"
