"""The fedgc wire format: a SparseUpdate to bytes and back, versioned, checksummed, validated.

One module per concern: :mod:`~dgc.wire.framing` (preamble, CRC, bounded reader; shared with the
sign channel's payloads), :mod:`~dgc.wire.layout` (the update's header fields),
:mod:`~dgc.wire.index_codings`, :mod:`~dgc.wire.value_codings`, :mod:`~dgc.wire.encoder`,
:mod:`~dgc.wire.decoder` and its fast path :mod:`~dgc.wire.fast`. ``docs/wire.md`` has the
byte-by-byte specification.
"""

from dgc.errors import EncodeError
from dgc.wire.decoder import (
    MAX_NUMEL,
    decode,
    decode_many,
    max_numel_of,
    max_numel_of_message,
    tensor_codings,
)
from dgc.wire.encoder import encode, encoded_size
from dgc.wire.index_codings import INDEX_CODINGS, index_bits
from dgc.wire.layout import EMPTY_MESSAGE_BYTES, MAGIC, VERSION
from dgc.wire.value_codings import (
    GRID_CODED,
    GRID_NONZERO_CODED,
    GRID_RICE_CODED,
    SIGN_CODED,
    VALUE_DTYPE_IDS,
)

__all__ = [
    "EMPTY_MESSAGE_BYTES",
    "GRID_CODED",
    "GRID_NONZERO_CODED",
    "GRID_RICE_CODED",
    "INDEX_CODINGS",
    "MAGIC",
    "MAX_NUMEL",
    "SIGN_CODED",
    "VALUE_DTYPE_IDS",
    "VERSION",
    "EncodeError",
    "decode",
    "decode_many",
    "encode",
    "encoded_size",
    "index_bits",
    "max_numel_of",
    "max_numel_of_message",
    "tensor_codings",
]
