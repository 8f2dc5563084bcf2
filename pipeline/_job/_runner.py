"""Beam's options and the runner, through Beam's public API: a mistake in either is one ``error:`` line.

Beam's own option parser prints its whole usage (~130 lines) and exits on a bad value; a
packstream user gets the one line that names the option instead. The parser is the one Beam
builds (``PipelineOptions.get_all_options`` hands it to its ``add_extra_args_fn``), told not to
exit (argparse's ``exit_on_error``). Runner names are Beam's ``StandardOptions.ALL_KNOWN_RUNNERS``,
looked up as Beam does (a short name, with or without "Runner", or a class path); ``DaskRunner``
(not in that list), or Beam's DaskRunner by its class path, becomes packstream's (:mod:`pipeline._workers.on_dask`).
Without a runner the job runs on packstream's local runner (:mod:`pipeline._job._local`), which needs no
Beam at all.
"""

from __future__ import annotations

import argparse
import importlib
import os
from typing import Optional, Sequence

from packers import PackstreamError

DASK_RUNNER = "pipeline._workers.on_dask.DaskRunner"
"""packstream's DaskRunner: Beam's, with a GroupByKey that spreads the job's few, small keys (see
:mod:`pipeline._workers.on_dask`)."""
BEAM_DASK_RUNNER = "apache_beam.runners.dask.dask_runner.DaskRunner"
_RUNNER_EXAMPLES = "DataflowRunner, DaskRunner, FlinkRunner, PortableRunner"
_NEEDS_NAME = f"--runner needs a runner name: --runner=NAME (e.g. {_RUNNER_EXAMPLES})"


def beam_option_parser() -> argparse.ArgumentParser:
    """Beam's option parser (every registered option class), raising ``argparse.ArgumentError`` on a bad value."""
    from apache_beam.options.pipeline_options import PipelineOptions

    found: list[argparse.ArgumentParser] = []
    PipelineOptions([]).get_all_options(add_extra_args_fn=found.append)
    parser = found[0]
    parser.exit_on_error = False  # a bad value raises ArgumentError (naming the option) instead of exiting

    def refuse(message: str):  # argparse's own checks that do not raise ArgumentError; it must not return
        raise PackstreamError(f"Beam option error: {message}; give options as --name=value (see Beam's pipeline "
                              "options)")

    parser.error = refuse
    return parser


def unknown_beam_args(tokens: Sequence[str]) -> list[str]:
    """The tokens that are no Beam option (inputs, and options Beam does not know); a bad value of a Beam
    option (``--direct_num_workers=abc``, a bare ``--runner``) is a PackstreamError naming it."""
    try:
        _, unknown = beam_option_parser().parse_known_args(list(tokens))
    except argparse.ArgumentError as e:
        if e.argument_name == "--runner":  # a plain string option: its one mistake is a missing value
            raise PackstreamError(_NEEDS_NAME) from None
        what = f"{e.argument_name}: {e.message}" if e.argument_name else e.message
        raise PackstreamError(f"Beam option {what}; give it as --name=value (see Beam's pipeline options)") from None
    return unknown


def beam_flags() -> list[str]:
    """The names of Beam's options (``--runner``, ``--direct_num_workers``, ...), for "did you mean" hints."""
    from apache_beam.options.pipeline_options import PipelineOptions

    return [f"--{name}" for name in PipelineOptions([]).get_all_options()]


def runner_names() -> list[str]:
    """The runner names --runner takes (besides a PipelineRunner subclass's full class path)."""
    from apache_beam.options.pipeline_options import StandardOptions

    return sorted({*StandardOptions.KNOWN_RUNNER_NAMES, "DaskRunner"})


def _runner_value(beam_args: Sequence[str], i: int) -> tuple[Optional[str], int]:
    """The value of the runner option at ``beam_args[i]`` (``--runner=X`` or ``--runner X``) and the tokens it spans."""
    a = beam_args[i]
    if a.startswith("--runner="):
        return a.split("=", 1)[1], 1
    if a == "--runner":
        if i + 1 >= len(beam_args) or beam_args[i + 1].startswith("-"):
            raise PackstreamError(_NEEDS_NAME)
        return beam_args[i + 1], 2
    return None, 1


