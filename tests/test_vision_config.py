"""``--processor FOLDER`` is read through one typed reader (``packers/_vision.py``: ``_Key``, ``_get``): a value of
the wrong type, out of range, or missing is one PackstreamError line naming the file it came from, the key, the
value as the file has it, what was expected and the fix; a valid folder gives the same spec as before.

The same goes for :meth:`VisionSpec.from_json`, which loaders call on a (maybe edited) manifest's ``vision``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from packers import PackstreamError, VisionFamily, VisionSpec

PRE, PROC = "preprocessor_config.json", "processor_config.json"
QWEN = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}
LLAVA_PRE = {"crop_size": {"height": 336, "width": 336}, "image_processor_type": "CLIPImageProcessor",
             "processor_class": "LlavaProcessor", "size": {"shortest_edge": 336}}
LLAVA_PROC = {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
              "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"}


def _folder(root: Path, pre: dict | None, proc: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, config in ((PRE, pre), (PROC, proc)):
        if config is not None:
            (root / name).write_text(json.dumps(config))
    return root


def _refusal(folder: Path) -> str:
    """The one-line message reading ``folder`` ends with (any other exception fails the test)."""
    with pytest.raises(PackstreamError) as e:
        VisionSpec.from_processor(folder)
    message = str(e.value)
    assert "\n" not in message, message
    return message


# Each bad value: what the file holds, and the words the message must carry. The file named is the one the value
# is in; the value is shown as the JSON file has it (true, null, "two", 1e+30).
QWEN_BAD = [
    ({"merge_size": "two"}, 'merge_size is "two", expected an integer in 1..64'),
    ({"patch_size": 0}, "patch_size is 0, expected an integer in 1..1024"),
    ({"patch_size": 2048}, "patch_size is 2048, expected an integer in 1..1024"),  # absurd: refused by range
    ({"patch_size": True}, "patch_size is true, expected an integer"),             # a bool is not an int
    ({"patch_size": 14.5}, "patch_size is 14.5, expected an integer"),
    ({"patch_size": None}, "patch_size is null, expected an integer"),             # only min/max pixels may be null
    ({"patch_size": "14"}, 'patch_size is "14", expected an integer'),
    ({"min_pixels": -5}, "min_pixels is -5, expected an integer in 1..1073741824"),
    ({"min_pixels": 1e30}, "min_pixels is 1e+30, expected an integer in 1..1073741824"),
    ({"max_pixels": [1]}, "max_pixels is [1], expected an integer"),
    ({"temporal_patch_size": {}}, "temporal_patch_size is {}, expected an integer in 1..64"),
    ({"min_pixels": None, "size": {"shortest_edge": "x"}}, 'size.shortest_edge is "x", expected an integer'),
    ({"size": "big"}, 'size is "big", expected an object'),
    ({"size": 336}, "size is 336, expected an object"),     # transformers' Qwen2VLImageProcessor refuses it too
    ({"min_pixels": 10, "max_pixels": 5}, "min_pixels 10 is over max_pixels 5, expected min_pixels <= max_pixels"),
    ({"min_pixels": 20_000_000, "max_pixels": None},
     "min_pixels 20000000 is over the default max_pixels 1003520"),
    ({"image_processor_type": 5}, "image_processor_type is 5, expected a string"),
]


@pytest.mark.parametrize("change, words", QWEN_BAD)
def test_a_bad_qwen_value_is_one_line_naming_file_key_and_value(tmp_path, change, words):
    message = _refusal(_folder(tmp_path, {**QWEN, **change}))
    assert message.startswith(f"--processor {tmp_path / PRE}: ") and words in message, message
    assert message.endswith("fix the value or pass a shipped spec: --processor qwen2-vl"), message


DROP = object()
"""In a change: leave the key out."""

LLAVA_BAD = [  # (file, change, words)
    (PRE, {"crop_size": [1]}, "crop_size is [1], expected an object or an integer in 1..32768"),
    (PRE, {"crop_size": {"height": "336"}}, 'crop_size.height is "336", expected an integer in 1..32768'),
    (PRE, {"crop_size": {"height": None}}, "crop_size.height is null, expected an integer"),
    (PRE, {"crop_size": 10 ** 6}, "crop_size is 1000000, expected an object or an integer in 1..32768"),
    (PRE, {"crop_size": {"height": 8}, "size": DROP}, "crop_size.height 8 is under patch_size 14 (in --processor"),
    (PRE, {"size": {"shortest_edge": False}, "crop_size": DROP}, "size.shortest_edge is false, expected an integer"),
    (PROC, {"num_additional_image_tokens": "1"}, 'num_additional_image_tokens is "1", expected an integer in 0..1024'),
    (PROC, {"vision_feature_select_strategy": "first"},
     'vision_feature_select_strategy is "first", expected one of "default", "full"'),
    (PROC, {"vision_feature_select_strategy": None}, "vision_feature_select_strategy is null"),
    (PROC, {"image_token": ""}, 'image_token is "", expected a string of 1..256 characters'),
    (PROC, {"image_token": 32000}, "image_token is 32000, expected a string"),
    (PROC, {"patch_size": 14.5}, "patch_size is 14.5, expected an integer in 1..1024"),
    (PROC, {"image_processor": {"patch_size": "x"}, "patch_size": DROP},  # the nested key, named as written
     'image_processor.patch_size is "x"'),
]


@pytest.mark.parametrize("where, change, words", LLAVA_BAD)
def test_a_bad_llava_value_names_the_file_it_is_in(tmp_path, where, change, words):
    pre, proc = dict(LLAVA_PRE), dict(LLAVA_PROC)
    changed = {**(pre if where == PRE else proc), **change}
    changed = {k: v for k, v in changed.items() if v is not DROP}
    pre, proc = (changed, proc) if where == PRE else (pre, changed)
    message = _refusal(_folder(tmp_path, pre, proc))
    assert message.startswith(f"--processor {tmp_path / where}: ") and words in message, message
    assert message.endswith("fix the value or pass a shipped spec: --processor llava-1.5"), message


def test_a_llava_folder_without_a_side_is_refused_naming_both_keys(tmp_path):
    pre = {k: v for k, v in LLAVA_PRE.items() if k not in ("crop_size", "size")}
    message = _refusal(_folder(tmp_path, pre, LLAVA_PROC))
    assert message.startswith(f"--processor {tmp_path / PRE}: no side for the square images are resized to "
                              "(crop_size absent, size absent), expected crop_size.height or size.shortest_edge")
    # Where a key is there but gives no side, the message says which file holds it.
    message = _refusal(_folder(tmp_path, pre, {**LLAVA_PROC, "image_processor": {"size": {"longest_edge": 9}}}))
    assert (f'(crop_size absent, image_processor.size {{"longest_edge": 9}} in --processor {tmp_path / PROC})'
            in message), message


def test_valid_folders_read_as_before(tmp_path):
    """What the old reader accepted and this one keeps: whole floats (14.0, as int() read them), null pixels falling
    back to ``size`` (as transformers writes them), an integer crop_size (CLIP's older form), nested settings."""
    qwen = VisionSpec.builtin("qwen2-vl")
    as_read = lambda folder, spec: dataclasses.replace(spec, name=str(folder))  # noqa: E731
    cases = [
        ({**QWEN, "patch_size": 14.0, "max_pixels": 12845056.0}, None, qwen),
        ({**QWEN, "min_pixels": None, "max_pixels": None, "size": {"shortest_edge": 3136, "longest_edge": 12845056}},
         None, qwen),
        ({k: v for k, v in QWEN.items() if k not in ("min_pixels", "max_pixels", "size")}, None,
         dataclasses.replace(qwen, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)),
        ({"image_processor_type": "Qwen2VLImageProcessor", "size": None}, {"image_processor": {"merge_size": 1}},
         dataclasses.replace(qwen, merge_size=1, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)),
        ({**LLAVA_PRE, "crop_size": 336}, LLAVA_PROC, VisionSpec.builtin("llava-1.5")),
        ({**LLAVA_PRE, "crop_size": None}, {**LLAVA_PROC, "vision_feature_select_strategy": "full"},
         dataclasses.replace(VisionSpec.builtin("llava-1.5"), extra_tokens=1)),
        ({k: v for k, v in LLAVA_PRE.items() if k != "crop_size"} | {"size": 224}, {},
         dataclasses.replace(VisionSpec.builtin("llava-1.5"), image_size=224)),  # an int size: shortest_edge
    ]
    for i, (pre, proc, want) in enumerate(cases):
        folder = _folder(tmp_path / str(i), pre, proc)
        assert VisionSpec.from_processor(folder) == as_read(folder, want), i


# --- VisionSpec.from_json: a manifest's spec read back ----------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    ({"patch_size": "two"}, 'vision spec: patch_size is "two", expected an integer in 1..1024'),
    ({"extra_tokens": True}, "vision spec: extra_tokens is true, expected an integer in -1..1024"),
    ({"family": "qwen9"}, 'vision spec: family is "qwen9", expected one of "qwen2-vl", "qwen2.5-vl", "qwen3-vl", "llava"'),
    ({"family": None}, "vision spec: family is null"),
    ({"image_token": None}, "vision spec: image_token is null"),
    ({"vision_start": 7}, "vision spec: vision_start is 7, expected a string"),
    ({"min_pixels": 1e40}, "vision spec: min_pixels is 1e+40, expected an integer in 1..1073741824"),
])
def test_a_damaged_stored_spec_is_one_line(change, words):
    text = json.dumps({**json.loads(VisionSpec.builtin("qwen2-vl").to_json()), **change})
    with pytest.raises(PackstreamError) as e:
        VisionSpec.from_json(text)
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)
    assert str(e.value).endswith("the run's vision spec was edited or damaged; pack the data again")


