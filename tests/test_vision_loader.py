"""Collating vision-language rows and decoding their images: worked examples and the one-line errors.

Rows carry ``image_offsets``, ``image_grid_thw`` and ``images`` (see :class:`packers.Collator`); a row whose
image runs do not match its tokens, or whose image file changed or vanished since packing, is refused naming
the row, the image and the fix. Text-only rows under ``Collator(vision=...)`` keep every key of the text batch.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from packers import Collator, ContractError, PackstreamError, PixelLoader, VisionSpec
from packers.rowcheck import check_images
from tests._internals import VisionFamily
from tests.test_vision_exact import IMAGE, SPECS, png

SPEC = SPECS["qwen2-vl"]  # 28-pixel merged patches, 2 to 8 of them per image


def image_row(ref: dict, width: int = 56, height: int = 56) -> dict:
    """One row: an example with one image (grid from the spec: 56 x 56 -> (1, 4, 4), 4 tokens), then a text one."""
    grid = SPEC.image_grid(width, height)
    n = SPEC.grid_tokens(grid)
    ids = [5, 121] + [IMAGE] * n + [122, 6, 7] + [8, 9, 10]
    return {"input_ids": ids, "loss_mask": [0] * (len(ids) - 4) + [1, 0, 1, 1],
            "seq_offsets": [0, len(ids) - 3, len(ids)], "example_ids": ["img", "txt"],
            "image_offsets": [2], "image_grid_thw": list(grid), "images": [ref]}


def test_text_rows_under_a_vision_collator_keep_the_text_batch():
    rows = [{"input_ids": [5, 9, 41, 17, 5, 30], "loss_mask": [0, 0, 1, 1, 0, 1], "seq_offsets": [0, 4, 6]}]
    text, vision = Collator()(rows), Collator(vision=SPEC)(rows)
    assert set(vision) == set(text) and "pixel_values" not in vision and "image_grid_thw" not in vision
    for k in set(text) - {"position_ids"}:
        assert torch.equal(vision[k], text[k]) if torch.is_tensor(text[k]) else vision[k] == text[k], k
    assert vision["position_ids"].shape == (4, 1, 6)
    assert (vision["position_ids"] == text["position_ids"]).all()  # all four rows: the text positions


def test_pixels_from_bytes_and_from_a_file_equal_the_processors(tmp_path):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from PIL import Image

    data = png(90, 50, seed=1)
    (tmp_path / "a.png").write_bytes(data)
    rows = [image_row({"path": None, "bytes": data}, 90, 50), image_row({"path": "a.png", "bytes": None}, 90, 50)]
    batch = Collator(vision=SPEC, pixels=PixelLoader(vision=SPEC, root=tmp_path))(rows)
    want = Qwen2VLImageProcessorPil(size={"shortest_edge": SPEC.min_pixels, "longest_edge": SPEC.max_pixels})(
        images=[Image.open(io.BytesIO(data)).convert("RGB")] * 2, return_tensors="pt")
    assert batch["image_grid_thw"].tolist() == [[1, 4, 6], [1, 4, 6]] == want["image_grid_thw"].tolist()
    assert torch.equal(batch["pixel_values"], want["pixel_values"])


def test_a_processor_of_ones_own_is_used():
    calls = []

    class Mine:
        def __call__(self, images, return_tensors):
            calls.append(len(images))
            return {"pixel_values": torch.zeros(16, 1176), "image_grid_thw": torch.tensor([[1, 4, 4]])}

    batch = Collator(vision=SPEC, pixels=PixelLoader(vision=SPEC, processor=Mine()))(
        [image_row({"path": None, "bytes": png(56, 56, 0)})])
    assert calls == [1] and batch["pixel_values"].shape == (16, 1176)


def test_rows_with_images_need_a_vision_spec():
    with pytest.raises(PackstreamError, match=r"row 0 holds images .*Collator\(vision=VisionSpec"):
        Collator()([image_row({"path": None, "bytes": b""})])


def test_text_rows_under_a_llava_collator_are_the_text_batch():
    """LLaVA rotates by 1-D positions: without images its batch is the text Collator's, key for key."""
    rows = [{"input_ids": [5, 9, 41, 17, 5, 30], "loss_mask": [0, 0, 1, 1, 0, 1], "seq_offsets": [0, 4, 6]}]
    text, llava = Collator()(rows), Collator(vision=VisionSpec.builtin("llava-1.5"))(rows)
    assert set(llava) == set(text)
    for k in text:
        assert torch.equal(llava[k], text[k]) if torch.is_tensor(text[k]) else llava[k] == text[k], k


