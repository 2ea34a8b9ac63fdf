"""The catalogue's encoders a phone runs on its host, no program: random-k, EF-signSGD, the vote.

A phone whose task has a ``codec`` entry (``PhoneExport.phone_task``: the encoder, the payload
kind, a seed) runs one of these instead of the exported encoder, as the method's simulated
client runs its compressor (``fedgc.methods.randk.RandomKCompressor``,
``fedgc.methods.efsign.EFSignCompressor``, ``fedgc.methods.signvote.VoteCompressor``): the
pseudo-gradient joins a float32 residual, what is sent leaves it, and an update the server did
not aggregate is folded back whole (the vote keeps nothing: a lost vote is lost). The
arithmetic is float32 numpy, an addition and a subtraction per entry, as it would be plain Java
on a phone; torch rounds the values (float16, bfloat16), sums EF-signSGD's scale (in float64,
as the simulated client sums it: another order could move the float32 scale by a bit) and holds
the update the method's codec writes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from dgc import SparseTensor, SparseUpdate, StateError
from dgc.config import DGCConfig
from dgc.selection import num_selected
from dgc.sparse import VALUE_DTYPES
from fedgc.methods.efsign import SignsCodec, SignsUpdate, dense_signs
from fedgc.methods.randk import RandomKCodec, SeededUpdate, seed_of_round, seeded_indices

#: The largest finite float16: values beyond it are clamped, as the simulated client does.
FLOAT16_MAX = 65504.0


class HostEncoder:
    """A phone's residual, flat float32 per tensor, the method it stands for (``name``, a
    task's ``codec.encoder``) and whether it keeps what the server did not aggregate;
    subclasses write :meth:`compress` and :meth:`encode`."""

    name = ""
    keeps_residual = True

    def __init__(self) -> None:
        self.residual: dict[str, np.ndarray] = {}

    def compress(self, grads: Mapping[str, np.ndarray], policy: DGCConfig, epoch: float,
                 sequence: int) -> SparseUpdate:
        """Add ``grads`` to the residual and return the update of round ``sequence``
        (``policy``: the task's layer policy, density at ``epoch`` and value dtype)."""
        raise NotImplementedError

    def encode(self, update: SparseUpdate) -> bytes:
        """The payload's bytes, as the method's codec writes them."""
        raise NotImplementedError

    def _accumulate(self, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Checked before anything changes, as ResidualCompressor.check_gradients does.
        for name, g in grads.items():
            held = self.residual.get(name)
            if not np.isfinite(g).all():
                raise StateError(f"gradient {name!r} contains NaN or Inf; nothing was changed")
            if held is not None and held.size != g.size:
                raise StateError(f"gradient {name!r} has {g.size} entries, the residual holds "
                                 f"{held.size}")
        out = {}
        for name, g in grads.items():
            v = self.residual.setdefault(name, np.zeros(g.size, dtype=np.float32))
            v += np.asarray(g, dtype=np.float32).reshape(-1)
            out[name] = v
        return out

    def restore(self, update: SparseUpdate) -> None:
        """Fold an update the server did not aggregate back into the residual, whole."""
        for name, t in update.tensors.items():
            held = self.residual.get(name)
            if held is None or held.size != t.numel:
                raise StateError(f"update tensor {name!r} does not fit this phone's residual")
        for name, t in update.tensors.items():
            self.residual[name][t.indices.numpy()] += t.values.to(torch.float32).numpy()


class SeededEncoder(HostEncoder):
    """random-k: the residual at the ``k`` positions ``seeded_indices`` draws from the round's
    seed (every entry of a tensor the layer policy sends whole), in the run's value dtype.

    Parameters
    ----------
    seed : int
        The client's seed (``fedgc.methods.randk.client_seed``), sent with every task.
    """

    name = "randk"

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = int(seed)

    def compress(self, grads: Mapping[str, np.ndarray], policy: DGCConfig, epoch: float,
                 sequence: int) -> SeededUpdate:
        residual = self._accumulate(grads)
        seed = seed_of_round(self.seed, sequence)
        density = policy.density_at(epoch)
        dtype = VALUE_DTYPES[policy.value_dtype]
        out = {}
        for position, (name, v) in enumerate(residual.items()):
            shape = tuple(grads[name].shape)
            k = v.size if policy.sends_dense(shape) else num_selected(v.size, density)
            idx = seeded_indices(seed, position, v.size, k)
            picked = v[idx]
            if dtype == torch.float16:
                picked = np.clip(picked, -FLOAT16_MAX, FLOAT16_MAX)
            values = torch.from_numpy(picked).to(dtype)
            v[idx] -= values.to(torch.float32).numpy()  # the rounding error stays behind
            out[name] = SparseTensor(torch.from_numpy(idx), values, shape)
        return SeededUpdate(out, int(sequence), seed=seed)

    def encode(self, update: SparseUpdate) -> bytes:
        return RandomKCodec().encode(update)


class SignsEncoder(HostEncoder):
    """EF-signSGD: every entry of residual plus pseudo-gradient as its sign times the tensor's
    mean magnitude (``||p||_1 / d``, summed in float64, sent as float32); the residual keeps
    the difference."""

    name = "efsign"

    def compress(self, grads: Mapping[str, np.ndarray], policy: DGCConfig, epoch: float,
                 sequence: int) -> SignsUpdate:
        out = SignsUpdate({}, int(sequence))
        for name, p in self._accumulate(grads).items():
            magnitude = float(torch.from_numpy(p).abs().sum(dtype=torch.float64))
            scale = float(torch.tensor(magnitude / max(p.size, 1), dtype=torch.float32))
            sent = dense_signs(tuple(grads[name].shape), torch.from_numpy(p < 0), scale)
            p -= sent.values.numpy()
            out.tensors[name], out.scales[name] = sent, scale
        return out

    def encode(self, update: SparseUpdate) -> bytes:
        return SignsCodec().encode(update)


class VoteEncoder(HostEncoder):
    """signSGD-MV: the sign of every entry of the pseudo-gradient, scale 1, an exact 0 by a
    coin of ``numpy.random.default_rng([seed, round])``; nothing kept.

    Parameters
    ----------
    seed : int
        The client's seed (``fedgc.methods.signvote.SignVote.phone_task``).
    """

    name = "signvote"
    keeps_residual = False

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.seed = int(seed)

    def compress(self, grads: Mapping[str, np.ndarray], policy: DGCConfig, epoch: float,
                 sequence: int) -> SignsUpdate:
        for name, g in grads.items():
            if not np.isfinite(g).all():
                raise StateError(f"gradient {name!r} contains NaN or Inf")
        rng = np.random.default_rng([self.seed, int(sequence)])
        out = SignsUpdate({}, int(sequence))
        for name, g in grads.items():
            flat = np.asarray(g, dtype=np.float32).reshape(-1)
            coin = rng.random(flat.size) < 0.5
            negative = torch.from_numpy(np.where(flat == 0, coin, flat < 0))
            out.tensors[name], out.scales[name] = dense_signs(tuple(g.shape), negative, 1.0), 1.0
        return out

    def encode(self, update: SparseUpdate) -> bytes:
        return SignsCodec().encode(update)

    def restore(self, update: SparseUpdate) -> None:
        """Nothing to restore into (the simulated client keeps nothing either)."""


def host_encoder(codec: Mapping[str, object]) -> HostEncoder:
    """The encoder a task's ``codec`` entry names (``encoder``, and ``seed`` for random-k and
    the vote); ValueError naming the encoders phones run."""
    name, seed = codec.get("encoder"), codec.get("seed")
    seeded = {SeededEncoder.name: SeededEncoder, VoteEncoder.name: VoteEncoder}
    if name in seeded:
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
            raise ValueError(f"encoder {name!r} needs a seed in [0, 2^64), got {seed!r}")
        return seeded[name](seed)
    if name == SignsEncoder.name:
        return SignsEncoder()
    raise ValueError(f"encoder {name!r} is not one this phone runs: "
                     f"{[SeededEncoder.name, SignsEncoder.name, VoteEncoder.name]} or the "
                     f"exported one")
