"""Weighted scatter-add of sparse updates, in O(total nonzeros) beyond the output itself."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dgc.errors import AggregationError
from dgc.sparse import SparseUpdate, TensorLayout


def aggregate_buffers(shapes: Mapping[str, Sequence[int]],
                      device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """Zeroed float32 buffers for ``aggregate(..., out=...)``, views of one flat block.

    With the buffers laid out back to back in the model's order, :func:`aggregate` scatters a
    decoded update's entries of all tensors in one call instead of one call per tensor.
    ``device``: where the sum is formed (default the host); updates decoded on the host are
    moved there, one copy of each update's packed arrays.
    """
    offsets, total = _flat_offsets(shapes)
    block = torch.zeros(total, dtype=torch.float32, device=device)
    return {name: block[offsets[name]:offsets[name] + math.prod(s)].view(tuple(s))
            for name, s in shapes.items()}


def _flat_offsets(shapes: Mapping[str, Sequence[int]]) -> tuple[dict[str, int], int]:
    """Where each tensor starts in the model flattened tensor after tensor, and the total."""
    offsets, total = {}, 0
    for name, s in shapes.items():
        offsets[name] = total
        total += math.prod(s)
    return offsets, total


def _device_of(updates: Sequence[SparseUpdate],
               flat_out: Mapping[str, torch.Tensor] | None) -> torch.device:
    """Where a sum of per-tensor updates is formed: on ``out``'s device, else on the device of
    the first update tensor (the host when there is none)."""
    if flat_out:
        return next(iter(flat_out.values())).device
    for u in updates:
        for t in u.tensors.values():
            return t.values.device
    return torch.device("cpu")


def _check_weights(updates: Sequence[SparseUpdate], weights: Sequence[float]) -> None:
    if len(updates) != len(weights):
        raise AggregationError(f"{len(updates)} updates but {len(weights)} weights")
    for w in weights:
        if not (isinstance(w, (int, float)) and w >= 0 and w == w and w != float("inf")):
            raise AggregationError(f"weights must be finite and >= 0, got {w!r}")


def _check_out(out: Mapping[str, torch.Tensor],
               shapes: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
    """Flat views of the caller's buffers, after checking that each one can take the sum (one
    device for all of them)."""
    if not isinstance(out, Mapping):
        raise AggregationError(f"out must be a dict of tensors by name, got {type(out).__name__}")
    missing = [name for name in shapes if name not in out]
    if missing:
        raise AggregationError(f"out lacks buffers for {missing}")
    extra = [name for name in out if name not in shapes]
    if extra:
        raise AggregationError(f"out has buffers {extra} that the model does not have")
    flat = {}
    devices = {out[name].device for name in shapes if isinstance(out[name], torch.Tensor)}
    for name, s in shapes.items():
        buf = out[name]
        if not isinstance(buf, torch.Tensor):
            raise AggregationError(f"out[{name!r}] must be a torch.Tensor, got "
                                   f"{type(buf).__name__}")
        if buf.dtype != torch.float32 or tuple(buf.shape) != tuple(s):
            raise AggregationError(f"out[{name!r}] is {buf.dtype} of shape {tuple(buf.shape)}, "
                                   f"expected torch.float32 of shape {tuple(s)}")
        if not buf.is_contiguous() or len(devices) > 1:
            raise AggregationError(f"out[{name!r}] must be a contiguous tensor on the device "
                                   f"of the other buffers (found {sorted(map(str, devices))})")
        flat[name] = buf.view(-1)
    return flat


def aggregate(
    updates: Sequence[SparseUpdate],
    weights: Sequence[float],
    shapes: Mapping[str, Sequence[int]],
    normalize: bool = True,
    out: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Weighted sum of sparse updates as dense float32 tensors shaped as ``shapes``.

    Entries that several updates carry are summed. With ``normalize`` the sum is divided by the
    total weight (FedAvg: an update that did not send an entry counts as zero there). Every update
    (and every ``out`` buffer) is checked before anything is written.

    Parameters
    ----------
    updates, weights
        One weight (finite, >= 0) per update.
    shapes
        The model's tensor shapes by name; the result has exactly these tensors.
    normalize
        Divide by the total weight (which must then be positive when there are updates).
    out
        Optional float32 contiguous buffers on one device, one per name in ``shapes`` with that
        shape (the sum is formed on their device; without ``out``, on the device of the first
        update's tensors, the host for decoded updates). The
        weighted sum is *added* to what they hold (pass zeroed buffers for the plain average;
        a server reuses them across rounds with ``zero_()`` in between, saving the allocation
        of a fresh model-sized output). The returned dict holds these same tensors.

    Notes
    -----
    Updates straight from :func:`dgc.decode` (``update.packed`` set) are summed from their flat
    arrays: one scatter per update for all its sparse tensors, and one running sum per update
    for all its dense ones (scattered once at the end). This is fastest into buffers from
    :func:`aggregate_buffers` (or with no ``out``); other ``out`` buffers get the sum through a
    temporary flat block.

    Otherwise, per tensor, the indices and weight-scaled float32 values of all updates are
    concatenated and scattered with one ``index_add_``; a tensor that every update carries in
    full (indices exactly ``0..numel-1``) is summed with one matrix-vector product instead.
    Either way each sum is the same as adding the updates one by one in their order, up to the
    order and grouping of the float32 additions (threads, BLAS blocking): results agree within
    float32 rounding, not bit for bit.
    """
    _check_weights(updates, weights)
    flat_out = _check_out(out, shapes) if out is not None else None
    if updates and all(getattr(u, "packed", None) is not None for u in updates):
        return _aggregate_packed(updates, weights, shapes, normalize, out)
    device = _device_of(updates, flat_out)
    # Structural checks (cheap, per piece) first; the index range is checked below on the
    # concatenation of each tensor's indices, still before anything is written.
    pieces: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {n: [] for n in shapes}
    model_shapes = {name: tuple(s) for name, s in shapes.items()}
    for i, u in enumerate(updates):
        for name, t in u.tensors.items():
            expected = model_shapes.get(name)
            if expected is None:
                raise AggregationError(f"update {i} carries unknown tensor {name!r}")
            if expected != t.shape:
                raise AggregationError(f"update {i} tensor {name!r} has shape {t.shape}, "
                                       f"the model has {expected}")
            if t.indices.numel():
                pieces[name].append((i, t.indices.to(device), t.values.to(device)))
    total = float(sum(weights))
    if normalize and total <= 0 and updates:
        raise AggregationError("total weight is zero; nothing to average")
    scale = 1.0 / total if normalize and total > 0 else 1.0
    factors = torch.tensor([float(w) * scale for w in weights], dtype=torch.float32,
                           device=device)
    factors64 = [float(w) * scale for w in weights]

    scatters = []
    for name, parts in pieces.items():
        if not parts:
            continue
        numel = int(torch.Size(model_shapes[name]).numel())
        counts = [int(p[1].numel()) for p in parts]
        indices = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
        # Every piece carrying exactly 0..numel-1 (a tensor sent dense, e.g. biases and norms)
        # is summed as one matrix-vector product rather than a scatter.
        dense = (len(parts) > 1 and all(c == numel for c in counts)
                 and bool((indices.view(len(parts), numel)
                           == torch.arange(numel, dtype=torch.int64, device=device)).all()))
        if not dense:
            lo, hi = torch.aminmax(indices)
            if int(lo) < 0 or int(hi) >= numel:
                bad = next(i for i, idx, _ in parts
                           if int(idx.min()) < 0 or int(idx.max()) >= numel)
                raise AggregationError(f"update {bad} tensor {name!r} has indices outside "
                                       f"[0, {numel})")
        scatters.append((name, numel, indices, parts, counts, dense))

    if flat_out is None:
        result = {name: torch.zeros(s, dtype=torch.float32, device=device)
                  for name, s in model_shapes.items()}
        flat_out = {name: t.view(-1) for name, t in result.items()}
    else:
        result = {name: out[name] for name in model_shapes}
    for name, numel, indices, parts, counts, dense in scatters:
        if len(parts) == 1:
            i, _, v = parts[0]
            flat_out[name].index_add_(0, indices, v.to(torch.float32), alpha=factors64[i])
            continue
        # cat promotes mixed value dtypes to float32 exactly; one conversion, not one per piece
        values = torch.cat([p[2] for p in parts]).to(torch.float32)
        piece_factors = factors[torch.tensor([p[0] for p in parts], dtype=torch.int64,
                                             device=device)]
        if dense:
            flat_out[name].addmv_(values.view(len(parts), numel).t(), piece_factors)
            continue
        values.mul_(torch.repeat_interleave(piece_factors,
                                            torch.tensor(counts, dtype=torch.int64,
                                                         device=device)))
        flat_out[name].index_add_(0, indices, values)
    return result


