"""Tests of dgc.federated: stale client state by rounds missed, and server momentum."""

from __future__ import annotations

import math

import pytest
import torch

import dgc
from dgc.errors import ConfigError, StateError
from dgc.federated import (
    RowwiseCompressor,
    ServerMomentum,
    StaleStatePolicy,
    TwoDensityCompressor,
)

SHAPES = {"w": (64, 32), "b": (32,)}


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}


def _compressor(**kw) -> dgc.DGCCompressor:
    cfg = dict(density=0.05, selection="exact", warmup="none", min_sparse_numel=16)
    cfg.update(kw)
    comp = dgc.DGCCompressor(dgc.DGCConfig(**cfg))
    for s in range(3):
        comp.compress(_grads(s))
    return comp


def _snapshot(comp: dgc.DGCCompressor) -> dict[str, dict[str, torch.Tensor]]:
    return comp.memory.state_dict()


# ------------------------------------------------------------------------- StaleStatePolicy

def test_stale_momentum_decays_by_m_per_missed_round_and_keeps_residual():
    comp = _compressor(momentum=0.8)
    before = _snapshot(comp)
    assert any(u.abs().sum() > 0 for u in before["u"].values())
    StaleStatePolicy().apply(comp, 3)
    for name, u in before["u"].items():
        torch.testing.assert_close(comp.memory.u[name], u * 0.8 ** 3)
    for name, v in before["v"].items():
        assert torch.equal(comp.memory.v[name], v)  # no gradient mass is lost


def test_stale_policy_explicit_factors_reset_momentum_and_decay_residual():
    comp = _compressor(momentum=0.9, dampening=0.9, momentum_masking=False)
    before = _snapshot(comp)
    StaleStatePolicy(momentum_decay=0.0, residual_decay=0.5).apply(comp, 2)
    assert comp.memory.u == {}
    for name, v in before["v"].items():
        torch.testing.assert_close(comp.memory.v[name], v * 0.25)
    # The reset momentum restarts as a fresh compressor's: the whole gradient, not (1 - d) * g.
    g = _grads(7)
    comp.compress(g)
    fresh = _compressor(momentum=0.9, dampening=0.9, momentum_masking=False)
    fresh.memory.u.clear()
    fresh.compress(g)
    for name in g:
        torch.testing.assert_close(comp.memory.u[name], fresh.memory.u[name])


def test_stale_policy_zero_rounds_missed_changes_nothing():
    comp = _compressor()
    before = _snapshot(comp)
    StaleStatePolicy(momentum_decay=0.0, residual_decay=0.0).apply(comp, 0)
    after = _snapshot(comp)
    for part in ("u", "v"):
        for name, t in before[part].items():
            assert torch.equal(after[part][name], t)


def test_stale_policy_changes_what_is_sent_next():
    # A client that missed rounds sends less of its old momentum: the policy must reach the wire.
    fresh, aged = _compressor(), _compressor()
    StaleStatePolicy(momentum_decay=0.0).apply(aged, 5)
    g = _grads(99)
    a, b = fresh.compress(g).to_dense(), aged.compress(g).to_dense()
    assert not torch.equal(a["w"], b["w"])


@pytest.mark.parametrize("rounds", [-1, 1.5, True, "2"])
def test_stale_policy_rejects_bad_rounds_missed_and_changes_nothing(rounds):
    comp = _compressor()
    before = _snapshot(comp)
    with pytest.raises(StateError, match="rounds_missed"):
        StaleStatePolicy(momentum_decay=0.0).apply(comp, rounds)
    for name, u in before["u"].items():
        assert torch.equal(comp.memory.u[name], u)


@pytest.mark.parametrize("kw", [dict(momentum_decay=1.5), dict(momentum_decay=-0.1),
                                dict(residual_decay=2.0), dict(residual_decay=True),
                                dict(momentum_decay="0.5")])
def test_stale_policy_rejects_factors_outside_unit_interval(kw):
    name = next(iter(kw))
    with pytest.raises(ConfigError, match=name):
        StaleStatePolicy(**kw)


# ------------------------------------------------------------------------- ServerMomentum

def _params(seed: int = 0) -> dict[str, torch.Tensor]:
    return _grads(1000 + seed)


def test_server_plain_step_is_fedavg_model_averaging():
    params = _params()
    local = [{k: v - 0.1 * g for (k, v), g in zip(params.items(), _grads(s).values(),
                                                    strict=True)} for s in range(3)]
    weights = [1.0, 2.0, 5.0]
    fedavg = {k: sum(w * m[k] for w, m in zip(weights, local, strict=True)) / sum(weights)
              for k in params}
    updates = [dgc.SparseUpdate.from_dense({k: params[k] - m[k] for k in params})
               for m in local]
    agg = dgc.aggregate(updates, weights, SHAPES)
    ServerMomentum().step(params, agg)
    for k in params:
        torch.testing.assert_close(params[k], fedavg[k])


