"""PackedDataset trusts only a complete manifest.json (issue 10, "Safe by construction").

Each kind of damage the issue lists, done to a good output folder, must be refused, with a message
that names the shard (and for a row check, the row, the sequence and the check):

==========================  ======================================================================
damage                      caught by
==========================  ======================================================================
flipped token               sha256, with ``verify=True`` (same size, and every row still valid)
prompt tokens -> targets    sha256, with ``verify=True``
boundary moved by 3         the row check at read time: ``eos_at_boundaries``
a row removed               the size check: bytes differ from the manifest's
stray backup-*.arrow        unlisted file, refused by name
two runs mixed              unlisted files (other names), or the size check (same names)
no / failed manifest, lock  refused before any shard is opened
==========================  ======================================================================

The last test does the same damage to randomly shaped runs in folders with unusual names (the
held-out check): each must end the same way.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from packers import Batching, ContractError, PackedDataset, PackstreamError, Sampling
from packers.rowcheck import Batch, gather, check_batch
from packers.manifest import RowChecks
from tests._shards import Example, pack_first_fit, recount, write_manifest, write_shards

BUDGET = 64
EOS = 1
SHARD = "train-00001-of-00003.arrow"


def eos_examples(n: int, *, seed: int, budget: int = BUDGET, min_len: int = 8, vocab: int = 128) -> list[Example]:
    """Examples as a real run packs them: a prompt (mask 0), then targets ending with EOS (mask 1).

    EOS appears only at the end of each example, so a moved boundary lands on a non-EOS token.
    """
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(min_len, min(40, budget) + 1))
        prompt = int(rng.integers(1, length - 1))
        ids = rng.integers(2, vocab, size=length - 1).tolist() + [EOS]
        out.append(Example(f"ex:{seed}:{i}", ids, [0] * prompt + [1] * (length - prompt)))
    return out


def make_run(folder: Path, *, seed: int = 0, budget: int = BUDGET, num_shards: int = 3, n: int = 200) -> list[dict]:
    rows = pack_first_fit(eos_examples(n, seed=seed, budget=budget), budget)
    write_shards(folder, rows, budget=budget, num_shards=num_shards, eos_token_id=EOS)
    return rows


@pytest.fixture
def run(tmp_path) -> Path:
    folder = tmp_path / "out"
    make_run(folder)
    m = json.loads((folder / "manifest.json").read_text())
    assert m["row_checks"] == {"budget": BUDGET, "eos_token_id": EOS, "eos_at_boundaries": True,
                               "targets_in_every_sequence": True, "all_targets": False, "pairs": False}
    assert len(PackedDataset(folder, verify=True).rows) == sum(s["rows"] for s in m["shards"])  # the good folder reads
    return folder


def read(path: Path) -> pa.Table:
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_stream(src).read_all()


def rewrite(path: Path, edit, schema: pa.Schema | None = None) -> None:
    """Rewrite a shard as the writer does (one stream, its schema and metadata) after ``edit(rows)``."""
    table = read(path)
    schema = schema or table.schema
    rows = table.to_pylist()
    edit(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        w.write_table(pa.Table.from_pylist(rows, schema=schema))


def reseal(folder: Path) -> None:
    """Make the manifest agree with the shards' bytes again (as a buggy writer would), keeping its row_checks:
    then only the row checks stand between a broken row and training."""
    import hashlib

    m = json.loads((folder / "manifest.json").read_text())
    for s in m["shards"]:
        data = (folder / s["name"]).read_bytes()
        t = read(folder / s["name"])
        s.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), rows=t.num_rows,
                 tokens=sum(t.column("num_tokens").to_pylist()), examples=sum(len(x or []) for x in t.column("example_ids").to_pylist()))
        s["target_tokens"] = min(s["target_tokens"], s["tokens"])
    m["counts"] = recount(m["counts"], m["shards"], m["row_checks"]["budget"])
    (folder / "manifest.json").write_text(json.dumps(m))


def read_everything(folder: Path) -> None:
    ds = PackedDataset(folder, batching=Batching(batch_size=4))
    for _ in ds:  # one epoch, as training reads it
        pass


# -- same-size edits of a shard's bytes: sha256 (verify=True) ----------------------------------------


def test_flipped_token_is_caught_by_verify(run):
    size = (run / SHARD).stat().st_size

    def flip(rows):
        rows[2]["input_ids"][1] += 1  # inside the first example, not at a boundary: every row check still holds

    rewrite(run / SHARD, flip)
    assert (run / SHARD).stat().st_size == size
    read_everything(run)  # what verify=True is for: a valid-looking edit passes the size and row checks
    with pytest.raises(ContractError, match=rf"out/{SHARD}: check sha256 failed: .*manifest.json says"):
        PackedDataset(run, verify=True)


def test_prompt_switched_to_targets_is_caught_by_verify(run):
    def to_targets(rows):
        rows[0]["loss_mask"] = [1] * len(rows[0]["loss_mask"])  # the prompts of every example in the row

    rewrite(run / SHARD, to_targets)
    with pytest.raises(ContractError, match=rf"out/{SHARD}: check sha256 failed"):
        PackedDataset(run, verify=True)


# -- rows checked as they are read ---------------------------------------------------------------------


@pytest.mark.parametrize("shift", [3, -3])
def test_boundary_moved_is_caught_when_the_row_is_read(run, shift):
    size = (run / SHARD).stat().st_size
    first_id = {}

    def move(rows):
        rows[4]["seq_offsets"][1] += shift  # example 0 now ends 3 tokens late (early): it sees its neighbour
        first_id["id"] = rows[4]["example_ids"][0]

    rewrite(run / SHARD, move)
    assert (run / SHARD).stat().st_size == size
    ds = PackedDataset(run)  # opening checks files, not rows
    pattern = (rf"out/{SHARD} row 4 sequence 0 \({first_id['id']}\): check eos_at_boundaries failed: ends on token "
               rf"\d+, not on eos_token_id {EOS}")
    with pytest.raises(ContractError, match=pattern):
        read_everything(run)
    with pytest.raises(ContractError, match=pattern):
        ds.check_rows()
    with pytest.raises(ContractError, match=pattern):  # also from a DataLoader worker
        list(ds.dataloader(num_workers=1))
    with pytest.raises(ContractError, match=rf"out/{SHARD}: check sha256 failed"):
        PackedDataset(run, verify=True)


@pytest.mark.parametrize(
    "edit,check",
    [
        (lambda r: r.update(seq_offsets=[0] + r["seq_offsets"][2:] + r["seq_offsets"][1:2]), "seq_offsets"),
        (lambda r: r.update(seq_offsets=r["seq_offsets"][:-1] + [r["seq_offsets"][-1] - 1]), "seq_offsets"),
        (lambda r: r.update(num_tokens=r["num_tokens"] + 1), "num_tokens"),
        (lambda r: r.update(loss_mask=r["loss_mask"][:-1]), "loss_mask_length"),
        (lambda r: r.update(loss_mask=[2] + r["loss_mask"][1:]), "loss_mask_values"),
        (lambda r: r.update(example_ids=r["example_ids"][:-1]), "example_ids"),
        (lambda r: r.update(loss_mask=[0] * r["seq_offsets"][1] + r["loss_mask"][r["seq_offsets"][1]:]),
         "targets_in_every_sequence"),
    ],
    ids=["offsets-not-increasing", "offsets-end", "num_tokens", "mask-length", "mask-value", "example-ids", "no-targets"],
)
def test_each_row_check_names_shard_row_and_check(run, edit, check):
    def apply(rows):
        edit(rows[6])

    rewrite(run / SHARD, apply)
    reseal(run)  # sizes, sha256 and counts agree: the row itself is what is wrong
    ds = PackedDataset(run, verify=True, sampling=Sampling(shuffle=False))
    with pytest.raises(ContractError, match=rf"out/{SHARD} row 6\b.*: check {check} failed"):
        ds.check_rows()


def test_row_over_budget_and_all_targets(tmp_path):
    folder = tmp_path / "all"
    rows = pack_first_fit([Example(e.id, e.input_ids, [1] * len(e.input_ids)) for e in eos_examples(60, seed=1)], BUDGET)
    write_shards(folder, rows, budget=BUDGET, eos_token_id=EOS)
    assert json.loads((folder / "manifest.json").read_text())["row_checks"]["all_targets"]
    name = "train-00000-of-00001.arrow"
    rewrite(folder / name, lambda rows: rows[3]["loss_mask"].__setitem__(-2, 0))
    with pytest.raises(ContractError, match=rf"{name} row 3 sequence \d+ \(.*\): check all_targets failed"):
        PackedDataset(folder).check_rows()

    def grow(rows):  # a row longer than the budget (its offsets and lengths consistent)
        r = rows[0]
        r["input_ids"] += [5] * (BUDGET - len(r["input_ids"])) + [EOS]
        r["loss_mask"] = [1] * len(r["input_ids"])
        r["seq_offsets"][-1] = r["num_tokens"] = len(r["input_ids"])

    write_shards(folder, rows, budget=BUDGET, eos_token_id=EOS)
    rewrite(folder / name, grow)
    reseal(folder)  # even a manifest that agrees with the file does not make the row legal
    with pytest.raises(ContractError, match=rf"{name} row 0: check budget failed: {BUDGET + 1} tokens > budget {BUDGET}"):
        PackedDataset(folder).check_rows()


# -- file-level damage: refused when the dataset is opened --------------------------------------------


def test_row_removed_is_caught_by_size(run):
    rewrite(run / SHARD, lambda rows: rows.pop(3))
    with pytest.raises(ContractError, match=rf"out/{SHARD}: [\d,]+ bytes, manifest.json says [\d,]+: the shard was changed"):
        PackedDataset(run)


def test_stray_backup_is_refused_by_name(run):
    shutil.copy(run / "train-00000-of-00003.arrow", run / "backup-00000-of-00003.arrow")
    with pytest.raises(ContractError, match=r"out: backup-00000-of-00003.arrow: not listed in manifest.json; .*"
                                            r"remove it, or re-run packstream pack"):
        PackedDataset(run)
    with pytest.raises(ContractError, match="backup-00000-of-00003.arrow: not listed"):  # naming one shard: same rule
        PackedDataset(run / "train-00000-of-00003.arrow")


def test_two_runs_mixed_are_refused(run, tmp_path):
    other = tmp_path / "other"
    make_run(other, seed=7, num_shards=2, n=150)
    for p in other.glob("*.arrow"):  # another run's shards copied in: names this manifest does not list
        shutil.copy(p, run / p.name)
    with pytest.raises(ContractError, match=r"train-00000-of-00002.arrow: not listed in manifest.json \(and 1 more"
                                            r".*a shard of another run"):
        PackedDataset(run)
    shutil.copy(other / "manifest.json", run / "manifest.json")  # ... and its manifest: now the first run's are unlisted
    with pytest.raises(ContractError, match=r"train-00000-of-00003.arrow: not listed in manifest.json"):
        PackedDataset(run)

    same = tmp_path / "same"
    make_run(same, seed=8, num_shards=3, n=120)
    fresh = tmp_path / "fresh"
    make_run(fresh)
    shutil.copy(same / SHARD, fresh / SHARD)  # the same name from another run replaces this run's shard
    with pytest.raises(ContractError, match=rf"fresh/{SHARD}: [\d,]+ bytes, manifest.json says"):
        PackedDataset(fresh)


def test_no_manifest_is_refused(run):
    (run / "manifest.json").unlink()
    with pytest.raises(ContractError, match="out: shard files but no manifest.json: not a finished packstream output"):
        PackedDataset(run)
    for p in run.iterdir():
        p.unlink()
    with pytest.raises(ContractError, match="out: no manifest.json; point at the --output folder"):
        PackedDataset(run)


def test_failed_run_is_refused(run):
    write_manifest(run, status="failed", error="exit 3: 12 records could not be read")
    with pytest.raises(ContractError, match=r"run that wrote this folder failed \(exit 3: 12 records could not be read\)"):
        PackedDataset(run)


def test_lock_is_refused(run):
    (run / ".packstream.lock").write_text('{"pid": 1}')
    with pytest.raises(ContractError, match=r"\.packstream\.lock is present: a packstream run .* is rewriting"):
        PackedDataset(run)  # a complete manifest, but a run holds the folder
    (run / "manifest.json").unlink()
    with pytest.raises(ContractError, match=r"no manifest.json, and \.packstream\.lock is present"):
        PackedDataset(run)


def test_listed_shard_missing_is_refused(run):
    (run / SHARD).unlink()
    with pytest.raises(ContractError, match=rf"out/{SHARD}: listed in manifest.json but missing from the folder"):
        PackedDataset(run)


def test_metadata_mismatch_is_refused(run):
    schema = read(run / SHARD).schema
    meta = dict(schema.metadata)
    meta[b"packstream.tokenizer_vocab_sha256"] = json.dumps("1" * 64).encode()  # same length: same size
    rewrite(run / SHARD, lambda rows: None, schema.with_metadata(meta))
    with pytest.raises(ContractError, match=rf"out/{SHARD}: schema metadata tokenizer_vocab_sha256 is '1111.*"
                                            r"manifest.json says '0000"):
        PackedDataset(run)


def test_other_leftovers_and_datasets_caches(run):
    (run / ".tmp-train-00002-of-00003.arrow").write_bytes(b"")
    with pytest.raises(ContractError, match=r"\.tmp-train-00002-of-00003.arrow: not listed .*temporary file"):
        PackedDataset(run)
    (run / ".tmp-train-00002-of-00003.arrow").unlink()
    (run / "cache-0123456789abcdef.arrow").write_bytes(b"")  # what datasets writes beside a file it maps
    (run / "cache-0123456789abcdef_00001_of_00004.arrow").write_bytes(b"")  # ... with num_proc
    PackedDataset(run)
    (run / "cache-mine.arrow").write_bytes(b"")  # not a datasets fingerprint: refused like any other
    with pytest.raises(ContractError, match="cache-mine.arrow: not listed"):
        PackedDataset(run)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: m.pop("row_checks"), "no 'row_checks' object"),
        (lambda m: m["row_checks"].update(budget="64"), r"row_checks.budget is '64'"),
        (lambda m: m["config"].update(max_tokens=128), r"row_checks.budget is 64 but config.max_tokens is 128"),
        (lambda m: m.update(contract_version=99), "contract_version is 99"),
        (lambda m: m["shards"][0].update(sha256="x"), r"shards\[0\].sha256 is 'x'"),
        (lambda m: m.update(status="done"), "status 'done'"),
    ],
)
def test_malformed_manifest_is_refused(run, edit, message):
    m = json.loads((run / "manifest.json").read_text())
    edit(m)
    (run / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ContractError, match=message):
        PackedDataset(run)
    (run / "manifest.json").write_text("{not json")
    with pytest.raises(ContractError, match="manifest.json: not valid JSON"):
        PackedDataset(run)


# -- held-out: the same damage to runs and paths the tests above have not seen -------------------------


KINDS = ["token", "mask", "boundary", "row_removed", "stray", "mixed", "no_manifest", "failed", "missing", "metadata"]


@pytest.mark.parametrize("seed", range(12))
def test_held_out_damage_ends_the_same_way(tmp_path, seed):
    rng = np.random.default_rng(1000 + seed)
    budget = int(rng.choice([32, 48, 100, 257]))
    shards = int(rng.integers(1, 5))
    folder = tmp_path / f"run ünï #{seed} (copy)" / "data.v2"
    rows = make_run(folder, seed=2000 + seed, budget=budget, num_shards=shards, n=int(rng.integers(60, 160)))
    counts = [s["rows"] for s in json.loads((folder / "manifest.json").read_text())["shards"]]
    k = int(rng.choice([i for i, c in enumerate(counts) if c > 0]))
    name = f"train-{k:05d}-of-{shards:05d}.arrow"
    r = int(rng.integers(0, counts[k]))
    kind = KINDS[seed % len(KINDS)] if seed < len(KINDS) else str(rng.choice(KINDS))
    where = rf"{folder.name}/{name}"

    if kind == "token":
        rewrite(folder / name, lambda rows: rows[r]["input_ids"].__setitem__(0, rows[r]["input_ids"][0] + 1))
        expect, opts = rf"{where}: check sha256 failed", {"verify": True}
    elif kind == "mask":
        rewrite(folder / name, lambda rows: rows[r].update(loss_mask=[1] * len(rows[r]["loss_mask"])))
        expect, opts = rf"{where}: check sha256 failed", {"verify": True}
    elif kind == "boundary":
        def move(rows):
            offs = rows[r]["seq_offsets"]
            if len(offs) > 2:  # move an inner boundary 3 tokens within its neighbours
                offs[1] = offs[1] + 3 if offs[2] - offs[1] > 3 else offs[1] - 3
            else:  # one example: its end moves back 3, so the row ends early
                offs[1] -= 3
        rewrite(folder / name, move)
        expect, opts = rf"{where} row {r}\b.*: check (eos_at_boundaries|seq_offsets) failed", {}
    elif kind == "row_removed":
        rewrite(folder / name, lambda rows: rows.pop(r))
        expect, opts = rf"{where}: [\d,]+ bytes, manifest.json says", {}
    elif kind == "stray":
        stray = f"{name.split('-')[0]}-copy-{k:05d}.arrow"
        shutil.copy(folder / name, folder / stray)
        expect, opts = rf"{stray}: not listed in manifest.json", {}
    elif kind == "mixed":
        other = tmp_path / "other"
        make_run(other, seed=3000 + seed, budget=budget, num_shards=shards + 1, n=80)
        for p in other.glob("*.arrow"):
            shutil.copy(p, folder / p.name)
        expect, opts = rf"train-00000-of-{shards + 1:05d}.arrow: not listed in manifest.json", {}
    elif kind == "no_manifest":
        (folder / "manifest.json").unlink()
        expect, opts = "shard files but no manifest.json", {}
    elif kind == "failed":
        write_manifest(folder, status="failed", error=f"killed by signal {seed}")
        expect, opts = rf"failed \(killed by signal {seed}\)", {}
    elif kind == "missing":
        (folder / name).unlink()
        expect, opts = rf"{where}: listed in manifest.json but missing", {}
    else:
        schema = read(folder / name).schema
        rewrite(folder / name, lambda rows: None,
                schema.with_metadata({**schema.metadata, b"packstream.eos_token_id": b"7"}))
        expect, opts = rf"{where}: schema metadata eos_token_id is 7, manifest.json says {EOS}", {}

    with pytest.raises(PackstreamError, match=expect):
        PackedDataset(folder, **opts).check_rows()
    assert rows  # the run was not empty


def test_check_batch_accepts_every_valid_row_and_flags_the_first_broken_one():
    """Row checks over random valid batches: nothing flagged; then one moved boundary: that row, that sequence."""
    rng = np.random.default_rng(0)
    checks = RowChecks(budget=BUDGET, eos_token_id=EOS, eos_at_boundaries=True, targets_in_every_sequence=True,
                       all_targets=False)
    for trial in range(30):
        rows = pack_first_fit(eos_examples(int(rng.integers(1, 40)), seed=trial), BUDGET)
        table = pa.Table.from_pylist(rows, schema=read_schema())
        b = gather(table, check=True)
        assert isinstance(b, Batch) and check_batch(b, checks) is None
        multi = [i for i, r in enumerate(rows) if len(r["seq_offsets"]) > 2]
        if not multi:
            continue
        i = int(rng.choice(multi))
        rows[i]["seq_offsets"][1] += 3 if rows[i]["seq_offsets"][2] - rows[i]["seq_offsets"][1] > 3 else -3
        f = check_batch(gather(pa.Table.from_pylist(rows, schema=read_schema()), check=True), checks)
        assert (f.row, f.check, f.sequence) == (i, "eos_at_boundaries", 0), trial


def read_schema() -> pa.Schema:
    from packers import SCHEMA

    return SCHEMA


def test_nulls_are_refused_by_row(run):
    """The schema says non-null, but Arrow does not enforce it: a null list or value is a broken row too."""
    rewrite(run / SHARD, lambda rows: rows[7]["input_ids"].__setitem__(3, None))
    reseal(run)
    with pytest.raises(ContractError, match=rf"out/{SHARD} row 7: check nulls failed: input_ids holds a null value"):
        PackedDataset(run, sampling=Sampling(shuffle=False)).check_rows()
    def swap(rows):
        rows[7]["input_ids"][3] = 5
        rows[5]["example_ids"] = None

    rewrite(run / SHARD, swap)
    reseal(run)
    with pytest.raises(ContractError, match=rf"out/{SHARD} row 5: check nulls failed: example_ids is null"):
        PackedDataset(run, sampling=Sampling(shuffle=False)).check_rows()


def test_random_byte_damage_never_ends_in_a_stray_exception(tmp_path):
    """Held-out damage of any kind: random bytes of a shard flipped (same size). Opening and reading every row
    either refuses it with a PackstreamError, or (a valid-looking edit: a token) reads it; verify=True refuses all."""
    base = tmp_path / "base"
    make_run(base)
    good = (base / SHARD).read_bytes()
    refused = 0
    for seed in range(100):
        rng = np.random.default_rng(seed)
        data = bytearray(good)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, len(data)))] ^= int(rng.integers(1, 256))
        (base / SHARD).write_bytes(bytes(data))
        try:
            PackedDataset(base, sampling=Sampling(shuffle=False)).check_rows()
        except PackstreamError as e:
            assert SHARD in str(e), e
            refused += 1
        with pytest.raises(ContractError, match=rf"{SHARD}: check sha256 failed"):
            PackedDataset(base, verify=True)
    assert refused > 30  # most damage is caught without verify=True too (measured: ~60 of 100)


# -- issue 16: resume states are tied to the data and range-checked (cause 7) --------------------------------


def test_a_state_resumes_only_its_own_data(run, tmp_path):
    """A state saved on one folder must not resume another with the same row count: the batches would be the
    same indices of other rows. The state carries the run id, the split and a digest of the shards opened."""
    ds = PackedDataset(run, sampling=Sampling(seed=3), batching=Batching(batch_size=4))
    next(iter(ds))
    state = ds.state_dict()
    assert state["run_id"] == ds.manifest.run_id and state["split"] == "train" and len(state["data_sha256"]) == 64
    twin = tmp_path / "twin"  # another run of other examples, packed to the same number of rows
    rows = make_run(run.parent / "scratch", seed=0)
    other = [{**r, "example_ids": [f"other:{i}:{k}" for k in range(len(r["example_ids"]))]} for i, r in enumerate(rows)]
    write_shards(twin, other, budget=BUDGET, num_shards=3, eos_token_id=EOS)
    theirs = PackedDataset(twin, sampling=Sampling(seed=3), batching=Batching(batch_size=4))
    assert len(theirs.rows) == len(ds.rows)  # what the old check compared, and all it compared
    with pytest.raises(PackstreamError, match=r"cannot resume: the state was saved over other data \(saved vs current: run_id '[0-9a-f]{16}' vs "):
        theirs.load_state_dict(state)
    one = PackedDataset(run / "train-00000-of-00003.arrow", sampling=Sampling(seed=3),
                        batching=Batching(batch_size=4))
    with pytest.raises(PackstreamError, match=r"saved over other data \(saved vs current: data_sha256 '[0-9a-f]{16}"):
        one.load_state_dict({**state, "num_rows": len(one.rows)})  # fewer shards of the same run
    fresh = PackedDataset(run, sampling=Sampling(seed=3), batching=Batching(batch_size=4))
    fresh.load_state_dict(state)
    assert (fresh.epoch, fresh.position) == (0, 1)


@pytest.mark.parametrize("edit,message", [
    ({"position": -3}, r"position is -3, expected an integer >= 0"),
    ({"position": 10**6}, r"position 1000000 is past the end of epoch 0, which has \d+ steps"),
    ({"position": 1.5}, r"position is 1.5, expected an integer >= 0"),
    ({"position": True}, r"position is True"),
    ({"epoch": -1}, r"epoch is -1, expected an integer >= 0"),
    ({"epoch": "2"}, r"epoch is '2'"),
    ({"seed": -5}, r"saved vs current: seed -5 vs 3;"),
    ({"world_size": 2}, r"saved vs current: world_size 2 vs 1;"),
], ids=["negative", "past-the-epoch", "float", "bool", "negative-epoch", "string-epoch", "seed", "world"])
def test_a_state_out_of_range_is_refused(run, edit, message):
    ds = PackedDataset(run, sampling=Sampling(seed=3), batching=Batching(batch_size=4))
    state = {**ds.state_dict(), **edit}
    with pytest.raises(PackstreamError, match=message):
        ds.load_state_dict(state)
    assert (ds.epoch, ds.position) == (0, 0)  # nothing half-applied


def test_a_position_of_minus_3_no_longer_adds_batches(run):
    """The issue's case: position -3 made a 6-step epoch yield 9 batches."""
    ds = PackedDataset(run, sampling=Sampling(seed=3), batching=Batching(batch_size=4))
    steps = len(ds)
    with pytest.raises(PackstreamError, match="position is -3"):
        ds.load_state_dict({**ds.state_dict(), "position": -3})
    assert sum(1 for _ in ds) == steps


