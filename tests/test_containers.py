"""Any container, the same examples (issue 17): the container-invariance property.

The same records are written through every container packstream reads: JSONL, a JSON array,
JSONL compressed with gzip, zstd, xz and bzip2 (and a compressed JSON array), Parquet written by
pyarrow and by ``datasets`` (with and without its ``Json`` feature), Arrow IPC stream and file,
and ``save_to_disk`` folders (a Dataset and a DatasetDict). Each is read back by the job's own
reader (:func:`pipeline._read.read_file`) and encoded by the job's own stage
(:class:`pipeline._encode.Encoder`); every container must give, record by record, the same tokens,
the same loss mask, the same normalization counts, or the same refusal. ``read_file`` and
``Encoder`` are exactly what the job runs, so equal examples here are equal examples in the shards.

Why examples and not whole shards: a record's position is part of its example id (line 3 in
JSONL is row 2 in Parquet, and the source name carries the file's extension), and ids choose the
packing group and the shuffle, so the rows of two containers hold the same examples in other
orders. The examples are therefore compared record by record, without their ids; the slow test
packs through the real job and compares each example's tokens, found in the shards by the record's
own ``id`` field, and the counts.

The records: every fixture of ``tests/test_formats.py``'s ``SHAPES`` table (so a shape added
there is covered here with no change), and records generated from random turn lists for the turn
shapes of ``tests/test_fuzz_formats.py`` (hypothesis, slow tier).

Where a container cannot hold a set of records (pyarrow refuses a field that is a string in one
record and a list in another; Parquet has no struct without fields), that container is skipped for
that set; the JSON family and ``datasets``' ``Json`` feature must hold every set. What a columnar
schema adds, the reader takes away (:func:`pipeline._read.table_rows`): the nulls of struct fields
a record lacked, and the JSON text of ``Json`` values. Records with explicit nulls inside structs
cannot be told apart from records without those fields once in a columnar file; the fixtures have
none where it would change the text.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import PackOptions
from tests._internals import Encoder, Rejected, _read
from tests.test_formats import SHAPES, load
from tests.test_fuzz_formats import record_for


class NotRepresentable(Exception):
    """The container cannot hold these records (the writer refused them)."""


def _lines(records: list) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def _zstd(data: bytes) -> bytes:
    """A zstd stream, as the zstd tool writes it (pyarrow's codec: no dependency of its own)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as out:
        out.write(data)
    return sink.getvalue().to_pybytes()


def _table(records: list) -> pa.Table:
    """A table of every key of every record (``Table.from_pylist`` keeps only the first record's keys)."""
    keys = list(dict.fromkeys(k for r in records for k in r))
    try:
        return pa.table({k: pa.array([r.get(k) for r in records]) for k in keys})
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError) as e:
        raise NotRepresentable(f"pyarrow: {e}") from None


def _dataset(records: list, json_feature: bool):
    import datasets

    keys = list(dict.fromkeys(k for r in records for k in r))  # from_list keeps only the first record's keys
    columns = {k: [r.get(k) for r in records] for k in keys}
    try:
        if json_feature:  # every column a Json feature: what datasets 5 uses for free-form values
            return datasets.Dataset.from_dict(columns, features=datasets.Features({k: datasets.Json() for k in keys}))
        return datasets.Dataset.from_dict(columns)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError) as e:
        raise NotRepresentable(f"datasets: {e}") from None


def _parquet(table: pa.Table, path: Path) -> None:
    try:
        pq.write_table(table, path)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:  # e.g. a struct without fields
        raise NotRepresentable(f"parquet: {e}") from None


def _arrow(table: pa.Table, path: Path, kind: str) -> None:
    with pa.OSFile(str(path), "wb") as sink:
        with (pa.ipc.new_stream if kind == "stream" else pa.ipc.new_file)(sink, table.schema) as w:
            w.write_table(table)


def _quiet_datasets():
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


