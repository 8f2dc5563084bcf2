"""What verify finds (a :class:`Report` of :class:`Problem` s, each naming where and what), and the helpers
every check uses: the folder's paths, places and values as problems show them."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from packers import InternalError
from packers.files import show_path
import pipeline._write as _write

MAX_KEPT_PROBLEMS = 10_000
"""Problems kept in a report (all are counted): a badly damaged folder can have one per sequence."""


@dataclasses.dataclass(frozen=True)
class Problem:
    where: str
    """``manifest.json counts.rows``, ``train-00000-of-00002.arrow row 3 sequence 1 (src@7)``, ..."""
    what: str
    """The check that failed, with the expected and the actual value."""

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


@dataclasses.dataclass
class Report:
    folder: str
    problems: list[Problem] = dataclasses.field(default_factory=list)
    """The first :data:`MAX_KEPT_PROBLEMS` problems; :attr:`count` counts them all."""
    count: int = 0
    shards: int = 0
    rows: int = 0
    pieces: int = 0
    tokens: int = 0
    dead_letters: int = 0
    records: Optional[int] = None
    """Input records reconciled (``None`` without ``--inputs``)."""
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.count == 0

    def add(self, where: str, what: str) -> None:
        self.count += 1
        if len(self.problems) < MAX_KEPT_PROBLEMS:
            self.problems.append(Problem(where, what))

    def summary(self) -> str:
        s = (f"{self.folder}: {self.shards} shards, {self.rows:,} rows, {self.pieces:,} sequences, "
             f"{self.tokens:,} tokens, {self.dead_letters:,} dead letters")
        if self.records is not None:
            s += f"; {self.records:,} input records reconciled"
        return s + f" ({self.elapsed_s:.1f} s)"


def record_place(key: tuple) -> str:
    """``source:position (example id)`` of a dead letter's key ``(source, position, example id)``."""
    source, position, eid = key
    return show_path(f"{source}:{position}" + (f" ({eid})" if eid else ""))


def short(v: Any, limit: int = 80) -> str:
    """``repr(v)``, cut to ``limit`` characters."""
    s = repr(v)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def is_remote(folder: str) -> bool:
    return "://" in folder


def in_folder(folder: str, name: str) -> str:
    if "/" in name or "\\" in name or name in ("", ".", ".."):  # callers open only checked names
        raise InternalError(f"refusing to open {name!r}: not a plain file name inside {folder}")
    return _write.join(folder, name)
