"""Scale benchmark: 10,000 stateful DGC clients against vanilla Flower FedAvg, in one run.

Both runs use Flower's simulation engine (Ray backend) with 10,000 SuperNodes, sample the same
100 partitions per round (the same seeded sampler over the same client keys), train the same
~1M-parameter model (an MLP 784-1200-10 on Fashion-MNIST, IID, 6 samples per client) with the
same local settings, and evaluate centrally every round:

* ``fedgc``: the fedgc ClientApp behind the network emulator's mod (LTE/3G mix, virtual time),
  DGC at density 0.001 with the per-client residual in the on-disk ClientStateStore, and
  DGCStrategy with the emulator's extensions (round clock, wire columns);
* ``vanilla``: a plain ClientApp that returns its dense weights and Flower's own ``FedAvg``.

It prints the wall time per round of each (round 1 includes Ray start-up and the identification
of the 10,000 nodes; the ratio uses rounds 2..R), their ratio, and the peak memory of all
processes of the run (PSS summed over the benchmark process, Ray's processes and its workers,
sampled every 0.25 s): ``python bench/scale.py [--clients 10000] [--per-round 100] [--rounds 5]``.

With ``--engine local|batched|ray`` it measures instead how one engine carries many clients of
a task whose data each client makes from its own seed (``own_task.task:build_per_client``,
``examples/own_task``: nothing is held for clients not sampled): for each count of
``--clients`` (e.g. ``1000,10000,100000,1000000``) one fedgc DGC run in a fresh process, and
its peak memory (PSS of the process tree), its first round and its later rounds' wall time:
``python bench/scale.py --engine local --clients 1000,1000000 --per-round 100 --rounds 5``.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN = (1200,)  # 784*1200 + 1200 + 1200*10 + 10 = 954,010 parameters
VANILLA_LR, VANILLA_BATCH = 0.05, 10  # local settings of both runs (one epoch, no momentum)


#: The run keys of the benchmark's model; the vanilla run builds the same with get_task.
MODEL_KEYS = {"model": "mlp", "model_options": {"hidden": list(HIDDEN)}}


def _task(name: str):
    """The benchmark's task: Fashion-MNIST with the ~1M-parameter MLP."""
    import tasks

    return tasks.get_task(name, model="mlp", model_options={"hidden": HIDDEN})


# ---------------------------------------------------------------------------- memory sampling
def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _children() -> dict[int, int]:
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    parent[int(d)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    return parent


class PeakMemory(threading.Thread):
    """Samples the summed PSS of this process and all its descendants (Ray included)."""

    def __init__(self, interval_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._halt = threading.Event()

    def tree(self) -> list[int]:
        parent = _children()
        root, out, frontier = os.getpid(), [os.getpid()], [os.getpid()]
        while frontier:
            nxt = [p for p, pp in parent.items() if pp in frontier]
            out += nxt
            frontier = nxt
        del root
        return out

    def run(self) -> None:
        while not self._halt.is_set():
            total = sum(_pss_kb(p) for p in self.tree()) * 1024
            self.peak_bytes = max(self.peak_bytes, total)
            self._halt.wait(self.interval_s)

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return self.peak_bytes


# ---------------------------------------------------------------------------- vanilla Flower
def vanilla_client_app(num_clients: int, seed: int, lr: float, batch_size: int):
    """A plain Flower ClientApp: train on the partition, reply with the dense weights."""
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    def setup():
        import tasks

        # Kept on an imported module: this function is shipped to the Ray actors by value, and
        # a cache held in its closure would not outlive one message.
        cache = tasks.__dict__.setdefault("_fedgc_bench_cache", {})
        if not cache:
            import torch

            torch.set_num_threads(1)
            task = _task("fashion-mnist")
            cache["task"] = task
            cache["parts"] = task.partition(num_clients, scheme="iid", seed=seed)
        return cache["task"], cache["parts"]

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        import torch

        from fedgc.training import round_seed, train_locally

        task, parts = setup()
        key = int(context.node_config["partition-id"])
        idx = torch.as_tensor(parts[key])
        model = task.build_model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        rnd = int(msg.content["config"]["server-round"])
        local = train_locally(model, task.train_x[idx], task.train_y[idx], task.training_loss,
                              lr=lr, batch_size=batch_size, local_epochs=1, local_steps=0,
                              momentum=0.0, weight_decay=0.0, seed=round_seed(seed, rnd, key))
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples":
                                                            local.num_examples})}),
                       reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord(
            {"client_key": int(context.node_config["partition-id"])})}), reply_to=msg)

    return app


