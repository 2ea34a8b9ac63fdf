"""Issue 37's study: virtual time to sync dense's accuracy, sync against async, on several seeds.

Runs every run through the product's own command (``python -m simulations run ...``, one
subprocess per run, no second simulator), appends each finished run to a jsonl (its command,
settings and per-round accuracy, virtual seconds, wire bytes and joules), and reports from that
jsonl alone: per seed, the virtual seconds each run needs to reach sync dense's last-10 accuracy
at the cut (``simulations.netem.target.reach_target``), the ratios against sync dense and sync
FedAvgM, the worst dip per run, and a plot of accuracy against virtual time and against joules.

The scenario is docs/async.md's: mnist5k (``--scenario``: another of
``simulations/scenarios``, e.g. ``fashion-mnist-6m``, docs/async.md "The phone-sized
scenario"), 3G/LTE 50/50, 20% intermittent clients, profile ``bridge-tls`` (a phone through
fedgc's bridge), netem seed = training seed. Each run is long
(minutes of one core): run it through ``/work/locks/cpujob`` on the shared machine::

    /work/locks/cpujob .venv/bin/python bench/async_study.py run --seeds 0 \
        --out results/study37/runs.jsonl
    .venv/bin/python bench/async_study.py report results/study37/runs.jsonl \
        --plot results/study37/study.png
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from simulations.netem.target import reach_target, virtual_times

#: The study's scenario unless ``--scenario`` names another.
SCENARIO = "mnist5k"
#: Settings every run shares (docs/async.md, "A first measurement"); the scenario, rounds and
#: seeds are added per run.
COMMON = ("--set", "sim.engine=local",
          "--set", "netem.enabled=true", "--set", "netem.mix=3g:0.5,lte:0.5",
          "--set", "netem.intermittent=0.2", "--set", "netem.protocol=bridge-tls")
SYNC = ("--set", "over_selection=1.3", "--set", "netem.deadline_s=60")
ASYNC = ("--set", "mode=async", "--set", "async.concurrency=30", "--set", "async.buffer=10")
#: The study's runs: name -> (method, mode settings, rounds multiplier of the cut). Async dgc
#: runs on past the cut (its steps are a few virtual seconds each) to reach the target.
RUNS: dict[str, tuple[str, tuple[str, ...], float]] = {
    "sync-dense": ("dense", SYNC, 1.0),
    "sync-fedavgm": ("fedavgm", SYNC, 1.0),
    "async-dense": ("dense", ASYNC, 1.0),
    "async-dgc": ("dgc", ASYNC, 2.5),
    # Only where async dense's 60 steps fell short of the target (not in the default --runs).
    "async-dense-long": ("dense", ASYNC, 2.5),
    # A probe of the dips (not in the default --runs): updates the server never aggregated
    # dropped instead of decayed back into the residual (fedgc.methods.unaggregated).
    "async-dgc-discard": ("dgc", (*ASYNC, "--set", "unaggregated=discard"), 2.5),
    # Probes of seed 1's dip after step 60 (docs/async.md, "Ending the dip"; not in the
    # default --runs): a tighter staleness bound, a steeper staleness weight.
    "async-dgc-stale10": ("dgc", (*ASYNC, "--set", "async.max_staleness=10"), 2.5),
    "async-dgc-stale15": ("dgc", (*ASYNC, "--set", "async.max_staleness=15"), 2.5),
    "async-dgc-exp1": ("dgc", (*ASYNC, "--set", "async.staleness_exponent=1.0"), 2.5),
    "async-dgc-exp06": ("dgc", (*ASYNC, "--set", "async.staleness_exponent=0.6"), 2.5),
    "async-dgc-exp075": ("dgc", (*ASYNC, "--set", "async.staleness_exponent=0.75"), 2.5),
    # The exponent that ended the dip, on async dense (the key is every method's): 150 steps.
    "async-dense-exp075": ("dense", (*ASYNC, "--set", "async.staleness_exponent=0.75"), 2.5),
    # 0.75 is the default since (the two runs above are async-dgc and async-dense-long now):
    # FedBuff's 1/sqrt(1+s), the default before, for a comparison.
    "async-dgc-exp05": ("dgc", (*ASYNC, "--set", "async.staleness_exponent=0.5"), 2.5),
    "async-dense-exp05": ("dense", (*ASYNC, "--set", "async.staleness_exponent=0.5"), 2.5),
    # Asynchrony begets momentum (Mitliagkas et al. 2016): dgc's server momentum (0.5) lowered.
    "async-dgc-m0": ("dgc", (*ASYNC, "--set", "server_momentum=0"), 2.5),
    "async-dgc-m025": ("dgc", (*ASYNC, "--set", "server_momentum=0.25"), 2.5),
}
#: Per-round columns kept in the jsonl (what the report and the plot read).
COLUMNS = ("accuracy", "virtual_seconds", "wire_uplink_bytes", "wire_downlink_bytes",
           "joules", "idle_joules")
BASELINE, MOMENTUM_BASELINE = "sync-dense", "sync-fedavgm"
#: The dip window: 10 rounds back; counted after round 30 of the 200 (the issue's), scaled to
#: the cut.
DIP_WINDOW = 10


def command(name: str, seed: int, rounds: int, results_dir: Path,
            overrides: Sequence[str] = (), scenario: str = SCENARIO) -> list[str]:
    """The ``python -m simulations run`` command line of run ``name`` on ``seed`` of
    ``scenario``; ``overrides`` (``KEY=VALUE``) replace the scenario's keys in every run (a
    smaller study: ``task=digits``)."""
    method, mode, scale = RUNS[name]
    return [sys.executable, "-m", "simulations", "run", "--scenario", scenario, *COMMON, *mode,
            *(arg for kv in overrides for arg in ("--set", kv)),
            "--set", f"method={method}", "--set", f"seed={seed}", "--set", f"netem.seed={seed}",
            "--set", f"rounds={round(rounds * scale)}", "--set", f"results_dir={results_dir}",
            "--set", f"run_name={name}-s{seed}"]


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def read_rows(run_dir: Path) -> list[dict[str, float]]:
    """The study's columns of ``run_dir/rounds.csv`` (nan where a column is empty)."""
    with open(run_dir / "rounds.csv", newline="") as f:
        return [{c: _float(r.get(c, "")) for c in COLUMNS} for r in csv.DictReader(f)]