@dataclass
class _LayoutPlan:
    """Where the tensors of one update layout go in the model's flat block."""

    sparse_shifts: np.ndarray | None  # per sparse tensor, model offset minus layout offset
    sparse_tensors: list[int]  # layout positions of the sparse tensors
    dense_positions: torch.Tensor  # model flat position of every dense entry, in layout order


def _plan(layout: TensorLayout, update: int, shapes: Mapping[str, Sequence[int]],
          model_offsets: Mapping[str, int]) -> _LayoutPlan:
    """Check a layout against the model (the errors the per-tensor path raises) and place it."""
    sparse_tensors, shifts, dense_starts, dense_sizes = [], [], [], []
    for k, (name, shape, dense, offset) in enumerate(zip(layout.names, layout.shapes,
                                                         layout.dense, layout.offsets,
                                                         strict=True)):
        expected = shapes.get(name)
        if expected is None:
            raise AggregationError(f"update {update} carries unknown tensor {name!r}")
        if tuple(expected) != shape:
            raise AggregationError(f"update {update} tensor {name!r} has shape {shape}, "
                                   f"the model has {tuple(expected)}")
        if dense:
            dense_starts.append(model_offsets[name])
            dense_sizes.append(math.prod(shape))
        else:
            sparse_tensors.append(k)
            shifts.append(model_offsets[name] - offset)
    sizes = np.array(dense_sizes, dtype=np.int64)
    positions = np.arange(int(sizes.sum()), dtype=np.int64)
    positions += np.repeat(np.array(dense_starts, dtype=np.int64) - (np.cumsum(sizes) - sizes),
                           sizes)
    sparse_shifts = np.array(shifts, dtype=np.int64)
    return _LayoutPlan(sparse_shifts if sparse_shifts.any() else None, sparse_tensors,
                       torch.from_numpy(positions))


