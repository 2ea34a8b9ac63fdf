"""``mode = async``: FedBuff's buffered asynchronous loop (server/async_loop.py) runs every
method of the registry with the strategy's own step, weights replies by staleness, refuses the
stale ones (counted, folded back by error-feedback clients), and refuses bad keys clearly."""

from __future__ import annotations

import csv
import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from flwr.app import MessageType

from client.app import app as client_app
from fedgc import methods
from fedgc import protocol as P
from fedgc.settings import RunConfig, SettingsError
from server.app import run_server
from server.async_loop import PULL_INTERVAL_MAX_S, pull_interval, staleness_weight
from server.extensions import Added, Arrival, ConfigValue, Reply, RoundExtension
from server.local_grid import LocalGrid
from server.records import RoundRecord
from server.registry import ClientRegistry
from simulations.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"task": "digits", "num_clients": 5, "clients_per_round": 2, "rounds": 3, "seed": 3,
         "sim.engine": "local", "progress": "false", "eval_samples": 300, "mode": "async",
         "async.concurrency": 3, "async.buffer": 2}


def _run(tmp_path: Path, name: str, **keys: object) -> Path:
    argv = ["run", "--set", f"results_dir={tmp_path}", "--set", f"run_name={name}"]
    for k, v in {**SMALL, **keys}.items():
        argv += ["--set", f"{k}={v}"]
    assert main(argv) == 0
    return tmp_path / name


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def test_staleness_weight_is_fedbuffs_at_half_and_the_keys_by_default() -> None:
    from fedgc.settings import RunConfig

    assert staleness_weight(0, "polynomial", 0.5) == 1.0
    assert staleness_weight(3, "polynomial", 0.5) == 0.5  # FedBuff's 1 / sqrt(1 + 3)
    s = RunConfig.from_flat({}).server  # the keys' defaults: polynomial, 0.75
    assert staleness_weight(15, s.async_staleness, s.async_staleness_exponent) == 0.125
    assert math.isclose(staleness_weight(8, "polynomial", 1.0), 1 / 9)
    assert staleness_weight(100, "constant", 0.5) == 1.0
    with pytest.raises(ValueError, match="staleness must be >= 0, got -1"):
        staleness_weight(-1, "polynomial", 0.5)
    with pytest.raises(ValueError, match="'hinge'"):
        staleness_weight(1, "hinge", 0.5)


def test_a_grid_without_replies_is_pulled_less_and_less() -> None:
    # A deployment's grid is a SuperLink over HTTP and a SuperNode's reply takes many seconds:
    # 50 ms, doubled after every empty pull, at most PULL_INTERVAL_MAX_S (1 s).
    waits = [pull_interval(n) for n in range(1, 80)]
    assert waits[:3] == [0.05, 0.1, 0.2]
    assert all(a <= b for a, b in zip(waits, waits[1:], strict=False))
    assert waits[-1] == PULL_INTERVAL_MAX_S == 1.0
    # A minute without a reply: about 65 pulls, where a pull every 50 ms made 1,200.
    pulls, waited = 0, 0.0
    while waited < 60.0:
        pulls += 1
        waited += pull_interval(pulls)
    assert pulls <= 66
    with pytest.raises(ValueError, match="empty_pulls must be >= 1, got 0"):
        pull_interval(0)


@pytest.mark.parametrize(("keys", "says"), [
    ({"mode": "asynchronous"}, "mode = 'asynchronous'"),
    ({"mode": "async", "async.buffer": 11}, "async.buffer = 11 exceeds async.concurrency = 10"),
    ({"mode": "async", "async.concurrency": 0}, "async.concurrency = 0"),
    ({"mode": "async", "num_clients": 4, "clients_per_round": 2, "async.concurrency": 5,
      "async.buffer": 2}, "async.concurrency = 5 must be <= num_clients = 4"),
    ({"mode": "async", "fraction_evaluate": 0.5}, "fraction_evaluate = 0.5 must be 0"),
    ({"async.staleness": "hinge"}, "async.staleness = 'hinge'"),
    ({"async.max_staleness": -1}, "async.max_staleness = -1"),
    ({"mode": "async", "method": "dense", "privacy.secagg": True},
     "mode = async runs without privacy.secagg and privacy.dp"),
    ({"mode": "async", "privacy.dp": "central", "privacy.clip": 1.0},
     "mode = async runs without privacy.secagg and privacy.dp"),
])
def test_bad_async_keys_are_refused_naming_the_value(keys: dict, says: str) -> None:
    with pytest.raises(SettingsError) as err:
        RunConfig.from_flat(keys)
    assert says in str(err.value)


