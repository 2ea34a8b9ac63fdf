"""The combine stage of the server's aggregation: the round's payloads, after the defences
(:mod:`server.defences`), to one sum in the aggregator's space.

``aggregation = mean``: the weighted average of the payloads' sparse parts, scattered in
O(total nonzeros) into one buffer that is reused every round (:class:`SparseAverage`); a
robust statistic (``trimmed_mean``, ``median``): coordinate-wise over the union of the round's
indices, never densifying more (:func:`robust_average`). Both read payloads only through
:class:`fedgc.methods.Payload` (``parts``), so every method and payload kind goes through the
same stage; the method's aggregator then finishes the round (:class:`fedgc.methods.Aggregator`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

import dgc
from dgc import SparseUpdate
from fedgc.methods import Payload
from fedgc.settings import AGGREGATIONS


class SparseAverage:
    """Averages decoded updates into a model-sized buffer allocated once per model shape."""

    def __init__(self) -> None:
        self._out: dict[str, torch.Tensor] | None = None

    def __call__(self, updates: list[SparseUpdate], weights: list[float], total_weight: float,
                 shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """``sum(w * u) / total_weight``; ``dgc.AggregationError`` when the total is not > 0.

        The result is the reused buffer: valid until the next call.
        """
        total = float(total_weight)
        if total <= 0:
            raise dgc.AggregationError("total weight is zero; nothing to average")
        if self._out is None or {k: tuple(v.shape) for k, v in self._out.items()} != shapes:
            self._out = dgc.aggregate_buffers(shapes)
        else:
            for buf in self._out.values():
                buf.zero_()
        # w * (1 / total): the very factors dgc.aggregate's own normalization computes. Decoded
        # updates and signs go in separate calls, so that the decoded ones keep the packed path.
        scale = 1.0 / total
        packed = [i for i, u in enumerate(updates) if u.packed is not None]
        others = [i for i, u in enumerate(updates) if u.packed is None]
        for group in (packed, others):
            if group:
                dgc.aggregate([updates[i] for i in group], [weights[i] * scale for i in group],
                              shapes, normalize=False, out=self._out)
        return self._out


ROBUST = tuple(a for a in AGGREGATIONS if a != "mean")


def _flat(update: SparseUpdate, offsets: Mapping[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions in the model's flat vector, values) of a decoded update's entries."""
    if update.packed is not None:
        p = update.packed
        if p.layout.names == tuple(offsets):
            dense = [torch.arange(off, off + n) for off, n, is_dense in
                     zip(p.layout.offsets, p.counts, p.layout.dense, strict=True) if is_dense]
            return (torch.cat([p.sparse_indices.to(torch.int64), *dense]),
                    torch.cat([p.sparse_values, p.dense_values]).to(torch.float64))
    idx = [t.indices.to(torch.int64) + offsets[n] for n, t in update.tensors.items()]
    val = [t.values.to(torch.float64) for t in update.tensors.values()]
    return torch.cat(idx), torch.cat(val)


def robust_average(clients: list[list[SparseUpdate]], factors: list[float], how: str,
                   trim_fraction: float, shapes: Mapping[str, tuple[int, ...]],
                   ) -> dict[str, torch.Tensor]:
    """The coordinate-wise trimmed mean (``trim_fraction`` of the K clients cut at each end) or
    median of the clients' updates, unweighted, in O(n log n) for n nonzeros in all.

    ``clients[i]``: client i's sparse updates (its update and signs), summed; ``factors[i]``
    scales them (the norm clip). An entry a client did not send is a 0 in its column, so the
    zeros of a coordinate are never materialized: its sorted column is its negative values,
    then K - m zeros, then its positive values, and an entry's place follows from its rank among
    the m values sent.
    """
    names = list(shapes)
    offsets, total = {}, 0
    for n in names:
        offsets[n] = total
        total += math.prod(shapes[n])
    k = len(clients)
    trim = (k - 1) // 2 if how == "median" else math.floor(trim_fraction * k)
    positions, values = [], []
    for parts, factor in zip(clients, factors, strict=True):
        flat = [_flat(u, offsets) for u in parts]
        idx, val = torch.cat([f[0] for f in flat]), torch.cat([f[1] for f in flat]) * factor
        idx, inverse = torch.unique(idx, return_inverse=True)  # one value per coordinate
        positions.append(idx)
        values.append(torch.zeros(idx.numel(), dtype=torch.float64).index_add_(0, inverse, val))
    idx, val = torch.cat(positions), torch.cat(values)
    by_value = torch.argsort(val, stable=True)
    order = by_value[torch.argsort(idx[by_value], stable=True)]  # by coordinate, then value
    idx, val = idx[order], val[order]
    _, counts = torch.unique_consecutive(idx, return_counts=True)
    starts = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    rank = torch.arange(idx.numel()) - starts
    place = torch.where(val < 0, rank, k - torch.repeat_interleave(counts, counts) + rank)
    keep = (place >= trim) & (place < k - trim)
    out = torch.zeros(total, dtype=torch.float64)
    out.index_add_(0, idx[keep], val[keep] / (k - 2 * trim))
    return {n: out[offsets[n]:offsets[n] + math.prod(shapes[n])].to(torch.float32)
            .view(shapes[n]) for n in names}


class Combine:
    """The combine stage: ``how`` = "mean" (weighted by the capped weights, each payload scaled
    by its clip factor) or one of :data:`ROBUST` (unweighted, ``trim_fraction`` for the trimmed
    mean)."""

    def __init__(self, how: str = "mean", trim_fraction: float = 0.1) -> None:
        if how not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {list(AGGREGATIONS)}, got {how!r}")
        self.how, self.trim_fraction = how, float(trim_fraction)
        self._average = SparseAverage()

    def __call__(self, payloads: Sequence[Payload], weights: Sequence[float],
                 factors: Sequence[float], shapes: Mapping[str, tuple[int, ...]],
                 ) -> dict[str, torch.Tensor]:
        """The round's sum in the space of ``shapes``; ``dgc.AggregationError`` when the
        weights total zero."""
        if self.how in ROBUST:
            return robust_average([p.parts() for p in payloads], list(factors), self.how,
                                  self.trim_fraction, shapes)
        scaled = [w * f for w, f in zip(weights, factors, strict=True)]
        parts = [p.parts() for p in payloads]
        # Each payload's first part, then the others (a client's shared signs) with its weight.
        updates = [ps[0] for ps in parts] + [q for ps in parts for q in ps[1:]]
        ws = scaled + [w for w, ps in zip(scaled, parts, strict=True) for _ in ps[1:]]
        return self.average(updates, ws, float(sum(weights)), shapes)

    def average(self, updates: list[SparseUpdate], weights: list[float], total_weight: float,
                shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """``sum(w * u) / total_weight`` (:class:`SparseAverage`)."""
        return self._average(updates, weights, total_weight, shapes)
