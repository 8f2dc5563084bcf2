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
