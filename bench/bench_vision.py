"""Vision-language packing: fill and useful tokens per row, packed vs padded, the cost of the media layout, videos,
and ``--workers auto`` on image-heavy input.

    python bench/bench_vision.py                       # 400 records, budget 8192, Qwen2-VL's image rules
    python bench/bench_vision.py --records 1000 --budget 4096 --max-pixels 1003520

A seeded mixed set is generated: 30% text-only records, 55% with one image, 15% with two; images in three kinds
(thumbnails 64-320 px, photos 480-1600 px, tall document scans), written as JPEG files with PIL; text lengths
lognormal. It is packed by the real job (``packstream pack --processor qwen2-vl``, a tokenizer with Qwen's vision
tokens), and the shards are read back:

* **Packed vs padded.** Packed: the rows as written, each at most ``--budget`` tokens. Padded: one example per row,
  batches of ``--batch`` examples in a seeded order, each padded to its longest (what a padding collator does). Both
  count the same examples; "useful" is non-padding tokens over the tokens a forward pass runs.
* **Media layout.** packstream stores each image by reference (``--images reference``, the default: its resolved
  path; or the bytes when the source held bytes) or embeds the encoded file (``--images embed``), and the loader
  decodes and preprocesses it (the processor's resize, normalize and patchify). The same set is packed both ways.
  Measured: shard bytes per image for references, for the embedded files (from the two runs' shard sizes), and for
  ``pixel_values`` decoded at pack time (float32, what the model reads); and the loader's CPU per image for decoding
  from a reference (the file), from the embedded bytes, and for reading stored pixels.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
WORDS = ("the image shows a chart of quarterly revenue with labels along each axis and a legend in the corner "
         "describe what you see then answer the question about colours shapes counts and text in the picture").split()


def vision_tokenizer(folder: Path) -> Path:
    """The project's default tokenizer with Qwen2-VL's vision tokens added, saved to ``folder``."""
    from transformers import AutoTokenizer

    from pipeline._tokenizer import default_tokenizer_path

    tok = AutoTokenizer.from_pretrained(default_tokenizer_path())
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.save_pretrained(folder)
    return folder


def _size(rng: np.random.Generator) -> tuple[int, int]:
    kind = rng.choice(3, p=[0.3, 0.5, 0.2])
    if kind == 0:
        return int(rng.integers(64, 320)), int(rng.integers(64, 320))
    if kind == 1:
        w = int(rng.integers(480, 1600))
        return w, int(w * rng.choice([0.5625, 0.75, 1.0, 1.333]))
    return int(rng.integers(600, 1000)), int(rng.integers(1200, 2000))


def _text(rng: np.random.Generator, median: float) -> str:
    n = int(np.clip(rng.lognormal(np.log(median), 1.0), 3, 3000))
    return " ".join(rng.choice(WORDS, n))


def make_set(folder: Path, records: int, seed: int) -> Path:
    """A JSONL of OpenAI-style image+text records and the JPEG files they name (relative paths)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for r in range(records):
        n_images = int(rng.choice(3, p=[0.3, 0.55, 0.15]))
        parts: list[dict] = []
        for k in range(n_images):
            w, h = _size(rng)
            name = f"img/{r:05d}_{k}.jpg"
            pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)  # a small noise tile, scaled: cheap to encode
            Image.fromarray(pixels).resize((w, h)).save(folder / name, quality=85)
            parts.append({"type": "image_url", "image_url": {"url": name}})
        parts.append({"type": "text", "text": _text(rng, 40)})
        lines.append({"id": f"r{r}", "messages": [{"role": "user", "content": parts},
                                                   {"role": "assistant", "content": _text(rng, 80)}]})
    path = folder / "mixed.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def pack(data: Path, out: Path, tokenizer: Path, budget: int, max_pixels: int | None, images: str = "reference",
         workers: str = "auto") -> dict:
    processor = "qwen2-vl"
    if max_pixels is not None:
        folder = out.parent / "processor"
        folder.mkdir(exist_ok=True)  # both runs write the same file
        (folder / "preprocessor_config.json").write_text(json.dumps({
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor",
            "min_pixels": 3136, "max_pixels": max_pixels, "patch_size": 14, "merge_size": 2,
            "temporal_patch_size": 2}))
        processor = str(folder)
    cmd = [sys.executable, "-m", "pipeline.cli", "pack", str(data), "--output", str(out), "--no-progress",
           "--tokenizer", str(tokenizer), "--processor", processor, "--max-tokens", str(budget), "--images", images,
           "--workers", workers, "--overwrite"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"pack failed ({done.returncode}):\n{done.stderr[-3000:]}")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["_seconds"] = time.perf_counter() - t0
    return manifest


