"""A compression method of this project's own: Strom's threshold quantization, as a fedgc Method.

Nikko Strom, "Scalable Distributed DNN Training Using Commodity GPU Cloud Computing",
Interspeech 2015: each worker adds its gradient to a residual and sends every entry whose
residual passes a threshold ``tau``, as ``+tau`` or ``-tau``, subtracting what it sent; the rest
waits in the residual. Here the worker is a federated client and the gradient its
pseudo-gradient ``global - local``.

fedgc runs it with ``method = "own_method.method:make"``: it imports this module (on the server
and on every client) and calls :func:`make`, which returns the :class:`fedgc.methods.Method`.
The method brings a compressor with a residual (:class:`StromCompressor`), its own key
(``strom.tau``, :class:`StromSettings`) and reuses fedgc's sparse payload with sign coding, so
every value costs one bit on the wire; the server's checks, defences, aggregation, downlink and
checkpoints are fedgc's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dgc import SparseTensor, SparseUpdate, StateError
from fedgc.methods import Codec, Method, SparseCodec
from fedgc.schema import Check, setting


@dataclass(frozen=True)
class StromSettings:
    """The method's own keys, under its prefix: ``--set strom.tau=0.002``."""

    tau: float = setting(0.03, "strom.tau", "Strom's threshold: a client sends every entry "
                         "whose residual is at least this in magnitude, as +-tau",
                         Check(0.0, low_open=True))


class StromCompressor:
    """Threshold quantization with a residual (implements :class:`dgc.base.Compressor`).

    Parameters
    ----------
    tau : float
        The threshold; a sent entry carries exactly ``+tau`` or ``-tau``.
    """

    def __init__(self, tau: float) -> None:
        self.tau = float(tau)
        self.v: dict[str, torch.Tensor] = {}  # the residual, flat, per tensor

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> SparseUpdate:
        """Add ``grads`` to the residual; send the entries at or past ``tau`` as +-tau."""
        for name, g in grads.items():
            if not torch.isfinite(g).all():
                raise StateError(f"gradient {name!r} holds NaN or Inf")
        out = {}
        for name, g in grads.items():
            v = self.v.setdefault(name, torch.zeros(g.numel()))
            v += g.detach().reshape(-1).to(torch.float32)
            idx = torch.nonzero(v.abs() >= self.tau).reshape(-1)
            sent = torch.where(v[idx] < 0, -self.tau, self.tau)
            v[idx] -= sent
            out[name] = SparseTensor(idx, sent, tuple(g.shape))
        return SparseUpdate(out, 0 if sequence is None else sequence)

    def restore(self, update: SparseUpdate) -> None:
        """Add an update the server did not aggregate back into the residual."""
        for name, t in update.tensors.items():
            if name not in self.v or t.numel != self.v[name].numel():
                raise StateError(f"update tensor {name!r} does not fit this compressor")
        for name, t in update.tensors.items():
            self.v[name].index_add_(0, t.indices, t.values.to(torch.float32))

    def residual(self) -> dict[str, torch.Tensor]:
        return self.v

    def scale_state(self, factor: float) -> None:
        for v in self.v.values():
            v.mul_(factor)

    def state_dict(self) -> dict[str, Any]:
        return {"v": {k: t.clone() for k, t in self.v.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        v = state.get("v")
        if not isinstance(v, Mapping) or not all(
                isinstance(t, torch.Tensor) and t.dim() == 1 for t in v.values()):
            raise StateError("Strom state must map tensor names to flat tensors")
        self.v = {k: t.detach().to(torch.float32).clone() for k, t in v.items()}


class Strom(Method):
    """Strom's threshold quantization with error feedback (module docstring)."""

    name = "strom"
    label = "Strom 2015"
    description = "every residual entry at or past `strom.tau`, as +-tau, one bit each"
    keeps_residual = True
    prefix = "strom"
    settings = StromSettings

    def compressor(self, train: Any, client_key: int, material: Any = None) -> StromCompressor:
        return StromCompressor(self.own.tau)

    def codec(self, train: Any) -> Codec:
        return SparseCodec(sign_coding=True)  # +-tau: the sign bits and tau once per tensor

    def uplink_density(self, train: Any) -> float:
        return float("nan")  # as many entries as pass the threshold: no nominal density


def make() -> Method:
    """The method fedgc loads for ``method = "own_method.method:make"``."""
    return Strom()
