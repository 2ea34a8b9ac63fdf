"""DDP on Fashion-MNIST, N workers: dense all-reduce, PowerSGD (rank 4) and DGC, on shaped links.

Trains the project's CNN (``tasks.models.CNN``, 0.2M parameters) on a seeded subset of
Fashion-MNIST, each worker a process of its own (gloo, ``init_method=env://``, so ``torchrun``
launches the same worker). Reports test accuracy after the last epoch, the gradient bytes each
worker contributes per step, and the wall time per epoch.

Links: ``loopback`` runs the workers on 127.0.0.1. ``tbf:MBPS`` puts each worker in a network
namespace joined by a veth pair to a hub namespace that forwards between them; both ends of each
pair are shaped with the kernel's ``tbf`` at MBPS (``simulations.deploy.netns`` builds the pairs
and the ``tbf`` arguments), so a message from worker i to worker j crosses i's uplink and j's
downlink like a switch with MBPS ports. There the bytes each worker put on the wire per step are
also read from its interface counters. Needs root; everything created is deleted at the end.

    nice python bench/ddp.py --workers 4 --links loopback tbf:1000 tbf:100
    torchrun --nproc-per-node 2 bench/ddp.py worker --method dgc    # one run, no shaping
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

METHODS = ("dense", "powersgd", "dgc")


# ---------------------------------------------------------------------------------------------
# One worker (a rank)
# ---------------------------------------------------------------------------------------------

def run_worker(args: argparse.Namespace) -> None:
    """Train as one rank of the group the environment describes; rank 0 writes the results."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dgc import DGCConfig
    from dgc.ddp import DGCState, dgc_hook
    from tasks.images import load_fashion_mnist
    from tasks.models import CNN

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = load_fashion_mnist()
    order = np.random.default_rng(args.seed).permutation(len(data.train_y))[: args.train_size]
    shard = order[rank::world]
    # The loaders' arrays are read-only (shared cache): every tensor here is a copy. Each rank
    # evaluates its own slice of the test set; the counts are summed.
    x = torch.from_numpy(data.train_x[shard].astype(np.float32) / data.scale)
    y = torch.from_numpy(data.train_y[shard].copy())
    test = slice(rank, args.test_size, world)
    test_x = torch.from_numpy(data.test_x[test].astype(np.float32) / data.scale)
    test_y = torch.from_numpy(data.test_y[test].copy())
    steps = len(y) // args.batch_size
    torch.manual_seed(args.seed)
    model = CNN(1, 28, 28, 10)
    numel = sum(p.numel() for p in model.parameters())
    ddp = DDP(model)
    state = None
    momentum = args.momentum
    if args.method == "powersgd":
        # start_powerSGD_iter=2 is the least torch allows with error feedback; the short runs
        # here have no room for the 10% of steps its docs suggest.
        state = powersgd.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2,
                                       min_compression_rate=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    elif args.method == "dgc":
        config = DGCConfig(density=args.density, momentum=args.momentum, warmup="exponential",
                           warmup_epochs=args.warmup_epochs, value_dtype="float16")
        state = DGCState(None, ddp, config, steps_per_epoch=steps, exchange=args.exchange)
        ddp.register_comm_hook(state, dgc_hook)
        momentum = 0.0  # the hook applies momentum (correction); the paper's prescription
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=momentum)
    gen = torch.Generator().manual_seed(args.seed + rank)
    # On a shaped link the worker reads its own interface's counter, epoch by epoch.
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    counter = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes") if ifname else None
    epochs = []
    for epoch in range(args.epochs):
        payload_before = state.payload_bytes if args.method == "dgc" else 0
        density = state.density() if args.method == "dgc" else 1.0
        perm = torch.randperm(len(y), generator=gen)
        ddp.train()
        dist.barrier()
        tx_before = int(counter.read_text()) if counter else 0
        start = time.perf_counter()
        for s in range(steps):
            idx = perm[s * args.batch_size: (s + 1) * args.batch_size]
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()
        dist.barrier()
        wall_s = time.perf_counter() - start
        wire = (int(counter.read_text()) - tx_before) / steps if counter else float("nan")
        accuracy = _accuracy(model, test_x, test_y) if epoch == args.epochs - 1 else None
        if args.method == "dgc":
            payload = (state.payload_bytes - payload_before) / steps
        elif args.method == "powersgd" and epoch > 0:
            payload = 4.0 * _powersgd_numel(model, 4, 2.0)
        else:
            payload = 4.0 * numel
        epochs.append({"epoch": epoch, "wall_s": wall_s, "accuracy": accuracy,
                       "payload_bytes_per_step": payload,
                       "density": density, "wire_bytes_per_step": wire})
        if rank == 0:
            print(f"[{args.method}] epoch {epoch}: {wall_s:.1f} s, accuracy {accuracy}, "
                  f"payload {payload:.0f} B/step", flush=True)
    # Every rank's wire bytes, gathered after the timed epochs.
    every: list[list[float]] = [[] for _ in range(world)]
    dist.all_gather_object(every, [e["wire_bytes_per_step"] for e in epochs])
    for e in epochs:
        e["wire_bytes_per_step"] = sum(w[e["epoch"]] for w in every) / world
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps({
            "method": args.method, "workers": world, "numel": numel, "steps_per_epoch": steps,
            "epochs": epochs}))
    dist.destroy_process_group()


