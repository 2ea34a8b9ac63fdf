"""``topk``: DGC's top-k without error feedback or momentum, the contrast case.

The same bytes as ``dgc`` (the same densities, the same split for small tensors, the same
wire), but nothing is remembered between rounds: what a client does not send is lost. Phones
run it (their encoder is DGC's, with the residual cleared).
"""

from __future__ import annotations

from dgc import Compressor, DGCConfig
from fedgc.keys import TrainSettings
from fedgc.methods.base import Method
from fedgc.methods.payloads import Codec, SparseCodec
from fedgc.methods.phone import PhoneExport
from fedgc.methods.registry import register
from fedgc.methods.sparsifier import SparsifierSettings, layer_config, small_split, split_compressor

__all__ = ["PHONE_DENSE", "TopK"]

#: The keys under which topk's phones send their update as dense FedAvg does: every tensor
#: whole in float32 (values only, no indices), the exact model down (``python -m simulations
#: wire bridge --method dense``).
PHONE_DENSE: dict[str, object] = {
    "method": "topk", "density": 1.0, "dgc.value_dtype": "float32",
    "dgc.min_sparse_numel": 2**31 - 1, "dgc.small_density": 0.0, "downlink_density": 1.0}


class TopK(PhoneExport, Method[SparsifierSettings]):
    """Top-k of each pseudo-gradient, no residual (module docstring)."""

    name = "topk"
    order = 20
    family = "top-k"
    description = "top-k at `density`, fp16; no error feedback"
    settings = SparsifierSettings

    def config(self, train: TrainSettings) -> DGCConfig:
        """DGC's layer configuration with momentum, masking and the residual off."""
        return layer_config(train, self.own, momentum=0.0, momentum_correction=False,
                            momentum_masking=False, error_feedback=False)

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> Compressor:
        return split_compressor(self.own, self.config(train))

    def codec(self, train: TrainSettings) -> Codec:
        return SparseCodec(sign_coding=self.own.ternary)

    def phone_config(self, train: TrainSettings) -> DGCConfig:
        return self.config(train)

    def phone_small(self, train: TrainSettings) -> tuple[float, int] | None:
        return small_split(self.own)


register(TopK())
