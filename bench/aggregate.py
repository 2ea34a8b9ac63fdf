"""Server aggregation: 100 sparse DGC updates vs Flower's dense FedAvg on the same updates.

The model has 25.6M parameters (ResNet-50's count: ten 512x512x3x3 convolutions, a 1000x2048
classifier and their biases). Every client update keeps a ``density`` fraction of each large
tensor (random positions, fp16 values, as DGC sends them) and its biases dense.

- fedgc: ``dgc.decode`` of each update's wire bytes, then ``dgc.aggregate`` (scatter-add,
  O(total nonzeros)) -- what ``DGCStrategy.aggregate_train`` does per round.
- Flower: the same updates densified into ArrayRecords (what a dense client would send) and
  averaged by ``flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords``, the function
  the stock ``FedAvg.aggregate_train`` calls (deserialize each Array, weighted sum).

Memory: 100 dense fp32 updates are 10 GB, so Flower's side is timed on ``--dense-sample`` of the
100 updates and scaled by ``clients / dense-sample``: its cost is one deserialization and one
multiply-add per reply, linear in the number of replies (the script prints the per-reply cost at
half and at the full sample to show it). Both results are checked to agree on the sample.

Run: ``python bench/aggregate.py`` (about a minute on 2 cores, ~2.5 GB of memory).
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from collections import OrderedDict

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

import dgc
from dgc import SparseTensor, SparseUpdate


def model_shapes() -> OrderedDict[str, tuple[int, ...]]:
    """25.6M parameters shaped like a ResNet-50's bulk."""
    shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
    for i in range(10):
        shapes[f"conv{i}.weight"] = (512, 512, 3, 3)
        shapes[f"conv{i}.bias"] = (512,)
    shapes["fc.weight"] = (1000, 2048)
    shapes["fc.bias"] = (1000,)
    return shapes


def sparse_update(shapes, density: float, seed: int) -> SparseUpdate:
    """One client's update: ``density`` of each large tensor at random positions, fp16."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if len(shape) <= 1:
            idx = torch.arange(numel, dtype=torch.int64)
        else:
            k = max(1, math.ceil(numel * density))
            idx = torch.unique(torch.randint(0, numel, (int(k * 1.05) + 8,), generator=g))[:k]
        values = torch.randn(idx.numel(), generator=g).to(torch.float16)
        tensors[name] = SparseTensor(idx, values, shape)
    return SparseUpdate(tensors, sequence=1)


def dense_record(update: SparseUpdate, weight: float) -> RecordDict:
    """The same update as a dense client would send it to Flower's FedAvg."""
    arrays = ArrayRecord(OrderedDict(
        (name, Array(t.to_dense().numpy())) for name, t in update.tensors.items()))
    return RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": weight})})


def best_of(fn, repeats: int) -> tuple[float, object]:
    """Fastest wall time of ``repeats`` calls, and the last result."""
    best, out = float("inf"), None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    """Print both timings, the ratio, and the agreement check."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--dense-sample", type=int, default=8,
                   help="updates Flower's dense aggregation is timed on (memory bound)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    shapes = model_shapes()
    num_params = sum(math.prod(s) for s in shapes.values())
    weights = [float(10 + (i % 7)) for i in range(args.clients)]
    updates = [sparse_update(shapes, args.density, seed=i) for i in range(args.clients)]
    wire = [dgc.encode(u) for u in updates]
    nnz = sum(u.nnz for u in updates)

    def ours(n: int):
        decoded = [dgc.decode(b) for b in wire[:n]]
        return dgc.aggregate(decoded, weights[:n], shapes)

    def ours_aggregate_only(n: int):
        return dgc.aggregate(updates[:n], weights[:n], shapes)

    t_ours, _ = best_of(lambda: ours(args.clients), args.repeats)
    t_ours_agg, _ = best_of(lambda: ours_aggregate_only(args.clients), args.repeats)

    k = min(args.dense_sample, args.clients)
    half = max(1, k // 2)
    records = [dense_record(u, w) for u, w in zip(updates[:k], weights[:k], strict=True)]
    t_half, _ = best_of(lambda: aggregate_arrayrecords(records[:half], "num-examples"),
                        args.repeats)
    t_k, flower = best_of(lambda: aggregate_arrayrecords(records, "num-examples"), args.repeats)
    per_reply = t_k / k
    t_flower = per_reply * args.clients

    # Same math: FedAvg of the sample, both ways.
    mine = ours(k)
    diff = max(float(np.max(np.abs(flower[n].numpy() - mine[n].numpy()))) for n in shapes)

    print(f"model: {num_params / 1e6:.1f}M parameters; {args.clients} updates at density "
          f"{args.density} ({nnz / args.clients:,.0f} nonzeros each, "
          f"{sum(map(len, wire)) / args.clients / 1e3:.1f} kB on the wire each)")
    print(f"fedgc  decode + sparse aggregate, {args.clients} updates: {t_ours * 1e3:9.1f} ms")
    print(f"fedgc  sparse aggregate only,     {args.clients} updates: {t_ours_agg * 1e3:9.1f} ms")
    print(f"Flower dense FedAvg, measured on {half} updates: {t_half * 1e3:9.1f} ms "
          f"({t_half / half * 1e3:.1f} ms per reply)")
    print(f"Flower dense FedAvg, measured on {k} updates: {t_k * 1e3:9.1f} ms "
          f"({per_reply * 1e3:.1f} ms per reply)")
    print(f"Flower dense FedAvg, {args.clients} updates (scaled x{args.clients / k:g}): "
          f"{t_flower * 1e3:9.1f} ms")
    print(f"max |difference| of the two averages on the {k}-update sample: {diff:.2e}")
    print(f"ratio (Flower dense / fedgc decode + aggregate): {t_flower / t_ours:7.1f}x")
    print(f"ratio (Flower dense / fedgc aggregate only):     {t_flower / t_ours_agg:7.1f}x")


if __name__ == "__main__":
    main()
