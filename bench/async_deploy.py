"""Issue 37: an asynchronous deployment against the emulator's run of the same scenario.

The target: "a deployment (``deploy``, 5 SuperNodes, shaped links, TLS, async) matches the
emulator's virtual time to a target within 25% and its wire bytes within 10%, on the same
scenario and seeds". ``run`` makes both runs through the product's own commands, one after the
other, and appends each finished run to a jsonl:

- ``deploy``: ``python -m simulations deploy --nodes N --link LINK --tls`` with ``mode = async``
  (a real SuperLink and N SuperNodes behind shaped links, TLS, the loop pushing and pulling
  through Flower's grid). Its time is real time: each applied step's ``wall_seconds``; its
  wire bytes are what the links carried (``deploy.json``: every message, poll and heartbeat,
  Flower's envelopes, HTTP, TLS, TCP/IP).
- ``emulator-PROFILE``: ``python -m simulations run`` with the same keys and seeds under the
  emulator (``netem.mix = LINK:1.0``, ``netem.protocol = PROFILE``, devices ``server`` for this
  machine's CPU): its time is each step's ``virtual_seconds``; its wire bytes are the working
  clients' link bytes plus the idle nodes' polls and heartbeats (``rounds.csv``).

``report`` reads the jsonl alone: per run, the seconds to ``--target`` (the first applied step
at or above it), seconds per step after the first (the first holds the deployment's start:
identification queries, a ClientApp's first start), wire bytes in all, and the ratios
emulated / deployed over the deployment's steps. The deploy CLI shapes every node with one
preset (no per-node mix), so the study's 3G/LTE mix becomes one preset for all nodes here.

Each deployment takes minutes of the shared 2 cores (a ClientApp process per message): run it
through ``/work/locks/cpujob``::

    /work/locks/cpujob .venv/bin/python bench/async_deploy.py run --out results/a37d/runs.jsonl
    .venv/bin/python bench/async_deploy.py report results/a37d/runs.jsonl --target 0.6
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: The profiles the emulator runs under: Flower's SuperNode with a ClientApp's start-up on a
#: free core of this machine (5.59 CPU s), and the 2026-12-04 fit of this loaded machine.
PROFILES = ("supernode-tls", "supernode-tls-devbox")
#: Per-step columns kept in the jsonl.
COLUMNS = ("accuracy", "wall_seconds", "virtual_seconds", "uplink_bytes", "downlink_bytes",
           "wire_uplink_bytes", "wire_downlink_bytes", "idle_uplink_bytes",
           "idle_downlink_bytes", "clients_aggregated")


def shared_keys(args: argparse.Namespace) -> list[str]:
    """``--set`` options both runs take: the scenario, the method, the asynchronous loop."""
    keys = {"task": args.task, "method": args.method, "num_clients": args.nodes,
            "clients_per_round": args.nodes, "mode": "async",
            "async.concurrency": args.concurrency, "async.buffer": args.buffer,
            "rounds": args.steps, "seed": args.seed, "round_timeout_s": 300,
            "progress": "false"}
    out = []
    for k, v in keys.items():
        out += ["--set", f"{k}={v}"]
    return out


def commands(args: argparse.Namespace, results_dir: Path) -> dict[str, list[str]]:
    """Run name -> its command line."""
    py = [sys.executable, "-m", "simulations"]
    where = ["--set", f"results_dir={results_dir}"]
    runs = {"deploy": [*py, "deploy", "--nodes", str(args.nodes), "--link", args.link, "--tls",
                       "--seed", str(args.seed), "--timeout-s", str(args.timeout_s),
                       "--workdir", str(results_dir / "deploy-work"), *shared_keys(args),
                       *where, "--set", "run_name=deploy"]}
    for profile in PROFILES:
        runs[f"emulator-{profile}"] = [
            *py, "run", *shared_keys(args), *where, "--set", "sim.engine=local",
            "--set", "netem.enabled=true", "--set", f"netem.mix={args.link}:1.0",
            "--set", f"netem.seed={args.seed}", "--set", f"netem.protocol={profile}",
            "--set", "netem.device_mix=server:1.0", "--set", f"run_name=emulator-{profile}"]
    return runs


def _float(text: str | None) -> float:
    try:
        return float(text) if text not in (None, "") else math.nan
    except ValueError:
        return math.nan


def read_run(run_dir: Path) -> dict[str, Any]:
    """A finished run's steps, summary figures and (a deployment's) link bytes."""
    with open(run_dir / "rounds.csv", newline="") as f:
        rows = [{c: _float(r.get(c)) for c in COLUMNS} for r in csv.DictReader(f)]
    summary = json.loads((run_dir / "summary.json").read_text())
    out: dict[str, Any] = {"rows": rows, "payload_up": summary.get("uplink_bytes"),
                           "payload_down": summary.get("downlink_bytes")}
    deploy = run_dir / "deploy.json"
    if deploy.exists():
        record = json.loads(deploy.read_text())
        links = [v for v in record["links"].values() if v]
        out["link_up"] = sum(v["uplink_bytes"] for v in links)
        out["link_down"] = sum(v["downlink_bytes"] for v in links)
        out["shaping_mode"] = record["shaping_mode"]
        out["deploy_wall_seconds"] = record["deploy_wall_seconds"]
    with open(run_dir / "clients.csv", newline="") as f:
        clients = list(csv.DictReader(f))
    out["replies"] = len(clients)
    out["staleness"] = [int(r["staleness"]) for r in clients
                        if r["status"] == "aggregated" and r.get("staleness")]
    return out


def run_all(args: argparse.Namespace) -> None:
    """Every run of :func:`commands` not in ``--out`` yet, appended to it as it finishes."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results_dir = out.parent / f"runs-s{args.seed}"
    for name, cmd in commands(args, results_dir).items():
        if name not in args.runs.split(","):
            continue
        if (results_dir / name).exists():
            print(f"{name}: {results_dir / name} exists, skipped", flush=True)
            continue
        start = time.time()
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        (results_dir / f"{name}.log").parent.mkdir(parents=True, exist_ok=True)
        (results_dir / f"{name}.log").write_text(done.stdout)
        if done.returncode != 0:
            print(f"{name}: failed ({done.returncode}); log in {results_dir}/{name}.log",
                  flush=True)
            continue
        record = {"run": name, "seed": args.seed, "command": cmd[1:],
                  "wall_s": round(time.time() - start, 1),
                  "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  **read_run(results_dir / name)}
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"{name}: {len(record['rows'])} steps, {record['wall_s']} s", flush=True)


