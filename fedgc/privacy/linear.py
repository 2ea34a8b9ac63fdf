"""Which methods' payloads sum linearly at coordinates every client knows, and the vector each
payload becomes under secure aggregation.

Secure aggregation adds masked vectors: it can only sum payloads whose entries sit at the same
coordinates for every client of a round, known before anyone trains. A method declares where
its payload sits in :attr:`fedgc.methods.Method.secure_sum`:

``"all"``
    every coordinate of its aggregation space (:meth:`fedgc.methods.Aggregator.space`):
    ``dense``, ``fedavgm`` (the model's entries) and ``fetchsgd`` (its count sketch's cells: a
    sketch is linear, the sum of sketches is the sketch of the sum).
``"seed"``
    positions drawn from a seed, not from the data: ``randk``. Under secure aggregation every
    client draws with the run's seed (client key 0, :func:`client_compressor`), so all send the
    same positions; :func:`round_layout` finds them by compressing zeros.
``"material"``
    the round material's index sets, the same for every client, and the tensors the layer policy
    sends whole (``dgc.min_sparse_numel``, ``dgc.sparse_vectors``): ``tcs`` (the server's mask)
    and ``dgc_sets`` (sets ranked by the model's displacement). Both also send a per-client
    top-k with indices (``dgc_sets`` always: its density is above 0; ``tcs`` with
    ``tcs.topk_share`` > 0, or in a round without a mask, its first). Under secure
    aggregation :func:`hold_back` puts those entries back into the client's residual (error
    feedback) before it encodes, so that only the sets travel: ``dgc_sets`` becomes "its
    shared sets only", which under secure aggregation are larger (``dgc.secure_density``) and
    partly drawn from the round's seed (``dgc.shared_explore``): ranked by displacement alone
    they would stick where the model first moved (docs/privacy.md). Set
    ``tcs.topk_share = 0`` rather than compute a top-k that is held back.
``""`` (the default)
    per-client coordinates or scales (``dgc``, ``topk``, ``stc``: top-k indices; ``qsgd``,
    ``efsign``, ``signvote``: levels or signs under a client's own scale; ``powersgd``: factors
    whose product is the update): :func:`check_secure` refuses them with one line naming the
    methods that work. (Every payload of the model's space sums at *all* coordinates, densely;
    that is ``dense``.)

A round's :class:`Layout` lists those coordinates; :meth:`Layout.vector` turns a decoded payload
(:class:`fedgc.methods.Payload`, its side part attached) into the float vector the client then
clips, encodes (:class:`fedgc.privacy.FixedPoint`) and masks, and :meth:`Layout.combined` turns
the unmasked sum back into the tensors the method's aggregator finishes, as the plain combine
(``server/aggregation.py``) would give them. Weights: a client scales its vector by its own
weight before encoding (the server cannot weigh a masked vector), and the server divides by the
total (known from the clients' metrics, or summed as one more coordinate).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dgc import SparseTensor, SparseUpdate
from fedgc.methods import Method, Payload, registered
from fedgc.methods.sparsifier import SparsifierSettings, layer_config

__all__ = ["SECURE_SUMS", "Layout", "NotLinearError", "Segment", "check_secure",
           "client_compressor", "hold_back", "round_layout", "secure_methods"]

#: The declarations a method may make (module docstring).
SECURE_SUMS = ("all", "seed", "material")
#: The client key every client of a ``"seed"`` method compresses with under secure aggregation.
SHARED_CLIENT_KEY = 0


class NotLinearError(ValueError):
    """A method, a configuration or a payload that does not sum at coordinates every client
    knows (the message says why and what works)."""


def secure_methods() -> tuple[str, ...]:
    """The registered methods whose payload secure aggregation sums, in ``compare``'s order."""
    return tuple(m.name for m in registered() if m.secure_sum)


