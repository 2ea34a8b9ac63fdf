"""``dgc``: Deep Gradient Compression (Lin et al., ICLR 2018) in federated rounds, as fedgc runs it.

Clients compress ``global - local`` with DGC's top-k, residual (error feedback) and optional
momentum correction (its ``dgc.*`` keys, :class:`DGCSettings`, on the sparsifiers' shared ones:
two densities, ``dgc.small_density`` for small tensors) and send the residual at the round's
shared index sets as scaled signs (the sign channel, :mod:`dgc.signs`, ``dgc.shared_density``);
the server applies its momentum to the aggregate (``server_momentum``, 0.5 for this method) and
broadcasts per ``downlink_density``. With ``dgc.feedback = aggregate`` a client compresses its
pseudo-gradient less a reference both ends derive from the sent models, which the server adds
back (:mod:`fedgc.methods.feedback`). Its keys, its round material and its phone export are all
here: the server, the clients and the emulator know none of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from dgc import Compressor, DGCConfig, SparseTensor, SparseUpdate
from dgc.int8_grid import round_initial
from dgc.signs.client import take_signs, take_values, values_on_grid
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
from fedgc.keys import RunSettings, TrainSettings
from fedgc.keys.client import momentum_range
from fedgc.methods.base import Aggregator, Method
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
from fedgc.methods.material import Channel, RoundMaterial
from fedgc.methods.optimizer import ServerOptimizer
from fedgc.methods.payloads import Codec, SparseCodec
from fedgc.methods.phone import PhoneExport
from fedgc.methods.registry import register
from fedgc.methods.server_error import ErrorAccumulation
from fedgc.methods.shift import ShiftMemory, shift_by, unshift
from fedgc.methods.sparsifier import SparsifierSettings, layer_config, small_split, split_compressor
from fedgc.methods.unaggregated import FOLD_BACK_DEFAULTS
from fedgc.schema import Check, SettingsError, fields_of, setting, validate

__all__ = ["BUDGETS", "DGC", "DGCSets", "DGCSettings", "DisplacementSets", "FEEDBACKS",
           "RankRequest", "RoundCompressor", "SHARED_RANKS", "SHARED_VALUES", "SharedSigns",
           "dgc_config"]

#: What a dgc client sends at the shared indices: scaled signs, or values on a grid.
SHARED_VALUES = ("sign", "grid")
#: How the server ranks the shared indices (dgc.signs.planner).
SHARED_RANKS = ("aggregates", "displacement")
#: What a dgc client compresses (fedgc.methods.feedback): its residual plus its pseudo-gradient
#: (DGC's error feedback), its pseudo-gradient less the aggregate reference (CAFe), or both,
#: or its pseudo-gradient less its own shift (EF21, fedgc.methods.shift).
FEEDBACKS = ("residual", "aggregate", "aggregate+residual", "own")
#: How a dgc client shares its top-k's entries out among its tensors (dgc.DGCCompressor).
BUDGETS = ("tensor", "model", "energy")


@dataclass(frozen=True)
class DGCSettings(SparsifierSettings):
    """DGC's own keys (``dgc.*``), on the sparsifiers' shared ones: its momentum correction and
    clipping, issue 30's client switches, its residual's ageing and feedback (sent to clients),
    and the sign channel's and aggregate feedback's server keys (``sent=False``). The ranges of
    the keys that configure :class:`dgc.DGCConfig` are that class's own."""

    momentum: float = setting(0.0, "dgc.momentum", "momentum m of DGC's momentum "
                              "correction on the pseudo-gradient; 0 = residual only",
                              DGCConfig.check("momentum"))
    dampening: float = setting(0.0, "dgc.dampening", "u = m*u + (1 - dampening)*g; "
                               "dampening = m keeps the step size of plain SGD",
                               DGCConfig.check("dampening"))
    momentum_correction: bool = setting(False, "dgc.momentum_correction", "accumulate the "
                                        "velocity (True) or the raw pseudo-gradient (False: "
                                        "error feedback only)")
    nesterov: bool = setting(False, "dgc.nesterov", "Nesterov form of momentum correction")
    momentum_masking: bool = setting(True, "dgc.momentum_masking", "zero the momentum at the "
                                     "sent coordinates (momentum factor masking)")
    # The issue-30 switches below take the method's default when left empty (dgc_sets sets them).
    shared_values: str | None = setting(
        None, "dgc.shared_values", "what a dgc client sends at the shared indices: sign (one "
        "bit each, times the mean magnitude) or grid (values on a power-of-two grid with "
        "dgc.shared_levels steps to the mean magnitude, Rice-coded); empty = the method's "
        "default", Check(choices=SHARED_VALUES), fallback="sign")
    shared_levels: float | None = setting(
        None, "dgc.shared_levels", "with dgc.shared_values = grid: the mean magnitude at the "
        "shared indices in grid steps (the step is the power of two nearest mean / levels); "
        "larger is finer and costs more bits; empty = the method's default",
        Check(0.0, 128.0, low_open=True), fallback=1.0)
    shared_first: bool | None = setting(
        None, "dgc.shared_first", "dgc: take the shared sets before the top-k, so that the "
        "top-k sends what the sets miss (GlueFL's order) instead of entries the sets carry "
        "anyway; empty = the method's default", fallback=False)
    value_levels: float | None = setting(
        None, "dgc.value_levels", "dgc: send each tensor's values on a power-of-two grid whose "
        "step is the power of two nearest mean(|values|) / value_levels, Rice-coded; the "
        "rounding stays in the residual; 0 = the values in dgc.value_dtype; empty = the "
        "method's default", Check(0.0, 128.0), fallback=0.0)
    residual_decay: float = setting(1.0, "dgc.residual_decay", "aged residuals (dgc): a client's "
                                    "residual is scaled by this per round it was away beyond "
                                    "dgc.residual_after_rounds (CSER, Fed-EF); 1 = keep it all, "
                                    "0 = reset it", Check(0.0, 1.0))
    residual_after_rounds: int = setting(0, "dgc.residual_after_rounds", "rounds away a "
                                         "residual keeps whole before dgc.residual_decay acts",
                                         Check(0))
    step_ahead: float = setting(0.0, "dgc.step_ahead", "step-ahead partial error feedback "
                                "(SA-PEF, dgc): local training starts from the model minus "
                                "this fraction of the client's residual, which leaves the "
                                "residual; 0 = plain error feedback", Check(0.0, 1.0))
    feedback: str = setting("residual", "dgc.feedback", "what a dgc client compresses: "
                            "residual (its pseudo-gradient plus its residual, DGC's error "
                            "feedback), aggregate (its pseudo-gradient less the reference: how "
                            "the model it was sent moved per version since it last trained, "
                            "which the server adds back; no residual kept, CAFe) or "
                            "aggregate+residual (the difference, with a residual) or own "
                            "(its pseudo-gradient less its own shift, what it sent so far: "
                            "EF21, no residual; the server steps on every client's shift, "
                            "FedVARP)", Check(choices=FEEDBACKS))
    # Issue 39's switches (docs/dgc_vs_dense.md, "The last points"); empty = the method's default.
    budget: str | None = setting(
        None, "dgc.budget", "dgc: how the top-k's entries are shared out among the "
        "sparsified tensors: tensor (density, or dgc.small_density, of each), model (the same "
        "total by one top-k of all their residuals, so a tensor's share follows its largest "
        "entries) or energy (the same total in proportion to each residual's squared norm); "
        "empty = the method's default", Check(choices=BUDGETS), fallback="tensor")
    compact_wire: bool | None = setting(
        None, "dgc.compact_wire", "dgc: send replies and their sets' values as compact "
        "messages (tensors by their place in the model, sizes as varints: dgc.wire.compact, "
        "docs/wire.md) instead of update messages; the same sections, a third fewer bytes on "
        "an LSTM's many small tensors; not for phones; empty = the method's default",
        fallback=False)
    server_error: float | None = setting(
        None, "dgc.server_error", "dgc: FetchSGD's server without a sketch: clients keep no "
        "residual (they send their fresh pseudo-gradient's sets and top-k), the server "
        "accumulates its momentum's steps as error and applies this fraction of the model's "
        "entries each round, the largest of its error (momentum and error zeroed there); 0 = "
        "off; empty = the method's default", Check(0.0, 1.0), fallback=0.0)
    clip_norm: float = setting(0.0, "dgc.clip_norm", "local gradient clipping threshold "
                               "(scaled by clients_per_round**-0.5); 0 = off",
                               # DGCConfig's range, plus 0 for off (clip_norm=None there).
                               dataclasses.replace(DGCConfig.check("clip_norm"), low_open=False))
    # The server's: the sign channel and aggregate feedback.
    shared_density: float = setting(0.03, "dgc.shared_density", "shared-index sign channel "
                                    "(dgc only): fraction of each sparsified tensor at which "
                                    "every client of a round sends its residual as scaled signs, "
                                    "1 bit per entry, at indices the server picks; 0 = off",
                                    Check(0.0, 1.0), sent=False)
    shared_small_density: float = setting(0.0, "dgc.shared_small_density", "the same for "
                                          "tensors of at most dgc.small_numel entries; 0 = "
                                          "dgc.shared_density", Check(0.0, 1.0), sent=False)
    shared_momentum: float = setting(0.9, "dgc.shared_momentum", "factor of the moving average "
                                     "of aggregates by which the server ranks shared indices",
                                     momentum_range(), sent=False)
    shared_rank: str | None = setting(
        None, "dgc.shared_rank", "how the server ranks shared indices: aggregates (a moving "
        "average of the applied aggregates, dgc.shared_momentum; the sets travel with the "
        "model) or displacement (how far the model clients hold has moved from version 0, "
        "which clients compute themselves: no index bytes); empty = the method's default",
        Check(choices=SHARED_RANKS), fallback="aggregates", sent=False)
    shared_explore: float | None = setting(
        None, "dgc.shared_explore", "with dgc.shared_rank = displacement: the fraction of each "
        "shared set drawn at random (seeded by the round: both ends draw alike) among the "
        "entries its displacement part, which takes moved entries only, leaves; the first "
        "round then has sets, and where the model moves only at the sets (secure aggregation "
        "holds the top-k back) they still move; empty = 0, or 0.25 under privacy.secagg or "
        "privacy.dp = central",
        Check(0.0, 1.0), sent=False)
    secure_density: float = setting(0.2, "dgc.secure_density", "the shared sets' density "
                                    "under privacy.secagg or privacy.dp = central, which hold "
                                    "the top-k back so that the sets carry all a client sends "
                                    "(docs/privacy.md); 0 = dgc.shared_density",
                                    Check(0.0, 1.0), sent=False)
    shared_churn: float = setting(1.0, "dgc.shared_churn", "the most of each shared index set "
                                  "that may change from one round to the next, the weakest "
                                  "members swapped for the strongest newcomers (GlueFL's "
                                  "bounded mask shift; dgc.shared_rank = aggregates); 1 = "
                                  "unbounded", Check(0.0, 1.0), sent=False)
    feedback_scale: float = setting(0.0, "dgc.feedback_scale", "with dgc.feedback = aggregate: "
                                    "the reference is the sent model's movement per version "
                                    "times this; 0 = (1 - server_momentum) / server_lr, the mean "
                                    "pseudo-gradient that movement stands for",
                                    Check(0.0, 100.0), sent=False)
    feedback_history: int = setting(50, "dgc.feedback_history", "with dgc.feedback = "
                                    "aggregate: the sent models the server keeps (one a "
                                    "version); a client last sent an older one compresses "
                                    "without a reference", Check(1, 100_000), sent=False)

    def __post_init__(self) -> None:
        validate(self)
        if self.server_error and (self.feedback != "residual" or self.residual_decay < 1.0
                                  or self.step_ahead > 0.0):
            raise SettingsError("dgc.server_error keeps the error on the server and no residual "
                                "on clients, which dgc.feedback, dgc.residual_decay and "
                                "dgc.step_ahead act on: leave them at residual, 1 and 0")
        if self.feedback == "own" and (self.residual_decay < 1.0 or self.step_ahead > 0.0):
            raise SettingsError("dgc.feedback = own keeps no residual, which dgc.residual_decay "
                                "and dgc.step_ahead act on: leave them at 1 and 0")
        if self.feedback == "aggregate" and (self.residual_decay < 1.0 or self.step_ahead > 0.0):
            raise SettingsError("dgc.feedback = aggregate keeps no residual, which "
                                "dgc.residual_decay and dgc.step_ahead act on: leave them at 1 "
                                "and 0, or use dgc.feedback = aggregate+residual")


