"""Attention backends for packed batches, and the guard that refuses silent cross-example attention.

Which backends keep the examples of a flattened ``[1, T]`` batch apart (transformers 5.x):

============================  ==================================  =========================================
``attn_implementation``       what separates the examples         leaks when
============================  ==================================  =========================================
``flash_attention_2``/``_3``  ``cu_seq_lens_*``/``max_length_*``  an ``attention_mask`` is passed: FA unpads
                              (else ``position_ids`` resets)      by it and ignores position_ids (TRL #4170)
``sdpa``/``eager``/``flex``   block mask built from               an ``attention_mask`` is passed, or a KV
                              ``position_ids`` (masking_utils)    cache exists (``use_cache`` on by default)
``packstream_varlen``         ``cu_seq_lens_*`` (else             never silently: a padding attention_mask
                              ``position_ids`` resets)            or a KV cache raises
============================  ==================================  =========================================

:func:`check_packing_safe` raises :class:`~packers.PackstreamError` naming the fix for each
"leaks when"; :func:`install_packing_guard` runs it before every forward of a model.
:func:`register_varlen_attention` adds the ``packstream_varlen`` backend: PyTorch's own
FlashAttention kernel (``torch.nn.attention.varlen.varlen_attn``, PyTorch >= 2.10, CUDA only),
for FA2-speed packed training where the flash-attn package cannot be installed.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Mapping

import torch

from packers._errors import PackstreamError

VARLEN_NAME = "packstream_varlen"
"""Default name of the varlen backend in transformers' ``AttentionInterface``."""

_VARLEN_NAMES: set[str] = set()
_MASK_BACKENDS = ("sdpa", "eager", "flex_attention")
_CU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# What torch's varlen_attn (a FlashAttention kernel) accepts; tests widen these to run a CPU reference.
_VARLEN_DEVICES = ("cuda",)
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)


def _varlen_kernel() -> Callable[..., torch.Tensor]:
    """``torch.nn.attention.varlen.varlen_attn``; a module-level hook so tests can swap in a CPU reference."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:  # torch < 2.10
        raise PackstreamError(
            f"the {VARLEN_NAME!r} backend needs torch.nn.attention.varlen (PyTorch >= 2.10), found torch "
            f"{torch.__version__}; upgrade torch, or use attn_implementation='flash_attention_2' or 'sdpa'"
        ) from e
    return varlen_attn


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function over ``varlen_attn``: ``(B, H, T, D)`` in, ``(B, T, H, D)`` out.

    Sequence boundaries: ``cu_seq_lens_q/k`` + ``max_length_q/k`` when given (``B`` must be 1), else
    position_ids resets, else one sequence per row. Refuses an attention_mask and a KV cache.
    """
    name = getattr(getattr(module, "config", None), "_attn_implementation", VARLEN_NAME)
    if attention_mask is not None:
        raise PackstreamError(
            f"attn_implementation={name!r} got an attention_mask; the sequence boundaries come from cu_seq_lens_* "
            "(or position_ids): drop attention_mask from the batch (cf. TRL #4170)"
        )
    if query.device.type not in _VARLEN_DEVICES:
        raise PackstreamError(
            f"{name!r} runs on CUDA only (torch varlen_attn), the model is on {query.device.type}; "
            "on CPU use attn_implementation='sdpa' or 'eager' (packed masks from position_ids)"
        )
    batch, _, q_len, _ = query.shape
    if key.shape[2] != q_len:
        raise PackstreamError(f"{name!r} is for training (no KV cache); generate with attn_implementation='sdpa'")
    if any(x is None for x in (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)):
        # Like FA2 in transformers: without explicit boundaries, take them from position_ids resets (one
        # device sync per layer; packers.Collator passes cu_seq_lens and avoids it), else one sequence per row.
        cu_seq_lens_q, max_length_q = _boundaries(kwargs.get("position_ids"), batch, q_len, query.device)
        cu_seq_lens_k, max_length_k = cu_seq_lens_q, max_length_q
    elif batch != 1:
        raise PackstreamError(f"{name!r} with cu_seq_lens_* takes a flattened [1, T] batch, got batch size {batch}")
    if dropout:
        raise PackstreamError(f"{name!r} has no attention dropout, got dropout={dropout}; set attention_dropout=0")
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise PackstreamError(f"{name!r} supports neither logit softcapping nor attention sinks; use flash_attention_2")
    if query.shape[-1] != value.shape[-1]:
        raise PackstreamError(f"{name!r} needs equal q/k and v head dims, got {query.shape[-1]} and {value.shape[-1]}")

    q, k, v = (x.transpose(1, 2).flatten(0, 1) for x in (query, key, value))  # (B*T, H, D)
    if q.dtype not in _VARLEN_DTYPES:  # the flash kernel takes fp16/bf16 only
        if not torch.is_autocast_enabled(q.device.type):
            raise PackstreamError(
                f"{name!r} needs fp16/bf16 activations, got {q.dtype}: load the model in bfloat16 or use autocast"
            )
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    causal = module.is_causal if is_causal is None else is_causal
    if causal:
        # varlen_attn is non-causal by default; causal is window (-1, 0). A sliding window of W tokens
        # (self included, as transformers' masks and FA2 count it) is (W - 1, 0). Must be a tuple:
        # varlen_attn tests `window_size == (-1, 0)`.
        window = (sliding_window - 1, 0) if sliding_window else (-1, 0)
    else:
        window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    gqa = q.shape[1] != k.shape[1]
    out = _varlen_kernel()(
        q,
        k,
        v,
        cu_seq_lens_q,
        cu_seq_lens_k,
        int(max_length_q),
        int(max_length_k),
        scale=scaling,
        window_size=window,
        enable_gqa=gqa,
    )
    return out.to(query.dtype).unflatten(0, (batch, q_len)), None


