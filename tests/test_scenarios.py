"""Named scenarios, ``compare --seeds`` and the summary's traffic and last-10 fields."""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import statistics
from pathlib import Path

import pytest

from fedgc.methods import compared
from fedgc.settings import RunConfig, SettingsError
from server.records import RoundRecord
from server.results import summarize
from simulations.cli import DEMO, _parser, build_config, main
from simulations.scenario import load_scenario, scenario_names

PNG = b"\x89PNG\r\n\x1a\n"


def _args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"scenario": None, "config": None, "set": [], **kw})


def test_the_shipped_scenarios_are_valid_runs() -> None:
    assert {"mnist5k", "fashion-mnist", "shakespeare", "fashion-mnist-6m"} <= set(
        scenario_names())
    for name in scenario_names():
        c = build_config(_args(scenario=name))
        task = c.train.task
        # No scenario names its folder: each run gets a new one, named by time, task, method.
        assert re.fullmatch(rf"\d{{8}}-\d{{6}}-{task}-{c.train.method}", c.server.run_name)
        # A scenario is named by its task, or by a variant of it (another model).
        assert name == task or name.startswith(f"{task}-")
    # make demo is the mnist5k scenario, in its own folder.
    assert {k: v for k, v in DEMO.items() if k not in ("run_name", "overwrite")} == \
        {k: v for k, v in load_scenario("mnist5k").items() if k != "run_name"}


def test_the_phone_sized_scenario_trains_leafs_femnist_cnn() -> None:
    """fashion-mnist-6m: Fashion-MNIST with LEAF's FEMNIST CNN (conv5x5-32, pool, conv5x5-64,
    pool, fc-2048, fc-10): 6.5M parameters, phone-sized, on data that ships in a package."""
    from client.app import task_of

    c = build_config(_args(scenario="fashion-mnist-6m")).train
    model = task_of(c.task_spec()).build_model()
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes[0] == (32, 1, 5, 5) and shapes[2] == (64, 32, 5, 5)
    assert (2048, 64 * 7 * 7) in shapes and (10, 2048) in shapes
    assert sum(p.numel() for p in model.parameters()) == 6_497_162
    assert c.num_clients >= 100


def test_precedence_defaults_scenario_config_set(tmp_path: Path) -> None:
    cfg = tmp_path / "mine.toml"
    cfg.write_text('rounds = 50\nlr = 0.05\ndensity = 0.01\n')
    c = build_config(_args(scenario="fashion-mnist", config=str(cfg),
                           set=["rounds=7", "seed=4"])).to_flat()
    default = RunConfig().to_flat()
    assert c["rounds"] == 7 and c["seed"] == 4                  # --set wins
    assert c["lr"] == 0.05 and c["density"] == 0.01              # --config over the scenario
    assert c["task"] == "fashion-mnist"                          # the scenario
    assert c["batch_size"] == default["batch_size"]              # defaults below all


@pytest.mark.parametrize("argv", [["run", "--scenario", "cifar"],
                                  ["compare", "--scenario", "cifar"]])
