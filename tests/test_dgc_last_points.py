"""Issue 39's dgc switches: the top-k's budget shared out by the model's residual
(``dgc.budget``) and FetchSGD's server over the sets (``dgc.server_error``)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

import dgc
from android_bridge.export import check_phone_run
from dgc.errors import ConfigError
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


def test_the_budgets_count_small_tensors_at_their_own_density_in_the_total():
    grads = _grads({"a": 1.3, "b": 1.0, "c": 0.01})
    # per tensor: a and b are small (1000 each at 0.1), c large (200 at 0.01)
    model = dgc.DGCCompressor(_cfg(), budget="model", small_density=0.1,
                              small_numel=10_000).compress(grads)
    counts = {n: model.tensors[n].nnz for n in ("a", "b", "c")}
    assert sum(counts.values()) == 2200 and counts["c"] == 1  # c's residual is tiny
    energy = dgc.DGCCompressor(_cfg(), budget="energy", small_density=0.1,
                               small_numel=10_000).compress(grads)
    shares = {n: energy.tensors[n].nnz for n in ("a", "b", "c")}
    assert sum(shares.values()) <= 2200 and shares["c"] >= 1
    # in proportion to the squared norms: a's is 1.69 times b's
    assert abs(shares["a"] / shares["b"] - 1.69) < 0.1
    with pytest.raises(ConfigError, match="small_density must be in"):
        dgc.DGCCompressor(_cfg(), budget="model", small_density=2.0)


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
        check_phone_run(phone.method, phone.server)


# ----------------------------------------------------------------- dgc.feedback = own
def _own_run():
    return RunConfig.from_flat({"method": "dgc", "task": "digits", "density": 0.1,
                                "dgc.warmup": "none", "dgc.feedback": "own"})


def test_an_own_client_compresses_its_update_less_its_shift_and_keeps_what_it_sent():
    run = _own_run()
    method, train = run.method, run.train
    g = torch.Generator().manual_seed(3)
    first = {"w": torch.randn(30, 40, generator=g)}
    c = method.compressor(train, 0, None)
    method.prepare(train, c, {}, -1)
    sent = c.compress(first, sequence=1)
    assert torch.equal(c.shift["w"], sent.to_dense()["w"].reshape(-1).float())
    second = {"w": first["w"] + 0.1 * torch.randn(30, 40, generator=g)}
    again = method.compressor(train, 0, None)
    again.load_state_dict(c.state_dict())
    method.prepare(train, again, {}, 3)  # no residual carries over; the shift does
    assert float(again.residual()["w"].abs().sum()) == 0.0
    correction = again.compress(second, sequence=2).to_dense()["w"].reshape(-1).float()
    wanted = (second["w"].reshape(-1) - c.shift["w"])
    idx = torch.nonzero(correction).view(-1)
    torch.testing.assert_close(correction[idx], wanted[idx].half().float())
    torch.testing.assert_close(again.shift["w"], c.shift["w"] + correction)
    unsent = again.residual()["w"].clone()
    again.restore(SparseUpdateOf(correction))  # not aggregated: it leaves the shift again
    torch.testing.assert_close(again.shift["w"], c.shift["w"])
    assert torch.equal(again.residual()["w"], unsent)  # and goes into no residual


def SparseUpdateOf(flat: torch.Tensor):  # noqa: N802 - reads as the update it builds
    idx = torch.nonzero(flat).view(-1)
    return dgc.SparseUpdate({"w": dgc.SparseTensor(idx, flat[idx], (30, 40))}, 2)


def test_the_server_adds_the_mean_shift_and_takes_in_each_rounds_corrections():
    from fedgc.methods.shift import ShiftMemory

    memory = ShiftMemory(0.1)
    one = {"w": torch.ones(3)}
    assert torch.equal(memory.finish(one, {"w": (3,)})["w"], torch.ones(3))  # H was 0
    torch.testing.assert_close(memory.finish(one, {"w": (3,)})["w"], torch.full((3,), 1.1))
    state = memory.state_dict()
    bad = memory.finish({"w": torch.tensor([1.0, float("nan"), 0.0])}, {"w": (3,)})
    assert not bool(torch.isfinite(bad["w"]).all())
    torch.testing.assert_close(memory.mean_shift["w"], torch.full((3,), 0.2))  # unchanged
    resumed = ShiftMemory(0.1)
    resumed.load_state_dict(state)
    torch.testing.assert_close(resumed.mean_shift["w"], torch.full((3,), 0.2))
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        ShiftMemory(0.0)


def test_a_federation_with_own_shifts_learns_and_the_server_holds_their_mean(tmp_path):
    import csv

    from client.state import ClientStateStore
    from server.checkpoint import load_checkpoint
    from simulations.api import run

    # digits' 1,438 training images in 2 iid parts of 719: every reply weighs the same.
    result = run(config={"task": "digits", "num_clients": 2, "clients_per_round": 1,
                         "rounds": 8, "results_dir": str(tmp_path), "run_name": "own",
                         "progress": False, "partition": "iid", "checkpoint": True},
                 sim__engine="local", method="dgc_sets", dgc__feedback="own")
    assert result.summary["clients_rejected"] == 0
    assert all(r["clients_aggregated"] == 1 for r in result.rounds)
    assert result.summary["final_accuracy"] > 0.8
    rows = list(csv.DictReader((tmp_path / "own" / "clients.csv").open()))
    assert {r["num_examples"] for r in rows} == {"719"}
    # Every client's shift is what it sent; the server's memory is their mean, up to float32
    # sums in another order.
    store = ClientStateStore(tmp_path / "own" / "client_state")
    shifts = [store.load(str(k)).compressor["shift"] for k in range(2)]
    held = load_checkpoint(tmp_path / "own")["method"]["aggregator"]["mean_shift"]
    for name, mean in held.items():
        total = sum(s[name].view(mean.shape) for s in shifts) / 2
        assert float(total.abs().sum()) > 0
        torch.testing.assert_close(mean, total, atol=1e-6, rtol=1e-4)
