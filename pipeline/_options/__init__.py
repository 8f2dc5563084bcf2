"""Every option of the packing job, declared once.

:class:`FormatOptions` says how the records of one data set become conversations;
:class:`PackOptions` (a ``FormatOptions`` plus the job's own options) is what ``packstream
pack`` runs. Each field carries its CLI flag and help text (:func:`cli`); ``pipeline.cli``
generates the click options of ``pack``, ``estimate``, ``preview`` and ``verify`` from them,
and the Beam job and the pure functions below it receive the frozen object, never loose keyword
arguments. ``--config mix.yaml`` gives several :class:`DatasetSpec` s, each with its own
``FormatOptions``; the flags are then their defaults.

* ``_modes``   the enums of the modes, the field-path grammar, ``--pair-winner`` tests
* ``_fields``  a field's command-line metadata, ``NAME=VALUE`` pairs, enum values, the recorded JSON form
* ``_format``  :class:`FormatOptions`
* ``_pack``    :class:`DatasetSpec`, :class:`PackOptions`
* ``_config``  ``--config``: bounded YAML, the type checks, the data sets
"""

from pipeline._options._config import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, MAX_CONFIG_EXPANDED, check_type, load_config, load_yaml
from pipeline._options._fields import cli
from pipeline._options._format import LATER_DEFAULTS, FormatOptions
from pipeline._options._modes import (
    DEFAULT_TOKENIZER, ROLES, WINNER_OPS, Eos, Format, ImageStorage, LeadingAssistant, OutputFormat, PackMode, PairBest, Preference,
    SameRole, Strings, TextSplit, Ids, TrainOn, Turns, TreePaths, TruncateSide, parse_path, winner_test,
)
from pipeline._options._pack import MAX_REPEAT, MAX_SEED, DatasetSpec, PackOptions, options_from_config

__all__ = [
    "MAX_CONFIG_BYTES", "MAX_CONFIG_DEPTH", "MAX_CONFIG_EXPANDED", "check_type", "load_config", "load_yaml", "cli",
    "FormatOptions", "LATER_DEFAULTS", "DEFAULT_TOKENIZER", "ROLES", "WINNER_OPS", "Eos", "Format", "ImageStorage", "LeadingAssistant", "OutputFormat",
    "PackMode", "PairBest", "Preference", "SameRole", "Strings", "TextSplit", "Turns", "Ids", "TrainOn", "TreePaths", "TruncateSide", "parse_path",
    "winner_test", "MAX_REPEAT", "MAX_SEED", "DatasetSpec", "PackOptions", "options_from_config",
]
