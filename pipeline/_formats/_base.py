"""The types every shape module shares: what a record becomes, how a shape is declared, why a record is refused.

A shape module reads one record into :class:`Draft` s (turns before hygiene, or plain text,
labelled segments, tokens) through a :class:`Ctx` that carries the options and collects the
notes; the driver (:mod:`pipeline._formats._driver`) turns each draft into a
:class:`Conversation`. A record that cannot be read raises :class:`Rejected` with a
:class:`Reason`; the reasons grow here only.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Callable, Collection, Optional, Sequence, Union

from pipeline._formats._fix import Fix
from pipeline._options import Format, FormatOptions


class Reason(str, enum.Enum):
    """Why a record left the main path. One counter and one dead-letter reason each."""

    MALFORMED_JSON = "malformed_json"
    INVALID_UTF8 = "invalid_utf8"
    RECORD_TOO_LARGE = "record_too_large"
    NOT_AN_OBJECT = "not_an_object"
    UNKNOWN_FORMAT = "unknown_format"
    MISSING_FIELD = "missing_field"
    BAD_TYPE = "bad_type"
    EMPTY_CONVERSATION = "empty_conversation"
    NO_ASSISTANT_TURN = "no_assistant_turn"
    STARTS_WITH_ASSISTANT = "starts_with_assistant"
    CONSECUTIVE_SAME_ROLE = "consecutive_same_role"
    UNKNOWN_ROLE = "unknown_role"
    TEMPLATE_ERROR = "template_error"
    EMPTY_AFTER_RENDER = "empty_after_render"
    NO_TARGET_TOKENS = "no_target_tokens"
    DUPLICATE_ID = "duplicate_id"
    TOO_LONG = "too_long"
    NON_TEXT_CONTENT = "non_text_content"
    TEMPLATE_LIMIT = "template_limit"
    PRETOKENIZED_UNVERIFIED = "pretokenized_unverified"
    BAD_TOKEN_ID = "bad_token_id"
    CORRUPT_INPUT = "corrupt_input"
    AMBIGUOUS_FIELD = "ambiguous_field"
    PREFERENCE_PAIR = "preference_pair"
    NOT_A_PAIR = "not_a_pair"
    PAIR_PROMPT_MISMATCH = "pair_prompt_mismatch"
    NO_PREFERENCE = "no_preference"
    MAPPED_FIELD_CUT = "mapped_field_cut"
    MALFORMED_ROW = "malformed_row"  #: a CSV/TSV row of the wrong cell count, or an unterminated quote
    BLANK_TEXT = "blank_text"  #: a plain-text document (a line, or a whole file) that holds only whitespace
    PLACEHOLDER_MISMATCH = "placeholder_mismatch"  #: --processor: image placeholders and images differ in number
    BAD_IMAGE = "bad_image"  #: --processor: an image that is missing, unreadable, or of a size the processor refuses
    BAD_VIDEO = "bad_video"  #: --video-fps: a video that is missing, unreadable, cut short, or of a frame size refused
    REMOTE_IMAGE = "remote_image"  #: --processor: an http(s) image URL (packing is offline)
    OUTSIDE_MEDIA_ROOT = "outside_media_root"  #: --processor: an image file that is not under the media root
    EMPTY_ANSWER = "empty_answer"  #: a CSV/TSV row whose answer cell is empty (an empty cell is a missing field)
    LABEL_CONFLICT = "label_conflict"  #: KTO labels in two fields (label, kto_tag) that disagree


class Row(dict):
    """A CSV/TSV row's record: its non-empty cells. ``empty`` names the columns whose cell was empty, left out
    (an empty cell is a missing field), so a row refused for lacking one can name that cell
    (:data:`Reason.EMPTY_ANSWER`) rather than fix the row by reading the cells it has otherwise (issue 42)."""

    def __init__(self, cells: dict, empty: Sequence[str]):
        super().__init__(cells)
        self.empty = tuple(empty)

    def __reduce__(self):  # pickled with its empty cells (records cross processes)
        return (Row, (dict(self), self.empty))


class Rejected(Exception):
    """A record that cannot be packed; ``str()`` is ``"<reason>: <detail>"``.

    With a ``fix`` (the options that would read the record, as data: :class:`~pipeline._formats._fix.Fix`)
    the detail is ``detail``, the fix's options, ``after``, then what trying the fix found.
    """

    def __init__(self, reason: Reason, detail: str, fix: Optional[Fix] = None, after: str = ""):
        self.reason = reason
        self.fix = fix
        self._around = (detail, after)
        self.detail = detail + (fix.text() if fix else "") + after + (fix.outcome() if fix else "")
        super().__init__(f"{reason.value}: {self.detail}")

    def with_fix(self, fix: Fix) -> "Rejected":
        """The same refusal showing ``fix`` (the one it carries, as trying it found it)."""
        return Rejected(self.reason, self._around[0], fix, self._around[1])

    def __reduce__(self):  # pickle (Beam ships read-time rejections between steps) by our own fields
        return (Rejected, (self.reason, self._around[0], self.fix, self._around[1]))


@dataclasses.dataclass
class Conversation:
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """``{"role", "content"}`` plus, where present: ``reasoning`` (assistant), ``tool_calls``
    (assistant; ``[{"type": "function", "function": {"name", "arguments"}, "id"?}]``), ``name``
    and ``tool_call_id`` (tool)."""
    tools: Optional[list] = None
    text: Optional[str] = None
    """Set for plain-text records (every token trained); ``messages`` is then empty."""
    train: Optional[list[Optional[bool]]] = None
    """Per message: True/False where the record's turn says so (loss_weight, train, training), else None."""
    segments: Optional[list[tuple[str, bool]]] = None
    """Template-free labelled segments ``[(text, is_target), ...]``; ``messages`` is then empty."""
    tokens: Optional[Any] = None
    """Pre-tokenized: a ``(2, n)`` int32 array (ids, loss mask); ``messages`` is then empty."""
    notes: dict[str, int] = dataclasses.field(default_factory=dict)
    """What normalization did to the record (turns trimmed, merged, dropped; ``ignored_field:<name>``)."""
    shape: str = ""
    """The shape the record was read as (``alpaca``, ``messages``, ``fields``, ...)."""
    mapping: tuple[str, ...] = ()
    """How the record's fields became turns, in words (``instruction+input -> user``), for ``preview``."""
    desirable: Optional[bool] = None
    """KTO data: whether the record's answer is desirable (its boolean ``label``/``kto_tag``, or ``--kto-label``);
    None when it carries no such label (pipeline._formats._labels)."""
    prompt: Optional[int] = None
    """TRL's prompt/completion records (``prompt`` + ``completion``, a KTO ``label`` or not; a preference record's
    explicit or implicit prompt): how many leading ``messages`` are the prompt. The renderer then follows TRL: the
    prompt rendered with the generation prompt is context, the completion is what the whole rendering adds after the
    tokens the two have in common (:mod:`pipeline._render`). None: any other conversation."""
    raw: Optional[tuple[str, str]] = None
    """TRL's standard (string) prompt and completion, kept as raw text (``--strings raw``): ``messages`` is then
    empty, and the example is ``prompt + completion`` (EOS appended to a completion that lacks it), the prompt
    context."""
    images: list[Any] = dataclasses.field(default_factory=list)
    """``--processor`` runs: the record's image references (a path or URI string, ``{"bytes", "path"}``, bytes), in the
    order their placeholder text (``image_text``) stands in the messages or text (pipeline._formats._images)."""


