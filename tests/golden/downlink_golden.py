"""Generator of the golden vectors of two downlink messages the Java codec reads
(tests/golden/downlink.json), for its driver ``org.fedgc.wire.DownlinkTest``:

- ``masks``: a round's shared index sets (``FGCM``, ``dgc.signs.codec.encode_mask``; docs/wire.md
  section 11), their bytes and what ``decode_mask`` reads of them: no set, an empty set, one
  index, the largest index of a 2^40-entry tensor, a dense set, every entry, several tensors;
- ``mask_refusals``: malformed masks (a valid checksum where the fault is elsewhere) and the
  reason ``decode_mask``'s message gives (:data:`MASK_REASONS`);
- ``compact``: compact updates (``FGCK``, ``dgc.wire.compact.encode_compact``; section 19) on a
  model's layout or a patch's (``fedgc.context_patch.patch_layout``, ``downlink_compact``), the
  layout's digest and what ``decode_compact`` reads: every index coding, every value dtype (plain,
  sign-coded, grid-coded 64, 65 and 66), places skipped, names whose order differs between code
  points and UTF-16 units, a ten-byte sequence;
- ``compact_refusals``: malformed compact messages and the reason ``decode_compact``'s message
  gives (:data:`COMPACT_REASONS`).

Values come from explicit formulas (no random generator whose stream could change). Regenerate
only when adding cases::

    PYTHONPATH=. python tests/golden/downlink_golden.py
"""

from __future__ import annotations

import re
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
import torch

GOLDEN_PATH = Path(__file__).with_name("downlink.json")

#: decode_mask's messages, classified into the Java codec's DecodeException.Reason names.
MASK_REASONS = [
    (r"^truncated input", "TRUNCATED"),
    (r"^bad magic", "BAD_MAGIC"),
    (r"^unsupported version", "UNSUPPORTED_VERSION"),
    (r"^bad checksum", "BAD_CHECKSUM"),
    (r"^trailing or oversized", "TRAILING"),
    (r"is not valid utf-8", "BAD_UTF8"),
    (r"^index set of '[^']*' appears twice", "DUPLICATE_NAME"),
    (r"^index set of '[^']*' (is for|claims) ", "BAD_INDEX_SET"),
    (r"^index set of '[^']*': .*(out of range|a gap exceeds|run past)", "INDEX_OUT_OF_RANGE"),
    (r"^index set of '[^']*': ", "BAD_INDEX_SECTION"),
]

#: decode_compact's messages, classified into the Java codec's DecodeException.Reason names.
#: Order matters: a grid's Rice section's messages are value-section faults.
COMPACT_REASONS = [
    (r"^truncated input", "TRUNCATED"),
    (r"^bad magic", "BAD_MAGIC"),
    (r"^unsupported version", "UNSUPPORTED_VERSION"),
    (r"^bad checksum", "BAD_CHECKSUM"),
    (r"^trailing or oversized", "TRAILING"),
    (r"^a compact update about another model", "WRONG_LAYOUT"),
    (r"canonical varint$|above the u64 range$|longer than \d+ bytes$", "BAD_VARINT"),
    (r"^\d+ tensors for a model of|^tensor place \d+ beyond", "BAD_PLACE"),
    (r"above max_numel", "TOO_LARGE"),
    (r"claims \d+ entries, above its numel", "COUNT_ABOVE_NUMEL"),
    (r"unknown index coding", "UNKNOWN_CODING"),
    (r"unknown value dtype", "UNKNOWN_DTYPE"),
    (r"is NaN or Inf", "NON_FINITE_VALUE"),
    (r"sign-coded scale must|padding after the last sign|grid-coded", "BAD_VALUE_SECTION"),
    (r"does not increase", "INDEX_NOT_INCREASING"),
    (r"out of range|a gap exceeds|run past", "INDEX_OUT_OF_RANGE"),
    (r"coding 'all' needs|indices\): ", "BAD_INDEX_SECTION"),
]


def reason(reasons: list[tuple[str, str]], message: str) -> str:
    """The Java reason of a Python decoder's message; an AssertionError for one not listed."""
    for pattern, name in reasons:
        if re.search(pattern, message):
            return name
    raise AssertionError(f"unclassified message: {message}")