#: DGC's switches (issue 30) that phones do not run, with the value phones run: their exported
#: encoder is the default client's. Not among them (issue 39): ``dgc.shared_rank =
#: displacement`` (a phone derives those sets from the model it holds and its version 0,
#: ``android_bridge.phone.derive_sets``), ``dgc.shared_values = grid`` and ``dgc.value_levels``
#: (host code on the encoder's residual and outputs, :meth:`DGC.phone_values`), and
#: ``dgc.shared_first`` (the sets taken on the host before the encoder's top-k).
PHONE_SWITCHES: dict[str, object] = {
    "residual_decay": 1.0, "step_ahead": 0.0, "feedback": "residual", "budget": "tensor",
    "compact_wire": False, "server_error": 0.0}


def dgc_config(train: TrainSettings, own: DGCSettings) -> DGCConfig:
    """DGC's configuration: :func:`layer_config` with its momentum correction, error feedback
    and local clipping (0 turns it off; scaled by ``clients_per_round**-0.5``)."""
    return layer_config(
        train, own, momentum=own.momentum, momentum_correction=own.momentum_correction,
        nesterov=own.nesterov, dampening=own.dampening,
        momentum_masking=own.momentum_masking, error_feedback=True,
        clip_norm=own.clip_norm or None, num_workers=train.clients_per_round)


