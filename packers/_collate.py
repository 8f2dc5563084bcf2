"""Turn packed rows into one flattened training batch (the FlashAttention-2 "padding-free" layout).

Two rows of budget 8 (``T`` = target token, ``.`` = not), collated with the defaults::

    row 0  input_ids [ 5  9 41 17 | 5 30 ]           seq_offsets [0, 4, 6]    example_ids ["a", "b"]
           loss_mask [ .  .  T  T | .  T ]
    row 1  input_ids [ 5  8  6  1  2 ]               seq_offsets [0, 5]       example_ids ["c"]
           loss_mask [ .  .  T  T  T ]

    input_ids     [[ 5  9 41 17  5 30  5  8  6  1  2]]      [1, T], rows back to back
    position_ids  [[ 0  1  2  3  0  1  0  1  2  3  4]]      reset at every example
    labels        [[-100 -100 41 17 -100 30 -100 -100 6 1 2]]
                     ^ first token of each example: never a target (nothing before it to predict from)
    cu_seq_lens_q [0, 4, 6, 11]   (int32, also cu_seq_lens_k)   max_length_q = max_length_k = 5
    seq_idx       [[0 0 0 0 1 1 2 2 2 2 2]]                 (int32) sequence index, for Mamba-style layers
    example_index [0, 1, 2]                                 (int64) the sequence of each of the rows' examples
    example_ids   ["a", "b", "c"]                           the rows' example_ids (rows without: no key)
    desirable     [1, 0, -1]                                (int8) KTO labels, when a row carries them (else no key)
    use_cache     False                                     see "why use_cache" below

With ``fixed_shape=True, budget=8`` every row is padded to the budget, so ``T = rows x budget``
at every step. The padding of a row is one more sequence of its own: its tokens are
``pad_token_id``, its labels -100, its positions restart at 0, and it gets its own entry in
``cu_seq_lens``. Real tokens never attend to it (it comes later and is another sequence), and
it never reaches the loss::

    row 0  input_ids [ 5  9 41 17  5 30  0  0 ]   position_ids [0 1 2 3 0 1 0 1]
                                         ^^^^ pad  cu_seq_lens [0, 4, 6, 8, ...]
                                                   example_index [0, 1, 3]: sequence 2 is padding

``max_length_*`` is then the budget (a valid upper bound for the kernels; a constant keeps
``torch.compile`` from specialising on it). ``example_index`` and ``example_ids`` are what
per-example outputs index: :func:`packers.example_losses` and :func:`packers.sequence_logps` return
one value per example, in the rows' order, with its id, and none for a padding sequence.

Why ``use_cache=False`` is in the batch: transformers' sdpa/eager attention builds the
block-diagonal packed mask from ``position_ids`` only when there is no KV cache, and a model
whose config says ``use_cache=True`` (Llama, Qwen, Mistral by default) creates one in a plain
``model(**batch)`` call, even in ``train()`` mode. The packed examples then attend to each
other (max logit error about 0.2-0.8). Passing ``use_cache=False`` in the batch makes a plain
``model(**batch)`` safe; :func:`packers.check_packing_safe` checks the rest.

>>> import numpy as np
>>> rows = [{"input_ids": [5, 9, 41, 17, 5, 30], "loss_mask": [0, 0, 1, 1, 0, 1], "seq_offsets": [0, 4, 6],
...          "example_ids": ["a", "b"]},
...         {"input_ids": [5, 8, 6, 1, 2], "loss_mask": [0, 0, 1, 1, 1], "seq_offsets": [0, 5], "example_ids": ["c"]}]
>>> b = Collator()(rows)
>>> b["labels"].tolist()
[[-100, -100, 41, 17, -100, 30, -100, -100, 6, 1, 2]]
>>> b["position_ids"].tolist(), b["cu_seq_lens_q"].tolist(), b["max_length_q"]
([[0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 4]], [0, 4, 6, 11], 5)
>>> f = Collator(fixed_shape=True, budget=8)(rows)
>>> f["input_ids"].shape, f["cu_seq_lens_q"].tolist(), f["max_length_q"]
(torch.Size([1, 16]), [0, 4, 6, 8, 13, 16], 8)
>>> f["example_index"].tolist(), f["example_ids"]        # sequence 2 is row 0's padding
([0, 1, 3], ['a', 'b', 'c'])

Rows of preference pairs (``packstream pack --pairs``, see :mod:`packers.schema`) also give what a
DPO-style loss needs: which tokens are completions, and which sequences make a pair. One row, two
pairs (``p`` prompt, ``c`` completion)::

    input_ids        [ 5  9 41 17 | 5  9 30 | 5 62  1 | 5 18 ]
                       p  p  c  c   p  p  c   p  c  c   p  c
    sides            chosen        rejected   chosen    rejected
    completion_mask  [[F  F  T  T   F  F  T   F  T  T   F  T]]    [1, T] bool
    pair_index       [[0, 1], [2, 3]]                              [P, 2] int64: (chosen, rejected) sequences
    cu_seq_lens_q    [0, 4, 7, 10, 12]

:func:`packers.sequence_logps` turns a model's logits on such a batch into each sequence's
completion log-probability, as (chosen, rejected) pairs.

>>> pair_row = {"input_ids": [5, 9, 41, 17, 5, 9, 30, 5, 62, 1, 5, 18], "loss_mask": [0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1],
...             "seq_offsets": [0, 4, 7, 10, 12], "sides": [0, 1, 0, 1], "completion_spans": [2, 4, 6, 7, 8, 10, 11, 12]}
>>> p = Collator()([pair_row])
>>> p["pair_index"].tolist(), p["completion_mask"].int().tolist()
([[0, 1], [2, 3]], [[0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1]])

Vision-language rows (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) also carry ``image_offsets`` (where each image's run of placeholder
tokens starts in the row), ``image_grid_thw`` (3 per image: its patch grid) and ``images`` (``{"path",
"bytes"}`` references). ``Collator(vision=spec)`` then gives ``position_ids`` of ``[4, 1, T]``: row 0 the
positions above, which transformers' Qwen2-VL text model reads to find the packed sequences (without that
row it builds one causal mask over the whole batch and the examples attend to each other; Qwen3-VL's text model
reads it the same way in transformers 5.x), rows 1..3 each
example's 3-D rotary positions (:func:`packers.mrope_positions`), as the model computes them for it alone.
One row, two examples, the first with an image of grid (1, 4, 4) (4 tokens ``I`` after merging 2 x 2)::

    input_ids      [ 5  I  I  I  I  6 | 5  7 ]     image_offsets [1]   image_grid_thw [1, 4, 4]
    position_ids   [[0  1  2  3  4  5   0  1]      text positions: the packed sequences
                    [0  1  1  1  1  3   0  1]      temporal  } each example's mRoPE positions:
                    [0  1  1  2  2  3   0  1]      height    } after the image, 1 + max(4, 4) // 2 = 3
                    [0  1  2  1  2  3   0  1]]     width     }

The image here is a 56 x 56 PNG embedded in the row (Qwen2-VL: grid (1, 4, 4)); without ``decode_images`` the Collator
still reads its size from the PNG's header and checks the row's grid against it.

>>> import io
>>> from PIL import Image
>>> from packers._vision import VisionSpec
>>> png = io.BytesIO(); Image.new("RGB", (56, 56)).save(png, "PNG")
>>> vl_row = {"input_ids": [5, 90, 90, 90, 90, 6, 5, 7], "loss_mask": [0, 0, 0, 0, 0, 1, 0, 1],
...           "seq_offsets": [0, 6, 8], "image_offsets": [1], "image_grid_thw": [1, 4, 4],
...           "images": [{"path": None, "bytes": png.getvalue()}]}
>>> v = Collator(vision=VisionSpec.builtin("qwen2-vl"), decode_images=False)([vl_row])
>>> v["position_ids"][:, 0].tolist()
[[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 1, 1, 1, 3, 0, 1], [0, 1, 1, 2, 2, 3, 0, 1], [0, 1, 2, 1, 2, 3, 0, 1]]
>>> v["image_grid_thw"].tolist()
[[1, 4, 4]]

LLaVA-1.5 rows (``Collator(vision=VisionSpec.builtin("llava-1.5"))``, or any spec of the LLaVA family) keep the
text batch's ``[1, T]`` position_ids: LLaVA's language model rotates by 1-D positions and builds the packed mask
from them like any text model. Every image is one fixed run of ``spec.grid_tokens(grid)`` ``<image>`` tokens (576
for 336-pixel images in 14-pixel patches, the CLS feature dropped), its grid always ``(1, 24, 24)``. The batch
adds ``pixel_values`` ``[images, 3, 336, 336]`` in the rows' order, which the model scatters over the ``<image>``
tokens in the same order, and no ``image_grid_thw`` (``LlavaForConditionalGeneration`` takes none). A tiny spec:
28-pixel images in 14-pixel patches, 4 tokens each::

    input_ids      [ 5  I  I  I  I  6 | 5  7 ]     image_offsets [1]   image_grid_thw [1, 2, 2]
    position_ids   [[0  1  2  3  4  5   0  1]]     as for text: reset at each example

>>> from packers._vision import VisionFamily
>>> llava = VisionSpec(family=VisionFamily.LLAVA, image_size=28, patch_size=14, merge_size=1, temporal_patch_size=1)
>>> l = Collator(vision=llava, decode_images=False)([{**vl_row, "image_grid_thw": [1, 2, 2]}])
>>> l["position_ids"].tolist(), "image_grid_thw" in l
([[0, 1, 2, 3, 4, 5, 0, 1]], False)

InternVL rows (``VisionSpec.builtin("internvl3")``) collate as LLaVA's do: ``[1, T]`` position_ids, and
``pixel_values`` ``[tiles, 3, S, S]``, each image's tiles then its thumbnail, in the rows' order; their
``image_grid_thw`` is ``(tiles, rows, cols)`` (:mod:`packers._tiles`), ``tiles x image_seq_length`` tokens.

Gemma 3 rows (``VisionSpec.builtin("gemma3")``) collate as LLaVA's do, and every batch adds ``token_type_ids``
``[1, T]``: 1 on each image's soft tokens (its bidirectional block in training, :mod:`packers._gemma`); train them
under :func:`packers.install_packing_guard` (:mod:`packers._attention._blocks` says why).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, TypedDict

import numpy as np
import torch

from packers._mrope import mrope_positions
from packers._pixels import PixelLoader
from packers._video import VideoLoader, group_runs
from packers._gemma import token_type_ids
from packers._vision import VisionFamily, VisionSpec
from packers.errors import ContractError, PackstreamError
from packers.rowcheck import Failure, check_images, check_videos

IGNORE_INDEX = -100
"""The label of a token that is not a training target (the ``ignore_index`` of the HF losses)."""


class PackedBatch(TypedDict, total=False):
    """What :class:`Collator` returns: keyword arguments for a transformers causal LM.

    ``T`` is the number of tokens in the batch (the rows' lengths summed, or rows x budget
    with ``fixed_shape``); ``N`` the number of sequences (examples, plus one per padded row).
    """

    input_ids: torch.Tensor
    """``[1, T]`` int64: the rows back to back."""
    labels: torch.Tensor
    """``[1, T]`` int64: the token where ``loss_mask`` is 1, else -100; -100 on every example's first token."""
    position_ids: torch.Tensor
    """``[1, T]`` int64: 0, 1, 2, ... restarting at every example (and at every row's padding). With
    ``Collator(vision=...)`` of a Qwen2-VL-style spec: ``[4, 1, T]``, row 0 those positions, rows 1..3 each
    example's mRoPE positions (temporal, height, width; :func:`packers.mrope_positions`); of a LLaVA spec:
    ``[1, T]``, as for text."""
    cu_seq_lens_q: torch.Tensor
    """``[N + 1]`` int32: sequence boundaries ``[0, end_1, ..., T]``. Only with ``return_flash_attn_kwargs``."""
    cu_seq_lens_k: torch.Tensor
    """Same tensor as ``cu_seq_lens_q`` (self-attention)."""
    max_length_q: int
    """Longest sequence in the batch (the budget with ``fixed_shape``)."""
    max_length_k: int
    """Same as ``max_length_q``."""
    seq_idx: torch.Tensor
    """``[1, T]`` int32: index of each token's sequence. Only with ``return_seq_idx``."""
    example_index: torch.Tensor
    """``[E]`` int64: the sequence (as in ``cu_seq_lens``) of each of the rows' examples, in the rows' order; a
    padded row's padding is no example. Only with ``return_example_index``; what :func:`packers.example_losses`
    and :func:`packers.sequence_logps` read."""
    example_ids: list[Any]
    """The rows' ``example_ids``, flattened (one per ``example_index`` entry). Only with ``return_example_index``
    and rows that carry them (rows from :class:`packers.PackedDataset` or packstream shards)."""
    desirable: torch.Tensor
    """``[E]`` int8, one per ``example_index`` entry: 1 desirable, 0 undesirable, -1 no label (KTO data). Only with
    ``return_example_index`` and a batch where some row carries the ``desirable`` column."""
    use_cache: bool
    """Always ``False`` (unless ``disable_cache=False``): see the module docstring."""
    completion_mask: torch.Tensor
    """``[1, T]`` bool: the completion tokens of each sequence (rows of preference pairs only)."""
    pair_index: torch.Tensor
    """``[P, 2]`` int64: the sequence indices (as in ``cu_seq_lens``) of each pair's chosen and rejected
    sides (rows of preference pairs only)."""
    image_grid_thw: torch.Tensor
    """``[I, 3]`` int64: each image's patch grid (t, h, w), in the batch's token order. Only with
    ``Collator(vision=...)`` of a Qwen2-VL-style spec and a batch holding images (LLaVA's model takes none)."""
    pixel_values: torch.Tensor
    """The images decoded by ``Collator.pixels`` (``[patches, C * temporal * patch * patch]`` for Qwen2-VL, in
    the order of ``image_grid_thw``; ``[I, C, image_size, image_size]`` for LLaVA), in the batch's token order.
    Only with ``Collator(vision=...)``, ``decode_images`` and images."""
    loss_weights: torch.Tensor
    """``[1, T]`` float32, aligned with ``labels``: what each target counts in its optimizer step's loss (0 off
    target and in padding). Only for rows from :class:`packers.PackedDataset`, which schedules it; read by
    :func:`packers.loss`."""