def floats(n: int, mul: int, mod: int, scale: float, offset: float = 0.0) -> np.ndarray:
    """``n`` deterministic float32 values spread over [-scale/2, scale/2) (+ offset)."""
    i = np.arange(n, dtype=np.int64)
    return ((((i * mul) % mod) / mod - 0.5) * scale + offset).astype(np.float32)


def _seal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


# --------------------------------------------------------------------------------------------
# FGCM masks
# --------------------------------------------------------------------------------------------

MASK_NUMELS = {"conv.weight": 432, "fc.weight": 2560, "层.b": 10, "big": 2**40, "none": 0}


def masks() -> list[dict]:
    from dgc.signs.codec import decode_mask, encode_mask

    cases = [
        ("no_set", {}, 0),
        ("empty_set", {"fc.weight": []}, 1),
        ("one_index", {"conv.weight": [17]}, 2),
        ("first_and_last", {"conv.weight": [0, 431]}, 3),
        ("largest_index", {"big": [0, 2**20, 2**39 + 5, 2**40 - 1]}, 4),
        ("dense", {"fc.weight": [i for i in range(2560) if i % 7 != 3]}, 5),
        ("every_entry", {"层.b": list(range(10))}, 6),
        ("zero_entries", {"none": []}, 7),
        ("several", {"conv.weight": list(range(1, 432, 9)), "fc.weight": list(range(5, 2560, 97)),
                     "层.b": [9]}, 2**64 - 1),
    ]
    out = []
    for case, sets, sequence in cases:
        arrays = {n: np.asarray(s, dtype=np.int64) for n, s in sets.items()}
        data = encode_mask(arrays, MASK_NUMELS, sequence)
        seq, got = decode_mask(data, MASK_NUMELS)
        out.append({"case": case, "hex": data.hex(), "numels": MASK_NUMELS, "sequence": seq,
                    "sets": {n: v.tolist() for n, v in got.items()}})
    return out


def _mask(tensors: list[tuple], sequence: int = 1,
          magic: bytes = b"FGCM", version: int = 1, count: int | None = None,
          tail: bytes = b"") -> bytes:
    """A mask of raw parts: (utf-8 name, numel, k, section[, section bytes said]) each,
    sealed."""
    body = magic + struct.pack("<BQI", version, sequence, len(tensors) if count is None else count)
    for name, numel, k, section, *said in tensors:
        nbytes = said[0] if said else len(section)
        body += struct.pack("<H", len(name)) + name + struct.pack("<QQQ", numel, k, nbytes)
        body += section
    return _seal(body + tail)


