"""The settings engine: every run-config key of fedgc, its owner, default and accepted range.

A schema is a frozen dataclass whose fields carry their external key (``dgc.density``), a
docstring and an accepted range (a :class:`dgc.config.Check`) in field metadata, so that parsing,
validation, error messages, ``python -m simulations keys`` and the documentation table all come
from one place. Values are validated once, when a schema object is built; every bad value is a
:class:`SettingsError` that names the key and the accepted range.

Each key belongs to one part of fedgc, named by its prefix where it has one:

- ``client``: what a client needs to train a round (:class:`TrainSettings`, sent in every train
  message);
- ``server``: rounds, server optimizer, downlink, checkpoints, results (:class:`ServerSettings`);
- ``dgc``: compression, on either side (``dgc.*``); the ranges of the keys that configure
  :class:`dgc.DGCConfig` are that class's own (:meth:`dgc.DGCConfig.check`);
- ``stc``: sparse ternary compression's densities, up and down (``stc.*``, ``method = stc``);
- ``sim``: the simulation engine (``sim.*``);
- ``netem``: the network emulator (``netem.*``, ``simulations.netem.settings.NetemSettings``,
  built on this engine).

:class:`RunConfig` is the server's and clients' keys together (what ``flwr run`` reads); the
emulator's keys are split off by the simulation CLI. Keys are flat and dotted, so one dict
serves a Flower run config (``[tool.flwr.app.config]``, ``flwr run --run-config``), a TOML file
(``[dgc]`` tables flatten) and ``--set key=value``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, get_type_hints

from dgc import Compressor, DGCCompressor, DGCConfig
from dgc.config import SELECTIONS, WARMUP_SCHEDULES, Check
from dgc.sparse import VALUE_DTYPES as _VALUE_DTYPES
from dgc.stc import STC_DENSITY, STCCompressor, stc_config
from dgc.two_density import TwoDensityCompressor
from tasks.partition import SCHEMES

#: Compression methods, in the order ``compare`` runs them: dense fp32 (FedAvg), dense with
#: DGC's server momentum (FedAvgM), top-k without error feedback, sparse ternary compression
#: both ways (STC, ``dgc.stc``), DGC.
METHODS = ("dense", "fedavgm", "topk", "stc", "dgc")
#: Methods whose clients send every entry in fp32: the baseline of every compression ratio;
#: their clients always get the exact global model.
DENSE_METHODS = ("dense", "fedavgm")
#: Methods whose clients keep a residual between rounds (error feedback), which the server's
#: acknowledgements keep whole.
RESIDUAL_METHODS = ("stc", "dgc")
#: Methods whose server applies ``dgc.server_momentum`` and ``dgc.server_lr`` (the others
#: ``server_momentum`` and ``server_lr``).
SERVER_MOMENTUM_METHODS = ("fedavgm", "dgc")
#: Shipped tasks a run may name (``tasks.DATASETS``); mnist and cifar10 read their files from
#: ``data_dir``. A run may also name a callable of its own, ``module:callable`` (:data:`TASK_REF`).
TASKS = ("mnist5k", "digits", "fashion-mnist", "shakespeare", "mnist", "cifar10")
#: A task of the user's own: ``pkg.module:callable`` (the callable may be ``Class.method``).
TASK_REF = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
#: Models a run may name for a shipped task (``tasks.MODELS``); empty = the task's default.
MODEL_NAMES = ("", "mlp", "cnn", "lstm")
#: Keys whose value is a JSON object of keyword options; a TOML table or a dict is accepted too.
OPTION_KEYS = ("model_options", "task_options")
#: How the training set is split into clients (``tasks.partition``).
PARTITIONS = SCHEMES
#: Warm-up schedules a run key may name: DGCConfig's, but "list", whose per-round densities
#: have no run key.
WARMUPS = tuple(w for w in WARMUP_SCHEDULES if w != "list")
#: Precisions of sent values (``dgc.sparse``).
VALUE_DTYPES = tuple(_VALUE_DTYPES)
#: What clients are sent: "auto" (a patch when smaller) or always the dense model.
DOWNLINKS = ("auto", "dense")
#: How a compressed broadcast moves the entries it sends (``downlink_values``): copied on the
#: float16 or int8 grid, or moved by sign * mean per tensor (STC's downlink, ``ternary``).
DOWNLINK_VALUES = ("float16", "int8", "ternary")
#: Simulation engines: Flower's Ray backend, or every client in this process.
ENGINES = ("ray", "local")
#: How the server combines a round's updates: the weighted mean (FedAvg), or coordinate-wise
#: robust statistics (``server.aggregation.ROBUST``).
AGGREGATIONS = ("mean", "trimmed_mean", "median")
#: The parts of fedgc that own keys (see the module docstring).
PARTS = ("client", "server", "dgc", "stc", "sim", "netem")

__all__ = ["DENSE_METHODS", "DOWNLINKS", "DOWNLINK_VALUES", "ENGINES", "METHODS", "MODEL_NAMES",
           "OPTION_KEYS", "PARTITIONS", "PARTS", "RESIDUAL_METHODS", "SELECTIONS",
           "SERVER_MOMENTUM_METHODS", "TASKS", "TASK_REF", "VALUE_DTYPES", "WARMUPS", "Check",
           "KeyInfo", "RunConfig", "ServerSettings", "SettingsError", "TaskSpec",
           "TrainSettings", "describe", "fields_of", "flatten", "key_table", "load_toml",
           "new_run_name", "options_of", "parse", "setting", "to_flat", "validate"]

T = TypeVar("T")


class SettingsError(ValueError):
    """A configuration key is unknown, or its value is outside the accepted range."""


def setting(default: Any, key: str, doc: str, check: Check | None = None) -> Any:
    """A dataclass field with its external key, documentation and accepted range.

    A schema class names the part that owns its keys in a ``PART`` class attribute; a dotted
    key's prefix (``dgc.``, ``sim.``, ``netem.``) names it instead.
    """
    return dataclasses.field(default=default,
                             metadata={"key": key, "doc": doc, "check": check or Check()})


def fields_of(cls: type) -> list[dataclasses.Field]:
    """The schema fields of a settings class (those declared with :func:`setting`)."""
    return [f for f in dataclasses.fields(cls) if "key" in f.metadata]


def coerce(key: str, value: object, kind: type) -> Any:
    """Convert ``value`` (typed, or a ``--set`` string) to ``kind``, naming ``key`` on error."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise SettingsError(f"{key} must be a boolean (true/false), got {value!r}")
    if kind is int or kind is float:
        noun = "an integer" if kind is int else "a number"
        if isinstance(value, bool):
            raise SettingsError(f"{key} must be {noun}, got {value!r}")
        if kind is int and isinstance(value, int):
            return value
        if kind is int and isinstance(value, float) and value.is_integer():
            return int(value)
        if kind is float and isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return kind(value.strip())
            except ValueError:
                pass
        raise SettingsError(f"{key} must be {noun}, got {value!r}")
    if kind is str:
        if isinstance(value, str):
            return value
        raise SettingsError(f"{key} must be a string, got {value!r}")
    raise SettingsError(f"{key}: unsupported setting type {kind!r}")


