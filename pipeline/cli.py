"""``packstream``: the command line. A thin click wrapper around :func:`pipeline.run`."""

from __future__ import annotations

import difflib
import logging
import os
import sys
from importlib import resources
from typing import Sequence

import click

# Import-time chatter that says nothing to a packstream user: Beam's optional GCP clients and
# transformers' "PyTorch was not found" (the job needs only tokenizers).
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class _DropImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "apitools not found" not in record.getMessage()


logging.getLogger().addFilter(_DropImportNoise())

from packers import LongPolicy, PackstreamError
from pipeline._options import DEFAULT_TOKENIZER, Format, OutputFormat, PackMode, PackOptions, TrainOn
from pipeline._progress import LogFormat


def bundled_sample() -> str:
    """The project's own sample of instruction records, in several formats."""
    return str(resources.files("pipeline").joinpath("data"))


def _enum_choice(enum_cls) -> click.Choice:
    return click.Choice([m.value for m in enum_cls])


def split_beam_args(tokens: Sequence[str], own_options: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate input paths from Beam pipeline options; unknown options are a clear error."""
    from apache_beam.options.pipeline_options import PipelineOptions, _BeamArgumentParser

    parser = _BeamArgumentParser(allow_abbrev=False)
    seen = {}
    for cls in PipelineOptions.__subclasses__():
        seen.setdefault(str(cls), cls)
    for cls in seen.values():
        cls._add_argparse_args(parser)  # the same parser Beam builds in get_all_options()
    _, unknown = parser.parse_known_args(list(tokens))
    bad = [t for t in unknown if t.startswith("-")]
    if bad:
        known = [o for a in parser._actions for o in a.option_strings] + list(own_options)
        name = bad[0].split("=", 1)[0]
        hint = difflib.get_close_matches(name, known, n=1)
        raise click.UsageError(
            f"unknown option {name}" + (f"; did you mean {hint[0]}?" if hint else "; see packstream pack --help")
        )
    inputs = [t for t in unknown if t != "--"]
    beam_args = [t for t in tokens if t not in inputs]
    return inputs, beam_args


EXIT_USER_ERROR = 2
"""Bad input, bad option or a bad output folder: one ``error: ...`` line, no traceback."""
EXIT_TOO_MANY_REJECTED = 3
"""The job finished but rejected more than ``--max-reject-fraction`` of the records."""


def _fail(e: "Exception | str", code: int = EXIT_USER_ERROR, reporter=None) -> None:
    click.secho(f"error: {e}", fg="red", err=True)
    if reporter is not None:
        reporter.error(str(e), code)  # --log-format json: the batch log ends with an error event
    sys.exit(code)


class _NoUserErrorTracebacks(logging.Filter):
    """Beam logs a failing DoFn's traceback before re-raising; a user error gets one line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, PackstreamError) and not isinstance(record.msg, PackstreamError)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="packstream")
def main() -> None:
    """Pack instruction data into fixed-budget rows for FlashAttention-2 training."""


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True})
@click.argument("inputs", nargs=-1, type=click.UNPROCESSED)
@click.option("--output", "-o", default=None, help="Output folder (local, gs://, s3://). Required unless --estimate.")
@click.option("--tokenizer", default=DEFAULT_TOKENIZER, show_default=True,
              help="Hugging Face tokenizer name or local path (fast tokenizers only).")
@click.option("--max-tokens", type=int, default=4096, show_default=True, help="Token budget per packed row.")
@click.option("--format", "fmt", type=_enum_choice(Format), default="auto", show_default=True,
              help="Record shape; auto detects it per record.")
@click.option("--field", "fields", multiple=True, metavar="NAME=ROLE",
              help="Map a field to a turn (repeat, in order), e.g. --field question=user --field answer=assistant. "
                   "ROLE: system, user, assistant, tool, or text (one field, every token trained).")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False),
              help="Jinja chat template file overriding the tokenizer's own and the built-in ChatML.")
@click.option("--train-on", type=_enum_choice(TrainOn), default="assistant", show_default=True)
@click.option("--long", "long_policy", type=_enum_choice(LongPolicy), default="drop", show_default=True,
              help="Examples longer than --max-tokens: drop (dead-lettered), truncate, or split.")
@click.option("--max-per-row", type=int, default=None, help="Cap on examples per row.")
@click.option("--refine/--no-refine", default=True, show_default=True,
              help="After best-fit decreasing, try exact fill (minimum bin slack) per group and keep the "
                   "fewer rows. Off when --max-per-row is set.")
@click.option("--group-size", type=int, default=10_000, show_default=True,
              help="Examples per packing group (grouped mode).")
@click.option("--mode", type=_enum_choice(PackMode), default="grouped", show_default=True,
              help="grouped: pack bounded groups; global: two passes over all lengths for the last bit of fill.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the row shuffle.")
@click.option("--num-shards", type=int, default=0, show_default=True, help="Output shards (0: automatic).")
@click.option("--output-format", type=_enum_choice(OutputFormat), default="arrow", show_default=True)
@click.option("--max-record-bytes", type=int, default=16 * 2**20, show_default=True)
@click.option("--max-reject-fraction", type=float, default=1.0, show_default=True,
              help="Fail (exit 3) when more than this fraction of records is rejected or dropped.")
