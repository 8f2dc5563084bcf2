"""The code's guards, as tests: size limits, private seams, import-time side effects.

Each guard is a pure function over source text (or one import in a fresh interpreter) that returns its violations,
checked on the project's own modules here, and shown to catch a planted violation in a worked example, so a guard
that silently stopped looking would fail too.

- **Size**: no module over :data:`MAX_MODULE_LINES` lines, no function over :data:`MAX_FUNCTION_LINES`, no
  signature over :data:`MAX_PARAMETERS` parameters (``self``/``cls`` not counted; ``*args``/``**kwargs`` count one
  each). Exceptions go in :data:`EXCEPTIONS`, each with its one-line reason.
- **Seams**: a private name (``_x``, a module or a name in one) is imported only from inside the package that owns
  it: ``pipeline._job._launch`` may import ``pipeline._render`` (owned by ``pipeline``), not
  ``pipeline._formats._fix`` (owned by ``pipeline._formats``); a module's private names are owned by its package.
- **One door for output writes**: no module of the job opens a file to write except ``pipeline/_sink.py``
  (:data:`WRITES_ELSEWHERE` names the writes that are not under the output folder, each with its reason), so the
  fault matrix of ``tests/test_write_faults.py`` reaches every write of a run.
- **Import-time side effects**: importing any module of ``pipeline`` or ``packers`` changes no environment
  variable, no logger's level, handlers or propagation, and no signal handler.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "packers")

MAX_MODULE_LINES = 700
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8
EXCEPTIONS: dict[str, str] = {
    # "module:function" or "module": why it may exceed its limit, in one line.
    "packers._loader:__init__": "PackedDataset's **old catches the flat keywords of before the option groups, to "
                                "name each one's new spelling (issue 35); its own options stay 8",
}


def modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, tuple[Path, bool]]:
    """Every module under the packages: dotted name -> (file, is a package's ``__init__``)."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = (pkg, *path.relative_to(root / pkg).with_suffix("").parts)
            init = parts[-1] == "__init__"
            out[".".join(parts[:-1] if init else parts)] = (path, init)
    return out


def size_violations(sources: dict[str, str]) -> list[str]:
    """Modules, functions and signatures over their limits, as ``"name: what (limit)"`` lines."""
    found = []
    for name, source in sources.items():
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES and name not in EXCEPTIONS:
            found.append(f"{name}: {lines} lines (limit {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            where = f"{name}:{node.name}"
            if where in EXCEPTIONS:
                continue
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{where} (line {node.lineno}): {length} lines (limit {MAX_FUNCTION_LINES})")
            a = node.args
            params = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)] + [p.arg for p in (a.vararg, a.kwarg) if p]
            params = [p for p in params if p not in ("self", "cls")]
            if len(params) > MAX_PARAMETERS:
                found.append(f"{where} (line {node.lineno}): {len(params)} parameters (limit {MAX_PARAMETERS})")
    return found


WRITES_ELSEWHERE = {
    "pipeline/_job/_commit.py": "the outcome file, in the system's temp folder, for the launcher to read",
    "pipeline/_progress.py": "progress counts, in the run's progress folder under the system's temp folder",
    "pipeline/_trace.py": "trace spans, in the folder PACKSTREAM_TRACE names",
    "pipeline/_workers/signals.py": "stderr to /dev/null, and the test hook's marker file",
    "pipeline/_tools/inspect.py": "inspect's plots, in --plots-dir (not a run's output)",
    "pipeline/_tools/estimate.py": "the timed sample pack's inputs, in a temporary folder (not a run's output)",
    "packers/_folder.py": "the loader's cache of a remote folder's shards, under cache_dir",
    "packers/_preference_trainer.py": "the loader state and reference table, in the Trainer's checkpoint folder",
    "packers/_trainer_settings.py": "the generated trainer settings table, into the project's docs/loader.md",
}


