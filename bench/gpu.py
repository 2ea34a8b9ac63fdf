"""GPU benchmark: the encoder against top-k and the floor, clients per second one at a time and
batched, and a fashion-mnist study's wall time, on whatever device is present.

Three parts, each printing its figures with the device and the date beside them:

1. ``encoder``: ResNet-50's 161 gradient tensors (25.6M floats) and one 25.6M tensor, density
   0.001, median of ``--repeats`` (the device synchronised around each call):

   - ``floor``: ``abs`` + compare per tensor (the issue's floor), and the same over one flat
     buffer (the floor of a batched pass);
   - ``topk``: ``torch.topk`` of ``|x|`` per sparsified tensor;
   - ``sampled, per tensor``: :func:`dgc.selection.select_sampled` tensor by tensor (fedgc's
     selection before the batched one);
   - ``sampled, batched``: :class:`dgc.batched.BatchedSelector` on one flat buffer, the
     selection the compressor runs on an accelerator;
   - ``compress`` (what a client runs: momentum, selection, residual, fp16 values) and
     ``compress + encode`` (the wire bytes, one device-to-host copy);

   with the ratios batched/topk and batched/floor (targets on a GPU: <= 1 and <= 2).
2. ``clients``: the Fashion-MNIST CNN, 120 SGD steps of batch 10 per client (momentum 0.5):
   clients per second trained one at a time (:func:`fedgc.training.train_locally`) and all at
   once (:func:`client.batched_training.train_batched`, ``torch.func``), for ``--clients``.
3. ``study``: ``python -m simulations compare --scenario fashion-mnist`` (5 methods,
   ``--seeds``, ``--study-rounds``), its wall time. On a GPU the default is the whole study
   (3 seeds, 50 rounds; target under 5 minutes, against 48 on the 2 CPU cores); on the CPU a
   slice of it (seed 0, 2 rounds) with the whole study's time extrapolated from it.

Run: ``python bench/gpu.py [--device auto|cpu|cuda] [--parts encoder,clients,study]
[--repeats R] [--clients 10,100,1000] [--seeds 0,1,2] [--study-rounds N]``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.encoder import resnet50_shapes  # noqa: E402
from dgc import DGCCompressor, DGCConfig, encode  # noqa: E402
from dgc.batched import BatchedSelector  # noqa: E402
from dgc.selection import num_selected, select_sampled  # noqa: E402

DENSITY = 0.001
STUDY_ROUNDS, STUDY_SEEDS = 50, "0,1,2"


def device_line(device: torch.device) -> str:
    """What the figures were measured on, and when."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        what = f"{name}, CUDA {torch.version.cuda}"
    else:
        what = f"CPU, {torch.get_num_threads()} thread(s), {os.cpu_count()} visible"
    return f"{what}; torch {torch.__version__}; {datetime.date.today().isoformat()}"


