"""``packstream pack --processor``: image+text records packed for a vision-language model (issue 27, pipeline side).

The tokenizer is the default one with Qwen2-VL's three vision tokens added (no hub); images are made with PIL.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

import packers
from packers import LongPolicy, VisionSpec
from pipeline import PackOptions
from tests._internals import Encoder, _media, _rows, pack_group
from pipeline.cli import main

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
SPEC = VisionSpec.builtin("qwen2-vl")


def save_tokenizer(folder: Path, tokens: list[str]) -> str:
    """The default tokenizer with ``tokens`` added as special tokens, saved to ``folder`` (what --tokenizer gets)."""
    from transformers import PreTrainedTokenizerFast

    from tests._internals import default_tokenizer_path

    tok = PreTrainedTokenizerFast.from_pretrained(default_tokenizer_path())
    tok.add_special_tokens({"additional_special_tokens": tokens})
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    """The default tokenizer with Qwen's vision tokens."""
    return save_tokenizer(tmp_path_factory.mktemp("vl-tokenizer"), VISION_TOKENS)


def _image(path: Path, size: tuple[int, int], color: str = "red") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


def _png_bytes(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, "green").save(buf, "PNG")
    return buf.getvalue()


def _user_image(ref, text="what is it?") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ref}},
                                                      {"type": "text", "text": text}]},
                         {"role": "assistant", "content": "a square"}]}


def _pack(*args: str):
    result = CliRunner().invoke(main, ["pack", *args, "-q"])
    assert isinstance(result.exception, (SystemExit, type(None))), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def _read_rows(folder: Path) -> list[dict]:
    rows = []
    for path in sorted(folder.glob("train-*.arrow")):
        with pa.memory_map(str(path)) as f:
            rows += pa.ipc.open_stream(f).read_all().to_pylist()
    return rows


def _size_of(image: dict) -> tuple[int, int]:
    with Image.open(io.BytesIO(image["bytes"]) if image["bytes"] is not None else image["path"]) as im:
        return im.size


def _check_images(rows: list[dict], image_id: int, budget: int) -> int:
    """Every row within the budget; each image's run: its grid's token count of image tokens at its offset, inside
    one sequence, never a target, its grid the processor's for the image's size. Returns the images seen."""
    seen = 0
    for row in rows:
        ids, mask, offs = np.array(row["input_ids"]), np.array(row["loss_mask"]), row["image_offsets"]
        assert row["num_tokens"] == len(ids) <= budget
        assert len(row["image_grid_thw"]) == 3 * len(offs) == 3 * len(row["images"])
        starts = np.flatnonzero(ids == image_id)
        runs = [int(s) for s in starts if s == 0 or ids[s - 1] != image_id]
        assert runs == offs  # every run of image tokens is one image, in row order
        for k, at in enumerate(offs):
            grid = tuple(row["image_grid_thw"][3 * k:3 * k + 3])
            n = SPEC.grid_tokens(grid)
            assert grid == SPEC.image_grid(*_size_of(row["images"][k]))
            assert (ids[at:at + n] == image_id).all() and (at + n == len(ids) or ids[at + n] != image_id)
            assert not mask[at:at + n].any()
            seq = np.searchsorted(row["seq_offsets"], at, side="right")
            assert at + n <= row["seq_offsets"][seq]  # inside one example
            seen += 1
    return seen