@pytest.mark.parametrize("nesterov", [False, True])
def test_server_momentum_matches_torch_sgd(nesterov):
    ours = _params()
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in ours.items()}
    opt = torch.optim.SGD(ref.values(), lr=0.3, momentum=0.9, nesterov=nesterov)
    server = ServerMomentum(lr=0.3, momentum=0.9, nesterov=nesterov)
    for s in range(5):
        g = _grads(s)
        server.step(ours, g)
        for k, p in ref.items():
            p.grad = g[k].clone()
        opt.step()
    for k in ours:
        torch.testing.assert_close(ours[k], ref[k].detach())


def test_server_momentum_resumes_exactly_from_state_dict():
    straight, resumed = _params(), _params()
    a = ServerMomentum(lr=0.5, momentum=0.9)
    for s in range(6):
        a.step(straight, _grads(s))
    b = ServerMomentum(lr=0.5, momentum=0.9)
    for s in range(3):
        b.step(resumed, _grads(s))
    c = ServerMomentum()
    c.load_state_dict(b.state_dict())
    for s in range(3, 6):
        c.step(resumed, _grads(s))
    for k in straight:
        assert torch.equal(straight[k], resumed[k])


@pytest.mark.parametrize("bad, match", [
    ({"w": torch.zeros(64, 32), "nope": torch.zeros(3)}, "'nope' is not a model parameter"),
    ({"w": torch.zeros(32, 64)}, r"shape \(32, 64\)"),
    ({"b": torch.full((32,), math.nan)}, "NaN or Inf"),
])
def test_server_rejects_bad_aggregate_and_changes_nothing(bad, match):
    params = _params()
    server = ServerMomentum(lr=0.5, momentum=0.9)
    server.step(params, _grads(0))
    before = {k: v.clone() for k, v in params.items()}
    buffer = {k: v.clone() for k, v in server.buffer.items()}
    with pytest.raises(StateError, match=match):
        server.step(params, {**_grads(1), **bad} if "w" not in bad else bad)
    for k in params:
        assert torch.equal(params[k], before[k])
        assert torch.equal(server.buffer[k], buffer[k])


@pytest.mark.parametrize("kw, match", [
    (dict(lr=0.0), "server lr"), (dict(lr=-1.0), "server lr"), (dict(lr=math.inf), "server lr"),
    (dict(momentum=1.0), "server momentum"), (dict(momentum=-0.5), "server momentum"),
    (dict(momentum=0.0, nesterov=True), "nesterov"),
])
def test_server_rejects_bad_settings(kw, match):
    with pytest.raises(ConfigError, match=match):
        ServerMomentum(**kw)


def test_server_load_rejects_malformed_state_and_keeps_its_own():
    server = ServerMomentum(lr=0.5, momentum=0.9)
    server.step(_params(), _grads(0))
    good = server.state_dict()
    for bad, match in [({k: v for k, v in good.items() if k != "buffer"}, "lacks"),
                       ({**good, "momentum": 1.2}, "server momentum"),
                       ({**good, "buffer": {"w": torch.full((2,), math.inf)}}, "finite")]:
        with pytest.raises((StateError, ConfigError), match=match):
            server.load_state_dict(bad)
        assert server.momentum == 0.9
        for k in good["buffer"]:
            assert torch.equal(server.buffer[k], good["buffer"][k])


# ------------------------------------------------------------------------- RowwiseCompressor

RSHAPES = {"w": (8, 50), "head": (3, 40), "b": (8,)}


