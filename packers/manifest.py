"""The output-folder contract: ``manifest.json``, the run lock, and the files a run owns.

A finished ``packstream pack`` folder::

    out/
      train-00000-of-00002.arrow       shards: listed in the manifest with rows, bytes and sha256
      train-00001-of-00002.arrow
      validation-00000-of-00001.arrow  (only with --validation-fraction)
      rejected.jsonl                   dead letters, one JSON object per line
      README.md                        the dataset card (datasets / the Hub read its YAML header)
      manifest.json                    written LAST, atomically; "status": "complete" marks the commit

While a run holds the folder, ``.packstream.lock`` (created exclusively; pid, host, start time)
is there too, and files appear under ``.tmp-*`` names before they are renamed into place. A run
that fails (for any reason, exit 3 included) writes no complete manifest: either none (killed)
or one with ``"status": "failed"`` and the reason. Readers (the loader, ``packstream verify``)
trust only a complete manifest: they open exactly the shards it lists, check sizes (and, when
asked, sha256), and refuse a folder without one, or with shard files it does not list.

The manifest's keys that readers rely on (the writer, :mod:`pipeline._job`, fills them)::

    status           "complete" | "failed"
    error            why a failed run failed (failed only)
    contract_version 9 (6: rows without ``cuts``), 7 with images, 8 with videos (+"vision", "media_roots"); 3-5 refused
    run_id           16 hex digits: a digest of what decides the run's bytes (options but the output
                     folder, inputs, tokenizer); every shard carries it in its schema metadata
    shards           [{"name", "split", "rows", "examples", "tokens", "target_tokens", "bytes", "sha256"}]
    files            every file name the run wrote (shards, rejected.jsonl, README.md); --overwrite
                     removes exactly these (plus packstream's .tmp-* names and a broken lock)
    rejected_file    "rejected.jsonl"
    row_checks       what every row of the run satisfies, so a reader can check rows as it reads:
                     {"budget": int, "eos_token_id": int | null,
                      "eos_at_boundaries": bool,          every sequence shorter than the budget ends
                                                          with eos_token_id (a full-budget sequence is a
                                                          piece of a truncated or split example)
                      "targets_in_every_sequence": bool,  every sequence has a loss_mask 1
                      "all_targets": bool,                every token is a target (--train-on all)
                      "pairs": bool}                      every row holds preference pairs (--pairs; the
                                                          pair columns of the row contract), else none does
    tokenizer        {"name", "vocab_sha256", "eos_token_id", "pad_token_id", ...}
    config, counts, inputs   the run's options and counts (see docs/operations.md)

**One typed reader.** :func:`load_manifest` reads ``manifest.json`` through the checked open
(:func:`packers.files.read_checked`: a regular file, at most :data:`MAX_MANIFEST_BYTES`, JSON at most 512 levels
deep) and :func:`parse_manifest` turns it into a frozen :class:`Manifest`: every key a reader uses has its type and
range checked, and the manifest must agree with itself (:func:`inconsistencies`): counts equal the sums of the shard
entries and reconcile, each split's shards are named ``-of-N`` with N its number of shards and indexes 0..N-1 once
each, names are unique, split labels match the names, ``files`` lists exactly the run's files. ``verify``,
``inspect``, the loader and ``pack --overwrite`` all read it this way, and refuse a manifest that fails in one line:
nothing a reader does later meets an unexpected type. Each shard's own schema metadata (run id, split, index,
count: :func:`expected_metadata`) is then held against its entry.

>>> m = parse_manifest(b'{"status": "failed", "error": "disk full", "files": ["README.md"]}', "out")
>>> (m.status.value, m.error, m.files, m.shards)
('failed', 'disk full', ('README.md',), ())
>>> parse_manifest(b'{"status": "complete", "files": ["../../.bashrc"]}', "out")
Traceback (most recent call last):
...
packers.errors.ContractError: out: manifest.json files[0] is '../../.bashrc', expected a file name packstream writes (a shard name, rejected.jsonl or README.md); the manifest was edited or damaged, or not written by packstream: restore the folder or re-run packstream pack

A shared contract module (the pipeline and the loader use it): users reach its names through :mod:`packers`.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import IO, Any, Callable, Iterable, Mapping, Optional

from packers.errors import ContractError, PackstreamError, is_int, is_weight, short
from packers.files import MiB, load_json, read_checked, show_path
from packers.schema import CONTRACT_VERSION, READABLE_VERSIONS, is_text, mask_rule_refusal

MANIFEST = "manifest.json"
LOCK = ".packstream.lock"
TMP_PREFIX = ".tmp-"
SPLITS = ("train", "validation")
SHARD_NAME = re.compile(r"^(train|validation)-(\d{5})-of-(\d{5})\.(arrow|parquet)\Z")
"""Names of the shards packstream writes; nothing else in a folder is ever opened as a shard."""
REJECTED = "rejected.jsonl"
CARD = "README.md"
RUN_FILES = (REJECTED, CARD)
"""Besides shards: the files a run writes and lists in ``files`` (``manifest.json`` itself is not listed)."""
DATASETS_CACHE = re.compile(r"^cache-[0-9a-f]{16}(_\d{5}_of_\d{5})?\.arrow\Z")
"""What ``datasets`` writes beside a file it maps (``ds.rows.map(...)``, ``select``, ...): ``cache-`` + its
16-hex-digit fingerprint (+ ``_XXXXX_of_NNNNN`` with ``num_proc``), see ``Dataset._get_cache_file_path``.
Readers tolerate these next to the shards (``datasets`` itself treats them as its own:
``Dataset.cleanup_cache_files``); any other unlisted ``*.arrow`` is refused by name."""
RUN_ID = re.compile(r"^[0-9a-f]{16}\Z")
MAX_MANIFEST_BYTES = 64 * MiB
"""The largest manifest.json a reader opens. A run of 10,000 input files and 10,000 shards writes about
5 MiB (each input and shard is one short entry); a bigger file is not one packstream wrote."""
MAX_DEAD_LETTER_BYTES = 64 * MiB
"""The longest line of rejected.jsonl a reader accepts: a dead letter holds its record's id and a
one-line detail, and a record is at most ``--max-record-bytes`` (16 MiB by default)."""
_MAX_COUNT = 2**63 - 1
RESTORE = "restore the folder or re-run packstream pack"  # the fix of every refusal of a damaged or edited folder
_FIX = f"the manifest was edited or damaged, or not written by packstream: {RESTORE}"


SOURCE_ESCAPES = str.maketrans({"%": "%25", ":": "%3A", "@": "%40", "#": "%23", "~": "%7E"})
"""How an input's ``source`` (manifest ``inputs[].source``) is escaped at the start of its example ids
(``gsm8k/train.jsonl@7``, ``oasst.jsonl:a1b2``): the escaped source holds no ``:`` or ``@``, so an id's source
is everything before the first of them (:func:`id_source`)."""


def escape_source(source: str) -> str:
    """The prefix an input's examples carry in their ids."""
    return source.translate(SOURCE_ESCAPES)


