"""Safe by construction (issue 10): every case a careless or hostile user hit, on the ``pack`` side.

The output folder is packstream's alone; one run holds it at a time; a run that fails leaves no
complete manifest; user mistakes end in one ``error:`` line (exit 2), never a traceback or a hang;
a file is read once and a record has one identity; options are checked before any work. (What
the loader and ``verify`` refuse is in tests/test_loader_trust.py and tests/test_verify.py.)
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import packers
from pipeline.cli import main

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}


def cli(*args: str):
    r = CliRunner().invoke(main, list(args))
    assert isinstance(r.exception, (SystemExit, type(None))), repr(r.exception)
    assert "Traceback" not in r.output
    return r


def user_error(r, *words: str) -> None:
    """Exit 2 with exactly one ``error:`` line holding ``words``, no traceback."""
    errors = [line for line in r.output.splitlines() if line.startswith("error: ")]
    assert r.exit_code == 2 and len(errors) == 1, r.output
    for w in words:
        assert w in errors[0], errors[0]


def write_jsonl(path: Path, records, n: int = 1) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records) * n)
    return path


# -- 1. --overwrite never touches what is not packstream's; the output is never an input ----------


def test_output_holding_the_input_is_refused_and_nothing_is_deleted(tmp_path):
    proj = tmp_path / "proj"
    src = write_jsonl(proj / "train-data.jsonl", [GOOD])
    (proj / "README.md").write_text("my project")
    (proj / "rejected_ideas.txt").write_text("ideas")
    before = {p.name: p.read_bytes() for p in proj.iterdir()}
    user_error(cli("pack", str(src), "-o", str(proj), "--overwrite", "-q"), "holds input", "somewhere else")
    assert {p.name: p.read_bytes() for p in proj.iterdir()} == before


@pytest.mark.parametrize("where", ["inside", "same"])
def test_output_inside_or_equal_to_an_input_folder_is_refused(tmp_path, where):
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", [GOOD])
    out = data / "packed" if where == "inside" else data
    user_error(cli("pack", str(data), "-o", str(out), "-q"), "--output", "input")
    assert sorted(p.name for p in data.iterdir()) == ["a.jsonl"]


def test_output_through_a_symlink_to_the_input_folder_is_refused(tmp_path):
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", [GOOD])
    link = tmp_path / "link"
    link.symlink_to(data)
    user_error(cli("pack", str(data / "a.jsonl"), "-o", str(link), "-q", "--overwrite"), "input")


def test_overwrite_removes_only_what_the_manifest_lists(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD], n=5)
    out = tmp_path / "out"
    assert cli("pack", str(src), "-o", str(out), "-q").exit_code == 0
    (out / "train-mine.txt").write_text("mine")  # looks like ours, is not listed: kept
    (out / "rejected_ideas.txt").write_text("mine")
    assert cli("pack", str(src), "-o", str(out), "-q", "--overwrite").exit_code == 0
    assert (out / "train-mine.txt").read_text() == "mine" and (out / "rejected_ideas.txt").read_text() == "mine"


# -- 2. one run per folder; a failed run leaves no complete manifest -------------------------------


def _pack_proc(src: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pipeline.cli", "pack", str(src), "-o", str(out), "-q", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def test_two_runs_started_together_on_one_folder_exactly_one_wins(tmp_path):
    # Big enough that the winner still runs when the other one, started at the same moment, claims the folder.
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": f"record {i} " + "lorem ipsum dolor " * 30} for i in range(40_000)])
    out = tmp_path / "out"
    procs = [_pack_proc(src, out), _pack_proc(src, out)]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    codes = sorted(r[2] for r in results)
    assert codes == [0, 2], results
    loser = next(r for r in results if r[2] == 2)
    errors = [line for line in loser[1].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and ".packstream.lock" in errors[0] and "Traceback" not in loser[1], loser[1]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "complete" and {s["name"] for s in manifest["shards"]} == {
        n for n in os.listdir(out) if n.endswith(".arrow")}
    assert not (out / ".packstream.lock").exists()


def test_a_stale_lock_is_reported_and_overwrite_breaks_it(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    import socket

    (out / ".packstream.lock").write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(),
                                                     "started": "2026-01-01T00:00:00Z"}))
    user_error(cli("pack", str(src), "-o", str(out), "-q"), ".packstream.lock", "killed run", "--overwrite")
    with pytest.raises(packers.PackstreamError, match="lock"):
        packers.PackedDataset(str(out))
    assert cli("pack", str(src), "-o", str(out), "-q", "--overwrite").exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"


def _start_ticks(pid: int) -> int:
    """Process ``pid``'s start time in clock ticks since boot (/proc/PID/stat field 22), as the lock records it."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        pytest.skip("needs /proc (Linux)")
    return int(data[data.rindex(b")") + 2:].split()[19])


