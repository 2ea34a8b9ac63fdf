"""Clipping for client-level DP-FedAvg: a client's update bounded in L2 norm, to a fixed norm or
to one that follows a quantile of the clients' norms.

DP-FedAvg (McMahan et al., ICLR 2018) bounds each client's influence on a round's sum by
scaling its update to L2 norm at most ``S`` (all tensors as one vector), so that Gaussian noise
of standard deviation ``z * S`` on the sum makes the round a Gaussian mechanism of noise
multiplier ``z``. :func:`clip_update` does it on the pseudo-gradient, before the method
compresses (docs/privacy.md says why the guarantee needs the clip where the contribution enters
the sum too: :func:`clip_vector`).

Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021) moves ``S`` each round
towards the ``target_quantile`` of the clients' update norms: each client also sends one bit,
``norm <= S``; the server sums the bits with Gaussian noise (``count_noise``), and steps
``S <- S * exp(-learning_rate * (noisy fraction - target_quantile))``. The bits and the update
are released together, so the update's noise multiplier is raised to keep the pair's privacy at
the run's ``z`` (:meth:`AdaptiveClip.update_noise_multiplier`; the same formula as Flower's
``compute_adaptive_noise_params``). Defaults are the paper's: initial clip 0.1, quantile 0.5,
learning rate 0.2, count noise ``clients / 20``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["AdaptiveClip", "clip_update", "clip_vector", "l2_norm"]


def l2_norm(tensors: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of all ``tensors`` as one vector, summed in float64."""
    return math.sqrt(sum(float(t.detach().to(torch.float64).square().sum())
                         for t in tensors.values()))


def _factor(norm: float, clip_norm: float) -> float:
    if not (math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip_norm = {clip_norm!r}: expected a finite value > 0")
    if not math.isfinite(norm):
        raise ValueError(f"the update's norm is {norm}: it holds NaN or Inf")
    return min(1.0, clip_norm / norm) if norm > 0 else 1.0


def clip_update(tensors: Mapping[str, torch.Tensor], clip_norm: float,
                ) -> tuple[dict[str, torch.Tensor], float]:
    """(``tensors`` scaled to L2 norm at most ``clip_norm``, their norm before): a client's
    pseudo-gradient before it compresses."""
    norm = l2_norm(tensors)
    factor = _factor(norm, clip_norm)
    return {n: t * factor if factor < 1.0 else t for n, t in tensors.items()}, norm


def clip_vector(vector: np.ndarray, clip_norm: float) -> tuple[np.ndarray, float]:
    """(``vector`` scaled to L2 norm at most ``clip_norm``, its norm before): a contribution as
    it enters the sum (:meth:`fedgc.privacy.linear.Layout.vector`)."""
    v = np.asarray(vector, dtype=np.float64)
    norm = float(np.linalg.norm(v))
    factor = _factor(norm, clip_norm)
    return (v * factor if factor < 1.0 else v), norm


@dataclass
class AdaptiveClip:
    """The clip norm of adaptive clipping (module docstring), kept by the server.

    Parameters
    ----------
    clip : float
        The current clip norm ``S`` (the initial one at construction).
    target_quantile : float
        ``gamma``: the fraction of clients whose update norm should fall within ``S``.
    learning_rate : float
        ``eta``: the geometric step of ``S``.
    count_noise : float
        ``sigma_b``: the std of the Gaussian noise on the count of bits (the paper's default is
        the expected clients per round / 20); 0 only without DP noise.
    """

    clip: float = 0.1
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    count_noise: float = 0.0
    history: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ValueError(f"clip = {self.clip!r}: expected a finite value > 0")
        if not 0.0 <= self.target_quantile <= 1.0:
            raise ValueError(f"target_quantile = {self.target_quantile}: expected 0 to 1")
        if not self.learning_rate > 0 or self.count_noise < 0:
            raise ValueError(f"learning_rate = {self.learning_rate}, count_noise = "
                             f"{self.count_noise}: expected > 0 and >= 0")

    @classmethod
    def for_clients(cls, clients_per_round: float, **kwargs: Any) -> AdaptiveClip:
        """The paper's defaults with ``count_noise = clients_per_round / 20``."""
        return cls(count_noise=clients_per_round / 20, **kwargs)

    def bit(self, norm: float) -> float:
        """A client's bit for the count: 1 when its update's norm is within the clip."""
        return 1.0 if norm <= self.clip else 0.0

    def update(self, bits_sum: float, clients: float, rng: np.random.Generator) -> float:
        """Step the clip from the round's sum of bits over ``clients`` (the expected count per
        round keeps the denominator independent of who took part); returns the new clip."""
        if clients <= 0:
            raise ValueError(f"clients = {clients}: expected > 0")
        noisy = (bits_sum + (rng.normal(0.0, self.count_noise) if self.count_noise else 0.0))
        self.history.append(self.clip)
        self.clip *= math.exp(-self.learning_rate * (noisy / clients - self.target_quantile))
        return self.clip

    def update_noise_multiplier(self, noise_multiplier: float) -> float:
        """The update's noise multiplier ``z_u`` that keeps update and bits together at
        ``noise_multiplier`` (``z``): ``(z^-2 - (2 sigma_b)^-2)^-1/2``; ValueError when the bits'
        noise alone spends more than ``z`` allows (``2 sigma_b <= z``)."""
        z = float(noise_multiplier)
        if z <= 0:
            return 0.0
        if 2 * self.count_noise <= z:
            raise ValueError(f"count_noise = {self.count_noise}: the bits' noise must exceed "
                             f"z / 2 = {z / 2} for a total noise multiplier of {z}")
        return (z ** -2 - (2 * self.count_noise) ** -2) ** -0.5

    def state_dict(self) -> dict[str, Any]:
        """The clip and its history (for a checkpoint)."""
        return {"clip": self.clip, "history": list(self.history)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""
        clip = float(state["clip"])
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"adaptive clip state: clip = {clip!r}, expected a finite value > 0")
        self.clip, self.history = clip, [float(c) for c in state.get("history", [])]
