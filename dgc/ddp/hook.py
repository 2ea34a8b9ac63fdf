"""dgc_hook: Deep Gradient Compression as a ``DistributedDataParallel`` communication hook.

No ``from __future__ import annotations`` here: DDP checks the hook's annotations at run time
(``bucket: dist.GradBucket``, returning ``torch.futures.Future[torch.Tensor]``).
"""

import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dgc import DGCConfig, DGCMemory, SparseTensor, SparseUpdate, StateError, decode, encode
from dgc.ddp.state import DGCState
from dgc.selection import num_selected, select_exact, select_sampled

_VALUE_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                 "bfloat16": torch.bfloat16}
_FP16_MAX = float(torch.finfo(torch.float16).max)
_INDEX_BYTES = 4  # int32 bucket offsets: a bucket never holds 2**31 entries


@dataclass(frozen=True)
class _View:
    """One parameter's gradient inside the flat bucket."""

    name: str
    start: int
    numel: int
    dense: bool


@dataclass(frozen=True)
class _Layout:
    """The parameters of one bucket in DDP's order, and where the dense ones sit."""

    views: tuple[_View, ...]
    numel: int
    dense_positions: torch.Tensor  # bucket offsets of every entry of a dense view, in order

    @property
    def dense_numel(self) -> int:
        return int(self.dense_positions.numel())


