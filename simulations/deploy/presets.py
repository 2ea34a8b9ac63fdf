"""Link presets for real shaping, taken from the virtual-clock emulator (``simulations.netem``).

A deployment and a simulation use the very same numbers: :func:`preset` converts the emulator's
:class:`~simulations.netem.presets.LinkProfile` into a :class:`LinkSpec` (round-trip latency,
jitter, rates, and its zero-throughput stalls as an on/off chain under the ``"resume"`` policy).
Packet loss is not reproduced on real links (neither ``tbf`` nor the proxy drops packets), and
trace-driven profiles are refused; see ``docs/deploy.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from simulations.netem.link import OUTAGE_POLICIES
from simulations.netem.presets import LINK_PRESETS, LinkProfile
from simulations.netem.throughput import Trace

from .errors import LinkError


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
        ``"fail"``: an outage resets every connection and refuses new ones until it ends
        (:data:`simulations.netem.link.OUTAGE_POLICIES`).
    """

    name: str
    rtt_ms: float
    jitter_ms: float
    down_mbps: float
    up_mbps: float
    mean_online_s: float = math.inf
    mean_offline_s: float = 0.0
    outage_policy: str = "fail"

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


def from_profile(profile: LinkProfile) -> LinkSpec:
    """Convert an emulator ``LinkProfile`` into the :class:`LinkSpec` shaped on real sockets.

    Raises
    ------
    LinkError
        When a rate is a throughput trace (real shaping here uses constant rates).
    """
    name = profile.name
    rates = {}
    for key in ("down_mbps", "up_mbps"):
        value = profile.down_mbps if key == "down_mbps" else profile.up_mbps
        if isinstance(value, Trace):
            raise LinkError(
                f"link preset {name!r}: {key} is a throughput trace; real shaping needs a "
                f"constant rate"
            )
        rates[key] = float(value)
    on_s, off_s = profile.stall_mean_on_s, profile.stall_mean_off_s
    return LinkSpec(
        name,
        rtt_ms=float(profile.latency_ms),
        jitter_ms=float(profile.jitter_ms),
        mean_online_s=math.inf if on_s is None else float(on_s),
        mean_offline_s=0.0 if off_s is None else float(off_s),
        # The emulator's stalls pause throughput and keep the connection.
        outage_policy="resume",
        **rates,
    )


def preset_names() -> list[str]:
    """Names of the emulator's link presets."""
    return sorted(LINK_PRESETS)


def preset(name: str) -> LinkSpec:
    """The emulator's link preset ``name`` as a :class:`LinkSpec`.

    Raises
    ------
    LinkError
        When ``name`` is not a known preset; the message lists the known ones.
    """
    if name not in LINK_PRESETS:
        raise LinkError(f"unknown link preset {name!r}; expected one of {preset_names()}")
    return from_profile(LINK_PRESETS[name])