class RankRequest(NamedTuple):
    """The material of sets ranked by displacement, as read: per tensor its set's size; the
    client derives the sets from the model it holds (:meth:`DGC.hold_material`)."""

    counts: dict[str, int]
    initial_on_grid: bool
    explore: dict[str, int] | None = None  # per tensor, entries drawn at random
    sequence: int = 0  # the round, which seeds the draw


class RoundCompressor:
    """One client's DGC compressor for a round, with issue 30's client switches around it.

    ``dgc.shared_first`` (with the round's sets): the pseudo-gradient at the sets joins the
    residual there and the sets' part (:meth:`take`) leaves first, so that the top-k finds what
    the sets miss (GlueFL's order); ``dgc.value_levels``: the top-k's values go on a
    power-of-two grid (:func:`dgc.signs.client.on_grid`), the rounding back into the residual.
    Everything else is the wrapped compressor's (:class:`dgc.base.Compressor`).
    """

    def __init__(self, inner: Compressor, own: DGCSettings,
                 masks: Mapping[str, np.ndarray] | None = None,
                 feedback: FeedbackMaterial | None = None) -> None:
        self.inner, self.own, self.masks = inner, own, masks
        # dgc.feedback = aggregate: the round's material with this client's reference, which
        # leaves the pseudo-gradient before anything else (fedgc.methods.feedback).
        self.feedback = feedback
        self.taken: SparseUpdate | None = None  # the sets' part, when taken first
        # dgc.feedback = own: the client's shift h_i (EF21, fedgc.methods.shift), which leaves
        # the pseudo-gradient first and takes in everything sent; None otherwise.
        self.shift: dict[str, torch.Tensor] | None = {} if own.feedback == "own" else None

    def take(self, source: dict[str, torch.Tensor], server_round: int) -> SparseUpdate:
        """The residual at the sets as signs or grid values (``dgc.shared_values``)."""
        if self.own.shared_values == "grid":
            return take_values(source, self.masks, server_round, self.own.shared_levels)
        return take_signs(source, self.masks, server_round)

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> SparseUpdate:
        left = None
        ref = self.shift if self.feedback is None else self.feedback.reference
        if ref:
            grads = {n: g - ref[n].view(g.shape).to(g.device, g.dtype) if n in ref else g
                     for n, g in grads.items()}
        if self.masks is not None and (self.own.shared_first or self.shift is not None):
            # (under dgc.feedback = own the sets always come first: no residual holds them)
            self.taken, grads, left = self._take_first(dict(grads), sequence or 0)
        update = self.inner.compress(grads, epoch, sequence)
        if left is not None and left.tensors:
            self.inner.restore(left)  # a first round's remainder at the sets
        if self.own.value_levels > 0:
            update, error = values_on_grid(update, self.own.value_levels)
            self.inner.restore(error)
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


