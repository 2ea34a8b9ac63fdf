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

Every kind is scaled to ``attack.norm_ratio`` times the norm of the client's honest
pseudo-gradient, its estimate of the round's median norm; and it claims ``attack.weight_ratio``
times its real number of examples. Both default to just under the bounds in force
(``fedgc.settings``: 0.99 times ``max_norm_ratio`` and ``max_weight_ratio``), as the issue-26
probe did: a client whose honest norm (or weight) is above the round's median is clipped (or
capped) to exactly the bound, one below it stays under. The client learns which it is from its
train message only: the attack is a setting of the run, so whoever sets the run decides it
(docs/threat_model.md). The phone bridge does not run attacks (a phone trains its own way).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from fedgc.settings import ATTACKS, UNBOUNDED_ATTACK, TrainSettings, parse_attack_clients

__all__ = ["ATTACKS", "Attack", "attack_of"]


@dataclass(frozen=True)
class Attack:
    """One hostile client's attack (module docstring).

    Parameters
    ----------
    kind : str
        One of :data:`ATTACKS`.
    norm_ratio : float
        The norm of what it sends, as a multiple of its honest pseudo-gradient's norm.
    weight_ratio : float
        The number of examples it claims, as a multiple of its real number.
    target_class : int
        The label ``targeted`` trains towards.
    """

    kind: str
    norm_ratio: float
    weight_ratio: float
    target_class: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ATTACKS:
            raise ValueError(f"attack.kind must be one of {list(ATTACKS)}, got {self.kind!r}")
        for name in ("norm_ratio", "weight_ratio"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"attack.{name} must be a finite number > 0, got {value!r}")

    def labels(self, y: torch.Tensor, num_classes: int) -> torch.Tensor:
        """The labels it trains on: ``y``, or every one ``target_class`` (``targeted``);
        ValueError when ``target_class`` is not a class of the task."""
        if self.kind != "targeted":
            return y
        if not 0 <= self.target_class < num_classes:
            raise ValueError(f"attack.target_class = {self.target_class} is not a class of the "
                             f"task: expected 0 <= target_class < {num_classes}")
        return torch.full_like(y, self.target_class)

    def update(self, honest: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
        """The pseudo-gradient it sends instead of ``honest`` (``seed``: the noise's, per
        round and client)."""
        if self.kind == "noise":
            generator = torch.Generator().manual_seed(seed)
            noise = {k: torch.randn(v.shape, generator=generator, dtype=torch.float32)
                     .to(v.device) for k, v in honest.items()}
            ratio = self.norm_ratio * _norm(honest) / max(_norm(noise), 1e-30)
            return {k: v * ratio for k, v in noise.items()}
        sign = -1.0 if self.kind == "sign_flip" else 1.0
        return {k: v * (sign * self.norm_ratio) for k, v in honest.items()}

    def claimed_examples(self, num_examples: int) -> int:
        """The ``num-examples`` it reports: at least 1, below the server's 2^31."""
        return int(min(max(round(num_examples * self.weight_ratio), 1), 2**31 - 1))


def _norm(tensors: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


def attack_of(settings: TrainSettings, client_key: int) -> Attack | None:
    """The attack ``client_key`` runs under the run's ``attack.*`` keys (a TrainSettings),
    None for an honest client."""
    if client_key not in parse_attack_clients(settings.attack_clients):
        return None
    # A run config resolves both ratios (fedgc.settings); a message without them gets the
    # attack fedgc runs where no bound stops it.
    norm_ratio = settings.attack_norm_ratio or UNBOUNDED_ATTACK["norm_ratio"]
    weight_ratio = settings.attack_weight_ratio or UNBOUNDED_ATTACK["weight_ratio"]
    return Attack(settings.attack_kind, norm_ratio, weight_ratio, settings.attack_target_class)
