"""Tests of the label-based partitioners and of Task.partition."""

import numpy as np
import pytest

from tasks import DataError, get_task, label_skew, partition

LABELS = np.random.default_rng(7).integers(0, 10, size=2000)


def _assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert joined.dtype == np.int64
    assert joined.size == n, "every index must be assigned exactly once"
    assert np.array_equal(np.sort(joined), np.arange(n))
    assert all(p.size > 0 for p in parts), "no client may be empty"
    assert all(np.all(np.diff(p) > 0) for p in parts), "indices are sorted and unique per client"


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards"])
@pytest.mark.parametrize("num_clients", [1, 7, 100])
def test_every_index_assigned_once(scheme: str, num_clients: int) -> None:
    parts = partition(LABELS, num_clients, scheme, alpha=0.3, seed=3)
    assert len(parts) == num_clients
    _assert_exact_cover(parts, LABELS.size)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards"])
def test_same_seed_same_partition_other_seed_differs(scheme: str) -> None:
    a = partition(LABELS, 20, scheme, seed=11)
    b = partition(LABELS, 20, scheme, seed=11)
    c = partition(LABELS, 20, scheme, seed=12)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_iid_sizes_differ_by_at_most_one() -> None:
    sizes = [p.size for p in partition(LABELS, 30, "iid")]
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_skew_grows_as_alpha_shrinks() -> None:
    skews = [
        np.mean(
            [
                label_skew(LABELS, partition(LABELS, 50, "dirichlet", alpha=a, seed=s))
                for s in range(3)
            ]
        )
        for a in (100.0, 1.0, 0.1, 0.01)
    ]
    assert all(lo < hi for lo, hi in zip(skews[:-1], skews[1:], strict=True)), skews
    # alpha=100 is close to IID; alpha=0.01 leaves most clients with essentially one class.
    iid = label_skew(LABELS, partition(LABELS, 50, "iid"))
    assert skews[0] < iid + 0.05
    assert skews[-1] > 0.8


def test_dirichlet_tiny_alpha_still_fills_every_client() -> None:
    labels = np.repeat(np.arange(2), 60)  # two classes, 120 samples, 100 clients
    parts = partition(labels, 100, "dirichlet", alpha=0.001, seed=0)
    _assert_exact_cover(parts, labels.size)


def test_shards_give_each_client_few_labels() -> None:
    labels = np.repeat(np.arange(10), 100)
    parts = partition(labels, 50, "shards", shards_per_client=2, seed=0)
    _assert_exact_cover(parts, labels.size)
    # 100 shards of 10 samples each, all single-class: at most 2 labels per client.
    assert max(np.unique(labels[p]).size for p in parts) <= 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scheme": "random"}, "unknown partition scheme 'random'.*dirichlet"),
        ({"scheme": "natural"}, "natural"),
        ({"num_clients": 0}, "num_clients must be >= 1, got 0"),
        ({"num_clients": 2.5}, "num_clients must be an int"),
        ({"num_clients": 2001}, "num_clients=2001 exceeds the 2000 samples"),
        ({"scheme": "dirichlet", "alpha": 0.0}, "alpha must be finite and > 0, got 0.0"),
        ({"scheme": "dirichlet", "alpha": float("nan")}, "alpha must be finite"),
        ({"scheme": "shards", "shards_per_client": 0}, "shards_per_client must be >= 1"),
        ({"scheme": "shards", "num_clients": 1001}, r"1001\*2 = 2002 <= 2000"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs: dict, match: str) -> None:
    args = {"num_clients": 10, "scheme": "iid"} | kwargs
    with pytest.raises(DataError, match=match):
        partition(LABELS, **args)


def test_bad_labels_raise() -> None:
    with pytest.raises(DataError, match=r"1-D.*shape \(2, 3\)"):
        partition(np.zeros((2, 3), dtype=int), 2, "iid")
    with pytest.raises(DataError, match="integer class ids.*float"):
        partition(np.zeros(5), 2, "iid")


def test_task_partition_natural_needs_a_natural_split() -> None:
    task = get_task("digits")
    with pytest.raises(DataError, match="dataset 'digits' has no natural client split"):
        task.partition(10, scheme="natural")
    parts = task.partition(10, scheme="shards", seed=1)
    _assert_exact_cover(parts, len(task.train_y))
