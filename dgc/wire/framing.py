"""Framing shared by every fedgc payload: preamble, CRC-32 trailer and a bounded reader.

Every fedgc message (an update, a round's index sets, a client's signs) is::

    magic (4 bytes) | version u8 | the payload's own preamble fields | body | crc32 u32

little-endian, the CRC-32 (zlib) covering every byte before it. A decoder opens the preamble
(:meth:`Preamble.open`), checks the CRC (:func:`check_crc`) and reads the body only through
:func:`read` / :func:`read_text`, which refuse to read past the CRC, so that no field is taken
from bytes the message does not hold. Every failure is a :class:`~dgc.errors.DecodeError` whose
message starts with the same words for every payload (``truncated input``, ``bad magic``,
``unsupported version``, ``bad checksum``, ``trailing or oversized input``); the Java codec maps
those words to its error codes (``android_bridge/WIRE_FORMAT.md``).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Container, Iterable

from dgc.errors import DecodeError
from dgc.golomb import MAX_NUMEL

#: The trailer of every message: CRC-32 (zlib) of every byte before it.
CRC = struct.Struct("<I")
#: A u16 byte length, then that many utf-8 bytes: how every payload writes a tensor name.
NAME_LEN = struct.Struct("<H")

MAX_U32 = (1 << 32) - 1
MAX_U64 = (1 << 64) - 1


class Preamble:
    """The fixed head of one kind of payload: its magic, its version, then its own fields.

    Parameters
    ----------
    magic : bytes
        Four bytes that name the payload (``b"FGCU"``: an update).
    version : int
        The version this code writes and reads.
    fields : str
        The ``struct`` codes of the fields after the version (little-endian).
    """

    def __init__(self, magic: bytes, version: int, fields: str) -> None:
        self.magic = magic
        self.version = version
        self.struct = struct.Struct("<4sB" + fields)
        self.size = self.struct.size
        #: Bytes of a message of this kind that carries nothing: preamble plus CRC.
        self.min_message_bytes = self.size + CRC.size

    def pack(self, *fields: int) -> bytes:
        """The preamble bytes with these field values."""
        return self.struct.pack(self.magic, self.version, *fields)

    def open(self, view: memoryview) -> tuple[int, ...]:
        """The fields after the version, once length, magic and version are checked."""
        if len(view) < self.min_message_bytes:
            raise DecodeError(f"truncated input: {len(view)} bytes, a message has at least "
                              f"{self.min_message_bytes}")
        magic, version, *fields = self.struct.unpack_from(view, 0)
        if magic != self.magic:
            raise DecodeError(f"bad magic {magic!r}, expected {self.magic!r}")
        if version != self.version:
            raise DecodeError(f"unsupported version {version}, this decoder reads "
                              f"{self.version}")
        return tuple(fields)


def as_view(data: bytes | bytearray | memoryview) -> memoryview:
    """``data`` as a flat byte view (no copy); anything else is a DecodeError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"decode takes bytes, bytearray or memoryview, got "
                          f"{type(data).__name__}")
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise DecodeError("decode needs a contiguous buffer")
        view = view.cast("B")
    return view


def seal(parts: Iterable[bytes]) -> bytes:
    """The message of these parts (preamble first): their bytes and the CRC-32 trailer."""
    body = b"".join(parts)
    return body + CRC.pack(zlib.crc32(body))


def crc_offset(view: memoryview) -> int:
    """Where the CRC trailer starts: the end of what a reader may read."""
    return len(view) - CRC.size


def check_crc(view: memoryview, end: int) -> None:
    """Check the CRC-32 stored at ``end`` against the bytes before it."""
    (stored_crc,) = CRC.unpack_from(view, end)
    actual_crc = zlib.crc32(view[:end])
    if stored_crc != actual_crc:
        raise DecodeError(f"bad checksum: stored CRC32 0x{stored_crc:08x}, computed "
                          f"0x{actual_crc:08x}")


def read(fmt: struct.Struct, view: memoryview, pos: int, end: int, what: str) -> tuple:
    """The fields of ``fmt`` at ``pos``, which must end by ``end`` (the CRC's offset)."""
    if pos + fmt.size > end:
        raise DecodeError(f"truncated input: {what} needs {fmt.size} bytes at offset {pos}, "
                          f"only {max(end - pos, 0)} left before the checksum")
    return fmt.unpack_from(view, pos)


