"""Issue 55: the model's chat template is the authority for where image tokens go.

A tokenizer whose template writes an image part itself (InternVL3-hf's writes ``<IMG_CONTEXT>\\n``): each packed
example's tokens equal ``tokenizer.apply_chat_template`` of the record's messages, image parts and all, followed by
``InternVLProcessor``'s expansion of the same images, example by example. Before, packstream wrote its own
``<img><IMG_CONTEXT></img>`` where the part was, and 7 of 9 examples differed (``...</img><img>...`` where the model's
template gives ``...</img>\\n<img>...``). A template that does not write image parts keeps packstream's placeholder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline import PackOptions
from tests._internals import Encoder
from tests.test_vision_end_to_end import _records
from tests.test_vision_internvl import (PER_TILE, SIDE, internvl_processor, preprocessor, processor_folder,
                                        tok_folder, hf_tokenizer)  # noqa: F401 - fixtures

PIL = pytest.importorskip("PIL.Image")

PARTS = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}{% if message['content'] is string %}"
         "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
         "{{ '<IMG_CONTEXT>\\n' }}{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
         "{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
         "{% endif %}")
"""InternVL3-hf's way: an image part is ``<IMG_CONTEXT>`` and a newline."""


def _as_template_sees(record: dict, root: Path) -> tuple[list[dict], list]:
    """The record's messages with image parts as transformers' chat templates take them, and its images in order."""
    msgs, images = [], []
    for m in record["messages"]:
        if isinstance(m["content"], str):
            msgs.append(m)
            continue
        parts = []
        for p in m["content"]:
            if p["type"] == "image_url":
                parts.append({"type": "image"})
                images.append(PIL.open(root / p["image_url"]["url"]).convert("RGB"))
            else:
                parts.append(p)
        msgs.append({"role": m["role"], "content": parts})
    return msgs, images


@pytest.mark.parametrize("seed", [0, 1])
def test_packed_tokens_equal_the_templates_rendering_and_the_processors_expansion(tmp_path, tok_folder, hf_tokenizer,
                                                                                 seed):
    rng = np.random.default_rng(seed)
    high = int(rng.integers(2, 6))
    low = int(rng.integers(1, high + 1))
    folder = processor_folder(tmp_path / "proc", preprocessor(SIDE, low, high), PER_TILE)
    data = _records(tmp_path, 9, seed, sides=(4, 200))
    records = [json.loads(line) for line in data.read_text().splitlines()]
    (tmp_path / "tpl.jinja").write_text(PARTS)
    enc = Encoder(PackOptions(inputs=(str(data),), tokenizer=tok_folder, processor=str(folder), chat_template=PARTS),
                  {"records.jsonl": str(tmp_path)})
    assert enc.renderer.jinja.images is not None and enc.renderer.jinja.images.written == "<IMG_CONTEXT>\n"
    out = enc.encode([(0, "records.jsonl", i + 1, r) for i, r in enumerate(records)])
    assert not out.rejected, out.rejected
    hf_tokenizer.chat_template = PARTS
    proc = internvl_processor(hf_tokenizer, SIDE, low, high, PER_TILE)
    b = out.batch
    with_images = 0
    for i, record in enumerate(records):
        msgs, images = _as_template_sees(record, tmp_path)
        text = hf_tokenizer.apply_chat_template(msgs, tokenize=False)
        want = proc(text=[text], images=images or None)["input_ids"][0]
        got = b.input_ids[b.offsets[i]:b.offsets[i + 1]].tolist()
        assert got == list(want), (i, hf_tokenizer.decode(got)[:300], hf_tokenizer.decode(want)[:300])
        with_images += bool(images)
    assert with_images >= 3  # the case under test occurs


def test_a_template_that_does_not_write_image_parts_keeps_packstreams_placeholder(tmp_path, tok_folder):
    plain = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    folder = processor_folder(tmp_path / "proc", preprocessor(SIDE, 1, 2), PER_TILE)
    enc = Encoder(PackOptions(inputs=("x.jsonl",), tokenizer=tok_folder, processor=str(folder), chat_template=plain))
    assert enc.renderer.jinja.images is None


LLAVA_FIRST = ("{% for message in messages %}{{ message['role'].upper() + ': ' }}{% if message['content'] is string %}"
               "{{ message['content'] }}{% else %}{% for c in message['content'] | selectattr('type', 'equalto', 'image') %}"
               "{{ '<image>\\n' }}{% endfor %}{% for c in message['content'] | selectattr('type', 'equalto', 'text') %}"
               "{{ c['text'] }}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}"
               "{{ 'ASSISTANT: ' }}{% endif %}")
"""LLaVA-1.5-hf's way: a message's images first, each ``<image>`` and a newline, then its text."""


def test_a_template_that_puts_images_first_is_followed(tmp_path):
    """The template, not the record, decides where an image goes: LLaVA's writes every image before the text, and
    the packed tokens equal its rendering with LlavaProcessor's expansion of ``<image>``."""
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor

    from tests.test_vision_pipeline import save_tokenizer

    tok_dir = save_tokenizer(tmp_path / "tok", ["<image>"])
    data = _records(tmp_path, 8, 3, sides=(4, 120))
    records = [json.loads(line) for line in data.read_text().splitlines()]
    enc = Encoder(PackOptions(inputs=(str(data),), tokenizer=tok_dir, processor="llava-1.5", chat_template=LLAVA_FIRST),
                  {"records.jsonl": str(tmp_path)})
    assert enc.renderer.jinja.images is not None
    out = enc.encode([(0, "records.jsonl", i + 1, r) for i, r in enumerate(records)])
    assert not out.rejected, out.rejected
    hf = AutoTokenizer.from_pretrained(tok_dir)
    hf.chat_template = LLAVA_FIRST
    proc = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 336},
                                                             crop_size={"height": 336, "width": 336}),
                          tokenizer=hf, patch_size=14, vision_feature_select_strategy="default", image_token="<image>",
                          num_additional_image_tokens=1)
    b, moved = out.batch, 0
    for i, record in enumerate(records):
        msgs, images = _as_template_sees(record, tmp_path)
        text = hf.apply_chat_template(msgs, tokenize=False)
        want = list(proc(text=[text], images=images or None)["input_ids"][0])
        got = b.input_ids[b.offsets[i]:b.offsets[i + 1]].tolist()
        assert got == want, (i, hf.decode(got)[:200], hf.decode(want)[:200])
        parts = record["messages"][0]["content"]
        moved += bool(images) and parts[0]["type"] == "text"  # an image after text in the record, first in the tokens
    assert moved >= 1  # the case under test occurs
