"""Lines: one rule everywhere.

A line ends at LF, CRLF or a lone CR (old Mac files), exactly the line ends of Python's
``bytes.splitlines``. Raw CR and LF cannot occur inside a JSON value, so splitting at either
never cuts a record. The readers split with :func:`split_lines`; cutting read tasks and counting
records count with :func:`line_ends`; tests hold the two equal over random bytes cut at random
places, so every task numbers its lines as one pass over the whole file would.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional

from pipeline._read._files import BOM, InputFile, open_bytes, read_blocks


def line_ends(buf: bytes, start: int = 0, stop: Optional[int] = None, after_cr: bool = False) -> int:
    """The number of line ends in ``buf[start:stop]`` (LF, CRLF, lone CR; a CRLF counts once).

    ``after_cr``: the byte before ``start`` was a CR, so an LF at ``start`` completes a CRLF that
    was already counted.

    >>> line_ends(b"a\\nb\\r\\nc\\rd\\r\\r\\n"), line_ends(b"\\nx", after_cr=True)
    (5, 0)
    """
    stop = len(buf) if stop is None else stop
    n = buf.count(b"\n", start, stop) + buf.count(b"\r", start, stop) - buf.count(b"\r\n", start, stop)
    if after_cr and start < stop and buf[start] == 0x0A:
        n -= 1
    return n


def split_lines(blocks: Iterable[bytes], max_bytes: int) -> Iterator["bytes | int"]:
    """Each line of a byte stream, without its line end (see :func:`line_ends` for the rule).

    A line longer than ``max_bytes`` comes out as its length (an ``int``), and is never held
    whole: memory stays within ``max_bytes`` plus one block, whatever the file holds (a file of
    one 10 GB line, a file of lone CRs read as one line by ``readline``).

    >>> list(split_lines([b"a\\r", b"\\nbb\\rc", b"ccc\\n\\n"], max_bytes=3))
    [b'a', b'bb', 4, b'']
    """
    pending = b""  # the start of a line whose end is not read yet
    skipped = 0  # the length so far of a line too long to hold (pending is then empty)
    after_cr = False  # the last block ended with a CR: an LF starting the next one completes that CRLF
    for block in blocks:
        if after_cr and block[:1] == b"\n":
            block = block[1:]
        data = pending + block if pending else block
        if not skipped and b"\r" not in data:  # the common case, LF only: split and hand over in C
            parts = data.split(b"\n")
            pending, after_cr = parts.pop(), False
            if parts and max(map(len, parts)) <= max_bytes:
                yield from parts
            else:
                yield from (p if len(p) <= max_bytes else len(p) for p in parts)
            if len(pending) > max_bytes:
                skipped, pending = len(pending), b""
            continue
        parts = data.splitlines(keepends=True)
        pending = parts.pop() if parts and parts[-1][-1:] not in (b"\n", b"\r") else b""
        after_cr = bool(parts) and not pending and parts[-1][-1:] == b"\r"
        for part in parts:
            body = part[:-2] if part[-2:] == b"\r\n" else part[:-1]
            if skipped:
                yield skipped + len(body)
                skipped = 0
            else:
                yield body if len(body) <= max_bytes else len(body)
        if len(pending) > max_bytes:
            skipped += len(pending)
            pending = b""
    if skipped:
        yield skipped + len(pending)
    elif pending:
        yield pending if len(pending) <= max_bytes else len(pending)


def _numbered(fh, first_line: int, limit: Optional[int], max_bytes: int) -> Iterator[tuple[int, "bytes | int"]]:
    """``(line number, bytes or length)`` of each line in the next ``limit`` bytes of ``fh`` (None: to the end)."""
    return enumerate(split_lines(read_blocks(fh, limit), max_bytes), start=first_line)


def jsonl_texts(f: InputFile, max_bytes: int, start: int = 0, stop: Optional[int] = None,
                first_line: int = 1) -> Iterator[tuple[int, "bytes | int"]]:
    """``(line number, text or size)`` of each non-blank line of bytes ``start:stop`` of a JSONL file
    (a byte-order mark before line 1 is not part of it)."""
    with open_bytes(f.path) as fh:
        if start:
            fh.seek(start)
        for lineno, raw in _numbered(fh, first_line, None if stop is None else stop - start, max_bytes):
            if lineno == 1 and isinstance(raw, bytes) and raw.startswith(BOM):
                raw = raw[len(BOM):]
            if isinstance(raw, int) or raw.strip():  # blank lines are not records
                yield lineno, raw

