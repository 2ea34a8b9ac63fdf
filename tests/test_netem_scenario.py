"""Presets, devices, and the seeded assignment of links and devices to clients."""

from __future__ import annotations

import numpy as np
import pytest

from simulations.netem import (
    DEVICE_PRESETS,
    LINK_PRESETS,
    Device,
    DeviceProfile,
    LinkConfigError,
    LinkProfile,
    MarkovOnOff,
    Trace,
    assign,
    link_preset,
    split_counts,
)

REQUIRED_PRESETS = {"wifi", "lte", "lte-driving", "3g", "edge", "ethernet-1g"}


def test_every_required_preset_exists_with_a_source_and_builds_a_link() -> None:
    assert REQUIRED_PRESETS <= set(LINK_PRESETS)
    for name, profile in LINK_PRESETS.items():
        assert profile.source, name
        link = profile.make_link((0, 1))
        assert link.name == name
        r = link.transfer(100_000, 0.0, "up")
        assert r.ok and r.end_s > 0


def test_cellular_presets_use_the_trace_medians() -> None:
    assert (link_preset("lte-driving").down_mbps, link_preset("lte-driving").up_mbps) == (5.4, 1.04)
    assert (link_preset("3g").down_mbps, link_preset("3g").up_mbps) == (1.88, 1.08)
    # The zero-throughput seconds of the driving trace (94 of 1012) become stalls.
    p = link_preset("lte-driving")
    stall = MarkovOnOff(p.stall_mean_on_s, p.stall_mean_off_s)
    assert 1 - stall.duty_cycle == pytest.approx(94 / 1012)
    assert p.make_link(0).outage_policy == "resume"


def test_assignment_counts_are_exact_and_the_mapping_is_seeded() -> None:
    mix = {"lte": 0.5, "3g": 0.3, "edge": 0.2}
    a = assign(1000, mix, seed=5, intermittent=0.2)
    assert a.counts() == {"lte": 500, "3g": 300, "edge": 200}
    assert sum(c.intermittent for c in a.clients) == 200
    assert [c.client_id for c in a.clients] == list(range(1000))
    b = assign(1000, mix, seed=5, intermittent=0.2)
    assert [c.link.name for c in a.clients] == [c.link.name for c in b.clients]
    assert [c.device for c in a.clients] == [c.device for c in b.clients]
    assert [c.intermittent for c in a.clients] == [c.intermittent for c in b.clients]
    c = assign(1000, mix, seed=6, intermittent=0.2)
    assert [x.link.name for x in a.clients] != [x.link.name for x in c.clients]
    # Same seed: the same transfer outcomes, client by client.
    for cid in (0, 17, 999):
        assert (a[cid].link.transfer(200_000, 30.0, "up", round_index=2)
                == b[cid].link.transfer(200_000, 30.0, "up", round_index=2))


def test_intermittent_clients_get_the_scenario_outages_and_policy() -> None:
    a = assign(50, {"lte": 1.0}, seed=1, intermittent=0.4, intermittent_mean_on_s=10.0,
               intermittent_mean_off_s=5.0, outage_policy="fail")
    flaky = [c for c in a.clients if c.intermittent]
    steady = [c for c in a.clients if not c.intermittent]
    assert len(flaky) == 20
    assert all(isinstance(c.link.outages, MarkovOnOff) and c.link.outage_policy == "fail"
               and c.link.outages.mean_off_s == 5.0 for c in flaky)
    assert all(c.link.outages is None for c in steady)  # lte has no stalls
    # A 19 s upload over a link down a third of the time (up periods of 10 s on average) fails
    # for about 90% of the intermittent clients, and never for the others.
    fails = sum(not c.link.transfer(10_000_000, 0.0, "up").ok for c in flaky)
    assert fails >= 14
    assert all(c.link.transfer(10_000_000, 0.0, "up").ok for c in steady)


def test_split_counts_largest_remainder() -> None:
    assert split_counts(10, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}, "mix") == {"a": 4, "b": 3,
                                                                            "c": 3}
    assert sum(split_counts(7, {"x": 0.15, "y": 0.85}, "mix").values()) == 7


def test_trace_presets_give_each_client_its_own_phase() -> None:
    trace = Trace.from_samples(np.arange(10.0), np.arange(1.0, 11.0))
    profile = LinkProfile("traced", trace, 1.0, latency_ms=10.0)
    a = assign(20, {"traced": 1.0}, seed=3, link_presets={"traced": profile})
    offsets = {c.link.down.offset_s for c in a.clients}
    assert len(offsets) == 20 and all(0 <= o < 10 for o in offsets)


def test_device_compute_time_spread_and_availability() -> None:
    d = Device(0.004, availability=0.7, seed=(1, 9))
    assert d.compute_seconds(250, epochs=2) == pytest.approx(2.0)
    avail = np.mean([d.is_available(r) for r in range(4000)])
    assert avail == pytest.approx(0.7, abs=0.03)
    assert [d.is_available(r) for r in range(50)] == [d.is_available(r) for r in range(50)]
    a = assign(2000, {"wifi": 1.0}, seed=2, device_mix={"lowend": 0.5, "flagship": 0.5})
    low = [c.device.seconds_per_sample for c in a.clients if c.device.name == "lowend"]
    assert len(low) == 1000
    assert np.median(low) == pytest.approx(DEVICE_PRESETS["lowend"].seconds_per_sample,
                                           rel=0.05)
    assert np.std(np.log(low)) == pytest.approx(0.3, abs=0.03)
    assert all(c.device.availability == 0.5 for c in
               assign(10, {"wifi": 1.0}, seed=2, availability=0.5).clients)


@pytest.mark.parametrize("kwargs,match", [
    ({"mix": {"5g": 1.0}}, "unknown link preset '5g'"),
    ({"mix": {"lte": 0.5, "3g": 0.4}}, "sum to 1, got 0.9"),
    ({"mix": {"lte": 1.2, "3g": -0.2}}, "lte"),
    ({"mix": {}}, "at least one"),
    ({"num_clients": 0}, "num_clients"),
    ({"intermittent": 1.5}, "intermittent"),
    ({"outage_policy": "ignore"}, "outage_policy"),
    ({"device_mix": {"tablet": 1.0}}, "unknown device preset 'tablet'"),
    ({"availability": 0.0}, "availability"),
    ({"intermittent_mean_off_s": -1.0}, "intermittent_mean_off_s"),
])
def test_bad_scenarios_name_the_value(kwargs: dict, match: str) -> None:
    args = {"num_clients": 10, "mix": {"lte": 1.0}, "seed": 0, **kwargs}
    with pytest.raises(LinkConfigError, match=match):
        assign(**args)


def test_bad_profiles_and_devices_name_the_field() -> None:
    with pytest.raises(LinkConfigError, match="seconds_per_sample"):
        DeviceProfile("x", 0.0)
    with pytest.raises(LinkConfigError, match="availability"):
        Device(0.01, availability=1.5)
    with pytest.raises(LinkConfigError, match="num_samples"):
        Device(0.01).compute_seconds(-3)
    with pytest.raises(LinkConfigError, match="stall_mean_off_s"):
        LinkProfile("x", 1.0, 1.0, 10.0, stall_mean_on_s=5.0)
    with pytest.raises(LinkConfigError, match=r"LinkProfile\(x\).up_mbps"):
        LinkProfile("x", 1.0, -1.0, 10.0)
    with pytest.raises(LinkConfigError, match="unknown link preset"):
        link_preset("carrier-pigeon")
    a = assign(3, {"lte": 1.0})
    with pytest.raises(LinkConfigError, match="client id 3 is outside 0..2"):
        a[3]
