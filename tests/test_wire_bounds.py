"""Every decoder checks a count against the bytes that must carry it before it allocates.

A hostile message may claim any count in a few bytes. These tests feed such claims to the four
decoders of fedgc payloads (``decode``, ``decode_many``, ``decode_mask``, ``decode_signs``) and
check that each is refused as a DecodeError, with a peak of traced memory (numpy reports its
allocations to ``tracemalloc``) far below what the claim would cost, and that each decoder
needs a bound from its caller.
"""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import torch

from dgc import DecodeError, SparseTensor, SparseUpdate, decode, decode_many, encode
from dgc.signs import decode_mask, decode_signs, encode_mask

#: A decode that allocates for the claimed count takes 2 GiB (2**28 int64 indices) or more.
PEAK_LIMIT_BYTES = 1 << 20

GRID_RICE_CODED = 0x41


def hostile_all_message(entries: int) -> bytes:
    """74 bytes: one tensor of ``entries`` entries, index coding 'all', whose grid values are
    Rice-coded in a 2-byte section (which can carry 8 values)."""
    name = b"w"
    record = (struct.pack("<H", len(name)) + name + struct.pack("<BQ", 1, entries)
              + struct.pack("<QBBQ", entries, 0, GRID_RICE_CODED, 0)
              + struct.pack("<fQQ", 1.0, entries, 2) + b"\x00\x01")
    body = b"FGCU" + struct.pack("<BBQI", 1, 0, 0, 1) + record
    return body + struct.pack("<I", zlib.crc32(body))


def peak_bytes(call: Callable[[], object]) -> tuple[object, int]:
    """``call()``'s result (or the exception it raised) and the peak of traced memory."""
    tracemalloc.start()
    try:
        try:
            result: object = call()
        except Exception as e:  # noqa: BLE001 - the caller asserts on what came back
            result = e
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("entries", [2**28, 2**32])
def test_a_74_byte_message_claiming_huge_counts_is_refused_without_allocating(
        entries: int) -> None:
    data = hostile_all_message(entries)
    assert len(data) == 74
    result, peak = peak_bytes(lambda: decode(data, max_numel=entries))
    assert isinstance(result, DecodeError), result
    assert f"1 unary bytes cannot hold {entries} codes" in str(result)
    assert peak < PEAK_LIMIT_BYTES


def test_decode_many_keeps_the_other_replies_of_the_batch() -> None:
    g = torch.Generator().manual_seed(3)
    good = [encode(SparseUpdate({"w": SparseTensor(torch.tensor([1, 5, 9]),
                                                   torch.randn(3, generator=g), (2**32,))}, s))
            for s in (1, 2)]
    batch = [good[0], hostile_all_message(2**32), good[1]]
    results, peak = peak_bytes(lambda: decode_many(batch, max_numel=2**32))
    assert isinstance(results, list), results
    assert [type(r).__name__ for r in results] == ["SparseUpdate", "DecodeError", "SparseUpdate"]
    assert [r.sequence for r in results[::2]] == [1, 2]
    assert peak < PEAK_LIMIT_BYTES


def test_decode_mask_rejects_a_count_its_section_cannot_carry() -> None:
    numels = {"w": 2**40}
    data = bytearray(encode_mask({"w": np.array([3, 70])}, numels, 4))
    # The tensor header follows the 17-byte preamble and the name (2 + 1 bytes): numel, count,
    # section bytes. Claim 2**36 indices in the same few bytes.
    struct.pack_into("<Q", data, 17 + 3 + 8, 2**36)
    body = bytes(data[:-4])
    forged = body + struct.pack("<I", zlib.crc32(body))
    result, peak = peak_bytes(lambda: decode_mask(forged, numels))
    assert isinstance(result, DecodeError), result
    assert "remainder bytes for 68719476736 indices" in str(result)
    assert peak < PEAK_LIMIT_BYTES


def test_decode_mask_needs_the_expected_sizes() -> None:
    data = encode_mask({"w": np.array([3, 70])}, {"w": 100}, 4)
    with pytest.raises(TypeError):
        decode_mask(data)  # type: ignore[call-arg]
    with pytest.raises(DecodeError, match="expected 99"):
        decode_mask(data, {"w": 99})


def test_decode_signs_rejects_a_count_its_section_cannot_carry() -> None:
    # 1000 signs, as many as the server's set holds, claimed with a section of 2 bytes.
    mask = np.arange(1000, dtype=np.int64)
    body = (b"FGCS" + struct.pack("<BQI", 1, 5, 1) + struct.pack("<H", 1) + b"w"
            + struct.pack("<Qf", 1000, 1.0) + b"\x00\x00")
    data = body + struct.pack("<I", zlib.crc32(body))
    with pytest.raises(DecodeError, match="run past the end"):
        decode_signs(data, {"w": mask}, {"w": (1000,)})


@pytest.mark.parametrize("call", [decode, lambda d: decode_many([d])])
def test_decode_and_decode_many_need_a_bound(call: Callable[[bytes], object]) -> None:
    data = encode(SparseUpdate({}, 1))
    with pytest.raises(TypeError):
        call(data)
