"""Round trips, coding choice, golden vectors and the specific rejections of dgc.wire."""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from dgc import DecodeError, SparseTensor, SparseUpdate, decode, decode_many, encode
from dgc import golomb as gr
from dgc.wire import MAX_NUMEL, EncodeError, encoded_size, index_bits, tensor_codings

GOLDEN_DIR = Path(__file__).with_name("golden")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RAW_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
CODINGS = ["auto", "golomb", "bitmap", "raw"]


def random_tensor(numel: int, count: int, dtype: torch.dtype, seed: int,
                  shape: tuple[int, ...] | None = None) -> SparseTensor:
    g = torch.Generator().manual_seed(seed)
    indices = torch.randperm(numel, generator=g)[:count].sort().values
    values = torch.randn(count, generator=g).to(dtype)
    return SparseTensor(indices, values, shape if shape is not None else (numel,))


def assert_same(a: SparseUpdate, b: SparseUpdate) -> None:
    """Equal sequence, names in order, shapes, indices, and value bits."""
    assert a.sequence == b.sequence
    assert list(a.tensors) == list(b.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert u.shape == t.shape
        assert u.values.dtype == t.values.dtype
        assert u.indices.dtype == torch.int64
        assert torch.equal(u.indices, t.indices)
        view = RAW_VIEW[t.values.dtype]
        assert torch.equal(u.values.view(view), t.values.view(view))


def edge_tensors(dtype: torch.dtype) -> dict[str, SparseTensor]:
    """Tensors every coding can carry: sparse, empty, first/last index, one entry of many."""
    def t(indices, values, shape):
        return SparseTensor(torch.tensor(indices, dtype=torch.int64),
                            torch.tensor(values, dtype=torch.float32).to(dtype), shape)
    return {
        "random": random_tensor(5000, 61, dtype, seed=1, shape=(50, 100)),
        "no.selection": t([], [], (7, 3)),
        "zero.size": t([], [], (4, 0)),
        "at.zero": t([0], [1.5], (1000,)),
        "at.last": t([999], [-1.5], (1000,)),
        "both.ends": t([0, 999], [2.0, -0.0], (10, 100)),
        "one.of.one.sparse": t([0], [3.0], (1, 1, 1)),
        "adjacent": t(list(range(40, 72)), [0.5] * 32, (128,)),
    }


# ---------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("coding", CODINGS)
def test_round_trip_every_coding_and_dtype(coding: str, dtype: torch.dtype) -> None:
    update = SparseUpdate(edge_tensors(dtype), sequence=41)
    data = encode(update, coding)
    assert_same(update, decode(data, max_numel=MAX_NUMEL))
    assert len(data) == encoded_size(update, coding)
    if coding != "auto":
        assert set(tensor_codings(data).values()) == {coding}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_dense_tensors_with_all_coding(dtype: torch.dtype) -> None:
    dense = {"bias": torch.randn(33, generator=torch.Generator().manual_seed(3)),
             "scalar": torch.tensor(2.5), "matrix": torch.ones(3, 4)}
    update = SparseUpdate.from_dense(dense, value_dtype=str(dtype).removeprefix("torch."),
                                     sequence=5)
    data = encode(update, "all")
    assert set(tensor_codings(data).values()) == {"all"}
    assert_same(update, decode(data, max_numel=MAX_NUMEL))
    assert decode(data, max_numel=MAX_NUMEL).tensors["scalar"].shape == ()
    # 'auto' sends no index bytes for a dense tensor either.
    assert encode(update, "auto") == data


def test_empty_update_round_trips_for_every_sequence_width() -> None:
    for sequence in (0, 1, 2**32, 2**64 - 1):
        data = encode(SparseUpdate({}, sequence))
        assert len(data) == 22
        assert_same(SparseUpdate({}, sequence), decode(data, max_numel=MAX_NUMEL))


def test_special_values_keep_their_bits() -> None:
    values = {
        torch.float32: [-0.0, 1e-45, -3.4028235e38, 1.1754942e-38],
        torch.float16: [-0.0, 6e-8, 65504.0, -6.1e-5],
        torch.bfloat16: [-0.0, 9.2e-41, 3.38e38, -1.0],
    }
    for dtype, vals in values.items():
        t = SparseTensor(torch.tensor([1, 5, 6, 9]), torch.tensor(vals).to(dtype), (10,))
        for coding in CODINGS:
            assert_same(SparseUpdate({"x": t}), decode(encode(SparseUpdate({"x": t}), coding),
                                                       max_numel=MAX_NUMEL))


def test_large_numel_beyond_uint32() -> None:
    numel = 2**40
    indices = torch.tensor([0, 2**32 - 1, 2**32, 2**39 + 12345, numel - 1])
    t = SparseTensor(indices, torch.arange(5, dtype=torch.float16), (2**20, 2**20))
    update = SparseUpdate({"huge": t}, 9)
    data = encode(update)  # 'auto' must neither pick raw nor build a 128 GiB bitmap
    assert tensor_codings(data) == {"huge": "golomb"}
    assert len(data) < 200
    assert_same(update, decode(data, max_numel=MAX_NUMEL))
    with pytest.raises(EncodeError, match="uint32"):
        encode(update, "raw")


def test_large_dense_like_selection_round_trips() -> None:
    t = random_tensor(200_000, 20_000, torch.bfloat16, seed=4)
    update = SparseUpdate({"w": t})
    for coding in ("golomb", "bitmap", "raw", "auto"):
        assert_same(update, decode(encode(update, coding), max_numel=MAX_NUMEL))


def test_decode_accepts_bytearray_and_memoryview() -> None:
    update = SparseUpdate(edge_tensors(torch.float16), 3)
    data = encode(update)
    assert_same(update, decode(bytearray(data), max_numel=MAX_NUMEL))
    assert_same(update, decode(memoryview(data), max_numel=MAX_NUMEL))
    padded = b"xx" + data + b"yy"
    assert_same(update, decode(memoryview(padded)[2:-2], max_numel=MAX_NUMEL))


def test_decoded_tensors_are_writable_and_independent_of_the_buffer() -> None:
    buffer = bytearray(encode(SparseUpdate({"x": random_tensor(100, 10, torch.float32, 5)})))
    decoded = decode(buffer, max_numel=MAX_NUMEL)
    before = decoded.tensors["x"].values.clone()
    buffer[:] = bytes(len(buffer))
    assert torch.equal(decoded.tensors["x"].values, before)
    decoded.tensors["x"].values.add_(1.0)  # would fail on a read-only numpy view


def test_encode_leaves_the_update_unchanged() -> None:
    update = SparseUpdate(edge_tensors(torch.float32), 8)
    snapshot = {n: (t.indices.clone(), t.values.clone()) for n, t in update.tensors.items()}
    encode(update)
    for n, (i, v) in snapshot.items():
        assert torch.equal(update.tensors[n].indices, i)
        assert torch.equal(update.tensors[n].values, v)


# ---------------------------------------------------------------------------------------------
# Coding choice and sizes
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("numel,count", [(10_000, 1), (10_000, 10), (10_000, 100), (10_000, 300),
                                         (10_000, 400), (10_000, 2_000), (10_000, 9_999),
                                         (64, 0), (7, 7), (1, 1), (3, 0)])
def test_auto_picks_the_smallest_coding(numel: int, count: int) -> None:
    update = SparseUpdate({"w": random_tensor(numel, count, torch.float16, seed=count)})
    auto = encode(update, "auto")
    sizes = {c: len(encode(update, c)) for c in ("golomb", "bitmap", "raw")}
    if count == numel:
        sizes["all"] = len(encode(update, "all"))
    assert len(auto) == min(sizes.values())
    assert tensor_codings(auto)["w"] in {c for c, s in sizes.items() if s == len(auto)}


def test_auto_crosses_from_golomb_to_bitmap_near_the_expected_density() -> None:
    # Rice with b = 1 costs about 0.5 + 1.5 q bits per entry, a bitmap 1: they cross near q = 1/3
    # (with b = 0 Golomb-Rice is a bitmap in disguise plus its parameter byte).
    numel = 100_000
    chosen = {}
    for density in (0.001, 0.01, 0.1, 0.25, 0.45, 0.9):
        update = SparseUpdate({"w": random_tensor(numel, int(density * numel), torch.float16,
                                                  seed=7)})
        chosen[density] = tensor_codings(encode(update))["w"]
    assert chosen == {0.001: "golomb", 0.01: "golomb", 0.1: "golomb", 0.25: "golomb",
                      0.45: "bitmap", 0.9: "bitmap"}


def test_best_rice_parameter_is_the_exact_minimum() -> None:
    rng = np.random.default_rng(0)
    cases = [(100_000, 100), (100_000, 1_000), (100_000, 10_000), (100_000, 50_000)]
    for numel, count in cases:
        indices = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
        gaps = gr.gaps_of(indices)
        costs = [gr.rice_cost_bits(gaps, b) for b in range(gr.MAX_RICE_PARAMETER + 1)]
        assert gr.rice_cost_bits(gaps, gr.best_rice_parameter(gaps, numel)) == min(costs)
    # Clustered indices: the uniform estimate is far off, the descent still finds the minimum.
    clustered = np.concatenate([np.arange(0, 500), np.arange(10**6, 10**6 + 500)]).astype(np.int64)
    gaps = gr.gaps_of(clustered)
    costs = [gr.rice_cost_bits(gaps, b) for b in range(gr.MAX_RICE_PARAMETER + 1)]
    assert gr.rice_cost_bits(gaps, gr.best_rice_parameter(gaps, 2 * 10**6)) == min(costs)


def test_rice_parameter_estimate_follows_the_formula() -> None:
    phi = (1 + math.sqrt(5)) / 2
    for q in (0.3, 0.1, 0.01, 0.001, 1e-6):
        numel = 10**7
        expected = 1 + math.floor(math.log2(math.log(phi - 1) / math.log(1 - q)))
        assert gr.rice_parameter_estimate(round(q * numel), numel) == max(expected, 0)
    assert gr.rice_parameter_estimate(0, 100) == 0
    assert gr.rice_parameter_estimate(100, 100) == 0


def test_golomb_is_near_the_entropy_bound_at_low_density() -> None:
    numel = 1_000_000
    for count in (1_000, 10_000):
        indices = np.sort(np.random.default_rng(count).choice(numel, count, replace=False))
        bound = (math.lgamma(numel + 1) - math.lgamma(count + 1)
                 - math.lgamma(numel - count + 1)) / math.log(2)
        assert index_bits(indices, numel, "golomb") < 1.02 * bound


def test_index_bits_matches_the_encoded_section() -> None:
    t = random_tensor(10_000, 123, torch.float16, seed=2)
    for coding in ("golomb", "bitmap", "raw"):
        header_and_values = len(encode(SparseUpdate({"w": t}), "raw")) - 4 * 123
        assert 8 * (len(encode(SparseUpdate({"w": t}), coding)) - header_and_values) == \
            index_bits(t.indices, 10_000, coding)
    with pytest.raises(EncodeError, match="'all'"):
        index_bits(t.indices, 10_000, "all")


# ---------------------------------------------------------------------------------------------
# Golden vectors
# ---------------------------------------------------------------------------------------------

def _golden_module():
    spec = importlib.util.spec_from_file_location("wire_golden", GOLDEN_DIR / "wire_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_golden_vectors_are_byte_exact() -> None:
    stored = json.loads((GOLDEN_DIR / "wire_v1.json").read_text(encoding="utf-8"))["cases"]
    generator = _golden_module()
    current = generator.golden_records()
    assert [c["case"] for c in stored] == [c["case"] for c in current]
    for want, got in zip(stored, current, strict=True):
        assert got["hex"] == want["hex"], f"wire bytes of golden case {want['case']} changed"
        assert got == want


def test_golden_vectors_decode_to_their_recorded_content() -> None:
    stored = json.loads((GOLDEN_DIR / "wire_v1.json").read_text(encoding="utf-8"))["cases"]
    codings_seen = set()
    dtypes_seen = set()
    for case in stored:
        data = bytes.fromhex(case["hex"])
        decoded = decode(data, max_numel=MAX_NUMEL)
        assert decoded.sequence == case["sequence"]
        assert list(decoded.tensors) == [t["name"] for t in case["tensors"]]
        for t in case["tensors"]:
            got = decoded.tensors[t["name"]]
            assert list(got.shape) == t["shape"]
            assert got.indices.tolist() == t["indices"]
            bits = got.values.view(RAW_VIEW[got.values.dtype]).tolist()
            mask = 2 ** (8 * got.values.element_size()) - 1
            assert [b & mask for b in bits] == t["value_bits"]
            codings_seen.add(t["index_coding"])
            dtypes_seen.add(t["dtype"])
    assert codings_seen == {"all", "raw", "bitmap", "golomb"}
    assert dtypes_seen == {"float32", "float16", "bfloat16"}


def test_golden_empty_update_matches_the_spec_by_hand() -> None:
    body = b"FGCU" + bytes([1, 0]) + (0).to_bytes(8, "little") + (0).to_bytes(4, "little")
    assert encode(SparseUpdate({}, 0)) == body + zlib.crc32(body).to_bytes(4, "little")


# ---------------------------------------------------------------------------------------------
# Messages built by hand from docs/wire.md, to reach each rejection past the checksum
# ---------------------------------------------------------------------------------------------

def tensor_record(name: bytes, shape: list[int], count: int, coding: int, dtype_id: int,
                  index: bytes, values: bytes, index_bytes: int | None = None) -> bytes:
    return (struct.pack("<H", len(name)) + name + struct.pack("<B", len(shape))
            + b"".join(struct.pack("<Q", d) for d in shape)
            + struct.pack("<QBBQ", count, coding, dtype_id,
                          len(index) if index_bytes is None else index_bytes)
            + index + values)


def message(records: list[bytes], sequence: int = 0, magic: bytes = b"FGCU", version: int = 1,
            flags: int = 0, tensor_count: int | None = None, crc: int | None = None) -> bytes:
    body = (magic + struct.pack("<BBQI", version, flags, sequence,
                                len(records) if tensor_count is None else tensor_count)
            + b"".join(records))
    return body + struct.pack("<I", zlib.crc32(body) if crc is None else crc)


def f16(*vals: float) -> bytes:
    return np.array(vals, dtype="<f2").tobytes()


def f32(*vals: float) -> bytes:
    return np.array(vals, dtype="<f4").tobytes()


def tensor_value_dtypes(data: bytes) -> dict[str, int]:
    """How each tensor's values are coded (0 plain, or the sign- or grid-coded id), by name."""
    from dgc.wire.decoder import read_structure

    _, records = read_structure(memoryview(data), None)
    return {r.name: r.value_coding for r in records}


def grid_message(dtype_id: int, section: bytes) -> bytes:
    """A message of one (4, 4) tensor carrying entries 3 and 9 with this value section."""
    return message([tensor_record(b"w", [4, 4], 2, 1, dtype_id, raw_u32(3, 9), section)])


def rice_of(positions: list[int], numel: int | None = None) -> tuple[int, bytes]:
    """(length, bytes) of the Golomb-Rice section of ``positions`` (their last + 1 entries)."""
    section = gr.golomb_encode(np.array(positions, dtype=np.int64),
                                   numel or positions[-1] + 1)
    return len(section), section


def rice_grid(scale: float, span: int, nbytes: int, section: bytes) -> bytes:
    """A Rice-coded grid value section: scale, span, section length, section."""
    return struct.pack("<fQQ", scale, span, nbytes) + section


def raw_u32(*idx: int) -> bytes:
    return np.array(idx, dtype="<u4").tobytes()


def test_hand_built_message_decodes() -> None:
    data = message([tensor_record(b"w", [4, 4], 2, 1, 1, raw_u32(3, 9), f16(1.0, -2.0))], 77)
    decoded = decode(data, max_numel=MAX_NUMEL)
    assert decoded.sequence == 77
    assert decoded.tensors["w"].indices.tolist() == [3, 9]
    assert decoded.tensors["w"].values.tolist() == [1.0, -2.0]
    assert encode(decoded, "raw") == data


GOOD = tensor_record(b"w", [4, 4], 2, 1, 1, raw_u32(3, 9), f16(1.0, -2.0))

REJECTIONS = {
    "short": (b"FGCU\x01", "truncated input: 5 bytes"),
    "magic": (message([GOOD], magic=b"FGCV"), "bad magic"),
    "version": (message([GOOD], version=2), "unsupported version 2"),
    "flags": (message([GOOD], flags=1), "unsupported flags 0x01"),
    "checksum": (message([GOOD], crc=1234), "bad checksum"),
    "tensor_count": (message([GOOD], tensor_count=2), "truncated input"),
    "tensor_count_huge": (message([GOOD], tensor_count=2**32 - 1), "cannot fit"),
    "trailing": (message([GOOD + b"\x00"]), "trailing or oversized input: 1 bytes"),
    "unknown_coding": (message([tensor_record(b"w", [4, 4], 2, 9, 1, raw_u32(3, 9),
                                              f16(1, 2))]), "unknown index coding id 9"),
    "unknown_dtype": (message([tensor_record(b"w", [4, 4], 2, 1, 7, raw_u32(3, 9),
                                             f16(1, 2))]), "unknown value dtype id 7"),
    "count_above_numel": (message([tensor_record(b"w", [2], 3, 1, 1, raw_u32(0, 1, 2),
                                                 f16(1, 2, 3))]), "above its numel 2"),
    "absurd_dim": (message([tensor_record(b"w", [2**63], 0, 1, 1, b"", b"")]),
                   "above the format's limit"),
    "absurd_product": (message([tensor_record(b"w", [2**31, 2**31, 2], 0, 1, 1, b"", b"")]),
                       "above the format's limit"),
    "claims_2_60_dense": (message([tensor_record(b"w", [2**60], 2**60, 0, 1, b"", b"")]),
                          "truncated input"),
    "claims_huge_bitmap": (message([tensor_record(b"w", [2**60], 1, 2, 1, b"\x01", f16(1))]),
                           f"bitmap of 1 bytes, expected {2**57}"),
    "bad_utf8": (message([tensor_record(b"\xff\xfe", [4, 4], 2, 1, 1, raw_u32(3, 9),
                                        f16(1, 2))]), "not valid utf-8"),
    "duplicate_name": (message([GOOD, GOOD]), "duplicate tensor name 'w'"),
    "raw_out_of_range": (message([tensor_record(b"w", [4, 4], 2, 1, 1, raw_u32(3, 16),
                                                f16(1, 2))]), "out of range for 16"),
    "raw_repeated": (message([tensor_record(b"w", [4, 4], 2, 1, 1, raw_u32(3, 3), f16(1, 2))]),
                     "repeated or unsorted"),
    "raw_decreasing": (message([tensor_record(b"w", [4, 4], 2, 1, 1, raw_u32(9, 3),
                                              f16(1, 2))]), "repeated or unsorted"),
    "raw_length": (message([tensor_record(b"w", [4, 4], 2, 1, 1, raw_u32(3, 9, 11),
                                          f16(1, 2))]), "expected 8"),
    "nan": (message([tensor_record(b"w", [4, 4], 2, 1, 1, raw_u32(3, 9),
                                   f16(1.0, float("nan")))]), "value 1 is NaN or Inf"),
    "inf_bf16": (message([tensor_record(b"w", [4, 4], 1, 1, 2, raw_u32(3), b"\x80\x7f")]),
                 "NaN or Inf"),
    "inf_f32": (message([tensor_record(b"w", [4, 4], 1, 1, 0, raw_u32(3),
                                       np.array([-np.inf], "<f4").tobytes())]), "NaN or Inf"),
    "all_sparse": (message([tensor_record(b"w", [4], 2, 0, 1, b"", f16(1, 2))]),
                   "coding 'all' needs count == numel"),
    "bitmap_count": (message([tensor_record(b"w", [10], 2, 2, 1, b"\x07\x00", f16(1, 2))]),
                     "bitmap holds 3 indices, header says 2"),
    "bitmap_padding": (message([tensor_record(b"w", [10], 2, 2, 1, b"\x01\x08", f16(1, 2))]),
                       "nonzero padding bits"),
    "bitmap_length": (message([tensor_record(b"w", [10], 1, 2, 1, b"\x01", f16(1))]),
                      "expected 2 for 10 entries"),
    # Golomb-Rice with b = 1: gap 0 -> remainder 0, unary '1'; gap 5 -> q 2, r 1, unary '001'.
    "golomb_rice_param": (message([tensor_record(b"w", [100], 1, 3, 1, b"\x3f\x01", f16(1))]),
                          "Rice parameter 63"),
    "golomb_count": (message([tensor_record(b"w", [100], 3, 3, 1, b"\x01\x02\x09", f16(1, 2, 3))]),
                     "holds 2 codes, header says 3"),
    "golomb_out_of_range": (message([tensor_record(b"w", [6], 2, 3, 1, b"\x01\x02\x09",
                                                   f16(1, 2))]), "out of range for 6"),
    "golomb_gap_too_big": (message([tensor_record(b"w", [4], 1, 3, 1, b"\x00\x40", f16(1))]),
                           "gap exceeds the tensor size 4"),
    "golomb_trailing_zero_byte": (message([tensor_record(b"w", [100], 2, 3, 1, b"\x01\x02\x09\x00",
                                                         f16(1, 2))]), "not canonical"),
    "golomb_remainder_padding": (message([tensor_record(b"w", [100], 2, 3, 1, b"\x01\x06\x09",
                                                        f16(1, 2))]), "padding bits"),
    "golomb_no_param": (message([tensor_record(b"w", [100], 0, 3, 1, b"", b"")]),
                        "lacks its parameter byte"),
    "golomb_codes_for_nothing": (message([tensor_record(b"w", [100], 0, 3, 1, b"\x00\x01", b"")]),
                                 "unary bytes for zero indices"),
    # Sign-coded (value dtype 128 + base): the scale, then one sign bit per value.
    "signs_unknown_base": (message([tensor_record(b"w", [4, 4], 2, 1, 0x83, raw_u32(3, 9),
                                                  f16(1) + b"\x02")]),
                           "unknown value dtype id 131"),
    "signs_nan_scale": (message([tensor_record(b"w", [4, 4], 2, 1, 0x81, raw_u32(3, 9),
                                               f16(float("nan")) + b"\x02")]),
                        "sign-coded scale is NaN or Inf"),
    "signs_negative_scale": (message([tensor_record(b"w", [4, 4], 2, 1, 0x81, raw_u32(3, 9),
                                                    f16(-1.0) + b"\x02")]),
                             "sign-coded scale must be above zero"),
    "signs_zero_scale": (message([tensor_record(b"w", [4, 4], 2, 1, 0x81, raw_u32(3, 9),
                                                f16(0.0) + b"\x02")]),
                         "sign-coded scale must be above zero"),
    "signs_padding": (message([tensor_record(b"w", [4, 4], 2, 1, 0x81, raw_u32(3, 9),
                                             f16(1.0) + b"\x06")]),
                      "nonzero padding after the last sign bit"),
    "signs_missing": (message([tensor_record(b"w", [4, 4], 2, 1, 0x81, raw_u32(3, 9), f16(1.0))]),
                      "truncated input"),
    # Grid-coded (value dtype 64): a power-of-two float32 scale, then one int8 per value.
    "grid_scale_not_power_of_two": (grid_message(0x40, f32(0.75) + b"\x01\xff"),
                                    "grid-coded scale 0.75 is not a power of two"),
    "grid_scale_negative": (grid_message(0x40, f32(-0.5) + b"\x01\xff"),
                            "grid-coded scale -0.5 is not a power of two"),
    "grid_scale_zero": (grid_message(0x40, f32(0.0) + b"\x01\xff"),
                        "grid-coded scale 0.0 is not a power of two"),
    "grid_scale_nan": (grid_message(0x40, f32(float("nan")) + b"\x01\xff"),
                       "grid-coded scale nan is not a power of two"),
    "grid_scale_too_large": (grid_message(0x40, f32(2.0 ** 121) + b"\x01\xff"),
                             "is not a power of two 2\\*\\*e with e in \\[-126, 120\\]"),
    "grid_scale_subnormal": (grid_message(0x40, f32(2.0 ** -127) + b"\x01\xff"),
                             "is not a power of two"),
    "grid_missing": (grid_message(0x40, f32(0.5) + b"\x01"), "truncated input"),
    "grid_unknown_id": (grid_message(0x43, f32(0.5) + b"\x01\xff"),
                        "unknown value dtype id 67"),
    # Rice-coded grid (value dtype 65): scale, span, Golomb-Rice bytes, then the section.
    "grid_rice_head_missing": (grid_message(0x41, f32(0.5) + b"\x00" * 8),
                               "truncated input"),
    "grid_rice_section_missing": (grid_message(0x41, rice_grid(0.5, 3, 5, b"\x00\x03")),
                                  "truncated input"),
    "grid_rice_bad_scale": (grid_message(0x41, rice_grid(3.0, 3, *rice_of([0, 2]))),
                            "grid-coded scale 3.0 is not a power of two"),
    "grid_rice_span_too_large": (grid_message(0x41, rice_grid(0.5, 513, *rice_of([0, 2]))),
                                 "claim a span of 513, above 256 per value"),
    "grid_rice_span_not_canonical": (grid_message(0x41, rice_grid(0.5, 5, *rice_of([0, 2], 5))),
                                     "are not canonical"),
    "grid_rice_beyond_int8": (grid_message(0x41, rice_grid(0.5, 258, *rice_of([0, 257]))),
                              "are not canonical"),
    "grid_rice_bad_section": (grid_message(0x41, rice_grid(0.5, 3, 2, b"\x3f\x01")),
                              "grid-coded values (Rice): Rice parameter 63"),
}


def test_hand_built_sign_coded_message_decodes() -> None:
    # Scale 1.5 (float16), signs + - : bit 1 set (value 1 negative).
    data = message([tensor_record(b"w", [4, 4], 2, 1, 0x81, raw_u32(3, 9), f16(1.5) + b"\x02")],
                   5)
    t = decode(data, max_numel=MAX_NUMEL).tensors["w"]
    assert t.values.dtype == torch.float16 and t.values.tolist() == [1.5, -1.5]
    assert encode(decode(data, max_numel=MAX_NUMEL), "raw", sign_coding=True) == data
    # Without sign coding the same update takes 2 bytes per value.
    assert len(encode(decode(data, max_numel=MAX_NUMEL), "raw")) == len(data) + 4 - 3


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("count", [2, 3, 8, 9, 1000])
def test_sign_coding_round_trips_bit_for_bit_and_is_smaller(dtype: torch.dtype,
                                                            count: int) -> None:
    g = torch.Generator().manual_seed(count)
    indices = torch.randperm(50_000, generator=g)[:count].sort().values
    signs = torch.where(torch.rand(count, generator=g) < 0.5, -1.0, 1.0)
    scale = torch.tensor(0.0123).to(dtype).float()
    tensors = {"ternary": SparseTensor(indices, (signs * scale).to(dtype), (50, 1000)),
               "plain": random_tensor(3000, 40, dtype, seed=2)}
    update = SparseUpdate(tensors, 9)
    signed, plain = encode(update, sign_coding=True), encode(update)
    assert encoded_size(update, sign_coding=True) == len(signed)
    size = torch.finfo(dtype).bits // 8
    if size + (count + 7) // 8 < count * size:
        assert len(plain) - len(signed) == count * size - (size + (count + 7) // 8)
    else:
        assert signed == plain
    assert_same(decode(signed, max_numel=MAX_NUMEL), update)
    (many,) = decode_many([signed], max_numel=MAX_NUMEL)
    assert_same(many, update)


def test_hand_built_grid_coded_message_decodes() -> None:
    # Scale 2**-3 (float32 0x3e000000), q = 1, -1, 127: values 0.125, -0.125, 15.875.
    data = message([tensor_record(b"w", [4, 4], 3, 1, 0x40, raw_u32(3, 9, 10),
                                  bytes.fromhex("0000003e") + b"\x01\xff\x7f")], 5)
    t = decode(data, max_numel=MAX_NUMEL).tensors["w"]
    assert t.values.dtype == torch.float32 and t.values.tolist() == [0.125, -0.125, 15.875]
    assert encode(decode(data, max_numel=MAX_NUMEL), "raw", grid_coding=True) == data
    # Plain, the same update takes 4 bytes per value.
    assert len(encode(decode(data, max_numel=MAX_NUMEL), "raw")) == len(data) + 12 - 7


@pytest.mark.parametrize("exponent", [-126, -20, 0, 5, 120])
@pytest.mark.parametrize("count", [2, 3, 1000])
def test_grid_coding_round_trips_bit_for_bit_and_is_smaller(exponent: int, count: int) -> None:
    g = torch.Generator().manual_seed(count)
    indices = torch.randperm(50_000, generator=g)[:count].sort().values
    q = torch.randint(-127, 128, (count,), generator=g).float()
    values = q * 2.0 ** exponent + 0.0  # +0.0: q = 0 gives +0.0, never -0.0
    tensors = {"grid": SparseTensor(indices, values, (50, 1000)),
               "plain": random_tensor(3000, 40, torch.float32, seed=2)}
    update = SparseUpdate(tensors, 9)
    gridded, plain = encode(update, grid_coding=True), encode(update)
    assert encoded_size(update, grid_coding=True) == len(gridded)
    assert len(plain) - len(gridded) == 4 * count - (4 + count)
    assert_same(decode(gridded, max_numel=MAX_NUMEL), update)
    (many,) = decode_many([gridded], max_numel=MAX_NUMEL)
    assert_same(many, update)


def test_grid_coding_leaves_values_off_every_int8_grid_plain() -> None:
    cases = {
        "off_grid": [0.5, 0.1],          # 0.1 is no multiple of a power of two that fits
        "too_wide": [1.0, 2.0 ** -8],    # on the grid 2**-8, but 1.0 needs q = 256
        "negative_zero": [0.5, -0.0],    # decodes as +0.0
        "half": [0.5, 0.25],             # grid coding carries float32 values only
        "one_value": [0.5],              # 4 + 1 bytes is not smaller than 4
    }
    for name, vals in cases.items():
        dtype = torch.float16 if name == "half" else torch.float32
        update = SparseUpdate({name: SparseTensor(torch.arange(len(vals)),
                                                  torch.tensor(vals, dtype=dtype), (8,))}, 1)
        assert encode(update, grid_coding=True) == encode(update), name
        assert encoded_size(update, grid_coding=True) == len(encode(update)), name


def test_grid_coding_picks_the_coarsest_grid_the_values_sit_on() -> None:
    # Multiples of 2**-4 up to 1.0: the finest step with |q| <= 127 is 2**-6 (q = 64, -4, 32),
    # but the encoder writes the coarsest they sit on, 2**-4 (q = 16, -1, 8).
    values = torch.tensor([1.0, -0.0625, 0.5], dtype=torch.float32)
    data = encode(SparseUpdate({"w": SparseTensor(torch.arange(3), values, (4,))}, 0),
                  "raw", grid_coding=True)
    section = data[-4 - 7:-4]
    assert section == bytes.fromhex("0000803d") + bytes([16, 256 - 1, 8])
    assert decode(data, max_numel=MAX_NUMEL).tensors["w"].values.tolist() == values.tolist()


def test_hand_built_rice_grid_message_decodes() -> None:
    # q = 0, -1, 1, 2 zigzag to 0, 1, 2, 4: the gaps of positions 0, 2, 5, 10 (span 11).
    nbytes, section = rice_of([0, 2, 5, 10])
    data = message([tensor_record(b"w", [4, 4], 4, 1, 0x41, raw_u32(1, 3, 9, 10),
                                  rice_grid(0.25, 11, nbytes, section))], 2)
    t = decode(data, max_numel=MAX_NUMEL).tensors["w"]
    assert t.values.dtype == torch.float32 and t.values.tolist() == [0.0, -0.25, 0.25, 0.5]
    assert str(t.values[0].item()) == "0.0"  # +0.0


@pytest.mark.parametrize("spread", [1, 5, 20])
def test_rice_grid_coding_round_trips_and_beats_a_byte_per_value(spread: int) -> None:
    """Grid values that cluster near zero (weights on a grid) take fewer than 8 bits each."""
    g = torch.Generator().manual_seed(spread)
    count = 5000
    q = (torch.randn(count, generator=g) * spread).round().clamp(-127, 127)
    q[0] = 127  # the peak sets the grid; the rest are small
    values = q * 2.0 ** -9 + 0.0
    indices = torch.randperm(80_000, generator=g)[:count].sort().values
    update = SparseUpdate({"w": SparseTensor(indices, values, (200, 400))}, 4)
    data, plain = encode(update, grid_coding=True), encode(update)
    assert encoded_size(update, grid_coding=True) == len(data)
    assert_same(decode(data, max_numel=MAX_NUMEL), update)
    value_bits = 8 * (len(data) - (len(plain) - 4 * count)) / count
    assert value_bits < {1: 3.5, 5: 5.5, 20: 7.5}[spread]
    assert decode_many([data],
                       max_numel=MAX_NUMEL)[0].tensors["w"].values.tolist() == values.tolist()


def test_hand_built_nonzero_grid_message_decodes() -> None:
    # q = 1, -1, 2, -2 fold (no code for 0) to 0, 1, 2, 3: the gaps of positions 0, 2, 5, 9.
    nbytes, section = rice_of([0, 2, 5, 9])
    data = message([tensor_record(b"w", [4, 4], 4, 1, 0x42, raw_u32(1, 3, 9, 10),
                                  rice_grid(0.25, 10, nbytes, section))], 2)
    t = decode(data, max_numel=MAX_NUMEL).tensors["w"]
    assert t.values.dtype == torch.float32 and t.values.tolist() == [0.25, -0.25, 0.5, -0.5]
    # four values are smaller a byte each (grid-coded 64) than behind a Rice head
    again = encode(decode(data, max_numel=MAX_NUMEL), "raw", grid_coding=True, nonzero_grid=True)
    assert tensor_value_dtype(again) == 0x40 and len(again) < len(data)
    # a folded value of 254 would be q = 128, beyond what the grid writes: refused
    nbytes, section = rice_of([254])
    bad = message([tensor_record(b"w", [4, 4], 1, 1, 0x42, raw_u32(1),
                                 rice_grid(0.25, 255, nbytes, section))], 2)
    with pytest.raises(DecodeError, match="above 253"):
        decode(bad, max_numel=MAX_NUMEL)


@pytest.mark.parametrize("spread", [1, 5, 20])
def test_nonzero_grid_coding_is_asked_for_smaller_and_round_trips(spread: int) -> None:
    """Differences of a catch-up patch (never zero) take fewer bits without a code for zero;
    written only with nonzero_grid, and never for values with a zero among them."""
    g = torch.Generator().manual_seed(spread)
    count = 5000
    q = (torch.randn(count, generator=g) * spread).round().clamp(-127, 127)
    q[q == 0] = 1
    q[0] = 127
    values = q * 2.0 ** -9 + 0.0
    indices = torch.randperm(80_000, generator=g)[:count].sort().values
    update = SparseUpdate({"w": SparseTensor(indices, values, (200, 400))}, 4)
    folded = encode(update, grid_coding=True, nonzero_grid=True)
    zigzag = encode(update, grid_coding=True)
    assert encoded_size(update, grid_coding=True, nonzero_grid=True) == len(folded)
    assert tensor_value_dtype(folded) == 0x42 and tensor_value_dtype(zigzag) == 0x41
    assert len(folded) < len(zigzag)
    assert_same(decode(folded, max_numel=MAX_NUMEL), update)
    with_zero = values.clone()
    with_zero[1] = 0.0
    zero = SparseUpdate({"w": SparseTensor(indices, with_zero, (200, 400))}, 4)
    assert tensor_value_dtype(encode(zero, grid_coding=True, nonzero_grid=True)) == 0x41


def tensor_value_dtype(data: bytes) -> int:
    """The value dtype byte of a one-tensor message's tensor."""
    from dgc.wire.decoder import read_structure

    (record,) = read_structure(memoryview(data), None)[1]
    return record.value_coding


def test_sign_coding_leaves_tensors_of_several_magnitudes_plain() -> None:
    values = torch.tensor([0.5, -0.5, 0.5, 0.25], dtype=torch.float16)
    zeros = torch.tensor([0.0, -0.0, 0.0, 0.0], dtype=torch.float16)
    update = SparseUpdate({"mixed": SparseTensor(torch.arange(4), values, (8,)),
                           "zeros": SparseTensor(torch.arange(4), zeros, (8,))}, 1)
    assert encode(update, sign_coding=True) == encode(update)


def test_hand_built_golomb_section_is_what_the_encoder_writes() -> None:
    data = message([tensor_record(b"w", [100], 2, 3, 1, b"\x01\x02\x09", f16(1, 2))])
    assert decode(data, max_numel=MAX_NUMEL).tensors["w"].indices.tolist() == [0, 6]
    t = SparseTensor(torch.tensor([0, 6]), torch.tensor([1.0, 2.0]).half(), (100,))
    assert gr.golomb_encode(t.indices.numpy(), 100, 1) == b"\x01\x02\x09"


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_decode_rejects_with_a_specific_reason(case: str) -> None:
    data, reason = REJECTIONS[case]
    with pytest.raises(DecodeError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        decode(data, max_numel=MAX_NUMEL)


def test_max_numel_guards_before_allocating() -> None:
    data = encode(SparseUpdate({"w": random_tensor(1000, 10, torch.float16, 1)}))
    assert decode(data, max_numel=1000).tensors["w"].nnz == 10
    with pytest.raises(DecodeError, match="above max_numel=999"):
        decode(data, max_numel=999)
    huge = message([tensor_record(b"w", [2**40, 2**20], 1, 3, 1, b"\x00\x01", f16(1))])
    with pytest.raises(DecodeError, match="max_numel"):
        decode(huge, max_numel=2**30)
    with pytest.raises(ValueError, match="max_numel"):
        decode(data, max_numel=-1)


def test_every_truncation_and_extension_is_named() -> None:
    data = encode(SparseUpdate(edge_tensors(torch.float16), 6))
    for cut in range(len(data)):
        with pytest.raises(DecodeError, match="truncated input"):
            decode(data[:cut], max_numel=MAX_NUMEL)
    for extra in (b"\x00", b"\x00" * 9, data):
        with pytest.raises(DecodeError, match="trailing or oversized input"):
            decode(data + extra, max_numel=MAX_NUMEL)


def test_decode_rejects_non_bytes() -> None:
    for bad in ("FGCU", None, 12, [1, 2]):
        with pytest.raises(DecodeError, match="decode takes bytes"):
            decode(bad, max_numel=MAX_NUMEL)


# ---------------------------------------------------------------------------------------------
# Encode-side rejections
# ---------------------------------------------------------------------------------------------

def test_encode_rejects_what_decode_would_refuse() -> None:
    def upd(indices, values, shape=(10,), dtype=torch.float32, sequence=0):
        return SparseUpdate({"w": SparseTensor(torch.tensor(indices, dtype=torch.int64),
                                               torch.tensor(values, dtype=dtype), shape)},
                            sequence)
    with pytest.raises(EncodeError, match="does not increase"):
        encode(upd([3, 2], [1.0, 2.0]))
    with pytest.raises(EncodeError, match="does not increase"):
        encode(upd([3, 3], [1.0, 2.0]))
    with pytest.raises(EncodeError, match=r"outside \[0, 10\)"):
        encode(upd([3, 10], [1.0, 2.0]))
    with pytest.raises(EncodeError, match=r"outside \[0, 10\)"):
        encode(upd([-1, 3], [1.0, 2.0]))
    with pytest.raises(EncodeError, match="NaN or Inf"):
        encode(upd([1], [float("inf")], dtype=torch.bfloat16))
    with pytest.raises(EncodeError, match="sequence -1"):
        encode(upd([1], [1.0], sequence=-1))
    with pytest.raises(EncodeError, match="sequence"):
        encode(upd([1], [1.0], sequence=2**64))
    with pytest.raises(EncodeError, match="'all' needs every entry"):
        encode(upd([1], [1.0]), "all")
    with pytest.raises(EncodeError, match="'huffman' is not one of"):
        encode(upd([1], [1.0]), "huffman")
    with pytest.raises(EncodeError, match="65535"):
        encode(SparseUpdate({"x" * 70_000: upd([1], [1.0]).tensors["w"]}))
    empty = torch.empty(0, dtype=torch.int64)
    for shape in ((0, 2**63), (-1, 4)):
        with pytest.raises(EncodeError, match="has a dim outside"):
            encode(SparseUpdate({"w": SparseTensor(empty, torch.empty(0), shape)}))
    with pytest.raises(EncodeError, match="SparseUpdate"):
        encode({"w": upd([1], [1.0]).tensors["w"]})


# ---------------------------------------------------------------------------------------------
# With the real compressor
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value_dtype", ["float32", "float16", "bfloat16"])
def test_compressor_updates_round_trip_and_take_the_expected_codings(value_dtype: str) -> None:
    from dgc import DGCCompressor, DGCConfig

    comp = DGCCompressor(DGCConfig(density=0.01, value_dtype=value_dtype))
    g = torch.Generator().manual_seed(11)
    shapes = {"conv.weight": (32, 16, 3, 3), "fc.weight": (10, 512), "fc.bias": (10,)}
    for epoch in (0.0, 5.0):  # warm-up density, then the target density
        grads = {n: torch.randn(s, generator=g) * 100 for n, s in shapes.items()}
        update = comp.compress(grads, epoch=epoch)
        data = encode(update)
        assert len(data) == encoded_size(update)
        decoded = decode(data, max_numel=MAX_NUMEL)
        assert_same(update, decoded)
        for name, dense in update.to_dense().items():
            assert torch.equal(decoded.to_dense()[name], dense)
        codings = tensor_codings(data)
        assert codings["fc.bias"] == "all"
        if epoch == 5.0:
            assert codings["conv.weight"] == codings["fc.weight"] == "golomb"


# ---------------------------------------------------------------------------------------------
# Packed decoding (the server's fast path) against the reference per-tensor decoder
# ---------------------------------------------------------------------------------------------

def reference_decode(data: bytes) -> SparseUpdate:
    """What decode returns through the step-by-step reader and decoder only."""
    from dgc.wire.decoder import decode_tensors, read_structure

    view = memoryview(data)
    sequence, records = read_structure(view, None)
    return SparseUpdate(decode_tensors(view, records), sequence)


def model_like_update(dtype: torch.dtype, seed: int) -> SparseUpdate:
    """Sparse large tensors, dense small ones, an empty selection: what a DGC client sends."""
    tensors = {}
    for k, (shape, count) in enumerate([((64, 3, 3, 3), 9), ((64,), 64), ((128, 64), 40),
                                        ((128,), 128), ((10, 128), 0), ((10,), 10),
                                        ((300, 7), 2100)]):
        numel = math.prod(shape)
        tensors[f"layer{k}"] = random_tensor(numel, count, dtype, seed + k, shape)
    return SparseUpdate(tensors, seed)


@pytest.mark.parametrize("coding", CODINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_decode_equals_the_reference_decoder(coding: str, dtype: torch.dtype) -> None:
    data = encode(model_like_update(dtype, 3), index_coding=coding)
    update = decode(data, max_numel=MAX_NUMEL)
    assert update.packed is not None
    assert update.nnz == sum(t.nnz for t in reference_decode(data).tensors.values())
    assert update.numel == sum(t.numel for t in reference_decode(data).tensors.values())
    assert_same(reference_decode(data), update)
    assert update.packed is None  # reading tensors made the dict the update's content


def test_messages_of_one_structure_share_their_layout() -> None:
    a = decode(encode(model_like_update(torch.float16, 1)), max_numel=MAX_NUMEL)
    b = decode(encode(model_like_update(torch.float16, 2)), max_numel=MAX_NUMEL)
    assert a.packed is not None and b.packed is not None
    assert a.packed.layout is b.packed.layout
    assert a.packed.layout.offsets[1] == 64 * 27


def test_mixed_value_dtypes_decode_through_the_reference_path() -> None:
    update = model_like_update(torch.float16, 4)
    update.tensors["layer1"] = random_tensor(64, 64, torch.float32, 9, (64,))
    data = encode(update)
    decoded = decode(data, max_numel=MAX_NUMEL)
    assert decoded.packed is None
    assert_same(update, decoded)


def test_golomb_decode_many_equals_section_by_section() -> None:
    rng = np.random.default_rng(0)
    for trial in range(200):
        message, expected = bytearray(rng.integers(0, 256, 3).astype(np.uint8).tobytes()), []
        columns: list[list[int]] = [[], [], [], [], []]  # starts, lengths, counts, numels, offsets
        offset = 0
        for _ in range(int(rng.integers(1, 7))):
            numel = int(rng.integers(1, 4000))
            indices = np.sort(rng.choice(numel, int(rng.integers(0, min(numel, 300) + 1)),
                                         replace=False)).astype(np.int64)
            # forced Rice parameters: small ones, and wide ones (remainders over 4 bytes)
            rice = None if rng.random() < 0.7 else int(rng.choice([*range(12), 25, 26, 40]))
            section = gr.golomb_encode(indices, numel, rice)
            message += rng.integers(0, 256, int(rng.integers(0, 4))).astype(np.uint8).tobytes()
            for column, value in zip(columns, [len(message), len(section), indices.size, numel,
                                               offset], strict=True):
                column.append(value)
            message += section
            expected.append(indices + offset)
            offset += numel
        args = [np.frombuffer(bytes(message), dtype=np.uint8),
                *(np.array(c, dtype=np.int64) for c in columns)]
        assert np.array_equal(gr.golomb_decode_many(*args), np.concatenate(expected)), trial
        # One flipped bit: None, or exactly what section-by-section decoding gives.
        at = int(rng.integers(0, len(message)))
        message[at] ^= 1 << int(rng.integers(0, 8))
        args[0] = np.frombuffer(bytes(message), dtype=np.uint8)
        try:
            reference = np.concatenate([
                gr.golomb_decode(bytes(message[s:s + n]), c, m) + o
                for s, n, c, m, o in zip(*columns, strict=True)])
        except gr.IndexCodingError:
            reference = None
        got = gr.golomb_decode_many(*args)
        assert got is None if reference is None else got is None or np.array_equal(got,
                                                                                   reference)


# ---------------------------------------------------------------------------------------------
# decode_many: a round's replies at once, each with its own result or error
# ---------------------------------------------------------------------------------------------

def decode_result(data: object, max_numel: int = MAX_NUMEL) -> SparseUpdate | str:
    """What decode gives: the update, or its DecodeError message."""
    try:
        return decode(data, max_numel=max_numel)  # type: ignore[arg-type]
    except DecodeError as e:
        return str(e)


def assert_same_results(got: list[SparseUpdate | DecodeError], messages: list[object],
                        max_numel: int = MAX_NUMEL) -> None:
    assert len(got) == len(messages)
    for result, data in zip(got, messages, strict=True):
        want = decode_result(data, max_numel)
        if isinstance(want, str):
            assert isinstance(result, DecodeError) and str(result) == want
        else:
            assert isinstance(result, SparseUpdate)
            assert (result.packed is None) == (want.packed is None)
            assert_same(want, result)


def test_decode_many_equals_decode_on_the_golden_vectors() -> None:
    stored = json.loads((GOLDEN_DIR / "wire_v1.json").read_text(encoding="utf-8"))["cases"]
    messages = [bytes.fromhex(case["hex"]) for case in stored]
    assert_same_results(decode_many(messages, max_numel=MAX_NUMEL), messages)
    assert_same_results(decode_many(messages + messages, max_numel=MAX_NUMEL), messages + messages)


def test_decode_many_shares_one_layout_across_a_round() -> None:
    messages = [encode(model_like_update(torch.float16, seed)) for seed in range(6)]
    got = decode_many(messages, max_numel=MAX_NUMEL)
    layouts = {id(u.packed.layout) if isinstance(u, SparseUpdate) and u.packed else None
               for u in got}
    assert len(layouts) == 1 and None not in layouts
    assert_same_results(got, messages)


def test_decode_many_rejects_only_the_corrupt_message() -> None:
    messages: list[object] = [encode(model_like_update(torch.float16, seed)) for seed in range(5)]
    good = messages[2]
    assert isinstance(good, bytes)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    messages[2] = bytes(flipped)  # bad checksum
    # Past the checksum: a Golomb section's Rice parameter above the format's maximum.
    inner = bytearray(encode(model_like_update(torch.float16, 7)))
    section_at = inner.index(b"layer2") + len(b"layer2") + 1 + 2 * 8 + 8 + 2 + 8
    inner[section_at] = 63
    body = bytes(inner[:-4])
    messages.insert(4, body + struct.pack("<I", zlib.crc32(body)))
    messages.insert(1, good[:-9])  # truncated
    messages.append("not bytes")
    got = decode_many(messages, max_numel=MAX_NUMEL)  # type: ignore[arg-type]
    assert_same_results(got, messages)
    errors = [i for i, r in enumerate(got) if isinstance(r, DecodeError)]
    assert errors == [1, 3, 5, 7]
    assert "bad checksum" in str(got[3])
    assert "(golomb indices): Rice parameter 63" in str(got[5])


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_decode_many_names_each_rejection_like_decode(case: str) -> None:
    data, _ = REJECTIONS[case]
    valid = message([GOOD])
    messages = [valid, data, valid, data]
    assert_same_results(decode_many(messages, max_numel=MAX_NUMEL), messages)


def test_decode_many_takes_messages_of_different_structures() -> None:
    messages = [encode(model_like_update(dtype, seed), index_coding=coding)
                for seed, (coding, dtype) in enumerate((c, d) for c in CODINGS for d in DTYPES)]
    mixed = model_like_update(torch.float16, 4)
    mixed.tensors["layer1"] = random_tensor(64, 64, torch.float32, 9, (64,))
    messages += [encode(mixed), encode(SparseUpdate({}, 3)), messages[0], messages[-1]]
    assert_same_results(decode_many(messages, max_numel=MAX_NUMEL), messages)


def test_decode_many_applies_max_numel() -> None:
    messages = [encode(model_like_update(torch.float16, seed)) for seed in range(3)]
    assert_same_results(decode_many(messages, max_numel=2100), messages, max_numel=2100)
    got = decode_many(messages, max_numel=2099)
    assert all(isinstance(r, DecodeError) and "above max_numel=2099" in str(r) for r in got)
    with pytest.raises(ValueError, match="max_numel"):
        decode_many(messages, max_numel=-1)