def test_mixed_shapes_pack_with_exact_budgets_and_dead_letters(tmp_path, tokenizer):
    _image(tmp_path / "img" / "a.png", (64, 48))
    _image(tmp_path / "img" / "b.jpg", (200, 100), "blue")
    _image(tmp_path / "img" / "big.png", (2000, 2000))  # 5,000+ tokens: over the budget
    (tmp_path / "img" / "corrupt.png").write_bytes(b"not an image at all")
    data_url = "data:image/png;base64," + base64.b64encode(_png_bytes((30, 90))).decode()
    records = [
        _user_image("img/a.png"),                                                    # 1 OpenAI part
        {"messages": [{"role": "user", "content": "<image>compare<image>"},           # 2 LLaMA-Factory
                      {"role": "assistant", "content": "red, then blue"}], "images": ["img/a.png", "img/b.jpg"]},
        {"id": "llava-1", "image": "img/b.jpg",                                        # 3 LLaVA (sharegpt)
         "conversations": [{"from": "human", "value": "<image>\nWhat colour?"}, {"from": "gpt", "value": "Blue."}]},
        {"messages": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url}]},  # 4 data URL
                      {"role": "assistant", "content": "green"}]},
        {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this?"}]},
                      {"role": "assistant", "content": "red"}], "images": [str(tmp_path / "img" / "a.png")]},  # 5
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},  # 6 text
        _user_image("img/missing.png"),                                               # 7 bad_image
        _user_image("img/corrupt.png"),                                               # 8 bad_image
        {"messages": [{"role": "user", "content": "<image>one"}, {"role": "assistant", "content": "x"}],
         "images": ["img/a.png", "img/b.jpg"]},                                       # 9 placeholder_mismatch
        _user_image("img/big.png"),                                                   # 10 too_long
        _user_image("https://example.com/cat.png"),                                   # 11 remote_image
        {"messages": [{"role": "user", "content": "the token <|image_pad|> as text"},  # 12 placeholder_mismatch
                      {"role": "assistant", "content": "x"}]},
        _user_image("file://" + str(tmp_path / "img" / "b.jpg")),                    # 13 file URI
        {"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]},  # 14 video
                      {"role": "assistant", "content": "x"}]},
        _user_image("img/thin.png"),                                                  # 15 bad_image (aspect)
    ]
    _image(tmp_path / "img" / "thin.png", (1, 300))  # aspect ratio 300, over Qwen2-VL's 200: ImageSizeError
    src = tmp_path / "data" / "mix.jsonl"
    src.parent.mkdir()
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    # Relative paths resolve against the input's folder unless --media-root says otherwise: here, tmp_path.
    out = tmp_path / "out"
    r = _pack(str(src), "-o", str(out), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "--max-tokens", "600",
              "--max-reject-fraction", "1",
              "--media-root", str(tmp_path))
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["contract_version"] == packers.VISION_CONTRACT_VERSION and m["vision"] == SPEC.to_json()
    c = m["counts"]
    assert c["records_read"] == len(records)
    assert c["records_read"] == c["examples_packed"] + c["rejected"] + c["dropped_too_long"] + c["not_sampled"]
    dead = {json.loads(line)["position"]: json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()}
    assert {p: d["reason"] for p, d in dead.items()} == {
        7: "bad_image", 8: "bad_image", 9: "placeholder_mismatch", 10: "too_long", 11: "remote_image",
        12: "placeholder_mismatch", 14: "non_text_content", 15: "bad_image"}
    assert "missing.png" in dead[7]["detail"] and "does not exist" in dead[7]["detail"]
    assert "corrupt.png" in dead[8]["detail"] and "cannot be read" in dead[8]["detail"]
    assert "1 image placeholders" in dead[9]["detail"] and "2 in 'images'" in dead[9]["detail"]
    assert "never cut" in dead[10]["detail"] and "budget 600" in dead[10]["detail"]
    assert "videos are packed only for Qwen2-VL, Qwen2.5-VL and Qwen3-VL" in dead[14]["detail"]
    assert "aspect ratio 300" in dead[15]["detail"] and "thin.png" in dead[15]["detail"]
    assert c["examples_packed"] == 7

    rows = _read_rows(out)
    from tests._internals import load_tokenizer

    pad = load_tokenizer(tokenizer).backend_tokenizer.token_to_id("<|image_pad|>")
    assert _check_images(rows, pad, 600) == 7  # records 1, 2 (two), 3, 4 (bytes), 5, 13 (file:// URI)
    images = [i for row in rows for i in row["images"]]
    assert sum(i["bytes"] is not None and i["path"] is None for i in images) == 1  # the data URL's bytes
    assert {i["path"] for i in images if i["path"]} == {str(tmp_path / "img" / "a.png"), str(tmp_path / "img" / "b.jpg")}
    assert sum(len(row["example_ids"]) for row in rows) == c["examples_packed"]

    ds = packers.PackedDataset(str(out))
    assert len(ds.rows) == len(rows)
    checked = CliRunner().invoke(main, ["verify", str(out)])
    assert checked.exit_code == 0 and checked.output.strip().endswith("OK"), checked.output


