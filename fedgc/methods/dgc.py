"""``dgc``: Deep Gradient Compression (Lin et al., ICLR 2018) in federated rounds, as fedgc runs it.

Clients compress ``global - local`` with DGC's top-k, residual (error feedback) and optional
momentum correction (``dgc.*`` keys; two densities, ``dgc.small_density`` for small tensors) and
send the residual at the round's shared index sets as scaled signs (the sign channel,
:mod:`dgc.signs`, ``dgc.shared_density``); the server applies its momentum to the aggregate
(``server_momentum``, 0.5 for this method) and broadcasts per ``downlink_density``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dgc import Compressor, DGCCompressor, DGCConfig, SparseUpdate
from dgc.signs.client import take_signs
from dgc.signs.codec import decode_mask, decode_signs, encode_mask, encode_signs
from dgc.signs.planner import SharedIndexPlanner
from dgc.two_density import TwoDensityCompressor
from fedgc.methods.base import Channel, Method
from fedgc.methods.payloads import Codec, SparseCodec
from fedgc.methods.registry import register

__all__ = ["DGC", "SharedSigns", "dgc_config", "layer_config", "split_compressor"]


def layer_config(train: Any, **method: Any) -> DGCConfig:
    """A :class:`DGCConfig` of the run's ``density`` and the ``dgc.*`` keys every DGC-family
    method shares (selection, value precision, layer policy, warm-up), with ``method``'s own
    fields.

    The run keys of DGCConfig's fields were validated against its own ranges; the renames are
    the run's vocabulary: rounds are the paper's epochs.
    """
    return DGCConfig(
        density=train.density, selection=train.selection, value_dtype=train.value_dtype,
        ternary=train.ternary, min_sparse_numel=train.min_sparse_numel,
        sparse_vectors=train.sparse_vectors,
        warmup="exponential" if train.warmup == "exponential" and train.warmup_rounds else "none",
        warmup_epochs=max(train.warmup_rounds, 0), **method)


def dgc_config(train: Any) -> DGCConfig:
    """DGC's configuration: :func:`layer_config` with its momentum correction, error feedback
    and local clipping (0 turns it off; scaled by ``clients_per_round**-0.5``)."""
    return layer_config(
        train, momentum=train.dgc_momentum, momentum_correction=train.momentum_correction,
        nesterov=train.nesterov, dampening=train.dampening,
        momentum_masking=train.momentum_masking, error_feedback=True,
        clip_norm=train.clip_norm or None, num_workers=train.clients_per_round)


def split_compressor(train: Any, config: DGCConfig) -> Compressor:
    """A compressor of ``config``, with a second density for small tensors when
    ``dgc.small_density > 0``.

    Small sparsified tensors (``dgc.small_numel`` entries or fewer, e.g. a 10x200 output layer)
    get ``dgc.small_density``: at ``density`` alone they would send 2 entries per update
    (docs/federated_momentum.md).
    """
    if train.small_density == 0.0:
        return DGCCompressor(config)
    return TwoDensityCompressor(config, train.small_density, small_numel=train.small_numel)


class SharedSigns(Channel):
    """The sign channel's server half: each round's shared index sets, from the aggregates seen
    (:class:`dgc.signs.planner.SharedIndexPlanner`), sent Golomb-Rice coded."""

    def __init__(self, planner: SharedIndexPlanner, numels: Mapping[str, int]) -> None:
        self.planner = planner
        self.numels = dict(numels)

    def plan(self, server_round: int) -> tuple[bytes, Any] | None:
        masks = self.planner.plan()
        if not masks:
            return None
        return encode_mask(masks, {n: self.numels[n] for n in masks}, server_round), masks

    def observe(self, aggregate: Mapping[str, Any]) -> None:
        self.planner.observe(aggregate)

    def state_dict(self) -> dict[str, Any] | None:
        return self.planner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.planner.load_state_dict(state)


class DGC(Method):
    """DGC with error feedback, the sign channel and server momentum (module docstring)."""

    name = "dgc"
    order = 40
    description = ("DGC's top-k of the residual (`dgc.*`), fp16, and the residual at the "
                   "round's shared indices as signs (`dgc.shared_density`)")
    keeps_residual = True
    phone = True
    prefix = "dgc"
    defaults = {"server_momentum": 0.5}

    def compressor(self, train: Any, client_key: int, material: Any = None) -> Compressor:
        return split_compressor(train, dgc_config(train))

    def codec(self, train: Any) -> Codec:
        return SparseCodec(sign_coding=bool(train is not None and train.ternary))

    def phone_config(self, train: Any) -> DGCConfig:
        return dgc_config(train)

    # -- the sign channel, client half
    def read_material(self, data: bytes, numels: Mapping[str, int]) -> Any:
        return decode_mask(data, numels)[1]

    def side_part(self, compressor: Compressor, material: Any,
                  server_round: int) -> tuple[bytes, int] | None:
        if material is None:
            return None
        signs = take_signs(compressor.residual(), material, server_round)
        return encode_signs(signs), signs.nnz

    def read_side(self, data: bytes, material: Any,
                  shapes: Mapping[str, tuple[int, ...]]) -> SparseUpdate:
        return decode_signs(data, material, {n: shapes[n] for n in material})

    # -- the sign channel, server half
    def channel(self, config: Any, shapes: Mapping[str, tuple[int, ...]]) -> Channel | None:
        s, t = config.server, config.train
        if s.shared_density <= 0:
            return None
        policy = dgc_config(t)
        sparse = {n: tuple(shape) for n, shape in shapes.items()
                  if not policy.sends_dense(tuple(shape))}
        planner = SharedIndexPlanner(sparse, s.shared_density, s.shared_small_density,
                                     t.small_numel, s.shared_momentum)
        return SharedSigns(planner, {n: math.prod(shape) for n, shape in shapes.items()})


register(DGC())
