"""The guard at the lengths a config makes special (issue 18).

* A backend that keeps packed examples apart up to N tokens and leaks above them passes a probe of 12
  tokens; the guard probes a row crossing each length the config names (sliding window, attention
  chunk, rope original length, ...) and refuses it, for N at each of these boundaries.
* Ropes whose frequencies follow the longest sequence of the batch (``dynamic``, ``longrope``) are exact
  while every sequence stays below the original length, and refused above it, under every backend.
* flex_attention on CPU is refused: torch's compiled CPU kernel is wrong at some lengths, packed or not
  (the flaky OPT/flex LEAK of the compatibility matrix).
* The probe leaves no trace in modules that replace buffers or set attributes during a forward.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from packers import Collator, PackstreamError, check_packing_safe, install_packing_guard
from tests._internals import batch_rope, cached_verdict, probe_layout as layout, run_probe, special_lengths
from tests._models import TOL, VOCAB, cpu_varlen as use_cpu_varlen, max_diff, tiny_model, tiny_opt
from tests._shards import Example, make_row

N = 16  # the special length under test: longer than the short probe's 7 tokens, so that probe cannot see it


def llama(attn, **kw):
    return tiny_model("llama", attn, **{"max_position_embeddings": 64, **kw})


def mistral(attn, **kw):
    return tiny_model("mistral", attn, **{"max_position_embeddings": 64, **kw})


def llama4(attn, **kw):
    return tiny_model("llama4", attn, **{"max_position_embeddings": 64, **kw})


def phi3(attn, **kw):
    return tiny_model("phi3", attn, **{"max_position_embeddings": 64, **kw})


def rows_of(lengths: list[list[int]], seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    exs = [[Example(f"x{i}{j}", torch.randint(3, VOCAB, (n,), generator=g).tolist(), [1] * n) for j, n in enumerate(row)]
           for i, row in enumerate(lengths)]
    return [make_row(r) for r in exs]


# -- a backend that leaks only above N tokens ------------------------------------------------------------------


def leaky_above(n: int) -> str:
    """sdpa, except that a query longer than ``n`` tokens attends causally over the whole row (the packed mask
    dropped): exact on short rows, a leak on long ones. Registered through transformers' AttentionInterface."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def forward(module, query, key, value, attention_mask, **kwargs):
        if query.shape[2] > n:
            attention_mask, kwargs["is_causal"] = None, True
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = f"leaky_above_{n}"
    AttentionInterface.register(name, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


BOUNDARIES = {
    "window": (mistral, {"sliding_window": N}, "sliding_window"),
    "chunk": (llama4, {"attention_chunk_size": N}, "attention_chunk_size"),
    "original": (llama, {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                             "original_max_position_embeddings": N}}, "original_max_position_embeddings"),
}


@pytest.mark.parametrize("boundary", list(BOUNDARIES))
def test_a_backend_leaking_above_a_special_length_is_refused(boundary):
    make, config, key = BOUNDARIES[boundary]
    model = make(leaky_above(N), **config).train()
    short = layout(Collator()(rows_of([[5, 7]])))
    # The short probe alone finds nothing: 12 tokens never leave the mask.
    diff, tol, error = run_probe(model, model, short, fix=False)
    assert error is None and diff <= tol
    long_rows = Collator()(rows_of([[9, N + 4], [6]]))
    assert max_diff(model, long_rows) > 1e-2  # and the backend does leak, on rows longer than N
    install_packing_guard(model)
    with pytest.raises(PackstreamError, match=rf"lets packed examples interact.*2 sequences of 5 and {N + 2} tokens, "
                                              rf"crossing (rope_parameters\.)?{key}={N}"):
        model(**Collator()(rows_of([[5, 7]])))  # refused at the first packed batch, short as it is


