"""The sign channel's payloads: a round's index sets (downlink) and a client's signs (uplink).

Both are framed as every fedgc payload (:mod:`dgc.wire.framing`: magic, version, CRC-32,
bounded reads; ``docs/wire.md`` section 11)::

    mask  = "FGCM" | version u8 = 1 | sequence u64 | count u32
            | (name_len u16 | name | numel u64 | k u64 | section_bytes u64 | Golomb-Rice section)
              * count | crc32 u32
    signs = "FGCS" | version u8 = 1 | sequence u64 | count u32
            | (name_len u16 | name | k u64 | scale f32 | ceil(k / 8) sign bytes) * count
            | crc32 u32

The signs carry no indices: the server holds the sets it sent. Every count is checked against
the bytes that must carry it (or, for signs, against the set it answers) before anything is
allocated; every defect is a :class:`~dgc.errors.DecodeError`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping

import numpy as np
import torch

from dgc.errors import DecodeError, StateError
from dgc.golomb import IndexCodingError, golomb_decode, golomb_encode
from dgc.sparse import SparseTensor, SparseUpdate
from dgc.wire.framing import (
    Preamble,
    as_view,
    check_crc,
    check_end,
    crc_offset,
    name_bytes,
    read,
    read_name,
    seal,
)

VERSION = 1
#: The preambles after magic and version: sequence, tensor count.
MASK_PREAMBLE = Preamble(b"FGCM", VERSION, "QI")
SIGN_PREAMBLE = Preamble(b"FGCS", VERSION, "QI")
MASK_MAGIC = MASK_PREAMBLE.magic
SIGN_MAGIC = SIGN_PREAMBLE.magic
_MASK_TENSOR = struct.Struct("<QQQ")  # numel, count, index section bytes
_SIGN_TENSOR = struct.Struct("<Qf")  # count, scale

#: A round's shared index sets: sorted int64 indices per tensor name.
Masks = dict[str, np.ndarray]


def encode_mask(masks: Mapping[str, np.ndarray], numels: Mapping[str, int],
                sequence: int) -> bytes:
    """The downlink bytes of a round's index sets: Golomb-Rice coded, CRC-checked."""
    parts = [MASK_PREAMBLE.pack(sequence, len(masks))]
    for name, mask in masks.items():
        idx = np.asarray(mask, dtype=np.int64)
        section = golomb_encode(idx, int(numels[name]))
        parts += [name_bytes(name), _MASK_TENSOR.pack(int(numels[name]), idx.size, len(section)),
                  section]
    return seal(parts)


def decode_mask(data: bytes | bytearray | memoryview,
                numels: Mapping[str, int]) -> tuple[int, Masks]:
    """``(sequence, masks)`` from :func:`encode_mask` bytes; every defect is a DecodeError.

    ``numels`` is the bound: every tensor must be one of them, with that size; its count must
    fit that size, and the Golomb-Rice decoder checks it against the section's bytes before it
    allocates anything.
    """
    view = as_view(data)
    sequence, count = MASK_PREAMBLE.open(view)
    end = crc_offset(view)
    check_crc(view, end)
    pos = MASK_PREAMBLE.size
    masks: Masks = {}
    for _ in range(count):
        name, pos = read_name(view, pos, end, "index set name")
        numel, k, nbytes = read(_MASK_TENSOR, view, pos, end, f"index set header of {name!r}")
        pos += _MASK_TENSOR.size
        if name in masks:
            raise DecodeError(f"index set of {name!r} appears twice")
        if numels.get(name) != numel:
            raise DecodeError(f"index set of {name!r} is for {numel} entries, expected "
                              f"{numels.get(name)}")
        if k > numel or pos + nbytes > end:
            raise DecodeError(f"index set of {name!r} claims {k} of {numel} entries in "
                              f"{nbytes} bytes, past the end of the message")
        try:
            masks[name] = golomb_decode(view[pos:pos + nbytes], k, numel)
        except IndexCodingError as ex:
            raise DecodeError(f"index set of {name!r}: {ex}") from ex
        pos += nbytes
    check_end(view, pos, end)
    return sequence, masks


def encode_signs(sent: SparseUpdate) -> bytes:
    """The uplink bytes of :func:`dgc.signs.client.take_signs`'s result: per tensor one fp32
    scale and 1 bit per entry (set for a negative value), in index order; no indices (the
    server holds them)."""
    parts = [SIGN_PREAMBLE.pack(sent.sequence, len(sent.tensors))]
    for name, t in sent.tensors.items():
        values = t.values.to("cpu", torch.float32)
        scale = float(values.abs().max()) if t.nnz else 0.0
        if not math.isfinite(scale) or not bool((values.abs() == scale).all()):
            raise StateError(f"shared values of {name!r} are not +-one finite scale")
        negative = (values < 0).numpy()
        parts += [name_bytes(name), _SIGN_TENSOR.pack(t.nnz, scale),
                  np.packbits(negative, bitorder="little").tobytes()]
    return seal(parts)


def decode_signs(data: bytes | bytearray | memoryview, masks: Mapping[str, np.ndarray],
                 shapes: Mapping[str, tuple[int, ...]]) -> SparseUpdate:
    """The shared update a client sent for ``masks``; every defect is a DecodeError.

    ``masks`` (the sets the server sent this round) is the bound: the message must carry
    exactly their tensors, each with as many signs as its set holds (checked against the bytes
    before they are unpacked), a finite scale >= 0 and zero padding bits. Its tensors get
    ``shapes``.
    """
    view = as_view(data)
    sequence, count = SIGN_PREAMBLE.open(view)
    end = crc_offset(view)
    check_crc(view, end)
    pos = SIGN_PREAMBLE.size
    out: dict[str, SparseTensor] = {}
    for _ in range(count):
        name, pos = read_name(view, pos, end, "sign tensor name")
        k, scale = read(_SIGN_TENSOR, view, pos, end, f"sign header of {name!r}")
        pos += _SIGN_TENSOR.size
        if name not in masks:
            raise DecodeError(f"signs for {name!r}, which had no shared index set this round")
        if name in out:
            raise DecodeError(f"signs for {name!r} appear twice")
        if k != len(masks[name]):
            raise DecodeError(f"{k} signs for {name!r}, its index set holds {len(masks[name])}")
        if not math.isfinite(scale) or scale < 0:
            raise DecodeError(f"scale of {name!r} is {scale}, expected a finite value >= 0")
        nbytes = (k + 7) // 8
        if pos + nbytes > end:
            raise DecodeError(f"signs of {name!r} run past the end of the message")
        bits = np.unpackbits(np.frombuffer(view[pos:pos + nbytes], dtype=np.uint8),
                             bitorder="little")
        if bits[k:].any():
            raise DecodeError(f"padding bits of {name!r} are not zero")
        pos += nbytes
        values = torch.where(torch.from_numpy(bits[:k].astype(bool)), -scale, scale)
        out[name] = SparseTensor(torch.from_numpy(np.asarray(masks[name], dtype=np.int64)),
                                 values.to(torch.float32), tuple(shapes[name]))
    missing = set(masks) - set(out)
    if missing:
        raise DecodeError(f"no signs for {sorted(missing)}")
    check_end(view, pos, end)
    return SparseUpdate(out, sequence)
