"""Entry point of local worker processes (``packstream pack --workers N``): Beam's SDK worker, quiet.

FnApiRunner starts each worker as ``python -m pipeline._worker`` (a cold worker, through ``sh -c``, see
:func:`pipeline._signals.worker_command`), or hands it to a warm one forked from the launcher
(:mod:`pipeline._pool`), which calls :func:`main` too; either way the log level is set before Beam
logs a line, and signals are settled first: a terminal's Ctrl-C or hang-up reaches the whole process
group, and a worker must neither print a KeyboardInterrupt traceback nor die on its own. The launcher
handles the signal and stops its workers (:mod:`pipeline._signals`); a launcher killed outright
takes them with it.
"""

import logging
import sys

from pipeline import _signals

# Beam's worker logs its start-up (INFO, and warnings about options packstream does not use): noise to a
# packstream user. Errors still surface: a failing step fails the job, and the launcher reports it.
logging.disable(logging.WARNING)


def main(argv) -> None:
    from apache_beam.runners.worker import sdk_worker_main

    logging.disable(logging.WARNING)
    sdk_worker_main.main(argv)


if __name__ == "__main__":
    _signals.worker_setup()
    main(sys.argv)
