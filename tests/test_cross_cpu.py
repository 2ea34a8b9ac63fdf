"""The second pass of ``make test`` (``make test-cross-cpu``) computes with other float kernels.

It reruns the ``cross_cpu`` tests under PyTorch's scalar kernels (``ATEN_CPU_CAPABILITY``),
oneDNN limited to SSE4.1 (``ONEDNN_MAX_CPU_ISA``) and MKL's compatible code path
(``MKL_CBWR``): each of the three moves float results on an AMD EPYC with AVX2 under torch 2.13
(docs/guide.md, "Testing"), so the developers' machine sees what another CPU would. Should a
torch stop honouring them, the second pass would silently repeat the first: these tests say so.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.run_compare import float_probe

LOWERED = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
           "MKL_CBWR": "COMPATIBLE"}
PROBE = "from tests.run_compare import float_probe; print(float_probe())"


def _probe(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in LOWERED}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, check=True,
                          capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    return done.stdout.strip()


@pytest.mark.skipif(os.environ.get("FEDGC_LOWERED_DISPATCH") == "1",
                    reason="the first pass's test (this is the lowered second pass)")
def test_the_lowered_dispatch_changes_this_machines_floats() -> None:
    assert _probe(LOWERED) != float_probe()


@pytest.mark.cross_cpu
@pytest.mark.skipif(os.environ.get("FEDGC_LOWERED_DISPATCH") != "1",
                    reason="runs in make test's second pass (make test-cross-cpu)")
def test_the_second_pass_runs_on_other_float_kernels() -> None:
    assert all(os.environ.get(k) == v for k, v in LOWERED.items())
    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    assert float_probe() != _probe({})
