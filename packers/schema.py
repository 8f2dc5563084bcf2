"""The packed-row contract (version 9): one Arrow schema, written by the pipeline and read by the loader.

A packed row holds several tokenized examples back to back, with no padding stored. Here is
one row of budget 16 holding three examples (``T`` is a target token, ``.`` is not)::

    example_ids  ["gsm8k/train.jsonl:7",   "oasst:a1b2",       "t0.jsonl:3"]
    input_ids    [ 5  9  2 41 17  1 | 5  8 30  1 | 5 77  6  1 ]     14 tokens <= budget 16
    loss_mask    [ 0  0  0  1  1  1 | 0  0  1  1 | 0  0  1  1 ]
    seq_offsets  [0,                6,          10,          14]    cu_seqlens style
    num_targets  7                                                  the targets the loss sees (below)
    pair_ids, sides, completion_spans   []                          no pairs in this row
    desirable    []                                                 no KTO labels in this row
    cuts         []                                                 no sequence of this row was cut

and what the loader (:class:`packers.Collator`) derives from it at training time::

    position_ids [ 0  1  2  3  4  5 | 0  1  2  3 | 0  1  2  3 ]     reset at every example
    labels       [-100 -100 -100 41 17 1 | -100 -100 30 1 | -100 -100 6 1]
                   ^ -100 where loss_mask is 0, and always on the first token of an example

A row of preference pairs (``packstream pack --pairs``) keeps each pair whole: its two sides are
adjacent sequences, chosen first, and both start with the same prompt tokens. Two pairs in a row
of budget 24::

    example_ids  ["dpo@1#chosen", "dpo@1#rejected",  "dpo@4#chosen", "dpo@4#rejected"]
    input_ids    [ 5  9  2 41 17  1 | 5  9  2 30  1 | 5  7 62 63  1 | 5  7 18  1 ]
    loss_mask    [ 0  0  0  1  1  1 | 0  0  0  1  1 | 0  0  1  1  1 | 0  0  1  1 ]
                   prompt   completion  same prompt     prompt           same prompt
    seq_offsets  [0,                6,             11,             16,          20]
    pair_ids     ["dpo@1",          "dpo@1",          "dpo@4",        "dpo@4"]
    sides        [0,                1,                0,              1]            0 chosen, 1 rejected
    completion_spans [3, 6,         9, 11,            13, 16,         18, 20]       [start, stop) in the row
    num_targets  10

Columns (see :data:`SCHEMA`):

* ``input_ids`` ``list<int32>``: the packed examples' tokens, back to back; ``len <= budget``.
* ``loss_mask`` ``list<uint8>``: 1 where the token is a training target, else 0. Same length.
* ``seq_offsets`` ``list<int32>``: ``[0, end_1, ..., len(input_ids)]``, strictly increasing.
* ``example_ids`` ``list<string>``: one stable id per packed sequence, ``len == len(seq_offsets) - 1``.
  The record's own ``id`` field when it has one, otherwise ``source:position``; a piece of an
  example split by ``--long split`` is ``<id>#<k>``; the sides of a pair are ``<id>#chosen`` and
  ``<id>#rejected``.
* ``num_tokens`` ``int32``: ``len(input_ids)``, for cheap statistics without touching the lists.
* ``num_targets`` ``int32``: the labels :class:`packers.Collator` yields that are not -100 for this
  row: tokens with ``loss_mask`` 1 that are not the first token of their sequence. A loss
  denominator (``num_items_in_batch``) without reading the masks.
* ``pair_ids`` ``list<string>``: empty in a row of plain examples; else one per sequence, the id of
  the pair it belongs to (the same on both sides; ``example_ids[j] == pair_ids[j] + "#chosen"`` or
  ``"#rejected"``).
* ``sides`` ``list<uint8>``: empty, or one per sequence: :class:`Side` (0 chosen, 1 rejected).
  Pairs are adjacent, chosen first: ``0, 1, 0, 1, ...``.
* ``completion_spans`` ``list<int32>``: empty, or two per sequence: ``[start, stop)`` of its
  completion, as token offsets in the row. A completion starts after at least one prompt token
  (a first token has nothing to predict it) and ends within its sequence; ``loss_mask`` is 1
  exactly on the completions; the two sides of a pair hold the same prompt tokens before them.
* ``desirable`` ``list<int8>``: empty in a row whose examples carry no desirability label; else one
  per sequence: 1 desirable, 0 undesirable, -1 no label (KTO data: a record's boolean ``label``,
  ``kto_tag`` or ``--kto-label`` field). :class:`packers.Collator` gives it as the batch's
  ``desirable``, and :func:`packers.sequence_logps` beside each example's log-prob.
* ``cuts`` ``list<int32>``: empty in a row where no sequence was cut; else two per sequence,
  ``[pieces, length]`` (:class:`Cut`): ``[0, 0]`` a whole example; ``[1, N]`` an example of ``N`` tokens
  truncated (``--long truncate``; a pair side: ``N`` the side's length before its completion was cut);
  ``[n, N]``, ``n >= 2``, a piece of an example of ``N`` tokens that ``--long split`` cut into ``n = ceil(N /
  budget)`` pieces (those dropped for holding no target token count), the piece's own index the ``#k`` of
  its id; ``[-1, -1]`` a piece of an example split by an older packstream (a version-6 folder repacked),
  count unknown. ``N`` is more than the sequence's own length. Metadata for tools: the Collator ignores it.
  A cut row of budget 8 (an example of 19 tokens split into 3 pieces, this row holding its piece 2)::

      example_ids  ["t0.jsonl@9#2", "a:1"]
      seq_offsets  [0,              3,      8]
      cuts         [3, 19,          0, 0]

A row holds pairs or plain examples, never both (a run is ``--pairs`` or not; the manifest's
``row_checks.pairs`` says which).

Schema metadata (bytes keys and values, see :func:`schema_metadata`): the contract version,
the token budget, the tokenizer's name and a hash of its vocabulary, the pad/eos ids, and where
the shard belongs: the ``run_id`` of the run that wrote it (``manifest.json`` has the same), its
``split``, and its place ``shard_index`` of ``shard_count`` in that split. A reader holds these
against the manifest's entry for the file, so a shard listed twice, renamed, moved to another
split or taken from another run is refused without reading a row (:mod:`packers.manifest`).

Version history: 1, the first five columns; 2, ``num_targets`` and the pair columns; 3, ``desirable``; 4,
:data:`VISION_SCHEMA` (images); 5, :data:`VIDEO_SCHEMA` (videos, ``--video-fps``); 6 (this), the same schema as 3 under
TRL's mask rule (:data:`MASK_RULE_CHANGE`: the prompt of a prompt-completion, KTO or preference record is context
whatever roles it holds, a conversation keeps the chat template's ending, a string prompt/completion record is raw
text with EOS appended); 7 and 8, the same rule with :data:`VISION_SCHEMA` and :data:`VIDEO_SCHEMA`; 9 (this),
``cuts``: a per-sequence mark of examples cut by --long truncate/split (:data:`SCHEMA`; version 6 is
:data:`SCHEMA_V6`, still read, its cut sequences unmarked). The image and video schemas (7, 8) are built on
:data:`SCHEMA_V6` and carry no ``cuts`` column (out of scope for now). An older folder is refused with "repack"
(:func:`read_metadata`); one of version 3, 4 or 5 in words that say what changed.

>>> import pyarrow as pa
>>> row = {"input_ids": [5, 9, 2, 41, 17, 1, 5, 8, 30, 1], "loss_mask": [0, 0, 0, 1, 1, 1, 0, 0, 1, 1],
...        "seq_offsets": [0, 6, 10], "example_ids": ["a:1", "b:2"], "num_tokens": 10, "num_targets": 5,
...        "pair_ids": [], "sides": [], "completion_spans": [], "desirable": [], "cuts": []}
>>> validate_row(pa.Table.from_pylist([row], schema=SCHEMA).to_pylist()[0], budget=16)
>>> validate_row({**row, "seq_offsets": [0, 6, 9]}, budget=16)
Traceback (most recent call last):
...
packers.errors.ContractError: seq_offsets must end at len(input_ids)=10, got 9
>>> pair = {"input_ids": [5, 9, 2, 41, 17, 1, 5, 9, 2, 30, 1], "loss_mask": [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1],
...         "seq_offsets": [0, 6, 11], "example_ids": ["dpo@1#chosen", "dpo@1#rejected"], "num_tokens": 11,
...         "num_targets": 5, "pair_ids": ["dpo@1", "dpo@1"], "sides": [0, 1], "completion_spans": [3, 6, 9, 11],
...         "desirable": [], "cuts": []}
>>> validate_row(pair, budget=16)
>>> validate_row({**pair, "input_ids": [5, 9, 2, 41, 17, 1, 5, 8, 2, 30, 1]}, budget=16)
Traceback (most recent call last):
...
packers.errors.ContractError: pair dpo@1: the prompts differ (chosen [5, 9, 2], rejected [5, 8, 2])

The same two examples, the first a window of 6 tokens that ``--long truncate`` kept of 20, the second whole;
then a mark whose length is not more than its window's:

>>> validate_row({**row, "cuts": [1, 20, 0, 0]}, budget=16)
>>> validate_row({**row, "cuts": [1, 6, 0, 0]}, budget=16)
Traceback (most recent call last):
...
packers.errors.ContractError: sequence 0 (a:1): cuts [1, 6] says it was cut from 6 tokens, but it holds 6; a cut sequence's length N is more than its own; the row was changed since packing: restore the folder or re-run packstream pack

A shared contract module: the pipeline (writer, verify, inspect) and the loader both use it, so it
has no leading underscore; users reach the same names through :mod:`packers`.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Mapping

import pyarrow as pa

from packers.errors import ContractError

CONTRACT_VERSION = 9
"""The contract version of a text run (:data:`SCHEMA`; 6 before the ``cuts`` column, still read). Bump on any incompatible change to :data:`SCHEMA`, its metadata keys, or what its rows mean (the tokens and masks a
record becomes; see the version history above)."""

MASK_RULE_CHANGE = ("packed before packstream's TRL mask rule: prompt-completion, KTO and preference prompts are "
                    "context whatever roles they hold, conversations keep the chat template's ending, string "
                    "prompt/completion records are raw text")
"""What versions 6, 7 and 8 changed from 3, 4 and 5 (the same three schemas): the words of the refusal of an older
folder (:func:`mask_rule_refusal`) and of the docs."""

MASK_RULE_VERSIONS = (3, 4, 5)
"""The text, image and video versions before the TRL mask rule: same schemas, other masks and tokens. Refused."""

REPACK = "repack it with this packstream (re-run packstream pack on its inputs)"

MAX_TOKENS_LIMIT = 1 << 24
"""The largest row budget: offsets are int32, and best-fit keeps a bucket per capacity (O(budget) memory).
16,777,216 tokens is far above any row a model trains on."""

SCHEMA_V6 = pa.schema(
    [
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("seq_offsets", pa.list_(pa.int32()), nullable=False),
        pa.field("example_ids", pa.list_(pa.string()), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("num_targets", pa.int32(), nullable=False),
        pa.field("pair_ids", pa.list_(pa.string()), nullable=False),
        pa.field("sides", pa.list_(pa.uint8()), nullable=False),
        pa.field("completion_spans", pa.list_(pa.int32()), nullable=False),
        pa.field("desirable", pa.list_(pa.int8()), nullable=False),
    ]
)
"""The shard schema of contract version 6 (text rows before ``cuts``), and the base of the image and video schemas
(versions 7 and 8, unchanged)."""

TEXT_V6_VERSION = 6
"""The text version before the ``cuts`` column: :data:`SCHEMA_V6`, still read."""

TEXT_VERSIONS = (TEXT_V6_VERSION, CONTRACT_VERSION)
"""The contract versions of text rows (no vision metadata): 6 (:data:`SCHEMA_V6`) and 9 (:data:`SCHEMA`)."""

SCHEMA = pa.schema(list(SCHEMA_V6) + [pa.field("cuts", pa.list_(pa.int32()), nullable=False)])
"""The shard schema (version 9): :data:`SCHEMA_V6` and ``cuts``. Never inferred from data: every writer casts to it."""

IMAGE_TYPE = pa.struct([pa.field("path", pa.string()), pa.field("bytes", pa.binary())])
"""One image as a row carries it: a path or URI (resolved when packed), or the encoded bytes (Hugging Face datasets'
``Image`` encoding)."""

VISION_CONTRACT_VERSION = 7
"""The contract version of a run with images: :data:`VISION_SCHEMA`. A reader that knows only version 6 refuses it,
so no older packstream trains the image placeholders as text. (4 before the TRL mask rule.)"""

VISION_SCHEMA = pa.schema(
    list(SCHEMA_V6)
    + [
        pa.field("image_offsets", pa.list_(pa.int32()), nullable=False),
        pa.field("image_grid_thw", pa.list_(pa.int32()), nullable=False),
        pa.field("images", pa.list_(IMAGE_TYPE), nullable=False),
    ]
)
"""The shard schema of a run with images (``packstream pack --processor``): :data:`SCHEMA_V6` and, per row, in row order,
each image's start ``image_offsets`` (the token offset of its first placeholder token), its patch grid
``image_grid_thw`` (three per image: t, h, w, as the processor's ``image_grid_thw``) and the image itself ``images``.
An image's placeholder run is :meth:`packers.VisionSpec.grid_tokens` tokens long, lies inside one example, and is
never a target. Empty lists in a row without images."""

VISION_COLUMNS = ("image_offsets", "image_grid_thw", "images")

VIDEO_CONTRACT_VERSION = 8
"""The contract version of a run that packs videos (``--video-fps``): :data:`VIDEO_SCHEMA`. A reader that knows only
versions 6 and 7 refuses it, so no older packstream trains the video placeholders as text. (5 before the TRL mask
rule.)"""

VIDEO_SCHEMA = pa.schema(
    list(VISION_SCHEMA)
    + [
        pa.field("video_offsets", pa.list_(pa.int32()), nullable=False),
        pa.field("video_grid_thw", pa.list_(pa.int32()), nullable=False),
        pa.field("videos", pa.list_(IMAGE_TYPE), nullable=False),
        pa.field("second_per_grid_ts", pa.list_(pa.float32()), nullable=False),
    ]
)
"""The shard schema of a run with videos: :data:`VISION_SCHEMA` and, per row, in row order, each video's start
``video_offsets`` (its first ``<|video_pad|>`` token), its patch grid ``video_grid_thw`` (t, h, w: t the sampled frames
over the temporal patch), the file ``videos`` (``{path, bytes}`` as images) and its ``second_per_grid_ts`` (the
processor's ``temporal_patch_size / sampled fps``, float32; Qwen2.5-VL's temporal positions are scaled by it). A video's
run is ``t * h * w / merge**2`` tokens, inside one example, never a target. Empty lists in a row without videos."""

VIDEO_COLUMNS = ("video_offsets", "video_grid_thw", "videos", "second_per_grid_ts")

READABLE_VERSIONS = (TEXT_V6_VERSION, VISION_CONTRACT_VERSION, VIDEO_CONTRACT_VERSION, CONTRACT_VERSION)


def is_text(contract_version: Any) -> bool:
    """A text contract version (6 or 9: no images, no vision metadata)."""
    return type(contract_version) is int and contract_version in TEXT_VERSIONS


def mask_rule_refusal(what: str, version: Any) -> str | None:
    """The one-line refusal of a ``what`` (``shard``, ``manifest.json``) of contract ``version`` when that version
    is one of :data:`MASK_RULE_VERSIONS` (packed before the TRL mask rule); None for any other version.

    >>> print(mask_rule_refusal("shard", 3))  # doctest: +NORMALIZE_WHITESPACE
    shard has contract version 3 (packed before packstream's TRL mask rule: prompt-completion, KTO and preference
    prompts are context whatever roles they hold, conversations keep the chat template's ending, string
    prompt/completion records are raw text); repack it with this packstream (re-run packstream pack on its inputs)
    >>> mask_rule_refusal("shard", 6) is None
    True
    """
    if type(version) is int and version in MASK_RULE_VERSIONS:
        return f"{what} has contract version {version} ({MASK_RULE_CHANGE}); {REPACK}"
    return None


def vision_version(vision: str | None) -> int:
    """The contract version of a run whose vision spec is ``vision`` (:meth:`packers.VisionSpec.to_json`; None: text):
    9, 7 with images, 8 when the spec packs videos (its ``video_fps`` is set)."""
    if vision is None:
        return CONTRACT_VERSION
    try:
        videos = json.loads(vision).get("video_fps") is not None
    except (ValueError, AttributeError):
        videos = False
    return VIDEO_CONTRACT_VERSION if videos else VISION_CONTRACT_VERSION


def row_schema(contract_version: int) -> pa.Schema:
    """The row schema of a contract version this packstream reads."""
    if contract_version == VISION_CONTRACT_VERSION:
        return VISION_SCHEMA
    if contract_version == VIDEO_CONTRACT_VERSION:
        return VIDEO_SCHEMA
    if contract_version == CONTRACT_VERSION:
        return SCHEMA
    if contract_version == TEXT_V6_VERSION:
        return SCHEMA_V6
    old = mask_rule_refusal("data", contract_version)
    if old is not None:
        raise ContractError(old)
    raise ContractError(f"contract version {contract_version!r} is not one this packstream reads "
                        f"({', '.join(map(str, READABLE_VERSIONS))}); repack the data or install a matching packstream")


PAIR_COLUMNS = ("pair_ids", "sides", "completion_spans")
"""Empty in a row of plain examples; one entry per sequence (two for the spans) in a row of pairs."""

NO_LABEL = -1
"""A sequence's ``desirable`` value when its record carries no desirability label (in a row where another does)."""


class Side(enum.IntEnum):
    """Which answer of a preference pair a sequence is (the ``sides`` column)."""

    CHOSEN = 0
    REJECTED = 1

    @property
    def suffix(self) -> str:
        """What the sequence's example id adds to its pair id: ``#chosen`` or ``#rejected``."""
        return "#" + self.name.lower()


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
    vision: str | None = None,
) -> dict[bytes, bytes]:
    """The metadata every shard of one run carries; :func:`place_metadata` adds the shard's own place.
    ``vision``: the run's :meth:`packers.VisionSpec.to_json` when it packs images (contract version 7, 8 with videos)."""
    values = {
        "contract_version": vision_version(vision),
        "budget": budget,
        "tokenizer": tokenizer,
        "tokenizer_vocab_sha256": vocab_sha256,
        "pad_token_id": pad_token_id,
        "eos_token_id": eos_token_id,
        "run_id": run_id,
    }
    if vision is not None:
        values["vision"] = vision
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
    old = mask_rule_refusal("shard", out["contract_version"])
    if old is not None:
        raise ContractError(old)
    if out["contract_version"] not in READABLE_VERSIONS:
        raise ContractError(
            f"shard has contract version {out['contract_version']}, this packstream reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}; repack the data or install a matching packstream"
        )
    if is_text(out["contract_version"]) == ("vision" in out):  # text (6, 9) has no vision metadata; 7, 8 have it
        raise ContractError(f"shard has contract version {out['contract_version']} "
                            f"{'without' if 'vision' not in out else 'with'} packstream.vision metadata; "
                            "it was not written by packstream: repack the data")
    return out