def test_unknown_scenario_names_the_known_ones(argv: list[str], capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "'cifar'" in err and all(name in err for name in scenario_names())
    assert "is a task" not in err


def test_a_task_given_as_scenario_gets_the_key_to_use(capsys) -> None:
    assert main(["run", "--scenario", "digits"]) == 2
    err = capsys.readouterr().err
    assert "'digits' is a task: --set task=digits" in err and "mnist5k" in err


@pytest.mark.parametrize("seeds", ["0,x", "1,1", "-1", ""])
def test_bad_seeds_are_named(seeds: str, capsys) -> None:
    assert main(["compare", "--seeds", seeds, "--set", "rounds=1"]) == 2
    assert "--seeds" in capsys.readouterr().err


def test_compare_takes_every_method_by_default() -> None:
    assert _parser().parse_args(["compare"]).methods.split(",") == list(compared())


def test_summary_traffic_and_last10_of_the_last_ten_rounds() -> None:
    rounds = [RoundRecord(i, accuracy=i / 100, uplink_bytes=10 * i, downlink_bytes=100,
                          dense_uplink_bytes=1000, dense_downlink_bytes=200)
              for i in range(1, 13)]
    s = summarize(rounds, "dgc", {})
    assert s["last10_accuracy"] == pytest.approx(statistics.fmean(range(3, 13)) / 100)
    assert s["final_accuracy"] == 0.12
    up, down = 10 * sum(range(1, 13)), 1200
    assert (s["uplink_bytes"], s["downlink_bytes"], s["total_bytes"]) == (up, down, up + down)
    assert s["uplink_compression"] == 12000 / up and s["downlink_compression"] == 2.0
    assert s["total_compression"] == pytest.approx(14400 / (up + down))
    assert s["dense_total_bytes"] == 14400


def _rounds(run: Path) -> list[dict[str, str]]:
    with (run / "rounds.csv").open() as fh:
        return list(csv.DictReader(fh))


def test_compare_over_seeds_layout_and_mean_std(tmp_path: Path, capsys) -> None:
    argv = ["compare", "--seeds", "0,1", "--methods", "dense,dgc",
            "--set", f"results_dir={tmp_path}", "--set", "run_name=cmp", "--set", "task=digits",
            "--set", "num_clients=4", "--set", "clients_per_round=2", "--set", "rounds=3",
            "--set", "sim.engine=local", "--set", "progress=false", "--set", "partition=iid"]
    assert main(argv) == 0
    base = tmp_path / "cmp"
    summaries = {(s, m): json.loads((base / f"seed-{s}" / m / "summary.json").read_text())
                 for s in (0, 1) for m in ("dense", "dgc")}
    for (seed, method), s in summaries.items():
        assert s["config"]["seed"] == seed and s["method"] == method
        # A run of 3 rounds: last10 is the mean of all three.
        accs = [float(r["accuracy"]) for r in _rounds(base / f"seed-{seed}" / method)]
        assert len(accs) == 3 and s["last10_accuracy"] == pytest.approx(statistics.fmean(accs))
        assert s["total_bytes"] == s["uplink_bytes"] + s["downlink_bytes"]
    assert summaries[0, "dense"]["final_accuracy"] != summaries[1, "dense"]["final_accuracy"]
    doc = json.loads((base / "compare.json").read_text())
    assert doc["seeds"] == [0, 1] and sorted(doc["methods"]) == ["dense", "dgc"]
    for method in ("dense", "dgc"):
        agg = doc["methods"][method]
        assert agg["runs"] == 2
        for key in ("final_accuracy", "last10_accuracy", "total_bytes"):
            values = [summaries[s, method][key] for s in (0, 1)]
            assert agg["mean"][key] == pytest.approx(statistics.fmean(values))
            assert agg["std"][key] == pytest.approx(statistics.stdev(values))
        # Ratios against the dense run of the same seed.
        for d in ("uplink", "downlink", "total"):
            ratios = [summaries[s, "dense"][f"{d}_bytes"] / summaries[s, method][f"{d}_bytes"]
                      for s in (0, 1)]
            assert doc["per_seed"]["0"][method][f"{d}_vs_dense"] == pytest.approx(ratios[0])
            assert agg["mean"][f"{d}_vs_dense"] == pytest.approx(statistics.fmean(ratios))
    assert doc["methods"]["dense"]["mean"]["total_vs_dense"] == 1.0
    assert doc["methods"]["dgc"]["mean"]["uplink_vs_dense"] > 5
    # Each seed keeps its own comparison too.
    per = json.loads((base / "seed-1" / "compare.json").read_text())["methods"]
    assert per["dgc"]["uplink_vs_dense"] == pytest.approx(doc["per_seed"]["1"]["dgc"]
                                                          ["uplink_vs_dense"])
    assert (base / "accuracy_vs_traffic.png").read_bytes()[:8] == PNG
    for seed in ("0", "1"):  # every method read at the cheapest one's total traffic
        per = doc["per_seed"][seed]
        cheapest = min(per, key=lambda m: per[m]["total_bytes"])
        assert per[cheapest]["last10_at_equal_traffic"] == \
            pytest.approx(per[cheapest]["last10_accuracy"])
        assert per["dense"]["equal_traffic_bytes"] == per[cheapest]["total_bytes"]
    out = capsys.readouterr().out
    assert "mean +- std over seeds 0, 1" in out and "total MB" in out and "last10 acc" in out
    assert "last-10 accuracy at the cheapest method's mean total traffic" in out
    # Read again at dense's bytes, with the seed-1 dgc run given apart (merged by seed).
    assert main(["traffic", str(base / "seed-0"), str(base / "seed-1" / "dense"),
                 str(base / "seed-1" / "dgc"), "--budget-method", "dense",
                 "--out", str(tmp_path / "merged")]) == 0
    out = capsys.readouterr().out
    for seed in (0, 1):  # dense within its own whole traffic: its own last-10
        dense = summaries[seed, "dense"]
        assert (f"seed {seed}: last-10 accuracy at dense's total traffic "
                f"({dense['total_bytes'] / 1e6:.2f} MB): "
                f"dense {dense['last10_accuracy']:.4f}") in out
    assert "last-10 accuracy at dense's mean total traffic" in out
    merged = json.loads((tmp_path / "merged" / "compare.json").read_text())
    assert merged["seeds"] == [0, 1] and merged["equal_traffic_method"] == "dense"
    for method in ("dense", "dgc"):  # the same means as the comparison that ran them
        for key in ("last10_accuracy", "total_bytes", "uplink_vs_dense"):
            assert merged["methods"][method]["mean"][key] == \
                pytest.approx(doc["methods"][method]["mean"][key])
    assert merged["per_seed"]["1"]["dgc"]["last10_at_equal_traffic"] == \
        pytest.approx(summaries[1, "dgc"]["last10_accuracy"])  # dgc's whole run fits
    assert (tmp_path / "merged" / "accuracy_vs_traffic.png").read_bytes()[:8] == PNG
    assert main(["traffic", str(base), "--budget-method", "stc"]) == 2
    assert "no stc run for seed(s) [0, 1]" in capsys.readouterr().err


@pytest.mark.slow  # eight small runs, four of them in spawned processes
def test_compare_jobs_gives_the_runs_of_one_job(tmp_path: Path, capsys) -> None:
    common = ["--seeds", "0,1", "--methods", "dense,dgc", "--set", f"results_dir={tmp_path}",
              "--set", "task=digits", "--set", "num_clients=4", "--set", "clients_per_round=2",
              "--set", "rounds=2", "--set", "sim.engine=local", "--set", "partition=iid"]
    assert main(["compare", *common, "--set", "run_name=serial"]) == 0
    assert main(["compare", *common, "--set", "run_name=parallel", "--jobs", "2"]) == 0
    assert "done (4/4)" in capsys.readouterr().out
    for seed in (0, 1):
        for method in ("dense", "dgc"):
            want = _rounds(tmp_path / "serial" / f"seed-{seed}" / method)
            got = _rounds(tmp_path / "parallel" / f"seed-{seed}" / method)
            keys = ("accuracy", "loss", "uplink_bytes", "downlink_bytes")
            assert [[r[k] for k in keys] for r in got] == [[r[k] for k in keys] for r in want]
    serial = json.loads((tmp_path / "serial" / "compare.json").read_text())
    parallel = json.loads((tmp_path / "parallel" / "compare.json").read_text())
    assert parallel["methods"]["dgc"]["mean"]["final_accuracy"] == \
        serial["methods"]["dgc"]["mean"]["final_accuracy"]


@pytest.mark.parametrize("jobs, engine", [("0", "local"), ("2", "ray")])
def test_bad_jobs_are_named(jobs: str, engine: str, capsys) -> None:
    assert main(["compare", "--jobs", jobs, "--set", "rounds=1",
                 "--set", f"sim.engine={engine}"]) == 2
    assert "--jobs" in capsys.readouterr().err


def test_compare_without_run_name_names_one_folder_for_the_comparison(tmp_path: Path) -> None:
    c = build_config(_args(command="compare", set=["task=digits", f"results_dir={tmp_path}"]))
    assert re.fullmatch(r"\d{8}-\d{6}-digits-compare", c.server.run_name)
    named = build_config(_args(command="compare", set=["run_name=mine"]))
    assert named.server.run_name == "mine"
    with pytest.raises(SettingsError, match="resume=true needs run_name"):
        build_config(_args(command="compare", set=["resume=true"]))


def test_compare_budget_method_reads_every_method_at_its_traffic(tmp_path: Path,
                                                                  capsys) -> None:
    argv = ["compare", "--methods", "dense,dgc", "--budget-method", "dense",
            "--set", f"results_dir={tmp_path}", "--set", "run_name=cmp", "--set", "task=digits",
            "--set", "num_clients=4", "--set", "clients_per_round=2", "--set", "rounds=2",
            "--set", "sim.engine=local", "--set", "progress=false", "--set", "partition=iid"]
    assert main(argv) == 0
    per = json.loads((tmp_path / "cmp" / "compare.json").read_text())["methods"]
    for m in ("dense", "dgc"):
        assert per[m]["equal_traffic_method"] == "dense"
        assert per[m]["equal_traffic_bytes"] == per["dense"]["total_bytes"]
    # dgc sends far less: its whole run fits in dense's budget.
    assert per["dgc"]["last10_at_equal_traffic"] == pytest.approx(per["dgc"]["last10_accuracy"])
    # the only compressed method is above itself; dense is not read against the curves
    assert (per["dgc"]["curve_above_share"], per["dgc"]["curve_beaten_by"]) == (1.0, {})
    assert "curve_above_share" not in per["dense"]
    out = capsys.readouterr().out
    assert "at dense's total traffic" in out and "above others" in out
    assert main([*argv[:4], "stc", *argv[5:]]) == 2
    assert "--budget-method 'stc' is not among the compared methods" in capsys.readouterr().err


def test_find_runs_merges_folders_and_names_what_it_cannot_read(tmp_path: Path) -> None:
    from simulations.compare import find_runs

    def run(folder: Path, accs: list[float]) -> Path:
        folder.mkdir(parents=True)
        rows = "".join(f"{a},10,5\n" for a in accs)
        (folder / "rounds.csv").write_text("accuracy,uplink_bytes,downlink_bytes\n" + rows)
        return folder

    a = run(tmp_path / "x" / "seed-0" / "dense", [0.1])
    b = run(tmp_path / "x" / "seed-1" / "dense", [0.2])
    c = run(tmp_path / "y" / "seed-1" / "dgc", [0.3])
    assert find_runs([tmp_path / "x", tmp_path / "y"]) == {0: {"dense": a},
                                                           1: {"dense": b, "dgc": c}}
    flat = run(tmp_path / "z" / "topk", [0.4])
    assert find_runs([tmp_path / "z"]) == {None: {"topk": flat}}
    with pytest.raises(SettingsError, match="dense seed 0 is in two folders"):
        find_runs([tmp_path / "x", tmp_path / "x"])
    with pytest.raises(SettingsError, match="no such comparison folder"):
        find_runs([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SettingsError, match="holds no run"):
        find_runs([tmp_path / "empty"])
    with pytest.raises(SettingsError, match="no readable summary.json"):
        find_runs([flat])  # a single run names its method and seed in its summary
    (flat / "summary.json").write_text("[1, 2]")
    with pytest.raises(SettingsError, match="summary.json is not a JSON object"):
        find_runs([flat])
    (flat / "summary.json").write_text('{"method": "topk", "config": {"seed": 4}}')
    assert find_runs([flat]) == {4: {"topk": flat}}
    with pytest.raises(SettingsError, match="holds no run"):  # after a folder that has runs
        find_runs([tmp_path / "x", tmp_path / "empty"])


@pytest.mark.parametrize("text, what", [
    ("accuracy,uplink_bytes\n0.1,10\n", "row 1: KeyError 'downlink_bytes'"),
    ("accuracy,uplink_bytes,downlink_bytes\n0.1,10,5\n0.2,ten,5\n", "row 2: ValueError"),
    ("accuracy,uplink_bytes,downlink_bytes\n0.1,10\n", "row 1: TypeError"),
])
def test_traffic_names_a_malformed_rounds_csv(tmp_path: Path, capsys, text: str,
                                               what: str) -> None:
    run = tmp_path / "cmp" / "dense"
    run.mkdir(parents=True)
    (run / "rounds.csv").write_text(text)
    (run / "summary.json").write_text('{"method": "dense", "config": {"seed": 0}}')
    assert main(["traffic", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err
    assert "rounds.csv: not a fedgc rounds.csv" in err and what in err


def test_at_equal_traffic_reads_each_method_at_the_cheapest_budget() -> None:
    from simulations.compare import at_equal_traffic

    curves = {"cheap": [(10, 0.1), (20, 0.2), (30, 0.3)],
              "dear": [(5, 0.5), (25, 0.6), (31, 0.9), (90, 0.95)],
              "late": [(40, 0.99)]}
    got = at_equal_traffic(curves)
    assert got["method"] == "cheap" and got["bytes"] == 30
    assert got["rounds"] == {"cheap": 3, "dear": 2, "late": 0}
    assert got["last10"]["cheap"] == pytest.approx(0.2)
    assert got["last10"]["dear"] == pytest.approx(0.55)  # 0.9 came after the budget
    assert math.isnan(got["last10"]["late"])
    long = {"a": [(i, i / 100) for i in range(1, 31)], "b": [(i, 1.0) for i in range(1, 51)]}
    assert at_equal_traffic(long)["last10"]["a"] == pytest.approx(sum(range(21, 31)) / 1000)
    dear = at_equal_traffic(curves, "dear")  # at a named method's total instead
    assert dear["method"] == "dear" and dear["bytes"] == 90
    assert dear["last10"] == {"cheap": pytest.approx(0.2), "dear": pytest.approx(0.7375),
                              "late": pytest.approx(0.99)}
    with pytest.raises(SettingsError, match="budget method 'nope' is not among"):
        at_equal_traffic(curves, "nope")


def test_accuracy_at_budget_is_0_before_the_first_round_and_the_end_beyond_the_last() -> None:
    """A user with a byte budget: nothing before the first round ends, the last-10 within the
    budget, and the run's final last-10 past its own final bytes (run to its end)."""
    from simulations.compare import accuracy_at_budget

    curve = [(10 * (i + 1), i / 20) for i in range(20)]  # 20 rounds, 10 bytes each
    assert accuracy_at_budget(curve, 9) == 0.0
    assert accuracy_at_budget(curve, 10) == 0.0  # the first round, accuracy 0
    assert accuracy_at_budget(curve, 35) == pytest.approx((0 + 0.05 + 0.1) / 3)
    last10 = sum(i / 20 for i in range(10, 20)) / 10
    assert accuracy_at_budget(curve, 200) == pytest.approx(last10)
    assert accuracy_at_budget(curve, 10**9) == pytest.approx(last10)


def test_curve_above_reads_each_compressed_method_against_the_others_at_every_budget() -> None:
    from simulations.compare import compressed_methods, curve_above

    # "low" is better below 100 bytes, "high" from 100 on; dense-family runs are not compared.
    low = [(10, 0.6), (20, 0.6), (50, 0.6)]
    high = [(10, 0.5), (100, 0.9), (1000, 0.9)]
    curves = {"dense": [(10_000, 0.99)], "fedavgm": [(10_000, 0.99)], "dgc": low, "stc": high}
    assert compressed_methods(list(curves)) == ["dgc", "stc"]
    got = curve_above(curves, points=100)  # budgets 10^(1 + 2i/99): 10 .. 1000
    assert (got["floor"], got["ceiling"]) == (10, 1000)
    assert set(got["share"]) == {"dgc", "stc"}
    # below 100 (50 of the 100 budgets) dgc stands at 0.6 against stc's 0.5; from 100 on
    # stc's last-10 within the budget is (0.5 + 0.9) / 2 = 0.7 or more, dgc's held 0.6.
    assert got["share"] == {"dgc": pytest.approx(0.5), "stc": pytest.approx(0.5)}
    assert got["beaten_by"] == {"dgc": {"stc": pytest.approx(0.5)},
                                "stc": {"dgc": pytest.approx(0.5)}}
    # A curve above the other everywhere takes the whole range; a late starter counts 0 first.
    best = {"a": [(10, 0.9), (1000, 0.9)], "b": [(20, 0.5), (500, 0.8)]}
    above = curve_above(best, points=50)
    assert above["share"] == {"a": 1.0, "b": 0.0}
    ties = curve_above({"a": [(10, 0.5)], "b": [(10, 0.5)]})
    assert ties["share"] == {"a": 1.0, "b": 1.0}  # at or above: a tie is not beaten
    assert curve_above({"dense": [(5, 0.9)]})["share"] == {}
    assert curve_above({"only": low})["share"] == {"only": 1.0}
    with pytest.raises(ValueError, match="at least 2 budgets"):
        curve_above(curves, points=1)


def test_the_seeds_table_of_a_dozen_methods_fits_125_columns() -> None:
    from simulations.cli_common import seeds_table

    def agg(i: int, runs: int = 3) -> dict:
        up, down = 381.7e6 / (1 + 60 * i), 302.1e6 / (1 + 5 * i)
        mean = {"final_accuracy": 0.9, "last10_accuracy": 0.89, "uplink_bytes": up,
                "downlink_bytes": down, "total_bytes": up + down,
                "uplink_vs_dense": 381.7e6 / up, "downlink_vs_dense": 302.1e6 / down,
                "total_vs_dense": 683.8e6 / (up + down)}
        return {"mean": mean, "std": {k: 0.01 * v for k, v in mean.items()}, "runs": runs}

    names = ["dense", "fedavgm", "topk", "randk", "stc", "dgc", "TCS", "QSGD", "signSGD (EF)",
             "signSGD (MV)", "PowerSGD", "FetchSGD"]
    table = seeds_table({"methods": {n: agg(i) for i, n in enumerate(names)}})
    lines = table.splitlines()
    assert len(lines) == 14 and max(map(len, lines)) <= 125
    assert "seeds" not in lines[0]  # the same three for every method: said above the table
    dgc = lines[2 + names.index("dgc")]
    assert "0.8900 +- 0.0089" in dgc and " 301.0 " in dgc and "301.0 +-" not in dgc
    uneven = seeds_table({"methods": {"dense": agg(0, 3), "dgc": agg(5, 2)}})
    assert uneven.splitlines()[0].split()[:2] == ["method", "seeds"]


def test_every_column_of_the_tables_is_explained_in_compare_help_and_the_guide(capsys) -> None:
    """Each header the run, compare and seeds tables can print has its explanation
    (COLUMN_HELP), printed by ``compare --help`` and held by docs/guide.md."""
    import re

    from simulations.cli import main
    from simulations.cli_common import COLUMN_HELP, seeds_table, summary_table

    every = {"final_accuracy": 0.9, "last10_accuracy": 0.9, "uplink_bytes": 1e6,
             "downlink_bytes": 1e6, "total_bytes": 2e6, "uplink_vs_dense": 2.0,
             "downlink_vs_dense": 2.0, "total_vs_dense": 2.0, "wire_uplink_bytes": 2e6,
             "wire_downlink_bytes": 2e6, "wire_total_bytes": 4e6, "wire_uplink_vs_dense": 1.5,
             "wire_downlink_vs_dense": 1.5, "wire_total_vs_dense": 1.5,
             "joules_per_client_round": 3.0, "joules_to_target": 90.0,
             "virtual_seconds": 120.0, "virtual_seconds_to_target": 80.0,
             "wire_bytes_to_target": 3e6, "target_accuracy": 0.8,
             "traffic_auc_mean": 0.8, "curve_above_share": 1.0, "reach_dense_round": 5,
             "reach_dense_bytes": 1e6, "clients_failed": 0, "wall_seconds": 1.0,
             "dp_epsilon": 4.2, "dp_delta": 1e-5, "dp_sampling_rate": 0.1}

    def heads(table: str) -> set[str]:
        return set(re.split(r"\s{2,}", table.splitlines()[0].strip()))

    agg = {"mean": every, "std": every}
    printed = heads(summary_table({"dgc": every})) | heads(
        seeds_table({"methods": {"a": {**agg, "runs": 3}, "b": {**agg, "runs": 2}}}))
    assert printed == set(COLUMN_HELP)
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    help_text = re.sub(r"\s+", " ", capsys.readouterr().out)
    guide = (Path(__file__).resolve().parents[1] / "docs" / "guide.md").read_text()
    for head, text in COLUMN_HELP.items():
        assert f"{head}: {text}" in help_text, head
        assert f"| `{head}` | {text} |" in guide, head
