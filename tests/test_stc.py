"""Sparse ternary compression: the client's compressor (dgc.stc), its wire bytes, and the
server's ternary broadcast (server.downlink, downlink_values = "ternary")."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch

import dgc
from dgc.stc import STC_DENSITY, STCCompressor, stc_config
from fedgc import protocol as P
from fedgc.methods import get
from fedgc.settings import RunConfig
from server.downlink import Downlink, copy_model


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(30, 40, generator=g), "b": torch.randn(40, generator=g)}


def test_the_settings_build_stc_as_its_paper_has_it():
    """method = stc: exact top-k at its density (1/400 by default), ternary, error feedback, no
    momentum, masking, clipping or warm-up; every tensor sparsified."""
    comp = get("stc").compressor(RunConfig.from_flat({"method": "stc"}).train, 0)
    assert isinstance(comp, STCCompressor)
    c = comp.config
    assert c.density == STC_DENSITY == 0.0025 and c.selection == "exact" and c.ternary
    assert c.error_feedback and c.momentum == 0 and not c.momentum_correction
    assert not c.momentum_masking and c.clip_norm is None and c.density_at(0.0) == c.density
    assert not comp.is_dense_tensor((10,)) and not comp.is_dense_tensor((2, 2))
    assert get("stc").compressor(RunConfig.from_flat({"method": "stc", "density": 0.01}).train,
                                 0).config.density == 0.01


def test_sent_values_are_plus_or_minus_the_mean_of_the_kept_magnitudes():
    comp = STCCompressor(stc_config(density=0.05))
    grads = _grads(0)
    update = comp.compress(grads)
    for name, g in grads.items():
        t = update.tensors[name]
        acc = g.reshape(-1)  # the residual starts at zero
        k = math.ceil(0.05 * acc.numel())
        assert t.nnz == k  # 60 of the matrix, 2 of the bias (STC sparsifies 1-D tensors too)
        top = torch.topk(acc.abs(), k).indices.sort().values
        assert torch.equal(t.indices, top)
        mu = acc[top].abs().mean(dtype=torch.float64).to(torch.float16)
        assert t.values.dtype == torch.float16
        assert torch.equal(t.values.abs(), mu.expand(k))
        assert torch.equal(t.values.sign(), acc[top].sign().to(torch.float16))


def test_mass_is_conserved_sent_plus_residual_is_what_was_accumulated():
    comp = STCCompressor(stc_config(density=0.05))
    total = {k: torch.zeros(v.numel(), dtype=torch.float64) for k, v in _grads(0).items()}
    sent = {k: torch.zeros_like(v) for k, v in total.items()}
    updates = []
    for step in range(5):
        grads = _grads(step)
        update = comp.compress(grads)
        updates.append(update)
        for name, g in grads.items():
            total[name] += g.reshape(-1).double()
            t = update.tensors[name]
            sent[name].index_add_(0, t.indices, t.values.double())
    residual = comp.residual()
    for name in total:
        assert torch.allclose(sent[name] + residual[name].double(), total[name], atol=1e-5)
    # An update the server never aggregated goes back whole into the residual.
    before = {k: v.clone() for k, v in residual.items()}
    comp.restore(updates[-1])
    for name, t in updates[-1].tensors.items():
        back = before[name].clone()
        back[t.indices] += t.values.to(torch.float32)
        assert torch.equal(comp.residual()[name], back)


def test_wire_bytes_of_a_ternary_update_match_a_hand_count():
    """Four kept entries of a 10x40 tensor: Golomb-Rice positions, one sign bit each, one mu."""
    g = torch.zeros(10, 40)
    flat = g.view(-1)
    flat[[3, 50, 51, 300]] = torch.tensor([1.0, -2.0, 3.0, -4.0])
    update = STCCompressor(stc_config(density=0.01)).compress({"w": g})  # k = 4
    t = update.tensors["w"]
    assert t.indices.tolist() == [3, 50, 51, 300]
    assert t.values.tolist() == [2.5, -2.5, 2.5, -2.5]  # mu = mean(1, 2, 3, 4)
    data = dgc.encode(update, sign_coding=True)
    # Gaps 3, 46, 0, 248. Rice parameter b = 6 (4 * 7 bits + quotients 0+0+0+3 = 31 bits, the
    # least; b = 5 costs 32, b = 7 33): the b byte, ceil(4 * 6 / 8) = 3 bytes of remainders,
    # ceil((4 + 3) / 8) = 1 byte of unary quotients.
    index_bytes = 1 + 3 + 1
    value_bytes = 2 + 1  # mu as float16, four sign bits in one byte
    header = 2 + len("w") + 1 + 2 * 8 + (8 + 1 + 1 + 8)  # name, ndim, dims, count/codings/size
    message = 4 + 1 + 1 + 8 + 4 + 4  # magic, version, flags, sequence, tensor count, CRC
    assert len(data) == message + header + index_bytes + value_bytes == 68
    assert dgc.wire.encoded_size(update, sign_coding=True) == 68
    back = dgc.decode(data, max_numel=400).tensors["w"]
    assert torch.equal(back.indices, t.indices) and torch.equal(back.values, t.values)
    # Without the sign coding the four values take 8 bytes instead of 3.
    assert len(dgc.encode(update)) == 68 - 3 + 8


def test_ternary_broadcast_keeps_on_the_server_what_it_did_not_send():
    """Each version moves ceil(p * numel) entries of every tensor by +-mu, mu the mean of their
    differences; the rest of global - broadcast (the server's residual) is kept exactly. A
    patch on the version before adds the step (sign-coded), one on several versions carries
    values; both rebuild the broadcast bit for bit."""
    g = torch.Generator().manual_seed(1)
    model = OrderedDict(w=torch.randn(20, 30, generator=g), b=torch.randn(30, generator=g))
    down = Downlink("auto", history=3, density=0.05, values="ternary")
    down.reset(copy_model(model))
    versions = [copy_model(down.sent_model)]
    for _ in range(3):
        model = OrderedDict((k, v - 0.1 * torch.randn(v.shape, generator=g))
                            for k, v in model.items())
        before = copy_model(down.sent_model)
        down.advance(model, model)
        step_version, step = down.ternary_step
        assert step_version == down.version
        for name, target in model.items():
            diff = (target - before[name]).view(-1)
            idx, delta = step[name]
            k = math.ceil(0.05 * diff.numel())
            assert torch.equal(idx, torch.topk(diff.abs(), k).indices.sort().values)
            mu = diff[idx].abs().mean(dtype=torch.float64).to(torch.float32)
            assert torch.equal(delta.abs(), mu.expand(k))
            assert torch.equal(delta.sign(), diff[idx].sign())
            residual = (target - down.sent_model[name]).view(-1)
            rest = torch.ones(diff.numel(), dtype=torch.bool)
            rest[idx] = False
            assert torch.equal(residual[rest], diff[rest])  # not sent: kept whole
            assert torch.allclose(residual[idx], diff[idx] - delta, atol=1e-6)
        assert down.model is model  # the server still aggregates into the exact model
        versions.append(copy_model(down.sent_model))
    data, added = down.patch((down.version - 1,))
    assert sorted(added) == ["b", "w"]
    rebuilt = P.apply_patch(versions[-2], data, added)
    assert all(torch.equal(rebuilt[k], down.sent_model[k]) for k in model)
    assert all(t.nnz == len(step[n][0]) for n, t in
               dgc.decode(data, max_numel=600).tensors.items())
    wide, added_wide = down.patch((down.version - 2, down.version - 1))
    assert added_wide == [] and len(wide) > len(data)
    for base in versions[-3:-1]:
        rebuilt = P.apply_patch(base, wide)
        assert all(torch.equal(rebuilt[k], down.sent_model[k]) for k in model)


@pytest.mark.parametrize("method, default, given", [
    ("dense", (1.0, "int8"), (1.0, "float16")), ("fedavgm", (1.0, "int8"), (1.0, "float16")),
    ("topk", (0.05, "int8"), (0.3, "float16")), ("stc", (0.0025, "ternary"), (0.3, "float16")),
    ("dgc", (0.05, "int8"), (0.3, "float16"))])
def test_each_method_gets_its_downlink(method, default, given):
    """The dense family always broadcasts the exact model; stc its ternary broadcast at 1/400
    by default; a downlink_density or downlink_values given applies to the others."""
    from server.strategy import DGCStrategy

    for keys, want in (({}, default), ({"downlink_density": 0.3, "downlink_values": "float16"},
                                       given)):
        s = DGCStrategy(RunConfig.from_flat({"method": method, **keys}))
        assert (s.downlink.density, s.downlink.values) == want


@pytest.mark.parametrize("density", [0.0, 1.5])
def test_stc_densities_out_of_range_are_named(density):
    from fedgc.settings import SettingsError

    for key in ("density", "downlink_density"):
        with pytest.raises(SettingsError, match=rf"{key}.*\(0, 1\]"):
            RunConfig.from_flat({"method": "stc", key: density})
