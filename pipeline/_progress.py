"""Progress of a local run: records read, tokenized and packed, with the rate and an ETA.

The local runner runs the job's steps in this process (``--workers 1``) or in worker processes
it forks (``--workers N``), and the counts must reach the launcher while the job runs, from
whichever process made them. Progress therefore travels through small files::

    launcher (this process)                      each process that runs steps
    -----------------------------------------    ---------------------------------------------
    Progress.watch(files) -> folder:             Counter(ns, name, folder).inc(n):
      mkdtemp(); the folder goes to every          (a Beam counter += n, on Beam), record(folder,
      step in the run's context                    name, n): counts[name] += n, and at most
      thread, every --log-interval:                every 0.25 s write <folder>/<pid>.json
        read_counts(): sum <dir>/*.json  <------   (temp name, os.replace)
        render a line or a JSON event
      on exit: remove the folder

The folder is a fresh temporary folder outside the output; the steps get its name with the rest
of the run's context (:class:`pipeline._job._context.RunContext`), which every worker gets. A remote run (Dataflow, Flink, Spark) is not watched: its steps get no folder and record
nothing. Progress never touches the output folder, so it cannot change the output's bytes; a
progress file that cannot be written or read is skipped, never an error.

The percentage and the ETA follow the stage that limits the run. First *tokenizing*: records
encoded (read, normalized, rendered and tokenized) out of the input's records, counted in a
background thread (:func:`pipeline._read.count_records`); reading runs ahead of it and is shown
but never drives the ETA. Then *packing and writing*: rows written out of the rows the
tokenized tokens need (their lower bound). Then *finishing* (dead letters, the manifest). Rates
are moving averages over the last :data:`RATE_WINDOW_S` seconds, so a pause shows as a falling
rate, not as zero.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import IO, Any, Iterator, Optional, Sequence

FLUSH_S = 0.25
COUNTERS = ("records_read", "records_encoded", "examples_tokenized", "tokens", "rows")
RATE_WINDOW_S = 20.0


class LogFormat(str, enum.Enum):
    """How ``packstream pack`` reports: for people or for batch logs."""

    TEXT = "text"  #: a progress line on a terminal's stderr, then the summary table on stdout
    JSON = "json"  #: JSON lines on stdout: ``progress`` events, then one ``done`` (or ``error``) event


# ---------------------------------------------------------------------------------------
# Worker side: called for every counter increment, so the fast path is one dict lookup.

_lock = threading.Lock()
_state: dict[str, Any] = {"dir": None, "counts": {}, "flushed": 0.0}


def record(folder: Optional[str], name: str, n: int = 1) -> None:
    """Add ``n`` to counter ``name`` of this process, for the launcher watching ``folder`` (None: none is)."""
    if not folder:
        return
    with _lock:
        if _state["dir"] != folder:  # a new run in a long-lived process (tests, notebooks)
            _state.update(dir=folder, counts={}, flushed=0.0)
        counts = _state["counts"]
        counts[name] = counts.get(name, 0) + n
        now = time.monotonic()
        if now - _state["flushed"] < FLUSH_S:
            return
        _state["flushed"] = now
        body = json.dumps(counts)
    _write(folder, body)


def flush(folder: Optional[str]) -> None:
    """Write this process's counts into ``folder`` now (a step calls it when a task ends: increments that came
    within FLUSH_S of the last write would otherwise wait for the next one, which may never come)."""
    if not folder:
        return
    with _lock:
        if _state["dir"] != folder:
            return
        _state["flushed"] = time.monotonic()
        body = json.dumps(_state["counts"])
    _write(folder, body)


class Counter:
    """A step's counter: it feeds :func:`record` (``folder``: the watching launcher's, or None) and, where the step
    runs under Beam (Dataflow, Dask, ...: Beam is imported in this process), a Beam metrics counter too, which the
    runner's own UI shows. The local runner never imports Beam for it."""

    def __init__(self, namespace: str, name: str, folder: Optional[str]):
        self.name, self.folder = name, folder
        self.metric = None
        if "apache_beam" in sys.modules:
            from apache_beam.metrics import Metrics

            self.metric = Metrics.counter(namespace, name)

    def inc(self, n: int = 1) -> None:
        if self.metric is not None:
            self.metric.inc(n)
        record(self.folder, self.name, n)


def _write(folder: str, body: str) -> None:
    path = os.path.join(folder, f"{os.getpid()}.json")  # one file per process: counts are per process
    tmp = path + ".tmp"
    try:
        with open(tmp, "w") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError:
        pass  # progress is best effort: the launcher may already have removed the folder


