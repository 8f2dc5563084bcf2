"""Preference-pair benchmark (CPU): packed pairs against padded pairs, on the same pairs.

    python bench/bench_pairs.py [--budgets 2048 4096 8192] [--mix 3000] [--train-pairs 48] [--json OUT]

Data sets:

* ``dpo_zh``: ../shared/preference/dpo_zh_demo.json (LLaMA-Factory's ranking form, 300 pairs),
  encoded by ``packstream pack --pairs``'s own encode stage (the default tokenizer, built-in ChatML);
* ``long_tail``: a generated mix of ``--mix`` pairs with log-normal prompt and completion lengths
  (prompt median 150 tokens, completions 250 and 180, sigma 1.1: most pairs short, a few near or
  past the budget), chosen and rejected drawn independently so their lengths differ;
* ``kto_en``: ../shared/preference/kto_en_demo.json, single answers with a desirability label. KTO
  has no pair: packing it is plain SFT packing of single sequences (``packers.pack``), shown for
  its fill only; ``--pairs`` refuses it (``not_a_pair``), and the row contract has no column for
  the label (see docs/formats.md).

Per budget (``--long truncate``: a pair over the budget has both completions cut at one length;
the padded baseline gets the same cut pairs, so both hold the same tokens):

* **packed**: ``packers.pack_pairs`` (best-fit decreasing, a pair one item): rows, fill
  (tokens / (rows x budget)), pairs per row;
* **padded**: the usual DPO collator: batches of B pairs in shuffled order, chosen and rejected
  sides padded to the longest sequence of the batch (2B x max_len); B = the packed run's mean
  pairs per row, so both see the same pairs per step. Fill = tokens / padded slots.
* **CPU tokens/s**: a tiny Llama (sdpa), DPO loss forward + backward through
  ``packers.sequence_logps``, over the same ``--train-pairs`` pairs: packed rows (one per step)
  against padded batches (same pairs per step), timed in turns; useful tokens (no padding) per
  second. On CPU, sdpa computes each packed row's block-diagonal mask densely (T x T), so packing
  saves the padding but pays for the masked-out blocks; varlen kernels on GPU skip them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packers import Collator, pack, pack_pairs, sequence_logps  # noqa: E402

PREF = ROOT.parent / "shared" / "preference"


def encoded_pairs(path: Path) -> dict[str, np.ndarray]:
    """(chosen, rejected, prompt) lengths and the tokens of every pair of ``path``, by pack --pairs' encoder."""
    from pipeline._encode import Encoder
    from pipeline._options import PackOptions

    enc = Encoder(PackOptions(inputs=(str(path),), pairs=True))
    records = json.loads(path.read_text(encoding="utf-8"))
    out = enc.encode([(0, path.name, i, r) for i, r in enumerate(records)])
    if out.rejected:
        print(f"  {path.name}: {len(out.rejected)} records dead-lettered: {sorted({r['reason'] for r in out.rejected})}")
    b = out.batch
    from pipeline._rows import prompt_lengths

    return {"chosen": b.cuts, "rejected": b.lengths - b.cuts, "prompt": prompt_lengths(b), "batch": b}


def kto_lengths(path: Path) -> np.ndarray:
    """Token lengths of the KTO set's single answers, encoded as SFT (the label is a field SFT ignores and counts)."""
    from pipeline._encode import Encoder
    from pipeline._options import PackOptions

    enc = Encoder(PackOptions(inputs=(str(path),)))
    records = json.loads(path.read_text(encoding="utf-8"))
    return enc.encode([(0, path.name, i, r) for i, r in enumerate(records)]).batch.lengths