def id_source(example_id: str) -> str:
    """The escaped source at the start of an example id.

    >>> id_source("gsm8k/train.jsonl@7"), id_source("mix%3Av2.jsonl:q17~2#1")
    ('gsm8k/train.jsonl', 'mix%3Av2.jsonl')
    """
    return example_id[: next((i for i, c in enumerate(example_id) if c in ":@"), len(example_id))]


class Status(str, enum.Enum):
    COMPLETE = "complete"
    FAILED = "failed"


def shard_name(split: str, index: int, count: int, ext: str) -> str:
    """``train-00003-of-00008.arrow``: the one place shard names are made."""
    return f"{split}-{index:05d}-of-{count:05d}.{ext}"


def shard_place(name: str) -> Optional[tuple[str, int, int, str]]:
    """``(split, index, count, ext)`` of a shard name packstream writes, else None.

    >>> shard_place("validation-00002-of-00003.arrow")
    ('validation', 2, 3, 'arrow')
    """
    m = SHARD_NAME.match(name)
    return (m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)) if m else None


def looks_like_shard(name: str) -> bool:
    """A file a reader could mistake for a shard: any ``*.arrow`` or ``*.parquet``."""
    return name.endswith((".arrow", ".parquet"))


# -- the typed manifest ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowChecks:
    """``manifest.json``'s ``row_checks``: what every row of the run satisfies (see the module docstring)."""

    budget: int
    eos_token_id: Optional[int]
    eos_at_boundaries: bool
    targets_in_every_sequence: bool
    all_targets: bool
    pairs: bool = False


@dataclass(frozen=True)
class ShardEntry:
    """One entry of ``shards``; ``split``, ``index`` and ``count`` agree with ``name`` (checked)."""

    name: str
    split: str
    index: int
    count: int
    rows: int
    examples: int
    tokens: int
    target_tokens: int
    bytes: int
    sha256: str

    @property
    def ext(self) -> str:
        return self.name.rsplit(".", 1)[1]