@dataclass(frozen=True, kw_only=True)
class Collator:
    """Collate packed rows (dicts with ``input_ids``, ``loss_mask``, ``seq_offsets``) into a :class:`PackedBatch`.

    Rows may hold Python lists (what ``datasets`` yields), numpy arrays (what
    :class:`packers.PackedDataset` yields) or CPU tensors. Rows whose ``sides`` and
    ``completion_spans`` are not empty (pairs) add ``completion_mask`` and ``pair_index``; a batch
    holds rows of pairs or rows without, not both. Rows from ``PackedDataset`` also carry
    ``loss_weights``, which become the batch's ``loss_weights`` (for :func:`packers.loss`), and
    ``example_ids``, which become the batch's ``example_ids``. Rows of a vision-language model carry
    ``image_offsets``, ``image_grid_thw`` and ``images``, and need ``vision`` (see the module docstring).
    Other keys (``num_tokens``, ``num_targets``, ``pair_ids``, ``loss_denominator``) are ignored.
    """

    fixed_shape: bool = False
    """Pad every row to ``budget`` so that ``T = rows x budget`` (for ``torch.compile`` and constant memory)."""
    budget: int | None = None
    """Token budget of a row; required with ``fixed_shape``, and rows longer than it are rejected when given."""
    pad_token_id: int = 0
    """Token id of the padding; it takes no part in loss or attention, any valid id will do."""
    return_flash_attn_kwargs: bool = True
    """Return ``cu_seq_lens_q/k`` and ``max_length_q/k`` (used by FA2 and the varlen backend; sdpa/eager ignore them)."""
    return_seq_idx: bool = True
    """Return ``seq_idx`` (for models with Mamba-style convolution layers)."""
    return_example_index: bool = True
    """Return ``example_index`` and the rows' ``example_ids`` (models ignore them; :func:`packers.example_losses`
    and :func:`packers.sequence_logps` need them). Turn it off only for a model whose ``forward`` refuses
    keyword arguments it does not know."""
    disable_cache: bool = True
    """Put ``use_cache=False`` in the batch, so that sdpa/eager build the packed mask. Leave it on."""
    validate: bool = True
    """Check each row's offsets and lengths (vectorised, cheap) and raise ContractError if broken."""
    vision: VisionSpec | None = None
    """The vision processor the rows were packed with (e.g. ``VisionSpec.builtin("qwen2-vl")`` or
    ``VisionSpec.builtin("llava-1.5")``). For a model with 3-D rotary positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) every
    batch, text-only too, gets ``position_ids`` of ``[4, 1, T]`` (see "vision-language rows" above), and a batch
    holding images gets ``image_grid_thw`` and ``pixel_values``; for LLaVA the positions stay ``[1, T]`` and a
    batch holding images gets ``pixel_values``. Rows that hold images need it."""
    pixels: PixelLoader | None = None
    """The :class:`packers.PixelLoader` that decodes the rows' images; None: ``PixelLoader(vision=vision)``."""
    decode_images: bool = True
    """Decode the rows' images into ``pixel_values``; False leaves that to you (the batch then has no pixels, only
    ``image_grid_thw`` for Qwen2-VL, and a model fed it would read the placeholder tokens as text). Either way each
    image is opened and its grid checked against the packed one (without decoding, from its size in the file's
    header: :meth:`PixelLoader.check_grids`), so a grid edited since packing never gives wrong positions."""

    def __post_init__(self) -> None:
        if self.pixels is not None and self.vision is None:
            raise PackstreamError("Collator(pixels=...) needs vision=... too: the spec the rows were packed with")
        if self.vision is not None and self.pixels is None:  # decoding or not, it reads each image's grid
            object.__setattr__(self, "pixels", PixelLoader(vision=self.vision))
        if self.budget is not None and self.budget < 1:
            raise PackstreamError(f"budget={self.budget} must be >= 1")
        if self.fixed_shape and self.budget is None:
            raise PackstreamError(
                "Collator(fixed_shape=True) needs the row budget: pass budget=..., e.g. PackedDataset(...).budget"
            )

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> PackedBatch:
        if len(rows) == 0:
            raise PackstreamError("Collator got an empty list of rows")
        parts = _Parts(weighted="loss_weights" in rows[0], pairs=_has_pairs(rows[0]),
                       named=rows[0].get("example_ids") is not None)
        for i, row in enumerate(rows):
            self._add(parts, i, row)
        input_ids = np.concatenate(parts.ids)
        if input_ids.shape[0] == 0:
            raise PackstreamError(f"Collator got {len(rows)} rows with no tokens at all")
        target = np.concatenate(parts.mask)
        seq_lens = np.concatenate(parts.lens)
        ends = np.cumsum(seq_lens)
        starts = ends - seq_lens
        position_ids = np.arange(input_ids.shape[0], dtype=np.int64) - np.repeat(starts, seq_lens)
        labels = np.where(target, input_ids, IGNORE_INDEX)
        # The loss shifts labels left by one, so the last token of an example predicts label[start of the
        # next one]: -100 there keeps examples from predicting each other (as DataCollatorWithFlattening).
        labels[starts] = IGNORE_INDEX

        batch: dict[str, Any] = {
            "input_ids": torch.from_numpy(input_ids)[None],
            "labels": torch.from_numpy(labels)[None],
            "position_ids": torch.from_numpy(position_ids)[None],
        }
        if self.vision is not None:
            batch.update(self._vision_tensors(parts, position_ids, starts, ends))
        if self.return_flash_attn_kwargs:
            cu = torch.from_numpy(np.concatenate([[0], ends]).astype(np.int32))
            max_len = self.budget if self.fixed_shape else int(seq_lens.max())
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
        if self.return_seq_idx:
            seq_idx = np.repeat(np.arange(seq_lens.shape[0], dtype=np.int32), seq_lens)
            batch["seq_idx"] = torch.from_numpy(seq_idx)[None]
        if self.return_example_index:
            batch["example_index"] = torch.from_numpy(np.concatenate(parts.examples))
            if parts.named:
                batch["example_ids"] = parts.example_ids
            if parts.labelled:
                batch["desirable"] = torch.from_numpy(np.concatenate(parts.desirable))
        if self.disable_cache:
            batch["use_cache"] = False
        if parts.pairs:
            batch.update(_pair_tensors(parts, input_ids.shape[0]))
        if parts.weighted:
            weights = np.concatenate(parts.weights)
            weights[labels == IGNORE_INDEX] = 0.0
            batch["loss_weights"] = torch.from_numpy(weights)[None]
        return batch  # type: ignore[return-value]

    def _vision_tensors(self, parts: _Parts, position_ids: np.ndarray, starts: np.ndarray,
                        ends: np.ndarray) -> dict[str, Any]:
        """Qwen2-VL: ``position_ids`` ``[4, 1, T]`` (the 1-D positions, then each example's mRoPE positions), and
        with images ``image_grid_thw`` and ``pixel_values``. LLaVA: with images ``pixel_values`` alone (the 1-D
        positions are the model's own)."""
        if not self.vision.family.mrope:
            out = {}
            if self.vision.family is VisionFamily.GEMMA3:  # every Gemma 3 batch: 1 on the soft tokens
                out["token_type_ids"] = _gemma_types(self.vision, parts, position_ids.shape[0])
            if not parts.image_offsets:
                return out
            return out | self._pixels(parts, np.concatenate(parts.image_grids))
        mrope = np.broadcast_to(position_ids, (3, position_ids.shape[0])).copy()  # text-only: 1-D, three times
        out: dict[str, Any] = {}
        offsets, grids = _cat(parts.image_offsets, np.int64), _cat(parts.image_grids, np.int64, 3)
        v_offsets, v_grids = _cat(parts.video_offsets, np.int64), _cat(parts.video_grids, np.int64, 3)
        v_seconds = _cat(parts.video_seconds, np.float32)
        if self.vision.family is VisionFamily.QWEN3_VL and len(v_offsets):  # one (1, h, w) run per frame group
            v_offsets, v_grids = _cat(parts.group_offsets, np.int64), _cat(parts.group_grids, np.int64, 3)
            v_seconds = np.zeros(len(v_offsets), np.float32)
        if len(offsets) or len(v_offsets):
            # Images and videos in token order; Qwen2.5-VL spaces a video's temporal index by tokens_per_second *
            # second_per_grid_ts (float32, as get_rope_index), Qwen2-VL by one per temporal patch.
            at = np.concatenate([offsets, v_offsets])
            order = np.argsort(at, kind="stable")
            at, all_grids = at[order], np.concatenate([grids, v_grids])[order]
            scaled = self.vision.family is VisionFamily.QWEN2_5_VL
            scale = np.concatenate([np.zeros(len(offsets), np.float32), np.float32(self.vision.tokens_per_second)
                                    * v_seconds if scaled else np.ones(len(v_offsets), np.float32)])[order]
            seq = np.searchsorted(ends, at, side="right")  # the sequence holding each image (checked in _add)
            for s in np.unique(seq).tolist():
                here = seq == s
                a, b = int(starts[s]), int(ends[s])
                mrope[:, a:b] = mrope_positions(b - a, at[here] - a, all_grids[here], self.vision.merge_size,
                                                scale[here])
        if len(offsets):
            out["image_grid_thw"] = torch.from_numpy(grids)
            out.update(self._pixels(parts, grids))
        if sum(len(o) for o in parts.video_offsets):
            v_grids, v_seconds = _cat(parts.video_grids, np.int64, 3), _cat(parts.video_seconds, np.float32)
            out["video_grid_thw"] = torch.from_numpy(v_grids)
            if self.vision.family is VisionFamily.QWEN2_5_VL:
                out["second_per_grid_ts"] = torch.from_numpy(v_seconds)
            videos = VideoLoader(self.pixels)
            if self.decode_images:
                out["pixel_values_videos"] = videos(parts.videos, v_grids, parts.video_names)[0]
            else:
                videos.check_grids(parts.videos, v_grids, parts.video_names)
        out["position_ids"] = torch.from_numpy(np.concatenate([position_ids[None], mrope]))[:, None, :]
        return out

    def _pixels(self, parts: _Parts, grids: np.ndarray) -> dict[str, Any]:
        """``pixel_values`` of the batch's images, each checked to come out at its packed grid; without
        ``decode_images`` only that check, from each image's header."""
        if not self.decode_images:
            self.pixels.check_grids(parts.images, grids, parts.image_names)
            return {}
        pixels, _ = self.pixels(parts.images, grids, parts.image_names)
        return {"pixel_values": pixels}

    def _add(self, parts: _Parts, i: int, row: Mapping[str, Any]) -> None:
        """Row ``i``'s tokens, mask, sequence lengths (and pair columns, weights), checked, then its padding."""
        ids = np.asarray(row["input_ids"], dtype=np.int64)
        mask = np.asarray(row["loss_mask"], dtype=bool)
        offs = np.asarray(row["seq_offsets"], dtype=np.int64)
        n = ids.shape[0]
        if self.validate:
            _check_row(i, n, mask, offs, self.budget)
        if _has_pairs(row) != parts.pairs:
            raise PackstreamError(
                f"row 0 {'holds' if parts.pairs else 'holds no'} preference pairs, row {i} "
                f"{'does not' if parts.pairs else 'does'}; collate rows of one packstream run (pairs or not)"
            )
        if parts.pairs:
            sides = np.asarray(row["sides"], dtype=np.int64)
            spans = np.asarray(row["completion_spans"], dtype=np.int64).reshape(-1, 2)
            if self.validate:
                _check_pairs(i, offs, sides, spans)
            parts.spans.append(spans + parts.at)
            parts.sides.append(sides)
        nseq = offs.shape[0] - 1
        if parts.named:
            parts.example_ids += _row_example_ids(i, row, nseq)
        elif row.get("example_ids") is not None:
            raise PackstreamError(f"row 0 carries no example_ids, row {i} does; collate rows of one source "
                                  "(all with their example_ids, or all without)")
        if _has_images(row):
            self._add_images(parts, i, row, ids, offs)
        if _has_videos(row):
            self._add_videos(parts, i, row, ids, offs)
        parts.examples.append(np.arange(parts.seqs, parts.seqs + nseq, dtype=np.int64))
        parts.desirable.append(_row_desirable(i, row, nseq))
        parts.labelled |= bool((parts.desirable[-1] != -1).any())
        parts.seqs += nseq
        parts.ids.append(ids)
        parts.mask.append(mask)
        parts.lens.append(np.diff(offs))
        parts.at += n
        if parts.weighted:
            parts.weights.append(_row_weights(i, row, n))
        if self.fixed_shape and n < self.budget:
            pad = self.budget - n
            parts.ids.append(np.full(pad, self.pad_token_id, dtype=np.int64))
            parts.mask.append(np.zeros(pad, dtype=bool))
            parts.lens.append(np.array([pad], dtype=np.int64))
            parts.sides.append(np.array([-1], dtype=np.int64))
            parts.seqs += 1  # a sequence, not an example: in cu_seq_lens, not in example_index
            parts.at += pad
            if parts.weighted:
                parts.weights.append(np.zeros(pad, dtype=np.float32))

    def _add_images(self, parts: _Parts, i: int, row: Mapping[str, Any], ids: np.ndarray, offs: np.ndarray) -> None:
        """Row ``i``'s images, checked by :func:`packers.rowcheck.check_images` (always: a wrong offset would give every
        later image token another image's features and positions)."""
        if self.vision is None:
            raise PackstreamError(
                f"row {i} holds images (image_offsets {np.asarray(row['image_offsets']).tolist()[:4]}) and the "
                "Collator has no vision spec: pass the spec the rows were packed with, Collator(vision="
                "VisionSpec.builtin('qwen2-vl')) (or 'qwen2.5-vl', 'qwen3-vl', 'llava-1.5', 'internvl3', 'gemma3') or "
                "VisionSpec.from_processor(model folder), so that the batch gets the pixel_values (and for Qwen2-VL the mRoPE position_ids and "
                "image_grid_thw) the model needs")
        starts = np.asarray(row["image_offsets"], dtype=np.int64).reshape(-1)
        grids = np.asarray(row.get("image_grid_thw", ()), dtype=np.int64).reshape(-1)
        refs = row.get("images")
        refs = list(refs) if refs is not None else []
        f = check_images(i, ids, None, offs, starts, grids, len(refs), self.vision)
        if f is not None:
            raise ContractError(f"row {i}{', ' if f.detail.startswith('image ') else ': '}{f.detail}")
        grids = grids.reshape(-1, 3)
        parts.image_names += _media_names(i, "image", starts, offs, row.get("example_ids"))
        parts.image_offsets.append(starts + parts.at)
        parts.image_grids.append(grids)
        parts.images += refs


    def _add_videos(self, parts: _Parts, i: int, row: Mapping[str, Any], ids: np.ndarray, offs: np.ndarray) -> None:
        """Row ``i``'s videos (contract version 8), checked as its images are (their own placeholder id)."""
        if self.vision is None or not self.vision.videos:
            raise PackstreamError(f"row {i} holds videos and the Collator's vision spec packs none: pass the spec the "
                                  "rows were packed with, Collator(vision=PackedDataset(folder).vision)")
        starts = np.asarray(row["video_offsets"], dtype=np.int64).reshape(-1)
        grids = np.asarray(row.get("video_grid_thw", ()), dtype=np.int64).reshape(-1)
        refs = list(row.get("videos") if row.get("videos") is not None else [])
        seconds = np.asarray(row.get("second_per_grid_ts", ()), dtype=np.float32).reshape(-1)
        f = check_videos(i, ids, None, offs, starts, grids, len(refs), self.vision)
        if f is None and seconds.shape != starts.shape:
            f = Failure(i, "videos", f"{seconds.shape[0]} second_per_grid_ts for {starts.shape[0]} videos; one each")
        if f is not None:
            raise ContractError(f"row {i}{', ' if f.detail.startswith('video ') else ': '}{f.detail}")
        parts.video_names += _media_names(i, "video", starts, offs, row.get("example_ids"))
        parts.video_offsets.append(starts + parts.at)
        parts.video_grids.append(grids.reshape(-1, 3))
        if self.vision.family is VisionFamily.QWEN3_VL:  # the frame groups check_videos found
            for at, (t, h, w) in zip(starts.tolist(), grids.reshape(-1, 3).tolist()):
                end = int(offs[np.searchsorted(offs, at, side="right")])
                runs = group_runs(ids, at, (t, h, w), self.vision.merge_size, end) or []
                parts.group_offsets.append(np.array([a for a, _ in runs], np.int64) + parts.at)
                parts.group_grids.append(np.tile(np.array([[1, h, w]], np.int64), (len(runs), 1)))
        parts.video_seconds.append(seconds)
        parts.videos += refs


