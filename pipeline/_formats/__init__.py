"""Record shapes -> normalized conversations.

Every record becomes a :class:`Conversation` (or, for a message tree, one per kept path) or
raises :class:`Rejected` with a :class:`Reason` whose detail names the value, the limit and the
fix. Conversational shapes become a list of messages ``{"role", "content"}`` with roles
``system | user | assistant | tool`` (assistant messages may carry ``reasoning`` and
OpenAI-shaped ``tool_calls``; tool results ``name`` and ``tool_call_id``). Three shapes are not
conversations: plain ``text`` (every token trained), labelled ``segments`` (trained exactly
where labelled) and pre-tokenized ``tokens``.

Shapes, in the order detection tries them (:data:`pipeline._formats.detect.ORDER`; one module
each; ``docs/formats.md`` has the table with the options):

=================  =========================================================================
fields             any other shape, field by field: ``--field PATH=ROLE`` (and ``transcript`` strings)
messages_field     a list of turns under any key: ``--messages-field PATH`` (``--role-key``, ``--content-key``, ``--roles``; ``--field`` turns after it)
tree               a message tree, each message with its ``replies`` (OpenAssistant): ``--tree KEY`` (``--tree-paths all|best``)
tokens             ``input_ids`` (+ ``labels`` with -100, or ``loss_mask``; ``attention_mask``)
segments           ``segments: [{text, label}]`` (template-free, Axolotl's input_output)
messages           ``messages: [{role, content}]`` (OpenAI: parts, reasoning, tool calls)
preference         ``chosen`` + ``rejected`` (TRL, LLaMA-Factory ranking, HH-RLHF) or OpenAI DPO's ``preferred_output``: with ``--preference chosen``
sharegpt           ``conversations: [{from, value}]`` (or role/content)
chat               ``conversation``/``dialog``/``dialogue``/``chat``/``texts``: a list of turn objects (lmsys-chat; Capybara's ``[{input, output}]``; the_cauldron's ``texts: [{user, assistant}]``)
xlam               ``query`` + ``answers: [{name, arguments}]`` (xLAM/APIGen function calling; JSON text or objects)
prompt-completion  ``prompt`` + ``completion`` (strings, or lists of messages as in TRL)
alpaca             ``instruction`` + ``output``/``response`` (+ ``input``, ``system``, ``history``)
text               ``text``
=================  =========================================================================

A record of no known shape is refused with a suggestion computed from its own keys. A refusal that
options would fix carries them as data (:class:`Fix`): its detail is rendered from them, and they are
tried on the record first (values that do not read it whole become holes, ``--content-key KEY``).

TRL's conversational shapes (``messages``, ShareGPT's ``conversations``, conversational ``prompt`` + ``completion``)
keep their turns as the record writes them, as TRL renders them (``--turns written``, the default); a prompt is
context whatever roles it holds. Conversation hygiene, the same for every other conversational shape (and for those
under ``--turns cleaned``) and run once by the driver
(:mod:`pipeline._formats._hygiene`), each step counted in ``notes``: empty turns are dropped;
consecutive same-role turns with the same train flag are merged (``--same-role``; turns whose
flags differ stay apart); a first assistant turn that answers nothing is dropped, kept as
context, or refused (``--leading-assistant``); trailing turns that are not trained (user, tool,
or flagged 0) are trimmed, so every example ends on a target turn. Reasoning written inline in
an assistant answer (``<think>...</think>``, or text before a ``</think>`` with no ``<think>``)
becomes the turn's reasoning.

Nothing a record holds is dropped unseen: record keys outside the detected shape are counted as
``ignored_field:<key>``; so are (when they hold something) turn keys a turn does not read
(``ignored_field:messages[].refusal``) and fields beside a followed ``--field``/``--messages-field``
path (``ignored_field:conversation.system``, ``ignored_field:choices[1:]``). Two keys that hold
different text for one slot (Alpaca ``input``/``context``, ``output``/``response``/``instances``;
a turn's ``content``/``text``/``value``; two reasoning keys) refuse the record as ``ambiguous_field``.

With ``image_text`` (``packstream pack --processor``), images in content parts or beside the text
(``images`` + ``<image>``) become that text in their turn and the conversation's ``images``
(:mod:`pipeline._formats._images`); without it they refuse the record as ``non_text_content``.

Layout: ``_base`` (types), ``_fix`` (a refusal's fix), ``_turns`` (turn objects, content, tool calls), ``_images``,
``_hygiene``, ``_paths``, ``detect`` (ORDER, detect), ``_suggest`` (suggest), ``_driver`` (normalize), and one module
per shape.

>>> c = normalize({"instruction": "Add 2 and 3.", "input": "", "output": "5"}, FormatOptions())
>>> c.shape, c.messages
('alpaca', [{'role': 'user', 'content': 'Add 2 and 3.'}, {'role': 'assistant', 'content': '5'}])
>>> c = normalize({"conversation": [{"from": "gpt", "value": "Hi! Ask me anything."},
...                                 {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}, FormatOptions())
>>> [m["role"] for m in c.messages], c.notes
(['user', 'assistant'], {'leading_assistant_dropped': 1})
>>> c = normalize({"conversations": [{"from": "gpt", "value": "Hi! Ask me anything."},
...                                  {"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]}, FormatOptions())
>>> [m["role"] for m in c.messages], c.notes  # TRL's shapes keep their turns as written (--turns written)
(['assistant', 'user', 'assistant'], {})
>>> fmt = FormatOptions(fields=(("turns", "user"), ("choices[0].turns", "assistant")))
>>> c = normalize({"turns": ["Hi", "2+2?"], "choices": [{"turns": ["Hello", "4"]}], "category": "math"}, fmt)
>>> [(m["role"], m["content"]) for m in c.messages], c.notes
([('user', 'Hi'), ('assistant', 'Hello'), ('user', '2+2?'), ('assistant', '4')], {'ignored_field:category': 1})
>>> normalize({"question": "2+2?", "answer": "4"}, FormatOptions())
Traceback (most recent call last):
...
pipeline._formats.Rejected: unknown_format: keys [answer, question] match no format (input_ids, segments, messages, chosen/rejected, conversations, conversation/dialog/dialogue/chat/texts, query/answers, prompt/completion, instruction/output, text); read it with --field question=user --field answer=assistant
"""

