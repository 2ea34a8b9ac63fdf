"""Index codings of the wire format: Golomb-Rice on gaps, bitmap and raw uint32, vectorized numpy.

Every function here works on a sorted, unique, flat ``int64`` index array and a tensor size
``numel``; encoders return the index section's bytes, decoders take them back and raise
:class:`IndexCodingError` with a specific reason when the bytes are not a canonical encoding.
No function loops in Python over indices: the unary parts are placed by cumulative bit positions
and found again with ``np.flatnonzero``; the fixed-width remainders are moved one bit plane at a
time (at most 62 planes).

Bit order everywhere is least-significant-bit first: bit ``k`` of a section is bit ``k % 8``
(value ``1 << (k % 8)``) of byte ``k // 8``. ``docs/wire.md`` specifies the layout byte by byte.
"""

from __future__ import annotations

import math

import numpy as np

#: Largest Rice parameter the format allows (remainders then fit an int64 with room to spare).
MAX_RICE_PARAMETER = 62

#: Largest tensor size the format allows; keeps every gap and index computation inside int64.
MAX_NUMEL = 1 << 62

_LOG_GOLDEN_CONJUGATE = math.log((math.sqrt(5.0) - 1.0) / 2.0)  # log(phi - 1)


class IndexCodingError(ValueError):
    """An index section is not a canonical encoding; ``wire.decode`` raises it as DecodeError."""


# ---------------------------------------------------------------------------------------------
# Golomb-Rice on gaps
# ---------------------------------------------------------------------------------------------

def gaps_of(indices: np.ndarray) -> np.ndarray:
    """Gaps minus one of sorted unique indices: ``g[0] = i[0]``, ``g[j] = i[j] - i[j-1] - 1``."""
    gaps = np.empty_like(indices)
    if indices.size:
        gaps[0] = indices[0]
        np.subtract(indices[1:], indices[:-1], out=gaps[1:])
        gaps[1:] -= 1
    return gaps


def rice_parameter_estimate(count: int, numel: int) -> int:
    """The Rice parameter for uniform random indices at density ``q = count / numel``.

    ``b* = 1 + floor(log2(log(phi - 1) / log(1 - q)))`` (phi the golden ratio; Sattler et al.,
    Sparse Ternary Compression), clamped to ``[0, MAX_RICE_PARAMETER]``; 0 for an empty or full
    selection, where there are no gaps to code.
    """
    if count <= 0 or count >= numel:
        return 0
    q = count / numel
    ratio = _LOG_GOLDEN_CONJUGATE / math.log1p(-q)
    b = 1 + math.floor(math.log2(ratio))
    return min(max(b, 0), MAX_RICE_PARAMETER)


def rice_cost_bits(gaps: np.ndarray, b: int) -> int:
    """Exact bits of the Golomb-Rice code of ``gaps`` with parameter ``b`` (both sections)."""
    n = int(gaps.size)
    return n * (b + 1) + int(np.right_shift(gaps, b).sum())


def best_rice_parameter(gaps: np.ndarray, numel: int) -> int:
    """The Rice parameter the reference encoder uses: a descent on the exact cost.

    Start at :func:`rice_parameter_estimate`; step down while the cost does not grow, otherwise
    step up while it strictly shrinks. The cost is convex in ``b``, so this finds the minimum
    (the smallest ``b`` among ties below the start) in a few O(nnz) passes; it also copes with
    indices that are far from uniform (clustered selections), where the estimate is off.
    """
    n = int(gaps.size)
    if n == 0:
        return 0
    b = rice_parameter_estimate(n, numel)
    cost = rice_cost_bits(gaps, b)
    moved_down = False
    while b > 0:
        lower = rice_cost_bits(gaps, b - 1)
        if lower > cost:
            break
        b, cost, moved_down = b - 1, lower, True
    if not moved_down:
        while b < MAX_RICE_PARAMETER:
            higher = rice_cost_bits(gaps, b + 1)
            if higher >= cost:
                break
            b, cost = b + 1, higher
    return b


