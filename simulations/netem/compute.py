"""A model's training cost against the one the device presets were set for: the factor that
scales the emulator's per-sample compute (``netem.compute_scale``).

The device presets (:data:`simulations.netem.presets.DEVICE_PRESETS`) charge seconds per sample
of a small model: their speeds were set for the MLP and the default small CNN on 28x28 inputs.
A larger model costs a phone more per sample, about in proportion to its multiply-adds, so a
run's virtual compute is the presets' times ``max(1, model's multiply-adds a sample forward /``
:data:`REFERENCE_MACS` ``)``. The floor of 1 keeps every model at or under the reference (the
MLP's 0.16M, the small CNN's 3.02M) charged as before; only a larger model (the LEAF FEMNIST CNN
of ``fashion-mnist-6m``: 17.1M) is charged more.

Counted are the multiply-adds of ``nn.Linear`` and ``nn.Conv1d/2d/3d`` layers on one sample
(forward hooks), the bulk of a CNN's or an MLP's work; recurrent layers (``nn.LSTM``) are not
counted, so the LSTM of the Shakespeare task keeps the presets' charge (its head alone is
counted). Backward costs about twice forward for every layer alike, so the ratio of forwards is
the ratio of training costs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedgc.schema import SettingsError

#: Multiply-adds a sample forward of the model the device presets were set for: the default
#: small CNN (conv 5x5 16, pool, conv 5x5 32, pool, fc 128, fc 10) on a 28x28x1 image:
#: 313,600 + 2,508,800 + 200,704 + 1,280.
REFERENCE_MACS = 3_024_384

_COUNTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def forward_macs(model: nn.Module, sample: torch.Tensor) -> int:
    """Multiply-adds of ``model``'s Linear and Conv layers on one forward of ``sample`` (a
    batch of one, as the task's data holds it)."""
    total = 0

    def count(module: nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Linear):
            total += output.numel() * module.in_features
        else:
            conv: nn.modules.conv._ConvNd = module  # type: ignore[assignment]
            total += output.numel() * (conv.in_channels // conv.groups) * math.prod(
                conv.kernel_size)

    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, _COUNTED)]
    try:
        with torch.no_grad():
            model(sample)
    finally:
        for hook in hooks:
            hook.remove()
    return total // sample.shape[0]


def scale_for(macs: int, reference: int = REFERENCE_MACS) -> float:
    """The compute factor of a model of ``macs`` multiply-adds a sample: ``macs / reference``,
    at least 1 (module docstring)."""
    if macs < 0 or reference <= 0:
        raise SettingsError(f"compute scale: multiply-adds must be >= 0 and the reference > 0, "
                            f"got {macs} and {reference}")
    return max(1.0, macs / reference)


def model_compute_scale(task: object) -> tuple[float, int]:
    """(the compute factor, the multiply-adds a sample) of ``task``'s model (a
    :class:`tasks.Task`), on its first training sample; the model is built under a forked RNG
    so the caller's ``torch.manual_seed`` stream does not move."""
    with torch.random.fork_rng(devices=[]):
        model = task.build_model()  # type: ignore[attr-defined]
    model.eval()
    macs = forward_macs(model, task.train_x[:1])  # type: ignore[attr-defined]
    return scale_for(macs), macs
