"""Issue 39's dgc switches: the top-k's budget shared out by the model's residual
(``dgc.budget``) and FetchSGD's server over the sets (``dgc.server_error``)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import dgc
from android_bridge.export import check_phone_run
from dgc.errors import ConfigError
from dgc.two_density import TwoDensityCompressor
from fedgc.methods.server_error import ErrorAccumulation
from fedgc.settings import RunConfig, SettingsError

SHAPES = {"a": (100, 100), "b": (50, 200), "c": (20, 1000), "bias": (100,)}


def _cfg() -> dgc.DGCConfig:
    return dgc.DGCConfig(density=0.01, selection="exact", warmup="none",
                         momentum_correction=False)


def _grads(scale: dict[str, float], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g) * scale.get(k, 1.0) for k, s in SHAPES.items()}


def test_the_model_budget_sends_the_same_total_shared_by_the_residual():
    grads = _grads({"a": 1.3, "b": 1.0, "c": 0.01})
    per_tensor = dgc.DGCCompressor(_cfg()).compress(grads)
    comp = dgc.DGCCompressor(_cfg(), budget="model")
    model = comp.compress(grads)
    sparse = ["a", "b", "c"]
    assert [per_tensor.tensors[n].nnz for n in sparse] == [100, 100, 200]
    counts = [model.tensors[n].nnz for n in sparse]
    assert sum(counts) == 400 and counts[0] > counts[1] > counts[2] == 1  # c: the floor
    assert model.tensors["bias"].is_dense
    # a's and b's entries are the largest of the two together: one top-k, not two.
    sent = torch.cat([model.tensors[n].values.float().abs() for n in ("a", "b")])
    left = torch.cat([comp.residual()[n].abs() for n in ("a", "b")])
    assert float(sent.min()) >= float(left.max()) * 0.999  # float16 values


def test_the_tensor_budget_is_the_default_bit_for_bit_and_bad_budgets_are_refused():
    grads = _grads({"a": 10.0})
    plain = dgc.DGCCompressor(_cfg()).compress(grads)
    named = dgc.DGCCompressor(_cfg(), budget="tensor").compress(grads)
    for n in SHAPES:
        assert torch.equal(plain.tensors[n].indices, named.tensors[n].indices)
    with pytest.raises(ConfigError, match="budget must be one of"):
        dgc.DGCCompressor(_cfg(), budget="layer")
    with pytest.raises(ConfigError, match="batched must be False or None"):
        dgc.DGCCompressor(_cfg(), batched=True, budget="model")


def test_two_densities_share_the_model_budget_among_the_large_tensors_only():
    comp = TwoDensityCompressor(_cfg(), small_density=0.1, small_numel=10_000,
                                budget="model")
    upd = comp.compress(_grads({"a": 3.0, "b": 1.0, "c": 0.01}))
    assert upd.tensors["a"].nnz == upd.tensors["b"].nnz == 1000  # small: 0.1 each, whatever
    assert upd.tensors["c"].nnz == 200  # the only large tensor: all of the budget
    again = TwoDensityCompressor(_cfg(), small_density=0.1, budget="model")
    again.load_state_dict(comp.state_dict())
    assert again.large.budget == "model"


def _model() -> OrderedDict[str, torch.Tensor]:
    return OrderedDict([("w", torch.zeros(4, 5)), ("b", torch.zeros(5))])


def test_the_server_applies_the_largest_of_its_error_and_keeps_the_rest():
    opt = ErrorAccumulation(1.0, 0.5, fraction=0.2)  # 5 of 25 entries a round
    avg = {"w": torch.arange(20.0).view(4, 5) / 10, "b": torch.full((5,), 0.05)}
    new = opt.step(_model(), avg)
    moved = torch.cat([new[k].reshape(-1) for k in new]) != 0
    assert int(moved.sum()) == 5
    assert torch.equal(new["w"].view(-1)[15:], -avg["w"].view(-1)[15:])  # the five largest
    assert bool((opt.error["w"].view(-1)[15:] == 0).all())  # masked where applied
    assert bool((opt.buffer["w"].view(-1)[15:] == 0).all())
    torch.testing.assert_close(opt.error["b"], avg["b"])  # the rest waits on the server
    second = opt.step(new, {k: torch.zeros_like(v) for k, v in avg.items()})
    # nothing new arrives: the momentum's half and the error keep moving the next largest
    assert bool((second["w"].view(-1)[10:15] < 0).all())
    state = opt.state_dict()
    resumed = ErrorAccumulation(1.0, 0.5, 0.2)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.error["b"], opt.error["b"])


def test_a_step_that_is_not_finite_changes_nothing():
    opt = ErrorAccumulation(1.0, 0.0, fraction=1.0)
    opt.step(_model(), {"w": torch.ones(4, 5), "b": torch.ones(5)})
    before = {k: v.clone() for k, v in opt.error.items()}
    bad = {"w": torch.full((4, 5), float("inf")), "b": torch.ones(5)}
    assert opt.step(_model(), bad) is None
    assert all(torch.equal(before[k], opt.error[k]) for k in before)
    with pytest.raises(ValueError, match=r"dgc.server_error must be in \(0, 1\]"):
        ErrorAccumulation(1.0, 0.0, 0.0)


def test_the_keys_are_checked_chosen_by_the_run_and_refused_on_phones():
    run = RunConfig.from_flat({"method": "dgc_sets", "dgc.server_error": 0.01,
                               "dgc.budget": "model"})
    assert isinstance(run.method.optimizer(run), ErrorAccumulation)
    assert RunConfig.from_flat({"method": "dgc"}).method.optimizer(
        RunConfig.from_flat({"method": "dgc"})) is None
    with pytest.raises(SettingsError, match="dgc.server_error keeps the error on the server"):
        RunConfig.from_flat({"method": "dgc", "dgc.server_error": 0.01,
                             "dgc.feedback": "aggregate"})
    with pytest.raises(SettingsError, match="dgc.budget"):
        RunConfig.from_flat({"dgc.budget": "layer"})
    phone = RunConfig.from_flat({"method": "dgc", "dgc.budget": "model"})
    with pytest.raises(ConfigError, match="dgc.budget='model'"):
        check_phone_run(phone.train, phone.server)
