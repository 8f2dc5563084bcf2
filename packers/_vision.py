"""How many tokens an image becomes, without a model: a vision processor's resize rules as data.

A :class:`VisionSpec` holds what a family's image processor does to an image's size (Qwen2-VL's
``smart_resize`` with its min/max pixels, patch and merge size; LLaVA's fixed square) and the
token strings its chat template and processor use. From an image's width and height alone it
gives the patch grid (``image_grid_thw``, as the processor returns it) and the number of
placeholder tokens the processor expands the image to, so a packer can budget a row exactly
before any pixel is decoded.

Specs come from a processor folder or file (:meth:`VisionSpec.from_processor`: the
``preprocessor_config.json`` / ``processor_config.json`` a model ships) or from the configs
shipped here (:meth:`VisionSpec.builtin`: ``qwen2-vl``, ``qwen2.5-vl``, ``llava-1.5``).

>>> spec = VisionSpec.builtin("qwen2-vl")
>>> spec.image_grid(width=640, height=480)       # smart_resize to 644 x 476, 14-pixel patches
(1, 34, 46)
>>> spec.image_tokens(width=640, height=480)     # the grid merged 2 x 2
391
>>> VisionSpec.builtin("llava-1.5").image_tokens(width=640, height=480)
576
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from pathlib import Path
from typing import Any, Mapping

from packers.errors import PackstreamError
from packers.files import load_json, read_checked

_MAX_CONFIG_BYTES = 1 << 20
"""A processor config is a few hundred bytes; a file over 1 MiB is not one."""

_MAX_RATIO = 200
"""Qwen2-VL's processor refuses an image whose long side is over 200 times its short side."""


