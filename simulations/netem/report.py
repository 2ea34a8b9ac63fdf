"""Reports of emulated runs: accuracy against virtual time, time to accuracy, drops, bytes.

``python -m simulations.netem.report OUT.png NAME=RUN_DIR [NAME=RUN_DIR ...]
[--set netem.target_accuracy=ACC]`` plots accuracy against cumulative virtual seconds for each
run (e.g. dense FedAvg and DGC under a mobile mix) with the target accuracy as a line, accuracy
against cumulative joules (runs with the emulator's energy accounting), the per-round virtual
duration, the updates not aggregated by cause (drops, and the surplus of over-selection) and
MB up, down and in total, as payload and on the wire, titled with the methods, scenario and
links; and prints the time-to-accuracy table, whose virtual seconds are the run's total, as the
progress line's ``total``, with payload and link bytes both ways, each with its ratio to dense
(the run of method ``dense`` among them, else dense FedAvg for the run's own client-rounds),
and joules per client-round, and the virtual seconds, wire bytes and joules to the target
(:mod:`simulations.netem.target`; link bytes count Flower's protocol with ``netem.protocol``).

The target is the one key of every reading, ``netem.target_accuracy``: as given with ``--set``,
else as the runs were made with (their ``summary.json``), else derived (0): the dense run's
last-10 accuracy (the first run's without one). A cell with no value says so in words
("not reached", "n/a"), never ``nan``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from fedgc.methods import baseline  # noqa: E402
from server.results import read_rounds  # noqa: E402
from simulations.netem.errors import NetemError  # noqa: E402
from simulations.netem.target import (  # noqa: E402
    NOT_REACHED,
    TARGET_KEY,
    derived_target,
    reach_target,
    target_of,
)
from simulations.netem.target import virtual_times as target_times  # noqa: E402
from simulations.plots import (  # noqa: E402
    integer_rounds,
    legend_below,
    readable_log,
    save,
    scenario_title,
)

#: The ``rounds.csv`` columns of the drops, by cause.
DROP_CAUSES = ("dropped_deadline", "dropped_link", "dropped_rejected")
#: Valid updates that came in time but after the round had its K: not drops, not failures.
SURPLUS = "clients_surplus"


def virtual_times(rows: Sequence[Mapping[str, float]]) -> list[float]:
    """Cumulative virtual seconds at the end of each round (a run not emulated is an error)."""
    if any("virtual_seconds" not in r for r in rows):
        raise NetemError("rounds.csv has no virtual_seconds column: the run was not "
                         "emulated (set netem.enabled=true)")
    return target_times(rows)


def time_to_accuracy(rows: Sequence[Mapping[str, float]], target: float) -> float | None:
    """Virtual seconds until the accuracy first reached ``target`` (None: never)."""
    virtual_times(rows)
    reached = reach_target(rows, target)
    return reached.virtual_s if reached else None


def _has(rows: Sequence[Mapping[str, float]], column: str) -> bool:
    return bool(rows) and all(column in r and math.isfinite(r[column]) for r in rows)


def cumulative_joules(rows: Sequence[Mapping[str, float]]) -> list[float] | None:
    """Joules spent by the end of each round (``joules``: the clients that worked, plus
    ``idle_joules``: the nodes that waited), or None when the run recorded none."""
    if not _has(rows, "joules"):
        return None
    out, total = [], 0.0
    for r in rows:
        total += r["joules"] + (r.get("idle_joules", 0.0) if math.isfinite(
            r.get("idle_joules", 0.0)) else 0.0)
        out.append(total)
    return out


def energy_to_accuracy(rows: Sequence[Mapping[str, float]], target: float) -> float | None:
    """Joules until the accuracy first reached ``target`` (None: never, or not recorded)."""
    reached = reach_target(rows, target)
    return reached.joules if reached else None


def _summary_of(run_dir: str | Path) -> dict:
    """A run's ``summary.json`` ({} when it has none or it is unreadable)."""
    try:
        summary = json.loads(Path(run_dir, "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _method_of(run_dir: str | Path) -> str:
    return str(_summary_of(run_dir).get("method", ""))


#: The traffic columns of the table: (key, rounds.csv columns summed, dense columns summed).
TRAFFIC = (("uplink", ("uplink_bytes",), ("dense_uplink_bytes",)),
           ("downlink", ("downlink_bytes",), ("dense_downlink_bytes",)),
           ("wire_uplink", ("wire_uplink_bytes",), ("dense_wire_uplink_bytes",)),
           ("wire_downlink", ("wire_downlink_bytes",), ("dense_wire_downlink_bytes",)),
           ("wire_total", ("wire_uplink_bytes", "wire_downlink_bytes"),
            ("dense_wire_uplink_bytes", "dense_wire_downlink_bytes")))


def run_target(runs: Mapping[str, str | Path], target: float | None = None
               ) -> tuple[float, str]:
    """``(target accuracy, where it comes from)`` for ``runs`` (name -> folder): ``target``
    when given (> 0), else the ``netem.target_accuracy`` the runs were made with
    (:func:`simulations.netem.target.target_of`), else derived
    (:func:`simulations.netem.target.derived_target`)."""
    if target is not None and target > 0:
        return target, TARGET_KEY
    try:
        given = target_of({name: _summary_of(d) for name, d in runs.items()})
    except ValueError as ex:
        raise NetemError(str(ex)) from None
    if given > 0:
        return given, f"{TARGET_KEY} of the runs"
    dense = next((n for n, d in runs.items() if _method_of(d) == baseline()), None)
    value, how = derived_target({n: read_rounds(Path(d)) for n, d in runs.items()}, dense)
    return value, f"derived: {how}"


def summarize_runs(runs: Mapping[str, str | Path], target: float | None = None
                   ) -> dict[str, dict[str, float | None]]:
    """Per run: final accuracy, virtual seconds, the target (:func:`run_target`) and what the
    run spent to reach it (virtual seconds, wire bytes, joules), drops, payload bytes and (runs
    that recorded them) link bytes both ways, each with its ratio to dense, and joules per
    client-round and in all.

    A ratio to dense (``<traffic>_vs_dense``) is the bytes of the baseline method's run (dense)
    among ``runs`` over this run's; without one, what dense FedAvg would have sent for the
    run's own client-rounds (its ``dense_*`` columns) over what it sent.
    """
    table: dict[str, dict[str, float | None]] = {}
    rows_of = {name: read_rounds(Path(d)) for name, d in runs.items()}
    target, _ = run_target(runs, target)
    dense_run = next((n for n, d in runs.items() if _method_of(d) == baseline()), None)

    def total(rows: Sequence[Mapping[str, float]], columns: Sequence[str]) -> float | None:
        if not all(_has(rows, c) for c in columns):
            return None
        return sum(r[c] for r in rows for c in columns)

    for name, rows in rows_of.items():
        joules = cumulative_joules(rows)
        client_rounds = total(rows, ("client_rounds",))
        reached = reach_target(rows, target)
        table[name] = {
            "final_accuracy": rows[-1]["accuracy"],
            "rounds": len(rows),
            "virtual_seconds": virtual_times(rows)[-1],
            "target_accuracy": target,
            "virtual_seconds_to_target": reached.virtual_s if reached else None,
            "wire_bytes_to_target": reached.wire_bytes if reached else None,
            "dropped_deadline": sum(r["dropped_deadline"] for r in rows),
            "dropped_link": sum(r["dropped_link"] for r in rows),
            "dropped_rejected": sum(r["dropped_rejected"] for r in rows),
            "surplus": sum(r.get(SURPLUS, 0.0) for r in rows),  # runs before it had none
            "joules_per_client_round": (sum(r["joules"] for r in rows) / client_rounds
                                        if joules is not None and client_rounds else None),
            "joules_total": joules[-1] if joules else None,
            "joules_to_target": reached.joules if reached else None,
        }
        for key, columns, dense in TRAFFIC:
            sent = total(rows, columns)
            table[name][f"{key}_bytes"] = sent
            own = total(rows, dense)
            table[name][f"{key}_vs_dense"] = (own / sent if own is not None and sent else None)
    if dense_run is not None:
        for key, _, _ in TRAFFIC:
            base = table[dense_run][f"{key}_bytes"]
            for r in table.values():
                sent = r[f"{key}_bytes"]
                r[f"{key}_vs_dense"] = base / sent if base is not None and sent else None
    return table


def plot_virtual_time(runs: Mapping[str, str | Path], out: str | Path, title: str = "",
                      target: float | None = None) -> Path:
    """Write :func:`virtual_time_figure` to ``out``."""
    return save(virtual_time_figure(runs, title, target), out)


def virtual_time_figure(runs: Mapping[str, str | Path], title: str = "",
                        target: float | None = None) -> Figure:
    """Accuracy vs virtual time (with the ``target`` accuracy as a dashed line, each run's time
    to it marked), round durations, drops by cause and MB by direction (total included).

    ``title`` defaults to the methods and scenario (:func:`simulations.plots.scenario_title`).
    """
    fig, axes = plt.subplots(1, 5, figsize=(26, 5))
    ax_acc, ax_energy, ax_dur, ax_drop, ax_bytes = axes
    names, handles = list(runs), []
    drops, traffic = [], []
    for i, run_dir in enumerate(runs.values()):
        rows = read_rounds(Path(run_dir))
        t, color = virtual_times(rows), f"C{i}"
        (line,) = ax_acc.plot(t, [r["accuracy"] for r in rows], marker=".", color=color)
        handles.append(line)
        if target is not None and (hit := time_to_accuracy(rows, target)) is not None:
            ax_acc.axvline(hit, color=color, linestyle=":", linewidth=1)
        joules = cumulative_joules(rows)
        if joules is not None:
            ax_energy.plot(joules, [r["accuracy"] for r in rows], marker=".", color=color)
        ax_dur.plot([r["round"] for r in rows], [r["virtual_seconds"] for r in rows],
                    color=color)
        drops.append([sum(r.get(c, 0.0) for r in rows) for c in (*DROP_CAUSES, SURPLUS)])
        up, down = (sum(r[c] for r in rows) / 1e6 for c in ("uplink_bytes", "downlink_bytes"))
        bars = [up, down, up + down]
        if _has(rows, "wire_uplink_bytes"):
            w_up, w_down = (sum(r[c] for r in rows) / 1e6
                            for c in ("wire_uplink_bytes", "wire_downlink_bytes"))
            bars += [w_up, w_down, w_up + w_down]
        traffic.append(bars)
    if target is not None:
        ax_acc.axhline(target, color="0.4", linestyle="--", linewidth=1)
        ax_acc.annotate(f"target {target:.3f}", xy=(0.01, target), xycoords=("axes fraction",
                        "data"), xytext=(0, 3), textcoords="offset points", color="0.3",
                        fontsize=9)
    readable_log(ax_acc, "x")
    ax_acc.set(xlabel="virtual seconds (cumulative)", ylabel="test accuracy",
               title="accuracy vs emulated time" + ("" if target is None else
                                                    " (dotted: target reached)"))
    if ax_energy.lines:
        readable_log(ax_energy, "x")
        if target is not None:
            ax_energy.axhline(target, color="0.4", linestyle="--", linewidth=1)
    else:
        ax_energy.text(0.5, 0.5, "no energy recorded\n(emulated before issue 25)",
                       ha="center", va="center", transform=ax_energy.transAxes, color="0.4")
    ax_energy.set(xlabel="joules, all clients (cumulative)", ylabel="test accuracy",
                  title="accuracy vs energy")
    readable_log(ax_dur, "y")
    integer_rounds(ax_dur)
    ax_dur.set(xlabel="round", ylabel="virtual seconds", title="round duration")
    _grouped_bars(ax_drop, names, drops,
                  [*(c.replace("dropped_", "") for c in DROP_CAUSES), "surplus"], 0)
    ax_drop.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_drop.set(ylabel="clients", title="updates not aggregated: drops by cause, and surplus")
    labels = ["payload up", "payload down", "payload total"]
    if all(len(t) == 6 for t in traffic):  # every run recorded its link bytes
        labels += ["wire up", "wire down", "wire total"]
    else:
        traffic = [t[:3] for t in traffic]
    _grouped_bars(ax_bytes, names, traffic, labels, 3, log=True)
    ax_bytes.set(ylabel="MB", title="traffic by direction: payload and on the wire")
    for ax in axes:
        ax.grid(True, which="major", alpha=0.3)
    legend_below(fig, handles, names)
    fig.suptitle(title or scenario_title(runs.values(), names))
    return fig


def _grouped_bars(ax: Axes, names: Sequence[str], values: Sequence[Sequence[float]],
                  labels: Sequence[str], first_color: int, log: bool = False) -> None:
    """One group of bars per run (``values[run][bar]``), a legend of the bars above them;
    ``log``: a readable log scale (a bar of 0 is drawn at 1e-6)."""
    width = 0.8 / len(labels)
    for j, label in enumerate(labels):
        ax.bar([i + width * (j - (len(labels) - 1) / 2) for i in range(len(names))],
               [max(group[j], 1e-6) if log else group[j] for group in values], width=width,
               color=f"C{j + first_color}", label=label)
    if log:
        readable_log(ax, "y")
    ax.set_xticks(range(len(names)), names)
    for tick in ax.get_xticklabels():  # run names are long: slanted, they do not overlap
        tick.set_rotation(20)
        tick.set_horizontalalignment("right")
    # Room above the tallest bar for the legend, so that it covers no bar.
    top = max((v for group in values for v in group), default=0.0)
    ax.set_ylim(top=(top * 8 if log else top * 1.35) if top > 0 else 1.0)
    ax.legend(loc="upper center", ncol=min(len(labels), 3), frameon=False, fontsize=8)


def table_text(table: Mapping[str, Mapping[str, float | None]]) -> str:
    """The printed time-to-accuracy table: accuracy, time, what each run spent to the target
    (virtual seconds, wire MB, joules), drops, surplus, payload and wire MB both ways with their
    ratios to dense, joules per client-round. No cell says ``nan``: a run that never reached
    the target says "not reached", a value it did not record "n/a"."""
    def cell(value: float | None, scale: float = 1.0, digits: int = 2, missing: str = "n/a"
             ) -> str:
        return missing if value is None or not math.isfinite(value) \
            else f"{value / scale:.{digits}f}"

    def to_target(r: Mapping[str, float | None], key: str, scale: float, digits: int) -> str:
        if r["virtual_seconds_to_target"] is None:
            return NOT_REACHED
        return cell(r[key], scale, digits)

    head = (f"{'run':<12} {'final acc':>9} {'rounds':>6} {'virtual s total':>15} "
            f"{'s to target':>12} {'wire MB to tgt':>14} {'J to target':>12} "
            f"{'deadline':>8} {'link':>5} {'rejected':>8} {'surplus':>7} "
            f"{'up MB':>8} {'x dense':>7} {'down MB':>8} {'x dense':>7} "
            f"{'wire up':>8} {'x dense':>7} {'wire dn':>8} {'x dense':>7} {'x total':>7} "
            f"{'J/c-round':>9}")
    lines = [head]
    for name, r in table.items():
        lines.append(
            f"{name:<12} {cell(r['final_accuracy'], 1, 4):>9} {r['rounds']:6.0f} "
            f"{cell(r['virtual_seconds'], 1, 1):>15} "
            f"{to_target(r, 'virtual_seconds_to_target', 1, 1):>12} "
            f"{to_target(r, 'wire_bytes_to_target', 1e6, 3):>14} "
            f"{to_target(r, 'joules_to_target', 1, 0):>12} "
            f"{r['dropped_deadline']:8.0f} {r['dropped_link']:5.0f} "
            f"{r['dropped_rejected']:8.0f} {r['surplus']:7.0f} "
            f"{cell(r['uplink_bytes'], 1e6, 3):>8} "
            f"{cell(r['uplink_vs_dense'], 1, 1):>7} "
            f"{cell(r['downlink_bytes'], 1e6):>8} {cell(r['downlink_vs_dense'], 1, 1):>7} "
            f"{cell(r['wire_uplink_bytes'], 1e6, 3):>8} "
            f"{cell(r['wire_uplink_vs_dense'], 1, 1):>7} {cell(r['wire_downlink_bytes'], 1e6):>8} "
            f"{cell(r['wire_downlink_vs_dense'], 1, 1):>7} "
            f"{cell(r['wire_total_vs_dense'], 1, 1):>7} "
            f"{cell(r['joules_per_client_round'], 1, 1):>9}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: plot runs and print the time-to-accuracy table."""
    p = argparse.ArgumentParser(prog="python -m simulations.netem.report",
                                description=__doc__.split("\n")[0])
    p.add_argument("out", help="PNG file to write")
    p.add_argument("runs", nargs="+", metavar="NAME=RUN_DIR")
    p.add_argument("--set", action="append", default=[], metavar=f"{TARGET_KEY}=ACC",
                   help="the target accuracy of the 'to target' columns (default: the key the "
                        "runs were made with, else the dense run's last-10 accuracy, else the "
                        "first run's)")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    runs = {}
    for item in args.runs:
        name, sep, path = item.partition("=")
        if not sep or not Path(path, "rounds.csv").exists():
            print(f"error: {item!r} must be NAME=RUN_DIR with a rounds.csv", file=sys.stderr)
            return 2
        runs[name] = path
    try:
        target = _target_set(args.set)
        value, how = run_target(runs, target)
        table = summarize_runs(runs, value)
        plot_virtual_time(runs, args.out, args.title, value)
    except NetemError as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2
    print(table_text(table))
    print(f"target accuracy {value:.4f} ({how}); plot: {args.out}")
    return 0


def _target_set(items: Sequence[str]) -> float | None:
    """The value of ``--set netem.target_accuracy=ACC`` (None when not given); any other key,
    or a value outside (0, 1], is a NetemError naming it."""
    target = None
    for item in items:
        key, sep, value = item.partition("=")
        if key.strip() != TARGET_KEY or not sep:
            raise NetemError(f"--set takes {TARGET_KEY}=ACC only (the report reads finished "
                             f"runs), got {item!r}")
        try:
            target = float(value)
        except ValueError:
            target = math.nan
        if not 0 < target <= 1:
            raise NetemError(f"{TARGET_KEY} must be an accuracy in (0, 1], got {value!r}")
    return target


if __name__ == "__main__":
    sys.exit(main())
