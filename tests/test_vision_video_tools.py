"""Every tool on a folder packed with videos (``--processor qwen2-vl --video-fps``, contract version 5; issue 45).

One small set of records (videos as parts and as a LLaMA-Factory ``videos`` column, an image, text, two unreadable
videos) is packed once; then ``verify`` (with and without ``--inputs``) passes on the folder as written and fails in
one line per problem on an edited grid, a grid with height and width swapped, an edited ``second_per_grid_ts`` or a
video file changed after packing; ``inspect`` reports the videos beside the images; ``preview`` marks each video
``<video NAME: N tokens, F frames, grid TxHxW>``; ``estimate`` and ``--workers auto``'s image work count videos
apart; the loader reads the folder and the packed-folder reader refuses it in one line; unreadable videos are
``bad_video``; ``--pairs`` refuses videos saying why.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import packers
from packers import PackstreamError
from pipeline import PackOptions
from pipeline.cli import main
from tests._internals import _media, _read, packed_examples
from tests.test_verify import read_rows, rewrite_shard
from tests.test_vision_pipeline import save_tokenizer

av = pytest.importorskip("av")
PIL = pytest.importorskip("PIL.Image")

from tests.test_vision_video import TOKENS, clip  # noqa: E402 - needs av

LIMITS = ["--video-fps", "2", "--video-max-pixels", "3136", "--video-min-pixels", "784", "--image-max-pixels", "3136",
          "--image-min-pixels", "784"]
SPEC = packers.VisionSpec.builtin("qwen2-vl").with_video(2.0, 768, 784, 3136)


def _user(parts: list, answer: str = "ok", rid: str = "") -> dict:
    return {"id": rid, "messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


def _video(name: str) -> dict:
    return {"type": "video", "video": name}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("video-tools")
    tok = save_tokenizer(root / "tok", TOKENS)
    data = root / "data"
    data.mkdir()
    clip(data / "a.mp4", 8, 4, 32, 32, seed=1)
    clip(data / "b.mp4", 12, 6, 48, 32, seed=2)
    clip(data / "wide.mp4", 6, 4, 56, 28, seed=3)  # grid (t, 2, 4): swapped, as many tokens
    (data / "junk.mp4").write_bytes(b"not a video at all")
    PIL.fromarray(np.full((28, 56, 3), 200, np.uint8)).save(data / "i.png")
    records = [
        _user([_video("a.mp4"), {"type": "text", "text": "what happens?"}], "a square moves", "r0"),
        _user([{"type": "image_url", "image_url": {"url": "i.png"}}, {"type": "text", "text": "and"},
               _video("b.mp4")], "a circle", "r1"),
        {"id": "r2", "videos": ["wide.mp4"], "messages": [{"role": "user", "content": "<video> describe"},
                                                          {"role": "assistant", "content": "wide"}]},
        _user([{"type": "text", "text": "no media here"}], "fine", "r3"),
        _user([_video("missing.mp4"), {"type": "text", "text": "?"}], "x", "r4"),
        _user([_video("junk.mp4"), {"type": "text", "text": "?"}], "x", "r5"),
    ]
    path = data / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = root / "out"
    result = CliRunner().invoke(main, ["pack", str(path), "--tokenizer", tok, "--processor", "qwen2-vl", *LIMITS,
                                       "--max-tokens", "512", "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "manifest.json").read_text())["contract_version"] == packers.VIDEO_CONTRACT_VERSION
    return {"root": root, "tok": Path(tok), "data": data, "records": path, "out": out}


def _verify(folder: Path, *extra: str):
    return CliRunner().invoke(main, ["verify", str(folder), *extra])


def _copy(run, tmp_path: Path) -> Path:
    dst = tmp_path / "out"
    shutil.copytree(run["out"], dst)
    return dst


def _video_at(rows: list[dict], grid_hw: tuple[int, int]) -> tuple[int, int]:
    """(row, video) of the first video packed with grid (t, *grid_hw)."""
    for i, row in enumerate(rows):
        for k in range(len(row["video_offsets"])):
            if tuple(row["video_grid_thw"][3 * k + 1:3 * k + 3]) == grid_hw:
                return i, k
    raise AssertionError(f"no video of grid (t, {grid_hw}) packed")


def _one_line(result, *words: str) -> str:
    """The one problem line of a failed verify that holds every word of ``words``."""
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.output.splitlines() if all(w in ln for w in words)]
    assert len(lines) == 1, result.output
    return lines[0]


def test_a_video_folder_verifies_with_and_without_its_inputs(run):
    assert _verify(run["out"]).output.strip().endswith("OK")
    result = _verify(run["out"], "--inputs")
    assert result.exit_code == 0, result.output
    assert "6 input records reconciled" in result.output and result.output.strip().endswith("OK")
    dead = [json.loads(x) for x in (run["out"] / "rejected.jsonl").read_text().splitlines()]
    assert sorted(d["reason"] for d in dead) == ["bad_video", "bad_video"]
    assert any("does not exist" in d["detail"] and "video 'missing" in d["detail"].replace(str(run["data"]) + "/", "")
               for d in dead), dead


def test_an_edited_video_grid_fails_verify_in_one_line(run, tmp_path):
    out = _copy(run, tmp_path)
    row, k = _video_at(read_rows(out), (2, 2))

    def grow(rows):
        rows[row]["video_grid_thw"][3 * k] += 1
        return rows

    rewrite_shard(out, 0, grow)
    line = _one_line(_verify(out), f"row {row}", f"video {k}:")
    assert "check videos failed" in line


def test_a_swapped_video_grid_and_an_edited_second_per_grid_ts_are_found_by_inputs(run, tmp_path):
    """(t, 2, 4) -> (t, 4, 2): the same placeholder tokens, so only re-reading the video finds it; and the video's
    second_per_grid_ts (Qwen2.5-VL's temporal position scale) changed."""
    out = _copy(run, tmp_path)
    row, k = _video_at(read_rows(out), (2, 4))

    def swap(rows):
        g = rows[row]["video_grid_thw"]
        g[3 * k + 1], g[3 * k + 2] = g[3 * k + 2], g[3 * k + 1]
        rows[row]["second_per_grid_ts"][k] *= 2
        return rows

    rewrite_shard(out, 0, swap)
    assert _verify(out).exit_code == 0  # without the inputs, nothing tells the grid from its swap
    line = _one_line(_verify(out, "--inputs"), f"video {k}:")
    assert f"row {row}" in line and "stored, re-reading the input gives (" in line and "second_per_grid_ts" in line


def test_a_video_file_changed_after_packing_fails_verify_inputs(run, tmp_path):
    """b.mp4 replaced by a longer clip: re-reading it samples more frames, so its run and the example's tokens
    differ from the packed ones; verify names the example in one line."""
    b = run["data"] / "b.mp4"
    kept = tmp_path / "b.mp4"
    shutil.copy(b, kept)
    try:
        clip(b, 30, 6, 48, 32, seed=9)
        result = _verify(run["out"], "--inputs")
    finally:
        shutil.copy(kept, b)
    line = _one_line(result, "d.jsonl:r1")
    assert "tokens stored" in line, line


def test_inspect_reports_the_videos(run):
    result = CliRunner().invoke(main, ["inspect", str(run["out"]), "--json", "--no-plots"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["schema_version"] == 5
    v = report["vision"]
    rows = read_rows(run["out"])
    grids = [r["video_grid_thw"][3 * k:3 * k + 3] for r in rows for k in range(len(r["video_offsets"]))]
    want = [SPEC.grid_tokens(g) for g in grids]
    assert (v["images"], v["videos"]["videos"], v["videos"]["video_tokens"]) == (1, 3, sum(want))
    assert v["videos"]["frames"] == sum(2 * g[0] for g in grids)
    assert v["videos"]["tokens_per_video"]["p100"] == max(want) and v["videos"]["embedded_videos"] == 0
    assert v["image_tokens"] + v["videos"]["video_tokens"] == sum(
        int(np.isin(r["input_ids"], [r["input_ids"][o] for o in r["image_offsets"] + r["video_offsets"]]).sum())
        for r in rows)
    text = CliRunner().invoke(main, ["inspect", str(run["out"]), "--no-plots"]).output
    assert "videos" in text and "frames per video" in text


def test_preview_marks_each_video_with_its_tokens_frames_and_grid(run):
    result = CliRunner().invoke(main, ["preview", str(run["records"]), "--tokenizer", str(run["tok"]), "--processor",
                                       "qwen2-vl", *LIMITS, "-n", "3"])
    assert result.exit_code == 0, result.output
    grid, _ = SPEC.measure_video(str(run["data"] / "b.mp4"), "b")
    mark = (f"<video {run['data'] / 'b.mp4'}: {SPEC.grid_tokens(grid)} tokens, {2 * grid[0]} frames, "
            f"grid {'x'.join(map(str, grid))}>")
    assert mark in result.output, result.output
    assert "<image " in result.output and "<image " + str(run["data"] / "b.mp4") not in result.output
    assert "in 1 images, " in result.output and " in 1 videos)" in result.output


def test_estimate_and_the_image_work_count_videos(run):
    result = CliRunner().invoke(main, ["estimate", str(run["records"]), "--tokenizer", str(run["tok"]), "--processor",
                                       "qwen2-vl", *LIMITS, "--json"])
    assert result.exit_code == 0, result.output
    e = json.loads(result.output.strip().splitlines()[-1])
    assert e["schema_version"] == 6
    assert (e["vision"]["images"], e["vision"]["videos"]) == (1, 3)
    packed = json.loads((run["out"] / "manifest.json").read_text())
    assert e["tokens"] == packed["counts"]["tokens"]
    options = PackOptions(inputs=(str(run["records"]),), tokenizer=str(run["tok"]), output=str(run["root"] / "x"),
                          processor="qwen2-vl", video_fps=2.0)
    files = _read.expand_datasets(options.datasets())[0]
    work = _media.image_work(options, files, [_read.input_bytes(f) for f in files])
    assert (work.images, work.videos) == (1, 5) and work.seconds_per_video > 0
    assert "~5 videos at" in work.describe()


def test_the_loader_reads_video_rows_and_the_packed_reader_refuses_them_in_one_line(run):
    ds = packers.PackedDataset(run["out"])
    rows = ds.fetch(range(len(ds.rows)))
    assert sum(len(r["videos"]) for r in rows) == 3
    with pytest.raises(PackstreamError) as e:
        list(packed_examples(str(run["out"])))
    assert "videos" in str(e.value) and "not supported yet" in str(e.value) and "\n" not in str(e.value)


def test_pairs_refuse_videos_saying_pairs_pack_images_only(run, tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({
        "prompt": [{"role": "user", "content": [_video(str(run["data"] / "a.mp4")), {"type": "text", "text": "?"}]}],
        "chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}) + "\n")
    for extra in (["--video-fps", "2"], []):
        out = tmp_path / f"o{len(extra)}"
        CliRunner().invoke(main, ["pack", str(tmp_path / "p.jsonl"), "--tokenizer", str(run["tok"]), "--processor",
                                  "qwen2-vl", "--pairs", "--media-root", "/", *extra, "-o", str(out), "-q"])
        dead = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
        assert [d["reason"] for d in dead] == ["non_text_content"]
        assert "pairs" in dead[0]["detail"] and "--video-fps" not in dead[0]["detail"]
