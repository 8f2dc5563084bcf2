"""The ``packstream_varlen`` attention backend: PyTorch's FlashAttention kernel behind transformers' AttentionInterface.

``torch.nn.attention.varlen.varlen_attn`` (PyTorch >= 2.10, CUDA only) takes the flattened ``(T, H, D)`` tokens of
a packed batch and the sequence boundaries ``cu_seq_lens``: FA2-speed packed training where the flash-attn package
cannot be installed. The boundaries are the batch's ``cu_seq_lens_q/k`` (what :class:`packers.Collator` passes), else
where ``position_ids`` restart, else one sequence per row. Anything the kernel cannot compute exactly (a padding
attention_mask, a KV cache, dropout, softcapping) is a PackstreamError naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from packers._attention._fixes import CLASS_TABLES
from packers.errors import PackstreamError

VARLEN_NAME = "packstream_varlen"
"""Default name of the varlen backend in transformers' ``AttentionInterface``."""
CU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass
class VarlenBackend:
    """The backend's state in this process: the names it is registered under, how often it ran, what its kernel
    accepts. One instance, :data:`VARLEN`; tests widen ``devices`` and ``dtypes`` and replace ``kernel`` to run a CPU
    reference of ``varlen_attn``."""

    names: set[str] = field(default_factory=set)
    """The names :func:`register_varlen_attention` registered it under."""
    calls: int = 0
    """Calls of :func:`varlen_attention_forward`: the packing probe's proof that a model dispatches to it."""
    devices: tuple[str, ...] = ("cuda",)
    """Device types the kernel runs on."""
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
    """Activation dtypes the kernel takes (a FlashAttention kernel: half precision only)."""

    def kernel(self) -> Callable[..., torch.Tensor]:
        """``torch.nn.attention.varlen.varlen_attn``, or a PackstreamError naming the torch it needs."""
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError as e:  # torch < 2.10
            raise PackstreamError(
                f"the {VARLEN_NAME!r} backend needs torch.nn.attention.varlen (PyTorch >= 2.10), found torch "
                f"{torch.__version__}; upgrade torch, or use attn_implementation='flash_attention_2' or 'sdpa'"
            ) from e
        return varlen_attn


