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

Scaling with cores (``--cores``)::

    python bench/bench_scale.py --cores [--workers 1 2] [--dask-workers 1 2] [--scales 3 6]
                                [--repeats 3] [--json F] [--md F] [--mix FILE]

``packstream pack --workers N --tokenizer-threads 1`` for each N, and packstream on a Dask
``LocalCluster`` of N worker processes of one thread each (``--tokenizer-threads 1``), as whole
processes, run alternately (the order reversed every other repeat). Each run is traced
(``PACKSTREAM_TRACE``, :mod:`pipeline._trace`), so besides the wall time it reports where the CPU
time went: the launcher before the job, each worker's start-up (Python, Beam, the tokenizer), the
read tasks (the Python thread and the tokenizer apart), packing, writing, the commit. From that
it models the run on a quiet machine with a core per worker (stages run one after the other, each
as long as its busiest worker), and gives the serial fraction (Karp-Flatt: the ``e`` that Amdahl's
law ``S(N) = 1 / (e + (1 - e) / N)`` needs to give the speed-up seen) from the wall times and from
the model, and the speed-ups it predicts at 16 and 64 workers. Every run of one scale must give
the same shards (their sha256 in the manifests), or the bench fails. Nothing is downloaded: the
mix is built from ``--data`` (``../shared/data``), or ``--mix`` names any JSONL.
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
from typing import Optional, Sequence

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


def _watch_peak_rss(pid: int, also: Sequence[int] = ()):
    """Poll the peak RSS of ``pid``'s process tree (plus the trees of ``also``) every 50 ms in a thread; returns
    ``(peak, stop)``: ``peak[0]`` holds the peak so far, ``stop()`` ends the polling."""
    peak = [0]
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(pid) + sum(_tree_rss(p) for p in also))
            done.wait(0.05)

    th = threading.Thread(target=poll, daemon=True)
    th.start()

    def stop() -> None:
        done.set()
        th.join()

    return peak, stop


def run_measured(cmd: list[str], env: dict | None = None, also: Sequence[int] = ()) -> dict:
    """Run ``cmd``; wall seconds, peak RSS of its process tree (plus the trees of the pids ``also``),
    and its last stdout line parsed as JSON if it is."""
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    peak, stop = _watch_peak_rss(proc.pid, also)
    out, err = proc.communicate()
    wall = time.perf_counter() - t
    stop()
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


def compiled() -> None:
    """The package's bytecode compiled, as ``pip install`` leaves it, and the runs allowed to use it: a checkout run
    with ``PYTHONDONTWRITEBYTECODE`` set compiles ~80 modules from source in every process (~0.13 s each time)."""
    import compileall

    for pkg in ("pipeline", "packers"):
        compileall.compile_dir(str(ROOT / pkg), quiet=1)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--scales", type=int, nargs="+", default=None, help="[default: 1 6 30; --cores: 3 6]")
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--paths", nargs="+", default=["raw", "trl", "ps1", "ps2", "ps", "dask"])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--workdir", default=None, help="where the mixes and outputs go [default: a temp folder]")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--cores", action="store_true", help="scaling with workers, the tokenizer pinned (see above)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="--cores: packstream --workers values")
    p.add_argument("--dask-workers", type=int, nargs="*", default=None,
                   help="--cores: Dask worker processes [default: as --workers]; none to skip Dask")
    p.add_argument("--md", default=None, help="--cores: also write the tables to this markdown file")
    p.add_argument("--mix", default=None, help="--cores: this JSONL instead of the shared mix (scales ignored)")
    args = p.parse_args(argv)
    compiled()
    data = Path(args.data)
    if not args.mix and not (data / "gsm8k" / "train.jsonl").exists():
        sys.exit(f"no data at {data}; pass --data")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.scales is None:
        args.scales = [3, 6] if args.cores else [1, 6, 30]
    if args.cores:
        if args.dask_workers is None:
            args.dask_workers = list(args.workers)
        if args.mix:
            args.scales = [1]
        results = run_cores(args, data, work)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        if args.md:
            Path(args.md).write_text("\n\n".join("\n".join(cores_table(r)) for r in results) + "\n")
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
        return
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


# ---------------------------------------------------------------------------------------
# --cores: scaling with workers, the tokenizer pinned to one thread per worker

