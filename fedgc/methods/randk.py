"""``randk``: random-k with a shared seed and error feedback, a floor for the other methods.

Each round a client adds its pseudo-gradient to its residual and sends, of every tensor the
layer policy sparsifies (``dgc.min_sparse_numel``, ``dgc.sparse_vectors``), the residual at
``k = ceil(density * numel)`` positions drawn from a seed; what it sent leaves the residual
(Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018: rand-k with error
feedback). The payload carries the seed and the values, not the indices: the server draws the
same positions from the seed (Konečný et al., "Federated Learning: Strategies for Improving
Communication Efficiency", 2016: a random mask "generated from a random seed", so that "only
the seed and the nonzero values" travel). A value costs its 16 bits; an index nothing.

The payload (``FGCR``, ``docs/wire.md`` section 12) is framed as every fedgc payload
(:mod:`dgc.wire.framing`)::

    "FGCR" | version u8 = 1 | sequence u64 | seed u64 | count u32
    | (name_len u16 | name | ndim u8 | dims u64 * ndim | k u64 | value dtype u8 | values) * count
    | crc32 u32

A tensor with ``k == numel`` carries every entry in order; otherwise its positions are the first
``k`` distinct values of ``splitmix64(seed + (i << 40) + j) mod numel`` for ``j = 0, 1, ...``,
``i`` the tensor's place in the message, sorted (:func:`seeded_indices`). The server also checks
that every ``k`` is the one the method sends for that tensor in that round.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dgc import Compressor, DecodeError, DGCConfig, SparseTensor, SparseUpdate
from dgc.golomb import MAX_NUMEL
from dgc.selection import num_selected
from dgc.sparse import VALUE_DTYPES
from dgc.wire.framing import (
    MAX_U64,
    NDIM,
    Preamble,
    check_end,
    open_records,
    read,
    read_tensor_head,
    seal,
    tensor_head,
)
from dgc.wire.value_codings import DTYPES_BY_ID, VALUE_DTYPE_IDS
from fedgc.keys import TrainSettings
from fedgc.methods.base import Method
from fedgc.methods.compressors import ResidualCompressor
from fedgc.methods.payloads import Bound, Codec, PayloadError, SparsePayload, check_tensors
from fedgc.methods.phone import PhoneExport
from fedgc.methods.registry import register
from fedgc.methods.sparsifier import SparsifierSettings, layer_config
from fedgc.methods.unaggregated import FOLD_BACK_DEFAULTS

__all__ = ["RandomK", "RandomKCodec", "RandomKCompressor", "SeededUpdate", "client_seed",
           "seed_of_round", "seeded_indices"]

PREAMBLE = Preamble(b"FGCR", 1, "QQI")  # sequence, seed, tensor count
_TAIL = struct.Struct("<QB")  # k, value dtype id
#: The least bytes of a tensor record: an empty name, no dims, k and dtype.
_MIN_RECORD = 2 + NDIM.size + _TAIL.size
_MASK = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function (Steele, Lea, Flood 2014) on uint64s, wrapping."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def seed_of_round(client_seed: int, sequence: int) -> int:
    """The seed of the update a client of ``client_seed`` sends with ``sequence`` (its round):
    ``splitmix64(client_seed + sequence)``."""
    return int(_splitmix64(np.array([(int(client_seed) + int(sequence)) & _MASK],
                                    dtype=np.uint64))[0])


def seeded_indices(seed: int, position: int, numel: int, k: int) -> np.ndarray:
    """The sorted int64 positions a tensor at ``position`` in a message of ``seed`` carries: the
    first ``k`` distinct values of ``splitmix64(seed + (position << 40) + j) mod numel``."""
    if k >= numel:
        return np.arange(numel, dtype=np.int64)
    base = (int(seed) + (int(position) << 40)) & _MASK
    drawn = np.empty(0, dtype=np.int64)
    j = 0
    while True:
        batch = max(2 * (k - drawn.size), drawn.size) + 64
        with np.errstate(over="ignore"):
            counters = np.uint64(base) + np.arange(j, j + batch, dtype=np.uint64)
        j += batch
        drawn = np.concatenate([drawn, (_splitmix64(counters) % np.uint64(numel))
                                .astype(np.int64)])
        _, first = np.unique(drawn, return_index=True)
        if first.size >= k:
            return np.sort(drawn[np.sort(first)[:k]])
        drawn = drawn[np.sort(first)]


def _raw(values: torch.Tensor) -> bytes:
    """The values' bits, little-endian, as they travel (bfloat16 too: numpy has no such type)."""
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return values.contiguous().view(view[values.dtype]).numpy().astype("<i" + str(
        values.element_size())).tobytes()


