"""How the records of one data set become conversations: :class:`FormatOptions`."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from packers import PackstreamError
from pipeline._options._fields import cli, flag_of, jsonable, option_enum, parse_pairs
from pipeline._options._modes import (
    DEFAULT_TOKENIZER, ROLES, Eos, Format, Ids, LeadingAssistant, PairBest, Preference, SameRole, Strings, TextSplit, TrainOn, Turns, TreePaths,
    parse_path, winner_test,
)

_EXAMPLES = {"messages_field": "conversation", "role_key": "speaker", "content_key": "text", "tree": "prompt",
             "tokenized_with": DEFAULT_TOKENIZER, "pair_sides": "response_0,response_1", "pair_prompt": "history",
             "pair_ranked": "completions=response/overall_score", "kto_label": "label"}
"""An example value of each option that names a field, a key or a tokenizer, for the error of an empty one."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FormatOptions:
    """How the records of one data set become conversations, and which tokens are targets."""

    format: Format = dataclasses.field(default=Format.AUTO, metadata=cli(
        "--format", "Record shape; auto detects it per record by its keys: input_ids (tokens), segments, messages, "
        "conversations (sharegpt), conversation/dialog/dialogue/chat/texts turn lists, prompt+completion, instruction+output/response (alpaca, with input, system, "
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
        "(Nectar). Or TEXTS/SCORES: a list of answers and a parallel list of their scores, of equal length "
        "(--pair-ranked responses/rewards).", metavar="LIST=TEXT/SCORE|TEXTS/SCORES"))
    pair_best: PairBest = dataclasses.field(default=PairBest.HIGH, metadata=cli(
        "--pair-best", "With --pair-ranked: whether the highest score (a rating) or the lowest (a rank) is the best."))
    pair_prompt: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--pair-prompt", "With --pairs: the path of a preference record's prompt (a string or a list of messages) "
        "when it is not prompt/question/query, instruction or conversations: --pair-prompt history (SHP).",
        metavar="PATH"))
    kto_label: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--kto-label", "The field that says whether a record's answer is desirable (KTO data: true/false, 1/0, yes/no, "
        "correct/incorrect): kept "
        "per example in the rows' desirable column, which packers.kto_loss reads. Without it a top-level boolean "
        "label or kto_tag field is kept; a record this option names no value for is dead-lettered.",
        metavar="FIELD"))
    train_on: TrainOn = dataclasses.field(default=TrainOn.ASSISTANT, metadata=cli(
        "--train-on", "Training targets: assistant turns with their end-of-turn token and the final EOS, or all "
        "tokens. A turn's own loss_weight/train/training flag overrides it for that turn."))
    strings: Strings = dataclasses.field(default=Strings.RAW, metadata=cli(
        "--strings", "TRL's standard (string) records, prompt+completion (with a KTO label or not) and prompt+chosen+"
        "rejected: raw, as TRL trains them (the text as it stands, no chat template, the EOS appended to a completion "
        "that lacks it, tokenized with the tokenizer's special tokens), or chat (the prompt a user turn and the "
        "completion an assistant turn of the chat template). Either way the prompt is context."))
    eos: Eos = dataclasses.field(default=Eos.TRL, metadata=cli(
        "--eos", "How an example ends: trl (as TRL: text, messages, prompt+completion and preference conversations "
        "end as the chat template renders them, text and string completions get the EOS when they lack it; other "
        "shapes get the EOS after their last turn) or always (every rendered example ends with the tokenizer's EOS "
        "after its last turn, trailing whitespace dropped; for templates that write no end of turn)."))
    turns: Turns = dataclasses.field(default=Turns.WRITTEN, metadata=cli(
        "--turns", "TRL's conversational records (messages, ShareGPT conversations, prompt+completion as messages): "
        "written, as TRL renders them (no turn dropped, merged or trimmed; every assistant turn trained, the rest "
        "context; a prompt is context whatever its roles), or cleaned by packstream's "
        "hygiene as every other shape is (empty turns dropped, same-role turns merged, see --leading-assistant and "
        "--same-role; each counted). Use cleaned for a template that refuses what the data holds (roles that do not "
        "alternate)."))
    mask_reasoning: bool = dataclasses.field(default=False, metadata=cli(
        "--mask-reasoning", "Train on the answers but not on the reasoning (thinking) blocks of assistant turns "
        "(reasoning_content/thinking fields, reasoning parts, a leading <think>...</think>, or the text before a lone </think>).",
        kind="switch"))
    leading_assistant: LeadingAssistant = dataclasses.field(default=LeadingAssistant.DROP, metadata=cli(
        "--leading-assistant", "A first assistant turn that answers nothing: drop it, keep it as context, or "
        "reject the record."))
    same_role: SameRole = dataclasses.field(default=SameRole.MERGE, metadata=cli(
        "--same-role", "Consecutive turns of one role: merge them, or reject the record."))
    text_split: TextSplit = dataclasses.field(default=TextSplit.LINE, metadata=cli(
        "--text-split", "Plain-text (.txt) inputs: what one document (one {text} record, every token trained) is: "
        "each line (the default; a blank line is a blank_text dead letter), each paragraph (blank lines between "
        "documents), or the whole file. The summary says which was used."))
    ids: Ids = dataclasses.field(default=Ids.AUTO, metadata=cli(
        "--ids", "What keys each record: auto (its own 'id' field when it has one, else its file and position; a "
        "repeated id is dead-lettered as duplicate_id) or position (always its file and position: for data whose ids "
        "repeat by design, e.g. several completions of one prompt sharing an id; the id field is kept as metadata)."))
    tokenized_with: Optional[str] = dataclasses.field(default=None, metadata=cli(
        "--tokenized-with", "Pre-tokenized records (input_ids): the tokenizer they were made with; must equal "
        "--tokenizer. Without it such records are refused.", metavar="TOKENIZER"))

    _NAMES_SOMETHING = ("messages_field", "role_key", "content_key", "tokenized_with", "tree", "pair_sides",
                        "pair_prompt", "pair_ranked", "kto_label")
    """Text options that name a field, a key or a tokenizer: an empty one names nothing (omit it for the default)."""

    def __post_init__(self) -> None:
        for name, flag in (("fields", "--field"), ("roles", "--roles"), ("transcript_markers", "--transcript-marker"),
                           ("pair_winner", "--pair-winner")):
            object.__setattr__(self, name, parse_pairs(getattr(self, name), flag))
        for name in self._NAMES_SOMETHING:
            value = getattr(self, name)
            if isinstance(value, str) and not value.strip():
                flag = flag_of(FormatOptions, name)
                raise PackstreamError(f"{flag} {value!r} is empty; give a name, e.g. {flag} "
                                      f"{_EXAMPLES.get(name, 'NAME')}, or omit {flag} for the default")
        for enum_name, cls in (("format", Format), ("train_on", TrainOn), ("leading_assistant", LeadingAssistant),
                               ("same_role", SameRole), ("tree_paths", TreePaths), ("pair_best", PairBest),
                               ("text_split", TextSplit), ("ids", Ids), ("strings", Strings),
                               ("eos", Eos), ("turns", Turns)):
            object.__setattr__(self, enum_name, option_enum(cls, getattr(self, enum_name), enum_name))
        if self.preference is not None:
            object.__setattr__(self, "preference", option_enum(Preference, self.preference, "preference"))
        allowed = ROLES + ("text", "transcript", "tool_calls", "reasoning")
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
        _check_paths([(f, "--field") for f, _ in self.fields] + [(self.messages_field, "--messages-field"),
                                                                 (self.tree, "--tree")])
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
        """``--pair-ranked LIST=TEXT/SCORE`` as (list path, text key, score key), or None (also for TEXTS/SCORES)."""
        if self.pair_ranked is None or "=" not in self.pair_ranked:
            return None
        path, _, keys = self.pair_ranked.partition("=")
        text, _, score = keys.partition("/")
        return path.strip(), text.strip(), score.strip()

    def ranked_lists(self) -> Optional[tuple[str, str]]:
        """``--pair-ranked TEXTS/SCORES`` (two parallel lists) as (texts path, scores path), or None."""
        if self.pair_ranked is None or "=" in self.pair_ranked or self.pair_ranked.count("/") != 1:
            return None
        texts, _, scores = self.pair_ranked.partition("/")
        return texts.strip(), scores.strip()

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
            lists = self.ranked_lists()
            path, text, score = self.ranked() or ("", "", "")
            if not ((path and text and score and "/" in self.pair_ranked) or (lists and all(lists)
                                                                                and lists[0] != lists[1])):
                raise PackstreamError(f"--pair-ranked {self.pair_ranked!r} must look like LIST=TEXT/SCORE (a list of "
                                      "objects, each item's answer key and score key: completions=response/"
                                      "overall_score) or TEXTS/SCORES (two parallel lists: responses/rewards)")
            if self.pair_sides is not None or self.pair_winner:
                raise PackstreamError("--pair-ranked picks the two answers from a list itself; it does not combine with "
                                      "--pair-sides or --pair-winner")
        elif self.pair_best is not PairBest.HIGH:
            raise PackstreamError(f"--pair-best {self.pair_best.value} says which score of a --pair-ranked list is best; "
                                  "add --pair-ranked LIST=TEXT/SCORE")
        if self.pair_winner and self.pair_sides is None:
            raise PackstreamError("--pair-winner picks between the two answers --pair-sides names; add --pair-sides A,B "
                                  "(e.g. --pair-sides response_0,response_1)")
        _check_paths([(self.pair_prompt, "--pair-prompt"), *((f, "--pair-winner") for f, _ in self.pair_winner),
                      *(((self.ranked()[0], "--pair-ranked"),) if self.ranked() else ()),
                      *((p, "--pair-ranked") for p in (self.ranked_lists() or ())),
                      *((p, "--pair-sides") for p in (self.sides() if self.pair_sides else ()))])
        if self.maps_pairs() and (self.fields or self.messages_field is not None or self.tree is not None
                                  or self.format is not Format.AUTO):
            raise PackstreamError("--pair-sides/--pair-ranked/--pair-prompt name a preference record's fields; they do "
                                  "not combine with --field, --messages-field, --tree or --format")

    def format_dict(self) -> dict[str, Any]:
        """JSON-ready, for manifest.json."""
        return {f.name: jsonable(getattr(self, f.name)) for f in dataclasses.fields(FormatOptions)}


LATER_DEFAULTS = {"text_split": "line", "ids": "auto", "strings": "raw", "eos": "trl", "turns": "written"}
"""Options added after runs were made, at their defaults: left out of a run's id (:func:`pipeline._write.run_digest`),
so a run that does not use them keeps the id, and so the shard bytes, it had before they existed
(``bench/same_output.py``). The manifest's ``config`` records them all the same."""


def _check_paths(paths: list[tuple[Optional[str], str]]) -> None:
    """Each ``(path, flag)``: a field path of the one grammar (:func:`~pipeline._options.parse_path`), or None."""
    for path, flag in paths:
        if path is not None:
            try:
                parse_path(path)
            except ValueError as e:
                raise PackstreamError(f"{flag}: {e}") from None
