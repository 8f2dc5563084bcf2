"""``--inputs``: every input record re-read and re-encoded with the run's configuration, then reconciled with the
shards and the dead letters: packed with the same tokens, dead-lettered for the same reason, or not sampled."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import pyarrow as pa

import packers
from packers import PackstreamError
from packers.manifest import MANIFEST, Manifest
import pipeline._read as _read
from pipeline import _media
import pipeline._rows as _rows
from pipeline._formats import Reason
from pipeline._options import DatasetSpec, FormatOptions, PackOptions, options_from_config  # noqa: F401 (verify's name)
from pipeline._tools.verify._base import Report, record_place
from pipeline._tools.verify._folder import Dead
from pipeline._tools.verify._shards import PieceImage, Stored, images_in, open_shard, piece_digest, row_images

_MISMATCH_DETAILS = 1_000
"""Pieces whose re-encoded tokens are kept to explain a mismatch position by position."""


def recorded_inputs(m: Manifest) -> tuple[str, ...]:
    """The run's INPUT paths as it resolved them, so ``verify --inputs`` finds them from any folder: a relative
    one joined to the folder the run was started in (the manifest's ``inputs_from``; for a manifest from before
    it, the folder that a recorded input's path ends in this one under). () for a ``--config`` run (its data
    sets' paths are absolute, resolved from the config file)."""
    given = tuple(m.config.get("inputs") or ()) if isinstance(m.config, dict) else ()
    if m.config.get("config"):
        return ()
    base = m.raw.get("inputs_from")
    if not isinstance(base, str):
        base = next((p[: len(p) - len(rel)] for s in given if _read.relative_input(s) and not any(c in s for c in "*?[")
                     for rel in [os.path.normpath(s)] for p in (i.path for i in m.inputs)
                     if isinstance(p, str) and p.endswith(os.sep + rel)), None)
    if base is None:
        return given
    return tuple(os.path.join(base, os.path.expanduser(s)) if _read.relative_input(s) else s for s in given)


@dataclasses.dataclass
class InputCheck:
    """The run's options, rebuilt from its manifest, and its inputs as they resolve now."""

    options: PackOptions
    files: list


def prepare_inputs(folder: str, m: Manifest, inputs: Sequence[str], trust_remote_code: bool,
                    announce: Callable[[str], None], report: Report) -> Optional[InputCheck]:
    """Options and inputs of the run, and its tokenizer (loaded here, before the shards are read, so a
    tokenizer that cannot be loaded fails at once). None, with a problem, when the inputs differ."""
    from pipeline._tokenizer import tokenizer_identity

    options = options_from_config(m.config, inputs or recorded_inputs(m), folder, trust_remote_code)
    files = _read.expand_datasets(options.datasets())[0]  # PackstreamError: the inputs cannot be read
    want = sorted({i.source for i in m.inputs})
    got = sorted({f.source for f in files})
    if want != got:
        report.add("inputs", f"resolve to sources {got}, the manifest has {want}; pass the same inputs as the pack run")
        return None
    recorded = m.raw.get("media_roots")
    if recorded is not None:  # images resolve under the folders the run read them under, or the check means nothing
        now = _media.media_roots(options.media_root, [os.path.dirname(f.path) for f in files])
        if now != recorded:
            report.add("inputs", f"images resolve under {now} here, the run read them under {recorded} "
                                 "(manifest.json media_roots); pass the inputs where the pack run read them")
            return None
    name = options.tokenizer
    announce(f"verify: loading tokenizer {name!r} (named in {folder}/{MANIFEST}); its own code "
             + ("may run (--trust-remote-code)" if trust_remote_code else
                "will not run (the manifest cannot allow it; only --trust-remote-code does)"))
    try:
        identity = tokenizer_identity(name, trust_remote_code)
    except PackstreamError as e:
        hint = "" if trust_remote_code else ("; verify never runs a tokenizer's own code unless you pass "
                                             "--trust-remote-code (whatever manifest.json says)")
        raise PackstreamError(f"{e}{hint}") from None
    if identity["vocab_sha256"] != m.tokenizer.vocab_sha256:
        report.add("tokenizer", f"{name!r} here has vocab sha256 {identity['vocab_sha256'][:16]}…, the run used "
                                f"{m.tokenizer.vocab_sha256[:16]}…; cannot re-tokenize")
        return None
    return InputCheck(options, files)


def _chunks(files: Iterable, options: PackOptions, counts: dict, expected_dead: dict) -> Iterable[list]:
    """The inputs as the job reads them (per read task, chunks of --batch-size), a corrupt rest as one dead letter."""
    for f in files:
        for task in _read.cut_tasks(f):
            chunk: list = []
            try:
                for position, record in _read.read_task(task, options.max_record_bytes):
                    chunk.append((f.dataset, f.source, position, record))
                    if len(chunk) == options.batch_size:
                        counts["records_read"] += len(chunk)
                        yield chunk
                        chunk = []
            except _read.CorruptInput as e:  # as pipeline._job.EncodeTasks: counted as one record
                expected_dead[(f.source, e.rest_at, None)] = Reason.CORRUPT_INPUT.value
                counts["records_read"] += 1
            if chunk:
                counts["records_read"] += len(chunk)
                yield chunk


@dataclasses.dataclass
class _Reread:
    """What re-reading and re-encoding the inputs gives."""

    counts: dict[str, int] = dataclasses.field(default_factory=lambda: {"records_read": 0})
    """records_read, and the encode stage's counts (not_sampled, repeated_copies, extra_paths)."""
    dead: dict[tuple[str, int, Optional[str]], str] = dataclasses.field(default_factory=dict)
    """(source, position, example id) -> the reason it is dead-lettered."""
    candidates: dict[str, list[tuple[str, int, Any, dict]]] = dataclasses.field(default_factory=dict)
    """Example id -> (source, position, [(piece id, digest)] or a dead-letter reason, its --long stats), per record
    that gave it (more than one: a duplicate id)."""
    details: dict[str, tuple[np.ndarray, list[PieceImage]]] = dataclasses.field(default_factory=dict)
    """Piece id -> re-encoded (2, n) tokens and images (no bytes), for a mismatch's message."""


def check_inputs(folder: str, m: Manifest, check: InputCheck, stored: Stored, dead: Dead, report: Report) -> None:
    """Every input record: packed with the same tokens, dead-lettered for the same reason, or not sampled."""
    from pipeline._encode import add_counts

    again = _reread(check.options, check.files, stored)
    report.records = again.counts["records_read"]
    expected: dict[str, tuple[str, int, bytes]] = {}
    totals: dict[str, int] = {}
    for eid, (source, position, outcome, stats) in _winners(again).items():
        add_counts(totals, stats)
        if isinstance(outcome, str):
            again.dead[(source, position, eid)] = outcome
            continue
        totals["examples_packed"] = totals.get("examples_packed", 0) + bool(outcome)  # as len(np.unique(ex))
        for pid, d in outcome:
            expected[pid] = (source, position, d)
    _compare_pieces(folder, stored, dead, expected, again.details, _spec(m), report)
    _compare_dead_letters(dead, again.dead, report)
    _compare_counts(m, again.counts, totals, report)


def _spec(m: Manifest) -> Optional[packers.VisionSpec]:
    """The run's vision spec, to count an image's tokens in a message; None for a text run (or one the shard
    checks already report unreadable)."""
    try:
        return packers.VisionSpec.from_json(m.raw["vision"], what="manifest.json vision") if m.raw.get("vision") else None
    except (TypeError, ValueError):
        return None


def _reread(options: PackOptions, files: list, stored: Stored) -> _Reread:
    """Every record read, encoded and cut (or refused) as the job does, its pieces' digests taken."""
    from pipeline._encode import Encoder, add_counts, input_folders

    encoder = Encoder(options, input_folders(files))
    again = _Reread()
    for chunk in _chunks(files, options, again.counts, again.dead):
        enc = encoder.encode(chunk)
        add_counts(again.counts, enc.counts)
        for r in enc.rejected:
            again.dead[(r["source"], r["position"], r.get("example_id"))] = r["reason"]
        batch = enc.batch
        for i, eid in enumerate(batch.ids):
            stats: dict[str, int] = {}
            spans = _spans(batch, i, options, stats)
            outcome: Any = spans
            if not isinstance(spans, str):
                o, outcome = int(batch.offsets[i]), []
                images = _example_images(batch, i)
                for part, a, b in spans:
                    pid = eid + part if isinstance(part, str) else eid if part < 0 else f"{eid}#{part}"
                    ids, mask = batch.input_ids[o + a:o + b], batch.loss_mask[o + a:o + b]
                    here = [im for _, im in images_in(images, a, b)] if images else []
                    d = piece_digest(ids, mask, here)
                    if pid in stored.digest and stored.digest[pid] != d and len(again.details) < _MISMATCH_DETAILS:
                        again.details[pid] = (np.stack([ids.astype(np.int64), mask.astype(np.int64)]), here)
                    outcome.append((pid, d))
            again.candidates.setdefault(eid, []).append((batch.sources[i], batch.positions[i], outcome, stats))
    return again


def _example_images(batch: _rows.ExampleBatch, i: int) -> list[tuple[int, PieceImage]]:
    """Example ``i``'s images and videos as the Encoder gives them (``batch.images``, in token order), each ``(offset
    in the example, PieceImage)`` as :func:`~pipeline._tools.verify._shards.row_images` reads a row's; [] without
    images."""
    imgs = batch.images
    if imgs is None or imgs.index[i] == imgs.index[i + 1]:
        return []
    out = []
    for j in range(int(imgs.index[i]), int(imgs.index[i + 1])):
        path, data = imgs.refs[j]
        seconds = float(imgs.seconds[j]) if imgs.video[j] else None
        out.append((int(imgs.offsets[j]), PieceImage.of(0, imgs.grids[j], path, data, seconds)))
    return out


def _spans(batch: _rows.ExampleBatch, i: int, options: PackOptions, stats: dict[str, int]) -> "list[tuple] | str":
    """Example ``i``'s pieces as the job cuts them, ``(part, start, stop)`` (part: -1 whole, ``k`` the ``#k`` piece,
    or a pair's side suffix), by the job's rules on this example alone; or the reason it is dead-lettered."""
    rejected: list[dict] = []
    if options.pairs:  # the job's rules for pairs, on this pair alone: two sides, or a dead letter
        result, _ = _rows.pack_pair_group(batch.take([i]), options, rejected, stats)
        if rejected:
            return rejected[0]["reason"]
        cut = int(batch.cuts[i])
        return [(packers.Side(side).suffix, (0 if side == 0 else cut), (0 if side == 0 else cut) + int(n))
                for side, n in zip(result.order.tolist(), result.stops.tolist())]
    n = int(batch.offsets[i + 1] - batch.offsets[i])
    if n <= options.max_tokens:
        return [(-1, 0, n)]
    _, a, b, parts, _ = _rows.pieces(batch.take([i]), options, rejected, stats)  # the job's --long rules
    if rejected:
        return rejected[0]["reason"]
    return list(zip(parts.tolist(), a.tolist(), b.tolist()))


def _winners(again: _Reread) -> dict[str, tuple[str, int, Any, dict]]:
    """The record each example id is kept from: the first by (source, position) (pipeline._rows.dedupe); the
    others are added to ``again.dead`` as duplicates."""
    winners: dict[str, tuple[str, int, Any, dict]] = {}
    repeated = [e for e, c in again.candidates.items() if len(c) > 1]
    for eid, c in again.candidates.items():
        if len(c) == 1:
            winners[eid] = c[0]
    if repeated:
        flat = [(eid, s, p) for eid in repeated for s, p, _, _ in again.candidates[eid]]
        probe = _rows.ExampleBatch.from_arrays([x[0] for x in flat], [x[1] for x in flat], [x[2] for x in flat],
                                               np.zeros(len(flat), np.int64), np.zeros(0, np.int32),
                                               np.zeros(0, np.uint8))
        kept, dups = _rows.dedupe(probe)
        for eid, s, p in zip(kept.ids, kept.sources, kept.positions):
            winners[eid] = next(c for c in again.candidates[eid] if c[0] == s and c[1] == p)
        for r in dups:
            again.dead[(r["source"], r["position"], r["example_id"])] = r["reason"]
    return winners


def _compare_pieces(folder: str, stored: Stored, dead: Dead, expected: dict[str, tuple[str, int, bytes]],
                    details: dict[str, tuple[np.ndarray, list[PieceImage]]], spec: Optional[packers.VisionSpec],
                    report: Report) -> None:
    """Packed pieces (tokens, mask, images) against the stored ones."""
    dead_at = {k[:2]: r["reason"] for k, r in dead.by_key.items()}
    tables: dict[int, pa.Table] = {}  # shards parsed again to explain mismatches, once each
    for pid, (source, position, d) in expected.items():
        if pid not in stored.loc:
            why = dead_at.get((source, position))
            report.add(f"input {source}:{position}", f"should be packed as {pid!r} but is not in any shard"
                                                     + (f" (rejected.jsonl says {why})" if why else ""))
        elif pid in stored.digest and stored.digest[pid] != d:
            _explain(folder, stored, pid, details.get(pid), tables, spec, report)
    for pid in sorted(set(stored.loc) - set(expected)):
        report.add(stored.first(pid), "packed example matches no input record (not in the inputs, not sampled, or "
                                      "another run's)")


def _compare_dead_letters(dead: Dead, expected_dead: dict[tuple[str, int, Optional[str]], str], report: Report) -> None:
    """Dead letters against the expected ones."""
    for key, reason in sorted(expected_dead.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or "")):
        got = dead.by_key.get(key)
        if got is None:
            report.add(f"input {record_place(key)}", f"is rejected ({reason}) on re-reading but is not in rejected.jsonl")
        elif got["reason"] != reason:
            report.add(f"input {record_place(key)}", f"rejected.jsonl says {got['reason']}, re-reading gives {reason}")
    for key in sorted(set(dead.by_key) - set(expected_dead), key=lambda k: (k[0], k[1], k[2] or "")):
        report.add(f"rejected.jsonl {record_place(key)}",
                   f"dead letter ({dead.by_key[key]['reason']}) for a record the inputs pack fine or do not have")


