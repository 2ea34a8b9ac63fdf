"""Tests of aggregate: weighted scatter-add of sparse updates against the dense computation."""

from __future__ import annotations

import pytest
import torch

from dgc.aggregate import aggregate
from dgc.compressor import DGCCompressor
from dgc.config import DGCConfig
from dgc.errors import AggregationError
from dgc.sparse import SparseTensor, SparseUpdate

torch.set_num_threads(1)

SHAPES = {"fc.weight": (50, 60), "fc.bias": (50,)}


def _client_updates(count: int, value_dtype: str = "float16") -> list[SparseUpdate]:
    updates = []
    for c in range(count):
        comp = DGCCompressor(DGCConfig(density=0.05, warmup="none", value_dtype=value_dtype))
        gen = torch.Generator().manual_seed(c)
        updates.append(comp.compress({n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}))
    return updates


def _dense_average(updates: list[SparseUpdate], weights: list[float],
                   normalize: bool = True) -> dict[str, torch.Tensor]:
    total = sum(weights) if normalize else 1.0
    out = {n: torch.zeros(s, dtype=torch.float64) for n, s in SHAPES.items()}
    for u, w in zip(updates, weights, strict=True):
        for n, t in u.to_dense(torch.float64).items():
            out[n] += w * t
    return {n: (t / total).float() for n, t in out.items()}


@pytest.mark.parametrize("value_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("normalize", [True, False])
def test_scatter_add_equals_dense_weighted_average(value_dtype: str, normalize: bool) -> None:
    updates = _client_updates(5, value_dtype)
    weights = [1.0, 3.0, 0.5, 2.0, 0.0]
    got = aggregate(updates, weights, SHAPES, normalize=normalize)
    expected = _dense_average(updates, weights, normalize)
    assert set(got) == set(SHAPES)
    for n, s in SHAPES.items():
        assert got[n].shape == s and got[n].dtype == torch.float32
        torch.testing.assert_close(got[n], expected[n], rtol=1e-6, atol=1e-6)


def test_duplicates_across_updates_sum() -> None:
    a = SparseUpdate({"fc.bias": SparseTensor(torch.tensor([1, 4]), torch.tensor([1.0, 2.0]),
                                              (50,))})
    b = SparseUpdate({"fc.bias": SparseTensor(torch.tensor([4, 9]), torch.tensor([10.0, 5.0]),
                                              (50,))})
    got = aggregate([a, b], [1, 1], SHAPES, normalize=False)["fc.bias"]
    expected = torch.zeros(50)
    expected[1], expected[4], expected[9] = 1.0, 12.0, 5.0
    assert torch.equal(got, expected)
    weighted = aggregate([a, b], [1, 3], SHAPES)["fc.bias"]
    assert float(weighted[4]) == (1 * 2.0 + 3 * 10.0) / 4
    assert torch.count_nonzero(aggregate([a, b], [1, 1], SHAPES)["fc.weight"]) == 0


def test_empty_updates() -> None:
    empty = SparseUpdate({})
    nothing_selected = SparseUpdate({"fc.weight": SparseTensor(
        torch.zeros(0, dtype=torch.int64), torch.zeros(0), (50, 60))})
    for updates, weights in [([], []), ([empty], [1.0]), ([empty, nothing_selected], [1.0, 2.0])]:
        got = aggregate(updates, weights, SHAPES)
        assert all(torch.count_nonzero(t) == 0 and t.shape == SHAPES[n] for n, t in got.items())
    # An empty update still counts in the average (FedAvg: it sent zeros).
    one = _client_updates(1)
    half = aggregate([one[0], empty], [1.0, 1.0], SHAPES)
    torch.testing.assert_close(half["fc.weight"], one[0].to_dense()["fc.weight"] / 2)


def _bad(name: str, indices: list[int], shape: tuple[int, ...]) -> SparseUpdate:
    return SparseUpdate({name: SparseTensor(torch.tensor(indices, dtype=torch.int64),
                                            torch.ones(len(indices)), shape)})


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (_bad("fc.other", [0], (50,)), "fc.other"),
        (_bad("fc.bias", [0], (51,)), r"fc\.bias.*\(51,\).*\(50,\)"),
        (_bad("fc.weight", [0], (60, 50)), r"fc\.weight.*\(60, 50\)"),
        (_bad("fc.bias", [3, 50], (50,)), r"fc\.bias.*outside \[0, 50\)"),
        (_bad("fc.bias", [-1, 3], (50,)), r"fc\.bias.*outside"),
    ],
    ids=["unknown name", "wrong shape", "transposed", "index too large", "negative index"],
)
def test_bad_updates_raise(bad: SparseUpdate, match: str) -> None:
    good = _client_updates(2)
    inputs = [u.to_dense() for u in good]
    # The bad update comes last: it must be found before anything is summed.
    with pytest.raises(AggregationError, match=match):
        aggregate([*good, bad], [1.0, 1.0, 1.0], SHAPES)
    assert all(torch.equal(a, b) for u, d in zip(good, inputs, strict=True)
               for a, b in zip(u.to_dense().values(), d.values(), strict=True))


