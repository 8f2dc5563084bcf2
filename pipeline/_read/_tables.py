"""Tables (Parquet, Arrow, datasets folders): rows as the records they hold."""

from __future__ import annotations

import json
from typing import Any, Iterator, Optional

from pipeline._formats import Rejected
from pipeline._read._files import InputFile, hf_dataset, open_raw
from pipeline._read._json import parse_line


_JSON_VALUE = "json"


def _decoder(t: Any, feature: Any = None) -> Any:
    """What turns a value of Arrow type ``t`` back into the record it stores: None (nothing: no struct and
    no JSON inside), :data:`_JSON_VALUE`, ``("struct", {field: decoder})`` or ``("list", decoder)``.

    ``feature`` is ``datasets``' description of the same place (its ``huggingface`` schema metadata),
    which marks a ``Json`` feature even where a writer dropped the Arrow extension type.
    """
    import pyarrow as pa

    if getattr(t, "extension_name", None) == "arrow.json" or (isinstance(feature, dict) and feature.get("_type") == "Json"):
        return _JSON_VALUE
    if isinstance(t, pa.ExtensionType):
        t = t.storage_type
    if pa.types.is_struct(t):
        sub = feature if isinstance(feature, dict) and "_type" not in feature else {}
        return ("struct", {t.field(i).name: _decoder(t.field(i).type, sub.get(t.field(i).name)) for i in range(t.num_fields)})
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_list_view(t) \
            or pa.types.is_large_list_view(t):
        inner = feature.get("feature") if isinstance(feature, dict) and feature.get("_type") in ("List", "LargeList", "Sequence") else None
        sub = _decoder(t.value_type, inner)
        return None if sub is None else ("list", sub)
    return None


def row_decoder(schema: Any) -> Any:
    """The decoder (:func:`_decoder`) of a table's rows: a struct of its columns."""
    import pyarrow as pa

    features = None
    meta = (schema.metadata or {}).get(b"huggingface")
    if meta:
        try:
            features = (json.loads(meta).get("info") or {}).get("features")
        except (ValueError, AttributeError):
            features = None
    return _decoder(pa.struct(list(schema)), features if isinstance(features, dict) else None)


def _restore(value: Any, decoder: Any, max_bytes: int, at: str) -> Any:
    """A columnar value as the record it stores (see :func:`table_rows`)."""
    if value is None or decoder is None:
        return value
    if decoder is _JSON_VALUE:
        if not isinstance(value, str):
            return value
        record = parse_line(value.encode("utf-8", "surrogatepass"), max_bytes)
        if isinstance(record, Rejected):
            raise Rejected(record.reason, f"the Json value at {at}: {record.detail}")
        return record
    kind, sub = decoder
    if kind == "struct":
        return {k: _restore(v, sub.get(k), max_bytes, f"{at}.{k}" if at else k) for k, v in value.items() if v is not None}
    return [_restore(x, sub, max_bytes, f"{at}[{j}]") for j, x in enumerate(value)]


def table_rows(batch: Any, max_bytes: int, decoder: Any = None) -> list:
    """The records of a record batch or table (a Rejected for a record that cannot be restored).

    Columnar files store records differently from JSON, and these two differences are undone here,
    so that the same records give the same examples in every container (tests/test_containers.py):

    * ``datasets``' ``Json`` feature (the ``arrow.json`` extension type, which ``datasets`` 5 writes
      to Parquet and ``save_to_disk`` for free-form values) stores each value as JSON text: it is
      decoded, never read as a string holding JSON.
    * A columnar schema gives every row every field of a struct, so the fields a record lacked come
      back as nulls (pyarrow and ``datasets`` fill them): a null struct field is dropped, as it is
      not in the record. Values decoded from ``Json`` are left as their JSON says, nulls included.
    """
    decoder = row_decoder(batch.schema) if decoder is None else decoder
    out: list = []
    for row in batch.to_pylist():
        try:
            out.append(_restore(row, decoder, max_bytes, ""))
        except Rejected as r:
            out.append(r)
    return out


def table_batches(f: InputFile, max_bytes: int, start: int = 0, stop: Optional[int] = None) -> Iterator[list]:
    """Records ``start:stop`` of a table input (:func:`table_rows`), in lists of up to 1024."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if f.kind == "hf_disk":
        ds = hf_dataset(f).with_format("arrow")
        stop = len(ds) if stop is None else min(stop, len(ds))
        decoder = row_decoder(ds.features.arrow_schema) if hasattr(ds.features, "arrow_schema") else None
        for i in range(start, stop, 1024):
            yield table_rows(ds[i:min(i + 1024, stop)], max_bytes, decoder)
        return
    with open_raw(f.path) as fh:
        if f.kind == "parquet":
            pf = pq.ParquetFile(fh)
            decoder = row_decoder(pf.schema_arrow)
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            first = 0
            for g, n in enumerate(sizes):  # tasks start and stop at row-group boundaries
                if first >= start and (stop is None or first < stop):
                    for batch in pf.iter_batches(batch_size=1024, row_groups=[g]):
                        yield table_rows(batch, max_bytes, decoder)
                first += n
            return
        # Arrow: IPC file (random access, "ARROW1" first) or stream, read batch by batch from the checked file.
        source = pa.PythonFile(fh, mode="r")
        if fh.read(6) == b"ARROW1":
            fh.seek(0)
            reader = pa.ipc.open_file(source)
            schema, batches = reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            fh.seek(0)
            reader = pa.ipc.open_stream(source)
            schema, batches = reader.schema, iter(reader)
        decoder = row_decoder(schema)
        for batch in batches:
            yield table_rows(batch, max_bytes, decoder)
