"""The in-process engine (``sim.engine=local``) trains the same model as Flower's Ray engine.

Sweeps and the scenario studies may then run in-process: same clients, same sampling, same
replies, only the transport differs. The strategy sums the chosen replies in client-key order
(server/strategy.py), whatever order Ray delivers them in, so the models are bit-identical.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from fedgc.flower_log import NOISE
from simulations.cli import main


def _rows(run: Path) -> list[dict[str, str]]:
    with (run / "rounds.csv").open() as fh:
        return list(csv.DictReader(fh))


@pytest.mark.slow
def test_local_engine_gives_the_ray_engines_model(tmp_path: Path, digits_on_ray) -> None:
    # Ray in its own process, as a user runs it (it starts and stops its own instance): the
    # session's run of conftest.DIGITS_ON_RAY, which test_simulation.py reads too. DGC with
    # top-k from round 3 of 5, 4 of 8 clients a round (a client sampled again carries its
    # residual from its earlier round).
    proc = digits_on_ray.proc
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Flower's log stays quiet without --verbose (fedgc.flower_log), its Ray actors' too.
    output = proc.stdout + proc.stderr
    assert "\x1b[" not in output, output[-3000:]
    for noise in ("DEPRECATED", "run_simulation", *NOISE):
        assert noise not in output, (noise, output[-3000:])
    argv = ["run", "--set", f"results_dir={tmp_path}", "--set", "run_name=local",
            "--set", "progress=false"]
    for key, value in {**digits_on_ray.keys, "sim.engine": "local"}.items():
        argv += ["--set", f"{key}={value}"]
    assert main(argv) == 0
    ray_model = torch.load(digits_on_ray.folder / "model.pt")
    local_model = torch.load(tmp_path / "local" / "model.pt")
    assert ray_model.keys() == local_model.keys()
    for name, tensor in ray_model.items():
        assert torch.equal(local_model[name], tensor), name
    ray_rows, local_rows = _rows(digits_on_ray.folder), _rows(tmp_path / "local")
    assert len(ray_rows) == len(local_rows) == 5
    for r, rl in zip(ray_rows, local_rows, strict=True):
        for key in ("accuracy", "loss", "uplink_bytes", "downlink_bytes", "nnz",
                    "clients_aggregated"):
            assert rl[key] == r[key], (key, rl[key], r[key])
    # The models moved: a comparison of two untrained models would prove nothing.
    assert float(local_rows[-1]["loss"]) < float(local_rows[0]["loss"])  # it learned
