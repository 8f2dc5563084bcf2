"""The fix is never cut off (issue 28): when records are refused, the summary's line for each reason and the final
``error:`` line of a run that packs nothing show the refusal's remedy whole. Only what was found is shortened;
the whole detail stays in rejected.jsonl.

Every refusal's detail reads ``<what was found>; <what to do>`` (split at the first ``; `` outside brackets:
:func:`split_remedy`), so the check below holds for every refusal the fixtures in tests/shapes/ meet, not only
for the ones written down here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main
from tests._internals import split_remedy

SHAPES = Path(__file__).parent / "shapes"


def _pack(src: Path, out: Path, *args: str):
    r = CliRunner().invoke(main, ["pack", str(src), "-o", str(out), "--workers", "1", "--no-progress", *args])
    assert "Traceback" not in r.output, r.output
    return r


def _check_remedies_whole(r, out: Path) -> int:
    """Each reason's summary line and the final error line hold the remedy of that reason's first case, whole."""
    manifest = json.loads((out / "manifest.json").read_text())
    first = manifest["counts"]["first_rejected"]
    lines = r.output.splitlines()
    error = [line for line in lines if line.startswith("error: ")]
    assert len(error) == 1, r.output
    checked = 0
    for reason, case in first.items():
        remedy = split_remedy(" ".join(case["detail"].split()))[1]
        if not remedy:
            continue
        [line] = [line for line in lines if line.lstrip().startswith(reason + " ") and "e.g." in line]
        assert line.endswith(remedy), (reason, line, remedy)
        checked += 1
    counts = manifest["counts"]["rejected_by_reason"]
    top = max(counts, key=counts.get)
    top_remedy = split_remedy(" ".join(first[top]["detail"].split()))[1]
    if top_remedy:
        assert f"fix ({top}, as its first record says): {top_remedy};" in error[0], (error[0], top_remedy)
    return checked


def test_a_refused_file_shows_its_fix_whole_in_the_summary_and_on_the_error_line(tmp_path):
    """gsm8k without --field: the detail's list of known formats is long; the --field suggestion must survive."""
    src = tmp_path / "gsm.jsonl"
    src.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}. #### {2 * i}"})
                           + "\n" for i in range(6)))
    r = _pack(src, tmp_path / "out")
    assert r.exit_code == 3, r.output
    assert _check_remedies_whole(r, tmp_path / "out") == 1
    assert "read it with --field question=user --field answer=assistant" in r.output.splitlines()[-1]


@pytest.mark.slow  # ~30 s: one pack per fixture
def test_every_bundled_refusal_shows_its_fix_whole(tmp_path):
    """Every fixture of tests/shapes/ packed with no option: each one that packs nothing (exit 3) shows, for every
    reason it met, the remedy whole on its summary line, and the most common reason's remedy on the error line."""
    refused = 0
    for src in sorted(SHAPES.iterdir()):
        out = tmp_path / src.name
        r = _pack(src, out)
        if r.exit_code != 3:
            continue
        refused += 1
        _check_remedies_whole(r, out)
    assert refused >= 15, refused  # the unknown shapes, the preference files, media, unverified tokens
