"""Rendering: a :class:`Conversation` -> segments of text, each all training target or all context.

A conversation is rendered into *segments*; the encoder (``pipeline._encode``) tokenizes each on
its own (``add_special_tokens=False``) and concatenates the ids, so the mask is exact at every
boundary, and the boundary before an assistant turn is exactly where inference starts
generating. With the built-in ChatML template::

    segment  "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"   context  -> mask 0
    segment  "Hello!<|im_end|>"   (trailing whitespace after the last turn dropped)   target -> mask 1
    eos      "<｜end▁of▁sentence｜>" (the tokenizer's EOS, appended by the encoder)   target -> mask 1

Which turns are targets: a turn's own flag (``loss_weight``/``train``/``training``) when the
record has one, else assistant turns (every turn with ``--train-on all``). A target assistant
turn trains its reasoning block, its answer, its tool calls and its end-of-turn token; with
``--mask-reasoning`` the reasoning block is context. The generation prompt before it
(``<|im_start|>assistant\\n``) is context.

Templates: the tokenizer's own chat template when it has one, else the built-in ChatML
(``templates/chatml.jinja``, rendered here without Jinja for speed; a test keeps both equal),
or ``--chat-template FILE``. Reasoning renders through the template's own thinking block
(``reasoning_content``/``thinking``); the built-in ChatML writes ``<think>\\n...\\n</think>\\n\\n``
before the answer. Tool calls render through the template with ``tools``; the built-in ChatML
writes the tool definitions as JSON in the system turn and each call as
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``. A template that does not render
reasoning, tool calls or tool definitions (found once, by probing it) gets them written into the
turn's text the built-in way, so nothing a record holds is silently left out.

Jinja templates run only in transformers' sandboxed environment (``ImmutableSandboxedEnvironment``,
no attribute escapes, no file access), compiled with ``*`` and ``**`` guarded, and each record's
rendering is bounded: output size (:data:`TEMPLATE_MAX_CHARS` plus 8 characters per input
character) and time (:data:`TEMPLATE_SECONDS`: every block of template code checks its thread's deadline,
see :func:`time_limit`). A record that hits a bound is dead-lettered as
``template_limit``. Assistant spans are found by rendering prefixes:
``render(messages[:i], add_generation_prompt=True)`` must be a prefix of the full rendering;
templates that rewrite earlier turns are refused with a clear reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
import threading
import time
from importlib import resources
from typing import Any, Optional

from packers import PackstreamError
from pipeline._formats import TRL_CONVERSATIONS, Conversation, Reason, Rejected, Video, target_flags
from pipeline._image_parts import ImageParts, content_text as _content_text
from pipeline._options import Eos, FormatOptions, PackOptions, TrainOn, Turns

Segments = list[tuple[str, bool]]  # (text, is_target)

BUILTIN_CHATML = resources.files("pipeline").joinpath("templates/chatml.jinja").read_text(encoding="utf-8")

TEMPLATE_SECONDS = 10.0
"""Wall-clock bound on rendering one record through a Jinja template (all its prefixes)."""
TEMPLATE_MAX_CHARS = 1 << 20
"""Bound on one rendering's size: this many characters plus 8 per character of the record's text."""


from pipeline._tokenizer import default_tokenizer_path, load_tokenizer, tokenizer_identity  # noqa: E402,F401 - re-exported


# ------------------------------------------------------------------------------------------------
# The built-in ChatML, without Jinja.


def think_block(reasoning: str) -> str:
    """The built-in ChatML's thinking block, written before the answer (Qwen3/DeepSeek-R1 style)."""
    return "<think>\n" + reasoning + "\n</think>\n\n"


def tool_calls_text(content: str, calls: Optional[list]) -> str:
    """Tool calls the built-in way (Hermes/Qwen2.5): one ``<tool_call>`` block of JSON each, after the text."""
    out = ""
    for k, call in enumerate(calls or ()):
        fn = call["function"]
        body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
        out += ("\n" if k or content else "") + "<tool_call>\n" + body + "\n</tool_call>"
    return out


