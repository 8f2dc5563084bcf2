"""Read tasks: pieces of the inputs that workers read, their sizes, and the records of each.

Positions: 1-based line numbers for JSONL and text, spreadsheet row numbers for CSV/TSV (the header is
row 1), 0-based row indices for everything else. A CSV/TSV or text file is one task: a quoted cell may
hold line ends, so no byte cut is safe without parsing from the start. A record that
cannot even be parsed comes out as a :class:`~pipeline._formats.Rejected`; a file that breaks off
mid-way raises :class:`CorruptInput`.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Iterable, Iterator, Optional, Sequence

from packers import PackstreamError
from pipeline._read._csv import csv_count, csv_records
from pipeline._formats import Reason, Rejected
from pipeline._read._files import CorruptStream, InputFile, compression, hf_dataset, open_bytes, open_raw, read_blocks
from pipeline._read._json import json_records, json_texts, jsonl_records
from pipeline._read._text import text_count, text_records
from pipeline._read._lines import line_ends
from pipeline._read._tables import table_batches


@dataclasses.dataclass(frozen=True)
class ReadTask:
    """A piece of one input that one worker reads: bytes ``start:stop`` of a JSONL file (beginning
    at line ``first``), rows ``start:stop`` of a table, or the whole file (``stop`` None)."""

    file: InputFile
    start: int = 0
    stop: Optional[int] = None
    first: int = 1

    @property
    def name(self) -> str:
        """Stable and unique within a run: names the task's spill files and dead-letter part."""
        import hashlib

        return hashlib.blake2b(f"{self.file.path}\0{self.file.split}\0{self.start}".encode(), digest_size=6).hexdigest()


TASK_BYTES = 8 * 2**20
"""A JSONL file is read in tasks of at most about this many bytes (cut at line ends), so that one
big file spreads over every worker; each task also bounds what a worker holds at once."""
MIN_TASK_BYTES = 512 * 2**10
"""Smaller tasks than this cost more in per-task work (a spill file per task, a tokenizer pipeline
that fills and drains) than they gain in balance."""
TASKS_PER_WORKER = 8
"""Read tasks wanted per worker: the local runner deals them, biggest first, to whichever worker is idle, so
the workers finish within about one small task of each other; a Beam runner may deal them up front."""
UNKNOWN_WORKERS = 32
"""The workers assumed where the launcher cannot know them (a cluster): 256 tasks for a big input."""


