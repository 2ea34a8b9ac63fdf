"""The privacy spent by DP-FedAvg rounds, from Google's ``dp-accounting`` library.

The guarantee is **client-level** (ε, δ)-DP: what the released models (every round's noised
aggregate) reveal changes by at most ``exp(ε)`` (plus δ) when one client's whole data, every
update it would send, is added or removed (``NeighboringRelation.ADD_OR_REMOVE_ONE``).

The **sampling assumption**: each round every one of ``N`` clients takes part independently
with probability ``q`` (Poisson sampling), the assumption under which DP-FedAvg's amplification
holds (McMahan et al., ICLR 2018). fedgc's rounds today sample a fixed number ``m`` without
replacement; accounting those at ``q = m / N`` as Poisson is DP-FedAvg's own convention but not
a proof for fixed-size sampling (the two differ in the tails; Lebeda et al., 2024). The
integration must sample Poisson for the stated guarantee to hold exactly, and every
:class:`Guarantee` says which was assumed.

- :class:`GaussianAccountant`: central noise (or any noise the server may be trusted to count
  as Gaussian): each round is ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, composed by the
  library's RDP accountant (default) or its PLD accountant (tighter, slower).
- :class:`DiscreteGaussianAccountant`: the distributed discrete Gaussian
  (:class:`fedgc.privacy.dp.noise.DistributedDiscreteGaussian`): its per-round RDP (Kairouz et
  al.'s Proposition 14), amplified by Poisson sampling with Zhu and Wang's general upper bound
  (ICML 2019, Theorem 5, which holds for any mechanism given its RDP at integer orders),
  composed over rounds by summing, and converted to (ε, δ) by the library's
  ``compute_epsilon``.

δ: the caller's (``1e-5``, or ``1 / N`` for ``N`` clients; δ should be well below ``1 / N``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp
from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon
from scipy import special

from fedgc.privacy.dp.noise import DistributedDiscreteGaussian

__all__ = ["ACCOUNTANTS", "DiscreteGaussianAccountant", "GaussianAccountant", "Guarantee",
           "INTEGER_ORDERS", "subsampled_rdp"]

#: The accountants of dp-accounting a GaussianAccountant can use.
ACCOUNTANTS = ("rdp", "pld")
#: RDP orders for bounds that need integers (Zhu and Wang's), as in Kairouz et al.'s code.
INTEGER_ORDERS = (*range(2, 65), 80, 96, 128, 192, 256)
_POISSON = ("Poisson sampling: each client takes part in a round independently with "
            "probability q")


@dataclass(frozen=True)
class Guarantee:
    """The privacy spent so far: ``epsilon`` for ``delta`` after ``rounds`` rounds, and a
    sentence saying what it is a guarantee of."""

    epsilon: float
    delta: float
    rounds: int
    statement: str


@contextmanager
def _quiet_library() -> Iterator[None]:
    """dp-accounting logs a warning for each fractional RDP order its series does not converge
    at (small orders at sampling rates near 0.1), then rightly leaves the order out: hundreds of
    lines per round that change nothing."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_delta(delta: float) -> float:
    if not 0 < delta < 1:
        raise ValueError(f"delta = {delta}: expected 0 < delta < 1")
    return float(delta)


def _check_round(noise_multiplier: float, sampling_rate: float, rounds: int) -> None:
    if not noise_multiplier > 0 or not 0 < sampling_rate <= 1 or rounds < 1:
        raise ValueError(f"noise_multiplier = {noise_multiplier}, sampling_rate = "
                         f"{sampling_rate}, rounds = {rounds}: expected > 0, in (0, 1], >= 1")