@pytest.mark.parametrize("boundary", list(BOUNDARIES))
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_windows_chunks_and_static_ropes_stay_exact_across_their_lengths(boundary, attn):
    """The long probes refuse nothing that is exact: the same configs under transformers' own backends pass,
    and rows whose sequences cross N equal each sequence alone."""
    make, config, _ = BOUNDARIES[boundary]
    model = make(attn, **config).eval()
    install_packing_guard(model)
    batch = Collator()(rows_of([[9, N + 4], [6, N + 1]]))
    check_packing_safe(model, batch)
    verdict = cached_verdict(model, batch)
    assert (5, N + 2) in verdict.probes
    assert max_diff(model, batch) <= TOL


# -- ropes whose frequencies follow the batch ------------------------------------------------------------------

LIMIT = 32  # the original length of the dynamic and longrope configs below


def dynamic_llama(attn):
    return llama(attn, max_position_embeddings=LIMIT,
                 rope_parameters={"rope_type": "dynamic", "factor": 16.0, "rope_theta": 10000.0})


def longrope_phi3(attn):
    half = 4  # head_dim 8 / 2
    return phi3(attn, max_position_embeddings=4 * LIMIT, original_max_position_embeddings=LIMIT, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
        "long_factor": [1.0, 3.0, 9.0, 27.0], "original_max_position_embeddings": LIMIT})


ROPES = {"dynamic": dynamic_llama, "longrope": longrope_phi3}


