"""Reference phones in a deployment: the bridge, a SuperNode per phone beside it, each phone
behind its own shaped link.

``python -m simulations deploy --nodes N --phones P --link lte`` runs N SuperNodes behind their
links (``cluster.Deployment``) and P reference phones (``python -m android_bridge phone``, on
this CPU or in the emulated arm64 environment of ``make arm``), one federation of N + P
clients. A phone reaches the federation as it would in the field: over its own link (a
namespace, tbf and the userspace proxy, exactly as a SuperNode's) to the phone bridge
(``python -m android_bridge serve``, TLS with ``--tls``), whose SuperNodes sit next to the
SuperLink, unshaped, as a server's would. Client keys: SuperNodes ``0..N-1``, phones
``N..N+P-1`` (a phone trains on that partition of the run's task).

What a phone runs is exported for the run first (``android_bridge.export.export_run``: the
run's task, its own ``module:callable`` too, its method's phone config, batch size, lr, seed).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from android_bridge.export import MANIFEST_FILE, export_run
from android_bridge.notices import quiet_toolchain
from dgc.errors import ConfigError

from .certs import make_tls
from .errors import DeployError
from .files import private_dir, write_private
from .links import LinkSet, NodeLink
from .presets import LinkSpec
from .processes import ManagedProcess
from .toml_values import toml_value

ARCHES = ("host", "arm64")


def device_id(k: int) -> str:
    """The device id of phone ``k``."""
    return f"phone-{k}"


class PhoneFleet:
    """The phones of one deployment: their export, tokens, bridge, links and processes.

    Parameters
    ----------
    count : int
        Phones, 1 to 50.
    first_key : int
        Client key (partition id) of phone 0: the number of SuperNodes.
    workdir : Path
        The deployment's folder (``phones/`` is made in it).
    arch : str
        ``host`` (this CPU) or ``arm64`` (qemu-user, ``make arm``).
    tls : bool
        The bridge serves TLS with a certificate made for the run (phones pin its CA).
    env : mapping
        Environment of the bridge and phone processes (the deployment's).
    timeout_s : float
        How long a round waits for a phone (the bridge app's ``bridge-timeout-s``).
    """

    def __init__(self, count: int, first_key: int, workdir: Path, arch: str = "host",
                 tls: bool = False, env: Mapping[str, str] | None = None,
                 timeout_s: float = 600.0) -> None:
        if not isinstance(count, int) or not 1 <= count <= 50:
            raise DeployError(f"--phones {count!r}: expected an integer in 1..50")
        if arch not in ARCHES:
            raise DeployError(f"--phone-arch {arch!r}: expected one of {list(ARCHES)}")
        self.count, self.first_key, self.arch, self.tls = count, first_key, arch, tls
        self.dir = private_dir(workdir / "phones")
        self.env = dict(env or os.environ)
        self.timeout_s = timeout_s
        self.tokens = {device_id(k): secrets.token_hex(16) for k in range(count)}
        self.devices_file = self.dir / "devices.json"
        write_private(self.devices_file, json.dumps(self.tokens).encode())
        self.bridge_dir = self.dir / "bridge"
        self.control = f"unix:{self.bridge_dir / 'control' / 'bridge.sock'}"
        self.export_dir = self.dir / "export"
        self.bridge: ManagedProcess | None = None
        self.bridge_port = 0
        self.links: LinkSet | None = None
        self.phone_links: dict[int, NodeLink] = {}
        self.procs: dict[int, ManagedProcess] = {}
        self.ca: Path | None = None

    # -- the SuperNodes' side ---------------------------------------------------------------
    def owns(self, index: int) -> bool:
        """Whether SuperNode ``index`` of the deployment stands for a phone."""
        return self.first_key <= index < self.first_key + self.count

    def node_config(self, index: int) -> dict[str, object]:
        """Node config of phone SuperNode ``index``: the phone it serves and the bridge."""
        k = index - self.first_key
        return {"device-id": device_id(k), "bridge-control": self.control,
                "state-dir": str(self.bridge_dir / "held-models"),
                "bridge-timeout-s": float(self.timeout_s)}

    # -- export, bridge, phones ---------------------------------------------------------------
    def export(self, config: Any, reuse: Path | None = None) -> bool:
        """Export the phones' files for the run of ``config`` (a RunConfig) into ``reuse``, or
        the fleet's folder; an export already in ``reuse`` is used as it is (a phone refuses a
        task its export cannot run, naming the key). Returns whether it exported."""
        if reuse is not None:
            self.export_dir = reuse.resolve()
            if (self.export_dir / MANIFEST_FILE).exists():
                return False
        quiet_toolchain()
        try:
            export_run(config, self.export_dir)
        except ConfigError as err:  # what an export refuses, naming the key
            raise DeployError(f"cannot export the phones' files for this run: {err}") from err
        return True

    def start_bridge(self, spec: LinkSpec | None, mode: str, seed: int,
                     startup_timeout_s: float) -> None:
        """Start ``python -m android_bridge serve`` on loopback (TLS with ``tls``), and the
        phones' links towards it."""
        self.links = LinkSet(spec, mode, seed=seed + 1000)
        argv = [sys.executable, "-m", "android_bridge", "serve", "--devices",
                str(self.devices_file), "--listen", "127.0.0.1:0", "--workdir",
                str(self.bridge_dir), "--timeout-s", str(self.timeout_s)]
        if self.tls:
            files = make_tls(self.dir / "tls", self.links.host_addresses(self.count))
            self.ca = files.ca_cert
            argv += ["--cert", str(files.server_cert), "--key", str(files.server_key)]
        else:
            argv.append("--insecure")
        self.bridge = ManagedProcess("bridge", argv, self.dir / "logs" / "bridge.log",
                                     env=self.env).start()
        self.bridge.wait_for_log(r"phones connect to", startup_timeout_s)
        found = re.findall(r"phones connect to [^ ]*:(\d+) ", self.bridge.log_text())
        if not found:
            raise DeployError(f"the bridge logged no port:\n{self.bridge.tail()}")
        self.bridge_port = int(found[-1])

    def start_phones(self, config: Any) -> None:
        """Start every phone behind its link, on its partition of the run's task."""
        assert self.links is not None and self.bridge_port
        # The run's keys, so that a phone loads the data client.app gives its key.
        flat = config.to_flat()
        run_keys = self.dir / "run.toml"
        run_keys.write_text("".join(f"{json.dumps(k)} = {toml_value(k, v)}\n"
                                    for k, v in sorted(flat.items())))
        for k in range(self.count):
            link = self.links.build(k, "127.0.0.1", self.bridge_port)
            self.phone_links[k] = link
            argv = [sys.executable, "-m", "android_bridge", "phone", "--export",
                    str(self.export_dir), "--bridge", link.address, "--device", device_id(k),
                    "--token-file", str(self.devices_file), "--run-config", str(run_keys),
                    "--partition-id", str(self.first_key + k), "--arch", self.arch,
                    "--report", str(self.dir / f"{device_id(k)}.json"),
                    "--task-timeout-s", str(self.timeout_s)]
            if self.ca is not None:
                argv += ["--ca", str(self.ca)]
            self.procs[k] = ManagedProcess(device_id(k), argv,
                                           self.dir / "logs" / f"{device_id(k)}.log",
                                           env=self.env, netns=link.netns).start()

    def check(self) -> None:
        """Raise :class:`DeployError` when a phone or the bridge has exited: a phone serves
        until it is stopped, so its exit is a failure the run would otherwise only meet as a
        round's timeout."""
        for proc in [*self.procs.values(), *([self.bridge] if self.bridge else [])]:
            code = proc.returncode()
            if code is not None:
                raise DeployError(f"{proc.name} exited ({code}) while the run went on:\n"
                                  f"{proc.tail()}")

    def stop(self) -> list[str]:
        """Stop the phones, the bridge and the phones' links; the problems met, if any."""
        problems = []
        for proc in [*self.procs.values(), *([self.bridge] if self.bridge else [])]:
            try:
                proc.stop(timeout_s=5.0)
            except DeployError as err:
                problems.append(str(err))
        if self.links is not None:
            self.links.stop()
        return problems

    # -- what they did ----------------------------------------------------------------------
    def reports(self) -> dict[int, dict[str, Any]]:
        """Each phone's rounds, as its ``--report`` file holds them (empty when it wrote none)."""
        out = {}
        for k in range(self.count):
            path = self.dir / f"{device_id(k)}.json"
            try:
                out[k] = json.loads(path.read_text())
            except (OSError, ValueError):
                out[k] = {"device": device_id(k), "rounds": []}
        return out

    def log_tails(self) -> str:
        """The ends of the bridge's and phones' logs, for error reports."""
        parts = [f"--- bridge\n{self.bridge.tail() if self.bridge else ''}"]
        parts += [f"--- {p.name}\n{p.tail()}" for p in self.procs.values()]
        return "\n".join(parts)
