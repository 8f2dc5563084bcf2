"""Readers that trust an edited or failed folder (issue 16, causes 5, 10, 11, 15 and 18, the folder side).

One real ``pack`` output (two train and two validation shards) is packed once; each test copies it, edits
it as a careless or hostile user would, and runs the readers on it (tests/_abuse.py: ``verify``,
``inspect``, ``PackedDataset``, ``pack --overwrite``, each within a time bound).

* **The manifest agrees with itself** (:func:`packers.manifest.inconsistencies`): a shard listed twice,
  one left out of the list, a split label that contradicts the shard's name, counts that do not add up
  are refused before any shard is opened.
* **And with the shards** (their schema metadata: run id, split, index, count). Edits that keep the
  manifest consistent (files renamed, every count recomputed) are caught there:

  =====================================  =====================================================
  edit (manifest recomputed to match)    caught by
  =====================================  =====================================================
  a shard copied in under a new name     the copy's shard_index (0, its name says 2), the
                                         others' shard_count (2, renamed of-00003)
  a shard and its entry removed          shard_count (2, the remaining name says of-00001)
  validation shards relabelled train     split (validation, the name says train)
  another run's shard, entry copied too  run_id
  =====================================  =====================================================

* **Every key typed**: an edited type (``status: []``, ``counts: []``, ``counts.records_read: null``)
  is one line from every reader, never a TypeError.
* **Folder files that are not files**: ``manifest.json`` or ``rejected.jsonl`` as a link to /dev/zero, a
  FIFO, nested 100,000 levels deep or 100 MiB large; a listed shard that is a FIFO.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from packers import ContractError, PackedDataset, PackstreamError, Sampling
from pipeline import PackOptions, run
from pipeline.cli import bundled_sample, main
from tests._internals import verify
from tests._abuse import READERS, deadline, outcome, outcomes, replace_file
from tests._shards import recount


@pytest.fixture(scope="module")
def packed(small_run) -> Path:
    names = sorted(p.name for p in small_run.glob("*.arrow"))
    assert names == ["train-00000-of-00002.arrow", "train-00001-of-00002.arrow",
                     "validation-00000-of-00002.arrow", "validation-00001-of-00002.arrow"], names
    return small_run


@pytest.fixture
def out(packed, tmp_path) -> Path:
    dst = tmp_path / "out"
    shutil.copytree(packed, dst)
    return dst


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def save(folder: Path, m: dict) -> None:
    (folder / "manifest.json").write_text(json.dumps(m, indent=2, sort_keys=True))


def rows_of(folder: Path, name: str) -> list[tuple]:
    return [tuple(r) for r in pa.ipc.open_stream((folder / name).read_bytes()).read_all()
            .column("example_ids").to_pylist()]


def reshape(folder: Path, renames: dict[str, str | None], copies: dict[str, str] | None = None) -> dict:
    """Rename (or, for None, delete) shard files and copy some to new names, then rewrite the manifest to match
    exactly, as a careful editor would: names, splits, files, and every count derived from the entries."""
    m = manifest(folder)
    by_name = {e["name"]: e for e in m["shards"]}
    for src, new in (copies or {}).items():
        shutil.copy(folder / src, folder / f".copy-{new}")
    for old, new in renames.items():
        if new is None:
            (folder / old).unlink()
        else:
            (folder / old).rename(folder / f".copy-{new}")
    shards = [e for e in m["shards"] if e["name"] not in renames]
    shards += [{**by_name[old], "name": new, "split": new.split("-")[0]} for old, new in renames.items() if new]
    shards += [{**by_name[src], "name": new, "split": new.split("-")[0]} for src, new in (copies or {}).items()]
    for new in [n for n in renames.values() if n] + list((copies or {}).values()):
        (folder / f".copy-{new}").rename(folder / new)
    m["shards"] = sorted(shards, key=lambda e: e["name"])
    m["files"] = sorted(e["name"] for e in shards) + [f for f in m["files"] if not f.endswith(".arrow")]
    m["counts"] = recount(m["counts"], m["shards"], m["row_checks"]["budget"])
    save(folder, m)
    return m


def served(folder: Path, split: str = "train") -> list[tuple]:
    return [tuple(r["example_ids"]) for r in PackedDataset(folder, split=split, sampling=Sampling(shuffle=False)).rows]


# -- cause 5: the loader opened folders whose manifest was edited ----------------------------------------------


def test_a_shard_listed_twice_is_refused(out):
    m = manifest(out)
    m["shards"].append(dict(m["shards"][0]))  # the same entry twice: every example of it served twice
    m["counts"] = recount(m["counts"], m["shards"], m["row_checks"]["budget"])
    save(out, m)
    with pytest.raises(ContractError, match=r"manifest.json shards \(train-00000-of-00002.arrow\) lists "
                                            r"train-00000-of-00002.arrow 2 times"):
        PackedDataset(out)
    assert any("2 times" in str(p) for p in verify(str(out), announce=lambda line: None).problems)


def test_a_shard_copied_in_under_a_new_name_is_refused(out, packed):
    twice = rows_of(out, "train-00000-of-00002.arrow")
    reshape(out, {"train-00000-of-00002.arrow": "train-00000-of-00003.arrow",
                  "train-00001-of-00002.arrow": "train-00001-of-00003.arrow"},
            copies={"train-00000-of-00002.arrow": "train-00002-of-00003.arrow"})
    with pytest.raises(ContractError, match=r"out/train-0000\d-of-00003.arrow: schema metadata shard_(count|index) is "
                                            r"\d, manifest.json says \d: the shard is another shard's file"):
        assert len(served(out)) == len(served(packed)) + len(twice)  # (what the loader did before)
    found = [str(p) for p in verify(str(out), announce=lambda line: None).problems]
    assert any("train-00002-of-00003.arrow schema metadata shard_index" in p for p in found), found


def test_a_shard_removed_from_the_list_is_refused(out):
    m = manifest(out)
    m["shards"] = [e for e in m["shards"] if e["name"] != "train-00001-of-00002.arrow"]
    m["files"].remove("train-00001-of-00002.arrow")
    m["counts"] = recount(m["counts"], m["shards"], m["row_checks"]["budget"])
    (out / "train-00001-of-00002.arrow").unlink()
    save(out, m)
    with pytest.raises(ContractError, match=r"manifest.json shards \(train\) indices \[0\], expected 0..1 once each "
                                            r"\(index 1 is not listed\)"):
        PackedDataset(out)


def test_a_shard_removed_and_the_rest_renumbered_is_refused(out, packed):
    reshape(out, {"train-00001-of-00002.arrow": None, "train-00000-of-00002.arrow": "train-00000-of-00001.arrow"})
    with pytest.raises(ContractError, match=r"train-00000-of-00001.arrow: schema metadata shard_count is 2, "
                                            r"manifest.json says 1"):
        assert len(served(out)) < len(served(packed))  # half the data, silently (what the loader did before)


def test_a_split_label_changed_is_refused(out):
    m = manifest(out)
    for e in m["shards"]:
        if e["name"].startswith("validation"):
            e["split"] = "train"  # validation rows served as train
    m["counts"] = recount(m["counts"], m["shards"], m["row_checks"]["budget"])
    save(out, m)
    with pytest.raises(ContractError, match=r"manifest.json shards \(validation-00000-of-00002.arrow\) has split "
                                            r"'train', but its name says 'validation'"):
        PackedDataset(out)


def test_validation_shards_relabelled_and_renamed_train_are_refused(out, packed):
    reshape(out, {"train-00000-of-00002.arrow": "train-00000-of-00004.arrow",
                  "train-00001-of-00002.arrow": "train-00001-of-00004.arrow",
                  "validation-00000-of-00002.arrow": "train-00002-of-00004.arrow",
                  "validation-00001-of-00002.arrow": "train-00003-of-00004.arrow"})
    with pytest.raises(ContractError, match=r"train-0000\d-of-00004.arrow: schema metadata (split|shard_index|"
                                            r"shard_count) is .*, manifest.json says"):
        assert len(served(out)) == len(served(packed)) + len(served(packed, "validation"))
    found = [str(p) for p in verify(str(out), announce=lambda line: None).problems]
    assert any("train-00002-of-00004.arrow schema metadata split: is 'validation', manifest.json says 'train'" in p
               for p in found), found


def test_a_shard_from_another_run_under_a_listed_name_is_refused(out, tmp_path):
    """Same name, same size by chance or by padding: the run id in its metadata says whose it is."""
    other = tmp_path / "other"
    run(PackOptions(inputs=(bundled_sample(),), output=str(other), max_tokens=512, num_shards=2, group_size=8,
                    validation_fraction=0.25, seed=7))
    name = "train-00001-of-00002.arrow"
    shutil.copy(other / name, out / name)
    reshape(out, {})  # counts recomputed; then make the entry describe the foreign file exactly
    m = manifest(out)
    theirs = next(e for e in manifest(other)["shards"] if e["name"] == name)
    m["shards"] = [theirs if e["name"] == name else e for e in m["shards"]]
    m["counts"] = recount(m["counts"], m["shards"], m["row_checks"]["budget"])
    save(out, m)
    with pytest.raises(ContractError, match=rf"out/{name}: schema metadata run_id is '[0-9a-f]{{16}}', manifest.json "
                                            r"says '[0-9a-f]{16}'"):
        PackedDataset(out)


def test_every_shard_carries_its_place(packed):
    m = manifest(packed)
    assert len(m["run_id"]) == 16
    for e in m["shards"]:
        meta = pa.ipc.open_stream((packed / e["name"]).read_bytes()).schema.metadata
        place = {k.decode().split(".", 1)[1]: json.loads(v) for k, v in meta.items()
                 if k.decode().split(".", 1)[1] in ("run_id", "split", "shard_index", "shard_count")}
        split, index, _, count = e["name"].replace(".arrow", "").split("-")
        assert place == {"run_id": m["run_id"], "split": split, "shard_index": int(index), "shard_count": int(count)}


# -- cause 18: edited types are one line, never a TypeError -----------------------------------------------------


EDITS = {
    "status: []": lambda m: m.update(status=[]),
    "counts: []": lambda m: m.update(counts=[]),
    "counts.records_read: null": lambda m: m["counts"].update(records_read=None),
    "counts.rejected_by_reason: 3": lambda m: m["counts"].update(rejected_by_reason=3),
    "counts.splits.train: 5": lambda m: m["counts"]["splits"].update(train=5),
    "shards[0]: 'x'": lambda m: m["shards"].__setitem__(0, "x"),
    "shards[0].rows: -1": lambda m: m["shards"][0].update(rows=-1),
    "shards[0].tokens: 1e400": lambda m: m["shards"][0].update(tokens=float("inf")),
    "shards[0].split missing": lambda m: m["shards"][0].pop("split"),
    "tokenizer: 'x'": lambda m: m.update(tokenizer="x"),
    "tokenizer.eos_token_id: '1'": lambda m: m["tokenizer"].update(eos_token_id="1"),
    "row_checks.budget: true": lambda m: m["row_checks"].update(budget=True),
    "config: null": lambda m: m.update(config=None),
    "inputs: {}": lambda m: m.update(inputs={}),
    "files: [1]": lambda m: m.update(files=[1]),
    "files: ../x": lambda m: m["files"].append("../x"),
    "run_id: 7": lambda m: m.update(run_id=7),
    "run_id with a newline": lambda m: m.update(run_id=m["run_id"] + "\n"),
    "shards[0].name with a newline": lambda m: m["shards"][0].update(name=m["shards"][0]["name"] + "\n"),
    "a huge integer": lambda m: m["counts"].update(rows=10**500),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_edited_manifest_types_are_refused_in_one_line(out, edit):
    m = manifest(out)
    EDITS[edit](m)
    save(out, m)
    got = outcomes(out)
    for name in ("verify", "inspect", "PackedDataset"):
        assert got[name] and "manifest.json" in got[name], (name, got[name])
    if edit.startswith(("status", "files")):  # what pack --overwrite relies on: which files a run wrote
        assert got["pack --overwrite"] and "manifest.json" in got["pack --overwrite"], got
    else:
        assert got["pack --overwrite"] is None, got  # the rest does not decide what --overwrite may remove


def test_cli_refusals_are_one_error_line(out, tmp_path):
    m = manifest(out)
    m["counts"]["records_read"] = None
    save(out, m)
    for args, code in ((["verify", str(out)], 1), (["inspect", str(out), "--no-plots"], 2)):
        r = CliRunner().invoke(main, args)
        assert r.exit_code == code and "Traceback" not in r.output, r.output
        assert "counts.records_read is None, expected an integer >= 0" in r.output
    m["status"] = []
    save(out, m)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"instruction": "hi", "output": "hello"}) + "\n")
    r = CliRunner().invoke(main, ["pack", str(src), "-o", str(out), "--overwrite", "-q"])
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "manifest.json cannot be trusted" in errors[0], r.output
    assert (out / "train-00000-of-00002.arrow").exists()  # nothing was removed


# -- causes 10, 11, 15: folder files that are not files ---------------------------------------------------------


KINDS = ["link to /dev/zero", "FIFO", "deep", "100 MiB"]  # tests/_abuse.py: replace_file


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"), reason="needs FIFOs and /dev/zero")
@pytest.mark.parametrize("kind", KINDS)
def test_manifest_that_is_not_a_file_is_one_line(out, kind):
    replace_file(out / "manifest.json", kind)
    got = outcomes(out)
    words = {"link to /dev/zero": "is a device", "FIFO": "is a FIFO", "deep": "nested deeper than",
             "100 MiB": "more than the 64 MiB"}[kind]
    for name, said in got.items():
        assert said and words in said, (name, said)


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"), reason="needs FIFOs and /dev/zero")
@pytest.mark.parametrize("kind", KINDS)
def test_dead_letters_that_are_not_a_file_are_one_line(out, kind):
    replace_file(out / "rejected.jsonl", kind)
    got = outcomes(out)
    words = {"link to /dev/zero": "is a device", "FIFO": "is a FIFO", "deep": "nested deeper than",
             "100 MiB": "line 1 is longer than"}[kind]
    assert got["verify"] and words in got["verify"] and got["verify"].startswith("rejected.jsonl"), got["verify"]
    for name in ("inspect", "PackedDataset", "pack --overwrite"):  # they do not read rejected.jsonl
        assert got[name] is None, (name, got[name])


def test_a_big_dead_letter_file_is_read_line_by_line(out, monkeypatch):
    """rejected.jsonl may be large: read one line at a time, each line within the cap (lowered here)."""
    from tests._internals import _verify_folder as v  # where rejected.jsonl is read

    lines = (out / "rejected.jsonl").read_text().splitlines()
    assert len(lines) == 3
    assert verify(str(out), announce=lambda line: None).ok
    monkeypatch.setattr(v, "MAX_DEAD_LETTER_BYTES", max(len(x) for x in lines) + 1)
    assert verify(str(out), announce=lambda line: None).ok
    monkeypatch.setattr(v, "MAX_DEAD_LETTER_BYTES", 16)
    found = [str(p) for p in verify(str(out), announce=lambda line: None).problems]
    assert found == ["rejected.jsonl: cannot be read: rejected.jsonl " + str(out / "rejected.jsonl")
                     + " line 1 is longer than 16 bytes; this is not a file packstream wrote: restore the folder or "
                       "re-run packstream pack"], found


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_listed_shard_that_is_a_fifo(out):
    name = "train-00001-of-00002.arrow"
    (out / name).unlink()
    os.mkfifo(out / name)
    got = outcomes(out, ("verify", "inspect", "PackedDataset"))
    for reader, said in got.items():
        assert said and f"{name} is a FIFO" in said, (reader, said)
    (out / name).unlink()
    (out / name).symlink_to("/dev/zero")
    got = outcomes(out, ("verify", "inspect", "PackedDataset"))
    for reader, said in got.items():
        assert said and f"{name} is a device" in said, (reader, said)


def test_readers_work_on_the_untouched_folder(out):
    assert outcomes(out) == dict.fromkeys(READERS)


def test_deadline_interrupts_a_blocking_open(tmp_path):
    """The bound the tests rely on: a FIFO opened the plain way blocks, and the deadline ends it."""
    from tests._abuse import Overran

    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(Overran):
        with deadline(0.5):
            open(tmp_path / "fifo", "rb")
    assert outcome("verify", tmp_path) and "no manifest.json" in outcome("verify", tmp_path)
    with pytest.raises(PackstreamError):
        PackedDataset(tmp_path)


def test_paths_the_loader_cannot_open_are_one_line(tmp_path):
    with pytest.raises(PackstreamError, match="nosuchproto://x"):
        PackedDataset("nosuchproto://x/out")
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "manifest.json").write_text("{}")
    if os.geteuid() != 0:  # root reads any folder
        locked.chmod(0)
        with pytest.raises(PackstreamError, match="cannot be listed"):
            PackedDataset(locked)
        locked.chmod(0o700)
