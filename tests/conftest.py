"""Fixtures shared by the test files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pytest

if TYPE_CHECKING:
    from simulations.deploy.cluster import Deployment


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Callable[..., Deployment]]:
    """A factory of started local deployments (``DeploymentConfig`` keyword arguments).

    Every deployment it started is stopped afterwards, also when the test failed, and no process
    naming its port or folder may outlive that.
    """
    # Imported here: only the deployment tests need it, the other test files stay independent.
    from simulations.deploy.cluster import Deployment, DeploymentConfig
    from simulations.deploy.errors import DeployError

    started: list[Deployment] = []

    def make(**kwargs: object) -> Deployment:
        dep = Deployment(DeploymentConfig(workdir=tmp_path / f"dep{len(started)}", **kwargs))
        started.append(dep)
        dep.start()
        return dep

    yield make
    problems = []
    for dep in started:  # every one is stopped, even when stopping an earlier one failed
        try:
            dep.stop()
        except DeployError as err:
            problems.append(str(err))
    assert problems == [], f"stopping a deployment failed: {problems}"
    for dep in started:
        assert dep.leftover_pids() == [], "processes of the deployment outlived stop()"


#: The run a shared phone export is made for: digits with fedgc's defaults (dgc, client
#: momentum, the second density, the sign channel), seed 2 (the parameters baked in are version
#: 0 of a run with that seed).
PHONE_RUN = {"task": "digits", "seed": 2}


@pytest.fixture(scope="session")
def digits_phone_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The phone files (``android_bridge.export.export_run``) of a digits run with fedgc's
    defaults; exported once per session (minutes on a busy machine), shared by the phone
    tests. Its batch size, lr and DGC config are any default run's; its seed is PHONE_RUN's."""
    from android_bridge.export import export_run
    from fedgc.settings import RunConfig

    out = tmp_path_factory.mktemp("digits-phone-export")
    export_run(RunConfig.from_flat({**PHONE_RUN, "results_dir": str(out / "unused"),
                                    "run_name": "export"}), out / "export")
    return out / "export"


@pytest.fixture(scope="session")
def bridge_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The phone files of the digits task that the bridge tests' phones run
    (``tests.test_bridge.EXPORT_CONFIG``, batch ``BATCH``): exported once per session (half a
    minute to a minute on a busy machine) and shared by ``test_bridge.py``,
    ``test_bridge_control.py``, ``test_bridge_federation.py`` and ``test_arm.py``. Read only:
    a test that changes an export copies it first."""
    from android_bridge.export import export_all
    from tests.test_bridge import BATCH, EXPORT_CONFIG

    out = tmp_path_factory.mktemp("bridge-export")
    export_all("digits", out, EXPORT_CONFIG, batch_size=BATCH, max_numel=2**15)
    return out


@pytest.fixture(scope="session")
def java_classpath(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Java codec of ``android_bridge/java`` with its test drivers and line tool, compiled
    by javac 17 once per session (tens of CPU seconds) for ``test_java_codec.py`` and
    ``test_android_java.py``; skips where no JDK is installed."""
    javac, java = shutil.which("javac"), shutil.which("java")
    if javac is None or java is None:
        pytest.skip("javac/java not on PATH: the Java codec cannot be compiled here")
    out = tmp_path_factory.mktemp("java-classes")
    root = Path(__file__).resolve().parents[1] / "android_bridge" / "java"
    sources = sorted(str(p) for p in root.glob("src/**/*.java"))
    assert sources, f"no Java sources under {root}"
    done = subprocess.run([javac, "--release", "17", "-encoding", "UTF-8", "-Xlint:all",
                           "-Werror", "-d", str(out), *sources],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"javac failed:\n{done.stdout}\n{done.stderr}"
    return out


@pytest.fixture(scope="session")
def encoder_pte() -> Callable[[str], bytes]:
    """``encoder_pte(name)``: the encoder.pte of ``tests.test_android_export.CONFIGS[name]``
    for ``MAX_NUMEL`` entries, exported on the host the first time a test asks for it (half a
    minute each on a busy machine) and shared by ``test_android_export.py`` and
    ``test_arm.py`` (one lane of ``make test``)."""
    from android_bridge.export import export_encoder
    from tests.test_android_export import CONFIGS, MAX_NUMEL

    exported: dict[str, bytes] = {}

    def pte(name: str) -> bytes:
        if name not in exported:
            exported[name] = export_encoder(CONFIGS[name], max_numel=MAX_NUMEL)
        return exported[name]

    return pte


# Ray kills a worker that has not registered within 60 s and starts another, which on a machine
# as loaded as make test's three lanes on 2 cores starts no faster (a worker imports torch and
# Flower first): the suite's Ray instances, in process and in the processes the tests start (who
# inherit this environment), wait 300 s for one. A user's runs keep Ray's default.
os.environ.setdefault("RAY_worker_register_timeout_seconds", "300")


#: The digits run on Flower's Ray engine that ``digits_on_ray`` makes: DGC past its warm-up
#: (density 0.01 from round 3), 4 of 8 clients a round, 5 rounds (accuracy rises by 0.15).
DIGITS_ON_RAY = {"task": "digits", "num_clients": 8, "clients_per_round": 4, "rounds": 5,
                 "lr": 0.1, "density": 0.01, "dgc.warmup_rounds": 2,
                 "sim.cpus_per_client": 1, "sim.engine": "ray"}


class RayRun(NamedTuple):
    """A finished ``python -m simulations run`` of :data:`DIGITS_ON_RAY`."""

    proc: subprocess.CompletedProcess[str]
    folder: Path  # the run's folder (rounds.csv, summary.json, model.pt, ...)
    keys: dict[str, object]  # DIGITS_ON_RAY, for a run to compare with


@pytest.fixture(scope="session")
def digits_on_ray(tmp_path_factory: pytest.TempPathFactory) -> RayRun:
    """One run of :data:`DIGITS_ON_RAY` on Flower's Ray engine, in a process of its own as a
    user runs it (it starts and stops its own Ray), made once per session: each such run costs
    a Ray instance and its actors. ``test_simulation.py`` reads its files and progress
    display, ``test_engines.py`` compares the local engine's run of the same keys with it and
    its output with Flower's noise."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("digits-on-ray")
    cmd = [sys.executable, "-m", "simulations", "run", "--set", f"results_dir={out}",
           "--set", "run_name=ray"]
    for key, value in DIGITS_ON_RAY.items():
        cmd += ["--set", f"{key}={value}"]
    # Alone it takes 20 s; under make test's three lanes 105 s here and, in CI's stop-45 run,
    # more than the 300 s it had (round 2 after 4 min 40 s). The timeout guards against a hang:
    # it is not a timing assertion.
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    return RayRun(proc, out / "ray", dict(DIGITS_ON_RAY))
