"""packers.PackedDataset: shards round trip, epochs, rank sharding, exact resumption, DataLoader workers."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
import torch

from packers import Batching, BatchBy, Collator, ContractError, PackedDataset, PackstreamError, Sampling, Sharding
from tests._shards import pack_first_fit, random_examples, write_manifest, write_shards

BUDGET = 64


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """3 shards, ~70 rows of random examples packed to 64 tokens."""
    folder = tmp_path_factory.mktemp("packed")
    rows = pack_first_fit(random_examples(220, seed=5), BUDGET)
    write_shards(folder, rows, budget=BUDGET, num_shards=3)
    return folder, rows


def ids_of(batch):
    return [tuple(r["example_ids"]) for r in batch]


def test_round_trip_zero_copy(shards):
    folder, rows = shards
    ds = PackedDataset(folder, sampling=Sampling(shuffle=False))
    assert len(ds.rows) == len(rows) and ds.budget == BUDGET and ds.metadata["pad_token_id"] == 0
    assert ds.rows[:] == {k: [r[k] for r in rows] for k in rows[0]}  # map-style, shards in name order
    assert sorted(f["filename"] for f in ds.rows.cache_files) == sorted(str(p) for p in folder.glob("*.arrow"))
    assert ds.num_examples.tolist() == [len(r["example_ids"]) for r in rows]
    fetched = ds.fetch([5, 0])
    assert fetched[0]["input_ids"].tolist() == rows[5]["input_ids"] and fetched[1]["example_ids"] == rows[0]["example_ids"]


def test_rows_from_datasets_collate_with_defaults(shards):
    """`Collator()(rows)` where rows are what `datasets` yields (Python lists)."""
    import datasets

    folder, rows = shards
    hf = datasets.Dataset.from_file(str(sorted(folder.glob("*.arrow"))[0]))
    batch = Collator()([hf[0], hf[1]])
    assert batch["input_ids"][0].tolist() == rows[0]["input_ids"] + rows[1]["input_ids"]


def test_datasets_cache_files_in_the_folder_are_not_shards(shards, tmp_path):
    folder, rows = shards
    copy = tmp_path / "copy"
    write_shards(copy, rows, budget=BUDGET, num_shards=3)
    PackedDataset(copy).rows.map(lambda r: {"n": r["num_tokens"]})  # datasets writes cache-*.arrow beside the shards
    assert list(copy.glob("cache-*.arrow"))
    assert len(PackedDataset(copy).rows) == len(rows)


def test_fsspec_path(shards, tmp_path):
    import fsspec

    folder, rows = shards
    fs = fsspec.filesystem("memory")
    for p in folder.iterdir():  # the whole output folder, manifest.json included
        fs.pipe(f"/remote-run/{p.name}", p.read_bytes())
    ds = PackedDataset("memory://remote-run", cache_dir=str(tmp_path), sampling=Sampling(shuffle=False))
    assert ds.rows["example_ids"] == [r["example_ids"] for r in rows]
    assert all(f["filename"].startswith(str(tmp_path)) for f in ds.rows.cache_files)  # copied once, then mapped
    again = PackedDataset("memory://remote-run", cache_dir=str(tmp_path), verify=True)  # the cached copies
    assert [f["filename"] for f in again.rows.cache_files] == [f["filename"] for f in ds.rows.cache_files]

    # Remote folders follow the same contract: the manifest is read there first, only listed shards copied.
    fs.pipe("/remote-run/backup-00000-of-00003.arrow", b"x")
    with pytest.raises(ContractError, match="backup-00000-of-00003.arrow: not listed in manifest.json"):
        PackedDataset("memory://remote-run", cache_dir=str(tmp_path))
    fs.rm("/remote-run/backup-00000-of-00003.arrow")
    name = "train-00001-of-00003.arrow"
    data = bytearray(fs.cat_file(f"/remote-run/{name}"))
    data[-200] ^= 1  # same size: caught by the sha256 of the copy, which is always checked
    fs.pipe(f"/remote-run/{name}", bytes(data))
    with pytest.raises(ContractError, match=rf"remote-run/{name}: sha256 of the copy"):
        PackedDataset("memory://remote-run", cache_dir=str(tmp_path / "fresh"))
    # The copy cached earlier has the manifest's sha256 (recorded beside it when it was checked): read that.
    same = PackedDataset("memory://remote-run", cache_dir=str(tmp_path), sampling=Sampling(shuffle=False))
    assert same.rows[:] == ds.rows[:]
    fs.rm("/remote-run/manifest.json")
    with pytest.raises(ContractError, match="memory:///remote-run: shard files but no manifest.json"):
        PackedDataset("memory://remote-run", cache_dir=str(tmp_path))
    fs.rm("/remote-run", recursive=True)


def test_bad_paths_are_refused(shards, tmp_path):
    folder, rows = shards
    other = tmp_path / "other"
    write_shards(other, rows[:10], budget=BUDGET)
    with pytest.raises(PackstreamError, match="span 2 folders"):  # two runs (or a run and its copy)
        PackedDataset([folder / "train-00000-of-00003.arrow", other / "train-00000-of-00001.arrow"])
    with pytest.raises(PackstreamError, match="passed 2 times"):
        PackedDataset([folder / "train-00000-of-00003.arrow"] * 2)
    with pytest.raises(PackstreamError, match="pass the folder alone"):
        PackedDataset([folder, folder / "train-00000-of-00003.arrow"])
    with pytest.raises(ContractError, match="README.md: not a shard listed in manifest.json"):
        (other / "README.md").write_text("card")
        PackedDataset(other / "README.md")
    with pytest.raises(PackstreamError, match="empty list"):
        PackedDataset([])

    plain = tmp_path / "plain" / "plain.arrow"  # not packstream's: no manifest beside it
    plain.parent.mkdir()
    with pa.OSFile(str(plain), "wb") as f, pa.ipc.new_stream(f, pa.schema([("x", pa.int32())])) as w:
        w.write_table(pa.table({"x": pa.array([1], pa.int32())}))
    with pytest.raises(ContractError, match="plain: shard files but no manifest.json"):
        PackedDataset(plain)

    parquet = tmp_path / "parquet"
    parquet.mkdir()
    import pyarrow.parquet as pq

    schema = pa.ipc.open_stream(pa.memory_map(str(folder / "train-00000-of-00003.arrow"))).schema
    pq.write_table(pa.Table.from_pylist(rows[:3], schema=schema), parquet / "train-00000-of-00001.parquet")
    write_manifest(parquet)
    with pytest.raises(PackstreamError, match="--output-format arrow"):
        PackedDataset(parquet)

    with pytest.raises(PackstreamError, match="does not exist"):
        PackedDataset(tmp_path / "nope")
    with pytest.raises(PackstreamError, match="split='test'"):
        PackedDataset(folder, split="test")
    with pytest.raises(ContractError, match="lists no 'validation' shards; it lists \\['train'\\] shards"):
        PackedDataset(folder, split="validation")
    with pytest.raises(PackstreamError, match="batch_by"):
        PackedDataset(folder, batching=Batching(batch_by="bytes"))
    with pytest.raises(PackstreamError, match="rank=2"):
        PackedDataset(folder, sharding=Sharding(rank=2, world_size=2))
    with pytest.raises(PackstreamError, match="tokens < row budget"):
        PackedDataset(folder, batching=Batching(batch_by="tokens", batch_size=10))


OWN = "PackedDataset takes a path and split=, verify=, sampling=, sharding=, batching=, cache_dir=, storage_options="
GONE = ("drop_last= is gone: every epoch's schedule trains every example exactly once and gives every rank the same "
        "number of steps (nothing repeated, nothing dropped); remove it")
OLD_KEYWORDS = {
    # The call as earlier examples wrote it: each keyword moves to its group, the groups in the order first met.
    "batching_and_sharding": (dict(batch_size=8, rank=0, world_size=2),
                              "PackedDataset(batch_size=8, rank=0, world_size=2) takes its options in groups now: "
                              "batching=Batching(batch_size=8), sharding=Sharding(rank=0, world_size=2)"),
    "sampling": (dict(seed=3, shuffle=False, rebatch=False),
                 "PackedDataset(seed=3, shuffle=False, rebatch=False) takes its options in groups now: "
                 "sampling=Sampling(seed=3, shuffle=False, rebatch=False)"),
    # An enum by its value, which the group takes as a string too.
    "all_three_groups": (dict(batch_by=BatchBy.TOKENS, grad_accum=4, seed=1, world_size=8, balance="none"),
                         "PackedDataset(batch_by='tokens', grad_accum=4, seed=1, world_size=8, balance='none') takes "
                         "its options in groups now: batching=Batching(batch_by='tokens', grad_accum=4, "
                         "balance='none'), sampling=Sampling(seed=1), sharding=Sharding(world_size=8)"),
    "loss_weighting": (dict(loss_weighting="source", source_weights={"gsm8k": 2.0}),
                       "PackedDataset(loss_weighting='source', source_weights={'gsm8k': 2.0}) takes its options in "
                       "groups now: batching=Batching(loss_weighting='source', source_weights={'gsm8k': 2.0})"),
    # drop_last= no group holds: it is gone, and why.
    "drop_last": (dict(batch_size=4, drop_last=True),
                  "PackedDataset(batch_size=4, drop_last=True) takes its options in groups now: "
                  "batching=Batching(batch_size=4); " + GONE),
    "drop_last_alone": (dict(drop_last=False), "PackedDataset(drop_last=False): " + GONE),
    # A keyword that never was an option: named, the nearest spelling offered, the ones taken listed.
    "typo_of_a_field": (dict(shufle=True), "PackedDataset(shufle=True): shufle= is not an option (did you mean "
                                           "sampling=Sampling(shuffle=...)?); " + OWN),
    "typo_of_own": (dict(splt="validation"), "PackedDataset(splt='validation'): splt= is not an option (did you mean "
                                             "split=?); " + OWN),
    "old_and_unknown": (dict(rank=1, colour="red"), "PackedDataset(rank=1, colour='red') takes its options in groups "
                                                    "now: sharding=Sharding(rank=1); colour= is not an option; " + OWN),
}


@pytest.mark.parametrize("name", list(OLD_KEYWORDS))
def test_old_flat_keywords_name_their_group(name, tmp_path):
    """Issue 35: PackedDataset's flat keywords of before the groups (batch_size=, rank=, seed=, ...) were a bare
    TypeError; each now says its new spelling, in one PackstreamError line, before the path is opened."""
    given, message = OLD_KEYWORDS[name]
    with pytest.raises(PackstreamError) as e:
        PackedDataset(tmp_path / "never-opened", **given)
    assert str(e.value) == message
    if name not in ("drop_last_alone", "typo_of_a_field", "typo_of_own"):  # the new spelling works as written
        spelled = message.split(" now: ", 1)[1].split("; ", 1)[0]
        groups = eval(f"dict({spelled})", {"Batching": Batching, "Sampling": Sampling, "Sharding": Sharding})
        assert {type(g).__name__ for g in groups.values()} <= {"Batching", "Sampling", "Sharding"}


def test_shard_files_and_splits(shards, tmp_path):
    folder, rows = shards
    ds = PackedDataset([folder / "train-00002-of-00003.arrow", folder / "train-00000-of-00003.arrow"],
                       sampling=Sampling(shuffle=False))
    assert ds.shards == ("train-00000-of-00003.arrow", "train-00002-of-00003.arrow")  # the run's order
    n0 = len(PackedDataset(folder / "train-00000-of-00003.arrow").rows)
    assert ds.rows["example_ids"][n0:] == [r["example_ids"] for r in rows[-(len(ds.rows) - n0):]]

    both = tmp_path / "both"
    write_shards(both, rows[:30], budget=BUDGET, num_shards=2)
    write_shards(both, rows[30:40], budget=BUDGET, split="validation")  # the manifest lists both splits
    in_order = Sampling(shuffle=False)
    train, val = PackedDataset(both, sampling=in_order), PackedDataset(both, split="validation", sampling=in_order)
    assert (len(train.rows), len(val.rows)) == (30, 10) and val.shards == ("validation-00000-of-00001.arrow",)
    assert val.rows["example_ids"] == [r["example_ids"] for r in rows[30:40]]
    with pytest.raises(PackstreamError, match="a 'validation' shard.*pass split='validation'"):
        PackedDataset(both / "validation-00000-of-00001.arrow")


def test_epochs_are_seeded_permutations(shards):
    folder, rows = shards
    ds = PackedDataset(folder, sampling=Sampling(seed=11), batching=Batching(batch_size=4))
    epochs = [[r for b in ds for r in ids_of(b)] for _ in range(2)]  # the second loop rolls over to epoch 1
    assert ds.epoch == 1
    assert all(sorted(e) == sorted(tuple(r["example_ids"]) for r in rows) for e in epochs)  # each row once
    assert epochs[0] != epochs[1]
    again = PackedDataset(folder, sampling=Sampling(seed=11), batching=Batching(batch_size=4))
    assert [r for b in again for r in ids_of(b)] == epochs[0]
    other_seed = PackedDataset(folder, sampling=Sampling(seed=12), batching=Batching(batch_size=4))
    assert [r for b in other_seed for r in ids_of(b)] != epochs[0]
    unshuffled = PackedDataset(folder, sampling=Sampling(shuffle=False), batching=Batching(batch_size=4))
    assert [r for b in unshuffled for r in ids_of(b)] == [tuple(r["example_ids"]) for r in rows]


@pytest.mark.parametrize("by,size", [("rows", 3), ("examples", 9), ("tokens", 150)])
@pytest.mark.parametrize("balance", ["compute", "none"])
def test_two_ranks_disjoint_same_steps_every_example_once(shards, by, size, balance):
    folder, rows = shards
    ranks = [PackedDataset(folder, sampling=Sampling(seed=3), sharding=Sharding(rank=r, world_size=2),
                           batching=Batching(batch_by=by, batch_size=size, balance=balance))
             for r in range(2)]
    batches = [list(ds) for ds in ranks]
    assert len(ranks[0]) == len(ranks[1]) == len(batches[0]) == len(batches[1]) > 0  # len() was exact
    seen = Counter(e for b in batches[0] + batches[1] for r in b for e in r["example_ids"])
    assert seen == Counter(e for r in rows for e in r["example_ids"])  # every example exactly once


def test_examples_per_step_track_the_target(shards):
    folder, _ = shards
    ds = PackedDataset(folder, sharding=Sharding(world_size=1),
                       batching=Batching(batch_by=BatchBy.EXAMPLES, batch_size=12))
    per_step = [int(ds.num_examples[b].sum()) for b in ds.schedule()]
    assert abs(np.mean(per_step[:-1]) - 12) < 1.0
    tokens = PackedDataset(folder, batching=Batching(batch_by="tokens", batch_size=200))
    assert all(int(tokens.num_tokens[b].sum()) <= 200 for b in tokens.schedule())


def run(ds, n):
    """The next ``n`` batches' example ids, starting a new ``iter()`` (a new epoch) as often as needed."""
    out = []
    while len(out) < n:
        out += [ids_of(b) for b in itertools.islice(iter(ds), n - len(out))]
    return out


