"""A client's part of a private round: its secure-aggregation stages and its masked reply.

Under ``privacy.secagg`` a round is SecAgg+'s four stages (:mod:`fedgc.privacy.secagg`), each a
real Flower message: setup and share keys come as queries of action ``secagg`` before the
train message (:func:`answer_stage`), the train message carries stage 2's request (the
neighbours' encrypted shares) and its reply the masked vector in place of the payload
(:func:`masked_content`), and the unmasking is a last query. The handler's state (its seeds:
as secret as the update) lives in the node's Context between the messages.

The vector a client masks is its decoded payload at the round's shared coordinates
(:class:`fedgc.privacy.linear.Layout`), after the method's per-client top-k went back to its
residual (:func:`held_back`), clipped to ``privacy.clip`` (the DP boundary, docs/privacy.md) and
written in the fixed point.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict

from dgc import SparseUpdate
from fedgc import methods
from fedgc import protocol as P
from fedgc.methods import Bound, Payload
from fedgc.methods.material import material_of
from fedgc.privacy import FixedPoint
from fedgc.privacy.dp import DistributedDiscreteGaussian, clip_update, clip_vector
from fedgc.privacy.linear import Layout, hold_back, round_layout
from fedgc.privacy.secagg import ClientHandler, SecAggError
from fedgc.settings import TrainSettings

__all__ = ["SecureRoundError", "answer_stage", "clip_bit", "clipped", "held_back", "layout_of",
           "masked_content", "round_clip"]

_STATE = "secagg_state"  # the Context's ConfigRecord holding the handler


class SecureRoundError(P.ProtocolError):
    """A secure-aggregation message this client cannot act on (the text says why)."""


def _save(context: Context, handler: ClientHandler) -> None:
    state = {k: (v.hex() if isinstance(v, bytes) else
                 [x.hex() if isinstance(x, bytes) else x for x in v] if isinstance(v, list)
                 else v) for k, v in handler.state_dict().items()}
    context.state[_STATE] = ConfigRecord({"json": json.dumps(state)})


def _load(context: Context) -> ClientHandler:
    record = context.state.config_records.get(_STATE)
    if record is None:
        raise SecureRoundError("a secure-aggregation request without a session: this client "
                               "was not sent the setup")
    raw = json.loads(str(record["json"]))
    byte_keys = ("setup", "seeds")
    list_keys = ("neighbour_keys", "held_shares")
    state = {k: (bytes.fromhex(v) if k in byte_keys else
                 [bytes.fromhex(x) for x in v] if k in list_keys else v) for k, v in raw.items()}
    try:
        return ClientHandler.from_state(state)
    except SecAggError as ex:
        raise SecureRoundError(str(ex)) from ex


def request_bytes(content: RecordDict) -> bytes:
    """The secure-aggregation request a message carries (SecureRoundError when none)."""
    record = content.array_records.get(P.SECAGG)
    if record is None:
        raise SecureRoundError(f"the message carries no {P.SECAGG!r} ArrayRecord")
    try:
        return P.record_to_bytes(record, P.SECAGG)
    except ValueError as ex:
        raise SecureRoundError(str(ex)) from ex


def answer_stage(msg: Message, context: Context, key: int) -> Message:
    """The reply to a setup, share-keys or unmask request (query action ``secagg``)."""
    data = request_bytes(msg.content)
    handler = ClientHandler(key) if bytes(data[:4]) == b"FGA0" else _load(context)
    try:
        reply = handler.handle(data)
    except SecAggError as ex:
        raise SecureRoundError(f"client {key}: {ex}") from ex
    _save(context, handler)
    return Message(RecordDict({P.SECAGG: P.bytes_to_record(reply, P.SECAGG)}), reply_to=msg)


def layout_of(method: methods.Method, s: TrainSettings, payload: Payload | None,
              shapes: dict[str, tuple[int, ...]], material: Any, server_round: int) -> Layout:
    """The round's shared coordinates as this client computes them: in the space of its
    decoded ``payload``'s parts for a method that sums all of them (a sketch's), in the
    model's (``shapes``) otherwise, from the material it holds."""
    space = shapes
    if method.secure_sum == "all" and payload is not None:
        space = {n: tuple(t.shape) for part in payload.parts() for n, t in part.tensors.items()}
    return round_layout(method, s, space, material, server_round)


def held_back(method: methods.Method, s: TrainSettings, compressor: Any,
              update: SparseUpdate, shapes: dict[str, tuple[int, ...]], material: Any,
              server_round: int) -> SparseUpdate:
    """``update`` without what secure aggregation cannot sum (a per-client top-k), which goes
    back into the residual (a method whose payload sits at the round material's sets)."""
    if method.secure_sum != "material" or compressor is None:
        return update
    layout = layout_of(method, s, None, shapes, material, server_round)
    return hold_back(compressor, update, layout)[0]