def parse(cls: type[T], values: Mapping[str, object], *, strict: bool = True) -> T:
    """Build ``cls`` from external keys; with ``strict`` an unknown key is an error."""
    hints = get_type_hints(cls)
    by_key = {f.metadata["key"]: f for f in fields_of(cls)}
    if strict:
        unknown = sorted(set(values) - set(by_key))
        if unknown:
            raise SettingsError(f"unknown configuration key(s) {unknown}; known keys: "
                                f"{sorted(by_key)}")
    kwargs: dict[str, Any] = {}
    for key, f in by_key.items():
        if key in values:
            value = values[key]
            if key in OPTION_KEYS and isinstance(value, Mapping):
                value = options_text(key, value)
            kwargs[f.name] = coerce(key, value, hints[f.name])
    return cls(**kwargs)


def options_text(key: str, options: Mapping[str, object]) -> str:
    """The JSON text of an options table (what the run config carries), naming ``key`` when a
    value is not JSON (numbers, strings, booleans, lists and tables are)."""
    try:
        return json.dumps(dict(options), sort_keys=True)
    except RecursionError:
        raise SettingsError(f"{key} is nested too deeply for a table of keyword options "
                            f"(Python's recursion limit, {sys.getrecursionlimit()} levels); "
                            f"expected options such as {{'hidden': 64}}") from None
    except (TypeError, ValueError) as ex:
        raise SettingsError(f"{key} must hold JSON values (numbers, strings, booleans, lists, "
                            f"tables), got {dict(options)!r}: {ex}") from None


