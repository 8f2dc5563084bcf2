"""One checked way to open a file a user names: inputs, templates, configs, manifests, shards, dead letters.

Every reader and tool opens user-named files through :func:`open_checked` or :func:`read_checked`,
so the same rules hold everywhere:

* **Regular files only.** A FIFO would block the reader forever, ``/dev/zero`` never ends, a
  socket or a folder is not data. Local files are opened with ``O_NONBLOCK`` (opening a FIFO
  cannot block) and judged by ``fstat`` of the opened descriptor, so a file swapped for a FIFO
  between a check and the open is still caught. Symlinks are followed: what counts is what they
  point at.
* **A size cap where the format has one.** :func:`read_checked` refuses a file larger than its
  ``limit`` before reading it, and never reads more than ``limit + 1`` bytes even if the file
  grows or lies about its size (a remote object, a file still being written).
* **A bounded parser depth.** :func:`load_json` parses with the standard library (``packers``
  needs no other JSON library) and turns the parser's own failures (nesting deeper than
  :data:`MAX_JSON_DEPTH`, an integer longer than Python converts, invalid UTF-8) into one
  :class:`~packers.PackstreamError` line.

Messages name the file, what it is, the limit and the fix. Paths are shown through
:func:`show_path`, so a newline or other control character in a name cannot split an
``error:`` line.

>>> show_path("out\\nput")
"'out\\\\nput'"
>>> load_json(b'{"a": [1, 2]}', what="manifest.json")
{'a': [1, 2]}
>>> load_json(b"[" * 600 + b"]" * 600, what="manifest.json")
Traceback (most recent call last):
...
packers.errors.PackstreamError: manifest.json: JSON nested deeper than 512 levels; this is not a file packstream wrote or reads

A shared contract module: the pipeline (writer, verify, inspect) and the loader both use it, so it
has no leading underscore; users reach the same names through :mod:`packers`.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import IO, Any, Callable, Optional

from packers.errors import PackstreamError

MAX_JSON_DEPTH = 512
"""The deepest JSON nesting any packstream file or input record may have. A manifest nests 4 levels,
a conversation record rarely 10; Python's parser would raise RecursionError near 1,000."""

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def show_path(path: Any) -> str:
    """A path as it may appear inside a one-line message: as given when it is printable, else quoted with
    escapes (a newline or a terminal escape in a file name must not split or colour the line)."""
    s = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return s if s.isprintable() else repr(s)


def check_utf8_name(path: str, what: str) -> None:
    """Refuse a path whose name is not UTF-8 (bytes the file system could not decode, held as surrogate escapes):
    source names, example ids, the manifest and Arrow all store names as UTF-8 text."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise PackstreamError(f"{what} {show_path(path)} has a name that is not valid UTF-8; packstream stores names "
                              "as UTF-8: rename it (e.g. convmv -f latin1 -t utf8), or link it under a UTF-8 name and "
                              "give that") from None


def _what(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def _human(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} bytes"


def check_regular(path: str, what: str) -> os.stat_result:
    """``os.stat(path)`` of a regular local file (symlinks followed), else a PackstreamError naming what it is."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise PackstreamError(f"cannot read {what} {show_path(path)}: {e.strerror or e}; check the path and its permissions") from None
    if not stat.S_ISREG(st.st_mode):
        raise PackstreamError(
            f"{what} {show_path(path)} is {_what(st.st_mode)}; packstream reads regular files only: copy the data to a file"
        )
    return st


