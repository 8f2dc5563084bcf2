"""Compatibility matrix: every causal LM in the installed transformers, packed vs each example alone.

    python bench/compat_matrix.py [--only gpt_oss,opt] [--jobs 2] [--json matrix.json] [--md docs/compatibility.md]

For each entry of transformers' auto mapping for causal LMs (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``)
the script builds a tiny random fp32 model from the config class (hidden 32, 2 layers, 4 heads of 8,
vocab 128, 4 experts, sliding windows and attention chunks of 8 tokens; nothing from the Hub) and
runs it under every backend the model class accepts on CPU (``eager``, ``sdpa``, ``flex_attention``),
in ``train()`` mode with its default config and in ``eval()`` mode, as a user would:
``install_packing_guard(model)`` then ``model(**Collator()(rows))``. Each cell is one of

* **exact**: the guard let the batch through, and the packed logits, per-token loss and gradients
  equal those of each example run alone (max abs diff <= 1e-5; gradients relative to the largest
  one where that exceeds 1, as Gemma 4's reach 18 and fp32 rounding alone then gives ~1e-5; flex
  has no CPU backward, so its gradients are not compared). "exact, mask fix" when the guard had to
  pass position_ids to the model's mask functions;
* **refused**: the guard raised PackstreamError (its message; and what the unguarded batch does). A cell
  the guard refuses by a rule of the backend alone, whatever the model (``flex_attention`` on CPU:
  ``packers._attention._rules.backend_refusal``), is recorded as refused with the guard's reason
  without building, compiling or running anything;
* **cannot build**: the tiny model could not be built or run alone (why);
* **LEAK**: the guard let the batch through and packed differs from alone. There must be none.

The ground truth does not ask the guard: it runs the packed batch and each example alone and
compares them. Dropout would make packed and alone differ by chance, so after the guard's decision
(taken with the default config) dropout probabilities are set to 0 for the comparison.

The table goes to ``--md`` (docs/compatibility.md), the raw cells to ``--json``; ``--resume`` skips
(architecture, backend) tasks already in the JSON file. ``--jobs N`` runs N worker processes; a worker
that crashes or hangs costs its task only (recorded as an error) and is replaced. Exit status 1 if any
cell is a LEAK.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOL = 1e-5
VOCAB = 128
WINDOW = 8  # sliding windows and attention chunks: shorter than the longer examples, so windows are exercised
BACKENDS = ("eager", "sdpa", "flex_attention")
MODES = ("train", "eval")
TASK_TIMEOUT_S = 300
# Examples (lengths) in two rows; the 1-token example has no target; 13 and 11 tokens exceed the window of 8.
LENGTHS = [[9, 1, 13], [6, 11]]

# Generic shrinking: attribute name -> tiny value, applied where the default config has the attribute.
TINY = {
    "vocab_size": VOCAB,
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "n_embed", "embed_dim", "model_dim", "word_embed_proj_dim",
                     "embedding_size", "hidden_dim"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads",
                     "encoder_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                     "num_key_value_groups"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "v_head_dim", "qk_nope_head_dim", "qk_head_dim", "attention_head_dim"), 8),
    "qk_rope_head_dim": 8,
    "rotary_dim": 8,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "decoder_ffn_dim", "ffn_hidden_size", "d_ff",
                     "encoder_ffn_dim"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                     "moe_ffn_hidden_size", "dense_intermediate_size"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "moe_k", "num_selected_experts"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length",
                     "max_sequence_length"), 128),
    **dict.fromkeys(("sliding_window", "attention_chunk_size", "window_size", "sliding_window_size"), WINDOW),
    # Mamba / linear-attention mixers
    **dict.fromkeys(("state_size", "mamba_d_state", "ssm_state_size", "d_state"), 8),
    **dict.fromkeys(("mamba_n_heads", "linear_num_value_heads", "linear_num_key_heads"), 4),
    **dict.fromkeys(("mamba_head_dim", "mamba_headdim"), 16),  # n_heads x head_dim = expand (2) x hidden
    **dict.fromkeys(("linear_key_head_dim", "linear_value_head_dim", "indexer_head_dim"), 8),
    **dict.fromkeys(("indexer_n_heads", "indexer_kv_heads", "n_mamba_heads"), 2),
    **dict.fromkeys(("mamba_n_groups", "n_groups"), 1),
    "time_step_rank": 4,
    "mamba_d_ssm": 32,
    "mamba_d_head": 16,
    "attn_layer_period": 2,
    "attn_layer_offset": 1,
    "expert_layer_period": 2,
    "expert_layer_offset": 1,
}
# Attributes set even where the default is None (some default configs do not build without them).
NONE_OK = {"head_dim", "num_key_value_heads"}
# Per-architecture settings where the generic ones do not build (found by running this script).
OVERRIDES: dict[str, dict[str, Any]] = {
    "reformer": {"is_decoder": True},
    "zaya": {"num_experts_per_tok": 1},
    "mamba2": {"num_heads": 4, "head_dim": 16},
    "bamba": {"attn_layer_indices": [1]},
    "recurrent_gemma": {"num_hidden_layers": 3, "block_types": ["recurrent", "recurrent", "attention"]},
    "zamba2": {"hybrid_layer_ids": [1]},
}


def _log_quiet() -> None:
    import warnings

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")


def model_classes() -> dict[str, str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()))


def _shrink_kwargs(default, model_type: str) -> dict[str, Any]:
    """Constructor keyword arguments that make ``default`` (a config instance) tiny."""
    values = dict(vars(default))
    try:
        values.update((k, v) for k, v in default.to_dict().items() if k not in (getattr(default, "sub_configs", {}) or {}))
    except Exception:  # a config that cannot serialise its defaults: vars() alone
        pass
    kw: dict[str, Any] = {}
    for k, v in TINY.items():
        if k in values:
            old = values[k]
            if old is None and k not in NONE_OK or isinstance(old, bool) or not isinstance(old, (int, float, type(None))):
                continue
            kw[k] = v
    if "kv_lora_rank" in values and "num_key_value_heads" in kw:  # multi-head latent attention: one kv head per head
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    # special token ids must fit the tiny vocabulary
    for k, v in values.items():
        if k.endswith("token_id") and isinstance(v, int) and not isinstance(v, bool) and v >= VOCAB:
            kw[k] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(k, VOCAB - 1)
        elif k.endswith("token_id") and isinstance(v, list):
            kw[k] = [x if x < VOCAB else 2 for x in v]
    n_layers = next((values[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers") if k in values), None)
    types = values.get("layer_types")
    if isinstance(types, (list, tuple)) and types:
        distinct = list(dict.fromkeys(types))
        new = distinct if len(distinct) >= 2 else distinct * 2
        kw["layer_types"] = new
        for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
            if k in values:
                kw[k] = len(new)
    # other per-layer lists: cut to the new depth
    if isinstance(n_layers, int):
        depth = len(kw.get("layer_types", [])) or 2
        for k, v in values.items():
            if k != "layer_types" and isinstance(v, list) and len(v) == n_layers and n_layers > depth:
                kw[k] = v[:depth]
        # per-layer settings keyed by layer index (dots3_note, gemma4 ``per_layer_config``)
        for k, v in values.items():
            if isinstance(v, dict) and v and all(isinstance(i, int) or (isinstance(i, str) and i.isdigit()) for i in v):
                kw[k] = {i: x for i, x in v.items() if int(i) < depth}
    return kw


def tiny_config(model_type: str):
    """A tiny random config of ``model_type`` (sub-configs shrunk too), or raise."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    kw = _shrink_kwargs(default, model_type)
    for key in getattr(default, "sub_configs", {}) or {}:
        sub = getattr(default, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            sub_kw = _shrink_kwargs(sub, getattr(sub, "model_type", key))
            merged = {**sub.to_dict(), **sub_kw}
            depth = len(sub_kw.get("layer_types", [])) or 2
            for k, v in list(merged.items()):  # per-layer settings keyed by layer index
                if isinstance(v, dict) and v and all(isinstance(i, int) or (isinstance(i, str) and i.isdigit()) for i in v):
                    merged[k] = {i: x for i, x in v.items() if int(i) < depth}
            kw[key] = merged
    kw.update(OVERRIDES.get(model_type, {}))
    return cls(**kw)


def examples(config) -> list[list[int]]:
    """Fixed token ids inside the tiny vocabulary, avoiding special and media token ids."""
    import numpy as np

    from packers._attention._model import special_token_ids

    special = special_token_ids(config)
    vocab = min(VOCAB, getattr(config.get_text_config(), "vocab_size", VOCAB) or VOCAB)
    pool = np.array([t for t in range(3, vocab) if t not in special])
    rng = np.random.default_rng(7)
    return [rng.choice(pool, n).tolist() for row in LENGTHS for n in row]


def rows_of(exs: list[list[int]]) -> list[dict]:
    rows, i = [], 0
    for lens in LENGTHS:
        ids, offs = [], [0]
        for _ in lens:
            ids += exs[i]
            offs.append(len(ids))
            i += 1
        rows.append({"input_ids": ids, "loss_mask": [1] * len(ids), "seq_offsets": offs})
    return rows


def build(model_type: str, class_name: str, config, backend: str):
    import torch
    import transformers

    cls = getattr(transformers, class_name)
    if not isinstance(config, cls.config_class):  # a text-only causal LM listed under its multimodal config
        config = config.get_text_config(decoder=True)
    torch.manual_seed(0)
    model = cls._from_config(config, attn_implementation=backend)
    return model.float()


def zero_dropout(model) -> None:
    """Dropout off for the ground truth: what the guard's probe turns off (nn.Dropout modules, float attributes
    copied from the config, the configs)."""
    from packers._attention._model import dropout_settings

    for obj, k, _ in dropout_settings(model):
        setattr(obj, k, 0.0)


def _per_token(logits, labels):
    import torch.nn.functional as F

    return F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100, reduction="none")


