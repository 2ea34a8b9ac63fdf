"""Train replies: decode and validate each one into an accepted update, or a rejection with
its reason.

A rejected reply never touches the model; the strategy logs and counts it. The round's payload
bytes are decoded by the method's codec (:mod:`fedgc.methods.payloads`) in one ``decode_many``
call, against the model's tensors and the round's material; a reply's side part (what answers
the round material, DGC's shared signs) by the method's ``read_side``. Last, every payload of
every method is held to one bound on its values (:data:`MAX_ABS_VALUE`, read by the payload's
``max_abs`` before anything expands or sums it), so that no valid reply can make a round's
aggregate overflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import Message, MetricRecord

from dgc import DecodeError
from fedgc import protocol as P
from fedgc.methods import Bound, Codec, Method, Payload, PayloadError, material_of

#: The largest absolute value a payload may add at one coordinate (2**64, about 1.8e19). A
#: pseudo-gradient is a difference of two models: an honest one of any task fedgc trains stays
#: below 1e3. Under this bound no sum the server takes can overflow float32 (3.4e38, 2**128):
#: the weighted mean of a round's payloads (a few parts each) stays below a few 2**64, so do the
#: coordinate-wise statistics, centered clipping and FLTrust, and the server's momentum
#: buffer (at most 1 / (1 - momentum) times that) leaves 2**60 and more of headroom; squared
#: in float64 (the norms of the defences) it is 2**128, far from float64's 2**1024. Found by
#: the server's fuzz of every method's replies (docs/threat_model.md): QSGD norms of 3e38,
#: PowerSGD factors of 1e20 and sign scales of 1.7e38 decoded, and their sum or product was
#: Inf, which failed the whole round.
MAX_ABS_VALUE = 2.0 ** 64


class ReplyRejected(ValueError):
    """A train reply failed validation; the message names the reason."""


@dataclass(frozen=True)
class CheckedReply:
    """One train reply, checked: whose it is and what became of it.

    ``status`` is "valid" (``payload`` and the metrics below are set), "rejected" (``reason``
    says why), "error" (the reply is an error message; ``reason`` is its text) or "ignored"
    (from a node that was not sampled, or a client's second reply).
    """

    message: Message
    client_key: int
    node_id: int
    status: str
    reason: str = ""
    uplink_bytes: int = 0
    payload: Payload | None = None  # decoded by the method's codec, side part attached
    num_examples: int = 0
    train_loss: float = float("nan")
    compute_seconds: float = 0.0
    restored: int = 0
    ray_node: str = ""  # the Ray node that ran the round, as the reply names it (client.node)
    state_quarantined: int = 0  # damaged state records the client set aside (recorded only)


def recorded_fields(msg: Message) -> dict[str, Any]:
    """What a reply says that the server only records (``clients.csv``), never uses: the Ray
    node that ran it (at most 64 characters) and ``state_quarantined``. A value that is not of
    the expected kind is recorded as empty or 0, not rejected: nothing depends on it."""
    where = msg.content.config_records.get(P.NODE)
    ray_node = where.get("ray_node", "") if where is not None else ""
    metrics = msg.content.metric_records.get(P.METRICS)
    quarantined = metrics.get("state_quarantined", 0) if metrics is not None else 0
    return {"ray_node": ray_node[:64] if isinstance(ray_node, str) else "",
            "state_quarantined": quarantined if isinstance(quarantined, int)
            and not isinstance(quarantined, bool) and 0 <= quarantined < 2**31 else 0}


@dataclass(frozen=True)
class ReplyNumbers:
    """The reply metrics the server uses, checked as data."""

    num_examples: int
    train_loss: float  # NaN: not reported
    compute_seconds: float
    restored: int


def _number(metrics: MetricRecord, key: str, default: float) -> float:
    """``metrics[key]`` (``default`` when absent) as a float; ReplyRejected unless it is a
    single int or float (a MetricRecord value may also be a list)."""
    value = metrics.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ReplyRejected(f"{key} must be a number, got {value!r}")
    return float(value)


def reply_numbers(metrics: MetricRecord, weighted_by_key: str = "num-examples") -> ReplyNumbers:
    """The metrics of a reply that the server reads, or ReplyRejected naming the first bad one.

    ``weighted_by_key`` (the update's weight) must be a whole number >= 1: a fraction would be
    truncated, and its update's mass lost, while the client is told it was aggregated.
    ``restored`` (updates the client folded back) a whole number >= 0, ``compute_seconds`` a
    finite number >= 0, ``train_loss`` a finite number or NaN (not reported). Other metrics are
    not read.
    """
    weight = metrics.get(weighted_by_key)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
            or not math.isfinite(weight) or weight < 1 or weight != int(weight):
        raise ReplyRejected(f"{weighted_by_key} must be a whole number >= 1, got {weight!r}")
    loss = _number(metrics, "train_loss", float("nan"))
    if math.isinf(loss):
        raise ReplyRejected(f"train_loss must be finite (or NaN: not reported), got {loss!r}")
    seconds = _number(metrics, "compute_seconds", 0.0)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ReplyRejected(f"compute_seconds must be a finite number >= 0, got {seconds!r}")
    restored = _number(metrics, "restored", 0)
    if not (math.isfinite(restored) and restored >= 0 and restored.is_integer()):
        raise ReplyRejected(f"restored must be a whole number >= 0, got {restored!r}")
    return ReplyNumbers(int(weight), loss, seconds, int(restored))


def payload_nbytes(msg: Message) -> int:
    """The bytes of a reply's array records (what a rejected reply cost the uplink)."""
    return sum(P.record_nbytes(r) for r in msg.content.array_records.values())


class ReplyChecker:
    """Validates train replies against the model's tensors (set with :meth:`expect`), with the
    run's method's codec.

    Parameters
    ----------
    method : fedgc.methods.Method
        The run's method: its codec reads the payloads, its round material part's
        ``read_side`` the side parts (:class:`fedgc.methods.RoundMaterial`).
    codec : fedgc.methods.Codec
        The method's codec for the run's settings.
    weighted_by_key : str (default: "num-examples")
        The reply metric that weighs each update.
    """

    def __init__(self, method: Method, codec: Codec,
                 weighted_by_key: str = "num-examples") -> None:
        self.method, self.codec = method, codec
        self.material_part = material_of(method)
        self.weighted_by_key = weighted_by_key
        self.shapes: dict[str, tuple[int, ...]] = {}

    def expect(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Check replies against a model of these tensor shapes from now on (a forged header
        cannot make the server allocate more than the largest tensor)."""
        self.shapes = dict(shapes)

    def bound(self, server_round: int, material: Any = None) -> Bound:
        """What a payload of ``server_round`` is decoded and checked against."""
        return Bound(self.shapes, server_round, material)

    def check_round(self, server_round: int, replies: Iterable[Message],
                    key_of: Callable[[Message], tuple[int, int]], sampled: Iterable[int],
                    material: Any = None) -> list[CheckedReply]:
        """Every reply of ``server_round``, checked, in order.

        ``key_of(msg)`` gives (client key, node id) of a reply; ``material`` is the round
        material sent this round, decoded (None: none).
        """
        wanted = set(sampled)
        seen: set[int] = set()
        plan: list[tuple[Message, int, int, str]] = []
        for msg in replies:
            key, node = key_of(msg)
            status = "ignored" if key not in wanted or key in seen else (
                "error" if msg.has_error() else "check")
            seen.add(key)
            plan.append((msg, key, node, status))
        bound = self.bound(server_round, material)
        decoded = iter(self._decode([msg for msg, _, _, status in plan if status == "check"],
                                    bound))
        out = []
        for msg, key, node, status in plan:
            if status == "ignored":
                out.append(CheckedReply(msg, key, node, "ignored",
                                        "reply from a node that was not sampled or replied "
                                        "twice"))
            elif status == "error":
                out.append(CheckedReply(msg, key, node, "error", msg.error.reason))
            else:
                out.append(self.check(msg, key, node, server_round, material, next(decoded)))
        return out

    def _decode(self, replies: list[Message], bound: Bound) -> list[Payload | DecodeError | None]:
        """The decoded payload bytes of each of ``replies``, in one ``decode_many`` call (None
        for a reply without readable payload bytes: :meth:`check` names why)."""
        blobs: list[bytes | None] = []
        for msg in replies:
            arrays = msg.content.array_records.get(P.UPDATE)
            try:
                blobs.append(None if arrays is None else P.record_to_bytes(arrays, P.UPDATE))
            except ValueError:
                blobs.append(None)
        results = iter(self.codec.decode_many([b for b in blobs if b is not None], bound))
        return [None if b is None else next(results) for b in blobs]

    def check(self, msg: Message, key: int, node: int, server_round: int, material: Any = None,
              decoded: Payload | DecodeError | None = None) -> CheckedReply:
        """One reply, "valid" or "rejected" with its reason.

        ``decoded``, if given, is what the codec's ``decode_many`` gave for this reply's
        payload bytes: it stands in for decoding them here. The checks and their order are the
        same either way.
        """
        recorded = recorded_fields(msg)
        try:
            payload, numbers, nbytes = self._validate(msg, server_round, material, decoded)
        except ReplyRejected as ex:
            return CheckedReply(msg, key, node, "rejected", str(ex),
                                uplink_bytes=payload_nbytes(msg), **recorded)
        return CheckedReply(msg, key, node, "valid", uplink_bytes=nbytes, payload=payload,
                            num_examples=numbers.num_examples,
                            train_loss=numbers.train_loss,
                            compute_seconds=numbers.compute_seconds, restored=numbers.restored,
                            **recorded)

    def _validate(self, msg: Message, server_round: int, material: Any,
                  decoded: Payload | DecodeError | None,
                  ) -> tuple[Payload, ReplyNumbers, int]:
        """(payload, its metrics, uplink bytes) of a valid reply; ReplyRejected if not.

        A reply to a message with round material may carry a side part that answers it (a
        client without it, such as the phone encoder, sends none); it is decoded against the
        material sent.
        """
        content = msg.content
        metrics = content.metric_records.get(P.METRICS)
        if metrics is None:
            raise ReplyRejected(f"no {P.METRICS!r} MetricRecord")
        arrays = content.array_records.get(P.UPDATE)
        if arrays is None:
            raise ReplyRejected(f"no {P.UPDATE!r} ArrayRecord")
        try:
            data = P.record_to_bytes(arrays, P.UPDATE)
        except ValueError as ex:
            raise ReplyRejected(str(ex)) from ex
        numbers = reply_numbers(metrics, self.weighted_by_key)
        bound = self.bound(server_round, material)
        try:
            if isinstance(decoded, DecodeError):
                raise decoded
            payload = decoded if decoded is not None else self.codec.decode(data, bound)
        except DecodeError as ex:
            raise ReplyRejected(f"undecodable update ({len(data)} bytes): {ex}") from ex
        if payload.sequence != server_round:
            raise ReplyRejected(f"update sequence {payload.sequence} is not the round "
                                f"{server_round}")
        try:
            self.codec.check(payload, bound)
        except PayloadError as ex:
            raise ReplyRejected(str(ex)) from ex
        nbytes = len(data)
        shared = content.array_records.get(P.SHARED)
        if shared is not None:
            if material is None or self.material_part is None:
                raise ReplyRejected("shared signs in reply to a round without shared index sets")
            try:
                side_data = P.record_to_bytes(shared, P.SHARED_SIGNS)
                side = self.material_part.read_side(side_data, material, self.shapes)
            except (ValueError, DecodeError) as ex:
                raise ReplyRejected(f"undecodable shared signs: {ex}") from ex
            if side.sequence != server_round:
                raise ReplyRejected(f"shared signs sequence {side.sequence} is not the round "
                                    f"{server_round}")
            try:
                payload = payload.attach(side)
            except PayloadError as ex:
                raise ReplyRejected(str(ex)) from ex
            nbytes += len(side_data)
        check_values(payload)
        return payload, numbers, nbytes


def check_values(payload: Payload) -> None:
    """ReplyRejected when ``payload`` carries a value that is not finite, or adds more than
    :data:`MAX_ABS_VALUE` at a coordinate (its ``max_abs``: what decoding or expanding it, or
    summing it with a round's others, would turn into Inf)."""
    peak = payload.max_abs()
    if math.isnan(peak) or math.isinf(peak):
        raise ReplyRejected("update not finite: it carries NaN or Inf, or its decoded values "
                            "overflow float32")
    if peak > MAX_ABS_VALUE:
        raise ReplyRejected(f"update too large: its values reach {peak:.3g}, above the "
                            f"server's bound {MAX_ABS_VALUE:.3g} on any update")
