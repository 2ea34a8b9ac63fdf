"""dgc.two_density: a second density for small tensors, validation, restore, resume, scaling."""

from __future__ import annotations

import math

import pytest
import torch

import dgc
from dgc.errors import ConfigError, StateError
from dgc.two_density import TwoDensityCompressor

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
        upd = dgc.decode(dgc.encode(comp.compress(g)), max_numel=dgc.wire.MAX_NUMEL)
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


def test_two_density_scale_state_reaches_both_parts():
    comp = TwoDensityCompressor(_tcfg(momentum_correction=True, momentum=0.5), 0.1)
    comp.compress(_tgrads(0))
    parts = (comp.large, comp.small)
    u = {k: t.clone() for p in parts for k, t in p.memory.u.items()}
    v = {k: t.clone() for k, t in comp.residual().items()}
    assert set(u) == set(TSHAPES)
    comp.scale_state(0.5)
    for p in parts:
        for k, t in p.memory.u.items():
            torch.testing.assert_close(t, u[k] * 0.5)
    for k, t in comp.residual().items():
        torch.testing.assert_close(t, v[k] * 0.5)
    with pytest.raises(StateError, match="finite number >= 0"):
        comp.scale_state(-1.0)
