"""Train a tiny random Qwen2-VL on packed image+text rows, on CPU, end to end; the loss falls.

    python examples/train_vlm.py                     # generate, pack, train 40 steps
    python examples/train_vlm.py --records 300 --steps 80 --attn eager

What it shows, in order:

1. A generated set of chat records in the OpenAI shape: each user turn holds an image part (a PNG file of one
   colour, of a random size) and a question; the assistant names the colour. A third of the records are text only.
2. ``packstream pack --processor <folder>``: the images are measured from their headers, each expands to exactly
   the tokens Qwen2-VL's processor gives it (``smart_resize`` with the folder's min/max pixels), and the examples
   are packed into rows of ``--budget`` tokens; every image stays whole inside its example.
3. ``PackedDataset`` reads the rows with their images; ``Collator(vision=ds.vision)`` decodes the images at load
   time (the processor's own resize and normalisation, the grid checked against the packed one) and builds the
   ``[4, 1, T]`` position ids (text positions, then each example's 3-D mRoPE positions, restarted per example), so
   the packed batch computes what each example alone would (tests/test_vision_exact.py).
4. The packing guard checks the model on the first batch; the loss is the mean over the step's target tokens.

Token ids are folded into a small vocabulary (as examples/train_tiny.py does), the vision tokens kept distinct.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packers import Batching, Collator, PackedDataset, Sampling, install_packing_guard  # noqa: E402

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (240, 220, 40),
           "black": (10, 10, 10), "white": (245, 245, 245)}


def make_records(folder: Path, n: int, seed: int) -> Path:
    from PIL import Image

    rng = np.random.default_rng(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    names = sorted(COLOURS)
    lines = []
    for r in range(n):
        colour = names[int(rng.integers(len(names)))]
        if r % 3 == 2:  # text only
            lines.append({"messages": [{"role": "user", "content": f"Spell the word {colour}."},
                                       {"role": "assistant", "content": " ".join(colour)}]})
            continue
        w, h = int(rng.integers(40, 200)), int(rng.integers(40, 200))
        Image.new("RGB", (w, h), COLOURS[colour]).save(folder / "img" / f"{r}.png")
        lines.append({"messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"img/{r}.png"}},
                                         {"type": "text", "text": "What colour is this picture?"}]},
            {"role": "assistant", "content": f"It is {colour}."}]})
    path = folder / "colours.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def make_tokenizer(folder: Path) -> Path:
    from transformers import AutoTokenizer

    from pipeline._tokenizer import default_tokenizer_path

    tok = AutoTokenizer.from_pretrained(default_tokenizer_path())
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.save_pretrained(folder)
    return folder


def make_processor(folder: Path, max_pixels: int) -> Path:
    """A Qwen2-VL processor config with a small pixel cap, so each image is a few dozen tokens."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
        "min_pixels": 28 * 28 * 4, "max_pixels": max_pixels, "patch_size": 14, "merge_size": 2,
        "temporal_patch_size": 2}))
    return folder


def pack(data: Path, tokenizer: Path, processor: Path, out: Path, budget: int) -> None:
    cmd = [sys.executable, "-m", "pipeline.cli", "pack", str(data), "--tokenizer", str(tokenizer), "--processor",
           str(processor), "--max-tokens", str(budget), "--output", str(out), "--quiet"]
    print("$ packstream " + " ".join(cmd[3:]))
    subprocess.run(cmd, check=True, cwd=ROOT)


class VocabFold:
    """The data's most frequent ids to ``0..size-2``, the rest to ``size - 1``; the vision tokens always kept."""

    def __init__(self, ds: PackedDataset, size: int, keep: list[int]) -> None:
        flat = ds.rows.data.table.column("input_ids").combine_chunks().flatten().to_numpy()
        ids, counts = np.unique(flat, return_counts=True)
        order = [i for i in keep] + [int(i) for i in ids[np.argsort(-counts, kind="stable")] if int(i) not in keep]
        self.table = np.full(max(int(ids.max()), *keep) + 1, size - 1, dtype=np.int64)
        self.table[order[: size - 1]] = np.arange(min(size - 1, len(order)))
        self.size = size

    def __call__(self, rows: list[dict]) -> list[dict]:
        return [{**r, "input_ids": self.table[np.asarray(r["input_ids"])]} for r in rows]


def tiny_qwen2_vl(vocab: int, ids: dict[str, int], attn: str):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=4096, bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]})
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, mlp_ratio=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, video_token_id=vocab - 1, **ids)
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration._from_config(cfg, attn_implementation=attn)


def main(argv=None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=240)
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--max-pixels", type=int, default=28 * 28 * 16, help="the processor's pixel cap")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--examples-per-step", type=int, default=16)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok_dir = make_tokenizer(tmp / "tokenizer")
        pack(make_records(tmp / "data", args.records, args.seed), tok_dir,
             make_processor(tmp / "processor", args.max_pixels), tmp / "packed", args.budget)
        ds = PackedDataset(tmp / "packed", sampling=Sampling(seed=args.seed),
                           batching=Batching(batch_by="examples", batch_size=args.examples_per_step))
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir)
        start, image, end = (tok.convert_tokens_to_ids(t) for t in VISION_TOKENS)
        fold = VocabFold(ds, args.vocab, [start, image, end])
        ids = {"vision_start_token_id": int(fold.table[start]), "image_token_id": int(fold.table[image]),
               "vision_end_token_id": int(fold.table[end])}
        collate = Collator(vision=ds.vision)
        model = tiny_qwen2_vl(args.vocab, ids, args.attn).train()
        install_packing_guard(model, max_length=ds.budget)  # refuses a batch that would let examples attend to each other
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        images = sum(len(r) for r in ds.rows.data.table.column("images").to_pylist())
        print(f"{len(ds.rows)} rows, {int(ds.num_examples.sum())} examples, {images} images, budget {ds.budget}; "
              f"{len(ds)} steps/epoch of ~{args.examples_per_step} examples")

        losses, step, t0, tokens = [], 0, time.time(), 0
        while step < args.steps:
            for rows in ds:
                batch = collate(fold(rows))
                n_targets = int((batch["labels"][..., 1:] != -100).sum())
                loss = model(**batch, num_items_in_batch=n_targets).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses.append(loss.item())
                tokens += batch["input_ids"].shape[1]
                step += 1
                if step % 10 == 0 or step == 1:
                    print(f"step {step:4d}  loss {losses[-1]:.3f}  epoch {ds.epoch}  "
                          f"{tokens / (time.time() - t0):,.0f} tok/s")
                if step == args.steps:
                    break

    k = max(1, len(losses) // 10)
    first, last = float(np.mean(losses[:k])), float(np.mean(losses[-k:]))
    print(f"loss {first:.3f} -> {last:.3f} over {step} steps ({'falls' if last < first else 'DOES NOT FALL'})")
    return last - first


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(0 if main() < 0 else 1)
