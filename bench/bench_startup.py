"""What ``packstream pack`` costs beyond the interpreter's start, on a tiny input: where the second goes.

    python bench/bench_startup.py [--records 20] [--repeats 7] [--workers auto]

Writes a JSONL of ``--records`` alpaca records (from ``../shared/data``'s gsm8k where it exists, else the
bundled sample, repeated), compiles the package's bytecode first (as ``pip install`` does; a checkout run
with ``PYTHONDONTWRITEBYTECODE`` set would otherwise compile ~80 modules from source on every run), then runs,
as whole processes, alternately: ``python -c pass`` (the interpreter's start), ``python -c "import
pipeline.cli"`` (the command's imports) and ``packstream pack FILE -o OUT -q --overwrite``; the median of each.
One more traced run of the pack (``PACKSTREAM_TRACE``) says where its CPU went: the imports before the launcher
starts, the tokenizer (load and identity), the run's context, the job (read, tokenize, pack, write) and the
commit. The overhead is the pack's wall time minus the interpreter's.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def write_records(path: Path, n: int, data: Path) -> str:
    gsm8k = data / "gsm8k" / "train.jsonl"
    rows = []
    if gsm8k.exists():
        with open(gsm8k, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                rows.append({"instruction": r["question"], "input": "", "output": r["answer"]})
                if len(rows) == n:
                    break
        where = str(gsm8k)
    else:
        with open(ROOT / "pipeline" / "data" / "alpaca.jsonl", encoding="utf-8") as f:
            sample = [json.loads(line) for line in f if line.strip()]
        rows = [sample[i % len(sample)] for i in range(n)]
        where = "the bundled alpaca sample"
    with open(path, "w", encoding="utf-8") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({"id": f"r{i}", **r}) + "\n")
    return where


def timed(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return wall


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=20)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--workers", default="auto")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    args = p.parse_args(argv)
    compileall.compile_dir(str(ROOT / "pipeline"), quiet=1)
    compileall.compile_dir(str(ROOT / "packers"), quiet=1)
    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    try:
        src = work / "tiny.jsonl"
        where = write_records(src, args.records, Path(args.data))
        out = work / "out"
        pack = [PY, "-m", "pipeline.cli", "pack", str(src), "-o", str(out), "-q", "--overwrite",
                "--workers", args.workers]
        cmds = {"python -c pass": [PY, "-c", "pass"], "import pipeline.cli": [PY, "-c", "import pipeline.cli"],
                "packstream pack": pack}
        times: dict[str, list[float]] = {k: [] for k in cmds}
        timed(pack, env)  # warm the page cache
        for _ in range(args.repeats):
            for name, cmd in cmds.items():
                times[name].append(timed(cmd, env))
        med = {k: statistics.median(v) for k, v in times.items()}
        trace = work / "trace"
        trace.mkdir()
        timed(pack, {**env, "PACKSTREAM_TRACE": str(trace)})
        sys.path.insert(0, str(ROOT))
        from pipeline import _trace

        spans = _trace.read(str(trace))
        launcher = next(sp["pid"] for sp in spans if sp["span"] == "launch")
        mine = [sp for sp in spans if sp["pid"] == launcher]

        def cpu(name: str) -> float:
            return sum(sp["cpu"] for sp in mine if sp["span"] == name)

        before = next(sp["info"]["process_cpu"] for sp in mine if sp["span"] == "launch")
        print(f"{args.records} records ({where}), --workers {args.workers}, median of {args.repeats}, "
              f"{os.cpu_count()} cores")
        for name, secs in med.items():
            print(f"  {name:<22}{secs:7.3f} s wall")
        print(f"  overhead beyond the interpreter's start: {med['packstream pack'] - med['python -c pass']:.3f} s")
        print("  where the pack's CPU went (one traced run, the launcher):")
        for label, secs in (("imports and options", before), ("tokenizer: load, identity, checks", cpu("launch_tokenizer")),
                            ("run context", cpu("launch_context")), ("job: read, tokenize, pack, write, commit",
                                                                     cpu("job"))):
            print(f"    {label:<42}{secs:6.3f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
