"""KTO data keeps its desirability label (issue 25): each example's label travels with it into the rows' ``desirable``
column, out of the loader as the batch's ``desirable``, beside each example's log-prob, into :func:`packers.kto_loss`.

Worked examples of the layouts KTO sets come in, a property over random records and budgets (every packed example's
label is its record's), the contract checks, and the loss on a packed batch equal to the loss of its examples alone.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from packers import (Collator, ContractError, PackedDataset, PackstreamError, SequenceLogps, kto_loss,
                     sequence_logps, validate_row)
from pipeline.cli import main
from tests._models import tiny_model
from tests._shards import make_row, random_examples, v2_row
from tests.test_pipeline import _rows

KTO_RECORDS = [
    # {messages, label}: LLaMA-Factory's kto demo layout
    {"messages": [{"role": "user", "content": "Name a prime number."}, {"role": "assistant", "content": "Seven."}],
     "label": True},
    {"messages": [{"role": "user", "content": "Name a prime number."}, {"role": "assistant", "content": "Nine."}],
     "label": False},
    # TRL's unpaired preference layout
    {"prompt": "What is the capital of Norway?", "completion": "Oslo.", "label": True},
    {"prompt": "What is the capital of Norway?", "completion": "Bergen, I think.", "label": False},
    # LLaMA-Factory's kto_tag
    {"instruction": "Translate 'cat' to French.", "output": "chat", "kto_tag": True},
    # no label: an SFT record beside them (-1)
    {"instruction": "Say hello.", "output": "Hello!"},
    # a label that is a class, not a desirability: stays an ignored field
    {"prompt": "Classify: 'great match'", "completion": "sports", "label": "sports"},
]
EXPECTED = [1, 0, 1, 0, 1, -1, -1]


def _pack(tmp_path, records, *args, name="kto.jsonl"):
    src = tmp_path / name
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    r = CliRunner().invoke(main, ["pack", str(src), "-o", str(out), "--workers", "1", "--no-progress",
                                  "--max-tokens", "256", *args])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    return out, r.output, json.loads((out / "manifest.json").read_text())


def _id(i: int) -> str:
    """The example id of record ``i`` of kto.jsonl (records without their own id: file@line)."""
    return f"kto.jsonl@{i + 1}"


def _labels_by_id(out) -> dict[str, int]:
    found = {}
    for row in _rows(str(out)):
        ids = row["example_ids"]
        found.update(zip(ids, row["desirable"] or [-1] * len(ids)))
    return found


def test_every_kto_layout_keeps_its_label_per_example(tmp_path):
    out, output, manifest = _pack(tmp_path, KTO_RECORDS)
    found = _labels_by_id(out)
    assert found == {_id(i): want for i, want in enumerate(EXPECTED)}
    notes = manifest["counts"]["normalization"]
    assert notes["kto_labels:desirable"] == 3 and notes["kto_labels:undesirable"] == 2
    assert "ignored_field:label" in notes and notes["ignored_field:label"] == 1  # only the class label
    [line] = [line for line in output.splitlines() if line.startswith("KTO labels")]
    assert "3 desirable, 2 undesirable records" in line and "SFT loss trains on both" in line


def test_a_run_without_labels_writes_an_empty_column_and_the_batch_has_no_key(tmp_path):
    out, output, _ = _pack(tmp_path, KTO_RECORDS[5:6] * 3)
    assert set(_labels_by_id(out).values()) == {-1} and "KTO labels" not in output
    rows = PackedDataset(str(out)).fetch([0])
    assert rows[0]["desirable"].size == 0 and "desirable" not in Collator()(rows)


def test_kto_label_names_the_field_and_reads_text_and_numbers(tmp_path):
    records = [{"q": "2+2?", "a": "4", "good": "true"}, {"q": "2+2?", "a": "5", "good": 0},
               {"q": "3+3?", "a": "6", "good": "1"}, {"q": "3+3?", "a": "7", "good": "maybe"}, {"q": "1+1?", "a": "2"}]
    out, output, manifest = _pack(tmp_path, records, "--field", "q=user", "--field", "a=assistant", "--kto-label", "good")
    assert _labels_by_id(out) == {_id(0): 1, _id(1): 0, _id(2): 1}
    # A record --kto-label names no value in is dead-lettered with its reason, never packed unlabelled.
    dead = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert sorted(d["position"] for d in dead) == [4, 5]  # line numbers
    assert all(d["reason"] == "missing_field" and "--kto-label good" in d["detail"] for d in dead)
    assert "'maybe'" in dead[0]["detail"] + dead[1]["detail"]
    assert manifest["counts"]["records_read"] == 5 == manifest["counts"]["examples_packed"] + manifest["counts"]["rejected"]


def test_the_loader_batch_carries_the_labels_aligned_with_the_example_ids(tmp_path):
    out, _, _ = _pack(tmp_path, KTO_RECORDS)
    ds = PackedDataset(str(out))
    batch = Collator(fixed_shape=True, budget=256)(ds.fetch(list(range(ds.rows.num_rows))))
    want = {_id(i): label for i, label in enumerate(EXPECTED)}
    assert batch["desirable"].dtype == torch.int8
    assert dict(zip(batch["example_ids"], batch["desirable"].tolist())) == want


# -- the property: whatever the records and the budget, every packed example carries its record's label --------------

_RECORD = st.fixed_dictionaries({
    "q": st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=40),
    "a": st.text(st.characters(codec="ascii", categories=("L", "N")), min_size=1, max_size=120),
    "label": st.one_of(st.booleans(), st.none(), st.sampled_from(["x", 1])),
})


@settings(max_examples=8, deadline=None)
@given(records=st.lists(_RECORD, min_size=1, max_size=30), budget=st.sampled_from([64, 128, 512]),
       long=st.sampled_from(["drop", "split"]))
def test_every_packed_example_carries_its_records_label(tmp_path_factory, records, budget, long):
    tmp = tmp_path_factory.mktemp("kto")
    rows = [{"prompt": r["q"], "completion": r["a"], **({} if r["label"] is None else {"label": r["label"]})}
            for r in records]
    src = tmp / "p.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = CliRunner().invoke(main, ["pack", str(src), "-o", str(tmp / "o"), "--workers", "1", "--no-progress",
                                  "--max-tokens", str(budget), "--long", long])
    assert r.exit_code in (0, 3), r.output  # 3: every record dropped (over the budget, and KTO is never split)
    if r.exit_code == 3:
        return
    for eid, label in _labels_by_id(tmp / "o").items():
        line = int(eid.split("@")[1].split("#")[0])
        value = records[line - 1]["label"]
        assert label == (int(value) if isinstance(value, bool) else -1), (eid, value)
        assert label == -1 or "#" not in eid, eid  # a labelled example is whole: never a piece


# -- the contract ------------------------------------------------------------------------------------------------------

def test_the_contract_refuses_a_desirable_column_of_the_wrong_length_or_value():
    row = v2_row(make_row(random_examples(3, seed=1)))
    validate_row({**row, "desirable": [1, 0, -1]}, budget=4096)
    with pytest.raises(ContractError, match="desirable holds 2 values for 3 sequences"):
        validate_row({**row, "desirable": [1, 0]}, budget=4096)
    with pytest.raises(ContractError, match="other than 1, 0 and -1"):
        validate_row({**row, "desirable": [1, 0, 2]}, budget=4096)
    with pytest.raises(ContractError, match="desirable holds 1 values for 3 sequences"):
        Collator()([{**row, "desirable": np.array([1], np.int8)}])


# -- the loss: packed equals alone --------------------------------------------------------------------------------------

def _trl_kto(policy: float, reference: float, good: bool, kl: float, beta: float) -> float:
    """TRL's KTOTrainer.kto_loss for one example (loss_type "kto", weights 1)."""
    r = policy - reference
    z = beta * (r - kl) if good else beta * (kl - r)
    return 1 - 1 / (1 + math.exp(-z))


