"""What happens to the residual of a client that comes back after many rounds away.

In cross-device FL a client takes part rarely, so the residual (and momentum) it accumulated
goes stale: it points along the gradient of a model that has since moved (Fed-EF, FetchSGD and
STC discuss this). Three policies, each applied when the client next trains:

* ``keep``: keep everything, whatever the absence (no mass is ever lost; the default);
* ``decay``: after ``after_rounds`` rounds away, scale residual and momentum by
  ``decay ** (rounds_away - after_rounds)``;
* ``drop``: after ``after_rounds`` rounds away, zero residual and momentum.

Decay and drop discard mass on purpose; :class:`StaleReport` says how much, so a run can account
for it. ``rounds_away`` counts the rounds since the client's last update was computed, minus one:
a client sampled in consecutive rounds is 0 rounds away.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from client.state import fold_back_pending, update_age
from dgc import Compressor
from dgc.wire import MAX_NUMEL
from fedgc.keys import TrainSettings
from fedgc.methods import Bound, Method, pending_parts
from simulations.netem._validate import integer, number
from simulations.netem.errors import LinkConfigError

STALE_POLICIES: tuple[str, ...] = ("keep", "decay", "drop")


@dataclass(frozen=True)
class StalePolicy:
    """A stale-residual policy.

    Parameters
    ----------
    mode : str
        ``"keep"``, ``"decay"`` or ``"drop"``.
    decay : float
        Factor per round away beyond ``after_rounds`` (``"decay"`` only), in (0, 1].
    after_rounds : int
        T: rounds away that are tolerated before the policy acts, >= 0.
    """

    mode: str = "keep"
    decay: float = 0.5
    after_rounds: int = 0

    def __post_init__(self) -> None:
        if self.mode not in STALE_POLICIES:
            raise LinkConfigError(f"StalePolicy.mode must be one of {STALE_POLICIES}, "
                                  f"got {self.mode!r}")
        number("StalePolicy", "decay", self.decay, minimum=0.0, maximum=1.0, strict_min=True)
        integer("StalePolicy", "after_rounds", self.after_rounds, minimum=0)

    def factor(self, rounds_away: int) -> float:
        """The scale applied to residual and momentum after ``rounds_away`` rounds away."""
        integer("StalePolicy", "rounds_away", rounds_away, minimum=0)
        over = rounds_away - self.after_rounds
        if self.mode == "keep" or over <= 0:
            return 1.0
        return 0.0 if self.mode == "drop" else self.decay ** over


@dataclass(frozen=True)
class StaleReport:
    """What a policy did to one client: the factor and the residual L1 mass before and after."""

    factor: float
    residual_l1_before: float
    residual_l1_after: float

    @property
    def discarded_l1(self) -> float:
        """Residual L1 mass discarded on purpose."""
        return self.residual_l1_before - self.residual_l1_after


def _l1(tensors: dict[str, torch.Tensor]) -> float:
    return float(sum(float(t.double().abs().sum()) for t in tensors.values()))


def apply_stale_policy(compressor: Compressor, rounds_away: int,
                       policy: StalePolicy) -> StaleReport:
    """Scale (or zero) the compressor's residual and momentum in place, by ``policy``.

    ``compressor`` is any :class:`dgc.Compressor` (its ``scale_state`` ages every part alike).
    """
    factor = policy.factor(rounds_away)
    before = _l1(compressor.residual())
    if factor != 1.0:
        compressor.scale_state(factor)
    return StaleReport(factor, before, _l1(compressor.residual()) if factor != 1.0 else before)


def _stored_compressor(record: dict[str, Any],
                       make_compressor: Callable[[], Compressor]) -> Compressor:
    """The compressor of a stored record, its state loaded."""
    compressor = make_compressor()
    compressor.load_state_dict(record["compressor"])
    return compressor


def apply_stale_policy_to_record(record: dict[str, Any], round_index: int, ack_sequence: int,
                                 policy: StalePolicy, make_compressor: Callable[[], Compressor],
                                 method: Method, train: TrainSettings,
                                 model_version: int | None = None) -> StaleReport | None:
    """Apply ``policy`` to a client's stored record (``client.app``'s format), in place.

    ``make_compressor`` builds an empty compressor of the client's kind (its method's
    ``compressor``); the run's ``method`` and ``train`` settings read the stored payload
    (:func:`client.state.fold_back_pending`).
    The record holds ``compressor`` (the compressor's ``state_dict()``) and ``pending`` (the
    encoded last update, a uint8 tensor; with the shared sign channel also ``pending_shared``
    and ``pending_mask``). The client was last trained in round
    ``pending.sequence``, so it is ``round_index - pending.sequence - 1`` rounds away; with
    ``model_version`` (an asynchronous dispatch, whose sequences count dispatches) the versions
    since the one it trained on, less one (:func:`client.state.update_age`). When the
    policy changes anything, an unacknowledged pending update is first folded back (as the client
    would do), then residual and momentum are scaled, and ``pending`` is removed so that the
    client does not fold it back a second time. Returns None when the record has nothing to age.
    """
    if policy.mode == "keep" or "compressor" not in record or record.get("pending") is None:
        return None
    compressor = None
    if record.get("pending_mask") is not None:
        # A payload that answered the round's material (TCS's values at the server's mask) is
        # read against it, in the shapes of the client's residual.
        compressor = _stored_compressor(record, make_compressor)
        stored = [None if record.get(k) is None else bytes(record[k].numpy().tobytes())
                  for k in ("pending", "pending_shared", "pending_mask")]
        sequence, _ = pending_parts(method, train, *stored, {  # type: ignore[arg-type]
            n: (v.numel(),) for n, v in compressor.residual().items()})
    else:
        # The client's own bytes, from its own store: bounded by the format alone.
        sequence = method.codec(train).decode(bytes(record["pending"].numpy().tobytes()),
                                              Bound({}, limit=MAX_NUMEL)).sequence
    rounds_away = max(0, update_age(record.get("reply"), sequence, round_index, model_version) - 1)
    if policy.factor(rounds_away) == 1.0:
        return None
    if compressor is None:
        compressor = _stored_compressor(record, make_compressor)
    fold_back_pending(compressor, record, ack_sequence,
                      {n: (v.numel(),) for n, v in compressor.residual().items()}, method, train,
                      round_index, model_version)
    report = apply_stale_policy(compressor, rounds_away, policy)
    record["compressor"] = compressor.state_dict()
    for key in ("pending", "pending_shared", "pending_mask"):
        record.pop(key, None)
    return report
