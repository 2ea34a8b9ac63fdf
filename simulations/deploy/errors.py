"""Exceptions raised by the deployment kit."""


class DeployError(RuntimeError):
    """A deployment step failed (a process, a run, a bad option)."""


class ProcessStartError(DeployError):
    """A managed process exited or did not become ready in time."""


class LinkError(DeployError):
    """A link could not be shaped as asked (bad preset, missing kernel support)."""
