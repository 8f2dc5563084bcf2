"""Input files: the kind a name says, the one checked open, decompression, and bytes in blocks.

An input's kind comes from its name (:data:`SUPPORTED`): JSONL (``.jsonl``, ``.ndjson``), JSON
arrays (``.json``), CSV (``.csv``), TSV (``.tsv``) and plain text (``.txt``), plain or compressed
(``.gz``, ``.zst``, ``.xz``, ``.bz2``), Parquet and Arrow; a Hugging Face ``save_to_disk`` folder is
known by its ``state.json`` or ``dataset_dict.json``. Every file is opened through
:func:`packers.files.open_checked`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import os
import posixpath
import zlib
from typing import Any, Iterator, Optional

from packers.files import open_checked

_TYPES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".tsv": "tsv", ".txt": "text",
          ".parquet": "parquet", ".arrow": "arrow"}
"""File name endings -> input kind (the one table; everything else is derived from it)."""
COMPRESSIONS = {".gz": b"\x1f\x8b", ".zst": b"\x28\xb5\x2f\xfd", ".xz": b"\xfd7zXZ\x00", ".bz2": b"BZh"}
"""Compressions of the text inputs (JSONL, JSON, CSV, TSV, plain text) -> the magic bytes their streams start with."""
CODEC = {".gz": "gzip", ".zst": "zstd", ".xz": "xz", ".bz2": "bzip2"}
_COMPRESSIBLE = ("jsonl", "json", "csv", "tsv", "text")
SUPPORTED = tuple(ext + c for ext, kind in _TYPES.items() for c in ("", *(COMPRESSIONS if kind in _COMPRESSIBLE else ())))
OTHER_FORMATS = {".xlsx": "save it as CSV (File > Save As > .csv)", ".xls": "save it as CSV (File > Save As > .csv)",
                 ".ods": "save it as CSV (File > Save As > .csv)"}
"""Data formats packstream does not read, and how to make one it reads."""
OTHER_COMPRESSIONS = {".lz4": "lz4 -d", ".zip": "unzip", ".snappy": "a Snappy tool", ".br": "brotli -d",
                       ".zz": "a zlib tool", ".lzma": "xz -d", ".z": "uncompress", ".tar": "tar -xf", ".tgz": "tar -xzf",
                       ".7z": "7z x", ".rar": "unrar x"}
"""Compressions and archives packstream does not read, and the command that undoes each."""


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str
    source: str
    """Short, stable name used in example ids and dead letters (path relative to the common root)."""
    kind: str  # jsonl | json | csv | tsv | text | parquet | arrow | hf_disk
    split: str = ""
    dataset: int = 0
    """Index of the data set (``PackOptions.datasets()``) whose format options apply."""
    text_split: str = ""
    """A ``text`` input: its data set's ``--text-split`` (``line``, ``paragraph``, ``file``); "" for other kinds."""


def open_raw(path: str):
    """An input's bytes as a binary stream, through the one checked open (:func:`packers.files.open_checked`:
    regular files only, so a FIFO or ``/dev/zero`` is one error line); local files directly (no Beam
    import), anything else through Beam's FileSystems (gs://, s3://, ...; :func:`pipeline._fs.open`), uncompressed."""
    from pipeline import _fs

    return open_checked(path, what="input", opener=_fs.open)


def compression(path: str) -> Optional[str]:
    """The compression suffix of a JSONL, JSON, CSV, TSV or text input (``.gz``, ``.zst``, ``.xz``, ``.bz2``), or None."""
    low = path.lower()
    for c in COMPRESSIONS:
        if low.endswith(c) and _TYPES.get(posixpath.splitext(low[: -len(c)])[1]) in _COMPRESSIBLE:
            return c
    return None


def file_kind(path: str) -> str | None:
    """The input kind a file name says (``data.jsonl.zst``: jsonl), or None.

    >>> [file_kind(p) for p in ("a/b.ndjson.zst", "b.JSON.bz2", "b.parquet", "b.parquet.gz", "b.jsonl.lz4", "t.tsv.gz")]
    ['jsonl', 'json', 'parquet', None, None, 'tsv']
    """
    low = path.lower()
    c = compression(low)
    return _TYPES.get(posixpath.splitext(low[: len(low) - len(c or "")])[1])


