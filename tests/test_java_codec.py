"""The Java wire codec of android_bridge/java, compiled with javac and checked against dgc.wire.

The Java test driver checks the golden vectors in both directions and the rejections on its
own; the tests here drive the compiled codec through its line tool (one JVM per test) and
compare it with the Python reference on real DGCCompressor updates, on mutated messages (with
the checksum repaired so the semantic checks are reached) and on half-float rounding.
"""

from __future__ import annotations

import random
import re
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
import torch

from dgc import DecodeError, DGCCompressor, DGCConfig, SparseTensor, SparseUpdate, decode, encode
from dgc.wire import MAX_NUMEL, EncodeError, tensor_codings

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "wire_v1.json"
RAW_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
CODINGS = ["auto", "golomb", "bitmap", "raw"]
JVM_TIMEOUT_S = 120

# dgc.decode's messages, classified into the Java codec's DecodeException.Reason names.
# Order matters: the index-section messages that mean "out of range" come before the catch-all.
PYTHON_REASONS = [
    (r"^truncated input", "TRUNCATED"),
    (r"^bad magic", "BAD_MAGIC"),
    (r"^unsupported version", "UNSUPPORTED_VERSION"),
    (r"^unsupported flags", "UNSUPPORTED_FLAGS"),
    (r"^trailing or oversized", "TRAILING"),
    (r"^bad checksum", "BAD_CHECKSUM"),
    (r"name is not valid utf-8", "BAD_UTF8"),
    (r"^duplicate tensor name", "DUPLICATE_NAME"),
    (r"above the format's limit|above max_numel", "TOO_LARGE"),
    (r"claims \d+ entries, above its numel", "COUNT_ABOVE_NUMEL"),
    (r"unknown index coding", "UNKNOWN_CODING"),
    (r"unknown value dtype", "UNKNOWN_DTYPE"),
    (r"is NaN or Inf", "NON_FINITE_VALUE"),
    (r"sign-coded scale must|padding after the last sign|grid-coded", "BAD_VALUE_SECTION"),
    (r"does not increase", "INDEX_NOT_INCREASING"),
    (r"out of range|a gap exceeds|run past", "INDEX_OUT_OF_RANGE"),
    (r"coding 'all' needs|indices\): ", "BAD_INDEX_SECTION"),
]


def python_reason(message: str) -> str:
    for pattern, reason in PYTHON_REASONS:
        if re.search(pattern, message):
            return reason
    raise AssertionError(f"unclassified dgc.decode message: {message}")


def run_driver(classpath: Path, main_class: str, golden: Path) -> int:
    """Run a Java test driver on its golden file; how many checks it passed (all, asserted)."""
    done = subprocess.run(["java", "-cp", str(classpath), f"org.fedgc.wire.{main_class}",
                           str(golden)], capture_output=True, text=True, timeout=JVM_TIMEOUT_S)
    assert done.returncode == 0, f"{main_class} failed:\n{done.stdout}\n{done.stderr}"
    summary = re.search(r"^OK (\d+)/(\d+) checks passed$", done.stdout, re.MULTILINE)
    assert summary is not None and summary.group(1) == summary.group(2), done.stdout
    return int(summary.group(2))


def run_tool(classpath: Path, lines: list[str]) -> list[str]:
    """Feed the line protocol of org.fedgc.wire.WireTool to one JVM; its answers, in order."""
    done = subprocess.run(["java", "-cp", str(classpath), "org.fedgc.wire.WireTool"],
                          input="\n".join(lines) + "\n", capture_output=True, text=True,
                          timeout=JVM_TIMEOUT_S)
    assert done.returncode == 0, f"WireTool failed:\n{done.stderr}"
    answers = done.stdout.splitlines()
    assert len(answers) == len(lines)
    return answers


def assert_same(a: SparseUpdate, b: SparseUpdate) -> None:
    """Equal sequence, names in order, shapes, dtypes, indices and value bits."""
    assert a.sequence == b.sequence
    assert list(a.tensors) == list(b.tensors)
    for name, t in a.tensors.items():
        u = b.tensors[name]
        assert u.shape == t.shape
        assert u.values.dtype == t.values.dtype
        assert torch.equal(u.indices, t.indices)
        view = RAW_VIEW[t.values.dtype]
        assert torch.equal(u.values.view(view), t.values.view(view))


