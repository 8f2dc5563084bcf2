"""A bench script of bench/ loaded as a module, for the tests that run a bench end to end on tiny inputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCHES = Path(__file__).resolve().parents[1] / "bench"


def load_bench(name: str):
    """``bench/<name>.py`` as a module (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
