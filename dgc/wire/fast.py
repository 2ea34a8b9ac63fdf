"""The decoder's fast path: well-formed messages of a round decoded into packed arrays.

A server decodes a round's replies, which share one structure (same model, same codings). Here
their headers are read in one tight loop (or against a template of an earlier message), all
Golomb-Rice sections decoded in one batch and all values checked in one pass. Every function
returns None on anything unusual, and :mod:`dgc.wire.decoder`'s reference reader then reads the
same bytes again and raises the error it names.
"""

from __future__ import annotations

import functools
import math
import operator
import struct
from dataclasses import dataclass

import numpy as np
import torch

from dgc import golomb
from dgc.sparse import PackedTensors, TensorLayout
from dgc.wire.framing import NAME_LEN, NDIM
from dgc.wire.index_codings import ALL_ID, CODING_NAMES, GOLOMB_ID, INDEX_DECODERS
from dgc.wire.layout import PREAMBLE, TENSOR_TAIL
from dgc.wire.value_codings import DTYPES_BY_ID, RAW_BITS, VALUE_SIZE_BY_ID

# dims, count, index_coding, value_dtype, index_bytes: the rest of a record after its name
_HEADER_REST_BY_NDIM = [struct.Struct(f"<{n}QQBBQ") for n in range(256)]


@dataclass
class Headers:
    """Every tensor header of a message, field by field (what :func:`read_headers_fast` reads)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    numels: list[int]
    counts: list[int]
    codings: list[int]
    dtype_ids: list[int]
    index_starts: list[int]
    index_lengths: list[int]
    value_starts: list[int]


def read_headers_fast(data: memoryview, end: int, tensor_count: int,
                      max_numel: int | None) -> Headers | None:
    """The headers of a well-formed message in one tight loop, or None if anything is off.

    The checks are those of the reference reader (``dgc.wire.decoder``), which reads a message
    that fails any of them again and raises the reference error. The loop does a few Python
    steps per tensor (ResNet-50 has 161).
    """
    limit = golomb.MAX_NUMEL if max_numel is None else min(max_numel, golomb.MAX_NUMEL)
    h = Headers([], [], [], [], [], [], [], [], [])
    pos = PREAMBLE.size
    try:
        for _ in range(tensor_count):
            name_end = pos + NAME_LEN.size + (data[pos] | data[pos + 1] << 8)
            ndim = data[name_end]
            rest = _HEADER_REST_BY_NDIM[ndim]
            fields = rest.unpack_from(data, name_end + NDIM.size)
            shape = fields[:ndim]
            count, coding, dtype_id, index_bytes = fields[ndim:]
            numel = math.prod(shape)
            start = name_end + NDIM.size + rest.size
            values_start = start + index_bytes
            next_pos = values_start + count * VALUE_SIZE_BY_ID[dtype_id]
            if (next_pos > end or numel > limit or count > numel or coding not in CODING_NAMES
                    or (coding == ALL_ID and (count != numel or index_bytes))
                    or (not numel and ndim and max(shape) > golomb.MAX_NUMEL)):
                return None
            h.names.append(str(data[pos + NAME_LEN.size:name_end], "utf-8"))
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

#: Message structures one :func:`decode_many` call remembers (a round's replies share one).
MAX_TEMPLATES = 8

_TAIL_SIZE = TENSOR_TAIL.size


class Template:
    """The header bytes of one decoded message, to read messages of the same structure fast.

    Messages of one round (same model, same codings) differ in their headers only by each
    tensor's count and index length. Given a message that passed every header check, another
    whose name/ndim/dims bytes are the same, tensor by tensor, and whose coding and dtype ids are
    the same, passes the same checks (names, shapes, numels, utf-8, uniqueness, max_numel are all
    in those bytes) except those on count, index length and total length, which :meth:`read`
    makes. So it reads one prefix comparison and one small unpack per tensor, not the whole
    header field by field.
    """

    def __init__(self, data: memoryview, h: Headers, layout: TensorLayout) -> None:
        self.layout = layout
        self.tensor_count = len(h.names)
        prefixes = []
        pos = PREAMBLE.size
        for k in range(self.tensor_count):
            prefix_end = h.index_starts[k] - _TAIL_SIZE
            prefixes.append(bytes(data[pos:prefix_end]))
            pos = h.value_starts[k] + h.counts[k] * VALUE_SIZE_BY_ID[h.dtype_ids[k]]
        self.rows = [(prefix, len(prefix), VALUE_SIZE_BY_ID[d])
                     for prefix, d in zip(prefixes, h.dtype_ids, strict=True)]
        self.names, self.shapes, self.numels = h.names, h.shapes, h.numels
        self.codings, self.dtype_ids = tuple(h.codings), tuple(h.dtype_ids)
        dense = [k for k, c in enumerate(h.codings) if c == ALL_ID]
        self.dense_numels = [h.numels[k] for k in dense]
        self.dense = dense

    def read(self, data: memoryview, end: int, tensor_count: int) -> Headers | None:
        """The headers of ``data`` if it has this structure and passes the header checks."""
        if tensor_count != self.tensor_count:
            return None
        starts: list[int] = []
        tails: list[tuple[int, int, int, int]] = []
        unpack = TENSOR_TAIL.unpack_from
        pos = PREAMBLE.size
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
        return Headers(self.names, self.shapes, self.numels, counts, codings, dtype_ids,
                        starts, index_lengths, list(map(operator.add, starts, index_lengths)))


@functools.lru_cache(maxsize=64)
def _layout(names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...],
            dense: tuple[bool, ...]) -> TensorLayout:
    """One shared layout object per message structure (bounded: forged headers cannot grow it)."""
    return TensorLayout(names, shapes, dense)


def decode_packed(data: memoryview, h: Headers,
                   layout: TensorLayout | None = None) -> PackedTensors | None:
    """The tensors of a message as flat arrays, or None if any section is bad or unusual.

    Decodes all Golomb-Rice index sections in one batch and checks all values for NaN/Inf in one
    pass. Covers messages whose values share one dtype (what a DGC client sends); None also for
    any failed check, and ``dgc.wire.decoder.decode_tensors`` then decodes again tensor by
    tensor, so that the error raised (which tensor, which check) is exactly the reference one.
    """
    dtype_ids = set(h.dtype_ids)
    if len(dtype_ids) > 1:
        return None
    dtype = DTYPES_BY_ID[dtype_ids.pop()] if dtype_ids else torch.float32
    wire_dtype, view_dtype, exponent_mask = RAW_BITS[dtype]
    value_size = view_dtype.itemsize
    whole = np.frombuffer(data, dtype=np.uint8)
    dense = tuple(c == ALL_ID for c in h.codings)
    if layout is None:
        layout = _layout(tuple(h.names), tuple(h.shapes), dense)
    sparse = [k for k, d in enumerate(dense) if not d]
    if all(h.codings[k] == GOLOMB_ID for k in sparse):
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
                pieces.append(INDEX_DECODERS[h.codings[k]](section, h.counts[k], h.numels[k])
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