def compressor_updates() -> list[SparseUpdate]:
    """Real DGC updates (seeded): every value dtype, warm-up and target densities, a clipped one."""
    shapes = {"conv.weight": (16, 8, 3, 3), "fc.weight": (10, 256), "fc.bias": (10,)}
    updates = []
    for k, (dtype, density, clip) in enumerate([("float16", 0.01, None), ("float32", 0.05, 1.0),
                                                ("bfloat16", 0.001, None)]):
        config = DGCConfig(density=density, value_dtype=dtype, clip_norm=clip,
                           min_sparse_numel=64)
        comp = DGCCompressor(config)
        g = torch.Generator().manual_seed(100 + k)
        for epoch in (0.0, 1.0, 6.0):
            grads = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
            updates.append(comp.compress(grads, epoch=epoch))
    return updates


def edge_updates() -> list[SparseUpdate]:
    """Hand-made updates at the coding choice's corners: ties, huge gaps, empty and dense."""
    from dgc import SparseTensor

    def t(indices: list[int], shape: tuple[int, ...], dtype: torch.dtype) -> SparseTensor:
        values = torch.linspace(-1.0, 1.0, len(indices)).to(dtype)
        return SparseTensor(torch.tensor(indices, dtype=torch.int64), values, shape)

    f16, f32, bf16 = torch.float16, torch.float32, torch.bfloat16
    return [
        # golomb (b = 0, 1 unary byte) and bitmap both take 2 bytes: the tie goes to golomb.
        SparseUpdate({"tie": t([0, 1], (16,), f16)}, 1),
        # One index at the far end of 2^40 entries: b near 40, a bitmap would not fit.
        SparseUpdate({"far": t([(1 << 40) - 1], (1 << 20, 1 << 20), f32)}, 2),
        # A cluster then a jump: the density estimate of b is far off, the descent fixes it.
        SparseUpdate({"clustered": t([*range(50), 10**6 - 1], (10**6,), bf16),
                      "dense": t(list(range(6)), (2, 3), f16),
                      "half": t(list(range(0, 64, 2)), (8, 8), f32),  # density 1/2: bitmap
                      "empty": t([], (0, 4), f32), "none": t([], (9,), bf16)}, 2**64 - 1),
    ]


def test_java_driver_passes_golden_vectors_and_rejections(java_classpath: Path) -> None:
    # the per-bit flips alone are over a thousand
    assert run_driver(java_classpath, "WireCodecTest", GOLDEN) > 1000


def test_java_reencodes_compressor_updates_byte_for_byte(java_classpath: Path) -> None:
    updates = compressor_updates() + edge_updates()
    cases = []
    for u in updates:
        for coding in CODINGS:
            if coding == "bitmap" and "far" in u.tensors:
                continue  # 2^37 bytes: Python would try to build it, Java refuses (its driver)
            try:
                cases.append((u, coding, encode(u, coding)))
            except EncodeError:  # raw beyond 2^32 entries
                assert coding == "raw" and "far" in u.tensors
    # The sparse tensors at target density must take Golomb-Rice under auto, or this test would
    # not exercise the Rice parameter choice.
    auto_codings = [c for _, coding, data in cases if coding == "auto"
                    for c in tensor_codings(data).values()]
    assert {"all", "golomb", "bitmap", "raw"} <= set(auto_codings)
    assert tensor_codings(encode(edge_updates()[0]))["tie"] == "golomb"
    answers = run_tool(java_classpath, [f"codec {c} {data.hex()}" for _, c, data in cases])
    for (update, coding, data), answer in zip(cases, answers, strict=True):
        status, _, java_hex = answer.partition(" ")
        assert status == "OK", f"Java rejected a Python {coding} message: {answer}"
        java_bytes = bytes.fromhex(java_hex)
        assert java_bytes == data, f"Java's {coding} encoding differs from Python's"
        assert_same(update, decode(java_bytes, max_numel=MAX_NUMEL))


def _repair_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def _mutations(message: bytes, rng: random.Random, count: int) -> list[bytes]:
    """Damaged versions of ``message``: most with the checksum repaired, some without."""
    body = message[:-4]
    out = []
    for _ in range(count):
        b = bytearray(body)
        kind = rng.randrange(5)
        at = rng.randrange(len(b))
        if kind == 0:
            b[at] = rng.randrange(256)
        elif kind == 1:
            b[at] ^= 1 << rng.randrange(8)
        elif kind == 2:
            b.insert(at, rng.randrange(256))
        elif kind == 3:
            del b[at:at + rng.randrange(1, 9)]
        else:
            # A header-sized field set to an extreme: counts, lengths and dims of 2^k +- 1.
            width = rng.choice([1, 2, 4, 8])
            value = max(0, min((1 << (8 * width)) - 1, (1 << rng.randrange(8 * width + 1))
                               + rng.choice([-1, 0, 1])))
            b[at:at + width] = value.to_bytes(width, "little")
        keep_stale_crc = rng.randrange(6) == 0
        out.append(bytes(b) + message[-4:] if keep_stale_crc else _repair_crc(bytes(b)))
    return out


