"""Readers: input paths -> ``(source, position, record)`` triples.

Inputs are files, globs or folders, local or anything Beam's ``FileSystems`` reads (gs://,
s3://). Supported (:data:`SUPPORTED`): JSONL (``.jsonl``, ``.ndjson``) and JSON arrays (``.json``),
plain or compressed (``.gz``, ``.zst``, ``.xz``, ``.bz2``), Parquet, Arrow (IPC stream or file), and
Hugging Face ``save_to_disk`` folders. Each input is checked against its name before the job
starts (its magic bytes; a small compressed stream decompressed whole), so a mislabelled, empty or
unsupported file is a clear CLI error naming the fix, not a worker traceback. Every file is opened
through :func:`packers.files.open_checked`.

Positions: 1-based line numbers for JSONL, 0-based row indices for everything else.
A record that cannot even be parsed comes out as a :class:`~pipeline._formats.Rejected`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import itertools
import json
import os
import posixpath
import re
import zlib
from typing import Any, Iterable, Iterator, Optional

import orjson

from packers import PackstreamError
from packers.files import MAX_JSON_DEPTH, check_regular, check_utf8_name, open_checked, show_path, value_depth
from pipeline._formats import Reason, Rejected

_TYPES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
"""File name endings -> input kind (the one table; everything else is derived from it)."""
COMPRESSIONS = {".gz": b"\x1f\x8b", ".zst": b"\x28\xb5\x2f\xfd", ".xz": b"\xfd7zXZ\x00", ".bz2": b"BZh"}
"""Compressions of JSONL and JSON inputs -> the magic bytes their streams start with."""
_CODEC = {".gz": "gzip", ".zst": "zstd", ".xz": "xz", ".bz2": "bzip2"}
_COMPRESSIBLE = ("jsonl", "json")
SUPPORTED = tuple(ext + c for ext, kind in _TYPES.items() for c in ("", *(COMPRESSIONS if kind in _COMPRESSIBLE else ())))
_OTHER_COMPRESSIONS = {".lz4": "lz4 -d", ".zip": "unzip", ".snappy": "a Snappy tool", ".br": "brotli -d",
                       ".zz": "a zlib tool", ".lzma": "xz -d", ".z": "uncompress", ".tar": "tar -xf", ".tgz": "tar -xzf",
                       ".7z": "7z x", ".rar": "unrar x"}
"""Compressions and archives packstream does not read, and the command that undoes each."""


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str
    source: str
    """Short, stable name used in example ids and dead letters (path relative to the common root)."""
    kind: str  # jsonl | json | parquet | arrow | hf_disk
    split: str = ""
    dataset: int = 0
    """Index of the data set (``PackOptions.datasets()``) whose format options apply."""


def open_raw(path: str):
    """An input's bytes as a binary stream, through the one checked open (:func:`packers.files.open_checked`:
    regular files only, so a FIFO or ``/dev/zero`` is one error line); local files directly (no Beam
    import), anything else through Beam's FileSystems (gs://, s3://, ...), uncompressed."""
    return open_checked(path, what="input", opener=_beam_open)


def _beam_open(path: str):
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.open(path, compression_type="uncompressed")


def compression(path: str) -> Optional[str]:
    """The compression suffix of a JSONL or JSON input (``.gz``, ``.zst``, ``.xz``, ``.bz2``), or None."""
    low = path.lower()
    for c in COMPRESSIONS:
        if low.endswith(c) and _TYPES.get(posixpath.splitext(low[: -len(c)])[1]) in _COMPRESSIBLE:
            return c
    return None


def _kind(path: str) -> str | None:
    """The input kind a file name says (``data.jsonl.zst``: jsonl), or None.

    >>> _kind("a/b.ndjson.zst"), _kind("b.JSON.bz2"), _kind("b.parquet"), _kind("b.parquet.gz"), _kind("b.jsonl.lz4")
    ('jsonl', 'json', 'parquet', None, None)
    """
    low = path.lower()
    c = compression(low)
    return _TYPES.get(posixpath.splitext(low[: len(low) - len(c or "")])[1])


def supported_text() -> str:
    """The supported inputs, for messages."""
    plain = ", ".join(ext for ext in _TYPES)
    return (f"{plain} (JSONL and JSON also compressed: {', '.join(COMPRESSIONS)}), or a datasets save_to_disk folder")


