"""Per-round wall time of one scenario on one Ray node and on a two-node cluster, with the store.

The same scenario runs through ``simulations.runner.run_scenario`` twice, with the same 2 CPUs:

- ``one node``: a fresh local Ray instance, ``sim.num_cpus=2`` (today's default path), the
  client state in a folder of the run;
- ``two nodes``: two ``ray start`` nodes of 1 CPU each on this machine
  (:class:`simulations.local_cluster.LocalRayCluster`), ``sim.ray_address`` set, the client
  state in the same kind of folder, which both nodes reach (on real machines: a shared mount).

The scenario is mnist5k with the MLP 784-1262-10 (1,003,300 parameters, the model of
``bench/state_store.py``), 10 clients, 4 per round, DGC at its default settings with
``downlink=auto`` (clients keep the model they hold in their record). Each ClientApp call
times its store ``get`` and ``put`` (the record of a 1M-parameter model) beside its whole
compute time. Printed: median wall seconds per round over rounds 2..R (round 1 starts the
actors), the ratio two nodes / one node, and the store's share of a client's round.

Run: ``python bench/cluster.py [--rounds 6] [--repeats 1]`` (3-4 minutes on 2 busy cores).
"""

from __future__ import annotations

import argparse
import csv
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HIDDEN = (1262,)  # 784*1262 + 1262 + 1262*10 + 10 = 1,003,300 parameters


#: The run keys of the benchmark's ~1M-parameter model.
MODEL_KEYS = {"model": "mlp", "model_options": {"hidden": list(HIDDEN)}}


def _timed_store() -> None:
    """Time every ClientStateStore get and put of this process into ``_store_s``."""
    from client.state import ClientStateStore

    if getattr(ClientStateStore, "_bench_timed", False):
        return
    for name in ("get", "put"):
        real = getattr(ClientStateStore, name)

        def timed(self: Any, *a: Any, _real: Any = real, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return _real(self, *a, **k)
            finally:
                _store_s.append(time.perf_counter() - start)

        setattr(ClientStateStore, name, timed)
    ClientStateStore._bench_timed = True


_store_s: list[float] = []


def _train(msg: Any, context: Any) -> Any:
    """The fedgc ClientApp on the bench's model, writing ``store-times/<key>-<round>.txt``
    (store seconds, compute seconds) beside the client state.

    Module-level, as :func:`_query`: Ray ships them by reference, so that in an actor they
    share this module's ``_store_s`` with :func:`_timed_store`'s wrappers.
    """
    import client.app as fedgc_client
    from fedgc import protocol as P

    _timed_store()
    _store_s.clear()
    reply = fedgc_client.app(msg, context)  # an actor imports client.app afresh: the real one
    cfg = msg.content.config_records[P.CONFIG]
    if not reply.has_error():
        compute = float(reply.content.metric_records[P.METRICS]["compute_seconds"])
        out = Path(str(cfg["state_dir"])).parent / "store-times"
        out.mkdir(exist_ok=True)
        key = fedgc_client.client_key(context)
        (out / f"{key}-{int(cfg[P.SERVER_ROUND])}.txt").write_text(
            f"{sum(_store_s)} {compute}\n")
    return reply


def _query(msg: Any, context: Any) -> Any:
    import client.app as fedgc_client

    return fedgc_client.app(msg, context)


def bench_app() -> Any:
    """A ClientApp of :func:`_train` and :func:`_query`."""
    from flwr.clientapp import ClientApp

    app = ClientApp()
    app.train()(_train)
    app.query()(_query)
    return app


def run(label: str, results: Path, rounds: int, seed: int, **extra: str) -> dict[str, float]:
    """One run of the scenario; its per-round wall times and store figures."""
    import client.app as fedgc_client
    from fedgc.settings import RunConfig
    from simulations.runner import run_scenario

    config = RunConfig.from_flat({
        "task": "mnist5k", "num_clients": 10, "clients_per_round": 4, "rounds": rounds,
        "seed": seed, "checkpoint": False, "progress": False, "overwrite": True,
        "results_dir": str(results), "run_name": label.replace(" ", "-"), **MODEL_KEYS, **extra})
    saved = fedgc_client.app
    fedgc_client.app = bench_app()  # what run_scenario ships to the actors
    try:
        run_scenario(config)
    finally:
        fedgc_client.app = saved
    with (config.run_dir / "rounds.csv").open() as fh:
        walls = [float(r["wall_seconds"]) for r in csv.DictReader(fh)]
    pairs = [tuple(map(float, p.read_text().split()))
             for p in (config.run_dir / "store-times").glob("*.txt")]
    with (config.run_dir / "clients.csv").open() as fh:
        nodes = {r["ray_node"] for r in csv.DictReader(fh)}
    return {"round_s": statistics.median(walls[1:]), "store_s": statistics.median(
        s for s, _ in pairs), "compute_s": statistics.median(c for _, c in pairs),
        "share": sum(s for s, _ in pairs) / sum(c for _, c in pairs), "nodes": len(nodes)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--repeats", type=int, default=1, help="runs of each, alternating")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    # This module by its import name, not __main__: Ray then ships bench_app's functions by
    # reference, and every actor shares its module's _store_s with them.
    from bench import cluster as this
    from bench.common import machine_line
    from simulations.local_cluster import LocalRayCluster

    print(machine_line(1))
    work = Path(tempfile.mkdtemp(prefix="fgbench"))
    figures: dict[str, list[dict[str, float]]] = {"one node": [], "two nodes": []}
    try:
        for i in range(args.repeats):
            figures["one node"].append(this.run("one node", work / f"r{i}", args.rounds, args.seed,
                                           **{"sim.num_cpus": "2"}))
            with LocalRayCluster(work / f"cluster{i}", num_nodes=2, cpus_per_node=1) as c:
                figures["two nodes"].append(this.run("two nodes", work / f"r{i}", args.rounds,
                                                args.seed, **{"sim.ray_address": c.address}))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(f["round_s"] for f in figures["one node"])
    print(f"{'':10} {'s/round':>8} {'x one node':>10} {'store s/client':>14} "
          f"{'compute s/client':>16} {'store share':>11} {'Ray nodes':>9}")
    for label, runs in figures.items():
        med = {k: statistics.median(f[k] for f in runs) for k in runs[0]}
        print(f"{label:10} {med['round_s']:8.2f} {med['round_s'] / base:9.2f}x "
              f"{med['store_s']:14.3f} {med['compute_s']:16.2f} {med['share']:10.1%} "
              f"{med['nodes']:9.0f}")


if __name__ == "__main__":
    main()
