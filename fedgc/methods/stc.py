"""``stc``: Sparse Ternary Compression both ways (Sattler et al., IEEE TNNLS 2019).

Clients send the top ``density`` fraction of every tensor (biases too) of their residual plus
pseudo-gradient as ``sign * mean magnitude`` (:class:`dgc.stc.STCCompressor`), one sign bit each
on the wire, and keep the rest; the server broadcasts ternary steps of ``downlink_density``
(``downlink_values = ternary``, ``server/downlink.py``). Its defaults are the paper's: 1/400
both ways. docs/methods.md sets them beside the reference code's.
"""

from __future__ import annotations

from dgc import Compressor
from dgc.stc import STC_DENSITY, STCCompressor, stc_config
from fedgc.keys import TrainSettings
from fedgc.methods.base import Method
from fedgc.methods.payloads import Codec, SparseCodec
from fedgc.methods.registry import register
from fedgc.methods.sparsifier import SparsifierSettings
from fedgc.methods.unaggregated import FOLD_BACK_DEFAULTS

__all__ = ["STC"]


class STC(Method[SparsifierSettings]):
    """Sparse ternary compression of both directions (module docstring)."""

    name = "stc"
    phone_needs = ("ternary values (sign times mean magnitude) of every tensor, biases too: the "
                   "exported encoder sends its value dtype (dgc.ternary is refused on phones)")
    order = 30
    family = "top-k"
    description = ("top-k at `density` of every tensor (biases too) as sign * mean "
                   "magnitude, one bit each")
    keeps_residual = True
    settings = SparsifierSettings
    defaults = {"density": STC_DENSITY, "downlink_density": STC_DENSITY,
                "downlink_values": "ternary", **FOLD_BACK_DEFAULTS}

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> Compressor:
        # One density for every tensor, as STC has; the scale's precision is dgc.value_dtype.
        return STCCompressor(stc_config(train.density, self.own.value_dtype))

    def codec(self, train: TrainSettings) -> Codec:
        return SparseCodec(sign_coding=True)  # ternary whatever dgc.ternary says


register(STC())
