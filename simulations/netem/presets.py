"""Link and device presets, with where every number comes from.

Bandwidths are the medians of public cellular traces as tabulated in shared/DGC_NOTES.md
("Mobile links"); the seconds with zero throughput in those traces become short stalls (an on/off
chain under policy ``"resume"``: the connection survives, throughput pauses). Latencies, jitters,
loss rates, stall lengths, Wi-Fi and device speeds are not in those tables: they are assumptions,
stated per preset below and in docs/netem.md, to be replaced by measurements when there are any.
"""

from __future__ import annotations

from dataclasses import dataclass

from simulations.netem._validate import number
from simulations.netem.device import DeviceProfile
from simulations.netem.errors import LinkConfigError
from simulations.netem.link import Link
from simulations.netem.loss import GilbertElliott
from simulations.netem.outage import MarkovOnOff, OutageProcess, SeedLike
from simulations.netem.throughput import Throughput, Trace


def _stall_on_s(zero_fraction: float, mean_off_s: float) -> float:
    """Mean up time such that the stationary down fraction is ``zero_fraction``."""
    return mean_off_s * (1.0 - zero_fraction) / zero_fraction


@dataclass(frozen=True)
class LinkProfile:
    """A class of links from which each client's link is built.

    Parameters
    ----------
    name : str
        Preset name.
    down_mbps, up_mbps : float or Trace
        Median rate in Mbit/s, or a trace (each client then reads it at its own random phase).
    latency_ms, jitter_ms : float
        Round-trip latency and the half-width of its uniform jitter.
    loss : GilbertElliott, optional
        Bursty packet loss.
    stall_mean_on_s, stall_mean_off_s : float, optional
        Zero-throughput stalls as an on/off chain (policy ``"resume"``); both or neither.
    source : str
        Where the numbers come from.
    """

    name: str
    down_mbps: float | Trace
    up_mbps: float | Trace
    latency_ms: float
    jitter_ms: float = 0.0
    loss: GilbertElliott | None = None
    stall_mean_on_s: float | None = None
    stall_mean_off_s: float | None = None
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("down_mbps", "up_mbps"):
            v = getattr(self, f)
            if not isinstance(v, Trace):
                number(f"LinkProfile({self.name})", f, v, minimum=0.0, strict_min=True)
        number(f"LinkProfile({self.name})", "latency_ms", self.latency_ms, minimum=0.0)
        number(f"LinkProfile({self.name})", "jitter_ms", self.jitter_ms, minimum=0.0,
               maximum=self.latency_ms)
        if (self.stall_mean_on_s is None) != (self.stall_mean_off_s is None):
            raise LinkConfigError(f"LinkProfile({self.name}).stall_mean_on_s and "
                                  f"stall_mean_off_s must both be set or both be None")

    def make_link(self, seed: SeedLike, *, outages: OutageProcess | None = None,
                  outage_policy: str = "resume", trace_offset_s: float = 0.0) -> Link:
        """Build one client's link; ``outages`` (intermittent clients) replaces the stalls."""
        seed_words = (seed,) if isinstance(seed, int) else tuple(seed)
        if outages is None and self.stall_mean_on_s is not None:
            outages = MarkovOnOff(self.stall_mean_on_s, self.stall_mean_off_s,
                                  seed=(*seed_words, 0x57A1))
            outage_policy = "resume"
        down: float | Throughput = self.down_mbps
        up: float | Throughput = self.up_mbps
        if isinstance(down, Trace):
            down = down.shifted(trace_offset_s)
        if isinstance(up, Trace):
            up = up.shifted(trace_offset_s)
        return Link(down, up, self.latency_ms, self.jitter_ms, self.loss, outages,
                    outage_policy, seed_words, self.name)


_CELL_SRC = "shared/DGC_NOTES.md, 'Mobile links' table (medians of public cellular traces)"