def _looks_like_data(name: str) -> bool:
    """A file name that says data packstream does not read (``a.jsonl.lz4``, ``shard.parquet.gz``, ``data.zip``):
    a folder holding one is noted, never skipped in silence."""
    low = name.lower()
    return low.endswith(tuple(_OTHER_COMPRESSIONS)) or any(f"{ext}." in low for ext in _TYPES)


def _fix_for(paths: list[str]) -> str:
    """What to do about files no reader supports: the command that undoes a compression packstream does not
    read, else a rename."""
    for p in paths:
        low = p.lower()
        for ext, command in _OTHER_COMPRESSIONS.items():
            if low.endswith(ext):
                return (f"packstream does not read {ext} files: decompress them first ({command}), or recompress "
                        "JSONL/JSON as .zst, .gz, .xz or .bz2")
    return "name each file for its type (data.jsonl for JSON lines, data.json for a JSON array, data.parquet, ...)"


def _is_hf_disk(path: str) -> bool:
    if "://" not in path:
        return os.path.isdir(path) and any(os.path.exists(os.path.join(path, n)) for n in ("state.json", "dataset_dict.json"))
    from apache_beam.io.filesystems import FileSystems

    return any(
        FileSystems.exists(FileSystems.join(path, name)) for name in ("state.json", "dataset_dict.json")
    )


def _sniff(path: str, kind: str) -> None:
    """Refuse a file whose bytes do not match its extension, or that is empty."""
    try:
        with open_raw(path) as f:
            head = raw_head = f.read(4096)
    except (OSError, IOError) as e:  # permissions, a folder named like a file, a vanished file
        raise PackstreamError(f"cannot read input {path}: {type(e).__name__}: {e}; check the path and its permissions") from None
    if not head:
        raise PackstreamError(f"input {path} is empty; remove it from the inputs")
    c = compression(path)
    if c is not None:
        if not head.startswith(COMPRESSIONS[c]):
            raise PackstreamError(f"input {show_path(path)} ends in {c} but is not {_CODEC[c]} data (starts with {head[:6]!r}); "
                                  "rename it to what it is, or recompress it")
        try:
            # A small file is decompressed whole here, so a break in it is a launch error (bounded: a
            # few KiB of zstd or xz can stand for gigabytes).
            with _open_bytes(path) as fh:
                head = fh.read(4096)
                if len(head) == 4096 and len(raw_head) < 4096:
                    for _ in _blocks(fh, limit=64 * 2**20):
                        pass
        except (OSError, EOFError, ValueError, zlib.error) as e:
            raise PackstreamError(f"input {show_path(path)} is a corrupt or truncated {_CODEC[c]} file ({e}); re-create it") from None
    if kind == "parquet" and head[:4] != b"PAR1":
        raise PackstreamError(f"input {path} has extension .parquet but is not a Parquet file (starts with {head[:8]!r})")
    if kind == "arrow" and not (head[:6] == b"ARROW1" or head[:4] == b"\xff\xff\xff\xff"):
        raise PackstreamError(f"input {path} has extension .arrow but is not an Arrow IPC file (starts with {head[:8]!r})")
    if kind in ("jsonl", "json"):
        stripped = head.lstrip(b"\xef\xbb\xbf \t\r\n")
        if not stripped:
            raise PackstreamError(f"input {path} holds only whitespace; remove it from the inputs")
        if stripped[:1] not in (b"{", b"["):
            raise PackstreamError(
                f"input {path} has extension {kind} but does not start with a JSON object or array "
                f"(starts with {stripped[:12]!r}); check the file type"
            )
        if kind == "jsonl" and stripped.split(b"\n", 1)[0].strip() == b"[":
            raise PackstreamError(
                f"input {path} holds a JSON array spread over lines, not JSON Lines (one object per line); "
                "rename it to .json"
            )
        if kind == "json" and len(head) < 4096:  # all of it is here: a break is a launch error, as for gzip
            try:
                for _ in _json_texts(InputFile(path, path, kind), 2**31 - 1):
                    pass
            except ValueError as e:
                raise PackstreamError(f"input {path} is not valid JSON ({e}); fix the file or convert it to JSONL") from None
        if kind == "jsonl" and stripped[:1] == b"[" and _one_line(path):
            raise PackstreamError(
                f"input {path} holds one JSON array on a single line, not JSON Lines (one object per line): its "
                "records would be one rejected line; rename it to .json"
            )