@dataclass
class SeededUpdate(SparseUpdate):
    """A sparse update whose positions follow from ``seed`` (:func:`seeded_indices`)."""

    seed: int = 0


class RandomKCompressor(ResidualCompressor):
    """Random-k of the residual with a seed per round (implements :class:`dgc.base.Compressor`).

    Parameters
    ----------
    policy : dgc.DGCConfig
        Which tensors are sent whole (``sends_dense``), the density after warm-up
        (``density_at``) and the values' precision (``value_dtype``).
    seed : int
        This client's seed; the seed of round ``r`` is ``splitmix64(seed + r)``.
    """

    label = "random-k"

    def __init__(self, policy: Any, seed: int) -> None:
        super().__init__()
        self.policy = policy
        self.seed = int(seed) & _MASK
        self._dtype = VALUE_DTYPES[policy.value_dtype]

    def compress(self, grads: Mapping[str, torch.Tensor], epoch: float = 0.0,
                 sequence: int | None = None) -> SeededUpdate:
        """Add ``grads`` to the residual and send it at the round's seeded positions."""
        self.check_gradients(grads)
        sequence = 0 if sequence is None else int(sequence)
        seed = seed_of_round(self.seed, sequence)
        density = self.policy.density_at(epoch)
        out = {}
        for position, (name, g) in enumerate(grads.items()):
            shape = tuple(g.shape)
            v = self.memory.accumulate(name, g.detach().reshape(-1).to(torch.float32))
            k = v.numel() if self.policy.sends_dense(shape) else num_selected(v.numel(), density)
            idx = torch.from_numpy(seeded_indices(seed, position, v.numel(), k))
            values = v[idx].clamp(-65504.0, 65504.0).to(self._dtype) \
                if self._dtype == torch.float16 else v[idx].to(self._dtype)
            self.memory.mark_sent(name, idx, values, False)
            out[name] = SparseTensor(idx, values, shape)
        return SeededUpdate(out, sequence, seed=seed)


