"""``python -m android_bridge phone``: a reference phone that serves a bridge's tasks, x86 or arm64.

The phone (:class:`android_bridge.phone.ReferencePhone`) registers with the bridge, waits for a
task, trains, compresses, uploads, and again, until ``--rounds`` tasks are done (0: until
SIGINT or SIGTERM), printing one line per round. Its data is the partition a simulated client
of the same key gets: ``--set`` / ``--run-config`` give the run's keys (``task``,
``task_options``, ``num_clients``, ``partition``, ``alpha``, ``seed``; any task, your own
``module:callable`` included: the phone's owner names it, as a node's ``allowed-callables``
does) and ``--partition-id`` the key; or ``--data`` an ``.npz`` of ``x`` (float32) and ``y``
(int64).

``--arch arm64`` runs the same phone in the emulated arm64 environment of ``make arm``
(``android_bridge.arm``: qemu-user, Debian's aarch64 Python and the aarch64 wheels): the host
loads the partition and hands it over as ``--data``, the emulated process imports nothing else
of the host's. Under emulation importing torch and ExecuTorch takes about a minute of CPU.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from android_bridge.arm.emulator import ArmEnv, ArmEnvError
from android_bridge.notices import quiet_toolchain


class PhoneCliError(RuntimeError):
    """A bad option or file; the message names it."""


def parser() -> argparse.ArgumentParser:
    """The options of ``phone``."""
    p = argparse.ArgumentParser(
        prog="python -m android_bridge phone",
        description="A reference phone: the exported .pte files, its own data, the bridge's "
                    "gRPC API. One line per round.")
    p.add_argument("--export", required=True, help="folder of `python -m android_bridge export`")
    p.add_argument("--bridge", required=True, help="host:port of the bridge")
    p.add_argument("--device", required=True, help="this phone's device id")
    token = p.add_mutually_exclusive_group(required=True)
    token.add_argument("--token", help="this phone's token")
    token.add_argument("--token-file", help="a file holding the token (or the bridge's devices "
                                            "JSON, whose entry for --device is used)")
    p.add_argument("--ca", help="PEM of the CA that signed the bridge's certificate (TLS); "
                                "without it the phone connects in plaintext")
    p.add_argument("--server-name", help="name to check the bridge's certificate against")
    p.add_argument("--data", help=".npz with x (float32) and y (int64): the phone's data")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                   help="a run key (as `python -m simulations run --set`) that picks the data")
    p.add_argument("--run-config", metavar="FILE", help="TOML file of run keys")
    p.add_argument("--partition-id", type=int, help="the phone's client key: its partition")
    p.add_argument("--rounds", type=int, default=0, help="tasks to serve (0: until stopped)")
    p.add_argument("--task-timeout-s", type=float, default=600.0,
                   help="give up when no task comes for this long (default 600)")
    p.add_argument("--report", help="write every round's figures to this JSON file")
    p.add_argument("--arch", choices=("host", "arm64"), default="host",
                   help="host: this machine's CPU; arm64: the emulated phone of `make arm`")
    return p


def _token(args: argparse.Namespace) -> str:
    if args.token:
        return str(args.token)
    try:
        text = Path(args.token_file).read_text().strip()
    except OSError as ex:
        raise PhoneCliError(f"--token-file {args.token_file}: {ex.strerror or ex}") from None
    if text.startswith("{"):
        devices = json.loads(text)
        if args.device not in devices:
            raise PhoneCliError(f"--token-file {args.token_file} has no entry for "
                                f"{args.device!r}")
        return str(devices[args.device])
    return text


def phone_data(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: ``--data``, or the partition ``--partition-id`` of the run's task."""
    if args.data:
        if args.set or args.run_config:
            raise PhoneCliError("--data and --set/--run-config both pick the data: give one")
        try:
            with np.load(args.data) as f:
                return np.asarray(f["x"], dtype=np.float32), np.asarray(f["y"], dtype=np.int64)
        except (OSError, KeyError, ValueError) as ex:
            raise PhoneCliError(f"--data {args.data}: expected an .npz with x and y: "
                                f"{ex}") from None
    if args.partition_id is None:
        raise PhoneCliError("give --partition-id (the phone's client key) with --set, or --data")
    # Imported here: start-up; a phone given --data loads neither Flower nor the run's task.
    from client.app import client_data
    from fedgc.schema import load_toml
    from fedgc.settings import RunConfig, SettingsError

    values: dict[str, object] = {}
    try:
        if args.run_config:
            values.update(load_toml(args.run_config))
        for item in args.set:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise PhoneCliError(f"--set expects key=value, got {item!r}")
            values[key.strip()] = value.strip()
        t = RunConfig.from_flat(values).train
        if not 0 <= args.partition_id < t.num_clients:
            raise PhoneCliError(f"--partition-id {args.partition_id}: expected 0.."
                                f"{t.num_clients - 1} (num_clients = {t.num_clients})")
        # The data client.app trains on for the same key. The task's module:callable is the
        # command's own --set (this user's config, as for export): any is allowed (None).
        x, y = client_data(t, args.partition_id, None)
    except SettingsError as ex:
        raise PhoneCliError(str(ex)) from None
    return x.numpy(), y.numpy()