def test_kto_loss_on_a_packed_batch_equals_its_examples_alone():
    torch.manual_seed(0)
    policy, reference = tiny_model("llama", "sdpa").eval(), tiny_model("llama", "sdpa").eval()
    examples = random_examples(5, seed=3, min_len=4, max_len=20, vocab=100)
    labels = [1, 0, 0, 1, 1]
    rows = [{**make_row(examples[:3]), "desirable": labels[:3]}, {**make_row(examples[3:]), "desirable": labels[3:]}]
    batch = Collator(fixed_shape=True, budget=64)(rows)
    with torch.no_grad():
        lp, ref = (sequence_logps(m(**batch).logits, batch) for m in (policy, reference))
        alone = []
        for ex in examples:
            single = Collator()([make_row([ex])])
            alone.append([sequence_logps(m(**single).logits, single).sum.item() for m in (policy, reference)])
    assert lp.desirable.tolist() == labels and list(lp.ids) == [ex.id for ex in examples]
    want = sum(_trl_kto(p, r, bool(g), 0.05, 0.1) for (p, r), g in zip(alone, labels)) / len(labels)
    assert kto_loss(lp, ref, kl=0.05, beta=0.1).item() == pytest.approx(want, abs=1e-6)


def test_kto_loss_refuses_unlabelled_examples_and_batches_without_labels():
    row = make_row(random_examples(2, seed=2, min_len=3))
    plain = Collator()([row])
    logits = torch.zeros(1, plain["input_ids"].shape[1], 200)
    lp = sequence_logps(logits, plain)
    with pytest.raises(Exception, match="carries no desirable labels"):
        kto_loss(lp, lp, kl=0.0)
    mixed = Collator()([{**row, "desirable": [1, -1]}])
    lp = sequence_logps(logits, mixed)
    with pytest.raises(Exception, match="1 of the batch's 2 examples carry no desirability label"):
        kto_loss(lp, lp, kl=0.0)