@pytest.mark.parametrize("state,message", [
    ([1, 2], "the state is a list"),
    ({"epoch": 0, "position": 0}, r"the state lacks \["),
])
def test_a_state_that_is_not_ours_is_refused(run, state, message):
    with pytest.raises(PackstreamError, match=message):
        PackedDataset(run).load_state_dict(state)


# -- issue 16: a negative seed is refused when the dataset is made (cause 17) ---------------------------------


@pytest.mark.parametrize("seed", [-1, 1.5, "0", True, None])
def test_a_bad_seed_is_refused_at_construction(run, seed):
    with pytest.raises(PackstreamError, match=r"seed=.* must be an integer >= 0"):
        PackedDataset(run, sampling=Sampling(seed=seed))


def test_a_big_seed_works(run):
    ds = PackedDataset(run, sampling=Sampling(seed=2**70))
    assert sum(1 for _ in ds) == len(ds)


# -- issue 16: cached copies of remote shards are checked, and private (cause 8) ------------------------------


def _remote(run: Path, name: str):
    import fsspec

    fs = fsspec.filesystem("memory")
    for p in run.iterdir():
        fs.pipe(f"/{name}/{p.name}", p.read_bytes())
    return fs


def test_a_cached_copy_edited_to_the_same_size_is_not_served(run, tmp_path):
    fs = _remote(run, "cache-check")
    cache = tmp_path / "cache"
    ds = PackedDataset("memory://cache-check", cache_dir=str(cache), sampling=Sampling(shuffle=False))
    good = ds.rows[:]
    copy = Path(next(f["filename"] for f in ds.rows.cache_files if f["filename"].endswith(SHARD)))
    del ds
    rewrite(copy, lambda rows: rows[2]["input_ids"].__setitem__(1, rows[2]["input_ids"][1] + 1))  # one token, same size
    assert copy.stat().st_size == (run / SHARD).stat().st_size
    again = PackedDataset("memory://cache-check", cache_dir=str(cache), sampling=Sampling(shuffle=False))
    assert again.rows[:] == good  # the edited copy was hashed, found wrong, and fetched again
    assert pa.ipc.open_stream(copy.read_bytes()).read_all().to_pylist() == read(run / SHARD).to_pylist()
    fs.rm("/cache-check", recursive=True)


def test_the_cache_is_private(run, tmp_path, monkeypatch):
    fs = _remote(run, "cache-private")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    ds = PackedDataset("memory://cache-private")  # the default: under the user's cache home
    root = tmp_path / "xdg" / "packstream" / "shards"
    assert all(f["filename"].startswith(str(root)) for f in ds.rows.cache_files)
    for d in (root, Path(ds.rows.cache_files[0]["filename"]).parent):
        assert d.stat().st_mode & 0o777 == 0o700, oct(d.stat().st_mode)
    open_to_all = tmp_path / "shared-cache"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(PackstreamError, match=r"shared-cache is writable by others \(mode 0777\).*chmod 700"):
        PackedDataset("memory://cache-private", cache_dir=str(open_to_all))
    open_to_all.chmod(0o770)
    with pytest.raises(PackstreamError, match="is writable by its group"):
        PackedDataset("memory://cache-private", cache_dir=str(open_to_all))
    if os.geteuid() == 0:  # root can make a folder that belongs to someone else
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(PackstreamError, match=r"theirs belongs to user id 65534, not to you"):
            PackedDataset("memory://cache-private", cache_dir=str(theirs))
    fs.rm("/cache-private", recursive=True)
