"""The folder: its manifest, which files it holds, its dead letters, and the manifest's counts against them."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from packers import PackstreamError
from packers import CONTRACT_VERSION
from packers.files import load_json, show_path
from packers.manifest import (
    LOCK, MANIFEST, MAX_DEAD_LETTER_BYTES, TMP_PREFIX, Manifest, ShardEntry, inconsistencies, is_datasets_cache,
    missing_manifest, require_complete,
)
import pipeline._rows as _rows
import pipeline._write as _write
from pipeline._formats import Reason
from pipeline._tools.verify._base import Report, in_folder, record_place, short
from pipeline._tools.verify._shards import Stored, piece_base

REASONS = {r.value for r in Reason}


def load_manifest(folder: str, names: list[str], report: Report) -> Optional[Manifest]:
    """The complete manifest, or None with the problem that says why the folder cannot be trusted. Its types
    and ranges are checked first (a manifest that fails is the one problem reported: nothing else can be read
    against it); then every place it contradicts itself is a problem of its own, and the checks go on."""
    if MANIFEST not in names:
        report.add(MANIFEST, f"missing: {missing_manifest(folder, names)}")
        return None
    try:
        m = require_complete(_write.read_manifest(folder, consistent=False), folder)
    except PackstreamError as e:  # ContractError, or the checked open's refusal (a FIFO, a device, too big)
        report.add(MANIFEST, str(e))
        return None
    for key, what in inconsistencies(m):
        report.add(f"{MANIFEST} {key}", what)
    return m


def check_files(folder: str, names: list[str], m: Manifest, report: Report) -> list[ShardEntry]:
    """Leftovers, unlisted shard-like files, listed files that are missing; returns the listed shards present."""
    present = set(names)
    for n in names:
        if n.startswith(TMP_PREFIX):
            report.add(show_path(n), "temporary file left by an interrupted write; packstream pack --overwrite removes it")
        elif n == LOCK:
            report.add(n, "run lock left in a folder whose manifest is complete: a run is writing here now, or was "
                          "killed; packstream pack --overwrite breaks it")
    for n in m.unlisted(names):
        if not is_datasets_cache(n):
            report.add(show_path(n), "shard-like file not listed in manifest.json (a stray copy, or a shard of another "
                                     "run); not opened: remove it")
    for n in m.files:
        if n not in present:
            report.add(n, "listed in manifest.json files but missing from the folder")
    out = []
    for e in m.listed():
        if e.name in present:
            out.append(e)
        elif e.name not in m.files:
            report.add(e.name, "listed in manifest.json shards but missing from the folder")
    return out


@dataclasses.dataclass
class Dead:
    by_key: dict[tuple[str, int, Optional[str]], dict]
    """(source, position, example_id) -> the dead letter."""
    by_reason: dict[str, int]
    first: dict[str, dict]
    read: bool = True
    """False when rejected.jsonl could not be read to its end: nothing is compared with its counts then."""


def check_dead_letters(folder: str, names: list[str], m: Manifest, stored: Stored, report: Report) -> Dead:
    dead = Dead({}, {}, {})
    fname = m.rejected_file
    if fname not in names:
        report.add(fname, "missing")
        dead.read = False
        return dead
    prev = None
    lines = 0
    try:  # one line at a time through the checked open: a big file costs one line of memory, a FIFO none
        for lineno, line in _write.read_lines(in_folder(folder, fname), what=fname, line_limit=MAX_DEAD_LETTER_BYTES):
            lines += 1
            at = f"{fname} line {lineno}"
            try:
                rec = load_json(line, what=at)
            except PackstreamError as e:
                report.add(at, str(e)[len(at) + 2:])
                continue
            if not isinstance(rec, dict):
                report.add(at, "is not a JSON object")
                continue
            bad = [k for k, t in (("source", str), ("position", int), ("reason", str), ("detail", str))
                   if not isinstance(rec.get(k), t) or isinstance(rec.get(k), bool)]
            if bad or not isinstance(rec.get("example_id", ""), str):
                report.add(at, f"field(s) {', '.join(bad) or 'example_id'} missing or of the wrong type")
                continue
            if rec["reason"] not in REASONS:
                report.add(at, f"unknown reason {short(rec['reason'])}")
            key = (rec["source"], rec["position"], rec.get("example_id"))
            if key in dead.by_key:
                report.add(at, f"{record_place(key)} is dead-lettered twice")
            dead.by_key[key] = rec
            dead.by_reason[rec["reason"]] = dead.by_reason.get(rec["reason"], 0) + 1
            dead.first.setdefault(rec["reason"], rec)
            order = _rows.reject_sort_key(rec)
            if prev is not None and order < prev:
                report.add(at, "out of order: rejected.jsonl is sorted by source, position, reason and id")
            prev = order
    except PackstreamError as e:
        report.add(fname, f"cannot be read: {e}")
        dead.read = False
    report.dead_letters = lines
    # A too_long example is not packed; a duplicate_id names an example that was kept: packed, or dead-lettered.
    packed = {piece_base(e) for e in stored.loc}
    kept_dead = {k[2] for k, r in dead.by_key.items() if r["reason"] != Reason.DUPLICATE_ID.value}
    for key, rec in dead.by_key.items():
        eid = key[2]
        if rec["reason"] == Reason.TOO_LONG.value and eid in packed:
            report.add(f"{fname} {record_place(key)}", f"{eid} is dropped as too_long but also packed")
        if rec["reason"] == Reason.DUPLICATE_ID.value and eid not in packed and eid not in kept_dead:
            report.add(f"{fname} {record_place(key)}",
                       f"duplicate of {eid}, but no example {eid} is packed or dead-lettered")
    return dead


CUT_FIX = ("the rows' cuts marks or manifest.json were changed since packing: restore the folder or re-run "
           "packstream pack")


def _check_cut_counts(m: Manifest, stored: Stored, report: Report) -> None:
    """The rows' ``cuts`` marks (contract version 9) against ``counts.cut_sequences``, which the packing step counted
    from its placements: the truncated sequences and the split pieces, exactly. When no example arrived cut
    (``carried`` 0), also against the run's example counts: the examples (pairs) with a truncated sequence are
    ``truncated_examples`` (a truncated pair counts once, one or both of its sides marked), the examples with pieces
    ``split_examples``.

    ``counts.cut_sequences`` (:data:`packers.manifest.CUT_KEYS`): ``truncated``, the sequences marked ``[1, N]``;
    ``pieces``, those marked ``[n >= 2, N]`` or ``[-1, -1]``; ``carried``, of those, the ones whose mark came with
    their example (a repack of cut rows), not made by this run."""
    if m.raw.get("contract_version") != CONTRACT_VERSION:
        return  # version 6 rows carry no marks; image and video rows neither
    c, cut = m.counts, m.counts.cut_sequences
    if cut is None:
        report.add("manifest.json counts.cut_sequences", f"missing; a contract version {CONTRACT_VERSION} run counts its "
                                                         "cut sequences (re-run packstream pack)")
        return
    truncated = sum(t for t, _ in stored.cuts.values())
    pieces = sum(p for _, p in stored.cuts.values())
    held = "; ".join(f"{n} holds {t} truncated, {p} pieces" for n, (t, p) in stored.cuts.items() if t or p) \
        or "no shard holds a cut mark"
    if (cut["truncated"], cut["pieces"]) != (truncated, pieces):
        report.add("manifest.json counts.cut_sequences", f"says {cut['truncated']} truncated sequences and {cut['pieces']} "
                                                         f"split pieces, the shards' cuts marks {truncated} and {pieces} "
                                                         f"({held}); {CUT_FIX}")
    if cut["carried"] == 0 and (len(stored.truncated), len(stored.split)) != (c.truncated_examples, c.split_examples):
        report.add("manifest.json counts.truncated_examples", f"says {c.truncated_examples} truncated and "
                                                              f"{c.split_examples} split examples, the shards' cuts "
                                                              f"marks {len(stored.truncated)} and {len(stored.split)} "
                                                              f"({held}); {CUT_FIX}")


def check_counts(m: Manifest, measured: dict[str, dict], stored: Stored, dead: Dead, complete: bool,
                  report: Report) -> None:
    """The manifest's counts against what the files hold (that they reconcile among themselves and with the
    shard entries is :func:`packers.manifest.inconsistencies`, reported with the manifest)."""
    c = m.counts

    def expect(key: str, got: Any, holder: str = "the files hold") -> None:
        if getattr(c, key) != got:
            report.add(f"manifest.json counts.{key}", f"says {getattr(c, key)!r}, {holder} {got!r}")

    if complete:  # every listed shard was read
        rows = sum(x["rows"] for x in measured.values())
        tokens = sum(x["tokens"] for x in measured.values())
        expect("rows", rows)
        expect("tokens", tokens)
        expect("target_tokens", sum(x["target_tokens"] for x in measured.values()))
        expect("pieces", sum(x["examples"] for x in measured.values()))
        expect("examples_packed", len({piece_base(e) for e in stored.loc}), "the shards hold (distinct examples)")
        splits = {}
        for name, x in measured.items():
            s = splits.setdefault(stored.splits[stored.names.index(name)], {"rows": 0, "tokens": 0})
            s["rows"] += x["rows"]
            s["tokens"] += x["tokens"]
        said = {sp: {"rows": v.rows, "tokens": v.tokens} for sp, v in c.splits.items()}
        if said != splits:
            report.add("manifest.json counts.splits", f"says {said!r}, the shards hold {splits!r}")
        _check_cut_counts(m, stored, report)
    if not dead.read:
        return
    by_reason = dict(dead.by_reason)
    expect("dropped_too_long", by_reason.pop(Reason.TOO_LONG.value, 0), "rejected.jsonl holds")
    expect("rejected", sum(by_reason.values()), "rejected.jsonl holds")
    if dict(c.rejected_by_reason) != dict(sorted(by_reason.items())):
        report.add("manifest.json counts.rejected_by_reason",
                   f"says {dict(c.rejected_by_reason)!r}, rejected.jsonl holds {dict(sorted(by_reason.items()))!r}")
    first = {r: (x["source"], x["position"], x["detail"]) for r, x in dead.first.items()}
    if {r: (x.source, x.position, x.detail) for r, x in c.first_rejected.items()} != first:
        report.add("manifest.json counts.first_rejected", "differs from the first dead letter of each reason in "
                                                          "rejected.jsonl")
