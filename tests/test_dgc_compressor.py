"""Tests of DGCCompressor: SGD equivalence, mass conservation, clipping, layer policy, state."""

from __future__ import annotations

import dataclasses
import io
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgc.compressor import DGCCompressor
from dgc.config import DGCConfig
from dgc.errors import StateError
from dgc.selection import num_selected
from dgc.sparse import SparseTensor, SparseUpdate

torch.set_num_threads(1)

# A 2-D layer large enough to be sparsified, a bias and a small conv kernel (both sent dense).
SHAPES: dict[str, tuple[int, ...]] = {"fc.weight": (40, 64), "fc.bias": (40,),
                                      "conv.weight": (4, 3, 3, 3)}


def _grads(seed: int, shapes: dict[str, tuple[int, ...]] = SHAPES,
           scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) * scale for n, s in shapes.items()}


def _dense_config(**kw: object) -> DGCConfig:
    base = dict(density=1.0, warmup="none", momentum_masking=False, value_dtype="float32",
                selection="exact")
    base.update(kw)
    return DGCConfig(**base)


def _run_sgd(steps: list[dict[str, torch.Tensor]], lr: float,
             **sgd_kw: object) -> dict[str, torch.Tensor]:
    params = {n: torch.nn.Parameter(torch.ones(s)) for n, s in SHAPES.items()}
    opt = torch.optim.SGD(list(params.values()), lr=lr, foreach=False, **sgd_kw)
    for grads in steps:
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


def _run_dgc(steps: list[dict[str, torch.Tensor]], lr: float,
             config: DGCConfig) -> dict[str, torch.Tensor]:
    params = {n: torch.ones(s) for n, s in SHAPES.items()}
    comp = DGCCompressor(config)
    for grads in steps:
        sent = comp.compress(grads).to_dense()
        for n, p in params.items():
            p.add_(sent[n], alpha=-lr)  # the same operation SGD applies to its step
    return params


@pytest.mark.parametrize(
    ("dgc_kw", "sgd_kw"),
    [
        (dict(momentum=0.9), dict(momentum=0.9)),
        (dict(momentum=0.9, nesterov=True), dict(momentum=0.9, nesterov=True)),
        (dict(momentum=0.9, dampening=0.9), dict(momentum=0.9, dampening=0.9)),
        (dict(momentum=0.7, dampening=0.3), dict(momentum=0.7, dampening=0.3)),
        (dict(momentum_correction=False, momentum=0.9), dict()),
    ],
    ids=["momentum", "nesterov", "dampening=momentum", "dampening", "no-correction"],
)
def test_density_one_reproduces_sgd_bit_for_bit(dgc_kw: dict, sgd_kw: dict) -> None:
    steps = [_grads(seed) for seed in range(6)]
    expected = _run_sgd(steps, lr=0.1, **sgd_kw)
    got = _run_dgc(steps, lr=0.1, config=_dense_config(**dgc_kw))
    for n in SHAPES:
        assert torch.equal(got[n], expected[n]), n


def test_density_one_with_masking_is_not_momentum_sgd() -> None:
    # Guard against the SGD test passing for a compressor that ignores momentum: masking at
    # density 1 clears the momentum every step, so the sparsified layer follows plain SGD.
    steps = [_grads(seed) for seed in range(4)]
    got = _run_dgc(steps, 0.1, _dense_config(momentum=0.9, momentum_masking=True))
    plain = _run_sgd(steps, 0.1)
    momentum = _run_sgd(steps, 0.1, momentum=0.9)
    assert torch.allclose(got["fc.weight"], plain["fc.weight"], atol=1e-6)
    assert not torch.allclose(got["fc.weight"], momentum["fc.weight"], atol=1e-3)
    # Dense layers are never masked: they keep ordinary momentum.
    assert torch.equal(got["fc.bias"], momentum["fc.bias"])


