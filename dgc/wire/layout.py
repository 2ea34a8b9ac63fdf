"""The update message's layout: magic, version, preamble and tensor-header fields.

::

    message  = magic "FGCU" | version u8 = 1 | flags u8 = 0 | sequence u64 | tensor_count u32
               | tensor * tensor_count | crc32 u32 (zlib CRC-32 of every byte before it)
    tensor   = name_len u16 | name (utf-8) | ndim u8 | dims u64 * ndim | count u64
               | index_coding u8 | value_dtype u8 | index_bytes u64
               | index section (index_bytes) | values

``docs/wire.md`` has the byte-by-byte specification; the index and value sections are
:mod:`dgc.wire.index_codings` and :mod:`dgc.wire.value_codings`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from dgc.wire.framing import CRC, Preamble

MAGIC = b"FGCU"
VERSION = 1
#: The update's preamble after magic and version: flags, sequence, tensor_count.
PREAMBLE = Preamble(MAGIC, VERSION, "BQI")
TENSOR_TAIL = struct.Struct("<QBBQ")  # count, index_coding, value_dtype, index_bytes

#: Bytes of a message that carries no tensors: preamble plus checksum.
EMPTY_MESSAGE_BYTES = PREAMBLE.size + CRC.size


@dataclass
class TensorRecord:
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
    # GRID_RICE_CODED, GRID_NONZERO_CODED: scale, then the int8s Rice-coded
    values_length: int = 0  # bytes of the value section
