"""Kernel link shaping: network namespaces, veth pairs, and ``tbf`` or ``netem`` qdiscs.

Each SuperNode gets a namespace joined to the root namespace by one veth pair on a private /30.
Egress of the namespace end is the client's uplink, egress of the host end its downlink; a qdisc on
each end shapes that direction. Everything created here carries the run's tag in its name and is
deleted by :meth:`VethLink.delete` (deleting the namespace also deletes the veth pair).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass

from .errors import LinkError
from .presets import LinkSpec

_CMD_TIMEOUT_S = 10.0


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    return _run(argv, check)


def _tc(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["tc", *args] if netns is None else ["ip", "netns", "exec", netns, "tc", *args]
    return _run(argv, check)


def _run(argv: list[str], check: bool) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise LinkError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclass(frozen=True)
class Capabilities:
    """What this machine allows for link shaping."""

    netns: bool
    tbf: bool
    htb: bool
    netem: bool
    detail: str


def probe_capabilities() -> Capabilities:
    """Try a namespace, a veth pair and each qdisc kind on a throwaway link, then delete them."""
    if os.geteuid() != 0:
        return Capabilities(False, False, False, False, "not root: no namespaces or qdiscs")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return Capabilities(False, False, False, False, "`ip` or `tc` (iproute2) not found")
    tag = f"{random.randrange(16**4):04x}"
    link = None
    try:
        link = VethLink.create(tag, 0, subnet_octet=None)
        kinds = {}
        for kind, args in (
            ("tbf", ["tbf", "rate", "1mbit", "burst", "4kb", "latency", "100ms"]),
            ("htb", ["htb", "default", "1"]),
            ("netem", ["netem", "delay", "10ms"]),
        ):
            proc = _tc("qdisc", "replace", "dev", link.host_dev, "root", *args, check=False)
            kinds[kind] = proc.returncode == 0
            note = proc.stderr.strip()
            if not kinds[kind]:
                kinds[f"{kind}-error"] = note  # type: ignore[assignment]
        detail = "netns+veth ok; " + ", ".join(
            f"{k}={'yes' if kinds[k] else 'no (' + str(kinds.get(k + '-error')) + ')'}"
            for k in ("tbf", "htb", "netem")
        )
        return Capabilities(True, bool(kinds["tbf"]), bool(kinds["htb"]), bool(kinds["netem"]),
                            detail)
    except (LinkError, OSError, subprocess.TimeoutExpired) as err:
        return Capabilities(False, False, False, False, f"netns/veth unavailable: {err}")
    finally:
        if link is not None:
            link.delete()


def _used_second_octets() -> set[int]:
    proc = _ip("-4", "-o", "addr", "show", check=False)
    used = set()
    for line in proc.stdout.splitlines():
        for word in line.split():
            if word.startswith("10.") and "/" in word:
                used.add(int(word.split(".")[1]))
    return used


def pick_subnet_octet() -> int:
    """A second octet for ``10.X.i.0/30`` subnets that no interface of this host uses."""
    used = _used_second_octets()
    free = [o for o in range(128, 254) if o not in used]
    if not free:
        raise LinkError("no free 10.128-253.x.x range for the run's veth subnets")
    return random.choice(free)


@dataclass
class VethLink:
    """One namespace and its veth pair: ``host_ip`` in the root namespace, ``node_ip`` inside."""

    netns: str
    host_dev: str
    node_dev: str
    host_ip: str
    node_ip: str

    @classmethod
    def create(cls, tag: str, index: int, subnet_octet: int | None) -> VethLink:
        """Create namespace ``fedgc-<tag>-<index>`` with a veth pair on ``10.<octet>.<index>.0/30``.

        Raises
        ------
        LinkError
            When an ``ip`` command fails; whatever was created is deleted first.
        """
        if not 0 <= index < 250:
            raise LinkError(f"link index {index} out of range, expected 0..249")
        octet = pick_subnet_octet() if subnet_octet is None else subnet_octet
        link = cls(
            netns=f"fedgc-{tag}-{index}",
            host_dev=f"fg{tag}h{index}",
            node_dev=f"fg{tag}n{index}",
            host_ip=f"10.{octet}.{index}.1",
            node_ip=f"10.{octet}.{index}.2",
        )
        try:
            _ip("netns", "add", link.netns)
            _ip("link", "add", link.host_dev, "type", "veth", "peer", "name", link.node_dev)
            _ip("link", "set", link.node_dev, "netns", link.netns)
            _ip("addr", "add", f"{link.host_ip}/30", "dev", link.host_dev)
            _ip("link", "set", link.host_dev, "up")
            _ip("addr", "add", f"{link.node_ip}/30", "dev", link.node_dev, netns=link.netns)
            _ip("link", "set", link.node_dev, "up", netns=link.netns)
            _ip("link", "set", "lo", "up", netns=link.netns)
        except (LinkError, subprocess.TimeoutExpired):
            link.delete()
            raise
        return link

    def shape(self, spec: LinkSpec, kernel: str) -> None:
        """Shape both directions: ``kernel`` is ``"tbf"`` (rate) or ``"netem"`` (rate + delay)."""
        for dev, netns, mbps in (
            (self.node_dev, self.netns, spec.up_mbps),
            (self.host_dev, None, spec.down_mbps),
        ):
            rate_kbit = max(8, round(mbps * 1000))
            if kernel == "tbf":
                _tc("qdisc", "replace", "dev", dev, "root", *tbf_args(mbps), netns=netns)
            elif kernel == "netem":
                one_way_ms = spec.rtt_ms / 2.0
                _tc("qdisc", "replace", "dev", dev, "root", "netem",
                    "delay", f"{one_way_ms:.3f}ms", f"{spec.jitter_ms:.3f}ms",
                    "rate", f"{rate_kbit}kbit", "limit", "100000", netns=netns)
            else:
                raise LinkError(f"kernel shaping {kernel!r} unknown, expected 'tbf' or 'netem'")

    def delete(self) -> None:
        """Delete the namespace and the veth pair (idempotent, never raises)."""
        _ip("link", "del", self.host_dev, check=False)
        _ip("netns", "del", self.netns, check=False)


def tbf_args(mbps: float) -> list[str]:
    """``tbf`` arguments for a rate of ``mbps``.

    The bucket holds 10 ms of traffic (at least two full frames) so that short transfers are not
    let through at line rate, and the queue holds one second so that TCP sees few drops.
    """
    bytes_per_s = mbps * 1e6 / 8.0
    burst_bytes = max(3028, int(bytes_per_s * 0.010))
    return ["tbf", "rate", f"{max(8, round(mbps * 1000))}kbit", "burst", str(burst_bytes),
            "latency", "1000ms"]


def cleanup_tag(tag: str) -> None:
    """Delete every namespace named ``fedgc-<tag>-*`` (a crash safety net)."""
    proc = _ip("netns", "list", check=False)
    for line in proc.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"fedgc-{tag}-"):
            _ip("netns", "del", name, check=False)
