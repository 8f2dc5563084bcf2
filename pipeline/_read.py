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

import dataclasses
import gzip
import json
import os
import posixpath
from typing import Any, Iterator

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


def _kind(path: str) -> str | None:
    low = path.lower()
    for exts, kind in ((_JSONL, "jsonl"), (_JSON, "json"), (_PARQUET, "parquet"), (_ARROW, "arrow")):
        if low.endswith(exts):
            return kind
    return None


def _is_hf_disk(path: str) -> bool:
    from apache_beam.io.filesystems import FileSystems

    return any(
        FileSystems.exists(FileSystems.join(path, name)) for name in ("state.json", "dataset_dict.json")
    )


def _sniff(path: str, kind: str) -> None:
    """Refuse a file whose bytes do not match its extension, or that is empty."""
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path, compression_type="uncompressed") as f:
        head = f.read(4096)
    if not head:
        raise PackstreamError(f"input {path} is empty; remove it from the inputs")
    if path.lower().endswith(".gz"):
        if head[:2] != b"\x1f\x8b":
            raise PackstreamError(f"input {path} ends in .gz but is not gzip data; rename it or recompress it")
        head = gzip.decompress(head) if len(head) < 4096 else _gunzip_head(path)
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


def _gunzip_head(path: str) -> bytes:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(path, compression_type="gzip") as f:
        return f.read(4096)


def expand_inputs(patterns: tuple[str, ...]) -> list[InputFile]:
    """Resolve files, globs and folders into a sorted, de-duplicated list of checked inputs."""
    from apache_beam.io.filesystems import FileSystems

    found: list[tuple[str, str]] = []  # (path, kind)
    for pattern in patterns:
        is_dir = os.path.isdir(pattern) if "://" not in pattern else False
        if is_dir or ("://" in pattern and _is_hf_disk(pattern)):
            if _is_hf_disk(pattern):
                found.append((pattern.rstrip("/"), "hf_disk"))
                continue
            pattern = FileSystems.join(pattern, "**")
        try:
            matches = FileSystems.match([pattern])[0].metadata_list
        except Exception as e:  # beam raises BeamIOError for unreadable or unknown schemes
            raise PackstreamError(f"cannot read input {pattern!r}: {e}") from None
        paths = sorted(m.path for m in matches)
        if not paths:
            raise PackstreamError(f"input {pattern!r} matches no file; check the path or the glob")
        usable = [(p, _kind(p)) for p in paths]
        usable = [(p, k) for p, k in usable if k]
        if not usable:
            raise PackstreamError(
                f"input {pattern!r} matches no supported file; supported: {', '.join(SUPPORTED)} "
                "or a datasets save_to_disk folder"
            )
        found.extend(usable)
    seen: dict[str, str] = {}
    for p, k in found:
        seen.setdefault(p, k)
    for p, k in seen.items():
        if k != "hf_disk":
            _sniff(p, k)
    paths = sorted(seen)
    root = _common_root(paths)
    out = []
    for p in paths:
        source = p[len(root):].lstrip("/") if root else p
        source = source or posixpath.basename(p.rstrip("/"))
        if seen[p] == "hf_disk":
            out.extend(_hf_splits(p, source))
        else:
            out.append(InputFile(p, source, seen[p]))
    return out


def _common_root(paths: list[str]) -> str:
    """The folder shared by all paths ('' for a single path's own folder handling)."""
    if not paths:
        return ""
    if len(paths) == 1:
        return posixpath.dirname(paths[0].rstrip("/"))
    root = posixpath.commonpath([p.replace("://", ":/") for p in paths]).replace(":/", "://", 1)
    return root if "://" not in paths[0] or "://" in root else ""


def _hf_splits(path: str, source: str) -> list[InputFile]:
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # datasets raises FileNotFoundError or ValueError on a broken folder
        raise PackstreamError(f"cannot open datasets folder {path}: {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        return [InputFile(path, f"{source}[{name}]", "hf_disk", name) for name in sorted(ds)]
    return [InputFile(path, source, "hf_disk")]


def _jsonl(f: InputFile, max_bytes: int) -> Iterator[tuple[int, Any]]:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(f.path) as fh:  # compression inferred from the extension
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue  # blank lines are not records
            if len(raw) > max_bytes:
                yield lineno, Rejected(
                    Reason.RECORD_TOO_LARGE, f"{len(raw)} bytes > --max-record-bytes {max_bytes}"
                )
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, Rejected(Reason.INVALID_UTF8, f"byte {e.start}: {e.reason}")
                continue
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError as e:
                yield lineno, Rejected(Reason.MALFORMED_JSON, f"{e.msg} at column {e.colno}")
            except RecursionError:
                yield lineno, Rejected(Reason.MALFORMED_JSON, "nesting too deep")


def _json(f: InputFile, max_bytes: int) -> Iterator[tuple[int, Any]]:
    from apache_beam.io.filesystems import FileSystems

    with FileSystems.open(f.path) as fh:
        data = fh.read()
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        if isinstance(e, json.JSONDecodeError) and e.msg == "Extra data":
            # A .json file holding JSON lines: read it as JSONL.
            yield from _jsonl(f, max_bytes)
            return
        raise PackstreamError(f"input {f.path} is not valid JSON ({e}); fix the file or convert it to JSONL") from None
    items = value if isinstance(value, list) else [value]
    for i, item in enumerate(items):
        if max_bytes < 2**31 and isinstance(item, dict):
            size = len(json.dumps(item, ensure_ascii=False).encode())
            if size > max_bytes:
                yield i, Rejected(Reason.RECORD_TOO_LARGE, f"{size} bytes > --max-record-bytes {max_bytes}")
                continue
        yield i, item


def _table_batches(f: InputFile) -> Iterator[list[dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from apache_beam.io.filesystems import FileSystems

    if f.kind == "hf_disk":
        import datasets

        ds = datasets.load_from_disk(f.path)
        if f.split:
            ds = ds[f.split]
        for batch in ds.with_format("arrow").iter(batch_size=1024):
            yield batch.to_pylist()
        return
    with FileSystems.open(f.path, compression_type="uncompressed") as fh:
        if f.kind == "parquet":
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=1024):
                yield batch.to_pylist()
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


def read_file(f: InputFile, max_bytes: int) -> Iterator[tuple[int, Any]]:
    """``(position, record or Rejected)`` for every record of one input."""
    if f.kind == "jsonl":
        yield from _jsonl(f, max_bytes)
    elif f.kind == "json":
        yield from _json(f, max_bytes)
    else:
        i = 0
        for rows in _table_batches(f):
            for row in rows:
                yield i, row
                i += 1
