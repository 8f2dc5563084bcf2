"""Arrow arrays from numpy arrays and lists of str, without ``pa.array``.

``pa.array`` (pyarrow 25) imports pandas the first time it is called, whatever it is given: its array-like checks
consult pyarrow's pandas shim, which imports pandas when it is installed (~0.25-0.3 CPU-seconds, in the launcher and
again in every worker process). packstream never needs pandas to write rows, so its pack path builds arrays here,
from buffers: the arrays equal (``.equals``) what ``pa.array`` gives for the same input and type (tests/test_arrow.py),
and the same inputs fail (a lone surrogate: ``UnicodeEncodeError``; an int64 value out of int32's range:
``pa.ArrowInvalid``).

What it takes, deliberately narrow:

* numeric: a 1-d numpy array of bool, int8-64, uint8-64 or float16-64 (any strides, native byte order), or a list of
  Python ints/floats/bools; cast safely (as ``pa.array`` does) when ``typ`` differs from its dtype;
* ``pa.string()`` / ``pa.large_string()``: a sequence of ``str`` (no None, no bytes);
* lists: :func:`list_array` of int32 offsets and values built here.

And back: :func:`to_numpy` for numeric and bool arrays without nulls (``Array.to_numpy`` imports pandas too), and
:func:`empty_batch` for ``RecordBatch.from_pylist([], schema=...)`` (likewise).

>>> import numpy as np, pyarrow as pa
>>> array(np.arange(3), pa.int32()).equals(pa.array([0, 1, 2], pa.int32()))
True
>>> array(["a", "é"], pa.string()).to_pylist()
['a', 'é']
>>> list_array(np.array([0, 2, 3]), np.array([7, 8, 9]), pa.int32()).to_pylist()
[[7, 8], [9]]
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

__all__ = ["array", "empty_batch", "list_array", "to_numpy"]

_FROM_NUMPY = {
    np.dtype(np.bool_): pa.bool_(),
    np.dtype(np.int8): pa.int8(), np.dtype(np.int16): pa.int16(),
    np.dtype(np.int32): pa.int32(), np.dtype(np.int64): pa.int64(),
    np.dtype(np.uint8): pa.uint8(), np.dtype(np.uint16): pa.uint16(),
    np.dtype(np.uint32): pa.uint32(), np.dtype(np.uint64): pa.uint64(),
    np.dtype(np.float16): pa.float16(), np.dtype(np.float32): pa.float32(), np.dtype(np.float64): pa.float64(),
}
_TO_NUMPY = {t: d for d, t in _FROM_NUMPY.items()}
_INT32_MAX = 2**31 - 1


def array(values, typ: pa.DataType | None = None) -> pa.Array:
    """``pa.array(values, typ)`` for a 1-d numeric numpy array (or list of numbers), or, with ``typ`` a string
    type, a sequence of str. Without ``typ``, a numpy array keeps its dtype's type."""
    if typ is not None and (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        return _strings(values, typ)
    if not isinstance(values, np.ndarray):
        if typ is None:
            raise TypeError("pipeline._arrow.array: a list needs its Arrow type")
        values = np.asarray(values)
        if values.dtype.kind not in "biuf":  # what pa.array would reject or convert otherwise (str, None, objects)
            raise pa.ArrowTypeError(f"pipeline._arrow.array: {values.dtype} values for {typ}")
    return _numeric(values, typ)


def list_array(offsets, values, typ: pa.DataType | None = None) -> pa.ListArray:
    """``list<typ>`` whose list ``i`` is ``values[offsets[i]:offsets[i + 1]]`` (int32 offsets), as
    ``pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, typ))``."""
    if not isinstance(values, pa.Array):
        values = array(values, typ)
    return pa.ListArray.from_arrays(array(offsets, pa.int32()), values)


def _numeric(arr: np.ndarray, typ: pa.DataType | None) -> pa.Array:
    if arr.ndim != 1:
        raise pa.ArrowInvalid("only handle 1-dimensional arrays")
    own = _FROM_NUMPY.get(arr.dtype.newbyteorder("="))
    if own is None:
        raise pa.ArrowTypeError(f"pipeline._arrow.array: unsupported numpy dtype {arr.dtype}")
    if not arr.dtype.isnative:
        raise pa.ArrowNotImplementedError("Byte-swapped arrays not supported")  # as pa.array
    arr = np.ascontiguousarray(arr)
    data = np.packbits(arr, bitorder="little") if own == pa.bool_() else arr
    out = pa.Array.from_buffers(own, len(arr), [None, pa.py_buffer(data)])
    # A safe cast, as pa.array(ndarray, typ) does: out-of-range integers and truncated floats raise pa.ArrowInvalid.
    return out if typ is None or typ == own else out.cast(typ)


def _strings(values: Sequence[str], typ: pa.DataType) -> pa.Array:
    try:
        encoded = [str.encode(v, "utf-8") for v in values]  # a lone surrogate: UnicodeEncodeError, as pa.array
    except TypeError:
        bad = next(v for v in values if not isinstance(v, str))
        raise pa.ArrowTypeError(f"Expected str, got a {type(bad).__name__!r} object") from None
    n = len(encoded)
    large = pa.types.is_large_string(typ)
    lengths = np.fromiter(map(len, encoded), np.int64, count=n)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if not large:
        if offsets[-1] > _INT32_MAX:
            raise pa.ArrowCapacityError(f"{int(offsets[-1])} bytes of strings exceed a string array's 2 GiB; "
                                        "ask for pa.large_string()")
        offsets = offsets.astype(np.int32)
    return pa.Array.from_buffers(typ, n, [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded))])


def to_numpy(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """``arr.to_numpy(zero_copy_only=False)`` of a numeric or bool array without nulls (``to_numpy`` imports pandas
    too): a read-only view of its buffer (bool: unpacked, a copy); chunks concatenated."""
    if isinstance(arr, pa.ChunkedArray):
        parts = [to_numpy(c) for c in arr.chunks]
        return np.concatenate(parts) if parts else np.zeros(0, _dtype(arr.type))
    dtype, n = _dtype(arr.type), len(arr)
    if arr.null_count:
        raise pa.ArrowInvalid(f"pipeline._arrow.to_numpy: {arr.null_count} nulls in a {arr.type} array")
    data = arr.buffers()[1]
    if dtype == np.bool_:
        bits = np.frombuffer(data, np.uint8) if data is not None and n else np.zeros(0, np.uint8)
        return np.unpackbits(bits, count=arr.offset + n, bitorder="little")[arr.offset:].view(np.bool_)
    if data is None or not n:
        out = np.zeros(0, dtype)
    else:
        out = np.frombuffer(data, dtype, count=n, offset=arr.offset * dtype.itemsize)
    out.flags.writeable = False
    return out


def empty_batch(schema: pa.Schema) -> pa.RecordBatch:
    """``pa.RecordBatch.from_pylist([], schema=schema)``: no rows (the same IPC bytes)."""
    return pa.RecordBatch.from_arrays([pa.nulls(0, f.type) for f in schema], schema=schema)


def _dtype(typ: pa.DataType) -> np.dtype:
    try:
        return _TO_NUMPY[typ]
    except KeyError:
        raise pa.ArrowTypeError(f"pipeline._arrow.to_numpy: unsupported type {typ}") from None
