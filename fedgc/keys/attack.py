"""The attack's keys (part ``attack``): hostile clients for a robustness study.

What ``client/attacks.py`` reads. Sent in train messages only where a client attacks
(:meth:`fedgc.settings.RunConfig.client_config`); ``attack.norm_ratio`` and
``attack.weight_ratio`` left empty are set just under the server's bounds in force when the
run's keys are combined (:func:`attack_bounds`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedgc.schema import Check, SettingsError, setting

__all__ = ["ATTACKS", "ATTACK_MARGIN", "UNBOUNDED_ATTACK", "AttackKeys", "attack_bounds",
           "parse_attack_clients"]

#: Hostile clients (``client.attacks``).
ATTACKS = ("sign_flip", "scaled", "targeted", "noise")
#: How far an attack goes where no bound stops it: the bounds fedgc had before issue 26.
UNBOUNDED_ATTACK = {"norm_ratio": 10.0, "weight_ratio": 4.0}
#: An attack stays this fraction under the bounds in force.
ATTACK_MARGIN = 0.99


@dataclass(frozen=True)
class AttackKeys:
    """Which clients attack, how, and how far."""

    PART = "attack"

    attack_clients: str = setting("", "attack.clients", "hostile clients for a robustness "
                                  "study: their keys, comma-separated ('0,1'); each sends an "
                                  "attack (attack.kind) instead of its update (client/attacks.py, "
                                  "docs/threat_model.md); empty = none")
    attack_kind: str = setting("sign_flip", "attack.kind", "what a hostile client sends: "
                               "sign_flip (its update negated), scaled (its update scaled up), "
                               "targeted (trained to predict attack.target_class, scaled up), "
                               "noise (Gaussian, of the same norm)", Check(choices=ATTACKS))
    attack_norm_ratio: float | None = setting(
        None, "attack.norm_ratio", "the norm of a hostile update, as a multiple of the client's "
        "honest update's norm (its estimate of the round's median); empty = just under the norm "
        "bound in force: 0.99 x max_norm_ratio, 10 without one", Check(0.0, low_open=True))
    attack_weight_ratio: float | None = setting(
        None, "attack.weight_ratio", "the num-examples a hostile client claims, as a multiple of "
        "its real number; empty = just under the weight cap in force: 0.99 x max_weight_ratio, "
        "4 without one", Check(0.0, low_open=True))
    attack_target_class: int = setting(0, "attack.target_class", "the class attack.kind = "
                                       "targeted trains every input towards", Check(0))


def attack_bounds(attack: AttackKeys, max_norm_ratio: float,
                  max_weight_ratio: float) -> dict[str, float]:
    """The values of an empty ``attack.norm_ratio`` / ``attack.weight_ratio``: just under the
    server's bounds (:data:`ATTACK_MARGIN` of them; :data:`UNBOUNDED_ATTACK` without one)."""
    bounds = {"norm_ratio": max_norm_ratio, "weight_ratio": max_weight_ratio}
    values = {}
    for name, bound in bounds.items():
        if getattr(attack, f"attack_{name}") is None:
            values[f"attack.{name}"] = (ATTACK_MARGIN * bound if bound
                                        else UNBOUNDED_ATTACK[name])
    return values


def parse_attack_clients(text: str) -> frozenset[int]:
    """``"0,1, 5"`` -> ``{0, 1, 5}`` (``attack.clients``); ``""`` -> none.

    Raises
    ------
    SettingsError
        An item that is not a whole number >= 0.
    """
    out = set()
    for item in filter(None, (i.strip() for i in text.split(","))):
        if not (item.isascii() and item.isdigit() and len(item) <= 12):
            raise SettingsError(f"attack.clients item {item[:30]!r} is not a client key (a "
                                f"whole number >= 0); expected keys such as '0,1'")
        out.add(int(item))
    return frozenset(out)
