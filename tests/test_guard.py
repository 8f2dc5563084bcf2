"""The packing guard judges models by what they compute (tiny random models, fp32, CPU).

* A model made to leak on purpose (its decoder never sees the batch's position_ids, or creates a KV
  cache inside) is refused, although its modeling code is Llama's, which builds packed masks.
* GptOss and OPT (whose transformers 5.24 code builds masks without position_ids, and leaked) are
  exact in train and eval under every backend they build with on CPU: the guard passes the
  positions to their mask functions, after the probe proves that exact.
* A fixed sample of 20 architectures (bench/compat_matrix.py) has no silent leak; the whole zoo
  runs as a slow test.
* The probe leaves no trace (RNG, dropout settings, buffers, gradients), runs once per model state,
  agrees across DDP/FSDP2 ranks, and a backend a model cannot dispatch to is a PackstreamError.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from packers import Collator, PackstreamError, check_packing_safe, install_packing_guard, register_varlen_attention
from tests._internals import GUARD, VARLEN, cached_verdict, probe_layout as layout
from tests._models import TOL, VOCAB, max_diff, tiny_model, tiny_opt
from tests._shards import make_row, random_examples

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = random_examples(4, seed=3, vocab=VOCAB, min_len=5, max_len=14)
ROWS = [make_row(EXAMPLES[:2]), make_row(EXAMPLES[2:])]


def load_matrix():
    path = ROOT / "bench" / "compat_matrix.py"
    spec = importlib.util.spec_from_file_location("compat_matrix", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["compat_matrix"] = module  # its worker processes import it by this name
    spec.loader.exec_module(module)
    return module


def llama(attn: str = "sdpa", **overrides):
    return tiny_model("llama", attn, **overrides)


def gpt_oss(attn: str = "eager"):
    return tiny_model("gpt_oss", attn)


# -- models made to leak ------------------------------------------------------------------------------


def drop_position_ids(model):
    """A leak by construction: the decoder stack never sees position_ids (so no packed mask, positions 0..T-1)."""
    def hook(module, args, kwargs):
        kwargs.pop("position_ids", None)
        return args, kwargs

    return model.model.register_forward_pre_hook(hook, with_kwargs=True)


def cache_inside(model):
    """Another: the decoder stack is told to build a KV cache, so masking_utils skips the packed mask."""
    def hook(module, args, kwargs):
        kwargs["use_cache"] = True
        return args, kwargs

    return model.model.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("leak", [drop_position_ids, cache_inside], ids=["drop_position_ids", "cache_inside"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_model_made_to_leak_is_refused(leak, attn, mode):
    model = getattr(llama(attn), mode)()
    leak(model)
    batch = Collator()(ROWS)
    assert max_diff(model, batch) > 1e-2  # it really leaks, and nothing in the batch or the config shows it
    install_packing_guard(model)
    with pytest.raises(PackstreamError, match=rf"LlamaForCausalLM lets packed examples interact under "
                                              rf"attn_implementation='{attn}' \({mode} mode\).*packing probe"):
        model(**batch)
    with pytest.raises(PackstreamError, match="packing probe"):
        check_packing_safe(model, batch)


def test_the_same_model_without_the_leak_passes():
    model = llama("sdpa").train()
    handle = install_packing_guard(model)
    batch = Collator()(ROWS)
    model(**batch).loss.backward()
    hook = drop_position_ids(model)
    model.eval()  # a new mode: probed again, and the leak is found
    with pytest.raises(PackstreamError, match="packing probe"):
        model(**batch)
    hook.remove()
    model(**batch)
    handle.remove()


# -- GptOss and OPT -----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt_oss", "opt"])
def test_gpt_oss_and_opt_exact_or_refused(arch):
    """Every backend each builds with on CPU, train (default config) and eval: exact <= 1e-5 or refused."""
    m = load_matrix()
    cells = m.run_arch(arch, m.model_classes()[arch])
    backends = {c["backend"] for c in cells}
    assert "eager" in backends and (arch == "gpt_oss" or "sdpa" in backends), cells
    for c in cells:
        assert c["status"] in ("exact", "refused"), c
        if c["status"] == "exact":
            assert c["logits"] <= TOL and c["loss"] <= TOL, c
            assert c["backend"] == "flex_attention" or c["grad"] <= TOL, c
            # exact because the guard passed position_ids to the mask functions (they leak without it)
            assert c["fix"], c
        elif c["backend"] == "flex_attention":  # torch's CPU flex kernel is wrong at some lengths: never vouched for
            assert "flex_attention' on CPU" in c["why"], c
        else:
            assert "lets packed examples interact" in c["why"] or "cannot run the packing probe" in c["why"], c


@pytest.mark.parametrize("attn", ["eager"])
def test_gpt_oss_leaks_without_the_guard_and_not_with_it(attn):
    batch = Collator()(ROWS)
    model = gpt_oss(attn).eval()
    assert max_diff(model, batch) > 1e-2  # the bug in issue 11: GptOssModel builds masks without position_ids
    with pytest.raises(PackstreamError, match="install_packing_guard"):
        check_packing_safe(model, batch)  # a plain model(**batch) would leak: check says so, and names the fix
    handle = install_packing_guard(model)
    assert max_diff(model, batch) <= TOL
    check_packing_safe(model, batch)  # with the guard on, the same batch is safe
    handle.remove()
    assert max_diff(model, batch) > 1e-2  # and the fix goes with the guard
    from transformers import masking_utils
    from transformers.models.gpt_oss import modeling_gpt_oss

    # the module's names point at transformers' own functions again: only guarded forwards saw the wrappers
    assert modeling_gpt_oss.create_causal_mask is masking_utils.create_causal_mask
    assert modeling_gpt_oss.create_sliding_window_causal_mask is masking_utils.create_sliding_window_causal_mask


def test_opt_leaks_without_the_guard_and_not_with_it():
    for attn in ("eager", "sdpa"):
        model = tiny_opt(attn, dropout=0.0).eval()
        batch = Collator()(ROWS)
        assert max_diff(model, batch) > 1e-2
        with install_packing_guard(model):
            assert max_diff(model, batch) <= TOL


# -- the matrix ---------------------------------------------------------------------------------------

SAMPLE = ["gpt_oss", "opt", "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "falcon", "gpt_neox",
          "mixtral", "bloom", "mpt", "biogpt", "xglm", "gpt2", "starcoder2", "olmo2", "bamba"]


def test_sample_matrix_has_no_silent_leak(tmp_path):
    """20 architectures, eager and sdpa, train and eval: exact or refused, never LEAK (a few seconds)."""
    m = load_matrix()
    md, out = tmp_path / "compat.md", tmp_path / "cells.json"
    assert m.main(["--only", ",".join(SAMPLE), "--backends", "eager,sdpa", "--md", str(md), "--json", str(out)]) == 0
    cells = [json.loads(line) for line in out.read_text().splitlines()]
    assert {c["arch"] for c in cells} == set(SAMPLE)
    assert all(c["status"] in ("exact", "refused") for c in cells), [c for c in cells if c["status"] not in ("exact", "refused")]
    assert sum(c["status"] == "exact" for c in cells) >= 50
    for c in cells:
        if c["status"] == "refused":  # refusals here are needed: unguarded, the batch leaks or cannot run
            u = c.get("unguarded")
            assert u is None or u["logits"] > TOL, c
    text = md.read_text()
    assert "LEAK 0" in text and "| gpt_oss | GptOssForCausalLM | eager | exact, mask fix" in text


@pytest.mark.slow
def test_full_matrix_has_no_silent_leak(tmp_path):
    """Every causal LM in the installed transformers, every CPU backend (see docs/compatibility.md for the time)."""
    m = load_matrix()
    out = tmp_path / "matrix.json"
    assert m.main(["--json", str(out), "--jobs", str(min(2, os.cpu_count() or 1))]) == 0
    cells = [json.loads(line) for line in out.read_text().splitlines()]
    assert not [c for c in cells if c["status"] == "LEAK"]
    assert len({c["arch"] for c in cells if c["status"] in ("exact", "refused")}) >= 100


# -- the probe leaves no trace and runs once ------------------------------------------------------------


def test_probe_leaves_no_trace():
    model = llama("sdpa", attention_dropout=0.3).train()
    batch = Collator()(ROWS)
    rng = torch.get_rng_state()
    buffers = [b.clone() for b in model.buffers()]
    params = [p.detach().clone() for p in model.parameters()]
    dropouts = [m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")]
    check_packing_safe(model, batch)  # probes: with dropout 0.3 in train mode, and still exact
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and model.config.attention_dropout == 0.3
    assert [m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")] == dropouts
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers))
    assert all(torch.equal(a, b) and a.grad is None for a, b in zip(model.parameters(), params))
    assert not GUARD.probing


def test_probe_restores_running_stats():
    """A module that updates a buffer in forward (BatchNorm-like running stats) gets it back."""
    model = llama("eager").train()

    class Stats(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen += x.shape[1]
            return x

    stats = Stats()
    model.model.norm.register_forward_hook(lambda mod, a, out: stats(out))
    model.model.stats = stats
    check_packing_safe(model, Collator()(ROWS))
    assert stats.seen.item() == 0


def count_forwards(model) -> list[int]:
    n = [0]
    model.register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1))
    return n


def probe_forwards(model, batch) -> int:
    """The forwards the probe ran for ``batch``: each packed row once, and each of its sequences alone."""
    return sum(1 + len(row) for row in cached_verdict(model, batch).probes)


def test_probe_runs_once_per_model_state():
    model = llama("sdpa").train()
    n = count_forwards(model)
    install_packing_guard(model)
    batch = Collator()(ROWS)
    model(**batch)
    probe = probe_forwards(model, batch)
    # (5, 7), then a row as long as the batch rounded up to a power of two, its last sequence starting late
    assert probe == 3 + 1 + len(cached_verdict(model, batch).probes[-1])
    assert n[0] == probe + 1  # the probe, then the batch
    model(**batch)
    model(**Collator()(ROWS[:1]))
    assert n[0] == probe + 3  # cached
    model.eval()
    model(**batch)
    assert n[0] == probe + 3 + probe + 1  # a new mode: probed again
    model.set_attn_implementation("eager")
    model(**batch)
    assert n[0] == 2 * probe + 4 + probe + 1  # a new backend: probed again
    model.config.sliding_window = 4
    model(**batch)
    assert n[0] == 3 * probe + 5 + probe_forwards(model, batch) + 1  # a changed config: probed again
    twin = llama("eager").eval()  # another object: probed for itself (a hook on one instance can make it leak)
    m = count_forwards(twin)
    install_packing_guard(twin)
    twin(**batch)
    assert m[0] == probe_forwards(twin, batch) + 1


def test_probe_cost_on_a_tiny_model():
    """The documented cost: one forward of 12 packed tokens and two of 5 and 7 alone, tens of ms here."""
    model = llama("sdpa").train()
    verdict = GUARD.probe(model, model, layout(Collator()(ROWS)))
    assert verdict.error is None and not verdict.fix and verdict.diff < 1e-6
    assert verdict.seconds < 2.0, verdict  # ~0.01-0.03 s on 2 CPU cores


def test_unpacked_batches_pass_even_where_packing_is_refused():
    model = llama("sdpa").eval()
    drop_position_ids(model)
    install_packing_guard(model)
    model(input_ids=torch.tensor([[5, 6, 7]]))  # no boundaries: nothing to probe
    one = Collator()([make_row(EXAMPLES[:1])])
    model(**one)  # one sequence: probed (so ranks stay in step) but not refused
    with pytest.raises(PackstreamError):
        model(**Collator()(ROWS))


def test_bf16_autocast_uses_a_half_precision_tolerance():
    model = llama("sdpa").eval()
    install_packing_guard(model)
    batch = Collator()(ROWS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch)
    drop_position_ids(model)
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(PackstreamError, match="> 5e-02"):
        model(**batch)


def test_guard_through_torch_compile():
    """The hook sits on the transformers model and stays out of the graph; the probe runs eagerly."""
    model = gpt_oss("eager").eval()
    compiled = torch.compile(model, backend="eager")
    install_packing_guard(compiled)
    batch = Collator()(ROWS)
    with torch.no_grad():
        logits = compiled(**batch).logits[0]
        cu = batch["cu_seq_lens_q"].tolist()
        d = max((model(input_ids=batch["input_ids"][:, a:b]).logits[0] - logits[a:b]).abs().max().item()
                for a, b in zip(cu, cu[1:]))
    assert d <= TOL


# -- backends a model cannot dispatch to ------------------------------------------------------------------


def table_model(attn: str) -> torch.nn.Module:
    """GPT-Neo, which picks its attention class at construction from ``GPT_NEO_ATTENTION_CLASSES``. Models move
    to transformers' AttentionInterface release by release (Falcon did in 5.25); the test skips, saying so, on a
    release where GPT-Neo has too."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM
    from transformers.models.gpt_neo import modeling_gpt_neo

    if not hasattr(modeling_gpt_neo, "GPT_NEO_ATTENTION_CLASSES"):
        pytest.skip("this transformers release dispatches GPT-Neo through the AttentionInterface: no class table")
    config = GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                          attention_types=[[["global"], 2]], max_position_embeddings=256)
    config._attn_implementation = attn
    return GPTNeoForCausalLM(config)


