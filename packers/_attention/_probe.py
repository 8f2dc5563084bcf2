"""The guard's behavioural probe: the model runs short packed rows and each of their sequences alone, and the
logits must agree within the dtype's noise.

The rows: two sequences of 5 and 7 tokens (:data:`PROBE_LENGTHS`), and for each length the config makes special
(a sliding window, an attention chunk, a rope's original length) a row crossing it. The probe copies the real
batch's boundary keys (its layout), runs under ``no_grad`` with dropout at 0 and leaves no trace (RNG, buffers,
attributes). A leak under a mask backend is probed again with position_ids passed to the model's mask functions
(:data:`packers._attention._fixes.MASK_FIX`); the result is a :class:`Verdict`.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from packers._attention._fixes import MASK_FIX
from packers._attention._model import dropout_settings, input_device, special_token_ids, uses_mrope
from packers._examples import text_positions
from packers._attention._varlen import CU_KEYS, VARLEN, VARLEN_NAME
from packers.errors import PackstreamError

PROBE_LENGTHS = (5, 7)
"""Lengths of the short probe's two sequences: one forward of 12 packed tokens and two of 5 and 7 alone.
Each length the config makes special adds a probe of two sequences crossing it (:func:`probes`)."""

_LAYOUT_KEYS = ("position_ids", *CU_KEYS, "seq_idx")
# Max |packed - alone| / max |alone| allowed on the probe's logits, by compute dtype. Leaks in the tiny
# models of bench/compat_matrix.py move the logits by 1e-2 to 1 of their scale; packed vs alone without a
# leak differs by ~1e-6 of it in fp32 on CPU. Half precision: bench/gpu_check.py measures bf16's own error
# at ~1e-2 (of logits of ~1).
_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
_TF32_TOLERANCE = 2e-3  # fp32 matmuls in TF32 (10-bit mantissa), torch.backends.cuda.matmul.allow_tf32


@dataclass(frozen=True)
class Verdict:
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
    reach: int = 0
    """The longest packed row probed (tokens): batches up to this long are covered by this verdict."""


def layout(batch: Mapping[str, Any]) -> tuple | None:
    """Which boundary keys the batch carries (and its use_cache): the probe copies them. None: nothing to probe."""
    keys = tuple(k for k in _LAYOUT_KEYS if batch.get(k) is not None)
    if "position_ids" not in keys and "cu_seq_lens_q" not in keys:
        return None
    return keys, batch.get("use_cache")


# -- which rows: the lengths the config makes special ------------------------------------------------------------

# Config keys whose integer values are lengths where attention changes: sliding windows (sliding_window,
# attention_window_size, window_size, local_attention_window_len, keep_window_size, ...), attention chunks
# (attention_chunk_size, chunk_size of Mamba's chunked scan, local_attn_chunk_length), blocks (block_size) and
# the rope's original length (original_max_position_embeddings, also inside rope_parameters, per layer type).
# Found by listing every causal LM config of transformers 5.24.
_SPECIAL_KEY = re.compile(r"window|chunk_size|chunk_length|block_size|original_max_position|^local_attention$")
_NOT_A_LENGTH = re.compile(r"layers|pattern|feed_forward|lm_head|^num_|ratio|multiple|^use_|_dim$")
_MAX_POSITIONS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length", "n_ctx")


def special_lengths(hf: torch.nn.Module, below: int | None) -> dict[int, str]:
    """Length -> the config key that makes it special, for the text config's windows, chunks, blocks and rope
    original lengths that a sequence the model accepts can cross (length + 2 <= its max positions) and that stay
    under ``below`` (a batch-dependent rope's limit: its probes must not cross it, see :func:`batch_rope`)."""
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
    cap = max_positions(hf)
    return {n: k for n, k in sorted(found.items())
            if (cap is None or n + 2 <= cap) and (below is None or n + 2 < below) and n + 2 > max(PROBE_LENGTHS)}


def max_positions(hf: torch.nn.Module) -> int | None:
    """The longest sequence the model's config accepts (None: it names no limit)."""
    cfg = hf.config.get_text_config(decoder=True)
    return next((getattr(cfg, k) for k in _MAX_POSITIONS if isinstance(getattr(cfg, k, None), int)), None)


def reach_for(hf: torch.nn.Module, tokens: int) -> int:
    """How long a row the probe runs for batches of ``tokens``: the next power of two (so a run whose batches grow
    is probed again at most log2(budget) times), at least the short probe's row, at most the model's positions."""
    reach = max(sum(PROBE_LENGTHS), 1 << max(0, int(tokens) - 1).bit_length())
    cap = max_positions(hf)
    return min(reach, cap) if cap else reach


def long_row(reach: int, rope: tuple[int, str] | None) -> tuple[int, ...]:
    """A row of ``reach`` tokens whose last sequence (7 tokens) starts late, at ``reach - 7``: what a loader feeds
    when the budget is ``reach`` -- a backend that changes path above some length, or a bias built from positions
    counted over the row (ALiBi from the row's positions, in low precision) shows there and nowhere shorter.
    Each sequence stays under a batch-dependent rope's limit (as every packed batch's must)."""
    last = PROBE_LENGTHS[1]
    most = (rope[0] - 2) if rope is not None else reach
    head, out = reach - last, []
    while head > 0:
        out.append(min(head, max(most, 1)))
        head -= out[-1]
    return (*out, last)


def probes(hf: torch.nn.Module, rope: tuple[int, str] | None, reach: int = 0) -> list[tuple[tuple[int, ...], str]]:
    """The probe's packed rows: (5, 7), and for each special length N a short sequence then one of N + 2 tokens,
    so that one sequence crosses N inside itself (a window or chunk bites, a rope switches), the row crosses N
    (a backend that changes path above N tokens), and the second sequence straddles position N of the row (chunks
    or windows counted over the row instead of each sequence). Then, when ``reach`` is longer than those, one row of
    ``reach`` tokens with a sequence starting late (:func:`long_row`): the lengths the loader will really feed."""
    out: list[tuple[tuple[int, ...], str]] = [(PROBE_LENGTHS, "")]
    for n, key in special_lengths(hf, None if rope is None else rope[0]).items():
        out.append(((PROBE_LENGTHS[0], n + 2), f", crossing {key}={n}"))
    if reach > max(sum(lengths) for lengths, _ in out):
        row = long_row(reach, rope)
        out.append((row, f", a row of {reach} tokens whose last sequence starts at {reach - row[-1]}"))
    return out


def batch_rope(hf: torch.nn.Module) -> tuple[int, str] | None:
    """(limit, rope type) when a rotary embedding recomputes its frequencies from the batch, else None.

    transformers' ``dynamic_rope_update`` (modeling_rope_utils.py, 5.24) wraps the rotary embeddings' forward:
    a rope type containing "dynamic" rescales its frequencies once ``max(position_ids) + 1`` exceeds the original
    length, and "longrope" switches from its short to its long factors there. In a packed batch that maximum
    is the longest example's, so every example beside a long one gets the long one's frequencies: packed differs
    from alone (2e-3 to 1e-2 of the logits). With every sequence below the limit, nothing switches.
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


# -- one probe row ---------------------------------------------------------------------------------------------


def _probe_ids(hf: torch.nn.Module, lengths: tuple[int, ...] = PROBE_LENGTHS) -> list[list[int]]:
    """Fixed token sequences of ``lengths`` inside the vocabulary, avoiding the config's special and media token ids."""
    try:
        vocab = int(hf.get_input_embeddings().num_embeddings)
    except (AttributeError, NotImplementedError):
        vocab = int(hf.config.get_text_config().vocab_size)
    special = special_token_ids(hf.config)
    pool = [t for t in range(3, vocab) if t not in special] or list(range(vocab))
    # A stride coprime to most vocab sizes spreads the ids; the two sequences share no token.
    picks = [pool[(17 * i + 5) % len(pool)] for i in range(sum(lengths))]
    bounds = [0, *itertools.accumulate(lengths)]
    return [picks[a:b] for a, b in zip(bounds, bounds[1:])]


def _probe_batch(ids: list[list[int]], layout: tuple, mrope: bool = False) -> dict[str, Any]:
    """The probe's packed batch, built by packers.Collator and cut to the keys the real batch has. ``mrope``: for a
    model with 3-D rotary positions, collated as its batches must be (``Collator(vision=...)``: ``[4, 1, T]``
    position_ids; the probe's text-only rows make rows 1..3 equal to row 0)."""
    from packers._collate import Collator
    from packers._vision import VisionSpec

    offsets = [0, *itertools.accumulate(len(x) for x in ids)]
    row = {"input_ids": [t for x in ids for t in x], "loss_mask": [1] * offsets[-1], "seq_offsets": offsets}
    collator = Collator(vision=VisionSpec.builtin("qwen2-vl"), decode_images=False) if mrope else Collator()
    full = collator([row])
    keys, use_cache = layout
    batch = {"input_ids": full["input_ids"], **{k: full[k] for k in keys}}
    if use_cache is not None:
        batch["use_cache"] = use_cache
    return batch


@contextlib.contextmanager
def _quiet(hf: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Run the probe deterministically, leaving no trace: no_grad, dropout and router noise at 0, RNG forked,
    buffers (running stats, dynamic RoPE frequencies) restored. Train mode's other behaviour stays.

    Dropout draws different masks for a packed row than for each sequence alone, so the probe would see a
    difference that is not a leak (:func:`packers._attention._model.dropout_settings` finds its probabilities).
    """
    saved = dropout_settings(hf)
    # Buffers by module and name (a dynamic rope re-registers inv_freq: a new tensor under the old name), their
    # values (running statistics change in place), and each module's plain attributes (the rope's
    # max_seq_len_cached and attention_scaling, longrope's cached long_inv_freq).
    buffers = [(m, name, b, b.detach().clone()) for m in hf.modules() for name, b in m._buffers.items() if b is not None]
    attributes = [(m, dict(vars(m))) for m in hf.modules()]
    devices = [device] if device.type == "cuda" else []
    try:
        for obj, k, _ in saved:
            setattr(obj, k, 0.0)
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            yield
    finally:
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


def _compute_dtype(device: torch.device, seen: list[torch.dtype]) -> torch.dtype:
    """The least precise of: the input embeddings' output, the logits (``seen``), the autocast dtype (if on)."""
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


def _not_dispatched(hf: torch.nn.Module, impl: str) -> str:
    return (f"attn_implementation={impl!r} is set but was never called: {type(hf).__name__} computes attention with "
            "classes of its own instead of transformers' AttentionInterface, so it cannot use this backend")


def _compare(packed: torch.Tensor, alone: list[torch.Tensor], tol: float) -> tuple[float, float, str | None]:
    """(max relative logit diff, tolerance, error or None) of the packed row's logits against the sequences alone."""
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


def run_probe(
    hf: torch.nn.Module, target: torch.nn.Module, layout: tuple, fix: bool, lengths: tuple[int, ...] = PROBE_LENGTHS
) -> tuple[float, float, str | None]:
    """Run one probe row of ``lengths``: (max relative logit diff, tolerance, error or None). Never raises for the
    model's faults."""
    device = input_device(hf)
    ids = _probe_ids(hf, lengths)
    batch = {k: (v.to(device) if torch.is_tensor(v) else v)
             for k, v in _probe_batch(ids, layout, uses_mrope(hf)).items()}
    seen: list[torch.dtype] = []
    handle = None
    try:
        emb = hf.get_input_embeddings()
        handle = emb.register_forward_hook(lambda m, a, out: seen.append(out.dtype) if torch.is_tensor(out) else None)
    except (AttributeError, NotImplementedError):
        pass
    impl = hf.config._attn_implementation
    calls = VARLEN.calls
    fixed = MASK_FIX.packed_positions(hf, text_positions(batch)) if fix else contextlib.nullcontext()
    try:
        with _quiet(hf, device):
            with fixed:
                packed = _logits(target(**batch))[0]
            alone = [_logits(target(input_ids=torch.tensor([x], device=device)))[0] for x in ids]
    except Exception as e:  # the model cannot run a packed batch at all: refuse, naming why
        if impl in VARLEN.names and VARLEN.calls == calls:
            return float("nan"), 0.0, _not_dispatched(hf, impl)
        if isinstance(e, PackstreamError):
            return float("nan"), 0.0, str(e)
        return float("nan"), 0.0, f"the probe's packed forward raised {type(e).__name__}: {str(e)[:300]}"
    finally:
        if handle is not None:
            handle.remove()
    if impl in VARLEN.names and VARLEN.calls == calls:
        return float("nan"), 0.0, _not_dispatched(hf, impl)
    seen.append(packed.dtype)
    return _compare(packed, alone, _tolerance(_compute_dtype(device, seen), device))


# -- the verdict -------------------------------------------------------------------------------------------------


def agree(ok: bool, device: torch.device) -> bool:
    """Under torch.distributed, ok only if every rank's probe is ok (all_reduce MIN), so no rank trains alone."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=_collective_device(device))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _collective_device(device: torch.device) -> torch.device:
    """Where a collective's tensor lives: the CPU for gloo and MPI, this rank's GPU for NCCL."""
    import torch.distributed as dist

    backend = str(dist.get_backend())
    if "gloo" in backend or backend == "mpi":
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device


def agree_max(value: int, device: torch.device) -> int:
    """Under torch.distributed, the largest ``value`` over the ranks (all_reduce MAX); else ``value``."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([int(value)], dtype=torch.int64, device=_collective_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _run_probes(
    hf: torch.nn.Module, target: torch.nn.Module, layout: tuple, fix: bool, rows: list[tuple[tuple[int, ...], str]]
) -> tuple[float, float, str | None, str]:
    """Every probe row in turn: (worst diff, tolerance, error, which row) of the first that fails, else of all.

    Every row runs even after one failed, so that every rank of a sharded model (FSDP: each forward is collective)
    runs the same forwards whatever its own rows find; the ranks agree on the verdict afterwards."""
    worst, tol, what, failed = 0.0, 0.0, "", None
    for lengths, crossing in rows:
        diff, tol, error = run_probe(hf, target, layout, fix, lengths)
        here = (f"{len(lengths)} sequences of {' and '.join(map(str, lengths))} tokens{crossing}" if len(lengths) <= 4
                else f"{len(lengths)} sequences{crossing}")
        if failed is None and (error is not None or not diff <= tol):
            failed = (diff, tol, error, here)
        elif failed is None:
            worst, what = max(worst, diff), here
    return failed if failed is not None else (worst, tol, None, what)


def probe(hf: torch.nn.Module, target: torch.nn.Module, layout: tuple, reach: int = 0) -> Verdict:
    """Probe as is; if that leaks under a mask backend, probe with position_ids supplied to the mask functions.
    ``reach``: the longest row to probe (:func:`reach_for` of the batches' length or the folder's budget).

    Under torch.distributed every rank runs the same forwards and the verdict is agreed after each probe.
    """
    t0 = time.perf_counter()
    device = input_device(hf)
    rope = batch_rope(hf)
    rows = probes(hf, rope, reach)
    reach = max(sum(lengths) for lengths, _ in rows)
    shapes = tuple(lengths for lengths, _ in rows)
    diff, tol, error, what = _run_probes(hf, target, layout, False, rows)
    if agree(error is None and diff <= tol, device):
        return Verdict(None, False, diff, time.perf_counter() - t0, shapes, rope, reach)
    impl = hf.config._attn_implementation
    fix_note = ""
    # The fix is for models that build their masks without position_ids (GptOss, OPT, Bloom, MPT, ... in
    # transformers 5.24): masking_utils then cannot see the packed layout. Passing it gives ~2e-7.
    fixable = error is None and "position_ids" in layout[0] and impl not in VARLEN.names and "flash" not in impl
    if fixable and agree(bool(MASK_FIX.patches(hf)), device):
        fix_diff, _, fix_error, fix_what = _run_probes(hf, target, layout, True, rows)
        if agree(fix_error is None and fix_diff <= tol, device):
            return Verdict(None, True, fix_diff, time.perf_counter() - t0, shapes, rope, reach)
        fix_note = (f", and still by {fix_diff:.2g} ({fix_what}) with position_ids passed to its mask functions"
                    if fix_error is None else f"; with position_ids passed to its mask functions it raised: {fix_error}")
    return Verdict(_refusal(hf, diff, tol, error, what, fix_note), False, diff, time.perf_counter() - t0, shapes, rope,
                   reach)


def uses_alibi(hf: torch.nn.Module) -> bool:
    """Does the model add an ALiBi bias (Falcon with ``alibi``, MPT's ``attn_config.alibi``, Bloom, ...)?"""
    cfg = hf.config.get_text_config(decoder=True)
    attn = getattr(cfg, "attn_config", None)
    return bool(getattr(cfg, "alibi", False) is True or getattr(cfg, "position_embedding_type", None) == "alibi"
                or getattr(attn, "alibi", False) is True or getattr(cfg, "model_type", "") == "bloom")


def _refusal(hf: torch.nn.Module, diff: float, tol: float, error: str | None, what: str, fix_note: str) -> str:
    """The refusal of a failed probe: the model, the backend and mode, the cause (``what``: the failing row;
    ``fix_note``: what the mask fix did), and the fix."""
    impl = hf.config._attn_implementation
    mode = "train" if hf.training else "eval"
    if error is None and diff <= tol:
        cause = "another rank's packing probe failed (see that rank's error)"
    elif error is None:
        cause = (f"the packing probe ({what}, packed vs alone) differs by {diff:.2g} > {tol:.0e} "
                 f"(max logit diff / max logit){fix_note}")
        if uses_alibi(hf):
            cause += ("; its ALiBi bias is built from positions counted over the whole packed row (not position_ids), "
                      "so an example that starts late in a row gets another bias, in reduced precision, than alone")
    else:
        cause = error.rstrip(". ")
    others = " or ".join(repr(b) for b in ("flash_attention_2", VARLEN_NAME, "sdpa") if b != impl)
    result = "lets packed examples interact" if error is None else "cannot run the packing probe"
    return (
        f"{type(hf).__name__} {result} under attn_implementation={impl!r} ({mode} mode): {cause}. Use another "
        f"attn_implementation (e.g. {others}; each is probed the same way), or do not pack for this model: "
        "collate padded batches with an attention_mask"
    )
