"""The job behind ``packstream pack``: thin steps around the stages' pure functions, two runners, the launcher.

Locally the steps run on packstream's own runner (:mod:`~pipeline._job._local`: forked workers, no Beam);
with ``--runner`` they run as the Beam graph below (:mod:`~pipeline._job._graph`), on Dataflow, Dask, Flink
or Spark. The graph and the local runner call the same step objects, so their outputs are byte-identical.

::

    Create(inputs) -> CutTasks -> Spread -> EncodeTasks ------------------------------+
                      (split big     (tasks    read a task, normalize, render,          |
                       files)        over the  tokenize (pipeline._encode), spill the   |
                                     workers)  examples per packing group to disk       |
                                                   |                                     |
                                 Slices: Spilled -> (split, group), Slice(group, file, batch)
                                                   v                                     |
                                    ByGroup -> PackGroups: per group, on every worker:   |
                                               read it back, de-duplicate, split/        |
                                               truncate, bin-pack, assemble rows, park   |
                                               them in a packed spill file               |
                                                   |                                     |
                                 Pieces: Packed -> (split, shard), Piece(group, file, batch)
                                                   v                                     |
                      (every shard) -> ByShard -> WriteShards: per shard, stream its     |
                                                  groups' rows in group order into the   |
                                                  shard file, sha256 as the bytes pass   |
                                                   |                                     |
                                                   v                                     v
                                   Collect (one key) -> Finalize: merge the dead letters,
                                   sum the counts, check they reconcile, then the commit:
                                   the staged shards renamed into place, manifest.json
                                   (complete) and the dataset card; or a failed manifest
                                   and a card that points at no data

Only small values cross a shuffle or a process (tasks, slices, shard descriptions, counts, file names), so
memory does not grow with the input on any runner; tokens move through spill files
(:mod:`pipeline._spill`). Every step has one output, of small typed values
(:mod:`~pipeline._job._outputs`): runners such as Dask support nothing more. Nothing a worker
finds wrong with the user's data or folder raises: a corrupt input is a dead letter naming the
file, a failed write or a user error a :class:`~pipeline._job._outputs.Failure` that the manifest
records, and the launcher turns a failed manifest into one ``error:`` line.

The modules, one job each::

    _context   RunContext: what the launcher decided (options, inputs, tokenizer, Layout); every step gets it
    _outputs   the typed values the steps emit
    _steps     the steps (Beam's shape: setup, process, teardown; no runner in them)
    _local     the local runner: the steps in this process or dealt to forked workers, then the commit
    _graph     the steps as a Beam graph (a DoFn each), for the runners --runner names
    _commit    finalize(): counts (_counts), status, manifest, commit; stopped() for a run that did not finish
    _runner    Beam's options and the runner, through Beam's public API
    _outcome   how a run ended, as a type: Committed, Failed, TemplateLaunched, Interrupted
    _launch    launch() -> Outcome, and run() -> manifest: prepare, then one ExitStack of the run's resources (the folder's claim, the spill,
               the warm workers, progress) around the job
"""

from pipeline._job._launch import launch, run
from pipeline._job._outcome import Committed, Failed, Interrupted, Outcome, TemplateLaunched, TooManyRejected
from pipeline._job._runner import DASK_RUNNER, beam_flags, pipeline_options, runner_args, unknown_beam_args

__all__ = ["DASK_RUNNER", "Committed", "Failed", "Interrupted", "Outcome", "TemplateLaunched", "TooManyRejected",
           "beam_flags", "launch", "pipeline_options", "run", "runner_args", "unknown_beam_args"]
