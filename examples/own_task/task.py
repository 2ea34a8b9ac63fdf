"""A task of this project's own: noisy waves to classify by frequency, and a small 1-D CNN.

fedgc runs it with ``task = "own_task.task:build"``: it imports this module (on the server and on
every client) and calls :func:`build` with the run's ``task_options``, which returns a
:class:`tasks.Task` holding the data as tensors and ``model_fn``, the model's constructor.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tasks import Task

#: Cycles per window of each class: class k is a wave of FREQUENCIES[k] cycles.
FREQUENCIES = (1.0, 2.0, 3.0, 4.0)


class WaveNet(nn.Module):
    """Conv1d(1->8, 5) - ReLU - maxpool(2) - dense(hidden) - ReLU - logits, on (N, 1, length)."""

    def __init__(self, length: int = 32, num_classes: int = len(FREQUENCIES),
                 hidden: int = 64) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv1d(1, 8, kernel_size=5, padding=2), nn.ReLU(),
                                      nn.MaxPool1d(2), nn.Flatten())
        self.classifier = nn.Sequential(nn.Linear(8 * (length // 2), hidden), nn.ReLU(),
                                        nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def waves(n: int, length: int, noise: float, generator: torch.Generator) -> tuple[torch.Tensor,
                                                                                 torch.Tensor]:
    """``n`` windows ``(n, 1, length)`` of sine waves with a random phase and amplitude plus
    Gaussian noise, and their classes (the index of the wave's frequency)."""
    labels = torch.randint(len(FREQUENCIES), (n,), generator=generator)
    cycles = torch.tensor(FREQUENCIES)[labels]
    phase = torch.rand(n, generator=generator) * 2 * math.pi
    amplitude = 0.5 + torch.rand(n, generator=generator)
    t = torch.arange(length, dtype=torch.float32) / length
    x = amplitude[:, None] * torch.sin(2 * math.pi * cycles[:, None] * t + phase[:, None])
    x = x + noise * torch.randn(n, length, generator=generator)
    return x[:, None, :], labels


def build(num_train: int = 2000, num_test: int = 500, length: int = 32, noise: float = 0.5,
          hidden: int = 64, seed: int = 0) -> Task:
    """The wave task: ``num_train``/``num_test`` windows of ``length`` samples, drawn from
    ``seed`` (the same data on the server and every client), and :class:`WaveNet`."""
    if length < 8 or length % 2:
        raise ValueError(f"length must be an even number >= 8, got {length!r}")
    generator = torch.Generator().manual_seed(seed)
    train_x, train_y = waves(num_train, length, noise, generator)
    test_x, test_y = waves(num_test, length, noise, generator)
    return Task("waves", "wavenet", len(FREQUENCIES), train_x, train_y, test_x, test_y,
                model_fn=lambda: WaveNet(length, len(FREQUENCIES), hidden),
                info={"frequencies": FREQUENCIES, "noise": noise})


def build_per_client(samples: int = 20, num_test: int = 500, length: int = 32,
                     noise: float = 0.5, skew: float = 0.5, hidden: int = 64,
                     seed: int = 0) -> Task:
    """The wave task with every client's data made from its own seed: ``task =
    "own_task.task:build_per_client"`` runs any number of clients (a million on one box,
    ``bench/scale.py``), and a run holds the data of the clients it samples and nothing else.

    Client ``key`` gets ``samples`` windows drawn from ``Generator(seed, key)``; a fraction
    ``skew`` of them of its own class (``key % 4``), the rest of any class (label skew, as a
    Dirichlet partition gives). The test set is drawn from ``seed``, as :func:`build`'s.
    """
    if samples < 1 or not 0.0 <= skew <= 1.0:
        raise ValueError(f"samples must be >= 1 and skew in [0, 1], got {samples!r}, {skew!r}")
    if length < 8 or length % 2:
        raise ValueError(f"length must be an even number >= 8, got {length!r}")
    test_x, test_y = waves(num_test, length, noise, torch.Generator().manual_seed(seed))

    def client_data(key: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed((seed * 1_000_003 + key) * 2 + 1)
        x, y = waves(samples, length, noise, generator)
        own = torch.rand(samples, generator=generator) < skew
        if bool(own.any()):  # the windows of its own class, drawn again from the same stream
            cycles = FREQUENCIES[key % len(FREQUENCIES)]
            t = torch.arange(length, dtype=torch.float32) / length
            phase = torch.rand(int(own.sum()), generator=generator) * 2 * math.pi
            wave = torch.sin(2 * math.pi * cycles * t + phase[:, None])
            x[own] = (wave + noise * torch.randn(wave.shape, generator=generator))[:, None, :]
            y[own] = key % len(FREQUENCIES)
        return x, y

    return Task("waves-per-client", "wavenet", len(FREQUENCIES),
                torch.empty(0, 1, length), torch.empty(0, dtype=torch.int64), test_x, test_y,
                model_fn=lambda: WaveNet(length, len(FREQUENCIES), hidden),
                info={"frequencies": FREQUENCIES, "noise": noise, "samples": samples,
                      "skew": skew}, client_data=client_data)