@pytest.mark.parametrize(
    ("weights", "match"),
    [([1.0], "2 updates but 1 weights"), ([1.0, -1.0], "-1.0"), ([1.0, float("nan")], "nan"),
     ([1.0, float("inf")], "inf"), ([0.0, 0.0], "total weight is zero"), ([1.0, "2"], "'2'")],
)
def test_bad_weights_raise(weights: list, match: str) -> None:
    with pytest.raises(AggregationError, match=match):
        aggregate(_client_updates(2), weights, SHAPES)


def test_zero_total_weight_is_fine_without_normalizing() -> None:
    got = aggregate(_client_updates(2), [0.0, 0.0], SHAPES, normalize=False)
    assert all(torch.count_nonzero(t) == 0 for t in got.values())


def _per_update_reference(updates: list[SparseUpdate], weights: list[float],
                          normalize: bool = True) -> dict[str, torch.Tensor]:
    """The one-``index_add_``-per-update summation the concatenated scatter replaced."""
    total = float(sum(weights))
    scale = 1.0 / total if normalize else 1.0
    out = {n: torch.zeros(int(torch.Size(s).numel())) for n, s in SHAPES.items()}
    for u, w in zip(updates, weights, strict=True):
        for n, t in u.tensors.items():
            out[n].index_add_(0, t.indices, t.values.float(), alpha=float(w) * scale)
    return {n: out[n].view(s) for n, s in SHAPES.items()}


@pytest.mark.parametrize("normalize", [True, False])
def test_concatenated_scatter_equals_per_update_path(normalize: bool) -> None:
    # Many overlapping updates (density 0.05 of 3000 entries, 40 clients) of mixed value dtypes.
    updates = _client_updates(20, "float16") + _client_updates(10, "bfloat16") + \
        _client_updates(10, "float32")
    # Updates that lack a tensor or carry nothing of it: each piece must keep its own weight.
    for i in (3, 11, 25):
        updates[i] = SparseUpdate({"fc.bias": updates[i].tensors["fc.bias"]})
    updates[7].tensors["fc.bias"] = SparseTensor(torch.zeros(0, dtype=torch.int64),
                                                 torch.zeros(0), (50,))
    weights = [float(1 + (i % 5)) for i in range(len(updates))]
    got = aggregate(updates, weights, SHAPES, normalize=normalize)
    expected = _per_update_reference(updates, weights, normalize)
    for n in SHAPES:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-6, atol=1e-6)
        assert torch.count_nonzero(got[n]) == torch.count_nonzero(expected[n])


def test_out_accumulates_into_the_callers_buffers() -> None:
    updates = _client_updates(4)
    weights = [1.0, 2.0, 3.0, 4.0]
    buffers = {n: torch.zeros(s) for n, s in SHAPES.items()}
    got = aggregate(updates, weights, SHAPES, out=buffers)
    fresh = aggregate(updates, weights, SHAPES)
    for n in SHAPES:
        assert got[n] is buffers[n]
        assert torch.equal(buffers[n], fresh[n])
    # Reused without zeroing, the second sum adds to the first.
    aggregate(updates, weights, SHAPES, out=buffers)
    for n in SHAPES:
        torch.testing.assert_close(buffers[n], 2 * fresh[n])
    # Reused after zero_(), as a server does across rounds: the plain result again.
    for t in buffers.values():
        t.zero_()
    aggregate(updates[:2], weights[:2], SHAPES, out=buffers)
    for n, t in aggregate(updates[:2], weights[:2], SHAPES).items():
        assert torch.equal(buffers[n], t)


