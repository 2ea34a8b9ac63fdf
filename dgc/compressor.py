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
from dgc.batched import BatchedSelector
from dgc.config import DGCConfig
from dgc.errors import ConfigError, StateError
from dgc.memory import DGCMemory
from dgc.selection import num_selected, select_exact, select_sampled
from dgc.sparse import VALUE_DTYPES, SparseTensor, SparseUpdate

_FP16_MAX = float(torch.finfo(torch.float16).max)
STATE_VERSION = 1
#: How the entries sent are shared out among the sparsified tensors (``budget``).
BUDGETS = ("tensor", "model", "energy")


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
    batched : bool or None, default None
        Compress the whole model at once from flat buffers (:mod:`dgc.batched`: one pass per
        step over all tensors, no host synchronisation until the result is read) instead of
        tensor by tensor. None: batched when the gradients live on an accelerator, where
        launches and round trips dominate, and tensor by tensor on the host, where they do
        not. Both give the same updates (up to which of equal magnitudes at the ``k``-th place
        is kept).
    budget : {"tensor", "model", "energy"}, default "tensor"
        How many entries each sparsified tensor sends. "tensor": ``ceil(density * numel)``
        each (the paper's per-layer top-k; ``small_density`` for the small ones). "model": the
        same total, taken by one top-k of every sparsified tensor's residual magnitudes
        together, so a tensor's share follows its residual's largest entries: the split that
        leaves the least residual (in L2) for the entries sent. "energy": the same total, each
        tensor's share in proportion to its residual's squared norm. At least one entry each;
        tensor by tensor only (not ``batched``).
    small_density, small_numel : float, int
        With a budget other than "tensor": the density of the sparsified tensors of at most
        ``small_numel`` entries in the total shared out (``dgc.small_density``; 0: ``density``),
        as :class:`~dgc.TwoDensityCompressor` gives them under "tensor".
    """

    def __init__(self, config: DGCConfig | None = None, batched: bool | None = None,
                 budget: str = "tensor", small_density: float = 0.0,
                 small_numel: int = 10_000) -> None:
        if budget not in BUDGETS:
            raise ConfigError(f"budget must be one of {list(BUDGETS)}, got {budget!r}")
        if budget != "tensor" and batched:
            raise ConfigError(f"budget {budget!r} selects tensor by tensor; batched must be "
                              f"False or None")
        if not 0.0 <= small_density <= 1.0:
            raise ConfigError(f"small_density must be in [0, 1], got {small_density!r}")
        self.config = config or DGCConfig()
        self.batched = batched
        self.budget = budget
        self.small_density, self.small_numel = float(small_density), int(small_numel)
        c = self.config
        self.memory = DGCMemory(c.momentum, c.momentum_correction, c.nesterov, c.dampening)
        self.step = 0
        self._value_dtype = VALUE_DTYPES[c.value_dtype]
        # |v| is written into one buffer reused across tensors and steps: allocating it anew
        # costs page faults that take longer than the pass itself on large tensors. It holds
        # the largest sparsified tensor, is scratch only and is not part of the state.
        self._magnitude = torch.empty(0)
        # Batched selection plans by (sparse tensor sizes, density, device): built once each.
        self._selectors: dict[tuple[tuple[int, ...], float, torch.device], BatchedSelector] = {}
        self._aranges: dict[tuple[int, torch.device], torch.Tensor] = {}

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
        if self._use_batched(grads):
            return self._compress_batched(grads, density, sequence)
        flat = self._validated(grads)
        self._clip(flat)
        out: dict[str, SparseTensor] = {}
        residuals = {name: self.memory.accumulate(name, g) for name, g in flat.items()}
        counts = self._counts(residuals, {n: tuple(grads[n].shape) for n in grads}, density)
        for name, v in residuals.items():
            shape = tuple(grads[name].shape)
            sparse = name in counts
            if not sparse:
                idx = torch.arange(v.numel(), dtype=torch.int64, device=v.device)
                mask = False  # dense layers keep ordinary momentum, as in the paper
            else:
                k = counts[name]
                magnitude = self._magnitude_of(v)
                if c.selection == "exact" or self.budget != "tensor" or k >= v.numel():
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

    def _counts(self, residuals: Mapping[str, torch.Tensor],
                shapes: Mapping[str, tuple[int, ...]], density: float) -> dict[str, int]:
        """Entries each sparsified tensor sends this step (``budget``), by name."""
        sparse = [n for n in residuals if not self.is_dense_tensor(shapes[n])]

        def own_density(numel: int) -> float:
            small = self.small_density > 0 and numel <= self.small_numel
            return max(self.small_density, density) if small else density

        counts = {n: num_selected(residuals[n].numel(), own_density(residuals[n].numel()))
                  for n in sparse}
        if self.budget == "tensor" or len(sparse) < 2:
            return counts
        sizes = torch.tensor([residuals[n].numel() for n in sparse])
        total = min(int(sum(counts.values())), int(sizes.sum()))
        if self.budget == "model":
            # One top-k of all the residuals' magnitudes: each tensor's count is its share.
            magnitude = torch.cat([residuals[n].abs() for n in sparse])
            top = torch.topk(magnitude, total, sorted=False).indices
            owner = torch.bucketize(top, torch.cumsum(sizes, 0), right=True)
            shares = torch.bincount(owner, minlength=len(sparse))
        else:  # "energy": in proportion to each residual's squared norm
            energy = torch.tensor([float(residuals[n].double().pow(2).sum()) for n in sparse])
            weights = energy / energy.sum() if float(energy.sum()) > 0 else sizes / sizes.sum()
            shares = torch.minimum(torch.floor(weights * total).to(torch.int64), sizes)
        # At least one entry each; the slots the floor takes come off the largest shares.
        shares = torch.minimum(shares.clamp(min=1), sizes)
        while int(shares.sum()) > total and bool((shares > 1).any()):
            shares[int(torch.argmax(shares))] -= 1
        return {n: int(k) for n, k in zip(sparse, shares.tolist(), strict=True)}

    def _use_batched(self, grads: Mapping[str, torch.Tensor]) -> bool:
        if self.budget != "tensor":
            return False
        if self.batched is not None:
            return self.batched and bool(grads)
        return any(isinstance(g, torch.Tensor) and g.device.type != "cpu"
                   for g in grads.values())

    def _compress_batched(self, grads: Mapping[str, torch.Tensor], density: float,
                          sequence: int | None) -> SparseUpdate:
        """:meth:`compress` of every tensor at once (see ``batched``).

        1. Check the gradients (one read of a single flag from the device) and lay them out
           flat: the sparsified tensors first, then the dense ones, in the caller's order.
        2. Clip, accumulate and take the dense tensors' values on whole blocks.
        3. Select every sparsified tensor's entries with :class:`dgc.batched.BatchedSelector`,
           round them, take them out of the residual and mask the momentum there, all on
           fixed-size buffers: nothing in 2-3 waits for the device.
        4. Read the per-tensor counts (one small copy to the host), run the exact selection on
           the rare tensors the batched one flagged, and hand out views of the buffers.
        """
        c = self.config
        names, numels, sparse_count = self._flat_layout(grads)
        device = grads[names[0]].device
        g = torch.cat([grads[n].detach().reshape(-1).to(device, torch.float32) for n in names])
        if c.check_finite and not all_finite(g):
            bad = next(n for n in names if not all_finite(grads[n].detach().float()))
            raise StateError(f"gradient {bad!r} contains NaN or Inf; nothing was changed")
        selector, selection, sent, dense_values = self.batched_step(names, numels, sparse_count,
                                                                    g, density)
        return self._finish_batched(grads, names, numels, sparse_count, selector, selection,
                                    sent, dense_values, sequence)

    def batched_step(self, names: tuple[str, ...], numels: tuple[int, ...], sparse_count: int,
                     g: torch.Tensor, density: float,
                     ) -> tuple[BatchedSelector, Any, torch.Tensor, torch.Tensor]:
        """Steps 2-3 of the batched compress, the hot path: nothing here waits for the device.

        ``g`` holds the checked gradients of ``names`` back to back (the first
        ``sparse_count`` sparsified, of ``numels`` entries each). Returns the selector, its
        :class:`~dgc.batched.Selection`, the values sent per slot (zero in invalid slots) and
        the dense tensors' values, all on ``g``'s device.
        """
        c = self.config
        device = g.device
        if c.clip_norm is not None and g.numel():
            # float64, as the per-tensor path; the scale is applied where the norm exceeds the
            # threshold, decided on the device.
            threshold = c.clip_norm / math.sqrt(c.num_workers)
            total = g.double().pow(2).sum().sqrt()
            scale = torch.where(total > threshold, threshold / total, 1.0).to(torch.float32)
            g = g * scale
        v, u = self.memory.accumulate_flat(names, numels, g)
        split = sum(numels[:sparse_count])
        dense_values = self._round(v[split:])
        if dense_values.data_ptr() == v[split:].data_ptr():  # float32 values: not a copy
            dense_values = dense_values.clone()
        v[split:].sub_(dense_values.to(torch.float32))
        selector = self._selector(numels[:sparse_count], density, device)
        sparse_v = v[:split]
        selection = selector.select(torch.abs(sparse_v, out=self._scratch(split, device)),
                                    self.step)
        positions, valid = selection.positions, selection.valid
        selected = sparse_v[positions]
        values = self._round(selected)
        if c.ternary:
            values = self._ternary_segments(selected, values, valid, selection.slot_segment,
                                            len(selector.sizes))
        sent = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=device))
        # index_add of -sent: invalid slots add zero wherever they point, so no write races
        # with a valid one (v - s and v + (-s) are the same float).
        sparse_v.index_add_(0, positions, -sent.to(torch.float32))
        if c.momentum_masking and u is not None:
            sparse_u = u[:split]
            sparse_u.index_add_(0, positions, torch.where(valid, -sparse_u[positions], 0.0))
        return selector, selection, sent, dense_values

    def _finish_batched(self, grads: Mapping[str, torch.Tensor], names: tuple[str, ...],
                        numels: tuple[int, ...], sparse_count: int, selector: BatchedSelector,
                        selection: Any, sent: torch.Tensor, dense_values: torch.Tensor,
                        sequence: int | None) -> SparseUpdate:
        c = self.config
        device = sent.device
        both = torch.stack([selection.counts, selection.fallback.to(torch.int64)])
        counts, fallback = both.tolist()  # the one read of the step: sizes for the views
        local = selection.positions - selector._offsets[selection.slot_segment]  # noqa: SLF001
        out: dict[str, SparseTensor] = {}
        for t in range(sparse_count):
            name = names[t]
            if fallback[t]:
                out[name] = self._select_one_exact(name, selector.ks[t])
                continue
            start = selector.slot_offsets[t]
            out[name] = SparseTensor(local[start:start + counts[t]],
                                     sent[start:start + counts[t]], tuple(grads[name].shape))
        at = 0
        for name, n in zip(names[sparse_count:], numels[sparse_count:], strict=True):
            out[name] = SparseTensor(self._arange(n, device), dense_values[at:at + n],
                                     tuple(grads[name].shape))
            at += n
        if not c.error_feedback:
            for name in names:
                self.memory.clear_residual(name)
        self.step += 1
        return SparseUpdate({name: out[name] for name in grads},
                            self.step if sequence is None else sequence)

    def _select_one_exact(self, name: str, k: int) -> SparseTensor:
        """The per-tensor exact selection of one tensor the batched selection flagged."""
        c = self.config
        v = self.memory.v[name]
        idx = select_exact(torch.abs(v), k)
        selected = v[idx]
        values = self._round(selected)
        if c.ternary:
            values = self._ternary(selected, values)
        self.memory.mark_sent(name, idx, values, c.momentum_masking)
        return SparseTensor(idx, values, (v.numel(),))

    def _flat_layout(self, grads: Mapping[str, torch.Tensor],
                     ) -> tuple[tuple[str, ...], tuple[int, ...], int]:
        """Names in flat order (sparsified tensors first), their sizes, how many are sparse;
        after the checks of :meth:`_validated` that need no data."""
        sparse, dense = [], []
        for name, g in grads.items():
            if not isinstance(g, torch.Tensor) or not g.is_floating_point():
                raise StateError(f"gradient {name!r} must be a floating-point tensor, "
                                 f"got {type(g).__name__}")
            held = self.memory.v.get(name)
            if held is not None and held.numel() != g.numel():
                raise StateError(f"gradient {name!r} has {g.numel()} entries, the residual holds "
                                 f"{held.numel()}")
            (dense if self.is_dense_tensor(tuple(g.shape)) else sparse).append(name)
        devices = {grads[n].device for n in grads}
        if len(devices) > 1:
            raise StateError(f"gradients must be on one device, got {sorted(map(str, devices))}")
        names = tuple(sparse + dense)
        return names, tuple(grads[n].numel() for n in names), len(sparse)

    def _selector(self, sizes: tuple[int, ...], density: float,
                  device: torch.device) -> BatchedSelector:
        key = (sizes, density, device)
        selector = self._selectors.get(key)
        if selector is None:
            if len(self._selectors) >= 8:  # warm-up densities come and go
                self._selectors.clear()
            selector = self._selectors[key] = BatchedSelector(sizes, density, self.config,
                                                              device)
        return selector

    def _scratch(self, numel: int, device: torch.device) -> torch.Tensor:
        if self._magnitude.numel() < numel or self._magnitude.device != device:
            self._magnitude = torch.empty(numel, dtype=torch.float32, device=device)
        return self._magnitude[:numel]

    def _arange(self, n: int, device: torch.device) -> torch.Tensor:
        key = (n, device)
        if key not in self._aranges:
            self._aranges[key] = torch.arange(n, dtype=torch.int64, device=device)
        return self._aranges[key]

    def _ternary_segments(self, selected: torch.Tensor, rounded: torch.Tensor,
                          valid: torch.Tensor, segment: torch.Tensor,
                          segments: int) -> torch.Tensor:
        """:meth:`_ternary` of every segment at once: its mean |v| over its valid slots."""
        device = selected.device
        magnitude = torch.where(valid, selected.abs().double(), 0.0)
        total = torch.zeros(segments, dtype=torch.float64, device=device)
        total.index_add_(0, segment, magnitude)
        count = torch.zeros(segments, dtype=torch.float64, device=device)
        count.index_add_(0, segment, valid.double())
        mean = (total / count.clamp(min=1.0)).to(torch.float32)
        scale = self._round(mean)[segment]
        ternary = torch.where(selected < 0, -scale, scale)
        return torch.where(scale > 0, ternary, rounded)

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
        if self._magnitude.numel() < v.numel() or self._magnitude.device != v.device:
            self._magnitude = torch.empty(v.numel(), dtype=torch.float32, device=v.device)
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
