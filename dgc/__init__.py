"""Deep Gradient Compression: compressors, residual memory, wire format and aggregation.

Pure PyTorch and numpy; imports nothing of Flower.
"""

from dgc.aggregate import aggregate, aggregate_buffers
from dgc.base import Compressor
from dgc.compressor import DGCCompressor
from dgc.config import DGCConfig
from dgc.errors import (
    AggregationError,
    ConfigError,
    DecodeError,
    DGCError,
    EncodeError,
    StateError,
)
from dgc.memory import DGCMemory
from dgc.rowwise import RowwiseCompressor
from dgc.sparse import PackedTensors, SparseTensor, SparseUpdate, TensorLayout
from dgc.two_density import TwoDensityCompressor
from dgc.wire import decode, decode_many, encode

__all__ = [
    "AggregationError",
    "Compressor",
    "ConfigError",
    "DGCCompressor",
    "DGCConfig",
    "DGCError",
    "DGCMemory",
    "DecodeError",
    "EncodeError",
    "PackedTensors",
    "RowwiseCompressor",
    "SparseTensor",
    "SparseUpdate",
    "StateError",
    "TensorLayout",
    "TwoDensityCompressor",
    "aggregate",
    "aggregate_buffers",
    "decode",
    "decode_many",
    "encode",
]

