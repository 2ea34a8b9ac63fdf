"""After a deployment run with ``--capture``: the wire ledger of its links into ``wire.json``."""

from __future__ import annotations

import csv
from typing import Any

from simulations.wire.report import format_table, summarize, write_wire
from simulations.wire.supernode import analyse_deployment

from .cluster import Deployment
from .fedgc_run import FedgcRun


def payload_in_clients_csv(run_dir: Any) -> dict[str, int]:
    """Payload bytes the server recorded for every client-round (``clients.csv``), per
    direction: what the capture's payload category must equal."""
    up = down = 0
    try:
        with (run_dir / "clients.csv").open(newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                up += int(float(row.get("uplink_bytes") or 0))
                down += int(float(row.get("downlink_bytes") or 0))
    except FileNotFoundError:
        pass
    return {"up": up, "down": down}


def write_capture_ledger(dep: Deployment, run: FedgcRun) -> str:
    """Analyse every node's capture, write ``<run_dir>/wire.json``, return its table."""
    link = dep.config.link
    nodes = analyse_deployment(dep.capture_dir, dep.config.nodes)
    summary = summarize(nodes, "supernode", {
        "link": None if link is None else link.name,
        "tls": dep.config.tls,
        "auth": dep.config.auth,
        "method": run.summary.get("method"),
        "task": run.summary.get("task"),
        "run_id": run.result.run_id,
        "kernel_drops": sum(dep.capture_drops.values()),
        "capture_dir": str(dep.capture_dir),
        "poll_interval_s": dep.config.poll_interval_s,
        "heartbeat_interval_s": dep.config.heartbeat_interval_s,
        "keep_alive_s": dep.config.keep_alive_s,
        "payload_clients_csv": payload_in_clients_csv(run.run_dir),
    })
    write_wire(run.run_dir, summary)
    return format_table(summary)
