"""The fedgc wire format: a SparseUpdate to bytes and back, versioned, checksummed, validated.

Layout (all integers little-endian; ``docs/wire.md`` has the byte-by-byte specification)::

    message  = magic "FGCU" | version u8 = 1 | flags u8 = 0 | sequence u64 | tensor_count u32
               | tensor * tensor_count | crc32 u32 (zlib CRC-32 of every byte before it)
    tensor   = name_len u16 | name (utf-8) | ndim u8 | dims u64 * ndim | count u64
               | index_coding u8 | value_dtype u8 | index_bytes u64
               | index section (index_bytes) | values (count * value size)

Index codings: 0 all (count == numel, no index bytes), 1 raw uint32, 2 bitmap, 3 Golomb-Rice on
gaps. Value dtypes: 0 float32, 1 float16, 2 bfloat16, carried as their raw bits. A value dtype
with the high bit set (``SIGN_CODED``: 128, 129, 130) marks a sign-coded tensor, whose values are
all ``+scale`` or ``-scale``: its value section is the scale (raw bits of the base dtype) and one
sign bit per value (``size + ceil(count / 8)`` bytes), what ternary DGC sends (``encode(...,
sign_coding=True)``). Value dtypes 64 and 65 (``GRID_CODED``, ``GRID_RICE_CODED``, float32 only)
mark a grid-coded tensor, whose values are all ``q * scale`` with ``q`` an int8 and ``scale`` a
power of two: its value section is the scale (float32 bits) and one signed byte per value
(``4 + count`` bytes), or the scale and the zigzagged ``q`` as the gaps of a Golomb-Rice
section; what a server's int8 broadcast sends (``encode(..., grid_coding=True)``).

:func:`decode` first walks the headers (so truncated or trailing input is named as such and no
payload is touched before its length is known to be present), then checks the CRC, then decodes
and validates each section. Every failure is a :class:`~dgc.errors.DecodeError`.
"""

from __future__ import annotations

import functools
import math
import operator
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dgc import golomb
from dgc.errors import DecodeError, DGCError
from dgc.sparse import PackedTensors, SparseTensor, SparseUpdate, TensorLayout

MAGIC = b"FGCU"
VERSION = 1

#: Index coding ids, by the name ``encode(index_coding=...)`` takes.
INDEX_CODINGS: dict[str, int] = {"all": 0, "raw": 1, "bitmap": 2, "golomb": 3}
_CODING_NAMES = {v: k for k, v in INDEX_CODINGS.items()}

#: Value dtype ids and their raw-bit representation on the wire.
VALUE_DTYPE_IDS: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_DTYPES_BY_ID = {v: k for k, v in VALUE_DTYPE_IDS.items()}
#: Set in the value dtype byte of a sign-coded tensor (values +-scale; ``docs/wire.md`` 5).
SIGN_CODED = 0x80
#: The value dtype id of a grid-coded tensor (float32 values int8 * power-of-two scale; 5).
GRID_CODED = 0x40
#: The same with the int8s Rice-coded, zigzagged, as the gaps of a Golomb-Rice section (5).
GRID_RICE_CODED = 0x41
_GRID_CODINGS = (GRID_CODED, GRID_RICE_CODED)
#: Head of a Rice-coded grid section: scale, numel of the gap sequence, Golomb-Rice bytes.
_GRID_RICE_HEAD = struct.Struct("<fQQ")
#: A grid-coded scale is 2**e with e in [-126, 120]: every int8 multiple is exact and finite.
_GRID_EXPONENTS = (-126, 120)
_RAW_BITS = {  # wire dtype, torch view dtype, exponent mask (all ones = Inf or NaN)
    torch.float32: ("<u4", torch.int32, 0x7F800000),
    torch.float16: ("<u2", torch.int16, 0x7C00),
    torch.bfloat16: ("<u2", torch.int16, 0x7F80),
}

_PREAMBLE = struct.Struct("<4sBBQI")  # magic, version, flags, sequence, tensor_count
_NAME_LEN = struct.Struct("<H")
_NDIM = struct.Struct("<B")
_DIM = struct.Struct("<Q")
_TENSOR_TAIL = struct.Struct("<QBBQ")  # count, index_coding, value_dtype, index_bytes
_CRC = struct.Struct("<I")

#: Bytes of a message that carries no tensors: preamble plus checksum.
EMPTY_MESSAGE_BYTES = _PREAMBLE.size + _CRC.size

#: Tiebreak among codings of equal size: the cheapest to decode first.
_AUTO_PREFERENCE = ("all", "golomb", "bitmap", "raw")

_MAX_U32 = (1 << 32) - 1
_MAX_U64 = (1 << 64) - 1


class EncodeError(DGCError, ValueError):
    """An update handed to :func:`encode` cannot be put on the wire (the message names why)."""


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------

def _check_tensor(name: str, t: SparseTensor) -> np.ndarray:
    """The tensor's indices as numpy after checking what decode would check."""
    numel = t.numel
    if numel > golomb.MAX_NUMEL:
        raise EncodeError(f"tensor {name!r} has {numel} entries, above the format's limit "
                          f"{golomb.MAX_NUMEL}")
    if len(t.shape) > 255:
        raise EncodeError(f"tensor {name!r} has {len(t.shape)} dims, the format allows 255")
    if any(d < 0 or d > golomb.MAX_NUMEL for d in t.shape):
        raise EncodeError(f"tensor {name!r} has a dim outside [0, {golomb.MAX_NUMEL}] in shape "
                          f"{t.shape}")
    indices = t.indices.detach().cpu().contiguous().numpy()
    if indices.size:
        if not bool(np.all(indices[1:] > indices[:-1])):
            bad = int(np.flatnonzero(indices[1:] <= indices[:-1])[0]) + 1
            raise EncodeError(f"tensor {name!r}: index {int(indices[bad])} at position {bad} "
                              f"does not increase on {int(indices[bad - 1])}; indices must be "
                              f"sorted and unique")
        if int(indices[0]) < 0 or int(indices[-1]) >= numel:
            raise EncodeError(f"tensor {name!r}: indices span [{int(indices[0])}, "
                              f"{int(indices[-1])}], outside [0, {numel}) for shape {t.shape}")
    if t.values.numel() and not bool(torch.isfinite(t.values).all()):
        raise EncodeError(f"tensor {name!r} carries NaN or Inf values; the format only carries "
                          f"finite values")
    return indices