def fold_options(values: Mapping[str, object]) -> dict[str, object]:
    """``{"task_options.n": 3}`` -> ``{"task_options": {"n": 3}}``, merged into the key's own
    value (a dict, or JSON text) when it is given too."""
    out = {k: v for k, v in values.items() if not any(k.startswith(o + ".") for o in OPTION_KEYS)}
    for key in OPTION_KEYS:
        dotted = {k[len(key) + 1:]: v for k, v in values.items() if k.startswith(key + ".")}
        if not dotted:
            continue
        base = values.get(key, "")
        merged = dict(base) if isinstance(base, Mapping) else options_of(key, str(base))
        out[key] = {**merged, **dotted}
    return out


def options_of(key: str, text: str) -> dict[str, Any]:
    """The keyword options of an options key: ``""`` is none, else a JSON object."""
    if not text.strip():
        return {}
    try:
        options = json.loads(text)
    except RecursionError:
        raise SettingsError(f"{key} is nested too deeply for a JSON object of keyword options "
                            f"(Python's recursion limit, {sys.getrecursionlimit()} levels); "
                            f"expected an object such as '{{\"hidden\": 64}}'") from None
    except json.JSONDecodeError as ex:
        raise SettingsError(f"{key} = {text!r} is not JSON ({ex.msg}); expected an object "
                            f"such as '{{\"hidden\": 64}}'") from None
    if not isinstance(options, dict):
        raise SettingsError(f"{key} = {text!r} must be a JSON object of keyword options, such "
                            f"as '{{\"hidden\": 64}}'")
    bad = [k for k in options if not k.isidentifier()]
    if bad:
        raise SettingsError(f"{key} = {text!r}: option names {bad} are not Python identifiers")
    return options


def validate(obj: object) -> None:
    """Check every schema field of ``obj`` against its accepted range."""
    hints = get_type_hints(type(obj))
    for f in fields_of(type(obj)):
        key, check = f.metadata["key"], f.metadata["check"]
        value = getattr(obj, f.name)
        kind = hints[f.name]
        if kind in (int, float) and (isinstance(value, bool) or
                                     not isinstance(value, (int, float))):
            raise SettingsError(f"{key} must be a number, got {value!r}")
        if kind is int and not isinstance(value, int):
            raise SettingsError(f"{key} must be an integer, got {value!r}")
        if not check.accepts(value):
            raise SettingsError(f"{key} = {value!r} is outside the accepted range "
                                f"{check.describe()}")


def to_flat(obj: object) -> dict[str, bool | int | float | str]:
    """External-key form of a settings object (what travels in a Flower ConfigRecord)."""
    return {f.metadata["key"]: getattr(obj, f.name) for f in fields_of(type(obj))}


def part_of(cls: type, key: str) -> str:
    """The part of fedgc that owns ``key`` of schema ``cls`` (one of :data:`PARTS`)."""
    prefix, dot, _ = key.partition(".")
    part = prefix if dot else getattr(cls, "PART", "")
    if part not in PARTS:
        raise SettingsError(f"key {key!r} of {cls.__name__} names no part of {list(PARTS)}")
    return part


class KeyInfo(NamedTuple):
    """One key as ``python -m simulations keys`` lists it."""

    key: str
    part: str
    kind: str
    default: str
    accepted: str
    doc: str


def key_table(classes: Sequence[type]) -> list[KeyInfo]:
    """Every key of the given schema classes with its part, sorted by key."""
    rows = []
    for cls in classes:
        for key, kind, default, accepted, doc in describe(cls):
            rows.append(KeyInfo(key, part_of(cls, key), kind, default, accepted, doc))
    return sorted(rows)


def describe(cls: type) -> list[tuple[str, str, str, str, str]]:
    """(key, type, default, accepted range, doc) for every key of ``cls``, for docs and --help."""
    hints = get_type_hints(cls)
    rows = []
    for f in fields_of(cls):
        kind = hints[f.name]
        accepted = f.metadata["check"].describe()
        if kind is bool:
            accepted = "true or false"
        elif kind is str and accepted == "any":
            accepted = "text"
        rows.append((f.metadata["key"], kind.__name__, repr(f.default), accepted,
                     f.metadata["doc"]))
    return rows


@dataclass(frozen=True)
class _TaskCheck(Check):
    """The ``task`` key's range: a shipped task's name, or ``module:callable``."""

    def accepts(self, value: object) -> bool:
        return value in self.choices or (isinstance(value, str)
                                         and TASK_REF.fullmatch(value) is not None)

    def describe(self) -> str:
        return f"one of {list(self.choices)}, or 'module:callable'"


@dataclass(frozen=True)
class _OptionsCheck(Check):
    """An options key's range: a JSON object of keyword options (checked by options_of)."""

    def describe(self) -> str:
        return "a JSON object, or empty"


