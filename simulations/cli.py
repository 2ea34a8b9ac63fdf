"""The command line: ``run``, ``compare``, ``demo``, ``keys`` and (another package's) ``deploy``."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from server.app import RunFolderError
from server.config import RunConfig, SettingsError, load_toml
from server.results import write_json
from simulations.cluster import ClusterError
from simulations.netem.errors import NetemError

METHODS = ("dense", "topk", "dgc")

#: The default comparison (``make demo``): 100 clients, 10 per round, Dirichlet(0.5) label skew,
#: density 0.001 after a 4-round warm-up, on the MNIST 5k subset, 200 rounds (the horizon of
#: docs/federated_momentum.md). Client and server settings are the defaults and only ``method``
#: differs between the three runs (``cmd_compare``), so the comparison is at equal client work.
DEMO: dict[str, object] = {
    "run_name": "demo",
    "task": "mnist5k",
    "num_clients": 100,
    "clients_per_round": 10,
    "partition": "dirichlet",
    "alpha": 0.5,
    "rounds": 200,
    "dgc.density": 0.001,
    "dgc.warmup": "exponential",
    "dgc.warmup_rounds": 4,
    "overwrite": True,
}


def parse_sets(items: Sequence[str]) -> dict[str, str]:
    """``["a=1", "dgc.density=0.01"]`` -> dict; an item without ``=`` names itself."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SettingsError(f"--set expects key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _values(args: argparse.Namespace, base: Mapping[str, object] | None) -> dict[str, object]:
    values: dict[str, object] = dict(base or {})
    if args.config:
        values.update(load_toml(args.config))
    values.update(parse_sets(args.set or []))
    return values


def build_config(args: argparse.Namespace, base: Mapping[str, object] | None = None) -> RunConfig:
    """Defaults < ``base`` < ``--config FILE`` < ``--set key=value`` (``netem.*`` aside)."""
    values = _values(args, base)
    return RunConfig.from_flat({k: v for k, v in values.items() if not k.startswith("netem.")})


def build_netem(args: argparse.Namespace, base: Mapping[str, object] | None = None) -> Any:
    """The network emulator's settings from the ``netem.*`` keys (disabled when none)."""
    from simulations.netem.integration import split_netem

    return split_netem(_values(args, base))[1]


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def summary_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    """A plain-text table of the headline numbers of one or more runs."""
    head = (f"{'method':<8} {'final acc':>9} {'best acc':>9} {'uplink MB':>10} {'x dense':>8} "
            f"{'downlink MB':>11} {'failed':>6} {'wall s':>7}")
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        lines.append(
            f"{name:<8} {_fmt(s.get('final_accuracy'), '9.4f')} "
            f"{_fmt(s.get('best_accuracy'), '9.4f')} "
            f"{_fmt(s['uplink_bytes'] / 1e6, '10.3f')} {_fmt(s.get('uplink_compression'), '8.1f')} "
            f"{_fmt(s['downlink_bytes'] / 1e6, '11.2f')} {s.get('clients_failed', 0):>6} "
            f"{_fmt(s.get('wall_seconds'), '7.1f')}")
    return "\n".join(lines)


def cmd_run(config: RunConfig, verbose: bool, netem: Any = None) -> dict[str, Any]:
    """Run one scenario, plot it, print its table."""
    from simulations.plots import plot_run
    from simulations.runner import run_scenario

    print(f"fedgc: running {config.train.method} on {config.train.task}, "
          f"{config.train.num_clients} clients ({config.train.clients_per_round} per round), "
          f"{config.server.rounds} rounds -> {config.run_dir}", flush=True)
    summary = run_scenario(config, verbose=verbose, netem=netem)
    plot = plot_run(config.run_dir)
    print(summary_table({config.train.method: summary}))
    print(f"results: {config.run_dir}/rounds.csv, summary.json, {plot.name}")
    return summary


