"""Take the values of the run snapshots again on this machine, and its float probe.

    python tests/golden/runs/retake_values.py

Runs each snapshot's run (``tests/test_run_snapshots.py``: ``COMMON`` and ``RUNS``) with the
code of the checkout and writes its values into the snapshot's files in their own layout: the
columns, rows and keys of ``rounds.csv``, ``clients.csv`` and ``summary.json`` stay the
snapshot's (a column the run no longer writes keeps its value; ``summary.json``'s ``config`` and
``netem`` are not touched, the test maps them), only the values change. Then writes this
machine's :func:`tests.run_compare.float_probe` to ``float_probe.json``: the snapshots are
compared bit for bit where a machine computes that probe alike, within the measured tolerances
elsewhere.

Take them again only when the code's results are known to be the snapshots' on the machine
they were taken on (the test passes there), and say so in the commit: the values are then those
results on this machine's float kernels.
"""

from __future__ import annotations

import csv
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from simulations.cli import main as cli  # noqa: E402
from tests.run_compare import PROBE_FILE, float_probe  # noqa: E402
from tests.test_run_snapshots import COMMON, GOLDEN, RUNS  # noqa: E402

#: Keys of summary.json that say how the run was configured, not what it computed.
KEPT = {"config", "netem"}


def _retake_csv(new: Path, golden: Path) -> None:
    with new.open() as fh:
        rows = list(csv.DictReader(fh))
    with golden.open() as fh:
        reader = csv.DictReader(fh)
        columns, old = list(reader.fieldnames or []), list(reader)
    if len(rows) != len(old):
        raise SystemExit(f"{golden}: the run has {len(rows)} rows, the snapshot {len(old)}")
    with golden.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, columns, lineterminator="\n")
        writer.writeheader()
        for row, before in zip(rows, old, strict=True):
            writer.writerow({c: row.get(c, before[c]) for c in columns})


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for name, argv in RUNS.items():
            if cli(["run", *COMMON, *argv, "--set", f"results_dir={tmp}",
                    "--set", f"run_name={name}"]) != 0:
                raise SystemExit(f"the run of snapshot {name} failed")
            out, golden = Path(tmp) / name, GOLDEN / name
            for file in ("rounds.csv", "clients.csv"):
                _retake_csv(out / file, golden / file)
            got = json.loads((out / "summary.json").read_text())
            want = json.loads((golden / "summary.json").read_text())
            want.update({k: got[k] for k in want if k in got and k not in KEPT})
            (golden / "summary.json").write_text(json.dumps(want, indent=2, sort_keys=True) + "\n")
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())
    PROBE_FILE.write_text(json.dumps({
        "digest": float_probe(),
        "taken_on": f"{cpu}, {platform.machine()}, torch {torch.__version__}, PyTorch's CPU "
                    f"capability {torch.backends.cpu.get_cpu_capability()}"}, indent=1) + "\n")


if __name__ == "__main__":
    main()