def supported_text() -> str:
    """The supported inputs, for messages."""
    plain = ", ".join(ext for ext in _TYPES)
    return (f"{plain} (all but Parquet and Arrow also compressed: {', '.join(COMPRESSIONS)}), or a datasets "
            "save_to_disk folder")


def looks_like_data(name: str) -> bool:
    """A file name that says data packstream does not read (``a.jsonl.lz4``, ``shard.parquet.gz``, ``data.zip``):
    a folder holding one is noted, never skipped in silence. A ``.txt.`` name (``notes.txt.bak``) is not data."""
    low = name.lower()
    return low.endswith(tuple(OTHER_COMPRESSIONS) + tuple(OTHER_FORMATS)) or any(
        f"{ext}." in low for ext, kind in _TYPES.items() if kind != "text")


def fix_for(paths: list[str]) -> str:
    """What to do about files no reader supports: how to make a spreadsheet a CSV, the command that undoes a
    compression packstream does not read, else a rename."""
    for p in paths:
        low = p.lower()
        for ext, how in OTHER_FORMATS.items():
            if low.endswith(ext):
                return f"packstream does not read {ext} files: {how}"
        for ext, command in OTHER_COMPRESSIONS.items():
            if low.endswith(ext):
                return (f"packstream does not read {ext} files: decompress them first ({command}), or recompress "
                        "the file as .zst, .gz, .xz or .bz2")
    return ("name each file for its type (data.jsonl for JSON lines, data.json for a JSON array, data.csv, data.txt "
            "for plain text, data.parquet, ...)")


def is_hf_disk(path: str) -> bool:
    """Whether ``path`` is a datasets ``save_to_disk`` folder."""
    if "://" not in path:
        return os.path.isdir(path) and any(os.path.exists(os.path.join(path, n)) for n in ("state.json", "dataset_dict.json"))
    from pipeline import _fs

    return any(_fs.exists(_fs.join(path, name)) for name in ("state.json", "dataset_dict.json"))


def hf_dataset(f: "InputFile"):
    """The ``datasets.Dataset`` of a datasets-folder input (its split, for a DatasetDict)."""
    import datasets

    ds = datasets.load_from_disk(f.path)
    return ds[f.split] if f.split else ds


_BLOCK = 1 << 20
"""Bytes read at a time by the line and JSON readers."""
BOM = b"\xef\xbb\xbf"


