"""``python -m android_bridge serve``: the phone bridge, its control socket, a SuperNode per phone.

One process holds what must outlive a round: the TLS gRPC server phones talk to
(:class:`android_bridge.bridge.PhoneBridge`: sessions, resumable uploads, acknowledgements) and
the control socket a SuperNode's ClientApp hands its train rounds through
(:mod:`android_bridge.control`). With ``--superlink`` it also starts one ``flower-supernode``
per device of ``--devices``, whose node config names the phone (``device-id``), the control
socket (``bridge-control``), where the bridge app keeps the model each phone holds
(``state-dir``) and the phone's client key (``partition-id``: the i-th device gets
``--first-key + i``). The run's ClientApp must be ``android_bridge.bridge_app:app`` (the
repository's ``pyproject.toml`` names it): on a node with a ``device-id`` it serves the train
rounds through the phone, on any other node it is ``client.app``.

Everything it starts it stops on SIGINT or SIGTERM (the SuperNodes first, then the servers),
and the command exits 0; a SuperNode that exits is restarted, as a device's service manager
would. ``docs/android.md`` has a session to copy.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Device ids name the bridge app's records on disk (``client.state``'s key pattern).
DEVICE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_STOP_S = 5.0


class ServeError(RuntimeError):
    """A bad option or file; the message names it."""


def load_devices(path: str | Path) -> dict[str, str]:
    """``{"device id": "token", ...}`` from a JSON file, each id a name the store accepts and
    each token at least 16 characters; ServeError naming the file and entry otherwise."""
    try:
        devices = json.loads(Path(path).read_text())
    except OSError as ex:
        raise ServeError(f"--devices {path}: cannot read it: {ex.strerror or ex}") from None
    except ValueError as ex:
        raise ServeError(f"--devices {path} is not JSON: {ex}") from None
    if not isinstance(devices, dict) or not devices:
        raise ServeError(f"--devices {path} must hold a JSON object of device id -> token, "
                         f"with at least one device")
    for device, token in devices.items():
        if not DEVICE_ID.match(device):
            raise ServeError(f"--devices {path}: device id {device!r} must match "
                             f"{DEVICE_ID.pattern}")
        if not isinstance(token, str) or len(token) < 16:
            raise ServeError(f"--devices {path}: the token of {device!r} must be a string of "
                             f"at least 16 characters")
    return devices


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _supernode_binary() -> str | None:
    """``flower-supernode`` of this Python's environment, else the one on PATH."""
    beside = Path(sys.executable).parent / "flower-supernode"
    return str(beside) if beside.exists() else shutil.which("flower-supernode")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value) if isinstance(value, int) else json.dumps(value)


def node_config(device: str, key: int, control: str, state_dir: Path,
                extra: str = "") -> str:
    """The ``--node-config`` of the SuperNode of phone ``device`` (client key ``key``)."""
    values: dict[str, Any] = {"device-id": device, "partition-id": key,
                              "bridge-control": control, "state-dir": str(state_dir)}
    text = " ".join(f"{k}={_toml(v)}" for k, v in values.items())
    return f"{text} {extra}".strip()