class _Reference:
    """An independent float64 model of the u/v recursion, fed with what the compressor sent."""

    def __init__(self, config: DGCConfig) -> None:
        self.c = config
        self.u: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.accumulated: dict[str, torch.Tensor] = {}
        self.sent: dict[str, torch.Tensor] = {}
        self.dropped: dict[str, torch.Tensor] = {}  # unsent mass, without error feedback

    def step(self, grads: dict[str, torch.Tensor], update: SparseUpdate) -> None:
        c = self.c
        g64 = {n: g.double().reshape(-1) for n, g in grads.items()}
        if c.clip_norm is not None:
            total = math.sqrt(sum(float((g * g).sum()) for g in g64.values()))
            threshold = c.clip_norm / math.sqrt(c.num_workers)
            if total > threshold:
                g64 = {n: g * (threshold / total) for n, g in g64.items()}
        for n, g in g64.items():
            if c.momentum_correction:
                if n not in self.u:
                    self.u[n] = g.clone()
                else:
                    self.u[n] = c.momentum * self.u[n] + (1 - c.dampening) * g
                inc = g + c.momentum * self.u[n] if c.nesterov else self.u[n].clone()
            else:
                inc = g
            self.v[n] = self.v.get(n, torch.zeros_like(g)) + inc
            self.accumulated[n] = self.accumulated.get(n, torch.zeros_like(g)) + inc
            t = update.tensors[n]
            sent = t.to_dense(torch.float64).reshape(-1)
            self.sent[n] = self.sent.get(n, torch.zeros_like(g)) + sent
            self.v[n] -= sent
            self.dropped.setdefault(n, torch.zeros_like(g))
            if not c.error_feedback:
                self.dropped[n] += self.v[n]
                self.v[n].zero_()
            dense_layer = len(grads[n].shape) <= 1 or grads[n].numel() < c.min_sparse_numel
            if c.momentum_correction and c.momentum_masking and not dense_layer:
                self.u[n][t.indices] = 0.0


def _check_against_reference(comp: DGCCompressor, ref: _Reference) -> None:
    for n, acc in ref.accumulated.items():
        residual = comp.memory.v[n].double()
        scale = float(acc.abs().max()) + 1.0
        # Mass conservation: everything sent plus the residual is everything accumulated (less
        # what was dropped on purpose when error feedback is off).
        torch.testing.assert_close(ref.sent[n] + residual + ref.dropped[n], acc, rtol=0,
                                   atol=2e-6 * scale)
        torch.testing.assert_close(residual, ref.v[n], rtol=0, atol=2e-6 * scale)
        if n in ref.u:
            torch.testing.assert_close(comp.memory.u[n].double(), ref.u[n], rtol=0,
                                       atol=2e-6 * (float(ref.u[n].abs().max()) + 1.0))


def _run_with_reference(config: DGCConfig, steps: int, seed: int,
                        steps_per_epoch: int = 2) -> tuple[DGCCompressor, _Reference]:
    comp = DGCCompressor(config)
    ref = _Reference(config)
    for i in range(steps):
        grads = _grads(seed * 1000 + i, scale=3.0)
        update = comp.compress(grads, epoch=i / steps_per_epoch)
        ref.step(grads, update)
    return comp, ref


