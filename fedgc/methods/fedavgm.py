"""``fedavgm``: dense FedAvg with DGC's server momentum (Hsu et al., 2019's FedAvgM).

It is ``dense`` with ``server_momentum`` 0.5, the momentum ``dgc`` runs use, applied by the same
server optimizer: DGC's gain over it is the compression's alone.
"""

from __future__ import annotations

from fedgc.methods.dense import Dense
from fedgc.methods.registry import register

__all__ = ["FedAvgM"]


class FedAvgM(Dense):
    """Dense updates, server momentum 0.5 (module docstring)."""

    name = "fedavgm"
    order = 10
    family = "dense"
    description = "every entry, fp32 (dense with DGC's server momentum)"
    defaults = {"server_momentum": 0.5}


register(FedAvgM())