class SuperNodes:
    """One ``flower-supernode`` per phone, each in a process group of its own, restarted when
    it exits and stopped (SIGTERM, then SIGKILL) on :meth:`stop`."""

    def __init__(self, argvs: dict[str, list[str]], logs: Path) -> None:
        self.argvs, self.logs = argvs, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.restarts: dict[str, int] = {}

    def start(self, device: str) -> None:
        """Start (or restart) the SuperNode of ``device``; its output goes to its log."""
        with open(self.logs / f"supernode-{device}.log", "ab") as log:
            self.procs[device] = subprocess.Popen(
                self.argvs[device], stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def check(self) -> None:
        """Restart every SuperNode that exited, saying so."""
        for device, proc in list(self.procs.items()):
            if proc.poll() is not None:
                self.restarts[device] = self.restarts.get(device, 0) + 1
                print(f"[bridge] the SuperNode of {device} exited ({proc.returncode}); "
                      f"restarting it", flush=True)
                self.start(device)

    def stop(self) -> None:
        """SIGTERM every group, SIGKILL what is left after 5 s (its SuperExec follows its
        parent out: Flower's ``--parent-pid`` monitor)."""
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_S
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(_STOP_S)


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def parser() -> argparse.ArgumentParser:
    """The options of ``serve``."""
    p = argparse.ArgumentParser(
        prog="python -m android_bridge serve",
        description="Serve phones: the TLS bridge they connect to, the control socket a "
                    "SuperNode's ClientApp hands train rounds through, and (with --superlink) a "
                    "SuperNode per phone.")
    p.add_argument("--devices", required=True,
                   help="JSON file {\"device id\": \"token\", ...}: the phones that may register")
    p.add_argument("--listen", default="127.0.0.1:8443",
                   help="host:port phones connect to (default 127.0.0.1:8443; port 0: any)")
    p.add_argument("--cert", help="PEM certificate chain of the bridge (TLS)")
    p.add_argument("--key", help="PEM private key of --cert")
    p.add_argument("--insecure", action="store_true",
                   help="plaintext, for a bridge on a loopback address only")
    p.add_argument("--workdir", help="the control socket, the models the phones hold, the "
                                     "SuperNodes' logs (default: a new private folder)")
    p.add_argument("--superlink", help="host:port of the SuperLink's Fleet API: start one "
                                       "SuperNode per device")
    p.add_argument("--superlink-ca", help="PEM CA of the SuperLink (default: --insecure "
                                          "towards it)")
    p.add_argument("--first-key", type=int, default=0,
                   help="client key (partition id) of the first device; the next get the next")
    p.add_argument("--node-config", default="",
                   help="more node config for every SuperNode, Flower's syntax "
                        "(e.g. 'allowed-callables=\"task=my_pkg.task:build\"')")
    p.add_argument("--timeout-s", type=float, default=600.0,
                   help="how long a round waits for a phone's update (default 600)")
    p.add_argument("--poll-interval-s", type=float, default=1.0,
                   help="how long a phone waits between two FetchTask polls while it has no "
                        "task (default 1)")
    return p


def main(argv: Sequence[str]) -> int:
    """Run until SIGINT or SIGTERM; 0 then, 2 on a bad option or file."""
    args = parser().parse_args(list(argv))
    try:
        return _serve(args)
    except ServeError as ex:
        print(f"python -m android_bridge serve: error: {ex}", file=sys.stderr)
        return 2


def _credentials(args: argparse.Namespace) -> Any:
    import grpc

    if args.insecure:
        if args.cert or args.key:
            raise ServeError("--insecure with --cert/--key: choose one")
        if not _is_loopback(args.listen):
            raise ServeError(f"--insecure listens in plaintext, so only on a loopback address; "
                             f"--listen {args.listen} is not one (give --cert and --key)")
        return None
    if not (args.cert and args.key):
        raise ServeError("phones connect over TLS: give --cert and --key (PEM), or --insecure "
                         "on a loopback address")
    try:
        return grpc.ssl_server_credentials([(Path(args.key).read_bytes(),
                                             Path(args.cert).read_bytes())])
    except OSError as ex:
        raise ServeError(f"cannot read {ex.filename}: {ex.strerror}") from None


def _serve(args: argparse.Namespace) -> int:
    # Imported here: start-up; a bad option is answered before torch loads.
    from android_bridge.bridge import BridgeError, PhoneBridge
    from android_bridge.control import control_address, serve_control

    devices = load_devices(args.devices)
    credentials = _credentials(args)
    if not 0 < args.timeout_s <= 86_400:
        raise ServeError(f"--timeout-s {args.timeout_s}: expected seconds in (0, 86400]")
    if not 0 < args.poll_interval_s <= 600:
        raise ServeError(f"--poll-interval-s {args.poll_interval_s}: expected seconds in "
                         f"(0, 600]")
    if args.superlink and _supernode_binary() is None:
        raise ServeError("--superlink: flower-supernode is neither beside this Python nor on "
                         "PATH (install flwr)")
    workdir = (Path(args.workdir) if args.workdir
               else Path(tempfile.mkdtemp(prefix="fedgc-bridge-"))).resolve()
    for folder in (workdir, workdir / "control", workdir / "held-models", workdir / "logs"):
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
    sock = workdir / "control" / "bridge.sock"
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    bridge = PhoneBridge(devices, args.listen, credentials, poll_interval_s=args.poll_interval_s,
                         max_streams=max(16, 2 * len(devices)))
    try:
        port = bridge.start()
    except BridgeError as ex:
        raise ServeError(f"--listen {args.listen}: {ex}") from None
    control = serve_control(bridge, sock, max_workers=len(devices) + 8)
    nodes = None
    try:
        host = args.listen.rsplit(":", 1)[0]
        print(f"[bridge] phones connect to {host}:{port} "
              f"({'plaintext' if credentials is None else 'TLS'}); {len(devices)} devices: "
              f"{', '.join(devices)}", flush=True)
        print(f"[bridge] control socket {control_address(sock)}; workdir {workdir}", flush=True)
        if args.superlink:
            nodes = _supernodes(args, devices, control_address(sock), workdir)
        while not stop.wait(1.0):
            if nodes is not None:
                nodes.check()
    finally:
        if nodes is not None:
            nodes.stop()
        control.stop(1.0).wait()
        bridge.stop()
        print("[bridge] stopped", flush=True)
    return 0


def _supernodes(args: argparse.Namespace, devices: dict[str, str], control: str,
                workdir: Path) -> Any:
    tls = (["--root-certificates", str(Path(args.superlink_ca).resolve())]
           if args.superlink_ca else ["--insecure"])
    argvs = {}
    for i, device in enumerate(devices):
        argvs[device] = [str(_supernode_binary()), "--superlink", args.superlink, *tls,
                         "--port", str(_free_port()), "--node-config",
                         node_config(device, args.first_key + i, control,
                                     workdir / "held-models",
                                     f"bridge-timeout-s={float(args.timeout_s)!r} "
                                     f"{args.node_config}")]
    nodes = SuperNodes(argvs, workdir / "logs")
    for device in devices:
        nodes.start(device)
        print(f"[bridge] SuperNode of {device} (client key "
              f"{args.first_key + list(devices).index(device)}) -> {args.superlink}; log "
              f"{workdir / 'logs' / f'supernode-{device}.log'}", flush=True)
    return nodes
