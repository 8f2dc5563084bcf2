"""``--processor FOLDER``: nothing a folder holds is silently dropped (issue 52, part B).

Every file packstream reads from a processor folder goes through one reader (``packers/_processor_folder.py``):

* absent (no directory entry at all): the spec is built without it, as it always was;
* a regular JSON object: read;
* there but unreadable -- a FIFO, a folder, a socket, a dangling link (a Hub cache whose blob was removed), a link
  loop, JSON that is no object or no JSON -- one PackstreamError line naming the file, what it is and the fix. Before,
  ``is_file()`` skipped such a file and the pack went on at exit 0 without it.

And a ``config.json`` beside the processor files must name a model type packstream verified for the family (one
table, ``MODEL_TYPES`` in ``packers/_processor_folder.py``): a Qwen3VLProcessor folder of a Qwen3.5 model, an
InternVL folder whose model is LLaVA-NeXT, a Gemma 3 folder of a PaliGemma model are refused, each in the same
words. ``VERIFIED`` below is that table as this test expects it, held against transformers' own mappings.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packers import PackstreamError, VisionFamily, VisionSpec
from pipeline.cli import main

FILES = PRE, PROC, MODEL, VIDEO = ("preprocessor_config.json", "processor_config.json", "config.json",
                                   "video_preprocessor_config.json")
"""Every file of a processor folder packstream reads."""

# family -> (the model types packstream verified, the family's processor class, the shipped --processor name). The
# model types are transformers 5.25's names (CONFIG_MAPPING_NAMES), each the one the family's released checkpoints
# write in config.json; transformers gives the same processors to others that are not verified (qwen3_5, qwen3_5_moe,
# qwen4_exp: Qwen3VLProcessor; vipllava: LlavaProcessor; t5gemma2: Gemma3Processor).
VERIFIED = {
    "qwen2-vl": (("qwen2_vl",), "Qwen2VLProcessor", "qwen2-vl"),
    "qwen2.5-vl": (("qwen2_5_vl",), "Qwen2_5_VLProcessor", "qwen2.5-vl"),
    "qwen3-vl": (("qwen3_vl", "qwen3_vl_moe"), "Qwen3VLProcessor", "qwen3-vl"),
    "llava": (("llava",), "LlavaProcessor", "llava-1.5"),
    "internvl": (("internvl",), "InternVLProcessor", "internvl3"),
    "gemma3": (("gemma3",), "Gemma3Processor", "gemma3"),
}

# One folder per family, as its released checkpoints ship it (the same contents as tests/test_vision_config.py,
# test_vision_qwen3.py, test_vision_internvl.py and test_vision_gemma3.py write), and the model_type of its config.json.
_QWEN = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
         "image_processor_type": "Qwen2VLImageProcessor"}
FOLDERS: dict[str, dict[str, dict]] = {
    "qwen2-vl": {PRE: _QWEN | {"processor_class": "Qwen2VLProcessor"}},
    "qwen2.5-vl": {PRE: _QWEN | {"processor_class": "Qwen2_5_VLProcessor"}},
    "qwen3-vl": {PRE: {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                       "patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}},
    "llava": {PRE: {"crop_size": {"height": 336, "width": 336}, "image_processor_type": "CLIPImageProcessor",
                    "processor_class": "LlavaProcessor", "size": {"shortest_edge": 336}},
              PROC: {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
                     "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"}},
    "internvl": {PRE: {"image_processor_type": "GotOcr2ImageProcessorFast", "processor_class": "InternVLProcessor",
                       "min_patches": 1, "max_patches": 12, "size": {"height": 448, "width": 448},
                       "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]},
                 PROC: {"processor_class": "InternVLProcessor", "image_seq_length": 256}},
    "gemma3": {PRE: {"image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor",
                     "do_convert_rgb": None, "do_pan_and_scan": None, "resample": 2, "image_mean": [0.5] * 3,
                     "image_std": [0.5] * 3, "size": {"height": 896, "width": 896}, "image_seq_length": 256},
               PROC: {"processor_class": "Gemma3Processor", "image_seq_length": 256}},
}
MODEL_TYPE = {"qwen2-vl": "qwen2_vl", "qwen2.5-vl": "qwen2_5_vl", "qwen3-vl": "qwen3_vl", "llava": "llava",
              "internvl": "internvl", "gemma3": "gemma3"}


def _folder(root: Path, family: str, *, model_type: str | None = "default", video: bool = True) -> Path:
    """``family``'s folder under ``root``: its processor files, a config.json naming ``model_type`` (the family's own
    by default; None: no config.json) and, with ``video``, a video_preprocessor_config.json."""
    root.mkdir(parents=True, exist_ok=True)
    for name, content in FOLDERS[family].items():
        (root / name).write_text(json.dumps(content))
    if model_type is not None:
        (root / MODEL).write_text(json.dumps({"model_type": MODEL_TYPE[family] if model_type == "default"
                                              else model_type}))
    if video:
        (root / VIDEO).write_text(json.dumps({"max_frames": 96, "size": {"shortest_edge": 3136,
                                                                         "longest_edge": 602112}}))
    return root


def _resolve(folder: Path) -> VisionSpec:
    """What ``packstream pack --processor FOLDER --video-fps 2`` reads: the folder's video settings, then its spec."""
    VisionSpec.folder_video_settings(str(folder))
    return VisionSpec.from_processor(folder)


