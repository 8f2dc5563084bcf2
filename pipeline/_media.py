"""Images of a ``--processor`` run: a record's references -> what a row carries, and how many tokens each is.

A reference is what the record holds (:attr:`pipeline._formats.Conversation.images`)::

    "photos/cat.jpg"                     a path: relative to --media-root, else to the input file's folder
    "file:///data/cat.jpg"               a file URI
    "data:image/png;base64,iVBOR..."     a data URL: its bytes
    {"bytes": b"...", "path": "x.png"}   Hugging Face datasets' Image (Parquet/Arrow struct columns): bytes first
    b"\\x89PNG..."                        encoded bytes
    "https://..."                        refused (remote_image): packing is offline

and becomes an :class:`Image`: ``{path, bytes}`` as the row's ``images`` column stores it (an absolute
path or URI with no bytes, or the bytes with the name the record gave), its size read from the file's
header with PIL (no pixel is decoded), its patch grid and its token count from the run's
:class:`packers.VisionSpec`. Anything that cannot be read or sized is a :class:`Rejected`
(``bad_image``) naming the image and the error.
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

from packers import ImageSizeError, VisionSpec
from pipeline._formats import Reason, Rejected

_SHOWN = 80


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
    try:
        with PILImage.open(io.BytesIO(data) if data is not None else path) as im:
            size = im.size
            im.draft("RGB", (max(1, size[0] // 8), max(1, size[1] // 8)))
            im.load()
            return size
    except FileNotFoundError:
        raise Rejected(Reason.BAD_IMAGE, f"{at}: image {what} does not exist; give paths relative to the input "
                                         "file's folder, or set --media-root") from None
    except Exception as e:  # noqa: BLE001 - every way a file fails to decode is a dead letter with its reason
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise Rejected(Reason.BAD_IMAGE, f"{at}: image {what} cannot be read ({type(e).__name__}: {_short(first)}); "
                                         "replace the file or drop the record") from None


def measure(refs: Sequence[Any], base: str, spec: VisionSpec) -> list[Image]:
    """The images of one example, resolved against ``base`` and sized under ``spec``; or :class:`Rejected`."""
    out = []
    for k, ref in enumerate(refs):
        at = f"image {k + 1} of {len(refs)}"
        path, data = resolve(ref, base, at)
        width, height = image_size(path, data, at)
        try:
            grid = spec.image_grid(width, height)
        except ImageSizeError as e:
            raise Rejected(Reason.BAD_IMAGE, f"{at} ({_short(path) if path else 'bytes'}): {e}") from None
        out.append(Image(path, data, grid, spec.grid_tokens(grid)))
    return out