@pytest.mark.parametrize("break_it, message", [
    (lambda r: r.update(image_offsets=[r["seq_offsets"][1] - 3]), r"row 0, image 0: 4 placeholder .* cross the end"),
    (lambda r: r.update(image_offsets=[1]), r"row 0, image 0: .* not one placeholder id"),
    (lambda r: r.update(image_grid_thw=[1, 4, 8]), r"row 0, image 0: 8 placeholder tokens .*(cross|not one)"),
    (lambda r: r.update(image_grid_thw=[1, 4]), r"row 0: 1 image_offsets and 2 image_grid_thw"),
    (lambda r: r.update(images=[]), r"row 0: 0 images for 1 image_offsets"),
])
def test_broken_image_runs_are_one_line_contract_errors(break_it, message):
    row = image_row({"path": None, "bytes": png(56, 56, 0)})
    break_it(row)
    with pytest.raises(ContractError, match=message) as e:
        Collator(vision=SPEC)([row])
    assert "\n" not in str(e.value)


def test_a_missing_or_unreadable_image_names_its_path(tmp_path):
    with pytest.raises(PackstreamError, match=r"row 0 image 0 \(example 'img'\): cannot read .*gone\.png"):
        Collator(vision=SPEC)([image_row({"path": str(tmp_path / "gone.png"), "bytes": None})])
    (tmp_path / "junk.png").write_bytes(b"not an image")
    with pytest.raises(PackstreamError, match=r"cannot read .*junk\.png"):
        Collator(vision=SPEC)([image_row({"path": str(tmp_path / "junk.png"), "bytes": None})])


def test_an_image_changed_since_packing_is_refused(tmp_path):
    """Packed for a 56 x 56 image (grid 1 x 4 x 4); the file now holds a 120 x 60 one (1 x 4 x 8)."""
    (tmp_path / "a.png").write_bytes(png(120, 60, seed=2))
    with pytest.raises(ContractError, match=r"row 0 image 0 \(example 'img'\) \(.*a\.png\): decodes to patch grid "
                                            r"\(1, 4, 8\), the row was packed for \(1, 4, 4\)"):
        Collator(vision=SPEC)([image_row({"path": str(tmp_path / "a.png"), "bytes": None})])


def test_fixed_shape_padding_gets_text_positions_in_every_row():
    row = image_row({"path": None, "bytes": png(56, 56, 0)})
    n = len(row["input_ids"])
    batch = Collator(vision=SPEC, fixed_shape=True, budget=n + 3)([row])
    pos = batch["position_ids"][:, 0]
    assert pos.shape == (4, n + 3)
    assert pos[:, n:].tolist() == [[0, 1, 2]] * 4
    # the image example: text 0 1, image at 2 (2x2 merged), after it 2 + 2 = 4
    assert pos[1:, :9].tolist() == [[0, 1, 2, 2, 2, 2, 4, 5, 6], [0, 1, 2, 2, 3, 3, 4, 5, 6], [0, 1, 2, 3, 2, 3, 4, 5, 6]]
    assert np.array_equal(pos[0].numpy()[:n], np.r_[np.arange(n - 3), np.arange(3)])


def test_remap_reads_a_moved_folder_longest_prefix_first(tmp_path):
    """Packed under /data/imgs (and /data/imgs/scans, mounted elsewhere): remap maps each absolute path by its
    longest matching prefix, whole path components only; relative paths still go to root, others stay as stored."""
    pixels = PixelLoader(vision=SPEC, root="/work", remap={"/data/imgs": "/mnt/imgs", "/data/imgs/scans/": "/scans"})
    assert pixels.resolve("/data/imgs/a/cat.jpg").as_posix() == "/mnt/imgs/a/cat.jpg"
    assert pixels.resolve("/data/imgs/scans/p1.png").as_posix() == "/scans/p1.png"  # the longer prefix wins
    assert pixels.resolve("/data/imgs2/cat.jpg").as_posix() == "/data/imgs2/cat.jpg"  # not a component of /data/imgs
    assert pixels.resolve("rel/cat.jpg").as_posix() == "/work/rel/cat.jpg"

    data = png(56, 56, seed=3)
    (tmp_path / "mnt").mkdir()
    (tmp_path / "mnt" / "a.png").write_bytes(data)
    row = image_row({"path": "/data/imgs/a.png", "bytes": None})
    batch = Collator(vision=SPEC, pixels=PixelLoader(vision=SPEC, remap={"/data/imgs": str(tmp_path / "mnt")}))([row])
    same = Collator(vision=SPEC)([image_row({"path": None, "bytes": data})])
    assert torch.equal(batch["pixel_values"], same["pixel_values"])


