"""How many tokens an image becomes, without a model: a vision processor's resize rules as data.

A :class:`VisionSpec` holds what a family's image processor does to an image's size (Qwen2-VL's
``smart_resize`` with its min/max pixels, patch and merge size; LLaVA's fixed square; InternVL's dynamic tiles,
:mod:`packers._tiles`) and the
token strings its chat template and processor use. From an image's width and height alone it
gives the patch grid (``image_grid_thw``, as the processor returns it) and the number of
placeholder tokens the processor expands the image to, so a packer can budget a row exactly
before any pixel is decoded.

Specs come from a processor folder or file (:meth:`VisionSpec.from_processor`: the
``preprocessor_config.json`` / ``processor_config.json`` a model ships) or from the configs
shipped here (:meth:`VisionSpec.builtin`: ``qwen2-vl``, ``qwen2.5-vl``, ``qwen3-vl``, ``llava-1.5``, ``internvl3``,
``gemma3``).

>>> spec = VisionSpec.builtin("qwen2-vl")
>>> spec.image_grid(width=640, height=480)       # smart_resize to 644 x 476, 14-pixel patches
(1, 34, 46)
>>> spec.image_tokens(width=640, height=480)     # the grid merged 2 x 2
391
>>> VisionSpec.builtin("qwen3-vl").image_grid(width=640, height=480)   # 16-pixel patches: multiples of 32
(1, 30, 40)
>>> VisionSpec.builtin("llava-1.5").image_tokens(width=640, height=480)
576
>>> VisionSpec.builtin("internvl3").image_grid(width=640, height=480)    # (tiles, rows, cols): 3 x 4 + thumbnail
(13, 3, 4)
>>> VisionSpec.builtin("internvl3").image_tokens(width=640, height=480)  # 256 per tile
3328
>>> VisionSpec.builtin("gemma3").image_tokens(width=640, height=480)     # one 896 x 896 square, 256 soft tokens
256
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from packers import _gemma, _processor_folder as _folder, _tiles
from packers.errors import PackstreamError
from packers._keys import (NEEDED as _NEEDED, Fixed, Got as _Got, Key as _Key, check_fixed, get as _get,
                           integral as _integral, read as _read, shown as _shown)
from packers._video import CLIP_MEAN, CLIP_STD
from packers.files import load_json

_PRE, _PROC = "preprocessor_config.json", "processor_config.json"

_MAX_RATIO = 200
"""Qwen2-VL's processor refuses an image whose long side is over 200 times its short side."""

# The ranges a processor config's values (and a stored spec's) must fall in. Each is generous: a value outside
# is a typo or a damaged file, never a model (Qwen2-VL ships 14-pixel patches merged 2 x 2 and at most
# 12,845,056 pixels; LLaVA-1.5 a 336-pixel square).
_MAX_PATCH = 1024
"""Pixels per patch side (ViTs use 14 to 32)."""
_MAX_MERGE = 64
"""Patches per merged token side, and frames per temporal patch (Qwen: 2)."""
_MAX_PIXELS = 1 << 30
"""Pixels a resized image may have (32768 x 32768; Qwen2-VL's largest is 12,845,056)."""
_MAX_SIDE = 1 << 15
"""Pixels per side of LLaVA's square (LLaVA-1.5: 336)."""
_MAX_EXTRA = 1024
"""Tokens the vision tower adds beyond the patches (CLIP: its one CLS token)."""
_MAX_TOKEN_CHARS = 256
"""Characters in a placeholder token string (``<|image_pad|>``, ``<image>``)."""
_MAX_TILES = 1024
"""InternVL: tiles an image may become (InternVL3: at most 12, plus the thumbnail)."""
_MAX_TILE_TOKENS = 1 << 16
"""InternVL: tokens per tile (InternVL3: 256)."""


class VisionFamily(str, enum.Enum):
    """How a family turns an image into tokens and positions."""

    QWEN2_VL = "qwen2-vl"
    """``smart_resize`` to multiples of patch x merge within [min, max] pixels; one token per merged patch;
    3-D (temporal, height, width) rotary positions (mRoPE)."""
    QWEN2_5_VL = "qwen2.5-vl"
    """As Qwen2-VL for images (Qwen2.5-VL differs in the vision tower and in video time positions)."""
    QWEN3_VL = "qwen3-vl"
    """``Qwen3VLProcessor`` (Qwen3-VL, Qwen3-VL-MoE): the same image processor class as Qwen2-VL (transformers'
    ``Qwen2VLImageProcessor``) with Qwen3-VL's settings (16-pixel patches, 65,536..16,777,216 pixels), one token
    per merged patch, and image positions the same arithmetic as Qwen2-VL's (``Qwen3VLModel.get_rope_index`` /
    ``get_vision_position_ids``; held equal in ``tests/test_vision_qwen3.py``). Qwen3-VL differs for videos: each
    frame group is its own ``<t seconds>`` timestamp and vision run (:mod:`packers._video`)."""
    LLAVA = "llava"
    """A fixed square resize: every image is the same number of tokens; 1-D positions."""
    INTERNVL = "internvl"
    """Dynamic tiles (:mod:`packers._tiles`): ``tile_tokens`` per tile, the tile count from the aspect ratio;
    ``image_grid_thw`` holds ``(tiles, rows, cols)``; 1-D positions."""
    GEMMA3 = "gemma3"
    """``Gemma3Processor`` (:mod:`packers._gemma`): LLaVA's fixed square (``patch_size``: one pooled token's side,
    896 / 16 = 56); 1-D positions; ``token_type_ids`` (1 on the soft tokens) for each image's bidirectional block."""

    @property
    def mrope(self) -> bool:
        return self not in (VisionFamily.LLAVA, VisionFamily.INTERNVL, VisionFamily.GEMMA3)

    @property
    def square(self) -> bool:
        """Every image resized to one square: the same grid and token count for all."""
        return self in (VisionFamily.LLAVA, VisionFamily.GEMMA3)