def _index_sizes(indices: np.ndarray, numel: int) -> tuple[dict[str, int], int]:
    """Bytes of the index section under every coding that can carry these indices, and the
    Rice parameter the Golomb-Rice coding would use."""
    count = int(indices.size)
    golomb_bytes, rice_b = golomb.golomb_size(indices, numel)
    sizes = {"golomb": golomb_bytes, "bitmap": golomb.bitmap_size(numel)}
    if count == numel:
        sizes["all"] = 0
    if numel <= _MAX_U32 + 1:
        sizes["raw"] = 4 * count
    return sizes, rice_b


def _choose_coding(indices: np.ndarray, numel: int, index_coding: str,
                   name: str) -> tuple[str, int | None]:
    """The coding for one tensor, and its Rice parameter when already computed."""
    if index_coding == "auto":
        if indices.size == numel:
            return "all", None
        sizes, rice_b = _index_sizes(indices, numel)
        coding = min(sizes, key=lambda c: (sizes[c], _AUTO_PREFERENCE.index(c)))
        return coding, rice_b
    if index_coding not in INDEX_CODINGS:
        raise EncodeError(f"index_coding {index_coding!r} is not one of "
                          f"{['auto', *INDEX_CODINGS]}")
    if index_coding == "all" and indices.size != numel:
        raise EncodeError(f"tensor {name!r}: index_coding 'all' needs every entry, got "
                          f"{indices.size} of {numel}")
    if index_coding == "raw" and numel > _MAX_U32 + 1:
        raise EncodeError(f"tensor {name!r}: index_coding 'raw' carries uint32 indices, the "
                          f"tensor has {numel} entries")
    return index_coding, None


def _encode_indices(indices: np.ndarray, numel: int, coding: str, rice_b: int | None) -> bytes:
    if coding == "all":
        return b""
    if coding == "raw":
        return golomb.raw_encode(indices)
    if coding == "bitmap":
        return golomb.bitmap_encode(indices, numel)
    return golomb.golomb_encode(indices, numel, rice_b)


def _raw_values(values: torch.Tensor) -> np.ndarray:
    wire_dtype, view_dtype, _ = _RAW_BITS[values.dtype]
    raw = values.detach().cpu().contiguous().view(view_dtype).numpy()
    return raw.astype(wire_dtype, copy=False)


def _sign_scale(raw: np.ndarray) -> int | None:
    """The common magnitude (raw bits) of values that are all +-scale with scale > 0, when a
    sign-coded section (scale, then a bit per value) is smaller than the plain one; else None."""
    size = raw.dtype.itemsize
    if size + (raw.size + 7) // 8 >= raw.size * size:  # one value (or two float32s)
        return None
    magnitude = raw & ((1 << (8 * size - 1)) - 1)
    scale = int(magnitude[0])
    if scale == 0 or not bool(np.all(magnitude == scale)):
        return None
    return scale


def _grid_values(values: torch.Tensor) -> tuple[float, np.ndarray] | None:
    """``(scale, q)`` of float32 values that are all ``q * scale`` with int8 ``q`` and a
    power-of-two scale, at least 2 of them; else None.

    The scale is the coarsest power of two the values sit on (with every ``|q| <= 127``): the
    finest that keeps ``|q| <= 127`` holds them if any power-of-two int8 grid does, and is then
    coarsened while every ``q`` is even (small ``q`` for the Rice coding).
    """
    if values.dtype != torch.float32 or values.numel() < 2:
        return None
    v = values.detach().cpu().contiguous().numpy()
    peak = float(np.max(np.abs(v)))
    exponent = math.frexp(peak)[1] - 7 if peak > 0 else 0  # peak < 2**(exponent + 7)
    if not _GRID_EXPONENTS[0] <= exponent <= _GRID_EXPONENTS[1]:
        return None
    scale = np.float32(math.ldexp(1.0, exponent))
    q = np.rint(v / scale).astype(np.int8)  # off-grid values are caught below
    # What a decoder computes, bit for bit (this also turns away -0.0: 0 * scale is +0.0)
    if not np.array_equal((q.astype(np.float32) * scale).view(np.uint32), v.view(np.uint32)):
        return None
    nonzero = q[q != 0]
    if nonzero.size:  # the common trailing zero bits of the q: at most 6
        low = int(np.bitwise_or.reduce(nonzero.astype(np.int64) & -nonzero.astype(np.int64)))
        shift = min((low & -low).bit_length() - 1, _GRID_EXPONENTS[1] - exponent)
        if shift > 0:
            q = q >> shift
            scale = np.float32(math.ldexp(1.0, exponent + shift))
    return float(scale), q


def _zigzag_positions(q: np.ndarray) -> np.ndarray:
    """The increasing sequence whose Golomb gaps are the zigzagged ``q`` (0, -1, 1, -2, ... ->
    0, 1, 2, 3, ...): ``cumsum(zigzag(q) + 1) - 1``."""
    q64 = q.astype(np.int64)
    return np.cumsum(np.where(q64 >= 0, 2 * q64, -2 * q64 - 1) + 1) - 1


