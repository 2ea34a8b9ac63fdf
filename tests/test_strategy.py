"""DGCStrategy: equals Flower's FedAvg/FedAvgM on dense updates, rejects bad replies untouched."""

from __future__ import annotations

import math
import struct
import zlib
from collections import OrderedDict

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedAvgM

import dgc
from client.app import app as client_app
from client.app import global_model
from client.state import ClientState
from dgc import DGCCompressor, DGCConfig, SparseTensor, SparseUpdate
from dgc.signs import decode_mask, encode_signs, take_signs
from fedgc import protocol as P
from fedgc.settings import RunConfig
from server.checkpoint import CheckpointError
from server.downlink import copy_model
from server.local_grid import LocalGrid
from server.replies import ReplyChecker
from server.strategy import DGCStrategy
from tests.strategies import make_strategy

NUM_NODES = 4


def _model(seed: int = 0) -> OrderedDict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return OrderedDict([("fc1.weight", torch.randn(40, 30, generator=g)),
                        ("fc1.bias", torch.randn(40, generator=g)),
                        ("fc2.weight", torch.randn(10, 40, generator=g))])


def _strategy(**kw) -> tuple[DGCStrategy, LocalGrid]:
    grid = LocalGrid(client_app, NUM_NODES, seed=5)
    s = make_strategy(clients_per_round=kw.pop("clients_per_round", NUM_NODES), **kw)
    s.registry.register(grid.partition_of)  # what the identification query would learn
    return s, grid


def _reply(msg: Message, content: dict) -> Message:
    return Message(RecordDict(content), reply_to=msg)


def _update_reply(msg: Message, update: SparseUpdate, weight: float = 10.0,
                  data: bytes | None = None) -> Message:
    data = dgc.encode(update) if data is None else data
    return _reply(msg, {P.UPDATE: P.bytes_to_record(data),
                        P.METRICS: MetricRecord({"num-examples": weight,
                                                 "train_loss": 1.0})})


def _locals(global_model, round_seed: int):
    g = torch.Generator().manual_seed(round_seed)
    return [OrderedDict((k, v + 0.1 * torch.randn(v.shape, generator=g))
                        for k, v in global_model.items()) for _ in range(NUM_NODES)]


@pytest.mark.parametrize("server_lr, server_momentum", [(1.0, 0.0), (0.7, 0.9)])
def test_density_one_equals_flower_fedavg(server_lr, server_momentum):
    """Same local models, three rounds: DGCStrategy at density 1 == FedAvg (or FedAvgM)."""
    init = _model()
    ours, grid = _strategy(server_lr=server_lr, server_momentum=server_momentum,
                           downlink="dense")
    if server_momentum == 0.0 and server_lr == 1.0:
        flower = FedAvg(fraction_evaluate=0.0)
    else:
        flower = FedAvgM(fraction_evaluate=0.0, server_learning_rate=server_lr,
                         server_momentum=server_momentum)
    config = DGCConfig(density=1.0, momentum_correction=False, warmup="none",
                       value_dtype="float32")
    compressors = {k: DGCCompressor(config) for k in range(NUM_NODES)}
    ours_arrays = ArrayRecord(OrderedDict((k, v.clone()) for k, v in init.items()))
    flower_arrays = ArrayRecord(OrderedDict((k, v.clone()) for k, v in init.items()))
    weights = [5.0, 17.0, 3.0, 11.0]
    for rnd in (1, 2, 3):
        msgs = list(ours.configure_train(rnd, ours_arrays, ConfigRecord(), grid))
        flower_msgs = list(flower.configure_train(rnd, flower_arrays, ConfigRecord(), grid))
        global_now = ours.model
        locals_ = _locals(global_now, rnd)
        key_of = {m.metadata.dst_node_id: grid.partition_of[m.metadata.dst_node_id]
                  for m in msgs}
        replies = []
        for m in msgs:
            k = key_of[m.metadata.dst_node_id]
            delta = {n: global_now[n] - locals_[k][n] for n in global_now}
            replies.append(_update_reply(m, compressors[k].compress(delta, sequence=rnd),
                                         weights[k]))
        flower_replies = [
            _reply(m, {"arrays": ArrayRecord(OrderedDict(
                (n, t.clone()) for n, t in locals_[grid.partition_of[m.metadata.dst_node_id]]
                .items())), "metrics": MetricRecord(
                    {"num-examples": weights[grid.partition_of[m.metadata.dst_node_id]]})})
            for m in flower_msgs]
        ours_arrays, _ = ours.aggregate_train(rnd, replies)
        flower_arrays, _ = flower.aggregate_train(rnd, flower_replies)
        a, b = ours_arrays.to_torch_state_dict(), flower_arrays.to_torch_state_dict()
        assert list(a) == list(b)
        for n in a:
            torch.testing.assert_close(a[n], b[n].float(), rtol=0, atol=2e-6)
    assert ours.model_version == 3
    assert all(r.status == "aggregated" for r in ours.client_rows)


def _one_round_with(tamper, **kw):
    """Round 1 with three good updates (weight 10) and one tampered; returns the strategy, the
    aggregate, the model that averaging the good ones gives, the model before and the updates
    (the tampered one's as sent to ``tamper``)."""
    init = _model()
    s, grid = _strategy(downlink="dense", **kw)
    msgs = list(s.configure_train(1, ArrayRecord(init), ConfigRecord(), grid))
    config = DGCConfig(density=0.1, warmup="none", value_dtype="float32")
    updates, replies = [], []
    for i, m in enumerate(msgs):
        g = torch.Generator().manual_seed(i)
        delta = {n: torch.randn(v.shape, generator=g) for n, v in init.items()}
        updates.append(DGCCompressor(config).compress(delta, sequence=1))
        replies.append(tamper(m, updates[i]) if i == 0 else _update_reply(m, updates[i]))
    before = OrderedDict((k, v.clone()) for k, v in s.model.items())
    arrays, _ = s.aggregate_train(1, replies)
    avg = dgc.aggregate(updates[1:], [10.0] * 3, {k: v.shape for k, v in init.items()})
    expected = {k: before[k] - avg[k] for k in before}
    return s, arrays, expected, before, updates


def _with_tensor(update: SparseUpdate, name: str, t: SparseTensor) -> SparseUpdate:
    return SparseUpdate({**update.tensors, name: t}, update.sequence)


