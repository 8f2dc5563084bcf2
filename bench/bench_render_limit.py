"""What the render time limit costs: the same template compiled with and without its deadline checks.

    python bench/bench_render_limit.py [--repeats 5] [--rounds 200]

The time limit on Jinja chat templates (``pipeline._render.time_limit``) is a check at the top of every block
the compiled template runs. This renders the test conversations (``tests/test_render.py``: plain, reasoning,
tool calls, ...) through a Qwen-like template ``--rounds`` times, best of ``--repeats``, once with the checks
and once with Jinja's plain code generator, in one process, and prints both and their ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timed(rounds: int, repeats: int) -> float:
    from pipeline import _render
    from pipeline._formats import Rejected
    from pipeline._options import FormatOptions
    from tests.test_render import CONVERSATIONS, QWEN_LIKE, qwen_renderer

    _render.compile_template.cache_clear()
    renderer, fmt, convs = qwen_renderer(QWEN_LIKE), FormatOptions(), list(CONVERSATIONS.values())

    def once():
        for c in convs:
            try:
                renderer.segments(c, fmt)
            except Rejected:
                pass

    once()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(rounds):
            once()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args(argv)
    from jinja2.compiler import CodeGenerator

    from pipeline import _render

    checked = timed(args.rounds, args.repeats)
    bounded = _render._bounded_code_generator
    _render._bounded_code_generator = lambda: CodeGenerator
    try:
        plain = timed(args.rounds, args.repeats)
    finally:
        _render._bounded_code_generator = bounded
        _render.compile_template.cache_clear()
    print(f"with deadline checks {checked:.3f} s, plain Jinja {plain:.3f} s: ratio {checked / plain:.3f}")


if __name__ == "__main__":
    main()
