"""The guard's static rules: what the batch and the config decide about a packed batch, every step, cheaply.

The "leaks when" column of :mod:`packers._attention`'s table, and the limit of a rope whose frequencies follow
the batch. Each rule raises a PackstreamError naming the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from packers._attention._model import input_device, uses_mrope
from packers._attention._varlen import CU_KEYS, VARLEN
from packers.errors import PackstreamError

MASK_BACKENDS = ("sdpa", "eager", "flex_attention")
"""Backends whose packed mask transformers builds from position_ids (masking_utils)."""

_FLEX_CPU = (
    "attn_implementation='flex_attention' on CPU: torch's compiled CPU flex_attention kernel returns wrong attention "
    "for some sequence lengths, packed or not (measured with torch 2.13: a plain causal 40-token sequence with head "
    "dim 8 or 16 comes out wrong by ~1, differently in each process), so no probe can vouch for a batch it did not "
    "run; on CPU use attn_implementation='sdpa' or 'eager' (flex_attention has no CPU backward either), and "
    "flex_attention on CUDA"
)


def num_sequences(batch: Mapping[str, Any]) -> int:
    """1 + the number of sequence starts after the first token (as masking_utils finds them); 1 = not packed.

    Restarts inside the padding of an ordinary padded batch (position_ids padded with 0) do not count.
    """
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        return int(cu.shape[0]) - 1
    pos = batch.get("position_ids")
    if pos is None or pos.shape[-1] < 2:
        return 1
    if pos.dim() == 3 and pos.shape[0] == 4:  # packers.Collator(vision=...): row 0 holds the text positions
        pos = pos[0]
    elif pos.dim() == 3:  # mRoPE positions alone (3 rows): a sequence starts where all three are 0
        starts = (pos[:, :, 1:] == 0).all(dim=0)
        return int(starts.sum().item()) + 1
    starts = torch.diff(pos, dim=-1) != 1
    mask = batch.get("attention_mask")
    if mask is not None and mask.shape == pos.shape:
        starts &= (mask[..., 1:] != 0) & (mask[..., :-1] != 0)
    return int(starts.sum().item()) + 1


def backend_refusal(impl: str, device_type: str) -> str | None:
    """Why every packed batch under backend ``impl`` on ``device_type`` is refused, whatever the model and the batch;
    None when the model and the batch decide. (bench/compat_matrix.py records such cells without running them.)"""
    if impl == "flex_attention" and device_type == "cpu":
        return _FLEX_CPU
    return None


def check_static(hf: torch.nn.Module, batch: Mapping[str, Any]) -> None:
    """The rules of :mod:`packers._attention`'s table that the batch and the config decide (a packed batch)."""
    impl = hf.config._attn_implementation
    if batch.get("attention_mask") is not None:
        raise PackstreamError(
            f"packed batch with an attention_mask (attn_implementation={impl!r}): flash attention unpads by the "
            "mask and ignores position_ids (TRL #4170), sdpa/eager then skip the packed mask; either way the "
            "examples attend to each other. Drop attention_mask from the batch (packers.Collator never adds one)"
        )
    if batch.get("past_key_values") is not None or batch.get("cache") is not None:
        raise PackstreamError("packed batch with a KV cache: packing is for training; pass no past_key_values/cache")
    if batch.get("pixel_values") is not None:
        check_vision_tower(hf, batch)
    if uses_mrope(hf):
        check_mrope(hf, batch)
    has_cu = all(batch.get(k) is not None for k in CU_KEYS)
    ids = batch.get("input_ids", batch.get("inputs_embeds"))
    if impl in VARLEN.names or "flash" in impl:
        if not has_cu and (batch.get("position_ids") is None or ids is None or ids.shape[0] != 1):
            raise PackstreamError(
                f"{impl!r} with a packed batch needs cu_seq_lens_q/k + max_length_q/k, or position_ids with batch "
                "size 1; collate with packers.Collator()"
            )
    elif impl in MASK_BACKENDS:
        if (why := backend_refusal(impl, input_device(hf).type)) is not None:
            raise PackstreamError(why)
        if batch.get("position_ids") is None:
            raise PackstreamError(f"{impl!r} builds the packed mask from position_ids; the batch has none")
        if _uses_cache(hf, batch):
            raise PackstreamError(
                f"attn_implementation={impl!r} with use_cache on: the model creates a KV cache, and transformers "
                "then skips the packed mask, so the examples attend to each other (even in train mode). Pass "
                "use_cache=False in the batch (packers.Collator does by default) or set model.config.use_cache=False"
            )
    # Any other backend (a custom AttentionInterface function, a hub kernel) is judged by the probe alone.


