"""Each client's own predictor, and the server's memory of all of them (``dgc.feedback = own``).

EF21 (Richtarik, Sokolov, Fatkhullin, NeurIPS 2021) replaces error feedback's residual by a
shift ``h_i`` that client and server both hold: the client compresses ``g_i - h_i`` and both add
what it sent, ``c_i``, to ``h_i``. ``h_i`` is a predictor both ends know without a byte of it
travelling (CAFe's idea, Ortega et al. 2025, with the client's own last update instead of the
global one, which docs/dgc_vs_dense.md found orthogonal to a client's next update while its own
previous one has cosine 0.78). With partial participation EF21 keeps the mean of every client's
shift on the server and steps on it, the sampled clients' corrections added (EF21-PP; the same
update as FedVARP, Jhunjhunwala et al., UAI 2022, with ``h_i`` as the server's memory of client
``i``)::

    client i in the round:  c_i = C(g_i - h_i);   h_i = h_i + c_i          (no residual)
    server:                 step on  mean_S(c_i) + H;   H = H + (|S| / N) mean_S(c_i)

``H`` is the mean of the ``N`` clients' shifts (clients never sampled hold zero), kept by
:class:`ShiftMemory` and the checkpoint; ``|S| / N`` is ``clients_per_round / num_clients``.
Every client's last update keeps counting in every round's step, which is what cuts the
variance that sampling 10 of 100 non-IID clients adds (FedVARP). A client whose update the
server did not aggregate takes it back out of ``h_i`` (:func:`unshift`), so both ends keep
holding the same shift.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dgc import SparseUpdate
from dgc.errors import StateError
from fedgc.methods.base import Aggregator

__all__ = ["ShiftMemory", "shift_by", "unshift"]


def shift_by(shift: dict[str, torch.Tensor], sent: SparseUpdate, sign: float = 1.0) -> None:
    """Add ``sign`` times what ``sent`` carries to ``shift`` (flat float32 per tensor, created
    as zeros), in place."""
    for name, t in sent.tensors.items():
        held = shift.get(name)
        if held is None:
            held = shift[name] = torch.zeros(t.numel, dtype=torch.float32)
        if held.numel() != t.numel:
            raise StateError(f"tensor {name!r} has {t.numel} entries, the shift holds "
                             f"{held.numel()}")
        held.index_add_(0, t.indices.to(torch.int64).cpu(),
                        sign * t.values.detach().to("cpu", torch.float32))


def unshift(shift: dict[str, torch.Tensor], sent: SparseUpdate) -> None:
    """Take an update the server did not aggregate back out of ``shift``."""
    shift_by(shift, sent, -1.0)


class ShiftMemory(Aggregator):
    """The server's mean of every client's shift, ``H``, added to each round's combined
    corrections (module docstring).

    Parameters
    ----------
    sampled_share : float
        ``|S| / N``: the share of the clients a round aggregates, in (0, 1].
    """

    def __init__(self, sampled_share: float) -> None:
        if not 0.0 < sampled_share <= 1.0:
            raise ValueError(f"the share of clients a round aggregates must be in (0, 1], got "
                             f"{sampled_share!r}")
        self.sampled_share = float(sampled_share)
        self.mean_shift: dict[str, torch.Tensor] = {}

    def finish(self, combined: Mapping[str, torch.Tensor],
               shapes: Mapping[str, tuple[int, ...]]) -> Mapping[str, torch.Tensor]:
        out = {}
        if not all(bool(torch.isfinite(t).all()) for t in combined.values()):
            return dict(combined)  # the step refuses it; the memory stays as it was
        for name, t in combined.items():
            held = self.mean_shift.get(name)
            if held is None:
                held = self.mean_shift[name] = torch.zeros_like(t)
            out[name] = t + held
            held.add_(t, alpha=self.sampled_share)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"mean_shift": dict(self.mean_shift)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.mean_shift = {k: v.clone() for k, v in (state.get("mean_shift") or {}).items()}