def write_opens(source: str) -> list[int]:
    """Lines that open a file to write: ``open(..., "w"|"a"|"x"|"+")``, ``os.open`` with a write flag,
    ``os.fdopen(.., "w...")``, ``FileSystems.create``, ``pa.OSFile(.., "w...")``, ``Path.write_text/write_bytes``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"), None)
        writes_mode = not isinstance(mode, ast.Constant) or any(c in str(mode.value) for c in "wax+")
        if name.endswith(("FileSystems.create", "write_text", "write_bytes")):
            found.append(node.lineno)
        elif name == "os.open" and any(f in ast.unparse(node) for f in ("O_WRONLY", "O_RDWR", "O_CREAT")):
            found.append(node.lineno)
        elif (name in ("open", "io.open", "os.fdopen") or name.endswith("OSFile")) and mode is not None and writes_mode:
            found.append(node.lineno)
    return found


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [f"{node.module}.{a.name}" for a in node.names]
    return []


def seam_violations(sources: dict[str, str], packages: dict[str, bool]) -> list[str]:
    """Imports of a private module or name from outside the package that owns it, as ``"importer: target"``.

    ``packages`` maps every module name to whether it is a package (``__init__``): a private component's owner is the
    package holding it -- for a name inside a module, that module's package."""
    found = []
    for name, source in sources.items():
        home = name if packages.get(name) else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(source)):
            for target in _targets(node):
                parts = target.split(".")
                if parts[0] not in PACKAGES:
                    continue
                for i, part in enumerate(parts):
                    if not part.startswith("_") or part.startswith("__"):
                        continue
                    owner = ".".join(parts[:i])
                    if owner in packages and not packages[owner]:  # a module's private name: its package owns it
                        owner = owner.rsplit(".", 1)[0]
                    if home != owner and not home.startswith(owner + "."):
                        found.append(f"{name} (line {node.lineno}): {target}")
                        break
    return found


_SNAPSHOT = textwrap.dedent("""
    import importlib, json, logging, os, signal, sys
    modules, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    for dep in heavy:  # the heavy third-party libraries, imported once, first: their own effects are not ours
        try:
            importlib.import_module(dep)
        except ImportError:
            pass

    def state():
        loggers = {"": logging.getLogger()}
        loggers.update((n, l) for n, l in logging.Logger.manager.loggerDict.items() if isinstance(l, logging.Logger))
        configured = {n: [l.level, [type(h).__name__ for h in l.handlers], l.propagate] for n, l in loggers.items()
                      if n == "" or l.level or l.handlers or not l.propagate or l.disabled}
        handlers = {}
        for s in signal.valid_signals():
            try:
                h = signal.getsignal(s)
            except (ValueError, OSError):
                continue
            handlers[int(s)] = repr(h)
        return {"env": dict(os.environ), "loggers": configured, "signals": handlers}

    out = {}
    for module in modules:  # each in a forked child: no module hides behind another's import
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                before = state()
                importlib.import_module(module)
                after = state()
                changed = []
                for what in ("env", "loggers", "signals"):
                    keys = set(before[what]) | set(after[what])
                    changed += [f"{what} {k}: {before[what].get(k)!r} -> {after[what].get(k)!r}"
                                for k in sorted(keys, key=str) if before[what].get(k) != after[what].get(k)]
            except BaseException as e:
                changed = [f"import failed: {type(e).__name__}: {e}"]
            os.write(w, json.dumps(changed).encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            out[module] = json.loads(f.read() or '["the child died"]')
        os.waitpid(pid, 0)
    print(json.dumps(out))
""")
_HEAVY = ("numpy", "pyarrow", "torch", "transformers", "datasets", "apache_beam", "tokenizers", "jinja2", "click")


