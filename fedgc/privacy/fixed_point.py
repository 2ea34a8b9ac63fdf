"""Fixed point for secure aggregation: float vectors to integers modulo 2^b and the sum back.

Secure aggregation sums integers in the ring Z_M, M = 2^``modulus_bits`` (masks are uniform in
it, so they hide a value only there). A client's float vector goes in as follows:

1. every coordinate is clamped to ``[-clip, clip]`` (saturated, not wrapped; :meth:`encode`
   counts the clamped coordinates so that a run can see a clip that is too small);
2. scaled to ``[-R, R]``, ``R = 2^(value_bits - 1) - 1`` (one step is ``clip / R``), and rounded
   stochastically to an integer (unbiased: ``E[round(y)] = y``, the error below one step);
3. written in two's complement modulo M (``-1`` is ``M - 1``).

The sum of ``n`` such vectors lies in ``[-nR, nR]``; it is read back by the centered lift (a
ring value ``>= M/2`` is negative) and times the step. Overflow:

- *Honest clients never overflow*: a FixedPoint holds ``n`` clients only when ``nR < M/2``
  (:meth:`capacity`; :meth:`check_clients` refuses more), so the sum of in-range vectors never
  wraps.
- *A client that sends a ring vector outside its range* (a bug, another range, or malice: the
  masked message is uniform, so nobody can check one client's range) makes the sum wrap modulo
  M. :meth:`decode_sum` detects a coordinate that lands in the headroom between ``nR`` and
  ``M/2`` and raises :class:`SumOutOfRange`; a wrapped coordinate that lands back inside
  ``[-nR, nR]`` cannot be told from an honest sum. Each bit of headroom
  (``modulus_bits - min_modulus_bits``) halves the chance that a uniformly random coordinate
  goes undetected. Secure aggregation gives no integrity against malicious clients; this is a
  check, not a defence.

The rounding error of the sum of ``n`` clients is below ``n`` steps per coordinate
(:meth:`error_bound`), its standard deviation at most ``sqrt(n) / 2`` steps.

Flower's SecAgg+ quantizes with the same idea (``flwr.common.secure_aggregation.quantization``:
a shift to ``[0, 2c]``, 2^22 levels, stochastic rounding, modulus 2^32); this one keeps the
sign in two's complement, so that the sum needs no shift by the number of clients and a client
that adds integer noise (the distributed discrete Gaussian, :mod:`fedgc.privacy.dp.noise`)
adds it to the same integers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["MAX_MODULUS_BITS", "FixedPoint", "FixedPointError", "SumOutOfRange"]

#: The widest ring: ring values are held in uint64 and sums of many of them must not wrap the
#: int64 arithmetic of the centered lift.
MAX_MODULUS_BITS = 62


class FixedPointError(ValueError):
    """A fixed-point configuration that cannot hold what it is asked to (the message says
    which value and what was expected)."""


class SumOutOfRange(FixedPointError):
    """A decoded sum has coordinates outside what its clients' in-range vectors can produce:
    at least one client sent a ring vector outside the fixed-point range."""


@dataclass(frozen=True)
class FixedPoint:
    """Signed fixed point in the ring of integers modulo ``2^modulus_bits`` (module docstring).

    Parameters
    ----------
    clip : float
        The largest magnitude a coordinate keeps; larger ones are clamped to it.
    value_bits : int
        Bits of one client's integer, sign included: coordinates become integers in ``[-R, R]``,
        ``R = 2^(value_bits - 1) - 1``; one step is ``clip / R``.
    modulus_bits : int
        ``b`` of the ring's modulus ``M = 2^b`` (what each coordinate costs on the wire, bit
        packed); at least ``value_bits + 1``, at most :data:`MAX_MODULUS_BITS`.
    """

    clip: float = 1.0
    value_bits: int = 16
    modulus_bits: int = 32

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise FixedPointError(f"clip = {self.clip!r}: expected a finite value > 0")
        if not 2 <= self.value_bits <= MAX_MODULUS_BITS - 1:
            raise FixedPointError(f"value_bits = {self.value_bits}: expected 2 to "
                                  f"{MAX_MODULUS_BITS - 1}")
        if not self.value_bits + 1 <= self.modulus_bits <= MAX_MODULUS_BITS:
            raise FixedPointError(f"modulus_bits = {self.modulus_bits}: expected value_bits + 1 "
                                  f"= {self.value_bits + 1} to {MAX_MODULUS_BITS}")

    # ------------------------------------------------------------------ sizes
    @property
    def levels(self) -> int:
        """``R``: a client's integers lie in ``[-R, R]``."""
        return (1 << (self.value_bits - 1)) - 1

    @property
    def step(self) -> float:
        """The value of one integer step, ``clip / R``."""
        return self.clip / self.levels

    @property
    def modulus(self) -> int:
        """``M = 2^modulus_bits``."""
        return 1 << self.modulus_bits

    def capacity(self) -> int:
        """The most clients whose sum cannot wrap: the largest ``n`` with ``nR < M/2``."""
        return (self.modulus // 2 - 1) // self.levels

    def check_clients(self, clients: int) -> None:
        """FixedPointError unless the sum of ``clients`` in-range vectors fits the ring."""
        if clients > self.capacity():
            raise FixedPointError(
                f"{clients} clients: the sum of their values (up to {clients} x {self.levels}) "
                f"would wrap modulo 2^{self.modulus_bits}; this fixed point holds at most "
                f"{self.capacity()} (modulus_bits >= "
                f"{self.min_modulus_bits(clients, self.value_bits)} for {clients})")

    @staticmethod
    def min_modulus_bits(clients: int, value_bits: int) -> int:
        """The fewest modulus bits whose ring holds the sum of ``clients`` vectors of
        ``value_bits`` (``clients * R < 2^(b-1)``)."""
        levels = (1 << (value_bits - 1)) - 1
        return max(value_bits + 1, (clients * levels).bit_length() + 1)

    @classmethod
    def for_clients(cls, clients: int, clip: float = 1.0, value_bits: int = 16,
                    headroom_bits: int = 0) -> FixedPoint:
        """The narrowest fixed point for ``clients`` (plus ``headroom_bits`` of detection,
        module docstring)."""
        if clients < 1 or headroom_bits < 0:
            raise FixedPointError(f"clients = {clients}, headroom_bits = {headroom_bits}: "
                                  f"expected >= 1 and >= 0")
        bits = cls.min_modulus_bits(clients, value_bits) + headroom_bits
        return cls(clip, value_bits, bits)

    def error_bound(self, clients: int) -> float:
        """A bound on ``|decoded sum - true sum|`` per coordinate for ``clients`` in-range
        vectors: each stochastic rounding errs by less than one step."""
        return clients * self.step

    # ------------------------------------------------------------------ client side
    def quantize(self, values: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        """(int64 integers in ``[-R, R]``, coordinates clamped): steps 1 and 2."""
        x = np.asarray(values, dtype=np.float64)
        if not np.isfinite(x).all():
            raise FixedPointError(f"{int((~np.isfinite(x)).sum())} coordinates are NaN or Inf; "
                                  f"fixed point takes finite values")
        clamped = int((np.abs(x) > self.clip).sum())
        scaled = np.clip(x, -self.clip, self.clip) * (self.levels / self.clip)
        low = np.floor(scaled)
        up = rng.random(scaled.shape) < (scaled - low)
        # The product may land a float ulp beyond R at the clip; rounding up there must not
        # leave [-R, R].
        ints = np.clip(low.astype(np.int64) + up, -self.levels, self.levels)
        return ints, clamped

    def to_ring(self, ints: np.ndarray) -> np.ndarray:
        """Integers (any sign) as uint64 ring elements modulo M (two's complement)."""
        return np.asarray(ints, dtype=np.int64).astype(np.uint64) & np.uint64(self.modulus - 1)

    def encode(self, values: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        """(the ring vector of ``values``, how many coordinates were clamped)."""
        ints, clamped = self.quantize(values, rng)
        return self.to_ring(ints), clamped

    # ------------------------------------------------------------------ server side
    def from_ring(self, ring: np.ndarray, bound: int) -> np.ndarray:
        """The centered lift of a ring vector (values ``>= M/2`` are negative), as int64;
        :class:`SumOutOfRange` for a coordinate beyond ``bound`` in magnitude."""
        r = np.asarray(ring, dtype=np.uint64) & np.uint64(self.modulus - 1)
        half = np.uint64(self.modulus // 2)
        lifted = r.astype(np.int64) - np.where(r >= half, np.int64(self.modulus), np.int64(0))
        out = np.abs(lifted) > bound
        if out.any():
            raise SumOutOfRange(
                f"{int(out.sum())} of {lifted.size} coordinates of the sum lie beyond {bound} "
                f"(the most in-range clients can produce), e.g. {int(lifted[out][0])}: a client "
                f"sent a vector outside the fixed-point range (or more clients were summed than "
                f"counted)")
        return lifted

    def decode_sum(self, ring_sum: np.ndarray, clients: int) -> np.ndarray:
        """The float64 sum of ``clients`` encoded vectors from their ring sum."""
        self.check_clients(clients)
        return self.from_ring(ring_sum, clients * self.levels) * self.step
