"""The output folder: packstream owns it, one run at a time, and commits by writing the manifest last.

The protocol of one ``packstream pack`` run (the contract is :mod:`packers.manifest`)::

    check     --output is a folder of its own: not "", not "/", not an input, not inside or around one
    claim     create .packstream.lock exclusively (O_EXCL locally; a create-if-absent precondition on
              gs:// and s3://) holding who runs (pid, host, boot id, the process's start time, run id)
              and the run's journal: every file name it may create ("files"), written BEFORE any of
              them exists. An existing lock: another run holds the folder (exit 2, naming it), or a
              killed run left it (its process is gone, the pid now belongs to another program, or the
              machine restarted): --overwrite breaks it.
    own       the folder must be empty, or hold an earlier packstream output (a manifest.json): then
              --overwrite removes exactly the files that manifest lists, plus packstream's .tmp-*
              names, and nothing else. Files without a manifest are refused, except the leftovers of
              a run that never finished (a broken stale lock, or packstream's own "not complete"
              README.md): then the lock's journal and packstream's own names (shards,
              rejected.jsonl, README.md, .tmp-*) are removed.
    guard     before anything is removed or written, README.md becomes a card whose data_files point at
              nothing, so datasets.load_dataset refuses the folder until the commit
              (pipeline._write.guard_card); then the earlier output goes, its manifest first
    run       shards and dead letters are written under .tmp-* names (datasets ignores them)
    commit    complete: the shards are renamed into place, then manifest.json ("status": "complete",
              atomically), then the real card; failed: the staged shards go, then a card that
              points at no data and manifest.json with "status": "failed" and the reason
    release   remove the lock, only once a manifest explains the folder (a SIGKILL, or a manifest
              that could not be written, leaves it: the next run reports it as stale)
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
import time
from typing import Optional, Sequence

from packers import PackstreamError
from packers.files import check_utf8_name, show_path
from packers.manifest import LOCK, MANIFEST, SHARD_NAME, TMP_PREFIX
from pipeline import _fs, _sink
from pipeline._sink import Site
from pipeline._write import GUARD_MARK, join

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
    shown = show_path(output)
    check_utf8_name(output, "--output")
    if output.startswith("file://"):  # a local path as a URL: file:///abs/path (file://localhost/abs/path)
        rest = output[len("file://"):]
        host, slash, path = rest.partition("/")
        if host not in ("", "localhost") or not slash:
            raise PackstreamError(f"--output {shown}: a file:// URL names a local folder as file:///absolute/path; "
                                  "give it so, or as a plain path")
        output = "/" + path
    elif _is_remote(output):
        scheme, rest = output.split("://", 1)
        _check_scheme(output, scheme)
        rest = rest.strip("/")
        if "/" not in rest:
            raise PackstreamError(f"--output {shown} is a bucket root; give a folder inside it, e.g. {scheme}://{rest}/packed")
        return f"{scheme}://{rest}"
    path = os.path.abspath(os.path.expanduser(output))
    if path == os.path.abspath(os.sep) or path == os.path.expanduser("~"):
        raise PackstreamError(f"--output {shown} is {'the filesystem root' if path == os.sep else 'your home folder'}; "
                              "packstream owns its output folder: give a new folder, e.g. -o packed/")
    return path


def _check_scheme(output: str, scheme: str) -> None:
    """A remote --output must name a filesystem Beam has (gs://, s3://, hdfs://, ...), installed."""
    if not _fs.supports(output):
        raise PackstreamError(
            f"--output {show_path(output)}: no filesystem for {scheme}:// (Beam reads and writes local paths, gs://, "
            "s3://, hdfs:// and azfs://; gs:// needs apache-beam[gcp], s3:// apache-beam[aws])"
        )


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


_HELD: set[str] = set()
"""Run ids whose lock this process holds now: a lock naming this process's pid but none of these is stale
(a run of this process that ended without releasing it, or an earlier process that had the same pid)."""


@dataclasses.dataclass
class Claim:
    """A held output folder: release it when the run ends (only once a manifest explains the folder)."""

    folder: str
    lock_path: str
    broke_stale: bool
    run_id: str = ""

    def leave(self) -> None:
        """The run ends without removing its lock (no manifest explains the folder): the lock is stale now."""
        _HELD.discard(self.run_id)

    def release(self) -> None:
        _HELD.discard(self.run_id)
        try:
            _fs.delete([self.lock_path])
        except Exception:  # noqa: BLE001 - best effort: the lock is reported as stale next time
            pass


def boot_id() -> Optional[str]:
    """This machine's boot id (Linux): a lock from before a restart is stale whatever its pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


def process_start(pid: int) -> Optional[str]:
    """When process ``pid`` started, as a token equal only for the same process: its start time in clock ticks
    since boot (/proc/PID/stat field 22), else psutil's create_time; None when neither can tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return "ticks:" + data[data.rindex(b")") + 2:].split()[19].decode()
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return f"ctime:{psutil.Process(pid).create_time():.3f}"
    except Exception:  # noqa: BLE001 - ImportError, NoSuchProcess, AccessDenied: unknown
        return None


def _lock_body(run_id: str, files: Sequence[str]) -> bytes:
    return json.dumps({
        "pid": os.getpid(), "host": socket.gethostname(), "boot_id": boot_id(), "pid_start": process_start(os.getpid()),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "run": run_id, "files": list(files),
    }).encode()


def _create_exclusive(path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` only if it does not exist; False if it does."""
    if not _is_remote(path):
        try:
            f = _sink.create(path, Site.LOCK, exclusive=True)
        except FileExistsError:
            return False
        with f:
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
    if _fs.exists(path):
        return False
    with _sink.create(path, Site.LOCK) as f:
        f.write(data)
    with _fs.open(path) as f:
        return f.read() == data


def _read_lock(path: str) -> dict:
    try:
        with _fs.open(path) as f:
            return json.loads(f.read())
    except Exception:  # noqa: BLE001 - a lock we cannot read is still a lock
        return {}


@dataclasses.dataclass(frozen=True)
class LockState:
    """What a lock left in the output folder proves about the run that took it."""

    alive: Optional[bool]
    """True: a process that may be that run holds the pid here (never broken); False: that run is gone
    (``--overwrite`` breaks the lock); None: it may run on another machine, or the lock names none."""
    why: str
    """One clause: how the lock and this machine show it."""
    proven: bool = False
    """``alive`` is proven: the pid's process is the one that took the lock (host, boot id where this machine
    has one, and the process's start time all match). Only then may advice name the pid to stop."""


def lock_state(info: dict) -> LockState:
    """Whether the run that wrote a lock still runs, and why (see :class:`LockState`).

    A pid alone proves nothing: after a restart, or in a container where every run is pid 1, the
    pid of a dead run belongs to another process, or to this very one. The lock says which
    process it was (host, boot id, the process's start time, the run id), and each must still match.
    A lock that records less (an older packstream's, or one taken where neither /proc nor psutil
    tells a start time) cannot prove that a live pid is its run, nor that it is not.
    """
    pid = info.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return LockState(None, "the lock names no process" if info else "the lock is unreadable")
    host = info.get("host")
    if host is None:
        return LockState(None, "it records no host, boot id or process start time (an older packstream wrote it), so "
                               "nothing tells whether that run still goes")
    if host != socket.gethostname():
        return LockState(None, f"the run may be on another machine ({host!r})")
    recorded_boot, boot = info.get("boot_id"), boot_id()
    if recorded_boot and boot and recorded_boot != boot:
        return LockState(False, "the machine restarted since: a killed run left it")
    if pid == os.getpid():
        if info.get("run") in _HELD:
            return LockState(True, "this process holds it for another run", proven=True)
        return LockState(False, f"pid {pid} is this process, which runs no pack there: an earlier run that was "
                                "stopped left it")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return LockState(False, "that process is gone: a killed run left it")
    except PermissionError:
        pass
    recorded_start, start = info.get("pid_start"), process_start(pid)
    if recorded_start and start and recorded_start.split(":")[0] == start.split(":")[0] and recorded_start != start:
        return LockState(False, f"pid {pid} now belongs to another process (started at another time): a killed run "
                                "left it")
    if recorded_start and recorded_start == start and (recorded_boot == boot or not (recorded_boot or boot)):
        return LockState(True, "that run is still going", proven=True)
    lacks = [what for what, have in (("boot id", recorded_boot or not boot), ("process start time", recorded_start))
             if not have]
    records = f"records no {' or '.join(lacks)}" if lacks else "holds a process start time this machine cannot check"
    return LockState(True, f"pid {pid} is alive here, but the lock {records} to tell that run from another process "
                           f"with pid {pid} (in a container every run is pid 1)")


def _list(folder: str) -> list[str]:
    if _is_remote(folder):
        found = _fs.match(folder.rstrip("/") + "/**")
        prefix = folder.rstrip("/") + "/"
        return sorted({m.path[len(prefix):].split("/", 1)[0] for m in found if m.path.startswith(prefix)})
    return sorted(os.listdir(folder))


def _remove(folder: str, names: Sequence[str]) -> None:
    if not names:
        return
    if _is_remote(folder):
        paths = []
        for n in names:
            paths += [m.path for m in _fs.match(join(folder, n) + "*")
                      if m.path == join(folder, n) or m.path.startswith(join(folder, n) + "/")]
        if paths:
            _fs.delete(paths)
        return
    import shutil

    for n in names:
        p = os.path.join(folder, n)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)


def remove_temporaries(folder: str) -> None:
    """Remove packstream's ``.tmp-*`` names from a folder this process holds (its run has stopped, its workers
    with it: nothing writes them any more). Best effort: ``--overwrite`` removes any that stay."""
    try:
        _remove(folder, [n for n in _list(folder) if n.startswith(TMP_PREFIX)])
    except Exception:  # noqa: BLE001 - OSError, BeamIOError: they stay for --overwrite
        pass


def _own_name(name: str) -> bool:
    return bool(SHARD_NAME.match(name)) or name in OWN_NAMES or name.startswith(TMP_PREFIX)


def _check_folder(output: str) -> None:
    """A local --output is a folder, or nothing yet (then it is created); anything else is named for what it is."""
    shown = show_path(output)
    if os.path.islink(output) and not os.path.exists(output):
        raise PackstreamError(f"--output {shown} is a dangling symlink (to {show_path(os.readlink(output))}, which does not "
                              "exist); remove the link, or point it at a folder")
    if os.path.lexists(output) and not os.path.isdir(output):
        mode = os.stat(output).st_mode
        what = ("a file" if stat.S_ISREG(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
                "not a folder")
        raise PackstreamError(f"--output {shown} is {what}; give a folder")
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as e:
        raise PackstreamError(f"--output {shown} cannot be created: {e.strerror or e}; choose a writable folder") from None
    if not os.access(output, os.W_OK | os.X_OK):
        raise PackstreamError(f"--output {shown} is not writable; choose a writable folder")


def _who(info: dict) -> str:
    """Who took a lock, as far as it says: ``pid 1 on host-a, since 2026-01-01T00:00:00Z``."""
    if not info:
        return "an unreadable lock"
    where = f" on {info['host']}" if info.get("host") is not None else ""
    when = f", since {info['started']}" if info.get("started") is not None else ""
    return f"pid {info.get('pid')}{where}{when}"


def _lock_fix(state: LockState, info: dict, lock: str) -> str:
    """How to go on from a lock in the way: stop its pid only when the lock proves the pid is its run."""
    pid, rm = info.get("pid"), f"rm {show_path(lock)}, then pass --overwrite"
    if state.alive is True and state.proven:
        return (f"wait for it, or stop it (kill {pid}); if no packstream run uses this folder (the pid now belongs to "
                f"another program), remove the lock: {rm}")
    if state.alive is True:
        before = f" that started before {info['started']}" if info.get("started") is not None else ""
        return f"if `ps -o lstart=,args= -p {pid}` shows no packstream run{before}, that run is gone: {rm}; else wait for it"
    return "if no run is active, pass --overwrite to break the lock and clear what that run left"


def claim(output: str, inputs: Sequence[str], overwrite: bool, run_id: str, files: Sequence[str] = ()) -> Claim:
    """Check, claim and clear the output folder (see the module docstring); raises PackstreamError.

    ``files``: the run's journal, every name it may create in the folder; written into the lock
    before any of them exists, so whatever a run leaves, ``--overwrite`` knows it is packstream's.
    """
    check_not_inputs(output, inputs)
    shown = show_path(output)
    if not _is_remote(output):
        _check_folder(output)
    lock = join(output, LOCK)
    broke, journal = False, []
    try:
        got = _create_exclusive(lock, _lock_body(run_id, files))
        if not got:
            info = _read_lock(lock)
            state = lock_state(info)
            if state.alive is True or not overwrite:
                raise OutputLocked(f"--output {shown} is locked by another packstream run ({LOCK}: {_who(info)}; "
                                   f"{state.why}); {_lock_fix(state, info, lock)}")
            journal = [n for n in info.get("files", []) if isinstance(n, str)] if isinstance(info.get("files"), list) else []
            _remove(output, [LOCK])
            broke = True
            if not _create_exclusive(lock, _lock_body(run_id, files)):
                raise OutputLocked(f"--output {shown}: another run claimed {LOCK} while this one broke the stale lock")
    except OSError as e:
        raise PackstreamError(f"--output {shown} cannot be written: {e.strerror or e}; choose a writable folder") from None
    _HELD.add(run_id)
    c = Claim(output, lock, broke, run_id)
    try:
        _clear(output, overwrite, broke, journal, run_id)
    except BaseException:
        c.release()
        raise
    return c


def _guarded(output: str, names: Sequence[str]) -> bool:
    """The folder holds packstream's own "not complete" card: a run that never finished (its lock removed by hand)."""
    if "README.md" not in names:
        return False
    from packers.files import MiB, read_checked

    try:  # packstream's cards are a few KB: a bigger README.md is not one
        return GUARD_MARK.encode() in read_checked(join(output, "README.md"), what="README.md", limit=MiB,
                                                   opener=_fs.open)
    except (OSError, PackstreamError):  # unreadable: no proof of ownership
        return False


def _guard(output: str, run_id: str) -> None:
    """Put packstream's "not complete" card in place (pipeline._write.guard_card): datasets.load_dataset refuses
    the folder from now until the commit, even while an earlier output's files are being removed."""
    from pipeline._write import guard_card, write_atomic

    try:
        write_atomic(join(output, "README.md"), guard_card(
            f"A packstream run (id {run_id}) is writing this folder, or was stopped before it finished.").encode(),
                     Site.CARD)
    except OSError as e:
        raise PackstreamError(f"--output {show_path(output)} cannot be written: {e.strerror or e}; choose a writable "
                              "folder") from None


def _clear(output: str, overwrite: bool, broke_stale: bool, journal: Sequence[str] = (), run_id: str = "") -> None:
    """Check that the folder is packstream's, put the guard card in place, then remove the earlier output."""
    names = [n for n in _list(output) if n != LOCK]
    if not names:
        _guard(output, run_id)
        return
    shown = show_path(output)
    manifest = None
    if MANIFEST in names:
        from pipeline._write import read_manifest

        try:  # the one typed reader, through the checked open: a FIFO, /dev/zero or a huge file is one line
            manifest = read_manifest(output, files_only=True)  # which files a run wrote: all --overwrite needs
        except PackstreamError as e:
            if not broke_stale and not _guarded(output, names):
                raise PackstreamError(
                    f"--output {shown}: its {MANIFEST} cannot be trusted ({e}); --overwrite removes only "
                    "the files a valid manifest lists, so it leaves this folder alone: remove the folder yourself, or "
                    "choose another --output"
                ) from None
            manifest = None  # a killed run's leftovers: only packstream's own names go (below)
    leftovers = broke_stale or (manifest is None and _guarded(output, names))
    if manifest is None and not leftovers:
        raise PackstreamError(
            f"--output {shown} holds files packstream did not write ({len(names)} entries, e.g. {show_path(names[0])}; no "
            f"packstream {MANIFEST}); packstream owns its output folder: choose an empty or new folder"
        )
    if not overwrite:
        what = "an earlier packstream output" if manifest is not None else "what an unfinished packstream run left"
        raise PackstreamError(
            f"--output {shown} holds {what} ({len(names)} entries); pass --overwrite to replace it (only "
            "packstream's own files), or choose an empty folder"
        )
    owned = set(manifest.files) | {MANIFEST} if manifest is not None else set()
    owned |= set(journal)
    remove = [n for n in names if n in owned or n.startswith(TMP_PREFIX) or (leftovers and _own_name(n))]
    try:
        # The guard card first (it replaces the old card: load_dataset refuses the folder from here on), then the
        # manifest (PackedDataset and verify refuse it), then the rest.
        _guard(output, run_id)
        _remove(output, [n for n in remove if n == MANIFEST])
        _remove(output, [n for n in remove if n not in (MANIFEST, "README.md")])
    except OSError as e:
        raise PackstreamError(f"--output {shown}: cannot remove the earlier output's files ({e}); check permissions") from None
