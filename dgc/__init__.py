"""Deep Gradient Compression: compressor, residual memory, wire format and aggregation.

Pure PyTorch and numpy; imports nothing of Flower.
"""

from dgc.aggregate import aggregate
from dgc.compressor import DGCCompressor
from dgc.config import DGCConfig
from dgc.errors import AggregationError, ConfigError, DecodeError, DGCError, StateError
from dgc.memory import DGCMemory
from dgc.sparse import SparseTensor, SparseUpdate
from dgc.wire import EncodeError, decode, encode

__all__ = [
    "AggregationError",
    "ConfigError",
    "DGCCompressor",
    "DGCConfig",
    "DGCError",
    "DGCMemory",
    "DecodeError",
    "EncodeError",
    "SparseTensor",
    "SparseUpdate",
    "StateError",
    "aggregate",
    "decode",
    "encode",
]

