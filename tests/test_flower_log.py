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
