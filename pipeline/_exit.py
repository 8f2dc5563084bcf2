"""The exit codes of the ``packstream`` command, declared once (the job records them in a failed manifest)."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """How a command ended. A signal N ends a command with 128 + N (:func:`pipeline._workers.signals.exit_code`)."""

    OK = 0
    VERIFY_FAILED = 1
    """``packstream verify`` found at least one mismatch."""
    USER_ERROR = 2
    """Bad input, bad option or a bad output folder: one ``error: ...`` line, no traceback."""
    REJECTED = 3
    """The job finished but packed nothing, or rejected more than ``--max-reject-fraction`` of the records."""
