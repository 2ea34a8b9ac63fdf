"""The Flower mod that charges each train message's exact encoded bytes to the client's link.

``netem_mod`` wraps the ClientApp (``ClientApp(mods=[netem_mod])``). On a train message whose
config carries ``netem.enabled = True`` it:

1. finds this client's link and device in the run's scenario (``netem.*`` keys, built once per
   process);
2. charges the download: the protobuf-encoded size of the message content, i.e. exactly the
   bytes Flower serialises for it, from the round's virtual start ``netem.round_start_s``;
3. if the device is unavailable or the download fails, replies at once without training (a real
   client would never have seen the model);
4. applies the stale-residual policy (``netem.stale_policy``) to the client's stored residual
   when it has been away long enough;
5. trains (``call_next``), charges ``num-examples * local_epochs`` samples (or
   ``netem.local_samples``) of the device's compute time, and charges the upload: the encoded
   size of the reply, emulator record included;
6. attaches the timeline as a ``netem`` MetricRecord to the reply. Nothing sleeps: the strategy's
   round clock reads these virtual times and decides which updates make the round.

Other messages (query, evaluate) and runs without ``netem.enabled`` pass through untouched.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.serde import recorddict_to_proto
from flwr.proto.recorddict_pb2 import Array as ProtoArray

from client.app import (
    age_version,
    allowed_callables,
    client_key,
    for_method,
    message_config,
    method_of,
    settings_from,
    state_root,
)
from client.state import ClientState, ClientStateStore, StateCorruptError
from fedgc.protocol import ACK_SEQUENCE, NUM_EXAMPLES
from simulations.netem.clock import REASON_UNAVAILABLE, ClientTimeline
from simulations.netem.energy import (
    DEVICE_COMPUTE_W,
    LINK_RADIO,
    Transfer,
    compute_energy_j,
    radio_energy,
)
from simulations.netem.errors import LinkConfigError
from simulations.netem.link import REASON_LINK_DOWN, REASON_OK, TransferResult
from simulations.netem.protocol import ProtocolModel, message_objects
from simulations.netem.settings import (
    PREFIX,
    ROUND_KEY,
    ROUND_START_KEY,
    NetemSettings,
    assignment_for,
)
from simulations.netem.staleness import StaleReport, apply_stale_policy_to_record

#: Name of the MetricRecord the mod adds to a train reply.
RECORD = "netem"
REASON_CODES: dict[str, float] = {REASON_OK: 0.0, REASON_LINK_DOWN: 1.0, REASON_UNAVAILABLE: 2.0}
_REASONS = {v: k for k, v in REASON_CODES.items()}
_FIELDS = ("ok", "reason", "client_key", "finish_s", "download_end_s", "compute_s",
           "download_bytes", "upload_bytes", "download_wire_bytes", "upload_wire_bytes",
           "outage_s", "stale_factor", "stale_discarded_l1",
           # What the protocol adds (netem.protocol; equal to the above without one): payload
           # and link bytes each way over the whole round trip (requests and acknowledgements
           # included), the transfer and orchestration seconds, and the joules spent. The
           # client's orchestration is the sum of its named parts (the server's is the
           # strategy's): the wait for a poll, the round trips of the RPCs beyond each
           # transfer's own, and the app's start-up.
           "payload_down_bytes", "payload_up_bytes", "link_down_bytes", "link_up_bytes",
           "transfer_s", "orchestration_s", "radio_j", "compute_j",
           "poll_s", "round_trips_s", "startup_s")
#: Seeds the wait for a node's next poll, per (scenario seed, client, round).
_STREAM_POLL = 0x9011


def _varint_nbytes(n: int) -> int:
    return max(1, (n.bit_length() + 6) // 7)


def _field_nbytes(payload: int) -> int:
    """A length-delimited protobuf field (field number < 16: one tag byte) of ``payload`` bytes."""
    return 1 + _varint_nbytes(payload) + payload


def _str_nbytes(text: str) -> int:
    n = len(text.encode("utf-8"))
    return _field_nbytes(n) if n else 0  # proto3 leaves an empty string out


def _array_record_nbytes(record: ArrayRecord) -> int:
    """``array_record_to_proto(record).ByteSize()`` without copying the arrays' bytes.

    ``flwr.proto.ArrayRecord``: repeated ``Item {string key = 1; Array value = 2}`` (field 1),
    ``Array {string dtype = 1; repeated int32 shape = 2; string stype = 3; bytes data = 4}``.
    Everything but ``data`` is measured by protobuf itself on a copy without the bytes.
    """
    total = 0
    for key, array in record.items():
        meta = ProtoArray(dtype=array.dtype, shape=array.shape, stype=array.stype).ByteSize()
        n = len(array.data)
        value = meta + (_field_nbytes(n) if n else 0)
        total += _field_nbytes(_str_nbytes(key) + _field_nbytes(value))
    return total


def encoded_nbytes(content: RecordDict) -> int:
    """Bytes of ``content`` as Flower serialises it (``recorddict_to_proto(content).ByteSize()``).

    Computed without serialising the arrays: a dense model message is a few MB, and copying it
    into a protobuf just to measure it cost each emulated client several milliseconds. The other
    records are small and measured by protobuf; the array records by the same wire rules
    (``tests/test_netem_mod.py`` checks both ways agree).
    """
    total = 0
    for key, record in content.items():
        if isinstance(record, ArrayRecord):
            item = _str_nbytes(key) + _field_nbytes(_array_record_nbytes(record))
        else:
            item = recorddict_to_proto(RecordDict({key: record})).items[0].ByteSize()
        total += _field_nbytes(item)
    return total


def payload_nbytes(content: RecordDict) -> int:
    """fedgc's payload in a message: the bytes of every Array of its ArrayRecords (what
    ``rounds.csv`` counts)."""
    return sum(len(a.data) for r in content.array_records.values() for a in r.values())


def content_objects(content: RecordDict) -> int:
    """How many Flower objects a message with ``content`` is shipped as."""
    arrays = [len(a.data) for r in content.array_records.values() for a in r.values()]
    return message_objects(arrays, len(content))


def _poll_wait_s(proto: ProtocolModel | None, settings: NetemSettings, key: int,
                 round_index: int) -> float:
    """How long the message waits for the node's next poll (uniform over an interval)."""
    if proto is None or proto.poll_interval_s <= 0:
        return 0.0
    ss = np.random.SeedSequence([settings.seed, key, round_index, _STREAM_POLL])
    return float(np.random.default_rng(ss).random()) * proto.poll_interval_s


