"""Inputs: the files, globs and folders of every data set -> checked :class:`InputFile` s.

Inputs are local, or anything Beam's ``FileSystems`` reads (gs://, s3://). Each input is checked
against its name before the job starts (its magic bytes; a small compressed stream decompressed
whole), so a mislabelled, empty or unsupported file is a clear CLI error naming the fix, not a
worker traceback.
"""

from __future__ import annotations

import dataclasses

import os
import posixpath
import zlib
from typing import NamedTuple, Sequence

from packers import PackstreamError
from packers.files import check_regular, check_utf8_name, show_path
from pipeline._read._files import (
    CODEC, COMPRESSIONS, CorruptStream, InputFile, compression, file_kind, fix_for, is_hf_disk, looks_like_data, open_bytes, open_raw,
    read_blocks, supported_text,
)
from pipeline._read._csv import csv_header
from pipeline._read._json import json_texts


def _sniff(path: str, kind: str, text_split: str = "") -> None:
    """Refuse a file whose bytes do not match its extension, or that is empty. Compressed: a stream whose
    first 4 KiB do not decompress (or a small one, with a break anywhere) is refused; a later break is
    the reader's ``corrupt_input`` dead letter."""
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
            raise PackstreamError(f"input {show_path(path)} ends in {c} but is not {CODEC[c]} data (starts with {head[:6]!r}); "
                                  "rename it to what it is, or recompress it")
        try:
            # A small file is decompressed whole here, so a break in it is a launch error (bounded: a
            # few KiB of zstd or xz can stand for gigabytes).
            with open_bytes(path) as fh:
                head = fh.read(4096)  # the bytes before a break, if any: the next read raises it
                if len(raw_head) < 4096:
                    for _ in read_blocks(fh, limit=64 * 2**20):
                        pass
        except (OSError, EOFError, ValueError, zlib.error) as e:  # a CorruptStream (an OSError), from any decompressor
            raise PackstreamError(f"input {show_path(path)} is a corrupt or truncated {CODEC[c]} file ({e}); re-create it") from None
    if kind == "parquet" and head[:4] != b"PAR1":
        raise PackstreamError(f"input {path} has extension .parquet but is not a Parquet file (starts with {head[:8]!r})")
    if kind == "arrow" and not (head[:6] == b"ARROW1" or head[:4] == b"\xff\xff\xff\xff"):
        raise PackstreamError(f"input {path} has extension .arrow but is not an Arrow IPC file (starts with {head[:8]!r})")
    if kind in ("jsonl", "json", "csv", "tsv", "text"):
        binary = next((what for magic, what in _MAGIC if head.startswith(magic)), None)
        if binary is not None:
            raise PackstreamError(f"input {show_path(path)} has extension .{kind} but is {binary} (starts with "
                                  f"{head[:8]!r}); give the file its own extension, or pack a text file of records")
        foreign = foreign_encoding(head)
        if foreign is not None:
            name, why, iconv = foreign
            raise PackstreamError(f"input {show_path(path)} is {name} ({why}), not UTF-8, which is what packstream reads: "
                                  f"convert it (iconv -f {iconv} -t UTF-8 FILE > COPY) and pack the copy")
    # Under --text-split file the whole file is one document: a blank one is its blank_text dead letter (docs/formats.md)
    blank_is_a_record = kind == "text" and text_split == "file"
    if kind in ("csv", "tsv", "text") and not head.lstrip(b"\xef\xbb\xbf \t\r\n") and not blank_is_a_record:
        raise PackstreamError(f"input {show_path(path)} holds only whitespace; remove it from the inputs")
    if kind in ("csv", "tsv"):
        try:
            csv_header(InputFile(path, path, kind), 2**24)  # a header that cannot key records: one error line
        except CorruptStream as e:  # it breaks off inside its header row: nothing to read
            raise PackstreamError(f"input {show_path(path)} is a corrupt or truncated {CODEC[c]} file, cut inside its "
                                  f"header row ({e}); re-create it") from None
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
                for _ in json_texts(InputFile(path, path, kind), 2**31 - 1):
                    pass
            except ValueError as e:
                raise PackstreamError(f"input {path} is not valid JSON ({e}); fix the file or convert it to JSONL") from None
        if kind == "jsonl" and stripped[:1] == b"[" and _one_line(path):
            raise PackstreamError(
                f"input {path} holds one JSON array on a single line, not JSON Lines (one object per line): its "
                "records would be one rejected line; rename it to .json"
            )


