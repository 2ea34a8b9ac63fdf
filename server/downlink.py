"""The downlink: model versions, what changed at each, the compressed broadcast on its float16
or int8 grid or by ternary steps, and the dense model or patch each client is sent.

Clients hold the *sent model*: the global model itself, or, with ``density < 1``, a broadcast
model that follows it by the largest entries of their difference each round (error feedback on
the server, as in DoubleSqueeze, Tang et al. 2019, and STC's downlink, Sattler et al. 2019). Per
entry the downlink keeps the version at which it last changed (``changed_at``), so a patch valid
on every version a client may hold is the set of entries that changed after the oldest of them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import ArrayRecord

import dgc
from dgc import SparseTensor, SparseUpdate
from dgc.int8_grid import grid_exponent, initial_exponents, to_int8_grid
from dgc.ranking import DisplacementOrder
from dgc.selection import num_selected, select_exact, select_stable
from dgc.wire import encoded_size
from dgc.wire.compact import encode_compact
from fedgc import context_patch
from fedgc import protocol as P
from server.checkpoint import CheckpointError

Model = OrderedDict[str, torch.Tensor]

#: The most bytes of past grid values the server keeps for delta patches (``downlink_deltas``);
#: a patch on a version beyond them carries values.
DELTA_HISTORY_BYTES = 256 * 2**20

#: With ``downlink_context``: the versions whose displacement rankings the server keeps for the
#: patches on them (8 bytes an entry each; a client is back within 32 rounds 97% of the time at
#: 10 of 100 a round). A patch on an older version ranks its base whole.
RANKED_VERSIONS = 32


@dataclass
class Offer:
    """What one client is sent: the dense model or a patch on the versions it may hold."""

    kind: str  # "dense" | "patch"
    record: ArrayRecord
    nbytes: int
    base_versions: tuple[int, ...] = ()
    added: list[str] = field(default_factory=list)  # patch tensors that carry differences
    context: list[str] = field(default_factory=list)  # patch tensors sent ranked by displacement


@dataclass
class Patch:
    """A patch's bytes, the tensors whose values are differences to add (``patch_add``) and
    those sent as segments of their ranking by displacement (``patch_context``)."""

    data: bytes
    added: list[str]
    context: list[str] = field(default_factory=list)


def copy_model(model: Mapping[str, torch.Tensor]) -> Model:
    """A deep copy of ``model`` (same order)."""
    return OrderedDict((k, v.clone()) for k, v in model.items())


def float16_grid(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to the nearest float16 values, in float32 (values beyond float16's range
    unrounded)."""
    rounded = t.to(torch.float16).to(torch.float32)
    return torch.where(torch.isfinite(rounded), rounded, t)


