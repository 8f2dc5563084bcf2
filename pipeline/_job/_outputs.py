"""What the job's steps emit: one small frozen type per kind of value.

Every step has one output, a mix of these values (runners such as Dask support nothing more), and
the runners pick out the type that a stage of the plan carries on (:class:`pipeline._job._plan.Stage`,
``carries``); the commit sums up the rest, the reports (:class:`pipeline._job._commit.Reports`, one handler per
type)::

    EncodeTasks  -> Spilled, Rejects, Stats, Failure
    PackGroups   -> Packed, Rejects, Stats, Flags, Failure
    WriteShards  -> Written, Failure
    Finalize     <- everything but Spilled and Packed (which feed the next step)

Nothing a worker finds wrong with the user's data or folder raises: a failed write or a user error
is a :class:`Failure` that the manifest records, and the launcher turns a failed manifest into one
``error:`` line.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from packers import PackstreamError
from pipeline._spill import Piece, Slice


@dataclasses.dataclass(frozen=True)
class Spilled:
    """Examples of one packing group, spilled to disk by one read task."""

    split: str
    group: int
    slice: Slice

    def keyed(self) -> tuple[tuple[str, int], Slice]:
        return (self.split, self.group), self.slice


@dataclasses.dataclass(frozen=True)
class Packed:
    """Rows of one packing group for one shard, parked in a packed spill file."""

    split: str
    shard: int
    piece: Piece

    def keyed(self) -> tuple[tuple[str, int], Piece]:
        return (self.split, self.shard), self.piece


@dataclasses.dataclass(frozen=True)
class Rejects:
    """A file of dead letters (one JSON line each) to merge into ``rejected.jsonl``."""

    path: str


@dataclasses.dataclass(frozen=True)
class Stats:
    """Counts to add up (records read, examples packed, normalization notes, ...)."""

    counts: dict[str, int]


@dataclasses.dataclass(frozen=True)
class Flags:
    """What one group's rows hold: every boundary after an EOS token, only target tokens."""

    eos_at_boundaries: bool
    all_targets: bool


@dataclasses.dataclass(frozen=True)
class Written:
    """A shard staged under its temporary name: its description for the manifest."""

    shard: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why the run cannot complete (the folder cannot be written, a user error found by a worker)."""

    message: str

    @classmethod
    def of(cls, e: "OSError | PackstreamError", output: str) -> "Failure":
        return cls(cannot_write(e, output) if isinstance(e, OSError) else str(e))


def cannot_write(e: OSError, output: str) -> str:
    """The one message for a write to the output folder ``output`` that failed: the folder and the cause.

    >>> import errno, os
    >>> cannot_write(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "out/")
    'cannot write to --output out/ (OSError: No space left on device)'
    """
    from packers.files import show_path

    return f"cannot write to --output {show_path(output)} ({type(e).__name__}: {e.strerror or e})"
