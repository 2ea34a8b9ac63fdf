"""PNG plots of results: accuracy against cumulative MB (total and uplink), and MB per round.

Every figure is titled with its methods and scenario (read from the runs' ``summary.json``),
shows total traffic (uplink + downlink: the downlink is most of the bytes), labels log axes in
plain numbers (0.05, 1, 20 MB; 5 kB), rounds as integers, and keeps its legend off the data
(one legend for the runs, under the panels, as many rows as it needs). A comparison of many
methods stays readable: every method has its own colour, a method family
(``fedgc.methods.Method.family``) shades of one hue, its methods also told apart by line style,
and the legend lists them family by family (:func:`method_styles`). :func:`readable_log` and
:func:`integer_rounds` are shared with the network emulator's report
(``simulations.netem.report``).
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only; no display on servers and CI

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import (  # noqa: E402
    EngFormatter,
    FuncFormatter,
    LogLocator,
    MaxNLocator,
    NullFormatter,
)

from server.results import read_rounds  # noqa: E402
from simulations.compare import by_family, family_of  # noqa: E402
from simulations.netem.target import reach_target, virtual_times  # noqa: E402

__all__ = ["family_sizes", "integer_rounds", "legend_below", "method_styles", "plot_bands",
           "plot_run", "plot_runs", "readable_log", "runs_figure", "save", "scenario_title"]

#: Line styles of a family's methods, in the order they come; a fifth and later also get a
#: marker.
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v")
#: Family colours (matplotlib's tab10 without its grey); the family of the baseline (dense
#: FedAvg) is drawn in black and greys, a tenth family on takes tab20's lighter tones.
_COLOURS = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C8", "C9")
#: Height of a legend row, in inches (10-point text and its spacing).
_LEGEND_ROW_IN = 0.26


def _plain(value: float, _pos: object = None) -> str:
    """0.05, 1, 20, 1500: the shortest plain form (never 1.1x10^0)."""
    return f"{value:.6g}" if value < 1e6 else f"{value:,.0f}"


def readable_log(ax: Axes, axis: str = "x", unit: str = "") -> None:
    """A log scale on ``axis`` ("x" or "y") with ticks at 1, 2 and 5 per decade, labelled in
    plain numbers, or with SI prefixes when ``unit`` is given (``"B"``: 5 kB, 2 MB); the minor
    ticks stay unlabelled, so that a narrow range shows no "1.1x10^0". Call it after plotting:
    a range of more than three decades gets a tick per decade only."""
    target = ax.xaxis if axis == "x" else ax.yaxis
    (ax.set_xscale if axis == "x" else ax.set_yscale)("log")
    low, high = ax.dataLim.intervalx if axis == "x" else ax.dataLim.intervaly
    # Over more than three decades 2 and 5 crowd the labels: decades only.
    wide = low > 0 and high / low > 1e3
    target.set_major_locator(LogLocator(base=10, subs=(1.0,) if wide else (1.0, 2.0, 5.0)))
    target.set_major_formatter(EngFormatter(unit=unit, places=0) if unit
                               else FuncFormatter(_plain))
    target.set_minor_formatter(NullFormatter())


def integer_rounds(ax: Axes) -> None:
    """Round numbers on the x axis: integers only, at most ~10 ticks."""
    ax.xaxis.set_major_locator(MaxNLocator(nbins=10, integer=True, min_n_ticks=1))


def legend_below(fig: Figure, handles: Sequence[Any], labels: Sequence[str],
                 max_columns: int = 6, groups: Sequence[int] = ()) -> float:
    """One legend for the whole figure, under its panels (it covers no data), in rows of at
    most ``max_columns`` entries; returns the fraction of the figure's height it needs (pass it
    to :func:`save` as ``legend_room``).

    ``groups``: the sizes of consecutive groups of entries (a family's methods); when there are
    at most ``max_columns`` groups of at most 4 entries, each group gets a column of its own.
    """
    handles, labels = list(handles), list(labels)
    if groups and sum(groups) == len(labels) and len(groups) <= max_columns \
            and 1 < max(groups) <= 4:
        rows, at = max(groups), 0
        padded_h: list[Any] = []
        padded_l: list[str] = []
        for size in groups:  # matplotlib fills a legend column by column
            padded_h += handles[at:at + size] + [Line2D([], [], alpha=0)] * (rows - size)
            padded_l += labels[at:at + size] + [""] * (rows - size)
            at += size
        handles, labels, columns = padded_h, padded_l, len(groups)
    else:
        columns = max(1, min(len(labels), max_columns))
        rows = math.ceil(len(labels) / columns) if labels else 0
    fig.legend(handles, labels, loc="lower center", ncol=columns, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    return min(0.45, (rows * _LEGEND_ROW_IN + 0.15) / fig.get_figheight())


def family_sizes(styles: Mapping[str, Mapping[str, Any]]) -> list[int]:
    """The sizes of the consecutive families of :func:`method_styles`' order (for
    :func:`legend_below`'s ``groups``)."""
    sizes: list[int] = []
    last = None
    for style in styles.values():
        if style["family"] != last:
            sizes.append(0)
            last = style["family"]
        sizes[-1] += 1
    return sizes


def method_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """A ``color``, ``linestyle`` and ``marker`` per method, and the order in which a legend
    lists them (the dict's): family by family, families in the order of their first method.

    Every method has a colour of its own: a family (``Method.family``; a method without one,
    or one this process does not know, is a family of its own) takes shades of one hue (its
    first method the family colour, the next ones darker, then lighter), greys from black for
    the baseline's (dense FedAvg); its methods also take the line styles ``-``, ``--``, ``:``,
    ``-.`` in turn, and a marker from the fifth on. Each style also names its ``family``.
    """
    families: dict[str, list[str]] = {}
    black: set[str] = set()
    for name in by_family(names):
        family, is_baseline = family_of(name)
        families.setdefault(family, []).append(name)
        if is_baseline:
            black.add(family)
    out: dict[str, dict[str, Any]] = {}
    colours = iter([*_COLOURS, *(plt.get_cmap("tab20")(i) for i in range(1, 20, 2))] * 4)
    for family, members in families.items():
        base = (0.0, 0.0, 0.0) if family in black else to_rgb(next(colours))
        for i, name in enumerate(members):
            out[name] = {"color": _shade(base, i, family in black),
                         "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
                         "marker": _MARKERS[(i // len(_LINESTYLES) - 1) % len(_MARKERS)]
                         if i >= len(_LINESTYLES) else None, "family": family}
    return out


#: How far a family's later methods move from its colour: towards black, then towards white
#: (a light shade stays visible on white; greys for the baseline only lighten).
_SHADES = (0.0, -0.4, 0.4, 0.65, -0.6, 0.25, -0.2)


def _shade(base: tuple[float, float, float], i: int, grey: bool) -> tuple[float, ...]:
    """The colour of a family's ``i``-th method: ``base`` darkened or lightened, same hue."""
    t = abs(_SHADES[i % len(_SHADES)]) * 0.9 if grey else _SHADES[i % len(_SHADES)]
    if t < 0:
        return tuple(c * (1 + t) for c in base)
    return tuple(c + (1 - c) * t for c in base)


def _line(style: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``plot`` in a :func:`method_styles` style."""
    return {k: style[k] for k in ("color", "linestyle", "marker")}


def _summary(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def scenario_title(run_dirs: Iterable[str | Path], methods: Sequence[str] = ()) -> str:
    """"dense vs dgc on digits: 6 clients, 3 per round, iid, 12 rounds, density 0.001".

    Read from the first run's ``summary.json`` (its ``config``); ``methods`` default to those
    of the runs. Empty where no run has a summary (a plot of bare ``rounds.csv`` files).
    """
    summaries = [s for s in (_summary(Path(d)) for d in run_dirs) if s]
    if not summaries:
        return ""
    c = summaries[0].get("config", {})
    methods = list(methods) or list(dict.fromkeys(s.get("label", s.get("method", "?"))
                                                  for s in summaries))
    # More than a few names make a title of several lines: the legend lists them.
    who = " vs ".join(methods) if len(methods) <= 4 else f"{len(methods)} methods"
    parts = [f"{c.get('num_clients', '?')} clients, {c.get('clients_per_round', '?')} per "
             f"round"]
    partition = c.get("partition")
    if partition:
        parts.append(f"Dirichlet({c.get('alpha')})" if partition == "dirichlet" else partition)
    parts.append(f"{summaries[0].get('rounds', c.get('rounds', '?'))} rounds")
    densities = sorted({s["density"] for s in summaries
                        if isinstance(s.get("density"), (int, float)) and s["density"] < 1})
    if densities:
        parts.append("density " + ", ".join(f"{d:g}" for d in densities))
    if c.get("downlink_density", 1.0) < 1.0:
        parts.append(f"downlink density {c['downlink_density']:g}")
    netem = summaries[0].get("netem") or {}
    if netem.get("netem.enabled"):
        deadline = netem.get("netem.deadline_s")
        # 0 (the default) means none: the round waits for its K, or for every client.
        deadline = (f"deadline {deadline:g} s" if isinstance(deadline, (int, float))
                    and deadline > 0 else "no deadline")
        parts.append(f"links {netem.get('netem.mix')}, {deadline}")
    task = c.get("task", summaries[0].get("task", "?"))
    return f"{who} on {task}: {', '.join(parts)}"


def _label(run_dir: str | Path, name: str) -> str:
    """How a run's method is named in a legend: its summary's label (a method of the user's
    own is named ``module:callable``), else ``name``."""
    summary = _summary(Path(run_dir))
    return str(summary["label"]) if summary.get("method") == name and "label" in summary \
        else name


def _cumulative_mb(rows: Sequence[Mapping[str, float]], *columns: str) -> np.ndarray:
    return np.cumsum([sum(r[c] for c in columns) for r in rows]) / 1e6


def plot_runs(runs: Mapping[str, str | Path], out: str | Path, title: str = "",
              target: float | None = None) -> Path:
    """Write :func:`runs_figure` to ``out``."""
    return save(runs_figure(runs, title, target), out)


def _recorded(rows: Sequence[Mapping[str, float]], column: str) -> bool:
    return bool(rows) and all(math.isfinite(r.get(column, math.nan)) for r in rows)


def runs_figure(runs: Mapping[str, str | Path], title: str = "",
                target: float | None = None) -> Figure:
    """One figure for several runs (name -> run folder): accuracy against cumulative total MB
    (uplink + downlink), accuracy against cumulative uplink MB, and the MB of each round both
    ways (uplink a line, downlink thick and pale), all as fedgc's payload. Runs under the network
    emulator add the link's bytes (thin pale lines of the run's style in the panels above, gid
    ``wire``: Flower's protocol, HTTP, TLS and TCP/IP with ``netem.protocol``), a panel of
    accuracy against cumulative virtual seconds (with ``target`` as a dashed line and each
    run's first reaching it as a dotted one) and one of accuracy against cumulative joules.
    ``title`` defaults to :func:`scenario_title`."""
    loaded = {name: read_rounds(Path(d)) for name, d in runs.items()}
    wire = any(_recorded(rows, "wire_uplink_bytes") for rows in loaded.values())
    emulated = any(_recorded(rows, "virtual_seconds") for rows in loaded.values())
    panels = 3 + emulated + wire
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels + 0.5, 5))
    ax_total, ax_up, ax_bytes = axes[:3]
    ax_time = axes[3] if emulated else None
    ax_energy = axes[-1] if wire else None
    styles = method_styles(list(runs))
    handles = {}
    for name, rows in loaded.items():
        style, acc = _line(styles[name]), [r["accuracy"] for r in rows]
        if style["marker"] is None and len(rows) <= 50:
            style["marker"] = "."  # a dot per round, while they stay apart
        (line,) = ax_total.plot(_cumulative_mb(rows, "uplink_bytes", "downlink_bytes"), acc,
                                **style)
        ax_up.plot(_cumulative_mb(rows, "uplink_bytes"), acc, **style)
        rounds = [r["round"] for r in rows]
        # A round that sent nothing (every client failed) sits at 1 byte, on the log axis.
        plain = {"color": style["color"], "linestyle": style["linestyle"]}
        ax_bytes.plot(rounds, [max(r["uplink_bytes"], 1.0) for r in rows], **plain)
        ax_bytes.plot(rounds, [max(r["downlink_bytes"], 1.0) for r in rows], **plain,
                      linewidth=4, alpha=0.3)
        if _recorded(rows, "wire_uplink_bytes"):
            # The method's colour and line style, thin and pale: the same run on the wire.
            thin = {**plain, "linewidth": 0.8, "alpha": 0.6, "gid": "wire"}
            ax_total.plot(_cumulative_mb(rows, "wire_uplink_bytes", "wire_downlink_bytes"), acc,
                          **thin)
            ax_up.plot(_cumulative_mb(rows, "wire_uplink_bytes"), acc, **thin)
            ax_bytes.plot(rounds, [max(r["wire_uplink_bytes"], 1.0) for r in rows], **thin)
        if ax_time is not None and _recorded(rows, "virtual_seconds"):
            ax_time.plot(virtual_times(rows), acc, **style)
            reached = reach_target(rows, target) if target is not None else None
            if reached is not None:
                ax_time.axvline(reached.virtual_s, color=style["color"], linestyle=":",
                                linewidth=1)
        if ax_energy is not None and _recorded(rows, "joules"):
            joules = np.cumsum([r["joules"] + (r["idle_joules"] if math.isfinite(
                r.get("idle_joules", math.nan)) else 0.0) for r in rows])
            ax_energy.plot(joules, acc, **style)
        handles[name] = line
    readable_log(ax_total, "x")
    wire_note = " (thin, pale: on the wire)" if wire else ""
    ax_total.set(xlabel="cumulative total traffic, uplink + downlink (MB)",
                 ylabel="test accuracy", title="accuracy vs total traffic" + wire_note)
    readable_log(ax_up, "x")
    ax_up.set(xlabel="cumulative uplink (MB)", ylabel="test accuracy",
              title="accuracy vs uplink" + wire_note)
    readable_log(ax_bytes, "y", unit="B")
    integer_rounds(ax_bytes)
    ax_bytes.set(xlabel="round", ylabel="bytes per round", title="traffic per round")
    keys = [Line2D([], [], color="0.3"), Line2D([], [], color="0.3", linewidth=4, alpha=0.3)]
    names = ["payload uplink", "payload downlink"]
    if wire:
        keys.append(Line2D([], [], color="0.3", linewidth=0.8, alpha=0.6))
        names.append("uplink on the wire (thin, pale)")
    ax_bytes.legend(keys, names, loc="best")
    if ax_time is not None:
        readable_log(ax_time, "x")
        if target is not None:
            ax_time.axhline(target, color="0.4", linestyle="--", linewidth=1)
        ax_time.set(xlabel="virtual seconds (cumulative)", ylabel="test accuracy",
                    title="accuracy vs emulated time" + (
                        "" if target is None else f" (target {target:.3f}; dotted: reached)"))
    if ax_energy is not None:
        readable_log(ax_energy, "x")
        ax_energy.set(xlabel="joules, all clients (cumulative)", ylabel="test accuracy",
                      title="accuracy vs energy")
    for ax in axes:
        ax.grid(True, which="major", alpha=0.3)
    labels = {name: _label(d, name) for name, d in runs.items()}
    fig.legend_room = legend_below(  # type: ignore[attr-defined]
        fig, [handles[n] for n in styles], [labels[n] for n in styles],
        groups=family_sizes(styles))
    fig.suptitle(textwrap.fill(title or scenario_title(runs.values(), list(labels.values())),
                               110))
    return fig


def save(fig: Figure, out: str | Path, legend_room: float | None = None) -> Path:
    """Lay out ``fig`` (``legend_room``: the bottom fraction kept for :func:`legend_below`;
    default: what the figure's legend asked for, else 0.07), write it as a PNG (creating the
    folder) and close it."""
    if legend_room is None:
        legend_room = getattr(fig, "legend_room", 0.07)
    fig.tight_layout(rect=(0, legend_room, 1, 1))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_run(run_dir: str | Path) -> Path:
    """``<run_dir>/plots.png`` for a single run, named by its method's label."""
    run_dir = Path(run_dir)
    summary = _summary(run_dir)
    name = summary.get("label", summary.get("method", run_dir.name))
    return plot_runs({name: run_dir}, run_dir / "plots.png")


def plot_bands(runs: Mapping[str, Sequence[str | Path]], out: str | Path, title: str = "") -> Path:
    """Accuracy against cumulative total MB (uplink + downlink), one band per method.

    ``runs`` maps a method to its run folders, one per seed. Per round, the line is the mean
    accuracy over the seeds at their mean cumulative total MB; the band is +- one standard
    deviation of the accuracy (none for a single seed). Runs of unequal length are cut to the
    shortest. ``title`` defaults to :func:`scenario_title`.
    """
    fig, ax = plt.subplots(figsize=(9, 5.5))
    styles = method_styles(list(runs))
    counts = {len(d) for d in runs.values()}
    handles = {}
    for name, dirs in runs.items():
        curves = [read_rounds(Path(d)) for d in dirs]
        n = min(len(c) for c in curves)
        acc = np.array([[r["accuracy"] for r in c[:n]] for c in curves])
        mb = np.array([_cumulative_mb(c[:n], "uplink_bytes", "downlink_bytes") for c in curves])
        x, mean = mb.mean(axis=0), acc.mean(axis=0)
        label = _label(dirs[0], name) if dirs else name
        if len(counts) > 1:  # the title says the count when every method has the same
            label += f" ({len(curves)} seed{'s' if len(curves) != 1 else ''})"
        style = _line(styles[name])
        (line,) = ax.plot(x, mean, label=label, **style,
                          markevery=max(1, n // 8) if style["marker"] else None)
        if len(curves) > 1:
            std = acc.std(axis=0, ddof=1)
            # Many bands over each other hide the lines: fainter the more there are.
            ax.fill_between(x, mean - std, mean + std, color=line.get_color(),
                            alpha=0.25 if len(runs) <= 5 else 0.12, linewidth=0)
        handles[name] = line
    readable_log(ax, "x")
    ax.set(xlabel="cumulative total traffic, uplink + downlink (MB)",
           ylabel="test accuracy (mean +- std over seeds)")
    ax.grid(True, which="major", alpha=0.3)
    room = legend_below(fig, [handles[n] for n in styles],
                        [handles[n].get_label() for n in styles], max_columns=6,
                        groups=family_sizes(styles))
    first = [Path(d[0]) for d in runs.values() if d]
    seeds = max(counts, default=0)
    ax.set_title(textwrap.fill(title or f"{scenario_title(first, list(runs))}; "
                                        f"{seeds} seed{'s' if seeds != 1 else ''}", 90))
    return save(fig, out, legend_room=room)