def test_java_and_python_agree_on_mutated_messages(java_classpath: Path) -> None:
    import json

    golden = [bytes.fromhex(c["hex"]) for c in json.loads(GOLDEN.read_text("utf-8"))["cases"]]
    small = [encode(u) for u in compressor_updates()[:3]]
    rng = random.Random(2024)
    messages = [m for base in golden + small for m in _mutations(base, rng, 150)]
    answers = run_tool(java_classpath, [f"codec auto {m.hex()}" for m in messages])
    accepted = 0
    seen_reasons = set()
    for message, answer in zip(messages, answers, strict=True):
        status, _, rest = answer.partition(" ")
        try:
            expected = encode(decode(message, max_numel=MAX_NUMEL)).hex()
        except DecodeError as e:
            reason = python_reason(str(e))
            assert (status, rest) == ("REJECT", reason), (
                f"Python rejects ({e}), Java answered {answer} for {message.hex()}")
            seen_reasons.add(reason)
            continue
        assert (status, rest) == ("OK", expected), (
            f"Python accepts, Java answered {answer[:80]} for {message.hex()}")
        accepted += 1
    # The mutations must reach deep into the format, not only the framing checks.
    assert accepted > 0
    assert {"TRUNCATED", "TRAILING", "BAD_CHECKSUM", "COUNT_ABOVE_NUMEL", "UNKNOWN_CODING",
            "BAD_INDEX_SECTION"} <= seen_reasons, seen_reasons


def _java_agrees(java_classpath: Path, messages: list[bytes], rejections: str) -> None:
    """The Java codec decodes ``messages`` to the bits Python decodes (it re-encodes them
    plain, as Python's ``encode`` does by default) and rejects the test_wire rejections whose
    names start with ``rejections`` for the reason Python gives."""
    import tests.test_wire as wire_tests

    rejected = {name: data for name, (data, _) in wire_tests.REJECTIONS.items()
                if name.startswith(rejections)}
    assert rejected
    answers = run_tool(java_classpath, [f"codec auto {m.hex()}"
                                        for m in [*messages, *rejected.values()]])
    for message, answer in zip(messages, answers, strict=False):
        assert answer == f"OK {encode(decode(message, max_numel=MAX_NUMEL)).hex()}"
    for (name, data), answer in zip(rejected.items(), answers[len(messages):], strict=True):
        with pytest.raises(DecodeError) as e:
            decode(data, max_numel=MAX_NUMEL)
        assert answer == f"REJECT {python_reason(str(e.value))}", name


def test_java_decodes_sign_coded_values_as_python_does(java_classpath: Path) -> None:
    """Ternary DGC's sign-coded tensors (docs/wire.md, section 5): the Java codec decodes them
    to the same bits (it re-encodes them plain, as Python's encode does by default) and rejects
    the malformed ones for the same reason."""

    messages = []
    for k, dtype in enumerate(["float16", "float32", "bfloat16"]):
        comp = DGCCompressor(DGCConfig(density=0.05, value_dtype=dtype, ternary=True,
                                       warmup="none", min_sparse_numel=64))
        g = torch.Generator().manual_seed(200 + k)
        for _ in range(2):
            grads = {"conv.weight": torch.randn(16, 8, 3, 3, generator=g),
                     "fc.weight": torch.randn(10, 256, generator=g),
                     "fc.bias": torch.randn(10, generator=g)}
            messages.append(encode(comp.compress(grads), sign_coding=True))
    # really sign-coded
    assert all(len(m) < len(encode(decode(m, max_numel=MAX_NUMEL))) for m in messages)
    _java_agrees(java_classpath, messages, "signs_")


