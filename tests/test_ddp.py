"""dgc.ddp: the DGC communication hook on two gloo processes (127.0.0.1), and its state."""

from __future__ import annotations

import copy
import datetime
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dgc import ConfigError, DGCConfig, StateError
from dgc.ddp import DGCState, dgc_hook

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args) -> None:
    mp.spawn(fn, args=(_free_port(), *args), nprocs=WORLD, join=True)


def _init(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    # A short timeout turns a rank stuck in a collective into a failure instead of a hang.
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 40), nn.ReLU(), nn.Linear(40, 30), nn.ReLU(),
                                  nn.Linear(30, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class _Linear(nn.Module):
    """Loss ``(w * x).sum() + (b * x[0]).sum()``: the gradient is the input, whatever w is."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(16, 64))
        self.b = nn.Parameter(torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum() + (self.b * x[0]).sum()


def _config(**kw: object) -> DGCConfig:
    base = dict(warmup="none", min_sparse_numel=64)
    base.update(kw)
    return DGCConfig(**base)


def _equivalence(rank: int, port: int) -> None:
    _init(rank, port)
    torch.manual_seed(0)
    model = _Net()
    ref = DDP(copy.deepcopy(model))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    variants = []
    config = _config(density=1.0, momentum_masking=False, value_dtype="float32")
    for exchange, rate in (("pairs", 0.0), ("golomb", 0.0), ("pairs", 1e9)):
        m = DDP(copy.deepcopy(model))
        state = DGCState(None, m, config, exchange=exchange, min_compression_rate=rate)
        m.register_comm_hook(state, dgc_hook)
        variants.append((m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.0), state))
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        x, y = torch.randn(8, 12, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        for m, opt in [(ref, ref_opt)] + [(m, o) for m, o, _ in variants]:
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    for m, _, _state in variants:
        for p, q in zip(m.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert variants[0][2].sparse_buckets > 0 and variants[0][2].dense_buckets == 0
    assert variants[2][2].dense_buckets > 0 and variants[2][2].sparse_buckets == 0
    dist.destroy_process_group()


@pytest.mark.slow
def test_density_one_without_masking_equals_ddp_with_momentum_sgd() -> None:
    _spawn(_equivalence)


def _conservation(rank: int, port: int) -> None:
    _init(rank, port)
    gen = torch.Generator().manual_seed(7 + rank)
    for exchange in ("pairs", "golomb"):
        module = _Linear()
        start = [p.detach().clone() for p in module.parameters()]
        m = DDP(module)
        state = DGCState(None, m, _config(density=0.02, momentum_correction=False,
                                          value_dtype="float16"),
                         exchange=exchange, min_compression_rate=0.0)
        m.register_comm_hook(state, dgc_hook)
        opt = torch.optim.SGD(m.parameters(), lr=1.0, momentum=0.0)
        fed = torch.zeros(16, 64, dtype=torch.float64)
        for _ in range(7):
            x = torch.randn(16, 64, generator=gen)
            fed += x.double()
            opt.zero_grad()
            m(x).backward()
            opt.step()
        # The sum over ranks of everything fed in equals N times the applied mean plus what
        # every rank still holds in its residual.
        applied = (start[0] - module.w.detach()).double() * WORLD
        held = state.residual()["w"].double().view(16, 64)
        dist.all_reduce(fed)
        dist.all_reduce(held)
        torch.testing.assert_close(applied + held, fed, rtol=0, atol=1e-4)
        assert 0 < float(applied.abs().sum()) and 0 < float(held.abs().sum())
        applied_b = (start[1] - module.b.detach()).double() * WORLD
        held_b = state.residual()["b"].double()
        dist.all_reduce(held_b)
        fed_b = fed[0].clone()
        torch.testing.assert_close(applied_b + held_b, fed_b, rtol=0, atol=1e-4)
        assert state.compression_ratio() > 1
        # The state round-trips: a fresh state loaded from it continues identically.
        again = DGCState(None, m, state.config, exchange=exchange, min_compression_rate=0.0)
        again.load_state_dict(state.state_dict())
        saved, loaded = state.state_dict(), again.state_dict()
        assert loaded["iter"] == saved["iter"] == 7
        for part in ("u", "v"):
            assert saved[part].keys() == loaded[part].keys()
            for k in saved[part]:
                assert torch.equal(saved[part][k], loaded[part][k])
    dist.destroy_process_group()


@pytest.mark.slow
def test_mass_is_conserved_across_steps_and_ranks() -> None:
    _spawn(_conservation)


def _buckets_and_empty(rank: int, port: int) -> None:
    _init(rank, port)
    torch.manual_seed(0)
    for exchange in ("pairs", "golomb"):
        model = _Net()
        # A tiny bucket cap gives several buckets.
        m = DDP(model, bucket_cap_mb=0.002)
        state = DGCState(None, m, _config(density=0.05), exchange=exchange,
                         min_compression_rate=0.0)
        m.register_comm_hook(state, dgc_hook)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.0)
        before = [p.detach().clone() for p in model.parameters()]
        for step in range(4):
            # Rank 0's input is all zeros, so its gradient of the first layer and of the
            # later ones (through ReLU(bias)) may select nothing; rank 1's never is.
            scale = 0.0 if rank == 0 else 1.0
            x = torch.randn(4, 12) * scale
            opt.zero_grad()
            (m(x).sum() * scale).backward()
            opt.step()
            assert state.iter == step + 1
        layouts = sorted((i, names) for i, names in state.layouts)
        every: list[object] = [None] * WORLD
        dist.all_gather_object(every, layouts)
        assert every[0] == every[1]
        assert len({i for i, _ in layouts}) >= 2, layouts
        assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before,
                                                          strict=True))
    # Ranks whose settings differ are told so on every rank, before any payload is exchanged.
    m = DDP(_Net())
    exchange = "pairs" if rank == 0 else "golomb"
    m.register_comm_hook(DGCState(None, m, _config(), exchange=exchange), dgc_hook)
    with pytest.raises(Exception, match="differs between ranks"):
        m(torch.randn(4, 12)).sum().backward()
    dist.destroy_process_group()


@pytest.mark.slow
def test_buckets_agree_across_ranks_and_an_empty_selection_does_not_hang() -> None:
    _spawn(_buckets_and_empty)


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"config": DGCConfig(warmup="none", density=1e-3), "exchange": "zip"}, "exchange"),
    ({"config": DGCConfig()}, "steps_per_epoch"),
    ({"config": DGCConfig(), "steps_per_epoch": 0}, "steps_per_epoch"),
    ({"config": DGCConfig(warmup="none"), "min_compression_rate": -1.0},
     "min_compression_rate"),
    ({"config": DGCConfig(warmup="none", ternary=True)}, "ternary"),
    ({"config": {"density": 0.01}}, "config"),
])
def test_a_bad_configuration_raises_before_training_naming_the_key(kwargs: dict,
                                                                   key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        DGCState(None, _Net(), **kwargs)


def test_a_bad_config_field_is_named() -> None:
    with pytest.raises(ConfigError, match="density"):
        DGCState(None, _Net(), DGCConfig(density=0.0, warmup="none"))


def test_a_bad_state_is_refused_and_changes_nothing() -> None:
    model = _Linear()
    state = DGCState(None, model, _config())
    good = {"version": 1, "iter": 3, "config": state.config.to_dict(),
            "u": {"w": torch.ones(16 * 64)}, "v": {"w": torch.full((16 * 64,), 2.0)}}
    state.load_state_dict(good)
    for bad, what in (
        ({**good, "v": {"w": torch.ones(5)}}, "1024 entries"),
        ({**good, "v": {"nope": torch.ones(3)}}, "nope"),
        ({**good, "u": {"w": torch.full((16 * 64,), float("nan"))}}, "NaN"),
        ({**good, "iter": -1}, "iter"),
    ):
        with pytest.raises(StateError, match=what):
            state.load_state_dict(bad)
        assert state.iter == 3 and torch.equal(state.residual()["w"], good["v"]["w"])