@pytest.mark.parametrize("method", [m.name for m in methods.registered()])
def test_every_method_runs_async_in_process(tmp_path: Path, method: str) -> None:
    run = _run(tmp_path, method, method=method)
    rounds = _csv(run / "rounds.csv")
    # An applied step is a round: K replies each, the model one version further each.
    assert [int(r["model_version"]) for r in rounds] == [1, 2, 3]
    assert all(int(r["clients_aggregated"]) == 2 for r in rounds)
    rows = _csv(run / "clients.csv")
    stale = [int(r["staleness"]) for r in rows if r["status"] == "aggregated"]
    # Three clients in flight, a step every two replies: later replies trained on older models.
    assert stale[:2] == [0, 0] and max(stale) >= 1
    model = torch.load(run / "model.pt")
    assert all(torch.isfinite(t).all() for t in model.values())
    # Every applied step moved the model (its evaluation differs step after step).
    assert len({r["loss"] for r in rounds}) == 3 and all(int(r["nnz"]) > 0 for r in rounds)


def test_staleness_weight_changes_the_step_and_exponent_zero_is_constant(tmp_path: Path) -> None:
    keys = {"method": "dense", "rounds": 2}
    const = torch.load(_run(tmp_path, "c", **keys, **{"async.staleness": "constant"})
                       / "model.pt")
    flat = torch.load(_run(tmp_path, "p0", **keys, **{"async.staleness_exponent": 0.0})
                      / "model.pt")
    steep = torch.load(_run(tmp_path, "p5", **keys, **{"async.staleness_exponent": 5.0})
                       / "model.pt")
    assert all(torch.equal(const[k], flat[k]) for k in const)
    assert any(not torch.equal(const[k], steep[k]) for k in const)


def test_stale_replies_are_refused_counted_and_folded_back(tmp_path: Path) -> None:
    # A step after every reply with four in flight: every reply but the first of a wave is
    # older than max_staleness = 0.
    run = _run(tmp_path, "stale", method="dgc", rounds=3, **{
        "async.concurrency": 4, "async.buffer": 1, "async.max_staleness": 0})
    rows = _csv(run / "clients.csv")
    refused = [r for r in rows if r["status"] == "rejected"]
    assert refused and all(r["reason"].startswith("stale: trained on version") for r in refused)
    assert all(int(r["staleness"]) > 0 for r in refused)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rejections"]["stale"] == len(refused)
    rounds = _csv(run / "rounds.csv")
    assert sum(int(r["clients_rejected"]) for r in rounds) == len(refused)
    # A client that comes back is sent a patch from the version it holds to the current one.
    assert any(r["downlink"] == "patch" and int(r["round"]) > 1 for r in rows)
    # A refused client was not acknowledged: its next reply folds the update back (restored).
    later = {r["client_key"] for r in refused}
    assert any(int(r["restored"]) > 0 for r in rows
               if r["client_key"] in later and r["status"] == "aggregated")


