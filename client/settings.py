"""Typed, validated settings schemas: the keys a client reads from its train message.

A schema is a frozen dataclass whose fields carry their external key (``dgc.density``), a
docstring and an accepted range in field metadata, so that parsing, validation, error messages and
the documentation table all come from one place. The server's run config
(:mod:`server.config`) reuses the same machinery and embeds :class:`TrainSettings`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, get_type_hints

from dgc import Compressor, DGCCompressor, DGCConfig
from dgc.two_density import TwoDensityCompressor

METHODS = ("dense", "topk", "dgc")
TASKS = ("mnist5k", "digits", "fashion-mnist", "shakespeare")
PARTITIONS = ("iid", "dirichlet", "shards", "natural")
WARMUPS = ("exponential", "none")
SELECTIONS = ("exact", "sampled")
VALUE_DTYPES = ("float32", "float16", "bfloat16")

T = TypeVar("T")


class SettingsError(ValueError):
    """A configuration key is unknown, or its value is outside the accepted range."""


@dataclass(frozen=True)
class Check:
    """Accepted values of one key: a numeric interval or a set of choices."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        """Human-readable accepted range, e.g. ``(0, 1]`` or ``one of ['a', 'b']``."""
        if self.choices:
            return f"one of {list(self.choices)}"
        if self.low is None and self.high is None:
            return "any"
        lo = "-inf" if self.low is None else _num(self.low)
        hi = "inf" if self.high is None else _num(self.high)
        left = "(" if self.low_open or self.low is None else "["
        right = ")" if self.high_open or self.high is None else "]"
        return f"{left}{lo}, {hi}{right}"

    def accepts(self, value: object) -> bool:
        """Whether ``value`` (already of the field's type) is in range."""
        if self.choices:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return True
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        if self.high is not None and (value > self.high or
                                      (self.high_open and value == self.high)):
            return False
        return True


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def setting(default: Any, key: str, doc: str, check: Check | None = None) -> Any:
    """A dataclass field with its external key, documentation and accepted range."""
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
    if kind is int:
        if isinstance(value, bool):
            raise SettingsError(f"{key} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise SettingsError(f"{key} must be an integer, got {value!r}")
    if kind is float:
        if isinstance(value, bool):
            raise SettingsError(f"{key} must be a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise SettingsError(f"{key} must be a number, got {value!r}")
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
            kwargs[f.name] = coerce(key, values[key], hints[f.name])
    return cls(**kwargs)


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


def _frac() -> Check:
    return Check(0.0, 1.0, low_open=True)


def _momentum() -> Check:
    return Check(0.0, 1.0, high_open=True)


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

    task: str = setting("mnist5k", "task", "dataset and model (tasks.get_task)", Check(
        choices=TASKS))
    num_clients: int = setting(100, "num_clients", "number of data partitions (= clients)",
                               Check(1))
    partition: str = setting("dirichlet", "partition", "how the training set is split",
                             Check(choices=PARTITIONS))
    alpha: float = setting(0.5, "alpha", "Dirichlet concentration (smaller = more label skew)",
                           Check(0.0, low_open=True))
    seed: int = setting(0, "seed", "seed of partitioning, sampling and local shuffling", Check(0))
    method: str = setting("dgc", "method", "uplink compression: dense fp32, top-k without error "
                          "feedback, or DGC", Check(choices=METHODS))
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
                             "per round after warm-up (topk and dgc)", _frac())
    dgc_momentum: float = setting(0.0, "dgc.momentum", "momentum m of DGC's momentum "
                                  "correction on the pseudo-gradient; 0 = residual only",
                                  _momentum())
    dampening: float = setting(0.0, "dgc.dampening", "u = m*u + (1 - dampening)*g; "
                               "dampening = m keeps the step size of plain SGD", Check(0.0, 1.0))
    momentum_correction: bool = setting(False, "dgc.momentum_correction", "accumulate the "
                                        "velocity (True) or the raw pseudo-gradient (False: "
                                        "error feedback only)")
    nesterov: bool = setting(False, "dgc.nesterov", "Nesterov form of momentum correction")
    momentum_masking: bool = setting(True, "dgc.momentum_masking", "zero the momentum at the "
                                     "sent coordinates (momentum factor masking)")
    small_density: float = setting(0.1, "dgc.small_density", "density of the sparsified "
                                   "tensors of at most dgc.small_numel entries (an output "
                                   "layer; topk and dgc); 0 = off, they use dgc.density",
                                   Check(0.0, 1.0))
    small_numel: int = setting(10_000, "dgc.small_numel", "size limit, in entries, of a tensor "
                               "that gets dgc.small_density", Check(1))
    warmup: str = setting("exponential", "dgc.warmup", "density warm-up schedule over the "
                          "first rounds: 4**-(r+1) until it reaches dgc.density",
                          Check(choices=WARMUPS))
    warmup_rounds: int = setting(4, "dgc.warmup_rounds", "rounds the warm-up lasts (the "
                                 "paper's warm-up epochs, counted in server rounds)", Check(0))
    selection: str = setting("sampled", "dgc.selection", "top-k threshold: exact or sampled",
                             Check(choices=SELECTIONS))
    value_dtype: str = setting("float16", "dgc.value_dtype", "precision of sent values",
                               Check(choices=VALUE_DTYPES))
    ternary: bool = setting(False, "dgc.ternary", "send sparsified tensors' entries as "
                            "sign * mean magnitude, one bit each on the wire (sparse ternary "
                            "compression; not for phones)")
    min_sparse_numel: int = setting(1024, "dgc.min_sparse_numel", "tensors smaller than this "
                                    "(and every 1-D tensor) are sent dense", Check(1))
    clip_norm: float = setting(0.0, "dgc.clip_norm", "local gradient clipping threshold "
                               "(scaled by clients_per_round**-0.5); 0 = off", Check(0.0))
    clients_per_round: int = setting(10, "clients_per_round", "clients whose updates are "
                                     "aggregated per round", Check(1))
    state_dir: str = setting("", "state_dir", "folder of the per-client state store (residual, "
                             "pending update, held model); empty = <results>/<run>/client_state")

    def __post_init__(self) -> None:
        validate(self)
        if self.local_epochs == 0 and self.local_steps == 0:
            raise SettingsError("local_epochs and local_steps are both 0: set local_epochs >= 1 "
                                "or local_steps >= 1")

    def dgc_config(self) -> DGCConfig:
        """The compressor configuration of this method (None-like for dense: density 1)."""
        common = dict(
            density=self.density, selection=self.selection, value_dtype=self.value_dtype,
            ternary=self.ternary,
            min_sparse_numel=self.min_sparse_numel,
            warmup="exponential" if self.warmup == "exponential" and self.warmup_rounds else "none",
            warmup_epochs=max(self.warmup_rounds, 0),
        )
        if self.method == "topk":
            # Same bytes as DGC, but nothing is remembered between rounds: the contrast case.
            return DGCConfig(momentum=0.0, momentum_correction=False, momentum_masking=False,
                             error_feedback=False, **common)
        if self.method == "dgc":
            return DGCConfig(
                momentum=self.dgc_momentum, momentum_correction=self.momentum_correction,
                nesterov=self.nesterov, dampening=self.dampening,
                momentum_masking=self.momentum_masking, error_feedback=True,
                clip_norm=self.clip_norm or None, num_workers=self.clients_per_round, **common)
        raise SettingsError(f"method {self.method!r} has no compressor (dense sends fp32)")


    def compressor(self) -> Compressor:
        """A fresh compressor of this method: one density, or two when dgc.small_density > 0.

        Small sparsified tensors (``dgc.small_numel`` entries or fewer, e.g. a 10x200 output
        layer) get ``dgc.small_density``: at ``dgc.density`` alone they would send 2 entries per
        update (docs/federated_momentum.md). ``topk`` uses the same split, so that it differs
        from ``dgc`` only in keeping no residual.
        """
        config = self.dgc_config()
        if self.small_density == 0.0:
            return DGCCompressor(config)
        return TwoDensityCompressor(config, self.small_density, small_numel=self.small_numel)


def known_keys(classes: Sequence[type]) -> list[str]:
    """Every external key of the given schema classes, sorted."""
    return sorted(f.metadata["key"] for cls in classes for f in fields_of(cls))
