"""TLS on a captured connection: records, their overhead, and TLS 1.3 decryption from a key log.

Every TLS record is a 5-byte header and a fragment. Without keys a record's inner content type
is hidden; with the session secrets of an ``SSLKEYLOGFILE`` (NSS key log format: Python's
``ssl`` and OpenSSL write it) the records of TLS 1.3 decrypt (RFC 8446, section 5.2:
``AEAD(key, iv XOR seq, header)``, keys from ``HKDF-Expand-Label``, section 7.1) and each record
is exactly split into what TLS adds (header, inner type byte, padding, the AEAD tag, and the
handshake, alert and session-ticket records) and the application's plaintext.
"""

from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from .errors import WireError

HANDSHAKE, CHANGE_CIPHER_SPEC, ALERT, APPLICATION_DATA = 22, 20, 21, 23
_HEADER = 5
#: TLS 1.3 cipher suites: (AEAD, key bytes, hash).
_SUITES = {
    0x1301: (AESGCM, 16, "sha256"),
    0x1302: (AESGCM, 32, "sha384"),
    0x1303: (ChaCha20Poly1305, 32, "sha256"),
}
_FINISHED = 20


@dataclass
class Record:
    """One TLS record: where it lies in the TCP stream, and what it carried.

    ``plain_start``/``plain_end`` locate its application data in the connection's plaintext
    stream (equal when it carried none: handshake, alert, change-cipher-spec, ticket).
    """

    start: int
    end: int
    outer_type: int
    inner_type: int | None = None
    plain_start: int = 0
    plain_end: int = 0
    unreadable: bool = False  # the capture missed some of its bytes: it could not be opened

    @property
    def overhead(self) -> int:
        """Bytes TLS added: the whole record less the application data it carried (0 for an
        unreadable record, whose bytes are nobody's)."""
        if self.unreadable:
            return 0
        return (self.end - self.start) - (self.plain_end - self.plain_start)


@dataclass
class TlsStream:
    """One direction of a TLS connection: its records and the application plaintext."""

    records: list[Record]
    plaintext: bytes
    trailing: int  # stream bytes after the last whole record (cut by the capture's end)

    @property
    def unreadable(self) -> int:
        """Bytes of records that could not be opened (the capture missed part of them)."""
        return sum(r.end - r.start for r in self.records if r.unreadable)


def looks_like_tls(stream: bytes) -> bool:
    """Whether a client stream starts with a TLS handshake record (a ClientHello)."""
    return len(stream) >= 6 and stream[0] == HANDSHAKE and stream[1] == 3 and stream[5] == 1


def split_records(stream: bytes) -> tuple[list[Record], int]:
    """The records of a TLS byte stream, and the bytes left after the last whole record."""
    records, pos = [], 0
    while pos + _HEADER <= len(stream):
        length = struct.unpack("!H", stream[pos + 3:pos + 5])[0]
        if pos + _HEADER + length > len(stream):
            break
        records.append(Record(pos, pos + _HEADER + length, stream[pos]))
        pos += _HEADER + length
    return records, len(stream) - pos


