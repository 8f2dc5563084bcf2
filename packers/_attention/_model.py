"""What the guard reads from a transformers model: the model inside its wrappers, its configs, its input device,
its special token ids and its dropout settings."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from packers.errors import PackstreamError

_DROPOUT_NAME = re.compile(r"drop|jitter|noise", re.IGNORECASE)


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers PreTrainedModel inside DDP/FSDP/PEFT/torch.compile wrappers."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            return m
    raise PackstreamError(f"{type(model).__name__} contains no transformers PreTrainedModel")


def configs(config: Any) -> Iterator[Any]:
    """A config and its sub-configs (text, vision, ...), depth first, each once."""
    seen, todo = set(), [config]
    while todo:
        c = todo.pop()
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        yield c
        todo.extend(getattr(c, k, None) for k in getattr(c, "sub_configs", {}) or {})


def uses_mrope(hf: torch.nn.Module) -> bool:
    """Does the model rotate by 3-D positions (mRoPE: Qwen2-VL, Qwen2.5-VL, ...)? Read from its configs'
    ``rope_parameters``/``rope_scaling`` (an ``mrope_section``), or a ``get_rope_index`` method on the model or its
    base model (cheap: runs every step)."""
    for c in configs(hf.config):
        for key in ("rope_parameters", "rope_scaling"):
            rope = getattr(c, key, None)
            if isinstance(rope, dict) and ("mrope_section" in rope or any(
                    isinstance(v, dict) and "mrope_section" in v for v in rope.values())):
                return True
    return any(callable(getattr(m, "get_rope_index", None)) for m in (hf, getattr(hf, "model", None)))


def input_device(hf: torch.nn.Module) -> torch.device:
    """Where the model takes its input ids (its input embeddings' device)."""
    try:
        return hf.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        return next(hf.parameters()).device


def special_token_ids(config: Any) -> set[int]:
    """The token ids a config and its sub-configs name (``*token_id``, ``*token_ids``, ``*token_index``, ``*_id``)."""
    special: set[int] = set()
    for c in configs(config):
        for k, v in vars(c).items():
            if k.endswith(("token_id", "token_ids", "token_index", "_id")) and not isinstance(v, bool):
                for x in v if isinstance(v, (list, tuple)) else [v]:
                    if isinstance(x, int):
                        special.add(x)
    return special


def dropout_settings(hf: torch.nn.Module) -> list[tuple[Any, str, float]]:
    """``(object, attribute, value)`` of every dropout probability above 0 the model reads at run time: in
    nn.Dropout modules, in float attributes copied from the config (``self.attention_dropout``; router jitter and
    noise too) and in the configs themselves."""
    found: list[tuple[Any, str, float]] = []
    for m in hf.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            found.append((m, "p", m.p))
        for k, v in vars(m).items():
            if type(v) is float and v > 0 and _DROPOUT_NAME.search(k):
                found.append((m, k, v))
    for c in configs(hf.config):
        for k, v in vars(c).items():
            if type(v) is float and v > 0 and _DROPOUT_NAME.search(k):
                found.append((c, k, v))
    return found