@pytest.mark.parametrize("text, words", [
    ("[1, 2]", "vision spec: [1, 2] is not a JSON object"),
    ("{", "vision spec: not valid JSON"),
    ('{"patch_size": 14}', "vision spec: family is missing, expected one of"),
    ('{"family": "llava", "colour": 1}', "vision spec has unknown fields ['colour']"),
])
def test_a_stored_spec_that_is_no_spec_is_one_line(text, words):
    with pytest.raises(PackstreamError) as e:
        VisionSpec.from_json(text, what="vision spec")
    assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


def test_stored_specs_round_trip_and_old_manifests_still_read():
    for name in ("qwen2-vl", "qwen2.5-vl", "llava-1.5"):
        spec = VisionSpec.builtin(name)
        assert VisionSpec.from_json(spec.to_json()) == spec
        assert VisionSpec.from_json(spec.to_json().encode()) == spec
    # A field left out takes the dataclass's default, as before.
    assert VisionSpec.from_json('{"family": "qwen2-vl"}') == VisionSpec(family=VisionFamily.QWEN2_VL)


# --- The property: any value in any key, in any of the files ---------------------------------------------------

def _legacy(config: dict[str, Any], name: str) -> VisionSpec:
    """The reader before this one (``int(...)`` of whatever was there), as the oracle for valid folders. One
    deliberate difference is applied before it: an integer ``size`` in a CLIP config is its shortest edge (as
    transformers reads it); the old reader ignored it."""
    kind = str(config.get("image_processor_type") or "")
    model = str(config.get("processor_class") or "")
    size = config.get("size") if isinstance(config.get("size"), dict) else {}
    if kind == "Qwen2VLImageProcessor":
        family = {"": VisionFamily.QWEN2_VL, "Qwen2VLProcessor": VisionFamily.QWEN2_VL,
                  "Qwen2_5_VLProcessor": VisionFamily.QWEN2_5_VL}[model]
        return VisionSpec(
            family=family, name=name,
            patch_size=int(config.get("patch_size", 14)), merge_size=int(config.get("merge_size", 2)),
            temporal_patch_size=int(config.get("temporal_patch_size", 2)),
            min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280))
    if isinstance(config.get("size"), (int, float)) and not isinstance(config.get("size"), bool):
        size = {"shortest_edge": config["size"]}
    crop = config.get("crop_size", {})
    side = int(crop.get("height", 0) if isinstance(crop, dict) else crop or 0) or int(size.get("shortest_edge", 0))
    strategy = config.get("vision_feature_select_strategy", "default")
    extra = int(config.get("num_additional_image_tokens", 1)) - (1 if strategy == "default" else 0)
    return VisionSpec(family=VisionFamily.LLAVA, name=name, patch_size=int(config.get("patch_size", 14)),
                      merge_size=1, temporal_patch_size=1, image_size=side, extra_tokens=extra,
                      image_token=str(config.get("image_token", "<image>")), vision_start=None, vision_end=None)


