"""Train replies: decode and validate each one into an accepted update, or a rejection with
its reason.

A rejected reply never touches the model; the strategy logs and counts it. The round's update
bytes are decoded in one ``dgc.decode_many`` call: the replies of a round share their
structure, so the headers of all but the first are read against it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import Message, MetricRecord

import dgc
from dgc import DecodeError, SparseUpdate, TensorLayout
from dgc.signs.codec import Masks, decode_shared
from fedgc import protocol as P


class ReplyRejected(ValueError):
    """A train reply failed validation; the message names the reason."""


@dataclass(frozen=True)
class CheckedReply:
    """One train reply, checked: whose it is and what became of it.

    ``status`` is "valid" (``update`` and the metrics below are set), "rejected" (``reason``
    says why), "error" (the reply is an error message; ``reason`` is its text) or "ignored"
    (from a node that was not sampled, or a client's second reply).
    """

    message: Message
    client_key: int
    node_id: int
    status: str
    reason: str = ""
    uplink_bytes: int = 0
    update: SparseUpdate | None = None
    signs: SparseUpdate | None = None  # the shared sign channel's part of a valid reply
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


def _check_tensors(sent: Mapping[str, tuple[int, ...]],
                   shapes: Mapping[str, tuple[int, ...]]) -> None:
    """ReplyRejected unless the update's tensors are the model's, by name and shape."""
    missing = sorted(set(shapes) - set(sent))
    extra = sorted(set(sent) - set(shapes))
    if missing or extra:
        raise ReplyRejected(f"tensor names differ from the model: missing {missing}, "
                            f"unknown {extra}")
    for name, shape in sent.items():
        if shape != shapes[name]:
            raise ReplyRejected(f"tensor {name!r} has shape {shape}, the model has "
                                f"{shapes[name]}")


class ReplyChecker:
    """Validates train replies against the model's tensors (set with :meth:`expect`).

    Parameters
    ----------
    weighted_by_key : str (default: "num-examples")
        The reply metric that weighs each update.
    """

    def __init__(self, weighted_by_key: str = "num-examples") -> None:
        self.weighted_by_key = weighted_by_key
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.max_numel = 0
        self._checked_layouts: set[TensorLayout] = set()  # update layouts that match the model

    def expect(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Check replies against a model of these tensor shapes from now on."""
        self.shapes = dict(shapes)
        # A forged header cannot make the server allocate more than the largest tensor.
        self.max_numel = max((math.prod(s) for s in self.shapes.values()), default=0)
        self._checked_layouts = set()

    def check_round(self, server_round: int, replies: Iterable[Message],
                    key_of: Callable[[Message], tuple[int, int]], sampled: Iterable[int],
                    masks: Masks) -> list[CheckedReply]:
        """Every reply of ``server_round``, checked, in order.

        ``key_of(msg)`` gives (client key, node id) of a reply; ``masks`` are the shared index
        sets sent this round (empty: none).
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
        decoded = iter(self._decode([msg for msg, _, _, status in plan if status == "check"]))
        out = []
        for msg, key, node, status in plan:
            if status == "ignored":
                out.append(CheckedReply(msg, key, node, "ignored",
                                        "reply from a node that was not sampled or replied "
                                        "twice"))
            elif status == "error":
                out.append(CheckedReply(msg, key, node, "error", msg.error.reason))
            else:
                out.append(self.check(msg, key, node, server_round, masks, next(decoded)))
        return out

    def _decode(self, replies: list[Message]) -> list[SparseUpdate | DecodeError | None]:
        """The decoded update bytes of each of ``replies``, in one ``dgc.decode_many`` call
        (None for a reply without readable update bytes: :meth:`check` names why)."""
        blobs: list[bytes | None] = []
        for msg in replies:
            arrays = msg.content.array_records.get(P.UPDATE)
            try:
                blobs.append(None if arrays is None else P.record_to_bytes(arrays, P.UPDATE))
            except ValueError:
                blobs.append(None)
        results = iter(dgc.decode_many([b for b in blobs if b is not None],
                                       max_numel=self.max_numel))
        return [None if b is None else next(results) for b in blobs]

    def check(self, msg: Message, key: int, node: int, server_round: int, masks: Masks,
              decoded: SparseUpdate | DecodeError | None = None) -> CheckedReply:
        """One reply, "valid" or "rejected" with its reason.

        ``decoded``, if given, is what ``dgc.decode_many`` gave for this reply's update bytes:
        it stands in for decoding them here. The checks and their order are the same either way.
        """
        recorded = recorded_fields(msg)
        try:
            update, numbers, nbytes, signs = self._validate(msg, server_round, masks, decoded)
        except ReplyRejected as ex:
            return CheckedReply(msg, key, node, "rejected", str(ex),
                                uplink_bytes=payload_nbytes(msg), **recorded)
        return CheckedReply(msg, key, node, "valid", uplink_bytes=nbytes, update=update,
                            signs=signs, num_examples=numbers.num_examples,
                            train_loss=numbers.train_loss,
                            compute_seconds=numbers.compute_seconds, restored=numbers.restored,
                            **recorded)

    def _validate(self, msg: Message, server_round: int, masks: Masks,
                  decoded: SparseUpdate | DecodeError | None,
                  ) -> tuple[SparseUpdate, ReplyNumbers, int, SparseUpdate | None]:
        """(update, its metrics, uplink bytes, signs) of a valid reply; ReplyRejected if not.

        A reply to a message with shared index sets may carry the client's signs (a client
        without the channel, such as the phone encoder, sends none); they are decoded against
        the sets sent.
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
        try:
            if isinstance(decoded, DecodeError):
                raise decoded
            update = decoded if decoded is not None else dgc.decode(data,
                                                                    max_numel=self.max_numel)
        except DecodeError as ex:
            raise ReplyRejected(f"undecodable update ({len(data)} bytes): {ex}") from ex
        if update.sequence != server_round:
            raise ReplyRejected(f"update sequence {update.sequence} is not the round "
                                f"{server_round}")
        if update.packed is not None:
            # Straight from decode, whose checks cover indices and values: only the names and
            # shapes are left, once per layout (replies of one round share theirs).
            layout = update.packed.layout
            if layout not in self._checked_layouts:
                _check_tensors(dict(zip(layout.names, layout.shapes, strict=True)), self.shapes)
                self._checked_layouts.add(layout)
        else:
            _check_tensors({name: t.shape for name, t in update.tensors.items()}, self.shapes)
            for name, t in update.tensors.items():
                if t.nnz and (int(t.indices.min()) < 0 or int(t.indices.max()) >= t.numel):
                    raise ReplyRejected(f"tensor {name!r} has indices outside [0, {t.numel})")
                if not torch.isfinite(t.values).all():
                    raise ReplyRejected(f"tensor {name!r} carries NaN or Inf values")
        nbytes = len(data)
        shared = content.array_records.get(P.SHARED)
        signs = None
        if shared is not None:
            if not masks:
                raise ReplyRejected("shared signs in reply to a round without shared index sets")
            try:
                signs_data = P.record_to_bytes(shared, P.SHARED_SIGNS)
                signs = decode_shared(signs_data, masks, {n: self.shapes[n] for n in masks})
            except (ValueError, DecodeError) as ex:
                raise ReplyRejected(f"undecodable shared signs: {ex}") from ex
            if signs.sequence != server_round:
                raise ReplyRejected(f"shared signs sequence {signs.sequence} is not the round "
                                    f"{server_round}")
            nbytes += len(signs_data)
        return update, numbers, nbytes, signs