def mask_refusals() -> list[dict]:
    from dgc import DecodeError
    from dgc.golomb import golomb_encode
    from dgc.signs.codec import decode_mask, encode_mask

    numels = {"w": 100, "v": 8, "big": 2**41}
    g = golomb_encode(np.array([3, 50, 99]), 100)
    good = encode_mask({"w": np.array([3, 50, 99])}, numels, 5)
    cases = [
        ("empty_input", b""),
        ("short", good[:20]),
        ("prefix", good[:-1]),
        ("rank_request_magic", _mask([(b"w", 100, 3, g)], magic=b"FGCD")),
        ("version_2", _mask([(b"w", 100, 3, g)], version=2)),
        ("bad_checksum", good[:-1] + bytes([good[-1] ^ 1])),
        ("name_not_utf8", _mask([(b"\xc3", 100, 3, g)])),
        ("name_past_the_end", _mask([(b"w", 100, 3, g)], count=2)),
        ("header_past_the_end", _mask([(b"w", 100, 3, g)], count=2,
                                      tail=b"\x01\x00v\x00\x00")),
        ("twice", _mask([(b"w", 100, 3, g), (b"w", 100, 3, g)])),
        ("unknown_tensor", _mask([(b"x", 100, 3, g)])),
        ("another_size", _mask([(b"w", 101, 3, g)])),
        ("more_than_numel", _mask([(b"v", 8, 9, b"\x00\xff\x01")])),
        ("section_past_the_end", _mask([(b"w", 100, 3, g, len(g) + 1)])),
        ("section_of_2_64_bytes", _mask([(b"w", 100, 3, g, 2**64 - 1)])),
        ("huge_count", _mask([(b"big", 2**41, 2**40, golomb_encode(np.array([1]), 2**41))])),
        ("count_above_codes", _mask([(b"w", 100, 4, g)])),
        ("count_below_codes", _mask([(b"w", 100, 2, g)])),
        ("index_beyond_numel", _mask([(b"v", 8, 2, golomb_encode(np.array([1, 50]), 100))])),
        ("last_index_is_numel", _mask([(b"v", 8, 1, golomb_encode(np.array([8]), 9))])),
        ("rice_parameter_63", _mask([(b"w", 100, 1, b"\x3f" + b"\x00" * 8 + b"\x01")])),
        ("unary_ends_with_zero", _mask([(b"w", 100, 3, g + b"\x00")])),
        ("no_parameter_byte", _mask([(b"w", 100, 0, b"")])),
        ("unary_bytes_for_none", _mask([(b"w", 100, 0, b"\x00\x01")])),
        ("remainder_padding", _mask([(b"w", 100, 1, b"\x02\x04\x01")])),
        ("trailing_byte", _mask([(b"w", 100, 3, g)], tail=b"\x00")),
    ]
    out = []
    for case, data in cases:
        try:
            decode_mask(data, numels)
        except DecodeError as ex:
            out.append({"case": case, "hex": data.hex(), "numels": numels,
                        "reason": reason(MASK_REASONS, str(ex)), "message": str(ex)})
        else:
            raise AssertionError(f"mask refusal {case!r} was accepted")
    return out


# --------------------------------------------------------------------------------------------
# FGCK compact updates
# --------------------------------------------------------------------------------------------

#: A model's tensors in its own order; the layout sorts them by code point, where "z\uffff"
#: comes before "z\U0001f600" (UTF-16 units would put the surrogate pair first).
SHAPES = {"fc.weight": (10, 100), "fc.bias": (10,), "conv.weight": (4, 3, 3, 3), "scalar": (),
          "z\U0001f600": (6,), "z\uffff": (5,), "层.b": (7,)}


def _tensor(indices, values, shape, dtype=torch.float32):
    from dgc import SparseTensor

    return SparseTensor(torch.tensor(indices, dtype=torch.int64),
                        torch.as_tensor(np.asarray(values, np.float32)).to(dtype), shape)


def _tensor_json(name: str, t) -> dict:
    wide = t.values.dtype == torch.float32
    raw = t.values.contiguous().view(torch.int32 if wide else torch.int16).tolist()
    return {"name": name, "shape": list(t.shape), "dtype": str(t.values.dtype).removeprefix(
        "torch."), "indices": t.indices.tolist(),
        "value_bits": [int(b) & (0xFFFFFFFF if wide else 0xFFFF) for b in raw]}