PINNED = {"RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _cpu_of(pids: Sequence[int]) -> dict[int, float]:
    import psutil

    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return out


def run_traced(cmd: list[str], env: dict, trace: Path, also: Sequence[int] = ()) -> dict:
    """Run ``cmd`` with ``PACKSTREAM_TRACE=trace``: wall seconds, CPU seconds of its whole process tree
    (from the kernel's accounting of the reaped tree) plus those of the processes ``also`` over the run,
    peak RSS, and the trace's spans."""
    sys.path.insert(0, str(ROOT))
    from pipeline import _trace

    shutil.rmtree(trace, ignore_errors=True)
    trace.mkdir(parents=True)
    before = _cpu_of(also)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, "PACKSTREAM_TRACE": str(trace)}, cwd=ROOT)
    peak, stop = _watch_peak_rss(proc.pid, also)
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)  # the tree's CPU: the child and every descendant it reaped
    wall = time.perf_counter() - t
    proc.returncode = os.waitstatus_to_exitcode(status)
    stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{err[-3000:]}")
    after = _cpu_of(also)
    cpu = usage.ru_utime + usage.ru_stime + sum(after[p] - before.get(p, 0.0) for p in after)
    return {"seconds": wall, "cpu": cpu, "peak_rss": peak[0], "spans": _trace.read(str(trace))}


def _profile(spans: list[dict], workers: int) -> dict:
    """Where a run's CPU time went (seconds), and the run it models on a quiet machine with a core per worker.

    Stages run one after another (each waits for the last one's busiest worker): the model is the
    launcher before the job + the slowest worker's start-up + the busiest worker at encoding, at
    packing, at writing + the commit. One worker with a spare core overlaps its Python thread with
    the tokenizer's, so its encoding counts as the longer of the two; with a core per worker
    nothing overlaps and a worker's encoding counts as its CPU time.
    """
    per: dict[str, dict[int, float]] = {}
    tok = py = 0.0
    counts: dict[str, int] = {}
    launch = job_cpu = 0.0
    launcher = {sp["pid"] for sp in spans if sp["span"] == "launch"}
    for sp in spans:
        name, pid, cpu = sp["span"], sp["pid"], sp["cpu"]
        counts[name] = counts.get(name, 0) + 1
        if name == "launch":
            launch += sp["info"].get("process_cpu", 0.0)
        elif name.startswith("launch_"):
            launch += cpu
        elif name == "encode_setup" and pid not in launcher:
            # A worker's CPU time until its first tokenizer is ready: the process, Beam (or Dask), the tokenizer.
            per.setdefault("startup", {}).setdefault(pid, sp["info"].get("process_cpu", cpu))
        elif name == "encode_task":
            py += sp["thread_cpu"]
            tok += cpu - sp["thread_cpu"]
            overlapped = max(sp["thread_cpu"], cpu - sp["thread_cpu"]) if workers == 1 else cpu
            per.setdefault("encode", {})[pid] = per.get("encode", {}).get(pid, 0.0) + overlapped
        elif name == "job" and pid in launcher:
            job_cpu += cpu
        elif name in ("cut_tasks", "pack_group", "write_shard", "finalize"):
            key = {"cut_tasks": "cut", "pack_group": "pack", "write_shard": "write", "finalize": "finalize"}[name]
            per.setdefault(key, {})[pid] = per.get(key, {}).get(pid, 0.0) + cpu
    total = {k: sum(v.values()) for k, v in per.items()}
    busiest = {k: max(v.values()) for k, v in per.items()}
    model = launch + sum(busiest.values())
    in_launcher = sum(sp["cpu"] for sp in spans if sp["pid"] in launcher and sp["span"] in _WORK)
    spent = launch + sum(total.get(k, 0.0) for k in ("startup", "cut", "pack", "write", "finalize")) + py + tok
    runner = max(0.0, job_cpu - in_launcher)
    # CPU accounting: what no number of workers shortens (the launcher before the job, its coordination, cutting
    # the inputs into tasks, the commit, and the biggest packing group and shard: one worker each) against the rest.
    items = {k: [sp["cpu"] for sp in spans if sp["span"] == k] for k in ("pack_group", "write_shard")}
    floor = sum(max(v, default=0.0) for v in items.values())
    serial = launch + runner + total.get("cut", 0.0) + total.get("finalize", 0.0) + floor
    parallel = max(0.0, spent - launch - total.get("cut", 0.0) - total.get("finalize", 0.0) - floor)
    return {"launch": launch, "total": total, "busiest": busiest, "model_s": model, "spent": spent,
            "serial_cpu": serial, "parallel_cpu": parallel,
            "serial_fraction_cpu": serial / (serial + parallel) if serial + parallel else None,
            "runner": runner,
            "encode_python": py, "encode_tokenizer": tok, "tasks": counts.get("encode_task", 0),
            "groups": counts.get("pack_group", 0), "shards": counts.get("write_shard", 0),
            "processes": len({sp["pid"] for sp in spans})}