def _grid_section(values: torch.Tensor) -> tuple[int, bytes] | None:
    """``(value dtype id, section)`` of grid values: the scale then one signed byte each
    (GRID_CODED), or, when smaller, the scale and the zigzagged int8s as the gaps of a
    Golomb-Rice section (GRID_RICE_CODED); None for values off every power-of-two int8 grid."""
    grid = _grid_values(values)
    if grid is None:
        return None
    scale, q = grid
    plain = struct.pack("<f", scale) + q.tobytes()
    positions = _zigzag_positions(q)
    numel = int(positions[-1]) + 1
    rice_bytes, b = golomb.golomb_size(positions, numel)
    if _GRID_RICE_HEAD.size + rice_bytes < len(plain):
        return GRID_RICE_CODED, (_GRID_RICE_HEAD.pack(scale, numel, rice_bytes)
                                 + golomb.golomb_encode(positions, numel, b))
    return GRID_CODED, plain


def _values_section(values: torch.Tensor, sign_coding: bool,
                    grid_coding: bool = False) -> tuple[int, bytes]:
    """(value dtype id, value section) of one tensor: sign- or grid-coded when asked and
    possible (sign coding first: it is the smaller)."""
    raw = _raw_values(values)
    dtype_id = VALUE_DTYPE_IDS[values.dtype]
    scale = _sign_scale(raw) if sign_coding else None
    if scale is not None:
        signs = np.packbits((raw >> (8 * raw.dtype.itemsize - 1)).astype(np.uint8),
                            bitorder="little")
        return dtype_id | SIGN_CODED, np.array(scale, dtype=raw.dtype).tobytes() + signs.tobytes()
    grid = _grid_section(values) if grid_coding else None
    if grid is not None:
        return grid
    return dtype_id, raw.tobytes()


def _values_nbytes(dtype: torch.dtype, count: int, coding: int = 0) -> int:
    """Bytes of a value section: ``coding`` is 0 (plain), SIGN_CODED or GRID_CODED (a
    GRID_RICE_CODED section says its own length)."""
    size = _RAW_BITS[dtype][1].itemsize
    if coding == SIGN_CODED:
        return size + (count + 7) // 8
    if coding == GRID_CODED:
        return 4 + count
    return count * size


def _tensor_header(name: str, t: SparseTensor, coding: str, index_bytes: int,
                   dtype_id: int) -> bytes:
    name_utf8 = name.encode("utf-8")
    if len(name_utf8) > 0xFFFF:
        raise EncodeError(f"tensor name of {len(name_utf8)} utf-8 bytes; the format allows 65535")
    return b"".join([
        _NAME_LEN.pack(len(name_utf8)), name_utf8, _NDIM.pack(len(t.shape)),
        *(_DIM.pack(d) for d in t.shape),
        _TENSOR_TAIL.pack(t.nnz, INDEX_CODINGS[coding], dtype_id, index_bytes),
    ])


def _check_update(update: SparseUpdate) -> None:
    if not isinstance(update, SparseUpdate):
        raise EncodeError(f"encode takes a SparseUpdate, got {type(update).__name__}")
    if not 0 <= update.sequence <= _MAX_U64:
        raise EncodeError(f"sequence {update.sequence} outside the u64 range [0, 2**64)")
    if len(update.tensors) > _MAX_U32:
        raise EncodeError(f"{len(update.tensors)} tensors; the format allows {_MAX_U32}")
    for name in update.tensors:
        if not isinstance(name, str):
            raise EncodeError(f"tensor names must be str, got {name!r}")


def encode(update: SparseUpdate, index_coding: str = "auto", sign_coding: bool = False,
           grid_coding: bool = False) -> bytes:
    """The wire bytes of ``update``.

    Parameters
    ----------
    update
        The update to send. Tensors are written in the dict's order.
    index_coding
        ``"auto"`` (per tensor the smallest of the codings that can carry it), or one of
        ``"all"``, ``"raw"``, ``"bitmap"``, ``"golomb"`` for every tensor.
    sign_coding
        Send a tensor whose values are all ``+scale`` or ``-scale`` (ternary DGC) as the scale
        and one sign bit per value, when that is smaller; the decoded values are the same bits.
        Off by default: decoders that predate it reject such tensors (the Java codec reads
        them, but phones do not send ternary updates).
    grid_coding
        Send a float32 tensor whose values are all ``q * 2**e`` with int8 ``q`` (a server's
        int8 broadcast) as the scale and one signed byte per value, or the ``q`` Rice-coded
        when that is smaller still, when that is smaller than plain; the decoded values are the
        same bits. Off by default: decoders that predate it reject such tensors (the Java codec
        reads them).

    Raises
    ------
    EncodeError
        The update cannot be carried: unsorted/repeated/out-of-range indices, NaN/Inf values, a
        sequence outside u64, a name over 65535 utf-8 bytes, or a coding that cannot carry a
        tensor (``"all"`` on a sparse one, ``"raw"`` beyond 2**32 entries).
    """
    _check_update(update)
    parts = [_PREAMBLE.pack(MAGIC, VERSION, 0, update.sequence, len(update.tensors))]
    for name, t in update.tensors.items():
        indices = _check_tensor(name, t)
        coding, rice_b = _choose_coding(indices, t.numel, index_coding, name)
        index_section = _encode_indices(indices, t.numel, coding, rice_b)
        dtype_id, value_section = _values_section(t.values, sign_coding, grid_coding)
        parts += [_tensor_header(name, t, coding, len(index_section), dtype_id), index_section,
                  value_section]
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def encoded_size(update: SparseUpdate, index_coding: str = "auto",
                 sign_coding: bool = False, grid_coding: bool = False) -> int:
    """``len(encode(update, index_coding, sign_coding, grid_coding))``, computed without
    building the bytes."""
    _check_update(update)
    total = EMPTY_MESSAGE_BYTES
    for name, t in update.tensors.items():
        indices = _check_tensor(name, t)
        coding, _ = _choose_coding(indices, t.numel, index_coding, name)
        index_bytes = 0 if coding == "all" else _index_sizes(indices, t.numel)[0][coding]
        if sign_coding and _sign_scale(_raw_values(t.values)) is not None:
            value_bytes = _values_nbytes(t.values.dtype, t.nnz, SIGN_CODED)
        elif grid_coding and (grid := _grid_section(t.values)) is not None:
            value_bytes = len(grid[1])
        else:
            value_bytes = _values_nbytes(t.values.dtype, t.nnz)
        total += (_NAME_LEN.size + len(name.encode("utf-8")) + _NDIM.size
                  + _DIM.size * len(t.shape) + _TENSOR_TAIL.size + index_bytes + value_bytes)
    return total


