"""The launcher: :func:`run` decides the run, owns the output folder for it, runs the job and ends it.

::

    launch      prepare and run, ending in one Outcome (pipeline._job._outcome); run() turns it into the manifest
    prepare     the inputs, the tokenizer (checked once, here), the workers, Beam's options -> Launch
    run         one ExitStack; each resource is entered once and cleans up after itself, in reverse:
      owned       the output folder: the claim (lock, journal, guard card); released after the commit,
                  or, when anything stops the run, stopped(): a failed manifest and guard card (or the
                  rest of a commit already made), so every reader refuses the folder and --overwrite
                  can clear it; a signal ends as Interrupted
      spill       the spill folder under the output, removed
      outcome     the local outcome file (where the commit says why when it cannot write the manifest)
      environ     the tokenizer's threads for local workers (the Rust library reads them), restored
      workers     the local workers (forked before any thread starts), reaped (killed on an error)
      progress    the progress folder and its reporter (local runs)
      job         the job's plan (pipeline._job._plan.PACK) on the local runner (pipeline._job._local), or
                  as the Beam graph on Beam's runner (pipeline._job._graph); a signal cancels a remote job
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
import uuid
from typing import Any, Iterator, Optional, Sequence

from packers import PackstreamError
from packers.files import show_path
from packers.manifest import MANIFEST, Status
from pipeline import _output, _progress, _read, _trace, _write
from pipeline._job import _local
from pipeline._job._commit import Verdict, remove_spill, stopped
from pipeline._job._context import Inputs, RunContext, decide
from pipeline._job._plan import PACK, REPACK, Plan
from pipeline._job._outcome import Committed, Failed, Interrupted, Outcome, TemplateLaunched, from_manifest
from pipeline._job._runner import DASK_RUNNER, local_beam_options, names_runner, pipeline_options, unknown_beam_args
from pipeline._options import PackOptions
from pipeline._tokenizer import tokenizer_identity
from pipeline._workers import on_dask, parallel, signals


@dataclasses.dataclass(frozen=True)
class Launch:
    """What the launcher decided before it touches the output folder: the run, and what runs it."""

    ctx: RunContext
    pipe_opts: Any
    """Beam's PipelineOptions for a Beam runner (``--runner``); None for a local run (no Beam)."""
    workers: int
    """Local worker processes."""
    environ: dict[str, str]
    """The environment that gives local workers their tokenizer threads (empty for a remote runner)."""
    template: Optional[str]
    """A Flex Template launch (``--template_location``): where the job graph goes; nothing is run."""
    avoid: tuple[str, ...]
    """The inputs and the folders their globs start from: paths the output folder must not touch."""
    plan: Plan = PACK
    """The job: :data:`~pipeline._job._plan.PACK`, or a repack's."""


def run(options: PackOptions, beam_args: Sequence[str] = (), progress: Optional[_progress.Progress] = None,
        *, quiet: bool = False) -> dict:
    """Build and run the whole job; returns the manifest. Raises PackstreamError on user error.

    :func:`launch` with its outcome turned into a value or an error, for callers that want a manifest:
    ``Committed`` -> the manifest; ``TemplateLaunched`` (``--template_location``: Dataflow runs the job graph
    later and writes the manifest) -> ``{"config", "template_location"}``; ``Failed`` -> PackstreamError
    (:class:`TooManyRejected` for exit code 3); ``Interrupted`` -> :class:`~pipeline._workers.signals.Interrupted`.
    """
    return launch(options, beam_args, progress, quiet=quiet).result()


def launch(options: PackOptions, beam_args: Sequence[str] = (), progress: Optional[_progress.Progress] = None,
           *, quiet: bool = False) -> Outcome:
    """Build and run the whole job; returns how it ended (:mod:`pipeline._job._outcome`), never raising for a user
    error, a failed run or a signal: each is an outcome with its one line and exit code.

    ``progress`` reports a local run while it runs (see :mod:`pipeline._progress`); it never
    changes the output. ``quiet``: print no warning. A signal (the CLI handles SIGINT, SIGTERM and SIGHUP:
    :mod:`pipeline._workers.signals`) ends as :class:`Interrupted` once the folder is a failed output.
    """
    started = time.time()
    try:
        outcome = _launched(prepare(options, beam_args, quiet=quiet) if isinstance(options, PackOptions)
                            else prepare_repack(options, beam_args), progress)
    except signals.Interrupted as e:
        return Interrupted(e.signum, str(e))
    except PackstreamError as e:
        return Failed(str(e))
    if isinstance(outcome, Committed):
        outcome.manifest["elapsed_s"] = round(time.time() - started, 3)
    return outcome


