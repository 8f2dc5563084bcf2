"""pipeline._arrow: Arrow arrays without pa.array (which imports pandas), equal to pa.array's; and a local pack that
imports no pandas, in the launcher or in its workers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import packers
from tests._internals import _arrow

ROOT = Path(__file__).resolve().parents[1]

DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
          np.float16, np.float32, np.float64]
TYPES = [pa.bool_(), pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint32(), pa.uint64(),
         pa.float32(), pa.float64()]


def _outcome(make):
    try:
        return "ok", make()
    except Exception as e:  # noqa: BLE001 - the kind of failure is what is compared
        return "error", type(e)


def _same(ours, theirs):
    """Both built the same array, or both failed the same way."""
    a, b = _outcome(ours), _outcome(theirs)
    assert a[0] == b[0], (a, b)
    if a[0] == "ok":
        assert a[1].type == b[1].type and a[1].equals(b[1]), (a[1], b[1])
        assert a[1].null_count == 0 and a[1].offset == 0
    else:
        assert a[1] is b[1], (a, b)


@st.composite
def numpy_arrays(draw):
    """1-d arrays of every supported dtype, contiguous or strided (a slice with a step, reversed), no NaN (NaN
    never equals itself in .equals)."""
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    elements = hnp.from_dtype(dtype, allow_nan=False) if dtype.kind == "f" else None
    arr = draw(hnp.arrays(dtype, st.integers(0, 40), elements=elements))
    start, step = draw(st.integers(0, 3)), draw(st.sampled_from([1, 2, 3, -1]))
    return arr[start::step] if step > 0 else arr[::-1]


@settings(max_examples=300, deadline=None)
@given(numpy_arrays(), st.one_of(st.none(), st.sampled_from(TYPES)))
def test_numeric_arrays_equal_pa_array(arr, typ):
    _same(lambda: _arrow.array(arr, typ), lambda: pa.array(arr, typ))
    if len(arr):
        _same(lambda: _arrow.array(arr[1:], typ), lambda: pa.array(arr[1:], typ))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-2**40, 2**40), max_size=20), st.sampled_from([pa.int64(), pa.int32(), pa.int8()]))
def test_lists_of_ints_equal_pa_array(values, typ):
    """A list of Python ints (packstream's positions): as pa.array, out-of-range values failing as it does."""
    if typ == pa.int64():
        _same(lambda: _arrow.array(values, typ), lambda: pa.array(values, typ))
    else:  # pa.array says OverflowError or ArrowInvalid by the route it takes; both refuse
        ours, theirs = _outcome(lambda: _arrow.array(values, typ)), _outcome(lambda: pa.array(values, typ))
        assert ours[0] == theirs[0]
        if ours[0] == "ok":
            assert ours[1].equals(theirs[1])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=12), max_size=30), st.sampled_from([pa.string(), pa.large_string()]),
       st.booleans())
def test_strings_equal_pa_array(values, typ, as_tuple):
    """Lists of str, non-ASCII, astral and NUL characters included, empty lists and strings included."""
    values = tuple(values) if as_tuple else values
    _same(lambda: _arrow.array(values, typ), lambda: pa.array(values, typ))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(max_size=5), max_size=8), st.integers(0xD800, 0xDFFF), st.integers(0, 8))
def test_a_lone_surrogate_fails_as_in_pa_array(values, surrogate, at):
    """pa.array refuses a lone surrogate with UnicodeEncodeError; so does the helper."""
    values = list(values)
    values.insert(min(at, len(values)), "x" + chr(surrogate))
    with pytest.raises(UnicodeEncodeError):
        pa.array(values, pa.string())
    with pytest.raises(UnicodeEncodeError):
        _arrow.array(values, pa.string())


def test_what_is_not_a_string_is_refused():
    with pytest.raises(pa.ArrowTypeError):
        pa.array(["a", 1], pa.string())
    with pytest.raises(pa.ArrowTypeError):
        _arrow.array(["a", 1], pa.string())
    with pytest.raises(pa.ArrowTypeError):  # pa.array would take None (a null) or bytes; packstream never has them
        _arrow.array(["a", None], pa.string())


@settings(max_examples=200, deadline=None)
@given(st.one_of(
    st.tuples(st.just(pa.int32()), st.lists(st.lists(st.integers(-2**31, 2**31 - 1), max_size=6), max_size=8)),
    st.tuples(st.just(pa.uint8()), st.lists(st.lists(st.integers(0, 255), max_size=6), max_size=8)),
    st.tuples(st.just(pa.int8()), st.lists(st.lists(st.integers(-128, 127), max_size=6), max_size=8)),
    st.tuples(st.just(pa.string()), st.lists(st.lists(st.text(max_size=6), max_size=6), max_size=8)),
))
def test_nested_lists_equal_pa_array(case):
    """list<...> from offsets and flat values (numpy or a list of str), as pa.array of the nested lists."""
    typ, nested = case
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in nested], dtype=np.int64)])
    flat = [v for x in nested for v in x]
    values = flat if typ == pa.string() else np.array(flat, dtype=np.int64)  # int64, cast as _rows does
    ours = _arrow.list_array(offsets, values, typ)
    theirs = pa.array(nested, pa.list_(typ))
    assert ours.type == theirs.type and ours.equals(theirs)
    assert ours.equals(pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, typ)))