def shared_explore(own: DGCSettings, sets_only: bool) -> float:
    """The fraction of each displacement-ranked set drawn at random (``dgc.shared_explore``):
    the key's, or by default 0.25 when clients send the sets only (``sets_only``: secure
    aggregation, central DP), where the model moves only at the sets and displacement alone
    would rank the same sets every round, and 0 otherwise (0.25: the best of 0, 0.25, 0.5 and
    1 on digits, docs/privacy.md)."""
    if own.shared_explore is not None:
        return float(own.shared_explore)
    return 0.25 if sets_only else 0.0


class DisplacementSets(Channel):
    """Shared sets ranked by how far the model clients hold has moved from version 0
    (``dgc.shared_rank = displacement``): clients hold both models bit for bit and rank them
    the same way (:func:`dgc.signs.planner.displacement_masks`), so only each set's size
    travels (:func:`dgc.signs.codec.encode_rank_request`, ~20 bytes a tensor)."""

    def __init__(self, counts: Mapping[str, int], numels: Mapping[str, int],
                 explore: Mapping[str, int] | None = None) -> None:
        self.counts, self.numels = dict(counts), dict(numels)
        # Entries of each set drawn at random (dgc.shared_explore); none: displacement alone.
        self.explore = {n: k for n, k in (explore or {}).items() if k > 0}
        self.initial: dict[str, torch.Tensor] = {}
        self.held: Mapping[str, torch.Tensor] = {}
        self.version, self.initial_on_grid = 0, False

    def hold(self, sent_model: Mapping[str, torch.Tensor], version: int,
             initial_on_grid: bool) -> None:
        if version == 0 or not self.initial:
            self.initial = {n: sent_model[n].clone() for n in self.counts}
        self.held, self.version, self.initial_on_grid = sent_model, version, initial_on_grid

    def plan(self, server_round: int) -> tuple[bytes, object] | None:
        if self.version == 0 and not self.explore:  # version 0 has not moved: no set
            return None
        masks = displacement_masks(self.held, self.initial, self.counts, self.explore,
                                   server_round)
        return (encode_rank_request(self.counts, self.numels, server_round,
                                    self.initial_on_grid, self.explore), masks)