def ground_truth(model, batch, exs: list[list[int]], with_grad: bool) -> dict[str, float]:
    """Max abs diffs of logits, per-token loss and gradients: packed batch vs each example alone."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    ctx = torch.enable_grad() if with_grad else torch.no_grad()
    with ctx:
        model.zero_grad(set_to_none=True)
        logits = model(**batch).logits[0]
        tok = _per_token(logits, batch["labels"][0])
        grads = None
        if with_grad:
            tok.sum().backward()
            grads = [None if p.grad is None else p.grad.clone() for p in params]
            model.zero_grad(set_to_none=True)
        cu = batch["cu_seq_lens_q"].tolist()
        d_logits = d_loss = 0.0
        for i, x in enumerate(exs):
            a, b = cu[i], cu[i + 1]
            alone = model(input_ids=torch.tensor([x])).logits[0]
            labels = torch.tensor(x)
            labels[0] = -100
            atok = _per_token(alone, labels)
            if with_grad:
                atok.sum().backward()
            d_logits = max(d_logits, (alone - logits[a:b]).abs().max().item())
            if b - a > 1:
                d_loss = max(d_loss, (atok - tok[a : b - 1]).abs().max().item())
        d_grad = g_max = float("nan")
        if with_grad:
            d_grad = g_max = 0.0
            for p, g in zip(params, grads):
                h = p.grad
                if g is None and h is None:
                    continue
                g = torch.zeros_like(p) if g is None else g
                h = torch.zeros_like(p) if h is None else h
                d_grad = max(d_grad, (g - h).abs().max().item())
                g_max = max(g_max, h.abs().max().item())
            model.zero_grad(set_to_none=True)
    # Gradients relative to the largest one where that exceeds 1: fp32 rounding scales with it.
    return {"logits": d_logits, "loss": d_loss, "grad": d_grad / max(1.0, g_max) if with_grad else d_grad,
            "grad_abs": d_grad, "grad_max": g_max}


def _bad(d: dict[str, float]) -> bool:
    return any(not (d[k] <= TOL) for k in ("logits", "loss", "grad") if not (k == "grad" and math.isnan(d[k])))


def run_cell(model_type: str, class_name: str, config, backend: str, mode: str, exs) -> dict[str, Any]:
    import torch

    from packers import (
        Collator,
        PackstreamError,
        check_packing_safe,
        install_packing_guard,
    )

    from packers._attention import cached_verdict
    from packers._attention._rules import backend_refusal

    cell: dict[str, Any] = {"arch": model_type, "class": class_name, "backend": backend, "mode": mode}
    why = backend_refusal(backend, "cpu")
    if why is not None:  # refused whatever the model: nothing to build, compile or run
        cell.update(status="refused", why=why, static=True)
        return cell
    try:
        model = build(model_type, class_name, config, backend)
    except Exception as e:
        cell.update(status="cannot build", why=f"{type(e).__name__}: {str(e)[:200]}")
        return cell
    getattr(model, mode)()
    batch = Collator()(rows_of(exs))
    # flex_attention has no backward on CPU (torch: "FlexAttention does not support backward on CPU")
    with_grad = backend != "flex_attention"
    handle = install_packing_guard(model)
    t0 = time.perf_counter()
    try:
        with torch.set_grad_enabled(with_grad):
            check_packing_safe(model, batch)  # the probe runs here (and is cached for the forward below)
        cell["probe_s"] = time.perf_counter() - t0
        verdict = cached_verdict(model, batch)
        cell["fix"] = verdict.fix
    except PackstreamError as e:
        cell["probe_s"] = time.perf_counter() - t0
        cell.update(status="refused", why=str(e))
        handle.remove()
        zero_dropout(model)
        try:
            cell["unguarded"] = ground_truth(model, batch, exs, with_grad=False)
        except Exception as e2:
            cell["unguarded_error"] = f"{type(e2).__name__}: {str(e2)[:150]}"
        return cell
    zero_dropout(model)
    try:
        d = ground_truth(model, batch, exs, with_grad)
    except PackstreamError as e:  # refused at the forward (a rule the check above did not see)
        cell.update(status="refused", why=str(e))
        return cell
    except Exception as e:
        cell.update(status="error", why=f"{type(e).__name__}: {str(e)[:300]}")
        return cell
    finally:
        handle.remove()
    cell.update(d)
    cell["status"] = "LEAK" if _bad(d) else "exact"
    return cell


def _alarm(signum, frame):
    raise TimeoutError(f"task took more than {TASK_TIMEOUT_S} s")


def run_task(model_type: str, class_name: str, backend: str, static: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The train and eval cells of one architecture under ``backend``, and under each backend of ``static`` (refused
    by a rule of the backend alone: recorded without building it, once the architecture builds); never raises.

    The eager task also reports an architecture that cannot be built (the others then report nothing).
    """
    _log_quiet()
    import torch
    import transformers

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TASK_TIMEOUT_S)
    cells: list[dict[str, Any]] = []
    try:
        try:
            config = tiny_config(model_type)
            cls = getattr(transformers, class_name)
            exs = examples(config)
            # The examples alone must run on a plain eager model, else there is nothing to compare with.
            model = build(model_type, class_name, config, "eager")
            with torch.no_grad():
                model.eval()(input_ids=torch.tensor([exs[0]]))
            del model
        except Exception as e:
            if backend != "eager":
                return []
            return [{"arch": model_type, "class": class_name, "status": "cannot build",
                     "why": f"{type(e).__name__}: {str(e)[:200]}"}]
        supports = {"eager": True, "sdpa": getattr(cls, "_supports_sdpa", False),
                    "flex_attention": getattr(cls, "_supports_flex_attn", False)}
        for b in (*static, backend):
            if supports.get(b, False):
                cells += [run_cell(model_type, class_name, config, b, mode, exs) for mode in MODES]
    except TimeoutError as e:
        cells = [c for c in cells if c["backend"] != backend] + [
            {"arch": model_type, "class": class_name, "backend": backend, "mode": m, "status": "error",
             "why": f"timeout: {e}"} for m in MODES]
    except Exception as e:  # a bug in this script: report it as such
        cells = [c for c in cells if c["backend"] != backend] + [
            {"arch": model_type, "class": class_name, "backend": backend, "mode": m, "status": "error",
             "why": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-500:]}"} for m in MODES]
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    for c in cells:
        c["task_s"] = time.perf_counter() - t0
    return cells


