"""Rendering: the built-in ChatML, tokenizer templates, training targets, and the bounds on templates.

The templates below are written for these tests in the style of real ones: a Qwen-like ChatML
with a ``<think>`` block, ``<tools>`` in the system turn and ``<tool_call>``/``<tool_response>``
blocks, and a Llama-3-like one that renders only role and content. Expected texts are written
out by hand; decoding checks run on real tokens through the :class:`~pipeline._encode.Encoder`.
"""

from __future__ import annotations

import json
import math
import threading
import time

import pytest

from packers import PackstreamError
from pipeline import PackOptions
from tests._internals import (
    BUILTIN_CHATML, Conversation, Encoder, FormatOptions, Reason, Rejected, Renderer, _render, merge_runs, normalize,
)

QWEN_LIKE = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.reasoning_content %}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- message.content }}
        {%- for tool_call in message.tool_calls or [] %}
            {%- if (loop.first and message.content) or (not loop.first) %}
                {{- '\n' }}
            {%- endif %}
            {%- if tool_call.function %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' + tool_call.arguments | tojson + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or messages[loop.index0 - 1].role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

LLAMA3_LIKE = r"""
{%- for message in messages %}
    {%- set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}
    {%- if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}
    {{- content }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}
"""

# Qwen3's real templates show reasoning only for assistant turns after the last user turn, so
# an earlier turn renders differently once the conversation goes on: not prefix-consistent.
HISTORY_STRIPPING = r"""
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}
{%- for m in messages %}
    {%- if m.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_query and m.reasoning_content %}{{- '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}{% endif %}
        {{- m.content + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{% endif %}
"""

TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "Current time in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def call(name, **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


CONVERSATIONS = {
    "plain": Conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]),
    "system_multi": Conversation([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
                                  {"role": "assistant", "content": "d"}]),
    "reasoning": Conversation([{"role": "user", "content": "Is 91 prime?"},
                               {"role": "assistant", "content": "No, 91 = 7 × 13.", "reasoning": "91 / 7 = 13."}]),
    "tools": Conversation([{"role": "system", "content": "You can call tools."}, {"role": "user", "content": "Time in Oslo?"},
                           {"role": "assistant", "content": "", "reasoning": "Need the tool.",
                            "tool_calls": [call("get_time", city="Oslo"), call("get_time", city="Bergen")]},
                           {"role": "tool", "content": "14:05", "name": "get_time"},
                           {"role": "tool", "content": "14:05", "name": "get_time"},
                           {"role": "assistant", "content": "It is 14:05 in Oslo (and Bergen)."}], tools=TOOLS),
    "tools_no_system": Conversation([{"role": "user", "content": "Time?"},
                                     {"role": "assistant", "content": "Checking.", "tool_calls": [call("get_time", city="Rome")]},
                                     {"role": "tool", "content": "09:00"}, {"role": "assistant", "content": "09:00."}], tools=TOOLS),
    "mid_system": Conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                                {"role": "system", "content": "Now answer in German."}, {"role": "user", "content": "c"},
                                {"role": "assistant", "content": "d"}]),
    "flags": Conversation([{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"},
                           {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}],
                          train=[True, False, None, None]),
}


@pytest.fixture(scope="module")
def builtin():
    return Renderer(PackOptions(inputs=("-",)))


@pytest.fixture(scope="module")
def builtin_jinja():
    return Renderer(PackOptions(inputs=("-",), chat_template=BUILTIN_CHATML))


def template_messages(conv: Conversation) -> list[dict]:
    out = []
    for m in conv.messages:
        m = dict(m)
        if "reasoning" in m:
            m["reasoning_content"] = m.pop("reasoning")
        out.append(m)
    return out


