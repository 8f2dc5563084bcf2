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

The manifest's keys that readers rely on (the writer, :mod:`pipeline._write`, fills them)::

    status           "complete" | "failed"
    error            why a failed run failed (failed only)
    contract_version the packed-row contract version (packers.CONTRACT_VERSION)
    shards           [{"name", "split", "rows", "examples", "tokens", "target_tokens", "bytes", "sha256"}]
    files            every file name the run wrote (shards, rejected.jsonl, README.md); --overwrite
                     removes exactly these (plus packstream's .tmp-* names and a broken lock)
    row_checks       what every row of the run satisfies, so a reader can check rows as it reads:
                     {"budget": int, "eos_token_id": int | null,
                      "eos_at_boundaries": bool,          every sequence shorter than the budget ends
                                                          with eos_token_id (a full-budget sequence is a
                                                          piece of a truncated or split example)
                      "targets_in_every_sequence": bool,  every sequence has a loss_mask 1
                      "all_targets": bool}                every token is a target (--train-on all)
    tokenizer        {"name", "vocab_sha256", "eos_token_id", "pad_token_id", ...}
    config, counts, inputs   the run's options and counts (see docs/operations.md)
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from packers._errors import ContractError
from packers._schema import CONTRACT_VERSION

MANIFEST = "manifest.json"
LOCK = ".packstream.lock"
TMP_PREFIX = ".tmp-"
SPLITS = ("train", "validation")
SHARD_NAME = re.compile(r"^(train|validation)-(\d{5})-of-(\d{5})\.(arrow|parquet)$")
"""Names of the shards packstream writes; nothing else in a folder is ever opened as a shard."""
DATASETS_CACHE = re.compile(r"^cache-[0-9a-f]{16}(_\d{5}_of_\d{5})?\.arrow$")
"""What ``datasets`` writes beside a file it maps (``ds.rows.map(...)``, ``select``, ...): ``cache-`` + its
16-hex-digit fingerprint (+ ``_XXXXX_of_NNNNN`` with ``num_proc``), see ``Dataset._get_cache_file_path``.
Readers tolerate these next to the shards (``datasets`` itself treats them as its own:
``Dataset.cleanup_cache_files``); any other unlisted ``*.arrow`` is refused by name."""


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


def looks_like_shard(name: str) -> bool:
    """A file a reader could mistake for a shard: any ``*.arrow`` or ``*.parquet``."""
    return name.endswith((".arrow", ".parquet"))


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    """Decode ``manifest.json`` and check its structure; ContractError names what is wrong.

    Does not require ``status == complete``: see :func:`require_complete`.
    """
    try:
        m = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ContractError(f"{where}: manifest.json is not valid JSON ({e}); the folder is damaged, re-run pack") from None
    if not isinstance(m, dict):
        raise ContractError(f"{where}: manifest.json holds a JSON {type(m).__name__}, expected an object")
    status = m.get("status")
    if status not in {s.value for s in Status}:
        raise ContractError(
            f"{where}: manifest.json has status {status!r}, expected 'complete'; it was not written by a finished "
            "packstream run (or by a packstream older than the run lock): re-run packstream pack"
        )
    if status == Status.FAILED.value:
        return m
    shards = m.get("shards")
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise ContractError(f"{where}: manifest.json 'shards' must be a list of objects")
    for i, s in enumerate(shards):
        name = s.get("name")
        if not isinstance(name, str) or not SHARD_NAME.match(name):
            raise ContractError(
                f"{where}: manifest.json shards[{i}].name is {name!r}, not a shard name packstream writes "
                "(train|validation-XXXXX-of-NNNNN.arrow|parquet); refusing to open it"
            )
        if s.get("split", "train") not in SPLITS:
            raise ContractError(f"{where}: manifest.json shards[{i}].split is {s.get('split')!r}, expected one of {SPLITS}")
        for key in ("rows", "bytes"):
            if not isinstance(s.get(key), int) or isinstance(s.get(key), bool) or s[key] < 0:
                raise ContractError(f"{where}: manifest.json shards[{i}].{key} is {s.get(key)!r}, expected an integer >= 0")
        sha = s.get("sha256")
        if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise ContractError(f"{where}: manifest.json shards[{i}].sha256 is {sha!r}, expected 64 hex digits")
    files = m.get("files", [])
    if not isinstance(files, list) or not all(isinstance(f, str) and f and "/" not in f and f not in (".", "..") for f in files):
        raise ContractError(f"{where}: manifest.json 'files' must be a list of plain file names")
    return m


def require_complete(m: dict[str, Any], where: str) -> dict[str, Any]:
    """``m`` if it marks a finished run, else a ContractError saying why the folder cannot be read."""
    if m.get("status") != Status.COMPLETE.value:
        why = m.get("error") or "no reason recorded"
        raise ContractError(
            f"{where}: the packstream run that wrote this folder failed ({why}); its files are not a complete "
            "output. Fix the cause and re-run packstream pack --overwrite"
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


def listed_shards(m: dict[str, Any], split: Optional[str] = None) -> list[dict[str, Any]]:
    """The manifest's shard entries (of ``split`` when given), in name order."""
    out = [s for s in m.get("shards", []) if split is None or s.get("split", "train") == split]
    return sorted(out, key=lambda s: s["name"])


def unlisted(names: Iterable[str], m: dict[str, Any]) -> list[str]:
    """Shard-like files (``*.arrow``/``*.parquet``) in a folder listing that the manifest does not list."""
    listed = {s["name"] for s in m.get("shards", [])}
    return sorted(n for n in names if looks_like_shard(n) and n not in listed)


def is_datasets_cache(name: str) -> bool:
    """``name`` is exactly a cache file ``datasets`` writes beside the shards (see :data:`DATASETS_CACHE`)."""
    return bool(DATASETS_CACHE.match(name))


@dataclass(frozen=True)
class RowChecks:
    """``manifest.json``'s ``row_checks``: what every row of the run satisfies (see the module docstring)."""

    budget: int
    eos_token_id: Optional[int]
    eos_at_boundaries: bool
    targets_in_every_sequence: bool
    all_targets: bool


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def row_checks(m: dict[str, Any], where: str) -> RowChecks:
    """The complete manifest ``m``'s ``row_checks``, checked; ContractError names a missing or ill-typed key."""
    rc = m.get("row_checks")
    if not isinstance(rc, dict):
        raise ContractError(
            f"{where}: manifest.json has no 'row_checks' object (got {type(rc).__name__}); it was written by a "
            "packstream older than the output-folder contract: re-run packstream pack"
        )
    budget, eos = rc.get("budget"), rc.get("eos_token_id")
    if not _is_int(budget) or budget < 1:
        raise ContractError(f"{where}: manifest.json row_checks.budget is {budget!r}, expected an integer >= 1")
    if eos is not None and (not _is_int(eos) or eos < 0):
        raise ContractError(f"{where}: manifest.json row_checks.eos_token_id is {eos!r}, expected an integer >= 0 or null")
    flags = {}
    for key in ("eos_at_boundaries", "targets_in_every_sequence", "all_targets"):
        if not isinstance(rc.get(key), bool):
            raise ContractError(f"{where}: manifest.json row_checks.{key} is {rc.get(key)!r}, expected true or false")
        flags[key] = rc[key]
    if flags["eos_at_boundaries"] and eos is None:
        raise ContractError(f"{where}: manifest.json row_checks.eos_at_boundaries is true but eos_token_id is null")
    max_tokens = (m.get("config") or {}).get("max_tokens") if isinstance(m.get("config"), dict) else None
    if max_tokens is not None and max_tokens != budget:
        raise ContractError(
            f"{where}: manifest.json row_checks.budget is {budget} but config.max_tokens is {max_tokens!r}; "
            "the manifest contradicts itself: re-run packstream pack"
        )
    return RowChecks(budget=budget, eos_token_id=eos, **flags)


def expected_metadata(m: dict[str, Any], where: str) -> dict[str, Any]:
    """The schema metadata (:func:`packers.read_metadata`'s keys) every shard of the complete manifest ``m``
    must carry: contract version, budget, tokenizer name and vocabulary hash, eos/pad ids."""
    if m.get("contract_version") != CONTRACT_VERSION:
        raise ContractError(
            f"{where}: manifest.json contract_version is {m.get('contract_version')!r}, this packstream reads "
            f"version {CONTRACT_VERSION}; repack the data or install a matching packstream"
        )
    tok = m.get("tokenizer")
    if not isinstance(tok, dict):
        raise ContractError(f"{where}: manifest.json has no 'tokenizer' object; re-run packstream pack")
    if not isinstance(tok.get("vocab_sha256"), str) or not isinstance(tok.get("name"), str):
        raise ContractError(
            f"{where}: manifest.json tokenizer.name / tokenizer.vocab_sha256 are {tok.get('name')!r} / "
            f"{tok.get('vocab_sha256')!r}, expected strings"
        )
    for key in ("eos_token_id", "pad_token_id"):
        if tok.get(key) is not None and not _is_int(tok.get(key)):
            raise ContractError(f"{where}: manifest.json tokenizer.{key} is {tok.get(key)!r}, expected an integer or null")
    return {
        "contract_version": CONTRACT_VERSION,
        "budget": row_checks(m, where).budget,
        "tokenizer": tok["name"],
        "tokenizer_vocab_sha256": tok["vocab_sha256"],
        "eos_token_id": tok.get("eos_token_id"),
        "pad_token_id": tok.get("pad_token_id"),
    }
