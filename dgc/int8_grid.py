"""The int8 broadcast grid: power-of-two int8 grids that `downlink_values="int8"` rounds to.

A matrix of the broadcast model holds values ``q * 2**e`` with ``|q| <= 127``, one exponent
``e`` per tensor; the wire's grid coding (docs/wire.md, section 5) carries them in a byte or
fewer bits each. The server picks each tensor's first grid from the initial model with
:data:`HEADROOM_BITS` of headroom; a client that builds version 0 itself rounds it with
:func:`round_initial`, which gives the server's version 0 bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

#: The initial int8 grid of a broadcast tensor holds 2**this times its largest initial entry:
#: weights grow in training, and each doubling of the step re-sends the whole tensor.
HEADROOM_BITS = 3

#: The exponents the wire's grid coding carries (its f32 scale, normal and finite).
MIN_EXPONENT, MAX_EXPONENT = -126, 120


def grid_exponent(t: torch.Tensor, at_least: int | None = None) -> int | None:
    """The exponent ``e`` of the finest int8 grid step ``2**e`` (at least ``2**at_least``)
    that holds every entry of ``t``: ``127 * 2**e >= max |t|``. None for an all-zero tensor
    when no step is set yet."""
    peak = float(t.abs().max()) if t.numel() else 0.0
    if peak == 0.0:
        return at_least
    mantissa, exponent = math.frexp(peak / 127.0)  # peak / 127 = mantissa * 2**exponent
    e = exponent - 1 if mantissa == 0.5 else exponent
    e = min(max(e, MIN_EXPONENT), MAX_EXPONENT)
    return e if at_least is None else max(e, at_least)


def to_int8_grid(t: torch.Tensor, exponent: int) -> torch.Tensor:
    """``t`` rounded to the nearest multiples ``q * 2**exponent``, ``|q| <= 127`` (zeros as
    +0.0, the only zero the grid coding carries)."""
    scale = math.ldexp(1.0, exponent)
    return torch.round(t / scale).clamp_(-127, 127).mul_(scale).add_(0.0)


def initial_exponents(model: Mapping[str, torch.Tensor]) -> dict[str, int | None]:
    """Per matrix (tensor of two or more dims) of the initial model, the exponent of its first
    grid: :data:`HEADROOM_BITS` coarser than the finest that holds it (None: all zeros)."""
    out: dict[str, int | None] = {}
    for name, t in model.items():
        if t.dim() > 1:
            e = grid_exponent(t)
            out[name] = None if e is None else min(e + HEADROOM_BITS, MAX_EXPONENT)
    return out


def round_initial(model: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Version 0 of an int8 broadcast: ``model`` (float32) with every matrix rounded to its
    first grid (:func:`initial_exponents`); other tensors copied unchanged."""
    exponents = initial_exponents(model)
    out = {}
    for name, t in model.items():
        e = exponents.get(name)
        out[name] = t.clone() if e is None else to_int8_grid(t, e)
    return out
