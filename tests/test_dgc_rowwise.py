"""dgc.rowwise: top-k per output unit, its residual, restore, resume and state scaling."""

from __future__ import annotations

import math

import pytest
import torch

import dgc
from dgc.errors import StateError
from dgc.rowwise import RowwiseCompressor

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
        upd = dgc.decode(dgc.encode(comp.compress(g)), max_numel=dgc.wire.MAX_NUMEL)
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


def test_rowwise_scale_state_reaches_every_row():
    comp = _rowwise(momentum_correction=True, momentum=0.5)
    comp.compress(_rgrads(0))
    u = {k: t.clone() for k, t in comp.memory.u.items()}
    v = {k: t.clone() for k, t in comp.residual().items()}
    comp.scale_state(0.25)
    for k, t in u.items():
        torch.testing.assert_close(comp.memory.u[k], t * 0.25)
    for k, t in v.items():
        torch.testing.assert_close(comp.residual()[k], t * 0.25)


def test_rowwise_residual_is_live_so_the_sign_channel_can_take_from_it():
    comp = _rowwise()
    comp.compress(_rgrads(0))
    comp.residual()["w"][7] += 1.0  # what take_signs does, in place
    assert float(comp.memory.v["w#row0"][7]) == float(comp.residual()["w"][7])
    c = _rowwise()
    c.load_state_dict(comp.state_dict())
    c.residual()["w"].zero_()
    assert not c.memory.v["w#row3"].any()