def index_bits(indices: torch.Tensor | np.ndarray, numel: int, coding: str) -> int:
    """Bits of the index section of one tensor under ``coding`` (``"auto"``: the smallest).

    A measurement helper for benchmarks and the network emulator; ``indices`` must be sorted,
    unique and inside ``[0, numel)``.
    """
    idx = indices.detach().cpu().numpy() if isinstance(indices, torch.Tensor) else indices
    idx = np.asarray(idx, dtype=np.int64)
    sizes, _ = _index_sizes(idx, numel)
    if coding == "auto":
        return 8 * min(sizes.values())
    if coding not in sizes:
        raise EncodeError(f"coding {coding!r} cannot carry {idx.size} of {numel} indices; "
                          f"possible: {sorted(sizes)}")
    return 8 * sizes[coding]


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------

@dataclass
class _TensorRecord:
    """One tensor's header, and where its sections lie, from the structural pass."""

    name: str
    shape: tuple[int, ...]
    numel: int
    count: int
    coding: int
    dtype: torch.dtype
    index_start: int
    index_bytes: int
    values_start: int
    value_coding: int = 0  # SIGN_CODED: scale, a sign bit each; GRID_CODED: scale, int8 each;
    # GRID_RICE_CODED: scale, then the int8s Rice-coded
    values_length: int = 0  # bytes of the value section


def _read(fmt: struct.Struct, data: memoryview, pos: int, end: int, what: str) -> tuple:
    if pos + fmt.size > end:
        raise DecodeError(f"truncated input: {what} needs {fmt.size} bytes at offset {pos}, "
                          f"only {max(end - pos, 0)} left before the checksum")
    return fmt.unpack_from(data, pos)