def task_bytes(input_bytes: float, workers: Optional[int] = None, scale: float = 1.0) -> int:
    """The JSONL task size of a run over ``input_bytes`` bytes of input on ``workers`` workers (None:
    unknown): about :data:`TASKS_PER_WORKER` tasks per worker, within [MIN_TASK_BYTES, TASK_BYTES];
    one worker reads the biggest tasks. ``scale``: the run's work per input byte (a ``--processor`` run's
    images: :class:`pipeline._media.Work`), with ``input_bytes`` its work in bytes of text; the sizes above
    bound a task's work, and the task is cut that much smaller in the file's own bytes.

    The output does not depend on it: a group's examples are sorted by id before packing.

    >>> task_bytes(35 * 2**20, 2) // 2**10, task_bytes(35 * 2**20, 16) // 2**10, task_bytes(10**12) // 2**20
    (2240, 512, 8)
    >>> task_bytes(9 * 2**20, 2, scale=300.0)    # 30 KiB of image records with 9 MiB of text's work: 16 tasks
    1966
    """
    if workers == 1:  # nothing to balance: the fewest tasks (each fills and drains the tokenizer pipeline once)
        return max(1, int(TASK_BYTES / scale))
    wanted = max(1, workers or UNKNOWN_WORKERS) * TASKS_PER_WORKER
    return max(1, int(min(TASK_BYTES, max(MIN_TASK_BYTES, input_bytes // wanted)) / scale))
TASK_ROWS = 65_536
"""Rows per task for Parquet (whole row groups) and datasets folders."""


def cut_tasks(f: InputFile, task_bytes: Optional[int] = None) -> list[ReadTask]:
    """The read tasks of one input (``task_bytes``: :data:`TASK_BYTES`, read at call time).

    A JSONL file is cut right after an LF at about every ``task_bytes`` bytes, and each task
    starts with the number of its first line, counted by the one line rule (:func:`line_ends`:
    LF, CRLF and lone CR end lines) that the readers split by, so every task numbers its lines
    as one pass over the whole file would. One byte scan, no parsing.
    """
    task_bytes = task_bytes or TASK_BYTES
    if f.kind == "jsonl" and compression(f.path) is None:
        tasks, start, line, pos, ends, after_cr = [], 0, 1, 0, 0, False
        with open_raw(f.path) as fh:
            for block in read_blocks(fh, size=8 * 2**20):
                cut = 0  # line ends of block[:cut] are counted
                while True:
                    nl = block.find(b"\n", max(cut, start + task_bytes - 1 - pos))
                    if nl < 0:
                        break
                    ends += line_ends(block, cut, nl + 1, after_cr if cut == 0 else block[cut - 1] == 0x0D)
                    tasks.append(ReadTask(f, start, pos + nl + 1, line))
                    line, ends, start, cut = line + ends, 0, pos + nl + 1, nl + 1
                ends += line_ends(block, cut, None, after_cr if cut == 0 else block[cut - 1] == 0x0D)
                after_cr = block[-1] == 0x0D
                pos += len(block)
        if start < pos or not tasks:
            tasks.append(ReadTask(f, start, None, line))
        return tasks
    if f.kind in ("parquet", "hf_disk"):
        try:
            return [ReadTask(f, a, b) for a, b in _row_ranges(f)]
        except (OSError, ValueError):  # a damaged file: one task, whose reader turns it into a dead letter
            return [ReadTask(f)]
    return [ReadTask(f)]


def task_count(f: InputFile, records: int, task_bytes: int) -> int:
    """About how many read tasks :func:`cut_tasks` cuts an input of ``records`` records into, without reading it."""
    if f.kind == "jsonl" and compression(f.path) is None:
        return max(1, math.ceil(input_bytes(f) / task_bytes))
    if f.kind in ("parquet", "hf_disk"):
        return max(1, math.ceil(records / TASK_ROWS))
    return 1


def _row_ranges(f: InputFile) -> list[tuple[int, Optional[int]]]:
    if f.kind == "hf_disk":
        n = count_records(f)
        return [(a, min(a + TASK_ROWS, n)) for a in range(0, max(n, 1), TASK_ROWS)]
    import pyarrow.parquet as pq

    with open_raw(f.path) as fh:
        meta = pq.ParquetFile(fh).metadata
    out, start, first = [], 0, 0
    for g in range(meta.num_row_groups):
        first += meta.row_group(g).num_rows
        if first - start >= TASK_ROWS:
            out.append((start, first))
            start = first
    out.append((start, None))
    return out


def count_records(f: InputFile) -> int:
    """Records in one input, as cheaply as the format allows (the progress total and the group count)."""

    if f.kind == "jsonl":
        n, last, after_cr = 0, b"\n", False
        with open_bytes(f.path) as fh:
            for block in read_blocks(fh, size=8 * 2**20):
                n += line_ends(block, after_cr=after_cr)
                last, after_cr = block[-1:], block[-1] == 0x0D
        # a last line without a line end is a record too (blank lines count: this is an estimate)
        return n + (last not in (b"\n", b"\r"))
    if f.kind == "parquet":
        import pyarrow.parquet as pq

        with open_raw(f.path) as fh:
            return pq.ParquetFile(fh).metadata.num_rows
    if f.kind == "hf_disk":
        return len(hf_dataset(f))
    if f.kind == "json":
        return sum(1 for _ in json_texts(f, 2**31 - 1))  # split, not parsed
    if f.kind in ("csv", "tsv"):
        return csv_count(f, 16 * 2**20)  # parsed, not decoded
    if f.kind == "text":
        return text_count(f, 16 * 2**20)
    return sum(1 for _ in read_file(f, 2**31 - 1))


def input_bytes(f: InputFile) -> int:
    """An input's size in bytes, as the job sizes groups and shards from it (a datasets folder, or an
    input that cannot be sized, counts 0)."""
    if f.kind == "hf_disk":
        return 0
    from pipeline import _fs

    try:
        return _fs.size(f.path)
    except Exception:  # noqa: BLE001 - an unsizable input adds nothing; the reader reports what is wrong with it
        return 0


def read_tasks(files: Sequence[InputFile], input_bytes: float, workers: int, scale: float = 1.0) -> int:
    """About how many read tasks a local run on ``workers`` workers cuts ``files`` into (``input_bytes``: their
    total size; with ``scale``, their work, as :func:`task_bytes` takes them), without reading them: what
    ``--workers auto`` starts at most workers for."""
    size = task_bytes(input_bytes, workers, scale)
    return sum(task_count(f, expected_records(f) if f.kind in ("parquet", "hf_disk") else 0, size) for f in files)


def expected_records(f: InputFile) -> int:
    """Records in one input for sizing a run: counted where that is cheap (local files, Parquet and datasets
    folders anywhere), else about one per KiB."""
    if "://" not in f.path or f.kind in ("parquet", "hf_disk"):
        try:
            return count_records(f)
        except Exception:  # noqa: BLE001 - the count only sizes groups; a corrupt file is reported by the reader
            pass
    return max(1, input_bytes(f) // 1024)


def read_task(t: ReadTask, max_bytes: int) -> Iterator[tuple[int, Any]]:
    """``(position, record or Rejected)`` for every record of one task (see :func:`read_file`)."""
    f = t.file
    position = None
    try:
        if f.kind == "jsonl":
            records = jsonl_records(f, max_bytes, t.start, t.stop, t.first)
        elif f.kind == "json":
            records = json_records(f, max_bytes)
        elif f.kind in ("csv", "tsv"):
            records = csv_records(f, max_bytes)
        elif f.kind == "text":
            records = text_records(f, max_bytes)
        else:
            records = enumerate((row for rows in table_batches(f, max_bytes, t.start, t.stop) for row in rows), start=t.start)
        for position, record in records:
            yield position, record
    except PackstreamError:
        raise
    except (OSError, EOFError, ValueError, zlib.error) as e:  # ArrowInvalid is a ValueError, ArrowIOError an OSError
        # (a compressed stream's every error is a CorruptStream, an OSError: pipeline._read._files.Decompressed)
        raise corrupt_input(f, e, position) from None


def corrupt_input(f: InputFile, e: BaseException, position: Optional[int]) -> "CorruptInput":
    """The :class:`CorruptInput` of input ``f`` breaking off with ``e`` after ``position`` (None: at the start)."""
    after = "at the start" if position is None else f"after position {position}"
    what, detail = (e.cause, e.detail) if isinstance(e, CorruptStream) else (type(e).__name__, e)
    return CorruptInput(f"input {f.path} is corrupt or truncated ({what} {after}: {detail}); re-create or remove "
                        "the file", position)


class CorruptInput(PackstreamError):
    """An input that breaks off mid-way (a truncated gzip, Parquet or Arrow file); ``position`` is the last good one."""

    def __init__(self, message: str, position: Optional[int]):
        super().__init__(message)
        self.position = position

    @property
    def rest_at(self) -> int:
        """The position of the dead letter that stands for the rest of the file: the one after the last good
        record (0 when none was read)."""
        return 0 if self.position is None else self.position + 1


def until_break(items: Iterable[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
    """The items of :func:`read_file` or :func:`read_task`, a break ending them with the ``corrupt_input``
    :class:`~pipeline._formats.Rejected` that the job dead-letters at its place (``preview``, ``estimate``)."""
    try:
        yield from items
    except CorruptInput as e:
        yield e.rest_at, Rejected(Reason.CORRUPT_INPUT, str(e))


def read_file(f: InputFile, max_bytes: int) -> Iterator[tuple[int, Any]]:
    """``(position, record or Rejected)`` for every record of one input.

    A file that breaks off mid-way (a truncated gzip, Parquet or Arrow file) raises
    :class:`CorruptInput` naming the file and the last good position.
    """
    yield from read_task(ReadTask(f), max_bytes)