class TaskSpec(NamedTuple):
    """The keys that make a run's Task (hashable: clients cache the task by it)."""

    task: str
    model: str
    model_options: str
    data_dir: str
    task_options: str


def _momentum() -> Check:
    return Check(0.0, 1.0, high_open=True)


def _dgc(name: str) -> Check:
    """The range of DGCConfig's field ``name``: a run key that sets it accepts the same."""
    return DGCConfig.check(name)


@dataclass(frozen=True)
class TrainSettings:
    """What a client needs to train one round: data, local optimizer, compression method.

    The server sends these keys in every train message (so ``run_simulation`` and ``flwr run``
    behave the same); a client never trusts its own defaults for them.

    Parameters
    ----------
    Every field is documented in its ``setting(...)`` declaration below; ``describe(TrainSettings)``
    renders the table in ``docs/federation.md``.
    """

    PART = "client"

    task: str = setting("mnist5k", "task", "a shipped dataset with its model "
                        "(tasks.get_task; mnist and cifar10 read data_dir), or your own: "
                        "'module:callable' returning a tasks.Task, called with task_options "
                        "(the module must be importable by every client: PYTHONPATH or "
                        "installed)", _TaskCheck(choices=TASKS))
    task_options: str = setting("", "task_options", "keyword options of the task, a JSON "
                                "object ('{\"n\": 3}'; a TOML table or a dict too): the "
                                "callable's, or a shipped dataset's (test_fraction; "
                                "Shakespeare's seq_len, ...); empty = none", _OptionsCheck())
    model: str = setting("", "model", "model of a shipped task (tasks.MODELS: mlp or cnn for "
                         "images, lstm for shakespeare); empty = the task's default",
                         Check(choices=MODEL_NAMES))
    model_options: str = setting("", "model_options", "constructor options of a shipped "
                                 "task's model, a JSON object like task_options: mlp hidden "
                                 "(list of widths, [200]); cnn channels ([16, 32]), hidden "
                                 "(128); lstm embedding_dim (8), hidden (128), num_layers (2); "
                                 "empty = the defaults", _OptionsCheck())
    data_dir: str = setting("", "data_dir", "local folder of a shipped task's data files: "
                            "required by mnist (IDX files) and cifar10 (python batches), "
                            "replaces fashion-mnist's Debian folder; empty = the packaged "
                            "data")
    num_clients: int = setting(100, "num_clients", "number of data partitions (= clients)",
                               Check(1))
    partition: str = setting("dirichlet", "partition", "how the training set is split",
                             Check(choices=PARTITIONS))
    alpha: float = setting(0.5, "alpha", "Dirichlet concentration (smaller = more label skew)",
                           Check(0.0, low_open=True))
    seed: int = setting(0, "seed", "seed of partitioning, sampling and local shuffling", Check(0))
    method: str = setting("dgc", "method", "compression: dense fp32 (FedAvg), fedavgm (dense "
                          "with dgc.server_momentum), top-k without error feedback, stc (sparse "
                          "ternary compression of both directions, stc.*), or DGC",
                          Check(choices=METHODS))
    local_epochs: int = setting(2, "local_epochs", "local passes over the client's data (used "
                                "when local_steps is 0)", Check(0))
    local_steps: int = setting(0, "local_steps", "local SGD steps per round; 0 = use "
                               "local_epochs; 1 = FedSGD-style rounds", Check(0))
    batch_size: int = setting(10, "batch_size", "local minibatch size", Check(1))
    lr: float = setting(0.1, "lr", "client SGD learning rate", Check(0.0, low_open=True))
    client_momentum: float = setting(0.5, "client_momentum", "client SGD momentum within a "
                                     "round (reset every round)", _momentum())
    weight_decay: float = setting(0.0, "weight_decay", "client SGD weight decay (applied "
                                  "locally, never sent)", Check(0.0))
    density: float = setting(0.001, "dgc.density", "fraction of each sparsified tensor sent "
                             "per round after warm-up (topk and dgc)", _dgc("density"))
    dgc_momentum: float = setting(0.0, "dgc.momentum", "momentum m of DGC's momentum "
                                  "correction on the pseudo-gradient; 0 = residual only",
                                  _dgc("momentum"))
    dampening: float = setting(0.0, "dgc.dampening", "u = m*u + (1 - dampening)*g; "
                               "dampening = m keeps the step size of plain SGD", _dgc("dampening"))
    momentum_correction: bool = setting(False, "dgc.momentum_correction", "accumulate the "
                                        "velocity (True) or the raw pseudo-gradient (False: "
                                        "error feedback only)")
    nesterov: bool = setting(False, "dgc.nesterov", "Nesterov form of momentum correction")
    momentum_masking: bool = setting(True, "dgc.momentum_masking", "zero the momentum at the "
                                     "sent coordinates (momentum factor masking)")
    small_density: float = setting(0.03, "dgc.small_density", "density of the sparsified "
                                   "tensors of at most dgc.small_numel entries (an output "
                                   "layer; topk and dgc); 0 = off, they use dgc.density",
                                   Check(0.0, 1.0))
    small_numel: int = setting(10_000, "dgc.small_numel", "size limit, in entries, of a tensor "
                               "that gets dgc.small_density", Check(1))
    warmup: str = setting("exponential", "dgc.warmup", "density warm-up schedule over the "
                          "first rounds: 4**-(r+1) until it reaches dgc.density",
                          Check(choices=WARMUPS))
    warmup_rounds: int = setting(0, "dgc.warmup_rounds", "rounds the warm-up lasts (the "
                                 "paper's warm-up epochs, counted in server rounds; 0 = none: "
                                 "with error feedback and server momentum it cost no accuracy "
                                 "in federated rounds, and its dense early rounds were a "
                                 "quarter of the uplink over 200 rounds)",
                                 _dgc("warmup_epochs"))
    selection: str = setting("sampled", "dgc.selection", "top-k threshold: exact or sampled",
                             _dgc("selection"))
    value_dtype: str = setting("float16", "dgc.value_dtype", "precision of sent values",
                               _dgc("value_dtype"))
    ternary: bool = setting(False, "dgc.ternary", "send sparsified tensors' entries as "
                            "sign * mean magnitude, one bit each on the wire (sparse ternary "
                            "compression; not for phones)")
    stc_density: float = setting(STC_DENSITY, "stc.density", "STC's p_up: the fraction of "
                                 "every tensor (biases too) a stc client sends per round, as "
                                 "sign * mean magnitude; the paper's 1/400",
                                 _dgc("density"))
    min_sparse_numel: int = setting(512, "dgc.min_sparse_numel", "tensors smaller than this "
                                    "(and 1-D ones unless dgc.sparse_vectors) are sent dense; "
                                    "512 (DGCConfig's 1024 sent the LSTM's embedding dense; 256 "
                                    "also sparsified the CNN's first convolution, -0.8 points)",
                                    _dgc("min_sparse_numel"))
    sparse_vectors: bool = setting(True, "dgc.sparse_vectors", "sparsify 1-D tensors (biases) "
                                   "of at least dgc.min_sparse_numel entries too, e.g. an LSTM's "
                                   "4 x hidden biases (sent dense, they were 60% of its uplink)")
    clip_norm: float = setting(0.0, "dgc.clip_norm", "local gradient clipping threshold "
                               "(scaled by clients_per_round**-0.5); 0 = off",
                               # DGCConfig's range, plus 0 for off (clip_norm=None there).
                               dataclasses.replace(_dgc("clip_norm"), low_open=False))
    clients_per_round: int = setting(10, "clients_per_round", "clients whose updates are "
                                     "aggregated per round", Check(1))
    state_dir: str = setting("", "state_dir", "folder of the per-client state store (residual, "
                             "pending update, held model); empty = <results>/<run>/client_state")

    def __post_init__(self) -> None:
        validate(self)
        if self.local_epochs == 0 and self.local_steps == 0:
            raise SettingsError("local_epochs and local_steps are both 0: set local_epochs >= 1 "
                                "or local_steps >= 1")
        for key in OPTION_KEYS:
            options_of(key, getattr(self, key))
        if self.task not in TASKS:
            shipped_only = [k for k in ("model", "model_options", "data_dir") if getattr(self, k)]
            if shipped_only:
                raise SettingsError(f"{', '.join(shipped_only)} set with task = {self.task!r}: "
                                    f"they configure the shipped tasks {list(TASKS)}; pass your "
                                    f"callable's options in task_options")

    def task_spec(self) -> TaskSpec:
        """The keys that make this run's Task."""
        return TaskSpec(self.task, self.model, self.model_options, self.data_dir,
                        self.task_options)

    def load_task(self) -> Any:
        """This run's :class:`tasks.Task` (:func:`fedgc.task_loader.load_task`)."""
        from fedgc.task_loader import load_task

        return load_task(self.task_spec())

    def dgc_config(self) -> DGCConfig:
        # The run keys of DGCConfig's fields were validated against its own ranges (_dgc); the
        # renames are the run's vocabulary: rounds are the paper's epochs, 0 turns clipping off.
        """The compressor configuration of this method (None-like for dense: density 1)."""
        common = dict(
            density=self.density, selection=self.selection, value_dtype=self.value_dtype,
            ternary=self.ternary,
            min_sparse_numel=self.min_sparse_numel, sparse_vectors=self.sparse_vectors,
            warmup="exponential" if self.warmup == "exponential" and self.warmup_rounds else "none",
            warmup_epochs=max(self.warmup_rounds, 0),
        )
        if self.method == "topk":
            # Same bytes as DGC, but nothing is remembered between rounds: the contrast case.
            return DGCConfig(momentum=0.0, momentum_correction=False, momentum_masking=False,
                             error_feedback=False, **common)
        if self.method == "stc":
            return stc_config(self.stc_density, self.value_dtype)
        if self.method == "dgc":
            return DGCConfig(
                momentum=self.dgc_momentum, momentum_correction=self.momentum_correction,
                nesterov=self.nesterov, dampening=self.dampening,
                momentum_masking=self.momentum_masking, error_feedback=True,
                clip_norm=self.clip_norm or None, num_workers=self.clients_per_round, **common)
        raise SettingsError(f"method {self.method!r} has no compressor (it sends dense fp32)")

    def compressor(self) -> Compressor:
        """A fresh compressor of this method: one density, or two when dgc.small_density > 0.

        Small sparsified tensors (``dgc.small_numel`` entries or fewer, e.g. a 10x200 output
        layer) get ``dgc.small_density``: at ``dgc.density`` alone they would send 2 entries per
        update (docs/federated_momentum.md). ``topk`` uses the same split, so that it differs
        from ``dgc`` only in keeping no residual.
        """
        config = self.dgc_config()
        if self.method == "stc":
            return STCCompressor(config)  # one density for every tensor, as STC has
        if self.small_density == 0.0:
            return DGCCompressor(config)
        return TwoDensityCompressor(config, self.small_density, small_numel=self.small_numel)


