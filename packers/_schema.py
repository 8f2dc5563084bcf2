"""The packed-row contract: one Arrow schema, written by the pipeline and read by the loader.

A packed row holds several tokenized examples back to back, with no padding stored. Here is
one row of budget 16 holding three examples (``T`` is a target token, ``.`` is not)::

    example_ids  ["gsm8k/train.jsonl:7",   "oasst:a1b2",       "t0.jsonl:3"]
    input_ids    [ 5  9  2 41 17  1 | 5  8 30  1 | 5 77  6  1 ]     14 tokens <= budget 16
    loss_mask    [ 0  0  0  1  1  1 | 0  0  1  1 | 0  0  1  1 ]
    seq_offsets  [0,                6,          10,          14]    cu_seqlens style

and what the loader (:class:`packers.Collator`) derives from it at training time::

    position_ids [ 0  1  2  3  4  5 | 0  1  2  3 | 0  1  2  3 ]     reset at every example
    labels       [-100 -100 -100 41 17 1 | -100 -100 30 1 | -100 -100 6 1]
                   ^ -100 where loss_mask is 0, and always on the first token of an example

Columns (see :data:`SCHEMA`):

* ``input_ids`` ``list<int32>``: the packed examples' tokens, back to back; ``len <= budget``.
* ``loss_mask`` ``list<uint8>``: 1 where the token is a training target, else 0. Same length.
* ``seq_offsets`` ``list<int32>``: ``[0, end_1, ..., len(input_ids)]``, strictly increasing.
* ``example_ids`` ``list<string>``: one stable id per packed example, ``len == len(seq_offsets) - 1``.
  The record's own ``id`` field when it has one, otherwise ``source:position``; a piece of an
  example split by ``--long split`` is ``<id>#<k>``.
* ``num_tokens`` ``int32``: ``len(input_ids)``, for cheap statistics without touching the lists.

Schema metadata (bytes keys and values, see :func:`schema_metadata`): the contract version,
the token budget, the tokenizer's name and a hash of its vocabulary, the pad/eos ids, and where
the shard belongs: the ``run_id`` of the run that wrote it (``manifest.json`` has the same), its
``split``, and its place ``shard_index`` of ``shard_count`` in that split. A reader holds these
against the manifest's entry for the file, so a shard listed twice, renamed, moved to another
split or taken from another run is refused without reading a row (:mod:`packers._manifest`).

>>> import pyarrow as pa
>>> t = pa.Table.from_pylist([{
...     "input_ids": [5, 9, 2, 41, 17, 1, 5, 8, 30, 1], "loss_mask": [0, 0, 0, 1, 1, 1, 0, 0, 1, 1],
...     "seq_offsets": [0, 6, 10], "example_ids": ["a:1", "b:2"], "num_tokens": 10}], schema=SCHEMA)
>>> validate_row(t.to_pylist()[0], budget=16)
>>> validate_row({**t.to_pylist()[0], "seq_offsets": [0, 6, 9]}, budget=16)
Traceback (most recent call last):
...
packers._errors.ContractError: seq_offsets must end at len(input_ids)=10, got 9
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import pyarrow as pa

from packers._errors import ContractError

CONTRACT_VERSION = 1
"""Bump on any incompatible change to :data:`SCHEMA` or its metadata keys."""

MAX_TOKENS_LIMIT = 1 << 24
"""The largest row budget: offsets are int32, and best-fit keeps a bucket per capacity (O(budget) memory).
16,777,216 tokens is far above any row a model trains on."""

SCHEMA = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("seq_offsets", pa.list_(pa.int32()), nullable=False),
        pa.field("example_ids", pa.list_(pa.string()), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
    ]
)
"""The shard schema. Never inferred from data: every writer casts to it."""

_META_PREFIX = "packstream."
PLACE_KEYS = ("run_id", "split", "shard_index", "shard_count")
"""The metadata keys that say where one shard belongs (the rest are the same on every shard of a run)."""
_MAX_META_BYTES = 1 << 16
"""A packstream metadata value is a short JSON scalar; anything longer is not one packstream wrote."""


def schema_metadata(
    *,
    budget: int,
    tokenizer: str,
    vocab_sha256: str,
    pad_token_id: int | None,
    eos_token_id: int | None,
    run_id: str,
) -> dict[bytes, bytes]:
    """The metadata every shard of one run carries; :func:`place_metadata` adds the shard's own place."""
    values = {
        "contract_version": CONTRACT_VERSION,
        "budget": budget,
        "tokenizer": tokenizer,
        "tokenizer_vocab_sha256": vocab_sha256,
        "pad_token_id": pad_token_id,
        "eos_token_id": eos_token_id,
        "run_id": run_id,
    }
    return {(_META_PREFIX + k).encode(): json.dumps(v).encode() for k, v in values.items()}