LINK_PRESETS: dict[str, LinkProfile] = {
    # Assumed: a home/office 802.11ac link behind a consumer broadband line.
    "wifi": LinkProfile("wifi", 50.0, 20.0, latency_ms=20.0, jitter_ms=5.0,
                        loss=GilbertElliott(0.001, 0.5, 0.0, 0.5),
                        source="assumption: typical broadband Wi-Fi; not from a trace"),
    # LTE stationary: the table gives a range of medians over traces (3.7-14.0 down, 1.6-11.2 up);
    # the preset takes their geometric means. Zero-throughput seconds are "few": no stalls.
    "lte": LinkProfile("lte", 7.2, 4.23, latency_ms=50.0, jitter_ms=10.0,
                       loss=GilbertElliott(0.005, 0.25, 0.0, 0.25),
                       source=_CELL_SRC + "; geometric mean of the LTE-stationary medians"),
    # LTE driving: medians 5.4 / 1.04; 94 of 1012 s with zero uplink throughput -> stalls with a
    # 9.3% stationary down fraction, mean stall 3 s (assumed).
    "lte-driving": LinkProfile("lte-driving", 5.4, 1.04, latency_ms=70.0, jitter_ms=20.0,
                               loss=GilbertElliott(0.01, 0.2, 0.0, 0.3),
                               stall_mean_on_s=_stall_on_s(94 / 1012, 3.0),
                               stall_mean_off_s=3.0, source=_CELL_SRC),
    # UMTS/3G: medians 1.88 / 1.08; 32 and 27 of ~1000 s at zero -> 2.95% stalls of 2 s (assumed).
    "3g": LinkProfile("3g", 1.88, 1.08, latency_ms=150.0, jitter_ms=40.0,
                      loss=GilbertElliott(0.01, 0.25, 0.0, 0.3),
                      stall_mean_on_s=_stall_on_s(29.5 / 1000, 2.0), stall_mean_off_s=2.0,
                      source=_CELL_SRC),
    # The slowest row of the table (EVDO): medians 0.41 down / 0.96 up as measured; 43 and 29 of
    # ~1000 s at zero -> 3.6% stalls of 3 s (assumed). Named "edge" as the edge-of-coverage class.
    "edge": LinkProfile("edge", 0.41, 0.96, latency_ms=400.0, jitter_ms=100.0,
                        loss=GilbertElliott(0.02, 0.2, 0.0, 0.4),
                        stall_mean_on_s=_stall_on_s(36 / 1000, 3.0), stall_mean_off_s=3.0,
                        source=_CELL_SRC + "; EVDO row"),
    # The paper's "commodity 1 Gbps" datacenter link, for reference runs.
    "ethernet-1g": LinkProfile("ethernet-1g", 1000.0, 1000.0, latency_ms=0.2, jitter_ms=0.05,
                               source="DGC paper: commodity 1 Gbps Ethernet"),
}

# Assumed speeds per training sample of a small model (an MLP or small CNN on 28x28 inputs) with
# batches of about 10; a log-normal spread of 0.3 across devices of a class.
DEVICE_PRESETS: dict[str, DeviceProfile] = {
    "flagship": DeviceProfile("flagship", 0.001, spread=0.3),
    "midrange": DeviceProfile("midrange", 0.003, spread=0.3),
    "lowend": DeviceProfile("lowend", 0.01, spread=0.3),
    "server": DeviceProfile("server", 0.0002, spread=0.1),
}


def link_preset(name: str) -> LinkProfile:
    """The link preset called ``name``."""
    try:
        return LINK_PRESETS[name]
    except KeyError:
        raise LinkConfigError(f"unknown link preset {name!r}; expected one of "
                              f"{sorted(LINK_PRESETS)}") from None


def device_preset(name: str) -> DeviceProfile:
    """The device preset called ``name``."""
    try:
        return DEVICE_PRESETS[name]
    except KeyError:
        raise LinkConfigError(f"unknown device preset {name!r}; expected one of "
                              f"{sorted(DEVICE_PRESETS)}") from None
