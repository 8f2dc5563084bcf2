"""``packstream verify --inputs`` checks every image a row carries, not only its tokens.

A few records with images are packed twice, by reference (the default) and with ``--images embed``. Each test
edits one image of a packed shard in a way that keeps every token (and so the token digest) as it was, reseals
the manifest's sha256 and size as a careless or malicious rewrite would, and checks that re-reading the inputs
finds it in one line naming the shard, the row, the example and the image. The unedited folders verify clean.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from packers import VisionSpec
from pipeline.cli import main
from tests.test_verify import read_rows, rewrite_shard
from tests.test_vision_pipeline import VISION_TOKENS, _image, _pack, _user_image, save_tokenizer

SPEC = VisionSpec.builtin("qwen2-vl")
WIDE = (168, 84)
"""12 x 6 patches of 14 pixels: grid (1, 6, 12), 18 tokens; swapped, (1, 12, 6) is as many tokens."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same four records (one wide image; a square one; two images in one record; none) packed by reference
    and embedded; ``spare.png`` is an image of the wide one's size that no record names."""
    root = tmp_path_factory.mktemp("verify-images")
    tokenizer = save_tokenizer(root / "tokenizer", VISION_TOKENS)
    img = root / "img"
    _image(img / "wide.png", WIDE)
    _image(img / "square.png", (84, 84), "blue")
    _image(img / "spare.png", WIDE, "green")
    assert SPEC.image_grid(*WIDE) == (1, 6, 12)
    records = [_user_image(str(img / "wide.png")),
               _user_image(str(img / "square.png")),
               {"messages": [{"role": "user", "content": "<image>then<image>"},
                             {"role": "assistant", "content": "blue, red"}],
                "images": [str(img / "square.png"), str(img / "wide.png")]},
               {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}]
    data = root / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    common = [str(data), "--tokenizer", tokenizer, "--processor", "qwen2-vl", "--max-tokens", "2048"]
    out = {"reference": root / "ref", "embed": root / "emb", "img": img}
    assert _pack(*common, "-o", str(out["reference"])).exit_code == 0
    assert _pack(*common, "-o", str(out["embed"]), "--images", "embed").exit_code == 0
    return out


def _copy(runs, mode: str, tmp_path: Path) -> Path:
    dst = tmp_path / mode
    shutil.copytree(runs[mode], dst)
    return dst


def _verify(folder: Path, *extra: str):
    return CliRunner().invoke(main, ["verify", str(folder), *extra])


def _wide(rows: list[dict]) -> tuple[int, int]:
    """(row, image) of the first image packed with grid (1, 6, 12)."""
    for i, row in enumerate(rows):
        for k in range(len(row["image_offsets"])):
            if row["image_grid_thw"][3 * k:3 * k + 3] == [1, 6, 12]:
                return i, k
    raise AssertionError("no wide image packed")


def _failed_on_image(result, k: int, *words: str) -> str:
    """The one problem line of a failed verify that names image ``k``, with ``words``."""
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.output.splitlines() if f"image {k}:" in ln]
    assert len(lines) == 1, result.output
    line = lines[0]
    assert "row " in line and "example " in line and all(w in line for w in words), line
    return line


@pytest.mark.parametrize("mode", ["reference", "embed"])
def test_an_unedited_vision_folder_verifies_against_its_inputs(runs, mode):
    result = _verify(runs[mode], "--inputs")
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith("OK")
    assert "4 input records reconciled" in result.output


@pytest.mark.parametrize("mode", ["reference", "embed"])
def test_a_grid_with_height_and_width_swapped_is_found(runs, mode, tmp_path):
    """(1, 6, 12) -> (1, 12, 6): the same 18 placeholder tokens, so every token check passes; only comparing the
    grid with the one re-reading the image gives catches it (its mRoPE positions would be wrong in training)."""
    out = _copy(runs, mode, tmp_path)
    row, k = _wide(read_rows(out))

    def swap(rows):
        rows[row]["image_grid_thw"][3 * k:3 * k + 3] = [1, 12, 6]
        return rows

    rewrite_shard(out, 0, swap)
    assert _verify(out).exit_code == 0  # without the inputs, nothing tells the grid from its swap
    line = _failed_on_image(_verify(out, "--inputs"), k, f"row {row}", "grid (1, 12, 6) stored",
                            "re-reading the input gives (1, 6, 12)")
    assert "example 'd.jsonl@" in line


def test_an_image_path_changed_to_another_existing_image_is_found(runs, tmp_path):
    """The wide image's path pointed at ``spare.png``: a file of the same size (so the same grid and tokens), but
    another image than the one the record names."""
    out = _copy(runs, "reference", tmp_path)
    row, k = _wide(read_rows(out))
    spare = str(runs["img"] / "spare.png")

    def repoint(rows):
        rows[row]["images"][k]["path"] = spare
        return rows

    rewrite_shard(out, 0, repoint)
    assert _verify(out).exit_code == 0
    _failed_on_image(_verify(out, "--inputs"), k, f"row {row}", f"path {spare!r} stored",
                     f"{str(runs['img'] / 'wide.png')!r}")


def test_embedded_bytes_replaced_by_another_valid_png_are_found(runs, tmp_path):
    """The wide image's embedded bytes replaced by another PNG of the same size: same grid, same tokens, other
    pixels. The message names both sha256 prefixes."""
    out = _copy(runs, "embed", tmp_path)
    row, k = _wide(read_rows(out))
    buf = io.BytesIO()
    Image.new("RGB", WIDE, "purple").save(buf, "PNG")

    def replace(rows):
        assert rows[row]["images"][k]["bytes"] is not None
        rows[row]["images"][k]["bytes"] = buf.getvalue()
        return rows

    rewrite_shard(out, 0, replace)
    assert _verify(out).exit_code == 0
    _failed_on_image(_verify(out, "--inputs"), k, f"row {row}", "bytes", "sha256")