def _nan_bytes(update: SparseUpdate) -> bytes:
    """Encoded bytes whose fc1.bias values were overwritten with NaN after encoding.

    The encoder refuses NaN, so only a faulty or hostile sender produces such bytes.
    """
    marker = torch.full((40,), 1234.5)
    data = dgc.encode(_with_tensor(update, "fc1.bias",
                                   SparseTensor(torch.arange(40), marker, (40,))))
    pattern = marker.numpy().tobytes()
    assert data.count(pattern) == 1
    body = data[:-4].replace(pattern, torch.full((40,), float("nan")).numpy().tobytes())
    # A consistent checksum, so that the values themselves must be caught.
    return body + struct.pack("<I", zlib.crc32(body))


def _metrics_reply(msg: Message, update: SparseUpdate, **metrics) -> Message:
    """A reply with a good update and these metrics (``num_examples`` is ``num-examples``)."""
    values = {"num-examples": metrics.pop("num_examples", 10), "train_loss": 1.0, **metrics}
    return _reply(msg, {P.UPDATE: P.bytes_to_record(dgc.encode(update)),
                        P.METRICS: MetricRecord(values)})


#: Metrics a client may send that are not data the server can use (issue 14, items 2 and 12):
#: each must be a rejection naming the field, never an exception out of the strategy.
BAD_METRICS = {
    "restored inf": ({"restored": float("inf")}, "restored"),
    "restored NaN": ({"restored": float("nan")}, "restored"),
    "restored list": ({"restored": [1, 2]}, "restored"),
    "restored fraction": ({"restored": 0.5}, "restored"),
    "fractional weight": ({"num_examples": 0.5}, "num-examples"),
    "weight list": ({"num_examples": [3, 4]}, "num-examples"),
    "train_loss list": ({"train_loss": [1.0]}, "train_loss"),
    "train_loss inf": ({"train_loss": float("-inf")}, "train_loss"),
    "negative compute_seconds": ({"compute_seconds": -1.0}, "compute_seconds"),
    "compute_seconds NaN": ({"compute_seconds": float("nan")}, "compute_seconds"),
}

TAMPERS = {
    "malformed bytes": (lambda m, u: _update_reply(m, u, data=b"\x00garbage" * 7),
                        "undecodable"),
    "truncated bytes": (lambda m, u: _update_reply(m, u, data=dgc.encode(u)[:-5]),
                        "undecodable"),
    "wrong shape": (lambda m, u: _update_reply(m, _with_tensor(
        u, "fc1.weight", SparseTensor(torch.tensor([0, 3]), torch.ones(2), (30, 40)))),
        "shape"),
    "unknown tensor": (lambda m, u: _update_reply(m, _with_tensor(
        u, "fc9.weight", SparseTensor(torch.tensor([0]), torch.ones(1), (3,)))), "unknown"),
    "missing tensor": (lambda m, u: _update_reply(m, SparseUpdate(
        {k: v for k, v in u.tensors.items() if k != "fc2.weight"}, 1)), "missing"),
    "NaN values": (lambda m, u: _update_reply(m, u, data=_nan_bytes(u)), "NaN"),
    "zero weight": (lambda m, u: _update_reply(m, u, weight=0.0), "num-examples"),
    "stale sequence": (lambda m, u: _update_reply(m, SparseUpdate(u.tensors, 0)), "sequence"),
    "no metrics": (lambda m, u: _reply(m, {P.UPDATE: P.bytes_to_record(dgc.encode(u))}),
                   "MetricRecord"),
    "dense arrays instead of bytes": (lambda m, u: _reply(m, {
        P.UPDATE: ArrayRecord(_model()), P.METRICS: MetricRecord({"num-examples": 3})}),
        "byte array"),
}


@pytest.mark.parametrize("case", sorted(BAD_METRICS))
def test_bad_metrics_reject_the_reply_and_keep_its_mass_with_the_client(case):
    metrics, word = BAD_METRICS[case]
    s, arrays, expected, _, _ = _one_round_with(lambda m, u: _metrics_reply(m, u, **metrics))
    rejected = [r for r in s.client_rows if r.status == "rejected"]
    assert len(rejected) == 1 and rejected[0].reason.startswith(word)
    assert sum(s.rejections.values()) == 1
    # Not acknowledged: the client folds its update back into its residual next round.
    assert s.registry.acked(rejected[0].client_key) == -1
    assert sorted(s.registry.acked(r.client_key) for r in s.client_rows) == [-1, 1, 1, 1]
    got = arrays.to_torch_state_dict()
    for k in expected:  # exactly the average of the three good updates
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6)


def test_unreported_train_loss_is_accepted_as_nan():
    """The phone bridge reports NaN for a phone that sent no loss: not a reason to reject."""
    s, arrays, expected, _, _ = _one_round_with(
        lambda m, u: _metrics_reply(m, u, train_loss=float("nan"), restored=2.0))
    assert {r.status for r in s.client_rows} == {"aggregated"}
    assert sorted(r.restored for r in s.client_rows) == [0, 0, 0, 2]


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_bad_reply_is_rejected_with_reason_and_never_touches_the_model(case):
    tamper, word = TAMPERS[case]
    s, arrays, expected, _, _ = _one_round_with(tamper)
    rows = {r.status for r in s.client_rows}
    rejected = [r for r in s.client_rows if r.status == "rejected"]
    assert len(rejected) == 1 and rows == {"rejected", "aggregated"}
    reason = rejected[0].reason
    assert word.lower() in reason.lower()
    assert sum(s.rejections.values()) == 1
    record = s.rounds[-1] if s.rounds else s.round_record
    assert record.clients_rejected == 1 and record.clients_failed == 1
    assert record.clients_aggregated == NUM_NODES - 1
    got = arrays.to_torch_state_dict()
    for k in expected:  # exactly the average of the three good updates
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6)


def test_all_replies_bad_leaves_the_model_bit_identical():
    init = _model()
    s, grid = _strategy(downlink="dense")
    msgs = list(s.configure_train(1, ArrayRecord(init), ConfigRecord(), grid))
    before = OrderedDict((k, v.clone()) for k, v in s.model.items())
    replies = [_update_reply(m, SparseUpdate({}, 1), data=b"junk") for m in msgs]
    arrays, metrics = s.aggregate_train(1, replies)
    assert arrays is None
    assert s.model_version == 0
    for k in before:
        assert torch.equal(s.model[k], before[k])
    assert metrics["clients_aggregated"] == 0


