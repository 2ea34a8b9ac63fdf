"""Which torch device a run's clients use: ``sim.device`` resolved on this machine."""

from __future__ import annotations

import torch

from fedgc.keys.sim import DEVICES
from fedgc.schema import SettingsError


class DeviceError(SettingsError):
    """``sim.device`` names a device this machine does not have."""


def resolve(name: str) -> torch.device:
    """The device ``sim.device = name`` means here: ``auto`` is cuda where torch sees one.

    Raises
    ------
    DeviceError
        ``cuda`` on a machine where ``torch.cuda.is_available()`` is False, or a name outside
        :data:`fedgc.keys.sim.DEVICES`.
    """
    if name not in DEVICES:
        raise DeviceError(f"sim.device must be one of {list(DEVICES)}, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise DeviceError("sim.device = 'cuda' but torch sees no CUDA device on this machine "
                          f"(torch {torch.__version__}, torch.cuda.is_available() is False); "
                          "use sim.device=cpu or auto")
    return torch.device(name)