def tools_text(tools: list) -> str:
    return "# Tools\n" + json.dumps(tools, ensure_ascii=False)


def chatml_segments(conv: Conversation, targets: list[bool], mask_reasoning: bool = False) -> Segments:
    """The built-in ChatML template, as segments. Same text as ``templates/chatml.jinja``."""
    msgs = conv.messages
    segs: Segments = []
    start = 0
    if conv.tools or (msgs and msgs[0]["role"] == "system"):
        text = "<|im_start|>system\n"
        if msgs and msgs[0]["role"] == "system":
            text += msgs[0]["content"] + ("\n\n" if conv.tools else "")
            start = 1
        if conv.tools:
            text += tools_text(conv.tools)
        segs.append((text + "<|im_end|>\n", bool(start and targets[0])))
    for m, target in zip(msgs[start:], targets[start:]):
        header = f"<|im_start|>{m['role']}\n"
        body = m["content"] + tool_calls_text(m["content"], m.get("tool_calls")) + "<|im_end|>\n"
        if m["role"] != "assistant" or not target:
            segs.append((header + (think_block(m["reasoning"]) if m.get("reasoning") else "") + body, target))
            continue
        segs.append((header, False))
        if m.get("reasoning"):
            segs.append((think_block(m["reasoning"]), not mask_reasoning))
        segs.append((body, True))
    return segs


# ------------------------------------------------------------------------------------------------
# Bounds on Jinja templates: output size, `*`/`**` sizes, and time (a deadline every block of template code checks).


class TemplateTimeout(BaseException):
    """Raised by template code that runs past its thread's deadline. A BaseException, so no ``except Exception``
    inside a template library can swallow it."""


class _Deadline(threading.local):
    at: float = math.inf
    """When template code running in this thread must stop (``time.monotonic()``); inf outside :func:`time_limit`."""


_DEADLINE = _Deadline()


@contextlib.contextmanager
def time_limit(seconds: float):
    """Bound the chat-template code this thread runs inside the block to ``seconds`` (nested blocks keep the sooner).

    Nothing runs beside it and nothing is injected into a thread: templates are compiled (:func:`compile_template`)
    so that every block they run -- each loop iteration, macro call, branch taken -- first calls :func:`_tick`,
    which raises :class:`TemplateTimeout` in the thread running the template once its deadline has passed. Code
    outside a template never raises it, so a deadline cannot land anywhere but inside the guarded render.
    """
    outer = _DEADLINE.at
    _DEADLINE.at = min(outer, time.monotonic() + seconds)
    try:
        yield
    finally:
        _DEADLINE.at = outer


def _tick() -> None:
    if time.monotonic() > _DEADLINE.at:
        raise TemplateTimeout


@functools.cache
def _bounded_code_generator() -> type:
    """Jinja's code generator, with a deadline check (:func:`_tick`) at the top of every block it writes: a loop's
    body, a macro's body, a branch. Jinja has no other way to repeat work, so no template outruns its deadline by
    more than one block's straight-line code (bounded by the output and ``*``/``**`` limits). Imported on first
    use: a run with the built-in ChatML never loads Jinja."""
    from jinja2.compiler import CodeGenerator

    class BoundedCodeGenerator(CodeGenerator):
        def blockvisit(self, nodes, frame) -> None:
            self.writeline("environment.packstream_tick()")
            super().blockvisit(nodes, frame)

    return BoundedCodeGenerator


class _TooBig(Exception):
    pass


