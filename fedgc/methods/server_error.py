"""FetchSGD's server without a sketch: momentum and error accumulation kept by the server.

FetchSGD (Rothchild et al., ICML 2020; :mod:`fedgc.methods.fetchsgd`) moves error feedback from
the clients to the server, so that a client sampled once in ten rounds holds no stale state: the
server keeps the momentum and the error of what it did not apply, and applies the largest
entries of that error each round. Its clients send count sketches, which sum linearly. DGC's
shared sets sum linearly too (every client of a round sends values at the same coordinates), so
``dgc.server_error`` tries the same server on them: clients keep no residual (``DGC.prepare``
clears it) and send their fresh pseudo-gradient's sets and top-k; the server steps::

    u = rho u + mean                      (server_momentum)
    e = e + server_lr u
    D = the largest fraction f of e's entries (dgc.server_error), over the whole model
    e, u = 0 where D is                   (FetchSGD's masking)
    w = w - D

docs/dgc_vs_dense.md ("The last points") reads it against dgc_sets.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from fedgc.methods.optimizer import ServerOptimizer

__all__ = ["ErrorAccumulation"]


class ErrorAccumulation(ServerOptimizer):
    """The server optimizer of ``dgc.server_error`` (module docstring): a
    :class:`fedgc.methods.optimizer.ServerOptimizer` whose step applies the error's top.

    Parameters
    ----------
    learning_rate : float
        ``server_lr``: the momentum's step goes into the error times this.
    momentum : float
        ``server_momentum`` (rho), in [0, 1).
    fraction : float
        The fraction of the model's entries applied each round, in (0, 1].
    """

    def __init__(self, learning_rate: float, momentum: float, fraction: float) -> None:
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"dgc.server_error must be in (0, 1] to apply anything, got "
                             f"{fraction!r}")
        super().__init__(learning_rate, momentum)  # its buffer is u
        self.fraction = float(fraction)
        self.error: dict[str, torch.Tensor] | None = None  # e

    def step(self, model: Mapping[str, torch.Tensor],
             avg: Mapping[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor] | None:
        """The next global model, or None (the state unchanged) when it would not be finite."""
        if self.buffer is None or self.error is None:
            self.buffer = {k: torch.zeros_like(v) for k, v in model.items()}
            self.error = {k: torch.zeros_like(v) for k, v in model.items()}
        u = {k: self.buffer[k] * self.momentum + avg[k] if k in avg else self.buffer[k].clone()
             for k in model}
        e = {k: self.error[k] + self.learning_rate * u[k] for k in model}
        names = list(model)
        flat = torch.cat([e[k].reshape(-1) for k in names])
        count = min(flat.numel(), math.ceil(self.fraction * flat.numel()))
        top = torch.topk(flat.abs(), count, sorted=False).indices
        applied = torch.zeros_like(flat)
        applied[top] = flat[top]
        new: OrderedDict[str, torch.Tensor] = OrderedDict()
        at = 0
        for k in names:
            n = model[k].numel()
            part = applied[at:at + n].view(model[k].shape)
            new[k] = model[k] - part
            chosen = part != 0
            e[k] = torch.where(chosen, 0.0, e[k])
            u[k] = torch.where(chosen, 0.0, u[k])
            at += n
        if not all(torch.isfinite(t).all() for t in new.values()):
            return None
        self.buffer, self.error = u, e
        return new

    def heading(self, model: OrderedDict[str, torch.Tensor],
                lookahead: float) -> OrderedDict[str, torch.Tensor]:
        """The model itself: what the error holds is not yet decided to be applied."""
        return model

    def state_dict(self) -> dict[str, Any]:
        """The momentum and the error (the checkpoint's ``momentum_buffer``, ``server_error``)."""
        return {"momentum_buffer": self.buffer, "server_error": self.error}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""
        self.buffer = state["momentum_buffer"]
        self.error = state.get("server_error")
