"""Value codings of the update message: plain raw bits, sign-coded and grid-coded values.

Value dtypes: 0 float32, 1 float16, 2 bfloat16, carried as their raw bits. A value dtype with
the high bit set (``SIGN_CODED``: 128, 129, 130) marks a sign-coded tensor, whose values are all
``+scale`` or ``-scale``: its value section is the scale (raw bits of the base dtype) and one
sign bit per value (``size + ceil(count / 8)`` bytes), what ternary DGC sends. Value dtypes 64
and 65 (``GRID_CODED``, ``GRID_RICE_CODED``, float32 only) mark a grid-coded tensor, whose values
are all ``q * scale`` with ``q`` an int8 and ``scale`` a power of two: its value section is the
scale (float32 bits) and one signed byte per value (``4 + count`` bytes), or the scale and the
zigzagged ``q`` as the gaps of a Golomb-Rice section; what a server's int8 broadcast sends.
Value dtype 66 (``GRID_NONZERO_CODED``) is the Rice-coded grid of values none of which is zero
(``q`` folded without a code for 0: 1, -1, 2, -2 -> 0, 1, 2, 3): differences of a catch-up patch
(``downlink_context``), written only when asked (``nonzero_grid``).
``docs/wire.md`` section 5 specifies them.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import torch

from dgc import golomb
from dgc.errors import DecodeError
from dgc.wire.layout import TensorRecord

#: Value dtype ids and their raw-bit representation on the wire.
VALUE_DTYPE_IDS: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

DTYPES_BY_ID = {v: k for k, v in VALUE_DTYPE_IDS.items()}
#: Set in the value dtype byte of a sign-coded tensor (values +-scale; ``docs/wire.md`` 5).
SIGN_CODED = 0x80
#: The value dtype id of a grid-coded tensor (float32 values int8 * power-of-two scale; 5).
GRID_CODED = 0x40
#: The same with the int8s Rice-coded, zigzagged, as the gaps of a Golomb-Rice section (5).
GRID_RICE_CODED = 0x41
#: The same for values none of which is zero, ``q`` folded without a code for 0 (5).
GRID_NONZERO_CODED = 0x42
GRID_CODINGS = (GRID_CODED, GRID_RICE_CODED, GRID_NONZERO_CODED)
#: The Rice-coded grid sections (scale, span, Rice bytes, then the section).
GRID_RICE_CODINGS = (GRID_RICE_CODED, GRID_NONZERO_CODED)

#: Head of a Rice-coded grid section: scale, numel of the gap sequence, Golomb-Rice bytes.
GRID_RICE_HEAD = struct.Struct("<fQQ")
#: A grid-coded scale is 2**e with e in [-126, 120]: every int8 multiple is exact and finite.
GRID_EXPONENTS = (-126, 120)
RAW_BITS = {  # wire dtype, torch view dtype, exponent mask (all ones = Inf or NaN)
    torch.float32: ("<u4", torch.int32, 0x7F800000),
    torch.float16: ("<u2", torch.int16, 0x7C00),
    torch.bfloat16: ("<u2", torch.int16, 0x7F80),
}
VALUE_SIZE_BY_ID = {i: RAW_BITS[d][1].itemsize for i, d in DTYPES_BY_ID.items()}


def raw_values(values: torch.Tensor) -> np.ndarray:
    """The raw bits of ``values`` as the wire's little-endian unsigned integers."""
    wire_dtype, view_dtype, _ = RAW_BITS[values.dtype]
    raw = values.detach().cpu().contiguous().view(view_dtype).numpy()
    return raw.astype(wire_dtype, copy=False)


def sign_scale(raw: np.ndarray) -> int | None:
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
    if not GRID_EXPONENTS[0] <= exponent <= GRID_EXPONENTS[1]:
        return None
    scale = np.float32(math.ldexp(1.0, exponent))
    q = np.rint(v / scale).astype(np.int8)  # off-grid values are caught below
    # What a decoder computes, bit for bit (this also turns away -0.0: 0 * scale is +0.0)
    if not np.array_equal((q.astype(np.float32) * scale).view(np.uint32), v.view(np.uint32)):
        return None
    nonzero = q[q != 0]
    if nonzero.size:  # the common trailing zero bits of the q: at most 6
        low = int(np.bitwise_or.reduce(nonzero.astype(np.int64) & -nonzero.astype(np.int64)))
        shift = min((low & -low).bit_length() - 1, GRID_EXPONENTS[1] - exponent)
        if shift > 0:
            q = q >> shift
            scale = np.float32(math.ldexp(1.0, exponent + shift))
    return float(scale), q


def _zigzag_positions(q: np.ndarray) -> np.ndarray:
    """The increasing sequence whose Golomb gaps are the zigzagged ``q`` (0, -1, 1, -2, ... ->
    0, 1, 2, 3, ...): ``cumsum(zigzag(q) + 1) - 1``."""
    q64 = q.astype(np.int64)
    return np.cumsum(np.where(q64 >= 0, 2 * q64, -2 * q64 - 1) + 1) - 1


def _nonzero_positions(q: np.ndarray) -> np.ndarray:
    """The increasing sequence whose Golomb gaps are the non-zero ``q`` folded (1, -1, 2, -2,
    ... -> 0, 1, 2, 3, ...)."""
    q64 = q.astype(np.int64)
    return np.cumsum(np.where(q64 > 0, 2 * q64 - 2, -2 * q64 - 1) + 1) - 1


