"""Gemma 3 images: a fixed square, one run of soft tokens wrapped in blank lines, and a bidirectional image block.

transformers' ``Gemma3Processor`` (``google/gemma-3-*-it``; transformers 5.25 ``models/gemma3/processing_gemma3.py``)
resizes every image to one ``size x size`` square (``Gemma3ImageProcessor``: 896 x 896, bilinear, mean and std 0.5)
and replaces each ``<start_of_image>`` the chat template writes with its ``full_image_sequence``::

    "\\n\\n<start_of_image>" + "<image_soft_token>" * image_seq_length + "<end_of_image>\\n\\n"

before tokenizing the whole text, so the blank lines merge with the text around them as the tokenizer merges them.
:func:`expand` does that replacement on rendered text (one soft token per image; the packer repeats it to the
image's count afterwards), so the text around an image tokenizes as the processor's does.

In training the processor's ``token_type_ids`` (1 on the soft tokens) make each image's soft tokens attend to each
other both ways (modeling_gemma3 ``get_block_sequence_ids_for_mask``: one block per run of soft tokens).
:func:`token_type_ids` gives them for a packed row from its image offsets and counts.

Pan-and-scan (``do_pan_and_scan``: extra crops of a long image, each one more image sequence) is not counted here
and is refused (:func:`check_fixed`), as are pixel settings other than Gemma 3's own.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import numpy as np

from packers.errors import PackstreamError
from packers._keys import Fixed, check_fixed as _check_fixed

BOI, SOFT, EOI = "<start_of_image>", "<image_soft_token>", "<end_of_image>"
"""The tokenizer's ``boi_token``, ``image_token`` and ``eoi_token`` (google/gemma-3-*-it)."""
PROCESSORS = {"Gemma3ImageProcessor", "Gemma3ImageProcessorFast", "Gemma3ImageProcessorPil"}
MODELS = {"Gemma3Processor"}
SIDE, TOKENS = 896, 256
"""google/gemma-3-{4b,12b,27b}-it: preprocessor_config.json ``size`` 896 x 896 and ``image_seq_length`` 256
(config.json ``mm_tokens_per_image`` 256, SigLIP ``image_size`` 896 in 14-pixel patches: 64 x 64, average-pooled 4 x 4 to 16 x 16)."""

# Image processor settings that change the pixels (never the token count) and that packstream's loader reproduces
# only at Gemma 3's values: the key and the value it must have. A key absent takes Gemma3ImageProcessor's class
# default, which is that value (transformers 5.25: bilinear, IMAGENET_STANDARD mean/std 0.5, do_convert_rgb true,
# rescale 1/255). google's preprocessor_config.json writes do_convert_rgb and the pan-and-scan keys as null, and a null
# is NOT the class default there: transformers 5.25 keeps do_convert_rgb None, so its processor converts nothing
# (an RGB image comes out the same; a grayscale or RGBA one fails in its normalize, mean and channels disagreeing).
# packstream's loader converts every image to RGB first (packers.images.decode_rgb), so it accepts null: the pixels
# agree wherever transformers' own processor gives any.
FIXED: tuple[Fixed, ...] = (
    Fixed("do_resize", True), Fixed("do_rescale", True), Fixed("do_normalize", True), Fixed("do_convert_rgb", True),
    Fixed("rescale_factor", 1 / 255), Fixed("resample", 2),  # PIL bilinear
    Fixed("image_mean", [0.5, 0.5, 0.5]), Fixed("image_std", [0.5, 0.5, 0.5]),
)


def full_sequence(soft: int = 1) -> str:
    """What the processor writes for one image: ``soft`` soft tokens wrapped in ``<start_of_image>`` /
    ``<end_of_image>`` and blank lines (``Gemma3Processor.full_image_sequence``)."""
    return f"\n\n{BOI}{SOFT * soft}{EOI}\n\n"


def expand(text: str) -> str:
    """``text`` with each ``<start_of_image>`` replaced by the processor's image sequence (one soft token).

    >>> expand("<start_of_turn>user\\n<start_of_image>What is it?")
    '<start_of_turn>user\\n\\n\\n<start_of_image><image_soft_token><end_of_image>\\n\\nWhat is it?'
    """
    return text.replace(BOI, full_sequence()) if BOI in text else text


def token_type_ids(length: int, offsets: Sequence[int], counts: Sequence[int]) -> np.ndarray:
    """``[length]`` int64: 1 on each image's soft tokens (``counts[k]`` of them from ``offsets[k]``), 0 elsewhere --
    what ``Gemma3Processor`` returns as ``token_type_ids`` for the same tokens.

    >>> token_type_ids(8, [1, 5], [2, 2]).tolist()
    [0, 1, 1, 0, 0, 1, 1, 0]
    """
    out = np.zeros(length, dtype=np.int64)
    if len(offsets):
        delta = np.zeros(length + 1, dtype=np.int64)
        np.add.at(delta, np.asarray(offsets, dtype=np.int64), 1)
        np.add.at(delta, np.asarray(offsets, dtype=np.int64) + np.asarray(counts, dtype=np.int64), -1)
        out = np.cumsum(delta[:-1])
    return out


def square_side(tokens: int) -> int:
    """The side of the pooled token square (16 for 256), or 0 when ``tokens`` is no square (the model's projector
    average-pools the patches to ``sqrt(mm_tokens_per_image)`` a side)."""
    side = int(round(tokens ** 0.5))
    return side if side * side == tokens else 0


def check_fixed(config: Mapping[str, tuple[Any, str, str]], where: str, fix: str) -> None:
    """PackstreamError naming the file, the key, the value and the expected one when pan-and-scan is on or a pixel
    setting of :data:`FIXED` is not Gemma 3's."""
    value, what, prefix = config.get("do_pan_and_scan", (None, where, ""))
    if value not in (None, False):
        raise PackstreamError(f"{what}: {prefix}do_pan_and_scan is {json.dumps(value)[:60]}, expected false or null: "
                              "pan-and-scan adds crops of each long image (each one more image sequence) that "
                              f"packstream does not count; set it false (Gemma 3's default) or {fix}")
    _check_fixed(config, FIXED, where, "Gemma 3", fix)


def check_model(config: Mapping[str, Any], what: str, side: int, tokens: int) -> None:
    """A Gemma 3 folder's ``config.json`` (a JSON object, read by :func:`packers._processor_folder.read_json`): its
    ``mm_tokens_per_image`` and vision ``image_size``, when written, must be the processor's ``image_seq_length`` and
    ``size`` (else the model's image features and the placeholder tokens, or its patches and the pixels, would not
    match: transformers fails on the example alone)."""
    vision = config.get("vision_config")
    for key, value, want in (("mm_tokens_per_image", config.get("mm_tokens_per_image"), tokens),
                             ("vision_config.image_size", vision.get("image_size") if isinstance(vision, dict) else None,
                              side)):
        if value is not None and value != want:
            raise PackstreamError(f"{what}: {key} is {json.dumps(value)[:60]}, the processor's is {want}: the model "
                                  "and its processor config disagree; pass the model's own processor folder")