def rice_section_bytes(count: int, b: int, unary_bits: int) -> int:
    """Bytes of a Golomb-Rice index section: parameter byte, remainder part, unary part."""
    return 1 + (count * b + 7) // 8 + (unary_bits + 7) // 8


def golomb_size(indices: np.ndarray, numel: int) -> tuple[int, int]:
    """``(section_bytes, b)`` of the Golomb-Rice coding the encoder would write."""
    gaps = gaps_of(indices)
    b = best_rice_parameter(gaps, numel)
    unary_bits = int(gaps.size) + int(np.right_shift(gaps, b).sum())
    return rice_section_bytes(int(gaps.size), b, unary_bits), b


def _pack_bit_positions(positions: np.ndarray, nbits: int) -> bytes:
    """Bytes of an ``nbits``-long LSB-first bit string with ones exactly at ``positions``."""
    nbytes = (nbits + 7) // 8
    if positions.size == 0:
        return bytes(nbytes)
    # Several ones can share a byte; their bit values never collide, so a weighted bincount
    # (exact in float64 for sums below 256) ORs them in O(nnz) without materializing nbits.
    byte_values = np.bincount(positions >> 3, weights=np.left_shift(1, positions & 7),
                              minlength=nbytes)
    return byte_values.astype(np.uint8).tobytes()


def _pack_fixed_width(values: np.ndarray, width: int) -> bytes:
    """``values`` (each below ``2**width``) as consecutive ``width``-bit LSB-first fields."""
    n = int(values.size)
    if n == 0 or width == 0:
        return b""
    bits = np.empty((n, width), dtype=np.uint8)
    for t in range(width):  # one pass per bit plane, never per value
        bits[:, t] = np.right_shift(values, t) & 1
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def golomb_encode(indices: np.ndarray, numel: int, b: int | None = None) -> bytes:
    """Golomb-Rice index section: ``[b: u8][remainders: count*b bits][unary: q_j zeros, a one]``.

    ``indices`` must be sorted, unique and inside ``[0, numel)``; ``b`` defaults to
    :func:`best_rice_parameter`.
    """
    gaps = gaps_of(indices)
    if b is None:
        b = best_rice_parameter(gaps, numel)
    if not 0 <= b <= MAX_RICE_PARAMETER:
        raise IndexCodingError(f"Rice parameter {b} outside [0, {MAX_RICE_PARAMETER}]")
    quotients = np.right_shift(gaps, b)
    remainders = gaps & ((1 << b) - 1)
    # The j-th unary code ends with a one at bit sum_{i<=j}(q_i + 1) - 1.
    one_positions = np.cumsum(quotients + 1) - 1
    unary_bits = int(one_positions[-1]) + 1 if one_positions.size else 0
    return (bytes([b]) + _pack_fixed_width(remainders, b)
            + _pack_bit_positions(one_positions, unary_bits))


def _read_fixed_width(section: memoryview | bytes, nbytes: int, count: int,
                      width: int) -> np.ndarray:
    """The ``count`` consecutive ``width``-bit LSB-first fields that start at byte 1."""
    if width <= 56:
        # Field j lies in the 8 bytes from byte (j * width) // 8, at bit (j * width) % 8, and
        # ends by bit 63 when width <= 56: gather those 8-byte words (unaligned, little-endian)
        # and shift, rather than one pass per bit plane.
        padded = np.zeros(nbytes + 8, dtype=np.uint8)
        padded[:nbytes] = np.frombuffer(section, dtype=np.uint8, offset=1, count=nbytes)
        words = np.ndarray((nbytes + 1,), dtype="<u8", buffer=padded, strides=(1,))
        starts = np.arange(0, count * width, width, dtype=np.int64)
        fields = np.take(words, starts >> 3) >> (starts & 7).astype(np.uint64)
        fields &= np.uint64((1 << width) - 1)
        return fields.view(np.int64)
    bits = np.unpackbits(np.frombuffer(section, dtype=np.uint8, offset=1, count=nbytes),
                         bitorder="little")
    planes = bits[:count * width].reshape(count, width)
    out = np.zeros(count, dtype=np.int64)
    for t in range(width):  # one pass per bit plane
        out |= np.left_shift(planes[:, t].astype(np.int64), t)
    return out


