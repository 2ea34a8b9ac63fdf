"""Time, wire bytes and joules to a target accuracy, read from a run's rows of ``rounds.csv``.

One reading for ``summary.json`` (:class:`~simulations.netem.extension.NetemClock`,
:class:`~simulations.netem.wire_columns.WireColumns`), ``compare`` (:mod:`simulations.cli`) and
the report (:mod:`simulations.netem.report`), whatever drove the run: each row is one model the
server applied (a synchronous round; an asynchronous server step when there is one), and its
``virtual_seconds`` the emulated time since the previous row (the clients' part and the
server's). A run reaches ``target`` at the first row whose accuracy is at or above it; what it
spent until then is the sum of that row and every row before it:

- ``virtual_s``: virtual seconds (``virtual_seconds``);
- ``wire_bytes``: bytes on the clients' links both ways (``wire_uplink_bytes`` +
  ``wire_downlink_bytes``; None when the run has no wire columns);
- ``joules``: the working clients' and the idle online nodes' joules (``joules`` +
  ``idle_joules``; None without energy columns).

``netem.target_accuracy`` names the target; 0 derives it (:func:`derived_target`): the last-10
accuracy of the comparison's dense FedAvg run, where dense ends, or the first run's without one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from server.results import last_mean

__all__ = ["NOT_REACHED", "TARGET_KEY", "Reached", "derived_target", "reach_target",
           "target_of", "virtual_times"]

Row = Mapping[str, float]
#: How a table says that a run never reached the target (never ``nan``).
NOT_REACHED = "not reached"
#: The one key of every "to target" reading.
TARGET_KEY = "netem.target_accuracy"


@dataclass(frozen=True)
class Reached:
    """Where a run first stood at or above the target: its row (1-based) and what it spent."""

    row: int
    virtual_s: float
    wire_bytes: float | None
    joules: float | None


def _number(row: Row, key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def virtual_times(rows: Sequence[Row]) -> list[float]:
    """Cumulative virtual seconds at the end of each row (a row without a finite
    ``virtual_seconds`` adds nothing)."""
    out, t = [], 0.0
    for r in rows:
        t += _number(r, "virtual_seconds") or 0.0
        out.append(t)
    return out


def reach_target(rows: Sequence[Row], target: float) -> Reached | None:
    """The first row at or above ``target`` and what the run spent until it (module
    docstring); None when no row is."""
    seconds = 0.0
    wire: float | None = 0.0 if rows and all(
        _number(r, "wire_uplink_bytes") is not None for r in rows) else None
    joules: float | None = 0.0 if rows and all(
        _number(r, "joules") is not None for r in rows) else None
    for i, r in enumerate(rows):
        seconds += _number(r, "virtual_seconds") or 0.0
        if wire is not None:
            wire += (_number(r, "wire_uplink_bytes") or 0.0) + (
                _number(r, "wire_downlink_bytes") or 0.0)
        if joules is not None:
            joules += (_number(r, "joules") or 0.0) + (_number(r, "idle_joules") or 0.0)
        accuracy = _number(r, "accuracy")
        if accuracy is not None and accuracy >= target:
            return Reached(i + 1, seconds, wire, joules)
    return None


def derived_target(runs: Mapping[str, Sequence[Row]], baseline: str | None) -> tuple[float, str]:
    """``(target, how it was derived)`` for ``netem.target_accuracy = 0``: the last-10 mean
    accuracy of run ``baseline`` (dense FedAvg's) when it is among ``runs``, else of the first
    run (``runs`` maps a name to its rows)."""
    if not runs:
        raise ValueError("derived_target needs at least one run")
    name = baseline if baseline in runs else next(iter(runs))
    accuracies = [r.get("accuracy", math.nan) for r in runs[name]]
    whose = "dense FedAvg's" if name == baseline else f"{name}'s (no dense run)"
    return last_mean([float(a) for a in accuracies]), f"{whose} last-10 accuracy"


def target_of(summaries: Mapping[str, Mapping[str, Any]]) -> float:
    """The ``netem.target_accuracy`` runs were made with (their ``summary.json``'s ``netem``
    settings; ``summaries`` maps a name to one), 0 when none named one (derive it).

    Raises
    ------
    ValueError
        The runs were made with different targets (named, with theirs).
    """
    given = {}
    for name, summary in summaries.items():
        netem = summary.get("netem")
        value = netem.get(TARGET_KEY) if isinstance(netem, Mapping) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            given[name] = float(value)
    if len(set(given.values())) > 1:
        raise ValueError(f"the runs were made with different {TARGET_KEY}: {given}; name one "
                         f"(--set {TARGET_KEY}=ACC)")
    return next(iter(given.values()), 0.0)
