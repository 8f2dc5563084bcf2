"""Test helper: tiny random transformers models (fp32, CPU, seeded), a CPU reference of torch's varlen kernel, and
the packed-vs-alone measure the guard and exactness tests share.

One builder for every test's tiny model: :func:`tiny_model` (hidden 32, 2 layers, 4 heads of 8, 2 kv heads,
vocab 97, 128 positions unless overridden), seeded with ``torch.manual_seed(0)`` so that a model of one kind and
configuration is the same in every test.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

VOCAB = 97
TOL = 1e-5
"""Max abs diff of logits, per-token loss and gradients allowed between packed and alone (fp32 rounding: ~1e-7)."""

BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
_KINDS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # kind: (config class, model class, settings besides BASE)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {"head_dim": 8, "intermediate_size_mlp": 64, "num_local_experts": 2}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"intermediate_size": 32, "head_dim": 8, "num_local_experts": 4,
                                                      "num_experts_per_tok": 2, "sliding_window": 4}),
}

MODELS = [("llama", {}), ("qwen2", {}), ("mistral", {}), ("mistral", {"sliding_window": 4})]
"""The exactness matrix's models (tests/test_exactness.py, tests/test_dpo.py)."""
MODEL_IDS = ["llama", "qwen2", "mistral", "mistral-window4"]


def tiny_model(kind: str = "llama", attn: str = "sdpa", **overrides: Any) -> torch.nn.Module:
    """A tiny random causal LM of ``kind`` (a key of ``_KINDS``) under ``attn_implementation=attn``; ``overrides``
    change its config (e.g. ``sliding_window=4``, ``max_position_embeddings=64``)."""
    import transformers

    config_name, model_name, settings = _KINDS[kind]
    cfg = getattr(transformers, config_name)(**{**BASE, **settings, **overrides})
    torch.manual_seed(0)
    return getattr(transformers, model_name)._from_config(cfg, attn_implementation=attn)


def tiny_opt(attn: str, **overrides: Any) -> torch.nn.Module:
    """A tiny OPT (whose transformers 5.24 code builds its masks without position_ids)."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                    word_embed_proj_dim=32, max_position_embeddings=128, **overrides)
    torch.manual_seed(0)
    return OPTForCausalLM._from_config(cfg, attn_implementation=attn)


def max_diff(model: torch.nn.Module, batch: dict, relative: bool = False) -> float:
    """Max abs logit diff, packed batch vs each sequence alone (no_grad); with ``relative``, over the largest
    logit (the guard's measure: tiny random models have logits of ~1e-2)."""
    with torch.no_grad():
        logits = model(**batch).logits[0]
        cu = batch["cu_seq_lens_q"].tolist()
        diff = max((model(input_ids=batch["input_ids"][:, a:b]).logits[0] - logits[a:b]).abs().max().item()
                   for a, b in zip(cu, cu[1:]))
        return diff / logits.abs().max().item() if relative else diff


# -- the torch varlen backend on CPU ---------------------------------------------------------------------------


def reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """What torch.nn.attention.varlen.varlen_attn computes, on any device: per-sequence attention."""
    assert isinstance(window_size, tuple)  # varlen_attn compares it to the tuple (-1, 0)
    if enable_gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.empty_like(q)
    left, right = window_size
    for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:]):
        i = torch.arange(b - a)[:, None]
        j = torch.arange(b - a)[None, :]
        allowed = torch.ones(b - a, b - a, dtype=torch.bool)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))
        out[a:b] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scale).transpose(0, 1)
    return out


def cpu_varlen(monkeypatch) -> str:
    """Register packstream_varlen with :func:`reference_varlen_attn` as its kernel, on CPU and in fp32 too, for the
    rest of the test (``monkeypatch`` undoes it); returns the backend's name."""
    from packers import register_varlen_attention
    from tests._internals import VARLEN

    monkeypatch.setattr(VARLEN, "kernel", lambda: reference_varlen_attn)
    monkeypatch.setattr(VARLEN, "devices", ("cuda", "cpu"))
    monkeypatch.setattr(VARLEN, "dtypes", (torch.float16, torch.bfloat16, torch.float32))
    return register_varlen_attention()