def test_relative_paths_resolve_against_the_input_folder_by_default(tmp_path, tokenizer):
    _image(tmp_path / "data" / "pics" / "a.png", (120, 80))
    src = tmp_path / "data" / "in.jsonl"
    src.write_text(json.dumps(_user_image("pics/a.png")) + "\n")
    out = tmp_path / "out"
    assert _pack(str(src), "-o", str(out), "--tokenizer", tokenizer, "--processor", "qwen2-vl").exit_code == 0
    (row,) = _read_rows(out)
    assert row["images"] == [{"path": str(tmp_path / "data" / "pics" / "a.png"), "bytes": None}]
    assert row["image_grid_thw"] == list(SPEC.image_grid(120, 80))


def test_parquet_image_column_of_bytes_and_path_structs(tmp_path, tokenizer):
    sizes = [(64, 64), (300, 120), (90, 400)]
    table = pa.table({
        "messages": [[{"role": "user", "content": "<image>Describe."}, {"role": "assistant", "content": f"image {k}"}]
                     for k in range(len(sizes))],
        "images": [[{"bytes": _png_bytes(s), "path": f"img{k}.png"}] for k, s in enumerate(sizes)],
    })
    src = tmp_path / "in.parquet"
    pq.write_table(table, src)
    out = tmp_path / "out"
    r = _pack(str(src), "-o", str(out), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "--max-tokens", "1024")
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["examples_packed"] == 3 and m["counts"]["rejected"] == 0
    rows = _read_rows(out)
    images = sorted((i["path"], _size_of(i)) for row in rows for i in row["images"])
    assert images == [(f"img{k}.png", s) for k, s in enumerate(sizes)]
    from tests._internals import load_tokenizer

    assert _check_images(rows, load_tokenizer(tokenizer).backend_tokenizer.token_to_id("<|image_pad|>"), 1024) == 3


def test_option_errors_are_one_line(tmp_path, tokenizer):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(_user_image("a.png")) + "\n")
    out = str(tmp_path / "out")
    cases = [
        (["--processor", "no-such-model"], "no such file or folder"),
        (["--processor", "llava-1.5", "--image-max-pixels", "90000"], "no pixel limit applies; drop them"),
        (["--media-root", str(tmp_path)], "add --processor"),
        (["--processor", "qwen2-vl", "--media-root", str(tmp_path / "nope")], "no such folder"),
        (["--images", "embed"], "only --processor packs images; add --processor"),
        (["--processor", "qwen2-vl"], "pass the vision-language model's own tokenizer with --tokenizer"),  # default tok
    ]
    for extra, words in cases:
        args = [str(src), "-o", out, *extra] + ([] if extra[-1] == "qwen2-vl" else ["--tokenizer", tokenizer])
        r = _pack(*args)
        assert r.exit_code != 0, extra
        lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and words in lines[0], (extra, r.output)


def test_a_processor_folder_whose_image_token_the_tokenizer_lacks_stops_the_run(tmp_path, tokenizer):
    """A LLaVA processor folder: its placeholder <image> is no single token of a Qwen-vision tokenizer."""
    proc = tmp_path / "llava"
    proc.mkdir()
    (proc / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "CLIPImageProcessor", "crop_size": {"height": 336, "width": 336}, "patch_size": 14}))
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(_user_image("a.png")) + "\n")
    r = _pack(str(src), "-o", str(tmp_path / "out"), "--tokenizer", tokenizer, "--processor", str(proc))
    assert r.exit_code != 0
    assert "no single token for the processor's image_token '<image>'" in r.output and "--tokenizer" in r.output
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_text_only_options_record_nothing_new():
    """A run without --processor records no image option: its manifest and run id (so its bytes) stay as before."""
    d = PackOptions(inputs=("x.jsonl",), output="o").to_dict()
    assert "processor" not in d and "media_root" not in d and "images" not in d
    assert PackOptions(inputs=("x.jsonl",), output="o", processor="qwen2-vl").to_dict()["processor"] == "qwen2-vl"
    # --images: the default (reference) is recorded by no one, so image runs packed before it keep their id too.
    image_run = PackOptions(inputs=("x.jsonl",), output="o", processor="qwen2-vl")
    assert image_run.to_dict() == PackOptions(inputs=("x.jsonl",), output="o", processor="qwen2-vl",
                                              images="reference").to_dict()
    assert "images" not in image_run.to_dict()
    assert PackOptions(inputs=("x.jsonl",), output="o", processor="qwen2-vl", images="embed").to_dict()["images"] == "embed"


