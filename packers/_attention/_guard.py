"""The packing guard's entry points, and its verdicts cached per model.

:func:`check_packing_safe` runs the static rules (:mod:`packers._attention._rules`) and the behavioural probe
(:mod:`packers._attention._probe`) for one batch; :func:`install_packing_guard` runs them before every forward of
a model, and applies the mask fix where the probe found it exact. :data:`GUARD` holds the verdicts.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Self

import torch

from packers._attention._blocks import block_problem, image_blocks, packed_blocks
from packers._attention._fixes import MASK_FIX
from packers._attention._model import configs, hf_model, input_device
from packers._attention._probe import Verdict, agree_max, layout, probe, reach_for
from packers._attention._rules import check_rope, check_static, num_sequences
from packers._examples import text_positions
from packers.errors import PackstreamError


class Guard:
    """The guard's state in this process: each model's verdicts, and whether this thread runs a probe.

    Verdicts are cached per model object, not per class and config alone: a hook, an adapter or a patched module on
    one instance changes what it computes without changing either. Each is kept while its key holds (:func:`_key`:
    class, config, backend, mode, dtype, device, autocast, batch layout); ``kept`` of them per model, so that
    switching between train and eval or between a few layouts does not probe again. A refusal is not cached, so a
    model that was fixed in place is probed again at its next packed batch (on every rank alike).
    """

    def __init__(self, kept: int = 16) -> None:
        self.verdicts: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, Verdict]] = weakref.WeakKeyDictionary()
        self.kept = kept
        self._local = threading.local()
        self.lengths: weakref.WeakKeyDictionary[torch.nn.Module, int] = weakref.WeakKeyDictionary()
        """Per model: the longest batch it will be fed, as told by :func:`guard_max_length` (the packed trainers
        pass their folder's budget). Its probes reach at least that far; no other model's do."""

    @property
    def probing(self) -> bool:
        """This thread runs the probe's forwards (the guard's hooks let those through)."""
        return getattr(self._local, "probing", False)

    def probe(self, hf: torch.nn.Module, target: torch.nn.Module, layout: tuple, reach: int = 0) -> Verdict:
        """:func:`packers._attention._probe.probe`, with the guard's hooks standing aside for its forwards."""
        self._local.probing = True
        try:
            return probe(hf, target, layout, reach)
        finally:
            self._local.probing = False

    def verdict(self, hf: torch.nn.Module, target: torch.nn.Module, layout: tuple, reach: int = 0) -> Verdict:
        """This model's verdict as it is now, for batches up to ``reach`` tokens: cached while its key holds and
        its probe reached that far; probes (all ranks together) otherwise."""
        key = (layout, _key(hf, layout))
        state = self.verdicts.setdefault(hf, {})
        known = state.get(key)
        if known is not None and known.reach >= reach:
            return known
        verdict = self.probe(hf, target, layout, max(reach, known.reach if known is not None else 0))
        if verdict.error is None:
            state[key] = verdict
            while len(state) > self.kept:
                state.pop(next(iter(state)))
        return verdict

    def cached(self, hf: torch.nn.Module, layout: tuple) -> Verdict | None:
        return (self.verdicts.get(hf) or {}).get((layout, _key(hf, layout)))


GUARD = Guard()