def shard_schema(**metadata: Any) -> pa.Schema:
    """:data:`SCHEMA` (:data:`VISION_SCHEMA` with ``vision=``) with :func:`schema_metadata` attached."""
    schema = row_schema(vision_version(metadata.get("vision")))
    return schema.with_metadata(schema_metadata(**metadata))


def count_targets(loss_mask: Any, seq_offsets: Any) -> int:
    """``num_targets`` of a row: tokens with loss_mask 1, less those on a sequence's first token."""
    return int(sum(int(x) for x in loss_mask)) - sum(int(loss_mask[a]) for a in list(seq_offsets)[:-1])


def validate_row(row: Mapping[str, Any], budget: int) -> None:
    """Check one row (a dict of Python lists) against the contract; raise ContractError if broken.

    The per-row definition that the loader's and ``packstream verify``'s vectorized checks follow.
    """
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
    if any(int(m) not in (0, 1) for m in mask):
        raise ContractError("loss_mask holds a value other than 0 and 1")
    targets = count_targets(mask, offs)
    if row.get("num_targets", targets) != targets:
        raise ContractError(f"num_targets={row['num_targets']} but the row has {targets} targets "
                            "(loss_mask 1, not on a sequence's first token)")
    validate_pairs(row)
    validate_desirable(row)
    validate_cuts(row)