def prepare(options: PackOptions, beam_args: Sequence[str] = (), *, quiet: bool = False) -> Launch:
    """Everything decided before the folder is touched: a mistake here writes nothing."""
    options = dataclasses.replace(options, output=_output.normalize_output(options.output))
    _trace.mark("launch", process_cpu=time.process_time())
    with _trace.span("launch_inputs"):
        files, notes, skipped = _read.expand_datasets(options.datasets())
    sizes = [_read.input_bytes(f) for f in files]
    local = not names_runner(beam_args)
    if local and beam_args:  # Beam's options change nothing without a Beam runner: say so, naming what to use
        unknown_beam_args(beam_args)  # a bad value names itself first
        raise PackstreamError(local_beam_options(beam_args))
    pipe_opts = None if local else pipeline_options(beam_args)
    template, dask_task_bytes = None, None
    if pipe_opts is not None:
        from apache_beam.options.pipeline_options import GoogleCloudOptions, StandardOptions

        template = pipe_opts.view_as(GoogleCloudOptions).template_location
        if pipe_opts.view_as(StandardOptions).runner == DASK_RUNNER:  # before the tokenizer: the cluster's
            dask_task_bytes = on_dask.layout(pipe_opts, files, sizes)  # workers warm up meanwhile
    with _trace.span("launch_tokenizer"):
        identity = tokenizer_identity(options.tokenizer, options.trust_remote_code)
        _check_launch(options, identity, quiet)
    inputs = Inputs(tuple(files), tuple(notes), identity, sum(sizes), tuple(skipped), tuple(sizes))
    with _trace.span("launch_parallelism"):  # a --processor run's images, measured on a sample: work, not bytes
        par, size, scale = parallel.for_run(options, files, sizes)
    task_bytes = dask_task_bytes or _read.task_bytes(size, par.workers if local else None, scale)
    if local:  # every worker process (this one for one worker) takes its share of the cores for the tokenizer
        options = dataclasses.replace(options, workers=par.workers, tokenizer_threads=par.threads)
    run_id = uuid.uuid4().hex[:12]
    with _trace.span("launch_context", workers=par.workers, threads=par.threads):
        ctx = decide(options, inputs, run_id, task_bytes)
    if local:
        ctx = dataclasses.replace(ctx, outcome=os.path.join(tempfile.gettempdir(), f"packstream-outcome-{run_id}.json"),
                                  parallelism=par.to_dict())
    avoid = [f.path for f in files] + [_glob_root(p) for d in options.datasets() for p in d.paths]
    return Launch(ctx, pipe_opts, par.workers, par.env() if local else {}, template, tuple(avoid))


def prepare_repack(ropts, beam_args: Sequence[str] = ()) -> Launch:
    """:func:`prepare` for ``packstream repack`` (:class:`pipeline._job._repack.RepackOptions`): the equivalent pack
    resolved from the folders (:func:`pipeline._job._repack.context`); the tokenizer is loaded only for raw inputs."""
    from pipeline._job import _repack

    ropts = dataclasses.replace(ropts, output=_output.normalize_output(ropts.output))
    local = not names_runner(beam_args)
    if local and beam_args:
        unknown_beam_args(beam_args)
        raise PackstreamError(local_beam_options(beam_args))
    pipe_opts = None if local else pipeline_options(beam_args)
    run_id = uuid.uuid4().hex[:12]
    ctx = _repack.context(ropts, run_id)
    raw = ctx.read_files()
    if raw:  # raw inputs beside the folders: tokenized as pack does, with the folders' tokenizer
        identity = tokenizer_identity(ctx.options.tokenizer, ctx.options.trust_remote_code)
        if identity.get("vocab_sha256") != ctx.tokenizer.get("vocab_sha256"):
            raise PackstreamError(f"tokenizer {identity['name']} here is not the one the folders were packed with "
                                  f"({ctx.tokenizer.get('name')}); install that version to encode the raw inputs")
        _check_launch(ctx.options, identity, True)
    shard_bytes = sum(os.path.getsize(os.path.join(src.folder, n)) for src in ctx.packed for n, _ in src.shards)
    raw_sizes = [_read.input_bytes(f) for f in raw]
    elements = len(_repack.repack_inputs(ctx))
    par = parallel.choose(ropts.workers, ropts.tokenizer_threads, float(shard_bytes + sum(raw_sizes)),
                          read_tasks=lambda n: elements + (_read.read_tasks(list(raw), sum(raw_sizes), n) if raw else 0))
    task_bytes = _read.task_bytes(sum(raw_sizes), par.workers if local else None) if raw else _read.TASK_BYTES
    options = ctx.options
    if local:
        options = dataclasses.replace(options, workers=par.workers, tokenizer_threads=par.threads)
    ctx = dataclasses.replace(ctx, options=options, task_bytes=task_bytes)
    if local:
        ctx = dataclasses.replace(ctx, outcome=os.path.join(tempfile.gettempdir(), f"packstream-outcome-{run_id}.json"),
                                  parallelism=par.to_dict())
    avoid = [src.folder for src in ctx.packed] + [f.path for f in raw]
    return Launch(ctx, pipe_opts, par.workers, par.env() if local else {}, None, tuple(avoid), REPACK)