def read_counts(folder: str) -> dict[str, int]:
    """The sum of every process's counters in ``folder``."""
    total = {k: 0 for k in COUNTERS}
    try:
        names = os.listdir(folder)
    except OSError:
        return total
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                counts = json.load(f)
        except (OSError, ValueError):
            continue  # replaced or removed while we read it: the next poll sees it
        for k, v in counts.items():
            total[k] = total.get(k, 0) + int(v)
    return total


# ---------------------------------------------------------------------------------------
# Launcher side.


def _clock(seconds: Optional[float]) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _short(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


class Progress:
    """Renders the progress of a local run (see the module docstring).

    ``fmt`` TEXT draws one line on ``stream`` (rewritten with ``\\r``; meant for a terminal);
    JSON writes one ``{"event": "progress", ...}`` line per ``interval``. :meth:`done` and
    :meth:`error` write the final event in JSON mode.
    """

    def __init__(self, fmt: LogFormat, stream: IO[str], interval: float, budget: int = 0):
        check_interval(interval)
        self.fmt, self.stream, self.interval = LogFormat(fmt), stream, interval
        self.started = time.monotonic()
        self.total: Optional[int] = None
        self.budget = budget
        self.events: list[dict] = []  # what was reported, for tests and callers
        self._history: list[tuple[float, dict[str, int]]] = []  # (time, counts) for the moving rates
        self._width = 0

    # -- the job side -----------------------------------------------------------------

    @contextlib.contextmanager
    def watch(self, files: Sequence[Any]) -> Iterator[str]:
        """Set up the progress folder (yielded: the steps count into it), report until the block ends, then
        clean up."""
        folder = tempfile.mkdtemp(prefix="packstream-progress-")
        stop = threading.Event()
        threading.Thread(target=self._count_total, args=(files,), daemon=True, name="packstream-total").start()
        reporter = threading.Thread(target=self._loop, args=(folder, stop), daemon=True, name="packstream-progress")
        self.started = time.monotonic()
        reporter.start()
        try:
            yield folder
            stop.set()
            reporter.join(timeout=5)
            if self.fmt is LogFormat.JSON:  # the last progress event holds the final counts
                self.report(read_counts(folder))
        finally:
            stop.set()
            reporter.join(timeout=5)
            self._clear()
            shutil.rmtree(folder, ignore_errors=True)

    def _count_total(self, files: Sequence[Any]) -> None:
        from pipeline._read import count_records

        try:
            self.total = sum(count_records(f) for f in files)
        except Exception:  # noqa: BLE001 - the total only feeds the ETA; without it we show counts
            self.total = None

    def _loop(self, folder: str, stop: threading.Event) -> None:
        while not stop.wait(self.interval):
            try:
                self.report(read_counts(folder))
            except (OSError, ValueError):  # a closed stream: stop drawing, never fail the job
                return

    # -- rendering --------------------------------------------------------------------

    def _rate(self, now: float, counts: dict[str, int], key: str) -> float:
        """Units of ``key`` per second over the last RATE_WINDOW_S seconds (since the start before that)."""
        t0, c0 = self._history[0]
        if now - t0 <= 1e-6:
            return 0.0
        return (counts.get(key, 0) - c0.get(key, 0)) / (now - t0)

    def snapshot(self, counts: dict[str, int]) -> dict[str, Any]:
        """One progress event: the running stage, counts, its moving rate, percentage and ETA."""
        now = time.monotonic()
        elapsed = now - self.started
        self._history.append((now, dict(counts)))
        self._history = [h for h in self._history if now - h[0] <= RATE_WINDOW_S] or self._history[-1:]
        read, encoded = counts.get("records_read", 0), counts.get("records_encoded", 0)
        rows, tokens = counts.get("rows", 0), counts.get("tokens", 0)
        total = self.total
        done_encoding = total is not None and encoded >= total
        stage, pct, eta = "tokenizing", None, None
        rate = self._rate(now, counts, "records_encoded")
        if done_encoding or (rows and encoded >= read):
            need = math.ceil(tokens / self.budget) if self.budget and tokens else 0
            stage = "packing and writing" if rows < need or not rows or not need else "finishing"
            rate = self._rate(now, counts, "rows")
            if need:
                pct = min(100.0, 100.0 * rows / need)
                eta = (need - rows) / rate if rate > 0 and rows < need else (0.0 if rows >= need else None)
        elif total:
            pct = min(100.0, 100.0 * encoded / total)
            eta = (total - encoded) / rate if rate > 0 else None
        return {
            "event": "progress",
            "stage": stage,
            "elapsed_s": round(elapsed, 1),
            "records_read": read,
            "records_encoded": encoded,
            "records_total": total,
            "examples_tokenized": counts.get("examples_tokenized", 0),
            "tokens": tokens,
            "rows": rows,
            "percent": None if pct is None else round(pct, 1),
            "rate_per_s": round(rate, 1),
            "rate_unit": "rows" if stage != "tokenizing" else "records",
            "eta_s": None if eta is None else round(eta, 1),
        }

    def line(self, e: dict[str, Any]) -> str:
        total = f"/{e['records_total']:,}" if e["records_total"] else ""
        pct = f" {e['percent']:.0f}%" if e["percent"] is not None else ""
        eta = f"ETA {_clock(e['eta_s'])}" if e["eta_s"] is not None else "ETA --:--"
        unit = "rec/s" if e["rate_unit"] == "records" else "rows/s"
        return (
            f"{e['stage']}{pct} | tokenized {e['records_encoded']:,}{total} (read {e['records_read']:,}) | "
            f"{_short(e['tokens'])} tokens | rows {e['rows']:,} | {e['rate_per_s']:,.0f} {unit} | {eta} | "
            f"{_clock(e['elapsed_s'])}"
        )

    def report(self, counts: dict[str, int]) -> dict[str, Any]:
        e = self.snapshot(counts)
        self.events.append(e)
        if self.fmt is LogFormat.JSON:
            self._json(e)
        else:
            text = self.line(e)
            pad = max(0, self._width - len(text))
            self._width = len(text)
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
        return e

    def _clear(self) -> None:
        if self.fmt is LogFormat.TEXT and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0

    def _json(self, event: dict[str, Any]) -> None:
        self.stream.write(json.dumps(event, sort_keys=True) + "\n")
        self.stream.flush()

    def done(self, manifest: dict[str, Any]) -> None:
        """The final event (JSON mode): the manifest's counts and where the output is."""
        if self.fmt is not LogFormat.JSON:
            return
        event = {
            "event": "done",
            "elapsed_s": manifest.get("elapsed_s", round(time.monotonic() - self.started, 3)),
            "output": manifest.get("config", {}).get("output"),
            "shards": len(manifest.get("shards", [])),
            "counts": manifest.get("counts", {}),
            "run": manifest.get("run"),  # a local run's workers, tokenizer threads and why; null on a cluster
        }
        self.events.append(event)
        self._json(event)

    def error(self, message: str, exit_code: int) -> None:
        if self.fmt is not LogFormat.JSON:
            return
        event = {"event": "error", "message": message, "exit_code": exit_code,
                 "elapsed_s": round(time.monotonic() - self.started, 1)}
        self.events.append(event)
        self._json(event)


def watching(progress: Optional[Progress], files: Sequence[Any], *, local: bool, budget: int = 0
             ) -> contextlib.AbstractContextManager[Optional[str]]:
    """``progress.watch(files)`` for a local run (it yields the progress folder); None for no progress, or for a
    remote runner."""
    if progress is None or not local:
        return contextlib.nullcontext(None)
    progress.budget = budget or progress.budget
    return progress.watch(files)


MAX_INTERVAL_S = 86_400.0
"""The longest --log-interval: a day (a timer beyond what the platform can wait overflows)."""


def check_interval(interval: float) -> None:
    """A PackstreamError unless ``interval`` is a finite number of seconds in (0, MAX_INTERVAL_S]."""
    if not (isinstance(interval, (int, float)) and math.isfinite(interval) and 0 < interval <= MAX_INTERVAL_S):
        from packers import PackstreamError

        raise PackstreamError(f"--log-interval {interval} must be a number of seconds > 0 and <= {MAX_INTERVAL_S:,.0f} "
                              "(e.g. 0.5 on a terminal, 10 for batch logs)")


def default_interval(fmt: LogFormat) -> float:
    """Redraw a terminal line twice a second; write a JSON line every 10 s."""
    return 0.5 if LogFormat(fmt) is LogFormat.TEXT else 10.0


def for_cli(fmt: LogFormat, quiet: bool, progress: Optional[bool], interval: Optional[float]) -> Optional[Progress]:
    """The reporter ``packstream pack`` uses, or None for no progress.

    ``--quiet`` shows nothing (errors still go to stderr). TEXT shows the line when
    ``progress`` is True, or when it is None (auto) and stderr is a terminal. JSON reports to
    stdout, whatever ``progress`` says.
    """
    fmt = LogFormat(fmt)
    interval = default_interval(fmt) if interval is None else interval
    check_interval(interval)  # a mistake even where no progress is shown (--quiet)
    if quiet:
        return None
    if fmt is LogFormat.JSON:
        return Progress(fmt, sys.stdout, interval)
    if progress is False:
        return None
    if progress is None and not sys.stderr.isatty():
        return None
    return Progress(fmt, sys.stderr, interval)
