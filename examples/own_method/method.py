"""Strom's threshold quantization (Interspeech 2015) as a fedgc Method: each client adds its
pseudo-gradient to a residual and sends every entry that reaches ``tau``, as ``+-tau``; the rest
waits in the residual. fedgc loads it with ``method = "own_method.method:make"`` (README.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dgc import SparseTensor, SparseUpdate
from fedgc.keys import TrainSettings
from fedgc.methods import Codec, Method, ResidualCompressor, SparseCodec
from fedgc.schema import Check, setting


@dataclass(frozen=True)
class StromSettings:  # its own key, under its prefix: --set strom.tau=0.002
    tau: float = setting(0.03, "strom.tau", "Strom's threshold: a client sends every entry "
                         "whose residual is at least this in magnitude, as +-tau",
                         Check(0.0, low_open=True))


class StromCompressor(ResidualCompressor):  # the residual's bookkeeping is the base's
    def __init__(self, tau: float) -> None:
        super().__init__()
        self.tau = float(tau)

    def compress(self, grads, epoch=0.0, sequence=None) -> SparseUpdate:
        self.check_gradients(grads)
        out = {}
        for name, g in grads.items():
            v = self.accumulate(name, g)
            idx = torch.nonzero(v.abs() >= self.tau).reshape(-1)
            sent = torch.where(v[idx] < 0, -self.tau, self.tau)
            self.mark_sent(name, idx, sent)
            out[name] = SparseTensor(idx, sent, tuple(g.shape))
        return SparseUpdate(out, 0 if sequence is None else sequence)


class Strom(Method[StromSettings]):
    name, label, settings = "strom", "Strom 2015", StromSettings
    description = "every residual entry at or past `strom.tau`, as +-tau, one bit each"
    keeps_residual = True  # the server's acknowledgements keep the residual whole

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> StromCompressor:
        return StromCompressor(self.own.tau)

    def codec(self, train: TrainSettings) -> Codec:
        return SparseCodec(sign_coding=True)  # +-tau: the sign bits and tau once per tensor

    def uplink_density(self, train: TrainSettings) -> float:
        return float("nan")  # as many entries as pass the threshold: no nominal density


def make() -> Method:  # what fedgc calls for method = "own_method.method:make"
    return Strom()
