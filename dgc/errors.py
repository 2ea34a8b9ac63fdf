"""Exception types raised by the dgc library."""


class DGCError(Exception):
    """Base class of every error the dgc library raises on purpose."""


class ConfigError(DGCError, ValueError):
    """A DGCConfig field has a value outside its accepted range."""


class DecodeError(DGCError, ValueError):
    """Bytes handed to :func:`dgc.decode` are not a valid fedgc sparse update."""


class EncodeError(DGCError, ValueError):
    """An update handed to :func:`dgc.encode` cannot be put on the wire (the message names why)."""


class StateError(DGCError, ValueError):
    """A compressor state (or a gradient fed to it) does not match what the compressor holds."""


class AggregationError(DGCError, ValueError):
    """Updates handed to :func:`dgc.aggregate` disagree with the model's shapes or each other."""