def test_error_and_missing_replies_count_as_failures():
    init = _model()
    s, grid = _strategy(downlink="dense")
    msgs = list(s.configure_train(1, ArrayRecord(init), ConfigRecord(), grid))
    update = SparseUpdate.from_dense({k: torch.ones_like(v) for k, v in init.items()},
                                     sequence=1)
    from flwr.app import Error

    replies = [_update_reply(msgs[0], update), Message(Error(2, "boom"), reply_to=msgs[1])]
    s.aggregate_train(1, replies)  # msgs[2], msgs[3]: no reply (timed out)
    statuses = sorted(r.status for r in s.client_rows)
    assert statuses == ["aggregated", "error", "timeout", "timeout"]
    assert s.round_record.clients_failed == 3
    assert [r.reason for r in s.client_rows if r.status == "error"] == ["boom"]
    # Only the aggregated client is acknowledged.
    acked = {k: v.acked for k, v in s.registry.clients.items()}
    assert sorted(acked.values()) == [-1, -1, -1, 1]


def test_the_superlinks_error_for_an_offline_node_counts_for_that_client():
    """The SuperLink answers a message to a node it declared offline itself, under its own id."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.server.superlink.linkstate.utils import (
        create_message_error_unavailable_res_message,
    )

    init = _model()
    s, grid = _strategy(downlink="dense")
    msgs = list(s.configure_train(1, ArrayRecord(init), ConfigRecord(), grid))
    grid.push_messages(msgs)  # gives each message its id, as on the deployment engine
    update = SparseUpdate.from_dense({k: torch.ones_like(v) for k, v in init.items()},
                                     sequence=1)
    offline = create_message_error_unavailable_res_message(msgs[1].metadata, "node_unavail")
    assert offline.metadata.src_node_id == SUPERLINK_NODE_ID != msgs[1].metadata.dst_node_id
    s.aggregate_train(1, [_update_reply(msgs[0], update), offline])
    rows = {r.node_id: r for r in s.client_rows}
    assert rows[msgs[1].metadata.dst_node_id].status == "error"
    assert "Node Unavailable" in rows[msgs[1].metadata.dst_node_id].reason
    assert sorted(r.status for r in s.client_rows) == ["aggregated", "error", "timeout",
                                                       "timeout"]
    assert s.rejections == {}  # not mistaken for a reply from a node that was not sampled


def test_sampling_is_seeded_and_ignores_node_ids():
    a = make_strategy(clients_per_round=3, seed=4)
    keys = list(range(50))
    assert a.registry.sample(7, keys, 3) == make_strategy(clients_per_round=3, seed=4) \
        .registry.sample(7, keys[::-1], 3)
    assert a.registry.sample(7, keys, 3) != a.registry.sample(8, keys, 3)
    over = make_strategy(clients_per_round=10, over_selection=1.3)
    grid = LocalGrid(client_app, 20, seed=5)
    over.registry.register(grid.partition_of)
    assert len(list(over.configure_train(1, ArrayRecord(_model()), ConfigRecord(), grid))) == 13



def test_a_restarted_node_is_messaged_under_its_newest_id():
    """A crashed SuperNode's old id may still be listed online: the newest id of a key wins."""
    s = make_strategy(clients_per_round=2)
    # Node ids are random: the restarted node (key 0) got a larger id than its dead one.
    s.registry.register({100: 0, 500: 1})
    s.registry.register({900: 0})
    assert s.registry.nodes_by_key([100, 500, 900]) == {0: 900, 1: 500}
    assert s.registry.nodes_by_key([100, 500]) == {0: 100, 1: 500}  # only the old id is connected
    s.registry.register({100: 0})  # identified again: newest once more
    assert s.registry.nodes_by_key([100, 500, 900]) == {0: 100, 1: 500}

@pytest.mark.parametrize("kwargs, word", [
    ({"clients_per_round": 0}, "clients_per_round"),
    ({"server_momentum": 1.0}, "server_momentum"),
    ({"server_lr": -1.0}, "server_lr"),
    ({"downlink": "smart"}, "downlink"),
    ({"over_selection": 0.5}, "over_selection"),
])
def test_constructor_validates(kwargs, word):
    """The settings engine checks the values (its error names the run config key)."""
    with pytest.raises(ValueError, match=word):
        make_strategy(**kwargs)


def test_state_dict_round_trip_and_mismatch():
    s, grid = _strategy()
    s.set_model(ArrayRecord(_model()))
    state = s.state_dict()
    other = make_strategy(clients_per_round=NUM_NODES)
    other.set_model(ArrayRecord(_model(1)))
    other.load_state_dict(state)
    assert all(torch.equal(other.model[k], s.model[k]) for k in s.model)
    # A resumed ServerApp knows the nodes' keys without querying them again.
    assert other.registry.node_keys == s.registry.node_keys
    assert len(s.registry.node_keys) == NUM_NODES
    wrong = make_strategy(clients_per_round=NUM_NODES)
    wrong.set_model(ArrayRecord(OrderedDict([("w", torch.zeros(3))])))
    from server.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="does not match"):
        wrong.load_state_dict(state)
    assert list(wrong.model) == ["w"]
    assert math.isclose(float(wrong.model["w"].sum()), 0.0)


# ---------------------------------------------------------------- bounds (issue 14, item 4)
def _hostile_round(tamper, **kw):
    """:func:`_one_round_with`'s round: strategy, new model, model before, the four updates."""
    s, arrays, _, before, updates = _one_round_with(tamper, **kw)
    return s, arrays.to_torch_state_dict(), before, updates


def _moved(arrays, before) -> float:
    return math.sqrt(sum(float((arrays[k] - before[k]).double().square().sum()) for k in before))


def test_a_claim_of_a_trillion_examples_is_capped_at_four_times_the_median():
    s, arrays, before, updates = _hostile_round(lambda m, u: _update_reply(m, u, weight=1e12),
                                                max_weight_ratio=4, max_norm_ratio=10)
    hostile = [r for r in s.client_rows if r.num_examples == 10**12]
    assert len(hostile) == 1 and hostile[0].status == "aggregated"
    assert hostile[0].reason == "weight 1000000000000 capped at 40"
    weights = [40.0, 10.0, 10.0, 10.0]
    keys = sorted(r.client_key for r in s.client_rows)
    order = {r.client_key: i for i, r in enumerate(s.client_rows)}
    avg = dgc.aggregate([updates[order[k]] for k in keys], [weights[order[k]] for k in keys],
                        {k: v.shape for k, v in before.items()})
    for k in before:
        torch.testing.assert_close(arrays[k], before[k] - avg[k], rtol=0, atol=1e-6)


