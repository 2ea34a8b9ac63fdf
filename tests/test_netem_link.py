"""Link transfers against their analytical times: constant links, traces, outages, loss, seeds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from simulations.netem import (
    FixedOutages,
    GilbertElliott,
    Link,
    LinkConfigError,
    MarkovOnOff,
    Trace,
    TraceError,
    load_mahimahi_trace,
    load_throughput_trace,
    load_trace,
)


@pytest.mark.parametrize("direction,mbps", [("down", 8.0), ("up", 1.5)])
@pytest.mark.parametrize("nbytes", [0, 1, 1500, 123_457, 4_000_000])
def test_constant_link_time_is_latency_plus_serialization(direction: str, mbps: float,
                                                          nbytes: int) -> None:
    link = Link(down_mbps=8.0, up_mbps=1.5, latency_ms=80.0)
    r = link.transfer(nbytes, 10.0, direction)
    assert r.ok and r.reason == "ok"
    assert r.end_s == pytest.approx(10.0 + 0.080 + nbytes * 8 / (mbps * 1e6), rel=1e-12)
    assert r.wire_bytes == nbytes and r.outage_s == 0.0


def test_jitter_stays_within_its_band_and_averages_to_the_latency() -> None:
    link = Link(10.0, 10.0, latency_ms=100.0, jitter_ms=30.0, seed=(7, 3))
    lat = np.array([link.transfer(0, 0.0, "up", round_index=r).latency_s for r in range(2000)])
    assert lat.min() >= 0.070 and lat.max() <= 0.130
    assert lat.mean() == pytest.approx(0.100, abs=0.002)
    assert len(np.unique(lat)) > 1900  # a fresh draw per round, not one value reused


def test_piecewise_constant_trace_integrates_exactly() -> None:
    # 1 Mbit/s on [0,1), 2 on [1,2), 4 on [2,3): 7 Mbit per 3 s period.
    trace = Trace.from_samples([0.0, 1.0, 2.0], [1.0, 2.0, 4.0])
    assert trace.period_s == 3.0 and trace.mean_mbps == pytest.approx(7 / 3)
    link = Link(trace, trace)
    # 0.5 Mbit in [0.5, 1) and 2 Mbit in [1, 2): 2.5 Mbit from 0.5 s ends at exactly 2 s.
    assert link.transfer(2_500_000 // 8, 0.5, "down").end_s == pytest.approx(2.0, abs=1e-12)
    # 10 Mbit from 0: one whole period (7), then 1 + 2 of the next: ends at 5 s.
    assert link.transfer(10_000_000 // 8, 0.0, "up").end_s == pytest.approx(5.0, abs=1e-12)
    # Half-way into the 4 Mbit/s segment of the third period.
    assert link.transfer((14_000_000 + 3_000_000 + 2_000_000) // 8, 0.0,
                         "up").end_s == pytest.approx(8.5, abs=1e-12)


def test_trace_with_a_zero_segment_stalls_without_failing() -> None:
    trace = Trace.from_samples([0.0, 1.0, 3.0], [2.0, 0.0, 2.0], period_s=4.0)
    r = Link(trace, trace, outage_policy="fail").transfer(625_000, 0.0, "down")  # 5 Mbit
    # 2 in [0,1), nothing in [1,3), 2 in [3,4), the last 1 at the start of the next period.
    assert r.ok and r.end_s == pytest.approx(4.5)


def test_trace_phase_shift_reads_the_trace_later() -> None:
    trace = Trace.from_samples([0.0, 1.0], [1.0, 3.0])
    shifted = Link(trace.shifted(1.0), trace)
    # Shifted by 1 s: starts in the 3 Mbit/s segment.
    assert shifted.transfer(3_000_000 // 8, 0.0, "down").end_s == pytest.approx(1.0)


def test_throughput_trace_file_round_trip(tmp_path) -> None:
    p = tmp_path / "cell.txt"
    p.write_text("# t_seconds mbps\n0 1.0\n1 2.0\n\n2 4.0\n")
    trace = load_throughput_trace(p)
    assert trace.period_s == 3.0
    assert trace.bits_between(0.0, 3.0) == pytest.approx(7e6)
    assert load_trace(p).kind == "linear"


def test_mahimahi_trace_delivers_one_packet_per_opportunity_and_loops(tmp_path) -> None:
    p = tmp_path / "mm.trace"
    p.write_text("1\n1\n5\n10\n")  # 4 packets per 10 ms loop, two of them at 1 ms
    trace = load_mahimahi_trace(p)
    assert load_trace(p).kind == "step" and trace.period_s == pytest.approx(0.010)
    assert trace.mean_mbps == pytest.approx(4 * 1500 * 8 / 0.010 / 1e6)
    link = Link(trace, trace)
    assert link.transfer(1, 0.0, "down").end_s == pytest.approx(0.001)  # a partial packet
    assert link.transfer(3000, 0.0, "down").end_s == pytest.approx(0.001)
    assert link.transfer(4500, 0.0, "down").end_s == pytest.approx(0.005)
    # The fifth packet is the first opportunity of the second loop, at 10 + 1 ms.
    assert link.transfer(5 * 1500, 0.0, "down").end_s == pytest.approx(0.011)
    # Starting after the 5 ms opportunity: the next ones are at 10 ms, then 11 ms.
    assert link.transfer(1500, 0.006, "up").end_s == pytest.approx(0.010)
    assert link.transfer(3000, 0.006, "up").end_s == pytest.approx(0.011)


def test_mahimahi_every_millisecond_is_12_mbps() -> None:
    trace = Trace.from_mahimahi(np.arange(1, 1001))
    assert trace.mean_mbps == pytest.approx(12.0)
    r = Link(trace, trace).transfer(12_000_000 // 8, 0.0, "down")
    assert r.end_s == pytest.approx(1.0)


def test_outage_under_resume_adds_the_outage_time() -> None:
    link = Link(8.0, 4.0, latency_ms=50.0, outages=FixedOutages([(1.0, 3.5)]),
                outage_policy="resume")
    r = link.transfer(1_000_000, 0.0, "up")  # 2 s of serialization at 4 Mbit/s
    assert r.ok
    assert r.outage_s == pytest.approx(2.5)
    assert r.end_s == pytest.approx(0.050 + 2.0 + 2.5)


def test_outage_under_fail_reports_the_cause_and_when() -> None:
    link = Link(8.0, 4.0, latency_ms=50.0, outages=FixedOutages([(1.0, 3.5)]),
                outage_policy="fail")
    r = link.transfer(1_000_000, 0.0, "up")
    assert not r.ok and r.reason == "link_down" and r.end_s == pytest.approx(1.0)


def test_short_outage_in_the_middle_of_a_transfer_is_detected() -> None:
    # The link is down for 10 ms in the middle and up again long before the transfer ends:
    # looking only at the end would miss it.
    outages = FixedOutages([(0.9, 0.91)])
    failing = Link(8.0, 4.0, outages=outages, outage_policy="fail")
    r = failing.transfer(1_000_000, 0.0, "up")
    assert not r.ok and r.end_s == pytest.approx(0.9)
    resuming = Link(8.0, 4.0, outages=outages, outage_policy="resume")
    assert resuming.transfer(1_000_000, 0.0, "up").end_s == pytest.approx(2.01)


def test_outages_outside_the_transfer_do_not_touch_it() -> None:
    outages = FixedOutages([(0.0, 0.5), (2.6, 3.0)])
    link = Link(8.0, 4.0, latency_ms=100.0, outages=outages, outage_policy="fail")
    r = link.transfer(1_000_000, 0.5, "up")  # 0.5 + 0.1 + 2.0 = 2.6: ends as the outage begins
    assert r.ok and r.end_s == pytest.approx(2.6)


def test_outage_during_latency_and_at_start() -> None:
    outages = FixedOutages([(0.02, 0.52)])
    resume = Link(8.0, 8.0, latency_ms=100.0, outages=outages)
    r = resume.transfer(0, 0.0, "down")
    assert r.ok and r.end_s == pytest.approx(0.6) and r.outage_s == pytest.approx(0.5)
    fail = Link(8.0, 8.0, latency_ms=100.0, outages=outages, outage_policy="fail")
    r = fail.transfer(10, 0.3, "down")  # starts while the link is down
    assert not r.ok and r.end_s == pytest.approx(0.3)


def test_trace_and_outage_together() -> None:
    trace = Trace.from_samples([0.0, 1.0, 2.0], [1.0, 2.0, 4.0])
    link = Link(trace, trace, outages=FixedOutages([(1.0, 2.0)]))
    # 1 Mbit in [0,1), nothing while down in [1,2) (the 2 Mbit/s are lost), then 4 Mbit/s.
    r = link.transfer(3_000_000 // 8, 0.0, "down")
    assert r.end_s == pytest.approx(2.5) and r.outage_s == pytest.approx(1.0)


def test_loss_costs_resent_packets_and_their_time() -> None:
    ge = GilbertElliott(0.05, 0.2, loss_good=0.01, loss_bad=0.5)
    link = Link(10.0, 10.0, latency_ms=20.0, loss=ge, seed=(1, 2))
    r = link.transfer(3_000_000, 0.0, "down", round_index=4)
    resent = r.wire_bytes - r.nbytes
    assert resent > 0 and resent % ge.mtu_bytes == 0
    assert r.end_s == pytest.approx(0.020 + r.wire_bytes * 8 / 10e6)
    packets = math.ceil(3_000_000 / 1500)
    assert resent / ge.mtu_bytes / (packets + resent / ge.mtu_bytes) == pytest.approx(
        ge.stationary_loss, abs=0.03)


def test_transfers_are_deterministic_per_seed_round_and_direction() -> None:
    def make(seed: tuple[int, int]) -> Link:
        return Link(5.0, 1.0, latency_ms=60.0, jitter_ms=20.0,
                    loss=GilbertElliott(0.02, 0.3, 0.0, 0.5),
                    outages=MarkovOnOff(20.0, 5.0, seed=(*seed, 9)), seed=seed)

    a, b, c = make((3, 11)), make((3, 11)), make((3, 12))
    # Ask b about a later time first: the outage timeline must not depend on query order.
    b.transfer(100_000, 500.0, "up", round_index=9)
    ra = [a.transfer(400_000, 10.0 * r, "up", round_index=r) for r in range(20)]
    rb = [b.transfer(400_000, 10.0 * r, "up", round_index=r) for r in range(20)]
    rc = [c.transfer(400_000, 10.0 * r, "up", round_index=r) for r in range(20)]
    assert ra == rb
    assert ra != rc
    down = a.transfer(400_000, 0.0, "down", round_index=0)
    assert down.latency_s != ra[0].latency_s  # down and up draw from different streams


@pytest.mark.parametrize("kwargs,field", [
    ({"down_mbps": -1.0}, "down_mbps"),
    ({"up_mbps": 0.0}, "up_mbps"),
    ({"up_mbps": float("nan")}, "up_mbps"),
    ({"latency_ms": -5.0}, "latency_ms"),
    ({"latency_ms": 10.0, "jitter_ms": 11.0}, "jitter_ms"),
    ({"outage_policy": "retry"}, "outage_policy"),
    ({"seed": -1}, "seed"),
    ({"loss": 0.1}, "loss"),
])
def test_bad_link_values_name_the_field(kwargs: dict, field: str) -> None:
    base = {"down_mbps": 1.0, "up_mbps": 1.0}
    with pytest.raises(LinkConfigError, match=field):
        Link(**{**base, **kwargs})


@pytest.mark.parametrize("args,field", [
    ((-1, 0.0, "up"), "nbytes"),
    ((1.5, 0.0, "up"), "nbytes"),
    ((10, float("inf"), "up"), "start_s"),
    ((10, 0.0, "sideways"), "direction"),
])
def test_bad_transfer_arguments_name_the_field(args: tuple, field: str) -> None:
    with pytest.raises(LinkConfigError, match=field):
        Link(1.0, 1.0).transfer(*args)


def test_bad_traces_are_refused_with_the_offending_sample(tmp_path) -> None:
    with pytest.raises(TraceError, match="sample 2"):
        Trace.from_samples([0.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    with pytest.raises(TraceError, match="sample 1 has rate -2"):
        Trace.from_samples([0.0, 1.0], [1.0, -2.0])
    with pytest.raises(TraceError, match="delivers no bits"):
        Trace.from_samples([0.0, 1.0], [0.0, 0.0])
    p = tmp_path / "bad.txt"
    p.write_text("0 1.0\n1 fast\n")
    with pytest.raises(TraceError, match=r"bad.txt:2"):
        load_throughput_trace(p)
    p.write_text("5\n3\n")
    with pytest.raises(TraceError, match="line 2 has timestamp 3"):
        load_mahimahi_trace(p)
    with pytest.raises(TraceError, match="cannot read trace file"):
        load_trace(tmp_path / "missing.txt")