def open_checked(path: str, *, what: str, opener: Optional[Callable[[str], IO[bytes]]] = None) -> IO[bytes]:
    """A binary file object for reading the user-named ``path``, which must be a regular file.

    ``what`` says what the file is for ("input", "manifest.json", "--config file") and starts every
    message. ``opener`` opens anything that is not a local path (``gs://``, ``s3://``): remote stores
    have no FIFOs or devices, so only the size rules of :func:`read_checked` apply there.
    """
    path = os.fspath(path)
    if "://" in path and not path.startswith("file://"):
        if opener is None:
            raise PackstreamError(f"{what} {show_path(path)}: remote paths are not readable here; copy the file locally")
        try:
            return opener(path)
        except PackstreamError:
            raise
        except Exception as e:  # noqa: BLE001 - object stores raise their own types (BeamIOError, ClientError, ...)
            raise PackstreamError(f"cannot read {what} {show_path(path)}: {type(e).__name__}: {e}") from None
    if path.startswith("file://"):
        path = path[len("file://"):]
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise PackstreamError(f"cannot read {what} {show_path(path)}: {e.strerror or e}; check the path and its permissions") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PackstreamError(
                f"{what} {show_path(path)} is {_what(st.st_mode)}; packstream reads regular files only: copy the data to a file"
            )
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class OutsideRoot(PackstreamError):
    """A path that leads outside the folder it must stay in (:func:`within` and :func:`open_beneath`); the
    path, its real target and the root are carried as data."""

    def __init__(self, path: str, target: str, root: str, what: str, moved: bool = False) -> None:
        self.path, self.target, self.root = path, target, root
        how = ("changed while it was opened (a link appeared in it)" if moved else
               f"leads to {show_path(target)}" + (" through a link" if target != os.path.abspath(path) else ""))
        super().__init__(f"{what} {show_path(path)} {how}, outside {show_path(root)}; only files under that folder "
                         "are read")


def real_folder(path: str) -> str:
    """The absolute, real (links resolved) path of the folder ``path``: the root :func:`within` and
    :func:`open_beneath` hold paths under."""
    return os.path.realpath(os.path.abspath(path))


def within(root: str, path: str, *, what: str) -> str:
    """The real path of ``path`` (absolute, every link resolved, ``..`` applied), which must lie under the real
    folder ``root`` (:func:`real_folder`), else :class:`OutsideRoot`. A look-up, not a read:
    :func:`open_beneath` opens the result so that the check also holds at open time.

    >>> within("/data", "/data/a/../b.png", what="image")
    '/data/b.png'
    >>> within("/data", "/data/../etc/x.png", what="image")
    Traceback (most recent call last):
    ...
    packers.files.OutsideRoot: image /data/../etc/x.png leads to /etc/x.png, outside /data; only files under that folder are read
    """
    real = os.path.realpath(path)
    if not under(root, real):
        raise OutsideRoot(path, real, root, what)
    return real


def under(root: str, path: str) -> bool:
    """Whether ``path`` is ``root`` or lies beneath it, by their text (resolve links first where they count).

    >>> under("/data", "/data/a.png"), under("/data", "/data2/a.png"), under("/", "/etc")
    (True, False, True)
    """
    return path == root or path.startswith(root if root.endswith(os.sep) else root + os.sep)