def guard_max_length(model: torch.nn.Module, max_length: int) -> None:
    """``model`` will be fed batches up to ``max_length`` tokens: its probes (under :func:`install_packing_guard` or
    :func:`check_packing_safe`) reach at least that far, and under torch.distributed agree on their length without
    an all_reduce per step (every rank makes the same call). Per model, never raised by another model's call or by
    opening a folder; it only grows. :class:`packers.PackedDPOTrainer` and :class:`packers.PackedKTOTrainer` call it
    for their model and reference model with their folder's budget. A module holding no transformers model has no
    guard to tell: nothing happens."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise PackstreamError(f"max_length={max_length!r}: give the longest batch in tokens, an int >= 1 "
                              "(e.g. PackedDataset(...).budget)")
    from transformers import PreTrainedModel

    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is not None:
        GUARD.lengths[hf] = max(GUARD.lengths.get(hf, 0), max_length)


def note_budget(budget: int) -> None:
    """Removed (issue 55): it raised the probe length of every model in the process. Raises, naming the new
    spelling."""
    raise PackstreamError(
        f"note_budget({budget!r}) is gone: it lengthened the probes of every model in the process. The probe length "
        f"belongs to the model: install_packing_guard(model, max_length={budget!r}) or check_packing_safe(model, "
        f"batch, max_length={budget!r}) (a folder's budget is PackedDataset(...).budget; PackedDPOTrainer and "
        "PackedKTOTrainer pass theirs)")


def _config_fingerprint(config: Any) -> tuple:
    """The plain values of a config and its sub-configs (~50 us): a changed window or rope setting shows here."""
    plain = (int, float, str, bool, type(None))
    return tuple(
        tuple(sorted((k, v if isinstance(v, plain) else repr(v)) for k, v in vars(c).items()
                     if isinstance(v, plain) or (isinstance(v, (list, tuple, dict)) and len(v) < 256)))
        for c in configs(config)
    )


def _key(hf: torch.nn.Module, layout: tuple) -> tuple:
    """What, when it changes, calls for a new probe: the class, the config, the backend (and the functions
    registered for it), train/eval mode, dtype, device, autocast, float32 matmul precision, batch layout."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    impls = tuple(getattr(c, "_attn_implementation", None) for c in configs(hf.config))
    functions = tuple(
        (AttentionInterface._global_mapping.get(i), ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(i))
        for i in impls
        if isinstance(i, str)
    )
    param = next(hf.parameters(), None)
    dtype = param.dtype if param is not None else None
    dev = input_device(hf).type
    autocast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
    tf32 = dev == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return (type(hf), _config_fingerprint(hf.config), impls, functions, hf.training, dtype, dev, autocast,
            torch.get_float32_matmul_precision(), tf32, layout)


def cached_verdict(model: torch.nn.Module, batch: Mapping[str, Any]) -> Verdict | None:
    """The cached verdict that ``batch`` gets from ``model`` as it is now (for tools and tests), or None."""
    hf = hf_model(model)
    shape = layout(batch)
    return None if shape is None else GUARD.cached(hf, shape)


def _reach(hf: torch.nn.Module, batch: Mapping[str, Any], max_length: int | None) -> int:
    """How far the probe must reach for ``batch``: its length, the caller's ``max_length`` and the length given for
    this model (:func:`guard_max_length`), whichever is longest (:func:`reach_for` rounds it up). Under
    torch.distributed with neither of the two given, the ranks agree on the longest batch (one all_reduce of an int
    per step), so that every rank probes at the same step and the same length; with one, every rank knows it."""
    ids = batch.get("input_ids", batch.get("position_ids"))
    tokens = int(ids.shape[-1]) if torch.is_tensor(ids) else 0
    known = max(max_length or 0, GUARD.lengths.get(hf, 0))
    if not known:
        tokens = agree_max(tokens, input_device(hf))
    return reach_for(hf, max(tokens, known))


def _check(hf: torch.nn.Module, target: torch.nn.Module, batch: Mapping[str, Any],
           max_length: int | None = None, guarded: bool = False) -> Verdict | None:
    """Static rules, then the verdict; raises PackstreamError for a packed batch that would leak.

    Returns the verdict (None when the batch carries no boundaries to probe). The verdict is computed
    for every batch with boundaries, packed or not, so that all ranks probe at the same step.
    """
    packed = num_sequences(batch) > 1
    if packed:
        check_static(hf, batch)
        if image_blocks(hf) and (why := block_problem(hf, batch, guarded)[0]) is not None:
            raise PackstreamError(why)
    shape = layout(batch)
    if shape is None:
        return None
    verdict = GUARD.verdict(hf, target, shape, _reach(hf, batch, max_length))
    if packed and verdict.error is not None:
        raise PackstreamError(verdict.error)
    if packed and verdict.rope is not None:
        check_rope(hf, verdict.rope, batch)
    return verdict


