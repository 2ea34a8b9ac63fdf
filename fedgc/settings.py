"""The run's keys combined: every owner's keys and the run's method's own, checked together.

Each part of fedgc declares its keys with the settings engine (:mod:`fedgc.schema`), once, in
its own place: the run, the client, the server, the simulation engine and the attack in
:mod:`fedgc.keys` (which imports no method, so that the methods' hooks are typed with its
classes); each compression method its own, with its method (:attr:`fedgc.methods.Method.settings`:
``dgc.*`` in ``fedgc/methods/dgc.py``, the sparsifiers' shared ones in
``fedgc/methods/sparsifier.py``); the network emulator its ``netem.*`` keys
(``simulations.netem.settings.NetemSettings``). This module is where they meet the method
registry: :class:`RunConfig` parses a run's flat keys, gives the keys a method may set its own
default for (``server_lr``, ``server_momentum``, ``density``, ``downlink_density``,
``downlink_values``, a method's own such keys) the run's method's, fills the aggregation and
attack keys left empty, and asks the method whether its keys go together with the server's.

Keys are flat and dotted, so one dict serves a Flower run config (``[tool.flwr.app.config]``,
``flwr run --run-config``), a TOML file (``[dgc]`` tables flatten) and ``--set key=value``. A
method's own keys travel with its runs only (a method added to the registry changes no other
method's run, its messages or its ``summary.json``); one set for a comparison applies to all.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fedgc import methods
from fedgc.keys import FlatValue, RunSettings, ServerSettings, TrainSettings
from fedgc.keys.attack import (
    ATTACK_MARGIN,
    ATTACKS,
    UNBOUNDED_ATTACK,
    attack_bounds,
    parse_attack_clients,
)
from fedgc.keys.run import MODEL_NAMES, PARTITIONS, TASKS, TaskSpec
from fedgc.keys.server import (
    AGGREGATIONS,
    DOWNLINK_VALUES,
    DOWNLINKS,
    ROBUST_MODES,
    ROBUST_PROFILES,
    parse_client_nodes,
)
from fedgc.keys.sim import DEVICES, ENGINES
from fedgc.refs import REF as TASK_REF
from fedgc.refs import is_ref
from fedgc.schema import (
    MAX_CONFIG_BYTES,
    OPTION_KEYS,
    Check,
    KeyInfo,
    SettingsError,
    coerce,
    describe,
    fields_of,
    fill_fallbacks,
    flatten,
    fold_options,
    is_sent,
    known_keys,
    load_toml,
    options_of,
    options_text,
    parse,
    setting,
    to_flat,
    unknown_keys,
    validate,
)
from fedgc.schema import key_table as _key_table

#: The parts of fedgc that own keys, besides the methods' (each its keys' prefix: ``dgc``).
PARTS = ("run", "client", "server", "sim", "netem", "attack")
#: Keys retired in favour of one key for every method (issue 29): the old name is refused,
#: naming the new one.
RENAMED = {"dgc.density": "density", "stc.density": "density",
           "dgc.server_lr": "server_lr", "dgc.server_momentum": "server_momentum",
           "stc.downlink_density": "downlink_density"}

__all__ = ["AGGREGATIONS", "ATTACKS", "ATTACK_MARGIN", "DEVICES", "DOWNLINKS", "DOWNLINK_VALUES",
           "ENGINES", "MAX_CONFIG_BYTES", "MODEL_NAMES", "OPTION_KEYS", "PARTITIONS", "PARTS",
           "RENAMED", "ROBUST_MODES", "ROBUST_PROFILES", "TASKS", "TASK_REF", "UNBOUNDED_ATTACK",
           "Check", "KeyInfo", "RunConfig", "RunSettings", "ServerSettings", "SettingsError",
           "TaskSpec", "TrainSettings", "coerce", "describe", "fields_of", "flatten",
           "fold_options", "key_table", "known_keys", "load_toml", "method_default",
           "method_key_classes", "new_run_name", "options_of", "options_text", "parse",
           "parse_attack_clients", "parse_client_nodes", "setting", "to_flat", "unknown_keys",
           "validate"]

T = TypeVar("T", TrainSettings, ServerSettings)


def method_default(key: str, fallback: Any) -> str:
    """How the ``keys`` table writes a per-method key's default: the registered methods that
    set their own, then the others'."""
    own = [f"{m.name} {m.defaults[key]!r}" for m in methods.registered() if key in m.defaults]
    return f"{fallback!r}; " + ", ".join(own) if own else repr(fallback)


