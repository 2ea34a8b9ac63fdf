"""Attach a run to a running Ray cluster: reach its head, list its nodes, check the state folder.

``sim.ray_address`` names the cluster (``HEAD:PORT`` of ``ray start --head``, or ``auto``).
Before Flower's simulation engine starts, :func:`attach` connects this process (the driver) to
it and checks, from every alive node, that the client-state folder is the same folder there:
a client scheduled on a node that does not see the records of its earlier rounds would lose
its residual. Every failure is a :class:`ClusterError` naming the address, node or folder.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Seconds to wait for the head's GCS port to accept a connection.
CONNECT_TIMEOUT_S = 5.0
#: Seconds to wait for the state-folder probe on every node (a node starts a worker for it).
PROBE_TIMEOUT_S = 120.0


class ClusterError(RuntimeError):
    """The Ray cluster of ``sim.ray_address`` cannot run this simulation (unreachable, no alive
    node, or a node that does not see the client-state folder)."""


@dataclass(frozen=True)
class ClusterNode:
    """One alive node of the cluster, as Ray lists it."""

    node_id: str
    address: str
    hostname: str
    cpus: float


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` as (host, port); a ClusterError names a malformed address."""
    if address.startswith("ray://"):
        raise ClusterError(f"sim.ray_address = {address!r} is a Ray Client address; fedgc runs "
                           f"its driver on a node of the cluster: give the head's GCS address "
                           f"HEAD:PORT (ray start --head --port PORT) or auto")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"sim.ray_address = {address!r} must be HOST:PORT (the head's "
                           f"`ray start --head --port PORT`) or auto")
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast when the head's port does not answer (``ray.init`` would retry for a minute)."""
    if address == "auto":
        return  # Ray resolves it (RAY_ADDRESS or the last `ray start` here) and says if it cannot
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as ex:
        raise ClusterError(f"sim.ray_address = {address!r}: no Ray head answers at {host}:{port} "
                           f"({ex}); start one with `ray start --head --port {port}` or fix the "
                           f"address") from ex


def alive_nodes() -> list[ClusterNode]:
    """The alive nodes of the cluster this process is connected to, in Ray's order."""
    import ray

    return [ClusterNode(n["NodeID"], n.get("NodeManagerAddress", ""),
                        n.get("NodeManagerHostname", ""),
                        float(n.get("Resources", {}).get("CPU", 0.0)))
            for n in ray.nodes() if n.get("Alive")]


def check_marker(folder: str, marker: str, token: str, name: str) -> str:
    """"" if ``folder`` holds ``marker`` with ``token`` and takes a file ``name``, else why not."""
    path = Path(folder) / marker
    try:
        if path.read_text() != token:
            return f"{path} holds another run's token"
        check = Path(folder) / name
        check.write_text(token)
        check.unlink()
    except OSError as ex:
        return f"{type(ex).__name__}: {ex}"
    return ""


def _probe(folder: str, marker: str, token: str) -> tuple[str, str]:
    """On a node: (its node id, :func:`check_marker`'s answer there)."""
    import ray

    node = ray.get_runtime_context().get_node_id()
    return node, check_marker(folder, marker, token, f".{marker}.{node[:12]}")


def probe_state_dir(folder: Path, nodes: list[ClusterNode],
                    timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Check from every node that ``folder`` is the folder this process writes to.

    This process writes a marker with a random token; a task pinned to each node (no CPU
    asked, so it runs beside whatever else holds the node) reads it back and writes a file of
    its own. A node-local folder of the same name holds no marker, and fails.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    folder.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    marker = f".fedgc-probe-{token[:8]}"
    (folder / marker).write_text(token)
    try:
        probe = ray.remote(num_cpus=0)(_probe)
        refs = {n.node_id: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            n.node_id, soft=False)).remote(str(folder), marker, token) for n in nodes}
        try:
            results = dict(ray.get(list(refs.values()), timeout=timeout_s))
        except ray.exceptions.GetTimeoutError as ex:
            raise ClusterError(f"the state-folder probe did not finish on every node within "
                               f"{timeout_s:.0f} s; is every node's Python environment able to "
                               f"import fedgc?") from ex
        except ray.exceptions.RayError as ex:
            raise ClusterError(f"the state-folder probe failed on a node: {ex}") from ex
    finally:
        (folder / marker).unlink(missing_ok=True)
    bad = {n.node_id: results.get(n.node_id, "no answer") for n in nodes}
    bad = {k: v for k, v in bad.items() if v}
    if bad:
        where = "; ".join(f"node {k[:12]} ({next(n.address for n in nodes if n.node_id == k)}): "
                          f"{v}" for k, v in bad.items())
        raise ClusterError(f"state_dir {folder} is not shared by every node of the cluster "
                           f"({where}); put state_dir (or results_dir) on a filesystem every "
                           f"node mounts at the same path (docs/cluster.md)")


def attach(address: str, state_dir: Path) -> list[ClusterNode]:
    """Connect this process to the cluster at ``address`` and check it can run a simulation.

    Flower's Ray backend then finds Ray initialised and uses this connection as it is. The
    workers get this process's import path, as Flower gives them when it starts Ray itself,
    so every node must hold the project at the same path (or have it installed). On any
    failure Ray is shut down again and a :class:`ClusterError` raised.
    """
    check_reachable(address)
    import ray

    pythonpath = os.pathsep.join(p for p in [*sys.path, os.environ.get("PYTHONPATH", "")] if p)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    except (ConnectionError, ValueError, RuntimeError) as ex:
        raise ClusterError(f"sim.ray_address = {address!r}: cannot connect to the Ray cluster: "
                           f"{ex}") from ex
    try:
        nodes = alive_nodes()
        if not nodes:
            raise ClusterError(f"the Ray cluster at {address!r} has no alive node")
        if not sum(n.cpus for n in nodes):
            raise ClusterError(f"the Ray cluster at {address!r} offers no CPU for ClientApp "
                               f"actors (ray start --num-cpus)")
        probe_state_dir(state_dir, nodes)
    except BaseException:
        ray.shutdown()
        raise
    return nodes


def detach() -> None:
    """Disconnect this process from the cluster (the cluster keeps running)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def describe(nodes: list[ClusterNode]) -> str:
    """One line about the cluster for the run's log."""
    cpus = sum(n.cpus for n in nodes)
    hosts = ", ".join(f"{n.hostname or n.address} {n.node_id[:8]} ({n.cpus:g} CPU)"
                      for n in nodes)
    return f"{len(nodes)} node(s), {cpus:g} CPUs: {hosts}"


def init_args(address: str) -> dict[str, Any]:
    """The ``ray.init`` arguments of a run attached to ``address`` (no CPU count: the nodes
    declare theirs)."""
    return {"address": address, "include_dashboard": False}
