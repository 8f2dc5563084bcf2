"""Images in records (``packstream pack --processor``): where each one stands in the text, and which file it is.

The common ways a record places images, each read into one form, a marker per image in the turn's text
and the image's reference in :attr:`Ctx.images`::

    OpenAI parts      {"type": "image_url", "image_url": {"url": "a.png"}}    inline reference
                      {"type": "input_image", "image_url": "data:image/png;base64,..."}
                      {"type": "image", "image": {"bytes": ..., "path": ...}}
    separate column   {"type": "image"} parts, or "<image>" in the text        the record's images[k], in order
                      (LLaMA-Factory: images + <image>; LLaVA: image + <image> in the first turn)

After hygiene (which may merge or trim turns), :func:`take_images` reads the markers left in the
conversation in order: each becomes the processor's placeholder text (``<|vision_start|><|image_pad|>
<|vision_end|>`` for Qwen2-VL, ``<image>`` for LLaVA) and its reference joins ``Conversation.images``
in that order. References stay as the record holds them; the encoder resolves and measures them
(:mod:`pipeline._media`).

>>> from pipeline._options import FormatOptions
>>> ctx = Ctx(FormatOptions(), image_text="<IMG>")
>>> text = "look: " + part_marker({"type": "image_url", "image_url": {"url": "a.png"}}, "m[0]", ctx)
>>> conv = Conversation(messages=[{"role": "user", "content": text}])
>>> take_images(conv, ctx); conv.messages[0]["content"], conv.images
('look: <IMG>', ['a.png'])
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

from packers import InternalError
from pipeline._formats._base import Conversation, Ctx, Draft, Reason, Rejected, _blank, _kind

IMAGE_PARTS = ("image_url", "input_image", "image")
"""Content part types that are images."""
VIDEO_AUDIO_PARTS = ("video", "video_url", "input_video", "audio", "input_audio", "audio_url")
VIDEO_PARTS = ("video", "video_url", "input_video")
"""Content part types that are videos (packed with ``--video-fps``: Qwen2-VL, Qwen2.5-VL)."""
VIDEO_COLUMNS = ("videos", "video")
"""Record columns that hold a record's videos beside its text (LLaMA-Factory ``videos`` + ``<video>``)."""
VIDEO_PLACEHOLDER = "<video>"
IMAGE_COLUMNS = ("images", "image")
"""Record columns that hold a record's images beside its text (LLaMA-Factory ``images``, LLaVA ``image``)."""
PLACEHOLDER = "<image>"
"""How LLaMA-Factory and LLaVA mark an image's place in the text."""

_OPEN, _CLOSE, _SLOT, _VSLOT = "\ue000", "\ue001", "\ue002", "\ue003"
"""Private-use characters: a marker ``\\ue000<k>\\ue001`` for image (or video) ``k``; ``\\ue002`` for a part whose
image is in the column, ``\\ue003`` for one whose video is."""
_MARKER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
_PRIVATE = re.compile(f"[{_OPEN}{_CLOSE}{_SLOT}{_VSLOT}]")
NOT_YET = ("videos are packed only for Qwen2-VL, Qwen2.5-VL and Qwen3-VL, with --video-fps (e.g. --video-fps 2)")


@dataclasses.dataclass(frozen=True)
class Video:
    """A video reference among a conversation's ``images`` (which then holds images and videos in the order they
    stand in the text): the record's reference, as for an image."""

    ref: Any


def _marker(ctx: Ctx, ref: Any) -> str:
    ctx.images.append(ref)
    return f"{_OPEN}{len(ctx.images) - 1}{_CLOSE}"


def _video_ref(part: dict, at: str) -> Any:
    """A video part's reference (``video``, ``video_url`` {url}, ``url``, ``path``), or None for a slot."""
    for key in ("video", "video_url", "input_video", "url", "path"):
        ref = part.get(key)
        if isinstance(ref, dict) and "url" in ref:
            ref = ref.get("url")
        if not _blank(ref):
            if isinstance(ref, list):
                raise Rejected(Reason.NON_TEXT_CONTENT, f"{at}.{key} is a list of frames; videos are packed from a "
                                                        "video file (mp4, webm, ...) only: encode the frames to one")
            if not isinstance(ref, (str, bytes, dict)):
                raise Rejected(Reason.BAD_TYPE, f"{at}.{key} is {_kind(ref)}, expected a video path or "
                                                "{bytes, path} object")
            return ref
    return None