class RandomKCodec(Codec):
    """The ``FGCR`` payload (module docstring). ``policy`` (the run's DGC layer configuration)
    fixes the ``k`` a client sends per tensor and round, which :meth:`check` holds it to."""

    kind = "seeded"

    def __init__(self, policy: Any = None) -> None:
        self.policy = policy

    def encode(self, payload: object) -> bytes:
        if not isinstance(payload, SeededUpdate):
            raise TypeError(f"the FGCR payload encodes a SeededUpdate, got "
                            f"{type(payload).__name__}")
        parts = [PREAMBLE.pack(payload.sequence, payload.seed, len(payload.tensors))]
        for position, (name, t) in enumerate(payload.tensors.items()):
            if not torch.equal(t.indices, torch.from_numpy(
                    seeded_indices(payload.seed, position, t.numel, t.nnz))):
                raise ValueError(f"tensor {name!r}: its indices are not the seeded ones")
            parts += [tensor_head(name, t.shape),
                      _TAIL.pack(t.nnz, VALUE_DTYPE_IDS[t.values.dtype]),
                      _raw(t.values)]
        return seal(parts)

    def decode(self, data: bytes, bound: Bound) -> SparsePayload:
        view, (sequence, seed, count), end = open_records(data, PREAMBLE, _MIN_RECORD)
        pos, tensors = PREAMBLE.size, {}
        for position in range(count):
            name, shape, numel, pos = read_tensor_head(view, pos, end, tensors,
                                                       min(MAX_NUMEL, bound.max_numel))
            k, dtype_id = read(_TAIL, view, pos, end, f"header of {name!r}")
            pos += _TAIL.size
            dtype = DTYPES_BY_ID.get(dtype_id)
            if dtype is None:
                raise DecodeError(f"tensor {name!r}: unknown value dtype {dtype_id}")
            if k > numel:
                raise DecodeError(f"tensor {name!r} claims {k} of {numel} entries")
            nbytes = k * torch.tensor([], dtype=dtype).element_size()
            if pos + nbytes > end:
                raise DecodeError(f"truncated input: the values of {name!r} need {nbytes} "
                                  f"bytes at offset {pos}")
            values = torch.frombuffer(bytearray(view[pos:pos + nbytes]), dtype=dtype) \
                if nbytes else torch.empty(0, dtype=dtype)
            pos += nbytes
            if not torch.isfinite(values).all():
                raise DecodeError(f"tensor {name!r} carries NaN or Inf values")
            idx = torch.from_numpy(seeded_indices(seed, position, numel, k))
            tensors[name] = SparseTensor(idx, values, tuple(shape))
        check_end(view, pos, end)
        return SparsePayload(SeededUpdate(tensors, sequence, seed=seed))

    def check(self, payload: SparsePayload, bound: Bound) -> None:  # type: ignore[override]
        update = payload.update
        check_tensors({n: t.shape for n, t in update.tensors.items()}, bound.shapes)
        if self.policy is None or bound.server_round < 1:
            return
        density = self.policy.density_at(float(bound.server_round - 1))
        for name, t in update.tensors.items():
            want = t.numel if self.policy.sends_dense(t.shape) else num_selected(t.numel, density)
            if t.nnz != want:
                raise PayloadError(f"tensor {name!r} carries {t.nnz} entries, random-k sends "
                                   f"{want} of it this round")

    def golden_cases(self) -> list[tuple[str, Any]]:
        def tensor(seed: int, position: int, values: list[float], shape: tuple[int, ...],
                   dtype: torch.dtype) -> SparseTensor:
            numel = int(np.prod(shape))
            idx = torch.from_numpy(seeded_indices(seed, position, numel, len(values)))
            return SparseTensor(idx, torch.tensor(values, dtype=torch.float32).to(dtype), shape)

        seed = 0x0123456789ABCDEF
        return [
            ("empty", SeededUpdate({}, 0, seed=0)),
            ("sparse_and_dense", SeededUpdate({
                "fc.weight": tensor(seed, 0, [0.5, -1.25, 3.0, 7.75], (16, 16), torch.float16),
                "fc.bias": tensor(seed, 1, [1.0, -1.0, 0.25], (3,), torch.float32)}, 7,
                seed=seed)),
            ("largest_seed", SeededUpdate({
                "层.权重": tensor(MAX_U64, 0, [-2.0, 0.125], (4, 5), torch.bfloat16)},
                MAX_U64, seed=MAX_U64)),
        ]


class RandomK(PhoneExport, Method[SparsifierSettings]):
    """Random-k with a shared seed and error feedback (module docstring)."""

    name = "randk"
    order = 25
    family = "shared positions"
    compared = False  # a floor to ask for: compare --methods ...,randk
    description = ("the residual at `density` of positions drawn from a seed, fp16; the seed "
                   "travels, not the indices")
    keeps_residual = True
    settings = SparsifierSettings
    defaults = FOLD_BACK_DEFAULTS
    secure_sum = "seed"  # positions from a seed; under secure aggregation, the run's for all

    def policy(self, train: TrainSettings) -> DGCConfig:
        """DGC's layer policy, density, warm-up and value precision for the run."""
        return layer_config(train, self.own, momentum=0.0, momentum_correction=False,
                            momentum_masking=False, error_feedback=True)

    def compressor(self, train: TrainSettings, client_key: int,
                   material: object = None) -> Compressor:
        return RandomKCompressor(self.policy(train), client_seed(train, client_key))

    def codec(self, train: TrainSettings) -> Codec:
        return RandomKCodec(self.policy(train))

    # -- phones: the seeded positions on the host (android_bridge.phone_codecs), no program
    def phone_config(self, train: TrainSettings) -> DGCConfig:
        """The layer policy, density, warm-up and value precision (:meth:`policy`)."""
        return self.policy(train)

    def phone_task(self, train: TrainSettings, client_key: int) -> dict[str, Any]:
        """randk's host encoder, the ``seeded`` payload and the client's seed, as
        :meth:`compressor` takes it."""
        return {"encoder": self.name, "payload": RandomKCodec.kind,
                "seed": client_seed(train, client_key)}

    def phone_codec(self) -> Codec:
        return RandomKCodec()


def client_seed(train: TrainSettings, client_key: int) -> int:
    """A client's random-k seed: one per client and run (splitmix64, drawing the round's seed
    from it, spreads neighbouring keys apart)."""
    return (int(train.seed) << 32) + int(client_key)


register(RandomK())
