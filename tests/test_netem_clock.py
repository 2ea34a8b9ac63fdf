"""The round clock: analytical finish times, first-K selection, deadlines and drop causes."""

from __future__ import annotations

import math

import pytest

from simulations.netem import (
    ClientJob,
    ClientNetwork,
    Device,
    FixedOutages,
    Link,
    LinkConfigError,
    RoundClock,
    assign,
    client_timeline,
)


def _network(ups_mbps: list[float], outages: dict[int, FixedOutages] | None = None,
             policy: str = "fail", availability: float = 1.0) -> list[ClientNetwork]:
    outages = outages or {}
    return [ClientNetwork(i, Link(10.0, up, latency_ms=100.0, outages=outages.get(i),
                                  outage_policy=policy, seed=(0, i)),
                          Device(0.01, availability, seed=(0, i)), False)
            for i, up in enumerate(ups_mbps)]


def test_client_finish_time_is_download_compute_upload() -> None:
    net = _network([2.0])
    job = ClientJob(0, download_bytes=1_250_000, upload_bytes=50_000, compute_s=3.0)
    t = client_timeline(net[0].link, net[0].device, job, 100.0, 0)
    expected = 100.0 + (0.1 + 1_250_000 * 8 / 10e6) + 3.0 + (0.1 + 50_000 * 8 / 2e6)
    assert t.ok and t.finish_s == pytest.approx(expected)
    assert t.download.end_s == pytest.approx(101.1) and t.upload.start_s == pytest.approx(104.1)


def test_first_k_finishers_make_the_round_and_the_rest_are_counted() -> None:
    # Uplinks from slow to fast: finishing order is 4, 3, 2, 1, 0.
    net = _network([0.5, 1.0, 2.0, 4.0, 8.0])
    clock = RoundClock(clients_per_round=3, deadline_s=60.0, over_selection=5 / 3)
    assert clock.num_to_sample(100) == 5
    jobs = [ClientJob(i, 100_000, 1_000_000, 1.0) for i in range(5)]
    out = clock.run(2, 0.0, jobs, net)
    assert out.aggregated == (4, 3, 2)
    third = 0.1 + 0.08 + 1.0 + 0.1 + 8e6 / 2e6
    assert out.end_s == pytest.approx(third) and out.virtual_seconds == pytest.approx(third)
    assert out.dropped == {1: "straggler", 0: "straggler"}
    # In time, after the K-th: over-selection's surplus, not drops.
    assert out.surplus == 2 and out.dropped_deadline == 0 and out.dropped_link == 0


def test_deadline_closes_a_round_short_of_k() -> None:
    net = _network([0.5, 1.0, 2.0, 4.0, 8.0])
    clock = RoundClock(clients_per_round=5, deadline_s=6.0)
    out = clock.run(0, 50.0, [ClientJob(i, 100_000, 1_000_000, 1.0) for i in range(5)], net)
    # Finish times after the start: 2.28, 3.28, 5.28, 9.28, 17.28.
    assert out.aggregated == (4, 3, 2)
    assert out.end_s == pytest.approx(56.0)  # lost and slow clients look alike: wait it out
    assert out.dropped == {1: "deadline", 0: "deadline"}
    assert out.dropped_deadline == 2 and out.surplus == 0


def test_link_failures_are_dropped_with_their_cause() -> None:
    # Client 1's uplink goes down for a moment mid-upload; client 2's device is never there.
    net = _network([4.0, 4.0, 4.0, 4.0], outages={1: FixedOutages([(2.0, 2.05)])})
    net[2] = ClientNetwork(2, net[2].link, Device(0.01, availability=1e-9, seed=(0, 2)), False)
    clock = RoundClock(clients_per_round=3, deadline_s=30.0, over_selection=1.34)
    assert clock.num_to_sample(4) == 4
    out = clock.run(1, 0.0, [ClientJob(i, 10_000, 1_000_000, 0.5) for i in range(4)], net)
    assert out.aggregated == (0, 3)
    assert out.dropped == {1: "link_down", 2: "unavailable"}
    assert out.dropped_link == 2 and out.dropped_deadline == 0
    assert out.end_s == pytest.approx(30.0)
    tl = {t.client_id: t for t in out.timelines}
    assert tl[1].finish_s == pytest.approx(2.0) and tl[1].upload.reason == "link_down"


def test_no_deadline_waits_for_every_client() -> None:
    net = _network([1.0, 2.0])
    out = RoundClock(5).run(0, 0.0, [ClientJob(i, 0, 1_000_000, 0.0) for i in range(2)], net)
    assert out.aggregated == (1, 0) and out.end_s == pytest.approx(0.2 + 8.0)


def test_outcome_does_not_depend_on_job_order() -> None:
    a = assign(200, {"lte": 0.5, "3g": 0.5}, seed=4, intermittent=0.2)
    jobs = [ClientJob(i, 300_000, 20_000, 2.0) for i in range(0, 200, 7)]
    clock = RoundClock(20, deadline_s=40.0, over_selection=1.3)
    fwd = clock.run(3, 1000.0, jobs, a)
    rev = clock.run(3, 1000.0, list(reversed(jobs)), a)
    assert fwd.aggregated == rev.aggregated and fwd.dropped == rev.dropped
    assert fwd.end_s == rev.end_s
    assert len(fwd.aggregated) + len(fwd.dropped) == len(jobs)


def test_over_selection_rounds_exactly() -> None:
    assert RoundClock(10, over_selection=1.3).num_to_sample(1000) == 13
    assert RoundClock(100, over_selection=1.3).num_to_sample(1000) == 130
    assert RoundClock(100, over_selection=1.3).num_to_sample(50) == 50


@pytest.mark.parametrize("kwargs,field", [
    ({"clients_per_round": 0}, "clients_per_round"),
    ({"deadline_s": 0.0}, "deadline_s"),
    ({"deadline_s": float("nan")}, "deadline_s"),
    ({"over_selection": 0.9}, "over_selection"),
])
def test_bad_clock_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(LinkConfigError, match=field):
        RoundClock(**{"clients_per_round": 5, **kwargs})


def test_bad_jobs_name_the_field() -> None:
    with pytest.raises(LinkConfigError, match="upload_bytes"):
        ClientJob(0, 10, -1, 0.0)
    with pytest.raises(LinkConfigError, match="compute_s"):
        ClientJob(0, 10, 10, math.nan)
    net = _network([1.0])
    with pytest.raises(LinkConfigError, match="same client twice"):
        RoundClock(1).run(0, 0.0, [ClientJob(0, 1, 1, 0.0), ClientJob(0, 1, 1, 0.0)], net)
