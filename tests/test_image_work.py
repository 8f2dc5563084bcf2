"""``--workers auto`` and the read tasks of a ``--processor`` run count its images' work (issue 45), not only the
JSONL's bytes: a few dozen KiB of records naming large images is seconds of work, once one worker and one task.

The work is measured, not assumed (:func:`pipeline._media.image_work`: images per record from a sample, and the
time :func:`pipeline._media.measure` takes on a few of them); these tests pin the arithmetic by setting what a
MiB of text costs, so the choices do not depend on this machine's speed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipeline import PackOptions
from tests._internals import _media, _read, parallel
from tests.test_vision_pipeline import tokenizer  # noqa: F401 - a fixture

PIL = pytest.importorskip("PIL.Image")


def _image_set(root: Path, records: int, share: float = 1.0) -> Path:
    """``records`` records; about ``share`` of them (seeded) name an image (one file, shared)."""
    import random

    rng = random.Random(0)
    PIL.new("RGB", (640, 480), "red").save(root / "a.png")
    lines = []
    for r in range(records):
        content = ([{"type": "image_url", "image_url": {"url": "a.png"}}] if rng.random() < share else []) + [
            {"type": "text", "text": f"what is in picture {r}?"}]
        lines.append(json.dumps({"id": f"r{r}", "messages": [{"role": "user", "content": content},
                                                             {"role": "assistant", "content": "a red square"}]}))
    (root / "d.jsonl").write_text("\n".join(lines) + "\n")
    return root / "d.jsonl"


def _work(path: Path, tokenizer: str, **over) -> _media.Work | None:  # noqa: F811
    options = PackOptions(inputs=(str(path),), tokenizer=tokenizer, output=str(path.parent / "out"), **over)
    files = _read.expand_datasets(options.datasets())[0]
    return _media.image_work(options, files, [_read.input_bytes(f) for f in files])


@pytest.mark.parametrize("share", [1.0, 0.3])
def test_the_images_are_counted_from_a_sample(tmp_path, tokenizer, share):  # noqa: F811
    path = _image_set(tmp_path, 600, share)
    expected = sum('"image_url"' in line for line in path.read_text().splitlines())
    work = _work(path, tokenizer, processor="qwen2-vl")
    assert work is not None and abs(work.images - expected) <= expected * 0.25
    assert work.seconds_per_image > 0 and work.scale > 1
    assert work.bytes == pytest.approx(work.input_bytes + work.images * work.seconds_per_image
                                       / _media.TEXT_SECONDS_PER_MIB * 2**20)
    assert "images at" in work.describe()


def test_a_text_run_or_one_without_images_has_no_image_work(tmp_path, tokenizer):  # noqa: F811
    path = _image_set(tmp_path, 20)
    assert _work(path, tokenizer) is None  # no --processor
    text = tmp_path / "t.jsonl"
    text.write_text('{"prompt": "a", "completion": "b"}\n' * 20)
    assert _work(text, tokenizer, processor="qwen2-vl") is None


def test_auto_starts_workers_and_cuts_tasks_by_the_images_work(tmp_path, tokenizer):  # noqa: F811
    """240 image records (~50 KiB): by bytes, one worker and one read task; by their images' work (set here to cost
    what 8 MiB of text does), a worker per core and several tasks each."""
    path = _image_set(tmp_path, 240)
    work = _work(path, tokenizer, processor="qwen2-vl")
    work = dataclasses.replace(work, seconds_per_image=8 * _media.TEXT_SECONDS_PER_MIB / work.images)
    assert 8 * 2**20 < work.bytes < 9 * 2**20
    files = _read.expand_datasets(PackOptions(inputs=(str(path),)).datasets())[0]

    by_bytes = parallel.choose(0, 0, work.input_bytes, n_cores=4,
                               read_tasks=lambda n: _read.read_tasks(files, work.input_bytes, n))
    assert by_bytes.workers == 1 and "a small input" in by_bytes.why
    assert len(_read.cut_tasks(files[0], _read.task_bytes(work.input_bytes, 2))) == 1

    by_work = parallel.choose(0, 0, work.bytes, n_cores=4, size_note=work.describe(),
                              read_tasks=lambda n: _read.read_tasks(files, work.bytes, n, work.scale))
    assert by_work.workers == 4 and work.describe() in by_work.why
    tasks = _read.cut_tasks(files[0], _read.task_bytes(work.bytes, by_work.workers, work.scale))
    assert len(tasks) >= 2 * by_work.workers
    records = [r for t in tasks for r in _read.read_task(t, 2**20)]
    assert [pos for pos, _ in records] == list(range(1, 241))  # every record read once, in order


def test_a_pack_names_the_image_work_it_chose_its_workers_by(tmp_path, tokenizer):  # noqa: F811
    from click.testing import CliRunner

    from pipeline.cli import main

    path = _image_set(tmp_path, 12)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["pack", str(path), "--processor", "qwen2-vl", "--tokenizer", tokenizer,
                                       "-o", str(out), "-q"])
    assert result.exit_code == 0, result.output
    why = json.loads((out / "manifest.json").read_text())["run"]["why"]
    assert "~12 images at" in why and "the work of" in why