def test_long_split_never_cuts_an_image_example(tmp_path, tokenizer):
    _image(tmp_path / "a.png", (640, 480))  # 391 tokens
    enc = Encoder(PackOptions(inputs=("-",), tokenizer=tokenizer, processor="qwen2-vl", max_tokens=256,
                              long=LongPolicy.SPLIT, media_root=str(tmp_path)))
    long_text = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 400}]}
    out = enc.encode([(0, "in.jsonl", 1, _user_image("a.png")), (0, "in.jsonl", 2, long_text)])
    assert not out.rejected and len(out.batch) == 2
    group = pack_group(out.batch, enc.options, enc.eos_id)
    assert [r["reason"] for r in group.rejected] == ["too_long"] and group.rejected[0]["position"] == 1
    assert group.stats["split_examples"] == 1  # the text example is split as --long split says
    rows = group.batch.to_pylist()
    assert all(r["num_tokens"] <= 256 and r["images"] == [] and r["image_offsets"] == [] for r in rows)


# -- a property over generated records ------------------------------------------------------------

_SIZES = st.tuples(st.integers(8, 400), st.integers(8, 400))
_WORDS = st.text(st.sampled_from("abcdefgh ijk.,?"), max_size=40).map(lambda t: "w" + t)  # never blank


@st.composite
def _records(draw):
    """A record of 0-3 images of random sizes in random places of its user turn, as OpenAI parts or LLaMA-Factory
    <image> placeholders; with it, the same record's text with every image replaced by <|vision_start|><|vision_end|>
    (its text tokens), and the images' sizes."""
    sizes = draw(st.lists(_SIZES, max_size=3))
    words = draw(st.lists(_WORDS, min_size=len(sizes) + 1, max_size=len(sizes) + 1))
    answer = draw(_WORDS)
    as_parts = draw(st.booleans())
    text_only = "".join(w + "<|vision_start|><|vision_end|>" for w in words[:-1]) + words[-1]
    plain = {"messages": [{"role": "user", "content": text_only}, {"role": "assistant", "content": answer}]}
    names = [f"{w}x{h}.png" for w, h in sizes]
    if as_parts:
        parts = []
        for w, name in zip(words, names):
            parts += [{"type": "text", "text": w}, {"type": "image_url", "image_url": {"url": name}}]
        parts.append({"type": "text", "text": words[-1]})
        record = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}
    else:
        content = "".join(w + "<image>" for w in words[:-1]) + words[-1]
        record = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}],
                  "images": names}
    return record, plain, sizes


@pytest.fixture(scope="module")
def encoders(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sizes")
    vision = Encoder(PackOptions(inputs=("-",), tokenizer=tokenizer, processor="qwen2-vl", max_tokens=2048,
                                 media_root=str(folder)))
    text = Encoder(PackOptions(inputs=("-",), tokenizer=tokenizer, max_tokens=2048))
    return vision, text, folder


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(_records(), min_size=1, max_size=8))
def test_image_tokens_are_the_text_tokens_plus_each_images_count_and_nothing_is_lost(encoders, batch):
    vision, text, folder = encoders
    for _, _, sizes in batch:
        for w, h in sizes:
            if not (folder / f"{w}x{h}.png").exists():
                _image(folder / f"{w}x{h}.png", (w, h))
    enc = vision.encode([(0, "g.jsonl", i + 1, rec) for i, (rec, _, _) in enumerate(batch)])
    plain = text.encode([(0, "g.jsonl", i + 1, p) for i, (_, p, _) in enumerate(batch)])
    assert not enc.rejected and not plain.rejected
    assert len(enc.batch) == len(plain.batch) == len(batch)
    imgs = enc.batch.images
    for i, (_, _, sizes) in enumerate(batch):
        want = [SPEC.image_tokens(w, h) for w, h in sizes]
        assert int(enc.batch.lengths[i]) == int(plain.batch.lengths[i]) + sum(want)
        a, b = imgs.index[i], imgs.index[i + 1]
        assert [SPEC.grid_tokens(g) for g in imgs.grids[a:b]] == want
        ids, mask = enc.batch.tokens(i)
        for at, n in zip(imgs.offsets[a:b], want):
            assert (ids[at:at + n] == vision.image_id).all() and not mask[at:at + n].any()
    # Packed into rows of a small budget: every example is packed whole or dead-lettered, none lost.
    budget = 700
    group = pack_group(enc.batch, dataclasses.replace(vision.options, max_tokens=budget), vision.eos_id)
    reasons = Counter(r["reason"] for r in group.rejected)
    assert set(reasons) <= {"too_long"}
    assert group.stats["examples_packed"] + reasons["too_long"] == len(batch)
    assert reasons["too_long"] == int((enc.batch.lengths > budget).sum())
    rows = group.batch.to_pylist()
    assert all(r["num_tokens"] <= budget for r in rows)
    packed_images = sum(len(r["images"]) for r in rows)
    kept = enc.batch.lengths <= budget
    assert packed_images == int(imgs.counts[kept].sum())


