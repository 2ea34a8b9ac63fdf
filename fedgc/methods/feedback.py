"""Aggregate feedback for ``dgc`` (``dgc.feedback``): the reference both ends derive, its framing
and the server's history of sent models.

CAFe (Ortega et al., arXiv 2412.04538, 2024) has each client compress the difference between
its update and the last global aggregate, which every client holds, and the server add that
aggregate back. In a federation where a client is sampled once every ~10 rounds, the aggregate
it can hold for free is how the model it was sent moved since it last trained: a client that
trained on sent version ``u`` and is now sent version ``v`` holds both, bit for bit (the client
state keeps the model it was sent, ``client/state.py``), and so does the server (its history
of sent models, :class:`FeedbackChannel`). The reference is that movement per version, in the
units of a pseudo-gradient (``global - local``)::

    r = (sent_u - sent_v) * (scale / (v - u))      float32, the same operations on both ends

``scale`` is ``dgc.feedback_scale``, by default ``(1 - server_momentum) / server_lr``: in
steady state the server moves the model by ``server_lr / (1 - server_momentum)`` times the
mean pseudo-gradient each version, so ``r`` is the mean pseudo-gradient of the versions the
client missed. The client compresses ``pseudo_gradient - r``; the server adds ``r`` back to
that client's update before the round's combine (weights, defences and robust statistics see
each client's whole update). No reference bytes travel: the round material says which versions
the server keeps (:func:`encode_material`) and each reply which one its client used
(:func:`encode_side`). A client that holds no model of the run (first contact), or one older
than the server keeps, compresses its pseudo-gradient as before (base -1).

Wire (framed as every fedgc payload, :mod:`dgc.wire.framing`; ``docs/wire.md``)::

    material = "FGCF" | version u8 = 1 | sequence u32 | model version u32 | oldest kept u32
               | scale f32 | the sets' material (dgc.signs.codec) or nothing | crc32 u32
    side     = "FGCA" | version u8 = 1 | sequence u32 | base version i32 (-1: none)
               | the sets' side part (signs or grid values) or nothing | crc32 u32
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dgc import SparseTensor, SparseUpdate
from dgc.errors import DecodeError
from dgc.wire.framing import Preamble, as_view, check_crc, crc_offset, seal
from fedgc.methods.material import Channel

__all__ = ["FeedbackChannel", "FeedbackMaterial", "decode_material", "decode_side",
           "encode_material", "encode_side", "reference", "with_reference"]

MATERIAL_PREAMBLE = Preamble(b"FGCF", 1, "IIIf")
MATERIAL_MAGIC = MATERIAL_PREAMBLE.magic
SIDE_PREAMBLE = Preamble(b"FGCA", 1, "Ii")
SIDE_MAGIC = SIDE_PREAMBLE.magic
MAX_U32 = (1 << 32) - 1


def reference(then: Mapping[str, torch.Tensor], now: Mapping[str, torch.Tensor], span: int,
              scale: float) -> dict[str, torch.Tensor]:
    """``(then - now) * (scale / span)`` per tensor of ``now``, in float32 on the CPU: the
    reference of a client that held ``then`` ``span`` versions before ``now``.

    Both ends call this with the same bits (the sent models and the material's float32 scale),
    so both get the same bits: the factor is rounded to float32 once, here.
    """
    if span <= 0:
        raise ValueError(f"a reference spans at least one version, got {span}")
    factor = float(np.float32(np.float32(scale) / np.float32(span)))
    out = {}
    for name, t in now.items():
        if name not in then or then[name].shape != t.shape:
            raise ValueError(f"the held model has no tensor {name!r} of shape {tuple(t.shape)}")
        out[name] = (then[name].detach().to("cpu", torch.float32)
                     - t.detach().to("cpu", torch.float32)) * factor
    return out


def encode_material(sequence: int, version: int, oldest: int, scale: float,
                    inner: bytes = b"") -> bytes:
    """The round material of aggregate feedback, wrapping the sets' material ``inner``."""
    return seal([MATERIAL_PREAMBLE.pack(sequence, version, oldest, scale), bytes(inner)])


def decode_material(data: bytes | bytearray | memoryview) -> tuple[int, int, int, float, bytes]:
    """``(sequence, version, oldest, scale, inner)`` of :func:`encode_material` bytes; a
    DecodeError for a defect (an oldest kept version after the model's, a scale not finite
    and positive)."""
    view = as_view(data)
    sequence, version, oldest, scale = MATERIAL_PREAMBLE.open(view)
    end = crc_offset(view)
    check_crc(view, end)
    if oldest > version:
        raise DecodeError(f"feedback material keeps versions from {oldest}, after the model's "
                          f"{version}")
    if not (math.isfinite(scale) and scale > 0):
        raise DecodeError(f"feedback material scale {scale} is not finite and positive")
    return sequence, version, oldest, float(scale), bytes(view[MATERIAL_PREAMBLE.size:end])


def encode_side(sequence: int, base: int, inner: bytes = b"") -> bytes:
    """A reply's side part under aggregate feedback: the version its reference started from
    (-1: none) and the sets' side part ``inner``."""
    return seal([SIDE_PREAMBLE.pack(sequence, base), bytes(inner)])


def decode_side(data: bytes | bytearray | memoryview) -> tuple[int, int, bytes]:
    """``(sequence, base, inner)`` of :func:`encode_side` bytes (DecodeError if bad)."""
    view = as_view(data)
    sequence, base = SIDE_PREAMBLE.open(view)
    end = crc_offset(view)
    check_crc(view, end)
    if base < -1:
        raise DecodeError(f"feedback base version {base}: -1 (none) or a version")
    return sequence, base, bytes(view[SIDE_PREAMBLE.size:end])


@dataclass
class FeedbackMaterial:
    """Aggregate feedback's round material, decoded.

    ``inner``: the sets' material (DGC's shared index sets; None: none this round). On the
    client, after :meth:`fedgc.methods.dgc.DGC.hold_material`, ``base`` and ``reference`` are
    its own (base -1, reference None: it compresses its pseudo-gradient as is). On the server,
    ``channel`` gives the reference of any base a reply names.
    """

    sequence: int
    version: int
    oldest: int
    scale: float
    inner: Any = None
    base: int = -1
    reference: dict[str, torch.Tensor] | None = None
    channel: FeedbackChannel | None = field(default=None, repr=False)
    inner_bytes: bytes = field(default=b"", repr=False)  # the sets' material as read


def with_reference(side: SparseUpdate | None, ref: Mapping[str, torch.Tensor],
                   shapes: Mapping[str, tuple[int, ...]], sequence: int) -> SparseUpdate:
    """``ref`` (every entry of every tensor) plus the sets' ``side`` part, as one sparse
    update: what the server adds to a client's payload."""
    out = {}
    for name, r in ref.items():
        values = r.reshape(-1).to(torch.float32).clone()
        if side is not None and name in side.tensors:
            t = side.tensors[name]
            values.index_add_(0, t.indices, t.values.to(torch.float32))
        out[name] = SparseTensor(torch.arange(values.numel(), dtype=torch.int64), values,
                                 tuple(shapes[name]))
    return SparseUpdate(out, sequence)


class FeedbackChannel(Channel):
    """The server half of aggregate feedback: the sent models of the last ``history`` versions
    (contiguous, newest last), and the round material that names them, around the sets'
    channel ``inner`` (or none)."""

    def __init__(self, inner: Channel | None, scale: float, history: int) -> None:
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"dgc.feedback_scale {scale} must be finite and > 0")
        self.inner = inner
        self.scale = float(np.float32(scale))  # what the material carries
        self.history = int(history)
        self.models: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.version = 0
        self._refs: dict[int, dict[str, torch.Tensor]] = {}

    def hold(self, sent_model: Mapping[str, torch.Tensor], version: int,
             initial_on_grid: bool) -> None:
        if self.inner is not None:
            self.inner.hold(sent_model, version, initial_on_grid)
        if version not in self.models:
            if self.models and version != next(reversed(self.models)) + 1:
                self.models.clear()  # a resume: what clients hold in between is not known here
            self.models[version] = {n: t.detach().to("cpu", torch.float32).clone()
                                    for n, t in sent_model.items()}
            while len(self.models) > self.history:
                self.models.popitem(last=False)
        self.version = version
        self._refs = {}

    @property
    def oldest(self) -> int:
        """The oldest version whose sent model the server keeps."""
        return next(iter(self.models)) if self.models else self.version

    def plan(self, server_round: int) -> tuple[bytes, Any] | None:
        planned = self.inner.plan(server_round) if self.inner is not None else None
        if self.version == 0 and planned is None:
            return None  # nobody holds a version before 0: no reference, no sets
        inner_bytes, inner = (b"", None) if planned is None else planned
        data = encode_material(server_round, self.version, self.oldest, self.scale, inner_bytes)
        return data, FeedbackMaterial(server_round, self.version, self.oldest, self.scale,
                                      inner, channel=self, inner_bytes=inner_bytes)

    def reference_of(self, base: int) -> dict[str, torch.Tensor]:
        """The reference of a client that held version ``base`` (ValueError for a version the
        server does not keep, or not before the model's)."""
        if not (base in self.models and base < self.version and self.version in self.models):
            raise ValueError(f"feedback base version {base} is not one the server keeps "
                             f"before {self.version} (kept: {self.oldest}..{self.version})")
        if base not in self._refs:
            self._refs[base] = reference(self.models[base], self.models[self.version],
                                         self.version - base, self.scale)
        return self._refs[base]

    def observe(self, aggregate: Mapping[str, torch.Tensor]) -> None:
        if self.inner is not None:
            self.inner.observe(aggregate)

    def state_dict(self) -> dict[str, Any] | None:
        # The history is not checkpointed: after a resume the material keeps only the versions
        # held since, and clients on older ones compress without a reference for a round.
        return None if self.inner is None else self.inner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state)
