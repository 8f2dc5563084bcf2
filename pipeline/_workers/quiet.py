"""Log records that say nothing to a packstream user, dropped: one filter for the launcher (``pipeline.cli``) and
for the worker processes of a local Dask cluster (preloaded there as a Dask worker preload, :func:`dask_setup`),
which import Beam again and would print its import-time warnings once per worker."""

from __future__ import annotations

import logging

NOISE = ("apitools not found", "direct_num_workers is not equal to 1")
"""Beam's warning that its optional GCP clients are absent, and its warning about the local worker processes
packstream starts itself (pipeline._workers, with Beam's in-memory mode's option name)."""

LOGGERS = ("", "apache_beam.runners.portability.fn_api_runner.fn_runner")


class DropNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in NOISE)


_FILTER = DropNoise()


def install() -> None:
    """Add the filter to the loggers that say :data:`NOISE` (once each)."""
    for name in LOGGERS:
        if _FILTER not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_FILTER)


def dask_setup(worker=None) -> None:  # noqa: ARG001 - Dask's preload hook, called with the worker
    """Dask's preload hook (``distributed.worker.preload``): the filter in a local cluster's worker process."""
    install()