def known_keys(classes: Sequence[type]) -> list[str]:
    """Every external key of the given schema classes, sorted."""
    return sorted(f.metadata["key"] for cls in classes for f in fields_of(cls))


@dataclass(frozen=True)
class ServerSettings:
    """Server, results and simulation-engine keys (the clients' keys are in TrainSettings)."""

    PART = "server"

    run_name: str = setting("", "run_name", "results go to <results_dir>/<run_name>/; empty: a "
                            "new folder named by the start time, task and method "
                            "(YYYYmmdd-HHMMSS-<task>-<method>; -2, -3... if taken), so a run never "
                            "meets the last one; resume=true needs the name")
    results_dir: str = setting("results", "results_dir", "parent folder of run folders")
    rounds: int = setting(100, "rounds", "server rounds to run (in total, when resuming)",
                          Check(1))
    over_selection: float = setting(1.0, "over_selection", "sample ceil(clients_per_round * "
                                    "over_selection) clients, aggregate the first "
                                    "clients_per_round valid replies (straggler defence)",
                                    Check(1.0, 10.0))
    server_lr: float = setting(1.0, "server_lr", "server learning rate of dense, topk and stc "
                               "runs: global -= server_lr * momentum buffer; fedavgm and dgc "
                               "runs use dgc.server_lr", Check(0.0, low_open=True))
    server_momentum: float = setting(0.0, "server_momentum", "server momentum of dense, topk "
                                     "and stc runs (FedAvgM convention: buf = m*buf + avg); "
                                     "fedavgm and dgc runs use dgc.server_momentum",
                                     Check(0.0, 1.0, high_open=True))
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
                                         "dgc and fedavgm runs (replaces server_momentum "
                                         "there): DGC's "
                                         "momentum applied once per round to the aggregate, "
                                         "where it is never stale", Check(0.0, 1.0, high_open=True))
    dgc_server_lr: float = setting(1.0, "dgc.server_lr", "server learning rate of dgc and "
                                   "fedavgm runs (replaces server_lr there), applied to "
                                   "dgc.server_momentum's buffer", Check(0.0, low_open=True))
    max_weight_ratio: float = setting(4.0, "max_weight_ratio", "a client's weight "
                                      "(num-examples) is capped at this times the median claim "
                                      "of the round's valid replies (server/defences.py); 0 = "
                                      "no cap", Check(0.0))
    max_norm_ratio: float = setting(10.0, "max_norm_ratio", "a client's update (with its "
                                    "signs) is scaled down to at most this times the median "
                                    "norm of the round's valid replies; 0 = no clip",
                                    Check(0.0))
    aggregation: str = setting("mean", "aggregation", "mean: weighted by num-examples "
                               "(FedAvg); trimmed_mean or median: coordinate-wise over the "
                               "round's clients, unweighted, robust to a few hostile ones",
                               Check(choices=AGGREGATIONS))
    trim_fraction: float = setting(0.1, "trim_fraction", "with aggregation = trimmed_mean: the "
                                   "fraction of clients cut at each end of every coordinate",
                                   Check(0.0, 0.5, high_open=True))
    downlink: str = setting("auto", "downlink", "auto: send a patch instead of the dense model "
                            "when the client holds a recent version and the patch is smaller",
                            Check(choices=DOWNLINKS))
    downlink_history: int = setting(1000, "downlink_history", "the most versions a patch may "
                                    "span; a client holding an older version gets the dense "
                                    "model (memory: one int32 per parameter, whatever the "
                                    "value)", Check(0))
    downlink_density: float = setting(0.05, "downlink_density", "1: clients are sent the "
                                      "global model exactly; below 1 (topk and dgc runs; stc "
                                      "runs use stc.downlink_density): a "
                                      "compressed broadcast, each round the server copies "
                                      "this fraction of the matrix entries of the global "
                                      "model, those that differ most, into the model clients "
                                      "hold (error feedback on the server; 1-D tensors whole); "
                                      "dense and fedavgm runs always get the exact model",
                                      Check(0.0, 1.0, low_open=True))
    stc_downlink_density: float = setting(STC_DENSITY, "stc.downlink_density", "STC's p_down "
                                          "(stc runs): each round the server moves this "
                                          "fraction of every tensor of the model clients hold, "
                                          "where it differs most from the global model, by "
                                          "sign * mean difference (downlink_values ternary; "
                                          "error feedback on the server); the paper's 1/400; 1 "
                                          "= the exact model", Check(0.0, 1.0, low_open=True))
    downlink_values: str = setting("int8", "downlink_values", "with downlink_density < 1: "
                                   "the grid the broadcast's matrix entries are rounded to; "
                                   "float16 (2 bytes per patch value) or int8 (a byte or less: per "
                                   "tensor a power-of-two step whose range is 8x its largest "
                                   "initial entry, doubled when the model outgrows it); or "
                                   "ternary: per tensor (1-D too) the entries move by sign * "
                                   "their mean difference, a bit each in a one-round patch "
                                   "(STC's downlink; what stc runs use)",
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
        True, "clients_build_initial_model", "clients build version 0 of the model from the "
        "run's seed as the server does (the app ships the initial model), so a first contact "
        "gets a patch on version 0 instead of the dense model")
    round_timeout_s: float = setting(600.0, "round_timeout_s", "seconds to wait for train "
                                     "replies; a later reply counts as failed (round 1 includes "
                                     "Ray start-up)", Check(0.0, low_open=True))
    eval_samples: int = setting(0, "eval_samples", "evaluate the global model every round on "
                                "a seeded random subset of this many test samples (the same "
                                "subset every round); 0 = the whole test split (Shakespeare's "
                                "10,000 cost ~0.5 ms each in the LSTM)", Check(0))
    fraction_evaluate: float = setting(0.0, "fraction_evaluate", "fraction of clients for "
                                       "federated evaluation (centralized evaluation runs every "
                                       "round regardless)", Check(0.0, 1.0))
    checkpoint: bool = setting(True, "checkpoint", "write model + strategy state atomically "
                               "after every round")
    resume: bool = setting(False, "resume", "continue from the run folder's checkpoint")
    overwrite: bool = setting(False, "overwrite", "replace an earlier run in the same folder "
                              "(its checkpoint, results and client state)")
    progress: bool = setting(True, "progress", "print one line per round")
    client_nodes: str = setting("", "client_nodes", "with SuperNode authentication "
                                "(flower-superlink --enable-supernode-auth): the authenticated "
                                "node that serves each client key, 'key:node_id,...' (the node "
                                "id `flwr supernode register` prints); a node not listed, or "
                                "claiming another key, is never sampled; empty: a node is the "
                                "client key it claims (docs/threat_model.md)")
    tensorboard: bool = setting(False, "tensorboard", "also write every round's metrics "
                                "(accuracy, loss, MB both ways, clients, seconds) as "
                                "TensorBoard scalars under <run_dir>/tensorboard/ (needs the "
                                "tensorboard package: pip install 'fedgc[tensorboard]')")
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
        if "/" in self.run_name or self.run_name in (".", ".."):
            raise SettingsError(f"run_name = {self.run_name!r} must be a plain folder name")
        parse_client_nodes(self.client_nodes)
        if not self.run_name.isprintable():
            # A newline or an escape sequence in a folder name garbles every line that prints it.
            raise SettingsError(f"run_name = {self.run_name!r} holds a control character; "
                                f"expected a plain folder name")
        if self.resume and not self.run_name:
            raise SettingsError("resume=true needs run_name: the name of the run folder to "
                                "continue (without it, a run starts in a new timestamped folder)")


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
        outside = [k for k in parse_client_nodes(self.server.client_nodes) if k >= t.num_clients]
        if outside:
            raise SettingsError(f"client_nodes binds client keys {outside[:5]} outside [0, "
                                f"{t.num_clients}) (num_clients = {t.num_clients})")
        if t.clients_per_round > t.num_clients:
            raise SettingsError(f"clients_per_round = {t.clients_per_round} must be <= "
                                f"num_clients = {t.num_clients}")
        if not self.server.run_name:
            # Named once, here: to_flat() and with_overrides() then carry the same folder.
            named = dataclasses.replace(self.server, run_name=new_run_name(
                self.server.results_dir, f"{t.task}-{t.method}"))
            object.__setattr__(self, "server", named)

    @classmethod
    def from_flat(cls, values: Mapping[str, object]) -> RunConfig:
        """Parse flat dotted keys; an unknown key names itself and lists the known ones.

        ``model_options.hidden = [64]`` (how Flower flattens a ``[model_options]`` table of
        ``[tool.flwr.app.config]``) is option ``hidden`` of ``model_options``.
        """
        values = fold_options(values)
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


