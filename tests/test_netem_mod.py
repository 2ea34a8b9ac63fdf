"""The Flower mod on a real ClientApp: exact encoded bytes, virtual times, early replies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from fedgc.settings import SettingsError
from simulations.netem import LinkConfigError
from simulations.netem.mod import encoded_nbytes, netem_mod, reply_metrics, timeline_from_reply
from simulations.netem.settings import NetemSettings, assignment_for


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    # Messages need a run identity; Flower's runtime sets it in a real run.
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def _app(calls: list[int]) -> ClientApp:
    app = ClientApp(mods=[netem_mod])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        calls.append(int(context.node_config["partition-id"]))
        return Message(RecordDict({"update": ArrayRecord({"w": torch.zeros(2000)}),
                                   "metrics": MetricRecord({"num-examples": 120})}),
                       reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"metrics": MetricRecord({"client_key": 3})}), reply_to=msg)

    return app


def _message(settings: NetemSettings, round_index: int = 2, start_s: float = 50.0,
             numel: int = 250_000, message_type: str = MessageType.TRAIN) -> Message:
    cfg = {**settings.to_config(), "netem.round": round_index, "netem.round_start_s": start_s,
           "lr": 0.1}
    return Message(RecordDict({"config": ConfigRecord(cfg),
                               "arrays": ArrayRecord({"w": torch.ones(numel)})}),
                   dst_node_id=1, message_type=message_type)


def _context(key: int) -> Context:
    return Context(run_id=1, node_id=100 + key, node_config={"partition-id": key},
                   state=RecordDict(), run_config={})


def test_mod_charges_the_exact_encoded_bytes_both_ways() -> None:
    # netem.protocol = none: the payload only (a profile's bytes: test_netem_orchestration.py).
    settings = NetemSettings(enabled=True, mix="3g:1.0", num_clients=8, seed=3,
                             local_epochs=2.0, protocol="none")
    msg = _message(settings)
    calls: list[int] = []
    reply = _app(calls)(msg, _context(5))
    m = reply_metrics(reply)
    assert calls == [5] and m["ok"] == 1.0 and m["client_key"] == 5
    assert m["download_bytes"] == encoded_nbytes(msg.content) > 1_000_000
    assert m["upload_bytes"] == encoded_nbytes(reply.content)  # the record itself included
    # The same link, asked directly, gives the same times: nothing but the emulator decides.
    net = assignment_for(settings)[5]
    down = net.link.transfer(int(m["download_bytes"]), 50.0, "down", round_index=2)
    compute_s = net.device.compute_seconds(120, 2.0)
    up = net.link.transfer(int(m["upload_bytes"]), down.end_s + compute_s, "up", round_index=2)
    assert (m["download_end_s"], m["compute_s"], m["finish_s"]) == (down.end_s, compute_s,
                                                                    up.end_s)
    assert reply.content["update"]["w"].numpy().size == 2000  # the client's reply is intact
    tl = timeline_from_reply(reply)
    assert tl.ok and tl.client_id == 5 and tl.finish_s == up.end_s


def test_a_profile_charges_its_bytes_and_its_named_orchestration_parts() -> None:
    """A SuperNode profile: the message waits for a poll (uniform over the interval), every
    RPC beyond a transfer's own costs the link's latency, the ClientApp starts per message;
    the bridge's profile: no wait, one RPC each way, a resident app. The parts add up to the
    client's orchestration, and the finish time is the sum of every part."""
    from simulations.netem.mod import content_objects, payload_nbytes

    for name in ("supernode-tls-devbox", "bridge-tls"):
        settings = NetemSettings(enabled=True, mix="lte:1.0", num_clients=8, seed=3,
                                 protocol=name)
        proto = settings.protocol_model()
        msg = _message(settings)
        reply = _app([])(msg, _context(5))
        m = reply_metrics(reply)
        latency = assignment_for(settings)[5].link.latency_ms / 1000
        objects_up = content_objects(reply.content)
        trips = (proto.rpcs("down", content_objects(msg.content)) - 1
                 + proto.rpcs("up", objects_up) - 1) * latency
        assert m["round_trips_s"] == pytest.approx(trips)
        assert m["startup_s"] == proto.clientapp_startup_s
        assert 0 <= m["poll_s"] <= proto.poll_interval_s
        assert m["orchestration_s"] == pytest.approx(m["poll_s"] + m["round_trips_s"]
                                                     + m["startup_s"])
        assert m["finish_s"] - 50.0 == pytest.approx(m["orchestration_s"] + m["transfer_s"]
                                                     + m["compute_s"])
        # The bytes of the profile, not the encoded message.
        assert m["download_bytes"] == proto.download(payload_nbytes(msg.content),
                                                     content_objects(msg.content))[1]
        if name == "bridge-tls":
            assert m["poll_s"] == m["startup_s"] == m["round_trips_s"] == 0
        else:
            assert m["startup_s"] > 7 and m["round_trips_s"] > 10 * latency
    # A key sets a part of the profile: a phone's resident app behind a SuperNode's polls.
    quick = NetemSettings(enabled=True, mix="lte:1.0", num_clients=8, seed=3,
                          protocol="supernode-tls-devbox", app_startup_s=0.25)
    assert reply_metrics(_app([])(_message(quick), _context(5)))["startup_s"] == 0.25