# The public classes are documented, pickled and printed under the package that exports them.
for _cls in (Reason, Rejected, Conversation):
    _cls.__module__ = "pipeline._formats"

NOTE_KEYS = ("leading_assistant_dropped", "trailing_turns_trimmed", "empty_turns_dropped", "turns_merged")
"""Notes that count turns a record held but its conversation does not (besides ``ignored_field:*``)."""

NOTE_UNITS = {**dict.fromkeys(NOTE_KEYS, "turns"), "number_as_text": "values", "padding_tokens_removed": "tokens",
              "other_side_not_trained": "records", "tree_paths_kept": "paths", "tree_messages_off_path": "messages",
              "large_image": "images", "images_placed_first": "images", "videos_placed_first": "videos",
              "image_tags_as_videos": "tags", "prompt_not_prefix": "examples"}
"""Every note normalization keeps (besides ``ignored_field:*``), with what it counts."""

TRL_CONVERSATIONS = frozenset({"messages", "sharegpt"})
"""Shapes of TRL's conversational language-modeling format (``messages``; ShareGPT's ``conversations``, which TRL
converts to messages): under ``--turns written`` their turns are taken as written, and under ``--eos trl`` they
end as the chat template renders them."""

ID_KEYS = ("id",)  # the example id (pipeline._rows.example_id): part of every shape

MISSING = object()
"""What :func:`pipeline._formats._paths.resolve` gives for a path the record does not have."""


