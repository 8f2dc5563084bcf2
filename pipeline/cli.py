"""``packstream``: the command line. A thin click wrapper around :func:`pipeline.run`."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import functools
import json
import logging
import os
import sys
import typing
from pathlib import Path
from importlib import resources
from typing import Any, Sequence

import click

from packers import InternalError, PackstreamError
from pipeline._exit import ExitCode
from pipeline._progress import LogFormat
from pipeline._report import printable, summary_table
from pipeline._workers import quiet, signals


def _quiet_libraries() -> None:
    """Silence what says nothing to a packstream user, before a command imports the libraries that say it:
    Beam's optional GCP clients, transformers' "PyTorch was not found" (the job needs only tokenizers), and
    Beam's warning about the local worker processes packstream starts itself (pipeline._workers, with Beam's
    in-memory mode's option name), with each worker's start-up warnings it relays. Called by every command."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    quiet.install()
    logging.getLogger("apache_beam.runners.portability.local_job_service").setLevel(logging.ERROR)


def bundled_sample() -> str:
    """The project's own sample of instruction records, in several formats."""
    return str(resources.files("pipeline").joinpath("data"))


def _enum_choice(enum_cls) -> click.Choice:
    return click.Choice([m.value for m in enum_cls])


def split_beam_args(tokens: Sequence[str], own_options: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate input paths from Beam pipeline options; an unknown option or a bad value is a clear error.

    A bad value of a Beam option (``--direct_num_workers=abc``, a bare ``--runner``) is a
    PackstreamError (one ``error:`` line), never Beam's usage text; the runner is checked here too,
    in either spelling (``--runner=X`` or ``--runner X``).
    """
    if not any(t.startswith("-") for t in tokens):  # inputs only: nothing for Beam to parse (and no Beam to import)
        return list(tokens), []
    from pipeline._job import beam_flags, runner_args, unknown_beam_args

    if any("dask" in t.lower() for t in tokens):
        try:  # registers DaskOptions (--dask_client_address, ...) with Beam's option parser
            import apache_beam.runners.dask.dask_runner  # noqa: F401
        except ImportError:
            pass
    unknown = unknown_beam_args(tokens)
    bad = [t for t in unknown if t.startswith("-")]
    if bad:
        name = bad[0].split("=", 1)[0]
        hint = (difflib.get_close_matches(name, list(own_options), n=1, cutoff=0.7)
                or difflib.get_close_matches(name, beam_flags(), n=1, cutoff=0.8))
        raise click.UsageError(
            f"unknown option {name}" + (f"; did you mean {hint[0]}?" if hint else "; see packstream pack --help")
        )
    inputs = [t for t in unknown if t != "--"]
    beam_args = [t for t in tokens if t not in inputs]
    runner_args(beam_args)  # an unknown runner fails now, before any input is read
    return inputs, beam_args


def _fail(e: "Exception | str", code: int = ExitCode.USER_ERROR, reporter=None, summary: "dict | None" = None) -> None:
    """The one way a command ends with an error: one ``error:`` line (through :func:`printable`), exit ``code``."""
    if summary is not None:
        click.echo(summary_table(summary), err=True)
    signals.unmute_stderr()
    click.secho(f"error: {printable(str(e))}", fg="red", err=True)
    if reporter is not None:
        reporter.error(str(e), code)  # --log-format json: the batch log ends with an error event
    sys.exit(code)


@contextlib.contextmanager
def _user_errors():
    """A user error (PackstreamError) inside ends the command as :func:`_fail` does: one line, exit 2."""
    try:
        yield
    except PackstreamError as e:
        _fail(e)


class _Commands(click.Group):
    """The ``packstream`` group: every command runs with the libraries' noise silenced, with SIGINT, SIGTERM and
    SIGHUP handled (one line, exit 128 + the signal; pipeline._workers.signals), and a click usage error's
    message is one printable line too."""

    def main(self, *args, **kwargs):
        _quiet_libraries()
        with signals.handling():
            try:
                return super().main(*args, **kwargs)
            except SystemExit:
                raise
            except BaseException as e:
                signum = signals.received()
                if signum is None:
                    raise
                _fail(e if isinstance(e, signals.Interrupted) else f"interrupted by {signals.name(signum)}",
                      signals.exit_code(signum))

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as e:
            _click_error(e)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.ClickException as e:
            _click_error(e)


def _click_error(e: click.ClickException) -> None:
    """A mistyped command, option or value (click's own checks): click's usage lines, then one ``error:`` line
    like every other error of packstream (click prints ``Error:``), exit 2."""
    ctx = getattr(e, "ctx", None)
    if ctx is not None:
        click.echo(f"{ctx.get_usage()}\nTry '{ctx.command_path} {ctx.help_option_names[-1]}' for help.\n", err=True)
    _fail(e.format_message(), e.exit_code)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="packstream")
def main() -> None:
    """Pack instruction data into fixed-budget rows for FlashAttention-2 training."""


def _click_type(field: dataclasses.Field, hint: Any):
    """The click type of a PackOptions field (``Optional[X]`` -> X; enums -> their values)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint
    if isinstance(base, type) and issubclass(base, enum.Enum):
        return _enum_choice(base)
    return {int: int, float: float}.get(base, str)


class _AutoCount(click.ParamType):
    """A count, or ``auto`` (0): ``--workers auto``, ``--workers 4``."""

    name = "count"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip().lower()
        if text == "auto":
            return 0
        try:
            return int(text)
        except ValueError:
            self.fail(f"{value!r} is not a whole number or auto", param, ctx)


_AUTO_COUNT = _AutoCount()


def options_for(command: str):
    """Click decorators for every PackOptions field whose CLI metadata names ``command``."""
    from pipeline._options import PackOptions

    hints = typing.get_type_hints(PackOptions)
    decorators = []
    for f in dataclasses.fields(PackOptions):
        meta = f.metadata.get("cli")
        if not meta or command not in meta["commands"]:
            continue
        names = [meta["flag"]] + ([meta["short"]] if meta["short"] else [])
        kw: dict[str, Any] = {"help": meta["help"]}
        kind = meta["kind"]
        if kind == "flag":
            names = [f"{meta['flag']}/--no-{meta['flag'][2:]}"]
            kw.update(default=f.default, show_default=True)
        elif kind == "switch":
            kw.update(is_flag=True, default=False)
        elif kind == "pairs":
            kw.update(multiple=True, metavar=meta["metavar"])
        elif kind == "auto":
            kw.update(type=_AUTO_COUNT, default=f.default, metavar=meta["metavar"], show_default="auto")
        elif kind in ("file", "config"):
            kw.update(type=click.Path(exists=True, dir_okay=False), default=None, metavar=meta["metavar"])
        else:
            default = f.default
            kw.update(type=_click_type(f, hints[f.name]), metavar=meta["metavar"],
                      default=default.value if isinstance(default, enum.Enum) else default,
                      show_default=default is not None and default != "")
        decorators.append(click.option(*names, f.name, **kw))
    return lambda fn: functools.reduce(lambda acc, d: d(acc), reversed(decorators), fn)


def build_options(paths: Sequence[str], params: dict[str, Any], *, output_required: bool = False):
    """PackOptions from the generated click parameters; a bad value is a PackstreamError."""
    from pipeline._options import PackOptions, load_config

    known = {f.name for f in dataclasses.fields(PackOptions)}
    kw = {k: v for k, v in params.items() if k in known and v is not None}
    if output_required and params.get("output") is None:
        raise click.UsageError("Missing option '--output' / '-o'.")
    if output_required and not params["output"].strip():
        raise PackstreamError("--output is empty; give a folder for the packed data, e.g. -o packed/")
    if kw.get("chat_template"):
        kw["chat_template"] = read_text_file(kw["chat_template"], "--chat-template")
    config = kw.pop("config", None)
    kw["inputs"] = tuple(paths) if (paths or config) else (bundled_sample(),)
    if config:
        defaults = PackOptions(**{**kw, "inputs": ("-",)}).format_options()
        kw["config"] = load_config(config, defaults)
    return PackOptions(**kw)


def read_text_file(path: str, flag: str) -> str:
    """A small text file given on the command line (a template), as UTF-8 text, or a clear error: read
    through the one checked open (a FIFO, a device or a file over 4 MiB is one error line)."""
    from packers.files import read_checked, show_path

    data = read_checked(path, what=f"{flag} file", limit=4 * 2**20, fix="a chat template is a few KB")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise PackstreamError(f"{flag} {show_path(path)} is not UTF-8 text ({e.reason} at byte {e.start}); "
                              "save it as UTF-8") from None


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True})
@click.argument("inputs", nargs=-1, type=click.UNPROCESSED)
@options_for("pack")
@click.option("--quiet", "-q", is_flag=True, help="Print only errors.")
@click.option("--progress/--no-progress", default=None,
              help="Show records read, tokenized and packed with the rate and an ETA on stderr "
                   "(default: when stderr is a terminal; local runs only).")
