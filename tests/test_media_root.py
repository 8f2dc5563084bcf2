"""Every image a row carries was meant to be there (issue 41): image reads stay under the media root.

The media root is ``--media-root``, else the folder of the input file that names the image. Every spelling of a
reference that leads out of it (``..``, an absolute path, ``file:`` URLs with and without a host, a link inside
the root to a file or a folder outside it, a datasets struct without bytes) is an ``outside_media_root`` dead
letter in both image modes, and no byte (nor path) of the outside file reaches a shard. A property test runs
generated references through the one resolver with every ``open`` watched, and through the whole job.

The layout every test builds (``tree``)::

    tmp/
      outside/secret.png            an image outside the root (noise: its bytes are unmistakable)
      outside/dir/secret.png
      root/data.jsonl               the input: its folder is the media root
      root/in.png                   an image inside the root
      root/sub/deep/in2.png
      root/link-out.png      -> ../outside/secret.png
      root/link-dir-out      -> ../outside/dir
      root/link-in.png       -> sub/deep/in2.png          (inside: fine)
      root/link-dir-in       -> sub/deep                  (inside: fine)
"""

from __future__ import annotations

import json
import os
import urllib.parse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

from packers import VisionSpec
from packers.files import OutsideRoot, open_beneath, real_folder, within
from pipeline import PackOptions
from pipeline.cli import main
from tests._internals import Encoder, _media
from tests.test_vision_pipeline import VISION_TOKENS, _pack, save_tokenizer

SPEC = VisionSpec.builtin("qwen2-vl")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    """The default tokenizer with Qwen's vision tokens and LLaVA's <image>."""
    return save_tokenizer(tmp_path_factory.mktemp("vl-tokenizer"), VISION_TOKENS + ["<image>"])


def _noise(path: Path, size=(40, 30), seed=0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


def _build(base: Path) -> dict[str, Path]:
    t = {"base": base, "root": base / "root", "outside": base / "outside"}
    t["secret"] = _noise(base / "outside" / "secret.png", seed=1)
    t["secret2"] = _noise(base / "outside" / "dir" / "secret.png", seed=2)
    t["in"] = _noise(base / "root" / "in.png", seed=3)
    t["in2"] = _noise(base / "root" / "sub" / "deep" / "in2.png", seed=4)
    root = t["root"]
    os.symlink("../outside/secret.png", root / "link-out.png")
    os.symlink("../outside/dir", root / "link-dir-out")
    os.symlink("sub/deep/in2.png", root / "link-in.png")
    os.symlink("sub/deep", root / "link-dir-in")
    return t


@pytest.fixture
def tree(tmp_path) -> dict[str, Path]:
    return _build(tmp_path)


def _user(ref, text="what is it?") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ref}}
                                                      if not isinstance(ref, dict) else {"type": "image", "image": ref},
                                                      {"type": "text", "text": text}]},
                         {"role": "assistant", "content": "a picture"}]}


def _escapes(t: dict[str, Path]) -> dict[str, object]:
    """Every spelling of a reference out of ``root`` the issue lists (and two more)."""
    secret = str(t["secret"])
    depth = len(t["root"].parts) - 1
    return {
        "dot-dot": "../" * depth + secret.lstrip("/"),          # ../../../../<secret>, from the root
        "absolute": secret,
        "file:///": "file://" + secret,
        "file://otherhost/": "file://otherhost" + secret,
        "file:/": "file:" + secret,
        "file://localhost/": "file://localhost" + secret,
        "file: percent-escaped ..": "file://" + urllib.parse.quote(str(t["root"])) + "/%2e%2e/outside/secret.png",
        "link to a file": "link-out.png",
        "link to a folder": "link-dir-out/secret.png",
        "struct without bytes": {"bytes": None, "path": secret},
    }


def _dead(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]


def _outside_bytes_absent(out: Path, t: dict[str, Path]) -> None:
    """No byte of an outside image and no outside path in any file the run wrote."""
    secrets = [t["secret"].read_bytes(), t["secret2"].read_bytes()]
    for f in out.iterdir():
        data = f.read_bytes()
        for s in secrets:
            assert s[-64:] not in data, f  # the image's last bytes (its IDAT data and IEND)
        if f.suffix == ".arrow":
            assert str(t["outside"]).encode() not in data and b"secret.png" not in data, f