def text_size(value: Any) -> int:
    """How much text a value holds: the characters of its strings, stripped, nested in lists and objects (0: none).

    >>> text_size({"a": " hi ", "b": [1, "yes", {"c": ""}]}), text_size([None, "  "])
    (5, 0)
    """
    if isinstance(value, str):
        return len(value.strip())
    if isinstance(value, dict):
        return sum(text_size(v) for v in value.values())
    if isinstance(value, list):
        return sum(text_size(v) for v in value)
    return 0


# ------------------------------------------------------------------------------------------------
# Words for details.


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {str: "str", bool: "bool", int: "int", float: "float", list: "list", dict: "dict"}.get(
        type(value), type(value).__name__)


def _keys(record: dict) -> str:
    names = sorted(map(str, record))
    return ", ".join(names[:10]) + (f", ... ({len(names)} keys)" if len(names) > 10 else "") if names else "none"


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def missing_mapped(paths: Sequence[str], asked: str, record: dict) -> Rejected:
    """A record that lacks fields options map (``asked``: the options, in words): named, never suggested again."""
    what = ", ".join(repr(p) for p in paths)
    return Rejected(Reason.MISSING_FIELD, f"field {what} ({asked}) is missing from this record; it has keys [{_keys(record)}]")


def _blank(value: Any) -> bool:
    """Holds nothing to lose: null, a string of whitespace, an empty list or object."""
    return value is None or (isinstance(value, str) and not value.strip()) or (isinstance(value, (list, dict)) and not value)


def _same(a: Any, b: Any) -> bool:
    """Two values of one slot that say the same thing (strings compared without surrounding whitespace)."""
    if isinstance(a, str) and isinstance(b, str):
        return a.strip() == b.strip()
    return type(a) is type(b) and a == b


def _one_slot(m: dict, names: Sequence[str]) -> tuple[Optional[str], Optional[str]]:
    """One slot that may sit under any of ``names``: the key to read (the first that holds something, else
    the first present, else None), and another key that holds different text (None when none does)."""
    present = [k for k in names if k in m]
    full = [k for k in present if not _blank(m[k])]
    found = full[0] if full else present[0] if present else None
    return found, next((k for k in full[1:] if not _same(m[k], m[found])), None)


# ------------------------------------------------------------------------------------------------
# One record's reading context: options, notes and the words preview shows.


class Ctx:
    def __init__(self, options: FormatOptions, image_text: Optional[str] = None, video_text: Optional[str] = None):
        self.o = options
        self.image_text = image_text
        self.video_text = video_text
        """``--video-fps`` runs: the text a video becomes in its turn; None: videos are refused."""
        """``--processor`` runs: the text an image becomes in its turn; None: images are refused (text only)."""
        self.images: list[Any] = []  # image references by marker number (pipeline._formats._images)
        self.notes: dict[str, int] = {}
        self.mapping: list[str] = []
        self.speakers: dict[str, str] = {}  # raw speaker name -> role, as seen
        self.roles = {k.lower(): v for k, v in options.roles}
        self.flagged_off = 0  # trailing assistant turns trimmed because their own flag says not to train
        self.turns_read: list = []  # the turns as read, before hygiene (for the details of a refusal)

    def note(self, key: str, n: int = 1) -> None:
        if n:
            self.notes[key] = self.notes.get(key, 0) + n

    def ignore(self, name: str) -> None:
        """A field the record holds but the conversation does not: counted once per record."""
        self.notes.setdefault(f"ignored_field:{name}", 1)

    def fork(self) -> "Ctx":
        """A context for one more draft of the same record: the same options, speakers and words so far,
        its own notes (a record's own notes are counted once, on its first conversation)."""
        child = Ctx(self.o, self.image_text, self.video_text)
        child.speakers, child.mapping, child.images = self.speakers, list(self.mapping), self.images
        return child


