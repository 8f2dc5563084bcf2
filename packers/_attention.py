"""Attention backends for packed batches, and the guard that refuses silent cross-example attention.

Which backends keep the examples of a flattened ``[1, T]`` batch apart (transformers 5.x):

============================  ==================================  =========================================
``attn_implementation``       what separates the examples         leaks when
============================  ==================================  =========================================
``flash_attention_2``/``_3``  ``cu_seq_lens_*``/``max_length_*``  an ``attention_mask`` is passed: FA unpads
                              (else ``position_ids`` resets)      by it and ignores position_ids (TRL #4170)
``sdpa``/``eager``/``flex``   block mask built from               an ``attention_mask`` is passed, a KV cache
                              ``position_ids`` (masking_utils)    exists (``use_cache`` on by default), or the
                                                                  model builds its mask without position_ids
``packstream_varlen``         ``cu_seq_lens_*`` (else             never silently: a padding attention_mask
                              ``position_ids`` resets)            or a KV cache raises
============================  ==================================  =========================================

Two layers of defence, both raising :class:`~packers.PackstreamError` with the fix:

* **Static rules** (every step, cheap): the "leaks when" column, read from the batch and the config.
* **A behavioural probe** (once per model class, configuration, backend, mode, dtype and batch
  layout): the model itself runs two short sequences (5 and 7 tokens) packed into one ``[1, 12]``
  batch, and each alone, under ``no_grad``; the logits must agree within the dtype's noise. No
  list of models is consulted, so a model whose code forgets the packed layout (GptOss and OPT
  build their masks without ``position_ids`` in transformers 5.24) is caught by what it computes.
  Where the only fault is that forgotten argument, :func:`install_packing_guard` supplies it (the
  probe must then prove the result exact); otherwise the model is refused.

:func:`check_packing_safe` runs both for one batch; :func:`install_packing_guard` runs them before
every forward of a model. :func:`register_varlen_attention` adds the ``packstream_varlen`` backend:
PyTorch's own FlashAttention kernel (``torch.nn.attention.varlen.varlen_attn``, PyTorch >= 2.10,
CUDA only), for FA2-speed packed training where the flash-attn package cannot be installed.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import inspect
import itertools
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import torch

from packers.errors import PackstreamError

VARLEN_NAME = "packstream_varlen"
"""Default name of the varlen backend in transformers' ``AttentionInterface``."""

_VARLEN_NAMES: set[str] = set()
_MASK_BACKENDS = ("sdpa", "eager", "flex_attention")
_CU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# What torch's varlen_attn (a FlashAttention kernel) accepts; tests widen these to run a CPU reference.
_VARLEN_DEVICES = ("cuda",)
_VARLEN_DTYPES = (torch.float16, torch.bfloat16)
_VARLEN_CALLS = [0]  # calls of varlen_attention_forward: the probe's proof that a model dispatches to it


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
    _VARLEN_CALLS[0] += 1
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
    Runs on CUDA with PyTorch >= 2.10; elsewhere the forward raises PackstreamError. A model that
    picks its attention from a class table of its own instead of ``AttentionInterface`` (Falcon,
    GPT-Neo, GIT) raises PackstreamError when built with ``name``, not a ``KeyError``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        flash_attention_mask,
    )

    if "flash" in name:
        raise PackstreamError(f"name {name!r} must not contain 'flash': transformers would treat it as flash-attn")
    AttentionInterface.register(name, varlen_attention_forward)
    # FA2's mask function: None for an all-ones 2D mask, the 2D mask itself when it pads. Without one,
    # transformers drops any attention_mask for an unknown backend, and padding would pass unnoticed.
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, flash_attention_mask)
    _VARLEN_NAMES.add(name)
    _refuse_in_class_tables(name)
    return name


# -- models outside AttentionInterface ------------------------------------------------------------

_CLASS_TABLE = re.compile(r"^(\w*ATTENTION_CLASSES)\s*=\s*\{", re.MULTILINE)
_TABLES_DONE: set[str] = set()