def rows_of(out: Path) -> list[dict]:
    import pyarrow as pa

    rows = []
    for f in sorted(out.rglob("*.arrow")):
        with pa.memory_map(str(f)) as src:
            rows.extend(pa.ipc.open_stream(src).read_all().to_pylist())
    return rows


def packed_vs_padded(rows: list[dict], budget: int, batch: int, seed: int) -> dict:
    lengths = np.array([b - a for r in rows for a, b in zip(r["seq_offsets"][:-1], r["seq_offsets"][1:])])
    image_tokens = sum(int(np.prod(np.reshape(r["image_grid_thw"], (-1, 3)), axis=1).sum()) // 4 for r in rows)
    order = np.random.default_rng(seed).permutation(len(lengths))
    padded_slots = sum(int(lengths[order[i:i + batch]].max()) * len(order[i:i + batch])
                       for i in range(0, len(order), batch))
    useful = int(lengths.sum())
    return {"examples": len(lengths), "useful_tokens": useful, "image_tokens": image_tokens,
            "packed_rows": len(rows), "packed_slots": len(rows) * budget, "packed_fill": useful / (len(rows) * budget),
            "padded_rows": len(lengths), "padded_slots": padded_slots, "padded_useful": useful / padded_slots,
            "useful_per_row_packed": useful / len(rows), "useful_per_row_padded": useful / len(lengths)}


def _cpu_per_item(work, items: list, passes: int = 3) -> float:
    """CPU seconds per item of ``work`` over ``items``: the best of ``passes`` passes, nothing kept (keeping 19 MB of
    pixels per image would time the paging), so that first-call costs and the allocator's state are no layout's."""
    best = float("inf")
    for _ in range(passes):
        t0 = time.process_time()
        for item in items:
            work(item)
        best = min(best, time.process_time() - t0)
    return best / len(items)


def media_layout(out: Path, rows: list[dict], spec_json: str, sample: int) -> dict:
    """Bytes per image of each layout, and the loader's CPU per image to get pixel_values from each."""
    import pyarrow as pa

    from packers import PixelLoader, VisionSpec
    from PIL import Image

    spec = VisionSpec.from_json(spec_json)
    images = [(img, grid) for r in rows for img, grid in zip(r["images"], np.reshape(r["image_grid_thw"], (-1, 3)))]
    shard_bytes = sum(f.stat().st_size for f in out.rglob("*.arrow"))
    ref_bytes = sum(len((img["path"] or "").encode()) for img, _ in images)
    file_bytes = sum(os.path.getsize(img["path"]) for img, _ in images)
    patch_dim = 3 * spec.temporal_patch_size * spec.patch_size ** 2
    pixel_bytes = sum(int(np.prod(grid)) * patch_dim * 4 for _, grid in images)
    processor = PixelLoader(vision=spec).image_processor  # the loader's own processor
    picked = images[:sample]

    def decode(img: dict) -> dict:
        with Image.open(img["path"]) as im:
            return processor(images=[im.convert("RGB")], return_tensors="np")

    for img, grid in picked:
        assert tuple(decode(img)["image_grid_thw"][0]) == tuple(grid)
    decode_cpu = _cpu_per_item(lambda item: decode(item[0]), picked)
    stored = [decode(img)["pixel_values"].astype(np.float32) for img, _ in picked]
    # Stored pixels: what reading them back from a memory-mapped Arrow column costs (a copy into a tensor).
    table = pa.table({"pixels": [p.reshape(-1) for p in stored]})
    sink = out.parent / "pixels.arrow"
    with pa.OSFile(str(sink), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)
    t0 = time.process_time()
    with pa.memory_map(str(sink)) as src:
        col = pa.ipc.open_file(src).read_all().column("pixels")
        for i in range(len(stored)):
            np.array(col[i].values.to_numpy(zero_copy_only=True), copy=True)
    read_cpu = (time.process_time() - t0) / len(picked)
    n = len(images)
    return {"images": n, "shard_bytes_with_refs": shard_bytes, "ref_bytes_per_image": ref_bytes / n,
            "file_bytes_per_image": file_bytes / n, "pixel_bytes_per_image": pixel_bytes / n,
            "decode_ms_per_image": 1000 * decode_cpu, "stored_pixels_ms_per_image": 1000 * read_cpu,
            "sampled": len(picked)}


def embedded_layout(out: Path, embedded: Path, rows: list[dict], sample: int) -> dict:
    """The ``--images embed`` run beside the reference run ``out``: its shard bytes (per image: what embedding adds
    over a reference, measured from the two runs' shards), and the loader's CPU per image to decode from the
    embedded bytes (the same images, and the same processor, as the reference run's timing; pixels checked equal)."""
    from packers import PixelLoader, VisionSpec
    from PIL import Image
    import io

    spec = VisionSpec.from_json(json.loads((embedded / "manifest.json").read_text())["vision"])
    by_name = {img["path"]: img["bytes"] for r in rows_of(embedded) for img in r["images"]}  # file name -> bytes
    refs = [img for r in rows for img in r["images"]]
    if len(by_name) != len(refs) or any(b is None for b in by_name.values()):
        raise SystemExit(f"the embedded run holds {len(by_name)} named images for {len(refs)} references")
    ref_shards = sum(f.stat().st_size for f in out.rglob("*.arrow"))
    shards = sum(f.stat().st_size for f in embedded.rglob("*.arrow"))
    ref_bytes = sum(len(img["path"].encode()) for img in refs)
    processor = PixelLoader(vision=spec).image_processor  # the loader's own processor
    picked = [by_name[os.path.basename(img["path"])] for img in refs[:sample]]

    def decode(data: bytes) -> np.ndarray:
        with Image.open(io.BytesIO(data)) as im:
            return processor(images=[im.convert("RGB")], return_tensors="np")["pixel_values"]

    decode_cpu = _cpu_per_item(decode, picked)
    for img, data in zip(refs[:sample], picked):  # outside the timing: the same pixels as from the file
        with Image.open(img["path"]) as im:
            assert np.array_equal(decode(data), processor(images=[im.convert("RGB")], return_tensors="np")["pixel_values"])
    n = len(refs)
    return {"shard_bytes_embedded": shards, "shard_bytes_refs": ref_shards,
            "embedded_bytes_per_image": (shards - ref_shards + ref_bytes) / n,
            "decode_embedded_ms_per_image": 1000 * decode_cpu}


def make_heavy_set(folder: Path, records: int, seed: int) -> Path:
    """An image-heavy JSONL: ``records`` short records, each naming one 2400 x 1800 PNG (a tiled noise pattern:
    cheap to write, a full decode to size and check, ~14 ms each here), so the run's work is in its images and the
    JSONL is a few dozen KiB: what ``--workers auto`` once sized by the JSONL's bytes alone (one worker, one task)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    lines = []
    for r in range(records):
        tile = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
        name = f"img/h{r:05d}.png"
        Image.fromarray(np.tile(tile, (29, 38, 1))[:1800, :2400]).save(folder / name, compress_level=1)
        lines.append({"id": f"h{r}", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": name}},
                                         {"type": "text", "text": _text(rng, 20)}]},
            {"role": "assistant", "content": _text(rng, 30)}]})
    path = folder / "heavy.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def make_video_set(folder: Path, records: int, seed: int) -> Path:
    """A JSONL of ``records`` records, each one MPEG-4 clip (2-20 s at 24 or 30 fps, 320 x 240, a moving gradient:
    cheap to write) and a question, written with PyAV; a third also hold an image."""
    import fractions

    import av
    from PIL import Image

    rng = np.random.default_rng(seed)
    (folder / "vid").mkdir(parents=True, exist_ok=True)
    ramp = np.linspace(0, 255, 320, dtype=np.float32)[None, :, None]
    lines = []
    for r in range(records):
        fps = int(rng.choice([24, 30]))
        frames = int(rng.uniform(2, 20) * fps)
        name = f"vid/{r:04d}.mp4"
        with av.open(str(folder / name), "w") as c:
            st = c.add_stream("mpeg4", rate=fractions.Fraction(fps))
            st.width, st.height, st.pix_fmt = 320, 240, "yuv420p"
            for i in range(frames):
                frame = np.broadcast_to((ramp + 3 * i) % 256, (240, 320, 3)).astype(np.uint8)
                for packet in st.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    c.mux(packet)
            for packet in st.encode():
                c.mux(packet)
        parts = [{"type": "video", "video": name}]
        if r % 3 == 0:
            Image.new("RGB", (int(rng.integers(200, 900)), int(rng.integers(200, 900))), "teal").save(
                folder / f"vid/{r:04d}.png")
            parts.append({"type": "image_url", "image_url": {"url": f"vid/{r:04d}.png"}})
        parts.append({"type": "text", "text": _text(rng, 20)})
        lines.append({"id": f"v{r}", "messages": [{"role": "user", "content": parts},
                                                   {"role": "assistant", "content": _text(rng, 60)}]})
    path = folder / "videos.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def video_section(folder: Path, tokenizer: Path, records: int, budget: int, batch: int, seed: int,
                  sample: int) -> dict:
    """The video set packed with ``--video-fps 2`` (Qwen2-VL's default sampling): packed vs padded token slots, the
    pack's wall time, and the loader's CPU per video (header, decode of the sampled frames, resize, patchify)."""
    from packers import PackedDataset, PixelLoader
    from packers._video import VideoLoader

    data = make_video_set(folder / "data", records, seed)
    out = folder / "out"
    cmd = [sys.executable, "-m", "pipeline.cli", "pack", str(data), "--output", str(out), "--no-progress",
           "--tokenizer", str(tokenizer), "--processor", "qwen2-vl", "--video-fps", "2", "--max-tokens", str(budget)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"video pack failed ({done.returncode}):\n{done.stderr[-3000:]}")
    seconds = time.perf_counter() - t0
    manifest = json.loads((out / "manifest.json").read_text())
    rows = rows_of(out)
    fill = packed_vs_padded(rows, budget, batch, seed)
    video_tokens = sum(int(np.prod(np.reshape(r["video_grid_thw"], (-1, 3)), axis=1).sum()) // 4 for r in rows)
    frames = [int(g[0]) * 2 for r in rows for g in np.reshape(r["video_grid_thw"], (-1, 3))]
    ds = PackedDataset(out)
    loader = VideoLoader(PixelLoader(vision=ds.vision))
    videos = [(v, g) for r in rows for v, g in zip(r["videos"], np.reshape(r["video_grid_thw"], (-1, 3)))][:sample]
    cpu = _cpu_per_item(lambda item: loader([item[0]], [item[1]], ["video"]), videos, passes=1)
    return {"video_records": records, "video_packed": manifest["counts"]["examples_packed"],
            "video_dead_letters": manifest["counts"].get("rejected", 0), "video_pack_seconds": seconds,
            "video_tokens": video_tokens, "video_frames_mean": float(np.mean(frames)) if frames else 0.0,
            "video_decode_ms_per_video": cpu * 1e3, "video_sampled": len(videos),
            **{f"video_{k}": v for k, v in fill.items()}}


def workers_speedup(data: Path, out: Path, tokenizer: Path, budget: int, max_pixels: int | None,
                    repeats: int) -> dict:
    """The same image set packed with ``--workers 1`` and ``--workers auto``, alternately, ``repeats`` times each:
    the best wall time of each, the workers and read tasks ``auto`` chose and why (``--processor`` runs size both
    by the images' measured work, not the JSONL's bytes)."""
    best = {"1": float("inf"), "auto": float("inf")}
    chosen = {}
    for _ in range(repeats):
        for w in best:
            m = pack(data, out / w, tokenizer, budget, max_pixels, workers=w)
            best[w] = min(best[w], m["_seconds"])
            if w == "auto":
                chosen = m.get("run", {})
    return {"pack_seconds_1_worker": best["1"], "pack_seconds_auto": best["auto"],
            "auto_workers": chosen.get("workers"), "auto_why": chosen.get("why"),
            "auto_speedup": best["1"] / best["auto"]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=400)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--batch", type=int, default=8, help="examples per padded batch")
    p.add_argument("--max-pixels", type=int, default=None,
                   help="the processor's max_pixels (default: Qwen2-VL's shipped 12845056)")
    p.add_argument("--sample", type=int, default=60, help="images decoded to time the loader")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--repeats", type=int, default=2, help="packs per --workers setting for the speed-up (best kept)")
    p.add_argument("--no-speedup", action="store_true", help="skip the --workers 1 / auto comparison")
    p.add_argument("--video-records", type=int, default=40, help="records of the video set (one clip each; 0: skip)")
    p.add_argument("--heavy-records", type=int, default=160,
                   help="records of the image-heavy set the --workers speed-up is measured on (one large PNG each)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = make_set(tmp / "data", args.records, args.seed)
        tok = vision_tokenizer(tmp / "tok")
        manifest = pack(data, tmp / "out", tok, args.budget, args.max_pixels)
        rows = rows_of(tmp / "out")
        fill = packed_vs_padded(rows, args.budget, args.batch, args.seed)
        layout = media_layout(tmp / "out", rows, manifest["vision"], args.sample)
        embedded = pack(data, tmp / "embedded", tok, args.budget, args.max_pixels, images="embed")
        layout.update(embedded_layout(tmp / "out", tmp / "embedded", rows, args.sample),
                      pack_seconds_embedded=embedded["_seconds"])
        speed = {} if args.no_speedup else workers_speedup(make_heavy_set(tmp / "heavy", args.heavy_records, args.seed),
                                                           tmp / "speed", tok, args.budget, args.max_pixels,
                                                           args.repeats)
        layout.update(speed)
        video = {} if not args.video_records else video_section(tmp / "video", tok, args.video_records, args.budget,
                                                                args.batch, args.seed, min(args.sample, 10))
        layout.update(video)
    figures = {"records": args.records, "budget": args.budget, "pack_seconds": manifest["_seconds"],
               "dead_letters": manifest.get("counts", {}).get("rejected"), **fill, **layout}
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    print(f"{args.records} records -> {fill['examples']} examples, {layout['images']} images "
          f"({fill['image_tokens']:,} image tokens of {fill['useful_tokens']:,}); budget {args.budget}")
    print(f"{'layout':<8} {'rows':>6} {'token slots':>12} {'useful':>8} {'useful/row':>11}")
    print(f"{'packed':<8} {fill['packed_rows']:>6} {fill['packed_slots']:>12,} {fill['packed_fill']:>8.1%} "
          f"{fill['useful_per_row_packed']:>11,.0f}")
    print(f"{'padded':<8} {fill['padded_rows']:>6} {fill['padded_slots']:>12,} {fill['padded_useful']:>8.1%} "
          f"{fill['useful_per_row_padded']:>11,.0f}")
    print(f"token slots padded / packed: {fill['padded_slots'] / fill['packed_slots']:.2f}x; packstream pack took "
          f"{manifest['_seconds']:.1f} s (every image sized and decoded once)")
    print(f"media per image: reference {layout['ref_bytes_per_image']:,.0f} B, encoded file "
          f"{layout['file_bytes_per_image']:,.0f} B, decoded pixel_values {layout['pixel_bytes_per_image']:,.0f} B "
          f"({layout['pixel_bytes_per_image'] / layout['file_bytes_per_image']:.0f}x the file)")
    mib = 2**20
    print(f"shards: reference {layout['shard_bytes_refs'] / mib:,.1f} MiB, embedded (--images embed) "
          f"{layout['shard_bytes_embedded'] / mib:,.1f} MiB: {layout['embedded_bytes_per_image']:,.0f} B per image "
          f"in the shard; pack took {layout['pack_seconds_embedded']:.1f} s embedded")
    print(f"loader CPU per image: decode + preprocess from the file {layout['decode_ms_per_image']:.1f} ms, from "
          f"embedded bytes {layout['decode_embedded_ms_per_image']:.1f} ms, read stored pixels "
          f"{layout['stored_pixels_ms_per_image']:.2f} ms ({layout['sampled']} images)")
    if video:
        print(f"videos ({video['video_records']} clips of 2-20 s, 320x240, --video-fps 2: {video['video_frames_mean']:.0f} "
              f"frames each on average; {video['video_packed']} packed, {video['video_dead_letters']} dead letters): "
              f"{video['video_tokens']:,} video tokens of {video['video_useful_tokens']:,}")
        print(f"  packed {video['video_packed_rows']} rows, {video['video_packed_slots']:,} token slots "
              f"({video['video_packed_fill']:.1%} useful); padded {video['video_padded_rows']} rows, "
              f"{video['video_padded_slots']:,} slots ({video['video_padded_useful']:.1%} useful): "
              f"{video['video_padded_slots'] / video['video_packed_slots']:.2f}x the slots; pack took "
              f"{video['video_pack_seconds']:.1f} s; loader CPU per video {video['video_decode_ms_per_video']:.0f} ms "
              f"({video['video_sampled']} videos: header, decode of the sampled frames, resize, patchify)")
    if speed:
        print(f"image-heavy set ({args.heavy_records} records, one 2400x1800 PNG each), pack wall, best of "
              f"{args.repeats}: --workers 1 {speed['pack_seconds_1_worker']:.2f} s, --workers auto "
              f"{speed['pack_seconds_auto']:.2f} s ({speed['auto_workers']} workers: {speed['auto_why']}): "
              f"{speed['auto_speedup']:.2f}x")


if __name__ == "__main__":
    main()
