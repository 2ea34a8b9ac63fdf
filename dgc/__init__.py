"""Deep Gradient Compression: compressor, residual memory, wire format and aggregation.

Pure PyTorch and numpy; imports nothing of Flower.
"""

from dgc.aggregate import aggregate, aggregate_buffers
from dgc.compressor import DGCCompressor
from dgc.config import DGCConfig
from dgc.errors import AggregationError, ConfigError, DecodeError, DGCError, StateError
from dgc.memory import DGCMemory
from dgc.sparse import PackedTensors, SparseTensor, SparseUpdate, TensorLayout
from dgc.wire import EncodeError, decode, decode_many, encode

__all__ = [
    "AggregationError",
    "ConfigError",
    "DGCCompressor",
    "DGCConfig",
    "DGCError",
    "DGCMemory",
    "DecodeError",
    "EncodeError",
    "PackedTensors",
    "SparseTensor",
    "SparseUpdate",
    "StateError",
    "TensorLayout",
    "aggregate",
    "aggregate_buffers",
    "decode",
    "decode_many",
    "encode",
]

