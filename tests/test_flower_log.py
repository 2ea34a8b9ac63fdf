"""Flower's log in a run: quiet by default (no colour codes, no noise), all of it with --verbose.

Each run is a process of its own, as a user starts it, and the test reads what it printed
(in-process, Flower's console handler keeps the stream it found at import). The Ray engine's
output is checked in tests/test_engines.py (its Ray run, where the actors' lines come from);
these run the in-process engine, whose ServerApp logs through the same Flower logger.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedgc.flower_log import NOISE, flower_logging

ROOT = Path(__file__).resolve().parents[1]
RUN = ["run", "--set", "task=digits", "--set", "num_clients=3", "--set", "clients_per_round=2",
       "--set", "rounds=1", "--set", "sim.engine=local"]


def _run(tmp_path: Path, *extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "simulations", *RUN, "--set",
                           f"results_dir={tmp_path}", *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_run_prints_no_flower_noise_and_no_colour_codes(tmp_path):
    output = _run(tmp_path)
    assert "round    1/1" in output  # fedgc's own progress is there
    assert "\x1b[" not in output
    for noise in NOISE:
        assert noise not in output
    assert "Starting DGCStrategy strategy" not in output  # Flower's INFO lines


@pytest.mark.slow
def test_verbose_shows_flowers_log(tmp_path):
    output = _run(tmp_path, "--verbose")
    assert "Starting DGCStrategy strategy" in output
    assert NOISE[0] in output  # nothing of Flower's is dropped


def test_quiet_settings_are_restored_after_the_run():
    from flwr.supercore.logger import ConsoleHandler

    handlers = [h for h in logging.getLogger("flwr").handlers if isinstance(h, ConsoleHandler)]
    before = [(h.level, h.colored) for h in handlers]
    filters = list(logging.getLogger("flwr").filters)
    with flower_logging(verbose=False):
        assert all(h.level == logging.WARNING and not h.colored for h in handlers)
        assert os.environ["FLWR_LOG_LEVEL"] == "ERROR"
        record = logging.LogRecord("flwr", logging.WARNING, "", 0, "%s", (NOISE[1],), None)
        assert not logging.getLogger("flwr").filter(record)
    assert [(h.level, h.colored) for h in handlers] == before
    assert logging.getLogger("flwr").filters == filters


def test_an_error_reported_in_one_line_loses_flowers_traceback():
    from fedgc.flower_log import FlowerNoiseFilter, report_once

    class Seen(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.records: list[logging.LogRecord] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.records.append(record)

    flwr_logger, seen, quiet = logging.getLogger("flwr"), Seen(), FlowerNoiseFilter()
    flwr_logger.addHandler(seen)
    flwr_logger.addFilter(quiet)
    try:
        mine = ValueError("dgc.density = 2.0 is outside the accepted range (0, 1]\nmore")
        report_once(mine)
        # What Flower's simulation process then does with the exception it fails the run with.
        flwr_logger.error("Simulation raised an exception", exc_info=mine)
        other = RuntimeError("a bug")
        flwr_logger.error("Simulation raised an exception", exc_info=other)
    finally:
        flwr_logger.removeHandler(seen)
        flwr_logger.removeFilter(quiet)
    assert [r.getMessage() for r in seen.records] == [
        "fedgc: dgc.density = 2.0 is outside the accepted range (0, 1]",
        "Simulation raised an exception"]
    assert seen.records[1].exc_info[1] is other  # a bug keeps its traceback


def test_muted_threads_lose_their_flower_records_and_others_keep_theirs():
    """After a Ctrl-C on the Ray engine, the runtime's worker threads log the ActorDiedError
    that Ray's shutdown gives them; those records are dropped, other threads' are not, and the
    filter goes once the muted threads have ended."""
    import threading

    from fedgc.flower_log import mute_threads

    class Seen(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    flwr_logger, seen = logging.getLogger("flwr"), Seen()
    go, done = threading.Event(), threading.Event()

    def worker() -> None:  # blocked on an actor until the driver shuts Ray down
        go.wait(10)
        flwr_logger.error("ray.exceptions.ActorDiedError: The actor died unexpectedly")
        done.wait(10)

    runtime = threading.Thread(target=worker, name="ThreadPoolExecutor-9_0")
    runtime.start()
    flwr_logger.addHandler(seen)
    muted = mute_threads([runtime])
    try:
        go.set()
        flwr_logger.error("the main thread's record")
        assert not muted.release()  # still running: it stays muted
        assert muted in flwr_logger.filters
        done.set()
        runtime.join(10)
        assert muted.release()
        assert muted not in flwr_logger.filters
        # A later thread of the same name (an id may be reused too) is heard.
        later = threading.Thread(target=flwr_logger.error, args=("a later run's record",),
                                 name="ThreadPoolExecutor-9_0")
        later.start()
        later.join(10)
    finally:
        done.set()
        flwr_logger.removeHandler(seen)
        flwr_logger.removeFilter(muted)
    assert seen.messages == ["the main thread's record", "a later run's record"]


def test_an_actor_whose_owner_died_is_not_logged_but_another_actors_death_is():
    """A Ctrl-C reaches Ray's workers with the run's process group, possibly before the run
    sees it: Flower's runtime then logs each busy actor's death (its text, its traceback),
    which the run's one line already says. An actor that died otherwise is still shown."""
    from fedgc.flower_log import FlowerNoiseFilter

    def record(text: str) -> logging.LogRecord:
        return logging.LogRecord("flwr", logging.ERROR, __file__, 1, text, None, None)

    keep = FlowerNoiseFilter().filter
    owner = ("The actor died unexpectedly before finishing this task.\n\tclass_name: "
             "ClientAppActor\nThe actor is dead because its owner has died. Owner Id: 01")
    assert not keep(record(owner))
    assert not keep(record(f"Traceback (most recent call last):\n  ...\n{owner}\n"))
    assert not keep(record("An exception was raised when processing a message by RayBackend"))
    assert keep(record("The actor died unexpectedly before finishing this task.\nThe actor "
                       "is dead because its worker process has died."))