def open_beneath(root: str, real: str, *, what: str) -> IO[bytes]:
    """:func:`open_checked` of ``real`` (a real path under the real folder ``root``, as :func:`within` gives it),
    opened so that it is still under ``root`` when it is opened: each component is opened from its parent's
    descriptor, starting at ``root``'s, with ``O_NOFOLLOW``. ``real`` holds no links, so a link met on the way
    means a component was swapped for one after the look-up (it could lead out): :class:`OutsideRoot`, never
    followed. A missing file, a FIFO, a device or a folder fail as in :func:`open_checked`."""
    if not under(root, real):
        raise OutsideRoot(real, real, root, what)
    if os.open not in os.supports_dir_fd or not hasattr(os, "O_NOFOLLOW"):  # no descriptor-relative opens here
        f = open_checked(real, what=what)
        if not under(root, os.path.realpath(real)):
            f.close()
            raise OutsideRoot(real, os.path.realpath(real), root, what, moved=True)
        return f
    rel = os.path.relpath(real, root)
    parts = [] if rel == os.curdir else rel.split(os.sep)  # the root itself: a folder, refused below as one
    nofollow = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        parent = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise PackstreamError(f"cannot read {what} {show_path(real)}: the folder {show_path(root)}: "
                              f"{e.strerror or e}; check the path and its permissions") from None
    try:
        for k, part in enumerate(parts):
            last = k == len(parts) - 1
            flags = (os.O_RDONLY | nofollow | (getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) if last
                                               else getattr(os, "O_DIRECTORY", 0)))
            try:
                fd = os.open(part, flags, dir_fd=parent)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR, getattr(errno, "EMLINK", errno.ELOOP)):
                    if os.path.islink(os.path.join(root, *parts[:k + 1])) or e.errno == errno.ELOOP:
                        raise OutsideRoot(real, real, root, what, moved=True) from None
                raise PackstreamError(f"cannot read {what} {show_path(real)}: {e.strerror or e}; check the path and "
                                      "its permissions") from None
            os.close(parent)
            parent = fd
        fd, parent = parent, -1
    finally:
        if parent >= 0:
            os.close(parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PackstreamError(
                f"{what} {show_path(real)} is {_what(st.st_mode)}; packstream reads regular files only: copy the data "
                "to a file"
            )
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_checked(path: str, *, what: str, limit: int, fix: str = "",
                 opener: Optional[Callable[[str], IO[bytes]]] = None) -> bytes:
    """The bytes of the user-named regular file ``path``, at most ``limit`` of them.

    A larger file is refused before it is read (local files, by their size) or as soon as ``limit``
    is passed (anything else); ``fix`` ends that message (the default says the file is not one
    packstream wrote or reads).
    """
    with open_checked(path, what=what, opener=opener) as f:
        try:
            size = os.fstat(f.fileno()).st_size
        except (OSError, AttributeError, ValueError, NotImplementedError):  # a remote stream has no descriptor
            size = None
        if size is not None and size > limit:
            raise PackstreamError(
                f"{what} {show_path(path)} is {_human(size)}, more than the {_human(limit)} a {what} may hold; "
                f"{fix or 'this is not a file packstream wrote or reads'}"
            )
        try:
            data = f.read(limit + 1)
        except OSError as e:
            raise PackstreamError(f"cannot read {what} {show_path(path)}: {e.strerror or e}") from None
        if len(data) > limit:
            raise PackstreamError(
                f"{what} {show_path(path)} holds more than the {_human(limit)} a {what} may hold; "
                f"{fix or 'this is not a file packstream wrote or reads'}"
            )
        return data


def load_json(data: bytes | str, *, what: str, fix: str = "") -> Any:
    """Parse JSON ``data`` (UTF-8, a byte-order mark allowed) with a bounded depth; any failure is one
    PackstreamError line naming ``what`` and ending with ``fix`` (by default: not valid JSON says nothing more,
    the rest say the file is not one packstream wrote or reads)."""
    also = f"; {fix}" if fix else ""
    fix = fix or "this is not a file packstream wrote or reads"
    try:
        text = data.decode("utf-8-sig") if isinstance(data, (bytes, bytearray)) else data
    except UnicodeDecodeError as e:
        raise PackstreamError(f"{what}: not UTF-8 text (byte {e.start}: {e.reason}); {fix}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise PackstreamError(f"{what}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}){also}") from None
    except RecursionError:
        value = _TOO_DEEP
    except ValueError as e:  # an integer of more than 4,300 digits
        raise PackstreamError(f"{what}: JSON that cannot be read ({str(e)[:120]}){also}") from None
    if value is _TOO_DEEP or value_depth(value) > MAX_JSON_DEPTH:
        raise PackstreamError(f"{what}: JSON nested deeper than {MAX_JSON_DEPTH} levels; {fix}")
    return value


_TOO_DEEP = object()


def value_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """The nesting depth of a parsed JSON-like value (dicts and lists), counted without recursion and
    stopping once past ``limit``: ``value_depth(1) == 0``, ``value_depth([[1]]) == 2``.

    >>> value_depth({"a": [{"b": 1}]})
    3
    """
    if not isinstance(value, (dict, list, tuple)):
        return 0
    level, depth = [value], 0
    while level:  # breadth first, one list of the containers per level
        depth += 1
        if depth > limit:
            return depth
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v)
                 if isinstance(c, (dict, list, tuple))]
    return depth


def not_a_file(path: str) -> Optional[str]:
    """What the local entry ``path`` is when it is there but no regular file can be read from it, as a message
    says it: ``"a FIFO (named pipe)"``, ``"a folder"``, ``"a socket"``, ``"a device"``, ``"a link to X, which does
    not exist"``, ``"a link loop"``; None for a regular file (links followed). No entry at all (not even a dangling
    link: ``os.lstat`` finds nothing) raises FileNotFoundError, so that a caller can tell "absent" from "broken".

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     os.symlink("gone.json", os.path.join(d, "config.json"))
    ...     not_a_file(os.path.join(d, "config.json")), not_a_file(d)
    ('a link to gone.json, which does not exist', 'a folder')
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "a link loop (links that lead back to themselves)"
            target = show_path(os.readlink(path))
            if e.errno == errno.ENOENT:
                return f"a link to {target}, which does not exist"
            return f"a link to {target}, which cannot be followed ({e.strerror or e})"
    return None if stat.S_ISREG(st.st_mode) else _what(st.st_mode)