def _read_record(data: memoryview, pos: int, end: int, k: int, max_numel: int | None,
                 seen: set[str]) -> tuple[_TensorRecord, int]:
    (name_len,) = _read(_NAME_LEN, data, pos, end, f"tensor {k} name length")
    pos += _NAME_LEN.size
    if pos + name_len > end:
        raise DecodeError(f"truncated input: tensor {k} name of {name_len} bytes at offset {pos}")
    try:
        name = bytes(data[pos:pos + name_len]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise DecodeError(f"tensor {k} name is not valid utf-8: {e.reason} at byte "
                          f"{e.start}") from e
    pos += name_len
    if name in seen:
        raise DecodeError(f"duplicate tensor name {name!r} (tensor {k})")
    seen.add(name)
    (ndim,) = _read(_NDIM, data, pos, end, f"tensor {name!r} ndim")
    pos += _NDIM.size
    shape = []
    numel = 1
    for _ in range(ndim):
        (dim,) = _read(_DIM, data, pos, end, f"tensor {name!r} dims")
        pos += _DIM.size
        if dim > golomb.MAX_NUMEL:
            raise DecodeError(f"tensor {name!r} has dim {dim}, above the format's limit "
                              f"{golomb.MAX_NUMEL}")
        shape.append(dim)
        numel *= dim  # exact Python int; bounded below since each factor is
    if numel > golomb.MAX_NUMEL:
        raise DecodeError(f"tensor {name!r} shape {tuple(shape)} has {numel} entries, above the "
                          f"format's limit {golomb.MAX_NUMEL}")
    if max_numel is not None and numel > max_numel:
        raise DecodeError(f"tensor {name!r} shape {tuple(shape)} has {numel} entries, above "
                          f"max_numel={max_numel}")
    count, coding, dtype_id, index_bytes = _read(_TENSOR_TAIL, data, pos, end,
                                                 f"tensor {name!r} count/coding/dtype/length")
    pos += _TENSOR_TAIL.size
    if count > numel:
        raise DecodeError(f"tensor {name!r} claims {count} entries, above its numel {numel}")
    if coding not in _CODING_NAMES:
        raise DecodeError(f"tensor {name!r} has unknown index coding id {coding}; known: "
                          f"{sorted(_CODING_NAMES)}")
    value_coding = dtype_id if dtype_id in _GRID_CODINGS else dtype_id & SIGN_CODED
    if dtype_id not in _GRID_CODINGS and dtype_id & ~SIGN_CODED not in _DTYPES_BY_ID:
        raise DecodeError(f"tensor {name!r} has unknown value dtype id {dtype_id}; known: "
                          f"{sorted(_DTYPES_BY_ID)}, sign-coded "
                          f"{sorted(i | SIGN_CODED for i in _DTYPES_BY_ID)} and grid-coded "
                          f"{list(_GRID_CODINGS)}")
    if coding == INDEX_CODINGS["all"] and (count != numel or index_bytes != 0):
        raise DecodeError(f"tensor {name!r}: coding 'all' needs count == numel and no index "
                          f"bytes, got count {count}, numel {numel}, {index_bytes} index bytes")
    dtype = (torch.float32 if value_coding in _GRID_CODINGS
             else _DTYPES_BY_ID[dtype_id & ~SIGN_CODED])
    if value_coding == GRID_RICE_CODED:
        head = pos + index_bytes
        if head + _GRID_RICE_HEAD.size > end:
            raise DecodeError(f"truncated input: tensor {name!r} needs {index_bytes} index bytes "
                              f"and a {_GRID_RICE_HEAD.size}-byte grid head at offset {pos}, "
                              f"only {end - pos} left")
        _, _, rice_bytes = _GRID_RICE_HEAD.unpack_from(data, head)
        value_bytes = _GRID_RICE_HEAD.size + rice_bytes
    else:
        value_bytes = _values_nbytes(dtype, count, value_coding)
    if pos + index_bytes + value_bytes > end:
        raise DecodeError(f"truncated input: tensor {name!r} needs {index_bytes} index bytes and "
                          f"{value_bytes} value bytes at offset {pos}, only {end - pos} left")
    record = _TensorRecord(name, tuple(shape), numel, count, coding, dtype, pos, index_bytes,
                           pos + index_bytes, value_coding, value_bytes)
    return record, pos + index_bytes + value_bytes


# dims, count, index_coding, value_dtype, index_bytes: the rest of a record after its name
_HEADER_REST_BY_NDIM = [struct.Struct(f"<{n}QQBBQ") for n in range(256)]
_VALUE_SIZE_BY_ID = {i: _RAW_BITS[d][1].itemsize for i, d in _DTYPES_BY_ID.items()}
_ALL_ID = INDEX_CODINGS["all"]
_GOLOMB_ID = INDEX_CODINGS["golomb"]
_INDEX_DECODERS = {INDEX_CODINGS["raw"]: golomb.raw_decode,
                   INDEX_CODINGS["bitmap"]: golomb.bitmap_decode,
                   INDEX_CODINGS["golomb"]: golomb.golomb_decode}


@dataclass
class _Headers:
    """Every tensor header of a message, field by field (what :func:`_read_headers_fast` reads)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    numels: list[int]
    counts: list[int]
    codings: list[int]
    dtype_ids: list[int]
    index_starts: list[int]
    index_lengths: list[int]
    value_starts: list[int]


def _read_headers_fast(data: memoryview, end: int, tensor_count: int,
                       max_numel: int | None) -> _Headers | None:
    """The headers of a well-formed message in one tight loop, or None if anything is off.

    The checks are those of :func:`_read_record` and the trailing-bytes check of
    :func:`_read_records`; a message that fails any of them is read again by those, which raise
    the reference error. The loop does a few Python steps per tensor (ResNet-50 has 161).
    """
    limit = golomb.MAX_NUMEL if max_numel is None else min(max_numel, golomb.MAX_NUMEL)
    h = _Headers([], [], [], [], [], [], [], [], [])
    pos = _PREAMBLE.size
    try:
        for _ in range(tensor_count):
            name_end = pos + _NAME_LEN.size + (data[pos] | data[pos + 1] << 8)
            ndim = data[name_end]
            rest = _HEADER_REST_BY_NDIM[ndim]
            fields = rest.unpack_from(data, name_end + _NDIM.size)
            shape = fields[:ndim]
            count, coding, dtype_id, index_bytes = fields[ndim:]
            numel = math.prod(shape)
            start = name_end + _NDIM.size + rest.size
            values_start = start + index_bytes
            next_pos = values_start + count * _VALUE_SIZE_BY_ID[dtype_id]
            if (next_pos > end or numel > limit or count > numel or coding not in _CODING_NAMES
                    or (coding == _ALL_ID and (count != numel or index_bytes))
                    or (not numel and ndim and max(shape) > golomb.MAX_NUMEL)):
                return None
            h.names.append(str(data[pos + _NAME_LEN.size:name_end], "utf-8"))
            h.shapes.append(shape)
            h.numels.append(numel)
            h.counts.append(count)
            h.codings.append(coding)
            h.dtype_ids.append(dtype_id)
            h.index_starts.append(start)
            h.index_lengths.append(index_bytes)
            h.value_starts.append(values_start)
            pos = next_pos
    except (IndexError, KeyError, struct.error, UnicodeDecodeError):
        return None  # read past the end, unknown dtype id, bad utf-8: the slow reader says which
    if pos != end or len(set(h.names)) != tensor_count:
        return None
    return h


def _decode_indices(data: memoryview, r: _TensorRecord) -> np.ndarray:
    section = data[r.index_start:r.index_start + r.index_bytes]
    name = _CODING_NAMES[r.coding]
    try:
        if name == "all":
            return np.arange(r.numel, dtype=np.int64)
        if name == "raw":
            return golomb.raw_decode(section, r.count, r.numel)
        if name == "bitmap":
            return golomb.bitmap_decode(section, r.count, r.numel)
        return golomb.golomb_decode(section, r.count, r.numel)
    except golomb.IndexCodingError as e:
        raise DecodeError(f"tensor {r.name!r} ({name} indices): {e}") from e


def _decode_signs(data: memoryview, r: _TensorRecord) -> np.ndarray:
    """The raw bits of a sign-coded tensor's values: +-scale, checked and canonical."""
    wire_dtype, view_dtype, exponent_mask = _RAW_BITS[r.dtype]
    size = view_dtype.itemsize
    sign_bit = 1 << (8 * size - 1)
    scale = int(np.frombuffer(data, dtype=wire_dtype, count=1, offset=r.values_start)[0])
    if scale & exponent_mask == exponent_mask:
        raise DecodeError(f"tensor {r.name!r}: sign-coded scale is NaN or Inf (raw bits "
                          f"0x{scale:x}); only finite values are valid")
    if scale & sign_bit or scale == 0:
        raise DecodeError(f"tensor {r.name!r}: sign-coded scale must be above zero, got raw bits "
                          f"0x{scale:x}")
    packed = np.frombuffer(data, dtype=np.uint8, count=(r.count + 7) // 8,
                           offset=r.values_start + size)
    if r.count % 8 and int(packed[-1]) >> (r.count % 8):
        raise DecodeError(f"tensor {r.name!r}: nonzero padding after the last sign bit")
    negative = np.unpackbits(packed, count=r.count, bitorder="little").astype(wire_dtype)
    return negative * np.array(sign_bit, dtype=wire_dtype) | np.array(scale, dtype=wire_dtype)


def _decode_grid(data: memoryview, r: _TensorRecord) -> torch.Tensor:
    """The values of a grid-coded tensor, ``q * scale`` (exact), the scale and, Rice-coded,
    the int8s checked."""
    (scale,) = struct.unpack_from("<f", data, r.values_start)
    mantissa, exponent = math.frexp(scale) if math.isfinite(scale) else (0.0, 0)
    if mantissa != 0.5 or not _GRID_EXPONENTS[0] <= exponent - 1 <= _GRID_EXPONENTS[1]:
        raise DecodeError(f"tensor {r.name!r}: grid-coded scale {scale!r} is not a power of two "
                          f"2**e with e in [{_GRID_EXPONENTS[0]}, {_GRID_EXPONENTS[1]}]")
    if r.value_coding == GRID_CODED:
        q = np.frombuffer(data, dtype=np.int8, count=r.count, offset=r.values_start + 4)
        return torch.from_numpy(q.astype(np.float32) * np.float32(scale))
    _, numel, rice_bytes = _GRID_RICE_HEAD.unpack_from(data, r.values_start)
    # Each zigzagged int8 is at most 255, so the gap sequence spans at most 256 per value.
    if numel > min(256 * r.count, golomb.MAX_NUMEL):
        raise DecodeError(f"tensor {r.name!r}: grid-coded values (Rice) claim a span of {numel}, "
                          f"above 256 per value")
    start = r.values_start + _GRID_RICE_HEAD.size
    try:
        positions = golomb.golomb_decode(data[start:start + rice_bytes], r.count, numel)
    except golomb.IndexCodingError as e:
        raise DecodeError(f"tensor {r.name!r}: grid-coded values (Rice): {e}") from e
    z = np.diff(positions.astype(np.int64), prepend=-1) - 1
    if (int(positions[-1]) + 1 if r.count else 0) != numel or (r.count and int(z.max()) > 255):
        raise DecodeError(f"tensor {r.name!r}: grid-coded values (Rice) are not canonical: a "
                          f"span other than the gaps' or a value beyond int8")
    q = (z >> 1) ^ -(z & 1)  # un-zigzag
    return torch.from_numpy(q.astype(np.float32) * np.float32(scale))


def _decode_values(data: memoryview, r: _TensorRecord) -> torch.Tensor:
    wire_dtype, view_dtype, exponent_mask = _RAW_BITS[r.dtype]
    if r.value_coding in _GRID_CODINGS:
        return _decode_grid(data, r)
    if r.value_coding == SIGN_CODED:
        signed_bits = _decode_signs(data, r).astype(wire_dtype.replace("u", "i"))
        return torch.from_numpy(signed_bits).view(r.dtype)
    raw = np.frombuffer(data, dtype=wire_dtype, count=r.count, offset=r.values_start)
    non_finite = (raw & exponent_mask) == exponent_mask
    if non_finite.any():
        at = int(np.flatnonzero(non_finite)[0])
        raise DecodeError(f"tensor {r.name!r}: value {at} is NaN or Inf (raw bits "
                          f"0x{int(raw[at]):x}); only finite values are valid")
    signed = raw.astype(wire_dtype.replace("u", "i"))  # a copy, so torch owns writable memory
    return torch.from_numpy(signed).view(r.dtype)


def _as_bytes_view(data: bytes | bytearray | memoryview) -> memoryview:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"decode takes bytes, bytearray or memoryview, got "
                          f"{type(data).__name__}")
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            raise DecodeError("decode needs a contiguous buffer")
        view = view.cast("B")
    return view