@click.option("--trust-remote-code", is_flag=True, help="Allow tokenizers with custom code (off by default).")
@click.option("--overwrite", is_flag=True, help="Replace packstream's files in a non-empty --output.")
@click.option("--batch-size", type=int, default=512, show_default=True, help="Records per tokenizer batch.")
@click.option("--workers", type=int, default=1, show_default=True,
              help="Local worker processes (FnApiRunner multi-processing); use the machine's cores.")
@click.option("--quiet", "-q", is_flag=True, help="Print only errors.")
@click.option("--progress/--no-progress", default=None,
              help="Show records read, tokenized and packed with the rate and an ETA on stderr "
                   "(default: when stderr is a terminal; local runs only).")
@click.option("--log-format", type=_enum_choice(LogFormat), default="text", show_default=True,
              help="json: JSON lines on stdout for batch logs (progress events, then one done or error event).")
@click.option("--log-interval", type=float, default=None,
              help="Seconds between progress updates [default: 0.5 on a terminal, 10 with --log-format json].")
@click.option("--estimate", "estimate_only", is_flag=True,
              help="Pack nothing: sample the inputs and predict rows, fill, tokens, output size and local run time.")
@click.option("--sample", type=int, default=1000, show_default=True, help="Records sampled per input by --estimate.")
def pack(inputs, output, tokenizer, max_tokens, fmt, fields, chat_template, train_on, long_policy, max_per_row, refine,
         group_size, mode, seed, num_shards, output_format, max_record_bytes, max_reject_fraction,
         trust_remote_code, overwrite, batch_size, workers, quiet, progress, log_format, log_interval,
         estimate_only, sample):
    """Pack INPUT files (JSONL, JSON, Parquet, Arrow, datasets folders; globs; gs://, s3://) into OUTPUT.

    With no INPUT, packs the bundled sample. Other Beam options (--runner=DataflowRunner,
    --project=..., --setup_file=...) pass through to Beam; give them as --name=value.
    """
    from pipeline._job import TooManyRejected, run

    from pipeline import _progress

    own = [o for p in click.get_current_context().command.params for o in getattr(p, "opts", [])]
    paths, beam_args = split_beam_args(inputs, own)
    if output is None and not estimate_only:
        raise click.UsageError("Missing option '--output' / '-o' (required unless --estimate).")
    reporter = None
    try:
        mapping = []
        for spec in fields:
            if "=" not in spec:
                raise PackstreamError(f"--field {spec!r} must look like NAME=ROLE, e.g. question=user")
            name, role = spec.split("=", 1)
            mapping.append((name, role))
        template = open(chat_template, encoding="utf-8").read() if chat_template else None
        options = PackOptions(
            inputs=tuple(paths) or (bundled_sample(),), output=output or "", tokenizer=tokenizer, max_tokens=max_tokens,
            format=Format(fmt), fields=tuple(mapping), chat_template=template, train_on=TrainOn(train_on),
            long=LongPolicy(long_policy), max_per_row=max_per_row, refine=refine, group_size=group_size, mode=PackMode(mode),
            seed=seed, num_shards=num_shards, output_format=OutputFormat(output_format),
            max_record_bytes=max_record_bytes, max_reject_fraction=max_reject_fraction,
            trust_remote_code=trust_remote_code, overwrite=overwrite, batch_size=batch_size,
        )
        if workers < 1:
            raise PackstreamError(f"--workers {workers} must be >= 1 (this machine has {os.cpu_count()} cores)")
        if quiet:
            logging.getLogger().setLevel(logging.ERROR)
        beam_log = logging.getLogger("apache_beam.runners.common")
        if not any(isinstance(f, _NoUserErrorTracebacks) for f in beam_log.filters):
            beam_log.addFilter(_NoUserErrorTracebacks())
        if estimate_only:
            _print_estimate(options, sample, workers, log_format, quiet)
            return
        reporter = _progress.for_cli(LogFormat(log_format), quiet, progress, log_interval)
        manifest = run(options, beam_args, workers=workers, progress=reporter)
    except TooManyRejected as e:
        _fail(e, EXIT_TOO_MANY_REJECTED, reporter)
    except PackstreamError as e:
        _fail(e, reporter=reporter)
    except Exception as e:  # a Beam job failure wraps the worker's exception: surface user errors cleanly
        msg = _user_error_in(e)
        if msg is None:
            raise
        _fail(msg, reporter=reporter)
    if "counts" not in manifest:  # a Flex Template launch: Dataflow runs the job graph later
        if not quiet:
            click.echo(f"job graph written to {manifest['template_location']}; Dataflow runs it next")
        return
    if reporter is not None:
        reporter.done(manifest)
    if not quiet and LogFormat(log_format) is LogFormat.TEXT:
        click.echo(summary_table(manifest))


