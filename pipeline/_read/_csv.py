"""CSV and TSV: rows -> records whose fields are the columns, streamed by pyarrow's CSV reader.

Every column is read as bytes (``pa.binary()``, so ``00123`` or ``true`` is never retyped) and
decoded here cell by cell, so a cell that is not UTF-8 costs its row alone. The rules::

    id,instruction,output                 row 1: the header; its names are the records' keys
    7,"Add 2, 3","5"                      row 2 -> {"id": "7", "instruction": "Add 2, 3", "output": "5"}
    8,Say hi,"Hi,                         row 3 -> one record: a quoted cell may hold commas, "" and
    there"                                         line ends (newlines_in_values)
    9,,4                                  row 4 -> {"id": "9", "output": "4"}: an empty cell is a missing field
    10,only two                           row 5 -> a malformed_row dead letter (2 cells, the header has 3)

    ,prompt,completion                    a first column with no name (DataFrame.to_csv's index): read under
    0,hi,there                            "Unnamed: 0", as pandas and datasets key it, an ignored field (counted),
                                          and the run's notes say so; any other unnamed column is refused

Positions are row numbers as a spreadsheet shows them: the header is row 1, a quoted multi-line cell
is one row, blank lines are no rows. A ``.tsv`` follows the same rules with a tab between cells
(quotes included, as HF ``datasets`` reads it). pyarrow numbers the rows it refuses (wrong cell
count, an unterminated quote that runs to the end) only when it reads on one thread, so it does;
a file is one read task (quoted line ends make a byte cut unsafe).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from packers import InternalError, PackstreamError
from packers.files import show_path
from pipeline._formats import Reason, Rejected, Row
from pipeline._read._files import CorruptStream, InputFile, file_kind, open_bytes

_MIN_BLOCK = 1 << 20
INDEX = "Unnamed: 0"
"""The key of an unnamed first column (the index ``DataFrame.to_csv()`` writes), as pandas and ``datasets`` key it."""


def _options(path: str, max_bytes: int, refused: "list | None", names: "list[str] | None" = None):
    import pyarrow as pa
    import pyarrow.csv as pc

    # A row must fit in one block: blocks are a bit bigger than the largest record, so a row over
    # --max-record-bytes is measured and refused on its own (a row over the block stops the file: corrupt_input).
    block = max(_MIN_BLOCK, min(max_bytes + _MIN_BLOCK, 2**31 - 1))
    handler = None if refused is None else (lambda row: refused.append(row) or "skip")
    return dict(
        read_options=pc.ReadOptions(block_size=block, use_threads=False),
        parse_options=pc.ParseOptions(delimiter="\t" if _is_tsv(path) else ",", newlines_in_values=True,
                                      invalid_row_handler=handler),
        convert_options=pc.ConvertOptions(column_types={n: pa.binary() for n in names or ()},
                                          strings_can_be_null=False, quoted_strings_can_be_null=False),
    )


def _is_tsv(path: str) -> bool:
    return file_kind(path) == "tsv"


@contextlib.contextmanager
def _reader(f: InputFile, max_bytes: int, refused: "list | None", names: "list[str] | None" = None):
    """pyarrow's reader of the file, and the stream it reads: a compressed one ends at a break (its
    :attr:`~pipeline._read._files.Decompressed.broken` set), so the rows before it are parsed, not dropped with
    the block the break falls in; the caller raises the break once it has handed them over."""
    import pyarrow.csv as pc

    with open_bytes(f.path, at_break="end") as fh:
        try:
            yield pc.open_csv(fh, **_options(f.path, max_bytes, refused, names)), fh
        except ValueError:  # ArrowInvalid on the bytes a break cut short: the break is the cause
            _raise_break(fh)
            raise


def _raise_break(fh: Any) -> None:
    """Raise the decompressor's error if the stream broke off (a :class:`CorruptStream`: a corrupt_input)."""
    broken = getattr(fh, "broken", None)
    if broken is not None:
        raise broken from None


def csv_header(f: InputFile, max_bytes: int) -> list[str]:
    """The column names of a CSV/TSV input; a header packstream cannot key records by is one error line (a
    stream that breaks off inside it raises :class:`CorruptStream`)."""
    where = show_path(f.path)
    try:
        with _reader(f, max_bytes, []) as (r, _):
            names = list(r.schema.names)
    except CorruptStream:
        raise
    except (ValueError, OSError) as e:  # ArrowInvalid (a ValueError), a header that is not UTF-8
        raise PackstreamError(f"input {where}: cannot read its header row ({str(e).splitlines()[0]}); the first row of "
                              "a CSV/TSV file names its columns") from None
    for i, n in enumerate(names):
        if not n.strip() and i == 0 and len(names) > 1 and INDEX not in names:
            continue  # an index (DataFrame.to_csv's): the records key it INDEX, a field no format reads
        if not n.strip():
            raise PackstreamError(f"input {where}: column {i + 1} of the header row has no name; name every column "
                                  f"(the header is {names[:8]})")
        if n in names[:i]:
            raise PackstreamError(f"input {where}: two columns are named {n!r}; rename one (each column is a field "
                                  "of the record)")
    return names


