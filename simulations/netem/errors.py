"""Exception types raised by the network emulator."""


class NetemError(ValueError):
    """Base class of every error the network emulator raises on purpose."""


class LinkConfigError(NetemError):
    """A link, loss, outage, device or scenario parameter is outside its accepted range."""


class TraceError(NetemError):
    """A throughput or Mahimahi trace file cannot be parsed or describes an unusable link."""
