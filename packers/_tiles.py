"""InternVL's dynamic tiles: how many square tiles an image becomes, from its width and height alone.

transformers' ``InternVLProcessor`` (``OpenGVLab/InternVL3-*-hf``) hands each image to its GotOcr2 image processor
with ``crop_to_patches=True``: the image is resized to a canvas of ``cols x rows`` tiles of ``size x size`` pixels,
the canvas chosen among every ``cols * rows`` in ``[min_patches, max_patches]`` for the aspect ratio closest to the
image's (ties: more tiles while the image's area exceeds half the canvas's), cut into those tiles row by row, and,
when there is more than one, followed by a thumbnail of the whole image at ``size x size``. Each tile is
``image_seq_length`` ``<IMG_CONTEXT>`` tokens; the image is ``<img>`` + those runs + ``</img>``.

Packed rows store an InternVL image's ``image_grid_thw`` as ``(tiles, rows, cols)``: the tiles the vision tower
gets (the thumbnail counted) and the canvas. The token count is ``tiles * image_seq_length``; the canvas lets a
loader check, from the image's size alone, that the image still tiles the same way.

>>> tile_grid(width=800, height=400, size=448, min_tiles=1, max_tiles=12)   # a 2 x 1 canvas + the thumbnail
(3, 1, 2)
>>> tile_grid(width=2000, height=1000, size=448, min_tiles=1, max_tiles=12)  # the tie broken for 4 x 2: a large image
(9, 2, 4)
>>> tile_grid(width=448, height=448, size=448, min_tiles=1, max_tiles=12)   # one tile: no thumbnail
(1, 1, 1)
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any, Mapping, Sequence

from packers.errors import PackstreamError
from packers._keys import Fixed

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
"""The normalization InternVL3-hf ships (transformers' convert_internvl_weights_to_hf.py writes these into its
GotOcr2ImageProcessorFast; GotOcr2's own class defaults are CLIP's, which InternVL never used)."""

# Image processor settings that change the pixels (never the token count) and that packstream's loader reproduces
# only at InternVL3-hf's values. Left out, each takes GotOcr2ImageProcessor's class default: InternVL3-hf's, but for
# the mean and std (CLIP's, which InternVL never used), which must be written.
FIXED: tuple[Fixed, ...] = (
    Fixed("do_resize", True), Fixed("do_rescale", True), Fixed("do_normalize", True), Fixed("do_convert_rgb", True),
    Fixed("rescale_factor", 1 / 255), Fixed("resample", 3),  # PIL bicubic
    Fixed("image_mean", list(IMAGENET_MEAN), default_ok=False), Fixed("image_std", list(IMAGENET_STD), default_ok=False),
)


@lru_cache(maxsize=64)
def _arrangements(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every ``(cols, rows)`` with ``min_tiles <= cols * rows <= max_tiles``, by tile count (a stable sort of the
    cols-major enumeration), as GotOcr2's ``get_all_supported_aspect_ratios`` lists them."""
    out = [(w, h) for w in range(1, max_tiles + 1) for h in range(1, max_tiles + 1)
           if min_tiles <= w * h <= max_tiles]
    return tuple(sorted(out, key=lambda g: g[0] * g[1]))


def canvas(width: int, height: int, size: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """``(cols, rows)``: the same arithmetic, in the same order of float operations, as transformers'
    ``got_ocr2.image_processing_pil_got_ocr2.get_optimal_tiled_canvas`` (tests/test_vision_internvl.py holds the
    two equal over generated sizes and limits)."""
    aspect = width / height
    area = width * height
    best_diff, best = float("inf"), (1, 1)
    for grid in _arrangements(min_tiles, max_tiles):
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best_diff, best = diff, grid
        elif diff == best_diff and area > 0.5 * size * size * grid[0] * grid[1]:
            best = grid
    return best


def tile_grid(width: int, height: int, size: int, min_tiles: int, max_tiles: int) -> tuple[int, int, int]:
    """``(tiles, rows, cols)`` of an image: the canvas, and the tiles the vision tower gets (the canvas's, plus the
    thumbnail when there is more than one). ``max_tiles`` 1 is one tile, as GotOcr2 skips the cropping then."""
    if max_tiles <= 1:
        return 1, 1, 1
    cols, rows = canvas(width, height, size, min_tiles, max_tiles)
    n = cols * rows
    return n + (1 if n > 1 else 0), rows, cols


def grid_problem(grid: Sequence[int], min_tiles: int, max_tiles: int) -> str | None:
    """Why ``grid`` (a row's ``(tiles, rows, cols)``) is no grid these limits give, or None. A canvas outside the
    limits, or a tile count that is not the canvas's (plus the thumbnail), is a row packed for another spec."""
    tiles, rows, cols = (int(v) for v in grid)
    n = rows * cols
    if max_tiles <= 1:
        ok = (tiles, rows, cols) == (1, 1, 1)
    else:
        ok = min_tiles <= n <= max_tiles and tiles == n + (1 if n > 1 else 0)
    if ok:
        return None
    return (f"is no InternVL tile grid (tiles, rows, cols) of min_patches {min_tiles}, max_patches {max_tiles}: a "
            f"{rows} x {cols} canvas gives {n + (1 if n > 1 else 0)} tiles with the thumbnail, within "
            f"{min_tiles}..{max_tiles} tiles")
