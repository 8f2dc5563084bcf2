"""Videos for Qwen2-VL, Qwen2.5-VL and Qwen3-VL: which frames the processor samples, and how many tokens they become.

A video's token count is known before its pixels are: transformers' ``Qwen2VLVideoProcessor`` (5.x,
``models/qwen2_vl/video_processing_qwen2_vl.py``) samples frames from the container's frame count and rate alone
(``sample_frames``: ``fps`` frames per second, at least ``min_frames``, at most ``max_frames`` and the frames there are,
floored to a multiple of ``temporal_patch_size``; then ``arange(0, total, total / n)`` truncated), resizes every frame
by ``smart_resize`` within the video pixel limits, and pads the frames to a multiple of the temporal patch. Here is
the same arithmetic, without torch, held equal to transformers' in ``tests/test_vision_video.py``:

>>> frame_indices(total=30, fps=10.0, want_fps=2.0, min_frames=4, max_frames=768, temporal=2)
[0, 5, 10, 15, 20, 25]
>>> frame_indices(total=5, fps=25.0, want_fps=2.0, min_frames=4, max_frames=768, temporal=2)   # at least 4
[0, 1, 2, 3]

Qwen2.5-VL also gives each video's ``second_per_grid_ts`` (``temporal_patch_size / sampled fps``, the sampled fps
being ``len(indices) / total * fps``), which scales its temporal rotary positions.

Qwen3-VL's ``Qwen3VLVideoProcessor`` samples and resizes its own way (:func:`qwen3_frame_indices`:
``linspace(0, total - 1, n).round()``; :func:`qwen3_resized`: pixel limits over all the sampled frames, 32-pixel
factor), and ``Qwen3VLProcessor`` writes each temporal group of a video as its own run after a timestamp,
``<t seconds><|vision_start|>`` + ``h * w / merge**2`` pads + ``<|vision_end|>`` (:func:`qwen3_text`, replacing the
template's one placeholder before tokenization, so the timestamp tokenizes with the text around it as the processor's
does); ``get_rope_index`` positions each group as an image of grid ``(1, h, w)`` (:func:`group_runs` finds them in a
packed row). Held equal to transformers' in ``tests/test_vision_qwen3_video.py``.

Decoding is PyAV's (``av``, the ``video`` extra), read as transformers' ``read_video_pyav`` reads it: the
container's first video stream, its ``frames`` and ``average_rate``, frames decoded in order and the sampled
indices kept. PyAV is imported on first use (``import packers`` needs neither it nor torch).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
from typing import IO, Any, Sequence

import numpy as np

from packers.errors import PackstreamError
from packers._keys import integral
from packers.files import show_path

MAX_VIDEO_FRAMES = 1 << 20
"""The most frames a container may state (a million: 9 hours at 30 fps); more is a damaged header."""


@dataclasses.dataclass(frozen=True)
class VideoInfo:
    """What the container says of its first video stream: all a token count needs."""

    frames: int
    """``stream.frames``: the frame count the container states (transformers' ``total_num_frames``)."""
    fps: float
    """``float(stream.average_rate)``."""
    width: int
    height: int


def frame_indices(total: int, fps: float, *, want_fps: float, min_frames: int, max_frames: int,
                  temporal: int) -> list[int]:
    """The frame indices ``Qwen2VLVideoProcessor.sample_frames(metadata, fps=want_fps, ...)`` samples from a video of
    ``total`` frames at ``fps``: the same float arithmetic (``torch.arange`` sizes in double, steps in float32)."""
    cap = math.floor(min(max_frames, total) / temporal) * temporal
    n = total / fps * want_fps
    n = min(max(n, min_frames), cap, total)
    n = math.floor(n / temporal) * temporal
    if n < 1:
        raise PackstreamError(f"a video of {total} frames samples no frame in groups of {temporal}; it needs at least "
                              f"{temporal} frames")
    step = total / n
    size = math.ceil(total / step)  # torch.arange's length, computed in double
    values = (np.arange(size, dtype=np.float64) * step).astype(np.float32)
    return values.astype(np.int32).tolist()


def qwen3_frame_indices(total: int, fps: float, *, want_fps: float, min_frames: int, max_frames: int) -> list[int]:
    """The frame indices ``Qwen3VLVideoProcessor.sample_frames(metadata, fps=want_fps)`` samples from a video of
    ``total`` frames at ``fps``: ``int(total / fps * want_fps)`` frames, at least ``min_frames``, at most
    ``max_frames`` and ``total`` (not rounded to the temporal patch: the last frame is repeated to fill it), spread by
    ``np.linspace(0, total - 1, n).round()``.

    >>> qwen3_frame_indices(30, 10.0, want_fps=2.0, min_frames=4, max_frames=768)
    [0, 6, 12, 17, 23, 29]
    """
    n = int(total / fps * want_fps)
    n = min(max(n, min_frames), max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int).tolist()


def qwen3_resized(frames: int, width: int, height: int, spec: Any) -> tuple[int, int]:
    """The ``(height, width)`` ``Qwen3VLVideoProcessor`` resizes each of ``frames`` sampled frames of a ``width`` x
    ``height`` video to: its own ``smart_resize`` (sides under one merged patch scaled up first; the pixel limits
    bound ``t_bar * h * w``, all the frames together), factor ``patch * merge``; ``cap_pixels_per_frame`` off (its
    default in transformers 5.25)."""
    factor, temporal = spec.patch_size * spec.merge_size, spec.temporal_patch_size
    if frames < temporal:
        raise PackstreamError(f"a video sampled to {frames} frame(s): Qwen3-VL's video processor needs at least "
                              f"{temporal} (its temporal patch); the video holds too few frames")
    if width < 1 or height < 1:
        raise PackstreamError(f"its frames are {width} x {height} pixels, no area; the video processor refuses it")
    w0, h0 = width, height
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise PackstreamError(f"its {w0} x {h0} frames have an aspect ratio over 200 (sides under {factor} pixels "
                              "scaled up first, as Qwen3-VL's video processor does); the processor refuses it")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > spec.video_max_pixels:
        beta = math.sqrt((frames * height * width) / spec.video_max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < spec.video_min_pixels:
        beta = math.sqrt(spec.video_min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def qwen3_timestamps(indices: Sequence[int], fps: float, temporal: int) -> list[float]:
    """Each temporal group's time in seconds, as ``Qwen3VLProcessor._calculate_timestamps``: the last index repeated
    to fill the group, then the mean of the group's first and last frame times (``index / fps``).

    >>> qwen3_timestamps([0, 5, 10, 19, 24], 10.0, 2)
    [0.25, 1.45, 2.4]
    """
    idx = [int(i) for i in indices]
    if len(idx) % temporal:
        idx.extend(idx[-1] for _ in range(temporal - len(idx) % temporal))
    ts = [i / fps for i in idx]
    return [(ts[i] + ts[i + temporal - 1]) / 2 for i in range(0, len(ts), temporal)]


def qwen3_text(indices: Sequence[int], fps: float, spec: Any) -> str:
    """What ``Qwen3VLProcessor`` writes for one video (its ``replace_video_token``), with one ``<|video_pad|>`` per
    temporal group where it writes ``h * w / merge**2`` (the packer repeats each afterwards)::

        <0.2 seconds><|vision_start|><|video_pad|><|vision_end|><1.4 seconds><|vision_start|>...

    >>> spec = type("S", (), {"temporal_patch_size": 2, "video_placeholder": "<s><v></s>"})
    >>> qwen3_text([0, 5, 10, 19, 24], 10.0, spec)
    '<0.2 seconds><s><v></s><1.4 seconds><s><v></s><2.4 seconds><s><v></s>'
    """
    group = spec.video_placeholder
    return "".join(f"<{t:.1f} seconds>{group}" for t in qwen3_timestamps(indices, fps, spec.temporal_patch_size))


def group_runs(input_ids: Any, at: int, grid: Sequence[int], merge: int, stop: int) -> list[tuple[int, int]] | None:
    """A packed Qwen3-VL video's placeholder runs ``(start, length)``: ``grid[0]`` runs of ``h * w / merge**2``
    tokens (one per frame group), the first at ``at``, each next one at the next token of the first run's id after
    the previous run (its timestamp and ``<|vision_end|><|vision_start|>`` between them), all before ``stop`` (the
    example's end); None when they are not there (runs that touch read as one in ``get_rope_index``).

    >>> group_runs([1, 9, 9, 2, 3, 9, 9, 2], 1, (2, 2, 4), 2, 8)
    [(1, 2), (5, 2)]
    """
    ids = np.asarray(input_ids)
    per = int(grid[1]) * int(grid[2]) // (merge * merge)
    out, start = [], int(at)
    for g in range(int(grid[0])):
        if per < 1 or start + per > stop:
            return None
        out.append((start, per))
        if g + 1 < int(grid[0]):
            nxt = np.flatnonzero(ids[start + per:stop] == ids[at])
            if not len(nxt) or nxt[0] == 0:
                return None
            start += per + int(nxt[0])
    return out


def grid_of(spec: Any, frames: int, fps: float, width: int, height: int) -> tuple[tuple[int, int, int], list[int],
                                                                                 float]:
    """:meth:`packers.VisionSpec.video_grid`: the video's ``(t, h, w)``, its sampled frame indices and its
    ``second_per_grid_ts``, by the family's video processor (Qwen2-VL's, or Qwen3-VL's own sampling and resize)."""
    if spec.video_fps is None:
        raise PackstreamError("this vision spec packs no videos; pass --video-fps")
    t = spec.temporal_patch_size
    if spec.family.value == "qwen3-vl":
        idx = qwen3_frame_indices(frames, fps, want_fps=spec.video_fps, min_frames=spec.video_min_frames,
                                  max_frames=spec.video_max_frames)
        h, w = qwen3_resized(len(idx), width, height, spec)
    else:
        idx = frame_indices(frames, fps, want_fps=spec.video_fps, min_frames=spec.video_min_frames,
                            max_frames=spec.video_max_frames, temporal=t)
        h, w = spec.video_resized(width, height)
    grid = (-(-len(idx) // t), h // spec.patch_size, w // spec.patch_size)
    return grid, idx, sampled_seconds_per_grid(t, len(idx), frames, fps)


def measure(spec: Any, source: Any, what: str) -> tuple[tuple[int, int, int], float, str]:
    """:meth:`packers.VisionSpec.measure_video_text`: grid, ``second_per_grid_ts`` and, for Qwen3-VL, the
    processor's timestamped text (:func:`qwen3_text`; "" for the others); the file decoded up to its last sampled
    frame."""
    info = probe(source, what)
    grid, indices, seconds = grid_of(spec, info.frames, info.fps, info.width, info.height)
    if hasattr(source, "seek"):
        source.seek(0)
    count_frames(source, indices[-1], what)
    text = qwen3_text(indices, info.fps, spec) if spec.family.value == "qwen3-vl" else ""
    return grid, seconds, text


def sampled_seconds_per_grid(temporal: int, n_indices: int, total: int, fps: float) -> float:
    """Qwen2.5-VL's ``second_per_grid_ts`` of one video: ``temporal / sampled_fps`` as float32 (what the processor's
    tensor holds), ``sampled_fps = n_indices / total * fps`` (``VideoMetadata.sampled_fps``)."""
    return float(np.float32(temporal / (n_indices / total * fps)))


def probe(source: IO[bytes] | str, what: str) -> VideoInfo:
    """The container's first video stream: frame count, rate and size. PackstreamError naming ``what`` when PyAV
    cannot open it, it has no video stream, or its header states no frame count or rate."""
    av = _av()
    try:
        with av.open(source) as container:
            if not container.streams.video:
                raise PackstreamError(f"{what} holds no video stream")
            s = container.streams.video[0]
            info = VideoInfo(int(s.frames), float(s.average_rate or 0), int(s.width), int(s.height))
    except PackstreamError:
        raise
    except Exception as e:  # noqa: BLE001 - PyAV raises many types on a bad file; each is one line naming it
        first = (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise PackstreamError(f"{what} cannot be read as a video ({type(e).__name__}: {first})") from None
    if not 0 < info.frames <= MAX_VIDEO_FRAMES or not info.fps > 0:
        raise PackstreamError(f"{what}: its container states {info.frames} frames at {info.fps:g} fps; the frames "
                              "sampled (as transformers samples them) come from that count and rate: remux it to MP4 "
                              "(ffmpeg -i IN -c copy OUT.mp4) so its header states them")
    return info


def decode_frames(source: IO[bytes] | str, indices: Sequence[int], what: str) -> np.ndarray:
    """The frames ``indices`` (increasing) of the container's first video stream, ``[n, H, W, 3]`` uint8 RGB, decoded
    as transformers' ``read_video_pyav`` decodes them; PackstreamError when one of them is not there (a file cut
    short, or one whose header states more frames than it holds)."""
    av = _av()
    want = set(int(i) for i in indices)
    end = max(want) if want else -1
    frames: list[Any] = []
    try:
        with av.open(source) as container:
            container.seek(0)
            for i, frame in enumerate(container.decode(video=0)):
                if i > end:
                    break
                if i in want:
                    frames.append(frame.to_ndarray(format="rgb24"))
    except Exception as e:  # noqa: BLE001 - as in probe
        first = (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise PackstreamError(f"{what} cannot be decoded ({type(e).__name__}: {first})") from None
    if len(frames) != len(want):
        raise PackstreamError(f"{what}: {len(frames)} of the {len(want)} sampled frames decode (its header states "
                              "more frames than it holds, or it is cut short); re-encode it or drop the record")
    return np.stack(frames)


def count_frames(source: IO[bytes] | str, last: int, what: str) -> None:
    """Decode up to frame ``last``: PackstreamError when the video holds fewer (what :func:`decode_frames` would meet
    at training time), so that such a file is a dead letter when packed."""
    av = _av()
    got = 0
    try:
        with av.open(source) as container:
            for got, _ in enumerate(container.decode(video=0), start=1):
                if got > last:
                    return
    except Exception as e:  # noqa: BLE001 - as in probe
        first = (str(e).splitlines() or [type(e).__name__])[0][:120]
        raise PackstreamError(f"{what} cannot be decoded ({type(e).__name__}: {first})") from None
    raise PackstreamError(f"{what}: {got} frames decode, and frame {last} is sampled (its header states more frames "
                          "than it holds, or it is cut short); re-encode it or drop the record")


def _av() -> Any:
    try:
        import av
    except ImportError:
        raise PackstreamError("videos need PyAV: pip install 'packstream[video]' (or pip install av)") from None
    return av


@dataclasses.dataclass(frozen=True)
class VideoLoader:
    """Turn a batch's video references into ``pixel_values_videos`` (and each video's grid) at load time: the frames
    the packer counted (:meth:`packers.VisionSpec.video_grid` from the container's header), decoded with PyAV and
    turned into patches by :func:`video_patches` (the spec's video pixel limits, patch, merge and temporal sizes), each
    video checked to come out at its packed grid. Paths resolve as :class:`packers.PixelLoader`'s (``root``,
    ``remap``), which it is built from."""

    pixels: Any
    """The :class:`packers.PixelLoader` of the batch's images: its spec, ``root`` and ``remap``."""

    def _open(self, ref: Any, where: str) -> tuple[IO[bytes], str]:
        from packers.files import open_checked

        data, path = (ref.get("bytes"), ref.get("path")) if isinstance(ref, dict) else (None, None)
        if data is not None:
            return io.BytesIO(data), f"{where} ({len(data)} bytes)"
        if not path:
            raise PackstreamError(f"{where}: neither bytes nor a path; the row's videos must carry one of them")
        resolved = self.pixels.resolve(path)
        name = f"{where} ({resolved})"
        try:
            return open_checked(str(resolved), what=f"{where}: video"), name
        except PackstreamError as e:
            raise PackstreamError(f"{e} (stored as {path}); the folder's videos must be readable where you train: "
                                  "map a moved folder with PixelLoader(remap=...) or root=") from None

    def grid_of(self, ref: Any, where: str) -> tuple[tuple[int, int, int], list[int]]:
        """A video's grid and sampled frame indices from its container's header alone (as the packer measured it)."""
        f, name = self._open(ref, where)
        with f:
            info = probe(f, name)
        grid, indices, _ = self.pixels.vision.video_grid(info.frames, info.fps, info.width, info.height)
        return grid, indices

    def source(self, ref: Any) -> str:
        """How a message names the file a video reference reads: its path as the row stores it, and where that
        resolves (``root``, ``remap``) when it differs; a video stored in the row, by its size."""
        data, path = (ref.get("bytes"), ref.get("path")) if isinstance(ref, dict) else (None, None)
        if data is not None:
            return f"the video stored in the row ({len(data)} bytes)"
        resolved = str(self.pixels.resolve(path))
        return f"video file {show_path(path)}" + (f" (read as {show_path(resolved)})" if resolved != path else "")

    def check_grids(self, refs: Sequence[Any], grids: Any, names: Sequence[str]) -> None:
        """ContractError naming the first video (its example and its file) whose header gives another grid than its
        packed one."""
        got = np.array([self.grid_of(r, names[i])[0] for i, r in enumerate(refs)], np.int64).reshape(-1, 3)
        _compare(refs, got, grids, self._named(refs, names), "its header gives video grid")

    def _named(self, refs: Sequence[Any], names: Sequence[str]) -> list[str]:
        return [f"{name}, {self.source(ref)}" for ref, name in zip(refs, names)]

    def __call__(self, refs: Sequence[Any], grids: Any, names: Sequence[str]) -> tuple[Any, Any]:
        """``(pixel_values_videos, video_grid_thw)`` of ``refs``, each checked against its packed grid."""
        import torch

        frames = []
        for i, ref in enumerate(refs):
            _, indices = self.grid_of(ref, names[i])
            f, name = self._open(ref, names[i])
            with f:
                frames.append(decode_frames(f, indices, name))
        v = self.pixels.vision
        done = [video_patches(f, v) for f in frames]
        got = torch.tensor([g for _, g in done], dtype=torch.int64).reshape(-1, 3)
        _compare(refs, got.numpy(), grids, self._named(refs, names), "decodes to video grid")
        return torch.from_numpy(np.concatenate([p for p, _ in done])), got


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def video_patches(frames: np.ndarray, spec: Any) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``[n, H, W, 3]`` uint8 frames -> ``(patches [t * h * w, 3 * temporal * patch * patch] float32, (t, h, w))``:
    each frame resized to the spec's ``video_resized`` size with PIL's bicubic filter (as the PIL image processor
    resizes images), scaled to [0, 1] and normalized with CLIP's mean and std (Qwen2-VL's), the last frame repeated to
    fill the temporal patch, then flattened in ``Qwen2VLVideoProcessor.patchify``'s order.

    transformers' own video processor resizes with torchvision (not installable beside a CPU-only torch wheel here), so
    its pixel values may differ from these by the two resamplers' rounding; grids, token counts and positions do not.
    """
    from PIL import Image

    n, height, width = frames.shape[:3]
    qwen3 = spec.family.value == "qwen3-vl"  # its own resize rule, and mean/std 0.5
    h, w = qwen3_resized(n, width, height, spec) if qwen3 else spec.video_resized(width, height)
    resized = np.stack([np.asarray(Image.fromarray(f).resize((w, h), Image.BICUBIC)) for f in frames])
    mean, std = ((0.5,) * 3, (0.5,) * 3) if qwen3 else (CLIP_MEAN, CLIP_STD)
    x = (resized.astype(np.float32) / 255.0 - np.float32(mean)) / np.float32(std)
    x = x.transpose(0, 3, 1, 2)  # [n, C, h, w]
    t, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    if pad := -n % t:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    gt, gh, gw = x.shape[0] // t, h // p, w // p
    x = x.reshape(gt, t, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, 3 * t * p * p)), (gt, gh, gw)


def _compare(refs: Sequence[Any], got: np.ndarray, grids: Any, names: Sequence[str], how: str) -> None:
    from packers.errors import ContractError

    want = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    if want.shape[0] != got.shape[0]:
        raise ContractError(f"{len(refs)} videos, {want.shape[0]} packed video grids; one grid per video")
    for i in np.flatnonzero((got != want).any(axis=1)):
        raise ContractError(f"{names[i]}: {how} {tuple(got[i].tolist())}, the row was packed for "
                            f"{tuple(want[i].tolist())}: the video file or the row's video_grid_thw changed since "
                            "packing, or the video settings differ from the spec the rows were packed with; put the "
                            "video back as it was packed or repack, or load with that spec")


MAX_PIXELS = 1 << 30
"""Pixels a video frame may be resized to (as an image: packers._vision's limit)."""


VIDEO_FAMILIES = ("qwen2-vl", "qwen2.5-vl", "qwen3-vl")
"""The families whose videos packstream packs."""

DEFAULT_PIXELS = {"qwen3-vl": (128 * 32 * 32, 32 * 32 * 768)}
"""A family's video pixel limits when --video-min-pixels / --video-max-pixels are not given, where they are not
Qwen2-VL's (the spec's field defaults): ``Qwen3VLVideoProcessor.size`` (shortest_edge, longest_edge), pixels over all
the sampled frames (``t_bar * h * w``), not per frame."""


def video_spec(spec: Any, fps: float | None, max_frames: int | None, min_pixels: int | None,
               max_pixels: int | None) -> Any:
    """:meth:`VisionSpec.with_video`: each value checked, one line naming it, its limit and the fix."""
    if fps is None:
        given = [f for f, v in (("--video-max-frames", max_frames), ("--video-min-pixels", min_pixels),
                                ("--video-max-pixels", max_pixels)) if v is not None]
        if given:
            raise PackstreamError(f"{' and '.join(given)} say how videos are sampled, and videos are packed only with "
                                  "--video-fps; add --video-fps 2 (Qwen's default) or drop them")
        return spec
    name = spec.name or spec.family.value
    if spec.family.value not in VIDEO_FAMILIES:
        raise PackstreamError(f"--video-fps: packstream packs videos for Qwen2-VL, Qwen2.5-VL and Qwen3-VL only, not "
                              f"for the processor {name} ({spec.family.value}); drop --video-fps and the records' videos")
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= 1000:
        raise PackstreamError(f"--video-fps {fps!r} is out of range; give frames per second in (0, 1000] "
                              "(Qwen samples 2)")
    for flag, value in (("--video-max-frames", max_frames), ("--video-min-pixels", min_pixels),
                        ("--video-max-pixels", max_pixels)):
        top = 1 << 20 if flag == "--video-max-frames" else MAX_PIXELS
        if value is not None and (not integral(value) or not 1 <= value <= top):
            raise PackstreamError(f"{flag} {value!r} is out of range; give an integer within 1..{top:,}")
    frames = spec.video_max_frames if max_frames is None else int(max_frames)
    if frames < spec.temporal_patch_size:
        raise PackstreamError(f"--video-max-frames {frames} is under the processor's temporal patch of "
                              f"{spec.temporal_patch_size} frames; give at least {spec.temporal_patch_size}")
    low0, high0 = ((DEFAULT_PIXELS.get(spec.family.value) if spec.video_fps is None else None)
                   or (spec.video_min_pixels, spec.video_max_pixels))
    low = low0 if min_pixels is None else int(min_pixels)
    high = high0 if max_pixels is None else int(max_pixels)
    if low > high:
        raise PackstreamError(f"the video pixel limits run from {low:,} to {high:,} (--video-min-pixels / "
                              f"--video-max-pixels, or the processor's defaults {low0:,} and {high0:,}); give a min "
                              "under the max")
    return dataclasses.replace(spec, video_fps=float(fps), video_max_frames=frames,
                               video_min_frames=min(spec.video_min_frames, frames), video_min_pixels=low,
                               video_max_pixels=high)


def folder_settings(processor: str) -> dict[str, int]:
    """The video settings a model folder's ``video_preprocessor_config.json`` writes (transformers' video processor
    reads them when loaded from that folder): ``min_pixels`` / ``max_pixels`` (top-level keys, else ``size.
    shortest_edge`` / ``size.longest_edge``) and ``max_frames``, each read through the typed reader; {} when
    ``processor`` is no folder or has no such entry (one that is there but unreadable, a FIFO or a dangling link, is
    refused: :func:`packers._processor_folder.read_json`). ``--video-min-pixels`` / ``--video-max-pixels`` /
    ``--video-max-frames`` win over them."""
    import os

    from packers._keys import Key, read
    from packers._processor_folder import read_json

    if not os.path.isdir(processor):
        return {}
    fix = "fix the value, or give --video-min-pixels / --video-max-pixels / --video-max-frames"
    loaded = read_json(processor, "video_preprocessor_config.json", fix=fix)
    if loaded is None:
        return {}
    what = f"--processor {os.path.join(processor, 'video_preprocessor_config.json')}"
    values = {k: (v, what, "") for k, v in loaded.items()}
    out = {}
    for name, keys in (("min_pixels", ("min_pixels", "size.shortest_edge")),
                       ("max_pixels", ("max_pixels", "size.longest_edge")), ("max_frames", ("max_frames",))):
        for key in keys:
            top = 1 << 20 if name == "max_frames" else MAX_PIXELS
            value = read(values, Key(key, int, 1, top, default=None, nullable=True), fix, what)
            if value is not None:
                out[name] = value
                break
    return out