def timed_ms(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, float]:
    """Median wall time and median process CPU time of ``fn()`` in ms, the device synchronised
    before and after (on a shared host the CPU time is the steadier figure)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # warm-up: plans, allocator, kernels
    wall, cpu = [], []
    for _ in range(repeats):
        sync()
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        sync()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.process_time() - start_cpu) * 1e3)
    return statistics.median(wall), statistics.median(cpu)


# ----------------------------------------------------------------------------- 1. encoder
def encoder_ops(shapes: dict[str, tuple[int, ...]],
                device: torch.device) -> dict[str, Callable[[], Any]]:
    """The timed operations on one gradient of ``shapes`` on ``device``."""
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(s, generator=gen).to(device) for n, s in shapes.items()}
    policy = DGCConfig(density=DENSITY, warmup="none")
    sparse = [n for n, g in grads.items() if not policy.sends_dense(tuple(g.shape))]
    flat_sparse = torch.cat([grads[n].reshape(-1) for n in sparse])
    magnitudes = [grads[n].reshape(-1).abs() for n in sparse]
    flat_all = torch.cat([g.reshape(-1) for g in grads.values()])
    threshold = 3.0  # about the 0.1% quantile of |N(0, 1)|; the floor's cost does not depend on it
    selector = BatchedSelector([grads[n].numel() for n in sparse], DENSITY, policy, device)
    flat_magnitude = flat_sparse.abs()
    step = [0]

    def floor() -> None:
        for g in grads.values():
            torch.ge(g.abs(), threshold)

    def floor_flat() -> None:
        torch.ge(flat_all.abs(), threshold)

    def topk() -> None:
        for m in magnitudes:
            torch.topk(m, num_selected(m.numel(), DENSITY), sorted=False)

    def sampled_per_tensor() -> None:
        step[0] += 1
        for m in magnitudes:
            select_sampled(m, num_selected(m.numel(), DENSITY), DENSITY, offset=step[0])

    def sampled_batched() -> None:
        step[0] += 1
        selector.select(flat_magnitude, step[0])

    compressor = DGCCompressor(policy)  # batched on an accelerator, per tensor on the host
    coder = DGCCompressor(policy)
    ops: dict[str, Callable[[], Any]] = {
        "floor": floor, "floor, flat": floor_flat, "topk": topk,
        "sampled, per tensor": sampled_per_tensor, "sampled, batched": sampled_batched,
        "compress": lambda: compressor.compress(grads),
        "compress + encode": lambda: encode(coder.compress(grads)),
    }
    if device.type == "cpu":  # the batched compressor is the accelerator's; on the host too
        batched = DGCCompressor(policy, batched=True)
        ops["compress, batched"] = lambda: batched.compress(grads)
    return ops


def run_encoder(device: torch.device, repeats: int) -> None:
    print(f"\n## encoder, density {DENSITY}, median of {repeats} ({device_line(device)})")
    print(f"{'workload':24} {'operation':22} {'wall_ms':>9} {'cpu_ms':>9}")
    workloads = {"resnet50 (161 tensors)": resnet50_shapes(),
                 "25600x1000 tensor": {"w": (25600, 1000)}}
    # On a GPU the wall time (the device synchronised) is the figure; on a shared host the
    # process CPU time is.
    pick = 0 if device.type == "cuda" else 1
    for workload, shapes in workloads.items():
        ms = {}
        for op, fn in encoder_ops(shapes, device).items():
            wall, cpu = timed_ms(fn, device, repeats)
            ms[op] = (wall, cpu)[pick]
            print(f"{workload:24} {op:22} {wall:9.2f} {cpu:9.2f}", flush=True)
        print(f"{workload:24} ratios ({('wall', 'cpu')[pick]}): batched/topk = "
              f"{ms['sampled, batched'] / ms['topk']:.2f} (target <= 1), batched/floor = "
              f"{ms['sampled, batched'] / ms['floor']:.2f} (target <= 2), batched/floor-flat = "
              f"{ms['sampled, batched'] / ms['floor, flat']:.2f}, per-tensor/topk = "
              f"{ms['sampled, per tensor'] / ms['topk']:.2f}", flush=True)


# ----------------------------------------------------------------------------- 2. clients
CLIENT_STEPS, CLIENT_BATCH = 120, 10


def run_clients(device: torch.device, counts: list[int], repeats: int) -> None:
    import tasks
    from client.batched_training import BatchedClient, train_batched
    from fedgc.training import train_locally

    print(f"\n## clients per second, Fashion-MNIST CNN, {CLIENT_STEPS} steps of batch "
          f"{CLIENT_BATCH} per client ({device_line(device)})")
    task = tasks.get_task("fashion-mnist")
    parts = task.partition(max(counts), scheme="iid", seed=0)
    torch.manual_seed(0)
    model = task.build_model().to(device)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y = task.train_x.to(device), task.train_y.to(device)
    settings = dict(lr=0.05, batch_size=CLIENT_BATCH, local_epochs=1, local_steps=CLIENT_STEPS,
                    momentum=0.5, weight_decay=0.0)

    def one_at_a_time(n: int) -> None:
        for key in range(n):
            model.load_state_dict(start)
            idx = torch.as_tensor(parts[key], device=device)
            train_locally(model, x[idx], y[idx], task.training_loss, seed=key, **settings)

    def at_once(n: int) -> None:
        clients = [BatchedClient(start, x[torch.as_tensor(parts[k], device=device)],
                                 y[torch.as_tensor(parts[k], device=device)], seed=k)
                   for k in range(n)]
        train_batched(model, clients, **settings)

    pick = 0 if device.type == "cuda" else 1  # wall on a GPU, process CPU time on a host
    what = ("wall", "cpu")[pick]
    single = min(counts[0], 10)
    ms = timed_ms(lambda: one_at_a_time(single), device, max(1, repeats // 2))[pick]
    print(f"one at a time: {single} clients in {ms / 1e3:.2f} s ({what}), "
          f"{single / (ms / 1e3):.1f} clients/s", flush=True)
    for n in counts:
        ms_b = timed_ms(lambda n=n: at_once(n), device, max(1, repeats // 2))[pick]
        rate = n / (ms_b / 1e3)
        print(f"batched: {n} clients in {ms_b / 1e3:.2f} s ({what}), {rate:.1f} clients/s, "
              f"{rate / (single / (ms / 1e3)):.1f}x one at a time (target on a GPU: >= 100 "
              f"clients/s)", flush=True)


# ----------------------------------------------------------------------------- 3. study
def run_study(device: torch.device, seeds: str, rounds: int, engine: str, jobs: int) -> None:
    n_seeds = len(seeds.split(","))
    print(f"\n## fashion-mnist study: 5 methods x {n_seeds} seed(s) x {rounds} rounds, "
          f"sim.engine={engine} ({device_line(device)})", flush=True)
    with tempfile.TemporaryDirectory(prefix="fedgc-gpu-study-") as results:
        command = [sys.executable, "-m", "simulations", "compare", "--scenario", "fashion-mnist",
                   "--seeds", seeds, "--set", f"sim.engine={engine}", "--set",
                   f"rounds={rounds}", "--set", f"results_dir={results}", "--set",
                   "run_name=study", "--set", "progress=false"]
        if engine in ("local", "batched"):
            command[4:4] = ["--jobs", str(jobs)]
        if device.type == "cuda":
            command += ["--set", "sim.device=cuda"]
        start = time.perf_counter()
        subprocess.run(command, check=True, cwd=Path(__file__).resolve().parent.parent,
                       stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        rounds_s = sum(float(row["wall_seconds"]) for path in Path(results).rglob("rounds.csv")
                       for row in csv.DictReader(path.open()))
    # The rounds scale with the rounds and the runs; the rest (start-up, data) with the runs.
    per_jobs = rounds_s / jobs
    whole = ((wall - per_jobs) + per_jobs * STUDY_ROUNDS / rounds) * (3 / n_seeds)
    print(f"wall time {wall / 60:.2f} min, of which rounds {rounds_s:.0f} s over {jobs} job(s); "
          f"the whole study (3 seeds x {STUDY_ROUNDS} rounds) at this rate: about "
          f"{whole / 60:.1f} min (target on a GPU: under 5; 48 on the 2 CPU cores)", flush=True)
    print(f"command: {' '.join(command[1:])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--parts", default="encoder,clients,study")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: 1 on the CPU, where the CPU time of idle "
                             "threads spinning would count; torch's own on a GPU)")
    parser.add_argument("--clients", default=None,
                        help="batched client counts (default 10,100,1000 on a GPU, 10,50 on CPU)")
    parser.add_argument("--seeds", default=None, help="study seeds (default 0,1,2 on a GPU)")
    parser.add_argument("--study-rounds", type=int, default=None)
    parser.add_argument("--engine", default=None, help="study engine (default batched)")
    parser.add_argument("--jobs", type=int, default=None,
                        help="study runs at a time (default: 2 on the CPU; on a GPU half the "
                             "cores, at most 15: the server's side of a run is host work)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu.py: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    on_gpu = device.type == "cuda"
    if args.threads or not on_gpu:
        torch.set_num_threads(args.threads or 1)
    parts = args.parts.split(",")
    print(f"# bench/gpu.py on {device_line(device)}")
    if "encoder" in parts:
        run_encoder(device, args.repeats)
    if "clients" in parts:
        counts = [int(c) for c in (args.clients or ("10,100,1000" if on_gpu else "10,50"))
                  .split(",")]
        run_clients(device, counts, args.repeats)
    if "study" in parts:
        jobs = args.jobs or (min(15, max(1, (os.cpu_count() or 2) // 2)) if on_gpu else 2)
        run_study(device, args.seeds or (STUDY_SEEDS if on_gpu else "0"),
                  args.study_rounds or (STUDY_ROUNDS if on_gpu else 2),
                  args.engine or "batched", jobs)


if __name__ == "__main__":
    main()
