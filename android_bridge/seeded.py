"""random-k on the phone: the residual at the positions the round's seed draws, with no program.

A phone whose task names the ``seeded`` payload (``fedgc.methods.randk.RandomK.phone_task``) runs
this instead of the exported encoder: add the pseudo-gradient to its residual, take the
residual at the ``k`` positions ``seeded_indices`` draws from the round's seed (every entry of a
tensor the layer policy sends whole), round them to the run's value dtype and take what was sent
out of the residual, as :class:`fedgc.methods.randk.RandomKCompressor` does on a simulated
client. The arithmetic is float32 numpy, one addition and one subtraction per entry, as it would
be plain Java on a phone; torch only rounds the values (float16, bfloat16) and holds the update
``RandomKCodec`` writes. Positions are a hash of counters (splitmix64): no state but the seed.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from dgc import SparseTensor, SparseUpdate, StateError
from dgc.config import DGCConfig
from dgc.selection import num_selected
from dgc.sparse import VALUE_DTYPES
from fedgc.methods.randk import SeededUpdate, seed_of_round, seeded_indices

#: The largest finite float16: values beyond it are clamped, as the simulated client does.
FLOAT16_MAX = 65504.0


class SeededEncoder:
    """One phone's random-k state: its client seed and its residual, flat float32 per tensor.

    Parameters
    ----------
    seed : int
        The client's seed (``fedgc.methods.randk.client_seed``), sent with every task.
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self.residual: dict[str, np.ndarray] = {}

    def compress(self, grads: Mapping[str, np.ndarray], policy: DGCConfig, epoch: float,
                 sequence: int) -> SeededUpdate:
        """Add ``grads`` to the residual and send it at round ``sequence``'s seeded positions
        (``policy``: which tensors go whole, the density at ``epoch``, the value dtype)."""
        for name, g in grads.items():
            held = self.residual.get(name)
            if not np.isfinite(g).all():
                raise StateError(f"gradient {name!r} contains NaN or Inf; nothing was changed")
            if held is not None and held.size != g.size:
                raise StateError(f"gradient {name!r} has {g.size} entries, the residual holds "
                                 f"{held.size}")
        seed = seed_of_round(self.seed, sequence)
        density = policy.density_at(epoch)
        dtype = VALUE_DTYPES[policy.value_dtype]
        out = {}
        for position, (name, g) in enumerate(grads.items()):
            shape = tuple(g.shape)
            v = self.residual.setdefault(name, np.zeros(g.size, dtype=np.float32))
            v += np.asarray(g, dtype=np.float32).reshape(-1)
            k = v.size if policy.sends_dense(shape) else num_selected(v.size, density)
            idx = seeded_indices(seed, position, v.size, k)
            picked = v[idx]
            if dtype == torch.float16:
                picked = np.clip(picked, -FLOAT16_MAX, FLOAT16_MAX)
            values = torch.from_numpy(picked).to(dtype)
            v[idx] -= values.to(torch.float32).numpy()  # the rounding error stays behind
            out[name] = SparseTensor(torch.from_numpy(idx), values, shape)
        return SeededUpdate(out, int(sequence), seed=seed)

    def restore(self, update: SparseUpdate) -> None:
        """Fold an update the server did not aggregate back into the residual, whole."""
        for name, t in update.tensors.items():
            held = self.residual.get(name)
            if held is None or held.size != t.numel:
                raise StateError(f"update tensor {name!r} does not fit this phone's residual")
        for name, t in update.tensors.items():
            self.residual[name][t.indices.numpy()] += t.values.to(torch.float32).numpy()
