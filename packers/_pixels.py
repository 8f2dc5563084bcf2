"""Decode a packed row's image references into the vision tower's input, at load time.

Packed rows keep images as references (Hugging Face ``datasets``' Image encoding: ``{"path", "bytes"}``) and
each image's patch grid, measured when the row was packed (:class:`packers._vision.VisionSpec`). A
:class:`PixelLoader` opens them, runs the family's image processor (transformers' PIL
``Qwen2VLImageProcessorPil`` with the spec's pixel limits, patch, merge and temporal sizes, and for Qwen3-VL its
mean and std of 0.5; for LLaVA its PIL ``LlavaImageProcessorPil``, CLIP's resize and centre crop to the spec's
``image_size``; for InternVL its PIL ``GotOcr2ImageProcessorPil`` cropping to the spec's tiles, as
``InternVLProcessor`` runs it; for Gemma 3 its PIL ``Gemma3ImageProcessorPil`` at the spec's square; or a processor
of the caller's) and checks that each image still comes out at the grid
its row was packed for: a file replaced since
packing, or a processor set differently from the spec, would otherwise shift every placeholder token after it
onto the wrong features.

Every image is decoded by :func:`packers.images.decode_rgb` (the upright image, any transparency composited onto
white, as transformers' image processors make it RGB) and sized by :func:`packers.images.upright_size`, here and
when packing (:mod:`pipeline._media`), so the grid a row was packed for is the one the processor gives the decoded
image.

PIL and transformers are imported on first use (``import packers`` needs neither).
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from packers._tiles import IMAGENET_MEAN, IMAGENET_STD
from packers._vision import VisionFamily, VisionSpec
from packers.files import open_checked, real_folder, within
from packers.images import decode_rgb, upright_size
from packers.errors import ContractError, PackstreamError


@dataclass(frozen=True, kw_only=True)
class PixelLoader:
    """Turn image references into ``pixel_values`` (and each image's patch grid) for a vision tower.

    ``PixelLoader(vision=VisionSpec.builtin("qwen2-vl"))(images, grids)`` returns
    ``(pixel_values [patches, C * temporal * patch * patch] float32, image_grid_thw [n, 3] int64)``,
    as the model's processor would for the same images. With a LLaVA spec
    (``VisionSpec.builtin("llava-1.5")``) ``pixel_values`` is ``[n, C, image_size, image_size]`` (what
    ``LlavaForConditionalGeneration`` takes) and the grids are read from its shape: ``(1, image_size / patch,
    image_size / patch)`` each, as :meth:`VisionSpec.image_grid` gives them. With an InternVL spec
    (``VisionSpec.builtin("internvl3")``) ``pixel_values`` is ``[tiles, C, image_size, image_size]``, each image's
    tiles then its thumbnail, image after image (what ``InternVLForConditionalGeneration`` takes), and the grids are
    ``(tiles, rows, cols)``: the tiles the processor gave each image, the canvas its size gives.

    An image is read from its ``bytes`` when the row holds them (``--images embed``, or a source that held
    bytes), else from its ``path``: an absolute one (``--images reference``) through ``remap`` when the images
    moved since packing (``remap={"/data/imgs": "/mnt/imgs"}``: prefix -> new prefix, longest prefix wins), a
    relative one against ``root``.
    """

    vision: VisionSpec
    """The spec the rows were packed with: its pixel limits, patch, merge and temporal sizes (LLaVA: its
    ``image_size``) drive the processor."""
    processor: Any = None
    """An image processor of your own (e.g. ``AutoImageProcessor.from_pretrained(model)``), called as
    ``processor(images=[PIL images], return_tensors="pt")``; None: one built from ``vision``."""
    root: str | Path | None = None
    """Folder that relative image paths are resolved against (None: the working directory)."""
    remap: Mapping[str, str] | None = None
    """Prefix -> new prefix, applied to absolute paths (the rows of ``--images reference`` hold absolute paths):
    ``remap={"/data/imgs": "/mnt/imgs"}`` reads ``/data/imgs/a/cat.jpg`` as ``/mnt/imgs/a/cat.jpg``, so a folder
    packed where the images sat under ``/data/imgs`` trains where they are mounted at ``/mnt/imgs``. Prefixes match
    whole path components (``/data/imgs`` does not match ``/data/imgs2``); the longest matching prefix wins; a
    path that none matches is read as stored."""

    def __post_init__(self) -> None:
        for old, new in (self.remap or {}).items():
            if not (isinstance(old, str) and isinstance(new, str) and old.startswith("/") and new):
                raise PackstreamError(f"PixelLoader(remap=...): {old!r} -> {new!r}; each entry maps an absolute path "
                                      "prefix to a new prefix, e.g. remap={'/data/imgs': '/mnt/imgs'}")

    def resolve(self, path: str) -> Path:
        """Where ``path`` (a row's image path) is read: ``remap`` applied to an absolute path, ``root`` joined to a
        relative one, which must stay under it (links resolved; else :class:`packers.files.OutsideRoot`)."""
        p = Path(path)
        if not p.is_absolute():
            if self.root is None:
                return p
            root = real_folder(str(self.root))  # a relative path stays under root= (no ../ nor link out of it)
            return Path(within(root, os.path.join(root, os.path.normpath(path)), what=f"image {path!r} under root="))
        text = os.path.normpath(p.as_posix())  # /data/imgs/../x is /x: a prefix matches what the path names
        for old in sorted(self.remap or {}, key=lambda o: len(o.rstrip("/")), reverse=True):  # longest prefix wins
            stem = old.rstrip("/") or "/"
            if text == stem or text.startswith(stem.rstrip("/") + "/"):
                return Path(self.remap[old]) / text[len(stem):].lstrip("/")
        return p

    @cached_property
    def image_processor(self) -> Any:
        """The processor in use: ``processor``, or transformers' PIL Qwen2-VL (LLaVA) processor set from ``vision``.
        Either is given the images :func:`packers.images.decode_rgb` makes (RGB already: its own RGB conversion
        leaves them as they are)."""
        if self.processor is not None:
            return self.processor
        v = self.vision
        if v.family is VisionFamily.INTERNVL:
            from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

            # OpenGVLab/InternVL3-*-hf: 448-pixel tiles, ImageNet's mean and std (packers._tiles.FIXED).
            return GotOcr2ImageProcessorPil(size={"height": v.image_size, "width": v.image_size},
                                            crop_to_patches=True, min_patches=v.min_tiles, max_patches=v.max_tiles,
                                            image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD))
        if v.family is VisionFamily.GEMMA3:
            from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

            # google/gemma-3-*-it: one square, bilinear, mean/std 0.5 (the class defaults; packers._gemma.FIXED).
            return Gemma3ImageProcessorPil(size={"height": v.image_size, "width": v.image_size}, do_pan_and_scan=False)
        if not v.family.mrope:
            from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

            # llava-hf/llava-1.5-*-hf: CLIP's resize of the shortest edge, then a centre crop, to one square.
            return LlavaImageProcessorPil(size={"shortest_edge": v.image_size},
                                          crop_size={"height": v.image_size, "width": v.image_size})
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        # Qwen3-VL normalizes with mean and std 0.5 (its preprocessor_config.json), Qwen2-VL with CLIP's (the
        # class's default); a processor normalizing otherwise is passed as ``processor=``.
        norm = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if v.family is VisionFamily.QWEN3_VL else {}
        return Qwen2VLImageProcessorPil(size={"shortest_edge": v.min_pixels, "longest_edge": v.max_pixels},
                                        patch_size=v.patch_size, merge_size=v.merge_size,
                                        temporal_patch_size=v.temporal_patch_size, **norm)

    @contextlib.contextmanager
    def _pil(self, image: Mapping[str, Any] | None, where: str) -> Iterator[Any]:
        """One reference opened by PIL (its header read, no pixel decoded yet); PackstreamError naming the path (or
        the bytes) when it cannot be read, by PIL here or by what the caller does with it."""
        from PIL import Image

        data, path = (image.get("bytes"), image.get("path")) if isinstance(image, Mapping) else (None, None)
        if data is None and not path:
            raise PackstreamError(f"{where}: neither bytes nor a path; the row's images must carry one of them")
        if data is not None:
            source, name = io.BytesIO(data), f"{len(data)} bytes" + (f" (from {path})" if path else "")
        else:
            resolved = self.resolve(path)
            name = str(resolved) if str(resolved) == path else f"{resolved} (stored as {path})"
            try:  # the one checked open: a FIFO or a device where an image was is refused, never waited on
                source = open_checked(str(resolved), what=f"{where}: image") if os.path.lexists(resolved) else resolved
            except PackstreamError as e:
                raise PackstreamError(f"{e} (stored as {path})") from None
        try:
            with Image.open(source) as im:
                yield im
        except Exception as e:  # noqa: BLE001 - PIL raises many types on a bad file; each is one line naming it
            hint = ("" if data is not None else
                    "; the folder's images must be readable where you train: map a moved folder with "
                    "PixelLoader(remap={old_prefix: new_prefix}) (absolute paths) or root= (relative ones), or "
                    "pack with --images embed")
            raise PackstreamError(f"{where}: cannot read {name}: {e}{hint}") from None
        finally:
            if hasattr(source, "read"):
                source.close()

    def open(self, image: Mapping[str, Any], where: str = "image") -> Any:
        """One reference as an RGB PIL image (:func:`packers.images.decode_rgb`: upright, transparency on white);
        PackstreamError naming the path (or the bytes) when unreadable."""
        with self._pil(image, where) as im:
            return decode_rgb(im)

    def grid_of(self, image: Mapping[str, Any], where: str = "image") -> tuple[int, int, int]:
        """The patch grid ``vision`` gives one reference, from its upright size (:func:`packers.images.upright_size`:
        the file's header and its EXIF orientation, no pixel decoded where the header settles it: as the packer
        measured it). PackstreamError when unreadable, or of a size the processor refuses."""
        with self._pil(image, where) as im:
            width, height = upright_size(im)
        try:
            return self.vision.image_grid(width, height)
        except PackstreamError as e:  # ImageSizeError: no area, or too thin
            raise PackstreamError(f"{where}: {e}") from None

    def check_grids(self, images: Sequence[Mapping[str, Any]], grids: Sequence[Sequence[int]] | np.ndarray,
                    names: Sequence[str] | None = None) -> None:
        """ContractError naming the first image whose size (read from its header, no pixel decoded) gives another
        grid than the one it was packed for (``grids``, one ``(t, h, w)`` per image): what a Collator that does not
        decode checks, so that a grid edited since packing (its height and width swapped: the same token count)
        never gives the image's tokens wrong mRoPE positions."""
        names = list(names) if names is not None else [f"image {i}" for i in range(len(images))]
        got = np.array([self.grid_of(im, names[i]) for i, im in enumerate(images)], dtype=np.int64).reshape(-1, 3)
        _compare_grids(images, got, grids, names, "its size gives patch grid")

    def __call__(self, images: Sequence[Mapping[str, Any]], grids: Sequence[Sequence[int]] | np.ndarray | None = None,
                 names: Sequence[str] | None = None) -> tuple[Any, Any]:
        """``(pixel_values, image_grid_thw)`` of ``images``; with ``grids`` (one ``(t, h, w)`` per image, as packed),
        ContractError if an image comes out at another grid. ``names``: how messages name each image."""
        import torch

        names = list(names) if names is not None else [f"image {i}" for i in range(len(images))]
        pil = [self.open(im, names[i]) for i, im in enumerate(images)]
        if self.vision.family is VisionFamily.INTERNVL:  # as InternVLProcessor calls its image processor
            out = self.image_processor(images=pil, return_tensors="pt", crop_to_patches=True)
            pixels = torch.as_tensor(out["pixel_values"])
            if "num_patches" not in out:
                raise ContractError(f"the image processor {type(self.image_processor).__name__} gave no num_patches "
                                    "(each image's tile count) for InternVL images; pass a GotOcr2 image processor "
                                    "(InternVL's), or none: PixelLoader builds one from the spec")
            got = self._tile_grids(pixels, out["num_patches"], pil, names)
        else:
            out = self.image_processor(images=pil, return_tensors="pt")
            pixels = torch.as_tensor(out["pixel_values"])
            got = (torch.as_tensor(out["image_grid_thw"], dtype=torch.int64).reshape(-1, 3)
                   if self.vision.family.mrope else self._square_grids(pixels, images, names))
        if grids is not None:
            _compare_grids(images, got.numpy(), grids, names, "decodes to patch grid")
        return pixels, got

    def _square_grids(self, pixels: Any, images: Sequence[Mapping[str, Any]], names: Sequence[str]) -> Any:
        """LLaVA: each image's grid ``(1, H / patch, W / patch)`` from ``pixels`` (``[n, C, H, W]``), checked to be
        the spec's ``image_size`` square (a processor set to another size would give other token counts)."""
        import torch

        side, patch = self.vision.image_size, self.vision.patch_size
        if pixels.dim() != 4 or pixels.shape[0] != len(images):
            raise ContractError(f"the image processor gave pixel_values of shape {list(pixels.shape)} for "
                                f"{len(images)} images; a LLaVA processor gives [images, channels, {side}, {side}]")
        h, w = int(pixels.shape[2]), int(pixels.shape[3])
        if (h, w) != (side, side):
            spec = self.vision.name or self.vision.family.value
            raise ContractError(f"{names[0]} (and every image beside it) decodes to {w}x{h} pixels, the spec {spec} "
                                f"has image_size {side} (a {side}x{side} square): the processor's size/crop_size "
                                "differ from the spec the rows were packed with; load with that spec, or a processor "
                                "set to it")
        return torch.tensor([[1, h // patch, w // patch]] * len(images), dtype=torch.int64).reshape(-1, 3)

    def _tile_grids(self, pixels: Any, num_patches: Any, pil: Sequence[Any], names: Sequence[str]) -> Any:
        """InternVL: each image's ``(tiles, rows, cols)``, its tiles the processor's ``num_patches`` and its canvas
        the spec's for the image's size; ContractError unless ``pixels`` is ``[sum(tiles), C, image_size,
        image_size]`` (a processor set to another tile size, or not cropping, would give other token counts)."""
        import torch

        side = self.vision.image_size
        tiles = [int(n) for n in torch.as_tensor(num_patches).reshape(-1).tolist()]
        if len(tiles) != len(pil) or pixels.dim() != 4 or pixels.shape[0] != sum(tiles) or tuple(
                pixels.shape[2:]) != (side, side):
            spec = self.vision.name or self.vision.family.value
            raise ContractError(f"{names[0]} (and the images beside it): the image processor gave pixel_values of "
                                f"shape {list(pixels.shape)} and num_patches {tiles[:8]}, the spec {spec} gives "
                                f"[tiles, channels, {side}, {side}] and one num_patches per image: its size differs "
                                "from the spec the rows were packed with; load with that spec, or a processor set to "
                                "it")
        grids = [(n, *self.vision.image_grid(*im.size)[1:]) for n, im in zip(tiles, pil)]
        return torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)


def _compare_grids(images: Sequence[Mapping[str, Any]], got: np.ndarray, grids: Any, names: Sequence[str],
                   how: str) -> None:
    """ContractError naming the first image whose grid ``got`` (as ``how`` says it was found) is not the packed one."""
    want = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    if want.shape[0] != got.shape[0]:
        raise ContractError(f"{len(images)} images, {want.shape[0]} packed grids; one grid per image")
    for i in np.flatnonzero((got != want).any(axis=1)):
        im = images[i] if isinstance(images[i], Mapping) else {}
        ref = im.get("path") or f"{len(im.get('bytes') or b'')} bytes"
        raise ContractError(
            f"{names[i]} ({ref}): {how} {tuple(got[i].tolist())}, the row was packed for {tuple(want[i].tolist())}: "
            "the image or the row's image_grid_thw changed since packing, or the processor settings differ from the "
            "spec the rows were packed with; repack, or load with that spec")
