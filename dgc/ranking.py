"""Entries ranked by displacement: one total order both ends compute alike, built whole or moved.

DGC's shared sets ranked by displacement (``dgc.shared_rank = displacement``) and the downlink's
patches coded by displacement rank (``downlink_context``) order a tensor's entries by how far
the model has moved from version 0, ``|model - origin|``, largest first, ties by position (what
a stable descending sort gives). Server and clients hold both tensors bit for bit and must order
them the same way.

The order is the ascending order of one int64 key per entry: the float32 bits of the
displacement, complemented, above the entry's position (:func:`displacement_keys`). The bits of
a non-negative float32 order as the values do, and the position makes every key distinct, so an
ordinary (unstable) sort or top-k of the keys gives exactly the stable sort's order, at about
half its cost. Between two versions of the model only the entries that moved change key:
:meth:`DisplacementOrder.moved` takes those out of the sorted keys and merges them back in
(``O(n + m log n)`` for ``m`` moved entries of ``n``) instead of sorting again, with the same
result bit for bit.
"""

from __future__ import annotations

import torch

from dgc.errors import StateError

__all__ = ["DisplacementOrder", "displacement_keys", "ranked", "top_positions"]

#: Above every non-negative float32 bit pattern (NaN's included): complementing the bits against
#: it turns "largest first" into ascending order.
_BITS_TOP = 0x7FFFFFFF
_POSITION_BITS = 32


def _displacement(model: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
    """``|model - origin|`` flat, in float32 on the host."""
    now, then = model.detach().reshape(-1).cpu(), origin.detach().reshape(-1).cpu()
    if now.numel() != then.numel():
        raise StateError(f"a tensor of {now.numel()} entries ranked against version 0 of "
                         f"{then.numel()}")
    return (now.to(torch.float32) - then.to(torch.float32)).abs()


def _keys(displacement: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The int64 keys of ``displacement`` (non-negative float32) at ``positions``."""
    bits = displacement.contiguous().view(torch.int32).to(torch.int64)
    return ((_BITS_TOP - bits) << _POSITION_BITS) | positions


def displacement_keys(model: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
    """One distinct int64 key per entry whose ascending order is the entries' order by
    ``|model - origin|`` descending, ties by position (a StateError when the sizes differ)."""
    moved = _displacement(model, origin)
    if moved.numel() >= 2**_POSITION_BITS:
        raise StateError(f"a tensor of {moved.numel()} entries is too large to rank (at most "
                         f"2**{_POSITION_BITS} - 1)")
    return _keys(moved, torch.arange(moved.numel(), dtype=torch.int64))


def ranked(model: torch.Tensor, origin: torch.Tensor) -> torch.Tensor:
    """The flat positions of ``model``'s entries by displacement from ``origin``, largest
    first, ties by position (int64): ``torch.sort(|model - origin|, descending=True,
    stable=True).indices``, bit for bit."""
    keys = torch.sort(displacement_keys(model, origin)).values
    return keys & (2**_POSITION_BITS - 1)


def top_positions(model: torch.Tensor, origin: torch.Tensor, k: int) -> torch.Tensor:
    """The positions of the ``k`` most displaced entries, in rank order (the first ``k`` of
    :func:`ranked`), without sorting the rest."""
    keys = displacement_keys(model, origin)
    k = max(0, min(int(k), keys.numel()))
    top = torch.topk(keys, k, largest=False, sorted=True).values
    return top & (2**_POSITION_BITS - 1)


class DisplacementOrder:
    """One tensor's entries ranked by displacement from version 0, kept up to date as the
    model moves (:meth:`moved`) rather than sorted again each version.

    Parameters
    ----------
    model, origin : torch.Tensor
        The tensor as the model holds it now, and at version 0 (same number of entries).
    """

    def __init__(self, model: torch.Tensor, origin: torch.Tensor) -> None:
        self.displacement = _displacement(model, origin)
        self.keys = torch.sort(displacement_keys(model, origin)).values  # ascending
        self.origin = origin.detach().reshape(-1).cpu().to(torch.float32)

    @property
    def order(self) -> torch.Tensor:
        """The flat positions, most displaced first (int64; :func:`ranked`'s)."""
        return self.positions(self.keys)

    @staticmethod
    def positions(keys: torch.Tensor) -> torch.Tensor:
        """The flat positions of sorted keys (:attr:`keys`, kept without the object)."""
        return keys & (2**_POSITION_BITS - 1)

    def moved(self, positions: torch.Tensor, values: torch.Tensor) -> DisplacementOrder:
        """The order once the entries at ``positions`` (flat, distinct) hold ``values``: a new
        object, this one unchanged. The same order as building it whole from the new model."""
        positions = positions.reshape(-1).to(torch.int64).cpu()
        out = DisplacementOrder.__new__(DisplacementOrder)
        out.origin = self.origin
        out.displacement = self.displacement.clone()
        if not positions.numel():
            out.keys = self.keys
            return out
        n = self.keys.numel()
        if int(positions.min()) < 0 or int(positions.max()) >= n:
            raise StateError(f"moved positions outside a tensor of {n} entries")
        new = (values.reshape(-1).cpu().to(torch.float32) - self.origin[positions]).abs()
        old_keys = _keys(self.displacement[positions], positions)
        out.displacement[positions] = new
        # The keys are distinct, so each old key sits at exactly one place of the sorted keys.
        gone = torch.searchsorted(self.keys, old_keys)
        keep = torch.ones(n, dtype=torch.bool)
        keep[gone] = False
        rest = self.keys[keep]
        fresh = torch.sort(_keys(new, positions)).values
        # Each fresh key lands after the kept keys below it and the fresh keys before it.
        at = torch.searchsorted(rest, fresh) + torch.arange(fresh.numel(), dtype=torch.int64)
        keys = torch.empty(n, dtype=torch.int64)
        taken = torch.zeros(n, dtype=torch.bool)
        taken[at] = True
        keys[at] = fresh
        keys[~taken] = rest
        out.keys = keys
        return out