def run_study(names: Sequence[str], seeds: Sequence[int], rounds: int, out: Path,
              overrides: Sequence[str] = (), scenario: str = SCENARIO) -> None:
    """Run each of ``names`` on each seed, one after the other (a run on every seed, then the
    next run: the baseline and the method on every seed come first), appending each to
    ``out``; a run whose folder exists (done, or being run by another job of the study) is
    skipped. ``overrides``: keys set in every run, ``scenario`` theirs (:func:`command`)."""
    results_dir = out.parent / "runs"
    for name in names:
        for seed in seeds:
            if (results_dir / f"{name}-s{seed}").exists():
                print(f"{name} seed {seed}: already there, skipped", flush=True)
                continue
            cmd = command(name, seed, rounds, results_dir, overrides, scenario)
            start = time.time()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            record = {"run": name, "seed": seed, "cut": rounds, "scenario": scenario,
                      "command": cmd[1:],
                      "wall_s": round(time.time() - start, 1),
                      "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      "rows": read_rows(results_dir / f"{name}-s{seed}")}
            with open(out, "a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"{name} seed {seed}: {len(record['rows'])} rounds, {record['wall_s']} s",
                  flush=True)


def last10(rows: Sequence[Mapping[str, float]]) -> float:
    """Mean accuracy of the last 10 rows."""
    tail = [r["accuracy"] for r in rows[-10:]]
    return sum(tail) / len(tail)


def worst_dip(rows: Sequence[Mapping[str, float]], after: int) -> float:
    """The largest drop of a row's accuracy below the best of the previous ``DIP_WINDOW`` rows,
    over rows after row ``after`` (0 where none drops)."""
    acc = [r["accuracy"] for r in rows]
    return max([0.0] + [max(acc[i - DIP_WINDOW:i]) - acc[i]
                        for i in range(max(after, DIP_WINDOW), len(acc))])


def load(path: Path) -> dict[tuple[str, int], dict[str, Any]]:
    """The jsonl's runs by (name, seed); a later line replaces an earlier one."""
    runs = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            runs[(record["run"], record["seed"])] = record
    return runs


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:,.1f}"