# -- KTO and --long split (issue 43): TRL truncates, never splits ------------------------------------------------------

def test_kto_with_long_split_is_refused_at_pack_time(tmp_path):
    """Worked example: two labelled records, one longer than the budget. Under --long split the long one is a
    too_long dead letter naming the alternatives (not pieces that each carry its label); the short one packs.
    --kto-label with --long split is refused before anything is read."""
    long_answer = " ".join(f"word{i}" for i in range(200))
    records = [{"prompt": "Say hi.", "completion": "Hi!", "label": True},
               {"prompt": "Count.", "completion": long_answer, "label": False}]
    out, _, _ = _pack(tmp_path, records, "--max-tokens", "64", "--long", "split")
    dead = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [(d["position"], d["reason"]) for d in dead] == [(2, "too_long")]
    assert "never split" in dead[0]["detail"] and "--long truncate" in dead[0]["detail"]
    assert all("#" not in eid for eid in _labels_by_id(out))
    refused = CliRunner().invoke(main, ["pack", str(tmp_path / "kto.jsonl"), "-o", str(tmp_path / "o2"),
                                        "--kto-label", "label", "--long", "split"])
    assert refused.exit_code == 2 and "--long truncate or --long drop" in refused.output
    assert len(refused.output.strip().splitlines()) == 1


def test_kto_loss_refuses_pieces_of_a_split_example_from_an_older_folder():
    lp = SequenceLogps(sum=torch.tensor([-2.0, -3.0]), tokens=torch.tensor([2, 3]), pair_index=None,
                       ids=("kto.jsonl@1", "kto.jsonl@2#1"), desirable=torch.tensor([1, 0], dtype=torch.int8))
    with pytest.raises(PackstreamError, match="'kto.jsonl@2#1' is a piece of a KTO example split by --long split"):
        kto_loss(lp, lp, kl=0.0)
    whole = dataclasses.replace(lp, ids=("kto.jsonl@1", "kto.jsonl@2"))
    assert torch.isfinite(kto_loss(whole, whole, kl=0.0))
