"""Videos for Qwen2-VL and Qwen2.5-VL: which frames the processor samples, and how many tokens they become.

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

    def check_grids(self, refs: Sequence[Any], grids: Any, names: Sequence[str]) -> None:
        """ContractError naming the first video whose header gives another grid than its packed one."""
        got = np.array([self.grid_of(r, names[i])[0] for i, r in enumerate(refs)], np.int64).reshape(-1, 3)
        _compare(refs, got, grids, names, "its header gives video grid")

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
        _compare(refs, got.numpy(), grids, names, "decodes to video grid")
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
    h, w = spec.video_resized(width, height)
    resized = np.stack([np.asarray(Image.fromarray(f).resize((w, h), Image.BICUBIC)) for f in frames])
    x = (resized.astype(np.float32) / 255.0 - np.float32(CLIP_MEAN)) / np.float32(CLIP_STD)
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
                            f"{tuple(want[i].tolist())}: the video or the row's video_grid_thw changed since packing, or "
                            "the video settings differ from the spec the rows were packed with; repack, or load with "
                            "that spec")


MAX_PIXELS = 1 << 30
"""Pixels a video frame may be resized to (as an image: packers._vision's limit)."""


VIDEO_FAMILIES = ("qwen2-vl", "qwen2.5-vl")
"""The families whose videos packstream packs (Qwen3-VL's timestamped frame groups are not done)."""


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
        raise PackstreamError(f"--video-fps: packstream packs videos for Qwen2-VL and Qwen2.5-VL only, not for the "
                              f"processor {name} ({spec.family.value}); drop --video-fps and the records' videos")
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
    low = spec.video_min_pixels if min_pixels is None else int(min_pixels)
    high = spec.video_max_pixels if max_pixels is None else int(max_pixels)
    if low > high:
        raise PackstreamError(f"the video pixel limits run from {low:,} to {high:,} (--video-min-pixels / "
                              "--video-max-pixels, or the processor's defaults 100,352 and 602,112); give a min "
                              "under the max")
    return dataclasses.replace(spec, video_fps=float(fps), video_max_frames=frames,
                               video_min_frames=min(spec.video_min_frames, frames), video_min_pixels=low,
                               video_max_pixels=high)
