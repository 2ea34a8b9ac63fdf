"""Aggregate feedback for dgc (``dgc.feedback``, CAFe): the reference both ends derive bit for
bit, its framing and bytes, hostile side parts, the keys, and a federation that learns."""

from __future__ import annotations

import csv
from collections import OrderedDict

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from client.app import app as client_app
from dgc import DecodeError, SparseTensor, SparseUpdate
from fedgc import protocol as P
from fedgc.methods import feedback as F
from fedgc.methods import get
from fedgc.methods.dgc import DGC
from fedgc.settings import RunConfig, SettingsError
from server.app import run_server
from server.local_grid import LocalGrid
from tests.strategies import make_strategy


def _model(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(30, 40, generator=g), "b": torch.randn(30, generator=g)}


# ----------------------------------------------------------------- the reference and its bytes
def test_reference_is_the_movement_per_version_in_float32():
    then, now = _model(0), _model(1)
    ref = F.reference(then, now, 4, 0.5)
    for n in now:
        assert ref[n].dtype == torch.float32
        torch.testing.assert_close(ref[n], (then[n] - now[n]) * 0.125, rtol=0, atol=0)
    with pytest.raises(ValueError, match="at least one version"):
        F.reference(then, now, 0, 0.5)
    with pytest.raises(ValueError, match="no tensor 'w'"):
        F.reference({"b": then["b"]}, now, 1, 0.5)


def test_material_and_side_part_round_trip_and_refuse_defects():
    data = F.encode_material(7, 6, 2, 0.5, b"inner")
    assert F.decode_material(data) == (7, 6, 2, 0.5, b"inner")
    assert len(F.encode_material(7, 6, 2, 0.5)) == 25  # what every sampled client is sent
    side = F.encode_side(7, 3, b"sets")
    assert F.decode_side(side) == (7, 3, b"sets") and len(F.encode_side(7, -1)) == 17
    flipped = data[:6] + bytes([data[6] ^ 1]) + data[7:]
    with pytest.raises(DecodeError, match="checksum"):
        F.decode_material(flipped)
    with pytest.raises(DecodeError, match="after the model's"):
        F.decode_material(F.encode_material(7, 2, 6, 0.5))
    for bad in (float("nan"), 0.0, -1.0):
        with pytest.raises(DecodeError, match="finite and positive"):
            F.decode_material(F.encode_material(7, 6, 2, bad))
    with pytest.raises(DecodeError, match="-1 \\(none\\)"):
        F.decode_side(F.encode_side(7, -2))
    with pytest.raises(DecodeError, match="truncated"):
        F.decode_side(side[:10])


def _channel(versions: int, history: int = 10) -> tuple[F.FeedbackChannel, list[dict]]:
    channel = F.FeedbackChannel(None, 0.5, history)
    models = [_model(v) for v in range(versions + 1)]
    for v, m in enumerate(models):
        channel.hold(m, v, False)
    return channel, models


def test_client_and_server_derive_the_same_reference_and_the_server_adds_it_back():
    """A client that kept version ``u`` derives, from the material's bytes, the reference the
    server computes from its history (bit for bit: the last version, and one 4 versions back);
    its side part names ``u`` and the server's reading of it is the reference plus the sets'
    part; without a kept model (or one older than the history) there is no reference."""
    channel, models = _channel(6, history=5)
    data, server_material = channel.plan(9)
    method = get("dgc")
    numels = {n: t.numel() for n, t in models[6].items()}
    for u in (5, 2):
        read = method.read_material(data, numels)
        _, mine = method.hold_material(data, read, models[6], None, held=(u, models[u]))
        assert mine.base == u
        theirs = channel.reference_of(u)
        for n in models[6]:
            assert torch.equal(mine.reference[n].view(torch.int32), theirs[n].view(torch.int32))
        shapes = {n: tuple(t.shape) for n, t in models[6].items()}
        back = method.read_side(F.encode_side(9, u), server_material, shapes)
        assert back.sequence == 9
        dense = back.to_dense()
        for n in shapes:
            assert torch.equal(dense[n], theirs[n])
        # On a client (no channel: folding back an update) the reference is not added.
        assert method.read_side(F.encode_side(9, u), read, shapes).tensors == {}
    read = method.read_material(data, numels)
    assert channel.oldest == 2  # history 5: versions 2..6
    for held in (None, (1, models[1]), (6, models[6]), (5, {"w": models[5]["w"]})):
        _, mine = method.hold_material(data, read, models[6], None, held=held)
        assert mine.base == -1 and mine.reference is None


