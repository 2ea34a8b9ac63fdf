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

from flwr.app import ArrayRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.serde import recorddict_to_proto
from flwr.proto.recorddict_pb2 import Array as ProtoArray

from client.app import allowed_callables, client_key, method_of, settings_from, state_root
from client.state import ClientState, ClientStateStore, StateCorruptError
from fedgc.protocol import ACK_SEQUENCE, NUM_EXAMPLES
from simulations.netem.clock import REASON_UNAVAILABLE, ClientTimeline
from simulations.netem.errors import LinkConfigError
from simulations.netem.link import REASON_LINK_DOWN, REASON_OK, TransferResult
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
           "outage_s", "stale_factor", "stale_discarded_l1")


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


def _age_residual(config: dict, context: Context, key: int, round_index: int,
                  settings: NetemSettings) -> StaleReport | None:
    # The client keeps its residual in client.state.ClientStateStore; the stale policy acts on
    # that state before the client loads it.
    if settings.stale_policy == "keep":
        return None
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
    report = apply_stale_policy_to_record(record, round_index,
                                          int(config.get(ACK_SEQUENCE, -1)), settings.stale,
                                          lambda: method.compressor(train, key), method, train)
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
    down = net.link.transfer(encoded_nbytes(msg.content), start_s, "down",
                             round_index=round_index)
    if not down.ok:
        return _early_reply(msg, key, down.reason, down.end_s, down)

    stale = _age_residual(config, context, key, round_index, settings)
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
    reply.content[RECORD] = _record({})
    up_nbytes = encoded_nbytes(reply.content)
    up = net.link.transfer(up_nbytes, down.end_s + compute_s, "up", round_index=round_index)
    reply.content[RECORD] = _record({
        "ok": float(up.ok), "reason": REASON_CODES[up.reason], "client_key": key,
        "finish_s": up.end_s, "download_end_s": down.end_s, "compute_s": compute_s,
        "download_bytes": down.nbytes, "upload_bytes": up.nbytes,
        "download_wire_bytes": down.wire_bytes, "upload_wire_bytes": up.wire_bytes,
        "outage_s": down.outage_s + up.outage_s,
        "stale_factor": 1.0 if stale is None else stale.factor,
        "stale_discarded_l1": 0.0 if stale is None else stale.discarded_l1,
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
