"""Benchmark of the wire format: bits per index against the entropy bound, and codec speed.

For random uniform indices at densities 0.1, 0.01, 0.001 and tensor sizes 1e5, 1e6, 25.6e6, prints
a markdown table of

- bits per index of each index coding (golomb, bitmap, raw) and of ``auto``, and the entropy bound
  ``log2 C(n, k) / k`` (via ``math.lgamma``) with each coding's ratio to it;
- bits per nonzero of the whole ``auto`` message: index bits + 16-bit values + header share;
- encode and decode times of ``auto`` (best of ``--repeats``), and their ratio to a baseline
  measured in the same run: copying the same indices as uint32 and the values as raw bytes.

Then, for the value codings of the int8 broadcast's patches (``grid_coding``; docs/wire.md,
section 5), a second table: ``k`` weight-like values (normal, on a power-of-two grid whose
largest value is q = 127, the others spread with standard deviation ``spread`` grid steps) at
density 0.3, with bits per value as float16, as a byte each and Rice-coded, and the grid
message's encode and decode times against the float16 message's (measured in the same run).

Run from the repository root::

    PYTHONPATH=. python bench/wire.py [--sizes 100000 1000000 25600000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from dgc import SparseTensor, SparseUpdate, decode, encode
from dgc.wire import MAX_NUMEL, index_bits, tensor_codings


def entropy_bits_per_index(numel: int, count: int) -> float:
    """``log2 C(numel, count) / count``: the fewest bits per index any coding can average."""
    log_binomial = (math.lgamma(numel + 1) - math.lgamma(count + 1)
                    - math.lgamma(numel - count + 1))
    return log_binomial / math.log(2) / count


def best_time_s(fn, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(numel: int, density: float, repeats: int, seed: int) -> dict[str, float | str]:
    count = round(density * numel)
    rng = np.random.default_rng(seed)
    indices = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
    values = torch.from_numpy(rng.standard_normal(count).astype(np.float32)).to(torch.float16)
    update = SparseUpdate({"w": SparseTensor(torch.from_numpy(indices), values, (numel,))})
    bound = entropy_bits_per_index(numel, count)
    row: dict[str, float | str] = {"n": numel, "density": density, "k": count, "bound": bound}
    for coding in ("golomb", "bitmap", "raw"):
        row[coding] = index_bits(indices, numel, coding) / count
    row["auto"] = index_bits(indices, numel, "auto") / count
    data = encode(update)
    row["chosen"] = tensor_codings(data)["w"]
    row["per_nonzero"] = 8 * len(data) / count  # index + 16-bit value + header and checksum
    row["encode_ms"] = 1e3 * best_time_s(lambda: encode(update), repeats)
    row["decode_ms"] = 1e3 * best_time_s(lambda: decode(data, max_numel=MAX_NUMEL), repeats)
    values_bits = values.view(torch.int16).numpy()
    row["copy_ms"] = 1e3 * best_time_s(
        lambda: indices.astype("<u4").tobytes() + values_bits.tobytes(), repeats)
    return row


def measure_values(count: int, spread: float, repeats: int, seed: int) -> dict[str, float]:
    numel = round(count / 0.3)
    rng = np.random.default_rng(seed)
    indices = torch.from_numpy(np.sort(rng.choice(numel, count, replace=False)).astype(np.int64))
    q = np.clip(np.rint(rng.standard_normal(count) * spread), -127, 127)
    q[0] = 127
    values = torch.from_numpy((q * 2.0 ** -8).astype(np.float32)) + 0.0
    grid = SparseUpdate({"w": SparseTensor(indices, values, (numel,))})
    half = SparseUpdate({"w": SparseTensor(indices, values.to(torch.float16), (numel,))})
    index_bytes = index_bits(indices, numel, "auto") / 8
    data, half_data = encode(grid, grid_coding=True), encode(half)
    byte_each = 4 + count  # the int8 section, what the encoder compares the Rice one with
    return {
        "k": count, "spread": spread,
        "float16": 8 * (len(half_data) - index_bytes) / count,
        "int8": 8 * (len(half_data) - index_bytes - 2 * count + byte_each) / count,
        "grid": 8 * (len(data) - index_bytes) / count,
        "encode_ms": 1e3 * best_time_s(lambda: encode(grid, grid_coding=True), repeats),
        "half_encode_ms": 1e3 * best_time_s(lambda: encode(half), repeats),
        "decode_ms": 1e3 * best_time_s(lambda: decode(data, max_numel=MAX_NUMEL), repeats),
        "half_decode_ms": 1e3 * best_time_s(lambda: decode(half_data, max_numel=MAX_NUMEL),
                                            repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 25_600_000])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.01, 0.001])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    print("| n | density | k | bound | golomb (x bound) | bitmap | raw | auto (chosen) "
          "| auto bits/nonzero | encode ms (x copy) | decode ms (x copy) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for numel in args.sizes:
        for density in args.densities:
            r = measure(numel, density, args.repeats, args.seed)
            print(f"| {numel:,} | {density:g} | {r['k']:,} | {r['bound']:.3f} "
                  f"| {r['golomb']:.3f} ({r['golomb'] / r['bound']:.4f}) "
                  f"| {r['bitmap']:.1f} | {r['raw']:.0f} "
                  f"| {r['auto']:.3f} ({r['chosen']}) | {r['per_nonzero']:.3f} "
                  f"| {r['encode_ms']:.2f} ({r['encode_ms'] / r['copy_ms']:.1f}) "
                  f"| {r['decode_ms']:.2f} ({r['decode_ms'] / r['copy_ms']:.1f}) |",
                  flush=True)

    print()
    print("| k | spread (steps) | float16 bits/value | int8 | grid-coded (chosen) "
          "| encode ms (x float16) | decode ms (x float16) |")
    print("|---|---|---|---|---|---|---|")
    for count in (40_000, 400_000):
        for spread in (5.0, 15.0, 50.0):
            r = measure_values(count, spread, args.repeats, args.seed)
            print(f"| {count:,} | {spread:g} | {r['float16']:.2f} | {r['int8']:.2f} "
                  f"| {r['grid']:.2f} "
                  f"| {r['encode_ms']:.2f} ({r['encode_ms'] / r['half_encode_ms']:.1f}) "
                  f"| {r['decode_ms']:.2f} ({r['decode_ms'] / r['half_decode_ms']:.1f}) |",
                  flush=True)


if __name__ == "__main__":
    main()