# name -> (writer: (records, folder) -> the input path, must always hold the records)
CONTAINERS: dict[str, tuple[Callable[[list, Path], Path], bool]] = {
    "jsonl": (lambda r, d: _write(d / "data.jsonl", _lines(r)), True),
    "json": (lambda r, d: _write(d / "data.json", json.dumps(r, indent=1, ensure_ascii=False).encode()), True),
    "jsonl.gz": (lambda r, d: _write(d / "data.jsonl.gz", gzip.compress(_lines(r))), True),
    "jsonl.zst": (lambda r, d: _write(d / "data.jsonl.zst", _zstd(_lines(r))), True),
    "jsonl.xz": (lambda r, d: _write(d / "data.jsonl.xz", lzma.compress(_lines(r))), True),
    "jsonl.bz2": (lambda r, d: _write(d / "data.ndjson.bz2", bz2.compress(_lines(r))), True),
    "json.zst": (lambda r, d: _write(d / "data.json.zst", _zstd(json.dumps(r).encode())), True),
    "parquet (pyarrow)": (lambda r, d: _then(_parquet(_table(r), d / "data.parquet"), d / "data.parquet"), False),
    "parquet (datasets)": (lambda r, d: _then(_dataset(r, False).to_parquet(str(d / "data.parquet")), d / "data.parquet"), False),
    "parquet (datasets, Json)": (lambda r, d: _then(_dataset(r, True).to_parquet(str(d / "data.parquet")), d / "data.parquet"), True),
    "arrow stream": (lambda r, d: _then(_arrow(_table(r), d / "data.arrow", "stream"), d / "data.arrow"), False),
    "arrow file": (lambda r, d: _then(_arrow(_table(r), d / "data.arrow", "file"), d / "data.arrow"), False),
    "save_to_disk Dataset": (lambda r, d: _then(_dataset(r, False).save_to_disk(str(d / "ds")), d / "ds"), False),
    "save_to_disk Dataset (Json)": (lambda r, d: _then(_dataset(r, True).save_to_disk(str(d / "ds")), d / "ds"), True),
    "save_to_disk DatasetDict": (lambda r, d: _then(_dict(r).save_to_disk(str(d / "dd")), d / "dd"), False),
}


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _then(_: Any, path: Path) -> Path:
    return path


def _dict(records: list):
    import datasets

    return datasets.DatasetDict({"train": _dataset(records, False)})


def examples(path: Path, options: PackOptions) -> list:
    """What the job makes of each record of ``path``: (tokens, mask) or the refusal, plus the counts."""
    encoder = _encoder(options)
    (f,) = _read.expand_inputs((str(path),))
    items = list(_read.read_file(f, options.max_record_bytes))
    out = []
    for _, record in items:
        enc = encoder.encode([(0, "x", 0, record)])
        if enc.rejected:
            out.append(("refused", enc.rejected[0]["reason"], enc.rejected[0]["detail"]))
        else:
            b = enc.batch
            out.append([(b.input_ids[b.offsets[i]:b.offsets[i + 1]].tolist(), b.loss_mask[b.offsets[i]:b.offsets[i + 1]].tolist())
                        for i in range(len(b))] + [sorted(enc.counts.items())])
    return out


_ENCODERS: dict = {}


def _encoder(options: PackOptions) -> Encoder:
    key = repr(options)
    if key not in _ENCODERS:
        _ENCODERS[key] = Encoder(options)
    return _ENCODERS[key]


def check_invariance(records: list, opts: dict, folder: Path) -> dict[str, str]:
    """Write ``records`` through every container; all must encode alike. Returns the skipped containers."""
    _quiet_datasets()
    base = None
    skipped = {}
    for name, (write, must_hold) in CONTAINERS.items():
        d = folder / name.replace(" ", "_").replace("(", "").replace(")", "").replace(",", "")
        d.mkdir()
        try:
            path = write(records, d)
        except NotRepresentable as e:
            assert not must_hold, f"{name} must hold every record set: {e}"
            skipped[name] = str(e)
            continue
        got = examples(path, PackOptions(inputs=(str(path),), **opts))
        if base is None:
            base = (name, got)
            assert len(got) == len(records)
            continue
        assert len(got) == len(base[1]), (name, len(got), len(base[1]))
        for i, (a, b) in enumerate(zip(base[1], got)):
            assert a == b, f"record {i}: {base[0]} gives {a!r}\n{name} gives {b!r}\nrecord: {records[i]!r}"
    return skipped


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_shape_in_every_container(tmp_path, shape):
    name, opts, _ = SHAPES[shape]
    records = [r for _, r in load(name)]
    skipped = check_invariance(records, opts, tmp_path)
    # The JSON family and the Json feature hold everything; the typed columnar writers only what has one type per field.
    assert len(CONTAINERS) - len(skipped) >= sum(must for _, must in CONTAINERS.values()), skipped


