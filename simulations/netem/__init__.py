"""Network emulator: per-client links and devices on a virtual clock, and the round clock.

Pure Python and numpy; imports nothing of Flower. See docs/netem.md for the model and the sources
of every preset number.
"""

from simulations.netem.clock import (
    REASON_DEADLINE,
    REASON_STRAGGLER,
    REASON_UNAVAILABLE,
    ClientJob,
    ClientTimeline,
    RoundClock,
    RoundOutcome,
    client_timeline,
)
from simulations.netem.device import Device, DeviceProfile
from simulations.netem.errors import LinkConfigError, NetemError, TraceError
from simulations.netem.link import REASON_LINK_DOWN, REASON_OK, Link, TransferResult
from simulations.netem.loss import GilbertElliott
from simulations.netem.outage import FixedOutages, MarkovOnOff, OutageProcess
from simulations.netem.presets import (
    DEVICE_PRESETS,
    LINK_PRESETS,
    LinkProfile,
    device_preset,
    link_preset,
)
from simulations.netem.scenario import Assignment, ClientNetwork, assign, split_counts
from simulations.netem.throughput import (
    ConstantRate,
    Throughput,
    Trace,
    load_mahimahi_trace,
    load_throughput_trace,
    load_trace,
)

__all__ = [
    "DEVICE_PRESETS",
    "LINK_PRESETS",
    "REASON_DEADLINE",
    "REASON_LINK_DOWN",
    "REASON_OK",
    "REASON_STRAGGLER",
    "REASON_UNAVAILABLE",
    "Assignment",
    "ClientJob",
    "ClientNetwork",
    "ClientTimeline",
    "ConstantRate",
    "Device",
    "DeviceProfile",
    "FixedOutages",
    "GilbertElliott",
    "Link",
    "LinkConfigError",
    "LinkProfile",
    "MarkovOnOff",
    "NetemError",
    "OutageProcess",
    "RoundClock",
    "RoundOutcome",
    "Throughput",
    "Trace",
    "TraceError",
    "TransferResult",
    "assign",
    "client_timeline",
    "device_preset",
    "link_preset",
    "load_mahimahi_trace",
    "load_throughput_trace",
    "load_trace",
    "split_counts",
]