def decode(data: bytes | bytearray | memoryview, *, max_numel: int | None = None) -> SparseUpdate:
    """The update carried by ``data``, validated.

    Parameters
    ----------
    data
        One whole message as :func:`encode` wrote it, nothing before or after.
    max_numel
        If given, reject any tensor whose shape claims more entries (a guard for receivers that
        will densify what they decode). Checked from the header, before anything is allocated.

    Raises
    ------
    DecodeError
        With the reason: truncated input, trailing bytes, bad magic, unsupported version or
        flags, bad checksum, unknown coding or dtype id, count above numel, numel above
        ``max_numel`` or the format's limit, indices out of range / repeated / not increasing /
        not canonically coded, NaN or Inf values, duplicate or non-utf-8 tensor names. No other
        exception escapes on bad bytes.
    """
    if max_numel is not None and (not isinstance(max_numel, int) or max_numel < 0):
        raise ValueError(f"max_numel must be a non-negative int or None, got {max_numel!r}")
    return _decode_checked(_as_bytes_view(data), max_numel, None)


def _decode_checked(view: memoryview, max_numel: int | None,
                    templates: list[_Template] | None) -> SparseUpdate:
    try:
        return _decode(view, max_numel, templates)
    except DecodeError:
        raise
    except (ValueError, TypeError, IndexError, OverflowError, struct.error, RuntimeError) as e:
        # A check above missed a malformed case: still honour the DecodeError-only contract.
        raise DecodeError(f"malformed update: {type(e).__name__}: {e}") from e


def _read_preamble(data: memoryview) -> tuple[int, int, int]:
    """``(sequence, tensor_count, end)`` after checking the framing; ``end`` is the CRC's offset."""
    size = len(data)
    if size < EMPTY_MESSAGE_BYTES:
        raise DecodeError(f"truncated input: {size} bytes, a message has at least "
                          f"{EMPTY_MESSAGE_BYTES}")
    magic, version, flags, sequence, tensor_count = _PREAMBLE.unpack_from(data, 0)
    if magic != MAGIC:
        raise DecodeError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise DecodeError(f"unsupported version {version}, this decoder reads {VERSION}")
    if flags != 0:
        raise DecodeError(f"unsupported flags 0x{flags:02x} for version {VERSION} (must be 0)")
    end = size - _CRC.size
    # Each tensor record has at least its fixed fields: a count larger than the bytes can hold
    # is refused before any per-tensor work.
    min_record = _NAME_LEN.size + _NDIM.size + _TENSOR_TAIL.size
    if tensor_count * min_record > end - _PREAMBLE.size:
        raise DecodeError(f"truncated input: {tensor_count} tensors cannot fit in "
                          f"{end - _PREAMBLE.size} bytes")
    return sequence, tensor_count, end


