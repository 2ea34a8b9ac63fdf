"""The run's keys: every key of fedgc's server and clients, its owner, default and accepted range.

Declared with the settings engine (:mod:`fedgc.schema`: ``setting``, parsing, checks, the
``keys`` table), each key once. Each key belongs to one part of fedgc, named by its prefix where
it has one:

- ``client``: what a client needs to train a round (:class:`TrainSettings`, sent in every train
  message);
- ``server``: rounds, server optimizer, downlink, checkpoints, results (:class:`ServerSettings`);
- ``dgc``: the DGC family's compression keys, on either side (``dgc.*``); the ranges of the keys
  that configure :class:`dgc.DGCConfig` are that class's own (:meth:`dgc.DGCConfig.check`);
- a method's own keys under its prefix (:attr:`fedgc.methods.Method.settings`);
- ``sim``: the simulation engine (``sim.*``);
- ``netem``: the network emulator (``netem.*``, ``simulations.netem.settings.NetemSettings``,
  built on the same engine).

Keys a compression method may give its own default (``server_lr``, ``server_momentum``,
``density``, ``downlink_density``, ``downlink_values``) hold "" (the method's) until the run's
method fills them (:class:`RunConfig`), so that ``compare`` runs every method at its own
defaults and a value set for the comparison applies to all of them.

:class:`RunConfig` is the server's and clients' keys together (what ``flwr run`` reads); the
emulator's keys are split off by the simulation CLI. Keys are flat and dotted, so one dict
serves a Flower run config (``[tool.flwr.app.config]``, ``flwr run --run-config``), a TOML file
(``[dgc]`` tables flatten) and ``--set key=value``.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from dgc import DGCConfig
from dgc.config import SELECTIONS, WARMUP_SCHEDULES
from dgc.sparse import VALUE_DTYPES as _VALUE_DTYPES
from fedgc import methods
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
    fallback_of,
    fields_of,
    flatten,
    fold_options,
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
from tasks.partition import SCHEMES

#: Shipped tasks a run may name (``tasks.DATASETS``); mnist and cifar10 read their files from
#: ``data_dir``. A run may also name a callable of its own, ``module:callable`` (:data:`TASK_REF`).
TASKS = ("mnist5k", "digits", "fashion-mnist", "shakespeare", "mnist", "cifar10")
#: Models a run may name for a shipped task (``tasks.MODELS``); empty = the task's default.
MODEL_NAMES = ("", "mlp", "cnn", "lstm")
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
#: What a dgc client sends at the shared indices: scaled signs, or values on a grid.
SHARED_VALUES = ("sign", "grid")
#: How the server ranks the shared indices (dgc.signs.planner).
SHARED_RANKS = ("aggregates", "displacement")
#: What a dgc client compresses (fedgc.methods.feedback): its residual plus its pseudo-gradient
#: (DGC's error feedback), its pseudo-gradient less the aggregate reference (CAFe), or both.
FEEDBACKS = ("residual", "aggregate", "aggregate+residual", "own")
#: How a dgc client shares its top-k's entries out among its tensors (dgc.DGCCompressor).
BUDGETS = ("tensor", "model", "energy")
#: Simulation engines: Flower's Ray backend, every client in this process one after another, or
#: a round's clients trained at once in this process (``torch.func``, MLP and CNN models).
ENGINES = ("ray", "local", "batched")
#: Where clients train and compress (``sim.device``): auto is cuda where torch sees one.
DEVICES = ("cpu", "cuda", "auto")
#: How the server combines a round's updates: the weighted mean (FedAvg), coordinate-wise
#: robust statistics (``server.aggregation``), centered clipping or FLTrust (``server.robust``).
AGGREGATIONS = ("mean", "trimmed_mean", "median", "centered_clip", "fltrust")
#: ``robust``: the defaults of the aggregation keys for clients that are not trusted (on: a
#: deployment's, the phone bridge's) or are (off: a simulation's, plain FedAvg); auto decides by
#: where the run runs (``server.app.run_server``).
ROBUST_MODES = ("auto", "on", "off")
#: What ``robust`` gives the aggregation keys left empty (docs/threat_model.md: why these).
ROBUST_PROFILES: dict[str, dict[str, Any]] = {
    "off": {"aggregation": "mean", "max_weight_ratio": 0.0, "max_norm_ratio": 0.0,
            "min_cosine": -1.0},
    "on": {"aggregation": "centered_clip", "max_weight_ratio": 1.0, "max_norm_ratio": 0.0,
           "min_cosine": 0.0},
}
#: Hostile clients (``client.attacks``).
ATTACKS = ("sign_flip", "scaled", "targeted", "noise", "alie", "ipm", "min_max", "min_sum")
#: The attacks whose clients collude: they craft one update from what they know of the round's
#: benign updates (``client.collusion``): ALIE, IPM, min-max, min-sum.
COLLUDING_ATTACKS = ("alie", "ipm", "min_max", "min_sum")
#: What colluders know of the benign updates (``attack.knowledge``): their own honest updates
#: (partial, as in Shejwalkar and Houmansadr 2021), or every benign client's (full).
KNOWLEDGE = ("partial", "full")
#: The perturbation min-max and min-sum add to the benign mean, against its direction
#: (``attack.deviation``, the NDSS 2021 paper's three).
DEVIATIONS = ("std", "unit_vec", "sign")
#: How far an attack goes where no bound stops it: the bounds fedgc had before issue 26.
UNBOUNDED_ATTACK = {"norm_ratio": 10.0, "weight_ratio": 4.0}
#: An attack stays this fraction under the bounds in force.
ATTACK_MARGIN = 0.99
#: The parts of fedgc that own keys (see the module docstring), besides methods' prefixes.
PARTS = ("client", "server", "dgc", "sim", "netem", "attack")
#: Keys retired in favour of one key for every method (issue 29): the old name is refused,
#: naming the new one.
RENAMED = {"dgc.density": "density", "stc.density": "density",
           "dgc.server_lr": "server_lr", "dgc.server_momentum": "server_momentum",
           "stc.downlink_density": "downlink_density"}

__all__ = ["AGGREGATIONS", "ATTACKS", "DEVICES", "ROBUST_MODES", "ROBUST_PROFILES", "DOWNLINKS",
           "DOWNLINK_VALUES", "ENGINES", "MAX_CONFIG_BYTES", "MODEL_NAMES", "OPTION_KEYS",
           "PARTITIONS", "PARTS", "RENAMED", "SELECTIONS", "TASKS", "TASK_REF", "VALUE_DTYPES",
           "WARMUPS", "Check", "KeyInfo", "RunConfig", "ServerSettings", "SettingsError",
           "TaskSpec", "TrainSettings", "coerce", "describe", "fields_of", "flatten",
           "fold_options", "key_table", "known_keys", "load_toml", "method_default",
           "new_run_name", "options_of", "options_text", "parse", "parse_attack_clients",
           "parse_client_nodes", "setting", "to_flat", "unknown_keys", "validate"]


def method_default(key: str, fallback: Any) -> str:
    """How the ``keys`` table writes a per-method key's default: the registered methods that
    set their own, then the others'."""
    own = [f"{m.name} {m.defaults[key]!r}" for m in methods.registered() if key in m.defaults]
    return f"{fallback!r}; " + ", ".join(own) if own else repr(fallback)