def _ratio(reference: float | None, value: float | None, reference_total: float) -> str:
    """How many times sooner ``value`` is than ``reference`` ("> N x" when the reference never
    reached the target: its whole run's time is a lower bound)."""
    if value is None or math.isnan(reference_total):
        return "-"
    if reference is None:
        return f"> {reference_total / value:.1f}x"
    return f"{reference / value:.1f}x"


def seed_table(runs: Mapping[tuple[str, int], Mapping[str, Any]], seed: int) -> list[str]:
    """The markdown rows of one seed: target, time to it, ratios, dips."""
    cut = runs[(BASELINE, seed)]["cut"]
    base_rows = runs[(BASELINE, seed)]["rows"]
    target = last10(base_rows)
    first_dip = 30 if cut >= 60 else cut // 2
    reached = {name: reach_target(runs[(name, seed)]["rows"], target)
               for name in RUNS if (name, seed) in runs}
    totals = {name: virtual_times(runs[(name, seed)]["rows"][:cut])[-1] for name in reached}
    base_dip = worst_dip(base_rows[:cut], first_dip)
    lines = [f"seed {seed}: target {target:.4f} (sync dense's last-10 at {cut} rounds); dips "
             f"after round {first_dip}",
             "| run | steps | last-10 at the cut | virtual s at the cut | virtual s to target "
             "(step) | vs sync dense | vs sync FedAvgM | wire MB / J to target | worst dip "
             "(to the cut; whole run) | dip - sync dense's |",
             "|---|---:|---:|---:|---:|---|---|---|---|---|"]
    seconds = {name: None if hit is None else hit.virtual_s for name, hit in reached.items()}
    for name, hit in reached.items():
        rows = runs[(name, seed)]["rows"]
        dip, dip_all = worst_dip(rows[:cut], first_dip), worst_dip(rows, first_dip)
        spent = "-" if hit is None else (
            f"{(hit.wire_bytes or math.nan) / 1e6:,.1f} / {(hit.joules or math.nan):,.0f}")
        where = "" if hit is None else f" ({hit.row})"
        vs_dense = _ratio(seconds[BASELINE], seconds[name], totals[BASELINE])
        vs_momentum = _ratio(seconds.get(MOMENTUM_BASELINE), seconds[name],
                             totals.get(MOMENTUM_BASELINE, math.nan))
        lines.append(
            f"| {name} | {len(rows)} | {last10(rows[:cut]):.4f} | {totals[name]:,.1f} | "
            f"{_seconds(seconds[name])}{where} | {vs_dense} | {vs_momentum} | {spent} | "
            f"{100 * dip:.1f}; {100 * dip_all:.1f} | "
            f"{100 * (max(dip, dip_all) - base_dip):+.1f} |")
    return lines