class GaussianAccountant:
    """Rounds of a Poisson-sampled Gaussian mechanism (module docstring).

    Parameters
    ----------
    delta : float
        The δ epsilon is reported for.
    kind : str
        "rdp" (dp-accounting's ``RdpAccountant``) or "pld" (``PLDAccountant``).
    """

    def __init__(self, delta: float, kind: str = "rdp") -> None:
        if kind not in ACCOUNTANTS:
            raise ValueError(f"accountant kind {kind!r}: expected one of {ACCOUNTANTS}")
        self.delta, self.kind = _check_delta(delta), kind
        #: (noise multiplier, sampling rate, rounds) in the order recorded.
        self.events: list[tuple[float, float, int]] = []

    @property
    def rounds(self) -> int:
        """Rounds recorded."""
        return sum(count for _, _, count in self.events)

    def record(self, noise_multiplier: float, sampling_rate: float, rounds: int = 1) -> None:
        """``rounds`` more rounds, each sampling clients at ``sampling_rate`` with noise of
        ``noise_multiplier`` times the clip norm on the sum."""
        _check_round(noise_multiplier, sampling_rate, rounds)
        self.events.append((float(noise_multiplier), float(sampling_rate), int(rounds)))

    def epsilon(self) -> float:
        """ε for :attr:`delta` after the rounds recorded (0 before any)."""
        if not self.events:
            return 0.0
        # Rounds of one (z, q) composed at once: the library computes an event's RDP (or PLD)
        # once per composition, about 0.1 s, not once per round.
        counts: dict[tuple[float, float], int] = {}
        for z, q, count in self.events:
            counts[(z, q)] = counts.get((z, q), 0) + count
        accountant = rdp.RdpAccountant() if self.kind == "rdp" else pld.PLDAccountant()
        with _quiet_library():
            for (z, q), count in counts.items():
                accountant.compose(dp_accounting.PoissonSampledDpEvent(
                    q, dp_accounting.GaussianDpEvent(z)), count)
            return float(accountant.get_epsilon(self.delta))

    def guarantee(self) -> Guarantee:
        """ε now, with what it guarantees."""
        zs = sorted({z for z, _, _ in self.events})
        qs = sorted({q for _, q, _ in self.events})
        return Guarantee(self.epsilon(), self.delta, self.rounds,
                         f"client-level ({self.epsilon():.4g}, {self.delta:g})-DP after "
                         f"{self.rounds} rounds of the Gaussian mechanism (noise multiplier "
                         f"{zs}, sampling rate {qs}); {_POISSON}; add or remove one client; "
                         f"dp-accounting {self.kind.upper()} accountant")

    def state_dict(self) -> dict[str, Any]:
        """The rounds recorded (a checkpoint rebuilds the accountant from them)."""
        return {"delta": self.delta, "kind": self.kind, "events": [list(e) for e in self.events]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (ValueError for another δ or kind)."""
        if float(state["delta"]) != self.delta or state["kind"] != self.kind:
            raise ValueError(f"accountant state for delta {state['delta']} ({state['kind']}); "
                             f"this one reports delta {self.delta} ({self.kind})")
        self.events = []
        for z, q, count in state["events"]:
            self.record(float(z), float(q), int(count))


def subsampled_rdp(rdp_of: Sequence[float], orders: Sequence[int], sampling_rate: float,
                   ) -> np.ndarray:
    """The RDP of a mechanism run on a Poisson sample of rate ``q``, at each integer order
    ``a``, from its RDP ``rdp_of`` at the orders ``2 .. max(orders)`` (``rdp_of[l - 2]`` is its
    RDP at order ``l``): Zhu and Wang's general upper bound (ICML 2019, Theorem 5),
    ``1/(a-1) log((1-q)^(a-1) (a q - q + 1) + C(a,2) q^2 (1-q)^(a-2) e^eps(2)
    + 3 sum_{l=3}^{a} C(a,l) (1-q)^(a-l) q^l e^((l-1) eps(l)))``, never above the mechanism's
    own."""
    q = float(sampling_rate)
    eps = np.asarray(rdp_of, dtype=np.float64)
    out = []
    for a in orders:
        a = int(a)
        if a < 2 or a - 2 >= len(eps):
            raise ValueError(f"order {a}: need the RDP at orders 2 to {len(eps) + 1}")
        if q >= 1.0:
            out.append(eps[a - 2])
            continue
        log_c = (special.gammaln(a + 1) - special.gammaln(np.arange(a + 1) + 1)
                 - special.gammaln(a - np.arange(a + 1) + 1))
        terms = [(a - 1) * math.log1p(-q) + math.log(a * q - q + 1),
                 log_c[2] + 2 * math.log(q) + (a - 2) * math.log1p(-q) + eps[0]]
        weights = [1.0, 1.0]
        for k in range(3, a + 1):
            terms.append(log_c[k] + (a - k) * math.log1p(-q) + k * math.log(q)
                         + (k - 1) * eps[k - 2])
            weights.append(3.0)
        bound = float(special.logsumexp(terms, b=weights)) / (a - 1)
        out.append(min(bound, float(eps[a - 2])))
    return np.asarray(out)


class DiscreteGaussianAccountant:
    """Rounds of the distributed discrete Gaussian under Poisson sampling (module docstring).

    Parameters
    ----------
    delta : float
        The δ epsilon is reported for.
    mechanism : DistributedDiscreteGaussian
        The clients' shares' parameters.
    orders : sequence of int
        Integer RDP orders (Zhu and Wang's bound needs integers).
    """

    def __init__(self, delta: float, mechanism: DistributedDiscreteGaussian,
                 orders: Sequence[int] = INTEGER_ORDERS) -> None:
        self.delta, self.mechanism = _check_delta(delta), mechanism
        self.orders = tuple(int(a) for a in orders)
        self.events: list[tuple[int, float, int]] = []  # (clients summed, q, rounds)
        self._rdp = np.zeros(len(self.orders))

    @property
    def rounds(self) -> int:
        return sum(count for _, _, count in self.events)

    def round_rdp(self, clients: int, sampling_rate: float) -> np.ndarray:
        """One round's RDP at :attr:`orders`: the sum of ``clients`` shares, sampled."""
        base = self.mechanism.rdp(range(2, max(self.orders) + 1), clients)
        return subsampled_rdp(base, self.orders, sampling_rate)

    def record(self, clients: int, sampling_rate: float, rounds: int = 1) -> None:
        """``rounds`` more rounds whose sums held ``clients`` shares each."""
        _check_round(1.0, sampling_rate, rounds)
        self._rdp = self._rdp + rounds * self.round_rdp(clients, sampling_rate)
        self.events.append((int(clients), float(sampling_rate), int(rounds)))

    def epsilon(self) -> float:
        """ε for :attr:`delta` after the rounds recorded (0 before any)."""
        if not self.events:
            return 0.0
        return float(compute_epsilon(self.orders, self._rdp, self.delta)[0])

    def guarantee(self) -> Guarantee:
        """ε now, with what it guarantees."""
        m = self.mechanism
        return Guarantee(self.epsilon(), self.delta, self.rounds,
                         f"client-level ({self.epsilon():.4g}, {self.delta:g})-DP after "
                         f"{self.rounds} rounds of the distributed discrete Gaussian (z "
                         f"{m.noise_multiplier} with {m.min_clients} shares, clip {m.clip_norm}, "
                         f"step {m.step}); {_POISSON}; add or remove one client; RDP (Kairouz "
                         f"et al. Prop. 14, Zhu-Wang sampling bound), dp-accounting conversion")
