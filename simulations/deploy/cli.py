"""``python -m simulations deploy``: run an app on a local deployment, or calibrate the links."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType

# Python 3.10 has no tomllib; tomli (a Flower dependency) is the same parser.
import tomli

from android_bridge.export import check_phone_privacy, check_phone_run
from dgc.errors import ConfigError
from fedgc.refs import ALLOWED_CALLABLES, is_ref
from fedgc.settings import SettingsError, new_run_name
from simulations.cli_common import load_config_file, summary_table
from simulations.cli_common import parse_sets as parse_run_sets

from .calibrate import measure, point_to_dict, predicted_transfer_s
from .capture_report import write_capture_ledger
from .cluster import Deployment, DeploymentConfig, default_node_config
from .errors import DeployError, DeployInterrupted
from .fedgc_run import (
    bytes_table,
    check_fedgc_run,
    deploy_run_config,
    finish_fedgc,
    format_nodes,
    link_stats,
    node_rows,
    submit_fedgc,
    write_deploy_record,
)
from .links import MODES, choose_mode
from .phones import PhoneFleet
from .presets import preset, preset_names

PROBE_APP = Path(__file__).resolve().parent / "probe_app"


def parse_sets(items: Sequence[str]) -> dict[str, object]:
    """``["rounds=3", "task=mnist5k"]`` -> ``{"rounds": 3, "task": "mnist5k"}``.

    Values are read as TOML (numbers, booleans, quoted strings); anything else is a string.

    Raises
    ------
    DeployError
        When an item has no ``=`` or an empty key.
    """
    out: dict[str, object] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise DeployError(f"--set expects key=value, got {item!r}")
        try:
            out[key] = tomli.loads(f"v = {raw.strip()}")["v"]
        except tomli.TOMLDecodeError:
            out[key] = raw.strip()
    return out


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m simulations deploy",
        description="Run a Flower app on one local SuperLink and N SuperNodes behind shaped "
                    "links (`python -m simulations deploy calibrate --help` for calibration).",
    )
    p.add_argument("--nodes", type=int, default=2, help="number of SuperNodes (default 2)")
    p.add_argument("--link", default=None, choices=preset_names(),
                   help="link preset of every SuperNode (default: unshaped loopback)")
    p.add_argument("--shaping", default="auto", choices=MODES,
                   help="how links are shaped (default: the best this machine supports)")
    p.add_argument("--tls", action="store_true", help="TLS with certificates made for the run")
    p.add_argument("--auth", action="store_true",
                   help="SuperNode authentication with registered keys (implies --tls)")
    p.add_argument("--app", default="fedgc",
                   help="'fedgc' (the real ServerApp/ClientApp, default), 'probe' (a numpy "
                        "FedAvg check), or an app folder with [tool.flwr.app]")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="fedgc: TOML file of run keys, as for `python -m simulations run`")
    p.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                   help="fedgc: a run key as for `python -m simulations run`; other apps: a "
                        "run-config override (repeatable)")
    p.add_argument("--workdir", default=None,
                   help="logs, certificates and state (default: a new temporary folder)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="bound on the whole run")
    p.add_argument("--seed", type=int, default=0, help="seeds the links' jitter and outages")
    p.add_argument("--phones", type=int, default=0,
                   help="fedgc: reference phones besides the SuperNodes, each behind its own "
                        "link to the phone bridge (clients --nodes..--nodes+phones-1)")
    p.add_argument("--phone-export", metavar="DIR",
                   help="the phones' files: exported for the run into DIR, or taken from DIR "
                        "when it holds an export (default: exported into the workdir)")
    p.add_argument("--phone-arch", choices=("host", "arm64"), default="host",
                   help="the phones' CPU: this machine's, or the emulated arm64 phone of "
                        "`make arm` (qemu-user; about a minute of CPU to start each)")
    p.add_argument("--poll-interval-s", type=float, default=None,
                   help="an idle SuperNode's pull interval (Flower's: 3 s)")
    p.add_argument("--heartbeat-interval-s", type=float, default=None,
                   help="SuperNode heartbeat interval (Flower's: 30 s; offline after 2)")
    p.add_argument("--keep-alive-s", type=float, default=None,
                   help="how long the SuperLink keeps an idle connection (Flower's: 5 s)")
    p.add_argument("--phone-settings", action="store_true",
                   help="fedgc's pick for phones (docs/deploy.md): "
                        + ", ".join(f"{k.replace('_', '-')} {v:g}"
                                    for k, v in PHONE_SETTINGS.items()))
    p.add_argument("--capture", action="store_true",
                   help="record every packet of each link (tcpdump; needs shaping tbf or "
                        "netem) and print where the bytes go (`python -m simulations wire`)")
    return p


def _calibrate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m simulations deploy calibrate",
        description="Time transfers on shaped real links and compare them with the analytic "
                    "prediction (rtt + bytes * 8 / bandwidth).",
    )
    p.add_argument("--presets", default="wifi,lte,lte-driving,3g,edge",
                   help="comma-separated presets")
    p.add_argument("--sizes", default="10000,100000,1000000",
                   help="comma-separated payload sizes in bytes")
    p.add_argument("--directions", default="up,down", help="up, down or both")
    p.add_argument("--shaping", default="auto", choices=MODES)
    p.add_argument("--max-predicted-s", type=float, default=12.0,
                   help="skip points whose predicted transfer is longer than this")
    p.add_argument("--repeats", type=int, default=2, help="transfers per point (fastest kept)")
    p.add_argument("--out", default=None, help="write the points as JSON here")
    return p


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def cmd_calibrate(argv: Sequence[str]) -> int:
    """Measure and print the calibration table; returns 1 when a point misses 15%."""
    args = _calibrate_parser().parse_args(argv)
    mode, detail = choose_mode(args.shaping)
    print(f"[deploy] link shaping mode: {mode} ({detail})", flush=True)
    try:
        sizes = [int(s) for s in _csv(args.sizes)]
    except ValueError:
        raise DeployError(f"--sizes must be comma-separated integers, got {args.sizes!r}") from None
    directions = _csv(args.directions)
    rows = []
    print(f"{'preset':<12} {'dir':<4} {'bytes':>9} {'measured s':>10} {'predicted s':>11} "
          f"{'error':>7}")
    for name in _csv(args.presets):
        spec = preset(name)
        for direction in directions:
            for size in sizes:
                if predicted_transfer_s(spec, size, direction) > args.max_predicted_s:
                    continue
                point = measure(spec, mode, size, direction, seed=0, repeats=args.repeats)
                rows.append(point_to_dict(point))
                print(f"{name:<12} {direction:<4} {size:>9} {point.measured_s:>10.3f} "
                      f"{point.predicted_s:>11.3f} {point.relative_error:>+7.1%}", flush=True)
    worst = max((abs(float(r["relative_error"])) for r in rows), default=0.0)
    print(f"{len(rows)} points, worst relative error {worst:.1%} (target 15%)")
    if args.out:
        Path(args.out).write_text(json.dumps({"mode": mode, "points": rows}, indent=2) + "\n")
    return 0 if worst <= 0.15 else 1


#: Flower settings fedgc picks for SuperNodes on phones (docs/deploy.md, "Settings for phones"):
#: a poll every 20 s lets an LTE radio leave its 11.6 s tail between polls; heartbeats every
#: 120 s (a dead node is marked offline within 240 s); connections kept 60 s so polls and
#: heartbeats reuse one connection instead of a TCP and TLS handshake each.
PHONE_SETTINGS = {"poll_interval_s": 20.0, "heartbeat_interval_s": 120.0, "keep_alive_s": 60.0}


def flower_settings(args: argparse.Namespace) -> dict[str, float]:
    """The poll, heartbeat and keep-alive settings of the command line (``--phone-settings``
    first, explicit options over it).

    Raises
    ------
    DeployError
        A value outside (0, 3600] seconds.
    """
    out = dict(PHONE_SETTINGS) if args.phone_settings else {}
    for key in PHONE_SETTINGS:
        value = getattr(args, key)
        if value is not None:
            if not (math.isfinite(value) and 0 < value <= 3600):
                raise DeployError(f"--{key.replace('_', '-')} {value!r}: expected seconds in "
                                  f"(0, 3600]")
            out[key] = float(value)
    return out


def _workdir(args: argparse.Namespace) -> Path:
    """``--workdir``, or a new private folder (made once: the phones and the deployment share
    it)."""
    if not args.workdir:
        args.workdir = tempfile.mkdtemp(prefix="fedgc-deploy-")
    return Path(args.workdir)


def _deployment_config(args: argparse.Namespace, fleet: PhoneFleet | None = None,
                       allowed: str = "") -> DeploymentConfig:
    """The deployment of ``args``, with the phone bridge's SuperNodes of ``fleet``; ``allowed``:
    the ``key=module:callable`` references the SuperNodes' node config lets a run call (the
    run's own task and method, each for its key: this command is the nodes' operator too)."""
    workdir = _workdir(args)
    phones = fleet.count if fleet is not None else 0

    def node_config(index: int, nodes: int) -> dict[str, object]:
        config = dict(default_node_config(index, nodes))
        if allowed:
            config[ALLOWED_CALLABLES] = allowed
        if fleet is not None and fleet.owns(index):
            config.update(fleet.node_config(index))
        return config

    config = DeploymentConfig(
        nodes=args.nodes + phones,
        workdir=workdir,
        link=preset(args.link) if args.link else None,
        shaping=args.shaping,
        tls=args.tls,
        auth=args.auth,
        seed=args.seed,
        # A device's service manager restarts a SuperNode that gave up on a bad link.
        restart_on_exit=True,
        node_config=node_config,
        # The bridge's SuperNodes sit beside the SuperLink; the phones have the links.
        unshaped=frozenset(range(args.nodes, args.nodes + phones)),
        capture=args.capture,
        **flower_settings(args),
    )
    with_phones = (f" + {phones} {fleet.arch} phones behind links to the phone bridge"
                   if fleet is not None else "")
    print(f"[deploy] {args.nodes} SuperNodes{with_phones}, link {args.link or 'none'}, "
          f"tls={'on' if config.tls else 'off'}, auth={'on' if config.auth else 'off'}, "
          f"workdir {workdir}", flush=True)
    return config


def _run_fedgc(args: argparse.Namespace) -> int:
    import time

    # Imported here: start-up; matplotlib loads only when something is plotted.
    from simulations.plots import plot_run

    try:
        values: dict[str, object] = {}
        if args.config:
            values.update(load_config_file(args.config))
        values.update(parse_run_sets(args.set))
        if not values.get("run_name"):  # a new folder per deployment, as for a simulation
            values["run_name"] = new_run_name(values.get("results_dir", "results"),
                                              f"deploy-{args.link or 'loopback'}")
    except SettingsError as err:
        raise DeployError(str(err)) from err
    if args.phones < 0:
        raise DeployError(f"--phones {args.phones}: expected 0 or more")
    if args.phones:
        try:
            check_phone_privacy(values)
        except ConfigError as err:
            raise DeployError(str(err)) from err
    run_config = deploy_run_config(values, args.nodes + args.phones,
                                   "--nodes + --phones" if args.phones else "--nodes")
    if args.phones:
        try:
            check_phone_run(run_config.method, run_config.server)
        except ConfigError as err:
            raise DeployError(str(err)) from err
    check_fedgc_run(run_config)  # before any process starts
    fleet = None
    if args.phones:
        fleet = PhoneFleet(args.phones, args.nodes, _workdir(args), args.phone_arch,
                           tls=args.tls or args.auth)
        t = run_config.train
        reuse = Path(args.phone_export) if args.phone_export else None
        if reuse is None or not (reuse / "manifest.json").exists():
            print(f"[deploy] exporting the phones' files for the run (task {t.task}, method "
                  f"{t.method}); minutes on a busy machine", flush=True)
        fleet.export(run_config, reuse)
    started_s = time.monotonic()
    # The run's own task and method, when they are module:callable: the nodes run nothing else.
    own = ",".join(f"{key}={ref}" for key, ref in (("task", run_config.train.task),
                                                   ("method", run_config.train.method))
                   if is_ref(ref))
    with Deployment(_deployment_config(args, fleet, allowed=own)) as dep:
        if dep.client_nodes():
            # With --auth each client key is bound to its node's authenticated id: a node
            # cannot serve another client's rounds by claiming its key.
            run_config = run_config.with_overrides({"client_nodes": dep.client_nodes()})
        try:
            if fleet is not None:
                fleet.env = dict(dep.env)
                fleet.start_bridge(dep.config.link, dep.mode, args.seed,
                                   dep.config.startup_timeout_s)
                fleet.start_phones(run_config)
            run = finish_fedgc(dep, run_config,
                               submit_fedgc(dep, run_config, phones=fleet is not None),
                               args.timeout_s, progress=run_config.server.progress,
                               check=fleet.check if fleet is not None else None)
        finally:
            problems = fleet.stop() if fleet is not None else []
        extra = phones_record(fleet) if fleet is not None else None
        write_deploy_record(dep, run, started_s, extra)
        print(f"[deploy] run {run.result.run_id}: {run.result.status} in "
              f"{run.result.seconds:.1f} s; results in {run.run_dir}")
        if not run.result.ok or not run.summary:
            print(run.result.log[-4000:], file=sys.stderr)
            print(dep.log_tails(), file=sys.stderr)
            if fleet is not None:
                print(fleet.log_tails(), file=sys.stderr)
            return 1
        if problems:
            print(f"[deploy] stopping the phones: {'; '.join(problems)}", file=sys.stderr)
    plot = plot_run(run.run_dir)
    record = json.loads((run.run_dir / "deploy.json").read_text())
    print(summary_table({str(run.summary.get("method", "run")): run.summary}))
    print(bytes_table(run.summary, record))
    if args.link or fleet is not None:
        print(format_nodes(node_rows(run.run_dir, record)))
    written = ["rounds.csv", "clients.csv", "summary.json", "deploy.json", plot.name]
    if args.capture:
        print(write_capture_ledger(dep, run))
        written.append("wire.json")
    print(f"results: {run.run_dir}/{', '.join(written)}")
    return 0


def phones_record(fleet: PhoneFleet) -> dict[str, object]:
    """``deploy.json``'s keys for the phones: each phone's arch and rounds (client key ->),
    and what each phone's link carried."""
    reports = fleet.reports()
    return {
        "phones": {str(fleet.first_key + k): {"device": r.get("device"), "arch": fleet.arch,
                                             "machine": r.get("machine"),
                                             "rounds": r.get("rounds", [])}
                   for k, r in reports.items()},
        "phone_links": {str(fleet.first_key + k): link_stats(link)
                        for k, link in fleet.phone_links.items()},
        "phone_tls": fleet.tls,
    }


