"""Dataflow Flex Template entry point: template parameters -> ``packstream pack`` arguments.

The Flex Template launcher runs this file (``FLEX_TEMPLATE_PYTHON_PY_FILE``) with every template
parameter as ``--name=value`` plus the pipeline options of the launch, roughly::

    python /template/launcher.py --inputs=gs://b/in/*.jsonl --output=gs://b/packed --max_tokens=4096 \\
        --runner=DataflowRunner --project=p --region=r --template_location=gs://... --sdk_container_image=...

Parameters declared in ``metadata.json`` (next to this file) become ``pack`` options:
``--max_tokens=4096`` -> ``--max-tokens=4096``; ``inputs`` and ``field`` are comma-separated
lists; ``overwrite``, ``trust_remote_code`` and ``refine`` take ``true`` or ``false``. Everything else is
a Beam pipeline option and passes through. ``pack`` writes the job graph to
``--template_location`` and returns; Dataflow then runs the job on the same image.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Iterable, Sequence

METADATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "metadata.json")
FLAGS = ("overwrite", "trust_remote_code", "mask_reasoning", "pairs")
"""true -> ``--name``; false -> nothing."""
SWITCHES = ("refine",)
"""true -> ``--name``; false -> ``--no-name``."""


def parameter_names(metadata: str = METADATA) -> set[str]:
    with open(metadata) as f:
        return {p["name"] for p in json.load(f)["parameters"]}


def pack_args(argv: Sequence[str], names: Iterable[str]) -> list[str]:
    """The ``packstream`` arguments (``pack ...``) for the launcher's ``argv``."""
    names = set(names)
    inputs: list[str] = []
    options: list[str] = []
    passthrough: list[str] = []
    for arg in argv:
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if not eq or name not in names:
            passthrough.append(arg)
        elif name == "inputs":
            inputs += [v.strip() for v in value.split(",") if v.strip()]
        elif name == "field":
            options += [f"--field={v.strip()}" for v in value.split(",") if v.strip()]
        elif name in FLAGS or name in SWITCHES:
            on = value.strip().lower() == "true"
            if on or name in SWITCHES:
                options.append(("--" if on else "--no-") + name.replace("_", "-"))
        else:
            options.append(f"--{name.replace('_', '-')}={value}")
    if not any(a == "--runner" or a.startswith("--runner=") for a in passthrough):
        # Without a runner, pack runs the job locally; on the launcher VM that is never wanted.
        passthrough.append("--runner=DataflowRunner")
    return ["pack", *inputs, *options, *passthrough]


def main(argv: Sequence[str] | None = None) -> None:
    from pipeline.cli import main as cli

    args = pack_args(sys.argv[1:] if argv is None else argv, parameter_names())
    print("packstream " + " ".join(args), flush=True)  # the launch log shows what ran
    cli.main(args=args, prog_name="packstream")


if __name__ == "__main__":
    main()
