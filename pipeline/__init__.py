"""packstream's offline packing job: read, render, tokenize, pack and write (Apache Beam).

Layout: ``_read`` (inputs -> records), ``_formats`` (records -> conversations),
``_render`` (conversations -> tokens and loss masks), ``_rows`` (examples -> packed rows),
``_write`` (rows -> shards, dead letters, manifest, card), ``_job`` (the Beam steps, the commit
and :func:`run`, the launcher), ``_workers`` (signals and local worker processes), ``cli`` (the
``packstream`` command).
"""

from pipeline._options import DEFAULT_TOKENIZER, Format, OutputFormat, PackMode, PackOptions, TrainOn


def __getattr__(name: str):
    if name == "RepackOptions":  # the job's module (Beam-free), loaded when asked for
        from pipeline._job import RepackOptions

        return RepackOptions
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")


def run(options: "PackOptions | RepackOptions", beam_args=()) -> dict:
    """Run the packing job (a :class:`RepackOptions`: ``packstream repack``); returns the manifest (see ``manifest.json``). Raises PackstreamError when the run fails
    (:func:`launch` returns how it ended instead)."""
    from pipeline._job import run as _run

    return _run(options, beam_args)


def launch(options: PackOptions, beam_args=()):
    """Run the packing job; returns how it ended, never raising for a user error, a failed run or a signal:
    ``Committed(manifest)``, ``Failed(error, exit_code, manifest)``, ``TemplateLaunched(location, config)`` or
    ``Interrupted(signum, message)`` (``pipeline._job._outcome``), each with its ``exit_code``."""
    from pipeline._job import launch as _launch

    return _launch(options, beam_args)


__all__ = ["DEFAULT_TOKENIZER", "Format", "OutputFormat", "PackMode", "PackOptions", "RepackOptions", "TrainOn", "launch",
           "run"]
