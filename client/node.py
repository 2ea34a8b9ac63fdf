"""Where this ClientApp process runs: its Ray node, which a reply names for ``clients.csv``.

In Flower's simulation engine every ClientApp runs in a Ray actor; on a multi-node cluster a
client's rounds land on different nodes, and ``clients.csv`` records which (``ray_node``).
Outside Ray (the local engine, real SuperNodes) there is nothing to name and replies carry
nothing extra.
"""

from __future__ import annotations

import socket
import sys
from functools import lru_cache


@lru_cache(maxsize=1)
def _ray_node_of_process() -> str:
    ray = sys.modules.get("ray")  # imported by Ray's own worker; importing it here costs ~1 s
    if ray is None or not ray.is_initialized():
        return ""
    return str(ray.get_runtime_context().get_node_id())


def node_info() -> dict[str, str]:
    """``{"ray_node": node id, "host": host name}`` inside a Ray worker, else ``{}``."""
    node = _ray_node_of_process()
    if not node:
        _ray_node_of_process.cache_clear()  # Ray may connect later in this process
        return {}
    return {"ray_node": node, "host": socket.gethostname()}


def in_simulation_engine() -> bool:
    """Whether this process is a worker of Flower's simulation engine (its Ray backend), where
    every node runs the configuration of the user who started the simulation; a deployed
    SuperNode's ClientApp process runs outside Ray."""
    return bool(node_info())


def describe() -> str:
    """``Ray node <id> (<host>)`` for error messages, or ``host <name>`` outside Ray."""
    info = node_info()
    if info:
        return f"Ray node {info['ray_node'][:12]} ({info['host']})"
    return f"host {socket.gethostname()}"
