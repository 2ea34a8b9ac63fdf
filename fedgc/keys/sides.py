"""The owners' keys by side: what every train message carries, what the server keeps, and both.

:class:`TrainSettings` (run, client, ``sim.device`` and attack keys) travels to every client in
every train message; :class:`ServerSettings` (the run's folder and rounds, server and engine
keys) stays with the server; :class:`RunSettings` is both with the run's method's own keys, what
a method's server hooks read. Each is a flat frozen dataclass composed of its owners' classes
(:mod:`fedgc.keys.run`, ``client``, ``server``, ``sim``, ``attack``), so a key is read as
``train.lr`` wherever it is used and declared once, by its owner.

A key a method may give its own default (``density``, ``server_momentum``: declared with
``fallback``) holds None here until the run's keys are combined
(:class:`fedgc.settings.RunConfig` fills it with the run's method's default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from fedgc.keys.attack import AttackKeys
from fedgc.keys.client import ClientKeys
from fedgc.keys.run import RunFolderKeys, RunKeys
from fedgc.keys.server import ServerKeys
from fedgc.keys.sim import SimDeviceKeys, SimKeys
from fedgc.schema import to_flat, validate

__all__ = ["FlatValue", "RunSettings", "ServerSettings", "TrainSettings"]

#: A key's value in flat form (a Flower ConfigRecord's, ``summary.json``'s).
FlatValue = bool | int | float | str


# The owners are listed last-first: a dataclass takes its bases' fields from the last base on,
# so the keys keep the order run, client, sim, attack.
@dataclass(frozen=True)
class TrainSettings(AttackKeys, SimDeviceKeys, ClientKeys, RunKeys):
    """What a client needs to train one round: data, local optimizer, compression density.

    The server sends these keys in every train message (so ``run_simulation`` and ``flwr run``
    behave the same); a client never trusts its own defaults for them. The run's method's own
    keys travel beside them (:attr:`fedgc.methods.Method.settings`).

    Parameters
    ----------
    Every field is documented in its ``setting(...)`` declaration, in its owner's module;
    ``describe(TrainSettings)`` renders the table in ``docs/federation.md``.
    """

    #: The per-method keys that the run's method filled, and the attack's bounds that the
    #: server's filled (not the user's: ``compare`` gives the next method its own, and
    #: ``with_overrides`` fills them again).
    by_method: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        validate(self)
        self.check_client_keys()
        self.check_run_keys()


@dataclass(frozen=True)
class ServerSettings(SimKeys, ServerKeys, RunFolderKeys):
    """The run's folder and rounds, the server's keys and the engine's (the clients' keys are
    in TrainSettings)."""

    #: The per-method keys that the run's method filled, and the aggregation keys that
    #: ``robust`` filled (see TrainSettings.by_method).
    by_method: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        validate(self)
        self.check_folder_keys()
        self.check_server_keys()


@dataclass(frozen=True)
class RunSettings:
    """A run's keys: the server's, the clients', and its method's own (flat, by key).

    What a method's server hooks are given (:meth:`fedgc.methods.Method.aggregator`, ...);
    :class:`fedgc.settings.RunConfig` is one, built and checked against the method registry.
    """

    server: ServerSettings = field(default_factory=ServerSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    own: Mapping[str, FlatValue] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        """``<results_dir>/<run_name>``."""
        return Path(self.server.results_dir) / self.server.run_name

    @property
    def state_dir(self) -> Path:
        """Where clients keep their state (``state_dir`` or ``<run_dir>/client_state``)."""
        return Path(self.train.state_dir) if self.train.state_dir else self.run_dir / "client_state"

    def to_flat(self) -> dict[str, FlatValue]:
        """All keys with their values (what ``summary.json`` records as the run's config)."""
        return {**to_flat(self.server), **to_flat(self.train), **self.own}