@pytest.mark.parametrize("by,size", [("rows", 4), ("examples", 10)])
def test_resume_gives_the_same_next_batches(shards, by, size):
    folder, _ = shards
    make = lambda: PackedDataset(folder, sampling=Sampling(seed=9), sharding=Sharding(rank=1, world_size=2),
                                 batching=Batching(batch_by=by, batch_size=size))
    steps = len(make())
    uninterrupted = run(make(), 2 * steps)  # two epochs
    for k in (0, 3, steps - 1, steps, steps + 2):  # stop after k batches, in either epoch or at the boundary
        first = make()
        head = run(first, k)
        resumed = make()
        resumed.load_state_dict(first.state_dict())
        assert head + run(resumed, 2 * steps - k) == uninterrupted, k


def test_set_epoch_keeps_a_resumed_position(shards):
    folder, _ = shards
    ds = PackedDataset(folder, batching=Batching(batch_size=4))
    ds.load_state_dict({**ds.state_dict(), "epoch": 2, "position": 5})
    ds.set_epoch(2)  # a training loop calling set_epoch(epoch) after resuming
    assert (ds.epoch, ds.position) == (2, 5)
    ds.set_epoch(3)
    assert (ds.epoch, ds.position) == (3, 0)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_an_epoch_end_in_a_set_epoch_loop(shards, workers):
    """State saved right after an epoch's last batch; a loop that calls set_epoch(e) trains the same epochs."""
    folder, _ = shards
    make = lambda: PackedDataset(folder, sampling=Sampling(seed=1), batching=Batching(batch_size=8))

    def train(ds, epochs, stop_after=None):
        seen = []
        for epoch in epochs:
            ds.set_epoch(epoch)
            for batch in ds.dataloader(num_workers=workers):
                seen.append((ds.epoch, ids_of(batch)))
                if len(seen) == stop_after:
                    return seen, ds.state_dict()
        return seen, ds.state_dict()

    full, _ = train(make(), range(3))
    steps = len(make())
    head, state = train(make(), range(3), stop_after=steps)  # stopped after epoch 0's last batch
    assert state["epoch"] == 0 and state["position"] == steps
    resumed = make()
    resumed.load_state_dict(state)
    tail, _ = train(resumed, range(state["epoch"], 3))
    assert head + tail == full and [e for e, _ in full] == [0] * steps + [1] * steps + [2] * steps


