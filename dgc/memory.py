"""The residual memory of DGC: per-tensor momentum ``u`` and accumulated velocity ``v``.

Kept apart from selection and from the wire so that each can be tested and replaced alone.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dgc.errors import StateError


class DGCMemory:
    """Momentum and residual per tensor name, created as zeros on first use.

    Parameters
    ----------
    momentum : float
        Momentum factor m.
    momentum_correction : bool
        Accumulate the velocity (True) or the raw gradient (False) into the residual.
    nesterov : bool
        Nesterov momentum correction: ``v += g + m*u`` (paper: ``u' = m*(u' + g); v += u' + g``).
    dampening : float
        ``u = m*u + (1 - dampening)*g`` after the first step, as in ``torch.optim.SGD``.
    """

    def __init__(self, momentum: float, momentum_correction: bool, nesterov: bool,
                 dampening: float) -> None:
        self.momentum = momentum
        self.momentum_correction = momentum_correction
        self.nesterov = nesterov
        self.dampening = dampening
        self.u: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    def accumulate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """Fold one flat float32 gradient into the state; return the residual ``v`` (a view).

        The momentum ``u`` is held in the form of ``torch.optim.SGD``'s momentum buffer, with the
        same operations in the same order, so that density 1 without masking reproduces SGD bit
        for bit: it starts as the first gradient (undamped, as SGD does), then
        ``u = m*u + (1 - dampening)*g``; ``v += u``, or ``v += g + m*u`` for Nesterov (the
        paper's ``u' = m*(u' + g); v += u' + g`` with ``u' = m*u``).
        """
        v = self.v.get(name)
        if v is None:
            v = self.v[name] = torch.zeros_like(grad)
        elif v.shape != grad.shape:
            raise StateError(f"tensor {name!r} has {grad.numel()} entries, the residual holds "
                             f"{v.numel()}")
        if not self.momentum_correction:
            v.add_(grad)
            return v
        u = self.u.get(name)
        if u is None:
            # clone: the flat gradient may be a view of the caller's tensor.
            u = self.u[name] = grad.clone()
        else:
            u.mul_(self.momentum).add_(grad, alpha=1.0 - self.dampening)
        if self.nesterov:
            v.add_(grad).add_(u, alpha=self.momentum)
        else:
            v.add_(u)
        return v

    def mark_sent(self, name: str, indices: torch.Tensor, sent: torch.Tensor,
                  mask_momentum: bool) -> None:
        """Remove what was sent from the residual; with masking, zero the momentum there too.

        ``sent`` is what the receiver will see (after value rounding): the rounding error stays in
        the residual instead of being lost.
        """
        v = self.v[name]
        v.index_put_((indices,), v[indices] - sent.to(v.dtype))
        if mask_momentum and name in self.u:
            self.u[name].index_fill_(0, indices, 0.0)

    def clear_residual(self, name: str) -> None:
        """Drop everything not sent (top-k without error feedback)."""
        self.v[name].zero_()

    def restore(self, name: str, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Add values that were sent but never applied back into the residual."""
        v = self.v.get(name)
        if v is None:
            raise StateError(f"cannot restore into unknown tensor {name!r}")
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= v.numel()):
            raise StateError(f"restore indices for {name!r} fall outside [0, {v.numel()})")
        v.index_add_(0, indices, values.to(v.dtype))

    def scale(self, factor: float) -> None:
        """Multiply every momentum and residual entry by ``factor``, in place."""
        for state in (self.v, self.u):
            for t in state.values():
                t.mul_(factor)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of ``u`` and ``v``, keyed by tensor name."""
        return {"u": {k: t.clone() for k, t in self.u.items()},
                "v": {k: t.clone() for k, t in self.v.items()}}

    def load_state_dict(self, state: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Replace the state; validated whole before anything is replaced."""
        if set(state) - {"u", "v"}:
            raise StateError(f"memory state has unknown parts {sorted(set(state) - {'u', 'v'})}")
        new: dict[str, dict[str, torch.Tensor]] = {}
        for part in ("u", "v"):
            new[part] = {}
            tensors = state.get(part, {})
            if not isinstance(tensors, Mapping):
                raise StateError(f"memory state {part!r} must map tensor names to tensors, got "
                                 f"{type(tensors).__name__}")
            for k, t in tensors.items():
                if not isinstance(k, str):
                    raise StateError(f"memory state {part} has a non-string name {k!r}")
                if not isinstance(t, torch.Tensor) or t.dim() != 1 or not t.is_floating_point():
                    raise StateError(f"memory state {part}[{k!r}] must be a flat floating-point "
                                     f"tensor")
                if not torch.isfinite(t).all():
                    raise StateError(f"memory state {part}[{k!r}] holds NaN or Inf")
                new[part][k] = t.detach().to(torch.float32).clone()
        for k, t in new["u"].items():
            if k in new["v"] and new["v"][k].shape != t.shape:
                raise StateError(f"memory state u[{k!r}] and v[{k!r}] differ in size")
        self.u, self.v = new["u"], new["v"]
