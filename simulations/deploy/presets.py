"""Link presets for real shaping: latency, bandwidth per direction and on/off outages.

The cellular numbers are the medians in ``shared/DGC_NOTES.md`` (public traces); the round-trip
latencies, jitter and the ``wifi`` / ``ethernet-1g`` rows are typical values chosen here, because
the notes give none. When ``simulations.netem`` (the virtual-clock emulator) is importable its
presets take precedence, so that a deployment and a simulation use the very same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .errors import LinkError

OUTAGE_POLICIES = ("drop", "resume")


@dataclass(frozen=True)
class LinkSpec:
    """One client's link, as shaped on real sockets.

    Parameters
    ----------
    name : str
        Preset name, for logs and reports.
    rtt_ms : float
        Round-trip latency; each direction is delayed by half of it.
    jitter_ms : float
        Half-width of the uniform jitter around the latency, as ``tc netem delay D J`` and the
        virtual-clock emulator use it; at most ``rtt_ms``. Bytes are never reordered.
    down_mbps, up_mbps : float
        Bottleneck rate towards the client (downlink) and from it (uplink), in Mbit/s.
    mean_online_s, mean_offline_s : float
        Mean sojourn times of the two-state on/off chain (exponential); ``mean_offline_s == 0``
        means the link never goes down.
    outage_policy : str
        ``"resume"``: an outage pauses the bytes and the connection survives (a stall);
        ``"drop"``: an outage resets every connection and refuses new ones until it ends.
    """

    name: str
    rtt_ms: float
    jitter_ms: float
    down_mbps: float
    up_mbps: float
    mean_online_s: float = math.inf
    mean_offline_s: float = 0.0
    outage_policy: str = "drop"

    def __post_init__(self) -> None:
        if self.outage_policy not in OUTAGE_POLICIES:
            raise LinkError(
                f"link {self.name!r}: outage_policy={self.outage_policy!r}, expected one of "
                f"{list(OUTAGE_POLICIES)}"
            )
        for key in ("rtt_ms", "jitter_ms", "mean_offline_s"):
            value = getattr(self, key)
            if not (value >= 0.0 and math.isfinite(value)):
                raise LinkError(
                    f"link {self.name!r}: {key}={value!r}, expected a finite value >= 0"
                )
        for key in ("down_mbps", "up_mbps"):
            value = getattr(self, key)
            if not (value > 0.0 and math.isfinite(value)):
                raise LinkError(f"link {self.name!r}: {key}={value!r}, expected a finite value > 0")
        if self.jitter_ms > self.rtt_ms:
            raise LinkError(
                f"link {self.name!r}: jitter_ms={self.jitter_ms!r} exceeds rtt_ms={self.rtt_ms!r}"
            )
        if not self.mean_online_s > 0.0:
            raise LinkError(
                f"link {self.name!r}: mean_online_s={self.mean_online_s!r}, expected > 0"
            )

    @property
    def intermittent(self) -> bool:
        """Whether the link has outages."""
        return self.mean_offline_s > 0.0 and math.isfinite(self.mean_online_s)

    def with_overrides(self, **changes: float | str) -> LinkSpec:
        """Return a copy with some fields changed (validated again)."""
        unknown = set(changes) - set(self.__dataclass_fields__)
        if unknown:
            raise LinkError(
                f"unknown link field(s) {sorted(unknown)}; expected some of "
                f"{sorted(self.__dataclass_fields__)}"
            )
        return replace(self, **changes)


def _outage_chain(up_zero_s: float, total_s: float, mean_offline_s: float) -> tuple[float, float]:
    """Mean on/off sojourns that give ``up_zero_s`` seconds offline out of ``total_s``."""
    offline_fraction = up_zero_s / total_s
    mean_online_s = mean_offline_s * (1.0 - offline_fraction) / offline_fraction
    return mean_online_s, mean_offline_s


_LTE_DRIVING_ON, _LTE_DRIVING_OFF = _outage_chain(94.0, 1012.0, 3.0)
_3G_ON, _3G_OFF = _outage_chain(27.0, 1000.0, 2.0)

LOCAL_PRESETS: dict[str, LinkSpec] = {
    "ethernet-1g": LinkSpec("ethernet-1g", rtt_ms=1.0, jitter_ms=0.0, down_mbps=1000.0,
                            up_mbps=1000.0),
    "wifi": LinkSpec("wifi", rtt_ms=20.0, jitter_ms=3.0, down_mbps=50.0, up_mbps=20.0),
    # LTE stationary: the middle of the notes' ranges (3.7-14.0 down, 1.6-11.2 up).
    "lte": LinkSpec("lte", rtt_ms=50.0, jitter_ms=5.0, down_mbps=8.0, up_mbps=4.0),
    "lte-driving": LinkSpec("lte-driving", rtt_ms=80.0, jitter_ms=15.0, down_mbps=5.4,
                            up_mbps=1.04, mean_online_s=_LTE_DRIVING_ON,
                            mean_offline_s=_LTE_DRIVING_OFF),
    "3g": LinkSpec("3g", rtt_ms=150.0, jitter_ms=20.0, down_mbps=1.88, up_mbps=1.08,
                   mean_online_s=_3G_ON, mean_offline_s=_3G_OFF),
    # EDGE-class link; the notes' EVDO row is the closest measured one.
    "edge": LinkSpec("edge", rtt_ms=300.0, jitter_ms=40.0, down_mbps=0.41, up_mbps=0.96),
}


def preset(name: str) -> LinkSpec:
    """Look up a link preset by name.

    Raises
    ------
    LinkError
        When ``name`` is not a known preset; the message lists the known ones.
    """
    try:
        return LOCAL_PRESETS[name]
    except KeyError:
        raise LinkError(
            f"unknown link preset {name!r}; expected one of {sorted(LOCAL_PRESETS)}"
        ) from None
