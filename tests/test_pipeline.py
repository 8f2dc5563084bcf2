"""End-to-end tests of ``packstream pack``: round trips, reconciliation, decoding, determinism."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections import Counter

import datasets
import numpy as np
import pyarrow as pa
import pytest

import packers
from pipeline import PackOptions, run
from pipeline.cli import bundled_sample
from tests._internals import load_tokenizer
from tests.conftest import GSM8K_FIELDS, shared_data


def _shards(folder) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, "train-*.arrow")))


def _rows(folder) -> list[dict]:
    rows = []
    for path in _shards(folder):
        rows.extend(datasets.Dataset.from_file(path).to_list())
    return rows


_ESC_SOURCE = str.maketrans({"%": "%25", ":": "%3A", "@": "%40", "#": "%23", "~": "%7E"})
_ESC_ID = str.maketrans({"%": "%25", "#": "%23", "~": "%7E"})


def _expected_id(source: str, pos: int, rec) -> str:
    """The id scheme as README documents it, written out here independently of pipeline._rows."""
    src = source.translate(_ESC_SOURCE)
    own = rec.get("id") if isinstance(rec, dict) else None
    if isinstance(own, str) and own:
        try:
            float(own)
            return f'{src}:"{own.translate(_ESC_ID)}"'
        except ValueError:
            return f"{src}:{own.translate(_ESC_ID)}"
    if isinstance(own, int) and not isinstance(own, bool):
        return f"{src}:{own}"
    return f"{src}@{pos}"


def _inputs_by_id(folder: str, options: PackOptions) -> dict[str, tuple[str, int, object]]:
    """Every input record, re-read with the json module alone: example id -> (source, position, record).

    Sources are paths relative to the inputs' common folder; JSONL positions are 1-based lines
    (blank lines skipped), JSON arrays 0-based indices.
    """
    paths = []
    for p in options.inputs:
        if os.path.isdir(p):
            paths += [os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs if f.endswith((".jsonl", ".json"))]
        else:
            paths.append(os.path.abspath(p))
    paths = sorted(os.path.abspath(p) for p in paths)
    root = os.path.dirname(paths[0]) if len(paths) == 1 else os.path.commonpath(paths)
    out = {}
    for path in paths:
        source = os.path.relpath(path, root)
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                items = [(n, json.loads(line)) for n, line in enumerate(f, start=1) if line.strip()]
        else:
            items = list(enumerate(json.load(open(path, encoding="utf-8"))))
        for pos, rec in items:
            out[_expected_id(source, pos, rec)] = (source, pos, rec)
    return out


_SIMPLE = ("messages", "instruction", "question", "prompt")


def _expected_chatml(rec: dict, options: PackOptions):
    """(full text, target text) of a simple record in the built-in ChatML, or None for other shapes
    (those are checked shape by shape in tests/test_formats.py)."""
    fields = dict(options.fields)
    if "question" in rec and fields.get("question") == "user":
        turns = [("user", rec["question"]), ("assistant", rec["answer"])]
    elif "instruction" in rec and isinstance(rec.get("output", rec.get("response")), str) and "history" not in rec:
        inp = rec.get("input") or ""
        turns = [("user", rec["instruction"] + ("\n\n" + inp if inp.strip() else "")),
                 ("assistant", rec.get("output", rec.get("response")))]
    elif isinstance(rec.get("messages"), list) and all(isinstance(m.get("content"), str) and m.get("role") in
                                                       ("system", "user", "assistant") and set(m) <= {"role", "content"}
                                                       for m in rec["messages"]):
        turns = [(m["role"], m["content"]) for m in rec["messages"]]
    elif isinstance(rec.get("prompt"), str) and isinstance(rec.get("completion"), str) and not (
            rec.get("system") or rec.get("tools")) and options.strings.value == "raw":
        # TRL's standard strings: raw text, the EOS appended; trained from where the tokens part from the prompt's
        # (within its last word when the two merge: tests/test_trl_formats.py holds the exact split against TRL)
        return rec["prompt"] + rec["completion"], rec["completion"], "raw"
    else:
        return None
    if any(not c.strip() for _, c in turns) or turns[-1][0] != "assistant":
        return None
    full, target = "", ""
    for role, content in turns:
        full += f"<|im_start|>{role}\n"
        if role == "assistant":
            full += content + "<|im_end|>\n"
            target += content + "<|im_end|>\n"
        else:
            full += content + "<|im_end|>\n"
    if "messages" in rec and options.eos.value == "trl":  # TRL's messages end as the template renders them
        return full, target, ""
    return full.rstrip(), target.rstrip(), None


def check_output(folder: str, options: PackOptions, sample: int = 200) -> dict:
    """Everything a user relies on, checked from the files alone."""
    manifest = json.load(open(os.path.join(folder, "manifest.json")))
    assert manifest["status"] == "complete"
    c = manifest["counts"]
    # Loads three ways.
    rows = _rows(folder)
    assert datasets.load_dataset(folder, split="train").num_rows == len(rows) == c["rows"]
    assert datasets.load_dataset("arrow", data_files=_shards(folder), split="train").num_rows == len(rows)
    # Every row follows the contract and the metadata names the tokenizer.
    schema = pa.ipc.open_stream(open(_shards(folder)[0], "rb")).schema
    meta = packers.read_metadata(schema)
    assert meta["budget"] == options.max_tokens and meta["tokenizer_vocab_sha256"] == manifest["tokenizer"]["vocab_sha256"]
    for r in rows:
        packers.validate_row(r, options.max_tokens)
    # Every input record is in exactly one row or in the dead-letter file.
    packed = Counter(i for r in rows for i in r["example_ids"])
    assert all(v == 1 for v in packed.values())
    rejected = [json.loads(l) for l in open(os.path.join(folder, "rejected.jsonl"))]
    inputs = _inputs_by_id(folder, options)
    dead = Counter((d["source"], d["position"]) for d in rejected)
    assert all(v == 1 for v in dead.values()), "a record is dead-lettered twice"
    packed_records = {i.split("#")[0] for i in packed}
    for eid, (source, pos, _) in inputs.items():
        assert (eid in packed_records) != ((source, pos) in dead), f"{eid} is in neither or both"
    assert len(packed_records) + len(dead) == len(inputs) == c["records_read"]
    assert c["records_read"] == c["examples_packed"] + c["rejected"] + c["dropped_too_long"]
    assert c["tokens"] == sum(len(r["input_ids"]) for r in rows)
    # Decoding a sample of examples gives the chat text written out here by hand; the targets are
    # each assistant turn's content and its end-of-turn token, then the EOS.
    tok = load_tokenizer(options.tokenizer)
    eos = tok.eos_token
    rng = np.random.default_rng(0)
    by_row = [(r, k) for r in rows for k in range(len(r["example_ids"]))]
    checked = 0
    for i in rng.choice(len(by_row), size=min(sample, len(by_row)), replace=False):
        r, k = by_row[i]
        eid = r["example_ids"][k]
        if "#" in eid:
            continue  # a piece of a split example: checked in test_split_pieces_concatenate
        lo, hi = r["seq_offsets"][k], r["seq_offsets"][k + 1]
        ids = np.array(r["input_ids"][lo:hi])
        mask = np.array(r["loss_mask"][lo:hi], dtype=bool)
        rec = inputs[eid][2]
        if "text" in rec and len(rec) <= 2 and not options.fields:
            assert mask.all() and tok.decode(ids) in (rec["text"] + eos, (rec["text"] + eos)[: len(tok.decode(ids))])
            continue
        expected = _expected_chatml(rec, options)
        if expected is None:
            continue
        full, target, end = expected
        if end == "raw":
            whole = full if full.endswith(eos) else full + eos
            trained = tok.decode(ids[mask])
            keep = whole.startswith if options.truncate_side.value == "right" else whole.endswith
            assert tok.decode(ids) == whole or len(ids) == options.max_tokens and keep(tok.decode(ids)), eid
            assert whole.endswith(trained) and (trained.endswith(target + eos) or len(ids) == options.max_tokens), eid
            checked += 1
            continue
        ending = eos if end is None else end
        text = tok.decode(ids)
        if len(ids) == options.max_tokens and options.long is packers.LongPolicy.TRUNCATE:
            keep = (full + ending).startswith if options.truncate_side.value == "right" else (full + ending).endswith
            assert keep(text), eid
            continue
        assert text == full + ending, eid
        assert tok.decode(ids[mask]) == target + ending, eid
        checked += 1
    assert checked > 0 or sample == 0
    return manifest


def test_bundled_sample_round_trip(tmp_path):
    options = PackOptions(inputs=(bundled_sample(),), output=str(tmp_path / "out"), max_tokens=512)
    manifest = run(options)
    assert manifest["counts"]["rejected"] == 0
    assert manifest["counts"]["rows"] >= manifest["counts"]["lower_bound"] > 1
    check_output(options.output, options)
    card = (tmp_path / "out" / "README.md").read_text()
    assert card.startswith("---\nconfigs:") and "packstream" in card


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    data = shared_data()
    out = tmp_path_factory.mktemp("shared") / "out"
    options = PackOptions(inputs=(str(data),), output=str(out), fields=GSM8K_FIELDS, max_tokens=4096)
    return options, run(options)


def test_every_shared_file_round_trips(shared_run):
    options, manifest = shared_run
    sources = {i["source"] for i in manifest["inputs"]}
    assert {"gsm8k/train.jsonl", "gpteacher/codegen-instruct.json", "oasst/en_100_paths.messages.jsonl",
            "glaive_toolcall/glaive_toolcall_en_demo.json", "self_instruct/t0_sample_15_per_template.jsonl",
            "self_instruct/seed_tasks.jsonl"} <= sources
    check_output(options.output, options, sample=400)
    c = manifest["counts"]
    assert c["fill"] >= 0.995
    assert c["dropped_too_long"] > 0  # the t0 sample has prompts longer than 4096 tokens


def test_counts_per_source_match_the_files(shared_run):
    options, manifest = shared_run
    data = shared_data()
    lines = sum(1 for l in open(data / "gsm8k" / "train.jsonl") if l.strip())
    rows = _rows(options.output)
    gsm = sum(1 for r in rows for i in r["example_ids"] if i.startswith("gsm8k/"))
    assert gsm == lines == 7473


@pytest.mark.parametrize("mode,long,side", [("global", "drop", "right"), ("grouped", "split", "right"),
                                            ("grouped", "truncate", "right"), ("grouped", "truncate", "left")])
def test_modes_and_long_policies(tmp_path, mode, long, side):
    data = shared_data()
    options = PackOptions(
        inputs=(str(data / "self_instruct"), str(data / "glaive_toolcall")), output=str(tmp_path / "o"),
        max_tokens=2048, mode=__import__("pipeline").PackMode(mode), long=packers.LongPolicy(long), group_size=1000,
        truncate_side=side,
    )
    manifest = run(options)
    c = manifest["counts"]
    check_output(options.output, options, sample=100)
    if long == "split":
        assert c["split_examples"] > 0 and c["dropped_too_long"] == 0
        # The t0 prompts that overflow are context: their leading pieces hold no target token and are
        # dropped and counted (a piece that trains nothing is never packed), the answer pieces stay.
        assert c["pieces"] >= c["examples_packed"] and c["no_target_pieces"] > 0
    if long == "truncate":
        assert c["dropped_too_long"] == 0
        if side == "right":  # the long t0 prompts keep their first 2048 tokens: context only, so refused
            assert c["rejected_by_reason"].get("no_target_tokens", 0) > 0
            assert "--truncate-side left" in c["first_rejected"]["no_target_tokens"]["detail"]
        else:  # the end of the example, its answer and EOS, is kept
            assert c["truncated_examples"] > 0 and c["truncated_tokens"] > 0


def test_split_pieces_concatenate(tmp_path):
    """The pieces of a split example, in order, are exactly the example's tokens."""
    long_text = " ".join(f"word{i}" for i in range(600))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": long_text}) + "\n" + json.dumps({"text": "short one"}) + "\n")
    options = PackOptions(inputs=(str(src),), output=str(tmp_path / "o"), max_tokens=256, long=packers.LongPolicy.SPLIT)
    run(options)
    pieces = {}
    for r in _rows(options.output):
        for k, eid in enumerate(r["example_ids"]):
            lo, hi = r["seq_offsets"][k], r["seq_offsets"][k + 1]
            pieces[eid] = r["input_ids"][lo:hi]
    parts = sorted((int(e.split("#")[1]), v) for e, v in pieces.items() if e.startswith("in.jsonl@1#"))
    assert len(parts) > 1 and all(len(v) == 256 for _, v in parts[:-1])
    tok = load_tokenizer(options.tokenizer)
    assert tok.decode([t for _, v in parts for t in v]) == long_text + tok.eos_token