def _launched(launch: Launch, progress: Optional[_progress.Progress]) -> Outcome:
    """Run the job with its resources held (see the module docstring): what the folder's manifest records, or
    the template launch the runner was asked for."""
    ctx = launch.ctx
    with contextlib.ExitStack() as stack:
        stack.enter_context(_owned(launch))
        stack.callback(remove_spill, ctx.spill)
        if ctx.outcome:
            stack.callback(_remove_file, ctx.outcome)
        stack.enter_context(_environ(launch.environ))
        local = launch.pipe_opts is None
        workers = stack.enter_context(_workers(launch.workers)) if local else None
        folder = stack.enter_context(_progress.watching(progress, ctx.read_files(), local=local,
                                                        budget=ctx.options.max_tokens))
        ctx = dataclasses.replace(ctx, progress=folder)
        if workers is not None:
            with _trace.span("job"):
                _local.run(ctx, workers, launch.plan)
        else:
            _run_beam(ctx, launch.pipe_opts, launch.plan)
        if launch.template and not local:  # DataflowRunner wrote the job graph there and submitted nothing
            return TemplateLaunched(launch.template, ctx.options.to_dict())
        return _read_back(ctx)


@contextlib.contextmanager
def _owned(launch: Launch) -> Iterator[Optional[_output.Claim]]:
    """The output folder, owned for the run (:mod:`pipeline._output`; a template launch writes nothing there).

    The lock, its journal, the guard card and the clearing happen whole (a signal waits). Released once
    the block ends; if anything stops the run, the folder is made to explain itself first (:func:`stopped`).
    """
    ctx, claim = launch.ctx, None
    try:
        signals.at("launch")
        if not launch.template:
            with signals.deferred():
                claim = _output.claim(ctx.output, launch.avoid, ctx.options.overwrite, ctx.run_id,
                                      ctx.planned_files())
            signals.set_last_words(f"interrupted again while stopping; {show_path(ctx.output)} holds a partial "
                                   "output and the run's lock: run again with --overwrite")
            signals.at("launch")
        yield claim
    except BaseException as e:
        signum = signals.received()
        if claim is None:
            if signum is not None:
                raise signals.Interrupted(signum, f"interrupted by {signals.name(signum)} before anything was "
                                                  f"written to {show_path(ctx.output)}") from None
            raise
        state = stopped(ctx, claim, _why(e, signum))
        if signum is not None:
            raise signals.Interrupted(signum, interrupted_message(signum, ctx.output, state)) from None
        raise
    if claim is not None:
        claim.release()


def _why(e: BaseException, signum: Optional[int]) -> Verdict:
    """The failed manifest of a run that ``e`` stopped (``signum``: the signal behind it, if any)."""
    if signum is not None:
        return Verdict.failed(f"interrupted by {signals.name(signum)}", signals.exit_code(signum))
    return Verdict.failed(str(e) if isinstance(e, PackstreamError) else f"the run stopped: {type(e).__name__}: {e}")


