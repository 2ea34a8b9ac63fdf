"""``mode = async``: FedBuff's buffered asynchronous loop (server/async_loop.py) runs every
method of the registry with the strategy's own step, weights replies by staleness, refuses the
stale ones (counted, folded back by error-feedback clients), and refuses bad keys clearly."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from fedgc import methods
from fedgc.settings import RunConfig, SettingsError
from server.async_loop import staleness_weight
from simulations.cli import main

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


def test_staleness_weight_is_fedbuffs_by_default() -> None:
    assert staleness_weight(0) == 1.0
    assert staleness_weight(3) == 0.5  # 1 / sqrt(1 + 3)
    assert math.isclose(staleness_weight(8, "polynomial", 1.0), 1 / 9)
    assert staleness_weight(100, "constant") == 1.0
    with pytest.raises(ValueError, match="staleness must be >= 0, got -1"):
        staleness_weight(-1)
    with pytest.raises(ValueError, match="'hinge'"):
        staleness_weight(1, "hinge")


@pytest.mark.parametrize(("keys", "says"), [
    ({"mode": "asynchronous"}, "mode = 'asynchronous'"),
    ({"mode": "async", "async.buffer": 11}, "async.buffer = 11 exceeds async.concurrency = 10"),
    ({"mode": "async", "async.concurrency": 0}, "async.concurrency = 0"),
    ({"mode": "async", "num_clients": 4, "clients_per_round": 2, "async.concurrency": 5,
      "async.buffer": 2}, "async.concurrency = 5 must be <= num_clients = 4"),
    ({"mode": "async", "fraction_evaluate": 0.5}, "fraction_evaluate = 0.5 must be 0"),
    ({"async.staleness": "hinge"}, "async.staleness = 'hinge'"),
    ({"async.max_staleness": -1}, "async.max_staleness = -1"),
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
    # A refused client was not acknowledged: its next reply folds the update back (restored).
    later = {r["client_key"] for r in refused}
    assert any(int(r["restored"]) > 0 for r in rows
               if r["client_key"] in later and r["status"] == "aggregated")


def test_async_refuses_the_emulator_and_resume_until_they_are_wired(tmp_path: Path,
                                                                    capsys) -> None:
    argv = ["run", "--set", f"results_dir={tmp_path}", "--set", "run_name=n"]
    for k, v in {**SMALL, "netem.enabled": "true"}.items():
        argv += ["--set", f"{k}={v}"]
    assert main(argv) != 0
    assert "mode = async does not run under the network emulator" in capsys.readouterr().err
