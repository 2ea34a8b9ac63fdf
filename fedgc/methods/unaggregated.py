"""What a client folds back of an update the server never aggregated: whole, decayed, capped, none.

An error-feedback client keeps what it did not send in its residual; what it sent leaves the
residual. When the server does not aggregate that update (the reply was dropped mid-upload,
arrived past the deadline, was a surplus straggler's or was refused), the client learns it from
the server's next message to it: its ``ack_sequence`` (the round of the client's last
aggregated update, ``server.registry``) is not the update's round. Flower updates a timed-out
client's ``context.state`` all the same, so nothing the client holds says otherwise.

Folding the update back whole (``keep``) loses no mass, but the update was computed on a model
that has since moved, often many rounds before (a client is sampled again after
``num_clients / clients_per_round`` rounds on average), and error feedback sends it at once:
under the network emulator the rounds where 20-40% of the replies folded back such an update
are those where dgc's accuracy fell 8-50 points (docs/dgc_vs_dense.md). The other policies
(the client key ``unaggregated``, each error-feedback method with its own default):

* ``decay``: fold back ``unaggregated_decay ** age`` of it, ``age`` the rounds since it was
  computed (1 when the client is sampled the next round; under ``mode = async`` the applied
  steps, model versions, since the model it trained on): a stale update counts less;
* ``cap``: fold back at most ``unaggregated_cap`` times the L2 norm of the residual it joins
  (what the client's error feedback carries anyway), whatever its age;
* ``discard``: fold back nothing (the client's residual goes on without it).

The residual that merely waited (what the client did not send) is never touched here: aging
it is the method's own business (``dgc.residual_decay``, ``netem.stale_policy``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from dgc import Compressor, SparseUpdate
from fedgc.keys.client import UNAGGREGATED

__all__ = ["FOLD_BACK_DEFAULTS", "UNAGGREGATED", "fold_back", "folded_share"]

#: The catalogue's error-feedback methods' defaults for these keys (each adds them to its
#: ``defaults``): an unaggregated update decayed by half a round of age, measured on dgc and
#: dgc_sets under the emulator (docs/netem.md, "Stale updates").
FOLD_BACK_DEFAULTS: dict[str, str | float] = {"unaggregated": "decay"}


def folded_share(mode: str, decay: float, cap: float, age: int, folded_norm: float,
                 residual_norm: float) -> float:
    """The share, in [0, 1], of an unaggregated update that goes back into the residual.

    ``mode`` is one of :data:`UNAGGREGATED`; ``decay`` the factor per round of ``age`` (the
    rounds since the update was computed, >= 1); ``cap`` the most the folded update's L2 norm
    (``folded_norm``) may be, in L2 norms of the residual it joins (``residual_norm``).
    """
    if mode not in UNAGGREGATED:
        raise ValueError(f"unaggregated must be one of {UNAGGREGATED}, got {mode!r}")
    if mode == "keep":
        return 1.0
    if mode == "discard":
        return 0.0
    if mode == "decay":
        return float(decay) ** max(1, int(age))
    if folded_norm <= cap * residual_norm:
        return 1.0
    return cap * residual_norm / folded_norm


def _l2(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def fold_back(compressor: Compressor, parts: Sequence[SparseUpdate],
              share: Callable[[float, float], float]) -> float:
    """Fold ``parts`` (an unaggregated update: its payload's parts, its side part) back into
    ``compressor``'s residual, scaled by ``share(folded_norm, residual_norm)``; returns the share.

    The parts are restored as the compressor restores them (a low-rank payload as its product,
    signs at their indices), then only what they added is scaled, so the policy works in the
    residual's space for every compressor and leaves the residual that waited as it was.
    """
    before = {n: t.clone() for n, t in compressor.residual().items()}
    for part in parts:
        compressor.restore(part)
    after = compressor.residual()
    folded = {n: after[n] - before[n] for n in after}
    factor = float(share(_l2(folded), _l2(before)))
    if not 0.0 <= factor <= 1.0:
        raise ValueError(f"the share of an unaggregated update folded back must be in [0, 1], "
                         f"got {factor!r}")
    if factor != 1.0:
        for n, t in after.items():
            # In place: residual() is the compressor's own tensors.
            t.copy_(before[n] + factor * folded[n])
    return factor