def interrupted_message(signum: int, output: str, state: str) -> str:
    """The one line of a run that signal ``signum`` stopped, by what the folder holds (:func:`stopped`'s state)."""
    what = f"interrupted by {signals.name(signum)}"
    out = show_path(output)
    if state == "complete":
        return f"{what} after the output was committed: {out} is complete (packstream verify {out} checks it)"
    if state == "failed":
        return (f"{what}; {out} holds no complete output (its manifest.json says failed, and readers refuse it): "
                "run the same command with --overwrite to pack again")
    return (f"{what}; {out} holds a partial output and the run's lock (it could not be marked failed): "
            "run the same command with --overwrite to clear it and pack again")


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in this process's environment (local workers inherit it) for the block; then restored."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _workers(n: int) -> Iterator["_local.InProcess | _local.Workers"]:
    """The local run's workers, started now (forked before any thread starts here). Reaped when the block ends;
    killed if it ends with an error or a signal (the folder is then made to explain itself)."""
    with _trace.span("launch_pool", workers=n):
        workers = _local.start(n)
    try:
        yield workers
    except BaseException:
        workers.close(kill=True)
        raise
    workers.close()


def _run_beam(ctx: RunContext, pipe_opts, plan: Plan = PACK) -> None:
    """Build the Beam graph and run it to its end on the runner the options name. A runner error that the commit
    explained (the outcome file) is that PackstreamError; a signal cancels a remote job."""
    import apache_beam as beam

    from pipeline._job._graph import build

    try:
        p = beam.Pipeline(options=pipe_opts)
        build(p, ctx, plan)
        with _trace.span("job"):
            result = p.run()
        try:
            with _trace.span("job_wait"):
                result.wait_until_finish()
        except BaseException:
            if signals.received() is not None:
                _cancel(result)
            raise
        finally:
            client = getattr(result, "client", None)  # DaskRunner: close the client (and a local cluster)
            if client is not None:
                client.close()
    except PackstreamError:
        raise
    except Exception:  # a runner error: our typed outcome (if any) says more than its text
        if signals.received() is not None:
            raise
        outcome = _read_outcome(ctx.outcome)
        if outcome:
            raise PackstreamError(outcome["error"]) from None
        raise


def _cancel(result) -> None:
    """A remote job keeps running after its launcher stops: cancel it (best effort)."""
    try:
        result.cancel()
    except Exception:  # noqa: BLE001 - local runners have nothing to cancel; remote ones may refuse
        pass


def _check_launch(options: PackOptions, identity: dict, quiet: bool) -> None:
    """What every worker would find wrong alike is found here, once, as one error: the chat template
    (empty, not compiling, or never ending), an EOS token the vocabulary does not hold as one token.
    A tokenizer without an EOS gets a warning (unless ``quiet``): examples then end without one."""
    from pipeline._render import Renderer
    from pipeline._tokenizer import check_eos, load_tokenizer, vision_token_ids

    Renderer(options)  # raises PackstreamError; the tokenizer is already loaded (cached per process)
    tok = load_tokenizer(options.tokenizer, options.trust_remote_code)
    check_eos(tok, identity["name"])
    if options.vision() is not None:
        vision_token_ids(tok, options.vision(), identity["name"])
    if identity["eos_token"] is None and not quiet:
        print(f"warning: tokenizer {show_path(identity['name'])} has no EOS token, so examples are packed without one "
              "and a model trained on them does not learn where an answer ends; set \"eos_token\" in its "
              "tokenizer_config.json", file=sys.stderr)


def _glob_root(pattern: str) -> str:
    """The folder a glob starts from (the pattern itself when it has no wildcard): an input the output must avoid."""
    parts = pattern.split("/")
    for i, part in enumerate(parts):
        if any(c in part for c in "*?[") and not os.path.exists(pattern):
            return "/".join(parts[:i]) or "."
    return pattern


def _remove_file(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _read_outcome(path: Optional[str]) -> Optional[dict]:
    if not path:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_back(ctx: RunContext) -> Outcome:
    """The run's outcome as the folder records it: its manifest (complete, or failed with its error), else the
    outcome file the commit wrote where it could not write the manifest (a full disk), else a failure that says so.
    Never a success without a complete manifest."""
    try:
        return from_manifest(_write.read_manifest(ctx.output).raw)
    except (OSError, PackstreamError) as e:
        recorded = _read_outcome(ctx.outcome)
        if recorded and recorded.get("error"):
            return from_manifest({**recorded, "status": Status.FAILED.value})
        return Failed(f"the run ended without writing {ctx.output}/{MANIFEST} ({e}); see the messages above")
