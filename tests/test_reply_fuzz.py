"""No reply stalls a round (issue 35): a reply whose decoded update is not finite, or would
overflow once decoded, expanded or summed, is refused alone, with its reason, for every method
of the registry; the round aggregates its honest replies, and so does the round after.

The hostile replies of the issue come first (a QSGD norm of 3e38, PowerSGD factors of 1e20, a
sign scale of 1.7e38, two dense updates of 3e38), then a fuzz of every method's replies
(``bench/reply_fuzz.py``: 60 mutants per case here; ``python bench/reply_fuzz.py`` runs 10,000,
docs/threat_model.md gives its counts).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from flwr.app import Message

from bench.reply_fuzz import ROUND, cases, fuzz_case, honest_round, with_payload
from dgc import SparseUpdate
from fedgc import protocol as P
from fedgc.methods.efsign import EFSignCompressor, SignsCodec
from fedgc.methods.powersgd import LowRankCodec, LowRankTensor, LowRankUpdate
from fedgc.methods.qsgd import LevelsCodec, QSGDCompressor
from server.defences import LEFT_OUT
from server.records import ClientRow
from server.replies import MAX_ABS_VALUE, check_values
from server.strategy import DGCStrategy


def _grads(strategy: DGCStrategy, value: float) -> dict[str, torch.Tensor]:
    """A pseudo-gradient of the model's shapes, every entry ``value``."""
    return {n: torch.full(s, value) for n, s in strategy.shapes.items()}


def _qsgd_norm_3e38(strategy: DGCStrategy, reply: Message) -> bytes:
    """One entry of 3e38 per tensor: its bucket's norm is 3e38, its level ``s``, and the
    decoded value ``norm * s / s`` overflows float32 on the way (the issue's finding)."""
    own = strategy.method.own
    grads = _grads(strategy, 0.0)
    for g in grads.values():
        g.view(-1)[0] = 3e38
    update = QSGDCompressor(own.bucket_size, own.levels, 0, False).compress(grads,
                                                                            sequence=ROUND)
    assert max(float(n.max()) for n in update.norms.values()) == pytest.approx(3e38)
    return LevelsCodec().encode(update)


def _powersgd_factors_1e20(strategy: DGCStrategy, reply: Message) -> bytes:
    honest = LowRankCodec().decode(P.record_to_bytes(reply.content.array_records[P.UPDATE],
                                                     P.UPDATE),
                                   strategy.checker.bound(ROUND, strategy._round.material))
    tensors = {}
    for name, t in honest.tensors.items():
        if t.whole is not None:
            tensors[name] = t
        else:
            tensors[name] = LowRankTensor(t.shape, p=torch.full(tuple(t.p.shape), 1e20),
                                          q=torch.full(tuple(t.q.shape), 1e20))
    assert any(t.p is not None for t in tensors.values())
    return LowRankCodec().encode(LowRankUpdate(tensors, ROUND))


def _sign_scale_1_7e38(strategy: DGCStrategy, reply: Message) -> bytes:
    return SignsCodec().encode(EFSignCompressor().compress(_grads(strategy, 1.7e38),
                                                           sequence=ROUND))


def _dense_3e38(strategy: DGCStrategy, reply: Message) -> bytes:
    return strategy.checker.codec.encode(SparseUpdate.from_dense(_grads(strategy, 3e38),
                                                                 "float32", ROUND))


HOSTILE = {
    "qsgd": (_qsgd_norm_3e38, 1, "update not finite"),
    "powersgd": (_powersgd_factors_1e20, 1, "update too large"),
    "efsign": (_sign_scale_1_7e38, 1, "update too large"),
    "dense": (_dense_3e38, 2, "update too large"),
}


@pytest.mark.parametrize("robust", ["off", "on"])
@pytest.mark.parametrize("method", sorted(HOSTILE))
def test_the_issues_hostile_replies_are_refused_alone(tmp_path: Path, method: str,
                                                      robust: str) -> None:
    """Before the fix QSGD's and PowerSGD's made the aggregate Inf: every reply of the round
    was rejected ("aggregate was not finite"); the sign scale and the dense values were
    aggregated, near the float32 limit."""
    make, count, reason = HOSTILE[method]
    strategy, pairs = honest_round({"method": method}, robust, tmp_path)
    replies = [reply for _, reply in pairs]
    for i in range(count):
        sent, reply = pairs[i]
        replies[i] = with_payload(sent, reply, P.UPDATE, make(strategy, reply))
    checked = strategy.check_replies(ROUND, replies)
    assert [c.status for c in checked] == ["rejected"] * count + ["valid"] * (4 - count)
    assert all(c.reason.startswith(reason) for c in checked[:count]), checked[0].reason
    arrays, _ = strategy.aggregate_checked(ROUND, checked)
    assert arrays is not None
    assert all(torch.isfinite(t).all() for t in arrays.to_torch_state_dict().values())
    rows = strategy.client_rows[-4:]
    assert strategy.rejections[reason] == count
    assert all(honest_kept(r) for r in rows if not r.reason.startswith(reason))
    assert sum(r.reason.startswith(reason) for r in rows) == count
    # The round after, every client honest: none refused.
    after, _ = strategy.aggregate_checked(ROUND, strategy.check_replies(
        ROUND, [reply for _, reply in pairs]))
    assert after is not None and all(honest_kept(r) for r in strategy.client_rows[-4:])


