"""About ``k`` records of one input, spread over all of it, read as the job reads them (``packstream estimate``).

Evenly spaced lines of a JSONL file (a big local one read twice: counted, then sampled), evenly spaced seeks
for a big remote one, evenly spaced rows of the row groups of a Parquet file
and of a datasets folder, a seeded reservoir for compressed JSONL (no seeking into the stream),
every record of a small JSONL file, a JSON array or an Arrow file (no seeking; the records at
evenly spaced places kept in one pass). Records are parsed by the job's own parser and restored by
its own row decoder, so a sampled record is the record the job reads (a Rejected where the job
would dead-letter it).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from pipeline._formats import Reason, Rejected
from pipeline._read._files import CorruptStream, InputFile, compression, hf_dataset, open_raw, read_blocks
from pipeline._read._json import record_of
from pipeline._read._lines import jsonl_texts, split_lines
from pipeline._read._tables import row_decoder, table_rows
from pipeline._read._tasks import corrupt_input, count_records, input_bytes, read_file, until_break

WHOLE_JSONL_BYTES = 32 * 2**20
"""JSONL files up to this size are read whole (exact count, exact even spacing)."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """About ``k`` records of one input, spread over it, and how many records it holds."""

    file: InputFile
    records: int
    """Records in the input: counted when ``exact``, else file bytes / sampled bytes per record."""
    exact: bool
    items: list
    """``(position, record or Rejected)``, as :func:`pipeline._read.read_file` yields them; a sample of a big
    remote JSONL file numbers each line by its byte offset / the mean sampled line length."""
    parsed: int
    """Records parsed to take the sample: ``len(items)``, or all of them for whole-file formats."""


def sample(f: InputFile, k: int, max_bytes: int, seed: int = 0) -> Sample:
    """About ``k`` records spread over input ``f`` (``k`` >= 1), and its record count."""
    if f.kind == "jsonl":
        items, n, exact = _jsonl(f, k, max_bytes, random.Random(seed))
    elif f.kind == "parquet":
        items, n, exact = _parquet(f, k, max_bytes)
    elif f.kind == "hf_disk":
        items, n, exact = _hf_disk(f, k, max_bytes)
    else:  # json, arrow, csv, text: no seeking; count, then keep the records at evenly spaced places in one pass
        try:
            n = count_records(f)
        except (OSError, EOFError, ValueError):  # it breaks off: count as the job reads it (the rest one record)
            n = sum(1 for _ in until_break(read_file(f, max_bytes)))
        wanted = set(_evenly(n, k))
        items = [(i, pos, rec) for i, (pos, rec) in enumerate(until_break(read_file(f, max_bytes)))]
        # a break's corrupt_input (the last item) is always kept: the run will dead-letter it
        items = [(pos, rec) for i, pos, rec in items if i in wanted or (i == len(items) - 1 and _is_break(rec))]
        return Sample(f, n, True, items, n)
    return Sample(f, n, exact, items, len(items))


def _is_break(record) -> bool:
    return isinstance(record, Rejected) and record.reason is Reason.CORRUPT_INPUT


def _evenly(n: int, k: int) -> list[int]:
    """``min(n, k)`` indices spread evenly over ``range(n)``."""
    if n <= k:
        return list(range(n))
    return sorted({int((i + 0.5) * n / k) for i in range(k)})


def _parse(lines: list, max_bytes: int) -> list:
    """Sampled JSONL lines parsed with the job's own record parser."""
    return [(pos, record_of(raw, max_bytes)) for pos, raw in lines]


