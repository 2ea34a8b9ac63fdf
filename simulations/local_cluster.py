"""A Ray cluster of several nodes on this machine (one ``ray start`` each), for tests and benches.

Each node is its own ``ray start --block`` process in a session of its own, with its own temp
folder (short, under /tmp: Ray's socket paths must stay under 108 bytes), working folder and
ports, so it behaves as a separate machine would, except for the shared filesystem.
:meth:`LocalRayCluster.stop` ends exactly those sessions (never ``ray stop``, which ends every
Ray process of the machine), and checks that no process naming a temp folder is left.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from simulations.cluster import ClusterError

#: Seconds a node may take to start (Ray starts several processes; this machine may be busy).
START_TIMEOUT_S = 120.0


def free_ports(n: int) -> list[int]:
    """``n`` different TCP ports nothing listens on now (the OS picks them, all bound at once:
    one at a time, it may hand out the same port twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    return free_ports(1)[0]


def _ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


class LocalRayCluster:
    """``num_nodes`` Ray nodes on this machine, ``cpus_per_node`` CPUs each.

    Parameters
    ----------
    workdir : Path
        Parent of each node's working folder (``node<i>``) and log (``node<i>.log``).
    num_nodes : int
        Nodes to start: a head, then workers that join it.
    cpus_per_node : int
        ``ray start --num-cpus`` of every node.

    Use as a context manager, or call :meth:`start` and, in a ``finally``, :meth:`stop`.
    """

    def __init__(self, workdir: Path, num_nodes: int = 2, cpus_per_node: int = 1) -> None:
        self.workdir = Path(workdir)
        self.num_nodes = num_nodes
        self.cpus_per_node = cpus_per_node
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.temp_dirs: list[Path] = []

    def _node_args(self, head: bool) -> list[str]:
        temp = Path(tempfile.mkdtemp(prefix="fgr", dir="/tmp"))
        self.temp_dirs.append(temp)
        # Every port Ray would otherwise take at a fixed default, which two nodes on one
        # machine (or another Ray instance here) would share.
        agent, grpc, runtime_env, metrics, dashboard, client = [
            p for p in free_ports(7) if p != self.port][:6]
        args = [_ray_cli(), "start", "--block", "--disable-usage-stats",
                f"--num-cpus={self.cpus_per_node}", f"--temp-dir={temp}",
                f"--dashboard-agent-listen-port={agent}",
                f"--dashboard-agent-grpc-port={grpc}",
                f"--runtime-env-agent-port={runtime_env}", f"--metrics-export-port={metrics}"]
        if head:
            return [*args, "--head", f"--port={self.port}", "--include-dashboard=false",
                    f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}"]
        return [*args, f"--address={self.address}"]

    def start(self) -> LocalRayCluster:
        """Start the nodes and wait until all of them are alive in the cluster."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "RAY_ADDRESS": ""}  # a node joins what --address says, nothing else
        for i in range(self.num_nodes):
            cwd = self.workdir / f"node{i}"
            cwd.mkdir(exist_ok=True)
            with (self.workdir / f"node{i}.log").open("wb") as log:
                self.procs.append(subprocess.Popen(self._node_args(head=i == 0), cwd=cwd,
                                                   stdout=log, stderr=subprocess.STDOUT,
                                                   env=env, start_new_session=True))
            if i == 0:
                self._wait(lambda: self._port_open(), "the head's port")
        self._wait(lambda: self.alive_nodes() >= self.num_nodes,
                   f"{self.num_nodes} alive nodes")
        return self

    def _port_open(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0):
                return True
        except OSError:
            return False

    def alive_nodes(self) -> int:
        """How many nodes the head lists as alive (asked through the ``ray`` CLI's GCS client)."""
        import ray

        ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
        try:
            return sum(1 for n in ray.nodes() if n.get("Alive"))
        finally:
            ray.shutdown()

    def _wait(self, ready: object, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead:
                raise ClusterError(f"a Ray node exited while starting ({dead[0]}); see "
                                   f"{self.workdir}/node*.log")
            if ready():  # type: ignore[operator]
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"no {what} after {START_TIMEOUT_S:.0f} s; see "
                                   f"{self.workdir}/node*.log")
            time.sleep(0.5)

    def leftovers(self) -> dict[int, str]:
        """Processes (pid: command line) of this cluster that are still running.

        One of them names a temp folder of this cluster in its command line, runs in a node's
        working folder, or holds a file of a temp folder open (Ray's agents rename themselves
        ``ray::DashboardAgent``, but keep their logs open); no other process does any of that.
        """
        temps = tuple(str(t) + "/" for t in self.temp_dirs)
        marks = [str(t) for t in self.temp_dirs]
        cwds = tuple(str(self.workdir / f"node{i}") for i in range(self.num_nodes))
        found = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            proc = Path("/proc") / pid
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                mine = any(m in cmd for m in marks) \
                    or os.readlink(proc / "cwd").removesuffix(" (deleted)").startswith(cwds)
                if not mine:
                    mine = any(os.readlink(fd).startswith(temps) for fd in (proc / "fd").iterdir())
            except OSError:  # ended meanwhile, or not ours to read
                continue
            if mine:
                found[int(pid)] = cmd[:160]
        return found

    def stop(self, timeout_s: float = 20.0) -> None:
        """End every node's session (SIGTERM, then SIGKILL) and remove the temp folders.

        A process that left its node's session (Ray may start workers in sessions of their
        own) is found by the temp folder its command line names, which no other Ray instance
        uses, and is killed by its pid. Raises ClusterError if one outlives that.
        """
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                try:
                    os.killpg(p.pid, sig)  # the session this object started, by its id
                except ProcessLookupError:
                    pass
            if sig == signal.SIGKILL:
                for pid in self.leftovers():
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and self.leftovers():
                time.sleep(0.5)
            if not self.leftovers():
                break
        for p in self.procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        left = self.leftovers()
        for t in self.temp_dirs:
            shutil.rmtree(t, ignore_errors=True)
        if left:
            raise ClusterError(f"Ray processes outlived the cluster's stop: {left}")

    def __enter__(self) -> LocalRayCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