def key_table(classes: list[type]) -> list[KeyInfo]:
    """Every key of ``classes`` with its part (:data:`PARTS` and the methods' prefixes)."""
    parts = PARTS + tuple(m.prefix for m in methods.loaded() if m.prefix)
    return _key_table(classes, parts, method_default)


def _resolve(obj: Any, method: methods.Method) -> Any:
    """``obj`` with its per-method keys that are still None set to ``method``'s defaults (the
    generic one where it has none), and ``by_method`` naming them."""
    filled, named = {}, []
    for f in fields_of(type(obj)):
        if "fallback" in f.metadata and getattr(obj, f.name) is None:
            key = f.metadata["key"]
            filled[f.name] = method.defaults.get(key, fallback_of(f))
            named.append(key)
    if not filled:
        return obj
    out = dataclasses.replace(obj, **filled)
    object.__setattr__(out, "by_method", frozenset(named) | obj.by_method)
    validate(out)  # a method's own default must be in range too
    return out


@dataclass(frozen=True)
class _TaskCheck(Check):
    """The ``task`` key's range: a shipped task's name, or ``module:callable``."""

    def accepts(self, value: object) -> bool:
        return value in self.choices or (isinstance(value, str)
                                         and TASK_REF.fullmatch(value) is not None)

    def describe(self) -> str:
        return f"one of {list(self.choices)}, or 'module:callable'"


