"""Pixels equal the processor's for every image mode PIL opens (issue 55).

Generated image files in every mode PIL opens them as (RGB, RGBA partly transparent, LA, L, P without and with
transparency -- an index, an alpha table, a GIF's --, L and RGB with a tRNS colour, CMYK, I;16, I, F, 1, 16-bit RGBA,
RGB and LA PNGs; as PNG, JPEG, GIF, TIFF and WebP), of random sizes, the JPEG, PNG, WebP and TIFF ones with a random
EXIF orientation (one PNG with its eXIf chunk after the image data), are sized the packer's way
(``pipeline._media.measure``), collated by ``Collator(vision=spec)`` and compared with the family's transformers image
processor run on the same files the way transformers loads a file (``PIL.ImageOps.exif_transpose`` of
``Image.open``, as ``transformers.image_utils.load_image`` and ``datasets``' ``Image`` feature turn it, from the file's
bytes: see :func:`reference`; the processor's own ``convert_to_rgb`` then composites any transparency onto white): ``pixel_values`` and ``image_grid_thw`` (InternVL:
its tiles, ``num_patches``) agree within 1e-5, for Qwen2-VL, Qwen2.5-VL, Qwen3-VL, InternVL3 (GotOcr2), Gemma 3 and
LLaVA-1.5 (CLIP). ``load_image`` itself ends in ``convert("RGB")``, which drops alpha instead of compositing it: on
every file without transparency its pixels are the same (checked), on the others it differs and the processors'
compositing is the rule (packers/images.py).

End to end, examples holding RGBA, palette (transparent), LA, CMYK, 16-bit and EXIF-turned images, packed two to a row,
give a tiny Qwen2-VL's and a tiny Gemma 3's logits and per-example losses equal to each example's alone through the
processor (1e-5), and the job's packed image DPO pairs' completion log-probabilities equal each side's alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

import packers
from packers import Collator, PixelLoader, VisionSpec
from pipeline.cli import main
from tests._internals import VisionFamily, _media
from tests.test_vision_exact import END, IMAGE, START, mean_target_loss, pack_row, tiny_vl
from tests.test_vision_gemma3 import BOI, EOI, SOFT, preprocessor, processor_folder, tiny_gemma3
from tests.test_vision_pipeline import VISION_TOKENS, tokenizer  # noqa: F401 - tokenizer: a fixture

PIL = pytest.importorskip("PIL.Image")
from PIL import ExifTags, ImageOps, features  # noqa: E402 - after the importorskip

TOL = 1e-5
IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
MODES = {"RGB", "RGBA", "LA", "L", "P", "CMYK", "I;16", "I", "F", "1"}
"""The modes every generated set holds (each file's mode as PIL opens it is checked)."""


# -- the images ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Case:
    path: Path
    mode: str
    """The mode PIL opens it as."""
    transparent: bool
    """Whether it carries an alpha band or a transparency entry (convert_to_rgb composites it onto white)."""


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png16(path: Path, array: np.ndarray, color_type: int) -> None:
    """A 16-bit PNG PIL cannot write: ``array`` uint16 ``[h, w, channels]``; color type 2 RGB, 4 gray+alpha, 6 RGBA."""
    h, w = array.shape[:2]
    raw = b"".join(b"\x00" + array[y].astype(">u2").tobytes() for y in range(h))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0))
                     + _chunk(b"IDAT", zlib.compress(raw)) + _chunk(b"IEND", b""))


def _exif_after_pixels(path: Path) -> None:
    """Move a PNG's eXIf chunk after its image data (where PIL reads it only when it decodes)."""
    data, chunks, at = path.read_bytes(), [], 8
    while at < len(data):
        n = struct.unpack(">I", data[at:at + 4])[0]
        chunks.append(data[at:at + 12 + n])
        at += 12 + n
    exif = next(c for c in chunks if c[4:8] == b"eXIf")
    rest = [c for c in chunks if c[4:8] != b"eXIf"]
    path.write_bytes(data[:8] + b"".join(rest[:-1] + [exif, rest[-1]]))


