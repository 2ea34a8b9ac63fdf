"""Server downlink: int8 broadcast patches of values against patches of differences.

A ``DGCStrategy`` with ``downlink_values="int8"`` at ``downlink_density`` 0.07 follows a global
model of ~1M parameters (the MLP 784-1200-10 of ``bench/scale.py``) through ``--rounds``
aggregations of small random steps, twice: with ``downlink_deltas=False`` (patches carry the
entries' values, the baseline) and with ``downlink_deltas=True`` (patches on one known version
carry differences, which the client adds). Then, for patches on versions 1, 5, 10 and
``--rounds`` back, it times building the patch (``Downlink.patch``: the changed entries,
for differences the past values from the kept history, the exactness check, the size
comparison, the encoding) and prints its bytes, both sides interleaved on the same machine
state, with the ratios. A patch of differences is checked to rebuild the current model from
the old version bit for bit before anything is timed.

The steps are Gaussian, a tenth of the initial weights' spread per round, so weights drift as
in training; real training moves fewer entries far and more entries little, which favours
differences more (docs/netem.md measures 4.2 bits per entry against 5.5 on mnist5k).

Run: ``python bench/downlink.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import OrderedDict
from pathlib import Path

import torch
from flwr.app import ArrayRecord

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dgc  # noqa: E402
from bench.common import interleaved_wall_cpu_ms, machine_line  # noqa: E402
from dgc import SparseTensor, SparseUpdate  # noqa: E402
from fedgc.settings import RunConfig  # noqa: E402
from server.strategy import DGCStrategy  # noqa: E402


def mlp(seed: int) -> OrderedDict[str, torch.Tensor]:
    """MLP 784-1200-10 with PyTorch's default initialisation bounds (954,010 parameters)."""
    g = torch.Generator().manual_seed(seed)
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, fan_in, fan_out in (("fc1", 784, 1200), ("fc2", 1200, 10)):
        bound = 1.0 / math.sqrt(fan_in)
        out[f"{name}.weight"] = (torch.rand(fan_out, fan_in, generator=g) * 2 - 1) * bound
        out[f"{name}.bias"] = (torch.rand(fan_out, generator=g) * 2 - 1) * bound
    return out


def follow(deltas: bool, rounds: int, density: float, seed: int) -> DGCStrategy:
    """A strategy after ``rounds`` aggregations of the same seeded steps."""
    start = mlp(seed)
    s = DGCStrategy(RunConfig.from_flat({
        "clients_per_round": 2, "downlink_density": density, "downlink_values": "int8",
        "downlink_history": rounds, "downlink_deltas": deltas, "checkpoint": False,
        "clients_build_initial_model": False, "run_name": "bench"}))
    s.set_model(ArrayRecord(OrderedDict((k, v.clone()) for k, v in start.items())))
    g = torch.Generator().manual_seed(seed + 1)
    for rnd in range(1, rounds + 1):
        step = {k: 0.1 * v.std() * torch.randn(v.shape, generator=g) for k, v in start.items()}
        s.apply([SparseUpdate({k: SparseTensor(torch.arange(v.numel()), v.view(-1),
                                               tuple(v.shape)) for k, v in step.items()},
                              rnd)], [1.0])
    return s


def check_exact(s: DGCStrategy, base: int) -> None:
    """The patch of differences on ``base`` turns version ``base`` into the current model."""
    data, added = s.downlink.patch((base,))
    if not added:
        raise SystemExit(f"no tensor of the patch on version {base} carried differences")
    held = s.downlink.grid_values_at(base)
    assert held is not None
    update = dgc.decode(data, max_numel=dgc.wire.MAX_NUMEL)
    for name in added:
        t = update.tensors[name]
        flat = held[name].view(-1)
        flat[t.indices] += t.values
        if not torch.equal(held[name].view(torch.int32), s.sent_model[name].view(torch.int32)):
            raise SystemExit(f"{name}: the differences on version {base} are not exact")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rounds", type=int, default=20, help="aggregations before timing")
    p.add_argument("--density", type=float, default=0.07, help="downlink_density")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    values = follow(False, a.rounds, a.density, a.seed)
    deltas = follow(True, a.rounds, a.density, a.seed)
    print(machine_line(1))
    print(f"int8 broadcast of a 954,010-parameter MLP, downlink_density {a.density}, "
          f"{a.rounds} aggregations; patch on a version k back (median of {a.repeats}, "
          f"interleaved; ratio = differences / values)")
    print(f"{'k back':>7} {'values kB':>10} {'diffs kB':>9} {'bytes':>6} "
          f"{'values ms':>10} {'diffs ms':>9} {'time':>6}")
    for back in sorted({1, 5, 10, a.rounds}):
        base = a.rounds - back
        check_exact(deltas, base)
        times = interleaved_wall_cpu_ms({"values": lambda b=base: values.downlink.patch((b,)),
                                         "deltas": lambda b=base: deltas.downlink.patch((b,))},
                                        repeats=a.repeats)
        nv, nd = len(values.downlink.patch((base,))[0]), len(deltas.downlink.patch((base,))[0])
        tv, td = times["values"][0], times["deltas"][0]
        print(f"{back:>7} {nv / 1e3:>10.1f} {nd / 1e3:>9.1f} {nd / nv:>6.2f} "
              f"{tv:>10.1f} {td:>9.1f} {td / tv:>6.2f}")
    kept = deltas.downlink.past_nbytes / 2**20
    print(f"history kept for differences: {kept:.1f} MiB over {len(deltas.downlink.past)} versions")


if __name__ == "__main__":
    main()
