"""Compression methods as plugins: one :class:`Method` object per method, in one registry.

``fedgc.methods.get("dgc")`` is the method a run's ``method`` key names (a registered name, or
``pkg.module:callable`` returning a Method of the user's own). The contract: :mod:`.base` (the
core: compressor, codec, aggregator, optimizer, downlink, the method's keys and defaults),
:mod:`.material` and :mod:`.phone` (the opt-in parts: round material, phone export),
:mod:`.compressors` (residual and stateless compressor bases), :mod:`.unaggregated` (what a
client folds back of an update the server never aggregated), :mod:`.payloads` (the payload
kinds and their codecs), :mod:`.optimizer` (the server optimizer) and :mod:`.sparsifier` (the
keys and layer policy the top-k methods share). One small module per shipped method holds it
whole and registers it: importing this package imports every module in it, so a new method is
one new file. ``docs/methods.md`` says how to write one.
"""

import importlib
import pkgutil

from fedgc.methods.base import Aggregator, DownlinkPolicy, Method
from fedgc.methods.compressors import ResidualCompressor, StatelessCompressor
from fedgc.methods.material import Channel, RoundMaterial, material_of, pending_parts
from fedgc.methods.optimizer import ServerOptimizer
from fedgc.methods.payloads import Bound, Codec, Payload, PayloadError, SparseCodec, SparsePayload
from fedgc.methods.phone import (
    PhoneExport,
    phone_codec_of,
    phone_export_of,
    phone_methods,
    phone_refusal,
)
from fedgc.methods.registry import (
    baseline,
    compared,
    get,
    is_known,
    load_method,
    loaded,
    names,
    register,
    registered,
)

_CONTRACT = {"base", "compressors", "material", "optimizer", "payloads", "phone", "registry",
             "sparsifier", "unaggregated"}
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in _CONTRACT:
        importlib.import_module(f"{__name__}.{_module}")

__all__ = ["Aggregator", "Bound", "Channel", "Codec", "DownlinkPolicy", "Method", "Payload",
           "PayloadError", "PhoneExport", "ResidualCompressor", "RoundMaterial",
           "ServerOptimizer", "SparseCodec", "SparsePayload", "StatelessCompressor", "baseline",
           "compared", "get", "is_known", "load_method", "loaded", "material_of", "names",
           "pending_parts", "phone_codec_of", "phone_export_of", "phone_methods", "phone_refusal",
           "register", "registered"]
