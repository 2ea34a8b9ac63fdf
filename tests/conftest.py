"""Fixtures shared by the test files."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

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