def cmd_compare(config: RunConfig, verbose: bool,
                methods: Sequence[str] = METHODS, netem: Any = None) -> dict[str, Any]:
    """The same scenario with each method; ``compare.json`` and ``compare.png`` in one folder."""
    from simulations.plots import plot_runs
    from simulations.runner import run_scenario

    base = config.run_dir
    summaries: dict[str, dict[str, Any]] = {}
    runs: dict[str, Path] = {}
    for method in methods:
        c = config.with_overrides({"method": method, "results_dir": str(base),
                                   "run_name": method, "state_dir": ""})
        print(f"fedgc: [{method}] {c.server.rounds} rounds -> {c.run_dir}", flush=True)
        summaries[method] = run_scenario(c, verbose=verbose, netem=netem)
        runs[method] = c.run_dir
    base.mkdir(parents=True, exist_ok=True)
    doc = {"methods": summaries}
    write_json(base / "compare.json", doc)
    plot = plot_runs(runs, base / "compare.png",
                     title=f"{config.train.task}: {config.train.num_clients} clients, "
                           f"{config.train.clients_per_round} per round, density "
                           f"{config.train.density}")
    print(summary_table(summaries))
    print(f"results: {base}/compare.json, {plot.name}")
    return doc


def cmd_keys() -> None:
    """Print every configuration key with its type, default and accepted range."""
    for key, kind, default, accepted, doc in RunConfig.describe():
        print(f"{key:<26} {kind:<5} {default:<14} {accepted:<32} {doc}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m simulations",
                                description="fedgc: federated learning with Deep Gradient "
                                            "Compression on Flower's simulation engine")
    sub = p.add_subparsers(dest="command", required=True)

    def scenario(name: str, help_text: str) -> argparse.ArgumentParser:
        q = sub.add_parser(name, help=help_text)
        q.add_argument("--config", metavar="FILE", help="TOML file of keys ([dgc] tables "
                       "flatten to dgc.*); see `python -m simulations keys`")
        q.add_argument("--set", metavar="KEY=VALUE", action="append", default=[],
                       help="override one key (repeatable)")
        q.add_argument("--verbose", action="store_true", help="show Flower's and Ray's logs")
        return q

    scenario("run", "run one scenario")
    c = scenario("compare", "run dense, topk and dgc on the same scenario and plot them")
    c.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated subset of dense,topk,dgc")
    scenario("demo", "the default comparison (what `make demo` runs)")
    sub.add_parser("keys", help="list every configuration key")
    sub.add_parser("deploy", help="deployment tools (simulations.deploy)", add_help=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m simulations``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "deploy":
        try:
            from simulations.deploy.cli import main as deploy_main  # another package's CLI
        except ModuleNotFoundError as ex:
            if ex.name not in ("simulations.deploy", "simulations.deploy.cli"):
                raise
            print("python -m simulations deploy: error: simulations.deploy is not installed",
                  file=sys.stderr)
            return 2
        return int(deploy_main(argv[1:]) or 0)
    args = _parser().parse_args(argv)
    try:
        if args.command == "keys":
            cmd_keys()
        elif args.command == "run":
            cmd_run(build_config(args), args.verbose, build_netem(args))
        elif args.command == "compare":
            methods = [m.strip() for m in args.methods.split(",") if m.strip()]
            bad = [m for m in methods if m not in METHODS]
            if bad or not methods:
                raise SettingsError(f"--methods must be a comma-separated subset of "
                                    f"{list(METHODS)}, got {args.methods!r}")
            cmd_compare(build_config(args), args.verbose, methods, build_netem(args))
        elif args.command == "demo":
            cmd_compare(build_config(args, DEMO), args.verbose, netem=build_netem(args, DEMO))
    except (SettingsError, RunFolderError, NetemError, ClusterError) as ex:
        print(f"python -m simulations {args.command}: error: {ex}", file=sys.stderr)
        return 2
    return 0
