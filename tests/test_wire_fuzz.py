"""Property and fuzz tests of dgc.wire: random updates round trip, bad bytes raise DecodeError."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgc import DecodeError, SparseTensor, SparseUpdate, decode, decode_many, encode
from dgc.wire import MAX_NUMEL

RAW_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
FUZZ = settings(max_examples=200, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def sparse_tensors(draw) -> SparseTensor:
    shape = tuple(draw(st.one_of(
        st.lists(st.integers(0, 6), max_size=4),                    # small, often empty dims
        st.lists(st.integers(1, 3000), min_size=1, max_size=1),     # flat layers
        st.just([2**20, 2**21]),                                    # numel beyond uint32
    )))
    numel = math.prod(shape)
    dtype = draw(st.sampled_from(list(RAW_VIEW)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    max_count = min(numel, 400)
    count = draw(st.integers(0, max_count))
    if draw(st.booleans()) and numel <= 400:
        count = numel  # dense tensors take the 'all' coding
    if numel <= 10**6:
        indices = np.sort(rng.choice(numel, count, replace=False))
    else:  # choice() without replacement would build a 2**41 permutation
        indices = np.unique(rng.integers(0, numel, count))
        count = indices.size
    # Values from raw bits, so subnormals, signed zeros and extremes all appear; NaN/Inf dropped.
    bits = rng.integers(0, 2**31, count, dtype=np.int64)
    if dtype is torch.float32:
        raw = torch.from_numpy((bits - 2**30).astype(np.int32)).view(torch.float32)
    else:
        raw = torch.from_numpy(((bits % 2**16) - 2**15).astype(np.int16)).view(dtype)
    values = torch.where(torch.isfinite(raw), raw, torch.zeros((), dtype=dtype))
    return SparseTensor(torch.from_numpy(indices.astype(np.int64)), values, shape)


@st.composite
def sparse_updates(draw) -> SparseUpdate:
    names = draw(st.lists(st.text(max_size=12), max_size=4, unique=True))
    tensors = {name: draw(sparse_tensors()) for name in names}
    return SparseUpdate(tensors, draw(st.integers(0, 2**64 - 1)))


def assert_same(a: SparseUpdate, b: SparseUpdate) -> None:
    assert a.sequence == b.sequence
    assert list(a.tensors) == list(b.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert u.shape == t.shape
        assert torch.equal(u.indices, t.indices)
        view = RAW_VIEW[t.values.dtype]
        assert u.values.dtype == t.values.dtype
        assert torch.equal(u.values.view(view), t.values.view(view))


def assert_valid(update: SparseUpdate) -> None:
    """What every successfully decoded update must satisfy."""
    for t in update.tensors.values():
        idx = t.indices
        assert idx.dtype == torch.int64
        if idx.numel():
            assert int(idx[0]) >= 0 and int(idx[-1]) < t.numel
            assert bool((idx[1:] > idx[:-1]).all())
        assert bool(torch.isfinite(t.values).all())


def decode_or_reject(data: bytes) -> SparseUpdate | None:
    """Decode; ``None`` for a DecodeError. Any other exception fails the test."""
    try:
        update = decode(data, max_numel=MAX_NUMEL)
    except DecodeError:
        return None
    assert_valid(update)
    return update


def with_fixed_crc(data: bytes | bytearray) -> bytes:
    """``data`` with its trailing checksum recomputed, so mutations reach the inner checks."""
    body = bytes(data[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


@FUZZ
@given(sparse_updates(), st.sampled_from(["auto", "golomb", "bitmap", "raw"]))
def test_random_updates_round_trip(update: SparseUpdate, coding: str) -> None:
    if coding == "bitmap" and any(t.numel > 10**6 for t in update.tensors.values()):
        coding = "golomb"  # a 2**41-bit bitmap is valid but 256 GiB
    if coding == "raw" and any(t.numel > 2**32 for t in update.tensors.values()):
        coding = "auto"
    data = encode(update, coding)
    assert_same(update, decode(data, max_numel=MAX_NUMEL))


def _reference_messages() -> list[bytes]:
    """Small valid messages covering every coding and dtype, for exhaustive mutation."""
    def t(indices, shape, dtype):
        vals = torch.linspace(-2, 2, len(indices)).to(dtype)
        return SparseTensor(torch.tensor(indices, dtype=torch.int64), vals, shape)
    mixed = SparseUpdate({
        "g": t([1, 2, 9, 40, 63], (8, 8), torch.float16),
        "d": t([0, 1, 2], (3,), torch.bfloat16),
        "e": t([], (0,), torch.float32),
    }, 3)
    return [
        encode(mixed, "auto"),
        encode(SparseUpdate({"b": t([0, 5, 7, 11], (12,), torch.float32)}, 1), "bitmap"),
        encode(SparseUpdate({"r": t([3, 17], (2, 10), torch.bfloat16)}, 2), "raw"),
        encode(SparseUpdate({"g": t([0, 5, 200, 201, 999], (1000,), torch.float16)}, 4),
               "golomb"),
    ]


@pytest.mark.parametrize("which", range(4))
def test_every_single_byte_mutation_is_rejected_or_valid(which: int) -> None:
    data = _reference_messages()[which]
    outcomes = {"rejected": 0, "valid": 0}
    for pos in range(len(data)):
        for xor in (0x01, 0x02, 0x10, 0x80, 0xFF):
            mutated = bytearray(data)
            mutated[pos] ^= xor
            # As sent: the checksum must catch every single-byte change.
            assert decode_or_reject(bytes(mutated)) is None
            # With the checksum fixed, the inner checks must hold on their own.
            result = decode_or_reject(with_fixed_crc(mutated)) if pos < len(data) - 4 else None
            outcomes["rejected" if result is None else "valid"] += 1
    assert outcomes["rejected"] > 0 and outcomes["valid"] > 0


def test_every_truncation_of_every_reference_message_is_rejected() -> None:
    for data in _reference_messages():
        for cut in range(len(data)):
            assert decode_or_reject(data[:cut]) is None
            if cut >= 4:
                assert decode_or_reject(with_fixed_crc(data[:cut])) is None


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_are_rejected(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode(data, max_numel=MAX_NUMEL)


@FUZZ
@given(st.binary(max_size=200), st.integers(0, 3))
def test_random_bodies_behind_a_valid_preamble_never_escape(tail: bytes, count: int) -> None:
    body = b"FGCU\x01\x00" + (7).to_bytes(8, "little") + count.to_bytes(4, "little") + tail
    decode_or_reject(body + struct.pack("<I", zlib.crc32(body)))


@FUZZ
@given(st.data())
def test_random_mutations_of_random_updates_never_escape(data) -> None:
    update = data.draw(sparse_updates())
    message = bytearray(encode(update, data.draw(st.sampled_from(["auto", "golomb", "raw"]))
                               if all(t.numel <= 2**32 for t in update.tensors.values())
                               else "golomb"))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(message) - 1))
        message[pos] = data.draw(st.integers(0, 255))
    decode_or_reject(with_fixed_crc(message))


@pytest.mark.parametrize("which", range(4))
def test_decode_many_after_a_valid_message_decodes_every_mutation_like_decode(which: int) -> None:
    # The valid message first makes decode_many read the mutated one against its headers: a
    # mutation must be accepted or refused exactly as decode does, with the same reason.
    data = _reference_messages()[which]
    for pos in range(len(data) - 4):
        for xor in (0x01, 0x02, 0x10, 0x80, 0xFF):
            mutated = bytearray(data)
            mutated[pos] ^= xor
            fixed = with_fixed_crc(mutated)
            first, got = decode_many([data, fixed], max_numel=MAX_NUMEL)
            assert isinstance(first, SparseUpdate)
            try:
                want = decode(fixed, max_numel=MAX_NUMEL)
            except DecodeError as e:
                assert isinstance(got, DecodeError) and str(got) == str(e), (pos, xor)
                continue
            assert isinstance(got, SparseUpdate), (pos, xor)
            assert_same(want, got)