def test_an_image_is_never_a_target_even_when_every_token_is(tmp_path, tokenizer):
    """--train-on all makes every token a target, the image's placeholder run excepted (and only it)."""
    from pipeline import TrainOn

    _image(tmp_path / "a.png", (100, 100))
    enc = Encoder(PackOptions(inputs=("-",), tokenizer=tokenizer, processor="qwen2-vl", train_on=TrainOn.ALL,
                              media_root=str(tmp_path)))
    out = enc.encode([(0, "in.jsonl", 1, _user_image("a.png"))])
    ids, mask = out.batch.tokens(0)
    at, n = int(out.batch.images.offsets[0]), SPEC.image_tokens(100, 100)
    assert n > 1 and (ids[at:at + n] == enc.image_id).all()
    assert not mask[at:at + n].any() and mask[:at].all() and mask[at + n:].all()


def test_preview_estimate_inspect_and_verify_understand_image_tokens(tmp_path, tokenizer):
    """The tools count image tokens: preview shows each image as one mark with its grid and token count (not a
    thousand placeholder tokens), estimate projects the images and their tokens, inspect reports them from the
    shards, and verify checks every image run against its grid (and finds a run edited after packing)."""
    sizes = [(64, 48), (300, 120), (90, 90)]
    records = [_user_image(str(_image(tmp_path / f"i{k}.png", s))) for k, s in enumerate(sizes)]
    records.append({"messages": [{"role": "user", "content": "no image"}, {"role": "assistant", "content": "ok"}]})
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    want = [SPEC.image_tokens(*s) for s in sizes]
    common = [str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl"]

    shown = CliRunner().invoke(main, ["preview", *common, "-n", "4"])
    assert shown.exit_code == 0, shown.output
    for k, (s, n) in enumerate(zip(sizes, want)):
        grid = "x".join(map(str, SPEC.image_grid(*s)))
        assert f"<image {tmp_path / f'i{k}.png'}: {n} tokens, grid {grid}>" in shown.output
        assert f"({n} in 1 images)" in shown.output
    assert "<|image_pad|><|image_pad|>" not in shown.output

    est = CliRunner().invoke(main, ["estimate", *common, "--json"])
    assert est.exit_code == 0, est.output
    vision = json.loads(est.output.strip().splitlines()[-1])["vision"]
    assert (vision["images"], vision["image_tokens"], vision["processor"]) == (3, sum(want), "qwen2-vl")

    out = tmp_path / "out"
    _pack(*common, "-o", str(out))
    report = CliRunner().invoke(main, ["inspect", str(out), "--json", "--no-plots"])
    v = json.loads(report.output)["vision"]
    assert (v["images"], v["image_tokens"], v["rows_with_images"], v["embedded_images"]) == (3, sum(want), 1, 0)
    assert v["tokens_per_image"]["p100"] == max(want)
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0

    # One image token turned into text: verify names the row and the image (and so does the loader).
    path = next(out.glob("train-*.arrow"))
    table = pa.ipc.open_stream(path.read_bytes()).read_all()
    rows = table.to_pylist()
    at = rows[0]["image_offsets"][-1] + 1
    rows[0]["input_ids"][at] = 5
    broken = pa.Table.from_pylist(rows, schema=table.schema)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(broken)
    path.write_bytes(sink.getvalue().to_pybytes())
    checked = CliRunner().invoke(main, ["verify", str(out)])
    assert checked.exit_code == 1 and "check images failed" in checked.output and "row 0" in checked.output


def _truncated_jpeg(path: Path) -> Path:
    """A JPEG cut in half: its header (and so its size) reads, its pixels do not."""
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (200, 300, 3), dtype=np.uint8)).save(buf, "JPEG")
    path.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    return path