def index_note(f: InputFile, max_bytes: int) -> "str | None":
    """The run's note on a CSV/TSV input whose first column has no name, or None: the column is read as the
    index ``DataFrame.to_csv()`` writes by default, keyed ``Unnamed: 0`` as pandas and ``datasets`` key it, and
    counted as an ignored field of every record (the summary's ``fields ignored``)."""
    if file_kind(f.path) not in ("csv", "tsv"):
        return None
    names = csv_header(f, max_bytes)
    if names and not names[0].strip():
        return (f"{show_path(f.path)}: its first column has no name, read as an index (what DataFrame.to_csv() "
                f"writes) under the key {INDEX!r} and not packed; name the column to have it read")
    return None


def _record(row: dict, number: int, max_bytes: int) -> Any:
    """One row's cells (bytes) -> the record (empty cells left out), or a Rejected."""
    size = sum(len(v) for v in row.values())
    if size > max_bytes:
        return Rejected(Reason.RECORD_TOO_LARGE, f"row {number}: {size} bytes > --max-record-bytes {max_bytes}")
    out, empty = {}, []
    for name, value in row.items():
        name = name if name.strip() else INDEX  # only a first column may have no name (csv_header)
        if not value:
            empty.append(name)
            continue
        try:
            out[name] = value.decode("utf-8")
        except UnicodeDecodeError as e:
            return Rejected(Reason.INVALID_UTF8, f"row {number}, column {name!r}: byte {e.start}: {e.reason}; save "
                                                 "the file as UTF-8")
    return Row(out, empty) if empty else out  # a Row names its empty cells: a refusal for one can name it


def _malformed(row: Any, width: int) -> Rejected:
    text = row.text if len(row.text) <= 80 else row.text[:77] + "..."
    why = ("an unterminated quote runs past it (a quote opens a cell that never closes)" if row.actual_columns < width
           and row.text.count('"') % 2 else f"it holds {row.actual_columns} cells, the header {width}")
    return Rejected(Reason.MALFORMED_ROW, f"row {row.number}: {why}: {text!r}; fix the row (quote a cell that holds "
                                          "the delimiter, a quote or a line end, doubling its quotes)")


def csv_records(f: InputFile, max_bytes: int) -> Iterator[tuple[int, Any]]:
    """``(row number, record or Rejected)`` of every row of a CSV/TSV input, in file order; a compressed file that
    breaks off raises :class:`CorruptStream` after the rows before the break (the row the break falls in is
    part of the rest: it may be cut short, and a cut cell would pack as a shorter answer)."""
    names = csv_header(f, max_bytes)
    refused: list = []  # rows pyarrow skipped, appended as it parses (before the batch that follows them)
    with _reader(f, max_bytes, refused, names) as (reader, fh):
        held = None  # the last row so far: handed over once the stream goes on past it
        for item in _rows(reader, refused, names, max_bytes):
            if held is not None:
                yield held
            held = item
        _raise_break(fh)
        if held is not None:
            yield held


def _rows(reader: Any, refused: list, names: list[str], max_bytes: int) -> Iterator[tuple[int, Any]]:
    number = 1  # the last row number handed out (the header's)
    bad: dict[int, Any] = {}
    for batch in reader:
        bad.update(_numbered(refused))
        refused.clear()
        for row in batch.to_pylist():
            number += 1
            while number in bad:
                yield number, _malformed(bad.pop(number), len(names))
                number += 1
            yield number, _record(row, number, max_bytes)
    bad.update(_numbered(refused))
    for n in sorted(bad):
        yield n, _malformed(bad[n], len(names))


def _numbered(rows: list) -> dict[int, Any]:
    out = {}
    for row in rows:
        if row.number is None or row.number < 0:  # only a multi-threaded read leaves rows unnumbered
            raise InternalError("pyarrow's CSV reader did not number a refused row (use_threads must be off)")
        out[row.number] = row
    return out


def csv_count(f: InputFile, max_bytes: int) -> int:
    """Rows of a CSV/TSV input (refused ones included), parsed but not decoded."""
    refused: list = []
    with _reader(f, max_bytes, refused, csv_header(f, max_bytes)) as (reader, _):  # a break: the rows before it
        return sum(b.num_rows for b in reader) + len(refused)
