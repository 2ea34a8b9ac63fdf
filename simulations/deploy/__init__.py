"""Real deployment of fedgc: SuperLink and SuperNodes on real sockets behind shaped links.

The pieces, each in its own module:

- :mod:`.presets`   link presets (latency, bandwidth, outages) shared with the emulator.
- :mod:`.proxy`     a userspace TCP proxy that adds latency, jitter, outages and (optionally) rate.
- :mod:`.netns`     kernel shaping: network namespaces, veth pairs and ``tbf`` / ``netem`` qdiscs.
- :mod:`.links`     picks the shaping mode the machine supports and builds one link per SuperNode.
- :mod:`.certs`     TLS certificates and SuperNode keys generated for one run.
- :mod:`.files`     the run's folders (0700) and key files (created 0600).
- :mod:`.toml_values` run and node config values in TOML syntax.
- :mod:`.processes` process groups with log-based readiness and bounded shutdown.
- :mod:`.cluster`   one ``flower-superlink``, N ``flower-supernode`` and ``flwr run`` against them.
- :mod:`.calibrate` the same transfer timed on the shaped link and predicted analytically.
- :mod:`.cli`       ``python -m simulations deploy ...``.
"""

from .errors import DeployError, LinkError, ProcessStartError

__all__ = ["DeployError", "LinkError", "ProcessStartError"]