@pytest.fixture
def cpu_varlen(monkeypatch):
    """packstream_varlen with a CPU reference kernel, so that every backend runs here."""
    return use_cpu_varlen(monkeypatch)


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("attn", ["eager", "sdpa", pytest.param("varlen", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["train", pytest.param("eval", marks=pytest.mark.slow)])
def test_batch_dependent_ropes_are_exact_below_the_original_length_and_refused_above(rope, attn, mode, cpu_varlen):
    model = ROPES[rope](cpu_varlen if attn == "varlen" else attn)
    getattr(model, mode)()
    long = Collator()(rows_of([[LIMIT + 8, 6], [7]]))
    # Unguarded, a short example beside a long one gets the long one's frequencies (dropout off for the truth).
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    assert max_diff(model, long, relative=True) > 1e-4  # fp32 noise: ~1e-7
    install_packing_guard(model)
    short = Collator()(rows_of([[LIMIT - 1, 6], [9, 12]]))
    model(**short)  # every sequence below the limit: allowed ...
    assert max_diff(model, short) <= TOL  # ... and exact
    with pytest.raises(PackstreamError, match=rf"rope_type='{rope}'.*sequence of {LIMIT + 8} tokens.*static rope type.*"
                                              rf"--max-tokens {LIMIT - 1}"):
        model(**long)
    fixed = Collator(fixed_shape=True, budget=LIMIT)(rows_of([[9, 12]]))  # the budget bounds the padding's positions
    with pytest.raises(PackstreamError, match="fixed_shape"):
        model(**fixed)


@pytest.mark.parametrize("rope", list(ROPES))
def test_batch_dependent_ropes_under_flex_are_refused(rope):
    model = ROPES[rope]("flex_attention").eval()
    with pytest.raises(PackstreamError, match="flex_attention' on CPU"):
        check_packing_safe(model, Collator()(rows_of([[9, 12]])))


# -- flex_attention on CPU -----------------------------------------------------------------------------------


def test_flex_attention_on_cpu_is_refused():
    """The flaky LEAK of tests/test_guard.py::test_gpt_oss_and_opt_exact_or_refused[opt]: the guard's 12-token probe
    passed, then the 40-token batch came out wrong. torch's compiled CPU flex kernel gives wrong attention for some
    lengths with no packing at all (bench/compat_matrix.py's tiny models, head dim 8), differently in each process,
    so the guard refuses it on CPU instead of vouching for lengths it did not run."""
    model = tiny_opt("flex_attention").eval()
    install_packing_guard(model)
    with pytest.raises(PackstreamError, match="flex_attention' on CPU.*use attn_implementation='sdpa' or 'eager'"):
        model(**Collator()(rows_of([[9, 1, 13], [6, 11]])))


# -- no trace --------------------------------------------------------------------------------------------------


def test_probe_restores_replaced_buffers_and_attributes():
    """A module that re-registers a buffer and sets attributes in its forward (what a dynamic rope does when a
    sequence grows past its cache) gets its own objects back after the probe."""
    model = llama("sdpa", sliding_window=None).train()
    rotary = model.model.rotary_emb
    inv_freq, cached = rotary.inv_freq, rotary.max_seq_len_cached
    grown = inv_freq * 0.5

    def grow(module, args):  # the same in every forward, so packed and alone still agree
        module.register_buffer("inv_freq", grown.clone(), persistent=False)
        module.max_seq_len_cached = 2 * cached
        module.scratch = torch.zeros(1)

    rotary.register_forward_pre_hook(grow)
    check_packing_safe(model, Collator()(rows_of([[5, 9]])))
    assert rotary.inv_freq is inv_freq and torch.equal(rotary.inv_freq, inv_freq)
    assert rotary.max_seq_len_cached == cached and not hasattr(rotary, "scratch")


def test_switching_modes_does_not_probe_again():
    """Verdicts are kept per state: train -> eval -> train probes twice, not three times."""
    model = llama("sdpa").train()
    n = [0]
    model.register_forward_pre_hook(lambda *a: n.__setitem__(0, n[0] + 1))
    install_packing_guard(model)
    batch = Collator()(rows_of([[5, 9]]))
    model(**batch)
    probe = sum(1 + len(row) for row in cached_verdict(model, batch).probes)  # each row packed, its sequences alone
    model.eval()(**batch)
    model.train()(**batch)
    assert n[0] == 2 * probe + 3


def test_special_lengths_come_from_the_config():
    """What the probe crosses: the config's windows, chunks and rope original lengths, within max positions."""
    model = mistral("sdpa", sliding_window=N)
    assert special_lengths(model, None) == {N: "sliding_window"}
    model = llama("sdpa", rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 40})
    assert special_lengths(model, None) == {40: "rope_parameters.original_max_position_embeddings"}
    model = mistral("sdpa", sliding_window=4096)  # longer than its 64 positions: no sequence can cross it
    assert special_lengths(model, None) == {}
    assert batch_rope(dynamic_llama("sdpa")) == (LIMIT, "dynamic")
    assert batch_rope(longrope_phi3("sdpa")) == (LIMIT, "longrope")
    assert batch_rope(model) is None


# -- at the lengths the loader really feeds (issue 24) -----------------------------------------------------------


def test_a_backend_leaking_above_n_tokens_is_refused_when_the_config_names_no_length():
    """A plain Llama names no window, chunk or rope length, so no probe crosses N from the config alone; the probe
    at the folder's budget (``max_length=PackedDataset(...).budget``) reaches past N and refuses it."""
    n = 40
    model = tiny_model("llama", leaky_above(n), max_position_embeddings=256).train()
    assert special_lengths(model, None) == {}
    short = Collator()(rows_of([[5, 7]]))
    check_packing_safe(model, short)  # probed up to this batch's 12 tokens (16): nothing crosses 40
    assert cached_verdict(model, short).reach == 16
    with pytest.raises(PackstreamError, match=r"a row of 128 tokens whose last sequence starts at 121"):
        check_packing_safe(model, short, max_length=128)
    install_packing_guard(model, max_length=128)
    with pytest.raises(PackstreamError, match=r"a row of 128 tokens whose last sequence starts at 121"):
        model(**short)


def test_a_long_batch_is_probed_at_its_own_length_without_being_told():
    """No budget given: the first batch of 12 tokens is probed up to 16; a batch of 70 tokens probes again up to 128,
    where the backend leaks (above 40 tokens), and is refused."""
    model = tiny_model("llama", leaky_above(40), max_position_embeddings=256).train()
    install_packing_guard(model)
    model(**Collator()(rows_of([[5, 7]])))
    assert cached_verdict(model, Collator()(rows_of([[5, 7]]))).reach == 16
    with pytest.raises(PackstreamError, match=r"a row of 128 tokens"):
        model(**Collator()(rows_of([[30, 40]])))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_falcon_alibi_over_the_row_is_refused_at_the_budget(attn):
    """Falcon with ``alibi=True`` (the falcon-rw layout) builds its ALiBi bias from positions counted over the whole
    row: packed differs from alone by ~1e-2 once an example starts past position 256. The probe at the budget
    (512) sees it; the short probe did not (the guard let it through)."""
    import transformers

    cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                    alibi=True, new_decoder_architecture=False, multi_query=False, parallel_attn=False,
                                    bias=True)
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM._from_config(cfg, attn_implementation=attn).eval()
    batch = Collator()(rows_of([[300, 200]]))
    assert max_diff(model, batch, relative=True) > 1e-3  # it does differ: a late example gets another bias
    short = Collator()(rows_of([[5, 7]]))
    check_packing_safe(model, short, max_length=16)  # what the guard saw before: exact on short rows
    install_packing_guard(model, max_length=512)
    with pytest.raises(PackstreamError, match=r"FalconForCausalLM lets packed examples interact.*a row of 512 tokens.*"
                                              r"ALiBi"):
        model(**batch)