_ABSENT = object()
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10 ** 12) | st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(1, 400).map(float) | st.text(max_size=6) | st.sampled_from(["14", "default", "full", "<image>"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["height", "width", "shortest_edge", "longest_edge", "x"]), inner, max_size=3),
    max_leaves=6)


def _maybe(value):
    return st.just(_ABSENT) | value


@st.composite
def _valid_qwen(draw) -> dict[str, Any]:
    size = draw(_maybe(st.fixed_dictionaries({}, optional={"shortest_edge": st.integers(1, 10 ** 6),
                                                           "longest_edge": st.integers(10 ** 6, 10 ** 8)})) | st.none())
    return {"image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": draw(_maybe(st.sampled_from(["Qwen2VLProcessor", "Qwen2_5_VLProcessor", ""]))),
            "patch_size": draw(_maybe(st.integers(1, 64))), "merge_size": draw(_maybe(st.integers(1, 4))),
            "temporal_patch_size": draw(_maybe(st.integers(1, 4))),
            "min_pixels": draw(_maybe(st.integers(1, 10 ** 6) | st.none())),
            "max_pixels": draw(_maybe(st.integers(10 ** 6, 10 ** 8) | st.none())), "size": size}


@st.composite
def _valid_llava(draw) -> dict[str, Any]:
    side = st.integers(32, 1000)
    crop = draw(_maybe(side | st.fixed_dictionaries({"height": side, "width": side}) | st.none()))
    size = draw(st.fixed_dictionaries({"shortest_edge": side}) if crop in (_ABSENT, None)
                else _maybe(st.fixed_dictionaries({"shortest_edge": side})))
    return {"image_processor_type": "CLIPImageProcessor",
            "processor_class": draw(_maybe(st.sampled_from(["LlavaProcessor", ""]))),
            "patch_size": draw(_maybe(st.integers(1, 32))), "crop_size": crop, "size": size,
            "num_additional_image_tokens": draw(_maybe(st.integers(0, 2))),
            "vision_feature_select_strategy": draw(_maybe(st.sampled_from(["default", "full"]))),
            "image_token": draw(_maybe(st.text(min_size=1, max_size=10)))}


