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

Models with 3-D rotary positions (mRoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) build the packed mask only from ``[4, B, T]``
position_ids (row 0 the text positions): any other packed batch leaks under every backend, and is refused naming
``packers.Collator(vision=...)``, which collates them so; the probe collates its rows the same way. LLaVA keeps
1-D positions (the text rules and probe decide). Gemma 3 (``token_type_ids``: a bidirectional block per image) is
refused a packed batch with images but no ``token_type_ids``, and a plain forward of one with images outside a row's
first example, whose sliding-window masks transformers misplaces; :func:`install_packing_guard` builds them exactly
(:mod:`._blocks`). A batch with ``pixel_values`` whose vision tower runs under a
varlen backend is refused while it carries ``cu_seq_lens_*``: transformers hands them on to the tower's attention.

Two layers of defence, both raising :class:`~packers.PackstreamError` with the fix:

* **Static rules** (every step, cheap; :mod:`._rules`): the "leaks when" column, read from the batch and the config.
* **A behavioural probe** (once per model class, configuration, backend, mode, dtype and batch layout;
  :mod:`._probe`): the model itself runs two short sequences (5 and 7 tokens) packed into one ``[1, 12]``
  batch, and each alone, under ``no_grad``; the logits must agree within the dtype's noise. No
  list of models is consulted, so a model whose code forgets the packed layout (GptOss and OPT
  build their masks without ``position_ids`` in transformers 5.24) is caught by what it computes.
  Where the only fault is that forgotten argument, :func:`install_packing_guard` supplies it (:mod:`._fixes`;
  the probe must then prove the result exact); otherwise the model is refused.

:func:`check_packing_safe` runs both for one batch; :func:`install_packing_guard` runs them before
every forward of a model (:mod:`._guard`, which caches the verdicts); both take ``max_length``, the longest batch
the probe must cover (a folder's budget), and :func:`guard_max_length` gives one model that length for every later
probe (the packed trainers pass their folder's budget). Opening a folder changes no model's probe: the old
process-wide ``note_budget`` raises, naming these. :func:`register_varlen_attention` adds the
``packstream_varlen`` backend (:mod:`._varlen`): PyTorch's own FlashAttention kernel
(``torch.nn.attention.varlen.varlen_attn``, PyTorch >= 2.10, CUDA only), for FA2-speed packed training where the
flash-attn package cannot be installed.

The modules, by job: ``_varlen`` the kernel, ``_rules`` the static rules, ``_probe`` the probe, ``_guard`` the
entry points and the verdict cache, ``_fixes`` the fixes to transformers (mask functions, class tables),
``_model`` what they read from a model, ``_blocks`` Gemma 3's image blocks.
"""

from packers._attention._guard import (GuardHandle, cached_verdict, check_packing_safe, guard_max_length,
                                      install_packing_guard, note_budget)
from packers._attention._varlen import VARLEN_NAME, register_varlen_attention, varlen_attention_forward

__all__ = [
    "VARLEN_NAME",
    "GuardHandle",
    "cached_verdict",
    "check_packing_safe",
    "guard_max_length",
    "install_packing_guard",
    "register_varlen_attention",
    "varlen_attention_forward",
]