def _print_estimate(options: PackOptions, sample: int, workers: int, log_format: str, quiet: bool) -> None:
    from pipeline._estimate import estimate, format_estimate

    est = estimate(options, sample=sample, workers=workers)
    if quiet:
        return
    if LogFormat(log_format) is LogFormat.JSON:
        import json

        click.echo(json.dumps({"event": "estimate", **est}, sort_keys=True))
    else:
        click.echo(format_estimate(est))


def _user_error_in(e: BaseException) -> "str | None":
    """The PackstreamError message inside a Beam failure, if that is what it was."""
    text = str(e)
    for name in ("PackstreamError: ", "ContractError: "):
        if name in text:
            return text.split(name, 1)[1].splitlines()[0].strip(" '\"[]")
    return None


def summary_table(manifest: dict) -> str:
    c = manifest["counts"]
    lines = [
        ("records read", f"{c['records_read']:,}"),
        ("examples packed", f"{c['examples_packed']:,}"),
        ("rejected", f"{c['rejected']:,}"),
        *[(f"  {k}", f"{v:,}") for k, v in c["rejected_by_reason"].items()],
        (f"dropped (> {manifest['config']['max_tokens']} tokens)", f"{c['dropped_too_long']:,}"),
        ("truncated / split examples", f"{c['truncated_examples']:,} / {c['split_examples']:,}"),
        ("rows", f"{c['rows']:,}  (lower bound {c['lower_bound']:,}, "
                 f"+{(c['rows'] / c['lower_bound'] - 1) if c['lower_bound'] else 0:.2%})"),
        ("tokens", f"{c['tokens']:,}  ({c['target_tokens']:,} targets)"),
        ("fill", f"{c['fill']:.3%}"),
        ("examples per row", f"{c['examples_per_row']:.2f}"),
        ("shards", f"{len(manifest['shards'])}  -> {manifest['config']['output']}"),
        ("time", f"{manifest.get('elapsed_s', 0):.1f} s  ({c['tokens'] / max(manifest.get('elapsed_s', 1), 1e-9):,.0f} tokens/s)"),
    ]
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)


@main.command("inspect")
@click.argument("folder", metavar="DIR")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object (schema_version 1).")
@click.option("--plots-dir", default=None, help="Folder for the PNGs [default: DIR-inspect beside a local DIR].")
@click.option("--no-plots", is_flag=True, help="Write no PNGs.")
def inspect_command(folder, as_json, plots_dir, no_plots):
    """Summarize a packed output folder DIR: rows, fill, lengths, rejects, and three PNG plots.

    Reads the shards' num_tokens and seq_offsets columns and manifest.json (local, gs://, s3://).
    """
    import json

    from pipeline import _inspect

    try:
        report = _inspect.inspect(folder, None if no_plots else (plots_dir or _inspect.default_plots_dir(folder)))
    except PackstreamError as e:
        _fail(e)
    click.echo(json.dumps(report, indent=2, sort_keys=True) if as_json else _inspect.format_report(report))


@main.command("estimate", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                           "help_option_names": []})
@click.pass_context
def estimate_command(ctx):
    """Predict a pack job from a sample of its inputs; the same as `packstream pack --estimate`.

    Takes the options of `packstream pack` (--output is optional); see `packstream estimate --help`.
    """
    sub = pack.make_context("estimate", [*ctx.args, "--estimate"], parent=ctx.parent)
    with sub:
        pack.invoke(sub)


EXIT_VERIFY_FAILED = 1
"""``packstream verify`` found at least one mismatch."""


@main.command("verify")
@click.argument("folder", metavar="DIR")
@click.argument("input_paths", nargs=-1, metavar="[INPUT]...")
@click.option("--inputs", "with_inputs", is_flag=True,
              help="Also reconcile every input record: INPUT paths follow DIR (or the flag); with none, "
                   "the inputs recorded in manifest.json.")
@click.option("--max-problems", type=int, default=50, show_default=True, help="Problems printed (all are counted).")
def verify_command(folder, input_paths, with_inputs, max_problems):
    """Re-check a packed output folder DIR: schema, rows, offsets, ids, counts, dead letters.

    With --inputs, every input record must be packed with the same tokens (re-tokenized) or be in
    rejected.jsonl. Exit status: 0 when everything matches, 1 on any mismatch (each one printed
    with its shard, row, field, expected and actual value), 2 on a user error.

    Example: packstream verify out/ --inputs data/*.jsonl
    """
    from pipeline._verify import verify

    if input_paths and not with_inputs:
        raise click.UsageError(f"unexpected argument {input_paths[0]!r}; put --inputs before input paths")
    try:
        report = verify(folder, tuple(input_paths) if with_inputs else None)
    except PackstreamError as e:
        _fail(e)
    for p in report.problems[:max_problems]:
        click.echo(str(p))
    if len(report.problems) > max_problems:
        click.echo(f"... and {len(report.problems) - max_problems} more")
    click.echo(report.summary())
    if not report.ok:
        click.secho(f"FAILED: {len(report.problems)} problem(s)", fg="red", err=True)
        sys.exit(EXIT_VERIFY_FAILED)
    click.secho("OK", fg="green")


if __name__ == "__main__":  # pragma: no cover
    main()