def test_a_model_with_its_own_class_table_and_varlen_is_a_packstream_error_not_a_key_error():
    name = register_varlen_attention()
    with pytest.raises(PackstreamError, match=r"gpt_neo .*knows only \[.*'eager'.*\].*packstream_varlen"):
        table_model(name)


def test_varlen_set_on_a_model_that_never_calls_it_is_refused(monkeypatch):
    """GPT-Neo built with eager, then told it uses the varlen backend: it never calls it, and the guard says so."""
    name = register_varlen_attention()
    monkeypatch.setattr(VARLEN, "devices", ("cuda", "cpu"))  # so that a call would not raise on CPU
    torch.manual_seed(0)
    model = table_model("eager").eval()
    model.config._attn_implementation = name
    install_packing_guard(model)
    with pytest.raises(PackstreamError, match="never called: GPTNeoForCausalLM computes attention with classes of its own"):
        model(**Collator()(ROWS))


# -- torch.distributed: every rank probes in step and they agree -------------------------------------------


def _distributed_worker(rank: int, world: int, store: str, out: str, leaky_rank: int) -> None:
    """DDP, then FSDP2 (fully_shard per layer and at the root), on gloo: each a model needing the mask fix
    (GptOss: two collective probes) and a Llama that leaks on ``leaky_rank`` only."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (world,))

    def fsdp2(model):
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    result = {}
    done = False
    try:
        for name, wrap in (("ddp", DistributedDataParallel), ("fsdp2", fsdp2)):
            model = wrap(gpt_oss("eager").train())
            install_packing_guard(model)
            model(**Collator()([ROWS[rank % 2]])).loss.backward()  # each rank its own batch
            result[f"{name} gpt_oss"] = "ok"
            leaky = llama("sdpa").train()
            if rank == leaky_rank:
                drop_position_ids(leaky)
            leaky = wrap(leaky)
            install_packing_guard(leaky)
            try:
                leaky(**Collator()([ROWS[rank % 2]])).loss.backward()
                result[f"{name} llama"] = "ok"
            except PackstreamError as e:
                result[f"{name} llama"] = str(e)
        done = True
    finally:
        Path(f"{out}.{rank}").write_text(json.dumps(result))
        if done:  # both ranks here before either tears gloo down (else a rank can abort: SIGABRT, "terminate called")
            dist.barrier()
        dist.destroy_process_group()


def test_ddp_and_fsdp2_ranks_probe_in_step_and_agree(tmp_path):
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    out = str(tmp_path / "result")
    mp.spawn(_distributed_worker, args=(2, str(tmp_path / "store"), out, 1), nprocs=2, join=True)
    r0, r1 = (json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1))
    for name in ("ddp", "fsdp2"):
        assert r0[f"{name} gpt_oss"] == r1[f"{name} gpt_oss"] == "ok"
        assert "another rank's packing probe failed" in r0[f"{name} llama"]  # rank 0's model is fine, rank 1's leaks
        assert "packing probe (2 sequences" in r1[f"{name} llama"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_guard_on_cuda_bf16():
    model = llama("sdpa").to("cuda", torch.bfloat16).train()
    install_packing_guard(model)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in Collator()(ROWS).items()}
    model(**batch).loss.backward()
    drop_position_ids(model)
    model.eval()
    with pytest.raises(PackstreamError):
        model(**batch)