def _compare_counts(m: Manifest, counts: dict[str, int], totals: dict[str, int], report: Report) -> None:
    """The manifest's counts re-derived from the inputs."""
    c = m.counts
    for key, got in (("records_read", counts["records_read"]), ("not_sampled", counts.get("not_sampled", 0)),
                     ("repeated_copies", counts.get("repeated_copies", 0)),
                     ("examples_packed", totals.get("examples_packed", 0)),
                     ("truncated_examples", totals.get("truncated_examples", 0)),
                     ("split_examples", totals.get("split_examples", 0)),
                     ("no_target_pieces", totals.get("no_target_pieces", 0))):
        if getattr(c, key) != got:
            report.add(f"manifest.json counts.{key}", f"says {getattr(c, key)!r}, re-reading the inputs gives {got}")
    if c.extra_paths != counts.get("extra_paths", 0):
        report.add("manifest.json counts.extra_paths", f"says {c.extra_paths}, re-reading the inputs gives "
                                                       f"{counts.get('extra_paths', 0)}")


def _explain(folder: str, stored: Stored, pid: str, want: Optional[tuple[np.ndarray, list[PieceImage]]],
             tables: dict[int, pa.Table], spec: Optional[packers.VisionSpec], report: Report) -> None:
    """A stored piece differs from the re-encoded one: say where and at which position, or which image differs."""
    loc = stored.loc[pid]
    loc = loc[0] if isinstance(loc, list) else loc
    where = stored.where(loc, pid)
    if want is None:
        report.add(where, "check input_ids/loss_mask/images failed: the stored piece differs from re-encoding the "
                          "input")
        return
    shard, row, k = stored.place(loc)
    if shard not in tables:
        tables[shard] = open_shard(folder, stored.names[shard], 1 << 62)[2]()[1]  # read once already
    table = tables[shard].slice(row, 1)
    r = table.select(["input_ids", "loss_mask", "seq_offsets"]).to_pylist()[0]
    a, b = r["seq_offsets"][k], r["seq_offsets"][k + 1]
    got = np.array([r["input_ids"][a:b], r["loss_mask"][a:b]], dtype=np.int64)
    tokens, images = want
    if got.shape[1] != tokens.shape[1]:
        report.add(where, f"check input_ids failed: {got.shape[1]} tokens stored, re-tokenizing the input gives "
                          f"{tokens.shape[1]}")
        return
    found = False
    for i, column in enumerate(("input_ids", "loss_mask")):
        diff = np.flatnonzero(got[i] != tokens[i])
        if diff.size:
            j = int(diff[0])
            more = f" ({diff.size} positions differ)" if diff.size > 1 else ""
            report.add(where, f"check {column} failed: {column}[{j}] is {int(got[i][j])}, re-tokenizing the input "
                              f"gives {int(tokens[i][j])}{more}")
            found = True
    kept = images_in(row_images(table)[0], a, b)
    found |= _explain_images(f"{stored.names[shard]} row {row} example {pid!r}", kept, images, spec, report)
    if not found:  # the digests differ, yet nothing above does: say so rather than pass it
        report.add(where, "check inputs failed: the stored piece's digest differs from re-encoding the input")