def test_the_guard_probes_at_the_budget_of_the_folder_it_is_given(tmp_path):
    """The folder's row budget (from the manifest), passed as ``max_length``: the probe reaches that far. Opening the
    folder alone lengthens no probe (issue 55; tests/test_guard_budget.py)."""
    from packers import PackedDataset
    from tests._shards import random_examples, write_shards, pack_first_fit

    write_shards(tmp_path, pack_first_fit(random_examples(20, seed=3, max_len=60), 128), budget=128)
    ds = PackedDataset(tmp_path)
    model = tiny_model("llama", "sdpa", max_position_embeddings=256).train()
    check_packing_safe(model, Collator()(rows_of([[5, 7]])), max_length=ds.budget)
    assert cached_verdict(model, Collator()(rows_of([[5, 7]]))).reach == 128


@settings(max_examples=12, deadline=None)
@given(threshold=st.integers(13, 250), budget=st.sampled_from([64, 128, 256]), alibi=st.booleans())
def test_generated_leaks_below_the_budget_are_refused_and_exact_models_pass(threshold, budget, alibi):
    """A backend that leaks above a random threshold, probed at a random budget: refused when the threshold is
    below the budget (a row of the budget would leak), let through when it is not (no row the loader feeds leaks).
    A model whose bias depends on absolute position (Falcon with ALiBi) is exact or refused, never silent."""
    model = tiny_model("llama", leaky_above(threshold), max_position_embeddings=256).train()
    g = torch.Generator().manual_seed(threshold)
    first = int(torch.randint(1, budget - 8, (1,), generator=g))
    batch = Collator()(rows_of([[first, budget - first]], seed=threshold))
    leaks = max_diff(model, batch) > 1e-5
    install_packing_guard(model, max_length=budget)
    try:
        model(**batch)
        refused = False
    except PackstreamError:
        refused = True
    assert refused == (threshold < budget)
    assert not leaks or refused  # never silent
    if alibi:
        import transformers

        cfg = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                        alibi=True, new_decoder_architecture=False, multi_query=False,
                                        parallel_attn=False, bias=True)
        falcon = transformers.FalconForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
        diff = max_diff(falcon, batch, relative=True)
        install_packing_guard(falcon, max_length=budget)
        try:
            falcon(**batch)
        except PackstreamError:
            return
        assert diff <= 1e-4  # let through: then exact