def check_vision_tower(hf: torch.nn.Module, batch: Mapping[str, Any]) -> None:
    """A batch with images whose vision tower runs under a varlen backend must not carry the text's boundaries.

    transformers (5.x) hands the forward's keyword arguments on to the vision tower (Qwen2-VL: get_image_features
    -> visual -> each block's attention; LLaVA: get_image_features -> vision_tower -> each CLIPAttention, which
    receives ``cu_seq_lens_q`` and ``max_length_q``: tests/test_vision_exact_llava.py checks it). Under a varlen
    backend its attention gets the text's cu_seq_lens beside (flash: instead of) the images' own, or none of the
    images at all. Not measured on a GPU yet: refused rather than trusted."""
    vision = getattr(getattr(hf.config, "vision_config", None), "_attn_implementation", None)
    if isinstance(vision, str) and vision not in MASK_BACKENDS and any(batch.get(k) is not None for k in CU_KEYS):
        raise PackstreamError(
            f"{type(hf).__name__}'s vision tower runs under attn_implementation={vision!r} and would receive this "
            "batch's cu_seq_lens_q/k (transformers passes the forward's keyword arguments on to it), not its images' "
            "boundaries. Give the vision tower sdpa (attn_implementation={'text_config': ..., 'vision_config': "
            "'sdpa'}) or collate with Collator(vision=..., return_flash_attn_kwargs=False)"
        )


def check_mrope(hf: torch.nn.Module, batch: Mapping[str, Any]) -> None:
    """A model with 3-D rotary positions (mRoPE) keeps packed examples apart only with ``[4, B, T]`` position_ids:
    transformers' Qwen2-VL text model takes row 0 as the text positions it builds the packed mask from (its comment
    "we need to pass text position ids for packing"); from ``[B, T]`` or ``[3, B, T]`` it builds one causal mask
    over the batch, and without position_ids it numbers the whole batch as one sequence."""
    pos = batch.get("position_ids")
    if pos is not None and pos.dim() == 3 and pos.shape[0] == 4:
        return
    shape = "none" if pos is None else f"shape {list(pos.shape)}"
    raise PackstreamError(
        f"{type(hf).__name__} uses 3-D rotary positions (mRoPE) and builds the packed mask only from position_ids "
        f"of shape [4, B, T] (row 0 the text positions, rows 1..3 each example's mRoPE positions); this packed batch "
        f"has position_ids of {shape}, so its examples would attend to each other (and its images lose their "
        "positions). Collate with packers.Collator(vision=VisionSpec.builtin('qwen2-vl')) or the spec the rows were "
        "packed with (VisionSpec.from_processor(model folder)), even for text-only rows"
    )


def _uses_cache(hf: torch.nn.Module, batch: Mapping[str, Any]) -> bool:
    """Whether ``hf(**batch)`` creates a KV cache: the batch's ``use_cache``, else the config's, unless
    transformers turns it off itself (activation checkpointing while training with gradients)."""
    use_cache = batch.get("use_cache")
    if use_cache is not None:
        return bool(use_cache)
    use_cache = getattr(hf.config.get_text_config(), "use_cache", False)
    ckpt = getattr(hf, "is_activation_checkpointing", None)
    if ckpt is None:  # transformers < 5.x
        ckpt = getattr(hf, "is_gradient_checkpointing", False)
    if ckpt and hf.training and torch.is_grad_enabled():
        return False
    return bool(use_cache)


def _longest_sequence(batch: Mapping[str, Any]) -> int:
    """An upper bound of ``max(position_ids) + 1`` (what a dynamic rope reads): ``max_length_q`` when the batch has
    it (a Python int: no device sync; the budget with ``Collator(fixed_shape=True)``), else the positions' max."""
    n = batch.get("max_length_q")
    if isinstance(n, int):
        return n
    pos = batch.get("position_ids")
    if pos is not None:
        return int(pos.max().item()) + 1
    ids = batch.get("input_ids", batch.get("inputs_embeds"))
    return int(ids.shape[1]) if ids is not None else 0


def check_rope(hf: torch.nn.Module, rope: tuple[int, str], batch: Mapping[str, Any]) -> None:
    """A rope whose frequencies follow the batch (``rope``: its limit and type, found by the probe) keeps every
    example's own frequencies only while every sequence of the batch stays below its limit."""
    limit, kind = rope
    longest = _longest_sequence(batch)
    if longest >= limit:
        raise PackstreamError(
            f"{type(hf).__name__} uses rope_type={kind!r}, whose frequencies follow the longest sequence of the batch "
            f"(transformers' dynamic_rope_update switches at the original length {limit}), and this packed batch has a "
            f"sequence of {longest} tokens (max_length_q, or position_ids), so the examples beside it would get its "
            f"frequencies instead of their own. Use a static rope type (e.g. 'yarn' or 'linear' with the same factor), "
            f"or keep every example below {limit} tokens: pack with --max-tokens {limit - 1} or less (with "
            f"Collator(fixed_shape=True) the budget itself counts)"
        )