def compact() -> list[dict]:
    from dgc import SparseUpdate
    from dgc.wire.compact import decode_compact, encode_compact, layout_digest, layout_of
    from dgc.wire.value_codings import GRID_CODED, GRID_NONZERO_CODED, GRID_RICE_CODED, SIGN_CODED
    from fedgc import context_patch

    model = layout_of(SHAPES)
    sparse = list(range(3, 1000, 11))
    q = np.arange(-127, 128, dtype=np.float32)
    nonzero = np.concatenate([np.arange(1, 60), -np.arange(1, 40)]).astype(np.float32)
    cases = [
        ("no_tensor", SparseUpdate({}, 0), model, {}, ()),
        ("plain_float32", SparseUpdate({"fc.weight": _tensor(sparse, floats(len(sparse), 41, 113,
                                                                             0.4), (10, 100)),
                                        "fc.bias": _tensor(list(range(10)), floats(10, 3, 7, 1.0),
                                                           (10,))}, 7), model, {}, ()),
        ("half_and_bfloat16", SparseUpdate({
            "conv.weight": _tensor([0, 5, 107], [0.5, -1.25, 3e-5], (4, 3, 3, 3), torch.float16),
            "层.b": _tensor([1, 6], [-0.0, 65504.0], (7,), torch.bfloat16)}, 8), model, {}, ()),
        ("bitmap_indices", SparseUpdate({"fc.weight": _tensor(
            [i for i in range(1000) if i % 3], floats(666, 7, 19, 0.1), (10, 100))}, 9),
         model, {}, ()),
        ("raw_indices", SparseUpdate({"big.w": _tensor([7, 2**32 - 3], [1.0, 2.0], (2**32,))},
                                     10), layout_of({"big.w": (2**32,)}), {}, ()),
        ("sign_coded", SparseUpdate({"fc.weight": _tensor(sparse, np.where(
            np.arange(len(sparse)) % 3 == 0, -0.125, 0.125), (10, 100))}, 11),
         model, {"sign_coding": True}, (SIGN_CODED,)),
        ("grid_byte_per_value", SparseUpdate({"fc.weight": _tensor(list(range(255)),
                                                                   q * np.float32(2.0**-9),
                                                                   (10, 100))}, 12),
         model, {"grid_coding": True}, (GRID_CODED,)),
        ("grid_rice", SparseUpdate({"fc.weight": _tensor(sparse, np.where(  # no -0.0: off grid
            np.arange(len(sparse)) % 5 == 0, np.where(np.arange(len(sparse)) % 2, 0.25, -0.25),
            0.0), (10, 100))}, 13),
         model, {"grid_coding": True}, (GRID_RICE_CODED,)),
        ("grid_nonzero", SparseUpdate({"fc.weight": _tensor(list(range(0, 980, 10)),
                                                            np.where(nonzero > 50, 1.0, 1.0)
                                                            * np.sign(nonzero) * 2.0**-4,
                                                            (10, 100))}, 14),
         model, {"grid_coding": True, "nonzero_grid": True}, (GRID_NONZERO_CODED,)),
        ("places_skipped_and_unicode", SparseUpdate({
            "scalar": _tensor([0], [3.5], ()),
            "z\uffff": _tensor([4], [-2.0], (5,)),
            "z\U0001f600": _tensor([0, 5], [1.0, 1.5], (6,))}, 2**64 - 1), model, {}, ()),
    ]
    # A patch on the layout of the model and the segments of "fc.weight" (downlink_compact with
    # downlink_context): segments j of shape (hi - lo,), as the server sends them.
    context = ["fc.weight"]
    patch_layout = context_patch.patch_layout(SHAPES, context)
    cuts = context_patch.cuts(1000)
    segments = {context_patch.segment_name("fc.weight", j): _tensor(
        [0, hi - lo - 1], [0.5 * (j + 1), -0.25], (hi - lo,)) for j, (lo, hi) in
        enumerate(zip(cuts[:-1], cuts[1:], strict=True)) if j != 2}
    cases.append(("patch_segments", SparseUpdate({**segments, "fc.bias": _tensor(
        [0, 9], [1.0, -1.0], (10,))}, 15), patch_layout, {"grid_coding": True}, ()))
    out, seen = [], set()
    for case, update, layout, switches, dtypes in cases:
        data = encode_compact(update, layout, **switches)
        max_numel = max(int(np.prod(shape)) for _, shape in layout)
        got = decode_compact(data, layout, max_numel=max_numel)
        shapes = {n: list(s) for n, s in layout}
        if layout == patch_layout:
            shapes = {n: list(s) for n, s in SHAPES.items()}
        found = _codings(data, layout)
        seen |= found
        for d in dtypes:  # the case holds the value coding it is named after
            assert d in {v for _, v in found}, (case, d)
        out.append({"case": case, "hex": data.hex(), "shapes": shapes,
                    "context": context if layout == patch_layout else [],
                    "digest": layout_digest(layout), "max_numel": max_numel,
                    "sequence": got.sequence,
                    "tensors": [_tensor_json(n, t) for n, t in got.tensors.items()]})
    # every index coding (all, raw, bitmap, golomb) and every value coding
    assert {c for c, _ in seen} == {0, 1, 2, 3}, seen
    assert {v for _, v in seen} == {0, SIGN_CODED, GRID_CODED, GRID_RICE_CODED,
                                    GRID_NONZERO_CODED}, seen
    return out


