"""Compression methods as plugins: one :class:`Method` object per method, in one registry.

``fedgc.methods.get("dgc")`` is the method a run's ``method`` key names (a registered name, or
``pkg.module:callable`` returning a Method of the user's own); :mod:`fedgc.methods.base` is the
contract (client compressor, payload codec, server aggregator, round material, downlink, keys),
:mod:`fedgc.methods.payloads` the payload kinds, and one small module per shipped method holds
it whole and registers it: importing this package imports every module in it, so a new method is
one new file. ``docs/methods.md`` says how to write one.
"""

import importlib
import pkgutil

from fedgc.methods.base import Aggregator, Channel, DownlinkPolicy, Method
from fedgc.methods.payloads import Bound, Codec, Payload, PayloadError, SparseCodec, SparsePayload
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

_CONTRACT = {"base", "optimizer", "payloads", "registry"}
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in _CONTRACT:
        importlib.import_module(f"{__name__}.{_module}")

__all__ = ["Aggregator", "Bound", "Channel", "Codec", "DownlinkPolicy", "Method", "Payload",
           "PayloadError", "SparseCodec", "SparsePayload", "baseline", "compared", "get",
           "is_known", "load_method", "loaded", "names", "register", "registered"]
