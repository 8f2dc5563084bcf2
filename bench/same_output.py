"""Output folders byte-identical to another commit's: the check behind "behaviour unchanged".

    python bench/same_output.py --ref 89e5737 [--case bundled --case gsm8k ...] [--keep DIR]

Checks out ``--ref`` into a temporary git worktree, then for each case runs ``packstream pack``
from that tree and from this one (same interpreter, same output path, one after the other) and
compares every file of the two output folders byte for byte: the shards, ``manifest.json``,
``rejected.jsonl`` and the dataset card. Prints one line per case and exits 1 on any difference.
Cases that need ``../shared`` are skipped (and said so) where it is absent. The bundled sample is
copied out of the ref's tree to one folder that both runs read, since the manifest records the
inputs' paths.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

CASES = {
    # name: (pack arguments after the inputs, inputs; paths under ../shared start with "shared/")
    "bundled": ([], []),
    "bundled-parquet-global-validation": (
        ["--output-format", "parquet", "--mode", "global", "--validation-fraction", "0.2", "--max-tokens", "1024"], []),
    "bundled-split-two-workers": (["--long", "split", "--max-tokens", "256", "--workers", "2"], []),
    "shared-data": (["--field", "question=user", "--field", "answer=assistant", "--max-tokens", "4096"],
                    ["shared/data"]),
    "gsm8k-truncate-grouped": (["--field", "question=user", "--field", "answer=assistant", "--max-tokens", "256",
                                "--long", "truncate", "--group-size", "500", "--num-shards", "3"],
                               ["shared/data/gsm8k/train.jsonl"]),
    "dpo-pairs": (["--pairs", "--max-tokens", "2048"], ["shared/preference/dpo_zh_demo.json"]),
    "kto": (["--max-tokens", "2048"], ["shared/preference/kto_en_demo.json"]),
}


def _inputs(paths: list[str], bundled: Path) -> list[str] | None:
    if not paths:
        return [str(bundled)]
    out = []
    for p in paths:
        full = SHARED / p.removeprefix("shared/")
        if not full.exists():
            return None
        out.append(str(full))
    return out


def _pack(tree: Path, inputs: list[str], args: list[str], output: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "pipeline.cli", "pack", *inputs, *args, "-o", str(output), "-q"]
    return subprocess.run(cmd, cwd=tempfile.gettempdir(), env=env, capture_output=True, text=True)


def _differences(a: Path, b: Path) -> list[str]:
    names_a = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    names_b = sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    out = [f"only in {ref}: {n}" for ref, n in
           [("ref", n) for n in sorted(set(names_a) - set(names_b))] + [("here", n) for n in sorted(set(names_b) - set(names_a))]]
    out += [f"differs: {n}" for n in sorted(set(names_a) & set(names_b))
            if not filecmp.cmp(a / n, b / n, shallow=False)]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="the commit to compare with (e.g. the main before a refactor)")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="cases to run (default: all)")
    ap.add_argument("--keep", default=None, help="keep the output folders under this folder")
    args = ap.parse_args(argv)
    work = Path(args.keep or tempfile.mkdtemp(prefix="same-output-"))
    work.mkdir(parents=True, exist_ok=True)
    ref_tree = work / "ref-tree"
    if ref_tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(ref_tree)], capture_output=True)
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(ref_tree), args.ref],
                   check=True, capture_output=True)
    bundled = work / "bundled"
    shutil.rmtree(bundled, ignore_errors=True)
    shutil.copytree(ref_tree / "pipeline" / "data", bundled)
    failed = 0
    try:
        for name in args.case or CASES:
            extra, paths = CASES[name]
            inputs = _inputs(paths, bundled)
            if inputs is None:
                print(f"{name}: skipped (../shared is absent)")
                continue
            out = work / "out" / name
            results = {}
            for label, tree in (("ref", ref_tree), ("here", ROOT)):
                shutil.rmtree(out, ignore_errors=True)
                done = _pack(tree, inputs, extra, out)
                if done.returncode not in (0, 3):
                    print(f"{name}: {label} exited {done.returncode}: {done.stderr.strip()[-400:]}")
                    failed += 1
                    break
                results[label] = work / f"{name}.{label}"
                shutil.rmtree(results[label], ignore_errors=True)
                out.rename(results[label])
            else:
                diff = _differences(results["ref"], results["here"])
                files = sum(1 for p in results["here"].rglob("*") if p.is_file())
                print(f"{name}: {'identical' if not diff else 'DIFFERENT'} ({files} files)" +
                      "".join(f"\n  {d}" for d in diff))
                failed += bool(diff)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(ref_tree)], capture_output=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