def import_side_effects(names: list[str], path: tuple[str, ...] = (),
                        heavy: tuple[str, ...] = _HEAVY) -> dict[str, list[str]]:
    """What importing each module alone changes (a forked child each, the heavy libraries imported once before):
    environment variables, configured loggers, signal handlers, as ``"kind key: before -> after"`` lines per
    module. ``path``: extra folders on sys.path."""
    import os

    env = {**os.environ, "PYTHONPATH": ":".join((*path, str(ROOT)))}
    proc = subprocess.run([sys.executable, "-c", _SNAPSHOT, json.dumps(names), json.dumps(heavy)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- on the project ------------------------------------------------------------------------------------------------


def test_no_module_function_or_signature_over_its_limit():
    mods = modules()
    assert size_violations({m: p.read_text() for m, (p, _) in mods.items()}) == []
    stale = [e for e in EXCEPTIONS if e.split(":")[0] not in mods]
    assert not stale, f"EXCEPTIONS names modules that are gone: {stale}"


def test_no_private_import_across_packages():
    mods = modules()
    assert seam_violations({m: p.read_text() for m, (p, _) in mods.items()}, {m: init for m, (_, init) in mods.items()}) == []


def test_importing_any_module_changes_no_environment_logger_or_signal():  # slow tier: about 15 s
    found = import_side_effects(sorted(modules()))
    assert len(found) == len(modules()) and {m: fx for m, fx in found.items() if fx} == {}


def test_every_output_write_goes_through_the_one_door():
    found = {}
    for m, (path, _) in modules().items():
        rel = path.relative_to(ROOT).as_posix()
        if rel != "pipeline/_sink.py" and (lines := write_opens(path.read_text())) and rel not in WRITES_ELSEWHERE:
            found[rel] = lines
    assert found == {}, "open output files through pipeline._sink.create (or name the write in WRITES_ELSEWHERE)"
    gone = [p for p in WRITES_ELSEWHERE if not (ROOT / p).exists() or not write_opens((ROOT / p).read_text())]
    assert not gone, f"WRITES_ELSEWHERE names files that write nothing now: {gone}"


# -- each guard catches a planted violation ---------------------------------------------------------------------------


def test_the_size_guard_catches_a_long_module_a_long_function_and_a_wide_signature():
    long_fn = "def long():\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    wide = "def wide(self, " + ", ".join(f"a{i}" for i in range(MAX_PARAMETERS)) + ", *rest):\n    pass\n"
    ok = "def fine(self, " + ", ".join(f"a{i}" for i in range(MAX_PARAMETERS)) + "):\n    pass\n"
    found = size_violations({"pkg.big": "x = 1\n" * (MAX_MODULE_LINES + 1), "pkg.fns": long_fn + wide + ok})
    assert found == [f"pkg.big: {MAX_MODULE_LINES + 1} lines (limit {MAX_MODULE_LINES})",
                     f"pkg.fns:long (line 1): {MAX_FUNCTION_LINES + 1} lines (limit {MAX_FUNCTION_LINES})",
                     f"pkg.fns:wide (line {MAX_FUNCTION_LINES + 2}): {MAX_PARAMETERS + 1} parameters "
                     f"(limit {MAX_PARAMETERS})"]
    assert size_violations({"pkg.edge": "x = 1\n" * (MAX_MODULE_LINES - 2) + ok}) == []


def test_the_seam_guard_catches_a_private_import_from_another_package():
    packages = {"pipeline": True, "pipeline._job": True, "pipeline._job._launch": False, "pipeline._formats": True,
                "pipeline._formats._fix": False, "pipeline._formats.fields": False, "pipeline._render": False,
                "packers": True, "packers._pack": False}
    sources = {
        "pipeline._job._launch": textwrap.dedent("""
            from pipeline import _render                    # owned by pipeline, an ancestor: fine
            from pipeline._render import _tick              # a private name of a module of pipeline: fine
            from pipeline._formats import Conversation      # public: fine
            import pipeline._formats._fix                   # line 5: owned by pipeline._formats
            def later():
                from packers._pack import _pack             # line 7: owned by packers
        """),
        "pipeline._formats.fields": "from pipeline._formats._fix import Fix\nfrom pipeline._formats._fix import _merged\n",
    }
    assert seam_violations(sources, packages) == [
        "pipeline._job._launch (line 5): pipeline._formats._fix",
        "pipeline._job._launch (line 7): packers._pack._pack",
    ]


def test_the_import_guard_catches_a_module_that_sets_the_environment_a_logger_or_a_signal(tmp_path):
    pkg = tmp_path / "planted"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "env.py").write_text("import os\nos.environ['PLANTED_BY_IMPORT'] = '1'\n")
    (pkg / "log.py").write_text("import logging\nlogging.getLogger('planted').setLevel(logging.DEBUG)\n")
    (pkg / "sig.py").write_text("import signal\nsignal.signal(signal.SIGUSR1, lambda *a: None)\n")
    (pkg / "clean.py").write_text("import logging\nlog = logging.getLogger(__name__)\nX = 1\n")
    found = import_side_effects(["planted.env", "planted.log", "planted.sig", "planted.clean"], (str(tmp_path),), heavy=())
    assert found["planted.env"] == ["env PLANTED_BY_IMPORT: None -> '1'"]
    assert found["planted.log"] == ["loggers planted: None -> [10, [], True]"]
    [sig] = found["planted.sig"]
    assert sig.startswith("signals 10: '<Handlers.SIG_DFL: 0>' -> '<function <lambda>"), sig
    assert found["planted.clean"] == []


def test_the_door_guard_catches_every_way_to_open_a_file_to_write():
    planted = textwrap.dedent("""
        import os, pyarrow as pa
        from apache_beam.io.filesystems import FileSystems
        open(p, "wb")
        open(p, mode="a")
        os.open(p, os.O_CREAT | os.O_WRONLY)
        os.fdopen(fd, "w")
        FileSystems.create(p)
        pa.OSFile(p, "wb")
        path.write_text("x")
        open(p, "xb" if exclusive else "wb")
        open(p), open(p, "rb"), os.open(p, os.O_RDONLY), pa.OSFile(p, "rb"), FileSystems.open(p)
    """)
    assert write_opens(planted) == [4, 5, 6, 7, 8, 9, 10, 11]
