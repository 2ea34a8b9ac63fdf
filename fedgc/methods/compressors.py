"""Compressor bases for a method's client half: one that keeps a residual, one that keeps nothing.

A method's compressor (:class:`dgc.base.Compressor`) compresses and keeps its state between
rounds. Most keep a residual (error feedback: what they did not send waits for the next round)
and differ only in how they compress; others keep nothing at all. Subclass
:class:`ResidualCompressor` or :class:`StatelessCompressor` and write ``compress``: the rest of
the contract (``restore``, ``residual``, ``scale_state``, the state dict) is here, written once.
random-k, QSGD, EF-signSGD and TCS keep a residual; FetchSGD's sketches and signSGD's votes keep
nothing; ``examples/own_method`` is a user's residual compressor in a dozen lines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dgc import DGCMemory, SparseUpdate, StateError

__all__ = ["ResidualCompressor", "StatelessCompressor"]


class ResidualCompressor:
    """A compressor with a residual (error feedback): write ``compress`` with
    :meth:`check_gradients`, :meth:`accumulate` and :meth:`mark_sent`.

    The residual is a :class:`dgc.DGCMemory` without momentum (``self.memory``), flat float32
    per tensor, on the host; ``label`` names the method in a refused state's message.

    Example
    -------
    A compressor that sends every residual entry of magnitude 1 or more, and keeps the rest::

        class Threshold(ResidualCompressor):
            def compress(self, grads, epoch=0.0, sequence=None):
                self.check_gradients(grads)
                out = {}
                for name, g in grads.items():
                    v = self.accumulate(name, g)
                    idx = torch.nonzero(v.abs() >= 1.0).reshape(-1)
                    sent = v[idx].clone()
                    self.mark_sent(name, idx, sent)
                    out[name] = SparseTensor(idx, sent, tuple(g.shape))
                return SparseUpdate(out, sequence or 0)
    """

    label = "compressor"

    def __init__(self) -> None:
        self.memory = DGCMemory(0.0, False, False, 0.0)

    def check_gradients(self, grads: Mapping[str, torch.Tensor]) -> None:
        """StateError, before anything changes, for a gradient with NaN or Inf or one of another
        size than the residual holds for its tensor."""
        for name, g in grads.items():
            if not torch.isfinite(g).all():
                raise StateError(f"gradient {name!r} contains NaN or Inf; nothing was changed")
            held = self.memory.v.get(name)
            if held is not None and held.numel() != g.numel():
                raise StateError(f"gradient {name!r} has {g.numel()} entries, the residual "
                                 f"holds {held.numel()}")

    def accumulate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Add ``grad`` (any shape or device) to the residual of ``name``; the residual, flat
        float32 on the host, which ``compress`` reads and :meth:`mark_sent` reduces."""
        return self.memory.accumulate(name, grad.detach().reshape(-1).to("cpu", torch.float32))

    def mark_sent(self, name: str, indices: torch.Tensor, sent: torch.Tensor) -> None:
        """Take what was sent (as the receiver will read it) out of the residual of ``name``."""
        self.memory.mark_sent(name, indices, sent, False)

    def restore(self, update: SparseUpdate) -> None:
        """Add an update (or one part of a payload) the server did not aggregate back into
        the residual; nothing is added unless every tensor fits."""
        for name, t in update.tensors.items():
            held = self.memory.v.get(name)
            if held is None or held.numel() != t.numel:
                raise StateError(f"update tensor {name!r} does not fit this compressor")
        for name, t in update.tensors.items():
            self.memory.restore(name, t.indices, t.values)

    def residual(self) -> dict[str, torch.Tensor]:
        return self.memory.v

    def scale_state(self, factor: float) -> None:
        self.memory.scale(float(factor))

    def state_dict(self) -> dict[str, Any]:
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or not isinstance(state.get("memory"), Mapping):
            raise StateError(f"{self.label} state must hold the residual under 'memory'")
        self.memory.load_state_dict(state["memory"])


class StatelessCompressor:
    """A compressor that keeps nothing between rounds: write ``compress``. What the server did
    not aggregate is lost (there is no residual to fold it back into)."""

    def restore(self, update: SparseUpdate) -> None:
        """Nothing to restore into."""

    def residual(self) -> dict[str, torch.Tensor]:
        return {}

    def scale_state(self, factor: float) -> None:
        """No state to scale."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """No state to load."""
