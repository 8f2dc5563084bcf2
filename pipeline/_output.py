"""The output folder: packstream owns it, one run at a time, and commits by writing the manifest last.

The protocol of one ``packstream pack`` run (the contract is :mod:`packers._manifest`)::

    check     --output is a folder of its own: not "", not "/", not an input, not inside or around one
    claim     create .packstream.lock exclusively (O_EXCL locally; a create-if-absent precondition on
              gs:// and s3://) holding pid, host, start time. An existing lock: another run holds the
              folder (exit 2, naming it), or a killed run left it (--overwrite breaks it).
    own       the folder must be empty, or hold an earlier packstream output (a manifest.json): then
              --overwrite removes exactly the files that manifest lists, plus packstream's .tmp-*
              names, and nothing else. Files without a manifest are refused, except after a broken
              stale lock, where only packstream's own names (shards, rejected.jsonl, README.md,
              .tmp-*) are removed.
    run       shards and dead letters appear under .tmp-* names and are renamed into place
    commit    manifest.json, written last and atomically: "status": "complete", or "failed" with
              the reason (nothing a reader will load)
    release   remove the lock (a SIGKILL leaves it: the next run reports it as stale)
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from typing import Optional, Sequence

from packers import PackstreamError
from packers._files import show_path
from packers._manifest import LOCK, MANIFEST, SHARD_NAME, TMP_PREFIX
from pipeline._write import join

OWN_NAMES = ("rejected.jsonl", "README.md", MANIFEST)
"""Besides shards and .tmp-* names: the files a run writes."""


class OutputLocked(PackstreamError):
    """Another run holds the output folder (or a killed run left its lock)."""


def _is_remote(path: str) -> bool:
    return "://" in path


def normalize_output(output: str) -> str:
    """The output folder as packstream uses it: absolute locally; refuses names that are no folder of its own."""
    if not output or not output.strip():
        raise PackstreamError("--output is empty; give a folder for the packed data, e.g. -o packed/")
    if _is_remote(output):
        scheme, rest = output.split("://", 1)
        rest = rest.strip("/")
        if "/" not in rest:
            raise PackstreamError(f"--output {output} is a bucket root; give a folder inside it, e.g. {scheme}://{rest}/packed")
        return f"{scheme}://{rest}"
    path = os.path.abspath(os.path.expanduser(output))
    if path == os.path.abspath(os.sep) or path == os.path.expanduser("~"):
        raise PackstreamError(f"--output {output} is {'the filesystem root' if path == os.sep else 'your home folder'}; "
                              "packstream owns its output folder: give a new folder, e.g. -o packed/")
    return path


def check_not_inputs(output: str, inputs: Sequence[str]) -> None:
    """Refuse an output that is, holds, or lies inside an input (real paths): a rerun would read its own output."""
    if _is_remote(output):
        out = output.rstrip("/") + "/"
        for p in inputs:
            q = p.rstrip("/") + "/"
            if q.startswith(out) or out.startswith(q):
                raise PackstreamError(f"--output {output} and input {p} overlap; write the output somewhere else")
        return
    out = os.path.realpath(output)
    for p in inputs:
        if _is_remote(p):
            continue
        real = os.path.realpath(p)
        if real == out or real.startswith(out + os.sep) or out.startswith(real + os.sep):
            what = "is" if real == out else "holds" if real.startswith(out + os.sep) else "lies inside"
            raise PackstreamError(
                f"--output {output} {what} input {p}: a later run would read its own output (or --overwrite would "
                "remove an input); write the output somewhere else"
            )


@dataclasses.dataclass
class Claim:
    """A held output folder: release it when the run ends."""

    folder: str
    lock_path: str
    broke_stale: bool

    def release(self) -> None:
        try:
            if _is_remote(self.lock_path):
                from apache_beam.io.filesystems import FileSystems

                FileSystems.delete([self.lock_path])
            else:
                os.remove(self.lock_path)
        except Exception:  # noqa: BLE001 - best effort: the lock is reported as stale next time
            pass


def _lock_body(run_id: str) -> bytes:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "run": run_id}).encode()


def _create_exclusive(path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if it does not exist; False if it does."""
    if not _is_remote(path):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    return _remote_create_exclusive(path, data)


def _remote_create_exclusive(path: str, data: bytes) -> bool:
    """Object stores: a create-if-absent precondition where the client library offers one (GCS
    ``if_generation_match=0``, S3 ``IfNoneMatch="*"``); otherwise check, write and read back (a
    race of two runs started within the same second can then both pass: see docs/operations.md)."""
    scheme, rest = path.split("://", 1)
    bucket, key = rest.split("/", 1)
    if scheme == "gs":
        try:
            from google.api_core.exceptions import PreconditionFailed
            from google.cloud import storage
        except ImportError:
            pass
        else:
            try:
                storage.Client().bucket(bucket).blob(key).upload_from_string(data, if_generation_match=0)
                return True
            except PreconditionFailed:
                return False
    if scheme == "s3":
        try:
            import boto3
            from botocore.exceptions import ClientError
        except ImportError:
            pass
        else:
            try:
                boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
                return True
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return False
                raise
    from apache_beam.io.filesystems import FileSystems

    if FileSystems.exists(path):
        return False
    with FileSystems.create(path) as f:
        f.write(data)
    with FileSystems.open(path, compression_type="uncompressed") as f:
        return f.read() == data