VARLEN = VarlenBackend()


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function over ``varlen_attn``: ``(B, H, T, D)`` in, ``(B, T, H, D)`` out.

    The keywords transformers passes besides (``sliding_window``, ``softcap``, ``is_causal``, ``s_aux``, the
    boundaries ``cu_seq_lens_q/k`` + ``max_length_q/k``, ``position_ids``) are read from ``kwargs``; the rest
    are the model's own and ignored, as transformers' backends do. Sequence boundaries: ``cu_seq_lens_*`` when
    given (``B`` must be 1), else position_ids resets, else one sequence per row. Refuses an attention_mask and
    a KV cache.
    """
    VARLEN.calls += 1
    name = getattr(getattr(module, "config", None), "_attn_implementation", VARLEN_NAME)
    _refuse(name, query, key, value, attention_mask, dropout, kwargs)
    batch, _, q_len, _ = query.shape
    cu_q, cu_k, max_q, max_k = _bounds(kwargs, batch, q_len, query.device)
    q, k, v = _flat(name, query, key, value)
    causal = module.is_causal if kwargs.get("is_causal") is None else kwargs["is_causal"]
    out = VARLEN.kernel()(
        q, k, v, cu_q, cu_k, int(max_q), int(max_k),
        scale=scaling, window_size=_window(causal, kwargs.get("sliding_window")), enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.to(query.dtype).unflatten(0, (batch, q_len)), None


def _refuse(name: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
            dropout: float, kwargs: Mapping[str, Any]) -> None:
    """A PackstreamError naming the fix for a call the kernel cannot compute exactly."""
    if attention_mask is not None:
        raise PackstreamError(
            f"attn_implementation={name!r} got an attention_mask; the sequence boundaries come from cu_seq_lens_* "
            "(or position_ids): drop attention_mask from the batch (cf. TRL #4170)"
        )
    if query.device.type not in VARLEN.devices:
        raise PackstreamError(
            f"{name!r} runs on CUDA only (torch varlen_attn), the model is on {query.device.type}; "
            "on CPU use attn_implementation='sdpa' or 'eager' (packed masks from position_ids)"
        )
    batch, _, q_len, _ = query.shape
    if key.shape[2] != q_len:
        raise PackstreamError(f"{name!r} is for training (no KV cache); generate with attn_implementation='sdpa'")
    if all(kwargs.get(k) is not None for k in CU_KEYS) and batch != 1:
        raise PackstreamError(f"{name!r} with cu_seq_lens_* takes a flattened [1, T] batch, got batch size {batch}")
    if dropout:
        raise PackstreamError(f"{name!r} has no attention dropout, got dropout={dropout}; set attention_dropout=0")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise PackstreamError(f"{name!r} supports neither logit softcapping nor attention sinks; use flash_attention_2")
    if query.shape[-1] != value.shape[-1]:
        raise PackstreamError(f"{name!r} needs equal q/k and v head dims, got {query.shape[-1]} and {value.shape[-1]}")


def _bounds(kwargs: Mapping[str, Any], batch: int, length: int, device: torch.device) -> tuple[Any, Any, Any, Any]:
    """``(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)``: the batch's own when it gives all four, else,
    like FA2 in transformers, from position_ids resets (one device sync per layer; packers.Collator passes
    cu_seq_lens and avoids it), else one sequence per row."""
    given = tuple(kwargs.get(k) for k in CU_KEYS)
    if all(x is not None for x in given):
        return given
    cu, longest = cu_seq_lens(kwargs.get("position_ids"), batch, length, device)
    return cu, cu, longest, longest


def cu_seq_lens(position_ids: torch.Tensor | None, batch: int, length: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """``cu_seq_lens`` and max length of a ``[B, T]`` batch flattened to ``B*T``: a sequence starts where the
    position does not follow the previous one (as masking_utils.find_packed_sequence_indices), and at every row."""
    if position_ids is None:
        starts = torch.arange(0, batch * length, length, device=device)
    else:
        pos = position_ids.expand(batch, -1).reshape(-1)
        new = torch.ones_like(pos, dtype=torch.bool)
        new[1:] = pos[1:] - pos[:-1] != 1
        new[::length] = True
        starts = new.nonzero().flatten()
    end = torch.tensor([batch * length], device=device)
    cu = torch.cat([starts, end]).to(torch.int32)
    return cu, int(cu.diff().max().item())


def _flat(name: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(B*T, H, D)`` views of q, k and v in a dtype the kernel takes (autocast's, for fp32 activations)."""
    q, k, v = (x.transpose(1, 2).flatten(0, 1) for x in (query, key, value))
    if q.dtype in VARLEN.dtypes:
        return q, k, v
    if not torch.is_autocast_enabled(q.device.type):
        raise PackstreamError(
            f"{name!r} needs fp16/bf16 activations, got {q.dtype}: load the model in bfloat16 or use autocast"
        )
    dtype = torch.get_autocast_dtype(q.device.type)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _window(causal: bool, sliding_window: int | None) -> tuple[int, int]:
    """varlen_attn's ``window_size``. It is non-causal by default; causal is (-1, 0). A sliding window of W tokens
    (self included, as transformers' masks and FA2 count it) is (W - 1, 0). A tuple: varlen_attn tests
    ``window_size == (-1, 0)``."""
    if causal:
        return (sliding_window - 1, 0) if sliding_window else (-1, 0)
    return (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)


def register_varlen_attention(name: str = VARLEN_NAME) -> str:
    """Register the torch varlen backend with transformers; returns ``name`` for ``attn_implementation=``.

    >>> name = register_varlen_attention()
    >>> name
    'packstream_varlen'

    Then ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)`` (or
    ``model.set_attn_implementation(name)``) and feed it :class:`packers.Collator` batches.
    Runs on CUDA with PyTorch >= 2.10; elsewhere the forward raises PackstreamError. A model that
    picks its attention from a class table of its own instead of ``AttentionInterface`` (Falcon,
    GPT-Neo, GIT) raises PackstreamError when built with ``name``, not a ``KeyError``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    if "flash" in name:
        raise PackstreamError(f"name {name!r} must not contain 'flash': transformers would treat it as flash-attn")
    AttentionInterface.register(name, varlen_attention_forward)
    # FA2's mask function: None for an all-ones 2D mask, the 2D mask itself when it pads. Without one,
    # transformers drops any attention_mask for an unknown backend, and padding would pass unnoticed.
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, flash_attention_mask)
    VARLEN.names.add(name)
    CLASS_TABLES.refuse(name)
    return name