class VisionFamily(str, enum.Enum):
    """How a family turns an image into tokens and positions."""

    QWEN2_VL = "qwen2-vl"
    """``smart_resize`` to multiples of patch x merge within [min, max] pixels; one token per merged patch;
    3-D (temporal, height, width) rotary positions (mRoPE)."""
    QWEN2_5_VL = "qwen2.5-vl"
    """As Qwen2-VL for images (Qwen2.5-VL differs in the vision tower and in video time positions)."""
    LLAVA = "llava"
    """A fixed square resize: every image is the same number of tokens; 1-D positions."""

    @property
    def mrope(self) -> bool:
        return self is not VisionFamily.LLAVA


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
    """LLaVA: the side of the square every image is resized to (0 for Qwen)."""
    extra_tokens: int = 0
    """LLaVA: tokens the vision tower adds beyond the patches (its CLS token, when kept)."""
    image_token: str = "<|image_pad|>"
    """The placeholder the processor repeats once per image token."""
    vision_start: str | None = "<|vision_start|>"
    vision_end: str | None = "<|vision_end|>"
    name: str = ""
    """Where it came from (a builtin name or a path), for messages and the manifest."""

    def __post_init__(self) -> None:
        bad = [f"{k}={getattr(self, k)}" for k in ("patch_size", "merge_size", "temporal_patch_size")
               if int(getattr(self, k)) < 1]
        if self.family is VisionFamily.LLAVA and self.image_size < self.patch_size:
            bad.append(f"image_size={self.image_size}")
        if self.family.mrope and not 0 < self.min_pixels <= self.max_pixels:
            bad.append(f"min_pixels={self.min_pixels}, max_pixels={self.max_pixels}")
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
        if self.family is VisionFamily.LLAVA:
            return self.image_size, self.image_size
        if max(height, width) / min(height, width) > _MAX_RATIO:
            raise ImageSizeError(ImageRefusal.ASPECT, width, height, _MAX_RATIO)
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)

    def image_grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``(t, h, w)`` in patches, as the processor's ``image_grid_thw`` gives it for one image."""
        h, w = self.resized(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def grid_tokens(self, grid: tuple[int, int, int] | list[int]) -> int:
        """The placeholder tokens an image of patch grid ``grid`` becomes."""
        t, h, w = (int(v) for v in grid)
        return t * h * w // (self.merge_size * self.merge_size) + self.extra_tokens

    def image_tokens(self, width: int, height: int) -> int:
        """The placeholder tokens an image of this size becomes (what the processor expands it to)."""
        return self.grid_tokens(self.image_grid(width, height))

    def to_json(self) -> str:
        return json.dumps({k: (v.value if isinstance(v, enum.Enum) else v)
                           for k, v in dataclasses.asdict(self).items()}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> VisionSpec:
        data = json.loads(text)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise PackstreamError(f"vision spec has unknown fields {unknown}: written by a newer packstream; upgrade")
        return cls(**{**data, "family": VisionFamily(data["family"])})

    @classmethod
    def builtin(cls, name: str) -> VisionSpec:
        """A spec shipped with packstream: ``qwen2-vl``, ``qwen2.5-vl`` or ``llava-1.5``."""
        key = name.strip().lower()
        if key not in _BUILTIN:
            raise PackstreamError(f"no shipped vision processor {name!r}; choose one of {sorted(_BUILTIN)} or pass "
                                  "the model's processor folder (its preprocessor_config.json)")
        return dataclasses.replace(_BUILTIN[key], name=key)

    @classmethod
    def from_processor(cls, path: str | Path) -> VisionSpec:
        """Read a model's processor config: a folder with ``preprocessor_config.json`` (and optionally
        ``processor_config.json``), or one of those files, or a shipped name."""
        p = Path(path)
        if not p.exists():
            if str(path).strip().lower() in _BUILTIN:
                return cls.builtin(str(path))
            raise PackstreamError(f"--processor {path}: no such file or folder; give the model's folder (with "
                                  f"preprocessor_config.json) or one of {sorted(_BUILTIN)}")
        config: dict[str, Any] = {}
        files = [p] if p.is_file() else [p / "preprocessor_config.json", p / "processor_config.json"]
        for f in files:
            if f.is_file():
                loaded = load_json(read_checked(str(f), what=f"--processor {f}", limit=_MAX_CONFIG_BYTES),
                                   what=f"--processor {f}", fix="pass the model's processor folder")
                if not isinstance(loaded, dict):
                    raise PackstreamError(f"--processor {f}: a JSON object was expected")
                # processor_config.json may nest the image processor's settings.
                config.update(loaded.get("image_processor", {}) if isinstance(loaded.get("image_processor"), dict)
                              else {})
                config.update({k: v for k, v in loaded.items() if k != "image_processor"})
        if not config:
            raise PackstreamError(f"--processor {path}: no preprocessor_config.json there")
        return _from_config(config, name=str(path))


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
                "Qwen2_5_VLProcessor": VisionFamily.QWEN2_5_VL}
_LLAVA_MODELS = {"", "LlavaProcessor"}


def _from_config(config: Mapping[str, Any], name: str) -> VisionSpec:
    """A spec from a processor config; a processor whose token count or positions packstream has not verified
    (Qwen3-VL, LLaVA-NeXT's any-resolution tiles, ...) is refused, never guessed."""
    kind = str(config.get("image_processor_type") or "")
    model = str(config.get("processor_class") or "")
    size = config.get("size") if isinstance(config.get("size"), dict) else {}
    if kind in _QWEN_PROCESSORS and model in _QWEN_MODELS:
        return VisionSpec(
            family=_QWEN_MODELS[model], name=name,
            patch_size=int(config.get("patch_size", 14)), merge_size=int(config.get("merge_size", 2)),
            temporal_patch_size=int(config.get("temporal_patch_size", 2)),
            min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
        )
    if kind in _CLIP_PROCESSORS and model in _LLAVA_MODELS:
        crop = config.get("crop_size", {})
        side = int(crop.get("height", 0) if isinstance(crop, dict) else crop or 0) or int(size.get("shortest_edge", 0))
        strategy = config.get("vision_feature_select_strategy", "default")
        extra = int(config.get("num_additional_image_tokens", 1)) - (1 if strategy == "default" else 0)
        return VisionSpec(family=VisionFamily.LLAVA, name=name, patch_size=int(config.get("patch_size", 14)),
                          merge_size=1, temporal_patch_size=1, image_size=side, extra_tokens=extra,
                          image_token=str(config.get("image_token", "<image>")), vision_start=None, vision_end=None)
    raise PackstreamError(
        f"--processor {name}: image processor {kind or '(unnamed)'} of {model or '(no processor_class)'} is not one "
        f"packstream counts tokens for exactly; supported: Qwen2-VL, Qwen2.5-VL, LLaVA-1.5 (CLIP). Shipped: "
        f"{sorted(_BUILTIN)}")


_BUILTIN: dict[str, VisionSpec] = {
    # Qwen/Qwen2-VL-*-Instruct preprocessor_config.json: 14-pixel patches merged 2 x 2, 3136..12845056 pixels.
    "qwen2-vl": VisionSpec(family=VisionFamily.QWEN2_VL, min_pixels=3136, max_pixels=12845056),
    # Qwen/Qwen2.5-VL-*-Instruct: the same image rules.
    "qwen2.5-vl": VisionSpec(family=VisionFamily.QWEN2_5_VL, min_pixels=3136, max_pixels=12845056),
    # llava-hf/llava-1.5-*-hf: CLIP ViT-L/14 at 336 x 336, the CLS feature dropped: 576 tokens.
    "llava-1.5": VisionSpec(family=VisionFamily.LLAVA, patch_size=14, merge_size=1, temporal_patch_size=1,
                            image_size=336, extra_tokens=0, image_token="<image>", vision_start=None, vision_end=None),
}
