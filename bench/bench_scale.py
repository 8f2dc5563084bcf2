"""packstream at scale, as whole processes, against the TRL user's script and the raw tokenizer.

    python bench/bench_scale.py [--data ../shared/data] [--scales 1 6 30] [--budget 4096]
                                [--paths raw trl ps1 ps2 dask] [--repeats 1] [--workdir DIR]

The input is the real mix of ``../shared/data`` (gsm8k + GPTeacher codegen + the T0 sample,
16,211 records) as one alpaca JSONL (``{"id", "instruction", "input", "output"}``), replicated
``k`` times with distinct ids. Each path runs as its own process, as a user runs it:

* ``raw``  ``bench/peers/raw_tokenizer.py``: read JSONL, render ChatML, ``encode_batch_fast``,
  nothing else (no packing, no output): the ceiling for any tool;
* ``trl``  ``bench/peers/trl_user.py``: ``load_dataset("json")`` + a ChatML ``map`` that
  tokenizes + ``trl.pack_dataset(strategy="bfd")`` + ``save_to_disk``;
* ``ps1``/``ps2``  ``packstream pack MIX -o OUT -q --workers 1`` / ``--workers 2``;
* ``ps``  ``packstream pack`` with the default ``--workers`` (what a user gets);
* ``dask`` ``packstream pack --runner=DaskRunner`` on a local ``distributed`` cluster of 2 workers.

For each: wall seconds, tokens/s, peak RSS (the sum over the process and its children,
sampled every 50 ms), rows and fill; then the ratios the README quotes. Paths of one scale run
alternately (raw, trl, ps, raw, trl, ps, ...) when ``--repeats`` > 1, and the median is kept.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
PACKSTREAM = [PY, "-m", "pipeline.cli"]


def build_mix(data: Path, scale: int, out: Path) -> int:
    """Write the alpaca mix ``scale`` times over with distinct ids; returns the record count."""
    base = []
    with open(data / "gsm8k" / "train.jsonl", encoding="utf-8") as f:
        for i, line in enumerate(f):
            r = json.loads(line)
            base.append(("gsm8k", i, r["question"], "", r["answer"]))
    for i, r in enumerate(json.loads((data / "gpteacher" / "codegen-instruct.json").read_text(encoding="utf-8"))):
        base.append(("gpteacher", i, r["instruction"], r.get("input") or "", r["response"]))
    with open(data / "self_instruct" / "t0_sample_15_per_template.jsonl", encoding="utf-8") as f:
        for i, line in enumerate(f):
            r = json.loads(line)
            base.append(("t0", i, r["prompt"], "", r["completion"]))
    with open(out, "w", encoding="utf-8") as f:
        for k in range(scale):
            for src, i, ins, inp, outp in base:
                f.write(json.dumps({"id": f"{src}-{i}-{k}", "instruction": ins, "input": inp, "output": outp},
                                   ensure_ascii=False) + "\n")
    return len(base) * scale


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_measured(cmd: list[str], env: dict | None = None, also: Sequence[int] = ()) -> dict:
    """Run ``cmd``; wall seconds, peak RSS of its process tree (plus the trees of the pids ``also``),
    and its last stdout line parsed as JSON if it is."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    peak = [0]
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid) + sum(_tree_rss(p) for p in also))
            done.wait(0.05)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    out, err = proc.communicate()
    wall = time.perf_counter() - t
    done.set()
    th.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{err[-3000:]}")
    last = (out.strip().splitlines() or [""])[-1]
    try:
        info = json.loads(last)
    except ValueError:
        info = {}
    return {"seconds": wall, "peak_rss": peak[0], **info}


def packstream_cmd(mix: Path, out: Path, budget: int, extra: list[str]) -> list[str]:
    return [*PACKSTREAM, "pack", str(mix), "-o", str(out), "--max-tokens", str(budget), "--overwrite",
            "--log-format", "json", "-q", *extra]


def run_path(name: str, mix: Path, work: Path, budget: int) -> dict:
    out = work / f"out-{name}"
    shutil.rmtree(out, ignore_errors=True)
    if name == "raw":
        r = run_measured([PY, str(ROOT / "bench" / "peers" / "raw_tokenizer.py"), str(mix)])
        return r | {"rows": None, "fill": None}
    if name == "trl":
        r = run_measured([PY, str(ROOT / "bench" / "peers" / "trl_user.py"), str(mix), str(out), "--max-tokens", str(budget)])
        return r
    if name == "dask":
        return _run_dask(mix, out, budget)
    extra = {"ps": [], "ps1": ["--workers", "1"], "ps2": ["--workers", "2"]}[name]
    r = run_measured(packstream_cmd(mix, out, budget, extra))
    return _measured_output(r, out)