class ImageRefusal(str, enum.Enum):
    """Why an image's size cannot be turned into tokens."""

    EMPTY = "empty_image"
    ASPECT = "extreme_aspect_ratio"


class ImageSizeError(PackstreamError):
    """An image whose size the processor refuses; the reason and the numbers are carried as data."""

    def __init__(self, reason: ImageRefusal, width: int, height: int, limit: float) -> None:
        self.reason, self.width, self.height, self.limit = reason, width, height, limit
        if reason is ImageRefusal.EMPTY:
            text = f"image of {width}x{height} pixels has no area"
        else:
            text = (f"image of {width}x{height} pixels has aspect ratio {max(width, height) / min(width, height):.0f}, "
                    f"over the processor's limit {limit:.0f}; crop or pad it")
        super().__init__(text)


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionSpec:
    """A processor's image-size rules and placeholder tokens. Build with :meth:`builtin` or :meth:`from_processor`."""

    family: VisionFamily
    patch_size: int = 14
    """Pixels per patch side."""
    merge_size: int = 2
    """Patches per merged token side (Qwen: 2, so 2 x 2 patches are one token; LLaVA: 1)."""
    temporal_patch_size: int = 2
    """Frames per temporal patch (an image is repeated to fill one)."""
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_size: int = 0
    """LLaVA: the side of the square every image is resized to; InternVL: the side of a tile (0 for Qwen)."""
    extra_tokens: int = 0
    """LLaVA: tokens the vision tower adds beyond the patches (its CLS token, when kept)."""
    image_token: str = "<|image_pad|>"
    """The placeholder the processor repeats once per image token."""
    vision_start: str | None = "<|vision_start|>"
    vision_end: str | None = "<|vision_end|>"
    name: str = ""
    """Where it came from (a builtin name or a path), for messages and the manifest."""
    min_tiles: int = 1
    max_tiles: int = 12
    """InternVL: the processor's ``min_patches`` / ``max_patches`` (tiles of the canvas, the thumbnail not counted)."""
    tile_tokens: int = 256
    """InternVL: the processor's ``image_seq_length``, placeholder tokens per tile."""
    video_fps: float | None = None
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL videos (``--video-fps``): frames sampled per second of video, as the video
    processor's ``fps``; None: videos are refused. The video fields below are stored only when it is set (:meth:`to_json`)."""
    video_min_frames: int = 4
    """The fewest frames sampled (``Qwen2VLVideoProcessor.min_frames``)."""
    video_max_frames: int = 768
    """The most frames sampled (``--video-max-frames``; ``Qwen2VLVideoProcessor.max_frames``)."""
    video_min_pixels: int = 128 * 28 * 28
    """Pixels a video frame is resized to at least (``--video-min-pixels``; the video processor's
    ``size.shortest_edge``, 100,352 by default)."""
    video_max_pixels: int = 28 * 28 * 768
    """Pixels a video frame is resized to at most (``--video-max-pixels``; ``size.longest_edge``, 602,112). Qwen3-VL:
    both limits bound all the sampled frames together, 131,072 and 786,432 by default (its video processor's)."""
    video_token: str = "<|video_pad|>"
    """The placeholder the processor repeats once per video token."""
    tokens_per_second: int = 2
    """Qwen2.5-VL: the model's ``vision_config.tokens_per_second`` (2 in Qwen2.5-VL's releases), which with each
    video's ``second_per_grid_ts`` spaces its temporal positions."""

    def __post_init__(self) -> None:
        bad = [f"{k}={getattr(self, k)}" for k in ("patch_size", "merge_size", "temporal_patch_size")
               if int(getattr(self, k)) < 1]
        if self.family.square and self.image_size < self.patch_size:
            bad.append(f"image_size={self.image_size}")
        if self.family is VisionFamily.GEMMA3 and self.image_size % self.patch_size:
            bad.append(f"image_size={self.image_size} (not a multiple of patch_size={self.patch_size})")
        if self.family is VisionFamily.INTERNVL and not (self.image_size >= 1 and self.tile_tokens >= 1
                                                         and 1 <= self.min_tiles <= self.max_tiles):
            bad.append(f"image_size={self.image_size}, tile_tokens={self.tile_tokens}, min_tiles={self.min_tiles}, "
                       f"max_tiles={self.max_tiles}")
        if self.family.mrope and not 0 < self.min_pixels <= self.max_pixels:
            bad.append(f"min_pixels={self.min_pixels}, max_pixels={self.max_pixels}")
        if self.video_fps is not None and not (0 < self.video_min_pixels <= self.video_max_pixels
                                               and 1 <= self.video_min_frames <= self.video_max_frames):
            bad.append(f"video_min_pixels={self.video_min_pixels}, video_max_pixels={self.video_max_pixels}, "
                       f"video_min_frames={self.video_min_frames}, video_max_frames={self.video_max_frames}")
        if bad:
            raise PackstreamError(f"vision processor {self.name or self.family.value}: {', '.join(bad)} is not a "
                                  "usable setting; check the processor config")

    @property
    def factor(self) -> int:
        """What the resized sides are multiples of."""
        return self.patch_size * self.merge_size

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """The ``(height, width)`` the processor resizes an image of this size to."""
        if width < 1 or height < 1:
            raise ImageSizeError(ImageRefusal.EMPTY, width, height, 0)
        if self.family.square:
            return self.image_size, self.image_size
        if self.family is VisionFamily.INTERNVL:  # the canvas the tiles are cut from
            _, rows, cols = self.image_grid(width, height)
            return rows * self.image_size, cols * self.image_size
        if max(height, width) / min(height, width) > _MAX_RATIO:
            raise ImageSizeError(ImageRefusal.ASPECT, width, height, _MAX_RATIO)
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def image_grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``(t, h, w)`` in patches, as the processor's ``image_grid_thw`` gives it for one image; InternVL:
        ``(tiles, rows, cols)`` (:func:`packers._tiles.tile_grid`)."""
        if self.family is VisionFamily.INTERNVL:
            if width < 1 or height < 1:
                raise ImageSizeError(ImageRefusal.EMPTY, width, height, 0)
            return _tiles.tile_grid(width, height, self.image_size, self.min_tiles, self.max_tiles)
        h, w = self.resized(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def grid_tokens(self, grid: tuple[int, int, int] | list[int]) -> int:
        """The placeholder tokens an image of patch grid ``grid`` becomes."""
        t, h, w = (int(v) for v in grid)
        if self.family is VisionFamily.INTERNVL:
            return t * self.tile_tokens
        return t * h * w // (self.merge_size * self.merge_size) + self.extra_tokens

    def image_tokens(self, width: int, height: int) -> int:
        """The placeholder tokens an image of this size becomes (what the processor expands it to)."""
        return self.grid_tokens(self.image_grid(width, height))

    @property
    def placeholder(self) -> str:
        """The text one image becomes in a record's messages, before the chat template renders them: the processor's
        image text (``<|vision_start|><|image_pad|><|vision_end|>``, ``<image>``); Gemma 3: ``<start_of_image>``, as
        its chat template writes it (:meth:`expand` then does what ``Gemma3Processor`` does to it)."""
        if self.family is VisionFamily.GEMMA3:
            return self.vision_start or ""
        return (self.vision_start or "") + self.image_token + (self.vision_end or "")

    @property
    def video_placeholder(self) -> str:
        """The text one video (for Qwen3-VL, one of its frame groups) becomes in a record's messages:
        ``<|vision_start|><|video_pad|><|vision_end|>``."""
        return (self.vision_start or "") + self.video_token + (self.vision_end or "")

    def expand(self, text: str) -> str:
        """Rendered text as the processor hands it to the tokenizer: unchanged, except for Gemma 3, whose processor
        wraps each ``<start_of_image>`` in blank lines and ``<end_of_image>`` (:func:`packers._gemma.expand`)."""
        return _gemma.expand(text) if self.family is VisionFamily.GEMMA3 else text

    def with_pixel_limits(self, min_pixels: int | None = None, max_pixels: int | None = None) -> VisionSpec:
        """This spec with its resize limits set (``--image-min-pixels`` / ``--image-max-pixels``, LLaMA-Factory's
        ``image_min_pixels`` / ``image_max_pixels``): what the processor's ``min_pixels`` / ``max_pixels`` (its
        ``size.shortest_edge`` / ``size.longest_edge``) do, for the families that resize within a pixel range. A
        limit left None keeps the processor's. A family that resizes every image to one size (LLaVA) has no such
        range and refuses them, as does a pair of limits where the lower is over the upper.

        >>> VisionSpec.builtin("qwen2-vl").with_pixel_limits(max_pixels=768 * 768).image_tokens(4000, 3000)
        713
        """
        if min_pixels is None and max_pixels is None:
            return self
        name = self.name or self.family.value
        if self.family is VisionFamily.INTERNVL:
            raise PackstreamError(f"--image-min-pixels/--image-max-pixels: the processor {name} cuts each image into "
                                  f"{self.image_size}x{self.image_size} tiles ({self.min_tiles}..{self.max_tiles} of "
                                  "them, its min_patches/max_patches), so no pixel limit applies; drop them, or set "
                                  "max_patches in the processor folder")
        if not self.family.mrope:
            raise PackstreamError(f"--image-min-pixels/--image-max-pixels: the processor {name} resizes every image "
                                  f"to one {self.image_size}x{self.image_size} square, so no pixel limit applies; "
                                  "drop them")
        for flag, value in (("--image-min-pixels", min_pixels), ("--image-max-pixels", max_pixels)):
            if value is not None and (not _integral(value) or not 1 <= value <= _MAX_PIXELS):
                raise PackstreamError(f"{flag} {value!r} is out of range; give a pixel count within 1..{_MAX_PIXELS:,} "
                                      "(e.g. --image-max-pixels 589824 for 768x768)")
        low = self.min_pixels if min_pixels is None else int(min_pixels)
        high = self.max_pixels if max_pixels is None else int(max_pixels)
        if low > high:
            said = (f"--image-min-pixels {low:,}" if min_pixels is not None else f"the processor's min_pixels {low:,}")
            over = (f"--image-max-pixels {high:,}" if max_pixels is not None else f"the processor's max_pixels "
                    f"{high:,}")
            fix = (f"give --image-min-pixels {high:,} or less too" if min_pixels is None
                   else f"give --image-max-pixels {low:,} or more too" if max_pixels is None
                   else "give a lower --image-min-pixels or a higher --image-max-pixels")
            raise PackstreamError(f"{said} is over {over} for processor {name}; {fix}")
        return dataclasses.replace(self, min_pixels=low, max_pixels=high)

    @property
    def videos(self) -> bool:
        """Whether videos are packed (``--video-fps`` given)."""
        return self.video_fps is not None

    def with_video(self, fps: float | None, max_frames: int | None = None, min_pixels: int | None = None,
                   max_pixels: int | None = None) -> VisionSpec:
        """This spec packing videos (``--video-fps``, ``--video-max-frames``, ``--video-min-pixels``,
        ``--video-max-pixels``): Qwen2-VL, Qwen2.5-VL and Qwen3-VL only. ``fps`` None and no other value: unchanged."""
        from packers._video import video_spec

        return video_spec(self, fps, max_frames, min_pixels, max_pixels)

    def video_resized(self, width: int, height: int) -> tuple[int, int]:
        """The ``(height, width)`` the video processor resizes every frame of a ``width`` x ``height`` video to."""
        if width < 1 or height < 1:
            raise ImageSizeError(ImageRefusal.EMPTY, width, height, 0)
        if max(height, width) / min(height, width) > _MAX_RATIO:
            raise ImageSizeError(ImageRefusal.ASPECT, width, height, _MAX_RATIO)
        return smart_resize(height, width, self.factor, self.video_min_pixels, self.video_max_pixels)

    def video_grid(self, frames: int, fps: float, width: int, height: int) -> tuple[tuple[int, int, int], list[int],
                                                                                     float]:
        """A video of ``frames`` frames at ``fps`` (its container's count and rate), ``width`` x ``height``: its patch
        grid ``(t, h, w)`` (``video_grid_thw``), the frame indices sampled, and its ``second_per_grid_ts``
        (:func:`packers._video.grid_of`: Qwen2-VL's sampling and resize, or Qwen3-VL's own)."""
        from packers._video import grid_of

        return grid_of(self, frames, fps, width, height)

    def measure_video(self, source: Any, what: str) -> tuple[tuple[int, int, int], float]:
        """A video file (a path or a seekable binary file object): its ``video_grid_thw`` and ``second_per_grid_ts``
        from its container's frame count, rate and size, its frames decoded once up to the last one sampled (one
        that is not there, or a file PyAV cannot read, is a PackstreamError naming ``what``). Needs PyAV."""
        return self.measure_video_text(source, what)[:2]

    def measure_video_text(self, source: Any, what: str) -> tuple[tuple[int, int, int], float, str]:
        """:meth:`measure_video`, and for Qwen3-VL the text its processor writes for the video (a ``<t seconds>``
        timestamp and one ``<|video_pad|>`` run per temporal group: :func:`packers._video.qwen3_text`); ""."""
        from packers._video import measure

        return measure(self, source, what)

    @staticmethod
    def folder_video_settings(processor: str) -> dict[str, int]:
        """A model folder's own video settings (its ``video_preprocessor_config.json``: ``min_pixels``,
        ``max_pixels``, ``max_frames``; {} without one), what ``--video-*`` flags left out default to
        (:func:`packers._video.folder_settings`)."""
        from packers._video import folder_settings

        return folder_settings(processor)

    def video_runs(self, input_ids: Any, at: int, grid: Any, stop: int) -> list[tuple[int, int]] | None:
        """Where a packed video's placeholder tokens lie, ``(start, length)`` runs from its offset ``at`` (``stop``: its
        example's end): one run, or for Qwen3-VL one per temporal group, timestamps between them
        (:func:`packers._video.group_runs`; None when they are not there)."""
        if self.family is VisionFamily.QWEN3_VL:
            from packers._video import group_runs

            return group_runs(input_ids, at, grid, self.merge_size, stop)
        return [(int(at), self.grid_tokens(grid))]

    def to_json(self) -> str:
        """The spec as JSON; InternVL's tile fields only for that family, the video fields only when it packs videos
        (another spec's JSON stays as it was, and reads in older packstreams)."""
        drop = set(() if self.family is VisionFamily.INTERNVL else _TILE_FIELDS)
        if self.video_fps is None:
            drop |= set(_VIDEO_FIELDS)
        return json.dumps({k: (v.value if isinstance(v, enum.Enum) else v)
                           for k, v in dataclasses.asdict(self).items() if k not in drop}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, *, what: str = "vision spec") -> VisionSpec:
        """The spec :meth:`to_json` wrote (a manifest's or a shard's ``vision`` entry). A value of the wrong type
        or out of range (a hand-edited or damaged file) is one PackstreamError line naming ``what``, the field and
        the value."""
        fix = "the run's vision spec was edited or damaged; pack the data again"
        data = load_json(text, what=what, fix=fix)
        if not isinstance(data, dict):
            raise PackstreamError(f"{what}: {_shown(data)} is not a JSON object; {fix}")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise PackstreamError(f"{what} has unknown fields {unknown}: written by a newer packstream; upgrade")
        values = {k: (v, what, "") for k, v in data.items()}
        # A field left out takes the dataclass's default, as it always has; only ``family`` has none.
        read = {key.path: _read(values, key, fix, what) for key in _SPEC_KEYS
                if key.path in data or key.default is _NEEDED}
        return cls(**{**read, "family": VisionFamily(read["family"])})

    @classmethod
    def builtin(cls, name: str) -> VisionSpec:
        """A spec shipped with packstream: ``qwen2-vl``, ``qwen2.5-vl``, ``qwen3-vl``, ``llava-1.5``, ``internvl3`` or
        ``gemma3``."""
        key = name.strip().lower()
        if key not in _BUILTIN:
            raise PackstreamError(f"no shipped vision processor {name!r}; choose one of {sorted(_BUILTIN)} or pass "
                                  "the model's processor folder (its preprocessor_config.json)")
        return dataclasses.replace(_BUILTIN[key], name=key)

    @classmethod
    def from_processor(cls, path: str | Path) -> VisionSpec:
        """Read a model's processor config: a folder with ``preprocessor_config.json`` (and optionally
        ``processor_config.json``), or one of those files, or a shipped name.

        Each key read is declared once (``_QWEN_KEYS``, ``_LLAVA_KEYS``, ``_INTERNVL_KEYS``: type, range, default); a
        value of the wrong type, out of range or missing is one PackstreamError line naming the file it is in, the
        key, the value as written and the fix. Integers may be written ``14.0``; ``true`` is no integer. Every file is
        read through :func:`packers._processor_folder.read_json` (a FIFO, a folder or a dangling link where a file
        should be is refused, never skipped), and a ``config.json`` beside them must name a model type verified for
        the family (:func:`packers._processor_folder.check_model_type`)."""
        text = os.fspath(path)
        if not os.path.exists(text):
            if text.strip().lower() in _BUILTIN:
                return cls.builtin(text)
            if not os.path.lexists(text):
                raise PackstreamError(f"--processor {path}: no such file or folder; give the model's folder (with "
                                      f"preprocessor_config.json) or one of {sorted(_BUILTIN)}")
        if os.path.isdir(text):
            folder = text
            files = [(os.path.join(folder, name), _folder.read_json(folder, name)) for name in (_PRE, _PROC)]
        else:  # one file (a dangling link or a FIFO named here is refused as a folder's would be)
            folder = os.path.dirname(text) or "."
            files = [(text, _folder.read_file(text))]
        present = [f for f, loaded in files if loaded is not None]
        config: dict[str, tuple[Any, str, str]] = {}  # key -> (value, the file it came from, its key prefix)
        for f, loaded in files:
            if loaded is None:
                continue
            what = f"--processor {f}"
            # processor_config.json may nest the image processor's settings; its own keys win.
            nested = loaded.get("image_processor")
            if isinstance(nested, dict):
                config.update({k: (v, what, "image_processor.") for k, v in nested.items()})
            config.update({k: (v, what, "") for k, v in loaded.items() if k != "image_processor"})
        if not config:
            raise PackstreamError(f"--processor {present[0]}: an empty JSON object, no image processor settings; pass "
                                  "the model's processor folder" if present else
                                  f"--processor {path}: no preprocessor_config.json there")
        spec = _from_config(config, name=str(path), where=f"--processor {present[0]}")
        model = _folder.read_json(folder, "config.json")
        if model is not None:  # absent: the spec stands on the processor files alone, as it always has
            where = f"--processor {os.path.join(folder, 'config.json')}"
            _folder.check_model_type(spec.family.value, model, where)
            if spec.family is VisionFamily.GEMMA3:
                _gemma.check_model(model, where, spec.image_size, spec.image_tokens(1, 1))
        return spec


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule: sides multiples of ``factor``, area in ``[min_pixels, max_pixels]``, aspect kept.

    The same arithmetic as ``transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.smart_resize``
    (``tests/test_vision.py`` holds the two equal over generated sizes).

    >>> smart_resize(480, 640, 28, 56 * 56, 28 * 28 * 1280)
    (476, 644)
    """
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


_QWEN_PROCESSORS = {"Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil"}
_CLIP_PROCESSORS = {"CLIPImageProcessor", "CLIPImageProcessorFast", "CLIPImageProcessorPil", "LlavaImageProcessor",
                    "LlavaImageProcessorFast", "LlavaImageProcessorPil"}
_QWEN_MODELS = {"": VisionFamily.QWEN2_VL, "Qwen2VLProcessor": VisionFamily.QWEN2_VL,
                "Qwen2_5_VLProcessor": VisionFamily.QWEN2_5_VL, "Qwen3VLProcessor": VisionFamily.QWEN3_VL}
_LLAVA_MODELS = {"", "LlavaProcessor"}
_GOT_OCR2_PROCESSORS = {"GotOcr2ImageProcessor", "GotOcr2ImageProcessorFast", "GotOcr2ImageProcessorPil"}
_INTERNVL_MODELS = {"InternVLProcessor"}

# Pixel settings the loader reproduces (packers.PixelLoader builds transformers' PIL processors with the class
# defaults, Qwen3-VL with mean/std 0.5): a config that sets another is refused, never loaded with other pixels.
_COMMON_FIXED = (Fixed("do_resize", True), Fixed("do_rescale", True), Fixed("do_normalize", True),
                 Fixed("do_convert_rgb", True), Fixed("rescale_factor", 1 / 255), Fixed("resample", 3))  # bicubic
_QWEN_FIXED = _COMMON_FIXED + (Fixed("image_mean", list(CLIP_MEAN)), Fixed("image_std", list(CLIP_STD)))
_QWEN3_FIXED = _COMMON_FIXED + (Fixed("image_mean", [0.5] * 3, default_ok=False),
                                Fixed("image_std", [0.5] * 3, default_ok=False))
_LLAVA_FIXED = _QWEN_FIXED + (Fixed("do_center_crop", True),)
_OWN_PIXELS = ("{fix}, then load with Collator(vision=ds.vision, pixels=PixelLoader(vision=ds.vision, processor=<your "
               "image processor>)) to train on its pixels")

# The keys of a processor config that packstream reads: each declared once. A key left out takes the image
# processor class's default, as transformers does (Qwen3VLProcessor's image processor is Qwen2VLImageProcessor, so a
# Qwen3-VL config without patch_size gets Qwen2-VL's 14 there too; Qwen3-VL's own configs write every key).
_KIND = _Key("image_processor_type", str, 0, 200, default="", nullable=True)
_MODEL = _Key("processor_class", str, 0, 200, default="", nullable=True)
_PATCH = _Key("patch_size", int, 1, _MAX_PATCH, default=14)
_QWEN_KEYS = (
    _PATCH,
    _Key("merge_size", int, 1, _MAX_MERGE, default=2),
    _Key("temporal_patch_size", int, 1, _MAX_MERGE, default=2),
    # min_pixels wins over size.shortest_edge, as in transformers' Qwen2VLImageProcessor; then the default.
    _Key("min_pixels", int, 1, _MAX_PIXELS, default=None, nullable=True),
    _Key("size.shortest_edge", int, 1, _MAX_PIXELS, default=56 * 56, nullable=True),
    _Key("max_pixels", int, 1, _MAX_PIXELS, default=None, nullable=True),
    _Key("size.longest_edge", int, 1, _MAX_PIXELS, default=28 * 28 * 1280, nullable=True),
)
_LLAVA_KEYS = (
    _PATCH,
    # The square's side: crop_size (what CLIP's center crop leaves), else size.shortest_edge.
    _Key("crop_size.height", int, 1, _MAX_SIDE, default=None, bare=True),
    _Key("size.shortest_edge", int, 1, _MAX_SIDE, default=None, bare=True),
    _Key("num_additional_image_tokens", int, 0, _MAX_EXTRA, default=1),
    _Key("vision_feature_select_strategy", str, choices=("default", "full"), default="default"),
    _Key("image_token", str, 1, _MAX_TOKEN_CHARS, default="<image>"),
)
_INTERNVL_KEYS = (
    _Key("size.height", int, 1, _MAX_SIDE, default=_NEEDED),
    _Key("size.width", int, 1, _MAX_SIDE, default=_NEEDED),
    _Key("min_patches", int, 1, _MAX_TILES, default=1),  # GotOcr2ImageProcessor's defaults
    _Key("max_patches", int, 1, _MAX_TILES, default=12),
    _Key("image_seq_length", int, 1, _MAX_TILE_TOKENS, default=256),  # InternVLProcessor's default
)
_GEMMA3_KEYS = (  # Gemma3ImageProcessor's size (its class default 224 is never Gemma 3's), Gemma3Processor's tokens
    _Key("size.height", int, 1, _MAX_SIDE, default=_NEEDED),
    _Key("size.width", int, 1, _MAX_SIDE, default=_NEEDED),
    _Key("image_seq_length", int, 1, _MAX_TILE_TOKENS, default=_gemma.TOKENS),
)
# The fields of a stored spec (VisionSpec.to_json), for VisionSpec.from_json. A field left out takes the
# dataclass's default (``default`` here is only what a nullable field's null reads as); ``family`` must be there.
_SPEC_KEYS = (
    _Key("family", str, choices=tuple(f.value for f in VisionFamily)),
    _Key("patch_size", int, 1, _MAX_PATCH, default=None),
    _Key("merge_size", int, 1, _MAX_MERGE, default=None),
    _Key("temporal_patch_size", int, 1, _MAX_MERGE, default=None),
    _Key("min_pixels", int, 1, _MAX_PIXELS, default=None),
    _Key("max_pixels", int, 1, _MAX_PIXELS, default=None),
    _Key("image_size", int, 0, _MAX_SIDE, default=None),
    _Key("extra_tokens", int, -1, _MAX_EXTRA, default=None),
    _Key("image_token", str, 1, _MAX_TOKEN_CHARS, default=None),
    _Key("vision_start", str, 1, _MAX_TOKEN_CHARS, default=None, nullable=True),
    _Key("vision_end", str, 1, _MAX_TOKEN_CHARS, default=None, nullable=True),
    _Key("name", str, 0, 4096, default=None),
    _Key("min_tiles", int, 1, _MAX_TILES, default=None),
    _Key("max_tiles", int, 1, _MAX_TILES, default=None),
    _Key("tile_tokens", int, 1, _MAX_TILE_TOKENS, default=None),
    _Key("video_fps", float, 0, 1000, default=None, nullable=True),
    _Key("video_min_frames", int, 1, 1 << 20, default=None),
    _Key("video_max_frames", int, 1, 1 << 20, default=None),
    _Key("video_min_pixels", int, 1, _MAX_PIXELS, default=None),
    _Key("video_max_pixels", int, 1, _MAX_PIXELS, default=None),
    _Key("video_token", str, 1, _MAX_TOKEN_CHARS, default=None),
    _Key("tokens_per_second", int, 1, 1 << 16, default=None),
)
_TILE_FIELDS = ("min_tiles", "max_tiles", "tile_tokens")
"""The fields a spec stores only for InternVL."""
_VIDEO_FIELDS = ("video_fps", "video_min_frames", "video_max_frames", "video_min_pixels", "video_max_pixels",
                 "video_token", "tokens_per_second")
"""The fields a spec stores only when it packs videos."""
def _from_config(config: Mapping[str, tuple[Any, str, str]], name: str, where: str) -> VisionSpec:
    """A spec from a processor config (key -> (value, the file it came from, its key prefix)); ``where`` names
    the main file, for a key that is missing. A processor whose token count or positions packstream has not
    verified (LLaVA-NeXT's any-resolution tiles, Qwen2-VL's image processor under another model's processor, ...) is
    refused, never guessed."""
    shipped = "fix the value or pass a shipped spec: --processor "
    kind = _read(config, _KIND, shipped + "qwen2-vl", where)
    model = _read(config, _MODEL, shipped + "qwen2-vl", where)
    if kind in _QWEN_PROCESSORS and model in _QWEN_MODELS:
        family = _QWEN_MODELS[model]
        fix = shipped + family.value
        got = {key.path: _get(config, key, fix) for key in _QWEN_KEYS}
        low = got["min_pixels"] if got["min_pixels"].value is not None else got["size.shortest_edge"]
        high = got["max_pixels"] if got["max_pixels"].value is not None else got["size.longest_edge"]
        if low.value > high.value:
            at = low.what or high.what
            raise PackstreamError(f"{at}: {low.named('min_pixels', at)} is over {high.named('max_pixels', at)}, "
                                  f"expected min_pixels <= max_pixels; {fix}")
        check_fixed(config, _QWEN3_FIXED if family is VisionFamily.QWEN3_VL else _QWEN_FIXED, where,
                    family.value, _OWN_PIXELS.format(fix=fix))
        return VisionSpec(
            family=family, name=name, patch_size=got["patch_size"].value, merge_size=got["merge_size"].value,
            temporal_patch_size=got["temporal_patch_size"].value, min_pixels=low.value, max_pixels=high.value)
    if kind in _CLIP_PROCESSORS and model in _LLAVA_MODELS:
        fix = shipped + "llava-1.5"
        got = {key.path: _get(config, key, fix) for key in _LLAVA_KEYS}
        side = got["crop_size.height"] if got["crop_size.height"].value is not None else got["size.shortest_edge"]
        patch = got["patch_size"]
        if side.value is None:
            held = [f"{prefix}{k} {_shown(v)} in {what}" if k in config else f"{k} absent"
                    for k in ("crop_size", "size") for v, what, prefix in [config.get(k, (None, "", ""))]]
            raise PackstreamError(f"{where}: no side for the square images are resized to ({', '.join(held)}), "
                                  f"expected crop_size.height or size.shortest_edge (LLaVA-1.5: 336); {fix}")
        if side.value < patch.value:
            raise PackstreamError(f"{side.what}: {side.named('', side.what)} is under "
                                  f"{patch.named('patch_size', side.what)}, expected a side of at least one patch; {fix}")
        check_fixed(config, _LLAVA_FIXED, where, "LLaVA-1.5", _OWN_PIXELS.format(fix=fix))
        default = got["vision_feature_select_strategy"].value == "default"  # "default" drops the CLS feature
        return VisionSpec(family=VisionFamily.LLAVA, name=name, patch_size=patch.value, merge_size=1,
                          temporal_patch_size=1, image_size=side.value,
                          extra_tokens=got["num_additional_image_tokens"].value - (1 if default else 0),
                          image_token=got["image_token"].value, vision_start=None, vision_end=None)
    if kind in _GOT_OCR2_PROCESSORS and model in _INTERNVL_MODELS:
        return _internvl_spec(config, name, where)
    if kind in _gemma.PROCESSORS and model in _gemma.MODELS:
        return _gemma3_spec(config, name, where)
    raise PackstreamError(
        f"--processor {name}: image processor {kind or '(unnamed)'} of {model or '(no processor_class)'} is not one "
        f"packstream counts tokens for exactly; supported: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA-1.5 (CLIP), InternVL3 "
        f"(GotOcr2 of InternVLProcessor), Gemma 3 (Gemma3Processor). Shipped: "
        f"{sorted(_BUILTIN)}")


def _square(got: Mapping[str, _Got], where: str, fix: str, side: str, square: str) -> _Got:
    """A config's ``size.height``, which must be there and equal ``size.width`` (the vision tower's square
    ``image_size``); else one line naming the file, what ``side`` is and that ``square`` was expected."""
    for key in ("size.height", "size.width"):
        if got[key].value is _NEEDED:
            raise PackstreamError(f"{where}: {key} is missing, expected {side}; {fix}")
    height, width = got["size.height"], got["size.width"]
    if height.value != width.value:
        raise PackstreamError(f"{height.what}: {height.named('', height.what)} and {width.named('', height.what)} "
                              f"differ, expected {square} (the vision tower's image_size); {fix}")
    return height


def _internvl_spec(config: Mapping[str, tuple[Any, str, str]], name: str, where: str) -> VisionSpec:
    """InternVL's tiles from a GotOcr2 image processor config of ``InternVLProcessor``. ``InternVLProcessor`` always
    crops to tiles (it passes ``crop_to_patches=True`` whatever the image processor's own ``crop_to_patches``, which
    InternVL3-hf ships false), so that key is not read. Tiles must be square (the vision tower's), ``min_patches <=
    max_patches``, and the pixel settings InternVL3-hf's (:data:`packers._tiles.FIXED`); anything else is refused."""
    fix = "fix the value or pass a shipped spec: --processor internvl3"
    got = {key.path: _get(config, key, fix) for key in _INTERNVL_KEYS}
    height = _square(got, where, fix, 'the tile side (InternVL3: size {"height": 448, "width": 448})', "square tiles")
    low, high = got["min_patches"], got["max_patches"]
    if low.value > high.value:
        at = low.what or high.what
        raise PackstreamError(f"{at}: {low.named('min_patches', at)} is over {high.named('max_patches', at)}, "
                              f"expected min_patches <= max_patches; {fix}")
    check_fixed(config, _tiles.FIXED, where, "InternVL3-hf", fix)
    return VisionSpec(family=VisionFamily.INTERNVL, name=name, patch_size=14, merge_size=1, temporal_patch_size=1,
                      image_size=height.value, min_tiles=low.value, max_tiles=high.value,
                      tile_tokens=got["image_seq_length"].value, image_token="<IMG_CONTEXT>", vision_start="<img>",
                      vision_end="</img>")


def _gemma3_spec(config: Mapping[str, tuple[Any, str, str]], name: str, where: str) -> VisionSpec:
    """Gemma 3's square from a ``Gemma3Processor`` config: a square ``size``, ``image_seq_length`` a square number
    whose side divides it, pan-and-scan off, Gemma 3's pixel settings (:func:`packers._gemma.check_fixed`)."""
    fix = "fix the value or pass a shipped spec: --processor gemma3"
    got = {key.path: _get(config, key, fix) for key in _GEMMA3_KEYS}
    height = _square(got, where, fix, 'the square images are resized to (Gemma 3: size {"height": 896, "width": 896})',
                     "a square")
    seq = got["image_seq_length"]
    side = _gemma.square_side(seq.value)
    if not side or height.value % side:
        raise PackstreamError(f"{seq.what or where}: {seq.named('image_seq_length', seq.what or where)} is not a "
                              f"square number whose side divides the image side {height.value} (Gemma 3: 256, 16 x 16 "
                              f"pooled tokens of 896 pixels); {fix}")
    _gemma.check_fixed(config, where, fix)
    return VisionSpec(family=VisionFamily.GEMMA3, name=name, patch_size=height.value // side, merge_size=1,
                      temporal_patch_size=1, image_size=height.value, image_token=_gemma.SOFT,
                      vision_start=_gemma.BOI, vision_end=_gemma.EOI)


_BUILTIN: dict[str, VisionSpec] = {
    # Qwen/Qwen2-VL-*-Instruct preprocessor_config.json: 14-pixel patches merged 2 x 2, 3136..12845056 pixels.
    "qwen2-vl": VisionSpec(family=VisionFamily.QWEN2_VL, min_pixels=3136, max_pixels=12845056),
    # Qwen/Qwen2.5-VL-*-Instruct: the same image rules.
    "qwen2.5-vl": VisionSpec(family=VisionFamily.QWEN2_5_VL, min_pixels=3136, max_pixels=12845056),
    # Qwen/Qwen3-VL-*-Instruct preprocessor_config.json (the same in the 2B..32B and the MoE 30B-A3B/235B-A22B
    # releases): Qwen2VLImageProcessorFast with 16-pixel patches merged 2 x 2, temporal 2, size.shortest_edge 65536
    # (256 x 256) and size.longest_edge 16777216 (4096 x 4096), image_mean/image_std 0.5. transformers 5.25 ships no
    # Qwen3-VL image defaults of its own (models/auto/image_processing_auto.py maps qwen3_vl to Qwen2VLImageProcessor,
    # whose defaults are Qwen2-VL's); its Qwen3VLVideoProcessor's 131072..786432 pixels are for videos only.
    "qwen3-vl": VisionSpec(family=VisionFamily.QWEN3_VL, patch_size=16, min_pixels=65536, max_pixels=16777216),
    # llava-hf/llava-1.5-*-hf: CLIP ViT-L/14 at 336 x 336, the CLS feature dropped: 576 tokens.
    "llava-1.5": VisionSpec(family=VisionFamily.LLAVA, patch_size=14, merge_size=1, temporal_patch_size=1,
                            image_size=336, extra_tokens=0, image_token="<image>", vision_start=None, vision_end=None),
    # OpenGVLab/InternVL3-*-hf: GotOcr2ImageProcessorFast at 448 x 448 tiles, min_patches 1, max_patches 12 (as
    # transformers' convert_internvl_weights_to_hf.py writes it), InternVLProcessor's image_seq_length 256 (448 / 14
    # = 32 patches a side, pixel-shuffled by 0.5: 16 x 16), tokens <img> <IMG_CONTEXT> </img> (the tokenizer's
    # start_image_token, context_image_token, end_image_token).
    "internvl3": VisionSpec(family=VisionFamily.INTERNVL, patch_size=14, merge_size=1, temporal_patch_size=1,
                            image_size=448, min_tiles=1, max_tiles=12, tile_tokens=256, image_token="<IMG_CONTEXT>",
                            vision_start="<img>", vision_end="</img>"),
    # google/gemma-3-{4b,12b,27b}-it: 896 x 896, 256 soft tokens of 56 x 56 pixels each (packers._gemma.SIDE, TOKENS).
    "gemma3": VisionSpec(family=VisionFamily.GEMMA3, patch_size=_gemma.SIDE // 16, merge_size=1, temporal_patch_size=1,
                         image_size=_gemma.SIDE, image_token=_gemma.SOFT, vision_start=_gemma.BOI,
                         vision_end=_gemma.EOI),
}
