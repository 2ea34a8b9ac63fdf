"""Server aggregation: 100 sparse DGC updates vs Flower's dense FedAvg on the same updates.

The model (``--model resnet50``, the default) has ResNet-50's 161 parameter tensors and shapes
(25.6M parameters: 53 convolutions, 53 batch norms' weight and bias, the 1000x2048 classifier
and its bias); ``--model blocks`` is the coarser 22-tensor stand-in of the same size (ten
512x512x3x3 convolutions, a 1000x2048 classifier and their biases). Every client update keeps a
``density`` fraction of each tensor of more than one dim (random positions, fp16 values, as DGC
sends them) and its 1-D tensors dense.

- fedgc: ``dgc.decode_many`` of the updates' wire bytes (the replies of a round share their
  structure: headers read against the first one's), then ``dgc.aggregate`` (scatter-add,
  O(total nonzeros)) -- what ``DGCStrategy`` does per round. "Decode one by one" is
  ``dgc.decode`` of each, for comparison. The output goes into a buffer the
  server keeps across rounds (``dgc.aggregate_buffers``: one block, so that each decoded update
  is scattered in one call; its ``zero_()`` is timed too); the line with a fresh output each
  call is printed for comparison. "Aggregate only" sums the already decoded updates.
- Flower: the same updates densified into ArrayRecords (what a dense client would send) and
  averaged by ``flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords``, the function
  the stock ``FedAvg.aggregate_train`` calls (deserialize each Array, weighted sum).

Memory: 100 dense fp32 updates are 10 GB, so Flower's side is timed on ``--dense-sample`` of the
100 updates and scaled by ``clients / dense-sample``: its cost is one deserialization and one
multiply-add per reply, linear in the number of replies (the script prints the per-reply cost at
half and at the full sample to show it). Both results are checked to agree on the sample.

All operations run in turns, ``--repeats`` rounds, and each one's fastest round is reported
(wall and process CPU time), so that on a shared machine they see the same background load.

Run: ``python bench/aggregate.py`` (about a minute on 2 cores, ~2.5 GB of memory).
"""

from __future__ import annotations

import argparse
import gc
import math
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

import dgc
from dgc import SparseTensor, SparseUpdate


def resnet50_shapes() -> OrderedDict[str, tuple[int, ...]]:
    """The parameter shapes of torchvision's ResNet-50, in its order (161 tensors, 25.6M)."""
    shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def conv_bn(prefix: str, bn: str, cin: int, cout: int, k: int) -> None:
        shapes[f"{prefix}.weight"] = (cout, cin, k, k)
        shapes[f"{bn}.weight"] = (cout,)
        shapes[f"{bn}.bias"] = (cout,)

    conv_bn("conv1", "bn1", 3, 64, 7)
    inplanes = 64
    for layer, (planes, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3),
                                                 strict=True), start=1):
        for b in range(blocks):
            p = f"layer{layer}.{b}"
            conv_bn(f"{p}.conv1", f"{p}.bn1", inplanes, planes, 1)
            conv_bn(f"{p}.conv2", f"{p}.bn2", planes, planes, 3)
            conv_bn(f"{p}.conv3", f"{p}.bn3", planes, planes * 4, 1)
            if b == 0:
                conv_bn(f"{p}.downsample.0", f"{p}.downsample.1", inplanes, planes * 4, 1)
            inplanes = planes * 4
    shapes["fc.weight"] = (1000, 2048)
    shapes["fc.bias"] = (1000,)
    return shapes


def model_shapes() -> OrderedDict[str, tuple[int, ...]]:
    """25.6M parameters in 22 tensors shaped like a ResNet-50's bulk."""
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