def test_java_decodes_grid_coded_values_as_python_does(java_classpath: Path) -> None:
    """The int8 broadcast's grid-coded tensors, a byte per value and Rice-coded (docs/wire.md,
    section 5): the Java codec decodes them to the same float32 bits and rejects the malformed
    ones for the same reason."""
    import tests.test_wire as wire_tests

    messages = []
    g = torch.Generator().manual_seed(5)
    for exponent in (-126, -9, 0, 120):
        q = torch.randint(-127, 128, (400,), generator=g).float()
        q[0] = 0.0
        indices = torch.randperm(3000, generator=g)[:400].sort().values
        small = (torch.randn(400, generator=g) * 4).round().clamp(-127, 127)
        small[0] = 127  # Rice-coded: the values cluster near zero
        for values in (q, small):
            update = SparseUpdate(
                {"w": SparseTensor(indices, values * 2.0 ** exponent + 0.0, (30, 100)),
                 "b": SparseTensor(torch.arange(3), torch.randn(3, generator=g), (3,))},
                exponent + 200)
            messages.append(encode(update, grid_coding=True))
    # really grid-coded
    assert all(len(m) < len(encode(decode(m, max_numel=MAX_NUMEL))) for m in messages)
    assert {wire_tests.tensor_value_dtypes(m)["w"] for m in messages} == {0x40, 0x41}
    # The encoder never writes q = -128, but it is a valid int8: both decode it.
    messages.append(wire_tests.message([wire_tests.tensor_record(
        b"w", [4, 4], 2, 1, 0x40, wire_tests.raw_u32(3, 9), wire_tests.f32(0.5) + b"\x80\x00")]))
    assert decode(messages[-1], max_numel=MAX_NUMEL).tensors["w"].values.tolist() == [-64.0, 0.0]
    _java_agrees(java_classpath, messages, "grid_")


def test_java_decodes_the_grid_without_a_code_for_zero_as_python_does(java_classpath: Path,
                                                                      ) -> None:
    """Value dtype 66 (``nonzero_grid``: a ``downlink_context`` patch's differences) in an
    update message: the Java codec decodes it to Python's bits (it refused it as an unknown
    dtype before 2026-12-07) and refuses a folded value above 253 as Python does."""
    import tests.test_wire as wire_tests

    g = torch.Generator().manual_seed(66)
    messages = []
    for exponent in (-126, -4, 120):
        q = torch.randint(1, 128, (300,), generator=g).float()
        q *= torch.where(torch.rand(300, generator=g) < 0.5, -1.0, 1.0)
        q[:3] = torch.tensor([1.0, -1.0, 2.0])  # the smallest folded codes: 0, 1, 2
        small = torch.where(torch.rand(300, generator=g) < 0.5, -1.0, 1.0)
        for values in (q, small):
            indices = torch.randperm(3000, generator=g)[:300].sort().values
            messages.append(encode(SparseUpdate({"w": SparseTensor(
                indices, values * 2.0 ** exponent, (30, 100))}, 3), grid_coding=True,
                nonzero_grid=True))
    assert 0x42 in {wire_tests.tensor_value_dtypes(m)["w"] for m in messages}
    nbytes, section = wire_tests.rice_of([254])  # a folded 254: q = 128, beyond the grid
    bad = wire_tests.message([wire_tests.tensor_record(
        b"w", [4, 4], 1, 1, 0x42, wire_tests.raw_u32(1),
        wire_tests.rice_grid(0.25, 255, nbytes, section))], 2)
    with pytest.raises(DecodeError, match="above 253"):
        decode(bad, max_numel=MAX_NUMEL)
    answers = run_tool(java_classpath, [f"codec auto {m.hex()}" for m in [*messages, bad]])
    assert answers[:-1] == [f"OK {encode(decode(m, max_numel=MAX_NUMEL)).hex()}"
                            for m in messages]
    assert answers[-1] == "REJECT BAD_VALUE_SECTION"


def test_java_half_float_rounding_matches_torch(java_classpath: Path) -> None:
    g = torch.Generator().manual_seed(3)
    uniform_bits = torch.randint(0, 1 << 32, (4000,), generator=g, dtype=torch.int64)
    # Values near float16's range and precision limits: ties, subnormals, overflow to Inf.
    half_grid = torch.arange(0, 1 << 16, 7, dtype=torch.int64).to(torch.int16).view(
        torch.float16).float()
    nudged = torch.cat([half_grid * (1 + 2.0 ** -11), half_grid * (1 - 2.0 ** -12),
                        torch.tensor([65504.0, 65519.0, 65520.0, 2.0 ** -25, 3 * 2.0 ** -26])])
    floats = torch.cat([uniform_bits.to(torch.int32).view(torch.float32), nudged])
    floats = floats[~torch.isnan(floats)]
    bits = floats.view(torch.int32).tolist()
    answers = run_tool(java_classpath, [f"half {b & 0xFFFFFFFF:08x}" for b in bits])
    want16 = floats.to(torch.float16).view(torch.int16).tolist()
    wantbf = floats.to(torch.bfloat16).view(torch.int16).tolist()
    mismatches = []
    for b, answer, h, bf in zip(bits, answers, want16, wantbf, strict=True):
        got16, gotbf = (int(x, 16) for x in answer.split())
        if (got16, gotbf) != (h & 0xFFFF, bf & 0xFFFF):
            mismatches.append((f"{b & 0xFFFFFFFF:08x}", answer, f"{h & 0xFFFF:04x}",
                               f"{bf & 0xFFFF:04x}"))
    assert not mismatches, mismatches[:10]


