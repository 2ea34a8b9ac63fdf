"""Payload and wire bytes, both ways, each with its ratio to dense, and joules: in compare's
table and compare.json, and in the netem report (simulations.netem.wire_columns)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from server.records import RoundRecord
from server.results import write_rounds
from simulations.cli import main
from simulations.netem.report import summarize_runs, table_text


def test_compare_reports_payload_and_wire_with_ratios_and_joules(tmp_path: Path,
                                                                 capsys) -> None:
    argv = ["compare", "--methods", "dense,dgc", "--set", f"results_dir={tmp_path}",
            "--set", "run_name=cmp", "--set", "task=digits", "--set", "num_clients=2",
            "--set", "clients_per_round=2", "--set", "rounds=2", "--set", "sim.engine=local",
            "--set", "progress=false", "--set", "netem.enabled=true",
            "--set", "netem.mix=lte:1.0"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "wire up MB" in out and "J/client-round" in out
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())["methods"]
    dense, dgc = doc["dense"], doc["dgc"]
    for d in ("uplink", "downlink", "total"):
        assert dgc[f"wire_{d}_vs_dense"] == pytest.approx(
            dense[f"wire_{d}_bytes"] / dgc[f"wire_{d}_bytes"])
        assert dense[f"wire_{d}_vs_dense"] == 1.0
    # Without netem.protocol the link carries the encoded Flower message: dense FedAvg's
    # estimate for a dense update is the run's own, within its non-payload records. (Its
    # downlink is not: round 1 sends no model, the clients build version 0 from the seed.)
    assert dense["wire_uplink_compression"] == pytest.approx(1.0, rel=0.01)
    # The same messages' envelope on both: on the wire the ratio is smaller than the payload's.
    assert 1 < dgc["wire_uplink_vs_dense"] < dgc["uplink_vs_dense"]
    assert dgc["joules_per_client_round"] > 0 and dgc["joules_total"] > 0
    assert dgc["joules_per_client_round"] < dense["joules_per_client_round"]
    # Time to the target beside the accuracy: netem.target_accuracy = 0 derives it from the
    # dense run's last-10, read from rounds.csv like the seconds, wire bytes and joules to it.
    head = out.splitlines()[out.splitlines().index(next(
        line for line in out.splitlines() if line.startswith("method")))]
    for column in ("virtual s", "s to target", "wire MB to target", "J to target"):
        assert column in head
    assert head.index("s to target") < head.index("uplink MB")  # beside the accuracy
    assert "nan" not in out
    assert dense["target_accuracy"] == pytest.approx(dense["last10_accuracy"])
    assert "derived (netem.target_accuracy = 0): dense FedAvg's last-10 accuracy" in out
    assert "under the protocol profile bridge-tls" in out
    for m in (dense, dgc):
        rows = list(csv.DictReader((tmp_path / "cmp" / m["method"] / "rounds.csv").open()))
        reached = next((i for i, r in enumerate(rows)
                        if float(r["accuracy"]) >= m["target_accuracy"]), None)
        if reached is None:
            assert m["virtual_seconds_to_target"] is None and "not reached" in out
            continue
        assert m["round_to_target"] == reached + 1
        assert m["virtual_seconds_to_target"] == pytest.approx(
            sum(float(r["virtual_seconds"]) for r in rows[:reached + 1]))
        assert m["wire_bytes_to_target"] == sum(int(r["wire_uplink_bytes"]) + int(
            r["wire_downlink_bytes"]) for r in rows[:reached + 1])
        assert m["joules_to_target"] == pytest.approx(sum(
            float(r["joules"]) + float(r["idle_joules"]) for r in rows[:reached + 1]))


def test_the_seeds_table_says_how_many_seeds_reached_the_target() -> None:
    from simulations.cli_common import seeds_table
    from simulations.compare import over_seeds

    def run(seconds: float | None) -> dict:
        return {"final_accuracy": 0.9, "virtual_seconds": 100.0, "target_accuracy": 0.85,
                "virtual_seconds_to_target": seconds, "joules_to_target": seconds,
                "wire_bytes_to_target": None if seconds is None else 1e6,
                "wire_uplink_bytes": 5e6}

    doc = over_seeds({0: {"dense": run(40.0), "dgc": run(None)},
                      1: {"dense": run(60.0), "dgc": run(20.0)}})
    assert doc["methods"]["dgc"]["reached"]["virtual_seconds_to_target"] == 1
    dense, dgc = seeds_table(doc).splitlines()[2:]
    assert "50 +- 14" in dense and "(1 of 2)" not in dense
    assert "20 (1 of 2)" in dgc and "nan" not in dgc
    doc = over_seeds({0: {"dgc": run(None)}})
    assert "not reached" in seeds_table(doc)


def _run(tmp_path: Path, method: str, up: int, wire_up: int, joules: float) -> Path:
    d = tmp_path / method
    extra = {"virtual_seconds": 10.0, "dropped_deadline": 0, "dropped_link": 0,
             "dropped_rejected": 0, "wire_uplink_bytes": wire_up, "wire_downlink_bytes": 2000,
             "dense_wire_uplink_bytes": 50_000, "dense_wire_downlink_bytes": 4000,
             "joules": joules, "idle_joules": 1.0, "client_rounds": 2}
    write_rounds(d, [RoundRecord(i, accuracy=0.2 * i, uplink_bytes=up, downlink_bytes=1000,
                                 dense_uplink_bytes=40_000, dense_downlink_bytes=3000,
                                 extra=extra) for i in (1, 2, 3)])
    (d / "summary.json").write_text(json.dumps({"method": method}))
    return d


def test_the_netem_report_prints_both_with_ratios_to_the_dense_run(tmp_path: Path) -> None:
    runs = {"dense": _run(tmp_path, "dense", 40_000, 50_000, 30.0),
            "dgc": _run(tmp_path, "dgc", 400, 5_000, 10.0)}
    table = summarize_runs(runs, target=0.4)
    dgc = table["dgc"]
    assert dgc["uplink_vs_dense"] == pytest.approx(100.0)
    assert dgc["wire_uplink_vs_dense"] == pytest.approx(10.0)
    assert dgc["wire_total_vs_dense"] == pytest.approx(52_000 / 7_000)
    assert dgc["joules_per_client_round"] == pytest.approx(5.0)
    assert dgc["joules_to_target"] == pytest.approx(22.0)  # two rounds of 10 + 1 J
    text = table_text(table)
    assert "wire up" in text and "100.0" in text and "10.0" in text
    # Without a dense run among them, each run's own estimate of dense FedAvg's bytes.
    alone = summarize_runs({"dgc": runs["dgc"]}, target=0.4)["dgc"]
    assert alone["wire_uplink_vs_dense"] == pytest.approx(10.0)
    assert alone["uplink_vs_dense"] == pytest.approx(100.0)
