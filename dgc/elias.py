"""Elias gamma codes of positive integers, vectorized numpy, as QSGD's payload writes them.

Elias gamma writes ``x >= 1`` as ``z = floor(log2 x)`` zeros, then the ``z + 1`` bits of ``x``
from the most significant one down (Elias, "Universal codeword sets and representations of the
integers", IEEE Trans. Inf. Theory 1975): 1 -> ``1``, 2 -> ``010``, 5 -> ``00101``; ``2z + 1``
bits. A run of codes is laid out here in two sections of the same bits, each code's prefix
(``z`` zeros and the leading one) in the first and its ``z`` low bits in the second, so that both
directions are a few array passes and never a Python loop over the integers: the prefixes are
found again by the positions of their ones (as Golomb-Rice's unary parts are, :mod:`dgc.golomb`),
and the low bits by each code's offset. The lengths, and so the bytes, are gamma's exactly.

Bits are numpy arrays of 0/1 ``uint8``, one per bit, in stream order; the caller packs them
least-significant-bit first (``np.packbits(..., bitorder="little")``, docs/wire.md section 1).
"""

from __future__ import annotations

import numpy as np

__all__ = ["GammaError", "gamma_bits", "gamma_length", "read_gamma"]

#: The largest ``floor(log2 x)`` a code may have: x < 2**63 fits an int64.
MAX_EXPONENT = 62


class GammaError(ValueError):
    """Bits that are not a run of gamma codes of the expected count and range."""


def _exponents(values: np.ndarray) -> np.ndarray:
    """``floor(log2 v)`` of positive int64s, exact (float64's log2 corrected by one step)."""
    z = np.minimum(np.floor(np.log2(values.astype(np.float64))).astype(np.int64), MAX_EXPONENT)
    z = np.where(np.left_shift(np.int64(1), z) > values, z - 1, z)
    up = np.minimum(z + 1, MAX_EXPONENT)  # 1 << 63 would wrap; no int64 reaches 2**63
    return np.where((z < MAX_EXPONENT) & (np.left_shift(np.int64(1), up) <= values), z + 1, z)


def gamma_length(values: np.ndarray) -> int:
    """Bits of the gamma codes of ``values`` (positive ints)."""
    values = np.asarray(values, dtype=np.int64)
    return int((2 * _exponents(values) + 1).sum()) if values.size else 0


def gamma_bits(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(prefix bits, low bits) of the gamma codes of ``values`` (ints in ``[1, 2**63)``).

    ValueError for a value below 1.
    """
    values = np.asarray(values, dtype=np.int64).reshape(-1)
    if values.size and int(values.min()) < 1:
        raise ValueError(f"gamma codes positive integers, got {int(values.min())}")
    z = _exponents(values) if values.size else np.zeros(0, dtype=np.int64)
    prefix = np.zeros(int((z + 1).sum()), dtype=np.uint8)
    prefix[np.cumsum(z + 1) - 1] = 1
    total = int(z.sum())
    owner = np.repeat(np.arange(values.size), z)
    offset = np.arange(total) - np.repeat(np.cumsum(z) - z, z)
    shift = z[owner] - 1 - offset  # the low bits, most significant first
    low = (np.right_shift(values[owner], shift) & 1).astype(np.uint8)
    return prefix, low


def read_gamma(bits: np.ndarray, start: int, count: int, largest: int) -> tuple[np.ndarray, int]:
    """``count`` gamma-coded integers laid out as :func:`gamma_bits` writes them from bit
    ``start`` of ``bits``, and the bit after them; each must be at most ``largest``.

    GammaError when the bits run out, a code is longer than ``largest`` allows, or a value
    passes it. Memory follows the bits: nothing is allocated beyond ``count`` integers, and
    ``count`` prefixes need ``count`` one bits that must be present.
    """
    if count == 0:
        return np.zeros(0, dtype=np.int64), start
    longest = min(max(int(largest), 1).bit_length() - 1, MAX_EXPONENT)
    # The prefixes of count codes no longer than largest's fit in this window.
    window = count * (longest + 1)
    ones = np.flatnonzero(bits[start:start + window])
    if ones.size < count:
        if start + window < bits.size:
            raise GammaError(f"a code is longer than values up to {largest} need")
        raise GammaError(f"truncated input: {count} codes, only {ones.size} code prefixes "
                         f"before the end")
    ones = ones[:count]
    z = np.diff(ones, prepend=-1) - 1
    if int(z.max()) > longest:
        raise GammaError(f"a code of {2 * int(z.max()) + 1} bits is longer than values up to "
                         f"{largest} need")
    low_start = start + int(ones[-1]) + 1
    total = int(z.sum())
    if low_start + total > bits.size:
        raise GammaError(f"truncated input: the codes' low bits need {total} bits at bit "
                         f"{low_start}, {bits.size - low_start} left")
    owner = np.repeat(np.arange(count), z)
    begin = np.cumsum(z) - z
    shift = z[owner] - 1 - (np.arange(total) - begin[owner])
    weights = np.left_shift(bits[low_start:low_start + total].astype(np.int64), shift)
    # Sums of each code's weighted bits by differences of a running sum: wraps in int64 never
    # change a difference below 2**63, which every code's value is.
    running = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(weights)])
    values = np.left_shift(np.int64(1), z) + running[begin + z] - running[begin]
    if int(values.max()) > largest:
        raise GammaError(f"a coded value {int(values.max())} is above {largest}")
    return values, low_start + total
