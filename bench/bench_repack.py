"""``packstream repack`` against ``packstream pack`` at a new budget, as whole processes: speed, sameness, memory.

    python bench/bench_repack.py [--data ../shared/data] [--scale 6] [--from 4096] [--to 8192] [--repeats 3]
                                 [--workers N] [--long drop|split] [--memory-scales 1 6 12] [--no-pack-memory]
                                 [--no-trace] [--workdir DIR] [--json FILE]

The input is ``bench/bench_scale.py``'s mix of ``../shared/data`` (gsm8k + GPTeacher codegen + the T0 sample,
16,211 records), replicated ``k`` times with distinct ids (``build_mix``). Every command is the CLI in its own
process (``python -m pipeline.cli``, as ``packstream``), timed from start to exit, its peak RSS the sum over its
process tree sampled every 50 ms (``bench_scale.run_measured``); all get the same ``--workers`` (default: the CLI's
own auto).

1. **Speed** on the ``--scale`` mix from ``--from`` to ``--to``:

   * ``pack``   ``packstream pack MIX -o P_TO --max-tokens TO -q``: what a user runs without repack;
   * ``repack`` ``packstream repack P_FROM -o R_TO --max-tokens TO -q``, where ``P_FROM`` is
     ``packstream pack MIX -o P_FROM --max-tokens FROM -q``, packed once beforehand (setup, not timed).

   They run alternately ``--repeats`` times (pack, repack, pack, repack, ...), each output folder removed before
   its run; the median wall time of each is kept and the ratio pack/repack printed (the bar: 20x). Then
   ``R_TO`` is compared with ``P_TO``: the manifests' ``counts`` and the shards' sha256. They are byte-identical
   exactly when the first pack cut nothing (``dropped_too_long``, ``truncated_examples`` and ``split_examples``
   of ``P_FROM`` all 0); the real mix has records longer than 4096 tokens, so the table says what the first pack
   dropped or cut, which is the whole difference, and the bench does not fail on it. With ``--long split`` every
   pack gets ``--long split``: the first one drops nothing and the repack carries the pieces (``<id>#k``, never
   joined back, so still not pack's bytes); at 8192 the mix has nothing to split, so ``P_TO`` is as without it.

2. **Memory** across ``--memory-scales``: for each k, the k-x mix is packed at ``FROM`` (setup), then the peak RSS
   of ``packstream repack ... --max-tokens TO`` is measured, and the ratio of the largest scale to the smallest
   printed (the bar: 1.25x, memory bounded by a part, not by the input). For comparison the same for ``pack`` at
   ``TO`` (``--no-pack-memory`` skips it: a 12x pack takes about half a minute on 2 cores). A scale equal to
   ``--scale`` reuses the speed runs.

3. **Where a repack's time goes** (``--no-trace`` skips it): one more repack with ``PACKSTREAM_TRACE``
   (:mod:`pipeline._trace`), summarized by span (wall and CPU seconds, processes), with the time before the
   first span (interpreter and imports) and after the last (exit), and the median start-up of
   ``packstream repack --help`` (the interpreter and the CLI's imports): what bounds the ratio on a small machine.

Prints markdown tables and the command that reproduces them; ``--json FILE`` also writes the results. The
working files (mixes, packed folders, traces) go under ``--workdir`` (default: a temp folder, removed at the end),
never into the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from bench_scale import PACKSTREAM, build_mix, compiled, run_measured  # noqa: E402

CUT = ("dropped_too_long", "truncated_examples", "split_examples", "no_target_pieces")


def _common(args) -> list[str]:
    extra = ["-q", "--overwrite"]
    if args.workers is not None:
        extra += ["--workers", str(args.workers)]
    return extra


def pack(args, mix: Path, out: Path, budget: int, env: Optional[dict] = None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    long = ["--long", args.long] if args.long else []
    return run_measured([*PACKSTREAM, "pack", str(mix), "-o", str(out), "--max-tokens", str(budget), *long,
                         *_common(args)], env=env)


def repack(args, folder: Path, out: Path, budget: int, env: Optional[dict] = None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    return run_measured([*PACKSTREAM, "repack", str(folder), "-o", str(out), "--max-tokens", str(budget),
                         *_common(args)], env=env)


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def compare(first: Path, repacked: Path, packed: Path) -> dict:
    """``repacked`` against ``packed``: same counts, same shards; and what ``first`` (the folder repacked) cut."""
    m1, mr, mp = manifest(first), manifest(repacked), manifest(packed)
    differing = sorted(k for k in set(mr["counts"]) | set(mp["counts"]) if mr["counts"].get(k) != mp["counts"].get(k))
    shards_r = [(s["name"], s["sha256"]) for s in mr["shards"]]
    shards_p = [(s["name"], s["sha256"]) for s in mp["shards"]]
    return {"identical": not differing and shards_r == shards_p, "counts_equal": not differing,
            "shards_equal": shards_r == shards_p, "differing_counts": {k: [mr["counts"].get(k), mp["counts"].get(k)]
                                                                      for k in differing},
            "first_pack_cut": {k: m1["counts"].get(k, 0) for k in CUT},
            "first_pack_dropped_tokens": m1["counts"].get("dropped_too_long_tokens", 0),
            "rows": {"repack": mr["counts"]["rows"], "pack": mp["counts"]["rows"]},
            "tokens": {"repack": mr["counts"]["tokens"], "pack": mp["counts"]["tokens"]}}


def speed(args, data: Path, work: Path) -> dict:
    mix = work / f"mix-{args.scale}x.jsonl"
    n = build_mix(data, args.scale, mix)
    first, p_to, r_to = work / f"p{args.from_}-{args.scale}x", work / f"p{args.to}-{args.scale}x", work / f"r{args.to}-{args.scale}x"
    print(f"{args.scale}x: {n:,} records, {mix.stat().st_size / 2**20:,.1f} MiB; setup: pack at {args.from_}", flush=True)
    setup = pack(args, mix, first, args.from_)
    runs: dict[str, list[dict]] = {"pack": [], "repack": []}
    for i in range(args.repeats):
        runs["pack"].append(pack(args, mix, p_to, args.to))
        runs["repack"].append(repack(args, first, r_to, args.to))
        print(f"  repeat {i + 1}: pack {runs['pack'][-1]['seconds']:.2f} s, repack {runs['repack'][-1]['seconds']:.2f} s",
              flush=True)
    out = {"scale": args.scale, "records": n, "bytes": mix.stat().st_size, "setup_pack_seconds": setup["seconds"],
           "setup_pack_peak_rss": setup["peak_rss"]}
    for name, rs in runs.items():
        med = statistics.median(r["seconds"] for r in rs)
        out[name] = {"seconds": med, "all_seconds": [r["seconds"] for r in rs],
                     "peak_rss": max(r["peak_rss"] for r in rs)}
    out["ratio"] = out["pack"]["seconds"] / out["repack"]["seconds"]
    out["compare"] = compare(first, r_to, p_to)
    mix.unlink()
    return out


def memory(args, data: Path, work: Path, reuse: Optional[dict]) -> list[dict]:
    rows = []
    for k in sorted(set(args.memory_scales)):
        if reuse and k == reuse["scale"]:
            rows.append({"scale": k, "records": reuse["records"], "repack_peak_rss": reuse["repack"]["peak_rss"],
                         "repack_seconds": reuse["repack"]["seconds"],
                         "pack_peak_rss": reuse["pack"]["peak_rss"] if args.pack_memory else None,
                         "pack_seconds": reuse["pack"]["seconds"] if args.pack_memory else None})
            print(f"  memory {k}x: reused the speed runs", flush=True)
            continue
        mix = work / f"mix-{k}x.jsonl"
        n = build_mix(data, k, mix)
        first, r_to, p_to = work / f"mem-p{args.from_}-{k}x", work / f"mem-r{args.to}-{k}x", work / f"mem-p{args.to}-{k}x"
        pack(args, mix, first, args.from_)
        r = repack(args, first, r_to, args.to)
        row = {"scale": k, "records": n, "repack_peak_rss": r["peak_rss"], "repack_seconds": r["seconds"],
               "pack_peak_rss": None, "pack_seconds": None}
        shutil.rmtree(r_to, ignore_errors=True)
        if args.pack_memory:
            p = pack(args, mix, p_to, args.to)
            row.update(pack_peak_rss=p["peak_rss"], pack_seconds=p["seconds"])
            shutil.rmtree(p_to, ignore_errors=True)
        shutil.rmtree(first, ignore_errors=True)
        mix.unlink()
        rows.append(row)
        print(f"  memory {k}x: repack {r['peak_rss'] / 2**20:,.0f} MiB"
              + (f", pack {row['pack_peak_rss'] / 2**20:,.0f} MiB" if row["pack_peak_rss"] else ""), flush=True)
    return rows


def trace(args, work: Path) -> dict:
    """One traced repack of the speed run's first folder, and the CLI's start-up (``repack --help``)."""
    from pipeline import _trace

    first = work / f"p{args.from_}-{args.scale}x"
    folder = work / "trace"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    t0 = time.time()
    r = repack(args, first, work / "r-traced", args.to, env={**os.environ, _trace.ENV: str(folder)})
    t1 = t0 + r["seconds"]
    spans = _trace.read(str(folder))
    by: dict[str, dict] = {}
    for sp in spans:
        b = by.setdefault(sp["span"], {"count": 0, "wall": 0.0, "cpu": 0.0, "pids": set(), "start": sp["start"],
                                       "end": 0.0, "wall_by_pid": {}})
        b["count"] += 1
        b["wall"] += sp["wall"]
        b["cpu"] += sp["cpu"]
        b["pids"].add(sp["pid"])
        b["end"] = max(b["end"], sp["start"] + sp["wall"])
        b["wall_by_pid"][sp["pid"]] = b["wall_by_pid"].get(sp["pid"], 0.0) + sp["wall"]
    table = {name: {"count": b["count"], "processes": len(b["pids"]), "wall_sum": b["wall"],
                    "wall_busiest_process": max(b["wall_by_pid"].values()), "cpu_sum": b["cpu"],
                    "from_start": b["start"] - t0, "to_start": b["end"] - t0}
             for name, b in by.items()}
    first_span = min(sp["start"] for sp in spans) if spans else t1
    last_end = max(sp["start"] + sp["wall"] for sp in spans) if spans else t0
    helps = []
    for _ in range(3):
        helps.append(run_measured([*PACKSTREAM, "repack", "--help"])["seconds"])
    py = statistics.median(run_measured([sys.executable, "-c", "pass"])["seconds"] for _ in range(3))
    shutil.rmtree(work / "r-traced", ignore_errors=True)
    return {"seconds": r["seconds"], "before_first_span": first_span - t0, "after_last_span": t1 - last_end,
            "spans": table, "help_seconds": statistics.median(helps), "python_seconds": py,
            "processes": len({sp["pid"] for sp in spans})}


def mib(x: Optional[float]) -> str:
    return "" if x is None else f"{x / 2**20:,.0f}"


def tables(res: dict) -> list[str]:
    a = res["args"]
    lines = []
    s = res.get("speed")
    if s:
        c = s["compare"]
        cut = ", ".join(f"{k} {v:,}" for k, v in c["first_pack_cut"].items())
        lines += [f"Speed: {s['scale']}x mix ({s['records']:,} records, {s['bytes'] / 2**20:,.1f} MiB), "
                  f"{a['from_']} -> {a['to']}, --workers {a['workers'] if a['workers'] is not None else 'auto'}"
                  f"{', --long ' + a['long'] if a['long'] else ''}, {res['cores']} cores, median of {a['repeats']}",
                  "", "| command | wall s (median) | all runs s | peak RSS MiB |", "|---|---|---|---|"]
        lines.append(f"| `pack --max-tokens {a['to']}` (from raw) | {s['pack']['seconds']:.2f} | "
                     f"{' / '.join(f'{x:.2f}' for x in s['pack']['all_seconds'])} | {mib(s['pack']['peak_rss'])} |")
        lines.append(f"| `repack --max-tokens {a['to']}` (of the {a['from_']} folder) | {s['repack']['seconds']:.2f} | "
                     f"{' / '.join(f'{x:.2f}' for x in s['repack']['all_seconds'])} | {mib(s['repack']['peak_rss'])} |")
        lines.append(f"| setup: `pack --max-tokens {a['from_']}` (not timed in the ratio) | {s['setup_pack_seconds']:.2f} "
                     f"| | {mib(s['setup_pack_peak_rss'])} |")
        lines += ["", f"pack / repack: **{s['ratio']:.1f}x** (bar: 20x: {'met' if s['ratio'] >= 20 else 'NOT met'})", ""]
        if c["identical"]:
            lines.append("Repacked output identical to pack's: same counts, same shard sha256.")
        else:
            lines.append(f"Repacked output NOT identical to pack's (shards equal: {c['shards_equal']}; counts equal: "
                         f"{c['counts_equal']}). The first pack at {a['from_']} cut: {cut} "
                         f"({c['first_pack_dropped_tokens']:,} tokens dropped), which is the difference. Rows "
                         f"repack/pack {c['rows']['repack']:,}/{c['rows']['pack']:,}, tokens "
                         f"{c['tokens']['repack']:,}/{c['tokens']['pack']:,}. Counts that differ (repack, pack): "
                         + ", ".join(f"{k} {v[0]:,}/{v[1]:,}" for k, v in c["differing_counts"].items()
                                     if isinstance(v[0], int) and isinstance(v[1], int)))
    m = res.get("memory")
    if m:
        lines += ["", f"Memory: peak RSS (process tree) across scales, {a['from_']} -> {a['to']}", "",
                  "| scale | records | repack peak RSS MiB | repack s | pack peak RSS MiB | pack s |", "|---|---|---|---|---|---|"]
        for r in m:
            lines.append(f"| {r['scale']}x | {r['records']:,} | {mib(r['repack_peak_rss'])} | {r['repack_seconds']:.2f} "
                         f"| {mib(r['pack_peak_rss'])} | {'' if r['pack_seconds'] is None else format(r['pack_seconds'], '.2f')} |")
        lo, hi = m[0], m[-1]
        ratio = hi["repack_peak_rss"] / lo["repack_peak_rss"]
        if len(m) > 1:
            lines += ["", f"repack peak RSS {hi['scale']}x / {lo['scale']}x: **{ratio:.2f}** "
                      f"(bar: 1.25: {'met' if ratio <= 1.25 else 'NOT met'})"]
        if len(m) > 1 and hi["pack_peak_rss"] and lo["pack_peak_rss"]:
            lines.append(f"pack peak RSS {hi['scale']}x / {lo['scale']}x: {hi['pack_peak_rss'] / lo['pack_peak_rss']:.2f}")
    t = res.get("trace")
    if t:
        lines += ["", f"Where one traced repack's {t['seconds']:.2f} s go ({t['processes']} processes; times from the "
                  f"command's start)", "",
                  "| span | count | processes | wall s (sum) | wall s (busiest process) | CPU s (sum) | from s | to s |",
                  "|---|---|---|---|---|---|---|---|"]
        lines.append(f"| before the first span (interpreter, imports) | | 1 | {t['before_first_span']:.2f} | | | 0.00 "
                     f"| {t['before_first_span']:.2f} |")
        for name, b in sorted(t["spans"].items(), key=lambda kv: kv[1]["from_start"]):
            lines.append(f"| {name} | {b['count']} | {b['processes']} | {b['wall_sum']:.2f} | {b['wall_busiest_process']:.2f} "
                         f"| {b['cpu_sum']:.2f} | {b['from_start']:.2f} | {b['to_start']:.2f} |")
        lines.append(f"| after the last span (exit) | | | {t['after_last_span']:.2f} | | | | {t['seconds']:.2f} |")
        lines += ["", f"Start-up: `packstream repack --help` {t['help_seconds']:.2f} s (median of 3); "
                  f"`python -c pass` {t['python_seconds']:.2f} s."]
    lines += ["", "Reproduce: `" + res["command"] + "`"]
    return lines


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--scale", type=int, default=6, help="the speed runs' mix [default: 6]")
    p.add_argument("--from", dest="from_", type=int, default=4096, help="the first pack's budget [default: 4096]")
    p.add_argument("--to", type=int, default=8192, help="the new budget [default: 8192]")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=None, help="passed to every pack and repack [default: auto]")
    p.add_argument("--long", choices=("drop", "split"), default=None, help="passed to every pack [default: pack's]")
    p.add_argument("--memory-scales", type=int, nargs="*", default=[1, 6, 12], help="none to skip [default: 1 6 12]")
    p.add_argument("--no-pack-memory", dest="pack_memory", action="store_false", help="memory: repack only")
    p.add_argument("--no-speed", dest="speed", action="store_false", help="skip the speed runs (and the trace)")
    p.add_argument("--no-trace", dest="trace", action="store_false", help="skip the traced repack")
    p.add_argument("--workdir", default=None, help="where the mixes and folders go [default: a temp folder]")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    data = Path(args.data)
    if not (data / "gsm8k" / "train.jsonl").exists():
        sys.exit(f"no data at {data}; pass --data")
    compiled()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-repack-"))
    work.mkdir(parents=True, exist_ok=True)
    argv_used = sys.argv[1:] if argv is None else list(argv)
    res: dict = {"cores": os.cpu_count(), "args": vars(args),
                 "command": shlex.join(["python", "bench/bench_repack.py", *argv_used])}
    print(f"{os.cpu_count()} cores; work dir {work}", flush=True)
    try:
        if args.speed:
            res["speed"] = speed(args, data, work)
        if args.memory_scales:
            res["memory"] = memory(args, data, work, res.get("speed"))
        if args.speed and args.trace:
            res["trace"] = trace(args, work)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print("\n".join(tables(res)))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, default=str))
    return res


if __name__ == "__main__":
    main()
