"""Payloads: what a client's reply carries, decoded, and the codec that writes and reads it.

A method declares its payload kind by its codec (:class:`Codec`): how a client's compressed
update becomes bytes and how the server reads them back, against a :class:`Bound`. Every codec
keeps the wire's framing (``dgc/wire/framing.py``: magic, version, the payload's fields, a
CRC-32 trailer, reads that never pass the CRC) and decodes raising only
:class:`dgc.DecodeError`; ``docs/wire.md`` specifies each kind, and ``golden_cases`` gives the
byte vectors that pin it (``tests/golden/payloads/``).

The server sees every decoded payload through :class:`Payload`: its entries in the aggregation
space as sparse updates (``parts``), its norm (the defences), its size. A sparse update of the
model's tensors is the kind the five shipped methods send (:class:`SparsePayload`,
:class:`SparseCodec`: ``dgc.encode``'s format); a kind of another shape (levels, a sketch, low
rank factors) maps its entries to ``parts`` in its aggregator's space
(:meth:`fedgc.methods.Aggregator.space`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import dgc
from dgc import DecodeError, SparseUpdate, TensorLayout
from dgc.wire.compact import decode_compact, encode_compact, layout_of

__all__ = ["Bound", "Codec", "Payload", "PayloadError", "SparseCodec", "SparsePayload",
           "check_tensors", "largest"]


class PayloadError(ValueError):
    """A payload decoded but does not fit the round (another model's tensors, a count the
    method does not send); the message names the reason."""


@dataclass(frozen=True)
class Bound:
    """What one round's payloads are decoded and checked against.

    Attributes
    ----------
    shapes : mapping of str to tuple of int
        The model's tensors (or, for a kind with an aggregation space of its own, that space's,
        :meth:`fedgc.methods.Aggregator.space`).
    server_round : int
        The round the payload answers (-1: any, for a client reading its own pending update).
    material : object
        What the server sent every client of the round beside the model (the method's round
        material, :class:`fedgc.methods.Channel`), decoded; None without.
    limit : int or None
        The most entries one tensor may claim, when not the largest of ``shapes`` (bytes the
        process wrote itself: ``dgc.wire.MAX_NUMEL``).
    """

    shapes: Mapping[str, tuple[int, ...]]
    server_round: int = -1
    material: object = None
    limit: int | None = None

    @property
    def max_numel(self) -> int:
        """The most entries one tensor may claim: the largest tensor's (a forged header cannot
        make the receiver allocate more), or ``limit``."""
        if self.limit is not None:
            return self.limit
        return max((math.prod(s) for s in self.shapes.values()), default=0)


def largest(values: torch.Tensor) -> float:
    """``max |values|`` as a float (0 for none; Inf when a value is NaN or Inf)."""
    if values.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(values).all()):
        return math.inf
    return float(values.detach().abs().max())


class Payload:
    """A decoded client payload as the server's aggregation sees it.

    Subclasses set ``sequence`` (the round the client answered) and implement :meth:`parts`;
    the rest follows from them. A kind whose :meth:`parts` expand what it carries (low-rank
    factors into their product) overrides :meth:`max_abs` to bound them without expanding.
    """

    sequence: int = 0

    def parts(self) -> list[SparseUpdate]:
        """Its entries in the aggregation space, as sparse updates that sum to it (the
        aggregator's combine takes them in this order)."""
        raise NotImplementedError

    @property
    def nnz(self) -> int:
        """Entries carried (``clients.csv``'s ``nnz``)."""
        return sum(p.nnz for p in self.parts())

    @property
    def density(self) -> float:
        """Entries carried, as a fraction of the space's entries."""
        first = self.parts()[0]
        return self.nnz / first.numel if first.numel else 0.0

    def attach(self, side: SparseUpdate) -> Payload:
        """This payload with a reply's side part (what answers the round material) added as
        one more part; a kind that takes none raises PayloadError."""
        raise PayloadError(f"a {type(self).__name__} takes no side part")

    def norm(self) -> float:
        """Its L2 norm, in float64 (the defences bound it)."""
        return math.sqrt(sum(float(t.values.to(torch.float64).square().sum())
                             for p in self.parts() for t in p.tensors.values()))

    def max_abs(self) -> float:
        """A bound on the absolute value of every entry its parts add up to at one coordinate
        (each part's largest value, summed over the parts, which may overlap); Inf when a value
        is NaN or Inf. The server's reply check (``server/replies.py``) refuses a payload above
        its bound before anything sums it: read from what the payload carries, so a kind that
        expands its values overrides this to bound them before the expansion."""
        return sum(max((largest(t.values) for t in p.tensors.values()), default=0.0)
                   for p in self.parts())


@dataclass
class SparsePayload(Payload):
    """A sparse update of the model's tensors, and the sparse parts that answer the round's
    material (DGC's shared signs), each at its own indices."""

    update: SparseUpdate
    extra: list[SparseUpdate] = field(default_factory=list)

    @property
    def sequence(self) -> int:  # type: ignore[override]
        return self.update.sequence

    def parts(self) -> list[SparseUpdate]:
        return [self.update, *self.extra]

    def attach(self, side: SparseUpdate) -> SparsePayload:
        return SparsePayload(self.update, [*self.extra, side])

    @property
    def nnz(self) -> int:
        """Entries of the update itself (the extra parts are counted apart, as
        ``shared_entries``)."""
        return self.update.nnz

    @property
    def density(self) -> float:
        return self.update.density

    def norm(self) -> float:
        """The extra parts' values, then the update's (read packed, without unpacking), summed
        in float64: values near the float32 limit would overflow squared in float32."""
        parts = [t.values for p in self.extra for t in p.tensors.values()]
        u = self.update
        if u.packed is not None:
            parts += [u.packed.sparse_values, u.packed.dense_values]
        else:
            parts += [t.values for t in u.tensors.values()]
        return math.sqrt(sum(float(p.to(torch.float64).square().sum()) for p in parts))

    def max_abs(self) -> float:
        """:meth:`Payload.max_abs`, reading the update's values packed."""
        u = self.update
        own = (max(largest(u.packed.sparse_values), largest(u.packed.dense_values))
               if u.packed is not None
               else max((largest(t.values) for t in u.tensors.values()), default=0.0))
        return own + sum(max((largest(t.values) for t in p.tensors.values()), default=0.0)
                         for p in self.extra)


class Codec:
    """A payload kind's encoder and decoder.

    ``kind`` names it (``docs/wire.md`` has a section per kind); ``encode`` writes what the
    client's compressor returned; ``decode_many`` reads a round's payloads, each bounded by the
    ``Bound`` (a forged header allocates nothing beyond what the bytes carry and the bound
    allows) and raising nothing but returning a :class:`dgc.DecodeError` in place of a payload;
    ``check`` refuses, with :class:`PayloadError`, a payload that decoded but does not fit.
    """

    kind = ""

    def encode(self, payload: object) -> bytes:
        """The bytes of ``payload`` (what the client's compressor returned)."""
        raise NotImplementedError

    def decode(self, data: bytes, bound: Bound) -> Payload:
        """One payload; :class:`dgc.DecodeError` naming what is wrong with the bytes."""
        raise NotImplementedError

    def decode_many(self, blobs: Sequence[bytes], bound: Bound) -> list[Payload | DecodeError]:
        """Each of ``blobs`` decoded, or the DecodeError :meth:`decode` raised for it."""
        out: list[Payload | DecodeError] = []
        for data in blobs:
            try:
                out.append(self.decode(data, bound))
            except DecodeError as ex:
                out.append(ex)
        return out

    def check(self, payload: Payload, bound: Bound) -> None:
        """Refuse (PayloadError) a decoded payload that does not fit the round's model."""

    def golden_cases(self) -> list[tuple[str, Any]]:
        """``(case name, payload)`` pairs whose bytes ``tests/golden/payloads/<kind>.json``
        pins (built from explicit lists: no random stream that could change)."""
        return []

    def golden_bound(self, case: str) -> Bound:
        """What golden case ``case`` is decoded against: by default no model and no round
        material, any size; a kind whose payload answers the round's material (values at a
        server's mask) gives the model and the material of its case."""
        return Bound({}, limit=2**62)


def check_tensors(sent: Mapping[str, tuple[int, ...]],
                  shapes: Mapping[str, tuple[int, ...]]) -> None:
    """PayloadError unless the tensors sent are the model's, by name and shape."""
    missing = sorted(set(shapes) - set(sent))
    extra = sorted(set(sent) - set(shapes))
    if missing or extra:
        raise PayloadError(f"tensor names differ from the model: missing {missing}, "
                           f"unknown {extra}")
    for name, shape in sent.items():
        if shape != shapes[name]:
            raise PayloadError(f"tensor {name!r} has shape {shape}, the model has "
                               f"{shapes[name]}")


class SparseCodec(Codec):
    """``dgc.encode``'s format (``docs/wire.md``, magic ``FGCU``): sparse tensors of the model,
    indices Golomb-Rice, bitmap, raw or all, values float32/16, bfloat16, sign- or grid-coded.

    Parameters
    ----------
    sign_coding : bool (default: False)
        Send a tensor whose values share one magnitude as one sign bit each plus the magnitude
        (ternary updates).
    grid_coding : bool (default: False)
        Send a float32 tensor whose values sit on a power-of-two int8 grid as the grid's step
        and its integers, Rice-coded where smaller (``dgc.value_levels``).
    compact : bool (default: False)
        Send the compact message (:mod:`dgc.wire.compact`, magic ``FGCK``: tensors by their
        place in the model, sizes as varints; ``dgc.compact_wire``), whose sections are the
        same; not for phones.
    """

    kind = "sparse"

    def __init__(self, sign_coding: bool = False, grid_coding: bool = False,
                 compact: bool = False) -> None:
        self.sign_coding = sign_coding
        self.grid_coding = grid_coding
        self.compact = compact
        self._checked: set[TensorLayout] = set()  # layouts that matched the model

    def encode(self, payload: object) -> bytes:
        update = payload.update if isinstance(payload, SparsePayload) else payload
        if self.compact:
            return encode_compact(update, sign_coding=self.sign_coding,
                                  grid_coding=self.grid_coding)
        return dgc.encode(update, sign_coding=self.sign_coding, grid_coding=self.grid_coding)

    def decode(self, data: bytes, bound: Bound) -> SparsePayload:
        if self.compact:
            return SparsePayload(decode_compact(data, layout_of(bound.shapes),
                                                max_numel=bound.max_numel))
        return SparsePayload(dgc.decode(data, max_numel=bound.max_numel))

    def decode_many(self, blobs: Sequence[bytes], bound: Bound) -> list[Payload | DecodeError]:
        if self.compact:
            return super().decode_many(blobs, bound)
        # One call for the round: the replies share their structure, so the headers of all but
        # the first are read against it.
        return [r if isinstance(r, DecodeError) else SparsePayload(r)
                for r in dgc.decode_many(list(blobs), max_numel=bound.max_numel)]

    def check(self, payload: Payload, bound: Bound) -> None:
        update = payload.update if isinstance(payload, SparsePayload) else payload.parts()[0]
        if update.packed is not None:
            # Straight from decode, whose checks cover indices and values: only the names and
            # shapes are left, once per layout (replies of one round share theirs).
            layout = update.packed.layout
            if layout not in self._checked or bound.shapes != getattr(self, "_shapes", None):
                if bound.shapes != getattr(self, "_shapes", None):
                    self._checked, self._shapes = set(), dict(bound.shapes)
                check_tensors(dict(zip(layout.names, layout.shapes, strict=True)), bound.shapes)
                self._checked.add(layout)
            return
        check_tensors({name: t.shape for name, t in update.tensors.items()}, bound.shapes)
        for name, t in update.tensors.items():
            if t.nnz and (int(t.indices.min()) < 0 or int(t.indices.max()) >= t.numel):
                raise PayloadError(f"tensor {name!r} has indices outside [0, {t.numel})")
            if not torch.isfinite(t.values).all():
                raise PayloadError(f"tensor {name!r} carries NaN or Inf values")

    def golden_cases(self) -> list[tuple[str, Any]]:
        def tensor(indices: list[int], values: list[float], shape: tuple[int, ...],
                   dtype: torch.dtype) -> dgc.SparseTensor:
            return dgc.SparseTensor(torch.tensor(indices, dtype=torch.int64),
                                    torch.tensor(values, dtype=torch.float32).to(dtype), shape)

        return [
            ("empty", SparseUpdate({}, 0)),
            ("sparse_and_dense", SparseUpdate({
                "fc.weight": tensor([0, 3, 17, 255], [0.5, -1.25, 3.0, 7.75], (16, 16),
                                    torch.float16),
                "fc.bias": tensor([0, 1, 2], [1.0, -1.0, 0.25], (3,), torch.float32)}, 7)),
        ]