from __future__ import annotations

from pipeline._formats._base import NOTE_KEYS, NOTE_UNITS, TRL_CONVERSATIONS, Conversation, Reason, Rejected, Row
from pipeline._formats._labels import AUTO_KEYS as LABEL_KEYS, NOTE as KTO_NOTE, TEXT_NOTE as KTO_TEXT_NOTE
from pipeline._formats._driver import ANSWER_IMAGE, TOOL_TEXT_NOTE, TRANSCRIPT_NOTE, _fast, _normalize, conversations, normalize, pair_conversations
from pipeline._formats._fix import Fix, Hole, _quoted as shell_word
from pipeline._formats._hygiene import target_flags
from pipeline._formats._images import Video
from pipeline._formats._paths import resolve
from pipeline._formats._turns import ROLE_ALIASES
from pipeline._formats.detect import ORDER, REGISTRY, detect, suggest
from pipeline._formats.preference import PreferenceTurns, preference_turns
from pipeline._options import FormatOptions, parse_path

FIELD_NOTES = ("ignored_field:", TOOL_TEXT_NOTE, KTO_NOTE, KTO_TEXT_NOTE, TRANSCRIPT_NOTE)
"""Prefixes of the notes counted per field or label (``ignored_field:meta``), each shown on a summary line of its
own rather than as a normalization count."""

__all__ = [
    "ANSWER_IMAGE", "FIELD_NOTES", "KTO_NOTE", "LABEL_KEYS", "KTO_TEXT_NOTE", "NOTE_KEYS", "NOTE_UNITS", "ORDER", "TOOL_TEXT_NOTE", "TRANSCRIPT_NOTE", "REGISTRY", "ROLE_ALIASES", "Conversation", "Fix", "FormatOptions", "Hole",
    "PreferenceTurns", "Reason", "Rejected", "Row", "conversations", "detect", "normalize", "pair_conversations", "parse_path",
    "preference_turns", "resolve", "suggest", "shell_word", "target_flags", "TRL_CONVERSATIONS", "Video",
    "_fast", "_normalize",
]