@click.option("--log-format", type=_enum_choice(LogFormat), default="text", show_default=True,
              help="json: JSON lines on stdout for batch logs (progress events, then one done or error event).")
@click.option("--log-interval", type=float, default=None,
              help="Seconds between progress updates [default: 0.5 on a terminal, 10 with --log-format json].")
@click.option("--estimate", "estimate_only", is_flag=True, hidden=True)
@click.option("--sample", type=int, default=1000, hidden=True)
def pack(inputs, quiet, progress, log_format, log_interval, estimate_only, sample, **params):
    """Pack INPUT files (JSONL, JSON, Parquet, Arrow, datasets folders; globs; gs://, s3://) into --output.

    With no INPUT, packs the bundled sample. Other Beam options (--runner=DataflowRunner,
    --project=..., --setup_file=...) pass through to Beam; give them as --name=value.
    """
    from pipeline import _progress
    from pipeline._job import Committed, Failed, Interrupted, TemplateLaunched, launch

    own = [o for p in click.get_current_context().command.params for o in getattr(p, "opts", [])]
    reporter = None
    try:
        paths, beam_args = split_beam_args(inputs, own)
        options = build_options(paths, params, output_required=not estimate_only)
        _quiet_logs(quiet)
        if estimate_only:
            _print_estimate(options, sample, log_format, quiet)
            return
        reporter = _progress.for_cli(LogFormat(log_format), quiet, progress, log_interval)
    except PackstreamError as e:
        _fail(e, reporter=reporter)
    outcome = launch(options, beam_args, progress=reporter, quiet=quiet)
    match outcome:
        case Committed(manifest=manifest):
            if reporter is not None:
                reporter.done(manifest)
            if not quiet and LogFormat(log_format) is LogFormat.TEXT:
                click.echo(summary_table(manifest, _what_was_packed(options)))
        case TemplateLaunched(location=location):  # Dataflow runs the job graph later
            if not quiet:
                click.echo(f"job graph written to {location}; Dataflow runs it next")
        case Failed(error=error, exit_code=code, manifest=manifest):  # a worker's user error too: the manifest's
            _fail(error, code, reporter, summary=manifest if code == ExitCode.REJECTED else None)
        case Interrupted(message=message):
            _fail(message, outcome.exit_code, reporter)
        case _:
            raise InternalError(f"the launcher returned {outcome!r}, which is not an Outcome")