def _history_nbytes(changes: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(i.numel() * i.element_size() + v.numel() * v.element_size()
               for i, v in changes.values())


class Downlink:
    """Model versions and what clients are sent; see the strategy's ``downlink*`` parameters
    (:class:`server.strategy.DGCStrategy`) for what each setting means."""

    def __init__(self, mode: str = "auto", history: int = 1, density: float = 1.0,
                 values: str = "float16", deltas: bool = True, deadband: float = 0.5,
                 vectors: str = "float32", context: bool = False,
                 compact: bool = False) -> None:
        self.mode = mode
        self.history = history
        self.density = float(density)
        self.values = values
        self.deltas = deltas
        # int8 grid: an entry moves only when the model is more than this many steps from it
        # (0.5: whenever it rounds to another grid point).
        self.deadband = float(deadband)
        # One-dimensional tensors of the broadcast: copied exactly, or rounded to float16.
        self.vectors = vectors
        # Patches on one base code a grid tensor's changed entries per segment of its ranking
        # by displacement from version 0 where that is smaller (fedgc.context_patch).
        self.context = context
        # Patches as compact messages (dgc.wire.compact: tensors by place, varint sizes).
        self.compact = compact
        self.origin: dict[str, torch.Tensor] = {}  # with context: version 0's grid tensors
        # With context: the sent model's ranking by displacement, moved along with each version
        # (dgc.ranking), and the rankings of the last RANKED_VERSIONS versions, which patches on
        # them are coded by. Derived data: rebuilt on demand after a reset or a resume.
        self.ranking: dict[str, DisplacementOrder] = {}
        self.rankings: OrderedDict[int, dict[str, torch.Tensor]] = OrderedDict()
        self.model: Model | None = None  # the global model, float32
        self.broadcast: Model | None = None  # what clients hold, with density < 1
        self.version = 0  # aggregations applied so far = version of the sent model
        # Per entry of the sent model, the version at which it last changed.
        self.changed_at: dict[str, torch.Tensor] = {}
        # values "int8": per matrix, the exponent e of the broadcast's grid step 2**e (None while
        # the tensor is all zeros: any grid holds it).
        self.grid_exponents: dict[str, int | None] = {}
        # With deltas: per version u, per grid tensor, the entries that changed at u and their
        # values before (what a patch on an older version subtracts). Oldest first.
        self.past: OrderedDict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = OrderedDict()
        self.past_nbytes = 0
        # values "ternary": the version the last step made and, per tensor, its entries and the
        # +-mu added there (what a patch on the version before carries, one bit per entry).
        self.ternary_step: tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None

    # ------------------------------------------------------------------ versions
    def reset(self, model: Model) -> None:
        """Start from ``model`` as version 0."""
        self.model = model
        self.version = 0
        self.broadcast = copy_model(model) if self.density < 1.0 else None
        self.grid_exponents = {}
        if self.density < 1.0 and self.values == "int8":
            self.grid_exponents = initial_exponents(model)
            if self.deltas:
                # Version 0 on the grid too, so that every version differs from every other by
                # multiples of the step (clients that build it round it the same way).
                for k, e in self.grid_exponents.items():
                    if e is not None:
                        self.broadcast[k] = to_int8_grid(model[k], e)
        self._forget_past()
        self.ternary_step = None
        self.changed_at = {k: torch.zeros(v.shape, dtype=torch.int32) for k, v in model.items()}
        self.origin = ({k: self.broadcast[k].clone() for k in self.grid_exponents}
                       if self.context and self.initial_on_grid else {})
        self._forget_rankings()
        if self.origin:
            self._rank({})  # version 0: nothing has moved

    @property
    def sent_model(self) -> Model:
        """The model clients are sent and hold: the broadcast model, or the global model."""
        assert self.model is not None
        return self.broadcast if self.broadcast is not None else self.model

    @property
    def nonzero(self) -> bool:
        """Whether patches may grid-code values none of which is zero without a code for zero
        (value dtype 66, ``nonzero_grid``): with ``downlink_context``. A phone of ``dgc_sets`` gets
        them too (docs/android.md): the reference phone and the Java codec read dtype 66."""
        return bool(self.origin)

    @property
    def initial_on_grid(self) -> bool:
        """Whether version 0 of the broadcast is rounded to the int8 grid (deltas on)."""
        return bool(self.grid_exponents) and self.deltas

    def advance(self, model: Model, heading: Model) -> None:
        """Adopt ``model`` as the next version; the broadcast follows ``heading``."""
        before = self.sent_model
        self.model = model
        if self.broadcast is not None:
            self.broadcast = self.follow(self.broadcast, heading)
        self.version += 1
        changed = {}
        for name, t in self.sent_model.items():
            # bitwise comparison, so a replaced entry reproduces the server's value exactly
            changed[name] = t.view(torch.int32) != before[name].view(torch.int32)
            self.changed_at[name][changed[name]] = self.version
        if self.initial_on_grid:
            self._remember(self.version, changed, before)
        if self.origin:
            self._rank(changed)

    def follow(self, broadcast: Mapping[str, torch.Tensor],
               model: Mapping[str, torch.Tensor]) -> Model:
        """The next broadcast model: ``broadcast`` with its matrix entries that differ most
        from ``model`` rounded to float16 replaced by those rounded values (one-dimensional
        tensors are copied whole, unrounded).

        The rounding halves the value bytes of every patch; what it drops (at most half a
        float16 step) stays in ``model - broadcast`` like any entry not sent, and is sent when
        the model moves on (error feedback on the server). Ranking by the rounded difference
        never spends a slot on an entry whose rounded value the clients already hold. With
        ``values="int8"`` the grid is the tensor's int8 grid instead (a quarter of the float32
        bytes); a tensor whose grid step had to double is copied whole, re-rounded. With
        ``values="ternary"``: :meth:`follow_ternary`.
        """
        if self.values == "ternary":
            return self.follow_ternary(broadcast, model)
        out = copy_model(broadcast)
        matrices = [k for k, v in model.items() if v.dim() > 1]
        for k, v in model.items():
            if v.dim() <= 1:
                # float16: a bias whose float16 value did not move stays out of every patch,
                # and those that did travel in two bytes (the rounding stays in G - B).
                out[k].copy_(float16_grid(v) if self.vectors == "float16" else v)
        if not matrices:
            return out
        if self.grid_exponents:
            target = {}
            for k in matrices:
                before = self.grid_exponents[k]
                e = grid_exponent(model[k], before)
                self.grid_exponents[k] = e
                target[k] = model[k].clone() if e is None else to_int8_grid(model[k], e)
                if before is not None and e != before:
                    out[k].copy_(target[k])  # a coarser grid: every entry moves onto it
        else:
            target = {k: float16_grid(model[k]) for k in matrices}
        if self.grid_exponents and self.deadband > 0.5:
            for k in matrices:
                e = self.grid_exponents[k]
                if e is not None:
                    # Hysteresis: an entry the model hovers around keeps its grid point.
                    near = (model[k] - out[k]).abs() <= self.deadband * 2.0 ** e
                    target[k] = torch.where(near, out[k], target[k])
        diff = torch.cat([(target[k] - out[k]).abs().view(-1) for k in matrices])
        count = min(diff.numel(), math.ceil(self.density * diff.numel()))
        # Ties are broken by position, so the selection is reproducible.
        chosen = select_stable(diff, count)
        chosen = chosen[diff[chosen] > 0]
        start = 0
        for k in matrices:
            n = model[k].numel()
            local = chosen[(chosen >= start) & (chosen < start + n)] - start
            out[k].view(-1)[local] = target[k].view(-1)[local]
            start += n
        return out

    def follow_ternary(self, broadcast: Mapping[str, torch.Tensor],
                       model: Mapping[str, torch.Tensor]) -> Model:
        """STC's downlink step: per tensor (one-dimensional ones too), the ``ceil(density *
        numel)`` entries where ``model - broadcast`` is largest move by ``sign * mu``, ``mu``
        the mean of those differences' magnitudes (float32).

        ``model - broadcast`` is STC's server residual plus the round's update (the server's
        ``A + dW``); what the step does not carry stays in it (error feedback). The step is kept
        (:attr:`ternary_step`): a client on the version before is sent it, one sign bit per
        entry, and adds it; the float32 sum is the same bits on both sides.
        """
        out = copy_model(broadcast)
        step = {}
        for k, v in model.items():
            diff = (v - out[k]).view(-1)
            idx = select_exact(diff.abs(), num_selected(diff.numel(), self.density))
            if not idx.numel():  # the tensor is where the model is: nothing to send
                continue
            chosen = diff[idx]
            mu = chosen.abs().mean(dtype=torch.float64).to(torch.float32)
            delta = torch.where(chosen < 0, -mu, mu)
            flat = out[k].view(-1)
            flat[idx] = flat[idx] + delta
            step[k] = (idx, delta)
        self.ternary_step = (self.version + 1, step)
        return out

    def _ternary_patch(self, base_versions: tuple[int, ...]) -> tuple[bytes, list[str]] | None:
        """The last ternary step as a patch of differences on the version before it (the one
        ``base_versions`` must name), sign-coded; None when it does not apply."""
        if (self.ternary_step is None or self.ternary_step[0] != self.version
                or base_versions != (self.version - 1,)):
            return None
        tensors = {name: SparseTensor(idx, delta, tuple(self.sent_model[name].shape))
                   for name, (idx, delta) in self.ternary_step[1].items()}
        return (dgc.encode(SparseUpdate(tensors, self.version), sign_coding=True),
                list(tensors))

    def _forget_rankings(self) -> None:
        self.ranking = {}
        self.rankings = OrderedDict()

    def _rank(self, changed: Mapping[str, torch.Tensor]) -> None:
        """Move the sent model's rankings by displacement to this version (``changed``: the
        entries that changed, a mask per tensor; a ranking not held yet is built whole) and keep
        them for the patches on it."""
        now = self.sent_model
        for name, origin in self.origin.items():
            if name not in self.ranking:
                self.ranking[name] = DisplacementOrder(now[name], origin)
                continue
            moved = torch.nonzero(changed[name].view(-1)).view(-1)
            self.ranking[name] = self.ranking[name].moved(moved, now[name].view(-1)[moved])
        self.rankings[self.version] = {n: r.keys for n, r in self.ranking.items()}
        while len(self.rankings) > RANKED_VERSIONS:
            self.rankings.popitem(last=False)

    def ranked(self, name: str, version: int, base: torch.Tensor) -> torch.Tensor:
        """The positions of grid tensor ``name`` of ``version`` (``base``, as the client holds
        it) by displacement from version 0, most displaced first: kept from when the version
        was made, else ranked whole (:func:`fedgc.context_patch.rank_order`, the same order)."""
        kept = self.rankings.get(version, {}).get(name)
        if kept is None:
            return context_patch.rank_order(base, self.origin[name])
        return DisplacementOrder.positions(kept)

    def _forget_past(self) -> None:
        self.past = OrderedDict()
        self.past_nbytes = 0

    def _remember(self, version: int, changed: Mapping[str, torch.Tensor],
                  before: Mapping[str, torch.Tensor]) -> None:
        """Keep the grid entries that changed at ``version`` (``changed``: a mask per tensor)
        with their values ``before``."""
        changes = {}
        for name in self.grid_exponents:
            idx = torch.nonzero(changed[name].view(-1)).view(-1)
            if idx.numel():
                changes[name] = (idx, before[name].view(-1)[idx].clone())
        self.past[version] = changes
        self.past_nbytes += _history_nbytes(changes)
        while self.past and (next(iter(self.past)) <= version - self.history
                             or self.past_nbytes > DELTA_HISTORY_BYTES):
            _, dropped = self.past.popitem(last=False)
            self.past_nbytes -= _history_nbytes(dropped)

    def grid_values_at(self, version: int) -> dict[str, torch.Tensor] | None:
        """The grid tensors of the sent model as they were at ``version``, or None when the
        kept history does not reach back to it."""
        if not all(u in self.past for u in range(version + 1, self.version + 1)):
            return None
        out = {name: self.sent_model[name].clone() for name in self.grid_exponents}
        for u in range(self.version, version, -1):  # newest first: the oldest value wins
            for name, (idx, old) in self.past[u].items():
                out[name].view(-1)[idx] = old
        return out

    # ------------------------------------------------------------------ what is sent
    def patch(self, base_versions: tuple[int, ...]) -> tuple[bytes, list[str]] | None:
        """:meth:`coded_patch`'s bytes and added tensors (what a patch without
        ``downlink_context`` is)."""
        coded = self.coded_patch(base_versions)
        return None if coded is None else (coded.data, coded.added)

    def coded_patch(self, base_versions: tuple[int, ...]) -> Patch | None:
        """A patch that turns any of ``base_versions`` into the current sent model, the tensors
        whose patch values are differences to add (``patch_add``) rather than values, and those
        sent ranked by displacement (``patch_context``).

        It carries, with their current values, the entries that changed after the oldest base:
        on each base an entry outside that set already holds the current bits, so replacing the
        set gives the same model whichever base the client holds. None when a base is more
        than ``history`` versions old (or newer than the model). On a single base, with
        ``deltas``, a grid tensor carries ``now - base`` instead where that encodes smaller
        (the differences sit on the grid, and adding them gives ``now`` bit for bit: both are
        checked), and with ``context`` its entries go as segments of the ranking of ``base``'s
        entries by displacement from version 0 where that encodes smaller still
        (:mod:`fedgc.context_patch`). With ternary values, a patch on the version just before
        carries the last step's ``+-mu`` to add (:meth:`follow_ternary`).
        """
        if not base_versions or any(not self.version - self.history <= v <= self.version
                                    for v in base_versions):
            return None
        if (ternary := self._ternary_patch(base_versions)) is not None:
            return Patch(*ternary)
        oldest = min(base_versions)
        base = (self.grid_values_at(oldest)
                if self.initial_on_grid and len(base_versions) == 1 else None)
        tensors: dict[str, SparseTensor] = {}
        added, ranked = [], []
        for name, t in self.sent_model.items():
            idx = torch.nonzero(self.changed_at[name].view(-1) > oldest).view(-1)
            values = t.view(-1)[idx].clone()
            if name in self.grid_exponents:
                # on the tensor's int8 grid: the encoder's grid coding carries them
                delta = None if base is None else self._delta(name, idx, values,
                                                              base[name].view(-1)[idx])
                sent = delta if delta is not None else SparseTensor(idx, values, tuple(t.shape))
                if delta is not None:
                    added.append(name)
                segments = (None if base is None or not self.origin
                            else self._segments(name, sent, oldest, base[name]))
                if segments is not None:
                    tensors.update(segments)
                    ranked.append(name)
                else:
                    tensors[name] = sent
                continue
            if torch.equal((half := values.to(torch.float16)).to(torch.float32), values):
                # Values float16 holds exactly (every matrix entry the compressed broadcast
                # wrote, see follow) travel in half the bytes; the client's float32 copy of
                # them is still bit for bit.
                values = half
            tensors[name] = SparseTensor(idx, values, tuple(t.shape))
        update = SparseUpdate(tensors, self.version)
        if self.compact:
            layout = context_patch.patch_layout(
                {k: tuple(v.shape) for k, v in self.sent_model.items()}, sorted(ranked))
            data = encode_compact(update, layout, grid_coding=bool(self.grid_exponents),
                                  nonzero_grid=self.nonzero)
        else:
            data = dgc.encode(update, grid_coding=bool(self.grid_exponents),
                              nonzero_grid=self.nonzero)
        return Patch(data, added, ranked)

    def _segments(self, name: str, sent: SparseTensor, version: int,
                  base: torch.Tensor) -> dict[str, SparseTensor] | None:
        """``sent`` as segments of the ranking of ``base`` (tensor ``name`` of ``version``) by
        displacement from version 0, when they encode smaller than ``sent`` whole."""
        if not sent.nnz:
            return None
        order = self.ranked(name, version, base)
        segments = context_patch.split(name, sent, order)
        if encoded_size(SparseUpdate(segments), grid_coding=True, nonzero_grid=True) \
                >= encoded_size(SparseUpdate({name: sent}), grid_coding=True, nonzero_grid=True):
            return None
        return segments

    def _delta(self, name: str, idx: torch.Tensor, now: torch.Tensor,
               then: torch.Tensor) -> SparseTensor | None:
        """The entries ``idx`` of grid tensor ``name`` as differences ``now - then`` (those
        that differ), when adding them gives ``now`` bit for bit and they encode smaller."""
        delta = now - then
        keep = delta != 0  # an entry that changed and changed back needs nothing added
        if not torch.equal((then[keep] + delta[keep]).view(torch.int32),
                           now[keep].view(torch.int32)):
            return None
        shape = tuple(self.sent_model[name].shape)
        added = SparseTensor(idx[keep], delta[keep], shape)
        if encoded_size(SparseUpdate({name: added}), grid_coding=True,
                        nonzero_grid=self.nonzero) \
                >= encoded_size(SparseUpdate({name: SparseTensor(idx, now, shape)}),
                                grid_coding=True, nonzero_grid=self.nonzero):
            return None
        return added

    def offers(self, held: Iterable[tuple[int, ...]]) -> dict[tuple[int, ...], Offer]:
        """Per set of versions a client may hold (``()``: none known), what it is sent: a
        patch when one spans them and is smaller than the dense model, else the dense model."""
        dense_record = ArrayRecord(copy_model(self.sent_model))
        dense = Offer("dense", dense_record, P.record_nbytes(dense_record))
        out: dict[tuple[int, ...], Offer] = {}
        for versions in held:
            if versions in out:
                continue
            out[versions] = dense
            if self.mode == "auto" and versions:
                patch = self.coded_patch(versions)
                if patch is not None and len(patch.data) < dense.nbytes:
                    out[versions] = Offer("patch", P.bytes_to_record(patch.data, P.PATCH),
                                          len(patch.data), versions, patch.added, patch.context)
        return out

    def config(self, offer: Offer, initial_versions: list[int]) -> dict[str, Any]:
        """The train config keys that tell a client how to read ``offer``."""
        cfg: dict[str, Any] = {P.DOWNLINK: offer.kind, P.KEEP_MODEL: self.mode == "auto"}
        if offer.kind == "patch":
            cfg[P.BASE_VERSION] = offer.base_versions[-1]
            cfg[P.BASE_VERSIONS] = list(offer.base_versions)
            if offer.added:
                cfg[P.PATCH_ADD] = offer.added
            if offer.context:
                cfg[P.PATCH_CONTEXT] = offer.context
        if self.initial_on_grid and initial_versions:
            cfg[P.INITIAL_GRID] = True
        return cfg

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The downlink's part of the strategy state (flat checkpoint keys)."""
        assert self.model is not None
        return {
            "model": dict(self.model),
            "model_names": list(self.model),
            "model_version": self.version,
            "broadcast": None if self.broadcast is None else dict(self.broadcast),
            "downlink_values": self.values,
            "grid_exponents": dict(self.grid_exponents),
            "downlink_deltas": self.deltas,
            "delta_history": [[u, {n: [i, v] for n, (i, v) in changes.items()}]
                              for u, changes in self.past.items()],
            "changed_at": dict(self.changed_at),
            "ternary_step": None if self.ternary_step is None else [
                self.ternary_step[0],
                {n: [i, d] for n, (i, d) in self.ternary_step[1].items()}],
            # written only with downlink_context, so that other runs' checkpoints stay as they
            # were (the run-config check refuses a resume that changes the key)
            **({"downlink_origin": dict(self.origin)} if self.origin else {}),
        }

    def check_state(self, state: Mapping[str, Any]) -> None:
        """CheckpointError when clients of the checkpointed run hold another model than this
        downlink would send (changes nothing)."""
        broadcast = state.get("broadcast")
        if (broadcast is None) != (self.density == 1.0):
            raise CheckpointError(f"checkpoint was written with downlink_density "
                                  f"{'1' if broadcast is None else '< 1'}, the run has "
                                  f"{self.density:g}: clients hold the other model")
        written = state.get("downlink_values", "float16")
        if broadcast is not None and written != self.values:
            raise CheckpointError(f"checkpoint was written with downlink_values {written}, the "
                                  f"run has {self.values}: clients hold the other grid")
        if (self.context and state.get("grid_exponents") and state.get("downlink_deltas")
                and not state.get("downlink_origin")):
            raise CheckpointError("the run has downlink_context, its checkpoint holds no "
                                  "version 0 to rank patches by (written without it)")
        deltas = bool(state.get("downlink_deltas", False))
        if state.get("grid_exponents") and deltas != self.deltas:
            raise CheckpointError(f"checkpoint was written with downlink_deltas {deltas}, the "
                                  f"run has {self.deltas}: version 0 is "
                                  f"{'' if deltas else 'not '}on the grid there")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (after :meth:`check_state`; migrated by
        ``server.checkpoint``)."""
        names = state["model_names"]
        model, broadcast = state["model"], state.get("broadcast")
        self.model = OrderedDict((k, model[k].to(torch.float32).contiguous()) for k in names)
        self.broadcast = None if broadcast is None else OrderedDict(
            (k, broadcast[k].to(torch.float32).contiguous()) for k in names)
        self.grid_exponents = dict(state.get("grid_exponents", {}))
        self._forget_past()
        for u, changes in state.get("delta_history", []):
            self.past[int(u)] = {n: (i.to(torch.int64), v.to(torch.float32))
                                 for n, (i, v) in changes.items()}
            self.past_nbytes += _history_nbytes(self.past[int(u)])
        step = state.get("ternary_step")
        self.ternary_step = None if step is None else (
            int(step[0]), {n: (i.to(torch.int64), d.to(torch.float32))
                           for n, (i, d) in step[1].items()})
        self.version = int(state["model_version"])
        self.changed_at = {k: state["changed_at"][k].to(torch.int32).contiguous() for k in names}
        origin = state.get("downlink_origin") or {}
        self.origin = ({k: v.to(torch.float32).contiguous() for k, v in origin.items()}
                       if self.context else {})
        self._forget_rankings()
