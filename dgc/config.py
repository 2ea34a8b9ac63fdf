"""DGCConfig: every hyperparameter of Deep Gradient Compression, with its default and its reason."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dgc.errors import ConfigError
from dgc.sparse import VALUE_DTYPES

SELECTIONS = ("exact", "sampled")
WARMUP_SCHEDULES = ("exponential", "list", "none")
_BOOL_FIELDS = ("momentum_correction", "nesterov", "momentum_masking", "error_feedback",
                "ternary", "check_finite")


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

    density: float = 0.001
    selection: str = "sampled"
    sample_ratio: float = 0.01
    min_count_ratio: float = 0.5
    max_adaptations: int = 2
    momentum: float = 0.9
    momentum_correction: bool = True
    nesterov: bool = False
    dampening: float = 0.0
    momentum_masking: bool = True
    error_feedback: bool = True
    clip_norm: float | None = None
    num_workers: int = 1
    warmup: str = "exponential"
    warmup_epochs: int = 4
    warmup_densities: tuple[float, ...] = ()
    dense_epochs: int = 0
    min_sparse_numel: int = 1024
    value_dtype: str = "float16"
    ternary: bool = False
    check_finite: bool = True

    def __post_init__(self) -> None:
        densities = self.warmup_densities
        if isinstance(densities, (str, bytes)) or not isinstance(densities, Iterable):
            raise ConfigError(f"warmup_densities must be a sequence of numbers in (0, 1], "
                              f"got {densities!r}")
        densities = tuple(densities)
        for i, d in enumerate(densities):
            _check_fraction(f"warmup_densities[{i}]", d)
        object.__setattr__(self, "warmup_densities", tuple(float(d) for d in densities))
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        _check_fraction("density", self.density)
        _check_choice("selection", self.selection, SELECTIONS)
        _check_fraction("sample_ratio", self.sample_ratio)
        _check_fraction("min_count_ratio", self.min_count_ratio)
        _check_int("max_adaptations", self.max_adaptations, 0)
        if not (_is_number(self.momentum) and 0.0 <= self.momentum < 1.0):
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum!r}")
        if not (_is_number(self.dampening) and 0.0 <= self.dampening <= 1.0):
            raise ConfigError(f"dampening must be in [0, 1], got {self.dampening!r}")
        if self.clip_norm is not None and not (
            _is_number(self.clip_norm) and math.isfinite(self.clip_norm) and self.clip_norm > 0
        ):
            raise ConfigError(f"clip_norm must be a positive finite number or None, "
                              f"got {self.clip_norm!r}")
        _check_int("num_workers", self.num_workers, 1)
        _check_choice("warmup", self.warmup, WARMUP_SCHEDULES)
        _check_int("warmup_epochs", self.warmup_epochs, 0)
        if self.warmup == "list" and not self.warmup_densities:
            raise ConfigError("warmup='list' needs a non-empty warmup_densities")
        if self.warmup != "list" and self.warmup_densities:
            # Silently ignoring the list would run a schedule the user did not ask for.
            raise ConfigError(f"warmup_densities is only used with warmup='list', but warmup is "
                              f"{self.warmup!r}")
        _check_int("dense_epochs", self.dense_epochs, 0)
        _check_int("min_sparse_numel", self.min_sparse_numel, 1)
        _check_choice("value_dtype", self.value_dtype, tuple(VALUE_DTYPES))

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


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_fraction(name: str, value: object) -> None:
    if not _is_number(value) or not 0.0 < value <= 1.0:
        raise ConfigError(f"{name} must be a number in (0, 1], got {value!r}")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {list(choices)}, got {value!r}")