def vanilla_strategy(per_round: int, seed: int, times: list[float]):
    """Flower's FedAvg, sampling the same client keys as DGCStrategy does."""
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict
    from flwr.serverapp.strategy import FedAvg

    class SameClientsFedAvg(FedAvg):
        keys: dict[int, int] = {}

        def configure_train(self, server_round, arrays, config, grid):
            times.append(time.perf_counter())
            nodes = sorted(grid.get_node_ids())
            if not self.keys:  # identify nodes once, as DGCStrategy does
                q = [Message(RecordDict({"config": ConfigRecord({"ask": "client_key"})}),
                             dst_node_id=n, message_type=MessageType.QUERY) for n in nodes]
                for r in grid.send_and_receive(q, timeout=3600):
                    self.keys[int(r.content["metrics"]["client_key"])] = r.metadata.src_node_id
            rng = random.Random(seed * 1_000_003 + server_round)
            sampled = rng.sample(sorted(self.keys), min(per_round, len(self.keys)))
            cfg = ConfigRecord({**dict(config), "server-round": server_round})
            return [Message(RecordDict({"arrays": arrays, "config": cfg}),
                            dst_node_id=self.keys[k], message_type=MessageType.TRAIN)
                    for k in sampled]

    return SameClientsFedAvg(fraction_train=1.0, fraction_evaluate=0.0,
                             min_train_nodes=per_round, min_available_nodes=per_round)


def run_vanilla(args, backend: dict) -> list[float]:
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
    from flwr.serverapp import ServerApp

    from simulations.runner import run_engine

    times: list[float] = []
    ends: list[float] = []
    server = ServerApp()

    @server.main()
    def main(grid, context) -> None:
        task = _task("fashion-mnist")
        import torch

        torch.manual_seed(args.seed)
        model = task.build_model()

        def evaluate(rnd: int, arrays: ArrayRecord) -> MetricRecord:
            model.load_state_dict(arrays.to_torch_state_dict())
            loss, acc = task.evaluate(model)
            if rnd > 0:
                ends.append(time.perf_counter())
            return MetricRecord({"accuracy": float(acc), "loss": float(loss)})

        strategy = vanilla_strategy(args.per_round, args.seed, times)
        strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=args.rounds,
                       train_config=ConfigRecord({}), evaluate_fn=evaluate, timeout=3600)

    run_engine(server, vanilla_client_app(args.clients, args.seed, VANILLA_LR, VANILLA_BATCH),
               args.clients, backend)
    return [e - s for s, e in zip(times, ends, strict=True)]


def run_fedgc(args, backend: dict, results: Path) -> list[float]:
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    import client.app as fedgc_client
    from fedgc.settings import RunConfig
    from server.app import run_server
    from simulations.netem.integration import extensions, for_run, wrap_client_app
    from simulations.netem.settings import NetemSettings
    from simulations.runner import run_engine

    config = RunConfig.from_flat({
        "task": "fashion-mnist", "num_clients": args.clients, "clients_per_round": args.per_round,
        "partition": "iid", "rounds": args.rounds, "seed": args.seed, "method": "dgc",
        "density": 0.001, "downlink": "dense", "checkpoint": False, "progress": True,
        # The local settings of the vanilla ClientApp (run_vanilla): one epoch of plain SGD.
        "local_epochs": 1, "lr": VANILLA_LR, "batch_size": VANILLA_BATCH, "client_momentum": 0.0,
        "results_dir": str(results), "run_name": "fedgc", "overwrite": True,
        "round_timeout_s": 3600.0, **MODEL_KEYS})
    netem = for_run(NetemSettings(enabled=True, mix="lte:0.5,3g:0.5", seed=args.seed), config)
    inner = wrap_client_app(fedgc_client.app)
    app = ClientApp()

    app.train()(inner)
    app.query()(inner)
    server = ServerApp()

    @server.main()
    def main(grid, context) -> None:
        # 10,000 identification queries take minutes on 2 busy cores: the probe timeout is
        # round_timeout_s (3600 s above), or most nodes would stay unidentified and be
        # probed again every round.
        run_server(grid, config, extensions=extensions(netem, config))

    run_engine(server, app, args.clients, backend)
    import csv

    with (config.run_dir / "rounds.csv").open() as fh:
        return [float(r["wall_seconds"]) for r in csv.DictReader(fh)]


# ---------------------------------------------------------------------------- one engine, N clients
PER_CLIENT_TASK = "own_task.task:build_per_client"


