"""Images of a ``--processor`` run: a record's references -> what a row carries, and how many tokens each is.

A reference is what the record holds (:attr:`pipeline._formats.Conversation.images`)::

    "photos/cat.jpg"                     a path: relative to --media-root, else to the input file's folder
    "file:///data/cat.jpg"               a file URI
    "data:image/png;base64,iVBOR..."     a data URL: its bytes
    {"bytes": b"...", "path": "x.png"}   Hugging Face datasets' Image (Parquet/Arrow struct columns): bytes first
    b"\\x89PNG..."                        encoded bytes
    "https://..."                        refused (remote_image): packing is offline

**Every file read lies under the media root** (:class:`MediaRoot`: ``--media-root``, else the input file's
folder). :func:`resolve` is the one resolver of every spelling (a relative or absolute path, ``file:`` URLs
with or without a host, a struct without bytes): it takes the path's real target (links resolved, ``..``
applied) and refuses one outside the root as ``outside_media_root``, naming the reference and the root; the
file is then opened component by component from the root without following links
(:func:`packers.files.open_beneath`), so a path swapped for a link between the look-up and the read is not
followed out either. ``--media-root /`` is how a user says images may lie anywhere.

and becomes an :class:`Image`: ``{path, bytes}`` as the row's ``images`` column stores it, its size read
from the file's header with PIL (and the image decoded once, cheaply, to catch a file cut short), upright (its EXIF
orientation applied, as the loader decodes it), its patch grid and its token count from the run's
:class:`packers.VisionSpec`. ``--images`` decides what a local path
becomes (bytes the record holds are stored as bytes either way, with the name the record gave)::

    --images reference  {"path": "/data/photos/cat.jpg", "bytes": None}       the absolute path; the loader reads it
    --images embed      {"path": "cat.jpg", "bytes": b"\\xff\\xd8\\xff..."}   the file's encoded bytes, read once
                                                                            (sized and checked from those bytes);
                                                                            its file name, as datasets' embed_storage

Anything that cannot be read or sized, or a file over :data:`MAX_EMBED_BYTES` to embed, is a
:class:`Rejected` (``bad_image``) naming the image and the error.

Videos (``--video-fps``: ``Video`` references among a conversation's images) are resolved and opened the same way
(:func:`measure_video`): their frame count, rate and size come from the container's header (PyAV, as transformers'
``read_video_pyav`` reads them), the frames the processor samples follow from those alone
(:meth:`packers.VisionSpec.video_grid`), and the file is decoded once up to the last sampled frame, so that a file
holding fewer frames than its header states is a ``bad_video`` dead letter here, not a crash in the loader.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import urllib.parse
import urllib.request
import warnings
from typing import IO, Any, Optional, Sequence

from packers import ImageSizeError, PackstreamError, VisionSpec
from packers.files import OutsideRoot, open_beneath, real_folder, under, within
from pipeline._formats import Reason, Rejected, Video
from pipeline._options import ImageStorage

_SHOWN = 80

MAX_EMBED_BYTES = 64 * 2**20
"""The largest image file ``--images embed`` stores in a row (64 MiB). Encoded training images are rarely over a
few MiB (a 12-megapixel JPEG is ~4 MiB, and Qwen2-VL's max_pixels downscales anything bigger); a larger file is
most often a raw scan or the wrong file, and rows and spill batches hold their images in one Arrow binary
column (at most 2 GiB per batch), so each image is bounded. A larger file is a ``bad_image`` dead letter naming
its size and this limit: re-encode it, or pack with ``--images reference``."""


@dataclasses.dataclass(frozen=True)
class Image:
    """One image of an example: as the row stores it, its grid ``(t, h, w)`` and its placeholder token count."""

    path: Optional[str]
    data: Optional[bytes]
    grid: tuple[int, int, int]
    tokens: int
    video: bool = False
    """A video (``--video-fps``): ``grid`` is its ``video_grid_thw``."""
    seconds: float = 0.0
    """A video's ``second_per_grid_ts`` (float32 as the processor gives it); 0 for an image."""
    text: str = ""
    """A Qwen3-VL video: the text its processor writes for it, one ``<t seconds>`` timestamp and one placeholder per
    temporal group (each group ``tokens / grid[0]`` tokens); "" otherwise (one placeholder run)."""


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "..."


@dataclasses.dataclass(frozen=True)
class MediaRoot:
    """The folder a record's image files must lie under: ``--media-root``, else the folder of the input file
    that names them. ``path`` is absolute (how summaries, the manifest and messages name it), ``real`` the same
    with links resolved (what reads are held under), None for a remote folder (``gs://``: images are read from
    local files only). ``--media-root /`` lets records name any file on the machine: said, never assumed."""

    path: str
    real: Optional[str]

    @classmethod
    def of(cls, folder: str) -> "MediaRoot":
        if "://" in folder and not folder.startswith("file://"):
            return cls(folder, None)
        folder = folder[len("file://"):] if folder.startswith("file://") else folder
        return cls(os.path.abspath(folder), real_folder(folder))


def media_root(option: Optional[str], folder: Optional[str]) -> MediaRoot:
    """The media root of an input in ``folder`` (its file's folder; None or "": read from standard input, the
    working folder) under ``--media-root option`` (None: not given)."""
    return MediaRoot.of(option or folder or os.getcwd())


def media_roots(option: Optional[str], folders: Sequence[Optional[str]]) -> list[str]:
    """The run's media roots, absolute, once each, sorted: what its summary and manifest name."""
    return sorted({media_root(option, f).path for f in folders} if folders else {media_root(option, None).path})


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one image's bytes come from: ``data`` the record holds, or the local file ``real`` (a real path under
    the media root) which a row names as ``path``."""

    path: Optional[str]
    data: Optional[bytes]
    real: Optional[str] = None


def _outside(at: str, ref: str, root: MediaRoot, how: str) -> Rejected:
    return Rejected(Reason.OUTSIDE_MEDIA_ROOT, f"{at} {_short(ref)!r} {how}, outside the media root {root.path}; only "
                                               "images under it are read: move the image under it, or pass the folder "
                                               "that holds every image as --media-root")


def _within_root(root: MediaRoot, path: str) -> bool:
    """Whether ``path``, as written (no link resolved), names a place under ``root``."""
    return under(root.path, path) or (root.real is not None and under(root.real, path))


def _local_path(ref: str, root: MediaRoot, at: str) -> str:
    """A string reference that names a local file -> that path as written (relative or absolute), from every
    spelling of a ``file:`` URL (``file:///a``, ``file:/a``, ``file://localhost/a``, percent-escapes decoded);
    a URL of any other scheme, or a ``file:`` URL naming another host, is refused."""
    low = ref[:16].lower()
    if low.startswith(("http://", "https://")):
        raise Rejected(Reason.REMOTE_IMAGE, f"{at} is the URL {_short(ref)!r}; packstream packs offline: download the "
                                            "images and give their local paths (relative ones resolve against "
                                            "--media-root)")
    if low.startswith("file:"):
        url = urllib.parse.urlsplit(ref)
        if url.netloc not in ("", "localhost"):
            raise _outside(at, ref, root, f"names a file on the host {_short(url.netloc)!r}")
        return urllib.request.url2pathname(url.path)
    if "://" in ref[:32]:
        raise Rejected(Reason.REMOTE_IMAGE, f"{at} is the URI {_short(ref)!r}; packstream reads images from local "
                                            "paths only: copy them here and give their paths")
    return ref


def resolve(ref: Any, root: MediaRoot, at: str) -> Source:
    """A reference -> its :class:`Source`: the bytes a record holds (keeping the record's name), or a local file
    checked to lie under ``root`` (every link resolved, ``..`` applied; else ``outside_media_root``). The one
    resolver: paths, ``file:`` URLs, data URLs, ``{bytes, path}`` structs (a struct without bytes is its path)."""
    if isinstance(ref, dict):
        data, path = ref.get("bytes"), ref.get("path")
        if isinstance(data, (bytes, bytearray)) and data:
            return Source((path if isinstance(path, str) and path else None), bytes(data))
        if isinstance(path, str) and path:
            return resolve(path, root, at)
        raise Rejected(Reason.BAD_IMAGE, f"{at} is an image object with neither bytes nor a path (keys "
                                         f"{sorted(map(str, ref))}); give {{bytes, path}} as Hugging Face datasets do")
    if isinstance(ref, (bytes, bytearray)):
        return Source(None, bytes(ref))
    if not isinstance(ref, str):
        raise Rejected(Reason.BAD_TYPE, f"{at} is {type(ref).__name__}, expected an image path, URL or bytes")
    if ref[:5].lower() == "data:":
        head, _, payload = ref.partition(",")
        if not head.lower().startswith("data:image/") or not head.lower().endswith(";base64"):
            raise Rejected(Reason.BAD_IMAGE, f"{at} is a data URL of {_short(head)!r}; an image data URL is "
                                             "data:image/<type>;base64,<data>")
        try:
            return Source(None, base64.b64decode(payload, validate=True))
        except (binascii.Error, ValueError) as e:
            raise Rejected(Reason.BAD_IMAGE, f"{at}: the data URL's base64 does not decode ({e})") from None
    local = _local_path(ref, root, at)
    if "\0" in local:
        raise Rejected(Reason.BAD_IMAGE, f"{at} {_short(ref)!r} holds a NUL character, which no file name does")
    try:
        local.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise Rejected(Reason.BAD_IMAGE, f"{at} {_short(ref)!r} holds a lone surrogate character, which no file name "
                                         "does") from None
    if root.real is None:
        raise Rejected(Reason.REMOTE_IMAGE, f"{at} {_short(ref)!r} names a file beside the remote input "
                                            f"{_short(root.path)}; images are read from local files only: copy them "
                                            "here and pass their folder as --media-root")
    # Never ~-expanded: a record's text does not get to name the packing user's home. Normalized as written
    # (x/../ removed), then its links resolved: the path a row stores names the file that was read.
    path = os.path.abspath(os.path.join(root.path, local))
    try:
        real = within(root.real, path, what=at)
    except OutsideRoot as e:  # out as written, or out through a link met on the way
        linked = _within_root(root, os.path.normpath(path))
        raise _outside(at, ref, root, f"leads through a link to {_short(e.target)}" if linked
                       else f"is {_short(e.target)}") from None
    return Source(path, None, real)


def _open(src: Source, root: MediaRoot, at: str):
    """The local file of ``src`` opened under ``root`` (:func:`packers.files.open_beneath`: the check holds at open
    time too); a missing file, a FIFO, a device, a folder or a file moved out since the look-up: Rejected."""
    if not os.path.lexists(src.real):
        raise Rejected(Reason.BAD_IMAGE, f"{at}: image {_short(src.path)!r} does not exist; give paths relative to the "
                                         "input file's folder, or set --media-root")
    try:
        return open_beneath(root.real, src.real, what=f"{at}: image")
    except OutsideRoot:
        raise _outside(at, src.path, root, "was swapped for a link while it was opened") from None
    except PackstreamError as e:  # not a regular file, or no permission: its one line says which
        raise Rejected(Reason.BAD_IMAGE, str(e)) from None


def image_size(source: IO[bytes], what: str, at: str, notes: Optional[dict] = None) -> tuple[int, int]:
    """``(width, height)`` of an image that decodes, upright: the size from its header, then the whole image read
    once (a JPEG at 1/8 scale, PIL's draft mode, so the check costs little), so that a file cut short or corrupt past
    its header is a dead letter here, not a crash in the training loader; width and height swapped when its EXIF
    orientation turns it a quarter (:func:`packers.images.upright_size`: the size of what the loader's
    :func:`packers.images.decode_rgb` gives the processor). Any failure of PIL's (it raises OSError,
    ValueError, SyntaxError, struct.error, DecompressionBombError, ... on bad files) is one. PIL's
    DecompressionBombWarning (an image over ``Image.MAX_IMAGE_PIXELS``) is counted in ``notes`` as
    ``large_image``, shown in the run's summary, never printed."""
    from PIL import Image as PILImage

    from packers.images import QUARTER_TURNS, exif_orientation

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PILImage.DecompressionBombWarning)
            with source, PILImage.open(source) as im:
                size = im.size
                im.draft("RGB", (max(1, size[0] // 8), max(1, size[1] // 8)))
                im.load()
                if exif_orientation(im) in QUARTER_TURNS:  # decoded: read as exif_transpose reads it
                    size = (size[1], size[0])
        if notes is not None and any(issubclass(w.category, PILImage.DecompressionBombWarning) for w in caught):
            notes["large_image"] = notes.get("large_image", 0) + 1
        return size
    except Exception as e:  # noqa: BLE001 - every way a file fails to decode is a dead letter with its reason
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise Rejected(Reason.BAD_IMAGE, f"{at}: image {what} cannot be read ({type(e).__name__}: {_short(first)}); "
                                         "replace the file or drop the record") from None


def _amount(n: int) -> str:
    return f"{n:,} bytes" if n < 2**20 else f"{n / 2**20:.4g} MiB"


def read_image(f: IO[bytes], path: str, at: str) -> bytes:
    """The encoded bytes of the opened local image file ``f`` (``--images embed``), at most
    :data:`MAX_EMBED_BYTES`; a larger or unreadable one is :class:`Rejected` (``bad_image``). A file over the
    limit is refused by its size, before it is read."""
    limit = MAX_EMBED_BYTES
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            data = f.read(limit + 1) if size <= limit else b""
        except OSError as e:
            raise Rejected(Reason.BAD_IMAGE, f"{at}: cannot read image {_short(path)!r} ({e.strerror or e}); replace "
                                             "the file or drop the record") from None
    size = max(size, len(data))
    if size > limit:
        raise Rejected(Reason.BAD_IMAGE, f"{at}: image {_short(path)!r} is {_amount(size)}, over the "
                                         f"{_amount(limit)} limit of an image embedded in a row (--images embed); "
                                         "re-encode or downscale it, or pack with --images reference")
    return data


def measure(refs: Sequence[Any], root: MediaRoot, spec: VisionSpec,
            storage: ImageStorage = ImageStorage.REFERENCE, notes: Optional[dict] = None) -> list[Image]:
    """The images of one example, resolved under ``root`` (:func:`resolve`), stored as ``storage`` says and sized
    under ``spec``; or :class:`Rejected`. A local file is opened once, under the root: with
    :attr:`ImageStorage.EMBED` the row stores the bytes read then, and they are what is sized and checked."""
    out = []
    for k, ref in enumerate(refs):
        if isinstance(ref, Video):
            out.append(measure_video(ref.ref, root, spec, storage, f"video {k + 1} of {len(refs)}"))
            continue
        at = f"image {k + 1} of {len(refs)}"
        src = resolve(ref, root, at)
        stored, data = src.path, src.data
        if data is not None:
            source: IO[bytes] = io.BytesIO(data)
        else:
            source = _open(src, root, at)
            if storage is ImageStorage.EMBED:
                data, stored = read_image(source, src.path, at), os.path.basename(src.path)
                source = io.BytesIO(data)
        what = repr(_short(src.path)) if src.path else f"{len(data or b'')} bytes"
        width, height = image_size(source, what, at, notes)
        try:
            grid = spec.image_grid(width, height)
        except ImageSizeError as e:
            raise Rejected(Reason.BAD_IMAGE, f"{at} ({_short(src.path) if src.path else 'bytes'}): {e}") from None
        out.append(Image(stored, data, grid, spec.grid_tokens(grid)))
    return out


TEXT_SECONDS_PER_MIB = 0.55
"""CPU-seconds a MiB of JSONL text costs the job on the shared mix (``bench/bench_scale.py --cores``): the unit
:func:`image_work` turns measured image time into."""
SAMPLED_RECORDS = 128
"""Records sampled per input (at most :data:`SAMPLED_INPUTS` inputs, the biggest) to count their images."""
SAMPLED_INPUTS = 4
TIMED_IMAGES = 12
"""Images resolved, read and sized (:func:`measure`) to time one: a few dozen milliseconds in all, usually."""
TIMED_VIDEOS = 4
"""Videos resolved, opened and decoded up to their last sampled frame (:func:`measure_video`) to time one."""


@dataclasses.dataclass(frozen=True)
class Work:
    """A ``--processor`` run's work in bytes of text (what ``--workers auto`` and the read tasks are sized by):
    the input bytes, plus each image's and video's measured time as the text bytes that take as long."""

    input_bytes: int
    images: int
    """Images the inputs hold, estimated from a sample of records."""
    seconds_per_image: float
    """Wall time of :func:`measure` per sampled image (resolve, open, header, a draft decode)."""
    videos: int = 0
    """Videos the inputs hold (``--video-fps``), estimated from the same sample."""
    seconds_per_video: float = 0.0
    """Wall time of :func:`measure_video` per sampled video (resolve, open, header, decoding to the last sampled
    frame)."""

    @property
    def bytes(self) -> float:
        seconds = self.images * self.seconds_per_image + self.videos * self.seconds_per_video
        return self.input_bytes + seconds / TEXT_SECONDS_PER_MIB * 2**20

    @property
    def scale(self) -> float:
        """Work per input byte (1 for a text-only run)."""
        return self.bytes / max(1, self.input_bytes)

    def describe(self) -> str:
        """How the summary says it: ``31,204 bytes of records and ~240 images at ~18.0 ms each: the work of ~7.9 MiB
        of text`` (and ``, ~12 videos at ~95.0 ms each`` after the images in a run with videos)."""
        kinds = [(n, kind, s) for n, kind, s in ((self.images, "images", self.seconds_per_image),
                                                 (self.videos, "videos", self.seconds_per_video))
                 if n or (kind == "images" and not self.videos)]
        media = ", ".join(f"~{n:,} {kind} at ~{s * 1e3:,.1f} ms each" for n, kind, s in kinds)
        return f"{_amount(self.input_bytes)} of records and {media}: the work of ~{_amount(int(self.bytes))} of text"


def image_work(options: Any, files: Sequence[Any], sizes: Sequence[int]) -> Optional[Work]:
    """The image work of a ``--processor`` run over ``files`` (``sizes``: their bytes), from a sample: the images
    (and videos) per record of up to :data:`SAMPLED_RECORDS` records of each of the biggest inputs, and the time
    :func:`measure` takes on up to :data:`TIMED_IMAGES` images and :data:`TIMED_VIDEOS` videos of them. None for a
    text-only run, or when the sample holds no image or video. A record the sample cannot read is skipped (the job
    dead-letters it)."""
    from pipeline._formats import conversations, pair_conversations
    from pipeline._read import sample

    spec = options.vision() if options.processor is not None else None
    if spec is None or not files:
        return None
    image_text = spec.placeholder
    video_text = spec.video_placeholder if spec.videos else None
    formats = [d.format for d in options.datasets()]
    totals, refs = [0.0, 0.0], ([], [])  # images, videos
    biggest = sorted(range(len(files)), key=lambda i: -sizes[i])[:SAMPLED_INPUTS]
    for i in biggest:
        f = files[i]
        try:
            s = sample(f, SAMPLED_RECORDS, options.max_record_bytes)
        except PackstreamError:
            continue
        root = media_root(options.media_root, os.path.dirname(f.path))
        found = [0, 0]
        for _, record in s.items:
            try:
                convs = (list(pair_conversations(record, formats[f.dataset], image_text))[:1] if options.pairs
                         else conversations(record, formats[f.dataset], image_text, video_text))
            except (Rejected, PackstreamError):
                continue
            for conv in convs:
                for ref in conv.images:
                    kind = int(isinstance(ref, Video))
                    found[kind] += 1
                    if len(refs[kind]) < (TIMED_VIDEOS if kind else TIMED_IMAGES):
                        refs[kind].append((ref, root))
        for kind in (0, 1):
            totals[kind] += found[kind] / len(s.items) * s.records if s.items else 0.0
    if not refs[0] and not refs[1]:
        return None
    share = sum(sizes) / max(1, sum(sizes[i] for i in biggest))  # the inputs not sampled: alike, by size
    return Work(int(sum(sizes)), int(round(totals[0] * share)), _time_measure(refs[0], spec, options.images),
                int(round(totals[1] * share)), _time_measure(refs[1], spec, options.images))


def _time_measure(refs: list[tuple[Any, MediaRoot]], spec: VisionSpec, storage: ImageStorage) -> float:
    """Seconds :func:`measure` takes per reference of ``refs`` (0 for none); a bad one costs about as much to find
    out."""
    import time

    if not refs:
        return 0.0
    start = time.perf_counter()
    for ref, root in refs:
        try:
            measure([ref], root, spec, storage)
        except Rejected:
            pass
    return (time.perf_counter() - start) / len(refs)


def measure_video(ref: Any, root: MediaRoot, spec: VisionSpec, storage: ImageStorage, at: str) -> Image:
    """One video of an example, resolved under ``root``, stored as ``storage`` says (``--images embed``: its bytes)
    and measured under ``spec``: an :class:`pipeline._media.Image` with ``video=True``, its ``video_grid_thw``, its
    token count and its ``second_per_grid_ts``; or :class:`Rejected`: a video that is missing, unreadable, cut short
    or of a frame size the processor refuses is ``bad_video`` (the other refusals, ``remote_image`` and
    ``outside_media_root``, are an image's)."""
    try:
        return _measure_video(ref, root, spec, storage, at)
    except Rejected as r:
        if r.reason is not Reason.BAD_IMAGE:
            raise
        raise Rejected(Reason.BAD_VIDEO, r.detail.replace(f"{at}: image ", f"{at}: video ", 1)
                       .replace(f"{at}: cannot read image ", f"{at}: cannot read video ", 1)) from None


def _measure_video(ref: Any, root: MediaRoot, spec: VisionSpec, storage: ImageStorage, at: str) -> Image:
    """:func:`measure_video`, its file refusals still ``bad_image``."""
    src = resolve(ref, root, at)
    stored, data = src.path, src.data
    source: IO[bytes]
    if data is not None:
        source = io.BytesIO(data)
    else:
        source = _open(src, root, at)
        if storage is ImageStorage.EMBED:
            data, stored = read_image(source, src.path, at), os.path.basename(src.path)
            source = io.BytesIO(data)
    what = f"{at} ({_short(src.path) if src.path else str(len(data or b'')) + ' bytes'})"
    with source:
        try:
            grid, seconds, text = spec.measure_video_text(source, what)
        except ImageSizeError as e:
            raise Rejected(Reason.BAD_IMAGE, f"{what}: {str(e).replace('image', 'video frame', 1)}") from None
        except PackstreamError as e:
            raise Rejected(Reason.BAD_IMAGE, f"{e}; replace the file or drop the record") from None
    return Image(stored, data, grid, spec.grid_tokens(grid), video=True, seconds=seconds, text=text)
