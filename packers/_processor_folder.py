"""One typed reader of a ``--processor FOLDER``'s JSON files, and the one table of the model types packstream verified.

A model folder (a Hub snapshot, a ``save_pretrained`` output) holds the files a processor is built from. packstream
reads four of them, each through :func:`read_json`: an entry is either

* **absent** (no directory entry at all, ``os.lstat`` finds nothing): None, and the caller does what it always did
  without the file;
* **a regular JSON object** (links followed), read through :func:`packers.files.read_checked` and
  :func:`packers.files.load_json` (1 MiB at most, bounded nesting);
* **present but unreadable** (a FIFO, a folder, a socket, a dangling link -- a Hub cache whose blob was removed --, a
  link loop, JSON that is no object): one PackstreamError line naming the file, what it is and the fix. Never
  skipped: a folder whose ``config.json`` cannot be read must not pack as if it had none.

>>> import shutil, tempfile
>>> d = tempfile.mkdtemp()
>>> read_json(d, "config.json") is None  # absent: the caller goes on without it
True
>>> os.mkfifo(os.path.join(d, "config.json"))
>>> read_json(d, "config.json")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
packers.errors.PackstreamError: --processor .../config.json is a FIFO (named pipe), not a JSON file ...
>>> shutil.rmtree(d)

:data:`MODEL_TYPES` says, per family, which ``config.json`` ``model_type`` values packstream has verified packed
batches for (:func:`check_model_type`): transformers hands one processor class to several models (``Qwen3VLProcessor``
to Qwen3.5, ``LlavaProcessor`` to VipLlava, ``Gemma3Processor`` to T5Gemma 2), whose positions or image features
packstream has not held against the model.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, NamedTuple, Optional

from packers.errors import PackstreamError
from packers._keys import shown
from packers.files import load_json, not_a_file, read_checked, show_path

MAX_BYTES = 1 << 20
"""A processor or model config is a few KiB; a file over 1 MiB is not one."""

FILES = ("preprocessor_config.json", "processor_config.json", "config.json", "video_preprocessor_config.json")
"""Every file of a processor folder packstream reads: the image processor's settings, the processor's, the model's
config (its ``model_type``), the video processor's (``--video-fps`` runs)."""

_FIX = "pass the model's processor folder"