def _boundaries(position_ids: torch.Tensor | None, batch: int, length: int, device: torch.device) -> tuple[torch.Tensor, int]:
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


def register_varlen_attention(name: str = VARLEN_NAME) -> str:
    """Register the torch varlen backend with transformers; returns ``name`` for ``attn_implementation=``.

    >>> name = register_varlen_attention()
    >>> name
    'packstream_varlen'

    Then ``AutoModelForCausalLM.from_config(cfg, attn_implementation=name)`` (or
    ``model.set_attn_implementation(name)``) and feed it :class:`packers.Collator` batches.
    Runs on CUDA with PyTorch >= 2.10; elsewhere the forward raises PackstreamError.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

    if "flash" in name:
        raise PackstreamError(f"name {name!r} must not contain 'flash': transformers would treat it as flash-attn")
    AttentionInterface.register(name, varlen_attention_forward)
    # FA2's mask function: None for an all-ones 2D mask, the 2D mask itself when it pads. Without one,
    # transformers drops any attention_mask for an unknown backend, and padding would pass unnoticed.
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, flash_attention_mask)
    _VARLEN_NAMES.add(name)
    return name


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers PreTrainedModel inside DDP/FSDP/PEFT/torch.compile wrappers."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return m
    raise PackstreamError(f"{type(model).__name__} contains no transformers PreTrainedModel")


_PACKED_MASK_CACHE: dict[type, bool] = {}


def _uses_packed_masks(model: torch.nn.Module) -> bool:
    """Whether the model builds its masks with transformers' masking_utils, which honours packed position_ids."""
    if type(model) not in _PACKED_MASK_CACHE:
        from transformers import masking_utils

        names = ("create_causal_mask", "create_sliding_window_causal_mask")
        modules = {sys.modules.get(type(m).__module__) for m in model.modules()}
        _PACKED_MASK_CACHE[type(model)] = any(
            getattr(mod, n, None) is getattr(masking_utils, n) for mod in modules for n in names
        )
    return _PACKED_MASK_CACHE[type(model)]


def _num_sequences(batch: Mapping[str, Any]) -> int:
    """1 + the number of sequence starts after the first token (as masking_utils finds them); 1 = not packed.

    Restarts inside the padding of an ordinary padded batch (position_ids padded with 0) do not count.
    """
    cu = batch.get("cu_seq_lens_q")
    if cu is not None:
        return int(cu.shape[0]) - 1
    pos = batch.get("position_ids")
    if pos is None or pos.shape[-1] < 2:
        return 1
    starts = torch.diff(pos, dim=-1) != 1
    mask = batch.get("attention_mask")
    if mask is not None and mask.shape == pos.shape:
        starts &= (mask[..., 1:] != 0) & (mask[..., :-1] != 0)
    return int(starts.sum().item()) + 1