def _codings(data: bytes, layout) -> set[tuple[int, int]]:
    """The index coding and value coding (0 plain, 128 sign-coded, a grid's id) of each tensor
    of a compact message, its headers walked as ``decode_compact`` walks them."""
    from dgc.wire.compact import _read_tensor, _read_varint

    view = memoryview(data)
    end = len(data) - 4
    _, pos = _read_varint(view, 9, end, "sequence")
    count, pos = _read_varint(view, pos, end, "count")
    place, out = -1, set()
    for _ in range(count):
        gap, pos = _read_varint(view, pos, end, "place")
        place += gap + 1
        name, shape = layout[place]
        record, _, pos = _read_tensor(view, pos, end, place, name, int(np.prod(shape)), shape)
        out.add((int(record.coding), int(record.value_coding)))
    return out


def _varint(n: int) -> bytes:
    from dgc.wire.compact import _varint as v

    return v(n)


def _compact(digest: int, parts: list[bytes], magic: bytes = b"FGCK", version: int = 1) -> bytes:
    return _seal(magic + struct.pack("<BI", version, digest) + b"".join(parts))


def _tensor_part(gap: int, count: int, coding: int, dtype: int, index: bytes,
                 values: bytes) -> bytes:
    return (_varint(gap) + _varint(count) + bytes([coding, dtype]) + _varint(len(index)) + index
            + values)


