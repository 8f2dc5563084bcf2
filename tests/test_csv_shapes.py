"""CSV worked examples a new user meets (issue 42), each read as a new user would: ``preview``, then the fix it
prints, then ``pack``, then the decoded rows and dead letters.

=====================  ==========================================================  ==================================
file                   the rows                                                    what must happen
=====================  ==========================================================  ==================================
empty_answer.csv       ``instruction,input,output``; rows 2 and 5 have no answer   rows 2 and 5: ``empty_answer``,
                       (``""``, and a trailing empty cell)                         naming the cell; never a fix that
                                                                                   trains the prompt (it was
                                                                                   ``--field instruction=text``)
kto_labels.csv         ``prompt,completion,label``, ``label`` true/false as text   preview and the summary name
                       (a CSV cell cannot hold a boolean)                          ``--kto-label label``; with it the
                                                                                   rows' ``desirable`` is 1/0 per row
=====================  ==========================================================  ==================================
"""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from pipeline.cli import main
from tests.test_shape_fixes import packed
from tests.test_pipeline import _rows

SHAPES_DIR = Path(__file__).parent / "shapes"


def cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, list(args))
    assert isinstance(result.exception, (SystemExit, type(None))), result.exception  # never a traceback
    assert result.exit_code == code, result.output
    return result.output


def test_an_empty_answer_cell_is_its_own_reason_and_never_trains_the_prompt(tmp_path):
    src = str(SHAPES_DIR / "empty_answer.csv")
    shown = cli("preview", src, "--no-color")
    # Rows 2 and 5 (the header is row 1): refused for the empty answer, the fix filling it in (no option to pass).
    for row in (2, 5):
        block = shown.split(f"-- record {row}:")[1].split("\n\n")[0]
        assert "REFUSED empty_answer" in block and "the row's output cell is empty: no answer to train on; fill in " \
                                                  "the answer, or remove the row" in block, block
    assert "=text" not in shown and "read it with" not in shown  # no fix that would train the prompt
    # The printed fix asks for nothing to pass: pack as it stands; the two full rows pack, the two others are dead.
    examples = packed(tmp_path, "empty_answer.csv", ["--max-reject-fraction", "0.5"])
    assert {e["id"].rsplit("@", 1)[1]: e["trained"].strip() for e in examples} == {
        "3": "11<|im_end|><｜end▁of▁sentence｜>", "4": "Bonjour<|im_end|><｜end▁of▁sentence｜>"}
    assert all("2+2" not in e["text"] and "Hamlet" not in e["text"] for e in examples)  # no prompt packed alone
    out = tmp_path / "out"
    dead = {d["position"]: d for d in map(json.loads, (out / "rejected.jsonl").read_text().splitlines())}
    assert {p: d["reason"] for p, d in dead.items()} == {2: "empty_answer", 5: "empty_answer"}
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["records_read"] == 4 == counts["examples_packed"] + counts["rejected"]
    # The summary and estimate name the same fix, whole, with the detail's brackets balanced.
    summary = cli("estimate", src)
    assert "empty_answer                ~2  e.g. empty_answer.csv at 2: the row's output cell is empty: no answer " \
           "to train on; fill in the answer, or remove the row" in summary, summary


def test_csv_kto_labels_name_kto_label_then_pack_as_labels(tmp_path):
    src = str(SHAPES_DIR / "kto_labels.csv")
    shown = cli("preview", src, "--no-color")
    assert shown.count("suggest: --kto-label label") == 4, shown  # one per record
    # Without the fix: packed as plain SFT, unlabelled, and the summary says so beside the ignored field.
    result = cli("pack", src, "-o", str(tmp_path / "plain"))
    assert "fields ignored              label (4)" in result
    assert "label holds true/false as text in 4 records (a CSV cell cannot hold a boolean), so they were packed as " \
           "plain SFT, unlabelled; --kto-label label keeps them as KTO labels" in result, result
    assert all(not r["desirable"] for r in _rows(str(tmp_path / "plain")))  # no labels in any row
    # The printed fix, typed back: each example keeps its label in the rows' desirable column, the label read.
    examples = packed(tmp_path, "kto_labels.csv", ["--kto-label", "label"])
    assert len(examples) == 4
    found = {}
    for row in _rows(str(tmp_path / "out")):
        found.update(zip((e.rsplit("@", 1)[1] for e in row["example_ids"]), row["desirable"]))
    assert found == {"2": 1, "3": 0, "4": 1, "5": 0}  # true, false, TRUE, false
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    notes = manifest["counts"]["normalization"]
    assert not any(k.startswith(("ignored_field:", "kto_label_text:")) for k in notes), notes
    # --kto-label with --pairs was ignored in silence: now one line at option validation.
    result = CliRunner().invoke(main, ["pack", src, "--pairs", "--kto-label", "label", "-o", str(tmp_path / "p")])
    errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert result.exit_code == 2 and len(errors) == 1 and "--kto-label label labels single answers (KTO); --pairs" \
        in errors[0], result.output
