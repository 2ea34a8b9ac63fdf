"""The attack's keys (part ``attack``): hostile clients for a robustness study.

What ``client/attacks.py`` reads. Sent in train messages only where a client attacks
(:meth:`fedgc.settings.RunConfig.client_config`); ``attack.norm_ratio`` and
``attack.weight_ratio`` left empty are set just under the server's bounds in force when the
run's keys are combined (:func:`attack_bounds`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedgc.schema import Check, SettingsError, setting

__all__ = ["ATTACKS", "ATTACK_MARGIN", "COLLUDING_ATTACKS", "DEVIATIONS", "KNOWLEDGE",
           "UNBOUNDED_ATTACK", "AttackKeys", "attack_bounds", "parse_attack_clients"]

#: Hostile clients (``client.attacks``).
ATTACKS = ("sign_flip", "scaled", "targeted", "noise", "alie", "ipm", "min_max", "min_sum")
#: The attacks whose clients collude: they craft one update from what they know of the round's
#: benign updates (``client.collusion``): ALIE, IPM, min-max, min-sum.
COLLUDING_ATTACKS = ("alie", "ipm", "min_max", "min_sum")
#: What colluders know of the benign updates (``attack.knowledge``): their own honest updates
#: (partial, as in Shejwalkar and Houmansadr 2021), or every benign client's (full).
KNOWLEDGE = ("partial", "full")
#: The perturbation min-max and min-sum add to the benign mean, against its direction
#: (``attack.deviation``, the NDSS 2021 paper's three).
DEVIATIONS = ("std", "unit_vec", "sign")
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
                               "noise (Gaussian, of the same norm); colluding, from what they "
                               "know of the benign updates (attack.knowledge): alie (Baruch et "
                               "al. 2019), ipm (Xie et al. 2019), min_max, min_sum (Shejwalkar "
                               "and Houmansadr 2021)", Check(choices=ATTACKS))
    attack_knowledge: str = setting("partial", "attack.knowledge", "what colluding hostile "
                                    "clients know of the benign updates: partial = their own "
                                    "honest updates; full = every other client's honest update, "
                                    "computed from its data (a simulation's study)",
                                    Check(choices=KNOWLEDGE))
    attack_deviation: str = setting("std", "attack.deviation", "the perturbation min_max and "
                                    "min_sum subtract from the benign mean: std (coordinate-"
                                    "wise), unit_vec (the mean's direction), sign (its signs)",
                                    Check(choices=DEVIATIONS))
    attack_epsilon: float = setting(0.0, "attack.epsilon", "ipm sends -epsilon times the benign "
                                    "mean; 0 = the largest epsilon whose update is no farther "
                                    "from any benign update than the two farthest benign "
                                    "updates are apart (min-max's bound)", Check(0.0))
    attack_norm_ratio: float | None = setting(
        None, "attack.norm_ratio", "the norm of a hostile update, as a multiple of the client's "
        "honest update's norm (its estimate of the round's median); empty = just under the norm "
        "bound in force: 0.99 x max_norm_ratio, 10 without one", Check(0.0, low_open=True))
    attack_weight_ratio: float | None = setting(
        None, "attack.weight_ratio", "the num-examples a hostile client claims, as a multiple of "
        "its real number (colluding kinds: of the median of the benign claims they know); empty "
        "= just under the weight cap in force: 0.99 x max_weight_ratio, without one 4 (colluding "
        "kinds: 1)", Check(0.0, low_open=True))
    attack_target_class: int = setting(0, "attack.target_class", "the class attack.kind = "
                                       "targeted trains every input towards", Check(0))


def attack_bounds(attack: AttackKeys, max_norm_ratio: float,
                  max_weight_ratio: float) -> dict[str, float]:
    """The values of an empty ``attack.norm_ratio`` / ``attack.weight_ratio``: just under the
    server's bounds (:data:`ATTACK_MARGIN` of them; :data:`UNBOUNDED_ATTACK` without one)."""
    bounds = {"norm_ratio": max_norm_ratio, "weight_ratio": max_weight_ratio}
    unbounded = dict(UNBOUNDED_ATTACK)
    if attack.attack_kind in COLLUDING_ATTACKS:
        # Colluders blend in: without a cap they claim the benign median (Shejwalkar and
        # Houmansadr's attackers weigh as much as a benign client).
        unbounded["weight_ratio"] = 1.0
    values = {}
    for name, bound in bounds.items():
        if getattr(attack, f"attack_{name}") is None:
            values[f"attack.{name}"] = ATTACK_MARGIN * bound if bound else unbounded[name]
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