class CorruptStream(OSError):
    """A compressed input's stream that breaks off or holds bad data: whichever error its decompressor raised
    (``EOFError`` at a break, ``zlib.error``, ``lzma.LZMAError``, gzip's and bz2's ``OSError``, pyarrow's zstd
    ``OSError``), as one type that every stage catches (an ``OSError``, so a catch of ``OSError`` keeps it)."""

    def __init__(self, cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = type(cause).__name__
        """The decompressor's own error type, for messages (``EOFError``)."""
        self.detail = str(cause)


def _decompressor_errors() -> tuple:
    import lzma

    return (EOFError, OSError, zlib.error, lzma.LZMAError)


class Decompressed:
    """A decompressing stream, the one place every compressed input is read through (:func:`open_bytes`), so each
    decompressor's error, at launch, at the count, at read time and in the tools, is one :class:`CorruptStream`
    (issue 42: a truncated ``.csv.gz`` let ``EOFError`` reach click, which printed ``Aborted!``).

    ``at_break="raise"`` raises it at the break (and at every read after it); ``"end"`` ends the stream there, as
    if the file stopped, and keeps the error in :attr:`broken` for the reader to raise once it has handed over
    the records before the break (pyarrow's CSV reader fills whole blocks, and an error drops the block)."""

    def __init__(self, stream: Any, at_break: str = "raise"):
        self.stream, self.at_break = stream, at_break
        self.broken: Optional[CorruptStream] = None
        self._read1 = getattr(stream, "read1", stream.read)

    def _take(self, n: int) -> bytes:
        """Up to ``n`` bytes, as many as the decompressor has at hand; b"" at the end, or at a break (then kept)."""
        if self.broken is None:
            try:
                return self._read1(n)
            except _decompressor_errors() as e:
                self.broken = e if isinstance(e, CorruptStream) else CorruptStream(e)
        return b""

    def _give(self, data: bytes) -> bytes:
        if not data and self.broken is not None and self.at_break == "raise":
            raise self.broken
        return data

    def read1(self, n: Optional[int] = -1) -> bytes:
        """At most ``n`` bytes, as many as the decompressor has at hand."""
        return self._give(self._take(_BLOCK if n is None or n < 0 else n))

    def read(self, n: Optional[int] = -1) -> bytes:
        """``n`` bytes (all: -1), fewer at the end. The bytes decoded before a break are handed over first; the
        next read raises it (or, under ``"end"``, meets the end)."""
        parts, want = [], -1 if n is None or n < 0 else n
        while want:
            part = self._take(_BLOCK if want < 0 else want)
            if not part:
                break
            parts.append(part)
            want = want if want < 0 else want - len(part)
        return self._give(b"".join(parts))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return self.stream.closed

    def close(self) -> None:
        self.stream.close()


@contextlib.contextmanager
def open_bytes(path: str, at_break: str = "raise") -> Iterator[Any]:
    """The file's bytes, decompressed by its suffix (:data:`COMPRESSIONS`); a compressed file as a
    :class:`Decompressed` stream (``at_break``: what it does at a break, see there).

    Each decompressor raises at a stream that breaks off, so the rest of the file never vanishes
    without a trace (see :func:`pipeline._read.read_file`): Python's gzip (not Beam's ``CompressedFile``, which
    stops silently at a truncated member), bz2 and lzma, and pyarrow's zstd (already a dependency;
    the ``zstandard`` package's stream reader ends silently at a truncated frame).
    """
    c = compression(path)
    with open_raw(path) as raw:
        if c is None:
            yield raw
            return
        with _decompressing(raw, c) as stream:
            yield Decompressed(stream, at_break)


@contextlib.contextmanager
def _decompressing(raw: Any, c: str) -> Iterator[Any]:
    if c == ".gz":
        with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
            yield stream
    elif c == ".bz2":
        import bz2

        with bz2.BZ2File(raw, mode="rb") as stream:
            yield stream
    elif c == ".xz":
        import lzma

        with lzma.LZMAFile(raw, mode="rb") as stream:
            yield stream
    else:
        import pyarrow as pa

        with pa.CompressedInputStream(pa.PythonFile(raw, mode="r"), "zstd") as stream:
            yield _SmallReads(stream)


class _SmallReads:
    """A stream whose ``read1`` asks for at most 64 KiB: pyarrow's decompressing stream raises at a break and
    drops what that one call decoded, so small calls hand over all but the last 64 KiB before the break."""

    def __init__(self, stream):
        self.stream = stream

    def read(self, n: int = -1) -> bytes:
        return self.stream.read() if n is None or n < 0 else self.stream.read(n)

    def read1(self, n: int = -1) -> bytes:
        return self.stream.read(1 << 16 if n is None or n < 0 else min(n, 1 << 16))

    @property
    def closed(self) -> bool:
        return self.stream.closed

    def close(self) -> None:
        self.stream.close()


def read_blocks(fh, limit: Optional[int] = None, size: int = _BLOCK) -> Iterator[bytes]:
    """The bytes of ``fh`` from its position, up to ``size`` at a time, at most ``limit`` of them in all.

    ``read1`` where the stream has it: a decompressing stream then hands over what it has decoded
    before it raises at a break (a truncated gzip), so the records before the break are read."""
    read = getattr(fh, "read1", None) or fh.read
    while limit is None or limit > 0:
        block = read(size if limit is None else min(size, limit))
        if not block:
            return
        if limit is not None:
            limit -= len(block)
        yield block