@functools.lru_cache(maxsize=8)
def compile_template(source: str):
    """A chat template compiled in transformers' sandboxed Jinja environment, with ``*`` and ``**`` guarded."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    env = _compile_jinja_template("").environment.overlay()  # the same sandbox, filters and globals
    env.code_generator_class = _bounded_code_generator()
    env.packstream_tick = _tick
    env.intercepted_binops = frozenset({"*", "**"})

    def call_binop(context, operator, left, right):
        if operator == "*" and isinstance(right, int) and isinstance(left, (str, list, tuple)) or \
                operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
            n, seq = (right, left) if isinstance(right, int) else (left, right)
            if n * len(seq) > TEMPLATE_MAX_CHARS * 16:
                raise _TooBig(f"'*' would build {n * len(seq):,} items")
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(right) > 4096:
            raise _TooBig(f"'**' with exponent {right:,}")
        return env.binop_table[operator](left, right)

    env.call_binop = call_binop
    return env.from_string(source)


# ------------------------------------------------------------------------------------------------
# Any Jinja chat template.


_PROBE_USER = {"role": "user", "content": "packstream probe question"}
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")  # as transformers finds the blocks


class JinjaTemplate:
    """One chat template: sandboxed, bounded, and probed once for what it renders."""

    def __init__(self, source: str, special_tokens: dict[str, Any]):
        self.source = source
        self.kwargs = dict(special_tokens)
        self.compiled = compile_template(source)
        self.images: Optional[ImageParts] = None
        """Set by the renderer of a ``--processor`` run whose template writes image parts (:func:`image_parts`)."""
        self.generation = _GENERATION.search(source) is not None
        """The template marks the assistant's text with ``{% generation %}`` blocks (TRL's ``assistant_only_loss``)."""
        self._check_ends()
        self.reasoning = self._renders("zq7reasoning", [_PROBE_USER, {
            "role": "assistant", "content": "answer", "reasoning_content": "zq7reasoning", "thinking": "zq7reasoning"}])
        call = {"type": "function", "function": {"name": "zq7call", "arguments": {"x": 1}}}
        self.tool_calls = self._renders("zq7call", [_PROBE_USER, {"role": "assistant", "content": "", "tool_calls": [call]}])
        tool = {"type": "function", "function": {"name": "zq7tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        self.tools = self._renders("zq7tool", [_PROBE_USER], tools=[tool])

    def _check_ends(self) -> None:
        """A template that cannot render the smallest conversation in time would time out on every record (1,000
        records would take hours): that is one launch error, found by one probe."""
        probe = [_PROBE_USER, {"role": "assistant", "content": "packstream probe answer"}]
        try:
            with time_limit(TEMPLATE_SECONDS):
                self.render(probe, None, False, TEMPLATE_MAX_CHARS)
        except TemplateTimeout:
            raise PackstreamError(
                f"the chat template did not finish rendering a two-message probe conversation in {TEMPLATE_SECONDS:g} s "
                "(a loop that never ends?), so every record would time out; fix the template, or pass --chat-template "
                "FILE with one that only lays out the turns") from None
        except Rejected:  # the template refuses the probe (it wants a system turn, ...): records will tell
            pass

    def _renders(self, needle: str, messages: list, tools=None) -> bool:
        """Does the template show ``needle``? If the probe itself fails, assume it does (records will tell)."""
        try:
            with time_limit(TEMPLATE_SECONDS):
                return needle in self.render(messages, tools, False, TEMPLATE_MAX_CHARS)
        except (Rejected, TemplateTimeout):
            return True

    def render_generation(self, messages: list, tools: Optional[list], cap: int) -> tuple[str, list[tuple[int, int]]]:
        """The rendering of ``messages`` and the ``[start, end)`` character spans of its ``{% generation %}``
        blocks, tracked as transformers tracks them (its ``AssistantTracker``)."""
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        with self.compiled.environment.activate_tracker(out, spans):
            self.render(messages, tools, False, cap, out=out)
        return "".join(out), spans  # as written (its spans index it): generation_segments processes each segment

    def render(self, messages: list, tools: Optional[list], gen: bool, cap: int, out: Optional[list] = None) -> str:
        out = [] if out is None else out
        size = 0
        try:
            for chunk in self.compiled.generate(messages=messages, tools=tools, documents=None,
                                                add_generation_prompt=gen, **self.kwargs):
                size += len(chunk)
                if size > cap:
                    raise _TooBig(f"it produced more than {cap:,} characters")
                out.append(chunk)
        except _TooBig as e:
            raise Rejected(Reason.TEMPLATE_LIMIT, f"the chat template is unbounded for this record: {e}; a chat "
                                                  "template should only lay out the turns") from None
        except Exception as e:  # jinja2 errors, raise_exception() from inside the template, type errors
            msg = str(e).splitlines()[0][:300] if str(e) else ""
            raise Rejected(Reason.TEMPLATE_ERROR, f"chat template failed: {type(e).__name__}: {msg}") from None
        text = "".join(out)
        return text if self.images is None else self.images.processed(text)


def image_parts(tpl: "JinjaTemplate", spec: Any) -> Optional[ImageParts]:
    """:class:`~pipeline._image_parts.ImageParts` of a template that writes image parts with the processor's image
    token, found by rendering one probe message (None: packstream writes each image's placeholder text)."""
    if spec is None:
        return None
    try:
        with time_limit(TEMPLATE_SECONDS):
            return ImageParts.probed(tpl.render(ImageParts.PROBE, None, False, TEMPLATE_MAX_CHARS),
                                     tpl.render(ImageParts.PLAIN, None, False, TEMPLATE_MAX_CHARS), spec)
    except (Rejected, TemplateTimeout):
        return None


def _inline(conv: Conversation, tpl: JinjaTemplate) -> tuple[list[dict], list[Optional[dict]], Optional[list]]:
    """The conversation as the template sees it, and each message without its reasoning (None: it has none).

    What the template cannot render (found by :class:`JinjaTemplate`'s probes) is written into the
    text the built-in way: reasoning as a ``<think>`` block, tool calls as ``<tool_call>`` JSON, tool
    definitions as JSON in the system turn.
    """
    msgs, plain = [], []
    for m in conv.messages:
        out = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls"):
            if tpl.tool_calls:
                out["tool_calls"] = m["tool_calls"]
            else:
                out["content"] += tool_calls_text(out["content"], m["tool_calls"])
        for k in ("name", "tool_call_id"):
            if k in m:
                out[k] = m[k]
        plain.append(dict(out) if m.get("reasoning") else None)
        if m.get("reasoning"):
            if tpl.reasoning:
                out["reasoning_content"] = out["thinking"] = m["reasoning"]
            else:
                out["content"] = think_block(m["reasoning"]) + out["content"]
        if tpl.images is not None and tpl.images.placeholder in out["content"]:  # the template writes the images
            out["content"] = tpl.images.parts(out["content"])
        msgs.append(out)
    tools = conv.tools
    if tools and not tpl.tools:
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + tools_text(tools)}
        else:
            msgs.insert(0, {"role": "system", "content": tools_text(tools)})
            plain.insert(0, None)
        tools = None
    return msgs, plain, tools