@pytest.mark.parametrize("side, match", [
    (F.encode_side(9, 1), "not one the server keeps"),  # older than the history
    (F.encode_side(9, 6), "not one the server keeps"),  # the model's own version
    (F.encode_side(9, 2, b"FGCS garbage"), "without them"),  # sets' part, no sets this round
    (F.encode_side(9, 2)[:-1] + b"\x00", "checksum"),
])
def test_the_server_refuses_a_side_part_it_cannot_read(side, match):
    channel, models = _channel(6, history=5)
    _, material = channel.plan(9)
    with pytest.raises((ValueError, DecodeError), match=match):
        get("dgc").read_side(side, material, {n: tuple(t.shape) for n, t in models[6].items()})


def test_with_reference_adds_the_sets_part_at_its_indices():
    ref = {"w": torch.ones(2, 3)}
    side = SparseUpdate({"w": SparseTensor(torch.tensor([1, 4]), torch.tensor([2.0, -1.0]),
                                           (2, 3))}, 5)
    out = F.with_reference(side, ref, {"w": (2, 3)}, 5).to_dense()
    assert out["w"].view(-1).tolist() == [1.0, 3.0, 1.0, 1.0, 0.0, 1.0]


def test_a_client_compresses_its_pseudo_gradient_less_the_reference():
    """``aggregate``: the top-k of ``pseudo_gradient - reference`` with an empty residual;
    ``aggregate+residual``: what it does not send stays in the residual."""
    keys = {"run_name": "x", "task": "digits", "density": 0.1, "dgc.warmup": "none"}
    run = RunConfig.from_flat({**keys, "dgc.feedback": "aggregate", "dgc.shared_first": False})
    method, train = run.method, run.train
    g = {"w": torch.randn(30, 40, generator=torch.Generator().manual_seed(3))}
    ref = {"w": torch.full((30, 40), 0.25)}
    material = F.FeedbackMaterial(1, 3, 0, 0.5, None, 2, ref)
    c = method.compressor(train, 0, material)
    method.prepare(train, c, {}, 0)
    sent = c.compress(g, sequence=1).to_dense()["w"]
    diff = (g["w"] - 0.25).view(-1)
    idx = torch.nonzero(sent.view(-1)).view(-1)
    assert 0 < idx.numel() <= 0.15 * diff.numel()
    torch.testing.assert_close(sent.view(-1)[idx], diff[idx].half().float())
    kept = c.residual()["w"]
    torch.testing.assert_close(kept.view(-1) + sent.view(-1), diff, atol=1e-3, rtol=0)
    # aggregate: the next round starts without it
    c2 = method.compressor(train, 0, material)
    c2.load_state_dict(c.state_dict())
    method.prepare(train, c2, {}, 0)
    assert float(c2.residual()["w"].abs().sum()) == 0.0
    both = RunConfig.from_flat({**keys, "dgc.feedback": "aggregate+residual"})
    c3 = both.method.compressor(both.train, 0, material)
    c3.load_state_dict(c.state_dict())
    both.method.prepare(both.train, c3, {}, 0)
    assert torch.equal(c3.residual()["w"], kept)


# ----------------------------------------------------------------- the server's bytes
def test_the_material_is_counted_in_each_clients_downlink_bytes():
    s = make_strategy(clients_per_round=2, num_clients=4, dgc__feedback="aggregate")
    grid = LocalGrid(client_app, 4, seed=5)
    s.registry.register(grid.partition_of)
    model = OrderedDict(_model(0))
    msgs = list(s.configure_train(1, ArrayRecord(model), ConfigRecord(), grid))
    assert not any(P.SHARED in m.content.array_records for m in msgs)  # version 0: none
    s.step({n: 0.1 * torch.ones_like(t) for n, t in model.items()})
    msgs = list(s.configure_train(2, ArrayRecord(model), ConfigRecord(), grid))
    for m in msgs:
        data = P.record_to_bytes(m.content.array_records[P.SHARED], P.SHARED_MASK)
        assert F.decode_material(data)[:4] == (2, 1, 0, 1.0)  # server_momentum 0
        key = s.registry.key_of(m.metadata.dst_node_id)
        offer_bytes = P.record_nbytes(m.content.array_records[P.ARRAYS])
        assert s._round.downlink[key][1] == offer_bytes + len(data) == offer_bytes + 25


