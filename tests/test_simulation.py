"""The command line: config errors, compare's files, and one real Flower simulation (Ray)."""

from __future__ import annotations

import csv
import json

import pytest

from server.results import ROUND_COLUMNS, SUMMARY_KEYS
from simulations.cli import main, parse_sets


@pytest.mark.parametrize("argv, words", [
    (["run", "--set", "density=2"], ["density", "(0, 1]"]),
    (["run", "--set", "rounds=-1"], ["rounds", "[1, inf)"]),
    (["run", "--set", "colour=blue"], ["unknown", "colour"]),
    (["run", "--set", "rounds"], ["key=value", "rounds"]),
    (["compare", "--methods", "dense,sgd"], ["--methods", "sgd"]),
    (["run", "--config", "/nonexistent/scenario.toml"], ["does not exist"]),
])
def test_bad_config_stops_with_key_and_range(argv, words, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err


def test_parse_sets():
    assert parse_sets(["a=1", "density = 0.1", "s=x=y"]) == {"a": "1", "density": "0.1",
                                                              "s": "x=y"}


def test_compare_writes_all_methods_and_a_plot(tmp_path, capsys):
    argv = ["compare", "--set", f"results_dir={tmp_path}", "--set", "run_name=cmp",
            "--set", "task=digits", "--set", "num_clients=4", "--set", "clients_per_round=2",
            "--set", "rounds=3", "--set", "sim.engine=local", "--set", "progress=false",
            "--set", "partition=iid"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert list(doc["methods"]) == ["dense", "dgc", "fedavgm", "stc", "topk"]  # sorted keys
    for name, s in doc["methods"].items():
        assert set(SUMMARY_KEYS) <= set(s) and s["method"] == name and s["rounds"] == 3
    m = doc["methods"]
    assert m["dgc"]["uplink_bytes"] < m["dense"]["uplink_bytes"] / 5
    assert m["stc"]["uplink_bytes"] < m["dgc"]["uplink_bytes"]
    assert m["fedavgm"]["uplink_bytes"] == m["dense"]["uplink_bytes"]
    # The dense baseline is the dense fp32 update on the same wire: dense sends exactly that.
    assert m["dense"]["uplink_compression"] == pytest.approx(1.0)
    assert m["dense"]["uplink_bytes"] == m["dense"]["dense_uplink_bytes"]
    # The methods run the same scenario: their recorded configs differ in method and folder,
    # in the keys each method sets its own default for, and in each method's own keys, which
    # its runs alone carry (dense none, topk and stc the sparsifiers', dgc all of DGC's).
    per_method = {name: dict(s["config"]) for name, s in m.items()}
    own = {}
    for name, cfg in per_method.items():
        for k in ("method", "run_name", "results_dir", "state_dir"):
            cfg.pop(k, None)
        own[name] = {k: cfg.pop(k) for k in ("server_lr", "server_momentum", "density",
                                              "downlink_density", "downlink_values",
                                              "unaggregated")}
    from fedgc.methods import get
    from fedgc.schema import known_keys

    base = per_method["dense"]
    for name, cfg in per_method.items():
        mine = get(name).settings
        assert set(cfg) == set(base) | set(known_keys([mine] if mine else [])), name
        assert {k: cfg[k] for k in base} == base, name
    assert own["dgc"]["server_momentum"] == own["fedavgm"]["server_momentum"] == 0.5
    assert own["dense"]["server_momentum"] == own["stc"]["server_momentum"] == 0.0
    assert own["stc"]["density"] == 0.0025 and own["dgc"]["density"] == 0.001
    assert own["dgc"]["unaggregated"] == own["stc"]["unaggregated"] == "decay"
    assert own["dense"]["unaggregated"] == "keep"  # no residual: nothing to fold back
    # ... and the same clients, sampled by the run's seed whatever the method.
    sampled = {name: [(r["round"], r["client_key"]) for r in
                      csv.DictReader((tmp_path / "cmp" / name / "clients.csv").open())]
               for name in m}
    assert all(keys == sampled["dense"] for keys in sampled.values())
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "final acc" in out and "topk" in out


def test_compare_methods_all_runs_every_registered_method_family_by_family(tmp_path, capsys):
    """The catalogue side by side: every registered method (a new one is in it by being
    registered), one round each, its table and plot listed family by family."""
    from fedgc import methods
    from simulations.compare import by_family

    argv = ["compare", "--methods", "all", "--set", f"results_dir={tmp_path}",
            "--set", "run_name=all", "--set", "task=digits", "--set", "num_clients=4",
            "--set", "clients_per_round=2", "--set", "rounds=1", "--set", "sim.engine=local",
            "--set", "progress=false", "--set", "partition=iid"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "all" / "compare.json").read_text())
    assert set(doc["methods"]) == set(methods.names())
    assert all(s["clients_aggregated"] == 2 for s in doc["methods"].values())
    rows = capsys.readouterr().out.split("\n-")[1].splitlines()[1:len(doc["methods"]) + 1]
    assert [r.split("  ")[0].strip() for r in rows] == \
        [methods.get(m).title for m in by_family(methods.names())]
    assert (tmp_path / "all" / "compare.png").stat().st_size > 10_000


def test_demo_is_the_default_scenario_with_default_client_settings():
    """`demo` pins the scenario only; local training and compression are the schema defaults."""
    import argparse

    from fedgc.settings import RunConfig
    from simulations.cli import DEMO, build_config

    c = build_config(argparse.Namespace(config=None, set=[]), DEMO)
    default = RunConfig().to_flat()
    for key in ("lr", "local_epochs", "batch_size", "client_momentum", "dgc.momentum",
                "dgc.momentum_correction", "dgc.small_density", "server_lr", "server_momentum"):
        assert c.to_flat()[key] == default[key], key
    assert (c.train.num_clients, c.train.clients_per_round, c.train.density) == (100, 10, 0.001)


@pytest.mark.slow
def test_flower_simulation_end_to_end(digits_on_ray):
    """The real engine: Ray actors run the ClientApp; accuracy rises; files have the schema
    (the session's run of conftest.DIGITS_ON_RAY, in its own process)."""
    proc, run_dir = digits_on_ray.proc, digits_on_ray.folder
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader((run_dir / "rounds.csv").open()))
    assert set(ROUND_COLUMNS) <= set(rows[0]) and len(rows) == 5
    acc = [float(r["accuracy"]) for r in rows]
    assert acc[-1] > acc[0] + 0.15
    assert all(int(r["clients_aggregated"]) == 4 and int(r["clients_failed"]) == 0
               for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(SUMMARY_KEYS) <= set(summary) and summary["method"] == "dgc"
    assert summary["uplink_compression"] > 5
    assert (run_dir / "plots.png").exists() and (run_dir / "checkpoint.pt").exists()
    assert "round    5/5" in proc.stdout  # the progress display


def test_the_defences_in_force_are_in_the_header_and_the_summary(tmp_path, capsys):
    # max_weight_ratio 1: every client claiming more than the round's median is capped.
    argv = ["run", "--set", f"results_dir={tmp_path}", "--set", "run_name=bounded",
            "--set", "task=digits", "--set", "num_clients=6", "--set", "clients_per_round=3",
            "--set", "rounds=2", "--set", "sim.engine=local", "--set", "max_weight_ratio=1"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == ("fedgc: defences: a client's weight capped at the round's median "
                      "(max_weight_ratio=1); plain FedAvg would take max_weight_ratio=0"), out[:3]
    run = tmp_path / "bounded"
    summary = json.loads((run / "summary.json").read_text())
    reasons = [r["reason"] for r in csv.DictReader((run / "clients.csv").open())
               if r["status"] == "aggregated"]
    capped = sum("capped at" in r for r in reasons)
    assert capped > 0
    assert summary["defences"] == {"max_weight_ratio": 1.0, "max_norm_ratio": 0.0,
                                   "aggregation": "mean", "trim_fraction": 0.1,
                                   "min_cosine": -1.0, "weights_capped": capped,
                                   "updates_clipped": 0, "updates_left_out": 0}
    assert (f"defences: {capped} weights capped, 0 updates clipped, 0 left out"
            in "\n".join(out))


def test_plain_fedavg_says_so():
    """The header names each defence with its key, and says what plain FedAvg would take."""
    from server.defences import describe

    assert describe(0, 0, "mean", 0.1) == ("defences: none, plain FedAvg (the weighted mean of "
                                           "the updates)")
    assert describe(0, 5, "trimmed_mean", 0.2) == (
        "defences: an update clipped to 5x the round's median norm (max_norm_ratio=5); updates "
        "combined by the coordinate-wise mean trimmed of 0.2 at each end "
        "(aggregation=trimmed_mean); plain FedAvg would take max_norm_ratio=0 aggregation=mean")
    assert describe(2, 0, "mean", 0.1) == (
        "defences: a client's weight capped at 2x the round's median (max_weight_ratio=2); "
        "plain FedAvg would take max_weight_ratio=0")
    assert describe(1, 0, "centered_clip", 0.1, 0.0, gate_reference="trend") == (  # robust = on's
        "defences: a client's weight capped at the round's median (max_weight_ratio=1); updates "
        "left out below cosine 0 with the aggregates' moving average (min_cosine=0, "
        "gate_reference=trend); updates combined by centered clipping around last round's "
        "aggregate (aggregation=centered_clip); plain FedAvg would take max_weight_ratio=0 "
        "min_cosine=-1 aggregation=mean")
    assert ("moving average, and a repeat offender's while its record is bad (min_cosine=0, "
            "gate_reference=trend, gate_memory=0.95);") in describe(
        1, 0, "centered_clip", 0.1, 0.0, gate_reference="trend", gate_memory=0.95)
    assert ("and a repeat offender's (a record opened below cosine -0.2) while its record is bad "
            "(min_cosine=0, gate_reference=trend, gate_memory=0.95, gate_memory_below=-0.2);"
            ) in describe(1, 0, "centered_clip", 0.1, 0.0, gate_reference="trend",
                          gate_memory=0.95, gate_memory_below=-0.2)
    assert "gate_memory_below" not in describe(  # at the bar (its default): every left-out
        1, 0, "centered_clip", 0.1, 0.0, gate_reference="trend", gate_memory=0.95)
    assert ("left out below cosine 0 (a client without a record below -0.2) with the "
            "aggregates' moving average") in describe(  # robust = on's since stop 46
        1, 0, "centered_clip", 0.1, 0.0, gate_reference="trend", gate_memory=0.95,
        gate_memory_below=-0.2, gate_first_bar=-0.2)
    assert "gate_first_bar" not in describe(  # unread without gate_memory
        1, 0, "centered_clip", 0.1, 0.0, gate_reference="trend", gate_first_bar=-0.2)
    assert ("updates combined by centered clipping around last round's aggregate, at radius 2 "
            "in a round the gate found clean (aggregation=centered_clip, clip_radius_clean=2)"
            ) in describe(  # robust = on's since issue 35's r35
        1, 0, "centered_clip", 0.1, 0.0, gate_reference="trend", gate_memory=0.95,
        gate_memory_below=-0.2, gate_first_bar=-0.2, clip_radius_clean=2.0)
    assert "clip_radius_clean" not in describe(  # unread without the gate
        1, 0, "centered_clip", 0.1, -1.0, clip_radius_clean=2.0)
    assert "cosine 0 with the last round's aggregate (min_cosine=0);" in describe(
        1, 0, "centered_clip", 0.1, 0.0, gate_reference="history")
    assert describe(0, 0, "centered_clip", 0.1, bucket_size=2) == (  # bucketing: issue 35
        "defences: updates combined by centered clipping around last round's aggregate of "
        "bucket means, 2 random clients each (aggregation=centered_clip, bucket_size=2); plain "
        "FedAvg would take aggregation=mean")