def read_text(view: memoryview, pos: int, end: int, length: int, what: str) -> str:
    """The ``length`` utf-8 bytes at ``pos`` (which must end by ``end``), decoded."""
    if pos + length > end:
        raise DecodeError(f"truncated input: {what} of {length} bytes at offset {pos}")
    try:
        return bytes(view[pos:pos + length]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise DecodeError(f"{what} is not valid utf-8: {e.reason} at byte {e.start}") from e


def read_name(view: memoryview, pos: int, end: int, what: str) -> tuple[str, int]:
    """A name (u16 length, utf-8 bytes) at ``pos``, and the offset after it."""
    (length,) = read(NAME_LEN, view, pos, end, f"{what} length")
    pos += NAME_LEN.size
    return read_text(view, pos, end, length, what), pos + length


#: A tensor's shape on the wire: its number of dimensions (u8), then each dimension (u64).
NDIM = struct.Struct("<B")
DIM = struct.Struct("<Q")


def shape_bytes(shape: Iterable[int]) -> bytes:
    """How a shape is written (:data:`NDIM`, then a :data:`DIM` per dimension)."""
    dims = tuple(shape)
    return NDIM.pack(len(dims)) + b"".join(DIM.pack(d) for d in dims)


def read_shape(view: memoryview, pos: int, end: int, name: str,
               limit: int) -> tuple[tuple[int, ...], int, int]:
    """Tensor ``name``'s shape at ``pos``, its number of entries and the offset after it.

    A DecodeError as soon as a dimension passes the format's :data:`MAX_NUMEL` or the entries
    so far pass ``limit`` (the decoder's bound), before anything is allocated for it.
    """
    (ndim,) = read(NDIM, view, pos, end, f"ndim of {name!r}")
    pos += NDIM.size
    shape, numel = [], 1
    for _ in range(ndim):
        (d,) = read(DIM, view, pos, end, f"dims of {name!r}")
        pos += DIM.size
        shape.append(d)
        numel *= d
        if d > MAX_NUMEL or numel > limit:
            raise DecodeError(f"tensor {name!r} claims {numel} entries, above the bound {limit}")
    return tuple(shape), numel, pos


def name_bytes(name: str) -> bytes:
    """How a name is written: u16 length, then its utf-8 bytes (at most 65535 of them)."""
    raw = name.encode("utf-8")
    return NAME_LEN.pack(len(raw)) + raw


def open_records(data: bytes | bytearray | memoryview, preamble: Preamble, min_record: int,
                 what: str = "tensors") -> tuple[memoryview, tuple[int, ...], int]:
    """A message of ``preamble`` whose last preamble field counts its records, each at least
    ``min_record`` bytes long: its view, the preamble's fields and the CRC's offset (the end of
    what a reader may read), once the count fits the bytes and the CRC holds. How every
    payload of records opens (the DecodeError names ``what`` the records are)."""
    view = as_view(data)
    fields = preamble.open(view)
    end = crc_offset(view)
    count = fields[-1]
    if count * min_record > end - preamble.size:
        raise DecodeError(f"truncated input: {count} {what} cannot fit in "
                          f"{end - preamble.size} bytes")
    check_crc(view, end)
    return view, fields, end


def tensor_head(name: str, shape: Iterable[int]) -> bytes:
    """How a tensor record starts: its name (:func:`name_bytes`), then its shape
    (:func:`shape_bytes`)."""
    return name_bytes(name) + shape_bytes(shape)


def read_tensor_head(view: memoryview, pos: int, end: int, seen: Container[str],
                     limit: int) -> tuple[str, tuple[int, ...], int, int]:
    """The name, shape and entries of the tensor record at ``pos`` (:func:`tensor_head`), and
    the offset after them; a name in ``seen`` (the records read so far) is a DecodeError, as is
    a shape past ``limit`` entries (:func:`read_shape`)."""
    name, pos = read_name(view, pos, end, "tensor name")
    if name in seen:
        raise DecodeError(f"tensor {name!r} appears twice")
    shape, numel, pos = read_shape(view, pos, end, name, limit)
    return name, shape, numel, pos


def check_end(view: memoryview, pos: int, end: int) -> None:
    """The last record must end exactly at the CRC: more bytes are an error."""
    if pos != end:
        raise DecodeError(f"trailing or oversized input: {end - pos} bytes after the last tensor "
                          f"(message is {len(view)} bytes, its tensors end at {pos + CRC.size})")