def _what_was_packed(options) -> "str | None":
    """The summary's first line when the run packed the bundled sample (no INPUT given), so nobody takes it for
    their own data; None otherwise."""
    if options.config or tuple(options.inputs) != (bundled_sample(),):
        return None
    files = sorted(p.name for p in Path(bundled_sample()).iterdir() if p.is_file())
    return (f"the bundled sample ({len(files)} files, a few records of every supported shape: {', '.join(files)}); "
            "pass your own files as INPUT")


def _quiet_logs(quiet: bool) -> None:
    """Dask's scheduler and nannies log every worker start and stop at INFO: noise to a packstream user. ``quiet``:
    only errors."""
    for name in ("distributed", "distributed.scheduler", "distributed.nanny", "distributed.core", "distributed.worker"):
        logging.getLogger(name).setLevel(logging.WARNING if not quiet else logging.ERROR)
    if quiet:
        logging.getLogger().setLevel(logging.ERROR)


def _repack_options():
    """Click decorators for ``repack``: pack's row options (``pipeline._job._repack.ROW_OPTIONS``), each defaulting
    to the folders' own, and its run options."""
    from pipeline._job import ROW_OPTIONS
    from pipeline._options import PackOptions

    hints = typing.get_type_hints(PackOptions)
    decorators = []
    for f in dataclasses.fields(PackOptions):
        meta = f.metadata.get("cli")
        if not meta or f.name not in ROW_OPTIONS + ("workers", "tokenizer_threads", "force_workers", "overwrite"):
            continue
        names = [meta["flag"]] + ([meta["short"]] if meta["short"] else [])
        kw: dict[str, Any] = {"help": meta["help"] + (" [default: the folders' own]" if f.name in ROW_OPTIONS else "")}
        if meta["kind"] == "flag":
            names = [f"{meta['flag']}/--no-{meta['flag'][2:]}"]
            kw.update(default=None)
        elif meta["kind"] == "switch":
            kw.update(is_flag=True, default=False)
        elif meta["kind"] == "auto":
            kw.update(type=_AUTO_COUNT, default=0, metavar=meta["metavar"], show_default="auto")
        else:
            kw.update(type=_click_type(f, hints[f.name]), metavar=meta["metavar"], default=None)
        decorators.append(click.option(*names, f.name, **kw))
    return lambda fn: functools.reduce(lambda acc, d: d(acc), reversed(decorators), fn)


