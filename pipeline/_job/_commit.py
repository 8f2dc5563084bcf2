"""The commit: everything the steps reported -> rejected.jsonl, the counts, manifest.json and the dataset card.

:func:`finalize` runs once, after every shard is staged. It sums the reports (:class:`Reports`:
one handler per type of :mod:`pipeline._job._outputs`), merges the dead letters, checks that the
counts reconcile and decides the run's status; then :func:`commit` writes the end of the run into
the folder in the order every reader relies on. Whatever stops a run before that (a signal, a
runner error) ends in :func:`stopped`, which makes the folder explain itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Optional

import packers
from packers import InternalError, PackstreamError
from packers.manifest import MANIFEST, Status
from pipeline import _media, _output, _trace, _write
from pipeline._exit import ExitCode
from pipeline._job._context import RunContext
from pipeline._job._counts import by_count, count, reconcile, top_reasons
from pipeline._report import split_remedy
from pipeline._job._outputs import Failure, Flags, Rejects, Stats, Written, cannot_write
from pipeline._sink import Site
from pipeline._workers import signals


class Reports:
    """The sum of what the steps reported."""

    def __init__(self) -> None:
        self.stats: dict[str, int] = {}
        self.shards: list[dict] = []
        self.parts: list[str] = []
        self.failures: list[str] = []
        self.flags = {"eos_at_boundaries": True, "all_targets": True}

    @functools.singledispatchmethod
    def add(self, item: Any) -> None:
        raise InternalError(f"the commit got a {type(item).__name__} from a step; it takes the reports of "
                            "pipeline._job._outputs")

    @add.register
    def _(self, item: Stats) -> None:
        for k, v in item.counts.items():
            self.stats[k] = self.stats.get(k, 0) + v

    @add.register
    def _(self, item: Written) -> None:
        self.shards.append(item.shard)

    @add.register
    def _(self, item: Rejects) -> None:
        self.parts.append(item.path)

    @add.register
    def _(self, item: Failure) -> None:
        self.failures.append(item.message)

    @add.register
    def _(self, item: Flags) -> None:
        self.flags["eos_at_boundaries"] &= item.eos_at_boundaries
        self.flags["all_targets"] &= item.all_targets


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The run's status, and for a failed run why and its exit code."""

    status: str = Status.COMPLETE.value
    error: Optional[str] = None
    code: int = 0

    @classmethod
    def failed(cls, error: str, code: int = ExitCode.USER_ERROR) -> "Verdict":
        return cls(Status.FAILED.value, error, code)

    @property
    def complete(self) -> bool:
        return self.status == Status.COMPLETE.value


def finalize(ctx: RunContext, items) -> dict:
    """Sum up ``items`` (every step's reports), decide the status and commit; returns the manifest."""
    reports = Reports()
    for item in items:
        reports.add(item)
    reports.shards.sort(key=lambda s: s["name"])
    rejected, first = {}, {}
    if not reports.failures:
        try:
            rejected, first = _write.merge_rejected(ctx.output, reports.parts)
        except (OSError, PackstreamError) as e:
            reports.failures.append(Failure.of(e, ctx.output).message)
    signals.at("commit")
    counts = count(ctx.options, reports.stats, reports.shards, rejected, first, check=not reports.failures)
    verdict = _verdict(ctx, counts, reports.failures)
    signals.at("commit")
    try:
        if verdict.complete:
            shards = _write.publish(ctx.output, reports.shards)  # the shards take their names; the manifest says whole
            written = [s["name"] for s in shards] + ["rejected.jsonl", "README.md"]
        else:  # nothing is published; the manifest lists everything the run may have left (--overwrite removes it)
            _write.discard(reports.shards)
            shards, written = [], ctx.planned_files()
        manifest = manifest_of(ctx, verdict, counts, shards, written, reports.flags)
        commit(ctx.output, manifest)
    except OSError as e:
        manifest = manifest_of(ctx, Verdict.failed(cannot_write(e, ctx.output)), counts, [], ctx.planned_files(), reports.flags)
        _record_outcome(ctx.outcome, manifest)
    remove_spill(ctx.spill)
    return manifest


