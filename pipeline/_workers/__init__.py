"""The processes of a run: the launcher's signals, how many local workers, and Dask's layout.

::

    launcher (packstream pack)                         local worker processes (--workers N,
      signals   SIGINT/SIGTERM/SIGHUP -> one line,     pipeline._job._local: forked warm)
                exit 128 + N; stops the workers;         ignore the terminal's signals, die with
                the test hook that sends them            the launcher (signals.worker_setup)
      parallel  how many workers, how many tokenizer
                threads each (the cores shared out)
      on_dask   DaskRunner: the read tasks spread over every Dask worker

Each module has one job; none of them imports Beam at module level.
"""
