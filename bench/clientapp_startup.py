"""A Flower ClientApp process's start-up, measured: what a SuperNode pays per message.

A Flower SuperNode in subprocess isolation (Flower 1.42's default) starts a ``flwr-clientapp``
process for every message it is sent. Before fedgc's ClientApp trains, that process imports
Flower and the app (``client.app``: torch, numpy, fedgc), loads the task's data and builds the
client's partition and model; a phone's app, resident, pays none of this per message. This
benchmark starts ``--repeats`` fresh Python processes that do exactly that work (Flower's
``flwr-clientapp`` entry point and the app imported, ``client.app.client_data`` for one client,
the model built from the seed) and prints the median of their wall seconds and of their CPU
seconds (user + system, from ``resource.getrusage(RUSAGE_CHILDREN)``), with the machine's load
and CPU: the CPU seconds are what a free core of this machine takes (the figure of the
``supernode*`` profiles' ``clientapp_startup_s``, simulations/netem/protocols.json), the wall
seconds what it took under the load at the time.

    python bench/clientapp_startup.py --task mnist5k --repeats 7
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: One ClientApp process's start-up: Flower's entry point, the app, the data, the model.
CHILD = """
import sys
from flwr.supernode.cli import flwr_clientapp  # noqa: F401  (what flwr-clientapp imports)
from client.app import app, client_data, task_of, _model  # noqa: F401
from fedgc.settings import RunConfig
s = RunConfig.from_flat({"task": sys.argv[1], "run_name": "startup"}).train
data = client_data(s, 0, None)
_model(task_of(s.task_spec()), s.task_spec())
"""


def measure(task: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh process doing :data:`CHILD`'s work."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD, task], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement and print its medians with the machine it ran on."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="mnist5k")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    measure(args.task)  # the first run warms the page cache (the data files, the wheels)
    runs = [measure(args.task) for _ in range(args.repeats)]
    walls, cpus = [w for w, _ in runs], [c for _, c in runs]
    cpu_model = next((line.split(":", 1)[1].strip() for line in
                      Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor())
    print(f"ClientApp start-up ({args.task}), {args.repeats} fresh processes: "
          f"CPU median {statistics.median(cpus):.2f} s (min {min(cpus):.2f}, max "
          f"{max(cpus):.2f}); wall median {statistics.median(walls):.2f} s (min "
          f"{min(walls):.2f}, max {max(walls):.2f})")
    print(f"machine: {cpu_model}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, Python "
          f"{platform.python_version()}, {time.strftime('%Y-%m-%d')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
