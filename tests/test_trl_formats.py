"""packstream's tokens and loss masks equal TRL 1.16's own, for TRL's documented data formats.

For every (chat template, format) case a seeded generator writes records, TRL's own trainer (SFTTrainer, KTOTrainer,
DPOTrainer), built once over the whole data set around a tiny random model, tokenizes them, and packstream's
:class:`~pipeline._encode.Encoder` encodes the same records with the same tokenizer folder: every record must be
packed (not dead-lettered), with TRL's token ids and TRL's loss mask (from token 1 on: the first token of a sequence
is never a target), and a KTO record with its label.

- language modeling: ``{"text"}`` (SFTTrainer: text + EOS unless it ends with it, ``tokenizer(text)``: special tokens
  added; every token trained) and ``{"messages"}`` (``assistant_only_loss=True``: the template's rendering,
  mask = its ``{% generation %}`` blocks; only for templates that have them);
- prompt-completion, strings (raw text, no template; mask 1 after the common token prefix of prompt and
  prompt+completion+EOS) and conversational (prompt with the generation prompt, the whole without EOS added;
  mask 1 after ``trl.data_utils.common_prefix_length``);
- KTO ``{"prompt", "completion", "label"}``: ``prompt_ids + completion_ids``, strings and conversational;
- DPO, explicit ``{"prompt", "chosen", "rejected"}`` (strings, conversational) and implicit ``{"chosen", "rejected"}``
  (``trl.data_utils.extract_prompt``): per side ``prompt_ids + chosen_ids`` / ``rejected_ids``.

Templates (tests/_trl.py): ChatML (Qwen2.5 style, generation-tagged), Llama 3 (``{{ bos_token }}``, header tokens, a
tokenizer that adds the BOS to plain text), a "think" template whose generation prompt ends with an empty
``<think>\\n\\n</think>\\n\\n`` that a completed turn does not render (Qwen3 without thinking, Gemma 4), and Mistral
(``[INST] ... [/INST]``, the template writes the EOS after each answer; no generation blocks).

Plus the issue's worked example (a prompt's earlier assistant turn is context) and one ``packstream pack`` run whose
packed rows are compared with TRL's by example id.
"""

from __future__ import annotations

import json
import time

import pytest

from tests import _trl

trl = pytest.importorskip("trl")

pytestmark = pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning")

N = 30
"""Records per (template, format) case."""

CASES = [pytest.param(t, f, id=f"{t}-{f}") for t in _trl.TEMPLATES for f in _trl.FORMATS
         if f != "messages" or _trl.TEMPLATES[t].generation]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One tokenizer folder per template, and transformers' tokenizer of each."""
    root = tmp_path_factory.mktemp("trl-tokenizers")
    out = {}
    for name, template in _trl.TEMPLATES.items():
        folder = _trl.tokenizer_folder(root, template)
        out[name] = (folder, _trl.hf_tokenizer(folder))
    return out


@pytest.fixture(scope="module")
def table(request):
    """Counts per case, printed as one table when the module ends."""
    rows: dict[str, dict] = {}
    yield rows
    if not rows:
        return
    keys = ("records", "ok", "rejected", "ids", "mask", "label", "missing")
    lines = ["", "TRL formats: records per outcome (ids/mask: first difference of a record), seconds per case",
             f"{'case':26s} " + " ".join(f"{k:>8s}" for k in keys) + "  seconds"]
    for case, c in rows.items():
        lines.append(f"{case:26s} " + " ".join(f"{c.get(k, 0):8d}" for k in keys) + f"  {c.get('seconds', 0):7.1f}")
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if tr is None or capture is None:  # pragma: no cover - xdist workers
        print("\n".join(lines))
        return
    with capture.global_and_fixture_disabled():
        for line in lines:
            tr.write_line(line)


@pytest.mark.parametrize("template,fmt", CASES)
def test_tokens_and_masks_equal_trls(template, fmt, folders, table, tmp_path):
    folder, tok = folders[template]
    recs = _trl.records(_trl.TEMPLATES[template], fmt, N, seed=f"{template}/{fmt}")
    start = time.perf_counter()
    with _trl.quiet_datasets():
        want = _trl.trl_sides(fmt, folder, recs, tmp_path / "trl")
    assert len(want) == len(recs)
    got = _trl.packstream_sides(fmt, folder, recs)
    counts, reports = _trl.compare(tok, fmt, recs, want, got)
    counts["seconds"] = time.perf_counter() - start
    case = f"{template}-{fmt}"
    table[case] = counts
    print(f"{case}: {counts}")
    assert not reports, _trl.summary(case, counts, reports)