def _read_lock(path: str) -> dict:
    try:
        if _is_remote(path):
            from apache_beam.io.filesystems import FileSystems

            with FileSystems.open(path, compression_type="uncompressed") as f:
                return json.loads(f.read())
        with open(path, "rb") as f:
            return json.loads(f.read())
    except Exception:  # noqa: BLE001 - a lock we cannot read is still a lock
        return {}


def _alive(info: dict) -> Optional[bool]:
    """Whether the lock's process runs: True/False on this host, None when it is elsewhere or unknown."""
    if info.get("host") != socket.gethostname() or not isinstance(info.get("pid"), int):
        return None
    try:
        os.kill(info["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _list(folder: str) -> list[str]:
    if _is_remote(folder):
        from apache_beam.io.filesystems import FileSystems

        found = FileSystems.match([folder.rstrip("/") + "/**"])[0].metadata_list
        prefix = folder.rstrip("/") + "/"
        return sorted({m.path[len(prefix):].split("/", 1)[0] for m in found if m.path.startswith(prefix)})
    return sorted(os.listdir(folder))


def _remove(folder: str, names: Sequence[str]) -> None:
    if not names:
        return
    if _is_remote(folder):
        from apache_beam.io.filesystems import FileSystems

        paths = []
        for n in names:
            paths += [m.path for m in FileSystems.match([join(folder, n) + "*"])[0].metadata_list
                      if m.path == join(folder, n) or m.path.startswith(join(folder, n) + "/")]
        if paths:
            FileSystems.delete(paths)
        return
    import shutil

    for n in names:
        p = os.path.join(folder, n)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)


def _own_name(name: str) -> bool:
    return bool(SHARD_NAME.match(name)) or name in OWN_NAMES or name.startswith(TMP_PREFIX)


def claim(output: str, inputs: Sequence[str], overwrite: bool, run_id: str) -> Claim:
    """Check, claim and clear the output folder (see the module docstring); raises PackstreamError."""
    check_not_inputs(output, inputs)
    if not _is_remote(output):
        if os.path.lexists(output) and not os.path.isdir(output):
            raise PackstreamError(f"--output {output} is a file; give a folder")
        try:
            os.makedirs(output, exist_ok=True)
        except OSError as e:
            raise PackstreamError(f"--output {output} cannot be created: {e.strerror or e}; choose a writable folder") from None
        if not os.access(output, os.W_OK | os.X_OK):
            raise PackstreamError(f"--output {output} is not writable; choose a writable folder")
    lock = join(output, LOCK)
    broke = False
    try:
        got = _create_exclusive(lock, _lock_body(run_id))
        if not got:
            info = _read_lock(lock)
            alive = _alive(info)
            who = (f"pid {info.get('pid')} on {info.get('host')}, since {info.get('started')}" if info
                   else "an unreadable lock")
            if alive is True or not overwrite:
                state = ("that run is still going" if alive else
                         "that process is gone: a killed run left it" if alive is False else
                         "the run may be on another machine")
                fix = ("wait for it or stop it" if alive else "if no run is active, pass --overwrite to break the lock")
                raise OutputLocked(f"--output {output} is locked by another packstream run ({LOCK}: {who}; {state}); {fix}")
            _remove(output, [LOCK])
            broke = True
            if not _create_exclusive(lock, _lock_body(run_id)):
                raise OutputLocked(f"--output {output}: another run claimed {LOCK} while this one broke the stale lock")
    except OSError as e:
        raise PackstreamError(f"--output {output} cannot be written: {e.strerror or e}; choose a writable folder") from None
    c = Claim(output, lock, broke)
    try:
        _clear(output, overwrite, broke)
    except BaseException:
        c.release()
        raise
    return c


def _clear(output: str, overwrite: bool, broke_stale: bool) -> None:
    names = [n for n in _list(output) if n != LOCK]
    if not names:
        return
    manifest = None
    if MANIFEST in names:
        from pipeline._write import read_manifest

        try:  # the one typed reader, through the checked open: a FIFO, /dev/zero or a huge file is one line
            manifest = read_manifest(output, files_only=True)  # which files a run wrote: all --overwrite needs
        except PackstreamError as e:
            if not broke_stale:
                raise PackstreamError(
                    f"--output {show_path(output)}: its {MANIFEST} cannot be trusted ({e}); --overwrite removes only "
                    "the files a valid manifest lists, so it leaves this folder alone: remove the folder yourself, or "
                    "choose another --output"
                ) from None
            manifest = None  # a killed run's leftovers: only packstream's own names go (below)
    if manifest is None and not broke_stale:
        raise PackstreamError(
            f"--output {show_path(output)} holds files packstream did not write ({len(names)} entries, e.g. "
            f"{show_path(names[0])}; no packstream {MANIFEST}); packstream owns its output folder: choose an empty or "
            "new folder"
        )
    if not overwrite:
        raise PackstreamError(
            f"--output {show_path(output)} holds an earlier packstream output ({len(names)} entries); pass --overwrite "
            "to replace it (only the files its manifest lists), or choose an empty folder"
        )
    owned = set(manifest.files) | {MANIFEST} if manifest is not None else set()
    remove = [n for n in names if n in owned or n.startswith(TMP_PREFIX) or (broke_stale and _own_name(n))]
    try:
        # The manifest goes first: from here on the folder is no complete output.
        _remove(output, [n for n in remove if n == MANIFEST])
        _remove(output, [n for n in remove if n != MANIFEST])
    except OSError as e:
        raise PackstreamError(f"--output {output}: cannot remove the earlier output's files ({e}); check permissions") from None
