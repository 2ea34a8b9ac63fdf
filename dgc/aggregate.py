"""Weighted scatter-add of sparse updates, in O(total nonzeros) beyond the output itself."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dgc.errors import AggregationError
from dgc.sparse import SparseUpdate


def aggregate(
    updates: Sequence[SparseUpdate],
    weights: Sequence[float],
    shapes: Mapping[str, Sequence[int]],
    normalize: bool = True,
) -> dict[str, torch.Tensor]:
    """Weighted sum of sparse updates as dense float32 tensors shaped as ``shapes``.

    Entries that several updates carry are summed. With ``normalize`` the sum is divided by the
    total weight (FedAvg: an update that did not send an entry counts as zero there). Every update
    is checked against ``shapes`` before anything is summed.
    """
    if len(updates) != len(weights):
        raise AggregationError(f"{len(updates)} updates but {len(weights)} weights")
    for w in weights:
        if not (isinstance(w, (int, float)) and w >= 0 and w == w and w != float("inf")):
            raise AggregationError(f"weights must be finite and >= 0, got {w!r}")
    for i, u in enumerate(updates):
        for name, t in u.tensors.items():
            if name not in shapes:
                raise AggregationError(f"update {i} carries unknown tensor {name!r}")
            if tuple(shapes[name]) != t.shape:
                raise AggregationError(f"update {i} tensor {name!r} has shape {t.shape}, "
                                       f"the model has {tuple(shapes[name])}")
            if t.nnz and (int(t.indices.min()) < 0 or int(t.indices.max()) >= t.numel):
                raise AggregationError(f"update {i} tensor {name!r} has indices outside "
                                       f"[0, {t.numel})")
    total = float(sum(weights))
    if normalize and total <= 0 and updates:
        raise AggregationError("total weight is zero; nothing to average")
    scale = 1.0 / total if normalize and total > 0 else 1.0
    out = {name: torch.zeros(int(torch.Size(s).numel()), dtype=torch.float32)
           for name, s in shapes.items()}
    for u, w in zip(updates, weights, strict=True):
        factor = float(w) * scale
        for name, t in u.tensors.items():
            out[name].index_add_(0, t.indices, t.values.to(torch.float32), alpha=factor)
    return {name: out[name].view(tuple(s)) for name, s in shapes.items()}
