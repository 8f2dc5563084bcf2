"""Run the fast tier N times, each with its own Hypothesis seed, and count failures, hangs and time.

    python tools/seeds.py                 # 20 runs, seeds 1..20, one at a time
    python tools/seeds.py --runs 5 --first 100 --limit 300 -- -x   # extra pytest arguments after --

Each run is a whole `pytest -m "not slow"` process with `--hypothesis-seed=K` under the "dev" profile (exploring,
not derandomized). A run that passes its time limit (--limit, default 240 s) is killed with its process group and
counted as a hang. Exit status 0 only when every run passed. The last line is the summary, e.g.::

    seeds 1..20: 20 runs, 0 failed, 0 hung; wall min 78 s, median 81 s, max 90 s
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(seed: int, limit: float, extra: list[str]) -> tuple[str, float, str]:
    env = dict(os.environ, HYPOTHESIS_PROFILE="dev")
    env.pop("CI", None)
    cmd = [sys.executable, "-m", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider",
           f"--hypothesis-seed={seed}", *extra]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "hung", time.monotonic() - t0, out
    wall = time.monotonic() - t0
    return ("passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})"), wall, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--first", type=int, default=1, help="the first seed (then first+1, ...)")
    ap.add_argument("--limit", type=float, default=240.0, help="seconds before a run counts as hung")
    ap.add_argument("extra", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args()
    walls, failed, hung = [], 0, 0
    for seed in range(args.first, args.first + args.runs):
        outcome, wall, out = one(seed, args.limit, args.extra)
        walls.append(wall)
        tail = out.strip().splitlines()[-1] if out.strip() else ""
        print(f"seed {seed}: {outcome} in {wall:.0f} s  {tail}", flush=True)
        if outcome == "hung":
            hung += 1
        elif outcome != "passed":
            failed += 1
            print("\n".join(line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))), flush=True)
    last = args.first + args.runs - 1
    print(f"seeds {args.first}..{last}: {args.runs} runs, {failed} failed, {hung} hung; wall min {min(walls):.0f} s, "
          f"median {statistics.median(walls):.0f} s, max {max(walls):.0f} s")
    return 1 if failed or hung else 0


if __name__ == "__main__":
    sys.exit(main())