def _has_videos(row: Mapping[str, Any]) -> bool:
    offsets = row.get("video_offsets")
    return offsets is not None and len(offsets) > 0


def _cat(arrays: list[np.ndarray], dtype: Any, width: int = 0) -> np.ndarray:
    """``arrays`` concatenated (empty of ``dtype``, ``(0, width)`` when ``width``, when there are none)."""
    if arrays:
        return np.concatenate(arrays).astype(dtype)
    return np.zeros((0, width) if width else 0, dtype)


def _media_names(i: int, what: str, starts: np.ndarray, offs: np.ndarray, ids_of: Any) -> list[str]:
    """How messages name row ``i``'s images (or videos) starting at ``starts``: ``row 3 image 1``, and the example
    that holds each when the row carries its ``example_ids``."""
    ids = None if ids_of is None else list(ids_of)
    names = []
    for k, at in enumerate(starts.tolist()):
        name = f"row {i} {what} {k}"
        names.append(name if ids is None else
                     f"{name} (example {ids[int(np.searchsorted(offs, at, side='right')) - 1]!r})")
    return names


def _has_images(row: Mapping[str, Any]) -> bool:
    offsets = row.get("image_offsets")
    return offsets is not None and len(offsets) > 0


@dataclass
class _Parts:
    """The batch being built: per row (and per row's padding), its arrays, concatenated at the end."""

    weighted: bool
    """The rows carry loss_weights (rows from PackedDataset)."""
    pairs: bool
    """The rows hold preference pairs."""
    named: bool
    """The rows carry example_ids."""
    ids: list[np.ndarray] = field(default_factory=list)
    mask: list[np.ndarray] = field(default_factory=list)
    lens: list[np.ndarray] = field(default_factory=list)
    """Sequence lengths (a padding is a sequence of its own)."""
    weights: list[np.ndarray] = field(default_factory=list)
    spans: list[np.ndarray] = field(default_factory=list)
    """Completion spans as batch token offsets."""
    sides: list[np.ndarray] = field(default_factory=list)
    """Each sequence's side, -1 for a padding sequence."""
    examples: list[np.ndarray] = field(default_factory=list)
    """Per row, the batch sequence index of each of its examples (its padding is none)."""
    example_ids: list[Any] = field(default_factory=list)
    """The rows' example ids, flattened (when ``named``)."""
    desirable: list[np.ndarray] = field(default_factory=list)
    """Per row, each example's desirability label (-1 where the row carries none)."""
    image_offsets: list[np.ndarray] = field(default_factory=list)
    """Per row with images, each image's first placeholder token as a batch token offset."""
    image_grids: list[np.ndarray] = field(default_factory=list)
    """Per row with images, ``[images, 3]`` patch grids."""
    images: list[Any] = field(default_factory=list)
    """The rows' image references (``{"path", "bytes"}``), flattened."""
    image_names: list[str] = field(default_factory=list)
    """How messages name each image."""
    video_offsets: list[np.ndarray] = field(default_factory=list)
    """Per row with videos, each video's first placeholder token as a batch token offset."""
    video_grids: list[np.ndarray] = field(default_factory=list)
    video_seconds: list[np.ndarray] = field(default_factory=list)
    """Per row with videos, each video's ``second_per_grid_ts``."""
    group_offsets: list[np.ndarray] = field(default_factory=list)
    group_grids: list[np.ndarray] = field(default_factory=list)
    """Qwen3-VL: per video, each frame group's first placeholder token (a batch token offset) and grid (1, h, w):
    ``get_rope_index`` positions each group as an image of its own."""
    videos: list[Any] = field(default_factory=list)
    video_names: list[str] = field(default_factory=list)
    labelled: bool = False
    """Some row carries a desirability label."""
    seqs: int = 0
    """Sequences so far (padding included)."""
    at: int = 0
    """Tokens so far."""