def _digest(folder) -> dict[str, bytes]:
    return {os.path.basename(p): open(p, "rb").read() for p in _shards(folder) + [os.path.join(folder, "rejected.jsonl")]}


def test_deterministic_across_runs_and_workers(tmp_path):
    data = shared_data()
    base = dict(inputs=(str(data / "oasst"), str(data / "gpteacher")), max_tokens=2048, group_size=500, num_shards=3)
    a = PackOptions(output=str(tmp_path / "a"), **base)
    c = PackOptions(output=str(tmp_path / "c"), **base)
    run(a)
    run(dataclasses.replace(c, workers=2))  # another run, on other workers: the same bytes
    assert _digest(a.output) == _digest(c.output)
    assert len(_shards(a.output)) == 3
    # Rows are shuffled: the output order does not follow length.
    lengths = [r["num_tokens"] for r in _rows(a.output)]
    assert lengths != sorted(lengths) and lengths != sorted(lengths, reverse=True)


def test_parquet_output_loads(tmp_path):
    options = PackOptions(inputs=(bundled_sample(),), output=str(tmp_path / "p"), max_tokens=256, output_format=__import__("pipeline").OutputFormat.PARQUET)
    run(options)
    ds = datasets.load_dataset(options.output, split="train")
    assert ds.num_rows == json.load(open(tmp_path / "p" / "manifest.json"))["counts"]["rows"]
