"""A round's extra exchanges on the emulated links: secure aggregation's stages, each a request
from the server and a reply, charged to a client's link as its train message is
(:mod:`simulations.netem.mod`), on the server's side of the virtual clock.

Each exchange waits for the node's poll, moves the request down (the profile's bytes for a
message of one record and one Array, its RPCs' round trips), starts the app (the profile's
start-up), and moves the reply up, the radio's joules counted over both transfers as a train
exchange's are (its own radio session: the stages are seconds apart); a link that goes down
under ``outage_policy = fail``, or a device away that round, loses the reply: the client drops
out of the protocol there, and the shares recover it (:mod:`fedgc.privacy.secagg`).
"""

from __future__ import annotations

from dataclasses import dataclass

from simulations.netem.energy import Transfer
from simulations.netem.mod import _energy, _poll_wait_s
from simulations.netem.protocol import ProtocolModel, message_objects
from simulations.netem.settings import NetemSettings, assignment_for

__all__ = ["StageExchange", "stage_exchange"]


@dataclass(frozen=True)
class StageExchange:
    """One client's exchange: whether its reply arrived, when, and its bytes on the wire
    (``up``: requests and the reply; ``down``: the request and acknowledgements)."""

    ok: bool
    finish_s: float
    wire_up_bytes: int
    wire_down_bytes: int
    radio_j: float = 0.0


def stage_exchange(settings: NetemSettings, proto: ProtocolModel | None, key: int,
                   round_index: int, start_s: float, request_bytes: int,
                   reply_bytes: int) -> StageExchange:
    """Client ``key``'s exchange of a ``request_bytes`` request and a ``reply_bytes`` reply
    (0: it sent none) from ``start_s`` on the virtual clock."""
    net = assignment_for(settings)[key]
    if not net.device.is_available(round_index):
        return StageExchange(False, start_s, 0, 0)
    latency_s = net.link.latency_ms / 1000.0
    t0 = start_s + _poll_wait_s(proto, settings, key, round_index)
    objects = message_objects([request_bytes], 1)
    if proto is None:
        requests_up, down_wire, rtt = 0, request_bytes, 0.0
    else:
        requests_up, down_wire = proto.download(request_bytes, objects)
        rtt = max(0, proto.rpcs("down", objects) - 1) * latency_s
    down = net.link.transfer(down_wire, t0, "down", round_index=round_index)
    spans = [Transfer(t0, down.end_s + rtt, up_bytes=requests_up, down_bytes=down.wire_bytes)]
    if not down.ok or reply_bytes <= 0:
        return StageExchange(False, down.end_s, requests_up, down.wire_bytes,
                             _energy(settings, net, proto, spans, 0.0)[0])
    startup_s = proto.clientapp_startup_s if proto is not None else 0.0
    objects = message_objects([reply_bytes], 1)
    if proto is None:
        up_wire, acks_down, rtt_up = reply_bytes, 0, 0.0
    else:
        up_wire, acks_down = proto.upload(reply_bytes, objects)
        rtt_up = max(0, proto.rpcs("up", objects) - 1) * latency_s
    start_up = down.end_s + rtt + startup_s
    up = net.link.transfer(up_wire, start_up, "up", round_index=round_index)
    finish = up.end_s + (rtt_up if up.ok else 0.0)
    spans.append(Transfer(start_up, max(start_up, finish), up_bytes=up.wire_bytes,
                          down_bytes=acks_down))
    return StageExchange(up.ok, finish, requests_up + up.wire_bytes, down.wire_bytes + acks_down,
                         _energy(settings, net, proto, spans, 0.0)[0])
