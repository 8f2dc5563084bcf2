"""Entry point of local worker processes (``packstream pack --workers N``): Beam's SDK worker, quiet.

FnApiRunner starts each worker as ``python -m pipeline._worker``, so the log level is set before
Beam logs a line.
"""

import logging
import sys

# Beam's worker logs its start-up (INFO, and warnings about options packstream does not use): noise to a
# packstream user. Errors still surface: a failing step fails the job, and the launcher reports it.
logging.disable(logging.WARNING)

from apache_beam.runners.worker import sdk_worker_main  # noqa: E402

if __name__ == "__main__":
    import time

    from pipeline import _trace

    _trace.mark("worker_start", process_cpu=time.process_time())
    sdk_worker_main.main(sys.argv)