def _refuse_in_class_tables(name: str) -> None:
    """Make every transformers class table of attention classes answer ``name`` with a PackstreamError.

    A few models pick their attention class from a dict of their own, e.g. Falcon's
    ``FALCON_ATTENTION_CLASSES[config._attn_implementation](config, layer_idx)`` (transformers 5.24,
    models/falcon/modeling_falcon.py), so a backend registered with ``AttentionInterface`` fails there
    with ``KeyError: 'packstream_varlen'`` while the model is built. The modules are found by their
    source (~40 ms for ~540 files) and imported; the entry added for ``name`` raises at construction.
    """
    spec = importlib.util.find_spec("transformers")
    if name in _TABLES_DONE or spec is None or spec.origin is None:
        return
    _TABLES_DONE.add(name)
    for path in sorted((Path(spec.origin).parent / "models").glob("*/modeling_*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if "ATTENTION_CLASSES" not in text or not _CLASS_TABLE.search(text):
            continue
        try:
            module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        except Exception:  # an optional dependency of that model is missing: nobody can build it here either
            continue
        for table_name in _CLASS_TABLE.findall(text):
            table = getattr(module, table_name, None)
            if isinstance(table, dict) and name not in table:
                table[name] = _unsupported_backend(name, module.__name__.rsplit(".", 1)[-1], sorted(table))


def _unsupported_backend(name: str, where: str, supported: list[str]) -> type:
    class UnsupportedAttentionBackend(torch.nn.Module):
        def __init__(self, config: Any = None, *args: Any, **kwargs: Any) -> None:
            model = getattr(config, "model_type", None) or where
            raise PackstreamError(
                f"{model} ({where}) picks its attention class from its own table, which knows only {supported}, "
                f"not attn_implementation={name!r} (that one works for models that dispatch through transformers' "
                f"AttentionInterface); build it with one of {supported}, each checked by install_packing_guard"
            )

    return UnsupportedAttentionBackend


# -- static rules ---------------------------------------------------------------------------------


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers PreTrainedModel inside DDP/FSDP/PEFT/torch.compile wrappers."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return m
    raise PackstreamError(f"{type(model).__name__} contains no transformers PreTrainedModel")


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


_FLEX_CPU = (
    "attn_implementation='flex_attention' on CPU: torch's compiled CPU flex_attention kernel returns wrong attention "
    "for some sequence lengths, packed or not (measured with torch 2.13: a plain causal 40-token sequence with head "
    "dim 8 or 16 comes out wrong by ~1, differently in each process), so no probe can vouch for a batch it did not "
    "run; on CPU use attn_implementation='sdpa' or 'eager' (flex_attention has no CPU backward either), and "
    "flex_attention on CUDA"
)


def _check_static(hf: torch.nn.Module, batch: Mapping[str, Any]) -> None:
    """The rules of the module docstring's table that the batch and the config decide (a packed batch)."""
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
    elif impl in _MASK_BACKENDS:
        if impl == "flex_attention" and _probe_device(hf).type == "cpu":
            raise PackstreamError(_FLEX_CPU)
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
    # Any other backend (a custom AttentionInterface function, a hub kernel) is judged by the probe alone.


# -- the behavioural probe ------------------------------------------------------------------------

PROBE_LENGTHS = (5, 7)
"""Lengths of the short probe's two sequences: one forward of 12 packed tokens and two of 5 and 7 alone.
Each length the config makes special adds a probe of two sequences crossing it (:func:`_probes`)."""

# Config keys whose integer values are lengths where attention changes: sliding windows (sliding_window,
# attention_window_size, window_size, local_attention_window_len, keep_window_size, ...), attention chunks
# (attention_chunk_size, chunk_size of Mamba's chunked scan, local_attn_chunk_length), blocks (block_size) and
# the rope's original length (original_max_position_embeddings, also inside rope_parameters, per layer type).
# Found by listing every causal LM config of transformers 5.24 (issue 18).
_SPECIAL_KEY = re.compile(r"window|chunk_size|chunk_length|block_size|original_max_position|^local_attention$")
_NOT_A_LENGTH = re.compile(r"layers|pattern|feed_forward|lm_head|^num_|ratio|multiple|^use_|_dim$")
_MAX_POSITIONS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length", "n_ctx")


def _special_lengths(hf: torch.nn.Module, below: int | None) -> dict[int, str]:
    """Length -> the config key that makes it special, for the text config's windows, chunks, blocks and rope
    original lengths that a sequence the model accepts can cross (length + 2 <= its max positions) and that stay
    under ``below`` (a batch-dependent rope's limit: its probes must not cross it, see :func:`_batch_rope`)."""
    cfg = hf.config.get_text_config(decoder=True)
    found: dict[int, str] = {}

    def lengths(key: str, value: Any, depth: int = 0) -> None:
        if isinstance(value, bool) or depth > 3:
            return
        if isinstance(value, int):
            if value > 1:
                found.setdefault(value, key)
        elif isinstance(value, dict):
            for k, v in value.items():
                lengths(f"{key}.{k}", v, depth + 1)
        elif isinstance(value, (list, tuple)) and len(value) <= 4096:
            for v in value:
                lengths(key, v, depth + 1)

    def visit(prefix: str, values: Mapping[str, Any], depth: int = 0) -> None:
        for k, v in values.items():
            if not isinstance(k, str) or k.startswith("_"):
                continue
            if k == "sliding_window" and getattr(cfg, "use_sliding_window", True) is False:
                continue  # Qwen2-style configs keep a window they do not use
            if _SPECIAL_KEY.search(k) and not _NOT_A_LENGTH.search(k):
                lengths(prefix + k, v)
            elif isinstance(v, dict) and depth < 2:  # rope_parameters, per layer type
                visit(f"{prefix}{k}.", v, depth + 1)

    visit("", vars(cfg))
    cap = next((getattr(cfg, k) for k in _MAX_POSITIONS if isinstance(getattr(cfg, k, None), int)), None)
    return {n: k for n, k in sorted(found.items())
            if (cap is None or n + 2 <= cap) and (below is None or n + 2 < below) and n + 2 > max(PROBE_LENGTHS)}


def _probes(hf: torch.nn.Module, rope: tuple[int, str] | None) -> list[tuple[tuple[int, int], str]]:
    """The probe's packed rows: (5, 7), and for each special length N a short sequence then one of N + 2 tokens,
    so that one sequence crosses N inside itself (a window or chunk bites, a rope switches), the row crosses N
    (a backend that changes path above N tokens), and the second sequence straddles position N of the row (chunks
    or windows counted over the row instead of each sequence)."""
    out = [(PROBE_LENGTHS, "")]
    for n, key in _special_lengths(hf, None if rope is None else rope[0]).items():
        out.append(((PROBE_LENGTHS[0], n + 2), f", crossing {key}={n}"))
    return out


def _batch_rope(hf: torch.nn.Module) -> tuple[int, str] | None:
    """(limit, rope type) when a rotary embedding recomputes its frequencies from the batch, else None.

    transformers' ``dynamic_rope_update`` (modeling_rope_utils.py, 5.24) wraps the rotary embeddings' forward:
    a rope type containing "dynamic" rescales its frequencies once ``max(position_ids) + 1`` exceeds the original
    length, and "longrope" switches from its short to its long factors there. In a packed batch that maximum
    is the longest example's, so every example beside a long one gets the long one's frequencies: packed differs
    from alone (2e-3 to 1e-2 of the logits, issue 18). With every sequence below the limit, nothing switches.
    Found on the model's modules (their forward's code is that wrapper's), so a model's own rotary class counts.
    """
    limits: list[tuple[int, str]] = []
    for m in hf.modules():
        code = getattr(getattr(type(m), "forward", None), "__code__", None)
        if "dynamic_rope_update" not in getattr(code, "co_qualname", ""):
            continue
        types = getattr(m, "rope_type", None)
        for layer, t in (types.items() if isinstance(types, dict) else [(None, types)]):
            if not isinstance(t, str):
                continue
            config = getattr(m, "config", hf.config)
            if "dynamic" in t:
                limit = getattr(m, "original_max_seq_len", None) or getattr(config, "max_position_embeddings", None)
            elif t == "longrope":
                params = getattr(config, "rope_parameters", None) or {}
                params = params.get(layer, params) if layer is not None else params
                limit = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
            else:
                continue
            if isinstance(limit, int):
                limits.append((limit, t))
    return min(limits) if limits else None


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


def _check_rope(hf: torch.nn.Module, rope: tuple[int, str], batch: Mapping[str, Any]) -> None:
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

_LAYOUT_KEYS = ("position_ids", *_CU_KEYS, "seq_idx")
# Max |packed - alone| / max |alone| allowed on the probe's logits, by compute dtype. Leaks in the tiny
# models of bench/compat_matrix.py move the logits by 1e-2 to 1 of their scale; packed vs alone without a
# leak differs by ~1e-6 of it in fp32 on CPU. Half precision: bench/gpu_check.py measures bf16's own error
# at ~1e-2 (of logits of ~1).
_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
_TF32_TOLERANCE = 2e-3  # fp32 matmuls in TF32 (10-bit mantissa), torch.backends.cuda.matmul.allow_tf32


@dataclass(frozen=True)
class _Verdict:
    """What the probe found for one model class, configuration, backend, mode, dtype and batch layout."""

    error: str | None
    """Why packed batches are refused; None when they are exact."""
    fix: bool
    """Exact only when the guard passes the packed position_ids to the model's mask functions."""
    diff: float
    """Max relative logit diff, packed vs alone, over the probes that decided (nan when one raised)."""
    seconds: float
    """Wall time of the probe forwards."""
    probes: tuple[tuple[int, ...], ...] = ()
    """The sequence lengths of each packed row probed."""
    rope: tuple[int, str] | None = None
    """A batch-dependent rope's (limit, type): every packed batch's sequences must stay below the limit."""


_STATE: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()  # model -> {(layout, key): verdict}
_STATES_KEPT = 16  # verdicts kept per model (train and eval, a few layouts): switching back does not re-probe
_LOCAL = threading.local()  # .probing: the guard's own probe forwards skip the guard


def _configs(config: Any) -> Iterator[Any]:
    """A config and its sub-configs (text, vision, ...), depth first, each once."""
    seen, todo = set(), [config]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        yield c
        todo.extend(getattr(c, k, None) for k in getattr(c, "sub_configs", {}) or {})


def _layout(batch: Mapping[str, Any]) -> tuple | None:
    """Which boundary keys the batch carries (and its use_cache): the probe copies them. None: nothing to probe."""
    keys = tuple(k for k in _LAYOUT_KEYS if batch.get(k) is not None)
    if "position_ids" not in keys and "cu_seq_lens_q" not in keys:
        return None
    return keys, batch.get("use_cache")


def _probe_device(hf: torch.nn.Module) -> torch.device:
    try:
        return hf.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        return next(hf.parameters()).device


def _config_fingerprint(config: Any) -> tuple:
    """The plain values of a config and its sub-configs (~50 us): a changed window or rope setting shows here."""
    plain = (int, float, str, bool, type(None))
    return tuple(
        tuple(sorted((k, v if isinstance(v, plain) else repr(v)) for k, v in vars(c).items()
                     if isinstance(v, plain) or (isinstance(v, (list, tuple, dict)) and len(v) < 256)))
        for c in _configs(config)
    )


def _key(hf: torch.nn.Module, layout: tuple) -> tuple:
    """What, when it changes, calls for a new probe: the class, the config, the backend (and the functions
    registered for it), train/eval mode, dtype, device, autocast, float32 matmul precision, batch layout."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    impls = tuple(getattr(c, "_attn_implementation", None) for c in _configs(hf.config))
    functions = tuple(
        (AttentionInterface._global_mapping.get(i), ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(i))
        for i in impls
        if isinstance(i, str)
    )
    param = next(hf.parameters(), None)
    dtype = param.dtype if param is not None else None
    dev = _probe_device(hf).type
    autocast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    tf32 = dev == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return (type(hf), _config_fingerprint(hf.config), impls, functions, hf.training, dtype, dev, autocast,
            torch.get_float32_matmul_precision(), tf32, layout)


def _probe_ids(hf: torch.nn.Module, lengths: tuple[int, ...] = PROBE_LENGTHS) -> list[list[int]]:
    """Fixed token sequences of ``lengths`` inside the vocabulary, avoiding the config's special and media token ids."""
    try:
        vocab = int(hf.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError):
        vocab = int(hf.config.get_text_config().vocab_size)
    special: set[int] = set()
    for c in _configs(hf.config):
        for k, v in vars(c).items():
            if k.endswith(("token_id", "token_ids", "token_index", "_id")) and not isinstance(v, bool):
                for x in v if isinstance(v, (list, tuple)) else [v]:
                    if isinstance(x, int):
                        special.add(x)
    pool = [t for t in range(3, vocab) if t not in special] or list(range(vocab))
    # A stride coprime to most vocab sizes spreads the ids; the two sequences share no token.
    picks = [pool[(17 * i + 5) % len(pool)] for i in range(sum(lengths))]
    bounds = [0, *itertools.accumulate(lengths)]
    return [picks[a:b] for a, b in zip(bounds, bounds[1:])]


def _probe_batch(ids: list[list[int]], layout: tuple) -> dict[str, Any]:
    """The probe's packed batch, built by packers.Collator and cut to the keys the real batch has."""
    from packers._collate import Collator

    offsets = [0, *itertools.accumulate(len(x) for x in ids)]
    row = {"input_ids": [t for x in ids for t in x], "loss_mask": [1] * offsets[-1], "seq_offsets": offsets}
    full = Collator()([row])
    keys, use_cache = layout
    batch = {"input_ids": full["input_ids"], **{k: full[k] for k in keys}}
    if use_cache is not None:
        batch["use_cache"] = use_cache
    return batch


_DROPOUT_NAME = re.compile(r"drop|jitter|noise", re.IGNORECASE)


@contextlib.contextmanager
def _quiet(hf: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Run the probe deterministically, leaving no trace: no_grad, dropout and router noise at 0, RNG forked,
    buffers (running stats, dynamic RoPE frequencies) restored. Train mode's other behaviour stays.

    Dropout draws different masks for a packed row than for each sequence alone, so the probe would see a
    difference that is not a leak; its probabilities live in nn.Dropout modules, in float attributes copied
    from the config (``self.attention_dropout``) and in the config itself (read at run time).
    """
    saved: list[tuple[Any, str, Any]] = []
    for m in hf.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            saved.append((m, "p", m.p))
        for k, v in vars(m).items():
            if type(v) is float and v > 0 and _DROPOUT_NAME.search(k):
                saved.append((m, k, v))
    for c in _configs(hf.config):
        for k, v in vars(c).items():
            if type(v) is float and v > 0 and _DROPOUT_NAME.search(k):
                saved.append((c, k, v))
    # Buffers by module and name (a dynamic rope re-registers inv_freq: a new tensor under the old name), their
    # values (running statistics change in place), and each module's plain attributes (the rope's
    # max_seq_len_cached and attention_scaling, longrope's cached long_inv_freq).
    buffers = [(m, name, b, b.detach().clone()) for m in hf.modules() for name, b in m._buffers.items() if b is not None]
    attributes = [(m, dict(vars(m))) for m in hf.modules()]
    devices = [device] if device.type == "cuda" else []
    try:
        for obj, k, _ in saved:
            setattr(obj, k, 0.0)
        _LOCAL.probing = True
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield
    finally:
        _LOCAL.probing = False
        for obj, k, v in saved:
            setattr(obj, k, v)
        for m, before in attributes:
            now = vars(m)
            for k in [k for k in now if k not in before]:
                delattr(m, k)
            for k, v in before.items():
                if now.get(k) is not v and (v is None or isinstance(v, (int, float, bool, str, torch.Tensor))):
                    object.__setattr__(m, k, v)
        with torch.no_grad():
            for m, name, b, copy in buffers:
                if m._buffers.get(name) is not b:
                    m._buffers[name] = b
                if b.shape == copy.shape and not torch.equal(b, copy):
                    b.copy_(copy)


def _logits(out: Any) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.detach().float()


def _compute_dtype(hf: torch.nn.Module, device: torch.device, seen: list[torch.dtype]) -> torch.dtype:
    """The least precise of: the input embeddings' output, the logits, the autocast dtype (if on)."""
    dtypes = list(seen)
    if torch.is_autocast_enabled(device.type):
        dtypes.append(torch.get_autocast_dtype(device.type))
    floats = [d for d in dtypes if d.is_floating_point] or [torch.float32]
    return max(floats, key=lambda d: _TOLERANCE.get(d, 5e-2))


def _tolerance(dtype: torch.dtype, device: torch.device) -> float:
    tol = _TOLERANCE.get(dtype, 5e-2)
    if dtype == torch.float32 and (
        torch.get_float32_matmul_precision() != "highest" or (device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    ):
        tol = _TF32_TOLERANCE
    return tol


def _run_probe(
    hf: torch.nn.Module, target: torch.nn.Module, layout: tuple, fix: bool, lengths: tuple[int, ...] = PROBE_LENGTHS
) -> tuple[float, float, str | None]:
    """Run one probe row of ``lengths``: (max relative logit diff, tolerance, error or None). Never raises for the
    model's faults."""
    device = _probe_device(hf)
    ids = _probe_ids(hf, lengths)
    batch = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in _probe_batch(ids, layout).items()}
    seen: list[torch.dtype] = []
    handle = None
    try:
        emb = hf.get_input_embeddings()
        handle = emb.register_forward_hook(lambda m, a, out: seen.append(out.dtype) if torch.is_tensor(out) else None)
    except (AttributeError, NotImplementedError):
        pass
    impl = hf.config._attn_implementation
    calls = _VARLEN_CALLS[0]
    not_dispatched = (
        f"attn_implementation={impl!r} is set but was never called: {type(hf).__name__} computes attention with "
        "classes of its own instead of transformers' AttentionInterface, so it cannot use this backend"
    )
    fixed = _packed_positions(hf, batch["position_ids"]) if fix else contextlib.nullcontext()
    try:
        with _quiet(hf, device):
            with fixed:
                packed = _logits(target(**batch))[0]
            alone = [_logits(target(input_ids=torch.tensor([x], device=device)))[0] for x in ids]
    except Exception as e:  # the model cannot run a packed batch at all: refuse, naming why
        if impl in _VARLEN_NAMES and _VARLEN_CALLS[0] == calls:
            return float("nan"), 0.0, not_dispatched
        if isinstance(e, PackstreamError):
            return float("nan"), 0.0, str(e)
        return float("nan"), 0.0, f"the probe's packed forward raised {type(e).__name__}: {str(e)[:300]}"
    finally:
        if handle is not None:
            handle.remove()
    if impl in _VARLEN_NAMES and _VARLEN_CALLS[0] == calls:
        return float("nan"), 0.0, not_dispatched
    seen.append(packed.dtype)
    tol = _tolerance(_compute_dtype(hf, device, seen), device)
    ref = torch.cat(alone)
    if packed.shape != ref.shape:
        return float("nan"), tol, f"the probe's packed logits have shape {tuple(packed.shape)}, alone {tuple(ref.shape)}"
    if not (torch.isfinite(packed).all() and torch.isfinite(ref).all()):
        return float("nan"), tol, "the probe's logits are not finite (nan/inf), packed or alone"
    # Relative to the logits' own scale, with no floor: tiny random models have logits of ~1e-2, where a
    # leak of 1e-4 (1%, InklingForCausalLM in the matrix) hid under a floor of 1 (fp32 rounding here: ~1e-6).
    err = (packed - ref).abs().max().item()
    scale = ref.abs().max().item()
    diff = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
    return diff, tol, None


def _agree(ok: bool, device: torch.device) -> bool:
    """Under torch.distributed, ok only if every rank's probe is ok (all_reduce MIN), so no rank trains alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    backend = str(dist.get_backend())
    if "gloo" in backend or backend == "mpi":
        dev = torch.device("cpu")
    elif device.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = device
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _run_probes(
    hf: torch.nn.Module, target: torch.nn.Module, layout: tuple, fix: bool, probes: list[tuple[tuple[int, int], str]]
) -> tuple[float, float, str | None, str]:
    """Every probe row in turn, up to the first that fails: (worst diff, tolerance, error, which row)."""
    worst, tol, what = 0.0, 0.0, ""
    for lengths, crossing in probes:
        diff, tol, error = _run_probe(hf, target, layout, fix, lengths)
        what = f"{len(lengths)} sequences of {' and '.join(map(str, lengths))} tokens{crossing}"
        if error is not None or not diff <= tol:
            return diff, tol, error, what
        worst = max(worst, diff)
    return worst, tol, None, what


def _probe(hf: torch.nn.Module, target: torch.nn.Module, layout: tuple) -> _Verdict:
    """Probe as is; if that leaks under a mask backend, probe with position_ids supplied to the mask functions.

    Under torch.distributed every rank runs the same forwards and the verdict is agreed after each probe.
    """
    t0 = time.perf_counter()
    device = _probe_device(hf)
    rope = _batch_rope(hf)
    probes = _probes(hf, rope)
    shapes = tuple(lengths for lengths, _ in probes)
    diff, tol, error, what = _run_probes(hf, target, layout, False, probes)
    if _agree(error is None and diff <= tol, device):
        return _Verdict(None, False, diff, time.perf_counter() - t0, shapes, rope)
    impl = hf.config._attn_implementation
    fix_note = ""
    # The fix is for models that build their masks without position_ids (GptOss, OPT, Bloom, MPT, ... in
    # transformers 5.24): masking_utils then cannot see the packed layout. Passing it gives ~2e-7 (issue 11).
    fixable = error is None and "position_ids" in layout[0] and impl not in _VARLEN_NAMES and "flash" not in impl
    if fixable and _agree(bool(_mask_patches(hf)), device):
        fix_diff, _, fix_error, fix_what = _run_probes(hf, target, layout, True, probes)
        if _agree(fix_error is None and fix_diff <= tol, device):
            return _Verdict(None, True, fix_diff, time.perf_counter() - t0, shapes, rope)
        fix_note = (f", and still by {fix_diff:.2g} ({fix_what}) with position_ids passed to its mask functions"
                    if fix_error is None else f"; with position_ids passed to its mask functions it raised: {fix_error}")
    mode = "train" if hf.training else "eval"
    if error is None and diff <= tol:
        cause = "another rank's packing probe failed (see that rank's error)"
    elif error is None:
        cause = (
            f"the packing probe ({what}, packed vs alone) "
            f"differs by {diff:.2g} > {tol:.0e} (max logit diff / max logit){fix_note}"
        )
    else:
        cause = error.rstrip(". ")
    others = " or ".join(repr(b) for b in ("flash_attention_2", VARLEN_NAME, "sdpa") if b != impl)
    what = "lets packed examples interact" if error is None else "cannot run the packing probe"
    message = (
        f"{type(hf).__name__} {what} under attn_implementation={impl!r} ({mode} mode): {cause}. Use another "
        f"attn_implementation (e.g. {others}; each is probed the same way), or do not pack for this model: "
        "collate padded batches with an attention_mask"
    )
    return _Verdict(message, False, diff, time.perf_counter() - t0, shapes, rope)


def _verdict(hf: torch.nn.Module, target: torch.nn.Module, layout: tuple) -> _Verdict:
    """This model's verdict as it is now: cached while its key holds; probes (all ranks together) otherwise.

    Cached per model object, not per class and config alone: a hook, an adapter or a patched module on
    one instance changes what it computes without changing either. A refusal is not cached, so a model
    that was fixed in place is probed again at its next packed batch (on every rank alike).
    """
    key = (layout, _key(hf, layout))
    state = _STATE.setdefault(hf, {})
    known = state.get(key)
    if known is not None:
        return known
    verdict = _probe(hf, target, layout)
    if verdict.error is None:
        state[key] = verdict
        while len(state) > _STATES_KEPT:
            state.pop(next(iter(state)))
    return verdict


def cached_verdict(model: torch.nn.Module, batch: Mapping[str, Any]) -> _Verdict | None:
    """The cached verdict that ``batch`` gets from ``model`` as it is now (for tools and tests), or None."""
    hf = _hf_model(model)
    layout = _layout(batch)
    return None if layout is None else (_STATE.get(hf) or {}).get((layout, _key(hf, layout)))


# -- the fix: position_ids for the mask functions that a model calls without them -------------------

_MASK_CREATORS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")
_PACKED_POSITIONS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "packstream_packed_positions", default=None
)


def _with_packed_positions(create: Callable[..., Any]) -> Callable[..., Any]:
    """``create`` (a masking_utils mask function), given the guarded batch's position_ids when its caller
    passes none; in place only during such a forward (:func:`_packed_positions`), and a pass-through in
    any other thread meanwhile (the positions are a context variable).

    Kept out of torch.compile graphs: the positions change every batch and must not be traced as constants.
    """

    @torch.compiler.disable
    @functools.wraps(create)
    def create_with_packed_positions(*args: Any, **kwargs: Any) -> Any:
        pos = _PACKED_POSITIONS.get()
        # Signature (transformers 5.24): config, inputs_embeds, attention_mask, cache, position_ids, ...
        if pos is not None and len(args) < 5 and kwargs.get("position_ids") is None:
            embeds = kwargs.get("inputs_embeds", args[1] if len(args) > 1 else None)
            if torch.is_tensor(embeds) and embeds.dim() >= 2 and embeds.shape[1] == pos.shape[-1]:
                kwargs["position_ids"] = pos.to(embeds.device)
        return create(*args, **kwargs)

    create_with_packed_positions._packstream_wraps = create  # type: ignore[attr-defined]
    return create_with_packed_positions


_PATCHES: dict[type, list[tuple[Any, str, Callable[..., Any], Callable[..., Any]]]] = {}


def _mask_patches(hf: torch.nn.Module) -> list[tuple[Any, str, Callable[..., Any], Callable[..., Any]]]:
    """(module, name, original, wrapper) for each masking_utils mask function that ``hf``'s modeling modules
    hold; empty if they hold none. Computed once per model class."""
    from transformers import masking_utils

    if type(hf) not in _PATCHES:
        originals = {id(getattr(masking_utils, n)): getattr(masking_utils, n) for n in _MASK_CREATORS}
        patches = []
        for module in {sys.modules.get(type(m).__module__) for m in hf.modules()}:
            if module is None or module is masking_utils:
                continue
            for name, obj in list(vars(module).items()):
                if originals.get(id(obj)) is obj:
                    patches.append((module, name, obj, _with_packed_positions(obj)))
        _PATCHES[type(hf)] = patches
    return _PATCHES[type(hf)]


@contextlib.contextmanager
def _packed_positions(hf: torch.nn.Module, position_ids: torch.Tensor) -> Iterator[None]:
    """For the duration of one forward: ``hf``'s mask functions get ``position_ids`` when called without.

    The modules' names point at the wrappers only meanwhile (then back at transformers' own functions,
    unless someone else replaced them since), so nothing changes for other models or later calls, and
    the wrappers' graph break under torch.compile is confined to guarded packed forwards.
    """
    patches = _mask_patches(hf)
    token = _PACKED_POSITIONS.set(position_ids)
    for module, name, _, wrapper in patches:
        setattr(module, name, wrapper)
    try:
        yield
    finally:
        for module, name, original, wrapper in patches:
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)
        _PACKED_POSITIONS.reset(token)


# -- public entry points ------------------------------------------------------------------------------


def _guarded(hf: torch.nn.Module) -> bool:
    return any(getattr(h, "_packstream_guard", False) for h in hf._forward_pre_hooks.values())


def _check(hf: torch.nn.Module, target: torch.nn.Module, batch: Mapping[str, Any]) -> _Verdict | None:
    """Static rules, then the verdict; raises PackstreamError for a packed batch that would leak.

    Returns the verdict (None when the batch carries no boundaries to probe). The verdict is computed
    for every batch with boundaries, packed or not, so that all ranks probe at the same step.
    """
    packed = _num_sequences(batch) > 1
    if packed:
        _check_static(hf, batch)
    layout = _layout(batch)
    if layout is None:
        return None
    verdict = _verdict(hf, target, layout)
    if packed and verdict.error is not None:
        raise PackstreamError(verdict.error)
    if packed and verdict.rope is not None:
        _check_rope(hf, verdict.rope, batch)
    return verdict


def check_packing_safe(model: torch.nn.Module, batch: Mapping[str, Any]) -> None:
    """Raise PackstreamError if ``model(**batch)`` would let packed examples attend to each other.

    Per step it reads the config and the batch's keys and shapes (one small device sync without
    ``cu_seq_lens_q``); see the module docstring's table. The first call for a model class,
    configuration, backend, mode, dtype and batch layout also runs the packing probe: one forward of
    12 packed tokens and two of 5 and 7 alone, under ``no_grad`` (cached afterwards). Under
    torch.distributed the probe agrees across ranks: call this on every rank, as you would a forward.
    A batch holding one sequence always passes.
    """
    hf = _hf_model(model)
    target = model
    while hasattr(target, "_orig_mod"):  # torch.compile's wrapper: probe the eager module, compile nothing
        target = target._orig_mod
    verdict = _check(hf, target, batch)
    if verdict is not None and verdict.fix and _num_sequences(batch) > 1 and not _guarded(hf):
        raise PackstreamError(
            f"{type(hf).__name__} builds its {hf.config._attn_implementation!r} masks without position_ids, so a "
            "plain model(**batch) lets packed examples attend to each other; install_packing_guard(model) passes "
            "them (the probe found that exact), or use another attn_implementation"
        )


class GuardHandle:
    """What :func:`install_packing_guard` returns: ``remove()`` takes the guard off (also as a context manager)."""

    def __init__(self, *handles: torch.utils.hooks.RemovableHandle) -> None:
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def install_packing_guard(model: torch.nn.Module) -> GuardHandle:
    """Check every forward of ``model``: the static rules per batch, the packing probe when the model changes.

    Before the first packed forward, and whenever the attention implementation, train/eval mode,
    dtype, device, autocast or batch layout changes, the model runs the packing probe (cost: one
    forward of 12 tokens and two of 5 and 7, under ``no_grad``, once per model class and
    configuration; every rank together under DDP/FSDP). A model found to build its masks without
    ``position_ids`` gets them from the guard when that makes the probe exact; any other mismatch
    raises PackstreamError naming the model, the backend and the fix. Catches what a trainer or a
    wrapper adds to the batch after the collator (an ``attention_mask``, a cache): the hook sits on
    the transformers model inside DDP/FSDP/PEFT/torch.compile wrappers. ``handle.remove()`` takes it off.
    """
    hf = _hf_model(model)
    params = list(inspect.signature(hf.forward).parameters)
    stack: list[contextlib.ExitStack | None] = []

    @torch.compiler.disable  # data-dependent checks and the probe's forwards stay out of compiled graphs
    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        stack.append(None)  # popped by post_hook, which runs even if this raises
        if getattr(_LOCAL, "probing", False):
            return
        batch = dict(zip(params, args)) | kwargs
        verdict = _check(hf, hf, batch)
        if verdict is not None and verdict.fix and _num_sequences(batch) > 1:
            fix = contextlib.ExitStack()
            fix.enter_context(_packed_positions(hf, batch["position_ids"]))
            stack[-1] = fix

    @torch.compiler.disable
    def post_hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        fix = stack.pop() if stack else None
        if fix is not None:
            fix.close()

    pre_hook._packstream_guard = True  # type: ignore[attr-defined]
    return GuardHandle(
        hf.register_forward_pre_hook(pre_hook, with_kwargs=True),
        hf.register_forward_hook(post_hook, with_kwargs=True, always_call=True),
    )