def _read_records(data: memoryview, end: int, tensor_count: int,
                  max_numel: int | None) -> list[_TensorRecord]:
    """Every tensor header, step by step: the reference reader, whose error is the one raised."""
    records = []
    seen: set[str] = set()
    pos = _PREAMBLE.size
    for k in range(tensor_count):
        record, pos = _read_record(data, pos, end, k, max_numel, seen)
        records.append(record)
    if pos != end:
        raise DecodeError(f"trailing or oversized input: {end - pos} bytes after the last tensor "
                          f"(message is {len(data)} bytes, its tensors end at {pos + _CRC.size})")
    return records


def _check_crc(data: memoryview, end: int) -> None:
    (stored_crc,) = _CRC.unpack_from(data, end)
    actual_crc = zlib.crc32(data[:end])
    if stored_crc != actual_crc:
        raise DecodeError(f"bad checksum: stored 0x{stored_crc:08x}, computed 0x{actual_crc:08x}")


def _read_structure(data: memoryview, max_numel: int | None) -> tuple[int, list[_TensorRecord]]:
    """The sequence and every tensor header, after the framing and the checksum are verified."""
    sequence, tensor_count, end = _read_preamble(data)
    records = _read_records(data, end, tensor_count, max_numel)
    _check_crc(data, end)
    return sequence, records


def _decode(data: memoryview, max_numel: int | None,
            templates: list[_Template] | None = None) -> SparseUpdate:
    # The fast readers return None on anything unusual; the reference ones then run on the same
    # bytes and raise the error (or decode a valid message the fast ones do not cover).
    sequence, tensor_count, end = _read_preamble(data)
    headers = layout = None
    if templates:
        for template in templates:
            headers = template.read(data, end, tensor_count)
            if headers is not None:
                layout = template.layout
                break
    if headers is None:
        headers = _read_headers_fast(data, end, tensor_count, max_numel)
    if headers is None:
        records = _read_records(data, end, tensor_count, max_numel)
        _check_crc(data, end)
        return SparseUpdate(_decode_tensors(data, records), sequence)
    _check_crc(data, end)
    packed = _decode_packed(data, headers, layout)
    if packed is None:
        records = _read_records(data, end, tensor_count, max_numel)
        return SparseUpdate(_decode_tensors(data, records), sequence)
    if templates is not None and layout is None and len(templates) < _MAX_TEMPLATES:
        templates.append(_Template(data, headers, packed.layout))
    return SparseUpdate.from_packed(packed, sequence)


#: Message structures one :func:`decode_many` call remembers (a round's replies share one).
_MAX_TEMPLATES = 8
_TAIL_SIZE = _TENSOR_TAIL.size


class _Template:
    """The header bytes of one decoded message, to read messages of the same structure fast.

    Messages of one round (same model, same codings) differ in their headers only by each
    tensor's count and index length. Given a message that passed every header check, another
    whose name/ndim/dims bytes are the same, tensor by tensor, and whose coding and dtype ids are
    the same, passes the same checks (names, shapes, numels, utf-8, uniqueness, max_numel are all
    in those bytes) except those on count, index length and total length, which :meth:`read`
    makes. So it reads one prefix comparison and one small unpack per tensor, not the whole
    header field by field.
    """

    def __init__(self, data: memoryview, h: _Headers, layout: TensorLayout) -> None:
        self.layout = layout
        self.tensor_count = len(h.names)
        prefixes = []
        pos = _PREAMBLE.size
        for k in range(self.tensor_count):
            prefix_end = h.index_starts[k] - _TAIL_SIZE
            prefixes.append(bytes(data[pos:prefix_end]))
            pos = h.value_starts[k] + h.counts[k] * _VALUE_SIZE_BY_ID[h.dtype_ids[k]]
        self.rows = [(prefix, len(prefix), _VALUE_SIZE_BY_ID[d])
                     for prefix, d in zip(prefixes, h.dtype_ids, strict=True)]
        self.names, self.shapes, self.numels = h.names, h.shapes, h.numels
        self.codings, self.dtype_ids = tuple(h.codings), tuple(h.dtype_ids)
        dense = [k for k, c in enumerate(h.codings) if c == _ALL_ID]
        self.dense_numels = [h.numels[k] for k in dense]
        self.dense = dense

    def read(self, data: memoryview, end: int, tensor_count: int) -> _Headers | None:
        """The headers of ``data`` if it has this structure and passes the header checks."""
        if tensor_count != self.tensor_count:
            return None
        starts: list[int] = []
        tails: list[tuple[int, int, int, int]] = []
        unpack = _TENSOR_TAIL.unpack_from
        pos = _PREAMBLE.size
        try:
            for prefix, prefix_len, value_size in self.rows:
                if data[pos:pos + prefix_len] != prefix:
                    return None
                tail = unpack(data, pos + prefix_len)
                start = pos + prefix_len + _TAIL_SIZE
                starts.append(start)
                tails.append(tail)
                pos = start + tail[3] + tail[0] * value_size
                if pos > end:
                    return None
        except struct.error:
            return None  # ran past the buffer: the reference reader names it
        if pos != end:
            return None
        counts, codings, dtype_ids, index_lengths = (
            (list(c) for c in zip(*tails, strict=True)) if tails else ([], [], [], []))
        if (tuple(codings) != self.codings or tuple(dtype_ids) != self.dtype_ids
                or any(map(operator.gt, counts, self.numels))
                or [counts[k] for k in self.dense] != self.dense_numels
                or any(index_lengths[k] for k in self.dense)):
            return None
        return _Headers(self.names, self.shapes, self.numels, counts, codings, dtype_ids,
                        starts, index_lengths, list(map(operator.add, starts, index_lengths)))