@st.composite
def _case(draw):
    """A valid config, each key put in one of the three places a folder can hold it, and maybe one key (not the
    processor's type or class) given a random JSON value instead."""
    config = {k: v for k, v in draw(_valid_qwen() | _valid_llava()).items() if v is not _ABSENT}
    keys = sorted(set(config) - {"image_processor_type", "processor_class"}) + ["patch_size"]
    bad = draw(st.none() | st.sampled_from(keys))
    if bad is not None:
        config[bad] = draw(_JSON | st.fixed_dictionaries({}, optional={"height": _JSON, "shortest_edge": _JSON,
                                                                       "longest_edge": _JSON}))
    places = {k: (PRE if k == "image_processor_type" else draw(st.sampled_from([PRE, PROC, "nested"])))
              for k in config}
    return config, places, bad


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_case())
def test_any_value_in_any_key_is_the_old_spec_or_one_line_naming_file_and_key(tmp_path_factory, case):
    config, places, bad = case
    folder = tmp_path_factory.mktemp("proc")
    pre = {k: v for k, v in config.items() if places[k] == PRE}
    proc = {k: v for k, v in config.items() if places[k] == PROC}
    nested = {k: v for k, v in config.items() if places[k] == "nested"}
    _folder(folder, pre, {**proc, "image_processor": nested} if proc or nested else None)
    try:
        spec = VisionSpec.from_processor(folder)
    except PackstreamError as e:
        message = str(e)
        event("refused")
        assert bad is not None, f"a valid config was refused: {message}"
        assert "\n" not in message and bad in message, message
        file = folder / (PRE if places[bad] == PRE else PROC)
        assert f"--processor {file}" in message, message
        assert ("image_processor." + bad in message) == (places[bad] == "nested"), message
        return
    event("read" if bad is None else "read, with a random value that passed")
    assert spec == _legacy(config, str(folder))