def main(argv: Sequence[str]) -> int:
    """Serve tasks; 0 after ``--rounds`` or a signal, 1 when the bridge fails the phone, 2 on a
    bad option."""
    args = parser().parse_args(list(argv))
    try:
        if args.arch == "arm64":
            return _on_arm64(args, list(argv))
        return _serve(args)
    except PhoneCliError as ex:
        print(f"python -m android_bridge phone: error: {ex}", file=sys.stderr)
        return 2


def _on_arm64(args: argparse.Namespace, argv: list[str]) -> int:
    """Hand the partition over as ``--data`` and run this command in the emulated phone."""
    try:
        env = ArmEnv.find()
    except ArmEnvError as ex:
        raise PhoneCliError(str(ex)) from None
    x, y = phone_data(args)
    inner = _without(argv, {"--arch", "--set", "--run-config", "--data", "--partition-id"})
    with tempfile.TemporaryDirectory(prefix="fedgc-phone-") as tmp:
        data = Path(tmp) / "data.npz"
        np.savez(data, x=x, y=y)
        paths = {"--export", "--ca", "--token-file", "--report"}
        for i, item in enumerate(inner[:-1]):
            if item in paths:
                inner[i + 1] = str(Path(inner[i + 1]).resolve())
        proc = env.popen("-m", "android_bridge", "phone", *inner, "--data", str(data))
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            return proc.wait()


def _without(argv: list[str], options: set[str]) -> list[str]:
    """``argv`` without ``options`` and their values (``--opt v`` and ``--opt=v``)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        name = item.split("=", 1)[0]
        if name in options:
            skip = "=" not in item
            continue
        out.append(item)
    return out


def _serve(args: argparse.Namespace) -> int:
    import grpc

    quiet_toolchain()
    # Imported here, after the filters (importing the toolchain logs); start-up without torch.
    from android_bridge.phone import ReferencePhone

    x, y = phone_data(args)
    ca = None
    if args.ca:
        try:
            ca = Path(args.ca).read_bytes()
        except OSError as ex:
            raise PhoneCliError(f"--ca {args.ca}: {ex.strerror or ex}") from None
    stopping = {"signal": 0}

    def stop(signum: int, frame: Any) -> None:
        stopping["signal"] = signum
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    phone = ReferencePhone(args.export, args.device, _token(args), args.bridge, x, y,
                           root_certificates=ca, server_name=args.server_name)
    reports: list[dict[str, Any]] = []
    print(f"[{args.device}] {len(x)} examples, {platform.machine()} "
          f"({'TLS' if ca else 'plaintext'} to {args.bridge})", flush=True)
    try:
        _register(phone, args.task_timeout_s)
        while args.rounds <= 0 or len(reports) < args.rounds:
            task = _next_task(phone, args.task_timeout_s)
            started = time.monotonic()
            report = phone.run_round(task)
            row = {"round": report.server_round, "uplink_bytes": report.uplink_bytes,
                   "signs_bytes": report.side_bytes, "downlink_bytes": len(task.model_bytes),
                   "encoding": "patch" if task.encoding == 2 else "dense",
                   "restored": report.restored, "train_loss": report.train_loss,
                   "ack": _ACK.get(report.ack_state, str(report.ack_state)),
                   "seconds": round(time.monotonic() - started, 3)}
            reports.append(row)
            # Written every round: a phone blocked in a long poll (FetchTask held up to the
            # bridge's max_wait_s) may be killed before its signal handler runs.
            _write_report(args, reports)
            print(f"[{args.device}] round {row['round']}: got {row['downlink_bytes']:,} B "
                  f"({row['encoding']}), sent {row['uplink_bytes']:,} B (signs "
                  f"{row['signs_bytes']:,} B), loss {row['train_loss']:.4f}, restored "
                  f"{'yes' if row['restored'] else 'no'}, {row['ack']}", flush=True)
    except KeyboardInterrupt:
        print(f"[{args.device}] stopped after {len(reports)} rounds", flush=True)
    except (grpc.RpcError, TimeoutError, ConnectionError) as ex:
        detail = ex.details() if isinstance(ex, grpc.RpcError) else str(ex)
        print(f"[{args.device}] error: {detail}", file=sys.stderr, flush=True)
        return 1
    finally:
        phone.close()
        _write_report(args, reports)
    return 0


def _write_report(args: argparse.Namespace, reports: list[dict[str, Any]]) -> None:
    """``--report``: the rounds so far as JSON, replaced whole (a reader never sees half)."""
    if not args.report:
        return
    path = Path(args.report)
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps({"device": args.device, "machine": platform.machine(),
                                   "rounds": reports}, indent=1) + "\n")
    partial.replace(path)


_ACK = {1: "INCOMPLETE", 2: "DELIVERED", 3: "REJECTED", 4: "MISSED_ROUND"}


def _register(phone: Any, timeout_s: float) -> None:
    """Register, retrying while the bridge is not up yet (a phone started before it)."""
    import grpc

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            phone.register()
            return
        except grpc.RpcError as ex:
            if ex.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _next_task(phone: Any, timeout_s: float) -> Any:
    """The next task; re-registers when the bridge forgot the session (it restarted) and waits
    through a bridge that is briefly unreachable."""
    import grpc

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return phone.wait_for_task(max(1.0, deadline - time.monotonic()))
        except grpc.RpcError as ex:
            if time.monotonic() > deadline:
                raise
            if ex.code() == grpc.StatusCode.UNAUTHENTICATED:
                phone.register()
            elif ex.code() == grpc.StatusCode.UNAVAILABLE:
                time.sleep(1.0)
            else:
                raise