_CLOSING_TAG = re.compile(r"\s*</[A-Za-z_][\w-]*>\s*")


def _common_suffix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(reversed(a), reversed(b)):
        if x != y:
            break
        n += 1
    return n


def _check_rendered(final: str, msgs: list[dict], tools: Optional[list]) -> None:
    """Nothing the record holds may vanish in the template: every turn's text (trimmed, as templates
    often trim it), reasoning, tool call and tool definition must show in the rendering. A template
    that drops system turns, or earlier turns' reasoning, is caught here, per record."""
    def missing(where: str, what: str) -> Rejected:
        return Rejected(Reason.TEMPLATE_ERROR, f"the chat template leaves out {where} ({what}); the record would "
                                               "train without it. Use --chat-template FILE with a template that "
                                               "renders every turn (or drop that part from the data)")
    def shown(text: str) -> bool:  # as is, or as a JSON string (templates that write tool results with tojson)
        return text in final or json.dumps(text, ensure_ascii=False)[1:-1] in final or json.dumps(text)[1:-1] in final

    for i, m in enumerate(msgs):
        text = _content_text(m["content"]).strip()
        if text and not shown(text):
            raise missing(f"messages[{i}] (role {m['role']})", f"{len(text):,} characters of text")
        reasoning = (m.get("reasoning_content") or "").strip()
        if reasoning and not shown(reasoning):
            raise missing(f"the reasoning of messages[{i}]", f"{len(reasoning):,} characters")
        for call in m.get("tool_calls") or ():
            name = (call.get("function") or {}).get("name") if isinstance(call, dict) else None
            if isinstance(name, str) and name and name not in final:
                raise missing(f"a tool call of messages[{i}]", f"function {name!r}")
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str) and name and name not in final:
            raise missing("a tool definition", f"function {name!r}")