def validate_desirable(row: Mapping[str, Any]) -> None:
    """The ``desirable`` column of one row: empty, or one of 1, 0, -1 per sequence."""
    values = list(row.get("desirable") or [])
    nseq = len(row["seq_offsets"]) - 1
    if values and len(values) != nseq:
        raise ContractError(f"desirable holds {len(values)} values for {nseq} sequences; expected {nseq} (or none)")
    if any(int(v) not in (1, 0, NO_LABEL) for v in values):
        raise ContractError(f"desirable holds a value other than 1, 0 and {NO_LABEL}: {values[:8]}")


_CUT_FIX = "the row was changed since packing: restore the folder or re-run packstream pack"


class Cut(enum.IntEnum):
    """The first value of a sequence's ``cuts`` mark ``[pieces, length]`` (the values >= 2 are split pieces)."""

    OLD_PIECE = -1
    """A piece of an example split by an older packstream (version 6, repacked): ``[-1, -1]``."""
    WHOLE = 0
    """A whole example: ``[0, 0]``."""
    TRUNCATED = 1
    """A window ``--long truncate`` kept (or a pair side cut): ``[1, N]``."""


def piece_index(example_id: str) -> int | None:
    """The ``k`` of an id ending ``#k`` (a piece of a split example), else None.

    >>> piece_index("t0.jsonl@9#2"), piece_index("dpo@1#chosen"), piece_index("a:1")
    (2, None, None)
    """
    head, sep, tail = example_id.rpartition("#")
    return int(tail) if sep and tail.isdigit() and tail.isascii() else None


