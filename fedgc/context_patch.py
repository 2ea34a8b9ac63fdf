"""Catch-up patches coded by displacement rank (``downlink_context``): a grid tensor's changed
entries are sent per segment of the tensor's entries ranked by how far the client's model has
moved from version 0, which both ends hold bit for bit.

The entries a broadcast moves are mostly those that have moved before: on mnist5k a patch's
changed entries are several times denser among the most displaced entries than among the rest,
so coding their positions per segment of that ranking (each segment with its own Golomb-Rice
parameter, or a bitmap) spends about a third fewer index bytes than coding them over the whole
tensor (``docs/dgc_vs_dense.md``, "A downlink for clients who return rarely"). The segments
travel as ordinary tensors of the update message, named ``NAME#j`` and one-dimensional, their
indices positions within segment ``j`` of the ranking; the wire format is unchanged.

The ranking: entries by ``|base - version0|`` descending, ties by position (a stable sort), so
server and client, holding the same two float32 tensors, order them the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dgc import SparseTensor
from dgc.ranking import ranked
from dgc.wire.compact import Layout, layout_of

#: Segment boundaries of the ranking, in thousandths of the tensor's entries: the most displaced
#: 2%, the next 4%, 9%, 25%, and the rest (chosen on the mnist5k cA run's patches; any fixed
#: boundaries decode, these spent the fewest index bytes of the sets measured).
BOUNDS_PER_MILLE = (20, 60, 150, 400)
SEPARATOR = "#"


class ContextError(ValueError):
    """A context-coded patch that does not fit the held model: a clear one-line reason."""


def segment_name(name: str, j: int) -> str:
    """The update-message name of segment ``j`` of tensor ``name``."""
    return f"{name}{SEPARATOR}{j}"


def cuts(numel: int) -> list[int]:
    """The segment boundaries of a tensor of ``numel`` entries: ``len(BOUNDS) + 2`` integers
    from 0 to ``numel`` (segments may be empty for tiny tensors)."""
    return [0, *(numel * b // 1000 for b in BOUNDS_PER_MILLE), numel]


def rank_order(base: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
    """The flat positions of ``base``'s entries by displacement ``|base - origin|``, largest
    first, ties by position (int64)."""
    if base.shape != origin.shape:
        raise ContextError(f"held tensor of shape {tuple(base.shape)} and version 0 of shape "
                           f"{tuple(origin.shape)} differ")
    return ranked(base, origin)  # a stable sort's order, sorted by distinct keys (dgc.ranking)


def split(name: str, t: SparseTensor, order: torch.Tensor) -> dict[str, SparseTensor]:
    """The segments of ``t`` (a tensor's changed entries, flat indices) on the ranking
    ``order``: per non-empty segment ``j``, ``NAME#j`` with the positions within it, sorted,
    and their values."""
    numel = order.numel()
    rank = torch.empty(numel, dtype=torch.int64)
    rank[order] = torch.arange(numel, dtype=torch.int64)
    ranks = rank[t.indices.to(torch.int64)]
    sort = torch.argsort(ranks)
    ranks, values = ranks[sort], t.values[sort]
    bounds = cuts(numel)
    out = {}
    for j, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        inside = (ranks >= lo) & (ranks < hi)
        if bool(inside.any()):
            out[segment_name(name, j)] = SparseTensor(ranks[inside] - lo, values[inside],
                                                      (hi - lo,))
    return out


def join(name: str, segments: Mapping[str, SparseTensor], order: torch.Tensor) -> SparseTensor:
    """Tensor ``name``'s changed entries (flat indices, sorted) from its segments
    ``NAME#j`` of a decoded patch; a ContextError when a segment's size is not the ranking's."""
    numel = order.numel()
    bounds = cuts(numel)
    indices, values = [], []
    for j, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        seg = segments.get(segment_name(name, j))
        if seg is None:
            continue
        if seg.shape != (hi - lo,):
            raise ContextError(f"patch segment {segment_name(name, j)!r} has shape {seg.shape}, "
                               f"segment {j} of {name!r} ({numel} entries) holds {hi - lo}")
        indices.append(order[seg.indices.to(torch.int64) + lo])
        values.append(seg.values)
    if not indices:
        return SparseTensor(torch.zeros(0, dtype=torch.int64), torch.zeros(0), (numel,))
    flat, sort = torch.sort(torch.cat(indices))
    return SparseTensor(flat, torch.cat(values)[sort], (numel,))


def segment_owner(segment: str, context: Mapping[str, object]) -> str | None:
    """The tensor of ``context`` whose segment ``segment`` is (``NAME#j``, ``j`` a segment
    number), or None."""
    name, sep, j = segment.rpartition(SEPARATOR)
    if not sep or name not in context or not j.isdigit() or str(int(j)) != j:
        return None
    return name if int(j) <= len(BOUNDS_PER_MILLE) else None


def patch_layout(shapes: Mapping[str, tuple[int, ...]], context: list[str] | tuple[str, ...],
                 ) -> Layout:
    """The layout of a compact patch (:mod:`dgc.wire.compact`, ``downlink_compact``) on a model
    of ``shapes`` whose tensors ``context`` go as segments of their ranking: the model's tensors
    and every segment of those, which both ends list alike."""
    out = {name: tuple(shape) for name, shape in shapes.items()}
    for name in context:
        numel = 1
        for d in shapes[name]:
            numel *= int(d)
        bounds = cuts(numel)
        for j, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            out[segment_name(name, j)] = (hi - lo,)
    return layout_of(out)