# --- Through the command line -----------------------------------------------------------------------------------

def test_pack_with_a_bad_processor_folder_prints_one_error_line(tmp_path):
    from pipeline.cli import main

    proc = _folder(tmp_path / "proc", {**QWEN, "merge_size": "two"})
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    result = CliRunner().invoke(main, ["pack", str(data), "--processor", str(proc), "-o", str(tmp_path / "out"), "-q"])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert "Traceback" not in result.output
    assert len(lines) == 1 and lines[0].startswith("error: --processor ") and PRE in lines[0], result.output
    assert 'merge_size is "two", expected an integer in 1..64' in lines[0], result.output
    assert not (tmp_path / "out" / "manifest.json").exists()


_QWEN25 = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
           "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
           "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
           "do_rescale": True, "do_normalize": True, "do_resize": True, "resample": 3,
           "rescale_factor": 0.00392156862745098, "do_convert_rgb": True}  # Qwen/Qwen2.5-VL-7B-Instruct's, as shipped
_LLAVA = {"image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor", "crop_size":
          {"height": 336, "width": 336}, "size": {"shortest_edge": 336}, "do_center_crop": True, "resample": 3,
          "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}


@pytest.mark.parametrize("config, change, refused", [
    (_QWEN25, {}, None),
    (_QWEN25, {"image_mean": None, "image_std": None}, None),  # the class default: CLIP's, as the loader's
    (_QWEN25, {"image_mean": [0.5, 0.5, 0.5]}, "image_mean is [0.5, 0.5, 0.5], expected [0.48145466"),
    (_QWEN25, {"do_normalize": False}, "do_normalize is false, expected true (qwen2.5-vl's"),
    (_QWEN25, {"resample": 2}, "resample is 2, expected 3"),
    ({**_QWEN25, "processor_class": "Qwen3VLProcessor", "patch_size": 16}, {}, "image_mean is [0.48145466"),
    ({**_QWEN25, "processor_class": "Qwen3VLProcessor", "patch_size": 16}, {"image_mean": None},
     "image_mean is absent (its class default is another), expected [0.5, 0.5, 0.5]"),
    ({**_QWEN25, "processor_class": "Qwen3VLProcessor", "patch_size": 16},
     {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}, None),
    (_LLAVA, {}, None),
    (_LLAVA, {"do_center_crop": False}, "do_center_crop is false, expected true (LLaVA-1.5's"),
    (_LLAVA, {"image_std": [0.5, 0.5, 0.5]}, "image_std is [0.5, 0.5, 0.5]"),
])
def test_pixel_settings_the_loader_does_not_reproduce_are_refused(tmp_path, config, change, refused):
    """The loader builds each family's transformers processor with its own pixel settings: a config with others
    (another mean, no normalization, another resampler) would train on pixels the model's processor never makes, so
    it is refused in one line naming the file, the key, both values and how to load such pixels."""
    data = {**config, **change}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({k: v for k, v in data.items() if v is not None}))
    if refused is None:
        assert VisionSpec.from_processor(tmp_path).name == str(tmp_path)
        return
    with pytest.raises(PackstreamError) as e:
        VisionSpec.from_processor(tmp_path)
    assert refused in str(e.value) and "PixelLoader(vision=ds.vision, processor=" in str(e.value)
    assert "\n" not in str(e.value) and str(tmp_path / "preprocessor_config.json") in str(e.value)
