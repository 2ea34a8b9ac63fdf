"""DGCConfig: every hyperparameter of Deep Gradient Compression, with its default and its reason."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dgc.errors import ConfigError
from dgc.sparse import VALUE_DTYPES

#: Top-k threshold selections (see :class:`DGCConfig`'s ``selection``).
SELECTIONS = ("exact", "sampled")
#: Density warm-up schedules (see :class:`DGCConfig`'s ``warmup``).
WARMUP_SCHEDULES = ("exponential", "list", "none")


@dataclass(frozen=True)
class Check:
    """Accepted values of one setting: a numeric interval or a set of choices.

    Defined here, next to the fields it guards, so that :class:`DGCConfig` and the run-config
    keys built on its fields (``fedgc.settings``) share one range per hyperparameter.
    """

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
        """Whether ``value`` (already of the setting's type) is in range; NaN and Inf never are."""
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


_KINDS = {bool: "True or False", int: "an integer", float: "a number", str: "a string"}


def check_value(name: str, value: object, kind: type, check: Check) -> None:
    """Raise :class:`ConfigError` naming ``name`` unless ``value`` is a ``kind`` that ``check``
    accepts (an int is a float; a bool is neither)."""
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok or not check.accepts(value):
        accepted = check.describe()
        where = "" if accepted == "any" or check.choices else f" in {accepted}"
        what = accepted if check.choices else f"{_KINDS.get(kind, kind.__name__)}{where}"
        raise ConfigError(f"{name} must be {what}, got {value!r}")


_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "float | None": float}


def _field(default: Any, check: Check | None = None, *, optional: bool = False) -> Any:
    # The value's type comes from the field's annotation (_TYPES).
    return dataclasses.field(default=default, metadata={"check": check or Check(),
                                                        "optional": optional})


