"""Phone export, an opt-in part of a method: the DGC configuration a phone's exported encoder runs.

Phones run one encoder, exported with ExecuTorch (``android_bridge.export``): DGC's top-k with
or without its residual and momentum correction, configured by a :class:`dgc.DGCConfig`, and an
optional second density for small tensors. A method whose clients phones can stand in for
inherits :class:`PhoneExport` beside :class:`fedgc.methods.Method` and says which configuration;
``phone_refusals`` names the run keys it has that the exported encoder does not run, so that a
run with phones is refused before they train otherwise than the simulated clients beside them.
A method without it is refused by the bridge and ``export``, naming the methods phones run.
"""

from __future__ import annotations

from typing import ClassVar

from dgc import DGCConfig
from fedgc.keys import TrainSettings
from fedgc.methods.base import Method

__all__ = ["PhoneExport", "phone_export_of"]


class PhoneExport:
    """The opt-in part of a :class:`fedgc.methods.Method` that phones run: inherit it beside
    Method and override :meth:`phone_config`."""

    phone: ClassVar[bool] = True

    def phone_config(self, train: TrainSettings) -> DGCConfig:
        """The DGC configuration a phone's exported encoder runs for this method."""
        raise NotImplementedError

    def phone_small(self, train: TrainSettings) -> tuple[float, int] | None:
        """The density a phone sends its small sparsified tensors at and the size, in entries,
        up to which a tensor is small (as :class:`dgc.TwoDensityCompressor` does in this
        method's compressor); None: every tensor at the config's density."""
        return None

    def phone_refusals(self) -> list[str]:
        """Its own keys (``key=value``, from ``self.own``) set to what phones do not run as
        this method's simulated clients do: a run that sets one is refused before phones
        train. None here."""
        return []


def phone_export_of(method: Method) -> PhoneExport | None:
    """``method``'s phone export part, None when phones do not run it (a subclass may turn it
    off with ``phone = False``)."""
    return method if isinstance(method, PhoneExport) and method.phone else None
