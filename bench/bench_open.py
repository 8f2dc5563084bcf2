"""What opening a folder costs: ``PackedDataset(folder)`` on a run of many shards, against a peer checkout.

    python bench/bench_open.py [--shards 256] [--rows-per-shard 40] [--repeats 5] [--peer DIR]

Writes one run of ``--shards`` small shards (tests/_shards.py, random examples at budget 512) and a
remote copy of it in fsspec's memory filesystem, then times, in this process:

* ``manifest``: reading and checking manifest.json (:func:`packers.manifest.load_manifest`: the
  checked open, the typed reader, the self-consistency checks);
* ``open``: ``PackedDataset(folder)``, everything it checks before the first batch (the manifest,
  every shard's size, schema, schema metadata against its entry, Arrow structure, row counts);
* ``open (remote, cached)``: ``PackedDataset("memory://...")`` once its shards are in the cache: each
  cached copy is hashed once per process, so the first open in a process pays sha256 of every shard
  and later ones do not (both shown);
* ``sha256``: hashing the shards once (what the first cached open, or ``verify=True``, adds).

With ``--peer DIR`` (another checkout, e.g. ``git worktree`` of main), the same folder is opened by
that checkout's loader in a subprocess, timings taken in turns with this one; the ratio is this
checkout's time over the peer's. Times are the best of ``--repeats`` (other processes only add time).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TIMER = r"""
import sys, time, json
sys.path.insert(0, sys.argv[1])
from packers import PackedDataset
folder, repeats = sys.argv[2], int(sys.argv[3])
PackedDataset(folder)  # imports, page cache
best = min((lambda t: (PackedDataset(folder), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(repeats))
print(json.dumps(best))
"""


def best_of(fn, repeats: int) -> float:
    out = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out


def timed_in(checkout: Path, folder: Path, repeats: int) -> float:
    """Best open time of ``folder`` by the loader of ``checkout``, in a fresh process."""
    got = subprocess.run([sys.executable, "-c", TIMER, str(checkout), str(folder), str(repeats)],
                         capture_output=True, text=True, check=True, cwd=checkout)
    return float(got.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=256)
    ap.add_argument("--rows-per-shard", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peer", type=Path, default=None, help="another checkout to time side by side")
    args = ap.parse_args()

    import fsspec

    from packers import PackedDataset
    from packers.manifest import load_manifest
    from tests import _shards

    tmp = Path(tempfile.mkdtemp(prefix="bench-open-"))
    folder = tmp / "run"
    budget = 512
    examples = _shards.random_examples(args.shards * args.rows_per_shard * 4, seed=0, max_len=240, vocab=1000)
    rows = _shards.pack_first_fit(examples, budget)
    _shards.write_shards(folder, rows, budget=budget, num_shards=args.shards)
    shard_bytes = sum(p.stat().st_size for p in folder.glob("*.arrow"))
    print(f"folder: {args.shards} shards, {len(rows):,} rows, {shard_bytes / 2**20:.1f} MiB, manifest "
          f"{(folder / 'manifest.json').stat().st_size / 2**10:.0f} KiB")

    fs = fsspec.filesystem("memory")
    for p in folder.iterdir():
        fs.pipe(f"/bench-open/{p.name}", p.read_bytes())
    cache = tmp / "cache"
    PackedDataset("memory://bench-open", cache_dir=str(cache))  # copies every shard into the cache

    results = {
        "manifest": best_of(lambda: load_manifest(str(folder / "manifest.json"), str(folder)), args.repeats),
        "open": best_of(lambda: PackedDataset(folder), args.repeats),
        "open (remote, cached, later opens)": best_of(
            lambda: PackedDataset("memory://bench-open", cache_dir=str(cache)), args.repeats),
        "sha256 of every shard": best_of(
            lambda: [hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.glob("*.arrow")], args.repeats),
    }
    for name, s in results.items():
        print(f"{name:38s} {s * 1000:9.1f} ms   {s * 1000 / args.shards:7.3f} ms/shard")
    if args.peer is not None:
        mine, peer = [], []
        for _ in range(3):  # in turns: a busy moment hits both
            mine.append(timed_in(ROOT, folder, args.repeats))
            peer.append(timed_in(args.peer, folder, args.repeats))
        print(json.dumps({"open_ms": round(min(mine) * 1000, 1), "peer_open_ms": round(min(peer) * 1000, 1),
                          "ratio": round(min(mine) / min(peer), 3), "peer": str(args.peer)}))
    fs.rm("/bench-open", recursive=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