# -- the ``signs`` payload kind (docs/wire.md section 14): EF-signSGD's and the vote's --------

SIGNS_GOLDEN = ROOT / "tests" / "golden" / "payloads" / "signs.json"

# fedgc.methods.efsign.SignsCodec.decode's messages, classified into the Java reasons.
SIGNS_REASONS = [
    (r"^truncated input", "TRUNCATED"),
    (r"^bad magic", "BAD_MAGIC"),
    (r"^unsupported version", "UNSUPPORTED_VERSION"),
    (r"^trailing or oversized", "TRAILING"),
    (r"^bad checksum", "BAD_CHECKSUM"),
    (r"is not valid utf-8", "BAD_UTF8"),
    (r"appears twice", "DUPLICATE_NAME"),
    (r"above the bound", "TOO_LARGE"),
    (r"scale is NaN or Inf", "NON_FINITE_VALUE"),
    (r"scale is negative|padding after its last sign", "BAD_VALUE_SECTION"),
]


def _signs_reason(message: str) -> str:
    for pattern, reason in SIGNS_REASONS:
        if re.search(pattern, message):
            return reason
    raise AssertionError(f"unclassified signs decode message: {message}")


def _signs_messages() -> list[bytes]:
    """Real EF-signSGD and vote payloads: odd sizes (padding bits), a scalar, an empty tensor,
    zeros, a second round with a residual."""
    from fedgc.methods import get
    from fedgc.settings import RunConfig

    g = torch.Generator().manual_seed(7)
    grads = {"conv.weight": torch.randn(16, 8, 3, 3, generator=g),
             "fc.weight": torch.randn(10, 255, generator=g), "fc.bias": torch.zeros(10),
             "scalar": torch.randn((), generator=g), "empty": torch.zeros(0, 4)}
    out = []
    for name in ("efsign", "signvote"):
        train = RunConfig.from_flat({"method": name, "run_name": "java"}).train
        method = get(name)
        comp = method.compressor(train, 3)
        for r in (1, 2):
            out.append(method.codec(train).encode(comp.compress(grads, sequence=r)))
    return out


def test_java_signs_driver_passes_golden_vectors_and_rejections(java_classpath: Path) -> None:
    run_driver(java_classpath, "SignsCodecTest", SIGNS_GOLDEN)


def test_java_reencodes_ef_signsgd_and_vote_payloads_byte_for_byte(java_classpath: Path) -> None:
    messages = _signs_messages()
    answers = run_tool(java_classpath, [f"signs {MAX_NUMEL} {m.hex()}" for m in messages])
    assert answers == [f"OK {m.hex()}" for m in messages]


def test_java_and_python_agree_on_mutated_signs_messages(java_classpath: Path) -> None:
    import json

    from fedgc.methods import Bound
    from fedgc.methods.efsign import SignsCodec

    golden = [bytes.fromhex(c["hex"]) for c in json.loads(SIGNS_GOLDEN.read_text())["cases"]]
    rng = random.Random(29)
    messages = [m for base in golden + _signs_messages()[:2] for m in _mutations(base, rng, 150)]
    bound = 4096  # the caller's bound: the largest tensor above has 1,152 entries
    answers = run_tool(java_classpath, [f"signs {bound} {m.hex()}" for m in messages])
    seen, accepted = set(), 0
    for message, answer in zip(messages, answers, strict=True):
        try:
            SignsCodec().decode(message, Bound({}, limit=bound))
        except DecodeError as e:
            reason = _signs_reason(str(e))
            assert answer == f"REJECT {reason}", f"Python: {e}; Java: {answer}"
            seen.add(reason)
            continue
        assert answer.startswith("OK "), answer
        # Java re-encodes what it read: Python's decoding, encoded again, is that message.
        assert bytes.fromhex(answer[3:]) == message
        accepted += 1
    assert accepted > 0
    assert {"TRUNCATED", "TRAILING", "BAD_CHECKSUM", "TOO_LARGE"} <= seen, seen