def plot(runs: Mapping[tuple[str, int], Mapping[str, Any]], out: Path) -> Path:
    """Accuracy against cumulative virtual seconds (top) and joules (bottom), a column per seed;
    sync runs solid, async dashed, a colour per method (:func:`simulations.plots.method_styles`),
    sync dense's last-10 as a dashed grey line."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from simulations.plots import legend_below, method_styles, readable_log, save

    seeds = sorted({seed for _, seed in runs if (BASELINE, seed) in runs})
    scenario = runs[(BASELINE, seeds[0])].get("scenario", SCENARIO)
    fig, axes = plt.subplots(2, len(seeds), figsize=(5.5 * len(seeds), 9), squeeze=False)
    colours = method_styles(sorted({m for m, _, _ in RUNS.values()}))
    for column, seed in enumerate(seeds):
        ax_time, ax_energy = axes[0][column], axes[1][column]
        target = last10(runs[(BASELINE, seed)]["rows"])
        for name, (method, _, _) in RUNS.items():
            if (name, seed) not in runs:
                continue
            rows = runs[(name, seed)]["rows"]
            style = {"color": colours[method]["color"],
                     "linestyle": "--" if name.startswith("async") else "-"}
            acc = [r["accuracy"] for r in rows]
            ax_time.plot(virtual_times(rows), acc, **style)
            joules = [r["joules"] + (r["idle_joules"] if math.isfinite(r["idle_joules"]) else 0)
                      for r in rows]
            ax_energy.plot([sum(joules[:i + 1]) for i in range(len(joules))], acc, **style)
        for ax, what in ((ax_time, "virtual seconds (cumulative)"),
                         (ax_energy, "joules, all clients (cumulative)")):
            readable_log(ax, "x")
            ax.axhline(target, color="0.4", linestyle="--", linewidth=1)
            ax.set(xlabel=what, ylabel="test accuracy", ylim=(min(0.6, target - 0.2), 0.95),
                   title=f"seed {seed}: target {target:.4f}")
            ax.grid(True, which="major", alpha=0.3)
    shown = [n for n in RUNS if any((n, seed) in runs for seed in seeds)]
    handles = [Line2D([], [], color=colours[RUNS[n][0]]["color"],
                      linestyle="--" if n.startswith("async") else "-") for n in shown]
    room = legend_below(fig, handles, shown)
    fig.suptitle(f"{scenario}, 3G/LTE 50/50, 20% intermittent, profile bridge-tls "
                 "(netem seed = training seed)")
    return save(fig, out, room)


def report(path: Path, plot_out: Path | None) -> str:
    """The study's tables (markdown) from the jsonl, and its plot when ``plot_out`` is given."""
    runs = load(path)
    seeds = sorted({seed for name, seed in runs if name == BASELINE})
    lines = []
    for seed in seeds:
        lines += seed_table(runs, seed) + [""]
    if plot_out is not None:
        lines.append(f"plot: {plot(runs, plot_out)}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the study's runs, appending each to the jsonl")
    run.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    run.add_argument("--runs", default="sync-dense,sync-fedavgm,async-dense,async-dgc",
                     help=f"comma-separated, of {list(RUNS)}")
    run.add_argument("--rounds", type=int, default=60,
                     help="the cut: rounds of every run (async dgc: 2.5x); default 60")
    run.add_argument("--out", type=Path, default=Path("results/study37/runs.jsonl"))
    run.add_argument("--scenario", default=SCENARIO,
                     help=f"the scenario of every run (default {SCENARIO}; e.g. "
                     "fashion-mnist-6m)")
    run.add_argument("--set", dest="overrides", action="append", default=[],
                     metavar="KEY=VALUE", help="a key of every run over the scenario's "
                     "(repeatable; e.g. task=digits for a smaller study)")
    rep = sub.add_parser("report", help="the tables (markdown) and the plot, from the jsonl")
    rep.add_argument("jsonl", type=Path)
    rep.add_argument("--plot", type=Path, default=None, help="write the plot here (PNG)")
    args = parser.parse_args(argv)
    if args.command == "report":
        print(report(args.jsonl, args.plot))
        return
    names = args.runs.split(",")
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"--runs: unknown run(s) {unknown}; expected some of {list(RUNS)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run_study(names, [int(s) for s in args.seeds.split(",")], args.rounds, args.out,
              args.overrides, args.scenario)


if __name__ == "__main__":
    main()
