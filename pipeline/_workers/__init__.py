"""The processes of a run: the launcher's signals, and the local worker processes it starts.

::

    launcher (packstream pack)                         local worker processes (--workers N)
      signals   SIGINT/SIGTERM/SIGHUP -> one line,       worker    Beam's SDK worker, quiet; ignores the
                exit 128 + N; stops the workers;                   terminal's signals, dies with the launcher
                the test hook that sends them
      parallel  how many workers, how many tokenizer
                threads each (the cores shared out)
      pool      N workers forked warm, before any    --> handoff   FnApiRunner's worker command: hands its
                thread starts                                      environment to an idle forked worker (or
                                                                   becomes a cold worker)
      on_dask   DaskRunner: the read tasks spread over every Dask worker

Each module has one job; none of them imports Beam at module level.
"""