def _one_line(path: str) -> bool:
    """Whether the file holds a single non-blank line (LF, CRLF or CR line ends)."""
    with _open_bytes(path) as f:
        seen_end = False
        for block in iter(lambda: f.read(2**20), b""):
            if seen_end:
                if block.strip():
                    return False
                continue
            for sep in (b"\n", b"\r"):
                i = block.find(sep)
                if i >= 0:
                    seen_end = True
                    if block[i:].strip():
                        return False
                    break
    return True


def _local_matches(pattern: str) -> list[str]:
    """Absolute paths of the local files (or datasets folders) that ``pattern`` names.

    A name that exists is taken literally, before any glob expansion (so ``a[1].jsonl`` is that
    file); a folder is walked recursively, skipping hidden names (``.tmp-*``, ``.git``) and not
    following symlinked folders; otherwise the pattern is a glob (``**`` recursive).
    """
    import glob

    if os.path.lexists(pattern):
        path = os.path.abspath(pattern)
        if not os.path.isdir(path) or _is_hf_disk(path):
            return [path]
        out: list[str] = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            if _is_hf_disk(dirpath) and dirpath != path:
                out.append(dirpath)
                dirnames[:] = []
                continue
            out += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".")
                    and (_kind(f) or _looks_like_data(f))]
        if not any(_kind(p) or _is_hf_disk(p) for p in out):
            raise PackstreamError(
                f"input folder {show_path(pattern)} holds no supported file (supported: {supported_text()}; hidden "
                f"names are skipped); {_fix_for(out)}"
            )
        return out
    return sorted(os.path.abspath(p) for p in glob.glob(pattern, recursive=True)
                  if not os.path.isdir(p) or _is_hf_disk(p))


def _remote_matches(pattern: str) -> list[str]:
    from apache_beam.io.filesystems import FileSystems

    if _is_hf_disk(pattern):
        return [pattern.rstrip("/")]
    try:
        if FileSystems.exists(pattern):  # literal name first
            return [pattern]
        literal_dir = not any(c in pattern for c in "*?[")
        query = FileSystems.join(pattern, "**") if literal_dir else pattern
        return sorted(m.path for m in FileSystems.match([query])[0].metadata_list)
    except Exception as e:  # noqa: BLE001 - Beam raises BeamIOError (or worse) for unreadable or unknown schemes
        raise PackstreamError(f"cannot read input {pattern!r}: {e}") from None


