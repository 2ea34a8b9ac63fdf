"""The phone bridge path, measured: reference phones in their own namespaces behind shaped
links, the bridge and a federation on this host, every packet of each phone's link captured.

``python -m simulations wire bridge --link lte --method dgc --task mnist5k --phones 2
--rounds 3 --out DIR``

Each phone (:mod:`.phone_process`, ExecuTorch ``.pte`` files exported for the run) dials the
bridge through its link (a veth pair shaped with ``tbf``, the userspace proxy for latency, as
``deploy`` does for SuperNodes); the federation is ``server.app.run_server`` on a
``LocalGrid`` whose ClientApp hands every train round to the node's phone
(``android_bridge.bridge_app``). ``--method dense`` runs what dense FedAvg sends through the
bridge: the phone's update with every tensor dense in float32 (topk's keys for it,
``fedgc.methods.topk.PHONE_DENSE``: the bytes of dense FedAvg's update, no indices) and the
exact model down.
The ledger goes to ``<out>/<run>/wire.json`` and is printed.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from android_bridge.bridge import PhoneBridge
from android_bridge.bridge_app import make_bridge_app
from android_bridge.export import exact_config, export_all, phone_config
from client.app import task_of
from fedgc.methods.topk import PHONE_DENSE
from fedgc.settings import RunConfig
from server.app import run_server
from server.local_grid import LocalGrid
from simulations.deploy.capture import PacketCapture
from simulations.deploy.capture_report import payload_in_clients_csv
from simulations.deploy.certs import make_tls
from simulations.deploy.files import private_dir
from simulations.deploy.links import LinkSet, choose_mode
from simulations.deploy.presets import preset, preset_names
from simulations.deploy.processes import ManagedProcess

from .bridge_link import analyse_phone
from .errors import WireError
from .report import format_table, summarize, write_wire

#: The measured variants (``--method``): ``dgc``, a default fedgc run, as a phone exported
#: with no options takes it; ``dense``, dense FedAvg through the bridge: every tensor of the
#: update dense in float32 up (the phone's encode_dense: values only, as dense FedAvg's
#: arrays; topk's keys for it, ``fedgc.methods.topk.PHONE_DENSE``), the exact model down.
VARIANTS = ("dense", "dgc")


def run_config(task: str, variant: str, phones: int, rounds: int, seed: int,
               results_dir: Path, run_name: str) -> Any:
    """The federation's RunConfig for ``variant`` (see :data:`VARIANTS`)."""
    if variant not in VARIANTS:
        raise WireError(f"--method {variant!r} unknown, expected one of {sorted(VARIANTS)}")
    keys = {"dense": PHONE_DENSE, "dgc": {"method": "dgc"}}[variant]
    return RunConfig.from_flat({
        "task": task, "num_clients": phones, "clients_per_round": phones, "rounds": rounds,
        "seed": seed, "progress": False, "results_dir": str(results_dir),
        "run_name": run_name, "overwrite": True, **keys})