def test_state_from_another_setup_is_refused(shards):
    folder, _ = shards
    state = PackedDataset(folder, sharding=Sharding(world_size=2), batching=Batching(batch_size=4)).state_dict()
    with pytest.raises(PackstreamError, match="world_size"):
        PackedDataset(folder, sharding=Sharding(world_size=4), batching=Batching(batch_size=4)).load_state_dict(state)


def test_dataloader_workers_keep_order_and_position(shards):
    folder, _ = shards
    make = lambda: PackedDataset(folder, sampling=Sampling(seed=4), batching=Batching(batch_size=3))
    collate = Collator()
    plain = [collate(b)["input_ids"] for b in make()]
    ds = make()
    loader = ds.dataloader(num_workers=2, collate_fn=collate)
    got = []
    for i, batch in enumerate(loader):
        got.append(batch["input_ids"])
        if i == 6:
            state = loader.state_dict()
            break
    assert state["position"] == 7 and all(torch.equal(a, b) for a, b in zip(got, plain))
    resumed = make()
    resumed.load_state_dict(state)
    rest = [b["input_ids"] for b in resumed.dataloader(num_workers=2, collate_fn=collate)]
    assert len(got) + len(rest) == len(plain) and all(torch.equal(a, b) for a, b in zip(got + rest, plain))
    assert resumed.position == len(plain)
    second = [b["input_ids"] for b in resumed.dataloader(num_workers=2, collate_fn=collate)]  # rolls over
    assert resumed.epoch == 1 and len(second) == len(plain)


def test_plain_dataloader_with_workers_is_refused(shards):
    folder, _ = shards
    ds = PackedDataset(folder, batching=Batching(batch_size=3))
    assert len(list(torch.utils.data.DataLoader(ds, batch_size=None, collate_fn=Collator()))) == len(ds)
    with pytest.raises(PackstreamError, match="ds.dataloader"):
        list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, collate_fn=Collator()))
    with pytest.raises(PackstreamError, match="persistent_workers"):
        ds.dataloader(num_workers=1, persistent_workers=True)