_WORK = ("cut_tasks", "encode_setup", "encode_task", "pack_group", "write_shard", "finalize")


def karp_flatt(speedup: float, n: int) -> Optional[float]:
    """The serial fraction e for which Amdahl's law gives ``speedup`` on ``n`` workers (None for n = 1)."""
    if n <= 1 or speedup <= 0:
        return None
    return (1 / speedup - 1 / n) / (1 - 1 / n)


def amdahl(e: float, n: int) -> float:
    return 1 / (e + (1 - e) / n)


def _shards_of(out: Path) -> list[tuple[str, str]]:
    manifest = json.loads((out / "manifest.json").read_text())
    return [(s["name"], s["sha256"]) for s in manifest["shards"]]


def _core_run(kind: str, n: int, mix: Path, work: Path, budget: int) -> dict:
    out = work / f"out-{kind}{n}"
    shutil.rmtree(out, ignore_errors=True)
    trace = work / f"trace-{kind}{n}"
    args = ["--tokenizer-threads", "1"]
    env = {**os.environ, **PINNED}
    if kind == "ps":
        r = run_traced(packstream_cmd(mix, out, budget, ["--workers", str(n), *args]), env, trace)
    else:
        import distributed

        saved = {k: os.environ.get(k) for k in (*PINNED, "PACKSTREAM_TRACE")}
        os.environ.update(PINNED, PACKSTREAM_TRACE=str(trace))  # the cluster's workers inherit it
        try:
            with distributed.LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                          dashboard_address=None) as cluster:
                pids = [w.pid for w in cluster.workers.values() if getattr(w, "pid", None)]
                r = run_traced(packstream_cmd(mix, out, budget, [
                    *args, "--runner=DaskRunner", f"--dask_client_address={cluster.scheduler_address}"]),
                    env, trace, also=pids)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    measured = _measured_output(r, out)
    profile = _profile(r["spans"], n)
    profile["other"] = max(0.0, r["cpu"] - profile["spent"] - profile["runner"])  # gRPC, Beam's harness, Dask
    return {**measured, "cpu": r["cpu"], "profile": profile, "shards": _shards_of(out)}


def run_cores(args, data: Path, work: Path) -> list[dict]:
    import platform

    runs_of = [("ps", n) for n in args.workers] + [("dask", n) for n in args.dask_workers]
    results = []
    print(f"--cores: {os.cpu_count()} cores ({platform.processor() or platform.machine()}); budget {args.budget}; "
          f"tokenizer pinned to 1 thread per worker; repeats {args.repeats} (median); work dir {work}", flush=True)
    for scale in args.scales:
        mix = Path(args.mix) if args.mix else work / f"mix-{scale}x.jsonl"
        n = build_mix(data, scale, mix) if not args.mix else sum(1 for _ in open(mix, "rb"))
        runs: dict[str, list[dict]] = {f"{k}{w}": [] for k, w in runs_of}
        for rep in range(args.repeats):
            for kind, w in (runs_of if rep % 2 == 0 else runs_of[::-1]):
                r = _core_run(kind, w, mix, work, args.budget)
                runs[f"{kind}{w}"].append(r)
                print(f"  {scale}x {kind} x{w}: {r['seconds']:.2f} s wall, {r['cpu']:.2f} s CPU, "
                      f"model {r['profile']['model_s']:.2f} s", flush=True)
        shards = {json.dumps(r["shards"]) for rs in runs.values() for r in rs}
        if len(shards) != 1:
            raise SystemExit(f"{scale}x: the runs wrote different shards: {sorted(shards)}")
        row = {"scale": scale, "records": n, "bytes": mix.stat().st_size, "cores": os.cpu_count(), "runs": {}}
        for label, rs in runs.items():
            secs = statistics.median(r["seconds"] for r in rs)
            model = statistics.median(r["profile"]["model_s"] for r in rs)
            mid = min(rs, key=lambda x: abs(x["profile"]["model_s"] - model))
            row["runs"][label] = {"seconds": secs, "all_seconds": [r["seconds"] for r in rs],
                                  "cpu": statistics.median(r["cpu"] for r in rs), "model_s": model,
                                  "peak_rss": mid["peak_rss"], "tokens": mid["tokens"], "rows": mid["rows"],
                                  "profile": mid["profile"]}
        for kind in ("ps", "dask"):
            base = row["runs"].get(f"{kind}1")
            for label, r in row["runs"].items():
                if not label.startswith(kind) or base is None:
                    continue
                w = int(label[len(kind):])
                r["speedup"] = base["seconds"] / r["seconds"]
                r["speedup_model"] = base["model_s"] / r["model_s"]
                r["serial_fraction"] = karp_flatt(r["speedup"], w)
                r["serial_fraction_model"] = karp_flatt(r["speedup_model"], w)
                r["serial_fraction_cpu"] = r["profile"]["serial_fraction_cpu"]
                for e_key, pred in (("serial_fraction", "predicted"), ("serial_fraction_model", "predicted_model"),
                                    ("serial_fraction_cpu", "predicted_cpu")):
                    e = r[e_key]
                    if e is not None:
                        r[pred] = {str(k): amdahl(max(e, 0.0), k) for k in (16, 64)}
        results.append(row)
        _print_cores(row)
        if not args.mix:
            mix.unlink()
    return results