@dataclass(frozen=True)
class DGCConfig:
    """Hyperparameters of Deep Gradient Compression (Lin et al., ICLR 2018, arXiv 1712.01887).

    Parameters
    ----------
    density : float, default 0.001
        Fraction of each sparsified tensor's entries sent per step, in (0, 1]. The paper sends the
        top 0.1% (99.9% sparsity).
    selection : {"exact", "sampled"}, default "sampled"
        "exact" takes ``torch.topk`` of the whole tensor. "sampled" estimates the top-k threshold on
        a deterministic strided sample, selects by comparison and re-selects exactly when the count
        misses (paper, Sec. 3.4); it is much faster on large tensors.
    sample_ratio : float, default 0.01
        Fraction of entries in the threshold sample; the paper samples 0.1%-1%. The sample always
        holds at least ``2 / density`` entries so that its own top-k has two or more entries.
    min_count_ratio : float, default 0.5
        The sampled selection accepts a count in ``[min_count_ratio * k, k]``. A larger count is
        trimmed to the k largest magnitudes; a smaller one lowers the threshold.
    max_adaptations : int, default 2
        How many times the sampled selection lowers its threshold before falling back to exact
        top-k (the adaptation is bounded so the cost stays bounded).
    momentum : float, default 0.9
        Momentum factor m, in [0, 1).
    momentum_correction : bool, default True
        Accumulate the velocity ``u = m*u + g`` into the residual instead of the raw gradient
        (paper, Sec. 3.2). Off: the residual accumulates the gradient (plain error feedback).
    nesterov : bool, default False
        Nesterov form of momentum correction: ``u = m*(u + g); v = v + u + g``.
    dampening : float, default 0.0
        Scale of the new gradient in the momentum, ``u = m*u + (1 - dampening)*g``, as in
        ``torch.optim.SGD`` (which, like this compressor, takes the first gradient undamped).
        ``dampening = momentum`` keeps the step size of plain SGD, which matters in federated
        rounds where momentum would otherwise multiply the step (see README).
    momentum_masking : bool, default True
        Momentum factor masking: zero the momentum where entries were sent, so stale momentum does
        not keep pushing coordinates already applied (paper, Sec. 3.3).
    error_feedback : bool, default True
        Keep what was not sent in the residual. Off: unsent mass is dropped each step (top-k
        without error feedback; for comparison only, it loses accuracy).
    clip_norm : float or None, default None
        Global gradient-norm threshold. When set, each worker clips its gradient, before
        accumulation, to ``clip_norm * num_workers ** -0.5`` (local gradient clipping, Sec. 3.3).
    num_workers : int, default 1
        N in the local clipping threshold: the number of workers whose updates are summed.
    warmup : {"exponential", "list", "none"}, default "exponential"
        Density schedule over the first epochs. "exponential": density ``4 ** -(e + 1)`` in epoch
        e until it reaches ``density`` (75%, 93.75%, 98.44%, 99.6% sparsity, then the target).
        "list": ``warmup_densities[e]`` for each listed epoch (never below ``density``).
        "none": the target from the start.
    warmup_epochs : int, default 4
        Epochs the exponential schedule lasts (four for CIFAR and ImageNet, one for PTB and speech).
    warmup_densities : tuple of float, default ()
        The per-epoch densities of the "list" schedule; an error with any other schedule.
    dense_epochs : int, default 0
        Epochs sent fully dense before any warm-up or sparsification starts.
    min_sparse_numel : int, default 1024
        Tensors smaller than this, and every tensor with ``dim <= 1`` (biases, norms), are sent
        dense: sparsifying them saves little and indices would cost more than the values.
    sparse_vectors : bool, default False
        Sparsify 1-D tensors of at least ``min_sparse_numel`` entries too. An LSTM's biases are
        4 x hidden entries per layer and pair (``bias_ih``, ``bias_hh``): sent dense they were
        most of its update (docs/tasks.md). Off, as in the paper: every 1-D tensor is dense.
    value_dtype : {"float32", "float16", "bfloat16"}, default "float16"
        Precision of the sent values. Rounding error stays in the residual, so nothing is lost.
    ternary : bool, default False
        Send each sparsified tensor's selected entries as ``sign(v) * mean(|v|)`` (one scale per
        tensor, in ``value_dtype``), as sparse ternary compression does (Sattler et al., 2019);
        :func:`dgc.encode` with ``sign_coding=True`` then carries them in one bit each. What the
        scale does not carry stays in the residual (error feedback). Not in the paper's DGC;
        tensors sent dense keep their values.
    check_finite : bool, default True
        Reject a gradient that contains NaN or Inf before any state changes.

    Weight decay is not a compressor field: it is applied where the model is updated and is never
    sent (paper, Sec. 3).
    """

    # Tuned hyperparameters (the paper's values as defaults).
    density: float = _field(0.001, Check(0.0, 1.0, low_open=True))
    selection: str = _field("sampled", Check(choices=SELECTIONS))
    sample_ratio: float = _field(0.01, Check(0.0, 1.0, low_open=True))
    min_count_ratio: float = _field(0.5, Check(0.0, 1.0, low_open=True))
    max_adaptations: int = _field(2, Check(0))
    momentum: float = _field(0.9, Check(0.0, 1.0, high_open=True))
    # Switches.
    momentum_correction: bool = _field(True)
    nesterov: bool = _field(False)
    dampening: float = _field(0.0, Check(0.0, 1.0))
    momentum_masking: bool = _field(True)
    error_feedback: bool = _field(True)
    # None = no clipping; a threshold must be a positive finite number.
    clip_norm: float | None = _field(None, Check(0.0, low_open=True), optional=True)
    num_workers: int = _field(1, Check(1))
    # Schedule.
    warmup: str = _field("exponential", Check(choices=WARMUP_SCHEDULES))
    warmup_epochs: int = _field(4, Check(0))
    warmup_densities: tuple[float, ...] = ()
    dense_epochs: int = _field(0, Check(0))
    # Wire.
    min_sparse_numel: int = _field(1024, Check(1))
    sparse_vectors: bool = _field(False)
    value_dtype: str = _field("float16", Check(choices=tuple(VALUE_DTYPES)))
    ternary: bool = _field(False)
    check_finite: bool = _field(True)

    def __post_init__(self) -> None:
        densities = self.warmup_densities
        if isinstance(densities, (str, bytes)) or not isinstance(densities, Iterable):
            raise ConfigError(f"warmup_densities must be a sequence of numbers in (0, 1], "
                              f"got {densities!r}")
        densities = tuple(densities)
        for i, d in enumerate(densities):
            check_value(f"warmup_densities[{i}]", d, float, Check(0.0, 1.0, low_open=True))
        object.__setattr__(self, "warmup_densities", tuple(float(d) for d in densities))
        for f in dataclasses.fields(self):
            if "check" in f.metadata:
                value = getattr(self, f.name)
                if not (f.metadata["optional"] and value is None):
                    check_value(f.name, value, _TYPES[str(f.type)], f.metadata["check"])
        if self.warmup == "list" and not self.warmup_densities:
            raise ConfigError("warmup='list' needs a non-empty warmup_densities")
        if self.warmup != "list" and self.warmup_densities:
            # Silently ignoring the list would run a schedule the user did not ask for.
            raise ConfigError(f"warmup_densities is only used with warmup='list', but warmup is "
                              f"{self.warmup!r}")

    @classmethod
    def check(cls, name: str) -> Check:
        """The accepted values of field ``name`` (what run-config keys of it derive from)."""
        for f in dataclasses.fields(cls):
            if f.name == name and "check" in f.metadata:
                return f.metadata["check"]
        raise ConfigError(f"DGCConfig has no checked field {name!r}")

    def sends_dense(self, shape: Sequence[int]) -> bool:
        """The layer policy: whether a tensor of this shape is sent whole every step.

        The one copy of the rule; the compressor, the DDP hook, the sign channel's planner and
        the phone's export all ask it.
        """
        numel = math.prod(shape)
        return numel < self.min_sparse_numel or (len(shape) <= 1 and not self.sparse_vectors)

    def density_at(self, epoch: float) -> float:
        """Density to send in (possibly fractional) ``epoch``, warm-up included."""
        if not (isinstance(epoch, (int, float)) and math.isfinite(epoch) and epoch >= 0):
            raise ConfigError(f"epoch must be a finite number >= 0, got {epoch!r}")
        e = math.floor(epoch)
        if e < self.dense_epochs:
            return 1.0
        e -= self.dense_epochs
        if self.warmup == "exponential" and e < self.warmup_epochs:
            return max(self.density, 4.0 ** -(e + 1))
        if self.warmup == "list" and e < len(self.warmup_densities):
            return max(self.density, self.warmup_densities[e])
        return self.density

    def to_dict(self) -> dict[str, Any]:
        """Plain-value form, for manifests, checkpoints and logs."""
        d = dataclasses.asdict(self)
        d["warmup_densities"] = list(self.warmup_densities)
        return d

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> DGCConfig:
        """Inverse of :meth:`to_dict`; an unknown key is an error that names it."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown DGCConfig field(s) {unknown}; known: {sorted(known)}")
        kwargs = dict(values)
        if "warmup_densities" in kwargs:
            kwargs["warmup_densities"] = tuple(kwargs["warmup_densities"])
        return cls(**kwargs)


