"""Entry point of a local worker process (``packstream pack --workers N``): Beam's SDK worker, quiet.

FnApiRunner starts each worker as ``python -m pipeline._workers.worker LAUNCHER_PID`` (a cold
worker, through ``sh -c``, see :func:`pipeline._workers.signals.worker_command`), or hands it to a
warm one forked from the launcher (:mod:`pipeline._workers.pool`), which calls :func:`main` too;
either way the log level is set before Beam logs a line, and signals are settled first: a
terminal's Ctrl-C or hang-up reaches the whole process group, and a worker must neither print a
KeyboardInterrupt traceback nor die on its own. The launcher handles the signal and stops its
workers (:mod:`pipeline._workers.signals`); a launcher killed outright takes them with it.
"""

import logging
import sys


def main() -> None:
    """Run Beam's SDK worker (its addresses are in the environment FnApiRunner gives the process)."""
    # Beam's worker logs its start-up (INFO, and warnings about options packstream does not use): noise to a
    # packstream user. Errors still surface: a failing step fails the job, and the launcher reports it.
    logging.disable(logging.WARNING)
    from apache_beam.runners.worker import sdk_worker_main

    sdk_worker_main.main([])


if __name__ == "__main__":
    logging.disable(logging.WARNING)
    from pipeline._workers import signals

    signals.worker_setup(int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else None)
    main()
