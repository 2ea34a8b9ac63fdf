"""The sign channel's payloads: a round's index sets (downlink) and a client's signs (uplink).

Both are framed as every fedgc payload (:mod:`dgc.wire.framing`: magic, version, CRC-32,
bounded reads; ``docs/wire.md`` section 11)::

    mask  = "FGCM" | version u8 = 1 | sequence u64 | count u32
            | (name_len u16 | name | numel u64 | k u64 | section_bytes u64 | Golomb-Rice section)
              * count | crc32 u32
    signs = "FGCS" | version u8 = 1 | sequence u64 | count u32
            | (name_len u16 | name | k u64 | scale f32 | ceil(k / 8) sign bytes) * count
            | crc32 u32

The signs carry no indices: the server holds the sets it sent. With ``dgc.shared_values =
grid`` a client sends values instead of signs (:func:`encode_values`): a wire message
(``docs/wire.md``, "FGCU") whose tensors are the flat value vectors of the sets, one entry per
index, grid-coded; :func:`decode_shared` reads either kind by its magic. Every count is
checked against the bytes that must carry it (or, for signs, against the set it answers)
before anything is allocated; every defect is a :class:`~dgc.errors.DecodeError`.
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
from dgc.wire import decode as decode_update
from dgc.wire import encode as encode_update
from dgc.wire.compact import COMPACT_MAGIC, decode_compact, encode_compact, layout_of
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
#: Sets ranked by displacement: the preamble, then a flag byte, then per tensor numel, count.
RANK_PREAMBLE = Preamble(b"FGCD", VERSION, "QI")
RANK_MAGIC = RANK_PREAMBLE.magic
_RANK_FLAGS = struct.Struct("<B")  # bit 0: version 0 has its matrices on the int8 grid;
_RANK_EXPLORE_BIT = 2  # bit 1: each tensor's count is followed by how many are drawn at random
_RANK_TENSOR = struct.Struct("<QQ")  # numel, count
_RANK_EXPLORE = struct.Struct("<Q")  # entries of the set drawn at random

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


def encode_values(sent: SparseUpdate, compact: bool = False) -> bytes:
    """The uplink bytes of :func:`dgc.signs.client.take_values`'s result: a wire message whose
    tensor ``name`` is the flat vector of the values at that set's indices, in index order
    (index coding ``all``: no indices; values grid-coded, Rice-coded where smaller); with
    ``compact``, the compact message (:mod:`dgc.wire.compact`) of the same tensors."""
    flat = {name: SparseTensor(torch.arange(t.nnz, dtype=torch.int64),
                               t.values.to(torch.float32), (t.nnz,))
            for name, t in sent.tensors.items()}
    if compact:
        return encode_compact(SparseUpdate(flat, sent.sequence), grid_coding=True)
    return encode_update(SparseUpdate(flat, sent.sequence), grid_coding=True)


def decode_shared(data: bytes | bytearray | memoryview, masks: Mapping[str, np.ndarray],
                  shapes: Mapping[str, tuple[int, ...]]) -> SparseUpdate:
    """A client's shared update for ``masks``, signs (:func:`decode_signs`) or values
    (:func:`encode_values`, either message), told apart by the magic; every defect is a
    DecodeError.

    Values must carry exactly the tensors of ``masks``, each a flat vector of as many finite
    values as its set holds.
    """
    view = as_view(data)
    if bytes(view[:4]) == SIGN_MAGIC:
        return decode_signs(view, masks, shapes)
    bound = max((len(m) for m in masks.values()), default=0)
    if bytes(view[:4]) == COMPACT_MAGIC:
        flat = decode_compact(view, layout_of({n: (len(m),) for n, m in masks.items()}),
                              max_numel=max(bound, 1))
    else:
        flat = decode_update(view, max_numel=max(bound, 1))
    out: dict[str, SparseTensor] = {}
    for name, t in flat.tensors.items():
        if name not in masks:
            raise DecodeError(f"values for {name!r}, which had no shared index set this round")
        k = len(masks[name])
        if tuple(t.shape) != (k,) or t.nnz != k:
            raise DecodeError(f"{t.nnz} values of shape {tuple(t.shape)} for {name!r}, its index "
                              f"set holds {k}")
        values = torch.zeros(k, dtype=torch.float32)
        values[t.indices] = t.values.to(torch.float32)
        out[name] = SparseTensor(torch.from_numpy(np.asarray(masks[name], dtype=np.int64)),
                                 values, tuple(shapes[name]))
    missing = set(masks) - set(out)
    if missing:
        raise DecodeError(f"no values for {sorted(missing)}")
    return SparseUpdate(out, flat.sequence)


def encode_rank_request(counts: Mapping[str, int], numels: Mapping[str, int], sequence: int,
                        initial_on_grid: bool, explore: Mapping[str, int] | None = None) -> bytes:
    """The downlink bytes of sets ranked by displacement (``dgc.shared_rank``): per tensor
    only how many entries its set holds (and with ``explore``, how many of them are drawn at
    random); the client ranks the model it holds against version 0 (``initial_on_grid``:
    rounded with ``dgc.int8_grid.round_initial``) as the server did
    (:func:`dgc.signs.planner.displacement_masks`)."""
    flags = int(initial_on_grid) | (_RANK_EXPLORE_BIT if explore else 0)
    parts = [RANK_PREAMBLE.pack(sequence, len(counts)), _RANK_FLAGS.pack(flags)]
    for name, k in counts.items():
        parts += [name_bytes(name), _RANK_TENSOR.pack(int(numels[name]), int(k))]
        if explore:
            parts.append(_RANK_EXPLORE.pack(int(explore.get(name, 0))))
    return seal(parts)


def decode_rank_request(data: bytes | bytearray | memoryview, numels: Mapping[str, int],
                        ) -> tuple[int, dict[str, int], bool, dict[str, int]]:
    """``(sequence, counts, initial_on_grid, explore)`` from :func:`encode_rank_request` bytes
    (``explore`` empty when none is drawn at random); every defect (a tensor not of ``numels``
    or of another size, a count of 0 or above its size, more drawn than the count, a tensor
    twice, unknown flags) is a DecodeError."""
    view = as_view(data)
    sequence, count = RANK_PREAMBLE.open(view)
    end = crc_offset(view)
    check_crc(view, end)
    pos = RANK_PREAMBLE.size
    (flags,) = read(_RANK_FLAGS, view, pos, end, "rank request flags")
    if flags & ~(1 | _RANK_EXPLORE_BIT):
        raise DecodeError(f"rank request flags {flags:#x}: only bits 0 and 1 are defined")
    pos += _RANK_FLAGS.size
    counts: dict[str, int] = {}
    explore: dict[str, int] = {}
    for _ in range(count):
        name, pos = read_name(view, pos, end, "ranked set name")
        numel, k = read(_RANK_TENSOR, view, pos, end, f"ranked set header of {name!r}")
        pos += _RANK_TENSOR.size
        if name in counts:
            raise DecodeError(f"ranked set of {name!r} appears twice")
        if numels.get(name) != numel:
            raise DecodeError(f"ranked set of {name!r} is for {numel} entries, expected "
                              f"{numels.get(name)}")
        if not 0 < k <= numel:
            raise DecodeError(f"ranked set of {name!r} holds {k} of {numel} entries")
        counts[name] = int(k)
        if flags & _RANK_EXPLORE_BIT:
            (drawn,) = read(_RANK_EXPLORE, view, pos, end, f"ranked set draw of {name!r}")
            pos += _RANK_EXPLORE.size
            if drawn > k:
                raise DecodeError(f"ranked set of {name!r} draws {drawn} of its {k} entries "
                                  f"at random; expected at most {k}")
            explore[name] = int(drawn)
    check_end(view, pos, end)
    return sequence, counts, bool(flags & 1), explore
