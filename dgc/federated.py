"""Federated adaptations of DGC: per-group density, stale client state, server-side momentum.

The paper's momentum correction (Lin et al., ICLR 2018, Sec. 3.2) assumes that every worker takes
part in every step. In cross-device federated learning a client sends one pseudo-gradient per round
(after several local steps) and takes part in few rounds. What follows was measured in
``docs/federated_momentum.md`` (``bench/fl_momentum.py``):

* :class:`TwoDensityCompressor` gives small weight tensors (an output layer) their own density:
  the per-tensor budget otherwise leaves them a couple of entries per update. Part of the chosen
  default (error feedback only, no momentum correction).
* :class:`ServerMomentum` is the server optimizer for aggregated pseudo-gradients (FedAvg at lr 1,
  momentum 0; FedAvgM with momentum). Measured: momentum helps dense aggregates but hurts sparse
  ones, so the default keeps it at 0.
* :class:`StaleStatePolicy` decays a client's momentum (and optionally its residual) by the rounds
  it missed. It halves the loss of naive momentum correction but does not beat error feedback.
* :class:`RowwiseCompressor` spends the density per output unit instead of per tensor. Measured
  worse on the MLP; kept for models where per-tensor top-k starves whole units.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dgc.compressor import DGCCompressor, all_finite
from dgc.config import DGCConfig
from dgc.errors import ConfigError, StateError
from dgc.sparse import SparseTensor, SparseUpdate

_ROW = "#row"


@dataclass(frozen=True)
class StaleStatePolicy:
    """How a client's DGC state ages over the rounds it did not take part in.

    Parameters
    ----------
    momentum_decay : float or None, default None
        Factor applied to the momentum ``u`` once per missed round, in [0, 1]. ``None`` uses the
        compressor's own momentum factor m: the momentum then decays exactly as it would have over
        steps with a zero gradient. 0 resets the momentum whenever a round was missed: the next
        step starts it afresh from the gradient, as a new compressor would.
    residual_decay : float, default 1.0
        Factor applied to the residual ``v`` once per missed round, in [0, 1]. 1 keeps every unsent
        value (no gradient mass is lost); smaller values forget old, stale residual.
    """

    momentum_decay: float | None = None
    residual_decay: float = 1.0

    def __post_init__(self) -> None:
        if self.momentum_decay is not None:
            _check_unit("momentum_decay", self.momentum_decay)
        _check_unit("residual_decay", self.residual_decay)

    def apply(self, compressor: Any, rounds_missed: int) -> None:
        """Age ``compressor``'s momentum and residual by ``rounds_missed`` rounds, in place.

        ``compressor`` is a :class:`~dgc.DGCCompressor`, or any of this module's compressors.
        """
        if isinstance(rounds_missed, bool) or not isinstance(rounds_missed, int) \
                or rounds_missed < 0:
            raise StateError(f"rounds_missed must be an integer >= 0, got {rounds_missed!r}")
        if rounds_missed == 0:
            return
        for part in getattr(compressor, "parts", ()):
            self.apply(part, rounds_missed)
        if hasattr(compressor, "parts"):
            return
        m = compressor.config.momentum if self.momentum_decay is None else self.momentum_decay
        u_factor = m ** rounds_missed
        v_factor = self.residual_decay ** rounds_missed
        memory = compressor.memory
        if u_factor == 0.0:
            # Dropped, not zeroed: the next step then starts the momentum buffer afresh from the
            # gradient, as torch.optim.SGD does (zeros would give only (1 - dampening) * g).
            memory.u.clear()
        elif u_factor != 1.0:
            for u in memory.u.values():
                u.mul_(u_factor)
        if v_factor != 1.0:
            for v in memory.v.values():
                v.mul_(v_factor)


class ServerMomentum:
    """Server optimizer for aggregated pseudo-gradients: ``b = mu*b + g; w -= lr * b``.

    With ``momentum=0`` and ``lr=1`` it is FedAvg's plain model averaging. Momentum here is DGC's
    momentum applied once per round to the global aggregate, where it is never stale.

    Parameters
    ----------
    lr : float, default 1.0
        Server learning rate, > 0.
    momentum : float, default 0.0
        Momentum factor mu, in [0, 1).
    nesterov : bool, default False
        Nesterov form: ``w -= lr * (g + mu*b)``.
    """

    def __init__(self, lr: float = 1.0, momentum: float = 0.0, nesterov: bool = False) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) \
                or lr <= 0:
            raise ConfigError(f"server lr must be a finite number > 0, got {lr!r}")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) \
                or not 0.0 <= momentum < 1.0:
            raise ConfigError(f"server momentum must be in [0, 1), got {momentum!r}")
        if nesterov and momentum == 0.0:
            raise ConfigError("nesterov=True needs a server momentum > 0")
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.buffer: dict[str, torch.Tensor] = {}

    def step(self, params: Mapping[str, torch.Tensor],
             pseudo_gradient: Mapping[str, torch.Tensor]) -> None:
        """Apply one aggregated pseudo-gradient to ``params`` in place.

        Every tensor is checked (known name, same shape, finite) before any parameter or buffer
        changes, so a bad aggregate leaves the model and the optimizer as they were.
        """
        for name, g in pseudo_gradient.items():
            if name not in params:
                raise StateError(f"pseudo-gradient tensor {name!r} is not a model parameter; "
                                 f"known: {sorted(params)}")
            if tuple(g.shape) != tuple(params[name].shape):
                raise StateError(f"pseudo-gradient {name!r} has shape {tuple(g.shape)}, the "
                                 f"parameter has {tuple(params[name].shape)}")
            if not torch.isfinite(g).all():
                raise StateError(f"pseudo-gradient {name!r} holds NaN or Inf")
        for name, g in pseudo_gradient.items():
            g = g.to(params[name].dtype)
            if self.momentum == 0.0:
                params[name].sub_(g, alpha=self.lr)
                continue
            b = self.buffer.get(name)
            if b is None:
                b = self.buffer[name] = torch.zeros_like(params[name])
            b.mul_(self.momentum).add_(g)
            direction = g.add(b, alpha=self.momentum) if self.nesterov else b
            params[name].sub_(direction, alpha=self.lr)

    def state_dict(self) -> dict[str, Any]:
        """Settings and momentum buffers (copies), for checkpoints."""
        return {"lr": self.lr, "momentum": self.momentum, "nesterov": self.nesterov,
                "buffer": {k: b.clone() for k, b in self.buffer.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; a malformed state changes nothing."""
        missing = {"lr", "momentum", "nesterov", "buffer"} - set(state)
        if missing:
            raise StateError(f"server momentum state lacks {sorted(missing)}")
        probe = ServerMomentum(state["lr"], state["momentum"], state["nesterov"])
        buffer = {}
        for k, b in state["buffer"].items():
            if not isinstance(b, torch.Tensor) or not torch.isfinite(b).all():
                raise StateError(f"server momentum buffer {k!r} must be a finite tensor")
            buffer[k] = b.detach().clone()
        self.lr, self.momentum, self.nesterov = probe.lr, probe.momentum, probe.nesterov
        self.buffer = buffer


