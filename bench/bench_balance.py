"""Compute balance across ranks, and order bias, of PackedDataset's epoch schedules on real length distributions.

    python bench/bench_balance.py [--budgets 4096 16384 32768] [--worlds 8 64] [--epochs 3]

Each real data set of ``../shared/data`` is rendered and tokenized with the default tokenizer by the
pipeline's encode stage (the lengths ``packstream pack`` sees), then packed by ``packers.pack`` (BFD, the
default strategy; long examples split, so that every token stays and full-budget rows of one example
exist), once per budget; plus "real mix" (all of them), each of these resampled (bootstrap, seeded) to
``--resample`` examples (``name@200k``: the same length distribution at the size of a training set; the
files themselves hold 300 to 7,500 examples, a handful of 32k-token rows for 64 ranks), and a generated
long-tail mix (88% lognormal around 250 tokens, 10% around 1,500, 2% around 12,000). The rows are the
same for every schedule below.

For each budget and world size, one row per micro-batch (the hardest case: a step's balance is its
rows'), the schedule of ``PackedDataset(batching=Batching(balance=...))``
(:func:`packers._schedule.schedule_epoch`) is built for ``--epochs`` epochs and scored with the cost
``alpha * sum(l) + beta * sum(l**2)`` per row of a Llama-3-8B-shaped model (``CostModel.from_config``: FLOPs of forward and backward):

* **straggler**: sum over steps of the most loaded rank's cost / sum of the mean rank's (the time a
  synchronous step waits for its slowest rank, relative to a perfect split), for ``none`` (the shuffled
  rows in order), ``tokens`` (rows dealt by token count) and ``compute``;
* **step ms**: the modelled mean step time, the most loaded rank's FLOPs at ``--tflops`` (default 400
  TFLOP/s per GPU, about 40% of an H100's bf16 peak), for ``tokens`` and ``compute``;
* **|rho| len / sq**: the largest |Spearman rho| over the epochs, step index vs the step's mean example
  length and vs its sum of squared lengths (``compute`` schedules; ``--` where an epoch has under 10 steps);
* **pieces**: rows divided at an example boundary so that every rank gets the same number of steps.

Goal: compute-balanced straggler <= 1.05 in every case, rows unchanged. Where a data set has
about as few rows as ranks (one or two steps), that is out of reach for any schedule that keeps one row per
micro-batch and trains every example once: 43 rows on 64 ranks leave at least 22 ranks a whole row while
the mean rank gets 43/64 of one (1.49). The exit status is 1 when a case with at least 10 steps per epoch
misses the goal.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packers import pack  # noqa: E402
from packers import Balance, Batching, CostModel, Sampling  # noqa: E402
from packers._schedule import Rows, ranks, schedule_epoch  # noqa: E402

DATA = ROOT.parent / "shared" / "data"
# (name, path under ../shared/data, format options the data set needs)
REAL = [
    ("gsm8k", "gsm8k/train.jsonl", {"fields": (("question", "user"), ("answer", "assistant"))}),
    ("gpteacher", "gpteacher/codegen-instruct.json", {}),
    ("t0", "self_instruct/t0_sample_15_per_template.jsonl", {}),
    ("glaive", "glaive_toolcall/glaive_toolcall_en_demo.json", {}),
    ("oasst", "oasst/en_100_paths.messages.jsonl", {}),
    ("alpaca", "llamafactory/alpaca_en_demo.json", {}),
]
LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256)


def encoded_lengths(path: Path, options: dict) -> np.ndarray:
    """Token lengths of every example ``packstream pack`` would make of ``path`` (default tokenizer)."""
    from pipeline import PackOptions, _read
    from pipeline._encode import Encoder

    o = PackOptions(inputs=(str(path),), output="unused", **options)
    files, _ = _read.expand_datasets(o.datasets())
    encoder = Encoder(o)
    items = [(f.dataset, f.source, pos, rec) for f in files for pos, rec in _read.read_file(f, o.max_record_bytes)]
    out = [np.diff(encoder.encode(items[i : i + 512]).batch.offsets) for i in range(0, len(items), 512)]
    return np.concatenate(out)


def long_tail(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    body, tail, far = rng.lognormal(np.log(250), 0.9, n), rng.lognormal(np.log(1500), 1.0, n), rng.lognormal(np.log(12000), 0.6, n)
    u = rng.random(n)
    return np.clip(np.where(u < 0.88, body, np.where(u < 0.98, tail, far)).astype(np.int64), 2, None)


def rows_of(lengths: np.ndarray, budget: int) -> Rows:
    """BFD rows of ``lengths`` (long examples split into budget-sized pieces), as example lengths per row."""
    r = pack(lengths, budget, "bfd", long="split")
    pieces = (r.stops - r.starts).astype(np.int64)
    return Rows(tokens=np.add.reduceat(pieces, r.row_offsets[:-1]), seq_start=r.row_offsets.astype(np.int64),
                seq_lens=pieces)


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    rx, ry = ranks(np.asarray(x, dtype=np.float64)), ranks(np.asarray(y, dtype=np.float64))  # ties: mean ranks
    return float(np.corrcoef(rx, ry)[0, 1])


def score(rows: Rows, world: int, balance: Balance, cost: CostModel, epochs: int) -> dict:
    per_seq = cost.of(rows.seq_lens)
    lens = rows.seq_lens.astype(np.float64)
    out = {"max": 0.0, "mean": 0.0, "steps": 0, "rho_len": 0.0, "rho_sq": 0.0, "pieces": 0, "seconds": 0.0}
    for epoch in range(epochs):
        t0 = time.perf_counter()
        sched = schedule_epoch(rows, epoch, sampling=Sampling(seed=17), batching=Batching(balance=balance, cost=cost),
                               world_size=world)
        out["seconds"] += time.perf_counter() - t0
        u = sched.units
        c = u.sums(rows, per_seq)
        per_mb = np.add.reduceat(c[sched.order], sched.bounds[:-1]).reshape(sched.steps, world)
        out["max"] += per_mb.max(axis=1).sum()
        out["mean"] += per_mb.mean(axis=1).sum()
        out["steps"] += sched.steps
        out["pieces"] = max(out["pieces"], len(u) - len(rows))
        if sched.steps >= 10:
            n, t, q = (np.add.reduceat(u.sums(rows, v)[sched.order], sched.bounds[:-1]).reshape(sched.steps, world).sum(axis=1)
                       for v in (np.ones_like(lens), lens, lens * lens))
            idx = np.arange(sched.steps)
            out["rho_len"] = max(out["rho_len"], abs(spearman(idx, t / n)))
            out["rho_sq"] = max(out["rho_sq"], abs(spearman(idx, q)))
        else:
            out["rho_len"] = out["rho_sq"] = float("nan")
    out["straggler"] = out["max"] / out["mean"]
    out["step_flops"] = out["max"] / out["steps"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU for the modelled step time")
    p.add_argument("--long-tail", type=int, default=200_000, help="examples in the generated long-tail mix")
    p.add_argument("--resample", type=int, default=200_000,
                   help="also each real distribution resampled (bootstrap) to this many examples; 0: off")
    p.add_argument("--only", help="comma-separated data set names")
    args = p.parse_args(argv)
    cost = CostModel.from_config(LLAMA3_8B)
    sets: list[tuple[str, np.ndarray]] = []
    for name, rel, options in REAL:
        if args.only and name not in args.only.split(","):
            continue
        if not (DATA / rel).exists():
            print(f"{name}: {DATA / rel} not found, skipped", flush=True)
            continue
        t0 = time.perf_counter()
        lengths = encoded_lengths(DATA / rel, options)
        print(f"{name}: {len(lengths):,} examples, {int(lengths.sum()):,} tokens, median {int(np.median(lengths))}, "
              f"max {int(lengths.max()):,} ({time.perf_counter() - t0:.1f} s to encode)", flush=True)
        sets.append((name, lengths))
    if len(sets) > 1:
        sets.append(("real mix", np.concatenate([x for _, x in sets])))
    if args.resample:
        # The same length distributions at the size of a real training set: a bootstrap sample of each.
        rng = np.random.default_rng(0)
        sets += [(f"{name}@{args.resample // 1000}k", rng.choice(x, args.resample)) for name, x in list(sets)]
    if not args.only or "long-tail" in args.only.split(","):
        sets.append(("long-tail", long_tail(args.long_tail)))
    print(f"\ncost: CostModel.from_config(Llama-3-8B shape): alpha {cost.alpha:.3g} FLOPs/token, beta {cost.beta:.3g} "
          f"FLOPs/token^2; one row per micro-batch; {args.epochs} epochs; step ms at {args.tflops:g} TFLOP/s\n")
    head = (f"{'data':<10} {'budget':>6} {'world':>5} {'rows':>7} {'steps':>6} | {'straggler none':>14} {'tokens':>7} "
            f"{'compute':>8} | {'step ms tokens':>14} {'compute':>8} | {'|rho| len':>9} {'sq':>6} | {'pieces':>6} {'sched s':>7}")
    print(head)
    print("-" * len(head))
    worst = 0.0
    for name, lengths in sets:
        for budget in args.budgets:
            rows = rows_of(lengths, budget)
            for world in args.worlds:
                s = {b: score(rows, world, b, cost, args.epochs) for b in Balance}
                c = s[Balance.COMPUTE]
                if c["steps"] // args.epochs >= 10:
                    worst = max(worst, c["straggler"])
                ms = lambda x: x["step_flops"] / (args.tflops * 1e12) * 1e3  # noqa: E731
                rho = lambda v: "--" if np.isnan(v) else f"{v:.3f}"  # noqa: E731
                print(f"{name:<10} {budget:>6} {world:>5} {len(rows):>7,} {c['steps'] // args.epochs:>6,} | "
                      f"{s[Balance.NONE]['straggler']:>14.3f} {s[Balance.TOKENS]['straggler']:>7.3f} {c['straggler']:>8.3f} | "
                      f"{ms(s[Balance.TOKENS]):>14.1f} {ms(c):>8.1f} | {rho(c['rho_len']):>9} {rho(c['rho_sq']):>6} | "
                      f"{c['pieces']:>6} {c['seconds'] / args.epochs:>7.2f}", flush=True)
    print(f"\nworst compute-balanced straggler over cases with >= 10 steps per epoch: {worst:.3f} (goal <= 1.05)")
    return 0 if worst <= 1.05 else 1


if __name__ == "__main__":
    sys.exit(main())
