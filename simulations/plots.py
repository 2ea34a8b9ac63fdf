"""PNG plots of results: accuracy against cumulative MB (log x), and bytes per round."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only; no display on servers and CI

import matplotlib.pyplot as plt  # noqa: E402

from server.results import read_rounds  # noqa: E402


def _curves(ax_acc, ax_bytes, label: str, rows: Sequence[Mapping[str, float]]) -> None:
    cumulative_mb, total = [], 0.0
    for r in rows:
        total += r["uplink_bytes"]
        cumulative_mb.append(total / 1e6)
    ax_acc.plot(cumulative_mb, [r["accuracy"] for r in rows], marker=".", label=label)
    ax_bytes.plot([r["round"] for r in rows], [max(r["uplink_bytes"], 1.0) for r in rows],
                  label=f"{label} uplink")


def _label(ax, log: str, xlabel: str, ylabel: str) -> None:
    """Axis labels, a log scale on axis ``log`` ("x" or "y"), grid and legend."""
    (ax.set_xscale if log == "x" else ax.set_yscale)("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def _save(fig, out: str | Path) -> Path:
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_runs(runs: Mapping[str, str | Path], out: str | Path, title: str = "") -> Path:
    """One figure for several runs (name -> run folder): the two panels side by side."""
    fig, (ax_acc, ax_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, run_dir in runs.items():
        _curves(ax_acc, ax_bytes, name, read_rounds(Path(run_dir)))
    _label(ax_acc, "x", "cumulative uplink (MB, log scale)", "test accuracy")
    _label(ax_bytes, "y", "round", "uplink bytes per round (log scale)")
    if title:
        fig.suptitle(title)
    return _save(fig, out)


def plot_run(run_dir: str | Path) -> Path:
    """``<run_dir>/plots.png`` for a single run."""
    run_dir = Path(run_dir)
    return plot_runs({run_dir.name: run_dir}, run_dir / "plots.png", title=str(run_dir))


def plot_bands(runs: Mapping[str, Sequence[str | Path]], out: str | Path, title: str = "") -> Path:
    """Accuracy against cumulative total MB (uplink + downlink), one band per method.

    ``runs`` maps a method to its run folders, one per seed. Per round, the line is the mean
    accuracy over the seeds at their mean cumulative total MB; the band is +- one standard
    deviation of the accuracy (none for a single seed). Runs of unequal length are cut to the
    shortest.
    """
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, dirs in runs.items():
        curves = [read_rounds(Path(d)) for d in dirs]
        n = min(len(c) for c in curves)
        acc = np.array([[r["accuracy"] for r in c[:n]] for c in curves])
        mb = np.array([np.cumsum([r["uplink_bytes"] + r["downlink_bytes"] for r in c[:n]])
                       for c in curves]) / 1e6
        x, mean = mb.mean(axis=0), acc.mean(axis=0)
        (line,) = ax.plot(x, mean, label=f"{name} ({len(curves)} seeds)")
        if len(curves) > 1:
            std = acc.std(axis=0, ddof=1)
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.25,
                            linewidth=0)
    _label(ax, "x", "cumulative total traffic, uplink + downlink (MB, log scale)",
           "test accuracy (mean +- std over seeds)")
    if title:
        ax.set_title(title)
    return _save(fig, out)