def export_for(config: Any, out: Path) -> Path:
    """The phone files for ``config`` (exported once into ``out``)."""
    t = config.train
    if (out / "manifest.json").exists():
        return out
    model = task_of(t.task_spec()).build_model()
    largest = max(p.numel() for p in model.parameters())
    export_all(t.task, out, exact_config(phone_config(config)), batch_size=t.batch_size,
               learning_rate=t.lr, seed=t.seed, max_numel=largest)
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the phones, the bridge and the federation; return the wire ledger."""
    import grpc

    out = Path(args.out).resolve()
    name = args.run_name or f"bridge-{args.method}-{args.link}-{'tls' if args.tls else 'plain'}"
    config = run_config(args.task, args.method, args.phones, args.rounds, args.seed,
                        out, name)
    work = private_dir(out / "work" / name)
    export = export_for(config, private_dir(out / "work" / f"export-{args.task}-{args.method}"))
    mode, detail = choose_mode(args.shaping)
    if mode not in ("tbf", "netem"):
        raise WireError(f"the bridge measurement captures on namespaced links; shaping mode "
                        f"{mode!r} has none ({detail})")
    links = LinkSet(preset(args.link), mode, seed=args.seed)
    tokens = {f"phone-{i}": secrets.token_hex(16) for i in range(args.phones)}
    credentials = None
    ca = None
    if args.tls:
        files = make_tls(work / "tls", links.host_addresses(args.phones))
        credentials = grpc.ssl_server_credentials(
            [(files.server_key.read_bytes(), files.server_cert.read_bytes())])
        ca = files.ca_cert
    captures: dict[int, PacketCapture] = {}
    phones: dict[int, ManagedProcess] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", ""))
        if p)}
    t = config.train
    bridge = PhoneBridge(tokens, "127.0.0.1:0", credentials, **(args.bridge_options or {}))
    bridge.start()
    try:
        for i in range(args.phones):
            link = links.build(i, "127.0.0.1", int(bridge.port or 0))
            assert link.veth is not None
            captures[i] = PacketCapture(link.veth.host_dev, work / f"phone{i}.pcap").start()
            argv = [sys.executable, "-m", "simulations.wire.phone_process",
                    "--export", str(export), "--device", f"phone-{i}",
                    "--token", tokens[f"phone-{i}"], "--target", link.address,
                    "--task", t.task, "--partition-id", str(i),
                    "--num-clients", str(args.phones), "--partition", t.partition,
                    "--alpha", str(t.alpha), "--seed", str(t.seed),
                    "--rounds", str(args.rounds), "--calls", str(work / f"phone{i}.calls.json")]
            if ca is not None:
                argv += ["--ca", str(ca)]
            phones[i] = ManagedProcess(f"phone{i}", argv, work / f"phone{i}.log", env=env,
                                       netns=link.netns).start()
        app = make_bridge_app(bridge, {i: f"phone-{i}" for i in range(args.phones)},
                              timeout_s=args.timeout_s)
        summary = run_server(LocalGrid(app, args.phones, seed=1), config)
        deadline = time.monotonic() + 60.0  # each phone exits after its last round
        while any(p.running() for p in phones.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for proc in phones.values():
            proc.stop(timeout_s=5.0)
        for capture in captures.values():
            capture.stop()
        links.stop()
        bridge.stop()
    nodes = {i: analyse_phone(work / f"phone{i}.pcap", work / f"phone{i}.calls.json")
             for i in range(args.phones)}

    ledger = summarize(nodes, "bridge", {
        "link": args.link, "tls": bool(args.tls), "method": args.method, "task": t.task,
        "bridge_options": dict(args.bridge_options or {}),
        "final_accuracy": summary.get("final_accuracy"),
        "payload_clients_csv": payload_in_clients_csv(config.run_dir),
        "capture_dir": str(work),
    })
    write_wire(config.run_dir, ledger)
    return ledger


def parser() -> argparse.ArgumentParser:
    """Options of ``python -m simulations wire bridge``."""
    p = argparse.ArgumentParser(prog="python -m simulations wire bridge",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="lte", choices=preset_names())
    p.add_argument("--method", default="dgc", choices=sorted(VARIANTS))
    p.add_argument("--task", default="mnist5k")
    p.add_argument("--phones", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plaintext", dest="tls", action="store_false",
                   help="no TLS (to check the HTTP/2 split against the frames themselves)")
    p.add_argument("--shaping", default="auto", choices=["auto", "tbf", "netem"])
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--out", default="results/wire-bridge")
    p.add_argument("--run-name", default=None)
    return p


def main(argv: Sequence[str]) -> int:
    """Measure and print the ledger."""
    args = parser().parse_args(list(argv))
    args.bridge_options = {}
    print(format_table(measure(args)))
    return 0