def _rgrads(seed: int, big_row: int | None = None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {k: torch.randn(s, generator=g) for k, s in RSHAPES.items()}
    if big_row is not None:
        out["w"][big_row] *= 100.0
    return out


def _rowwise(**kw) -> RowwiseCompressor:
    cfg = dict(density=0.05, selection="exact", warmup="none", min_sparse_numel=100,
               momentum_correction=False)
    cfg.update(kw)
    return RowwiseCompressor(dgc.DGCConfig(**cfg))


def test_rowwise_sends_the_top_k_of_every_row_where_per_tensor_sends_one_row():
    g = _rgrads(0, big_row=2)
    upd = _rowwise().compress(g)
    w = upd.tensors["w"]
    assert w.shape == (8, 50)
    rows = w.indices // 50
    assert torch.equal(torch.bincount(rows, minlength=8), torch.full((8,), 3))  # ceil(0.05*50)
    for i in range(8):
        expected = torch.sort(torch.topk(g["w"][i].abs(), 3).indices).values + i * 50
        assert torch.equal(w.indices[rows == i], expected)
    # The plain compressor spends the whole budget of w on the one large row.
    plain = dgc.DGCCompressor(dgc.DGCConfig(density=0.05, selection="exact", warmup="none",
                                            min_sparse_numel=100, momentum_correction=False))
    assert set((plain.compress(g).tensors["w"].indices // 50).tolist()) == {2}
    # "head" (120 entries) is sparsified per row too; "b" is sent dense by the layer policy.
    assert upd.tensors["head"].nnz == 3 * 2
    assert upd.tensors["b"].is_dense


def test_rowwise_error_feedback_keeps_every_value_and_round_trips_the_wire():
    comp = _rowwise()
    total = {k: torch.zeros(s) for k, s in RSHAPES.items()}
    sent = {k: torch.zeros(s) for k, s in RSHAPES.items()}
    for s in range(4):
        g = _rgrads(s)
        upd = dgc.decode(dgc.encode(comp.compress(g)))
        for k in RSHAPES:
            total[k] += g[k]
            sent[k] += upd.tensors[k].to_dense()
    for k in ("w", "head"):
        torch.testing.assert_close(sent[k].reshape(-1) + comp.residual()[k], total[k].reshape(-1),
                                   atol=1e-5, rtol=1e-5)


def test_rowwise_restore_puts_a_dropped_update_back():
    comp = _rowwise()
    comp.compress(_rgrads(0))
    before = {k: v.clone() for k, v in comp.residual().items()}
    g = _rgrads(1)
    upd = comp.compress(g)
    comp.restore(upd)
    for k in RSHAPES:
        torch.testing.assert_close(comp.residual()[k], before[k] + g[k].reshape(-1),
                                   atol=1e-3, rtol=1e-3)


def test_rowwise_resumes_exactly_from_state_dict():
    a, b = _rowwise(momentum_correction=True), _rowwise(momentum_correction=True)
    for s in range(3):
        a.compress(_rgrads(s))
        b.compress(_rgrads(s))
    c = _rowwise(momentum_correction=True)
    c.load_state_dict(b.state_dict())
    for s in range(3, 5):
        ua, uc = a.compress(_rgrads(s)), c.compress(_rgrads(s))
        for k in RSHAPES:
            assert torch.equal(ua.tensors[k].indices, uc.tensors[k].indices)
            assert torch.equal(ua.tensors[k].values, uc.tensors[k].values)


def test_rowwise_rejects_bad_gradients_and_keeps_its_state():
    comp = _rowwise()
    comp.compress(_rgrads(0))
    before = {k: v.clone() for k, v in comp.residual().items()}
    bad = _rgrads(1)
    bad["w"][3, 7] = math.nan
    with pytest.raises(StateError):
        comp.compress(bad)
    with pytest.raises(StateError, match=r"shape \(4, 100\)"):
        comp.compress({**_rgrads(1), "w": torch.zeros(4, 100)})
    with pytest.raises(StateError, match="must not contain"):
        comp.compress({"x#row1": torch.zeros(8, 50)})
    for k, v in before.items():
        assert torch.equal(comp.residual()[k], v)


def test_rowwise_load_rejects_a_foreign_state_and_keeps_its_own():
    comp = _rowwise()
    comp.compress(_rgrads(0))
    before = {k: v.clone() for k, v in comp.residual().items()}
    with pytest.raises(StateError, match="not a RowwiseCompressor state"):
        comp.load_state_dict(dgc.DGCCompressor().state_dict())
    for k, v in before.items():
        assert torch.equal(comp.residual()[k], v)


def test_stale_policy_reaches_the_rows_of_a_rowwise_compressor():
    comp = _rowwise(momentum_correction=True, momentum=0.5)
    comp.compress(_rgrads(0))
    u = {k: t.clone() for k, t in comp.memory.u.items()}
    StaleStatePolicy().apply(comp, 2)
    for k, t in u.items():
        torch.testing.assert_close(comp.memory.u[k], t * 0.25)


# ------------------------------------------------------------------------- TwoDensityCompressor

TSHAPES = {"w": (100, 120), "head": (10, 200), "b": (10,)}


def _tgrads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) for k, s in TSHAPES.items()}


def _tcfg(**kw) -> dgc.DGCConfig:
    cfg = dict(density=0.001, selection="exact", warmup="none", momentum_correction=False)
    cfg.update(kw)
    return dgc.DGCConfig(**cfg)


def test_two_density_gives_small_tensors_their_own_budget():
    comp = TwoDensityCompressor(_tcfg(), small_density=0.1)
    g = _tgrads(0)
    upd = comp.compress(g)
    assert upd.tensors["w"].nnz == 12            # ceil(0.001 * 12,000)
    assert upd.tensors["head"].nnz == 200        # ceil(0.1 * 2,000), not 2
    assert upd.tensors["b"].is_dense
    # The large tensors are compressed exactly as a plain compressor would.
    plain = dgc.DGCCompressor(_tcfg()).compress({"w": g["w"]})
    assert torch.equal(upd.tensors["w"].indices, plain.tensors["w"].indices)
    assert torch.equal(upd.tensors["w"].values, plain.tensors["w"].values)
    assert list(upd.tensors) == list(g)


def test_two_density_keeps_every_value_and_round_trips_the_wire():
    comp = TwoDensityCompressor(_tcfg(), small_density=0.05)
    total = {k: torch.zeros(s).reshape(-1) for k, s in TSHAPES.items()}
    sent = {k: torch.zeros(s).reshape(-1) for k, s in TSHAPES.items()}
    for s in range(3):
        g = _tgrads(s)
        upd = dgc.decode(dgc.encode(comp.compress(g)))
        for k in TSHAPES:
            total[k] += g[k].reshape(-1)
            sent[k] += upd.tensors[k].to_dense().reshape(-1)
    for k in TSHAPES:
        torch.testing.assert_close(sent[k] + comp.residual()[k], total[k], atol=1e-3, rtol=1e-3)


def test_two_density_rejects_a_bad_gradient_before_either_part_changes():
    comp = TwoDensityCompressor(_tcfg(), small_density=0.1)
    comp.compress(_tgrads(0))
    before = {k: v.clone() for k, v in comp.residual().items()}
    steps = (comp.large.step, comp.small.step)
    bad = _tgrads(1)
    bad["head"][0, 0] = math.inf  # the small part, checked after the large one would have run
    with pytest.raises(StateError, match="'head' holds NaN or Inf"):
        comp.compress(bad)
    with pytest.raises(StateError, match=r"shape \(20, 100\)"):
        comp.compress({**_tgrads(1), "head": torch.zeros(20, 100)})
    assert (comp.large.step, comp.small.step) == steps
    for k, v in before.items():
        assert torch.equal(comp.residual()[k], v)


def test_two_density_restore_and_resume():
    a = TwoDensityCompressor(_tcfg(), small_density=0.1)
    a.compress(_tgrads(0))
    before = {k: v.clone() for k, v in a.residual().items()}
    g = _tgrads(1)
    a.restore(a.compress(g))
    for k in TSHAPES:
        torch.testing.assert_close(a.residual()[k], before[k] + g[k].reshape(-1),
                                   atol=1e-3, rtol=1e-3)
    b = TwoDensityCompressor(_tcfg(), small_density=0.1)
    b.load_state_dict(a.state_dict())
    ua, ub = a.compress(_tgrads(2)), b.compress(_tgrads(2))
    for k in TSHAPES:
        assert torch.equal(ua.tensors[k].indices, ub.tensors[k].indices)
        assert torch.equal(ua.tensors[k].values, ub.tensors[k].values)
    with pytest.raises(StateError, match="not a TwoDensityCompressor state"):
        b.load_state_dict(dgc.DGCCompressor().state_dict())
    with pytest.raises(StateError, match="not held"):
        b.restore(dgc.SparseUpdate.from_dense({"other": torch.zeros(3)}))


@pytest.mark.parametrize("kw, match", [(dict(small_density=0.0), "small_density"),
                                       (dict(small_density=1.5), "small_density"),
                                       (dict(small_density=True), "small_density"),
                                       (dict(small_density=0.1, small_numel=0), "small_numel")])
def test_two_density_rejects_bad_settings(kw, match):
    with pytest.raises(ConfigError, match=match):
        TwoDensityCompressor(_tcfg(), **kw)


def test_stale_policy_reaches_both_parts_of_a_two_density_compressor():
    comp = TwoDensityCompressor(_tcfg(momentum_correction=True, momentum=0.5), 0.1)
    comp.compress(_tgrads(0))
    u = {k: t.clone() for p in comp.parts for k, t in p.memory.u.items()}
    assert set(u) == set(TSHAPES)
    StaleStatePolicy().apply(comp, 1)
    for p in comp.parts:
        for k, t in p.memory.u.items():
            torch.testing.assert_close(t, u[k] * 0.5)
