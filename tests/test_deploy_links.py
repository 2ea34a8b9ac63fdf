"""Link shaping for deployments: presets, the userspace proxy, kernel tbf in namespaces."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest

from simulations.deploy.calibrate import TransferSink, measure, time_transfer
from simulations.deploy.errors import LinkError
from simulations.deploy.links import LinkSet, choose_mode
from simulations.deploy.netns import probe_capabilities
from simulations.deploy.presets import LinkSpec, preset
from simulations.deploy.proxy import LinkProxy

CAPS = probe_capabilities()
needs_tbf = pytest.mark.skipif(not (CAPS.netns and CAPS.tbf), reason=CAPS.detail)


def _netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(LinkError, match=r"'gprs'.*'3g'.*'lte'"):
        preset("gprs")


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [("up_mbps", 0.0, "> 0"), ("rtt_ms", -1.0, ">= 0"), ("down_mbps", float("nan"), "> 0")],
)
def test_link_spec_rejects_bad_values(field: str, value: float, expected: str) -> None:
    with pytest.raises(LinkError, match=rf"{field}=.*{expected}"):
        preset("lte").with_overrides(**{field: value})


def test_override_of_unknown_field_is_refused() -> None:
    with pytest.raises(LinkError, match="bandwidth"):
        preset("lte").with_overrides(bandwidth=3.0)


def test_choose_mode_rejects_unknown_and_unavailable_modes() -> None:
    with pytest.raises(LinkError, match="'warp'"):
        choose_mode("warp", CAPS)
    no_kernel = type(CAPS)(netns=False, tbf=False, htb=False, netem=False, detail="not root")
    with pytest.raises(LinkError, match="'tbf' is not available here: not root"):
        choose_mode("tbf", no_kernel)
    assert choose_mode("auto", no_kernel)[0] == "proxy"


def test_outage_preset_chain_matches_the_trace_fraction() -> None:
    spec = preset("lte-driving")
    offline = spec.mean_offline_s / (spec.mean_online_s + spec.mean_offline_s)
    assert spec.intermittent
    assert offline == pytest.approx(94 / 1012)


def test_proxy_adds_round_trip_and_serialisation_time() -> None:
    # 200 ms RTT and 4 Mbit/s: 100 kB take 0.2 + 0.2 s; without the link they take ~1 ms.
    spec = LinkSpec("t", rtt_ms=200.0, jitter_ms=0.0, down_mbps=8.0, up_mbps=4.0)
    with TransferSink() as sink, LinkProxy(spec, "127.0.0.1", sink.port) as proxy:
        # The fastest of three: load on a shared machine only ever adds time.
        up_s = min(time_transfer("127.0.0.1", proxy.port, 100_000, "up") for _ in range(3))
        down_s = min(time_transfer("127.0.0.1", proxy.port, 100_000, "down") for _ in range(3))
        assert proxy.stats.uplink_bytes >= 100_000
        assert proxy.stats.downlink_bytes >= 100_000
    assert up_s == pytest.approx(0.4, rel=0.15)
    assert down_s == pytest.approx(0.3, rel=0.15)


def test_outage_drops_open_connections_and_refuses_new_ones() -> None:
    spec = LinkSpec("t", rtt_ms=0.0, jitter_ms=0.0, down_mbps=100.0, up_mbps=100.0)
    with TransferSink() as sink, LinkProxy(spec, "127.0.0.1", sink.port) as proxy:
        held = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        held.sendall(b"U" + (10**9).to_bytes(8, "big"))
        assert held.recv(1) == b"R"
        proxy.set_online(False)
        held.settimeout(5)
        with pytest.raises((ConnectionResetError, BrokenPipeError)):
            for _ in range(1000):  # bounded: the reset arrives within a few sends
                held.sendall(b"\0" * 65536)
                time.sleep(0.001)
        held.close()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as refused:
            refused.settimeout(5)
            try:
                assert refused.recv(1) == b""
            except ConnectionResetError:
                pass
        proxy.set_online(True)
        assert time_transfer("127.0.0.1", proxy.port, 1000, "up") < 1.0
        assert proxy.stats.outages == 1
        assert proxy.stats.aborted_by_outage >= 1
        assert proxy.stats.refused_offline == 1


def test_resume_policy_stalls_bytes_and_keeps_the_connection() -> None:
    spec = LinkSpec("t", rtt_ms=0.0, jitter_ms=0.0, down_mbps=100.0, up_mbps=100.0,
                    outage_policy="resume")
    with TransferSink() as sink, LinkProxy(spec, "127.0.0.1", sink.port) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(b"U" + (1000).to_bytes(8, "big"))
            assert sock.recv(1) == b"R"
            proxy.set_online(False)
            sock.sendall(b"\0" * 1000)
            sock.settimeout(0.5)
            with pytest.raises(TimeoutError):
                sock.recv(1)  # no ack while the link stalls
            proxy.set_online(True)
            sock.settimeout(10)
            assert sock.recv(1) == b"A"
        assert proxy.stats.aborted_by_outage == 0
        assert proxy.stats.outages == 1


def test_markov_outages_follow_the_seed() -> None:
    spec = LinkSpec("t", rtt_ms=0.0, jitter_ms=0.0, down_mbps=100.0, up_mbps=100.0,
                    mean_online_s=0.05, mean_offline_s=0.05)
    counts = []
    for _ in range(2):
        with TransferSink() as sink, LinkProxy(spec, "127.0.0.1", sink.port, seed=7) as proxy:
            time.sleep(0.6)
        counts.append(proxy.stats.outages)
    assert counts[0] >= 2
    assert abs(counts[0] - counts[1]) <= 1  # same draws; only timer granularity differs


@needs_tbf
def test_tbf_link_shapes_rate_in_a_namespace_and_cleans_up() -> None:
    before = _netns_names()
    point = measure(preset("lte"), "tbf", 400_000, "down", repeats=3)
    assert point.mode == "tbf"
    # 8 Mbit/s: 0.4 s of payload + 0.05 s RTT; unshaped loopback would take milliseconds.
    assert point.measured_s == pytest.approx(point.predicted_s, rel=0.15)
    assert _netns_names() == before


@needs_tbf
def test_link_set_deletes_namespaces_even_after_a_failed_shape() -> None:
    before = _netns_names()
    links = LinkSet(preset("3g"), "tbf", seed=1)
    link = links.build(0, "127.0.0.1", 1)
    assert link.netns in _netns_names()
    with pytest.raises(LinkError, match="kernel shaping 'cbq' unknown"):
        link.veth.shape(preset("3g"), "cbq")  # type: ignore[union-attr]
    links.stop()
    assert _netns_names() == before