def test_huge_values_are_clipped_to_ten_times_the_median_norm():
    from server.defences import update_norm

    def huge(m, u):
        # 1e15 times: huge, yet under the server's bound on any value (server.replies), which
        # refuses 1e30 times before the defences see it.
        return _update_reply(m, SparseUpdate({n: SparseTensor(t.indices, t.values * 1e15, t.shape)
                                              for n, t in u.tensors.items()}, u.sequence))

    s, arrays, before, updates = _hostile_round(huge, max_weight_ratio=4, max_norm_ratio=10)
    norms = sorted(update_norm(u) for u in updates[1:])
    bound = 10 * norms[1]  # the median of the four is between the good ones' two largest
    # The three good updates (weight 10 each) and the hostile one at most at the bound.
    assert _moved(arrays, before) <= 1.001 * (bound + sum(norms)) * 10 / 40
    clipped = [r for r in s.client_rows if r.reason.startswith("update norm")]
    assert len(clipped) == 1 and "clipped to" in clipped[0].reason
    assert clipped[0].status == "aggregated"


def test_a_huge_sign_scale_is_clipped_with_its_update():
    s, parts, before = _shared_rounds(scale_signs=1e15, max_norm_ratio=10)
    rows = [r for r in s.client_rows if r.round == 2]
    assert [r.reason.startswith("update norm") for r in sorted(rows, key=lambda r: r.client_key)
            ] == [True, False, False, False]
    assert all(r.status == "aggregated" for r in rows)
    moved = math.sqrt(sum(float((s.model[k] - before[k]).double().square().sum())
                          for k in before))
    assert math.isfinite(moved) and moved < 100