def tasks(model_type: str, class_name: str, backends) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """``run_task`` arguments covering ``backends``: one task per backend the guard judges by running the model;
    the backends it refuses by a rule of their own (``flex_attention`` on CPU) ride on the first task."""
    from packers._attention._rules import backend_refusal

    run = [b for b in backends if backend_refusal(b, "cpu") is None]
    static = tuple(b for b in backends if b not in run)
    if not run:
        return [(model_type, class_name, static[0], static[1:])] if static else []
    return [(model_type, class_name, run[0], static)] + [(model_type, class_name, b, ()) for b in run[1:]]


def run_arch(model_type: str, class_name: str, backends=BACKENDS) -> list[dict[str, Any]]:
    """All cells of one architecture, in this process."""
    return [c for task in tasks(model_type, class_name, backends) for c in run_task(*task)]


def _worker(conn) -> None:
    import torch

    torch.set_num_threads(1)
    while True:
        task = conn.recv()
        if task is None:
            return
        conn.send(run_task(*task))


def run(archs: dict[str, str], jobs: int, done: list[dict], json_path: Path | None, backends=BACKENDS) -> list[dict]:
    """Every (architecture, backend) task in ``jobs`` worker processes.

    A worker that dies (a crash in native code) or hangs costs only its task, recorded as an error, and is
    replaced.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    # Workers import this module by name (spawn): make it importable as what it is called here.
    if str(Path(__file__).resolve().parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
    cells = list(done)
    finished = {(c["arch"], c.get("backend")) for c in done} | {(c["arch"], b) for c in done if "backend" not in c
                                                                  for b in backends}
    queue = [task for t, c in archs.items() for task in tasks(t, c, [b for b in backends if (t, b) not in finished])]
    ctx = mp.get_context("spawn")
    workers: dict[Any, list] = {}  # connection -> [process, task, started]

    def start() -> None:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child,), daemon=True)
        proc.start()
        workers[parent] = [proc, None, 0.0]

    def feed(conn) -> None:
        if queue:
            task = queue.pop(0)
            conn.send(task)
            workers[conn][1:] = [task, time.monotonic()]
        else:
            conn.send(None)
            workers.pop(conn)[0].join(5)

    for _ in range(max(1, min(jobs, len(queue)))):
        start()
    for conn in list(workers):
        feed(conn)
    while workers:
        ready = wait(list(workers) + [w[0].sentinel for w in workers.values()], timeout=10)
        for conn, (proc, task, started) in list(workers.items()):
            if conn in ready:
                try:
                    cells += _report(conn.recv(), json_path)
                    feed(conn)
                    continue
                except (EOFError, OSError):
                    pass  # died while sending: handled below
            hung = task is not None and time.monotonic() - started > 2 * TASK_TIMEOUT_S
            if proc.sentinel in ready or not proc.is_alive() or hung:
                if hung:
                    proc.kill()
                proc.join(5)
                workers.pop(conn)
                why = "hung (killed)" if hung else f"the worker process crashed (exit code {proc.exitcode})"
                t, c, b, static = task
                cells += _report([{"arch": t, "class": c, "backend": x, "mode": m, "status": "error",
                                   "why": f"{why} in native code while running this cell"}
                                  for x in (*static, b) for m in MODES], json_path)
                if queue:
                    start()
                    feed(next(reversed(workers)))
    return cells


def _report(cells: list[dict], json_path: Path | None) -> list[dict]:
    for c in cells:
        detail = c.get("why", "")[:90] if c["status"] != "exact" else f"logits {c['logits']:.1e}"
        print(f"{c['arch']:28s} {c.get('backend', '-'):15s} {c.get('mode', '-'):5s} {c['status']:12s} {detail}", flush=True)
    if json_path is not None:
        with json_path.open("a") as f:
            for c in cells:
                f.write(json.dumps(c) + "\n")
    return cells


# -- the markdown table -------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.0e}"


def _cell_text(c: dict) -> str:
    s = c["status"]
    if s == "exact":
        fix = ", mask fix" if c.get("fix") else ""
        return f"exact{fix} ({_fmt(c['logits'])} / {_fmt(c['loss'])} / {_fmt(c['grad'])})"
    if s == "refused" and c.get("static"):
        return "refused (static rule, not run)"
    if s == "refused":
        u = c.get("unguarded")
        if u is not None:
            why = "would leak " + _fmt(u["logits"]) if _bad(u) else "unguarded exact"
        else:
            why = "unguarded raises"
        return f"refused ({why})"
    return s


def _probe_cost(cells: list[dict]) -> str:
    import statistics

    eager = sorted(c["probe_s"] for c in cells if "probe_s" in c and c.get("backend") in ("eager", "sdpa"))
    if not eager:
        return ""
    p90 = eager[int(0.9 * (len(eager) - 1))]
    return (f"The guard's probe (first packed batch of each cell, eager/sdpa, including the fix's second probe where "
            f"needed) took {statistics.median(eager) * 1e3:.0f} ms median, {p90 * 1e3:.0f} ms at the 90th percentile "
            f"({len(eager)} cells), on these tiny models with one thread; the slowest include a process's first forward.")


def _cause(why: str) -> str:
    """A refusal's cause without the parts every refusal shares (model, backend, mode, the fix)."""
    why = why.replace("\n", " ")
    m = re.search(r"mode\): (.*?)\. Use another attn_implementation", why)
    return (m.group(1) if m else why)[:300]