def part_marker(part: dict, at: str, ctx: Ctx) -> str:
    """An image content part -> the text that holds its place: a marker for an inline image, a slot for one in
    the record's image column. Video and audio parts are refused."""
    kind = part.get("type")
    if kind in VIDEO_PARTS and ctx.video_text is not None:
        ref = _video_ref(part, at)
        return _VSLOT if ref is None else _marker(ctx, Video(ref))
    if kind in VIDEO_AUDIO_PARTS:
        raise Rejected(Reason.NON_TEXT_CONTENT, f"{at} is a {kind} part; {NOT_YET} (nor audio): drop these records "
                                                "or their video and audio parts")
    for key in ("image_url", "image", "url", "path"):
        ref = part.get(key)
        if key == "image_url" and isinstance(ref, dict):
            ref = ref.get("url")
        if not _blank(ref):
            if not isinstance(ref, (str, bytes, dict)):
                raise Rejected(Reason.BAD_TYPE, f"{at}.{key} is {_kind(ref)}, expected an image path, URL or "
                                                "{bytes, path} object")
            return _marker(ctx, ref)
    return _SLOT


def column_videos(record: dict, ctx: Ctx) -> tuple[Optional[str], list]:
    """The record's video column (its key, its references wrapped as :class:`Video`; (None, []) when it has none),
    read when the run packs videos (``ctx.video_text``)."""
    if ctx.video_text is None:
        return None, []
    found = [k for k in VIDEO_COLUMNS if not _blank(record.get(k))]
    if len(found) > 1:
        raise Rejected(Reason.AMBIGUOUS_FIELD, "the record carries videos under both 'videos' and 'video'; keep one")
    if not found:
        return None, []
    key = found[0]
    refs = record[key] if isinstance(record[key], list) else [record[key]]
    for j, ref in enumerate(refs):
        if not isinstance(ref, (str, bytes, dict)) or _blank(ref):
            raise Rejected(Reason.BAD_TYPE, f"{key}[{j}] is {_kind(ref)}, expected a video path or {{bytes, path}} "
                                            "object")
    return key, [Video(r) for r in refs]


def column_images(record: dict, ctx: Ctx) -> tuple[Optional[str], list]:
    """The record's image column (its key, its references; (None, []) when it has none). Audio columns are refused,
    and video columns unless the run packs videos (:func:`column_videos`)."""
    for key in (("audios", "audio") if ctx.video_text is not None else ("videos", "video", "audios", "audio")):
        if not _blank(record.get(key)):
            raise Rejected(Reason.NON_TEXT_CONTENT, f"the record carries {key!r}; {NOT_YET} (nor audio): drop these "
                                                    f"records or their {key!r}")
    found = [k for k in IMAGE_COLUMNS if not _blank(record.get(k))]
    if len(found) > 1:
        raise Rejected(Reason.AMBIGUOUS_FIELD, "the record carries images under both 'images' and 'image'; keep one")
    if not found:
        return None, []
    key = found[0]
    value = record[key]
    refs = value if isinstance(value, list) else [value]
    for j, ref in enumerate(refs):
        if not isinstance(ref, (str, bytes, dict)) or _blank(ref):
            raise Rejected(Reason.BAD_TYPE, f"{key}[{j}] is {_kind(ref)}, expected an image path, URL or "
                                            "{bytes, path} object")
    return key, refs


def refuse_private_use(record: Any) -> None:
    """A record whose own text (any string in it, keys included) holds U+E000, U+E001 or U+E002, the characters
    image places are marked with while a record is read, is ``placeholder_mismatch``: checked on the raw record,
    before any mark is made, so no text of the record's can pass for one."""
    stack = [record]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _PRIVATE.search(v):
                raise Rejected(Reason.PLACEHOLDER_MISMATCH, "the record's text holds one of the private-use characters "
                                                            "U+E000, U+E001, U+E002, U+E003, which packstream marks image "
                                                            "places with under --processor; remove them")
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)


def _placeholders(ctx: Ctx, video: bool = False) -> "re.Pattern[str]":
    """What stands for one image of the record's image column, for every processor alike: ``<image>``, the
    processor's own placeholder text (``<|vision_start|><|image_pad|><|vision_end|>`` for Qwen2-VL), and an
    image part without an image of its own. ``video``: the same for a video (``<video>``, the processor's video
    text, a video part without a video)."""
    if video:
        spelled = sorted({VIDEO_PLACEHOLDER, ctx.video_text or VIDEO_PLACEHOLDER}, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, spelled)) + f"|{_VSLOT}")
    spelled = sorted({PLACEHOLDER, ctx.image_text or PLACEHOLDER}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, spelled)) + f"|{_SLOT}")