def method_key_classes(these: Iterable[methods.Method] | None = None) -> list[type]:
    """The schemas of the methods' own keys (of ``these``, by default every loaded method's),
    each once: methods that share keys share their class (the sparsifiers')."""
    out: list[type] = []
    for m in methods.loaded() if these is None else these:
        if m.settings is not None and m.settings not in out:
            out.append(m.settings)
    return out


def _methods_named(accepted: str, key: str) -> str:
    """The ``method`` key's range with the registered methods named (its declaration cannot
    name them: :mod:`fedgc.keys` imports no method)."""
    if key != "method":
        return accepted
    return f"one of {list(methods.names())}, or 'module:callable'"


def key_table(classes: list[type]) -> list[KeyInfo]:
    """Every key of ``classes`` with its part (:data:`PARTS` and the methods' prefixes)."""
    prefixes = {f.metadata["key"].partition(".")[0] for cls in method_key_classes()
                for f in fields_of(cls)}
    rows = _key_table(classes, PARTS + tuple(sorted(prefixes)), method_default)
    return [r._replace(accepted=_methods_named(r.accepted, r.key)) for r in rows]


def _by_method(obj: T, values: Mapping[str, Any]) -> T:
    """``obj`` with the fields named by key in ``values`` replaced, named in ``by_method`` (so
    that ``with_overrides`` fills them again)."""
    if not values:
        return obj
    names = {f.metadata["key"]: f.name for f in fields_of(type(obj))}
    out = dataclasses.replace(obj, **{names[k]: v for k, v in values.items()})
    object.__setattr__(out, "by_method", frozenset(values) | obj.by_method)
    return out


def _for_method(obj: T, method: methods.Method) -> T:
    """``obj`` with its per-method keys that are still None set to ``method``'s defaults."""
    out, named = fill_fallbacks(obj, method.defaults)
    if named:
        object.__setattr__(out, "by_method", named | obj.by_method)
    return out


