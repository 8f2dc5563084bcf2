"""``packstream verify``: re-check a whole output folder from its files alone.

Pure functions that fill a :class:`Report` with :class:`Problem` s, each naming where (shard,
row, sequence, example id, input record, or the manifest key) and what (the check, expected vs
got). Nothing in the folder is trusted:

* **The manifest.** Only a complete ``manifest.json`` is read, through the checked open and the typed
  reader (:mod:`packers.manifest`): a folder without one (a run still writing, a killed run, not
  packstream's), with ``"status": "failed"``, or with one that is not a regular file, too big, too
  deep or of the wrong types is a problem that says so, and nothing else is opened. Every place the
  manifest contradicts itself (:func:`packers.manifest.inconsistencies`) is a problem of its own.
* **Files.** Exactly the shards the manifest lists are opened (train and validation), only by
  the names the contract allows, only inside the folder. Every other ``*.arrow``/``*.parquet``
  is reported by name (a stray copy, another run's shard), and so are ``.tmp-*`` leftovers and
  a leftover ``.packstream.lock``. Each shard's size and sha256 must equal the manifest's, and
  every file the manifest lists must exist.
* **Schema.** Read with pyarrow's IPC or Parquet reader (no pickle anywhere): the schema equals
  :data:`packers.SCHEMA` (``VISION_SCHEMA``, ``VIDEO_SCHEMA`` for contract versions 4 and 5; their image and
  video runs checked against the tokens), the metadata (:func:`packers.read_metadata`) equals what the manifest
  implies (:func:`packers.manifest.expected_metadata`: the run's, and the shard's own run id, split,
  index and count), and no column holds nulls.
* **Rows.** :func:`packers.validate_row` (budget, lengths, offsets from 0 to ``len`` and strictly
  increasing), loss_mask values only 0 or 1, ``num_targets``, the pair columns (empty, or in a run of
  pairs: whole pairs, chosen first, one prompt per pair, loss_mask exactly on the completion spans),
  and the manifest's ``row_checks``: every sequence
  shorter than the budget ends with ``eos_token_id`` (``eos_at_boundaries``), every sequence has a
  target (``targets_in_every_sequence``), every token is one (``all_targets``).
* **Ids and counts.** Every example id exactly once across all shards and splits, the copies and
  pieces of one record in one split; every count of the manifest equals what the shards and
  ``rejected.jsonl`` hold, and the counts reconcile::

      records_read + repeated_copies + extra_paths == examples_packed + rejected + dropped_too_long + not_sampled

* **Inputs** (``--inputs``). Every input record is re-read and re-encoded with the manifest's
  configuration (:class:`pipeline._encode.Encoder`, the job's own encode stage; data sets, weights
  and format options from ``config``), then the job's packing rules are applied
  (:func:`pipeline._rows.dedupe`, :func:`pipeline._rows.pieces`): each record is then packed with
  the stored tokens and mask (``~k`` copies, ``#k`` pieces, the kept window of a truncated
  example) and the same images and videos (each one's offset in the example, grid, path and the sha256
  of its embedded bytes, a video's ``second_per_grid_ts``: a grid with height and width swapped,
  another path or other bytes is named by row, example and image or video), or in ``rejected.jsonl`` under the same reason, or not sampled; never
  two of these.

**Trust.** The tokenizer named in the manifest is loaded only with ``--trust-remote-code`` from the
command line allowing its code; the manifest's own ``trust_remote_code`` is ignored. verify says
which tokenizer it loads before loading it.

The checks live in ``_folder`` (the manifest, the files, the dead letters, the counts), ``_shards``
(each shard, every example id) and ``_inputs`` (``--inputs``); ``_base`` holds the report.
"""

from __future__ import annotations

import json

import sys
import time
from typing import Callable, Optional, Sequence

from packers import PackstreamError
from packers.manifest import expected_metadata
import pipeline._write as _write
from pipeline._tools.verify._base import Problem, Report
from pipeline._tools.verify._folder import check_counts, check_dead_letters, check_files, load_manifest
from pipeline._tools.verify._inputs import check_inputs, options_from_config, prepare_inputs
from pipeline._tools.verify._shards import OpenShard, Stored, check_ids, check_shard, open_shard, piece_digest