def test_a_missing_remapped_path_names_both_paths_and_remap():
    pixels = PixelLoader(vision=SPEC, remap={"/data/imgs": "/nowhere/imgs"})
    with pytest.raises(PackstreamError, match=r"row 0 image 0 .*cannot read /nowhere/imgs/a\.png \(stored as "
                                              r"/data/imgs/a\.png\).*PixelLoader\(remap="):
        Collator(vision=SPEC, pixels=pixels)([image_row({"path": "/data/imgs/a.png", "bytes": None})])
    with pytest.raises(PackstreamError, match=r"remap=.*'imgs' -> '/mnt'; each entry maps an absolute path prefix"):
        PixelLoader(vision=SPEC, remap={"imgs": "/mnt"})


def test_a_fifo_where_an_image_was_is_refused_at_load_not_waited_on(tmp_path):
    """At training time too an image path goes through the one checked open: a FIFO (or device) where the packed
    image was is one error line, never a DataLoader worker blocked for good."""
    import os

    fifo = tmp_path / "img.png"
    os.mkfifo(fifo)
    loader = PixelLoader(vision=VisionSpec.builtin("qwen2-vl"))
    with pytest.raises(PackstreamError, match="is a FIFO"):
        loader.open({"path": str(fifo), "bytes": None})
    with pytest.raises(PackstreamError, match="is a device"):
        loader.open({"path": "/dev/zero", "bytes": None})


# -- a grid edited since packing, caught whether or not the Collator decodes pixels -------------------------------


WIDE = (112, 56)
"""4 x 2 merged 28-pixel patches: grid (1, 4, 8), 8 tokens; its swap (1, 8, 4) is as many tokens, so only the
image's size tells them apart (the mRoPE positions of its tokens differ)."""


def _swapped(row: dict) -> dict:
    t, h, w = row["image_grid_thw"]
    return {**row, "image_grid_thw": [t, w, h]}


@pytest.mark.parametrize("decode, found", [(True, "decodes to patch grid"), (False, "its size gives patch grid")])
def test_a_grid_with_height_and_width_swapped_is_refused_decoding_or_not(tmp_path, decode, found):
    """The row packed for the 112 x 56 image says (1, 4, 8); rewritten to (1, 8, 4) its tokens and every run check
    still pass. Decoding, the processor's grid differs; without decoding, the grid of the size in the image's header
    differs: the same one-line ContractError, naming the row, the image and both grids. A file is resolved as for
    decoding (here against root=)."""
    data = png(*WIDE, seed=4)
    (tmp_path / "wide.png").write_bytes(data)
    pixels = PixelLoader(vision=SPEC, root=tmp_path)
    collate = Collator(vision=SPEC, pixels=pixels, decode_images=decode)
    for ref in ({"path": None, "bytes": data}, {"path": "wide.png", "bytes": None}):
        row = image_row(ref, *WIDE)
        assert row["image_grid_thw"] == [1, 4, 8]
        batch = collate([row])
        assert batch["image_grid_thw"].tolist() == [[1, 4, 8]] and ("pixel_values" in batch) == decode
        with pytest.raises(ContractError, match=rf"row 0 image 0 \(example 'img'\) \(.*\): {found} \(1, 4, 8\), the "
                                                r"row was packed for \(1, 8, 4\)") as e:
            collate([_swapped(row)])
        assert "\n" not in str(e.value)