@main.command("repack", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True})
@click.argument("folders", nargs=-1, type=click.UNPROCESSED, metavar="FOLDER...")
@click.option("--output", "-o", default=None, metavar="DIR", help="Output folder (local); as pack's --output.")
@click.option("--config", default=None, type=click.Path(exists=True, dir_okay=False), metavar="FILE",
              help="A --config as pack's, whose data sets may name packed folders (with weight and loss_weight) "
                   "beside raw inputs (tokenized as pack does).")
@_repack_options()
@click.option("--quiet", "-q", is_flag=True, help="Print only errors.")
def repack_command(folders, output, config, quiet, **params):
    """Repack packed FOLDERs of text rows to a new budget, mixture or split, without tokenizing again.

    Takes pack's row options (--max-tokens, --mode, --seed, --validation-fraction, --num-shards, --long, ...);
    an option not given is the folders' own. The rows equal those `packstream pack` writes from the folders'
    raw inputs with the same options, when no example was cut at the first pack (cut ones are carried, marked).
    Beam options (--runner=DaskRunner, ...) pass through as for pack.
    """
    from pipeline._job import Committed, Failed, Interrupted
    from pipeline._job import launch as _launch
    from pipeline._job import ROW_OPTIONS, RepackOptions

    own = [o for p in click.get_current_context().command.params for o in getattr(p, "opts", [])]
    try:
        paths, beam_args = split_beam_args(folders, own)
        if output is None:
            raise click.UsageError("Missing option '--output' / '-o'.")
        rows = tuple((k, v) for k, v in params.items() if k in ROW_OPTIONS and v is not None)
        ropts = RepackOptions(folders=tuple(paths), config=config, output=output, rows=rows,
                              overwrite=params["overwrite"], workers=params["workers"],
                              tokenizer_threads=params["tokenizer_threads"], force_workers=params["force_workers"])
        _quiet_logs(quiet)
    except PackstreamError as e:
        _fail(e)
    outcome = _launch(ropts, beam_args, quiet=True)
    match outcome:
        case Committed(manifest=manifest):
            if not quiet:
                click.echo(summary_table(manifest))
        case Failed(error=error, exit_code=code, manifest=manifest):
            _fail(error, code, summary=manifest if code == ExitCode.REJECTED else None)
        case Interrupted(message=message):
            _fail(message, outcome.exit_code)
        case _:
            raise InternalError(f"the launcher returned {outcome!r}, which is not an Outcome")


@main.command("estimate")
@click.argument("inputs", nargs=-1)
@options_for("estimate")
@click.option("--sample", type=int, default=1000, show_default=True, help="Records sampled per input.")
@click.option("--json", "as_json", is_flag=True, help="Print the estimate as one JSON object.")
@click.option("--quiet", "-q", is_flag=True, help="Print only errors.")
def estimate_command(inputs, sample, as_json, quiet, **params):
    """Predict a pack job from a sample of its INPUT files: rows, fill, tokens, output size, run time.

    Takes the options of `packstream pack` that shape the output (no --output needed).
    """
    with _user_errors():
        options = build_options(inputs, params)
        _quiet_logs(quiet)
        _print_estimate(options, sample, "json" if as_json else "text", quiet)


@main.command("preview")
@click.argument("inputs", nargs=-1)
@options_for("preview")
@click.option("-n", "--records", "n", type=int, default=5, show_default=True, help="Records shown per input.")
@click.option("--color/--no-color", default=None, help="Highlight targets in colour [default: on a terminal]; "
              "otherwise targets are shown in [[...]] brackets.")