def _pair_tensors(parts: _Parts, total: int) -> dict[str, torch.Tensor]:
    """``completion_mask`` and ``pair_index`` of a batch of rows of pairs."""
    spans = np.concatenate(parts.spans)
    edges = np.zeros(total + 1, dtype=np.int64)
    np.add.at(edges, spans[:, 0], 1)
    np.add.at(edges, spans[:, 1], -1)
    sides = np.concatenate(parts.sides)
    chosen = np.flatnonzero(sides == 0)
    return {"completion_mask": torch.from_numpy(np.cumsum(edges[:-1]) > 0)[None],
            "pair_index": torch.from_numpy(np.stack([chosen, chosen + 1], axis=1))}


def _gemma_types(spec: VisionSpec, parts: Any, length: int) -> torch.Tensor:
    """Gemma 3's ``token_type_ids`` ``[1, T]``: 1 on each image's soft tokens, as ``Gemma3Processor`` gives them."""
    offsets = np.concatenate(parts.image_offsets) if parts.image_offsets else np.zeros(0, np.int64)
    grids = np.concatenate(parts.image_grids).reshape(-1, 3) if parts.image_grids else np.zeros((0, 3), np.int64)
    counts = [spec.grid_tokens(g) for g in grids.tolist()]
    return torch.from_numpy(token_type_ids(length, offsets, counts))[None]


