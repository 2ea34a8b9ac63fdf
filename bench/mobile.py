"""Latency of the exported DGC encoder (.pte, ExecuTorch runtime) against eager dgc, one run.

Prints, at 1e5 and 1e6 floats (density 0.001, exact top-k), without and with clipping, the
median over a few repetitions of one compression step: eager ``dgc.DGCCompressor`` and the
``.pte`` driven by ``android_bridge.runtime.PteEncoder`` (which runs ``encode_blocked``), and
their ratio (target: .pte <= 1.5x eager). The two are timed alternately, call for call, so that
load from other processes falls on both; the ratio is the median of the per-pair ratios. Only
ratios measured in one run compare: the absolute times depend on the machine and its load.
Usage: ``python bench/mobile.py [--repeats N]`` from the repository root, with this checkout
first on ``PYTHONPATH`` when another one is installed in the environment.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from android_bridge.export import export_encoder
from android_bridge.runtime import PteEncoder
from dgc import DGCCompressor, DGCConfig

TARGET_RATIO = 1.5


def _paired_ms(eager: Callable[[], object], pte: Callable[[], object],
               repeats: int) -> tuple[float, float, float]:
    """Median eager ms, median .pte ms and median per-pair ratio, timed alternately."""
    eager()  # first calls pay allocation and method warm-up
    pte()
    eager_ms, pte_ms = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        eager()
        t1 = time.perf_counter()
        pte()
        t2 = time.perf_counter()
        eager_ms.append((t1 - t0) * 1e3)
        pte_ms.append((t2 - t1) * 1e3)
    ratio = statistics.median(p / e for p, e in zip(pte_ms, eager_ms, strict=True))
    return statistics.median(eager_ms), statistics.median(pte_ms), ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    # One thread on both sides: ExecuTorch's pool (XNNPACK) otherwise takes every core, and
    # waking its threads between calls costs milliseconds on a loaded machine.
    torch.set_num_threads(1)
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    _unsafe_reset_threadpool(1)
    plain = DGCConfig(selection="exact", warmup="none", density=0.001)
    # With clipping the .pte also runs sum_squares (float64 accumulation, see
    # android_bridge.encoder.SumSquares), which XNNPACK cannot take whole.
    clipped = DGCConfig(selection="exact", warmup="none", density=0.001, clip_norm=1.0)
    print(f"{'config':>8} {'floats':>9} {'eager_ms':>9} {'pte_ms':>9} {'pte/eager':>10}  "
          f"target <= {TARGET_RATIO}")
    for label, config in (("plain", plain), ("clipped", clipped)):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "encoder.pte"
            path.write_bytes(export_encoder(config, max_numel=2**21))
            _bench(label, config, path, args.repeats)


def _bench(label: str, config: DGCConfig, path: Path, repeats: int) -> None:
    for numel in (100_000, 1_000_000):
        shape = (numel // 1000, 1000)
        grad = {"w": torch.randn(shape, generator=torch.Generator().manual_seed(0))}
        eager = DGCCompressor(config)
        pte = PteEncoder(path, config, {"w": shape})
        eager_ms, pte_ms, ratio = _paired_ms(lambda c=eager, g=grad: c.compress(g),
                                             lambda c=pte, g=grad: c.compress(g), repeats)
        verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
        print(f"{label:>8} {numel:>9} {eager_ms:>9.2f} {pte_ms:>9.2f} {ratio:>9.2f}x  {verdict}")


if __name__ == "__main__":
    main()