def preview_command(inputs, n, color, **params):
    """Show how the first records of each INPUT are read, rendered and masked, without packing.

    For each record: the detected format and the mapping used, the rendered text with the training
    targets highlighted, token counts, or the rejection reason with its remedy. No Beam; quick.
    """
    from pipeline._tools import preview as _preview

    with _user_errors():
        options = build_options(inputs, params)
        if n < 1:
            raise PackstreamError(f"-n {n} must be >= 1 records per input")
        use_color = sys.stdout.isatty() if color is None else color
        click.echo(_preview.format_preview(_preview.preview(options, n), color=use_color))


def _print_estimate(options, sample: int, log_format: str, quiet: bool) -> None:
    from pipeline._job import run
    from pipeline._tools.estimate import estimate, format_estimate

    # The tools do not import the job (STYLE.md, layering): the command hands estimate the launcher for its timed pack.
    est = estimate(options, sample=sample, timed_run=functools.partial(run, quiet=True))
    if quiet:
        return
    if LogFormat(log_format) is LogFormat.JSON:
        click.echo(json.dumps({"event": "estimate", **est}, sort_keys=True))
    else:
        click.echo(format_estimate(est))




@main.command("inspect")
@click.argument("folder", metavar="DIR")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object (schema_version 2).")
@click.option("--plots-dir", default=None, help="Folder for the PNGs [default: DIR-inspect beside a local DIR].")
@click.option("--no-plots", is_flag=True, help="Write no PNGs.")
def inspect_command(folder, as_json, plots_dir, no_plots):
    """Summarize a finished output folder DIR: rows, fill, lengths, rejects, and three PNG plots.

    Opens the shards its complete manifest.json lists (train and validation: totals, then each
    split), reading only their num_tokens, seq_offsets, loss_mask and example_ids columns; counts
    what left the main path as pack's summary does (local, gs://, s3://).
    """
    from pipeline._tools import inspect as _inspect

    with _user_errors():
        report = _inspect.inspect(folder, None if no_plots else (plots_dir or _inspect.default_plots_dir(folder)))
    click.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else _inspect.format_report(report))


@main.command("verify")
@click.argument("folder", metavar="DIR")
@click.argument("input_paths", nargs=-1, metavar="[INPUT]...")
@click.option("--inputs", "with_inputs", is_flag=True,
              help="Also reconcile every input record: INPUT paths follow DIR (or the flag); with none, "
                   "the inputs recorded in manifest.json.")
@click.option("--trust-remote-code", is_flag=True,
              help="With --inputs: allow the tokenizer named in manifest.json to run its own code. Off by "
                   "default, whatever the manifest says.")
@click.option("--max-problems", type=int, default=50, show_default=True, help="Problems printed (all are counted).")
def verify_command(folder, input_paths, with_inputs, trust_remote_code, max_problems):
    """Re-check a packed output folder DIR: manifest, files, schema, rows, offsets, ids, counts, dead letters.

    Only a complete manifest.json is trusted, and only the shards it lists are opened; any other
    shard-like file is reported by name. With --inputs, every input record must be packed with the
    same tokens (re-encoded with the run's options) or be in rejected.jsonl; the tokenizer to load is
    printed first. Exit status: 0 when everything matches, 1 on any mismatch (each one printed with
    its shard, row, check, expected and actual value), 2 on a user error.

    Example: packstream verify out/ --inputs data/*.jsonl
    """
    from pipeline._tools.verify import verify

    if input_paths and not with_inputs:
        raise click.UsageError(f"unexpected argument {input_paths[0]!r}; put --inputs before input paths")
    with _user_errors():
        report = verify(folder, tuple(input_paths) if with_inputs else None, trust_remote_code=trust_remote_code,
                        announce=lambda line: click.echo(line, err=True))
    for p in report.problems[:max_problems]:
        click.echo(printable(str(p)))
    if report.count > max_problems:
        click.echo(f"... and {report.count - max_problems} more")
    click.echo(report.summary())
    if not report.ok:
        click.secho(f"FAILED: {report.count} problem(s)", fg="red", err=True)
        sys.exit(ExitCode.VERIFY_FAILED)
    click.secho("OK", fg="green")


if __name__ == "__main__":  # pragma: no cover
    main()
