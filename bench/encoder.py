"""Benchmark: time and memory to select and encode a gradient, against torch.topk and a floor.

For a ResNet-50-sized gradient (its 161 parameter tensors, 25.6M floats; and the same count as
one 25600x1000 tensor) and for 1M floats, at density 0.001, it prints the median time of

- ``floor``: one ``abs`` + compare pass over every tensor (a memory-bound lower bound),
- ``topk``: ``torch.topk`` of ``|x|`` per sparsified tensor (what exact selection costs),
- ``compress exact`` / ``compress sampled``: ``DGCCompressor.compress`` (momentum correction,
  masking, selection, residual update; fp16 values),
- ``sampled + encode``: compress and ``dgc.encode`` (skipped, with a note, without dgc.wire),

and the ratios sampled/topk and encode-total/floor, plus the peak resident memory each
operation adds above its inputs (peak RSS of a fresh child process per figure).

``--tie-rule`` prints instead the cost of TCS's deterministic top-k (``fedgc.methods.tcs.largest``:
ties at the k-th largest to the lower positions, so that a phone picks the coordinates a simulated
client picks) against ``torch.topk`` of the same scores measured in the same run, at 1e5 and 1e6
coordinates, TCS's two sizes of k (no mask yet: the mask's share and the top-k's, 1.1%; beside a
mask: 0.1%), on scores with no tie, with one straddling the k-th (magnitudes on a grid) and all
equal.

Run: ``python bench/encoder.py [--threads N] [--repeats R] [--no-memory] [--tie-rule]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import interleaved_wall_cpu_ms, machine_line, max_rss_mb  # noqa: E402
from dgc.compressor import DGCCompressor  # noqa: E402
from dgc.config import DGCConfig  # noqa: E402
from dgc.selection import num_selected  # noqa: E402
from fedgc.methods.tcs import TCS_DENSITY, Budget, largest  # noqa: E402

DENSITY = 0.001
RESNET50_NUMEL = 25_557_032  # torchvision's resnet50: parameters with gradients


def resnet50_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter shapes of ResNet-50 (He et al. 2016; torchvision's layout and names)."""
    shapes: dict[str, tuple[int, ...]] = {"conv1.weight": (64, 3, 7, 7),
                                          "bn1.weight": (64,), "bn1.bias": (64,)}
    inplanes = 64
    for stage, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for b in range(blocks):
            p = f"layer{stage}.{b}."
            shapes[p + "conv1.weight"] = (planes, inplanes, 1, 1)
            shapes[p + "conv2.weight"] = (planes, planes, 3, 3)
            shapes[p + "conv3.weight"] = (planes * 4, planes, 1, 1)
            for i, c in ((1, planes), (2, planes), (3, planes * 4)):
                shapes[p + f"bn{i}.weight"] = (c,)
                shapes[p + f"bn{i}.bias"] = (c,)
            if b == 0:
                shapes[p + "downsample.0.weight"] = (planes * 4, inplanes, 1, 1)
                shapes[p + "downsample.1.weight"] = (planes * 4,)
                shapes[p + "downsample.1.bias"] = (planes * 4,)
            inplanes = planes * 4
    shapes["fc.weight"] = (1000, 2048)
    shapes["fc.bias"] = (1000,)
    return shapes


WORKLOADS: dict[str, Callable[[], dict[str, tuple[int, ...]]]] = {
    "resnet50 (161 tensors)": resnet50_shapes,
    "25600x1000 tensor": lambda: {"w": (25600, 1000)},
    "1000x1000 tensor": lambda: {"w": (1000, 1000)},
}


def _encode() -> Callable[[Any], bytes] | None:
    try:
        from dgc.wire import encode
    except ImportError:
        return None
    return encode


