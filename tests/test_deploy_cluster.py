"""A real Flower deployment on this machine: SuperLink, SuperNodes, TLS, node auth, links."""

from __future__ import annotations

import json
import os
import re
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from simulations.deploy.cluster import Deployment, DeploymentConfig, RunResult
from simulations.deploy.errors import DeployError
from simulations.deploy.presets import preset

PROBE_APP = Path(__file__).resolve().parents[1] / "simulations" / "deploy" / "probe_app"

pytestmark = pytest.mark.slow


def _probe_result(result: RunResult) -> dict[str, float]:
    match = re.search(r"PROBE_RESULT (\{.*\})", result.log)
    assert match, f"no PROBE_RESULT in run log:\n{result.log[-2000:]}"
    return json.loads(match.group(1))


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_probe_app_runs_over_shaped_links_and_everything_is_cleaned_up(
    deployment: Callable[..., Deployment],
) -> None:
    dep = deployment(nodes=2, link=preset("lte"), shaping="auto")
    # This deployment's own namespaces only: other sessions on the machine add and remove theirs.
    own_netns = {link.netns for link in dep.node_links.values() if link.netns is not None}
    if dep.mode in ("netem", "tbf"):
        assert own_netns and own_netns <= _netns_names()
    assert dep.mode in ("netem", "tbf", "proxy")
    result = dep.run(PROBE_APP, timeout_s=180)
    assert result.ok, dep.log_tails()
    # Offsets 1 and 2 averaged with equal weights, two rounds: 2 * 1.5.
    assert _probe_result(result) == {"first": 3.0, "size": 4}
    for link in dep.node_links.values():
        assert link.proxy is not None and link.proxy.stats.uplink_bytes > 0
        assert link.proxy.stats.downlink_bytes > 0
    groups = [p.pid for p in dep.supernodes.values()] + [dep.superlink.pid]
    dep.stop()
    assert not any(_group_alive(g) for g in groups)
    assert not own_netns & _netns_names()


def test_tls_with_node_auth_refuses_an_unregistered_node_and_serves_a_registered_one(
    deployment: Callable[..., Deployment],
) -> None:
    dep = deployment(nodes=2, auth=True, unregistered=frozenset({1}))
    assert dep.tls is not None

    # The SuperLink speaks TLS with the run's own CA, and only TLS.
    context = ssl.create_default_context(cafile=str(dep.tls.ca_cert))
    with socket.create_connection(("127.0.0.1", dep.superlink_port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls_sock:
            assert tls_sock.version() in ("TLSv1.2", "TLSv1.3")
    with socket.create_connection(("127.0.0.1", dep.superlink_port), timeout=5) as plain:
        plain.settimeout(5)
        plain.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            reply = plain.recv(64)
        except ConnectionResetError:
            reply = b""
        assert not reply.startswith(b"HTTP/")

    refused = dep.supernodes[1]
    deadline = time.monotonic() + 60
    while refused.running() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert refused.returncode() not in (None, 0)
    assert "Failed to activate SuperNode" in refused.log_text()

    # The node id `flwr supernode register` printed is the one the node authenticated as: the
    # binding of client keys (client_nodes) rests on it.
    assert dep.registered == {0: dep.node_id(0)} and dep.client_nodes() == f"0:{dep.node_id(0)}"

    # Only node 0 (offset 1) trains: two rounds give exactly 2.0.
    result = dep.run(PROBE_APP, {"min-nodes": 1}, timeout_s=180)
    assert result.ok, dep.log_tails()
    assert _probe_result(result)["first"] == 2.0

    # The same node, once its key is registered, is let in.
    dep.register_node(1)
    dep.start_supernode(1)
    dep.wait_supernode(1, timeout_s=60)
    assert dep.supernodes[1].running()


def test_bad_deployment_options_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(DeployError, match=r"nodes=0, expected an integer in 1\.\.200"):
        DeploymentConfig(nodes=0, workdir=tmp_path)
    with pytest.raises(DeployError, match=r"unregistered=\[5\] out of range 0\.\.1"):
        DeploymentConfig(nodes=2, workdir=tmp_path, unregistered=frozenset({5}))
    assert not any(tmp_path.iterdir())
