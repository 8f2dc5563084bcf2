"""Fixes to transformers for packed batches, each applied only where it is needed.

* :data:`MASK_FIX`: some models build their masks without ``position_ids`` (GptOss, OPT, Bloom, MPT, ... in
  transformers 5.24), so masking_utils cannot see the packed layout and sdpa/eager attend across examples. During a
  guarded packed forward, their mask functions get the batch's position_ids; the guard applies this only where the
  packing probe found it exact (about 2e-7 of the logits).
* :data:`CLASS_TABLES`: a few models pick their attention class from a dict of their own instead of transformers'
  ``AttentionInterface``; built with a registered backend such as ``packstream_varlen``, they raise a PackstreamError
  naming the backends they know, not a ``KeyError``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from packers.errors import PackstreamError

_MASK_CREATORS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")
Patch = tuple[Any, str, Callable[..., Any], Callable[..., Any]]
"""(module, name, transformers' function, its wrapper): one name a model's modeling module holds a mask function by."""


class MaskFix:
    """position_ids for the masking_utils mask functions that a model calls without them, during guarded forwards.

    Holds the patches of each model class (computed once per class) and the guarded batch's positions (a context
    variable: another thread calling the same functions meanwhile sees a pass-through).
    """

    def __init__(self) -> None:
        self._patches: dict[type, list[Patch]] = {}
        self._positions: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
            "packstream_packed_positions", default=None
        )

    def patches(self, hf: torch.nn.Module) -> list[Patch]:
        """The patches for each masking_utils mask function that ``hf``'s modeling modules hold; empty if none."""
        from transformers import masking_utils

        if type(hf) not in self._patches:
            originals = {id(getattr(masking_utils, n)): getattr(masking_utils, n) for n in _MASK_CREATORS}
            patches = []
            for module in {sys.modules.get(type(m).__module__) for m in hf.modules()}:
                if module is None or module is masking_utils:
                    continue
                for name, obj in list(vars(module).items()):
                    if originals.get(id(obj)) is obj:
                        patches.append((module, name, obj, self._wrap(obj)))
            self._patches[type(hf)] = patches
        return self._patches[type(hf)]

    def _wrap(self, create: Callable[..., Any]) -> Callable[..., Any]:
        """``create`` (a masking_utils mask function), given the guarded batch's position_ids when its caller passes
        none. Kept out of torch.compile graphs: the positions change every batch and must not be traced as constants."""
        positions = self._positions

        @torch.compiler.disable
        @functools.wraps(create)
        def create_with_packed_positions(*args: Any, **kwargs: Any) -> Any:
            pos = positions.get()
            # Signature (transformers 5.24): config, inputs_embeds, attention_mask, cache, position_ids, ...
            if pos is not None and len(args) < 5 and kwargs.get("position_ids") is None:
                embeds = kwargs.get("inputs_embeds", args[1] if len(args) > 1 else None)
                if torch.is_tensor(embeds) and embeds.dim() >= 2 and embeds.shape[1] == pos.shape[-1]:
                    kwargs["position_ids"] = pos.to(embeds.device)
            return create(*args, **kwargs)

        create_with_packed_positions._packstream_wraps = create  # type: ignore[attr-defined]
        return create_with_packed_positions

    @contextlib.contextmanager
    def packed_positions(self, hf: torch.nn.Module, position_ids: torch.Tensor) -> Iterator[None]:
        """For the duration of one forward: ``hf``'s mask functions get ``position_ids`` when called without.

        The modules' names point at the wrappers only meanwhile (then back at transformers' own functions,
        unless someone else replaced them since), so nothing changes for other models or later calls, and
        the wrappers' graph break under torch.compile is confined to guarded packed forwards.
        """
        patches = self.patches(hf)
        token = self._positions.set(position_ids)
        for module, name, _, wrapper in patches:
            setattr(module, name, wrapper)
        try:
            yield
        finally:
            for module, name, original, wrapper in patches:
                if getattr(module, name, None) is wrapper:
                    setattr(module, name, original)
            self._positions.reset(token)


MASK_FIX = MaskFix()

_CLASS_TABLE = re.compile(r"^(\w*ATTENTION_CLASSES)\s*=\s*\{", re.MULTILINE)


class ClassTables:
    """Make every transformers class table of attention classes answer a backend name with a PackstreamError.

    A few models pick their attention class from a dict of their own, e.g. Falcon's
    ``FALCON_ATTENTION_CLASSES[config._attn_implementation](config, layer_idx)`` (transformers 5.24,
    models/falcon/modeling_falcon.py), so a backend registered with ``AttentionInterface`` fails there
    with ``KeyError: 'packstream_varlen'`` while the model is built.
    """

    def __init__(self) -> None:
        self.done: set[str] = set()
        """The backend names the tables already answer."""

    def refuse(self, name: str) -> None:
        """Add an entry for ``name`` that raises at construction to every table that lacks one. The modules are
        found by their source (~40 ms for ~540 files) and imported; once per name."""
        spec = importlib.util.find_spec("transformers")
        if name in self.done or spec is None or spec.origin is None:
            return
        self.done.add(name)
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


CLASS_TABLES = ClassTables()


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
