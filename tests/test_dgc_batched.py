"""The batched selection (dgc.batched) and the batched compressor: the per-tensor path's results,
and no read back from the device in the hot path."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dgc.batched import BatchedSelector
from dgc.compressor import DGCCompressor
from dgc.config import DGCConfig
from dgc.errors import StateError
from dgc.selection import num_selected, select_exact, select_sampled
from dgc.stc import STCCompressor, stc_config
from dgc.two_density import TwoDensityCompressor
from tests.test_dgc_selection import KINDS, _check_selection, _tensor

torch.set_num_threads(1)

#: Kinds whose k-th largest magnitude may be tied: there the two paths may keep different
#: entries of equal magnitude, so only the count and the selection's properties must agree
#: (negative_heavy: 30,000 values within 1e-3 of 1.0, where float32 steps are 6e-8).
TIED = {"all_equal", "ties", "negative_heavy"}


def _reference(magnitude: torch.Tensor, k: int, density: float, config: DGCConfig,
               step: int) -> torch.Tensor:
    if config.selection == "exact":
        return select_exact(magnitude, k)
    return select_sampled(magnitude, k, density, config.sample_ratio, config.min_count_ratio,
                          config.max_adaptations, step)


def _check_batched(kinds: list[str], sizes: list[int], density: float, config: DGCConfig,
                   step: int, seed: int) -> int:
    """Select the segments batched and per tensor; return how many fell back."""
    parts = [_tensor(kind, n, density, seed + i, offset=step)
             for i, (kind, n) in enumerate(zip(kinds, sizes, strict=True))]
    selector = BatchedSelector(sizes, density, config, "cpu")
    selection = selector.select(torch.cat(parts), step)
    assert selection.positions.numel() == selector.num_slots == sum(selector.ks)
    fell_back = 0
    for t, (kind, magnitude) in enumerate(zip(kinds, parts, strict=True)):
        k, start = selector.ks[t], selector.slot_offsets[t]
        count = int(selection.counts[t])
        expected = _reference(magnitude, k, density, config, step)
        if bool(selection.fallback[t]):
            fell_back += 1
            assert count == 0 and not bool(selection.valid[start:start + k].any())
            continue
        assert bool(selection.valid[start:start + count].all())
        assert not bool(selection.valid[start + count:start + k].any())
        got = selection.positions[start:start + count] - selector.offsets[t]
        _check_selection(magnitude, got, k, exact=config.selection == "exact")
        assert count == expected.numel(), (kind, count, expected.numel())
        if kind not in TIED:
            assert torch.equal(got, expected), kind
    return fell_back


@pytest.mark.parametrize("density", [0.001, 0.01, 0.3, 1.0])
@pytest.mark.parametrize("selection", ["sampled", "exact"])
def test_every_kind_of_tensor_at_once_selects_what_the_per_tensor_path_does(
        density: float, selection: str) -> None:
    # Every adversarial kind of tests/test_dgc_selection.py, in segments of several sizes
    # (some under 2 / density: exact from the start), in one buffer.
    config = DGCConfig(density=density, selection=selection)
    sizes = [3000, 100_003, 2500, 40_000, 1_200, 7_777, 60_000, 2_001, 12_345, 30_000]
    for step in (0, 1, 7):
        _check_batched(list(KINDS), sizes, density, config, step, seed=step)


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=6),
    seed=st.integers(0, 2**31),
    density=st.sampled_from([0.0005, 0.001, 0.01, 0.05, 0.3, 1.0]),
    sample_ratio=st.sampled_from([0.001, 0.01, 0.1]),
    min_count_ratio=st.sampled_from([0.1, 0.5, 1.0]),
    max_adaptations=st.integers(0, 3),
    step=st.integers(0, 1000),
    data=st.data(),
)
def test_batched_selection_property(kinds: list[str], seed: int, density: float,
                                    sample_ratio: float, min_count_ratio: float,
                                    max_adaptations: int, step: int, data: st.DataObject) -> None:
    sizes = data.draw(st.lists(st.integers(1, 30_000), min_size=len(kinds), max_size=len(kinds)))
    config = DGCConfig(density=density, sample_ratio=sample_ratio,
                       min_count_ratio=min_count_ratio, max_adaptations=max_adaptations)
    _check_batched(kinds, sizes, density, config, step, seed)


def test_the_exact_fallback_is_rare_on_ordinary_tensors() -> None:
    # The fallback costs a read back and a per-tensor top-k: measured on 2,000 Gaussian segments
    # it is taken by none (a sampled count must miss k by 8x; module docstring of dgc.batched).
    gen = torch.Generator().manual_seed(1)
    sizes = [int(x) for x in torch.randint(3000, 60_000, (50,), generator=gen)]
    selector = BatchedSelector(sizes, 0.001, DGCConfig(density=0.001), "cpu")
    fallbacks = sum(int(selector.select(torch.randn(sum(sizes), generator=gen).abs(),
                                        step).fallback.sum()) for step in range(40))
    assert fallbacks <= 2


def test_a_sample_of_zeros_falls_back_and_the_compressor_still_selects_exactly() -> None:
    # All but a few entries zero: the sample's threshold is 0, the sampled path's exact top-k.
    x = torch.zeros(50_000)
    x[torch.randperm(50_000, generator=torch.Generator().manual_seed(0))[:20]] = 1.0
    selector = BatchedSelector([50_000], 0.001, DGCConfig(density=0.001), "cpu")
    assert bool(selector.select(x, 0).fallback[0])
    comp = DGCCompressor(DGCConfig(density=0.001, warmup="none"), batched=True)
    update = comp.compress({"w": x.reshape(100, 500)})
    assert torch.equal(update.tensors["w"].indices, select_exact(x, num_selected(50_000, 0.001)))


# ----------------------------------------------------------------------------- the compressor
SHAPES = {"fc1.weight": (64, 300), "fc1.bias": (64,), "conv.weight": (8, 4, 5, 5),
          "fc2.weight": (10, 64), "fc2.bias": (10,), "big": (400, 250)}

CONFIGS = {
    "default": DGCConfig(density=0.01),
    "exact": DGCConfig(density=0.01, selection="exact"),
    "nesterov-dampening": DGCConfig(density=0.01, nesterov=True, dampening=0.3),
    "no-correction": DGCConfig(density=0.02, momentum_correction=False, warmup="none"),
    "clip": DGCConfig(density=0.01, clip_norm=5.0, num_workers=4),
    "no-error-feedback": DGCConfig(density=0.01, error_feedback=False, momentum=0.0,
                                   momentum_masking=False),
    "ternary-bf16": DGCConfig(density=0.01, ternary=True, value_dtype="bfloat16"),
    "float32-sparse-vectors": DGCConfig(density=0.05, value_dtype="float32",
                                        sparse_vectors=True, min_sparse_numel=32),
    "dense-epochs": DGCConfig(density=0.01, dense_epochs=1),
}


def _grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=gen) * (1 + step) for n, s in SHAPES.items()}


def _same_update(a, b) -> None:  # noqa: ANN001 - two SparseUpdates
    assert list(a.tensors) == list(b.tensors) and a.sequence == b.sequence
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert t.shape == u.shape and t.values.dtype == u.values.dtype
        assert torch.equal(t.indices, u.indices), name
        assert torch.allclose(t.values.float(), u.values.float(), rtol=1e-6, atol=1e-7), name


def _same_state(a: DGCCompressor, b: DGCCompressor) -> None:
    for part in ("u", "v"):
        sa, sb = getattr(a.memory, part), getattr(b.memory, part)
        assert set(sa) == set(sb)
        for name in sa:
            assert torch.allclose(sa[name], sb[name], rtol=1e-6, atol=1e-6), (part, name)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_compressor_sends_what_the_per_tensor_one_sends(name: str) -> None:
    config = CONFIGS[name]
    batched, per_tensor = DGCCompressor(config, batched=True), DGCCompressor(config, batched=False)
    for step in range(6):
        grads = _grads(step)
        _same_update(batched.compress(grads, epoch=step / 2),
                     per_tensor.compress(grads, epoch=step / 2))
        _same_state(batched, per_tensor)


@pytest.mark.parametrize("make", [
    lambda b: STCCompressor(stc_config(density=0.01)) if b is None else
    _with_batched(STCCompressor(stc_config(density=0.01)), b),
    lambda b: TwoDensityCompressor(DGCConfig(density=0.001), 0.05, small_numel=1000)
    if b is None else _two_density(b),
], ids=["stc", "two-density"])
def test_the_other_compressors_built_on_it_agree_too(make) -> None:  # noqa: ANN001
    batched, per_tensor = make(True), make(False)
    for step in range(4):
        grads = _grads(step)
        _same_update(batched.compress(grads, epoch=step), per_tensor.compress(grads, epoch=step))


def _with_batched(comp: DGCCompressor, batched: bool) -> DGCCompressor:
    comp.batched = batched
    return comp


def _two_density(batched: bool) -> TwoDensityCompressor:
    comp = TwoDensityCompressor(DGCConfig(density=0.001), 0.05, small_numel=1000)
    comp.large.batched = comp.small.batched = batched
    return comp


def test_state_round_trips_restore_scale_and_a_new_tensor_keep_the_paths_together() -> None:
    config = CONFIGS["default"]
    batched, per_tensor = DGCCompressor(config, batched=True), DGCCompressor(config, batched=False)
    first = {k: v for k, v in _grads(0).items() if k != "big"}
    a, b = batched.compress(first), per_tensor.compress(first)
    _same_update(a, b)
    batched.restore(a)  # into views of the flat blocks, in place
    per_tensor.restore(b)
    batched.scale_state(0.5)
    per_tensor.scale_state(0.5)
    _same_state(batched, per_tensor)
    # A tensor met for the first time mid-run, then a state loaded from the per-tensor path.
    _same_update(batched.compress(_grads(1)), per_tensor.compress(_grads(1)))
    _same_state(batched, per_tensor)
    state = per_tensor.state_dict()
    assert all(t.device.type == "cpu" for part in ("u", "v") for t in state["memory"][part]
               .values())
    batched.load_state_dict(state)
    _same_update(batched.compress(_grads(2)), per_tensor.compress(_grads(2)))
    _same_state(batched, per_tensor)


def test_a_bad_gradient_is_refused_before_anything_changes() -> None:
    comp = DGCCompressor(CONFIGS["default"], batched=True)
    comp.compress(_grads(0))
    before = {k: v.clone() for k, v in comp.memory.v.items()}
    bad = _grads(1)
    bad["conv.weight"][0, 0, 0, 0] = float("nan")
    with pytest.raises(StateError, match="'conv.weight' contains NaN"):
        comp.compress(bad)
    wrong = _grads(1)
    wrong["big"] = torch.randn(5, 5)
    with pytest.raises(StateError, match="'big' has 25 entries"):
        comp.compress(wrong)
    assert all(torch.equal(before[k], comp.memory.v[k]) for k in before)
    assert comp.step == 1


def test_the_hot_path_reads_nothing_back_from_the_device() -> None:
    # On the meta device every value is unknown: an .item(), a bool(tensor), a nonzero or a
    # mask index would raise. The plan is built on the host first; the step then runs on meta
    # as it would on an accelerator without waiting for it.
    sizes = [19_200, 800, 100_000, 2_500]
    for density, selection in itertools.product((0.001, 0.3, 1.0), ("sampled", "exact")):
        config = DGCConfig(density=density, selection=selection, ternary=True,
                           clip_norm=1.0, nesterov=True)
        selector = BatchedSelector(sizes, density, config, "meta")
        out = selector.select(torch.empty(sum(sizes), device="meta"), step=5)
        assert out.positions.shape == (sum(selector.ks),)
        comp = DGCCompressor(config, batched=True)
        names = tuple(f"t{i}" for i in range(len(sizes))) + ("bias",)
        numels = (*sizes, 64)
        for _ in range(2):  # the first step lays the state out, the second reuses it
            _, selection_, sent, dense = comp.batched_step(
                names, numels, len(sizes), torch.empty(sum(numels), device="meta"), density)
            assert sent.device.type == "meta" and dense.shape == (64,)
            assert selection_.counts.shape == (len(sizes),)


# ----------------------------------------------------------------------------- CUDA
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
@pytest.mark.parametrize("name", ["default", "exact", "ternary-bf16", "clip", "dense-epochs"])
def test_on_cuda_the_compressor_sends_what_it_sends_on_the_host(name: str) -> None:
    config = CONFIGS[name]
    on_gpu = DGCCompressor(config)  # batched: the gradients are on the device
    per_tensor_gpu = DGCCompressor(config, batched=False)
    host = DGCCompressor(config, batched=False)
    for step in range(4):
        grads = _grads(step)
        device_grads = {k: v.cuda() for k, v in grads.items()}
        a = on_gpu.compress(device_grads, epoch=step / 2)
        b = per_tensor_gpu.compress(device_grads, epoch=step / 2)
        c = host.compress(grads, epoch=step / 2)
        assert all(t.indices.is_cuda and t.values.is_cuda for t in a.tensors.values())
        _same_update(a.cpu(), c)
        _same_update(b.cpu(), c)


@cuda
def test_on_cuda_the_hot_path_does_not_synchronise() -> None:
    comp = DGCCompressor(dataclasses.replace(CONFIGS["default"], ternary=True, clip_norm=3.0))
    grads = {k: v.cuda() for k, v in _grads(0).items()}
    comp.compress(grads)  # builds the plan (host-to-device copies) and lays the state out
    names, numels, sparse_count = comp._flat_layout(grads)  # noqa: SLF001
    g = torch.cat([grads[n].reshape(-1) for n in names])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        comp.batched_step(names, numels, sparse_count, g, comp.config.density_at(0.0))
    finally:
        torch.cuda.set_sync_debug_mode(0)