def read_json(folder: str, name: str, *, fix: str = _FIX) -> Optional[dict[str, Any]]:
    """``folder``'s file ``name`` as a JSON object; None when there is no entry of that name at all. Present but
    unreadable, or JSON that is no object: one PackstreamError line naming the file (``fix`` ends the messages about
    its content)."""
    path = os.path.join(folder, name)
    try:
        kind = not_a_file(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # the folder itself cannot be listed (permissions), or is no folder
        raise PackstreamError(f"cannot read --processor {show_path(path)}: {e.strerror or e}; check the folder and "
                              "its permissions") from None
    if kind is not None:
        raise _unreadable(path, name, kind)
    return read_file(path, fix=fix)


def read_file(path: str, *, fix: str = _FIX) -> dict[str, Any]:
    """The JSON object in the file ``path`` (``--processor FILE``, or one of a folder's files), which must be there."""
    what = f"--processor {show_path(path)}"
    try:
        kind = not_a_file(path)
    except OSError as e:
        raise PackstreamError(f"cannot read {what}: {e.strerror or e}; check the path and its permissions") from None
    if kind is not None:
        raise _unreadable(path, os.path.basename(path), kind)
    loaded = load_json(read_checked(path, what=what, limit=MAX_BYTES, fix=fix), what=what, fix=fix)
    if not isinstance(loaded, dict):
        raise PackstreamError(f"{what}: {_json_kind(loaded)}, expected a JSON object; {fix}")
    return loaded


def _unreadable(path: str, name: str, kind: str) -> PackstreamError:
    gone = "which does not exist" in kind  # a Hub cache whose blob was removed: its snapshot links dangle
    return PackstreamError(
        f"--processor {show_path(path)} is {kind}, not a JSON file packstream can read; put the model's own {name} "
        f"there as a regular file{' (download the model again)' if gone else ''}, or pass a shipped --processor")


def _json_kind(value: Any) -> str:
    """A JSON value that is no object, as a message names it: ``a JSON array [1, 2]``, ``null``."""
    if value is None:
        return "null"
    names = {list: "a JSON array", str: "a JSON string", bool: "a JSON boolean"}
    return f"{names.get(type(value), 'a JSON number')} {shown(value, 40)}"


class Verified(NamedTuple):
    """What packstream verified for one family: the model types, and how messages name the family."""

    model_types: tuple[str, ...]
    """``config.json`` ``model_type`` values whose packed batches tests hold against the model."""
    processor: str
    """The transformers processor class of the family (``processor_class``)."""
    model: str
    """The family, with its article, as a message names it."""
    builtin: str
    """The shipped ``--processor`` name."""


MODEL_TYPES: Mapping[str, Verified] = {
    # Keyed by VisionFamily value. model_type names are transformers 5.25's (models/auto/configuration_auto.py
    # CONFIG_MAPPING_NAMES; PROCESSOR_MAPPING_NAMES gives each of them the processor named here), and each is the
    # model_type the family's released checkpoints write (Qwen/Qwen2-VL-*, Qwen/Qwen2.5-VL-*, Qwen/Qwen3-VL-* and
    # Qwen3-VL-*-A*B (MoE), llava-hf/llava-1.5-*-hf, OpenGVLab/InternVL3-*-hf, google/gemma-3-*-it).
    # Not listed, though transformers gives them the same processor: qwen3_5, qwen3_5_moe, qwen4_exp
    # (Qwen3VLProcessor), vipllava (LlavaProcessor), t5gemma2, t5gemma2_encoder (Gemma3Processor).
    "qwen2-vl": Verified(("qwen2_vl",), "Qwen2VLProcessor", "a Qwen2-VL", "qwen2-vl"),
    "qwen2.5-vl": Verified(("qwen2_5_vl",), "Qwen2_5_VLProcessor", "a Qwen2.5-VL", "qwen2.5-vl"),
    "qwen3-vl": Verified(("qwen3_vl", "qwen3_vl_moe"), "Qwen3VLProcessor", "a Qwen3-VL", "qwen3-vl"),
    "llava": Verified(("llava",), "LlavaProcessor", "a LLaVA-1.5", "llava-1.5"),
    "internvl": Verified(("internvl",), "InternVLProcessor", "an InternVL3", "internvl3"),
    "gemma3": Verified(("gemma3",), "Gemma3Processor", "a Gemma 3", "gemma3"),
}


def check_model_type(family: str, config: Mapping[str, Any], where: str) -> None:
    """A folder's ``config.json`` (``config``, read from ``where``) must name a model type packstream verified for
    ``family`` (a :class:`packers.VisionFamily` value); else one line naming the file, the model type, the verified
    ones and the fix. A model type missing or not a string is refused too: the model cannot be told."""
    v = MODEL_TYPES[family]
    verified = " and ".join(v.model_types)
    kind = config.get("model_type")
    unverified = f"pass --processor {v.builtin} knowing the model is not verified"
    if not isinstance(kind, str):
        said = "has no model_type" if "model_type" not in config else f"has model_type {shown(kind)}, not a string"
        raise PackstreamError(f"{where} {said}, so the model cannot be told; packstream has verified {v.processor}'s "
                              f"packed batches only for model_type {verified}: write the model's model_type there, or "
                              f"{unverified}")
    if kind in v.model_types:
        return
    other = next((o for o in MODEL_TYPES.values() if kind in o.model_types), None)
    fix = (f"the folder's processor files are {v.processor}'s but its model is {other.model.split(' ', 1)[1]}: use the "
           f"model's own processor files, or pass --processor {other.builtin}" if other is not None else
           f"pack for {v.model} model, or {unverified}")
    raise PackstreamError(f"{where}: model_type {shown(kind)} uses {v.processor}, but packstream has verified its "
                          f"packed batches only for model_type {verified}; {fix}")
