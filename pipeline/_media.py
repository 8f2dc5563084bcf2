"""Images of a ``--processor`` run: a record's references -> what a row carries, and how many tokens each is.

A reference is what the record holds (:attr:`pipeline._formats.Conversation.images`)::

    "photos/cat.jpg"                     a path: relative to --media-root, else to the input file's folder
    "file:///data/cat.jpg"               a file URI
    "data:image/png;base64,iVBOR..."     a data URL: its bytes
    {"bytes": b"...", "path": "x.png"}   Hugging Face datasets' Image (Parquet/Arrow struct columns): bytes first
    b"\\x89PNG..."                        encoded bytes
    "https://..."                        refused (remote_image): packing is offline

and becomes an :class:`Image`: ``{path, bytes}`` as the row's ``images`` column stores it, its size read
from the file's header with PIL (and the image decoded once, cheaply, to catch a file cut short), its patch
grid and its token count from the run's :class:`packers.VisionSpec`. ``--images`` decides what a local path
becomes (bytes the record holds are stored as bytes either way, with the name the record gave)::

    --images reference  {"path": "/data/photos/cat.jpg", "bytes": None}       the absolute path; the loader reads it
    --images embed      {"path": "cat.jpg", "bytes": b"\\xff\\xd8\\xff..."}   the file's encoded bytes, read once
                                                                            (sized and checked from those bytes);
                                                                            its file name, as datasets' embed_storage

Anything that cannot be read or sized, or a file over :data:`MAX_EMBED_BYTES` to embed, is a
:class:`Rejected` (``bad_image``) naming the image and the error.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import urllib.parse
import urllib.request
from typing import Any, Optional, Sequence

from packers import ImageSizeError, PackstreamError, VisionSpec
from packers.files import open_checked
from pipeline._formats import Reason, Rejected
from pipeline._options import ImageStorage

_SHOWN = 80

MAX_EMBED_BYTES = 64 * 2**20
"""The largest image file ``--images embed`` stores in a row (64 MiB). Encoded training images are rarely over a
few MiB (a 12-megapixel JPEG is ~4 MiB, and Qwen2-VL's max_pixels downscales anything bigger); a larger file is
most often a raw scan or the wrong file, and rows and spill batches hold their images in one Arrow binary
column (at most 2 GiB per batch), so each image is bounded. A larger file is a ``bad_image`` dead letter naming
its size and this limit: re-encode it, or pack with ``--images reference``."""


@dataclasses.dataclass(frozen=True)
class Image:
    """One image of an example: as the row stores it, its grid ``(t, h, w)`` and its placeholder token count."""

    path: Optional[str]
    data: Optional[bytes]
    grid: tuple[int, int, int]
    tokens: int


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


def resolve(ref: Any, base: str, at: str) -> tuple[Optional[str], Optional[bytes]]:
    """A reference -> ``(path, bytes)`` as a row stores it: one of the two set (bytes keep the record's name)."""
    if isinstance(ref, dict):
        data, path = ref.get("bytes"), ref.get("path")
        if isinstance(data, (bytes, bytearray)) and data:
            return (path if isinstance(path, str) and path else None), bytes(data)
        if isinstance(path, str) and path:
            return resolve(path, base, at)
        raise Rejected(Reason.BAD_IMAGE, f"{at} is an image object with neither bytes nor a path (keys "
                                         f"{sorted(map(str, ref))}); give {{bytes, path}} as Hugging Face datasets do")
    if isinstance(ref, (bytes, bytearray)):
        return None, bytes(ref)
    if not isinstance(ref, str):
        raise Rejected(Reason.BAD_TYPE, f"{at} is {type(ref).__name__}, expected an image path, URL or bytes")
    low = ref[:16].lower()
    if low.startswith(("http://", "https://")):
        raise Rejected(Reason.REMOTE_IMAGE, f"{at} is the URL {_short(ref)!r}; packstream packs offline: download the "
                                            "images and give their local paths (relative ones resolve against "
                                            "--media-root)")
    if low.startswith("data:"):
        head, _, payload = ref.partition(",")
        if not head.lower().startswith("data:image/") or not head.lower().endswith(";base64"):
            raise Rejected(Reason.BAD_IMAGE, f"{at} is a data URL of {_short(head)!r}; an image data URL is "
                                             "data:image/<type>;base64,<data>")
        try:
            return None, base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise Rejected(Reason.BAD_IMAGE, f"{at}: the data URL's base64 does not decode ({e})") from None
    if low.startswith("file:"):
        ref = urllib.request.url2pathname(urllib.parse.urlparse(ref).path)
    elif "://" in ref[:32]:
        raise Rejected(Reason.REMOTE_IMAGE, f"{at} is the URI {_short(ref)!r}; packstream reads images from local "
                                            "paths only: copy them here and give their paths")
    path = os.path.abspath(os.path.join(base, os.path.expanduser(ref)))
    return path, None


def image_size(path: Optional[str], data: Optional[bytes], at: str) -> tuple[int, int]:
    """``(width, height)`` of an image that decodes: the size from its header, then the whole image read once (a
    JPEG at 1/8 scale, PIL's draft mode, so the check costs little), so that a file cut short or corrupt past its
    header is a dead letter here, not a crash in the training loader. Any failure of PIL's (it raises OSError,
    ValueError, SyntaxError, struct.error, DecompressionBombError, ... on bad files) is one."""
    from PIL import Image as PILImage

    what = repr(_short(path)) if path else f"{len(data or b'')} bytes"
    if data is None and not os.path.lexists(path):
        raise Rejected(Reason.BAD_IMAGE, f"{at}: image {what} does not exist; give paths relative to the input "
                                         "file's folder, or set --media-root")
    try:
        # A path is opened through the one checked open (packers.files): a FIFO, a device or a folder named as an
        # image is refused by its kind, never opened (a FIFO would block the worker for good).
        source = io.BytesIO(data) if data is not None else open_checked(path, what=f"{at}: image")
    except PackstreamError as e:
        raise Rejected(Reason.BAD_IMAGE, str(e)) from None
    try:
        with source, PILImage.open(source) as im:
            size = im.size
            im.draft("RGB", (max(1, size[0] // 8), max(1, size[1] // 8)))
            im.load()
            return size
    except Exception as e:  # noqa: BLE001 - every way a file fails to decode is a dead letter with its reason
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise Rejected(Reason.BAD_IMAGE, f"{at}: image {what} cannot be read ({type(e).__name__}: {_short(first)}); "
                                         "replace the file or drop the record") from None


def _amount(n: int) -> str:
    return f"{n:,} bytes" if n < 2**20 else f"{n / 2**20:.4g} MiB"


def read_image(path: str, at: str) -> bytes:
    """The encoded bytes of the local image file ``path`` (``--images embed``), at most :data:`MAX_EMBED_BYTES`;
    a missing, unreadable or larger file (or a FIFO, a device, a folder) is :class:`Rejected` (``bad_image``).
    A file over the limit is refused by its size, before it is read."""
    limit = MAX_EMBED_BYTES
    if not os.path.lexists(path):
        raise Rejected(Reason.BAD_IMAGE, f"{at}: image {_short(path)!r} does not exist; give paths relative to the "
                                         "input file's folder, or set --media-root")
    try:
        with open_checked(path, what=f"{at}: image") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(limit + 1) if size <= limit else b""
    except PackstreamError as e:  # not a regular file, or no permission: its one line says which
        raise Rejected(Reason.BAD_IMAGE, str(e)) from None
    except OSError as e:
        raise Rejected(Reason.BAD_IMAGE, f"{at}: cannot read image {_short(path)!r} ({e.strerror or e}); replace "
                                         "the file or drop the record") from None
    size = max(size, len(data))
    if size > limit:
        raise Rejected(Reason.BAD_IMAGE, f"{at}: image {_short(path)!r} is {_amount(size)}, over the "
                                         f"{_amount(limit)} limit of an image embedded in a row (--images embed); "
                                         "re-encode or downscale it, or pack with --images reference")
    return data


def measure(refs: Sequence[Any], base: str, spec: VisionSpec,
            storage: ImageStorage = ImageStorage.REFERENCE) -> list[Image]:
    """The images of one example, resolved against ``base``, stored as ``storage`` says and sized under ``spec``;
    or :class:`Rejected`. With :attr:`ImageStorage.EMBED` a local file is read once: the row stores those bytes
    and they are what is sized and checked."""
    out = []
    for k, ref in enumerate(refs):
        at = f"image {k + 1} of {len(refs)}"
        path, data = resolve(ref, base, at)
        stored = path
        if storage is ImageStorage.EMBED and data is None:
            data, stored = read_image(path, at), os.path.basename(path)
        width, height = image_size(path, data, at)
        try:
            grid = spec.image_grid(width, height)
        except ImageSizeError as e:
            raise Rejected(Reason.BAD_IMAGE, f"{at} ({_short(path) if path else 'bytes'}): {e}") from None
        out.append(Image(stored, data, grid, spec.grid_tokens(grid)))
    return out