def _accuracy(model: object, x: object, y: object) -> float:
    """Test accuracy over every rank's slice (outside the timed epoch)."""
    import torch
    import torch.distributed as dist

    model.eval()
    with torch.no_grad():
        counts = torch.tensor([float((model(x).argmax(1) == y).sum()), float(len(y))],
                              dtype=torch.float64)
    dist.all_reduce(counts)
    return float(counts[0] / counts[1])


def _powersgd_numel(model: object, rank: int, min_compression_rate: float) -> int:
    """Entries PowerSGD all-reduces per step: P and Q of each tensor it compresses (viewed as
    ``shape[0] x rest``, compressed when ``(n + m) * rank * rate < n * m``), the rest whole."""
    total = 0
    for p in model.parameters():
        n = p.shape[0]
        m = p.numel() // n
        if p.dim() > 1 and (n + m) * min(rank, n, m) * min_compression_rate < n * m:
            total += (n + m) * min(rank, n, m)
        else:
            total += p.numel()
    return total


# ---------------------------------------------------------------------------------------------
# Shaped links: a hub namespace and one namespace per worker
# ---------------------------------------------------------------------------------------------

def _sh(*argv: str, netns: str | None = None) -> str:
    full = list(argv) if netns is None else ["ip", "netns", "exec", netns, *argv]
    proc = subprocess.run(full, capture_output=True, text=True, timeout=10)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(full)}` failed: {proc.stderr.strip()}")
    return proc.stdout


@dataclass
class ShapedSwitch:
    """N worker namespaces on veth pairs into one forwarding hub namespace, ``tbf``-shaped."""

    tag: str
    hub: str
    links: list

    @classmethod
    def create(cls, workers: int, mbps: float) -> ShapedSwitch:
        from simulations.deploy.netns import VethLink, pick_subnet_octet, tbf_args

        tag = f"{random.randrange(16**4):04x}"
        switch = cls(tag, f"fedgc-{tag}-hub", [])
        try:
            _sh("ip", "netns", "add", switch.hub)
            _sh("ip", "link", "set", "lo", "up", netns=switch.hub)
            # Forwarding is per namespace: the host's own setting is not touched.
            _sh("sysctl", "-qw", "net.ipv4.ip_forward=1", netns=switch.hub)
            octet = pick_subnet_octet()
            for i in range(workers):
                link = VethLink.create(tag, i, octet)
                switch.links.append(link)
                _sh("ip", "link", "set", link.host_dev, "netns", switch.hub)
                _sh("ip", "addr", "add", f"{link.host_ip}/30", "dev", link.host_dev,
                    netns=switch.hub)
                _sh("ip", "link", "set", link.host_dev, "up", netns=switch.hub)
                _sh("ip", "route", "add", f"10.{octet}.0.0/16", "via", link.host_ip,
                    netns=link.netns)
                _sh("tc", "qdisc", "replace", "dev", link.node_dev, "root", *tbf_args(mbps),
                    netns=link.netns)
                _sh("tc", "qdisc", "replace", "dev", link.host_dev, "root", *tbf_args(mbps),
                    netns=switch.hub)
        except BaseException:
            switch.delete()
            raise
        return switch

    def delete(self) -> None:
        """Delete every namespace of the switch (their veth pairs go with them); never raises."""
        from simulations.deploy.netns import cleanup_tag

        for link in self.links:
            link.delete()
        subprocess.run(["ip", "netns", "del", self.hub], capture_output=True, timeout=10)
        cleanup_tag(self.tag)


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------

def _launch(args: argparse.Namespace, method: str, switch: ShapedSwitch | None,
            out: Path) -> dict:
    port = str(29500 + random.randrange(2000))
    master = "127.0.0.1" if switch is None else switch.links[0].node_ip
    procs = []
    for rank in range(args.workers):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.workers), MASTER_ADDR=master,
                   MASTER_PORT=port, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        if switch is not None:
            env["GLOO_SOCKET_IFNAME"] = switch.links[rank].node_dev
        argv = [sys.executable, str(Path(__file__).resolve()), "worker", "--method", method,
                *_worker_flags(args), "--out", str(out) if rank == 0 else ""]
        if switch is not None:
            argv = ["ip", "netns", "exec", switch.links[rank].netns, *argv]
        procs.append(subprocess.Popen(argv, env=env))
    try:
        codes = [p.wait(timeout=args.timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(codes):
        raise RuntimeError(f"{method}: worker exit codes {codes}")
    return json.loads(out.read_text())


def _worker_flags(args: argparse.Namespace) -> list[str]:
    return ["--train-size", str(args.train_size), "--test-size", str(args.test_size),
            "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
            "--lr", str(args.lr), "--momentum", str(args.momentum), "--seed", str(args.seed),
            "--density", str(args.density), "--warmup-epochs", str(args.warmup_epochs),
            "--exchange", args.exchange]


def run_comparison(args: argparse.Namespace) -> None:
    """Every method on every link; one JSON line per run, then a table of ratios."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for link in args.links:
            switch = None
            if link != "loopback":
                kind, _, mbps = link.partition(":")
                if kind != "tbf" or not mbps:
                    raise SystemExit(f"link {link!r}: expected 'loopback' or 'tbf:MBPS'")
                switch = ShapedSwitch.create(args.workers, float(mbps))
            try:
                for method in args.methods:
                    result = _launch(args, method, switch, Path(tmp) / f"{method}.json")
                    result["link"] = link
                    result["args"] = {k: v for k, v in vars(args).items()
                                      if k not in ("mode", "method", "methods", "links", "out")}
                    rows.append(result)
                    print(json.dumps(result), flush=True)
            finally:
                if switch is not None:
                    switch.delete()
    _print_table(rows, args.workers, args.warmup_epochs)


def _steady(result: dict, skip: int) -> tuple[float, float, float]:
    """Means over the epochs after ``skip``: seconds per epoch, payload and wire bytes per step
    (the wire bytes are the mean over workers of what each put on its link)."""
    epochs = [e for e in result["epochs"] if e["epoch"] >= skip] or result["epochs"]
    return tuple(sum(e[key] for e in epochs) / len(epochs)
                 for key in ("wall_s", "payload_bytes_per_step", "wire_bytes_per_step"))


def _print_table(rows: list[dict], workers: int, skip: int) -> None:
    print(f"\n{workers} workers; per epoch and per step: means over epochs >= {skip} (after "
          f"DGC's warm-up); accuracy after the last epoch")
    print(f"{'link':<10} {'method':<9} {'s/epoch':>8} {'acc':>7} {'payload B/step':>15} "
          f"{'wire B/step':>12} {'dense/this s':>12} {'dense/this wire':>15}")
    base = {r["link"]: r for r in rows if r["method"] == "dense"}
    for r in rows:
        wall, payload, wire = _steady(r, skip)
        b_wall, _, b_wire = _steady(base[r["link"]], skip) if r["link"] in base else (
            float("nan"),) * 3
        print(f"{r['link']:<10} {r['method']:<9} {wall:8.2f} {r['epochs'][-1]['accuracy']:7.4f} "
              f"{payload:15.0f} {wire:12.0f} {b_wall / wall:12.2f} {b_wire / wire:15.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="compare", choices=("compare", "worker"))
    parser.add_argument("--method", choices=METHODS, default="dgc", help="worker mode only")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--links", nargs="+", default=["loopback"],
                        help="'loopback' or 'tbf:MBPS' (needs root)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--train-size", type=int, default=8192)
    parser.add_argument("--test-size", type=int, default=2000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--warmup-epochs", type=int, default=1)
    parser.add_argument("--exchange", choices=("pairs", "golomb"), default="pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1800.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if args.mode == "worker":
        run_worker(args)
    else:
        run_comparison(args)


if __name__ == "__main__":
    main()
