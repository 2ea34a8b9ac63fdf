"""The sign channel's client half: the residual at the round's shared indices, as scaled signs.

Every client of a round sends its residual at the server's index sets as
``sign(v[M]) * mean(|v[M]|)``, one fp32 scale per tensor and one bit per entry, and keeps the
rest in the residual (error feedback, as EF-signSGD, Karimireddy et al. 2019).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from dgc.errors import StateError
from dgc.sparse import SparseTensor, SparseUpdate


def take_signs(residual: Mapping[str, torch.Tensor], masks: Mapping[str, np.ndarray],
               sequence: int) -> SparseUpdate:
    """Send the residual at ``masks`` as scaled signs and keep the rest.

    ``residual`` maps tensor names to the compressor's flat residual tensors, changed in place:
    ``v[M] -= sign(v[M]) * mean(|v[M]|)``. Returns what was sent, as a :class:`SparseUpdate`
    whose values are ``+-scale`` (a zero entry counts as positive).
    """
    out: dict[str, SparseTensor] = {}
    for name, mask in masks.items():
        v = residual.get(name)
        if v is None:
            raise StateError(f"shared index set for {name!r}, which this client does not hold")
        idx = torch.from_numpy(np.asarray(mask, dtype=np.int64))
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= v.numel()):
            raise StateError(f"shared index set for {name!r} falls outside [0, {v.numel()})")
        idx = idx.to(v.device)  # the residual may live on an accelerator
        vm = v[idx]
        scale = float(vm.abs().mean()) if vm.numel() else 0.0
        sent = torch.where(vm < 0, -scale, scale).to(torch.float32)
        v.index_put_((idx,), vm - sent)
        out[name] = SparseTensor(idx, sent, (v.numel(),))
    return SparseUpdate(out, sequence)


def take_values(residual: Mapping[str, torch.Tensor], masks: Mapping[str, np.ndarray],
                sequence: int, levels: float = 1.0) -> SparseUpdate:
    """Send the residual at ``masks`` as values on a power-of-two grid and keep the rest.

    The values variant of :func:`take_signs` (time-correlated sparsification, Ozfatura et al.
    2021; GlueFL, He et al. 2023: every client sends values at the server's mask). Per tensor
    the step is ``2**e``, the power of two nearest ``mean(|v[M]|) / levels``; each entry sends
    ``q * 2**e`` with ``q = round(v / 2**e)`` clipped to [-127, 127], and the rounding stays in
    the residual. ``levels`` is the mean magnitude in steps: 1 sends most entries as 0 or +-1
    steps (~2 bits each, Rice-coded, :func:`dgc.signs.codec.encode_values`), larger is finer.
    """
    out: dict[str, SparseTensor] = {}
    for name, mask in masks.items():
        v = residual.get(name)
        if v is None:
            raise StateError(f"shared index set for {name!r}, which this client does not hold")
        idx = torch.from_numpy(np.asarray(mask, dtype=np.int64))
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= v.numel()):
            raise StateError(f"shared index set for {name!r} falls outside [0, {v.numel()})")
        vm = v[idx]
        sent = on_grid(vm, levels)
        v.index_put_((idx,), vm - sent)
        out[name] = SparseTensor(idx, sent, (v.numel(),))
    return SparseUpdate(out, sequence)


def on_grid(values: torch.Tensor, levels: float) -> torch.Tensor:
    """``values`` rounded to the power-of-two grid whose step is nearest ``mean(|values|) /
    levels`` (``q * step``, ``q`` clipped to [-127, 127]: what the wire's grid coding carries,
    docs/wire.md section 5), in float32, without negative zeros."""
    v = values.to(torch.float32)
    mean = float(v.abs().mean()) if v.numel() else 0.0
    if not (mean > 0 and math.isfinite(mean)):
        return torch.zeros_like(v)
    exponent = min(max(round(math.log2(mean / levels)), -126), 120)
    step = math.ldexp(1.0, exponent)
    return (v / step).round().clamp(-127, 127) * step + 0.0  # +0.0 turns -0.0 into 0.0


def values_on_grid(update: SparseUpdate, levels: float) -> tuple[SparseUpdate, SparseUpdate]:
    """``dgc.value_levels``: the top-k's values of ``update`` on a power-of-two grid per tensor
    (:func:`on_grid`), and the rounding, which goes back into the residual
    (the simulated client's :class:`RoundCompressor`, and a phone on its encoder's output)."""
    tensors, error = {}, {}
    for name, t in update.tensors.items():
        values = t.values.to(torch.float32)
        rounded = on_grid(values, levels)
        tensors[name] = SparseTensor(t.indices, rounded, t.shape)
        error[name] = SparseTensor(t.indices, values - rounded, t.shape)
    return SparseUpdate(tensors, update.sequence), SparseUpdate(error, update.sequence)
