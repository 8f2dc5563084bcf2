"""``packstream verify`` catches deliberately corrupted outputs, one corruption per test.

One small run (the bundled sample plus a few bad records, two shards) is packed once; each test
copies the folder, breaks one thing, and checks that verify names it precisely. Where a
corruption rewrites a shard, the manifest's sha256 and size are usually patched to match, so
that the content check itself must find it, not just the hash.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pytest
from click.testing import CliRunner

import packers
from pipeline import PackOptions, run
from pipeline._verify import verify
from pipeline.cli import bundled_sample, main


def shard_paths(folder) -> list[Path]:
    return sorted(Path(folder).glob("train-*.arrow"))


def read_rows(folder) -> list[dict]:
    """Every row of every shard, in shard order (pyarrow only)."""
    rows = []
    for p in shard_paths(folder):
        rows.extend(pa.ipc.open_stream(p.read_bytes()).read_all().to_pylist())
    return rows


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("verify")
    data = root / "in"
    shutil.copytree(bundled_sample(), data)
    (data / "bad.jsonl").write_text(
        '{"messages": [{"role": "assistant", "content": "hi"}]}\n{broken\n'
        + json.dumps({"text": " ".join(f"w{i}" for i in range(900))}) + "\n"  # too long for 512
    )
    out = root / "out"
    run(PackOptions(inputs=(str(data),), output=str(out), max_tokens=512, num_shards=2))
    return data, out


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


def rewrite_shard(folder: Path, index: int, change: Callable[[list[dict]], list[dict]], fix_hash: bool = True) -> str:
    """Rewrite one shard's rows (same schema and metadata); optionally patch the manifest's hash."""
    import hashlib

    path = shard_paths(folder)[index]
    table = pa.ipc.open_stream(path.read_bytes()).read_all()
    rows = change(table.to_pylist())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(pa.Table.from_pylist(rows, schema=table.schema))
    data = sink.getvalue().to_pybytes()
    path.write_bytes(data)
    if fix_hash:
        m = _manifest(folder)
        for s in m["shards"]:
            if s["name"] == path.name:
                s["sha256"], s["bytes"] = hashlib.sha256(data).hexdigest(), len(data)
        _save_manifest(folder, m)
    return path.name


def problems(folder: Path, inputs=None) -> list[str]:
    return [str(p) for p in verify(str(folder), inputs).problems]


def _only(found: list[str], *words: str) -> None:
    assert found, "verify found nothing"
    assert any(all(w in p for w in words) for p in found), "\n".join(found)


def _multi_row(rows: list[dict]) -> int:
    return next(i for i, r in enumerate(rows) if len(r["example_ids"]) >= 2)


# ------------------------------------------------------------------------------------------------


def test_clean_output_verifies(packed):
    data, out = packed
    report = verify(str(out), (str(data),))
    assert report.ok, "\n".join(map(str, report.problems))
    m = _manifest(out)
    assert report.records == m["counts"]["records_read"] and report.rows == m["counts"]["rows"]
    assert report.dead_letters == 2 + 1  # starts_with_assistant, malformed_json, too_long
    result = CliRunner().invoke(main, ["verify", str(out), "--inputs"])  # the manifest's own inputs
    assert result.exit_code == 0 and result.output.rstrip().endswith("OK"), result.output


def test_flipped_token_breaks_the_hash(copy):
    _, out = copy

    def flip(rows):
        rows[0]["input_ids"][3] += 1
        return rows

    name = rewrite_shard(out, 0, flip, fix_hash=False)
    _only(problems(out), name, "sha256", "manifest.json says")


def test_flipped_token_is_found_by_retokenizing(copy):
    """Hash patched too: only re-tokenizing the inputs can tell, and it names the position."""
    data, out = copy

    def flip(rows):
        rows[0]["input_ids"][3] += 1
        return rows

    name = rewrite_shard(out, 0, flip)
    assert problems(out) == []  # structurally still a valid shard
    found = problems(out, (str(data),))
    _only(found, f"{name} row 0 sequence 0", "input_ids[3] is", "re-tokenizing the input gives")
    assert len(found) == 1


def test_flipped_mask_bit_is_found_by_retokenizing(copy):
    data, out = copy

    def flip(rows):
        rows[0]["loss_mask"][0] ^= 1
        return rows

    rewrite_shard(out, 0, flip)
    _only(problems(out, (str(data),)), "loss_mask[0] is", "re-tokenizing the input gives")


def test_duplicated_row(copy):
    _, out = copy
    name = rewrite_shard(out, 0, lambda rows: rows + [rows[0]])
    found = problems(out)
    _only(found, "appears 2 times", f"{name} row 0 sequence 0")
    _only(found, name, "rows is", "manifest.json says")
    _only(found, "manifest.json counts.rows", "says")


def test_truncated_shard(copy):
    _, out = copy
    path = shard_paths(out)[1]
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    found = problems(out)
    _only(found, path.name, "cannot be read as arrow")
    _only(found, path.name, "bytes is", "manifest.json says")


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

    name = rewrite_shard(out, 0, shift)  # hash patched: the offsets themselves must give it away
    found = problems(out)
    if where == "interior":
        _only(found, f"{name} row {holder['row']} sequence", "not on EOS", "offsets do not match")
    else:
        _only(found, f"{name} row {holder['row']}", "seq_offsets must end at len(input_ids)")


def test_manifest_count_disagrees(copy):
    _, out = copy
    m = _manifest(out)
    m["counts"]["rows"] += 1
    m["counts"]["rejected_by_reason"]["malformed_json"] = 2
    _save_manifest(out, m)
    found = problems(out)
    _only(found, "manifest.json counts.rows", f"says {m['counts']['rows']}", f"hold {m['counts']['rows'] - 1}")
    _only(found, "manifest.json counts.rejected_by_reason", "'malformed_json': 2")


def test_manifest_shard_count_disagrees(copy):
    _, out = copy
    m = _manifest(out)
    m["shards"][0]["examples"] += 1
    _save_manifest(out, m)
    _only(problems(out), m["shards"][0]["name"], "examples is", "manifest.json says")


def test_cli_exits_1_with_a_precise_report(copy):
    _, out = copy

    def flip(rows):
        rows[0]["input_ids"][3] += 1
        return rows

    name = rewrite_shard(out, 0, flip, fix_hash=False)
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 1
    assert f"{name}: sha256 is" in result.output and "FAILED: 1 problem(s)" in result.output


# --- more ways an output can be wrong ------------------------------------------------------------


def test_missing_and_extra_shards_and_leftover_temp_files(copy):
    _, out = copy
    first, second = shard_paths(out)
    second.rename(out / "train-00002-of-00002.arrow")
    (out / ".tmp-train-00000-of-00002.arrow.abc123").write_bytes(b"partial")
    found = problems(out)
    _only(found, second.name, "listed in manifest.json but missing")
    _only(found, "train-00002-of-00002.arrow", "not listed in manifest.json")
    _only(found, ".tmp-train-00000-of-00002.arrow.abc123", "temporary file")


def test_mask_value_out_of_range(copy):
    _, out = copy

    def two(rows):
        rows[0]["loss_mask"][1] = 2
        return rows

    name = rewrite_shard(out, 0, two)
    _only(problems(out), f"{name} row 0", "loss_mask[1] is 2")


def test_schema_change(copy):
    _, out = copy
    path = shard_paths(out)[0]
    table = pa.ipc.open_stream(path.read_bytes()).read_all()
    wide = table.set_column(0, "input_ids", table.column("input_ids").cast(pa.list_(pa.int64())))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, wide.schema) as w:
        w.write_table(wide)
    path.write_bytes(sink.getvalue().to_pybytes())
    _only(problems(out), path.name, "schema is", "expected packers.SCHEMA")


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


def test_lost_record_and_lost_dead_letter(copy):
    """With inputs: a row removed (counts patched) and a dead letter removed are both lost records."""
    data, out = copy
    removed = {}

    def drop_row(rows):
        removed["ids"] = rows[-1]["example_ids"]
        return rows[:-1]

    rewrite_shard(out, 1, drop_row)
    lines = (out / "rejected.jsonl").read_text().splitlines()
    (out / "rejected.jsonl").write_text("\n".join(lines[1:]) + "\n")
    found = problems(out, (str(data),))
    for eid in removed["ids"]:
        _only(found, "should be packed as", repr(eid), "not in any shard")
    first = json.loads(lines[0])
    _only(found, f"input {first['source']}:{first['position']}", "not in rejected.jsonl")


def test_manifest_cannot_point_outside_the_folder(copy, tmp_path):
    _, out = copy
    secret = tmp_path / "secret.arrow"
    secret.write_bytes(b"not yours")
    m = _manifest(out)
    m["shards"][0]["name"] = "../secret.arrow"
    m["rejected_file"] = "../../etc/passwd"
    _save_manifest(out, m)
    found = problems(out)
    _only(found, "'../secret.arrow' is not train-XXXXX-of-NNNNN.<ext>; not opened")
    _only(found, "rejected_file", "not a plain file name; not opened")


def test_outputs_hold_no_pickle(packed):
    """Shards are plain Arrow IPC with the contract's schema (no extension types, which could
    unpickle on read); the manifest, card and dead letters are JSON or text; verify reads them
    with pyarrow and json only."""
    _, out = packed
    for p in shard_paths(out):
        reader = pa.ipc.open_stream(p.read_bytes())
        assert reader.schema.remove_metadata().equals(packers.SCHEMA)
        assert all(f.metadata is None for f in reader.schema)  # no ARROW:extension:* on any field
        assert all(k.startswith(b"packstream.") for k in reader.schema.metadata)
        for value in reader.schema.metadata.values():
            json.loads(value)
    json.loads((out / "manifest.json").read_text())
    for line in (out / "rejected.jsonl").read_text().splitlines():
        json.loads(line)
    import pipeline._verify as v

    assert "pickle" not in Path(v.__file__).read_text().replace("no pickle", "")
