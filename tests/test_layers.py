"""The layering of ../shared/STYLE.md, checked on the source: no import circles, each layer imports
only the layers below it, packing needs no torch, training needs no pipeline.

    Face     pipeline/cli.py, pipeline/__init__.py
    Job      the Beam composites and launcher, progress   Tools   verify, inspect, estimate, preview
    Encode   one stage: records -> encoded examples + typed rejections
    Workers  the processes: signals, local workers, the warm pool, sharing cores, Dask
    Stages   read, formats, render, rows, write, options, spill, tokenizer, output, trace, report, fs, arrow
    Core     packers: pack, stats, schema, errors, manifest, files     Loader   packers: collate, dataset, attention

Every import counts, at module level or inside a function (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LAYERS = {
    "face": {"pipeline.cli", "pipeline"},
    "job": {"pipeline._job", "pipeline._progress"},
    "tools": {"pipeline._tools"},
    "encode": {"pipeline._encode"},
    "workers": {"pipeline._workers"},
    "stages": {"pipeline._read", "pipeline._formats", "pipeline._render", "pipeline._image_parts", "pipeline._rows", "pipeline._long", "pipeline._write",
               "pipeline._options", "pipeline._spill", "pipeline._tokenizer", "pipeline._output", "pipeline._trace",
               "pipeline._exit", "pipeline._report", "pipeline._sink", "pipeline._fs", "pipeline._arrow",
               "pipeline._media"},
    "core": {"packers._pack", "packers._strategies", "packers._bfd", "packers._pairs", "packers._stats", "packers.schema",
             "packers.errors", "packers.manifest", "packers.files", "packers.rowcheck", "packers._options", "packers",
             "packers._vision", "packers._mrope", "packers.shardcheck", "packers._tiles", "packers._video",
             "packers._keys", "packers._gemma", "packers.images"},
    "loader": {"packers._collate", "packers._loader", "packers._folder", "packers._schedule", "packers._attention",
               "packers._logps", "packers._loss", "packers._examples", "packers._pixels",
               "packers._preference_trainer"},
}
ALLOWED = {  # what each layer may import, besides itself
    "face": {"job", "tools", "encode", "workers", "stages", "core", "loader"},
    "job": {"encode", "workers", "stages", "core"},
    "tools": {"encode", "workers", "stages", "core"},
    "encode": {"stages", "core"},
    "workers": {"stages", "core"},
    "stages": {"core"},
    "core": set(),
    "loader": {"core"},
}


def _modules() -> dict[str, Path]:
    """Every module of the two packages and their subpackages (``pipeline._formats.alpaca``)."""
    out = {}
    for pkg in ("pipeline", "packers"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = (pkg, *path.relative_to(ROOT / pkg).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (``from pipeline import _read`` counts as pipeline._read)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            # `from pipeline import _rows` imports pipeline._rows; the package counts only for its own names.
            names = [s for s in subs if s in known] or [node.module]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}


def _layer(module: str) -> str:
    """A module's layer; a subpackage's modules (``pipeline._formats.detect``) share their package's."""
    while module not in set().union(*LAYERS.values()) and "." in module:
        module = module.rsplit(".", 1)[0]
    return next(name for name, members in LAYERS.items() if module in members)


def test_every_module_has_a_layer():
    for m in _modules():
        _layer(m)


def test_no_import_circles():
    graph = _graph()
    # `import pipeline` / `import packers` name the package facades; only the private modules form the graph.
    graph = {m: {d for d in deps if d not in ("pipeline", "packers")} for m, deps in graph.items()
             if m not in ("pipeline", "packers")}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            assert state.get(d) != 1, "import circle: " + " -> ".join(path + [m, d])
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_each_layer_imports_only_the_layers_below():
    for m, deps in _graph().items():
        for d in deps:
            a, b = _layer(m), _layer(d)
            if a == b or d == "packers":  # the packers facade re-exports core names (loader names lazily)
                continue
            assert b in ALLOWED[a], f"{m} ({a}) imports {d} ({b})"


def test_packing_needs_no_torch_and_training_no_pipeline():
    for m, path in _modules().items():
        tree = ast.parse(path.read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
        if _layer(m) in ("core", "stages", "workers", "encode", "job", "tools") and m != "packers":
            assert not any(x == "torch" or x.startswith("torch.") for x in names), f"{m} imports torch at module level"
        if m.startswith("packers"):
            assert not any(x.startswith("pipeline") for x in names), f"{m} imports the pipeline"


def _private_imports(source: str) -> list[tuple[int, str]]:
    """The imports in ``source`` that reach a private module or name of pipeline or packers (a dotted component
    that starts with ``_``, dunders aside), at module level or inside a function: ``(line, what it imports)``."""

    def private(dotted: str) -> bool:
        return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in dotted.split("."))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{a.name}" for a in node.names]  # `from pipeline import _read`: pipeline._read
        else:
            continue
        found += [(node.lineno, t) for t in targets if t.split(".")[0] in ("pipeline", "packers") and private(t)]
    return sorted(found)


def test_tests_reach_internals_only_through_internals():
    """The tests reach private modules and names through tests/_internals.py alone: moving an internal edits that
    one file, not the tests that use it."""
    found = [f"{path.relative_to(ROOT)}:{line}: {target}"
             for path in sorted((ROOT / "tests").glob("*.py")) if path.name != "_internals.py"
             for line, target in _private_imports(path.read_text())]
    assert not found, "import these from tests._internals:\n" + "\n".join(found)


def test_private_imports_are_found_at_module_level_and_inside_functions():
    planted = (
        "import pipeline._render\n"
        "import pipeline._tools.verify as v\n"
        "from pipeline import PackOptions, _render\n"
        "from packers._pack import pack\n"
        "from pipeline.cli import _helper\n"
        "\n"
        "def test_x():\n"
        "    from pipeline._formats import Rejected\n"
        "    import packers._attention._varlen\n"
    )
    assert _private_imports(planted) == [
        (1, "pipeline._render"), (2, "pipeline._tools.verify"), (3, "pipeline._render"), (4, "packers._pack.pack"),
        (5, "pipeline.cli._helper"), (8, "pipeline._formats.Rejected"), (9, "packers._attention._varlen"),
    ]
    clean = (
        "import _thread\n"
        "import pipeline, pipeline.cli\n"
        "from pipeline import PackOptions, __version__, run\n"
        "from packers import Collator, pack\n"
        "from other._private import x\n"
        "from tests._internals import Encoder, _render\n"
        "\n"
        "def test_x():\n"
        "    from packers.schema import SCHEMA\n"
    )
    assert _private_imports(clean) == []