@pytest.mark.parametrize("value_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("selection", ["exact", "sampled"])
def test_mass_conservation_default_methods(value_dtype: str, selection: str) -> None:
    config = DGCConfig(density=0.01, selection=selection, value_dtype=value_dtype)
    comp, ref = _run_with_reference(config, steps=12, seed=1)
    _check_against_reference(comp, ref)
    # The warm-up was followed: epoch 0 sent (about, when sampled) a quarter of the layer.
    first = DGCCompressor(config).compress(_grads(1000, scale=3.0), epoch=0.0)
    nnz, k = first.tensors["fc.weight"].nnz, num_selected(2560, 0.25)
    assert (nnz == k) if selection == "exact" else (k // 2 <= nnz <= k)


def test_rounding_error_stays_in_the_residual() -> None:
    # One step: v is the gradient, so the residual at the sent entries is exactly the fp16
    # rounding error, and that error is far above the tolerance of the conservation checks.
    grads = _grads(2, scale=3.0)
    comp = DGCCompressor(DGCConfig(density=0.05, value_dtype="float16", warmup="none"))
    t = comp.compress(grads).tensors["fc.weight"]
    g = grads["fc.weight"].reshape(-1)
    error = comp.memory.v["fc.weight"][t.indices]
    assert torch.equal(error, g[t.indices] - t.values.float())
    assert float(error.abs().max()) > 100 * 2e-6 * (float(g.abs().max()) + 1.0)


@pytest.mark.parametrize(("value_dtype", "masking"), [("float32", True), ("float16", True),
                                                     ("bfloat16", True), ("float16", False)])
def test_ternary_sends_signs_times_the_mean_magnitude_and_keeps_the_rest(value_dtype: str,
                                                                         masking: bool) -> None:
    config = DGCConfig(density=0.05, warmup="none", ternary=True, value_dtype=value_dtype,
                       momentum=0.9, momentum_masking=masking)
    comp, ref = _run_with_reference(config, steps=6, seed=3)
    _check_against_reference(comp, ref)  # sent + residual is still every gradient's mass
    comp = DGCCompressor(config)
    grads = _grads(7, scale=3.0)
    update = comp.compress(grads)
    t = update.tensors["fc.weight"]
    g = grads["fc.weight"].reshape(-1)[t.indices]
    scale = g.abs().mean(dtype=torch.float64).to(torch.float32).to(t.values.dtype)
    assert t.values.dtype == config_dtype(value_dtype)
    assert torch.equal(t.values.abs(), scale.expand(t.nnz))
    assert torch.equal(t.values < 0, g < 0)
    # One step: the residual at the sent entries is the gradient minus +-scale, not zero.
    assert torch.equal(comp.memory.v["fc.weight"][t.indices], g - t.values.float())
    # Tensors sent dense keep their values.
    plain = DGCCompressor(dataclasses.replace(config, ternary=False)).compress(grads)
    for name in ("fc.bias", "conv.weight"):
        assert torch.equal(update.tensors[name].values, plain.tensors[name].values)


def config_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    momentum_correction=st.booleans(),
    nesterov=st.booleans(),
    masking=st.booleans(),
    error_feedback=st.booleans(),
    dampening=st.sampled_from([0.0, 0.5]),
    clip_norm=st.sampled_from([None, 1.0, 1e3]),
    num_workers=st.sampled_from([1, 4]),
    value_dtype=st.sampled_from(["float32", "float16", "bfloat16"]),
    selection=st.sampled_from(["exact", "sampled"]),
    warmup=st.sampled_from(["exponential", "none"]),
    dense_epochs=st.sampled_from([0, 1]),
    seed=st.integers(0, 10_000),
)
def test_mass_conservation_property(momentum_correction: bool, nesterov: bool, masking: bool,
                                    error_feedback: bool, dampening: float,
                                    clip_norm: float | None, num_workers: int, value_dtype: str,
                                    selection: str, warmup: str, dense_epochs: int,
                                    seed: int) -> None:
    config = DGCConfig(density=0.003, momentum=0.8, momentum_correction=momentum_correction,
                       nesterov=nesterov, momentum_masking=masking, error_feedback=error_feedback,
                       dampening=dampening, clip_norm=clip_norm, num_workers=num_workers,
                       value_dtype=value_dtype, selection=selection, warmup=warmup,
                       dense_epochs=dense_epochs)
    comp, ref = _run_with_reference(config, steps=8, seed=seed)
    _check_against_reference(comp, ref)


def test_restore_brings_dropped_mass_back() -> None:
    config = DGCConfig(density=0.02, value_dtype="float16", warmup="none")
    comp, ref = _run_with_reference(config, steps=4, seed=3)
    grads = _grads(77, scale=3.0)
    dropped = comp.compress(grads, epoch=5.0)
    ref.step(grads, dropped)
    comp.restore(dropped)
    for n, t in dropped.tensors.items():
        # The dropped update counts as not sent: its mass is back in the residual.
        ref.sent[n] -= t.to_dense(torch.float64).reshape(-1)
        ref.v[n] += t.to_dense(torch.float64).reshape(-1)
    _check_against_reference(comp, ref)
    # Momentum cleared by masking stays cleared (documented).
    masked = dropped.tensors["fc.weight"].indices
    assert torch.count_nonzero(comp.memory.u["fc.weight"][masked]) == 0


def test_restore_of_a_bad_update_changes_nothing() -> None:
    comp = DGCCompressor(DGCConfig(density=0.01, warmup="none"))
    comp.compress(_grads(0))
    before = comp.state_dict()
    good = SparseTensor(torch.tensor([0, 5]), torch.tensor([1.0, 2.0]), (40,))
    bad_cases = {
        "out of range": SparseTensor(torch.tensor([3, 2560]), torch.tensor([1.0, 1.0]), (40, 64)),
        "negative": SparseTensor(torch.tensor([-1]), torch.tensor([1.0]), (40, 64)),
        "nan": SparseTensor(torch.tensor([3]), torch.tensor([float("nan")]), (40, 64)),
        "wrong size": SparseTensor(torch.tensor([3]), torch.tensor([1.0]), (41, 64)),
    }
    for reason, bad in bad_cases.items():
        # The good tensor comes first: it must not be restored when a later one is bad.
        with pytest.raises(StateError, match="fc.weight"):
            comp.restore(SparseUpdate({"fc.bias": good, "fc.weight": bad}))
        _assert_same_state(comp.state_dict(), before, reason)
    with pytest.raises(StateError, match="never.seen"):
        comp.restore(SparseUpdate({"fc.bias": good, "never.seen": good}))
    _assert_same_state(comp.state_dict(), before, "unknown name")


def test_local_clipping_scales_to_threshold() -> None:
    config = _dense_config(momentum_correction=False, clip_norm=2.0, num_workers=4)
    grads = _grads(5, scale=10.0)
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    assert norm > 1.0
    sent = DGCCompressor(config).compress(grads).to_dense()
    sent_norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in sent.values()))
    assert sent_norm == pytest.approx(2.0 * 4 ** -0.5, rel=1e-6)
    for n, g in grads.items():  # the direction is kept: one common scale
        torch.testing.assert_close(sent[n], g * (1.0 / norm), rtol=1e-6, atol=1e-7)