def template_segments(tpl: JinjaTemplate, conv: Conversation, targets: list[bool], mask_reasoning: bool) -> Segments:
    """Segments of any Jinja chat template, found by rendering prefixes."""
    msgs, plain, tools = _inline(conv, tpl)
    everything = all(targets)
    if len(msgs) != len(conv.messages):  # tool definitions became a system turn of their own
        targets = [False] + targets
    cap = _cap(conv, msgs, tools)

    def render(upto: int, gen: bool, last: Optional[dict] = None) -> str:
        part = msgs[:upto] if last is None else msgs[:upto] + [last]
        return tpl.render(part, tools, gen, cap) if part else ""

    final = render(len(msgs), False)
    _check_rendered(final, msgs, tools)
    if everything:
        return [(final, True)]

    def inconsistent(i: int) -> Rejected:
        return Rejected(Reason.TEMPLATE_ERROR, f"the chat template is not prefix-consistent at messages[{i}] (it "
                        "rewrites earlier turns, e.g. drops their reasoning), so the target spans cannot be located; "
                        "use --chat-template with a template that appends turns")

    segs: Segments = []
    done = 0
    for i, m in enumerate(msgs):
        if not targets[i]:
            continue
        head = render(i, gen=m["role"] == "assistant")
        upto = render(i + 1, False)
        if not (final.startswith(head) and final.startswith(upto)) or len(head) < done:
            raise inconsistent(i)
        cut = len(head)
        if mask_reasoning and m["role"] == "assistant" and plain[i] is not None:
            alt = render(i, False, plain[i])
            if not alt.startswith(head):
                raise inconsistent(i)
            span = final[len(head):len(upto)]
            end = len(span) - _common_suffix(span, alt[len(head):])
            close = _CLOSING_TAG.match(span, end)
            cut += close.end() if close else end
        segs.append((final[done:len(head)], False))
        if cut > len(head):
            segs.append((final[len(head):cut], False))
        segs.append((final[cut:len(upto)], True))
        done = len(upto)
    segs.append((final[done:], False))
    return segs


@dataclasses.dataclass(frozen=True)
class Split:
    """A TRL-format example as TRL tokenizes it (:meth:`Renderer.split`): the ``whole`` text, tokenized as one; the
    ``prompt`` text (None: nothing is context), tokenized alone, whose tokens in common with the whole are context;
    ``special``: both are tokenized with the tokenizer's special tokens (BOS), as ``tokenizer(text)`` does for raw
    text (a chat template writes its own)."""

    prompt: Optional[str]
    whole: str
    special: bool
    spans: Optional[tuple[tuple[int, int], ...]] = None
    """TRL's conversational language modeling (``messages``): the ``[start, end)`` character ranges of ``whole``
    that are targets; a token that overlaps one is a target, as transformers' ``assistant_masks`` marks them (the
    whole text tokenized as one, so no token is cut where a turn starts). None: every token after the prompt's."""


def _char_spans(segs: Segments) -> tuple[tuple[int, int], ...]:
    """The ``[start, end)`` character ranges of the target segments of ``segs``, in the text they join into.

    >>> _char_spans([("ab", False), ("cd", True), ("e", False), ("f", True)])
    ((2, 4), (5, 6))
    """
    out, at = [], 0
    for text, target in segs:
        if target and text:
            out.append((at, at + len(text)))
        at += len(text)
    return tuple(out)