@dataclass(frozen=True)
class Tokenizer:
    name: str
    vocab_sha256: str
    eos_token_id: Optional[int]
    pad_token_id: Optional[int]


@dataclass(frozen=True)
class SplitCounts:
    rows: int
    tokens: int


@dataclass(frozen=True)
class FirstRejected:
    source: str
    position: int
    detail: str


COUNT_KEYS = ("records_read", "not_sampled", "repeated_copies", "extra_paths", "examples_packed", "rejected", "dropped_too_long",
              "truncated_examples", "split_examples", "no_target_pieces", "pieces", "rows", "tokens",
              "target_tokens", "lower_bound")
"""The integer counts readers use (``counts`` holds a few more, for people)."""
CUT_KEYS = ("truncated", "pieces", "carried")  # counts.cut_sequences (version 9): see pipeline._tools.verify._folder


@dataclass(frozen=True)
class Counts:
    """``manifest.json``'s ``counts`` (see docs/operations.md); every integer is >= 0."""

    records_read: int
    not_sampled: int
    repeated_copies: int
    extra_paths: int
    """Examples beyond a record's first (``--tree-paths all``: every root-to-leaf path of a message tree)."""
    examples_packed: int
    rejected: int
    dropped_too_long: int
    truncated_examples: int
    split_examples: int
    no_target_pieces: int
    pieces: int
    rows: int
    tokens: int
    target_tokens: int
    lower_bound: int
    fill: float
    rejected_by_reason: Mapping[str, int]
    first_rejected: Mapping[str, FirstRejected]
    splits: Mapping[str, SplitCounts]
    cut_sequences: Optional[Mapping[str, int]] = None  # CUT_KEYS: the sequences cut marks call so; None in version 6


@dataclass(frozen=True)
class InputEntry:
    path: str
    source: str


@dataclass(frozen=True)
class Manifest:
    """A checked ``manifest.json``. A failed run's has ``status``, ``error`` and ``files``; the rest is
    empty or None there (readers call :func:`require_complete` first)."""

    status: Status
    error: Optional[str]
    files: tuple[str, ...]
    run_id: Optional[str] = None
    shards: tuple[ShardEntry, ...] = ()
    row_checks: Optional[RowChecks] = None
    tokenizer: Optional[Tokenizer] = None
    counts: Optional[Counts] = None
    config: Mapping[str, Any] = None  # type: ignore[assignment]
    """The run's options as ``PackOptions.to_dict()`` wrote them (``max_tokens`` checked; the rest is
    read back by ``packstream verify --inputs`` through the options' own validation)."""
    inputs: tuple[InputEntry, ...] = ()
    rejected_file: str = REJECTED
    raw: Mapping[str, Any] = None  # type: ignore[assignment]
    """The whole decoded JSON, for display."""

    @property
    def complete(self) -> bool:
        return self.status is Status.COMPLETE

    def listed(self, split: Optional[str] = None) -> list[ShardEntry]:
        """The shard entries (of ``split`` when given), in name order."""
        return sorted((s for s in self.shards if split is None or s.split == split), key=lambda s: s.name)

    def unlisted(self, names: Iterable[str]) -> list[str]:
        """Shard-like files (``*.arrow``/``*.parquet``) in a folder listing that the manifest does not list."""
        listed = {s.name for s in self.shards}
        return sorted(n for n in names if looks_like_shard(n) and n not in listed)