def test_a_sign_scale_of_3e38_is_refused_alone():
    """Issue 35: its sum with the update overflowed float32; the reply is refused before the
    defences (server.replies' bound on any value), the round aggregates the others."""
    s, parts, before = _shared_rounds(scale_signs=3e38, max_norm_ratio=10)
    rows = sorted((r for r in s.client_rows if r.round == 2), key=lambda r: r.client_key)
    assert [r.status for r in rows] == ["rejected", "aggregated", "aggregated", "aggregated"]
    assert rows[0].reason.startswith("update too large: its values reach 3e+38")
    expected = _expected([p for p in parts if p[1] != 0], before)
    for k in expected:
        torch.testing.assert_close(s.model[k], expected[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("aggregation", ["median", "trimmed_mean"])
def test_robust_aggregation_runs_in_the_strategy(aggregation):
    def hostile(m, u):
        return _update_reply(m, SparseUpdate({n: SparseTensor(t.indices, t.values * 1e15,
                                                              t.shape)
                                              for n, t in u.tensors.items()}, 1), weight=1e12)

    s, arrays, before, updates = _hostile_round(hostile, aggregation=aggregation,
                                                trim_fraction=0.25, max_norm_ratio=0)
    assert all(r.status == "aggregated" for r in s.client_rows)
    assert _moved(arrays, before) < max(_moved({k: before[k] - u.to_dense()[k] for k in before},
                                               before) for u in updates[1:])


def test_bounds_off_aggregate_the_claims_as_sent():
    s, arrays, before, updates = _hostile_round(lambda m, u: _update_reply(m, u, weight=1e3),
                                                max_weight_ratio=0, max_norm_ratio=0)
    assert all(r.reason == "" for r in s.client_rows)
    assert _moved(arrays, before) > 0.5 * _moved(
        {k: before[k] - updates[0].to_dense()[k] for k in before}, before)


# ---------------------------------------------------------------- the shared sign channel

def _shared_rounds(tamper_signs=None, scale_signs=None, **kw):
    """Round 1 plain, round 2 with index sets; returns the strategy, round-2 replies' parts
    and the model before round 2. ``tamper_signs(data) -> bytes | None`` alters client 0's
    signs (None: it sends none); client 0 sends its signs at scale ``scale_signs``."""
    init = _model()
    s, grid = _strategy(downlink="dense", dgc__shared_density=0.1, dgc__min_sparse_numel=100,
                        **kw)
    config = DGCConfig(density=0.1, warmup="none", value_dtype="float32")
    compressors = [DGCCompressor(config) for _ in range(NUM_NODES)]
    arrays = ArrayRecord(init)
    parts = []
    for rnd in (1, 2):
        msgs = list(s.configure_train(rnd, arrays, ConfigRecord(), grid))
        masks = None
        if rnd == 2:
            assert all(P.SHARED in m.content.array_records for m in msgs)
            data = P.record_to_bytes(msgs[0].content.array_records[P.SHARED], P.SHARED_MASK)
            _, masks = decode_mask(data, {"fc1.weight": 1200, "fc2.weight": 400})
            assert len(masks["fc1.weight"]) == 120 and len(masks["fc2.weight"]) == 40
        else:
            assert not any(P.SHARED in m.content.array_records for m in msgs)
        before = OrderedDict((k, v.clone()) for k, v in s.model.items())
        replies = []
        for m in msgs:
            k = grid.partition_of[m.metadata.dst_node_id]
            g = torch.Generator().manual_seed(10 * rnd + k)
            update = compressors[k].compress({n: torch.randn(v.shape, generator=g)
                                              for n, v in init.items()}, sequence=rnd)
            reply = _update_reply(m, update, weight=float(k + 1))
            signs = None
            if masks is not None:
                signs = take_signs(compressors[k].residual(), masks, rnd)
                if k == 0 and scale_signs is not None:
                    signs = SparseUpdate({n: SparseTensor(t.indices, torch.sign(t.values)
                                                          * scale_signs, t.shape)
                                          for n, t in signs.tensors.items()}, signs.sequence)
                signs_data = encode_signs(signs)
                if k == 0 and tamper_signs is not None:
                    signs_data = tamper_signs(signs_data)
                if signs_data is not None:
                    reply.content[P.SHARED] = P.bytes_to_record(signs_data, P.SHARED_SIGNS)
            replies.append(reply)
            parts.append((rnd, k, update, signs))
        arrays, _ = s.aggregate_train(rnd, replies)
    return s, [p for p in parts if p[0] == 2], before


def _expected(parts, before, skip_signs_of=(), skip_update_of=()):
    shapes = {k: v.shape for k, v in before.items()}
    updates, weights = [], []
    for _, k, update, signs in parts:
        if k in skip_update_of:
            continue
        updates.append(update)
        weights.append(float(k + 1))
        if k not in skip_signs_of:
            updates.append(SparseUpdate({n: SparseTensor(t.indices, t.values, shapes[n])
                                         for n, t in signs.tensors.items()}, 2))
            weights.append(float(k + 1))
    total = sum(float(k + 1) for _, k, _, _ in parts if k not in skip_update_of)
    avg = dgc.aggregate(updates, [w / total for w in weights], shapes, normalize=False)
    return {k: before[k] - avg[k] for k in before}


def test_shared_signs_are_aggregated_with_the_updates():
    s, parts, before = _shared_rounds()
    expected = _expected(parts, before)
    for k in expected:
        torch.testing.assert_close(s.model[k], expected[k], rtol=0, atol=1e-6)
    # Counted uplink includes the signs; each message's downlink includes the index sets.
    rows = [r for r in s.client_rows if r.round == 2]
    assert all(r.status == "aggregated" for r in rows)
    sizes = {k: len(dgc.encode(u)) + len(encode_signs(signs)) for _, k, u, signs in parts}
    assert {r.client_key: r.uplink_bytes for r in rows} == sizes


def test_a_reply_without_signs_is_aggregated_from_its_update_alone():
    s, parts, before = _shared_rounds(tamper_signs=lambda data: None)
    expected = _expected(parts, before, skip_signs_of=(0,))
    for k in expected:
        torch.testing.assert_close(s.model[k], expected[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("tamper, word", [
    (lambda d: d[:-1], "CRC32"),
    (lambda d: d[:20] + bytes([d[20] ^ 0xFF]) + d[21:], "undecodable shared signs"),
    (lambda d: b"FGCM" + d[4:], "magic"),
])
def test_bad_signs_reject_the_whole_reply(tamper, word):
    s, parts, before = _shared_rounds(tamper_signs=tamper)
    rejected = [r for r in s.client_rows if r.status == "rejected"]
    assert len(rejected) == 1 and word.lower() in rejected[0].reason.lower()
    assert rejected[0].reason.startswith("undecodable shared signs")
    expected = _expected(parts, before, skip_update_of=(0,))
    for k in expected:
        torch.testing.assert_close(s.model[k], expected[k], rtol=0, atol=1e-6)


def test_shared_planner_state_survives_a_checkpoint():
    s, _, _ = _shared_rounds()
    other = make_strategy(clients_per_round=NUM_NODES, downlink="dense",
                          dgc__shared_density=0.1, dgc__min_sparse_numel=100)
    other.set_model(ArrayRecord(_model(3)))
    other.load_state_dict(s.state_dict())
    assert {k: v.tolist() for k, v in other.channel.planner.plan().items()} == \
        {k: v.tolist() for k, v in s.channel.planner.plan().items()}


def test_shared_sets_follow_the_layer_policy():
    """The sign channel plans indices for exactly the tensors clients sparsify: with
    sparse_vectors, a bias of min_sparse_numel entries or more as well."""
    for vectors, planned in ((False, {"fc1.weight", "fc2.weight"}),
                             (True, {"fc1.weight", "fc1.bias", "fc2.weight"})):
        s = make_strategy(dgc__shared_density=0.1, dgc__min_sparse_numel=40,
                          dgc__sparse_vectors=vectors)
        s.set_model(ArrayRecord(_model()))
        assert set(s.channel.planner.shapes) == planned


def test_shared_density_is_validated():
    with pytest.raises(ValueError, match="shared_density"):
        make_strategy(dgc__shared_density=1.5)


def _half(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float32)


def test_compressed_broadcast_follows_the_model_by_its_largest_differences():
    """Downlink.follow copies ceil(q * n) matrix entries (the largest differences, rounded to
    float16) and 1-D tensors whole; repeated, it reaches the model up to that rounding: nothing
    the server holds back is lost."""
    s = make_strategy(clients_per_round=2, downlink_density=0.05)
    broadcast = _model(0)
    model = _model(1)
    matrices = sum(v.numel() for v in model.values() if v.dim() > 1)
    step = s.downlink.follow(broadcast, model)
    changed = sum(int((step[k] != broadcast[k]).sum()) for k in model if model[k].dim() > 1)
    assert changed == math.ceil(0.05 * matrices)
    assert torch.equal(step["fc1.bias"], model["fc1.bias"])
    diff = torch.cat([(_half(model[k]) - broadcast[k]).abs().view(-1) for k in model
                      if model[k].dim() > 1])
    threshold = diff.sort(descending=True).values[changed - 1]
    for k in ("fc1.weight", "fc2.weight"):
        moved = step[k] != broadcast[k]
        assert torch.equal(step[k][moved], _half(model[k][moved]))  # the float16 value
        assert bool(((_half(model[k]) - broadcast[k]).abs()[moved] >= threshold).all())
    for _ in range(math.ceil(1 / 0.05)):
        step = s.downlink.follow(step, model)
    assert all(torch.equal(step[k], _half(model[k]) if model[k].dim() > 1 else model[k])
               for k in model)


def test_compressed_broadcast_copies_values_beyond_float16_unrounded():
    s = make_strategy(clients_per_round=2, downlink_density=1e-6)
    broadcast = {"w": torch.zeros(4, 4)}
    model = {"w": torch.zeros(4, 4)}
    model["w"][1, 2] = 1e6  # float16 overflows above 65504
    assert s.downlink.follow(broadcast, model)["w"][1, 2] == 1e6


def test_patches_carry_broadcast_values_in_float16_and_stay_exact():
    """A patch of the compressed broadcast sends its matrix entries as float16 (they are float16
    values), its 1-D tensors as float32, and applying it gives the broadcast bit for bit."""
    start, target = _model(0), _model(1)
    for density in (0.05, 1.0):
        s = make_strategy(clients_per_round=2, downlink_density=density, downlink_history=4)
        s.set_model(ArrayRecord({k: v.clone() for k, v in start.items()}))
        step = SparseUpdate({k: SparseTensor(torch.arange(v.numel()), (v - target[k]).view(-1),
                                             tuple(v.shape)) for k, v in start.items()}, 1)
        s.apply([step], [1.0])  # the global model becomes target
        data = s.downlink.patch((0,))[0]
        patch = dgc.decode(data, max_numel=dgc.wire.MAX_NUMEL)
        held = {k: v.clone() for k, v in start.items()}
        for n, t in patch.tensors.items():
            held[n].view(-1)[t.indices] = t.values.to(torch.float32)
        assert all(torch.equal(held[k], s.sent_model[k]) for k in held)
        dtypes = {n: t.values.dtype for n, t in patch.tensors.items()}
        if density == 1.0:  # the exact broadcast: float32 values
            assert set(dtypes.values()) == {torch.float32}
            continue
        assert dtypes == {"fc1.weight": torch.float16, "fc1.bias": torch.float32,
                          "fc2.weight": torch.float16}
        as_float32 = dgc.encode(SparseUpdate(
            {n: SparseTensor(t.indices, t.values.to(torch.float32), t.shape)
             for n, t in patch.tensors.items()}, patch.sequence))
        matrix_entries = sum(t.indices.numel() for n, t in patch.tensors.items()
                             if n.endswith("weight"))
        assert len(data) == len(as_float32) - 2 * matrix_entries


def _on_grid(t: torch.Tensor, exponent: int) -> bool:
    q = t / 2.0 ** exponent
    return bool(torch.equal(q, q.round()) and q.abs().max() <= 127)


def test_int8_broadcast_follows_the_model_on_a_power_of_two_grid():
    """downlink_values="int8": each matrix gets the step 2**e, 8x headroom over its largest
    initial entry; copied entries are the model's rounded to that grid, and repeated follows
    reach the model up to that rounding."""
    start, model = _model(0), _model(1)
    s = make_strategy(clients_per_round=2, downlink_density=0.05, downlink_values="int8",
                    downlink_deltas=False)
    s.set_model(ArrayRecord({k: v.clone() for k, v in start.items()}))
    for k in ("fc1.weight", "fc2.weight"):
        e = s.downlink.grid_exponents[k]
        assert 127 * 2.0 ** (e - 4) < float(start[k].abs().max()) <= 127 * 2.0 ** (e - 3)
    assert "fc1.bias" not in s.downlink.grid_exponents
    exponents = dict(s.downlink.grid_exponents)
    step = s.downlink.follow(s.downlink.broadcast, model)
    assert s.downlink.grid_exponents == exponents  # the model fits the grid: no step doubled
    matrices = sum(v.numel() for v in model.values() if v.dim() > 1)
    changed = sum(int((step[k] != start[k]).sum()) for k in model if model[k].dim() > 1)
    assert changed == math.ceil(0.05 * matrices)
    for k, e in exponents.items():
        moved = step[k] != start[k]
        assert _on_grid(step[k][moved], e)
        assert torch.equal(step[k][moved], (model[k][moved] / 2.0 ** e).round() * 2.0 ** e)
    assert torch.equal(step["fc1.bias"], model["fc1.bias"])
    for _ in range(math.ceil(1 / 0.05)):
        step = s.downlink.follow(step, model)
    for k, e in exponents.items():
        assert torch.equal(step[k], (model[k] / 2.0 ** e).round() * 2.0 ** e + 0.0)


def test_int8_grid_step_doubles_when_the_model_outgrows_it_and_moves_the_whole_tensor():
    start = _model(0)
    s = make_strategy(clients_per_round=2, downlink_density=0.01, downlink_values="int8",
                    downlink_history=4, downlink_deltas=False)
    s.set_model(ArrayRecord({k: v.clone() for k, v in start.items()}))
    e, e_fc1 = s.downlink.grid_exponents["fc2.weight"], s.downlink.grid_exponents["fc1.weight"]
    grown = {k: v.clone() for k, v in start.items()}
    grown["fc2.weight"][0, 0] = 127 * 2.0 ** e * 1.5  # beyond the grid: the step doubles
    step = SparseUpdate({k: SparseTensor(torch.arange(v.numel()), (v - grown[k]).view(-1),
                                         tuple(v.shape)) for k, v in start.items()}, 1)
    s.apply([step], [1.0])
    assert s.downlink.grid_exponents["fc2.weight"] == e + 1
    assert s.downlink.grid_exponents["fc1.weight"] == e_fc1  # fc1 keeps its own step
    sent = s.sent_model["fc2.weight"]
    assert _on_grid(sent, e + 1)
    assert torch.equal(sent, (grown["fc2.weight"] / 2.0 ** (e + 1)).round() * 2.0 ** (e + 1)
                       + 0.0)
    # fc1.weight moved in only ceil(0.01 * n) entries at most; fc2.weight whole.
    patch = dgc.decode(s.downlink.patch((0,))[0], max_numel=dgc.wire.MAX_NUMEL)
    assert patch.tensors["fc2.weight"].nnz == int((sent != start["fc2.weight"]).sum())
    assert patch.tensors["fc2.weight"].nnz > 0.9 * sent.numel()


def test_int8_patches_carry_a_byte_or_less_per_matrix_entry_and_stay_exact():
    start, target = _model(0), _model(1)
    patches = {}
    for values in ("float16", "int8"):
        s = make_strategy(clients_per_round=2, downlink_density=0.05, downlink_history=4,
                        downlink_values=values, downlink_deltas=False)
        s.set_model(ArrayRecord({k: v.clone() for k, v in start.items()}))
        step = SparseUpdate({k: SparseTensor(torch.arange(v.numel()), (v - target[k]).view(-1),
                                             tuple(v.shape)) for k, v in start.items()}, 1)
        s.apply([step], [1.0])
        data = s.downlink.patch((0,))[0]
        held = {k: v.clone() for k, v in start.items()}
        for n, t in dgc.decode(data, max_numel=dgc.wire.MAX_NUMEL).tensors.items():
            held[n].view(-1)[t.indices] = t.values.to(torch.float32)
        assert all(torch.equal(held[k].view(torch.int32), s.sent_model[k].view(torch.int32))
                   for k in held)
        patches[values] = (data, dgc.decode(data, max_numel=dgc.wire.MAX_NUMEL))
    (half, half_patch), (grid, grid_patch) = patches["float16"], patches["int8"]
    assert dgc.wire.tensor_codings(grid) == dgc.wire.tensor_codings(half)
    matrix_entries = sum(t.nnz for n, t in grid_patch.tensors.items() if n.endswith("weight"))
    assert matrix_entries == sum(t.nnz for n, t in half_patch.tensors.items()
                                 if n.endswith("weight"))
    index_bytes = {d: sum(dgc.wire.index_bits(t.indices, math.prod(t.shape), "auto") // 8
                          for t in p.tensors.values()) for d, p in
                   (("half", half_patch), ("grid", grid_patch))}
    # As many entries move (ranked on different grids, so not the very same ones): the values
    # shrink from two bytes to one (plus a 4-byte scale per matrix) or, Rice-coded, less.
    assert len(grid) - index_bytes["grid"] <= len(half) - index_bytes["half"] \
        - matrix_entries + 2 * 4


def test_int8_broadcast_state_survives_a_checkpoint_and_refuses_the_other_grid():
    start = _model(0)
    s = make_strategy(clients_per_round=2, downlink_density=0.05, downlink_values="int8")
    s.set_model(ArrayRecord({k: v.clone() for k, v in start.items()}))
    s.downlink.grid_exponents["fc2.weight"] += 1  # as after a doubling
    state = s.state_dict()
    again = make_strategy(clients_per_round=2, downlink_density=0.05, downlink_values="int8")
    again.set_model(ArrayRecord({k: v.clone() for k, v in start.items()}))
    again.load_state_dict(state)
    assert again.downlink.grid_exponents == s.downlink.grid_exponents
    other = make_strategy(clients_per_round=2, downlink_density=0.05)
    # The run config differs first (the downlink's own check names the grid, when none is kept).
    with pytest.raises(CheckpointError, match="downlink_values = 'int8' \\(now 'float16'\\)"):
        other.load_state_dict(state)


@pytest.mark.parametrize("bad", ["int4", "Int8", 8])
def test_downlink_values_must_be_a_known_grid(bad):
    with pytest.raises(ValueError, match="downlink_values( = .* outside the accepted range one "
                                         "of| must be a string)"):
        make_strategy(downlink_values=bad)


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, 1.01, True, "x"])
def test_downlink_density_must_be_in_zero_one(bad):
    with pytest.raises(ValueError, match="downlink_density( = .* outside the accepted range "
                                         "\\(0, 1\\]| must be a number)"):
        make_strategy(downlink_density=bad)


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_decoding_the_round_at_once_rejects_and_aggregates_as_one_by_one(case, monkeypatch):
    tamper, _ = TAMPERS[case]
    s, arrays, _, _, _ = _one_round_with(tamper)
    assert arrays is not None
    batched = [(r.status, r.reason) for r in s.client_rows]
    # Without the pre-pass, validate_reply decodes each reply itself.
    monkeypatch.setattr(ReplyChecker, "_decode",
                        lambda self, replies, bound: [None] * len(replies))
    s1, arrays1, _, _, _ = _one_round_with(tamper)
    assert [(r.status, r.reason) for r in s1.client_rows] == batched
    assert s1.rejections == s.rejections
    got, want = arrays.to_torch_state_dict(), arrays1.to_torch_state_dict()
    for k in want:
        assert torch.equal(got[k], want[k])


# ---------------------------------------------------------------- int8 deltas (downlink_deltas)
def _int8_run(rounds: int, history: int = 10, move: float = 0.05, grow_at: int | None = None):
    """An int8-broadcast strategy after ``rounds`` aggregations of small random moves (the
    step of fc2.weight doubling at round ``grow_at``), with every version it sent."""
    start = _model(0)
    s = make_strategy(clients_per_round=2, downlink_density=0.1, downlink_values="int8",
                      downlink_history=history)
    s.set_model(ArrayRecord({k: v.clone() for k, v in start.items()}))
    versions = {0: {k: v.clone() for k, v in s.sent_model.items()}}
    g = torch.Generator().manual_seed(3)
    for rnd in range(1, rounds + 1):
        step = {k: move * torch.randn(v.shape, generator=g) for k, v in start.items()}
        if rnd == grow_at:
            e = s.downlink.grid_exponents["fc2.weight"]
            step["fc2.weight"][0, 0] = float(s.model["fc2.weight"][0, 0]) - 127 * 2.0 ** e * 1.5
        s.apply([SparseUpdate({k: SparseTensor(torch.arange(v.numel()), v.view(-1),
                                               tuple(v.shape)) for k, v in step.items()},
                              rnd)], [1.0])
        versions[s.model_version] = {k: v.clone() for k, v in s.sent_model.items()}
    return s, versions


def _apply_patch(s: DGCStrategy, held: dict, bases: tuple[int, ...],
                 version: int | None = None) -> tuple[dict, list[str]]:
    """What a client holding ``held`` (version ``version``, default the newest base) builds
    from the patch on ``bases`` (client.app's code)."""
    data, added = s.downlink.patch(bases)
    config = ConfigRecord({P.DOWNLINK: "patch", P.BASE_VERSION: bases[-1],
                           P.BASE_VERSIONS: list(bases), P.MODEL_VERSION: s.model_version})
    if added:
        config[P.PATCH_ADD] = added
    content = RecordDict({P.ARRAYS: P.bytes_to_record(data, P.PATCH), P.CONFIG: config})
    record = ClientState(model={k: v.clone() for k, v in held.items()},
                         model_version=bases[-1] if version is None else version)
    return global_model(content, config, record), added


def _bits_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32),
                                                    b[k].view(torch.int32)) for k in a)


