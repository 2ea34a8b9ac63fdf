"""``topk``: DGC's top-k without error feedback or momentum, the contrast case.

The same bytes as ``dgc`` (the same densities, the same split for small tensors, the same
wire), but nothing is remembered between rounds: what a client does not send is lost. Phones
run it (their encoder is DGC's, with the residual cleared).
"""

from __future__ import annotations

from typing import Any

from dgc import Compressor, DGCConfig
from fedgc.methods.base import Method
from fedgc.methods.dgc import layer_config, small_split, split_compressor
from fedgc.methods.payloads import Codec, SparseCodec
from fedgc.methods.registry import register

__all__ = ["TopK"]


class TopK(Method):
    """Top-k of each pseudo-gradient, no residual (module docstring)."""

    name = "topk"
    order = 20
    family = "top-k"
    description = "top-k at `density`, fp16; no error feedback"
    phone = True
    prefix = "dgc"

    @staticmethod
    def config(train: Any) -> DGCConfig:
        """DGC's layer configuration with momentum, masking and the residual off."""
        return layer_config(train, momentum=0.0, momentum_correction=False,
                            momentum_masking=False, error_feedback=False)

    def compressor(self, train: Any, client_key: int, material: Any = None) -> Compressor:
        return split_compressor(train, self.config(train))

    def codec(self, train: Any) -> Codec:
        return SparseCodec(sign_coding=bool(train is not None and train.ternary))

    def phone_config(self, train: Any) -> DGCConfig:
        return self.config(train)

    def phone_small(self, train: Any) -> tuple[float, int] | None:
        return small_split(train)


register(TopK())
