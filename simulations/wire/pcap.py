"""Read a classic pcap file (what ``tcpdump -w`` writes) into IPv4/TCP packets.

Link types: Ethernet (1), Linux cooked v1 (113) and v2 (276), raw IPv4 (101, 228). Packets that
are not IPv4/TCP are skipped (counted); a truncated record or a packet cut by the snap length is
an error, because its bytes could not be attributed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import WireError

_MAGIC = {
    b"\xd4\xc3\xb2\xa1": ("<", 1e-6),
    b"\xa1\xb2\xc3\xd4": (">", 1e-6),
    b"\x4d\x3c\xb2\xa1": ("<", 1e-9),
    b"\xa1\xb2\x3c\x4d": (">", 1e-9),
}
#: Link-layer header bytes before the IP header, by link type.
_LINK_HEADER = {1: 14, 113: 16, 276: 20, 101: 0, 228: 0}

TCP_FIN, TCP_SYN, TCP_RST, TCP_ACK = 0x01, 0x02, 0x04, 0x10


@dataclass(frozen=True)
class TcpPacket:
    """One IPv4/TCP packet as captured.

    ``ip_bytes`` is the IP datagram's total length; ``header_bytes`` its IP and TCP headers
    (options included), so the TCP payload is ``ip_bytes - header_bytes``.
    """

    t: float
    src: tuple[str, int]
    dst: tuple[str, int]
    ip_bytes: int
    header_bytes: int
    seq: int
    ack: int
    flags: int
    mss: int | None  # the MSS option of a SYN
    payload: bytes


@dataclass
class Capture:
    """The TCP packets of one pcap file, in file order, and what was skipped."""

    path: Path
    packets: list[TcpPacket]
    skipped: int


def _ip(raw: bytes) -> str:
    return ".".join(str(b) for b in raw)


def read_pcap(path: Path) -> Capture:
    """Every IPv4/TCP packet of ``path``.

    Raises
    ------
    WireError
        Missing file, unknown magic or link type, a truncated record, or a packet shorter than
        its IP length says (captured with a snap length: rerun tcpdump with ``-s 0``).
    """
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise WireError(f"{path}: cannot read the capture ({err.strerror})") from None
    if len(data) < 24 or data[:4] not in _MAGIC:
        raise WireError(f"{path}: pcap magic {data[:4].hex() or 'none'}, expected a classic pcap "
                        f"file (tcpdump -w)")
    order, unit = _MAGIC[data[:4]]
    linktype = struct.unpack(order + "I", data[20:24])[0] & 0x0FFFFFFF
    if linktype not in _LINK_HEADER:
        raise WireError(f"{path}: link type {linktype}, expected one of {sorted(_LINK_HEADER)}")
    link_bytes = _LINK_HEADER[linktype]
    packets: list[TcpPacket] = []
    skipped = 0
    pos, index = 24, 0
    while pos < len(data):
        if pos + 16 > len(data):
            raise WireError(f"{path}: record {index} header truncated at byte {pos} (file of "
                            f"{len(data)} bytes)")
        sec, frac, caplen, origlen = struct.unpack(order + "IIII", data[pos:pos + 16])
        pos += 16
        if pos + caplen > len(data):
            raise WireError(f"{path}: record {index} truncated: {caplen} bytes announced, "
                            f"{len(data) - pos} left")
        frame = data[pos:pos + caplen]
        pos += caplen
        if caplen < origlen:
            raise WireError(f"{path}: record {index} captured {caplen} of {origlen} bytes; "
                            f"expected whole packets (tcpdump -s 0)")
        packet = _tcp_packet(frame, link_bytes, linktype, sec + frac * unit)
        if packet is None:
            skipped += 1
        else:
            packets.append(packet)
        index += 1
    return Capture(Path(path), packets, skipped)


def _tcp_packet(frame: bytes, link_bytes: int, linktype: int, t: float) -> TcpPacket | None:
    if linktype == 1 and len(frame) >= 14 and frame[12:14] != b"\x08\x00":
        return None  # not IPv4 (ARP, IPv6)
    ip = frame[link_bytes:]
    if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:
        return None
    ihl = (ip[0] & 0x0F) * 4
    total = struct.unpack("!H", ip[2:4])[0]
    if len(ip) < total or total < ihl + 20:
        return None
    tcp = ip[ihl:total]
    sport, dport, seq, ack = struct.unpack("!HHII", tcp[:12])
    offset = (tcp[12] >> 4) * 4
    flags = tcp[13]
    mss = None
    if flags & TCP_SYN:
        opts, i = tcp[20:offset], 0
        while i < len(opts):
            kind = opts[i]
            if kind == 0:
                break
            if kind == 1:
                i += 1
                continue
            if i + 1 >= len(opts) or opts[i + 1] < 2:
                break
            if kind == 2 and opts[i + 1] == 4:
                mss = struct.unpack("!H", opts[i + 2:i + 4])[0]
            i += opts[i + 1]
    return TcpPacket(t, (_ip(ip[12:16]), sport), (_ip(ip[16:20]), dport), total, ihl + offset,
                     seq, ack, flags, mss, bytes(tcp[offset:]))
