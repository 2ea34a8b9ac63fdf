"""A captured round's time split into compute, transfer and orchestration.

For each round of a deployment with ``--capture``: the server's round time (``wall_seconds``
of ``rounds.csv``: from sending the train messages to the evaluated model), the client whose
reply came last (the one the round waited for), its training seconds (``compute_seconds`` of
``clients.csv``), and its transfer seconds on the link (from the capture: the span of the RPCs
that fetched its message plus the span of those that pushed its reply, round trips included).
Orchestration is the rest: the message waiting for the node's next poll, the ClientApp's
start-up, the server's own work and its waiting for replies.
"""

from __future__ import annotations

import csv
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _rows(path: Path) -> list[dict[str, str]]:
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            return list(csv.DictReader(fh))
    except FileNotFoundError:
        return []


def round_split(run_dir: Path, ledger: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per round: ``wall_s``, and of its critical client ``compute_s``, ``transfer_s``,
    ``startup_s`` (ClientApp runtime less training) and ``orchestration_s``; ``gap_s`` is the
    time from the round's last reply on the link to the next round's first message on it."""
    wall = {int(r["round"]): float(r["wall_seconds"]) for r in _rows(run_dir / "rounds.csv")}
    nodes: dict[tuple[int, int], float] = {}
    for r in _rows(run_dir / "clients.csv"):
        if r.get("compute_seconds"):
            # clients.csv names clients by key; a deployment's key is its node index.
            nodes[(int(r["round"]), int(r["client_key"]))] = float(r["compute_seconds"])
    timeline = [t for t in ledger.get("timeline", []) if "up_end" in t and "down_start" in t]
    out = []
    for rnd in sorted(wall):
        rows = [t for t in timeline if t["round"] == rnd]
        if not rows:
            continue
        last = max(rows, key=lambda t: t["up_end"])
        compute = nodes.get((rnd, int(last["node"])), 0.0)
        transfer = (last["down_end"] - last["down_start"]) + (last["up_end"] - last["up_start"])
        runtime = last.get("clientapp_runtime_s")
        later = [t["down_start"] for t in timeline if t["round"] == rnd + 1]
        out.append({
            "round": rnd, "node": int(last["node"]), "wall_s": wall[rnd], "compute_s": compute,
            "transfer_s": transfer, "orchestration_s": wall[rnd] - compute - transfer,
            "startup_s": None if runtime is None else max(0.0, runtime - compute),
            "gap_s": min(later) - max(t["up_end"] for t in rows) if later else None,
        })
    return out


def mean_split(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per round of each part (empty when there are no rounds)."""
    if not rounds:
        return {}
    return {k: statistics.fmean(r[k] for r in rounds)
            for k in ("wall_s", "compute_s", "transfer_s", "orchestration_s")}
