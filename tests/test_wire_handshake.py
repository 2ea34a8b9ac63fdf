"""A SuperNode capture whose TLS client never finished its handshake (issue 38's node killed
between the SecAgg stages): the connection carried no message, so its bytes stay unattributed,
and a connection that did carry encrypted records still needs its secrets."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from simulations.wire.errors import WireError
from simulations.wire.supernode import analyse_supernode

CLIENT, SERVER = ("10.0.0.2", 40000), ("10.0.0.1", 9092)
RANDOM = bytes(range(32))


def _record(kind: int, body: bytes) -> bytes:
    return struct.pack("!BHH", kind, 0x0303, len(body)) + body


def _client_hello() -> bytes:
    body = b"\x03\x03" + RANDOM + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00" + b"\x00\x00"
    return _record(22, b"\x01" + len(body).to_bytes(3, "big") + body)


def _packet(src: tuple[str, int], dst: tuple[str, int], seq: int, ack: int, flags: int,
            payload: bytes = b"") -> bytes:
    tcp = struct.pack("!HHIIBBHHH", src[1], dst[1], seq, ack, 5 << 4, flags, 65535, 0, 0)
    total = 20 + len(tcp) + len(payload)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, total, 0, 0, 64, 6, 0,
                     bytes(int(x) for x in src[0].split(".")),
                     bytes(int(x) for x in dst[0].split(".")))
    return ip + tcp + payload


def _pcap(path: Path, client_records: bytes) -> Path:
    """A raw-IPv4 pcap of one connection: the handshake's SYNs, then the client's records."""
    syn, synack, ack, psh = 0x02, 0x12, 0x10, 0x18
    frames = [_packet(CLIENT, SERVER, 999, 0, syn), _packet(SERVER, CLIENT, 4999, 1000, synack),
              _packet(CLIENT, SERVER, 1000, 5000, ack),
              _packet(CLIENT, SERVER, 1000, 5000, psh, client_records)]
    out = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 101)
    for i, frame in enumerate(frames):
        out += struct.pack("<IIII", i, 0, len(frame), len(frame)) + frame
    path.write_bytes(out)
    return path


@pytest.fixture
def keylog(tmp_path: Path) -> Path:
    """A key log with another connection's secrets only."""
    path = tmp_path / "keys.log"
    path.write_text(f"CLIENT_TRAFFIC_SECRET_0 {'ab' * 32} {'cd' * 32}\n")
    return path


def test_a_handshake_that_never_finished_leaves_its_bytes_unattributed(tmp_path, keylog):
    pcap = _pcap(tmp_path / "cut.pcap", _client_hello())
    [conn] = analyse_supernode(pcap, keylog)
    assert conn.exchanges == []
    assert conn.unattributed == conn.wire_bytes and conn.wire_bytes[0] > len(_client_hello())


def test_encrypted_records_without_their_secrets_are_still_refused(tmp_path, keylog):
    pcap = _pcap(tmp_path / "data.pcap", _client_hello() + _record(23, b"\x00" * 40))
    with pytest.raises(WireError, match="has no secrets for client random " + RANDOM.hex()):
        analyse_supernode(pcap, keylog)