def long_tail(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def draw(median: float) -> np.ndarray:
        return np.clip(np.round(rng.lognormal(np.log(median), 1.1, n)), 1, 16384).astype(np.int64)

    p = draw(150)
    return {"prompt": p, "chosen": p + draw(250), "rejected": p + draw(180)}


def padded_fill(kept_c: np.ndarray, kept_r: np.ndarray, per_batch: int, seed: int = 0) -> tuple[float, int]:
    """(fill, padded slots) of DPO batches of ``per_batch`` pairs in shuffled order, both sides padded to the
    batch's longest sequence."""
    order = np.random.default_rng(seed).permutation(len(kept_c))
    slots = 0
    for i in range(0, len(order), per_batch):
        idx = order[i:i + per_batch]
        slots += 2 * len(idx) * int(max(kept_c[idx].max(), kept_r[idx].max()))
    tokens = int(kept_c.sum() + kept_r.sum())
    return tokens / slots if slots else 0.0, slots


def fill_table(name: str, d: dict[str, np.ndarray], budget: int) -> dict:
    r = pack_pairs(d["chosen"], d["rejected"], budget, prompt=d["prompt"], long="truncate")
    kept = r.stops.reshape(-1, 2)
    pairs = len(kept)
    per_row = pairs / r.num_rows if r.num_rows else 0.0
    b = max(1, int(round(per_row)))
    pad_fill, slots = padded_fill(kept[:, 0], kept[:, 1], b)
    tokens = int(kept.sum())
    return {"data": name, "budget": budget, "pairs": pairs, "dropped": len(r.dropped) // 2,
            "truncated": len(np.unique(r.truncated // 2)), "rows": r.num_rows,
            "packed_fill": tokens / (r.num_rows * budget) if r.num_rows else 0.0, "pairs_per_row": per_row,
            "padded_pairs_per_batch": b, "padded_fill": pad_fill,
            "slots_ratio": slots / (r.num_rows * budget) if r.num_rows else 0.0}


# ------------------------------------------------------------------------------------------------
# CPU training speed


def tiny_llama(vocab: int, max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_len,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def sample_rows(d: dict[str, np.ndarray], r, vocab: int, k: int, seed: int) -> list[list[tuple[list, list, list]]]:
    """Random rows of the packing (a seeded draw, until they hold ``k`` pairs), each a list of pairs as (prompt,
    chosen completion, rejected completion) token lists at the kept (truncated) lengths; random ids (speed does
    not depend on them). Random rows, not the first: best-fit decreasing opens rows with the longest pairs."""
    rng = np.random.default_rng(seed)
    rows, n = [], 0
    for i in rng.permutation(r.num_rows).tolist():
        row = []
        for j in range(int(r.row_offsets[i]) // 2, int(r.row_offsets[i + 1]) // 2):
            pair = int(r.order[2 * j] // 2)
            p = int(d["prompt"][pair])
            c, rj = int(r.stops[2 * j]) - p, int(r.stops[2 * j + 1]) - p
            row.append((rng.integers(3, vocab, p).tolist(), rng.integers(3, vocab, c).tolist(),
                        rng.integers(3, vocab, rj).tolist()))
        rows.append(row)
        n += len(row)
        if n >= k:
            break
    return rows


def pair_row(pairs) -> dict:
    ids, mask, offs, spans, sides = [], [], [0], [], []
    for p, c, r in pairs:
        for side, comp in ((0, c), (1, r)):
            start = len(ids)
            ids += p + comp
            mask += [0] * len(p) + [1] * len(comp)
            offs.append(len(ids))
            spans += [start + len(p), len(ids)]
            sides.append(side)
    return {"input_ids": ids, "loss_mask": mask, "seq_offsets": offs, "sides": sides, "completion_spans": spans}


def padded_batch(pairs) -> dict:
    seqs = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]
    n = max(len(a) + len(b) for a, b in seqs)
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    attn = torch.zeros(len(seqs), n, dtype=torch.long)
    comp = torch.zeros(len(seqs), n, dtype=torch.bool)
    for i, (a, b) in enumerate(seqs):
        ids[i, :len(a) + len(b)] = torch.tensor(a + b)
        attn[i, :len(a) + len(b)] = 1
        comp[i, len(a):len(a) + len(b)] = True
    return {"input_ids": ids, "attention_mask": attn, "comp": comp}


def packed_step(model, batch) -> None:
    lp = sequence_logps(model(**batch).logits, batch)
    (-F.logsigmoid(0.1 * (lp.chosen - lp.rejected))).mean().backward()


def padded_step(model, b) -> None:
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, b["input_ids"][:, 1:, None])[..., 0]
    per_seq = (lp * b["comp"][:, 1:]).sum(1)
    half = per_seq.shape[0] // 2
    (-F.logsigmoid(0.1 * (per_seq[:half] - per_seq[half:]))).mean().backward()


def speed(d: dict[str, np.ndarray], budget: int, k: int, repeats: int) -> dict:
    vocab = 1024
    r = pack_pairs(d["chosen"], d["rejected"], budget, prompt=d["prompt"], long="truncate")
    sampled = sample_rows(d, r, vocab, k, seed=budget)
    rows = [pair_row(row) for row in sampled]
    pairs = [p for row in sampled for p in row]
    per_batch = max(1, int(round(len(pairs) / len(rows))))
    order = np.random.default_rng(0).permutation(len(pairs))
    padded = [padded_batch([pairs[j] for j in order[i:i + per_batch]]) for i in range(0, len(pairs), per_batch)]
    packed = [Collator()([row]) for row in rows]
    tokens = sum(len(p) * 2 + len(c) + len(rj) for p, c, rj in pairs)
    model = tiny_llama(vocab, budget).train()
    times = {"packed": [], "padded": []}
    for _ in range(repeats):  # in turns: both see the same machine load
        for name, batches, step in (("packed", packed, packed_step), ("padded", padded, padded_step)):
            model.zero_grad()
            t0 = time.perf_counter()
            for b in batches:
                step(model, b)
            times[name].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    slots = sum(b["input_ids"].numel() for b in padded)
    return {"budget": budget, "pairs": len(pairs), "tokens": tokens, "packed_steps": len(packed),
            "padded_steps": len(padded), "padded_slots": slots,
            "packed_tok_s": tokens / best["packed"], "padded_tok_s": tokens / best["padded"],
            "packed_over_padded": best["padded"] / best["packed"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--mix", type=int, default=3000, help="pairs in the generated long-tail mix")
    ap.add_argument("--train-pairs", type=int, default=48, help="pairs timed per budget (CPU speed)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = {"dpo_zh": encoded_pairs(PREF / "dpo_zh_demo.json"), "long_tail": long_tail(args.mix)}
    out = {"fill": [], "speed": [], "kto": []}
    print("fill: packed pairs vs padded pairs (same pairs; --long truncate)")
    print(f"{'data':10} {'budget':>6} {'pairs':>6} {'cut':>4} {'drop':>4} {'rows':>5} {'packed fill':>11} "
          f"{'pairs/row':>9} {'padded fill':>11} {'B':>3}")
    for name, d in data.items():
        for budget in args.budgets:
            t = fill_table(name, d, budget)
            out["fill"].append(t)
            print(f"{name:10} {budget:6} {t['pairs']:6} {t['truncated']:4} {t['dropped']:4} {t['rows']:5} "
                  f"{t['packed_fill']:11.2%} {t['pairs_per_row']:9.2f} {t['padded_fill']:11.2%} "
                  f"{t['padded_pairs_per_batch']:3}")
    kto = kto_lengths(PREF / "kto_en_demo.json")
    for budget in args.budgets:
        res = pack(kto, budget)
        fill = int(res.row_lengths.sum()) / (res.num_rows * budget)
        out["kto"].append({"budget": budget, "sequences": len(kto), "dropped": len(res.dropped), "rows": res.num_rows,
                           "fill": fill})
        print(f"kto_en (single sequences, SFT packing) budget {budget}: {len(kto) - len(res.dropped)} sequences in "
              f"{res.num_rows} rows ({len(res.dropped)} over the budget dropped), fill {fill:.2%}")
    print(f"\nCPU tokens/s, tiny Llama sdpa, DPO forward+backward, {args.train_pairs} pairs of the long-tail mix "
          "(best of turns)")
    print(f"{'budget':>6} {'pairs':>5} {'tokens':>7} {'steps p/pad':>11} {'packed tok/s':>12} {'padded tok/s':>12} "
          f"{'packed/padded':>13}")
    for budget in args.budgets:
        s = speed(data["long_tail"], budget, args.train_pairs, args.repeats)
        out["speed"].append(s)
        print(f"{budget:6} {s['pairs']:5} {s['tokens']:7} {s['packed_steps']:5}/{s['padded_steps']:<5} "
              f"{s['packed_tok_s']:12,.0f} {s['padded_tok_s']:12,.0f} {s['packed_over_padded']:12.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