def test_unavailable_client_replies_without_training() -> None:
    settings = NetemSettings(enabled=True, num_clients=4, availability=1e-9)
    calls: list[int] = []
    reply = _app(calls)(_message(settings), _context(1))
    assert calls == []
    tl = timeline_from_reply(reply)
    assert not tl.ok and tl.reason == "unavailable" and tl.finish_s == 50.0
    assert "update" not in reply.content


def test_failed_download_replies_without_training() -> None:
    # Every client is intermittent, mostly down, and a 4 MB download on 3G takes ~17 s.
    settings = NetemSettings(enabled=True, mix="3g:1.0", num_clients=20, intermittent=1.0,
                             intermittent_mean_on_s=2.0, intermittent_mean_off_s=20.0,
                             outage_policy="fail")
    calls: list[int] = []
    replies = [_app(calls)(_message(settings, numel=1_000_000), _context(k)) for k in range(20)]
    reasons = [timeline_from_reply(r).reason for r in replies]
    assert reasons.count("link_down") == 20 and calls == []
    assert all(reply_metrics(r)["finish_s"] >= 50.0 for r in replies)


def test_mod_is_deterministic_and_depends_on_the_round() -> None:
    settings = NetemSettings(enabled=True, mix="lte-driving:1.0", num_clients=4, seed=9)
    a = reply_metrics(_app([])(_message(settings, round_index=4), _context(2)))
    b = reply_metrics(_app([])(_message(settings, round_index=4), _context(2)))
    c = reply_metrics(_app([])(_message(settings, round_index=5), _context(2)))
    assert a == b and a["finish_s"] != c["finish_s"]


def test_other_messages_and_disabled_runs_pass_through() -> None:
    calls: list[int] = []
    app = _app(calls)
    q = app(_message(NetemSettings(enabled=True), message_type=MessageType.QUERY), _context(0))
    assert reply_metrics(q) == {} and "netem" not in q.content
    off = app(_message(NetemSettings(enabled=False)), _context(0))
    assert calls == [0] and reply_metrics(off) == {}


def test_missing_round_keys_and_bad_settings_are_named() -> None:
    msg = Message(RecordDict({"config": ConfigRecord({"netem.enabled": True})}),
                  dst_node_id=1, message_type=MessageType.TRAIN)
    with pytest.raises(LinkConfigError, match="netem.round"):
        netem_mod(msg, _context(0), lambda m, c: m)
    with pytest.raises(SettingsError, match="unknown configuration key 'netem.speed'"):
        NetemSettings.from_config({"netem.speed": 3})
    with pytest.raises(SettingsError, match="netem.mix"):
        NetemSettings(mix="lte:0.5,5g:0.5")
    with pytest.raises(SettingsError, match="netem.mix"):
        NetemSettings(mix="lte:0.5,3g:0.4")
    with pytest.raises(SettingsError, match="netem.num_clients must be an integer"):
        NetemSettings(num_clients="many")
    assert NetemSettings.from_config(NetemSettings(intermittent=0.2).to_config()) == \
        NetemSettings(intermittent=0.2)
    assert NetemSettings.from_config({"netem.deadline_s": "30", "netem.enabled": "true"}) \
        .deadline == 30.0


def _contents() -> Iterator[RecordDict]:
    """Record dicts around the protobuf length-prefix boundaries, with every record kind."""
    from flwr.app import Array

    from fedgc import protocol as P

    for n in (0, 1, 127, 128, 16383, 16384, 2**21 - 3, 2**21 + 3):
        yield RecordDict({"update": P.bytes_to_record(bytes(n))})
        yield RecordDict({"": ArrayRecord({"": Array(dtype="", shape=(), stype="",
                                                     data=bytes(n))}),
                          "m": MetricRecord({"a": 1.0, "b": [1, 2]}),
                          "c": ConfigRecord({"x": "y" * n, "é": b"z" * (n % 300)})})
    yield RecordDict()
    yield RecordDict({"empty": ArrayRecord()})
    torch.manual_seed(0)
    yield RecordDict({"arrays": ArrayRecord(torch.nn.Linear(300, 200).state_dict()),
                      "config": ConfigRecord({"server-round": 3, "lr": 0.05, "ok": True})})
    gen = torch.Generator().manual_seed(1)
    for _ in range(40):
        records = {}
        for j in range(int(torch.randint(0, 4, (1,), generator=gen))):
            arrays = {}
            for q in range(int(torch.randint(0, 4, (1,), generator=gen))):
                shape = tuple(int(d) for d in torch.randint(0, 300, (q,), generator=gen))
                n = int(torch.randint(0, 40_000, (1,), generator=gen))
                arrays[f"t{'é' * q}{q}"] = Array(dtype="float32", shape=shape,
                                                 stype="numpy.ndarray", data=bytes(n))
            records[f"a{j}"] = ArrayRecord(arrays)
        records["metrics"] = MetricRecord({"x": float(j)})
        yield RecordDict(records)


def test_encoded_nbytes_is_what_protobuf_serialises():
    """The fast measure (array bytes not copied) equals Flower's serialised size exactly."""
    from flwr.common.serde import recorddict_to_proto

    for content in _contents():
        assert encoded_nbytes(content) == recorddict_to_proto(content).ByteSize()
