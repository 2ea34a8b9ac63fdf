"""``dgc``: Deep Gradient Compression (Lin et al., ICLR 2018) in federated rounds, as fedgc runs it.

Clients compress ``global - local`` with DGC's top-k, residual (error feedback) and optional
momentum correction (``dgc.*`` keys; two densities, ``dgc.small_density`` for small tensors) and
send the residual at the round's shared index sets as scaled signs (the sign channel,
:mod:`dgc.signs`, ``dgc.shared_density``); the server applies its momentum to the aggregate
(``server_momentum``, 0.5 for this method) and broadcasts per ``downlink_density``. With
``dgc.feedback = aggregate`` a client compresses its pseudo-gradient less a reference both ends
derive from the sent models, which the server adds back (:mod:`fedgc.methods.feedback`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from dgc import Compressor, DGCCompressor, DGCConfig, SparseTensor, SparseUpdate
from dgc.int8_grid import round_initial
from dgc.signs.client import on_grid, take_signs, take_values
from dgc.signs.codec import (
    RANK_MAGIC,
    decode_mask,
    decode_rank_request,
    decode_shared,
    encode_mask,
    encode_rank_request,
    encode_signs,
    encode_values,
)
from dgc.signs.planner import SharedIndexPlanner, displacement_masks
from dgc.two_density import TwoDensityCompressor
from fedgc.methods.base import Aggregator, Channel, Method
from fedgc.methods.feedback import (
    MATERIAL_MAGIC,
    FeedbackChannel,
    FeedbackMaterial,
    decode_material,
    decode_side,
    encode_material,
    encode_side,
    reference,
    with_reference,
)
from fedgc.methods.payloads import Codec, SparseCodec
from fedgc.methods.registry import register
from fedgc.methods.server_error import ErrorAccumulation
from fedgc.methods.shift import ShiftMemory, shift_by, unshift

__all__ = ["DGC", "DGCSets", "DisplacementSets", "RankRequest", "RoundCompressor", "SharedSigns",
           "dgc_config", "layer_config", "small_split", "split_compressor"]


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
    ``dgc.small_density > 0``, and the total shared out by the residual with ``dgc.budget``.

    Small sparsified tensors (``dgc.small_numel`` entries or fewer, e.g. a 10x200 output layer)
    get ``dgc.small_density``: at ``density`` alone they would send 2 entries per update
    (docs/federated_momentum.md).
    """
    if train.budget != "tensor":  # one compressor shares the total out (dgc.budget)
        return DGCCompressor(config, budget=train.budget, small_density=train.small_density,
                             small_numel=train.small_numel)
    if train.small_density == 0.0:
        return DGCCompressor(config)
    return TwoDensityCompressor(config, train.small_density, small_numel=train.small_numel)


def small_split(train: Any) -> tuple[float, int] | None:
    """``(dgc.small_density, dgc.small_numel)`` when :func:`split_compressor` gives small tensors
    a density of their own; None when it does not (what a phone is told to do the same)."""
    if train.small_density == 0.0:
        return None
    return float(train.small_density), int(train.small_numel)


class RankRequest(NamedTuple):
    """The material of sets ranked by displacement, as read: per tensor its set's size; the
    client derives the sets from the model it holds (:meth:`DGC.hold_material`)."""

    counts: dict[str, int]
    initial_on_grid: bool


