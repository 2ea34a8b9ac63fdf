"""Reports of emulated runs: accuracy against virtual time, time to accuracy, drops, bytes.

``python -m simulations.netem.report OUT.png NAME=RUN_DIR [NAME=RUN_DIR ...] [--target ACC]``
plots accuracy against cumulative virtual seconds for each run (e.g. dense FedAvg and DGC under
a mobile mix), the per-round virtual duration, drops by cause and bytes by direction, and prints
the time-to-accuracy table (target: the first run's final accuracy unless ``--target``).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI

import matplotlib.pyplot as plt  # noqa: E402

from server.results import read_rounds  # noqa: E402
from simulations.netem.errors import NetemError  # noqa: E402


def virtual_times(rows: Sequence[Mapping[str, float]]) -> list[float]:
    """Cumulative virtual seconds at the end of each round."""
    out, t = [], 0.0
    for r in rows:
        if "virtual_seconds" not in r:
            raise NetemError("rounds.csv has no virtual_seconds column: the run was not "
                             "emulated (set netem.enabled=true)")
        t += r["virtual_seconds"]
        out.append(t)
    return out


def time_to_accuracy(rows: Sequence[Mapping[str, float]], target: float) -> float | None:
    """Virtual seconds until the accuracy first reached ``target`` (None: never)."""
    for t, r in zip(virtual_times(rows), rows, strict=True):
        if math.isfinite(r["accuracy"]) and r["accuracy"] >= target:
            return t
    return None


def summarize_runs(runs: Mapping[str, str | Path], target: float | None = None
                   ) -> dict[str, dict[str, float | None]]:
    """Per run: final accuracy, virtual seconds, time to ``target``, drops and bytes."""
    table: dict[str, dict[str, float | None]] = {}
    rows_of = {name: read_rounds(Path(d)) for name, d in runs.items()}
    if target is None:
        first = next(iter(rows_of.values()))
        target = first[-1]["accuracy"]
    for name, rows in rows_of.items():
        table[name] = {
            "final_accuracy": rows[-1]["accuracy"],
            "rounds": len(rows),
            "virtual_seconds": virtual_times(rows)[-1],
            "target_accuracy": target,
            "virtual_seconds_to_target": time_to_accuracy(rows, target),
            "dropped_deadline": sum(r["dropped_deadline"] for r in rows),
            "dropped_link": sum(r["dropped_link"] for r in rows),
            "dropped_rejected": sum(r["dropped_rejected"] for r in rows),
            "uplink_bytes": sum(r["uplink_bytes"] for r in rows),
            "downlink_bytes": sum(r["downlink_bytes"] for r in rows),
        }
    return table


def plot_virtual_time(runs: Mapping[str, str | Path], out: str | Path, title: str = "") -> Path:
    """Accuracy vs virtual time, round durations, drops by cause and bytes by direction."""
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    ax_acc, ax_dur, ax_drop, ax_bytes = axes
    names = list(runs)
    for i, (name, run_dir) in enumerate(runs.items()):
        rows = read_rounds(Path(run_dir))
        t = virtual_times(rows)
        ax_acc.plot(t, [r["accuracy"] for r in rows], marker=".", label=name)
        ax_dur.plot([r["round"] for r in rows], [r["virtual_seconds"] for r in rows], label=name)
        for j, cause in enumerate(("dropped_deadline", "dropped_link", "dropped_rejected")):
            ax_drop.bar(i + 0.25 * (j - 1), sum(r[cause] for r in rows), width=0.25,
                        color=f"C{j}", label=cause.replace("dropped_", "") if i == 0 else None)
        for j, col in enumerate(("uplink_bytes", "downlink_bytes")):
            ax_bytes.bar(i + 0.35 * (j - 0.5), max(1.0, sum(r[col] for r in rows)) / 1e6,
                         width=0.35, color=f"C{j + 3}",
                         label=col.split("_")[0] if i == 0 else None)
    ax_acc.set(xscale="log", xlabel="virtual seconds (cumulative)", ylabel="test accuracy",
               title="accuracy vs emulated time")
    ax_dur.set(xlabel="round", ylabel="virtual seconds", yscale="log",
               title="round duration")
    ax_drop.set(xticks=range(len(names)), xticklabels=names, ylabel="clients",
                title="dropped updates by cause")
    ax_bytes.set(xticks=range(len(names)), xticklabels=names, ylabel="MB", yscale="log",
                 title="bytes by direction")
    for ax in (ax_drop, ax_bytes):  # run names are long: slanted, they do not overlap
        ax.tick_params(axis="x", labelrotation=20)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: plot runs and print the time-to-accuracy table."""
    p = argparse.ArgumentParser(prog="python -m simulations.netem.report",
                                description=__doc__.split("\n")[0])
    p.add_argument("out", help="PNG file to write")
    p.add_argument("runs", nargs="+", metavar="NAME=RUN_DIR")
    p.add_argument("--target", type=float, default=None,
                   help="accuracy for the time-to-accuracy column (default: the first run's "
                        "final accuracy)")
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
        table = summarize_runs(runs, args.target)
        plot_virtual_time(runs, args.out, args.title)
    except NetemError as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2
    print(f"{'run':<12} {'final acc':>9} {'rounds':>6} {'virtual s':>10} {'s to target':>12} "
          f"{'deadline':>8} {'link':>5} {'rejected':>8} {'up MB':>8} {'down MB':>8}")
    for name, r in table.items():
        tt = r["virtual_seconds_to_target"]
        print(f"{name:<12} {r['final_accuracy']:9.4f} {r['rounds']:6.0f} "
              f"{r['virtual_seconds']:10.1f} {'never' if tt is None else f'{tt:.1f}':>12} "
              f"{r['dropped_deadline']:8.0f} {r['dropped_link']:5.0f} "
              f"{r['dropped_rejected']:8.0f} {r['uplink_bytes'] / 1e6:8.2f} "
              f"{r['downlink_bytes'] / 1e6:8.2f}")
    print(f"target accuracy {next(iter(table.values()))['target_accuracy']:.4f}; plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