_MAGIC = ((b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
          (b"%PDF-", "a PDF document"), (b"PK\x03\x04", "a zip archive"), (b"\x1f\x8b", "gzip-compressed (name it .gz)"),
          (b"PAR1", "a Parquet file (name it .parquet)"), (b"ARROW1", "an Arrow IPC file (name it .arrow)"))
"""First bytes of binary formats that a text input named by a text extension is sometimes by mistake."""

_BOMS = ((b"\x00\x00\xfe\xff", "UTF-32 BE text", "UTF-32"), (b"\xff\xfe\x00\x00", "UTF-32 LE text", "UTF-32"),
         (b"\xff\xfe", "UTF-16 LE text", "UTF-16"), (b"\xfe\xff", "UTF-16 BE text", "UTF-16"))
"""Byte-order marks of the encodings a text input is refused in, with the encoding's name and iconv's."""


def foreign_encoding(head: bytes) -> "tuple[str, str, str] | None":
    r"""(what the file is, how it shows, iconv's name for it) when the first bytes of a text input say it is not
    UTF-8: a UTF-16/32 byte-order mark, or NUL bytes, which UTF-8 text never holds and JSON and CSV cannot, in more
    than a tenth of them (UTF-16 without a mark: every other byte, on the odd side for little-endian). None for
    UTF-8 (its own mark included): a stray NUL or a line of Latin-1 is that line's ``invalid_utf8`` dead letter.
    Read as UTF-8, such a file is mojibake or a dead letter per line; it is refused whole, at launch.

    >>> foreign_encoding("a,b\n".encode("utf-16"))
    ('UTF-16 LE text', 'a byte-order mark FF FE', 'UTF-16')
    >>> foreign_encoding("hello".encode("utf-16-be"))
    ('UTF-16 BE text', 'no byte-order mark; NUL bytes in 5 of 10', 'UTF-16BE')
    >>> foreign_encoding("h\u00e9llo".encode()) is None
    True
    """
    for mark, name, iconv in _BOMS:
        if head.startswith(mark):
            return name, f"a byte-order mark {mark.hex(' ').upper()}", iconv
    nuls = head.count(0)
    if not head or nuls * 10 <= len(head):
        return None
    odd = head[1::2].count(0)
    said = f"NUL bytes in {nuls} of {len(head)}"
    if odd * 10 >= nuls * 9:
        return "UTF-16 LE text", f"no byte-order mark; {said}", "UTF-16LE"
    if (nuls - odd) * 10 >= nuls * 9:
        return "UTF-16 BE text", f"no byte-order mark; {said}", "UTF-16BE"
    return "binary data or UTF-32 text", f"{said}", "ENCODING"


def _one_line(path: str) -> bool:
    """Whether the file holds a single non-blank line (LF, CRLF or CR line ends)."""
    with open_bytes(path, at_break="end") as f:  # a break: the reader's corrupt_input, not a launch error
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


class Skipped(NamedTuple):
    """A file of a folder input that is not read, and why (the manifest's ``inputs_skipped``)."""

    path: str
    source: str
    """The path from the folder input's parent (``data/notes.csv``), as the summary shows it."""
    reason: str


def skip_reason(name: str) -> str:
    """Why a file of a folder input is not read (a ``.csv``, a ``.txt``, a ``README.md``): said in the summary and
    the manifest's ``inputs_skipped``, so every file of a folder is packed or accounted for (issue 35)."""
    ext = posixpath.splitext(name)[1].lower()
    said = f"{ext} is not" if ext else "a name without an extension is not"
    return f"skipped: {said} a supported input format (JSONL, JSON, CSV, TSV, text, Parquet, Arrow)"


TEXT_SKIPPED = ("skipped: a .txt file beside other data is taken for notes, not read; name it, or a glob such as "
                "'DIR/*.txt', as an input to read it as text")
"""Why a ``.txt`` file of a folder or glob that also holds other data (README.txt beside JSONL) is not read."""


def _text_beside_data(pattern: str, usable: list[tuple[str, str]]) -> list[str]:
    """The ``.txt`` files of a folder or glob input that also holds data of another kind (a README.txt, a
    LICENSE.txt, notes beside JSONL): not read, but listed as skipped (:data:`TEXT_SKIPPED`). A ``.txt`` file is
    read when the input names it, when a glob names ``.txt`` files (``*.txt``, ``**/*.txt.gz``), or when the
    folder holds text files only."""
    if not any(k == "text" for _, k in usable) or all(k == "text" for _, k in usable):
        return []
    base = posixpath.basename(pattern.rstrip("/")).lower()
    if file_kind(base) == "text":  # the file itself, or a glob of .txt names
        return []
    return [p for p, k in usable if k == "text"]


def _local_matches(pattern: str, skipped: "list[str] | None" = None) -> list[str]:
    """Absolute paths of the local files (or datasets folders) that ``pattern`` names.

    A name that exists is taken literally, before any glob expansion (so ``a[1].jsonl`` is that
    file); a folder is walked recursively, skipping hidden names (``.tmp-*``, ``.git``) and not
    following symlinked folders; otherwise the pattern is a glob (``**`` recursive). The other files
    of a walked folder (no reader's, and not named like data) are appended to ``skipped``.
    """
    import glob

    if os.path.lexists(pattern):
        path = os.path.abspath(pattern)
        if not os.path.isdir(path) or is_hf_disk(path):
            return [path]
        out: list[str] = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            if is_hf_disk(dirpath) and dirpath != path:
                out.append(dirpath)
                dirnames[:] = []
                continue
            for f in sorted(filenames):
                if f.startswith("."):
                    continue
                (out if file_kind(f) or looks_like_data(f) else skipped if skipped is not None else []).append(
                    os.path.join(dirpath, f))
        if not any(file_kind(p) or is_hf_disk(p) for p in out):
            raise PackstreamError(
                f"input folder {show_path(pattern)} holds no supported file (supported: {supported_text()}; hidden "
                f"names are skipped); {fix_for(out)}"
            )
        return out
    return sorted(os.path.abspath(p) for p in glob.glob(pattern, recursive=True)
                  if not os.path.isdir(p) or is_hf_disk(p))


def _remote_matches(pattern: str) -> list[str]:
    from pipeline import _fs

    if not _fs.is_remote(pattern):  # file://: read through Beam before, which has no file system for it
        raise PackstreamError(f"cannot read input {pattern!r}: give a local file as a plain path, not a file:// URL")
    if is_hf_disk(pattern):
        return [pattern.rstrip("/")]
    try:
        if _fs.exists(pattern):  # literal name first
            return [pattern]
        literal_dir = not any(c in pattern for c in "*?[")
        query = _fs.join(pattern, "**") if literal_dir else pattern
        return sorted(m.path for m in _fs.match(query))
    except Exception as e:  # noqa: BLE001 - Beam raises BeamIOError (or worse) for unreadable or unknown schemes
        raise PackstreamError(f"cannot read input {pattern!r}: {e}") from None


def expand_datasets(datasets) -> tuple[list[InputFile], list[str], list[Skipped]]:
    """Resolve every data set's files, globs and folders into checked inputs, plus notes on duplicates and
    the files of folder inputs that are not read (by path).

    Local paths are made absolute and de-duplicated by real path (``d/./x.jsonl``, a symlink to a
    file already named): the first name is kept and the others are noted. Each input's source
    name is its path relative to the common root of all inputs. A file named by two data sets is
    an error: it would be read twice, in two shapes.
    """
    found: list[tuple[str, str, int]] = []  # (path, kind, dataset)
    owner: dict[str, tuple[str, int]] = {}  # real path -> (first path, dataset)
    notes: list[str] = []
    not_read: dict[str, Skipped] = {}  # files of folder inputs that no reader takes, by path
    for d, spec in enumerate(datasets):
        for pattern in spec.paths:
            if not pattern:
                raise PackstreamError("an input path is empty; give a file, glob or folder")
            remote = "://" in pattern
            left: list[str] = []
            paths = _remote_matches(pattern) if remote else _local_matches(pattern, left)
            if not paths:
                raise PackstreamError(f"input {pattern!r} matches no file; check the path or the glob")
            usable = [(p, "hf_disk" if is_hf_disk(p) else file_kind(p)) for p in paths]
            skipped = [p for p, k in usable if not k]
            usable = [(p, k) for p, k in usable if k]
            if not usable:
                shown = ", ".join(show_path(posixpath.basename(p)) for p in skipped[:3]) + (", ..." if len(skipped) > 3 else "")
                raise PackstreamError(f"input {show_path(pattern)} matches no supported file ({shown}); supported: "
                                      f"{supported_text()}; {fix_for(skipped)}")
            notes_txt = _text_beside_data(pattern, usable)
            usable = [(p, k) for p, k in usable if p not in notes_txt]
            unread = [p for p in skipped if looks_like_data(posixpath.basename(p))]
            if unread:  # data no reader supports is refused, never skipped in silence
                shown = ", ".join(show_path(posixpath.basename(p)) for p in unread[:3]) + (", ..." if len(unread) > 3 else "")
                raise PackstreamError(f"input {show_path(pattern)} holds {len(unread)} file(s) no reader supports "
                                      f"({shown}); {fix_for(unread)}, or name only the files to read")
            root = _pattern_root(pattern, remote)
            for p in left + skipped + notes_txt:  # a folder's other files, or a glob's: said, never skipped in silence
                source = p[len(root):].lstrip("/") if p.startswith(root) else p
                why = TEXT_SKIPPED if p in notes_txt else skip_reason(posixpath.basename(p))
                not_read.setdefault(p, Skipped(p, source, why))
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
    for p, k, d in found:
        if k != "hf_disk":
            _sniff(p, k, datasets[d].format.text_split.value if k == "text" else "")
    found.sort(key=lambda t: t[0])
    root = _common_root([p for p, _, _ in found])
    out = []
    for p, k, d in found:
        source = source_name(p, root)
        if k == "hf_disk":
            out.extend(_hf_splits(p, source, d, datasets[d].split))
        else:
            split = datasets[d].format.text_split.value if k == "text" else ""
            out.append(InputFile(p, source, k, dataset=d, text_split=split))
    return out, notes, [not_read[p] for p in sorted(not_read)]


def source_name(path: str, root: str) -> str:
    """An input's source name: its path relative to ``root``, the common root of all the run's inputs (a datasets
    folder adds ``[split]``, see :func:`expand_datasets`)."""
    source = path[len(root):].lstrip("/") if root else path
    return source or posixpath.basename(path.rstrip("/"))


def rename_sources(files: Sequence[InputFile]) -> list[InputFile]:
    """``files`` in the order :func:`expand_datasets` gives a run's inputs (by path, a datasets folder's splits in
    turn), each named as that run names it: by the common root of them all. ``packstream repack`` names the inputs
    of several packed folders, and raw inputs beside them, as one ``pack`` over them all would."""
    ordered = sorted(files, key=lambda f: (f.path, f.split))
    root = _common_root(sorted({f.path for f in ordered}))
    out = []
    for f in ordered:
        base = source_name(f.path, root)
        source = f"{base}[{f.split}]" if f.kind == "hf_disk" and f.split else base
        out.append(dataclasses.replace(f, source=source))
    return out


def expand_inputs(patterns: tuple[str, ...]) -> list[InputFile]:
    """The inputs of one data set (see :func:`expand_datasets`)."""
    from pipeline._options import DatasetSpec, FormatOptions

    return expand_datasets((DatasetSpec(name="default", paths=tuple(patterns), format=FormatOptions()),))[0]


def _pattern_root(pattern: str, remote: bool) -> str:
    """The folder a skipped file's source is shown from: the parent of a folder input (``data`` ->
    ``data/notes.csv``), or of a glob's fixed part (``data/*`` -> ``data/notes.csv``)."""
    fixed = pattern[: min((pattern.find(c) for c in "*?[" if c in pattern), default=len(pattern))]
    return posixpath.dirname((fixed if remote else os.path.abspath(fixed)).rstrip("/"))


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


def relative_input(path: str) -> bool:
    """Whether an INPUT is a local path relative to the working folder (not absolute, not ``gs://``...)."""
    return "://" not in path and not os.path.isabs(os.path.expanduser(path))