def cut_problem(pieces: int, length: int, own: int, example_id: str) -> str | None:
    """What is wrong with one sequence's mark ``[pieces, length]`` (``own`` its tokens; see the ``cuts`` column),
    or None; the one definition :func:`validate_row` and the loader's vectorized check (:mod:`packers.rowcheck`)
    follow."""
    mark = f"cuts [{pieces}, {length}]"
    if pieces < -1:
        return f"{mark}: pieces is {pieces}; it is -1 (an older split's piece), 0 (whole), 1 (truncated) or >= 2"
    if pieces == Cut.WHOLE and length != 0:
        return f"{mark}: a whole sequence (pieces 0) has length 0"
    if pieces == Cut.OLD_PIECE and length != -1:
        return f"{mark}: an older split's piece (pieces -1) has length -1"
    if length == -1 and pieces != Cut.OLD_PIECE:
        return f"{mark}: length -1 goes only with pieces -1"
    if pieces in (Cut.TRUNCATED,) or pieces >= 2:
        if length <= own:
            return (f"{mark} says it was cut from {length} tokens, but it holds {own}; a cut sequence's length N is "
                    "more than its own")
    if pieces >= 2 or pieces == Cut.OLD_PIECE:
        k = piece_index(example_id)
        if k is None or (pieces >= 2 and k >= pieces):
            return (f"{mark} marks a piece of a split example, but its id does not end with #k, k < {pieces}"
                    if pieces >= 2 else f"{mark} marks a piece of a split example, but its id does not end with #k")
    return None


