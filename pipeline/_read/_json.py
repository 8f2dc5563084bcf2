"""JSON records: one parser for every record's text, and the JSONL and JSON-array readers.

:func:`parse_line` turns one record's bytes into the record, or a
:class:`~pipeline._formats.Rejected` saying why not. A JSONL file's records are its non-blank
lines (:func:`pipeline._read._lines.jsonl_texts`); a ``.json`` file's are the items of its array,
split off one at a time by :func:`json_items` and parsed each on its own, or its one object.
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any, Iterable, Iterator, Optional

import orjson

from packers.files import MAX_JSON_DEPTH, value_depth
from pipeline._formats import Reason, Rejected
from pipeline._read._files import BOM, InputFile, open_bytes, read_blocks
from pipeline._read._lines import jsonl_texts


def _too_large(size: int, max_bytes: int) -> Rejected:
    return Rejected(Reason.RECORD_TOO_LARGE, f"{size} bytes > --max-record-bytes {max_bytes}")


_DIGITS = bytes.maketrans(b"0123456789", b"9999999999")
_LONG_DIGITS = b"9" * 19
"""orjson turns an integer beyond 64 bits (-2**63 .. 2**64-1) into a float, silently (an id
18446744073709551617 would read as 1.8446744073709552e+19): every such integer has 19 digits or
more, so a record with a run of 19 digits is parsed again by ``json``, whose integers are exact."""


def _too_deep(depth: "int | None" = None) -> Rejected:
    how = f"{depth} levels deep, deeper" if depth else "deeper"
    return Rejected(Reason.MALFORMED_JSON, f"nested {how} than the {MAX_JSON_DEPTH} levels packstream reads; "
                                           "flatten the record")


def _checked(record: Any, raw: bytes) -> Any:
    """``record``, or a Rejected when it nests deeper than :data:`packers.files.MAX_JSON_DEPTH` (counted on the
    parsed value, breadth first and stopping past the bound; only when its text holds that many brackets)."""
    if len(raw) > 2 * MAX_JSON_DEPTH and raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        depth = value_depth(record)
        if depth > MAX_JSON_DEPTH:
            return _too_deep()
    return record


def parse_line(raw: bytes, max_bytes: int, first: bool = False) -> Any:
    """One record's JSON text -> the record, or a Rejected saying why not. ``first``: the start of its file.

    The one parser of every JSON record: JSONL lines, the items of a JSON array, and the sampled
    lines of ``estimate``. orjson parses the common case (several times faster than ``json``);
    anything it refuses is parsed again by ``json`` for the exact error, a byte-order mark, NaN,
    or a lone surrogate. Whatever a parser refuses costs this record alone: invalid UTF-8, bad
    JSON, nesting deeper than :data:`packers.files.MAX_JSON_DEPTH` (orjson stops at 1,024 levels
    and ``json`` at Python's recursion limit, both in C), an integer of more digits than Python
    converts. Integers stay exact at any size (see :data:`_LONG_DIGITS`).
    """
    if len(raw) > max_bytes:
        return _too_large(len(raw), max_bytes)
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    else:
        if _LONG_DIGITS not in raw.translate(_DIGITS):
            return _checked(record, raw)
    try:
        # utf-8-sig on the first line: a byte-order mark is not part of the first record.
        text = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as e:
        return Rejected(Reason.INVALID_UTF8, f"byte {e.start}: {e.reason}")
    try:
        record = json.loads(text.rstrip("\r\n"))  # so that e.colno counts within this line
    except json.JSONDecodeError as e:
        return Rejected(Reason.MALFORMED_JSON, f"{e.msg} at column {e.colno}")
    except RecursionError:
        return _too_deep()
    except ValueError as e:  # an integer of more than 4,300 digits (Python's int() limit), or another refusal
        words = str(e).split(";")[0]
        if "digits" in words:
            words = f"holds a number longer than Python reads ({words}); store it as a string"
        return Rejected(Reason.MALFORMED_JSON, words)
    record = _checked(record, raw)
    return (_lone_surrogate(record) if _may_hold_surrogates(raw) else None) or record


def _may_hold_surrogates(raw: bytes) -> bool:
    return b"\\ud" in raw or b"\\uD" in raw


def _lone_surrogate(value: Any) -> "Rejected | None":
    """A Rejected if ``value`` holds a lone surrogate, else None.

    JSON can escape a lone UTF-16 surrogate (``"\\udfff"``) and Python decodes it into a ``str``
    that is not valid Unicode. Beam's coders (between steps) and the Rust tokenizer both fail on
    it, taking the whole job down, so the record is dead-lettered before it leaves the reader.
    Only records whose raw bytes hold a ``\\ud`` escape are checked (:func:`_may_hold_surrogates`).
    """
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return Rejected(
            Reason.INVALID_UTF8,
            f"the record holds a lone surrogate {e.object[e.start]!r} (an unpaired \\ud800-\\udfff escape is not valid Unicode)",
        )
    except (RecursionError, ValueError):
        return None
    return None


# ---------------------------------------------------------------------------------------
# JSON files, streamed: one item at a time


class _JsonLines(Exception):
    """A ``.json`` file that holds JSON lines (several values, no array): read it as JSONL."""


_STRING = rb'"[^"\\]*(?:\\.[^"\\]*)*"'
_SKIP_ITEM = re.compile(rb'(?:' + _STRING + rb'|[^\[\]{}",]+)*', re.S)
"""Bytes at an array's level that end no item: whole strings and anything but brackets, commas and quotes."""
_SKIP_INNER = re.compile(rb'(?:' + _STRING + rb'|[^\[\]{}"]+)*', re.S)
"""Bytes inside an item's brackets that change no depth: whole strings and anything but brackets and quotes."""
_STRING_BODY = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.S)
"""The rest of a string up to its closing quote (or up to a backslash that ends the block)."""