def expand_datasets(datasets) -> tuple[list[InputFile], list[str]]:
    """Resolve every data set's files, globs and folders into checked inputs, plus notes on duplicates.

    Local paths are made absolute and de-duplicated by real path (``d/./x.jsonl``, a symlink to a
    file already named): the first name is kept and the others are noted. Each input's source
    name is its path relative to the common root of all inputs. A file named by two data sets is
    an error: it would be read twice, in two shapes.
    """
    found: list[tuple[str, str, int]] = []  # (path, kind, dataset)
    owner: dict[str, tuple[str, int]] = {}  # real path -> (first path, dataset)
    notes: list[str] = []
    for d, spec in enumerate(datasets):
        for pattern in spec.paths:
            if not pattern:
                raise PackstreamError("an input path is empty; give a file, glob or folder")
            remote = "://" in pattern
            paths = _remote_matches(pattern) if remote else _local_matches(pattern)
            if not paths:
                raise PackstreamError(f"input {pattern!r} matches no file; check the path or the glob")
            usable = [(p, "hf_disk" if _is_hf_disk(p) else _kind(p)) for p in paths]
            skipped = [p for p, k in usable if not k]
            usable = [(p, k) for p, k in usable if k]
            if not usable:
                shown = ", ".join(show_path(posixpath.basename(p)) for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
                raise PackstreamError(f"input {show_path(pattern)} matches no supported file ({shown}); supported: "
                                      f"{supported_text()}; {_fix_for(skipped)}")
            unread = [p for p in skipped if _looks_like_data(posixpath.basename(p))]
            if unread:  # data no reader supports is refused, never skipped in silence
                shown = ", ".join(show_path(posixpath.basename(p)) for p in unread[:3]) + (", ..." if len(unread) > 3 else "")
                raise PackstreamError(f"input {show_path(pattern)} holds {len(unread)} file(s) no reader supports "
                                      f"({shown}); {_fix_for(unread)}, or name only the files to read")
            for p, k in usable:
                check_utf8_name(p, "input")
                if not remote and k != "hf_disk":
                    check_regular(p, "input")
                real = p if remote else os.path.realpath(p)
                if real in owner:
                    first, first_d = owner[real]
                    if first_d != d:
                        raise PackstreamError(
                            f"input {p} is named by two data sets ({datasets[first_d].name!r} and {spec.name!r}); "
                            "give each file to one data set"
                        )
                    if first != p:
                        notes.append(f"{p} is the same file as {first}; read once")
                    continue
                owner[real] = (p, d)
                found.append((p, k, d))
    for p, k, _ in found:
        if k != "hf_disk":
            _sniff(p, k)
    found.sort(key=lambda t: t[0])
    root = _common_root([p for p, _, _ in found])
    out = []
    for p, k, d in found:
        source = p[len(root):].lstrip("/") if root else p
        source = source or posixpath.basename(p.rstrip("/"))
        if k == "hf_disk":
            out.extend(_hf_splits(p, source, d, datasets[d].split))
        else:
            out.append(InputFile(p, source, k, dataset=d))
    return out, notes


def expand_inputs(patterns: tuple[str, ...]) -> list[InputFile]:
    """The inputs of one data set (see :func:`expand_datasets`)."""
    from pipeline._options import DatasetSpec, FormatOptions

    return expand_datasets((DatasetSpec(name="default", paths=tuple(patterns), format=FormatOptions()),))[0]


def _common_root(paths: list[str]) -> str:
    """The folder shared by all paths, ending at a path component (one path: its own folder)."""
    if not paths:
        return ""
    if len(paths) == 1:
        return posixpath.dirname(paths[0].rstrip("/"))
    split = [p.rstrip("/").split("/") for p in paths]
    common = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    root = "/".join(common)
    if len(common) == min(len(s) for s in split):  # one path is a prefix folder of another: keep a name
        root = "/".join(common[:-1])
    if "://" in paths[0] and "://" not in root + "/":  # never cut inside the scheme
        return ""
    return root


def _hf_splits(path: str, source: str, dataset: int = 0, split: "str | None" = None) -> list[InputFile]:
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - datasets raises FileNotFoundError, ValueError, or worse on a broken folder
        raise PackstreamError(f"cannot open datasets folder {path}: {e}") from None
    names = sorted(ds) if isinstance(ds, datasets.DatasetDict) else []
    if split is not None:
        if split not in names:
            raise PackstreamError(f"datasets folder {path} has no split {split!r}; it has {names or 'no splits'}")
        return [InputFile(path, f"{source}[{split}]", "hf_disk", split, dataset)]
    if names:
        return [InputFile(path, f"{source}[{name}]", "hf_disk", name, dataset) for name in names]
    return [InputFile(path, source, "hf_disk", "", dataset)]


@contextlib.contextmanager
def _open_bytes(path: str) -> Iterator[Any]:
    """The file's bytes, decompressed by its suffix (:data:`COMPRESSIONS`).

    Each decompressor raises at a stream that breaks off, so the rest of the file never vanishes
    without a trace (see :func:`read_file`): Python's gzip (not Beam's ``CompressedFile``, which
    stops silently at a truncated member), bz2 and lzma, and pyarrow's zstd (already a dependency;
    the ``zstandard`` package's stream reader ends silently at a truncated frame).
    """
    c = compression(path)
    with open_raw(path) as raw:
        if c is None:
            yield raw
        elif c == ".gz":
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


# ---------------------------------------------------------------------------------------
# Lines: one rule everywhere
#
# A line ends at LF, CRLF or a lone CR (old Mac files), exactly the line ends of Python's
# ``bytes.splitlines``. Raw CR and LF cannot occur inside a JSON value, so splitting at either
# never cuts a record. The readers split with ``bytes.splitlines``; the task planner and the
# record count count with :func:`line_ends`; tests hold the two equal over random bytes cut at
# random places, so every task numbers its lines as one pass over the whole file would.

_BLOCK = 1 << 20
"""Bytes read at a time by the line and JSON readers."""
_BOM = b"\xef\xbb\xbf"


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


def _blocks(fh, limit: Optional[int] = None, size: int = _BLOCK) -> Iterator[bytes]:
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


def _lines(fh, first_line: int, limit: Optional[int], max_bytes: int) -> Iterator[tuple[int, "bytes | int"]]:
    """``(line number, bytes or length)`` of each line in the next ``limit`` bytes of ``fh`` (None: to the end)."""
    return enumerate(split_lines(_blocks(fh, limit), max_bytes), start=first_line)


def _jsonl_texts(f: InputFile, max_bytes: int, start: int = 0, stop: Optional[int] = None,
                 first_line: int = 1) -> Iterator[tuple[int, "bytes | int"]]:
    """``(line number, text or size)`` of each non-blank line of bytes ``start:stop`` of a JSONL file
    (a byte-order mark before line 1 is not part of it)."""
    with _open_bytes(f.path) as fh:
        if start:
            fh.seek(start)
        for lineno, raw in _lines(fh, first_line, None if stop is None else stop - start, max_bytes):
            if lineno == 1 and isinstance(raw, bytes) and raw.startswith(_BOM):
                raw = raw[len(_BOM):]
            if isinstance(raw, int) or raw.strip():  # blank lines are not records
                yield lineno, raw


def _jsonl(f: InputFile, max_bytes: int, start: int = 0, stop: Optional[int] = None,
           first_line: int = 1) -> Iterator[tuple[int, Any]]:
    for lineno, text in _jsonl_texts(f, max_bytes, start, stop, first_line):
        yield lineno, _record(text, max_bytes)


# ---------------------------------------------------------------------------------------
# One record's bytes -> the record


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
    blocks = iter(blocks)
    buf, i, offset = b"", 0, 0  # held bytes, the next one to scan, the file offset of buf[0]
    depth = 0  # 1: in the array, at its items' level; 2 and more: inside an item's brackets
    item = None  # where the current item starts in buf (None: before the array)
    dropped = 0  # bytes of the current item let go of: too large or too deep to hold
    deepest = 0
    in_string = False  # inside a string whose end is not read yet
    closed = False  # wrapped: the top-level value has ended
    after_comma = False
    done = False

    def more() -> bool:
        """Read the next block, first letting go of what is no longer needed. False at the end."""
        nonlocal buf, i, offset, item, dropped
        cut = i
        if item is not None and not done:
            if dropped or i - item > max_bytes or deepest - 1 > MAX_JSON_DEPTH:
                dropped += len(buf[item:i].strip()) if not dropped else i - item
                item = i
            cut = item
        buf, offset, i = buf[cut:], offset + cut, i - cut
        if item is not None:
            item -= cut
        block = next(blocks, b"")
        buf += block
        return bool(block)

    while True:
        if in_string:
            j = _STRING_BODY.match(buf, i).end()
            if j < len(buf) and buf[j] == 0x22:  # the closing quote
                i, in_string = j + 1, False
                continue
            i = j  # the string goes on past this block (a backslash ending it is kept for the next match)
            if not more():
                break
            continue
        # Skip, in C, what moves no bracket and ends no item; stop at the next bracket, comma or open quote.
        start = (_SKIP_INNER if depth > 1 else _SKIP_ITEM).match(buf, i).end()
        if (done or item is None or (wrapped and closed)) and buf[i:start].strip():
            if wrapped and closed and not done:
                raise _JsonLines()
            where = "after the end of" if done else "before"
            raise ValueError(f"unexpected data {where} the JSON array, at byte {offset + i + len(buf[i:start]) - len(buf[i:start].lstrip())}")
        if start == len(buf):
            i = start
            if not more():
                break
            continue
        c, i = buf[start], start + 1
        if done or (item is None and c != 0x5B):
            where = "after the end of" if done else "before"
            raise ValueError(f"unexpected data {where} the JSON array, at byte {offset + start}")
        if c == 0x22:  # a quote whose string goes on past this block (whole strings were skipped)
            if wrapped and closed and depth == 1:
                raise _JsonLines()
            in_string = True
            continue
        if item is None:  # the array's "["
            depth, item, deepest = 1, i, 1
            continue
        if c in (0x5B, 0x7B):  # [ {
            if wrapped and closed and depth == 1:
                raise _JsonLines()
            depth += 1
            if depth > deepest:
                deepest = depth
        elif depth > 1:
            if c != 0x2C:  # ] } closing a bracket inside an item (a comma inside one is nothing here)
                depth -= 1
                closed = closed or depth == 1
        elif c == 0x7D:
            raise ValueError(f"a '}}' closes the JSON array's '[', at byte {offset + start}")
        else:  # the item's end: "," or the array's "]"
            if c == 0x2C and wrapped:
                raise _JsonLines()
            empty = not dropped and not buf[item:start].strip()
            if empty and (c == 0x2C or after_comma):
                raise ValueError(f"an empty item in the JSON array, at byte {offset + start}")
            if not empty:
                yield _item(buf[item:start], dropped, deepest, max_bytes)
            item, dropped, deepest, after_comma = i, 0, 1, c == 0x2C
            done = c == 0x5D
    if in_string or not done:
        raise ValueError(f"the JSON array breaks off at byte {offset + len(buf)} (a truncated file?)")


def _item(text: bytes, dropped: int, deepest: int, max_bytes: int) -> "bytes | int | Rejected":
    if deepest - 1 > MAX_JSON_DEPTH:
        return _too_deep(deepest - 1)
    text = text.strip()
    return text if not dropped and len(text) <= max_bytes else dropped + len(text)


def _json_texts(f: InputFile, max_bytes: int) -> Iterator[tuple[int, "bytes | int | Rejected"]]:
    """``(position, item text, size or Rejected)`` of a ``.json`` file: the items of its array, or its one
    object at position 0; a file of JSON lines is read as JSONL (positions are then line numbers)."""
    with _open_bytes(f.path) as fh:
        blocks = _blocks(fh)
        head = b""
        for block in blocks:  # up to the first byte after a byte-order mark and white space
            head += block
            if head[len(_BOM) if head.startswith(_BOM) else 0:].strip():
                break
        if head.startswith(_BOM):  # a byte-order mark is not part of the JSON (as in JSONL)
            head = head[len(_BOM):]
        if head.lstrip()[:1] != b"{":
            yield from enumerate(json_items(itertools.chain([head], blocks), max_bytes))
            return
        try:
            texts = list(json_items(itertools.chain([b"[", head], blocks, [b"]"]), max_bytes, wrapped=True))
        except _JsonLines:
            texts = None
    yield from _jsonl_texts(f, max_bytes) if texts is None else enumerate(texts)


def _json(f: InputFile, max_bytes: int) -> Iterator[tuple[int, Any]]:
    for position, text in _json_texts(f, max_bytes):
        yield position, _record(text, max_bytes)


def _record(text: "bytes | int | Rejected", max_bytes: int) -> Any:
    """The record of one text from :func:`_jsonl_texts` or :func:`_json_texts`."""
    if isinstance(text, bytes):
        return parse_line(text, max_bytes)
    return _too_large(text, max_bytes) if isinstance(text, int) else text


# ---------------------------------------------------------------------------------------
# Tables (Parquet, Arrow, datasets folders): rows as the records they hold


_JSON_VALUE = "json"


def _decoder(t: Any, feature: Any = None) -> Any:
    """What turns a value of Arrow type ``t`` back into the record it stores: None (nothing: no struct and
    no JSON inside), :data:`_JSON_VALUE`, ``("struct", {field: decoder})`` or ``("list", decoder)``.

    ``feature`` is ``datasets``' description of the same place (its ``huggingface`` schema metadata),
    which marks a ``Json`` feature even where a writer dropped the Arrow extension type.
    """
    import pyarrow as pa

    if getattr(t, "extension_name", None) == "arrow.json" or (isinstance(feature, dict) and feature.get("_type") == "Json"):
        return _JSON_VALUE
    if isinstance(t, pa.ExtensionType):
        t = t.storage_type
    if pa.types.is_struct(t):
        sub = feature if isinstance(feature, dict) and "_type" not in feature else {}
        return ("struct", {t.field(i).name: _decoder(t.field(i).type, sub.get(t.field(i).name)) for i in range(t.num_fields)})
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t) or pa.types.is_list_view(t) \
            or pa.types.is_large_list_view(t):
        inner = feature.get("feature") if isinstance(feature, dict) and feature.get("_type") in ("List", "LargeList", "Sequence") else None
        sub = _decoder(t.value_type, inner)
        return None if sub is None else ("list", sub)
    return None


