"""Run ``packstream pack`` in this process and SIGKILL it from inside a phase of the job.

    python -m tests._kill count PACK-ARGS...        run to the end; print {phase: calls} as JSON
    python -m tests._kill PHASE N PACK-ARGS...      SIGKILL at the N-th call of PHASE

The job runs in this process (the local runner, one worker), so patching the functions
of each phase reaches every step: the kill comes from the phase itself, not from a timer.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def _install(target: tuple[str, int] | None, counts: dict[str, int]) -> None:
    from tests._internals import Encoder, _read, _rows, _spill, _write

    def hit(phase: str) -> None:
        counts[phase] = counts.get(phase, 0) + 1
        if target is not None and target == (phase, counts[phase]):
            os.kill(os.getpid(), signal.SIGKILL)

    def after(phase, fn):
        def wrapped(*a, **kw):
            out = fn(*a, **kw)
            hit(phase)
            return out
        return wrapped

    def before(phase, fn):
        def wrapped(*a, **kw):
            hit(phase)
            return fn(*a, **kw)
        return wrapped

    real_read = _read.read_task

    def read_task(task, max_bytes):
        for item in real_read(task, max_bytes):
            hit("read")
            yield item

    _read.read_task = read_task
    Encoder.finish = after("encode", Encoder.finish)
    _spill.write_part = after("spill", _spill.write_part)
    _rows.pack_group = before("pack", _rows.pack_group)
    _write.ShardWriter.write = after("shard_write", _write.ShardWriter.write)
    _write.write_reject_part = after("reject_part", _write.write_reject_part)
    _write.merge_rejected = after("merge_rejected", _write.merge_rejected)
    real_replace = os.replace

    def replace(src, dst, *a, **kw):
        name = os.path.basename(str(dst))
        if name.startswith(("train-", "validation-")):
            hit("shard_rename")
        out = real_replace(src, dst, *a, **kw)
        if name in ("README.md", "manifest.json", "rejected.jsonl"):
            hit(f"wrote_{name}")
        return out

    os.replace = replace


def main(argv: list[str]) -> None:
    from pipeline.cli import main as cli

    counts: dict[str, int] = {}
    if argv[0] == "count":
        _install(None, counts)
        args = argv[1:]
    else:
        _install((argv[0], int(argv[1])), counts)
        args = argv[2:]
    try:
        cli.main(args=args, prog_name="packstream", standalone_mode=False)
    finally:
        if argv[0] == "count":
            print("COUNTS " + json.dumps(counts), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