def parse_client_nodes(text: str) -> dict[int, int]:
    """``"0:8421,1:977"`` -> ``{0: 8421, 1: 977}`` (client key -> authenticated node id).

    Raises
    ------
    SettingsError
        An item that is not ``key:node_id`` of whole numbers (keys >= 0, node ids >= 1), or a
        key or node id listed twice.
    """
    out: dict[int, int] = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        key, sep, node = item.partition(":")
        if not (sep and key.strip().isascii() and key.strip().isdigit()
                and node.strip().isascii() and node.strip().isdigit()
                and len(node.strip()) <= 20 and int(node) >= 1):
            raise SettingsError(f"client_nodes item {item[:60]!r} is not 'key:node_id' (whole "
                                f"numbers, node ids as `flwr supernode register` prints them)")
        if int(key) in out or int(node) in out.values():
            raise SettingsError(f"client_nodes lists client key {int(key)} or node {int(node)} "
                                f"twice; a node serves one client and a client one node")
        out[int(key)] = int(node)
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


def flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"dgc": {"density": 0.01}}`` -> ``{"dgc.density": 0.01}`` (TOML tables to keys).

    The tables of :data:`OPTION_KEYS` stay whole: they are one key's keyword options.
    """
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and key not in OPTION_KEYS:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


#: The largest configuration file read: a scenario takes a few kB; a file that never ends
#: (``/dev/zero``) or a huge one is refused before it fills the memory.
MAX_CONFIG_BYTES = 1 << 20


def load_toml(path: str | Path) -> dict[str, Any]:
    """Flat keys of a TOML scenario file; a missing, malformed, non-regular (a device, a FIFO)
    or oversized (over :data:`MAX_CONFIG_BYTES`) file names itself."""
    p = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer before it can be refused.
        with os.fdopen(os.open(p, os.O_RDONLY | os.O_NONBLOCK), "rb") as fh:
            info = os.fstat(fh.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise SettingsError(f"config file {p} is not a regular file; expected a TOML "
                                    f"file")
            data = fh.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise SettingsError(f"config file {p} is over {MAX_CONFIG_BYTES} bytes; a "
                                f"configuration takes a few kB")
        return flatten(tomllib.loads(data.decode("utf-8")))
    except FileNotFoundError as ex:
        raise SettingsError(f"config file {p} does not exist") from ex
    except tomllib.TOMLDecodeError as ex:
        raise SettingsError(f"config file {p} is not valid TOML: {ex}") from ex
    except RecursionError:
        raise SettingsError(f"config file {p} nests tables or arrays too deeply (Python's "
                            f"recursion limit, {sys.getrecursionlimit()} levels)") from None
