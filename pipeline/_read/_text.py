"""Plain text (``.txt``): documents -> ``{"text": document}`` records, read as the ``text`` shape (every token
trained; ``--field text=...`` maps them like any record).

``--text-split`` says what one document is (lines by the one line rule of :mod:`pipeline._read._lines`)::

    line       every line is a document            position: its line number
    paragraph  runs of non-blank lines, split at    position: the line number of its first line
               blank lines; lines joined with LF
    file       the whole file, line ends as LF      position: 1

A blank document (``line``: a line of whitespace only; ``file``: a file of whitespace only) is a
``blank_text`` dead letter, never skipped in silence; under ``paragraph`` blank lines are what
separates documents. A document over ``--max-record-bytes`` is a ``record_too_large`` dead
letter, measured and never held whole; a document that is not UTF-8 is ``invalid_utf8``.
"""

from __future__ import annotations

from typing import Any, Iterator

from pipeline._formats import Reason, Rejected
from pipeline._read._files import BOM, InputFile, open_bytes, read_blocks
from pipeline._read._lines import split_lines

SPLITS = ("line", "paragraph", "file")
"""The values of ``--text-split`` (:class:`pipeline._options.TextSplit`), the first the default."""


def _lines(f: InputFile, max_bytes: int) -> Iterator[tuple[int, "bytes | int"]]:
    """``(line number, bytes or length)`` of every line (a byte-order mark before line 1 is not part of it)."""
    with open_bytes(f.path) as fh:
        for n, raw in enumerate(split_lines(read_blocks(fh), max_bytes), start=1):
            if n == 1 and isinstance(raw, bytes) and raw.startswith(BOM):
                raw = raw[len(BOM):]
            yield n, raw


def _document(parts: list, size: int, max_bytes: int, what: str) -> Any:
    """The record of a document's lines (bytes), or a Rejected."""
    if size > max_bytes:
        return Rejected(Reason.RECORD_TOO_LARGE, f"{what}: {size} bytes > --max-record-bytes {max_bytes}; raise "
                                                 "--max-record-bytes, or split the text finer (--text-split)")
    raw = b"\n".join(parts)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Rejected(Reason.INVALID_UTF8, f"{what}: byte {e.start}: {e.reason}; save the file as UTF-8")
    if not text.strip():
        fix = ("blank lines separate documents under --text-split paragraph" if what.startswith("line")
               else "remove the file from the inputs")
        return Rejected(Reason.BLANK_TEXT, f"{what} holds only whitespace: no document to train on; {fix}")
    return {"text": text}


def text_records(f: InputFile, max_bytes: int) -> Iterator[tuple[int, Any]]:
    """``(position, record or Rejected)`` of every document of a ``.txt`` input, split by ``f.text_split``."""
    split = f.text_split or SPLITS[0]
    if split == "line":
        for n, raw in _lines(f, max_bytes):
            size = raw if isinstance(raw, int) else len(raw)
            yield n, _document([] if isinstance(raw, int) else [raw], size, max_bytes, f"line {n}")
        return
    if split == "file":
        parts, size = [], 0
        for n, raw in _lines(f, max_bytes):
            size += (raw if isinstance(raw, int) else len(raw)) + (n > 1)
            if size <= max_bytes and isinstance(raw, bytes):
                parts.append(raw)
            else:
                parts = []
        yield 1, _document(parts, size, max_bytes, "the file")
        return
    yield from _paragraphs(f, max_bytes)


def _paragraphs(f: InputFile, max_bytes: int) -> Iterator[tuple[int, Any]]:
    first, parts, size = 0, [], 0
    for n, raw in _lines(f, max_bytes):
        if isinstance(raw, bytes) and not raw.strip():
            if first:
                yield first, _document(parts, size, max_bytes, f"the paragraph at line {first}")
            first, parts, size = 0, [], 0
            continue
        size += (raw if isinstance(raw, int) else len(raw)) + bool(first)
        first = first or n
        if size <= max_bytes and isinstance(raw, bytes):
            parts.append(raw)
        else:
            parts = []  # too large: measured on, never held
    if first:
        yield first, _document(parts, size, max_bytes, f"the paragraph at line {first}")


def text_count(f: InputFile, max_bytes: int) -> int:
    """Documents of a ``.txt`` input (blank ones included), without decoding them."""
    split = f.text_split or SPLITS[0]
    if split == "file":
        return 1
    if split == "line":
        return sum(1 for _ in _lines(f, max_bytes))
    n, inside = 0, False
    for _, raw in _lines(f, max_bytes):
        blank = isinstance(raw, bytes) and not raw.strip()
        n += not blank and not inside
        inside = not blank
    return n