def _lock(out: Path, pid: int, **extra) -> None:
    """A lock as packstream writes it (who runs: pid, host, boot id, the process's start time, run id)."""
    import socket

    out.mkdir(exist_ok=True)
    body = {"pid": pid, "host": socket.gethostname(), "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "pid_start": f"ticks:{_start_ticks(pid)}", "started": "2026-01-01T00:00:00Z", "run": "0123456789ab", **extra}
    (out / ".packstream.lock").write_text(json.dumps(body))


@pytest.fixture
def live_pid():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def test_a_live_lock_is_never_broken(tmp_path, live_pid):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    out = tmp_path / "out"
    _lock(out, live_pid)
    r = cli("pack", str(src), "-o", str(out), "-q", "--overwrite")
    user_error(r, "still going", f"kill {live_pid}", f"rm {out / '.packstream.lock'}")  # how to clear a truly stale one
    assert (out / ".packstream.lock").exists()


# -- issue 16, cause 13: a lock names its run by more than a pid -----------------------------------


@pytest.mark.parametrize("case", ["pid_reused", "this_process", "rebooted"])
def test_a_lock_whose_pid_is_alive_but_another_process_is_stale(tmp_path, live_pid, case):
    """The pid in a dead run's lock may belong to a live, unrelated process (pid reuse; pid 1 in a container),
    or to the new run itself: the lock's start time, boot id and run id tell them apart."""
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    out = tmp_path / "out"
    if case == "pid_reused":  # a live process, but not the one that took the lock: its start time differs
        _lock(out, live_pid, pid_start=f"ticks:{_start_ticks(live_pid) - 1000}")
    elif case == "this_process":  # the run restarted with the same pid (pid 1 in a container), the old run's lock
        _lock(out, os.getpid())
    else:  # the machine restarted since the lock was taken
        _lock(out, live_pid, boot_id="00000000-0000-0000-0000-000000000000")
    (out / "train-00000-of-00001.arrow").write_bytes(b"left by the killed run")
    user_error(cli("pack", str(src), "-o", str(out), "-q"), "killed run" if case != "this_process" else "stopped left it",
               "--overwrite")
    r = cli("pack", str(src), "-o", str(out), "-q", "--overwrite")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    assert not (out / ".packstream.lock").exists()


# -- issue "Every failure ends as a failure": lock advice true where pids repeat -----------------------


@pytest.mark.skipif(os.getpid() == 1 or not os.path.exists("/proc/1"), reason="needs a pid 1 that is not this process")
def test_an_old_style_lock_of_pid_1_is_not_taken_for_a_live_run(tmp_path):
    """An older packstream's lock records a pid, the host and when, but no boot id or process start time. Its
    pid 1 is alive (the first process of this machine or container), so the lock cannot prove that pid 1 is
    its run, nor that it is not. The message said "that run is still going" and advised "kill 1"; now it says
    what the lock lacks and how to tell (the process's start against the lock's time), and never names a pid
    to kill. The lock still stands with --overwrite (it may be a live run): removed by hand, the run goes on."""
    import socket

    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    out = tmp_path / "out"
    out.mkdir()
    lock = out / ".packstream.lock"
    lock.write_text(json.dumps({"pid": 1, "host": socket.gethostname(), "started": "2024-01-01T00:00:00Z"}))
    for extra in ([], ["--overwrite"]):
        r = cli("pack", str(src), "-o", str(out), "-q", *extra)
        user_error(r)
        assert r.output.strip() == (
            f"error: --output {out} is locked by another packstream run (.packstream.lock: pid 1 on "
            f"{socket.gethostname()}, since 2024-01-01T00:00:00Z; pid 1 is alive here, but the lock records no boot id "
            "or process start time to tell that run from another process with pid 1 (in a container every run is "
            "pid 1)); if `ps -o lstart=,args= -p 1` shows no packstream run that started before 2024-01-01T00:00:00Z, "
            f"that run is gone: rm {lock}, then pass --overwrite; else wait for it")
        assert "kill" not in r.output and "still going" not in r.output
    lock.unlink()
    assert cli("pack", str(src), "-o", str(out), "-q", "--overwrite").exit_code == 0


def test_a_lock_of_only_a_pid_says_so_and_overwrite_breaks_it(tmp_path):
    """The oldest locks hold a pid alone: nothing places it on this machine, so nothing tells whether that run
    goes, and --overwrite breaks it (as for a lock from another host)."""
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    out = tmp_path / "out"
    out.mkdir()
    (out / ".packstream.lock").write_text('{"pid": 1}')
    r = cli("pack", str(src), "-o", str(out), "-q")
    user_error(r)
    assert r.output.strip() == (
        f"error: --output {out} is locked by another packstream run (.packstream.lock: pid 1; it records no host, boot "
        "id or process start time (an older packstream wrote it), so nothing tells whether that run still goes); "
        "if no run is active, pass --overwrite to break the lock and clear what that run left")
    assert cli("pack", str(src), "-o", str(out), "-q", "--overwrite").exit_code == 0


def test_a_live_pid_is_named_to_stop_only_when_the_lock_proves_it_is_its_run(tmp_path, live_pid):
    """The same live process, its start time recorded: with the boot id too the lock proves the process is its
    run (kill PID stops it); without the boot id (on a machine that has one) it proves nothing."""
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    _lock(tmp_path / "proven", live_pid)
    user_error(cli("pack", str(src), "-o", str(tmp_path / "proven"), "-q"), "still going", f"(kill {live_pid})")
    _lock(tmp_path / "unproven", live_pid, boot_id=None)
    r = cli("pack", str(src), "-o", str(tmp_path / "unproven"), "-q")
    user_error(r, f"pid {live_pid} is alive here, but the lock records no boot id to tell that run from another "
                  f"process with pid {live_pid}", f"ps -o lstart=,args= -p {live_pid}")
    assert "kill" not in r.output


def test_a_lock_removed_by_hand_leaves_a_folder_overwrite_still_clears(tmp_path, live_pid):
    """The message for a live-looking lock says `rm` it; what the run left is still packstream's (its guard card)."""
    from tests._internals import _write

    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    out = tmp_path / "out"
    _lock(out, live_pid)
    (out / "README.md").write_text(_write.guard_card("A packstream run is writing this folder."))
    (out / "train-00000-of-00002.arrow").write_bytes(b"partial")
    (out / ".packstream.lock").unlink()
    user_error(cli("pack", str(src), "-o", str(out), "-q"), "unfinished packstream run", "--overwrite")
    r = cli("pack", str(src), "-o", str(out), "-q", "--overwrite")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "manifest.json", "rejected.jsonl",
                                                     "train-00000-of-00001.arrow"]


