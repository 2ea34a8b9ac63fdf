"""The Method contract's core: one object per compression method, asked by both ends of a round.

GRACE (Xu et al., 2021) puts ``compress``, ``decompress`` and ``aggregate`` on one object per
method, beside a ``Memory`` (the residual) and a ``Communicator`` (who sends what);
pfl-research pairs ``postprocess_one_user`` (the client) with ``postprocess_server``. A
:class:`Method` is both halves. The server, the client, the phone bridge, the command line and
the plots ask it; nothing outside :mod:`fedgc.methods` compares method names.

The core is four hooks and the method's keys: its **compressor** (the client's, with its
residual, and what it folds back of an update the server never aggregated: **unaggregated**),
its **codec** (the payload on the wire), its **aggregator** (the server's step from
the combined payloads to the aggregate) and its **defaults** and own keys (``settings``). Two
rarer parts are opt-in, each a class to inherit beside :class:`Method`: round material sent
beside the model (:class:`fedgc.methods.material.RoundMaterial`: DGC's shared index sets, TCS's
mask, PowerSGD's matrix) and export to phones (:class:`fedgc.methods.phone.PhoneExport`).

One round, as a method sees it (hooks in bold; *material* is the opt-in part's)::

    server  configure_train   the downlink (**downlink**) moves the model clients hold;
                              *channel.plan(r)*: the round's material, beside the model
    client  train             **compressor**(train, key, *material*) (None: dense fp32);
                              an update the server did not aggregate (its ack_sequence):
                              **unaggregated**(train, age, ...) of it folded back
                              payload = compressor.compress(global - local)
                              reply = **codec**(train).encode(payload) + *side_part*
    server  aggregate_train   payloads = codec.decode_many(...), codec.check(...)
                              defences (server/defences.py) bound each payload's weight, norm
                              combine (server/aggregation.py): weighted mean, or a robust
                              statistic, of the payloads' parts() in **aggregator**.space()
                              aggregate = aggregator.finish(combined)
                              the server optimizer steps (**optimizer**: server_lr,
                              server_momentum); *channel.observe(aggregate)*

Settings, typed: the client half's hooks are given the keys every train message carries
(:class:`fedgc.keys.TrainSettings`: ``train.density``, ``train.seed``, ...), the server half's
the run's (:class:`fedgc.keys.RunSettings`: ``run.server.server_lr``, ...), and every hook
reads the method's own keys as ``self.own`` (an instance of its ``settings`` schema, parsed by
:meth:`Method.with_keys`). ``defaults`` gives its own defaults for the keys declared with
``fallback`` (``server_momentum``, ``density``, its own keys' too).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from dgc import Compressor
from fedgc.keys import FlatValue, RunSettings, TrainSettings
from fedgc.methods.optimizer import ServerOptimizer
from fedgc.methods.payloads import Codec, SparseCodec
from fedgc.methods.unaggregated import folded_share
from fedgc.schema import fields_of, fill_fallbacks, parse, validate

__all__ = ["Aggregator", "DownlinkPolicy", "Method"]

#: The type of a method's own keys (its ``settings`` schema; None without one).
S = TypeVar("S")


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


@functools.lru_cache(maxsize=32)
def _configured(method: Method[S], given: tuple[tuple[str, str, object], ...]) -> Method[S]:
    """``method`` configured with the keys of ``given`` (key, type name, value)."""
    return method._configure({k: v for k, _, v in given})


class Method(Generic[S]):
    """One compression method: its client half, its payload, its server half, its keys.

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
        Phones run it (set by :class:`fedgc.methods.phone.PhoneExport`).
    phone_needs : str
        Without :class:`fedgc.methods.phone.PhoneExport`: what phones would need to run it that
        the phone path lacks, one phrase ("" names no part: a method declares none); ``export``
        and the bridge refuse it with this (:func:`fedgc.methods.phone.phone_refusal`).
    baseline : bool
        Its clients send every entry in float32: the baseline of every compression ratio.
    order : int
        Where ``compare`` runs it among the registered methods (then by name).
    compared : bool
        ``compare`` runs it when no ``--methods`` are given (the demo's table).
    family : str
        The family plots draw in one colour, its methods told apart by line style, and tables
        list together ("dense", "top-k", "quantization", ...); "" (default): a family of its own.
    settings : type or None
        The schema of its own keys (a frozen dataclass of ``fedgc.schema.setting`` fields,
        dotted under its prefix: ``strom.tau``); sent to clients with every train message,
        but those declared ``sent=False`` (its server half's alone).
    defaults : mapping
        Its own defaults for keys declared with ``fallback`` (``server_momentum``...).
    secure_sum : str
        Where its payload sums at coordinates every client knows, for secure aggregation:
        "all", "seed" or "material" (:mod:`fedgc.privacy.linear`); "" (default): it does not.
    """

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    description: ClassVar[str] = ""
    keeps_residual: ClassVar[bool] = False
    phone: ClassVar[bool] = False
    phone_needs: ClassVar[str] = ""
    baseline: ClassVar[bool] = False
    order: ClassVar[int] = 100
    compared: ClassVar[bool] = True
    family: ClassVar[str] = ""
    settings: ClassVar[type | None] = None
    defaults: ClassVar[Mapping[str, FlatValue]] = {}
    secure_sum: ClassVar[str] = ""

    _own: S | None = None

    @property
    def own(self) -> S:
        """Its own keys (an instance of ``settings``, parsed by :meth:`with_keys`; their
        defaults before), None without ``settings``."""
        if self._own is None and self.settings is not None:
            self._own = fill_fallbacks(self.settings(), self.defaults)[0]
        return self._own  # type: ignore[return-value]

    @property
    def title(self) -> str:
        """``label``, or ``name`` without one."""
        return self.label or self.name

    def with_keys(self, values: Mapping[str, object]) -> Method[S]:
        """This method configured with its own keys, read from ``values`` (other keys are
        ignored; missing ones take their defaults, those declared with ``fallback`` this
        method's)."""
        if self.settings is None:
            return self
        mine = {f.metadata["key"] for f in fields_of(self.settings)}
        # Every train message of a run carries the same keys: configure once per process. The
        # key holds each value's type too, since 1, 1.0 and True are equal but parse apart.
        given = tuple(sorted((k, type(v).__name__, v) for k, v in values.items() if k in mine))
        try:
            return _configured(self, given)
        except TypeError:  # an unhashable value (a list): its check refuses it, uncached
            return _configured.__wrapped__(self, given)

    def _configure(self, values: Mapping[str, object]) -> Method[S]:
        """A copy of this method with its own keys parsed from ``values`` (its keys only)."""
        configured = copy.copy(self)
        parsed = parse(self.settings, values, strict=False)  # type: ignore[arg-type]
        validate(parsed)  # a method's schema need not check itself
        configured._own = fill_fallbacks(parsed, self.defaults)[0]
        return configured

    def check(self, run: RunSettings) -> None:
        """Refuse, with a :class:`fedgc.schema.SettingsError` naming them, keys of ``run``
        this method cannot run together (its own with the server's); nothing here."""

    # ------------------------------------------------------------------ client half
    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> Compressor | None:
        """A fresh compressor for one client's round (its state is loaded after), or None:
        the client sends its pseudo-gradient whole, in float32. ``material``: the round's
        material, decoded (a :class:`fedgc.methods.material.RoundMaterial` method's; None
        when the server sent none)."""
        return None

    def unaggregated(self, train: TrainSettings, age: int, folded_norm: float,
                     residual_norm: float) -> float:
        """The share, in [0, 1], of an update the server never aggregated that a client folds
        back into its residual (``keeps_residual`` methods; the server's ``ack_sequence`` tells
        the client). ``age``: rounds (under async, applied steps) since the update was computed
        (>= 1); ``folded_norm``: its L2 norm in the residual's space; ``residual_norm``: the
        residual's it joins. The
        run's ``unaggregated`` keys decide here (:mod:`fedgc.methods.unaggregated`: keep,
        decay by age, cap, discard), with this method's ``defaults`` for them."""
        # The keys are filled (fill_fallbacks with this method's defaults) before a hook runs.
        decay, cap = train.unaggregated_decay, train.unaggregated_cap
        return folded_share(str(train.unaggregated), float(decay),  # type: ignore[arg-type]
                            float(cap), age, folded_norm, residual_norm)  # type: ignore[arg-type]

    def codec(self, train: TrainSettings) -> Codec:
        """The payload codec (both ends)."""
        return SparseCodec()

    def uplink_density(self, train: TrainSettings) -> float:
        """The fraction of entries a client sends after warm-up (``summary.json``'s
        ``density``)."""
        return float(train.density)  # type: ignore[arg-type]

    def sets_only(self, train: TrainSettings) -> bool:
        """Whether a client of this method sends the round material's sets only, its per-client
        entries (a top-k) held back into its residual (both ends): under secure aggregation,
        which cannot sum per-client indices, and under central DP, where per-client indices
        would need the noise at every coordinate of the model while the sets need it at theirs
        only (docs/privacy.md, "dgc_sets under central DP"). A ``material`` method with its
        own aggregate feedback (``dgc.feedback``) keeps its top-k under central DP."""
        if self.secure_sum != "material":
            return False
        if train.privacy_secagg:
            return True
        return (train.privacy_dp == "central"
                and getattr(self.own, "feedback", "residual") == "residual")

    # ------------------------------------------------------------------ server half
    def aggregator(self, run: RunSettings) -> Aggregator:
        """The server's aggregate step (the identity on the weighted mean by default)."""
        return Aggregator()

    def optimizer(self, run: RunSettings) -> ServerOptimizer | None:
        """The server optimizer (:class:`fedgc.methods.optimizer.ServerOptimizer`); None: the
        default one, momentum SGD with ``server_lr`` and ``server_momentum``."""
        return None

    def downlink(self, run: RunSettings) -> DownlinkPolicy:
        """What clients are sent: ``downlink_density`` and ``downlink_values``."""
        s = run.server
        return DownlinkPolicy(s.downlink_density, s.downlink_values)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"<method {self.name!r}>"