def _runner_path(name: str) -> str:
    """Beam's lookup of a runner name: a known short name (any case, with or without "Runner"), else ``name``."""
    from apache_beam.options.pipeline_options import StandardOptions

    known = {path.rsplit(".", 1)[-1].lower(): path for path in StandardOptions.ALL_KNOWN_RUNNERS}
    return known.get(name.lower(), known.get(name.lower() + "runner", name))


def _check_runner(name: str) -> str:
    """``NAME`` as Beam is to get it (DaskRunner: its class path), or a PackstreamError naming the choices."""
    from apache_beam.runners.runner import PipelineRunner

    choices = f"use one of {', '.join(runner_names())}, or the full class path of a PipelineRunner subclass"
    if not name.strip():
        raise PackstreamError(f"--runner is empty; {choices}")
    if name.lower() in ("daskrunner", "dask") or name in (BEAM_DASK_RUNNER, DASK_RUNNER):
        try:
            import dask.distributed  # noqa: F401
        except ImportError:
            raise PackstreamError("--runner=DaskRunner needs dask.distributed: pip install 'packstream[dask]'") from None
        importlib.import_module("apache_beam.runners.dask.dask_runner")  # registers --dask_client_address, ...
        return DASK_RUNNER
    path = _runner_path(name)
    if "." not in path:
        raise PackstreamError(f"--runner {name!r} is not a Beam runner; {choices}")
    module, cls_name = path.rsplit(".", 1)
    try:
        cls = getattr(importlib.import_module(module), cls_name, None)
    except Exception as e:  # noqa: BLE001 - ImportError, or a runner module that fails with this environment
        extra = "gcp" if "dataflow" in path.lower() else "interactive" if "interactive" in path.lower() else None
        fix = f"pip install 'apache-beam[{extra}]'" if extra else "install the package that provides it"
        raise PackstreamError(f"--runner {name}: cannot import {module} ({type(e).__name__}: {e}); {fix}") from None
    if not (isinstance(cls, type) and issubclass(cls, PipelineRunner)):
        raise PackstreamError(f"--runner {name!r}: {path} is not a PipelineRunner subclass; {choices}")
    return name


def runner_args(beam_args: Sequence[str]) -> list[str]:
    """Beam's options with the runner checked and spelled ``--runner=NAME``; a bad runner is a PackstreamError.

    ``--runner=X`` and ``--runner X`` both work; ``DaskRunner`` (not in Beam's registry of short
    names) becomes Beam's class path. An unknown runner is one error naming the choices.
    """
    out: list[str] = []
    i = 0
    while i < len(beam_args):
        name, span = _runner_value(beam_args, i)
        if name is None:
            out.append(beam_args[i])
        else:
            out.append(f"--runner={_check_runner(name)}")
        i += span
    return out


def names_runner(beam_args: Sequence[str]) -> bool:
    """Whether the Beam options name a runner (``--runner=X`` or ``--runner X``): the job then runs on Beam;
    without one it runs on packstream's local runner (:mod:`pipeline._job._local`), and Beam is never imported."""
    return any(a == "--runner" or a.startswith("--runner=") for a in beam_args)


def pipeline_options(beam_args: Sequence[str]):
    """Beam's options for the runner ``beam_args`` name (``--runner``), checked: a bad runner or value is one
    PackstreamError. Without a runner there is no Beam run: the local runner takes ``--workers``, so other Beam
    options given alone are refused, naming what to use instead."""
    from apache_beam.options.pipeline_options import PipelineOptions

    args = runner_args(beam_args)
    unknown_beam_args(args)  # a bad value: one error line, not Beam's usage and exit
    if not names_runner(args):
        raise PackstreamError(local_beam_options(args))
    return PipelineOptions(args, pipeline_type_check=True)


def local_beam_options(beam_args: Sequence[str]) -> str:
    """The error for Beam options given to a local run (no ``--runner``): they would change nothing."""
    names = ", ".join(sorted({a.split("=", 1)[0] for a in beam_args if a.startswith("--")}))
    return (f"{names} {'is a Beam option' if ',' not in names else 'are Beam options'}, and this run names no "
            "--runner: a local run is packstream's own (use --workers N for its processes); to run on Beam, "
            f"add --runner=NAME (e.g. {_RUNNER_EXAMPLES})")
