"""The sign channel's client half: the residual at the round's shared indices, as scaled signs.

Every client of a round sends its residual at the server's index sets as
``sign(v[M]) * mean(|v[M]|)``, one fp32 scale per tensor and one bit per entry, and keeps the
rest in the residual (error feedback, as EF-signSGD, Karimireddy et al. 2019).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from dgc.errors import StateError
from dgc.sparse import SparseTensor, SparseUpdate


def take_signs(residual: Mapping[str, torch.Tensor], masks: Mapping[str, np.ndarray],
               sequence: int) -> SparseUpdate:
    """Send the residual at ``masks`` as scaled signs and keep the rest.

    ``residual`` maps tensor names to the compressor's flat residual tensors, changed in place:
    ``v[M] -= sign(v[M]) * mean(|v[M]|)``. Returns what was sent, as a :class:`SparseUpdate`
    whose values are ``+-scale`` (a zero entry counts as positive).
    """
    out: dict[str, SparseTensor] = {}
    for name, mask in masks.items():
        v = residual.get(name)
        if v is None:
            raise StateError(f"shared index set for {name!r}, which this client does not hold")
        idx = torch.from_numpy(np.asarray(mask, dtype=np.int64))
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= v.numel()):
            raise StateError(f"shared index set for {name!r} falls outside [0, {v.numel()})")
        idx = idx.to(v.device)  # the residual may live on an accelerator
        vm = v[idx]
        scale = float(vm.abs().mean()) if vm.numel() else 0.0
        sent = torch.where(vm < 0, -scale, scale).to(torch.float32)
        v.index_put_((idx,), vm - sent)
        out[name] = SparseTensor(idx, sent, (v.numel(),))
    return SparseUpdate(out, sequence)
