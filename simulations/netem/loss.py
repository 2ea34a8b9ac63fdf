"""Packet loss as a Gilbert-Elliott two-state Markov chain, turned into retransmitted bytes.

The chain moves per packet between a good state G and a bad state B: ``p_good_bad`` is the
probability of leaving G after a packet, ``p_bad_good`` of leaving B. A packet is lost with
probability ``loss_good`` in G and ``loss_bad`` in B (Gilbert's original model has 0 and 1).
A reliable transport resends every lost packet, so a transfer of N packets puts N plus the
lost ones on the wire: the loss costs goodput, i.e. time, not data. Congestion-control
reactions to loss (window halving) are not modelled; see docs/netem.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from simulations.netem._validate import integer, number

DEFAULT_MTU_BYTES = 1500


@dataclass(frozen=True)
class GilbertElliott:
    """Bursty packet loss.

    Parameters
    ----------
    p_good_bad : float
        Probability, per packet, of moving from the good to the bad state; in [0, 1].
    p_bad_good : float
        Probability, per packet, of moving from the bad to the good state; in (0, 1] (a chain
        that can never leave the bad state would lose everything for ever).
    loss_good : float
        Loss probability of a packet sent in the good state; in [0, 1).
    loss_bad : float
        Loss probability of a packet sent in the bad state; in [0, 1].
    mtu_bytes : int
        Payload bytes per packet, >= 1.
    """

    p_good_bad: float
    p_bad_good: float
    loss_good: float = 0.0
    loss_bad: float = 1.0
    mtu_bytes: int = DEFAULT_MTU_BYTES

    def __post_init__(self) -> None:
        number("GilbertElliott", "p_good_bad", self.p_good_bad, minimum=0.0, maximum=1.0)
        number("GilbertElliott", "p_bad_good", self.p_bad_good, minimum=0.0, maximum=1.0,
               strict_min=True)
        number("GilbertElliott", "loss_good", self.loss_good, minimum=0.0, maximum=1.0,
               strict_max=True)
        number("GilbertElliott", "loss_bad", self.loss_bad, minimum=0.0, maximum=1.0)
        integer("GilbertElliott", "mtu_bytes", self.mtu_bytes, minimum=1)

    @property
    def stationary_bad(self) -> float:
        """Long-run fraction of packets sent in the bad state, ``p / (p + r)``."""
        return self.p_good_bad / (self.p_good_bad + self.p_bad_good)

    @property
    def stationary_loss(self) -> float:
        """Long-run fraction of packets lost."""
        pb = self.stationary_bad
        return (1.0 - pb) * self.loss_good + pb * self.loss_bad

    def states(self, n: int, rng: np.random.Generator, start_bad: bool | None = None
               ) -> np.ndarray:
        """``n`` successive states (True = bad), the first drawn from the stationary law."""
        if n <= 0:
            return np.zeros(0, dtype=bool)
        bad = bool(rng.random() < self.stationary_bad) if start_bad is None else start_bad
        # Sojourns are geometric, so the chain is built run by run rather than packet by packet.
        pieces: list[np.ndarray] = []
        total = 0
        while total < n:
            # Enough good+bad run pairs to cover the rest of the n packets, on average.
            cycle = 1.0 / self.p_bad_good + (1.0 / self.p_good_bad if self.p_good_bad else n)
            runs = int((n - total) / cycle) + 16
            if self.p_good_bad == 0.0:
                good_runs = np.full(runs, n + 1, dtype=np.int64)
            else:
                good_runs = rng.geometric(self.p_good_bad, size=runs)
            bad_runs = rng.geometric(self.p_bad_good, size=runs)
            first, second = (bad_runs, good_runs) if bad else (good_runs, bad_runs)
            lengths = np.empty(2 * runs, dtype=np.int64)
            lengths[0::2], lengths[1::2] = first, second
            flags = np.empty(2 * runs, dtype=bool)
            flags[0::2], flags[1::2] = bad, not bad
            piece = np.repeat(flags, lengths)
            pieces.append(piece)
            total += piece.size
            # An even number of runs per chunk: the next chunk starts in this chunk's first state.
        return np.concatenate(pieces)[:n]

    def losses(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Whether each of ``n`` successive packets is lost."""
        bad = self.states(n, rng)
        p = np.where(bad, self.loss_bad, self.loss_good)
        return rng.random(n) < p

    def packets_sent(self, packets_delivered: int, rng: np.random.Generator) -> int:
        """Packets put on the wire until ``packets_delivered`` have arrived (resends included)."""
        if packets_delivered <= 0:
            return 0
        if self.stationary_loss == 0.0:
            return packets_delivered
        sent = 0
        delivered = 0
        chunk = int(math.ceil(packets_delivered / max(1e-3, 1.0 - self.stationary_loss))) + 64
        bad: bool | None = None
        while True:
            states = self.states(chunk, rng, start_bad=bad)
            p = np.where(states, self.loss_bad, self.loss_good)
            ok = rng.random(chunk) >= p
            counts = np.cumsum(ok)
            need = packets_delivered - delivered
            if counts[-1] >= need:
                return sent + int(np.searchsorted(counts, need, side="left")) + 1
            delivered += int(counts[-1])
            sent += chunk
            # Continue the chain from the last state: one more transition from it.
            last_bad = bool(states[-1])
            leave = self.p_bad_good if last_bad else self.p_good_bad
            bad = (not last_bad) if rng.random() < leave else last_bad

    def wire_bytes(self, nbytes: int, rng: np.random.Generator) -> int:
        """Bytes on the wire to deliver ``nbytes`` of payload: lost packets are resent whole."""
        if nbytes <= 0:
            return 0
        packets = -(-nbytes // self.mtu_bytes)
        return nbytes + (self.packets_sent(packets, rng) - packets) * self.mtu_bytes
