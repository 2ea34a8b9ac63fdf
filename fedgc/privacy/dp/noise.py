"""The noise of DP-FedAvg: Gaussian on the sum by the server, or shares of a discrete Gaussian
added by the clients under secure aggregation.

**Central** (:func:`add_central_noise`): a server that sees the sum (trusted to add noise,
with or without secure aggregation) adds ``N(0, (z S)^2)`` to each coordinate of the sum of
clipped contributions; a round is then the Gaussian mechanism with noise multiplier ``z``
(sensitivity ``S`` under adding or removing one client).

**Distributed** (:class:`DistributedDiscreteGaussian`): the distributed discrete Gaussian of
Kairouz, Liu and Steinke (ICML 2021), for a server that is not trusted with the noise either.
Each client clips its vector to ``c``, scales it to integers of step ``gamma`` (the fixed
point's, :class:`fedgc.privacy.FixedPoint`), rounds it randomly until the rounded vector's
norm is within the bound their Theorem 1 uses (conditional randomized rounding, ``beta``), and
adds integer noise from the discrete Gaussian ``N_Z(0, sigma^2)`` before masking. The server
only ever sees the sum, whose noise is the sum of the survivors' shares. What that does to the
guarantee:

- each client's share is set so that ``min_clients`` shares together have the noise the target
  ``z`` needs: fewer survivors than that spend more privacy (:meth:`rdp` takes the count
  summed), more survivors add more noise than needed (worse accuracy, better privacy);
- a sum of discrete Gaussians is not a discrete Gaussian: the RDP of the sum (their
  Proposition 14, in the simplified form their code uses) carries a term ``tau`` that is
  negligible once each share's std is a few integer steps, and the rounding adds up to
  ``sqrt(d) gamma`` to the sensitivity;
- noise in integers keeps the masked sum exact: no rounding happens after the noise, so the
  released sum is exactly the mechanism the accountant analyses
  (:class:`fedgc.privacy.dp.accountant.DiscreteGaussianAccountant`);
- without their random rotation, a whole clip norm may sit in one coordinate: the modulus must
  hold ``n c / gamma`` plus the noise's tails (:meth:`DistributedDiscreteGaussian.sum_bound`),
  a few bits more per coordinate than their flattened vectors need.

The sampler (:func:`discrete_gaussian`) is Canonne, Kamath and Steinke's (NeurIPS 2020)
rejection from a discrete Laplace, vectorized in floating point as Kairouz et al.'s own code
does; it is not hardened against floating-point timing or precision attacks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DistributedDiscreteGaussian", "add_central_noise", "discrete_gaussian"]


def add_central_noise(total: np.ndarray, noise_multiplier: float, clip_norm: float,
                      rng: np.random.Generator) -> np.ndarray:
    """``total`` (a sum of contributions clipped to ``clip_norm``) plus ``N(0, (z S)^2)`` in
    each coordinate."""
    std = float(noise_multiplier) * float(clip_norm)
    if std < 0 or not math.isfinite(std):
        raise ValueError(f"noise std z * S = {std}: expected a finite value >= 0")
    t = np.asarray(total, dtype=np.float64)
    return t + rng.normal(0.0, std, t.shape) if std > 0 else t.copy()


def discrete_gaussian(sigma: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` int64 draws from the discrete Gaussian ``N_Z(0, sigma^2)``:
    ``P(x) ~ exp(-x^2 / (2 sigma^2))`` on the integers (Canonne, Kamath, Steinke 2020,
    Algorithm 3: a discrete Laplace of scale ``t = floor(sigma) + 1``, kept with probability
    ``exp(-(|y| - sigma^2/t)^2 / (2 sigma^2))``)."""
    if not sigma > 0:
        raise ValueError(f"sigma = {sigma}: expected > 0")
    t = math.floor(sigma) + 1
    p = -math.expm1(-1.0 / t)  # a geometric's success probability: 1 - e^(-1/t)
    out = np.empty(size, dtype=np.int64)
    todo = np.arange(size)
    while todo.size:
        n = todo.size
        # The difference of two geometrics from 0 is a discrete Laplace of scale t.
        y = rng.geometric(p, n) - rng.geometric(p, n)
        keep = rng.random(n) < np.exp(-((np.abs(y) - sigma ** 2 / t) ** 2) / (2 * sigma ** 2))
        out[todo[keep]] = y[keep]
        todo = todo[~keep]
    return out