def seconds_of(run: Mapping[str, Any]) -> list[float]:
    """Each step's seconds: real (``wall_seconds``) for the deployment, virtual otherwise."""
    column = "wall_seconds" if run["run"] == "deploy" else "virtual_seconds"
    return [r[column] if math.isfinite(r[column]) else 0.0 for r in run["rows"]]


def to_target(run: Mapping[str, Any], target: float) -> tuple[float, int] | None:
    """(seconds, step) at the first step at or above ``target``; None when none is."""
    t = 0.0
    for i, (r, s) in enumerate(zip(run["rows"], seconds_of(run), strict=True)):
        t += s
        if r["accuracy"] >= target:
            return t, i + 1
    return None


def wire_bytes(run: Mapping[str, Any]) -> tuple[float, float]:
    """(up, down) bytes on the links over the whole run."""
    if "link_up" in run:
        return float(run["link_up"]), float(run["link_down"])
    rows = run["rows"]
    return (sum(r["wire_uplink_bytes"] + r["idle_uplink_bytes"] for r in rows),
            sum(r["wire_downlink_bytes"] + r["idle_downlink_bytes"] for r in rows))


def report(path: Path, target: float) -> str:
    """The table of every run in ``path`` and each emulated run's ratios to the deployment."""
    runs = {(r["run"], r["seed"]): r for r in map(json.loads, path.read_text().splitlines())}
    head = ("| run | seed | steps | last acc | s to target (step) | s/step after step 1 | "
            "payload up/down kB | wire up/down kB | mean staleness |")
    lines = [f"target accuracy {target}", head, "|" + "---|" * 9]
    for (name, seed), run in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        reached = to_target(run, target)
        secs = seconds_of(run)
        up, down = wire_bytes(run)
        lines.append(
            f"| {name} | {seed} | {len(run['rows'])} | {run['rows'][-1]['accuracy']:.3f} | "
            f"{'not reached' if reached is None else f'{reached[0]:.1f} ({reached[1]})'} | "
            f"{statistics.fmean(secs[1:]) if len(secs) > 1 else math.nan:.2f} | "
            f"{run['payload_up'] / 1e3:.1f} / {run['payload_down'] / 1e3:.1f} | "
            f"{up / 1e3:.1f} / {down / 1e3:.1f} | "
            f"{statistics.fmean(run['staleness']) if run['staleness'] else math.nan:.2f} |")
    lines += ["", "| emulated / deployed | seed | time to target | s/step after step 1 | "
              "wire bytes (both ways) | payload (both ways) |", "|---|---|---|---|---|---|"]
    for (name, seed), whole in sorted(runs.items()):
        deployed = runs.get(("deploy", seed))
        if name == "deploy" or deployed is None:
            continue
        # Over the deployment's steps: an emulated run's first n steps are its n-step run
        # (in process, reproducible from its seeds).
        run = {**whole, "rows": whole["rows"][:len(deployed["rows"])]}
        a, b = to_target(run, target), to_target(deployed, target)
        t = "-" if a is None or b is None else f"{a[0] / b[0]:.2f}"
        per_step = (statistics.fmean(seconds_of(run)[1:])
                    / statistics.fmean(seconds_of(deployed)[1:]))
        wire = sum(wire_bytes(run)) / sum(wire_bytes(deployed))
        payload = (sum(r["uplink_bytes"] + r["downlink_bytes"] for r in run["rows"])
                   / (deployed["payload_up"] + deployed["payload_down"]))
        lines.append(f"| {name} | {seed} | {t} | {per_step:.2f} | {wire:.2f} | {payload:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the deployment and the emulated runs, appended to --out")
    r.add_argument("--out", required=True, help="the jsonl the runs are appended to")
    r.add_argument("--runs", default=",".join(["deploy", *(f"emulator-{p}" for p in PROFILES)]))
    r.add_argument("--nodes", type=int, default=5)
    r.add_argument("--link", default="lte", help="the preset of every node's link")
    r.add_argument("--task", default="digits")
    r.add_argument("--method", default="dgc")
    r.add_argument("--concurrency", type=int, default=2)
    r.add_argument("--buffer", type=int, default=1)
    r.add_argument("--steps", type=int, default=12)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--timeout-s", type=float, default=1500.0)
    rep = sub.add_parser("report", help="the tables, from the jsonl alone")
    rep.add_argument("jsonl")
    rep.add_argument("--target", type=float, required=True, help="accuracy to reach")
    args = p.parse_args(argv)
    if args.command == "run":
        run_all(args)
    else:
        print(report(Path(args.jsonl), args.target))


if __name__ == "__main__":
    main()
