"""Hostile clients for robustness studies: what a client named in ``attack.clients`` sends
instead of its honest update.

A robustness study needs attackers that behave like the strongest clients the server's bounds
let through, on every method and engine, with their bytes on the real wire path. A hostile
client here is an ordinary ClientApp that, in its round, turns its honest work into an attack
before its method compresses it; everything after (compression, residual, codec, the emulator's
link, the server's checks and defences) is what any client's update goes through. Kinds
(``attack.kind``):

``sign_flip``
    the honest pseudo-gradient, negated: the model is pushed uphill (Blanchard et al., 2017;
    the issue-26 probe);
``scaled``
    the honest pseudo-gradient, scaled up: an overshooting step (boosting, Bhagoji et al.,
    2019; Bagdasaryan et al., 2020);
``targeted``
    trained on its own inputs with every label set to ``attack.target_class`` ("predict class
    c"), then scaled like ``scaled``: a backdoor-like push towards one class;
``noise``
    Gaussian noise of the same norm (a random direction).

Each of these is scaled to ``attack.norm_ratio`` times the norm of the client's honest
pseudo-gradient, its estimate of the round's median norm; and it claims ``attack.weight_ratio``
times its real number of examples.

The colluding kinds craft one update for all the hostile clients of the round from what they know
of the benign updates (:class:`Benign`, learnt as :mod:`client.collusion` says: their own honest
updates under ``attack.knowledge = partial``, every benign client's under ``full``), and claim
``attack.weight_ratio`` times the median of the benign claims they know (the median weight: the
largest a cap at the median leaves whole, and no outlier). With ``mu`` and ``sigma`` the
benign updates' coordinate-wise mean and standard deviation:

``alie``
    "A Little Is Enough" (Baruch, Baruch and Goldberg, NeurIPS 2019): ``mu - z * sigma``, where
    ``z = Phi^-1((n - s) / n)`` for ``s = floor(n/2 + 1) - m`` supporters, ``n`` the round's
    clients and ``m`` the colluders (:func:`alie`);
``ipm``
    inner-product manipulation (Xie, Koyejo and Gupta, UAI 2019): ``-epsilon * mu``
    (``attack.epsilon``; 0: the largest epsilon min-max's bound allows, :func:`ipm`);
``min_max``, ``min_sum``
    Shejwalkar and Houmansadr ("Manipulating the Byzantine", NDSS 2021): ``mu - gamma * dev``
    with the largest ``gamma`` whose update is no farther from any benign update than any two
    benign updates are apart (min-max), or whose summed squared distances to the benign
    updates are at most those of any benign update (min-sum); ``dev`` is ``sigma``, ``mu``'s
    unit vector or its signs (``attack.deviation``; :func:`largest_step`).

``attack.norm_ratio`` does not apply to them: the attack sets its own size. Every hostile
client of the round sends the same crafted update, as in the papers.

The ratios default to just under the bounds in force (``fedgc.settings``: 0.99 times
``max_norm_ratio`` and ``max_weight_ratio``), as the issue-26 probe did: a client whose honest
norm (or weight) is above the round's median is clipped (or capped) to exactly the bound, one
below it stays under; without a cap the colluding kinds claim the benign median (they blend in).
The client learns which it is from its train message only: the attack is a setting of the run, so
whoever sets the run decides it (docs/threat_model.md). The phone bridge does not run attacks (a
phone trains its own way).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fedgc.keys import TrainSettings
from fedgc.keys.attack import (
    ATTACKS,
    COLLUDING_ATTACKS,
    UNBOUNDED_ATTACK,
    parse_attack_clients,
)

__all__ = ["ATTACKS", "Attack", "Benign", "alie", "alie_z", "attack_of", "ipm", "largest_step"]


@dataclass(frozen=True)
class Benign:
    """What colluders know of a round's benign updates (:mod:`client.collusion`).

    Parameters
    ----------
    updates : sequence of dict of str to Tensor
        The benign pseudo-gradients they know, each with every tensor of the model.
    examples : sequence of int
        The number of examples each of them claims.
    """

    updates: Sequence[Mapping[str, torch.Tensor]]
    examples: Sequence[int]

    def __post_init__(self) -> None:
        if not self.updates or len(self.updates) != len(self.examples):
            raise ValueError(f"colluders need at least one benign update with its number of "
                             f"examples, got {len(self.updates)} updates and "
                             f"{len(self.examples)} numbers")

    def stacked(self) -> torch.Tensor:
        """The updates as the rows of one float64 matrix (tensors in the first's order)."""
        names = list(self.updates[0])
        return torch.stack([torch.cat([u[n].detach().reshape(-1).to("cpu", torch.float64)
                                       for n in names]) for u in self.updates])


@dataclass(frozen=True)
class Attack:
    """One hostile client's attack (module docstring).

    Parameters
    ----------
    kind : str
        One of :data:`ATTACKS`.
    norm_ratio : float
        The norm of what it sends, as a multiple of its honest pseudo-gradient's norm (not the
        colluding kinds).
    weight_ratio : float
        The number of examples it claims, as a multiple of its real number (colluding kinds:
        of the benign median they know).
    target_class : int
        The label ``targeted`` trains towards.
    epsilon : float
        ``ipm``'s epsilon; 0: the largest min-max's bound allows.
    deviation : str
        ``min_max`` and ``min_sum``'s perturbation: ``std``, ``unit_vec`` or ``sign``.
    round_clients : int
        ``alie``'s n: the clients of a round.
    colluders : int
        ``alie``'s m: the hostile clients.
    """

    kind: str
    norm_ratio: float
    weight_ratio: float
    target_class: int = 0
    epsilon: float = 0.0
    deviation: str = "std"
    round_clients: int = 10
    colluders: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise ValueError(f"attack.kind must be one of {list(ATTACKS)}, got {self.kind!r}")
        for name in ("norm_ratio", "weight_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"attack.{name} must be a finite number > 0, got {value!r}")

    @property
    def colluding(self) -> bool:
        """Whether it crafts its update from the benign ones (:data:`COLLUDING_ATTACKS`)."""
        return self.kind in COLLUDING_ATTACKS

    def labels(self, y: torch.Tensor, num_classes: int) -> torch.Tensor:
        """The labels it trains on: ``y``, or every one ``target_class`` (``targeted``);
        ValueError when ``target_class`` is not a class of the task."""
        if self.kind != "targeted":
            return y
        if not 0 <= self.target_class < num_classes:
            raise ValueError(f"attack.target_class = {self.target_class} is not a class of the "
                             f"task: expected 0 <= target_class < {num_classes}")
        return torch.full_like(y, self.target_class)

    def update(self, honest: Mapping[str, torch.Tensor], seed: int,
               benign: Benign | None = None) -> dict[str, torch.Tensor]:
        """The pseudo-gradient it sends instead of ``honest`` (``seed``: the noise's, per
        round and client; ``benign``: what a colluding kind knows, which it needs)."""
        if self.colluding:
            if benign is None:
                raise ValueError(f"attack.kind = {self.kind} crafts its update from the benign "
                                 f"updates, and none were given")
            flat = self._crafted(benign.stacked())
            out, at = {}, 0
            for name in benign.updates[0]:  # the order of stacked()'s rows
                t = honest[name]
                out[name] = flat[at:at + t.numel()].to(t.device, t.dtype).view(t.shape)
                at += t.numel()
            return out
        if self.kind == "noise":
            generator = torch.Generator().manual_seed(seed)
            noise = {k: torch.randn(v.shape, generator=generator, dtype=torch.float32)
                     .to(v.device) for k, v in honest.items()}
            ratio = self.norm_ratio * _norm(honest) / max(_norm(noise), 1e-30)
            return {k: v * ratio for k, v in noise.items()}
        sign = -1.0 if self.kind == "sign_flip" else 1.0
        return {k: v * (sign * self.norm_ratio) for k, v in honest.items()}

    def _crafted(self, benign: torch.Tensor) -> torch.Tensor:
        if self.kind == "alie":
            return alie(benign, alie_z(self.round_clients, self.colluders))
        if self.kind == "ipm":
            return ipm(benign, self.epsilon)
        mean = benign.mean(0)
        dev = _deviation(benign, self.deviation)
        return mean - largest_step(benign, dev, self.kind) * dev

    def claimed_examples(self, num_examples: int, benign: Benign | None = None) -> int:
        """The ``num-examples`` it reports (a colluding kind: from the benign median it
        knows): at least 1, below the server's 2^31."""
        base = statistics.median(benign.examples) if self.colluding and benign else num_examples
        return int(min(max(round(base * self.weight_ratio), 1), 2**31 - 1))


def alie_z(round_clients: int, colluders: int) -> float:
    """ALIE's ``z``: the largest deviation, in standard deviations, at which the colluders'
    update still has ``s = floor(n/2 + 1) - m`` benign "supporters" closer to the mean
    (Baruch et al. 2019, Algorithm 1): ``Phi^-1((n - s) / n)``. ValueError when ``m`` is not
    below ``n/2 + 1`` (no supporter is needed: the colluders are a majority)."""
    n, m = int(round_clients), int(colluders)
    supporters = n // 2 + 1 - m
    if not (n >= 1 and 1 <= m and supporters >= 1):
        raise ValueError(f"ALIE needs 1 <= colluders < round_clients/2 + 1, got {m} colluders "
                         f"of {n}")
    return statistics.NormalDist().inv_cdf((n - supporters) / n)


def alie(benign: torch.Tensor, z: float) -> torch.Tensor:
    """``mean - z * std`` of the rows of ``benign``, coordinate-wise (Baruch et al. 2019);
    one row has no spread (its std is 0)."""
    std = benign.std(0) if benign.shape[0] > 1 else torch.zeros_like(benign[0])
    return benign.mean(0) - z * std


def ipm(benign: torch.Tensor, epsilon: float) -> torch.Tensor:
    """``-epsilon * mean`` of the rows of ``benign`` (Xie et al. 2019). ``epsilon = 0``: the
    largest for which min-max's bound holds (``-epsilon * mu = mu - (1 + epsilon) mu``:
    :func:`largest_step` along ``mu``), and 0 where even ``epsilon = 0`` breaks it."""
    mean = benign.mean(0)
    if epsilon == 0:
        epsilon = max(largest_step(benign, mean, "min_max") - 1.0, 0.0)
    return -epsilon * mean


def _deviation(benign: torch.Tensor, kind: str) -> torch.Tensor:
    mean = benign.mean(0)
    if kind == "unit_vec":
        norm = float(mean.norm())
        return mean / norm if norm > 0 else torch.zeros_like(mean)
    if kind == "sign":
        return torch.sign(mean)
    if kind == "std":
        return benign.std(0) if benign.shape[0] > 1 else torch.zeros_like(mean)
    raise ValueError(f"attack.deviation must be std, unit_vec or sign, got {kind!r}")


def largest_step(benign: torch.Tensor, dev: torch.Tensor, criterion: str) -> float:
    """The largest ``gamma >= 0`` for which ``mu - gamma * dev`` (``mu``: the mean of the rows
    of ``benign``) meets Shejwalkar and Houmansadr's (NDSS 2021) bound:

    - ``min_max``: its largest distance to a benign update is at most the largest distance
      between two benign updates;
    - ``min_sum``: the sum of its squared distances to the benign updates is at most the
      smallest such sum of a benign update.

    Each squared distance is a quadratic in ``gamma`` (``a gamma^2 + b_i gamma + c_i``,
    ``a = ||dev||^2``, ``b_i = -2 <dev, mu - g_i>``, ``c_i = ||mu - g_i||^2``) that the mean
    meets at ``gamma = 0``, so the bound holds on one interval from 0 and its end is the
    quadratic's root: solved exactly, where the paper's code searches by halving steps from 10.
    0 when ``dev`` is 0.
    """
    mean = benign.mean(0)
    a = float(dev.square().sum())
    if a == 0:
        return 0.0
    gram = benign @ benign.T
    sq = gram.diagonal()
    pairwise = (sq[:, None] + sq[None, :] - 2 * gram).clamp_min(0)  # ||g_i - g_j||^2
    centred = mean - benign
    b = -2 * (centred @ dev)
    c = centred.square().sum(1)
    if criterion == "min_max":
        bound = float(pairwise.max())
        roots = [_root(a, float(bi), float(ci) - bound) for bi, ci in zip(b, c, strict=True)]
        return min(roots)
    if criterion == "min_sum":
        bound = float(pairwise.sum(1).min())
        k = benign.shape[0]
        return _root(k * a, float(b.sum()), float(c.sum()) - bound)
    raise ValueError(f"criterion must be min_max or min_sum, got {criterion!r}")


def _root(a: float, b: float, c: float) -> float:
    """The larger root of ``a x^2 + b x + c`` (``a > 0``), at least 0: where the quadratic,
    at most 0 at ``x = 0`` (``c <= 0``, up to rounding), rises above 0."""
    return max((-b + math.sqrt(max(b * b - 4 * a * min(c, 0.0), 0.0))) / (2 * a), 0.0)


def _norm(tensors: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


def attack_of(settings: TrainSettings, client_key: int) -> Attack | None:
    """The attack ``client_key`` runs under the run's ``attack.*`` keys (a TrainSettings),
    None for an honest client."""
    hostile = parse_attack_clients(settings.attack_clients)
    if client_key not in hostile:
        return None
    # A run config resolves both ratios (fedgc.settings); a message without them gets the
    # attack fedgc runs where no bound stops it.
    norm_ratio = settings.attack_norm_ratio or UNBOUNDED_ATTACK["norm_ratio"]
    weight_ratio = settings.attack_weight_ratio or UNBOUNDED_ATTACK["weight_ratio"]
    return Attack(settings.attack_kind, norm_ratio, weight_ratio, settings.attack_target_class,
                  settings.attack_epsilon, settings.attack_deviation,
                  settings.clients_per_round, len(hostile))
