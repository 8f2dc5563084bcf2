"""A folder of an older contract version, repacked into the current one, then loaded and verified: the worked example
of docs/repack.md, on a real version-6 folder (tests/data/contract-v6, written by packstream at the last version-6
commit; see tests/data/contract-v6.md).

Version 6 rows carry no cut marks: the pieces its ``--long split`` made (``<id>#k``) are carried as they are, each in
the split and packing group of its whole example, and counted once per record.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import packers
from pipeline.cli import main

V6 = Path(__file__).parent / "data" / "contract-v6"


@pytest.fixture
def v6(tmp_path) -> Path:
    folder = tmp_path / "v6"
    shutil.copytree(V6, folder)  # the test never writes into the repository
    return folder


def test_the_fixture_is_a_version_6_folder():
    m = json.loads((V6 / "manifest.json").read_text())
    assert m["contract_version"] == 6 and m["counts"]["split_examples"] == 3


def test_a_version_6_folder_repacked_loads_and_verifies(v6, tmp_path):
    out = tmp_path / "v6-repacked"
    r = CliRunner().invoke(main, ["repack", str(v6), "-o", str(out), "--max-tokens", "512"])
    assert r.exit_code == 0, r.output
    assert "repacked from" in r.output and "contract version 6" in r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["contract_version"] == packers.CONTRACT_VERSION
    assert m["repacked_from"][0]["contract_version"] == 6
    assert m["repacked_from"][0]["run_id"] == json.loads((v6 / "manifest.json").read_text())["run_id"]
    c = m["counts"]
    assert c["records_read"] == 34 and c["examples_packed"] == 34  # 3 records went in pieces, counted once each
    v = CliRunner().invoke(main, ["verify", str(out)])
    assert v.exit_code == 0, v.output
    pytest.importorskip("torch")
    ds = packers.PackedDataset(str(out), sampling=packers.Sampling(shuffle=False))
    ids = [i for row in ds.rows.data.table.column("example_ids").to_pylist() for i in row]
    pieces = [i for i in ids if "#" in i]
    assert len(ids) == 37 and len(pieces) == 6  # 3 records, 2 pieces each: carried, never joined back
    batch = next(iter(ds))  # rows as the loader yields them, each within the new budget
    assert batch and all(len(row["input_ids"]) == row["num_tokens"] <= 512 for row in batch)


def test_a_repacked_folder_whose_source_changed_fails_verify(v6, tmp_path):
    out = tmp_path / "o"
    assert CliRunner().invoke(main, ["repack", str(v6), "-o", str(out), "-q"]).exit_code == 0
    m = json.loads((v6 / "manifest.json").read_text())
    m["notes"] = ["edited"]
    (v6 / "manifest.json").write_text(json.dumps(m))
    v = CliRunner().invoke(main, ["verify", str(out)])
    assert v.exit_code == 1 and "repacked_from" in v.output and "changed since" in v.output


def test_a_folder_packed_before_the_mask_rule_is_refused_in_one_line(v6, tmp_path):
    m = json.loads((v6 / "manifest.json").read_text())
    m["contract_version"] = 3
    (v6 / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["repack", str(v6), "-o", str(tmp_path / "o")])
    assert r.exit_code == 2
    line = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "contract version 3" in line[0] and "re-run packstream pack on its inputs" in line[0]