def _explain_images(where: str, kept: list[tuple[int, PieceImage]], images: list[PieceImage],
                    spec: Optional[packers.VisionSpec], report: Report) -> bool:
    """The piece's stored images (``(index in the row, image)``) against re-reading its input's: one line per image
    that differs (its offset, grid and token count, path, embedded bytes' sha256). Whether any did."""
    fix = " (the shard was changed after packing: repack, or restore the shard)"
    if [s.kind for _, s in kept] != [w.kind for w in images]:
        rows = [f"{s.kind} {k}" for k, s in kept]
        got = sum(w.kind == "video" for w in images)
        report.add(where, f"check images failed: {len(kept)} images and videos stored ({', '.join(rows[:8])}), "
                          f"re-reading the input gives {len(images) - got} images and {got} videos{fix}")
        return True
    found = False
    for (k, s), w in zip(kept, images):
        diffs = []
        if s.offset != w.offset:
            diffs.append(f"at token {s.offset} of the example stored, re-reading the input gives token {w.offset}")
        if s.grid != w.grid:
            n, m = (spec.grid_tokens(s.grid), spec.grid_tokens(w.grid)) if spec else (None, None)
            count = "" if n is None else f" ({n} tokens either way)" if n == m else f" ({n} tokens stored, {m} re-read)"
            diffs.append(f"grid {s.grid} stored, re-reading the input gives {w.grid}{count}")
        if s.path != w.path:
            diffs.append(f"path {s.path!r} stored, re-reading the input gives {w.path!r}")
        if s.sha256 != w.sha256:
            diffs.append(f"embedded bytes {_sha(s.sha256)} stored, re-reading the input gives {_sha(w.sha256)}")
        if s.seconds != w.seconds:
            diffs.append(f"second_per_grid_ts {s.seconds} stored, re-reading the input gives {w.seconds}")
        if diffs:
            report.add(f"{where} {s.kind} {k}", "; ".join(diffs) + fix)
            found = True
    return found


def _sha(sha: Optional[str]) -> str:
    return "sha256 " + sha[:16] + "…" if sha else "none"