def golomb_decode(section: memoryview | bytes, count: int, numel: int) -> np.ndarray:
    """Indices from a Golomb-Rice section; rejects anything but the canonical encoding."""
    if len(section) < 1:
        raise IndexCodingError("Golomb-Rice section lacks its parameter byte")
    b = section[0]
    if b > MAX_RICE_PARAMETER:
        raise IndexCodingError(f"Rice parameter {b} above the maximum {MAX_RICE_PARAMETER}")
    remainder_bytes = (count * b + 7) // 8
    if 1 + remainder_bytes > len(section):
        raise IndexCodingError(f"Golomb-Rice section of {len(section)} bytes is shorter than its "
                               f"{remainder_bytes} remainder bytes for {count} indices")
    unary = np.frombuffer(section, dtype=np.uint8, offset=1 + remainder_bytes)
    if count == 0:
        if unary.size:
            raise IndexCodingError(f"{unary.size} unary bytes for zero indices")
        return np.empty(0, dtype=np.int64)
    # Each index needs at least one unary bit: refuse before unpacking anything count-sized.
    if unary.size == 0 or count > 8 * unary.size:
        raise IndexCodingError(f"{unary.size} unary bytes cannot hold {count} codes")
    if unary[-1] == 0:
        raise IndexCodingError("unary part ends with a zero byte (not canonical)")
    # nonzero on a bool view takes numpy's fast path (several times faster than on uint8)
    one_positions = np.unpackbits(unary, bitorder="little").view(bool).nonzero()[0]
    if one_positions.size != count:
        raise IndexCodingError(f"unary part holds {one_positions.size} codes, header says {count}")
    quotients = np.empty(count, dtype=np.int64)
    quotients[0] = one_positions[0]
    np.subtract(one_positions[1:], one_positions[:-1], out=quotients[1:])
    quotients[1:] -= 1
    # Bound the quotients before shifting so that no gap can overflow int64.
    if int(quotients.max()) > (numel - 1) >> b:
        raise IndexCodingError(f"a gap exceeds the tensor size {numel}")
    gaps = np.left_shift(quotients, b, out=quotients)
    if b:
        used_bits = count * b
        if used_bits & 7 and section[remainder_bytes] >> (used_bits & 7):
            # The padding bits are the high bits of the last remainder byte.
            raise IndexCodingError("remainder part has nonzero padding bits")
        gaps |= _read_fixed_width(section, remainder_bytes, count, b)
    if int(gaps.max()) >= numel:
        raise IndexCodingError(f"a gap exceeds the tensor size {numel}")
    # Each term is at most numel <= 2**62; partial sums could only wrap after passing numel,
    # which the strict-increase check below then catches.
    gaps += 1
    indices = np.cumsum(gaps, out=gaps)
    indices -= 1
    if count * numel >= 1 << 63 and not bool(np.all(indices[1:] > indices[:-1])):
        raise IndexCodingError(f"indices run past the tensor size {numel}")
    if int(indices[-1]) >= numel:
        raise IndexCodingError(f"index {int(indices[-1])} out of range for {numel} entries")
    return indices


# ---------------------------------------------------------------------------------------------
# Bitmap and raw uint32
# ---------------------------------------------------------------------------------------------

def bitmap_size(numel: int) -> int:
    """Bytes of a bitmap section: one bit per entry."""
    return (numel + 7) // 8


def bitmap_encode(indices: np.ndarray, numel: int) -> bytes:
    """Bitmap section: bit ``i`` (LSB-first) is one exactly when ``i`` is among the indices."""
    return _pack_bit_positions(indices, numel)


