"""Applying a downlink patch to the model a client holds: the part of :mod:`fedgc.protocol`
a phone needs, without Flower (the reference phone runs where no Flower is installed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

import dgc
from dgc.wire import max_numel_of
from dgc.wire.compact import COMPACT_MAGIC, decode_compact, encode_compact
from fedgc import context_patch

PATCH_ADD = "patch_add"  # tensors whose patch values are added to the held ones (one base only)
#: Tensors of a patch on one base sent as segments of the ranking by displacement from version 0
#: (``downlink_context``, :mod:`fedgc.context_patch`).
PATCH_CONTEXT = "patch_context"


class ProtocolError(ValueError):
    """A message that does not follow the contract (a missing key, a patch that does not fit)."""


def apply_patch(model: Mapping[str, torch.Tensor], patch: bytes,
                added: Sequence[str] = (),
                context: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The model a patch makes of ``model`` (which is left unchanged).

    ``patch`` is ``dgc.encode`` output (or a compact message, :mod:`dgc.wire.compact`, on the
    layout of the model and its ranked tensors' segments) whose values replace the entries at
    its indices, except
    in the tensors named in ``added`` (``patch_add``), whose values are differences to add.
    ``context`` (``patch_context``): per tensor sent as segments of its ranking by displacement,
    that tensor of version 0 (:mod:`fedgc.context_patch`). A patch tensor the model lacks, of
    another size, a tensor sent both whole and as segments, or an ``added`` name the patch lacks
    is a :class:`ProtocolError` (``dgc.DecodeError`` for bytes that do not decode).
    """
    update = decode_patch(patch, {k: tuple(v.shape) for k, v in model.items()},
                          sorted(context or {}))
    tensors = dict(update.tensors)
    if context:
        tensors = _joined(model, tensors, context)
    if unknown := sorted(set(added) - set(tensors)):
        raise ProtocolError(f"{PATCH_ADD} names tensors the patch lacks: {unknown}")
    for name, t in tensors.items():
        if name not in model or model[name].numel() != t.numel:
            raise ProtocolError(f"patch tensor {name!r} does not match the held model")
    out = {k: v.clone() for k, v in model.items()}
    for name, t in tensors.items():
        flat = out[name].view(-1)
        if name in added:
            flat[t.indices] += t.values.to(flat.dtype)
        else:
            flat[t.indices] = t.values.to(flat.dtype)
    return out


def is_compact(patch: bytes) -> bool:
    """Whether ``patch`` is a compact message (``downlink_compact``, magic ``FGCK``)."""
    return bytes(patch[:4]) == COMPACT_MAGIC


def decode_patch(patch: bytes, shapes: Mapping[str, tuple[int, ...]],
                 context: Sequence[str] = ()) -> dgc.SparseUpdate:
    """The tensors a patch on a model of ``shapes`` carries, its ranked tensors' segments
    ``NAME#j`` unjoined: ``dgc.decode``, or for a compact message (:func:`is_compact`)
    :func:`~dgc.wire.compact.decode_compact` on the layout of the model and the segments of
    its ``context`` tensors (:func:`fedgc.context_patch.patch_layout`). A ``context`` tensor the
    model lacks is a :class:`ProtocolError`; bytes that do not decode, ``dgc.DecodeError``."""
    limit = max_numel_of(shapes.values())
    if not is_compact(patch):
        return dgc.decode(patch, max_numel=limit)
    if unknown := sorted(set(context) - set(shapes)):
        raise ProtocolError(f"{PATCH_CONTEXT} names tensors the model lacks: {unknown}")
    return decode_compact(patch, context_patch.patch_layout(shapes, sorted(context)),
                          max_numel=limit)


def encode_patch(update: dgc.SparseUpdate, shapes: Mapping[str, tuple[int, ...]],
                 context: Sequence[str] = (), compact: bool = False) -> bytes:
    """``update`` (a patch's tensors, as :func:`decode_patch` gives them) in the form a patch
    travels in: grid-coded ``dgc.encode``, or with ``compact`` a compact message on the layout
    :func:`decode_patch` reads it with."""
    if not compact:
        return dgc.encode(update, grid_coding=True)
    return encode_compact(update, context_patch.patch_layout(shapes, sorted(context)),
                          grid_coding=True)


def _joined(model: Mapping[str, torch.Tensor], tensors: Mapping[str, dgc.SparseTensor],
            context: Mapping[str, torch.Tensor]) -> dict[str, dgc.SparseTensor]:
    """``tensors`` with the segments of each tensor of ``context`` joined back into it, on the
    ranking of the held model's tensor against version 0."""
    if unknown := sorted(set(context) - set(model)):
        raise ProtocolError(f"{PATCH_CONTEXT} names tensors the model lacks: {unknown}")
    if both := sorted(set(context) & set(tensors)):
        raise ProtocolError(f"patch sends {both} both whole and as {PATCH_CONTEXT} segments")
    out, segments = {}, {}
    for name, t in tensors.items():
        owner = context_patch.segment_owner(name, context)
        if owner is None:
            out[name] = t
        else:
            segments.setdefault(owner, {})[name] = t
    for name, parts in segments.items():
        try:
            order = context_patch.rank_order(model[name], context[name])
            out[name] = context_patch.join(name, parts, order)
        except context_patch.ContextError as ex:
            raise ProtocolError(f"{PATCH_CONTEXT} tensor {name!r}: {ex}") from ex
    return out
