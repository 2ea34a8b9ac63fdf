"""Latency of the exported DGC encoder (.pte, ExecuTorch runtime) against eager dgc, one run.

Prints, at 1e5 and 1e6 floats (density 0.001, exact top-k), the median over a few repetitions of
one compression step: eager ``dgc.DGCCompressor`` and the ``.pte`` driven by
``android_bridge.runtime.PteEncoder``, and their ratio (target: .pte <= 1.5x eager). Both are
measured in this run on this machine, so the ratio, not the absolute time, is the figure.
Usage: ``python bench/mobile.py [--repeats N]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from android_bridge.export import export_encoder
from android_bridge.runtime import PteEncoder
from dgc import DGCCompressor, DGCConfig


def _median_ms(fn, repeats: int) -> float:
    fn()  # first call pays allocation and method warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    plain = DGCConfig(selection="exact", warmup="none", density=0.001)
    # With clipping the .pte also runs sum_squares, a float64 reduction that XNNPACK cannot take
    # and ExecuTorch's portable kernel runs several times slower than eager torch.
    clipped = DGCConfig(selection="exact", warmup="none", density=0.001, clip_norm=1.0)
    print(f"{'config':>8} {'floats':>9} {'eager_ms':>9} {'pte_ms':>9} {'ratio':>6}")
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
        eager_ms = _median_ms(lambda c=eager, g=grad: c.compress(g), repeats)
        pte_ms = _median_ms(lambda c=pte, g=grad: c.compress(g), repeats)
        print(f"{label:>8} {numel:>9} {eager_ms:>9.2f} {pte_ms:>9.2f} "
              f"{pte_ms / eager_ms:>6.2f}")


if __name__ == "__main__":
    main()