@pytest.mark.parametrize("records,fraction,words", [
    ([{"bogus": 1}, {"answer": 2}, {"messages": []}], "0.5", ["no example was packed"]),
    ([GOOD, {"bogus": 1}, {"bogus": 2}], "0.5", ["--max-reject-fraction", "unknown_format 2"]),  # too many rejected
])
def test_an_exit_3_run_leaves_a_failed_manifest_and_publishes_no_data(tmp_path, records, fraction, words):
    """A failed run's manifest says failed (exit 3), its lock is gone, and its card points at no data, so
    datasets.load_dataset refuses the folder, like PackedDataset and verify."""
    import datasets

    src = write_jsonl(tmp_path / "in.jsonl", records)
    out = tmp_path / "out"
    r = cli("pack", str(src), "-o", str(out), "--max-reject-fraction", fraction)
    assert r.exit_code == 3 and "unknown_format" in r.output, r.output  # the summary's reasons
    assert all(w in r.output for w in words), r.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["exit_code"] == 3
    assert not (out / ".packstream.lock").exists()
    card = (out / "README.md").read_text()
    assert "train-*" not in card and "This packstream run failed" in card
    for streaming in (False, True):
        with pytest.raises(FileNotFoundError, match="packstream-output-not-complete"):
            datasets.load_dataset(str(out), streaming=streaming)
    with pytest.raises(packers.PackstreamError, match="failed"):
        packers.PackedDataset(str(out))
    assert cli("verify", str(out)).exit_code == 1


# -- 6. one error line, never a traceback ----------------------------------------------------------


@pytest.mark.parametrize("output,words", [
    ("/", ["filesystem root"]), ("", ["--output is empty"]), ("/proc/packstream-x", ["cannot be created"]),
    ("~", ["home folder"]),
])
def test_outputs_that_are_no_folder_of_their_own(tmp_path, output, words):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    user_error(cli("pack", str(src), "-o", output, "-q"), *words)


def test_absolute_and_relative_inputs_mixed(tmp_path, monkeypatch):
    a = write_jsonl(tmp_path / "d1" / "a.jsonl", [GOOD])
    write_jsonl(tmp_path / "d2" / "b.jsonl", [GOOD])
    monkeypatch.chdir(tmp_path)
    r = cli("pack", str(a), "d2/b.jsonl", "-o", str(tmp_path / "out"), "-q")
    assert r.exit_code == 0, r.output
    sources = {i["source"] for i in json.loads((tmp_path / "out" / "manifest.json").read_text())["inputs"]}
    assert sources == {"d1/a.jsonl", "d2/b.jsonl"}