@pytest.mark.parametrize("storage", ["reference", "embed"])
def test_every_escape_is_an_outside_media_root_dead_letter_in_both_image_modes(tree, tokenizer, storage):
    escapes = _escapes(tree)
    records = [_user(ref) for ref in escapes.values()] + [_user("in.png")]  # and one image inside: packed
    data = tree["root"] / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tree["base"] / f"out-{storage}"
    r = _pack(str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "--images", storage, "-o", str(out),
              "--max-reject-fraction", "1")  # every escape is refused: most of the records
    assert r.exit_code == 0, r.output
    dead = {d["position"] - 1: d for d in _dead(out)}  # positions count lines from 1
    for position, (name, ref) in enumerate(escapes.items()):
        assert dead[position]["reason"] == "outside_media_root", (name, dead.get(position))
        assert str(tree["root"]) in dead[position]["detail"], name  # it names the root
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["examples_packed"] == 1 and manifest["counts"]["rejected"] == len(escapes)
    assert manifest["media_roots"] == [str(tree["root"])]
    _outside_bytes_absent(out, tree)


def test_a_parquet_struct_without_bytes_is_held_under_the_root_too(tree, tokenizer):
    """Hugging Face datasets' Image column, as Parquet: {bytes: null, path: "/abs"} is its path, and is checked."""
    table = pa.table({
        "images": [[{"bytes": None, "path": str(tree["secret"])}], [{"bytes": None, "path": str(tree["in"])}]],
        "messages": [[{"role": "user", "content": "<image> what?"}, {"role": "assistant", "content": "noise"}]] * 2,
    })
    data = tree["root"] / "d.parquet"
    pq.write_table(table, data)
    out = tree["base"] / "out"
    r = _pack(str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "--images", "embed", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert [d["reason"] for d in _dead(out)] == ["outside_media_root"]
    _outside_bytes_absent(out, tree)


def test_links_that_stay_inside_the_root_are_read(tree, tokenizer):
    records = [_user(ref) for ref in ("link-in.png", "link-dir-in/in2.png", "sub/../in.png", str(tree["in"]),
                                      "file://" + str(tree["in"]))]
    data = tree["root"] / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tree["base"] / "out"
    r = _pack(str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["counts"]["examples_packed"] == len(records)


def test_media_root_slash_says_images_may_lie_anywhere_and_the_summary_names_it(tree, tokenizer):
    data = tree["root"] / "data.jsonl"
    data.write_text(json.dumps(_user(str(tree["secret"]))) + "\n")
    out = tree["base"] / "out"
    r = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl",
                                  "--media-root", "/", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert any(line.split() == ["images", "read", "under", "/"] for line in r.output.splitlines()), r.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["media_roots"] == ["/"] and manifest["config"]["media_root"] == "/"
    assert manifest["counts"]["examples_packed"] == 1


def test_a_relative_media_root_is_stored_absolute_and_verify_works_from_another_folder(tree, tokenizer, monkeypatch):
    """Worked example: packed from tmp/ with --media-root root, verified from tmp/root/sub with ../../out (the image
    root read from the manifest, absolute; the input named as seen from there)."""
    data = tree["root"] / "data.jsonl"
    data.write_text(json.dumps(_user("sub/deep/in2.png")) + "\n")
    monkeypatch.chdir(tree["base"])
    r = _pack("root/data.jsonl", "--tokenizer", tokenizer, "--processor", "qwen2-vl", "--media-root", "root",
              "-o", "out")
    assert r.exit_code == 0, r.output
    manifest = json.loads((tree["base"] / "out" / "manifest.json").read_text())
    assert manifest["config"]["media_root"] == str(tree["root"]) == manifest["media_roots"][0]
    monkeypatch.chdir(tree["root"] / "sub")
    v = CliRunner().invoke(main, ["verify", "../../out", "../data.jsonl", "--inputs"])  # INPUT as seen from here
    assert v.exit_code == 0, v.output


def test_an_empty_media_root_is_refused_in_one_line(tree, tokenizer):
    r = _pack(str(tree["root"] / "x.jsonl"), "--processor", "qwen2-vl", "--media-root", "", "-o",
              str(tree["base"] / "o"))
    assert r.exit_code != 0 and "--media-root '' is empty" in r.output and len(r.output.strip().splitlines()) == 1


# -- the check holds at open time ---------------------------------------------------------------

def test_a_folder_swapped_for_a_link_after_the_look_up_is_not_followed(tree):
    root = real_folder(str(tree["root"]))
    real = within(root, str(tree["in2"]), what="image")  # the look-up: root/sub/deep/in2.png, inside
    (tree["root"] / "sub").rename(tree["base"] / "moved")
    os.symlink(str(tree["outside"]), tree["root"] / "sub")  # root/sub -> outside/: a file of the same name waits
    _noise(tree["outside"] / "deep" / "in2.png", seed=9)
    with pytest.raises(OutsideRoot, match="changed while it was opened"):
        open_beneath(root, real, what="image")


def test_a_file_swapped_for_a_link_after_the_look_up_is_not_followed(tree):
    root = real_folder(str(tree["root"]))
    real = within(root, str(tree["in"]), what="image")
    os.remove(tree["in"])
    os.symlink(str(tree["secret"]), tree["in"])
    with pytest.raises(OutsideRoot):
        open_beneath(root, real, what="image")


def test_open_beneath_reads_a_file_under_the_root(tree):
    root = real_folder(str(tree["root"]))
    with open_beneath(root, within(root, str(tree["root"] / "link-in.png"), what="image"), what="image") as f:
        assert f.read() == tree["in2"].read_bytes()


# -- the property: generated references, every open watched --------------------------------------

_TARGETS = {  # name -> (path under base, where its real file is: "in", "out" or "missing")
    "in": ("root/in.png", "in"), "in2": ("root/sub/deep/in2.png", "in"), "secret": ("outside/secret.png", "out"),
    "secret2": ("outside/dir/secret.png", "out"), "link-out": ("root/link-out.png", "out"),
    "link-dir-out": ("root/link-dir-out/secret.png", "out"), "link-in": ("root/link-in.png", "in"),
    "link-dir-in": ("root/link-dir-in/in2.png", "in"), "missing-in": ("root/nope.png", "missing"),
    "missing-out": ("outside/nope.png", "out"),
}
_STARTS = ["root", "root/sub", "root/sub/deep", "outside", "."]  # the folder a relative spelling is written from


@st.composite
def references(draw):
    """A reference to one of the targets, spelled in any of the ways a record may: relative (with ``..`` at any
    depth and detours), absolute, ``file:`` URLs with no host, localhost or another host, structs with or
    without bytes."""
    target = draw(st.sampled_from(sorted(_TARGETS)))
    start = draw(st.sampled_from(_STARTS))
    detours = draw(st.lists(st.sampled_from(["sub", "link-dir-in", "link-dir-out", "nope"]), max_size=2))
    kind = draw(st.sampled_from(["relative", "absolute", "file:///", "file:/", "file://localhost", "file://host",
                                 "struct-path", "struct-bytes"]))
    return target, start, detours, kind


def _spell(t: dict[str, Path], target: str, start: str, detours: list[str], kind: str):
    """The reference as a string (or struct), and the real file it names (None: a remote host or held bytes)."""
    base = t["base"]
    path = base / _TARGETS[target][0]
    rel = os.path.relpath(path, base / start)
    # a detour through a folder and back out lexically (x/../): realpath resolves links before '..'
    rel = "/".join(f"{d}/.." for d in detours) + ("/" if detours else "") + rel
    # relative spellings are read against the root: re-anchor from the root
    from_root = os.path.relpath(base / start, t["root"]) + "/" + rel
    absolute = str(t["root"]) + "/" + from_root
    if kind == "relative":
        return from_root, absolute
    if kind == "absolute":
        return absolute, absolute
    if kind == "struct-path":
        return {"bytes": None, "path": absolute}, absolute
    if kind == "struct-bytes":
        return {"bytes": t["in"].read_bytes(), "path": absolute}, None
    quoted = urllib.parse.quote(absolute)
    return {"file:///": "file://" + quoted, "file:/": "file:" + quoted, "file://localhost": "file://localhost" + quoted,
            "file://host": "file://otherhost" + quoted}[kind], (None if kind == "file://host" else absolute)


def _expected(t: dict[str, Path], named, kind: str) -> str:
    """What the reference must give, decided independently of the resolver: "ok", or a dead-letter reason."""
    if kind == "struct-bytes":
        return "ok"
    if kind == "file://host":
        return "outside_media_root"
    real = os.path.realpath(os.path.normpath(named))  # x/../ goes as written (the stored path reads the same file)
    root = os.path.realpath(t["root"])
    if not real.startswith(root + os.sep):
        return "outside_media_root"
    return "ok" if os.path.isfile(real) else "bad_image"


@pytest.fixture(scope="module")
def shared_tree(tmp_path_factory) -> dict[str, Path]:
    return _build(tmp_path_factory.mktemp("tree"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(refs=st.lists(references(), min_size=1, max_size=4), embed=st.booleans())
def test_every_read_stays_under_the_root_for_generated_references(shared_tree, monkeypatch, refs, embed):
    """The one resolver and the checked open, on generated spellings: each image is read (only from under the
    root, every ``os.open`` watched) or refused with the reason the layout says, decided without the resolver."""
    t = shared_tree
    root = _media.media_root(None, str(t["root"]))
    opened: list[str] = []
    real_open = os.open

    def watched(path, flags, mode=0o777, *, dir_fd=None):
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        opened.append(os.readlink(f"/proc/self/fd/{fd}"))
        return fd

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to see which file an open reached")
    monkeypatch.setattr(os, "open", watched)
    storage = _media.ImageStorage.EMBED if embed else _media.ImageStorage.REFERENCE
    for target, start, detours, kind in refs:
        ref, named = _spell(t, target, start, detours, kind)
        want = _expected(t, named, kind)
        try:
            (image,) = _media.measure([ref], root, SPEC, storage)
            got, detail = "ok", ""
        except _media.Rejected as e:
            got, detail = e.reason.value, e.detail
        assert got == want, (ref, detail)
        if got == "ok" and embed:
            assert image.data in (t["in"].read_bytes(), t["in2"].read_bytes())
    for path in opened:
        assert path == root.real or path.startswith(root.real + os.sep), path


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(refs=st.lists(references(), min_size=1, max_size=12), embed=st.booleans())
def test_generated_records_through_the_job_are_packed_or_dead_lettered_and_counts_reconcile(
        tmp_path_factory, tokenizer, refs, embed):
    t = _build(tmp_path_factory.mktemp("job"))
    records, want = [], []
    for target, start, detours, kind in refs:
        ref, named = _spell(t, target, start, detours, kind)
        if isinstance(ref, dict) and ref.get("bytes"):
            ref = {"bytes": None, "path": ref["path"]}  # JSON holds no bytes: its path is what is read
            named, kind = ref["path"], "struct-path"
        records.append(_user(ref))
        want.append(_expected(t, named, kind))
    data = t["root"] / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = t["base"] / "out"
    r = _pack(str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "--images",
              "embed" if embed else "reference", "-o", str(out))
    assert r.exit_code in (0, 3), r.output
    dead = {d["position"] - 1: d["reason"] for d in _dead(out)}
    assert [dead.get(i, "ok") for i in range(len(records))] == want
    c = json.loads((out / "manifest.json").read_text())["counts"]
    assert c["records_read"] == len(records) == c["examples_packed"] + c["rejected"]
    _outside_bytes_absent(out, t)


# -- placeholders: an <image> tag with no image --------------------------------------------------

def _tag_without_image(layout: str, folder: Path) -> Path:
    convo = [{"role": "user", "content": "<image> what is this?"}, {"role": "assistant", "content": "a cat"}]
    if layout == "json":
        path = folder / "d.json"
        path.write_text(json.dumps([{"instruction": "<image> what is this?", "output": "a cat", "images": []}]))
    elif layout == "messages":
        path = folder / "d.jsonl"
        path.write_text(json.dumps({"images": [], "messages": convo}) + "\n")
    elif layout == "llava":
        path = folder / "d.jsonl"
        path.write_text(json.dumps({"id": "1", "conversations": [{"from": "human", "value": "<image>\nwhat is this?"},
                                                                 {"from": "gpt", "value": "a cat"}]}) + "\n")
    else:
        path = folder / "d.csv"
        path.write_text("instruction,output,images\n<image> what is this?,a cat,\n")
    return path


@pytest.mark.parametrize("processor", ["qwen2-vl", "qwen2.5-vl", "llava-1.5"])
@pytest.mark.parametrize("layout", ["json", "messages", "llava", "csv"])
def test_a_tag_with_no_image_is_placeholder_mismatch_under_every_shipped_processor(tmp_path, tokenizer, processor,
                                                                                  layout):
    data = _tag_without_image(layout, tmp_path)
    out = tmp_path / "out"
    r = _pack(str(data), "--tokenizer", tokenizer, "--processor", processor, "-o", str(out))
    assert r.exit_code == 3, r.output  # nothing packed
    (dead,) = _dead(out)
    assert dead["reason"] == "placeholder_mismatch", dead
    assert "1 image placeholders" in dead["detail"]


@pytest.mark.parametrize("char", ["\ue000", "\ue001", "\ue002"])
def test_each_private_use_mark_character_in_a_record_is_refused(tmp_path, tokenizer, char):
    """docs/formats.md: U+E000..U+E002 in a record's text are refused under --processor, each of them."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(_user("in.png", text=f"look {char}0\ue001 here")) + "\n")
    _noise(tmp_path / "in.png")
    enc = Encoder(PackOptions(inputs=(str(path),), tokenizer=tokenizer, processor="qwen2-vl"),
                  {str(path): str(tmp_path)})
    (rejected,) = enc.encode([(0, str(path), 0, json.loads(path.read_text()))]).rejected
    assert rejected["reason"] == "placeholder_mismatch" and "U+E000, U+E001, U+E002" in rejected["detail"]
    assert "<image>" not in rejected["detail"]


def test_qwen_placeholder_text_in_a_record_is_counted_as_one_image(tmp_path, tokenizer):
    """The processor's own placeholder text stands for one image of the column, as <image> does."""
    _noise(tmp_path / "a.png")
    text = "<|vision_start|><|image_pad|><|vision_end|> what is this?"
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"images": ["a.png"], "messages": [{"role": "user", "content": text},
                                                                  {"role": "assistant", "content": "noise"}]}) + "\n")
    out = tmp_path / "out"
    r = _pack(str(path), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["counts"]["examples_packed"] == 1


@pytest.mark.parametrize("ref", ["\ud800.png", "x\x00y.png", "file:///%00", "", ".", "..", "/", "file:///",
                                 "file://[::1]/a.png", "a" * 5000, {"path": 5}, 7])
def test_odd_references_are_dead_letters_with_a_reason(tmp_path, ref):
    root = _media.media_root(None, str(tmp_path))
    with pytest.raises(_media.Rejected) as e:
        _media.measure([ref], root, SPEC)
    assert e.value.reason.value in ("bad_image", "bad_type", "outside_media_root") and "\n" not in e.value.detail


def test_pils_decompression_bomb_warning_is_counted_not_printed(tmp_path, tokenizer, monkeypatch, capfd):
    """An image over PIL's warning size (Image.MAX_IMAGE_PIXELS; here lowered so a small file crosses it) is packed,
    counted as large_image in the summary, and nothing is printed under -q."""
    import warnings

    from PIL import Image as PILImage

    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 1000)  # 40 x 30 = 1200 pixels: over it, under twice it
    path = _noise(tmp_path / "big.png")
    notes: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (image,) = _media.measure([str(path)], _media.media_root(None, str(tmp_path)), SPEC, notes=notes)
    assert notes == {"large_image": 1} and not caught
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(_user("big.png")) + "\n")
    r = CliRunner().invoke(main, ["pack", str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl",
                                  "--workers", "1", "-o", str(tmp_path / "out"), "-q"])
    assert r.exit_code == 0 and r.output == "", r.output
    assert "DecompressionBomb" not in capfd.readouterr().err
    counts = json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]
    assert counts["normalization"] == {"large_image": 1}


