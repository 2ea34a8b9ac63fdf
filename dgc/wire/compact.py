"""Compact updates: the update message for a model both ends know, its tensors by place.

An update message (``FGCU``, :mod:`dgc.wire.layout`) names each tensor and spells out its shape,
its count and its index section's length in fixed-width fields: 21 bytes, plus the name, plus 8
bytes a dimension (54 bytes for ``lstm.weight_hh_l0``), and 20 more for a Rice-coded grid's head.
A DGC reply of a few hundred entries per tensor spends a third of its bytes there: on the
shakespeare LSTM's 11 tensors, 1.2 kB of a 3.8 kB reply and its side part (docs/dgc_vs_dense.md,
"The last points"). Sender and receiver both hold the model, so a compact message sends none of
it: a tensor is its place in the model's tensors sorted by name (:func:`layout_of`), and every
length is an unsigned LEB128 varint. The index and value sections are the update message's,
byte for byte (``docs/wire.md``), except that a Rice-coded grid's head carries its span and
length as varints too; the layout's digest (:func:`layout_digest`) makes a message about
another model (or another set of tensors) a decode error rather than tensors misread::

    message = "FGCK" | version u8 = 1 | layout digest u32 | sequence varint | tensor count varint
              | tensor * count | crc32 u32
    tensor  = place gap varint (place - previous place - 1; the first: its place)
              | count varint | index coding u8 | value dtype u8 | index bytes varint
              | index section | value section
    value section of a Rice-coded grid (dtype 65, 66) = scale f32 | span varint
              | Rice bytes varint | Rice section; any other: the update message's

Decoding is checked as the update message's is (:func:`decode_compact`): places inside the
layout and increasing, every count against its tensor's entries and against the bytes that must
carry it, before anything of that size is allocated; every defect a
:class:`~dgc.errors.DecodeError`. The Java codec decodes it (``CompactCodec``, tests/golden/
downlink.json); phones send the update message.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Mapping, Sequence

import torch

from dgc import golomb
from dgc.errors import DecodeError, EncodeError
from dgc.sparse import SparseTensor, SparseUpdate
from dgc.wire.encoder import _check_tensor, _check_update
from dgc.wire.framing import Preamble, as_view, check_crc, check_end, crc_offset, seal
from dgc.wire.index_codings import (
    CODING_NAMES,
    INDEX_CODINGS,
    choose_coding,
    decode_indices,
    encode_indices,
)
from dgc.wire.layout import TensorRecord
from dgc.wire.value_codings import (
    DTYPES_BY_ID,
    GRID_CODINGS,
    GRID_RICE_CODINGS,
    GRID_RICE_HEAD,
    SIGN_CODED,
    decode_values,
    values_nbytes,
    values_section,
)

__all__ = ["COMPACT_MAGIC", "Layout", "decode_compact", "encode_compact", "layout_digest",
           "layout_of"]

PREAMBLE = Preamble(b"FGCK", 1, "I")  # the layout's digest
COMPACT_MAGIC = PREAMBLE.magic
#: A model's tensors as both ends list them: (name, shape), sorted by name.
Layout = tuple[tuple[str, tuple[int, ...]], ...]
_CODES = struct.Struct("<BB")  # index coding, value dtype
_SCALE = struct.Struct("<f")
_MAX_VARINT_BYTES = 10  # a u64


def layout_of(shapes: Mapping[str, Sequence[int]]) -> Layout:
    """The layout of a model of these tensor shapes: its tensors sorted by name."""
    return tuple((name, tuple(int(d) for d in shapes[name])) for name in sorted(shapes))


def layout_digest(layout: Layout) -> int:
    """CRC-32 of the layout's names and shapes (``name:d0,d1;`` each, utf-8)."""
    text = "".join(f"{name}:{','.join(map(str, shape))};" for name, shape in layout)
    return zlib.crc32(text.encode("utf-8"))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: memoryview, pos: int, end: int, what: str) -> tuple[int, int]:
    """A canonical LEB128 varint at ``pos`` (no byte past ``end``, at most a u64) and the offset
    after it."""
    value = shift = 0
    for i in range(_MAX_VARINT_BYTES):
        if pos + i >= end:
            raise DecodeError(f"truncated input: {what} runs past the checksum at offset {pos}")
        byte = data[pos + i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if i and not byte:
                raise DecodeError(f"{what} at offset {pos} is not a canonical varint")
            if value >= 1 << 64:
                raise DecodeError(f"{what} at offset {pos} is above the u64 range")
            return value, pos + i + 1
        shift += 7
    raise DecodeError(f"{what} at offset {pos} is longer than {_MAX_VARINT_BYTES} bytes")


def _compact_values(dtype_id: int, section: bytes) -> bytes:
    """A value section with a Rice-coded grid's head in varints; any other as it is."""
    if dtype_id not in GRID_RICE_CODINGS:
        return section
    scale, span, rice_bytes = GRID_RICE_HEAD.unpack_from(section, 0)
    return (_SCALE.pack(scale) + _varint(span) + _varint(rice_bytes)
            + section[GRID_RICE_HEAD.size:])


def encode_compact(update: SparseUpdate, layout: Layout | None = None,
                   sign_coding: bool = False, grid_coding: bool = False,
                   nonzero_grid: bool = False) -> bytes:
    """The compact bytes of ``update``, whose tensors are some of ``layout``'s with their shapes
    (written in the layout's order; default: the update's own tensors); the codings as
    :func:`dgc.encode` picks them with the same switches. An :class:`~dgc.errors.EncodeError`
    for what a decoder would refuse."""
    _check_update(update)
    update = update.cpu()
    if layout is None:
        layout = layout_of({name: t.shape for name, t in update.tensors.items()})
    places = {name: (k, shape) for k, (name, shape) in enumerate(layout)}
    for name, t in update.tensors.items():
        if name not in places:
            raise EncodeError(f"tensor {name!r} is not in the model's layout")
        if tuple(t.shape) != places[name][1]:
            raise EncodeError(f"tensor {name!r} has shape {tuple(t.shape)}, the layout's is "
                              f"{places[name][1]}")
    parts = [PREAMBLE.pack(layout_digest(layout)), _varint(update.sequence),
             _varint(len(update.tensors))]
    previous = -1
    for name in sorted(update.tensors, key=lambda n: places[n][0]):
        t = update.tensors[name]
        indices = _check_tensor(name, t)
        coding, rice_b = choose_coding(indices, t.numel, "auto", name)
        index_section = encode_indices(indices, t.numel, coding, rice_b)
        dtype_id, value_section = values_section(t.values, sign_coding, grid_coding,
                                                 nonzero_grid)
        place = places[name][0]
        parts += [_varint(place - previous - 1), _varint(t.nnz),
                  _CODES.pack(INDEX_CODINGS[coding], dtype_id), _varint(len(index_section)),
                  index_section, _compact_values(dtype_id, value_section)]
        previous = place
    return seal(parts)


def _read_tensor(data: memoryview, pos: int, end: int, place: int, name: str, numel: int,
                 shape: tuple[int, ...]) -> tuple[TensorRecord, bytes | None, int]:
    """One tensor's record (and, for a Rice-coded grid, its value section with the update
    message's head, which the shared decoder reads), and the offset after it."""
    count, pos = _read_varint(data, pos, end, f"tensor {name!r} count")
    if pos + _CODES.size > end:
        raise DecodeError(f"truncated input: tensor {name!r} codings at offset {pos}")
    coding, dtype_id = _CODES.unpack_from(data, pos)
    pos += _CODES.size
    index_bytes, pos = _read_varint(data, pos, end, f"tensor {name!r} index length")
    if count > numel:
        raise DecodeError(f"tensor {name!r} claims {count} entries, above its numel {numel}")
    if coding not in CODING_NAMES:
        raise DecodeError(f"tensor {name!r} has unknown index coding id {coding}; known: "
                          f"{sorted(CODING_NAMES)}")
    value_coding = dtype_id if dtype_id in GRID_CODINGS else dtype_id & SIGN_CODED
    if dtype_id not in GRID_CODINGS and dtype_id & ~SIGN_CODED not in DTYPES_BY_ID:
        raise DecodeError(f"tensor {name!r} has unknown value dtype id {dtype_id}")
    if coding == INDEX_CODINGS["all"] and (count != numel or index_bytes != 0):
        raise DecodeError(f"tensor {name!r}: coding 'all' needs count == numel and no index "
                          f"bytes, got count {count}, numel {numel}, {index_bytes} index bytes")
    if pos + index_bytes > end:
        raise DecodeError(f"truncated input: tensor {name!r} needs {index_bytes} index bytes "
                          f"at offset {pos}, only {end - pos} left")
    index_start = pos
    pos += index_bytes
    dtype = (torch.float32 if value_coding in GRID_CODINGS
             else DTYPES_BY_ID[dtype_id & ~SIGN_CODED])
    rebuilt = None
    if value_coding in GRID_RICE_CODINGS:
        if pos + _SCALE.size > end:
            raise DecodeError(f"truncated input: tensor {name!r} grid scale at offset {pos}")
        (scale,) = _SCALE.unpack_from(data, pos)
        span, at = _read_varint(data, pos + _SCALE.size, end, f"tensor {name!r} grid span")
        rice_bytes, at = _read_varint(data, at, end, f"tensor {name!r} grid length")
        if span > golomb.MAX_NUMEL or at + rice_bytes > end:
            raise DecodeError(f"truncated input: tensor {name!r} needs {rice_bytes} grid bytes "
                              f"at offset {at}, only {end - at} left")
        rebuilt = (GRID_RICE_HEAD.pack(scale, span, rice_bytes)
                   + bytes(data[at:at + rice_bytes]))
        value_bytes, next_pos = len(rebuilt), at + rice_bytes
    else:
        value_bytes = values_nbytes(dtype, count, value_coding)
        if pos + value_bytes > end:
            raise DecodeError(f"truncated input: tensor {name!r} needs {value_bytes} value "
                              f"bytes at offset {pos}, only {end - pos} left")
        next_pos = pos + value_bytes
    record = TensorRecord(name, shape, numel, count, coding, dtype, index_start, index_bytes,
                          0 if rebuilt is not None else pos, value_coding, value_bytes)
    return record, rebuilt, next_pos


def decode_compact(data: bytes | bytearray | memoryview, layout: Layout, *,
                   max_numel: int) -> SparseUpdate:
    """The update of a compact message about a model of ``layout`` (every tensor it names
    with its layout shape), validated as :func:`dgc.decode` validates; ``max_numel``: refuse a
    layout tensor of more entries (the receiver's bound). Every defect is a DecodeError."""
    view = as_view(data)
    try:
        return _decode(view, layout, max_numel)
    except DecodeError:
        raise
    except (ValueError, TypeError, IndexError, OverflowError, struct.error, RuntimeError) as e:
        raise DecodeError(f"malformed compact update: {type(e).__name__}: {e}") from e


def _decode(view: memoryview, layout: Layout, max_numel: int) -> SparseUpdate:
    (digest,) = PREAMBLE.open(view)
    end = crc_offset(view)
    check_crc(view, end)
    if digest != layout_digest(layout):
        raise DecodeError(f"a compact update about another model: layout digest 0x{digest:08x}, "
                          f"this model's is 0x{layout_digest(layout):08x}")
    sequence, pos = _read_varint(view, PREAMBLE.size, end, "sequence")
    count, pos = _read_varint(view, pos, end, "tensor count")
    if count > len(layout):
        raise DecodeError(f"{count} tensors for a model of {len(layout)}")
    place, tensors = -1, {}
    for _ in range(count):
        gap, pos = _read_varint(view, pos, end, "tensor place")
        place += gap + 1
        if place >= len(layout):
            raise DecodeError(f"tensor place {place} beyond the model's {len(layout)} tensors")
        name, shape = layout[place]
        numel = math.prod(shape)
        if numel > max_numel:
            raise DecodeError(f"tensor {name!r} has {numel} entries, above max_numel="
                              f"{max_numel}")
        record, rebuilt, pos = _read_tensor(view, pos, end, place, name, numel, shape)
        # Values first, as the update message's decoder: their section bounds the count before
        # an 'all' section allocates the tensor's entries. A Rice-coded grid's values are read
        # from its head rebuilt in the update message's form.
        values = decode_values(view if rebuilt is None else memoryview(rebuilt), record)
        indices = torch.from_numpy(decode_indices(view, record))
        tensors[name] = SparseTensor(indices, values, shape)
    check_end(view, pos, end)
    return SparseUpdate(tensors, sequence)