def _jsonl(f: InputFile, k: int, max_bytes: int, rng: random.Random) -> tuple[list, int, bool]:
    """Lines are split and numbered by the job's own reader (:func:`pipeline._read._lines.jsonl_texts`: one
    line rule, lines past --max-record-bytes never held), so positions are the job's."""
    if compression(f.path) is not None:
        # No seeking into a compressed stream: one pass, counting lines and keeping a seeded reservoir.
        kept: list[tuple[int, "bytes | int"]] = []
        n, lineno, broken = 0, None, []
        try:
            for lineno, raw in jsonl_texts(f, max_bytes):
                n += 1
                if len(kept) < k:
                    kept.append((lineno, raw))
                else:
                    j = rng.randrange(n)
                    if j < k:
                        kept[j] = (lineno, raw)
        except CorruptStream as e:  # the rest is one corrupt_input, as the job reads it
            cut = corrupt_input(f, e, lineno)
            n, broken = n + 1, [(cut.rest_at, Rejected(Reason.CORRUPT_INPUT, str(cut)))]
        return _parse(sorted(kept), max_bytes) + broken, n, True
    size = input_bytes(f)
    if size <= WHOLE_JSONL_BYTES:
        lines = list(jsonl_texts(f, max_bytes))
        return _parse([lines[i] for i in _evenly(len(lines), k)], max_bytes), len(lines), True
    if "://" not in f.path:
        # A local file is counted in one pass anyway; a second takes evenly spaced lines. Seeks would choose lines
        # by the bytes before them: a file of long and short records in runs would be sampled long (issue 28: the
        # 6x shared mix's tokens were predicted twice over).
        n = sum(1 for _ in jsonl_texts(f, max_bytes))
        wanted = set(_evenly(n, k))
        return _parse([line for i, line in enumerate(jsonl_texts(f, max_bytes)) if i in wanted], max_bytes), n, True
    return _seek_lines(f, k, max_bytes, size)


def _seek_lines(f: InputFile, k: int, max_bytes: int, size: int) -> tuple[list, int, bool]:
    """A big plain JSONL file: seek to ``k`` evenly spaced offsets and take the line after each one. The line a
    seek lands in is chosen in proportion to its length; the line after it is not."""
    lines = []
    with open_raw(f.path) as fh:
        for i in range(k):
            offset = int((i + 0.5) * size / k)
            fh.seek(offset)
            found = split_lines(read_blocks(fh, size=64 * 2**10), max_bytes)
            if offset:
                next(found, None)  # the rest of the line the seek landed in
            raw = next((r for r in found if isinstance(r, int) or r.strip()), None)
            if raw is not None:
                lines.append((offset, raw))
    if not lines:
        return [], 0, True
    per_record = sum(raw if isinstance(raw, int) else len(raw) for _, raw in lines) / len(lines)
    if "://" not in f.path:
        records, exact = sum(1 for _ in jsonl_texts(f, max_bytes)), True
    else:
        records, exact = int(round(size / per_record)), False
    # Positions are line numbers in the job; here the offset's approximate line, one apart at least: two seeks may
    # land in one line longer than their spacing, and one place holds one record.
    numbered, last = [], 0
    for off, raw in lines:
        last = max(int(off / per_record) + 1, last + 1)
        numbered.append((last, raw))
    return _parse(numbered, max_bytes), records, exact


def _parquet(f: InputFile, k: int, max_bytes: int) -> tuple[list, int, bool]:
    """Rows restored as the job restores them (:func:`pipeline._read.table_rows`), one row group in memory at a
    time."""
    import pyarrow.parquet as pq

    with open_raw(f.path) as fh:
        pf = pq.ParquetFile(fh)
        decoder = row_decoder(pf.schema_arrow)
        n = pf.metadata.num_rows
        starts = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
        items, cache = [], {}
        for i in _evenly(n, k):
            g = int(np.searchsorted(starts, i, side="right") - 1)
            if g not in cache:
                cache = {g: table_rows(pf.read_row_group(g), max_bytes, decoder)}
            items.append((i, cache[g][i - starts[g]]))
    return items, n, True


def _hf_disk(f: InputFile, k: int, max_bytes: int) -> tuple[list, int, bool]:
    ds = hf_dataset(f)
    wanted = _evenly(len(ds), k)
    rows = table_rows(ds.with_format("arrow").select(wanted)[:], max_bytes, row_decoder(ds.features.arrow_schema))
    return list(zip(wanted, rows)), len(ds), True
