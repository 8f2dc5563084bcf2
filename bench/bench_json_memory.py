"""Peak memory of reading one big ``.json`` array: the streamed reader against loading it whole.

    python bench/bench_json_memory.py [--mib 500] [--keep]

Writes a JSON array of chat records (about ``--mib`` MiB, pretty-printed as data sets publish them),
then reads it in two fresh processes, side by side, and prints each one's peak RSS and time:

* ``streamed``: packstream's reader (:func:`pipeline._read.read_file`): the array is split item by item
  (:func:`pipeline._read.json_items`) and each item parsed on its own, so memory holds one item.
* ``whole``: what the reader did before issue 16: the file's bytes, then ``json.loads`` of all of it,
  then every record (about 4x the file's size).

Both count the records they read, so the two are checked to agree. The peak of a fresh interpreter
that only imports the reader is printed as the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
from pipeline import _read
mode, path = sys.argv[1], sys.argv[2]
started = time.perf_counter()
if mode == "streamed":
    f = _read.InputFile(path, "big.json", "json")
    n = sum(1 for _ in _read.read_file(f, 16 * 2**20))
elif mode == "whole":
    with open(path, "rb") as fh:
        data = fh.read()
    value = json.loads(data.decode("utf-8-sig"))
    n = len(value)
else:
    n = 0
seconds = time.perf_counter() - started
print(json.dumps({{"records": n, "seconds": seconds, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def write_array(path: Path, mib: int) -> int:
    record = {"messages": [{"role": "user", "content": "Explain the result, step by step. " * 6},
                           {"role": "assistant", "content": "First, the inputs. Then the steps, one by one. " * 12}],
              "source": "bench", "id": 0}
    n, size = 0, 0
    with open(path, "w") as fh:
        fh.write("[\n")
        while size < mib * 2**20:
            record["id"] = n
            text = ("" if n == 0 else ",\n") + json.dumps(record, indent=2)
            fh.write(text)
            size += len(text)
            n += 1
        fh.write("\n]\n")
    return n


def measure(mode: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD.format(root=str(ROOT)), mode, str(path)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=500)
    p.add_argument("--keep", action="store_true", help="keep the generated file (its path is printed)")
    args = p.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="packstream-json-")
    path = Path(folder) / "big.json"
    n = write_array(path, args.mib)
    size = os.path.getsize(path) / 2**20
    print(f"{path}: {size:,.0f} MiB, {n:,} records")
    base = measure("baseline", path)
    rows = {}
    for mode in ("streamed", "whole"):
        rows[mode] = measure(mode, path)
        assert rows[mode]["records"] == n, (mode, rows[mode]["records"], n)
    print(f"{'reader':<10} {'peak RSS':>10} {'above baseline':>15} {'x file size':>12} {'seconds':>8}")
    for mode, r in [("baseline", base), *rows.items()]:
        above = r["peak_mib"] - base["peak_mib"]
        print(f"{mode:<10} {r['peak_mib']:>8,.0f} MiB {above:>11,.0f} MiB {above / size:>12.2f} {r['seconds']:>8.1f}")
    s, w = rows["streamed"], rows["whole"]
    print(f"whole / streamed peak above baseline: {(w['peak_mib'] - base['peak_mib']) / max(1.0, s['peak_mib'] - base['peak_mib']):.1f}x; "
          f"time streamed / whole: {s['seconds'] / w['seconds']:.2f}x")
    if not args.keep:
        path.unlink()
        os.rmdir(folder)


if __name__ == "__main__":
    main()
