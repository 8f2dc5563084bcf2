"""The ``packstream`` command line: exit statuses, option errors, the output folder, ``verify``.

Exit statuses: 0 success; 1 ``verify`` found a mismatch; 2 user error (one ``error:`` line, or
click's usage message, never a traceback); 3 ``--max-reject-fraction`` exceeded (the outputs are
written, the job is reported failed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import main

GOOD = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}\n'


def cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    assert isinstance(result.exception, (SystemExit, type(None))), repr(result.exception)
    assert "Traceback" not in result.output
    return result


@pytest.fixture
def src(tmp_path) -> Path:
    p = tmp_path / "in.jsonl"
    p.write_text(GOOD * 3 + '{"text": "plain"}\n')
    return p


def test_output_folder_is_owned_and_overwrite_replaces_only_its_files(tmp_path, src):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    refused = cli("pack", str(src), "-o", str(out), "-q", "--overwrite")
    assert refused.exit_code == 2  # a folder with files but no packstream manifest: never packstream's to clear
    assert "error: --output" in refused.output and "packstream did not write" in refused.output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    out = tmp_path / "out2"
    first = cli("pack", str(src), "-o", str(out), "-q", "--num-shards", "3")
    assert first.exit_code == 0, first.output
    assert len(list(out.glob("train-*-of-00003.arrow"))) == 3
    (out / "notes.txt").write_text("mine")
    again = cli("pack", str(src), "-o", str(out), "-q")
    assert again.exit_code == 2 and "holds an earlier packstream output" in again.output and "--overwrite" in again.output
    # A rerun with fewer shards removes the stale ones (the manifest lists them): a reader never mixes two runs.
    second = cli("pack", str(src), "-o", str(out), "-q", "--overwrite", "--num-shards", "1")
    assert second.exit_code == 0, second.output
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md", "manifest.json", "notes.txt", "rejected.jsonl", "train-00000-of-00001.arrow"]
    assert (out / "notes.txt").read_text() == "mine"
    ok = cli("verify", str(out), "--inputs", str(src))
    assert ok.exit_code == 0 and ok.output.rstrip().endswith("OK"), ok.output
    assert "4 input records reconciled" in ok.output


def test_output_that_is_a_file(tmp_path, src):
    f = tmp_path / "out"
    f.write_text("x")
    r = cli("pack", str(src), "-o", str(f), "-q")
    assert r.exit_code == 2 and "is a file" in r.output


BAD_OPTIONS = {
    "unknown_option": (["--max-tokns", "512"], "unknown option --max-tokns; did you mean --max-tokens?"),
    "unknown_flag": (["--overwrit"], "did you mean --overwrite?"),
    "budget_too_small": (["--max-tokens", "4"], "--max-tokens 4 is out of range; use 8..16,777,216"),
    "budget_too_large": (["--max-tokens", "99999999999"], "is out of range; use 8..16,777,216"),
    "record_bytes_negative": (["--max-record-bytes", "-1"], "--max-record-bytes -1 must be within 1.."),
    "too_many_workers": (["--workers", "100000"], "more than 4 per core"),
    "validation_fraction": (["--validation-fraction", "1"], "--validation-fraction 1.0 must be within [0, 1)"),
    "text_mixed_with_turns": (["--field", "a=text", "--field", "b=assistant"], "cannot be mixed with turn roles"),
    "reject_fraction_range": (["--max-reject-fraction", "1.5"], "must be within [0, 1]"),
    "long_policy": (["--long", "bogus"], "'bogus' is not one of 'drop', 'truncate', 'split'"),
    "field_without_role": (["--field", "question"], "must look like NAME=ROLE"),
    "field_unknown_role": (["--field", "q=robot"], "unknown role 'robot'"),
    "negative_shards": (["--num-shards", "-1"], "must be within 0..99999"),
    "negative_workers": (["--workers", "-1"], "--workers -1 must be >= 1, or 0 for automatic"),
    "missing_template": (["--chat-template", "nope.jinja"], "does not exist"),
    "missing_tokenizer": (["--tokenizer", "/nonexistent/tokenizer"], "cannot load tokenizer"),
    "max_tokens_not_int": (["--max-tokens", "many"], "'many' is not a valid integer"),
}


@pytest.mark.parametrize("name", sorted(BAD_OPTIONS))
def test_bad_options_are_clear_errors(tmp_path, src, name):
    args, words = BAD_OPTIONS[name]
    r = cli("pack", str(src), "-o", str(tmp_path / "out"), "-q", *args)
    assert r.exit_code == 2, r.output
    assert words in r.output, r.output


def test_a_corrupt_input_found_by_a_worker_is_a_counted_dead_letter(tmp_path):
    """Errors as data: a truncated gzip is found while a worker reads it; the records before the cut are
    packed, the rest of the file is one dead letter naming the file, and nothing prints a traceback."""
    import gzip

    body = b"".join(json.dumps({"text": f"record {i} " + "xyz" * (i % 40)}).encode() + b"\n" for i in range(3000))
    data = gzip.compress(body)
    bad = tmp_path / "cut.jsonl.gz"
    bad.write_bytes(data[: len(data) // 2])
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "pack", str(bad), "-o", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    dead = [json.loads(line) for line in open(tmp_path / "out" / "rejected.jsonl")]
    assert [d["reason"] for d in dead] == ["corrupt_input"]
    assert "cut.jsonl.gz is corrupt or truncated" in dead[0]["detail"]
    c = json.load(open(tmp_path / "out" / "manifest.json"))["counts"]
    assert c["records_read"] == c["examples_packed"] + 1 and 0 < c["examples_packed"] < 3000
    assert "corrupt_input" in proc.stdout  # the summary names the reason


# ------------------------------------------------------------------------------------------------
# packstream verify


@pytest.fixture(scope="module")
def packed_out(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_verify")
    src = root / "in.jsonl"
    src.write_text(GOOD * 3 + "{broken\n")
    out = root / "out"
    r = cli("pack", str(src), "-o", str(out), "-q")
    assert r.exit_code == 0, r.output
    return src, out


def test_verify_clean_prints_a_summary(packed_out):
    src, out = packed_out
    r = cli("verify", str(out))
    assert r.exit_code == 0
    assert "1 shards, 1 rows, 3 sequences" in r.output and "1 dead letters" in r.output


def test_verify_arguments(packed_out, tmp_path):
    src, out = packed_out
    r = cli("verify", str(out), str(src))  # input paths need --inputs
    assert r.exit_code == 2 and "put --inputs before input paths" in r.output
    r = cli("verify", str(tmp_path / "missing"))
    assert r.exit_code == 2 and "error: cannot list output folder" in r.output
    (tmp_path / "empty").mkdir()
    r = cli("verify", str(tmp_path / "empty"))
    assert r.exit_code == 1 and "manifest.json: missing" in r.output


def test_verify_with_other_inputs_says_so(packed_out, tmp_path):
    _, out = packed_out
    other = tmp_path / "other.jsonl"
    other.write_text(GOOD)
    r = cli("verify", str(out), "--inputs", str(other))
    assert r.exit_code == 1 and "pass the same inputs as the pack run" in r.output


def test_verify_reports_are_capped(packed_out, tmp_path):
    import shutil

    _, out = packed_out
    bad = tmp_path / "out"
    shutil.copytree(out, bad)
    m = json.loads((bad / "manifest.json").read_text())
    for key in ("rows", "tokens", "target_tokens", "pieces"):
        m["counts"][key] += 1
    (bad / "manifest.json").write_text(json.dumps(m))
    r = cli("verify", str(bad), "--max-problems", "2")
    assert r.exit_code == 1
    assert "... and" in r.output and "more" in r.output


def test_help_lists_verify():
    r = cli("--help")
    assert "verify" in r.output and "pack" in r.output
    r = cli("verify", "--help")
    text = " ".join(r.output.split())  # click rewraps the docstring
    assert "--inputs" in text and "0 when everything matches, 1 on any mismatch" in text