def _has_pairs(row: Mapping[str, Any]) -> bool:
    sides = row.get("sides")
    return sides is not None and len(sides) > 0


def _check_pairs(i: int, offs: np.ndarray, sides: np.ndarray, spans: np.ndarray) -> None:
    """The pair columns' shape (the loader's and verify's checks go further): one side and one span per
    sequence, sides alternating chosen (0), rejected (1), each span inside its sequence after its first token."""
    nseq = offs.shape[0] - 1
    if sides.shape[0] != nseq or spans.shape[0] != nseq:
        raise ContractError(f"row {i}: {sides.shape[0]} sides and {spans.shape[0]} completion spans for {nseq} sequences")
    if nseq % 2 or (sides != np.arange(nseq) % 2).any():
        raise ContractError(f"row {i}: sides must alternate chosen (0), rejected (1), got {sides.tolist()[:8]}")
    if ((spans[:, 0] <= offs[:-1]) | (spans[:, 1] <= spans[:, 0]) | (spans[:, 1] > offs[1:])).any():
        raise ContractError(f"row {i}: a completion span lies outside its sequence (after its first token): "
                            f"{spans.tolist()[:4]}, seq_offsets {offs.tolist()[:5]}")


def _row_example_ids(i: int, row: Mapping[str, Any], nseq: int) -> list[Any]:
    """Row ``i``'s example ids, one per sequence: checked even without ``validate``, since a row with one id too
    many and the next with one too few would pair every value between them with the wrong example."""
    ids = row.get("example_ids")
    if ids is None:
        raise PackstreamError(f"row 0 carries example_ids, row {i} does not; collate rows of one source (all with "
                              "their example_ids, or all without)")
    ids = list(ids)
    if len(ids) != nseq:
        raise ContractError(f"row {i}: {len(ids)} example_ids for {nseq} sequences (seq_offsets "
                            f"{np.asarray(row['seq_offsets']).tolist()[:8]}); one id per example")
    return ids