def write_images(folder: Path, seed: int, turn: int | None = None) -> list[Case]:
    """One file per mode and container (see the module's docstring), of random sizes 4..160, partly transparent where
    the mode has transparency (fully transparent, opaque and in-between pixels), with a random EXIF orientation 1..8
    (``turn``: that one) where the container holds EXIF."""
    rng = np.random.default_rng(seed)
    cases: list[Case] = []

    def size() -> tuple[int, int]:
        return int(rng.integers(4, 161)), int(rng.integers(4, 161))

    def pixels(w: int, h: int, c: int = 3) -> np.ndarray:
        return rng.integers(0, 256, (h, w, c), dtype=np.uint8)

    def alpha(w: int, h: int) -> np.ndarray:
        a = rng.integers(1, 255, (h, w), dtype=np.uint8)
        a[rng.random((h, w)) < 0.3] = 0
        a[rng.random((h, w)) < 0.3] = 255
        return a

    def exif(quarter: bool = False) -> PIL.Exif:
        ex = PIL.Exif()
        ex[ExifTags.Base.Orientation] = turn or int(rng.integers(5, 9) if quarter else rng.integers(1, 9))
        return ex

    def save(name: str, im, transparent: bool = False, **kw) -> None:
        path = folder / name
        im.save(path, **kw)
        cases.append(Case(path, PIL.open(path).mode, transparent))

    w, h = size()
    save("rgb.png", PIL.fromarray(pixels(w, h)))
    save("rgb.jpg", PIL.fromarray(pixels(*size())), exif=exif().tobytes(), quality=90)
    rgba = lambda w, h: PIL.fromarray(np.dstack([pixels(w, h), alpha(w, h)]), "RGBA")  # noqa: E731
    save("rgba.png", rgba(*size()), True, exif=exif().tobytes())
    save("rgba_tail.png", rgba(*size()), True, exif=exif(quarter=True).tobytes())
    _exif_after_pixels(folder / "rgba_tail.png")
    save("rgba.tif", rgba(*size()), True, exif=exif())
    if features.check("webp"):
        save("rgba.webp", rgba(*size()), True, lossless=True, exif=exif().tobytes())
    save("la.png", rgba(*size()).convert("LA"), True)
    save("l.png", PIL.fromarray(pixels(*size(), 1)[..., 0]))
    save("l.jpg", PIL.fromarray(pixels(*size(), 1)[..., 0]), exif=exif().tobytes())
    grey = pixels(*size(), 1)[..., 0]
    save("l_trns.png", PIL.fromarray(grey), True, transparency=int(grey[0, 0]))
    colour = pixels(*size())
    colour[: max(1, colour.shape[0] // 3)] = colour[0, 0]
    save("rgb_trns.png", PIL.fromarray(colour), True, transparency=tuple(int(v) for v in colour[0, 0]))
    palette = lambda: PIL.fromarray(pixels(*size())).quantize(int(rng.integers(2, 64)))  # noqa: E731
    save("p.png", palette())
    p = palette()
    save("p_trns.png", p, True, transparency=int(np.asarray(p)[0, 0]))
    p = palette()
    save("p_alpha.png", p, True, transparency=bytes(rng.integers(0, 256, len(p.getpalette()) // 3, dtype=np.uint8)))
    p = palette()
    save("p_trns.gif", p, True, transparency=int(np.asarray(p)[0, 0]))
    save("cmyk.jpg", PIL.fromarray(pixels(*size(), 4), "CMYK"), exif=exif().tobytes())
    save("cmyk.tif", PIL.fromarray(pixels(*size(), 4), "CMYK"))
    w, h = size()
    save("i16.png", PIL.fromarray(rng.integers(0, 600, (h, w)).astype(np.uint16)))  # PIL clips I;16 -> RGB at 255
    w, h = size()
    save("i.tif", PIL.fromarray(rng.integers(-100, 400, (h, w)).astype(np.int32)), exif=exif())
    w, h = size()
    save("f.tif", PIL.fromarray(rng.normal(128, 120, (h, w)).astype(np.float32)))
    save("one.png", PIL.fromarray(pixels(*size(), 1)[..., 0]).convert("1"))
    for name, channels, kind in (("rgba16.png", 4, 6), ("rgb16.png", 3, 2), ("la16.png", 2, 4)):
        w, h = size()
        deep = rng.integers(0, 65536, (h, w, channels)).astype(np.uint16)
        if channels != 3:
            deep[..., -1] = alpha(w, h).astype(np.uint16) * 257
        _png16(folder / name, deep, kind)
        cases.append(Case(folder / name, PIL.open(folder / name).mode, channels != 3))
    assert {c.mode for c in cases} >= MODES, sorted({c.mode for c in cases})
    for c in cases:
        with PIL.open(c.path) as im:
            has = "A" in im.getbands() or im.info.get("transparency") is not None
        assert has == c.transparent, c
    return cases


def reference(path: Path):
    """The image as transformers loads a file, before its processor converts it: ``load_image``'s EXIF transpose
    (``datasets``' ``Image`` feature turns it the same way), the mode kept, so the processor's own conversion
    (``convert_to_rgb``: transparency onto white) runs on it. Read from the file's bytes: PIL 12.3 memory-maps an
    uncompressed TIFF opened by its name and, for one of a mappable mode (L, P, RGBA, CMYK, I;16) with an EXIF
    orientation of 5 to 8, maps it at its turned size, then turns it again (pixels scrambled, width and height
    unturned): opened from a file object or bytes, as packstream and ``datasets`` open them, it comes out upright."""
    return ImageOps.exif_transpose(PIL.open(io.BytesIO(path.read_bytes())))


def pil_maps_it_wrong(case: Case) -> bool:
    """Whether PIL opening ``case`` by name hits the memory-mapped TIFF bug (:func:`reference`)."""
    with PIL.open(io.BytesIO(case.path.read_bytes())) as im:
        turned = im.getexif().get(ExifTags.Base.Orientation) in (5, 6, 7, 8)
    return case.path.suffix == ".tif" and case.mode in ("L", "P", "RGBX", "RGBA", "CMYK", "I;16") and turned


# -- the families, each with its spec and transformers' processor set the same way ----------------------------------

def _qwen(family: VisionFamily, patch: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    side = patch * 2
    spec = VisionSpec(family=family, name=f"tiny-{family.value}", patch_size=patch, min_pixels=side * side * 2,
                      max_pixels=side * side * 16)
    norm = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if family is VisionFamily.QWEN3_VL else {}
    return spec, Qwen2VLImageProcessorPil(size={"shortest_edge": spec.min_pixels, "longest_edge": spec.max_pixels},
                                          patch_size=patch, merge_size=2, temporal_patch_size=2, **norm), {}


def _internvl():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    spec = VisionSpec(family=VisionFamily.INTERNVL, name="tiny-internvl", image_size=28, min_tiles=1, max_tiles=6,
                      tile_tokens=4, merge_size=1, temporal_patch_size=1, image_token="<IMG_CONTEXT>",
                      vision_start="<img>", vision_end="</img>")
    return spec, GotOcr2ImageProcessorPil(size={"height": 28, "width": 28}, min_patches=1, max_patches=6,
                                          **IMAGENET), {"crop_to_patches": True}


def _gemma3(tmp: Path):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    spec = VisionSpec.from_processor(processor_folder(tmp / "gemma3", preprocessor(28, 4), 4))
    # The class's do_convert_rgb (true). google's preprocessor_config.json writes it null, which transformers 5.25
    # keeps: such a processor converts nothing and refuses any PIL image not RGB already (mean of 3 values for 4
    # or 1 channels); given a path it gets load_image's RGB. The loader hands it RGB images either way.
    return spec, Gemma3ImageProcessorPil(size={"height": 28, "width": 28}), {}


def _llava():
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    spec = VisionSpec(family=VisionFamily.LLAVA, name="tiny-llava", image_size=42, patch_size=14, merge_size=1,
                      temporal_patch_size=1, image_token="<image>", vision_start=None, vision_end=None)
    # llava-hf/llava-1.5-*-hf ship a CLIPImageProcessor: resize the shortest edge, centre crop.
    return spec, CLIPImageProcessorPil(size={"shortest_edge": 42}, crop_size={"height": 42, "width": 42}), {}


FAMILIES = {
    "qwen2-vl": lambda tmp: _qwen(VisionFamily.QWEN2_VL, 14),
    "qwen2.5-vl": lambda tmp: _qwen(VisionFamily.QWEN2_5_VL, 14),
    "qwen3-vl": lambda tmp: _qwen(VisionFamily.QWEN3_VL, 16),
    "internvl3": lambda tmp: _internvl(),
    "gemma3": _gemma3,
    "llava-1.5": lambda tmp: _llava(),
}


def example(name: str, images: list[dict], grids: list[tuple[int, int, int]], spec: VisionSpec) -> dict:
    """An example of text and ``images`` (each its packed grid), the placeholder runs as packing writes them."""
    ids, offsets = [5, 6], []
    for grid in grids:
        ids.append(START)
        offsets.append(len(ids))
        ids += [IMAGE] * spec.grid_tokens(grid) + [END, 7]
    ids += [8, 9, 10]
    return dict(id=name, ids=ids, mask=[0] * (len(ids) - 3) + [1, 1, 1], offsets=offsets, grids=grids, images=images)


WORST: dict[str, float] = {}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_collated_pixels_equal_the_processors_for_every_mode(tmp_path_factory, family, seed):
    """Every mode, sized by the packer, collated, equals the family's processor on the files (see the module's
    docstring); the Collator that does not decode checks the same grids from the headers."""
    folder = tmp_path_factory.mktemp("modes")
    cases = write_images(folder, seed)
    spec, processor, kwargs = FAMILIES[family](folder)
    measured = _media.measure([c.path.name for c in cases], _media.MediaRoot.of(str(folder)), spec)
    # every other image embedded (``--images embed``: the loader reads its bytes), the others by their path
    refs = [{"path": m.path, "bytes": Path(m.path).read_bytes() if k % 2 else None} for k, m in enumerate(measured)]
    row = pack_row([example("e", refs, [m.grid for m in measured], spec)])
    Collator(vision=spec, decode_images=False)([row])  # the header-only check: every grid from its upright size
    batch = Collator(vision=spec)([row])
    want = processor(images=[reference(c.path) for c in cases], return_tensors="pt", **kwargs)
    got = batch["pixel_values"]
    assert got.shape == want["pixel_values"].shape
    diff = float((got - want["pixel_values"]).abs().max())
    WORST[family] = max(WORST.get(family, 0.0), diff)
    if diff > TOL:  # name the first image that differs
        per = [PixelLoader(vision=spec)([r])[0] for r in refs]
        one = [processor(images=[reference(c.path)], return_tensors="pt", **kwargs)["pixel_values"] for c in cases]
        bad = [(c.path.name, c.mode, float((a - b).abs().max())) for c, a, b in zip(cases, per, one)
               if a.shape != b.shape or (a - b).abs().max() > TOL]
        pytest.fail(f"{family}: pixels differ by {diff:.3g}; per image: {bad}")
    if spec.family.mrope:
        assert batch["image_grid_thw"].tolist() == want["image_grid_thw"].tolist()
    if spec.family is VisionFamily.INTERNVL:
        assert [m.grid[0] for m in measured] == want["num_patches"].tolist()
    print(f"{family}: {len(cases)} images, worst pixel difference so far {WORST[family]:.2e}")


PALETTE_WARNING = "ignore:Palette images with Transparency expressed in bytes:UserWarning"
"""PIL's warning when ``convert("RGB")`` drops a palette's alpha table (``load_image`` does, the tests' references)."""


@pytest.mark.filterwarnings(PALETTE_WARNING)
def test_load_image_gives_the_same_pixels_for_every_image_without_transparency(tmp_path):
    """The reference is ``load_image``'s, but for its last step: on a file without transparency the processor given
    ``load_image(path)`` gets the same RGB pixels (a quarter-turned EXIF image included); on one with transparency
    ``load_image`` drops alpha (PIL's ``convert("RGB")``) where the processors' ``convert_to_rgb`` composites it onto
    white, the rule packstream follows."""
    from transformers.image_transforms import convert_to_rgb
    from transformers.image_utils import load_image

    cases = write_images(tmp_path, 11, turn=6)
    dropped, mapped = 0, 0
    for c in cases:
        ours = np.asarray(PixelLoader(vision=VisionSpec.builtin("qwen2-vl")).open({"path": str(c.path)}))
        assert np.array_equal(ours, convert_to_rgb(reference(c.path), return_numpy=True)), c
        if pil_maps_it_wrong(c):  # load_image opens it by name: PIL's memory-mapped TIFF bug (see reference())
            mapped += 1
            continue
        theirs = np.asarray(load_image(str(c.path)))
        assert ours.shape == theirs.shape, c
        if not c.transparent:
            assert np.array_equal(ours, theirs), c
        else:
            dropped += not np.array_equal(ours, theirs)
    assert mapped == 1  # rgba.tif
    assert dropped >= 5, "load_image composites transparency now: the note in packers/images.py can go"


def test_a_quarter_turned_image_is_packed_for_its_turned_grid(tmp_path):
    """A 60x20 JPEG with EXIF orientation 6 (and a PNG with it after the pixels) is a 20x60 image to transformers:
    the packer's grid and the loader's header-only grid are that image's, the processor's."""
    spec = VisionSpec(family=VisionFamily.QWEN2_VL, min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 64)
    ex = PIL.Exif()
    ex[ExifTags.Base.Orientation] = 6
    PIL.new("RGB", (60, 20), "red").save(tmp_path / "turned.jpg", exif=ex.tobytes())
    PIL.new("RGBA", (60, 20), (0, 0, 255, 128)).save(tmp_path / "turned.png", exif=ex.tobytes())
    _exif_after_pixels(tmp_path / "turned.png")
    for name in ("turned.jpg", "turned.png"):
        (image,) = _media.measure([name], _media.MediaRoot.of(str(tmp_path)), spec)
        assert image.grid == spec.image_grid(20, 60) != spec.image_grid(60, 20)
        assert PixelLoader(vision=spec).grid_of({"path": str(tmp_path / name)}) == image.grid
        pixels, grids = PixelLoader(vision=spec)([{"path": str(tmp_path / name)}], [image.grid])
        assert grids.tolist() == [list(image.grid)]


# -- end to end ------------------------------------------------------------------------------------------------------

E2E = ["rgba.png", "p_trns.png", "la.png", "p_alpha.png", "cmyk.jpg", "rgba16.png", "p_trns.gif", "rgb.jpg"]


def _e2e_examples(spec: VisionSpec, folder: Path) -> list[dict]:
    """Four examples over the transparent, palette, CMYK and EXIF-turned (orientation 6) images; one text-only."""
    cases = {c.path.name: c for c in write_images(folder, 3, turn=6)}
    measured = _media.measure(E2E, _media.MediaRoot.of(str(folder)), spec)
    refs = [({"path": m.path, "bytes": None}, m.grid) for m in measured]
    split = [refs[:1], [], refs[1:4], refs[4:]]
    assert cases["rgba.png"].transparent and cases["p_trns.png"].transparent
    return [example(f"x{k}", [r for r, _ in part], [g for _, g in part], spec) for k, part in enumerate(split)]


@pytest.mark.parametrize("family", ["qwen2-vl", "gemma3"])
def test_packed_examples_in_every_mode_equal_each_example_alone(tmp_path, family):
    """Four examples (one text-only) over RGBA, palette with a transparent index and with an alpha table, LA, CMYK,
    16-bit RGBA, GIF and EXIF-turned images, two rows: the packed batch's logits and per-example losses equal each
    example's alone, its pixels from the processor on the files as transformers loads them."""
    spec, processor, _ = FAMILIES[family](tmp_path)
    examples = _e2e_examples(spec, tmp_path)
    if family == "gemma3":  # a sliding-window layer: the guard builds the packed masks
        model = tiny_gemma3(IMAGE + 8, {BOI: START, SOFT: IMAGE, EOI: END}, "sdpa").eval()
        guard = packers.install_packing_guard
    else:
        model, guard = tiny_vl("qwen2-vl", "sdpa").eval(), lambda _: contextlib.nullcontext()
    batch = Collator(vision=spec)([pack_row(examples[:2]), pack_row(examples[2:])])
    with torch.no_grad():
        with guard(model):
            packed = model(**batch).logits
            moved = model(**{**batch, "pixel_values": batch["pixel_values"].flip(-1)}).logits
        assert float((moved - packed).abs().max()) > 1e-4  # the comparison can fail: the pixels reach the logits
        losses = packers.example_losses(packed, batch)
        at, worst = 0, 0.0
        for i, ex in enumerate(examples):
            ids = torch.tensor([ex["ids"]])
            kwargs = {}
            if ex["images"]:
                out = processor(images=[reference(Path(r["path"])) for r in ex["images"]], return_tensors="pt")
                kwargs["pixel_values"] = out["pixel_values"]
                if family == "gemma3":
                    kwargs["token_type_ids"] = (ids == IMAGE).long()  # Gemma3Processor's: 1 on the soft tokens
                else:
                    assert out["image_grid_thw"].tolist() == [list(g) for g in ex["grids"]]
                    kwargs |= dict(image_grid_thw=out["image_grid_thw"], mm_token_type_ids=(ids == IMAGE).int())
            alone = model(input_ids=ids, use_cache=False, **kwargs).logits[0]
            n = len(ex["ids"])
            diff = float((packed[0, at:at + n] - alone).abs().max())
            worst = max(worst, diff)
            assert diff <= TOL, f"{ex['id']}: logits differ by {diff:.2e}"
            assert float(losses.loss[i]) == pytest.approx(float(mean_target_loss(alone, ex)), abs=TOL), ex["id"]
            at += n
    print(f"{family}: max logit diff {worst:.2e}")


@pytest.mark.filterwarnings(PALETTE_WARNING)
def test_dpo_pairs_with_images_in_every_mode_equal_each_side_alone(tmp_path, tokenizer):  # noqa: F811
    """Image pairs packed by the job (``--pairs --processor``; RGBA, palette, LA, CMYK and EXIF-turned prompts): each
    side's completion log-probability from the packed batch equals that side alone through the processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from tests.test_vision_end_to_end import _processor_folder, _reference, folded_qwen2_vl
    from tests.test_vision_pairs import _side_logp

    write_images(tmp_path, 5, turn=8)
    groups = [["rgba.png"], ["p_trns.png", "la.png"], [], ["cmyk.jpg", "p_alpha.png"], ["rgb.jpg"]]
    lines = [{"id": f"p{k}", "prompt": [{"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": n}} for n in names), {"type": "text", "text": "what is it"}]}],
        "chosen": [{"role": "assistant", "content": "a red square" * (k + 1)}],
        "rejected": [{"role": "assistant", "content": "a blue circle"}]} for k, names in enumerate(groups)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(tmp_path / "pairs.jsonl"), "--pairs", "--tokenizer", tokenizer,
                                       "--processor", str(_processor_folder(tmp_path / "proc")), "--max-tokens",
                                       "600", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["counts"]["rejected"] == 0

    ds = packers.PackedDataset(out)
    rows = ds.fetch(range(len(ds.rows)))
    model, fold, pad = folded_qwen2_vl(rows, tokenizer, "sdpa")
    processor = Qwen2VLImageProcessorPil(size={"shortest_edge": ds.vision.min_pixels,
                                               "longest_edge": ds.vision.max_pixels})
    batch = Collator(vision=ds.vision)([{**r, "input_ids": fold[r["input_ids"]]} for r in rows])
    with torch.no_grad():
        lp = packers.sequence_logps(model(**batch).logits, batch)
    alone: dict[str, list[float]] = {}  # pair id -> [chosen, rejected], as the rows hold them
    for row in rows:
        offs, spans = np.asarray(row["seq_offsets"]), np.asarray(row["completion_spans"]).reshape(-1, 2)
        for j, eid in enumerate(row["example_ids"]):
            a, z = int(offs[j]), int(offs[j + 1])
            mine = [im for im, o in zip(row["images"], np.asarray(row["image_offsets"])) if a <= o < z]
            tokens = row["input_ids"][a:z].tolist()
            ref = _reference(tokens, row["loss_mask"][a:z].tolist(), mine, pad, processor)  # the expansion
            assert ref["ids"] == tokens, eid
            if mine:  # the pixels of the files as transformers loads them (transparency on white, EXIF applied)
                ref["pixels"] = processor(images=[reference(Path(im["path"])) for im in mine], return_tensors="pt")
            ids = torch.from_numpy(fold[np.asarray(tokens)])[None]
            with torch.no_grad():
                logp = _side_logp(model, ref, ids, (int(spans[j, 0]) - a, int(spans[j, 1]) - a), int(fold[pad]))
            alone.setdefault(eid.rsplit("#", 1)[0], []).append(float(logp))
    assert len(lp.pair_ids) == len(groups) and all(len(v) == 2 for v in alone.values())
    worst = 0.0
    for k, pid in enumerate(lp.pair_ids):
        for side, got, want in (("chosen", lp.chosen[k], alone[pid][0]), ("rejected", lp.rejected[k], alone[pid][1])):
            worst = max(worst, abs(float(got) - want))
            assert abs(float(got) - want) <= 1e-4 * max(1.0, abs(want)), f"{pid} {side}: {float(got)} vs {want}"
    print(f"dpo pairs: max completion log-prob diff {worst:.2e}")
