"""Fixed point for secure aggregation (fedgc/privacy/fixed_point.py): the documented range,
clamping counted, unbiased rounding within one step, a modulus sized for its clients, and an
overflowing client detected in the sum's headroom."""

from __future__ import annotations

import numpy as np
import pytest

from fedgc.privacy import FixedPoint, FixedPointError, SumOutOfRange


def _sum(rings: list[np.ndarray], fp: FixedPoint) -> np.ndarray:
    total = np.zeros_like(rings[0])
    for r in rings:
        total += r
    return total & np.uint64(fp.modulus - 1)


def test_a_sum_decodes_within_its_bound_and_negatives_wrap_as_twos_complement():
    fp = FixedPoint(clip=2.0, value_bits=12, modulus_bits=20)
    assert fp.levels == 2047 and fp.step == pytest.approx(2.0 / 2047)
    assert fp.capacity() == (2 ** 19 - 1) // 2047
    rng = np.random.default_rng(0)
    xs = [rng.uniform(-2, 2, 1000) for _ in range(50)]
    rings = [fp.encode(x, rng)[0] for x in xs]
    assert all(int(r.max()) < fp.modulus for r in rings)
    # -1 step is M - 1.
    assert int(fp.to_ring(np.array([-1]))[0]) == fp.modulus - 1
    error = np.abs(fp.decode_sum(_sum(rings, fp), 50) - np.sum(xs, axis=0))
    assert error.max() < fp.error_bound(50)
    # Stochastic rounding is unbiased: the mean error over many coordinates is near 0, far
    # below the bound (deterministic rounding of these values would be off by a third of a
    # step on average).
    x = np.full(200_000, fp.step / 3)
    ints, _ = fp.quantize(x, rng)
    assert abs(ints.mean() * fp.step - fp.step / 3) < 0.01 * fp.step


def test_values_beyond_the_clip_are_clamped_and_counted():
    fp = FixedPoint(clip=1.0, value_bits=8, modulus_bits=16)
    ints, clamped = fp.quantize(np.array([0.5, 3.0, -7.0, 1.0, -1.0]), np.random.default_rng(1))
    assert clamped == 2
    assert ints[1] == fp.levels and ints[2] == -fp.levels and ints[3] == fp.levels
    with pytest.raises(FixedPointError, match="NaN or Inf"):
        fp.quantize(np.array([np.nan]), np.random.default_rng(1))


def test_a_fixed_point_holds_only_as_many_clients_as_cannot_wrap():
    fp = FixedPoint.for_clients(100, clip=1.0, value_bits=16)
    assert fp.modulus_bits == 23 and fp.capacity() >= 100
    assert FixedPoint.for_clients(100, value_bits=16, headroom_bits=3).modulus_bits == 26
    small = FixedPoint(1.0, 16, 20)
    with pytest.raises(FixedPointError, match="would wrap modulo 2\\^20.*modulus_bits >= 23"):
        small.decode_sum(np.zeros(3, dtype=np.uint64), 100)
    with pytest.raises(FixedPointError, match="modulus_bits = 16"):
        FixedPoint(1.0, 16, 16)
    with pytest.raises(FixedPointError, match="clip"):
        FixedPoint(0.0)


def test_a_client_outside_the_range_is_detected_in_the_headroom():
    def undetected(headroom_bits: int) -> int:
        fp = FixedPoint.for_clients(10, clip=1.0, value_bits=12, headroom_bits=headroom_bits)
        rng = np.random.default_rng(2)
        honest = [fp.encode(rng.uniform(-1, 1, 2000), rng)[0] for _ in range(9)]
        # A client that sends uniform ring elements (what a masked vector looks like, so nobody
        # can check it before the sum).
        rogue = rng.integers(0, fp.modulus, 2000, dtype=np.uint64)
        total = _sum([*honest, rogue], fp)
        with pytest.raises(SumOutOfRange, match="coordinates of the sum lie beyond"):
            fp.decode_sum(total, 10)
        lifted = fp.from_ring(total, bound=fp.modulus)
        return int((np.abs(lifted) <= 10 * fp.levels).sum())

    # A wrapped coordinate that lands back in range cannot be told from an honest one: each bit
    # of headroom halves how many do.
    tight, roomy = undetected(0), undetected(8)
    assert 300 < tight < 2000 and roomy < 0.01 * 2000
