"""``dense``: every entry of the pseudo-gradient in float32, FedAvg (McMahan et al., 2017).

The baseline of every compression ratio: its clients always get the exact global model
(``downlink_density`` does not apply) and keep nothing between rounds.
"""

from __future__ import annotations

from fedgc.keys import RunSettings, TrainSettings
from fedgc.methods.base import DownlinkPolicy, Method
from fedgc.methods.registry import register

__all__ = ["Dense"]


class Dense(Method):
    """Dense float32 updates and the exact model both ways (module docstring)."""

    name = "dense"
    phone_needs = ("every entry in float32 and the exact model each round, which no phone export "
                   "declares (the encoder's encode_dense is top-k's small-tensor path, in its "
                   "value dtype)")
    order = 0
    family = "dense"
    description = "every entry, fp32"
    baseline = True
    secure_sum = "all"

    def uplink_density(self, train: TrainSettings) -> float:
        return 1.0

    def downlink(self, run: RunSettings) -> DownlinkPolicy:
        return DownlinkPolicy(1.0, run.server.downlink_values)  # type: ignore[arg-type]


register(Dense())