def grid_section(values: torch.Tensor, nonzero: bool = False) -> tuple[int, bytes] | None:
    """``(value dtype id, section)`` of grid values: the scale then one signed byte each
    (GRID_CODED), or, when smaller, the scale and the zigzagged int8s as the gaps of a
    Golomb-Rice section (GRID_RICE_CODED), or with ``nonzero``, when no value is zero and that
    is smaller still, the same with the int8s folded without a code for zero
    (GRID_NONZERO_CODED); None for values off every power-of-two int8 grid."""
    grid = _grid_values(values)
    if grid is None:
        return None
    scale, q = grid
    best = (GRID_CODED, struct.pack("<f", scale) + q.tobytes())
    candidates = [(GRID_RICE_CODED, _zigzag_positions)]
    if nonzero and bool(np.all(q != 0)):
        candidates.append((GRID_NONZERO_CODED, _nonzero_positions))
    for coding, fold in candidates:
        positions = fold(q)
        numel = int(positions[-1]) + 1
        rice_bytes, b = golomb.golomb_size(positions, numel)
        if GRID_RICE_HEAD.size + rice_bytes < len(best[1]):
            best = (coding, GRID_RICE_HEAD.pack(scale, numel, rice_bytes)
                    + golomb.golomb_encode(positions, numel, b))
    return best


def values_section(values: torch.Tensor, sign_coding: bool,
                    grid_coding: bool = False, nonzero_grid: bool = False) -> tuple[int, bytes]:
    """(value dtype id, value section) of one tensor: sign- or grid-coded when asked and
    possible (sign coding first: it is the smaller)."""
    raw = raw_values(values)
    dtype_id = VALUE_DTYPE_IDS[values.dtype]
    scale = sign_scale(raw) if sign_coding else None
    if scale is not None:
        signs = np.packbits((raw >> (8 * raw.dtype.itemsize - 1)).astype(np.uint8),
                            bitorder="little")
        return dtype_id | SIGN_CODED, np.array(scale, dtype=raw.dtype).tobytes() + signs.tobytes()
    grid = grid_section(values, nonzero_grid) if grid_coding else None
    if grid is not None:
        return grid
    return dtype_id, raw.tobytes()


def values_nbytes(dtype: torch.dtype, count: int, coding: int = 0) -> int:
    """Bytes of a value section: ``coding`` is 0 (plain), SIGN_CODED or GRID_CODED (a
    GRID_RICE_CODED section says its own length)."""
    size = RAW_BITS[dtype][1].itemsize
    if coding == SIGN_CODED:
        return size + (count + 7) // 8
    if coding == GRID_CODED:
        return 4 + count
    return count * size


def _decode_signs(data: memoryview, r: TensorRecord) -> np.ndarray:
    """The raw bits of a sign-coded tensor's values: +-scale, checked and canonical."""
    wire_dtype, view_dtype, exponent_mask = RAW_BITS[r.dtype]
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


def _decode_grid(data: memoryview, r: TensorRecord) -> torch.Tensor:
    """The values of a grid-coded tensor, ``q * scale`` (exact), the scale and, Rice-coded,
    the int8s checked."""
    (scale,) = struct.unpack_from("<f", data, r.values_start)
    mantissa, exponent = math.frexp(scale) if math.isfinite(scale) else (0.0, 0)
    if mantissa != 0.5 or not GRID_EXPONENTS[0] <= exponent - 1 <= GRID_EXPONENTS[1]:
        raise DecodeError(f"tensor {r.name!r}: grid-coded scale {scale!r} is not a power of two "
                          f"2**e with e in [{GRID_EXPONENTS[0]}, {GRID_EXPONENTS[1]}]")
    if r.value_coding == GRID_CODED:
        q = np.frombuffer(data, dtype=np.int8, count=r.count, offset=r.values_start + 4)
        return torch.from_numpy(q.astype(np.float32) * np.float32(scale))
    _, numel, rice_bytes = GRID_RICE_HEAD.unpack_from(data, r.values_start)
    # Each zigzagged int8 is at most 255, so the gap sequence spans at most 256 per value.
    if numel > min(256 * r.count, golomb.MAX_NUMEL):
        raise DecodeError(f"tensor {r.name!r}: grid-coded values (Rice) claim a span of {numel}, "
                          f"above 256 per value")
    start = r.values_start + GRID_RICE_HEAD.size
    try:
        positions = golomb.golomb_decode(data[start:start + rice_bytes], r.count, numel)
    except golomb.IndexCodingError as e:
        raise DecodeError(f"tensor {r.name!r}: grid-coded values (Rice): {e}") from e
    z = np.diff(positions.astype(np.int64), prepend=-1) - 1
    if (int(positions[-1]) + 1 if r.count else 0) != numel or (r.count and int(z.max()) > 255):
        raise DecodeError(f"tensor {r.name!r}: grid-coded values (Rice) are not canonical: a "
                          f"span other than the gaps' or a value beyond int8")
    if r.value_coding == GRID_NONZERO_CODED:
        if r.count and int(z.max()) > 253:
            raise DecodeError(f"tensor {r.name!r}: grid-coded non-zero values (Rice) hold a "
                              f"folded value {int(z.max())} above 253 (|q| <= 127)")
        q = np.where(z & 1, -(z >> 1) - 1, (z >> 1) + 1)  # un-fold: 0, 1, 2 -> 1, -1, 2
        return torch.from_numpy(q.astype(np.float32) * np.float32(scale))
    q = (z >> 1) ^ -(z & 1)  # un-zigzag
    return torch.from_numpy(q.astype(np.float32) * np.float32(scale))


def decode_values(data: memoryview, r: TensorRecord) -> torch.Tensor:
    """The values of one tensor, checked (finite; sign and grid sections canonical)."""
    wire_dtype, view_dtype, exponent_mask = RAW_BITS[r.dtype]
    if r.value_coding in GRID_CODINGS:
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