def best_interleaved(ops: dict[str, Callable[[], object]],
                     repeats: int) -> dict[str, tuple[float, float]]:
    """Fastest wall time and fastest process CPU time of each operation, run in turns.

    CPU time is reported too because wall time on a loaded machine includes waiting for a core.
    """
    best = {name: (float("inf"), float("inf")) for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():
            gc.collect()
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def main() -> None:
    """Print both timings, the ratio, and the agreement check."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--density", type=float, default=0.001)
    p.add_argument("--dense-sample", type=int, default=8,
                   help="updates Flower's dense aggregation is timed on (memory bound)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", choices=["resnet50", "blocks"], default="resnet50")
    args = p.parse_args()
    torch.set_num_threads(1)
    shapes = resnet50_shapes() if args.model == "resnet50" else model_shapes()
    num_params = sum(math.prod(s) for s in shapes.values())
    weights = [float(10 + (i % 7)) for i in range(args.clients)]
    updates = [sparse_update(shapes, args.density, seed=i) for i in range(args.clients)]
    wire = [dgc.encode(u) for u in updates]
    nnz = sum(u.nnz for u in updates)

    bound = dgc.wire.max_numel_of(shapes.values())
    # what the server aggregates (packed arrays)
    decoded = [dgc.decode(b, max_numel=bound) for b in wire]

    # The server's buffer, kept across rounds (allocated and first touched once, up front), laid
    # out as one block so that each update is scattered in one call.
    buffer = dgc.aggregate_buffers(shapes)

    def ours(n: int):
        decoded = dgc.decode_many(wire[:n], max_numel=bound)
        for t in buffer.values():
            t.zero_()
        return dgc.aggregate(decoded, weights[:n], shapes, out=buffer)

    def ours_aggregate_only(n: int):
        for t in buffer.values():
            t.zero_()
        return dgc.aggregate(decoded[:n], weights[:n], shapes, out=buffer)

    def ours_fresh_output(n: int):
        return dgc.aggregate(decoded[:n], weights[:n], shapes)

    def decode_only(n: int):
        return dgc.decode_many(wire[:n], max_numel=bound)

    def decode_one_by_one(n: int):
        return [dgc.decode(b, max_numel=bound) for b in wire[:n]]

    k = min(args.dense_sample, args.clients)
    half = max(1, k // 2)
    records = [dense_record(u, w) for u, w in zip(updates[:k], weights[:k], strict=True)]
    # All operations in turns, each round once: on a shared machine every one sees the same
    # background load, and the fastest of the rounds is each one's least disturbed time.
    best = best_interleaved({
        "ours": lambda: ours(args.clients),
        "aggregate": lambda: ours_aggregate_only(args.clients),
        "fresh": lambda: ours_fresh_output(args.clients),
        "decode": lambda: decode_only(args.clients),
        "decode_each": lambda: decode_one_by_one(args.clients),
        "flower_half": lambda: aggregate_arrayrecords(records[:half], "num-examples"),
        "flower": lambda: aggregate_arrayrecords(records, "num-examples"),
    }, args.repeats)
    t_ours, c_ours = best["ours"]
    t_ours_agg, c_ours_agg = best["aggregate"]
    t_fresh, c_fresh = best["fresh"]
    t_dec, c_dec = best["decode"]
    t_dec1, c_dec1 = best["decode_each"]
    t_half, _ = best["flower_half"]
    t_k, c_k = best["flower"]
    flower = aggregate_arrayrecords(records, "num-examples")
    per_reply = t_k / k
    t_flower = per_reply * args.clients
    c_flower = c_k / k * args.clients

    # Same math: FedAvg of the sample, both ways.
    mine = {n: t.clone() for n, t in ours(k).items()}
    diff = max(float(np.max(np.abs(flower[n].numpy() - mine[n].numpy()))) for n in shapes)

    print(f"model: {args.model}, {len(shapes)} tensors, {num_params / 1e6:.1f}M parameters; "
          f"{args.clients} updates at density "
          f"{args.density} ({nnz / args.clients:,.0f} nonzeros each, "
          f"{sum(map(len, wire)) / args.clients / 1e3:.1f} kB on the wire each)")
    print(f"fedgc  decode + sparse aggregate, {args.clients} updates: {t_ours * 1e3:9.1f} ms "
          f"(CPU {c_ours * 1e3:.1f} ms)")
    print(f"fedgc  decode only,               {args.clients} updates: {t_dec * 1e3:9.1f} ms "
          f"(CPU {c_dec * 1e3:.1f} ms, {c_dec / args.clients * 1e3:.2f} ms CPU per update)")
    print(f"fedgc  decode one by one,         {args.clients} updates: {t_dec1 * 1e3:9.1f} ms "
          f"(CPU {c_dec1 * 1e3:.1f} ms, {c_dec1 / args.clients * 1e3:.2f} ms CPU per update)")
    print(f"fedgc  sparse aggregate only,     {args.clients} updates: {t_ours_agg * 1e3:9.1f} ms "
          f"(CPU {c_ours_agg * 1e3:.1f} ms)")
    print(f"fedgc  sparse aggregate, fresh output each call:  {t_fresh * 1e3:9.1f} ms "
          f"(CPU {c_fresh * 1e3:.1f} ms)")
    print(f"Flower dense FedAvg, measured on {half} updates: {t_half * 1e3:9.1f} ms "
          f"({t_half / half * 1e3:.1f} ms per reply)")
    print(f"Flower dense FedAvg, measured on {k} updates: {t_k * 1e3:9.1f} ms "
          f"({per_reply * 1e3:.1f} ms per reply)")
    print(f"Flower dense FedAvg, {args.clients} updates (scaled x{args.clients / k:g}): "
          f"{t_flower * 1e3:9.1f} ms (CPU {c_flower * 1e3:.1f} ms)")
    print(f"max |difference| of the two averages on the {k}-update sample: {diff:.2e}")
    print(f"speedup over Flower's dense FedAvg, {args.clients} updates (target 50x), "
          f"wall time / CPU time:")
    print(f"  including decode (decode + aggregate): {t_flower / t_ours:7.1f}x / "
          f"{c_flower / c_ours:7.1f}x")
    print(f"  aggregation alone:                     {t_flower / t_ours_agg:7.1f}x / "
          f"{c_flower / c_ours_agg:7.1f}x")


if __name__ == "__main__":
    main()
