"""Readers: input paths -> ``(source, position, record)`` triples.

Inputs are files, globs or folders, local or anything Beam's ``FileSystems`` reads (gs://,
s3://). Supported (:data:`SUPPORTED`): JSONL (``.jsonl``, ``.ndjson``), JSON arrays (``.json``), CSV
(``.csv``), TSV (``.tsv``) and plain text (``.txt``), plain or compressed (``.gz``, ``.zst``, ``.xz``,
``.bz2``), Parquet, Arrow (IPC stream or file), and Hugging Face ``save_to_disk`` folders. Each input is checked against its name before the job
starts, so a mislabelled, empty or unsupported file is a clear CLI error naming the fix, not a
worker traceback. Every file is opened through :func:`packers.files.open_checked`.

Positions: 1-based line numbers for JSONL and text, row numbers for CSV/TSV (the header is row 1),
0-based row indices for everything else.
A record that cannot even be parsed comes out as a :class:`~pipeline._formats.Rejected`.

* ``_files``   kinds by name, the checked open, decompression, bytes in blocks
* ``_inputs``  files, globs and folders of every data set -> checked :class:`InputFile` s
* ``_lines``   the one line rule (LF, CRLF, lone CR) and the lines of a JSONL file
* ``_json``    one record's JSON text -> the record; the items of a JSON array, streamed
* ``_csv``     CSV and TSV rows -> records of their cells (pyarrow's streaming reader)
* ``_text``    plain text -> ``{"text": document}`` records, by ``--text-split``
* ``_tables``  Parquet, Arrow and datasets rows -> the records they hold
* ``_tasks``   read tasks: cutting the inputs for the workers, sizing them, reading each
* ``_packed``  a finished packed folder -> the examples its rows hold (the first brick of ``repack``)
* ``_sample``  about ``k`` records spread over one input, for ``estimate``
"""

from pipeline._read._files import COMPRESSIONS, CorruptStream, SUPPORTED, InputFile, compression, file_kind, open_raw, supported_text
from pipeline._read._inputs import Skipped, expand_datasets, expand_inputs, relative_input, rename_sources
from pipeline._read._csv import csv_header, csv_records, index_note


def index_notes(files) -> tuple[str, ...]:
    """The run's notes on CSV/TSV inputs whose first column has no name (read as an index, :func:`index_note`)."""
    return tuple(n for f in files if (n := index_note(f, 2**24)) is not None)
from pipeline._read._json import json_items, parse_line
from pipeline._read._text import text_records
from pipeline._read._lines import jsonl_texts, line_ends, split_lines
from pipeline._read._packed import PackedExample, open_folder, open_shard, packed_examples, rows_batch
from pipeline._read._sample import Sample, sample
from pipeline._read._tables import row_decoder, table_rows
from pipeline._read._tasks import (
    MIN_TASK_BYTES, TASK_BYTES, TASK_ROWS, TASKS_PER_WORKER, UNKNOWN_WORKERS, CorruptInput, ReadTask, count_records,
    cut_tasks, expected_records, input_bytes, read_file, read_task, read_tasks, task_bytes, task_count, until_break,
)

__all__ = [
    "COMPRESSIONS", "SUPPORTED", "InputFile", "compression", "file_kind", "open_raw", "supported_text",
    "Skipped", "expand_datasets", "expand_inputs", "relative_input", "rename_sources", "open_folder", "open_shard", "rows_batch", "csv_header", "csv_records", "index_note", "index_notes", "text_records", "json_items", "parse_line", "jsonl_texts", "line_ends", "split_lines",
    "Sample", "sample", "row_decoder", "table_rows", "MIN_TASK_BYTES", "TASK_BYTES", "TASK_ROWS", "TASKS_PER_WORKER",
    "UNKNOWN_WORKERS", "CorruptInput", "ReadTask", "count_records", "cut_tasks", "expected_records", "input_bytes",
    "read_file", "read_task", "PackedExample", "packed_examples", "read_tasks", "task_bytes", "task_count", "until_break", "CorruptStream",
]