def _refusal(folder: Path) -> str:
    with pytest.raises(PackstreamError) as e:
        _resolve(folder)
    message = str(e.value)
    assert "\n" not in message, message
    return message


# -- worked examples ------------------------------------------------------------------------------------------------


def test_every_family_reads_with_and_without_its_config_json(tmp_path):
    for family in FOLDERS:
        assert _resolve(_folder(tmp_path / family, family)).family is VisionFamily(family)
        assert _resolve(_folder(tmp_path / f"{family}-bare", family, model_type=None, video=False)).family \
            is VisionFamily(family)  # no config.json: the processor files alone, as before


def test_a_dangling_config_json_of_a_qwen3_5_model_is_refused_not_packed_as_qwen3_vl(tmp_path):
    # The Hub cache layout: snapshots/<sha>/config.json is a link into blobs/, and the blob was removed. Before, the
    # folder packed as Qwen3-VL at exit 0, while the same config.json readable is refused (qwen3_5 is not verified).
    folder = _folder(tmp_path / "snapshot", "qwen3-vl", model_type=None)
    os.symlink("../../blobs/0123abcd", folder / MODEL)
    message = _refusal(folder)
    assert message == (f"--processor {folder / MODEL} is a link to ../../blobs/0123abcd, which does not exist, not a "
                       f"JSON file packstream can read; put the model's own config.json there as a regular file "
                       f"(download the model again), or pass a shipped --processor")
    os.remove(folder / MODEL)
    (folder / MODEL).write_text(json.dumps({"model_type": "qwen3_5"}))
    assert "model_type \"qwen3_5\" uses Qwen3VLProcessor" in _refusal(folder)


@pytest.mark.parametrize("family, model_type, words", [
    # The shape of the Qwen3-VL refusal, for every family.
    ("internvl", "llava_next", 'model_type "llava_next" uses InternVLProcessor, but packstream has verified its packed '
                               "batches only for model_type internvl; pack for an InternVL3 model, or pass --processor "
                               "internvl3 knowing the model is not verified"),
    ("gemma3", "paligemma", 'model_type "paligemma" uses Gemma3Processor, but packstream has verified its packed '
                            "batches only for model_type gemma3; pack for a Gemma 3 model"),
    ("gemma3", "t5gemma2", 'model_type "t5gemma2" uses Gemma3Processor'),     # transformers gives it Gemma3Processor
    ("llava", "vipllava", 'model_type "vipllava" uses LlavaProcessor'),        # ... and LlavaProcessor
    ("qwen3-vl", "qwen3_5_moe", "only for model_type qwen3_vl and qwen3_vl_moe; pack for a Qwen3-VL model"),
    # A model type verified for another family: the processor files are not the model's.
    ("qwen2-vl", "qwen2_5_vl", "the folder's processor files are Qwen2VLProcessor's but its model is Qwen2.5-VL: use "
                               "the model's own processor files, or pass --processor qwen2.5-vl"),
])
def test_a_model_type_not_verified_for_the_family_is_refused(tmp_path, family, model_type, words):
    message = _refusal(_folder(tmp_path, family, model_type=model_type))
    assert words in message and message.startswith(f"--processor {tmp_path / MODEL}: "), message


@pytest.mark.parametrize("config, words", [
    ({}, "has no model_type, so the model cannot be told"),
    ({"model_type": None}, "has model_type null, not a string"),
    ({"model_type": 5}, "has model_type 5, not a string"),
    ({"model_type": ["gemma3"]}, 'has model_type ["gemma3"], not a string'),
])
def test_a_config_json_without_a_string_model_type_is_refused(tmp_path, config, words):
    for family in FOLDERS:
        folder = _folder(tmp_path / family, family)
        (folder / MODEL).write_text(json.dumps(config))
        message = _refusal(folder)
        assert message.startswith(f"--processor {folder / MODEL} {words}") and "write the model's model_type" in \
            message and f"--processor {VERIFIED[family][2]} knowing" in message, message


def test_the_table_is_every_family_and_transformers_gives_each_model_type_its_processor():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    assert set(VERIFIED) == {f.value for f in VisionFamily}
    for family, (kinds, processor, builtin) in VERIFIED.items():
        for kind in kinds:
            assert kind in CONFIG_MAPPING_NAMES, kind
            assert PROCESSOR_MAPPING_NAMES[kind] == processor, (kind, PROCESSOR_MAPPING_NAMES[kind])
        assert FOLDERS[family][PRE]["processor_class"] == processor
        assert VisionSpec.builtin(builtin).family is VisionFamily(family)