def place_metadata(metadata: Mapping[bytes, bytes], *, split: str, shard_index: int,
                   shard_count: int) -> dict[bytes, bytes]:
    """``metadata`` (a run's :func:`schema_metadata`) plus one shard's place: ``split``, ``shard_index`` of
    ``shard_count``. The writer calls it for each shard it opens; the values equal the shard's name
    (``train-00003-of-00008.arrow``: train, 3, 8) and its manifest entry."""
    place = {"split": split, "shard_index": shard_index, "shard_count": shard_count}
    return {**metadata, **{(_META_PREFIX + k).encode(): json.dumps(v).encode() for k, v in place.items()}}


def read_metadata(schema: pa.Schema) -> dict[str, Any]:
    """Decode :func:`schema_metadata` from a shard's schema; raises ContractError if absent or unreadable."""
    meta = schema.metadata or {}
    out = {}
    for k, v in meta.items():
        key = k.decode(errors="replace")
        if not key.startswith(_META_PREFIX):
            continue
        if len(v) > _MAX_META_BYTES:
            raise ContractError(f"schema metadata {key} holds {len(v):,} bytes; packstream writes short JSON values")
        try:
            out[key[len(_META_PREFIX):]] = json.loads(v)
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or an integer too long to convert
            raise ContractError(f"schema metadata {key} is not JSON ({str(e)[:80]})") from None
    if "contract_version" not in out:
        raise ContractError("not a packstream shard: schema metadata has no packstream.contract_version")
    if out["contract_version"] != CONTRACT_VERSION:
        raise ContractError(
            f"shard has contract version {out['contract_version']}, this packstream reads version "
            f"{CONTRACT_VERSION}; repack the data or install a matching packstream"
        )
    return out


def shard_schema(**metadata: Any) -> pa.Schema:
    """:data:`SCHEMA` with :func:`schema_metadata` attached."""
    return SCHEMA.with_metadata(schema_metadata(**metadata))


def validate_row(row: Mapping[str, Any], budget: int) -> None:
    """Check one row (a dict of Python lists) against the contract; raise ContractError if broken."""
    ids, mask, offs, ex = row["input_ids"], row["loss_mask"], row["seq_offsets"], row["example_ids"]
    n = len(ids)
    if n > budget:
        raise ContractError(f"row has {n} tokens > budget {budget}")
    if len(mask) != n:
        raise ContractError(f"loss_mask has {len(mask)} entries, input_ids has {n}")
    if row.get("num_tokens", n) != n:
        raise ContractError(f"num_tokens={row['num_tokens']} but len(input_ids)={n}")
    if not offs or offs[0] != 0:
        raise ContractError(f"seq_offsets must start at 0, got {list(offs[:1])}")
    if offs[-1] != n:
        raise ContractError(f"seq_offsets must end at len(input_ids)={n}, got {offs[-1]}")
    if any(b <= a for a, b in zip(offs, offs[1:])):
        raise ContractError(f"seq_offsets must be strictly increasing, got {list(offs)}")
    if len(ex) != len(offs) - 1:
        raise ContractError(f"{len(ex)} example_ids for {len(offs) - 1} sequences")