def read_keylog(path: Path) -> dict[bytes, dict[str, bytes]]:
    """``client_random -> {label: secret}`` from an NSS key log file.

    Raises
    ------
    WireError
        When the file cannot be read or a line is not ``LABEL <hex random> <hex secret>``.
    """
    try:
        text = Path(path).read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as err:
        raise WireError(f"{path}: cannot read the TLS key log ({err})") from None
    out: dict[bytes, dict[str, bytes]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split()
        try:
            if len(parts) != 3:
                raise ValueError
            out.setdefault(bytes.fromhex(parts[1]), {})[parts[0]] = bytes.fromhex(parts[2])
        except ValueError:
            raise WireError(f"{path}:{number}: expected 'LABEL <hex client random> <hex "
                            f"secret>', got {line[:80]!r}") from None
    return out


def _expand_label(secret: bytes, label: str, length: int, digest: str) -> bytes:
    full = b"tls13 " + label.encode()
    info = struct.pack("!H", length) + bytes([len(full)]) + full + b"\x00"
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(secret, block + info + bytes([counter]), digest).digest()
        out += block
        counter += 1
    return out[:length]


class _Cipher:
    def __init__(self, suite: int, secret: bytes) -> None:
        aead, key_len, digest = _SUITES[suite]
        self.aead = aead(_expand_label(secret, "key", key_len, digest))
        self.iv = _expand_label(secret, "iv", 12, digest)
        self.seq = 0

    def open(self, header: bytes, fragment: bytes) -> tuple[int, bytes]:
        nonce = bytes(a ^ b for a, b in zip(self.iv, self.seq.to_bytes(12, "big"), strict=True))
        self.seq += 1
        inner = self.aead.decrypt(nonce, fragment, header).rstrip(b"\x00")
        if not inner:
            raise ValueError("empty inner plaintext")
        return inner[-1], inner[:-1]


def client_random(client_stream: bytes) -> bytes | None:
    """The 32-byte random of the ClientHello that opens ``client_stream``."""
    if not looks_like_tls(client_stream) or len(client_stream) < _HEADER + 4 + 2 + 32:
        return None
    return client_stream[_HEADER + 6:_HEADER + 6 + 32]


def _server_hello(server_stream: bytes) -> tuple[int, int] | None:
    """(cipher suite, negotiated version) of the ServerHello opening ``server_stream``."""
    if len(server_stream) < _HEADER + 4 + 2 + 32 + 1 or server_stream[0] != HANDSHAKE:
        return None
    body = server_stream[_HEADER + 4:]
    sid_len = body[34]
    suite = struct.unpack("!H", body[35 + sid_len:37 + sid_len])[0]
    pos = 37 + sid_len + 1  # compression method
    version = struct.unpack("!H", body[:2])[0]
    ext_end = pos + 2 + struct.unpack("!H", body[pos:pos + 2])[0]
    pos += 2
    while pos + 4 <= ext_end:
        kind, size = struct.unpack("!HH", body[pos:pos + 4])
        if kind == 43 and size == 2:  # supported_versions: the real version of TLS 1.3
            version = struct.unpack("!H", body[pos + 4:pos + 6])[0]
        pos += 4 + size
    return suite, version


def decrypt_connection(client_stream: bytes, server_stream: bytes,
                       secrets: dict[str, bytes], where: str,
                       holes: tuple[int, int] = (0, 0)) -> tuple[TlsStream, TlsStream]:
    """Both directions of a TLS 1.3 connection, decrypted with its ``secrets``.

    ``holes`` are the stream bytes the capture missed per direction: where there are some, a
    record that does not authenticate is marked unreadable (its bytes nobody's) and the next
    ones still open (each record has its own nonce).

    Raises
    ------
    WireError
        When the connection is not TLS 1.3 with a known suite, a secret is missing, or a
        record of a fully captured stream does not authenticate (``where`` names the
        connection in the message).
    """
    hello = _server_hello(server_stream)
    if hello is None:
        raise WireError(f"{where}: no ServerHello")
    suite, version = hello
    if version != 0x0304 or suite not in _SUITES:
        raise WireError(f"{where}: TLS version {version:#06x} suite {suite:#06x}; decryption "
                        f"handles TLS 1.3 (0x0304) with suites {sorted(_SUITES)}")
    out = []
    for stream, side, missing in ((client_stream, "CLIENT", holes[0]),
                                  (server_stream, "SERVER", holes[1])):
        try:
            handshake = _Cipher(suite, secrets[f"{side}_HANDSHAKE_TRAFFIC_SECRET"])
            application = _Cipher(suite, secrets[f"{side}_TRAFFIC_SECRET_0"])
        except KeyError as err:
            raise WireError(f"{where}: key log lacks {err.args[0]} for this connection") from None
        records, trailing = split_records(stream)
        cipher = None  # plaintext until the first encrypted record
        plain = bytearray()
        for record in records:
            header = stream[record.start:record.start + _HEADER]
            fragment = stream[record.start + _HEADER:record.end]
            record.plain_start = record.plain_end = len(plain)
            if record.outer_type != APPLICATION_DATA:
                record.inner_type = record.outer_type
                continue
            if cipher is None:
                cipher = handshake
            try:
                inner_type, content = cipher.open(header, fragment)
            except (InvalidTag, ValueError):
                if missing:
                    record.unreadable = True
                    continue
                raise WireError(f"{where}: {side.lower()} record at stream byte {record.start} "
                                f"does not decrypt with the logged secrets") from None
            record.inner_type = inner_type
            if inner_type == APPLICATION_DATA:
                plain += content
                record.plain_end = len(plain)
            elif cipher is handshake and inner_type == HANDSHAKE and _ends_with_finished(content):
                cipher = application
        out.append(TlsStream(records, bytes(plain), trailing))
    return out[0], out[1]


def _ends_with_finished(content: bytes) -> bool:
    """Whether a handshake record's messages end with Finished (then the keys change)."""
    pos, last = 0, None
    while pos + 4 <= len(content):
        last = content[pos]
        pos += 4 + int.from_bytes(content[pos + 1:pos + 4], "big")
    return last == _FINISHED