def _gradient(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def _operations(grads: dict[str, torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """The timed operations on one gradient; compressors are built (and their state) here."""
    sparse = DGCCompressor(DGCConfig(density=DENSITY))
    sparse_names = [n for n, g in grads.items() if not sparse.is_dense_tensor(g.shape)]
    flat = {n: grads[n].reshape(-1) for n in sparse_names}
    threshold = 3.0  # about the 0.1% quantile of |N(0, 1)|; the floor's cost does not depend on it

    def floor() -> None:
        for g in grads.values():
            torch.ge(g.abs(), threshold)

    def topk() -> None:
        for g in flat.values():
            torch.topk(g.abs(), num_selected(g.numel(), DENSITY), sorted=False)

    ops: dict[str, Callable[[], Any]] = {"floor": floor, "topk": topk}
    for selection in ("exact", "sampled"):
        comp = DGCCompressor(DGCConfig(density=DENSITY, warmup="none", selection=selection))
        ops[f"compress {selection}"] = lambda comp=comp: comp.compress(grads)
    encode = _encode()
    if encode is not None:
        comp = DGCCompressor(DGCConfig(density=DENSITY, warmup="none", selection="sampled"))
        ops["sampled + encode"] = lambda: encode(comp.compress(grads))
    return ops


#: Sizes of the tie rule's case, and its scores: |N(0, 1)| (no tie), the same on a grid of 1/8
#: (about 400 entries of 1e5 share each grid point near the k-th: a tie straddles it) and ones.
TIE_RULE_SIZES = (100_000, 1_000_000)
TIE_RULE_SCORES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "no tie": lambda g: g.abs(),
    "tie at the k-th": lambda g: (g.abs() * 8).round() / 8,
    "all equal": torch.ones_like,
}


def _tie_rule(repeats: int) -> None:
    """Print TCS's selection against torch.topk on the same scores, in turns (module docstring)."""
    budget = Budget(TCS_DENSITY, 0.0, 0, 0.1)  # tcs's defaults: topk_share 0.1
    print(f"{'floats':>9} {'k':>6} {'scores':16} {'topk_ms':>9} {'largest_ms':>11} "
          f"{'wall ratio':>10} {'cpu ratio':>9}")
    for numel in TIE_RULE_SIZES:
        g = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        for k in (budget.topk(numel, None), budget.topk(numel, budget.mask(numel))):
            for label, make in TIE_RULE_SCORES.items():
                score = make(g)
                timed = interleaved_wall_cpu_ms(
                    {"topk": lambda s=score, k=k: torch.topk(s, k, sorted=False),
                     "largest": lambda s=score, k=k: largest(s, k)}, repeats=repeats)
                (topk_wall, topk_cpu), (rule_wall, rule_cpu) = timed["topk"], timed["largest"]
                print(f"{numel:>9} {k:>6} {label:16} {topk_cpu:>9.3f} {rule_cpu:>11.3f} "
                      f"{rule_wall / topk_wall:>9.2f}x {rule_cpu / topk_cpu:>8.2f}x", flush=True)


def _memory_child(workload: str, op: str, threads: int) -> None:
    torch.set_num_threads(threads)
    ops = _operations(_gradient(WORKLOADS[workload]()))
    base_mb = max_rss_mb()
    for _ in range(2):  # the first call also creates the compressor state (u and v)
        ops[op]()
    print(json.dumps({"peak_extra_mb": max_rss_mb() - base_mb}))


def _peak_extra_mb(workload: str, op: str, threads: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--memory-child", workload, op,
                          "--threads", str(threads)], check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_extra_mb"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true", help="skip the memory figures")
    parser.add_argument("--tie-rule", action="store_true",
                        help="time TCS's tie rule against torch.topk instead (module docstring)")
    parser.add_argument("--memory-child", nargs=2, metavar=("WORKLOAD", "OP"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        _memory_child(*args.memory_child, args.threads)
        return
    torch.set_num_threads(args.threads)
    if args.tie_rule:
        print(f"# TCS's tie rule against torch.topk; {machine_line(args.threads)}")
        print(f"# median of {args.repeats} runs, the two in turns, after one warm-up; ms are "
              f"process CPU time, ratios wall and CPU")
        _tie_rule(args.repeats)
        return
    assert sum(math.prod(s) for s in resnet50_shapes().values()) == RESNET50_NUMEL
    print(f"# encoder benchmark, density {DENSITY}; {machine_line(args.threads)}")
    print(f"# median of {args.repeats} runs, operations in turns, after one warm-up (wall and "
          "process CPU time); memory: "
          "peak RSS (VmHWM) a fresh process adds above its inputs over two calls, compressor "
          "state included")
    if _encode() is None:
        print("# note: dgc.wire is not on this branch yet; 'sampled + encode' is skipped")
    print(f"{'workload':24} {'operation':18} {'floats':>10} {'wall_ms':>9} {'cpu_ms':>9} "
          f"{'peak_MiB':>9}")
    for workload, shapes_fn in WORKLOADS.items():
        grads = _gradient(shapes_fn())
        numel = sum(g.numel() for g in grads.values())
        ops = _operations(grads)
        timed = interleaved_wall_cpu_ms(ops, repeats=args.repeats)
        wall_ms = {op: w for op, (w, _) in timed.items()}
        cpu_ms = {op: c for op, (_, c) in timed.items()}
        for op in ops:
            mem = "-" if args.no_memory else f"{_peak_extra_mb(workload, op, args.threads):9.0f}"
            print(f"{workload:24} {op:18} {numel:10d} {wall_ms[op]:9.1f} {cpu_ms[op]:9.1f} "
                  f"{mem:>9}", flush=True)
        for label, t in (("wall", wall_ms), ("cpu", cpu_ms)):
            ratios = [f"sampled/topk = {t['compress sampled'] / t['topk']:.2f}",
                      f"exact/topk = {t['compress exact'] / t['topk']:.2f}",
                      f"sampled/floor = {t['compress sampled'] / t['floor']:.2f}"]
            if "sampled + encode" in t:
                ratios.append(f"encode-total/floor = {t['sampled + encode'] / t['floor']:.2f}")
            print(f"{workload:24} ratios ({label}): " + ", ".join(ratios), flush=True)
        del grads, ops


if __name__ == "__main__":
    main()