class SharedSigns(Channel):
    """The sign channel's server half: each round's shared index sets, from the aggregates seen
    (:class:`dgc.signs.planner.SharedIndexPlanner`), sent Golomb-Rice coded."""

    def __init__(self, planner: SharedIndexPlanner, numels: Mapping[str, int]) -> None:
        self.planner = planner
        self.numels = dict(numels)

    def plan(self, server_round: int) -> tuple[bytes, object] | None:
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


class DGC(RoundMaterial, PhoneExport, Method[DGCSettings]):
    """DGC with error feedback, the sign channel and server momentum (module docstring)."""

    name = "dgc"
    order = 40
    family = "top-k"
    description = ("DGC's top-k of the residual (`dgc.*`), fp16, and the residual at the "
                   "round's shared indices as signs (`dgc.shared_density`)")
    keeps_residual = True
    settings = DGCSettings
    defaults = {"server_momentum": 0.5, **FOLD_BACK_DEFAULTS}

    def check(self, run: RunSettings) -> None:
        if self.own.feedback != "residual" and run.server.downlink == "dense":
            raise SettingsError(f"dgc.feedback = {self.own.feedback} needs downlink = auto: its "
                                f"reference is how the model a client keeps moved, and with "
                                f"downlink = dense clients keep none")

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> Compressor:
        own = self.own
        inner = split_compressor(own, dgc_config(train, own), str(own.budget))
        if isinstance(material, FeedbackMaterial):
            return RoundCompressor(inner, own, material.inner, material)
        if own.value_levels > 0 or material is not None or own.feedback == "own":
            return RoundCompressor(inner, own, material)
        return inner

    def codec(self, train: TrainSettings) -> Codec:
        return SparseCodec(sign_coding=self.own.ternary, grid_coding=self.own.value_levels > 0,
                           compact=bool(self.own.compact_wire))

    # -- phones (their exported encoder is DGC's)
    def phone_config(self, train: TrainSettings) -> DGCConfig:
        return dgc_config(train, self.own)

    def phone_small(self, train: TrainSettings) -> tuple[float, int] | None:
        return small_split(self.own)

    def phone_values(self) -> dict[str, float]:
        """What a phone does on the host around its encoder, in its task's ``values`` entry:
        ``shared_levels`` (``dgc.shared_values = grid``: the residual at the sets as grid
        values, :func:`dgc.signs.client.take_values`), ``levels`` (``dgc.value_levels``: the
        encoder's top-k on a grid, :func:`values_on_grid`) and ``first`` (1 for
        ``dgc.shared_first``: the sets taken before the top-k); {} for the default client."""
        own, out = self.own, {}
        if own.shared_first:  # the sets before the top-k (android_bridge.phone.encoder_round)
            out["first"] = 1.0
        if own.shared_values == "grid":
            out["shared_levels"] = float(own.shared_levels)
        if own.value_levels > 0:
            out["levels"] = float(own.value_levels)
        return out

    def phone_refusals(self) -> list[str]:
        """Issue 30's switches set (:data:`PHONE_SWITCHES`): a phone runs the default client,
        so a run that sets one is refused before phones train otherwise than the simulated
        clients they stand beside."""
        keys = {f.name: f.metadata["key"] for f in fields_of(DGCSettings)}
        return [f"{keys[name]}={getattr(self.own, name)!r}"
                for name, value in PHONE_SWITCHES.items() if getattr(self.own, name) != value]

    # -- the client's start (aged residuals, step-ahead)
    def prepare(self, train: TrainSettings, compressor: Compressor,
                model: dict[str, torch.Tensor], rounds_away: int) -> dict[str, torch.Tensor]:
        own = self.own
        if own.feedback in ("aggregate", "own") or own.server_error > 0:
            # Aggregate feedback without a residual (CAFe): what the top-k leaves of
            # pseudo-gradient - reference is the reference's at the server; the server's error
            # accumulation (dgc.server_error) keeps the error on the server. Either way the
            # residual (and the velocity of momentum correction) starts every round empty.
            compressor.scale_state(0.0)
            return model
        # Aged residuals (CSER, Xie et al. 2020; Fed-EF, Li and Li 2023): a residual built on
        # a model many rounds old is scaled down by dgc.residual_decay per round beyond
        # dgc.residual_after_rounds.
        over = rounds_away - own.residual_after_rounds
        if own.residual_decay < 1.0 and over > 0:
            compressor.scale_state(own.residual_decay ** over)
        if own.step_ahead <= 0:
            return model
        # Step-ahead partial error feedback (SA-PEF, Redie et al. 2026): local training starts
        # at the model less a of the residual; that part leaves the residual, and the
        # pseudo-gradient against the model sent carries it.
        start = dict(model)
        for name, v in compressor.residual().items():
            if name in start and start[name].numel() == v.numel():
                start[name] = model[name] - own.step_ahead * v.view(model[name].shape)
                v.mul_(1.0 - own.step_ahead)
        return start

    # -- the sign channel, client half
    def read_material(self, data: bytes, numels: Mapping[str, int]) -> object:
        if bytes(data[:4]) == MATERIAL_MAGIC:
            sequence, version, oldest, scale, inner = decode_material(data)
            return FeedbackMaterial(sequence, version, oldest, scale,
                                    self.read_material(inner, numels) if inner else None,
                                    inner_bytes=inner)
        if bytes(data[:4]) == RANK_MAGIC:
            sequence, counts, on_grid_, explore = decode_rank_request(data, numels)
            return RankRequest(counts, on_grid_, explore, sequence)
        return decode_mask(data, numels)[1]

    def hold_material(self, data: bytes, material: object, model: Mapping[str, torch.Tensor],
                      initial: Callable[[], dict[str, torch.Tensor]],
                      held: tuple[int, Mapping[str, torch.Tensor]] | None = None,
                      ) -> tuple[bytes, object]:
        if isinstance(material, FeedbackMaterial):
            return self._hold_feedback(material, model, initial, held)
        if not isinstance(material, RankRequest):
            return data, material
        version0 = initial()
        if material.initial_on_grid:
            version0 = round_initial(version0)
        masks = displacement_masks(model, version0, material.counts, material.explore,
                                   material.sequence)
        return encode_mask(masks, {n: model[n].numel() for n in masks}, 0), masks

    def _hold_feedback(self, material: FeedbackMaterial, model: dict[str, torch.Tensor],
                       initial: Callable[[], dict[str, torch.Tensor]],
                       held: tuple[int, Mapping[str, torch.Tensor]] | None,
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

    def side_part(self, compressor: Compressor, material: object,
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
        own = compressor.own
        grid = own.shared_values == "grid"
        return (encode_values(sent, compact=bool(own.compact_wire)) if grid
                else encode_signs(sent)), sent.nnz

    def read_side(self, data: bytes, material: object,
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
    def _sets_channel(self, run: RunSettings, shapes: Mapping[str, tuple[int, ...]],
                      ) -> Channel | None:
        """The shared index sets' channel (None: ``dgc.shared_density`` 0)."""
        own = self.own
        if own.shared_density <= 0:
            return None
        policy = dgc_config(run.train, own)
        sparse = {n: tuple(shape) for n, shape in shapes.items()
                  if not policy.sends_dense(tuple(shape))}
        # Under secure aggregation and central DP the top-k is held back: the sets carry what a
        # client sends.
        sets_only = self.sets_only(run.train)
        density = (own.secure_density if sets_only and own.secure_density > 0
                   else own.shared_density)
        planner = SharedIndexPlanner(sparse, density, own.shared_small_density,
                                     own.small_numel, own.shared_momentum, own.shared_churn)
        numels = {n: math.prod(shape) for n, shape in shapes.items()}
        if own.shared_rank == "displacement":
            counts = {n: planner.count(n) for n in sparse}
            explore = shared_explore(own, sets_only)
            return DisplacementSets(counts, numels,
                                    {n: round(explore * k) for n, k in counts.items()})
        return SharedSigns(planner, numels)

    def aggregator(self, run: RunSettings) -> Aggregator:
        if self.own.feedback == "own":  # the mean of every client's shift (fedgc.methods.shift)
            t = run.train
            return ShiftMemory(min(1.0, t.clients_per_round / t.num_clients))
        return Aggregator()

    def optimizer(self, run: RunSettings) -> ServerOptimizer | None:
        if self.own.server_error > 0:  # FetchSGD's server over the sets (server_error.py)
            s = run.server
            return ErrorAccumulation(s.server_lr, s.server_momentum, self.own.server_error)
        return None

    def channel(self, run: RunSettings, shapes: Mapping[str, tuple[int, ...]]) -> Channel | None:
        inner = self._sets_channel(run, shapes)
        if self.own.feedback in ("residual", "own"):
            return inner
        s, own = run.server, self.own
        scale = own.feedback_scale or (1.0 - float(s.server_momentum)) / float(s.server_lr)
        return FeedbackChannel(inner, scale, own.feedback_history)


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
    shakespeare for 4-7% fewer bytes (docs/dgc_vs_dense.md, "The dead band"). Phones run it
    (issue 39: the reference phone derives the sets, joins the ranked patches and does the
    grids and the sets-first split on the host around dgc's exported encoder; the Android app
    does not yet, docs/android.md), and ``compare`` runs it only when named.
    """

    name = "dgc_sets"
    order = 41
    compared = False
    description = ("DGC's top-k of the residual on a 4-level grid after the residual at shared "
                   "sets clients rank themselves (the model's displacement), sent as grid "
                   "values (`dgc.*` as dgc)")
    defaults = {**DGC.defaults, "dgc.shared_rank": "displacement", "dgc.shared_values": "grid",
                "dgc.shared_levels": 0.5, "dgc.shared_first": True, "dgc.value_levels": 4.0,
                "downlink_vectors": "float16", "downlink_context": True}
    secure_sum = "material"  # the sets' values; under secure aggregation its top-k is held back


register(DGCSets())