def bitmap_decode(section: memoryview | bytes, count: int, numel: int) -> np.ndarray:
    """Indices from a bitmap section of exactly ``ceil(numel / 8)`` bytes holding ``count`` ones."""
    expected = bitmap_size(numel)
    if len(section) != expected:
        raise IndexCodingError(f"bitmap of {len(section)} bytes, expected {expected} for "
                               f"{numel} entries")
    bits = np.unpackbits(np.frombuffer(section, dtype=np.uint8), bitorder="little")
    if bits[numel:].any():
        raise IndexCodingError("bitmap has nonzero padding bits")
    indices = np.flatnonzero(bits).astype(np.int64, copy=False)
    if indices.size != count:
        raise IndexCodingError(f"bitmap holds {indices.size} indices, header says {count}")
    return indices


def raw_encode(indices: np.ndarray) -> bytes:
    """Raw section: each index as a little-endian uint32."""
    return indices.astype("<u4").tobytes()


def raw_decode(section: memoryview | bytes, count: int, numel: int) -> np.ndarray:
    """Indices from a raw uint32 section; they must be strictly increasing and below ``numel``."""
    if len(section) != 4 * count:
        raise IndexCodingError(f"raw section of {len(section)} bytes, expected {4 * count} for "
                               f"{count} indices")
    indices = np.frombuffer(section, dtype="<u4").astype(np.int64)
    if count:
        if not bool(np.all(indices[1:] > indices[:-1])):
            bad = int(np.flatnonzero(indices[1:] <= indices[:-1])[0]) + 1
            raise IndexCodingError(f"raw index {int(indices[bad])} at position {bad} does not "
                                   f"increase on {int(indices[bad - 1])} (repeated or unsorted)")
        if int(indices[-1]) >= numel:
            raise IndexCodingError(f"raw index {int(indices[-1])} out of range for {numel} "
                                   f"entries")
    return indices


# ---------------------------------------------------------------------------------------------
# Golomb-Rice, many sections at once
# ---------------------------------------------------------------------------------------------