def dgc_hook(state: DGCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Exchange the top ``density`` of each layer's accumulated velocity, averaged over ranks.

    Per bucket and step (Lin et al., ICLR 2018, Algorithm 4):

    1. Local gradient clipping of the bucket's gradient to ``clip_norm * N ** -0.5``.
    2. Momentum correction per parameter: ``u = m*u + g; v = v + u`` (Nesterov: ``v += g + m*u``;
       without correction ``v += g``), in the state's memory.
    3. Selection per parameter view of the bucket (the paper's per-layer top-k) with
       :mod:`dgc.selection`, at the warm-up density of the current epoch; parameters with
       ``dim <= 1`` or under ``min_sparse_numel`` entries are sent whole.
    4. The selected values, rounded to ``value_dtype``, leave the residual; momentum factor
       masking zeroes ``u`` there (sparse views only).
    5. Exchange: an all-gather of every rank's selection (``state.exchange``) summed by
       scatter-add, or, where sparsity does not pay (``min_compression_rate``), an all-reduce of
       the same selection as a dense tensor. Either way the result is the mean over ranks.

    The optimizer must then run without momentum (the hook applies it). A rank whose local
    gradient holds NaN or Inf contributes nothing this step (counted in
    ``state.nonfinite_steps``) instead of raising, so that the other ranks do not wait forever in
    the exchange; its memory is left as it was.

    Example::

        >>> state = DGCState(None, model, DGCConfig(density=0.001), steps_per_epoch=len(loader))
        >>> ddp_model.register_comm_hook(state, dgc_hook)
        >>> optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1, momentum=0.0)
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    layout = _layout_of(state, bucket, group)
    config = state.config
    density = state.density()
    grad = buffer.detach().to(torch.float32).reshape(-1)
    finite = not config.check_finite or math.isfinite(float(grad.sum())) \
        or bool(torch.isfinite(grad).all())
    if not finite:
        state.nonfinite_steps += 1
    else:
        grad = _clipped(grad, config.clip_norm, world)
    dense_values, indices, values, padded, padded_values = _select(state, layout, grad, density,
                                                                   finite)
    state.dense_bytes += 4 * layout.numel
    if bucket.is_last():
        state.iter += 1

    value_bytes = torch.empty(0, dtype=values.dtype).element_size()
    pairs_bytes = _INDEX_BYTES * padded.numel() + value_bytes * (dense_values.numel()
                                                                  + padded.numel())
    rate = state.min_compression_rate if state.min_compression_rate is not None else world / 2
    # The choice depends only on sizes every rank computes alike (the padded count, not what
    # was selected), so every rank takes the same branch and meets the others in it.
    if 4 * layout.numel < rate * pairs_bytes:
        state.dense_buckets += 1
        state.payload_bytes += 4 * layout.numel
        sent = torch.zeros(layout.numel, dtype=torch.float32, device=buffer.device)
        sent[layout.dense_positions] = dense_values.to(torch.float32)
        sent[indices] = values.to(torch.float32)
        fut = dist.all_reduce(sent, group=group, async_op=True).get_future()
        return fut.then(lambda f: _as_bucket(f.value()[0].div_(world), buffer))
    state.sparse_buckets += 1
    if state.exchange == "golomb":
        return _exchange_golomb(state, layout, group, world, buffer, dense_values, indices,
                                values)
    payload = torch.cat([padded.to(torch.int32).view(torch.uint8),
                         dense_values.view(torch.uint8),
                         padded_values.view(torch.uint8)])
    state.payload_bytes += payload.numel()
    gathered = [torch.empty_like(payload) for _ in range(world)]
    fut = dist.all_gather(gathered, payload, group=group, async_op=True).get_future()
    k = padded.numel()
    dtype = values.dtype

    def unpack(_: torch.futures.Future) -> torch.Tensor:
        out = torch.zeros(layout.numel, dtype=torch.float32, device=buffer.device)
        for p in gathered:
            idx = p[: _INDEX_BYTES * k].view(torch.int32).to(torch.int64)
            vals = p[_INDEX_BYTES * k:].view(dtype).to(torch.float32)
            out[layout.dense_positions] += vals[: layout.dense_numel]
            out.index_add_(0, idx, vals[layout.dense_numel:])
        return _as_bucket(out.div_(world), buffer)

    return fut.then(unpack)


def _as_bucket(out: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    return out if out.dtype == buffer.dtype else out.to(buffer.dtype)


def _layout_of(state: DGCState, bucket: dist.GradBucket, group: dist.ProcessGroup) -> _Layout:
    """The bucket's layout, built and (once) checked against every rank's on first sight."""
    params = bucket.parameters()
    names = tuple(state.name_of(p) for p in params)
    key = (bucket.index(), names)
    layout = state.layouts.get(key)
    if layout is not None:
        return layout
    config = state.config
    views, start, dense = [], 0, []
    for name, p in zip(names, params, strict=True):
        n = p.numel()
        is_dense = config.sends_dense(tuple(p.shape))
        views.append(_View(name, start, n, is_dense))
        if is_dense:
            dense.append(torch.arange(start, start + n, dtype=torch.int64))
        start += n
    buffer = bucket.buffer()
    if start != buffer.numel():
        raise StateError(f"bucket {bucket.index()} holds {buffer.numel()} entries but its "
                         f"parameters {list(names)} hold {start}")
    positions = torch.cat(dense) if dense else torch.empty(0, dtype=torch.int64)
    layout = _Layout(tuple(views), start, positions.to(buffer.device))
    if state.verify_buckets:
        _verify_layout(bucket.index(), layout, _settings(state), group, buffer.device)
    state.layouts[key] = layout
    return layout


def _settings(state: DGCState) -> str:
    """The settings that decide what a rank sends and how: ranks that differ in them would
    exchange mismatched payloads (or wait in different collectives)."""
    return (f"{state.exchange}:{state.min_compression_rate}:{state.steps_per_epoch}:"
            f"{sorted(state.config.to_dict().items())}")


def _verify_layout(index: int, layout: _Layout, settings: str, group: dist.ProcessGroup,
                   device: torch.device) -> None:
    """Raise on every rank when any two ranks hold different buckets at ``index``, or differ in
    the settings that shape the exchange."""
    text = settings + "\n" + "\n".join(f"{v.name}:{v.numel}:{int(v.dense)}"
                                        for v in layout.views)
    mine = torch.tensor([index, layout.numel, zlib.crc32(text.encode())], dtype=torch.int64,
                        device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    rows = [tuple(int(x) for x in t.cpu()) for t in every]
    if len(set(rows)) != 1:
        raise StateError(f"bucket {index} differs between ranks (index, entries, crc32 of the "
                         f"parameter names, sizes and DGC settings per rank: {rows}); every rank "
                         f"must wrap the same model with the same bucket_cap_mb and DGCState")


def _clipped(grad: torch.Tensor, clip_norm: float | None, world: int) -> torch.Tensor:
    if clip_norm is None:
        return grad
    threshold = clip_norm / math.sqrt(world)
    norm = float(grad.double().norm())
    return grad * (threshold / norm) if norm > threshold else grad


def _select(state: DGCState, layout: _Layout, grad: torch.Tensor, density: float,
            finite: bool) -> tuple[torch.Tensor, ...]:
    """Accumulate, select and take out of the residual what this rank sends.

    Returns the dense views' values (in layout order, ``value_dtype``), the selected bucket
    offsets of the sparse views and their values, and the same two padded to the fixed count
    ``sum(k)`` that every rank computes alike (padding: a view's first offset with value 0,
    which the scatter-add ignores), so that an all-gather needs no size exchange.
    """
    config = state.config
    memory = state.memory
    dtype = _VALUE_DTYPES[config.value_dtype]
    dense_parts, idx_parts, val_parts, pad_parts, pad_val_parts = [], [], [], [], []
    device = grad.device
    for view in layout.views:
        k = view.numel if view.dense else num_selected(view.numel, density)
        if not finite:
            if view.dense:
                dense_parts.append(torch.zeros(view.numel, dtype=dtype, device=device))
            else:
                pad_parts.append(torch.full((k,), view.start, dtype=torch.int64, device=device))
                pad_val_parts.append(torch.zeros(k, dtype=dtype, device=device))
            continue
        _to_device(memory, view.name, device)
        v = memory.accumulate(view.name, grad[view.start: view.start + view.numel])
        if view.dense:
            local = torch.arange(view.numel, dtype=torch.int64, device=device)
        else:
            local = _top(v.abs(), k, density, config, state.iter)
        sent = _rounded(v[local], dtype)
        memory.mark_sent(view.name, local, sent, config.momentum_masking and not view.dense)
        if not config.error_feedback:
            memory.clear_residual(view.name)
        if view.dense:
            dense_parts.append(sent)
            continue
        offsets = local + view.start
        idx_parts.append(offsets)
        val_parts.append(sent)
        pad = torch.full((k,), view.start, dtype=torch.int64, device=device)
        pad[: offsets.numel()] = offsets
        pad_parts.append(pad)
        pad_val = torch.zeros(k, dtype=dtype, device=device)
        pad_val[: sent.numel()] = sent
        pad_val_parts.append(pad_val)
    empty_i = torch.empty(0, dtype=torch.int64, device=device)
    empty_v = torch.empty(0, dtype=dtype, device=device)
    return (torch.cat(dense_parts) if dense_parts else empty_v,
            torch.cat(idx_parts) if idx_parts else empty_i,
            torch.cat(val_parts) if val_parts else empty_v,
            torch.cat(pad_parts) if pad_parts else empty_i,
            torch.cat(pad_val_parts) if pad_val_parts else empty_v)


def _top(magnitude: torch.Tensor, k: int, density: float, config: DGCConfig,
         step: int) -> torch.Tensor:
    if k >= magnitude.numel():
        # select_exact's whole-tensor path builds its range on the CPU; this one stays on the
        # bucket's device.
        return torch.nonzero(magnitude > 0).view(-1)
    if config.selection == "exact":
        return select_exact(magnitude, k)
    return select_sampled(magnitude, k, density, config.sample_ratio, config.min_count_ratio,
                          config.max_adaptations, step)


def _rounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float16:
        values = values.clamp(-_FP16_MAX, _FP16_MAX)
    return values.to(dtype)


def _to_device(memory: DGCMemory, name: str, device: torch.device) -> None:
    """Move a parameter's loaded memory to the device its gradient lives on."""
    for part in (memory.u, memory.v):
        t = part.get(name)
        if t is not None and t.device != device:
            part[name] = t.to(device)


def _exchange_golomb(state: DGCState, layout: _Layout, group: dist.ProcessGroup, world: int,
                     buffer: torch.Tensor, dense_values: torch.Tensor, indices: torch.Tensor,
                     values: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """All-gather the fedgc wire bytes of every rank's selection (sizes first), scatter-add."""
    tensors, d = {}, 0
    cpu_idx, cpu_dense, cpu_vals = indices.cpu(), dense_values.cpu(), values.cpu()
    for i, view in enumerate(layout.views):
        if view.dense:
            tensors[str(i)] = SparseTensor(torch.arange(view.numel, dtype=torch.int64),
                                           cpu_dense[d: d + view.numel], (view.numel,))
            d += view.numel
            continue
        lo = int(torch.searchsorted(cpu_idx, view.start))
        hi = int(torch.searchsorted(cpu_idx, view.start + view.numel))
        tensors[str(i)] = SparseTensor(cpu_idx[lo:hi] - view.start, cpu_vals[lo:hi],
                                       (view.numel,))
    data = encode(SparseUpdate(tensors, state.iter), index_coding="auto")
    state.payload_bytes += len(data)
    size = torch.tensor([len(data)], dtype=torch.int64, device=buffer.device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(t) for t in sizes)
    payload = torch.zeros(longest, dtype=torch.uint8)
    payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    payload = payload.to(buffer.device)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    fut = dist.all_gather(gathered, payload, group=group, async_op=True).get_future()

    def unpack(_: torch.futures.Future) -> torch.Tensor:
        out = torch.zeros(layout.numel, dtype=torch.float32)
        for p, n in zip(gathered, sizes, strict=True):
            update = decode(p[: int(n)].cpu().numpy().tobytes(), max_numel=layout.numel)
            if set(update.tensors) != {str(i) for i in range(len(layout.views))}:
                raise StateError(f"a rank sent tensors {sorted(update.tensors)} for a bucket of "
                                 f"{len(layout.views)} parameters")
            for i, view in enumerate(layout.views):
                t = update.tensors[str(i)]
                if t.numel != view.numel:
                    raise StateError(f"a rank sent {t.numel} entries for {view.name!r}, which "
                                     f"has {view.numel}")
                out.index_add_(0, t.indices + view.start, t.values.to(torch.float32))
        return _as_bucket(out.div_(world).to(buffer.device), buffer)

    return fut.then(unpack)