@dataclass(frozen=True)
class _MethodCheck(Check):
    """The ``method`` key's range: a registered method, or ``module:callable``."""

    def accepts(self, value: object) -> bool:
        return methods.is_known(value)

    def describe(self) -> str:
        return f"one of {list(methods.names())}, or 'module:callable'"


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
    method: str = setting("dgc", "method", "the compression method (docs/methods.md: what each "
                          "client sends and the server does), or your own: 'module:callable' "
                          "returning a fedgc.methods.Method (importable by every client, as a "
                          "task)", _MethodCheck())
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
    density: float | None = setting(None, "density", "fraction of each sparsified tensor a "
                                    "client sends per round (after dgc.warmup_rounds); empty = "
                                    "the method's default", _dgc("density"), fallback=0.001)
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
                                   "layer; topk and dgc); 0 = off, they use density",
                                   Check(0.0, 1.0))
    small_numel: int = setting(10_000, "dgc.small_numel", "size limit, in entries, of a tensor "
                               "that gets dgc.small_density", Check(1))
    warmup: str = setting("exponential", "dgc.warmup", "density warm-up schedule over the "
                          "first rounds: 4**-(r+1) until it reaches density",
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
    device: str = setting("cpu", "sim.device", "where clients train and compress: cpu, cuda, or "
                          "auto (cuda where torch sees one); models, batches and the compressor "
                          "on the device, client state on the host; cuda on a machine without "
                          "it stops the run before round 1", Check(choices=DEVICES))
    attack_clients: str = setting("", "attack.clients", "hostile clients for a robustness "
                                  "study: their keys, comma-separated ('0,1'); each sends an "
                                  "attack (attack.kind) instead of its update (client/attacks.py, "
                                  "docs/threat_model.md); empty = none")
    attack_kind: str = setting("sign_flip", "attack.kind", "what a hostile client sends: "
                               "sign_flip (its update negated), scaled (its update scaled up), "
                               "targeted (trained to predict attack.target_class, scaled up), "
                               "noise (Gaussian, of the same norm); colluding, from what they "
                               "know of the benign updates (attack.knowledge): alie (Baruch et "
                               "al. 2019), ipm (Xie et al. 2019), min_max, min_sum (Shejwalkar "
                               "and Houmansadr 2021)", Check(choices=ATTACKS))
    attack_knowledge: str = setting("partial", "attack.knowledge", "what colluding hostile "
                                    "clients know of the benign updates: partial = their own "
                                    "honest updates; full = every other client's honest update, "
                                    "computed from its data (a simulation's study)",
                                    Check(choices=KNOWLEDGE))
    attack_deviation: str = setting("std", "attack.deviation", "the perturbation min_max and "
                                    "min_sum subtract from the benign mean: std (coordinate-"
                                    "wise), unit_vec (the mean's direction), sign (its signs)",
                                    Check(choices=DEVIATIONS))
    attack_epsilon: float = setting(0.0, "attack.epsilon", "ipm sends -epsilon times the benign "
                                    "mean; 0 = the largest epsilon whose update is no farther "
                                    "from any benign update than the two farthest benign "
                                    "updates are apart (min-max's bound)", Check(0.0))
    attack_norm_ratio: float | None = setting(
        None, "attack.norm_ratio", "the norm of a hostile update, as a multiple of the client's "
        "honest update's norm (its estimate of the round's median); empty = just under the norm "
        "bound in force: 0.99 x max_norm_ratio, 10 without one", Check(0.0, low_open=True))
    attack_weight_ratio: float | None = setting(
        None, "attack.weight_ratio", "the num-examples a hostile client claims, as a multiple of "
        "its real number (colluding kinds: of the median of the benign claims they know); empty "
        "= just under the weight cap in force: 0.99 x max_weight_ratio, without one 4 (colluding "
        "kinds: 1)", Check(0.0, low_open=True))
    attack_target_class: int = setting(0, "attack.target_class", "the class attack.kind = "
                                       "targeted trains every input towards", Check(0))

    #: The per-method keys that the run's method filled, and the attack's bounds that the
    #: server's filled (not the user's: ``compare`` gives the next method its own, and
    #: ``with_overrides`` fills them again).
    by_method: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        validate(self)
        if self.local_epochs == 0 and self.local_steps == 0:
            raise SettingsError("local_epochs and local_steps are both 0: set local_epochs >= 1 "
                                "or local_steps >= 1")
        for key in OPTION_KEYS:
            options_of(key, getattr(self, key))
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
        if self.task not in TASKS:
            shipped_only = [k for k in ("model", "model_options", "data_dir") if getattr(self, k)]
            if shipped_only:
                raise SettingsError(f"{', '.join(shipped_only)} set with task = {self.task!r}: "
                                    f"they configure the shipped tasks {list(TASKS)}; pass your "
                                    f"callable's options in task_options")
        resolved = _resolve(self, methods.get(self.method))
        if resolved is not self:
            for f in dataclasses.fields(self):
                object.__setattr__(self, f.name, getattr(resolved, f.name))

    def task_spec(self) -> TaskSpec:
        """The keys that make this run's Task."""
        return TaskSpec(self.task, self.model, self.model_options, self.data_dir,
                        self.task_options)


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
    server_lr: float | None = setting(None, "server_lr", "server learning rate: global -= "
                                      "server_lr * momentum buffer; empty = the method's "
                                      "default", Check(0.0, low_open=True), fallback=1.0)
    server_momentum: float | None = setting(None, "server_momentum", "server momentum "
                                            "(FedAvgM convention: buf = m*buf + avg), DGC's "
                                            "momentum applied once per round to the aggregate, "
                                            "where it is never stale; empty = the method's "
                                            "default", Check(0.0, 1.0, high_open=True),
                                            fallback=0.0)
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
    shared_rank: str | None = setting(
        None, "dgc.shared_rank", "how the server ranks shared indices: aggregates (a moving "
        "average of the applied aggregates, dgc.shared_momentum; the sets travel with the "
        "model) or displacement (how far the model clients hold has moved from version 0, "
        "which clients compute themselves: no index bytes); empty = the method's default",
        Check(choices=SHARED_RANKS), fallback="aggregates")
    shared_churn: float = setting(1.0, "dgc.shared_churn", "the most of each shared index set "
                                  "that may change from one round to the next, the weakest "
                                  "members swapped for the strongest newcomers (GlueFL's "
                                  "bounded mask shift; dgc.shared_rank = aggregates); 1 = "
                                  "unbounded", Check(0.0, 1.0))
    feedback_scale: float = setting(0.0, "dgc.feedback_scale", "with dgc.feedback = aggregate: "
                                    "the reference is the sent model's movement per version "
                                    "times this; 0 = (1 - server_momentum) / server_lr, the mean "
                                    "pseudo-gradient that movement stands for",
                                    Check(0.0, 100.0))
    feedback_history: int = setting(50, "dgc.feedback_history", "with dgc.feedback = "
                                    "aggregate: the sent models the server keeps (one a "
                                    "version); a client last sent an older one compresses "
                                    "without a reference", Check(1, 100_000))
    robust: str = setting("auto", "robust", "the defaults of the aggregation keys left empty "
                          "(aggregation, max_weight_ratio, max_norm_ratio, min_cosine): off = "
                          "plain FedAvg (mean, no cap, no clip, no gate); on = for clients that "
                          "are not trusted (centered_clip, weights capped at the round's "
                          "median, updates pointing against the last round's aggregate left "
                          "out: min_cosine 0); auto = on in deployments and behind the phone "
                          "bridge, off in simulation (docs/threat_model.md)",
                          Check(choices=ROBUST_MODES))
    max_weight_ratio: float | None = setting(
        None, "max_weight_ratio", "a client's weight (num-examples) is capped at this times the "
        "median claim of the round's valid replies (server/defences.py); 0 = no cap; empty = "
        "by robust (off: 0, on: 1)", Check(0.0))
    max_norm_ratio: float | None = setting(
        None, "max_norm_ratio", "a client's update (with its signs) is scaled down to at most "
        "this times the median norm of the round's valid replies (1: norm bounding at the "
        "median, Sun et al. 2019); 0 = no clip; empty = by robust (0)", Check(0.0))
    aggregation: str | None = setting(
        None, "aggregation", "mean: weighted by num-examples (FedAvg); trimmed_mean or median: "
        "coordinate-wise over the round's clients, unweighted (Yin et al. 2018); centered_clip: "
        "each update's pull on last round's aggregate clipped to clip_radius times the median "
        "distance (Karimireddy et al. 2021); fltrust: updates scaled to the server's own update "
        "on root_samples training examples and weighted by their cosine with it (Cao et al. "
        "2021); empty = by robust (off: mean, on: centered_clip)",
        Check(choices=AGGREGATIONS))
    trim_fraction: float = setting(0.1, "trim_fraction", "with aggregation = trimmed_mean: the "
                                   "fraction of clients cut at each end of every coordinate "
                                   "(at least one client when above 0)",
                                   Check(0.0, 0.5, high_open=True))
    clip_radius: float = setting(1.0, "clip_radius", "with aggregation = centered_clip: the "
                                 "clipping radius, in medians of the clients' distances to the "
                                 "center", Check(0.0, low_open=True))
    clip_iterations: int = setting(3, "clip_iterations", "with aggregation = centered_clip: "
                                   "clipping iterations per round", Check(1, 100))
    min_cosine: float | None = setting(
        None, "min_cosine", "a client's update is left out of the round (rejected, its "
        "method folds it back) when its cosine with the last round's aggregate (the direction "
        "of history; none in round 1) is below this (server/aggregation.py); -1 = none left "
        "out; empty = by robust (off: -1, on: 0)", Check(-1.0, 1.0))
    root_samples: int = setting(100, "root_samples", "with aggregation = fltrust: training "
                                "examples the server holds (a seeded sample of the task's "
                                "training split), on which it takes its own round each round",
                                Check(1))
    downlink: str = setting("auto", "downlink", "auto: send a patch instead of the dense model "
                            "when the client holds a recent version and the patch is smaller",
                            Check(choices=DOWNLINKS))
    downlink_history: int = setting(1000, "downlink_history", "the most versions a patch may "
                                    "span; a client holding an older version gets the dense "
                                    "model (memory: one int32 per parameter, whatever the "
                                    "value)", Check(0))
    downlink_density: float | None = setting(
        None, "downlink_density", "1: clients are sent the global model exactly; below 1: a "
        "compressed broadcast, each round the server moves this fraction of the matrix entries "
        "of the model clients hold, those that differ most from the global model, by "
        "downlink_values (error feedback on the server; 1-D tensors whole, except with "
        "ternary); dense and fedavgm runs always get the exact model; empty = the method's "
        "default", Check(0.0, 1.0, low_open=True), fallback=0.05)
    downlink_values: str | None = setting(
        None, "downlink_values", "with downlink_density < 1: the grid the broadcast's matrix "
        "entries are rounded to; float16 (2 bytes per patch value) or int8 (a byte or less: per "
        "tensor a power-of-two step whose range is 8x its largest initial entry, doubled when "
        "the model outgrows it); or ternary: per tensor (1-D too) the entries move by sign * "
        "their mean difference, a bit each in a one-round patch (STC's downlink); empty = the "
        "method's default", Check(choices=DOWNLINK_VALUES), fallback="int8")
    downlink_deltas: bool = setting(True, "downlink_deltas", "with downlink_values int8: version "
                                    "0 is broadcast on the grid too, and a patch on the one "
                                    "version a client is known to hold carries differences "
                                    "(which the client adds) where those encode smaller")
    downlink_deadband: float | None = setting(
        None, "downlink_deadband", "with downlink_values int8: an entry of the broadcast moves "
        "only when the global model is more than this many grid steps from it (hysteresis: "
        "fewer entries change per round); 0.5 = whenever it rounds to another grid point; "
        "empty = the method's default", Check(0.5, 127.0), fallback=0.5)
    downlink_vectors: str | None = setting(
        None, "downlink_vectors", "with downlink_density < 1: the broadcast's one-dimensional "
        "tensors (biases) are copied whole every round, exactly (float32) or rounded to "
        "float16 (the rounding stays in the difference, and an entry whose float16 value did "
        "not move is not sent); empty = the method's default",
        Check(choices=("float32", "float16")), fallback="float32")
    downlink_context: bool | None = setting(
        None, "downlink_context", "with downlink_values int8 and downlink_deltas: a patch on "
        "the one version a client holds sends a matrix's changed entries per segment of its "
        "entries ranked by how far that version has moved from version 0 (which clients "
        "build), where that encodes smaller, and differences without a code for zero (wire "
        "value dtype 66); the same model in about a fifth fewer patch bytes; not on phones; "
        "empty = the method's default", fallback=False)
    downlink_compact: bool | None = setting(
        None, "downlink_compact", "patches as compact messages (tensors by their place in the "
        "model and its ranked segments, sizes as varints: dgc.wire.compact, docs/wire.md); the "
        "same sections in fewer bytes; not on phones; empty = the method's default",
        fallback=False)
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
                                "tensorboard package, in the dev extra: pip install -e "
                                "'.[tensorboard]' in the checkout)")
    engine: str = setting("ray", "sim.engine", "ray: Flower's simulation engine (Ray backend); "
                          "local: server.local_grid.LocalGrid, every client in this process "
                          "one after another (tests, debugging); batched: the same, but a "
                          "round's clients trained at once with torch.func (MLP and CNN "
                          "models; simulations/batched_engine.py), the local engine's models",
                          Check(choices=ENGINES))
    cpus_per_client: float = setting(1.0, "sim.cpus_per_client", "Ray CPUs per ClientApp "
                                     "actor (fractional allowed)", Check(0.0, low_open=True))
    num_cpus: int = setting(0, "sim.num_cpus", "CPUs Ray may use; 0 = all", Check(0))
    gpus_per_client: float = setting(0.0, "sim.gpus_per_client", "Ray GPUs per ClientApp "
                                     "actor (Flower's client_resources.num_gpus; 0.25: four "
                                     "clients share a GPU); 0 = Ray schedules clients by CPU "
                                     "alone", Check(0.0))
    ray_address: str = setting("", "sim.ray_address", "attach to a running Ray cluster "
                               "(HEAD:PORT of `ray start --head`, or auto) instead of starting "
                               "Ray here; its nodes declare their CPUs (sim.num_cpus must stay "
                               "0) and state_dir must be a folder every node mounts "
                               "(docs/cluster.md); empty = a fresh Ray instance on this machine")

    #: The per-method keys that the run's method filled, and the aggregation keys that
    #: ``robust`` filled (see TrainSettings.by_method).
    by_method: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

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
    """The whole configuration of a run: ``server`` keys, the clients' ``train`` keys, and the
    methods' own keys.

    Parameters
    ----------
    server : ServerSettings
        Rounds, server optimizer, downlink, checkpointing, results and Ray resources.
    train : TrainSettings
        Task, partition, local training and compression; sent to every client.
    own : mapping of str to value
        The own keys (:attr:`fedgc.methods.Method.settings`) of the run's method, and another
        method's given at a value other than its default; sent to every client too. (Not
        every registered method's: a method added to the registry changes no other method's
        run, its messages or its ``summary.json``.)
    """

    server: ServerSettings = field(default_factory=ServerSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    own: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        t = self.train
        outside = [k for k in parse_client_nodes(self.server.client_nodes) if k >= t.num_clients]
        if outside:
            raise SettingsError(f"client_nodes binds client keys {outside[:5]} outside [0, "
                                f"{t.num_clients}) (num_clients = {t.num_clients})")
        object.__setattr__(self, "server", _resolve(self.server, methods.get(t.method)))
        object.__setattr__(self, "server", _resolve_robust(self.server))
        object.__setattr__(self, "train", _resolve_attack(self.train, self.server))
        t = self.train
        # Another method's key at its default changes nothing: it is dropped, so that a method
        # added to the registry (or the next method of a comparison) leaves this run as it was.
        mine, every = _own_defaults(t.method), _own_defaults_of(methods.loaded())
        given = {k: v for k, v in self.own.items()
                 if k in mine or k not in every or v != every[k]}
        object.__setattr__(self, "own", {**mine, **given})
        hostile = parse_attack_clients(t.attack_clients)
        outside = sorted(k for k in hostile if k >= t.num_clients)
        if outside:
            raise SettingsError(f"attack.clients names client keys {outside[:5]} outside [0, "
                                f"{t.num_clients}) (num_clients = {t.num_clients})")
        if t.attack_kind == "alie" and len(hostile) > t.clients_per_round // 2:
            raise SettingsError(f"attack.kind = alie needs fewer colluders than half the round "
                                f"(Baruch et al.'s supporters): {len(hostile)} in "
                                f"attack.clients, clients_per_round = {t.clients_per_round}")
        if t.feedback != "residual" and self.server.downlink == "dense":
            raise SettingsError(f"dgc.feedback = {t.feedback} needs downlink = auto: its "
                                f"reference is how the model a client keeps moved, and with "
                                f"downlink = dense clients keep none")
        if t.clients_per_round > t.num_clients:
            raise SettingsError(f"clients_per_round = {t.clients_per_round} must be <= "
                                f"num_clients = {t.num_clients}")
        if not self.server.run_name:
            # Named once, here: to_flat() and with_overrides() then carry the same folder.
            label = t.method if not is_ref(t.method) else methods.get(t.method).title
            named = dataclasses.replace(self.server, run_name=new_run_name(
                self.server.results_dir, f"{t.task}-{label}"))
            object.__setattr__(named, "by_method", self.server.by_method)
            object.__setattr__(self, "server", named)

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
        own_keys = {f.metadata["key"] for m in methods.loaded() if m.settings is not None
                    for f in fields_of(m.settings)}
        unknown = sorted(set(values) - set(cls.keys()) - own_keys)
        if unknown:
            raise unknown_keys(unknown, set(cls.keys()) | own_keys)
        server_keys = {f.metadata["key"] for f in fields_of(ServerSettings)}
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
        return sorted(known_keys([ServerSettings, TrainSettings]) + list(_own_defaults()))

    @property
    def method(self) -> methods.Method:
        """The run's method, configured with its own keys."""
        return methods.get(self.train.method).with_keys(self.own)

    def to_flat(self) -> dict[str, bool | int | float | str]:
        """All keys with their values (what ``summary.json`` records as the run's config)."""
        return {**to_flat(self.server), **to_flat(self.train), **self.own}

    def with_overrides(self, values: Mapping[str, object]) -> RunConfig:
        """A copy with some keys replaced (validated like :meth:`from_flat`); the keys the
        method filled go back to "" (the next method's default)."""
        mine = self.server.by_method | self.train.by_method
        return RunConfig.from_flat({**{k: ("" if k in mine else v)
                                       for k, v in self.to_flat().items()}, **values})

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

    def client_config(self) -> dict[str, bool | int | float | str]:
        """The keys every train message carries: the clients' keys (``state_dir`` absolute)
        and the methods' own keys. The attack keys only where a client attacks: without them
        a client has no attack (their defaults), and a run's messages stay the size they were
        before the keys existed (the emulator charges their bytes to the links)."""
        flat = to_flat(self.client_train_settings())
        if not self.train.attack_clients:
            flat = {k: v for k, v in flat.items() if not k.startswith("attack.")}
        return {**flat, **self.own}

    @staticmethod
    def describe() -> list[tuple[str, str, str, str, str]]:
        """(key, type, default, accepted range, doc) of every key of :meth:`keys`."""
        rows = describe(ServerSettings, method_default) + describe(TrainSettings, method_default)
        for m in methods.registered():
            if m.settings is not None:
                rows += describe(m.settings, method_default)
        return sorted(rows)


def _own_defaults(method: str = "") -> dict[str, Any]:
    """The own keys at their defaults: of ``method`` (a registered name or ``module:callable``)
    when given, of every registered method otherwise (the keys a run accepts)."""
    return _own_defaults_of([methods.get(method)] if method else methods.registered())


def _own_defaults_of(these: Sequence[methods.Method]) -> dict[str, Any]:
    """The own keys of ``these`` methods at their defaults."""
    out: dict[str, Any] = {}
    for m in these:
        if m.settings is not None:
            out.update(to_flat(m.settings()))
    return out


def _parse_own(values: Mapping[str, object]) -> dict[str, Any]:
    """The methods' own keys given in ``values``, checked by their schemas (of every method
    this process knows)."""
    out: dict[str, Any] = {}
    for m in methods.loaded():
        if m.settings is not None:
            mine = {f.metadata["key"] for f in fields_of(m.settings)}
            given = {k: v for k, v in values.items() if k in mine}
            if given:
                own = parse(m.settings, given)
                validate(own)  # a method's schema need not check itself
                out.update({k: v for k, v in to_flat(own).items() if k in given})
    return out


def _filled(obj: Any, values: Mapping[str, Any]) -> Any:
    """``obj`` with the fields named by key in ``values`` replaced, named in ``by_method`` (so
    that ``with_overrides`` fills them again)."""
    if not values:
        return obj
    names = {f.metadata["key"]: f.name for f in fields_of(type(obj))}
    out = dataclasses.replace(obj, **{names[k]: v for k, v in values.items()})
    object.__setattr__(out, "by_method", frozenset(values) | obj.by_method)
    return out


def _resolve_robust(server: ServerSettings) -> ServerSettings:
    """``server`` with the aggregation keys left empty set by ``robust``'s profile
    (:data:`ROBUST_PROFILES`; auto: off until the run knows where it runs)."""
    profile = ROBUST_PROFILES["on" if server.robust == "on" else "off"]
    keys = {f.metadata["key"]: f.name for f in fields_of(ServerSettings)}
    return _filled(server, {k: v for k, v in profile.items()
                            if getattr(server, keys[k]) is None})


def _resolve_attack(train: TrainSettings, server: ServerSettings) -> TrainSettings:
    """``train`` with an empty ``attack.norm_ratio`` / ``attack.weight_ratio`` just under the
    server's bounds (:data:`ATTACK_MARGIN` of them; :data:`UNBOUNDED_ATTACK` without one)."""
    bounds = {"norm_ratio": server.max_norm_ratio, "weight_ratio": server.max_weight_ratio}
    unbounded = dict(UNBOUNDED_ATTACK)
    if train.attack_kind in COLLUDING_ATTACKS:
        # Colluders blend in: without a cap they claim the benign median (Shejwalkar and
        # Houmansadr's attackers weigh as much as a benign client).
        unbounded["weight_ratio"] = 1.0
    values = {}
    for name, bound in bounds.items():
        if getattr(train, f"attack_{name}") is None:
            values[f"attack.{name}"] = ATTACK_MARGIN * bound if bound else unbounded[name]
    return _filled(train, values)


def parse_attack_clients(text: str) -> frozenset[int]:
    """``"0,1, 5"`` -> ``{0, 1, 5}`` (``attack.clients``); ``""`` -> none.

    Raises
    ------
    SettingsError
        An item that is not a whole number >= 0.
    """
    out = set()
    for item in filter(None, (i.strip() for i in text.split(","))):
        if not (item.isascii() and item.isdigit() and len(item) <= 12):
            raise SettingsError(f"attack.clients item {item[:30]!r} is not a client key (a "
                                f"whole number >= 0); expected keys such as '0,1'")
        out.add(int(item))
    return frozenset(out)


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
