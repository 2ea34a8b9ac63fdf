"""The residual memory of DGC: per-tensor momentum ``u`` and accumulated velocity ``v``.

Kept apart from selection and from the wire so that each can be tested and replaced alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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
        # (names, v block, u block or None): the state of ``names`` as views of one flat block
        # each (accumulate_flat); checked against the dicts before every use, since loading a
        # state or another caller may replace the tensors behind the views.
        self._blocks: tuple[tuple[str, ...], torch.Tensor, torch.Tensor | None] | None = None

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
        elif v.device != grad.device:
            v = self.to_device(name, grad.device)
        if v.shape != grad.shape:
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

    def accumulate_flat(self, names: Sequence[str], numels: Sequence[int],
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`accumulate` for the tensors ``names`` at once, their flat float32 gradients
        concatenated in ``grad``; returns the residual and momentum blocks (``u`` is None
        without momentum correction).

        The state of ``names`` is kept as views of one flat block per part (laid out by one copy
        when it is not, e.g. after :meth:`load_state_dict`), so that a step is a few operations
        on the whole model instead of a few per tensor: what makes an accelerator's step fast.
        The operations are those of :meth:`accumulate`, element by element.
        """
        names = tuple(names)
        v_block, u_block = self._lay_out(names, numels, grad.device)
        if not self.momentum_correction:
            v_block.add_(grad)
            return v_block, None
        if u_block is None:
            if any(n in self.u for n in names):  # a tensor new to a running state: rare
                for name, (start, n) in zip(names, _spans(numels), strict=True):
                    self.accumulate(name, grad[start:start + n])
                return self._lay_out(names, numels, grad.device)  # every name has u now
            u_block = grad.clone()  # the first step: u starts as the gradient, undamped
            for name, (start, n) in zip(names, _spans(numels), strict=True):
                self.u[name] = u_block[start:start + n]
            self._blocks = (names, v_block, u_block)
        else:
            u_block.mul_(self.momentum).add_(grad, alpha=1.0 - self.dampening)
        if self.nesterov:
            v_block.add_(grad).add_(u_block, alpha=self.momentum)
        else:
            v_block.add_(u_block)
        return v_block, u_block

    def _lay_out(self, names: tuple[str, ...], numels: Sequence[int],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The v and u blocks of ``names`` (u: None unless every name has one), laid out anew
        when the dicts no longer hold views of the current blocks."""
        if self._blocks is not None and self._blocks[0] == names and self._still_views(numels):
            return self._blocks[1], self._blocks[2]
        for name, n in zip(names, numels, strict=True):
            held = self.v.get(name)
            if held is not None and held.numel() != n:
                raise StateError(f"tensor {name!r} has {n} entries, the residual holds "
                                 f"{held.numel()}")
        spans = _spans(numels)
        v_block = torch.cat([self.v[n].to(device) if n in self.v
                             else torch.zeros(k, dtype=torch.float32, device=device)
                             for n, k in zip(names, numels, strict=True)]) if names else \
            torch.zeros(0, device=device)
        for name, (start, n) in zip(names, spans, strict=True):
            self.v[name] = v_block[start:start + n]
        u_block = None
        if names and all(n in self.u for n in names):
            u_block = torch.cat([self.u[n].to(device) for n in names])
            for name, (start, n) in zip(names, spans, strict=True):
                self.u[name] = u_block[start:start + n]
        self._blocks = (names, v_block, u_block)
        return v_block, u_block

    def _still_views(self, numels: Sequence[int]) -> bool:
        names, v_block, u_block = self._blocks  # type: ignore[misc]
        for part, block in ((self.v, v_block), (self.u, u_block)):
            if block is None:
                if any(n in part for n in names):
                    return False
                continue
            base = block.data_ptr()
            for name, (start, n) in zip(names, _spans(numels), strict=True):
                t = part.get(name)
                if t is None or t.numel() != n or t.data_ptr() != base + 4 * start \
                        or t.untyped_storage().data_ptr() != block.untyped_storage().data_ptr():
                    return False
        return True

    def mark_sent(self, name: str, indices: torch.Tensor, sent: torch.Tensor,
                  mask_momentum: bool) -> None:
        """Remove what was sent from the residual; with masking, zero the momentum there too.

        ``sent`` is what the receiver will see (after value rounding): the rounding error stays in
        the residual instead of being lost.
        """
        v = self.v[name]
        indices = indices.to(v.device)
        v.index_put_((indices,), v[indices] - sent.to(v.device, v.dtype))
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
        v.index_add_(0, indices.to(v.device), values.to(v.device, v.dtype))

    def to_device(self, name: str, device: torch.device) -> torch.Tensor:
        """Move the state of ``name`` to ``device`` (a loaded state is on the host until the
        first gradient of that tensor shows where it lives); returns its residual."""
        for part in (self.u, self.v):
            t = part.get(name)
            if t is not None and t.device != device:
                part[name] = t.to(device)
        return self.v[name]

    def scale(self, factor: float) -> None:
        """Multiply every momentum and residual entry by ``factor``, in place."""
        whole: set[str] = set()
        if self._blocks is not None and self._still_views([t.numel() for t in
                                                          self._blocks_views()]):
            names, v_block, u_block = self._blocks
            for block in (v_block, u_block):
                if block is not None:
                    block.mul_(factor)  # one operation for every tensor of the block
            whole = set(names)
        for state in (self.v, self.u):
            for name, t in state.items():
                if name not in whole:
                    t.mul_(factor)

    def _blocks_views(self) -> list[torch.Tensor]:
        names = self._blocks[0] if self._blocks is not None else ()
        return [self.v[n] if n in self.v else torch.empty(0) for n in names]

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Copies of ``u`` and ``v`` on the host, keyed by tensor name (state is kept on the
        host between rounds, wherever the compressor ran)."""
        return {"u": {k: t.to("cpu", copy=True) for k, t in self.u.items()},
                "v": {k: t.to("cpu", copy=True) for k, t in self.v.items()}}

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


def _spans(numels: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, numel)`` of each tensor laid out back to back."""
    out, start = [], 0
    for n in numels:
        out.append((start, int(n)))
        start += int(n)
    return out
