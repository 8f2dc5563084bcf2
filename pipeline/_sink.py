"""The one place a run opens a file to write under its output folder: the lock, the cards, the spill, the shards,
the dead letters and the manifest all come through :func:`create`, named by their :class:`Site`.

One door makes one guarantee checkable: every write a run makes can fail (a full disk, a read-only mount, a lost
permission, an I/O error), and each such failure must end the run as a failure. ``tests/test_write_faults.py``
finds the sites by running a pack through this door, then fails each of them in turn with each errno; a new write
is covered there as soon as it exists, and ``tests/test_guards.py`` checks that no other module opens a file to
write under the output.
"""

from __future__ import annotations

import enum
import os
from typing import BinaryIO


class Site(str, enum.Enum):
    """What a run writes under its output folder."""

    LOCK = "lock"
    """``.packstream-lock``: the claim (created exclusively)."""
    CARD = "card"
    """``README.md``: the guard card at the claim, the dataset card at the commit."""
    SPILL = "spill"
    """Spill files: encoded examples and packed groups, under the run's ``.tmp-spill-*`` folder."""
    SHARD = "shard"
    """A shard, staged under a temporary name and renamed at the commit."""
    REJECTS = "rejects"
    """Dead letters: a part per task or group, then ``rejected.jsonl``."""
    MANIFEST = "manifest"
    """``manifest.json``, the commit (or a failed one)."""


def create(path: str, site: Site, *, exclusive: bool = False) -> BinaryIO:
    """``path`` opened to write bytes (its folder made as needed; an object store through Beam's FileSystems).
    ``exclusive``: fail with FileExistsError if it exists (local paths; an object store's create-if-absent is
    :func:`pipeline._output` 's to do). ``site`` names what is written (for the fault tests and for errors)."""
    if "://" in path:
        from apache_beam.io.filesystems import FileSystems

        return FileSystems.create(path, mime_type="application/octet-stream", compression_type="uncompressed")
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    return open(path, "xb" if exclusive else "wb")