def test_a_chat_template_that_is_not_utf8(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    tpl = tmp_path / "t.jinja"
    tpl.write_bytes(b"{% for m in messages %}\xff\xfe{{ m['content'] }}{% endfor %}")
    user_error(cli("pack", str(src), "-o", str(tmp_path / "out"), "--chat-template", str(tpl)), "not UTF-8")


def test_disk_full_while_writing_is_one_error_line_and_a_failed_manifest(tmp_path, monkeypatch):
    from tests._internals import _write

    src = write_jsonl(tmp_path / "in.jsonl", [GOOD], n=50)
    real = _write.ShardWriter.write

    def write(self, batch):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_write.ShardWriter, "write", write)
    r = cli("pack", str(src), "-o", str(tmp_path / "out"))
    user_error(r, "cannot write to --output", "No space left on device")
    monkeypatch.setattr(_write.ShardWriter, "write", real)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and "No space left" in manifest["error"]
    assert not [n for n in os.listdir(tmp_path / "out") if n.startswith((".tmp", ".packstream"))]


def test_a_user_error_a_step_finds_is_one_error_line_and_a_failed_manifest(tmp_path, monkeypatch):
    """A user error found by a step (here: an input that changed under the run) travels to the commit as a
    typed failure; the launcher raises it from the failed manifest: one line, exit 2, nothing left over."""
    from tests._internals import _read

    def read_task(task, max_bytes):
        raise packers.PackstreamError(f"input {task.file.source} changed while it was read; pack it again")
        yield

    monkeypatch.setattr(_read, "read_task", read_task)
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD], n=20)
    out = tmp_path / "out"
    r = cli("pack", str(src), "-o", str(out))
    user_error(r, "input in.jsonl changed while it was read; pack it again")
    assert "[while running" not in r.output  # the message, not a runner's wrapping of it
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["exit_code"] == 2
    assert manifest["error"] == "input in.jsonl changed while it was read; pack it again"
    assert not [n for n in os.listdir(out) if n.startswith((".tmp", ".packstream", "train-"))]


