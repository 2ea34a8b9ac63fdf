"""The messages of secure aggregation as bytes: one request and one reply per stage.

Every message keeps fedgc's framing (``dgc/wire/framing.py``: magic, version, fields, CRC-32
trailer) and starts with the session's 16-byte id; all integers are little-endian, ids u64.
Records have fixed sizes, so a decoder checks that the count it reads fills the message exactly
before it reads one record, and refuses anything else with :class:`BadMessage`::

    stage 0  setup         FGA0 request  session | round u64 | client u64 | clients u32
                                         | neighbours u32 | threshold u32 | length u64 | bits u8
                           FGA1 reply    session | client u64 | cipher key 32 | mask key 32
    stage 1  share keys    FGA2 request  session | count u32 | (id u64 | cipher key | mask key)*
                           FGA3 reply    session | client u64 | seed commitment 32 | count u32
                                         | (target u64 | commitment 16 * 2 | ciphertext 100)*
    stage 2  masked vector FGA4 request  session | count u32 | (source u64 | ciphertext 100)*
                           FGA5 reply    session | client u64 | length u64 | bits u8
                                         | the vector, ``bits`` per coordinate, bit packed
    stage 3  unmask        FGA6 request  session | active u32 | dropped u32 | ids u64 *
                           FGA7 reply    session | client u64 | count u32
                                         | (owner u64 | kind u8 | share 36)*

(``*``: repeated ``count`` times, 4 bytes of CRC-32 at the end of each.) What each stage means is
in :mod:`fedgc.privacy.secagg.server`; what each costs per client in
:mod:`fedgc.privacy.secagg.cost`, which reads its sizes from here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from dgc.errors import DecodeError
from dgc.wire.framing import CRC, Preamble, as_view, check_crc, crc_offset, seal
from fedgc.privacy.secagg.crypto import (
    CIPHERTEXT_BYTES,
    COMMITMENT_BYTES,
    KEY_BYTES,
    SESSION_BYTES,
    SHARE_BYTES,
)
from fedgc.privacy.secagg.errors import BadMessage

__all__ = ["SELF_SEED", "MASK_SEED", "Forward", "Keys", "Masked", "Neighbours", "Reveal",
           "Setup", "Shares", "Survivors", "pack_bits", "unpack_bits"]

#: Kinds of a revealed share: of the self-mask seed (an owner that sent its vector) or of the
#: mask key's seed (an owner that dropped before it).
SELF_SEED, MASK_SEED = 1, 2

_S = f"{SESSION_BYTES}s"


def _open(preamble: Preamble, data: bytes, what: str) -> tuple[memoryview, tuple, int]:
    """The view, preamble fields and CRC offset of ``data``; BadMessage for bad framing."""
    try:
        view = as_view(data)
        fields = preamble.open(view)
        end = crc_offset(view)
        check_crc(view, end)
    except DecodeError as ex:
        raise BadMessage(f"{what}: {ex}") from None
    return view, fields, end


def _records(view: memoryview, pos: int, end: int, count: int, record: struct.Struct,
             what: str) -> list[tuple]:
    """``count`` fixed-size records from ``pos``, which must end exactly at ``end``."""
    if pos + count * record.size != end:
        raise BadMessage(f"{what}: {count} records of {record.size} bytes need "
                         f"{count * record.size} bytes, the message holds {end - pos}")
    return [record.unpack_from(view, pos + i * record.size) for i in range(count)]


def _unique(ids: list[int], what: str) -> None:
    if len(set(ids)) != len(ids):
        raise BadMessage(f"{what}: an id appears twice")


# ---------------------------------------------------------------------- stage 0: setup
_SETUP = Preamble(b"FGA0", 1, _S + "QQIIIQB")


@dataclass(frozen=True)
class Setup:
    """The session's parameters, sent to each sampled client."""

    session: bytes
    server_round: int
    client: int
    clients: int
    neighbours: int
    threshold: int
    length: int
    modulus_bits: int

    def encode(self) -> bytes:
        return seal([_SETUP.pack(self.session, self.server_round, self.client, self.clients,
                                 self.neighbours, self.threshold, self.length,
                                 self.modulus_bits)])

    @classmethod
    def decode(cls, data: bytes) -> Setup:
        view, fields, end = _open(_SETUP, data, "setup request")
        if end != _SETUP.size:
            raise BadMessage(f"setup request: {end - _SETUP.size} bytes after its fields")
        return cls(*fields)


_KEYS = Preamble(b"FGA1", 1, _S + f"Q{KEY_BYTES}s{KEY_BYTES}s")


