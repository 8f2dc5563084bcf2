"""Videos of a ``--video-fps`` run: a record's reference -> what a row carries, its grid and its token count.

A video reference is spelled as an image's (a path under the media root, a ``file:`` URL, ``{bytes, path}``, bytes;
:func:`pipeline._media.resolve`) and opened the same way, under the media root without following links
(:func:`packers.files.open_beneath`). Its frame count, rate and size come from the container's header (PyAV, as
transformers' ``read_video_pyav`` reads them); the frames the processor samples follow from those alone
(:meth:`packers.VisionSpec.video_grid`), and the file is decoded once up to the last sampled frame, so that a file
that holds fewer frames than its header states is a dead letter here, not a crash in the training loader. Anything
that cannot be read is a ``bad_image`` dead letter naming the video and the error; a video too short to sample one
temporal patch is one too.
"""

from __future__ import annotations

import io
import os
from typing import IO, Any

from packers import ImageSizeError, PackstreamError, VisionSpec
from pipeline._formats import Reason, Rejected
from pipeline._media import Image, MediaRoot, _open, _short, read_image, resolve
from pipeline._options import ImageStorage


def measure_video(ref: Any, root: MediaRoot, spec: VisionSpec, storage: ImageStorage, at: str) -> Image:
    """One video of an example, resolved under ``root``, stored as ``storage`` says (``--images embed``: its bytes)
    and measured under ``spec``: an :class:`pipeline._media.Image` with ``video=True``, its ``video_grid_thw``, its
    token count and its ``second_per_grid_ts``; or :class:`Rejected`."""
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
            grid, seconds = spec.measure_video(source, what)
        except ImageSizeError as e:
            raise Rejected(Reason.BAD_IMAGE, f"{what}: {str(e).replace('image', 'video frame', 1)}") from None
        except PackstreamError as e:
            raise Rejected(Reason.BAD_IMAGE, f"{e}; replace the file or drop the record") from None
    return Image(stored, data, grid, spec.grid_tokens(grid), video=True, seconds=seconds)