def chatml_text(conv: Conversation, upto: int, gen: bool) -> str:
    """The built-in ChatML's rendering of ``conv.messages[:upto]`` (with the generation prompt when ``gen``): what
    ``templates/chatml.jinja`` renders for them."""
    part = dataclasses.replace(conv, messages=conv.messages[:upto], train=None)
    text = "".join(t for t, _ in chatml_segments(part, [False] * upto)) if upto or conv.tools else ""
    return text + ("<|im_start|>assistant\n" if gen else "")


def _cap(conv: Conversation, msgs: list[dict], tools: Optional[list]) -> int:
    """The bound on one rendering of ``msgs`` (``conv`` as the template sees it, :func:`_inline`):
    :data:`TEMPLATE_MAX_CHARS` plus 8 characters per character of the record's text, tool calls and definitions."""
    size = sum(len(_content_text(m["content"])) + len(m.get("reasoning_content", "")) for m in msgs)
    size += len(json.dumps([m.get("tool_calls") for m in msgs], ensure_ascii=False)) if conv.tools or any(
        m.get("tool_calls") for m in msgs) else 0
    size += len(json.dumps(tools, ensure_ascii=False)) if tools else 0
    return TEMPLATE_MAX_CHARS + 8 * size


def generation_segments(tpl: JinjaTemplate, conv: Conversation) -> Segments:
    """A conversation rendered whole, its ``{% generation %}`` blocks the targets and the rest context: the spans
    transformers' ``return_assistant_tokens_mask`` (TRL's ``assistant_only_loss``) trains."""
    msgs, _, tools = _inline(conv, tpl)
    whole, spans = tpl.render_generation(msgs, tools, _cap(conv, msgs, tools))
    _check_rendered(whole, msgs, tools)
    segs: Segments = []
    at = 0
    for a, b in spans:
        a = max(a, at)
        segs += [(whole[at:a], False), (whole[a:b], True)]
        at = max(at, b)
    segs.append((whole[at:], False))
    if tpl.images is not None:  # the processor's rewriting of each image the template wrote (within one segment)
        segs = [(tpl.images.processed(t), y) for t, y in segs]
    return merge_runs(segs)


def template_split(tpl: JinjaTemplate, conv: Conversation) -> Split:
    """:meth:`Renderer.split` of a conversation with a prompt, under a Jinja chat template: the prompt rendered with
    the generation prompt and the whole as the template writes it, nothing the record holds left out."""
    msgs, _, tools = _inline(conv, tpl)
    k = conv.prompt + len(msgs) - len(conv.messages)  # tool definitions may have become a system turn of their own
    cap = _cap(conv, msgs, tools)
    whole = tpl.render(msgs, tools, False, cap)
    _check_rendered(whole, msgs, tools)
    return Split(tpl.render(msgs[:k], tools, True, cap), whole, False)


# ------------------------------------------------------------------------------------------------


def merge_runs(segs: Segments) -> Segments:
    """Join neighbouring segments with the same flag (and drop empty ones): text is cut only where the mask changes.

    >>> merge_runs([("a", False), ("b", False), ("", True), ("c", True)])
    [('ab', False), ('c', True)]
    """
    out: Segments = []
    for text, target in segs:
        if not text:
            continue
        if out and out[-1][1] == target:
            out[-1] = (out[-1][0] + text, target)
        else:
            out.append((text, target))
    return out


@contextlib.contextmanager
def _record_time_limit():
    """One record's rendering, bounded by :data:`TEMPLATE_SECONDS`: past it, the record is ``template_limit``."""
    try:
        with time_limit(TEMPLATE_SECONDS):
            yield
    except TemplateTimeout:
        raise Rejected(Reason.TEMPLATE_LIMIT, f"the chat template ran longer than {TEMPLATE_SECONDS:g} s on this "
                                              "record; a chat template should only lay out the turns (use "
                                              "--chat-template FILE with one that does)") from None