def test_int8_deltas_put_version_0_on_the_grid_as_clients_build_it():
    from dgc.int8_grid import round_initial
    s, versions = _int8_run(0)
    start = _model(0)
    assert _bits_equal(versions[0], round_initial(start))  # what a client rounds it to
    for k, e in s.downlink.grid_exponents.items():
        assert _on_grid(versions[0][k], e) and not torch.equal(versions[0][k], start[k])
    assert torch.equal(versions[0]["fc1.bias"], start["fc1.bias"])  # 1-D: unrounded
    assert torch.equal(s.model["fc1.weight"], start["fc1.weight"])  # the global model is not


def test_int8_delta_patches_rebuild_every_version_bit_for_bit_and_are_smaller():
    s, versions = _int8_run(8, grow_at=5)
    grown = s.downlink.grid_exponents["fc2.weight"]
    assert grown == _int8_run(0)[0].downlink.grid_exponents["fc2.weight"] + 1
    any_added = set()
    for base in range(0, s.model_version):
        rebuilt, added = _apply_patch(s, versions[base], (base,))
        assert _bits_equal(rebuilt, versions[s.model_version]), base
        any_added |= set(added)
        assert "fc1.bias" not in added  # float32, not on a grid: values
        if added:  # smaller than the same entries as values
            changed = {n: s.downlink.changed_at[n].view(-1) > base for n in s.sent_model}
            values = dgc.encode(SparseUpdate(
                {n: SparseTensor(torch.nonzero(changed[n]).view(-1), t.view(-1)[changed[n]],
                                 tuple(t.shape))
                 for n, t in s.sent_model.items()}, s.model_version), grid_coding=True)
            assert len(s.downlink.patch((base,))[0]) < len(values)
    assert any_added == {"fc1.weight", "fc2.weight"}
    # From before the doubling, fc2.weight's entry that outgrew the grid moved by more than 127
    # of the old steps: no int8 grid holds the differences, and that tensor carries values.
    assert _apply_patch(s, versions[4], (4,))[1] == ["fc1.weight"]
    assert _apply_patch(s, versions[5], (5,))[1] == ["fc1.weight", "fc2.weight"]


