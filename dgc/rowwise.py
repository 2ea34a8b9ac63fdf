"""RowwiseCompressor: DGC with the density budget spent per output unit (row), not per tensor.

Measured worse than per-tensor top-k on the MLP of ``docs/federated_momentum.md``; kept for
models where per-tensor top-k starves whole units.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from dgc.compressor import DGCCompressor
from dgc.config import DGCConfig
from dgc.errors import StateError
from dgc.memory import DGCMemory
from dgc.sparse import SparseTensor, SparseUpdate

_ROW = "#row"


class RowwiseCompressor:
    """DGC with the density budget spent per output unit (row) instead of per tensor.

    Every tensor the layer policy sparsifies is cut into its rows (``shape[0]`` output units;
    ``t.reshape(shape[0], -1)``) and each row gets its own top-k of ``ceil(density * row_size)``
    entries, at least one. Per-tensor top-k on federated pseudo-gradients concentrates almost
    the whole budget on a few hidden units (measured: 20 of 200 units get 90% of the entries,
    ``docs/federated_momentum.md``) and gives a 10x200 output layer 2 entries per round; per-row
    selection keeps every unit learning. The residual, momentum, masking, warm-up, clipping and
    value rounding are those of an ordinary :class:`~dgc.DGCCompressor` (it runs underneath,
    one residual per row), and updates carry the original tensor names and shapes, so the wire
    format and :func:`dgc.aggregate` see nothing new. Implements :class:`dgc.base.Compressor`:
    each sparsified tensor's row residuals are views of one flat tensor, which
    :meth:`residual` returns.

    Parameters
    ----------
    config : DGCConfig, optional
        The hyperparameters; ``min_sparse_numel`` still decides which whole tensors are sent
        dense.
    """

    def __init__(self, config: DGCConfig | None = None) -> None:
        self.config = config or DGCConfig()
        self._policy = DGCCompressor(self.config)
        # Rows are handed over as (1, row_size) tensors: sparsified whatever their size. Tensor
        # by tensor: _join_rows keeps the rows as views of its own flat tensors, which the
        # batched path would lay out anew (on an accelerator this compressor is correct, not
        # fast).
        self.inner = DGCCompressor(dataclasses.replace(self.config, min_sparse_numel=1),
                                   batched=False)
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._flat: dict[str, torch.Tensor] = {}

    @property
    def memory(self) -> DGCMemory:
        """The per-row momentum and residual (a :class:`~dgc.DGCMemory`)."""
        return self.inner.memory

    @property
    def step(self) -> int:
        """Updates produced so far."""
        return self.inner.step

    def _split(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if _ROW in name:
            raise StateError(f"tensor name {name!r} must not contain {_ROW!r}")
        if self._policy.is_dense_tensor(tuple(t.shape)):
            return {name: t.reshape(-1)}
        rows = t.reshape(t.shape[0], -1)
        return {f"{name}{_ROW}{i}": rows[i:i + 1] for i in range(rows.shape[0])}

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> SparseUpdate:
        """Fold ``grads`` into the per-row residuals and return what to send this step.

        A bad gradient (NaN, wrong size, ...) is rejected by the underlying compressor before any
        state changes.
        """
        for name, t in grads.items():
            if not isinstance(t, torch.Tensor):
                raise StateError(f"gradient {name!r} must be a tensor, got {type(t).__name__}")
            known = self._shapes.get(name)
            if known is not None and known != tuple(t.shape):
                raise StateError(f"tensor {name!r} has shape {tuple(t.shape)}, the residual "
                                 f"holds {known}")
        pieces: dict[str, torch.Tensor] = {}
        for name, t in grads.items():
            pieces.update(self._split(name, t))
        sent = self.inner.compress(pieces, epoch, sequence)
        for name, t in grads.items():
            if name not in self._shapes:
                self._shapes[name] = tuple(t.shape)
                self._join_rows(name)
        out = {}
        for name, t in grads.items():
            shape = tuple(t.shape)
            if name in sent.tensors:
                piece = sent.tensors[name]
                out[name] = SparseTensor(piece.indices, piece.values, shape)
                continue
            rows = t.shape[0]
            row_size = t.numel() // rows
            parts = [sent.tensors[f"{name}{_ROW}{i}"] for i in range(rows)]
            indices = torch.cat([p.indices + i * row_size for i, p in enumerate(parts)])
            values = torch.cat([p.values for p in parts])
            out[name] = SparseTensor(indices, values, shape)
        return SparseUpdate(out, sent.sequence)

    def restore(self, update: SparseUpdate) -> None:
        """Fold an update that was sent but never applied back into the residuals."""
        pieces: dict[str, SparseTensor] = {}
        for name, t in update.tensors.items():
            shape = self._shapes.get(name)
            if shape is None:
                raise StateError(f"update tensor {name!r} is not held by this compressor")
            if shape != t.shape:
                raise StateError(f"update tensor {name!r} has shape {t.shape}, the residual "
                                 f"holds {shape}")
            if self._policy.is_dense_tensor(shape):
                pieces[name] = SparseTensor(t.indices, t.values, (t.numel,))
                continue
            rows = shape[0]
            row_size = t.numel // rows
            row_of = t.indices // row_size
            for i in range(rows):
                sel = row_of == i
                pieces[f"{name}{_ROW}{i}"] = SparseTensor(t.indices[sel] - i * row_size,
                                                          t.values[sel], (1, row_size))
        self.inner.restore(SparseUpdate(pieces, update.sequence))

    def _join_rows(self, name: str) -> None:
        """Hold the row residuals of ``name`` as views of one flat tensor (every update of the
        memory is in place, so the views stay joined)."""
        shape = self._shapes[name]
        v = self.inner.memory.v
        if name in v or not shape[0]:
            return
        keys = [f"{name}{_ROW}{i}" for i in range(shape[0])]
        flat = torch.cat([v[k] for k in keys])
        self._flat[name] = flat
        for k, row in zip(keys, flat.split([v[k].numel() for k in keys]), strict=True):
            v[k] = row

    def residual(self) -> dict[str, torch.Tensor]:
        """The unsent accumulated values (flat; the rows of a tensor are views of its flat
        residual), keyed by tensor name."""
        v = self.inner.memory.v
        return {name: v[name] if name in v else self._flat[name] for name in self._shapes
                if name in v or name in self._flat}

    def scale_state(self, factor: float) -> None:
        """Multiply the per-row residuals and momenta by ``factor`` in place."""
        self.inner.scale_state(factor)

    def state_dict(self) -> dict[str, Any]:
        """The underlying compressor's state plus the tensor shapes."""
        return {"rowwise": True, "shapes": {k: list(v) for k, v in self._shapes.items()},
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; a malformed state changes nothing."""
        if not isinstance(state, Mapping) or state.get("rowwise") is not True \
                or "inner" not in state or "shapes" not in state:
            raise StateError("not a RowwiseCompressor state (needs 'rowwise', 'shapes', 'inner')")
        shapes = {str(k): tuple(int(d) for d in v) for k, v in state["shapes"].items()}
        self.inner.load_state_dict(state["inner"])
        self._shapes = shapes
        self._flat = {}
        for name in shapes:
            self._join_rows(name)
