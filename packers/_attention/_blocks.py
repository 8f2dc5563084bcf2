"""Gemma 3's bidirectional image blocks in a packed batch: a static rule, and the fix the guard applies.

In training, ``Gemma3Model`` builds its masks from ``token_type_ids`` (1 on each image's soft tokens): every run of
soft tokens is one block that attends to itself both ways (transformers 5.25, modeling_gemma3
``create_masks_for_vision_model``). On a packed row (position_ids restarting per example, no attention_mask) the
full-attention layers get that right: masking_utils applies the block overlay at the row's own indices, then keeps
the examples apart. The sliding-window layers do not: there the block overlay is passed as an ``or_mask_function``,
which masking_utils re-indexes by each example's *positions* (``remap_positions_for_packed_sequence``), so an image
in any example but the first of its row is looked up at the first example's places: its block is lost, another
appears (measured: logits off by ~0.1 on a tiny Gemma 3, eager and sdpa alike, while the row's first example is
exact to 1e-7).

:func:`block_problem` is the static rule; :func:`packed_blocks` the fix :func:`packers.install_packing_guard` applies
during a guarded forward: Gemma 3's ``create_masks_for_vision_model`` swapped for one that hands the sliding layers
the blocks as ``block_sequence_ids`` (applied at the row's indices, after the remap, as for the full layers) and the
window as an ``and_mask_function``. That gives ``OR(AND(causal, window), block)`` instead of ``AND(window,
OR(causal, block))``: the same mask while every image block fits in the window (Gemma 3: 256 soft tokens, windows of
512 or 1024), which the rule checks; a longer block is refused.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

GEMMA3_TYPES = ("gemma3",)
"""The model types whose packed image blocks are verified (tests/test_vision_gemma3.py)."""


def image_blocks(hf: torch.nn.Module) -> bool:
    """Does the model build a bidirectional block over each image from ``token_type_ids`` (Gemma 3)?"""
    return getattr(hf.config, "model_type", None) in GEMMA3_TYPES


def _sliding(hf: torch.nn.Module) -> int | None:
    """The text model's sliding window when some layer uses it, else None."""
    text = hf.config.get_text_config()
    kinds = getattr(text, "layer_types", None) or ()
    return getattr(text, "sliding_window", None) if "sliding_attention" in kinds else None


def _runs(types: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Starts and lengths (flattened over the batch rows) of the runs of 1 in ``types`` ``[B, T]``."""
    flat = torch.nn.functional.pad((types == 1).to(torch.int8), (1, 1)).reshape(-1)
    edges = torch.diff(flat)
    starts, ends = torch.nonzero(edges == 1).reshape(-1), torch.nonzero(edges == -1).reshape(-1)
    return starts, ends - starts


def _later_images(types: torch.Tensor, positions: Any) -> bool:
    """Is some soft token outside the first sequence of its row? (Positions start at 0 and rise by one through a
    row's first sequence, so a token at column ``i`` lies in it exactly when its position is ``i``; without
    position_ids the row is taken as packed throughout.)"""
    image = types.reshape(types.shape[0], -1) == 1
    if not torch.is_tensor(positions) or positions.dim() != 2 or positions.shape[-1] != image.shape[-1]:
        return bool(image.any())
    columns = torch.arange(image.shape[-1], device=positions.device)
    return bool((image & (positions.expand(image.shape[0], -1) != columns)).any())


def block_problem(hf: torch.nn.Module, batch: Mapping[str, Any], guarded: bool) -> tuple[str | None, bool]:
    """``(why the packed batch is refused, or None; whether the guard must apply the fix)`` for a Gemma 3 model."""
    name = type(hf).__name__
    types = batch.get("token_type_ids")
    if types is None:
        if batch.get("pixel_values") is not None:
            return (f"{name} attends bidirectionally within each image in training (token_type_ids, 1 on its soft "
                    "tokens), and this packed batch has pixel_values but no token_type_ids, so its images would be "
                    "causal: collate with packers.Collator(vision=VisionSpec.builtin('gemma3')) (or the spec the rows "
                    "were packed with), which adds them"), False
        return None, False
    window = _sliding(hf)
    if window is None or not _later_images(types, batch.get("position_ids")):
        return None, False
    if getattr(hf.config.get_text_config(), "use_bidirectional_attention", False):
        return (f"{name} with use_bidirectional_attention: its packed image blocks are not verified; set it false "
                "for causal training"), False
    _, lengths = _runs(types.reshape(types.shape[0], -1))
    if int(lengths.max()) > window:
        return (f"{name}: an image block of {int(lengths.max())} soft tokens is longer than the sliding window "
                f"{window}, so its packed mask cannot be made exact; use images of at most {window} tokens"), False
    if not guarded:
        return (f"{name} builds its sliding-window layers' image blocks from each example's positions (transformers' "
                "masking_utils re-indexes the block overlay by position_ids), so in a plain model(**batch) an image "
                "outside the first example of a row gets another example's block; install_packing_guard(model) "
                "builds those masks exactly (measured equal to each example alone)"), False
    return None, True


def _fixed_masks(config: Any, inputs_embeds: torch.Tensor, attention_mask: Any, cache: Any, position_ids: Any,
                 block_sequence_ids: torch.Tensor) -> dict:
    """Gemma 3's two masks for a packed row: the blocks at the row's own indices in both (see the module doc)."""
    from transformers.masking_utils import create_causal_mask, sliding_window_overlay

    kwargs = {"config": config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask, "cache": cache,
              "position_ids": position_ids, "block_sequence_ids": block_sequence_ids}
    return {"full_attention": create_causal_mask(**kwargs),
            "sliding_attention": create_causal_mask(**kwargs, and_mask_function=sliding_window_overlay(
                config.sliding_window), layer_idx=0)}


@contextlib.contextmanager
def packed_blocks(hf: torch.nn.Module) -> Iterator[None]:
    """For one guarded forward: the modeling module of ``hf``'s class builds its masks with :func:`_fixed_masks`
    (then back to transformers' own, unless someone else replaced it since)."""
    module = sys.modules.get(type(hf).__module__)
    original = getattr(module, "create_masks_for_vision_model", None)
    if original is None:
        yield
        return
    module.create_masks_for_vision_model = _fixed_masks
    try:
        yield
    finally:
        if getattr(module, "create_masks_for_vision_model", None) is _fixed_masks:
            module.create_masks_for_vision_model = original
