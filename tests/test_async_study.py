"""bench/async_study.py (issue 37's study): its commands are valid runs of the product's CLI, and
its report reads the targets, ratios and dips right from a jsonl (synthetic rows here; the study
itself runs for an hour through /work/locks/cpujob)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.async_study import RUNS, command, report, worst_dip
from simulations.cli import _parser, build_config, build_netem


@pytest.mark.parametrize("name", list(RUNS))
def test_every_run_is_a_valid_simulations_run(name: str, tmp_path: Path) -> None:
    args = _parser().parse_args(command(name, 2, 60, tmp_path)[3:])
    config, netem = build_config(args), build_netem(args)
    assert (config.train.seed, config.run_dir) == (2, tmp_path / f"{name}-s2")
    assert config.server.rounds == (60 if name in ("sync-dense", "sync-fedavgm", "async-dense")
                                    else 150)
    assert ("unaggregated=discard" in command(name, 2, 60, tmp_path)) == name.endswith("discard")
    assert config.server.mode == ("async" if name.startswith("async") else "sync")
    assert netem.enabled and netem.seed == 2 and netem.protocol == "bridge-tls"
    assert config.train.task == "mnist5k"


def test_the_scenario_is_mnist5k_unless_named(tmp_path: Path) -> None:
    assert command("sync-dense", 0, 30, tmp_path)[3:6] == ["run", "--scenario", "mnist5k"]
    args = _parser().parse_args(command("async-dgc", 0, 30, tmp_path,
                                        scenario="fashion-mnist-6m")[3:])
    config = build_config(args)
    assert config.train.task == "fashion-mnist" and config.server.rounds == 75
    assert config.train.model_options == '{"channels": [32, 64], "hidden": 2048}'


def test_overrides_replace_the_scenarios_keys(tmp_path: Path) -> None:
    args = _parser().parse_args(command("async-dgc", 1, 60, tmp_path, ["task=digits"])[3:])
    config = build_config(args)
    assert config.train.task == "digits" and config.server.mode == "async"
    assert config.train.seed == 1


def test_worst_dip_is_the_largest_fall_below_the_previous_ten_after_the_given_row() -> None:
    acc = [0.5] * 10 + [0.8, 0.7, 0.9, 0.6, 0.85]
    rows = [{"accuracy": a} for a in acc]
    assert worst_dip(rows, 0) == pytest.approx(0.3)  # 0.6 against the 0.9 before it
    assert worst_dip(rows, 14) == pytest.approx(0.05)  # only the last: 0.85 against 0.9
    assert worst_dip(rows[:11], 0) == 0.0  # rising only


def _rows(n: int, seconds: float, ceiling: float) -> list[dict[str, float]]:
    return [{"accuracy": ceiling * (1 - math.exp(-(i + 1) / 15)), "virtual_seconds": seconds,
             "wire_uplink_bytes": 1e6, "wire_downlink_bytes": 1e6, "joules": 10.0,
             "idle_joules": math.nan} for i in range(n)]


def test_report_times_each_run_to_sync_dense_last10(tmp_path: Path) -> None:
    runs = {"sync-dense": _rows(60, 8.0, 0.9), "sync-fedavgm": _rows(60, 4.0, 0.85),
            "async-dense": _rows(60, 2.0, 0.9), "async-dgc": _rows(150, 0.5, 0.9)}
    jsonl = tmp_path / "runs.jsonl"
    jsonl.write_text("".join(json.dumps({"run": n, "seed": 0, "cut": 60, "rows": r}) + "\n"
                             for n, r in runs.items()))
    lines = {line.split(" | ")[0]: line.split(" | ") for line in
             report(jsonl, tmp_path / "study.png").splitlines() if line.startswith("| ")}
    # The same curve reaches sync dense's last-10 at the same step: the ratio of step times.
    assert lines["| sync-dense"][4].endswith("(56)")
    # FedAvgM never gets there: its whole run's 240 s bound the ratio (240 / 112).
    assert lines["| sync-fedavgm"][4] == "not reached"
    assert lines["| async-dense"][5:7] == ["4.0x", "> 2.1x"]
    assert lines["| async-dgc"][5] == "16.0x"
    assert (tmp_path / "study.png").stat().st_size > 0
