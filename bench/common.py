"""Timing and peak-memory helpers shared by the benchmark scripts in bench/."""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any


def median_ms(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in milliseconds, after ``warmup`` untimed calls."""
    return median_wall_cpu_ms(fn, repeats, warmup)[0]


def median_wall_cpu_ms(fn: Callable[[], Any], repeats: int = 5,
                       warmup: int = 1) -> tuple[float, float]:
    """Median wall time and median process CPU time (all threads) of ``fn()``, in ms.

    On a machine shared with other work the CPU time is the steadier figure: time spent
    descheduled counts in the wall time only.
    """
    for _ in range(warmup):
        fn()
    wall_ms, cpu_ms = [], []
    for _ in range(repeats):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall_ms.append((time.perf_counter() - start_wall) * 1e3)
        cpu_ms.append((time.process_time() - start_cpu) * 1e3)
    return statistics.median(wall_ms), statistics.median(cpu_ms)


def interleaved_wall_cpu_ms(ops: Mapping[str, Callable[[], Any]], repeats: int = 5,
                            warmup: int = 1) -> dict[str, tuple[float, float]]:
    """Median wall and CPU time (ms) of each operation, the operations run in turns.

    Running them round-robin, rather than one after the other, exposes every operation to the
    same background load, so their ratios stay meaningful on a shared machine.
    """
    for _ in range(warmup):
        for fn in ops.values():
            fn()
    wall_ms: dict[str, list[float]] = {name: [] for name in ops}
    cpu_ms: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeats):
        for name, fn in ops.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall_ms[name].append((time.perf_counter() - start_wall) * 1e3)
            cpu_ms[name].append((time.process_time() - start_cpu) * 1e3)
    return {name: (statistics.median(wall_ms[name]), statistics.median(cpu_ms[name]))
            for name in ops}


def max_rss_mb() -> float:
    """High-water mark of this process's resident set, in MiB (torch's allocations included).

    Read from ``VmHWM`` in /proc/self/status where Linux has it, because ``ru_maxrss`` carries
    the parent's peak across fork and exec and so hides the figure of a child started by a big
    parent; elsewhere ``ru_maxrss`` (KiB on Linux, bytes on macOS). Either never goes down, so
    a figure for one operation is the difference before and after it, in a fresh process that
    did nothing bigger first. tracemalloc would not see torch's buffers at all.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0 if sys.platform == "darwin" else 1024.0)


def machine_line(threads: int) -> str:
    """One line naming what the figures were measured on."""
    import torch

    return (f"torch {torch.__version__}, {threads} thread(s) (torch.set_num_threads), "
            f"{os.cpu_count()} CPU(s) visible, pid {os.getpid()}")