def masked_content(msg: Message, context: Context, key: int, s: TrainSettings,
                   method: methods.Method, data: bytes, side: bytes | None, material: Any,
                   shapes: dict[str, tuple[int, ...]], metrics: dict[str, int | float],
                   server_round: int, seed: int, bit: int | None = None) -> RecordDict:
    """The train reply's content under secure aggregation: the masked vector of the payload
    ``data`` (and its side part ``side``) at the round's layout, clipped and in fixed point,
    with the metrics; stage 2 of the session the message's request continues. Under adaptive
    clipping the clip ``bit`` is one more coordinate, ``bit x`` the fixed point's range (an
    exact level: the server reads the count of bits from the sum), not in the metrics."""
    codec = method.codec(s)
    payload = codec.decode(data, Bound(shapes, server_round, material))
    part = material_of(method)
    if side is not None and part is not None:
        payload = payload.attach(part.read_side(side, material, shapes))
    layout = layout_of(method, s, payload, shapes, material, server_round)
    vector = layout.vector(payload)
    if s.privacy_clip > 0:
        vector = clip_vector(vector, s.privacy_clip)[0]
    handler = _load(context)
    setup = handler.setup_request
    length = layout.length + (bit is not None)
    if setup is None or setup.length != length:
        summed = None if setup is None else setup.length
        raise SecureRoundError(f"client {key}: the session sums {summed} coordinates, this "
                               f"round's layout and clip bit have {length}")
    fp = FixedPoint(s.fixed_point_range, s.privacy_value_bits, setup.modulus_bits)
    if bit is not None:
        vector = np.append(vector, bit * fp.clip)
        metrics = {k: v for k, v in metrics.items() if k != P.DP_CLIP_BIT}
    if s.privacy_dp == "distributed":
        # Its share of the noise, from the OS: a server that could repeat it could remove it.
        share = DistributedDiscreteGaussian.for_keys(s, layout.length).privatize(
            vector, np.random.default_rng())
        ring, clamped = fp.to_ring(share), 0
    else:
        ring, clamped = fp.encode(vector, np.random.default_rng(seed))
    try:
        masked = handler.masked_vector(request_bytes(msg.content), ring)
    except SecAggError as ex:
        raise SecureRoundError(f"client {key}: {ex}") from ex
    _save(context, handler)
    if clamped:
        metrics = {**metrics, P.SECAGG_SATURATED: int(clamped)}
    return RecordDict({P.SECAGG: P.bytes_to_record(masked, P.SECAGG),
                       P.METRICS: MetricRecord(dict(metrics))})


def clipped(pseudo_gradient: dict[str, torch.Tensor], s: TrainSettings
            ) -> dict[str, torch.Tensor]:
    """The pseudo-gradient clipped to ``privacy.clip`` x ``privacy.update_clip`` (0: not
    clipped) before the method compresses it (the update's scale stays where the method was
    tuned; the guarantee's clip is the vector's, at ``privacy.clip``)."""
    if s.privacy_clip <= 0 or s.privacy_update_clip <= 0:
        return pseudo_gradient
    return clip_update(pseudo_gradient, s.privacy_clip * s.privacy_update_clip)[0]


def round_clip(s: TrainSettings, config: Any) -> TrainSettings:
    """``s`` with the round's clip of adaptive clipping (``P.DP_CLIP`` in the train message's
    config) as ``privacy.clip``; ``s`` itself when the message carries none.

    Raises
    ------
    SecureRoundError
        The clip is not a finite number > 0.
    """
    if not s.adaptive_clip or P.DP_CLIP not in config:
        return s
    clip = config[P.DP_CLIP]
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not (
            math.isfinite(clip) and clip > 0):
        raise SecureRoundError(f"{P.DP_CLIP} = {clip!r}: expected a finite number > 0")
    return dataclasses.replace(s, privacy_clip=float(clip))


def clip_bit(pseudo_gradient: dict[str, torch.Tensor], s: TrainSettings) -> int | None:
    """Adaptive clipping's bit of this client (Andrew et al.): 1 when its update's L2 norm is
    within the round's clip, before it is clipped; None without adaptive clipping."""
    if not s.adaptive_clip:
        return None
    norm = math.sqrt(sum(float(t.detach().to(torch.float64).pow(2).sum())
                         for t in pseudo_gradient.values()))
    return int(norm <= s.privacy_clip)
