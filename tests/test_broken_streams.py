"""Compressed inputs that break off, at every stage (issue 42, "Inputs").

Every compressed input is read through one stream (``pipeline._read._files.Decompressed``), so each decompressor's
error (``EOFError`` at a break, ``zlib.error``, ``lzma.LZMAError``, gzip's and bz2's ``OSError``) is one
``CorruptStream``, whatever stage meets it: the launch check, the count, the job's read, ``preview``,
``estimate`` and ``verify --inputs``. Before, a truncated ``.csv.gz`` let ``EOFError`` reach click at the header
check, which printed ``Aborted!`` and exited 1.

The documented outcome (docs/formats.md, "A file that breaks off"): the records before the break are packed, the
rest is one ``corrupt_input`` dead letter at the position after the last good one, counted as one record read;
a file whose first 4 KiB do not decompress (nothing decodes, or the break is inside the header row) is one
``error:`` line at launch (exit 2).

1. Worked examples: truncated ``.csv.gz``, ``.csv.xz`` and ``.tsv.bz2`` through ``pack``, ``verify --inputs``,
   ``preview`` and ``estimate``; files cut inside their header row or first block.
2. A property: any compressed input of any text kind, cut anywhere, reads as a prefix of the intact file's records
   and then at most one ``corrupt_input``; a byte flipped anywhere never lets another exception out.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import logging
import lzma
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from pipeline.cli import main
from tests._internals import _read, read_file
from tests.test_verify import read_rows

ROWS = 3000


def _table(sep: str = ",") -> bytes:
    """``instruction,output`` and ROWS rows; digests in the text, so it compresses poorly (the stream is long)."""
    lines = [f"instruction{sep}output"] + [
        f'"Question {i}: {hashlib.sha256(str(i).encode()).hexdigest() * (i % 5)}"{sep}"Answer {i}"' for i in range(ROWS)]
    return ("\n".join(lines) + "\n").encode()


def _cut(data: bytes) -> bytes:
    return data[: len(data) // 2]


TRUNCATED = [  # name, the file's bytes cut in half
    pytest.param("cut.csv.gz", _cut(gzip.compress(_table())), id="csv.gz"),
    pytest.param("cut.csv.xz", _cut(lzma.compress(_table())), id="csv.xz"),
    # bzip2 decodes whole blocks: 100 kB blocks (level 1), so the half holds some
    pytest.param("cut.tsv.bz2", _cut(bz2.compress(_table("\t") * 1, compresslevel=1)), id="tsv.bz2"),
]


def _pack(*args: str):
    result = CliRunner().invoke(main, ["pack", *args])
    assert isinstance(result.exception, (SystemExit, type(None))), result.exception  # never a traceback
    return result


@pytest.mark.parametrize("name, data", TRUNCATED)
def test_truncated_csv_packs_the_rows_before_the_break_and_one_corrupt_input(tmp_path, caplog, name, data):
    src = tmp_path / name
    src.write_bytes(data)
    out = tmp_path / "out"
    with caplog.at_level(logging.ERROR):
        result = _pack(str(src), "-o", str(out))
    assert result.exit_code == 0 and "Aborted" not in result.output, result.output
    assert not [r for r in caplog.records if r.exc_info]
    (dead,) = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    # Row 1 is the header; row n holds "Question n-2"; the dead letter stands at the row after the last good one.
    assert dead["reason"] == "corrupt_input" and dead["source"] == name, dead
    assert f"{name} is corrupt or truncated (EOFError after position {dead['position'] - 1}" in dead["detail"]
    assert 100 < dead["position"] < ROWS, dead  # the break is in the middle: rows before it were read
    c = json.loads((out / "manifest.json").read_text())["counts"]
    assert c["records_read"] == c["examples_packed"] + 1 == dead["position"] - 1  # rows 2..position-1, + the rest
    assert c["rejected_by_reason"] == {"corrupt_input": 1}
    ids = sorted(int(e.rsplit("@", 1)[1]) for r in read_rows(out) for e in r["example_ids"])
    assert ids == list(range(2, dead["position"]))
    # The last packed row is whole: the row the break falls in is part of the rest, never packed cut short.
    records = [rec for _, rec in _items(src) if isinstance(rec, dict)]
    last = dead["position"] - 1
    assert records[-1]["output"] == f"Answer {last - 2}" and records[-1]["instruction"].startswith(f"Question {last - 2}:")
    # verify re-reads the input, meets the same break, and expects the same dead letter.
    result = CliRunner().invoke(main, ["verify", str(out), "--inputs", str(src)])
    assert result.exit_code == 0 and f"{c['records_read']:,} input records reconciled" in result.output, result.output
    # preview and estimate read it as the job does: the break is a refusal, not an exception.
    result = CliRunner().invoke(main, ["preview", str(src), "-n", str(ROWS)])
    assert result.exit_code == 0 and "REFUSED corrupt_input" in result.output, result.output
    result = CliRunner().invoke(main, ["estimate", str(src)])
    assert result.exit_code == 0 and "corrupt_input" in result.output, result.output


CUT_EARLY = {
    # name: (bytes, words of the one error line); nothing decodes, so nothing could be packed: refused at launch
    "inside the header row (gzip)": ("head.csv.gz", gzip.compress(_table())[:30], "corrupt or truncated gzip file"),
    "inside the header row (xz)": ("head.tsv.xz", lzma.compress(_table("\t"))[:40], "corrupt or truncated xz file"),
    "inside the first block (bzip2, 900 kB blocks)": ("block.csv.bz2", _cut(bz2.compress(_table())),
                                                      "corrupt or truncated bzip2 file"),
}


@pytest.mark.parametrize("case", sorted(CUT_EARLY))
def test_a_file_cut_before_anything_decodes_is_one_error_line(tmp_path, case):
    name, data, words = CUT_EARLY[case]
    (tmp_path / name).write_bytes(data)
    for command in (["pack", str(tmp_path / name), "-o", str(tmp_path / "out")], ["preview", str(tmp_path / name)],
                    ["estimate", str(tmp_path / name)]):
        result = CliRunner().invoke(main, command)
        assert isinstance(result.exception, (SystemExit, type(None))), result.exception
        errors = [line for line in result.output.splitlines() if line.startswith("error: ")]
        assert result.exit_code == 2 and len(errors) == 1 and words in errors[0], (command, result.output)


# -- a property over every text kind and codec ----------------------------------------------------------------


def _zstd(data: bytes) -> bytes:
    import pyarrow as pa

    return pa.compress(data, codec="zstd", asbytes=True)


CODECS = {".gz": gzip.compress, ".xz": lzma.compress, ".bz2": lambda d: bz2.compress(d, 1), ".zst": _zstd}
KINDS = {  # suffix: the file's text from n records
    ".csv": lambda n: _table()[: 60 * n],
    ".tsv": lambda n: _table("\t")[: 60 * n],
    ".jsonl": lambda n: "".join(json.dumps({"text": f"record {i} " + "x" * (i % 37)}) + "\n" for i in range(n)).encode(),
    ".json": lambda n: json.dumps([{"text": f"item {i} " + "y" * (i % 29)} for i in range(n)], indent=1).encode(),
    ".txt": lambda n: "".join(f"line {i} " + "z" * (i % 41) + "\n" for i in range(n)).encode(),
}


def _items(path: Path) -> list:
    f = _read.InputFile(str(path), path.name, _read.file_kind(str(path)))
    return list(_read.until_break(read_file(f, 2**24)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(sorted(KINDS)), codec=st.sampled_from(sorted(CODECS)), n=st.integers(5, 400),
       cut=st.floats(0.05, 0.999), flip=st.booleans())
def test_a_broken_stream_reads_as_a_prefix_then_one_corrupt_input(tmp_path, kind, codec, n, cut, flip):
    plain = KINDS[kind](n)
    data = CODECS[codec](plain)
    whole = tmp_path / f"whole{kind}{codec}"
    whole.write_bytes(data)
    expected = _items(whole)
    at = max(1, int(len(data) * cut))
    broken = tmp_path / f"broken{kind}{codec}"
    if flip:  # a flipped byte: some decompressors pass garbage on before a checksum fails; only no escape is checked
        broken.write_bytes(data[:at] + bytes([data[at % len(data)] ^ 0xFF]) + data[at + 1:])
        _items(broken)
        return
    broken.write_bytes(data[:at])
    got = _items(broken)  # only a CorruptInput may end it (until_break): any other exception fails here
    assert got, "a cut file reads as at least its corrupt_input"
    *good, last = got
    assert isinstance(last[1], _read._tasks.Rejected) and last[1].reason.value == "corrupt_input", last
    assert good == expected[: len(good)]  # nothing invented, nothing cut short before the break
    assert last[0] == (good[-1][0] + 1 if good else 0)