class _Reader:
    """Typed access to the decoded JSON: each getter checks one key and names it in the refusal."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, key: str, value: Any, expected: str) -> ContractError:
        shown = "missing" if value is _MISSING else _short(value)
        return ContractError(f"{self.where}: {MANIFEST} {key} is {shown}, expected {expected}; {_FIX}")

    def obj(self, d: Mapping, key: str, at: str) -> dict:
        v = d.get(key, _MISSING)
        if not isinstance(v, dict):
            raise self.fail(at, v, "an object")
        return v

    def lst(self, d: Mapping, key: str, at: str) -> list:
        v = d.get(key, _MISSING)
        if not isinstance(v, list):
            raise self.fail(at, v, "a list")
        return v

    def count(self, d: Mapping, key: str, at: str, low: int = 0) -> int:
        v = d.get(key, _MISSING)
        if not is_int(v) or not low <= v <= _MAX_COUNT:
            raise self.fail(at, v, f"an integer >= {low}")
        return v

    def opt_id(self, d: Mapping, key: str, at: str) -> Optional[int]:
        v = d.get(key)
        if v is not None and (not is_int(v) or not 0 <= v <= _MAX_COUNT):
            raise self.fail(at, v, "an integer >= 0 or null")
        return v

    def text(self, d: Mapping, key: str, at: str, pattern: Optional[re.Pattern] = None, what: str = "a string",
             empty: bool = False) -> str:
        v = d.get(key, _MISSING)
        if not isinstance(v, str) or (pattern is not None and not pattern.match(v)) or (pattern is None and not (v or empty)):
            raise self.fail(at, v, what)
        return v

    def flag(self, d: Mapping, key: str, at: str) -> bool:
        v = d.get(key, _MISSING)
        if not isinstance(v, bool):
            raise self.fail(at, v, "true or false")
        return v

    def number(self, d: Mapping, key: str, at: str) -> float:
        v = d.get(key, _MISSING)
        if not is_weight(v):
            raise self.fail(at, v, "a finite number >= 0")
        return float(v)


_MISSING = object()
_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")


def _short(value: Any, limit: int = 80) -> str:
    """A manifest value in a message: a JSON object or list by its size (it can be megabytes long), else
    :func:`packers.errors.short`."""
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'list'} ({len(value)} entries)"
    return short(value, limit)


def _cut(text: str, limit: int = 500) -> str:
    """Free text (a failed run's error) on one line, at most ``limit`` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Decode and check ``manifest.json``'s bytes (see the module docstring); one ContractError line names
    the first key that is missing, of the wrong type or out of range, or where the manifest contradicts
    itself. Does not require ``status == complete``: see :func:`require_complete`."""
    m = _decode(data, where)
    problems = inconsistencies(m)
    if problems:
        key, what = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ContractError(f"{where}: {MANIFEST} {key} {what}{more}; {_FIX}")
    return m


def load_manifest(path: str, where: str, *, opener: Optional[Callable[[str], IO[bytes]]] = None,
                  consistent: bool = True, files_only: bool = False) -> Manifest:
    """``manifest.json`` at ``path`` (local, or remote through ``opener``), read through the checked open
    and parsed. ``consistent=False``: only its types and ranges are checked (``packstream verify`` reports
    every :func:`inconsistencies` itself). ``files_only``: only ``status``, ``error`` and ``files``, all
    that ``pack --overwrite`` needs to know which files a run wrote (so it can replace the output of an
    older packstream too): names a run writes, never a path or another file."""
    data = read_checked(path, what=MANIFEST, limit=MAX_MANIFEST_BYTES, opener=opener,
                        fix=f"this is not a {MANIFEST} packstream wrote: {RESTORE}")
    if files_only:
        return _decode(data, where, files_only=True)
    return parse_manifest(data, where) if consistent else _decode(data, where)


def _decode(data: bytes, where: str, files_only: bool = False) -> Manifest:
    try:
        raw = load_json(data, what=f"{show_path(where)}: {MANIFEST}")
    except PackstreamError as e:
        raise ContractError(f"{e}; the folder is damaged: restore it or re-run packstream pack") from None
    r = _Reader(show_path(where))
    if not isinstance(raw, dict):
        raise ContractError(f"{r.where}: {MANIFEST} holds {_short(raw) if isinstance(raw, (dict, list)) else 'a JSON ' + type(raw).__name__}, "
                            f"expected an object; {_FIX}")
    status = raw.get("status", _MISSING)
    if not isinstance(status, str) or status not in {s.value for s in Status}:
        raise ContractError(
            f"{r.where}: {MANIFEST} has status {'missing' if status is _MISSING else _short(status)}, expected "
            "'complete'; it was not written by a finished packstream run (or by a packstream older than the run "
            "lock): re-run packstream pack"
        )
    files = r.lst(raw, "files", "files") if "files" in raw or status == Status.COMPLETE.value else []
    for i, f in enumerate(files):
        # --overwrite removes exactly these: only names a run writes, never a path or a user's file.
        if not isinstance(f, str) or not (SHARD_NAME.match(f) or f in RUN_FILES):
            raise r.fail(f"files[{i}]", f, f"a file name packstream writes (a shard name, {' or '.join(RUN_FILES)})")
    if status == Status.FAILED.value:
        error = raw.get("error")
        error = error if isinstance(error, str) else None if error is None else _short(error)
        return Manifest(status=Status.FAILED, error=error or None, files=tuple(files), raw=raw)
    if files_only:
        return Manifest(status=Status.COMPLETE, error=None, files=tuple(files), raw=raw)
    _check_version_and_run_id(r, raw)
    # In the order of the keys' checks, so that the first broken key is the one named.
    shards = _decode_shards(r, raw)
    checks = _decode_row_checks(r, raw)
    tokenizer = _decode_tokenizer(r, raw)
    config = _decode_config(r, raw)
    counts = _decode_counts(r, raw)
    inputs = _decode_inputs(r, raw)
    rejected_file = raw.get("rejected_file", _MISSING)
    if rejected_file != REJECTED:
        raise ContractError(f"{r.where}: {MANIFEST} rejected_file is "
                            f"{'missing' if rejected_file is _MISSING else _short(rejected_file)}, not a plain file "
                            f"name packstream writes ({REJECTED!r}); not opened. {_FIX[0].upper()}{_FIX[1:]}")
    return Manifest(status=Status.COMPLETE, error=None, files=tuple(files), run_id=raw["run_id"], shards=shards,
                    row_checks=checks, tokenizer=tokenizer, counts=counts, config=config, inputs=inputs,
                    rejected_file=rejected_file, raw=raw)


def _check_version_and_run_id(r: _Reader, raw: Mapping[str, Any]) -> None:
    version = raw.get("contract_version", _MISSING)
    if (old := mask_rule_refusal(MANIFEST, version)) is not None:
        raise ContractError(f"{r.where}: {old}")
    if not is_int(version) or version not in READABLE_VERSIONS:
        raise ContractError(f"{r.where}: {MANIFEST} contract_version is {'missing' if version is _MISSING else _short(version)}"
                            f", expected one of {READABLE_VERSIONS}; repack the data or install a matching packstream")
    run_id = raw.get("run_id", _MISSING)
    if not isinstance(run_id, str) or not RUN_ID.match(run_id):
        raise ContractError(
            f"{r.where}: {MANIFEST} run_id is {'missing' if run_id is _MISSING else _short(run_id)}, expected 16 "
            "hex digits; it was written by a packstream older than the shard cross-check, or edited: re-run "
            "packstream pack"
        )


def _decode_shards(r: _Reader, raw: Mapping[str, Any]) -> tuple[ShardEntry, ...]:
    shards = []
    for i, s in enumerate(r.lst(raw, "shards", "shards")):
        at = f"shards[{i}]"
        if not isinstance(s, dict):
            raise r.fail(at, s, "an object")
        name = s.get("name", _MISSING)
        place = shard_place(name) if isinstance(name, str) else None
        if place is None:
            raise ContractError(
                f"{r.where}: {MANIFEST} {at}.name is {'missing' if name is _MISSING else _short(name)}, not a shard "
                "name packstream writes (train|validation-XXXXX-of-NNNNN.arrow|parquet); refusing to open it"
            )
        split = s.get("split", _MISSING)
        if split not in SPLITS:
            raise r.fail(f"{at}.split", split, f"one of {SPLITS}")
        shards.append(ShardEntry(
            name=name, split=split, index=place[1], count=place[2],
            **{k: r.count(s, k, f"{at}.{k}") for k in ("rows", "examples", "tokens", "target_tokens", "bytes")},
            sha256=r.text(s, "sha256", f"{at}.sha256", _SHA256, "64 hex digits"),
        ))
    return tuple(shards)


def _decode_row_checks(r: _Reader, raw: Mapping[str, Any]) -> RowChecks:
    rc = raw.get("row_checks", _MISSING)
    if not isinstance(rc, dict):
        raise ContractError(
            f"{r.where}: {MANIFEST} has no 'row_checks' object (got {_short(rc) if rc is not _MISSING else 'none'}); "
            "it was written by a packstream older than the output-folder contract: re-run packstream pack"
        )
    return RowChecks(budget=r.count(rc, "budget", "row_checks.budget", low=1),
                     eos_token_id=r.opt_id(rc, "eos_token_id", "row_checks.eos_token_id"),
                     **{k: r.flag(rc, k, f"row_checks.{k}")
                        for k in ("eos_at_boundaries", "targets_in_every_sequence", "all_targets", "pairs")})


def _decode_tokenizer(r: _Reader, raw: Mapping[str, Any]) -> Tokenizer:
    tok = r.obj(raw, "tokenizer", "tokenizer")
    return Tokenizer(name=r.text(tok, "name", "tokenizer.name"),
                     vocab_sha256=r.text(tok, "vocab_sha256", "tokenizer.vocab_sha256"),
                     eos_token_id=r.opt_id(tok, "eos_token_id", "tokenizer.eos_token_id"),
                     pad_token_id=r.opt_id(tok, "pad_token_id", "tokenizer.pad_token_id"))


def _decode_config(r: _Reader, raw: Mapping[str, Any]) -> dict:
    config = r.obj(raw, "config", "config")
    if "max_tokens" in config:
        r.count(config, "max_tokens", "config.max_tokens", low=1)
    return config


def _decode_counts(r: _Reader, raw: Mapping[str, Any]) -> Counts:
    c = r.obj(raw, "counts", "counts")
    by_reason = r.obj(c, "rejected_by_reason", "counts.rejected_by_reason")
    first = r.obj(c, "first_rejected", "counts.first_rejected")
    splits = r.obj(c, "splits", "counts.splits")
    for sp, v in splits.items():
        if sp not in SPLITS or not isinstance(v, dict):
            raise r.fail(f"counts.splits.{_short(sp, 40)}", v, f"an object under one of {SPLITS}")
    for reason, v in first.items():
        if not isinstance(v, dict):
            raise r.fail(f"counts.first_rejected.{_short(reason, 40)}", v, "an object")
    return Counts(
        **{k: r.count(c, k, f"counts.{k}") for k in COUNT_KEYS},
        fill=r.number(c, "fill", "counts.fill"),
        rejected_by_reason={k: r.count(by_reason, k, f"counts.rejected_by_reason.{_short(k, 40)}") for k in by_reason},
        first_rejected={k: FirstRejected(source=r.text(v, "source", f"counts.first_rejected.{_short(k, 40)}.source"),
                                         position=r.count(v, "position", f"counts.first_rejected.{_short(k, 40)}.position"),
                                         detail=r.text(v, "detail", f"counts.first_rejected.{_short(k, 40)}.detail", empty=True))
                        for k, v in first.items()},
        splits={sp: SplitCounts(rows=r.count(v, "rows", f"counts.splits.{sp}.rows"),
                                tokens=r.count(v, "tokens", f"counts.splits.{sp}.tokens")) for sp, v in splits.items()},
        cut_sequences={k: r.count(r.obj(c, "cut_sequences", "counts.cut_sequences"), k, f"counts.cut_sequences.{k}")
                       for k in CUT_KEYS} if "cut_sequences" in c else None,
    )


def _decode_inputs(r: _Reader, raw: Mapping[str, Any]) -> tuple[InputEntry, ...]:
    inputs = []
    for i, e in enumerate(r.lst(raw, "inputs", "inputs")):
        if not isinstance(e, dict):
            raise r.fail(f"inputs[{i}]", e, "an object")
        inputs.append(InputEntry(path=r.text(e, "path", f"inputs[{i}].path"),
                                 source=r.text(e, "source", f"inputs[{i}].source")))
    return tuple(inputs)


def inconsistencies(m: Manifest) -> list[tuple[str, str]]:
    """Where the complete manifest ``m`` contradicts itself, as ``(key, what)`` pairs, most basic first
    (a failed run's manifest has nothing to reconcile: ``[]``). Holds by construction for what
    :mod:`pipeline._job` writes; an edit that breaks one of these breaks what readers rely on."""
    if not m.complete:
        return []
    return [*_shard_problems(m), *_file_problems(m), *_check_problems(m), *_count_problems(m)]


def _shard_problems(m: Manifest) -> list[tuple[str, str]]:
    """Shard entries: listed once, split labels as their names say, each split's ``-of-N`` shards indexed 0..N-1
    once each, one format, counts that a row can hold."""
    out: list[tuple[str, str]] = []
    names = [s.name for s in m.shards]
    for n in sorted({n for n in names if names.count(n) > 1}):
        out.append((f"shards ({n})", f"lists {n} {names.count(n)} times; each shard is listed once"))
    for s in m.shards:
        if shard_place(s.name)[0] != s.split:
            out.append((f"shards ({s.name})", f"has split {s.split!r}, but its name says {shard_place(s.name)[0]!r}"))
    for split in SPLITS:
        mine = [s for s in m.shards if s.split == split]
        if not mine:
            continue
        totals = sorted({s.count for s in mine})
        indexes = sorted(s.index for s in mine)
        if len(totals) > 1:
            out.append((f"shards ({split})", f"shards of different runs mixed: -of- counts {totals}"))
        elif indexes != list(range(totals[0])):
            missing = sorted(set(range(totals[0])) - set(indexes))
            shown = str(indexes) if len(indexes) <= 20 else f"{indexes[:20]} ..."[:-5] + ", ...]"
            out.append((f"shards ({split})", f"indices {shown}, expected 0..{totals[0] - 1} once each"
                                              + (f" (index {missing[0]} is not listed)" if missing else "")))
    exts = sorted({s.ext for s in m.shards})
    if len(exts) > 1:
        out.append(("shards", f"mix formats {exts}; a run writes one --output-format"))
    budget = m.row_checks.budget
    for s in m.shards:
        if s.examples < s.rows or s.tokens < s.examples or s.tokens > s.rows * budget or s.target_tokens > s.tokens:
            out.append((f"shards ({s.name})", f"rows {s.rows}, examples {s.examples}, tokens {s.tokens}, target_tokens "
                                              f"{s.target_tokens} cannot be (every row holds 1+ examples of 1+ tokens, at "
                                              f"most {budget} per row)"))
    return out


def _file_problems(m: Manifest) -> list[tuple[str, str]]:
    """``files``: each name once, every listed shard, no shard that ``shards`` does not list, the dead letters."""
    out: list[tuple[str, str]] = []
    files = list(m.files)
    for f in sorted({f for f in files if files.count(f) > 1}):
        out.append(("files", f"lists {f} {files.count(f)} times"))
    listed = {s.name for s in m.shards}
    for n in sorted(listed - set(files)):
        out.append(("files", f"does not list the shard {n}"))
    for f in sorted(f for f in set(files) if SHARD_NAME.match(f) and f not in listed):
        out.append(("files", f"lists {f}, which is not in shards"))
    if m.rejected_file not in files:
        out.append(("files", f"does not list {m.rejected_file}"))
    return out


def _check_problems(m: Manifest) -> list[tuple[str, str]]:
    """``row_checks`` against the config and the tokenizer."""
    out: list[tuple[str, str]] = []
    rc, budget = m.row_checks, m.row_checks.budget
    if m.config.get("max_tokens", budget) != budget:
        out.append(("row_checks.budget", f"is {budget} but config.max_tokens is {m.config['max_tokens']}"))
    if rc.eos_at_boundaries and rc.eos_token_id is None:
        out.append(("row_checks.eos_at_boundaries", "is true but row_checks.eos_token_id is null"))
    if rc.pairs != bool(m.config.get("pairs", rc.pairs)):
        out.append(("row_checks.pairs", f"is {str(rc.pairs).lower()} but config.pairs is "
                                        f"{str(bool(m.config.get('pairs'))).lower()}"))
    if rc.pairs and (rc.all_targets or any(s.examples % 2 for s in m.shards)):
        out.append(("row_checks.pairs", "is true, but a run of pairs trains no prompt token (all_targets) and holds "
                                        "two sequences per pair in every shard"))
    if m.tokenizer.eos_token_id != rc.eos_token_id:
        out.append(("row_checks.eos_token_id", f"is {rc.eos_token_id!r} but tokenizer.eos_token_id is "
                                               f"{m.tokenizer.eos_token_id!r}"))
    return out


def _count_problems(m: Manifest) -> list[tuple[str, str]]:
    """``counts``: the sums of the shard entries, per split too; records in = records out; the lower bound and
    the fill the tokens imply."""
    out: list[tuple[str, str]] = []
    c, budget = m.counts, m.row_checks.budget
    for key, attr in (("rows", "rows"), ("tokens", "tokens"), ("target_tokens", "target_tokens"), ("pieces", "examples")):
        got = sum(getattr(s, attr) for s in m.shards)
        if getattr(c, key) != got:
            out.append((f"counts.{key}", f"says {getattr(c, key)}, the shards it lists hold {got}"))
    splits = {sp: SplitCounts(rows=sum(s.rows for s in m.shards if s.split == sp),
                              tokens=sum(s.tokens for s in m.shards if s.split == sp))
              for sp in sorted({s.split for s in m.shards})}
    if dict(c.splits) != splits:
        out.append(("counts.splits", f"says {_short({k: (v.rows, v.tokens) for k, v in c.splits.items()}, 200)} "
                                     f"(rows, tokens), the shards it lists hold "
                                     f"{_short({k: (v.rows, v.tokens) for k, v in splits.items()}, 200)}"))
    given = c.records_read + c.repeated_copies + c.extra_paths
    accounted = c.examples_packed + c.rejected + c.dropped_too_long + c.not_sampled
    if given != accounted:
        out.append(("counts", f"do not reconcile: records_read {c.records_read} + repeated_copies {c.repeated_copies} + "
                              f"extra_paths {c.extra_paths} = "
                              f"{given}, but examples_packed {c.examples_packed} + rejected {c.rejected} + "
                              f"dropped_too_long {c.dropped_too_long} + not_sampled {c.not_sampled} = {accounted}"))
    if "too_long" in c.rejected_by_reason:
        out.append(("counts.rejected_by_reason", "holds too_long; examples dropped for length are dropped_too_long"))
    if sum(c.rejected_by_reason.values()) != c.rejected:
        out.append(("counts.rejected", f"says {c.rejected}, counts.rejected_by_reason adds up to "
                                       f"{sum(c.rejected_by_reason.values())}"))
    lower = math.ceil(c.tokens / budget) if c.tokens else 0
    if c.lower_bound != lower:
        out.append(("counts.lower_bound", f"says {c.lower_bound}, ceil(tokens / budget) is {lower}"))
    fill = c.tokens / (c.rows * budget) if c.rows else 0.0
    if not math.isclose(c.fill, fill, rel_tol=1e-9, abs_tol=1e-12):
        out.append(("counts.fill", f"says {c.fill!r}, tokens / (rows * budget) is {fill!r}"))
    return out


def require_complete(m: Manifest, where: str) -> Manifest:
    """``m`` if it marks a finished run, else a ContractError saying why the folder cannot be read."""
    if not m.complete:
        raise ContractError(
            f"{where}: the packstream run that wrote this folder failed ({_cut(m.error or 'no reason recorded')}); "
            "its files are not a complete output. Fix the cause and re-run packstream pack --overwrite"
        )
    return m


def missing_manifest(where: str, names: Iterable[str]) -> ContractError:
    """The error for a folder without manifest.json: a run in progress, a killed run, or not packstream's."""
    names = set(names)
    if LOCK in names:
        return ContractError(
            f"{where}: no manifest.json, and {LOCK} is present: a packstream run is still writing this folder, or "
            "was killed before it finished. Wait for it, or re-run packstream pack --overwrite"
        )
    if any(looks_like_shard(n) for n in names):
        return ContractError(
            f"{where}: shard files but no manifest.json: not a finished packstream output (an interrupted run, or "
            "a partial copy). Re-run packstream pack, or copy the whole folder including manifest.json"
        )
    return ContractError(f"{where}: no manifest.json; point at the --output folder of a finished packstream pack")


def is_datasets_cache(name: str) -> bool:
    """``name`` is exactly a cache file ``datasets`` writes beside the shards (see :data:`DATASETS_CACHE`)."""
    return bool(DATASETS_CACHE.match(name))


def expected_metadata(m: Manifest, entry: ShardEntry) -> dict[str, Any]:
    """The schema metadata (:func:`packers.read_metadata`'s keys) the shard ``entry`` of the complete manifest
    ``m`` must carry: contract version, budget, tokenizer name and vocabulary hash, eos/pad ids (the same on
    every shard of the run), its place (run id, split, index, the split's shard count), and any vision spec."""
    version = m.raw.get("contract_version", CONTRACT_VERSION)
    return {
        "contract_version": version,
        **({"vision": m.raw.get("vision")} if not is_text(version) else {}),
        "budget": m.row_checks.budget, "tokenizer": m.tokenizer.name,
        "tokenizer_vocab_sha256": m.tokenizer.vocab_sha256, "eos_token_id": m.tokenizer.eos_token_id,
        "pad_token_id": m.tokenizer.pad_token_id, "run_id": m.run_id,
        "split": entry.split, "shard_index": entry.index, "shard_count": entry.count,
    }


def metadata_mismatch(meta: Mapping[str, Any], m: Manifest, entry: ShardEntry) -> Optional[tuple[str, str]]:
    """The first key of a shard's schema metadata ``meta`` that differs from what its manifest entry implies, as
    ``(key, "is X, manifest.json says Y")``; None when all agree. A shard listed twice (its copy under
    another name), moved to another split, or taken from another run fails here."""
    for key, want in expected_metadata(m, entry).items():
        got = meta.get(key, _MISSING)
        if got != want or type(got) is not type(want):
            shown = "missing" if got is _MISSING else _short(got)
            return key, f"is {shown}, {MANIFEST} says {want!r}"
    return None
