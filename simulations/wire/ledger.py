"""Where a link's bytes go: exchanges, their bytes per layer, and the totals they add up to.

An *exchange* is one request and its response (one RPC). Its bytes, per direction, fall in six
categories, from the application down to the wire:

- ``payload``: fedgc's payload (the encoded update, the model or patch);
- ``fedgc``: the rest of what fedgc puts in its messages (config records, metrics, record keys,
  array metadata; on the phone bridge, every field of its protobufs besides the payload);
- ``flower``: Flower's message envelope and protocol messages (object heads and ids, object
  trees, message metadata, polls, heartbeats, registration, the app bundle);
- ``http``: HTTP/1.1 heads and chunk framing (SuperNode) or gRPC and HTTP/2 framing (bridge);
- ``tls``: record headers, inner type bytes, AEAD tags, handshakes, tickets, alerts;
- ``tcpip``: IPv4 and TCP headers of every packet (pure ACKs, SYN and FIN included) and the
  payload of retransmissions.

:func:`attribute` gives each TLS record and each packet to the exchange whose bytes it carried
(an acknowledgement to the exchange whose bytes it acknowledged; a connection's handshake to its
first exchange), so the categories of all exchanges add up to every byte captured, except bytes
that could not be parsed, which are reported as ``unattributed``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .tcp import DOWN, UP, Connection
from .tls import TlsStream

CATEGORIES = ("payload", "fedgc", "flower", "http", "tls", "tcpip")
DIRECTIONS = ("up", "down")


def empty() -> dict[str, int]:
    """A zero count per category."""
    return dict.fromkeys(CATEGORIES, 0)


@dataclass
class Exchange:
    """One RPC on one connection and the bytes it cost, per direction and category.

    ``spans`` are its request's and its response's ranges in the connection's plaintext
    streams (up, down). ``kind`` says what it was for (``train-down``, ``train-up``, ``poll``,
    ``heartbeat``, ``setup``, ...), ``round`` the server round of its message (None for idle
    and setup traffic).
    """

    conn: int
    rpc: str
    kind: str
    round: int | None
    spans: tuple[tuple[int, int], tuple[int, int]]
    bytes: tuple[dict[str, int], dict[str, int]] = field(default_factory=lambda: (empty(),
                                                                                   empty()))
    t_start: float = float("inf")
    t_end: float = float("-inf")
    detail: dict[str, object] = field(default_factory=dict)

    def total(self, direction: int) -> int:
        """Every byte of one direction."""
        return sum(self.bytes[direction].values())


@dataclass
class Attribution:
    """A connection's exchanges with TLS and TCP/IP bytes added, and what could not be placed."""

    exchanges: list[Exchange]
    wire_bytes: tuple[int, int]
    unattributed: tuple[int, int]
    missed: tuple[int, int] = (0, 0)  # stream bytes the capture never saw (kernel drops)


def attribute(conn: Connection, exchanges: list[Exchange],
              tls: tuple[TlsStream, TlsStream] | None,
              unparsed_plain: tuple[int, int] = (0, 0)) -> Attribution:
    """Add each exchange's TLS and TCP/IP bytes, and time it, from ``conn``'s packets.

    ``exchanges`` already hold their application and HTTP bytes; ``tls`` is None for a
    connection in plaintext; ``unparsed_plain`` counts plaintext bytes no exchange holds.
    """
    wire = (sum(s.wire_bytes for s in conn.segments if s.direction == UP),
            sum(s.wire_bytes for s in conn.segments if s.direction == DOWN))
    if not exchanges:
        return Attribution([], wire, wire, conn.missing)
    starts = [[x.spans[d][0] for x in exchanges] for d in (UP, DOWN)]

    def by_plain(direction: int, offset: int) -> Exchange:
        i = bisect.bisect_right(starts[direction], offset) - 1
        return exchanges[max(0, i)]

    unplaced = list(unparsed_plain)
    # Stream offset -> exchange, through the TLS records when there are any.
    record_starts: list[list[int]] = [[], []]
    record_owner: list[list[Exchange]] = [[], []]
    if tls is not None:
        for d in (UP, DOWN):
            records = tls[d].records
            owners: list[Exchange | None] = [None] * len(records)
            following: Exchange | None = None
            for i in range(len(records) - 1, -1, -1):  # non-data records go with what follows
                r = records[i]
                if r.plain_end > r.plain_start:
                    following = by_plain(d, r.plain_start)
                owners[i] = following
            last = next((o for o in reversed(owners) if o is not None), exchanges[-1])
            for r, owner in zip(records, owners, strict=True):
                owner = owner or last
                owner.bytes[d]["tls"] += r.overhead
                record_starts[d].append(r.start)
                record_owner[d].append(owner)
            # An unreadable record's bytes were captured in part (the rest is a hole).
            unplaced[d] += tls[d].trailing + max(0, tls[d].unreadable - conn.missing[d])

    def by_stream(direction: int, offset: int) -> tuple[Exchange, bool]:
        """The exchange owning a stream byte, and whether the byte is application data (a
        TLS alert or ticket is not: it must not stretch the exchange's time)."""
        if tls is None:
            return by_plain(direction, offset), True
        i = bisect.bisect_right(record_starts[direction], offset) - 1
        if not record_owner[direction]:
            return exchanges[0], False
        record = tls[direction].records[max(0, i)]
        return record_owner[direction][max(0, i)], record.plain_end > record.plain_start

    for seg in conn.segments:
        if seg.payload:
            owner, data = by_stream(seg.direction, seg.new_start)
            if data:
                owner.t_start = min(owner.t_start, seg.t)
                owner.t_end = max(owner.t_end, seg.t)
        elif seg.ack_offset:
            owner = by_stream(1 - seg.direction, seg.ack_offset - 1)[0]
        else:
            owner = exchanges[0]  # SYN, and the ACK of the SYN-ACK
        owner.bytes[seg.direction]["tcpip"] += seg.header_bytes + seg.retransmitted
    return Attribution(exchanges, wire, (unplaced[0], unplaced[1]), conn.missing)


def add(into: dict[str, int], other: dict[str, int]) -> None:
    """``into += other``, per category."""
    for key, value in other.items():
        into[key] = into.get(key, 0) + value
