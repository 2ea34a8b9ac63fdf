"""Run the real fedgc federation on a local deployment and write a simulation run's results."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from fedgc.settings import RunConfig, SettingsError
from server.app import RunFolderError, prepare_run_dir, progress_line
from server.preflight import PreflightError
from server.records import RoundRecord

from .cluster import Deployment, RunResult
from .errors import DeployError
from .fedgc_app import PHONE_CLIENT_APP, write_app


def deploy_run_config(base: Mapping[str, object], nodes: int, nodes_option: str = "--nodes"
                      ) -> Any:
    """The :class:`fedgc.settings.RunConfig` of a deployment of ``nodes`` SuperNodes.

    One SuperNode is one client (its partition id is its index), so ``num_clients`` is ``nodes``;
    ``clients_per_round`` defaults to all of them. Paths become absolute, because the ServerApp
    and the ClientApps run in processes of their own. ``robust = auto`` is on (off under
    ``privacy.secagg``, which refuses robust aggregation).

    Raises
    ------
    DeployError
        When ``num_clients`` is set to something else than ``nodes``, or a key is invalid.
    """
    values = dict(base)
    if "num_clients" in values and int(str(values["num_clients"])) != nodes:
        raise DeployError(
            f"num_clients={values['num_clients']} but {nodes_option} = {nodes}: in a "
            f"deployment every SuperNode (or phone) is one client, so num_clients must equal "
            f"the number of nodes"
        )
    values["num_clients"] = nodes
    values.setdefault("clients_per_round", nodes)
    try:
        config = RunConfig.from_flat(values)
    except SettingsError as err:
        raise DeployError(str(err)) from err
    # Deployed clients are not trusted: robust = auto is on here, decided before the run
    # config is written into the app (its keys then arrive filled). Under secure aggregation
    # it is off: the server cannot bound or robustly combine masked updates (privacy.clip and
    # the fixed point's range bound each one instead, docs/threat_model.md).
    robust = "off" if config.train.privacy_secagg else "on"
    try:
        return config.with_overrides({
            "results_dir": str(Path(config.server.results_dir).resolve()),
            "state_dir": str(config.state_dir.resolve()),
            **({"robust": robust} if config.server.robust == "auto" else {}),
        })
    except SettingsError as err:
        raise DeployError(str(err)) from err


@dataclass
class FedgcRun:
    """What one deployed fedgc run left behind."""

    result: RunResult
    run_dir: Path
    summary: dict[str, Any]


def check_fedgc_run(config: Any) -> None:
    """Prepare the run folder and refuse a run that cannot work (a taken folder, clients without
    data, no writable ``state_dir``), as :class:`DeployError` naming the problem.

    Raises
    ------
    DeployError
        What :func:`server.app.prepare_run_dir` refused.
    """
    try:
        # The deployed ServerApp takes the run folder's lock itself, in its own process.
        prepare_run_dir(config).release()
    except (RunFolderError, PreflightError) as err:
        raise DeployError(str(err)) from err


def submit_fedgc(dep: Deployment, config: Any, app_version: str = "1.0.0",
                 phones: bool = False) -> int:
    """Write the app for ``config`` into the deployment's folder, submit it, return the run id.
    With ``phones`` its ClientApp serves the nodes that name a phone through it."""
    check_fedgc_run(config)  # refuse a taken run folder before anything is submitted
    app_dir = write_app(dep.workdir / f"app-{app_version}", config.to_flat(), app_version,
                        client_module=PHONE_CLIENT_APP if phones else "client.app")
    return dep.submit(app_dir)


class RoundProgress:
    """Prints the progress line of each round a deployed ServerApp appends to ``rounds.csv``.

    The ServerApp runs in Flower's own process and its stdout goes to the SuperLink's log; the
    run folder is on this machine, and ``rounds.csv`` is rewritten atomically after every round,
    so reading it while the run goes on is safe. Called at every poll of the run's status.
    """

    def __init__(self, run_dir: Path, rounds: int, out: TextIO | None = None) -> None:
        self.path = run_dir / "rounds.csv"
        self.rounds = rounds
        self.out = out or sys.stdout
        self.shown = 0
        self.started = time.monotonic()

    def __call__(self) -> None:
        try:
            with self.path.open(newline="", encoding="utf-8") as fh:
                rows = list(csv.DictReader(fh))
        except FileNotFoundError:
            return
        kinds = {f.name: f.type for f in dataclasses.fields(RoundRecord)}
        for row in rows[self.shown:]:
            values = {k: (int(float(v)) if kinds[k] == "int" else
                          float(v) if v not in ("", None) else float("nan"))
                      for k, v in row.items() if k in kinds}
            self.shown += 1
            print(progress_line(RoundRecord(**values), self.rounds,
                                time.monotonic() - self.started, self.shown),
                  file=self.out, flush=True)


def finish_fedgc(dep: Deployment, config: Any, run_id: int, timeout_s: float,
                 progress: bool = True, check: Callable[[], None] | None = None) -> FedgcRun:
    """Wait for ``run_id`` and collect the results the ServerApp wrote; with ``progress``, print
    a line per round as the ServerApp finishes it (the run's ``progress`` key). ``check`` is
    called at every poll too (the phones': it raises when one died)."""
    watch = RoundProgress(config.run_dir, config.server.rounds) if progress else None

    def poll() -> None:
        if check is not None:
            check()
        if watch is not None:
            watch()

    result = dep.wait_run(run_id, timeout_s, on_poll=poll)
    run_dir = config.run_dir
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return FedgcRun(result, run_dir, summary)


def bytes_table(summary: dict[str, Any], record: dict[str, Any]) -> str:
    """The payload (fedgc's encoded messages, ``summary.json``) beside the bytes that crossed
    the shaped links (``deploy.json``: Flower's messages, gRPC/HTTP2, TLS and idle polling
    included), per direction, with their ratio."""
    links = [v for part in ("links", "phone_links")
             for v in (record.get(part) or {}).values() if v]
    head = f"{'bytes':<9} {'payload MB':>11} {'on the links MB':>16} {'links/payload':>14}"
    lines = [head, "-" * len(head)]
    totals = [0.0, 0.0]
    for direction in ("uplink", "downlink"):
        payload = float(summary.get(f"{direction}_bytes", 0))
        wire = float(sum(v[f"{direction}_bytes"] for v in links)) if links else math.nan
        totals = [totals[0] + payload, totals[1] + wire]
        lines.append(_bytes_row(direction, payload, wire))
    lines.append(_bytes_row("total", *totals))
    if not links:
        lines.append("(no shaped link, so nothing counted the bytes on the wire: --link)")
    return "\n".join(lines)


def _bytes_row(name: str, payload: float, wire: float) -> str:
    on_links = "-" if math.isnan(wire) else f"{wire / 1e6:.3f}"
    ratio = "-" if math.isnan(wire) or not payload else f"{wire / payload:.1f}x"
    return f"{name:<9} {payload / 1e6:>11.3f} {on_links:>16} {ratio:>14}"


def link_stats(link: Any) -> dict[str, int] | None:
    """What a node's link carried (its proxy's counters); None for an unshaped one."""
    if link is None or link.proxy is None:
        return None
    stats = link.proxy.stats
    return {"uplink_bytes": stats.uplink_bytes, "downlink_bytes": stats.downlink_bytes,
            "connections": stats.connections, "outages": stats.outages,
            "aborted_by_outage": stats.aborted_by_outage}


def node_rows(run_dir: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per node (client key): its kind, what the server counted (``clients.csv``: payload up
    and down, rounds aggregated) and what its link carried (``deploy.json``)."""
    payload: dict[int, list[int]] = {}
    path = run_dir / "clients.csv"
    if path.exists():
        with path.open(newline="", encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                p = payload.setdefault(int(row["client_key"]), [0, 0, 0])
                p[0] += int(float(row["uplink_bytes"] or 0))
                p[1] += int(float(row["downlink_bytes"] or 0))
                p[2] += row["status"] == "aggregated"
    phones = record.get("phones") or {}
    rows = []
    for key in range(int(record.get("nodes", 0))):
        phone = phones.get(str(key))
        link = ((record.get("phone_links") or {}).get(str(key)) if phone
                else (record.get("links") or {}).get(str(key)))
        up, down, aggregated = payload.get(key, [0, 0, 0])
        rows.append({"client_key": key, "kind": f"phone ({phone['arch']})" if phone else
                     "supernode", "payload_uplink_bytes": up, "payload_downlink_bytes": down,
                     "rounds_aggregated": aggregated, "link": link})
    return rows


def format_nodes(rows: list[dict[str, Any]]) -> str:
    """The per-node table the command prints."""
    head = (f"{'node':>4} {'kind':<14} {'rounds':>6} {'payload up kB':>13} "
            f"{'payload down kB':>15} {'link up kB':>10} {'link down kB':>12} {'conns':>5} "
            f"{'outages':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        link = r["link"] or {}
        lines.append(f"{r['client_key']:>4} {r['kind']:<14} {r['rounds_aggregated']:>6} "
                     f"{_kb(r['payload_uplink_bytes']):>13} "
                     f"{_kb(r['payload_downlink_bytes']):>15} "
                     f"{_kb(link.get('uplink_bytes')):>10} {_kb(link.get('downlink_bytes')):>12} "
                     f"{link.get('connections', '-'):>5} {link.get('outages', '-'):>7}")
    return "\n".join(lines)


def _kb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e3:.1f}"


def write_deploy_record(dep: Deployment, run: FedgcRun, started_s: float,
                        extra: dict[str, Any] | None = None) -> Path:
    """``<run_dir>/deploy.json``: how the run was deployed (mode, link, nodes, TLS, auth), and
    ``extra`` keys (the phones: :mod:`simulations.deploy.phones`)."""
    link = dep.config.link
    record = {
        "run_id": run.result.run_id,
        "status": run.result.status,
        "nodes": dep.config.nodes,
        "link": None if link is None else link.name,
        "link_spec": None if link is None else {
            "rtt_ms": link.rtt_ms, "jitter_ms": link.jitter_ms, "down_mbps": link.down_mbps,
            "up_mbps": link.up_mbps,
            # None (JSON null) for a link that never goes down; JSON has no infinity.
            "mean_online_s": link.mean_online_s if math.isfinite(link.mean_online_s) else None,
            "mean_offline_s": link.mean_offline_s, "outage_policy": link.outage_policy,
        },
        "shaping_mode": dep.mode,
        "shaping_detail": dep.mode_detail,
        "tls": dep.config.tls,
        "auth": dep.config.auth,
        # None: Flower's own (3 s, 30 s, 5 s).
        "poll_interval_s": dep.config.poll_interval_s,
        "heartbeat_interval_s": dep.config.heartbeat_interval_s,
        "keep_alive_s": dep.config.keep_alive_s,
        "deploy_wall_seconds": time.monotonic() - started_s,
        "links": {str(i): link_stats(nl) for i, nl in dep.node_links.items()},
        **(extra or {}),
    }
    run.run_dir.mkdir(parents=True, exist_ok=True)
    path = run.run_dir / "deploy.json"
    path.write_text(json.dumps(record, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path
