"""Ctrl-C stops a run on either engine: one line, exit status 130, the last checkpoint kept.

The runs are real ``python -m simulations run`` processes, each in a session of its own, sent
SIGINT to their whole process group, as a terminal's Ctrl-C does (Ray's processes included).
"""

from __future__ import annotations

import csv
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from flwr.app import Message, RecordDict
from flwr.clientapp import ClientApp

from server.local_grid import LocalGrid
from simulations.cli import main
from simulations.interrupt import GridStopped, RunInterrupted, StoppableGrid

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--set", "task=digits", "--set", "num_clients=6", "--set", "clients_per_round=3",
       "--set", "seed=3", "--set", "density=0.01"]
#: Seconds before a run that ignores SIGINT counts as hung (it hung ~600 s: round_timeout_s).
HUNG_S = 60


def _rounds(run: Path) -> list[dict[str, str]]:
    try:
        with (run / "rounds.csv").open() as fh:
            return list(csv.DictReader(fh))
    except FileNotFoundError:
        return []


def _sigint_default() -> None:
    """In the child: SIGINT as a terminal's process has it. A process started with SIGINT
    ignored (a shell's background job: a test run started with ``&``) passes that on, and
    Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(tmp_path: Path, engine: str, after_rounds: int) -> tuple[int, str, str]:
    """Start a 500-round run, Ctrl-C its process group once ``after_rounds`` rounds are in
    ``rounds.csv``; return its exit status, stdout and stderr."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "simulations", "run", *RUN, "--set", "rounds=500",
             "--set", f"sim.engine={engine}", "--set", f"results_dir={tmp_path}",
             "--set", "run_name=cut"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=o, stderr=e, start_new_session=True, preexec_fn=_sigint_default)
        try:
            deadline = time.monotonic() + 300
            while len(_rounds(tmp_path / "cut")) < after_rounds:
                assert proc.poll() is None, err.read_text()[-3000:]
                assert time.monotonic() < deadline, "no round finished in 300 s"
                time.sleep(0.2)
            os.killpg(proc.pid, signal.SIGINT)
            status = proc.wait(timeout=HUNG_S)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    # A Ray worker busy in a round exits once it sees its raylet gone, shortly after.
    gone = time.monotonic() + 30
    while (left := _session(proc.pid)) and time.monotonic() < gone:
        time.sleep(0.2)
    assert not left, f"processes of the interrupted run outlived it: {left}"
    return status, out.read_text(), err.read_text()