# -- dgc_sets' host steps on the Java side (docs/android.md, "What dgc_sets needs on a phone") --

DGC_SETS_GOLDEN = ROOT / "tests" / "golden" / "dgc_sets.json"


def test_java_dgc_sets_driver_passes_golden_vectors_and_rejections(java_classpath: Path) -> None:
    """The rank request's decoder, the ranking and its sets, the grid, the grid-coded writer,
    take_values with encode_values and the join of a ranked patch, against the vectors the
    Python side wrote (tests/golden/dgc_sets_golden.py), and malformed rank requests."""
    # the rank request's prefixes and bit flips included
    assert run_driver(java_classpath, "DgcSetsTest", DGC_SETS_GOLDEN) > 500


def test_the_dgc_sets_golden_file_is_what_the_python_side_writes_now() -> None:
    """The golden vectors still hold for the Python side (a change there must regenerate them,
    deliberately). Exact on any CPU: the one float reduction, ``on_grid``'s float32 mean, only
    picks a power-of-two exponent, and none of the vectors' means lies near a rounding edge."""
    import json

    from tests.golden.dgc_sets_golden import golden

    assert json.loads(DGC_SETS_GOLDEN.read_text("utf-8")) == json.loads(json.dumps(golden()))


def test_java_rounds_compressor_updates_to_the_grid_as_python_does(java_classpath: Path) -> None:
    """``dgc.value_levels`` on real DGC updates (float16 and float32 values, three level
    counts): Java's values on the grid, grid-coded, and the rounding left for the residual are
    Python's bytes (``values_on_grid``, ``dgc.encode(..., grid_coding=True)``)."""
    from dgc.signs.client import values_on_grid

    lines, expected = [], []
    for k, update in enumerate(compressor_updates()[:6]):
        levels = (0.5, 4.0, 1.5)[k % 3]
        rounded, error = values_on_grid(update, levels)
        lines.append(f"grid {levels!r} {encode(update).hex()}")
        expected.append(f"OK {encode(rounded, grid_coding=True).hex()} {encode(error).hex()}")
    import tests.test_wire as wire_tests

    # the rounded updates really are grid-coded, a byte per value and Rice-coded
    dtypes = {d for e in expected
              for d in wire_tests.tensor_value_dtypes(bytes.fromhex(e.split()[1])).values()}
    assert {0x40, 0x41} <= dtypes, dtypes
    assert run_tool(java_classpath, lines) == expected


def test_java_grid_exponent_is_pythons_round_of_log2(java_classpath: Path) -> None:
    """``on_grid``'s step exponent, ``round(log2(mean / levels))`` (half to even) clipped to
    [-126, 120], which Java decides without a log2: 3,000 seeded float32 means over the whole
    range and levels, and 300 means whose ratio lies next to a half-integer power of two."""
    import math

    import numpy as np

    rng = np.random.default_rng(39)
    means = (rng.random(3000) * 2.0 ** rng.integers(-149, 128, 3000)).astype(np.float32)
    levels = rng.choice([0.5, 1.0, 4.0, 0.3, 7.25], 3000) * rng.random(3000).round(3).clip(1e-3)
    pairs = [(float(m), float(lv)) for m, lv in zip(means, levels, strict=True) if m > 0]
    for n in rng.integers(-60, 60, 300):
        lv = float(rng.choice([0.5, 1.0, 3.0]))
        mean = np.float32(math.sqrt(2.0) * 2.0 ** int(n) * lv)
        pairs += [(float(np.nextafter(mean, np.float32(d))), lv) for d in (-np.inf, np.inf)]
        pairs.append((float(mean), lv))
    lines = [f"exponent {np.float32(m).view(np.uint32):08x} "
             f"{np.float64(lv).view(np.uint64):016x}" for m, lv in pairs]
    want = [str(min(max(round(math.log2(m / lv)), -126), 120)) for m, lv in pairs]
    assert run_tool(java_classpath, lines) == want


# dgc.signs.codec.decode_rank_request's messages, classified into the Java reasons.
RANK_REASONS = [
    (r"^truncated input", "TRUNCATED"),
    (r"^bad magic", "BAD_MAGIC"),
    (r"^unsupported version", "UNSUPPORTED_VERSION"),
    (r"^bad checksum", "BAD_CHECKSUM"),
    (r"^trailing or oversized", "TRAILING"),
    (r"^rank request flags", "UNSUPPORTED_FLAGS"),
    (r"is not valid utf-8", "BAD_UTF8"),
    (r"appears twice", "DUPLICATE_NAME"),
    (r"^ranked set of .* (is for|holds|draws)", "BAD_RANKED_SET"),
]


