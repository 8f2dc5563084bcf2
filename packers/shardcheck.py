"""A listed shard held against its ``manifest.json`` entry: the one set of checks the loader
(:func:`packers._folder.open_rows`) and the packed-folder reader (:func:`pipeline._read.packed_examples`) run
before a row is read, so both refuse the same edited or foreign shard in the same words. A shared contract module,
as :mod:`packers.rowcheck`: the pipeline and the loader both use it, so it has no leading underscore."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from packers.errors import ContractError
from packers.manifest import MANIFEST, RESTORE, Manifest, ShardEntry, metadata_mismatch
from packers.schema import PLACE_KEYS, read_metadata, row_schema


def checked_metadata(at: str, schema: pa.Schema, m: Manifest, s: ShardEntry) -> dict[str, Any]:
    """The shard's schema metadata, once it reads, its schema is the contract's for its version, and it names this
    run and this entry's place (run id, split, index, count)."""
    try:
        meta = read_metadata(schema)
    except ValueError as e:  # ContractError, or metadata that is not UTF-8 JSON
        raise ContractError(f"{at}: schema metadata unreadable: {e}") from None
    expected = row_schema(meta["contract_version"])
    if not schema.remove_metadata().equals(expected):
        raise ContractError(f"{at}: schema {schema.remove_metadata()} differs from the packed-row contract {expected}")
    wrong = metadata_mismatch(meta, m, s)
    if wrong is not None:
        key, what = wrong
        whose = ("another shard's file (a copy listed twice, or renamed), or another run's" if key in PLACE_KEYS
                 else "not this run's")
        raise ContractError(f"{at}: schema metadata {key} {what}: the shard is {whose}; {RESTORE}")
    return meta


def check_rows(at: str, table: pa.Table, s: ShardEntry) -> None:
    """Arrow's own structure of the shard's rows (buffer sizes, list offsets in bounds, UTF-8: O(rows), no token
    read), then its rows, tokens and examples against the entry: a damaged file fails here, not as an out-of-bounds
    read in the middle of training."""
    try:
        table.validate(full=True)
    except (pa.ArrowException, OSError) as e:
        raise ContractError(f"{at}: not a valid Arrow file ({e}); it was damaged after the run wrote it: {RESTORE}") \
            from None
    measured = {"rows": table.num_rows,  # cheap: one int32 column, and the offsets of another
                "tokens": int(pc.sum(table.column("num_tokens")).as_py() or 0),
                "examples": int(pc.sum(pc.list_value_length(table.column("example_ids"))).as_py() or 0)}
    for key, got in measured.items():
        if got != getattr(s, key):
            raise ContractError(f"{at}: {got:,} {key}, {MANIFEST} says {getattr(s, key):,}: the shard is not the one "
                                f"the run wrote; {RESTORE}")