@dataclass(frozen=True)
class Keys:
    """A client's two public keys: for the shares' encryption and for the pairwise masks."""

    session: bytes
    client: int
    cipher_key: bytes
    mask_key: bytes

    def encode(self) -> bytes:
        return seal([_KEYS.pack(self.session, self.client, self.cipher_key, self.mask_key)])

    @classmethod
    def decode(cls, data: bytes) -> Keys:
        view, fields, end = _open(_KEYS, data, "public keys")
        if end != _KEYS.size:
            raise BadMessage(f"public keys: {end - _KEYS.size} bytes after its fields")
        return cls(*fields)


# ---------------------------------------------------------------------- stage 1: share keys
_NEIGHBOURS = Preamble(b"FGA2", 1, _S + "I")
_NEIGHBOUR = struct.Struct(f"<Q{KEY_BYTES}s{KEY_BYTES}s")


@dataclass(frozen=True)
class Neighbours:
    """The public keys of a client's neighbours still in the session."""

    session: bytes
    keys: tuple[tuple[int, bytes, bytes], ...]  # (id, cipher key, mask key)

    def encode(self) -> bytes:
        return seal([_NEIGHBOURS.pack(self.session, len(self.keys)),
                     *(_NEIGHBOUR.pack(*k) for k in self.keys)])

    @classmethod
    def decode(cls, data: bytes) -> Neighbours:
        view, (session, count), end = _open(_NEIGHBOURS, data, "neighbours' keys")
        keys = _records(view, _NEIGHBOURS.size, end, count, _NEIGHBOUR, "neighbours' keys")
        _unique([k[0] for k in keys], "neighbours' keys")
        return cls(session, tuple(keys))


_SHARES = Preamble(b"FGA3", 1, _S + "Q32sI")
_SHARE_RECORD = struct.Struct(f"<Q{COMMITMENT_BYTES}s{COMMITMENT_BYTES}s{CIPHERTEXT_BYTES}s")


@dataclass(frozen=True)
class Shares:
    """A client's encrypted shares, one ciphertext per neighbour, with the commitments to each
    share (what the server checks a revealed share against) and to its self-mask seed."""

    session: bytes
    client: int
    seed_commitment: bytes
    records: tuple[tuple[int, bytes, bytes, bytes], ...]  # (target, commit self, commit key, ct)

    def encode(self) -> bytes:
        return seal([_SHARES.pack(self.session, self.client, self.seed_commitment,
                                  len(self.records)),
                     *(_SHARE_RECORD.pack(*r) for r in self.records)])

    @classmethod
    def decode(cls, data: bytes) -> Shares:
        view, (session, client, seed_commitment, count), end = _open(_SHARES, data, "shares")
        records = _records(view, _SHARES.size, end, count, _SHARE_RECORD, "shares")
        _unique([r[0] for r in records], "shares")
        return cls(session, client, seed_commitment, tuple(records))


# ---------------------------------------------------------------------- stage 2: masked vector
_FORWARD = Preamble(b"FGA4", 1, _S + "I")
_FORWARD_RECORD = struct.Struct(f"<Q{CIPHERTEXT_BYTES}s")


@dataclass(frozen=True)
class Forward:
    """The ciphertexts a client's neighbours sent it, forwarded by the server."""

    session: bytes
    records: tuple[tuple[int, bytes], ...]  # (source, ciphertext)

    def encode(self) -> bytes:
        return seal([_FORWARD.pack(self.session, len(self.records)),
                     *(_FORWARD_RECORD.pack(*r) for r in self.records)])

    @classmethod
    def decode(cls, data: bytes) -> Forward:
        view, (session, count), end = _open(_FORWARD, data, "forwarded shares")
        records = _records(view, _FORWARD.size, end, count, _FORWARD_RECORD, "forwarded shares")
        _unique([r[0] for r in records], "forwarded shares")
        return cls(session, tuple(records))