@pytest.mark.parametrize("mask_reasoning", [False, True])
@pytest.mark.parametrize("train_on", ["assistant", "all"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_builtin_chatml_python_equals_jinja(name, train_on, mask_reasoning, builtin, builtin_jinja):
    """The fast path renders templates/chatml.jinja exactly, targets included; and so does transformers."""
    conv = CONVERSATIONS[name]
    fmt = FormatOptions(train_on=train_on, mask_reasoning=mask_reasoning)
    assert builtin.jinja is None and builtin_jinja.jinja is not None
    assert builtin.segments(conv, fmt) == builtin_jinja.segments(conv, fmt)
    text = builtin.tok.apply_chat_template(template_messages(conv), tools=conv.tools, chat_template=BUILTIN_CHATML,
                                           tokenize=False)
    assert "".join(t for t, _ in builtin.segments(conv, fmt)) == text.rstrip()


def test_builtin_chatml_by_hand(builtin):
    segs = builtin.segments(CONVERSATIONS["tools"], FormatOptions(mask_reasoning=True))
    tools = json.dumps(TOOLS, ensure_ascii=False)
    assert segs == [
        (f"<|im_start|>system\nYou can call tools.\n\n# Tools\n{tools}<|im_end|>\n<|im_start|>user\nTime in Oslo?<|im_end|>\n"
         "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n", False),
        ('<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {"city": "Bergen"}}\n</tool_call><|im_end|>\n', True),
        ("<|im_start|>tool\n14:05<|im_end|>\n<|im_start|>tool\n14:05<|im_end|>\n<|im_start|>assistant\n", False),
        ("It is 14:05 in Oslo (and Bergen).<|im_end|>", True),
    ]
    # A turn's own flag wins over --train-on: the user turn flagged 1 is a target, the assistant flagged 0 is not.
    assert builtin.segments(CONVERSATIONS["flags"], FormatOptions()) == [
        ("<|im_start|>user\nu1<|im_end|>\n", True),
        ("<|im_start|>assistant\na1<|im_end|>\n<|im_start|>user\nu2<|im_end|>\n<|im_start|>assistant\n", False),
        ("a2<|im_end|>", True)]


def qwen_renderer(template=QWEN_LIKE):
    return Renderer(PackOptions(inputs=("-",), chat_template=template))


def test_qwen_like_template_renders_reasoning_and_tools_itself():
    r = qwen_renderer()
    assert (r.jinja.reasoning, r.jinja.tool_calls, r.jinja.tools) == (True, True, True)
    conv = CONVERSATIONS["tools"]
    segs = r.segments(conv, FormatOptions())
    full = "".join(t for t, _ in segs)
    assert full == r.tok.apply_chat_template(template_messages(conv), tools=conv.tools, chat_template=QWEN_LIKE,
                                             tokenize=False).rstrip()
    assert [t for t, y in segs if y] == [
        '<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"city": "Bergen"}}\n</tool_call><|im_end|>\n',
        "It is 14:05 in Oslo (and Bergen).<|im_end|>"]
    assert "<tool_response>\n14:05\n</tool_response>\n<tool_response>" in full  # the template's own layout
    masked = r.segments(conv, FormatOptions(mask_reasoning=True))
    assert [t for t, y in masked if y][0].startswith("<tool_call>")  # the think block (tags included) is context
    assert "".join(t for t, _ in masked) == full


def test_llama3_like_template_gets_reasoning_and_tools_in_its_text():
    """A template that ignores reasoning, tool calls and tools: they are written into the text, never dropped."""
    r = qwen_renderer(LLAMA3_LIKE)
    assert (r.jinja.reasoning, r.jinja.tool_calls, r.jinja.tools) == (False, False, False)
    segs = r.segments(CONVERSATIONS["tools"], FormatOptions())
    full = "".join(t for t, _ in segs)
    bos = r.tok.bos_token
    assert full.startswith(f"{bos}<|start_header_id|>system<|end_header_id|>\n\nYou can call tools.\n\n# Tools\n"
                           + json.dumps(TOOLS, ensure_ascii=False) + "<|eot_id|>")
    assert [t for t, y in segs if y] == [
        '<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"city": "Bergen"}}\n</tool_call><|eot_id|>',
        "It is 14:05 in Oslo (and Bergen).<|eot_id|>"]
    masked = [t for t, y in r.segments(CONVERSATIONS["tools"], FormatOptions(mask_reasoning=True)) if y]
    assert masked[0].startswith("<tool_call>")
    # Tools but no system turn: the tool definitions become a system turn of their own (context).
    segs = r.segments(CONVERSATIONS["tools_no_system"], FormatOptions())
    assert segs[0][0].startswith(f"{bos}<|start_header_id|>system<|end_header_id|>\n\n# Tools\n") and not segs[0][1]


@pytest.mark.parametrize("template", ["qwen", "llama3"])
def test_template_decode_check_on_real_tokens(template):
    """Through the Encoder: decoded tokens == the template's rendering (+ EOS with --eos always); targets ==
    assistant turns (+ EOS). By default (TRL's rule) a ``messages`` example ends as the template renders it."""
    source = QWEN_LIKE if template == "qwen" else LLAMA3_LIKE
    for eos_rule in ("trl", "always"):
        _decode_check(template, source, eos_rule)


def _decode_check(template: str, source: str, eos_rule: str) -> None:
    enc = Encoder(PackOptions(inputs=("-",), chat_template=source, eos=eos_rule))
    tok = enc.renderer.tok
    rec = {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                        {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"}]}
    out = enc.encode([(0, "x.jsonl", 1, rec)])
    assert not out.rejected
    b = out.batch
    ids = b.input_ids.tolist() if hasattr(b, "input_ids") else b.tokens[0].tolist()
    mask = b.loss_mask.tolist() if hasattr(b, "loss_mask") else b.tokens[1].tolist()
    eos = tok.eos_token
    if template == "qwen":
        text = ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
                "<think>\nAdd them.\n</think>\n\n4<|im_end|>\n<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n6<|im_end|>")
        targets = "<think>\nAdd them.\n</think>\n\n4<|im_end|>\n6<|im_end|>"
    else:
        h = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"  # noqa: E731
        text = (f"{tok.bos_token}{h('system')}Answer briefly.<|eot_id|>{h('user')}2+2?<|eot_id|>{h('assistant')}"
                f"<think>\nAdd them.\n</think>\n\n4<|eot_id|>{h('user')}3+3?<|eot_id|>{h('assistant')}6<|eot_id|>")
        targets = "<think>\nAdd them.\n</think>\n\n4<|eot_id|>6<|eot_id|>"
    if eos_rule == "trl":  # the template's own ending: Qwen's newline after the last <|im_end|>, no EOS
        end = "\n" if template == "qwen" else ""
        assert tok.decode(ids) == text + end
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        if template == "qwen":
            assert trained == targets.replace("4<|im_end|>6", "4<|im_end|>\n6") + end
        else:  # the whole text is tokenized as one: a token across a turn's end (this vocabulary has no <|eot_id|>
            # token: "><" of "<|eot_id|><|start_header_id|>") is a target, as transformers' assistant_masks marks it
            assert trained.startswith(targets.split("4<|eot_id|>")[0] + "4<|eot_id|>") and trained.endswith("6<|eot_id|>")
        return
    assert tok.decode(ids) == text + eos
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == targets + eos


def test_prefix_inconsistent_template_is_refused_with_the_fix():
    r = qwen_renderer(HISTORY_STRIPPING)
    one = Conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r"}])
    assert [t for t, y in r.segments(one, FormatOptions()) if y] == ["<think>\nr\n</think>\n\na<|im_end|>"]
    two = Conversation(one.messages + [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}])
    with pytest.raises(Rejected) as e:
        r.segments(two, FormatOptions())
    assert e.value.reason is Reason.TEMPLATE_ERROR
    assert "not prefix-consistent at messages[1]" in e.value.detail and "--chat-template" in e.value.detail


def test_template_errors_and_the_sandbox():
    r = qwen_renderer("{{ raise_exception('only user/assistant roles are supported') }}")
    with pytest.raises(Rejected, match="template_error: chat template failed: TemplateError: only user/assistant"):
        r.segments(CONVERSATIONS["plain"], FormatOptions())
    r = qwen_renderer("{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Rejected, match="template_error: chat template failed: SecurityError"):
        r.segments(CONVERSATIONS["plain"], FormatOptions())
    with pytest.raises(PackstreamError, match="the chat template does not compile"):
        qwen_renderer("{% for %}")


@pytest.fixture
def quick_limit(monkeypatch):
    monkeypatch.setattr(_render, "TEMPLATE_SECONDS", 0.5)


BOUNDED = {
    # Slow on the records, not on the launch probe (a template slow on every conversation is one launch error:
    # test_a_template_that_never_ends_is_one_launch_error): the per-record bound must still dead-letter these.
    "loops": "{% if 'probe' not in messages[0].content %}{% for i in range(99999) %}{% for j in range(99999) %}"
             "{% set x = i %}{% endfor %}{% endfor %}{% endif %}{{ messages[0].content }}",
    "output": "{% for i in range(99999) %}{% for j in range(99999) %}xxxxxxxxxxxxxxxx{% endfor %}{% endfor %}",
    "string_times": "{{ 'ab' * 10000000000 }}",
    "list_times": "{{ ([1] * 999999999) | length }}",
    "power": "{{ 7 ** 99999999 }}",
}


@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_template_bounds_dead_letter_as_template_limit(name, quick_limit):
    r = qwen_renderer(BOUNDED[name])
    t0 = time.monotonic()
    with pytest.raises(Rejected) as e:
        r.segments(CONVERSATIONS["plain"], FormatOptions())
    assert e.value.reason is Reason.TEMPLATE_LIMIT, e.value
    assert time.monotonic() - t0 < 5
    # Through the encoder: a dead letter, the next record still renders.
    enc = Encoder(PackOptions(inputs=("-",), chat_template=BOUNDED[name]))
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    out = enc.encode([(0, "x.jsonl", 1, good)])
    assert [d["reason"] for d in out.rejected] == ["template_limit"]


def test_the_time_limit_runs_no_thread_and_never_fires_outside_a_render(quick_limit):
    """The bound is a deadline the template's own code checks: no thread beside it, nothing raised into a thread
    after its render ended, however long the thread then runs (code outside a template never checks it)."""
    r = qwen_renderer(QWEN_LIKE)
    fmt = FormatOptions()
    before = threading.active_count()
    for _ in range(300):
        r.segments(CONVERSATIONS["tools"], fmt)
    assert threading.active_count() == before
    time.sleep(0.7)  # past every deadline
    spin = time.monotonic() + 0.3
    while time.monotonic() < spin:  # plain Python, as a Hypothesis engine or a test runner would run
        pass
    assert r.segments(CONVERSATIONS["plain"], fmt)
    assert _render._DEADLINE.at == math.inf


def test_a_template_past_its_deadline_stops_inside_the_render_only():
    """A deadline passed before the template starts stops it at its first block; the caller's own code after the
    render goes on, and a nested limit keeps the sooner deadline."""
    tpl = _render.compile_template("{% for i in range(3) %}{{ i }}{% endfor %}")
    with _render.time_limit(10):
        with _render.time_limit(-1):
            with pytest.raises(_render.TemplateTimeout):
                tpl.render()
        assert tpl.render() == "012"  # the outer limit is back
    assert tpl.render() == "012" and _render._DEADLINE.at == math.inf


def test_each_thread_is_bounded_on_its_own(quick_limit):
    slow, fast = qwen_renderer(BOUNDED["loops"]), qwen_renderer(QWEN_LIKE)
    results = {}

    def work(name, r):
        try:
            results[name] = r.segments(CONVERSATIONS["plain"], FormatOptions())
        except Rejected as e:
            results[name] = e.reason

    threads = [threading.Thread(target=work, args=(f"slow{i}", slow)) for i in range(2)]
    threads += [threading.Thread(target=work, args=(f"fast{i}", fast)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results["slow0"] is results["slow1"] is Reason.TEMPLATE_LIMIT
    assert isinstance(results["fast0"], list) and results["fast0"] == results["fast1"]


def test_render_text_matches_the_tokens(builtin):
    enc = Encoder(PackOptions(inputs=("-",)))
    tok = enc.renderer.tok
    for rec in ({"text": "plain words"}, {"instruction": "a", "output": "b"},
                {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]}):
        conv = normalize(rec, FormatOptions())
        out = enc.encode([(0, "x.jsonl", 1, rec)])
        ids = out.batch.input_ids.tolist() if hasattr(out.batch, "input_ids") else out.batch.tokens[0].tolist()
        assert tok.decode(ids) == builtin.render_text(conv, FormatOptions())


def test_segments_are_exactly_as_labelled(builtin):
    conv = normalize({"segments": [{"text": "Q: ", "label": False}, {"text": "A", "label": True}]}, FormatOptions())
    assert builtin.segments(conv, FormatOptions()) == [("Q: ", False), ("A", True)]
    assert builtin.segments(conv, FormatOptions(train_on="all")) == [("Q: A", True)]
    assert builtin.render_text(conv, FormatOptions()) == "Q: A" and not builtin.appends_eos(conv)


def test_merge_runs():
    assert merge_runs([("a", True), ("", False), ("b", True), ("c", False)]) == [("ab", True), ("c", False)]


# A template that silently drops system turns (some older chat templates do), and one that renders
# only the last assistant turn's reasoning (Qwen3-style) with every token trained.
NO_SYSTEM = ("{% for m in messages %}{% if m.role != 'system' %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>"
             "{% endif %}{% endfor %}")
LAST_REASONING_ONLY = ("{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content and loop.last %}<think>"
                       "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}</{{ m.role }}>{% endfor %}")


@pytest.mark.parametrize("name, where", [("system_multi", "messages[0] (role system)"),
                                         ("tools", "messages[0] (role system)"),
                                         ("tools_no_system", "messages[0] (role system)")])
def test_a_template_that_drops_a_turn_is_refused_per_record(name, where):
    """Tool definitions this template cannot render go into a system turn, which it then drops: caught too."""
    r = qwen_renderer(NO_SYSTEM)
    with pytest.raises(Rejected) as e:
        r.segments(CONVERSATIONS[name], FormatOptions())
    assert e.value.reason is Reason.TEMPLATE_ERROR
    assert f"leaves out {where}" in e.value.detail and "--chat-template" in e.value.detail
    # A record with nothing it drops renders as before.
    assert [t for t, _ in r.segments(CONVERSATIONS["plain"], FormatOptions())] == ["<user>Hi</user>", "<assistant>Hello!</assistant>"]


def test_a_template_that_drops_earlier_reasoning_is_refused_even_when_every_token_trains():
    conv = Conversation([{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning": "r1 r1"},
                         {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "reasoning": "r2 r2"}])
    r = qwen_renderer(LAST_REASONING_ONLY)
    with pytest.raises(Rejected, match=r"leaves out the reasoning of messages\[1\]"):
        r.segments(conv, FormatOptions(train_on="all"))
    one = Conversation(conv.messages[2:])
    assert r.segments(one, FormatOptions(train_on="all")) == [("<user>q2</user><assistant><think>r2 r2</think>a2</assistant>", True)]


def test_tool_results_written_as_json_strings_count_as_shown():
    tpl = ("{% for m in messages %}{% if m.role == 'tool' %}{\"content\": {{ m.content | tojson }}}{% else %}"
           "<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endif %}{% endfor %}")
    conv = Conversation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "calling"},
                         {"role": "tool", "content": 'line "one"\nline two'}, {"role": "assistant", "content": "done"}])
    assert qwen_renderer(tpl).segments(conv, FormatOptions())[-1] == ("<assistant>done</assistant>", True)


def test_an_empty_template_file_is_an_error_not_the_builtin(tmp_path):
    with pytest.raises(PackstreamError, match="the --chat-template file is empty"):
        qwen_renderer("  \n")


def test_template_problems_are_one_error_at_launch_before_any_output(tmp_path):
    from tests._internals import _job

    data = tmp_path / "a.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    for template in ("{% for %}", ""):
        out = tmp_path / f"out{len(template)}"
        with pytest.raises(PackstreamError) as e:
            _job.run(PackOptions(inputs=(str(data),), output=str(out), chat_template=template))
        assert "EncodeTasks" not in str(e.value)
        assert not out.exists()


def test_a_tokenizer_without_eos_packs_with_a_warning(tmp_path, capsys):
    import shutil

    from tests._internals import _job, default_tokenizer_path

    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(f"{default_tokenizer_path()}/tokenizer.json", tok / "tokenizer.json")  # no config: no EOS
    data = tmp_path / "a.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    manifest = _job.run(PackOptions(inputs=(str(data),), output=str(tmp_path / "out"), tokenizer=str(tok)))
    assert manifest["counts"]["examples_packed"] == 1 and manifest["row_checks"]["eos_token_id"] is None
    assert "has no EOS token" in capsys.readouterr().err


# -- issue 16, causes 12 and 20: what every record would hit alike is one launch error ------------


def test_a_template_that_never_ends_is_one_launch_error(tmp_path, monkeypatch):
    """The start-up probe sees the render time out: one error (exit 2) before any output, not a timeout per
    record (1,000 records took 2.8 h)."""
    from tests._internals import _job, _render

    monkeypatch.setattr(_render, "TEMPLATE_SECONDS", 0.5)
    data = tmp_path / "a.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n' * 20)
    endless = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages }}"
    out = tmp_path / "out"
    with pytest.raises(PackstreamError, match=r"did not finish rendering a two-message probe conversation in 0.5 s"):
        _job.run(PackOptions(inputs=(str(data),), output=str(out), chat_template=endless))
    assert not out.exists()


