"""Shared fixtures: the real data in ../shared/data (skipped with a reason where absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
GSM8K_FIELDS = (("question", "user"), ("answer", "assistant"))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def shared_data() -> Path:
    if not (SHARED_DATA / "gsm8k" / "train.jsonl").exists():
        pytest.skip(f"real data not found at {SHARED_DATA} (the ../shared/data folder beside the checkout)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    return shared_data()


@pytest.fixture(scope="session")
def small_run(tmp_path_factory) -> Path:
    """One real ``pack`` output, packed once per session for the tests that edit or abuse a folder
    (tests/test_folder_trust.py, tests/test_manifest_fuzz.py; copy it before changing it): the bundled
    sample plus three bad records (a record with no user turn, a broken line, one too long), budget 512,
    two train and two validation shards, three dead letters."""
    import json
    import shutil

    from pipeline import PackOptions, run
    from pipeline.cli import bundled_sample

    root = tmp_path_factory.mktemp("small-run")
    data, out = root / "in", root / "out"
    shutil.copytree(bundled_sample(), data)
    (data / "bad.jsonl").write_text('{"messages": [{"role": "assistant", "content": "hi"}]}\n{broken\n'
                                    + json.dumps({"text": " ".join(f"w{i}" for i in range(900))}) + "\n")
    run(PackOptions(inputs=(str(data),), output=str(out), max_tokens=512, num_shards=2, group_size=8,
                    validation_fraction=0.25))
    return out