def test_local_clipping_leaves_small_gradients_alone() -> None:
    config = _dense_config(momentum_correction=False, clip_norm=1e4, num_workers=4)
    grads = _grads(6)
    sent = DGCCompressor(config).compress(grads).to_dense()
    for n, g in grads.items():
        assert torch.equal(sent[n], g)


def test_layer_policy_sends_small_and_1d_tensors_dense_and_keeps_their_momentum() -> None:
    comp = DGCCompressor(DGCConfig(density=0.001, warmup="none", min_sparse_numel=1024))
    assert comp.is_dense_tensor((40,)) and comp.is_dense_tensor((4, 3, 3, 3))
    assert comp.is_dense_tensor((31, 33)) and not comp.is_dense_tensor((32, 32))
    grads = _grads(8)
    update = comp.compress(grads)
    assert update.tensors["fc.bias"].is_dense and update.tensors["conv.weight"].is_dense
    weight = update.tensors["fc.weight"]
    assert weight.nnz == num_selected(2560, 0.001) == 3
    # Masking zeroed the sparsified layer's momentum where it sent; dense layers keep theirs.
    assert torch.count_nonzero(comp.memory.u["fc.weight"][weight.indices]) == 0
    assert torch.equal(comp.memory.u["fc.bias"], grads["fc.bias"])
    assert torch.equal(comp.memory.u["conv.weight"], grads["conv.weight"].reshape(-1))
    # What the sparsified layer did not send waits in the residual.
    rest = torch.ones(2560, dtype=torch.bool)
    rest[weight.indices] = False
    assert torch.equal(comp.memory.v["fc.weight"][rest], grads["fc.weight"].reshape(-1)[rest])