def check_run_args(args: argparse.Namespace) -> None:
    """Refuse options that cannot work before anything is created or started.

    Raises
    ------
    DeployError
        Naming the option, its value and what is accepted.
    """
    if not 1 <= args.nodes <= 200:
        raise DeployError(f"--nodes {args.nodes}: expected an integer in 1..200")
    if not (math.isfinite(args.timeout_s) and args.timeout_s > 0):
        raise DeployError(f"--timeout-s {args.timeout_s:g}: expected a finite number of "
                          f"seconds > 0")
    if args.workdir:
        workdir = Path(args.workdir)
        if (workdir.exists() or workdir.is_symlink()) and not workdir.is_dir():
            raise DeployError(f"--workdir {workdir} is not a folder; name a folder for the "
                              f"deployment's logs, certificates and state")


def cmd_run(argv: Sequence[str]) -> int:
    """Start the deployment, run the app, print its outcome, shut everything down."""
    args = _run_parser().parse_args(argv)
    check_run_args(args)
    if args.app == "fedgc":
        return _run_fedgc(args)
    if args.phones:
        raise DeployError("--phones is for the fedgc app (the phones run its client algorithm)")
    if args.config:
        raise DeployError("--config is for the fedgc app; use --set with other apps")
    run_config = parse_sets(args.set)
    app_dir = PROBE_APP if args.app == "probe" else Path(args.app).resolve()
    if not (app_dir / "pyproject.toml").is_file():
        raise DeployError(f"--app {args.app!r}: no pyproject.toml in {app_dir}")
    with Deployment(_deployment_config(args)) as dep:
        result = dep.run(app_dir, run_config or None, timeout_s=args.timeout_s)
        print(result.log)
        print(f"[deploy] run {result.run_id}: {result.status} in {result.seconds:.1f} s")
        if not result.ok:
            print(dep.log_tails(), file=sys.stderr)
            return 1
    return 0


def _unwind(signum: int, frame: FrameType | None) -> None:
    # The first signal unwinds; more while everything is torn down would cut the teardown short.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    raise DeployInterrupted(signum)


@contextlib.contextmanager
def _signals_unwind() -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`DeployInterrupted` in the main thread while inside."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = {sig: signal.signal(sig, _unwind) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str]) -> int:
    """Entry point dispatched to by ``python -m simulations deploy ...``.

    Returns 0 on success, 1 when a run failed, 2 on a bad option or a failed step, and 128 plus
    the signal's number after SIGTERM or SIGINT (everything started is torn down first).
    """
    with _signals_unwind():
        try:
            if argv and argv[0] == "calibrate":
                return cmd_calibrate(argv[1:])
            return cmd_run(argv)
        except DeployError as err:
            print(f"python -m simulations deploy: error: {err}", file=sys.stderr)
            return 2
        except DeployInterrupted as stop:
            print(f"python -m simulations deploy: {stop}; the SuperLink, SuperNodes, app "
                  f"processes and links of the run are torn down", file=sys.stderr)
            return 128 + stop.signum


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