def check_secure(method: Method, train: Any) -> None:
    """NotLinearError (one line) unless secure aggregation can sum ``method``'s payloads in a
    run of ``train`` (the run's TrainSettings; ``method`` configured with the run's keys)."""
    kind = method.secure_sum
    if kind not in ("", *SECURE_SUMS):
        raise NotLinearError(f"method {method.name!r} declares secure_sum = {kind!r}; expected "
                             f"one of {SECURE_SUMS} or ''")
    if not kind:
        raise NotLinearError(
            f"method {method.name!r} does not sum at coordinates every client knows (per-client "
            f"indices, scales or factors); secure aggregation works with "
            f"{', '.join(secure_methods())}")
    feedback = getattr(method.own, "feedback", "residual")  # dgc's aggregate feedback
    if kind == "material" and feedback != "residual":
        raise NotLinearError(
            f"method {method.name!r} with dgc.feedback = {feedback}: the server adds each "
            f"client's own reference to its reply, which a masked sum cannot; use "
            f"dgc.feedback = residual")


@dataclass(frozen=True)
class Segment:
    """One tensor's coordinates in a layout: ``indices`` (sorted flat int64), or every entry."""

    name: str
    shape: tuple[int, ...]
    indices: np.ndarray | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape) if self.indices is None else len(self.indices)

    def positions(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(where each of ``indices`` sits in this segment, which of them sit in it at all)."""
        if self.indices is None:
            inside = (indices >= 0) & (indices < math.prod(self.shape))
            return indices, inside
        at = np.searchsorted(self.indices, indices)
        inside = at < len(self.indices)
        inside[inside] = self.indices[at[inside]] == indices[inside]
        return at, inside


@dataclass(frozen=True)
class Layout:
    """The coordinates a round's payloads are summed at: ``segments`` in order, in the method's
    aggregation ``space`` (the model's tensors, or a sketch's)."""

    segments: tuple[Segment, ...]
    space: Mapping[str, tuple[int, ...]]

    @property
    def length(self) -> int:
        """Coordinates of a round's vector."""
        return sum(s.size for s in self.segments)

    def _offsets(self) -> dict[str, tuple[int, Segment]]:
        out, at = {}, 0
        for s in self.segments:
            out[s.name] = (at, s)
            at += s.size
        return out

    def vector(self, payload: Payload, strict: bool = True) -> np.ndarray:
        """The float64 vector of ``payload``'s parts (its side part attached) at this layout's
        coordinates; NotLinearError naming a tensor with entries anywhere else, or with
        ``strict`` False those entries left out (the server's projection of a reply it cannot
        refuse for them: central DP's sum at the layout, :mod:`server.privacy`)."""
        out = np.zeros(self.length, dtype=np.float64)
        offsets = self._offsets()
        for part in payload.parts():
            for name, t in part.tensors.items():
                if t.nnz == 0:
                    continue
                if name not in offsets:
                    if not strict:
                        continue
                    raise NotLinearError(f"the payload carries {t.nnz} entries of {name!r}, a "
                                         f"tensor with no shared coordinates this round")
                start, segment = offsets[name]
                idx = t.indices.cpu().numpy().astype(np.int64, copy=False)
                at, inside = segment.positions(idx)
                values = t.values.cpu().to(torch.float64).numpy()
                if not strict:
                    at, values = at[inside], values[inside]
                elif not inside.all():
                    raise NotLinearError(
                        f"the payload carries {int((~inside).sum())} entries of {name!r} outside "
                        f"the round's shared coordinates (per-client indices): hold them back "
                        f"(fedgc.privacy.linear.hold_back) or use a method that sends none")
                np.add.at(out, start + at, values)
        return out

    def combined(self, total: np.ndarray, weight: float) -> dict[str, torch.Tensor]:
        """The float32 tensors of the space (zero off the layout) of ``total / weight``: what
        the plain combine gives the method's aggregator."""
        if weight <= 0 or len(total) != self.length:
            raise ValueError(f"a sum of {len(total)} coordinates with total weight {weight}; "
                             f"expected {self.length} and a weight > 0")
        out = {n: torch.zeros(math.prod(s), dtype=torch.float32) for n, s in self.space.items()}
        for name, (start, segment) in self._offsets().items():
            values = torch.from_numpy(total[start:start + segment.size] / weight).to(
                torch.float32)
            if segment.indices is None:
                out[name] = values
            else:
                out[name][torch.from_numpy(segment.indices)] = values
        return {n: t.view(self.space[n]) for n, t in out.items()}


def client_compressor(method: Method, train: Any, client_key: int, material: Any = None) -> Any:
    """The compressor a client runs under secure aggregation: the method's, with the shared
    client key for a ``"seed"`` method (every client draws the same positions)."""
    key = SHARED_CLIENT_KEY if method.secure_sum == "seed" else client_key
    return method.compressor(train, key, material)


def round_layout(method: Method, train: Any, space: Mapping[str, tuple[int, ...]],
                 material: Any, server_round: int) -> Layout:
    """The coordinates of round ``server_round``'s vectors (both ends compute the same):
    ``space`` is the method's aggregation space (``aggregator.space(shapes)``), ``material``
    the round's decoded material (the server's, or a client's after ``hold_material``)."""
    check_secure(method, train)
    space = {n: tuple(s) for n, s in space.items()}
    kind = method.secure_sum
    if kind == "all":
        return Layout(tuple(Segment(n, s) for n, s in space.items()), space)
    if kind == "seed":
        # The positions do not depend on the data: compressing zeros draws them.
        probe = client_compressor(method, train, SHARED_CLIENT_KEY, material)
        sent = probe.compress({n: torch.zeros(s) for n, s in space.items()},
                              epoch=float(server_round - 1), sequence=server_round)
        return Layout(tuple(Segment(n, space[n], _sorted(t.indices))
                            for n, t in sent.tensors.items()), space)
    if material is not None and not (isinstance(material, Mapping) and all(
            isinstance(v, np.ndarray) for v in material.values())):
        raise NotLinearError(f"method {method.name!r}: the round material is a "
                             f"{type(material).__name__}, not index sets")
    # The sparsifiers' layer policy (their keys' defaults for a method without them).
    own = method.own if isinstance(method.own, SparsifierSettings) else SparsifierSettings()
    policy = layer_config(train, own)
    sets = dict(material or {})
    segments = []
    for name, shape in space.items():
        if policy.sends_dense(shape):
            segments.append(Segment(name, shape))
        elif name in sets:
            segments.append(Segment(name, shape, _sorted(sets[name])))
    return Layout(tuple(segments), space)


def _sorted(indices: Any) -> np.ndarray:
    idx = np.asarray(indices.cpu().numpy() if isinstance(indices, torch.Tensor) else indices,
                     dtype=np.int64)
    return np.unique(idx)


def hold_back(compressor: Any, update: SparseUpdate, layout: Layout) -> tuple[SparseUpdate, int]:
    """``update`` without its entries off ``layout`` (a per-client top-k), which go back into
    ``compressor``'s residual (error feedback: they are sent later or never, not lost), and how
    many entries that was. The update's other fields (a mask's values, a seed) stay."""
    offsets = layout._offsets()
    kept: dict[str, SparseTensor] = {}
    held: dict[str, SparseTensor] = {}
    for name, t in update.tensors.items():
        segment = offsets.get(name, (0, None))[1]
        idx = t.indices.cpu().numpy().astype(np.int64, copy=False)
        inside = (segment.positions(idx)[1] if segment is not None
                  else np.zeros(len(idx), dtype=bool))
        mask = torch.from_numpy(inside).to(t.indices.device)
        kept[name] = SparseTensor(t.indices[mask], t.values[mask], t.shape)
        if not inside.all():
            held[name] = SparseTensor(t.indices[~mask], t.values[~mask], t.shape)
    if held:
        compressor.restore(SparseUpdate(held, update.sequence))
    return dataclasses.replace(update, tensors=kept), sum(t.nnz for t in held.values())