def _guarded(hf: torch.nn.Module) -> bool:
    return any(getattr(h, "_packstream_guard", False) for h in hf._forward_pre_hooks.values())


def check_packing_safe(model: torch.nn.Module, batch: Mapping[str, Any], *, max_length: int | None = None) -> None:
    """Raise PackstreamError if ``model(**batch)`` would let packed examples attend to each other.

    Per step it reads the config and the batch's keys and shapes (one small device sync without
    ``cu_seq_lens_q``); see :mod:`packers._attention`'s table. The first call for a model class,
    configuration, backend, mode, dtype and batch layout also runs the packing probe: one forward of
    12 packed tokens and two of 5 and 7 alone, then one row as long as the batch or ``max_length`` (pass the folder's
    ``PackedDataset(...).budget``; or the length :func:`guard_max_length` gave this model), whichever is longest,
    rounded up to a power of two, with a sequence starting late, and its sequences alone, under ``no_grad`` (cached
    afterwards; a longer batch probes again). Opening a folder changes no model's probe. Under torch.distributed the
    probe agrees across ranks: call this on every rank, as you would a forward (with no length given, the ranks agree
    on the longest batch by one all_reduce of an int per call).
    A batch holding one sequence always passes.
    """
    hf = hf_model(model)
    target = model
    while hasattr(target, "_orig_mod"):  # torch.compile's wrapper: probe the eager module, compile nothing
        target = target._orig_mod
    verdict = _check(hf, target, batch, max_length, guarded=_guarded(hf))
    if verdict is not None and verdict.fix and num_sequences(batch) > 1 and not _guarded(hf):
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


def install_packing_guard(model: torch.nn.Module, *, max_length: int | None = None) -> GuardHandle:
    """Check every forward of ``model``: the static rules per batch, the packing probe when the model changes.

    Before the first packed forward, and whenever the attention implementation, train/eval mode,
    dtype, device, autocast or batch layout changes, the model runs the packing probe (cost: one
    forward of 12 tokens and two of 5 and 7, then about two forwards of the longest row it covers -- the batch's
    length, or ``max_length`` (pass the folder's ``PackedDataset(...).budget``: no per-step all_reduce under
    DDP/FSDP) or the length :func:`guard_max_length` gave this model when longer, rounded up to a power of two --
    under ``no_grad``, once per model class and configuration; every rank together under DDP/FSDP). Opening a folder
    changes no model's probe. A model found to build its masks without
    ``position_ids`` gets them from the guard when that makes the probe exact; any other mismatch
    raises PackstreamError naming the model, the backend and the fix. Catches what a trainer or a
    wrapper adds to the batch after the collator (an ``attention_mask``, a cache): the hook sits on
    the transformers model inside DDP/FSDP/PEFT/torch.compile wrappers. ``handle.remove()`` takes it off.
    """
    hf = hf_model(model)
    params = list(inspect.signature(hf.forward).parameters)
    stack: list[contextlib.ExitStack | None] = []

    @torch.compiler.disable  # data-dependent checks and the probe's forwards stay out of compiled graphs
    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        stack.append(None)  # popped by post_hook, which runs even if this raises
        if GUARD.probing:
            return
        batch = dict(zip(params, args)) | kwargs
        verdict = _check(hf, hf, batch, max_length, guarded=True)
        packed = num_sequences(batch) > 1
        blocks = packed and image_blocks(hf) and block_problem(hf, batch, True)[1]
        if packed and (blocks or (verdict is not None and verdict.fix)):
            fix = contextlib.ExitStack()
            if verdict is not None and verdict.fix:
                fix.enter_context(MASK_FIX.packed_positions(hf, text_positions(batch)))
            if blocks:  # Gemma 3's image blocks at the row's indices (packers._attention._blocks)
                fix.enter_context(packed_blocks(hf))
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

