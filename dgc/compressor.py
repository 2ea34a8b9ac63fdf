"""DGCCompressor: one worker's side of Deep Gradient Compression, from gradient to sparse update.

Per step and per tensor (Lin et al., ICLR 2018, Algorithm 4):

1. local gradient clipping of the whole gradient to ``clip_norm * N ** -0.5``;
2. momentum correction: ``u = m*u + g; v = v + u`` (or the Nesterov form, or ``v = v + g``);
3. selection of the largest ``density`` fraction of ``|v|`` (exact or sampled threshold);
4. the selected values leave the residual, and momentum factor masking zeroes ``u`` there;
5. warm-up: the density follows the exponential schedule over the first epochs.

Tensors with fewer than ``min_sparse_numel`` entries, and those with ``dim <= 1`` unless
``sparse_vectors`` is set, are sent dense every step (:meth:`DGCConfig.sends_dense`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from dgc.base import check_factor
from dgc.config import DGCConfig
from dgc.errors import StateError
from dgc.memory import DGCMemory
from dgc.selection import num_selected, select_exact, select_sampled
from dgc.sparse import VALUE_DTYPES, SparseTensor, SparseUpdate

_FP16_MAX = float(torch.finfo(torch.float16).max)
STATE_VERSION = 1


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry of the floating-point tensor ``t`` is finite.

    A NaN or Inf entry makes the sum non-finite, so a finite sum proves every entry finite. The
    sum is one read pass, several times cheaper than ``isfinite().all()``; only a sum that
    overflowed on huge finite entries needs the exact check.
    """
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


