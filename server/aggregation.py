"""The weighted average of a round's sparse updates, scattered in O(total nonzeros) into one
buffer that is reused every round."""

from __future__ import annotations

from collections.abc import Mapping

import torch

import dgc
from dgc import SparseUpdate


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