def _bomb_png(path: Path) -> Path:
    """A PNG whose header claims 30,000 x 30,000 pixels: PIL refuses it as a decompression bomb."""
    import struct
    import zlib

    buf = io.BytesIO()
    Image.new("L", (1, 1)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    chunk = b"IHDR" + struct.pack(">IIBBBBB", 30000, 30000, 8, 0, 0, 0, 0)
    data[8:33] = struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
    path.write_bytes(bytes(data))
    return path


def test_images_that_do_not_decode_are_dead_letters_not_loader_crashes(tmp_path, tokenizer):
    """A file whose header reads but whose pixels do not (a JPEG cut short) and a decompression bomb are both
    bad_image dead letters at pack time: nothing the loader would later fail to decode is packed."""
    good = _image(tmp_path / "ok.png", (64, 64))
    cut, bomb = _truncated_jpeg(tmp_path / "cut.jpg"), _bomb_png(tmp_path / "bomb.png")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(_user_image(str(p))) + "\n" for p in (good, cut, bomb)))
    out = tmp_path / "out"
    _pack(str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "-o", str(out), "--max-reject-fraction", "1")
    dead = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [d["reason"] for d in dead] == ["bad_image", "bad_image"]
    assert "cut.jpg" in dead[0]["detail"] and "truncated" in dead[0]["detail"]
    assert "DecompressionBombError" in dead[1]["detail"]
    ds = packers.PackedDataset(out)
    batch = packers.Collator(vision=ds.vision)(ds.fetch(range(len(ds.rows))))
    assert batch["image_grid_thw"].tolist() == [list(SPEC.image_grid(64, 64))]