@dataclass(frozen=True)
class RunConfig(RunSettings):
    """The whole configuration of a run, combined and checked: ``server`` keys, the clients'
    ``train`` keys, and the methods' ``own`` keys.

    Parameters
    ----------
    server : ServerSettings
        The run's folder and rounds, the server's and the engine's keys.
    train : TrainSettings
        Task, partition, local training and density; sent to every client.
    own : mapping of str to value
        The own keys (:attr:`fedgc.methods.Method.settings`) of the run's method, and another
        method's given at a value other than its default; sent to every client too, but those
        only the server reads. (Not every registered method's: a method added to the registry
        changes no other method's run, its messages or its ``summary.json``.)
    """

    #: The run's method's own keys that took its default (see TrainSettings.by_method).
    own_by_method: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        t = self.train
        outside = [k for k in parse_client_nodes(self.server.client_nodes) if k >= t.num_clients]
        if outside:
            raise SettingsError(f"client_nodes binds client keys {outside[:5]} outside [0, "
                                f"{t.num_clients}) (num_clients = {t.num_clients})")
        if not methods.is_known(t.method):
            raise SettingsError(f"method = {t.method!r} is outside the accepted range "
                                f"{_methods_named('', 'method')}")
        method = methods.get(t.method)
        server = _for_method(self.server, method)
        server = _by_method(server, server.robust_defaults())
        train = _for_method(t, method)
        bounds = attack_bounds(train, float(server.max_norm_ratio or 0.0),
                               float(server.max_weight_ratio or 0.0))
        train = _by_method(train, bounds)
        object.__setattr__(self, "server", server)
        object.__setattr__(self, "train", train)
        self._combine_own(method)
        t = self.train
        hostile = parse_attack_clients(t.attack_clients)
        outside = sorted(k for k in hostile if k >= t.num_clients)
        if outside:
            raise SettingsError(f"attack.clients names client keys {outside[:5]} outside [0, "
                                f"{t.num_clients}) (num_clients = {t.num_clients})")
        if t.attack_kind == "alie" and len(hostile) > t.clients_per_round // 2:
            raise SettingsError(f"attack.kind = alie needs fewer colluders than half the round "
                                f"(Baruch et al.'s supporters): {len(hostile)} in "
                                f"attack.clients, clients_per_round = {t.clients_per_round}")
        self.method.check(self)
        if t.clients_per_round > t.num_clients:
            raise SettingsError(f"clients_per_round = {t.clients_per_round} must be <= "
                                f"num_clients = {t.num_clients}")
        if not self.server.run_name:
            # Named once, here: to_flat() and with_overrides() then carry the same folder.
            label = t.method if not is_ref(t.method) else method.title
            named = dataclasses.replace(self.server, run_name=new_run_name(
                self.server.results_dir, f"{t.task}-{label}"))
            object.__setattr__(named, "by_method", self.server.by_method)
            object.__setattr__(self, "server", named)

    def _combine_own(self, method: methods.Method) -> None:
        """``own``: the run's method's keys (its defaults where not given, those declared with
        ``fallback`` the method's own), and the keys of other methods given at other values
        than their defaults. Another method's key at its default changes nothing: it is
        dropped, so that a method added to the registry (or the next method of a comparison)
        leaves this run as it was."""
        mine, every = _own_defaults([method]), _own_defaults(methods.loaded())
        given = {k: v for k, v in self.own.items()
                 if k in mine or k not in every or v != every[k]}
        own = {**mine, **given}
        filled = set()
        for f in fields_of(method.settings) if method.settings is not None else ():
            key = f.metadata["key"]
            if "fallback" in f.metadata and own[key] in ("", None):
                own[key] = method.defaults.get(key, f.metadata["fallback"])
                filled.add(key)
        object.__setattr__(self, "own", own)
        object.__setattr__(self, "own_by_method", frozenset(filled))

    @classmethod
    def from_flat(cls, values: Mapping[str, object]) -> RunConfig:
        """Parse flat dotted keys; an unknown key names itself and lists the known ones, a
        retired one names its successor.

        ``model_options.hidden = [64]`` (how Flower flattens a ``[model_options]`` table of
        ``[tool.flwr.app.config]``) is option ``hidden`` of ``model_options``. A method named
        by ``module:callable`` is loaded here, so that its own keys are known.
        """
        values = fold_options(values)
        renamed = sorted(k for k in values if k in RENAMED)
        if renamed:
            raise SettingsError("; ".join(f"{k} is now {RENAMED[k]} (one key for every method)"
                                          for k in renamed))
        if isinstance(values.get("method"), str) and is_ref(values["method"]):
            methods.get(str(values["method"]))  # a SettingsError naming the reference
        own_keys = set(known_keys(method_key_classes()))
        unknown = sorted(set(values) - set(cls.keys()) - own_keys)
        if unknown:
            raise unknown_keys(unknown, set(cls.keys()) | own_keys)
        server_keys = set(known_keys([ServerSettings]))
        return cls(
            server=parse(ServerSettings, {k: v for k, v in values.items() if k in server_keys}),
            train=parse(TrainSettings, {k: v for k, v in values.items()
                                        if k not in server_keys and k not in own_keys}),
            own=_parse_own({k: v for k, v in values.items() if k in own_keys}),
        )

    @staticmethod
    def keys() -> list[str]:
        """Every key of fedgc and of its registered methods, sorted (a method loaded by
        ``module:callable`` adds its own keys to those a run accepts)."""
        return sorted(set(known_keys([ServerSettings, TrainSettings]))
                      | set(_own_defaults(methods.registered())))

    @property
    def method(self) -> methods.Method:
        """The run's method, configured with its own keys."""
        return methods.get(self.train.method).with_keys(self.own)

    def with_overrides(self, values: Mapping[str, object]) -> RunConfig:
        """A copy with some keys replaced (validated like :meth:`from_flat`); the keys the
        method filled go back to "" (the next method's default)."""
        mine = self.server.by_method | self.train.by_method | self.own_by_method
        return RunConfig.from_flat({**{k: ("" if k in mine else v)
                                       for k, v in self.to_flat().items()}, **values})

    def client_train_settings(self) -> TrainSettings:
        """TrainSettings with ``state_dir`` resolved to an absolute path (clients run elsewhere)."""
        return dataclasses.replace(self.train, state_dir=str(self.state_dir.resolve()))

    def client_config(self) -> dict[str, FlatValue]:
        """The keys every train message carries: the clients' keys (``state_dir`` absolute)
        and the methods' own keys but those only their server half reads. The attack keys
        only where a client attacks: without them a client has no attack (their defaults),
        and a run's messages stay the size they were before the keys existed (the emulator
        charges their bytes to the links)."""
        flat = to_flat(self.client_train_settings())
        if not self.train.attack_clients:
            flat = {k: v for k, v in flat.items() if not k.startswith("attack.")}
        kept = {f.metadata["key"] for cls in method_key_classes() for f in fields_of(cls)
                if not is_sent(f)}
        return {**flat, **{k: v for k, v in self.own.items() if k not in kept}}

    @staticmethod
    def describe() -> list[tuple[str, str, str, str, str]]:
        """(key, type, default, accepted range, doc) of every key of :meth:`keys`."""
        rows = describe(ServerSettings, method_default) + describe(TrainSettings, method_default)
        seen = set()
        for cls in method_key_classes(methods.registered()):
            rows += [r for r in describe(cls, method_default) if r[0] not in seen]
            seen |= {r[0] for r in rows}
        return sorted((k, kind, d, _methods_named(a, k), doc) for k, kind, d, a, doc in rows)


