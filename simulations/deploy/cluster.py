"""One local Flower deployment: a SuperLink, N SuperNodes behind shaped links, and ``flwr run``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .capture import PacketCapture
from .certs import NodeKeys, TlsFiles, make_node_keys, make_tls
from .errors import DeployError, ProcessStartError
from .fedgc_app import repo_root
from .files import private_dir
from .links import LinkSet, NodeLink, choose_mode
from .presets import LinkSpec
from .processes import (
    ManagedProcess,
    descendants,
    free_port,
    process_args,
    run_command,
    wait_for_port,
)
from .toml_values import format_config
from .watchdog import Watchdog, start_time

CONNECTION = "fedgc-deploy"
#: The module that starts a SuperNode with fedgc's additions (:mod:`simulations.deploy.launch`).
LAUNCHER = "simulations.deploy.launch"
_BIN = Path(sys.executable).parent
_CLI_TIMEOUT_S = 60.0


def default_node_config(index: int, nodes: int) -> dict[str, int | str]:
    """Node config of SuperNode ``index``: its partition, as Flower's examples use it."""
    return {"partition-id": index, "num-partitions": nodes}


@dataclass
class DeploymentConfig:
    """What to start.

    Parameters
    ----------
    nodes : int
        Number of SuperNodes.
    workdir : Path
        Logs, certificates, keys, the Flower home (``FLWR_HOME``) and the SuperLink database.
    link : LinkSpec, optional
        Every SuperNode's link; None for unshaped loopback.
    shaping : str
        ``auto`` (best available), ``netem``, ``tbf``, ``proxy`` or ``none``.
    tls : bool
        Serve the Fleet and Control APIs over TLS with certificates generated for the run.
    auth : bool
        Require SuperNode authentication (implies ``tls``); keys are generated per node.
    unregistered : frozenset[int]
        With ``auth``, nodes whose key is *not* registered (to show they are refused).
    node_config : callable
        ``(index, nodes) -> dict`` for each node's ``--node-config``.
    seed : int
        Seeds the links (jitter and outages).
    startup_timeout_s : float
        Bound on each process's readiness.
    restart_on_exit : bool
        Supervise the SuperNodes and restart one that exits, as a service manager does on a
        device. Needed on intermittent links: Flower's SuperNode gives up when a connection reset
        makes one of its non-idempotent requests (node activation) fail for good.
    unshaped : frozenset[int]
        Nodes that run beside the SuperLink, on loopback without a link (the SuperNodes of the
        phone bridge: the phones' own links are theirs, :mod:`simulations.deploy.phones`).
    poll_interval_s, heartbeat_interval_s : float, optional
        An idle SuperNode's pull interval (Flower: 3 s) and its heartbeat interval (Flower:
        30 s); None keeps Flower's (:mod:`simulations.deploy.launch`).
    keep_alive_s : float, optional
        How long the SuperLink keeps an idle HTTP connection (Flower's uvicorn: 5 s).
    capture : bool
        Record every packet of each node's link with tcpdump (``<workdir>/capture/node<i>.pcap``)
        and, with TLS, the SuperNodes' session keys (``node<i>.keys``) for
        :mod:`simulations.wire`. Needs namespaced links (shaping ``tbf`` or ``netem``).
    """

    nodes: int
    workdir: Path
    link: LinkSpec | None = None
    shaping: str = "auto"
    tls: bool = False
    auth: bool = False
    unregistered: frozenset[int] = frozenset()
    node_config: Callable[[int, int], Mapping[str, object]] = default_node_config
    seed: int = 0
    startup_timeout_s: float = 90.0
    restart_on_exit: bool = False
    unshaped: frozenset[int] = frozenset()
    poll_interval_s: float | None = None
    heartbeat_interval_s: float | None = None
    keep_alive_s: float | None = None
    capture: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, int) or not 1 <= self.nodes <= 200:
            raise DeployError(f"nodes={self.nodes!r}, expected an integer in 1..200")
        if self.auth:
            self.tls = True
        bad = [i for i in self.unregistered if not 0 <= i < self.nodes]
        if bad:
            raise DeployError(f"unregistered={sorted(bad)} out of range 0..{self.nodes - 1}")