class _SentConfigs(LocalGrid):
    """The in-process grid, keeping the config of every train message pushed."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.configs: list[dict] = []

    def push_messages(self, messages):  # noqa: ANN001, ANN201 - Grid's signature
        messages = list(messages)
        self.configs += [dict(m.content.config_records[P.CONFIG]) for m in messages
                         if m.metadata.message_type == MessageType.TRAIN]
        return super().push_messages(messages)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_async_dispatches_say_an_update_ages_in_model_versions(tmp_path: Path, mode: str) -> None:
    """Issue 37: every async dispatch tells its client to age an unaggregated update in model
    versions (its sequences count dispatches); a sync round's message says nothing, so its
    clients compute what they did (tests/test_client_app.py checks both ages)."""
    config = RunConfig.from_flat({**SMALL, "method": "dgc", "rounds": 2, "mode": mode,
                                  "results_dir": str(tmp_path), "run_name": mode})
    grid = _SentConfigs(client_app, 5)
    run_server(grid, config)
    assert len(grid.configs) >= 3
    flags = [c.get(P.AGE_IN_VERSIONS) for c in grid.configs]
    assert flags == ([True] * len(flags) if mode == "async" else [None] * len(flags))


class KeyClock(RoundExtension):
    """A clock of this test's own: client k's reply reaches the server k + 1 seconds after its
    message left, so the loop must take replies by client key, not as they are pulled."""

    clocked = True

    def __init__(self) -> None:
        self.now_s = 0.0
        self.left: dict[int, float] = {}  # client key -> when its message left
        self.elapsed: list[float] = []

    def dispatch_at(self, now_s: float) -> None:
        self.now_s = now_s

    def message_keys(self, server_round: int, client_key: int) -> dict[str, ConfigValue]:
        self.left[client_key] = self.now_s
        return {}

    def arrival(self, reply: Reply) -> Arrival:
        return Arrival(self.left[reply.client_key] + reply.client_key + 1)

    def after_step(self, record: RoundRecord, rows: list, replies: list,
                   elapsed_s: float) -> Added:
        self.elapsed.append(elapsed_s)
        return Added()


def test_a_clock_decides_which_reply_comes_next(tmp_path: Path) -> None:
    keys = {**SMALL, "async.concurrency": 3, "async.buffer": 1, "rounds": 2,
            "results_dir": str(tmp_path), "run_name": "clock"}
    config = RunConfig.from_flat(keys)
    first = ClientRegistry(config.train.seed).sample(1, range(5), 3)
    assert first[0] != min(first)  # pulled in sampling order, the first would not be the min
    clock = KeyClock()
    run_server(LocalGrid(client_app, 5), config, extensions=[clock])
    rows = _csv(tmp_path / "clock" / "clients.csv")
    step1 = [r for r in rows if r["round"] == "1"]
    assert [int(r["client_key"]) for r in step1] == [min(first)]
    assert clock.elapsed[0] == min(first) + 1
    # Step 2: the earliest of the two still in flight and the client dispatched at step 1's
    # time (the registry's second draw, the first that is not busy).
    rest = sorted(first)[1:]
    new = next(k for k in ClientRegistry(config.train.seed).sample(2, range(5), 3)
               if k not in rest)
    arrivals = {k: k + 1 for k in rest} | {new: min(first) + 1 + new + 1}
    step2 = [int(r["client_key"]) for r in rows if r["round"] == "2"]
    assert step2 == [min(arrivals, key=arrivals.__getitem__)]
    assert sum(clock.elapsed) == min(arrivals.values())


def test_async_under_the_emulator_records_virtual_time_drops_and_time_to_target(
        tmp_path: Path) -> None:
    run = _run(tmp_path, "netem", method="dgc", rounds=4, num_clients=8, **{
        "async.concurrency": 4, "netem.enabled": "true", "netem.mix": "3g:0.5,lte:0.5",
        "netem.intermittent": 0.5, "netem.seed": 7, "netem.target_accuracy": 0.15})
    rounds = _csv(run / "rounds.csv")
    rows = _csv(run / "clients.csv")
    assert all(float(r["virtual_seconds"]) >= 0 for r in rounds)
    assert sum(float(r["virtual_seconds"]) for r in rounds) > 0
    assert all(int(r["wire_uplink_bytes"]) > int(r["uplink_bytes"]) for r in rounds)
    dropped = [r for r in rows if r["status"] == "dropped"]
    assert sum(int(r["dropped_link"]) for r in rounds) == len(dropped)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["virtual_seconds"] == pytest.approx(
        sum(float(r["virtual_seconds"]) for r in rounds))
    assert summary["virtual_seconds_to_target"] is not None


@pytest.mark.slow
def test_async_runs_on_flowers_simulation_engine(tmp_path: Path) -> None:
    # Ray in its own process, as a user runs it: the loop pulls replies as Ray's actors send
    # them (in no fixed order), through Flower's own grid.
    cmd = [sys.executable, "-m", "simulations", "run", "--set", f"results_dir={tmp_path}",
           "--set", "run_name=ray", "--set", "method=dgc"]
    for k, v in {**SMALL, "sim.engine": "ray"}.items():
        cmd += ["--set", f"{k}={v}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rounds = _csv(tmp_path / "ray" / "rounds.csv")
    assert [int(r["model_version"]) for r in rounds] == [1, 2, 3]
    # K = 2 replies a step, of two clients (one that answered waits for the next step), also
    # when Ray's actors answer together: the replies a step does not take wait for the next.
    assert [int(r["clients_aggregated"]) for r in rounds] == [2, 2, 2]
    rows = _csv(tmp_path / "ray" / "clients.csv")
    assert {r["status"] for r in rows} <= {"aggregated", "rejected"}
    assert len({r["loss"] for r in rounds}) == 3


def test_the_run_announces_its_asynchronous_loop() -> None:
    from simulations.cli import announcement

    line = announcement(RunConfig.from_flat({**SMALL, "run_name": "a"}))
    assert ("asynchronous (FedBuff: 3 training at once, a step every 2 replies, staleness "
            "weight (1+s)^-0.75, at most 20 steps stale), 3 applied steps") in line
    assert "per round" not in line


def test_a_methods_async_run_sits_beside_its_sync_run_in_tables() -> None:
    from simulations.compare import run_label

    assert run_label({"method": "dgc", "config": {"mode": "async"}}, "x") == "dgc-async"
    assert run_label({"method": "dense", "config": {"mode": "sync"}}, "x") == "dense"
    assert run_label({"config": "garbled"}, "folder") == "folder"  # an old or odd summary


def _real_time(column: str) -> bool:
    return "seconds" in column and not column.startswith(("virtual", "time_"))


def _answered_since_checkpoint(run: Path) -> bool:
    """Whether a client stored its state after the run's last checkpoint."""
    try:
        since = (run / "checkpoint.pt").stat().st_mtime_ns
        return any(p.stat().st_mtime_ns > since for p in (run / "client_state").iterdir())
    except FileNotFoundError:  # not written yet, or a file renamed as it was read
        return False


