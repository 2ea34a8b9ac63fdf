"""One shaped link per SuperNode, in the best mode this machine supports.

Modes, best first:

- ``netem``:  namespace + veth, kernel ``netem`` for rate, latency and jitter; the userspace proxy
  only runs the outage chain.
- ``tbf``:    namespace + veth, kernel ``tbf`` for rate; the userspace proxy adds latency, jitter
  and outages (the mode of machines whose kernel lacks ``netem``).
- ``proxy``:  no namespaces (not root, no iproute2): the userspace proxy does everything, rate
  included, on loopback.
- ``none``:   no shaping at all; SuperNodes dial the SuperLink directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .errors import LinkError
from .netns import Capabilities, VethLink, pick_subnet_octet, probe_capabilities
from .presets import LinkSpec
from .proxy import LinkProxy

MODES = ("auto", "netem", "tbf", "proxy", "none")

_DESCRIPTIONS = {
    "netem": "kernel netem (rate, latency, jitter) on veth pairs in network namespaces, "
             "userspace proxy for outages",
    "tbf": "kernel tbf (rate) on veth pairs in network namespaces, userspace proxy for latency, "
           "jitter and outages",
    "proxy": "userspace proxy on loopback for rate, latency, jitter and outages",
    "none": "no shaping (plain loopback)",
}


def choose_mode(requested: str, caps: Capabilities | None = None) -> tuple[str, str]:
    """Resolve ``requested`` (one of :data:`MODES`) into a mode and a printable explanation.

    Raises
    ------
    LinkError
        When ``requested`` is unknown, or asks for kernel shaping the machine lacks.
    """
    if requested not in MODES:
        raise LinkError(f"shaping mode {requested!r} unknown, expected one of {list(MODES)}")
    if requested in ("proxy", "none"):
        return requested, _DESCRIPTIONS[requested]
    caps = caps if caps is not None else probe_capabilities()
    if requested == "auto":
        if caps.netns and caps.netem:
            mode = "netem"
        elif caps.netns and caps.tbf:
            mode = "tbf"
        else:
            mode = "proxy"
    else:
        mode = requested
        if not (caps.netns and getattr(caps, mode)):
            raise LinkError(f"shaping mode {mode!r} is not available here: {caps.detail}")
    return mode, f"{_DESCRIPTIONS[mode]} [{caps.detail}]"


@dataclass
class NodeLink:
    """The link of one SuperNode: where it dials and which namespace it runs in."""

    index: int
    mode: str
    address: str
    netns: str | None
    proxy: LinkProxy | None
    veth: VethLink | None

    def stop(self) -> None:
        """Stop the proxy and delete the namespace (idempotent)."""
        if self.proxy is not None:
            self.proxy.stop()
        if self.veth is not None:
            self.veth.delete()


class LinkSet:
    """Builds and tears down the links of one run.

    Parameters
    ----------
    spec : LinkSpec or None
        The link of every SuperNode; None means unshaped.
    mode : str
        A mode already resolved by :func:`choose_mode` (``netem``, ``tbf``, ``proxy``, ``none``).
    seed : int
        Seeds each link's jitter and outage chain (node ``i`` uses ``seed + i``).
    """

    def __init__(self, spec: LinkSpec | None, mode: str, seed: int = 0) -> None:
        if mode not in MODES or mode == "auto":
            raise LinkError(f"LinkSet needs a resolved mode, got {mode!r}")
        if spec is None:
            mode = "none"
        self.spec = spec
        self.mode = mode
        self.seed = seed
        self.tag = f"{random.randrange(16**4):04x}"
        self._octet: int | None = None
        self.links: dict[int, NodeLink] = {}

    def netns_name(self, index: int) -> str | None:
        """The namespace node ``index``'s link lives in (made by :meth:`build`), or None when
        this mode makes none."""
        return f"fedgc-{self.tag}-{index}" if self.mode in ("netem", "tbf") else None

    def host_addresses(self, count: int) -> list[str]:
        """Addresses the SuperLink's certificate must name for ``count`` links."""
        if self.mode in ("netem", "tbf"):
            if self._octet is None:
                self._octet = pick_subnet_octet()
            return ["127.0.0.1", *(f"10.{self._octet}.{i}.1" for i in range(count))]
        return ["127.0.0.1"]

    def build(self, index: int, target_host: str, target_port: int) -> NodeLink:
        """Create node ``index``'s link towards ``target_host:target_port``."""
        if index in self.links:
            return self.links[index]
        spec = self.spec
        if self.mode == "none" or spec is None:
            link = NodeLink(index, "none", f"{target_host}:{target_port}", None, None, None)
        elif self.mode == "proxy":
            proxy = LinkProxy(spec, target_host, target_port, seed=self.seed + index).start()
            link = NodeLink(index, "proxy", proxy.address, None, proxy, None)
        else:
            if self._octet is None:
                self._octet = pick_subnet_octet()
            veth = VethLink.create(self.tag, index, self._octet)
            try:
                veth.shape(spec, self.mode)
                proxy = LinkProxy(
                    spec, target_host, target_port, listen_host=veth.host_ip,
                    shape_rate=False, shape_delay=self.mode == "tbf", seed=self.seed + index,
                ).start()
            except LinkError:
                veth.delete()
                raise
            link = NodeLink(index, self.mode, proxy.address, veth.netns, proxy, veth)
        self.links[index] = link
        return link

    def stop(self) -> None:
        """Tear down every link of the run."""
        for link in self.links.values():
            link.stop()
        self.links.clear()
