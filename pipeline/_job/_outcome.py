"""How a run ended, as a type: the launcher returns one of four outcomes, and the CLI dispatches on which.

::

    Committed          the commit was made: a complete manifest.json (the manifest, as written)
    Failed             the run stopped with its reason and exit code (a user error, a worker's failure, a
                       write that failed, too many records rejected); the failed manifest when one was written
    TemplateLaunched   a Flex Template launch: the job graph went to ``--template_location``, nothing ran
    Interrupted        a signal stopped the run; the exit code is 128 + the signal

Each outcome is made where the launcher knows it (the manifest it read back, the error it caught, the runner it
asked for a template), never inferred from which keys a dict happens to hold: a run whose manifest could not be
written is a :class:`Failed` with the reason the commit recorded, not a success.

>>> Failed("cannot write to --output (OSError: No space left on device)").exit_code
<ExitCode.USER_ERROR: 2>
>>> Committed({"status": "complete", "counts": {}}).exit_code
<ExitCode.OK: 0>
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional, Union

from packers import PackstreamError
from packers.manifest import Status
from pipeline._exit import ExitCode
from pipeline._workers import signals


class TooManyRejected(PackstreamError):
    """The run packed nothing, or rejected more than ``--max-reject-fraction`` (the CLI exits with 3)."""

    def __init__(self, message: str, manifest: Optional[dict] = None):
        super().__init__(message)
        self.manifest = manifest


@dataclasses.dataclass(frozen=True)
class Committed:
    """The run committed: ``manifest`` is complete."""

    manifest: dict
    exit_code: ClassVar[ExitCode] = ExitCode.OK

    def result(self) -> dict:
        return self.manifest


@dataclasses.dataclass(frozen=True)
class Failed:
    """The run failed: ``error`` is its one line, ``exit_code`` the command's exit status."""

    error: str
    exit_code: int = ExitCode.USER_ERROR
    manifest: Optional[dict] = None
    """The failed manifest the run wrote (None when it could not write one, or failed before the folder)."""

    def result(self) -> dict:
        if self.exit_code == ExitCode.REJECTED:
            raise TooManyRejected(self.error, self.manifest)
        raise PackstreamError(self.error)


@dataclasses.dataclass(frozen=True)
class TemplateLaunched:
    """A Flex Template launch: Dataflow runs the job graph at ``location`` later (and writes the manifest)."""

    location: str
    config: dict
    exit_code: ClassVar[ExitCode] = ExitCode.OK

    def result(self) -> dict:
        return {"config": self.config, "template_location": self.location}


@dataclasses.dataclass(frozen=True)
class Interrupted:
    """A signal stopped the run; ``message`` says what the folder holds."""

    signum: int
    message: str

    @property
    def exit_code(self) -> int:
        return signals.exit_code(self.signum)

    def result(self) -> dict:
        raise signals.Interrupted(self.signum, self.message)


Outcome = Union[Committed, Failed, TemplateLaunched, Interrupted]


def from_manifest(manifest: dict) -> Union[Committed, Failed]:
    """The outcome a manifest read back from the folder records: complete, or failed with its error and code.
    A manifest that says neither (no status) is a failure too: only a complete one is a success."""
    if manifest.get("status") == Status.COMPLETE.value and "counts" in manifest:
        return Committed(manifest)
    error = manifest.get("error") or f"the run ended with status {manifest.get('status')!r} and no error recorded"
    code = manifest.get("exit_code")
    return Failed(str(error), int(code) if isinstance(code, int) and code else ExitCode.USER_ERROR,
                  manifest if "counts" in manifest else None)