def test_verify_inputs_refuses_inputs_whose_images_would_resolve_under_another_root(tree, tokenizer):
    """The input copied to another folder: its images would resolve elsewhere, so verify says so in one line
    instead of comparing images read from another place."""
    data = tree["root"] / "data.jsonl"
    data.write_text(json.dumps(_user("in.png")) + "\n")
    out = tree["base"] / "out"
    assert _pack(str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "-o", str(out)).exit_code == 0
    copy = tree["base"] / "elsewhere" / "data.jsonl"
    copy.parent.mkdir()
    copy.write_text(data.read_text())
    v = CliRunner().invoke(main, ["verify", str(out), str(copy), "--inputs"])
    assert v.exit_code != 0 and "manifest.json media_roots" in v.output and str(tree["root"]) in v.output, v.output
    assert CliRunner().invoke(main, ["verify", str(out), str(data), "--inputs"]).exit_code == 0


def test_the_loader_reads_a_relative_row_path_only_under_its_root(tree):
    """PixelLoader(root=...): a row's relative path resolves under root, and one that leads out of it (../, a link)
    is refused in one line, never read."""
    from packers import PixelLoader

    loader = PixelLoader(vision=SPEC, root=str(tree["root"]))
    assert loader.resolve("sub/deep/in2.png") == Path(os.path.realpath(tree["in2"]))
    for path in ("../outside/secret.png", "link-out.png", "link-dir-out/secret.png"):
        with pytest.raises(OutsideRoot, match="outside"):
            loader.resolve(path)
    # absolute paths (--images reference) go through remap, compared once normalised
    moved = PixelLoader(vision=SPEC, remap={"/data/imgs": str(tree["root"])})
    assert moved.resolve("/data/imgs/in.png") == tree["root"] / "in.png"
    assert os.path.normpath(moved.resolve("/data/imgs/../../etc/x.png")) == "/etc/x.png"  # not remapped