def _tokenizer_with_eos(tmp_path, eos: str):
    import json
    import shutil

    from tests._internals import default_tokenizer_path

    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(f"{default_tokenizer_path()}/tokenizer.json", tok / "tokenizer.json")
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return tok


@pytest.mark.parametrize("eos,words", [
    ("<|no-such-token|>", "'<|no-such-token|>' is not in its vocabulary"),
    ("Ġthe", "'Ġthe' is token 270 of the vocabulary, but its text encodes to 3 token(s)"),
])
def test_an_eos_the_vocabulary_does_not_hold_as_one_token_is_a_launch_error(tmp_path, eos, words):
    """Such a tokenizer packed every example without an EOS (exit 0), and the warning said to set eos_token,
    which was set: now one error names the token and the fix."""
    from click.testing import CliRunner

    from pipeline.cli import main

    tok = _tokenizer_with_eos(tmp_path, eos)
    data = tmp_path / "a.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["pack", str(data), "-o", str(out), "--tokenizer", str(tok)])
    errors = [line for line in r.output.splitlines() if line.startswith("error: ")]
    assert r.exit_code == 2 and len(errors) == 1 and words in errors[0], r.output
    assert "added_tokens" in errors[0] and "no EOS token" not in r.output
    assert not out.exists()


def test_an_eos_that_is_one_token_of_the_vocabulary_packs(tmp_path):
    from tests._internals import _job

    tok = _tokenizer_with_eos(tmp_path, "hello")  # an odd EOS, but one token that encodes to itself
    data = tmp_path / "a.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    manifest = _job.run(PackOptions(inputs=(str(data),), output=str(tmp_path / "out"), tokenizer=str(tok)))
    assert manifest["row_checks"]["eos_token_id"] == 33310 and manifest["row_checks"]["eos_at_boundaries"]