def _verdict(ctx: RunContext, counts: dict, failures: list[str]) -> Verdict:
    """A failure (the first one), no records at all, nothing packed, or too many rejected: else complete."""
    o, files = ctx.options, ctx.files
    if failures:
        return Verdict.failed(failures[0])
    if counts["records_read"] == 0:
        shown = ", ".join(f.path for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        return Verdict.failed(f"the inputs hold no records ({shown}); check that they are the files you meant")
    reconcile(counts)
    frac = (counts["rejected"] + counts["dropped_too_long"]) / counts["records_read"]
    if counts["examples_packed"] == 0:
        return Verdict.failed(
            f"no example was packed: all {counts['records_read']:,} records were rejected or dropped "
            f"({top_reasons(counts)}){_top_remedy(counts)}; see {o.output}/rejected.jsonl, or try "
            "`packstream preview` on the inputs", ExitCode.REJECTED)
    if frac > o.max_reject_fraction:
        return Verdict.failed(
            f"{frac:.1%} of {counts['records_read']:,} records were rejected or dropped ({top_reasons(counts)}), "
            f"more than --max-reject-fraction {o.max_reject_fraction:.1%}{_top_remedy(counts)}; see "
            f"{o.output}/rejected.jsonl", ExitCode.REJECTED)
    return Verdict()


def _top_remedy(counts: dict) -> str:
    """The remedy the most common reason's first case names, whole (``: fix: read it with --field ...``), for the
    final error line; ``""`` when it names none."""
    first = counts.get("first_rejected", {})
    for reason, _ in by_count(counts):
        if reason in first:
            remedy = split_remedy(" ".join(str(first[reason]["detail"]).split()))[1]
            return f"; fix ({reason}, as its first record says): {remedy}" if remedy else ""
    return ""


def commit(output: str, manifest: dict) -> None:
    """Write the run's end into the folder: the order is what every reader sees at every instant.

    complete: (the shards already renamed into place: :func:`pipeline._write.publish`)
              manifest.json (atomic), then the dataset card that points at the shards. Until the
              card is written, the guard card written at the claim keeps ``datasets.load_dataset``
              out, and the lock keeps ``PackedDataset`` and ``verify`` out; the lock goes last.
    failed:   the guard card with the reason, then the failed manifest.

    A signal that arrives in between is held until both are written. A complete manifest whose
    card cannot be written is turned back into a failed one (best effort; the lock stays if not).
    """
    body = _json(manifest)
    card = _write.dataset_card(manifest).encode()
    readme, path = _write.join(output, "README.md"), _write.join(output, MANIFEST)
    with signals.deferred():
        if manifest["status"] != Status.COMPLETE.value:
            _write.write_atomic(readme, card, Site.CARD)
            _write.write_atomic(path, body, Site.MANIFEST)
            return
        _write.write_atomic(path, body, Site.MANIFEST)  # the commit
        try:
            _write.write_atomic(readme, card, Site.CARD)
        except OSError as e:
            failed = {**manifest, "status": Status.FAILED.value, "exit_code": ExitCode.USER_ERROR,
                      "error": f"{cannot_write(e, output)}: the dataset card README.md could not be written after "
                               "the manifest"}
            try:
                _write.write_atomic(path, _json(failed), Site.MANIFEST)
            except OSError:
                pass
            raise


def _json(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def manifest_of(ctx: RunContext, verdict: Verdict, counts: dict, shards: list, written: list, flags: dict) -> dict:
    """The manifest of a run that ends with ``verdict`` (a failed one names its error and exit code)."""
    o = ctx.options
    manifest = {
        "status": verdict.status,
        "packstream_version": _version(),
        "contract_version": packers.CONTRACT_VERSION,
        "config": o.to_dict(),
        "tokenizer": ctx.tokenizer,
        "run_id": ctx.digest,
        "inputs": ctx.input_entries(),
        "inputs_read_once": list(ctx.read_once),
        "counts": counts,
        "shards": shards,
        "files": written,
        "row_checks": {
            "budget": o.max_tokens,
            "eos_token_id": ctx.eos_id,
            "eos_at_boundaries": bool(flags["eos_at_boundaries"] and ctx.eos_id is not None),
            "targets_in_every_sequence": True,
            "all_targets": bool(flags["all_targets"] and counts["tokens"] > 0),
            "pairs": o.pairs,
        },
        "rejected_file": "rejected.jsonl",
    }
    if o.vision() is not None:  # a run with images: contract version 4 and the spec its shards carry
        manifest.update(contract_version=packers.VIDEO_CONTRACT_VERSION if o.vision().videos
                        else packers.VISION_CONTRACT_VERSION, vision=o.vision().to_json(),
                        media_roots=_media.media_roots(o.media_root, [os.path.dirname(f.path) for f in ctx.files]))
    if ctx.skipped:  # files of a folder input not read, each with its reason; absent when none (byte-identical)
        manifest["inputs_skipped"] = [e._asdict() for e in ctx.skipped]
    if ctx.notes:  # what the run decided for the user (a capped --num-shards); absent when nothing was
        manifest["notes"] = list(ctx.notes)
    if ctx.inputs_from:  # relative INPUT paths: where they were resolved from; absent when none is (byte-identical)
        manifest["inputs_from"] = ctx.inputs_from
    if ctx.sizes:  # what the layout was sized from, per input: a repack sizes its own from them
        manifest["input_sizes"] = list(ctx.sizes)
    if ctx.packed:  # a repack: the packed folders it read, each as its manifest names it (verify checks them)
        manifest["repacked_from"] = [src.lineage() for src in ctx.packed]
    if ctx.parallelism:  # a local run: the workers x threads it ran with and why (issue 28); absent on a cluster
        manifest["run"] = dict(ctx.parallelism)
    if not verdict.complete:
        manifest.update(error=verdict.error, exit_code=verdict.code)
    return manifest


def stopped(ctx: RunContext, claim: _output.Claim, verdict: Verdict) -> str:
    """After a run stopped without its commit (a signal, a runner error): make the folder explain itself.

    The workers have stopped (Beam's teardown, or :func:`pipeline._workers.signals.stop_workers`), so
    nothing else writes here now. A complete manifest means the commit was made: its card is
    (re)written and the run counts as done ("complete"). A failed one stays ("failed"). Otherwise a
    failed manifest (``verdict``) listing the run's journal and a guard card are written ("failed").
    The lock goes only when a manifest is there; if it cannot be written, the lock stays ("locked"):
    a killed run's lock, which ``--overwrite`` breaks.
    """
    state = "locked"
    with signals.deferred():
        try:
            m = written_manifest(ctx.output)
            if m is not None and m.get("status") == Status.COMPLETE.value:
                _write.write_atomic(_write.join(ctx.output, "README.md"), _write.dataset_card(m).encode(), Site.CARD)
                state = "complete"
            elif m is not None:
                state = "failed"
            else:
                counts = count(ctx.options, {}, [], {}, {})
                flags = {"eos_at_boundaries": True, "all_targets": True}
                commit(ctx.output, manifest_of(ctx, verdict, counts, [], ctx.planned_files(), flags))
                state = "failed"
        except Exception:  # noqa: BLE001 - a folder we cannot write: the lock stays and says so
            pass
        remove_spill(ctx.spill)
        if state != "complete":
            _output.remove_temporaries(ctx.output)  # staged shards, dead-letter parts: nothing will publish them
        if state != "locked":
            claim.release()
        else:
            claim.leave()
    return state


def written_manifest(output: str) -> Optional[dict]:
    """The manifest this run wrote, as JSON (the folder was cleared at the claim: any manifest there is this run's,
    written whole by an atomic rename); None when there is none or it cannot be read."""
    from packers.files import GiB, load_json, read_checked

    try:
        raw = load_json(read_checked(_write.join(output, MANIFEST), what=MANIFEST, limit=GiB, opener=_write.beam_open),
                        what=MANIFEST)
    except (OSError, PackstreamError):
        return None
    return raw if isinstance(raw, dict) else None


def _record_outcome(path: Optional[str], manifest: dict) -> None:
    """Where the manifest cannot be written (a full disk), a local launcher still learns why (``path``: the
    run's outcome file, None on a remote runner)."""
    if path:
        try:
            with open(path, "w") as f:
                json.dump({k: manifest[k] for k in ("status", "error", "exit_code")}, f)
        except OSError:
            pass


def remove_spill(folder: str) -> None:
    """Remove the run's spill folder (best effort: --overwrite removes ``.tmp-*`` leftovers)."""
    try:
        if "://" in folder:
            from pipeline import _fs

            found = [m.path for m in _fs.match(folder.rstrip("/") + "/**")]
            if found:
                _fs.delete(found)
        else:
            import shutil

            shutil.rmtree(folder, ignore_errors=True)
    except Exception:  # noqa: BLE001 - best effort: --overwrite removes .tmp-* leftovers
        pass


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("packstream")
    except PackageNotFoundError:
        return "0+unknown"