def check_packing_safe(model: torch.nn.Module, batch: Mapping[str, Any]) -> None:
    """Raise PackstreamError if ``model(**batch)`` would let packed examples attend to each other.

    Cheap: reads the config, the batch's keys and shapes (one small device sync without
    ``cu_seq_lens_q``). A batch holding one sequence always passes. For each backend, see the
    module docstring's table; an attention implementation packstream does not know is refused.
    """
    if _num_sequences(batch) <= 1:
        return
    hf = _hf_model(model)
    impl = hf.config._attn_implementation
    if batch.get("attention_mask") is not None:
        raise PackstreamError(
            f"packed batch with an attention_mask (attn_implementation={impl!r}): flash attention unpads by the "
            "mask and ignores position_ids (TRL #4170), sdpa/eager then skip the packed mask; either way the "
            "examples attend to each other. Drop attention_mask from the batch (packers.Collator never adds one)"
        )
    if batch.get("past_key_values") is not None or batch.get("cache") is not None:
        raise PackstreamError("packed batch with a KV cache: packing is for training; pass no past_key_values/cache")
    has_cu = all(batch.get(k) is not None for k in _CU_KEYS)
    ids = batch.get("input_ids", batch.get("inputs_embeds"))
    if impl in _VARLEN_NAMES or "flash" in impl:
        if not has_cu and (batch.get("position_ids") is None or ids is None or ids.shape[0] != 1):
            raise PackstreamError(
                f"{impl!r} with a packed batch needs cu_seq_lens_q/k + max_length_q/k, or position_ids with batch "
                "size 1; collate with packers.Collator()"
            )
        return
    if impl in _MASK_BACKENDS:
        if batch.get("position_ids") is None:
            raise PackstreamError(f"{impl!r} builds the packed mask from position_ids; the batch has none")
        use_cache = batch.get("use_cache")
        if use_cache is None:
            use_cache = getattr(hf.config.get_text_config(), "use_cache", False)
            ckpt = getattr(hf, "is_activation_checkpointing", None)
            if ckpt is None:  # transformers < 5.x
                ckpt = getattr(hf, "is_gradient_checkpointing", False)
            if ckpt and hf.training and torch.is_grad_enabled():
                use_cache = False  # transformers turns the cache off itself in this case
        if use_cache:
            raise PackstreamError(
                f"attn_implementation={impl!r} with use_cache on: the model creates a KV cache, and transformers "
                "then skips the packed mask, so the examples attend to each other (even in train mode). Pass "
                "use_cache=False in the batch (packers.Collator does by default) or set model.config.use_cache=False"
            )
        if not _uses_packed_masks(hf):
            raise PackstreamError(
                f"{type(hf).__name__} does not build its masks with transformers.masking_utils, so packstream cannot "
                f"tell whether {impl!r} honours packed position_ids; use attn_implementation='flash_attention_2' or "
                f"{VARLEN_NAME!r} (packers.register_varlen_attention) on CUDA"
            )
        return
    raise PackstreamError(
        f"attn_implementation={impl!r} is unknown to packstream, which cannot tell whether it keeps packed examples "
        f"apart; use one of 'flash_attention_2', 'sdpa', 'eager', or {VARLEN_NAME!r} (packers.register_varlen_attention)"
    )


def install_packing_guard(model: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Run :func:`check_packing_safe` before every forward of ``model``; returns the hook's handle.

    Catches what a trainer or a wrapper adds to the batch after the collator (an
    ``attention_mask``, a cache). ``handle.remove()`` takes the guard off.
    """
    params = list(inspect.signature(_hf_model(model).forward).parameters)

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        batch = dict(zip(params, args)) | kwargs
        check_packing_safe(module, batch)

    return model.register_forward_pre_hook(hook, with_kwargs=True)
