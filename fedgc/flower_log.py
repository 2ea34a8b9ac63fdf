"""Flower's log during a fedgc run: quiet by default, all of it with ``--verbose``.

Quiet means: Flower's console handler shows warnings and errors only, without ANSI colour codes
(they end up in captured logs and CI output), and without the lines fedgc causes on purpose
(:data:`NOISE`); Ray's ClientApp actors log Flower's errors only (``FLWR_LOG_LEVEL``, which
Flower reads when an actor imports it) and Ray prints their lines without colour
(``RAY_COLOR_PREFIX=0``). Only Flower's own logger is configured: fedgc's logger, Python's
warnings and Ray's log level are left alone.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

#: Starts of Flower log lines that every fedgc run would print and no user can act on.
NOISE = (
    # DGCStrategy evaluates on the server (task.evaluate); fraction_evaluate = 0 is its default.
    "fraction_evaluate is set to 0.0",
    # Flower's Ray backend stops every ClientApp actor this way at the end of each run.
    "Manually terminating ClientAppActor",
    # Flower's Ray backend before it raises a ClientApp's exception again, which Flower's
    # runtime then logs itself (the exception's text and its traceback): nothing of its own.
    "An exception was raised when processing a message by",
)

#: In Flower's log of an exception (its text, or its traceback's), a Ray actor that died with
#: the process that owned it: the run's own process is stopping (a Ctrl-C reaches Ray's
#: workers with the run's process group, possibly before the run sees it), which the run
#: says in its one line.
OWNER_DIED = "because its owner has died"

#: Environment of the Ray worker processes of a quiet run (they inherit the driver's).
QUIET_WORKER_ENV = {"FLWR_LOG_LEVEL": "ERROR", "RAY_COLOR_PREFIX": "0"}


#: The attribute that marks an exception fedgc has already reported in one line.
REPORTED = "fedgc_reported"


class FlowerNoiseFilter(logging.Filter):
    """Drops the records of :data:`NOISE`, Flower's log of a Ray actor whose owner died
    (:data:`OWNER_DIED`), and Flower's traceback of an exception fedgc has already reported in
    one line (:func:`report_once`); passes every other record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and getattr(record.exc_info[1], REPORTED, False):
            return False
        text = record.getMessage()
        return not text.startswith(NOISE) and OWNER_DIED not in text


class ThreadsFilter(logging.Filter):
    """Drops the records of some threads: those of a Flower simulation runtime stopped by
    Ctrl-C (:func:`mute_threads`); passes every other record.

    A thread is known by its id and its name together: an id alone may be reused by a thread
    started after the muted one ended.
    """

    def __init__(self, threads: Iterable[threading.Thread]) -> None:
        super().__init__()
        self.threads = list(threads)
        self._keys = {(t.ident, t.name) for t in self.threads}

    def filter(self, record: logging.LogRecord) -> bool:
        return (record.thread, record.threadName) not in self._keys

    def release(self) -> bool:
        """Remove this filter from Flower's logger if every muted thread has ended; return
        whether it was removed. One still running (a worker blocked on a dead actor) stays
        muted, without waiting for it: whatever it logs later is the interrupted run's too."""
        if any(t.is_alive() for t in self.threads):
            return False
        logging.getLogger("flwr").removeFilter(self)
        return True


def mute_threads(threads: Iterable[threading.Thread]) -> ThreadsFilter:
    """Drop Flower's log records from ``threads`` until :meth:`ThreadsFilter.release`.

    For a Ctrl-C on Flower's Ray engine: the runtime's worker threads that wait on a busy
    ClientApp actor get an ``ActorDiedError`` once Ray shuts down, and Flower logs each with a
    traceback; when that comes (before or after the run's one line) depends on the machine's
    speed. It says only that the run was stopped, which the run's one line already says.
    """
    muted = ThreadsFilter(threads)
    logging.getLogger("flwr").addFilter(muted)
    return muted


def report_once(ex: BaseException) -> None:
    """Log ``ex`` as one line on Flower's log (``fedgc: <its first line>``) and mark it, so
    that Flower, which then fails the run with it, does not log it again with a traceback.

    For the ServerApp under ``flwr run``: a bad value or a federation of the wrong size is the
    user's to fix, and one line says how; the run still fails, with that line as its reason.
    """
    from flwr.supercore import log

    lines = str(ex).strip().splitlines() or [type(ex).__name__]
    log(logging.ERROR, "fedgc: %s", lines[0])
    setattr(ex, REPORTED, True)


def _console_handlers() -> list[logging.Handler]:
    from flwr.supercore.logger import ConsoleHandler

    return [h for h in logging.getLogger("flwr").handlers if isinstance(h, ConsoleHandler)]


def drop_noise() -> None:
    """Install :class:`FlowerNoiseFilter` on Flower's logger (once) for the rest of the process,
    unless Flower logs at DEBUG (its verbose mode: every traceback is shown there).

    For the ServerApp under ``flwr run``, where Flower owns the process and its log settings
    (the federation's ``verbose = true`` sets its console handler to DEBUG).
    """
    flwr_logger = logging.getLogger("flwr")
    if any(h.level <= logging.DEBUG for h in _console_handlers()):
        return
    if not any(isinstance(f, FlowerNoiseFilter) for f in flwr_logger.filters):
        flwr_logger.addFilter(FlowerNoiseFilter())


@contextmanager
def flower_logging(verbose: bool) -> Iterator[None]:
    """Configure Flower's log for one run; restore its previous settings afterwards.

    ``verbose``: leave the run's log to Flower (its simulation engine logs at DEBUG, with
    timestamps). Otherwise quiet, as the module docstring says.
    """
    flwr_logger = logging.getLogger("flwr")
    handlers = _console_handlers()
    saved = [(h, h.level, getattr(h, "colored", True), getattr(h, "timestamps", False))
             for h in handlers]
    saved_env = {k: os.environ.get(k) for k in QUIET_WORKER_ENV}
    noise = FlowerNoiseFilter()
    if not verbose:
        for h in handlers:
            h.setLevel(logging.WARNING)
            h.colored = False  # type: ignore[attr-defined]
        flwr_logger.addFilter(noise)
        os.environ.update(QUIET_WORKER_ENV)
    try:
        yield
    finally:
        flwr_logger.removeFilter(noise)
        for h, level, colored, timestamps in saved:
            h.setLevel(level)
            h.colored = colored  # type: ignore[attr-defined]
            h.timestamps = timestamps  # type: ignore[attr-defined]
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
