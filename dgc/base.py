"""The Compressor contract: what every fedgc compressor offers, however it picks its entries.

A compressor turns one worker's successive gradients (or pseudo-gradients) into sparse updates
and keeps what it did not send (the residual) and its momentum between steps. The client, the
phone bridge, the network emulator and the benches use compressors only through this contract.
Implementations: :class:`dgc.DGCCompressor` (per-tensor top-k, the paper's),
:class:`dgc.two_density.TwoDensityCompressor` (a second density for small tensors),
:class:`dgc.rowwise.RowwiseCompressor` (top-k per output unit) and
``android_bridge.runtime.PteEncoder`` (the exported phone encoder, run by ExecuTorch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from dgc.errors import StateError
from dgc.sparse import SparseUpdate


@runtime_checkable
class Compressor(Protocol):
    """One worker's compressor: gradients in, sparse updates out, residual and momentum kept."""

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> SparseUpdate:
        """Fold ``grads`` into the residual and return what to send this step (``epoch`` drives
        the warm-up; ``sequence`` numbers the update, by default the step count). A bad
        gradient raises :class:`dgc.StateError` and changes nothing."""
        ...

    def restore(self, update: SparseUpdate) -> None:
        """Fold an update that was sent but never applied back into the residual."""
        ...

    def residual(self) -> dict[str, torch.Tensor]:
        """The unsent accumulated values, flat, keyed by tensor name: the compressor's own
        tensors, so that a change in place (the sign channel's ``take_signs``) is kept."""
        ...

    def scale_state(self, factor: float) -> None:
        """Multiply the residual and the momentum by ``factor`` in place (0 clears them): how
        a client's state ages over the rounds it missed."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue later (copies)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; a malformed state changes nothing."""
        ...


def check_factor(factor: object) -> float:
    """``factor`` as a float after checking that it is a finite number >= 0."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
            or not 0.0 <= float(factor) < float("inf"):
        raise StateError(f"state scale factor must be a finite number >= 0, got {factor!r}")
    return float(factor)