@dataclasses.dataclass
class Turn:
    role: str
    content: str
    at: str  # where in the record, for messages: "messages[3]"
    speaker: str = ""  # the raw speaker name, when the role came from one
    reasoning: Optional[str] = None
    tool_calls: Optional[list] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    train: Optional[bool] = None
    mapped: Optional[str] = None
    """The ``--field PATH=ROLE`` that named this turn, if one did: hygiene never trims or drops such a turn
    (the record is refused instead), since the user asked for that field by name."""

    def empty(self) -> bool:
        return (self.role != "tool" and not self.content.strip() and not self.tool_calls
                and not (self.reasoning or "").strip())

    def message(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning:
            m["reasoning"] = self.reasoning
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        if self.name is not None:
            m["name"] = self.name
        if self.tool_call_id is not None:
            m["tool_call_id"] = self.tool_call_id
        return m


@dataclasses.dataclass
class Draft:
    """What a shape reads from a record, before hygiene: exactly one of the four is set."""

    turns: Optional[list[Turn]] = None
    text: Optional[str] = None
    segments: Optional[list[tuple[str, bool]]] = None
    tokens: Optional[Any] = None
    tools: Optional[Any] = None
    """Tool definitions found somewhere other than the record's ``tools`` column (raw, as the record holds them)."""
    prompt: Optional[int] = None
    """TRL's prompt/completion split of ``turns``: the first ``prompt`` turns are the record's prompt, context whatever
    their roles; the rest is the completion, trained whole. The turns are then taken as the record writes them (no
    hygiene), as TRL renders them. None: a conversation of any other shape."""
    raw: Optional[tuple[str, str]] = None
    """TRL's standard (string) prompt and completion under ``--strings raw``: raw text, no chat template."""


# ------------------------------------------------------------------------------------------------
# How a shape is declared: what it claims, what it reads, how.


@dataclasses.dataclass(frozen=True)
class Need:
    """One thing a shape needs of a record. ``name`` is the field a ``missing_field`` detail names.
    A ``strict=False`` need is a type check that only detection applies: an explicit ``--format``
    reads the record and names the bad type instead."""

    name: str
    test: Callable[[dict], bool]
    strict: bool = True


def has(key: str) -> Need:
    return Need(key, lambda r: key in r)


def has_any(*names: str) -> Need:
    return Need(names[0], lambda r: any(k in r for k in names))


def is_list(key: str) -> Need:
    return Need(key, lambda r: isinstance(r.get(key), list), strict=False)


@dataclasses.dataclass(frozen=True)
class Claim:
    """The records a shape reads: all of ``needs`` met (:func:`all_of`), or what options name
    (``mapped``: ``--field``, ``--messages-field``)."""

    needs: tuple[Need, ...] = ()
    mapped: Optional[Callable[[dict, FormatOptions], list[str]]] = None
    """For shapes that options name: the mapped paths the record lacks (the shape applies when
    ``applies`` says the options name it)."""
    applies: Callable[[FormatOptions], bool] = lambda o: True
    given: Callable[[FormatOptions, list[str]], str] = lambda o, missing: ""
    """For shapes that options name: the options that asked for the missing paths, in words."""

    def missing(self, record: dict, options: FormatOptions, explicit: bool = False) -> list[str]:
        """What the record lacks for this shape: [] when the shape reads it. Key claims name the first
        unmet need only; ``explicit`` (``--format NAME``) skips the type checks."""
        if self.mapped is not None:
            return self.mapped(record, options)
        for need in self.needs:
            if (need.strict or not explicit) and not need.test(record):
                return [need.name]
        return []


def all_of(*needs: Need) -> Claim:
    return Claim(needs=tuple(needs))


Reads = Union[Collection[str], Callable[[dict, FormatOptions], Collection[str]]]


@dataclasses.dataclass(frozen=True)
class Shape:
    """One shape family (see :mod:`pipeline._formats.detect` for the order they are tried in).

    ``read(record, ctx)`` returns drafts (one per conversation the record holds) or raises
    :class:`Rejected`; it never drops, merges or trims turns (hygiene runs once, in the driver)
    and never reads ``common`` (the driver does). Top-level keys outside ``reads``, ``common`` and
    ``id`` are counted as ignored.
    """

    name: str
    claims: Claim
    reads: Reads
    read: Callable[[dict, Ctx], list[Draft]]
    looks_like: str
    """The record, in words: the docstring table and the docs are checked against it."""
    keys: str = ""
    """The keys that detect it, in words, for the ``unknown_format`` detail ("" when not detected by keys)."""
    common: tuple[str, ...] = ()
    """Columns the driver reads for this shape: ``system`` (a system turn), ``tools`` (definitions)."""
    format: Optional[Format] = None
    """The ``--format NAME`` that reads every record as this shape."""
    follows: Optional[Callable[[FormatOptions], Sequence[str]]] = None
    """For shapes that follow paths into the record (``--field``, ``--messages-field``): the paths, whose
    neighbours are counted as ignored when they hold something."""
    fast: Optional[Callable[[dict], Optional[Conversation]]] = None
    """A direct path for clean records under default options (None: take the general path);
    tests/test_fast_path.py holds it equal to ``read`` + the driver."""

    def top_keys(self, record: dict, options: FormatOptions) -> set[str]:
        """The top-level keys this shape reads (``reads`` + ``common`` + ``id``) in ``record``."""
        reads = self.reads(record, options) if callable(self.reads) else self.reads
        return {*reads, *self.common, *ID_KEYS}