def _killed_after(tmp_path: Path, name: str, steps: int, keys: dict[str, object]) -> int:
    """Start a 500-step async run in a process of its own (forked: this one's imports, no
    second start-up), SIGKILL it once ``steps`` steps are in ``rounds.csv``; how many are."""
    argv = ["run", "--set", f"results_dir={tmp_path}", "--set", f"run_name={name}"]
    for k, v in {**SMALL, **keys, "rounds": 500}.items():
        argv += ["--set", f"{k}={v}"]
    proc = multiprocessing.get_context("fork").Process(target=main, args=(argv,))
    proc.start()
    rounds = tmp_path / name / "rounds.csv"
    try:
        deadline = time.monotonic() + 300
        # Past the checkpoint a client has answered (its state stored): the resume must then
        # replay what it sent, not train it again.
        while not rounds.is_file() or len(_csv(rounds)) < steps \
                or not _answered_since_checkpoint(tmp_path / name):
            assert proc.is_alive(), f"the run ended with status {proc.exitcode}"
            assert time.monotonic() < deadline, "no async step finished in 300 s"
            time.sleep(0.02)
        proc.kill()  # SIGKILL: no teardown, in the middle of the next step
        proc.join()
        assert proc.exitcode == -signal.SIGKILL
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return len(_csv(rounds))


@pytest.mark.parametrize("keys", [
    {"method": "dgc"},
    # Under the emulator: replies taken on the virtual clock, drops, a clock to restore.
    pytest.param({"method": "dgc", "num_clients": 8, "async.concurrency": 4,
                  "netem.enabled": "true", "netem.mix": "3g:0.5,lte:0.5",
                  "netem.intermittent": 0.5, "netem.seed": 7}, marks=pytest.mark.slow),
], ids=["in-process", "emulated"])
def test_a_sigkilled_async_run_resumes_bit_identical(tmp_path: Path, keys: dict) -> None:
    """Issue 37: the dispatches in flight are in the checkpoint and sent again on resume;
    the resumed run is the uninterrupted run, step for step and bit for bit."""
    total = _killed_after(tmp_path, "cut", 2, keys) + 2
    _run(tmp_path, "cut", **keys, rounds=total, resume="true")
    _run(tmp_path, "whole", **keys, rounds=total)
    cut, whole = _csv(tmp_path / "cut" / "rounds.csv"), _csv(tmp_path / "whole" / "rounds.csv")
    assert len(cut) == len(whole) == total
    for a, b in zip(cut, whole, strict=True):
        # Every column but the real-time ones (this machine's seconds).
        assert {k: v for k, v in a.items() if not _real_time(k)} == \
            {k: v for k, v in b.items() if not _real_time(k)}
    keep = ("round", "client_key", "status", "staleness", "uplink_bytes", "downlink")
    rows = [[tuple(r[k] for k in keep) for r in _csv(tmp_path / n / "clients.csv")]
            for n in ("cut", "whole")]
    assert rows[0] == rows[1]
    models = [torch.load(tmp_path / n / "model.pt") for n in ("cut", "whole")]
    assert all(torch.equal(models[0][k], v) for k, v in models[1].items())
