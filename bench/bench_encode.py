"""Where the encode stage's time goes, per record: reading, the Python steps, and the tokenizer.

    python bench/bench_encode.py [INPUT] [--batch-size 512] [--repeats 3]

Runs :class:`pipeline._encode.Encoder` on one input, one step at a time over all of it (no Beam,
no overlap), best of ``--repeats``: reading and parsing (``_read.read_file``), ``prepare`` (normalize
and render into segments), ``tokenize`` (one ``encode_batch_fast`` call per chunk, the Rust
tokenizer on every core), ``finish`` (masks from segment lengths, the EOS). Default input: the
bundled sample, or ``../shared/data``'s gsm8k + GPTeacher + T0 mix built by bench_scale.py with ``--mix``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input", nargs="?", default=None)
    p.add_argument("--mix", action="store_true", help="the 1x mix of ../shared/data (bench_scale.py's input)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    from pipeline import PackOptions, _read
    from pipeline._encode import Encoder
    from pipeline.cli import bundled_sample

    path = args.input or bundled_sample()
    if args.mix:
        sys.path.insert(0, str(ROOT / "bench"))
        from bench_scale import build_mix

        path = str(Path(tempfile.mkdtemp()) / "mix-1x.jsonl")
        build_mix(ROOT.parent / "shared" / "data", 1, Path(path))
    options = PackOptions(inputs=(path,), output="unused", batch_size=args.batch_size)
    files, _ = _read.expand_datasets(options.datasets())
    encoder = Encoder(options)

    def best(fn):
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t)
        return min(times), out

    t_read, items = best(lambda: [(f.dataset, f.source, pos, rec) for f in files
                                  for pos, rec in _read.read_file(f, options.max_record_bytes)])
    chunks = [items[i:i + args.batch_size] for i in range(0, len(items), args.batch_size)]
    t_prep, prepared = best(lambda: [encoder.prepare(c) for c in chunks])
    t_tok, encodings = best(lambda: [encoder.tokenize(p) for p in prepared])
    t_fin, encoded = best(lambda: [encoder.finish(p, e) for p, e in zip(prepared, encodings)])
    n = len(items)
    tokens = sum(e.batch.num_tokens for e in encoded)
    print(f"{n:,} records, {tokens:,} tokens ({path}); per record, best of {args.repeats}:")
    for name, t in (("read and parse", t_read), ("prepare: normalize, render", t_prep),
                    ("tokenize (Rust, all cores)", t_tok), ("finish: masks, EOS", t_fin)):
        print(f"  {name:30s} {t / n * 1e6:8.1f} us   ({t:.2f} s)")
    python = t_read + t_prep + t_fin
    print(f"Python steps / tokenizer: {python / t_tok:.1%}")


if __name__ == "__main__":
    main()