def test_a_user_error_in_a_worker_process_is_one_error_line(tmp_path):
    """The same from a forked worker process (``--workers 2``): no traceback, no runner text, one line."""
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD], n=50)
    out = tmp_path / "out"
    script = (
        "import sys\n"
        "from packers import PackstreamError\n"
        "from pipeline import _rows\n"
        "def broken(*a, **kw):\n"
        "    raise PackstreamError('group too odd to pack; fix the input')\n"
        "_rows.pack_group = broken  # the forked workers inherit it\n"
        "from pipeline.cli import main\n"
        f"main(['pack', {str(src)!r}, '-o', {str(out)!r}, '--workers', '2', '--tokenizer-threads', '1'], "
        "prog_name='packstream')\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == ["error: group too odd to pack; fix the input"], proc.stderr[-3000:]
    assert json.loads((out / "manifest.json").read_text())["error"] == "group too odd to pack; fix the input"


def test_a_file_size_limit_while_writing_is_one_error_line(tmp_path):
    """A real EFBIG: the process runs under RLIMIT_FSIZE, so writes past 64 KiB fail in the worker."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": f"record {i} " + "lorem ipsum " * 40} for i in range(400)])

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))

    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "pack", str(src), "-o", str(tmp_path / "out")],
                          preexec_fn=limit, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "too large" in errors[0].lower(), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


# -- 7. no hangs ------------------------------------------------------------------------------------


def test_a_fifo_input_is_refused_at_once(tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    started = time.time()
    user_error(cli("pack", str(fifo), "-o", str(tmp_path / "out"), "-q"), "FIFO", "regular file")
    assert time.time() - started < 60


# -- 8. one identity per file and per record --------------------------------------------------------


def test_the_same_file_twice_is_read_once(tmp_path):
    d = tmp_path / "d"
    write_jsonl(d / "x.jsonl", [GOOD], n=3)
    (d / "link.jsonl").symlink_to(d / "x.jsonl")
    out = tmp_path / "out"
    r = cli("pack", str(d / "x.jsonl"), str(d / "." / "x.jsonl"), str(d), "-o", str(out))
    assert r.exit_code == 0, r.output
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["records_read"] == 3 and [i["source"] for i in m["inputs"]] == ["x.jsonl"]
    assert any("same file" in n for n in m["inputs_read_once"])


def test_explicit_ids_and_positions_never_collide_and_id_types_are_kept(tmp_path):
    recs = [GOOD, {"id": "1", **GOOD}, {"id": 1, **GOOD}, {"id": "a:b@c#1~2", **GOOD}, {"id": 2.5, **GOOD}]
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    out = tmp_path / "out"
    assert cli("pack", str(src), "-o", str(out), "-q").exit_code == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["examples_packed"] == 5 and m["counts"]["rejected"] == 0
    import datasets

    ids = sorted(i for r in datasets.Dataset.from_file(str(next(out.glob("train-*.arrow")))) for i in r["example_ids"])
    assert ids == sorted(['in.jsonl@1', 'in.jsonl:"1"', 'in.jsonl:1', 'in.jsonl:a:b@c%231%7E2', 'in.jsonl:2.5'])


# -- 9. options and odd files --------------------------------------------------------------------


def test_a_file_named_like_a_glob_is_taken_literally(tmp_path):
    src = write_jsonl(tmp_path / "a[1].jsonl", [GOOD])
    write_jsonl(tmp_path / "a1.jsonl", [GOOD, GOOD])  # what the glob would match instead
    out = tmp_path / "out"
    assert cli("pack", str(src), "-o", str(out), "-q").exit_code == 0
    m = json.loads((out / "manifest.json").read_text())
    assert [i["source"] for i in m["inputs"]] == ["a[1].jsonl"] and m["counts"]["records_read"] == 1


@pytest.mark.parametrize("newline", [b"\r", b"\r\n", b"\n"])
def test_every_line_ending_splits_records(tmp_path, newline):
    src = tmp_path / "in.jsonl"
    src.write_bytes(newline.join(json.dumps({**GOOD, "id": f"r{i}"}).encode() for i in range(5)) + newline)
    out = tmp_path / "out"
    assert cli("pack", str(src), "-o", str(out), "-q").exit_code == 0
    c = json.loads((out / "manifest.json").read_text())["counts"]
    assert c["records_read"] == 5 and c["examples_packed"] == 5


def test_a_one_line_json_array_in_a_jsonl_is_a_clear_error(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps([GOOD] * 10))
    user_error(cli("pack", str(src), "-o", str(tmp_path / "out")), "one JSON array on a single line", ".json")


def test_quiet_silences_worker_processes(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD], n=200)
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "pack", str(src), "-o", str(tmp_path / "out"), "-q",
                           "--workers", "2"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == "" and proc.stderr == "", proc.stderr[-3000:]


# -- issue 16, causes 19 and 21: output paths, and one error line whatever a path holds --------------


def test_a_file_url_output_keeps_its_leading_slash(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    out = tmp_path / "packed"
    r = cli("pack", str(src), "-o", f"file://{out}", "-q")
    assert r.exit_code == 0, r.output
    assert json.loads((out / "manifest.json").read_text())["config"]["output"] == str(out)


@pytest.mark.parametrize("output,words", [
    ("file://otherhost/x", ["file:///absolute/path"]),
    ("ftp://host/folder", ["no filesystem for ftp://"]),
])
def test_an_output_url_packstream_cannot_write_is_one_line(tmp_path, output, words):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    user_error(cli("pack", str(src), "-o", output, "-q"), *words)


def test_a_dangling_output_symlink_is_named_as_such(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    link = tmp_path / "out"
    link.symlink_to(tmp_path / "gone")
    user_error(cli("pack", str(src), "-o", str(link), "-q"), "dangling symlink", "gone")
    assert link.is_symlink() and not (tmp_path / "gone").exists()


@pytest.mark.parametrize("where", ["output", "input", "option"])
def test_a_control_character_in_a_path_never_splits_the_error_line(tmp_path, where):
    """Every message goes through the CLI's one printer, which escapes control characters: a newline (or a
    terminal escape) in a path shows as \\n, on the one line."""
    src = write_jsonl(tmp_path / "in.jsonl", [GOOD])
    odd = "/proc/new\nline\x1b[31m"
    args = {"output": ["pack", str(src), "-o", odd], "input": ["pack", odd + ".jsonl", "-o", str(tmp_path / "o")],
            "option": ["pack", str(src), "-o", str(tmp_path / "o"), "--bogus\nflag"]}[where]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and "\x1b[31m" not in r.output and "Traceback" not in r.output, r.output
    lines = [line for line in r.output.splitlines() if "new" in line or "bogus" in line]
    assert len(lines) == 1 and ("\\n" in lines[0]) and ("line" in lines[0] or "flag" in lines[0]), r.output
