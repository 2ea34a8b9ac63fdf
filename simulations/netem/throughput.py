"""Link throughput over time: a constant rate, or a looping trace integrated exactly.

Two trace kinds are read:

* throughput traces, text lines ``t_seconds mbps``: the rate is piecewise constant, each sample
  holding from its time until the next sample's; the last sample holds for as long as the
  interval before it (a trace sampled every second lasts one second past its last line), unless
  an explicit ``period_s`` is given;
* Mahimahi delivery-opportunity traces (``mm-link``): one integer millisecond timestamp per line,
  each an opportunity to deliver one 1500-byte packet; the trace loops with the last timestamp
  as its period, as Mahimahi does.

Both loop forever. Times handed in are virtual seconds on the simulation clock; a trace can be
shifted by a phase (``offset_s``) so that clients sharing one trace do not see it in lockstep.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from simulations.netem.errors import LinkConfigError, TraceError

MAHIMAHI_PACKET_BYTES = 1500
_BITS_PER_MBIT = 1e6
#: Bounds of a trace, far outside any measured link: a rate of 1e308 Mbit/s overflowed the
#: integration (every transfer then took NaN seconds), a period of 2^63 ms made a round take
#: 1.3e16 virtual seconds. Rates up to 1 Tbit/s, one loop up to 30 days, and at least 1 kbit/s
#: on average over a loop (a Mahimahi trace: one 1500-byte packet every 12 s).
MAX_TRACE_MBPS = 1e6
MAX_TRACE_PERIOD_S = 30 * 86_400.0
MIN_TRACE_MEAN_MBPS = 1e-3


class Throughput(Protocol):
    """What a link direction needs from its bandwidth model."""

    def bits_between(self, t0_s: float, t1_s: float) -> float:
        """Bits deliverable in ``[t0_s, t1_s]`` with the link up the whole time."""
        ...

    def time_for_bits(self, t0_s: float, bits: float) -> float:
        """The earliest time by which ``bits`` bits sent from ``t0_s`` have been delivered."""
        ...

    @property
    def mean_mbps(self) -> float:
        """Long-run average rate in Mbit/s."""
        ...


@dataclass(frozen=True)
class ConstantRate:
    """A link direction with a fixed rate.

    Parameters
    ----------
    mbps : float
        The rate in Mbit/s (10**6 bits per second), > 0.
    """

    mbps: float

    def __post_init__(self) -> None:
        if (isinstance(self.mbps, bool) or not isinstance(self.mbps, (int, float))
                or not math.isfinite(self.mbps) or self.mbps <= 0):
            raise LinkConfigError(f"ConstantRate.mbps must be a finite number > 0, "
                                  f"got {self.mbps!r}")

    @property
    def mean_mbps(self) -> float:
        return float(self.mbps)

    def bits_between(self, t0_s: float, t1_s: float) -> float:
        return max(0.0, t1_s - t0_s) * self.mbps * _BITS_PER_MBIT

    def time_for_bits(self, t0_s: float, bits: float) -> float:
        if bits <= 0:
            return t0_s
        return t0_s + bits / (self.mbps * _BITS_PER_MBIT)


class Trace:
    """A looping throughput trace whose cumulative delivered bits are integrated exactly.

    Build it with :meth:`from_samples`, :meth:`from_mahimahi`, or the ``load_*`` functions.

    Parameters
    ----------
    knots_s : numpy.ndarray
        Times within one period, from 0 to the period, increasing.
    cum_bits : numpy.ndarray
        Bits delivered from the period start up to each knot (``"linear"``: interpolated between
        knots, a piecewise-constant rate; ``"step"``: the count jumps at each knot, a delivery
        opportunity).
    kind : str
        ``"linear"`` or ``"step"``.
    period_s : float
        Length of one loop of the trace in seconds.
    offset_s : float
        Phase: virtual time ``t`` reads the trace at ``t + offset_s``.
    name : str
        Where the trace came from, for messages.
    """

    def __init__(self, knots_s: np.ndarray, cum_bits: np.ndarray, kind: str, period_s: float,
                 offset_s: float = 0.0, name: str = "trace") -> None:
        if kind not in ("linear", "step"):
            raise TraceError(f"trace kind must be 'linear' or 'step', got {kind!r}")
        if not math.isfinite(offset_s):
            raise LinkConfigError(f"Trace.offset_s must be finite, got {offset_s!r}")
        self.knots_s = knots_s
        self.cum_bits = cum_bits
        self.kind = kind
        self.period_s = float(period_s)
        self.offset_s = float(offset_s)
        self.name = name
        self.bits_per_period = float(cum_bits[-1])
        if self.bits_per_period <= 0:
            raise TraceError(f"trace {name!r} delivers no bits in its period of "
                             f"{self.period_s:g} s; a link needs some throughput")
        if not 0 < self.period_s <= MAX_TRACE_PERIOD_S:
            raise TraceError(f"trace {name!r} loops every {self.period_s:g} s; expected at most "
                             f"{MAX_TRACE_PERIOD_S:g} s (30 days)")
        if self.mean_mbps < MIN_TRACE_MEAN_MBPS:
            raise TraceError(f"trace {name!r} averages {self.mean_mbps:.3g} Mbit/s over its "
                             f"period; expected at least {MIN_TRACE_MEAN_MBPS:g} Mbit/s (1 kbit/s)")

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_samples(cls, times_s: np.ndarray | list[float], mbps: np.ndarray | list[float],
                     period_s: float | None = None, name: str = "trace") -> Trace:
        """A piecewise-constant trace: ``mbps[i]`` holds from ``times_s[i]`` to the next time.

        Times are shifted so that the first is 0.
        """
        t = np.asarray(times_s, dtype=np.float64)
        r = np.asarray(mbps, dtype=np.float64)
        if t.ndim != 1 or t.shape != r.shape or t.size == 0:
            raise TraceError(f"trace {name!r} needs equal, non-empty lists of times and rates, "
                             f"got {t.shape} and {r.shape}")
        if not (np.isfinite(t).all() and np.isfinite(r).all()):
            raise TraceError(f"trace {name!r} has a non-finite time or rate")
        if ((r < 0) | (r > MAX_TRACE_MBPS)).any():
            i = int(np.argmax((r < 0) | (r > MAX_TRACE_MBPS)))
            raise TraceError(f"trace {name!r} sample {i} has rate {float(r[i])!r} Mbit/s; "
                             f"rates must be in [0, {MAX_TRACE_MBPS:g}]")
        if t.size > 1 and (np.diff(t) <= 0).any():
            i = int(np.argmax(np.diff(t) <= 0)) + 1
            raise TraceError(f"trace {name!r} sample {i} has time {float(t[i])!r} s, not after the "
                             f"previous {float(t[i - 1])!r} s; times must increase")
        t = t - t[0]
        if period_s is None:
            last_interval = float(t[-1] - t[-2]) if t.size > 1 else 1.0
            period_s = float(t[-1]) + last_interval
        elif not math.isfinite(period_s) or period_s <= t[-1]:
            raise TraceError(f"trace {name!r} period_s must be > the last sample time "
                             f"{t[-1]:g} s, got {period_s!r}")
        knots = np.append(t, period_s)
        seg_bits = np.diff(knots) * r * _BITS_PER_MBIT
        cum = np.concatenate(([0.0], np.cumsum(seg_bits)))
        return cls(knots, cum, "linear", period_s, name=name)

    @classmethod
    def from_mahimahi(cls, timestamps_ms: np.ndarray | list[int],
                      packet_bytes: int = MAHIMAHI_PACKET_BYTES, name: str = "mahimahi") -> Trace:
        """A delivery-opportunity trace: each timestamp delivers one ``packet_bytes`` packet."""
        ts = np.asarray(timestamps_ms)
        if ts.ndim != 1 or ts.size == 0:
            raise TraceError(f"Mahimahi trace {name!r} needs at least one timestamp")
        if not np.issubdtype(ts.dtype, np.integer):
            raise TraceError(f"Mahimahi trace {name!r} timestamps must be integer milliseconds")
        if (ts < 0).any():
            raise TraceError(f"Mahimahi trace {name!r} has a negative timestamp "
                             f"{int(ts[np.argmax(ts < 0)])}")
        if ts.size > 1 and (np.diff(ts) < 0).any():
            i = int(np.argmax(np.diff(ts) < 0)) + 1
            raise TraceError(f"Mahimahi trace {name!r} line {i + 1} has timestamp {int(ts[i])} ms, "
                             f"before the previous {int(ts[i - 1])} ms")
        if int(ts[-1]) <= 0:
            raise TraceError(f"Mahimahi trace {name!r} must end after 0 ms (its last timestamp is "
                             f"the loop period)")
        knots = ts.astype(np.float64) / 1000.0
        cum = np.arange(1, ts.size + 1, dtype=np.float64) * packet_bytes * 8
        return cls(knots, cum, "step", float(knots[-1]), name=name)

    def shifted(self, offset_s: float) -> Trace:
        """The same trace read ``offset_s`` seconds later (arrays are shared, not copied)."""
        return Trace(self.knots_s, self.cum_bits, self.kind, self.period_s,
                     (self.offset_s + offset_s) % self.period_s, self.name)

    # -- integration --------------------------------------------------------------------------
    @property
    def mean_mbps(self) -> float:
        return self.bits_per_period / self.period_s / _BITS_PER_MBIT

    def _within(self, r_s: float) -> float:
        """Bits delivered in ``[0, r_s]`` of one period."""
        if self.kind == "linear":
            return float(np.interp(r_s, self.knots_s, self.cum_bits))
        n = int(np.searchsorted(self.knots_s, r_s, side="right"))
        return float(self.cum_bits[n - 1]) if n else 0.0

    def cumulative_bits(self, t_s: float) -> float:
        """Bits delivered from trace time 0 (virtual time ``-offset_s``) up to ``t_s``."""
        tt = t_s + self.offset_s
        loops = math.floor(tt / self.period_s)
        return loops * self.bits_per_period + self._within(tt - loops * self.period_s)

    def bits_between(self, t0_s: float, t1_s: float) -> float:
        if t1_s <= t0_s:
            return 0.0
        return self.cumulative_bits(t1_s) - self.cumulative_bits(t0_s)

    def time_for_bits(self, t0_s: float, bits: float) -> float:
        if bits <= 0:
            return t0_s
        target = self.cumulative_bits(t0_s) + bits
        loops = math.floor(target / self.bits_per_period)
        rest = target - loops * self.bits_per_period
        if rest <= 0:  # exactly at a period boundary: the last delivery of the period before
            loops -= 1
            rest = self.bits_per_period
        if self.kind == "linear":
            i = int(np.searchsorted(self.cum_bits, rest, side="left"))
            i = min(max(i, 1), self.cum_bits.size - 1)
            c0, c1 = self.cum_bits[i - 1], self.cum_bits[i]
            k0, k1 = self.knots_s[i - 1], self.knots_s[i]
            within = float(k0 + (rest - c0) / (c1 - c0) * (k1 - k0))
        else:
            i = int(np.searchsorted(self.cum_bits, rest, side="left"))
            within = float(self.knots_s[min(i, self.knots_s.size - 1)])
        return max(t0_s, loops * self.period_s + within - self.offset_s)

    def __repr__(self) -> str:
        return (f"Trace(name={self.name!r}, kind={self.kind!r}, period_s={self.period_s:g}, "
                f"mean_mbps={self.mean_mbps:.3f}, offset_s={self.offset_s:g})")


def _read_lines(path: str | os.PathLike[str]) -> list[tuple[int, list[str]]]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise TraceError(f"cannot read trace file {os.fspath(path)!r}: {e.strerror}") from e
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        body = line.split("#", 1)[0].strip()
        if body:
            rows.append((lineno, body.replace(",", " ").split()))
    if not rows:
        raise TraceError(f"trace file {os.fspath(path)!r} has no samples")
    return rows


def load_throughput_trace(path: str | os.PathLike[str], period_s: float | None = None) -> Trace:
    """Read a ``t_seconds mbps`` trace (blank lines and ``#`` comments are skipped)."""
    times, rates = [], []
    for lineno, cols in _read_lines(path):
        if len(cols) != 2:
            raise TraceError(f"{os.fspath(path)}:{lineno}: expected 't_seconds mbps', "
                             f"got {' '.join(cols)!r}")
        try:
            times.append(float(cols[0]))
            rates.append(float(cols[1]))
        except ValueError as e:
            raise TraceError(f"{os.fspath(path)}:{lineno}: not a number in "
                             f"{' '.join(cols)!r}") from e
    return Trace.from_samples(times, rates, period_s, name=os.path.basename(path))


_MAX_STAMP_DIGITS = len(str(int(MAX_TRACE_PERIOD_S * 1000)))


def load_mahimahi_trace(path: str | os.PathLike[str],
                        packet_bytes: int = MAHIMAHI_PACKET_BYTES) -> Trace:
    """Read a Mahimahi trace: one integer millisecond timestamp per line."""
    stamps = []
    for lineno, cols in _read_lines(path):
        # ASCII digits only: str.isdigit() also accepts '²', which int() refuses.
        if len(cols) != 1 or not (cols[0].isascii() and cols[0].isdigit()):
            raise TraceError(f"{os.fspath(path)}:{lineno}: expected one integer millisecond "
                             f"timestamp, got {' '.join(cols)[:80]!r}")
        if len(cols[0].lstrip("0")) > _MAX_STAMP_DIGITS:
            raise TraceError(f"{os.fspath(path)}:{lineno}: timestamp {cols[0][:40]!r}"
                             f"{'...' if len(cols[0]) > 40 else ''} ms is past the longest "
                             f"trace period, {MAX_TRACE_PERIOD_S * 1000:.0f} ms")
        stamps.append(int(cols[0]))
    return Trace.from_mahimahi(np.asarray(stamps, dtype=np.int64), packet_bytes,
                               name=os.path.basename(path))


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read either trace format: one integer column is Mahimahi, two columns ``t_seconds mbps``."""
    rows = _read_lines(path)
    if all(len(cols) == 1 for _, cols in rows):
        return load_mahimahi_trace(path)
    return load_throughput_trace(path)
