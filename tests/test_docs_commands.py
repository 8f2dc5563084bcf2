"""Every documented shell command runs as written from a fresh clone (issue 28).

Each block fenced ```bash, ```sh, ```shell or ```console in README.md and docs/*.md is either run here, in the
order of its document, from the root of a copy of a clean clone (tests/conftest.py, ``clone``), or listed in
NOT_RUN with the reason it cannot run here. So a new block in the docs is run, or consciously excused.

- ``packstream`` and ``python`` are the test environment's (the install blocks are declared: they need an index;
  tests/test_packaging.py builds the wheel and installs the sdist offline), importing the clone's code
  (PYTHONPATH); Hugging Face runs offline, and temporary files go inside the copy, as do the blocks' outputs.
- A block that names ``../shared`` (the real data beside the checkout: README.md, "Run the tests") runs where
  that folder exists, through a link beside the copy, and is skipped with the reason otherwise.
- A ```console block's ``$ `` lines are its commands, the other lines their output, compared as printed.
- No block is shortened or rewritten: a command too slow to test is made cheaper in the docs themselves.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import SHARED_DATA

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
SHELL = ("bash", "sh", "shell", "console")
SHARED = SHARED_DATA.parent

NOT_RUN = (  # (document, text that only this block of it holds, why the block is not run here)
    ("README.md", ".venv/bin/pip install . &&", "installs packstream's dependencies from an index (network)"),
    ("README.md", '.venv/bin/pip install -e ".[test]"', "installs from an index, then runs the whole suite, this "
                                                        "test included"),
    ("README.md", '-m "not slow"', "runs the fast tier of this suite, in the virtual environment the install makes"),
    ("README.md", "path/to/Qwen2-VL-7B-Instruct", "needs a Qwen2-VL model's tokenizer, from the Hub (offline here); "
                                                  "the next block runs the same pack on a tokenizer it makes"),
    ("docs/operations.md", 'pip install -e ".[dask]"', "installs from an index (network); the test environment "
                                                      "has every extra"),
    ("docs/operations.md", "gcloud services enable", "needs a Google Cloud project and the gcloud CLI"),
    ("docs/operations.md", "--runner=DataflowRunner", "needs a Dataflow project, a bucket and the SDK image"),
    ("docs/operations.md", "gcloud dataflow flex-template", "needs a Dataflow project and the gcloud CLI"),
    ("docs/operations.md", "beam_flink1.20_job_server", "needs Docker and a Flink or Spark cluster"),
    ("docs/operations.md", "dask scheduler", "needs several hosts; the scheduler and workers run until stopped"),
    ("docs/loader.md", "bench/gpu_check.py", "needs CUDA"),
)


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str

    def __str__(self) -> str:
        return f"{self.doc}:{self.line} ```{self.lang}"


def _blocks(doc: str) -> list[Block]:
    """Every fenced block of one document, in order."""
    blocks, lang, start, body = [], None, 0, []
    for n, line in enumerate((ROOT / doc).read_text().splitlines(), 1):
        fence = re.match(r"\s*```(\S*)\s*$", line)
        if lang is None and fence:
            lang, start, body = fence.group(1), n, []
        elif lang is not None and fence and not fence.group(1):
            blocks.append(Block(doc, start, lang, "\n".join(body) + "\n"))
            lang = None
        elif lang is not None:
            body.append(line)
    assert lang is None, f"{doc}:{start}: a fence that never closes"
    return blocks


def _declared(block: Block) -> str | None:
    return next((why for doc, text, why in NOT_RUN if doc == block.doc and text in block.text), None)


def _to_run(doc: str) -> list[Block]:
    return [b for b in _blocks(doc) if b.lang in SHELL and _declared(b) is None]


def test_every_shell_block_is_run_or_declared_and_every_declaration_is_current():
    shell = [b for doc in DOCS for b in _blocks(doc) if b.lang in SHELL]
    assert len(shell) >= 20, shell
    for doc, text, why in NOT_RUN:
        hits = [b for b in shell if b.doc == doc and text in b.text]
        assert len(hits) == 1, f"NOT_RUN ({doc!r}, {text!r}) matches {len(hits)} shell blocks, not one: {hits}"
        assert why.strip()
    for doc in DOCS:
        for b in _blocks(doc):
            prompts = [line for line in b.text.splitlines() if line.startswith("$ ")]
            assert b.lang != "console" or prompts, f"{b}: a console block shows its commands as '$ ' lines"
            assert b.lang or not prompts, f"{b}: shows '$ ' commands; fence it ```console so it is run"
    assert sum(len(_to_run(doc)) for doc in DOCS) >= 10


def _env(work: Path) -> dict[str, str]:
    (work / "tmp").mkdir()
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(work),  # the clone's code, never the checkout's (the console script's own path)
            "TMPDIR": str(work / "tmp"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def _run(block: Block, work: Path, env: dict[str, str]) -> None:
    def sh(script: str) -> subprocess.CompletedProcess:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, f"{block}\n{script}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
        return r

    if block.lang != "console":
        sh(block.text)
        return
    commands = re.split(r"^\$ ", block.text, flags=re.M)[1:]
    for command in commands:
        script, _, shown = command.partition("\n")
        printed = sh(script).stdout

        def lines(s: str) -> list[str]:
            return [line.rstrip() for line in s.rstrip().splitlines()]

        assert lines(printed) == lines(shown), f"{block}: `{script}` printed\n{printed}"


def _check_outputs(doc: str, work: Path) -> None:
    """What the blocks said they would write is there (the blocks' own exit codes are checked as they run)."""
    if doc == "docs/operations.md":
        assert (work / "out" / "sample" / "manifest.json").exists()
        assert (work / "out" / "dask" / "manifest.json").exists()
        assert json.loads((work / "out" / "pack-log.jsonl").read_text().splitlines()[-1])["event"] == "done"
        assert json.loads((work / "out" / "packed-report.json").read_text())["schema_version"] == 5
        assert sorted(os.listdir(work / "out" / "packed-inspect")) == [  # the marker: inspect owns this folder
            ".packstream-inspect.json", "example_lengths.png", "examples_per_row.png", "row_fill.png"]
    if doc == "README.md" and SHARED.is_dir():
        for folder in ("packed", "pairs"):
            assert json.loads((work / "out" / folder / "manifest.json").read_text())["status"] == "complete"


@pytest.mark.parametrize("doc", [d for d in DOCS if _to_run(d)])
def test_documented_commands_run_as_written(clone, tmp_path, doc):
    """Every shell block of ``doc`` not in NOT_RUN, copy-pasted in order into a shell at the clone's root."""
    work = tmp_path / "packstream"
    shutil.copytree(clone, work)
    if SHARED.is_dir():
        (tmp_path / "shared").symlink_to(SHARED, target_is_directory=True)
    env = _env(work)
    skipped = []
    for block in _to_run(doc):
        if "../shared" in block.text and not SHARED.is_dir():
            skipped.append(str(block))
            continue
        _run(block, work, env)
    _check_outputs(doc, work)
    if skipped:
        pytest.skip(f"not run: {', '.join(skipped)} (they name ../shared, and {SHARED} is absent)")


def _main_job(doc: str = "README.md") -> str:
    """The README's main job command (its block installs first, which needs an index: NOT_RUN), without the
    install, run with the test environment's packstream."""
    (block,) = [b for b in _blocks(doc) if b.lang in SHELL and ".venv/bin/pip install . &&" in b.text]
    command = block.text.strip().split(" && ")[-1]
    assert command.startswith(".venv/bin/packstream pack"), command
    return command.replace(".venv/bin/packstream", "packstream", 1)


def test_a_new_user_follows_the_readme_then_runs_the_docs_test_in_the_same_clone(clone, tmp_path):
    """A fresh git clone: the README's main job, twice (the second run must work as the first did), then every
    README block this test runs, then the docs test itself, run in that clone. Whatever the README wrote must be
    ignored by the clone's .gitignore, or the docs test's own clone copies it and its runs find an earlier output."""
    work = tmp_path / "packstream"
    shutil.copytree(clone, work)
    if SHARED.is_dir():
        (tmp_path / "shared").symlink_to(SHARED, target_is_directory=True)
    git = ["git", "-c", "user.name=new user", "-c", "user.email=user@example.com"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "clone"]):
        subprocess.run(git + args, cwd=work, check=True, capture_output=True, timeout=120)
    env = {**_env(work), "TMPDIR": str(tmp_path)}  # this test's temporary files outside the clone, as a user's are
    (work / "tmp").rmdir()
    main = Block("README.md", 0, "bash", _main_job() + "\n")
    for _ in range(2):
        _run(main, work, env)
    for block in _to_run("README.md"):
        if "../shared" not in block.text or SHARED.is_dir():
            _run(block, work, env)
    written = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=work, check=True,
                             capture_output=True, text=True, timeout=120).stdout.splitlines()
    assert written == [], "the README wrote files its .gitignore does not cover"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_docs_commands.py",
                        "-k", "test_documented_commands_run_as_written"], cwd=work, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
