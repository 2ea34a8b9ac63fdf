"""Deep Gradient Compression: compressor, residual memory, wire format and aggregation.

Pure PyTorch and numpy; imports nothing of Flower.
"""

from dgc.aggregate import aggregate
from dgc.compressor import DGCCompressor
from dgc.config import DGCConfig
from dgc.errors import AggregationError, ConfigError, DecodeError, DGCError, StateError
from dgc.memory import DGCMemory
from dgc.sparse import SparseTensor, SparseUpdate

__all__ = [
    "AggregationError",
    "ConfigError",
    "DGCCompressor",
    "DGCConfig",
    "DGCError",
    "DGCMemory",
    "DecodeError",
    "SparseTensor",
    "SparseUpdate",
    "StateError",
    "aggregate",
    "decode",
    "encode",
]


def __getattr__(name: str):  # the wire format lands in dgc.wire
    if name in ("encode", "decode"):
        from dgc import wire

        return getattr(wire, name)
    raise AttributeError(name)
