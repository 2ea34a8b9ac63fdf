"""RunConfig: every key of a fedgc run (server, simulation and the clients' TrainSettings).

Keys are flat and dotted (``dgc.density``), so one dict serves a Flower run config
(``[tool.flwr.app.config]``, ``flwr run --run-config``), a TOML file (``[dgc]`` tables flatten)
and ``--set key=value``. Unknown keys and out-of-range values stop with a
:class:`client.settings.SettingsError` that names the key and the accepted range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from client.settings import (
    Check,
    SettingsError,
    TrainSettings,
    describe,
    fields_of,
    known_keys,
    parse,
    setting,
    to_flat,
    validate,
)

DOWNLINKS = ("auto", "dense")
#: The grids a compressed broadcast's matrix entries can be rounded to (``downlink_values``).
DOWNLINK_VALUES = ("float16", "int8")
ENGINES = ("ray", "local")

__all__ = ["RunConfig", "SettingsError", "flatten", "load_toml"]


@dataclass(frozen=True)
class ServerSettings:
    """Server, results and simulation-engine keys (the clients' keys are in TrainSettings)."""

    run_name: str = setting("default", "run_name", "results go to <results_dir>/<run_name>/")
    results_dir: str = setting("results", "results_dir", "parent folder of run folders")
    rounds: int = setting(100, "rounds", "server rounds to run (in total, when resuming)",
                          Check(1))
    over_selection: float = setting(1.0, "over_selection", "sample ceil(clients_per_round * "
                                    "over_selection) clients, aggregate the first "
                                    "clients_per_round valid replies (straggler defence)",
                                    Check(1.0, 10.0))
    server_lr: float = setting(1.0, "server_lr", "server learning rate: global -= server_lr "
                               "* momentum buffer", Check(0.0, low_open=True))
    server_momentum: float = setting(0.0, "server_momentum", "server momentum of dense and "
                                     "topk runs (FedAvgM convention: buf = m*buf + avg); dgc "
                                     "runs use dgc.server_momentum", Check(0.0, 1.0,
                                                                             high_open=True))
    shared_density: float = setting(0.03, "dgc.shared_density", "shared-index sign channel "
                                    "(dgc only): fraction of each sparsified tensor at which "
                                    "every client of a round sends its residual as scaled signs, "
                                    "1 bit per entry, at indices the server picks; 0 = off",
                                    Check(0.0, 1.0))
    shared_small_density: float = setting(0.0, "dgc.shared_small_density", "the same for "
                                          "tensors of at most dgc.small_numel entries; 0 = "
                                          "dgc.shared_density", Check(0.0, 1.0))
    shared_momentum: float = setting(0.9, "dgc.shared_momentum", "factor of the moving average "
                                     "of aggregates by which the server ranks shared indices",
                                     Check(0.0, 1.0, high_open=True))
    dgc_server_momentum: float = setting(0.5, "dgc.server_momentum", "server momentum of "
                                         "dgc runs (replaces server_momentum there): DGC's "
                                         "momentum applied once per round to the aggregate, "
                                         "where it is never stale", Check(0.0, 1.0, high_open=True))
    downlink: str = setting("auto", "downlink", "auto: send a patch instead of the dense model "
                            "when the client holds a recent version and the patch is smaller",
                            Check(choices=DOWNLINKS))
    downlink_history: int = setting(1, "downlink_history", "the most versions a patch may "
                                    "span; a client holding an older version gets the dense "
                                    "model (memory: one int32 per parameter, whatever the "
                                    "value)", Check(0))
    downlink_density: float = setting(1.0, "downlink_density", "1: clients are sent the "
                                      "global model exactly; below 1 (topk and dgc runs): a "
                                      "compressed broadcast, each round the server copies "
                                      "this fraction of the matrix entries of the global "
                                      "model, those that differ most, into the model clients "
                                      "hold (error feedback on the server; 1-D tensors whole); "
                                      "dense runs always get the exact model",
                                      Check(0.0, 1.0, low_open=True))
    downlink_values: str = setting("float16", "downlink_values", "with downlink_density < 1: "
                                   "the grid the broadcast's matrix entries are rounded to; "
                                   "float16 (2 bytes per patch value) or int8 (a byte or less: per "
                                   "tensor a power-of-two step whose range is 8x its largest "
                                   "initial entry, doubled when the model outgrows it)",
                                   Check(choices=DOWNLINK_VALUES))
    downlink_deltas: bool = setting(True, "downlink_deltas", "with downlink_values int8: version "
                                    "0 is broadcast on the grid too, and a patch on the one "
                                    "version a client is known to hold carries differences "
                                    "(which the client adds) where those encode smaller")
    downlink_lookahead: float = setting(1.0, "downlink_lookahead", "with downlink_density < 1 "
                                        "and server momentum: the broadcast follows the global "
                                        "model minus this fraction of the step the momentum "
                                        "buffer already fixes (Nesterov's look-ahead), so that "
                                        "clients lag it less; 0 = follow the global model",
                                        Check(0.0, 1.0))
    clients_build_initial_model: bool = setting(
        False, "clients_build_initial_model", "clients build version 0 of the model from the "
        "run's seed as the server does (the app ships the initial model), so a first contact "
        "gets a patch on version 0 instead of the dense model")
    round_timeout_s: float = setting(600.0, "round_timeout_s", "seconds to wait for train "
                                     "replies; a later reply counts as failed (round 1 includes "
                                     "Ray start-up)", Check(0.0, low_open=True))
    fraction_evaluate: float = setting(0.0, "fraction_evaluate", "fraction of clients for "
                                       "federated evaluation (centralized evaluation runs every "
                                       "round regardless)", Check(0.0, 1.0))
    checkpoint: bool = setting(True, "checkpoint", "write model + strategy state atomically "
                               "after every round")
    resume: bool = setting(False, "resume", "continue from the run folder's checkpoint")
    overwrite: bool = setting(False, "overwrite", "replace an earlier run in the same folder "
                              "(its checkpoint, results and client state)")
    progress: bool = setting(True, "progress", "print one line per round")
    engine: str = setting("ray", "sim.engine", "ray: Flower's simulation engine (Ray backend); "
                          "local: server.local_grid.LocalGrid, every client in this process "
                          "one after another (tests, debugging)", Check(choices=ENGINES))
    cpus_per_client: float = setting(1.0, "sim.cpus_per_client", "Ray CPUs per ClientApp "
                                     "actor (fractional allowed)", Check(0.0, low_open=True))
    num_cpus: int = setting(0, "sim.num_cpus", "CPUs Ray may use; 0 = all", Check(0))
    ray_address: str = setting("", "sim.ray_address", "attach to a running Ray cluster "
                               "(HEAD:PORT of `ray start --head`, or auto) instead of starting "
                               "Ray here; its nodes declare their CPUs (sim.num_cpus must stay "
                               "0) and state_dir must be a folder every node mounts "
                               "(docs/cluster.md); empty = a fresh Ray instance on this machine")

    def __post_init__(self) -> None:
        validate(self)
        if "/" in self.run_name or self.run_name in ("", ".", ".."):
            raise SettingsError(f"run_name = {self.run_name!r} must be a plain folder name")


@dataclass(frozen=True)
class RunConfig:
    """The whole configuration of a run: ``server`` keys and the clients' ``train`` keys.

    Parameters
    ----------
    server : ServerSettings
        Rounds, server optimizer, downlink, checkpointing, results and Ray resources.
    train : TrainSettings
        Task, partition, local training and compression; sent to every client.
    """

    server: ServerSettings = field(default_factory=ServerSettings)
    train: TrainSettings = field(default_factory=TrainSettings)

    def __post_init__(self) -> None:
        t = self.train
        if t.clients_per_round > t.num_clients:
            raise SettingsError(f"clients_per_round = {t.clients_per_round} must be <= "
                                f"num_clients = {t.num_clients}")

    @classmethod
    def from_flat(cls, values: Mapping[str, object]) -> RunConfig:
        """Parse flat dotted keys; an unknown key names itself and lists the known ones."""
        unknown = sorted(set(values) - set(cls.keys()))
        if unknown:
            raise SettingsError(f"unknown configuration key(s) {unknown}; known keys: "
                                f"{cls.keys()}")
        server_keys = {f.metadata["key"] for f in fields_of(ServerSettings)}
        return cls(
            server=parse(ServerSettings, {k: v for k, v in values.items() if k in server_keys}),
            train=parse(TrainSettings, {k: v for k, v in values.items() if k not in server_keys}),
        )

    @staticmethod
    def keys() -> list[str]:
        """Every accepted key, sorted."""
        return known_keys([ServerSettings, TrainSettings])

    def to_flat(self) -> dict[str, bool | int | float | str]:
        """All keys with their values (what ``summary.json`` records as the run's config)."""
        return {**to_flat(self.server), **to_flat(self.train)}

    def with_overrides(self, values: Mapping[str, object]) -> RunConfig:
        """A copy with some keys replaced (validated like :meth:`from_flat`)."""
        return RunConfig.from_flat({**self.to_flat(), **values})

    @property
    def run_dir(self) -> Path:
        """``<results_dir>/<run_name>``."""
        return Path(self.server.results_dir) / self.server.run_name

    @property
    def state_dir(self) -> Path:
        """Where clients keep their state (``state_dir`` or ``<run_dir>/client_state``)."""
        return Path(self.train.state_dir) if self.train.state_dir else self.run_dir / "client_state"

    def client_train_settings(self) -> TrainSettings:
        """TrainSettings with ``state_dir`` resolved to an absolute path (clients run elsewhere)."""
        return dataclasses.replace(self.train, state_dir=str(self.state_dir.resolve()))

    @staticmethod
    def describe() -> list[tuple[str, str, str, str, str]]:
        """(key, type, default, accepted range, doc) of every key."""
        return sorted(describe(ServerSettings) + describe(TrainSettings))


def flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"dgc": {"density": 0.01}}`` -> ``{"dgc.density": 0.01}`` (TOML tables to keys)."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    """Flat keys of a TOML scenario file; a missing or malformed file names itself."""
    import tomllib  # Python >= 3.11

    p = Path(path)
    try:
        with p.open("rb") as fh:
            return flatten(tomllib.load(fh))
    except FileNotFoundError as ex:
        raise SettingsError(f"config file {p} does not exist") from ex
    except tomllib.TOMLDecodeError as ex:
        raise SettingsError(f"config file {p} is not valid TOML: {ex}") from ex