@settings(max_examples=30, deadline=None)
@given(width=st.integers(28, 300), height=st.integers(28, 300))
def test_without_decoding_a_row_passes_exactly_when_its_grids_are_its_images(width, height):
    """Any image the spec takes: the row packed for it collates; its grid with height and width swapped is refused
    unless the swap is the same grid."""
    if max(width, height) / min(width, height) > 150:
        return
    row = image_row({"path": None, "bytes": png(width, height, seed=0)}, width, height)
    collate = Collator(vision=SPEC, decode_images=False)
    assert collate([row])["image_grid_thw"].tolist() == [row["image_grid_thw"]]
    swapped = _swapped(row)
    if swapped["image_grid_thw"] == row["image_grid_thw"]:
        collate([swapped])
    else:
        with pytest.raises(ContractError, match="its size gives patch grid"):
            collate([swapped])


def test_without_decoding_only_the_header_is_read(tmp_path):
    """A JPEG cut in half: its header (so its size, so its grid) reads, its pixels do not. The Collator that does not
    decode takes it (and never reads pixels); the one that decodes names the file."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 112, 3), dtype=np.uint8)).save(buf, "JPEG")
    (tmp_path / "cut.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    row = image_row({"path": str(tmp_path / "cut.jpg"), "bytes": None}, *WIDE)
    assert Collator(vision=SPEC, decode_images=False)([row])["image_grid_thw"].tolist() == [[1, 4, 8]]
    with pytest.raises(PackstreamError, match=r"row 0 image 0 \(example 'img'\): cannot read .*cut\.jpg"):
        Collator(vision=SPEC)([row])


@pytest.mark.parametrize("ref", [None, {"path": None, "bytes": None}])
def test_an_image_with_neither_path_nor_bytes_is_refused_even_without_decoding(ref):
    with pytest.raises(PackstreamError, match=r"row 0 image 0 \(example 'img'\): neither bytes nor a path"):
        Collator(vision=SPEC, decode_images=False)([image_row(ref)])


# -- every placeholder token is in an image's run (packers.rowcheck.check_images) -----------------------------------


@pytest.mark.parametrize("edit, sequence, have, want", [
    (lambda ids: ids.__setitem__(-2, IMAGE), 1, 1, 0),   # a stray placeholder in the text example after
    (lambda ids: ids.__setitem__(6, IMAGE), 0, 5, 4),    # the run one longer than its grid (1, 4, 4) says
    (lambda ids: ids.__setitem__(0, IMAGE), 0, 5, 4),    # a stray placeholder before the image's run
])
def test_a_placeholder_token_outside_every_image_run_is_refused(edit, sequence, have, want):
    """``image_row``: ``[5 121 I I I I 122 6 7 | 8 9 10]``, one image of grid (1, 4, 4) = 4 tokens at offset 2, then a
    text example. Each edit adds one placeholder token where no image's run is: the model would count one image
    token more than the images' features. The loader, verify and the Collator run this one check."""
    row = image_row({"path": None, "bytes": png(56, 56, 0)})
    assert check_images(0, row["input_ids"], row["loss_mask"], row["seq_offsets"], row["image_offsets"],
                        row["image_grid_thw"], 1, SPEC) is None
    edit(row["input_ids"])
    f = check_images(0, row["input_ids"], None, row["seq_offsets"], row["image_offsets"], row["image_grid_thw"], 1,
                     SPEC)
    assert (f.check, f.sequence) == ("images", sequence)
    assert f.detail.startswith(f"sequence {sequence} holds {have} tokens of the placeholder id {IMAGE}, its images' "
                               f"grids give {want}")
    with pytest.raises(ContractError, match=rf"row 0: sequence {sequence} holds {have} tokens"):
        Collator(vision=SPEC)([row])


def test_touching_llava_images_are_counted_together():
    """LLaVA's images may touch (its 1-D positions do not group runs): two runs of 4 back to back are 8 placeholder
    tokens for two grids of 4, which passes; a ninth does not."""
    llava = VisionSpec(family=VisionFamily.LLAVA, image_size=28, patch_size=14, merge_size=1, temporal_patch_size=1)
    ids = [5] + [IMAGE] * 8 + [6, 7]
    args = ([0, 11], [1, 5], [1, 2, 2, 1, 2, 2], 2, llava)
    assert check_images(0, ids, None, *args) is None
    f = check_images(0, ids[:-1] + [IMAGE], None, *args)
    assert f is not None and f.detail.startswith("sequence 0 holds 9 tokens of the placeholder id")
