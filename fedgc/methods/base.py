"""The Method contract: one object per compression method, asked by both ends of a round.

GRACE (Xu et al., 2021) puts ``compress``, ``decompress`` and ``aggregate`` on one object per
method, beside a ``Memory`` (the residual) and a ``Communicator`` (who sends what);
pfl-research pairs ``postprocess_one_user`` (the client) with ``postprocess_server``. A
:class:`Method` is both halves. The server, the client, the phone bridge, the command line and
the plots ask it; nothing outside :mod:`fedgc.methods` compares method names.

One round, as a method sees it (``Method`` hooks in bold)::

    server  configure_train   channel = **channel**(config, shapes); bytes = channel.plan(r)
                              (round material, sent beside the model to every sampled client)
    client  train             material = **read_material**(bytes, numels)
                              compressor = **compressor**(train, key, material)
                              (None: dense fp32)
                              payload = compressor.compress(global - local)
                              reply = **codec**(train).encode(payload)
                                      + **side_part**(compressor, material, r)
    server  aggregate_train   payload = codec.decode_many(...), codec.check(...),
                              + **read_side**(side bytes, material, shapes)
                              defences (server/defences.py) bound each payload's weight, norm
                              combine (server/aggregation.py): weighted mean, or a robust
                              statistic, of the payloads' parts() in **aggregator**.space()
                              aggregate = aggregator.finish(combined)
                              the server optimizer steps (server_lr, server_momentum)
                              the downlink (**downlink**) moves the model clients hold
                              channel.observe(aggregate)

A method's residual (error feedback) lives in its compressor (``dgc.base.Compressor``); with
``keeps_residual`` the server's acknowledgements tell the client which update it aggregated
and the client folds back one that was not (``client/state.py``).

Settings: a method reads the run's keys (``fedgc.settings``) and may declare keys of its own
(``settings``: a schema of :func:`fedgc.schema.setting` fields under its ``prefix``, parsed into
``own`` by :meth:`with_keys`); ``defaults`` gives its own defaults for the shared keys that
allow one (``server_momentum``, ``density``, ...: those declared with ``fallback``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from dgc import Compressor, DGCConfig, SparseUpdate
from fedgc.methods.payloads import Bound, Codec, SparseCodec
from fedgc.schema import fields_of, parse, validate

__all__ = ["Aggregator", "Channel", "DownlinkPolicy", "Method"]


@dataclass(frozen=True)
class DownlinkPolicy:
    """What clients are sent of the global model.

    ``density`` 1: the model itself; below 1, a broadcast that follows it by that fraction of
    the matrix entries each round, rounded to ``values`` ("float16", "int8", or "ternary":
    sign * mean steps), with error feedback on the server (``server/downlink.py``).
    """

    density: float = 1.0
    values: str = "float16"


class Aggregator:
    """The server half's own step: from the round's combined payloads to the aggregate.

    The combine stage (``server/aggregation.py``: the weighted mean, or a robust statistic,
    after the defences' weight caps and norm clips) sums the payloads' parts in the space
    :meth:`space` names; :meth:`finish` turns that into the model-space aggregate the server
    optimizer steps on. The default is the identity in the model's space (FedAvg). A method
    whose combine is not a mean of model entries overrides both (a sketch's cells, low-rank
    factors; a majority vote's ``finish`` takes signs), and keeps what it needs across rounds
    in :meth:`state_dict`, which the checkpoint stores.
    """

    #: Whether the combine weighs each payload by its client's (capped) weight, as FedAvg; False:
    #: every client counts once (a majority vote).
    weighted: bool = True

    def space(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The shapes of the space the payloads' parts live in (the model's by default)."""
        return dict(shapes)

    def finish(self, combined: Mapping[str, torch.Tensor],
               shapes: Mapping[str, tuple[int, ...]]) -> Mapping[str, torch.Tensor]:
        """The model-space aggregate of the round's ``combined`` parts (``shapes``: the
        model's); None-free, finite or not (the optimizer refuses a non-finite step)."""
        return combined

    def state_dict(self) -> dict[str, Any]:
        """What this aggregator keeps across rounds (plain data and tensors)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""


class Channel:
    """The server half of a method's round material: what every sampled client of a round is
    sent beside the model (DGC's shared index sets; a shared matrix, a mask, a seed), and what
    the server learns from each round's aggregate to plan the next.

    The client half is :meth:`Method.read_material`, :meth:`Method.side_part` and
    :meth:`Method.read_side` (the reply's part that answers the material).
    """

    def hold(self, sent_model: Mapping[str, torch.Tensor], version: int,
             initial_on_grid: bool) -> None:
        """The model sampled clients hold (version 0 from ``set_model``, also before a resume,
        then each round's before :meth:`plan`; ``initial_on_grid``: version 0 has its matrices
        on the int8 grid, ``dgc.int8_grid.round_initial``). For a channel whose material
        clients derive from the model they hold (DGC's sets ranked by displacement); does
        nothing here."""

    def plan(self, server_round: int) -> tuple[bytes, Any] | None:
        """This round's material: its bytes (sent) and its decoded form (what replies are
        checked against, :attr:`Bound.material`); None: nothing this round."""
        return None

    def observe(self, aggregate: Mapping[str, torch.Tensor]) -> None:
        """The round's applied aggregate (model space)."""

    def state_dict(self) -> dict[str, Any] | None:
        """What the channel keeps across rounds, for the checkpoint."""
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`."""


class Method:
    """One compression method: its client half, its payload, its server half, its settings.

    Subclass it and override what differs from dense FedAvg (every hook has FedAvg's
    behaviour here); register it (:func:`fedgc.methods.register`) or name a callable that
    returns it (``method = "pkg.module:callable"``). ``docs/methods.md`` walks through one.

    Class attributes
    ----------------
    name : str
        The registry's name (the ``method`` key's value).
    label : str
        How tables and plots name it (default: ``name``).
    description : str
        One line for the methods table of ``docs/methods.md``.
    keeps_residual : bool
        The compressor keeps a residual the server's acknowledgements keep whole.
    phone : bool
        Phones run it (their exported encoder is DGC's, :meth:`phone_config`).
    baseline : bool
        Its clients send every entry in float32: the baseline of every compression ratio.
    order : int
        Where ``compare`` runs it among the registered methods (then by name).
    compared : bool
        ``compare`` runs it when no ``--methods`` are given (the demo's table).
    family : str
        The family plots draw in one colour, its methods told apart by line style, and tables
        list together ("dense", "top-k", "quantization", ...); "" (default): a family of its own.
    prefix : str
        The prefix of its own keys (``dgc``: ``dgc.*``).
    settings : type or None
        The schema of its own keys (a frozen dataclass of ``fedgc.schema.setting`` fields).
    defaults : mapping
        Its own defaults for shared keys declared with ``fallback`` (``server_momentum``...).
    secure_sum : str
        Where its payload sums at coordinates every client knows, for secure aggregation:
        "all", "seed" or "material" (:mod:`fedgc.privacy.linear`); "" (default): it does not.
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    description: ClassVar[str] = ""
    keeps_residual: ClassVar[bool] = False
    phone: ClassVar[bool] = False
    baseline: ClassVar[bool] = False
    order: ClassVar[int] = 100
    compared: ClassVar[bool] = True
    family: ClassVar[str] = ""
    prefix: ClassVar[str] = ""
    settings: ClassVar[type | None] = None
    defaults: ClassVar[Mapping[str, Any]] = {}
    secure_sum: ClassVar[str] = ""

    _own: Any = None

    @property
    def own(self) -> Any:
        """Its own keys (an instance of ``settings``, parsed by :meth:`with_keys`; their
        defaults before), None without ``settings``."""
        if self._own is None and self.settings is not None:
            self._own = self.settings()
        return self._own

    @property
    def title(self) -> str:
        """``label``, or ``name`` without one."""
        return self.label or self.name

    def with_keys(self, values: Mapping[str, object]) -> Method:
        """This method configured with its own keys, read from ``values`` (other keys are
        ignored; missing ones take their defaults)."""
        if self.settings is None:
            return self
        mine = {f.metadata["key"] for f in fields_of(self.settings)}
        configured = copy.copy(self)
        configured._own = parse(self.settings, {k: v for k, v in values.items() if k in mine},
                                strict=False)
        validate(configured._own)
        return configured

    # ------------------------------------------------------------------ client half
    def compressor(self, train: Any, client_key: int, material: Any = None) -> Compressor | None:
        """A fresh compressor for one client's round (its state is loaded after), or None:
        the client sends its pseudo-gradient whole, in float32. ``material``: the round's
        material, decoded (:meth:`read_material`; a shared matrix its payload projects on, a
        mask it sends values at), None when the server sent none."""
        return None

    def codec(self, train: Any) -> Codec:
        """The payload codec (both ends)."""
        return SparseCodec()

    def read_material(self, data: bytes, numels: Mapping[str, int]) -> Any:
        """The round material of a train message, decoded (a DecodeError or ValueError for
        bytes that do not decode)."""
        raise ValueError(f"method {self.name!r} sends no round material")

    def hold_material(self, data: bytes, material: Any, model: Mapping[str, torch.Tensor],
                      initial: Any, held: tuple[int, Mapping[str, torch.Tensor]] | None = None,
                      ) -> tuple[bytes, Any]:
        """The round material once the client holds the round's ``model`` (``initial()``
        builds version 0 from the run's seed; ``held``: the version and the model the client
        kept from its last round, None without one): as read, here. A method whose material
        clients derive from the models (DGC's sets ranked by displacement, ``dgc.shared_rank``;
        its aggregate feedback's reference, ``dgc.feedback``) returns it derived, with bytes
        that :meth:`read_material` reads back to the same up to what only this client holds
        (kept to fold the side part back, :meth:`pending_parts`)."""
        return data, material

    def prepare(self, train: Any, compressor: Compressor, model: dict[str, torch.Tensor],
                rounds_away: int) -> dict[str, torch.Tensor]:
        """Before local training, with the client's state loaded (and an update the server did
        not aggregate folded back): the model local training starts from (here ``model``, the
        one sent). ``rounds_away``: rounds since this client's last update, less one (0 for a
        client sampled in consecutive rounds; -1 for none). A method may act on the residual
        (DGC's aged residuals and step-ahead, ``dgc.residual_decay``, ``dgc.step_ahead``); the
        pseudo-gradient is taken against the model sent either way."""
        return model

    def side_part(self, compressor: Compressor, material: Any,
                  server_round: int) -> tuple[bytes, int] | None:
        """The reply's part that answers the round material, and the entries it carries
        (taken from the compressor's residual); None: none."""
        return None

    def read_side(self, data: bytes, material: Any,
                  shapes: Mapping[str, tuple[int, ...]]) -> SparseUpdate:
        """A reply's side part as a sparse update of the model (both ends: the server
        aggregates it, a client restores it); DecodeError or ValueError when it is bad."""
        raise ValueError(f"method {self.name!r} takes no side part")

    def pending_parts(self, train: Any, pending: bytes, side: bytes | None,
                      material: bytes | None, shapes: Mapping[str, tuple[int, ...]],
                      ) -> tuple[int, list[SparseUpdate]]:
        """(sequence, sparse updates) of what a client sent and stored (``pending``; with the
        round's material, ``material``, the bytes the server sent, which the payload and the
        side part answered): what it folds back when the server did not aggregate it. The
        client's own bytes: bounded by the model's sizes."""
        numels = {n: int(np.prod(s)) for n, s in shapes.items()}
        answered = None if material is None else self.read_material(material, numels)
        payload = self.codec(train).decode(pending, Bound(shapes, material=answered))
        parts = payload.parts()
        if side is not None and answered is not None:
            parts.append(self.read_side(side, answered, {n: (numels[n],) for n in numels}))
        return payload.sequence, parts

    def uplink_density(self, train: Any) -> float:
        """The fraction of entries a client sends after warm-up (``summary.json``'s
        ``density``)."""
        return float(train.density)

    def phone_config(self, train: Any) -> DGCConfig | None:
        """The DGC configuration a phone's exported encoder runs for this method (``phone``
        methods only); None: phones do not serve it."""
        return None

    def phone_small(self, train: Any) -> tuple[float, int] | None:
        """The density a phone sends its small sparsified tensors at and the size, in entries,
        up to which a tensor is small (as :class:`dgc.TwoDensityCompressor` does in this
        method's compressor); None: every tensor at the config's density."""
        return None

    # ------------------------------------------------------------------ server half
    def channel(self, config: Any, shapes: Mapping[str, tuple[int, ...]]) -> Channel | None:
        """The server half of the round material for a model of ``shapes``; None: none."""
        return None

    def aggregator(self, config: Any) -> Aggregator:
        """The server's aggregate step (the identity on the weighted mean by default)."""
        return Aggregator()

    def optimizer(self, config: Any) -> Any | None:
        """The server optimizer: an object with ``server.optimizer.ServerOptimizer``'s
        ``step``, ``heading``, ``state_dict`` and ``load_state_dict``; None: that one, momentum
        SGD with ``server_lr`` and ``server_momentum``."""
        return None

    def downlink(self, config: Any) -> DownlinkPolicy:
        """What clients are sent: ``downlink_density`` and ``downlink_values``."""
        s = config.server
        return DownlinkPolicy(s.downlink_density, s.downlink_values)

    def __repr__(self) -> str:
        return f"<method {self.name!r}>"