@pytest.mark.parametrize(
    ("make_out", "match"),
    [
        (lambda: {"fc.weight": torch.zeros(50, 60)}, r"lacks buffers for \['fc.bias'\]"),
        (lambda: {"fc.weight": torch.zeros(50, 60), "fc.bias": torch.zeros(50),
                  "extra": torch.zeros(1)}, r"buffers \['extra'\]"),
        (lambda: {"fc.weight": torch.zeros(60, 50), "fc.bias": torch.zeros(50)},
         r"out\['fc.weight'\].*\(60, 50\).*\(50, 60\)"),
        (lambda: {"fc.weight": torch.zeros(50, 60, dtype=torch.float64),
                  "fc.bias": torch.zeros(50)}, r"torch.float64"),
        (lambda: {"fc.weight": torch.zeros(60, 50).t(), "fc.bias": torch.zeros(50)},
         "contiguous"),
        (lambda: {"fc.weight": [0.0] * 3000, "fc.bias": torch.zeros(50)}, "list"),
        (lambda: [torch.zeros(50, 60), torch.zeros(50)], "dict of tensors"),
    ],
    ids=["missing", "extra", "wrong shape", "wrong dtype", "not contiguous", "not a tensor",
         "not a dict"],
)
def test_bad_out_raises_and_writes_nothing(make_out, match: str) -> None:
    out = make_out()
    before = ({n: t.clone() for n, t in out.items() if isinstance(t, torch.Tensor)}
              if isinstance(out, dict) else {})
    with pytest.raises(AggregationError, match=match):
        aggregate(_client_updates(2), [1.0, 1.0], SHAPES, out=out)
    assert all(torch.equal(out[n], t) for n, t in before.items())


@pytest.mark.parametrize("bad_index", [[3, 50], [-1, 3]], ids=["too large", "negative"])
def test_bad_update_leaves_out_untouched(bad_index: list[int]) -> None:
    buffers = {n: torch.full(s, 7.0) for n, s in SHAPES.items()}
    # The bad update comes last, after good ones that carry the same tensor.
    updates = [*_client_updates(3), _bad("fc.bias", bad_index, (50,))]
    with pytest.raises(AggregationError, match=r"update 3 tensor 'fc\.bias'.*outside \[0, 50\)"):
        aggregate(updates, [1.0] * 4, SHAPES, out=buffers)
    assert all(bool((t == 7.0).all()) for t in buffers.values())


def test_decoded_updates_aggregate_like_their_per_tensor_form() -> None:
    from dgc import aggregate_buffers, decode, encode
    from dgc.wire import MAX_NUMEL

    updates = _client_updates(5)
    weights = [3.0, 1.0, 2.0, 5.0, 4.0]
    expected = aggregate(updates, weights, SHAPES)
    decoded = [decode(encode(u), max_numel=MAX_NUMEL) for u in updates]
    assert all(u.packed is not None for u in decoded)
    block = aggregate_buffers(SHAPES)
    separate = {n: torch.zeros(s) for n, s in SHAPES.items()}
    reordered = dict(reversed(SHAPES.items()))  # the updates' order is not the model's
    for out, shapes in [(None, SHAPES), (block, SHAPES), (separate, SHAPES), (None, reordered)]:
        got = aggregate(decoded, weights, shapes, out=out)
        for n in SHAPES:
            torch.testing.assert_close(got[n], expected[n], rtol=1e-6, atol=1e-6)
        if out is not None:
            assert all(got[n] is out[n] for n in SHAPES)
    assert all(u.packed is not None for u in decoded)  # summing did not materialize them


def test_decoded_updates_are_checked_against_the_model() -> None:
    from dgc import decode, encode
    from dgc.wire import MAX_NUMEL

    decoded = [decode(encode(u), max_numel=MAX_NUMEL) for u in _client_updates(2)]
    with pytest.raises(AggregationError, match="update 0 carries unknown tensor 'fc.bias'"):
        aggregate(decoded, [1.0, 1.0], {"fc.weight": (50, 60)})
    with pytest.raises(AggregationError, match=r"update 0 tensor 'fc.bias' has shape \(50,\)"):
        aggregate(decoded, [1.0, 1.0], {"fc.weight": (50, 60), "fc.bias": (5, 10)})
    with pytest.raises(AggregationError, match="total weight is zero"):
        aggregate(decoded, [0.0, 0.0], SHAPES)
