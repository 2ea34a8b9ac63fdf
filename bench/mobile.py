"""Latency of the exported DGC encoder (.pte, ExecuTorch runtime) against eager dgc, one run.

Prints, at 1e5 and 1e6 floats (density 0.001, exact top-k), without and with clipping, the
median over a few repetitions of one compression step: eager ``dgc.DGCCompressor`` and the
``.pte`` driven by ``android_bridge.runtime.PteEncoder`` (which runs ``encode_blocked``), and
their ratio (target: .pte <= 1.5x eager). The two are timed alternately, call for call, so that
load from other processes falls on both; the ratio is the median of the per-pair ratios. Only
ratios measured in one run compare: the absolute times depend on the machine and its load.
Usage: ``python bench/mobile.py [--repeats N]`` from the repository root, with this checkout
first on ``PYTHONPATH`` when another one is installed in the environment.

``--host qsgd,tcs`` (any of randk, efsign, signvote, qsgd, tcs) then times the phones' host
encoders (``android_bridge.host_encoders``, numpy) against the method's simulated client
(its ``compressor``), alternately as above, at the same sizes, with each step's payload bytes
(the method's wire format, no transport framing), the host step's time over the plain
``.pte`` dgc step's measured in the same run (the issue's bound on a phone's step: 1.5x
today's dgc step), and over eager dgc's step timed alternately with it (``/dgc paired``: the
median of the per-pair ratios, the steadier figure on a loaded machine). TCS runs with a
round's mask of ``density`` entries (its steady state).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from android_bridge.export import export_encoder
from android_bridge.runtime import PteEncoder
from dgc import DGCCompressor, DGCConfig

TARGET_RATIO = 1.5
#: Tensor sizes timed (floats).
SIZES = (100_000, 1_000_000)
#: Today's dgc step, the reference: exact top-k at density 0.001, no warm-up.
PLAIN = DGCConfig(selection="exact", warmup="none", density=0.001)


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
    parser.add_argument("--host", default="", help="comma-separated methods whose phone host "
                        "encoders to time too (randk, efsign, signvote, qsgd, tcs)")
    args = parser.parse_args()
    # One thread on both sides: ExecuTorch's pool (XNNPACK) otherwise takes every core, and
    # waking its threads between calls costs milliseconds on a loaded machine.
    torch.set_num_threads(1)
    from executorch.extension.pybindings.portable_lib import _unsafe_reset_threadpool

    _unsafe_reset_threadpool(1)
    # With clipping the .pte also runs sum_squares (float64 accumulation, see
    # android_bridge.encoder.SumSquares), which XNNPACK cannot take whole.
    clipped = DGCConfig(selection="exact", warmup="none", density=0.001, clip_norm=1.0)
    print(f"{'config':>8} {'floats':>9} {'eager_ms':>9} {'pte_ms':>9} {'pte/eager':>10}  "
          f"target <= {TARGET_RATIO}")
    dgc_step: dict[int, float] = {}
    for label, config in (("plain", PLAIN), ("clipped", clipped)):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "encoder.pte"
            path.write_bytes(export_encoder(config, max_numel=2**21))
            measured = _bench(label, config, path, args.repeats)
        if label == "plain":
            dgc_step = measured
    hosts = [m for m in args.host.split(",") if m]
    if hosts:
        print(f"\n{'method':>8} {'floats':>9} {'sim_ms':>9} {'phone_ms':>9} {'phone/sim':>10} "
              f"{'/dgc.pte':>9} {'/dgc paired':>12} {'payload_B':>10} {'/dense':>8}")
        for method in hosts:
            _bench_host(method, dgc_step, args.repeats)


def _bench(label: str, config: DGCConfig, path: Path, repeats: int) -> dict[int, float]:
    """Print the eager and .pte steps of ``config`` at each size; the .pte's ms by size."""
    out = {}
    for numel in SIZES:
        shape = (numel // 1000, 1000)
        grad = {"w": torch.randn(shape, generator=torch.Generator().manual_seed(0))}
        eager = DGCCompressor(config)
        pte = PteEncoder(path, config, {"w": shape})
        eager_ms, pte_ms, ratio = _paired_ms(lambda c=eager, g=grad: c.compress(g),
                                             lambda c=pte, g=grad: c.compress(g), repeats)
        verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
        print(f"{label:>8} {numel:>9} {eager_ms:>9.2f} {pte_ms:>9.2f} {ratio:>9.2f}x  {verdict}")
        out[numel] = pte_ms
    return out


def _bench_host(method: str, dgc_step: Mapping[int, float], repeats: int) -> None:
    """Print the simulated client's and the phone's host step of ``method`` at each size."""
    from fedgc.settings import RunConfig

    run = RunConfig.from_flat({"method": method, "seed": 0})
    for numel in SIZES:
        sim_ms, phone_ms, ratio, dgc_ratio, payload = _host_step(run, numel, repeats)
        print(f"{method:>8} {numel:>9} {sim_ms:>9.2f} {phone_ms:>9.2f} {ratio:>9.2f}x "
              f"{phone_ms / dgc_step[numel]:>8.2f}x {dgc_ratio:>11.2f}x {payload:>10,} "
              f"{payload / (4 * numel):>8.4f}")


def _host_step(run: Any, numel: int, repeats: int) -> tuple[float, float, float, float, int]:
    """(simulated ms, phone ms, their median ratio, the phone's median ratio to eager dgc's
    step timed alternately, payload bytes) of one step of ``run``'s method on a tensor of
    ``numel`` floats (TCS with a mask of ``density`` of it)."""
    from android_bridge.host_encoders import host_encoder

    t, m = run.train, run.method
    policy, codec = m.phone_config(t), m.codec(t)
    grad = torch.randn((numel // 1000, 1000), generator=torch.Generator().manual_seed(0))
    flat = grad.numpy()
    masks = None
    if m.name == "tcs":
        picked = np.random.default_rng(0).choice(numel, round(t.density * numel), replace=False)
        masks = {"w": np.sort(picked).astype(np.int64)}
    simulated = m.compressor(t, 0, masks)
    phone = host_encoder(m.phone_task(t, 0))
    sim_ms, phone_ms, ratio = _paired_ms(
        lambda: simulated.compress({"w": grad}, 0.0, 1),
        lambda: phone.compress({"w": flat}, policy, 0.0, 1, masks), repeats)
    dgc = DGCCompressor(PLAIN)
    _, _, dgc_ratio = _paired_ms(lambda: dgc.compress({"w": grad}),
                                 lambda: phone.compress({"w": flat}, policy, 0.0, 1, masks),
                                 repeats)
    payload = len(codec.encode(phone.compress({"w": flat}, policy, 0.0, 1, masks)))
    return sim_ms, phone_ms, ratio, dgc_ratio, payload


if __name__ == "__main__":
    main()