def image_tags_as_videos(drafts: list[Draft], images: list, videos: list, ctx: Ctx) -> None:
    """LLaVA-Video's records (LLaVA-Video-178K: ``video`` beside ``conversations`` whose first turn starts with
    ``<image>``) mark a video's place with ``<image>``: a record with videos, no image, no video placeholder and as
    many ``<image>`` tags as videos has each tag read as ``<video>``, counted as ``image_tags_as_videos``."""
    if images or not videos:
        return
    texts = [(t, "content") for d in drafts for t in (d.turns or ())] + [(d, "text") for d in drafts if d.text]
    tags = sum(getattr(o, attr).count(PLACEHOLDER) for o, attr in texts)
    if tags != len(videos) or any(_placeholders(ctx, True).search(getattr(o, attr)) for o, attr in texts):
        return
    for o, attr in texts:
        setattr(o, attr, getattr(o, attr).replace(PLACEHOLDER, VIDEO_PLACEHOLDER))
    ctx.note("image_tags_as_videos", tags)


def place_column(drafts: list[Draft], key: Optional[str], refs: list, ctx: Ctx, video: bool = False) -> None:
    """Each placeholder (:func:`_placeholders`) in the drafts' text, in order, becomes the marker of the column's
    next image; their numbers must agree, with or without a column (an ``<image>`` with no image beside it, an
    empty ``images`` list or CSV cell, is ``placeholder_mismatch`` under every processor). A conversation whose text
    holds no placeholder at all gets the column's images before its first user turn's text, in order (TRL's
    ``prepare_multimodal_messages`` rule), counted as ``images_placed_first``."""
    texts = [(t, "content") for d in drafts for t in (d.turns or ())] + [(d, "text") for d in drafts if d.text]
    pattern = _placeholders(ctx, video)
    found = sum(len(pattern.findall(getattr(o, attr))) for o, attr in texts)
    if not found and not refs:
        return
    first_user = next((t for d in drafts[:1] for t in (d.turns or ()) if t.role == "user"), None)
    if not found and first_user is not None and len(drafts) == 1:
        # No placeholder anywhere (LLaVA/LLaMA-Factory records that leave them out, RLAIF-V, the_cauldron): the
        # images go before the first user turn's text, as TRL's prepare_multimodal_messages puts them; counted.
        first_user.content = (VIDEO_PLACEHOLDER if video else PLACEHOLDER) * len(refs) + first_user.content
        found = len(refs)
        ctx.note("videos_placed_first" if video else "images_placed_first", len(refs))
    if found != len(refs):
        kind, tag = ("video", "<video>") if video else ("image", "<image>")
        where = f"{len(refs)} in {key!r}" if key is not None else f"no {kind} beside the text (no '{kind}s' column)"
        raise Rejected(Reason.PLACEHOLDER_MISMATCH, f"the text holds {found} {kind} placeholders ({tag}, the "
                                                    f"processor's own {kind} text, or {kind} parts without a {kind} of "
                                                    f"their own) and the record {where}; give one placeholder per "
                                                    f"{kind}, in order")
    if len(drafts) > 1:
        raise Rejected(Reason.NON_TEXT_CONTENT, "the record holds several conversations (a message tree) and images "
                                                "beside the text; such records are not packed with images yet")
    order = iter(refs)
    for o, attr in texts:
        setattr(o, attr, pattern.sub(lambda _m: _marker(ctx, next(order)), getattr(o, attr)))


def take_images(conv: Conversation, ctx: Ctx) -> None:
    """The markers left in ``conv`` (after hygiene), in order: each becomes ``ctx.image_text`` and its reference joins
    ``conv.images``. A marker outside the text the template renders as is (reasoning, a tool call) is refused."""
    if ctx.image_text is None or not ctx.images:
        return
    images: list = []
    seen: set[int] = set()

    def one(m: re.Match) -> str:
        k = int(m.group(1))
        if k in seen or k >= len(ctx.images):  # refuse_private_use keeps the record's own text from this
            raise InternalError(f"image mark {k} met twice or beyond the record's {len(ctx.images)} images")
        seen.add(k)
        images.append(ctx.images[k])
        ref = ctx.images[k]
        return ctx.video_text if isinstance(ref, Video) else ctx.image_text

    if conv.text is not None:
        conv.text = _MARKER.sub(one, conv.text)
    for m in conv.messages:
        if isinstance(m.get("content"), str):
            m["content"] = _MARKER.sub(one, m["content"])
        if any(_OPEN in str(v) for k, v in m.items() if k != "content"):
            raise Rejected(Reason.PLACEHOLDER_MISMATCH, f"a {m['role']} turn holds an image in its reasoning or tool "
                                                        "calls; images are packed in a turn's text only")
    conv.images = images