def test_java_and_python_agree_on_mutated_rank_requests(java_classpath: Path) -> None:
    """A rank request (``dgc.shared_rank = displacement``), damaged 1,200 ways: the Java decoder
    (``RankRequest``) accepts what ``decode_rank_request`` accepts, with the same content, and
    refuses the rest for the reason Python's message gives."""
    from dgc.signs.codec import decode_rank_request, encode_rank_request

    numels = {"conv.weight": 432, "fc.weight": 2560, "b": 10}
    spec = ",".join(f"{n}={v}" for n, v in numels.items())
    bases = [encode_rank_request({"conv.weight": 40, "fc.weight": 25}, numels, 3, False),
             encode_rank_request({"fc.weight": 2560, "b": 1}, numels, 2**64 - 1, True),
             encode_rank_request({"conv.weight": 40, "b": 5}, numels, 9, False,
                                 {"conv.weight": 4})]
    rng = random.Random(39)
    messages = [m for base in bases for m in [base, *_mutations(base, rng, 400)]]
    answers = run_tool(java_classpath, [f"rank {spec} {m.hex()}" for m in messages])
    seen, accepted = set(), 0
    for message, answer in zip(messages, answers, strict=True):
        try:
            sequence, counts, grid, explore = decode_rank_request(message, numels)
        except DecodeError as e:
            reason = next((r for p, r in RANK_REASONS if re.search(p, str(e))), str(e))
            assert answer == f"REJECT {reason}", f"Python: {e}; Java: {answer}"
            seen.add(reason)
            continue
        sets = ",".join(f"{n}:{k}:{explore.get(n, 0)}" for n, k in counts.items())
        assert answer == f"OK {sequence} {int(grid)} {sets}", message.hex()
        accepted += 1
    assert accepted >= len(bases)
    assert {"TRUNCATED", "TRAILING", "BAD_CHECKSUM", "BAD_RANKED_SET"} <= seen, seen


DOWNLINK_GOLDEN = ROOT / "tests" / "golden" / "downlink.json"


def test_java_downlink_driver_passes_golden_vectors_and_rejections(java_classpath: Path) -> None:
    """A round's shared index sets (``FGCM``, ``SharedMask``) and compact updates (``FGCK``,
    ``CompactCodec``) against the vectors the Python side wrote (tests/golden/downlink_golden.py):
    9 masks decoded and re-encoded byte for byte, 11 compact updates decoded to Python's indices
    and value bits (every index and value coding, a patch's layout), 27 malformed masks and 41
    malformed compact messages refused for Python's reason, every prefix and bit flip refused."""
    # each golden message's prefixes and bit flips are a check apiece: tens of thousands
    assert run_driver(java_classpath, "DownlinkTest", DOWNLINK_GOLDEN) > 40_000


def test_the_downlink_golden_file_is_what_the_python_side_writes_now() -> None:
    """The downlink golden vectors still hold for the Python side (a change there must
    regenerate them, deliberately); no float arithmetic is involved."""
    import json

    from tests.golden.downlink_golden import golden

    assert json.loads(DOWNLINK_GOLDEN.read_text("utf-8")) == json.loads(json.dumps(golden()))


def test_java_and_python_agree_on_mutated_masks(java_classpath: Path) -> None:
    """A round's shared index sets (``FGCM``), damaged 1,200 ways: the Java decoder
    (``SharedMask``) accepts what ``decode_mask`` accepts, with the same sets, and refuses the
    rest for the reason Python's message gives."""
    import numpy as np

    from dgc.signs.codec import decode_mask, encode_mask
    from tests.golden.downlink_golden import MASK_REASONS, reason

    numels = {"conv.weight": 432, "fc.weight": 2560, "b": 10}
    spec = ",".join(f"{n}={v}" for n, v in numels.items())
    bases = [encode_mask({"conv.weight": np.arange(3, 432, 11), "fc.weight": np.array([0, 2559])},
                         numels, 3),
             encode_mask({"fc.weight": np.arange(0, 2560, 2), "b": np.arange(10)}, numels,
                         2**64 - 1),
             encode_mask({"b": np.array([4]), "conv.weight": np.array([], dtype=np.int64)},
                         numels, 9)]
    rng = random.Random(39)
    messages = [m for base in bases for m in [base, *_mutations(base, rng, 400)]]
    answers = run_tool(java_classpath, [f"mask {spec} {m.hex()}" for m in messages])
    seen, accepted = set(), 0
    for message, answer in zip(messages, answers, strict=True):
        try:
            sequence, sets = decode_mask(message, numels)
        except DecodeError as e:
            why = reason(MASK_REASONS, str(e))
            assert answer == f"REJECT {why}", f"Python: {e}; Java: {answer}"
            seen.add(why)
            continue
        text = ",".join(f"{n}:{'.'.join(map(str, s.tolist()))}" for n, s in sets.items())
        assert answer == f"OK {sequence} {text}".rstrip(" "), message.hex()
        accepted += 1
    assert accepted >= len(bases)
    want = {"TRUNCATED", "TRAILING", "BAD_CHECKSUM", "BAD_INDEX_SET", "BAD_INDEX_SECTION"}
    assert want <= seen, seen