@pytest.mark.slow
def test_a_vision_run_writes_the_same_bytes_on_every_runner(tmp_path, tokenizer):
    """Images ride through the spill files and the packing groups alike on the local runner with one or two workers
    and on Beam's DirectRunner: the shards are byte-identical."""
    rng = np.random.default_rng(4)
    records = []
    for k in range(40):
        refs = [str(_image(tmp_path / f"i{k}_{j}.png", (int(rng.integers(20, 300)), int(rng.integers(20, 300)))))
                for j in range(int(rng.integers(0, 3)))]
        content = [{"type": "image_url", "image_url": {"url": r}} for r in refs] + [{"type": "text", "text": f"q{k}"}]
        records.append({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": f"a{k}"}]})
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    digests = []
    for name, extra in (("one", ["--workers", "1"]), ("two", ["--workers", "2"]), ("beam", ["--runner=DirectRunner"])):
        out = tmp_path / name
        _pack(str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "--max-tokens", "2048",
              "--group-size", "7", "-o", str(out), *extra)
        digests.append([p.read_bytes() for p in sorted(out.glob("*.arrow"))])
    assert digests[0] and digests[0] == digests[1] == digests[2]


def test_text_holding_the_image_marker_characters_cannot_move_an_image(tmp_path, tokenizer):
    """packstream marks an image's place with private-use characters until the template renders; a record whose own
    text holds a marker is refused, so no image is counted twice or put where the record did not put it."""
    img = str(_image(tmp_path / "a.png", (60, 60)))
    forged = _user_image(img, text="see \ue0000\ue001 here")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(forged) + "\n" + json.dumps(_user_image(img)) + "\n")
    out = tmp_path / "out"
    _pack(str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "-o", str(out))
    dead = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [d["reason"] for d in dead] == ["placeholder_mismatch"] and "U+E000" in dead[0]["detail"]
    assert json.loads((out / "manifest.json").read_text())["counts"]["examples_packed"] == 1


# -- --images embed: self-contained shards --------------------------------------------------------


def _collated(out: Path) -> dict:
    """Every row of the folder ``out``, collated as training reads it (pixels decoded by the default PixelLoader)."""
    ds = packers.PackedDataset(out)
    return packers.Collator(vision=ds.vision)(ds.fetch(range(len(ds.rows))))


def test_embedded_images_are_the_files_bytes_and_train_after_the_files_are_gone(tmp_path, tokenizer):
    """Three images named by path, one data URL, one text-only record: packed twice, by reference (the default)
    and with --images embed. The embedded rows hold each file's bytes under its file name (the data URL's bytes as
    in both runs), inspect counts all four as embedded, and once the image folder is moved away the embedded run
    still collates to the reference run's pixel_values; the reference run needs remap= to find the moved files."""
    img = tmp_path / "img"
    files = {"a.png": _image(img / "a.png", (64, 48)), "b.jpg": _image(img / "b.jpg", (200, 100), "blue"),
             "c.png": _image(img / "sub" / "c.png", (90, 90), "green")}
    data_url = "data:image/png;base64," + base64.b64encode(_png_bytes((30, 90))).decode()
    records = [_user_image("img/a.png"),
               {"messages": [{"role": "user", "content": "<image>compare<image>"},
                             {"role": "assistant", "content": "blue, then green"}], "images": ["img/b.jpg", "img/sub/c.png"]},
               _user_image(data_url),
               {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    common = [str(src), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "--max-tokens", "2048"]
    ref, emb = tmp_path / "ref", tmp_path / "emb"
    assert _pack(*common, "-o", str(ref)).exit_code == 0
    r = _pack(*common, "-o", str(emb), "--images", "embed")
    assert r.exit_code == 0, r.output

    config = json.loads((emb / "manifest.json").read_text())["config"]
    assert config["images"] == "embed" and "images" not in json.loads((ref / "manifest.json").read_text())["config"]
    stored = [i for row in _read_rows(emb) for i in row["images"]]
    by_name = {i["path"]: i["bytes"] for i in stored if i["path"]}
    assert by_name == {name: path.read_bytes() for name, path in files.items()}  # the files' bytes, as they were
    assert [i for i in stored if not i["path"]] == [{"path": None, "bytes": _png_bytes((30, 90))}]
    assert CliRunner().invoke(main, ["verify", str(emb)]).output.strip().endswith("OK")
    for out, embedded in ((ref, 1), (emb, 4)):
        report = CliRunner().invoke(main, ["inspect", str(out), "--json", "--no-plots"])
        v = json.loads(report.output)["vision"]
        assert (v["images"], v["embedded_images"]) == (4, embedded)

    want = _collated(ref)
    moved = tmp_path / "moved"
    img.rename(moved)  # the images are no longer where the rows of the reference run say
    got = _collated(emb)
    assert got["example_ids"] == want["example_ids"]
    assert torch_equal(got["image_grid_thw"], want["image_grid_thw"])
    assert torch_equal(got["pixel_values"], want["pixel_values"])
    ds = packers.PackedDataset(ref)
    with pytest.raises(packers.PackstreamError, match=r"cannot read .*/img/.*PixelLoader\(remap="):
        packers.Collator(vision=ds.vision)(ds.fetch(range(len(ds.rows))))
    pixels = packers.PixelLoader(vision=ds.vision, remap={str(img): str(moved)})
    remapped = packers.Collator(vision=ds.vision, pixels=pixels)(ds.fetch(range(len(ds.rows))))
    assert torch_equal(remapped["pixel_values"], want["pixel_values"])


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def test_an_image_over_the_embed_limit_is_a_dead_letter_naming_its_size_and_the_limit(tmp_path, tokenizer,
                                                                                     monkeypatch):
    """The limit is MAX_EMBED_BYTES (64 MiB); here made a little smaller than one of two files, so that one is
    refused as bad_image with its size, the limit and the fix, and the other is embedded."""
    help_text = {f.name: f.metadata for f in dataclasses.fields(PackOptions)}["images"]["cli"]["help"]
    assert f"at most {_media.MAX_EMBED_BYTES // 2**20} MiB per file" in help_text  # --help says the real limit
    small, big = _image(tmp_path / "small.png", (20, 20)), _image(tmp_path / "big.png", (300, 200))
    big.write_bytes(big.read_bytes() + b"\0" * 4096)  # trailing bytes PIL ignores: a valid, larger file
    monkeypatch.setattr(_media, "MAX_EMBED_BYTES", small.stat().st_size + 100)
    enc = Encoder(PackOptions(inputs=("-",), tokenizer=tokenizer, processor="qwen2-vl", images="embed",
                              media_root=str(tmp_path)))
    out = enc.encode([(0, "in.jsonl", 1, _user_image("small.png")), (0, "in.jsonl", 2, _user_image("big.png"))])
    assert out.batch.images.refs == [("small.png", small.read_bytes())]
    (dead,) = out.rejected
    size, limit = big.stat().st_size, small.stat().st_size + 100
    assert dead["reason"] == "bad_image" and dead["position"] == 2
    assert f"big.png' is {size:,} bytes, over the {limit:,} bytes limit" in dead["detail"]
    assert "--images reference" in dead["detail"]
    # By reference the same file is packed: the limit is on what a row stores.
    assert not Encoder(PackOptions(inputs=("-",), tokenizer=tokenizer, processor="qwen2-vl", media_root=str(tmp_path))
                       ).encode([(0, "in.jsonl", 2, _user_image("big.png"))]).rejected


def test_embed_refuses_what_it_cannot_read_as_dead_letters(tmp_path, tokenizer):
    """A missing file, a folder and a file that does not decode are bad_image under --images embed as by reference."""
    (tmp_path / "dir.png").mkdir()
    (tmp_path / "junk.png").write_bytes(b"not an image")
    enc = Encoder(PackOptions(inputs=("-",), tokenizer=tokenizer, processor="qwen2-vl", images="embed",
                              media_root=str(tmp_path)))
    out = enc.encode([(0, "in.jsonl", k + 1, _user_image(name)) for k, name in
                      enumerate(["gone.png", "dir.png", "junk.png"])])
    assert len(out.batch) == 0 and [d["reason"] for d in out.rejected] == ["bad_image"] * 3
    gone, folder, junk = (d["detail"] for d in out.rejected)
    assert "gone.png' does not exist" in gone and "--media-root" in gone
    assert "dir.png is a folder" in folder
    assert "junk.png" in junk and "cannot be read" in junk


def test_a_text_only_run_is_unchanged_by_the_images_option(tmp_path):
    """--images is an image option: a text-only run has the same manifest config (so run id and bytes) as before."""
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                            {"role": "assistant", "content": "Hello!"}]}) + "\n")
    out = tmp_path / "out"
    assert _pack(str(src), "-o", str(out)).exit_code == 0
    m = json.loads((out / "manifest.json").read_text())
    assert "images" not in m["config"] and m["contract_version"] != packers.VISION_CONTRACT_VERSION


