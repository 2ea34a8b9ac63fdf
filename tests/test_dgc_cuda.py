"""The dgc library on CUDA tensors: every compressor, the sign channel, the int8 grid, aggregate,
encode (one device-to-host copy) and the DDP hook on NCCL. The CUDA tests skip without CUDA; the
host-side pieces they rely on (packing an update for one copy) are tested here on the CPU."""

from __future__ import annotations

import datetime
import socket

import numpy as np
import pytest
import torch
from torch import nn

import dgc
from dgc import DGCCompressor, DGCConfig, RowwiseCompressor, SparseTensor, SparseUpdate
from dgc.int8_grid import round_initial
from dgc.signs import encode_signs, take_signs
from dgc.stc import STCCompressor, stc_config
from dgc.two_density import TwoDensityCompressor

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SHAPES = {"fc1.weight": (64, 300), "fc1.bias": (64,), "conv.weight": (8, 4, 5, 5),
          "fc2.weight": (10, 64), "fc2.bias": (10,)}


def _grads(step: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {n: torch.randn(s, generator=gen).to(device) for n, s in SHAPES.items()}


def _mixed_update() -> SparseUpdate:
    return SparseUpdate({
        "a": SparseTensor(torch.tensor([1, 5, 9]), torch.tensor([1.5, -2.0, 3.25],
                                                                dtype=torch.float16), (3, 4)),
        "b": SparseTensor(torch.arange(3), torch.tensor([0.1, 0.2, 0.3]), (3,)),
        "c": SparseTensor(torch.tensor([0]), torch.tensor([7.0], dtype=torch.bfloat16), (2,)),
        "d": SparseTensor(torch.empty(0, dtype=torch.int64), torch.empty(0), (5,)),
    }, sequence=4)


def _same(a: SparseUpdate, b: SparseUpdate) -> None:
    assert list(a.tensors) == list(b.tensors) and a.sequence == b.sequence
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert t.shape == u.shape and t.values.dtype == u.values.dtype
        assert torch.equal(t.indices.cpu(), u.indices.cpu()), name
        torch.testing.assert_close(t.values.cpu().float(), u.values.cpu().float(), rtol=1e-6,
                                   atol=1e-7)


def test_an_update_moves_in_one_packed_copy_and_keeps_every_dtype() -> None:
    update = _mixed_update()
    moved = update.moved("cpu", "cpu")
    _same(moved, update)
    storages = {p.untyped_storage().data_ptr() for t in moved.tensors.values()
                for p in (t.indices, t.values) if p.numel()}
    assert len(storages) == 1, "one buffer, one copy"
    assert update.cpu() is update  # already on the host: nothing to copy
    assert dgc.encode(moved) == dgc.encode(update)


@cuda
@pytest.mark.parametrize("make", [
    lambda: DGCCompressor(DGCConfig(density=0.01)),
    lambda: DGCCompressor(DGCConfig(density=0.01, selection="exact", nesterov=True)),
    lambda: TwoDensityCompressor(DGCConfig(density=0.002), 0.05, small_numel=1000),
    lambda: STCCompressor(stc_config(density=0.01)),
    lambda: RowwiseCompressor(DGCConfig(density=0.02, min_sparse_numel=64)),
], ids=["dgc", "dgc-exact", "two-density", "stc", "rowwise"])
def test_every_compressor_on_cuda_sends_what_it_sends_on_the_host(make) -> None:  # noqa: ANN001
    on_gpu, on_host = make(), make()
    for step in range(4):
        a = on_gpu.compress(_grads(step, "cuda"), epoch=step)
        b = on_host.compress(_grads(step), epoch=step)
        _same(a, b)
        assert dgc.encode(a, sign_coding=True) == dgc.encode(b, sign_coding=True)
        on_gpu.restore(a)  # a lost update goes back into the device residual
        on_host.restore(b)
    state = on_gpu.state_dict()
    again = make()
    again.load_state_dict(state)  # a host state continues on the device
    _same(again.compress(_grads(9, "cuda")), on_host.compress(_grads(9)))


@cuda
def test_encode_copies_a_cuda_update_to_the_host_once() -> None:
    update = DGCCompressor(DGCConfig(density=0.01)).compress(_grads(0, "cuda"))
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        data = dgc.encode(update)
    copies = [e for e in prof.events() if "DtoH" in e.name or "Device -> " in e.name]
    assert len(copies) == 1, [e.name for e in copies]
    assert data == dgc.encode(update.cpu())


@cuda
def test_aggregate_sums_on_the_device_of_its_buffers() -> None:
    comp = [DGCCompressor(DGCConfig(density=0.05)) for _ in range(3)]
    updates = [c.compress(_grads(i, "cuda")) for i, c in enumerate(comp)]
    shapes = {n: s for n, s in SHAPES.items()}
    on_host = dgc.aggregate([u.cpu() for u in updates], [1.0, 2.0, 3.0], shapes)
    on_gpu = dgc.aggregate(updates, [1.0, 2.0, 3.0], shapes)
    decoded = [dgc.decode(dgc.encode(u)) for u in updates]
    into = dgc.aggregate(decoded, [1.0, 2.0, 3.0], shapes,
                         out=dgc.aggregate_buffers(shapes, device="cuda"))
    for name in shapes:
        assert on_gpu[name].is_cuda and into[name].is_cuda
        torch.testing.assert_close(on_gpu[name].cpu(), on_host[name], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(into[name].cpu(), on_host[name], rtol=1e-3, atol=1e-3)


@cuda
def test_the_sign_channel_and_the_int8_grid_on_cuda() -> None:
    residual = {"w": torch.randn(1000, generator=torch.Generator().manual_seed(0))}
    masks = {"w": np.array([3, 10, 500, 999], dtype=np.int64)}
    on_gpu = {"w": residual["w"].cuda()}
    a, b = take_signs(on_gpu, masks, 1), take_signs(residual, masks, 1)
    assert encode_signs(a) == encode_signs(b)
    torch.testing.assert_close(on_gpu["w"].cpu(), residual["w"])
    model = {"w": torch.randn(30, 20), "b": torch.randn(20)}
    host = round_initial(model)
    device = round_initial({k: v.cuda() for k, v in model.items()})
    for k in model:
        assert torch.equal(device[k].cpu(), host[k])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@cuda
@pytest.mark.skipif(not torch.distributed.is_nccl_available(), reason="needs NCCL")
def test_the_ddp_hook_trains_on_nccl() -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from dgc.ddp import DGCState, dgc_hook

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 400), nn.ReLU(), nn.Linear(400, 3)).cuda()
        ref = DDP(nn.Sequential(nn.Linear(12, 400), nn.ReLU(), nn.Linear(400, 3)).cuda())
        ref.load_state_dict(model.state_dict())
        ddp = DDP(model)
        config = DGCConfig(density=1.0, momentum_masking=False, value_dtype="float32",
                           warmup="none", min_sparse_numel=64)
        state = DGCState(None, ddp, config, min_compression_rate=0.0)
        ddp.register_comm_hook(state, dgc_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.0)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        gen = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = torch.randn(8, 12, generator=gen).cuda()
            y = torch.randint(0, 3, (8,), generator=gen).cuda()
            for m, o in ((ddp, opt), (ref, ref_opt)):
                o.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
                o.step()
        for p, q in zip(ddp.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert state.sparse_buckets > 0
        assert all(t.is_cuda for t in state.residual().values())
    finally:
        dist.destroy_process_group()