def _fmt(x: Optional[float], spec: str) -> str:
    return "" if x is None else format(x, spec)


def cores_table(row: dict) -> list[str]:
    """Markdown lines for one scale of ``--cores``."""
    lines = [f"{row['scale']}x: {row['records']:,} records, {row['bytes'] / 2**20:,.1f} MiB of JSONL, "
             f"{row['cores']} cores, tokenizer pinned to 1 thread per worker",
             "",
             "| run | wall s (median) | speed-up | serial fraction | predicted 16 / 64 | model s | model speed-up "
             "| serial fraction (model) | predicted 16 / 64 (model) | serial CPU s / all | serial fraction (CPU) "
             "| predicted 16 / 64 (CPU) | CPU s | peak RSS MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in row["runs"].items():
        pred = r.get("predicted") or {}
        predm = r.get("predicted_model") or {}
        predc = r.get("predicted_cpu") or {}
        p = r["profile"]
        lines.append(
            f"| {label} | {r['seconds']:.2f} | {_fmt(r.get('speedup'), '.2f')}x | {_fmt(r.get('serial_fraction'), '.3f')} "
            f"| {_fmt(pred.get('16'), '.1f')} / {_fmt(pred.get('64'), '.1f')} | {r['model_s']:.2f} "
            f"| {_fmt(r.get('speedup_model'), '.2f')}x | {_fmt(r.get('serial_fraction_model'), '.3f')} "
            f"| {_fmt(predm.get('16'), '.1f')} / {_fmt(predm.get('64'), '.1f')} "
            f"| {p['serial_cpu']:.2f} / {p['serial_cpu'] + p['parallel_cpu']:.2f} | {_fmt(p.get('serial_fraction_cpu'), '.3f')} "
            f"| {_fmt(predc.get('16'), '.1f')} / {_fmt(predc.get('64'), '.1f')} | {r['cpu']:.1f} "
            f"| {r['peak_rss'] / 2**20:,.0f} |")
    lines += ["", "Serial CPU: what no number of workers shortens: the launcher before the job, its coordination while "
              "the job runs, cutting the inputs into read tasks, the commit, and the biggest packing group and the "
              "biggest shard (one worker each); the serial fraction (CPU) is its share of the CPU time the run spent "
              "in its stages, and the predictions are Amdahl's law from it."]
    lines += ["", "Where the CPU time went (seconds, the median run by model; the busiest worker in brackets): the "
              "launcher before the job (Python, Beam, the tokenizer, the run context); a worker's start-up until its "
              "tokenizer is ready; the read tasks (this job's Python thread + the rest of the process: the "
              "tokenizer); packing the groups; writing the shards; the commit; the launcher coordinating the "
              "job (runner); everything else (other: gRPC and Beam's harness in workers, Dask's own work).", "",
              "| run | launcher | start-up / worker | encode: Python + tokenizer | tasks | pack (groups) | write (shards) "
              "| commit | runner | other | processes |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, r in row["runs"].items():
        p = r["profile"]
        t, b = p["total"], p["busiest"]
        lines.append(
            f"| {label} | {p['launch']:.2f} | {b.get('startup', 0):.2f} | {p['encode_python']:.2f} + "
            f"{p['encode_tokenizer']:.2f} [{b.get('encode', 0):.2f}] | {p['tasks']} | {t.get('pack', 0):.2f} "
            f"({p['groups']}) [{b.get('pack', 0):.2f}] | {t.get('write', 0):.2f} ({p['shards']}) "
            f"| {t.get('finalize', 0):.2f} | {p['runner']:.2f} | {p['other']:.2f} | {p['processes']} |")
    return lines


def _print_cores(row: dict) -> None:
    print()
    print("\n".join(cores_table(row)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
