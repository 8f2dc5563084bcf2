"""``packstream preview``: how the first records of each input are read, rendered and masked.

For the first ``n`` records of every input file: the shape the record was read as and how its
fields became turns, the rendered example with its training targets marked (colour on a
terminal, ``[[...]]`` otherwise), token counts, and what normalization did (turns dropped,
merged, trimmed; fields ignored); or the reason the record is refused, whose detail names the
fix. Records go through the same :class:`~pipeline._encode.Encoder` as ``packstream pack``, so
the tokens shown are the tokens that would be packed.

No Beam: local inputs are read here (JSONL lines through the job's own parser,
:func:`pipeline._read.parse_line`); remote ones (gs://, s3://) through :mod:`pipeline._read`.
Like Axolotl's ``preprocess --debug``, without a training config.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
from typing import Any, Iterator

from packers import PackstreamError
from pipeline._formats import Rejected, detect, normalize, pair_conversations
from pipeline._options import PackOptions

_HF_MARKERS = ("state.json", "dataset_dict.json")


def _local_files(pattern: str) -> list[tuple[str, str]]:
    """``(path, kind)`` for a local file, folder (walked, hidden names skipped) or glob."""
    import glob

    from pipeline._read import SUPPORTED, _kind

    def hf(p: str) -> bool:
        return os.path.isdir(p) and any(os.path.exists(os.path.join(p, n)) for n in _HF_MARKERS)

    if os.path.isdir(pattern) and not hf(pattern):
        out = []
        for dirpath, dirnames, filenames in os.walk(pattern):
            if hf(dirpath):
                out.append((os.path.abspath(dirpath), "hf_disk"))
                dirnames[:] = []
                continue
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            out += [(os.path.abspath(os.path.join(dirpath, f)), _kind(f)) for f in sorted(filenames)
                    if not f.startswith(".") and _kind(f)]
        if not out:
            raise PackstreamError(f"input {pattern!r} matches no supported file; supported: {', '.join(SUPPORTED)}")
        return out
    paths = [pattern] if os.path.exists(pattern) else sorted(glob.glob(pattern, recursive=True))
    if not paths:
        raise PackstreamError(f"input {pattern!r} matches no file; check the path or the glob")
    out = [(os.path.abspath(p), "hf_disk" if hf(p) else _kind(p)) for p in paths]
    out = [(p, k) for p, k in out if k]
    if not out:
        raise PackstreamError(f"input {pattern!r} matches no supported file; supported: {', '.join(SUPPORTED)}")
    return out


def inputs(options: PackOptions) -> list:
    """The input files of every data set, as :class:`pipeline._read.InputFile` (sources named as the job names them)."""
    from pipeline._read import InputFile, _common_root

    specs = options.datasets()
    if any("://" in p for s in specs for p in s.paths):
        from pipeline._read import expand_datasets  # remote inputs: Beam's FileSystems

        return expand_datasets(specs)[0]
    found: dict[str, tuple[str, str, int]] = {}
    for d, spec in enumerate(specs):
        for pattern in spec.paths:
            for path, kind in _local_files(pattern):
                found.setdefault(os.path.realpath(path), (path, kind, d))
    files = sorted(found.values())
    root = _common_root([p for p, _, _ in files])
    out = []
    for p, k, d in files:
        source = (p[len(root):].lstrip("/") if root else p) or os.path.basename(p)
        if k != "hf_disk":
            out.append(InputFile(p, source, k, dataset=d))
            continue
        import datasets

        ds = datasets.load_from_disk(p)
        splits = sorted(ds) if isinstance(ds, datasets.DatasetDict) else [""]
        if specs[d].split is not None:
            splits = [specs[d].split]
        out += [InputFile(p, f"{source}[{s}]" if s else source, k, s, d) for s in splits]
    return out


def records(f, max_bytes: int) -> Iterator[tuple[int, Any]]:
    """``(position, record or Rejected)`` of one input, lazily (positions as the job counts them)."""
    if f.path.startswith(("gs://", "s3://")) or "://" in f.path:
        from pipeline._read import read_file

        yield from read_file(f, max_bytes)
        return
    from pipeline._read import parse_line

    opener = gzip.open if f.path.lower().endswith(".gz") else open
    if f.kind == "jsonl":
        with opener(f.path, "rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                if raw.strip():
                    yield lineno, parse_line(raw.rstrip(b"\r\n"), max_bytes, first=lineno == 1)
        return
    if f.kind == "json":
        with opener(f.path, "rb") as fh:
            data = fh.read()
        try:
            value = json.loads(data.decode("utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if isinstance(e, json.JSONDecodeError) and e.msg == "Extra data":  # JSON lines in a .json file
                for lineno, raw in enumerate(data.splitlines(), start=1):
                    if raw.strip():
                        yield lineno, parse_line(raw, max_bytes, first=lineno == 1)
                return
            raise PackstreamError(f"input {f.path} is not valid JSON ({e}); fix the file or convert it to JSONL") from None
        yield from enumerate(value if isinstance(value, list) else [value])
        return
    import pyarrow as pa

    if f.kind == "parquet":
        import pyarrow.parquet as pq

        batches = pq.ParquetFile(f.path).iter_batches(batch_size=64)
    elif f.kind == "arrow":
        data = pa.memory_map(f.path)
        try:
            batches = iter(pa.ipc.open_stream(data))
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(data)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:  # a datasets save_to_disk folder
        import datasets

        ds = datasets.load_from_disk(f.path)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[f.split]
        batches = ds.with_format("arrow").iter(batch_size=64)
    yield from enumerate(itertools.chain.from_iterable(b.to_pylist() for b in batches))


def preview(options: PackOptions, n: int) -> list[dict]:
    """The first ``n`` records of each input, read, rendered and tokenized as ``pack`` would (see the module docstring).

    Each item: ``source``, ``position``, ``dataset``; then either ``reason`` and ``detail``, or
    ``format``, ``mapping`` (words), ``notes``, ``spans`` (``[(text, is_target), ...]`` decoded
    from the tokens), ``tokens`` and ``targets`` (counts); with ``--pairs``, ``sides``: the spans of
    the pair's chosen and rejected sequences. ``format`` is set for refused records
    too when their shape was recognised.
    """
    from pipeline._encode import Encoder

    encoder = Encoder(options)
    tok = encoder.renderer.tok
    specs = options.datasets()
    items: list[dict] = []
    for f in inputs(options):
        fmt = specs[f.dataset].format
        for position, record in itertools.islice(records(f, options.max_record_bytes), n):
            item: dict[str, Any] = {"source": f.source, "position": position, "dataset": specs[f.dataset].name}
            items.append(item)
            if not isinstance(record, Rejected):
                try:
                    item["format"] = detect(record, fmt)
                    # --pairs reads each side as --preference does; the mapping is the chosen side's
                    conv = pair_conversations(record, fmt)[0] if options.pairs else normalize(record, fmt)
                    item["mapping"] = list(conv.mapping)
                    item["notes"] = dict(conv.notes)
                    if options.pairs:  # both sides are packed: say so, not what --preference chosen would do
                        item["mapping"] = ["a preference pair: the shared prompt, then the chosen and the rejected "
                                           "answer, each a sequence (--pairs)"] + [
                            m for m in item["mapping"] if not m.startswith("a preference pair")]
                        item["notes"].pop("other_side_not_trained", None)
                except Rejected:
                    pass
            encoded = encoder.encode([(f.dataset, f.source, position, record)])
            if encoded.rejected:
                dead = encoded.rejected[0]
                item["reason"], item["detail"] = dead["reason"], dead["detail"]
                continue
            batch = encoded.batch
            a, b = int(batch.offsets[0]), int(batch.offsets[1])
            ids, mask = _example(batch, a, b)
            item["tokens"], item["targets"] = len(ids), int(sum(mask))
            item["spans"] = [(tok.decode(run_ids), bool(flag)) for flag, run_ids in _runs(ids, mask)]
            if batch.cuts is not None:  # a pair: its chosen and rejected sides, each on its own
                cut = int(batch.cuts[0])
                item["sides"] = [[(tok.decode(r), bool(flag)) for flag, r in _runs(ids[x:y], mask[x:y])]
                                 for x, y in ((0, cut), (cut, len(ids)))]
    return items


def _example(batch, a: int, b: int) -> tuple[list[int], list[int]]:
    if hasattr(batch, "input_ids"):
        return batch.input_ids[a:b].tolist(), batch.loss_mask[a:b].tolist()
    return batch.tokens[0, a:b].tolist(), batch.tokens[1, a:b].tolist()


def _runs(ids: list[int], mask: list[int]) -> list[tuple[int, list[int]]]:
    runs: list[tuple[int, list[int]]] = []
    for i, m in zip(ids, mask):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(i)
        else:
            runs.append((m, [i]))
    return runs


_GREEN, _DIM, _RED, _BOLD, _RESET = "\x1b[32m", "\x1b[2m", "\x1b[31m", "\x1b[1m", "\x1b[0m"


def format_preview(items: list[dict], color: bool) -> str:
    """Items of :func:`preview` as text: targets in green (``color``) or inside ``[[...]]``."""
    c = (lambda code, s: f"{code}{s}{_RESET}") if color else (lambda code, s: s)  # noqa: E731
    out: list[str] = []
    source = None
    for it in items:
        if it["source"] != source:
            source = it["source"]
            out.append(c(_BOLD, f"== {source}") + ("" if it["dataset"] == "default" else f"  (data set {it['dataset']})"))
        where = f"line {it['position']}" if str(source).lower().endswith((".jsonl", ".jsonl.gz", ".ndjson")) \
            else f"record {it['position']}"
        shape = it.get("format", "shape not recognised")
        if "reason" in it:
            out.append(f"-- {where}: {shape}  " + c(_RED, f"REFUSED {it['reason']}"))
            out.append(f"   {it['detail']}")
            out.append("")
            continue
        out.append(f"-- {where}: {shape}  {it['tokens']} tokens, {it['targets']} trained")
        for line in it.get("mapping", []):
            out.append(f"   {line}")
        notes = it.get("notes") or {}
        if notes:
            out.append("   notes: " + ", ".join(f"{k} {v}" for k, v in sorted(notes.items())))
        for k, spans in enumerate(it.get("sides") or [it["spans"]]):
            if "sides" in it:
                out.append(c(_BOLD, "   chosen:" if k == 0 else "   rejected:"))
            text = "".join(c(_GREEN, t) if y else c(_DIM, t) for t, y in spans) if color else \
                "".join(f"[[{t}]]" if y else t for t, y in spans)
            out.append(text)
        out.append("")
    if not color:
        out.append("[[...]]: training targets (loss mask 1)")
    return "\n".join(out).rstrip("\n") + "\n"