def test_java_and_python_agree_on_mutated_compact_updates(java_classpath: Path) -> None:
    """Compact updates (``FGCK``) on a model's layout and a patch's, damaged 1,500 ways: the
    Java decoder (``CompactCodec``) accepts what ``decode_compact`` accepts, with the same
    tensors (both re-encoded as an update message), and refuses the rest for the reason
    Python's message gives."""
    import numpy as np

    from dgc.wire.compact import decode_compact, encode_compact, layout_of
    from fedgc import context_patch
    from tests.golden.downlink_golden import COMPACT_REASONS, reason

    shapes = {"fc.weight": (10, 30), "fc.bias": (10,), "conv": (2, 3, 3), "s": ()}
    spec = ",".join(f"{n}={'x'.join(map(str, s))}" for n, s in shapes.items())
    model = layout_of(shapes)
    patch = context_patch.patch_layout(shapes, ["fc.weight"])

    def t(indices: list[int], values, shape: tuple[int, ...]) -> SparseTensor:
        return SparseTensor(torch.tensor(indices, dtype=torch.int64),
                            torch.as_tensor(np.asarray(values, np.float32)), shape)

    idx = list(range(1, 300, 7))
    grid = [((i % 5) - 2) * 0.125 for i in range(len(idx))]
    signs = [0.5 if i % 3 else -0.5 for i in range(len(idx))]
    bases = [
        (encode_compact(SparseUpdate({"fc.weight": t(idx, [0.01 * i for i in range(len(idx))],
                                                     (10, 30)),
                                      "s": t([0], [2.5], ())}, 4), model), model, "-"),
        (encode_compact(SparseUpdate({"fc.weight": t(idx, grid, (10, 30)),
                                      "fc.bias": t(list(range(10)), [0.5] * 10, (10,))}, 5),
                        model, grid_coding=True), model, "-"),
        (encode_compact(SparseUpdate({"fc.weight": t(idx, signs, (10, 30))}, 6), model,
                        sign_coding=True), model, "-"),
        (encode_compact(SparseUpdate({"conv": t(list(range(18)), [(-1) ** i * 0.25 * (1 + i % 3)
                                                                  for i in range(18)], (2, 3, 3))},
                                     7), model, grid_coding=True, nonzero_grid=True), model, "-"),
        (encode_compact(SparseUpdate({"fc.weight#0": t([0, 5], [1.0, -1.0], (6,)),
                                      "fc.weight#4": t([3], [0.5], (180,))}, 8), patch),
         patch, "fc.weight"),
    ]
    rng = random.Random(39)
    cases = [(m, layout, context) for base, layout, context in bases
             for m in [base, *_mutations(base, rng, 300)]]
    answers = run_tool(java_classpath, [f"compact 300 {spec} {context} {m.hex()}"
                                        for m, _, context in cases])
    seen, accepted = set(), 0
    for (message, layout, _), answer in zip(cases, answers, strict=True):
        try:
            update = decode_compact(message, layout, max_numel=300)
        except DecodeError as e:
            why = reason(COMPACT_REASONS, str(e))
            assert answer == f"REJECT {why}", f"Python: {e}; Java: {answer}; {message.hex()}"
            seen.add(why)
            continue
        assert answer == f"OK {encode(update).hex()}", message.hex()
        accepted += 1
    assert accepted >= len(bases)
    assert {"TRUNCATED", "TRAILING", "BAD_CHECKSUM", "BAD_VARINT", "BAD_PLACE",
            "COUNT_ABOVE_NUMEL", "BAD_VALUE_SECTION"} <= seen, seen
