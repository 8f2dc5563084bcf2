"""The encode cost of TRL's ``messages`` rule (issue 51), side by side with packstream's earlier rule, in one run.

TRL's rule (the default) tokenizes each conversation whole, with offsets, and masks the tokens that hold each
assistant span's characters; ``--eos always --turns cleaned`` tokenizes turn by turn. Both encode the same 20,000
generated two-turn records, best of 3; the ratio is what to read.

    python bench/bench_trl_rule.py
"""

from __future__ import annotations

import random
import time

from pipeline._encode import Encoder
from pipeline._options import PackOptions


def main(n: int = 20000) -> None:
    rng = random.Random(0)
    words = "alpha beta gamma delta river stone cloud quiet prime ninety seven".split()
    recs = [{"messages": [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(5, 60)))},
                          {"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(5, 200)))}]}
            for _ in range(n)]
    chunks = [[(0, "x.jsonl", i, r) for i, r in enumerate(recs[k:k + 1000], k)] for k in range(0, n, 1000)]
    times = {}
    for name, opts in (("--eos always --turns cleaned", {"eos": "always", "turns": "cleaned"}), ("TRL's rule", {})):
        enc = Encoder(PackOptions(inputs=("x.jsonl",), **opts))
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for c in chunks:
                enc.encode(c)
            best = min(best, time.perf_counter() - t)
        times[name] = best
        print(f"{name:30s} {best:.2f} s for {n:,} records")
    trl, old = times["TRL's rule"], times["--eos always --turns cleaned"]
    print(f"ratio: {trl / old:.2f}x")


if __name__ == "__main__":
    main()