def _energy(settings: NetemSettings, net: Any, proto: ProtocolModel | None,
            transfers: list[Transfer], compute_s: float) -> tuple[float, float]:
    """(radio, compute) joules of one client-round: the radio over its transfers (awake at the
    start, and its tail cut by the next poll, when the protocol polls within the tail)."""
    radio = LINK_RADIO.get(net.link.name)
    models = settings.power_models()
    radio_j = 0.0
    if radio is not None and radio in models and transfers:
        model = models[radio]
        interval = proto.poll_interval_s if proto is not None else 0.0
        warm = 0 < interval < model.tail_ms / 1000.0
        end = max(t.end_s for t in transfers)
        radio_j = radio_energy(model, transfers, until_s=end + interval if warm else None,
                               warm=warm).total_j
    compute_w = DEVICE_COMPUTE_W.get(net.device.name, 0.0)
    return radio_j, compute_energy_j(compute_w, compute_s)


def _netem_config(msg: Message) -> dict | None:
    for record in msg.content.config_records.values():
        if PREFIX + "enabled" in record:
            return dict(record)
    return None


def _record(values: dict[str, float]) -> MetricRecord:
    # Every value is a float: a protobuf double has a fixed size, so filling in the real values
    # after measuring the reply does not change the measured size.
    return MetricRecord({f"{RECORD}.{k}": float(values.get(k, 0.0)) for k in _FIELDS})


def _early_reply(msg: Message, key: int, reason: str, end_s: float,
                 down: TransferResult | None) -> Message:
    values = {"ok": 0.0, "reason": REASON_CODES[reason], "client_key": key, "finish_s": end_s}
    if down is not None:
        values.update(download_end_s=down.end_s, download_bytes=down.nbytes,
                      download_wire_bytes=down.wire_bytes, outage_s=down.outage_s)
    return Message(RecordDict({RECORD: _record(values)}), reply_to=msg)


def _age_residual(msg: Message, context: Context, key: int, round_index: int,
                  settings: NetemSettings) -> StaleReport | None:
    # The client keeps its residual in client.state.ClientStateStore; the stale policy acts on
    # that state before the client loads it.
    if settings.stale_policy == "keep":
        return None
    # The run's config as the client reads it (whole, or known by its digest).
    config = message_config(msg.content, context)
    allowed = allowed_callables(context)
    train = settings_from(config, allowed)
    root = state_root(train, context)
    if not root:
        return None
    store = ClientStateStore(root)
    try:
        state = store.load(str(key))
    except StateCorruptError:
        return None  # the client quarantines it and starts again: nothing left to age
    if state is None:
        return None
    record = state.to_record()
    method = method_of(train, config, allowed)
    train = for_method(train, method)
    report = apply_stale_policy_to_record(record, round_index,
                                          int(config.get(ACK_SEQUENCE, -1)), settings.stale,
                                          lambda: method.compressor(train, key), method, train,
                                          age_version(config))
    if report is not None:
        store.save(str(key), ClientState.from_record(record, f"client state {key}"))
    return report