@settings(max_examples=200, deadline=None)
@given(numpy_arrays(), st.integers(0, 5), st.integers(0, 5))
def test_to_numpy_equals_arrow_to_numpy(arr, a, b):
    """Back to numpy, sliced arrays included (an offset into the buffer; bools not on a byte boundary)."""
    built = pa.array(arr)[a:max(a, len(arr) - b)]
    ours, theirs = _arrow.to_numpy(built), built.to_numpy(zero_copy_only=False)
    assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs)
    chunked = pa.chunked_array([built, built], built.type)
    assert np.array_equal(_arrow.to_numpy(chunked), chunked.to_numpy())
    assert np.array_equal(_arrow.to_numpy(pa.chunked_array([], built.type)), np.zeros(0, theirs.dtype))


def test_to_numpy_refuses_nulls():
    with pytest.raises(pa.ArrowInvalid):
        _arrow.to_numpy(pa.array([1, None], pa.int32()))


def test_an_empty_batch_has_from_pylists_bytes():
    schema = pa.schema(packers.SCHEMA, metadata={b"k": b"v"})

    def ipc(batch):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as w:
            w.write_batch(batch)
        return sink.getvalue().to_pybytes()

    assert ipc(_arrow.empty_batch(schema)) == ipc(pa.RecordBatch.from_pylist([], schema=schema))


def test_the_helper_imports_no_pandas():
    script = textwrap.dedent("""
        import sys
        import numpy as np, pyarrow as pa
        from pipeline import _arrow
        a = _arrow.list_array(np.arange(3), ["x", "é"], pa.string())
        b = _arrow.array(np.arange(5), pa.int32()).take(_arrow.array(np.arange(2)))
        _arrow.to_numpy(b), _arrow.to_numpy(a.offsets), _arrow.to_numpy(_arrow.array(np.ones(3, bool)))
        _arrow.empty_batch(pa.schema([("a", pa.list_(pa.int32()))]))
        print("pandas" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------
# A local pack


def _records(folder: Path) -> tuple[Path, Path]:
    words = "alpha beta gamma délta épsilon zeta 漢字 🙂 theta".split()
    plain = folder / "plain.jsonl"
    plain.write_text("".join(json.dumps({"id": f"r{i}-é", "instruction": f"Say {i}.",
                                         "output": " ".join(words[: 1 + i % len(words)]) * (1 + i % 4)},
                                        ensure_ascii=i % 2 == 0) + "\n" for i in range(30)), encoding="utf-8")
    pairs = folder / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"What is {i}*{i}? ü", "chosen": f"{i * i}." * (1 + i % 3),
                                         "rejected": f"{i * i + 1}, I think."}) + "\n" for i in range(20)))
    return plain, pairs


def test_a_local_pack_imports_no_pandas(tmp_path):
    """pa.array, Array.to_numpy, RecordBatch.from_pylist import pandas (~0.3 CPU-seconds in the launcher and in each
    worker): a local ``packstream pack`` builds its arrays with pipeline._arrow and imports none, with one worker or
    two, plain examples or pairs, Arrow or Parquet shards, empty shards, a validation split and global mode. An
    import hook, inherited by the forked workers, notes any pandas import with the stack that asked for it."""
    plain, pairs = _records(tmp_path)
    runs = {
        "w1": [str(plain), "--workers", "1", "--validation-fraction", "0.1", "--num-shards", "6", "--mode", "global"],
        "w2": [str(plain), "--workers", "2", "--validation-fraction", "0.1", "--num-shards", "2"],
        "pairs": [str(pairs), "--workers", "2", "--pairs", "--output-format", "parquet", "--num-shards", "2"],
    }
    for name, args in runs.items():
        seen = tmp_path / f"{name}.pandas"
        script = textwrap.dedent(f"""
            import os, sys, traceback

            class Hook:
                def find_spec(self, fullname, path=None, target=None):
                    if fullname == "pandas":
                        with open({str(seen)!r}, "a") as f:
                            f.write(f"pid {{os.getpid()}}:\\n" + "".join(traceback.format_stack()))
                    return None

            sys.meta_path.insert(0, Hook())
            from pipeline.cli import main
            try:
                main(["pack", *{args!r}, "-o", {str(tmp_path / name)!r}, "-q", "--max-tokens", "256"])
            except SystemExit as e:
                assert not e.code, e.code
            print("pandas" in sys.modules)
        """)
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert not seen.exists(), f"{name}: pandas imported\n{seen.read_text()[-3000:]}"
        assert r.stdout.strip() == "False", f"{name}: {r.stdout[-500:]}"
    assert json.loads((tmp_path / "w1" / "manifest.json").read_text())["shards"]  # the runs wrote something
