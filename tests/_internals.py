"""The one place the tests reach packstream's private modules and names (``pipeline._*``, ``packers._*``).

Tests import the public names from ``pipeline`` and ``packers``; what they need beyond these they import from
here, at module level or inside a test: ``from tests._internals import Encoder, _render``. Moving or renaming
an internal then edits this file, not dozens of tests (tests/test_layers.py holds the suite to it).

Modules come back as the module objects themselves, so ``monkeypatch.setattr(_render, "TEMPLATE_SECONDS", 0.5)``
patches the real module. Plain re-exports, except that the Beam job (``pipeline._job``) and the torch-backed
attention package (``packers._attention``) load on first use (``__getattr__`` below): importing this module
imports neither apache_beam nor torch.
"""

from __future__ import annotations

import importlib

# Reading: inputs -> records.
from pipeline import _read
from pipeline._read import PackedExample, _inputs, _sample, _tasks, expand_inputs, packed_examples, read_file, sample

# Options beyond the public PackOptions (pipeline.PackOptions, Format, TrainOn, ...).
from pipeline._options import MAX_REPEAT, FormatOptions, TreePaths, load_config

# Formats: records -> conversations (pairs, trees), typed rejections and the fixes they suggest.
import pipeline._formats as _formats
from pipeline._formats import (
    NOTE_KEYS, ORDER, REGISTRY, Conversation, Fix, Hole, Reason, Rejected, _fast, _normalize, conversations, detect,
    normalize, pair_conversations, parse_path, resolve, suggest, tree,
)
from pipeline._formats._driver import looks_like_tool_calls, read_as
from pipeline._formats._fix import KEY, ROLE
from pipeline._formats.detect import KNOWN_KEYS, by_name, shape_table
from pipeline._formats.preference import layout as preference_layout, preference_turns

# Rendering and tokenizers: conversations -> tokens and loss masks.
from pipeline import _render, _tokenizer
from pipeline._render import BUILTIN_CHATML, Renderer, merge_runs
from pipeline._tokenizer import PlainTokenizer, default_tokenizer_path, load_tokenizer, tokenizer_identity
from pipeline._report import split_remedy, with_whole_remedy

# Encoding and rows: records -> encoded examples -> packed rows; images (--processor) resolved and embedded.
from pipeline import _media, _rows
from packers._video import frame_indices, qwen3_frame_indices
from pipeline._encode import Encoder, input_folders
from pipeline._rows import ExampleBatch, dedupe, example_id, pack_group

# Writing, spilling, the output folder, tracing and progress; Arrow arrays without pa.array (pipeline._arrow).
from pipeline import _arrow, _fs, _output, _progress, _sink, _spill, _trace, _write
from pipeline._progress import LogFormat, Progress

# Tools: verify, inspect, estimate, preview.
import pipeline._tools.verify as _verify
from pipeline._tools.verify import _folder as _verify_folder, options_from_config, verify
from pipeline._tools.inspect import PERCENTILES, PLOTS, PLOTS_MARK, REPORT_KEYS, SCHEMA_VERSION, inspect
from pipeline._tools.estimate import estimate, human_bytes
from pipeline._tools.preview import format_preview, inputs, preview

# Workers: signals, how many local worker processes.
from pipeline._workers import parallel, signals

# Packers internals that need no torch: the per-item packing loop, pairs, epoch schedules.
from packers._pack import _pack_per_item
from packers._pairs import truncate_pairs
from packers._schedule import Rows, Schedule, ranks, schedule_epoch, step_denominators
from packers._vision import VisionFamily, smart_resize
from packers._gemma import token_type_ids as gemma_token_type_ids
from packers import _trainer_settings  # every DPOConfig/KTOConfig field and what the packed trainers do with it

# Loaded on first use: name -> (module, attribute; None for the module itself).
_LAZY = {
    # The job (imports apache_beam): its steps' typed outputs, the commit, the runner's flags, the launcher.
    "_job": ("pipeline._job", None),
    "_local": ("pipeline._job._local", None),
    "_graph": ("pipeline._job._graph", None),  # imports apache_beam itself
    # The job's plan (pipeline._job._plan): what both runners walk.
    "_plan": ("pipeline._job._plan", None),
    **{name: ("pipeline._job._plan", name) for name in (
        "PACK", "Plan", "Source", "Stage", "StageLabels", "task_weight")},
    "pipeline_options": ("pipeline._job", "pipeline_options"),
    "Reports": ("pipeline._job._commit", "Reports"),
    "Verdict": ("pipeline._job._commit", "Verdict"),
    "finalize": ("pipeline._job._commit", "finalize"),
    **{name: ("pipeline._job._steps", name) for name in ("EncodeTasks", "PackGroups", "WriteShards")},
    "Inputs": ("pipeline._job._context", "Inputs"),
    "decide": ("pipeline._job._context", "decide"),
    "interrupted_message": ("pipeline._job._launch", "interrupted_message"),
    **{name: ("pipeline._job._outputs", name) for name in (
        "Failure", "Flags", "Packed", "Rejects", "Spilled", "Stats", "Written", "cannot_write")},
    **{name: ("pipeline._job._runner", name) for name in (
        "DASK_RUNNER", "beam_flags", "runner_args", "unknown_beam_args")},
    # Packers internals that import torch: the attention backend, the guard and its probe.
    "cached_verdict": ("packers._attention", "cached_verdict"),
    "GUARD": ("packers._attention._guard", "GUARD"),
    "VARLEN": ("packers._attention._varlen", "VARLEN"),
    "probe_layout": ("packers._attention._probe", "layout"),
    "dropout_settings": ("packers._attention._model", "dropout_settings"),
    "attention_probe": ("packers._attention._probe", None),
    "num_sequences": ("packers._attention._rules", "num_sequences"),
    "later_images": ("packers._attention._blocks", "_later_images"),  # Gemma 3: a soft token past a row's first example
    **{name: ("packers._attention._probe", name) for name in ("batch_rope", "run_probe", "special_lengths")},
    # The per-sequence float64 completion sums that packers.sequence_logps returns per example (tests/test_dpo.py).
    "sequence_sums": ("packers._logps", "_sequence_sums"),
    **{name: ("packers._preference_trainer", name) for name in ("LOADER_STATE", "REF_LOGPS")},
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = importlib.import_module(module)
    return value if attribute is None else getattr(value, attribute)
