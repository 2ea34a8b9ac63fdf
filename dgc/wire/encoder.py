"""Encoding: a SparseUpdate to the bytes of one update message.

:func:`encode` checks what a decoder would refuse (and raises :class:`~dgc.errors.EncodeError`
naming it), picks each tensor's index coding (:mod:`dgc.wire.index_codings`) and value coding
(:mod:`dgc.wire.value_codings`), and seals the message with its CRC (:mod:`dgc.wire.framing`).
"""

from __future__ import annotations

import numpy as np
import torch

from dgc import golomb
from dgc.errors import EncodeError
from dgc.sparse import SparseTensor, SparseUpdate
from dgc.wire.framing import DIM, MAX_U32, MAX_U64, NAME_LEN, NDIM, name_bytes, seal
from dgc.wire.index_codings import INDEX_CODINGS, choose_coding, encode_indices, index_sizes
from dgc.wire.layout import EMPTY_MESSAGE_BYTES, PREAMBLE, TENSOR_TAIL
from dgc.wire.value_codings import (
    SIGN_CODED,
    grid_section,
    raw_values,
    sign_scale,
    values_nbytes,
    values_section,
)


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


def _tensor_header(name: str, t: SparseTensor, coding: str, index_bytes: int,
                   dtype_id: int) -> bytes:
    name_size = len(name.encode("utf-8"))
    if name_size > 0xFFFF:
        raise EncodeError(f"tensor name of {name_size} utf-8 bytes; the format allows 65535")
    return b"".join([
        name_bytes(name), NDIM.pack(len(t.shape)),
        *(DIM.pack(d) for d in t.shape),
        TENSOR_TAIL.pack(t.nnz, INDEX_CODINGS[coding], dtype_id, index_bytes),
    ])


def _check_update(update: SparseUpdate) -> None:
    if not isinstance(update, SparseUpdate):
        raise EncodeError(f"encode takes a SparseUpdate, got {type(update).__name__}")
    if not 0 <= update.sequence <= MAX_U64:
        raise EncodeError(f"sequence {update.sequence} outside the u64 range [0, 2**64)")
    if len(update.tensors) > MAX_U32:
        raise EncodeError(f"{len(update.tensors)} tensors; the format allows {MAX_U32}")
    for name in update.tensors:
        if not isinstance(name, str):
            raise EncodeError(f"tensor names must be str, got {name!r}")


def encode(update: SparseUpdate, index_coding: str = "auto", sign_coding: bool = False,
           grid_coding: bool = False, nonzero_grid: bool = False) -> bytes:
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
    nonzero_grid
        With ``grid_coding``: a grid tensor none of whose values is zero (a catch-up patch's
        differences) may go Rice-coded without a code for zero (value dtype 66) when that is
        smaller. Off by default: the Java codec does not read it (phones never get it).

    Raises
    ------
    EncodeError
        The update cannot be carried: unsorted/repeated/out-of-range indices, NaN/Inf values, a
        sequence outside u64, a name over 65535 utf-8 bytes, or a coding that cannot carry a
        tensor (``"all"`` on a sparse one, ``"raw"`` beyond 2**32 entries).
    """
    _check_update(update)
    update = update.cpu()  # one device-to-host copy of what is sent, wherever it was selected
    parts = [PREAMBLE.pack(0, update.sequence, len(update.tensors))]
    for name, t in update.tensors.items():
        indices = _check_tensor(name, t)
        coding, rice_b = choose_coding(indices, t.numel, index_coding, name)
        index_section = encode_indices(indices, t.numel, coding, rice_b)
        dtype_id, value_section = values_section(t.values, sign_coding, grid_coding,
                                                 nonzero_grid)
        parts += [_tensor_header(name, t, coding, len(index_section), dtype_id), index_section,
                  value_section]
    return seal(parts)


def encoded_size(update: SparseUpdate, index_coding: str = "auto",
                 sign_coding: bool = False, grid_coding: bool = False,
                 nonzero_grid: bool = False) -> int:
    """``len(encode(update, index_coding, sign_coding, grid_coding, nonzero_grid))``, computed
    without building the bytes."""
    _check_update(update)
    update = update.cpu()
    total = EMPTY_MESSAGE_BYTES
    for name, t in update.tensors.items():
        indices = _check_tensor(name, t)
        coding, _ = choose_coding(indices, t.numel, index_coding, name)
        index_bytes = 0 if coding == "all" else index_sizes(indices, t.numel)[0][coding]
        if sign_coding and sign_scale(raw_values(t.values)) is not None:
            value_bytes = values_nbytes(t.values.dtype, t.nnz, SIGN_CODED)
        elif grid_coding and (grid := grid_section(t.values, nonzero_grid)) is not None:
            value_bytes = len(grid[1])
        else:
            value_bytes = values_nbytes(t.values.dtype, t.nnz)
        total += (NAME_LEN.size + len(name.encode("utf-8")) + NDIM.size
                  + DIM.size * len(t.shape) + TENSOR_TAIL.size + index_bytes + value_bytes)
    return total
