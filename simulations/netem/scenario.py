"""A scenario: which link and device each client gets, as an explicit, seeded assignment."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from simulations.netem._validate import integer, number
from simulations.netem.device import Device, DeviceProfile
from simulations.netem.errors import LinkConfigError
from simulations.netem.link import OUTAGE_POLICIES, Link
from simulations.netem.outage import MarkovOnOff
from simulations.netem.presets import DEVICE_PRESETS, LINK_PRESETS, LinkProfile
from simulations.netem.throughput import Trace

_STREAM_LINKS, _STREAM_DEVICES, _STREAM_INTERMITTENT, _STREAM_OUTAGES = 1, 2, 3, 4


def split_counts(total: int, fractions: Mapping[str, float], what: str) -> dict[str, int]:
    """Exact counts per name summing to ``total`` (largest remainder), fractions summing to 1."""
    if not fractions:
        raise LinkConfigError(f"{what} must name at least one preset")
    for name, f in fractions.items():
        number(what, name, f, minimum=0.0, maximum=1.0)
    s = sum(fractions.values())
    if not math.isclose(s, 1.0, abs_tol=1e-6):
        raise LinkConfigError(f"{what} fractions must sum to 1, got {s:g} from {dict(fractions)}")
    raw = {n: f * total for n, f in fractions.items()}
    counts = {n: int(math.floor(v)) for n, v in raw.items()}
    short = total - sum(counts.values())
    # Ties broken by name so the split does not depend on dict order.
    for n in sorted(raw, key=lambda n: (-(raw[n] - counts[n]), n))[:short]:
        counts[n] += 1
    return counts


@dataclass(frozen=True)
class ClientNetwork:
    """One client's link and device."""

    client_id: int
    link: Link
    device: Device
    intermittent: bool


class Assignment:
    """The mapping client id -> (link, device) of a scenario; built by :func:`assign`.

    The per-client draws are held as small arrays; a client's :class:`ClientNetwork` is built on
    first use and kept in a bounded cache, so 10,000 clients cost a few hundred kilobytes and any
    one client can be looked up without building the others (the Flower mod does that, once per
    process and client).
    """

    _CACHE = 4096

    def __init__(self, seed: int, profiles: list[LinkProfile], link_idx: np.ndarray,
                 devices: list[DeviceProfile], device_idx: np.ndarray, speed_z: np.ndarray,
                 flaky: np.ndarray, phase: np.ndarray, intermittent_mean_on_s: float,
                 intermittent_mean_off_s: float, outage_policy: str,
                 availability: float | None) -> None:
        self.seed = seed
        self._profiles, self._link_idx = profiles, link_idx
        self._devices, self._device_idx, self._speed_z = devices, device_idx, speed_z
        self._flaky, self._phase = flaky, phase
        self._on_s, self._off_s = intermittent_mean_on_s, intermittent_mean_off_s
        self._policy, self._availability = outage_policy, availability
        self._cache: OrderedDict[int, ClientNetwork] = OrderedDict()

    def __len__(self) -> int:
        return int(self._link_idx.size)

    def __getitem__(self, client_id: int) -> ClientNetwork:
        if isinstance(client_id, bool) or not isinstance(client_id, (int, np.integer)):
            raise LinkConfigError(f"client id must be an int, got {client_id!r}")
        cid = int(client_id)
        if not 0 <= cid < len(self):
            raise LinkConfigError(f"client id {cid} is outside 0..{len(self) - 1}")
        hit = self._cache.get(cid)
        if hit is not None:
            self._cache.move_to_end(cid)
            return hit
        built = self._build(cid)
        self._cache[cid] = built
        if len(self._cache) > self._CACHE:
            self._cache.popitem(last=False)
        return built

    def _build(self, cid: int) -> ClientNetwork:
        profile = self._profiles[int(self._link_idx[cid])]
        flaky = bool(self._flaky[cid])
        outages = None
        if flaky:
            outages = MarkovOnOff(self._on_s, self._off_s, seed=(self.seed, cid, _STREAM_OUTAGES))
        periods = [t.period_s for t in (profile.down_mbps, profile.up_mbps)
                   if isinstance(t, Trace)]
        offset_s = float(self._phase[cid]) * max(periods) if periods else 0.0
        link = profile.make_link((self.seed, cid), outages=outages, outage_policy=self._policy,
                                 trace_offset_s=offset_s)
        dp = self._devices[int(self._device_idx[cid])]
        sps = dp.seconds_per_sample * float(np.exp(dp.spread * self._speed_z[cid]))
        availability = dp.availability if self._availability is None else self._availability
        return ClientNetwork(cid, link, Device(sps, availability, dp.name, (self.seed, cid)),
                             flaky)

    @property
    def clients(self) -> list[ClientNetwork]:
        """Every client, in id order (builds them all: for small scenarios and reports)."""
        return [self[i] for i in range(len(self))]

    def link_name(self, client_id: int) -> str:
        """The link preset of ``client_id``, without building its link."""
        return self._profiles[int(self._link_idx[client_id])].name

    def is_intermittent(self, client_id: int) -> bool:
        """Whether ``client_id`` has the scenario's outages."""
        return bool(self._flaky[client_id])

    def counts(self) -> dict[str, int]:
        """Clients per link preset."""
        idx, n = np.unique(self._link_idx, return_counts=True)
        return {self._profiles[int(i)].name: int(c) for i, c in zip(idx, n, strict=True)}