def test_int8_patch_on_several_versions_carries_values():
    s, versions = _int8_run(4)
    for held in (2, 3):
        rebuilt, added = _apply_patch(s, versions[held], (2, 3), held)
        assert added == [] and _bits_equal(rebuilt, versions[4])


def test_int8_delta_history_is_bounded_and_survives_a_checkpoint(monkeypatch):
    s, versions = _int8_run(6, history=3)
    assert list(s.downlink.past) == [4, 5, 6]  # a patch spans at most 3 versions
    assert s.downlink.patch((2,)) is None and s.downlink.patch((3,))[1]
    state = s.state_dict()
    again = make_strategy(clients_per_round=2, downlink_density=0.1, downlink_values="int8",
                          downlink_history=3)
    again.set_model(ArrayRecord({k: v.clone() for k, v in _model(0).items()}))
    again.load_state_dict(state)
    assert again.downlink.patch((3,)) == s.downlink.patch((3,))
    assert _bits_equal(_apply_patch(again, versions[3], (3,))[0], versions[6])
    # Beyond the byte budget the oldest versions go: patches on them carry values.
    monkeypatch.setattr("server.downlink.DELTA_HISTORY_BYTES", 1)
    tight, versions = _int8_run(3)
    assert list(tight.downlink.past) == []
    rebuilt, added = _apply_patch(tight, versions[1], (1,))
    assert added == [] and _bits_equal(rebuilt, versions[3])
    other = make_strategy(clients_per_round=2, downlink_density=0.1, downlink_values="int8",
                          downlink_history=3, downlink_deltas=False)
    other.set_model(ArrayRecord({k: v.clone() for k, v in _model(0).items()}))
    kept = (copy_model(other.model), copy_model(other.downlink.broadcast),
            dict(other.downlink.grid_exponents))
    with pytest.raises(CheckpointError, match="downlink_deltas = True \\(now False\\)"):
        other.load_state_dict(state)
    # A refused checkpoint changes nothing.
    assert _bits_equal(other.model, kept[0]) and _bits_equal(other.downlink.broadcast, kept[1])
    assert other.downlink.grid_exponents == kept[2] and other.model_version == 0