def validate_cuts(row: Mapping[str, Any]) -> None:
    """The ``cuts`` column of one row: empty, or a mark ``[pieces, length]`` per sequence (:func:`cut_problem`);
    nothing to check in a row without the column (contract version 6)."""
    values = [int(v) for v in (row.get("cuts") or [])]
    offs, ex = row["seq_offsets"], row["example_ids"]
    nseq = len(offs) - 1
    if not values:
        return
    if len(values) != 2 * nseq:
        raise ContractError(f"cuts holds {len(values)} values for {nseq} sequences; expected {2 * nseq} (a [pieces, "
                            "length] mark per sequence), or none in a row where no sequence was cut")
    for j in range(nseq):
        why = cut_problem(values[2 * j], values[2 * j + 1], int(offs[j + 1]) - int(offs[j]), ex[j])
        if why is not None:
            raise ContractError(f"sequence {j} ({ex[j]}): {why}; {_CUT_FIX}")


def validate_pairs(row: Mapping[str, Any]) -> None:
    """The pair columns of one row (see the module docstring); nothing to check in a row of plain examples."""
    pids, sides, spans = (list(row.get(c) or []) for c in PAIR_COLUMNS)
    ids, mask, offs, ex = row["input_ids"], row["loss_mask"], row["seq_offsets"], row["example_ids"]
    nseq = len(offs) - 1
    if not (pids or sides or spans):
        return
    if len(pids) != nseq or len(sides) != nseq or len(spans) != 2 * nseq:
        raise ContractError(f"pair columns: {len(pids)} pair_ids, {len(sides)} sides, {len(spans)} completion_spans "
                            f"for {nseq} sequences; expected {nseq}, {nseq}, {2 * nseq} (or all empty)")
    if nseq % 2 or any(int(s) != j % 2 for j, s in enumerate(sides)):
        raise ContractError(f"sides must alternate chosen (0), rejected (1), chosen first, got {sides[:8]}")
    covered = [0] * len(ids)
    for j in range(nseq):
        a, b = int(spans[2 * j]), int(spans[2 * j + 1])
        if not offs[j] < a < b <= offs[j + 1]:
            raise ContractError(f"sequence {j} ({ex[j]}): completion span [{a}, {b}) must lie in its tokens "
                                f"[{offs[j]}, {offs[j + 1]}), after at least one prompt token, and hold a token")
        covered[a:b] = [1] * (b - a)
    if [int(m) for m in mask] != covered:
        t = next(i for i, (m, c) in enumerate(zip(mask, covered)) if int(m) != c)
        raise ContractError(f"loss_mask[{t}] is {int(mask[t])}, but a row of pairs trains exactly on the completion "
                            "spans")
    for j in range(0, nseq, 2):
        c, r = list(ids[offs[j]:spans[2 * j]]), list(ids[offs[j + 1]:spans[2 * j + 2]])
        if c != r:
            raise ContractError(f"pair {pids[j]}: the prompts differ (chosen {c[:16]}, rejected {r[:16]})")
    for j in range(nseq):
        side = Side(int(sides[j]))
        if not pids[j]:
            raise ContractError(f"sequence {j}: the pair id is empty")
        if j % 2 and pids[j] != pids[j - 1]:
            raise ContractError(f"sequences {j - 1}, {j}: a chosen side ({pids[j - 1]}) is not followed by its "
                                f"rejected side (got {pids[j]})")
        if ex[j] != pids[j] + side.suffix:
            raise ContractError(f"sequence {j}: example id {ex[j]!r} is not its pair id {pids[j]!r} + {side.suffix!r}")
    if len(set(pids)) != nseq // 2:
        raise ContractError(f"a pair id appears twice in the row: {pids}")