def json_items(blocks: Iterable[bytes], max_bytes: int, wrapped: bool = False) -> Iterator["bytes | int | Rejected"]:
    """The text of each item of the JSON array in a byte stream, one at a time::

        [ {"text": "a, [b]"} ,  {"text": "c"} , 7 ]        the bytes
          '-- item 0 ------'   '-- item 1 --'  '-'       what comes out

    A streaming splitter: it follows strings and brackets and never parses a value, so memory
    holds one item (at most ``max_bytes`` plus one block) whatever the size of the file; each
    item is then parsed on its own by :func:`parse_line`, so an item that a parser refuses costs
    that item alone. An item larger than ``max_bytes`` comes out as its size (an ``int``), one
    nested deeper than :data:`packers.files.MAX_JSON_DEPTH` as a Rejected; neither is held. A
    stream that breaks off, holds an empty item (``[1,,2]``) or data after the array raises
    ValueError naming the byte (the items before it have come out).

    ``wrapped``: the stream is one top-level value that the caller put inside ``[...]``; a second
    top-level value (JSON lines in a ``.json`` file) raises :class:`_JsonLines`.

    >>> list(json_items([b'[{"a": [1, "]"]}, 2', b'2, "x,\\\\', b'"]"]  '], max_bytes=100))
    [b'{"a": [1, "]"]}', b'22', b'"x,\\\\"]"']
    """
    return _Splitter(blocks, max_bytes, wrapped).items()