def summary(cells: list[dict]) -> dict[str, Any]:
    archs = sorted({c["arch"] for c in cells})
    by_status: dict[str, int] = {}
    for c in cells:
        by_status[c["status"]] = by_status.get(c["status"], 0) + 1
    ran = {c["arch"] for c in cells if c["status"] in ("exact", "refused", "LEAK")}
    return {"architectures": len(archs), "ran": len(ran), "cells": by_status}


def markdown(cells: list[dict], seconds: float, command: str, resumed: bool = False) -> str:
    import platform

    import torch
    import transformers

    s = summary(cells)
    counts = s["cells"]
    lines = [
        "# Compatibility: packed batches on every causal LM in transformers",
        "",
        f"Generated by `{command}` (bench/compat_matrix.py) with transformers {transformers.__version__}, "
        f"torch {torch.__version__}, on {platform.machine()} CPU, fp32, in {seconds / 60:.1f} min"
        f"{' (this part of a resumed run)' if resumed else ''}. Do not edit by hand.",
        "",
        "Each architecture in transformers' auto mapping for causal LMs is built as a tiny random model (hidden 32,",
        f"2 layers, 4 heads, vocab {VOCAB}, 4 experts, windows/chunks of {WINDOW} tokens) and run under each backend it",
        "accepts on CPU, in `train()` with its default config and in `eval()`, the way a user would:",
        "`install_packing_guard(model)` then `model(**Collator()(rows))`, 5 examples of 1-13 tokens in 2 rows.",
        "",
        "* **exact** (max abs diff of logits / per-token loss / gradients, packed vs each example alone): the guard let",
        "  the batch through and it computes what the examples alone compute, <= 1e-5 (gradients: relative to the",
        "  largest gradient where that exceeds 1; Gemma 4's reach 18). *mask fix*: exact because",
        "  the guard passed `position_ids` to mask functions the model calls without them. `flex_attention` has no",
        "  CPU backward, so its gradients are n/a.",
        "* **refused**: the guard raised `PackstreamError` before the forward. In brackets, what the same batch does",
        "  without the guard: *would leak* (max logit diff) or *unguarded exact* (a refusal that was not needed);",
        "  *static rule, not run*: a rule of the backend alone refuses it whatever the model (`flex_attention` on",
        "  CPU), so the cell is counted without building or running the model.",
        "* **cannot build**: the tiny model could not be built or run from its config here (the reason is listed).",
        "* **LEAK**: the guard let a batch through that differs from the examples alone. There must be none.",
        "",
        f"**{s['architectures']} architectures, {s['ran']} run; cells: "
        + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        + f"; LEAK {counts.get('LEAK', 0)}.**",
        "",
        _probe_cost(cells),
        "",
        "| architecture | class | backend | train | eval |",
        "|---|---|---|---|---|",
    ]
    by_arch: dict[str, list[dict]] = {}
    for c in cells:
        by_arch.setdefault(c["arch"], []).append(c)
    notes = []
    for arch in sorted(by_arch):
        cs = by_arch[arch]
        cls = cs[0]["class"]
        if all(c["status"] == "cannot build" and "backend" not in c for c in cs) or any("backend" not in c for c in cs):
            why = cs[0].get("why", "").replace("|", "\\|").replace("\n", " ")[:140]
            lines.append(f"| {arch} | {cls} | - | {cs[0]['status']}: {why} | |")
            continue
        for backend in BACKENDS:
            row = {c["mode"]: c for c in cs if c.get("backend") == backend}
            if not row:
                continue
            lines.append(f"| {arch} | {cls} | {backend} | {_cell_text(row['train']) if 'train' in row else ''} | "
                         f"{_cell_text(row['eval']) if 'eval' in row else ''} |")
            for c in row.values():
                if c["status"] != "exact" and c.get("why"):
                    notes.append((arch, backend, c["mode"], c["status"], c["why"]))
    lines += ["", "## Why: refusals and errors", "",
              "The guard's own words, cut to the cause (each refusal also names the fix: another",
              "`attn_implementation`, or padded batches), once per architecture and cause.", ""]
    causes: dict[tuple[str, str, str], list[str]] = {}
    for arch, backend, mode, status, why in notes:
        causes.setdefault((arch, status, _cause(why)), [])
        if backend not in causes[(arch, status, _cause(why))]:
            causes[(arch, status, _cause(why))].append(backend)
    for (arch, status, cause), backends in causes.items():
        lines.append(f"* **{arch}** ({', '.join(backends)}; {status}): {cause}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", help="comma-separated model types (default: all causal LMs)")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--json", help="append cells here as JSON lines (with --resume, skip architectures already there)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--md", help="write the markdown table here (e.g. docs/compatibility.md)")
    args = p.parse_args(argv)
    _log_quiet()
    archs = model_classes()
    if args.only:
        wanted = args.only.split(",")
        unknown = [w for w in wanted if w not in archs]
        if unknown:
            print(f"not causal LMs in this transformers: {unknown}", file=sys.stderr)
            return 2
        archs = {k: archs[k] for k in wanted}
    json_path = Path(args.json) if args.json else None
    done: list[dict] = []
    if json_path is not None and json_path.exists():
        if args.resume:
            done = [json.loads(line) for line in json_path.read_text().splitlines() if line.strip()]
        else:
            json_path.unlink()
    t0 = time.perf_counter()
    cells = run(archs, args.jobs, done, json_path, tuple(args.backends.split(",")))
    seconds = time.perf_counter() - t0  # this run only (a resumed run did part of the work before)
    s = summary(cells)
    print(json.dumps(s), f"{seconds:.0f} s", flush=True)
    if args.md:
        command = "python bench/compat_matrix.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))
        Path(args.md).write_text(markdown(cells, seconds, command.strip(), resumed=bool(done)))
    return 1 if s["cells"].get("LEAK", 0) else 0


if __name__ == "__main__":
    sys.exit(main())
