"""One decoding of an image file for the vision tower, at pack time and at load time: what transformers' image
processors see.

:func:`decode_rgb` is the RGB image the loader (:class:`packers.PixelLoader`) hands the processor; :func:`upright_size`
its size, which the packer (:mod:`pipeline._media`) and the loader's header-only grid check measure, so an image
whose EXIF orientation turns it a quarter is packed for the grid of its turned size, the one the processor gives.
PIL is imported on first use.
"""

from __future__ import annotations

import os
import struct
from typing import Any

TURNED = frozenset(range(2, 9))
"""The EXIF orientations ``PIL.ImageOps.exif_transpose`` turns or flips (1, or any other value: as stored)."""
QUARTER_TURNS = frozenset({5, 6, 7, 8})
"""The orientations that swap width and height."""
_EXIF_AT_OPEN = frozenset({"JPEG", "MPO", "WEBP", "GIF", "BMP"})
"""Formats whose EXIF (and XMP) PIL reads when it opens the file, which decoding leaves as it is."""
_PNG_METADATA = frozenset({b"eXIf", b"tEXt", b"zTXt", b"iTXt"})
"""PNG chunks that can carry an orientation (EXIF, ImageMagick's ``Raw profile type exif``, XMP)."""


def decode_rgb(image: Any) -> Any:
    """The RGB image transformers' image processors make of ``image`` (a PIL image as ``Image.open`` gives it), for
    every mode PIL opens. Two steps, each transformers' own:

    1. upright: the EXIF orientation applied, as ``PIL.ImageOps.exif_transpose`` applies it. That is what
       ``transformers.image_utils.load_image`` does to a file (a processor given a path, or a chat template naming
       one, loads it so) and what ``datasets``' ``Image`` feature does when it decodes a row's ``{path, bytes}``;
       a processor given a PIL image does not turn it itself. packstream reads files, so it follows ``load_image``.
    2. RGB: ``transformers.image_transforms.convert_to_rgb``, which each family's processor applies
       (``do_convert_rgb``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GotOcr2 for InternVL, Gemma 3, CLIP/LLaVA): an image with
       an alpha band (RGBA, LA, PA) or a transparency entry (``info["transparency"]``: a palette image's transparent
       index or alpha table, an L or RGB PNG's transparent colour) is converted to RGBA and composited onto opaque
       white; any other mode (RGB, L, P, 1, CMYK, YCbCr, I, I;16, F) is PIL's ``convert("RGB")`` (I, I;16 and F
       clip to 0..255, as PIL converts them; a 16-bit PNG's channels PIL already reads as 8-bit).

    ``load_image`` itself ends in ``convert("RGB")``, which drops alpha without compositing; the processors'
    conversion is the one followed here (a processor given ``load_image``'s output or a ``datasets`` image is given
    the same pixels for every image without transparency: tests/test_vision_pixels_modes.py)."""
    from PIL import Image, ImageOps

    image.load()
    if exif_orientation(image) in TURNED:
        image = ImageOps.exif_transpose(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:  # convert_to_rgb's test, as written
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def upright_size(image: Any) -> tuple[int, int]:
    """``(width, height)`` of ``image`` as :func:`decode_rgb` gives it: the header's size, swapped when the EXIF
    orientation turns it a quarter (5 to 8). No pixel is decoded where the header settles the orientation (JPEG,
    WebP, GIF, BMP, a PNG without a metadata chunk after its image data); otherwise (a TIFF, such a PNG, another
    format) the image is decoded first, as ``exif_transpose`` reads it."""
    width, height = image.size
    return (height, width) if exif_orientation(image) in QUARTER_TURNS else (width, height)


def exif_orientation(image: Any) -> int:
    """The EXIF orientation ``PIL.ImageOps.exif_transpose`` reads from ``image`` (1: none; it decodes the image, then
    reads ``getexif()``, which takes an XMP ``tiff:Orientation`` where EXIF has none). The same value without
    decoding where decoding cannot change it: a format whose metadata PIL reads at open, a PNG whose chunks after
    its image data carry no metadata; otherwise the image is decoded first, as ``exif_transpose`` does. (A TIFF PIL
    sizes upright at open and turns upright when it decodes it, dropping the tag: 1 then, and no second turn. Opened
    by its name, an uncompressed one PIL memory-maps is mapped at its turned size and comes out scrambled, PIL
    12.3's bug; packstream opens file objects and bytes, which PIL decodes right.)"""
    from PIL import ExifTags
    from PIL import Image as PILImage

    loaded = not getattr(image, "tile", None)
    if not loaded and image.format == "PNG" and _png_tail_is_bare(image):
        exif = PILImage.Image.getexif(image)  # PngImageFile.getexif would decode to look past the pixels
    else:
        if not loaded and image.format not in _EXIF_AT_OPEN:
            image.load()
        exif = image.getexif()
    value = exif.get(ExifTags.Base.Orientation, 1)
    return value if isinstance(value, int) else 1


def _png_tail_is_bare(image: Any) -> bool:
    """Whether no chunk after a not yet decoded PNG's first image-data chunk can carry metadata
    (:data:`_PNG_METADATA`): then decoding, which reads those chunks into ``image.info``, leaves its orientation as
    the header gives it. Read from the chunk headers alone (each chunk's data skipped), the file position restored."""
    fp = getattr(image, "fp", None)
    if fp is None or not image.tile:
        return False
    here = fp.tell()
    try:
        fp.seek(image.tile[0][2] - 8)  # the first IDAT's length and type, before its data
        while True:
            head = fp.read(8)
            if len(head) < 8:
                return False  # cut short: decoding tells what is there
            length, kind = struct.unpack(">I4s", head)
            if kind == b"IEND":
                return True
            if kind in _PNG_METADATA:
                return False
            fp.seek(length + 4, os.SEEK_CUR)  # the data and its CRC
    except (OSError, ValueError, struct.error):
        return False
    finally:
        fp.seek(here)
