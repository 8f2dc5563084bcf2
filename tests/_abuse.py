"""Test helper: run every reader of an output folder on it, each within a time bound, and say how it ended.

The readers are ``packstream verify``, ``packstream inspect``, ``packers.PackedDataset`` (opened, then one
batch read) and ``pack --overwrite`` (its claim of the folder, :func:`pipeline._output.claim`, which reads
the old manifest to learn what it may remove; run on a copy). Each either **works** or **refuses** with a
:class:`packers.PackstreamError` whose message is one line; any other exception, or a call that runs past
its bound, fails the test that called it. verify refuses by reporting problems (exit 1): each must be one
line too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
from pathlib import Path
from typing import Callable, Iterator

from packers import PackstreamError

BOUND_S = 20
"""Seconds any one reader may take on a small folder, whatever was done to it (a FIFO read blocks forever,
/dev/zero never ends: the bound turns that into a failure instead of a hung test)."""


class Overran(Exception):
    """A reader ran past its bound."""


@contextlib.contextmanager
def deadline(seconds: float = BOUND_S) -> Iterator[None]:
    """Raise :class:`Overran` in the main thread after ``seconds`` (SIGALRM interrupts a blocking open or read)."""

    def fire(signum, frame):
        raise Overran(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _verify(folder: Path) -> str | None:
    from tests._internals import verify

    report = verify(str(folder), None, announce=lambda line: None)
    for p in report.problems:
        assert "\n" not in str(p), f"verify problem spans lines: {str(p)!r}"
    return None if report.ok else str(report.problems[0])


def _inspect(folder: Path) -> None:
    from tests._internals import inspect

    inspect(str(folder))


def _load(folder: Path) -> None:
    from packers import Batching, PackedDataset, Sampling

    ds = PackedDataset(folder, sampling=Sampling(shuffle=False), batching=Batching(batch_size=2))
    next(iter(ds), None)


def _overwrite(folder: Path) -> None:
    from tests._internals import _output

    copy = folder.parent / f"{folder.name}-overwrite"
    if copy.exists():
        shutil.rmtree(copy)
    clone(folder, copy)
    try:
        _output.claim(str(copy), [], True, "test-run").release()
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def clone(src: Path, dst: Path) -> None:
    """``src`` as it is, cheaply: files hard-linked (claim removes names, never writes into a file), links and
    FIFOs recreated as links and FIFOs, folders recursed into."""
    dst.mkdir()
    for p in src.iterdir():
        if p.is_symlink():
            (dst / p.name).symlink_to(os.readlink(p))
        elif stat.S_ISFIFO(p.lstat().st_mode):
            os.mkfifo(dst / p.name)
        elif p.is_dir():
            clone(p, dst / p.name)
        else:
            os.link(p, dst / p.name)


READERS: dict[str, Callable[[Path], str | None]] = {
    "verify": _verify, "inspect": _inspect, "PackedDataset": _load, "pack --overwrite": _overwrite,
}


def outcome(name: str, folder: Path, bound: float = BOUND_S) -> str | None:
    """Run reader ``name`` on ``folder``: None when it works, else its one-line refusal."""
    try:
        with deadline(bound):
            said = READERS[name](folder)
    except PackstreamError as e:
        message = str(e)
        assert message and "\n" not in message, f"{name}: refusal spans lines: {message!r}"
        return message
    return said


def outcomes(folder: Path, names=tuple(READERS), bound: float = BOUND_S) -> dict[str, str | None]:
    """:func:`outcome` of each reader in ``names``."""
    return {n: outcome(n, folder, bound) for n in names}


FILE_KINDS = ["link to /dev/zero", "FIFO", "folder", "100 MiB", "random bytes", "truncated", "empty",
              "deep", "not UTF-8"]


def replace_file(path: Path, kind: str, original: bytes = b"", rng_bytes: bytes = b"") -> None:
    """Replace the file at ``path`` by something a reader must not read as it is (one of :data:`FILE_KINDS`)."""
    path.unlink()
    if kind == "link to /dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "100 MiB":
        with open(path, "wb") as f:
            f.truncate(100 << 20)
    elif kind == "random bytes":
        path.write_bytes(rng_bytes)
    elif kind == "truncated":
        path.write_bytes(original[: len(original) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "deep":
        path.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    else:
        path.write_bytes(b"\xff\xfe" + original)