class RoundCompressor:
    """One client's DGC compressor for a round, with issue 30's client switches around it.

    ``dgc.shared_first`` (with the round's sets): the pseudo-gradient at the sets joins the
    residual there and the sets' part (:meth:`take`) leaves first, so that the top-k finds what
    the sets miss (GlueFL's order); ``dgc.value_levels``: the top-k's values go on a
    power-of-two grid (:func:`dgc.signs.client.on_grid`), the rounding back into the residual.
    Everything else is the wrapped compressor's (:class:`dgc.base.Compressor`).
    """

    def __init__(self, inner: Compressor, train: Any, masks: Any = None,
                 feedback: FeedbackMaterial | None = None) -> None:
        self.inner, self.train, self.masks = inner, train, masks
        # dgc.feedback = aggregate: the round's material with this client's reference, which
        # leaves the pseudo-gradient before anything else (fedgc.methods.feedback).
        self.feedback = feedback
        self.taken: SparseUpdate | None = None  # the sets' part, when taken first
        # dgc.feedback = own: the client's shift h_i (EF21, fedgc.methods.shift), which leaves
        # the pseudo-gradient first and takes in everything sent; None otherwise.
        self.shift: dict[str, torch.Tensor] | None = {} if train.feedback == "own" else None

    def take(self, source: dict[str, torch.Tensor], server_round: int) -> SparseUpdate:
        """The residual at the sets as signs or grid values (``dgc.shared_values``)."""
        if self.train.shared_values == "grid":
            return take_values(source, self.masks, server_round, self.train.shared_levels)
        return take_signs(source, self.masks, server_round)

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> SparseUpdate:
        left = None
        ref = self.shift if self.feedback is None else self.feedback.reference
        if ref:
            grads = {n: g - ref[n].view(g.shape).to(g.device, g.dtype) if n in ref else g
                     for n, g in grads.items()}
        if self.masks is not None and (self.train.shared_first or self.shift is not None):
            # (under dgc.feedback = own the sets always come first: no residual holds them)
            self.taken, grads, left = self._take_first(dict(grads), sequence or 0)
        update = self.inner.compress(grads, epoch, sequence)
        if left is not None and left.tensors:
            self.inner.restore(left)  # a first round's remainder at the sets
        if self.train.value_levels > 0:
            tensors, error = {}, {}
            for name, t in update.tensors.items():
                values = t.values.to(torch.float32)
                rounded = on_grid(values, self.train.value_levels)
                tensors[name] = SparseTensor(t.indices, rounded, t.shape)
                error[name] = SparseTensor(t.indices, values - rounded, t.shape)
            self.inner.restore(SparseUpdate(error, update.sequence))
            update = SparseUpdate(tensors, update.sequence)
        if self.shift is not None:
            for sent in (update, self.taken):
                if sent is not None:
                    shift_by(self.shift, sent)
        return update

    def _take_first(self, grads: dict[str, torch.Tensor], server_round: int,
                    ) -> tuple[SparseUpdate, dict[str, torch.Tensor], SparseUpdate]:
        """What the sets send, the pseudo-gradient left for the top-k (zero at the sets) and,
        for tensors the residual does not hold yet (a first round), the remainder at the sets
        to restore after the top-k."""
        residual = self.inner.residual()
        source: dict[str, torch.Tensor] = {}
        for name, mask in self.masks.items():
            if name not in grads:
                continue
            idx = torch.from_numpy(np.asarray(mask, dtype=np.int64))
            flat = grads[name].reshape(-1).to(torch.float32)
            if name in residual:
                residual[name].index_add_(0, idx, flat[idx])
                source[name] = residual[name]
            else:
                source[name] = torch.zeros_like(flat)
                source[name][idx] = flat[idx]
            off = flat.clone()
            off[idx] = 0.0
            grads[name] = off.view(grads[name].shape)
        sent = self.take(source, server_round)
        left = {n: SparseTensor(t.indices, source[n][t.indices], t.shape)
                for n, t in sent.tensors.items() if n not in residual}
        return sent, grads, SparseUpdate(left, sent.sequence)

    def __getattr__(self, name: str) -> Any:
        # The wrapped compressor's own attributes (a TwoDensityCompressor's large and small).
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def restore(self, update: SparseUpdate) -> None:
        if self.shift is not None:
            unshift(self.shift, update)  # EF21 keeps no residual: the shift takes it back
            return
        self.inner.restore(update)

    def residual(self) -> dict[str, torch.Tensor]:
        return self.inner.residual()

    def scale_state(self, factor: float) -> None:
        self.inner.scale_state(factor)

    def state_dict(self) -> dict[str, Any]:
        if self.shift is None:
            return self.inner.state_dict()
        return {"shift": dict(self.shift), "compressor": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.shift is None:
            self.inner.load_state_dict(state)
            return
        if "shift" not in state:  # a state kept before the client ran dgc.feedback = own
            self.inner.load_state_dict(state)
            return
        self.shift = {k: v.detach().to(torch.float32).clone() for k, v in state["shift"].items()}
        self.inner.load_state_dict(state["compressor"])


class DisplacementSets(Channel):
    """Shared sets ranked by how far the model clients hold has moved from version 0
    (``dgc.shared_rank = displacement``): clients hold both models bit for bit and rank them
    the same way (:func:`dgc.signs.planner.displacement_masks`), so only each set's size
    travels (:func:`dgc.signs.codec.encode_rank_request`, ~20 bytes a tensor)."""

    def __init__(self, counts: Mapping[str, int], numels: Mapping[str, int]) -> None:
        self.counts, self.numels = dict(counts), dict(numels)
        self.initial: dict[str, torch.Tensor] = {}
        self.held: Mapping[str, torch.Tensor] = {}
        self.version, self.initial_on_grid = 0, False

    def hold(self, sent_model: Mapping[str, torch.Tensor], version: int,
             initial_on_grid: bool) -> None:
        if version == 0 or not self.initial:
            self.initial = {n: sent_model[n].clone() for n in self.counts}
        self.held, self.version, self.initial_on_grid = sent_model, version, initial_on_grid

    def plan(self, server_round: int) -> tuple[bytes, Any] | None:
        if self.version == 0:  # version 0 has not moved: no set in the first round
            return None
        masks = displacement_masks(self.held, self.initial, self.counts)
        return (encode_rank_request(self.counts, self.numels, server_round,
                                    self.initial_on_grid), masks)


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
    family = "top-k"
    description = ("DGC's top-k of the residual (`dgc.*`), fp16, and the residual at the "
                   "round's shared indices as signs (`dgc.shared_density`)")
    keeps_residual = True
    phone = True
    prefix = "dgc"
    defaults = {"server_momentum": 0.5}

    def compressor(self, train: Any, client_key: int, material: Any = None) -> Compressor:
        inner = split_compressor(train, dgc_config(train))
        if isinstance(material, FeedbackMaterial):
            return RoundCompressor(inner, train, material.inner, material)
        if train.value_levels > 0 or material is not None or train.feedback == "own":
            return RoundCompressor(inner, train, material)
        return inner

    def codec(self, train: Any) -> Codec:
        return SparseCodec(sign_coding=bool(train is not None and train.ternary),
                           grid_coding=bool(train is not None and train.value_levels > 0),
                           compact=bool(train is not None and train.compact_wire))

    def phone_config(self, train: Any) -> DGCConfig:
        return dgc_config(train)

    def phone_small(self, train: Any) -> tuple[float, int] | None:
        return small_split(train)

    # -- the client's start (aged residuals, step-ahead)
    def prepare(self, train: Any, compressor: Compressor, model: dict[str, torch.Tensor],
                rounds_away: int) -> dict[str, torch.Tensor]:
        if train.feedback in ("aggregate", "own") or train.server_error > 0:
            # Aggregate feedback without a residual (CAFe): what the top-k leaves of
            # pseudo-gradient - reference is the reference's at the server; the server's error
            # accumulation (dgc.server_error) keeps the error on the server. Either way the
            # residual (and the velocity of momentum correction) starts every round empty.
            compressor.scale_state(0.0)
            return model
        # Aged residuals (CSER, Xie et al. 2020; Fed-EF, Li and Li 2023): a residual built on
        # a model many rounds old is scaled down by dgc.residual_decay per round beyond
        # dgc.residual_after_rounds.
        over = rounds_away - train.residual_after_rounds
        if train.residual_decay < 1.0 and over > 0:
            compressor.scale_state(train.residual_decay ** over)
        if train.step_ahead <= 0:
            return model
        # Step-ahead partial error feedback (SA-PEF, Redie et al. 2026): local training starts
        # at the model less a of the residual; that part leaves the residual, and the
        # pseudo-gradient against the model sent carries it.
        start = dict(model)
        for name, v in compressor.residual().items():
            if name in start and start[name].numel() == v.numel():
                start[name] = model[name] - train.step_ahead * v.view(model[name].shape)
                v.mul_(1.0 - train.step_ahead)
        return start

    # -- the sign channel, client half
    def read_material(self, data: bytes, numels: Mapping[str, int]) -> Any:
        if bytes(data[:4]) == MATERIAL_MAGIC:
            sequence, version, oldest, scale, inner = decode_material(data)
            return FeedbackMaterial(sequence, version, oldest, scale,
                                    self.read_material(inner, numels) if inner else None,
                                    inner_bytes=inner)
        if bytes(data[:4]) == RANK_MAGIC:
            _, counts, on_grid_ = decode_rank_request(data, numels)
            return RankRequest(counts, on_grid_)
        return decode_mask(data, numels)[1]

    def hold_material(self, data: bytes, material: Any, model: dict[str, torch.Tensor],
                      initial: Any, held: tuple[int, Mapping[str, torch.Tensor]] | None = None,
                      ) -> tuple[bytes, Any]:
        if isinstance(material, FeedbackMaterial):
            return self._hold_feedback(material, model, initial, held)
        if not isinstance(material, RankRequest):
            return data, material
        version0 = initial()
        if material.initial_on_grid:
            version0 = round_initial(version0)
        masks = displacement_masks(model, version0, material.counts)
        return encode_mask(masks, {n: model[n].numel() for n in masks}, 0), masks

    def _hold_feedback(self, material: FeedbackMaterial, model: dict[str, torch.Tensor],
                       initial: Any, held: tuple[int, Mapping[str, torch.Tensor]] | None,
                       ) -> tuple[bytes, FeedbackMaterial]:
        """The feedback material with the sets derived and this client's reference: from the
        model it kept (``held``: its version and the model) when the server keeps that
        version too, else none."""
        inner_bytes, inner = b"", None
        if material.inner is not None:
            # The sets' bytes as the client holds them (derived when ranked by displacement).
            inner_bytes, inner = self.hold_material(material.inner_bytes, material.inner,
                                                    model, initial)
        base, ref = -1, None
        if held is not None and held[1] is not None \
                and material.oldest <= held[0] < material.version:
            try:
                ref = reference(held[1], model, material.version - held[0], material.scale)
                base = int(held[0])
            except ValueError:  # a kept model of other tensors: none, as on first contact
                pass
        data = encode_material(material.sequence, material.version, material.oldest,
                               material.scale, inner_bytes)
        return data, FeedbackMaterial(material.sequence, material.version, material.oldest,
                                      material.scale, inner, base, ref, inner_bytes=inner_bytes)

    def side_part(self, compressor: Compressor, material: Any,
                  server_round: int) -> tuple[bytes, int] | None:
        if isinstance(material, FeedbackMaterial) and isinstance(compressor, RoundCompressor):
            inner = (self.side_part(compressor, material.inner, server_round)
                     if material.inner is not None else None)
            data, entries = (b"", 0) if inner is None else inner
            return encode_side(server_round, material.base, data), entries
        if material is None or not isinstance(compressor, RoundCompressor):
            return None
        sent = (compressor.taken if compressor.taken is not None
                else compressor.take(compressor.residual(), server_round))
        train = compressor.train
        grid = train.shared_values == "grid"
        return (encode_values(sent, compact=train.compact_wire) if grid
                else encode_signs(sent)), sent.nnz

    def read_side(self, data: bytes, material: Any,
                  shapes: Mapping[str, tuple[int, ...]]) -> SparseUpdate:
        if isinstance(material, FeedbackMaterial):
            return self._read_feedback_side(data, material, shapes)
        return decode_shared(data, material, {n: shapes[n] for n in material})

    def _read_feedback_side(self, data: bytes, material: FeedbackMaterial,
                            shapes: Mapping[str, tuple[int, ...]]) -> SparseUpdate:
        """A side part under aggregate feedback: the sets' part, and on the server (whose
        material holds the channel) the reference of the base the client names added, so that
        the payload's parts sum to the client's pseudo-gradient. On a client (folding back an
        update the server did not aggregate) only the sets' part: the reference is not the
        client's to keep."""
        sequence, base, inner = decode_side(data)
        if inner and material.inner is None:
            raise ValueError("a side part for shared index sets in a round without them")
        side = self.read_side(inner, material.inner, shapes) if inner else None
        if side is not None and side.sequence != sequence:
            raise ValueError(f"shared part sequence {side.sequence} is not the side part's "
                             f"{sequence}")
        if material.channel is None or base == -1:
            return side if side is not None else SparseUpdate({}, sequence)
        ref = material.channel.reference_of(base)
        return with_reference(side, ref, shapes, sequence)

    # -- the sign channel and aggregate feedback, server half
    def _sets_channel(self, config: Any, shapes: Mapping[str, tuple[int, ...]],
                      ) -> Channel | None:
        """The shared index sets' channel (None: ``dgc.shared_density`` 0)."""
        s, t = config.server, config.train
        if s.shared_density <= 0:
            return None
        policy = dgc_config(t)
        sparse = {n: tuple(shape) for n, shape in shapes.items()
                  if not policy.sends_dense(tuple(shape))}
        planner = SharedIndexPlanner(sparse, s.shared_density, s.shared_small_density,
                                     t.small_numel, s.shared_momentum, s.shared_churn)
        numels = {n: math.prod(shape) for n, shape in shapes.items()}
        if s.shared_rank == "displacement":
            return DisplacementSets({n: planner.count(n) for n in sparse}, numels)
        return SharedSigns(planner, numels)

    def aggregator(self, config: Any) -> Aggregator:
        t = config.train
        if t.feedback == "own":  # the mean of every client's shift (fedgc.methods.shift)
            return ShiftMemory(min(1.0, t.clients_per_round / t.num_clients))
        return Aggregator()

    def optimizer(self, config: Any) -> Any | None:
        t, s = config.train, config.server
        if t.server_error > 0:  # FetchSGD's server over the sets (fedgc.methods.server_error)
            return ErrorAccumulation(s.server_lr, s.server_momentum, t.server_error)
        return None

    def channel(self, config: Any, shapes: Mapping[str, tuple[int, ...]]) -> Channel | None:
        inner = self._sets_channel(config, shapes)
        if config.train.feedback in ("residual", "own"):
            return inner
        s = config.server
        scale = s.feedback_scale or (1.0 - float(s.server_momentum)) / float(s.server_lr)
        return FeedbackChannel(inner, scale, s.feedback_history)


register(DGC())


class DGCSets(DGC):
    """``dgc_sets``: DGC whose clients send values on sets the server and clients rank alike.

    The best combination of issue 30's switches (docs/dgc_vs_dense.md, "cA"): the shared sets
    are ranked by the model's displacement from version 0 (no indices travel), carry each
    client's residual as values on a power-of-two grid (half a step per mean magnitude) before
    the top-k takes what they miss, the top-k's values go on a 4-level grid, and the broadcast
    sends its biases in float16 and ranks its patches' indices by the same displacement
    (``downlink_context``). Its broadcast keeps the server's dead band of half a grid step: a
    whole step (``downlink_deadband = 1``, its default until 2026-12-06) cost 1.8 points on
    shakespeare for 4-7% fewer bytes (docs/dgc_vs_dense.md, "The dead band"). Phones do not
    run it (their encoder is plain ``dgc``), and ``compare`` runs it only when named.
    """

    name = "dgc_sets"
    order = 41
    compared = False
    phone = False
    description = ("DGC's top-k of the residual on a 4-level grid after the residual at shared "
                   "sets clients rank themselves (the model's displacement), sent as grid "
                   "values (`dgc.*` as dgc)")
    defaults = {**DGC.defaults, "dgc.shared_rank": "displacement", "dgc.shared_values": "grid",
                "dgc.shared_levels": 0.5, "dgc.shared_first": True, "dgc.value_levels": 4.0,
                "downlink_vectors": "float16", "downlink_context": True}
    secure_sum = "material"  # the sets' values; under secure aggregation its top-k is held back

    def phone_config(self, train: Any) -> DGCConfig | None:
        return None  # phones' encoder is plain dgc's (android_bridge.export.check_phone_run)

    def phone_small(self, train: Any) -> tuple[float, int] | None:
        return None


register(DGCSets())