class _Splitter:
    """The state of :func:`json_items` over one stream: the bytes held, where the scan is, and the item it is in."""

    def __init__(self, blocks: Iterable[bytes], max_bytes: int, wrapped: bool):
        self.blocks, self.max_bytes, self.wrapped = iter(blocks), max_bytes, wrapped
        self.buf, self.i, self.offset = b"", 0, 0  # held bytes, the next one to scan, the file offset of buf[0]
        self.depth = 0  # 1: in the array, at its items' level; 2 and more: inside an item's brackets
        self.item: Optional[int] = None  # where the current item starts in buf (None: before the array)
        self.dropped = 0  # bytes of the current item let go of: too large or too deep to hold
        self.deepest = 0
        self.in_string = False  # inside a string whose end is not read yet
        self.closed = False  # wrapped: the top-level value has ended
        self.after_comma = False
        self.done = False

    def items(self) -> Iterator["bytes | int | Rejected"]:
        while True:
            if self.in_string:
                if self._close_string():
                    continue
            else:
                start = self._skip()
                if start < len(self.buf):
                    item = self._mark(start)
                    if item is not None:
                        yield item
                    continue
                self.i = start
            if not self._more():
                break
        if self.in_string or not self.done:
            raise ValueError(f"the JSON array breaks off at byte {self.offset + len(self.buf)} (a truncated file?)")

    def _more(self) -> bool:
        """Read the next block, first letting go of what is no longer needed. False at the end."""
        cut = self.i
        if self.item is not None and not self.done:
            if self.dropped or self.i - self.item > self.max_bytes or self.deepest - 1 > MAX_JSON_DEPTH:
                self.dropped += len(self.buf[self.item:self.i].strip()) if not self.dropped else self.i - self.item
                self.item = self.i
            cut = self.item
        self.buf, self.offset, self.i = self.buf[cut:], self.offset + cut, self.i - cut
        if self.item is not None:
            self.item -= cut
        block = next(self.blocks, b"")
        self.buf += block
        return bool(block)

    def _close_string(self) -> bool:
        """Scan to the end of the open string: True past its closing quote, False when the block ends first (a
        backslash ending the block is kept for the next scan)."""
        j = _STRING_BODY.match(self.buf, self.i).end()
        if j < len(self.buf) and self.buf[j] == 0x22:
            self.i, self.in_string = j + 1, False
            return True
        self.i = j
        return False

    def _skip(self) -> int:
        """Skip, in C, what moves no bracket and ends no item: the position of the next bracket, comma or open
        quote (``len(buf)``: none in this block). Raises at data outside the array."""
        buf, i = self.buf, self.i
        start = (_SKIP_INNER if self.depth > 1 else _SKIP_ITEM).match(buf, i).end()
        if (self.done or self.item is None or (self.wrapped and self.closed)) and buf[i:start].strip():
            if self.wrapped and self.closed and not self.done:
                raise _JsonLines()
            where = "after the end of" if self.done else "before"
            raise ValueError(f"unexpected data {where} the JSON array, at byte "
                             f"{self.offset + i + len(buf[i:start]) - len(buf[i:start].lstrip())}")
        return start

    def _mark(self, start: int) -> "bytes | int | Rejected | None":
        """Take the bracket, comma or quote at ``start``; the text of the item it ends, if it ends one."""
        c, self.i = self.buf[start], start + 1
        if self.done or (self.item is None and c != 0x5B):
            where = "after the end of" if self.done else "before"
            raise ValueError(f"unexpected data {where} the JSON array, at byte {self.offset + start}")
        top = self.wrapped and self.closed and self.depth == 1  # wrapped: a second top-level value starts here
        if c == 0x22:  # a quote whose string goes on past this block (whole strings were skipped)
            if top:
                raise _JsonLines()
            self.in_string = True
        elif self.item is None:  # the array's "["
            self.depth, self.item, self.deepest = 1, self.i, 1
        elif c in (0x5B, 0x7B):  # [ {
            if top:
                raise _JsonLines()
            self.depth += 1
            self.deepest = max(self.deepest, self.depth)
        elif self.depth > 1:
            if c != 0x2C:  # ] } closing a bracket inside an item (a comma inside one is nothing here)
                self.depth -= 1
                self.closed = self.closed or self.depth == 1
        elif c == 0x7D:
            raise ValueError(f"a '}}' closes the JSON array's '[', at byte {self.offset + start}")
        else:
            return self._end_item(c, start)
        return None

    def _end_item(self, c: int, start: int) -> "bytes | int | Rejected | None":
        """The item's end: a "," or the array's "]"."""
        if c == 0x2C and self.wrapped:
            raise _JsonLines()
        empty = not self.dropped and not self.buf[self.item:start].strip()
        if empty and (c == 0x2C or self.after_comma):
            raise ValueError(f"an empty item in the JSON array, at byte {self.offset + start}")
        out = None if empty else _item(self.buf[self.item:start], self.dropped, self.deepest, self.max_bytes)
        self.item, self.dropped, self.deepest, self.after_comma = self.i, 0, 1, c == 0x2C
        self.done = c == 0x5D
        return out


def _item(text: bytes, dropped: int, deepest: int, max_bytes: int) -> "bytes | int | Rejected":
    if deepest - 1 > MAX_JSON_DEPTH:
        return _too_deep(deepest - 1)
    text = text.strip()
    return text if not dropped and len(text) <= max_bytes else dropped + len(text)


def json_texts(f: InputFile, max_bytes: int) -> Iterator[tuple[int, "bytes | int | Rejected"]]:
    """``(position, item text, size or Rejected)`` of a ``.json`` file: the items of its array, or its one
    object at position 0; a file of JSON lines is read as JSONL (positions are then line numbers)."""
    with open_bytes(f.path) as fh:
        blocks = read_blocks(fh)
        head = b""
        for block in blocks:  # up to the first byte after a byte-order mark and white space
            head += block
            if head[len(BOM) if head.startswith(BOM) else 0:].strip():
                break
        if head.startswith(BOM):  # a byte-order mark is not part of the JSON (as in JSONL)
            head = head[len(BOM):]
        if head.lstrip()[:1] != b"{":
            yield from enumerate(json_items(itertools.chain([head], blocks), max_bytes))
            return
        try:
            texts = list(json_items(itertools.chain([b"[", head], blocks, [b"]"]), max_bytes, wrapped=True))
        except _JsonLines:
            texts = None
    yield from jsonl_texts(f, max_bytes) if texts is None else enumerate(texts)


def json_records(f: InputFile, max_bytes: int) -> Iterator[tuple[int, Any]]:
    for position, text in json_texts(f, max_bytes):
        yield position, record_of(text, max_bytes)


def record_of(text: "bytes | int | Rejected", max_bytes: int) -> Any:
    """The record of one text from :func:`~pipeline._read._lines.jsonl_texts` or :func:`json_texts`."""
    if isinstance(text, bytes):
        return parse_line(text, max_bytes)
    return _too_large(text, max_bytes) if isinstance(text, int) else text


def jsonl_records(f: InputFile, max_bytes: int, start: int = 0, stop: Optional[int] = None,
                  first_line: int = 1) -> Iterator[tuple[int, Any]]:
    """``(line number, record or Rejected)`` of each record in bytes ``start:stop`` of a JSONL file."""
    for lineno, text in jsonl_texts(f, max_bytes, start, stop, first_line):
        yield lineno, record_of(text, max_bytes)
