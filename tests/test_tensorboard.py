"""tensorboard=true: each round's metrics as TensorBoard scalars, read back from the event file."""

from __future__ import annotations

import csv
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from client.app import app as client_app
from fedgc.settings import RunConfig
from server.app import run_server
from server.local_grid import LocalGrid
from server.preflight import PreflightError
from server.records import RoundRecord
from server.tensorboard import EVENTS_DIR, RoundWriter, scalars
from simulations.netem.extension import NetemClock

BASE = {"task": "digits", "num_clients": 6, "clients_per_round": 3, "partition": "iid",
        "density": 0.01, "dgc.warmup_rounds": 1, "progress": False, "local_steps": 3,
        "sim.engine": "local"}


def _events(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / EVENTS_DIR))
    acc.Reload()
    return acc


def _values(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_a_run_writes_its_rounds_as_scalars(tmp_path):
    c = RunConfig.from_flat({**BASE, "results_dir": str(tmp_path), "run_name": "tb",
                             "rounds": 3, "tensorboard": True})
    run_server(LocalGrid(client_app, 6, seed=1), c)
    rows = list(csv.DictReader((c.run_dir / "rounds.csv").open()))
    acc = _events(c.run_dir)
    # float32 in the event file: equal to rounds.csv to float32 precision, step = round.
    for tag, column, scale in (("eval/accuracy", "accuracy", 1.0), ("eval/loss", "loss", 1.0),
                               ("traffic/uplink_MB", "uplink_bytes", 1e-6),
                               ("traffic/downlink_MB", "downlink_bytes", 1e-6),
                               ("clients/aggregated", "clients_aggregated", 1.0)):
        got = _values(acc, tag)
        assert [s for s, _ in got] == [1, 2, 3], tag
        assert [v for _, v in got] == pytest.approx(
            [float(r[column]) * scale for r in rows], rel=1e-6), tag
    total = [(int(r["uplink_bytes"]) + int(r["downlink_bytes"])) / 1e6 for r in rows]
    cumulative = [v for _, v in _values(acc, "traffic/cumulative_total_MB")]
    assert cumulative == pytest.approx([sum(total[:i + 1]) for i in range(3)], rel=1e-6)
    assert "time/virtual_seconds" not in acc.Tags()["scalars"]  # not an emulated run


def test_overwrite_replaces_the_event_files_and_off_writes_none(tmp_path):
    c = RunConfig.from_flat({**BASE, "results_dir": str(tmp_path), "run_name": "tb",
                             "rounds": 2, "tensorboard": True})
    run_server(LocalGrid(client_app, 6, seed=1), c)
    again = c.with_overrides({"rounds": 1, "overwrite": True})
    run_server(LocalGrid(client_app, 6, seed=1), again)
    assert len(list((c.run_dir / EVENTS_DIR).iterdir())) == 1
    assert [s for s, _ in _values(_events(c.run_dir), "eval/accuracy")] == [1]
    off = c.with_overrides({"run_name": "off", "tensorboard": False, "rounds": 1})
    run_server(LocalGrid(client_app, 6, seed=1), off)
    assert not (off.run_dir / EVENTS_DIR).exists()


def test_scalars_leave_out_what_a_round_lacks_and_add_the_emulators_clock():
    plain = scalars(RoundRecord(round=1, uplink_bytes=2_000_000, downlink_bytes=3_000_000),
                    [RoundRecord(round=0, uplink_bytes=1_000_000)])
    assert "eval/accuracy" not in plain and "traffic/uplink_compression" in plain
    assert plain["traffic/cumulative_total_MB"] == pytest.approx(6.0)
    emulated = scalars(RoundRecord(round=1, extra={"virtual_seconds": 12.5,
                                                   "dropped_deadline": 2}),
                       columns=NetemClock.columns)
    assert emulated["time/virtual_seconds"] == 12.5
    assert emulated["clients/dropped_deadline"] == 2.0


def test_without_the_package_the_run_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    with pytest.raises(PreflightError, match=r"tensorboard=true needs the tensorboard package"):
        RoundWriter(tmp_path)
