"""Examples recovered from packed rows (issue 44, the first brick of ``repack``): a folder packed by the job reads back,
by its rows' ``seq_offsets``, into exactly the examples the Encoder made of the inputs: ids, tokens, loss masks, KTO
labels, and each pair whole (chosen then rejected), whenever no example was cut at the pack."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packers import PackstreamError
from pipeline import PackOptions, run
from tests._internals import Encoder, _read, input_folders, packed_examples

_WORDS = st.lists(st.sampled_from(["alpha", "beta", "gamma", "delta", "seven", "nine", "Oslo", "cat", "chat"]),
                  min_size=1, max_size=12).map(" ".join)
_SFT = st.fixed_dictionaries({"instruction": _WORDS, "output": _WORDS})
_KTO = st.fixed_dictionaries({"prompt": _WORDS, "completion": _WORDS, "label": st.booleans()})
_SPACED = _WORDS.map(lambda w: " " + w)  # TRL's raw strings: an answer starts with its space
_PAIR = st.fixed_dictionaries({"prompt": _WORDS, "chosen": _SPACED, "rejected": _SPACED})


def _encoded(options: PackOptions) -> dict[str, tuple]:
    """What the Encoder makes of every input record, by id (as ``packstream verify --inputs`` re-reads them)."""
    files = _read.expand_datasets(options.datasets())[0]
    encoder = Encoder(options, input_folders(files))
    out = {}
    for f in files:
        chunk = [(f.dataset, f.source, pos, rec) for pos, rec in _read.read_file(f, options.max_record_bytes)]
        b = encoder.encode(chunk).batch
        for i, eid in enumerate(b.ids):
            a, z = int(b.offsets[i]), int(b.offsets[i + 1])
            out[eid] = (b.input_ids[a:z].tolist(), b.loss_mask[a:z].tolist(),
                        None if b.desirable is None else int(b.desirable[i]),
                        None if b.cuts is None else int(b.cuts[i]))
    return out


def _round_trip(tmp_path, records: list, budget: int, **opts) -> None:
    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))  # one folder per hypothesis example
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))  # records[0] short: never a run with nothing packed
    options = PackOptions(inputs=(str(src),), output=str(tmp_path / "out"), max_tokens=budget, workers=1, **opts)
    run(options)
    expected = {eid: e for eid, e in _encoded(options).items() if len(e[0]) <= budget}  # longer: dropped (--long drop)
    got = list(packed_examples(str(tmp_path / "out")))
    assert Counter(e.id for e in got) == Counter(list(expected)), "every packed example once, none lost"
    for e in got:
        ids, mask, label, chosen = expected[e.id]
        assert (e.input_ids.tolist(), e.loss_mask.tolist(), e.chosen_length) == (ids, mask, chosen), e.id
        assert e.desirable in ((None, -1) if label in (None, -1) else (label,)), e.id
        assert e.source == "in.jsonl" and e.piece is None and not e.maybe_truncated
        if chosen is not None:  # each completion span lies on its side, and the mask is 1 exactly there
            (a, b), (c, d) = e.completion_spans
            assert 0 < a < b <= chosen < c < d <= len(ids)
            assert sum(mask) == (b - a) + (d - c) and all(mask[a:b]) and all(mask[c:d])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(st.one_of(_SFT, _KTO), min_size=1, max_size=12), budget=st.sampled_from([48, 96, 256]),
       validation=st.sampled_from([0.0, 0.3]))
def test_plain_and_kto_examples_read_back_as_encoded(tmp_path, records, budget, validation):
    _round_trip(tmp_path, [{"instruction": "hi", "output": "ok"}, *records], budget, validation_fraction=validation)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(_PAIR, min_size=1, max_size=10), budget=st.sampled_from([128, 256]))
def test_pairs_read_back_whole_chosen_then_rejected(tmp_path, records, budget):
    _round_trip(tmp_path, [{"prompt": "hi", "chosen": " ok", "rejected": " no"}, *records], budget, pairs=True)


def test_pieces_are_marked(tmp_path):
    # One long SFT example at budget 32 with --long split: its pieces come back as <id>#0, #1, ... marked, never joined.
    records = [{"instruction": "tell me", "output": " ".join(["alpha beta gamma"] * 20)}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    run(PackOptions(inputs=(str(src),), output=str(tmp_path / "out"), max_tokens=32, long="split", workers=1))
    got = sorted(packed_examples(str(tmp_path / "out")), key=lambda e: e.piece)
    assert len(got) > 1 and [e.piece for e in got] == list(range(len(got)))
    assert all(e.id == f"in.jsonl@1#{e.piece}" for e in got)


def test_an_unfinished_folder_is_refused(tmp_path):
    with pytest.raises(PackstreamError, match="no manifest.json"):
        list(packed_examples(str(tmp_path)))