def pack_bits(values: np.ndarray, bits: int) -> bytes:
    """The low ``bits`` of each uint64 in ``values``, packed little-endian bit by bit."""
    v = np.ascontiguousarray(values, dtype="<u8")
    if bits % 8 == 0:  # whole bytes: the low bytes of each word, no bit shuffling
        return v.view(np.uint8).reshape(-1, 8)[:, :bits // 8].tobytes()
    unpacked = np.unpackbits(v.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
    return np.packbits(unpacked[:, :bits].reshape(-1), bitorder="little").tobytes()


def unpack_bits(data: memoryview | bytes, bits: int, count: int) -> np.ndarray:
    """``count`` uint64 values of ``bits`` each from :func:`pack_bits`'s bytes (which must hold
    exactly them, unused bits zero: BadMessage otherwise)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size != (count * bits + 7) // 8:
        raise BadMessage(f"masked vector: {count} coordinates of {bits} bits need "
                         f"{(count * bits + 7) // 8} bytes, got {raw.size}")
    words = np.zeros((count, 8), dtype=np.uint8)
    if bits % 8 == 0:
        words[:, :bits // 8] = raw.reshape(count, bits // 8)
        return words.view("<u8").reshape(-1)
    flat = np.unpackbits(raw, bitorder="little")
    if flat[count * bits:].any():
        raise BadMessage("masked vector: the padding bits after the last coordinate are not 0")
    full = np.zeros((count, 64), dtype=np.uint8)
    full[:, :bits] = flat[:count * bits].reshape(count, bits)
    return np.packbits(full, axis=1, bitorder="little").view("<u8").reshape(-1)


_MASKED = Preamble(b"FGA5", 1, _S + "QQB")


@dataclass(frozen=True)
class Masked:
    """A client's masked vector: ring elements modulo ``2^modulus_bits``."""

    session: bytes
    client: int
    modulus_bits: int
    vector: np.ndarray  # uint64, each below 2^modulus_bits

    def encode(self) -> bytes:
        return seal([_MASKED.pack(self.session, self.client, len(self.vector),
                                  self.modulus_bits),
                     pack_bits(self.vector, self.modulus_bits)])

    @classmethod
    def decode(cls, data: bytes, length: int, modulus_bits: int) -> Masked:
        """A masked vector of the session's ``length`` and ``modulus_bits`` (BadMessage for
        any other)."""
        view, (session, client, count, bits), end = _open(_MASKED, data, "masked vector")
        if count != length or bits != modulus_bits:
            raise BadMessage(f"masked vector of client {client}: {count} coordinates of {bits} "
                             f"bits, the session sums {length} of {modulus_bits}")
        return cls(session, client, bits, unpack_bits(view[_MASKED.size:end], bits, count))

    @staticmethod
    def size(length: int, modulus_bits: int) -> int:
        """The bytes of a masked vector of ``length`` coordinates."""
        return _MASKED.size + (length * modulus_bits + 7) // 8 + CRC.size


# ---------------------------------------------------------------------- stage 3: unmask
_SURVIVORS = Preamble(b"FGA6", 1, _S + "II")
_ID = struct.Struct("<Q")


@dataclass(frozen=True)
class Survivors:
    """Which of a client's neighbours sent their masked vector (``active``: reveal the share of
    their self-mask seed) and which dropped after sending shares (``dropped``: reveal the share
    of their mask key's seed)."""

    session: bytes
    active: tuple[int, ...]
    dropped: tuple[int, ...]

    def encode(self) -> bytes:
        return seal([_SURVIVORS.pack(self.session, len(self.active), len(self.dropped)),
                     *(_ID.pack(i) for i in (*self.active, *self.dropped))])

    @classmethod
    def decode(cls, data: bytes) -> Survivors:
        view, (session, active, dropped), end = _open(_SURVIVORS, data, "survivors")
        ids = [r[0] for r in _records(view, _SURVIVORS.size, end, active + dropped, _ID,
                                      "survivors")]
        _unique(ids, "survivors (an id both active and dropped, or twice)")
        return cls(session, tuple(ids[:active]), tuple(ids[active:]))


_REVEAL = Preamble(b"FGA7", 1, _S + "QI")
_REVEAL_RECORD = struct.Struct(f"<QB{SHARE_BYTES}s")


@dataclass(frozen=True)
class Reveal:
    """The shares a client reveals for the unmasking: one per neighbour the server named."""

    session: bytes
    client: int
    records: tuple[tuple[int, int, bytes], ...]  # (owner, kind, share)

    def encode(self) -> bytes:
        return seal([_REVEAL.pack(self.session, self.client, len(self.records)),
                     *(_REVEAL_RECORD.pack(*r) for r in self.records)])

    @classmethod
    def decode(cls, data: bytes) -> Reveal:
        view, (session, client, count), end = _open(_REVEAL, data, "revealed shares")
        records = _records(view, _REVEAL.size, end, count, _REVEAL_RECORD, "revealed shares")
        _unique([r[0] for r in records], "revealed shares")
        for owner, kind, _ in records:
            if kind not in (SELF_SEED, MASK_SEED):
                raise BadMessage(f"revealed shares: kind {kind} for client {owner}, expected "
                                 f"{SELF_SEED} (self-mask seed) or {MASK_SEED} (mask key seed)")
        return cls(session, client, tuple(records))


#: Bytes of each message kind with ``count`` records (``cost`` reads these).
SIZES = {
    "setup": _SETUP.size + CRC.size,
    "keys": _KEYS.size + CRC.size,
    "neighbours": (_NEIGHBOURS.size + CRC.size, _NEIGHBOUR.size),
    "shares": (_SHARES.size + CRC.size, _SHARE_RECORD.size),
    "forward": (_FORWARD.size + CRC.size, _FORWARD_RECORD.size),
    "survivors": (_SURVIVORS.size + CRC.size, _ID.size),
    "reveal": (_REVEAL.size + CRC.size, _REVEAL_RECORD.size),
}