# ----------------------------------------------------------------- a federation
@pytest.mark.parametrize("feedback", ["aggregate", "aggregate+residual"])
def test_every_reference_agrees_in_a_federation_with_returning_clients(tmp_path, monkeypatch,
                                                                       feedback):
    """The real server and clients, a compressed int8 broadcast (clients rebuild the sent
    models from patches), sets ranked by displacement with grid values: every reference a
    reply names is the one its client derived, bit for bit, including clients back after
    rounds away, and every reply is aggregated."""
    server_refs: dict[tuple[int, int], dict] = {}
    client_refs: dict[tuple[int, int], list[dict]] = {}
    reference_of, hold = F.FeedbackChannel.reference_of, DGC._hold_feedback

    def spy_server(self, base):
        out = reference_of(self, base)
        server_refs[(self.version, base)] = out
        return out

    def spy_client(self, *args):
        data, m = hold(self, *args)
        client_refs.setdefault((m.version, m.base), []).append(m.reference)
        return data, m

    monkeypatch.setattr(F.FeedbackChannel, "reference_of", spy_server)
    monkeypatch.setattr(DGC, "_hold_feedback", spy_client)
    c = RunConfig.from_flat({
        "task": "digits", "num_clients": 6, "clients_per_round": 2, "partition": "iid",
        "density": 0.05, "local_steps": 2, "rounds": 10, "progress": False,
        "results_dir": str(tmp_path), "run_name": "fb", "downlink_density": 0.05,
        "downlink_values": "int8", "dgc.feedback": feedback, "dgc.feedback_history": 4,
        "dgc.shared_rank": "displacement", "dgc.shared_values": "grid",
        "dgc.value_levels": 4.0})
    run_server(LocalGrid(client_app, 6, seed=1), c)
    rows = list(csv.DictReader((c.run_dir / "clients.csv").open()))
    assert rows and all(r["status"] == "aggregated" for r in rows)
    assert server_refs and set(server_refs) <= set(client_refs)
    for key, theirs in server_refs.items():
        for mine in client_refs[key]:
            assert all(torch.equal(mine[n].view(torch.int32), theirs[n].view(torch.int32))
                       for n in theirs)
    assert any(v - u >= 2 for v, u in server_refs)  # a client back after rounds away
    assert any(u == -1 and v > 0 for v, u in client_refs)  # first contact, or beyond history


def test_a_federation_with_aggregate_feedback_learns(tmp_path):
    from simulations.api import run

    result = run(config={"task": "digits", "num_clients": 10, "clients_per_round": 5,
                         "rounds": 8, "results_dir": str(tmp_path), "run_name": "fb",
                         "progress": False},
                 sim__engine="local", dgc__feedback="aggregate+residual")
    assert result.summary["clients_rejected"] == 0
    assert all(r["clients_aggregated"] == 5 for r in result.rounds)
    assert result.summary["final_accuracy"] > 0.8


# ----------------------------------------------------------------- the keys
@pytest.mark.parametrize("keys, match", [
    ({"dgc.feedback": "stale"}, "dgc.feedback"),
    ({"dgc.feedback_scale": -1.0}, "dgc.feedback_scale"),
    ({"dgc.feedback_history": 0}, "dgc.feedback_history"),
    ({"dgc.feedback": "aggregate", "dgc.step_ahead": 0.5}, "keeps no residual"),
    ({"dgc.feedback": "aggregate", "dgc.residual_decay": 0.5}, "keeps no residual"),
    ({"dgc.feedback": "aggregate+residual", "downlink": "dense"}, "needs downlink = auto"),
])
def test_bad_feedback_keys_are_refused(keys, match):
    with pytest.raises(SettingsError, match=match):
        RunConfig.from_flat({"run_name": "x", **keys})


def test_phones_refuse_aggregate_feedback():
    from android_bridge.export import check_phone_run
    from dgc.errors import ConfigError

    check_phone_run(RunConfig.from_flat({"run_name": "x"}).method)
    with pytest.raises(ConfigError, match="dgc.feedback='aggregate'"):
        check_phone_run(RunConfig.from_flat({"run_name": "x", "dgc.feedback": "aggregate"})
                        .method)


def test_residual_feedback_is_todays_dgc():
    """The default builds today's channel and compressor: no feedback material."""
    c = RunConfig.from_flat({"run_name": "x"})
    assert c.method.own.feedback == "residual"
    channel = c.method.channel(c, {"w": (200, 784)})
    assert not isinstance(channel, F.FeedbackChannel)
    on = RunConfig.from_flat({"run_name": "x", "dgc.feedback": "aggregate"})
    fb = on.method.channel(on, {"w": (200, 784)})
    assert isinstance(fb, F.FeedbackChannel) and fb.scale == 0.5  # (1 - 0.5) / 1
    assert type(fb.inner) is type(channel)
    scaled = RunConfig.from_flat({"run_name": "x", "dgc.feedback": "aggregate",
                                  "dgc.feedback_scale": 0.25})
    assert scaled.method.channel(scaled, {"w": (200, 784)}).scale == 0.25