def golomb_decode_many(message: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                       counts: np.ndarray, numels: np.ndarray,
                       offsets: np.ndarray) -> np.ndarray | None:
    """The indices of many Golomb-Rice sections of one message, or None if any is not canonical.

    Section ``s`` lies at ``message[starts[s]:starts[s] + lengths[s]]`` (``message``: a uint8
    array; the others: int64 arrays) and codes ``counts[s]`` indices of a tensor of
    ``numels[s]`` entries; its indices come back shifted by ``offsets[s]`` (the tensor's place
    in a flat vector of all the tensors, increasing with ``s``), all sections' concatenated, as
    int32 if every position fits (below ``2**31``) and int64 otherwise.

    A DGC update has one section per large tensor (54 of 5 to 2,400 indices for ResNet-50), so
    decoding them one by one costs mostly numpy call overhead: here each step is one numpy pass
    over all the sections. The checks are those of :func:`golomb_decode`; on any failure (or
    a Rice parameter above 56, or a section too long for the int64 bounds below) the result is
    None and the caller decodes the sections one by one, which names the error.
    """
    nonempty = counts > 0
    if not nonempty.all():  # sections of no index: only the parameter byte and no unary part
        if not bool(np.all(lengths[~nonempty] == 1)) or int(message[starts[~nonempty]].max(
                initial=0)) > MAX_RICE_PARAMETER:
            return None
        starts, lengths, counts, numels, offsets = (
            a[nonempty] for a in (starts, lengths, counts, numels, offsets))
    if counts.size == 0:
        return np.empty(0, dtype=np.int32)
    # The sections, back to back in 8-byte words with 16 zero bytes after them, so that every
    # remainder can be read from two aligned words.
    section_ends = np.cumsum(lengths)
    packed = np.zeros((int(section_ends[-1]) + 23) // 8 * 8, dtype=np.uint8)
    packed[:int(section_ends[-1])] = np.concatenate(
        [message[a:a + n] for a, n in zip(starts.tolist(), lengths.tolist(), strict=True)])
    starts = section_ends - lengths

    rice = packed[starts].astype(np.int64)
    remainder_bytes = (counts * rice + 7) >> 3  # no overflow: counts <= numel <= 2**62 ...
    unary_lengths = lengths - 1 - remainder_bytes
    unary_starts = starts + 1 + remainder_bytes
    # ... and a section with 2**(58 - rice) unary bytes or more (never in practice) is left to
    # golomb_decode: below that, each section's sum of gaps (unary zeros shifted by rice, plus
    # one remainder below 2**rice per unary one) stays under 2**62, so no sum can wrap.
    padding_bits = ((counts * rice) & 7).astype(np.uint8)
    if (int(rice.max()) > 56 or np.any(unary_lengths <= 0) or np.any(counts > 8 * unary_lengths)
            or np.any(unary_lengths >= np.left_shift(1, 58 - rice))
            or int(offsets[-1]) + int(numels[-1]) > MAX_NUMEL
            or not packed[unary_starts + unary_lengths - 1].all()  # canonical: no zero last byte
            # the padding bits are the high bits of the last remainder byte
            or np.any(np.where(padding_bits, packed[unary_starts - 1] >> padding_bits, 0))):
        return None

    # int32 where the positions fit: half the memory a server keeps per decoded update (and
    # fresh pages cost page faults).
    small = int(offsets[-1]) + int(numels[-1]) <= np.iinfo(np.int32).max
    out = np.empty(int(counts.sum()), dtype=np.int32 if small else np.int64)
    if not _decode_sections(packed, starts, unary_starts, unary_lengths, counts, numels,
                            offsets, rice, out):
        return None
    return out


def _decode_sections(packed: np.ndarray, starts: np.ndarray, unary_starts: np.ndarray,
                     unary_lengths: np.ndarray, counts: np.ndarray, numels: np.ndarray,
                     offsets: np.ndarray, rice: np.ndarray, out: np.ndarray) -> bool:
    """Decode sections whose framing is checked into ``out``; False if one is not canonical."""
    total = out.size
    # Unary parts, concatenated: the ones end the codes; each section must hold counts[s].
    unary = np.concatenate([packed[a:a + n] for a, n in zip(unary_starts.tolist(),
                                                             unary_lengths.tolist(), strict=True)])
    ones = np.unpackbits(unary, bitorder="little").view(bool).nonzero()[0]
    section_bit_starts = 8 * (np.cumsum(unary_lengths) - unary_lengths)
    if ones.size != total or not np.array_equal(
            np.diff(np.searchsorted(ones, section_bit_starts), append=total), counts):
        return False
    firsts = np.cumsum(counts) - counts  # where each section's indices start in out
    # gap + 1 = (quotient << rice) + remainder + 1, and quotient + 1 is the distance between
    # consecutive ones (from the section's start for its first one).
    steps = np.empty(total, dtype=np.int64)
    np.subtract(ones[1:], ones[:-1], out=steps[1:])
    steps[firsts] = ones[firsts] - section_bit_starts + 1
    uniform = bool(np.all(rice == rice[0]))
    if int(rice.max()) <= _NARROW_RICE:
        gaps = _narrow_gaps(packed, starts, counts, firsts, rice, uniform, steps)
    else:
        gaps = _wide_gaps(packed, starts, counts, firsts, rice, uniform, steps, ones)
    # Each section's indices are the running sum of its gaps + 1, minus one: its last index,
    # the sum minus one, must stay below numel (and with it every gap).
    sums = np.add.reduceat(gaps, firsts)
    if np.any(sums > numels):
        return False
    # One running sum over all sections: the first term of each section is shifted so that the sum
    # restarts at that section's offset (minus one, for the extra ones).
    previous_end = np.empty_like(offsets)
    previous_end[0] = 1
    previous_end[1:] = (offsets + sums)[:-1]
    gaps[firsts] += offsets - previous_end
    np.cumsum(gaps, out=out)
    return True


#: Rice parameters up to this one have every remainder inside the 4 bytes from its first byte.
_NARROW_RICE = 25


def _narrow_gaps(packed: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                 firsts: np.ndarray, rice: np.ndarray, uniform: bool,
                 steps: np.ndarray) -> np.ndarray:
    """gap + 1 of every index when no Rice parameter exceeds ``_NARROW_RICE`` (the usual case).

    ``steps`` (quotient + 1 per index, consumed) gives the unary part. A remainder of at most 25
    bits starting at bit ``k`` lies in the little-endian 4-byte word at byte ``k // 8``: one
    gather through an unaligned 4-byte view of ``packed``, about a third cheaper than two
    aligned 8-byte gathers, and a third of the passes over the indices.
    """
    if uniform:  # a scalar broadcasts faster than arrays
        rice_each: np.ndarray | int = int(rice[0])
        mask_each: np.ndarray | np.uint32 = np.uint32((1 << int(rice[0])) - 1)
    else:
        rice_each = np.repeat(rice, counts)
        mask_each = np.repeat(((1 << rice) - 1).astype(np.uint32), counts)
    # The j-th remainder of section s starts at bit 8 * (starts[s] + 1) + j * rice[s]: a running
    # sum of rice per index, restarted at each section's first remainder.
    first_bits = 8 * (starts + 1)
    bit_at = np.repeat(rice, counts)
    bit_at[firsts[0]] = first_bits[0]
    bit_at[firsts[1:]] = first_bits[1:] - (first_bits[:-1] + (counts[:-1] - 1) * rice[:-1])
    np.cumsum(bit_at, out=bit_at)
    words = np.ndarray((packed.size - 3,), dtype="<u4", buffer=packed, strides=(1,))
    shift = np.empty(bit_at.size, dtype=np.uint32)
    np.bitwise_and(bit_at, 7, out=shift, casting="unsafe")
    np.right_shift(bit_at, 3, out=bit_at)
    remainders = np.take(words, bit_at)
    remainders >>= shift
    remainders &= mask_each
    # gap + 1 = (quotient << rice) + remainder + 1 = (steps << rice) + remainder - mask
    steps <<= rice_each
    steps += remainders
    steps -= mask_each
    return steps


def _wide_gaps(packed: np.ndarray, starts: np.ndarray, counts: np.ndarray, firsts: np.ndarray,
               rice: np.ndarray, uniform: bool, steps: np.ndarray,
               ones: np.ndarray) -> np.ndarray:
    """gap + 1 of every index for any Rice parameter up to 56 (``ones`` is reused as scratch)."""
    total = steps.size
    if uniform:  # a scalar broadcasts faster than arrays
        rice_each, mask_each = int(rice[0]), (1 << int(rice[0])) - 1
    else:
        rice_each, mask_each = np.repeat(rice, counts), np.repeat((1 << rice) - 1, counts)

    # Remainders: rice bits each, packed from byte 1 of each section; the j-th of a section
    # starts at bit 8 * (start + 1) + j * rice.
    bit_at = np.arange(total, dtype=np.int64)
    bit_at *= rice_each
    bit_at += np.repeat(8 * (starts + 1) - firsts * rice, counts)
    # Read through the two aligned 8-byte words around the first bit (numpy gathers unaligned
    # 8-byte words several times slower); a shift by 64 gives 0 in numpy.
    words = packed.view("<u8")
    word_at = ones
    np.right_shift(bit_at, 6, out=word_at)
    shift = np.bitwise_and(bit_at, 63, out=bit_at).view(np.uint64)
    low = np.take(words, word_at)
    low >>= shift
    word_at += 1
    high = np.take(words, word_at)
    np.subtract(np.uint64(64), shift, out=shift)
    high <<= shift
    low |= high
    gaps = low.view(np.int64)
    gaps &= mask_each
    gaps -= mask_each
    steps <<= rice_each
    gaps += steps
    return gaps