def test_json_feature_values_are_decoded_and_added_nulls_dropped(tmp_path):
    """Issue 17's two silent corruptions: tool schemas read as JSON strings inside JSON, and fake
    ``"order_id": null`` properties that a columnar schema gave records without that field."""
    tools_a = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    tools_b = [{"type": "function", "function": {"name": "refund", "parameters": {"type": "object",
                "properties": {"order_id": {"type": "integer"}, "reason": {"type": "string", "default": None}}}}}]
    records = [{"messages": [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Cold."}],
                "tools": tools_a},
               {"messages": [{"role": "user", "content": "Refund order 7"}, {"role": "assistant", "content": "Done."}],
                "tools": tools_b}]
    _quiet_datasets()
    ds = _dataset(records, True)
    ds.to_parquet(str(tmp_path / "j.parquet"))
    _dataset([{**r, "tools": r["tools"]} for r in records[:1]], False).to_parquet(str(tmp_path / "p.parquet"))
    (f,) = _read.expand_inputs((str(tmp_path / "j.parquet"),))
    got = [r for _, r in _read.read_file(f, 1 << 20)]
    assert got == records  # decoded, and the explicit null of a Json value kept: its JSON says so
    pq.write_table(pa.Table.from_pylist([{"tools": tools_a}, {"tools": [{"type": "function", "function": {
        "name": "refund", "parameters": {"type": "object", "properties": {"order_id": {"type": "integer"}}}}}]}]),
        tmp_path / "s.parquet")
    (f,) = _read.expand_inputs((str(tmp_path / "s.parquet"),))
    first = [r for _, r in _read.read_file(f, 1 << 20)][0]
    assert first == {"tools": tools_a}  # no "order_id": null in the weather tool


def test_a_bad_json_value_refuses_its_record(tmp_path):
    import datasets

    _quiet_datasets()
    table = pa.table({"text": ["a", "b"], "meta": pa.array(['{"k": 1}', '{"k": 1' + "0" * 5000 + "}"], pa.json_())})
    pq.write_table(table, tmp_path / "m.parquet")
    (f,) = _read.expand_inputs((str(tmp_path / "m.parquet"),))
    got = [r for _, r in _read.read_file(f, 1 << 20)]
    assert got[0] == {"text": "a", "meta": {"k": 1}}
    assert isinstance(got[1], Rejected) and "the Json value at meta" in got[1].detail
    assert datasets  # the Json feature is datasets'; pyarrow writes the same arrow.json type


turns = st.lists(st.tuples(st.sampled_from(["user", "human", "assistant", "gpt", "system", "tool"]),
                           st.text(alphabet="abc xyz éß中\n", max_size=10)), min_size=1, max_size=5)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(shape=st.sampled_from(["messages", "sharegpt", "dialogue", "prompt_completion"]),
       lists=st.lists(turns, min_size=1, max_size=4))
def test_generated_records_in_every_container(tmp_path_factory, shape, lists):
    made = [record_for(shape, t) for t in lists]
    records = [r for r, _, _ in made]
    check_invariance(records, made[0][1], tmp_path_factory.mktemp("inv"))


@pytest.mark.slow
def test_the_job_packs_the_same_examples_from_every_container(tmp_path):
    """Through ``pipeline.run``: each record's example (found by its own ``id``) has the same tokens and
    mask whatever the container, and the counts agree."""
    from pipeline import run
    from tests.test_verify import read_rows

    name, opts, _ = SHAPES["sharegpt"]
    records = [{**r, "id": f"r{i}"} for i, (_, r) in enumerate(load(name))]
    _quiet_datasets()
    seen = {}
    for cname in ("jsonl", "jsonl.zst", "json", "parquet (pyarrow)", "parquet (datasets, Json)", "arrow file",
                  "save_to_disk DatasetDict"):
        d = tmp_path / cname.replace(" ", "_").replace("(", "").replace(")", "").replace(",", "")
        d.mkdir()
        path = CONTAINERS[cname][0](records, d)
        out = d / "out"
        manifest = run(PackOptions(inputs=(str(path),), output=str(out), max_tokens=512, **opts))
        by_id = {}
        for row in read_rows(out):
            offs = row["seq_offsets"]
            for k, eid in enumerate(row["example_ids"]):
                own = eid.rsplit(":", 1)[1]
                by_id[own] = (row["input_ids"][offs[k]:offs[k + 1]], row["loss_mask"][offs[k]:offs[k + 1]])
        c = manifest["counts"]
        seen[cname] = (by_id, c["records_read"], c["examples_packed"], c.get("rejected_by_reason"), c.get("normalization"))
    first = next(iter(seen.values()))
    assert len(first[0]) >= 4
    for cname, got in seen.items():
        assert got == first, cname
