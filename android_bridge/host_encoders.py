"""The catalogue's encoders a phone runs on its host, no program: random-k, EF-signSGD, the vote,
QSGD and TCS.

A phone whose task has a ``codec`` entry (``PhoneExport.phone_task``: the encoder, the payload
kind, a seed or a budget) runs one of these instead of the exported encoder, as the method's
simulated client runs its compressor (``fedgc.methods.randk.RandomKCompressor``,
``fedgc.methods.efsign.EFSignCompressor``, ``fedgc.methods.signvote.VoteCompressor``,
``fedgc.methods.qsgd.QSGDCompressor``, ``fedgc.methods.tcs.TCSCompressor``): the
pseudo-gradient joins a float32 residual, what is sent leaves it, and an update the server did
not aggregate is folded back whole (the vote and QSGD without error feedback keep nothing: a
lost update is lost). The arithmetic is numpy, as it would be plain Java on a phone: float32
additions and subtractions, QSGD's float64 ratios and draws, TCS's selection by its written
rule (``fedgc.methods.tcs.largest``); torch rounds the values (float16, bfloat16), sums
EF-signSGD's scale and QSGD's bucket norms (in float64, as the simulated client sums them:
another order could move a float32 result by a bit) and holds the update the method's codec
writes. A task's round material (TCS's mask, the task's ``shared_mask``) reaches
:meth:`HostEncoder.compress` decoded, as ``masks``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np
import torch

from dgc import SparseTensor, SparseUpdate, StateError
from dgc.config import DGCConfig
from dgc.selection import num_selected
from dgc.signs.codec import Masks
from dgc.sparse import VALUE_DTYPES
from fedgc.methods.efsign import SignsCodec, SignsUpdate, dense_signs
from fedgc.methods.qsgd import LevelsCodec, LevelsUpdate
from fedgc.methods.randk import RandomKCodec, SeededUpdate, seed_of_round, seeded_indices
from fedgc.methods.tcs import Budget, MaskedCodec, MaskedUpdate

#: The largest finite float16: values beyond it are clamped, as the simulated client does.
FLOAT16_MAX = 65504.0
#: Entries QSGD's phone step rounds at a time (1 MiB of float64 temporaries: in the cache).
QSGD_CHUNK = 1 << 17


class HostEncoder:
    """A phone's residual, flat float32 per tensor, the method it stands for (``name``, a
    task's ``codec.encoder``) and whether it keeps what the server did not aggregate;
    subclasses write :meth:`compress` and :meth:`encode`."""

    name = ""
    keeps_residual = True
    #: Whether the payload answers the task's round material (TCS's mask): the bridge then
    #: reads the upload against it, and no sign payload goes beside it.
    reads_masks = False

    def __init__(self) -> None:
        self.residual: dict[str, np.ndarray] = {}

    def compress(self, grads: Mapping[str, np.ndarray], policy: DGCConfig, epoch: float,
                 sequence: int, masks: Masks | None = None) -> SparseUpdate:
        """Add ``grads`` to the residual and return the update of round ``sequence``
        (``policy``: the task's layer policy, density at ``epoch`` and value dtype; ``masks``:
        the round's mask per tensor, sorted flat positions, for an encoder whose payload
        answers one, :attr:`reads_masks`)."""
        raise NotImplementedError

    def encode(self, update: SparseUpdate) -> bytes:
        """The payload's bytes, as the method's codec writes them."""
        raise NotImplementedError

    @staticmethod
    def _check_finite(grads: Mapping[str, np.ndarray]) -> None:
        for name, g in grads.items():
            if not np.isfinite(g).all():
                raise StateError(f"gradient {name!r} contains NaN or Inf; nothing was changed")

    def _accumulate(self, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        # Checked before anything changes, as ResidualCompressor.check_gradients does.
        self._check_finite(grads)
        for name, g in grads.items():
            held = self.residual.get(name)
            if held is not None and held.size != g.size:
                raise StateError(f"gradient {name!r} has {g.size} entries, the residual holds "
                                 f"{held.size}")
        out = {}
        for name, g in grads.items():
            v = self.residual.setdefault(name, np.zeros(g.size, dtype=np.float32))
            v += np.asarray(g, dtype=np.float32).reshape(-1)
            out[name] = v
        return out

    @staticmethod
    def _take(v: np.ndarray, idx: np.ndarray, dtype: torch.dtype,
              shape: tuple[int, ...]) -> SparseTensor:
        """The residual ``v`` at ``idx`` in the run's value dtype (float16 clamped to its finite
        range, as the simulated client), taken out of ``v``: the rounding error stays behind."""
        picked = v[idx]
        if dtype == torch.float16:
            picked = np.clip(picked, -FLOAT16_MAX, FLOAT16_MAX)
        values = torch.from_numpy(picked).to(dtype)
        v[idx] -= values.to(torch.float32).numpy()
        return SparseTensor(torch.from_numpy(idx), values, shape)

    def restore(self, update: SparseUpdate) -> None:
        """Fold an update the server did not aggregate back into the residual, whole (every
        part of it, as ``payload.parts()`` on the simulated client; nothing is added unless
        every tensor fits)."""
        parts = [update.tensors, *([update.masked] if isinstance(update, MaskedUpdate) else [])]
        for tensors in parts:
            for name, t in tensors.items():
                held = self.residual.get(name)
                if held is None or held.size != t.numel:
                    raise StateError(f"update tensor {name!r} does not fit this phone's "
                                     f"residual")
        for tensors in parts:
            for name, t in tensors.items():
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
                 sequence: int, masks: Masks | None = None) -> SeededUpdate:
        residual = self._accumulate(grads)
        seed = seed_of_round(self.seed, sequence)
        density = policy.density_at(epoch)
        dtype = VALUE_DTYPES[policy.value_dtype]
        out = {}
        for position, (name, v) in enumerate(residual.items()):
            shape = tuple(grads[name].shape)
            k = v.size if policy.sends_dense(shape) else num_selected(v.size, density)
            out[name] = self._take(v, seeded_indices(seed, position, v.size, k), dtype, shape)
        return SeededUpdate(out, int(sequence), seed=seed)

    def encode(self, update: SparseUpdate) -> bytes:
        return RandomKCodec().encode(update)


class SignsEncoder(HostEncoder):
    """EF-signSGD: every entry of residual plus pseudo-gradient as its sign times the tensor's
    mean magnitude (``||p||_1 / d``, summed in float64, sent as float32); the residual keeps
    the difference."""

    name = "efsign"

    def compress(self, grads: Mapping[str, np.ndarray], policy: DGCConfig, epoch: float,
                 sequence: int, masks: Masks | None = None) -> SignsUpdate:
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
                 sequence: int, masks: Masks | None = None) -> SignsUpdate:
        self._check_finite(grads)
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


class QuantizedEncoder(HostEncoder):
    """QSGD: each bucket of ``bucket`` entries of every tensor as its float32 norm and a level
    of ``0..levels`` per entry, rounded up with probability the remainder by a draw of
    ``numpy.random.default_rng([seed, round])`` (one per entry, tensor after tensor, as
    ``fedgc.methods.qsgd.quantize``); a residual with error feedback only.

    Parameters
    ----------
    seed : int
        The client's seed (``fedgc.methods.qsgd.qsgd_seed``).
    bucket, levels : int
        QSGD's d and s (``qsgd.bucket_size``, ``qsgd.levels``).
    error_feedback : bool
        Keep what quantization changed (``qsgd.error_feedback``); without it nothing is kept
        and nothing folded back, as the simulated client.
    """

    name = "qsgd"

    def __init__(self, seed: int, bucket: int, levels: int, error_feedback: bool) -> None:
        super().__init__()
        self.seed, self.bucket, self.levels = int(seed), int(bucket), int(levels)
        self.keeps_residual = bool(error_feedback)

    def compress(self, grads: Mapping[str, np.ndarray], policy: DGCConfig, epoch: float,
                 sequence: int, masks: Masks | None = None) -> LevelsUpdate:
        if self.keeps_residual:
            flats = self._accumulate(grads)
        else:
            self._check_finite(grads)
            flats = {n: np.asarray(g, dtype=np.float32).reshape(-1) for n, g in grads.items()}
        rng = np.random.default_rng([self.seed, int(sequence)])
        out = LevelsUpdate({}, int(sequence), bucket=self.bucket, levels=self.levels)
        for name, v in flats.items():
            norms, idx, signed = self._quantize(v, rng)
            values = norms[idx // self.bucket] * signed.astype(np.float32) / np.float32(self.levels)
            if self.keeps_residual:
                v[idx] -= values
            out.tensors[name] = SparseTensor(torch.from_numpy(idx), torch.from_numpy(values),
                                             tuple(grads[name].shape))
            out.norms[name], out.signed[name] = torch.from_numpy(norms), torch.from_numpy(signed)
        return out

    def _quantize(self, v: np.ndarray, rng: np.random.Generator,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(float32 norms per bucket, int64 positions of the nonzero levels, their signed
        levels) of the flat float32 ``v``, ``fedgc.methods.qsgd.quantize``'s to the bit: the
        same float64 operations on each entry in the same order, and the same draws (a
        generator's doubles do not depend on how many each call takes).

        One float64 buffer of whole buckets holds the squares, then the ratios; the rounding
        runs over ``QSGD_CHUNK`` entries at a time, whose temporaries stay in the cache and are
        reused (fresh ones of the tensor's size cost more than the arithmetic)."""
        n, d = v.size, self.bucket
        work = np.zeros((-(-n // d), d))  # float64; the last bucket's padding stays 0
        flat = work.reshape(-1)
        # The squares are exact in float64; their sum is torch's, in its order.
        np.square(v, out=flat[:n], dtype=np.float64)
        norms = np.sqrt(torch.from_numpy(work).sum(1).numpy()).astype(np.float32)
        # A bucket of norm 0 holds only zeros: its ratios are 0 / 1.
        np.abs(v, out=flat[:n], dtype=np.float64)
        work /= np.where(norms > 0, norms, 1.0).astype(np.float64)[:, None]
        work *= self.levels
        positions, signed = [], []
        for start in range(0, max(n, 1), QSGD_CHUNK):  # one pass, empty, for no entries
            ratio = flat[start:min(n, start + QSGD_CHUNK)]
            # Ratios are finite and >= 0: modf's parts are floor(r) and r - floor(r), exactly.
            fraction, level = np.modf(ratio, out=(ratio, np.empty_like(ratio)))
            level += rng.random(ratio.size) < fraction  # never up where v is 0 (fraction 0)
            at = np.flatnonzero(level > 0)
            # Levels are whole numbers, exact in float64: clamped, signed, then made int64.
            picked = np.minimum(level[at], self.levels)
            signed.append(np.copysign(picked, v[start + at], out=picked).astype(np.int64))
            positions.append(at + start)
        return norms, np.concatenate(positions), np.concatenate(signed)

    def encode(self, update: SparseUpdate) -> bytes:
        return LevelsCodec().encode(update)

    def restore(self, update: SparseUpdate) -> None:
        """Fold back with error feedback only (without it the simulated client keeps nothing)."""
        if self.keeps_residual:
            super().restore(update)


def largest_positions(score: np.ndarray, k: int) -> np.ndarray:
    """``fedgc.methods.tcs.largest`` in numpy: the increasing positions of the ``k`` largest
    entries of ``score``, ties at the k-th largest to the lower positions."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    kth = np.partition(score, score.size - k)[score.size - k]
    above = np.flatnonzero(score > kth)
    tied = np.flatnonzero(score == kth)[:k - above.size]
    return np.sort(np.concatenate([above, tied])).astype(np.int64)


class MaskedEncoder(HostEncoder):
    """TCS: the residual's values at the round's mask (no indices) and its ``budget.topk``
    largest magnitudes outside it, in the run's value dtype (every entry of a tensor the
    layer policy sends whole); what was sent leaves the residual.

    Parameters
    ----------
    budget : fedgc.methods.tcs.Budget
        The mask's and the top-k's sizes (the task's ``codec.budget``).
    """

    name = "tcs"
    reads_masks = True

    def __init__(self, budget: Budget) -> None:
        super().__init__()
        self.budget = budget

    def compress(self, grads: Mapping[str, np.ndarray], policy: DGCConfig, epoch: float,
                 sequence: int, masks: Masks | None = None) -> MaskedUpdate:
        masks = dict(masks or {})
        # Checked before anything changes, as TCSCompressor does.
        for name, mask in masks.items():
            g = grads.get(name)
            if g is None or policy.sends_dense(tuple(g.shape)):
                raise StateError(f"the round's mask names {name!r}, which this phone "
                                 f"{'sends whole' if g is not None else 'does not hold'}")
            if len(mask) and (int(mask[0]) < 0 or int(mask[-1]) >= g.size):
                raise StateError(f"the mask of {name!r} falls outside [0, {g.size})")
        dtype = VALUE_DTYPES[policy.value_dtype]
        rest, masked = {}, {}
        for name, v in self._accumulate(grads).items():
            shape = tuple(grads[name].shape)
            if policy.sends_dense(shape):
                rest[name] = self._take(v, np.arange(v.size, dtype=np.int64), dtype, shape)
                continue
            score = np.abs(v)
            mask = masks.get(name)
            if mask is not None:
                at = np.asarray(mask, dtype=np.int64)
                masked[name] = self._take(v, at, dtype, shape)
                score[at] = -1.0  # below every magnitude: the top-k looks outside the mask
            k = self.budget.topk(v.size, None if mask is None else len(mask))
            rest[name] = self._take(v, largest_positions(score, k), dtype, shape)
        return MaskedUpdate(rest, int(sequence), masked=masked)

    def encode(self, update: SparseUpdate) -> bytes:
        return MaskedCodec().encode(update)


def _seed(name: object, codec: Mapping[str, object]) -> int:
    seed = codec.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise ValueError(f"encoder {name!r} needs a seed in [0, 2^64), got {seed!r}")
    return seed


def _whole(name: object, codec: Mapping[str, object], key: str) -> int:
    value = codec.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 2**32:
        raise ValueError(f"encoder {name!r} needs {key} a whole number in [1, 2^32), got "
                         f"{value!r}")
    return value


def _budget(codec: Mapping[str, object]) -> Budget:
    raw = codec.get("budget")
    fields = {f.name for f in dataclasses.fields(Budget)}
    if not isinstance(raw, Mapping) or set(raw) != fields or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            and v >= 0 for v in raw.values()):
        raise ValueError(f"encoder 'tcs' needs a budget of non-negative numbers "
                         f"{sorted(fields)}, got {raw!r}")
    return Budget(float(raw["density"]), float(raw["small_density"]),
                  int(raw["small_numel"]), float(raw["share"]))


def host_encoder(codec: Mapping[str, object]) -> HostEncoder:
    """The encoder a task's ``codec`` entry names (``encoder``, and ``seed`` for random-k, the
    vote and QSGD, QSGD's ``bucket``, ``levels`` and ``error_feedback``, TCS's ``budget``);
    ValueError naming the encoders phones run, or what an entry lacks."""
    name = codec.get("encoder")
    seeded = {SeededEncoder.name: SeededEncoder, VoteEncoder.name: VoteEncoder}
    if name in seeded:
        return seeded[name](_seed(name, codec))
    if name == SignsEncoder.name:
        return SignsEncoder()
    if name == QuantizedEncoder.name:
        feedback = codec.get("error_feedback")
        if not isinstance(feedback, bool):
            raise ValueError(f"encoder {name!r} needs error_feedback true or false, got "
                             f"{feedback!r}")
        return QuantizedEncoder(_seed(name, codec), _whole(name, codec, "bucket"),
                                _whole(name, codec, "levels"), feedback)
    if name == MaskedEncoder.name:
        return MaskedEncoder(_budget(codec))
    known = [c.name for c in (SeededEncoder, SignsEncoder, VoteEncoder, QuantizedEncoder,
                              MaskedEncoder)]
    raise ValueError(f"encoder {name!r} is not one this phone runs: {known} or the exported "
                     f"one")
