"""Tests of top-k selection, exact and sampled, on random and adversarial tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dgc.selection as selection
from dgc.selection import (
    num_selected,
    sample_size,
    select_exact,
    select_sampled,
    strided_sample,
)

torch.set_num_threads(1)

KINDS = ("random", "all_equal", "ties", "single", "zeros", "dynamic_range", "on_stride",
         "on_stride_few", "sparse_nonzeros", "negative_heavy")


def _tensor(kind: str, n: int, density: float, seed: int, offset: int = 0) -> torch.Tensor:
    """A flat magnitude tensor (non-negative) of one adversarial kind."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(n, generator=gen).abs()
    if kind == "all_equal":
        return torch.full((n,), 0.5)
    if kind == "ties":
        return torch.randint(0, 3, (n,), generator=gen).float()
    if kind == "single":
        x = torch.zeros(n)
        x[int(torch.randint(0, n, (1,), generator=gen))] = 1e-3
        return x
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "dynamic_range":
        exponent = torch.rand(n, generator=gen) * 70 - 35
        return torch.pow(10.0, exponent)
    if kind == "sparse_nonzeros":  # fewer non-zero entries than k
        x = torch.zeros(n)
        k = num_selected(n, density)
        pos = torch.randperm(n, generator=gen)[: max(1, k // 3)]
        x[pos] = torch.rand(pos.numel(), generator=gen) + 0.1
        return x
    if kind == "negative_heavy":  # |v| of a tensor dominated by one sign and a few outliers
        x = torch.randn(n, generator=gen) * 1e-3 - 1.0
        x[torch.randperm(n, generator=gen)[:5]] = -50.0
        return x.abs()
    # The large entries sit exactly on the positions the strided sample reads.
    s = sample_size(n, density, 0.01)
    stride = max(1, n // s)
    start = offset % stride
    x = torch.rand(n, generator=gen) * 1e-3
    on = torch.arange(start, n, stride)[:s]
    if kind == "on_stride_few":  # only a few of them: the sample overestimates the count
        on = on[: max(1, num_selected(n, density) // 4)]
    x[on] = 1.0 + torch.rand(on.numel(), generator=gen)
    return x


def _check_selection(magnitude: torch.Tensor, idx: torch.Tensor, k: int, exact: bool) -> None:
    n = magnitude.numel()
    assert idx.dtype == torch.int64 and idx.dim() == 1
    nonzero = int(torch.count_nonzero(magnitude))
    if nonzero == 0:
        assert idx.numel() == 0
        return
    assert 1 <= idx.numel() <= k
    if exact:
        assert idx.numel() == min(k, nonzero)
    assert bool((idx[1:] > idx[:-1]).all()), "indices must be sorted and unique"
    assert int(idx.min()) >= 0 and int(idx.max()) < n
    selected = magnitude[idx]
    assert bool((selected > 0).all()), "a zero entry was selected"
    rest = torch.ones(n, dtype=torch.bool)
    rest[idx] = False
    if rest.any():
        # The kept entries are the largest: nothing left out is larger than anything kept.
        assert float(magnitude[rest].max()) <= float(selected.min())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
@pytest.mark.parametrize("n", [3000, 100_003])
def test_exact_and_sampled_on_adversarial_tensors(kind: str, density: float, n: int) -> None:
    k = num_selected(n, density)
    for offset in (0, 1, 7):
        magnitude = _tensor(kind, n, density, seed=n + offset, offset=offset)
        _check_selection(magnitude, select_exact(magnitude, k), k, exact=True)
        idx = select_sampled(magnitude, k, density, offset=offset)
        _check_selection(magnitude, idx, k, exact=False)


@settings(max_examples=80, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    n=st.integers(1, 30_000),
    density=st.sampled_from([0.0005, 0.001, 0.01, 0.05, 0.3, 1.0]),
    sample_ratio=st.sampled_from([0.001, 0.01, 0.1]),
    min_count_ratio=st.sampled_from([0.1, 0.5, 1.0]),
    max_adaptations=st.integers(0, 3),
    offset=st.integers(0, 1000),
    seed=st.integers(0, 2**31),
)
def test_selection_property(kind: str, n: int, density: float, sample_ratio: float,
                            min_count_ratio: float, max_adaptations: int, offset: int,
                            seed: int) -> None:
    magnitude = _tensor(kind, n, density, seed, offset)
    k = num_selected(n, density)
    _check_selection(magnitude, select_exact(magnitude, k), k, exact=True)
    idx = select_sampled(magnitude, k, density, sample_ratio, min_count_ratio, max_adaptations,
                         offset)
    _check_selection(magnitude, idx, k, exact=False)
    if idx.numel() and kind != "zeros" and idx.numel() < k:
        # An accepted short count still meets the lower bound, unless the tensor has fewer
        # non-zero entries than that.
        nonzero = int(torch.count_nonzero(magnitude))
        assert idx.numel() >= min(nonzero, math.ceil(min_count_ratio * k))


def test_sampled_path_is_taken_on_ordinary_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    # Spy on the exact fallback (the real function runs) so the sampled tests above are known to
    # exercise the threshold path, not only the fallback.
    calls = []
    real = selection.select_exact

    def spy(magnitude: torch.Tensor, k: int) -> torch.Tensor:
        calls.append(k)
        return real(magnitude, k)

    monkeypatch.setattr(selection, "select_exact", spy)
    for seed in range(5):
        magnitude = torch.randn(200_000, generator=torch.Generator().manual_seed(seed)).abs()
        k = num_selected(200_000, 0.001)
        idx = select_sampled(magnitude, k, 0.001, offset=seed)
        _check_selection(magnitude, idx, k, exact=False)
        assert math.ceil(0.5 * k) <= idx.numel() <= k
    assert calls == []
    # A tensor whose sample sees only its few large entries adapts, then falls back.
    magnitude = _tensor("on_stride_few", 200_000, 0.001, seed=0)
    idx = select_sampled(magnitude, num_selected(200_000, 0.001), 0.001, max_adaptations=0)
    assert calls == [200] and idx.numel() == 200


def test_trimming_keeps_the_largest_candidates() -> None:
    # Many entries tie at the sample threshold, so the candidate set is larger than k and must be
    # trimmed: the k kept must include every entry strictly larger than the ties.
    n, density = 100_000, 0.001
    k = num_selected(n, density)
    magnitude = torch.ones(n)
    big = torch.randperm(n, generator=torch.Generator().manual_seed(3))[: k // 2]
    magnitude[big] = 2.0 + torch.arange(big.numel(), dtype=torch.float32)
    idx = select_sampled(magnitude, k, density)
    assert idx.numel() == k
    assert set(big.tolist()) <= set(idx.tolist())


def test_num_selected_and_sample_size() -> None:
    assert num_selected(1000, 0.001) == 1
    assert num_selected(1001, 0.001) == 2  # rounds up
    assert num_selected(10, 1e-9) == 1  # never 0
    assert num_selected(10, 1.0) == 10
    assert sample_size(1_000_000, 0.001, 0.01) == 10_000
    assert sample_size(100_000, 0.001, 0.01) == 2000  # at least 2 / density
    assert sample_size(500, 0.001, 0.01) == 500  # capped at numel


def test_strided_sample_positions() -> None:
    x = torch.arange(100, dtype=torch.float32)
    assert torch.equal(strided_sample(x, 10, offset=0), torch.arange(0, 100, 10).float())
    assert torch.equal(strided_sample(x, 10, offset=13), torch.arange(3, 100, 10).float())
    assert strided_sample(x, 7, offset=5).numel() == 7
    assert strided_sample(torch.arange(5.0), 5, offset=3).numel() == 5


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 300_000), p=st.sampled_from([0.0, 1e-4, 0.01, 0.5, 1.0]),
       start=st.integers(0, 9), seed=st.integers(0, 2**31))
def test_nonzero_flat_equals_torch_nonzero(n: int, p: float, start: int, seed: int) -> None:
    mask = torch.rand(n, generator=torch.Generator().manual_seed(seed)) < p
    for m in (mask, mask[start:]):  # offset views take the plain path, aligned ones the words
        assert torch.equal(selection.nonzero_flat(m), torch.nonzero(m).view(-1))


@pytest.mark.parametrize("seed", range(6))
def test_select_stable_is_the_stable_sorts_prefix_without_the_sort(seed: int) -> None:
    """The server's broadcast and the shared sets rank by a stable descending sort (ties to
    the lower position); select_stable finds the same set from a top-k, ties included."""
    from dgc.selection import select_stable

    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 5000, (1,), generator=g))
    # Few distinct values (many ties, zeros among them), or continuous ones.
    values = (torch.randint(0, 6, (n,), generator=g).float() if seed % 2 else
              torch.rand(n, generator=g))
    for k in {0, 1, n // 7, n // 2, n - 1, n, n + 3}:
        want = torch.sort(torch.sort(values, descending=True, stable=True).indices[:k]).values
        got = select_stable(values, k)
        assert torch.equal(got, want), (n, k)