def engine_run(engine: str, clients: int, per_round: int, rounds: int, seed: int,
               results: Path) -> list[float]:
    """One fedgc DGC run of the per-client task on ``engine``; its rounds' wall seconds."""
    import csv

    from simulations.api import run

    keys = {"task": PER_CLIENT_TASK, "num_clients": clients, "clients_per_round": per_round,
            "rounds": rounds, "seed": seed, "method": "dgc", "sim.engine": engine,
            "results_dir": str(results), "run_name": f"{engine}-{clients}", "overwrite": True,
            "checkpoint": False, "progress": False, "eval_samples": 500,
            "round_timeout_s": 36_000.0}
    result = run(**{k.replace(".", "__"): v for k, v in keys.items()})
    with (result.folder / "rounds.csv").open() as fh:
        return [float(r["wall_seconds"]) for r in csv.DictReader(fh)]


def _engine_child(args: argparse.Namespace) -> None:
    """Run one count in this (fresh) process and print its figures as one JSON line."""
    import json

    mem = PeakMemory()
    mem.start()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedgc-scale-") as results:
        walls = engine_run(args.engine, int(args.clients), args.per_round, args.rounds,
                           args.seed, Path(results))
    total = time.perf_counter() - started
    print(json.dumps({"walls": walls, "peak_bytes": mem.stop(), "total_s": total}))


def run_engine_counts(args: argparse.Namespace) -> None:
    """Each count of ``--clients`` in a fresh process (its own peak memory)."""
    import json
    import subprocess

    counts = [int(c) for c in str(args.clients).split(",")]
    print(f"scale: engine {args.engine}, task {PER_CLIENT_TASK}, {args.per_round} per round, "
          f"{args.rounds} rounds, DGC; {os.cpu_count()} CPU(s)", flush=True)
    print(f"{'clients':>9} {'peak GiB':>9} {'round 1 s':>10} {'rounds 2.. s':>13} "
          f"{'whole run s':>12}", flush=True)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root), str(root / "examples"), os.environ.get("PYTHONPATH", "")])}
    for n in counts:
        out = subprocess.run([sys.executable, __file__, "--engine", args.engine, "--clients",
                              str(n), "--per-round", str(args.per_round), "--rounds",
                              str(args.rounds), "--seed", str(args.seed), "--child"],
                             check=True, capture_output=True, text=True, env=env)
        figures = json.loads(out.stdout.strip().splitlines()[-1])
        walls = figures["walls"]
        later = sum(walls[1:]) / max(1, len(walls) - 1)
        print(f"{n:>9} {figures['peak_bytes'] / 2**30:>9.2f} {walls[0]:>10.2f} {later:>13.2f} "
              f"{figures['total_s']:>12.1f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", default="10000",
                   help="clients (with --engine: a comma-separated list of counts)")
    p.add_argument("--per-round", type=int, default=100)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=("local", "batched", "ray"), default=None,
                   help="measure one engine on the per-client task instead")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help="results and client state (default: a temp "
                   "folder, removed at the end)")
    args = p.parse_args()
    if args.engine is not None:
        if args.child:
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
            _engine_child(args)
        else:
            run_engine_counts(args)
        return
    args.clients = int(args.clients)
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fedgc-scale-"))
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               "init_args": {"num_cpus": os.cpu_count() or 1, "include_dashboard": False}}
    nparams = sum(t.numel() for t in _task("fashion-mnist").build_model().parameters())
    print(f"scale: {args.clients} clients, {args.per_round} per round, {args.rounds} rounds, "
          f"model {nparams:,} parameters", flush=True)
    try:
        mem = PeakMemory()
        mem.start()
        vanilla = run_vanilla(args, backend)
        peak_vanilla = mem.stop()
        print(f"vanilla FedAvg wall s per round: {vanilla}; peak memory "
              f"{peak_vanilla / 2**30:.2f} GiB", flush=True)
        mem = PeakMemory()
        mem.start()
        fedgc = run_fedgc(args, backend, work)
        peak_fedgc = mem.stop()
        from client.state import ClientStateStore

        disk = ClientStateStore(work / "fedgc" / "client_state").nbytes()
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)

    def fmt(xs: list[float]) -> str:
        return " ".join(f"{x:6.1f}" for x in xs)

    print(f"wall s per round   vanilla FedAvg: {fmt(vanilla)}")
    print(f"                   fedgc DGC+netem: {fmt(fedgc)}")
    steady_v = sum(vanilla[1:]) / max(1, len(vanilla) - 1)
    steady_f = sum(fedgc[1:]) / max(1, len(fedgc) - 1)
    print(f"rounds 2..{args.rounds} mean: vanilla {steady_v:.2f} s, fedgc {steady_f:.2f} s, "
          f"ratio fedgc/vanilla {steady_f / steady_v:.2f} (target <= 1.2)")
    print(f"peak memory, all processes (PSS): vanilla {peak_vanilla / 2**30:.2f} GiB, "
          f"fedgc {peak_fedgc / 2**30:.2f} GiB (target <= 4 GB)")
    print(f"client state on disk after the run: {disk / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
