"""The ClientApp on real Flower messages: replies, restore of unacknowledged updates, patches."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

import dgc
from client.app import app as client_app
from client.state import ClientStateStore
from dgc.signs.codec import decode_signs, encode_mask
from fedgc import protocol as P
from fedgc.settings import RunConfig, TrainSettings, to_flat
from server.local_grid import LocalGrid

#: The keys of dgc (and the other sparsifiers) these tests give without their prefix.
_DGC_KEYS = ("small_density", "small_numel", "selection", "ternary")


def _settings(tmp_path, base: RunConfig | None = None, **kw) -> RunConfig:
    """A run's keys for these clients, or ``base`` with ``kw`` replaced (dgc's keys of
    :data:`_DGC_KEYS` named without their prefix)."""
    keys = {f"dgc.{k}" if k in _DGC_KEYS else k: v for k, v in kw.items()}
    if base is not None:
        return base.with_overrides(keys)
    return RunConfig.from_flat({
        "task": "digits", "num_clients": 3, "partition": "iid", "clients_per_round": 3,
        "density": 0.05, "dgc.warmup": "none", "state_dir": str(tmp_path / "state"),
        "results_dir": str(tmp_path), "run_name": "t", **keys})


def _send(grid: LocalGrid, key: int, settings: RunConfig, server_round: int, ack: int,
          arrays: ArrayRecord, shared: bytes | None = None, **extra) -> Message:
    node = next(n for n, k in grid.partition_of.items() if k == key)
    keys = {**settings.client_config(), P.SERVER_ROUND: server_round, P.MODEL_VERSION: 0,
            P.ACK_SEQUENCE: ack, P.DOWNLINK: "dense", **extra}
    cfg = ConfigRecord({k: v for k, v in keys.items() if v is not None})  # None: left out
    content = RecordDict({P.ARRAYS: arrays, P.CONFIG: cfg})
    if shared is not None:
        content[P.SHARED] = P.bytes_to_record(shared, P.SHARED_MASK)
    msg = Message(content, dst_node_id=node, message_type=MessageType.TRAIN)
    (reply,) = grid.send_and_receive([msg])
    return reply


def _global() -> ArrayRecord:
    from tasks import get_task

    torch.manual_seed(0)
    return ArrayRecord(get_task("digits").build_model().state_dict())


@pytest.mark.parametrize("method", ["dense", "topk", "dgc"])
def test_reply_carries_encoded_update_and_metrics(tmp_path, method):
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method=method)
    reply = _send(grid, 1, s, 1, -1, _global())
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    m = reply.content.metric_records[P.METRICS]
    assert tuple(m) == P.REPLY_METRICS  # only what the server reads (nothing restored)
    data = P.record_to_bytes(reply.content.array_records[P.UPDATE])
    update = dgc.decode(data, max_numel=dgc.wire.MAX_NUMEL)
    assert update.sequence == 1 and m[P.NUM_EXAMPLES] > 0
    if method == "dense":
        assert update.density == 1.0
    else:
        assert update.density < 0.2
    # Only DGC keeps a residual and a pending update between rounds.
    record = ClientStateStore(s.train.state_dir).get("1")
    assert ("pending" in record) == (method == "dgc")


def _residual(settings: RunConfig, key: str) -> dict[str, torch.Tensor]:
    """The stored residual of a client, read back through the compressor its settings build."""
    compressor = settings.method.compressor(settings.train, 0)
    compressor.load_state_dict(ClientStateStore(settings.train.state_dir).get(key)["compressor"])
    return compressor.residual()


def _sent_plus_residual(grid: LocalGrid, settings: RunConfig, server_round: int, ack: int,
                        **extra) -> tuple[Message, dict[str, torch.Tensor]]:
    """Client 0's reply to a train message, and what it sent plus its residual after it (flat,
    per tensor): with the ack or without it, the difference is the share folded back."""
    reply = _send(grid, 0, settings, server_round, ack, _global(), **extra)
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    sent = dgc.decode(P.record_to_bytes(reply.content.array_records[P.UPDATE]),
                      max_numel=dgc.wire.MAX_NUMEL).to_dense()
    resid = _residual(settings, "0")
    return reply, {k: sent[k].reshape(-1) + resid[k] for k in sent}


@pytest.mark.parametrize("small_density, ternary", [(0.0, False), (0.1, False), (0.1, True)])
def test_unacknowledged_update_is_folded_back_exactly(tmp_path, small_density, ternary):
    """(sent + residual) without the ack exceeds the acked case by exactly the share of the
    pending update dgc folds back (its default, ``unaggregated = decay``: half, one round old).

    With ``small_density`` > 0 the state is a TwoDensityCompressor's (the output layer of the
    digits MLP, 2,000 entries, is a small tensor; the 12,800-entry hidden layer is not). With
    ``ternary`` the pending update is sign-coded.
    """
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc", small_density=small_density, ternary=ternary)
    first = _send(grid, 0, s, 1, -1, _global())
    pending = dgc.decode(P.record_to_bytes(first.content.array_records[P.UPDATE]),
                         max_numel=dgc.wire.MAX_NUMEL)
    shutil.copytree(tmp_path / "state", tmp_path / "state_b")
    s_b = _settings(tmp_path, s, state_dir=str(tmp_path / "state_b"))

    (acked_reply, acked), (lost_reply, lost) = (_sent_plus_residual(grid, s, 2, 1),
                                                _sent_plus_residual(grid, s_b, 2, -1))
    for reply, restored in ((acked_reply, 0), (lost_reply, 1)):
        assert reply.content.metric_records[P.METRICS].get(P.RESTORED, 0) == restored
    p = pending.to_dense()
    for k in acked:
        torch.testing.assert_close(lost[k] - acked[k], 0.5 * p[k].reshape(-1), rtol=0,
                                   atol=1e-5)
    assert any(float(p[k].abs().sum()) > 0 for k in p)


@pytest.mark.parametrize("method", ["topk", "dgc"])
@pytest.mark.parametrize("small_density, small_nnz", [(0.0, 100), (0.1, 200), (0.5, 1000)])
def test_small_tensors_get_their_own_density(tmp_path, method, small_density, small_nnz):
    """dgc.small_density sets the entries of the 10x200 output layer; the hidden layer keeps
    density (ceil(0.05 * 12,800) = 640); biases are sent dense."""
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method=method, small_density=small_density, selection="exact")
    reply = _send(grid, 1, s, 1, -1, _global())
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    update = dgc.decode(P.record_to_bytes(reply.content.array_records[P.UPDATE]),
                        max_numel=dgc.wire.MAX_NUMEL)
    nnz = {k: int(t.indices.numel()) for k, t in update.tensors.items()}
    assert nnz == {"net.1.weight": 640, "net.1.bias": 200, "net.3.weight": small_nnz,
                   "net.3.bias": 10}


def test_small_numel_decides_which_tensors_are_small(tmp_path):
    """With dgc.small_numel above 12,800 the hidden layer, too, gets dgc.small_density."""
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, small_density=0.1, small_numel=12_800, selection="exact")
    reply = _send(grid, 1, s, 1, -1, _global())
    update = dgc.decode(P.record_to_bytes(reply.content.array_records[P.UPDATE]),
                        max_numel=dgc.wire.MAX_NUMEL)
    assert int(update.tensors["net.1.weight"].indices.numel()) == 1280
    assert int(update.tensors["net.3.weight"].indices.numel()) == 200


def test_state_of_the_other_compressor_kind_is_an_error_reply(tmp_path):
    """A stored single-density state under two-density settings fails loudly, keeps the record."""
    grid = LocalGrid(client_app, 3)
    one = _settings(tmp_path, small_density=0.0)
    assert not _send(grid, 0, one, 1, -1, _global()).has_error()
    before = ClientStateStore(one.train.state_dir).get("0")
    reply = _send(grid, 0, _settings(tmp_path, one, small_density=0.1), 2, 1, _global())
    assert reply.has_error() and "TwoDensityCompressor" in reply.error.reason
    after = ClientStateStore(one.train.state_dir).get("0")
    assert torch.equal(after["pending"], before["pending"])
    for k, v in before["compressor"]["memory"]["v"].items():
        assert torch.equal(after["compressor"]["memory"]["v"][k], v)


def test_patch_for_a_version_the_client_lacks_is_an_error_reply(tmp_path):
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path)
    patch = dgc.encode(dgc.SparseUpdate({}, 0))
    reply = _send(grid, 2, s, 1, -1, P.bytes_to_record(patch, P.PATCH),
                  **{P.DOWNLINK: "patch", P.BASE_VERSION: 7})
    assert reply.has_error()
    assert "version 7" in reply.error.reason and "holds version None" in reply.error.reason
    assert ClientStateStore(s.train.state_dir).get("2") is None  # nothing was stored


def test_missing_state_dir_is_an_error_reply(tmp_path):
    grid = LocalGrid(client_app, 3)
    reply = _send(grid, 0, _settings(tmp_path), 1, -1, _global(), state_dir="")
    assert reply.has_error() and "state_dir" in reply.error.reason


def test_query_reports_the_partition_id():
    grid = LocalGrid(client_app, 3)
    node = next(iter(grid.get_node_ids()))
    msg = Message(RecordDict({P.CONFIG: ConfigRecord({})}), dst_node_id=node,
                  message_type=MessageType.QUERY)
    (reply,) = grid.send_and_receive([msg])
    assert reply.content.metric_records[P.METRICS][P.CLIENT_KEY] == grid.partition_of[node]


def _update_bytes(reply: Message) -> bytes:
    assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
    return P.record_to_bytes(reply.content.array_records[P.UPDATE])


def test_a_re_sent_round_gets_the_same_reply_and_leaves_the_state_alone(tmp_path):
    """A ServerApp resumed from the checkpoint before round 2 sends round 2 again.

    The client already trained round 2 on model version 1: it must answer with the very bytes it
    sent (retraining would fold its pending update back into the residual and send it twice), and
    accept the re-sent patch from version 0 to the version 1 it already holds.
    """
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc")
    _send(grid, 0, s, 1, -1, _global(), **{P.KEEP_MODEL: True})
    second = _send(grid, 0, s, 2, 1, _global(), **{P.KEEP_MODEL: True, P.MODEL_VERSION: 1})
    store = ClientStateStore(s.train.state_dir)
    before = _residual(s, "0")
    patch = dgc.encode(dgc.SparseUpdate({}, 0))
    again = _send(grid, 0, s, 2, 1, P.bytes_to_record(patch, P.PATCH),
                  **{P.KEEP_MODEL: True, P.MODEL_VERSION: 1, P.DOWNLINK: "patch",
                     P.BASE_VERSION: 0})
    assert _update_bytes(again) == _update_bytes(second)
    m_again, m_first = (r.content.metric_records[P.METRICS] for r in (again, second))
    assert {k: m_again[k] for k in P.REPLY_METRICS if k != "compute_seconds"} == \
        {k: m_first[k] for k in P.REPLY_METRICS if k != "compute_seconds"}
    after = _residual(s, "0")
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert int(store.get("0")["reply"]["sequence"]) == 2


def test_a_patch_to_the_version_the_client_holds_trains_on_the_held_model(tmp_path):
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc")
    _send(grid, 1, s, 1, -1, _global(), **{P.KEEP_MODEL: True, P.MODEL_VERSION: 4})
    shutil.copytree(tmp_path / "state", tmp_path / "state_b")
    s_b = _settings(tmp_path, s, state_dir=str(tmp_path / "state_b"))
    patch = dgc.encode(dgc.SparseUpdate({}, 0))
    # Round 2 on version 4 again: a patch "from 3 to 4" needs nothing the client lacks.
    via_patch = _send(grid, 1, s, 2, 1, P.bytes_to_record(patch, P.PATCH),
                      **{P.MODEL_VERSION: 4, P.DOWNLINK: "patch", P.BASE_VERSION: 3})
    via_dense = _send(grid, 1, s_b, 2, 1, _global(), **{P.MODEL_VERSION: 4})
    assert _update_bytes(via_patch) == _update_bytes(via_dense)


def test_a_round_answered_on_another_model_version_is_trained_again(tmp_path):
    """Same round number but a different model version is not a re-send: fold back and train."""
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc")
    _send(grid, 2, s, 1, -1, _global())
    reply = _send(grid, 2, s, 1, -1, _global(), **{P.MODEL_VERSION: 9})
    assert _update_bytes(reply)
    assert reply.content.metric_records[P.METRICS]["restored"] == 1


# ---------------------------------------------------------------- the shared sign channel

#: Shared index sets for the digits MLP: 64 of the hidden layer's 12,800, 20 of the 2,000 output.
_MASKS = {"net.1.weight": np.arange(0, 12_800, 200, dtype=np.int64),
          "net.3.weight": np.arange(0, 2_000, 100, dtype=np.int64)}
_NUMELS = {"net.1.weight": 12_800, "net.3.weight": 2_000}


def _signs(reply: Message) -> dgc.SparseUpdate:
    data = P.record_to_bytes(reply.content.array_records[P.SHARED], P.SHARED_SIGNS)
    return decode_signs(data, _MASKS, {k: (n,) for k, n in _NUMELS.items()})


@pytest.mark.parametrize("small_density", [0.0, 0.1])
def test_shared_signs_leave_the_residual_and_are_counted(tmp_path, small_density):
    """Same start, same training: with index sets the residual is short by exactly the signs."""
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc", small_density=small_density)
    _send(grid, 0, s, 1, -1, _global())
    shutil.copytree(tmp_path / "state", tmp_path / "state_b")
    s_b = _settings(tmp_path, s, state_dir=str(tmp_path / "state_b"))
    with_mask = _send(grid, 0, s, 2, 1, _global(), shared=encode_mask(_MASKS, _NUMELS, 2))
    without = _send(grid, 0, s_b, 2, 1, _global())
    assert P.SHARED not in without.content.array_records
    m = with_mask.content.metric_records[P.METRICS]
    signs = _signs(with_mask)
    signs_bytes = len(P.record_to_bytes(with_mask.content.array_records[P.SHARED],
                                        P.SHARED_SIGNS))
    assert tuple(m) == P.REPLY_METRICS  # sizes and counts are the server's to read
    assert sum(len(t.indices) for t in signs.tensors.values()) == 84
    # A bit per sign: preamble 17, per tensor name (2 + 12), count and scale 12, the signs
    # (64 and 20 bits), CRC 4.
    assert signs.sequence == 2 and signs_bytes == 17 + (26 + 8) + (26 + 3) + 4
    # The top-k part is the same; the residual differs by exactly what the signs carried.
    assert P.record_to_bytes(with_mask.content.array_records[P.UPDATE]) == \
        P.record_to_bytes(without.content.array_records[P.UPDATE])
    r, r_b = _residual(s, "0"), _residual(s_b, "0")
    sent = signs.to_dense()
    for k in r:
        torch.testing.assert_close(r_b[k] - r[k], sent[k].reshape(-1) if k in sent
                                   else torch.zeros_like(r[k]), rtol=0, atol=1e-6)
    assert float(sent["net.1.weight"].abs().sum()) > 0


def test_unacknowledged_signs_are_folded_back_with_the_update(tmp_path):
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc", small_density=0.1)
    first = _send(grid, 0, s, 1, -1, _global(), shared=encode_mask(_MASKS, _NUMELS, 1))
    pending = dgc.decode(P.record_to_bytes(first.content.array_records[P.UPDATE]),
                         max_numel=dgc.wire.MAX_NUMEL).to_dense()
    pending_signs = _signs(first).to_dense()
    shutil.copytree(tmp_path / "state", tmp_path / "state_b")
    s_b = _settings(tmp_path, s, state_dir=str(tmp_path / "state_b"))

    (_, acked), (_, lost) = (_sent_plus_residual(grid, s, 2, 1),
                             _sent_plus_residual(grid, s_b, 2, -1))
    for k in acked:
        expected = pending[k].reshape(-1)
        if k in pending_signs:
            expected = expected + pending_signs[k].reshape(-1)
        # dgc's default share of an unaggregated update one round old: half, signs included.
        torch.testing.assert_close(lost[k] - acked[k], 0.5 * expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("in_versions, share", [(True, 0.5), (False, 0.5 ** 10)],
                         ids=["async", "sync"])
def test_an_async_dispatch_ages_an_unaggregated_update_in_model_versions(tmp_path, in_versions,
                                                                         share):
    """Issue 37: under async the loop spends a dispatch sequence per fill, about K per applied
    step. A client whose update (sequence 1, model version 0) was dropped, dispatched again
    in the next step (sequence 11 with K = 10, model version 1), folds back dgc's default
    ``0.5 ** 1`` of it when the dispatch says ``age_in_versions``; a message without it (a
    sync round's) ages it in sequences as before: ``0.5 ** 10``."""
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc")
    first = _send(grid, 0, s, 1, -1, _global())
    pending = dgc.decode(P.record_to_bytes(first.content.array_records[P.UPDATE]),
                         max_numel=dgc.wire.MAX_NUMEL).to_dense()
    shutil.copytree(tmp_path / "state", tmp_path / "state_b")
    s_b = _settings(tmp_path, s, state_dir=str(tmp_path / "state_b"))
    extra = {P.MODEL_VERSION: 1, **({P.AGE_IN_VERSIONS: True} if in_versions else {})}
    (_, acked), (_, lost) = (_sent_plus_residual(grid, s, 11, 1, **extra),
                             _sent_plus_residual(grid, s_b, 11, -1, **extra))
    for k in acked:
        torch.testing.assert_close(lost[k] - acked[k], share * pending[k].reshape(-1), rtol=0,
                                   atol=1e-6)
    assert max(float(p.abs().max()) for p in pending.values()) > 1e-3  # the shares differ


@pytest.mark.parametrize("in_versions", [True, False], ids=["async", "sync"])
def test_an_async_dispatch_ages_a_residual_in_model_versions(tmp_path, in_versions):
    """``dgc.residual_decay`` scales a residual by its rounds away: under async those are
    applied steps, as for an unaggregated update. A client that answered sequence 1 (model
    version 0, acknowledged) and is dispatched at sequence 11 on version 1 is 0 steps away
    under async (its residual kept whole: the same as with no decay) and 9 rounds away in a
    sync message (decayed: it differs)."""
    grid = LocalGrid(client_app, 3)
    runs = {}
    for decay in (1.0, 0.5):
        s = _settings(tmp_path, method="dgc", state_dir=str(tmp_path / f"state-{decay}"),
                      **{"dgc.residual_decay": decay})
        _send(grid, 0, s, 1, -1, _global())
        assert max(float(r.abs().max()) for r in _residual(s, "0").values()) > 1e-4
        extra = {P.MODEL_VERSION: 1, **({P.AGE_IN_VERSIONS: True} if in_versions else {})}
        runs[decay] = _sent_plus_residual(grid, s, 11, 1, **extra)[1]
    same = all(torch.equal(runs[0.5][k], runs[1.0][k]) for k in runs[1.0])
    assert same == in_versions


@pytest.mark.parametrize("extra, says", [
    ({P.AGE_IN_VERSIONS: "yes"}, "age_in_versions = 'yes'"),
    ({P.AGE_IN_VERSIONS: True, P.MODEL_VERSION: -1}, "model_version = -1"),
    ({P.AGE_IN_VERSIONS: True, P.MODEL_VERSION: 2.5}, "model_version = 2.5"),
    ({P.AGE_IN_VERSIONS: True, P.MODEL_VERSION: "two"}, "model_version = 'two'"),
    ({P.AGE_IN_VERSIONS: True, P.MODEL_VERSION: None}, "lacks 'model_version'"),
], ids=["flag-not-bool", "negative", "float", "text", "missing"])
def test_a_bad_version_or_age_flag_is_an_error_reply_that_changes_nothing(tmp_path, extra, says):
    """The server is untrusted too: a version an async dispatch cannot age an update by (or a
    flag that is not a boolean) is an error reply naming it, the client's state kept."""
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc")
    _send(grid, 2, s, 1, -1, _global())
    before = ClientStateStore(s.train.state_dir).get("2")
    residual = _residual(s, "2")
    reply = _send(grid, 2, s, 2, -1, _global(), **extra)
    assert reply.has_error() and says in reply.error.reason, reply.error.reason
    after = ClientStateStore(s.train.state_dir).get("2")
    assert torch.equal(after["pending"], before["pending"])
    assert all(torch.equal(v, residual[k]) for k, v in _residual(s, "2").items())


def test_a_re_sent_round_re_sends_the_same_signs(tmp_path):
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc")
    mask = encode_mask(_MASKS, _NUMELS, 1)
    first = _send(grid, 1, s, 1, -1, _global(), shared=mask)
    again = _send(grid, 1, s, 1, -1, _global(), shared=mask)
    for key, name in ((P.UPDATE, P.UPDATE), (P.SHARED, P.SHARED_SIGNS)):
        assert P.record_to_bytes(first.content.array_records[key], name) == \
            P.record_to_bytes(again.content.array_records[key], name)


def test_a_bad_index_set_is_an_error_reply_that_changes_nothing(tmp_path):
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc")
    _send(grid, 2, s, 1, -1, _global())
    before = ClientStateStore(s.train.state_dir).get("2")
    wrong_model = encode_mask({"net.1.weight": np.array([1, 2])}, {"net.1.weight": 999}, 2)
    for bad in (wrong_model, b"FGCM not a mask"):
        reply = _send(grid, 2, s, 2, 1, _global(), shared=bad)
        assert reply.has_error() and "bad shared index set" in reply.error.reason
    after = ClientStateStore(s.train.state_dir).get("2")
    assert torch.equal(after["pending"], before["pending"])


def test_a_patch_on_several_versions_applies_to_any_of_them(tmp_path):
    """The server may not know which of two versions a client holds: a patch names both."""
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc")
    held = _global()
    _send(grid, 1, s, 1, -1, held, **{P.KEEP_MODEL: True, P.MODEL_VERSION: 4})
    target = {k: v.clone() for k, v in held.to_torch_state_dict().items()}
    name = next(iter(target))
    target[name].view(-1)[:3] += 1.0
    patch = dgc.encode(dgc.SparseUpdate({name: dgc.SparseTensor(
        torch.arange(3), target[name].view(-1)[:3].clone(), tuple(target[name].shape))}, 6))
    reply = _send(grid, 1, s, 2, 1, P.bytes_to_record(patch, P.PATCH),
                  **{P.MODEL_VERSION: 6, P.DOWNLINK: "patch", P.BASE_VERSION: 5,
                     P.BASE_VERSIONS: [4, 5], P.KEEP_MODEL: True})
    assert not reply.has_error()
    record = ClientStateStore(s.train.state_dir).get("1")
    assert record["model_version"] == 6
    assert all(torch.equal(record["model"][k], target[k]) for k in target)
    lacking = _send(grid, 1, s, 3, 1, P.bytes_to_record(patch, P.PATCH),
                    **{P.MODEL_VERSION: 8, P.DOWNLINK: "patch", P.BASE_VERSION: 7,
                       P.BASE_VERSIONS: [2, 7]})
    assert lacking.has_error()
    assert "any of versions [2, 7]" in lacking.error.reason


def test_a_patch_that_adds_differences_adds_them_and_bad_ones_change_nothing(tmp_path):
    """patch_add: the named tensors' patch values are added to the held entries; an additive
    patch on several versions, or naming tensors it lacks, or not a list, is an error reply
    that leaves the stored record alone."""
    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc")
    held = _global()
    _send(grid, 1, s, 1, -1, held, **{P.KEEP_MODEL: True, P.MODEL_VERSION: 4})
    target = {k: v.clone() for k, v in held.to_torch_state_dict().items()}
    name, other = list(target)[:2]
    delta = torch.tensor([0.25, -0.5, 0.125])
    target[name].view(-1)[:3] += delta
    target[other].view(-1)[:2] = 7.0
    patch = dgc.encode(dgc.SparseUpdate({
        name: dgc.SparseTensor(torch.arange(3), delta, tuple(target[name].shape)),
        other: dgc.SparseTensor(torch.arange(2), torch.full((2,), 7.0),
                                tuple(target[other].shape))}, 5))
    record = P.bytes_to_record(patch, P.PATCH)
    before = ClientStateStore(s.train.state_dir).get("1")
    for bad, reason in (({P.PATCH_ADD: [name], P.BASE_VERSIONS: [3, 4]}, "applies to one version"),
                        ({P.PATCH_ADD: ["nope"]}, "names tensors the patch lacks: ['nope']"),
                        ({P.PATCH_ADD: name}, "must be a list of tensor names")):
        reply = _send(grid, 1, s, 2, 1, record, **{P.MODEL_VERSION: 5, P.DOWNLINK: "patch",
                                                   P.BASE_VERSION: 4, **bad})
        assert reply.has_error() and reason in reply.error.reason, reply.error.reason
        after = ClientStateStore(s.train.state_dir).get("1")
        assert after["model_version"] == 4 and torch.equal(after["pending"], before["pending"])
    reply = _send(grid, 1, s, 2, 1, record, **{P.MODEL_VERSION: 5, P.DOWNLINK: "patch",
                                               P.BASE_VERSION: 4, P.PATCH_ADD: [name],
                                               P.KEEP_MODEL: True})
    assert not reply.has_error()
    stored = ClientStateStore(s.train.state_dir).get("1")
    assert stored["model_version"] == 5
    assert all(torch.equal(stored["model"][k], target[k]) for k in target)


def test_a_client_that_builds_version_0_rounds_it_to_the_grid_when_told(tmp_path):
    """initial_grid: a client building version 0 itself rounds its matrices as the server's
    int8 broadcast does (dgc.int8_grid.round_initial), so a patch on version 0 lands on the
    server's model bit for bit."""
    from client.app import initial_model
    from dgc.int8_grid import round_initial
    from tasks import get_task

    grid = LocalGrid(client_app, 3)
    s = _settings(tmp_path, method="dgc")
    built = initial_model(get_task("digits"), s.train.seed)
    server_v0 = round_initial(built)
    assert any(not torch.equal(server_v0[k], built[k]) for k in built)
    empty = P.bytes_to_record(dgc.encode(dgc.SparseUpdate({}, 1)), P.PATCH)
    for on_grid, expected in ((False, built), (True, server_v0)):
        key = int(on_grid)
        reply = _send(grid, key, s, 1, -1, empty,
                      **{P.MODEL_VERSION: 1, P.DOWNLINK: "patch", P.BASE_VERSION: 0,
                         P.KEEP_MODEL: True, P.INITIAL_GRID: on_grid})
        assert not reply.has_error()
        stored = ClientStateStore(s.train.state_dir).get(str(key))["model"]
        assert all(torch.equal(stored[k].view(torch.int32), expected[k].view(torch.int32))
                   for k in expected)


def test_settings_are_parsed_once_and_their_types_still_checked():
    """settings_from caches by key, value *and type*: True for an integer key stays an error
    after the same key was parsed as 1, and a changed value gives new settings."""
    from client.app import ClientProtocolError, settings_from

    flat = to_flat(TrainSettings(task="digits", num_clients=3))
    first = settings_from(ConfigRecord({**flat, "batch_size": 1, P.SERVER_ROUND: 1}), None)
    assert first.batch_size == 1
    # Per-node keys do not take part: the next round's message gets the same object.
    assert settings_from(ConfigRecord({**flat, "batch_size": 1, P.SERVER_ROUND: 2}),
                         None) is first
    assert settings_from(ConfigRecord({**flat, "batch_size": 2}), None).batch_size == 2
    with pytest.raises(ClientProtocolError, match="batch_size"):
        settings_from(ConfigRecord({**flat, "batch_size": True}), None)


def test_reused_model_carries_nothing_between_clients(tmp_path):
    """The process keeps one model per task; a client's reply is the same whether another
    client trained (or evaluated) on that model just before it or the model was fresh."""
    import client.app as app_module

    s = _settings(tmp_path, method="dgc")
    app_module._models.__dict__.pop("by_task", None)
    alone = _send(LocalGrid(client_app, 3), 2, s, 1, -1, _global())
    # the model was kept, one per task and device
    assert app_module._models.by_task[(s.train.task_spec(), torch.device("cpu"))] is not None

    s2 = _settings(tmp_path, s, state_dir=str(tmp_path / "state2"))
    grid = LocalGrid(client_app, 3)
    # Another client first, from a different global model, so that its weights and gradients
    # are left behind in the kept model.
    other = ArrayRecord({k: v + 0.5 for k, v in _global().to_torch_state_dict().items()})
    assert not _send(grid, 0, s2, 1, -1, other).has_error()
    after = _send(grid, 2, s2, 1, -1, _global())
    assert (P.record_to_bytes(after.content.array_records[P.UPDATE])
            == P.record_to_bytes(alone.content.array_records[P.UPDATE]))


def test_ternary_client_sends_sign_coded_values(tmp_path):
    """dgc.ternary: each sparsified tensor goes as +-scale, sign-coded (one bit per value)."""
    replies = {}
    for ternary in (False, True):
        s = _settings(tmp_path / str(ternary), method="dgc", ternary=ternary)
        reply = _send(LocalGrid(client_app, 3), 1, s, 1, -1, _global())
        assert not reply.has_error(), reply.error.reason if reply.has_error() else ""
        replies[ternary] = P.record_to_bytes(reply.content.array_records[P.UPDATE])
    plain, ternary = (dgc.decode(replies[t], max_numel=dgc.wire.MAX_NUMEL) for t in (False, True))
    sparse = [n for n, t in ternary.tensors.items() if t.nnz < t.numel]
    assert sparse
    for name in sparse:
        magnitudes = ternary.tensors[name].values.abs().unique()
        assert magnitudes.numel() == 1 and float(magnitudes[0]) > 0
    # The same entries are selected (same data, same residual), in fewer bytes.
    assert all(torch.equal(plain.tensors[n].indices, ternary.tensors[n].indices) for n in sparse)
    assert len(replies[True]) < len(replies[False])
    assert _sign_coded(replies[True]) == set(sparse) and not _sign_coded(replies[False])


def _sign_coded(data: bytes) -> set[str]:
    """Names of the tensors a message carries sign-coded (value dtype byte >= SIGN_CODED)."""
    from dgc.wire import SIGN_CODED
    from tests.test_wire import tensor_value_dtypes

    return {name for name, coding in tensor_value_dtypes(data).items() if coding == SIGN_CODED}