@dataclass(frozen=True)
class DistributedDiscreteGaussian:
    """The distributed discrete Gaussian's parameters (module docstring).

    Parameters
    ----------
    clip_norm : float
        ``c``: the L2 norm a client's float vector is clipped to.
    step : float
        ``gamma``: the value of one integer (the fixed point's step).
    noise_multiplier : float
        ``z``: the sum's noise std over its sensitivity when ``min_clients`` shares are summed.
    min_clients : int
        The fewest shares the sum is assumed to hold (the session's ``min_survivors``).
    dimension : int
        ``d``: coordinates of the vector.
    beta : float
        Conditional rounding's parameter (Kairouz et al. use ``exp(-0.5)``): a larger bound,
        fewer retries.
    """

    clip_norm: float
    step: float
    noise_multiplier: float
    min_clients: int
    dimension: int
    beta: float = math.exp(-0.5)

    def __post_init__(self) -> None:
        if not (self.clip_norm > 0 and self.step > 0 and self.noise_multiplier > 0):
            raise ValueError(f"clip_norm = {self.clip_norm}, step = {self.step}, "
                             f"noise_multiplier = {self.noise_multiplier}: expected > 0")
        if self.min_clients < 1 or self.dimension < 1 or not 0 < self.beta < 1:
            raise ValueError(f"min_clients = {self.min_clients}, dimension = {self.dimension}, "
                             f"beta = {self.beta}: expected >= 1, >= 1 and in (0, 1)")

    @property
    def sensitivity(self) -> float:
        """The L2 sensitivity in integer steps after conditional rounding (Kairouz et al.,
        Theorem 1): ``min((c/g + sqrt d)^2, (c/g)^2 + d/4 + sqrt(2 ln(1/beta)) (c/g +
        sqrt(d)/2))`` under a square root."""
        c, d = self.clip_norm / self.step, self.dimension
        loose = (c + math.sqrt(d)) ** 2
        tight = c * c + d / 4 + math.sqrt(2 * math.log(1 / self.beta)) * (c + math.sqrt(d) / 2)
        return math.sqrt(min(loose, tight))

    @property
    def local_std(self) -> float:
        """Each client's share's std in integer steps: ``z * sensitivity / sqrt(min_clients)``."""
        return self.noise_multiplier * self.sensitivity / math.sqrt(self.min_clients)

    def sum_bound(self, clients: int, tail_stds: float = 10.0) -> int:
        """What any coordinate of the sum of ``clients`` shares stays within, but for the
        noise's tail beyond ``tail_stds`` standard deviations (10: about 1e-23 per coordinate):
        ``clients`` sensitivities plus the tail."""
        return math.ceil(clients * self.sensitivity
                         + tail_stds * math.sqrt(clients) * self.local_std)

    def min_modulus_bits(self, clients: int) -> int:
        """The fewest modulus bits whose ring holds :meth:`sum_bound` of ``clients``."""
        return self.sum_bound(clients).bit_length() + 1

    def privatize(self, vector: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One client's share (int64): :meth:`discretize` plus discrete Gaussian noise of
        :attr:`local_std`."""
        return self.discretize(vector, rng) + discrete_gaussian(self.local_std, self.dimension,
                                                                rng)

    def discretize(self, vector: np.ndarray, rng: np.random.Generator,
                   max_tries: int = 1000) -> np.ndarray:
        """``vector`` clipped to ``c``, in integer steps, rounded at random until its norm is
        within :attr:`sensitivity` (conditional randomized rounding), as int64."""
        x = np.asarray(vector, dtype=np.float64)
        if x.shape != (self.dimension,) or not np.isfinite(x).all():
            raise ValueError(f"a vector of shape {x.shape} (finite: {np.isfinite(x).all()}); "
                             f"expected {self.dimension} finite values")
        norm = float(np.linalg.norm(x))
        scaled = (x * min(1.0, self.clip_norm / norm) if norm > 0 else x) / self.step
        low = np.floor(scaled)
        bound = self.sensitivity
        for _ in range(max_tries):
            rounded = low + (rng.random(scaled.shape) < scaled - low)
            if np.linalg.norm(rounded) <= bound:
                break
        else:
            raise RuntimeError(f"conditional rounding found no vector within norm {bound} in "
                               f"{max_tries} tries (beta = {self.beta} too small)")
        return rounded.astype(np.int64)

    def tau(self, clients: int) -> float:
        """Kairouz et al.'s ``tau``: how far the sum of ``clients`` discrete Gaussians is from
        one, ``10 sum_{k=1}^{n-1} exp(-2 pi^2 sigma^2 k / (k + 1))``."""
        s2 = self.local_std ** 2
        return 10 * sum(math.exp(-2 * math.pi ** 2 * s2 * k / (k + 1))
                        for k in range(1, clients))

    def rdp(self, orders: Sequence[int], clients: int) -> np.ndarray:
        """The RDP, at each integer order, of one round's sum of ``clients`` shares (their
        Proposition 14 without the L1 term, as in their accounting code):
        ``min(a s^2 / 2 + tau d, a (s + sqrt(d) tau)^2 / 2)``, ``s = sensitivity /
        sqrt(n sigma^2)``."""
        if clients < 1:
            raise ValueError(f"clients = {clients}: expected >= 1")
        s = self.sensitivity / math.sqrt(clients * self.local_std ** 2)
        tau, d = self.tau(clients), self.dimension
        a = np.asarray(orders, dtype=np.float64)
        return np.minimum(a * s * s / 2 + tau * d, a * (s + math.sqrt(d) * tau) ** 2 / 2)