def _session(sid: int) -> list[str]:
    """The processes still running in session ``sid`` (zombies, already ended, are not)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # not a process, or gone
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state ppid pgrp session ...
            found.append(f"{entry.name} {(entry / 'cmdline').read_bytes()[:80]!r}")
    return found


LINE = re.compile(r"python -m simulations run: interrupted in round (\d+) of 500 \((.+)\): "
                  r"checkpoint\.pt holds round (\d+); to continue it, run the same command "
                  r"with --set run_name=cut --set results_dir=(.+) --set resume=true")


#: A line Ray forwards from one of its own processes, "(pid=31547) ..." or "(raylet) ...": a
#: terminal's Ctrl-C reaches Ray's workers too, and one may die of it with an abort of its own
#: (once in make test, 2026-12-07: "(pid=N) [mutex.cc : 1954] RAW: ... Mutex corrupt", a stack,
#: "Fatal Python error: Aborted", 14 lines); docs/federation.md says so. Not fedgc's output.
RAY_FORWARDED = re.compile(r"\((?:[\w.]+ )?pid=\d+(?:, ip=[\d.]+)?\)(?: |$)|\(raylet[^)]*\)(?: |$)")


def _check_one_line(status: int, out: str, err: str, tmp_path: Path) -> int:
    """The round the interrupted run says it kept, after checking what it printed (lines Ray
    forwards from its own processes aside)."""
    assert status == 130, err[-3000:]
    own_err = "\n".join(ln for ln in err.splitlines() if not RAY_FORWARDED.match(ln))
    assert "Traceback" not in out + own_err, (out + err)[-3000:]
    lines = [ln for ln in own_err.splitlines() if ln.strip()]
    assert len(lines) == 1, err[-3000:]
    match = LINE.fullmatch(lines[0])
    assert match, lines[0]
    stopped, run_dir, kept, results_dir = match.groups()
    assert (Path(run_dir), Path(results_dir)) == (tmp_path / "cut", tmp_path)
    assert int(stopped) == int(kept) + 1
    rows = _rounds(tmp_path / "cut")
    assert int(rows[-1]["round"]) == int(kept)
    return int(kept)


@pytest.mark.slow
def test_ctrl_c_on_the_local_engine_keeps_a_checkpoint_that_resumes_exactly(tmp_path: Path):
    status, out, err = _interrupt(tmp_path, "local", after_rounds=2)
    kept = _check_one_line(status, out, err, tmp_path)
    assert kept >= 2
    # Resumed as the line says, the run is the uninterrupted run, round for round.
    more = ["--set", f"rounds={kept + 2}", "--set", "sim.engine=local", "--set",
            f"results_dir={tmp_path}", "--set", "progress=false"]
    assert main(["run", *RUN, *more, "--set", "run_name=cut", "--set", "resume=true"]) == 0
    assert main(["run", *RUN, *more, "--set", "run_name=whole"]) == 0
    cut, whole = _rounds(tmp_path / "cut"), _rounds(tmp_path / "whole")
    assert len(cut) == len(whole) == kept + 2
    for a, b in zip(cut, whole, strict=True):
        for key in ("round", "accuracy", "loss", "uplink_bytes", "downlink_bytes",
                    "clients_aggregated"):
            assert a[key] == b[key], (key, a, b)
    models = [torch.load(tmp_path / name / "model.pt") for name in ("cut", "whole")]
    assert all(torch.equal(models[0][k], v) for k, v in models[1].items())


@pytest.mark.slow
def test_ctrl_c_on_the_ray_engine_stops_ray_and_says_one_line(tmp_path: Path):
    status, out, err = _interrupt(tmp_path, "ray", after_rounds=1)
    assert _check_one_line(status, out, err, tmp_path) >= 1
    assert (tmp_path / "cut" / "checkpoint.pt").is_file()


def test_a_stopped_grid_leaves_a_round_that_waits_for_replies():
    # Replies that never come (every one dropped): Flower's own wait would last the timeout.
    grid = LocalGrid(ClientApp(), 2, intercept=lambda reply: None)
    stop = threading.Event()
    stoppable = StoppableGrid(grid, stop)
    messages = [Message(RecordDict(), dst_node_id=n, message_type="train")
                for n in stoppable.get_node_ids()]
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(GridStopped):
        stoppable.send_and_receive(messages, timeout=3600)
    assert time.monotonic() - started < 60  # a hang detector, not a timing target
    with pytest.raises(GridStopped):
        stoppable.get_node_ids()


def test_without_a_stop_the_grid_returns_what_came_within_the_timeout():
    grid = LocalGrid(ClientApp(), 2, intercept=lambda reply: None)
    stoppable = StoppableGrid(grid, threading.Event())
    messages = [Message(RecordDict(), dst_node_id=n, message_type="train")
                for n in stoppable.get_node_ids()]
    assert stoppable.send_and_receive(messages, timeout=0.2) == []


def test_the_interruption_travels_between_processes_whole(tmp_path: Path):
    ex = RunInterrupted(tmp_path / "r", 4, 10, True)
    back = pickle.loads(pickle.dumps(ex))  # compare --jobs: from a worker process
    assert str(back) == str(ex) == (f"interrupted in round 5 of 10 ({tmp_path / 'r'}): "
                                    f"checkpoint.pt holds round 4")
    assert "no round had finished" in str(RunInterrupted(tmp_path, 0, 10, True))
    assert "cannot be resumed" in str(RunInterrupted(tmp_path, 3, 10, False))