# -- property tests over generated folders ---------------------------------------------------------------------------


def _fifo(path: str) -> None:
    os.mkfifo(path)


def _dangling(path: str) -> None:
    os.symlink(os.path.join(os.path.dirname(path), "blobs", "gone"), path)


def _folder_entry(path: str) -> None:
    os.mkdir(path)


def _loop(path: str) -> None:
    os.symlink(os.path.basename(path) + ".b", path)
    os.symlink(os.path.basename(path), path + ".b")


def _link_to_fifo(path: str) -> None:
    os.mkfifo(path + ".pipe")
    os.symlink(os.path.basename(path) + ".pipe", path)


def _socket(path: str) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()


def _json(text: str):
    def write(path: str) -> None:
        Path(path).write_text(text)
    return write


# Each kind of entry that is there but holds no JSON object, and the words its message must carry.
BROKEN = {
    "fifo": (_fifo, "is a FIFO (named pipe), not a JSON file"),
    "dangling link": (_dangling, "blobs/gone, which does not exist, not a JSON file"),
    "folder": (_folder_entry, "is a folder, not a JSON file"),
    "link loop": (_loop, "is a link loop"),
    "link to a fifo": (_link_to_fifo, "is a FIFO (named pipe)"),
    "socket": (_socket, "is a socket, not a JSON file"),
    "array": (_json("[1, 2]"), ": a JSON array [1, 2], expected a JSON object"),
    "string": (_json('"config"'), ': a JSON string "config", expected a JSON object'),
    "null": (_json("null"), ": null, expected a JSON object"),
    "boolean": (_json("true"), ": a JSON boolean true, expected a JSON object"),
    "number": (_json("3.5"), ": a JSON number 3.5, expected a JSON object"),
    "not json": (_json("{"), ": not valid JSON"),
    "empty": (_json(""), ": not valid JSON"),
}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(sorted(FOLDERS)), name=st.sampled_from(FILES), kind=st.sampled_from(sorted(BROKEN)),
       others=st.sets(st.sampled_from(FILES)))
def test_every_file_read_that_is_there_but_unreadable_is_one_line_naming_it(family, name, kind, others):
    """Any family's folder, any file packstream reads broken in any way (the other optional files there or not): one
    line naming the file, what it is, and a fix; never a spec built without it."""
    root = tempfile.mkdtemp(prefix="pf")  # short: a socket's path must fit in 108 bytes
    try:
        folder = _folder(Path(root) / "m", family, model_type=None if MODEL not in others else "default",
                         video=VIDEO in others)
        target = os.path.join(folder, name)
        if os.path.lexists(target):
            os.remove(target)
        make, words = BROKEN[kind]
        make(target)
        message = _refusal(folder)
        assert f"--processor {target}" in message and words in message and ";" in message, (kind, message)
    finally:
        shutil.rmtree(root)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(sorted(FOLDERS)), data=st.data())
def test_a_model_type_packs_exactly_when_verified_for_the_family(tmp_path_factory, family, data):
    """Any family, any model type transformers knows (and each verified one): the folder reads exactly when
    ``VERIFIED`` lists the type for the family, else one line in the Qwen3-VL refusal's shape."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    verified, processor, _ = VERIFIED[family]
    kind = data.draw(st.one_of(st.sampled_from(verified), st.sampled_from(sorted(CONFIG_MAPPING_NAMES))))
    folder = _folder(tmp_path_factory.mktemp("m"), family, model_type=kind, video=False)
    if kind in verified:
        assert _resolve(folder).family is VisionFamily(family)
    else:
        message = _refusal(folder)
        assert message.startswith(f"--processor {folder / MODEL}: model_type {json.dumps(kind)} uses "
                                  f"{processor}, but packstream has verified its packed batches "
                                  f"only for model_type {' and '.join(verified)}; "), message


# -- the command line ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["config.json", "processor", "preprocessor file"])
def test_pack_with_a_fifo_in_the_processor_folder_exits_with_one_line(tmp_path, where):
    """``packstream pack --processor FOLDER`` with a FIFO config.json (or the FIFO named as --processor): exit 1, one
    error line, before any record is read."""
    folder = _folder(tmp_path / "model", "qwen2-vl")
    processor = str(folder)
    if where == "config.json":
        os.remove(folder / MODEL)
        os.mkfifo(folder / MODEL)
        fifo = folder / MODEL
    elif where == "processor":
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        processor = str(fifo)
    else:
        os.remove(folder / PRE)
        os.mkfifo(folder / PRE)
        processor = fifo = folder / PRE
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
                   + "\n")
    result = CliRunner().invoke(main, ["pack", str(src), "-o", str(tmp_path / "out"), "--processor", processor, "-q"])
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"--processor {fifo} is a FIFO (named pipe)" in lines[0], result.output
    assert not (tmp_path / "out" / "manifest.json").exists()