WORKED = {"prompt": [{"role": "user", "content": "Name a color."},
                     {"role": "assistant", "content": "Blue is a color."},
                     {"role": "user", "content": "Another one?"}],
          "completion": [{"role": "assistant", "content": "Red."}]}


def test_a_prompt_assistant_turn_is_context_only_the_completion_trains(folders, tmp_path):
    """The issue's worked example, with ChatML: only ``Red.<|im_end|>\\n`` is trained (TRL's result, checked
    first so that the harness is known right), never the prompt's ``Blue is a color.``."""
    folder, tok = folders["chatml"]
    with _trl.quiet_datasets():
        (want,), = _trl.trl_sides("pc-conv", folder, [WORKED], tmp_path / "trl")
    assert _trl.trained_text(tok, *want) == ["Red.<|im_end|>\n"], "the harness: TRL trains this, see the issue"
    got = _trl.packstream_sides("pc-conv", folder, [WORKED])
    assert 0 not in got.rejected, got.rejected
    (ids, mask), = got.sides[0]
    trained = _trl.trained_text(tok, ids, mask)
    assert trained == ["Red.<|im_end|>\n"], (f"packstream trains {trained}, TRL ['Red.<|im_end|>\\n']; "
                                             f"text {tok.decode(ids)!r}")
    assert ids == want[0], f"TRL {tok.decode(want[0])!r}\npackstream {tok.decode(ids)!r}"


def _end_to_end_records(n: int) -> list[dict]:
    """Mixed conversational prompt-completion records (system turns or not, earlier assistant turns, empty and long
    completions), each with an id."""
    recs = _trl.records(_trl.CHATML, "pc-conv", n, seed="end-to-end")
    recs[0] = json.loads(json.dumps(WORKED))
    recs[1]["completion"] = [{"role": "assistant", "content": ""}]
    return [{"id": f"pc{i}", **r} for i, r in enumerate(recs)]


def test_packed_rows_of_the_pack_command_equal_trls(folders, tmp_path):
    """``packstream pack`` of a JSONL of conversational prompt-completion records (ChatML): every example of the
    written shards, found by its id, holds TRL's tokens and mask (from token 1 on); nothing is dead-lettered."""
    import datasets
    from click.testing import CliRunner

    from pipeline.cli import main

    folder, tok = folders["chatml"]
    recs = _end_to_end_records(24)
    data = _trl.write_jsonl(tmp_path / "pc.jsonl", recs)
    with _trl.quiet_datasets():
        want = _trl.trl_sides("pc-conv", folder, [{k: v for k, v in r.items() if k != "id"} for r in recs],
                              tmp_path / "trl")
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(data), "-o", str(out), "--tokenizer", str(folder), "-q",
                                       "--max-tokens", "2048"])
    assert result.exit_code == 0, result.output
    dead = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines() if line.strip()]
    assert not dead, "dead-lettered: " + "; ".join(f"{d.get('id')}: {d.get('reason')}: {d.get('detail')}"
                                                    for d in dead)
    packed: dict[int, list] = {}
    with _trl.quiet_datasets():
        for shard in sorted(out.glob("train-*.arrow")):
            for row in datasets.Dataset.from_file(str(shard)).to_list():
                offs = row["seq_offsets"]
                for k, eid in enumerate(row["example_ids"]):
                    i = int(eid.rsplit(":pc", 1)[1])
                    lo, hi = offs[k], offs[k + 1]
                    packed[i] = [(row["input_ids"][lo:hi], row["loss_mask"][lo:hi])]
    assert sorted(packed) == list(range(len(recs))), sorted(packed)
    got = _trl.Packed(packed, {}, {})
    counts, reports = _trl.compare(tok, "pc-conv", recs, want, got)
    assert not reports, _trl.summary("pack command, chatml pc-conv", counts, reports)