def _flat_block(out: Mapping[str, torch.Tensor], offsets: Mapping[str, int],
                total: int) -> torch.Tensor | None:
    """One flat tensor over all of ``out`` if its buffers lie back to back in model order."""
    if not offsets:
        return None
    first = out[next(iter(offsets))]
    storage = first.untyped_storage()
    for name, offset in offsets.items():
        buf = out[name]
        if (buf.untyped_storage().data_ptr() != storage.data_ptr()
                or buf.data_ptr() != first.data_ptr() + 4 * offset):
            return None
    if storage.nbytes() < 4 * (first.storage_offset() + total):
        return None
    return first.new_empty(0).set_(storage, first.storage_offset(), (total,), (1,))


def _aggregate_packed(updates: Sequence[SparseUpdate], weights: Sequence[float],
                      shapes: Mapping[str, Sequence[int]], normalize: bool,
                      out: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """:func:`aggregate` of decoded updates, from their packed arrays (see its Notes)."""
    model_offsets, total_numel = _flat_offsets(shapes)
    # Decoded updates of one structure share their layout object: check and place it once.
    plans: dict[int, _LayoutPlan] = {}
    for i, u in enumerate(updates):
        layout = u.packed.layout
        if id(layout) not in plans:
            plans[id(layout)] = _plan(layout, i, shapes, model_offsets)
    total = float(sum(weights))
    if normalize and total <= 0:
        raise AggregationError("total weight is zero; nothing to average")
    scale = 1.0 / total if normalize else 1.0

    block = _flat_block(out, model_offsets, total_numel) if out is not None else None
    into_out = block is not None
    if block is None:
        device = next(iter(out.values())).device if out else torch.device("cpu")
        block = torch.zeros(total_numel, dtype=torch.float32, device=device)
    device = block.device
    # Indices and shapes were checked by decode against the layout, and the layout against the
    # model above: every position is inside its tensor's range of the block.
    dense_sums: dict[int, torch.Tensor] = {}  # per layout: its dense tensors' weighted sum
    for u, w in zip(updates, weights, strict=True):
        packed = u.packed
        key = id(packed.layout)
        plan = plans[key]
        factor = float(w) * scale
        if packed.sparse_indices.numel():
            indices = packed.sparse_indices.to(torch.int64)  # scatter_add_ takes int64 only
            if plan.sparse_shifts is not None:  # the update's tensor order is not the model's
                counts = [packed.counts[k] for k in plan.sparse_tensors]
                indices = indices + torch.from_numpy(np.repeat(plan.sparse_shifts, counts))
            indices = indices.to(device)
            # scatter_add_ of pre-scaled values: same sums as index_add_(alpha=...), about a
            # third faster on CPU (torch 2.x) for these scattered single-entry writes.
            values = packed.sparse_values.to(device, torch.float32, copy=True).mul_(factor)
            block.scatter_add_(0, indices, values)
        if packed.dense_values.numel():
            dense_sum = dense_sums.get(key)
            if dense_sum is None:
                dense_sum = dense_sums[key] = torch.zeros(packed.dense_values.numel(),
                                                         dtype=torch.float32, device=device)
            dense_sum.add_(packed.dense_values.to(device), alpha=factor)
    for key, dense_sum in dense_sums.items():
        block.scatter_add_(0, plans[key].dense_positions.to(device), dense_sum)

    views = {name: block[model_offsets[name]:model_offsets[name] + math.prod(s)].view(tuple(s))
             for name, s in shapes.items()}
    if out is None:
        return views
    if not into_out:  # out is not one block: add the sum in
        for name, view in views.items():
            out[name].add_(view)
    return {name: out[name] for name in shapes}
