"""``packstream``: the command line. A thin click wrapper around :func:`pipeline.run`."""

from __future__ import annotations

import difflib
import logging
import os
import sys
from importlib import resources
from typing import Sequence

import click

from packers import LongPolicy, PackstreamError
from pipeline._options import DEFAULT_TOKENIZER, Format, OutputFormat, PackMode, PackOptions, TrainOn


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


def _fail(e: Exception) -> None:
    click.secho(f"error: {e}", fg="red", err=True)
    sys.exit(2)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="packstream")
def main() -> None:
    """Pack instruction data into fixed-budget rows for FlashAttention-2 training."""


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True})
@click.argument("inputs", nargs=-1, type=click.UNPROCESSED)
@click.option("--output", "-o", required=True, help="Output folder (local, gs://, s3://).")
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
def pack(inputs, output, tokenizer, max_tokens, fmt, fields, chat_template, train_on, long_policy, max_per_row,
         group_size, mode, seed, num_shards, output_format, max_record_bytes, max_reject_fraction,
         trust_remote_code, overwrite, batch_size, workers, quiet):
    """Pack INPUT files (JSONL, JSON, Parquet, Arrow, datasets folders; globs; gs://, s3://) into OUTPUT.

    With no INPUT, packs the bundled sample. Other Beam options (--runner=DataflowRunner,
    --project=..., --setup_file=...) pass through to Beam; give them as --name=value.
    """
    from pipeline._job import run

    own = [o for p in click.get_current_context().command.params for o in getattr(p, "opts", [])]
    paths, beam_args = split_beam_args(inputs, own)
    try:
        mapping = []
        for spec in fields:
            if "=" not in spec:
                raise PackstreamError(f"--field {spec!r} must look like NAME=ROLE, e.g. question=user")
            name, role = spec.split("=", 1)
            mapping.append((name, role))
        template = open(chat_template, encoding="utf-8").read() if chat_template else None
        options = PackOptions(
            inputs=tuple(paths) or (bundled_sample(),), output=output, tokenizer=tokenizer, max_tokens=max_tokens,
            format=Format(fmt), fields=tuple(mapping), chat_template=template, train_on=TrainOn(train_on),
            long=LongPolicy(long_policy), max_per_row=max_per_row, group_size=group_size, mode=PackMode(mode),
            seed=seed, num_shards=num_shards, output_format=OutputFormat(output_format),
            max_record_bytes=max_record_bytes, max_reject_fraction=max_reject_fraction,
            trust_remote_code=trust_remote_code, overwrite=overwrite, batch_size=batch_size,
        )
        if workers < 1:
            raise PackstreamError(f"--workers {workers} must be >= 1 (this machine has {os.cpu_count()} cores)")
        if quiet:
            logging.getLogger().setLevel(logging.ERROR)
        manifest = run(options, beam_args, workers=workers)
    except PackstreamError as e:
        _fail(e)
    except Exception as e:  # a Beam job failure wraps the worker's exception: surface user errors cleanly
        msg = _user_error_in(e)
        if msg is None:
            raise
        _fail(msg)
    if not quiet:
        click.echo(summary_table(manifest))


def _user_error_in(e: BaseException) -> "str | None":
    """The PackstreamError message inside a Beam failure, if that is what it was."""
    text = str(e)
    marker = "PackstreamError: "
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


if __name__ == "__main__":  # pragma: no cover
    main()
