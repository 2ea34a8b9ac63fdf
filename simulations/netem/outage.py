"""When a link is down: a fixed outage schedule, or an on/off Markov chain (exponential sojourns).

Both describe the same thing, a sorted sequence of off intervals on the virtual clock, and answer
one question: which off intervals end after a given time. A Markov chain's timeline is generated
lazily from virtual time 0 with its own seeded stream, so the state at any time depends only on the
seed, never on which transfers were asked about before or in what order.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np

from simulations.netem._validate import number
from simulations.netem.errors import LinkConfigError

SeedLike = int | Sequence[int]


class OutageProcess(Protocol):
    """A source of off intervals."""

    def off_intervals(self, t0_s: float) -> Iterator[tuple[float, float]]:
        """Off intervals ``(start_s, end_s)`` with ``end_s > t0_s``, in time order."""
        ...


class FixedOutages:
    """An explicit outage schedule.

    Parameters
    ----------
    intervals : iterable of (float, float)
        Off intervals ``(start_s, end_s)``, ``start_s < end_s``, sorted and disjoint.
    """

    def __init__(self, intervals: Iterable[tuple[float, float]]) -> None:
        ivs = [(float(a), float(b)) for a, b in intervals]
        for i, (a, b) in enumerate(ivs):
            if not (np.isfinite(a) and np.isfinite(b)) or a >= b:
                raise LinkConfigError(f"FixedOutages.intervals[{i}] must have start_s < end_s, "
                                      f"got ({a!r}, {b!r})")
            if i and a < ivs[i - 1][1]:
                raise LinkConfigError(f"FixedOutages.intervals[{i}] starts at {a!r} s, before the "
                                      f"previous one ends at {ivs[i - 1][1]!r} s; intervals must "
                                      f"be sorted and disjoint")
        self.intervals = ivs
        self._ends = [b for _, b in ivs]

    def off_intervals(self, t0_s: float) -> Iterator[tuple[float, float]]:
        i = bisect.bisect_right(self._ends, t0_s)
        yield from self.intervals[i:]

    def __repr__(self) -> str:
        return f"FixedOutages({self.intervals!r})"


class MarkovOnOff:
    """Intermittent connectivity: a two-state on/off chain with exponential sojourn times.

    Parameters
    ----------
    mean_on_s : float
        Mean length of an up period in seconds, > 0.
    mean_off_s : float
        Mean length of an outage in seconds, > 0.
    seed : int or sequence of int
        Seed of this chain's own random stream (e.g. ``(run_seed, client_id)``).

    Notes
    -----
    The state at time 0 is drawn from the stationary law (up with probability
    ``mean_on_s / (mean_on_s + mean_off_s)``); memorylessness makes the first sojourn exponential
    too, so the chain is stationary from the start.
    """

    _BATCH = 256

    def __init__(self, mean_on_s: float, mean_off_s: float, seed: SeedLike = 0) -> None:
        self.mean_on_s = number("MarkovOnOff", "mean_on_s", mean_on_s, minimum=0.0,
                                strict_min=True)
        self.mean_off_s = number("MarkovOnOff", "mean_off_s", mean_off_s, minimum=0.0,
                                 strict_min=True)
        self.seed = seed
        self._rng = np.random.default_rng(np.random.SeedSequence(seed))
        self._starts: list[float] = []
        self._ends: list[float] = []
        self._horizon_s = 0.0  # the timeline is known up to here
        self._up_at_horizon = bool(self._rng.random() < self.duty_cycle)

    @property
    def duty_cycle(self) -> float:
        """Long-run fraction of time the link is up."""
        return self.mean_on_s / (self.mean_on_s + self.mean_off_s)

    def _extend(self) -> None:
        t = self._horizon_s
        if not self._up_at_horizon:  # the chain starts inside an outage
            d = float(self._rng.exponential(self.mean_off_s))
            self._starts.append(t)
            self._ends.append(t + d)
            t += d
            self._up_at_horizon = True
        on = self._rng.exponential(self.mean_on_s, size=self._BATCH)
        off = self._rng.exponential(self.mean_off_s, size=self._BATCH)
        ends = t + np.cumsum(on + off)
        self._starts.extend((ends - off).tolist())
        self._ends.extend(ends.tolist())
        t = float(ends[-1])
        # The horizon sits at the end of an outage: the next batch starts with a whole up period.
        self._horizon_s = t

    def off_intervals(self, t0_s: float) -> Iterator[tuple[float, float]]:
        while self._horizon_s <= t0_s:
            self._extend()
        i = bisect.bisect_right(self._ends, t0_s)
        while True:
            while i >= len(self._starts):
                self._extend()
            yield self._starts[i], self._ends[i]
            i += 1

    def is_up(self, t_s: float) -> bool:
        """Whether the link is up at ``t_s``."""
        for a, _ in self.off_intervals(t_s):
            return t_s < a
        return True  # pragma: no cover - the generator never ends

    def up_seconds(self, t0_s: float, t1_s: float) -> float:
        """Seconds the link is up within ``[t0_s, t1_s]``."""
        down = 0.0
        for a, b in self.off_intervals(t0_s):
            if a >= t1_s:
                break
            down += min(b, t1_s) - max(a, t0_s)
        return (t1_s - t0_s) - down

    def __repr__(self) -> str:
        return (f"MarkovOnOff(mean_on_s={self.mean_on_s:g}, mean_off_s={self.mean_off_s:g}, "
                f"seed={self.seed!r})")
