"""A client device: how long local training takes, and whether the device is there this round."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from simulations.netem._validate import integer, number

_STREAM_AVAILABILITY = 0xA7A1


@dataclass(frozen=True)
class DeviceProfile:
    """A class of devices, from which each client's own device is drawn.

    Parameters
    ----------
    name : str
        Preset name.
    seconds_per_sample : float
        Median training time per sample per local epoch, > 0.
    spread : float
        Sigma of the log-normal spread of speed across devices of this class, >= 0
        (0.3: about a third of devices are 35% slower or faster than the median).
    availability : float
        Probability that the device can take part in a round it is sampled for, in (0, 1].
    """

    name: str
    seconds_per_sample: float
    spread: float = 0.0
    availability: float = 1.0

    def __post_init__(self) -> None:
        number("DeviceProfile", "seconds_per_sample", self.seconds_per_sample, minimum=0.0,
               strict_min=True)
        number("DeviceProfile", "spread", self.spread, minimum=0.0)
        number("DeviceProfile", "availability", self.availability, minimum=0.0, maximum=1.0,
               strict_min=True)

    def sample(self, rng: np.random.Generator, seed: tuple[int, ...]) -> Device:
        """Draw one device of this class."""
        factor = float(rng.lognormal(0.0, self.spread)) if self.spread > 0 else 1.0
        return Device(self.seconds_per_sample * factor, self.availability, self.name, seed)


@dataclass(frozen=True)
class Device:
    """One client's device.

    Parameters
    ----------
    seconds_per_sample : float
        Training time per sample per local epoch, > 0.
    availability : float
        Probability of being available in a round, in (0, 1].
    name : str
        The profile it was drawn from.
    seed : tuple of int
        Seeds the per-round availability draw, e.g. ``(run_seed, client_id)``.
    """

    seconds_per_sample: float
    availability: float = 1.0
    name: str = "device"
    seed: tuple[int, ...] = field(default=(0,))

    def __post_init__(self) -> None:
        number("Device", "seconds_per_sample", self.seconds_per_sample, minimum=0.0,
               strict_min=True)
        number("Device", "availability", self.availability, minimum=0.0, maximum=1.0,
               strict_min=True)

    def compute_seconds(self, num_samples: int, epochs: float = 1.0) -> float:
        """Virtual seconds to train ``epochs`` local epochs over ``num_samples`` samples."""
        integer("Device", "num_samples", num_samples, minimum=0)
        epochs = number("Device", "epochs", epochs, minimum=0.0)
        return num_samples * epochs * self.seconds_per_sample

    def is_available(self, round_index: int) -> bool:
        """Whether the device can take part in ``round_index`` (seeded per client and round)."""
        integer("Device", "round_index", round_index, minimum=0)
        if self.availability >= 1.0:
            return True
        ss = np.random.SeedSequence([*self.seed, round_index, _STREAM_AVAILABILITY])
        return bool(np.random.default_rng(ss).random() < self.availability)
