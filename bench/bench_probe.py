"""What the packing guard's probe costs, beside one training step of the same model (CPU, fp32).

    python bench/bench_probe.py [--threads 2]

The probe runs once per model state (class, config, backend, mode, dtype, batch layout): the short
row (5 + 7 tokens), for each length the config makes special a row crossing it (5 + N + 2 tokens), and a
row as long as the batch (``--tokens``, the budget here) whose last 7-token sequence starts late, each packed
and each sequence alone, under ``no_grad``. This prints, per model, the probe rows, the
probe's wall time (``packers._attention._probe.probe``, best of ``--repeats``), and one training step (forward and backward of a
packed batch of ``--tokens`` tokens, rows of 4 examples) for scale.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def models():
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    yield "tiny Llama (hidden 32, 2 layers)", LlamaForCausalLM, LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128)
    yield "tiny Mistral, sliding window 16", MistralForCausalLM, MistralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=16)
    yield "125M Mistral-shape, window 1024", MistralForCausalLM, MistralConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, max_position_embeddings=4096, sliding_window=1024)
    yield "125M Llama-shape, llama3 rope (original 2048)", LlamaForCausalLM, LlamaConfig(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
        num_key_value_heads=4, max_position_embeddings=8192, rope_parameters={
            "rope_type": "llama3", "factor": 4.0, "rope_theta": 500000.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 2048})


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048)
    args = p.parse_args(argv)
    import torch
    import transformers

    from packers import Collator
    from packers._attention._probe import layout, probe, reach_for

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    print(f"{'model':<48} {'probe rows':<22} {'probe s':>8} {'train step s':>12} {'probe / step':>12}")
    for name, cls, cfg in models():
        torch.manual_seed(0)
        model = cls._from_config(cfg, attn_implementation="sdpa").train()
        n = args.tokens // 4
        rows = [{"input_ids": torch.randint(3, cfg.vocab_size, (4 * n,)).tolist(), "loss_mask": [1] * (4 * n),
                 "seq_offsets": [0, n, 2 * n, 3 * n, 4 * n]}]
        batch = Collator()(rows)
        probed = layout(batch)
        best, verdict = float("inf"), None
        for _ in range(args.repeats):
            verdict = probe(model, model, probed, reach_for(model, args.tokens))
            best = min(best, verdict.seconds)
        assert verdict.error is None, verdict.error
        step = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            model(**batch).loss.backward()
            step = min(step, time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
        shapes = " ".join("+".join(map(str, s)) if len(s) <= 3 else f"{sum(s)}({len(s)})" for s in verdict.probes)
        print(f"{name:<48} {shapes:<22} {best:>8.3f} {step:>12.3f} {best / step:>12.2f}", flush=True)


if __name__ == "__main__":
    main()