def test_sparse_vectors_sparsifies_long_biases_only() -> None:
    """dgc.sparse_vectors: a 1-D tensor of min_sparse_numel entries or more (an LSTM's biases)
    is sparsified like a matrix; shorter ones, and every 1-D tensor by default, stay dense."""
    plain = DGCConfig(density=0.01, warmup="none", min_sparse_numel=512, selection="exact")
    vectors = dataclasses.replace(plain, sparse_vectors=True)
    assert plain.sends_dense((512,)) and not vectors.sends_dense((512,))
    assert vectors.sends_dense((511,)) and vectors.sends_dense((76,))
    assert not vectors.sends_dense((512, 8)) and plain.sends_dense((511, 1))
    grads = {"bias": torch.randn(512), "short": torch.randn(200)}
    update = DGCCompressor(vectors).compress(grads)
    assert update.tensors["bias"].nnz == num_selected(512, 0.01) == 6
    assert update.tensors["short"].is_dense
    top = grads["bias"].abs().topk(6).indices.sort().values
    assert torch.equal(update.tensors["bias"].indices.sort().values, top)
    assert DGCCompressor(plain).compress(grads).tensors["bias"].is_dense


def test_error_feedback_off_drops_the_unsent_mass() -> None:
    comp = DGCCompressor(DGCConfig(density=0.01, warmup="none", error_feedback=False))
    for i in range(3):
        comp.compress(_grads(i))
        assert all(torch.count_nonzero(v) == 0 for v in comp.memory.v.values())


def test_sequence_numbers() -> None:
    comp = DGCCompressor(DGCConfig(density=0.01))
    assert comp.compress(_grads(0)).sequence == 1
    assert comp.compress(_grads(1), sequence=42).sequence == 42
    assert comp.compress(_grads(2)).sequence == 3


@pytest.mark.parametrize("selection", ["exact", "sampled"])
def test_state_round_trip_continues_bit_identically(selection: str) -> None:
    config = DGCConfig(density=0.01, selection=selection, value_dtype="float16")
    shapes = {"big": (300, 100), "bias": (100,)}
    a = DGCCompressor(config)
    for i in range(3):
        a.compress(_grads(i, shapes), epoch=i / 2)
    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b = DGCCompressor(config)
    b.load_state_dict(torch.load(buffer))
    for i in range(3, 9):
        ua = a.compress(_grads(i, shapes), epoch=i / 2)
        ub = b.compress(_grads(i, shapes), epoch=i / 2)
        assert ua.sequence == ub.sequence
        for n in shapes:
            assert torch.equal(ua.tensors[n].indices, ub.tensors[n].indices)
            assert torch.equal(ua.tensors[n].values, ub.tensors[n].values)
    _assert_same_state(a.state_dict(), b.state_dict(), "after continuing")


def test_state_dict_is_a_copy() -> None:
    comp = DGCCompressor(DGCConfig(density=0.01))
    comp.compress(_grads(0))
    state = comp.state_dict()
    state["memory"]["v"]["fc.weight"].fill_(123.0)
    assert not torch.equal(comp.memory.v["fc.weight"], state["memory"]["v"]["fc.weight"])


def _assert_same_state(a: dict, b: dict, why: str) -> None:
    assert a["step"] == b["step"], why
    for part in ("u", "v"):
        assert set(a["memory"][part]) == set(b["memory"][part]), why
        for n, t in a["memory"][part].items():
            assert torch.equal(t, b["memory"][part][n]), (why, part, n)