__all__ = ["Problem", "Report", "options_from_config", "piece_digest", "verify"]


def verify(folder: str, inputs: Optional[Sequence[str]] = None, *, trust_remote_code: bool = False,
           announce: Optional[Callable[[str], None]] = None) -> Report:
    """Re-check ``folder``; with ``inputs`` (``()`` = the manifest's own), reconcile every input record.

    ``trust_remote_code`` (the command line's ``--trust-remote-code``) is the only thing that lets the
    run's tokenizer execute code; ``announce`` receives the line naming the tokenizer before it is
    loaded (default: stderr). Raises :class:`PackstreamError` only for a user error: no such folder,
    inputs that cannot be read, a tokenizer that cannot be loaded. Every mismatch is a
    :class:`Problem` in the report.
    """
    started = time.time()
    folder = folder.rstrip("/") or "/"
    report = Report(folder)
    try:
        names = _write.list_folder(folder)
    except (OSError, ValueError) as e:
        raise PackstreamError(f"cannot list output folder {folder}: {e}") from None
    m = load_manifest(folder, names, report)
    if m is None:
        if inputs is not None:
            report.add("inputs", "not reconciled: the folder has no complete manifest.json")
        report.elapsed_s = time.time() - started
        return report
    input_check = None
    if inputs is not None:
        input_check = prepare_inputs(folder, m, inputs, trust_remote_code, announce or _stderr, report)
    entries = check_files(folder, names, m, report)
    stored = Stored()
    measured: dict[str, dict] = {}
    for e in entries:
        try:
            size, sha, parse = open_shard(folder, e.name, e.bytes)
        except (OSError, PackstreamError) as err:  # PackstreamError: the checked open (a FIFO, a device, too big)
            report.add(e.name, f"cannot be read: {err}")
            continue
        shard = OpenShard(e, len(stored.names), size, sha, parse, expected_metadata(m, e))
        stored.names.append(e.name)
        stored.splits.append(e.split)
        got = check_shard(report, shard, m.row_checks, stored, keep_digests=input_check is not None)
        report.shards += 1
        if got is not None:
            measured[e.name] = got
    check_ids(stored, report)
    dead = check_dead_letters(folder, names, m, stored, report)
    check_counts(m, measured, stored, dead, complete=len(measured) == len(m.shards), report=report)
    check_lineage(m.raw, report)
    if input_check is not None:
        check_inputs(folder, m, input_check, stored, dead, report)
    report.elapsed_s = time.time() - started
    return report


def check_lineage(raw: dict, report: Report) -> None:
    """A repacked folder (``repacked_from``): each source folder at hand must still hold the manifest the repack read
    (its sha256, and the run id it names). A source that is gone is not a problem: the output stands alone."""
    import hashlib
    import os

    for i, entry in enumerate(raw.get("repacked_from") or ()):
        where = f"manifest.json repacked_from[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("folder"), str):
            report.add(where, "is not a {folder, run_id, manifest_sha256, contract_version} entry")
            continue
        path = os.path.join(entry["folder"], "manifest.json")
        if not os.path.isfile(path):
            continue
        from packers.files import GiB, read_checked

        body = read_checked(path, what="manifest.json", limit=GiB)
        sha = hashlib.sha256(body).hexdigest()
        if sha != entry.get("manifest_sha256"):
            report.add(where, f"{entry['folder']}/manifest.json has sha256 {sha[:16]}…, the repack read "
                              f"{str(entry.get('manifest_sha256'))[:16]}…: the source folder changed since (repack it "
                              "again, or restore the folder)")
            continue
        try:
            run_id = json.loads(body).get("run_id")
        except ValueError:
            run_id = None
        if run_id != entry.get("run_id"):
            report.add(where, f"{entry['folder']} has run id {run_id!r}, the entry says {entry.get('run_id')!r}")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