def assign(num_clients: int, mix: Mapping[str, float], seed: int = 0, *,
           intermittent: float = 0.0, intermittent_mean_on_s: float = 120.0,
           intermittent_mean_off_s: float = 30.0, outage_policy: str = "fail",
           device_mix: Mapping[str, float] | None = None, availability: float | None = None,
           link_presets: Mapping[str, LinkProfile] | None = None,
           device_presets: Mapping[str, DeviceProfile] | None = None) -> Assignment:
    """Give each of ``num_clients`` clients a link and a device, reproducibly from ``seed``.

    Parameters
    ----------
    num_clients : int
        Number of clients, >= 1; ids are 0..num_clients-1.
    mix : mapping of str to float
        Link preset name -> fraction of clients; fractions sum to 1 and the counts are exact
        (largest remainder), e.g. ``{"lte": 0.5, "3g": 0.5}``.
    seed : int
        Run seed: fixes who gets which link and device, the trace phases, the outage timelines
        and the per-transfer draws.
    intermittent : float
        Fraction of clients, in [0, 1], whose link also has outages: an on/off chain with
        exponential sojourns (means ``intermittent_mean_on_s``, ``intermittent_mean_off_s``)
        under ``outage_policy`` (``"fail"`` or ``"resume"``). It replaces the preset's stalls.
    device_mix : mapping of str to float, optional
        Device preset name -> fraction; ``{"midrange": 1.0}`` when omitted.
    availability : float, optional
        Overrides every device's per-round availability, in (0, 1].
    link_presets, device_presets : mapping, optional
        Presets to use instead of the built-in ones (e.g. trace-based links).
    """
    integer("assign", "num_clients", num_clients, minimum=1)
    integer("assign", "seed", seed, minimum=0)
    number("assign", "intermittent", intermittent, minimum=0.0, maximum=1.0)
    on_s = number("assign", "intermittent_mean_on_s", intermittent_mean_on_s, minimum=0.0,
                  strict_min=True)
    off_s = number("assign", "intermittent_mean_off_s", intermittent_mean_off_s, minimum=0.0,
                   strict_min=True)
    if outage_policy not in OUTAGE_POLICIES:
        raise LinkConfigError(f"assign.outage_policy must be one of {OUTAGE_POLICIES}, "
                              f"got {outage_policy!r}")
    if availability is not None:
        number("assign", "availability", availability, minimum=0.0, maximum=1.0,
               strict_min=True)
    links = dict(LINK_PRESETS if link_presets is None else link_presets)
    devices = dict(DEVICE_PRESETS if device_presets is None else device_presets)
    device_mix = {"midrange": 1.0} if device_mix is None else device_mix
    for name in mix:
        if name not in links:
            raise LinkConfigError(f"assign.mix names unknown link preset {name!r}; expected one "
                                  f"of {sorted(links)}")
    for name in device_mix:
        if name not in devices:
            raise LinkConfigError(f"assign.device_mix names unknown device preset {name!r}; "
                                  f"expected one of {sorted(devices)}")

    def labels(fractions: Mapping[str, float], what: str, stream: int) -> tuple[list[str],
                                                                               np.ndarray]:
        counts = split_counts(num_clients, fractions, what)
        names = sorted(counts)
        seq = np.repeat(np.arange(len(names)), [counts[n] for n in names])
        order = np.random.default_rng([seed, stream]).permutation(num_clients)
        return names, seq[order]

    link_names, link_idx = labels(mix, "assign.mix", _STREAM_LINKS)
    device_names, device_idx = labels(device_mix, "assign.device_mix", _STREAM_DEVICES)
    n_int = int(round(intermittent * num_clients))
    flaky = np.zeros(num_clients, dtype=bool)
    flaky[np.random.default_rng([seed, _STREAM_INTERMITTENT]).permutation(num_clients)[:n_int]] = 1
    speed_z = np.random.default_rng([seed, _STREAM_DEVICES, 1]).standard_normal(num_clients)
    phase = np.random.default_rng([seed, _STREAM_LINKS, 1]).random(num_clients)
    return Assignment(seed, [links[n] for n in link_names], link_idx,
                      [devices[n] for n in device_names], device_idx, speed_z, flaky, phase,
                      on_s, off_s, outage_policy, availability)
