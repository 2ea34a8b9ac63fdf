"""NetemSettings: the ``netem.*`` run-config keys of the emulator, parsed and validated.

The strategy puts these keys in every train message's config, so the Flower mod on the client
side rebuilds exactly the server's scenario; ``--set netem.mix=lte:0.5,3g:0.5`` style strings
are accepted for every key.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from client.settings import SettingsError, coerce
from simulations.netem.errors import LinkConfigError
from simulations.netem.link import OUTAGE_POLICIES
from simulations.netem.presets import DEVICE_PRESETS, LINK_PRESETS
from simulations.netem.scenario import Assignment, assign
from simulations.netem.staleness import STALE_POLICIES, StalePolicy

PREFIX = "netem."
#: Per-round keys the strategy adds next to the settings (not settings themselves).
ROUND_KEY = "netem.round"
ROUND_START_KEY = "netem.round_start_s"


def _doc(text: str) -> Any:
    return field(metadata={"doc": text})


@dataclass(frozen=True)
class NetemSettings:
    """Every emulator setting of a run; the key of field ``x`` is ``netem.x``.

    Parameters
    ----------
    enabled : bool
        Emulate the network (virtual time, deadline, drops). False: the mod passes through.
    mix : str
        Link presets by fraction, ``"lte:0.5,3g:0.5"``; fractions sum to 1.
    intermittent : float
        Fraction of clients with on/off outages, in [0, 1].
    intermittent_mean_on_s, intermittent_mean_off_s : float
        Mean up / down sojourn of intermittent links in seconds, > 0.
    outage_policy : str
        ``"fail"`` or ``"resume"``: what an outage does to a transfer of an intermittent client.
    device_mix : str
        Device presets by fraction, ``"midrange:0.7,lowend:0.3"``.
    availability : float
        Per-round availability of every device, in (0, 1]; 0 keeps the presets' own.
    seed : int
        Scenario seed, >= 0.
    num_clients : int
        Clients in the scenario (ids 0..num_clients-1), >= 1.
    deadline_s : float
        Round deadline in virtual seconds, >= 0; 0 means none.
    local_epochs : float
        Local epochs per round: virtual compute is ``num-examples * local_epochs`` samples.
    local_samples : int
        When > 0, the samples trained per round instead (local steps times batch size).
    target_accuracy : float
        When > 0, ``summary.json`` reports ``virtual_seconds_to_target`` for it, in [0, 1].
    stale_policy : str
        ``"keep"``, ``"decay"`` or ``"drop"`` (see :mod:`simulations.netem.staleness`).
    stale_decay : float
        Decay factor per round away beyond ``stale_after_rounds``, in (0, 1].
    stale_after_rounds : int
        Rounds away tolerated before the stale policy acts, >= 0.
    """

    enabled: bool = _doc("emulate the network")
    mix: str = _doc("link presets by fraction")
    intermittent: float = _doc("fraction of intermittent clients")
    intermittent_mean_on_s: float = _doc("mean up time of intermittent links")
    intermittent_mean_off_s: float = _doc("mean outage of intermittent links")
    outage_policy: str = _doc("fail or resume")
    device_mix: str = _doc("device presets by fraction")
    availability: float = _doc("per-round device availability; 0 = presets'")
    seed: int = _doc("scenario seed")
    num_clients: int = _doc("clients in the scenario")
    deadline_s: float = _doc("round deadline; 0 = none")
    local_epochs: float = _doc("local epochs per round")
    local_samples: int = _doc("samples per round; 0 = num-examples * local_epochs")
    target_accuracy: float = _doc("accuracy for virtual_seconds_to_target; 0 = none")
    stale_policy: str = _doc("keep, decay or drop")
    stale_decay: float = _doc("decay per round away")
    stale_after_rounds: int = _doc("rounds away before the policy acts")

    def __init__(self, enabled: bool = False, mix: str = "lte:0.5,3g:0.5",
                 intermittent: float = 0.0, intermittent_mean_on_s: float = 120.0,
                 intermittent_mean_off_s: float = 30.0, outage_policy: str = "fail",
                 device_mix: str = "midrange:1.0", availability: float = 0.0, seed: int = 0,
                 num_clients: int = 100, deadline_s: float = 0.0, local_epochs: float = 1.0,
                 local_samples: int = 0, target_accuracy: float = 0.0,
                 stale_policy: str = "keep", stale_decay: float = 0.5,
                 stale_after_rounds: int = 0) -> None:
        values = dict(locals())
        values.pop("self")
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, values[f.name], f.type))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, accepted: str) -> LinkConfigError:
            return LinkConfigError(f"{PREFIX}{name} must be {accepted}, "
                                   f"got {getattr(self, name)!r}")

        for name, presets in (("mix", LINK_PRESETS), ("device_mix", DEVICE_PRESETS)):
            fractions = parse_fractions(getattr(self, name), name)
            unknown = sorted(set(fractions) - set(presets))
            if unknown:
                raise bad(name, f"made of known presets {sorted(presets)} (unknown: {unknown})")
            if not math.isclose(sum(fractions.values()), 1.0, abs_tol=1e-6) or any(
                    f < 0 for f in fractions.values()):
                raise bad(name, "fractions >= 0 that sum to 1")
        if not 0.0 <= self.intermittent <= 1.0:
            raise bad("intermittent", "in [0, 1]")
        for name in ("intermittent_mean_on_s", "intermittent_mean_off_s"):
            if not getattr(self, name) > 0:
                raise bad(name, "> 0 seconds")
        if self.outage_policy not in OUTAGE_POLICIES:
            raise bad("outage_policy", f"one of {list(OUTAGE_POLICIES)}")
        if not 0.0 <= self.availability <= 1.0:
            raise bad("availability", "in [0, 1] (0: the presets' own)")
        if self.seed < 0:
            raise bad("seed", "an integer >= 0")
        if self.num_clients < 1:
            raise bad("num_clients", "an integer >= 1")
        if not self.deadline_s >= 0:
            raise bad("deadline_s", ">= 0 seconds (0: no deadline)")
        if not self.local_epochs > 0:
            raise bad("local_epochs", "> 0")
        if self.local_samples < 0:
            raise bad("local_samples", "an integer >= 0 (0: num-examples * local_epochs)")
        if not 0.0 <= self.target_accuracy <= 1.0:
            raise bad("target_accuracy", "in [0, 1] (0: none)")
        if self.stale_policy not in STALE_POLICIES:
            raise bad("stale_policy", f"one of {list(STALE_POLICIES)}")
        if not 0.0 < self.stale_decay <= 1.0:
            raise bad("stale_decay", "in (0, 1]")
        if self.stale_after_rounds < 0:
            raise bad("stale_after_rounds", "an integer >= 0")

    # -- conversions --------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> NetemSettings:
        """Settings from the ``netem.*`` keys of ``config`` (other keys are ignored).

        An unknown ``netem.*`` key is an error naming it and the known keys.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for key, value in config.items():
            if not key.startswith(PREFIX) or key in (ROUND_KEY, ROUND_START_KEY):
                continue
            name = key[len(PREFIX):]
            if name not in known:
                raise LinkConfigError(f"unknown key {key!r}; known netem keys: "
                                      f"{sorted(PREFIX + k for k in known)}")
            values[name] = value
        return cls(**values)

    def to_config(self) -> dict[str, bool | int | float | str]:
        """The ``netem.*`` keys, typed, for a Flower ConfigRecord."""
        return {PREFIX + f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def deadline(self) -> float:
        """The deadline for :class:`~simulations.netem.clock.RoundClock` (``inf`` when none)."""
        return self.deadline_s if self.deadline_s > 0 else math.inf

    @property
    def stale(self) -> StalePolicy:
        """The stale-residual policy."""
        return StalePolicy(self.stale_policy, self.stale_decay, self.stale_after_rounds)

    def scenario_key(self) -> tuple:
        """The fields that define the client -> (link, device) mapping."""
        return (self.mix, self.intermittent, self.intermittent_mean_on_s,
                self.intermittent_mean_off_s, self.outage_policy, self.device_mix,
                self.availability, self.seed, self.num_clients)

    def assignment(self) -> Assignment:
        """Build the scenario's assignment (cached per process by :func:`assignment_for`)."""
        return assign(self.num_clients, parse_fractions(self.mix, "mix"), self.seed,
                      intermittent=self.intermittent,
                      intermittent_mean_on_s=self.intermittent_mean_on_s,
                      intermittent_mean_off_s=self.intermittent_mean_off_s,
                      outage_policy=self.outage_policy,
                      device_mix=parse_fractions(self.device_mix, "device_mix"),
                      availability=self.availability or None)


_ASSIGNMENTS: dict[tuple, Assignment] = {}


def assignment_for(settings: NetemSettings) -> Assignment:
    """The (process-wide cached) assignment of ``settings``' scenario."""
    key = settings.scenario_key()
    hit = _ASSIGNMENTS.get(key)
    if hit is None:
        if len(_ASSIGNMENTS) >= 8:
            _ASSIGNMENTS.pop(next(iter(_ASSIGNMENTS)))
        hit = _ASSIGNMENTS[key] = settings.assignment()
    return hit


def parse_fractions(text: str, name: str) -> dict[str, float]:
    """``"lte:0.5,3g:0.5"`` -> ``{"lte": 0.5, "3g": 0.5}``, naming ``netem.<name>`` on error."""
    out: dict[str, float] = {}
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        preset, sep, frac = part.rpartition(":")
        try:
            value = float(frac)
        except ValueError:
            value = math.nan
        if not sep or not preset or not math.isfinite(value):
            raise LinkConfigError(f"{PREFIX}{name} must look like 'preset:fraction,...', "
                                  f"got {text!r} (bad part {part!r})")
        if preset in out:
            raise LinkConfigError(f"{PREFIX}{name} names {preset!r} twice in {text!r}")
        out[preset.strip()] = value
    if not out:
        raise LinkConfigError(f"{PREFIX}{name} must name at least one preset, got {text!r}")
    return out


def _coerce(name: str, value: object, kind: object) -> object:
    # The run config's own conversion (``--set`` strings, TOML values), plus finiteness: a link
    # number that is Inf or NaN would make every virtual time meaningless.
    kind = {"bool": bool, "int": int, "float": float, "str": str}.get(str(kind), kind)
    key = PREFIX + name
    try:
        out = coerce(key, value, kind)  # type: ignore[arg-type]
    except SettingsError as ex:
        raise LinkConfigError(str(ex)) from ex
    if kind is float and not math.isfinite(out):
        raise LinkConfigError(f"{key} must be a finite number, got {value!r}")
    return out