def _malformed_states(good: dict) -> dict[str, object]:
    def with_memory(**parts: object) -> dict:
        return {**good, "memory": {**good["memory"], **parts}}

    v = good["memory"]["v"]
    return {
        "not a mapping": [1, 2],
        "no version": {k: x for k, x in good.items() if k != "version"},
        "wrong version": {**good, "version": 99},
        "negative step": {**good, "step": -1},
        "bool step": {**good, "step": True},
        "float step": {**good, "step": 2.0},
        "no memory": {k: x for k, x in good.items() if k != "memory"},
        "memory not a mapping": {**good, "memory": "u, v"},
        "unknown part": with_memory(w={}),
        "part not a mapping": with_memory(v=[torch.zeros(3)]),
        "2-D tensor": with_memory(v={**v, "fc.weight": torch.zeros(40, 64)}),
        "integer tensor": with_memory(v={**v, "fc.weight": torch.zeros(2560, dtype=torch.int64)}),
        "not a tensor": with_memory(v={**v, "fc.weight": [0.0] * 2560}),
        "nan": with_memory(v={**v, "fc.weight": torch.full((2560,), float("nan"))}),
        "inf in u": with_memory(u={**good["memory"]["u"],
                                   "fc.bias": torch.full((40,), float("inf"))}),
        "u and v sizes differ": with_memory(u={**good["memory"]["u"], "fc.bias": torch.zeros(7)}),
        "non-string name": with_memory(v={**v, 3: torch.zeros(3)}),
    }


def test_malformed_states_raise_and_change_nothing() -> None:
    comp = DGCCompressor(DGCConfig(density=0.01))
    for i in range(2):
        comp.compress(_grads(i))
    good = comp.state_dict()
    for reason, state in _malformed_states(good).items():
        with pytest.raises(StateError):
            comp.load_state_dict(state)  # type: ignore[arg-type]
        _assert_same_state(comp.state_dict(), good, reason)
    comp.load_state_dict(good)  # the well-formed one is accepted


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_raises_and_changes_nothing(bad: float) -> None:
    comp = DGCCompressor(DGCConfig(density=0.01))
    comp.compress(_grads(0))
    before = comp.state_dict()
    grads = _grads(1)
    grads["fc.bias"][7] = bad  # the first tensor is fine and must not be folded in either
    with pytest.raises(StateError, match="fc.bias"):
        comp.compress(grads)
    _assert_same_state(comp.state_dict(), before, "non-finite gradient")


def test_huge_finite_gradient_is_accepted() -> None:
    # Its float32 sum overflows to inf; the finiteness check must not mistake that for an Inf.
    grads = {"w": torch.full((64, 64), 3e37)}
    update = DGCCompressor(DGCConfig(density=0.01, value_dtype="float32")).compress(grads)
    assert update.tensors["w"].nnz >= 1


def test_wrong_gradients_raise_and_change_nothing() -> None:
    comp = DGCCompressor(DGCConfig(density=0.01))
    comp.compress(_grads(0))
    before = comp.state_dict()
    wrong_size = _grads(1)
    wrong_size["fc.weight"] = torch.randn(41, 64)
    with pytest.raises(StateError, match=r"fc\.weight.*2624.*2560"):
        comp.compress(wrong_size)
    integer = _grads(1)
    integer["conv.weight"] = torch.ones(4, 3, 3, 3, dtype=torch.int32)
    with pytest.raises(StateError, match="conv.weight"):
        comp.compress(integer)
    _assert_same_state(comp.state_dict(), before, "wrong gradient")


def test_every_dgc_compressor_is_a_compressor_and_scale_state_ages_u_and_v():
    from dgc import Compressor, RowwiseCompressor, TwoDensityCompressor

    cfg = DGCConfig(density=0.05, selection="exact", warmup="none", min_sparse_numel=16)
    for c in (DGCCompressor(cfg), TwoDensityCompressor(cfg, 0.2), RowwiseCompressor(cfg)):
        assert isinstance(c, Compressor), type(c).__name__
    comp = DGCCompressor(cfg)
    g = torch.Generator().manual_seed(4)
    comp.compress({"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)})
    before = comp.memory.state_dict()
    assert any(u.abs().sum() > 0 for u in before["u"].values())
    comp.scale_state(0.25)
    for part in ("u", "v"):
        for name, t in before[part].items():
            torch.testing.assert_close(getattr(comp.memory, part)[name], t * 0.25)
    for bad in (-0.5, math.nan, math.inf, True, "1"):
        with pytest.raises(StateError, match="finite number >= 0"):
            comp.scale_state(bad)  # type: ignore[arg-type]
    comp.scale_state(0.0)
    assert all(not t.any() for t in comp.residual().values())
