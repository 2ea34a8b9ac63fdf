"""Robust aggregation: the sparse coordinate-wise trimmed mean and median equal their dense
definitions (unsent entries are zeros), and one hostile client cannot move the model far."""

from __future__ import annotations

import math

import pytest
import torch

import dgc
from dgc import SparseTensor, SparseUpdate
from server.aggregation import robust_average

SHAPES = {"w": (6, 5), "b": (7,)}


def _client(g: torch.Generator, density: float) -> list[SparseUpdate]:
    parts = []
    for _ in range(2):  # an update and, overlapping it, signs
        tensors = {}
        for name, shape in SHAPES.items():
            n = math.prod(shape)
            idx = torch.randperm(n, generator=g)[: max(1, int(density * n))].sort().values
            values = torch.randn(idx.numel(), generator=g).round(decimals=1)  # some exact 0
            tensors[name] = SparseTensor(idx, values, shape)
        parts.append(SparseUpdate(tensors, 1))
    return parts


def _dense(parts: list[SparseUpdate]) -> torch.Tensor:
    return torch.cat([sum(p.to_dense(torch.float64)[n] for p in parts).reshape(-1)
                      for n in SHAPES])


@pytest.mark.parametrize("k, how, trim, density", [
    (5, "median", 0.0, 0.3), (6, "median", 0.0, 0.5), (7, "trimmed_mean", 0.2, 0.4),
    (4, "trimmed_mean", 0.25, 1.0), (3, "trimmed_mean", 0.0, 0.2)])
def test_sparse_robust_average_equals_its_dense_definition(k, how, trim, density):
    g = torch.Generator().manual_seed(k)
    clients = [_client(g, density) for _ in range(k)]
    factors = [1.0] * (k - 1) + [0.5]
    got = robust_average(clients, factors, how, trim, SHAPES)
    columns = torch.stack([_dense(c) * f for c, f in zip(clients, factors, strict=True)])
    cut = (k - 1) // 2 if how == "median" else math.floor(trim * k)
    want = columns.sort(dim=0).values[cut:k - cut].mean(dim=0).to(torch.float32)
    flat = torch.cat([got[n].reshape(-1) for n in SHAPES])
    torch.testing.assert_close(flat, want, rtol=0, atol=1e-6)


def test_decoded_updates_give_the_same_robust_average():
    g = torch.Generator().manual_seed(1)
    clients = [_client(g, 0.3)[:1] for _ in range(5)]
    decoded = [[dgc.decode(dgc.encode(c[0]), max_numel=dgc.wire.MAX_NUMEL)] for c in clients]
    assert decoded[0][0].packed is not None  # read without unpacking
    for how in ("median", "trimmed_mean"):
        a = robust_average(clients, [1.0] * 5, how, 0.2, SHAPES)
        b = robust_average(decoded, [1.0] * 5, how, 0.2, SHAPES)
        assert all(torch.equal(a[n], b[n]) for n in SHAPES)


def test_the_median_keeps_one_huge_client_out():
    g = torch.Generator().manual_seed(2)
    clients = [_client(g, 1.0)[:1] for _ in range(5)]
    clients[0] = [SparseUpdate({n: SparseTensor(t.indices, t.values * 1e30, t.shape)
                                for n, t in clients[0][0].tensors.items()}, 1)]
    got = robust_average(clients, [1.0] * 5, "median", 0.0, SHAPES)
    assert all(float(v.abs().max()) < 10 for v in got.values())


def test_what_a_reply_only_records_is_bounded_never_trusted():
    """ray_node and state_quarantined are recorded, never used: a hostile value is recorded as
    empty or 0 (not an error, not an overflow), and a long node name is cut to 64 characters."""
    from types import SimpleNamespace

    from flwr.app import ConfigRecord, MetricRecord, RecordDict

    from fedgc import protocol as P
    from server.replies import recorded_fields

    def reply(node: object, quarantined: object) -> SimpleNamespace:
        # recorded_fields reads only the reply's content (a real RecordDict).
        return SimpleNamespace(content=RecordDict({
            P.NODE: ConfigRecord({"ray_node": node}),
            P.METRICS: MetricRecord({"state_quarantined": quarantined})}))

    assert recorded_fields(reply("n" * 500, 1)) == {"ray_node": "n" * 64, "state_quarantined": 1}
    for hostile in (2**40, -1, 1.5, [1, 2]):
        assert recorded_fields(reply(7, hostile)) == {"ray_node": "", "state_quarantined": 0}