def row_decoder(schema: Any) -> Any:
    """The decoder (:func:`_decoder`) of a table's rows: a struct of its columns."""
    import pyarrow as pa

    features = None
    meta = (schema.metadata or {}).get(b"huggingface")
    if meta:
        try:
            features = (json.loads(meta).get("info") or {}).get("features")
        except (ValueError, AttributeError):
            features = None
    return _decoder(pa.struct(list(schema)), features if isinstance(features, dict) else None)


def _restore(value: Any, decoder: Any, max_bytes: int, at: str) -> Any:
    """A columnar value as the record it stores (see :func:`table_rows`)."""
    if value is None or decoder is None:
        return value
    if decoder is _JSON_VALUE:
        if not isinstance(value, str):
            return value
        record = parse_line(value.encode("utf-8", "surrogatepass"), max_bytes)
        if isinstance(record, Rejected):
            raise Rejected(record.reason, f"the Json value at {at}: {record.detail}")
        return record
    kind, sub = decoder
    if kind == "struct":
        return {k: _restore(v, sub.get(k), max_bytes, f"{at}.{k}" if at else k) for k, v in value.items() if v is not None}
    return [_restore(x, sub, max_bytes, f"{at}[{j}]") for j, x in enumerate(value)]


def table_rows(batch: Any, max_bytes: int, decoder: Any = None) -> list:
    """The records of a record batch or table (a Rejected for a record that cannot be restored).

    Columnar files store records differently from JSON, and these two differences are undone here,
    so that the same records give the same examples in every container (tests/test_containers.py):

    * ``datasets``' ``Json`` feature (the ``arrow.json`` extension type, which ``datasets`` 5 writes
      to Parquet and ``save_to_disk`` for free-form values) stores each value as JSON text: it is
      decoded, never read as a string holding JSON.
    * A columnar schema gives every row every field of a struct, so the fields a record lacked come
      back as nulls (pyarrow and ``datasets`` fill them): a null struct field is dropped, as it is
      not in the record. Values decoded from ``Json`` are left as their JSON says, nulls included.
    """
    decoder = row_decoder(batch.schema) if decoder is None else decoder
    out: list = []
    for row in batch.to_pylist():
        try:
            out.append(_restore(row, decoder, max_bytes, ""))
        except Rejected as r:
            out.append(r)
    return out


