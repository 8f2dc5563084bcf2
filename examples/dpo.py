"""DPO on packed preference pairs with a tiny random Llama, on CPU: policy + frozen reference, no padding.

    # pack the first 120 pairs of ../shared/preference/dpo_zh_demo.json with `packstream pack --pairs`, then train:
    python examples/dpo.py out/dpo-pairs --make-demo 120
    # or train on any folder packed with --pairs (local or fsspec URL), with another loss:
    python examples/dpo.py out/dpo-pairs --steps 30 --loss simpo

One forward of the policy over a packed batch gives every sequence's completion log-prob
(``packers.sequence_logps``: chosen and rejected sides sit next to each other in one row); one
no-grad forward of the frozen reference over the *same* batch gives the reference log-probs. From
the same outputs:

* DPO   ``-logsigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))``          (Rafailov et al., 2023)
* ORPO  ``NLL(chosen) - lam * logsigmoid(log_odds(mean_c) - log_odds(mean_r))``, no reference
        (Hong et al., 2024; ``log_odds(p) = log p - log(1 - p)`` of the length-normalised probability)
* SimPO ``-logsigmoid(beta * (mean_c - mean_r) - gamma)``, no reference       (Meng et al., 2024)

Each optimizer step holds about ``--pairs-per-step`` pairs (``Batching(batch_by="examples")`` counts pairs in a
run of pairs), in micro-batches of ``--rows-per-forward`` rows; a step's loss is the mean
over its pairs (each micro-batch's sum divided by the step's pair count). The packing guard checks
both models. Token ids are folded into a small vocabulary as in examples/train_tiny.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from packers import Batching, Collator, PackedDataset, Sampling, install_packing_guard, sequence_logps  # noqa: E402
from train_tiny import FoldThenCollate, VocabFold, tiny_llama  # noqa: E402

DEMO = ROOT.parent / "shared" / "preference" / "dpo_zh_demo.json"


def make_demo(folder: Path, n: int, budget: int) -> None:
    """Pack the first ``n`` pairs of the LLaMA-Factory ranking-form demo with ``packstream pack --pairs``."""
    if not DEMO.exists():
        sys.exit(f"--make-demo: {DEMO} not found")
    with tempfile.TemporaryDirectory() as tmp:
        subset = Path(tmp) / "dpo_zh_demo.json"
        subset.write_text(json.dumps(json.loads(DEMO.read_text(encoding="utf-8"))[:n], ensure_ascii=False))
        cmd = [sys.executable, "-m", "pipeline.cli", "pack", str(subset), "--pairs", "--long", "truncate",
               "--max-tokens", str(budget), "--output", str(folder), "--quiet"]
        print("$ packstream " + " ".join(cmd[3:]))
        subprocess.run(cmd, check=True, cwd=ROOT)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for x < 0, accurate near 0 (Maechler 2012)."""
    return torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_losses(kind: str, lp, ref, *, beta: float, lam: float, gamma: float) -> torch.Tensor:
    """Per-pair loss terms ([P]) of DPO, ORPO or SimPO from :class:`packers.SequenceLogps` of the policy (``lp``)
    and the reference (``ref``, DPO only), all from the same packed batch."""
    if kind == "dpo":
        return -F.logsigmoid(beta * ((lp.chosen - ref.chosen) - (lp.rejected - ref.rejected)))
    if kind == "orpo":
        mc, mr = lp.chosen_mean.clamp(max=-1e-6), lp.rejected_mean.clamp(max=-1e-6)
        log_odds = (mc - mr) - (log1mexp(mc) - log1mexp(mr))
        nll = -lp.chosen_mean  # length-normalised NLL of the chosen side, as ORPO's SFT term
        return nll - lam * F.logsigmoid(log_odds)
    if kind == "simpo":
        return -F.logsigmoid(beta * (lp.chosen_mean - lp.rejected_mean) - gamma)
    raise ValueError(kind)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("pairs", help="a folder packed with packstream pack --pairs (local or fsspec URL)")
    p.add_argument("--make-demo", type=int, metavar="N", help="first pack N pairs of dpo_zh_demo.json into it")
    p.add_argument("--budget", type=int, default=2048, help="row budget for --make-demo")
    p.add_argument("--loss", default="dpo", choices=["dpo", "orpo", "simpo"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--pairs-per-step", type=int, default=8)
    p.add_argument("--rows-per-forward", type=int, default=1, help="micro-batch size (gradient accumulation)")
    p.add_argument("--beta", type=float, default=None, help="[dpo: 0.1, simpo: 2.0]")
    p.add_argument("--lam", type=float, default=0.1, help="ORPO's weight of the odds-ratio term")
    p.add_argument("--gamma", type=float, default=0.5, help="SimPO's target margin")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    beta = args.beta if args.beta is not None else {"dpo": 0.1, "simpo": 2.0, "orpo": 0.0}[args.loss]

    if args.make_demo:
        make_demo(Path(args.pairs), args.make_demo, args.budget)
    ds = PackedDataset(args.pairs, sampling=Sampling(seed=0),
                       batching=Batching(batch_by="examples", batch_size=args.pairs_per_step))
    if not ds.manifest.row_checks.pairs:
        sys.exit(f"{args.pairs} holds no preference pairs; pack it with packstream pack --pairs")
    collate = FoldThenCollate(VocabFold(ds, args.vocab), Collator())
    policy = tiny_llama(args.vocab, ds.budget, args.attn).train()
    reference = copy.deepcopy(policy).eval().requires_grad_(False)  # the frozen starting point
    install_packing_guard(policy, max_length=ds.budget)
    install_packing_guard(reference, max_length=ds.budget)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    print(f"{len(ds.rows)} rows, {int(ds.num_examples.sum())} pairs, {len(ds)} steps/epoch of "
          f"~{args.pairs_per_step} pairs; loss {args.loss}")

    history, step = [], 0
    while step < args.steps:
        for rows in ds:
            micro = [rows[i:i + args.rows_per_forward] for i in range(0, len(rows), args.rows_per_forward)]
            n_pairs = sum(int(len(r["sides"])) // 2 for r in rows)
            opt.zero_grad()
            total = correct = 0.0
            for part in micro:
                batch = collate(part)
                lp = sequence_logps(policy(**batch).logits, batch)
                ref = None
                if args.loss == "dpo":
                    with torch.no_grad():
                        ref = sequence_logps(reference(**batch).logits, batch)
                losses = pair_losses(args.loss, lp, ref, beta=beta, lam=args.lam, gamma=args.gamma)
                (losses.sum() / n_pairs).backward()
                total += float(losses.detach().sum())
                margin = (lp.chosen - lp.rejected) - ((ref.chosen - ref.rejected) if ref is not None else 0.0)
                correct += float((margin > 0).sum())
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            history.append(total / n_pairs)
            if step % 5 == 0 or step == args.steps - 1:
                print(f"step {step:3d}  {args.loss} loss {total / n_pairs:.4f}  pairs {n_pairs}  "
                      f"chosen preferred {correct / n_pairs:.0%}")
            step += 1
            if step >= args.steps:
                break
    first, last = sum(history[:3]) / min(3, len(history)), sum(history[-3:]) / min(3, len(history))
    print(f"{args.loss} loss: first 3 steps {first:.4f} -> last 3 steps {last:.4f}")
    return {"first": first, "last": last, "history": history}


if __name__ == "__main__":
    main()