class TwoDensityCompressor:
    """DGC with a second, higher density for the small sparsified tensors (an output layer).

    The per-tensor budget ``ceil(density * numel)`` gives a small weight tensor almost nothing:
    a 10x200 output layer gets 2 entries per update at density 0.001, so in federated rounds (a
    client sends a few dozen updates in a whole run) most of its weights are never updated.
    Tensors of at most ``small_numel`` entries go to a second :class:`~dgc.DGCCompressor` whose
    density is ``small_density``; it costs little (200 entries of a 2,000-entry layer) and was
    worth +1 to +1.5 accuracy points in ``docs/federated_momentum.md``. Both compressors share
    every other setting, warm-up included (each density is floored by the warm-up schedule).

    Parameters
    ----------
    config : DGCConfig
        Settings of both compressors; ``config.density`` is the density of the large tensors.
    small_density : float
        Density of the sparsified tensors with at most ``small_numel`` entries, in (0, 1].
    small_numel : int, default 10_000
        Size limit, in entries, of a "small" tensor.
    """

    def __init__(self, config: DGCConfig, small_density: float,
                 small_numel: int = 10_000) -> None:
        if isinstance(small_density, bool) or not isinstance(small_density, (int, float)) \
                or not 0.0 < small_density <= 1.0:
            raise ConfigError(f"small_density must be a number in (0, 1], got {small_density!r}")
        if isinstance(small_numel, bool) or not isinstance(small_numel, int) or small_numel < 1:
            raise ConfigError(f"small_numel must be an integer >= 1, got {small_numel!r}")
        self.config = config
        self.small_numel = small_numel
        self.large = DGCCompressor(config)
        self.small = DGCCompressor(dataclasses.replace(config, density=float(small_density)))
        self._shapes: dict[str, tuple[int, ...]] = {}

    @property
    def parts(self) -> tuple[DGCCompressor, DGCCompressor]:
        """The two underlying compressors (large tensors, small tensors)."""
        return (self.large, self.small)

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> SparseUpdate:
        """Fold ``grads`` into the residuals and return what to send this step.

        Every gradient is checked (a finite floating-point tensor of the shape already held)
        before either compressor changes, so a bad gradient leaves both as they were.
        """
        for name, t in grads.items():
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise StateError(f"gradient {name!r} must be a floating-point tensor")
            known = self._shapes.get(name)
            if known is not None and known != tuple(t.shape):
                raise StateError(f"tensor {name!r} has shape {tuple(t.shape)}, the residual "
                                 f"holds {known}")
            if self.config.check_finite and not all_finite(t):
                raise StateError(f"gradient {name!r} holds NaN or Inf")
        large = {k: t for k, t in grads.items() if t.numel() > self.small_numel}
        small = {k: t for k, t in grads.items() if t.numel() <= self.small_numel}
        a = self.large.compress(large, epoch, sequence)
        b = self.small.compress(small, epoch, sequence)
        for name, t in grads.items():
            self._shapes[name] = tuple(t.shape)
        out = {**a.tensors, **b.tensors}
        return SparseUpdate({k: out[k] for k in grads}, a.sequence)

    def restore(self, update: SparseUpdate) -> None:
        """Fold an update that was sent but never applied back into the residuals."""
        for name in update.tensors:
            if name not in self._shapes:
                raise StateError(f"update tensor {name!r} is not held by this compressor")
        large = {k: t for k, t in update.tensors.items() if t.numel > self.small_numel}
        small = {k: t for k, t in update.tensors.items() if t.numel <= self.small_numel}
        self.large.restore(SparseUpdate(large, update.sequence))
        self.small.restore(SparseUpdate(small, update.sequence))

    def residual(self) -> dict[str, torch.Tensor]:
        """The unsent accumulated values (flat), keyed by tensor name."""
        return {**self.large.residual(), **self.small.residual()}

    def state_dict(self) -> dict[str, Any]:
        """Both compressors' states and the tensor shapes."""
        return {"two_density": True, "shapes": {k: list(v) for k, v in self._shapes.items()},
                "large": self.large.state_dict(), "small": self.small.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; a malformed state changes nothing."""
        if not isinstance(state, Mapping) or state.get("two_density") is not True \
                or not {"shapes", "large", "small"} <= set(state):
            raise StateError("not a TwoDensityCompressor state (needs 'two_density', "
                             "'shapes', 'large', 'small')")
        shapes = {str(k): tuple(int(d) for d in v) for k, v in state["shapes"].items()}
        large = DGCCompressor(self.large.config)
        small = DGCCompressor(self.small.config)
        large.load_state_dict(state["large"])
        small.load_state_dict(state["small"])
        self.large, self.small, self._shapes = large, small, shapes


class RowwiseCompressor:
    """DGC with the density budget spent per output unit (row) instead of per tensor.

    Every tensor the layer policy sparsifies is cut into its rows (``shape[0]`` output units;
    ``t.reshape(shape[0], -1)``) and each row gets its own top-k of ``ceil(density * row_size)``
    entries, at least one. Per-tensor top-k on federated pseudo-gradients concentrates almost
    the whole budget on a few hidden units (measured: 20 of 200 units get 90% of the entries,
    ``docs/federated_momentum.md``) and gives a 10x200 output layer 2 entries per round; per-row
    selection keeps every unit learning. The residual, momentum, masking, warm-up, clipping and
    value rounding are those of an ordinary :class:`~dgc.DGCCompressor` (it runs underneath,
    one residual per row), and updates carry the original tensor names and shapes, so the wire
    format and :func:`dgc.aggregate` see nothing new.

    Parameters
    ----------
    config : DGCConfig, optional
        The hyperparameters; ``min_sparse_numel`` still decides which whole tensors are sent
        dense.
    """

    def __init__(self, config: DGCConfig | None = None) -> None:
        self.config = config or DGCConfig()
        self._policy = DGCCompressor(self.config)
        # Rows are handed over as (1, row_size) tensors: sparsified whatever their size.
        self.inner = DGCCompressor(dataclasses.replace(self.config, min_sparse_numel=1))
        self._shapes: dict[str, tuple[int, ...]] = {}

    @property
    def memory(self):
        """The per-row momentum and residual (a :class:`~dgc.DGCMemory`)."""
        return self.inner.memory

    @property
    def step(self) -> int:
        """Updates produced so far."""
        return self.inner.step

    def _split(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if _ROW in name:
            raise StateError(f"tensor name {name!r} must not contain {_ROW!r}")
        if self._policy.is_dense_tensor(tuple(t.shape)):
            return {name: t.reshape(-1)}
        rows = t.reshape(t.shape[0], -1)
        return {f"{name}{_ROW}{i}": rows[i:i + 1] for i in range(rows.shape[0])}

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> SparseUpdate:
        """Fold ``grads`` into the per-row residuals and return what to send this step.

        A bad gradient (NaN, wrong size, ...) is rejected by the underlying compressor before any
        state changes.
        """
        for name, t in grads.items():
            if not isinstance(t, torch.Tensor):
                raise StateError(f"gradient {name!r} must be a tensor, got {type(t).__name__}")
            known = self._shapes.get(name)
            if known is not None and known != tuple(t.shape):
                raise StateError(f"tensor {name!r} has shape {tuple(t.shape)}, the residual "
                                 f"holds {known}")
        pieces: dict[str, torch.Tensor] = {}
        for name, t in grads.items():
            pieces.update(self._split(name, t))
        sent = self.inner.compress(pieces, epoch, sequence)
        for name, t in grads.items():
            self._shapes[name] = tuple(t.shape)
        out = {}
        for name, t in grads.items():
            shape = tuple(t.shape)
            if name in sent.tensors:
                piece = sent.tensors[name]
                out[name] = SparseTensor(piece.indices, piece.values, shape)
                continue
            rows = t.shape[0]
            row_size = t.numel() // rows
            parts = [sent.tensors[f"{name}{_ROW}{i}"] for i in range(rows)]
            indices = torch.cat([p.indices + i * row_size for i, p in enumerate(parts)])
            values = torch.cat([p.values for p in parts])
            out[name] = SparseTensor(indices, values, shape)
        return SparseUpdate(out, sent.sequence)

    def restore(self, update: SparseUpdate) -> None:
        """Fold an update that was sent but never applied back into the residuals."""
        pieces: dict[str, SparseTensor] = {}
        for name, t in update.tensors.items():
            shape = self._shapes.get(name)
            if shape is None:
                raise StateError(f"update tensor {name!r} is not held by this compressor")
            if shape != t.shape:
                raise StateError(f"update tensor {name!r} has shape {t.shape}, the residual "
                                 f"holds {shape}")
            if self._policy.is_dense_tensor(shape):
                pieces[name] = SparseTensor(t.indices, t.values, (t.numel,))
                continue
            rows = shape[0]
            row_size = t.numel // rows
            row_of = t.indices // row_size
            for i in range(rows):
                sel = row_of == i
                pieces[f"{name}{_ROW}{i}"] = SparseTensor(t.indices[sel] - i * row_size,
                                                          t.values[sel], (1, row_size))
        self.inner.restore(SparseUpdate(pieces, update.sequence))

    def residual(self) -> dict[str, torch.Tensor]:
        """The unsent accumulated values (flat, rows joined again), keyed by tensor name."""
        v = self.inner.memory.v
        out = {}
        for name, shape in self._shapes.items():
            if name in v:
                out[name] = v[name].clone()
            else:
                out[name] = torch.cat([v[f"{name}{_ROW}{i}"] for i in range(shape[0])])
        return out

    def state_dict(self) -> dict[str, Any]:
        """The underlying compressor's state plus the tensor shapes."""
        return {"rowwise": True, "shapes": {k: list(v) for k, v in self._shapes.items()},
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; a malformed state changes nothing."""
        if not isinstance(state, Mapping) or state.get("rowwise") is not True \
                or "inner" not in state or "shapes" not in state:
            raise StateError("not a RowwiseCompressor state (needs 'rowwise', 'shapes', 'inner')")
        shapes = {str(k): tuple(int(d) for d in v) for k, v in state["shapes"].items()}
        self.inner.load_state_dict(state["inner"])
        self._shapes = shapes


def _check_unit(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}")
