"""3-D rotary positions (mRoPE) of one vision-language example, as Qwen2-VL computes them for it alone.

Qwen2-VL, Qwen2.5-VL and Qwen3-VL rotate each token by three positions: temporal, height and width. A text token
gets its index three times; an image's placeholder tokens get the image's merged patch grid, offset by
the position where the image starts; after an image, positions go on from that start plus the image's
longer merged side (``max(h, w) // merge``), not from its token count. The same arithmetic as
``Qwen2VLModel.get_rope_index`` (transformers 5.x, ``models/qwen2_vl/modeling_qwen2_vl.py``) for one
sequence; Qwen2.5-VL's differs only for videos (its temporal spacing), which packstream refuses. Qwen3-VL's
``Qwen3VLModel.get_rope_index`` gives images the same positions (its ``get_vision_position_ids``, the image runs found
by ``mm_token_type_ids``; ``tests/test_vision_qwen3.py`` holds the two equal). A Qwen3-VL video is one timestamped
run per frame group, each positioned as an image of grid ``(1, h, w)``: :class:`packers.Collator` passes the groups
(``tests/test_vision_qwen3_video.py``).

An example of 7 tokens: ``a b <img> <img> <img> <img> c`` holding one image of patch grid (1, 4, 4) at
token 2 (merge 2: a 2 x 2 grid of merged patches, 4 tokens)::

    token        a  b  I  I  I  I  c
    temporal     0  1  2  2  2  2  4
    height       0  1  2  2  3  3  4
    width        0  1  2  3  2  3  4
                       ^ start 2       after the image: 2 + max(4, 4) // 2 = 4

>>> mrope_positions(7, [2], [(1, 4, 4)], merge_size=2).tolist()
[[0, 1, 2, 2, 2, 2, 4], [0, 1, 2, 2, 3, 3, 4], [0, 1, 2, 3, 2, 3, 4]]

Two images with no text token between them have no such positions: ``get_rope_index`` takes touching image runs
for one image (and raises), so :class:`packers.Collator` refuses those rows; this function numbers each image on
its own.

A text-only example's positions are 0, 1, 2, ... in all three rows:

>>> mrope_positions(3, [], [], merge_size=2).tolist()
[[0, 1, 2], [0, 1, 2], [0, 1, 2]]
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from packers.errors import ContractError


def mrope_positions(length: int, image_offsets: Sequence[int], image_grid_thw: Sequence[Sequence[int]] | np.ndarray,
                    merge_size: int, time_scale: Sequence[float] | np.ndarray | None = None) -> np.ndarray:
    """``(3, length)`` int64 (temporal, height, width) positions of one example of ``length`` tokens whose images
    start at ``image_offsets`` (token offsets in the example, increasing), of patch grids ``image_grid_thw``
    (``(t, h, w)`` each, as the processor gives them); ``merge_size``: the vision tower's spatial merge.

    Videos are numbered the same way (their runs among the images, in token order), the temporal index stepping
    once per temporal patch (Qwen2-VL); ``time_scale`` (one per image or video, 0 for none): Qwen2.5-VL's
    ``tokens_per_second * second_per_grid_ts`` of a video, its temporal index ``int(k * scale)`` computed in float32
    as ``get_vision_position_ids`` does (still the start plus the longer merged side after it).

    A video of two temporal patches of 1 x 1 merged patch each at token 1, its steps 2.5 apart: temporal 1 + 0 and
    1 + int(2.5); after it, positions go on from 1 + max(2, 2) // 2 = 2.

    >>> mrope_positions(6, [1], [(2, 2, 2)], merge_size=2, time_scale=[2.5]).tolist()
    [[0, 1, 3, 2, 3, 4], [0, 1, 1, 2, 3, 4], [0, 1, 1, 2, 3, 4]]
    """
    scales = None if time_scale is None else np.asarray(time_scale, dtype=np.float32).reshape(-1)
    grids = np.asarray(image_grid_thw, dtype=np.int64).reshape(-1, 3)
    offsets = np.asarray(image_offsets, dtype=np.int64).reshape(-1)
    if offsets.shape[0] != grids.shape[0]:
        raise ContractError(f"{offsets.shape[0]} image offsets for {grids.shape[0]} image grids; one grid per image")
    out = np.empty((3, length), dtype=np.int64)
    at, pos = 0, 0  # next token, and its position
    for i, (off, (t, h, w)) in enumerate(zip(offsets.tolist(), grids.tolist())):
        gt, gh, gw = t, h // merge_size, w // merge_size
        n = gt * gh * gw
        if off < at or off + n > length:
            raise ContractError(f"image {i}: {n} tokens at offset {off} overlap the previous image or run past the "
                                f"example's {length} tokens")
        out[:, at:off] = pos + np.arange(off - at)
        pos += off - at
        # get_vision_position_ids: a (t, h, w) meshgrid of the merged grid, every axis offset by the start.
        steps = np.arange(gt)
        if scales is not None and scales[i] > 0:  # Qwen2.5-VL video: (arange(t) * interval).long() in float32
            steps = (steps.astype(np.float32) * scales[i]).astype(np.int64)
        tt, hh, ww = np.meshgrid(steps, np.arange(gh), np.arange(gw), indexing="ij")
        out[0, off:off + n] = tt.reshape(-1) + pos
        out[1, off:off + n] = hh.reshape(-1) + pos
        out[2, off:off + n] = ww.reshape(-1) + pos
        pos += max(h, w) // merge_size
        at = off + n
    out[:, at:] = pos + np.arange(length - at)
    return out
