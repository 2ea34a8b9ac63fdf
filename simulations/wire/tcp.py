"""TCP connections of a capture: both byte streams reassembled, and each packet's share.

Every captured packet becomes a :class:`Segment` of its connection: its bytes on the wire, its
IP/TCP header bytes, the range of *new* stream bytes it carried (a retransmission's repeated
bytes are counted apart), and the stream offset it acknowledged. A packet longer than the link's
MTU (the kernel's segmentation offload hands the capture point super-packets) is counted as the
MSS-sized segments a real link carries, each with its own headers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .pcap import TCP_ACK, TCP_SYN, Capture, TcpPacket

UP, DOWN = 0, 1  # client -> server, server -> client
_MOD = 1 << 32
#: MSS assumed when a connection's SYN was not captured (a 1500-byte MTU).
DEFAULT_MSS = 1460


@dataclass
class Segment:
    """One packet seen from its connection (offsets are relative to each stream's start)."""

    t: float
    direction: int
    wire_bytes: int
    header_bytes: int
    new_start: int
    new_end: int
    retransmitted: int
    ack_offset: int | None
    flags: int

    @property
    def payload(self) -> int:
        """New stream bytes carried."""
        return self.new_end - self.new_start


@dataclass
class Connection:
    """One TCP connection: the client (who sent the SYN), the server, packets and streams."""

    index: int
    client: tuple[str, int]
    server: tuple[str, int]
    segments: list[Segment] = field(default_factory=list)
    streams: tuple[bytes, bytes] = (b"", b"")
    missing: tuple[int, int] = (0, 0)  # stream bytes never captured (holes), per direction

    @property
    def start_s(self) -> float:
        """Time of its first packet."""
        return self.segments[0].t


class _Reassembly:
    """One direction of a connection: where its stream starts and which bytes arrived."""

    def __init__(self) -> None:
        self.base: int | None = None
        self.pieces: dict[int, bytes] = {}
        self.covered: list[list[int]] = []  # merged [start, end) intervals, sorted

    def add(self, start: int, data: bytes) -> tuple[int, int, int]:
        """Record ``data`` at ``start``; return (new_start, new_end, repeated bytes).

        A packet that both repeats and extends (a partial retransmission) counts its new tail.
        """
        end = start + len(data)
        new_start, new_end = start, end
        for lo, hi in self.covered:
            if lo <= new_start < hi:
                new_start = min(hi, end)
        new_end = max(new_start, end)
        repeated = (new_start - start)
        if new_end > new_start:
            self.pieces[new_start] = data[new_start - start:]
            self._cover(new_start, new_end)
        return new_start, new_end, repeated

    def _cover(self, lo: int, hi: int) -> None:
        merged = []
        for a, b in sorted([*self.covered, [lo, hi]]):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.covered = merged

    def stream(self) -> tuple[bytes, int]:
        """The stream from offset 0 to the last byte seen, holes filled with zeros, and the
        number of missing bytes."""
        if not self.covered:
            return b"", 0
        size = self.covered[-1][1]
        out = bytearray(size)
        for offset, piece in self.pieces.items():
            out[offset:offset + len(piece)] = piece
        missing = size - sum(b - a for a, b in self.covered)
        return bytes(out), missing


def connections(capture: Capture) -> list[Connection]:
    """The TCP connections of ``capture``, ordered by their first packet."""
    current: dict[frozenset[tuple[str, int]], tuple[Connection, list[_Reassembly],
                                                   list[int | None]]] = {}
    out: list[tuple[Connection, list[_Reassembly]]] = []
    for pkt in capture.packets:
        key = frozenset((pkt.src, pkt.dst))
        entry = current.get(key)
        opening = bool(pkt.flags & TCP_SYN) and not pkt.flags & TCP_ACK
        if entry is None or (opening and entry[1][UP].base is not None
                             and (pkt.seq + 1) % _MOD != entry[1][UP].base):
            # A new connection (a port pair reused after the old connection is a new SYN).
            client, server = pkt.src, pkt.dst
            if pkt.flags & TCP_SYN and pkt.flags & TCP_ACK:
                client, server = pkt.dst, pkt.src
            entry = (Connection(len(out), client, server), [_Reassembly(), _Reassembly()],
                     [None, None])
            current[key] = entry
            out.append((entry[0], entry[1]))
        conn, halves, mss = entry
        direction = UP if pkt.src == conn.client else DOWN
        conn.segments.append(_segment(pkt, direction, halves, mss))
    for conn, halves in out:
        up, missing_up = halves[UP].stream()
        down, missing_down = halves[DOWN].stream()
        conn.streams, conn.missing = (up, down), (missing_up, missing_down)
    return [conn for conn, _ in out]


def _segment(pkt: TcpPacket, direction: int, halves: list[_Reassembly],
             mss: list[int | None]) -> Segment:
    half = halves[direction]
    if pkt.flags & TCP_SYN:
        half.base = (pkt.seq + 1) % _MOD
        if pkt.mss:
            mss[direction] = pkt.mss
    if half.base is None:
        half.base = pkt.seq  # the connection began before the capture
    new_start = new_end = repeated = 0
    if pkt.payload:
        start = (pkt.seq - half.base) % _MOD
        new_start, new_end, repeated = half.add(start, pkt.payload)
    other = halves[1 - direction]
    ack_offset = None
    if pkt.flags & TCP_ACK and other.base is not None:
        ack_offset = (pkt.ack - other.base) % _MOD
        if ack_offset > _MOD // 2:
            ack_offset = 0  # acknowledges the SYN
    # Segments a real link carries: the peer's MSS bounds the payload of each.
    peer_mss = mss[1 - direction] or DEFAULT_MSS
    options = max(0, pkt.header_bytes - 40)
    per_segment = max(1, peer_mss - options)
    payload = len(pkt.payload)
    count = max(1, math.ceil(payload / per_segment))
    header = pkt.header_bytes * count
    return Segment(pkt.t, direction, header + payload, header, new_start, new_end, repeated,
                   ack_offset, pkt.flags)