def compact_refusals() -> list[dict]:
    from dgc import DecodeError, SparseUpdate
    from dgc.golomb import golomb_encode
    from dgc.wire.compact import decode_compact, encode_compact, layout_digest, layout_of

    shapes = {"a": (8,), "b": (2, 3), "c": (300,)}
    layout = layout_of(shapes)
    d = layout_digest(layout)
    good = encode_compact(SparseUpdate({"a": _tensor([1, 4], [1.0, -2.0], (8,))}, 3), layout)
    one = struct.pack("<f", 1.0)
    gr = golomb_encode(np.array([1, 4]), 8)
    plain2 = one + struct.pack("<f", 2.0)
    nan = struct.pack("<I", 0x7FC00000)
    rice = golomb_encode(np.array([254]), 255)  # a folded value of 254: |q| = 128
    cases = [
        ("empty_input", b"", None),
        ("short", good[:12], None),
        ("prefix", good[:-1], None),
        ("update_magic", _compact(d, [_varint(3), _varint(0)], magic=b"FGCU"), None),
        ("version_2", _compact(d, [_varint(3), _varint(0)], version=2), None),
        ("bad_checksum", good[:-1] + bytes([good[-1] ^ 0x80]), None),
        ("another_model", _compact(d ^ 1, [_varint(3), _varint(0)]), None),
        ("sequence_not_canonical", _compact(d, [b"\x83\x00", _varint(0)]), None),
        ("sequence_of_11_bytes", _compact(d, [b"\xff" * 10 + b"\x01", _varint(0)]), None),
        ("sequence_above_u64", _compact(d, [b"\xff" * 9 + b"\x02", _varint(0)]), None),
        ("sequence_past_the_end", _compact(d, [b"\xff\xff"]), None),
        ("more_tensors_than_the_model", _compact(d, [_varint(3), _varint(4)]), None),
        ("place_beyond", _compact(d, [_varint(3), _varint(1), _tensor_part(
            3, 0, 3, 0, b"\x00", b"")]), None),
        ("place_beyond_after_one", _compact(d, [_varint(3), _varint(2), _tensor_part(
            2, 0, 3, 0, b"\x00", b""), _tensor_part(0, 0, 3, 0, b"\x00", b"")]), None),
        ("place_gap_of_2_64", _compact(d, [_varint(3), _varint(1), b"\xff" * 9 + b"\x01"]),
         None),
        ("above_max_numel", _compact(d, [_varint(3), _varint(1), _tensor_part(
            2, 0, 3, 0, b"\x00", b"")]), 299),
        ("count_above_numel", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 9, 3, 0, b"\x00", b"")]), None),
        ("unknown_coding", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 4, 0, gr, plain2)]), None),
        ("unknown_dtype", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 3, 3, gr, plain2)]), None),
        ("unknown_signed_dtype", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 3, 0xC0, gr, plain2)]), None),
        ("all_of_fewer", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 0, 0, b"", plain2)]), None),
        ("index_bytes_past_the_end", _compact(d, [_varint(3), _varint(1), _varint(0),
                                                  _varint(2), b"\x03\x00", _varint(200)]), None),
        ("values_past_the_end", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 3, 0, gr, one)]), None),
        ("codings_past_the_end", _compact(d, [_varint(3), _varint(1), _varint(0),
                                              _varint(2), b"\x03"]), None),
        ("nan_value", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 3, 0, gr, one + nan)]), None),
        ("sign_scale_zero", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 3, 0x80, gr, b"\x00\x00\x00\x00\x01")]), None),
        ("sign_padding", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 3, 0x80, gr, one + b"\x05")]), None),
        ("grid_scale_not_a_power_of_two", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 3, 0x40, gr, struct.pack("<f", 3.0) + b"\x01\xff")]), None),
        ("grid_rice_span_past", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 3, 0x41, gr, one + _varint(2**62 + 1) + _varint(0))]), None),
        ("grid_rice_bytes_past", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 3, 0x41, gr, one + _varint(3) + _varint(50))]), None),
        ("grid_rice_scale_past", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 3, 0x41, gr, b"\x00\x00")]), None),
        ("grid_rice_span_above_256_each", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 1, 3, 0x41, golomb_encode(np.array([1]), 8), one + _varint(300)
            + _varint(len(golomb_encode(np.array([299]), 300)))
            + golomb_encode(np.array([299]), 300))]), None),
        ("grid_rice_not_canonical", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 1, 3, 0x41, golomb_encode(np.array([1]), 8), one + _varint(9)
            + _varint(len(golomb_encode(np.array([4]), 9))) + golomb_encode(np.array([4]), 9))]),
         None),
        ("grid_nonzero_folded_254", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 1, 3, 0x42, golomb_encode(np.array([1]), 8), one + _varint(255)
            + _varint(len(rice)) + rice)]), None),
        ("grid_rice_bad_section", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 1, 3, 0x41, golomb_encode(np.array([1]), 8), one + _varint(1) + _varint(2)
            + b"\x00\x00")]), None),
        ("index_beyond_numel", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 3, 0, golomb_encode(np.array([1, 9]), 10), plain2)]), None),
        ("raw_not_increasing", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 1, 0, struct.pack("<II", 4, 1), plain2)]), None),
        ("bitmap_count", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 2, 0, b"\x07", plain2)]), None),
        ("golomb_count", _compact(d, [_varint(3), _varint(1), _tensor_part(
            0, 2, 3, 0, golomb_encode(np.array([1, 4, 6]), 8), plain2)]), None),
        ("trailing_byte", _seal(good[:-4] + b"\x00"), None),
    ]
    out = []
    for case, data, max_numel in cases:
        limit = 300 if max_numel is None else max_numel
        try:
            decode_compact(data, layout, max_numel=limit)
        except DecodeError as ex:
            out.append({"case": case, "hex": data.hex(),
                        "shapes": {n: list(s) for n, s in shapes.items()}, "max_numel": limit,
                        "reason": reason(COMPACT_REASONS, str(ex)), "message": str(ex)})
        else:
            raise AssertionError(f"compact refusal {case!r} was accepted")
    return out


def golden() -> dict:
    """The whole document, as it would be written now."""
    return {"spec": "docs/wire.md, sections 11 (FGCM) and 19 (FGCK)",
            "masks": masks(), "mask_refusals": mask_refusals(), "compact": compact(),
            "compact_refusals": compact_refusals()}


if __name__ == "__main__":
    from tests.golden.dgc_sets_golden import text  # the golden files' one-case-a-line layout

    path = Path(sys.argv[1]) if len(sys.argv) > 1 else GOLDEN_PATH
    path.write_text(text(golden()), encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)
