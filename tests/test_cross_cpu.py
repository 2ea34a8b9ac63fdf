"""The second pass of ``make test`` (``make test-cross-cpu``) computes with other float kernels.

It reruns the ``cross_cpu`` tests under PyTorch's scalar kernels (``ATEN_CPU_CAPABILITY``),
oneDNN limited to SSE4.1 (``ONEDNN_MAX_CPU_ISA``) and MKL's compatible code path
(``MKL_CBWR``): each of the three moves float results on an AMD EPYC with AVX2 under torch 2.13
(docs/guide.md, "Testing"), so the developers' machine sees what another CPU would. Should a
torch stop honouring them, the second pass would silently repeat the first: these tests say so.
Where PyTorch already runs its scalar kernels (a CPU without AVX2, an arm64 one without SVE)
there is nothing lower to run: they skip, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.run_compare import float_probe

LOWERED = {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
           "MKL_CBWR": "COMPATIBLE"}
PROBE = ("import json, torch; from tests.run_compare import float_probe; "
         "print(json.dumps([torch.backends.cpu.get_cpu_capability(), float_probe()]))")
SECOND_PASS = os.environ.get("FEDGC_LOWERED_DISPATCH") == "1"


def _probe(env: dict[str, str]) -> tuple[str, str]:
    """(PyTorch's CPU capability, :func:`float_probe`) in a process with ``env`` over this one's
    environment without the lowering variables."""
    clean = {k: v for k, v in os.environ.items() if k not in LOWERED}
    done = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, check=True,
                          capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    capability, digest = json.loads(done.stdout)
    return capability, digest


def _native() -> tuple[str, str]:
    capability, digest = _probe({})
    if capability == "DEFAULT":
        pytest.skip("PyTorch runs its scalar kernels on this CPU already: no lower dispatch")
    return capability, digest


@pytest.mark.skipif(SECOND_PASS, reason="the first pass's test (this is the second pass)")
def test_the_lowered_dispatch_changes_this_machines_floats() -> None:
    _native()
    assert _probe(LOWERED)[1] != float_probe()


@pytest.mark.cross_cpu
@pytest.mark.skipif(not SECOND_PASS, reason="runs in make test's second pass (test-cross-cpu)")
def test_the_second_pass_runs_on_other_float_kernels() -> None:
    assert all(os.environ.get(k) == v for k, v in LOWERED.items())
    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
    assert float_probe() != _native()[1]


ARM64_TEST_PACKAGES = (Path(__file__).resolve().parents[1] / "android_bridge" / "arm"
                       / "requirements-arm64-tests.txt")


def test_the_arm64_runs_packages_are_this_environments() -> None:
    """``make test-cross-cpu-arm64`` (``tests/arm64_cross_cpu.sh``) runs the cross_cpu tests on
    aarch64 wheels pinned in ``requirements-arm64-tests.txt``: each pin must be the version
    installed here, so that a dependency moved in pyproject.toml moves the arm64 run too."""
    import importlib.metadata

    stale = {}
    for line in ARM64_TEST_PACKAGES.read_text(encoding="utf-8").splitlines():
        pin = line.split("#", 1)[0].strip()
        if pin:
            name, version = pin.split("==")
            here = importlib.metadata.version(name)
            if here.split("+", 1)[0] != version:
                stale[name] = (version, here)
    assert stale == {}, f"{ARM64_TEST_PACKAGES.name}: (pinned, installed here) {stale}"
