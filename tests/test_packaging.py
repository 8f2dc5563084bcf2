"""Packaging and deployment: the Docker image's Beam pin, the Flex Template, sdist/wheel, Dataflow's
``--setup_file`` stager and the dataset card (the docs' commands run as written: tests/test_docs_commands.py).

Docker cannot run here, so the image files are checked statically.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
FLEX = ROOT / "docker" / "flex-template"
# pack options a Flex Template does not offer, and why.
NOT_TEMPLATE_PARAMETERS = {
    "--chat-template", "--config",  # local file paths; the launcher VM has none
    "--workers", "--force-workers",  # local worker processes; Dataflow sizes workers with --max_num_workers
    "--quiet", "--progress", "--no-progress", "--log-format", "--log-interval",  # output of local runs
    "--estimate", "--sample",  # a local dry run
    "--media-root",  # a local image folder; Dataflow workers have none (images reach them as bytes)
}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _beam_pins() -> set[str]:
    p = _pyproject()["project"]
    deps = list(p["dependencies"]) + [d for extra in p.get("optional-dependencies", {}).values() for d in extra]
    return {m.group(1) for d in deps if (m := re.match(r"apache-beam(?:\[[^\]]*\])?==([\w.]+)$", d.replace(" ", "")))}


def test_dockerfile_pins_the_beam_version_of_pyproject():
    pins = _beam_pins()
    assert len(pins) == 1, f"pyproject pins apache-beam at several versions: {pins}"
    pin = pins.pop()
    text = DOCKERFILE.read_text()
    froms = re.findall(r"^FROM\s+(\S+)", text, re.M)
    sdk = [f for f in froms if f.startswith("apache/beam_python")]
    assert sdk == [f"apache/beam_python3.11_sdk:{pin}"], froms
    assert f"b.__version__ == '{pin}'" in text  # the build fails if pip moved Beam
    # Launcher and SDK images run the same Python.
    assert any(f.startswith("gcr.io/dataflow-templates-base/python311-template-launcher-base") for f in froms)


def _instructions(text: str) -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    return [(m.group(1).upper(), m.group(2).strip())
            for m in re.finditer(r"^\s*([A-Za-z]+)\s+(.*)$", joined, re.M) if not m.group(0).lstrip().startswith("#")]


def test_dockerfile_copies_paths_that_exist_and_keeps_the_beam_entrypoint():
    ins = _instructions(DOCKERFILE.read_text())
    copies = [args.split() for op, args in ins if op == "COPY" and not args.startswith("--from")]
    assert copies
    sources = [src for args in copies for src in args[:-1]]
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: not in the build context (the repository root)"
    assert {"pyproject.toml", "packers/", "pipeline/"} <= set(sources)
    # pyproject's readme must be in the image, or pip install . fails.
    assert _pyproject()["project"]["readme"] in sources
    env = " ".join(args for op, args in ins if op == "ENV")
    launcher = re.search(r"FLEX_TEMPLATE_PYTHON_PY_FILE=(\S+)", env).group(1)
    assert launcher == "/template/launcher.py" and ["docker/flex-template/", "/template/"] in copies
    assert (FLEX / "launcher.py").exists() and (FLEX / "metadata.json").exists()
    assert "HF_HUB_OFFLINE=1" in env
    assert [args for op, args in ins if op == "ENTRYPOINT"] == ['["/opt/apache/beam/boot"]']
    assert "docker/Dockerfile" in (ROOT / "docker" / "cloudbuild.yaml").read_text()


def _launcher():
    spec = importlib.util.spec_from_file_location("flex_launcher", FLEX / "launcher.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flex_template_parameters_map_to_pack_options():
    from pipeline.cli import pack

    meta = json.loads((FLEX / "metadata.json").read_text())
    params = meta["parameters"]
    names = [p["name"] for p in params]
    assert len(names) == len(set(names)) and meta["name"] and meta["description"]
    assert all(re.fullmatch(r"[a-z][a-z0-9_]*", n) and p.get("label") and p.get("helpText") for n, p in zip(names, params))
    assert {p["name"] for p in params if not p.get("isOptional")} == {"inputs", "output"}
    options = {o for p in pack.params for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])
               if o.startswith("--")}
    launcher = _launcher()
    flags = {"--" + n.replace("_", "-") for n in names if n != "inputs"}
    flags |= {"--no-" + n.replace("_", "-") for n in launcher.SWITCHES}
    assert flags <= options, flags - options
    # Every pack option is a template parameter, or deliberately not one.
    assert options - flags == NOT_TEMPLATE_PARAMETERS
    for p in params:
        for rx in p.get("regexes", []):
            re.compile(rx)


def test_flex_launcher_builds_arguments_pack_accepts():
    from pipeline.cli import pack, split_beam_args

    launcher = _launcher()
    names = launcher.parameter_names()
    argv = ["--inputs=gs://b/a/*.jsonl,gs://b/c/", "--output=gs://b/packed", "--max_tokens=2048",
            "--field=question=user,answer=assistant", "--overwrite=true", "--trust_remote_code=false", "--refine=false",
            "--output_format=parquet", "--project=p", "--region=us-central1",
            "--template_location=gs://b/launches/job_object", "--sdk_container_image=img:1"]
    args = launcher.pack_args(argv, names)
    assert args[0] == "pack"
    ctx = pack.make_context("pack", args[1:])
    p = ctx.params
    assert p["output"] == "gs://b/packed" and p["max_tokens"] == 2048 and p["output_format"] == "parquet"
    assert p["fields"] == ("question=user", "answer=assistant")
    assert p["overwrite"] is True and p["trust_remote_code"] is False and p["refine"] is False
    own = [o for q in pack.params for o in getattr(q, "opts", [])]
    inputs, beam_args = split_beam_args(p["inputs"], own)
    assert inputs == ["gs://b/a/*.jsonl", "gs://b/c/"]
    assert "--runner=DataflowRunner" in beam_args and "--template_location=gs://b/launches/job_object" in beam_args
    assert "--sdk_container_image=img:1" in beam_args
    # A runner given by the launch is kept, not doubled.
    assert launcher.pack_args(["--runner=DataflowRunner"], names).count("--runner=DataflowRunner") == 1


# ---------------------------------------------------------------------------------------
# Built artifacts: sdist, wheel, and what Dataflow's stager builds from pyproject.toml.


def _expected(clone: Path) -> set[str]:
    wanted = set()
    for pkg in ("packers", "pipeline"):
        wanted |= {str(p.relative_to(clone)) for p in (clone / pkg).rglob("*.py")}  # subpackages too (pipeline/_formats/)
    wanted |= {str(p.relative_to(clone)) for p in (clone / "pipeline" / "data").iterdir()}
    wanted |= {str(p.relative_to(clone)) for p in (clone / "pipeline" / "templates").iterdir()}
    assert {"packers/__init__.py", "pipeline/cli.py", "pipeline/templates/chatml.jinja"} <= wanted
    return wanted


def _sdist_names(path: Path) -> set[str]:
    with tarfile.open(path) as t:
        return {n.split("/", 1)[1] for n in t.getnames() if "/" in n}


def test_sdist_and_wheel_contain_both_packages_and_their_data(clone, tmp_path):
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(clone)],
                   check=True, capture_output=True, timeout=300)
    sdist = next(tmp_path.glob("packstream-*.tar.gz"))
    wheel = next(tmp_path.glob("packstream-*.whl"))
    wanted = _expected(clone)
    assert wanted <= _sdist_names(sdist), wanted - _sdist_names(sdist)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert wanted <= names, wanted - names
    assert "packstream = pipeline.cli:main" in entry


def test_dataflow_setup_file_stager_builds_an_installable_sdist(clone, tmp_path):
    """What `--setup_file=pyproject.toml` does at launch, and what a worker then installs."""
    from apache_beam.runners.portability.stager import Stager

    stage = tmp_path / "stage"
    stage.mkdir()
    tarball = Path(Stager._build_setup_package(str(clone / "pyproject.toml"), str(stage)))
    assert _expected(clone) <= _sdist_names(tarball)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(site), str(tarball)], check=True, capture_output=True, timeout=300)
    probe = ("import os, packers, pipeline, pipeline.cli, pipeline._job; "
             "print(pipeline.__file__); print(packers.__file__); "
             "print(sorted(os.listdir(pipeline.cli.bundled_sample())))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(site)}, check=True).stdout.splitlines()
    assert out[0].startswith(str(site)) and out[1].startswith(str(site))
    assert "alpaca.jsonl" in out[2]


# ---------------------------------------------------------------------------------------
# The output folder as a Hugging Face dataset.


def test_dataset_card_header_is_what_datasets_and_the_hub_read(tmp_path):
    import datasets
    from datasets.info import DatasetInfosDict
    from huggingface_hub import DatasetCard

    import packers
    from pipeline import PackOptions, run
    from pipeline.cli import bundled_sample

    out = tmp_path / "out"
    manifest = run(PackOptions(inputs=(bundled_sample(),), output=str(out), max_tokens=256, num_shards=2))
    rows = manifest["counts"]["rows"]
    card = DatasetCard.load(out / "README.md")
    header = yaml.safe_load((out / "README.md").read_text().split("---\n")[1])
    features = datasets.Features.from_arrow_schema(packers.SCHEMA)
    assert header["dataset_info"]["features"] == features._to_yaml_list()
    info = DatasetInfosDict.from_dataset_card_data(card.data)["default"]
    assert info.features == features
    assert info.splits["train"].num_examples == rows
    assert info.download_size == sum(s["bytes"] for s in manifest["shards"])
    (config,) = header["configs"]
    pattern = config["data_files"][0]["path"]
    assert sorted(s["name"] for s in manifest["shards"]) == sorted(fnmatch.filter(os.listdir(out), pattern))
    assert header["size_categories"] == ["n<1K"] and header["task_categories"] == ["text-generation"]
    # "Pushed as is": every file of the folder, uploaded unchanged, loads as one train split.
    pushed = tmp_path / "hub-copy"
    shutil.copytree(out, pushed)
    dd = datasets.load_dataset(str(pushed))
    assert list(dd) == ["train"] and dd["train"].num_rows == rows and dd["train"].features == features