def _table_batches(f: InputFile, max_bytes: int, start: int = 0, stop: Optional[int] = None) -> Iterator[list]:
    """Records ``start:stop`` of a table input (:func:`table_rows`), in lists of up to 1024."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if f.kind == "hf_disk":
        import datasets

        ds = datasets.load_from_disk(f.path)
        if f.split:
            ds = ds[f.split]
        ds = ds.with_format("arrow")
        stop = len(ds) if stop is None else min(stop, len(ds))
        decoder = row_decoder(ds.features.arrow_schema) if hasattr(ds.features, "arrow_schema") else None
        for i in range(start, stop, 1024):
            yield table_rows(ds[i:min(i + 1024, stop)], max_bytes, decoder)
        return
    with open_raw(f.path) as fh:
        if f.kind == "parquet":
            pf = pq.ParquetFile(fh)
            decoder = row_decoder(pf.schema_arrow)
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            first = 0
            for g, n in enumerate(sizes):  # tasks start and stop at row-group boundaries
                if first >= start and (stop is None or first < stop):
                    for batch in pf.iter_batches(batch_size=1024, row_groups=[g]):
                        yield table_rows(batch, max_bytes, decoder)
                first += n
            return
        # Arrow: IPC file (random access, "ARROW1" first) or stream, read batch by batch from the checked file.
        source = pa.PythonFile(fh, mode="r")
        if fh.read(6) == b"ARROW1":
            fh.seek(0)
            reader = pa.ipc.open_file(source)
            schema, batches = reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            fh.seek(0)
            reader = pa.ipc.open_stream(source)
            schema, batches = reader.schema, iter(reader)
        decoder = row_decoder(schema)
        for batch in batches:
            yield table_rows(batch, max_bytes, decoder)


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
"""Read tasks wanted per worker: local runners deal tasks out to the workers up front (FnApiRunner
round-robin), so a worker's share is within one task of the others', about 1/8 of its work."""
UNKNOWN_WORKERS = 32
"""The workers assumed where the launcher cannot know them (a cluster): 256 tasks for a big input."""


def task_bytes(input_bytes: int, workers: Optional[int] = None) -> int:
    """The JSONL task size of a run over ``input_bytes`` bytes of input on ``workers`` workers (None:
    unknown): about :data:`TASKS_PER_WORKER` tasks per worker, within [MIN_TASK_BYTES, TASK_BYTES];
    one worker reads the biggest tasks.

    The output does not depend on it: a group's examples are sorted by id before packing.

    >>> task_bytes(35 * 2**20, 2) // 2**10, task_bytes(35 * 2**20, 16) // 2**10, task_bytes(10**12) // 2**20
    (2240, 512, 8)
    """
    if workers == 1:  # nothing to balance: the fewest tasks (each fills and drains the tokenizer pipeline once)
        return TASK_BYTES
    wanted = max(1, workers or UNKNOWN_WORKERS) * TASKS_PER_WORKER
    return int(min(TASK_BYTES, max(MIN_TASK_BYTES, input_bytes // wanted)))
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
            for block in _blocks(fh, size=8 * 2**20):
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
        with _open_bytes(f.path) as fh:
            for block in _blocks(fh, size=8 * 2**20):
                n += line_ends(block, after_cr=after_cr)
                last, after_cr = block[-1:], block[-1] == 0x0D
        # a last line without a line end is a record too (blank lines count: this is an estimate)
        return n + (last not in (b"\n", b"\r"))
    if f.kind == "parquet":
        import pyarrow.parquet as pq

        with open_raw(f.path) as fh:
            return pq.ParquetFile(fh).metadata.num_rows
    if f.kind == "hf_disk":
        import datasets

        ds = datasets.load_from_disk(f.path)
        return len(ds[f.split] if f.split else ds)
    if f.kind == "json":
        return sum(1 for _ in _json_texts(f, 2**31 - 1))  # split, not parsed
    return sum(1 for _ in read_file(f, 2**31 - 1))


def input_bytes(f: InputFile) -> int:
    """An input's size in bytes, as the job sizes groups and shards from it (a datasets folder, or an
    input that cannot be sized, counts 0)."""
    if f.kind == "hf_disk":
        return 0
    from apache_beam.io.filesystems import FileSystems

    try:
        return int(FileSystems.match([f.path])[0].metadata_list[0].size_in_bytes)
    except Exception:  # noqa: BLE001 - an unsizable input adds nothing; the reader reports what is wrong with it
        return 0


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
            records = _jsonl(f, max_bytes, t.start, t.stop, t.first)
        elif f.kind == "json":
            records = _json(f, max_bytes)
        else:
            records = enumerate((row for rows in _table_batches(f, max_bytes, t.start, t.stop) for row in rows), start=t.start)
        for position, record in records:
            yield position, record
    except PackstreamError:
        raise
    except (OSError, EOFError, ValueError, zlib.error) as e:  # ArrowInvalid is a ValueError, ArrowIOError an OSError
        after = "at the start" if position is None else f"after position {position}"
        raise CorruptInput(
            f"input {f.path} is corrupt or truncated ({type(e).__name__} {after}: {e}); re-create or remove the file",
            position,
        ) from None


class CorruptInput(PackstreamError):
    """An input that breaks off mid-way (a truncated gzip, Parquet or Arrow file); ``position`` is the last good one."""

    def __init__(self, message: str, position: Optional[int]):
        super().__init__(message)
        self.position = position


def read_file(f: InputFile, max_bytes: int) -> Iterator[tuple[int, Any]]:
    """``(position, record or Rejected)`` for every record of one input.

    A file that breaks off mid-way (a truncated gzip, Parquet or Arrow file) raises
    :class:`CorruptInput` naming the file and the last good position.
    """
    yield from read_task(ReadTask(f), max_bytes)