@pytest.mark.parametrize("bad", ["maybe", 2, None])
def test_downlink_deltas_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="downlink_deltas must be a boolean"):
        DGCStrategy(RunConfig.from_flat({"downlink_deltas": bad}))


# ---------------------------------------------------------------- downlink_lookahead
def _step(model, seed: int) -> SparseUpdate:
    g = torch.Generator().manual_seed(seed)
    return SparseUpdate({k: SparseTensor(torch.arange(v.numel()),
                                         0.1 * torch.randn(v.numel(), generator=g),
                                         tuple(v.shape)) for k, v in model.items()}, seed)


def test_broadcast_looks_ahead_along_the_server_momentum():
    """downlink_lookahead a: the broadcast follows G - a * lr * m * buf, not G; G itself is
    the same either way; without server momentum there is nothing to look ahead along."""
    start = _model(0)
    runs = {}
    for look, momentum in ((0.0, 0.9), (1.0, 0.9), (0.5, 0.9), (1.0, 0.0)):
        s = make_strategy(clients_per_round=2, downlink_density=0.05, server_momentum=momentum,
                        server_lr=0.7, downlink_lookahead=look)
        s.set_model(ArrayRecord({k: v.clone() for k, v in start.items()}))
        previous = None
        for rnd in (1, 2, 3):
            previous = copy_model(s.downlink.broadcast)
            s.apply([_step(start, rnd)], [1.0])
        runs[look, momentum] = (s, previous)
    plain = runs[0.0, 0.9][0]
    for look in (1.0, 0.5):
        s, previous = runs[look, 0.9]
        assert all(torch.equal(s.model[k], plain.model[k]) for k in start)
        heading = OrderedDict((k, v - look * 0.7 * 0.9 * s.optimizer.buffer[k])
                              for k, v in s.model.items())
        expected = plain.downlink.follow(previous, heading)
        assert all(torch.equal(s.downlink.broadcast[k], expected[k]) for k in start)
        assert any(not torch.equal(s.downlink.broadcast[k], plain.downlink.broadcast[k])
                   for k in start)
    no_momentum = runs[1.0, 0.0][0]
    followed = make_strategy(clients_per_round=2, downlink_density=0.05, server_lr=0.7)
    followed.set_model(ArrayRecord({k: v.clone() for k, v in start.items()}))
    for rnd in (1, 2, 3):
        followed.apply([_step(start, rnd)], [1.0])
    assert all(torch.equal(no_momentum.downlink.broadcast[k], followed.downlink.broadcast[k])
               for k in start)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "x"])
def test_downlink_lookahead_must_be_in_zero_one(bad):
    with pytest.raises(ValueError, match="downlink_lookahead( = .* outside the accepted range "
                                         "\\[0, 1\\]| must be a number)"):
        make_strategy(downlink_lookahead=bad)
