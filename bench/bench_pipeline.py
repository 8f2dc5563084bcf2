"""End-to-end throughput of ``packstream pack`` vs the raw tokenizer and the TRL path, in one run.

    python bench/bench_pipeline.py [--data ../shared/data] [--max-tokens 4096] [--repeats 2]

Measures, on the same records rendered the same way (built-in ChatML, gsm8k mapped question->user,
answer->assistant):

* packstream: the whole local job (read, render, tokenize, pack, write shards), wall clock
  including Beam start-up;
* (a) raw tokenizer: ``encode_batch_fast`` of the same tokenizer over the fully rendered texts,
  already in memory (the ceiling for any pipeline that tokenizes);
* (b) TRL: ``datasets.Dataset.from_dict(texts).map(tokenize, batched=True)``, then
  ``trl.pack_dataset(strategy="bfd")``, then ``save_to_disk`` (rendering excluded, as TRL
  users render in their own map).

and prints tokens/s, fill, rows and the ratios. Best of ``--repeats`` runs for each path.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rendered_texts(options) -> list[str]:
    """Every packable record's full text, as the job renders it (the encode stage's own prepare step),
    EOS included: what the raw tokenizer and the TRL path tokenize."""
    from pipeline._encode import Encoder
    from pipeline._read import expand_datasets, read_file

    encoder = Encoder(options)
    eos = encoder.renderer.tok.eos_token
    texts = []
    for f in expand_datasets(options.datasets())[0]:
        chunk = [(f.dataset, f.source, pos, rec) for pos, rec in read_file(f, options.max_record_bytes)]
        p = encoder.prepare(chunk)
        joined = [""] * len(p.meta)
        for owner, text in zip(p.owner, p.texts):
            joined[owner] += text
        texts += [t.rstrip() + eos for t in joined if t]
    return texts


def bench_packstream(options, workers: int) -> tuple[float, dict]:
    import dataclasses

    from pipeline import run

    out = tempfile.mkdtemp(prefix="bench-ps-")
    shutil.rmtree(out)
    try:
        opts = dataclasses.replace(options, output=out, workers=workers)
        t = time.perf_counter()
        manifest = run(opts)
        return time.perf_counter() - t, manifest["counts"]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def bench_raw(tok, texts: list[str]) -> tuple[float, int]:
    backend = tok.backend_tokenizer
    t = time.perf_counter()
    n = sum(len(e.ids) for e in backend.encode_batch_fast(texts, add_special_tokens=False))
    return time.perf_counter() - t, n


def bench_trl(tok, texts: list[str], budget: int) -> tuple[float, dict]:
    import datasets
    from trl import pack_dataset

    datasets.disable_progress_bars()
    out = tempfile.mkdtemp(prefix="bench-trl-")
    try:
        t = time.perf_counter()
        ds = datasets.Dataset.from_dict({"text": texts})
        ds = ds.map(lambda b: {"input_ids": tok(b["text"], add_special_tokens=False)["input_ids"]},
                    batched=True, remove_columns=["text"])
        packed = pack_dataset(ds, seq_length=budget, strategy="bfd")
        packed.save_to_disk(out)
        dt = time.perf_counter() - t
        lengths = packed.with_format("arrow")["input_ids"].to_pylist()
        tokens = sum(len(x) for x in lengths)
        rows = len(lengths)
        return dt, {"tokens": tokens, "rows": rows, "fill": tokens / (rows * budget)}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args(argv)
    if not Path(args.data).exists():
        sys.exit(f"no data at {args.data}; pass --data")
    from pipeline import PackOptions
    from pipeline._tokenizer import load_tokenizer

    options = PackOptions(inputs=(args.data,), output="unused", max_tokens=args.max_tokens,
                          fields=(("question", "user"), ("answer", "assistant")))
    tok = load_tokenizer(options.tokenizer)
    texts = rendered_texts(options)
    bench_packstream(options, args.workers)  # warm-up: imports, tokenizer load, page cache

    ps = min((bench_packstream(options, args.workers) for _ in range(args.repeats)), key=lambda r: r[0])
    # The job's fixed cost (Beam graph construction, runner start-up, stage scheduling, writing the
    # manifest), measured as the whole job on the 31-record bundled sample.
    from pipeline.cli import bundled_sample

    tiny = dataclasses.replace(options, inputs=(bundled_sample(),), fields=())
    fixed = min(bench_packstream(tiny, args.workers)[0] for _ in range(args.repeats))
    raw = min((bench_raw(tok, texts) for _ in range(args.repeats)), key=lambda r: r[0])
    trl = min((bench_trl(tok, texts, args.max_tokens) for _ in range(args.repeats)), key=lambda r: r[0])

    ps_tps = ps[1]["tokens"] / ps[0]
    raw_tps = raw[1] / raw[0]
    trl_tps = trl[1]["tokens"] / trl[0]
    print(f"data: {args.data}  ({len(texts):,} examples rendered), budget {args.max_tokens}, "
          f"{os.cpu_count()} cores, packstream --workers {args.workers}")
    print(f"{'path':<34}{'seconds':>9}{'tokens':>12}{'tokens/s':>12}{'rows':>8}{'fill':>9}")
    print(f"{'packstream pack (end to end)':<34}{ps[0]:>9.2f}{ps[1]['tokens']:>12,}{ps_tps:>12,.0f}"
          f"{ps[1]['rows']:>8,}{ps[1]['fill']:>9.3%}")
    print(f"{'(a) raw tokenizer, in memory':<34}{raw[0]:>9.2f}{raw[1]:>12,}{raw_tps:>12,.0f}{'':>8}{'':>9}")
    print(f"{'(b) TRL map + pack_dataset(bfd)':<34}{trl[0]:>9.2f}{trl[1]['tokens']:>12,}{trl_tps:>12,.0f}"
          f"{trl[1]['rows']:>8,}{trl[1]['fill']:>9.3%}")
    print(f"fixed cost of a packstream run (the bundled 31-record sample): {fixed:.2f} s; "
          f"packstream without it: {ps[1]['tokens'] / max(ps[0] - fixed, 1e-9):,.0f} tokens/s")
    print(f"ratios: packstream / TRL = {ps_tps / trl_tps:.2f}x ; packstream / raw tokenizer = {ps_tps / raw_tps:.1%} ; "
          f"rows: packstream {ps[1]['rows']:,} vs TRL {trl[1]['rows']:,} (lower bound {ps[1]['lower_bound']:,})")


if __name__ == "__main__":
    main()
