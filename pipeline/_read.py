"""Readers: input paths -> ``(source, position, record)`` triples.

Inputs are files, globs or folders, local or anything Beam's ``FileSystems`` reads (gs://,
s3://). Supported: JSONL (``.jsonl``, ``.ndjson``, gzip'd too), JSON arrays (``.json``), Parquet,
Arrow (IPC stream or file), and Hugging Face ``save_to_disk`` folders. Each input is checked
against its extension before the job starts, so a mislabelled or empty file is a clear CLI
error, not a worker traceback.

Positions: 1-based line numbers for JSONL, 0-based row indices for everything else.
A record that cannot even be parsed comes out as a :class:`~pipeline._formats.Rejected`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import os
import posixpath
import zlib
from typing import Any, Iterator, Optional

import orjson

from packers import PackstreamError
from pipeline._formats import Reason, Rejected

_JSONL = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz")
_JSON = (".json", ".json.gz")
_PARQUET = (".parquet",)
_ARROW = (".arrow",)
SUPPORTED = _JSONL + _JSON + _PARQUET + _ARROW


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
    """A file's bytes as a binary stream: the local file system directly (no Beam import), else Beam's
    FileSystems (gs://, s3://, ...), uncompressed."""
    if "://" not in path:
        return open(path, "rb")
    from apache_beam.io.filesystems import FileSystems

    return FileSystems.open(path, compression_type="uncompressed")


def _kind(path: str) -> str | None:
    low = path.lower()
    for exts, kind in ((_JSONL, "jsonl"), (_JSON, "json"), (_PARQUET, "parquet"), (_ARROW, "arrow")):
        if low.endswith(exts):
            return kind
    return None


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
            head = f.read(4096)
    except (OSError, IOError) as e:  # permissions, a folder named like a file, a vanished file
        raise PackstreamError(f"cannot read input {path}: {type(e).__name__}: {e}; check the path and its permissions") from None
    if not head:
        raise PackstreamError(f"input {path} is empty; remove it from the inputs")
    if path.lower().endswith(".gz"):
        if head[:2] != b"\x1f\x8b":
            raise PackstreamError(f"input {path} ends in .gz but is not gzip data; rename it or recompress it")
        try:
            head = gzip.decompress(head) if len(head) < 4096 else _gunzip_head(path)
        except (OSError, EOFError, zlib.error) as e:
            raise PackstreamError(f"input {path} is a corrupt or truncated gzip file ({e}); re-create it") from None
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


def _gunzip_head(path: str) -> bytes:
    with open_raw(path) as raw, gzip.GzipFile(fileobj=raw, mode="rb") as f:
        return f.read(4096)


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
            out += [os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith(".") and _kind(f)]
        if not out:
            raise PackstreamError(
                f"input folder {pattern!r} holds no supported file (supported: {', '.join(SUPPORTED)}, or a datasets "
                "save_to_disk folder; hidden names are skipped)"
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


def _check_regular(path: str) -> None:
    """Refuse what is not a regular file (a FIFO would block the reader forever; a device never ends)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise PackstreamError(f"cannot read input {path}: {e.strerror or e}; check the path and its permissions") from None
    if not stat.S_ISREG(mode):
        what = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
        raise PackstreamError(f"input {path} is {what}; packstream reads regular files: copy the data to a file first")


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
            usable = [(p, k) for p, k in usable if k]
            if not usable:
                raise PackstreamError(
                    f"input {pattern!r} matches no supported file; supported: {', '.join(SUPPORTED)} "
                    "or a datasets save_to_disk folder"
                )
            for p, k in usable:
                if not remote and k != "hf_disk":
                    _check_regular(p)
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
    """The file's bytes, gunzipped for ``.gz``.

    Python's gzip over the raw stream, not Beam's ``CompressedFile``: that one is not iterable,
    and at a truncated gzip member it stops silently, so the rest of the file would vanish
    without a trace; ``gzip.GzipFile`` raises EOFError (see :func:`read_file`).
    """
    with open_raw(path) as raw:
        if path.lower().endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                yield gz
        else:
            yield raw


def parse_line(raw: bytes, max_bytes: int, first: bool = False) -> Any:
    """One JSONL line -> its record, or a Rejected saying why not. ``first``: line 1 of its file.

    orjson parses the common case (several times faster than ``json``); anything it refuses is
    parsed again by ``json`` for the exact error, a byte-order mark, NaN, or a lone surrogate.
    """
    if len(raw) > max_bytes:
        return Rejected(Reason.RECORD_TOO_LARGE, f"{len(raw)} bytes > --max-record-bytes {max_bytes}")
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    else:
        return record
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
        return Rejected(Reason.MALFORMED_JSON, "nesting too deep")
    return (_lone_surrogate(record) if _may_hold_surrogates(raw) else None) or record


def _lines(fh, first_line: int, stop: Optional[int], start: int) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of each line from the current position up to byte ``stop``.

    Lines end at LF, CRLF or a lone CR (old Mac files): raw CR and LF cannot occur inside a
    JSON value, so splitting at either never cuts a record.
    """
    lineno = first_line
    pos = start
    for raw in iter(fh.readline, b""):
        pos += len(raw)
        body = raw.rstrip(b"\r\n")
        if b"\r" in body:
            for part in body.split(b"\r"):
                yield lineno, part
                lineno += 1
        else:
            yield lineno, body
            lineno += 1
        if stop is not None and pos >= stop:
            return


def _jsonl(f: InputFile, max_bytes: int, start: int = 0, stop: Optional[int] = None,
           first_line: int = 1) -> Iterator[tuple[int, Any]]:
    with _open_bytes(f.path) as fh:
        if start:
            fh.seek(start)
        for lineno, raw in _lines(fh, first_line, stop, start):
            if raw.strip():  # blank lines are not records
                yield lineno, parse_line(raw, max_bytes, first=lineno == 1)


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


def _json(f: InputFile, max_bytes: int) -> Iterator[tuple[int, Any]]:
    with _open_bytes(f.path) as fh:
        data = fh.read()
    try:
        value = json.loads(data.decode("utf-8-sig"))  # a byte-order mark is not part of the JSON (as in JSONL)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        if isinstance(e, json.JSONDecodeError) and e.msg == "Extra data":
            # A .json file holding JSON lines: read it as JSONL.
            yield from _jsonl(f, max_bytes)
            return
        raise PackstreamError(f"input {f.path} is not valid JSON ({e}); fix the file or convert it to JSONL") from None
    items = value if isinstance(value, list) else [value]
    check_surrogates = _may_hold_surrogates(data)
    for i, item in enumerate(items):
        bad = _lone_surrogate(item) if check_surrogates else None
        if bad is not None:
            yield i, bad
            continue
        if max_bytes < 2**31 and isinstance(item, dict):
            size = len(json.dumps(item, ensure_ascii=False).encode())
            if size > max_bytes:
                yield i, Rejected(Reason.RECORD_TOO_LARGE, f"{size} bytes > --max-record-bytes {max_bytes}")
                continue
        yield i, item


def _table_batches(f: InputFile, start: int = 0, stop: Optional[int] = None) -> Iterator[list[dict]]:
    """Rows ``start:stop`` of a table input, in lists of up to 1024."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if f.kind == "hf_disk":
        import datasets

        ds = datasets.load_from_disk(f.path)
        if f.split:
            ds = ds[f.split]
        ds = ds.with_format("arrow")
        stop = len(ds) if stop is None else min(stop, len(ds))
        for i in range(start, stop, 1024):
            yield ds[i:min(i + 1024, stop)].to_pylist()
        return
    with open_raw(f.path) as fh:
        if f.kind == "parquet":
            pf = pq.ParquetFile(fh)
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
            first = 0
            for g, n in enumerate(sizes):  # tasks start and stop at row-group boundaries
                if first >= start and (stop is None or first < stop):
                    for batch in pf.iter_batches(batch_size=1024, row_groups=[g]):
                        yield batch.to_pylist()
                first += n
            return
        data = fh.read()
    try:
        reader = pa.ipc.open_stream(data)
        batches = iter(reader)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(data)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    for batch in batches:
        yield batch.to_pylist()


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


def plan_tasks(f: InputFile, task_bytes: int = TASK_BYTES) -> list[ReadTask]:
    """The read tasks of one input. Splitting a JSONL file counts its lines once (fast: a byte scan)."""

    if f.kind == "jsonl" and not f.path.lower().endswith(".gz"):
        tasks, start, line = [], 0, 1
        with open_raw(f.path) as fh:
            pos, pending = 0, 0
            while True:
                block = fh.read(8 * 2**20)
                if not block:
                    break
                cut = 0
                while pos + len(block) - start >= task_bytes:
                    nl = block.find(b"\n", max(cut, start + task_bytes - pos - 1))
                    if nl < 0:
                        break
                    pending += block.count(b"\n", cut, nl + 1)
                    tasks.append(ReadTask(f, start, pos + nl + 1, line))
                    line += pending
                    pending, start, cut = 0, pos + nl + 1, nl + 1
                pending += block.count(b"\n", cut)
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
        n, last = 0, b"\n"
        with _open_bytes(f.path) as fh:
            for block in iter(lambda: fh.read(8 * 2**20), b""):
                n += block.count(b"\n") + block.count(b"\r") - block.count(b"\r\n")
                last = block[-1:]
        # a last line without a newline is a record too (blank lines count: this is an estimate)
        return n + (last not in (b"\n", b"\r"))
    if f.kind == "parquet":
        import pyarrow.parquet as pq

        with open_raw(f.path) as fh:
            return pq.ParquetFile(fh).metadata.num_rows
    if f.kind == "hf_disk":
        import datasets

        ds = datasets.load_from_disk(f.path)
        return len(ds[f.split] if f.split else ds)
    return sum(1 for _ in read_file(f, 2**31 - 1))


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
            records = enumerate((row for rows in _table_batches(f, t.start, t.stop) for row in rows), start=t.start)
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
