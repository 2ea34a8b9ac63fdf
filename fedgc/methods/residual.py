"""The residual half of a catalogue compressor with error feedback: what the client keeps.

random-k, QSGD (with ``qsgd.error_feedback``), EF-signSGD and TCS keep what they did not send in
a :class:`dgc.DGCMemory` without momentum (``self.memory``, made by the compressor) and differ
only in how they compress; the :class:`dgc.Compressor` methods that read or restore that
residual are these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dgc import SparseUpdate, StateError


class ResidualCompressor:
    """``restore``, ``residual``, ``scale_state`` and the state dict of ``self.memory``;
    ``label`` names the method in a refused state's message."""

    label = "compressor"
    memory: Any  # dgc.DGCMemory, made by the subclass

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