@pytest.mark.parametrize("mode", ["grouped", "global"])
def test_embedded_images_over_a_chunk_are_written_in_several_batches_with_the_same_rows(tmp_path, tokenizer,
                                                                                       monkeypatch, mode):
    """A group whose rows embed more image bytes than CHUNK_IMAGE_BYTES is written as several record batches (one
    Arrow binary column holds 2 GiB at most): the same rows, in the same order, as one batch gives; the folder
    loads and verifies."""
    rng = np.random.default_rng(7)
    records = [_user_image(str(_image(tmp_path / f"i{k}.png", (int(rng.integers(30, 200)), int(rng.integers(30, 200))))),
                           text=f"q{k}") for k in range(12)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    args = [str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "--images", "embed", "--max-tokens",
            "512", "--mode", mode, "--num-shards", "2"]
    _pack(*args, "-o", str(tmp_path / "whole"))
    monkeypatch.setattr(_rows, "CHUNK_IMAGE_BYTES", 1)  # every row a batch of its own
    _pack(*args, "-o", str(tmp_path / "chunked"))
    for whole, chunked in zip(sorted((tmp_path / "whole").glob("train-*.arrow")),
                              sorted((tmp_path / "chunked").glob("train-*.arrow"))):
        with pa.memory_map(str(chunked)) as f:
            reader = pa.ipc.open_stream(f)
            table = reader.read_all()
        assert table.num_rows == 0 or len(table.to_batches()) == table.num_rows  # one batch a row
        with pa.memory_map(str(whole)) as f:
            assert pa.ipc.open_stream(f).read_all().to_pylist() == table.to_pylist()
    assert CliRunner().invoke(main, ["verify", str(tmp_path / "chunked")]).exit_code == 0
    ds = packers.PackedDataset(tmp_path / "chunked")
    assert sum(len(r["images"]) for r in ds.fetch(range(len(ds.rows)))) == 12


def test_a_fifo_a_device_or_a_folder_named_as_an_image_is_a_dead_letter_not_a_hang(tmp_path, tokenizer):
    """Image paths go through the one checked open (packers.files): opening a FIFO would block the worker for good;
    it, a device and a folder are bad_image dead letters naming what they are."""
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(_user_image(p)) + "\n" for p in (str(fifo), "/dev/zero", str(tmp_path))))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl",
                                       "--media-root", "/", "-o", str(out), "-q"])  # / : /dev/zero may be read
    assert result.exit_code == 3 and "Traceback" not in result.output  # nothing packed: exit 3, one line
    dead = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    assert [d["reason"] for d in dead] == ["bad_image"] * 3
    assert ["FIFO" in dead[0]["detail"], "device" in dead[1]["detail"], "folder" in dead[2]["detail"]] == [True] * 3