@dataclass
class RunResult:
    """The outcome of one ``flwr run``."""

    run_id: int
    status: str
    log: str
    seconds: float
    details: dict[str, object] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the run finished as completed."""
        return self.status == "finished:completed"


class Deployment:
    """Start, drive and stop one local deployment (a context manager).

    ``with Deployment(cfg) as dep: dep.run(app_dir)`` starts the SuperLink, registers node keys,
    starts the SuperNodes behind their links, runs the app and then tears everything down, even
    when a step fails.
    """

    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.workdir = config.workdir.resolve()
        self.flwr_home = self.workdir / "flwr-home"
        self.mode = "none"
        self.mode_detail = ""
        self.links: LinkSet | None = None
        self.superlink: ManagedProcess | None = None
        self.supernodes: dict[int, ManagedProcess] = {}
        self.node_links: dict[int, NodeLink] = {}
        self.node_keys: dict[int, NodeKeys] = {}
        self.tls: TlsFiles | None = None
        self.superlink_port = 0
        self.restarts: dict[int, int] = {}
        self.captures: dict[int, PacketCapture] = {}
        self.capture_drops: dict[int, int] = {}
        self.registered: dict[int, int] = {}  # index -> node id (auth only)
        self._held: set[int] = set(config.unregistered)
        self._supervisor: threading.Thread | None = None
        self.watchdog: Watchdog | None = None
        self._stopping = threading.Event()
        self._lock = threading.RLock()
        self.env = {
            **os.environ,
            "FLWR_HOME": str(self.flwr_home),
            "PATH": f"{_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            # Child processes print progress as it happens, so readiness can be read in logs.
            "PYTHONUNBUFFERED": "1",
            # The app processes import fedgc's packages (dgc, client, server, tasks) from here.
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(repo_root()), os.environ.get("PYTHONPATH", "")) if p
            ),
        }

    # ---- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Deployment:
        try:
            self.start()
        except BaseException:
            with contextlib.suppress(DeployError):
                self.stop()  # the start failure is the error worth reporting
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start the SuperLink, the links and every SuperNode, and wait until each is up."""
        cfg = self.config
        private_dir(self.workdir)
        private_dir(self.flwr_home)  # before the SuperLink, which would create it 0755
        private_dir(self.workdir / "logs")
        # First: whatever starts from here on is torn down even if this process is SIGKILLed.
        self.watchdog = Watchdog(self.workdir / "watchdog.json",
                                 self.workdir / "logs" / "watchdog.log")
        self._record()
        self.watchdog.start()
        requested = cfg.shaping if cfg.link is not None else "none"
        self.mode, self.mode_detail = choose_mode(requested)
        print(f"[deploy] link shaping mode: {self.mode} ({self.mode_detail})", flush=True)
        self.links = LinkSet(cfg.link, self.mode, seed=cfg.seed)
        if cfg.tls:
            self.tls = make_tls(self.workdir / "tls", self.links.host_addresses(cfg.nodes))
        self._start_superlink()
        self._write_flower_config()
        if cfg.auth:
            for index in range(cfg.nodes):
                self.node_keys[index] = make_node_keys(self.workdir / "keys", f"node{index}")
                if index not in cfg.unregistered:
                    self.register_node(index)
        for index in range(cfg.nodes):
            self.start_supernode(index)
        for index in range(cfg.nodes):
            if index not in cfg.unregistered:
                self.wait_supernode(index)
        if cfg.restart_on_exit:
            self._supervisor = threading.Thread(target=self._supervise, daemon=True,
                                                name="supernode-supervisor")
            self._supervisor.start()

    def _supervise(self) -> None:
        while not self._stopping.wait(0.5):
            for index in list(self.supernodes):
                with self._lock:
                    proc = self.supernodes[index]
                    if index in self._held or proc.running() or self._stopping.is_set():
                        continue
                    print(f"[deploy] supernode{index} exited ({proc.returncode()}); restarting",
                          flush=True)
                    self.restarts[index] = self.restarts.get(index, 0) + 1
                    proc.stop(timeout_s=5.0)  # reap what is left of its group
                    proc.start()

    def stop(self) -> None:
        """Stop every process (SuperNodes first) and tear down the links.

        Every step runs even when an earlier one fails; a process group that survives SIGKILL is
        reported afterwards as a :class:`DeployError`.
        """
        problems = []
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(10.0)
        procs = [*self.supernodes.values(), *([self.superlink] if self.superlink else [])]
        for proc in procs:
            try:
                # Graceful shutdown first, but a wedged process must not hold the run up long.
                proc.stop(timeout_s=5.0)
            except ProcessStartError as err:
                problems.append(str(err))
        # After the nodes (their last requests are on the wire), before the links go.
        for index, capture in self.captures.items():
            self.capture_drops[index] = capture.stop()
        if self.links is not None:
            self.links.stop()
        if self.watchdog is not None:
            self.watchdog.stop()  # everything is down: nothing for it to sweep
            self.watchdog = None
        if problems:
            raise DeployError("; ".join(problems))

    def _record(self, planned_netns: str | None = None) -> None:
        """Tell the watchdog what to tear down: the processes started so far (pid and start
        time), the namespaces made so far and ``planned_netns``, about to be made."""
        if self.watchdog is None:
            return
        procs = [p for p in (self.superlink, *self.supernodes.values())
                 if p is not None and p.running()]
        namespaces = {link.netns for link in self.node_links.values() if link.netns}
        if planned_netns:
            namespaces.add(planned_netns)
        self.watchdog.record({
            "flwr_home": str(self.flwr_home),
            "processes": [{"pid": p.pid, "start": start_time(p.pid)} for p in procs],
            "namespaces": sorted(namespaces)})

    # ---- SuperLink -------------------------------------------------------------------------
    def _start_superlink(self) -> None:
        self.superlink_port = free_port()
        argv = [
            str(_BIN / "flower-superlink"),
            "--port", str(self.superlink_port),
            "--database", str(self.workdir / "superlink.db"),
            # The venv already holds every dependency; never reach for a package index.
            "--disable-runtime-dependency-installation",
        ]
        if self.tls is not None:
            argv += ["--ssl-ca-certfile", str(self.tls.ca_cert),
                     "--ssl-certfile", str(self.tls.server_cert),
                     "--ssl-keyfile", str(self.tls.server_key)]
        else:
            argv.append("--insecure")
        if self.config.auth:
            argv.append("--enable-supernode-auth")
        if self.config.keep_alive_s is not None:
            argv = [sys.executable, "-m", LAUNCHER, "superlink",
                    "--keep-alive-s", str(self.config.keep_alive_s), "--", *argv[1:]]
        self.superlink = ManagedProcess("superlink", argv, self.workdir / "logs" / "superlink.log",
                                        env=self.env)
        self.superlink.start()
        self._record()
        self.superlink.wait_for_log(r"Uvicorn running on", self.config.startup_timeout_s)
        wait_for_port("127.0.0.1", self.superlink_port, self.config.startup_timeout_s)

    def _write_flower_config(self) -> None:
        private_dir(self.flwr_home)
        lines = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]",
                 f'address = "127.0.0.1:{self.superlink_port}"']
        if self.tls is not None:
            lines.append(f"root-certificates = {json.dumps(str(self.tls.ca_cert))}")
        else:
            lines.append("insecure = true")
        (self.flwr_home / "config.toml").write_text("\n".join(lines) + "\n", encoding="utf-8")

    def flwr(self, *args: str, timeout_s: float = _CLI_TIMEOUT_S) -> str:
        """Run one ``flwr`` CLI command against this deployment and return its output.

        Raises
        ------
        DeployError
            When the command fails; the message holds its output.
        """
        proc = run_command([str(_BIN / "flwr"), *args], env=self.env, timeout_s=timeout_s)
        if proc.returncode != 0:
            raise DeployError(
                f"`flwr {' '.join(args)}` failed ({proc.returncode}):\n{proc.stdout[-3000:]}"
            )
        return proc.stdout

    def register_node(self, index: int) -> int:
        """Register node ``index``'s public key with the SuperLink (``flwr supernode register``)
        and return the node id the SuperLink gave it (kept in :attr:`registered`): the
        SuperNode holding that key is that node, authenticated."""
        keys = self.node_keys[index]
        out = self.flwr("supernode", "register", str(keys.public_key), CONNECTION,
                        "--name", f"node{index}", "--format", "json")
        match = re.search(r'"node-id":\s*"?(\d+)', out)
        if match is None:
            raise DeployError(f"`flwr supernode register` printed no node id:\n{out[-2000:]}")
        self.registered[index] = int(match.group(1))
        return self.registered[index]

    def client_nodes(self) -> str:
        """The run key ``client_nodes`` of this deployment: each registered node's index (its
        ``partition-id``, the client key it serves) bound to its authenticated node id; empty
        without ``auth``."""
        return ",".join(f"{i}:{n}" for i, n in sorted(self.registered.items()))

    # ---- SuperNodes ------------------------------------------------------------------------
    def start_supernode(self, index: int) -> ManagedProcess:
        """Start (or restart) SuperNode ``index`` behind its link."""
        with self._lock:  # the supervisor must not restart it at the same moment
            return self._start_supernode(index)

    def _start_supernode(self, index: int) -> ManagedProcess:
        assert self.links is not None
        link = self.node_links.get(index)
        if link is None and index in self.config.unshaped:
            link = NodeLink(index, "none", f"127.0.0.1:{self.superlink_port}", None, None, None)
        elif link is None:
            # Recorded before it is made: the watchdog deletes it if this process dies.
            self._record(planned_netns=self.links.netns_name(index))
            link = self.links.build(index, "127.0.0.1", self.superlink_port)
        self.node_links[index] = link
        if self.config.capture:
            self._start_capture(index, link)
        existing = self.supernodes.get(index)
        if existing is not None and existing.running():
            self._held.discard(index)
            return existing
        node_config = dict(self.config.node_config(index, self.config.nodes))
        argv = [
            str(_BIN / "flower-supernode"),
            "--superlink", link.address,
            # Each SuperNode's own runtime API; inside a namespace it has a loopback of its own.
            "--port", str(free_port()),
            "--node-config", format_config(node_config),
        ]
        if self.tls is not None:
            argv += ["--root-certificates", str(self.tls.ca_cert)]
        else:
            argv.append("--insecure")
        if self.config.auth:
            argv += ["--auth-supernode-private-key", str(self.node_keys[index].private_key)]
        extra: list[str] = []
        if self.config.capture and self.tls is not None:
            # The node's TLS secrets, so that the capture of its link can be decrypted.
            extra += ["--keylog", str(self.capture_dir / f"node{index}.keys")]
        for flag, value in (("--poll-interval-s", self.config.poll_interval_s),
                            ("--heartbeat-interval-s", self.config.heartbeat_interval_s),
                            ("--keep-alive-s", self.config.keep_alive_s)):
            if value is not None:
                extra += [flag, str(value)]
        if extra:
            argv = [sys.executable, "-m", LAUNCHER, "supernode", *extra, "--", *argv[1:]]
        proc = existing or ManagedProcess(
            f"supernode{index}", argv, self.workdir / "logs" / f"supernode{index}.log",
            env=self.env, netns=link.netns,
        )
        self.supernodes[index] = proc.start()
        self._record()
        self._held.discard(index)
        return proc

    @property
    def capture_dir(self) -> Path:
        """Where the links' packet captures and the SuperNodes' TLS key logs go."""
        return self.workdir / "capture"

    def _start_capture(self, index: int, link: NodeLink) -> None:
        if index in self.captures:
            return
        if link.veth is None:
            raise DeployError(f"capture needs a namespaced link (shaping tbf or netem); node "
                              f"{index}'s link is in mode {link.mode!r}")
        self.captures[index] = PacketCapture(
            link.veth.host_dev, self.capture_dir / f"node{index}.pcap").start()

    def wait_supernode(self, index: int, timeout_s: float | None = None) -> None:
        """Block until SuperNode ``index`` has joined the SuperLink (it logs its node id).

        With ``restart_on_exit`` a SuperNode that gives up while joining is started again
        within the same time bound.
        """
        deadline = time.monotonic() + (timeout_s or self.config.startup_timeout_s)
        while True:
            proc = self.supernodes[index]
            try:
                proc.wait_for_log(r"SuperNode ID: \d+", max(0.1, deadline - time.monotonic()))
                return
            except ProcessStartError:
                if not self.config.restart_on_exit or time.monotonic() > deadline:
                    raise
            with self._lock:
                if not proc.running():
                    self.restarts[index] = self.restarts.get(index, 0) + 1
                    proc.stop(timeout_s=5.0)
                    proc.start()

    def node_id(self, index: int) -> int:
        """The node id SuperNode ``index`` got at its latest start (read from its log)."""
        found = re.findall(r"SuperNode ID: (\d+)", self.supernodes[index].log_text())
        if not found:
            raise DeployError(f"supernode{index} has not logged a node id yet")
        return int(found[-1])

    def node_statuses(self) -> dict[int, str]:
        """Node id -> status (``online``, ``offline``, ...) as the SuperLink sees them."""
        out = self.flwr("supernode", "list", CONNECTION, "--format", "json")
        nodes = json.loads(out[out.index("{"):]).get("nodes", [])
        return {int(n["node-id"]): str(n["status"]) for n in nodes}

    def kill_supernode(self, index: int) -> None:
        """SIGKILL SuperNode ``index`` and its ClientApp processes (a crash); it stays down
        (the supervisor leaves it alone) until :meth:`start_supernode`."""
        with self._lock:
            self._held.add(index)
            self.supernodes[index].kill()

    def leftover_pids(self) -> list[int]:
        """Processes that still name this deployment's SuperLink port or folder (a leak check)."""
        if not self.superlink_port:
            return []
        marks = (f":{self.superlink_port}", str(self.workdir))
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                args = " ".join(process_args(int(entry)))
                if "flower-" in args or "flwr-" in args or LAUNCHER in args:
                    if any(mark in args for mark in marks):
                        out.append(int(entry))
        return out

    def serverapp_pids(self) -> list[int]:
        """Pids of the ``flwr-serverapp`` processes the SuperLink runs (via its SuperExec)."""
        if self.superlink is None or not self.superlink.running():
            return []
        return [
            pid for pid in descendants(self.superlink.pid)
            if any(arg.endswith("flwr-serverapp") for arg in process_args(pid)[:2])
        ]

    def kill_serverapp(self) -> int:
        """SIGKILL every running ServerApp process (a server crash); return how many died."""
        pids = self.serverapp_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def stop_run(self, run_id: int) -> None:
        """Ask the SuperLink to stop ``run_id`` (``flwr stop``); a finished run is left alone."""
        if not str(self.run_status(run_id)["status"]).startswith("finished"):
            self.flwr("stop", str(run_id), CONNECTION)

    # ---- runs ------------------------------------------------------------------------------
    def submit(self, app_dir: Path, run_config: Mapping[str, object] | None = None) -> int:
        """Submit ``app_dir`` with ``flwr run`` and return the run id (does not wait)."""
        args = ["run", str(app_dir), CONNECTION, "--format", "json"]
        if run_config:
            args += ["--run-config", format_config(run_config)]
        out = self.flwr(*args, timeout_s=120.0)
        match = re.search(r'"run-id":\s*"(\d+)"', out)
        if match is None:
            raise DeployError(f"`flwr run` printed no run id:\n{out[-3000:]}")
        return int(match.group(1))

    def run_status(self, run_id: int) -> dict[str, object]:
        """The SuperLink's record of ``run_id`` (``flwr list --run-id``)."""
        out = self.flwr("list", CONNECTION, "--run-id", str(run_id), "--format", "json")
        data = json.loads(out[out.index("{"):])
        runs = data.get("runs", [])
        if not runs:
            raise DeployError(f"run {run_id} unknown to the SuperLink: {out[-1000:]}")
        return dict(runs[0])

    def wait_run(self, run_id: int, timeout_s: float, poll_s: float = 2.0,
                 on_poll: Callable[[], None] | None = None) -> RunResult:
        """Poll ``run_id`` until it finishes or ``timeout_s`` passes, then fetch its log;
        ``on_poll`` is called at every poll and once at the end (e.g. to show progress).

        Raises
        ------
        DeployError
            When the run does not finish in time (it is stopped first).
        """
        start_s = time.monotonic()
        while True:
            status = self.run_status(run_id)
            if on_poll is not None:
                on_poll()
            if str(status["status"]).startswith("finished"):
                break
            if time.monotonic() - start_s > timeout_s:
                self.flwr("stop", str(run_id), CONNECTION)
                raise DeployError(
                    f"run {run_id} still {status['status']!r} after {timeout_s:.0f} s; stopped it"
                )
            time.sleep(poll_s)
        log = self.flwr("log", str(run_id), CONNECTION, "--show")
        return RunResult(run_id, str(status["status"]), log, time.monotonic() - start_s, status)

    def run(
        self,
        app_dir: Path,
        run_config: Mapping[str, object] | None = None,
        timeout_s: float = 300.0,
    ) -> RunResult:
        """Submit ``app_dir`` and wait for it to finish."""
        return self.wait_run(self.submit(app_dir, run_config), timeout_s)

    def log_tails(self, names: Iterable[int] | None = None) -> str:
        """The ends of the SuperLink's and SuperNodes' logs, for error reports."""
        parts = [f"--- superlink\n{self.superlink.tail() if self.superlink else ''}"]
        for index in names if names is not None else self.supernodes:
            parts.append(f"--- supernode{index}\n{self.supernodes[index].tail()}")
        return "\n".join(parts)
