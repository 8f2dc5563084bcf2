"""``packstream repack``: a packed folder of text rows to a new budget, mixture or split, without tokenizing again.

The one promise, as a property over generated records and options: a folder packed at budget B1 and repacked at B2
holds byte-identical shards, the same run id and the same counts as ``pack`` of the raw inputs at B2 with the same
options, whenever no example was cut at B1. Worked examples: a mixture of two packed folders under a --config, and of a
packed folder and a raw input, against the same --config over the raw inputs; what a cut example becomes; the refusals.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pipeline
from packers import PackstreamError
from pipeline import PackOptions, RepackOptions

WORDS = "alpha beta gamma delta prime river stone cloud seven ninety quiet answer".split()


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _record(rng: random.Random, kind: str, longest: int) -> dict:
    q, a = _text(rng, rng.randint(1, longest)), _text(rng, rng.randint(1, longest))
    if kind == "pairs":
        return {"prompt": q, "chosen": " " + a, "rejected": " " + _text(rng, rng.randint(1, longest))}
    if kind == "kto":
        return {"prompt": q, "completion": " " + a, "label": rng.random() < 0.6}
    if rng.random() < 0.5:
        return {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    return {"prompt": q, "completion": " " + a}


def write_records(path: Path, kind: str, n: int, seed: int, longest: int = 40) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(_record(rng, kind, longest)) + "\n" for _ in range(n)))
    return path


def shards(folder: Path) -> dict[str, bytes]:
    """Every shard file of a finished folder, by name."""
    m = json.loads((folder / "manifest.json").read_text())
    return {s["name"]: (folder / s["name"]).read_bytes() for s in m["shards"]}


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def assert_same_output(repacked: Path, packed: Path) -> None:
    a, b = manifest(repacked), manifest(packed)
    assert sorted(shards(repacked)) == sorted(shards(packed))
    for name, data in shards(packed).items():
        assert shards(repacked)[name] == data, name
    assert a["run_id"] == b["run_id"]
    assert a["counts"] == b["counts"]
    assert (repacked / "rejected.jsonl").read_bytes() == (packed / "rejected.jsonl").read_bytes()


ROWS = dict(max_tokens=st.sampled_from([48, 64, 96, 160, 512]), mode=st.sampled_from(["grouped", "global"]),
            group_size=st.sampled_from([4, 9, 10_000]), max_per_row=st.sampled_from([None, 3]),
            refine=st.booleans(), seed=st.integers(0, 2**20), validation_fraction=st.sampled_from([0.0, 0.25]),
            num_shards=st.sampled_from([0, 1, 3]), output_format=st.sampled_from(["arrow", "parquet"]),
            long=st.sampled_from(["drop", "truncate", "split"]))


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(kind=st.sampled_from(["sft", "pairs", "kto"]), n=st.integers(3, 40), data_seed=st.integers(0, 2**16),
       rows=st.fixed_dictionaries(ROWS))
def test_repack_equals_pack_at_the_new_budget(tmp_path_factory, kind, n, data_seed, rows):
    """Packed at a budget nothing exceeds (nothing cut), then repacked at generated row options: the same shards,
    run id, counts and dead letters as pack of the raw inputs at those options."""
    tmp = tmp_path_factory.mktemp("repack")
    src = write_records(tmp / "in" / "data.jsonl", kind, n, data_seed)
    pairs = kind == "pairs"
    if pairs and rows["long"] == "split":
        rows["long"] = "drop"
    if kind == "kto" and rows["long"] == "split":
        rows["long"] = "truncate"
    if pairs and rows["max_per_row"] is not None:
        rows["max_per_row"] = 4
    first = PackOptions(inputs=(str(src),), output=str(tmp / "first"), max_tokens=4096, pairs=pairs,
                        max_reject_fraction=1.0)
    m1 = pipeline.run(first)
    assert m1["counts"]["dropped_too_long"] == m1["counts"]["truncated_examples"] == 0
    direct = pipeline.launch(PackOptions(inputs=(str(src),), output=str(tmp / "direct"), pairs=pairs,
                                         max_reject_fraction=1.0, **rows))
    again = pipeline.launch(RepackOptions(folders=(str(tmp / "first"),), output=str(tmp / "again"),
                                          rows=tuple(rows.items())))
    assert again.exit_code == direct.exit_code, (again, direct)
    if direct.exit_code:  # nothing fits the new budget: both fail alike (no example packed), with the same counts
        assert again.manifest["counts"] == direct.manifest["counts"]
        return
    assert_same_output(tmp / "again", tmp / "direct")


def test_repack_keeps_the_folders_options_it_is_not_given(tmp_path):
    """Only --max-tokens given: the mode, seed, validation split and --long of the first pack stay."""
    src = write_records(tmp_path / "in" / "d.jsonl", "sft", 30, 1)
    opts = dict(mode="grouped", seed=7, validation_fraction=0.2, long="truncate", group_size=8)
    pipeline.run(PackOptions(inputs=(str(src),), output=str(tmp_path / "a"), max_tokens=2048, **opts))
    pipeline.run(PackOptions(inputs=(str(src),), output=str(tmp_path / "b"), max_tokens=128, **opts))
    m = pipeline.run(RepackOptions(folders=(str(tmp_path / "a"),), output=str(tmp_path / "c"),
                                   rows=(("max_tokens", 128),)))
    assert m["config"]["seed"] == 7 and m["config"]["validation_fraction"] == 0.2
    assert m["repacked_from"][0]["run_id"] == manifest(tmp_path / "a")["run_id"]
    assert_same_output(tmp_path / "c", tmp_path / "b")


def _config(path: Path, datasets: list[dict]) -> Path:
    path.write_text(json.dumps({"datasets": datasets}))
    return path


def test_a_mixture_of_two_packed_folders_equals_the_mixture_of_their_raw_inputs(tmp_path):
    """Two folders, each packed from one input, mixed by a --config with weights and loss weights: the rows a
    --config over the two raw inputs gives (the sources renamed as one pack over both names them)."""
    a = write_records(tmp_path / "raw" / "a" / "chat.jsonl", "sft", 40, 2)
    b = write_records(tmp_path / "raw" / "b" / "chat.jsonl", "sft", 25, 3)  # the same file name: renamed a/, b/
    pipeline.run(PackOptions(inputs=(str(a),), output=str(tmp_path / "pa"), max_tokens=4096))
    pipeline.run(PackOptions(inputs=(str(b),), output=str(tmp_path / "pb"), max_tokens=4096))
    sets = [dict(name="a", weight=0.5, loss_weight=2.0), dict(name="b", weight=2, loss_weight=0.5)]
    raw = _config(tmp_path / "raw.json", [{**d, "paths": [str(p)]} for d, p in zip(sets, (a, b))])
    mix = _config(tmp_path / "mix.json", [{**d, "paths": [str(tmp_path / p)]} for d, p in zip(sets, ("pa", "pb"))])
    rows = dict(max_tokens=256, seed=3, validation_fraction=0.1)
    pipeline.run(PackOptions(config=pipeline._options.load_config(str(raw), pipeline._options.FormatOptions()),
                             inputs=(), output=str(tmp_path / "direct"), **rows))
    m = pipeline.run(RepackOptions(config=str(mix), output=str(tmp_path / "again"), rows=tuple(rows.items())))
    assert_same_output(tmp_path / "again", tmp_path / "direct")
    assert [i["source"] for i in m["inputs"]] == ["a/chat.jsonl", "b/chat.jsonl"]
    assert m["counts"]["not_sampled"] > 0 and m["counts"]["repeated_copies"] == 25


def test_a_mixture_of_a_packed_folder_and_a_raw_input(tmp_path):
    """One data set a packed folder (not tokenized again), one a raw input (tokenized as pack does)."""
    a = write_records(tmp_path / "raw" / "a.jsonl", "sft", 30, 4)
    b = write_records(tmp_path / "raw" / "b.jsonl", "sft", 20, 5)
    pipeline.run(PackOptions(inputs=(str(a),), output=str(tmp_path / "pa"), max_tokens=4096))
    raw = _config(tmp_path / "raw.json", [{"name": "a", "paths": [str(a)]}, {"name": "b", "paths": [str(b)]}])
    mix = _config(tmp_path / "mix.json", [{"name": "a", "paths": [str(tmp_path / "pa")]},
                                          {"name": "b", "paths": [str(b)]}])
    rows = dict(max_tokens=128, num_shards=2)
    pipeline.run(PackOptions(config=pipeline._options.load_config(str(raw), pipeline._options.FormatOptions()),
                             inputs=(), output=str(tmp_path / "direct"), **rows))
    pipeline.run(RepackOptions(config=str(mix), output=str(tmp_path / "again"), rows=tuple(rows.items())))
    assert_same_output(tmp_path / "again", tmp_path / "direct")


# --- refusals: one line each, nothing written that a reader accepts -------------------------------------------------


@pytest.fixture
def packed(tmp_path) -> Path:
    src = write_records(tmp_path / "in" / "d.jsonl", "sft", 20, 6)
    pipeline.run(PackOptions(inputs=(str(src),), output=str(tmp_path / "p"), max_tokens=1024))
    return tmp_path / "p"


def _refused(ropts: RepackOptions) -> str:
    outcome = pipeline.launch(ropts)
    assert outcome.exit_code != 0, outcome
    error = outcome.error
    assert "\n" not in error and "Traceback" not in error
    return error


def test_a_folder_given_twice_is_refused(packed, tmp_path):
    error = _refused(RepackOptions(folders=(str(packed), str(packed) + "/"), output=str(tmp_path / "o")))
    assert "given twice" in error
    assert not (tmp_path / "o").exists()


def test_the_output_equal_to_an_input_is_refused(packed):
    error = _refused(RepackOptions(folders=(str(packed),), output=str(packed)))
    assert "is the packed folder" in error and "-repacked" in error


def test_a_raw_file_is_not_a_packed_folder(tmp_path):
    src = write_records(tmp_path / "d.jsonl", "sft", 3, 1)
    error = _refused(RepackOptions(folders=(str(src),), output=str(tmp_path / "o")))
    assert "not a packed folder" in error and "--config" in error


@pytest.mark.parametrize("damage", ["missing", "altered", "manifest"])
def test_a_damaged_folder_is_refused(packed, tmp_path, damage):
    shard = next(packed.glob("train-*.arrow"))
    if damage == "missing":
        shard.unlink()
    elif damage == "altered":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        m = manifest(packed)
        m["shards"][0]["rows"] += 1
        (packed / "manifest.json").write_text(json.dumps(m))
    outcome = pipeline.launch(RepackOptions(folders=(str(packed),), output=str(tmp_path / "o")))
    assert outcome.exit_code == 2 and "\n" not in outcome.error, outcome
    assert not (tmp_path / "o" / "manifest.json").exists() or manifest(tmp_path / "o")["status"] == "failed"


def test_folders_of_different_tokenizers_are_refused(packed, tmp_path):
    other = tmp_path / "q"
    import shutil

    shutil.copytree(packed, other)
    m = manifest(other)
    m["tokenizer"]["vocab_sha256"] = "0" * 64
    m["inputs"][0]["path"] = str(tmp_path / "elsewhere.jsonl")
    (other / "manifest.json").write_text(json.dumps(m))
    error = _refused(RepackOptions(folders=(str(packed), str(other)), output=str(tmp_path / "o")))
    assert "different tokenizer vocabular" in error


def test_repack_options_refuse_what_pack_refuses(packed, tmp_path):
    with pytest.raises(PackstreamError, match="--max-tokens 4 is out of range"):
        pipeline.run(RepackOptions(folders=(str(packed),), output=str(tmp_path / "o"), rows=(("max_tokens", 4),)))


@pytest.mark.parametrize("offsets", ["backwards", "past_the_end"])
def test_rows_that_break_the_contract_are_refused_naming_the_row(packed, tmp_path, offsets):
    """A shard rewritten with a broken row but a manifest that matches its bytes: the row contract's checks,
    run on every row before an example is cut from it, refuse it in one line naming the shard and the row."""
    import hashlib

    import pyarrow as pa

    shard = next(packed.glob("train-*.arrow"))
    table = pa.ipc.open_stream(pa.memory_map(str(shard))).read_all()
    rows = table.to_pylist()
    seq = rows[-1]["seq_offsets"]
    rows[-1]["seq_offsets"] = ([seq[0], seq[2], seq[1], *seq[3:]] if offsets == "backwards" and len(seq) > 2
                               else [*seq[:-1], seq[-1] + 5])
    broken = pa.Table.from_pylist(rows, schema=table.schema)
    with pa.OSFile(str(shard), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(broken)
    m = manifest(packed)
    data = shard.read_bytes()
    m["shards"][0].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (packed / "manifest.json").write_text(json.dumps(m))
    outcome = pipeline.launch(RepackOptions(folders=(str(packed),), output=str(tmp_path / "o")))
    assert outcome.exit_code == 2 and "\n" not in outcome.error, outcome
    assert f"{shard.name} row {len(rows) - 1}" in outcome.error and "check" in outcome.error
    assert not (tmp_path / "o" / "manifest.json").exists() or manifest(tmp_path / "o")["status"] == "failed"


@pytest.mark.parametrize("long", ["truncate", "split"])
def test_examples_cut_at_the_first_pack_are_carried_marked(tmp_path, long):
    """Cut at budget 48, repacked at 4096: every cut sequence is carried with the mark the first pack gave it
    (``[1, N]`` truncated from N tokens, ``[n, N]`` piece of n), never joined back; the counts say how many, the
    summary and a note say so, and every record is still accounted for."""
    import pyarrow as pa

    src = write_records(tmp_path / "in" / "d.jsonl", "sft", 30, 9, longest=30)
    first = pipeline.run(PackOptions(inputs=(str(src),), output=str(tmp_path / "a"), max_tokens=48, long=long,
                                     max_reject_fraction=1.0))
    cut = first["counts"]["cut_sequences"]
    assert cut["truncated" if long == "truncate" else "pieces"] > 0
    m = pipeline.run(RepackOptions(folders=(str(tmp_path / "a"),), output=str(tmp_path / "b"),
                                   rows=(("max_tokens", 4096),)))
    c = m["counts"]
    assert c["cut_sequences"] == {**cut, "carried": cut["truncated"] + cut["pieces"]}
    assert c["records_read"] == first["counts"]["records_read"] and c["examples_packed"] == first["counts"]["examples_packed"]
    assert any("cut" in n and "carried" in n for n in m["notes"])
    marks = {}
    for shard in m["shards"]:
        for row in pa.ipc.open_stream(pa.memory_map(str(tmp_path / "b" / shard["name"]))).read_all().to_pylist():
            for j, eid in enumerate(row["example_ids"]):
                if row["cuts"] and row["cuts"][2 * j]:
                    marks[eid] = tuple(row["cuts"][2 * j:2 * j + 2])
    assert len(marks) == cut["truncated"] + cut["pieces"]
    for eid, (n, length) in marks.items():
        assert (n == 1) == (long == "truncate") and length > 48
        assert ("#" in eid) == (long == "split")
    from click.testing import CliRunner

    from pipeline.cli import main

    assert CliRunner().invoke(main, ["verify", str(tmp_path / "b")]).exit_code == 0