def _row_desirable(i: int, row: Mapping[str, Any], nseq: int) -> np.ndarray:
    """Row ``i``'s ``desirable`` labels, one per sequence (-1 each when the row carries none)."""
    labels = row.get("desirable")
    labels = np.asarray(labels if labels is not None else (), dtype=np.int8)
    if labels.size == 0:
        return np.full(nseq, -1, dtype=np.int8)
    if labels.shape != (nseq,):
        raise ContractError(f"row {i}: desirable holds {labels.size} values for {nseq} sequences; one per example")
    return labels


def _row_weights(i: int, row: Mapping[str, Any], n: int) -> np.ndarray:
    w = row.get("loss_weights")
    w = np.asarray(w if w is not None else (), dtype=np.float32)
    if w.shape != (n,):
        raise ContractError(f"row {i}: loss_weights has {w.shape[0] if w.ndim else 0} entries, input_ids has {n}; "
                            "give every row of a batch its weights (PackedDataset does), or none")
    return w


def _check_row(i: int, n: int, mask: np.ndarray, offs: np.ndarray, budget: int | None) -> None:
    if budget is not None and n > budget:
        raise ContractError(f"row {i} has {n} tokens > budget {budget}; collate with the budget the data was packed to")
    if mask.shape[0] != n:
        raise ContractError(f"row {i}: loss_mask has {mask.shape[0]} entries, input_ids has {n}")
    if offs.shape[0] == 0 or offs[0] != 0 or offs[-1] != n:
        raise ContractError(f"row {i}: seq_offsets must run from 0 to len(input_ids)={n}, got {offs.tolist()[:8]}")
    if offs.shape[0] > 1 and (np.diff(offs) <= 0).any():
        raise ContractError(f"row {i}: seq_offsets must be strictly increasing, got {offs.tolist()[:16]}")
