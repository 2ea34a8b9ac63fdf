"""Exceptions raised by the deployment kit."""

import signal


class DeployError(RuntimeError):
    """A deployment step failed (a process, a run, a bad option)."""


class ProcessStartError(DeployError):
    """A managed process exited or did not become ready in time."""


class LinkError(DeployError):
    """A link could not be shaped as asked (bad preset, missing kernel support)."""


class DeployInterrupted(BaseException):  # noqa: N818 - a signal, not an error
    """SIGTERM or SIGINT arrived: unwind, tearing down everything the deployment started.

    A ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception`` on the way
    swallows it; :meth:`simulations.deploy.cluster.Deployment.__exit__` stops the processes and
    deletes the namespaces as it passes.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")