def _run_dask(mix: Path, out: Path, budget: int) -> dict:
    """packstream on a distributed.LocalCluster of 2 worker processes (1 thread and 1 tokenizer thread each),
    started here; the peak RSS is the launcher's plus the cluster's processes."""
    import distributed

    os.environ["RAYON_NUM_THREADS"] = "1"  # the workers inherit it: one tokenizer thread per process
    try:
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                      dashboard_address=None) as cluster:
            workers = [w.pid for w in cluster.workers.values() if getattr(w, "pid", None)]
            r = run_measured(packstream_cmd(mix, out, budget, [
                "--runner=DaskRunner", f"--dask_client_address={cluster.scheduler_address}"]), also=workers)
    finally:
        os.environ.pop("RAYON_NUM_THREADS", None)
    return _measured_output(r, out)


def _measured_output(r: dict, out: Path) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    c = manifest["counts"]
    return {"seconds": r["seconds"], "peak_rss": r["peak_rss"], "tokens": c["tokens"], "rows": c["rows"],
            "fill": c["fill"], "records": c["records_read"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--scales", type=int, nargs="+", default=[1, 6, 30])
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--paths", nargs="+", default=["raw", "trl", "ps1", "ps2", "ps", "dask"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--workdir", default=None, help="where the mixes and outputs go [default: a temp folder]")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    data = Path(args.data)
    if not (data / "gsm8k" / "train.jsonl").exists():
        sys.exit(f"no data at {data}; pass --data")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    print(f"{os.cpu_count()} cores; budget {args.budget}; repeats {args.repeats} (median); work dir {work}", flush=True)
    for scale in args.scales:
        mix = work / f"mix-{scale}x.jsonl"
        n = build_mix(data, scale, mix)
        runs: dict[str, list[dict]] = {name: [] for name in args.paths}
        for _ in range(args.repeats):
            for name in args.paths:
                runs[name].append(run_path(name, mix, work, args.budget))
        row = {"scale": scale, "records": n, "bytes": mix.stat().st_size}
        for name, rs in runs.items():
            secs = statistics.median(r["seconds"] for r in rs)
            r = min(rs, key=lambda x: abs(x["seconds"] - secs))
            row[name] = {**r, "seconds": secs, "tokens_per_s": r["tokens"] / secs if r.get("tokens") else None}
        results.append(row)
        _print_scale(row, args.paths)
        mix.unlink()
    if len(results) > 1 and all(name in results[0] for name in ("ps",)):
        lo, hi = results[0], results[-1]
        for name in args.paths:
            if name.startswith("ps") or name == "dask":
                print(f"peak RSS {name}: {hi['scale']}x / {lo['scale']}x = {hi[name]['peak_rss'] / lo[name]['peak_rss']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


def _print_scale(row: dict, paths: list[str]) -> None:
    print(f"\n{row['scale']}x: {row['records']:,} records, {row['bytes'] / 2**20:,.1f} MiB of JSONL")
    print(f"{'path':<8}{'seconds':>9}{'tokens':>13}{'tokens/s':>12}{'peak RSS MiB':>14}{'rows':>9}{'fill':>9}")
    for name in paths:
        r = row[name]
        fill = f"{r['fill']:.3%}" if r.get("fill") is not None else ""
        rows = f"{r['rows']:,}" if r.get("rows") is not None else ""
        print(f"{name:<8}{r['seconds']:>9.2f}{r['tokens']:>13,}{r['tokens_per_s']:>12,.0f}"
              f"{r['peak_rss'] / 2**20:>14,.0f}{rows:>9}{fill:>9}")
    for name in paths:
        if name.startswith("ps") or name == "dask":
            r = row[name]
            parts = []
            if "trl" in row:
                parts.append(f"{row['trl']['seconds'] / r['seconds']:.2f}x TRL")
            if "raw" in row:
                parts.append(f"{row['raw']['seconds'] / r['seconds']:.1%} of raw")
            if name == "ps2" and "ps1" in row:
                parts.append(f"{row['ps1']['seconds'] / r['seconds']:.2f}x ps1")
            print(f"  {name}: " + ", ".join(parts))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
