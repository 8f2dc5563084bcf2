"""A video changed after packing is refused by the Collator in one line that names the example AND the video file
(issue 52, part B3): the path as the row stores it, and where it was read when that differs (``PixelLoader(root=)``,
``remap``). Before, the message named only ``row 0 video 1 (example 'r.jsonl:r1')``, and a folder of a thousand
clips left the user to find which file had changed.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import packers
from pipeline.cli import main
from tests.test_vision_pipeline import save_tokenizer
from tests.test_vision_video import TOKENS, clip

av = pytest.importorskip("av")


def _pack(root: Path) -> Path:
    """Two records, one video each (6 frames at 4 fps, 24 x 16: grid (2, 2, 2) at these limits), packed for Qwen2-VL
    into ``root/out``; the rows store each video's absolute path."""
    tok = save_tokenizer(root / "tok", TOKENS)
    lines = []
    for r in range(2):
        clip(root / f"v{r}.mp4", 6, 4, 24, 16, seed=r)
        lines.append({"id": f"r{r}", "messages": [
            {"role": "user", "content": [{"type": "video", "video": f"v{r}.mp4"}, {"type": "text", "text": "what"}]},
            {"role": "assistant", "content": "a clip"}]})
    (root / "r.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    result = CliRunner().invoke(main, ["pack", str(root / "r.jsonl"), "--tokenizer", tok, "--processor", "qwen2-vl",
                                       "--video-fps", "2", "--video-max-pixels", "3136", "--video-min-pixels", "784",
                                       "--max-tokens", "256", "-o", str(root / "out"), "-q"])
    assert result.exit_code == 0, result.output
    return root


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> Path:
    return _pack(tmp_path_factory.mktemp("videos"))


def _rows(folder: Path) -> tuple[list[dict], packers.VisionSpec]:
    ds = packers.PackedDataset(folder)
    return ds.fetch(range(len(ds.rows))), ds.vision


def _expected(stored: str, how: str, read_as: str = "") -> str:
    """The refusal's words: the example, the file as stored (and where it was read), the grids, the cause."""
    at = f" \\(read as {re.escape(read_as)}\\)" if read_as else ""
    return (rf"row \d+ video \d+ \(example 'r\.jsonl:r1'\), video file {re.escape(stored)}{at}: {how} "
            r"\(\d+, \d+, \d+\), the row was packed for \(2, 2, 2\): the video file or the row's video_grid_thw "
            r"changed since packing")


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("change", ["more frames", "another size"])
def test_a_video_changed_after_packing_names_the_example_and_the_file(packed, tmp_path, decode, change):
    """The clips moved to another folder (read through ``remap``), then one of them changed."""
    rows, vision = _rows(packed / "out")
    moved = tmp_path / "moved"
    shutil.copytree(packed, moved, ignore=shutil.ignore_patterns("out", "tok"))
    pixels = packers.PixelLoader(vision=vision, remap={str(packed): str(moved)})
    collate = packers.Collator(vision=vision, pixels=pixels, decode_images=decode)
    collate(rows)  # as packed: every video comes out at its packed grid
    stored = next(v["path"] for row in rows for v in row["videos"] if v["path"].endswith("v1.mp4"))
    if change == "more frames":
        clip(moved / "v1.mp4", 14, 4, 24, 16, seed=5)      # 14 frames at 4 fps: 4 sampled, 2 temporal patches -> 3
    else:
        clip(moved / "v1.mp4", 6, 4, 64, 48, seed=5)       # the same frame count at another size
    with pytest.raises(packers.ContractError) as e:
        collate(rows)
    message = str(e.value)
    assert "\n" not in message, message
    how = "decodes to video grid" if decode else "its header gives video grid"
    assert re.search(_expected(stored, how, str(moved / "v1.mp4")), message), message


def test_the_file_is_named_as_stored_when_read_there(tmp_path):
    root = _pack(tmp_path)
    rows, vision = _rows(root / "out")
    clip(root / "v1.mp4", 14, 4, 24, 16, seed=5)
    with pytest.raises(packers.ContractError) as e:
        packers.Collator(vision=vision, decode_images=False)(rows)
    assert re.search(_expected(str(root / "v1.mp4"), "its header gives video grid"), str(e.value)), str(e.value)
    assert "read as" not in str(e.value)