def _own_defaults(these: Sequence[methods.Method]) -> dict[str, Any]:
    """The own keys of ``these`` methods at their defaults ("" for those the method fills)."""
    out: dict[str, Any] = {}
    for cls in method_key_classes(these):
        out.update(to_flat(cls()))
    return out


def _parse_own(values: Mapping[str, object]) -> dict[str, Any]:
    """The methods' own keys given in ``values``, checked by their schemas (of every method
    this process knows)."""
    out: dict[str, Any] = {}
    for cls in method_key_classes():
        mine = set(known_keys([cls]))
        given = {k: v for k, v in values.items() if k in mine}
        if given:
            own = parse(cls, given)
            validate(own)  # a method's schema need not check itself
            out.update({k: v for k, v in to_flat(own).items() if k in given})
    return out


def new_run_name(results_dir: str | Path, label: str) -> str:
    """A run folder name that no folder in ``results_dir`` has: ``YYYYmmdd-HHMMSS-<label>``.

    Local time to the second, as FedScale names its logs; a name taken (two runs in one second)
    gets ``-2``, ``-3``... The default ``run_name`` is this, so a new run never meets the last.
    """
    label = re.sub(r"[^A-Za-z0-9._-]+", "_", label)  # a task may be a module path
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"
    name, n = stamp, 2
    while (Path(results_dir) / name).exists():
        name, n = f"{stamp}-{n}", n + 1
    return name