def decode_many(messages: Sequence[bytes | bytearray | memoryview], *,
                max_numel: int | None = None) -> list[SparseUpdate | DecodeError]:
    """:func:`decode` of each message, faster for messages that share their structure.

    Returns, in order, each message's update, or the :class:`~dgc.errors.DecodeError` that
    ``decode(message, max_numel=max_numel)`` would raise (same message): one bad message does
    not affect the others. The replies of a round (same model, same codings) differ only in
    counts and lengths; after the first is decoded, the others' headers are read against it
    (one prefix comparison per tensor, see ``_Template``) and their updates share its layout.
    """
    if max_numel is not None and (not isinstance(max_numel, int) or max_numel < 0):
        raise ValueError(f"max_numel must be a non-negative int or None, got {max_numel!r}")
    templates: list[_Template] = []
    results: list[SparseUpdate | DecodeError] = []
    for data in messages:
        try:
            results.append(_decode_checked(_as_bytes_view(data), max_numel, templates))
        except DecodeError as e:
            results.append(e)
    return results


def _decode_tensors(data: memoryview, records: list[_TensorRecord]) -> dict[str, SparseTensor]:
    """Every tensor, one after the other: the reference decoder, whose error is the one raised."""
    tensors = {}
    for r in records:
        indices = torch.from_numpy(_decode_indices(data, r))
        values = _decode_values(data, r)
        tensors[r.name] = SparseTensor(indices, values, r.shape)
    return tensors


@functools.lru_cache(maxsize=64)
def _layout(names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...],
            dense: tuple[bool, ...]) -> TensorLayout:
    """One shared layout object per message structure (bounded: forged headers cannot grow it)."""
    return TensorLayout(names, shapes, dense)


def _decode_packed(data: memoryview, h: _Headers,
                   layout: TensorLayout | None = None) -> PackedTensors | None:
    """The tensors of a message as flat arrays, or None if any section is bad or unusual.

    Decodes all Golomb-Rice index sections in one batch and checks all values for NaN/Inf in one
    pass. Covers messages whose values share one dtype (what a DGC client sends); None also for
    any failed check, and :func:`_decode_tensors` then decodes again tensor by tensor, so that
    the error raised (which tensor, which check) is exactly the reference one.
    """
    dtype_ids = set(h.dtype_ids)
    if len(dtype_ids) > 1:
        return None
    dtype = _DTYPES_BY_ID[dtype_ids.pop()] if dtype_ids else torch.float32
    wire_dtype, view_dtype, exponent_mask = _RAW_BITS[dtype]
    value_size = view_dtype.itemsize
    whole = np.frombuffer(data, dtype=np.uint8)
    dense = tuple(c == _ALL_ID for c in h.codings)
    if layout is None:
        layout = _layout(tuple(h.names), tuple(h.shapes), dense)
    sparse = [k for k, d in enumerate(dense) if not d]
    if all(h.codings[k] == _GOLOMB_ID for k in sparse):
        columns = [np.array([column[k] for k in sparse], dtype=np.int64)
                   for column in (h.index_starts, h.index_lengths, h.counts, h.numels)]
        offsets = np.array([layout.offsets[k] for k in sparse], dtype=np.int64)
        indices = golomb.golomb_decode_many(whole, *columns, offsets)
        if indices is None:
            return None
    else:  # raw or bitmap sections (rare at DGC densities): one tensor at a time
        pieces = []
        for k in sparse:
            section = data[h.index_starts[k]:h.index_starts[k] + h.index_lengths[k]]
            try:
                pieces.append(_INDEX_DECODERS[h.codings[k]](section, h.counts[k], h.numels[k])
                              + layout.offsets[k])
            except golomb.IndexCodingError:
                return None
        indices = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int32)

    def values_of(tensors: list[int]) -> np.ndarray:
        """The raw value bits of these tensors, concatenated (a copy that torch then owns)."""
        starts, counts = h.value_starts, h.counts
        # bytearray.join of memoryview slices: about half the cost of numpy slices + concatenate
        joined = bytearray().join([data[starts[k]:starts[k] + counts[k] * value_size]
                                   for k in tensors])
        return np.frombuffer(joined, dtype=wire_dtype)

    sparse_values = values_of(sparse)
    dense_values = values_of([k for k, d in enumerate(dense) if d])
    for raw in (sparse_values, dense_values):
        if ((raw & exponent_mask) == exponent_mask).any():
            return None
    signed = wire_dtype.replace("u", "i")
    return PackedTensors(layout, tuple(h.counts), torch.from_numpy(indices),
                         torch.from_numpy(sparse_values.view(signed)).view(dtype),
                         torch.from_numpy(dense_values.view(signed)).view(dtype))


def tensor_codings(data: bytes | bytearray | memoryview) -> dict[str, str]:
    """The index coding each tensor of a message is stored with, by name, in message order.

    Reads only the headers (after verifying framing and checksum); a diagnostic for benchmarks,
    tests and other-language codecs. Raises :class:`~dgc.errors.DecodeError` like :func:`decode`.
    """
    view = _as_bytes_view(data)
    try:
        _, records = _read_structure(view, None)
    except (ValueError, TypeError, IndexError, OverflowError, struct.error) as e:
        if isinstance(e, DecodeError):
            raise
        raise DecodeError(f"malformed update: {type(e).__name__}: {e}") from e
    return {r.name: _CODING_NAMES[r.coding] for r in records}