def netem_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Charge the train round trip to this client's emulated link (see the module docstring)."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, context)
    config = _netem_config(msg)
    if config is None:
        return call_next(msg, context)
    settings = NetemSettings.from_config(config)
    if not settings.enabled:
        return call_next(msg, context)
    for k in (ROUND_KEY, ROUND_START_KEY):
        if k not in config:
            raise LinkConfigError(f"train message has netem.enabled but lacks {k!r}")
    round_index = int(config[ROUND_KEY])
    start_s = float(config[ROUND_START_KEY])
    key = client_key(context)
    net = assignment_for(settings)[key]

    if not net.device.is_available(round_index):
        return _early_reply(msg, key, REASON_UNAVAILABLE, start_s, None)
    proto = settings.protocol_model()
    payload_down = payload_nbytes(msg.content)
    wait_s = _poll_wait_s(proto, settings, key, round_index)
    t0 = start_s + wait_s
    if proto is None:
        requests_up, down_nbytes, rtt_down = 0, encoded_nbytes(msg.content), 0.0
    else:
        objects = content_objects(msg.content)
        requests_up, down_nbytes = proto.download(payload_down, objects)
        # Every RPC but the first costs a round trip of its own (the transfer charges one).
        rtt_down = max(0, proto.rpcs("down", objects) - 1) * net.link.latency_ms / 1000.0
    down = net.link.transfer(down_nbytes, t0, "down", round_index=round_index)
    if not down.ok:
        return _early_reply(msg, key, down.reason, down.end_s, down)
    download_end = down.end_s + rtt_down

    stale = _age_residual(msg, context, key, round_index, settings)
    reply = call_next(msg, context)
    if reply.has_error() or not reply.has_content():
        return reply
    samples = 0
    for record in reply.content.metric_records.values():
        if NUM_EXAMPLES in record:
            samples = int(record[NUM_EXAMPLES])  # type: ignore[arg-type]
            break
    if settings.local_samples > 0:
        compute_s = net.device.compute_seconds(settings.local_samples)
    else:
        compute_s = net.device.compute_seconds(samples, settings.local_epochs)
    compute_s *= settings.compute_factor  # the model's cost against the presets' (compute.py)
    reply.content[RECORD] = _record({})
    startup_s = proto.clientapp_startup_s if proto is not None else 0.0
    upload_start = download_end + startup_s + compute_s
    payload_up = payload_nbytes(reply.content)
    rtt_up = 0.0
    if proto is None:
        up_nbytes, acks_down = encoded_nbytes(reply.content), 0
    else:
        objects = content_objects(reply.content)
        up_nbytes, acks_down = proto.upload(payload_up, objects)
        rtt_up = max(0, proto.rpcs("up", objects) - 1) * net.link.latency_ms / 1000.0
    up = net.link.transfer(up_nbytes, upload_start, "up", round_index=round_index)
    if not up.ok:
        rtt_up = 0.0  # the reply never got through: no more requests
    finish_s = up.end_s + rtt_up
    transfers = [Transfer(t0, download_end, up_bytes=requests_up, down_bytes=down.wire_bytes),
                 Transfer(upload_start, max(upload_start, finish_s), up_bytes=up.wire_bytes,
                          down_bytes=acks_down)]
    radio_j, compute_j = _energy(settings, net, proto, transfers, compute_s)
    reply.content[RECORD] = _record({
        "ok": float(up.ok), "reason": REASON_CODES[up.reason], "client_key": key,
        "finish_s": finish_s, "download_end_s": download_end, "compute_s": compute_s,
        "download_bytes": down.nbytes, "upload_bytes": up.nbytes,
        "download_wire_bytes": down.wire_bytes, "upload_wire_bytes": up.wire_bytes,
        "outage_s": down.outage_s + up.outage_s,
        "stale_factor": 1.0 if stale is None else stale.factor,
        "stale_discarded_l1": 0.0 if stale is None else stale.discarded_l1,
        "payload_down_bytes": payload_down, "payload_up_bytes": payload_up,
        "link_down_bytes": down.wire_bytes + acks_down,
        "link_up_bytes": requests_up + up.wire_bytes,
        # The round trips of the RPCs beyond each transfer's own are orchestration.
        "transfer_s": (down.end_s - t0) + (up.end_s - upload_start),
        "orchestration_s": wait_s + rtt_down + rtt_up + startup_s,
        "poll_s": wait_s, "round_trips_s": rtt_down + rtt_up, "startup_s": startup_s,
        "radio_j": radio_j, "compute_j": compute_j,
    })
    return reply


def timeline_from_reply(msg: Message) -> ClientTimeline | None:
    """The client's virtual timeline from a reply's ``netem`` record (None when it has none)."""
    if msg.has_error() or not msg.has_content() or RECORD not in msg.content.metric_records:
        return None
    r = msg.content.metric_records[RECORD]
    get = {k: float(r.get(f"{RECORD}.{k}", math.nan)) for k in _FIELDS}  # type: ignore[arg-type]
    reason = _REASONS.get(get["reason"])
    if reason is None or not all(math.isfinite(v) for v in get.values()):
        raise LinkConfigError(f"reply carries a malformed {RECORD!r} record: {dict(r)}")
    return ClientTimeline(int(get["client_key"]), bool(get["ok"]), reason, get["finish_s"],
                          None, get["compute_s"], None)


def reply_metrics(msg: Message) -> dict[str, float]:
    """The ``netem`` record of a reply as a plain dict without the prefix (empty when none)."""
    if msg.has_error() or not msg.has_content() or RECORD not in msg.content.metric_records:
        return {}
    return {k[len(RECORD) + 1:]: float(v)  # type: ignore[arg-type]
            for k, v in msg.content.metric_records[RECORD].items()}
