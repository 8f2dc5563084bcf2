"""The job behind ``packstream pack``: thin steps around the stages' pure functions, one plan, two runners, the
launcher.

The job's shape is declared once, as data: :data:`pipeline._job._plan.PACK`, a :class:`~pipeline._job._plan.Plan`
of a source (the inputs cut into read tasks), its stages in order (encode, pack, write: each a step class, the
type it carries on and how that is keyed) and a finish (the commit). Locally the plan runs on packstream's own
runner (:mod:`~pipeline._job._local`: forked workers, no Beam); with ``--runner`` it runs as a Beam graph
(:mod:`~pipeline._job._graph`), on Dataflow, Dask, Flink or Spark. Both runners walk the plan and name no
step, and call the same step objects, so their outputs are byte-identical. The plan as Beam builds it (its
labels are the plan's)::

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
    _plan      Plan, Source, Stage: the job's shape as data; PACK, the pack's plan (a second command declares its own)
    _local     the local runner: any plan's stages in this process or dealt to forked workers, then its finish
    _graph     any plan as a Beam graph (a DoFn a stage, a GroupByKey between), for the runners --runner names
    _commit    finalize(): counts (_counts), status, manifest, commit; stopped() for a run that did not finish
    _runner    Beam's options and the runner, through Beam's public API
    _outcome   how a run ended, as a type: Committed, Failed, TemplateLaunched, Interrupted
    _launch    launch() -> Outcome, and run() -> manifest: prepare, then one ExitStack of the run's resources (the folder's claim, the spill,
               the warm workers, progress) around the job
"""

from pipeline._job._launch import launch, run
from pipeline._job._repack import ROW_OPTIONS, RepackOptions
from pipeline._job._outcome import Committed, Failed, Interrupted, Outcome, TemplateLaunched, TooManyRejected
from pipeline._job._runner import DASK_RUNNER, beam_flags, pipeline_options, runner_args, unknown_beam_args

__all__ = ["ROW_OPTIONS", "RepackOptions", "DASK_RUNNER", "Committed", "Failed", "Interrupted", "Outcome", "TemplateLaunched", "TooManyRejected",
           "beam_flags", "launch", "pipeline_options", "run", "runner_args", "unknown_beam_args"]
