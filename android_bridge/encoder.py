"""Exportable DGC encoder: one compression step for one flat tensor, state passed in and out.

The modules here compute, for a single flat float32 tensor, exactly what
:class:`dgc.DGCCompressor` computes with ``selection="exact"``: local clipping by a given scale,
momentum correction (plain or Nesterov, with dampening), exact top-k selection, value rounding,
removal of the sent values from the residual and momentum factor masking. They hold no state:
the momentum ``u`` and the residual ``v`` go in and come out, so that the same graph runs in
ExecuTorch (``.pte``), TorchScript (``.pt``) and eager mode.

Contract of :class:`SparseStepEncoder` (the ``encode`` method of the exported program)::

    inputs   grad f32[n], u f32[n], v f32[n], scale f32[1], fresh f32[1], k_like f32[k]
             (1 <= k <= n; fresh = 1.0 on the tensor's first step, when u does not exist yet)
    outputs  indices i64[k], values VDT[k], count i64[], u_out f32[n], v_out f32[n]

Only the length of ``k_like`` is read (ExecuTorch programs take tensors, and a tensor's length is
a dynamic dimension that the graph can use as ``k``). ``indices[:count]`` are the selected flat
positions in increasing order and ``values[:count]`` their rounded values; the entries past
``count`` are padding (positions whose accumulated value is exactly zero, which the eager
compressor drops) and must be ignored. ``VDT`` is the config's ``value_dtype``.

:class:`DenseStepEncoder` (method ``encode_dense``) is the same step for a tensor the layer policy
sends dense: ``grad, u, v, scale, fresh -> values VDT[n], u_out, v_out`` with no selection and no
masking. :class:`SumSquares` (method ``sum_squares``) returns ``sum(grad**2)`` accumulated in
float64; the host adds these over all tensors, takes the square root and forms the clipping scale
``threshold / norm`` exactly as the eager compressor does (see :func:`clip_scale`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from dgc.config import DGCConfig
from dgc.errors import ConfigError
from dgc.sparse import VALUE_DTYPES

_FP16_MAX = float(torch.finfo(torch.float16).max)


def check_exportable(config: DGCConfig) -> None:
    """Raise :class:`dgc.ConfigError` when the exported encoder cannot match ``config``.

    The exported graph implements exact top-k; the sampled threshold estimate uses data-dependent
    slicing and output sizes that ExecuTorch cannot plan memory for, so it is not exported.
    """
    if config.ternary:
        raise ConfigError("the exported encoder sends values in value_dtype, not ternary; "
                          "export with ternary=False (phones cannot send ternary updates)")
    if config.selection != "exact":
        raise ConfigError(f"the exported encoder implements selection='exact' only, got "
                          f"selection={config.selection!r}; export with "
                          f"dataclasses.replace(config, selection='exact')")


#: DGCConfig fields fixed in the exported graph; the host reads the others (density, warm-up,
#: layer policy, clipping threshold, finiteness check) at run time.
BAKED_FIELDS = ("selection", "momentum", "momentum_correction", "nesterov", "dampening",
                "momentum_masking", "error_feedback", "value_dtype", "ternary")


def check_compatible(exported: DGCConfig, requested: DGCConfig) -> None:
    """Raise :class:`dgc.ConfigError` when ``requested`` differs from the config the encoder
    was exported with in a field the graph has baked in (see :data:`BAKED_FIELDS`)."""
    diff = {f: (getattr(exported, f), getattr(requested, f)) for f in BAKED_FIELDS
            if getattr(exported, f) != getattr(requested, f)}
    if diff:
        detail = ", ".join(f"{f}: exported {a!r}, requested {b!r}" for f, (a, b) in diff.items())
        raise ConfigError(f"the exported encoder cannot run this config ({detail}); re-export "
                          f"with the requested config")


class _StepBase(nn.Module):
    """Momentum correction and value rounding shared by the sparse and the dense step."""

    def __init__(self, config: DGCConfig) -> None:
        super().__init__()
        self.momentum = float(config.momentum)
        self.grad_scale = 1.0 - float(config.dampening)
        self.momentum_correction = bool(config.momentum_correction)
        self.nesterov = bool(config.nesterov)
        self.momentum_masking = bool(config.momentum_masking) and self.momentum_correction
        self.error_feedback = bool(config.error_feedback)
        self.value_dtype = VALUE_DTYPES[config.value_dtype]
        self.clamp_fp16 = self.value_dtype == torch.float16
        self.fp16_max = _FP16_MAX

    def _accumulate(self, grad: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                    scale: torch.Tensor, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Same operations, in the same order, as DGCMemory.accumulate, so the results agree bit
        # for bit (torch.add with alpha is the form the eager in-place ops use). The momentum is
        # torch.optim.SGD's buffer: the first gradient itself on the first step (fresh > 0),
        # then m*u + (1 - dampening)*g.
        g = grad * scale
        if not self.momentum_correction:
            return u, v + g
        if self.grad_scale == 1.0:
            # With no dampening, u = 0 (what the host holds before the first step) gives
            # 0*m + g = g: the fresh case needs no select pass (ExecuTorch's portable where is
            # slow). Only the sign of a zero can differ from eager's clone (-0.0 vs +0.0), which
            # no later value or selection sees.
            u = torch.add(u * self.momentum, g)
        else:
            u = torch.where(fresh > 0, g,
                            self._add_scaled(u * self.momentum, g, self.grad_scale))
        if self.nesterov:
            v = self._add_scaled(v + g, u, self.momentum)
        else:
            v = v + u
        return u, v

    def _finish(self, top: torch.Tensor, magnitude: torch.Tensor, u: torch.Tensor,
                v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drop zero magnitudes, sort by index, round, and take the sent values out of the
        state (momentum masking, error feedback), given the flat positions ``top`` of the top-k."""
        n = v.shape[0]
        k = top.shape[0]
        # select_exact drops entries whose magnitude is zero; here they are moved behind the
        # selected ones by offsetting their key by n, and a second (small) top-k sorts the keys
        # ascending. ExecuTorch has no sort kernel for int64; topk(largest=False) is the sort.
        valid = magnitude[top] > 0
        count = valid.sum()
        key = torch.where(valid, top, top + n)
        key = torch.topk(key, k, largest=False, sorted=True).values
        valid = key < n
        indices = torch.where(valid, key, key - n)
        picked = v[indices]
        values = self._round(picked)
        sent = torch.where(valid, values.to(torch.float32), torch.zeros_like(picked))
        v = v.index_put((indices,), picked - sent)
        if self.momentum_masking:
            u = u.index_put((indices,), torch.where(valid, torch.zeros_like(sent), u[indices]))
        if not self.error_feedback:
            v = torch.zeros_like(v)
        return indices, values, count, u, v


    def _add_scaled(self, a: torch.Tensor, b: torch.Tensor, alpha: float) -> torch.Tensor:
        """``a + alpha * b`` rounded once, as eager ``torch.add(a, b, alpha=alpha)`` computes it
        on CPU (a fused multiply-add with ``alpha`` in float32).

        ExecuTorch has no fused multiply-add; in float64 the product of two float32 numbers is
        exact, so one float64 addition and a rounding to float32 give the fused result except
        when the float64 sum itself had to round onto a float32 midpoint (double rounding, of
        the order of 2**-29 per entry). ``alpha`` of 1 or 0.5 needs none of this: the product is
        exact in float32 already.
        """
        if alpha == 1.0 or alpha == 0.5:
            return torch.add(a, b, alpha=alpha)
        alpha32 = float(torch.tensor(alpha, dtype=torch.float32))
        return (a.to(torch.float64) + b.to(torch.float64) * alpha32).to(torch.float32)

    def _round(self, values: torch.Tensor) -> torch.Tensor:
        if self.clamp_fp16:
            values = values.clamp(-self.fp16_max, self.fp16_max)
        return values.to(self.value_dtype)


