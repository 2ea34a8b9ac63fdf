"""The in-process engine (``sim.engine=local``) trains the same model as Flower's Ray engine.

Sweeps and the scenario studies may then run in-process: same clients, same sampling, same
replies, only the transport differs. The strategy sums the chosen replies in client-key order
(server/strategy.py), whatever order Ray delivers them in, so the models are bit-identical.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedgc.flower_log import NOISE
from simulations.cli import main

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--set", "task=digits", "--set", "num_clients=4", "--set", "clients_per_round=2",
       "--set", "rounds=3", "--set", "seed=2", "--set", "density=0.01",
       "--set", "dgc.warmup_rounds=1", "--set", "progress=false"]


def _rows(run: Path) -> list[dict[str, str]]:
    with (run / "rounds.csv").open() as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_local_engine_gives_the_ray_engines_model(tmp_path: Path) -> None:
    # Ray in its own process, as a user runs it (it starts and stops its own instance).
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "simulations", "run", *RUN, "--set", f"results_dir={tmp_path}",
           "--set", "run_name=ray", "--set", "sim.engine=ray"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Flower's log stays quiet without --verbose (fedgc.flower_log), its Ray actors' too.
    output = proc.stdout + proc.stderr
    assert "\x1b[" not in output, output[-3000:]
    for noise in ("DEPRECATED", "run_simulation", *NOISE):
        assert noise not in output, (noise, output[-3000:])
    assert main(["run", *RUN, "--set", f"results_dir={tmp_path}", "--set", "run_name=local",
                 "--set", "sim.engine=local"]) == 0
    ray_model = torch.load(tmp_path / "ray" / "model.pt")
    local_model = torch.load(tmp_path / "local" / "model.pt")
    assert ray_model.keys() == local_model.keys()
    for name, tensor in ray_model.items():
        assert torch.equal(local_model[name], tensor), name
    ray_rows, local_rows = _rows(tmp_path / "ray"), _rows(tmp_path / "local")
    assert len(ray_rows) == len(local_rows) == 3
    for r, rl in zip(ray_rows, local_rows, strict=True):
        for key in ("accuracy", "loss", "uplink_bytes", "downlink_bytes", "nnz",
                    "clients_aggregated"):
            assert rl[key] == r[key], (key, rl[key], r[key])
    # The models moved: a comparison of two untrained models would prove nothing.
    assert float(local_rows[-1]["loss"]) < float(local_rows[0]["loss"])  # it learned