class DGCCompressor:
    """Compresses successive gradients (or pseudo-gradients) of one worker.

    Implements :class:`dgc.base.Compressor`.

    Parameters
    ----------
    config : DGCConfig, optional
        The hyperparameters; the paper's defaults when omitted.
    """

    def __init__(self, config: DGCConfig | None = None) -> None:
        self.config = config or DGCConfig()
        c = self.config
        self.memory = DGCMemory(c.momentum, c.momentum_correction, c.nesterov, c.dampening)
        self.step = 0
        self._value_dtype = VALUE_DTYPES[c.value_dtype]
        # |v| is written into one buffer reused across tensors and steps: allocating it anew
        # costs page faults that take longer than the pass itself on large tensors. It holds
        # the largest sparsified tensor, is scratch only and is not part of the state.
        self._magnitude = torch.empty(0)

    def is_dense_tensor(self, shape: tuple[int, ...] | torch.Size) -> bool:
        """Whether the layer policy sends a tensor of this shape dense."""
        return self.config.sends_dense(tuple(shape))

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> SparseUpdate:
        """Fold ``grads`` into the residual and return what to send this step.

        Every gradient is validated (finite, floating point, same size as the state it meets)
        before any state changes, so a bad gradient leaves the compressor as it was.
        """
        c = self.config
        density = c.density_at(epoch)
        flat = self._validated(grads)
        self._clip(flat)
        out: dict[str, SparseTensor] = {}
        for name, g in flat.items():
            shape = tuple(grads[name].shape)
            v = self.memory.accumulate(name, g)
            sparse = not self.is_dense_tensor(shape)
            if not sparse:
                idx = torch.arange(v.numel(), dtype=torch.int64)
                mask = False  # dense layers keep ordinary momentum, as in the paper
            else:
                k = num_selected(v.numel(), density)
                magnitude = self._magnitude_of(v)
                if c.selection == "exact" or k >= v.numel():
                    idx = select_exact(magnitude, k)
                else:
                    idx = select_sampled(magnitude, k, density, c.sample_ratio,
                                         c.min_count_ratio, c.max_adaptations, self.step)
                mask = c.momentum_masking
            selected = v[idx]
            values = self._round(selected)
            if c.ternary and sparse:
                values = self._ternary(selected, values)
            self.memory.mark_sent(name, idx, values, mask)
            if not c.error_feedback:
                self.memory.clear_residual(name)
            out[name] = SparseTensor(idx, values, shape)
        self.step += 1
        return SparseUpdate(out, self.step if sequence is None else sequence)

    def restore(self, update: SparseUpdate) -> None:
        """Fold an update that was sent but never applied back into the residual.

        Use it when the server reports that an update was dropped (deadline, lost link, rejected),
        so that no gradient mass is lost. Momentum cleared by masking is not brought back.
        """
        for name, t in update.tensors.items():
            if name not in self.memory.v:
                raise StateError(f"update tensor {name!r} is not held by this compressor")
            if t.numel != self.memory.v[name].numel():
                raise StateError(f"update tensor {name!r} has {t.numel} entries, the residual "
                                 f"holds {self.memory.v[name].numel()}")
            # Checked for every tensor before the first is restored, so a bad update changes
            # nothing.
            if t.nnz and (int(t.indices.min()) < 0 or int(t.indices.max()) >= t.numel):
                raise StateError(f"update tensor {name!r} has indices outside [0, {t.numel})")
            if not torch.isfinite(t.values).all():
                raise StateError(f"update tensor {name!r} holds NaN or Inf values")
        for name, t in update.tensors.items():
            self.memory.restore(name, t.indices, t.values)

    def residual(self) -> dict[str, torch.Tensor]:
        """The unsent accumulated values (flat), keyed by tensor name."""
        return dict(self.memory.v)

    def scale_state(self, factor: float) -> None:
        """Multiply the residual and the momentum by ``factor`` in place (0 clears them)."""
        self.memory.scale(check_factor(factor))

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue later: step, config and the memory (copies)."""
        return {"version": STATE_VERSION, "step": self.step, "config": self.config.to_dict(),
                "memory": self.memory.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`; a malformed state changes nothing."""
        if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
            raise StateError(f"compressor state must be a mapping with version {STATE_VERSION}")
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise StateError(f"compressor state step must be an integer >= 0, got {step!r}")
        memory = state.get("memory")
        if not isinstance(memory, Mapping):
            raise StateError(f"compressor state memory must be a mapping with 'u' and 'v', "
                             f"got {type(memory).__name__}")
        self.memory.load_state_dict(memory)
        self.step = step

    def _validated(self, grads: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        flat: dict[str, torch.Tensor] = {}
        for name, g in grads.items():
            if not isinstance(g, torch.Tensor) or not g.is_floating_point():
                raise StateError(f"gradient {name!r} must be a floating-point tensor, "
                                 f"got {type(g).__name__}")
            f = g.detach().reshape(-1).to(torch.float32)
            if self.config.check_finite and not all_finite(f):
                raise StateError(f"gradient {name!r} contains NaN or Inf; nothing was changed")
            held = self.memory.v.get(name)
            if held is not None and held.numel() != f.numel():
                raise StateError(f"gradient {name!r} has {f.numel()} entries, the residual holds "
                                 f"{held.numel()}")
            flat[name] = f
        return flat

    def _clip(self, flat: dict[str, torch.Tensor]) -> None:
        c = self.config
        if c.clip_norm is None or not flat:
            return
        # float64 accumulation makes the norm reproducible bit for bit in the exported encoder.
        total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in flat.values()))
        threshold = c.clip_norm / math.sqrt(c.num_workers)
        if total > threshold:
            # No epsilon in the denominator (total > threshold > 0): the clipped norm is the
            # threshold itself, as the paper's local clipping specifies.
            scale = threshold / total
            for name in flat:
                flat[name] = flat[name] * scale

    def _magnitude_of(self, v: torch.Tensor) -> torch.Tensor:
        if self._magnitude.numel() < v.numel():
            self._magnitude = torch.empty(v.numel(), dtype=torch.float32)
        return torch.abs(v, out=self._magnitude[: v.numel()])

    def _round(self, values: torch.Tensor) -> torch.Tensor:
        if self._value_dtype == torch.float16:
            values = values.clamp(-_FP16_MAX, _FP16_MAX)
        return values.to(self._value_dtype)

    def _ternary(self, selected: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
        """``sign(v) * mean(|v|)`` over the selected entries, the mean in the value dtype; the
        rounded values themselves when that mean rounds to zero (nothing would be sent)."""
        if not selected.numel():
            return rounded
        scale = self._round(selected.abs().mean(dtype=torch.float64).to(torch.float32)
                            .reshape(1))
        if not bool(scale[0] > 0):
            return rounded
        return torch.where(selected < 0, -scale, scale)
