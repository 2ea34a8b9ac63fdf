"""Index codings of the update message: which coding carries a tensor's indices, and how.

The codings (``docs/wire.md`` section 4): 0 ``all`` (count == numel, no index bytes), 1 ``raw``
uint32, 2 ``bitmap``, 3 ``golomb`` (Golomb-Rice on gaps). :mod:`dgc.golomb` holds the bit-level
coders; this module picks a coding per tensor (``"auto"``: the smallest) and dispatches to them.
"""

from __future__ import annotations

import numpy as np
import torch

from dgc import golomb
from dgc.errors import DecodeError, EncodeError
from dgc.wire.framing import MAX_U32
from dgc.wire.layout import TensorRecord

#: Index coding ids, by the name ``encode(index_coding=...)`` takes.
INDEX_CODINGS: dict[str, int] = {"all": 0, "raw": 1, "bitmap": 2, "golomb": 3}

CODING_NAMES = {v: k for k, v in INDEX_CODINGS.items()}
#: Tiebreak among codings of equal size: the cheapest to decode first.
_AUTO_PREFERENCE = ("all", "golomb", "bitmap", "raw")


def index_sizes(indices: np.ndarray, numel: int) -> tuple[dict[str, int], int]:
    """Bytes of the index section under every coding that can carry these indices, and the
    Rice parameter the Golomb-Rice coding would use."""
    count = int(indices.size)
    golomb_bytes, rice_b = golomb.golomb_size(indices, numel)
    sizes = {"golomb": golomb_bytes, "bitmap": golomb.bitmap_size(numel)}
    if count == numel:
        sizes["all"] = 0
    if numel <= MAX_U32 + 1:
        sizes["raw"] = 4 * count
    return sizes, rice_b


def choose_coding(indices: np.ndarray, numel: int, index_coding: str,
                  name: str) -> tuple[str, int | None]:
    """The coding for one tensor, and its Rice parameter when already computed."""
    if index_coding == "auto":
        if indices.size == numel:
            return "all", None
        sizes, rice_b = index_sizes(indices, numel)
        coding = min(sizes, key=lambda c: (sizes[c], _AUTO_PREFERENCE.index(c)))
        return coding, rice_b
    if index_coding not in INDEX_CODINGS:
        raise EncodeError(f"index_coding {index_coding!r} is not one of "
                          f"{['auto', *INDEX_CODINGS]}")
    if index_coding == "all" and indices.size != numel:
        raise EncodeError(f"tensor {name!r}: index_coding 'all' needs every entry, got "
                          f"{indices.size} of {numel}")
    if index_coding == "raw" and numel > MAX_U32 + 1:
        raise EncodeError(f"tensor {name!r}: index_coding 'raw' carries uint32 indices, the "
                          f"tensor has {numel} entries")
    return index_coding, None


def encode_indices(indices: np.ndarray, numel: int, coding: str, rice_b: int | None) -> bytes:
    """The index section of ``indices`` under ``coding`` (from :func:`choose_coding`)."""
    if coding == "all":
        return b""
    if coding == "raw":
        return golomb.raw_encode(indices)
    if coding == "bitmap":
        return golomb.bitmap_encode(indices, numel)
    return golomb.golomb_encode(indices, numel, rice_b)


def index_bits(indices: torch.Tensor | np.ndarray, numel: int, coding: str) -> int:
    """Bits of the index section of one tensor under ``coding`` (``"auto"``: the smallest).

    A measurement helper for benchmarks and the network emulator; ``indices`` must be sorted,
    unique and inside ``[0, numel)``.
    """
    idx = indices.detach().cpu().numpy() if isinstance(indices, torch.Tensor) else indices
    idx = np.asarray(idx, dtype=np.int64)
    sizes, _ = index_sizes(idx, numel)
    if coding == "auto":
        return 8 * min(sizes.values())
    if coding not in sizes:
        raise EncodeError(f"coding {coding!r} cannot carry {idx.size} of {numel} indices; "
                          f"possible: {sorted(sizes)}")
    return 8 * sizes[coding]


ALL_ID = INDEX_CODINGS["all"]
GOLOMB_ID = INDEX_CODINGS["golomb"]

INDEX_DECODERS = {INDEX_CODINGS["raw"]: golomb.raw_decode,
                  INDEX_CODINGS["bitmap"]: golomb.bitmap_decode,
                  INDEX_CODINGS["golomb"]: golomb.golomb_decode}


def decode_indices(data: memoryview, r: TensorRecord) -> np.ndarray:
    """The indices of one tensor of a message whose headers passed the structural checks.

    Every decoder bounds what it allocates by its section's length before allocating; an
    ``all`` section allocates ``numel`` indices, which the caller reads only after the value
    section (whose length bounds the count) has been decoded.
    """
    section = data[r.index_start:r.index_start + r.index_bytes]
    name = CODING_NAMES[r.coding]
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