class Renderer:
    """Renders conversations with one tokenizer and template (loaded once per process)."""

    def __init__(self, options: PackOptions):
        self.tok = load_tokenizer(options.tokenizer, options.trust_remote_code)
        if options.chat_template is not None and not options.chat_template.strip():
            raise PackstreamError("the --chat-template file is empty; give a file holding a Jinja chat template, or "
                                  "leave --chat-template out to use the tokenizer's own (or the built-in ChatML)")
        source = options.chat_template if options.chat_template is not None else self.tok.chat_template
        if isinstance(source, dict):  # tokenizers with named templates
            source = source.get("default") or next(iter(source.values()))
        self.template: Optional[str] = source
        self.vision = options.vision()
        self._rewrites_images = self.vision is not None and self.vision.expand(self.vision.placeholder) != \
            self.vision.placeholder
        """The processor rewrites the text around each image before tokenizing it (Gemma 3: :meth:`VisionSpec.expand`)."""
        self.jinja: Optional[JinjaTemplate] = None
        if source is not None:
            try:
                self.jinja = JinjaTemplate(source, self.tok.special_tokens_map)
            except PackstreamError:  # it compiles but never ends (JinjaTemplate._check_ends)
                raise
            except Exception as e:  # a template that does not even compile: every record would fail alike
                raise PackstreamError(f"the chat template does not compile: {type(e).__name__}: {e}") from None
            self.jinja.images = image_parts(self.jinja, self.vision)
        self.eos_text = self.tok.eos_token
        self.eos_id = self.tok.eos_token_id

    def ends_as_rendered(self, conv: Conversation, fmt: FormatOptions) -> bool:
        """Whether the example ends as the template renders it, with no EOS appended and no trailing whitespace
        dropped: TRL's conversational language-modeling formats (``messages``, and ShareGPT's ``conversations``,
        which TRL converts to messages) under ``--eos trl``, as TRL's SFTTrainer tokenizes them."""
        return fmt.eos is Eos.TRL and conv.shape in TRL_CONVERSATIONS and not conv.raw and conv.text is None

    def segments(self, conv: Conversation, fmt: FormatOptions) -> Segments:
        """The conversation as ``[(text, is_target), ...]``; every target flag follows ``fmt``.

        Labelled segments come back exactly as labelled (all targets with ``--train-on all``).
        """
        if conv.segments is not None:
            segs = list(conv.segments)
        else:
            segs = self._rendered(conv, fmt)
            if not self.ends_as_rendered(conv, fmt):
                # Drop trailing whitespace after the last turn (or the text); the EOS follows it.
                while segs and not segs[-1][0].strip():
                    segs.pop()
                if segs:
                    text, target = segs[-1]
                    segs[-1] = (text.rstrip(), target)
        if fmt.train_on is TrainOn.ALL:
            segs = [(t, True) for t, _ in segs]
        return merge_runs(segs)

    def split(self, conv: Conversation, fmt: FormatOptions) -> Optional[Split]:
        """TRL's tokenization of a TRL-format example (:class:`Split`), or None for every other conversation (its
        :meth:`segments` are tokenized one by one).

        * ``text`` (``--eos trl``): the text, the EOS appended when it does not end with it, every token trained,
          tokenized with the tokenizer's special tokens (``tokenizer(text)``, SFTTrainer's language modeling);
        * a raw string prompt and completion (``--strings raw``): ``prompt + completion``, the EOS appended to a
          completion that lacks it, the prompt context; both tokenized with the special tokens;
        * a conversation with a prompt (:attr:`Conversation.prompt`; ``--eos trl`` and no ``--mask-reasoning``):
          the prompt rendered with the generation prompt, and the whole conversation rendered as the template
          writes it (no EOS appended, its ending kept), both tokenized without special tokens (the template writes
          them), as ``apply_chat_template(tokenize=True)``.

        The encoder takes the completion to start where the two token lists part, as TRL does
        (``common_prefix_length``): a prompt whose tokens are not a prefix of the whole is counted
        (``prompt_not_prefix``)."""
        eos = self.eos_text or ""
        if conv.raw is not None:
            prompt, completion = conv.raw
            return Split(prompt, prompt + (completion if completion.endswith(eos) else completion + eos), True)
        if fmt.eos is not Eos.TRL:
            return None
        if conv.text is not None and conv.shape == "text" and conv.text.strip():  # a blank one: empty_after_render
            return Split(None, conv.text if conv.text.endswith(eos) else conv.text + eos, True)
        videos = any(isinstance(i, Video) for i in conv.images)
        # a messages conversation is tokenized whole, its spans found by character offsets: unless the processor
        # rewrites the text around its images first (Gemma 3's blank lines), which would move them; then its turns
        # are tokenized one by one (:meth:`segments`)
        if self.ends_as_rendered(conv, fmt) and not videos and not (conv.images and self._rewrites_images):
            segs = self._lm_segments(conv, fmt)
            return Split(None, "".join(t for t, _ in segs), False, _char_spans(segs))
        if conv.prompt is None or fmt.mask_reasoning or videos:
            return None  # a video's placeholder text is timestamped per example later: the turns are split instead
        if self.jinja is None:
            return Split(chatml_text(conv, conv.prompt, True), chatml_text(conv, len(conv.messages), False), False)
        with _record_time_limit():
            return template_split(self.jinja, conv)

    def _lm_segments(self, conv: Conversation, fmt: FormatOptions) -> Segments:
        try:
            return self._lm_spans(conv, fmt)
        except Rejected as r:  # a template that refuses the turns as written (roles that do not alternate, ...)
            if r.reason is not Reason.TEMPLATE_ERROR or fmt.turns is not Turns.WRITTEN:
                raise
            raise Rejected(r.reason, r.detail + "; the turns are taken as written (TRL's rule): --turns cleaned "
                                                "merges same-role turns and drops empty ones first") from None

    def _lm_spans(self, conv: Conversation, fmt: FormatOptions) -> Segments:
        """A ``messages`` conversation's segments, as TRL's ``assistant_only_loss`` marks them: a template with
        ``{% generation %}`` blocks says itself which text is the assistant's (used when the record sets no turn
        flags and nothing else is asked: ``--train-on all``, ``--mask-reasoning``); otherwise each target turn is
        found by rendering prefixes (:func:`template_segments`)."""
        plain = conv.train is None and fmt.train_on is TrainOn.ASSISTANT and not fmt.mask_reasoning
        if self.jinja is None or not self.jinja.generation or not plain:
            return self.segments(conv, fmt)
        with _record_time_limit():
            return generation_segments(self.jinja, conv)

    def _rendered(self, conv: Conversation, fmt: FormatOptions) -> Segments:
        if conv.text is not None:
            return [(conv.text, True)]
        if conv.raw is not None:  # --strings raw read it; a caller asking for segments gets them the same way
            split = self.split(conv, fmt)
            return [(split.prompt, False), (split.whole[len(split.prompt):], True)]
        targets = target_flags(conv, fmt.train_on)
        if self.jinja is None:
            return chatml_segments(conv, targets, fmt.mask_reasoning)
        with _record_time_limit():
            return template_segments(self.jinja, conv, targets, fmt.mask_reasoning)

    def appends_eos(self, conv: Conversation, fmt: Optional[FormatOptions] = None) -> bool:
        """Whether the encoder appends the tokenizer's EOS to the example's segments: every rendered example, except
        labelled segments (trained exactly as labelled), pre-tokenized records (packed as they are) and, under
        ``--eos trl``, TRL's conversational formats (:meth:`ends_as_rendered`; a :meth:`split` writes its EOS as
        text)."""
        fmt = fmt or FormatOptions()
        return (conv.segments is None and conv.tokens is None and self.eos_text is not None
                and not self.ends_as_rendered(conv, fmt))

    def render_text(self, conv: Conversation, fmt: FormatOptions) -> str:
        """The full example as text, EOS included: what decoding the stored tokens gives back."""
        split = self.split(conv, fmt)
        if split is not None:
            return split.whole
        text = "".join(t for t, _ in self.segments(conv, fmt))
        if self.appends_eos(conv, fmt) and text and not text.endswith(self.eos_text):
            text += self.eos_text
        return text
