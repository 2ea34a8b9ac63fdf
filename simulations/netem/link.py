"""One client's network link: latency with jitter, asymmetric bandwidth, loss and outages.

A transfer of ``nbytes`` starting at ``start_s`` needs the link up for one round-trip latency
(request and first byte) and then for the bits on the wire (payload plus resent lost packets),
integrated over the direction's throughput. Outages are checked over the whole transfer, not only
at its end: under policy ``"resume"`` the transfer pauses while the link is down and continues
after, under ``"fail"`` it fails when the first outage begins. Randomness (jitter, loss) comes from
a stream seeded by ``(seed, round_index, direction)``, so a client's round is reproducible whatever
else was simulated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from simulations.netem._validate import integer, number
from simulations.netem.errors import LinkConfigError
from simulations.netem.loss import GilbertElliott
from simulations.netem.outage import OutageProcess, SeedLike
from simulations.netem.throughput import ConstantRate, Throughput

Direction = Literal["down", "up"]
DIRECTIONS: tuple[str, ...] = ("down", "up")
#: What an outage does to a transfer in flight, in the emulator and on shaped real links
#: (``simulations.deploy``) alike. ``"resume"``: the bytes pause while the link is down and
#: continue after (a stall; on a real link the connections survive). ``"fail"``: the transfer is
#: lost when the first outage begins (on a real link every open connection is reset and new ones
#: are refused until the link is back, as when a phone loses its radio bearer).
OUTAGE_POLICIES: tuple[str, ...] = ("resume", "fail")
REASON_OK = "ok"
REASON_LINK_DOWN = "link_down"


@dataclass(frozen=True)
class TransferResult:
    """What became of one transfer.

    Attributes
    ----------
    ok : bool
        Whether every byte arrived.
    end_s : float
        When the last byte arrived, or when the transfer failed.
    reason : str
        ``"ok"`` or ``"link_down"`` (an outage met under policy ``"fail"``).
    start_s : float
        When the transfer started.
    direction : str
        ``"down"`` or ``"up"``.
    nbytes : int
        Payload bytes.
    wire_bytes : int
        Bytes put on the wire, lost packets resent.
    latency_s : float
        The round-trip latency drawn for this transfer.
    outage_s : float
        Seconds spent waiting for the link to come back (policy ``"resume"``).
    """

    ok: bool
    end_s: float
    reason: str
    start_s: float
    direction: str
    nbytes: int
    wire_bytes: int
    latency_s: float
    outage_s: float

    @property
    def duration_s(self) -> float:
        """Seconds from start to ``end_s``."""
        return self.end_s - self.start_s


def _seed_words(seed: SeedLike) -> list[int]:
    words = [seed] if isinstance(seed, int) else list(seed)
    for w in words:
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise LinkConfigError(f"Link.seed must be an int >= 0 or a sequence of them, "
                                  f"got {seed!r}")
    return words


def _throughput(field: str, value: float | Throughput) -> Throughput:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value) or value <= 0:
            raise LinkConfigError(f"Link.{field} must be a finite number > 0 (Mbit/s) or a "
                                  f"trace, got {value!r}")
        return ConstantRate(float(value))
    if not (hasattr(value, "time_for_bits") and hasattr(value, "bits_between")):
        raise LinkConfigError(f"Link.{field} must be a rate in Mbit/s or a Trace, "
                              f"got {type(value).__name__}")
    return value


class Link:
    """A client's link to the server.

    Parameters
    ----------
    down_mbps : float or Throughput
        Downlink rate in Mbit/s, or a :class:`~simulations.netem.throughput.Trace`.
    up_mbps : float or Throughput
        Uplink rate in Mbit/s, or a trace.
    latency_ms : float
        Mean round-trip latency charged once per transfer, >= 0.
    jitter_ms : float
        Half-width of the uniform jitter around ``latency_ms`` (like ``tc netem delay D J``);
        in [0, latency_ms] so that latency never goes negative.
    loss : GilbertElliott, optional
        Packet loss; lost packets are resent and cost time.
    outages : OutageProcess, optional
        When the link is down (:class:`~simulations.netem.outage.MarkovOnOff` or
        :class:`~simulations.netem.outage.FixedOutages`).
    outage_policy : str
        ``"resume"`` (wait for the link and continue) or ``"fail"`` (the transfer is lost).
    seed : int or sequence of int
        Seeds the per-transfer jitter and loss draws, e.g. ``(run_seed, client_id)``.
    name : str
        A label (the preset name), for reports.
    """

    def __init__(self, down_mbps: float | Throughput, up_mbps: float | Throughput,
                 latency_ms: float = 0.0, jitter_ms: float = 0.0,
                 loss: GilbertElliott | None = None, outages: OutageProcess | None = None,
                 outage_policy: str = "resume", seed: SeedLike = 0, name: str = "link") -> None:
        self.down = _throughput("down_mbps", down_mbps)
        self.up = _throughput("up_mbps", up_mbps)
        self.latency_ms = number("Link", "latency_ms", latency_ms, minimum=0.0)
        self.jitter_ms = number("Link", "jitter_ms", jitter_ms, minimum=0.0,
                                maximum=self.latency_ms)
        if loss is not None and not isinstance(loss, GilbertElliott):
            raise LinkConfigError(f"Link.loss must be a GilbertElliott model or None, "
                                  f"got {type(loss).__name__}")
        if outages is not None and not hasattr(outages, "off_intervals"):
            raise LinkConfigError(f"Link.outages must provide off_intervals(), "
                                  f"got {type(outages).__name__}")
        if outage_policy not in OUTAGE_POLICIES:
            raise LinkConfigError(f"Link.outage_policy must be one of {OUTAGE_POLICIES}, "
                                  f"got {outage_policy!r}")
        self.loss = loss
        self.outages = outages
        self.outage_policy = outage_policy
        self._seed = _seed_words(seed)
        self.seed = seed
        self.name = name

    def throughput(self, direction: str) -> Throughput:
        """The bandwidth model of ``direction``."""
        if direction not in DIRECTIONS:
            raise LinkConfigError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        return self.down if direction == "down" else self.up

    def rng(self, round_index: int, direction: str) -> np.random.Generator:
        """The random stream of one transfer: a pure function of (seed, round, direction)."""
        code = DIRECTIONS.index(direction)
        return np.random.default_rng(np.random.SeedSequence([*self._seed, round_index, code]))

    def transfer(self, nbytes: int, start_s: float, direction: str, *,
                 round_index: int = 0) -> TransferResult:
        """Send ``nbytes`` in ``direction`` starting at virtual time ``start_s``.

        Parameters
        ----------
        nbytes : int
            Payload bytes, >= 0 (the exact encoded size of the message).
        start_s : float
            Virtual start time in seconds.
        direction : str
            ``"down"`` (server to client) or ``"up"``.
        round_index : int
            The federated round, >= 0; with the seed it fixes jitter and loss draws.
        """
        integer("transfer", "nbytes", nbytes, minimum=0)
        start_s = number("transfer", "start_s", start_s)
        integer("transfer", "round_index", round_index, minimum=0)
        tput = self.throughput(direction)
        rng = self.rng(round_index, direction)
        latency_ms = self.latency_ms
        if self.jitter_ms > 0:
            latency_ms = float(rng.uniform(self.latency_ms - self.jitter_ms,
                                           self.latency_ms + self.jitter_ms))
        latency_s = latency_ms / 1000.0
        wire_bytes = self.loss.wire_bytes(nbytes, rng) if self.loss is not None else nbytes

        t = start_s
        need_latency_s = latency_s
        need_bits = float(wire_bytes) * 8.0
        outage_s = 0.0
        offs = self.outages.off_intervals(t) if self.outages is not None else iter(())
        nxt = next(offs, None)

        def result(ok: bool, end_s: float, reason: str) -> TransferResult:
            return TransferResult(ok, end_s, reason, start_s, direction, nbytes, wire_bytes,
                                  latency_s, outage_s)

        while True:
            if nxt is not None and nxt[0] <= t:  # the link is down now
                if self.outage_policy == "fail":
                    return result(False, t, REASON_LINK_DOWN)
                outage_s += nxt[1] - t
                t = nxt[1]
                nxt = next(offs, None)
                continue
            window_end_s = nxt[0] if nxt is not None else math.inf
            if need_latency_s > 0:
                take = min(need_latency_s, window_end_s - t)
                t += take
                need_latency_s -= take
                if need_latency_s > 0:
                    continue
            if need_bits <= 0:
                return result(True, t, REASON_OK)
            end_s = tput.time_for_bits(t, need_bits)
            if end_s <= window_end_s:
                return result(True, end_s, REASON_OK)
            need_bits -= tput.bits_between(t, window_end_s)
            t = window_end_s

    def __repr__(self) -> str:
        return (f"Link(name={self.name!r}, down={self.down!r}, up={self.up!r}, "
                f"latency_ms={self.latency_ms:g}, jitter_ms={self.jitter_ms:g}, "
                f"loss={self.loss!r}, outages={self.outages!r}, "
                f"outage_policy={self.outage_policy!r})")


def link_seed(run_seed: int, client_id: int) -> Sequence[int]:
    """The seed words of client ``client_id``'s link in a run seeded with ``run_seed``."""
    return (run_seed, client_id)
