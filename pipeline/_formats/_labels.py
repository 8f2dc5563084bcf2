"""A record's desirability label (KTO data), read beside its conversation and kept per example in the rows.

KTO sets pair one answer with a label saying whether it is a good one: TRL's unpaired preference layout
``{prompt, completion, label: true}``, LLaMA-Factory's ``kto_tag``, ``{messages, label}``. Packed as SFT with the
label dropped, the undesirable answers would be trained like the others; kept, the rows' ``desirable`` column
(:mod:`packers.schema`) carries it to the loader's batch and :func:`packers.kto_loss`.

- Without ``--kto-label``: a top-level ``label`` or ``kto_tag`` whose value is a JSON boolean is the label. Any
  other value (a class name, a score) is not a desirability, and the field stays an ignored field, counted.
- With ``--kto-label FIELD``: the field (a path) must hold true/false, 1/0, or one of the words of :data:`_TEXT`
  (``"true"``, ``"1"``, ``"yes"``, ``"correct"``, ``"good"``, ... and their opposites: CSV cells, labels written
  as words); a record without one is dead-lettered (``missing_field``), never packed unlabelled.

>>> from pipeline._options import FormatOptions
>>> label_of({"messages": [], "label": False}, FormatOptions())
(False, 'label')
>>> label_of({"messages": [], "label": "sports"}, FormatOptions())
(None, None)
>>> label_of({"prompt": "p", "good": "1"}, FormatOptions(kto_label="good"))
(True, 'good')
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional, Sequence

from pipeline._formats._base import Conversation, Reason, Rejected, _kind
from pipeline._formats._paths import resolve
from pipeline._options import FormatOptions

AUTO_KEYS = ("label", "kto_tag")
"""Top-level fields read as the label when they hold a JSON boolean (TRL ``label``, LLaMA-Factory ``kto_tag``)."""
NOTE = "kto_labels:"
"""Notes ``kto_labels:desirable`` / ``kto_labels:undesirable``: records kept with each label."""
_TEXT = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False, "good": True, "bad": False,
         "correct": True, "incorrect": False, "desirable": True, "undesirable": False, "positive": True,
         "negative": False}
"""Text values ``--kto-label`` reads (case-insensitive): CSV cells, and labels written as words."""


TEXT_NOTE = "kto_label_text:"
"""Notes ``kto_label_text:<field>``: records whose ``label``/``kto_tag`` holds true/false as text (a CSV cell cannot
hold a boolean) without ``--kto-label``: packed as plain SFT, and the summary and ``preview`` name
``--kto-label <field>`` (issue 42)."""
_LIKELY = ("true", "false", "1", "0", "yes", "no")
"""Text that reads as a desirability without doubt; ``positive``/``negative`` are as often a sentiment class."""


def label_spelling(key: Any) -> bool:
    """Whether a top-level key names a KTO label in any spelling: ``label``, ``Label``, ``KTO_TAG``, ``kto-tag``."""
    return isinstance(key, str) and re.sub(r"[\s\-]+", "_", key.strip().lower()) in AUTO_KEYS


def label_like(value: Any) -> bool:
    """Whether a value reads as a desirability: a JSON boolean, 0/1, or true/false-like text."""
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return value in (0, 1)
    return isinstance(value, str) and value.strip().lower() in _LIKELY


def label_of(record: Any, options: FormatOptions) -> tuple[Optional[bool], Optional[str]]:
    """The record's desirability and the field it came from, or ``(None, None)``; :class:`Rejected` when
    ``--kto-label`` names a field the record holds no label in, or (``label_conflict``) when the label read and
    another field of a label's name (``label``, ``kto_tag``, in any spelling) holding a desirability disagree: the
    label is read once, never one of two picked.

    >>> label_of({"messages": [], "label": True, "kto_tag": True}, FormatOptions())
    (True, 'label')
    >>> label_of({"messages": [], "label": True, "kto_tag": False}, FormatOptions())
    Traceback (most recent call last):
    ...
    pipeline._formats.Rejected: label_conflict: label is true but kto_tag is false: two desirabilities for one answer; keep one field, or read one with --kto-label FIELD
    """
    value, key = _label_of(record, options)
    if value is not None:
        for k, v in record.items():
            if k != key and label_spelling(k) and label_like(v) and _desirability(v) is not value:
                raise Rejected(Reason.LABEL_CONFLICT, f"{key} is {_said(record[key])} but {k} is {_said(v)}: two "
                                                      "desirabilities for one answer; keep one field, or read one "
                                                      "with --kto-label FIELD")
    return value, key


def _desirability(value: Any) -> Optional[bool]:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TEXT:
        return _TEXT[value.strip().lower()]
    return None


def _said(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)[:40]


def _label_of(record: Any, options: FormatOptions) -> tuple[Optional[bool], Optional[str]]:
    if not isinstance(record, dict):
        return None, None
    if options.kto_label is None:
        key = next((k for k in AUTO_KEYS if isinstance(record.get(k), bool)), None)
        return (record[key], key) if key is not None else (None, None)
    value = resolve(record, options.kto_label)
    if _desirability(value) is not None:
        return _desirability(value), options.kto_label
    shown = "missing" if value is None else f"{_kind(value)} {str(value)[:40]!r}"
    raise Rejected(Reason.MISSING_FIELD, f"--kto-label {options.kto_label}: the record's value is {shown}, not "
                                         "true/false, 1/0 or yes/no (also correct/incorrect, good/bad); a KTO "
                                         "example needs its desirability")


def labelled(record: Any, options: FormatOptions, convs: Sequence[Conversation]) -> None:
    """Set each conversation's ``desirable`` from the record, and count the label as read (not ignored) on the
    first conversation, where the record's notes are."""
    value, key = label_of(record, options)
    if value is None:
        # A label not read as one: true/false as text (a CSV cell), or a JSON boolean under another spelling
        # (Label, KTO_TAG): packed unlabelled, and the summary names --kto-label FIELD.
        key = next((k for k in record if options.kto_label is None and label_spelling(k)
                    and label_like(record[k])), None) if isinstance(record, dict) else None
        if key is not None and convs:
            note = f"{TEXT_NOTE}{key}"
            convs[0].notes[note] = convs[0].notes.get(note, 0) + 1
        return
    first = convs[0]
    agreeing = [k for k, v in record.items() if label_spelling(k) and label_like(v)]
    for k in {key, *agreeing}:  # every label field agrees (label_of refuses two that disagree): all are read
        first.notes.pop(f"ignored_field:{k}", None)
    note = f"{NOTE}{'desirable' if value else 'undesirable'}"
    first.notes[note] = first.notes.get(note, 0) + 1
    for conv in convs:
        conv.desirable = value