class SparseStepEncoder(_StepBase):
    """One DGC step with exact top-k selection for one flat tensor (see the module contract).

    Parameters
    ----------
    config : DGCConfig
        The compressor's hyperparameters; ``selection`` must be ``"exact"``. The density is not
        read here: the caller passes ``k`` (``dgc.selection.num_selected(n, density_at(epoch))``)
        as the length of ``k_like``, so one program serves every warm-up epoch.
    """

    def __init__(self, config: DGCConfig) -> None:
        check_exportable(config)
        super().__init__(config)

    def forward(self, grad: torch.Tensor, u: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
                fresh: torch.Tensor, k_like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n = grad.shape[0]
        k = k_like.shape[0]
        if not torch.jit.is_scripting():
            torch._check(k <= n)
        u, v = self._accumulate(grad, u, v, scale, fresh)
        magnitude = v.abs()
        top = torch.topk(magnitude, k, sorted=False).indices
        return self._finish(top, magnitude, u, v)


#: Entries per block of :class:`BlockSparseStepEncoder`; its tensors are padded to a multiple.
BLOCK = 32


class BlockSparseStepEncoder(SparseStepEncoder):
    """:class:`SparseStepEncoder` with a top-k that reads the whole tensor once, not ``k`` times.

    ExecuTorch's topk over all ``n`` magnitudes costs more than the rest of the step. Here the
    magnitudes are viewed as ``n / BLOCK`` blocks: the ``k`` blocks with the largest maxima hold
    every entry of the exact top-k (each of them holds an entry at least as large as the k-th
    block maximum, and no other block holds a larger one), so top-k over their ``k * BLOCK``
    entries gives the exact set. Only ties can tell the two apart: when the smallest selected
    magnitude is non-zero and equals an entry left out (among the candidates, or the maximum of a
    block left out), the step falls back to topk over the whole tensor, which resolves ties as the
    eager compressor's ``torch.topk`` does (checked in the tests). Zero magnitudes are dropped
    anyway, so ties at zero need no fallback.

    Contract (method ``encode_blocked``): as ``encode``, except that ``grad``, ``u`` and ``v``
    have a length ``n`` that is a multiple of :data:`BLOCK` (the host pads with zeros, which
    stay zero and are never sent) and ``1 <= k <= n / BLOCK``; the host uses ``encode`` for a
    larger ``k`` (dense warm-up densities).
    """

    def forward(self, grad: torch.Tensor, u: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
                fresh: torch.Tensor, k_like: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        k = k_like.shape[0]
        u, v = self._accumulate(grad, u, v, scale, fresh)
        magnitude = v.abs()
        blocks = magnitude.view(-1, BLOCK)
        block_max = blocks.amax(dim=1)
        torch._check(k <= blocks.shape[0])
        best = torch.topk(block_max, k, sorted=False)
        candidates = blocks.index_select(0, best.indices).view(-1)
        top = torch.topk(candidates, k, sorted=False)
        chosen = best.indices[top.indices // BLOCK] * BLOCK + top.indices % BLOCK
        smallest = top.values.min()
        tie_inside = (candidates == smallest).sum() > (top.values == smallest).sum()
        block_floor = best.values.min()
        tie_outside = (block_floor == smallest) & (
            (block_max == block_floor).sum() > (best.values == block_floor).sum())
        tie = (tie_inside | tie_outside) & (smallest > 0)
        top = torch.cond(tie, _topk_of_all, _keep_chosen, (magnitude, chosen))
        return self._finish(top, magnitude, u, v)

def _topk_of_all(magnitude: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    return torch.topk(magnitude, chosen.shape[0], sorted=False).indices


def _keep_chosen(magnitude: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    return chosen.clone()


class DenseStepEncoder(_StepBase):
    """One DGC step for a tensor sent dense: every value is sent, momentum is not masked.

    Parameters
    ----------
    config : DGCConfig
        The compressor's hyperparameters (selection is irrelevant here).
    """

    def forward(self, grad: torch.Tensor, u: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
                fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u, v = self._accumulate(grad, u, v, scale, fresh)
        values = self._round(v)
        v = v - values.to(torch.float32)
        if not self.error_feedback:
            v = torch.zeros_like(v)
        return values, u, v


#: Veltkamp's splitting constant for float32 (2**12 + 1): ``hi`` keeps 12 significant bits.
_SPLIT = 4097.0


class SumSquares(nn.Module):
    """``sum(grad ** 2)`` of one flat float32 tensor, accumulated in float64 (shape ``[]``).

    Eager torch squares in float64, where the square of a float32 is exact. ExecuTorch converts
    float32 to float64 on a portable kernel at ~20 ns an entry, so the squares are formed in
    float32 instead, exactly, by XNNPACK: each entry is split (Veltkamp) into ``hi + lo`` of 12
    significant bits each, and ``hi*hi``, ``hi*lo``, ``lo*lo`` are exact float32 products whose
    float64 sums give ``sum(g**2)`` up to the float64 rounding of the sums. When a product
    overflows (entries of magnitude about 2**64 or more) the sum is not finite and the float64
    path runs instead. Products under float32's
    normal range lose at most 2**-126 each (below 1e-31 in all at 2**21 entries). TorchScript
    keeps the float64 path.

    ExecuTorch sums in a different order than eager torch, so the float64 result differs in its
    last bits (measured: ~1e-13 relative at 1e6 floats). The clipping scale is rounded to
    float32 before use, which absorbs that difference unless the scale falls within ~1e-13 of a
    float32 rounding boundary (a chance of a few in 1e6 per clipped step); then one gradient
    scale, and with it the step, differs in the last bit of float32.
    """

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_scripting():
            split = _split_sum_squares(grad)
            # An entry whose split products overflow makes the sum Inf or NaN.
            return torch.cond(torch.isfinite(split), _keep_sum, _float64_sum_squares_of,
                              (split, grad))
        # TorchScript (encoder.pt) runs on PyTorch's kernels, where float64 is fast.
        return _float64_sum_squares(grad)


def _split_sum_squares(grad: torch.Tensor) -> torch.Tensor:
    scaled = grad * _SPLIT
    hi = scaled - (scaled - grad)
    lo = grad - hi
    return ((hi * hi).sum(dtype=torch.float64) + 2.0 * (hi * lo).sum(dtype=torch.float64)
            + (lo * lo).sum(dtype=torch.float64))


def _float64_sum_squares(grad: torch.Tensor) -> torch.Tensor:
    return grad.to(torch.float64).pow(2).sum()


def _keep_sum(split: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return split.clone()


def _float64_sum_squares_of(split: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return _float64_sum_squares(grad)


def clip_scale(sum_squares: Sequence[float], config: DGCConfig) -> float:
    """The clipping scale for one step from the per-tensor float64 sums of squares.

    Returns 1.0 when clipping is off or the norm is under the threshold; multiplying by exactly
    1.0 leaves every gradient unchanged, as the eager compressor's skipped multiplication does.
    The sum runs in the caller's tensor order, which must be the order of the gradient mapping.
    """
    if config.clip_norm is None or not sum_squares:
        return 1.0
    total = math.sqrt(sum(float(s) for s in sum_squares))
    threshold = config.clip_norm / math.sqrt(config.num_workers)
    if total > threshold:
        return threshold / total
    return 1.0
