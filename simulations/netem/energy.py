"""Energy of a client's radio and processor, from its transfer timeline on the virtual clock.

The radio follows the state machine measured by Huang et al. ("A Close Examination of
Performance and Power Characteristics of 4G LTE Networks", MobiSys 2012, the power-model table
for LTE, 3G and WiFi):

1. **Promotion**: a radio that is idle needs ``promotion_ms`` at ``promotion_mw`` before it can
   send (charged in energy; the transfer itself is not delayed, as the emulator's links were
   calibrated without it).
2. **Transfer**: while data moves the radio draws ``base_mw + up_mw_per_mbps * up_mbps +
   down_mw_per_mbps * down_mbps`` (the paper's ``alpha_u * t_u + alpha_d * t_d + beta``), the
   throughputs being those of the transfers in flight (both directions at once add up).
3. **Tail**: after the last byte the radio stays in a high-power state for ``tail_ms`` at
   ``tail_mw`` before it goes idle. A transfer that starts within the tail cuts it short and
   needs no promotion: overlapping tails merge, so a message every few seconds keeps an LTE
   radio (11.6 s tail) out of idle for good.

Energy above the radio's idle draw is reported. Each piece goes to the transfer that caused it:
a promotion to the transfer it woke the radio for, a tail to the transfer it follows (up to the
next transfer), an active stretch shared by the transfers in flight in proportion to the bits
each moved. Compute energy is the device's power times its training seconds.

Presets (:data:`POWER_MODELS`) carry their source; a JSON file of the same fields
(:func:`load_power_models`, run key ``netem.power_model``) replaces or adds models.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from simulations.netem.errors import NetemError


class PowerModelError(NetemError):
    """A power model, a power-model file or a timeline value outside its accepted range."""


def _non_negative(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
            value) or value < 0:
        raise PowerModelError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RadioPowerModel:
    """One radio technology's power model (milliwatts, milliseconds, Mbit/s).

    Parameters
    ----------
    promotion_mw, promotion_ms : float
        Power and duration of the promotion from idle to the connected state.
    tail_mw, tail_ms : float
        Power and duration of the tail after the last transfer.
    up_mw_per_mbps, down_mw_per_mbps, base_mw : float
        Transfer power ``base_mw + up_mw_per_mbps * up_mbps + down_mw_per_mbps * down_mbps``.
    source : str
        Where the values come from.
    """

    promotion_mw: float
    promotion_ms: float
    tail_mw: float
    tail_ms: float
    up_mw_per_mbps: float
    down_mw_per_mbps: float
    base_mw: float
    source: str = ""

    def __post_init__(self) -> None:
        for f in NUMERIC_FIELDS:
            _non_negative(f"RadioPowerModel.{f}", getattr(self, f))


NUMERIC_FIELDS = tuple(f.name for f in fields(RadioPowerModel) if f.name != "source")

_HUANG = ("Huang et al., MobiSys 2012, power-model table (LTE, 3G and WiFi: promotion, tail, "
          "and alpha_u, alpha_d, beta of the transfer power)")

#: Radio power models by technology (values as transcribed from the cited table).
POWER_MODELS: dict[str, RadioPowerModel] = {
    "lte": RadioPowerModel(promotion_mw=1210.7, promotion_ms=260.1, tail_mw=1060.0,
                           tail_ms=11576.0, up_mw_per_mbps=438.39, down_mw_per_mbps=51.97,
                           base_mw=1288.04, source=_HUANG),
    "3g": RadioPowerModel(promotion_mw=659.4, promotion_ms=582.1, tail_mw=803.9,
                          tail_ms=8088.2, up_mw_per_mbps=868.98, down_mw_per_mbps=122.12,
                          base_mw=817.88, source=_HUANG),
    "wifi": RadioPowerModel(promotion_mw=124.4, promotion_ms=79.1, tail_mw=119.3,
                            tail_ms=238.1, up_mw_per_mbps=283.17, down_mw_per_mbps=137.01,
                            base_mw=132.86, source=_HUANG),
}

#: Which radio each link preset of :mod:`simulations.netem.presets` uses (None: no radio,
#: a wired link). EDGE uses the 3G model (the cited tables have no 2.5G row).
LINK_RADIO: dict[str, str | None] = {
    "wifi": "wifi", "lte": "lte", "lte-driving": "lte", "3g": "3g", "edge": "3g",
    "ethernet-1g": None, "trace": "lte",
}

#: Processor power while training, by device preset (*assumed*: a phone SoC under sustained
#: load; no measurement of fedgc's training on these devices exists).
DEVICE_COMPUTE_W: dict[str, float] = {"flagship": 3.0, "midrange": 2.0, "lowend": 1.2,
                                      "server": 30.0}


@dataclass(frozen=True)
class Transfer:
    """Bytes moved between two instants of virtual time (one direction or both)."""

    start_s: float
    end_s: float
    up_bytes: int = 0
    down_bytes: int = 0

    def __post_init__(self) -> None:
        _non_negative("Transfer.start_s", self.start_s)
        _non_negative("Transfer.end_s", self.end_s)
        _non_negative("Transfer.up_bytes", self.up_bytes)
        _non_negative("Transfer.down_bytes", self.down_bytes)
        if self.end_s < self.start_s:
            raise PowerModelError(f"Transfer.end_s must be >= start_s {self.start_s!r}, got "
                                  f"{self.end_s!r}")

    @property
    def bits(self) -> float:
        """Bits moved, both directions."""
        return 8.0 * (self.up_bytes + self.down_bytes)


@dataclass
class RadioEnergy:
    """Joules of each transfer of a timeline, by state (same order as the transfers)."""

    promotion_j: list[float]
    active_j: list[float]
    tail_j: list[float]
    promotions: int

    def total(self, i: int) -> float:
        """Joules charged to transfer ``i``."""
        return self.promotion_j[i] + self.active_j[i] + self.tail_j[i]

    @property
    def total_j(self) -> float:
        """Joules of the whole timeline."""
        return sum(self.promotion_j) + sum(self.active_j) + sum(self.tail_j)


def radio_energy(model: RadioPowerModel, transfers: Sequence[Transfer],
                 until_s: float | None = None, warm: bool = False) -> RadioEnergy:
    """The radio's energy over ``transfers`` (see the module docstring).

    The radio is idle before the first transfer, unless ``warm`` (other traffic kept it out of
    idle: no promotion for the first transfer). ``until_s`` cuts the last tail there (energy
    within a window); without it the last tail runs its full length.
    """
    n = len(transfers)
    out = RadioEnergy([0.0] * n, [0.0] * n, [0.0] * n, 0)
    if n == 0:
        return out
    if until_s is not None:
        _non_negative("until_s", until_s)
    order = sorted(range(n), key=lambda i: (transfers[i].start_s, transfers[i].end_s))
    tail_s = model.tail_ms / 1000.0
    promotion_j = model.promotion_mw * model.promotion_ms / 1e6
    # Busy stretches: maximal unions of overlapping transfers.
    busy: list[tuple[float, float, list[int]]] = []
    for i in order:
        t = transfers[i]
        if busy and t.start_s <= busy[-1][1]:
            start, end, members = busy[-1]
            busy[-1] = (start, max(end, t.end_s), [*members, i])
        else:
            busy.append((t.start_s, t.end_s, [i]))
    previous_end: float | None = None
    previous_last: int | None = None
    for start, end, members in busy:
        gap = math.inf if previous_end is None else start - previous_end
        if previous_last is not None:
            out.tail_j[previous_last] += model.tail_mw * min(gap, tail_s) / 1000.0
        if gap > tail_s and not (warm and previous_end is None):
            # The radio went idle (or never woke): promote for the first transfer.
            out.promotion_j[members[0]] += promotion_j
            out.promotions += 1
        _active(model, transfers, members, out)
        previous_end = end
        previous_last = max(members, key=lambda i: (transfers[i].end_s, i))
    assert previous_end is not None and previous_last is not None
    last_tail = tail_s if until_s is None else min(tail_s, max(0.0, until_s - previous_end))
    out.tail_j[previous_last] += model.tail_mw * last_tail / 1000.0
    return out


def _active(model: RadioPowerModel, transfers: Sequence[Transfer], members: list[int],
            out: RadioEnergy) -> None:
    """Energy of one busy stretch, sub-interval by sub-interval, shared by bits moved."""
    cuts = sorted({transfers[i].start_s for i in members} | {transfers[i].end_s for i in members})
    for a, b in zip(cuts, cuts[1:], strict=False):
        if b <= a:
            continue
        live = [i for i in members if transfers[i].start_s <= a and transfers[i].end_s >= b]
        if not live:
            continue
        up_mbps = sum(_rate_mbps(transfers[i], "up") for i in live)
        down_mbps = sum(_rate_mbps(transfers[i], "down") for i in live)
        power_w = (model.base_mw + model.up_mw_per_mbps * up_mbps
                   + model.down_mw_per_mbps * down_mbps) / 1000.0
        joules = power_w * (b - a)
        weights = [transfers[i].bits for i in live]
        total = sum(weights)
        for i, w in zip(live, weights, strict=True):
            out.active_j[i] += joules * (w / total if total > 0 else 1.0 / len(live))


def _rate_mbps(t: Transfer, direction: str) -> float:
    duration = t.end_s - t.start_s
    nbytes = t.up_bytes if direction == "up" else t.down_bytes
    return nbytes * 8.0 / duration / 1e6 if duration > 0 else 0.0


def compute_energy_j(power_w: float, seconds: float) -> float:
    """Joules of training for ``seconds`` at ``power_w``."""
    return _non_negative("compute power_w", power_w) * _non_negative("compute seconds", seconds)


def load_power_models(path: str | Path) -> dict[str, RadioPowerModel]:
    """The presets with the models of a JSON file laid over them.

    The file is an object of technology name -> object with every field of
    :class:`RadioPowerModel` (``source`` optional), e.g.
    ``{"lte": {"promotion_mw": 1210.7, "promotion_ms": 260.1, ...}}``.

    Raises
    ------
    PowerModelError
        One line naming the file, the model and field, and the accepted range: a missing or
        unreadable file, text that is not a JSON object (a truncated file), a missing field, or
        a value that is negative, NaN, infinite or not a number.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise PowerModelError(f"{path}: cannot read the power model ({why})") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except ValueError as err:
        raise PowerModelError(f"{path}: not a JSON object of power models ({err})") from None
    if not isinstance(data, dict) or not data:
        raise PowerModelError(f"{path}: expected a JSON object of technology -> model "
                              f"(e.g. {{\"lte\": {{...}}}}), got {type(data).__name__}")
    models = dict(POWER_MODELS)
    for name, spec in data.items():
        if not isinstance(spec, Mapping):
            raise PowerModelError(f"{path}: {name} must be an object of the fields "
                                  f"{list(NUMERIC_FIELDS)}, got {type(spec).__name__}")
        missing = [f for f in NUMERIC_FIELDS if f not in spec]
        unknown = sorted(set(spec) - set(NUMERIC_FIELDS) - {"source"})
        if missing or unknown:
            what = f"lacks field {missing[0]!r}" if missing else f"has unknown field {unknown[0]!r}"
            raise PowerModelError(f"{path}: {name} {what}; expected the fields "
                                  f"{list(NUMERIC_FIELDS)} (and optionally 'source')")
        for f in NUMERIC_FIELDS:
            value = spec[f]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value >= 0):
                raise PowerModelError(f"{path}: {name}.{f} must be a finite number >= 0, "
                                      f"got {value!r}")
        models[name] = RadioPowerModel(**{f: float(spec[f]) for f in NUMERIC_FIELDS},
                                       source=str(spec.get("source", path)))
    return models


def _refuse_constant(name: str) -> float:
    # JSON has no NaN or Infinity; Python's parser accepts them unless told not to.
    raise ValueError(f"{name} is not a number JSON allows")