def honest_kept(row: ClientRow) -> bool:
    """Whether an honest client's row is what the round owes it: aggregated, or, under
    ``robust = on``, left out by the direction gate (round 2 of 2 local steps on non-IID digits:
    an honest update can point against round 1's aggregate), never refused by a check."""
    return row.status == "aggregated" or (row.status == "rejected"
                                          and row.reason.startswith(LEFT_OUT))


def test_the_bound_is_read_before_any_expansion(tmp_path: Path) -> None:
    """PowerSGD's bound comes from its factors: the product of factors of 1e20 (Inf in float32)
    is never formed, and an honest payload's bound holds its product."""
    strategy, pairs = honest_round({"method": "powersgd"}, "off", tmp_path)
    bound = strategy.checker.bound(ROUND, strategy._round.material)
    data = P.record_to_bytes(pairs[0][1].content.array_records[P.UPDATE], P.UPDATE)
    honest = LowRankCodec().decode(data, bound)
    peak = honest.max_abs()
    assert 0 < peak < 1e3
    assert peak >= max(float(t.values.abs().max()) for p in copy.deepcopy(honest).parts()
                       for t in p.tensors.values())
    hostile = LowRankCodec().decode(_powersgd_factors_1e20(strategy, pairs[0][1]), bound)
    assert hostile._parts is None  # not expanded
    assert math.isfinite(hostile.max_abs()) and hostile.max_abs() > MAX_ABS_VALUE
    with pytest.raises(ValueError, match="update too large"):
        check_values(hostile)
    assert hostile._parts is None


@pytest.mark.parametrize("label", sorted(cases()))
def test_no_mutant_reply_stalls_a_round(label: str) -> None:
    """60 mutants of every case's replies (a method, with float32 values where it has a
    value dtype): 0 stalls, some refused and, where the bytes still make a valid reply, some
    accepted."""
    outcome = fuzz_case(label, cases()[label], 60)
    assert outcome.stalls == 0, outcome.first_stall
    assert outcome.mutants >= 60 and sum(outcome.refused.values()) > 0


@pytest.mark.parametrize("how", ["mean", "median", "trimmed_mean", "centered_clip"])
def test_valid_replies_at_the_bound_combine_to_a_finite_step(how: str) -> None:
    """The bound's argument, at its worst: eight clients each adding MAX_ABS_VALUE at every
    coordinate in two overlapping parts (an update and its shared signs), with claims of
    wildly different weights; the combine and 100 steps of momentum 0.99 stay finite, where
    values of 3e38 (finite, each) made the mean Inf."""
    from dgc import SparseTensor
    from fedgc.methods import SparsePayload
    from fedgc.methods.optimizer import ServerOptimizer
    from server.aggregation import Combine

    shapes = {"w": (64, 32), "b": (32,)}

    def payload(value: float) -> SparsePayload:
        update = SparseUpdate.from_dense({n: torch.full(s, value) for n, s in shapes.items()},
                                         "float32", ROUND)
        signs = SparseUpdate({n: SparseTensor(torch.arange(8), torch.full((8,), value), s)
                              for n, s in shapes.items()}, ROUND)
        return SparsePayload(update, [signs])

    weights = [1.0, 1e9, 3.0, 7.0, 1e-3, 2.0, 5.0, 11.0]
    assert payload(MAX_ABS_VALUE).max_abs() == 2 * MAX_ABS_VALUE
    combined = Combine(how)([payload(MAX_ABS_VALUE)] * 8, weights, [1.0] * 8, shapes)
    assert all(torch.isfinite(t).all() for t in combined.values())
    optimizer = ServerOptimizer(1.0, 0.99)
    model = {n: torch.zeros(s) for n, s in shapes.items()}
    for _ in range(100):
        model = optimizer.step(model, combined)
        assert model is not None
    if how == "mean":  # the same replies at 3e38, finite, once summed to Inf
        huge = Combine(how)([payload(3e38)] * 8, weights, [1.0] * 8, shapes)
        assert not all(torch.isfinite(t).all() for t in huge.values())
